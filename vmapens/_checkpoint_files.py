"""Checkpoint files as stored: the envelope (atomic write, checked read, version) and the
layout of a sharded fit checkpoint (member blocks in ``<path>.members/``), written and read.

Why a module of its own, below ``checkpoint.py`` and ``sharding.py``: ``sharding.py`` writes
a sharded checkpoint through the envelope, and ``checkpoint.py``'s ``load`` and ``restore``
read one in a single process, from its blocks, as ``fit`` reads it to resume. The reading
lived in ``sharding.py``, above ``checkpoint.py``, and imports go one way, so it moved here
with the envelope it reads through; both files import it, and it imports neither.

A fit checkpoint is one dict of parts. Its per-member entries ("rows") are cut out by path:
each rank writes its rows to a file of its own, named by its global member ids, in the
directory :func:`parts_dir` of the checkpoint; rank 0 then writes the rest (the shared loop
state and the list of block files) at the checkpoint's path. :func:`localise` reads the rows
of any members from whichever blocks hold them, at any world size, or in one process.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ._files import atomic_write, check_path, open_checked, seal_torch, torch_load
from .optim import MemberValues

__all__ = [
    "ROWS",
    "block_name",
    "check_member_ids",
    "describe_members",
    "localise",
    "members_way_out",
    "parts_dir",
    "read",
    "split_rows",
    "write",
]

FORMAT = "vmapens-checkpoint"
VERSION = 3  # 3: every file carries its SHA-256 digest


def write(path: str | os.PathLike, parts: Mapping[str, Any], api: str = "save") -> tuple[int, ...]:
    """Write ``parts`` (plain containers of tensors) to ``path`` atomically, with its digest.

    A ``torch.save`` zip whose comment holds the SHA-256 of its bytes, moved over ``path`` by
    one ``os.replace`` (``vmapens._files``): a crash at any point leaves the previous file whole.

    Returns:
        Which file is now at ``path`` (``vmapens._files.signature``), for ``check_owner``.

    Raises:
        OSError: the directory is missing or read-only, the disk is full or the file too
            large; the message says which and that the previous file is intact.
    """
    payload = {"format": FORMAT, "version": VERSION, **parts}
    return atomic_write(path, seal_torch(payload), api)


def read(path: str | os.PathLike, api: str, whole: bool = False) -> dict[str, Any]:
    """Read a checkpoint written by :func:`write`: digest, format and version checked; with
    ``whole``, a checkpoint (not a member block of a sharded one).

    Raises:
        TypeError: ``path`` is not a str or os.PathLike.
        FileNotFoundError: no file at ``path``.
        ValueError: a truncated, corrupt or changed file (its digest does not match),
            objects other than tensors and plain containers (possibly code), another format
            or version, a member file, a block where a ``whole`` checkpoint is wanted; the
            message names the file.
    """
    check_path(api, "path", path)
    where = os.fspath(path)
    if where.endswith(".safetensors") and _head(where) not in (b"", b"PK\x03\x04"):
        raise ValueError(
            f"{api}: {where} is a safetensors file, not a vmapens checkpoint: a member file of "
            "vmapens.save_members loads with vmapens.load_member"
        )
    with open_checked(path, api, "checkpoint") as f:
        payload = torch_load(f, where, api)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        plain = isinstance(payload, dict) and all(
            isinstance(v, torch.Tensor) for v in payload.values()
        )
        hint = (
            ": it holds a state_dict (a member file of vmapens.save_members loads with "
            "vmapens.load_member)"
            if plain and payload
            else ""
        )
        raise ValueError(f"{api}: {where} is not a vmapens checkpoint (no `{FORMAT}` marker){hint}")
    if whole and "rows" in payload and "members" not in payload:
        parent = Path(where).parent  # <checkpoint>.members
        raise ValueError(
            f"{api}: {where} is a member block of a sharded checkpoint, not the checkpoint: "
            f"load the checkpoint it belongs to, {parent.with_name(parent.name[:-8])}"
            if parent.name.endswith(".members")
            else f"{api}: {where} is a member block of a sharded checkpoint, not the checkpoint"
        )
    if payload.get("version") != VERSION:
        raise ValueError(
            f"{api}: {where} is a vmapens checkpoint of version {payload.get('version')!r}; "
            f"this vmapens reads version {VERSION}"
        )
    return payload


def _head(where: str) -> bytes:
    """The first 4 bytes of a file (a torch.save zip: ``PK\\x03\\x04``); empty if unreadable."""
    try:
        with open(where, "rb") as f:
            return f.read(4)
    except OSError:
        return b""


def check_member_ids(members: Any, api: str, where: str) -> tuple[list[int], int]:
    """``(member_ids, n_total)`` of a file's ``members`` entry, checked: ints, distinct, in range.

    Raises:
        ValueError: ``members`` is not ``{"member_ids": [...], "n_total": int}`` of that kind.
    """
    if not isinstance(members, dict):
        raise ValueError(f"{api}: {where} holds no member list (got {type(members).__name__})")
    ids, n_total = members.get("member_ids"), members.get("n_total")
    if type(n_total) is not int or n_total < 1:  # a file holds plain ints; bool is no id
        raise ValueError(f"{api}: {where}: `n_total` must be an int >= 1, got {n_total!r}")
    if not isinstance(ids, (list, tuple)) or not all(type(i) is int for i in ids):
        raise ValueError(f"{api}: {where}: `member_ids` must be a list of ints, got {ids!r:.80}")
    bad = [i for i in ids if not 0 <= i < n_total]
    if bad:
        raise ValueError(f"{api}: {where}: member ids must be in [0, {n_total}), got {bad[:8]}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{api}: {where}: `member_ids` repeat ids: {ids!r:.80}")
    return list(ids), n_total


def describe_members(m: Any) -> str:
    """A file's (or an ensemble's) ``members`` entry in words, for messages."""
    ids = m.get("member_ids") if isinstance(m, dict) else None
    if not isinstance(ids, (list, tuple)) or not all(type(i) is int for i in ids):
        return f"{m!r:.120}"  # not what vmapens writes: shown as it is
    # A range as first..last; any other list (a selection, another order) as itself.
    ranged = bool(ids) and list(ids) == list(range(ids[0], ids[0] + len(ids)))
    span = f"{ids[0]}..{ids[-1]}" if ranged else f"{list(ids)!r:.40}" if ids else "none"
    return f"{len(ids)} members of {m.get('class')} (ids {span} of {m.get('n_total')})"


def members_way_out(api: str, held: Any, ours: dict[str, Any]) -> str:
    """What to do when a file holds other members than the ensemble (``check_members``)."""
    if not isinstance(held, dict) or held.get("class") != ours["class"]:
        return ""  # another class (or no member list): the classes named say it
    if api == "fit":
        return (
            ": resume with the ensemble the run was started with (its `n_total` and member "
            "ids; under torch.distributed, shard=True gives each rank its block), or write "
            "this run's checkpoint to another path"
        )
    if api != "restore":  # load builds the stored members: only the class can differ
        return ""
    if held.get("n_total") == ours["n_total"]:  # the same run: `ours` holds others, or twice
        return (
            ": restore fills an ensemble of the stored members, or of some of them, each once "
            "(ens.select(rows), a rank's block of a sharded ensemble); vmapens.load(path, "
            "factory) builds one of them all (then build its optimizer and restore(path, ens, "
            "optimizer))"
        )
    return (
        ": restore fills an ensemble of the stored members (or some of them) of a run of "
        f"{held.get('n_total')} members; vmapens.load(path, factory) builds one (then build "
        "its optimizer and restore(path, ens, optimizer))"
    )


# -- the layout of a sharded fit checkpoint -----------------------------------------------------

ROWS = "vmapens:rows"  # stands for a per-member entry in the shared part
_BLOCK = "members-{start:06d}-{stop:06d}.epoch{epoch:06d}.pt"
_BLOCK_NAME = re.compile(r"members-\d{6,}-\d{6,}\.epoch\d{6,}\.pt")  # a bare name, no path


def parts_dir(path: str | os.PathLike) -> Path:
    """The directory next to ``path`` that holds a sharded checkpoint's member blocks.

    Example:
        >>> parts_dir("runs/ckpt.pt").as_posix()
        'runs/ckpt.pt.members'
    """
    path = Path(path)
    return path.with_name(path.name + ".members")


def block_name(member_ids: Sequence[int], epoch: int) -> str:
    """The file name of the block of the consecutive members ``member_ids`` at ``epoch``."""
    return _BLOCK.format(start=member_ids[0], stop=member_ids[-1] + 1, epoch=epoch)


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


def split_rows(payload: dict, n: int) -> tuple[dict, list[tuple]]:
    """(shared part with placeholders, rows [(path, kind, dim, value)]) of a fit payload of
    ``n`` members."""
    rows: list[tuple] = []

    def visit(path: tuple, value: Any) -> Any:
        found = _row_kind(path, value, n) if path else None
        if found is None:
            return ...
        kind, dim = found
        rows.append((path, kind, dim, list(value) if kind != "tensor" else value))
        return ROWS

    return _walk(payload, (), visit), rows


def _join(shared: dict, rows: list[tuple]) -> dict:
    """The inverse of :func:`split_rows` (``rows`` already cut to the members wanted)."""
    by_path = {path: (kind, value) for path, kind, _, value in rows}

    def visit(path: tuple, value: Any) -> Any:
        if not (isinstance(value, str) and value == ROWS) or path not in by_path:
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


def localise(payload: dict, path: str | os.PathLike, member_ids: Sequence[int], api: str) -> dict:
    """A fit checkpoint's parts for the members ``member_ids`` only, from either layout.

    ``payload`` is what :func:`read` gave for ``path``: a single file holding every member, or
    the shared part of a sharded checkpoint that names its block files. Per-member entries
    (parameters, buffers, optimizer state and per-member hyperparameters, history columns,
    early-stopping state) are cut to ``member_ids``, in that order; the rest is shared.
    ``payload`` itself is not changed.

    Raises:
        ValueError: a block file is missing, unreadable or not the one the checkpoint names
            (another run, epoch or members), or no block holds some member; the message
            starts with ``api``.
    """
    where, wanted = os.fspath(path), list(member_ids)
    stored = list((payload.get("members") or {}).get("member_ids", []))
    if "blocks" not in payload:
        if stored == wanted:
            return payload
        shared, rows = split_rows(payload, len(stored))
        blocks = [(stored, rows)]
    else:
        shared = {k: v for k, v in payload.items() if k != "blocks"}
        expected = _row_paths(shared)
        blocks = [
            _read_block(path, payload, name, ids, expected, api)
            for name, ids in _listed(payload, where, api)
            if set(ids) & set(wanted)
        ]
    where_is = {i: (b, j) for b, (ids, _) in enumerate(blocks) for j, i in enumerate(ids)}
    missing = [i for i in wanted if i not in where_is]
    if missing:
        raise ValueError(f"{api}: {where} holds no state for members {missing[:8]}")
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
            f"{api}: the member blocks of {where} do not fit together ({type(err).__name__}: {err})"
        ) from err
    local["members"] = {**local["members"], "member_ids": wanted}
    return local


def _listed(payload: dict, where: str, api: str) -> list[tuple[str, list[int]]]:
    """The ``(block file name, member ids)`` a sharded checkpoint names, checked."""
    listed = payload["blocks"]
    _, n_total = check_member_ids(payload.get("members"), api, where)
    if not isinstance(listed, (list, tuple)):
        raise ValueError(f"{api}: {where}: the block list is {type(listed).__name__}, not a list")
    out = []
    for entry in listed:
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[0], str)):
            raise ValueError(f"{api}: {where}: a block entry is {entry!r:.80}, not (name, ids)")
        name, ids = entry
        if not _BLOCK_NAME.fullmatch(name):
            # A path (../x, /x, a/b) would read outside <checkpoint>.members/.
            raise ValueError(
                f"{api}: {where} names the block {name!r:.80}, not a block file name in "
                f"{parts_dir(where)}"
            )
        ids, _ = check_member_ids({"member_ids": ids, "n_total": n_total}, api, where)
        out.append((name, ids))
    return out


def _row_paths(shared: dict) -> set[tuple]:
    """Where the shared part of a sharded checkpoint stands in for per-member rows."""
    paths: set[tuple] = set()

    def visit(path: tuple, value: Any) -> Any:
        if isinstance(value, str) and value == ROWS:
            paths.add(path)
        return ...

    _walk(shared, (), visit)
    return paths


def _read_block(
    path: str | os.PathLike, payload: dict, name: str, ids: list[int], expected: set, api: str
) -> tuple:
    """``(member ids, rows)`` of block ``name``, which must be of the checkpoint's run and epoch
    and hold a row for every ``expected`` path of the shared part, and no other."""
    file = parts_dir(path) / name
    try:
        block = read(file, api)
    except FileNotFoundError as err:
        raise ValueError(
            f"{api}: {os.fspath(path)} names the block {file}, which is missing"
        ) from err
    theirs = {k: block.get(k) for k in ("run", "epoch", "member_ids")}
    ours = {"run": payload.get("run"), "epoch": payload.get("epoch"), "member_ids": ids}
    if theirs != ours:
        raise ValueError(
            f"{api}: {file} is not the block {os.fspath(path)} names: it holds members "
            f"{theirs['member_ids']!r:.60} of run {theirs['run']} at epoch {theirs['epoch']}, "
            f"the checkpoint wants members {ids!r:.60} of run {ours['run']} at epoch "
            f"{ours['epoch']} (a block of another run, or left from an older epoch)"
        )
    rows = block.get("rows")
    if not isinstance(rows, list) or not all(isinstance(r, tuple) and len(r) == 4 for r in rows):
        raise ValueError(f"{api}: {file} holds no member rows")
    got = [r[0] for r in rows]
    if set(got) != expected or len(got) != len(expected):
        missing, extra = (
            sorted(map(str, expected - set(got))),
            sorted(map(str, set(got) - expected)),
        )
        raise ValueError(
            f"{api}: {file} does not hold the member rows {os.fspath(path)} names: missing "
            f"{missing[:4]}, unexpected {extra[:4]} (a block of another layout, or changed)"
        )
    return ids, rows
