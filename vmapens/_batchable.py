"""``batchable``: the member's layers that ``vmap`` cannot batch, or batches badly, re-classed.

The ensemble runs its template through :func:`batchable` once, when it is built. Each
replaced layer keeps its parameters, buffers, attributes and ``state_dict`` keys, and
computes the same maths (equal up to float round-off) in ops that ``torch.func.vmap``
batches and ``torch.compile(fullgraph=True)`` traces:

* ``nn.RNN``, ``nn.GRU``, ``nn.LSTM`` and their cells (``_recurrent.py``): ``vmap`` has no
  batching rule for torch's fused recurrent kernels at all.
* ``nn.MultiheadAttention`` (``_mha.py``): self-attention without the copies and the slow
  small-head CPU kernel of torch's own path.
* ``nn.BatchNorm1d/2d/3d`` and ``nn.SyncBatchNorm`` (where it does not sync: no process
  group) with ``momentum=None`` (a cumulative average of the batch statistics): torch turns
  ``num_batches_tracked`` into a Python float for its factor, which ``vmap`` cannot do
  (``.item()``); the twin keeps the factor a tensor, one per member.
  A subclass that keeps torch's ``forward`` gets a twin of its own class (made once per
  class, pickled as one); one with its own ``forward`` gets a twin whose error under
  ``vmap`` names it and says what to do.
* ``nn.Dropout`` on CPU: alone it draws a non-contiguous input's mask in memory order,
  under ``vmap`` in logical order; the twin draws in memory order under both
  (``_layout_twins.py``).
* ``nn.GroupNorm`` on a channels-last input (``_layout_twins.py``): torch's ``group_norm``
  asks the input's layout in a way ``vmap`` refuses; the twin lays it out itself.
* ``nn.LayerNorm`` and ``nn.GroupNorm`` fed an input of another dtype than their weights
  (``_layout_twins.py``): refused or rounded as torch's kernel does alone.
* ``torch.nn.utils.parametrizations.spectral_norm``'s parametrization and the old-style
  ``torch.nn.utils.spectral_norm``'s forward pre-hook (``_spectral.py``): their power
  iteration writes ``u``/``v`` with ``out=``, which ``vmap`` cannot batch; the twins compute
  them out of place and copy them into the buffers.
* ``torch.nn.utils.parametrizations.weight_norm``'s parametrization and the old-style
  ``torch.nn.utils.weight_norm``'s forward pre-hook (``_weight_norm.py``): torch's fused
  ``_weight_norm`` kernel has no batching rule (it ran member after member); the twins write
  its formula in ops ``vmap`` batches.

A parametrized module (``torch.nn.utils.parametrize``: its class is the ``Parametrized<Class>``
torch made, whose properties compute the tensors) is re-classed to a copy of that class over
``<Class>``'s twin: its parametrized tensors take the twin's path (an Embedding's padding row,
a GRU's batched recurrence), and the runner's class is its own, untouched by a
``remove_parametrizations`` on a member.
"""

from __future__ import annotations

import weakref
from typing import Any, SupportsIndex

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import _SpectralNorm, _WeightNorm
from torch.nn.utils.spectral_norm import SpectralNorm

from ._copies import copy_member
from ._encoder_twin import BatchableTransformerEncoder, BatchableTransformerEncoderLayer
from ._layout_twins import (
    BatchableAlphaDropout,
    BatchableDropout,
    BatchableGroupNorm,
    BatchableLayerNorm,
    in_logical_order,
)
from ._mha import BatchableMultiheadAttention
from ._recurrent import (
    BatchableGRU,
    BatchableGRUCell,
    BatchableLSTM,
    BatchableLSTMCell,
    BatchableRNN,
    BatchableRNNCell,
)
from ._spectral import BatchableSpectralNorm, BatchableSpectralNormHook
from ._weight_norm import BatchableWeightNorm, BatchableWeightNormHook, WeightNorm

__all__ = [
    "BatchableAlphaDropout",
    "BatchableDropout",
    "batchable",
    "in_logical_order",
    "own_parametrized_classes_",
    "twin_class",
]


def _cumulative_batch_norm(bn: _BatchNorm, input: Tensor) -> Tensor:
    """``bn(input)`` in training mode with ``momentum=None``, its factor kept a tensor.

    torch's ``_BatchNorm.forward``: ``num_batches_tracked += 1``, then the running statistics
    move by ``1 / num_batches_tracked`` towards the batch mean and unbiased variance, and the
    output is normalised by the batch statistics.
    """
    bn._check_input_dim(input)
    mean_, var_, count = bn.running_mean, bn.running_var, bn.num_batches_tracked
    if mean_ is None or var_ is None or count is None:  # not tracked: torch's own forward
        return _BatchNorm.forward(bn, input)
    count.add_(1)
    out = F.batch_norm(input, None, None, bn.weight, bn.bias, True, 0.0, bn.eps)
    with torch.no_grad():
        # torch's factor is a Python float, its update runs in double (CPU's accscalar_t);
        # the batch statistics in the wider of the input's and the buffers' dtypes.
        factor = count.to(torch.float64).reciprocal()
        x = input.detach().to(torch.promote_types(input.dtype, mean_.dtype))
        var, mean = torch.var_mean(x, [0, *range(2, input.dim())], correction=1)
        for stat, batch in ((mean_, mean), (var_, var)):
            stat.copy_(stat.to(torch.float64) * (1 - factor) + batch.to(torch.float64) * factor)
    return out


