"""Per-member files: one plain state_dict file per member that any PyTorch code loads.

``save_members`` writes ``member_<id>.pt`` (or ``.safetensors``) with a digest that plain
``torch.load`` / safetensors ignore; ``load_member`` is the checked reader.

Each file also records whose it is: the member's global id, in the state dict's
``_metadata`` under :data:`MEMBER_KEY` (``.pt``; ``load_state_dict`` looks up only its
modules' own prefixes there) or in the safetensors header metadata. A digest proves a file
whole, not that it is the file its name says: ``load_member`` refuses ``member_0003.pt``
holding member 2 (a file copied or renamed over another).
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

from ._checkpoint_files import FORMAT
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
from .ensemble import Ensemble, check_ensemble

__all__ = ["MEMBER_KEY", "load_member", "save_members"]

#: Where a member file records its member's global id (see the module docstring).
MEMBER_KEY = "vmapens:member_id"
_NAMED = re.compile(r"member_(\d+)\.(pt|safetensors)")


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
        TypeError: ``ens`` is not an Ensemble, ``directory`` not a path.
        ValueError: unknown ``format``.
        ImportError: ``format="safetensors"`` without the safetensors package.
        OSError: ``directory`` cannot be created or written.

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
        raise write_error("save_members", directory, err) from err
    # Each submodule's `_version`, as `module.state_dict()` carries it: a module whose
    # `_load_from_state_dict` migrates older versions reads a file without it as version 1.
    metadata = getattr(ens.template.state_dict(), "_metadata", None)
    paths = []
    for gid, sd in zip(ens.member_ids, ens.state_dicts(), strict=True):
        path = directory / f"member_{gid:04d}.{format}"
        if format == "pt":
            versioned = OrderedDict(sd)
            held = copy.deepcopy(metadata) if metadata is not None else OrderedDict()
            held[MEMBER_KEY] = {"id": gid}
            versioned._metadata = held  # type: ignore[attr-defined]
            atomic_write(path, seal_torch(versioned), "save_members")
        else:
            # safetensors refuses tensors that share memory (tied weights): one copy per key.
            tensors = {k: v.detach().cpu().contiguous().clone() for k, v in sd.items()}
            sealed = seal_safetensors(to_bytes, tensors, {MEMBER_KEY: str(gid)})
            atomic_write(path, _bytes_writer(sealed), "save_members")
        paths.append(path)
    return paths


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
    that records another member's id.

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
    where = os.fspath(path)
    if where.endswith(".safetensors"):
        try:
            from safetensors.torch import load as from_bytes
        except ImportError as err:
            raise ImportError(
                f"load_member: {where} is a safetensors file; install the safetensors package "
                "with: pip install 'vmapens[safetensors]'"
            ) from err
        data = read_bytes(path, "load_member")
        unseal_safetensors(data, where, "load_member")
        try:
            state = from_bytes(data)
            end = 8 + int.from_bytes(data[:8], "little")
            held = _recorded(json.loads(data[8:end]).get("__metadata__"))
        except Exception as err:  # noqa: BLE001  # safetensors raises its own kinds
            raise ValueError(
                f"load_member: {where} is not a readable safetensors file: {err}"
            ) from err
    else:
        with open_checked(path, "load_member") as f:
            state = torch_load(f, where, "load_member")
        entry = _recorded(getattr(state, "_metadata", None))
        held = _recorded(entry, "id")
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        whole = isinstance(state, dict) and state.get("format") == FORMAT
        hint = " (it is a vmapens checkpoint: read it with vmapens.load)" if whole else ""
        if whole and "rows" in state:
            hint = " (it is a member block of a sharded checkpoint: vmapens.load the checkpoint)"
        raise ValueError(
            f"load_member: {where} does not hold a state_dict (names -> tensors){hint}"
        )
    named = _NAMED.fullmatch(os.path.basename(where))
    # Older files record no id; a file renamed by hand (best.pt) names none.
    if held is not None and named is not None and str(held) != str(int(named.group(1))):
        raise ValueError(
            f"load_member: {where} holds member {held}, not member {int(named.group(1))} as its "
            "name says: a file of another member was copied or renamed over it"
        )
    return state
