"""Which layer of a padded member first computes something else than the member alone.

The self-check compares what a whole member computes; when members of different sizes
differ, the user needs the layer: the one whose padded output first disagrees (in its own
corner) with the output of the same layer in the member run alone, or, when a layer's input
is the first to disagree, the module whose ``forward`` computed that input in code of its own
(a functional op between two layers). Both run one member, no ``vmap``, under forward hooks
on private copies of the modules, without gradients: first in eval mode (no dropout draws),
then, when every layer agrees there, in the member's own modes from one RNG state: a random
layer (dropout) draws over the padded shape, so a padded member's draws are not the ones it
makes alone, and only this second run can name that layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optree
import torch
from torch import Tensor, nn
from torch.func import functional_call

from ._checks import tolerance
from ._copies import copy_member

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
        ``"`name` (Class)"`` (followed by why, for a layer that differs only by its random
        draws), or None when every layer agrees or a layer could not be compared (shapes
        that are not a padded corner of each other).

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
    found = _first(alone, runner, state, args, train=False)
    if found is None and any(m.training for m in alone.modules()):
        found = _first(alone, runner, state, args, train=True)
        if found is not None and _draws(alone.get_submodule(found)):
            return f"{_named(alone, found)}, which draws random numbers over the padded shape: {RANDOM}"
    return None if found is None else _named(alone, found)


#: Why a random layer differs, and the way out (``first_padded_difference``).
RANDOM = (
    "a padded member draws other numbers than alone (from the same distribution; pass "
    "check=False to train so)"
)


def _first(
    alone: nn.Module, runner: nn.Module, state: Mapping[str, Tensor], args: tuple, train: bool
) -> str | None:
    """The name of the first layer that differs in eval mode, or in the modules' own modes
    (``train``), each run from the caller's RNG state (which it leaves as is)."""
    alone, runner = copy_member(alone), copy_member(runner)
    if not train:
        alone.eval()
        runner.eval()
    devices = [t.device for t in state.values() if t.device.type == "cuda"][:1]
    with torch.no_grad():
        with torch.random.fork_rng(devices=devices):
            order, seen_alone = _record(alone, lambda: alone(*args))
        with torch.random.fork_rng(devices=devices):
            _, seen_padded = _record(runner, lambda: functional_call(runner, dict(state), args))
    for key in order:
        (blamed, a), p = seen_alone[key], seen_padded.get(key, (None, None))[1]
        if p is None or a.dim() != p.dim() or any(x > y for x, y in zip(a.shape, p.shape)):
            continue
        corner = p[tuple(slice(0, k) for k in a.shape)]
        if not a.is_floating_point():
            if not torch.equal(a, corner):
                return blamed
            continue
        scale = float(a.abs().max()) if a.numel() else 0.0
        tol = tolerance(a.dtype) * scale
        if a.numel() and float((a - corner.to(a.dtype)).abs().max()) > tol:
            return blamed
    return None


def _draws(module: nn.Module) -> bool:
    """Whether ``module`` holds a layer that draws random numbers in training mode."""
    dropout = nn.modules.dropout._DropoutNd
    return any(
        isinstance(m, dropout) or isinstance(m, nn.RNNBase) and m.dropout > 0
        for m in module.modules()
    )


#: A recorded tensor: (the submodule's name, "in" or "out").
Key = tuple[str, str]


def _record(module: nn.Module, run: Any) -> tuple[list[Key], dict[Key, tuple[str, Tensor]]]:
    """Run ``run()`` with hooks on every submodule: each one's first input and output tensor,
    in the order they were seen, with the layer to blame when it differs.

    An output that differs first is its module's doing; an input that differs first (every
    output before it agreed) was computed by the module whose ``forward`` called this one,
    in code of its own (``h - h.mean(-1)`` between two layers).
    """
    order: list[Key] = []
    seen: dict[Key, tuple[str, Tensor]] = {}
    calls: list[str] = []  # the modules whose forward is running, innermost last
    handles = []

    def note(key: Key, blamed: str, tree: Any) -> None:
        leaves = [t for t in optree.tree_leaves(tree) if isinstance(t, Tensor)]
        if leaves and key not in seen:
            order.append(key)
            seen[key] = (blamed, leaves[0].detach())

    for name, sub in module.named_modules():

        def enter(_: nn.Module, args: Any, name: str = name) -> None:
            if calls:  # the outermost module's inputs are the member's own
                note((name, "in"), calls[-1], args)
            calls.append(name)

        def leave(_: nn.Module, __: Any, out: Any, name: str = name) -> None:
            calls.pop()
            note((name, "out"), name, out)

        handles += [sub.register_forward_pre_hook(enter), sub.register_forward_hook(leave)]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return order, seen


def _named(module: nn.Module, name: str) -> str:
    sub = module.get_submodule(name)
    return f"`{name}` ({type(sub).__name__})" if name else f"the {type(sub).__name__} itself"
