"""The state of a ``fit`` run between steps and epochs, and its checkpoint."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import optree
import torch
from torch import Tensor

from ._checks import column
from ._data import Stream
from .checkpoint import check_ensemble_state, check_members, members_of, read, write
from .distributed import all_reduce_stats
from .ensemble import Ensemble
from .history import History
from .losses import per_member

__all__ = ["Loop", "read_checkpoint", "to_device"]


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
    ):
        self.ens, self.optimizer, self.patience = ens, optimizer, patience
        self.stream: Stream  # set by fit once the data source is known
        self.options: dict[str, Any] = {}
        n, device = len(ens), next(ens.parameters()).device
        self.val: tuple[Any, Tensor] | None = (
            None if val_data is None else to_device(val_data, device)
        )
        self.val_loss = per_member(loss_fn)
        self.history = History.empty(list(ens.member_ids), val_data is not None)
        # On the device, updated without a host sync per step.
        self.active = torch.ones(n, dtype=torch.bool, device=device)
        self.best_val = torch.full((n,), math.inf, dtype=torch.float64)
        self.bad = torch.zeros(n, dtype=torch.int64)
        self.best = {k: t.detach().clone() for k, t in self._state().items()} if keep_best else None

    def _state(self) -> dict[str, Tensor]:
        return self.ens.stacked_state()

    def step(self, step: Callable, inputs: Any, targets: Tensor, maskable: bool) -> Tensor:
        # The mask freezes stopped members whole: parameters, optimizer state and buffers.
        losses = step(inputs, targets, mask=self.active) if maskable else step(inputs, targets)
        self.active &= torch.isfinite(losses)
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
            improved = active & (val < self.best_val)
            self.best_val = torch.where(improved, val, self.best_val)
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

    def _validate(self) -> Tensor:
        assert self.val is not None  # called only with validation data
        x, y = self.val
        training = self.ens.training
        self.ens.eval()
        try:
            with torch.no_grad():
                out = self.ens(*(x if isinstance(x, tuple) else (x,)))
                return self.val_loss(out, y).double().cpu()
        finally:
            self.ens.train(training)

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
        self.stream.pass_, self.stream.pos = state["pass"], state["pos"]
        self.active.copy_(state["active"])
        self.best_val, self.bad = state["best_val"].clone(), state["bad"].clone()
        if self.best is not None and best is not None:
            self.best = {k: t.to(self.best[k].device) for k, t in best.items()}
        torch.set_rng_state(state["rng"])
        if state["cuda_rng"]:
            torch.cuda.set_rng_state_all(state["cuda_rng"])

    def save(self, path: str | os.PathLike) -> None:
        write(
            path,
            {
                "members": members_of(self.ens),
                "ensemble": {k: v.detach().cpu() for k, v in self.ens.state_dict().items()},
                "optimizer": self.optimizer.state_dict(),
                "optimizer_class": type(self.optimizer).__name__,
                "history": self.history.state_dict(),
                "fit": self.state_dict(),
            },
            "fit",
        )


def read_checkpoint(
    path: str | os.PathLike, ens: Ensemble, options: dict, seed: int | None
) -> dict[str, Any]:
    """Read a fit checkpoint and check it against this run; changes nothing."""
    where = os.fspath(path)
    payload = read(path, "fit")
    check_members(payload, ens, "fit", where)
    check_ensemble_state(payload.get("ensemble"), ens, "fit", where)
    state = payload.get("fit")
    if state is None:
        raise ValueError(
            f"fit: {where} was written by save(), not by fit(checkpoint=...): it holds no "
            "training-loop state to resume from; use another path"
        )
    stored = state["options"]
    ours = {**options, "seed": stored["seed"] if seed is None else seed}
    differ = [k for k in ours if stored.get(k) != ours[k]]
    if differ:
        got = ", ".join(f"{k}={ours[k]!r} (checkpoint: {stored.get(k)!r})" for k in differ)
        raise ValueError(
            f"fit: cannot resume from {where}: it was written by a run with other options: {got}"
        )
    return payload


def to_device(tree: Any, device: torch.device) -> Any:
    """``tree`` with every tensor moved to ``device``."""
    return optree.tree_map(lambda t: t.to(device), tree)
