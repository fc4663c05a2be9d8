"""History, the schedulers and the loggers of ``fit`` against N plain modules trained alone
with ``torch.optim`` and ``torch.optim.lr_scheduler``, each stepped per epoch or per batch as
a plain loop steps it, and stopped where ``fit`` stops it; the CSV read back with ``csv``."""

from __future__ import annotations

import copy
import csv
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as sched

import vmapens
from vmapens.callbacks import Callback, Context, CSVLogger, LRScheduler, TensorBoardLogger

F64 = dict(dtype=torch.float64)
TOL = dict(rtol=1e-9, atol=1e-12)
G = torch.Generator().manual_seed(0)
X, Y = torch.randn(16, 3, generator=G, **F64), torch.randn(16, 1, generator=G, **F64)
LRS = [0.05, 0.1, 0.02]  # one base lr per member
BATCH, EPOCHS = 4, 4
STOP_AT = {0: 6, 2: 9}  # member -> the global step after which a callback stops it

SCHEDULES: dict[str, Callable[[Any], Any]] = {
    "StepLR": lambda o: sched.StepLR(o, 2, 0.5),
    "ExponentialLR": lambda o: sched.ExponentialLR(o, 0.9),
    "CosineAnnealingWarmRestarts": lambda o: sched.CosineAnnealingWarmRestarts(o, 3, 2),
    "OneCycleLR": lambda o: sched.OneCycleLR(o, 0.1, total_steps=40),
    "CyclicLR": lambda o: sched.CyclicLR(o, 0.001, 0.01, step_size_up=3),
    "LambdaLR": lambda o: sched.LambdaLR(o, lambda e: 1 / (1 + e)),
    "SequentialLR": lambda o: sched.SequentialLR(
        o, [sched.ConstantLR(o, 0.5, 2), sched.ExponentialLR(o, 0.8)], [2]
    ),
}


def linear() -> nn.Module:
    return nn.Linear(3, 1).double()


class StopAt(Callback):
    """Stops each member of ``STOP_AT`` after its step (``Context.stop`` in ``on_step_end``)."""

    def on_step_end(self, ctx: Context) -> None:
        for member, step in STOP_AT.items():
            if ctx.step == step:
                ctx.stop(member)


def plain_run(model: nn.Module, i: int, kind: str, interval: str) -> dict[str, Any]:
    """Member ``i`` alone: torch.optim.SGD and its own scheduler, stopped after its step in
    ``STOP_AT`` (neither stepped again). Records each epoch's mean loss and starting lr."""
    opt = torch.optim.SGD(model.parameters(), lr=LRS[i], momentum=0.9)
    schedule, step = SCHEDULES[kind](opt), 0
    losses, lrs, stopped = [math.nan] * EPOCHS, [math.nan] * EPOCHS, -1
    for epoch in range(EPOCHS):
        lrs[epoch], steps = float(opt.param_groups[0]["lr"]), []
        for b in range(0, len(X), BATCH):
            loss = nn.functional.mse_loss(model(X[b : b + BATCH]), Y[b : b + BATCH])
            steps.append(loss.item())
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if interval == "step":
                schedule.step()
            if STOP_AT.get(i) == step:
                break
        if STOP_AT.get(i) == step:  # stopped during this epoch: no row of its own
            stopped = epoch
            break
        losses[epoch] = sum(steps) / len(steps)
        if interval == "epoch":
            schedule.step()
    return {"loss": losses, "lr": lrs, "stopped": stopped, "end_lr": opt.param_groups[0]["lr"]}


@pytest.mark.parametrize("interval", ["epoch", "step"])
@pytest.mark.parametrize("kind", list(SCHEDULES))
def test_history_schedule_and_csv_of_stopped_members_match_plain_runs(
    tmp_path: Path, kind: str, interval: str
) -> None:
    ens = vmapens.Ensemble(linear, n=3, seed=0)
    plains = [copy.deepcopy(m) for m in ens.unstack()]
    opt = vmapens.StackedSGD(ens, lr=LRS, momentum=0.9)
    log = tmp_path / "log.csv"
    h = vmapens.fit(ens, (X, Y), nn.MSELoss(), epochs=EPOCHS, batch_size=BATCH, shuffle=False,
                    optimizer=opt, progress=False,
                    callbacks=[LRScheduler(SCHEDULES[kind](opt), interval), StopAt(), CSVLogger(log)])  # fmt: skip
    truth = [plain_run(m, i, kind, interval) for i, m in enumerate(plains)]
    assert h.stopped_epoch.tolist() == [t["stopped"] for t in truth]
    loss = torch.tensor([t["loss"] for t in truth], **F64).T
    torch.testing.assert_close(h.train_loss, loss, equal_nan=True, **TOL)
    for got, plain in zip(ens.unstack(), plains, strict=True):
        for a, b in zip(got.parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(a, b, **TOL)
    end_lr = [float(v) for v in vmapens.optim.MemberValues(opt.param_groups[0]["lr"])]
    assert end_lr == pytest.approx([t["end_lr"] for t in truth], rel=1e-12)
    # The CSV: each member's row of each epoch, lr as the epoch started (a stopped member's
    # frozen one), its loss an empty cell from the epoch it stopped in.
    rows = list(csv.DictReader(log.read_text().splitlines()))
    assert len(rows) == h.epochs * 3
    for row in rows:
        e, i = int(row["epoch"]), int(row["member"])
        stopped = truth[i]["stopped"]
        lr = truth[i]["lr"][e] if stopped < 0 or e <= stopped else truth[i]["end_lr"]
        assert float(row["lr"]) == pytest.approx(lr, rel=1e-12)
        want = truth[i]["loss"][e]
        assert (row["train_loss"] == "") if math.isnan(want) else (
            float(row["train_loss"]) == pytest.approx(want, rel=1e-12)
        )  # fmt: skip


# -- bad logger paths, refused before anything trains ------------------------------------------


@pytest.mark.parametrize(
    ("where", "error"),
    [("missing/log.csv", FileNotFoundError), (".", IsADirectoryError)],
    ids=["missing-directory", "a-directory"],
)
def test_csv_logger_refuses_a_path_it_cannot_write_before_an_epoch_trains(
    tmp_path: Path, where: str, error: type[Exception]
) -> None:
    # The file was first opened at the first epoch's end: fit trained a whole epoch (and
    # changed every member) before the path was refused.
    ens = vmapens.Ensemble(linear, n=2, seed=0)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    with pytest.raises(error, match="CSVLogger: `path`"):
        vmapens.fit(ens, (X, Y), nn.MSELoss(), epochs=1, progress=False,
                    callbacks=[CSVLogger(tmp_path / where)])  # fmt: skip
    assert all(torch.equal(before[k], v) for k, v in ens.state_dict().items())
    assert not (tmp_path / "missing").exists()


def test_loggers_refuse_a_path_of_the_wrong_kind_when_built(tmp_path: Path) -> None:
    # TensorBoard's SummaryWriter failed on a file as `log_dir` in on_train_start, after
    # Checkpoint's on_fit_start had loaded a checkpoint into the ensemble and optimizer.
    file = tmp_path / "events"
    file.write_text("not a directory")
    with pytest.raises(NotADirectoryError, match="TensorBoardLogger: `log_dir`"):
        TensorBoardLogger(file)
    with pytest.raises(TypeError, match="TensorBoardLogger: `log_dir`"):
        TensorBoardLogger(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="CSVLogger: `path`"):
        CSVLogger(3)  # type: ignore[arg-type]
    assert file.read_text() == "not a directory"
