"""What ``fit`` reports (History, the CSV and TensorBoard loggers, the progress bar) against a
plain loop over plain modules and torch.optim that records the same numbers by hand, and
against what a reader (``csv``, TensorBoard's own) makes of the files."""

from __future__ import annotations

import contextlib
import csv
import io
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import vmapens
from vmapens.callbacks import CSVLogger, TensorBoardLogger

F64 = dict(dtype=torch.float64)
TOL = dict(rtol=1e-9, atol=1e-12)
G = torch.Generator().manual_seed(0)
X, Y = torch.randn(8, 3, generator=G, **F64), torch.randn(8, 1, generator=G, **F64)
XV, YV = torch.randn(6, 3, generator=G, **F64), torch.randn(6, 1, generator=G, **F64)


def linear() -> nn.Module:
    return nn.Linear(3, 1).double()


def mae(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).abs().mean()


class Interrupt(vmapens.Callback):
    """Raises at the end of epoch ``at``: after the loggers, before the checkpoint."""

    def __init__(self, at: int | None) -> None:
        self.at = at

    def on_epoch_end(self, ctx: vmapens.callbacks.Context) -> None:
        if ctx.epoch == self.at:
            raise KeyboardInterrupt


def tensorboard_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory))
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


# -- TensorBoard ----------------------------------------------------------------------------------


def _tensorboard_run(log_dir: Path, checkpoint: Path, interrupt: int | None) -> None:
    ens = vmapens.Ensemble(linear, n=2, seed=0)
    with contextlib.suppress(KeyboardInterrupt):
        vmapens.fit(ens, [(X, Y)], nn.MSELoss(), epochs=4, optimizer=vmapens.StackedSGD,
                    lr=[0.1, 0.2], progress=False, checkpoint=checkpoint, seed=0,
                    callbacks=[TensorBoardLogger(log_dir), Interrupt(interrupt)])  # fmt: skip


def test_tensorboard_resume_in_the_same_second_is_read_after_the_interrupted_run(tmp_path):
    # TensorBoard reads a directory's event files sorted by name: the second they were opened
    # in, then host, process id and a per-process counter, as text. An interrupted run and its
    # resume in the same second, with the counter going from 9 to 10 (or a process id from
    # 99999 to 100000), sorted the resumed run's file first: the reader took the interrupted
    # run's steps 0, 1 last, as a restart, and purged the resumed run's steps 2, 3.
    # Truth: an uninterrupted run's scalars as TensorBoard's own reader shows them.
    pytest.importorskip("tensorboard")
    from tensorboard.summary.writer import event_file_writer

    _tensorboard_run(tmp_path / "straight", tmp_path / "straight.pt", None)
    counter = event_file_writer._global_uid
    counter._value = 10 ** len(str(counter._value)) - 1  # the interrupted run's file: ...9
    # Both runs in one second (~0.1 s), from the start of the next. One clock reading: with two
    # (the ceiling of one minus the other) a second beginning between them made a negative sleep.
    time.sleep(1 - time.time() % 1)
    _tensorboard_run(tmp_path / "resumed", tmp_path / "resumed.pt", 1)
    _tensorboard_run(tmp_path / "resumed", tmp_path / "resumed.pt", None)
    straight = tensorboard_scalars(tmp_path / "straight")
    assert [step for step, _ in straight["train_loss/member_1"]] == [0, 1, 2, 3]
    assert tensorboard_scalars(tmp_path / "resumed") == straight


def test_tensorboard_logger_closes_its_event_file_when_fit_ends(tmp_path):
    # Each SummaryWriter holds a file and a writer thread: fit left them open (one more per
    # run of a sweep) until the logger was closed by hand. Truth: the threads before fit.
    pytest.importorskip("tensorboard")
    ens = vmapens.Ensemble(linear, n=2, seed=0)
    before = set(threading.enumerate())
    logger = TensorBoardLogger(tmp_path)
    vmapens.fit(ens, [(X, Y)], nn.MSELoss(), epochs=2, progress=False, callbacks=[logger])
    assert set(threading.enumerate()) <= before
    assert len(tensorboard_scalars(tmp_path)["train_loss/member_0"]) == 2
    with pytest.raises(KeyboardInterrupt):  # and when a callback interrupts it
        vmapens.fit(ens, [(X, Y)], nn.MSELoss(), epochs=2, progress=False,
                    callbacks=[logger, Interrupt(0)])  # fmt: skip
    assert set(threading.enumerate()) <= before


# -- the CSV file against a plain loop ----------------------------------------------------------


