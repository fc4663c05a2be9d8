"""The progress bar of ``fit``: tqdm on a terminal or a given stream, rank 0 only."""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
from tqdm import tqdm
from tqdm.auto import tqdm as auto_tqdm

from ..distributed import world_size
from .base import Callback, Context

__all__ = ["ProgressBar"]


class ProgressBar(Callback):
    """A tqdm bar of the run's steps, with the members' loss mean/min/max and how many train.

    ``fit(progress=...)`` builds it. Under ``torch.distributed`` only rank 0 draws it, and its
    text gives totals over every rank (collectives at epoch ends, which every rank runs).

    Args:
        progress: ``True``: a tqdm bar on stderr when it is a terminal; ``False``: quiet; a text
            stream (``io.StringIO``, an open log file): the bar is drawn there always.

    Raises:
        TypeError: ``progress`` is none of these.
    """

    def __init__(self, progress: Any = True) -> None:
        # 0/1 and numpy's bools pass as False/True (`progress=verbose`), and are read as such:
        # `_open` tells them apart by identity, and took 0 for a stream to write to.
        flag = isinstance(progress, int) or type(progress).__name__ in ("bool", "bool_")
        if not (flag and progress in (0, 1)) and not callable(getattr(progress, "write", None)):
            raise TypeError(
                f"fit: `progress` must be True, False or a text stream, got "
                f"{type(progress).__name__}"
            )
        self.progress = bool(progress) if flag else progress
        self.bar: Any = _NoBar()
        self.last_shown = 0.0

    def on_train_start(self, ctx: Context) -> None:
        self.bar = _open(self.progress, ctx)
        done = ctx.history.epochs
        if done:  # resumed: the text of the epoch the checkpoint ended, even if none is left
            self.bar.set_description(f"epoch {done}/{ctx.epochs}")
            self.bar.set_postfix_str(describe(ctx, ctx.history.train_loss[-1]))

    def on_epoch_start(self, ctx: Context) -> None:
        self.bar.set_description(f"epoch {ctx.epoch + 1}/{ctx.epochs}")
        self.last_shown = 0.0

    def on_step_end(self, ctx: Context) -> None:
        self.bar.update(1)
        # Per-step text would only show this rank's members: under torch.distributed the
        # totals are collectives, run at epoch ends only.
        if not self.bar.disable and world_size() == 1 and time.monotonic() - self.last_shown > 0.5:
            self.bar.set_postfix_str(describe(ctx, ctx.losses), refresh=False)
            self.last_shown = time.monotonic()

    def on_epoch_end(self, ctx: Context) -> None:
        self.bar.set_postfix_str(describe(ctx, ctx.history.train_loss[-1]))

    def teardown(self, ctx: Context) -> None:
        self.bar.close()


def describe(ctx: Context, losses: torch.Tensor) -> str:
    """The bar's text: loss mean/min/max over members still training, and their count."""
    t = ctx.totals(losses)
    stats = ""
    if t["training"]:
        mean = t["sum"] / t["training"]
        stats = f"loss {mean:.4g} (min {t['min']:.4g}, max {t['max']:.4g}), "
    return f"{stats}training {int(t['training'])}/{int(t['members'])}"


class _NoBar:
    disable = True

    def set_description(self, *_: Any) -> None: ...

    def set_postfix_str(self, *_: Any, **__: Any) -> None: ...

    def update(self, *_: Any) -> None: ...

    def close(self) -> None: ...


def _open(progress: Any, ctx: Context) -> Any:
    per_epoch = ctx.steps_per_epoch
    total = ctx.epochs * per_epoch if per_epoch else None
    done = ctx.history.epochs * (per_epoch or 0)
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if progress is False or (distributed and torch.distributed.get_rank() != 0):
        return _NoBar()
    if progress is True:
        # disable=None: tqdm stays quiet when stderr is not a terminal (logs, CI).
        return auto_tqdm(total=total, initial=done, file=sys.stderr, disable=None, unit="step")
    return tqdm(total=total, initial=done, file=progress, unit="step", ncols=120, mininterval=0)
