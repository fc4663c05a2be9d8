"""Members of different sizes: each member's tensors inside storage padded to the largest.

A width sweep (``hidden`` 16, 32, 64) cannot share one ``[n, ...]`` tensor per parameter as
it is. Padded, it can: every member's tensor sits in the leading corner of a tensor of the
largest member's shape, the rest zero. The member map multiplies every parameter by its 0/1
mask before the forward, so padded entries contribute exact zeros to every sum, their
gradients are exactly zero, and an elementwise optimizer leaves them at zero: each member
computes what it computes alone at its own size, up to the order of the sums.

Recurrent weights are the one layout that is not a corner: ``weight_ih``/``weight_hh`` and
their biases stack the gates (GRU: r, z, n; LSTM: i, f, g, o) along dim 0, so each gate's
block is padded on its own (``gates`` below).

What cannot be padded exactly is refused by layer when the ensemble is built (``check_pair``):
a normalisation over a padded dimension (LayerNorm, GroupNorm, RMSNorm) would count the
padded zeros in its statistics, attention splits the padded width into heads, and so on. A
forward that mixes padded entries by itself (``x.mean(-1)`` over a padded width, a reshape)
is caught by the self-check that ``make_step`` and ``vmapens.check`` run on every size.

This file imports only torch, ``_checks``, ``_members`` and ``_padding_parts``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor

from ._checks import is_int
from ._copies import copy_member
from ._members import Names, class_name, class_of, named_tensors, own_settings
from ._padding_parts import largest

__all__ = ["Padding", "check_pair", "gates_of", "largest", "masked", "setting_advice"]

#: Layer attributes that may differ between members of one padded ensemble: the sizes the
#: padding covers. Any other attribute of a torch layer must be equal in all members.
SIZES: dict[type, tuple[str, ...]] = {
    nn.Linear: ("in_features", "out_features"),
    nn.Bilinear: ("in1_features", "in2_features", "out_features"),
    nn.Conv1d: ("in_channels", "out_channels"),
    nn.Conv2d: ("in_channels", "out_channels"),
    nn.Conv3d: ("in_channels", "out_channels"),
    # weight [in, out, *kernel]: a corner as well; groups are refused in check_pair.
    nn.ConvTranspose1d: ("in_channels", "out_channels"),
    nn.ConvTranspose2d: ("in_channels", "out_channels"),
    nn.ConvTranspose3d: ("in_channels", "out_channels"),
    nn.BatchNorm1d: ("num_features",),
    nn.BatchNorm2d: ("num_features",),
    nn.BatchNorm3d: ("num_features",),
    nn.SyncBatchNorm: ("num_features",),  # BatchNorm without a process group
    nn.InstanceNorm1d: ("num_features",),  # each channel over its own positions: 0 - 0 = 0
    nn.InstanceNorm2d: ("num_features",),
    nn.InstanceNorm3d: ("num_features",),
    nn.PReLU: ("num_parameters",),  # one slope per channel, elementwise
    nn.Embedding: ("embedding_dim",),
    nn.EmbeddingBag: ("embedding_dim",),  # sums, means or maxes over a bag, never over dims
    nn.RNNBase: ("input_size", "hidden_size"),
    nn.RNNCellBase: ("input_size", "hidden_size"),
}

#: Why a layer cannot have a padded size, by the attribute that differs.
REFUSED: dict[tuple[type, str], str] = {
    (nn.LayerNorm, "normalized_shape"): "normalises over the padded dimension: the padded "
    "zeros would enter its mean and variance",
    (nn.GroupNorm, "num_channels"): "normalises over groups of channels: the padded channels "
    "would enter the groups' statistics",
    (nn.RMSNorm, "normalized_shape"): "normalises over the padded dimension: the padded "
    "zeros would enter its mean square",
    (nn.MultiheadAttention, "embed_dim"): "splits the padded width into heads and takes a "
    "softmax over it",
    (nn.Embedding, "num_embeddings"): "an index beyond a smaller member's rows would read "
    "padded zeros where that member alone raises IndexError",
}

_GATES = {"GRU": 3, "LSTM": 4}
_CELL_GATES: dict[type, int] = {nn.GRUCell: 3, nn.LSTMCell: 4}
_GATED = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")


def gates_of(module: nn.Module) -> dict[str, int]:
    """``{tensor name: gate count}`` for the recurrent tensors that stack gates along dim 0.

    Example:
        >>> gates_of(nn.Sequential(nn.GRU(3, 8), nn.Linear(8, 1)))["0.weight_hh_l0"]
        3
    """
    found = {}
    for prefix, sub in module.named_modules():
        count = _GATES.get(sub.mode, 1) if isinstance(sub, nn.RNNBase) else 1
        # isinstance, not type(): a subclass of nn.GRUCell stacks its gates the same way.
        count = next((c for cls, c in _CELL_GATES.items() if isinstance(sub, cls)), count)
        if count == 1:  # a plain RNN's single block is a corner like any other
            continue
        for name, _ in sub.named_parameters(recurse=False):
            if name.startswith(_GATED):
                found[f"{prefix}.{name}" if prefix else name] = count
    return found


def _sizes_of(module: nn.Module) -> tuple[str, ...]:
    for cls in type(module).__mro__:
        if cls in SIZES:
            return SIZES[cls]
    return ()


def check_pair(
    api: str, template: nn.Module, member: nn.Module, i: int, padded: bool = True
) -> None:
    """Raise ValueError unless ``member`` can run as ``template`` (with padded tensors).

    Both must have the same submodules by name and class, and equal settings (a dropout
    rate, an activation, ``eps``: one forward runs every member with ``template``'s). With
    ``padded``, the sizes the padding covers may differ (``SIZES``; an int attribute of your
    own module classes, such as a ``hidden`` width, or a tuple of them, too: the self-check
    confirms it on the first step).

    Example:
        >>> check_pair("Ensemble", nn.Linear(3, 8), nn.Linear(3, 4), 1)
        >>> check_pair("Ensemble", nn.LayerNorm(8), nn.LayerNorm(4), 1)
        Traceback (most recent call last):
        ...
        ValueError: Ensemble: members 1 and 0 cannot be padded to one size: LayerNorm normalises over the padded dimension: the padded zeros would enter its mean and variance (normalized_shape (4,) vs (8,)); give every member the same normalized_shape
    """
    ours, theirs = dict(template.named_modules()), dict(member.named_modules())
    names = Names(template), Names(member)
    for path in [*ours, *(p for p in theirs if p not in ours)]:
        kinds = [class_name(class_of(m[path])) if path in m else "none" for m in (theirs, ours)]
        if kinds[0] != kinds[1] or path not in ours or path not in theirs:
            raise ValueError(
                f"{api}: member {i} has another structure than member 0 at `{path}` "
                f"({' vs '.join(kinds)}): members of different sizes must have the same layers, "
                "only narrower or wider"
            )
        ref, other = ours[path], theirs[path]
        shapes = [[t.shape for _, t in named_tensors(m)] for m in (ref, other)]
        if isinstance(class_of(ref), tuple) and shapes[0] != shapes[1]:
            raise ValueError(
                f"{api}: members {i} and 0 cannot be padded to one size: `{path}` "
                f"({type(ref).__name__}) computes its parametrized tensors from padded ones (a "
                "norm over padded zeros divides by zero); give every member the same size there"
            )
        mine, yours = own_settings(ref, names[0]), own_settings(other, names[1])
        allowed = _sizes_of(ref)
        torch_layer = type(ref).__module__.startswith("torch.")
        for key in sorted(set(mine) | set(yours)):
            a, b = mine.get(key), yours.get(key)
            if _same(a, b):
                continue
            where = f"`{path}` ({type(ref).__name__})" if path else type(ref).__name__
            if padded and _hook_tensor(ref, key):  # torch.nn.utils.weight_norm and the like
                raise ValueError(
                    f"{api}: members {i} and 0 cannot be padded to one size: {where} computes "
                    f"`{key}` from padded tensors in a forward pre-hook (a norm over padded "
                    "zeros divides by zero); give every member the same size there"
                )
            for (cls, attr), reason in REFUSED.items():
                if isinstance(ref, cls) and attr == key:
                    raise ValueError(
                        f"{api}: members {i} and 0 cannot be padded to one size: "
                        f"{where} {reason} ({key} {b} vs {a}); give every member the same {key}"
                    )
            sized = padded and (key in allowed or (not torch_layer and _sizes_alike(a, b)))
            if not sized:
                raise ValueError(
                    f"{api}: member {i} differs from member 0 at {where}: `{key}` is "
                    f"{b!r} vs {a!r}; members of one ensemble share everything but their "
                    f"sizes, and {setting_advice(key, a)}"
                )
        if isinstance(ref, nn.RNNBase) and _size_differs(ref, other, ("hidden_size",)):
            for key in ("bidirectional", "proj_size"):
                if getattr(ref, key):
                    raise ValueError(
                        f"{api}: member {i} cannot be padded: `{path}` ({type(ref).__name__}) "
                        f"with {key}={getattr(ref, key)} lays the hidden units out in blocks "
                        "the padding does not follow; give every member the same hidden_size"
                    )
        renorms = isinstance(ref, (nn.Embedding, nn.EmbeddingBag)) and ref.max_norm is not None
        if renorms and _size_differs(ref, other, ("embedding_dim",)):
            raise ValueError(
                f"{api}: member {i} cannot be padded: `{path}` ({type(ref).__name__}) with max_norm="
                f"{ref.max_norm} renormalises its weight in place in the forward, which a "
                "padded member does to a masked copy, not to its weight; give every member "
                "the same embedding_dim"
            )
        conv = isinstance(ref, nn.modules.conv._ConvNd)
        if conv and ref.groups != 1 and _size_differs(ref, other, ("in_channels", "out_channels")):
            raise ValueError(
                f"{api}: member {i} cannot be padded: `{path}` ({type(ref).__name__}) "
                f"with groups={ref.groups} mixes padded channels into the groups; give "
                "every member the same channels"
            )


def setting_advice(key: str, value: Any, first: int = 0) -> str:
    """What to do about a setting (``_members.own_settings``) that differs between members."""
    if isinstance(getattr(value, "raw", None), Tensor):
        return (
            f"only parameters and buffers are stacked, every member runs with member {first}'s "
            f"`{key}`: register it as a buffer (self.register_buffer({key!r}, ...)) so that "
            "each member keeps its own"
        )
    return (
        f"one forward runs every member with member {first}'s settings: give every member the "
        "same value, or pass a per-member hyperparameter another way (a buffer the forward "
        "reads, or one ensemble per value)"
    )


def _same(a: Any, b: Any) -> bool:
    # Values without one truth value (arrays, tensors in a list) are not ours to judge.
    try:
        return bool(a == b)
    except Exception:
        return True


def _hook_tensor(module: nn.Module, key: str) -> bool:
    """Whether a forward pre-hook of ``module`` sets its attribute ``key`` before every call
    (``weight_norm``, ``spectral_norm``), as ``_members.own_settings`` finds them."""
    hooks = module._forward_pre_hooks.values()
    return any(key in (getattr(h, "name", 0), getattr(h, "_tensor_name", 0)) for h in hooks)


def _sizes_alike(a: Any, b: Any) -> bool:
    """Whether settings ``a`` and ``b`` of a user's class may be sizes: two ints, or two
    tuples (lists) of one length that differ only in ints (``self.hidden = (64, 32)``)."""
    if is_int(a) and is_int(b):
        return True
    if type(a) is not type(b) or not isinstance(a, (tuple, list)) or len(a) != len(b):
        return False
    return all(_same(x, y) or (is_int(x) and is_int(y)) for x, y in zip(a, b, strict=True))


def _size_differs(a: nn.Module, b: nn.Module, keys: Sequence[str]) -> bool:
    return any(getattr(a, k) != getattr(b, k) for k in keys)


def corner(t: Tensor, shape: Sequence[int], gates: int = 1) -> Tensor:
    """The view of padded ``t`` (one member, no member dim) that holds a ``shape`` tensor.

    With ``gates > 1`` dim 0 holds that many equal blocks, each padded on its own; the view
    then has shape ``(gates, shape[0] // gates, *shape[1:])``.

    Example:
        >>> corner(torch.arange(6).reshape(6, 1), (4, 1), gates=2).flatten().tolist()
        [0, 1, 3, 4]
    """
    if gates == 1:
        return t[tuple(slice(0, k) for k in shape)]
    blocks = t.unflatten(0, (gates, t.shape[0] // gates))
    index = (slice(None), slice(0, shape[0] // gates), *(slice(0, k) for k in shape[1:]))
    return blocks[index]


class Padding:
    """Where each member's tensors sit in an ensemble's padded storage.

    Members come in kinds (one per distinct set of shapes); ``kind_of[row]`` is the kind of the
    ensemble's row ``row``, ``templates[k]`` that kind's module on the meta device (the user's
    class at its own size: what ``ens[i]`` returns and the self-check runs alone).

    Args:
        templates: one meta module per kind.
        kind_of: the kind of every row.
        full: the padded shape of every tensor (the largest member's).
        gates: from :func:`gates_of`.
    """

    def __init__(
        self,
        templates: Sequence[nn.Module],
        kind_of: Sequence[int],
        full: Mapping[str, tuple[int, ...]],
        gates: Mapping[str, int],
    ) -> None:
        self.templates, self.kind_of = list(templates), tuple(kind_of)
        self.full, self.gates = dict(full), dict(gates)
        self.shapes = [
            {name: tuple(t.shape) for name, t in named_tensors(m)} for m in self.templates
        ]
        self.padded = {
            name for name, shape in self.full.items() if any(s[name] != shape for s in self.shapes)
        }
        self._masks: dict[tuple[str, torch.device, torch.dtype], Tensor] = {}

    def shape(self, name: str, row: int) -> tuple[int, ...]:
        """Row ``row``'s own shape of tensor ``name``."""
        return self.shapes[self.kind_of[row]][name]

    def take(self, name: str, padded: Tensor, row: int) -> Tensor:
        """Row ``row``'s tensor ``name`` at its own shape, from its padded row ``padded``."""
        shape = self.shape(name, row)
        return corner(padded, shape, self.gates.get(name, 1)).reshape(shape)

    def put_(self, name: str, padded: Tensor, value: Tensor, row: int) -> None:
        """Write ``value`` (row ``row``'s own shape) into its padded row ``padded``."""
        view = corner(padded, value.shape, self.gates.get(name, 1))
        view.copy_(value.reshape(view.shape))

    def rows_of_kinds(self) -> list[int]:
        """The first row of every kind present, in row order: the members the probe runs."""
        first: dict[int, int] = {}
        for row, kind in enumerate(self.kind_of):
            first.setdefault(kind, row)
        return sorted(first.values())

    def masks(self, params: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``{name: [n, *full]}`` 1 where a row's own entries are, 0 where it is padded.

        Only tensors that some row pads get a mask. Masks are built by :meth:`prepare` for
        the storage as it is; one for another device or dtype is built here, and kept only
        when it is a real tensor (not one of ``torch.export``'s fake tensors).
        """
        found: dict[str, Tensor] = {}
        for name, p in params.items():
            if name not in self.padded:
                continue
            key = (name, p.device, p.dtype)
            mask = self._masks.get(key)
            if mask is None:
                mask = self._mask(name, p)
                if not isinstance(mask, FakeTensor):
                    self._masks[key] = mask
            found[name] = mask
        return found

    def prepare(self, params: Mapping[str, Tensor]) -> None:
        """Build the masks of ``params`` as they are now (after ``.to()``, ``.double()``)."""
        self._masks = {
            (name, p.device, p.dtype): self._mask(name, p)
            for name, p in params.items()
            if name in self.padded
        }

    def _mask(self, name: str, like: Tensor) -> Tensor:
        rows = len(self.kind_of)
        mask = torch.zeros(rows, *self.full[name], dtype=like.dtype, device=like.device)
        for row in range(rows):
            corner(mask[row], self.shape(name, row), self.gates.get(name, 1)).fill_(1)
        return mask

    def member_map(
        self,
        lift: Callable[[Callable[..., Any], tuple], Callable[..., Any]],
        fn: Callable[..., Any],
        in_dims: tuple,
        params: set[str],
    ) -> Callable[..., Any]:
        """``Ensemble._member_map`` of ``fn`` for padded members: each parameter in
        ``params`` enters ``fn`` multiplied by its mask.

        ``x * 1`` is ``x`` and ``x * 0`` is ``0`` exactly: padded entries add exact zeros to
        every sum and get zero gradients. ``lift(fn, in_dims)`` batches a function as the
        ensemble does (vmap or loop); the masks are one more mapped argument.
        """

        def member(state: dict[str, Tensor], masks: dict[str, Tensor], *args: Any) -> Any:
            return fn(masked(state, masks), *args)

        lifted = lift(member, (0, *in_dims))

        def run(state: dict[str, Tensor], *args: Any, rows: slice | None = None) -> Any:
            masks = self.masks({k: v for k, v in state.items() if k in params})
            if rows is not None:  # a chunk of members (vmapens._chunks)
                masks = {k: m[rows] for k, m in masks.items()}
            out = lifted(state, masks, *args)
            self._rezero({k: v for k, v in state.items() if k not in params}, rows)
            return out

        return run

    def _rezero(self, buffers: Mapping[str, Tensor], rows: slice | None) -> None:
        """Zero again the padded entries of ``buffers`` after a forward.

        A padded BatchNorm channel sees a padded unit's activation (``sigmoid(0) = 0.5``),
        so its running mean drifts from 0: harmless to the forward (the next weights are
        masked), but the ensemble's own state dict then held non-zero padded entries, which
        ``load_state_dict`` (and ``vmapens.load``) refused as another ensemble's members.
        vmap's in-place updates leave no version to tell an updated buffer by, so every
        padded buffer is masked: a row's own entries are multiplied by 1, unchanged. Through
        ``.data``: autograd saved the buffer (BatchNorm's backward keeps it) and must not see
        a new version; its padded entries reach no member's output or gradient.
        """
        padded = {
            name: buf
            for name, buf in buffers.items()
            if name in self.padded and buf.dtype != torch.bool and not isinstance(buf, FakeTensor)
        }
        for name, mask in self.masks(padded).items():
            buf = padded[name]
            mask = mask if rows is None else mask[rows]
            if torch.compiler.is_compiling():  # functionalised: the graph keeps the old value
                with torch.no_grad():
                    buf.mul_(mask)
            else:
                buf.data.mul_(mask)

    def select(self, rows: Sequence[int]) -> Padding:
        """The padding of the sub-ensemble of ``rows`` (same kinds, same full shapes; its own
        copies of the meta templates, whose train/eval mode is the sub-ensemble's)."""
        templates = [copy_member(t) for t in self.templates]
        return Padding(templates, [self.kind_of[r] for r in rows], self.full, self.gates)

    def describe(self) -> dict[str, Any]:
        """What a checkpoint records: every kind's shapes and every row's kind."""
        return {
            "shapes": [{k: list(v) for k, v in s.items()} for s in self.shapes],
            "kind_of": list(self.kind_of),
        }


def masked(state: Mapping[str, Tensor], masks: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``state`` with each tensor that has a mask multiplied by it (see ``Padding.masks``)."""
    return {k: v * masks[k] if k in masks else v for k, v in state.items()}
