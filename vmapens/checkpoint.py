"""Checkpoints: the envelope (atomic write, checked read, version) and the verbs built on it.

The envelope knows no part's insides: each stateful part (ensemble, optimizer, history, the
fit loop) brings its own ``state_dict()`` and ``load_state_dict()``. Reading checks the
format and version; loading applies the parts all or nothing.
"""

from __future__ import annotations

import copy
import errno
import fcntl
import os
import pickle
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .ensemble import Ensemble
from .history import History

__all__ = [
    "apply_parts",
    "check_ensemble_state",
    "check_members",
    "load",
    "members_of",
    "read",
    "remove_stale_temps",
    "restore",
    "save",
    "save_members",
    "write",
]

FORMAT = "vmapens-checkpoint"
VERSION = 2


def write(path: str | os.PathLike, parts: Mapping[str, Any], api: str = "save") -> None:
    """Write ``parts`` (plain containers of tensors) to ``path`` atomically.

    The file is written to a temporary file in the same directory (held under an exclusive
    lock while written), synced, moved over ``path`` with ``os.replace`` and the directory
    synced: a crash at any point leaves the previous file intact. Temporary files that
    interrupted saves of the same ``path`` left behind (unlocked) are removed first.

    Raises:
        OSError: the directory is missing or read-only, or the disk is full; the message
            says the previous file is intact, and no temporary file is left.
    """
    payload = {"format": FORMAT, "version": VERSION, **parts}
    atomic_write(path, lambda f: torch.save(payload, f), api)


def atomic_write(path: str | os.PathLike, write_to: Callable[..., Any], api: str) -> None:
    """Write through a locked temporary file in the same directory, then ``os.replace`` it."""
    path = Path(path)
    _remove_stale(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as err:
        raise _write_error(api, path, err) from err
    try:
        with os.fdopen(fd, "wb") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # "in use": a later save leaves it alone
            write_to(f)
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp, path)
        _sync_dir(path.parent)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(err, (OSError, RuntimeError)) and not isinstance(err, NotImplementedError):
            raise _write_error(api, path, err) from err
        raise


def _write_error(api: str, path: Path, err: BaseException) -> OSError:
    code = getattr(err, "errno", None) or errno.EIO
    return OSError(
        code,
        f"{api}: could not write {path}: {err}; any previous file at that path is intact",
    )


def _remove_stale(path: Path) -> None:
    """Delete temporary files of earlier, interrupted saves of ``path`` (ours and unlocked)."""
    if path.parent.is_dir():
        _remove_unlocked(path.parent.glob(f".{path.name}.*.tmp"))


def remove_stale_temps(directory: Path) -> None:
    """Delete the temporary files of every interrupted save into ``directory`` (unlocked)."""
    _remove_unlocked(directory.glob(".*.tmp"))


