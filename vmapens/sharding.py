"""Sharded ensembles: collect every rank's members (and History) onto one rank, and
checkpoints keyed by global member id, so a sharded run resumes at any world size."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .checkpoint import check_member_ids, read, remove_stale_temps, write
from .distributed import barrier, gather_rows, member_blocks, rank, world_size
from .ensemble import Ensemble
from .history import History
from .optim import MemberValues

__all__ = ["gather", "gather_history", "localise", "parts_dir", "save_sharded"]


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


# -- sharded checkpoints ------------------------------------------------------------------------
#
# A fit checkpoint is one dict of parts. Its per-member entries ("rows") are cut out by path:
# each rank writes its rows to a file of its own, named by its global member ids, in the
# directory parts_dir(path); rank 0 then writes the rest (the shared loop state and the list
# of block files) to `path`, atomically, once every block is on disk. Loading reads the rows of
# this process's members from whichever blocks hold them, at any world size.

_ROWS = "vmapens:rows"  # stands for a per-member entry in the shared part
_BLOCK = "members-{start:06d}-{stop:06d}.epoch{epoch:06d}.pt"
_BLOCK_NAME = re.compile(r"members-\d{6,}-\d{6,}\.epoch\d{6,}\.pt")  # a bare name, no path


def parts_dir(path: str | os.PathLike) -> Path:
    """The directory next to ``path`` that holds a sharded checkpoint's member blocks."""
    path = Path(path)
    return path.with_name(path.name + ".members")


def _row_kind(path: tuple, value: Any, n: int) -> tuple[str, int] | None:
    """(kind, member dim) of a per-member entry of a fit checkpoint, None for a shared one."""
    if isinstance(value, MemberValues):
        return ("values", 0) if len(value) == n else None
    top, key = path[0], path[1] if len(path) > 1 else None
    if isinstance(value, list):
        listed = (top == "history" and key == "member_ids") or (
            # vmapens.optim.ReduceLROnPlateau keeps one entry per member
            top == "scheduler" and key in ("best", "num_bad_epochs", "cooldown_counter")
        )
        return ("list", 0) if listed and len(value) == n else None
    if not isinstance(value, torch.Tensor):
        return None
    dim = None
    if top == "ensemble" or path[:2] in (("optimizer", "state"), ("fit", "best")):
        dim = 0
    elif top == "history":
        dim = 1 if key in ("train_loss", "val_loss", "metrics") else None
        dim = 0 if key in ("best_epoch", "stopped_epoch", "diverged") else dim
    elif top == "fit" and (key in ("active", "best_val", "bad") or key == "loss_scale"):
        dim = 0 if path[-1] in ("active", "best_val", "bad", "scale", "growth_tracker") else None
    if dim is None or value.dim() <= dim or value.shape[dim] != n:
        return None  # e.g. a plain torch optimizer's shared 0-dim `step`
    return "tensor", dim


