"""Per-member files: one plain state_dict file per member that any PyTorch code loads, and
the manifest that makes them one set.

``save_members`` writes ``member_<id>.pt`` (or ``.safetensors``) with a digest that plain
``torch.load`` / safetensors ignore, then, last and atomically, ``members.json``: the set's
commit point, naming each file of this save and its SHA-256 (``vmapens._member_manifest``).
``load_members`` reads the set the manifest names; ``load_member`` is the checked reader of
one file (files of vmapens 0.3, which have no manifest, included).

Each file also records whose it is: the member's global id, in the state dict's
``_metadata`` under :data:`MEMBER_KEY` (``.pt``; ``load_state_dict`` looks up only its
modules' own prefixes there) or in the safetensors header metadata. A digest proves a file
whole, not that it is the file its name says: ``load_member`` refuses ``member_0003.pt``
holding member 2 (a file copied or renamed over another).
"""

from __future__ import annotations

import copy
import errno
import hashlib
import io
import json
import os
import socket
import warnings
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

from ._checkpoint_files import FORMAT
from ._checks import repeated
from ._files import (
    atomic_write,
    check_path,
    open_checked,
    read_bytes,
    seal_safetensors,
    seal_torch,
    torch_load,
    unseal_safetensors,
    write_error,
)
from ._member_manifest import (
    MANIFEST,
    NAMED,
    drop_stale,
    file_digest,
    member_file_names,
    previous,
    read_manifest,
    write_manifest,
)
from .distributed import claim, member_blocks, raise_together, rank, world_size
from .ensemble import Ensemble, check_ensemble

__all__ = ["MANIFEST", "MEMBER_KEY", "load_member", "load_members", "save_members"]

#: Where a member file records its member's global id (see the module docstring).
MEMBER_KEY = "vmapens:member_id"


def save_members(ens: Ensemble, directory: str | os.PathLike, format: str = "pt") -> list[Path]:
    """Write one file per member, named by its global index, that the member's class loads,
    then ``members.json``, which makes them one set for :func:`load_members`.

    ``member_0003.pt`` loads with ``MyModel().load_state_dict(torch.load(path))``;
    ``member_0003.safetensors`` with ``safetensors.torch.load_file(path)``.

    The manifest is written last, by one atomic rename: until then the directory's previous
    set stays the set, and a save that stops halfway leaves files that set no longer matches,
    which ``load_members`` refuses (never a mix of two saves). A save replaces the previous
    set in ``directory``: the member files the previous ``members.json`` listed and this save
    did not write are removed (unless changed since), so ``member_*`` holds this save's
    members only. Nothing else is removed; other ``member_*`` files (written by vmapens 0.3,
    or copies) are left with a warning. To keep two sets, save them into two directories.

    A sharded ensemble (``Ensemble(..., shard=True)``, this rank's block) is a collective:
    every rank writes its own files, then rank 0 writes the manifest of all ranks' members.
    Call it on every rank; if any rank fails, every rank raises and no manifest is written.
    Any other ensemble is saved by the rank that calls it alone (a gathered one, on rank 0);
    a second rank of the process group saving its own into that directory is refused.

    Args:
        ens: the ensemble, each member id at most once (a sub-ensemble keeps its global ids).
        directory: created if missing.
        format: ``"pt"`` or ``"safetensors"`` (needs ``pip install 'vmapens[safetensors]'``).

    Returns:
        The member files written, in member order (``members.json`` not included).

    Raises:
        TypeError: ``ens`` is not an Ensemble, ``directory`` not a path.
        ValueError: unknown ``format``; ``ens`` holds a member id twice (``ens[[1, 1]]``:
            both would be ``member_0001``); under ``torch.distributed``, ``ens`` is not this
            rank's block of a sharded ensemble and another rank saved its own members into
            ``directory`` (each rank's ``members.json`` would replace the other's). Nothing is
            written.
        ImportError: ``format="safetensors"`` without the safetensors package.
        OSError: ``directory`` cannot be created or written.
        RuntimeError: sharded, another rank could not write its files or the manifest.

    Example:
        >>> from torch import nn
        >>> paths = save_members(Ensemble(lambda: nn.Linear(3, 1), n=2), "members")
        >>> [p.name for p in paths]
        ['member_0000.pt', 'member_0001.pt']
        >>> nn.Linear(3, 1).load_state_dict(torch.load(paths[1]))
        <All keys matched successfully>
    """
    check_ensemble("save_members", ens)
    check_path("save_members", "directory", directory)
    if format not in ("pt", "safetensors"):
        raise ValueError(f"save_members: `format` must be 'pt' or 'safetensors', got {format!r}")
    to_bytes = _safetensors("save", "save_members") if format == "safetensors" else None
    if to_bytes is not None:  # before anything is written: safetensors says `KeyError: torch.x`
        for dtype, key in {t.dtype: k for k, t in ens.state_dict().items()}.items():
            try:
                to_bytes({"probe": torch.zeros(1, dtype=dtype)})
            except KeyError as err:
                why = f"safetensors cannot store {dtype} tensors (`{key}`); use format='pt'"
                raise ValueError(f"save_members: {why}, which keeps every dtype") from err
    ids = list(ens.member_ids)
    twice = repeated(ids)
    if twice:
        raise ValueError(
            f"save_members: `ens` holds member(s) {twice} more than once (member_ids {ids}); "
            "files are named by member id, so one would overwrite the other: save "
            "ens.select(...) of distinct members, or each copy into its own directory"
        )
    directory = Path(directory)
    sharded = _sharded(ens)
    if not sharded and world_size() > 1:
        _claim(directory, ids)
    entries: list[dict[str, Any]] = []
    failed: BaseException | None = None
    try:
        if directory.exists() and not directory.is_dir():
            raise NotADirectoryError(
                errno.ENOTDIR, f"save_members: `directory` {directory} is a file, not a directory"
            )
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise write_error("save_members", directory, err) from err
        entries = _write_files(ens, directory, format, to_bytes)
    except Exception as err:
        if not sharded:
            raise
        failed = err
    if sharded:  # every rank's entries, once every file is written; or every rank raises
        why = f"could not write its member files, so no {MANIFEST} was written (not a set)"
        entries = [e for part in raise_together("save_members", failed, entries, why) for e in part]
    left: list[str] = []
    if not sharded or rank() == 0:
        try:
            left = _commit(directory, entries, ens.n_total)
        except Exception as err:
            if not sharded:
                raise
            failed = err
    if sharded:
        raise_together("save_members", failed, what=f"could not write {MANIFEST}")
    if left:
        warnings.warn(
            f"save_members: {directory} also holds member files that this save did not write "
            f"and no earlier {MANIFEST} listed ({', '.join(left[:4])}"
            f"{', ...' if len(left) > 4 else ''}; {len(left)} files); they are left as they "
            f"are, and vmapens.load_members reads only the members {MANIFEST} lists",
            UserWarning,
            stacklevel=2,
        )
    return [directory / f"member_{gid:04d}.{format}" for gid in ids]


