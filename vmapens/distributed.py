"""Member sharding over ``torch.distributed``: each process trains its own block of members.

Members never talk to each other while training, so a sharded ensemble needs no
communication until the end: every rank builds and trains its contiguous block of global
member ids, and :func:`gather` collects the stacked tensors onto one rank afterwards.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .ensemble import Ensemble

__all__ = [
    "all_reduce_stats",
    "gather",
    "gather_history",
    "member_block",
    "member_blocks",
    "rank",
    "rank_path",
    "world_size",
]


def _initialised() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank in the default process group, 0 without one.

    Example:
        >>> rank()
        0
    """
    return dist.get_rank() if _initialised() else 0


def world_size() -> int:
    """The number of processes in the default process group, 1 without one.

    Example:
        >>> world_size()
        1
    """
    return dist.get_world_size() if _initialised() else 1


def member_blocks(n: int, world_size: int) -> list[range]:
    """Split global member ids ``0..n-1`` into ``world_size`` contiguous blocks.

    Blocks differ by at most one member; the first ``n % world_size`` ranks get the extra
    one. This is the assignment ``Ensemble(..., shard=True)`` uses.

    Args:
        n: total number of members, ``>= 1``.
        world_size: number of processes, ``1 <= world_size <= n``.

    Returns:
        One ``range`` of global member ids per rank, in rank order.

    Raises:
        TypeError: ``n`` or ``world_size`` is not an int.
        ValueError: ``n < 1``, ``world_size < 1`` or ``world_size > n`` (a rank would hold
            no members).

    Example:
        >>> member_blocks(7, 2)
        [range(0, 4), range(4, 7)]
    """
    for name, value in (("n", n), ("world_size", world_size)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"member_blocks: `{name}` must be an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"member_blocks: `{name}` must be >= 1, got {value}")
    if world_size > n:
        raise ValueError(
            f"member_blocks: world size {world_size} > `n`={n} would leave "
            f"{world_size - n} rank(s) without members; launch at most {n} processes"
        )
    base, extra = divmod(n, world_size)
    bounds = [r * base + min(r, extra) for r in range(world_size + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def member_block(n: int, api: str = "member_block") -> range:
    """Global member ids of this rank's block (see :func:`member_blocks`).

    Args:
        n: total number of members.
        api: name of the public API asking, for error messages (``Ensemble`` passes its own).

    Returns:
        This rank's contiguous ``range`` of global member ids.

    Raises:
        RuntimeError: no ``torch.distributed`` process group is initialised.
        ValueError: the world size exceeds ``n``.

    Example:
        >>> try:
        ...     member_block(8, "Ensemble")
        ... except RuntimeError as err:
        ...     print(str(err)[:46])
        Ensemble: `shard=True` needs an initialised to
    """
    if not _initialised():
        raise RuntimeError(
            f"{api}: `shard=True` needs an initialised torch.distributed process group; call "
            "torch.distributed.init_process_group(...) first, or launch the script with torchrun "
            "(torchrun --nproc-per-node N script.py), or pass shard=False"
        )
    world = dist.get_world_size()
    if world > n:
        raise ValueError(
            f"{api}: `shard=True` with world size {world} > `n`={n} would leave rank(s) "
            f"without members; launch at most {n} processes or build more members"
        )
    return member_blocks(n, world)[dist.get_rank()]


def _comm_device() -> torch.device:
    """Where tensors must be for the default group's collectives."""
    if dist.get_backend() == "nccl":
        # torchrun users set this from LOCAL_RANK (torch.cuda.set_device).
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather_rows(t: torch.Tensor, blocks: list[range], dst: int | None) -> torch.Tensor | None:
    """Concatenate every rank's ``[len(block), ...]`` tensor along dim 0.

    Rows are padded to the largest block so one fixed-shape collective does it; ``dst=None``
    gives the result to every rank, otherwise only to ``dst`` (None elsewhere).
    """
    me, size = dist.get_rank(), max(len(b) for b in blocks)
    full_shape = (sum(len(b) for b in blocks), *t.shape[1:])
    if t.numel() == 0:
        # A zero-size member tensor (every rank has one, since no block is empty) carries no
        # data: every rank skips the collective alike.
        return (
            torch.empty(full_shape, dtype=t.dtype, device=t.device) if dst in (None, me) else None
        )
    device = _comm_device()
    # gloo has no bool collectives: send bools as bytes.
    wire = t.detach().to(device)
    wire = wire.to(torch.uint8) if t.dtype == torch.bool else wire
    padded = torch.zeros((size, *t.shape[1:]), dtype=wire.dtype, device=device)
    padded[: len(t)] = wire
    parts: list[torch.Tensor] | None
    if dst is None:
        parts = [torch.empty_like(padded) for _ in blocks]
        dist.all_gather(parts, padded)
    else:
        parts = [torch.empty_like(padded) for _ in blocks] if me == dst else None
        dist.gather(padded, parts, dst=dst)
        if parts is None:
            return None
    rows = torch.cat([p[: len(b)] for p, b in zip(parts, blocks)])
    return rows.to(device=t.device, dtype=t.dtype)


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
        rows = _gather_rows(t, blocks, dst)
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


def gather_history(history: Any, dst: int = 0) -> Any:
    """Collect each rank's ``History`` from ``fit`` onto rank ``dst``, members in global order.

    A collective: every rank of the default group must call it. Per-member columns are
    concatenated in rank order (``[epochs, n]`` tables along dim 1, ``[n]`` vectors along
    dim 0, ``member_ids`` lists joined); a rank whose members all stopped early recorded
    fewer epochs, and its missing rows are NaN, as for any member that stopped.

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
        merged[f.name] = _merge_columns(values)
    return dataclasses.replace(parts[0], **merged)


def _merge_columns(values: list[Any]) -> Any:
    first = values[0]
    if first is None:
        return None
    if isinstance(first, list):
        return [v for part in values for v in part]
    if first.dim() == 1:
        return torch.cat(values)
    rows = max(v.shape[0] for v in values)
    padded = [torch.cat([v, v.new_full((rows - v.shape[0], v.shape[1]), math.nan)]) for v in values]
    return torch.cat(padded, dim=1)


def all_reduce_stats(
    stats: Mapping[str, float | torch.Tensor], op: str = "sum"
) -> dict[str, float]:
    """Reduce named floats over all ranks (every rank gets the result); identity without a group.

    For progress lines that report the whole ensemble: summed member losses and member counts
    (``op="sum"``), the lowest and highest member loss (``"min"``, ``"max"``). A collective:
    every rank must call it at the same point with the same names.

    Args:
        stats: name -> float (or 0-dim tensor); every rank passes the same names.
        op: ``"sum"``, ``"min"`` or ``"max"``.

    Returns:
        name -> the reduction over ranks, as floats.

    Example:
        >>> all_reduce_stats({"loss_sum": 3.0, "members": 4})
        {'loss_sum': 3.0, 'members': 4.0}
    """
    ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
    if op not in ops:
        raise ValueError(f"all_reduce_stats: `op` must be one of {sorted(ops)}, got {op!r}")
    names = sorted(stats)
    values = torch.tensor([float(stats[k]) for k in names], dtype=torch.float64)
    if world_size() > 1:
        values = values.to(_comm_device())
        dist.all_reduce(values, op=ops[op])
    return dict(zip(names, values.tolist(), strict=True))


def rank_path(path: str | os.PathLike) -> Path:
    """This rank's own file for ``path``: ``ckpt.pt`` -> ``ckpt.rank1-of-2.pt`` in a group.

    The world size is part of the name, so resuming with a different number of processes
    finds no checkpoint instead of loading another block's members. Without a process group
    the path is returned unchanged.

    Args:
        path: the checkpoint path the user gave.

    Returns:
        The path this rank reads and writes.

    Example:
        >>> rank_path("runs/ckpt.pt").as_posix()
        'runs/ckpt.pt'
    """
    path = Path(path)
    if not _initialised():
        return path
    tag = f".rank{dist.get_rank()}-of-{dist.get_world_size()}"
    return path.with_name(path.stem + tag + path.suffix)
