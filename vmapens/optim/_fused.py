"""torch's fused CPU kernels as an implementation detail of a rule (Adam, AdamW, SGD, Adagrad).

A fused kernel does a whole update in one pass over each tensor, but takes one step count and
shared float hyperparameters. A rule calls :func:`run_fused` when :func:`fusable` says it may,
and its ``torch._foreach_*`` form otherwise.

:func:`run_fused` writes the parameters and state in one call, whole or not at all, so a rule
that says (by :func:`one_kernel_when`) when it takes that path lets the optimizer skip its
rollback copy there (``StackedOptimizer._update``). A rule without a fused kernel (Adamax,
RMSprop, NAdam, RAdam, Adadelta; Adam, SGD and Adagrad with ``fused=False``) does the same with
its write phase: with shared float hyperparameters on CPU (:func:`safe_in_place`) its kernel
first computes everything that allocates, then returns its writes, in-place
``torch._foreach_*`` ops that can neither fail nor allocate on those tensors, which
:func:`write_then_count` makes with ``SIGINT`` held back until the last has returned. A step of
several such calls (param groups) holds every call's writes back until all have allocated
(:func:`writes_held`).
"""

from __future__ import annotations

# signal's own functions, without the enum wrappers of `signal` (60 us a call on Python 3.11)
import _signal  # type: ignore[import-not-found]
import contextlib
import contextvars
import functools
import signal
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from .._checks import column

__all__ = [
    "Writes",
    "fusable",
    "in_one_kernel",
    "into",
    "joined_empty",
    "make_held",
    "one_kernel_when",
    "run_fused",
    "safe_in_place",
    "write_then_count",
    "writes_held",
]

#: What a kernel returns instead of writing: one native op that checks its arguments and then
#: writes, all or nothing (a fused kernel); or a write phase, in-place ops made in order, each
#: of which can neither fail nor allocate (:func:`safe_in_place`). Each as a
#: ``functools.partial`` of the op (C all the way down: see :func:`write_then_count`).
Writes = Callable[[], Any] | list[Callable[[], Any]]

#: The writes :func:`write_then_count` holds back, with the step each counts, while
#: :func:`writes_held` is open (None: it makes them at once).
_HELD: contextvars.ContextVar[list[tuple[Writes, Tensor]] | None] = contextvars.ContextVar(
    "vmapens_held_writes", default=None
)

#: ``check(params, grads, state, group)``: whether a rule's call writes everything in one go.
Check = Callable[[list[Tensor], list[Tensor], dict[str, Any], dict[str, Any]], bool]
_CHECKS: dict[Callable[..., None], Check] = {}


