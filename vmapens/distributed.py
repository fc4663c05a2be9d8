"""Member sharding over ``torch.distributed``: each process trains its own block of members.

Members never talk to each other while training, so a sharded ensemble needs no
communication until the end: every rank builds and trains its contiguous block of global
member ids, and ``vmapens.gather`` collects the stacked tensors onto one rank afterwards.
This module knows no Ensemble: it deals in member ids, tensors and floats.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "all_reduce_stats",
    "broadcast_object",
    "gather_rows",
    "member_block",
    "member_blocks",
    "barrier",
    "claim",
    "raise_together",
    "rank",
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


def gather_rows(t: torch.Tensor, blocks: list[range], dst: int | None) -> torch.Tensor | None:
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
    # gloo has no bool or complex collectives (torch.distributed.gather takes no complex
    # tensors on any backend): send bools as bytes, complex numbers as (real, imag) pairs.
    wire = t.detach().to(device)
    if t.dtype == torch.bool:
        wire = wire.to(torch.uint8)
    elif t.is_complex():
        wire = torch.view_as_real(wire.resolve_conj())
    padded = torch.zeros((size, *wire.shape[1:]), dtype=wire.dtype, device=device)
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
    rows = torch.view_as_complex(rows) if t.is_complex() else rows
    return rows.to(device=t.device, dtype=t.dtype)


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


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` (picklable) on every rank; ``obj`` itself without a group.

    A collective: every rank must call it at the same point.

    Example:
        >>> broadcast_object({"run": "abc"})
        {'run': 'abc'}
    """
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=_comm_device())
    return box[0]


def barrier() -> None:
    """Wait until every rank of the default group gets here; nothing without a group.

    Example:
        >>> barrier()  # no process group: returns at once
    """
    if world_size() > 1:
        dist.barrier()


def raise_together(
    api: str,
    err: BaseException | None,
    value: Any = None,
    what: str = "failed, so every rank stops",
) -> list[Any]:
    """Every rank's ``value``, in rank order; but if any rank failed, raise on every rank:
    ``err`` where it happened, on the others a ``RuntimeError``
    ``"{api}: rank {r} {what}: {its error}"``.

    A rank that raised alone would leave the others waiting in the next collective until the
    group's timeout (30 minutes by default). A collective (one ``all_gather_object``): every
    rank must call it at the same point, with its own error or None.

    Example:
        >>> raise_together("fit", None, 3)  # no process group, no error: this rank's value
        [3]
    """
    if world_size() == 1:
        if err is not None:
            raise err
        return [value]
    said: list[Any] = [None] * world_size()
    dist.all_gather_object(said, (value, None if err is None else f"{type(err).__name__}: {err}"))
    if err is not None:
        raise err
    for r, (_, message) in enumerate(said):
        if message is not None:
            raise RuntimeError(f"{api}: rank {r} {what}: {message}")
    return [v for v, _ in said]


def claim(key: str, value: str, renew: Callable[[str], bool] = lambda held: False) -> str:
    """The value the rank that claimed ``key`` in the default process group gave: ``value``
    if no rank had (this rank claims it now) or if ``renew(held)`` says the holder's value
    ``held`` may be replaced (this rank's own, say), else the holder's. ``value`` without a
    group, or where the group's store cannot be reached (nothing can be told then).

    Not a collective: it reads and sets ``key`` in the group's store atomically
    (``compare_set``), so it tells a rank that another rank got somewhere first (into one
    directory) without the others calling anything.

    Example:
        >>> claim("save_members:/tmp/members", "0")  # no process group: this rank's value
        '0'
    """
    if world_size() == 1:
        return value
    try:  # torch has no public way to the default group's store
        store = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return value
    got = store.compare_set(f"vmapens/{key}", "", value)
    held = got.decode() if isinstance(got, bytes) else str(got)
    if held != value and renew(held):
        store.set(f"vmapens/{key}", value)
        return value
    return held