def _sharded(ens: Ensemble) -> bool:
    """Whether ``ens`` is this rank's block of a sharded ensemble (the rule ``export`` uses)."""
    size = world_size()
    if size == 1 or len(ens) == ens.n_total or size > ens.n_total:
        return False
    return list(ens.member_ids) == list(member_blocks(ens.n_total, size)[rank()])


def _claim(directory: Path, ids: list[int]) -> None:
    """Refuse a rank's save of an ensemble that is not its block (``best_k`` of it, an
    unsharded ensemble per rank) into a directory another rank of the group saved into: no
    collective joins the ranks' members, so each would commit its own manifest and the last
    would win, silently. Keyed by host too: node-local directories may share a path."""
    mine = f"{rank()}:{hashlib.sha256(repr(ids).encode()).hexdigest()}"
    where = f"save_members:{socket.gethostname()}:{os.path.realpath(directory)}"
    # This rank's own earlier save there is renewed with the members it saves now.
    got = claim(where, mine, renew=lambda held: held.split(":", 1)[0] == str(rank()))
    owner, held = got.split(":", 1)
    # The same members from another rank (a gathered ensemble each rank saves): the same files.
    if got != mine and held != mine.split(":", 1)[1]:
        raise ValueError(
            f"save_members: rank {rank()} saves members {ids} into {directory}, where rank "
            f"{owner} of this process group saved its own: `ens` is not this rank's block of "
            f"a sharded ensemble, so each rank would write its own {MANIFEST} and the last "
            "would win (one rank's members). Save the sharded ensemble itself on every rank "
            "(one set of all members), or gather first (vmapens.gather(ens, dst=0), then "
            "save on rank 0 only), or give each rank its own directory"
        )