def plain_loop(ens: vmapens.Ensemble, lrs: list, epochs: int) -> dict[str, list]:
    """Each member alone with its own rate: torch.optim.SGD and StepLR(1, 0.5), the numbers
    recorded by hand as [member][epoch] (``lr``: the rate the epoch started with), and the
    averaged members' ``ensemble_mae`` per epoch."""
    rows: dict[str, list] = {"train_loss": [], "val_loss": [], "mae": [], "lr": []}
    outputs = []
    for model, lr in zip(ens.unstack(), lrs, strict=True):
        opt = torch.optim.SGD(model.parameters(), lr=lr.clone() if torch.is_tensor(lr) else lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        member: dict[str, list] = {k: [] for k in rows}
        outputs.append([])
        for _ in range(epochs):
            member["lr"].append(float(opt.param_groups[0]["lr"]))
            loss = nn.functional.mse_loss(model(X), Y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            member["train_loss"].append(loss.item())
            with torch.no_grad():
                out = model(XV)
            member["val_loss"].append(nn.functional.mse_loss(out, YV).item())
            member["mae"].append(mae(out, YV).item())
            outputs[-1].append(out)
            sched.step()
        for k in rows:
            rows[k].append(member[k])
    rows["ensemble_mae"] = [
        mae(torch.stack([o[e] for o in outputs]).mean(0), YV).item() for e in range(epochs)
    ]
    return rows


def csv_columns(path: Path, names: list[str], epochs: int) -> dict[str, list]:
    """The CSV's columns as [member][epoch] floats, read back with the csv module."""
    rows = list(csv.DictReader(path.read_text().splitlines()))
    members = sorted({int(r["member"]) for r in rows})
    return {
        k: [[float(r[k]) for r in rows if int(r["member"]) == m] for m in members] for k in names
    }


def test_csv_logs_the_learning_rate_of_a_tensor_lr(tmp_path):
    # A 0-d tensor lr (torch's schedulers `fill_` it) had no `lr` column at all, where the
    # docs say the rate each epoch started with is written for every member.
    # Truth: plain modules with torch.optim.SGD(lr=tensor) and StepLR.
    ens = vmapens.Ensemble(linear, n=2, seed=0)
    truth = plain_loop(ens, [torch.tensor(0.1, **F64)] * 2, epochs=3)
    opt = vmapens.StackedSGD(ens, lr=torch.tensor(0.1, **F64))
    vmapens.fit(ens, [(X, Y)], nn.MSELoss(), epochs=3, optimizer=opt, progress=False,
                scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5),
                callbacks=[CSVLogger(tmp_path / "log.csv")])  # fmt: skip
    got = csv_columns(tmp_path / "log.csv", ["train_loss", "lr"], 3)
    torch.testing.assert_close(torch.tensor(got["lr"], **F64), torch.tensor(truth["lr"], **F64))
    torch.testing.assert_close(
        torch.tensor(got["train_loss"], **F64), torch.tensor(truth["train_loss"], **F64), **TOL
    )


# -- the progress bar -------------------------------------------------------------------------


@pytest.mark.parametrize("flag", [0, 1, False], ids=["int-0", "int-1", "bool"])
def test_progress_takes_zero_and_one_as_false_and_true(flag):
    # `progress=verbose` with an int (or a numpy bool) passed the check, then tqdm was given
    # it as the stream to write to: AttributeError after the run had started.
    # Truth: fit(progress=False)'s history, and nothing on stdout or stderr (not a terminal).
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        h = vmapens.fit(vmapens.Ensemble(linear, n=2, seed=0), [(X, Y)], nn.MSELoss(),
                        epochs=2, progress=flag, seed=0)  # fmt: skip
    quiet = vmapens.fit(vmapens.Ensemble(linear, n=2, seed=0), [(X, Y)], nn.MSELoss(),
                        epochs=2, progress=False, seed=0)  # fmt: skip
    assert (out.getvalue(), err.getvalue()) == ("", "")
    torch.testing.assert_close(h.train_loss, quiet.train_loss, rtol=0, atol=0)


def test_csv_of_a_sub_ensemble_against_a_plain_loop(tmp_path):
    # Every column of every row, read back with the csv module: global member ids, per-member
    # lr (MemberValues) at each epoch's start, losses, the metric and the averaged ensemble's.
    # Truth: each member alone with torch.optim.SGD and StepLR, recorded by hand.
    sub = vmapens.Ensemble(linear, n=4, seed=0)[[1, 3]]
    truth = plain_loop(sub, [0.1, 0.2], epochs=3)
    vmapens.fit(sub, [(X, Y)], nn.MSELoss(), epochs=3, optimizer=vmapens.StackedSGD,
                lr=[0.1, 0.2], val_data=(XV, YV), metrics={"mae": mae}, progress=False,
                scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5),
                patience=10, callbacks=[CSVLogger(tmp_path / "log.csv")])  # fmt: skip
    rows = list(csv.DictReader((tmp_path / "log.csv").read_text().splitlines()))
    assert [(int(r["epoch"]), int(r["member"])) for r in rows] == [
        (e, m) for e in range(3) for m in (1, 3)
    ]
    got = csv_columns(tmp_path / "log.csv", ["train_loss", "val_loss", "mae", "lr"], 3)
    for k, columns in got.items():
        want = torch.tensor(truth[k], **F64)
        torch.testing.assert_close(torch.tensor(columns, **F64), want, **TOL, msg=k)
    whole = [float(r["ensemble_mae"]) for r in rows[::2]]
    assert [float(r["ensemble_mae"]) for r in rows[1::2]] == whole
    torch.testing.assert_close(
        torch.tensor(whole, **F64), torch.tensor(truth["ensemble_mae"], **F64), **TOL
    )


@pytest.mark.parametrize("same", [True, False], ids=["one-path", "a-path-each"])
def test_one_csv_for_several_ranks_is_refused_before_a_row_is_written(tmp_path, monkeypatch, same):
    # Under torch.distributed every rank logs its own members: two ranks on one file wrote it
    # at once. The paths the ranks give are gathered (here: rank 1's as given, or its own).
    from vmapens.callbacks import loggers

    def gathered(api, err, value):
        return [value, value if same else value + ".rank1"]

    monkeypatch.setattr(loggers, "world_size", lambda: 2)
    monkeypatch.setattr(loggers, "raise_together", gathered)
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 1), 2, seed=0)
    path = tmp_path / "log.csv"
    data = (torch.randn(8, 3), torch.randn(8, 1))
    logger = vmapens.callbacks.CSVLogger(path)
    if same:
        with pytest.raises(ValueError, match=r"^CSVLogger: ranks \[0, 1\] log to one `path`"):
            vmapens.fit(ens, data, nn.MSELoss(), callbacks=[logger], progress=False)
        assert not path.exists()
    else:
        vmapens.fit(ens, data, nn.MSELoss(), callbacks=[logger], progress=False)
        assert path.exists()
