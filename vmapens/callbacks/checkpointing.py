"""Checkpointing: the whole run written after every epoch; a run that finds it resumes from it."""

from __future__ import annotations

import copy
import os
import uuid
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from .._checks import check_writable_dir
from .._data import data_generators
from .._files import signature
from .._resume import NOT_COMPARED, fingerprint, hyperparameters_of, read_checkpoint
from ..checkpoint import apply_parts, members_of, read, settings_of, write
from ..distributed import broadcast_object, raise_together, rank, world_size
from ..optim.plateau import plateaus_on
from ..sharding import drop_blocks, save_sharded
from .base import Callback, Context
from .scheduler import LRScheduler, attached_scheduler

__all__ = ["Checkpoint"]

#: Optimizers whose run raised after changing their settings past the checkpoint it wrote
#: last (a PBT round at an epoch's end, before that epoch's write): (their settings when it
#: raised, the checkpoint's). Resumed untouched since, such an optimizer is that run going on.
_UNSAVED: weakref.WeakKeyDictionary[Any, tuple[Any, Any]] = weakref.WeakKeyDictionary()
#: Each ensemble as the last run with a checkpoint left it in this process: (that run's id,
#: the ``fingerprint`` of its values). Resuming that run with the ensemble edited since (a
#: server's average between two rounds' fits) would replace the edit with the checkpoint's
#: values, silently.
_LEFT: weakref.WeakKeyDictionary[Any, tuple[str, Any]] = weakref.WeakKeyDictionary()


