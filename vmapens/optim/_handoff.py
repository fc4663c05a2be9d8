"""Handing members over: one member's state for the plain torch optimizer, sub-ensembles.

Free functions over a :class:`~vmapens.optim.StackedOptimizer` (which calls them from its
``member_state_dict`` and ``select``); they read its ``param_groups``, ``state``,
``hyperparameters`` and ``member_state``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from .._checks import index_rows
from ._hyper import params_of, pick_group

__all__ = ["member_state_dict", "select_parts"]


def member_state_dict(opt: Any, i: int, module: nn.Module | None = None) -> dict[str, Any]:
    """``opt.member_state_dict(i, module)``: see :meth:`StackedOptimizer.member_state_dict`."""
    api = f"{opt._api}.member_state_dict"
    n = opt.num_members
    if not -n <= i < n:
        raise IndexError(f"{api}: `i`={i} out of range for n={n}")
    i %= n
    params = [p for g in opt.param_groups for p in g["params"]]
    if module is not None:
        shapes = [tuple(p.shape) for p in module.parameters()]
        expected = [tuple(p.shape[1:]) for p in params]
        if shapes != expected:
            raise ValueError(
                f"{api}: `module` parameters do not match the stacked ones; got shapes "
                f"{shapes}, expected {expected} (same order)"
            )
    groups, state, start = [], {}, 0
    for group in opt.param_groups:
        ids = list(range(start, start + len(group["params"])))
        start += len(ids)
        groups.append({**pick_group(group, opt.hyperparameters, [i]), "params": ids})
        for k, p in zip(ids, group["params"], strict=True):
            member = opt.member_state(opt.state[p], group, i) if opt.state[p] else {}
            if member:
                state[k] = member
    return {"state": state, "param_groups": groups}


def select_parts(
    opt: Any, index: Any, params: Any
) -> tuple[Tensor, list[dict[str, Any]], dict[str, Any]]:
    """What a sub-ensemble's optimizer is built from: its rows, param groups and defaults.

    Raises:
        ValueError: ``params`` does not match the optimizer's parameters.
    """
    rows = index_rows(f"{opt._api}.select", index, opt.num_members)
    new_params = params_of(params)
    old = [p for g in opt.param_groups for p in g["params"]]
    shapes = [tuple(p.shape[1:]) for p in new_params]
    if shapes != [tuple(p.shape[1:]) for p in old]:
        raise ValueError(
            f"{opt._api}.select: `params` do not match this optimizer's parameters "
            f"(member shapes {shapes})"
        )
    picked = rows.tolist()
    groups, start = [], 0
    for group in opt.param_groups:
        size = len(group["params"])
        picks = pick_group(group, opt.hyperparameters, picked)
        groups.append({**picks, "params": new_params[start : start + size]})
        start += size
    return rows, groups, pick_group(opt.defaults, opt.hyperparameters, picked)
