"""Which members a backward reached, per stacked parameter, when members run in turns.

Alone, a member whose forward never reads a parameter (a branch that skips a head, an early
exit) leaves that parameter's ``.grad`` None, and ``torch.optim`` skips it: no weight decay, no
momentum, no step count. With ``backend="loop"`` each member reads its own row of the stacked
parameter, and one stacked ``.grad`` holds every row: zeros for a member that never read its
row. The loop backend watches each member's rows (``watch``); a backward notes the rows it
reached, per member as alone ``.grad`` stops being None, and the stacked optimizers step a
parameter only for the members whose row it reached (``reached``), as ``torch.optim`` alone
would.

What each member's ``.grad`` alone would be follows the stacked ``.grad``: a backward that
accumulates into it adds the members it reached (all of them anew where it was None); one
that accumulates into none (``torch.autograd.grad``, as the eager step and gradient surgery
call it) says which members a ``.grad`` set from its results next holds; a ``.grad`` set
otherwise (``p.grad = p.grad * 0.5``) keeps the members it had. A row of ``.grad`` that is
not zero was reached too (a penalty on ``ens.parameters()`` reaches every member); one
reached only by a path outside the rows with an exact zero, after the stacked ``.grad`` was
None, is the one case this cannot tell (docs/semantics.md).
"""

from __future__ import annotations

import functools
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch._C._functorch import is_functorch_wrapped_tensor
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["hold", "reached", "reached_rows", "watch"]


@dataclass
class _Reach:
    """Per member, whether its ``.grad`` alone would be a tensor (``members``), for the
    stacked ``.grad`` ``grad`` refers to; and what a backward that accumulated into no
    ``.grad`` reached (``given``: for the next ``.grad`` set by hand), if one ran since."""

    members: list[bool]
    grad: weakref.ref | None
    given: list[bool] | None = None


#: Per stacked parameter, what the backward running now reached: one flag per member, the
#: parameter's ``.grad`` (identity, version) when the first of its rows was reached, its name.
_RUNNING: WeakIdKeyDictionary = WeakIdKeyDictionary()
#: The backward (graph task) that will note ``_RUNNING`` in ``_REACH`` when it ends.
_TASK = [-1]
#: Per stacked parameter, its ``_Reach``.
_REACH: WeakIdKeyDictionary = WeakIdKeyDictionary()
#: The stacked parameters a stacked optimizer holds (``hold``), and those warned about.
_HELD: WeakIdKeyDictionary = WeakIdKeyDictionary()
_WARNED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def hold(params: list[Tensor]) -> None:
    """A stacked optimizer holds ``params``: it steps only the rows a backward reached."""
    for p in params:
        _HELD[p] = True


def watch(stacked: dict[str, Tensor], rows: dict[str, Tensor], i: int, n: int) -> None:
    """Member ``i`` (of ``n``) runs on ``rows``, cut from ``stacked``: a backward that reaches
    one of them notes it for its stacked parameter (a leaf that trains)."""
    for name, row in rows.items():
        p = stacked.get(name)
        if (
            p is None
            or row.grad_fn is None
            or not (p.is_leaf and p.requires_grad)
            or is_functorch_wrapped_tensor(row)
        ):
            continue
        row.register_hook(functools.partial(_note, weakref.ref(p), name, i, n))


def _grad_key(p: Tensor) -> Any:
    return None if p.grad is None else (id(p.grad), p.grad._version)


def _note(ref: weakref.ref, name: str, i: int, n: int, grad: Tensor) -> None:
    p = ref()
    if p is None:
        return
    task = torch._C._current_graph_task_id()
    if task != _TASK[0]:  # the first note of this backward: keep them all once it ends
        _TASK[0] = task
        _RUNNING.clear()  # what a backward that failed noted
        torch.autograd.Variable._execution_engine.queue_callback(_end_of_backward)
    flags, _, _ = _RUNNING.setdefault(p, ([False] * n, _grad_key(p), name))
    flags[i] = True


def _end_of_backward() -> None:
    """At the end of a backward: each parameter's members, into the ``.grad`` it accumulated
    into, or given for the next one set by hand where it accumulated into none."""
    running = list(_RUNNING.items())
    _RUNNING.clear()
    _TASK[0] = -1
    missed = {}
    for p, (flags, before, name) in running:
        if not all(flags) and p not in _HELD and p not in _WARNED:
            _WARNED[p] = True
            missed[name] = [i for i, f in enumerate(flags) if not f]
        reach = _REACH.get(p)
        if p.grad is None or _grad_key(p) == before:  # torch.autograd.grad
            if reach is None:
                _REACH[p] = _Reach([True] * len(flags), None, flags)
            else:
                reach.given = flags
        else:
            if before is not None:  # accumulated into a .grad every member had, or these
                had = _members(p, reach) or [True] * len(flags)
                flags = [a or b for a, b in zip(had, flags, strict=True)]
            _REACH[p] = _Reach(flags, weakref.ref(p.grad))
    if missed:
        _warn(missed)


def _members(p: Tensor, reach: _Reach | None) -> list[bool] | None:
    """The members whose ``.grad`` of ``p`` alone would be a tensor, for its ``.grad`` now."""
    if reach is None or p.grad is None:
        return None
    if reach.grad is None or reach.grad() is not p.grad:  # a .grad set by hand
        if reach.given is not None:  # from what torch.autograd.grad gave
            reach.members, reach.given = reach.given, None
        reach.grad = weakref.ref(p.grad)
    return reach.members


def _warn(missed: dict[str, list[int]]) -> None:
    which = ", ".join(f"`{name}` (members {rows})" for name, rows in sorted(missed.items()))
    warnings.warn(
        f"backend='loop': some members never read {which} in this backward; alone, their "
        "`.grad` would stay None and the optimizer would skip it. A torch.optim optimizer on "
        "the ensemble's stacked parameters steps their zero rows (weight decay, momentum and "
        "Adam's moments move them), so those members would not train as alone. Use a stacked "
        "optimizer of vmapens (vmapens.StackedSGD, vmapens.StackedAdam, ...): it skips those "
        "rows, as torch.optim skips the parameter alone (docs/semantics.md, backends).",
        UserWarning,
        stacklevel=2,
    )


def reached_rows(params: list[Tensor]) -> list[Tensor | None]:
    """``reached`` of each of ``params``; empty (all reached) while no backward noted any
    (the vmap backend's steps: no lookup per parameter)."""
    return [reached(p) for p in params] if _REACH else []


def reached(p: Tensor) -> Tensor | None:
    """The members whose ``.grad`` of ``p`` alone would be a tensor (bool ``[n]``, on ``p``'s
    device), or None where every member's would (or none was watched)."""
    members = _members(p, _REACH.get(p))
    if members is None or all(members):
        return None
    grad = p.grad
    assert grad is not None  # _members: None without a .grad
    flags = torch.tensor(members, device=grad.device)
    if grad.layout == torch.strided and grad.dim() > 0:  # reached by another path too
        flags |= grad.flatten(1).ne(0).any(1)
    return None if bool(flags.all()) else flags
