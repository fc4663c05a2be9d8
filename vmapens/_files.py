"""Files vmapens writes: atomic replacement, a SHA-256 digest inside each file, checked reads.

Every file carries the SHA-256 of its own bytes, so a changed byte anywhere is an error on
read, never changed values, and the file stays readable by the plain tools:

- ``.pt`` files (checkpoints, member blocks, ``save_members``) are ``torch.save`` zips whose
  end-of-zip comment (empty as torch writes it) becomes ``vmapens-sha256:<hex>``, the digest
  of the file as torch wrote it. Zip readers ignore the comment, so ``torch.load`` is unchanged.
- ``.safetensors`` files hold the digest in their header metadata under ``vmapens-sha256``,
  computed over the whole file with the 64 hex digits zeroed.

A ``.pt`` file holds only tensors and plain containers: a per-member hyperparameter
(``MemberValues``) is written as ``{"vmapens:member_values": [...]}`` and read back as one, so
``torch.load(weights_only=True)`` reads every file without vmapens installed.

Writes go through a temporary file in the same directory, named after the writer's pid and
locked while written, then ``os.replace`` (one atomic rename). A temporary file is removed by
a later save only when its writer is gone (no such pid here) and it is not locked.
"""

from __future__ import annotations

import copy
import errno
import fcntl
import hashlib
import json
import os
import pickle
import re
import stat
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

import torch

from .optim._values import MemberValues

__all__ = [
    "DIGEST_KEY",
    "MANIFEST",
    "atomic_write",
    "check_path",
    "open_checked",
    "read_bytes",
    "remove_stale_temps",
    "seal_safetensors",
    "seal_torch",
    "signature",
    "torch_load",
    "unseal_safetensors",
    "write_error",
]

DIGEST_KEY = "vmapens-sha256"
MANIFEST = "members.json"  # names a set of member files (vmapens._member_manifest)
_MARK = DIGEST_KEY.encode() + b":"
_HEX = 64
_COMMENT = len(_MARK) + _HEX  # the zip comment vmapens writes
_TAIL = 2 + _COMMENT  # the comment's length field, then the comment
_EOCD = b"PK\x05\x06"  # end of central directory: 22 bytes, the last 2 the comment length
_CHUNK = 1 << 20
_PID = re.compile(r"\.(\d+)\.[^.]+\.tmp$")  # .<name>.<pid>.<random>.tmp


class _Hashing:
    """A write-only file object that hashes everything passed to the file under it."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f, self.sha = f, hashlib.sha256()
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        try:
            return self.f.write(data)
        except OSError as err:  # torch's writer turns it into "enforce fail ...": keep it
            self.error = err
            raise

    def flush(self) -> None:
        self.f.flush()


_VALUES = "vmapens:member_values"


def _plain(obj: Any, back: bool = False) -> Any:
    """``obj`` with each ``MemberValues`` as ``{_VALUES: [...]}`` (``back``: the reverse);
    containers that hold none come back as they are (an OrderedDict keeps its metadata)."""
    if not back and isinstance(obj, MemberValues):
        return {_VALUES: list(obj.values)}
    if back and isinstance(obj, dict) and list(obj) == [_VALUES]:
        return MemberValues(obj[_VALUES])
    if isinstance(obj, (dict, list, tuple)):
        items = list(obj.items() if isinstance(obj, dict) else enumerate(obj))
        swapped = {k: _plain(v, back) for k, v in items}
        if all(swapped[k] is v for k, v in items):
            return obj
        if isinstance(obj, dict):
            out = copy.copy(obj)
            out.update(swapped)
            return out
        return (tuple if isinstance(obj, tuple) else list)(swapped.values())
    return obj


def seal_torch(obj: Any) -> Callable[[IO[bytes]], None]:
    """A writer for :func:`atomic_write`: ``torch.save(obj)`` of plain containers only (see
    the module docstring), its digest as the zip comment."""
    obj = _plain(obj)

    def write_to(f: IO[bytes]) -> None:
        hashing = _Hashing(f)
        try:
            torch.save(obj, hashing)  # type: ignore[arg-type]  # a file object: write and flush
        except RuntimeError:
            if hashing.error is not None:  # the disk's own error (ENOSPC, EFBIG, ...)
                raise hashing.error from None
            raise
        f.seek(-22, os.SEEK_END)
        end = f.read(22)
        if not (end.startswith(_EOCD) and end.endswith(b"\0\0")):
            raise RuntimeError("torch.save did not end the file with an empty zip comment")
        f.seek(-2, os.SEEK_END)
        f.write(_COMMENT.to_bytes(2, "little") + _MARK + hashing.sha.hexdigest().encode())

    return write_to


def check_path(api: str, name: str, path: Any) -> None:
    """Raise TypeError unless ``path`` is a ``str`` or ``os.PathLike``, naming argument ``name``."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{api}: `{name}` must be a str or os.PathLike, got {type(path).__name__}")


