"""Sharded ensembles: collect every rank's members (and History) onto one rank, and write
checkpoints keyed by global member id, so a sharded run resumes at any world size (their
layout, and the reading of it, is ``vmapens._checkpoint_files``'s)."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ._checkpoint_files import ROWS, block_name, parts_dir, split_rows, write
from ._files import remove_stale_temps
from .distributed import barrier, gather_rows, member_blocks, rank, world_size
from .ensemble import Ensemble
from .history import History

__all__ = ["gather", "gather_history", "parts_dir", "save_sharded"]


def _agreed_blocks(ens: Ensemble | None, dst: int, api: str) -> list[range]:
    """Every rank's ``(dst, members)``, checked on every rank alike; the blocks of ``ens``.

    One small ``all_gather_object`` first: a rank whose ``dst`` or ensemble differs would
    otherwise fail alone while the others wait in the collective that follows until the
    group's timeout (30 minutes by default). Here every rank raises the same error at once.
    """
    mine = None if ens is None else (ens.member_ids, ens.n_total)
    held: list[Any] = [None] * world_size()
    dist.all_gather_object(held, (dst, mine))
    dsts = [d for d, _ in held]
    if any(type(d) is not type(dst) or d != dst for d in dsts):
        raise ValueError(f"{api}: every rank must pass the same `dst`, got {dsts} by rank")
    _check_dst(dst, api)
    if ens is None:
        return []
    totals = [n for _, (_, n) in held]
    if len(set(totals)) > 1:
        raise ValueError(
            f"{api}: the ranks' ensembles have different sizes `n_total` {totals} (by rank); "
            "build the same ensemble with shard=True on every rank"
        )
    blocks = member_blocks(totals[0], len(held))
    for r, ((_, (ids, n)), block) in enumerate(zip(held, blocks, strict=True)):
        if list(ids) != list(block):
            raise ValueError(
                f"{api}: rank {r}'s `ens` holds members {ids!r:.60} of {n}, but rank {r}'s block is "
                f"{block}; build it with shard=True on every rank"
            )
    return blocks


def _check_dst(dst: Any, api: str) -> None:
    if not isinstance(dst, int) or isinstance(dst, bool):
        raise TypeError(f"{api}: `dst` must be an int, got {type(dst).__name__}")
    if not 0 <= dst < world_size():
        raise ValueError(f"{api}: `dst` must be a rank in [0, {world_size()}), got {dst}")


def gather(ens: Ensemble, dst: int = 0) -> Ensemble | None:
    """Collect a sharded ensemble onto rank ``dst``: all ``n_total`` members, in global order.

    A collective: every rank of the default group must call it, with the same ``dst``. The
    ranks first agree that each holds its block (one small ``all_gather_object``), so a
    mismatch is an error on every rank rather than a hang. Each stacked parameter and buffer
    is gathered with one ``torch.distributed.gather`` of the rank blocks (padded to
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
        ValueError: ``dst`` is not a rank or differs between ranks, or some rank's ``ens`` is
            not its block (raised on every rank).

    Example:
        >>> from torch import nn
        >>> from vmapens import Ensemble
        >>> ens = Ensemble(lambda: nn.Linear(3, 2), n=4, seed=0)
        >>> gather(ens) is ens  # single process: already whole
        True
    """
    if world_size() == 1:
        _check_dst(dst, "gather")
        if len(ens) != ens.n_total:
            raise ValueError(
                f"gather: `ens` holds {len(ens)} of {ens.n_total} members and there is no "
                "other process to gather the rest from"
            )
        return ens
    blocks = _agreed_blocks(ens, dst, "gather")  # checks `dst` too, on every rank alike
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

    A collective: every rank of the default group must call it, with the same ``dst``
    (checked on every rank first). Per-member columns are
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
        ValueError: ``dst`` is not a rank, or differs between ranks.
    """
    if world_size() == 1:
        _check_dst(dst, "gather_history")
        return history
    _agreed_blocks(None, dst, "gather_history")
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


# -- sharded checkpoints: writing (the layout, and reading it, is vmapens._checkpoint_files') ---
#
# Each rank writes its rows to a block file named by its global member ids; rank 0 then writes
# the rest (the shared loop state and the list of block files) to `path`, atomically, once
# every block is on disk.


def save_sharded(
    path: str | os.PathLike, payload: dict, member_ids: Sequence[int]
) -> tuple[int, ...] | None:
    """Write this rank's rows of a fit checkpoint, then (rank 0) the shared part at ``path``.

    A collective: every rank calls it after the same epoch. ``path`` is replaced only once every
    block is on disk, so a crash anywhere leaves the previous checkpoint whole; block files that
    no checkpoint names any more are removed afterwards. Blocks and checkpoint carry the run's
    identity and epoch (``payload["run"]``, ``payload["epoch"]``) and the global step.

    Returns:
        On rank 0 the ``signature`` of the checkpoint written, None elsewhere.
    """
    ids = list(member_ids)
    epoch = payload["epoch"]
    # Who wrote a block, and when: resume takes blocks of the checkpoint's run and epoch only.
    identity = {"run": payload["run"], "epoch": epoch, "step": payload["fit"]["global_step"]}
    shared, rows = _same_layout(*split_rows(payload, len(ids)), len(ids))
    blocks = parts_dir(path)
    blocks.mkdir(parents=True, exist_ok=True)
    name = block_name(ids, epoch)
    write(blocks / name, {"member_ids": ids, "rows": rows, **identity}, "fit")
    listed: list[Any] = [None] * world_size()
    dist.all_gather_object(listed, (name, ids))  # also: every block is written
    written = None
    if rank() == 0:
        members = {**shared["members"], "member_ids": [i for _, b in listed for i in b]}
        written = write(path, {**shared, "members": members, "blocks": listed, **identity}, "fit")
        drop_blocks(path, keep={b for b, _ in listed})
    barrier()
    return written


def _same_layout(shared: dict, rows: list[tuple], n: int) -> tuple[dict, list[tuple]]:
    """Every rank's block at the union of the ranks' per-member entries.

    Blocks can differ in which entries are per member: SGD and RMSprop keep no
    ``momentum_buffer`` for a block whose members all have ``momentum=0`` (as ``torch.optim``
    keeps none for such a model alone), and ``vmapens.optim.ReduceLROnPlateau`` turns a shared
    learning rate into one per member only on the ranks where it lowered some. Every block
    must hold each row the shared part names, so a block that lacks one gets it: zeros for
    state (a member without momentum never reads its buffer), its shared value once per member
    for a hyperparameter; and rank 0's shared part names every entry some block holds. One
    small ``all_gather_object`` of the ranks' layouts; every rank takes the same decisions.
    """
    mine = {
        p: (kind, dim, None if kind != "tensor" else (v.shape[:dim], v.shape[dim + 1 :], v.dtype))
        for p, kind, dim, v in rows
    }
    layouts: list[Any] = [None] * world_size()
    dist.all_gather_object(layouts, mine)
    union: dict[tuple, Any] = {}
    for layout in layouts:
        for p, spec in layout.items():
            union.setdefault(p, spec)
    odd = sorted(str(p) for p, (kind, _, _) in union.items() if kind == "list" and any(
        p not in layout for layout in layouts))  # fmt: skip
    if odd:  # raised on every rank alike
        raise ValueError(
            f"fit: the ranks' checkpoint blocks differ in the per-member entries {odd[:4]} "
            "(some ranks hold them, some not); run the same fit call, with the same callbacks, "
            "on every rank"
        )
    rows = list(rows)
    for p, (kind, dim, spec) in union.items():
        if p in mine:
            continue
        node = shared
        for key in p[:-1]:  # param_groups is a list; an optimizer's state a dict of dicts
            node = node[key] if isinstance(node, list) else node.setdefault(key, {})
        if kind == "values":  # a hyperparameter this block's members share
            rows.append((p, kind, dim, [float(node[p[-1]])] * n))
        else:
            before, after, dtype = spec
            rows.append((p, kind, dim, torch.zeros((*before, n, *after), dtype=dtype)))
        node[p[-1]] = ROWS
    return shared, rows


def drop_blocks(path: str | os.PathLike, keep: frozenset[str] | set[str] = frozenset()) -> None:
    """Remove the block files (and unlocked temporary files) next to ``path`` not in ``keep``."""
    blocks = parts_dir(path)
    if not blocks.is_dir():
        return
    for old in blocks.glob("members-*.pt"):
        if old.name not in keep:
            old.unlink(missing_ok=True)
    remove_stale_temps(blocks)
    if not keep and not any(blocks.iterdir()):
        blocks.rmdir()