def one_kernel_when(check: Check) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Mark a rule whose call writes everything in one go when ``check``: one
    :func:`run_fused` whose kernel returns its :data:`Writes`, or one :func:`write_then_count`
    of a write phase, and nothing written before.

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
    """Whether ``rule(params, grads, state, group)`` will write everything in one go.

    The answer is kept in ``group`` (``"one_kernel"``), where the rule's own :func:`fusable` or
    :func:`safe_in_place` finds it instead of walking the tensors again (~3 us a step).
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
    if not group["fused"] or any(isinstance(v, Tensor) for v in values):
        return False
    return safe_in_place(group, lists, values)  # its answer kept in group holds for these too


def into(op: Callable[..., Any], outs: list[Tensor], *args: Any, **kwargs: Any) -> list[Any]:
    """``op(*args, out=outs[i], **kwargs)`` for each tensor ``i`` as writes: what a foreach op
    without an ``out=`` form writes into buffers allocated before the write phase. A list (or
    tuple) in ``args`` gives its ``i``-th tensor, anything else goes as it is.

    Example:
        >>> v, out = [torch.tensor([4.0]), torch.tensor([9.0])], [torch.empty(1), torch.empty(1)]
        >>> for write in into(torch.sqrt, out, v):
        ...     _ = write()
        >>> out
        [tensor([2.]), tensor([3.])]
    """
    return [
        functools.partial(
            op, *[a[i] if isinstance(a, (list, tuple)) else a for a in args], out=out, **kwargs
        )
        for i, out in enumerate(outs)
    ]


def joined_empty(like: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
    """One uninitialised buffer for tensors shaped like ``like`` (one dtype and device), as
    one flat tensor and its contiguous views shaped like each, in order.

    A write phase's scratch: an op on the flat tensor is one call where a ``torch._foreach_*``
    op makes one per tensor (3-4 us against 7-8 us for workload A's four tensors), with the
    same bits (elementwise ops); the views take what reads or writes per tensor.

    Example:
        >>> flat, views = joined_empty([torch.zeros(2, 3), torch.zeros(2)])
        >>> flat.shape, [v.shape for v in views]
        (torch.Size([8]), [torch.Size([2, 3]), torch.Size([2])])
    """
    sizes = [t.numel() for t in like]
    flat = torch.empty(sum(sizes), dtype=like[0].dtype, device=like[0].device)
    views, start = [], 0
    for t, size in zip(like, sizes, strict=True):
        if t.is_contiguous():  # its strides are its shape's (as_strided: 1 us, a slice's view: 4)
            views.append(flat.as_strided(t.shape, t.stride(), start))
        else:
            views.append(flat[start : start + size].view(t.shape))
        start += size
    return flat, views


def safe_in_place(
    group: dict[str, Any], lists: list[list[Tensor]], values: list[Any], columns: bool = False
) -> bool:
    """Whether in-place ``torch._foreach_*`` ops over ``lists`` (params, grads, state), with
    ``values`` as their scalars, can neither fail nor allocate: every value a float shared by
    the members, the tensors dense CPU tensors of one dtype (same shapes, as the optimizer
    keeps them), plain (no subclass), writable in place here (no tensor that requires grad
    outside ``torch.no_grad()``, no inference tensor outside ``torch.inference_mode()``), the
    parameters and state contiguous, and no ``torch.compile`` trace running.
    A fused kernel takes the same (it ignores strides); a rule's write phase may then run
    without a rollback copy (see the module). ``group`` as for :func:`fusable`. With
    ``columns``, per-member values (tensors) are taken too, as ``[n, 1, ...]`` columns in the
    parameters' dtype: not for float16 or bfloat16 parameters, whose columns are float32 (an
    in-place op then allocates its result in the wider dtype)."""
    if group.get("one_kernel"):  # in_one_kernel has just checked these very tensors
        return True
    if torch.compiler.is_compiling():
        return False
    tensors = any(isinstance(v, Tensor) for v in values)
    if tensors and (not columns or lists[0][0].dtype in (torch.float16, torch.bfloat16)):
        return False
    # In-place ops refuse a leaf that requires grad outside no_grad (the optimizer steps under
    # it) and an inference tensor outside inference_mode.
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    dtype, strided, plain = lists[0][0].dtype, torch.strided, (Tensor, nn.Parameter)
    for k, ts in enumerate(lists):
        for t in ts:  # dtypes and layouts are singletons: `is`
            if t.dtype is not dtype or t.layout is not strided or not t.is_cpu:
                return False
            if type(t) not in plain:
                return False
            if k == 1:  # the gradients are only read
                continue
            if not t.is_contiguous() or (grad and t.requires_grad):
                return False
            if not inference and t.is_inference():
                return False
    return True


def run_fused(
    kernel: Callable[[list[list[Tensor]], float], Writes | None],
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
            itself (and returns None), or returns its :data:`Writes` (the fused op's call, or
            its write phase), made here (:func:`write_then_count`; only such a rule may be
            marked :func:`one_kernel_when`).
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
            write_then_count(write, step)
        return
    # Every count's kernel runs on copies before anything is written, and one copy writes
    # all: a failure on a later count leaves the tensors as they were.
    written = [lists[0], *lists[2:]]  # the gradients are read only
    targets = [t for ts in written for t in ts]
    merged = list(targets)
    stepping = torch.ones_like(step, dtype=torch.bool) if mask is None else mask.to(step.device)
    for count in counts:
        work = [[t.clone() for t in ts] for ts in lists]
        for op in _ops(kernel(work, count)):
            op()
        rows = stepping & (step == count)
        news = [t for ts in [work[0], *work[2:]] for t in ts]
        merged = [torch.where(column(rows, m), new, m) for m, new in zip(merged, news, strict=True)]
    write_then_count(functools.partial(torch._foreach_copy_, targets, merged), step)


@contextlib.contextmanager
def writes_held() -> Any:
    """Hold back every :func:`write_then_count` made inside, for :func:`make_held`.

    For an optimizer step of several rule calls (param groups, parameters with their own step
    counts), each of which writes in one go: every call's allocations come first, then all
    the writes. A call that fails leaves nothing written.
    """
    held: list[tuple[Writes, Tensor]] = []
    token = _HELD.set(held)
    try:
        yield held
    finally:
        _HELD.reset(token)


def make_held(held: list[tuple[Writes, Tensor]]) -> None:
    """Make the held writes in order, as one write phase, then count each call's step."""
    _make_then_count([op for write, _ in held for op in _ops(write)], [s for _, s in held])


