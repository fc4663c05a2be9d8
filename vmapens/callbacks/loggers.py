"""Loggers for ``fit``: per-member scalars after every epoch, to a CSV file or TensorBoard."""

from __future__ import annotations

import csv
import math
import os
import re
import socket
import time
import warnings
from typing import Any

from torch import Tensor

from .._checks import check_writable_dir
from ..distributed import raise_together, world_size
from ..optim._hyper import per_member
from .base import Callback, Context

__all__ = ["CSVLogger", "TensorBoardLogger", "epoch_scalars", "member_lrs"]


def epoch_scalars(
    ctx: Context, lr: list[float] | None = None
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """This epoch's per-member scalars (name -> one float per member) and ensemble scalars.

    Per member: ``train_loss``, ``val_loss`` and every metric (NaN after the epoch a member
    stopped in, and the validation scores of the epoch it diverged in), and ``lr``: ``lr`` if
    given (the loggers give :func:`member_lrs` read at the epoch's start), else
    :func:`member_lrs` now. Of the ensemble: ``ensemble_<metric>``.
    """
    h = ctx.history
    per: dict[str, list[float]] = {"train_loss": h.train_loss[-1].tolist()}
    if h.val_loss is not None:
        per["val_loss"] = h.val_loss[-1].tolist()
    for name, t in (h.metrics or {}).items():
        per[name] = t[-1].tolist()
    lr = member_lrs(ctx) if lr is None else lr
    if lr is not None:
        per["lr"] = lr
    whole = {f"ensemble_{k}": float(t[-1]) for k, t in (h.ensemble_metrics or {}).items()}
    return per, whole


def member_lrs(ctx: Context) -> list[float] | None:
    """Each member's learning rate in the first param group now (``None`` without one).

    A float, or a 0-d tensor (``lr=torch.tensor(1e-3)``, which torch's schedulers ``fill_``),
    is every member's. The loggers read it when an epoch starts: the rate the epoch trained
    with (its first step's), as a per-epoch scheduler (and PBT) change it at the epoch's end.
    """
    lr = ctx.optimizer.param_groups[0].get("lr")
    n = len(ctx.history.member_ids)
    values = per_member(lr, n)
    if values is None and isinstance(lr, Tensor) and lr.numel() == 1:  # one rate for all
        return [float(lr)] * n
    return values


class CSVLogger(Callback):
    """Append one row per member and epoch to a CSV file.

    Columns: ``epoch``, ``member`` (global index), then the scalars of :func:`epoch_scalars`
    (``train_loss``, ``val_loss``, metrics, ``lr``, ``ensemble_<metric>``, the last the same
    on every row of an epoch). Stopped members' losses are empty cells. A run that starts at
    epoch 0 writes a new file; a resumed run appends to it, after dropping any rows of the
    epochs it redoes (logged by the interrupted run after its last checkpoint). Under
    ``torch.distributed`` each rank logs its own members: give each rank its own ``path``
    (one path for several ranks is refused when training starts).

    Args:
        path: the CSV file.

    Raises:
        TypeError: ``path`` is not a str or os.PathLike.
        FileNotFoundError, NotADirectoryError, PermissionError: its directory does not exist,
            is no directory or is not writable.
        IsADirectoryError: ``path`` is a directory.

    Example:
        >>> import torch
        >>> import csv, tempfile, os
        >>> from vmapens import Ensemble, fit
        >>> path = os.path.join(tempfile.mkdtemp(), "log.csv")
        >>> ens = Ensemble(lambda: torch.nn.Linear(2, 1), n=3, seed=0)
        >>> _ = fit(ens, (torch.randn(8, 2), torch.randn(8, 1)), torch.nn.MSELoss(), epochs=2,
        ...         progress=False, callbacks=[CSVLogger(path)])
        >>> from pathlib import Path
        >>> rows = list(csv.DictReader(Path(path).read_text().splitlines()))
        >>> len(rows), sorted(rows[0])
        (6, ['epoch', 'lr', 'member', 'train_loss'])
    """

    def __init__(self, path: str | os.PathLike) -> None:
        # Checked here, as Checkpoint checks its path: the first row is written after a whole
        # epoch of training, too late to refuse a path that cannot take it.
        check_writable_dir("CSVLogger", "path", path)
        if os.path.isdir(path):
            raise IsADirectoryError(f"CSVLogger: `path` {os.fspath(path)!r} is a directory")
        self.path = os.fspath(path)
        self.lr: list[float] | None = None

    def on_train_start(self, ctx: Context) -> None:
        _one_per_rank("CSVLogger", "path", self.path)
        # A resumed run redoes the epochs after its checkpoint. The interrupted run may have
        # logged some of them already (a callback raised after this one, before the
        # checkpoint was written): drop those rows so that no epoch is logged twice.
        first = ctx.history.epochs
        if first == 0 or not os.path.exists(self.path):
            return
        with open(self.path, newline="") as f:
            rows = list(csv.reader(f))
        kept = rows[:1] + [row for row in rows[1:] if row and int(row[0]) < first]
        if len(kept) < len(rows):
            partial = self.path + ".partial"
            with open(partial, "w", newline="") as f:
                csv.writer(f).writerows(kept)
            os.replace(partial, self.path)

    def on_epoch_start(self, ctx: Context) -> None:
        self.lr = member_lrs(ctx)

    def on_epoch_end(self, ctx: Context) -> None:
        per, whole = epoch_scalars(ctx, self.lr)
        fields = ["epoch", "member", *per, *whole]
        fresh = ctx.epoch == 0 or not os.path.exists(self.path)
        with open(self.path, "w" if fresh else "a", newline="") as f:
            writer = csv.writer(f)
            if fresh:
                writer.writerow(fields)
            for col, member in enumerate(ctx.history.member_ids):
                values = [v[col] for v in per.values()] + list(whole.values())
                writer.writerow([ctx.epoch, member, *(_cell(v) for v in values)])


def _one_per_rank(api: str, name: str, where: str) -> None:
    """Refuse one file (or log directory) for several ranks of a process group: each rank logs
    its own members, so they would write it at once (CSV rows interleaved and truncated, or
    TensorBoard purges hiding the other ranks' steps). A collective: every rank's logger calls
    it when training starts, and every rank gets the same answer."""
    if world_size() == 1:
        return
    mine = f"{socket.gethostname()}:{os.path.realpath(where)}"
    shared = [r for r, other in enumerate(raise_together(api, None, mine)) if other == mine]
    if len(shared) > 1:
        raise ValueError(
            f"{api}: ranks {shared} log to one `{name}` ({where!r}), and each rank logs its own "
            f"members: give each rank its own, e.g. with its rank in the name "
            f'(f"...rank{{torch.distributed.get_rank()}}...")'
        )


def _cell(v: float) -> str:
    return "" if math.isnan(v) else repr(v)


class TensorBoardLogger(Callback):
    """Write per-member scalars to TensorBoard after every epoch.

    Tags ``<scalar>/member_<i>`` for each scalar of :func:`epoch_scalars` and member ``i``
    (global index), ``<scalar>/mean`` over the members that trained in the epoch, and
    ``ensemble/<metric>`` for the averaged ensemble; the global step is the epoch. Members
    that did not train in an epoch (stopped before it) are not written for it, ``lr``
    included. The event file is opened when training starts, with TensorBoard's
    ``purge_step`` at the first epoch the run trains: steps logged earlier in ``log_dir`` from
    that epoch on (by an interrupted run after its last checkpoint, which the resumed run
    redoes; by a run that started at epoch 0 there before) are hidden, so no epoch is shown
    twice, as :class:`CSVLogger` drops those rows. TensorBoard reads a directory's event files
    in the order of their names, which start with the second they were opened in: when an
    event file in ``log_dir`` was opened in the current second, the logger waits for the
    next one (at most a second), so its file is read after the earlier ones (in the same
    second the names sort by host, process id and a counter, and a reader could take this
    run's file first and show the steps the purge hides in place of this run's). The file
    is closed when ``fit`` ends (normally or not). Under ``torch.distributed`` each rank logs
    its own members: give each rank its own ``log_dir`` (one event file's purge hides the
    steps of every file read before it; one ``log_dir`` for several ranks is refused when
    training starts).

    Args:
        log_dir: TensorBoard's run directory.

    Raises:
        ImportError: tensorboard is not installed (``pip install 'vmapens[tensorboard]'``).
        TypeError: ``log_dir`` is not a str or os.PathLike.
        NotADirectoryError: ``log_dir`` is a file.
    """

    def __init__(self, log_dir: str | os.PathLike) -> None:
        if not isinstance(log_dir, (str, os.PathLike)):
            raise TypeError(
                "TensorBoardLogger: `log_dir` must be a str or os.PathLike, got "
                f"{type(log_dir).__name__}"
            )
        if os.path.exists(log_dir) and not os.path.isdir(log_dir):
            # Refused now, not when training starts (after a checkpoint's resume loaded).
            raise NotADirectoryError(
                f"TensorBoardLogger: `log_dir` {os.fspath(log_dir)!r} is a file, not a directory"
            )
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError(
                "TensorBoardLogger needs tensorboard; install it with: "
                "pip install 'vmapens[tensorboard]'"
            ) from err
        self.log_dir, self.summary_writer = os.fspath(log_dir), SummaryWriter
        self.writer: Any = None  # a SummaryWriter, opened by on_train_start
        self.lr: list[float] | None = None

    def on_train_start(self, ctx: Context) -> None:
        _one_per_rank("TensorBoardLogger", "log_dir", self.log_dir)
        # A resumed run redoes the epochs after its checkpoint, which the interrupted run may
        # have logged already: TensorBoard drops the steps from `purge_step` on that came
        # before this file's start event.
        self.close()
        _after_earlier_event_files(self.log_dir)
        self.writer = self.summary_writer(self.log_dir, purge_step=ctx.history.epochs)

    def on_epoch_start(self, ctx: Context) -> None:
        self.lr = member_lrs(ctx)

    def on_epoch_end(self, ctx: Context) -> None:
        per, whole = epoch_scalars(ctx, self.lr)
        # Members stopped before this epoch have NaN losses, but a learning rate all the same.
        trained = ctx.running.tolist()
        for name, values in per.items():
            live = [v for v, t in zip(values, trained, strict=True) if t and not math.isnan(v)]
            for member, v, t in zip(ctx.history.member_ids, values, trained, strict=True):
                if t and not math.isnan(v):
                    self.writer.add_scalar(f"{name}/member_{member}", v, ctx.epoch)
            if live:
                self.writer.add_scalar(f"{name}/mean", sum(live) / len(live), ctx.epoch)
        for name, v in whole.items():
            self.writer.add_scalar(f"ensemble/{name.removeprefix('ensemble_')}", v, ctx.epoch)
        self.writer.flush()

    def teardown(self, ctx: Context) -> None:
        self.close()

    def close(self) -> None:
        """Flush and close the event file (``fit`` does, when it ends)."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None


_EVENT_FILE = re.compile(r"events\.out\.tfevents\.(\d+)\.")


def _after_earlier_event_files(log_dir: str) -> None:
    """Wait until the clock's second is past every event file's in ``log_dir``, so that a
    file opened now sorts after them (its name starts with that second)."""
    names = os.listdir(log_dir) if os.path.isdir(log_dir) else []
    seconds = [int(m.group(1)) for m in map(_EVENT_FILE.match, names) if m]
    if not seconds:
        return
    wait = max(seconds) + 1 - time.time()
    if wait > 1:  # a file from a clock ahead of this one: no short wait orders them
        warnings.warn(
            f"TensorBoardLogger: `log_dir` {log_dir!r} holds an event file dated "
            f"{wait - 1:.0f} s in the future; TensorBoard may read this run's events before "
            "it and show that file's steps in place of this run's. Log to a new directory",
            stacklevel=2,
        )
    elif wait > 0:
        time.sleep(wait)
