"""Handing members over: one member's state for the plain torch optimizer, sub-ensembles.

Free functions over a :class:`~vmapens.optim.StackedOptimizer` (which calls them from its
``member_state_dict`` and ``select``); they read its ``param_groups``, ``state``,
``hyperparameters`` and ``member_state``.
"""

from __future__ import annotations

import contextlib
import operator
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from .._checks import index_rows
from .._cut_from import CUT_FROM
from ._flags import IMPLEMENTATION
from ._hyper import FREE_ON_LOAD, group_args, params_of, pick_group, unnamed

__all__ = ["check_state_dict", "copy_rows", "load_hooks", "member_state_dict", "select_parts"]


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
    if module is not None and not isinstance(module, nn.Module):
        raise TypeError(f"{api}: `module` must be an nn.Module, got {type(module).__name__}")
    if module is not None:
        _check_module(api, opt, [tuple(_own(p, p[i], i).shape) for p in params], module)
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


def _check_module(api: str, opt: Any, expected: list[tuple[int, ...]], module: nn.Module) -> None:
    """``module``'s parameters against the member shapes ``expected`` (in group order): by name
    where the groups keep ``param_names`` of ``module``'s; else as shapes in any order (a plain
    optimizer takes them in any group layout), all of them or those that require grad (a
    frozen backbone left out of the optimizer).

    Raises:
        ValueError: they do not match.
    """
    own = dict(module.named_parameters())
    names = [name for g in opt.param_groups for name in g.get("param_names", ())]
    if len(names) == len(expected) and all(name in own for name in names):
        got = [tuple(own[name].shape) for name in names]
        if got != expected:
            raise ValueError(
                f"{api}: `module` parameters {names} have shapes {got}, the stacked ones "
                f"{expected}: not a member of this ensemble"
            )
        return
    shapes = sorted(tuple(p.shape) for p in own.values())
    trainable = sorted(tuple(p.shape) for p in own.values() if p.requires_grad)
    if sorted(expected) not in (shapes, trainable):
        raise ValueError(
            f"{api}: `module` parameters do not match the stacked ones; got shapes {shapes} "
            f"({trainable} requiring grad), expected {sorted(expected)} (in any order)"
        )


def _own(p: Tensor, row: Tensor, i: int) -> Tensor:
    """Member ``i``'s ``row`` of a tensor shaped like ``p``, cut to the member's own size when
    members of different sizes are padded (``Ensemble.from_factories``)."""
    found = getattr(p, "_member_padding", None)
    return row if found is None else found[0].take(found[1], row, i).clone()


class _Groups(list):
    """A sub-ensemble's param groups, with the global ids and ``n_total`` its members have
    (``ens.select(index)``'s): the optimizer built from them reads both as it reads an
    Ensemble's, so that per-member values given later for all ``n_total`` members are cut
    to these members, as for an optimizer built on the sub-ensemble itself."""

    member_ids: list[int]
    n_total: int


def select_parts(
    opt: Any, index: Any, params: Any
) -> tuple[Tensor, list[dict[str, Any]], dict[str, Any]]:
    """What a sub-ensemble's optimizer is built from: its rows, param groups (with the
    members' global ids, see :class:`_Groups`) and defaults.

    Raises:
        ValueError: ``params`` does not match the optimizer's parameters.
    """
    rows = index_rows(f"{opt._api}.select", index, opt.num_members)
    if not len(rows):  # an empty slice or an all-False mask, as Ensemble.select says
        raise IndexError(f"{opt._api}.select: selecting no members; an Ensemble needs at least one")
    new_params = _matched(opt, rows, params)
    picked = rows.tolist()
    groups, start = _Groups(), 0
    ids = opt._block if opt._block is not None else range(opt._n_total)
    groups.member_ids, groups.n_total = [ids[r] for r in picked], opt._n_total
    for group in opt.param_groups:
        size = len(group["params"])
        picks = pick_group(group, opt.hyperparameters, picked)
        groups.append({**picks, "params": new_params[start : start + size]})
        start += size
    return rows, groups, pick_group(opt.defaults, opt.hyperparameters, picked)