class Checkpoint(Callback):
    """Write the run to ``path`` after every epoch; resume from it when it exists at the start.

    ``fit(checkpoint=path)`` is ``callbacks=[Checkpoint(path)]``. The file is written
    atomically, after every other callback's ``on_epoch_end`` (``fit`` runs checkpoints last),
    and holds the ensemble, the optimizer, the history, where training stands in the data, the
    RNG and every callback's state: a run that finds it resumes and ends exactly as an
    uninterrupted run would. Under ``torch.distributed`` each rank writes its members to a block
    file keyed by their global ids (in ``<path>.members``) and rank 0 the rest to ``path``: a run
    resumes at any number of processes (docs/distributed.md).

    The resumed run must be the same run: every ``fit`` argument is compared with the
    checkpoint's (``vmapens._resume``) and a difference is an error naming each option and both
    values, unless ``override`` names it.

    Args:
        path: the checkpoint file.
        override: options that may differ from the checkpoint's (``"optimizer"``: this run's
            hyperparameters replace the stored ones; ``"scheduler"``: the stored scheduler state
            is dropped; ``"val_data"``, ``"batch_size"``, ``"data"``, ...: this run's is used).

    Raises:
        TypeError: ``path`` not a str or ``os.PathLike``, ``override`` not a sequence of names.
        ValueError: at fit start, a directory that cannot be written, a torch scheduler built on
            the optimizer that ``fit`` does not step (its state would be lost), an ``override``
            that names no option of ``fit``, a checkpoint of another run; ``FileExistsError``
            when another run replaced the file.
    """

    def __init__(self, path: str | os.PathLike, override: Sequence[str] = ()) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(
                f"Checkpoint: `path` must be a str or os.PathLike, got {type(path).__name__}"
            )
        check_writable_dir("Checkpoint", "path", path)
        if isinstance(override, str) or not all(isinstance(o, str) for o in override):
            raise TypeError(
                f"Checkpoint: `override` must be a sequence of option names, got {override!r}"
            )
        self.path, self.override = path, tuple(override)
        self.options: dict[str, Any] = {}
        # This run's identity in its checkpoints, and which file at the path it read or wrote
        # last: a file there that is neither was written by another run.
        self.run: str | None = None
        self.seen: tuple[int, ...] | None = None
        # The optimizer's and schedulers' settings in the checkpoint at `path` (`live_options`).
        self.live: dict[str, Any] | None = None
        # Read, set just before the first step: torch's CPU and CUDA RNG states and those of
        # the generators the data draws from (``DataLoader(generator=...)``).
        self.rng: tuple[Any, list[Any], list[Any]] | None = None

    def on_fit_start(self, ctx: Context) -> None:
        schedulers = [cb for cb in ctx.callbacks if isinstance(cb, LRScheduler)]
        if attached_scheduler(ctx.optimizer) and not schedulers:
            raise ValueError(
                "fit: a torch LR scheduler is attached to `optimizer` (built on it) but not given "
                "as `scheduler`: with `checkpoint` its state would not be saved and a resumed run "
                "would restart its schedule; pass it as fit(scheduler=...), or (one that starts "
                "mid-run, as SWALR at swa_start) build it in a Callback that saves its "
                "state_dict"
            )
        stepped = [cb.scheduler for cb in schedulers]
        if any(all(p is not s for s in stepped) for p in plateaus_on(ctx.optimizer)):
            raise ValueError(
                "fit: a vmapens.optim.ReduceLROnPlateau is built on `optimizer` but not given "
                "as `scheduler`: with `checkpoint` its per-member record would not be saved and "
                "a resumed run would restart it; pass it as fit(scheduler=...)"
            )
        self.options = run_options(ctx)
        # Checked on the first run too: a name that is no option would refuse its resume.
        known = sorted({*self.options, "seed"})
        unknown = [k for k in self.override if k not in known]
        if unknown:
            raise ValueError(
                f"fit: `Checkpoint.override` names unknown options {unknown}; known: {known}"
            )
        if _keeps_workers(ctx.arguments.get("data")):
            warnings.warn(
                "fit: `data` is a DataLoader with persistent_workers=True: its worker processes "
                "keep their random state from epoch to epoch, which no checkpoint holds, and a "
                "resumed run starts new ones, drawing their seed from the RNG, so its random "
                "numbers (shuffling, dropout, augmentations) differ from an uninterrupted run's; "
                "pass persistent_workers=False for resumes that are exact",
                UserWarning,
                stacklevel=3,
            )
        saved, failed = None, None
        try:
            if os.path.exists(self.path):
                saved = self._checked(ctx)
        except Exception as err:  # noqa: BLE001 - raised below, on every rank
            failed = err
        # A sharded resume refused on some ranks only (per-member data whose rows differ from
        # the checkpoint's on those ranks) left the others waiting in fit's first collective.
        raise_together("fit", failed)
        if saved is None:
            return
        # What the run was built with goes on in the checkpoints it writes (the same objects
        # continuing have scheduled settings; `override`s are this run's).
        self.options = {k: v for k, v in saved["fit"]["options"].items() if k != "seed"}
        self.live = saved["fit"].get("live_options")
        parts: dict[str, Any] = {
            "ensemble": ctx.ensemble,
            "optimizer": ctx.optimizer,
            "history": ctx.history,
            "fit": _FitState(ctx, self),
        }
        keyed = _keyed(ctx)
        if "scheduler" in keyed and "scheduler" not in self.override:
            parts["scheduler"] = keyed["scheduler"]
        optimizer = ctx.optimizer
        fresh = None  # this run's hyperparameters, without a copy of every parameter
        if "optimizer" in self.override:
            fresh = [
                copy.deepcopy({k: v for k, v in g.items() if k != "params"})
                for g in optimizer.param_groups
            ]
        apply_parts(saved, parts, "fit", os.fspath(self.path))
        if fresh is not None:  # this run's hyperparameters replace the stored ones
            for group, new in zip(optimizer.param_groups, fresh, strict=True):
                group.update(new)
        ctx.seed = saved["fit"]["options"]["seed"]
        # The epoch the run goes on with, as a fresh run's 0: a callback stopping members before
        # it (`on_train_start`) records that epoch, not 0.
        ctx.epoch = ctx.history.epochs

    def _checked(self, ctx: Context) -> dict[str, Any]:
        """The checkpoint at ``path``, read and checked against this run: nothing applied."""
        options, unsaved = self.options, _UNSAVED.get(ctx.optimizer)
        if unsaved is not None and live_options(ctx, options) == unsaved[0]:
            # Its settings are those its interrupted run gave it after the checkpoint was
            # written, which the checkpoint's replace: compared as that checkpoint holds them.
            options = {**options, **unsaved[1]}
        saved = read_checkpoint(
            self.path, ctx.ensemble, options, ctx.seed, self.override, ctx.optimizer
        )
        left = _LEFT.get(ctx.ensemble)
        if (
            left is not None
            and left[0] == saved.get("run")
            and left[1] != fingerprint(ctx.ensemble.stacked_state())
        ):
            raise ValueError(
                f"fit: {os.fspath(self.path)} holds the run that last trained this ensemble, "
                "but the ensemble was changed since that run ended (a value written between "
                "the two calls: an average, a reset, load_state_dict); resuming would replace "
                "the change with the checkpoint's values. Give this run another `checkpoint` "
                "path (one per round), or delete the file"
            )
        done = saved.get("epoch")
        if isinstance(done, int) and done > ctx.epochs:
            # Going on would hand back members trained for more epochs than this call asks.
            raise ValueError(
                f"fit: {os.fspath(self.path)} holds a run already trained for {done} epochs, "
                f"more than `epochs`={ctx.epochs}; pass epochs >= {done} to continue it, read "
                "its members with vmapens.load, or give a shorter run another `checkpoint` path"
            )
        return saved

    def on_train_start(self, ctx: Context) -> None:
        # Restored last thing before the first step (fit runs checkpoints last): building the
        # data source, e.g. a DataLoader's first iterator, draws from the global RNG, and the
        # run must go on from the state the checkpoint held, as the uninterrupted run did.
        if self.rng is not None:
            torch.set_rng_state(self.rng[0])
            if self.rng[1]:
                torch.cuda.set_rng_state_all(self.rng[1])
            for g, state in zip(data_generators(ctx.arguments.get("data")), self.rng[2]):
                g.set_state(state)
            self.rng = None

    def on_epoch_end(self, ctx: Context) -> None:
        self.save(ctx)

    def teardown(self, ctx: Context) -> None:
        if self.run is not None:
            _LEFT[ctx.ensemble] = (self.run, fingerprint(ctx.ensemble.stacked_state()))
        now = live_options(ctx, self.options)
        if self.live is not None and now != self.live:  # raised past the last write
            _UNSAVED[ctx.optimizer] = (now, self.live)
        else:
            _UNSAVED.pop(ctx.optimizer, None)

    def save(self, ctx: Context) -> None:
        """Write the checkpoint: one file, or under torch.distributed one block per rank.

        Raises:
            FileExistsError: another run wrote the path since this one last read or wrote it.
        """
        refused = check_owner(self.path, self.seen, self.run, "fit") if rank() == 0 else None
        run, refused = broadcast_object((self.run or uuid.uuid4().hex, refused))
        if refused is not None:
            raise FileExistsError(refused)
        self.run = run
        keyed = _keyed(ctx)
        payload = {
            "run": run,
            "epoch": ctx.history.epochs,
            "members": members_of(ctx.ensemble),
            "settings": settings_of(ctx.ensemble),
            "ensemble": {k: v.detach().cpu() for k, v in ctx.ensemble.state_dict().items()},
            "optimizer": ctx.optimizer.state_dict(),
            "optimizer_class": type(ctx.optimizer).__name__,
            "history": ctx.history.state_dict(),
            "scheduler": keyed["scheduler"].state_dict() if "scheduler" in keyed else None,
            "fit": _FitState(ctx, self).state_dict(),
        }
        self.live = payload["fit"]["live_options"]
        if world_size() > 1:
            self.seen = save_sharded(self.path, payload, ctx.ensemble.member_ids)
        else:
            self.seen = write(self.path, payload, "fit")
            drop_blocks(self.path)  # of an earlier sharded run that this one resumed