def open_checked(path: str | os.PathLike, api: str, what: str = "file") -> IO[bytes]:
    """``path`` opened for reading once its digest matches its bytes (a ``.pt`` zip).

    Raises:
        TypeError: ``path`` is not a path.
        FileNotFoundError: no file at ``path``.
        ValueError: unreadable, truncated, no digest, or a digest that does not match.
    """
    check_path(api, "path", path)
    where = os.fspath(path)
    if os.path.basename(where) == MANIFEST and os.path.isfile(where):
        raise ValueError(
            f"{api}: {where} is the {MANIFEST} of a set of member files (save_members), not a "
            f"{what} of tensors: read the set with vmapens.load_members(directory)"
        )
    try:
        f = open(where, "rb")  # noqa: SIM115  # returned open, or closed below
    except FileNotFoundError:
        raise FileNotFoundError(f"{api}: no {what} at {where}") from None
    except OSError as err:
        raise _unreadable(api, where, err) from err
    try:
        _check_zip_digest(f, where, api)
    except BaseException:
        f.close()
        raise
    return f


def read_bytes(path: str | os.PathLike, api: str) -> bytes:
    """The bytes of ``path``; FileNotFoundError when missing, ValueError when unreadable."""
    check_path(api, "path", path)
    where = os.fspath(path)
    try:
        with open(where, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"{api}: no file at {where}") from None
    except OSError as err:
        raise _unreadable(api, where, err) from err


def _unreadable(api: str, where: str, err: OSError) -> ValueError:
    """The error for a path that cannot be read, saying what reads a set of member files."""
    hint = ""
    if os.path.isfile(os.path.join(where, MANIFEST)):
        hint = (
            "; it is a directory of member files (save_members): read it with vmapens.load_members"
        )
    return ValueError(f"{api}: cannot read {where}: {err.strerror or err}{hint}")


def _check_zip_digest(f: IO[bytes], where: str, api: str) -> None:
    try:
        size = os.fstat(f.fileno()).st_size
        sha, left = hashlib.sha256(), size - _TAIL
        while left > 0:
            chunk = f.read(min(_CHUNK, left))
            if not chunk:
                break
            sha.update(chunk)
            left -= len(chunk)
        tail = f.read()
    except OSError as err:
        raise ValueError(f"{api}: cannot read {where}: {err.strerror or err}") from err
    if size < _TAIL + 22 or tail[: 2 + len(_MARK)] != _COMMENT.to_bytes(2, "little") + _MARK:
        raise ValueError(
            f"{api}: {where} carries no vmapens digest ({size} bytes): a truncated or corrupt "
            "file, or one not written by vmapens >= 0.3"
        )
    sha.update(b"\0\0")  # the comment length as torch wrote it
    if sha.hexdigest().encode() != tail[2 + len(_MARK) :]:
        raise ValueError(
            f"{api}: {where} is corrupt: its bytes do not match the SHA-256 digest it carries "
            "(a changed byte or a partial copy); nothing was loaded from it"
        )
    f.seek(0)


def torch_load(f: IO[bytes], where: str, api: str) -> Any:
    """``torch.load(f, weights_only=True)`` on CPU, every failure a ValueError naming ``where``."""
    try:
        return _plain(torch.load(f, map_location="cpu", weights_only=True), back=True)
    except pickle.UnpicklingError as err:
        raise ValueError(
            f"{api}: refusing to load {where}: it holds objects other than tensors and plain "
            f"containers (possibly code that would run when unpickled); torch.load with "
            f"weights_only=True stopped at: {str(err).splitlines()[0]}"
        ) from err
    except Exception as err:  # noqa: BLE001  # torch raises many kinds for a bad file
        raise ValueError(
            f"{api}: {where} is not a readable file of tensors: {type(err).__name__}: {err}"
        ) from err


def seal_safetensors(
    to_bytes: Callable[..., bytes],
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str] | None = None,
) -> bytes:
    """safetensors bytes of ``tensors`` with ``metadata`` and the file's digest in the header."""
    data = bytearray(to_bytes(tensors, metadata={**(metadata or {}), DIGEST_KEY: "0" * _HEX}))
    at = _digest_at(bytes(data))
    assert at is not None  # we wrote it just now
    data[at : at + _HEX] = hashlib.sha256(data).hexdigest().encode()
    return bytes(data)