def write_then_count(write: Writes, step: Tensor) -> None:
    """Make ``write`` (:data:`Writes`), then count the step.

    Python raises a pending ``KeyboardInterrupt`` (or what a signal handler raises) as soon as a
    native call returns, so one that arrives while the kernel runs surfaces here after the op
    has written: the step is then counted before it propagates, and parameters, state and counts
    agree. ``write`` must be the op itself or a ``functools.partial`` of it (C all the way down:
    a Python function's entry would raise a pending interrupt before the op runs). The op's own
    errors (an ``Exception``) come from its argument checks, before it writes. A write phase of
    several ops runs with ``SIGINT`` deferred until its last op has returned
    (:func:`_interrupts_deferred`), so that it too is made whole. Inside :func:`writes_held`
    both are held back instead.
    """
    if torch.compiler.is_compiling():  # a compiled graph runs whole or not at all
        for op in _ops(write):
            op()
        step.add_(1)
        return
    held = _HELD.get()
    if held is not None:
        held.append((write, step))
        return
    _make_then_count(_ops(write), [step])


def _ops(write: Writes | None) -> list[Callable[[], Any]]:
    """The ops of a kernel's :data:`Writes` (none when it wrote itself)."""
    return [write] if callable(write) else write or []


def _make_then_count(ops: list[Callable[[], Any]], steps: list[Tensor]) -> None:
    """Make ``ops`` (one op alone; several with ``SIGINT`` deferred), then count ``steps``,
    also when an interrupt propagates after they wrote (see :func:`write_then_count`)."""
    try:
        if len(ops) > 1:
            _interrupts_deferred(ops)
        else:
            for op in ops:
                op()
    except Exception:
        raise
    except BaseException:
        for step in steps:
            step.add_(1)
        raise
    for step in steps:
        step.add_(1)


def _interrupts_deferred(writes: list[Callable[[], Any]]) -> None:
    """Make ``writes`` in order; the ``SIGINT`` handler runs after the last.

    A signal interrupts the main thread only, and runs its Python handler between two ops, where
    Python's own raises ``KeyboardInterrupt``: here the handler (Python's, or one of the user's
    own) is called with what arrived once every write is made. Other signals are left alone.
    """
    handler = _signal.getsignal(signal.SIGINT)
    if not callable(handler) or threading.current_thread() is not threading.main_thread():
        for write in writes:  # no Python handler (ignored, or the OS default), or not main
            write()
        return
    arrived: list[tuple[int, Any]] = []
    _signal.signal(signal.SIGINT, lambda signum, frame: arrived.append((signum, frame)))
    try:
        for write in writes:
            write()
    finally:
        _signal.signal(signal.SIGINT, handler)
    for signum, frame in arrived:
        handler(signum, frame)


def _counts(step: Tensor, mask: Tensor | None) -> list[float]:
    """The step counts of the stepping members, one each."""
    if mask is None:  # the common case, checked cheaply: every member steps with one count
        low, high = torch.aminmax(step)
        first = low.item()
        if first == high.item():
            return [first]
    stepping = torch.ones_like(step, dtype=torch.bool) if mask is None else mask.to(step.device)
    return step[stepping].unique().tolist()