def check_owner(path: str | os.PathLike, seen: Any, run: str | None, api: str) -> str | None:
    """Why this run must not write ``path``: another writer replaced the file since this run
    read or wrote it last (``seen``, a ``signature``; None: there was no file). None when free.
    """
    if signature(path) in (None, seen):
        return None
    try:
        held = read(path, api)
        theirs, epoch = held.get("run"), held.get("epoch")
    except (OSError, ValueError) as err:
        theirs, epoch = f"unknown ({err})", "?"
    ours = "a new run" if run is None else f"run {run}"
    return (
        f"{api}: {os.fspath(path)} was replaced by another writer (it now holds run {theirs} at "
        f"epoch {epoch}) since this run ({ours}) last read or wrote it: two runs are writing "
        "one checkpoint path. This run stops here and leaves that file alone; give it another "
        "`checkpoint` path (or delete the file to let this run take the path over)"
    )


def _keeps_workers(data: Any) -> bool:
    """Whether ``data`` (a DataLoader, or a per-member list of them) keeps worker processes,
    and their random state, across epochs."""
    if isinstance(data, (list, tuple)):
        return any(_keeps_workers(item) for item in data)
    workers = getattr(data, "num_workers", 0)
    return (
        bool(getattr(data, "persistent_workers", False))
        and isinstance(workers, int)
        and workers > 0
    )


def run_options(ctx: Context) -> dict[str, Any]:
    """This run's options for the resume check: every ``fit`` argument in ``ctx.arguments``
    except :data:`~vmapens._resume.NOT_COMPARED`, the built parts by their settings."""
    return {
        name: _settings(ctx, name) if name in _BUILT else fingerprint(value)
        for name, value in ctx.arguments.items()
        if name not in NOT_COMPARED
    }


