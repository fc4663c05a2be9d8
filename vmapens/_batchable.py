"""``batchable``: the member's layers that ``vmap`` cannot batch, or batches badly, re-classed.

The ensemble runs its template through :func:`batchable` once, when it is built. Each
replaced layer keeps its parameters, buffers, attributes and ``state_dict`` keys, and
computes the same maths (equal up to float round-off) in ops that ``torch.func.vmap``
batches and ``torch.compile(fullgraph=True)`` traces:

* ``nn.RNN``, ``nn.GRU``, ``nn.LSTM`` and their cells (``_recurrent.py``): ``vmap`` has no
  batching rule for torch's fused recurrent kernels at all.
* ``nn.MultiheadAttention`` (``_mha.py``): self-attention without the copies and the slow
  small-head CPU kernel of torch's own path.
"""

from __future__ import annotations

import copy

from torch import nn

from ._mha import BatchableMultiheadAttention
from ._recurrent import (
    BatchableGRU,
    BatchableGRUCell,
    BatchableLSTM,
    BatchableLSTMCell,
    BatchableRNN,
    BatchableRNNCell,
)

__all__ = ["batchable"]

_BATCHABLE: dict[type, type] = {
    nn.RNN: BatchableRNN,
    nn.GRU: BatchableGRU,
    nn.LSTM: BatchableLSTM,
    nn.RNNCell: BatchableRNNCell,
    nn.GRUCell: BatchableGRUCell,
    nn.LSTMCell: BatchableLSTMCell,
    nn.MultiheadAttention: BatchableMultiheadAttention,
}


def batchable(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` whose recurrent and attention layers ``vmap`` batches well.

    Every submodule (the root included) whose type is exactly ``nn.RNN``, ``nn.GRU``,
    ``nn.LSTM``, ``nn.RNNCell``, ``nn.GRUCell``, ``nn.LSTMCell`` or
    ``nn.MultiheadAttention`` is re-classed to the matching ``Batchable*`` class: same
    attributes, parameter names and ``state_dict`` keys, same maths. The recurrent twins
    support all flags (layers, bidirectional, batch_first, bias, dropout, nonlinearity,
    proj_size, unbatched input, given states); the attention twin takes its own path for
    plain self-attention and runs torch's ``forward`` for everything else. Subclasses of
    those types are left alone, since their own ``forward`` may differ. ``module`` itself
    is not changed; it may live on ``meta``.

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
    clone = copy.deepcopy(module)
    for sub in clone.modules():
        target = _BATCHABLE.get(type(sub))
        if target is not None:
            sub.__class__ = target
    return clone
