"""Which layer of a padded member first computes something else than the member alone.

The self-check compares what a whole member computes; when members of different sizes
differ, the user needs the layer: the one whose padded output first disagrees (in its own
corner) with the output of the same layer in the member run alone. Both run one member, no
``vmap``, under forward hooks on private copies of the modules, in eval mode (no dropout
draws, which differ with the padded shapes) and without gradients.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import optree
import torch
from torch import Tensor, nn
from torch.func import functional_call

from ._checks import tolerance

__all__ = ["first_padded_difference"]


def first_padded_difference(
    alone: nn.Module, runner: nn.Module, state: Mapping[str, Tensor], args: tuple
) -> str | None:
    """The name of the first layer (in the order layers run alone) whose output differs.

    Args:
        alone: the member at its own size (a module of the user's class).
        runner: the ensemble's module at the largest size (meta device is fine).
        state: the member's padded parameters (already masked) and buffers, no member dim.
        args: the member's inputs.

    Returns:
        ``"`name` (Class)"``, or None when every layer agrees or a layer could not be
        compared (shapes that are not a padded corner of each other).

    Example:
        >>> small, big = nn.Linear(3, 2), nn.Linear(3, 4)
        >>> state = {k: torch.cat([v, torch.zeros_like(v)]) for k, v in small.state_dict().items()}
        >>> first_padded_difference(small, big, state, (torch.randn(5, 3),)) is None
        True
        >>> first_padded_difference(nn.Softmax(-1), nn.Softmax(-1), {}, (torch.randn(5, 3),))
        >>> soft = nn.Sequential(small, nn.Softmax(-1))  # over the padded width
        >>> state = {f"0.{k}": v for k, v in state.items()}
        >>> first_padded_difference(soft, nn.Sequential(big, nn.Softmax(-1)), state, (torch.randn(5, 3),))
        '`1` (Softmax)'
    """
    alone, runner = copy.deepcopy(alone).eval(), copy.deepcopy(runner).eval()
    with torch.no_grad():
        order, outs_alone = _record(alone, lambda: alone(*args))
        _, outs_padded = _record(runner, lambda: functional_call(runner, dict(state), args))
    for name in order:
        a, p = outs_alone[name], outs_padded.get(name)
        if p is None or a.dim() != p.dim() or any(x > y for x, y in zip(a.shape, p.shape)):
            continue
        corner = p[tuple(slice(0, k) for k in a.shape)]
        if not a.is_floating_point():
            if not torch.equal(a, corner):
                return _named(alone, name)
            continue
        scale = float(a.abs().max()) if a.numel() else 0.0
        tol = tolerance(a.dtype) * scale
        if a.numel() and float((a - corner.to(a.dtype)).abs().max()) > tol:
            return _named(alone, name)
    return None


def _record(module: nn.Module, run: Any) -> tuple[list[str], dict[str, Tensor]]:
    """Run ``run()`` with a hook on every submodule; each one's first output tensor by name."""
    order: list[str] = []
    outs: dict[str, Tensor] = {}
    handles = []
    for name, sub in module.named_modules():

        def hook(_: nn.Module, __: Any, out: Any, name: str = name) -> None:
            leaves = [t for t in optree.tree_leaves(out) if isinstance(t, Tensor)]
            if leaves and name not in outs:
                order.append(name)
                outs[name] = leaves[0].detach()

        handles.append(sub.register_forward_hook(hook))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return order, outs


def _named(module: nn.Module, name: str) -> str:
    sub = module.get_submodule(name)
    return f"`{name}` ({type(sub).__name__})" if name else f"the {type(sub).__name__} itself"
