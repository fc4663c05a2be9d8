"""torch's fused CPU kernels as an implementation detail of a rule (Adam, AdamW, SGD, Adagrad).

A fused kernel does a whole update in one pass over each tensor, but takes one step count and
shared float hyperparameters. A rule calls :func:`run_fused` when :func:`fusable` says it may,
and its ``torch._foreach_*`` form otherwise.

:func:`run_fused` writes the parameters and state in one call, whole or not at all, so a rule
that says (by :func:`one_kernel_when`) when it takes that path lets the optimizer skip its
rollback copy there (``StackedOptimizer._update``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .._checks import column

__all__ = ["fusable", "in_one_kernel", "one_kernel_when", "run_fused"]

#: ``check(params, grads, state, group)``: whether a rule's call will be one ``run_fused``.
Check = Callable[[list[Tensor], list[Tensor], dict[str, Any], dict[str, Any]], bool]
_CHECKS: dict[Callable[..., None], Check] = {}


def one_kernel_when(check: Check) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Mark a rule whose call is one :func:`run_fused` (and writes nothing else) when ``check``.

    ``check`` must be the test the rule itself branches on, so the two cannot disagree.
    """

    def mark(rule: Callable[..., None]) -> Callable[..., None]:
        _CHECKS[rule] = check
        return rule

    return mark


def in_one_kernel(
    rule: Callable[..., None],
    params: list[Tensor],
    grads: list[Tensor],
    state: dict[str, Any],
    group: dict[str, Any],
) -> bool:
    """Whether ``rule(params, grads, state, group)`` will write everything in one call.

    The answer is kept in ``group`` (``"one_kernel"``), where the rule's own :func:`fusable`
    finds it instead of walking the tensors again (~3 us a step).
    """
    check = _CHECKS.get(rule)
    group["one_kernel"] = check is not None and check(params, grads, state, group)
    return group["one_kernel"]


def fusable(group: dict[str, Any], lists: list[list[Tensor]], values: list[Any]) -> bool:
    """Whether a rule may run torch's fused CPU kernel over ``lists`` (as for :func:`run_fused`).

    It may when the caller allows it (``group["fused"]``), every member shares the
    hyperparameters ``values`` (floats, not per-member tensors), the tensors are CPU tensors
    of one dtype, the parameters and state contiguous (the kernels ignore strides), and not
    while tracing for ``torch.compile``. The choice depends on this configuration only, never
    on other members' step counts or masks, so a member's result does not depend on what
    happens to the others, bit for bit.
    """
    if group.get("one_kernel"):  # in_one_kernel has just checked these very tensors
        return True
    if not group["fused"] or torch.compiler.is_compiling():
        return False
    if any(isinstance(v, Tensor) for v in values):
        return False
    dtype = lists[0][0].dtype
    for k, ts in enumerate(lists):
        for t in ts:
            if not t.is_cpu or t.dtype != dtype or not (k == 1 or t.is_contiguous()):
                return False
    return True


def run_fused(
    kernel: Callable[[list[list[Tensor]], float], Callable[[], Any] | None],
    lists: list[list[Tensor]],
    step: Tensor,
    mask: Tensor | None,
) -> None:
    """Run ``kernel(lists, step_count)`` over the whole stacked tensors, then count the step.

    A fused kernel takes one step count. The stepping members usually share theirs: one call,
    in place (rows of masked members are computed too, and the optimizer gives them their old
    values back). When counts differ (a member skipped a step), one call per count runs on
    copies of the whole tensors and each member takes the rows of its own count. Every member
    is thus always computed by a call over the whole tensors with its own count, as in a run
    where no other member skipped: its result does not depend on the others, bit for bit (a
    call on a subset of rows would move the kernel's vector/tail split).

    Args:
        kernel: The update on lists shaped like ``lists`` with one step count: it writes them
            itself (and returns None), or returns the fused op's call as a
            ``functools.partial``, which is made here as one write (:func:`_write_then_count`;
            only such a rule may be marked :func:`one_kernel_when`).
        lists: The kernel's tensor lists, stacked ``[n, ...]``: params, grads (copied when
            not contiguous: the kernels ignore strides, and leave gradients as they are),
            then state.
        step: Float32 ``[n]`` step counts shared by every tensor, counted here.
        mask: Optional bool ``[n]``: the members that step.
    """
    grads = [g if g.is_contiguous() else g.contiguous() for g in lists[1]]
    lists = [lists[0], grads, *lists[2:]]
    counts = _counts(step, mask)
    if len(counts) == 1:
        write = kernel(lists, counts[0])
        if write is None:
            step.add_(1)
        else:
            _write_then_count(write, step)
        return
    # Every count's kernel runs on copies before anything is written, and one copy writes
    # all: a failure on a later count leaves the tensors as they were.
    written = [lists[0], *lists[2:]]  # the gradients are read only
    targets = [t for ts in written for t in ts]
    merged = list(targets)
    stepping = torch.ones_like(step, dtype=torch.bool) if mask is None else mask.to(step.device)
    for count in counts:
        work = [[t.clone() for t in ts] for ts in lists]
        write = kernel(work, count)
        if write is not None:
            write()
        rows = stepping & (step == count)
        news = [t for ts in [work[0], *work[2:]] for t in ts]
        merged = [torch.where(column(rows, m), new, m) for m, new in zip(merged, news, strict=True)]
    _write_then_count(functools.partial(torch._foreach_copy_, targets, merged), step)


def _write_then_count(write: Callable[[], Any], step: Tensor) -> None:
    """Run ``write`` (one native op that writes all or nothing), then count the step.

    Python raises a pending ``KeyboardInterrupt`` (or what a signal handler raises) as soon as a
    native call returns, so one that arrives while the kernel runs surfaces here after the op
    has written: the step is then counted before it propagates, and parameters, state and counts
    agree. ``write`` must be the op itself or a ``functools.partial`` of it (C all the way down:
    a Python function's entry would raise a pending interrupt before the op runs). The op's own
    errors (an ``Exception``) come from its argument checks, before it writes.
    """
    try:
        write()
    except Exception:
        raise
    except BaseException:
        step.add_(1)
        raise
    step.add_(1)


def _counts(step: Tensor, mask: Tensor | None) -> list[float]:
    """The step counts of the stepping members, one each."""
    if mask is None:  # the common case, checked cheaply: every member steps with one count
        low, high = torch.aminmax(step)
        first = low.item()
        if first == high.item():
            return [first]
    stepping = torch.ones_like(step, dtype=torch.bool) if mask is None else mask.to(step.device)
    return step[stepping].unique().tolist()
