"""PBT's new per-member hyperparameters, computed on the side: rows copied (``exploit_``) and
perturbed (``explore``), each as new values that the caller writes only once all are made and
checked, so that a refused value changes nothing; and the copies' schedulers' base lrs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .optim import MemberValues, StackedOptimizer
from .optim._hyper import as_member_values

__all__ = ["copied_hypers", "inherit_base_lrs", "perturbed_hypers"]


def copied_hypers(
    groups: list[dict[str, Any]], n: int, s: Tensor, d: Tensor
) -> list[dict[str, Any]]:
    """Each param group's per-member hyperparameters with rows ``d`` taken from rows ``s``,
    as new values (the groups are left as they are)."""
    out = []
    for group in groups:
        copied: dict[str, Any] = {}
        for key, value in group.items():
            if key == "params":  # the stacked parameters: a member's scalar one is [n]
                continue
            if _per_member(value, n):
                copied[key] = _copy_rows(value, s, d)
            elif isinstance(value, (tuple, list)) and any(_per_member(v, n) for v in value):
                copied[key] = type(value)(
                    _copy_rows(v, s, d) if _per_member(v, n) else v for v in value
                )
        out.append(copied)
    return out


def _per_member(value: Any, n: int) -> bool:
    """Whether a param-group value holds one hyperparameter per member: ``MemberValues``, or
    a 1-D tensor of ``n`` values (which the step reads as ``MemberValues``)."""
    if isinstance(value, MemberValues):
        return True
    return isinstance(value, Tensor) and value.dim() == 1 and len(value) == n


def _copy_rows(values: Any, s: Tensor, d: Tensor) -> Any:
    if isinstance(values, Tensor):  # a new tensor: the group's old one may be held elsewhere
        out = values.detach().clone()
        out[d.to(out.device)] = values.detach()[s.to(out.device)]
        return out
    rows = list(values)
    for i, j in zip(s.tolist(), d.tolist(), strict=True):
        rows[j] = values[i]
    return MemberValues(rows)


def perturbed_hypers(
    api: str,
    optimizer: StackedOptimizer,
    groups: list[dict[str, Any]],
    rows: list[int],
    factors: list[float],
    generator: torch.Generator | None,
    names: Sequence[str],
) -> list[tuple[int, str, MemberValues]]:
    """``explore``'s draws and checked new values ``(group index, name, values)``; no writes."""
    n, hypers, out = optimizer.num_members, optimizer.hyperparameters, []
    for name in names:
        draws = torch.randint(len(factors), (len(rows),), generator=generator).tolist()
        for k, group in enumerate(groups):
            value = as_member_values(group[name])  # a 1-D tensor: n values, as the step reads
            values = list(value) if isinstance(value, MemberValues) else [float(value)] * n
            for row, f in zip(rows, draws, strict=True):
                values[row] *= factors[f]
            hyper = hypers[name]
            for row, v in enumerate(values):
                if not hyper.ok(v):
                    raise ValueError(
                        f"{api}: member {row}'s `{name}` would become {v}, must be {hyper.rule}"
                    )
            out.append((k, name, MemberValues(values)))
    return out


def inherit_base_lrs(callbacks: Sequence[Any], n: int, s: Tensor, d: Tensor) -> None:
    """Copies take their sources' base lrs (CosineAnnealingLR restarts from them)."""
    for cb in callbacks:
        top = getattr(cb, "scheduler", None)
        for sched in [top, *getattr(top, "_schedulers", [])]:
            base = getattr(sched, "base_lrs", None)
            if isinstance(base, list):
                sched.base_lrs = [_copy_rows(v, s, d) if _per_member(v, n) else v for v in base]
