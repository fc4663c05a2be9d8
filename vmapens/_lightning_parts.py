"""Argument checks of ``vmapens.lightning.EnsembleModule`` that need no ``lightning``."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from ._data import rows_of
from .callbacks.scheduler import step_keeping
from .optim import StackedOptimizer

__all__ = ["batch_rows", "check_optimizer_arg", "is_metric_object", "step_kept"]


def check_optimizer_arg(api: str, optimizer: Any) -> None:
    """Refuse an ``optimizer`` that is neither a StackedOptimizer nor a callable building one.

    torch's optimizer classes are callables too, but ``torch.optim.Adam(ens)`` fails deep in
    torch (it iterates the members, which are modules), at ``trainer.fit``, naming no argument:
    they are refused here, with the stacked class to use instead.
    """
    if optimizer is None or isinstance(optimizer, StackedOptimizer):
        return
    if not callable(optimizer):
        raise TypeError(
            f"{api}: `optimizer` must be a vmapens.StackedOptimizer or a callable (ens) -> "
            f"StackedOptimizer, got {type(optimizer).__name__}"
        )
    built = optimizer
    while isinstance(built, functools.partial):
        built = built.func
    if (
        isinstance(built, type)
        and issubclass(built, torch.optim.Optimizer)
        and not issubclass(built, StackedOptimizer)
    ):
        name = built.__name__
        raise TypeError(
            f"{api}: `optimizer` must build a vmapens.StackedOptimizer, got torch's {name}, "
            f"which cannot take an Ensemble; pass its stacked twin, called with the same "
            f"arguments: functools.partial(vmapens.optim.stacked(torch.optim.{name}), lr=...)"
        )


def is_metric_object(fn: Any) -> bool:
    """An object that accumulates: ``reset``, ``update`` and ``compute`` (torchmetrics)."""
    return all(callable(getattr(fn, a, None)) for a in ("reset", "update", "compute"))


def batch_rows(targets: Any, member_dim: bool = False) -> int:
    """Rows of a batch's targets (dim 0, or dim 1 after the member dim): those of its first
    tensor, for targets that are a tuple, list or dict of tensors (a ``(y, weights)`` pair, as
    ``make_step`` takes); 1 when they hold none.

    ``rows_of`` on the tensors only: a collated batch may hold other leaves (a list of string
    ids, an int), which ``rows_of``'s (X, Y) tensors never do. torch's pytree, not optree's,
    finds the first: it keeps a dict's own key order, which optree sorts.
    """
    tensors = [t for t in tree_leaves(targets) if isinstance(t, torch.Tensor)]
    return int(rows_of(tensors, member_dim)) if tensors else 1


def step_kept(sched: Any, active: torch.Tensor, step: Callable[[], Any]) -> None:
    """``step()``, a step of ``sched``; the members not ``active`` keep their values, as their
    own runs, over, step their schedulers no more (``fit``'s rule: ``step_keeping``)."""
    shared = step_keeping(sched, getattr(sched, "optimizer", None), ~active.cpu(), step)
    if shared is not None:
        warnings.warn(
            f"EnsembleModule: the scheduler changed `{shared}`, a 0-d tensor, for the members "
            "that stopped too: give it as a float or one value per member to keep a stopped "
            "member's value",
            stacklevel=3,
        )
