"""make_step's readings of its arguments as torch users pass them: clip bounds and targets."""

from __future__ import annotations

from typing import Any

import optree
import torch

__all__ = ["check_targets", "clip_bound"]


def clip_bound(api: str, name: str, bound: Any) -> float | None:
    """A ``clip_grad_norm`` / ``clip_grad_value`` bound as a float (None: no clipping).

    ``torch.nn.utils.clip_grad_norm_`` and ``clip_grad_value_`` take a 0-d tensor as well as a
    number (``max_norm=torch.tensor(1.0)``); it is read once, when the step is built.

    Raises:
        TypeError: not a number or a 0-d real tensor.
        ValueError: not > 0.
    """
    if bound is None:
        return None
    if isinstance(bound, torch.Tensor) and bound.dim() == 0:
        if bound.is_complex() or bound.dtype == torch.bool:
            raise TypeError(f"{api}: `{name}` must be a real number, got a {bound.dtype} tensor")
        bound = bound.item()
    if isinstance(bound, bool) or not isinstance(bound, (int, float)):
        got = (
            f"a tensor of shape {list(bound.shape)}"
            if isinstance(bound, torch.Tensor)
            else (type(bound).__name__)
        )
        raise TypeError(f"{api}: `{name}` must be a float (or a 0-d tensor), got {got}")
    if not bound > 0:
        raise ValueError(f"{api}: `{name}` must be > 0, got {bound}")
    return float(bound)


def check_targets(targets: Any) -> None:
    """``targets``: one tensor, or a tuple, list or dict of them (nested), as a ``loss_fn``
    that takes several targets is called in plain torch (``loss_fn(out, (y, w))``); each
    member's ``loss_fn`` gets the same structure (its rows of each, with ``in_dims=0``).

    Raises:
        TypeError: anything else, or a structure with no tensor in it.
    """
    if isinstance(targets, torch.Tensor):
        return
    structured = isinstance(targets, (tuple, list, dict))
    leaves = optree.tree_leaves(targets, none_is_leaf=True) if structured else [targets]
    bad = [leaf for leaf in leaves if not isinstance(leaf, torch.Tensor)]
    if bad or not leaves:
        got = type(targets).__name__
        if structured:
            got = f"a {got} holding {type(bad[0]).__name__}" if bad else f"an empty {got}"
        raise TypeError(
            f"step: `targets` must be a tensor or a tuple, list or dict of tensors, got {got}"
        )
