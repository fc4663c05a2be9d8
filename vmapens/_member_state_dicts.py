"""Each member's own state dict, cut from the stacked storage: what ``ens[i].state_dict()``
gives, detached copies under the member's keys (a tied alias shares its tensor's copy, as in
``module.state_dict()``), at the member's own size where members differ in size, with the
member's ``_metadata``."""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["member_state_dicts"]


def member_state_dicts(
    persistent: Mapping[str, torch.Tensor],
    state_keys: Mapping[str, str],
    n: int,
    padding: Any,
    metadata: Mapping[str, Any] | None,
) -> list[dict[str, torch.Tensor]]:
    """One state dict per member (``StackedModule.state_dicts``).

    Args:
        persistent: the stacked tensors a state dict holds, by stacked name.
        state_keys: member state-dict key -> stacked name, in the member's order.
        n: the number of members.
        padding: the ensemble's ``vmapens._padding.Padding``, or None (one size).
        metadata: the member's own state dict's ``_metadata``, or None.
    """
    sds: list[dict[str, torch.Tensor]] = []
    for i in range(n):
        # `module.state_dict()`'s type, with its `_metadata` (each submodule's `_version`):
        # without it BatchNorm's loader reads a state dict as version 1.
        sd: OrderedDict[str, torch.Tensor] = OrderedDict()
        rows: dict[str, torch.Tensor] = {}
        for key, name in state_keys.items():
            if name not in rows:  # one copy per tensor: a tied alias shares it, as alone
                row = persistent[name][i]
                own = row if padding is None else padding.take(name, row, i)
                rows[name] = own.detach().clone()
            sd[key] = rows[name].detach()
        if metadata is not None:
            sd._metadata = copy.deepcopy(metadata)  # type: ignore[attr-defined]
        sds.append(sd)
    return sds
