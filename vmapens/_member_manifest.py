"""``members.json``: the manifest that makes a directory of member files one set.

``save_members`` writes it last, by one atomic rename, so it is the set's commit point: it
names every member file of one save (member id, file name, the SHA-256 of the whole file as
written) and that save's random id. A crash before it leaves the previous manifest, whose
digests the new files no longer match, so a half-written set is refused rather than mixed.
Like every file vmapens writes, the manifest carries its own digest (``vmapens-sha256``: the
SHA-256 of its other fields as compact, key-sorted JSON) and stays readable by any JSON tool.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from ._files import DIGEST_KEY, MANIFEST, atomic_write, read_bytes

__all__ = [
    "MANIFEST",
    "NAMED",
    "drop_stale",
    "file_digest",
    "member_file_names",
    "previous",
    "read_manifest",
    "write_manifest",
]

NAMED = re.compile(r"member_(\d+)\.(pt|safetensors)")
_KIND = "vmapens.members"
_VERSION = 1
_HEX = re.compile(r"[0-9a-f]{64}")
_CHUNK = 1 << 20


def file_digest(f: IO[bytes]) -> str:
    """The SHA-256 (hex) of everything in the open file ``f``, read from its start."""
    f.flush()
    f.seek(0)
    sha = hashlib.sha256()
    while chunk := f.read(_CHUNK):
        sha.update(chunk)
    return sha.hexdigest()


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def write_manifest(
    directory: Path, entries: Sequence[dict[str, Any]], n_total: int, api: str
) -> dict[str, Any]:
    """Write ``directory/members.json`` for ``entries`` (``id``, ``file``, ``sha256``) atomically.

    Returns:
        The manifest written (without its digest).
    """
    body = {
        "format": _KIND,
        "version": _VERSION,
        "save_id": uuid.uuid4().hex,
        "n_members": len(entries),
        "n_total": n_total,
        "members": [dict(e) for e in entries],
    }
    text = json.dumps({**body, DIGEST_KEY: hashlib.sha256(_canonical(body)).hexdigest()}, indent=1)
    data = (text + "\n").encode()
    atomic_write(directory / MANIFEST, lambda f: f.write(data), api)
    return body


def read_manifest(directory: Path, api: str) -> dict[str, Any]:
    """The checked manifest of ``directory`` (see :func:`_checked` for what is checked).

    Raises:
        FileNotFoundError: no such directory, or no ``members.json`` in it.
        ValueError: ``directory`` is a file; a corrupt, foreign or newer manifest.
    """
    if directory.is_file():
        raise ValueError(
            f"{api}: `directory` {directory} is a file, not a directory of member files; read "
            "one member file with vmapens.load_member"
        )
    if not directory.is_dir():
        raise FileNotFoundError(f"{api}: no directory at {directory}")
    path = directory / MANIFEST
    if not path.exists():
        raise FileNotFoundError(
            f"{api}: {directory} holds no {MANIFEST}, so there is no set of members to load: "
            "files written by vmapens 0.3 or earlier have none (read each with "
            "vmapens.load_member), or the first save_members into it did not finish (save the "
            "ensemble again)"
        )
    return _checked(read_bytes(path, api), str(path), api)


def previous(directory: Path) -> dict[str, Any] | None:
    """The manifest in ``directory`` now if it is whole and readable, else None."""
    try:
        return read_manifest(directory, "save_members")
    except (OSError, ValueError):
        return None


def _checked(data: bytes, where: str, api: str) -> dict[str, Any]:
    """The manifest in ``data``: its digest, version, and entries that name bare files."""

    def bad(what: str) -> ValueError:
        return ValueError(f"{api}: {where} is not a manifest of member files: {what}")

    try:
        held = json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise bad(f"not JSON ({err}); a truncated or corrupt file") from err
    if not isinstance(held, dict) or held.get("format") != _KIND:
        raise bad(f'it has no "format": "{_KIND}"')
    version = held.get("version")
    if isinstance(version, int) and version > _VERSION:
        raise ValueError(
            f"{api}: {where} is manifest version {version}, written by a newer vmapens (this one "
            f"reads version {_VERSION}); upgrade vmapens to read it"
        )
    digest = held.pop(DIGEST_KEY, None)
    if digest != hashlib.sha256(_canonical(held)).hexdigest():
        raise ValueError(
            f"{api}: {where} is corrupt: its contents do not match the SHA-256 digest it "
            "carries (a changed byte, a hand edit or a partial copy); nothing was loaded"
        )
    members, n_total = held.get("members"), held.get("n_total")
    if not isinstance(members, list) or not isinstance(n_total, int) or version != _VERSION:
        raise bad("no list of members, no `n_total` or no version")
    if held.get("n_members") != len(members):
        raise bad(f"it says {held.get('n_members')} members and lists {len(members)}")
    ids = set()
    for entry in members:
        ok = isinstance(entry, dict) and set(entry) == {"id", "file", "sha256"}
        named = NAMED.fullmatch(entry["file"]) if ok and isinstance(entry["file"], str) else None
        gid = entry.get("id") if ok else None
        if (
            named is None
            or type(gid) is not int
            or int(named.group(1)) != gid
            or not 0 <= gid < n_total
            or gid in ids
            or not isinstance(entry["sha256"], str)
            or not _HEX.fullmatch(entry["sha256"])
        ):
            raise bad(f"a bad member entry {entry!r}")
        ids.add(gid)
    return held


def member_file_names(directory: Path) -> set[str]:
    """The names of the ``member_<id>.pt`` / ``.safetensors`` files in ``directory``."""
    return {p.name for p in directory.iterdir() if NAMED.fullmatch(p.name) and p.is_file()}


def drop_stale(directory: Path, old: dict[str, Any] | None, kept: set[str]) -> None:
    """Remove the files the ``old`` manifest listed that are not in ``kept``, when their bytes
    still have the digest it lists (a file someone put there since is not ours to remove)."""
    for entry in old["members"] if old is not None else ():
        if entry["file"] in kept:
            continue
        path = directory / entry["file"]
        try:
            data = path.read_bytes()
        except OSError:
            continue  # gone already, or not readable: not removed
        if hashlib.sha256(data).hexdigest() == entry["sha256"]:
            path.unlink(missing_ok=True)