def _remove_unlocked(paths: Iterable[Path]) -> None:
    for tmp in paths:
        try:
            fd = os.open(tmp, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # another process is writing it right now
        finally:
            os.close(fd)
        tmp.unlink(missing_ok=True)


def _sync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read(path: str | os.PathLike, api: str) -> dict[str, Any]:
    """Read a checkpoint written by :func:`write`; check its format and version only.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: a truncated or corrupt file, objects other than tensors and plain
            containers (possibly code), another format or version.
    """
    where = os.fspath(path)
    if not os.path.isfile(where):
        raise FileNotFoundError(f"{api}: no checkpoint at {where}")
    try:
        payload = torch.load(where, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(
            f"{api}: refusing to load {where}: it holds objects other than tensors and plain "
            f"containers (possibly code that would run when unpickled); torch.load with "
            f"weights_only=True stopped at: {str(err).splitlines()[0]}"
        ) from err
    except (RuntimeError, EOFError, OSError) as err:
        raise ValueError(
            f"{api}: {where} is not a readable checkpoint (truncated or corrupt file?): {err}"
        ) from err
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"{api}: {where} is not a vmapens checkpoint (no `{FORMAT}` marker)")
    if payload.get("version") != VERSION:
        raise ValueError(
            f"{api}: {where} is a vmapens checkpoint of version {payload.get('version')!r}; "
            f"this vmapens reads version {VERSION}"
        )
    return payload


def apply_parts(payload: Mapping[str, Any], parts: Mapping[str, Any], api: str, where: str) -> None:
    """``part.load_state_dict(payload[name])`` for every part, all or nothing.

    Each part checks its own state before it changes; if one refuses, the parts loaded
    before it get their previous state back, and the error says which part and why.
    """
    for name in parts:
        if payload.get(name) is None:
            raise ValueError(f"{api}: {where} holds no {name} state")
    before = {name: copy.deepcopy(part.state_dict()) for name, part in parts.items()}
    done: list[str] = []
    try:
        for name, part in parts.items():
            part.load_state_dict(payload[name])
            done.append(name)
    except (ValueError, RuntimeError, KeyError, TypeError, IndexError) as err:
        for name in done:
            parts[name].load_state_dict(before[name])
        raise ValueError(f"{api}: {where}: the {name} state does not fit: {err}") from err


def members_of(ens: Ensemble) -> dict[str, Any]:
    cls = type(ens.template)
    return {
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "n_total": ens.n_total,
        "member_ids": list(ens.member_ids),
    }


def check_members(payload: Mapping[str, Any], ens: Ensemble, api: str, where: str) -> None:
    """The file must hold this ensemble's members: same class and global ids."""
    held, ours = payload.get("members"), members_of(ens)
    if held != ours:
        raise ValueError(
            f"{api}: {where} holds {_describe(held)}, this ensemble has {_describe(ours)}"
        )


def check_ensemble_state(state: Any, ens: Ensemble, api: str, where: str) -> None:
    """The stored tensors must have this ensemble's keys, shapes and dtypes (no silent casts)."""
    expected = ens.state_dict()
    if not isinstance(state, dict) or set(state) != set(expected):
        got = set(state) if isinstance(state, dict) else set()
        missing, extra = sorted(set(expected) - got), sorted(got - set(expected))
        raise ValueError(f"{api}: {where}: keys differ: missing {missing}, unexpected {extra}")
    for key, t in expected.items():
        held = state[key]
        if not isinstance(held, torch.Tensor) or held.shape != t.shape or held.dtype != t.dtype:
            what = (tuple(held.shape), held.dtype) if isinstance(held, torch.Tensor) else type(held)
            raise ValueError(
                f"{api}: {where}: `{key}` is {what}, this ensemble has {(tuple(t.shape), t.dtype)}"
            )


def _describe(m: Any) -> str:
    if not isinstance(m, dict):
        return repr(m)
    ids = m["member_ids"]
    span = f"{ids[0]}..{ids[-1]}" if ids else "none"
    return f"{len(ids)} members of {m['class']} (ids {span} of {m['n_total']})"


def save(
    ens: Ensemble,
    path: str | os.PathLike,
    optimizer: torch.optim.Optimizer | None = None,
    history: History | None = None,
) -> None:
    """Write the ensemble (and optionally its optimizer and History) to ``path`` atomically.

    Only tensors and plain containers are stored, so ``torch.load(weights_only=True)`` reads
    it. See :func:`write` for what a crash or a full disk leaves.

    Args:
        ens: the ensemble.
        path: the checkpoint file.
        optimizer: an optimizer over ``ens.parameters()`` whose state to store.
        history: a ``vmapens.History`` to store.

    Example:
        >>> ens = Ensemble(lambda: nn.Linear(3, 1), n=4, seed=0)
        >>> save(ens, "ens.pt")
        >>> load("ens.pt", lambda: nn.Linear(3, 1)).n_total
        4
    """
    if not isinstance(ens, Ensemble):
        raise TypeError(f"save: `ens` must be a vmapens.Ensemble, got {type(ens).__name__}")
    write(path, _parts_state(ens, optimizer, history), "save")


def _parts_state(ens: Ensemble, optimizer: Any, history: Any) -> dict[str, Any]:
    return {
        "members": members_of(ens),
        "ensemble": {k: v.detach().cpu() for k, v in ens.state_dict().items()},
        "optimizer": None if optimizer is None else optimizer.state_dict(),
        "optimizer_class": None if optimizer is None else type(optimizer).__name__,
        "history": None if history is None else history.state_dict(),
    }


def load(
    path: str | os.PathLike,
    factory: Callable[[], nn.Module],
    optimizer: Callable[[Ensemble], torch.optim.Optimizer] | None = None,
) -> Ensemble | tuple[Ensemble, torch.optim.Optimizer]:
    """Build an Ensemble from a checkpoint, with the stored members and member ids.

    Args:
        path: a file written by ``save`` or ``fit(checkpoint=...)``.
        factory: builds one member, as for ``Ensemble``; its class must be the stored one.
        optimizer: how to build the optimizer, e.g. ``vmapens.StackedAdam`` or
            ``lambda e: StackedAdam(e, lr=1e-2)``; it gets the stored optimizer state.

    Returns:
        The ensemble, or ``(ensemble, optimizer)`` when ``optimizer`` is given.

    Raises:
        ValueError: the file is truncated or corrupt, holds objects other than tensors, or
            does not match ``factory``'s members.
        FileNotFoundError: no file at ``path``.
    """
    payload = read(path, "load")
    members = payload.get("members") or {}
    ids = list(members.get("member_ids", []))
    if not ids:
        raise ValueError(f"load: {os.fspath(path)} holds no members")
    # seed=0 leaves the caller's RNG alone; every tensor is overwritten below anyway.
    ens = Ensemble(factory, n=len(ids), seed=0)
    ens.member_ids = (
        range(ids[0], ids[-1] + 1) if ids == list(range(ids[0], ids[-1] + 1)) else tuple(ids)
    )
    ens.n_total = members["n_total"]
    opt = optimizer(ens) if optimizer is not None else None
    _restore(payload, path, ens, opt, None, "load")
    return ens if opt is None else (ens, opt)


def restore(
    path: str | os.PathLike,
    ens: Ensemble,
    optimizer: torch.optim.Optimizer | None = None,
    history: History | None = None,
) -> None:
    """Load a checkpoint into an existing ensemble (and optimizer, History), all or nothing.

    Raises:
        ValueError: as for ``load``, or the optimizer/History is missing from the file or
            does not match; ``ens``, ``optimizer`` and ``history`` are then unchanged.
    """
    _restore(read(path, "restore"), path, ens, optimizer, history, "restore")


def _restore(
    payload: dict, path: Any, ens: Ensemble, optimizer: Any, history: Any, api: str
) -> None:
    where = os.fspath(path)
    check_members(payload, ens, api, where)
    check_ensemble_state(payload.get("ensemble"), ens, api, where)
    if optimizer is not None and payload.get("optimizer_class") not in (
        None,
        type(optimizer).__name__,
    ):
        raise ValueError(
            f"{api}: {where} holds {payload['optimizer_class']} state, the optimizer is a "
            f"{type(optimizer).__name__}"
        )
    parts: dict[str, Any] = {"ensemble": ens}
    if optimizer is not None:
        parts["optimizer"] = optimizer
    if history is not None:
        parts["history"] = history
    apply_parts(payload, parts, api, where)


def save_members(ens: Ensemble, directory: str | os.PathLike, format: str = "pt") -> list[Path]:
    """Write one file per member, named by its global index, that the member's class loads.

    ``member_0003.pt`` loads with ``MyModel().load_state_dict(torch.load(path))``;
    ``member_0003.safetensors`` with ``safetensors.torch.load_file(path)``.

    Args:
        ens: the ensemble.
        directory: created if missing.
        format: ``"pt"`` or ``"safetensors"`` (needs ``pip install 'vmapens[safetensors]'``).

    Returns:
        The paths written, in member order.

    Raises:
        ValueError: unknown ``format``.
        ImportError: ``format="safetensors"`` without the safetensors package.

    Example:
        >>> paths = save_members(Ensemble(lambda: nn.Linear(3, 1), n=2), "members")
        >>> [p.name for p in paths]
        ['member_0000.pt', 'member_0001.pt']
        >>> nn.Linear(3, 1).load_state_dict(torch.load(paths[1]))
        <All keys matched successfully>
    """
    if format not in ("pt", "safetensors"):
        raise ValueError(f"save_members: `format` must be 'pt' or 'safetensors', got {format!r}")
    if format == "safetensors":
        try:
            from safetensors.torch import save as to_bytes
        except ImportError as err:
            raise ImportError(
                "save_members: format='safetensors' needs the safetensors package; install it "
                "with: pip install 'vmapens[safetensors]'"
            ) from err
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise _write_error("save_members", directory, err) from err
    paths = []
    for gid, sd in zip(ens.member_ids, ens.state_dicts(), strict=True):
        path = directory / f"member_{gid:04d}.{format}"
        if format == "pt":
            atomic_write(path, lambda f, sd=sd: torch.save(sd, f), "save_members")
        else:
            # safetensors refuses tensors that share memory (tied weights): one copy per key.
            tensors = {k: v.detach().cpu().contiguous().clone() for k, v in sd.items()}
            atomic_write(path, lambda f, t=tensors: f.write(to_bytes(t)), "save_members")
        paths.append(path)
    return paths