def unseal_safetensors(data: bytes, where: str, api: str) -> None:
    """Check the digest that :func:`seal_safetensors` put in ``data``'s header."""
    at = _digest_at(data)
    if at is None:
        raise ValueError(
            f"{api}: {where} carries no vmapens digest in its safetensors header: a truncated "
            "or corrupt file, or one not written by vmapens >= 0.3"
        )
    zeroed = bytearray(data)
    zeroed[at : at + _HEX] = b"0" * _HEX
    if hashlib.sha256(zeroed).hexdigest().encode() != data[at : at + _HEX]:
        raise ValueError(
            f"{api}: {where} is corrupt: its bytes do not match the SHA-256 digest it carries "
            "(a changed byte or a partial copy); nothing was loaded from it"
        )


def _digest_at(data: bytes) -> int | None:
    """Where the digest's hex digits start in a safetensors file, None if it has none."""
    if len(data) < 8:
        return None
    end = 8 + int.from_bytes(data[:8], "little")
    key = json.dumps(DIGEST_KEY).encode() + b':"'
    at = data.find(key, 8, end)
    start = at + len(key)
    return None if at < 0 or start + _HEX > end else start


def atomic_write(
    path: str | os.PathLike, write_to: Callable[[IO[bytes]], Any], api: str
) -> tuple[int, ...]:
    """Write through a locked temporary file in the same directory, then ``os.replace`` it.

    A crash at any point leaves the previous file at ``path`` whole: the new one appears by one
    atomic rename, after ``fsync``; the directory is synced after it.

    Returns:
        The :func:`signature` of the file written (what ``path`` is until someone replaces it).

    Raises:
        TypeError: ``path`` is not a path (nothing is written).
        OSError: the directory is missing or read-only, the disk is full, or the file is over
            the size limit; the message says which and that the previous file is intact.
    """
    check_path(api, "path", path)
    # Through a symlink to its target, as torch.save writes: replacing the link itself would
    # leave the file it points to stale (and the link gone).
    path = Path(os.path.realpath(path)) if os.path.islink(path) else Path(path)
    if path.parent.is_dir():
        _remove_unowned(path.parent.glob(f".{path.name}.*.tmp"))
    try:
        fd, tmp = tempfile.mkstemp(
            prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent
        )
    except OSError as err:
        raise write_error(api, path, err) from err
    try:
        with os.fdopen(fd, "w+b") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # "in use", for writers on other hosts
            # mkstemp makes 0600; the file gets the mode torch.save would give it: the
            # replaced file's, else 0666 less the umask (readable by the group, as usual).
            os.fchmod(f.fileno(), _mode(path))
            write_to(f)
            f.flush()
            os.fsync(f.fileno())
            written = _key(os.fstat(f.fileno()))
            os.replace(tmp, path)
        _sync_dir(path.parent)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(err, (OSError, RuntimeError)) and not isinstance(err, NotImplementedError):
            raise write_error(api, path, err) from err
        raise
    return written


def _mode(path: Path) -> int:
    """The permission bits a plain ``open(path, "wb")`` leaves ``path`` with."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        pass
    try:  # Linux: the umask without setting it (os.umask would race other threads)
        with open("/proc/self/status") as f:
            umask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        umask = os.umask(0o022)
        os.umask(umask)
    return 0o666 & ~umask


_REASONS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EFBIG: "the file would exceed the file-size limit (ulimit -f or the file system's)",
}


def write_error(api: str, path: Path, err: BaseException) -> OSError:
    """An OSError for a failed write that says why in words and that the old file is intact."""
    code = getattr(err, "errno", None) or errno.EIO
    reason = _REASONS.get(code)
    said = f"{reason} ({err})" if reason else str(err)
    return OSError(
        code, f"{api}: could not write {path}: {said}; any previous file at that path is intact"
    )


def remove_stale_temps(directory: Path) -> None:
    """Delete the temporary files that interrupted saves into ``directory`` left behind."""
    _remove_unowned(directory.glob(".*.tmp"))


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def _remove_unowned(paths: Iterable[Path]) -> None:
    """Delete the temporary files whose writer is gone: no live pid, and not locked."""
    for tmp in paths:
        pid = _PID.search(tmp.name)
        if pid is not None and _alive(int(pid.group(1))):
            continue
        try:
            fd = os.open(tmp, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a writer on another host holds it
        finally:
            os.close(fd)
        tmp.unlink(missing_ok=True)


def _sync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def signature(path: str | os.PathLike) -> tuple[int, ...] | None:
    """Which file is at ``path`` now (device, inode, size, mtime), None when there is none."""
    try:
        return _key(os.stat(path))
    except FileNotFoundError:
        return None


def _key(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
