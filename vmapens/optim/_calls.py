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
from ._fused import in_one_kernel, make_held, writes_held
from ._hyper import group_args
from ._keep import Rule, Snapshot, keep_masked_, tensors_of
from ._kinds import real_views

__all__ = ["rule_calls", "run_calls"]

#: A rule call: (params, grads, state, group args), as ``StackedOptimizer.update_`` takes them.
Call = tuple[list[Tensor], list[Tensor], dict[str, Any], dict[str, Any]]


def rule_calls(opt: Any, grads: Sequence[Tensor | None], mask: Tensor | None) -> list[Call]:
    """The rule calls of one step of ``opt`` (a ``StackedOptimizer``, its state prepared).

    Reads its ``param_groups``, ``state``, ``state_names``, ``scalar_state``,
    ``hyperparameters`` and which groups hold complex tensors (viewed as real pairs, as torch
    steps them). ``grads`` has one gradient (or None) per parameter, flattened over the groups.
    """
    calls: list[Call] = []
    start, compiling = 0, torch.compiler.is_compiling()
    for index, group in enumerate(opt.param_groups):
        params, counters = group["params"], tuple(opt.scalar_state(group))
        states, end = [opt.state[p] for p in params], start + len(params)
        parts = buckets(params, grads[start:end], states, opt.state_names(group), counters)
        start = end
        if index in opt._complex or (compiling and any(p.is_complex() for p in params)):
            parts = [real_views(part) for part in parts]  # as torch steps complex tensors
        if parts:
            args = group_args(group, opt.hyperparameters, params[0].device, **opt._who)
            args.update(mask=mask, fused=group.get("fused") is not False)
            calls += [(*part, dict(args)) for part in parts]  # in_one_kernel writes in args
    return calls


def run_calls(
    update: Rule,
    own: Rule | None,
    calls: list[Call],
    mask: Tensor | None,
    snapshot: Snapshot,
    layout: object,
) -> None:
    """``update(*call)`` for every call, all or nothing; called under ``torch.no_grad()``.

    Copied first (a failed step changes nothing, masked members keep theirs), unless each
    call of the class's own rule writes all in one go (``_fused.in_one_kernel``).

    Args:
        update: the optimizer's ``update_``.
        own: the class's rule where ``update_`` is the base's (which runs the rule alone),
            else None.
        calls: the step's calls, in order.
        mask: Optional bool [n]: which members step.
        snapshot: what takes and restores the copies.
        layout: the optimizer's layout token (``Snapshot.take``).
    """
    whole = own is not None and mask is None and all(in_one_kernel(own, *c) for c in calls)
    if whole:  # every call's allocations first, then all the writes
        with writes_held() as held:
            for params, g, state, args in calls:
                update(params, g, state, args)
        return make_held(held)
    written = [t for p, _, s, _ in calls for t in tensors_of(p, s)]
    saved = snapshot.take(written, mask, layout)
    try:
        for params, g, state, args in calls:
            update(params, g, state, args)
    except BaseException:
        snapshot.restore(written, saved)
        raise
    if mask is not None:
        keep_masked_(written, saved, mask)
