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

__all__ = ["check_state_dict", "copy_rows", "member_state_dict", "select_parts"]


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
        expected = [tuple(_own(p, p[i], i).shape) for p in params]
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
                state[k] = {
                    key: _own(p, v, i) if isinstance(v, Tensor) and v.shape == p.shape[1:] else v
                    for key, v in member.items()
                }
    return {"state": state, "param_groups": groups}


def _own(p: Tensor, row: Tensor, i: int) -> Tensor:
    """Member ``i``'s ``row`` of a tensor shaped like ``p``, cut to the member's own size when
    members of different sizes are padded (``Ensemble.from_factories``)."""
    found = getattr(p, "_member_padding", None)
    return row if found is None else found[0].take(found[1], row, i).clone()


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


def copy_rows(opt: Any, new: Any, rows: Tensor) -> None:
    """Give ``new`` (built over a sub-ensemble's parameters) rows ``rows`` of ``opt``'s state."""
    old = [p for g in opt.param_groups for p in g["params"]]
    fresh = [p for g in new.param_groups for p in g["params"]]
    for p_old, p_new in zip(old, fresh, strict=True):
        if opt.state[p_old]:
            new.state[p_new] = {
                k: v[rows.to(v.device)].clone() for k, v in opt.state[p_old].items()
            }


def check_state_dict(opt: Any, state_dict: dict[str, Any]) -> None:
    """What ``opt.load_state_dict`` checks before loading: known parameters, ``[n, ...]`` state.

    Raises:
        ValueError: state for unknown parameters, or tensors whose leading dim is not n.
    """
    api, n = f"{opt._api}.load_state_dict", opt.num_members
    count = sum(len(g["params"]) for g in opt.param_groups)
    for k, state in dict(state_dict.get("state", {})).items():
        if not isinstance(k, int) or not 0 <= k < count:
            raise ValueError(f"{api}: state for unknown parameter {k!r}")
        for name, v in state.items():
            if isinstance(v, Tensor) and v.dim() > 0 and v.shape[0] != n:
                raise ValueError(
                    f"{api}: `{name}` of parameter {k} has shape {tuple(v.shape)}, expected "
                    f"[n={n}, ...]"
                )
