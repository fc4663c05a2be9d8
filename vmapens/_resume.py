"""The resume check of ``fit``: this run's options, derived from ``fit``'s own arguments, against
the checkpoint's.

Every argument of ``fit`` is compared unless :data:`NOT_COMPARED` says why not, so an option
added to ``fit`` is compared without anyone listing it. Values that cannot be compared as they
are become fingerprints: tensors by shape, dtype and a SHA-256 of their bytes, modules (a loss)
by their repr, plain attributes and tensors, callables by qualified name, the optimizer (its hyperparameters included) and schedulers by the settings
they were built with.
"""

from __future__ import annotations

import functools
import hashlib
import os
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from ._checkpoint_files import check_member_ids, localise, read
from ._files import signature
from ._member_shapes import relaid
from .checkpoint import check_ensemble_state, check_members, same_class
from .ensemble import Ensemble
from .optim import MemberValues

__all__ = ["NOT_COMPARED", "fingerprint", "hyperparameters_of", "read_checkpoint"]

#: ``fit`` arguments a resumed run may change, and why.
NOT_COMPARED = {
    "ens": "checked member by member (class, ids, state shapes)",
    "epochs": "a resumed run may train for more epochs",
    "checkpoint": "the path itself",
    "progress": "display only",
    "callbacks": "each stateful callback's state is matched by class, and checks its settings",
    "seed": "None takes the checkpoint's; compared apart",
}


def fingerprint(value: Any) -> Any:
    """A comparable, printable stand-in for ``value`` (tensors and callables included)."""
    if isinstance(value, Tensor) and value.dim() == 0:  # a tensor lr, a loss's scalar buffer
        return f"tensor({value.item()!r}, dtype={value.dtype})"
    if isinstance(value, Tensor):
        t = value.detach().cpu().contiguous()
        digest = hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return f"tensor{tuple(t.shape)} {t.dtype} sha256={digest.hexdigest()[:16]}"
    if isinstance(value, (list, tuple)):
        return [fingerprint(v) for v in value]
    if isinstance(value, dict):
        return {str(k): fingerprint(v) for k, v in value.items()}
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    if isinstance(value, torch.nn.Module):
        # A loss's repr leaves its settings out: CrossEntropyLoss(label_smoothing=0.3) prints
        # "CrossEntropyLoss()". Its plain attributes and tensors (a class weight) go in too.
        # A loss wrapping another (self.inner = CrossEntropyLoss(label_smoothing=...)): the
        # inner one's repr says as little, so every submodule's settings go in, by prefix.
        plain = (int, float, str, bool, type(None))
        settings = [
            f"{prefix}{'.' if prefix else ''}{k}={v!r}"
            for prefix, module in value.named_modules()
            for k, v in sorted(vars(module).items())
            if not k.startswith("_") and k != "training" and isinstance(v, plain)
        ]
        settings += [f"{k}={fingerprint(t)}" for k, t in value.state_dict().items()]
        return repr(value) + (f" with {', '.join(settings)}" if settings else "")
    if isinstance(value, DataLoader):  # its repr is an address: what it yields, instead
        data = value.dataset
        held = fingerprint(data.tensors) if isinstance(data, TensorDataset) else None
        return (
            f"DataLoader of length {_length(value)}, batch_size={value.batch_size}, "
            f"drop_last={value.drop_last}, {type(value.sampler).__name__}, "
            f"{type(data).__qualname__}{'' if held is None else f' of {held}'}"
        )
    if isinstance(value, functools.partial):  # its repr names the function by address
        bound = [fingerprint(value.func), *map(fingerprint, value.args)]
        bound += [f"{k}={fingerprint(v)!r}" for k, v in sorted(value.keywords.items())]
        return f"partial({', '.join(map(str, bound))})"
    text = repr(value)
    if " at 0x" not in text and "object at" not in text:
        return text
    kind = value if callable(value) and hasattr(value, "__qualname__") else type(value)
    # The qualified name without the module: a script's functions live in ``__main__`` when it
    # runs as a script and under its own name when imported, and both are the same run.
    name = str(getattr(kind, "__qualname__", kind))
    size = None if callable(value) else _length(value)
    return name if size is None else f"{name} of length {size}"


def _length(value: Any) -> int | None:
    """``len(value)``, or None: a DataLoader over an ``IterableDataset`` without ``__len__``
    has a ``__len__`` that raises ``TypeError``."""
    try:
        return len(value)
    except TypeError:
        return None


