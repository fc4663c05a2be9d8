"""What ``Ensemble`` does to its members' modules: build member ``i`` from the stacked storage,
and set ``requires_grad`` on the stacked parameters and the template together."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ._members import named_tensors
from ._padding import Padding
from ._stacking import recompute_

__all__ = ["member_module", "set_flags_"]


def member_module(
    template: nn.Module, stacked: dict[str, torch.Tensor], padding: Padding | None, i: int
) -> nn.Module:
    """Member ``i`` as a module of the user's class: a deep copy of its (meta) ``template`` with
    row ``i`` of every stacked tensor (at its own size when ``padding``), cloned."""
    memo: dict[int, Any] = {}
    with torch.no_grad():
        for name, meta in named_tensors(template):
            row = stacked[name][i]
            value = (row if padding is None else padding.take(name, row, i)).clone()
            if isinstance(meta, nn.Parameter):
                value = nn.Parameter(value, requires_grad=meta.requires_grad)
            memo[id(meta)] = value
    member = copy.deepcopy(template, memo)
    recompute_(member)
    return member


def set_flags_(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], flag: bool) -> None:
    """``requires_grad_(flag)`` on both tensors of each ``(stacked, template)`` pair: the two
    sides agree at once, whether or not the template's parameters are linked to the stacked ones
    yet (``_stacking.follow_flags``)."""
    for p, meta in pairs:
        if p.requires_grad != flag:
            p.requires_grad_(flag)
        if meta.requires_grad != flag:
            meta.requires_grad_(flag)