def _write_files(
    ens: Ensemble, directory: Path, format: str, to_bytes: Callable[..., bytes] | None
) -> list[dict[str, Any]]:
    """Write ``ens``'s member files; their manifest entries (id, file name, SHA-256)."""
    # Each submodule's `_version`, as `module.state_dict()` carries it: a module whose
    # `_load_from_state_dict` migrates older versions reads a file without it as version 1.
    metadata = getattr(ens.template.state_dict(), "_metadata", None)
    entries = []
    for gid, sd in zip(ens.member_ids, ens.state_dicts(), strict=True):
        name = f"member_{gid:04d}.{format}"
        digest: list[str] = []
        if to_bytes is None:
            versioned = OrderedDict(sd)
            held = copy.deepcopy(metadata) if metadata is not None else OrderedDict()
            held[MEMBER_KEY] = {"id": gid}
            versioned._metadata = held  # type: ignore[attr-defined]
            atomic_write(directory / name, _digested(seal_torch(versioned), digest), "save_members")
        else:
            # safetensors refuses tensors that share memory (tied weights): one copy per key.
            tensors = {k: v.detach().cpu().contiguous().clone() for k, v in sd.items()}
            sealed = seal_safetensors(to_bytes, tensors, {MEMBER_KEY: str(gid)})
            atomic_write(directory / name, _digested(_bytes_writer(sealed), digest), "save_members")
        entries.append({"id": int(gid), "file": name, "sha256": digest[0]})
    return entries


def _digested(write_to: Callable[[IO[bytes]], Any], out: list[str]) -> Callable[[IO[bytes]], None]:
    """``write_to``, then the SHA-256 of the file it wrote into ``out``: the bytes that are
    renamed into place, hashed before the rename (not read back from the path later)."""

    def write(f: IO[bytes]) -> None:
        write_to(f)
        out.append(file_digest(f))

    return write


def _commit(directory: Path, entries: list[dict[str, Any]], n_total: int) -> list[str]:
    """Write the manifest of ``entries``, then remove the previous set's stale files.

    Returns:
        The other ``member_*`` files left in ``directory``, sorted.
    """
    old = previous(directory)
    write_manifest(directory, entries, n_total, "save_members")
    written = {e["file"] for e in entries}
    drop_stale(directory, old, written)
    return sorted(member_file_names(directory) - written)


def _safetensors(what: str, api: str, where: str = "") -> Callable[..., Any]:
    """``safetensors.torch.save`` or ``load``; an ImportError that says how to get it."""
    try:
        from safetensors import torch as st
    except ImportError as err:
        said = (
            f"{where} is a safetensors file; install the safetensors package"
            if where
            else "format='safetensors' needs the safetensors package; install it"
        )
        raise ImportError(f"{api}: {said} with: pip install 'vmapens[safetensors]'") from err
    return st.save if what == "save" else st.load


def _recorded(metadata: Any, key: str = MEMBER_KEY) -> Any:
    """``metadata[key]``, None where a file has no such entry (or no metadata at all)."""
    return metadata.get(key) if isinstance(metadata, dict) else None


def _bytes_writer(data: bytes) -> Callable[[IO[bytes]], Any]:
    return lambda f: f.write(data)


