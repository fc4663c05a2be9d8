"""Checkpoints: atomic ``save``, checked ``load``/``restore``, and one file per member."""

from __future__ import annotations

import os
import pickle
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from .ensemble import Ensemble

__all__ = ["load", "restore", "save", "save_members"]

_FORMAT = "vmapens-checkpoint"
_VERSION = 1
_KEYS = {"format", "version", "member_class", "n_total", "member_ids", "state", "optimizer"}
_KEYS |= {"optimizer_class", "history", "fit"}


def save(
    ens: Ensemble,
    path: str | os.PathLike,
    optimizer: torch.optim.Optimizer | None = None,
    history: Any = None,
) -> None:
    """Write the ensemble (and optionally its optimizer and History) to ``path`` atomically.

    The file is written to a temporary file in the same directory and moved over ``path``
    with ``os.replace``: a crash mid-write leaves the previous checkpoint intact. Only tensors
    and plain containers are stored, so ``torch.load(weights_only=True)`` reads it.

    Args:
        ens: the ensemble.
        path: the checkpoint file.
        optimizer: an optimizer over ``ens.parameters()`` whose state to store.
        history: a ``vmapens.fit.History`` to store.

    Example:
        >>> from vmapens import Ensemble
        >>> ens = Ensemble(lambda: nn.Linear(3, 1), n=4, seed=0)
        >>> save(ens, "ens.pt")
        >>> load("ens.pt", lambda: nn.Linear(3, 1)).n_total
        4
    """
    write_checkpoint(ens, path, optimizer, history, fit_state=None)


def write_checkpoint(
    ens: Ensemble,
    path: str | os.PathLike,
    optimizer: torch.optim.Optimizer | None,
    history: Any,
    fit_state: dict | None,
) -> None:
    """``save`` plus the training-loop state that ``fit(checkpoint=...)`` resumes from."""
    payload = {
        "format": _FORMAT,
        "version": _VERSION,
        "member_class": _class_name(ens),
        "n_total": ens.n_total,
        "member_ids": list(ens.member_ids),
        "state": {k: v.detach().cpu() for k, v in ens.state_dict().items()},
        "optimizer": None if optimizer is None else optimizer.state_dict(),
        "optimizer_class": None if optimizer is None else type(optimizer).__name__,
        "history": None if history is None else history.state_dict(),
        "fit": fit_state,
    }
    _atomic(path, lambda f: torch.save(payload, f))


def load(
    path: str | os.PathLike,
    factory: Callable[[], nn.Module],
    optimizer: Callable[[Ensemble], torch.optim.Optimizer] | None = None,
) -> Any:
    """Build an Ensemble from a checkpoint, with the stored members and member ids.

    Args:
        path: a file written by ``save`` or ``fit(checkpoint=...)``.
        factory: builds one member, as for ``Ensemble``; its class must be the stored one.
        optimizer: an optimizer cannot exist before the ensemble it optimises, so pass how to
            build it, e.g. ``vmapens.StackedAdam`` or ``lambda e: StackedAdam(e, lr=1e-2)``;
            it gets the stored optimizer state.

    Returns:
        The ensemble, or ``(ensemble, optimizer)`` when ``optimizer`` is given.

    Raises:
        ValueError: the file is truncated or corrupt, holds objects other than tensors (such
            as code to run), or does not match ``factory``'s members.
        FileNotFoundError: no file at ``path``.
    """
    from .ensemble import Ensemble

    payload = _read(path, "load")
    ids = payload["member_ids"]
    if not ids or ids != list(range(ids[0], ids[0] + len(ids))):
        raise ValueError(f"load: {os.fspath(path)}: member ids {ids} are not a contiguous block")
    # seed=0 leaves the caller's RNG alone; every tensor is overwritten below anyway.
    ens = Ensemble(factory, n=len(ids), seed=0)
    ens.member_ids, ens.n_total = range(ids[0], ids[-1] + 1), payload["n_total"]
    opt = optimizer(ens) if optimizer is not None else None
    payload = _check(payload, path, ens, opt, None, "load")
    apply_checkpoint(payload, ens, opt, None)
    return ens if opt is None else (ens, opt)


def restore(
    path: str | os.PathLike,
    ens: Ensemble,
    optimizer: torch.optim.Optimizer | None = None,
    history: Any = None,
) -> None:
    """Load a checkpoint into an existing ensemble (and optimizer, History), all or nothing.

    Everything is checked before anything is copied: on error ``ens``, ``optimizer`` and
    ``history`` are unchanged.

    Raises:
        ValueError: as for ``load``, or the optimizer/History is missing from the file or
            does not match.
    """
    payload = read_checkpoint(path, ens, optimizer, history, "restore")
    apply_checkpoint(payload, ens, optimizer, history)


def read_checkpoint(
    path: str | os.PathLike, ens: Ensemble, optimizer: Any, history: Any, api: str
) -> dict:
    """Read ``path`` and check it against ``ens``/``optimizer``/``history``; changes nothing."""
    return _check(_read(path, api), path, ens, optimizer, history, api)


