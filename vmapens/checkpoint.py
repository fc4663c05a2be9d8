"""Checkpoints: the verbs ``save``/``load``/``restore`` and the checks of the parts they load.

The envelope (atomic write, checked read, version) and the layout of a sharded fit checkpoint
live one level down, in ``vmapens._checkpoint_files``, so that ``load`` and ``restore`` read a
sharded checkpoint's member blocks in one process while ``vmapens.sharding``, which writes
them, still builds on this module. The envelope knows no part's insides: each stateful part
(ensemble, optimizer, history, the fit loop) brings its own ``state_dict()`` and
``load_state_dict()``; loading applies the parts all or nothing.
"""

from __future__ import annotations

import copy
import os
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ._checkpoint_files import (
    check_member_ids,
    describe_members,
    localise,
    members_way_out,
    read,
    write,
)
from ._checks import as_ids, repeated
from ._member_shapes import held_shapes, own_shapes, relaid
from ._padding_parts import check_zero_padding
from ._step_parts import check_optimizer
from .ensemble import Ensemble, check_ensemble
from .history import History

__all__ = [
    "apply_parts",
    "check_ensemble_state",
    "check_member_ids",
    "check_members",
    "load",
    "members_of",
    "read",
    "restore",
    "same_class",
    "save",
    "settings_of",
    "write",
]


def apply_parts(payload: Mapping[str, Any], parts: Mapping[str, Any], api: str, where: str) -> None:
    """``part.load_state_dict(payload[name])`` for every part, all or nothing: each part checks
    its state before it changes; if one raises, the parts loaded before it get their previous
    state back (a ValueError names the part and why; other exceptions pass through)."""
    for name in parts:
        if payload.get(name) is None:
            raise ValueError(f"{api}: {where} holds no {name} state")
    before = {name: copy.deepcopy(part.state_dict()) for name, part in parts.items()}
    done: list[str] = []
    try:
        for name, part in parts.items():
            part.load_state_dict(payload[name])
            done.append(name)
    except Exception as err:  # any: a callback's own load_state_dict may raise anything
        for loaded in done:  # not `name`: the message names the part that failed
            parts[loaded].load_state_dict(before[loaded])
        if not isinstance(err, (ValueError, RuntimeError, KeyError, TypeError, IndexError)):
            raise
        raise ValueError(f"{api}: {where}: the {name} state does not fit: {err}") from err


def members_of(ens: Ensemble) -> dict[str, Any]:
    cls = type(ens.template)
    members = {
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "n_total": ens.n_total,
        "member_ids": list(ens.member_ids),
    }
    if ens._padding is not None:  # members of different sizes: each one's own shapes
        members["sizes"] = ens._padding.describe()
    return members


def same_class(held: Any, ens: Ensemble) -> bool:
    """Whether a file's member class (``members_of``'s) is ``ens``'s. A script's classes are
    ``__main__.X`` when it runs and ``train.X`` when imported (``from train import X``): the
    same class, so ``__main__`` on either side matches any module with the same ``X``."""
    cls = type(ens.template)
    module, name = cls.__module__, cls.__qualname__
    if not isinstance(held, str):
        return False
    if held in (f"{module}.{name}", f"__main__.{name}"):
        return True
    return module == "__main__" and held.endswith(f".{name}") and len(held) > len(name) + 1


def settings_of(ens: Ensemble) -> dict[str, Any]:
    """How ``ens`` runs its members, for :func:`load` to build the ensemble alike: a forward
    that only ``backend="loop"`` runs, dropout drawn once for all members."""
    return {"randomness": ens.randomness, "chunk_size": ens.chunk_size, "backend": ens.backend}