def _matched(opt: Any, rows: Tensor, params: Any) -> list[Tensor]:
    """``params``' tensors in the order of ``opt``'s (flattened over its param groups).

    A parameter of ``ens.select(rows)`` knows the tensor it was cut from (``CUT_FROM``): each of
    ``opt``'s parameters gets the one cut from it, by name, whatever the order of the groups
    (biases in a group of their own) and whichever parameters ``opt`` leaves out. Without that
    record (a copy of the sub-ensemble, tensors replaced since), a module's parameters are
    matched by value (each row of ``opt``'s equal to exactly one of them) and a list's by
    position, as documented.
    """
    api = f"{opt._api}.select"
    old = [p for g in opt.param_groups for p in g["params"]]
    known = {id(p): k for k, p in enumerate(old)}
    given = unnamed(params_of(params)) if isinstance(params, (Iterable, nn.Module)) else [params]
    if not all(isinstance(t, Tensor) for t in given):
        got = next(type(t).__name__ for t in given if not isinstance(t, Tensor))
        raise TypeError(
            f"{api}: `params` must be the sub-ensemble or a list of its stacked tensors, got "
            f"{type(params).__name__}"
            + (f" holding a {got}" if got != type(params).__name__ else "")
        )
    parents: dict[int, Tensor] = {}
    for t in given:
        parent, cut = _cut_from(t)
        if parent is not None and id(parent) in known:
            if cut != tuple(rows.tolist()):
                raise ValueError(
                    f"{api}: `params` were cut from rows {list(cut)} (`ens.select`), not from "
                    f"`index`'s rows {rows.tolist()}: select the same members of both"
                )
            parents.setdefault(id(parent), t)
    if all(id(p) in parents for p in old):
        return [parents[id(p)] for p in old]
    way_out = (
        "pass the sub-ensemble's stacked parameters in this optimizer's order "
        "([sub.stacked_params()[name] for each parameter of each group]), or use "
        "vmapens.selection.best_k(..., optimizer=)"
    )
    if isinstance(params, nn.Module):
        return _by_value(api, old, given, rows, way_out)
    shapes = [tuple(p.shape[1:]) for p in given]
    if shapes != [tuple(p.shape[1:]) for p in old]:
        raise ValueError(
            f"{api}: `params` do not match this optimizer's parameters "
            f"(member shapes {shapes}, expected {[tuple(p.shape[1:]) for p in old]})"
        )
    was: dict[int, int] = {}  # position in `params` -> the parameter whose rows it holds
    for k, t in enumerate(given):
        parent, _ = _cut_from(t)
        if parent is not None and id(parent) in known and parent is not old[k]:
            was[k] = known[id(parent)]
    if not was and not all(_equal(p, rows, t) for p, t in zip(old, given, strict=True)):
        # Other values: fresh tensors, taken as given; unless they are these rows, reordered.
        hits = [[k for k, t in enumerate(given) if _equal(p, rows, t)] for p in old]
        if sorted(h[0] for h in hits if len(h) == 1) == list(range(len(old))):
            was = {h[0]: j for j, h in enumerate(hits) if h[0] != j}
    if was:
        k, j = min(was.items())
        raise ValueError(
            f"{api}: `params[{k}]` holds the rows of this optimizer's parameter {j}, not of "
            f"its parameter {k}: `params` must be in this optimizer's order (its param "
            f"groups', not the module's); {way_out}"
        )
    return given


def _cut_from(t: Any) -> tuple[Tensor | None, tuple[int, ...]]:
    """The live tensor ``t`` was cut from by ``ens.select``, and the rows (None, () if none)."""
    found = CUT_FROM.get(t)
    return (None, ()) if found is None else (found[0](), found[1])


def _equal(p: Tensor, rows: Tensor, t: Tensor) -> bool:
    """Whether ``t`` holds rows ``rows`` of ``p`` (in ``t``'s dtype and device: a sub-ensemble
    moved or cast since)."""
    if t.shape != (len(rows), *p.shape[1:]) or t.is_floating_point() != p.is_floating_point():
        return False
    return torch.equal(t.detach(), p.detach()[rows.to(p.device)].to(t.device, t.dtype))


