"""What an eager one-node recurrence needs besides its maths (``_lstm_fused`` today).

Such a node is a ``torch.autograd.Function`` that runs a whole layer direction on the
stacked ``[n, ...]`` tensors, with its backward through time written out. This file holds
when such a node may run at all (:func:`usable`), the ``vmap`` rule that hands it the stacked
tensors (:func:`member_first`), and the gradient of its gradient, which differentiates the
layer's per-step loop instead (:func:`twice`).

This file imports only torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
from torch.autograd.forward_ad import unpack_dual

__all__ = ["flat", "member_first", "order", "twice", "usable"]

_VMAP = torch._C._functorch.TransformType.Vmap
_DTYPES = (torch.float32, torch.float64)


def usable(tensors: Sequence[Tensor | None]) -> bool:
    """Whether a node may run on ``tensors``: where it is known to equal the per-step loop.

    That is eager (not traced by dynamo or export), under ``vmap`` alone or no functorch
    transform, float32/float64 on one device, no autocast, no ``TorchFunctionMode`` (vmapens's
    per-member autocast is one) and no forward-mode AD.
    """
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return False
    if torch._C._is_torch_function_mode_enabled():
        return False
    if any(level.key() != _VMAP for level in retrieve_all_functorch_interpreters()):
        return False
    present = [t for t in tensors if t is not None]
    dtype, device = present[0].dtype, present[0].device
    if _autocast(device.type):
        return False
    if dtype not in _DTYPES or any(t.dtype != dtype or t.device != device for t in present):
        return False
    return all(unpack_dual(t).tangent is None for t in present)  # no forward-mode AD


def _autocast(device_type: str) -> bool:
    """Whether autocast is on for the tensors' device: the loop runs its casts there."""
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type without autocast (meta, ...)
        return False


def member_first(
    apply: Callable[..., Any], info: Any, in_dims: tuple, tensors: int, args: tuple
) -> Any:
    """A node's ``vmap`` rule: ``apply`` on the first ``tensors`` arguments with the mapped dim
    first (shared ones expanded), the rest as they are; every output mapped along dim 0."""

    def moved(t: Tensor | None, dim: int | None) -> Tensor | None:
        if t is None:
            return None
        return t.expand(info.batch_size, *t.shape) if dim is None else t.movedim(dim, 0)

    stacked = [moved(t, d) for t, d in zip(args[:tensors], in_dims[:tensors], strict=True)]
    outs = apply(*stacked, *args[tensors:])
    return outs, (0,) * len(outs)


def flat(t: Tensor, rank: int) -> Tensor:
    """``t`` with its leading (member) dims as one: ``[m, *core]``, ``m = 1`` without any."""
    return t.reshape(-1, *t.shape[t.dim() - rank :])


def order(steps: int, reverse: bool) -> list[int]:
    """The time steps in the order a direction runs them."""
    return list(range(steps - 1, -1, -1)) if reverse else list(range(steps))


def twice(
    loop: Callable[..., tuple[Tensor, ...]],
    need: Sequence[bool],
    inputs: tuple[Tensor | None, ...],
    reverse: bool,
    grads_out: Sequence[Tensor | None],
) -> tuple[Tensor | None, ...]:
    """A node's backward as a graph (``create_graph=True``): ``loop(*inputs, reverse)``, the
    same maths in differentiable ops, recomputed and differentiated.

    Returns:
        One gradient per input (None where ``need`` is False or no output depends on it).
    """
    wanted = [t for t, n in zip(inputs, need, strict=True) if n and t is not None]
    with torch.enable_grad():
        results = loop(*inputs, reverse)
        outs = [(t, d) for t, d in zip(results, grads_out, strict=True) if d is not None]
        if not outs or not wanted:
            return (None,) * len(inputs)
        found = torch.autograd.grad(
            [t for t, _ in outs], wanted, [d for _, d in outs], create_graph=True, allow_unused=True
        )
    grads = iter(found)
    return tuple(next(grads) if n and t is not None else None for t, n in zip(inputs, need))
