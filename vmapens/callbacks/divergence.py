"""Divergence: a member whose training loss is not finite stops; the others carry on."""

from __future__ import annotations

import torch

from .base import Callback, Context

__all__ = ["Divergence"]


class Divergence(Callback):
    """Freeze a member from the step its loss is not finite (NaN or inf) on.

    After the step whose loss is not finite the member is frozen through the optimizer's mask
    (its parameters, optimizer state and buffers stay as they were after that step); at the
    epoch's end ``history.diverged`` marks it and ``history.stopped_epoch`` records the epoch.
    ``fit`` always runs it first, so every other callback sees the member as stopped.

    Example:
        >>> import torch
        >>> from vmapens import Ensemble, StackedSGD, fit
        >>> ens = Ensemble(lambda: torch.nn.Linear(1, 1), n=2, seed=0)
        >>> x, y = torch.ones(4, 1), torch.ones(4, 1)
        >>> h = fit(ens, (x, y), torch.nn.MSELoss(), epochs=3, lr=[1e-3, 1e30],
        ...         optimizer=StackedSGD, progress=False, seed=0)
        >>> h.diverged.tolist(), h.stopped_epoch.tolist()
        ([False, True], [-1, 1])
    """

    def on_step_end(self, ctx: Context) -> None:
        ctx._active &= torch.isfinite(ctx.losses)

    def on_epoch_end(self, ctx: Context) -> None:
        diverged = ctx.running & ~ctx._active.cpu()
        ctx.history.diverged |= diverged
        ctx._stop(diverged)