def check_members(payload: Mapping[str, Any], ens: Ensemble, api: str, where: str) -> None:
    """The file must hold this ensemble's members: same class and global ids, and every
    member the same shapes (however each side pads them: see :func:`relaid`)."""
    held, ours = payload.get("members"), members_of(ens)
    if isinstance(held, dict) and same_class(held.get("class"), ens):
        held = {**held, "class": ours["class"]}  # the same class under another module name
    if not isinstance(held, dict) or {**held, "sizes": None} != {**ours, "sizes": None}:
        raise ValueError(
            f"{api}: {where} holds {describe_members(held)}, this ensemble has {describe_members(ours)}"
            f"{members_way_out(api, held, ours)}"
        )
    sized = "sizes" in held or "sizes" in ours
    if sized and held_shapes(held, payload.get("ensemble"), ens) != own_shapes(ens):
        raise ValueError(
            f"{api}: {where} holds members of other sizes than this ensemble's (member by "
            "member): build it from the same factories, in the same order"
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
            cast = isinstance(held, torch.Tensor) and held.shape == t.shape  # the dtype differs
            raise ValueError(
                f"{api}: {where}: `{key}` is {what}, this ensemble has {(tuple(t.shape), t.dtype)}"
                + (f"; build the members in {held.dtype} (ens.to({held.dtype}), or a `factory` "
                   f"returning module.to({held.dtype}))" if cast else "")
            )  # fmt: skip


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
        history: the ``vmapens.History`` of ``ens``'s members (``fit``'s) to store.

    Raises:
        TypeError: ``ens``, ``optimizer``, ``history`` or ``path`` of the wrong type.
        ValueError: ``optimizer`` over another ensemble's parameters, ``history`` of others,
            ``ens`` holding a member twice (``ens.select([1, 1])``).
        OSError: see :func:`write`.

    Example:
        >>> ens = Ensemble(lambda: nn.Linear(3, 1), n=4, seed=0)
        >>> save(ens, "ens.pt")
        >>> load("ens.pt", lambda: nn.Linear(3, 1)).n_total
        4
    """
    _check_parts("save", ens, optimizer, history)
    ids = list(ens.member_ids)
    if repeated(ids):  # `load` refuses repeated ids: refused here, nothing written
        raise ValueError(
            f"save: `ens` holds a member more than once (member ids {ids!r:.60}), which a "
            "checkpoint cannot name; save ens.select(...) of distinct members"
        )
    check_zero_padding("save", ens.stacked_state(), ens._padding)
    if history is not None and list(history.member_ids) != list(ens.member_ids):
        raise ValueError(
            f"save: `history` must be the History of `ens`'s members (member ids "
            f"{list(ens.member_ids)!r:.60}), got one of member ids {history.member_ids!r:.60}"
        )
    parts = {
        "members": members_of(ens),
        "settings": settings_of(ens),
        "ensemble": _stored(ens.state_dict()),
        "optimizer": None if optimizer is None else optimizer.state_dict(),
        "optimizer_class": None if optimizer is None else type(optimizer).__name__,
        "history": None if history is None else history.state_dict(),
    }
    write(path, parts, "save")


def _stored(sd: Any) -> OrderedDict[str, torch.Tensor]:
    """``sd`` on CPU, detached, with its ``_metadata`` (each submodule's ``_version``), as
    ``torch.save(module.state_dict())`` keeps it: a member's loader that migrates older
    versions reads the version saved."""
    stored = OrderedDict((k, v.detach().cpu()) for k, v in sd.items())
    stored._metadata = getattr(sd, "_metadata", OrderedDict())  # type: ignore[attr-defined]
    return stored


def _check_parts(api: str, ens: Any, optimizer: Any, history: Any) -> None:
    check_ensemble(api, ens)
    if optimizer is not None:
        check_optimizer(api, ens, optimizer)
    if history is not None and not isinstance(history, History):
        raise TypeError(f"{api}: `history` must be a vmapens.History, got {type(history).__name__}")


def load(
    path: str | os.PathLike,
    factory: Callable[[], nn.Module] | Sequence[Callable[[], nn.Module]],
    **moved: Any,
) -> Ensemble:
    """Build an Ensemble from a checkpoint, with the stored members and member ids.

    To continue training, build the optimizer over the loaded ensemble and give it the stored
    state with :func:`restore`.

    Args:
        path: a file written by ``save`` or ``fit(checkpoint=...)``, or a sharded ``fit``
            checkpoint (``shard=True`` under torch.distributed): then every member, in
            member-id order, read from its block in ``<path>.members/``, in this process.
        factory: builds one member, as for ``Ensemble``; its class must be the stored one.
            For an ensemble built with ``Ensemble.from_factories``: the same factories.

    Returns:
        The ensemble (always the ensemble alone, since 0.3.0), run as the saved one was:
        its ``randomness``, ``chunk_size`` and ``backend`` (set them on it to change them).

    Raises:
        ValueError: the file (or a member block of a sharded checkpoint) is missing,
            truncated or corrupt, holds objects other than tensors, is a block of another run
            or epoch, or does not match ``factory``'s members.
        FileNotFoundError: no file at ``path``.
        TypeError: ``optimizer=`` (0.2's spelling; the message gives 0.3.0's).
    """
    if moved:
        names = ", ".join(f"`{k}`" for k in moved)
        raise TypeError(
            f"load: {names} is not taken since 0.3.0 (load returns the Ensemble alone): "
            "`ens = vmapens.load(path, factory); opt = vmapens.StackedAdam(ens); "
            "vmapens.restore(path, ens, opt)`"
        )
    payload = read(path, "load", whole=True)
    where = os.fspath(path)
    members = payload.get("members")
    ids, n_total = check_member_ids(members, "load", where)
    if "blocks" in payload:  # sharded: every member, in member-id order, as one process has
        ids = sorted(ids)
    if not ids:
        raise ValueError(f"load: {where} holds no members")
    settings = payload.get("settings") or {}  # none in files written before it was kept
    if not isinstance(settings, dict):
        raise ValueError(f"load: {where}: `settings` must be a dict, got {settings!r:.80}")
    # seed=0 leaves the caller's RNG alone; every tensor is overwritten below anyway.
    if isinstance(factory, Sequence):
        if len(factory) != len(ids):
            raise ValueError(
                f"load: {where} holds {len(ids)} members, `factory` gives {len(factory)} "
                "factories; give one per stored member, in order (a sub-ensemble's own)"
            )
        ens = Ensemble.from_factories(factory, seed=0, **settings)
    else:
        ens = Ensemble(factory, n=len(ids), seed=0, **settings)
    ens.member_ids, ens.n_total = as_ids(ids), n_total
    _restore(payload, path, ens, None, None, "load")
    return ens


def restore(
    path: str | os.PathLike,
    ens: Ensemble,
    optimizer: torch.optim.Optimizer | None = None,
    history: History | None = None,
) -> None:
    """Load a checkpoint into an existing ensemble (and optimizer, History), all or nothing.

    ``ens`` holds the stored members, or some of them in any order (``ens.select(rows)`` of
    the same run, or this rank's block of a sharded ensemble): each row gets the state of the
    member whose global id it holds, as restoring the whole ensemble and then taking
    ``ens.select(rows)`` and ``optimizer.select(rows, ...)`` would give. A sharded ``fit``
    checkpoint loads as the single-process run's would. ``history.ensemble_metrics`` is
    None when the file's members are not exactly ``ens``'s (it scored other members), as
    ``gather_history`` gives.

    Raises:
        TypeError: ``ens``, ``optimizer``, ``history`` or ``path`` of the wrong type.
        ValueError: as for ``load`` (a missing or foreign member block included), an
            optimizer over another ensemble's parameters, or the
            optimizer/History is missing from the file or does not match; ``ens``,
            ``optimizer`` and ``history`` are then unchanged.
    """
    _check_parts("restore", ens, optimizer, history)
    _restore(read(path, "restore", whole=True), path, ens, optimizer, history, "restore")


def _restore(
    payload: dict, path: Any, ens: Ensemble, optimizer: Any, history: Any, api: str
) -> None:
    where = os.fspath(path)
    check_member_ids(payload.get("members"), api, where)  # a file's list, before comparing it
    payload = _local(payload, path, ens, api)
    check_members(payload, ens, api, where)
    payload = relaid(payload, ens, optimizer)
    check_ensemble_state(payload.get("ensemble"), ens, api, where)
    held_class = payload.get("optimizer_class")
    if optimizer is not None and held_class not in (None, type(optimizer).__name__):
        raise ValueError(
            f"{api}: {where} holds {held_class} state, the optimizer is a "
            f"{type(optimizer).__name__}"
        )
    held = payload.get("history")
    ids = held.get("member_ids") if isinstance(held, dict) else None
    if history is not None and held is not None and list(ids or ()) != list(ens.member_ids):
        raise ValueError(f"{api}: {where} holds the history of other members (ids {ids!r:.60})")
    parts: dict[str, Any] = {"ensemble": ens}
    if optimizer is not None:
        parts["optimizer"] = optimizer
    if history is not None:
        parts["history"] = history
    apply_parts(payload, parts, api, where)


def _local(payload: dict, path: Any, ens: Ensemble, api: str) -> dict:
    """A checkpoint's parts for ``ens``'s members when it holds some of the file's, each once,
    in its order: their rows, cut from a whole file or read from the blocks of a sharded one
    that hold them (``localise``); else every member, in member-id order, from the blocks.

    A sharded checkpoint's members are checked against ``ens`` before any block is read; a
    missing, corrupt or foreign block is a ValueError (``localise``), before anything changes.
    Rows cut from a file of other members leave the History's ``ensemble_metrics`` None, as
    ``gather_history`` gives: it scored those members (a sharded one holds rank 0's block's).
    """
    where = os.fspath(path)
    held, wanted = payload["members"], list(ens.member_ids)
    ids = list(held["member_ids"])
    same_run = same_class(held.get("class"), ens) and held["n_total"] == ens.n_total
    if not same_run or not set(wanted) <= set(ids) or repeated(wanted):
        if "blocks" not in payload:
            return payload  # other members: check_members names them
        wanted = sorted(ids)
    elif wanted == ids and "blocks" not in payload:
        return payload
    if "blocks" in payload:
        check_members({**payload, "members": _members_for(held, wanted)}, ens, api, where)
    out = {**localise(payload, path, wanted, api), "members": _members_for(held, wanted)}
    history = out.get("history")
    if isinstance(history, dict) and history.get("ensemble_metrics") is not None:
        out["history"] = {**history, "ensemble_metrics": None}
    return out


def _members_for(held: dict, wanted: list[int]) -> dict:
    """A file's ``members`` entry for its members ``wanted``, in that order: their ids, and
    for members of several sizes which size each has."""
    out = {**held, "member_ids": wanted}
    sizes, ids = held.get("sizes"), list(held["member_ids"])
    kinds = sizes.get("kind_of") if isinstance(sizes, dict) else None
    if isinstance(sizes, dict) and isinstance(kinds, list) and len(kinds) == len(ids):
        at = {i: k for k, i in enumerate(ids)}
        out["sizes"] = {**sizes, "kind_of": [kinds[at[i]] for i in wanted]}
    return out
