"""One step's rule calls: built per bucket of parameters, run all or nothing.

A step of a :class:`~vmapens.optim.StackedOptimizer` is one call of its rule per bucket
(:func:`~vmapens.optim._buckets.buckets`: the parameters with a gradient that share their step
counts) of every param group. A failed step changes nothing, and the members outside the mask
keep their values bit for bit: either every call writes all in one go (the class's own rule in
torch's fused or one-kernel form, :mod:`vmapens.optim._fused`), every call's allocations first
and then all the writes, with nothing to copy; or what the calls write is copied first (the
optimizer's :class:`~vmapens.optim._keep.Snapshot`), put back if a call raises, and given back
to the masked-out members afterwards (:func:`~vmapens.optim._keep.keep_masked_`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ._buckets import buckets
from ._flags import check_flags
from ._fused import in_one_kernel, make_held, writes_held
from ._hyper import group_args
from ._keep import Rule, Snapshot, keep_masked_, tensors_of
from ._kinds import real_views

__all__ = ["rule_calls", "run_calls"]

#: A rule call: (params, grads, state, group args), as ``StackedOptimizer.update_`` takes them.
Call = tuple[list[Tensor], list[Tensor], dict[str, Any], dict[str, Any]]


def rule_calls(
    opt: Any,
    grads: Sequence[Tensor | None],
    mask: Tensor | None,
    reached: Sequence[Tensor | None] = (),
) -> list[Call]:
    """The rule calls of one step of ``opt`` (a ``StackedOptimizer``, its state prepared).

    Reads its ``param_groups``, ``state``, ``state_names``, ``scalar_state``,
    ``hyperparameters`` and which groups hold complex tensors (viewed as real pairs, as torch
    steps them). ``grads`` has one gradient (or None) per parameter, flattened over the groups;
    ``reached`` (empty: all) one bool ``[n]`` or None per parameter: the members whose
    gradient a backward reached (``_member_reach``). A parameter steps only those members,
    in a call of its own with its own counters, as ``torch.optim`` alone skips a parameter
    without a gradient.
    """
    calls: list[Call] = []
    start, compiling = 0, torch.compiler.is_compiling()
    for index, group in enumerate(opt.param_groups):
        if not compiling:  # a flag set by hand since (the compiled step checked it eagerly)
            check_flags(opt._who["api"], group, type(opt), opt.hyperparameters)
        params, counters = group["params"], tuple(opt.scalar_state(group))
        states, end = [opt.state[p] for p in params], start + len(params)
        rows: list[Tensor | None] = list(reached[start:end]) if reached else [None] * len(params)
        for part_mask, grads_of in _by_rows(grads[start:end], rows, mask):
            parts = buckets(params, grads_of, states, opt.state_names(group), counters)
            if index in opt._complex or (compiling and any(p.is_complex() for p in params)):
                parts = [real_views(part) for part in parts]  # as torch steps complex tensors
            if parts:
                args = group_args(group, opt.hyperparameters, params[0].device, **opt._who)
                args.update(mask=part_mask, fused=group.get("fused") is not False)
                calls += [(*part, dict(args)) for part in parts]  # in_one_kernel writes in args
        start = end
    return calls


def _by_rows(
    grads: Sequence[Tensor | None],
    rows: list[Tensor | None],
    mask: Tensor | None,
) -> list[tuple[Tensor | None, list[Tensor | None]]]:
    """One group's gradients split by the members each parameter steps (``mask`` and its
    ``rows``): per split its mask, and the gradients with None outside it (``buckets`` gives
    a parameter without a gradient counters of its own where it shares them with one that
    steps: each split counts apart)."""
    if all(r is None for r in rows):
        return [(mask, list(grads))]
    keys = [None if r is None else tuple(r.tolist()) for r in rows]
    splits: dict[Any, list[int]] = {}
    for i, (key, g) in enumerate(zip(keys, grads, strict=True)):
        if g is not None:
            splits.setdefault(key, []).append(i)
    out = []
    for members in splits.values():
        split, own = mask, rows[members[0]]
        if own is not None:
            split = own if mask is None else own & mask.to(own.device)
        out.append((split, [g if i in members else None for i, g in enumerate(grads)]))
    return out


def run_calls(
    update: Rule, own: Rule | None, calls: list[Call], snapshot: Snapshot, layout: object
) -> None:
    """``update(*call)`` for every call, all or nothing; called under ``torch.no_grad()``.

    Copied first (a failed step changes nothing, masked members keep theirs), unless each
    call of the class's own rule writes all in one go (``_fused.in_one_kernel``).

    Args:
        update: the optimizer's ``update_``.
        own: the class's rule where ``update_`` is the base's (which runs the rule alone),
            else None.
        calls: the step's calls, in order; each one's ``mask`` (None: all) says which
            members it steps.
        snapshot: what takes and restores the copies.
        layout: the optimizer's layout token (``Snapshot.take``).
    """
    masks = [args["mask"] for *_, args in calls]
    mask = next((m for m in masks if m is not None), None)
    whole = own is not None and mask is None and all(in_one_kernel(own, *c) for c in calls)
    if whole:  # every call's allocations first, then all the writes
        with writes_held() as held:
            for params, g, state, args in calls:
                update(params, g, state, args)
        return make_held(held)
    written, of = [], []  # what each call writes, and its mask
    for (params, _, state, _), m in zip(calls, masks, strict=True):
        wrote = tensors_of(params, state)
        written += wrote
        of += [m] * len(wrote)
    saved = snapshot.take(written, mask, layout)
    try:
        for params, g, state, args in calls:
            update(params, g, state, args)
    except BaseException:
        snapshot.restore(written, saved)
        raise
    if mask is not None:
        kept = [i for i, m in enumerate(of) if m is not None]
        keep_masked_([written[i] for i in kept], [saved[i] for i in kept], [of[i] for i in kept])