class _Cumulative(_BatchNorm):
    """The ``momentum=None`` training forward ``vmap`` batches, before the class's own."""

    def forward(self, input: Tensor) -> Tensor:
        # track_running_stats=False set on a layer that has the buffers: torch's forward
        # neither counts nor updates them (nor calls `.item()`)
        if self.momentum is None and self.training and self.track_running_stats:
            return _cumulative_batch_norm(self, input)
        return super().forward(input)


class BatchableBatchNorm1d(_Cumulative, nn.BatchNorm1d):
    """``nn.BatchNorm1d`` whose ``momentum=None`` training forward ``vmap`` batches."""


class BatchableBatchNorm2d(_Cumulative, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` whose ``momentum=None`` training forward ``vmap`` batches."""


class BatchableBatchNorm3d(_Cumulative, nn.BatchNorm3d):
    """``nn.BatchNorm3d`` whose ``momentum=None`` training forward ``vmap`` batches."""


class _CumulativeSync(_Cumulative):
    """``_Cumulative`` where ``SyncBatchNorm`` computes as ``_BatchNorm`` (no process group:
    torch's own forward falls back to ``F.batch_norm``); torch's forward where it would sync."""

    def forward(self, input: Tensor) -> Tensor:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return nn.SyncBatchNorm.forward(self, input)  # type: ignore[arg-type]
        return super().forward(input)


class BatchableSyncBatchNorm(_CumulativeSync, nn.SyncBatchNorm):
    """``nn.SyncBatchNorm`` whose ``momentum=None`` training forward ``vmap`` batches, where
    it does not sync (``torch.distributed`` not initialized)."""


class _Refused(_BatchNorm):
    """A BatchNorm subclass with its own ``forward``, ``momentum=None``: torch's cumulative
    factor, if that forward reaches it, fails under ``vmap`` with an error that names neither
    the layer nor the setting; this says both, and the ways out."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not (self.momentum is None and self.training):  # no try block for dynamo to trace
            return super().forward(*args, **kwargs)
        try:
            return super().forward(*args, **kwargs)
        except RuntimeError as err:
            if ".item()" not in str(err):
                raise
            name = getattr(self, "_twin_of", type(self)).__name__
            raise RuntimeError(
                f"{name}, a BatchNorm subclass with its own `forward`, has momentum=None (a "
                "cumulative average), whose factor torch computes as a Python float, which vmap "
                "cannot batch; vmapens batches it for BatchNorm classes that keep torch's "
                "`forward` only. Give it a float `momentum`, or build the ensemble with "
                f"backend='loop' ({err})"  # whose words the ensemble's message recognises
            ) from err


class _Twin:
    """What a twin made for a subclass (``_subclass_twin``) pickles and deep-copies as: a new
    class each process, so it is rebuilt from the user's class, found by name as usual."""

    _twin_of: type

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        reduced = super().__reduce_ex__(protocol)  # (copyreg's, (twin,), state, ...)
        return (_rebuilt, (self._twin_of,), *reduced[2:])


#: The twins made for subclasses (BatchNorm's, nn.TransformerEncoder's and its layer's), by the
#: user's class.
_TWINS: dict[type, type[nn.Module]] = {}


def _subclass_twin(cls: type) -> type[nn.Module]:
    """``cls`` with its twin's ``forward`` where it reaches it, one class per ``cls``.

    A subclass of one of ``_CUMULATIVE``: the twin's forward first where ``cls`` keeps torch's
    ``forward``, else ``_Refused``'s. A subclass of ``nn.TransformerEncoder`` or of its layer:
    ``cls`` first, so its own ``forward`` runs and reaches the twin's through ``super()``, as
    it reaches torch's alone (one without runs the twin's)."""
    if cls not in _TWINS:
        if issubclass(cls, nn.TransformerEncoder):
            bases: tuple[type, ...] = (_Twin, cls, BatchableTransformerEncoder)
        elif issubclass(cls, nn.TransformerEncoderLayer):
            bases = (_Twin, cls, BatchableTransformerEncoderLayer)
        else:
            base = next(b for b in cls.__mro__ if b in _CUMULATIVE)
            own = cls.forward is not base.forward  # type: ignore[attr-defined]
            # the named twin's first base holds its forward (``_Cumulative``, ...)
            mixin = _Refused if own else _CUMULATIVE[base].__bases__[0]
            bases = (_Twin, mixin, cls)
        name = f"Batchable{cls.__name__}"
        twin = type(name, bases, {"_twin_of": cls, "__module__": cls.__module__})
        twin.__qualname__ = f"{cls.__qualname__}<batchable>"
        _TWINS[cls] = twin
    return _TWINS[cls]


def _rebuilt(cls: type) -> nn.Module:
    """An empty module of ``cls``'s twin, for pickle to set the state of."""
    twin: type[nn.Module] = _subclass_twin(cls)
    return twin.__new__(twin)


class BatchableEmbedding(nn.Embedding):
    """``nn.Embedding`` whose ``padding_idx`` row gets no gradient under ``vmap`` either.

    vmap's embedding rule for per-member indices (computed from the member's own tensors, or
    per-member data) looks up the members' rows stacked into one table and passes
    ``padding_idx`` on unchanged: member 0's padding row kept its zero gradient, the others'
    got gradients. ``padding_idx`` only holds that row's gradient at zero (its forward value
    is the row as it is), so the twin reads that row detached and looks up without it.
    """

    def forward(self, input: Tensor) -> Tensor:
        if self.padding_idx is None:
            return super().forward(input)
        weight = self.weight
        if self.max_norm is not None:  # F.embedding's own renorm, on the stored weight
            with torch.no_grad():
                torch.embedding_renorm_(weight, input.contiguous(), self.max_norm, self.norm_type)
        rows = torch.arange(self.num_embeddings, device=weight.device).unsqueeze(-1)
        weight = torch.where(rows == self.padding_idx, weight.detach(), weight)
        return F.embedding(
            input, weight, None, None, self.norm_type, self.scale_grad_by_freq, self.sparse
        )


_BATCHABLE: dict[type, type] = {
    nn.Embedding: BatchableEmbedding,
    nn.RNN: BatchableRNN,
    nn.GRU: BatchableGRU,
    nn.LSTM: BatchableLSTM,
    nn.RNNCell: BatchableRNNCell,
    nn.GRUCell: BatchableGRUCell,
    nn.LSTMCell: BatchableLSTMCell,
    nn.MultiheadAttention: BatchableMultiheadAttention,
    nn.Dropout: BatchableDropout,
    nn.AlphaDropout: BatchableAlphaDropout,
    nn.GroupNorm: BatchableGroupNorm,
    nn.LayerNorm: BatchableLayerNorm,
    _SpectralNorm: BatchableSpectralNorm,
    _WeightNorm: BatchableWeightNorm,
}

#: Layers re-classed only with ``momentum=None``: the others batch as they are.
_CUMULATIVE: dict[type, type] = {
    nn.BatchNorm1d: BatchableBatchNorm1d,
    nn.BatchNorm2d: BatchableBatchNorm2d,
    nn.BatchNorm3d: BatchableBatchNorm3d,
    nn.SyncBatchNorm: BatchableSyncBatchNorm,
}

#: Layers whose subclasses get a twin too, with the user's class first (``_subclass_twin``).
_ENCODERS: dict[type, type] = {
    nn.TransformerEncoder: BatchableTransformerEncoder,
    nn.TransformerEncoderLayer: BatchableTransformerEncoderLayer,
}

#: Forward pre-hooks re-classed in place: the module's state_dict hooks hold the same object.
_BATCHABLE_HOOKS: dict[type, type] = {
    SpectralNorm: BatchableSpectralNormHook,
    WeightNorm: BatchableWeightNormHook,
}


#: The runner's own ``Parametrized*`` classes, by the template's class and the twin below it;
#: weak: each ensemble's template has a class of its own (a sweep builds many).
_PARAMETRIZED: weakref.WeakKeyDictionary[type, dict[type, type]] = weakref.WeakKeyDictionary()
_RUNNER_CLASSES: weakref.WeakSet[type] = weakref.WeakSet()


def _plain_twin(module: nn.Module, cls: type) -> type:
    """The twin of ``cls``, ``module``'s class or the one below its parametrization."""
    if getattr(module, "momentum", 0.1) is None and issubclass(cls, tuple(_CUMULATIVE)):
        return _CUMULATIVE.get(cls) or _subclass_twin(cls)
    for torch_cls, twin in _ENCODERS.items():
        if issubclass(cls, torch_cls) and not issubclass(cls, twin):
            # subclasses too: their forward reaches the twin's
            return twin if cls is torch_cls else _subclass_twin(cls)
    return _BATCHABLE.get(cls, cls)


def twin_class(module: nn.Module) -> type:
    """The class ``batchable`` gives ``module``'s copy (``type(module)`` if none).

    A parametrized module's class is the ``Parametrized<Class>`` torch made for it, whose
    properties compute the tensors; its twin is a copy of that class (the same properties) over
    the twin of ``<Class>``: an ``nn.Embedding`` with a parametrized weight needs the padding
    row's fix too. The copy is the runner's own: torch's ``remove_parametrizations`` on a
    member (``ens[i]``, which deep-copies the template and so shares its class) deletes the
    property from that class, which must not take the runner's weight with it.
    """
    cls = type(module)
    # torch's class: the module's own class is its first base (``type_before_parametrizations``)
    if not parametrize.is_parametrized(module) or cls in _RUNNER_CLASSES:
        return _plain_twin(module, cls)
    base = _plain_twin(module, cls.__bases__[0])
    twins = _PARAMETRIZED.setdefault(cls, {})
    if base not in twins:
        twins[base] = _class_copy(cls, base)
        _RUNNER_CLASSES.add(twins[base])
    return twins[base]


def _class_copy(cls: type, base: type) -> type:
    """A new class with ``cls``'s name and namespace (a ``Parametrized*`` class's properties)
    over ``base``."""
    body = {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")}
    copied = type(cls.__name__, (base,), body)
    copied.__qualname__ = cls.__qualname__
    return copied


def own_parametrized_classes_(module: nn.Module) -> nn.Module:
    """``module`` with each parametrized submodule given a ``Parametrized*`` class of its own.

    torch's deep copy of a parametrized module keeps its class, and ``remove_parametrizations``
    deletes the property from that class: on one copy, it takes the tensor from every other
    copy. A module built alone has its own class; a member (``ens[i]``, a deep copy of the
    template) needs one too.
    """
    for sub in module.modules():
        cls = type(sub)
        if parametrize.is_parametrized(sub):
            sub.__class__ = _class_copy(cls, cls.__bases__[0])
    return module


def batchable(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` whose recurrent and attention layers ``vmap`` batches well.

    Every submodule (the root included) whose type is exactly ``nn.RNN``, ``nn.GRU``,
    ``nn.LSTM``, ``nn.RNNCell``, ``nn.GRUCell``, ``nn.LSTMCell``, ``nn.MultiheadAttention``
    or ``nn.Dropout`` is re-classed to the matching ``Batchable*`` class: same
    attributes, parameter names and ``state_dict`` keys, same maths. The recurrent twins
    support all flags (layers, bidirectional, batch_first, bias, dropout, nonlinearity,
    proj_size, unbatched input, given states); the attention twin takes its own path for
    plain self-attention and runs torch's ``forward`` for everything else. Subclasses of
    those types are left alone, since their own ``forward`` may differ. Also re-classed: an
    ``nn.BatchNorm1d/2d/3d`` or ``nn.SyncBatchNorm`` with ``momentum=None``, or a subclass
    of one that keeps torch's ``forward``, to a twin that computes torch's cumulative
    average with a tensor factor (a subclass with its own ``forward``, to one that says why
    vmap fails on it), and
    ``spectral_norm``'s ``_SpectralNorm`` parametrization and old-style
    ``nn.utils.spectral_norm``'s ``SpectralNorm`` forward pre-hook, to ones whose power
    iteration writes their buffers with ``copy_``. A parametrized submodule is re-classed to
    a copy of its ``Parametrized*`` class over its own class's twin (``twin_class``).
    ``module`` itself is not changed; it may live on ``meta``.

    Args:
        module: the member module (any device, ``meta`` included).

    Returns:
        The converted deep copy (an equal deep copy if there was nothing to convert).

    Raises:
        TypeError: ``module`` is not an ``nn.Module``. The converted recurrent layers raise
            TypeError on ``PackedSequence`` inputs, which they cannot batch.

    Example:
        >>> import torch
        >>> from torch.func import functional_call, stack_module_state, vmap
        >>> grus = [nn.GRU(3, 5) for _ in range(4)]
        >>> params, _ = stack_module_state(grus)
        >>> template = batchable(grus[0]).to("meta")
        >>> run = vmap(lambda p, x: functional_call(template, p, (x,)), in_dims=(0, None))
        >>> out, h_n = run(params, torch.randn(7, 2, 3))
        >>> tuple(out.shape), tuple(h_n.shape)
        ((4, 7, 2, 5), (4, 1, 2, 5))
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"batchable: `module` must be a torch.nn.Module, got {type(module).__name__}"
        )
    clone = copy_member(module)
    for sub in clone.modules():
        if twin_class(sub) is not type(sub):
            sub.__class__ = twin_class(sub)
        for hook in sub._forward_pre_hooks.values():
            target = _BATCHABLE_HOOKS.get(type(hook))
            if target is not None:
                hook.__class__ = target
    return clone
