"""Plain values a forward sets on the module the members run, when the members run in turns.

A member's parameters and buffers are stacked per member; a plain value the forward keeps on
its module (a Python counter ``self.calls += 1``, a first-call flag) lives once, on the module
all members run. One run for all members sets it once per call, as each member alone would.
Run in turns (``backend="loop"``, ``chunk_size`` below ``n``), member ``i`` read what member
``i - 1`` left there: a counter advanced ``n`` times per call, and a warm-up on it
(``if self.calls > 2: h = h.tanh()``) ended early for every member, silently. So every turn
after the first starts from the plain values the modules held before the call
(``PlainTurns.next_turn``), and after the call the modules keep the values the last turn left
(one value serves every member: members alone all hold the same counter).

The same holds for a tensor the forward sets there (a positional table cached by
``if self.pe is None or self.pe.shape[0] < t``, built with ``self.fc.weight.new_zeros``):
with ``chunk_size`` a later chunk read the table an earlier chunk rebuilt, batched over that
chunk's members, and returned as many rows as it had (4 outputs for 3 members, member 2
trained on twice its gradient), silently. A turn after the first starts from the tensors the
modules held before the call too (``turn_value``).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import nn

from ._boxes import LARGE, box_leaves, edited, is_box, put_back, snapshot

__all__ = ["INTERNAL", "PlainTurns", "plain_turns", "plain_value", "turn_value"]

#: ``nn.Module``'s own entries in a module's ``__dict__``, and ``nn.RNNBase``'s views of its
#: weights (kept per module object; functional_call writes them in place).
INTERNAL = frozenset(nn.Module().__dict__) | {
    "_flat_weights",
    "_flat_weights_names",
    "_all_weights",
    "_flat_weight_refs",
}


def plain_value(value: object) -> bool:
    """A value a member can take as its own: no tensor, module or callable, which the
    members share or which hold other members' rows."""
    if type(value) is tuple:
        return all(map(plain_value, value))
    return type(value) in (bool, int, float, str, type(None))


def turn_value(value: Any) -> bool:
    """A value every turn of a call starts from as the call found it: a plain value, a
    tensor the forward keeps on a module (parameters and buffers are not in ``__dict__``), or
    a dict, list or tuple of them (a cache edited in place, ``self.acts.append(h)``)."""
    if is_box(value):  # a large one (a vocabulary) is no state a call keeps: as it is
        return len(value) <= LARGE and all(map(turn_value, box_leaves(value)))
    return plain_value(value) or isinstance(value, torch.Tensor)


class PlainTurns:
    """The plain values of ``runner``'s modules before a call whose members run in turns.

    Args:
        runner: the module the members run.
    """

    def __init__(self, runner: nn.Module) -> None:
        self.dicts = [vars(m) for m in runner.modules()]
        self.before = [
            {k: v for k, v in d.items() if k not in INTERNAL and turn_value(v)} for d in self.dicts
        ]
        # Flat, for ``next_turn``'s two C-level passes: nothing set, added or deleted.
        self.owned = [d for d, before in zip(self.dicts, self.before, strict=True) for _ in before]
        self.keys = [k for before in self.before for k in before]
        self.values = [v for before in self.before for v in before.values()]
        self.sizes = list(map(len, self.dicts))
        # Mutable containers, by their contents: a turn edits one in place (``self.cache["k"] =
        # k``); put back in place, so modules that share one share it still.
        self.boxes = [shot for v in self.values if (shot := snapshot(v)) is not None]
        self.turns = 0

    def next_turn(self) -> None:
        """Before each turn: after the first, every module's plain values as before the call,
        and a plain value the turns before added removed (``hasattr`` reads as alone)."""
        self.turns += 1
        if self.turns == 1 or (
            list(map(len, self.dicts)) == self.sizes
            and all(map(operator.is_, map(dict.get, self.owned, self.keys), self.values))
            and not any(map(edited, self.boxes))
        ):
            return
        for d, before in zip(self.dicts, self.before, strict=True):
            for k in d.keys() - INTERNAL - before.keys():
                if turn_value(d[k]):
                    del d[k]
            d.update(before)
        put_back(self.boxes)  # the ones the call found, their items as they were


def plain_turns(runner: nn.Module | None) -> PlainTurns | None:
    """``PlainTurns(runner)``, or None without a runner or while torch.compile or torch.export
    traces (the compiled step's chunks are torch.func's, inside its graph, as before)."""
    if runner is None or torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return None
    return PlainTurns(runner)
