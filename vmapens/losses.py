"""Per-member losses: one value per member, whose sum trains each member as if alone."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.func import vmap

__all__ = ["per_member"]


def per_member(loss_fn: Callable[..., torch.Tensor], in_dims: Any = (0, None)) -> Callable:
    """Wrap a loss so it returns one value per member, shape ``[n]``.

    The ensemble's training loss is the *sum* of these: the gradient of the sum with respect
    to member ``i``'s parameters is exactly the gradient of member ``i``'s own loss, so every
    member trains as it would alone. A mean would scale each member's gradient by ``1/n``.

    Args:
        loss_fn: ``(output, target) -> scalar``, e.g. ``nn.BCELoss()`` or a function.
        in_dims: as in ``torch.func.vmap``; the default ``(0, None)`` maps the stacked output
            and shares the target. Use ``(0, 0)`` for per-member targets.

    Returns:
        ``(output, target) -> Tensor[n]``.

    Example:
        >>> from torch import nn
        >>> loss = per_member(nn.MSELoss())(torch.zeros(4, 8, 1), torch.ones(8, 1))
        >>> loss.shape
        torch.Size([4])
    """
    if not callable(loss_fn):
        raise TypeError(f"per_member: `loss_fn` must be callable, got {type(loss_fn).__name__}")
    return vmap(loss_fn, in_dims=in_dims)
