"""Optimizer state that follows its parameters: made at the first step, moved when they move.

torch's optimizers make a parameter's state at its first step. A stacked optimizer's state
also follows the parameters afterwards (``opt = StackedAdam(ens); ens.double()`` steps in
float64): each state tensor takes its parameter's dtype and device, and the per-member
counters keep torch's scalar dtype (:func:`~vmapens.optim._buckets.counter_dtype`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from ._buckets import counter_dtype
from ._kinds import initial

__all__ = ["fill_state"]


def fill_state(
    params: list[Tensor],
    states: Mapping[Tensor, dict[str, Any]],
    starts: dict[str, float],
    names: tuple[str, ...],
    n: int,
    make: Callable[[str, Tensor, dict[str, Any]], Tensor],
    args: Callable[[torch.device], dict[str, Any]],
) -> bool:
    """Make the missing state of a param group's ``params`` and move what no longer matches;
    whether all of it matches now (a parameter without a gradient keeps its state's dtype).

    Args:
        params: the group's stacked parameters ``[n, ...]``.
        states: the optimizer's ``state`` (parameter -> its state dict), filled in place.
        starts: the per-member ``[n]`` counters (name -> starting value), ``step`` first.
        names: the state tensors shaped like the parameter.
        n: the number of members.
        make: ``make(name, param, group)``: state ``name`` before the first step
            (``StackedOptimizer.initial_state``; a complex ``param`` makes it on its real view).
        args: ``args(device)``: the group as the rule reads it, on ``device``.
    """
    # New state shares one step count per group: the rule then runs once for all.
    if not params:  # an empty param group (torch keeps one) has no state to make
        return True
    complete = True
    device = params[0].device
    fresh: dict[tuple[str, torch.dtype], Tensor] = {}
    for p in params:
        state = states[p]
        # Counters keep the dtype their `step` was created in (torch's load_state_dict
        # keeps `step` as it is and casts the others to the param's dtype).
        dtype = counter_dtype(state.get("step"))
        for key, start in starts.items():
            t = state.get(key)
            if t is None:
                full = torch.full((n,), start, dtype=dtype)
                new = fresh.setdefault((key, dtype), full.to(device))
                state[key] = new if new.device == p.device else new.to(p.device)
            elif t.device != p.device or t.dtype != dtype:
                state[key] = t.to(dtype=dtype, device=p.device)
        for key in names:
            t = state.get(key)
            if t is None:
                state[key] = initial(make, key, p, args(p.device))
            elif t.device != p.device or (t.dtype != p.dtype and p.grad is not None):
                # A parameter without a gradient keeps its state as it is until one that
                # steps it: torch.optim alone never touches it (a frozen layer's float32
                # momentum was rounded to float16 by a step while the ensemble was half).
                dtype = p.dtype if p.grad is not None else t.dtype
                state[key] = t.to(dtype=dtype, device=p.device)
            if state[key].dtype != p.dtype:
                complete = False
    return complete
