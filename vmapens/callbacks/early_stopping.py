"""Early stopping per member, and each member's best epoch given back at the end."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .._checks import check_choice, check_int, column
from ..optim import StackedOptimizer
from .base import Callback, Context

__all__ = ["EarlyStopping"]


class EarlyStopping(Callback):
    """Track each member's best epoch by ``monitor``; stop a member that stops improving.

    After each epoch a member still training *improves* when its ``monitor`` value is better
    (lower with ``mode="min"``) than its best so far; ``history.best_epoch`` records the epoch.
    With ``patience``, a member that has not improved for ``patience`` epochs stops (frozen
    through the optimizer's mask, ``history.stopped_epoch`` records the epoch); the others
    carry on. With ``restore_best``, each member gets its best-epoch parameters and buffers
    back when ``fit`` ends. ``fit(val_data=...)`` adds ``EarlyStopping(patience=patience)``
    unless ``callbacks`` holds one.

    Args:
        monitor: ``"val_loss"`` or ``"val_<name>"`` for a ``fit(metrics=)`` entry.
        mode: ``"min"`` or ``"max"``: whether lower or higher ``monitor`` is better.
        patience: epochs without improvement before a member stops (``None``: never).
        restore_best: give each member its best-epoch state back at the end.

    Raises:
        ValueError: bad values; at fit start, no ``val_data`` or an unknown ``monitor``.
        TypeError: ``restore_best`` not a bool; ``patience`` with an optimizer that is not a
            ``vmapens.StackedOptimizer``.

    Example:
        >>> import torch
        >>> from vmapens import Ensemble, fit
        >>> from vmapens.callbacks import EarlyStopping
        >>> ens = Ensemble(lambda: torch.nn.Linear(3, 1), n=4, seed=0)
        >>> x, y = torch.randn(64, 3), torch.randn(64, 1)
        >>> stop = EarlyStopping(patience=2, restore_best=False)
        >>> h = fit(ens, (x, y), torch.nn.MSELoss(), epochs=5, val_data=(x, y), seed=0,
        ...         progress=False, callbacks=[stop])
        >>> h.best_epoch.shape
        torch.Size([4])
    """

    state_key = "fit"  # best_val, bad and best are per-member rows of the loop state

    def __init__(
        self,
        monitor: str = "val_loss",
        mode: str = "min",
        patience: int | None = None,
        restore_best: bool = True,
    ) -> None:
        api = "EarlyStopping"
        check_choice(api, "mode", mode, ("min", "max"))
        if not isinstance(monitor, str):
            raise TypeError(f"{api}: `monitor` must be a str, got {type(monitor).__name__}")
        if patience is not None:
            check_int(api, "patience", patience, minimum=1)
        # bool() would read "no" or a stray None as a choice: only a bool (numpy's too) is one.
        if not isinstance(restore_best, bool) and type(restore_best).__name__ != "bool_":
            raise TypeError(
                f"{api}: `restore_best` must be a bool, got {type(restore_best).__name__}"
            )
        self.monitor, self.mode, self.patience = monitor, mode, patience
        self.restore_best = bool(restore_best)
        self.sign = 1.0 if mode == "min" else -1.0
        self.best_val = torch.zeros(0, dtype=torch.float64)
        self.bad = torch.zeros(0, dtype=torch.int64)
        self.best: dict[str, Tensor] | None = None

    def on_fit_start(self, ctx: Context) -> None:
        h = ctx.history
        if h.val_loss is None:
            raise ValueError(
                f"fit: `EarlyStopping` (monitor {self.monitor!r}) needs `val_data` to measure "
                "improvement" + (" (`patience` builds one)" if self.patience is not None else "")
            )
        allowed = ["val_loss", *(f"val_{k}" for k in h.metrics or {})]
        if self.monitor not in allowed:
            raise ValueError(
                f"fit: `EarlyStopping.monitor` must be one of {allowed}, got {self.monitor!r}"
            )
        if self.patience is not None and not isinstance(ctx.optimizer, StackedOptimizer):
            raise TypeError(
                f"fit: `patience` freezes members through a vmapens.StackedOptimizer's mask, got "
                f"{type(ctx.optimizer).__name__}"
            )
        n = len(ctx.ensemble)
        self.best_val = torch.full((n,), math.inf, dtype=torch.float64)
        self.bad = torch.zeros(n, dtype=torch.int64)
        state = ctx.ensemble.stacked_state()
        self.best = {k: t.detach().clone() for k, t in state.items()} if self.restore_best else None

    def on_epoch_end(self, ctx: Context) -> None:
        h = ctx.history
        assert h.val_loss is not None  # on_fit_start checked there is validation data
        watched = h.val_loss[-1]
        if self.monitor != "val_loss":
            assert h.metrics is not None  # on_fit_start checked the monitor is a metric
            watched = h.metrics[self.monitor.removeprefix("val_")][-1]
        watched = self.sign * watched  # lower is better from here on
        active = ctx._active.cpu()
        improved = active & (watched < self.best_val)
        self.best_val = torch.where(improved, watched, self.best_val)
        h.best_epoch = torch.where(improved, ctx.epoch, h.best_epoch)
        self.bad = torch.where(improved, 0, self.bad + 1)
        if self.patience is not None:
            ctx._stop(active & (self.bad >= self.patience))
        if self.best is not None and bool(improved.any()):
            keep = improved.to(ctx._active.device)
            with torch.no_grad():
                for name, t in ctx.ensemble.stacked_state().items():
                    self.best[name] = torch.where(column(keep, t), t, self.best[name])

    def on_fit_end(self, ctx: Context) -> None:
        if self.best is None:
            return
        restore = (ctx.history.best_epoch >= 0).to(ctx._active.device)
        with torch.no_grad():
            for name, t in ctx.ensemble.stacked_state().items():
                t.copy_(torch.where(column(restore, t), self.best[name], t))

    def on_inherit(self, ctx: Context, src: Tensor, dst: Tensor) -> None:
        for t in (self.best_val, self.bad, ctx.history.best_epoch):
            t[dst] = t[src]
        for t in (self.best or {}).values():
            t[dst.to(t.device)] = t[src.to(t.device)]

    def settings(self) -> dict[str, Any]:
        """What a resumed run must share with the run that wrote the checkpoint."""
        return {"monitor": self.monitor, "mode": self.mode, "patience": self.patience,
                "restore_best": self.restore_best}  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        return {
            "early_stopping": self.settings(),
            "best_val": self.best_val.clone(),
            "bad": self.bad.clone(),
            "best": None if self.best is None else {k: t.cpu() for k, t in self.best.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()`` (checked first; nothing changes on error)."""
        n = len(self.best_val)
        for key in ("best_val", "bad"):
            if not isinstance(state.get(key), Tensor) or tuple(state[key].shape) != (n,):
                raise ValueError(f"early-stopping state `{key}` is not [{n}]")
        stored = state.get("early_stopping")
        if stored != self.settings():
            raise ValueError(
                f"the checkpoint's EarlyStopping has settings {stored}, this run's "
                f"{self.settings()}; resume with the same ones"
            )
        best = state.get("best")
        if (best is None) != (self.best is None) or (
            best is not None
            and self.best is not None
            and {k: t.shape for k, t in best.items()} != {k: t.shape for k, t in self.best.items()}
        ):
            raise ValueError("best-epoch state does not match")
        self.best_val, self.bad = state["best_val"].clone(), state["bad"].clone()
        if self.best is not None and best is not None:
            self.best = {k: t.to(self.best[k].device) for k, t in best.items()}