def live_options(ctx: Context, options: dict[str, Any]) -> dict[str, Any]:
    """``run_options``'s optimizer and scheduler entries as they are now (a scheduler has
    changed the learning rates since the run began), for those in ``options``."""
    return {name: _settings(ctx, name) for name in _BUILT if name in options}


#: The ``fit`` arguments compared by the settings of what ``fit`` built from them.
_BUILT = ("optimizer", "scheduler")


def _settings(ctx: Context, name: str) -> Any:
    """The optimizer's hyperparameters, or each LR scheduler callback's settings (None if
    there is none), as they are now."""
    if name == "optimizer":
        return hyperparameters_of(ctx.optimizer)
    lr = [cb.settings() for cb in ctx.callbacks if isinstance(cb, LRScheduler)]
    return lr or None


def _keyed(ctx: Context) -> dict[str, Callback]:
    """The first callback of each ``state_key`` (the others' states go in the list)."""
    keyed: dict[str, Callback] = {}
    for cb in ctx.callbacks:
        if cb.state_key is not None and cb.state_key not in keyed:
            keyed[cb.state_key] = cb
    return keyed


def _listed(ctx: Context) -> list[Callback]:
    """The callbacks whose states go in the checkpoint's list: those that define
    ``state_dict`` (their state may still be empty at the start, as a log's is) or return one.
    """
    keyed = set(map(id, _keyed(ctx).values()))
    return [
        cb
        for cb in ctx.callbacks
        if id(cb) not in keyed
        and (type(cb).state_dict is not Callback.state_dict or cb.state_dict())
    ]


class _FitState:
    """The checkpoint's ``fit`` part: the loop's state, the run's options and identity, and
    the callbacks' states (merged for ``state_key="fit"``, else listed by class name)."""

    def __init__(self, ctx: Context, owner: Checkpoint) -> None:
        self.ctx, self.owner = ctx, owner

    def state_dict(self) -> dict[str, Any]:
        ctx, merged = self.ctx, _keyed(self.ctx).get("fit")
        return {
            **ctx.state_dict(),
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
            "data_rng": [g.get_state() for g in data_generators(ctx.arguments.get("data"))],
            **({} if merged is None else merged.state_dict()),
            "options": {**self.owner.options, "seed": ctx.seed},
            # The optimizer's and schedulers' settings as they are now (scheduled): the same
            # objects continuing in this process match these, not the options as built.
            "live_options": live_options(ctx, self.owner.options),
            "run": self.owner.run,
            "callbacks": [(type(cb).__name__, cb.state_dict()) for cb in _listed(ctx)],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # None in checkpoints written before the data's own generators were kept.
        data_rng = state.get("data_rng")
        if data_rng is not None:
            ours = len(data_generators(self.ctx.arguments.get("data")))
            if len(data_rng) != ours and "data" not in self.owner.override:
                raise ValueError(
                    f"the checkpoint's data drew its order from {len(data_rng)} generator(s) "
                    f"of its own (DataLoader(generator=...)), this run's from {ours}; pass "
                    "the same DataLoader to resume"
                )
            data_rng = data_rng if len(data_rng) == ours else None
        stateful = _listed(self.ctx)
        names = [type(cb).__name__ for cb in stateful]
        stored = [name for name, _ in state.get("callbacks", [])]
        if names != stored:
            raise ValueError(
                f"the checkpoint holds the state of callbacks {stored}, this run has stateful "
                f"callbacks {names}; pass the same callbacks to resume"
            )
        merged = _keyed(self.ctx).get("fit")
        loaded = ([] if merged is None else [merged]) + stateful
        # A callback's own load_state_dict may refuse its state (it raises anything): those
        # loaded before it get theirs back, so a refused resume leaves every callback as it was.
        before = [copy.deepcopy(cb.state_dict()) for cb in loaded]
        states = [state] * (merged is not None) + [s for _, s in state["callbacks"]]
        try:
            for cb, s in zip(loaded, states, strict=True):
                cb.load_state_dict(s)
            self.ctx.load_state_dict(state)
        except Exception:
            for cb, s in zip(loaded, before, strict=True):
                cb.load_state_dict(s)
            raise
        self.owner.run, self.owner.seen = state.get("run"), state.get("seen")
        self.owner.rng = (state["rng"], state["cuda_rng"], data_rng or [])
