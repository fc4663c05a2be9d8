"""Where a sub-ensemble's parameters were cut from: ``CUT_FROM``, kept by ``Ensemble.select``.

``StackedOptimizer.select`` matches an optimizer's parameters to a sub-ensemble's by name, not
by order (``vmapens.optim._handoff``): each parameter of ``ens.select(rows)`` records the
parent's tensor it was cut from and the rows, and the record follows it when ``.to()`` or a
dtype cast makes new Parameters.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["CUT_FROM", "follow_cuts", "record_cuts"]

#: A ``select``-ed parameter -> (a weak reference to the parent's tensor it was cut from, the
#: rows), so that ``StackedOptimizer.select`` matches an optimizer's parameters by name, not by
#: order. Keyed by identity (a tensor's ``==`` is elementwise); keeps neither tensor alive.
CUT_FROM: WeakIdKeyDictionary = WeakIdKeyDictionary()


def record_cuts(
    parent: Mapping[str, torch.Tensor], sub: Mapping[str, torch.Tensor], rows: tuple[int, ...]
) -> None:
    """Each of ``sub``'s parameters was cut from ``parent``'s of the same name, rows ``rows``."""
    for name, p in sub.items():
        CUT_FROM[p] = (weakref.ref(parent[name]), rows)


def follow_cuts(
    before: Iterable[torch.Tensor | None], after: Iterable[torch.Tensor | None]
) -> None:
    """New Parameters (``after``) keep the records of the ones they replace (``before``)."""
    for p, q in zip(before, after, strict=True):
        if p in CUT_FROM:  # select's record follows the new Parameters
            CUT_FROM[q] = CUT_FROM[p]