def _by_value(
    api: str, old: list[Tensor], given: list[Tensor], rows: Tensor, way_out: str
) -> list[Tensor]:
    """Each of ``old``'s parameters matched to the one tensor of ``given`` that holds its rows.

    Raises:
        ValueError: a parameter with no such tensor, or with several, or with one that another
            parameter matches too (equal values, such as biases initialised to zero).
    """
    out: list[Tensor] = []
    for k, p in enumerate(old):
        hits = [t for t in given if _equal(p, rows, t)]
        if len(hits) != 1 or any(hits[0] is q for q in out):
            how = "none" if not hits else "several (values alone do not say which)"
            raise ValueError(
                f"{api}: this optimizer's parameter {k} (member shape {tuple(p.shape[1:])}) "
                "was not cut by `ens.select` into `params` (a copy of a sub-ensemble, or "
                f"tensors replaced since), and by value it matches {how} of `params`' "
                f"parameters; {way_out}"
            )
        out.append(hits[0])
    return out


def copy_rows(opt: Any, new: Any, rows: Tensor) -> None:
    """Give ``new`` (built over a sub-ensemble's parameters) rows ``rows`` of ``opt``'s state."""
    old = [p for g in opt.param_groups for p in g["params"]]
    fresh = [p for g in new.param_groups for p in g["params"]]
    for p_old, p_new in zip(old, fresh, strict=True):
        if opt.state.get(p_old):
            new.state[p_new] = {
                k: v[rows.to(v.device)].clone() for k, v in opt.state[p_old].items()
            }


@contextlib.contextmanager
def load_hooks(opt: Any, state_dict: Any) -> Iterator[Any]:
    """``opt.load_state_dict``'s body between ``opt``'s load-state-dict hooks, as torch runs them.

    torch's ``load_state_dict`` runs the pre-hooks inside itself, after anything checked
    before it: a hook that adapts an old or wrapped checkpoint (fills in a hyperparameter,
    unwraps ``{"optimizer": sd}``) would be refused unseen. So the pre-hooks run first, on a
    shallow copy as torch's, the body (check, torch's load, normalisation) gets what they
    return, and the post-hooks run after it, on the optimizer as stepping reads it.
    """
    if isinstance(state_dict, dict):
        state_dict = state_dict.copy()  # torch's: a hook may edit the dict it is given
    for hook in opt._optimizer_load_state_dict_pre_hooks.values():
        out = hook(opt, state_dict)
        state_dict = state_dict if out is None else out
    pre, post = opt._optimizer_load_state_dict_pre_hooks, opt._optimizer_load_state_dict_post_hooks
    opt._optimizer_load_state_dict_pre_hooks = OrderedDict()  # torch's load must not rerun them
    opt._optimizer_load_state_dict_post_hooks = OrderedDict()
    try:
        yield state_dict
    finally:
        opt._optimizer_load_state_dict_pre_hooks = pre
        opt._optimizer_load_state_dict_post_hooks = post
    for hook in post.values():
        hook(opt)


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


#: State that a step creates when a flag changed mid-run asks for it (a momentum set from 0,
#: ``amsgrad``, ``centered``), as torch's optimizers create it: a stepped state may lack it.
LAZY_STATE = frozenset({"momentum_buffer", "max_exp_avg_sq", "grad_avg"})


def _check_state(
    opt: Any, api: str, k: Any, state: dict[str, Any], p: Tensor, options: dict[str, Any]
) -> None:
    """Parameter ``k``'s state: counters ``[n]`` tensors, the rest as ``opt`` makes it (the
    shapes of its ``initial_state``, built on the meta device: no memory)."""
    n, counters, names = opt.num_members, opt.scalar_state(options), opt.state_names(options)
    # A stepped parameter without one of its moments: the step would start it at zeros while
    # the counts go on (torch's next step raises a KeyError). Without its counts: the step
    # would take a loaded moment for none (torch's SGD keeps a momentum buffer and no count:
    # the next step started each buffer again from the gradient, silently, until session 47).
    missing = [name for name in names if name not in state and name not in LAZY_STATE]
    missing += [name for name in counters if name not in state]
    if state and missing:
        count = f" (one count per member, [n={n}])" if missing[0] in counters else ""
        raise ValueError(
            f"{api}: the state of parameter {k} has {sorted(state)} but no `{missing[0]}`"
            f"{count}, which every step keeps: load a state dict this optimizer saved (torch's "
            "own optimizers keep one count for all members, or none)"
        )
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
