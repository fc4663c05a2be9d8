"""Sharded ensembles: collect every rank's members (and History) onto one rank."""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist

from .distributed import gather_rows, member_blocks, rank, world_size
from .ensemble import Ensemble
from .history import History

__all__ = ["gather", "gather_history"]


def _check_sharded(ens: Ensemble, api: str) -> list[range]:
    """The blocks of a sharded ensemble, after checking that ``ens`` is this rank's block."""
    blocks = member_blocks(ens.n_total, dist.get_world_size())
    mine = blocks[dist.get_rank()]
    if ens.member_ids != mine:
        raise ValueError(
            f"{api}: `ens` holds members {ens.member_ids} of {ens.n_total}, but rank "
            f"{dist.get_rank()}'s block is {mine}; build it with shard=True on every rank"
        )
    return blocks


def _check_dst(dst: Any, api: str) -> None:
    if not isinstance(dst, int) or isinstance(dst, bool):
        raise TypeError(f"{api}: `dst` must be an int, got {type(dst).__name__}")
    if not 0 <= dst < world_size():
        raise ValueError(f"{api}: `dst` must be a rank in [0, {world_size()}), got {dst}")


def gather(ens: Ensemble, dst: int = 0) -> Ensemble | None:
    """Collect a sharded ensemble onto rank ``dst``: all ``n_total`` members, in global order.

    A collective: every rank of the default group must call it. Each stacked parameter and
    buffer is gathered with one ``torch.distributed.gather`` of the rank blocks (padded to
    the largest block), on the group's device (CUDA for nccl, CPU for gloo). Optimizer state
    and gradients are not gathered.

    Args:
        ens: this rank's block, built with ``shard=True``.
        dst: the rank that receives the full ensemble.

    Returns:
        On ``dst``, a new Ensemble with ``member_ids == range(ens.n_total)`` on the device of
        ``dst``'s block; ``None`` on the other ranks. Without a process group (or with one
        process) there is nothing to gather and ``ens`` itself is returned.

    Raises:
        TypeError: ``dst`` is not an int.
        ValueError: ``dst`` is not a rank, or ``ens`` is not this rank's block.

    Example:
        >>> from torch import nn
        >>> from vmapens import Ensemble
        >>> ens = Ensemble(lambda: nn.Linear(3, 2), n=4, seed=0)
        >>> gather(ens) is ens  # single process: already whole
        True
    """
    _check_dst(dst, "gather")
    if world_size() == 1:
        if len(ens) != ens.n_total:
            raise ValueError(
                f"gather: `ens` holds {len(ens)} of {ens.n_total} members and there is no "
                "other process to gather the rest from"
            )
        return ens
    blocks = _check_sharded(ens, "gather")
    memo: dict[int, Any] = {}
    for t in [*ens.parameters(), *ens.buffers()]:
        rows = gather_rows(t, blocks, dst)
        if rows is not None:
            is_param = isinstance(t, torch.nn.Parameter)
            memo[id(t)] = torch.nn.Parameter(rows, t.requires_grad) if is_param else rows
    if rank() != dst:
        return None
    # The memo hands deepcopy the gathered tensors in place of the local ones, so the copy
    # keeps every other attribute (template, backend, state-dict keys) of the local block.
    full = copy.deepcopy(ens, memo)
    full.member_ids = range(ens.n_total)
    return full


def gather_history(history: History, dst: int = 0) -> History | None:
    """Collect each rank's ``History`` from ``fit`` onto rank ``dst``, members in global order.

    A collective: every rank of the default group must call it. Per-member columns are
    concatenated in rank order (``[epochs, n]`` tables along dim 1, ``[n]`` vectors along
    dim 0, ``member_ids`` lists joined); a rank whose members all stopped early recorded
    fewer epochs, and its missing rows are NaN, as for any member that stopped. Per-member
    ``metrics`` are gathered like the losses; ``ensemble_metrics`` scored each rank's own
    block of members, not the whole ensemble, so the merged history has ``None`` there
    (score the gathered ensemble with ``vmapens.predict`` instead).

    Args:
        history: this rank's ``History`` (a dataclass whose fields are per-member).
        dst: the rank that receives the merged history.

    Returns:
        On ``dst`` a ``History`` of all ``n_total`` members, ``None`` elsewhere;
        ``history`` itself without a process group (or with one process).

    Raises:
        TypeError: ``dst`` is not an int.
        ValueError: ``dst`` is not a rank.
    """
    _check_dst(dst, "gather_history")
    if world_size() == 1:
        return history
    parts: list[Any] | None = [None] * world_size() if rank() == dst else None
    # Histories are small (epochs x members floats): pickling beats one collective per field.
    dist.gather_object(history, parts, dst=dst)
    if parts is None:
        return None
    merged = {}
    for f in dataclasses.fields(history):
        values = [getattr(p, f.name) for p in parts]
        merged[f.name] = None if f.name == "ensemble_metrics" else _merge_columns(values)
    return dataclasses.replace(parts[0], **merged)


def _merge_columns(values: list[Any]) -> Any:
    first = values[0]
    if first is None:
        return None
    if isinstance(first, dict):  # per-metric tables
        return {k: _merge_columns([v[k] for v in values]) for k in first}
    if isinstance(first, list):
        return [v for part in values for v in part]
    if first.dim() == 1:
        return torch.cat(values)
    rows = max(v.shape[0] for v in values)
    padded = [torch.cat([v, v.new_full((rows - v.shape[0], v.shape[1]), math.nan)]) for v in values]
    return torch.cat(padded, dim=1)
