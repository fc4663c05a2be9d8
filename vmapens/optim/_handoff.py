"""Handing members over: one member's state for the plain torch optimizer, sub-ensembles.

Free functions over a :class:`~vmapens.optim.StackedOptimizer` (which calls them from its
``member_state_dict`` and ``select``); they read its ``param_groups``, ``state``,
``hyperparameters`` and ``member_state``.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import Tensor, nn

from .._checks import index_rows
from ._hyper import FREE_ON_LOAD, IMPLEMENTATION, group_args, params_of, pick_group

__all__ = ["check_state_dict", "copy_rows", "member_state_dict", "select_parts"]


def member_state_dict(opt: Any, i: int, module: nn.Module | None = None) -> dict[str, Any]:
    """``opt.member_state_dict(i, module)``: see :meth:`StackedOptimizer.member_state_dict`."""
    api = f"{opt._api}.member_state_dict"
    n = opt.num_members
    if isinstance(i, bool) or not hasattr(i, "__index__"):  # int, numpy int, 0-d int tensor
        raise TypeError(f"{api}: `i` must be an int, got {type(i).__name__}")
    i = operator.index(i)
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
            member = opt.member_state(opt.state[p], group, i) if opt.state.get(p) else {}
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
        if opt.state.get(p_old):
            new.state[p_new] = {
                k: v[rows.to(v.device)].clone() for k, v in opt.state[p_old].items()
            }


def check_state_dict(opt: Any, state_dict: Any) -> None:
    """What ``opt.load_state_dict`` checks before anything changes: the param groups (their
    count and sizes, every hyperparameter and flag of ``opt``'s, valid as the constructor
    checks them) and the state (known parameters, per-member counters ``[n]``, tensors shaped
    as ``opt`` makes them).

    Raises:
        ValueError: a state dict that does not fit ``opt`` (another optimizer's, say).
        TypeError: a hyperparameter of the wrong type.
    """
    api = f"{opt._api}.load_state_dict"
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys():
        raise ValueError(
            f"{api}: `state_dict` must be a dict with `state` and `param_groups`, as "
            f"state_dict() returns, got {type(state_dict).__name__} "
            f"{sorted(state_dict) if isinstance(state_dict, dict) else ''}"
        )
    saved = list(state_dict["param_groups"])
    sizes = [len(g["params"]) for g in opt.param_groups]
    if [len(g.get("params", ())) for g in saved] != sizes:
        raise ValueError(
            f"{api}: the state dict's param groups hold "
            f"{[len(g.get('params', ())) for g in saved]} parameters, this optimizer's {sizes}"
        )
    needed = [k for k in opt.defaults if k not in IMPLEMENTATION]  # hyperparameters, flags
    options, where = [], {}
    for j, group in enumerate(saved):
        missing = [k for k in needed if k not in group]
        if missing:
            others = sorted(k for k in group if k not in opt.defaults and k != "params")
            raise ValueError(
                f"{api}: param group {j} has no {', '.join(f'`{k}`' for k in missing)}: "
                f"not a state dict of {opt._api} (it has {others or 'no others'})"
            )
        checked = {k: v for k, v in group.items() if k != "params"}
        try:
            opt._normalise(checked, FREE_ON_LOAD)
        except (TypeError, ValueError) as e:
            why = str(e).removeprefix(f"{opt._api}: ")
            raise type(e)(f"{api}: param group {j}: {why}") from e
        options.append(checked)
        where.update({k: j for k in group["params"]})
    params = [p for g in opt.param_groups for p in g["params"]]
    ids = dict(zip([k for g in saved for k in g["params"]], range(len(params)), strict=True))
    for k, state in dict(state_dict["state"]).items():
        if k not in ids:
            raise ValueError(f"{api}: state for unknown parameter {k!r}")
        _check_state(opt, api, k, state, params[ids[k]], options[where[k]])


def _check_state(
    opt: Any, api: str, k: Any, state: dict[str, Any], p: Tensor, options: dict[str, Any]
) -> None:
    """Parameter ``k``'s state: counters ``[n]`` tensors, the rest as ``opt`` makes it (the
    shapes of its ``initial_state``, built on the meta device: no memory)."""
    n, counters, names = opt.num_members, opt.scalar_state(options), opt.state_names(options)
    meta = torch.device("meta")
    args = group_args(options, opt.hyperparameters, meta, **opt._who) if names else {}
    for name, v in state.items():
        if name in counters:
            if not isinstance(v, Tensor) or tuple(v.shape) != (n,):
                got = tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__
                raise ValueError(
                    f"{api}: `{name}` of parameter {k} must be a tensor of shape [n={n}] (one "
                    f"count per member), got {got}"
                )
        elif isinstance(v, Tensor) and v.dim() > 0 and v.shape[0] != n:
            raise ValueError(
                f"{api}: `{name}` of parameter {k} has shape {tuple(v.shape)}, expected "
                f"[n={n}, ...]"
            )
        elif name in names and isinstance(v, Tensor):
            want = opt.initial_state(name, torch.empty_like(p, device=meta), args).shape
            if v.shape != want:
                raise ValueError(
                    f"{api}: `{name}` of parameter {k} has shape {tuple(v.shape)}, expected "
                    f"{tuple(want)}"
                )
