"""Validation metrics of ``fit``: each member's, and the averaged ensemble's, in one forward."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from .losses import per_member

__all__ = ["Metric", "check_metrics", "metric_pair", "score"]

Metric = tuple[Callable[[Any, Tensor], Tensor], Callable[[Any, Tensor], Tensor]]


def metric_pair(fn: Any) -> Metric:
    """A metric as (members' outputs ``[n, ...]`` -> ``[n]``, one output -> scalar).

    A callable ``(output, target) -> scalar`` is vmapped over the members like the loss; an
    object with ``reset``/``update``/``compute`` (a torchmetrics ``Metric``) runs member by
    member, since its accumulated state cannot be batched.
    """
    if all(callable(getattr(fn, a, None)) for a in ("reset", "update", "compute")):

        def single(out: Tensor, y: Tensor) -> Tensor:
            fn.reset()
            fn.update(out, y)
            value = torch.as_tensor(fn.compute())
            fn.reset()
            return value

        def members(out: Tensor, y: Tensor) -> Tensor:
            return torch.stack([single(o, y) for o in out])

        return members, single
    return per_member(fn), fn


def score(
    metrics: Mapping[str, Metric], out: Any, y: Tensor, diverged: Tensor
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Every metric per member (float64 ``[n]``) and of the output averaged over the members
    that have not diverged (float64 0-dim), on the CPU."""
    if not metrics:
        return {}, {}
    kept = ~diverged.to(out.device)
    mean = out[kept].mean(0) if bool(kept.any()) else out.mean(0)
    per = {k: m(out, y).double().cpu() for k, (m, _) in metrics.items()}
    whole = {k: torch.as_tensor(one(mean, y)).double().cpu() for k, (_, one) in metrics.items()}
    return per, whole


def check_metrics(api: str, metrics: Mapping[str, Any]) -> None:
    """``metrics`` maps names to callables ``(output, target) -> scalar`` or metric objects."""
    for k, fn in metrics.items():
        if not isinstance(k, str) or not (callable(fn) or hasattr(fn, "compute")):
            raise TypeError(
                f"{api}: `metrics` must map names to callables (output, target) -> scalar, got "
                f"{k!r}: {type(fn).__name__}"
            )