def _walk(tree: Any, path: tuple, visit: Any) -> Any:
    """``tree`` rebuilt with ``visit(path, leaf)`` where it returns something other than ...;
    containers it returns ... for are rebuilt from their visited items."""
    out = visit(path, tree)
    if out is not ...:
        return out
    if isinstance(tree, dict):
        return {k: _walk(v, (*path, k), visit) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        items = [_walk(v, (*path, k), visit) for k, v in enumerate(tree)]
        return items if isinstance(tree, list) else tuple(items)
    return tree


def _split(payload: dict, n: int) -> tuple[dict, list[tuple]]:
    """(shared part with placeholders, rows [(path, kind, dim, value)]) of a fit payload."""
    rows: list[tuple] = []

    def visit(path: tuple, value: Any) -> Any:
        found = _row_kind(path, value, n) if path else None
        if found is None:
            return ...
        kind, dim = found
        rows.append((path, kind, dim, list(value) if kind != "tensor" else value))
        return _ROWS

    return _walk(payload, (), visit), rows


def _join(shared: dict, rows: list[tuple]) -> dict:
    """The inverse of :func:`_split` (``rows`` already cut to the members wanted)."""
    by_path = {path: (kind, value) for path, kind, _, value in rows}

    def visit(path: tuple, value: Any) -> Any:
        if not (isinstance(value, str) and value == _ROWS) or path not in by_path:
            return ...
        kind, held = by_path[path]
        return MemberValues(held) if kind == "values" else held

    return _walk(shared, (), visit)


def _take(paths: list[tuple], picks: Sequence[tuple[int, torch.Tensor]], held: list) -> list:
    """The rows at ``paths`` of the wanted members: from block ``held[b]`` (path -> row) the
    rows ``index``, for each ``(b, index)`` in ``picks``, concatenated in that order."""
    out = []
    for path, kind, dim in paths:
        pieces = [(held[b][path], index) for b, index in picks]
        if kind == "tensor":
            value: Any = torch.cat([v.index_select(dim, i) for v, i in pieces], dim=dim)
        else:
            value = [v[j] for v, i in pieces for j in i.tolist()]
        out.append((path, kind, dim, value))
    return out


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
    shared, rows = _split(payload, len(ids))
    blocks = parts_dir(path)
    blocks.mkdir(parents=True, exist_ok=True)
    name = _BLOCK.format(start=ids[0], stop=ids[-1] + 1, epoch=epoch)
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


def localise(payload: dict, path: str | os.PathLike, member_ids: Sequence[int]) -> dict:
    """A fit checkpoint's parts for the members ``member_ids`` only, from either layout.

    ``payload`` is what ``checkpoint.read(path)`` gave: a single file holding every member, or
    the shared part of a sharded checkpoint that names its block files. Per-member entries
    (parameters, buffers, optimizer state and per-member hyperparameters, history columns,
    early-stopping state) are cut to ``member_ids``, in that order; the rest is shared.

    Raises:
        ValueError: a block file is missing or unreadable, or no block holds some member.
    """
    where, wanted = os.fspath(path), list(member_ids)
    stored = list((payload.get("members") or {}).get("member_ids", []))
    if "blocks" not in payload:
        if stored == wanted:
            return payload
        shared, rows = _split(payload, len(stored))
        blocks = [(stored, rows)]
    else:
        shared = {k: v for k, v in payload.items() if k != "blocks"}
        blocks = [
            _read_block(path, payload, name, ids)
            for name, ids in _listed(payload, where)
            if set(ids) & set(wanted)
        ]
    where_is = {i: (b, j) for b, (ids, _) in enumerate(blocks) for j, i in enumerate(ids)}
    missing = [i for i in wanted if i not in where_is]
    if missing:
        raise ValueError(f"fit: {where} holds no state for members {missing[:8]}")
    picks: list[tuple[int, torch.Tensor]] = []
    for i in wanted:  # runs of consecutive rows from one block
        b, j = where_is[i]
        if picks and picks[-1][0] == b and int(picks[-1][1][-1]) == j - 1:
            picks[-1] = (b, torch.cat([picks[-1][1], torch.tensor([j])]))
        else:
            picks.append((b, torch.tensor([j])))
    held = [{path: value for path, _, _, value in rows} for _, rows in blocks]
    paths = [(path, kind, dim) for path, kind, dim, _ in blocks[0][1]]
    try:
        local = _join(shared, _take(paths, picks, held))
    except (RuntimeError, KeyError, IndexError, TypeError, AttributeError) as err:
        raise ValueError(
            f"fit: the member blocks of {where} do not fit together ({type(err).__name__}: {err})"
        ) from err
    local["members"] = {**local["members"], "member_ids": wanted}
    return local


def _listed(payload: dict, where: str) -> list[tuple[str, list[int]]]:
    """The ``(block file name, member ids)`` a sharded checkpoint names, checked."""
    listed = payload["blocks"]
    if not isinstance(listed, (list, tuple)):
        raise ValueError(f"fit: {where}: the block list is {type(listed).__name__}, not a list")
    out = []
    for entry in listed:
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[0], str)):
            raise ValueError(f"fit: {where}: a block entry is {entry!r:.80}, not (name, ids)")
        name, ids = entry
        if not _BLOCK_NAME.fullmatch(name):
            # A path (../x, /x, a/b) would read outside <checkpoint>.members/.
            raise ValueError(
                f"fit: {where} names the block {name!r:.80}, not a block file name in "
                f"{parts_dir(where)}"
            )
        ids, _ = check_member_ids(
            {"member_ids": ids, "n_total": payload["members"]["n_total"]}, "fit", where
        )
        out.append((name, ids))
    return out


def _read_block(path: str | os.PathLike, payload: dict, name: str, ids: list[int]) -> tuple:
    """``(member ids, rows)`` of block ``name``, which must be of the checkpoint's run and epoch."""
    file = parts_dir(path) / name
    try:
        block = read(file, "fit")
    except FileNotFoundError as err:
        raise ValueError(
            f"fit: {os.fspath(path)} names the block {file}, which is missing"
        ) from err
    theirs = {k: block.get(k) for k in ("run", "epoch", "member_ids")}
    ours = {"run": payload.get("run"), "epoch": payload.get("epoch"), "member_ids": ids}
    if theirs != ours:
        raise ValueError(
            f"fit: {file} is not the block {os.fspath(path)} names: it holds members "
            f"{theirs['member_ids']!r:.60} of run {theirs['run']} at epoch {theirs['epoch']}, "
            f"the checkpoint wants members {ids!r:.60} of run {ours['run']} at epoch "
            f"{ours['epoch']} (a block of another run, or left from an older epoch)"
        )
    if not isinstance(block.get("rows"), list):
        raise ValueError(f"fit: {file} holds no member rows")
    return ids, block["rows"]