def load_member(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read one file written by :func:`save_members`, checking the digest it carries.

    ``torch.load(path)`` and ``safetensors.torch.load_file(path)`` read the same files but
    check nothing: a changed byte in tensor data loads as changed values. This reader refuses
    any file whose bytes do not match its SHA-256 digest, and a file named ``member_0003``
    that records another member's id. It reads one file alone, with or without a
    ``members.json`` next to it; :func:`load_members` reads a whole set.

    Args:
        path: a ``member_XXXX.pt`` or ``member_XXXX.safetensors`` file.

    Returns:
        The member's state_dict (on CPU), for ``model.load_state_dict``.

    Raises:
        TypeError: ``path`` is not a path.
        FileNotFoundError: no file at ``path``.
        ValueError: a truncated, corrupt or changed file, one that holds something other
            than a dict of tensors, or a ``member_XXXX`` file holding another member (a file
            copied over it); the message names the file.
        ImportError: a ``.safetensors`` file without the safetensors package.

    Example:
        >>> from torch import nn
        >>> paths = save_members(Ensemble(lambda: nn.Linear(3, 1), n=2), "members")
        >>> nn.Linear(3, 1).load_state_dict(load_member(paths[1]))
        <All keys matched successfully>
    """
    check_path("load_member", "path", path)
    return _read(path, "load_member")


def load_members(directory: str | os.PathLike) -> list[dict[str, torch.Tensor]]:
    """Read the set of member files that :func:`save_members` last wrote into ``directory``.

    ``members.json`` is the truth: it names each member file of one save and the SHA-256 of
    the whole file. Every file it lists must be there with exactly those bytes, so a
    directory holding files of two saves (a save that stopped halfway, a file copied in from
    another run) is refused, never loaded as a mix. Files it does not list (``member_*``
    files of vmapens 0.3, copies) are ignored. A directory without ``members.json`` (written
    by vmapens 0.3) is refused: read its files one by one with :func:`load_member`.

    Args:
        directory: a directory written by ``save_members``.

    Returns:
        One state_dict (on CPU) per member, in the saved ensemble's member order (its
        ``member_ids``, as the manifest lists them), each for ``model.load_state_dict``.

    Raises:
        TypeError: ``directory`` is not a path.
        FileNotFoundError: no such directory, no ``members.json`` in it, or a member file it
            lists is missing.
        ValueError: ``directory`` is a file; a corrupt or foreign manifest; a listed file whose
            bytes are not the ones the manifest lists, or that is corrupt; the message names
            the file. Nothing is returned.
        ImportError: ``.safetensors`` files without the safetensors package.

    Example:
        >>> from torch import nn
        >>> ens = Ensemble(lambda: nn.Linear(3, 1), n=3)
        >>> _ = save_members(ens, "members")
        >>> states = load_members("members")
        >>> len(states), nn.Linear(3, 1).load_state_dict(states[2])
        (3, <All keys matched successfully>)
    """
    check_path("load_members", "directory", directory)
    directory = Path(directory)
    manifest = read_manifest(directory, "load_members")
    states = []
    for entry in manifest["members"]:
        path = directory / entry["file"]
        if not path.is_file():
            raise FileNotFoundError(
                f"load_members: {path} is missing: {MANIFEST} lists it as member {entry['id']} "
                f"of a set of {len(manifest['members'])}; copy the whole directory, or save the "
                "ensemble again"
            )
        states.append(_read(path, "load_members", entry))
    return states


def _read(
    path: str | os.PathLike, api: str, entry: dict[str, Any] | None = None
) -> dict[str, torch.Tensor]:
    """One member file's state_dict, checked: against ``entry`` (its manifest entry) when
    given, else against the digest the file carries; and against the id its name says."""
    where = os.fspath(path)
    if where.endswith(".safetensors"):
        from_bytes = _safetensors("load", api, where)
        data = read_bytes(path, api)
        if entry is not None:
            _listed(data, entry, where)
        unseal_safetensors(data, where, api)
        try:
            state = from_bytes(data)
            end = 8 + int.from_bytes(data[:8], "little")
            held = _recorded(json.loads(data[8:end]).get("__metadata__"))
        except Exception as err:  # noqa: BLE001  # safetensors raises its own kinds
            raise ValueError(f"{api}: {where} is not a readable safetensors file: {err}") from err
    else:
        if entry is not None:
            # The manifest's digest is of these very bytes: one read, nothing swapped after it.
            data = read_bytes(path, api)
            _listed(data, entry, where)
            state = torch_load(io.BytesIO(data), where, api)
        else:
            with open_checked(path, api) as f:
                state = torch_load(f, where, api)
        held = _recorded(_recorded(getattr(state, "_metadata", None)), "id")
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        whole = isinstance(state, dict) and state.get("format") == FORMAT
        hint = " (it is a vmapens checkpoint: read it with vmapens.load)" if whole else ""
        if whole and "rows" in state:
            hint = " (it is a member block of a sharded checkpoint: vmapens.load the checkpoint)"
        raise ValueError(f"{api}: {where} does not hold a state_dict (names -> tensors){hint}")
    named = NAMED.fullmatch(os.path.basename(where))
    # Older files record no id; a file renamed by hand (best.pt) names none.
    if held is not None and named is not None and str(held) != str(int(named.group(1))):
        raise ValueError(
            f"{api}: {where} holds member {held}, not member {int(named.group(1))} as its "
            "name says: a file of another member was copied or renamed over it"
        )
    return state


def _listed(data: bytes, entry: dict[str, Any], where: str) -> None:
    """Refuse a member file whose bytes are not those its manifest entry lists."""
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise ValueError(
            f"load_members: {where} is not the file {MANIFEST} lists for member {entry['id']} "
            "(its SHA-256 differs): it was written by another save (a save_members into this "
            "directory that did not finish, or a file copied in) or changed since; save the "
            "ensemble again, or read single files with vmapens.load_member"
        )
