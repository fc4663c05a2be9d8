"""Validation metrics of ``fit``: each member's, and the averaged ensemble's, in one forward."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import optree
import torch
from torch import Tensor

from .losses import per_member

__all__ = ["Metric", "average", "check_metrics", "metric_pair", "score"]

Metric = tuple[Callable[[Any, Tensor], Tensor], Callable[[Any, Tensor], Tensor]]


def metric_pair(fn: Any) -> Metric:
    """A metric as (members' outputs ``[n, ...]`` -> ``[n]``, one output -> scalar).

    A callable ``(output, target) -> scalar`` is vmapped over the members like the loss (one
    that reads values, ``.item()`` included, runs on each member's output in turn); an
    object with ``reset``/``update``/``compute`` (a torchmetrics ``Metric``) runs member by
    member, since its accumulated state cannot be batched.
    """
    if all(callable(getattr(fn, a, None)) for a in ("reset", "update", "compute")):

        def single(out: Tensor, y: Tensor) -> Tensor:
            fn.reset()
            fn.update(out, y)
            value = _as_scalar(fn.compute())
            fn.reset()
            return value

        def members(out: Any, y: Tensor) -> Tensor:
            n = optree.tree_leaves(out)[0].shape[0]
            return torch.stack([single(member_of(out, i), y) for i in range(n)])

        return members, single

    # ``.item()`` gives a Python number, which ``per_member``'s member-by-member run (for what
    # vmap cannot batch) cannot stack: a metric needs no gradient, so it becomes a tensor.
    # Anything else goes on as it is, for the check to name.
    def scalar(out: Any, y: Any) -> Any:
        value = fn(out, y)
        return _as_scalar(value) if isinstance(value, (bool, int, float)) else value

    return per_member(scalar), scalar


def _as_scalar(value: Any) -> Tensor:
    """A metric object's value as a tensor: a Python number in float64, as exact as it is
    (``torch.as_tensor`` rounds a float to float32: 1/3 to 0.3333333433)."""
    if isinstance(value, Tensor):
        return value
    if isinstance(value, (bool, int, float)):
        return torch.tensor(value, dtype=torch.float64)
    return torch.as_tensor(value)


def score(
    metrics: Mapping[str, Metric], out: Any, y: Tensor, diverged: Tensor
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Every metric per member (float64 ``[n]``) and of the output averaged over the members
    that have not diverged (float64 0-dim), on the CPU."""
    if not metrics:
        return {}, {}
    kept = ~diverged.to(optree.tree_leaves(out)[0].device)
    mean = average(out, kept if bool(kept.any()) else None)
    per = {k: m(out, y).double().cpu() for k, (m, _) in metrics.items()}
    whole = {k: _as_scalar(one(mean, y)).double().cpu() for k, (_, one) in metrics.items()}
    return per, whole


def member_of(out: Any, i: int) -> Any:
    """Member ``i``'s output in the members' stacked output pytree."""
    return optree.tree_map(lambda t: t[i], out)


def average(out: Any, kept: Tensor | None = None) -> Any:
    """The members' output averaged over the members (those ``kept``), tensor by tensor: a
    member may return a tuple or dict of tensors, which its metric reads as it reads one
    member's output."""
    return optree.tree_map(lambda t: (t if kept is None else t[kept]).mean(0), out)


def check_metrics(api: str, metrics: Mapping[str, Any]) -> None:
    """``metrics`` maps names to callables ``(output, target) -> scalar`` or metric objects."""
    for k, fn in metrics.items():
        if not isinstance(k, str) or not (callable(fn) or hasattr(fn, "compute")):
            raise TypeError(
                f"{api}: `metrics` must map names to callables (output, target) -> scalar, got "
                f"{k!r}: {type(fn).__name__}"
            )