def hyperparameters_of(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's hyperparameters as built (not its state), by name, for resume checks.

    Per-member values stay ``MemberValues`` (a sharded checkpoint re-cuts them per rank);
    tensors (a 0-d tensor ``lr``) are fingerprinted, since their repr rounds to four decimals;
    the rest is compared as text.
    """
    out: dict[str, Any] = {"class": type(optimizer).__name__}
    for k, group in enumerate(optimizer.param_groups):
        # A torch scheduler keeps the lr the group was built with in `initial_lr` and moves
        # `lr` at every step: the setting is `initial_lr`. The same objects going on after an
        # interrupt mid-epoch (lr scheduled past the checkpoint) are then the run they are.
        built = {**group, "lr": group["initial_lr"]} if "initial_lr" in group else group
        for name, v in built.items():
            if name in ("params", "initial_lr"):
                continue
            tensors = isinstance(v, Tensor) or (
                isinstance(v, tuple) and any(isinstance(x, Tensor) for x in v)
            )
            out[f"group{k}.{name}"] = (
                v if _per_member(v) else fingerprint(v) if tensors else repr(v)
            )
    return out


def _per_member(v: Any) -> bool:
    return isinstance(v, MemberValues) or (
        isinstance(v, tuple) and any(isinstance(x, MemberValues) for x in v)
    )


def read_checkpoint(
    path: str | os.PathLike,
    ens: Ensemble,
    options: dict[str, Any],
    seed: int | None,
    override: tuple[str, ...] = (),
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Read a fit checkpoint and check it against this run's ``options``; changes nothing.

    The ensemble (and ``optimizer``) tensors come back padded as ``ens`` pads them
    (:func:`~vmapens.checkpoint.relaid`): a sub-ensemble of members of several sizes resumes
    rebuilt from its own members' factories.

    Raises:
        ValueError: another ensemble, a file ``save()`` wrote, or options that differ and
            are not in ``override`` (each named, with both values).
    """
    where = os.fspath(path)
    seen = signature(path)  # before reading: a later replacement shows as another file
    payload = read(path, "fit", whole=True)
    held = payload.get("members")
    check_member_ids(held, "fit", where)  # a list of ids in range, before cutting rows by it
    if (
        isinstance(held, dict)
        and same_class(held.get("class"), ens)
        and held.get("n_total") == ens.n_total
    ):  # the same run at any world size: this process's members
        payload = localise(payload, path, list(ens.member_ids), "fit")
    check_members(payload, ens, "fit", where)
    payload = relaid(payload, ens, optimizer)
    check_ensemble_state(payload.get("ensemble"), ens, "fit", where)
    state = payload.get("fit")
    if state is None:
        raise ValueError(
            f"fit: {where} was written by save(), not by fit(checkpoint=...): it holds no "
            "training-loop state to resume from; use another path"
        )
    state["seen"] = seen
    stored = state["options"]
    ours = {**options, "seed": stored.get("seed") if seed is None else seed}
    unknown = [k for k in override if k not in ours]
    if unknown:
        raise ValueError(
            f"fit: `Checkpoint.override` names unknown options {unknown}; known: {sorted(ours)}"
        )
    # The same optimizer and scheduler objects continuing (fit called again with more epochs)
    # have the settings they had when the checkpoint was written, not those they were built with.
    live = state.get("live_options") or {}
    differ = [
        k
        for k in {**stored, **ours}
        if stored.get(k) != ours.get(k)
        and k not in override
        and not (k in live and live[k] == ours.get(k))
    ]
    if differ:
        got = ", ".join(_difference(k, ours.get(k), stored.get(k)) for k in differ)
        raise ValueError(
            f"fit: cannot resume from {where}: it was written by a run with other options: "
            f"{got}; resume with the same arguments, or pass "
            f"vmapens.callbacks.Checkpoint(path, override={tuple(differ)!r}) to use this run's"
        )
    payload["fit"]["options"] = {**stored, **{k: ours[k] for k in override}}
    return payload


def _difference(name: str, ours: Any, stored: Any) -> str:
    """``name=ours (checkpoint: stored)``, naming only the entries that differ in a dict."""
    if isinstance(ours, dict) and isinstance(stored, dict):
        keys = [k for k in {**stored, **ours} if ours.get(k) != stored.get(k)]
        return ", ".join(f"{name}.{k}={ours.get(k)} (checkpoint: {stored.get(k)})" for k in keys)
    return f"{name}={ours!r} (checkpoint: {stored!r})"
