"""A batch a member's forward edits in place (``x.mul_(2)`` on its input), with members run
in turns on that one batch (``backend="loop"``, a ``chunk_size`` below n).

Alone, a member sees the batch as given; run in turns, each member would see the edits of the
members before it. Exact only when one run serves every member. This file keeps the batch
around a run (the self-check's runs, which must not edit it before the step), reads the
versions of the tensors all members share before the turns, and refuses an edit between them
(``EditedInTurns``, which ``_unbatchable.explain_failure`` names the API in).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import optree
import torch
from torch import Tensor

__all__ = [
    "EditedInTurns",
    "Versions",
    "batch_kept",
    "refuse_edited",
    "refuse_edits_in_turns",
    "shared_versions",
]


@contextlib.contextmanager
def batch_kept(*trees: Any) -> Iterator[list[Tensor]]:
    """The batch's tensors put back after the run; yields those it edited (filled at exit).
    A forward that edits its input (``x.mul_(2)``) edits it once in a step, as alone: the
    probe's runs must not edit it before the step (which would see ``4 * x``)."""
    batch: Any = trees
    tensors = {id(t): t for t in optree.tree_leaves(batch) if isinstance(t, Tensor)}
    kept = [  # an inference tensor has no version counter (and cannot be edited here)
        (t, t._version, t.detach().clone()) for t in tensors.values() if not t.is_inference()
    ]
    edited: list[Tensor] = []
    try:
        yield edited
    finally:
        with torch.no_grad():
            for t, version, saved in kept:
                if t._version != version:
                    t.copy_(saved)
                    edited.append(t)


def refuse_edits_in_turns(
    api: str, name: str, backend: str, chunk_size: int | None, n: int
) -> None:
    """A forward that edits a batch tensor all members share (``batch_kept`` saw it) is exact
    only when one run serves every member; in turns, each member sees the edits before it.

    Raises:
        RuntimeError: with ``backend="loop"`` or a ``chunk_size`` below ``n``.
    """
    if backend == "vmap" and (chunk_size or n) >= n:
        return
    how = "backend='loop'" if backend == "loop" else f"chunk_size={chunk_size}"
    raise RuntimeError(_edits_in_turns(api, name, how, "Nothing was changed"))


def _edits_in_turns(api: str, name: str, how: str, tail: str) -> str:
    return (
        f"{api}: the forward or loss of {name} edits a tensor of the batch in place (such as "
        f"x.mul_(2) on its input), and with {how} the members run in turns on that one batch: "
        "each member would see the edits of the members before it, where alone it sees the "
        "batch as given. Copy it before the edit (x = x.clone()), or build the ensemble with "
        "backend='vmap' and no chunk_size (one run for all members edits it once, as one "
        f"member alone does). {tail}"
    )


class EditedInTurns(RuntimeError):
    """What a runner of members in turns raises (``refuse_edited``) before the next turn when
    the turn of members ``first`` to ``last`` edited a batch tensor all members share;
    ``explain_failure`` names the API."""

    def __init__(self, how: str, first: int, last: int) -> None:
        self.how, self.first, self.last = how, first, last
        super().__init__(self.message("Ensemble", "the member"))

    def message(self, api: str, name: str) -> str:
        # No copy of the batch is kept (that would cost a copy per call): the edit stays.
        who = f"member {self.first}"
        if self.last > self.first:
            who = f"the one run of members {self.first} to {self.last} (a chunk)"
        tail = (
            "Refused before the next members ran: nothing else was changed, but the batch was "
            f"edited once, by {who}, as one member alone edits it"
        )
        return _edits_in_turns(api, name, self.how, tail)


#: A tensor all members share and its version before the first turn.
Versions = list[tuple[Tensor, int]]


def shared_versions(
    args: Sequence[Any], in_dims: Sequence[Any], per_member: bool = False
) -> Versions:
    """The version of each tensor of ``args`` that all members share (``in_dims`` None), read
    before members run in turns on them (``refuse_edited``): one ``_version`` read each. With
    ``per_member``, those of the per-member inputs instead (``in_dims`` not None).

    An inference tensor has no version counter; a traced call (torch.compile, torch.export)
    has none to read.
    """
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return []
    return [
        (t, t._version)
        for a, d in zip(args, in_dims, strict=True)
        if (d is None) is not per_member
        for t in optree.tree_leaves(a)
        if isinstance(t, Tensor) and not t.is_inference()
    ]


def refuse_edited(versions: Versions, how: str, first: int, last: int) -> None:
    """Before the next turn: raise ``EditedInTurns`` if a tensor of ``versions`` changed (the
    turn of members ``first`` to ``last`` edited it; ``how``: the setting that runs turns)."""
    for t, version in versions:
        if t._version != version:
            raise EditedInTurns(how, first, last)
