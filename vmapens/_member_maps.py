"""The ensemble's member maps, one per backend: ``fn`` over every member's state and slices,
in one ``vmap`` (chunk after chunk with ``chunk_size``) or member after member (``"loop"``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch
from torch import nn

from ._batch_edits import shared_versions
from ._buffer_turns import Slices, Turns
from ._chunks import Draws, in_order, in_turns, uncache, uncached, vmap_in_turns
from ._fastcall import forget_writes, no_random_ops, vmap_members
from ._kept import KeptTurns
from ._linalg_failure import FAILED_MEMBER
from ._member_reach import watch
from ._precision import autocast_members

__all__ = ["looped", "vmapped"]


def looped(
    n: int, randomness: str, fn: Callable[..., Any], in_dims: tuple, runner: nn.Module
) -> Callable:
    """The loop backend: ``fn`` once per member on its slices, outputs stacked; a random op
    raises with ``randomness="error"``, as under vmap. Members run in turns on the inputs
    they share: a member that edits one in place is refused before the next one runs. Once
    a member edited a buffer in place, the next ones get copies of theirs (``Turns``). Each
    member starts from the plain values ``runner`` (the module ``fn`` runs) held before the
    call (``_plain_turns``), and with its own row of each tensor the forwards kept, stacked
    there (``KeptTurns``). A backward notes which members' rows of each stacked parameter it
    reached (``_member_reach``): alone, a member that never read one leaves its ``.grad``
    None."""

    def looped(stacked: dict[str, torch.Tensor], *args: Any) -> Any:
        forget_writes()
        state = stacked
        shared = shared_versions(args, in_dims) if n > 1 else []
        turns, slices = Turns(state, n > 1), Slices(args, in_dims, n > 1)
        outputs, kept = [], KeptTurns(runner, n)  # each member its own row of a kept stack
        members = ((i, i + 1) for i in range(n))
        try:
            same = randomness == "same"
            for i, _ in in_order(members, shared, "backend='loop'", same, runner, args):
                member_args = slices.take(i)
                uncache()  # member i - 1's parametrized tensors: cached by module, not by member
                kept.take(i)
                # Cut with grad on: a row cut from a stacked parameter under no_grad reports
                # requires_grad but is no node of the graph, so a forward that differentiates
                # w.r.t. its own weight inside `torch.enable_grad()` failed where alone it runs.
                with torch.enable_grad():
                    state = turns.take(i)
                with no_random_ops(randomness == "error"):
                    try:
                        outputs.append(fn(state, *member_args))
                    except torch.linalg.LinAlgError as err:
                        setattr(err, FAILED_MEMBER, i)  # the message names the member
                        raise
                if n > 1 and torch.is_grad_enabled():  # after: an in-place edit of a row
                    watch(stacked, state, i, n)  # (max_norm) gives it a new autograd node
                turns.give_back(i)
                slices.give_back()
        finally:
            kept.end()
        uncache()
        return optree.tree_map(lambda *xs: torch.stack(xs), *outputs)

    return looped


def vmapped(
    n: int,
    randomness: str,
    chunk_size: int | None,
    fn: Callable,
    in_dims: tuple,
    runner: nn.Module,
) -> Callable:
    """The vmap backend: ``fn`` batched over the members' stacked state, outputs stacked.
    With chunks in turns, each starts from the plain values ``runner`` (the module ``fn``
    runs) held before the call (``_plain_turns``)."""

    def batched(state: dict[str, torch.Tensor], *args: Any) -> Any:
        # torch.autocast would cast vmap's decompositions, not the member's own ops.
        device = next(iter(state.values()), torch.empty(0)).device.type
        member = autocast_members(fn, device)
        forget_writes()

        mapped = member if state else lambda _, *a: member({}, *a)
        mapped = uncached(mapped) if chunk_size is not None else mapped  # a chunk's own
        if not state:  # a member without tensors (nn.Dropout): give vmap a dim to map
            state = {"": torch.empty(n, 0)}
        # The chunked step (_chunks.py) hands over one chunk's rows at a time: no re-chunking.
        rows = next(iter(state.values())).shape[0]
        size = None if chunk_size is not None and rows <= chunk_size else chunk_size
        # Chunks in turns: run here where a chunk may edit a buffer or its own input slices
        # that a backward needs (later chunks get copies), else by torch.func.
        turns = Turns(state) if size is not None else None
        mine = any(d is not None for d in in_dims)
        if size is not None and not (turns and (turns.active or turns.backward and mine)):
            draws = Draws(args, runner) if randomness == "same" else None
            versions = shared_versions(args, in_dims)
            mapped, turns = in_turns(mapped, versions, size, runner, draws), None
        uncache()  # another module's, cached under the id a member's module has now
        try:
            if turns is not None and size is not None:
                return vmap_in_turns(mapped, randomness, turns, args, in_dims, size, runner)
            return vmap_members(mapped, rows, randomness, state, args, in_dims, size)
        finally:
            uncache()  # batched tensors, dead outside vmap

    return batched
