"""The state of a ``fit`` run between steps and epochs, and its checkpoint."""

from __future__ import annotations

import math
import os
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import optree
import torch
from torch import Tensor
from torch.func import vmap

from ._checks import column, index_rows
from ._data import Stream
from ._files import signature
from ._metrics import Metric, metric_pair, score
from ._precision import LossScale
from .checkpoint import (
    check_ensemble_state,
    check_members,
    check_owner,
    members_of,
    read,
    write,
)
from .distributed import all_reduce_stats, broadcast_object, rank, world_size
from .ensemble import Ensemble
from .history import History
from .losses import per_member
from .optim import MemberValues
from .sharding import drop_blocks, localise, save_sharded

__all__ = [
    "Loop",
    "fingerprint",
    "hyperparameters_of",
    "read_checkpoint",
    "scheduler_options",
    "to_device",
]


class Loop:
    """Per-member training state between steps and epochs: who trains, best so far, history."""

    def __init__(
        self,
        ens: Ensemble,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable,
        val_data: tuple[Any, Tensor] | None,
        patience: int | None,
        keep_best: bool,
        val_in_dims: int | None = None,
    ):
        self.ens, self.optimizer, self.patience = ens, optimizer, patience
        self.stream: Stream  # set by fit once the data source is known
        self.options: dict[str, Any] = {}
        self.scheduler: Any = None
        self.hooks: Any = None  # fit's callbacks.Hooks: its stateful callbacks are checkpointed
        self.loss_scale: LossScale | None = None  # precision="fp16": per-member loss scales
        self.global_step = 0
        # This run's identity in its checkpoints, and which file at the checkpoint path it read
        # or wrote last: a file there that is neither was written by another run.
        self.run: str | None = None
        self.seen: tuple[int, ...] | None = None
        self.metrics: dict[str, Metric] = {}
        self.scores: tuple[dict[str, Tensor], dict[str, Tensor]] = ({}, {})
        self.monitor, self.sign = "val_loss", 1.0
        n, device = len(ens), next(ens.parameters()).device
        self.val: tuple[Any, Tensor] | None = (
            None if val_data is None else to_device(val_data, device)
        )
        self.val_in_dims = val_in_dims
        self.loss_fn = loss_fn
        self.val_loss = per_member(loss_fn, in_dims=(0, val_in_dims))
        self.oob: tuple[Any, Tensor, Tensor, int | None] | None = None
        self.history = History.empty(list(ens.member_ids), val_data is not None)
        # On the device, updated without a host sync per step.
        self.active = torch.ones(n, dtype=torch.bool, device=device)
        self.best_val = torch.full((n,), math.inf, dtype=torch.float64)
        self.bad = torch.zeros(n, dtype=torch.int64)
        self.best = {k: t.detach().clone() for k, t in self._state().items()} if keep_best else None

    def _state(self) -> dict[str, Tensor]:
        return self.ens.stacked_state()

    def track(self, metrics: Mapping[str, Any], monitor: str, mode: str) -> None:
        """Record ``metrics`` on the validation data; judge improvement by ``monitor``."""
        self.metrics = {k: metric_pair(fn) for k, fn in metrics.items()}
        self.monitor, self.sign = monitor, 1.0 if mode == "min" else -1.0
        ids = list(self.ens.member_ids)
        self.history = History.empty(ids, self.val is not None, list(self.metrics))

    def use_out_of_bag(self, data: tuple, mask: Tensor, in_dims: int | None) -> None:
        """Validate each member on the training rows its resample left out (``mask`` [n, S])."""
        x, y = data
        self.val = (x, y)
        self.oob = (x, y, mask.to(y.device), in_dims)
        self.history = History.empty(list(self.ens.member_ids), True)

    def step(self, step: Callable, inputs: Any, targets: Tensor, maskable: bool) -> Tensor:
        # The mask freezes stopped members whole: parameters, optimizer state and buffers.
        losses = step(inputs, targets, mask=self.active) if maskable else step(inputs, targets)
        self.active &= torch.isfinite(losses)
        self.global_step += 1
        return losses

    def totals(self, losses: Tensor | None = None) -> dict[str, float]:
        """Members still training and their loss statistics, over all ranks (a collective)."""
        active = self.active.cpu()
        live = torch.zeros(0) if losses is None else losses.detach().double().cpu()[active]
        sums = all_reduce_stats(
            {"training": active.sum(), "members": active.numel(), "sum": live.sum()}
        )
        low = all_reduce_stats({"min": live.min() if live.numel() else math.inf}, "min")
        high = all_reduce_stats({"max": live.max() if live.numel() else -math.inf}, "max")
        return {**sums, **low, **high}

    def describe(self, losses: Tensor) -> str:
        """The progress bar's text: loss mean/min/max over members still training, and count."""
        t = self.totals(losses)
        stats = ""
        if t["training"]:
            mean = t["sum"] / t["training"]
            stats = f"loss {mean:.4g} (min {t['min']:.4g}, max {t['max']:.4g}), "
        return f"{stats}training {int(t['training'])}/{int(t['members'])}"

    def end_epoch(self, epoch: int, mean_loss: Tensor) -> None:
        h = self.history
        running = h.stopped_epoch == -1  # trained during this epoch
        active = self.active.cpu()
        diverged = running & ~active
        stop = diverged.clone()
        h.diverged |= diverged
        nan = torch.tensor(math.nan, dtype=torch.float64)
        h.train_loss = torch.cat([h.train_loss, torch.where(running, mean_loss.cpu(), nan)[None]])
        if self.val is not None:
            val = torch.where(running, self._validate(), nan)
            assert h.val_loss is not None  # History.empty made it: there is validation data
            h.val_loss = torch.cat([h.val_loss, val[None]])
            watched = val
            if h.metrics is not None and h.ensemble_metrics is not None:
                per, whole = self.scores
                for k, value in per.items():
                    h.metrics[k] = torch.cat([h.metrics[k], torch.where(running, value, nan)[None]])
                    h.ensemble_metrics[k] = torch.cat([h.ensemble_metrics[k], whole[k][None]])
                if self.monitor != "val_loss":
                    watched = h.metrics[self.monitor.removeprefix("val_")][-1]
            watched = self.sign * watched  # lower is better from here on
            improved = active & (watched < self.best_val)
            self.best_val = torch.where(improved, watched, self.best_val)
            h.best_epoch = torch.where(improved, epoch, h.best_epoch)
            self.bad = torch.where(improved, 0, self.bad + 1)
            if self.patience is not None:
                stop |= active & (self.bad >= self.patience)
            if self.best is not None and bool(improved.any()):
                keep = improved.to(self.active.device)
                with torch.no_grad():
                    for name, t in self._state().items():
                        self.best[name] = torch.where(column(keep, t), t, self.best[name])
        h.stopped_epoch = torch.where(stop, epoch, h.stopped_epoch)
        self.active &= ~stop.to(self.active.device)

    def check_val(self, api: str) -> None:
        """One eval-mode forward and loss on the validation data (nothing changes); a
        ValueError when they fail. Out-of-bag validation runs on the training data: no check."""
        if self.val is None or self.oob is not None:
            return
        x, y = self.val
        training = self.ens.training
        self.ens.eval()
        try:
            with torch.no_grad():
                args = x if isinstance(x, tuple) else (x,)
                self.val_loss(self.ens(*args, in_dims=self.val_in_dims), y)
        except (RuntimeError, ValueError, TypeError, IndexError) as err:
            raise ValueError(
                f"{api}: `val_data` does not fit the ensemble (one forward and `loss_fn` in eval "
                f"mode failed): {err}"
            ) from err
        finally:
            self.ens.train(training)

    def _validate(self) -> Tensor:
        assert self.val is not None  # called only with validation data
        x, y = self.val
        dims = self.oob[3] if self.oob is not None else self.val_in_dims
        training = self.ens.training
        self.ens.eval()
        try:
            with torch.no_grad():
                out = self.ens(*(x if isinstance(x, tuple) else (x,)), in_dims=dims)
                self.scores = score(self.metrics, out, y, self.history.diverged)
                if self.oob is None:
                    return self.val_loss(out, y).double().cpu()
                return self._out_of_bag(out, y, self.oob[2], dims).double().cpu()
        finally:
            self.ens.train(training)

    def _out_of_bag(self, out: Any, y: Tensor, mask: Tensor, dims: int | None) -> Tensor:
        """Each member's mean loss over its out-of-bag rows (NaN when it has none).

        The loss of one row at a time, averaged over the member's rows: what ``loss_fn`` on
        the member's out-of-bag subset gives for a loss that averages over samples.
        """
        loss_fn = self.loss_fn

        def row(o: Any, t: Tensor) -> Tensor:
            return loss_fn(optree.tree_map(lambda v: v[None], o), t[None])

        rows = vmap(vmap(row), in_dims=(0, dims))(out, y).double()
        kept = mask.to(rows.dtype)
        return (rows * kept).sum(1) / kept.sum(1)

    # -- what callbacks may do (callbacks.Context) -------------------------------------------

    def stop(self, members: Any, epoch: int) -> None:
        """Stop ``members`` (rows) from now on; ``history.stopped_epoch`` records ``epoch``."""
        stop = torch.zeros(len(self.ens), dtype=torch.bool)
        stop[index_rows("Context.stop", members, len(self.ens))] = True
        stop &= self.active.cpu()
        self.history.stopped_epoch = torch.where(stop, epoch, self.history.stopped_epoch)
        self.active &= ~stop.to(self.active.device)

    def inherit(self, src: Any, dst: Any) -> None:
        """Rows ``dst`` take over the best score, patience count and best snapshot of ``src``."""
        n = len(self.ens)
        s, d = index_rows("Context.inherit", src, n), index_rows("Context.inherit", dst, n)
        if len(s) != len(d):
            raise ValueError(
                f"Context.inherit: `src` and `dst` must have the same length, got {len(s)} and "
                f"{len(d)}"
            )
        for t in (self.best_val, self.bad, self.history.best_epoch):
            t[d] = t[s]
        for t in (self.best or {}).values():
            t[d.to(t.device)] = t[s.to(t.device)]

    def finish(self) -> None:
        if self.best is None:
            return
        restore = (self.history.best_epoch >= 0).to(self.active.device)
        with torch.no_grad():
            for name, t in self._state().items():
                t.copy_(torch.where(column(restore, t), self.best[name], t))

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where training stands: data position, RNG, who trains, best so far, options."""
        return {
            "options": dict(self.options),
            "pass": self.stream.pass_,
            "pos": self.stream.pos,
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
            "active": self.active.cpu(),
            "best_val": self.best_val.clone(),
            "bad": self.bad.clone(),
            "best": None if self.best is None else {k: t.cpu() for k, t in self.best.items()},
            "global_step": self.global_step,
            "run": self.run,
            "callbacks": [] if self.hooks is None else self.hooks.state_dict(),
            "loss_scale": None if self.loss_scale is None else self.loss_scale.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()`` (checked first; nothing changes on error)."""
        n = len(self.ens)
        for key in ("active", "best_val", "bad"):
            if not isinstance(state.get(key), Tensor) or tuple(state[key].shape) != (n,):
                raise ValueError(f"loop state `{key}` is not [{n}]")
        best = state.get("best")
        if (best is None) != (self.best is None) or (
            best is not None
            and self.best is not None
            and {k: t.shape for k, t in best.items()} != {k: t.shape for k, t in self.best.items()}
        ):
            raise ValueError("best-epoch state does not match")
        if (state.get("loss_scale") is None) != (self.loss_scale is None):
            raise ValueError("loss-scale state does not match (precision='fp16' in one run only)")
        if self.hooks is not None:  # first: it checks the callbacks match, and may refuse
            self.hooks.load_state_dict(state.get("callbacks", []))
        if self.loss_scale is not None:
            self.loss_scale.load_state_dict(state["loss_scale"])
        self.global_step = state.get("global_step", 0)
        self.run, self.seen = state.get("run"), state.get("seen")
        self.stream.pass_, self.stream.pos = state["pass"], state["pos"]
        self.active.copy_(state["active"])
        self.best_val, self.bad = state["best_val"].clone(), state["bad"].clone()
        if self.best is not None and best is not None:
            self.best = {k: t.to(self.best[k].device) for k, t in best.items()}
        torch.set_rng_state(state["rng"])
        if state["cuda_rng"]:
            torch.cuda.set_rng_state_all(state["cuda_rng"])

    def save(self, path: str | os.PathLike) -> None:
        """Write the checkpoint: one file, or under torch.distributed one block per rank.

        Raises:
            FileExistsError: another run wrote ``path`` since this one last read or wrote it.
        """
        refused = check_owner(path, self.seen, self.run, "fit") if rank() == 0 else None
        run, refused = broadcast_object((self.run or uuid.uuid4().hex, refused))
        if refused is not None:
            raise FileExistsError(refused)
        self.run = run
        payload = {
            "run": run,
            "epoch": self.history.epochs,
            "members": members_of(self.ens),
            "ensemble": {k: v.detach().cpu() for k, v in self.ens.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "optimizer_class": type(self.optimizer).__name__,
            "history": self.history.state_dict(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "fit": self.state_dict(),
        }
        if world_size() > 1:
            self.seen = save_sharded(path, payload, self.ens.member_ids)
        else:
            self.seen = write(path, payload, "fit")
            drop_blocks(path)  # of an earlier sharded run that this one resumed


def read_checkpoint(
    path: str | os.PathLike,
    ens: Ensemble,
    options: dict,
    seed: int | None,
    override: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Read a fit checkpoint and check it against this run; changes nothing."""
    where = os.fspath(path)
    seen = signature(path)  # before reading: a later replacement shows as another file
    payload = read(path, "fit")
    held = payload.get("members")
    if isinstance(held, dict) and (held.get("class"), held.get("n_total")) == (
        members_of(ens)["class"],
        ens.n_total,
    ):  # the same run at any world size: this process's members
        payload = localise(payload, path, list(ens.member_ids))
    check_members(payload, ens, "fit", where)
    check_ensemble_state(payload.get("ensemble"), ens, "fit", where)
    state = payload.get("fit")
    if state is None:
        raise ValueError(
            f"fit: {where} was written by save(), not by fit(checkpoint=...): it holds no "
            "training-loop state to resume from; use another path"
        )
    state["seen"] = seen
    stored = state["options"]
    ours = {**options, "seed": stored["seed"] if seed is None else seed}
    unknown = [k for k in override if k not in ours]
    if unknown:
        raise ValueError(f"fit: `override` names unknown options {unknown}; known: {sorted(ours)}")
    differ = [k for k in ours if stored.get(k) != ours[k] and k not in override]
    if differ:
        got = ", ".join(_difference(k, ours[k], stored.get(k)) for k in differ)
        raise ValueError(
            f"fit: cannot resume from {where}: it was written by a run with other options: "
            f"{got}; resume with the same arguments, or pass override={tuple(differ)!r} to use "
            "this run's"
        )
    payload["fit"]["options"] = {**stored, **{k: ours[k] for k in override}}
    return payload


def _difference(name: str, ours: Any, stored: Any) -> str:
    """``name=ours (checkpoint: stored)``, naming only the entries that differ in a dict."""
    if isinstance(ours, dict) and isinstance(stored, dict):
        keys = [k for k in {**stored, **ours} if ours.get(k) != stored.get(k)]
        return ", ".join(f"{name}.{k}={ours.get(k)} (checkpoint: {stored.get(k)})" for k in keys)
    return f"{name}={ours!r} (checkpoint: {stored!r})"


def fingerprint(value: Any) -> str:
    """A short text that changes when ``value`` (tensors included) changes, for resume checks."""

    def describe(v: Any) -> Any:
        if isinstance(v, Tensor):
            d = v.detach().double().cpu()
            return f"tensor{tuple(v.shape)} {v.dtype} sum={float(d.sum()):.17g} sq={float((d * d).sum()):.17g}"
        if isinstance(v, (list, tuple)):
            return [describe(x) for x in v]
        if isinstance(v, (int, float, str, bool)) or v is None:
            return v
        return repr(v)

    return repr(describe(value))


def hyperparameters_of(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's hyperparameters as built (not its state), by name, for resume checks.

    Per-member values stay ``MemberValues`` (a sharded checkpoint re-cuts them per rank);
    the rest is compared as text.
    """
    out: dict[str, Any] = {"class": type(optimizer).__name__}
    for k, group in enumerate(optimizer.param_groups):
        for name, v in group.items():
            if name not in ("params", "initial_lr"):  # initial_lr: set by a scheduler
                out[f"group{k}.{name}"] = v if _per_member(v) else repr(v)
    return out


def _per_member(v: Any) -> bool:
    return isinstance(v, MemberValues) or (
        isinstance(v, tuple) and any(isinstance(x, MemberValues) for x in v)
    )


def scheduler_options(scheduler: Any) -> dict[str, str] | None:
    """A scheduler's own settings (not what it derived from the optimizer), for resume checks."""
    if scheduler is None:
        return None
    state = scheduler.state_dict()
    own = {k: repr(v) for k, v in state.items() if not k.startswith("_")}
    for derived in ("base_lrs", "last_epoch", "optimizer"):
        own.pop(derived, None)
    return {"class": type(scheduler).__name__, **own}


def to_device(tree: Any, device: torch.device) -> Any:
    """``tree`` with every tensor moved to ``device``."""
    return optree.tree_map(lambda t: t.to(device), tree)
