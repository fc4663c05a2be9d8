"""The values the turns of one call kept on their modules, stacked ``[n, ...]``.

One turn runs the whole ensemble under vmap, a chunk of members, or one member
(``backend="loop"``); each notes what its forward kept (``vmapens._kept.KeptSlots``). After
the call their rows become one value per name, a row per member, in the turns' form: the
batched tensors of a vmapped turn unwrapped (dead outside it, their graph intact), a tensor
made without the members' tensors one row per member.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch._C._functorch import (
    get_unwrapped,
    is_batchedtensor,
    is_functorch_wrapped_tensor,
    is_gradtrackingtensor,
    maybe_current_level,
    maybe_get_bdim,
    maybe_get_level,
)

from ._boxes import KEPT_MARK, form, plain_leaves, rebuilt, tensor_leaves

__all__ = ["dead", "revived", "stack_turns", "turn_rows"]


def turn_rows(state: dict[str, torch.Tensor]) -> int:
    """How many members a turn runs: one (loop), or a chunk's (vmap: the batched state's)."""
    t = next(iter(state.values()), None)
    if t is None or not is_batchedtensor(t):
        return 1
    return get_unwrapped(t).shape[maybe_get_bdim(t)]


def _rows(t: torch.Tensor, rows: int) -> torch.Tensor | None:
    """A turn's kept tensor as ``[rows, ...]``: a batched one (dead after the call) unwrapped,
    with its graph; one the members share (made without their tensors), one per member. Read
    after the ensemble's vmap ended, inside a torch.func transform of the caller's own (a vmap
    over data sets, a grad in the input) or none: a tensor wrapped by that one is alive, and
    each member's value there (dropped until session 48: the template kept a stale value)."""
    if is_batchedtensor(t) and not _alive(t):  # batched by the ensemble's vmap
        value = get_unwrapped(t)
        return None if dead(value) else value.movedim(maybe_get_bdim(t), 0)
    return None if dead(t) else t.expand(rows, *t.shape)


def _alive(t: torch.Tensor) -> bool:
    """Whether functorch-wrapped ``t`` belongs to a transform still running."""
    current = maybe_current_level()
    return current is not None and maybe_get_level(t) <= current


def revived(value: Any) -> Any:
    """``value`` (a kept stack) with each tensor that a grad transform of the caller's own
    wrapped (``torch.func.grad`` in the input around ``ens(x)``) unwrapped once that transform
    has ended, marked as the stack was: alone such a tensor computes as what it wraps.
    ``value`` itself where there is none, or where an ended ``vmap`` wrapped one (dead:
    ``_kept._stacked_rows`` hands it out no more)."""
    leaves = tensor_leaves(value)
    if not leaves or not any(dead(t) for t in leaves):
        return value
    out = []
    for t in leaves:
        while dead(t) and is_gradtrackingtensor(t):
            t = get_unwrapped(t)
        out.append(t)
    if any(dead(t) for t in out):
        return value
    for t in out:
        setattr(t, KEPT_MARK, True)
    return rebuilt(value, out)


def dead(t: torch.Tensor) -> bool:
    """Whether ``t`` is wrapped by a transform that has ended (one inside the forward)."""
    return is_functorch_wrapped_tensor(t) and not _alive(t)


def _stacked(values: list[Any], name: str) -> Any:
    """The turns' values of one name as one, ``[n, ...]`` (in each turn's form), or None:
    a turn without it, or turns that kept different forms, shapes, dtypes or devices. Turns
    that kept different plain values beside the tensors (``{"h": h, "scale": 0.5}``, each
    member alone its own) are refused: one value cannot be every member's."""
    forms = {
        (form(v), *((p.shape[1:], p.dtype, p.device) for p in tensor_leaves(v) or ()))
        for v in values
    }
    if any(v is None for v in values) or len(forms) != 1:
        return None
    if len({plain_leaves(v) for v in values}) != 1:
        path, _, key = name.rpartition(":")
        raise ValueError(
            f"Ensemble: the forward keeps `{key}` on {path or 'the module'} with plain values "
            f"that differ between members ({plain_leaves(values[0])}, "
            f"{plain_leaves(values[-1])}): one cannot be every member's; keep it as a tensor"
        )
    columns = zip(*[tensor_leaves(v) or [] for v in values], strict=True)
    return rebuilt(values[0], [ps[0] if len(ps) == 1 else torch.cat(ps) for ps in columns])


def stack_turns(turns: Sequence[tuple[int, dict[str, Any]]], n: int) -> dict[str, Any]:
    """What the turns that kept tensors (``(members, kept)`` each) kept, ``[n, ...]``: the
    names every turn set, in one form, shape, dtype and device (others are left as they are)."""
    if sum(rows for rows, _ in turns) != n:  # a turn kept nothing
        return {}
    stacked, made = {}, {}  # names that held one value each turn hold one stack
    for name in turns[0][1]:
        values = [kept.get(name) for _, kept in turns]
        key = tuple(map(id, values))
        if key not in made:
            made[key] = _stacked([_turn_rows(v, r) for v, (r, _) in zip(values, turns)], name)
        if made[key] is not None:
            stacked[name] = made[key]
    return stacked


def _turn_rows(value: Any, rows: int) -> Any:
    """``_rows`` of each tensor of a turn's kept value, in its form; None if one has none."""
    if value is None:
        return None
    parts = [_rows(t, rows) for t in tensor_leaves(value) or ()]
    return None if any(p is None for p in parts) else rebuilt(value, parts)