def apply_checkpoint(payload: dict, ens: Ensemble, optimizer: Any, history: Any) -> None:
    """Copy a checked payload into the objects (see ``read_checkpoint``)."""
    ens.load_state_dict(payload["state"])
    if optimizer is not None:
        optimizer.load_state_dict(payload["optimizer"])
    if history is not None:
        history.load_state_dict(payload["history"])


def _read(path: str | os.PathLike, api: str) -> dict:
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
    if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
        raise ValueError(f"{api}: {where} is not a vmapens checkpoint (no `{_FORMAT}` marker)")
    if payload.get("version") != _VERSION or set(payload) != _KEYS:
        raise ValueError(
            f"{api}: {where} is a vmapens checkpoint of version {payload.get('version')!r} with "
            f"keys {sorted(payload)}; this vmapens reads version {_VERSION}"
        )
    return payload


def _check(payload: dict, path: Any, ens: Ensemble, optimizer: Any, history: Any, api: str) -> dict:
    where = os.fspath(path)
    held = f"{len(payload['member_ids'])} members of {payload['member_class']}"
    ours = f"{len(ens)} members of {_class_name(ens)}"
    if payload["member_class"] != _class_name(ens) or payload["member_ids"] != list(ens.member_ids):
        raise ValueError(
            f"{api}: {where} holds {held} (ids {_span(payload['member_ids'])} of "
            f"{payload['n_total']}), this ensemble has {ours} (ids {_span(ens.member_ids)} of "
            f"{ens.n_total})"
        )
    state, expected = payload["state"], ens.state_dict()
    if set(state) != set(expected):
        missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
        raise ValueError(f"{api}: {where}: keys differ: missing {missing}, unexpected {extra}")
    for key, t in expected.items():
        got = state[key]
        if not isinstance(got, torch.Tensor) or got.shape != t.shape or got.dtype != t.dtype:
            what = (tuple(got.shape), got.dtype) if isinstance(got, torch.Tensor) else type(got)
            raise ValueError(
                f"{api}: {where}: `{key}` is {what}, this ensemble has {(tuple(t.shape), t.dtype)}"
            )
    if optimizer is not None:
        _check_optimizer(payload, where, optimizer, api)
    if history is not None:
        if payload["history"] is None:
            raise ValueError(f"{api}: {where} holds no History")
        history.check_state(payload["history"], api)
    return payload


def _check_optimizer(payload: dict, where: str, optimizer: Any, api: str) -> None:
    saved = payload["optimizer"]
    if saved is None:
        raise ValueError(f"{api}: {where} holds no optimizer state")
    if payload["optimizer_class"] != type(optimizer).__name__:
        raise ValueError(
            f"{api}: {where} holds {payload['optimizer_class']} state, the optimizer is a "
            f"{type(optimizer).__name__}"
        )
    groups = optimizer.param_groups
    sizes = [len(g["params"]) for g in saved["param_groups"]]
    if sizes != [len(g["params"]) for g in groups]:
        raise ValueError(
            f"{api}: {where}: optimizer param groups hold {sizes} parameters, the optimizer "
            f"{[len(g['params']) for g in groups]}"
        )
    params = [p for g in groups for p in g["params"]]
    for k, state in saved["state"].items():
        if not isinstance(k, int) or not 0 <= k < len(params):
            raise ValueError(f"{api}: {where}: optimizer state for unknown parameter {k!r}")
        for name, v in state.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] != params[k].shape[0]:
                raise ValueError(
                    f"{api}: {where}: optimizer state `{name}` of parameter {k} has shape "
                    f"{tuple(v.shape)}, the parameter {tuple(params[k].shape)}"
                )


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
        >>> from vmapens import Ensemble
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
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for gid, sd in zip(ens.member_ids, ens.state_dicts(), strict=True):
        path = directory / f"member_{gid:04d}.{format}"
        if format == "pt":
            _atomic(path, lambda f, sd=sd: torch.save(sd, f))
        else:
            # safetensors refuses tensors that share memory (tied weights): one copy per key.
            tensors = {k: v.detach().cpu().contiguous().clone() for k, v in sd.items()}
            _atomic(path, lambda f, t=tensors: f.write(to_bytes(t)))
        paths.append(path)
    return paths


def _atomic(path: str | os.PathLike, write: Callable[..., Any]) -> None:
    """Write through a temporary file in the same directory, then ``os.replace`` it.

    ``write(f)`` gets the open binary file; ``...`` lets callers bind loop variables as
    lambda defaults, which mypy cannot match against a one-argument signature.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _class_name(ens: Ensemble) -> str:
    cls = type(ens.template)
    return f"{cls.__module__}.{cls.__qualname__}"


def _span(ids: Any) -> str:
    ids = list(ids)
    return f"{ids[0]}..{ids[-1]}" if ids else "none"
