"""fit's callbacks against plain PyTorch: early stopping written from its documented rule over
N plain modules and ``torch.optim``, resumed runs against uninterrupted ones (float64, bit for
bit), user callbacks that stop members or change the learning rate, and bad arguments."""

from __future__ import annotations

import copy
import io
import math
import os
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import vmapens
from vmapens.callbacks import Callback, Checkpoint, Context, EarlyStopping, ProgressBar

N, ROWS, BATCH = 4, 40, 10
LRS = [0.3, 0.05, 0.01, 0.8]
#: member -> the run's step after which a user callback stops it (mid-epoch: 4 steps an epoch)
USER_STOPS = {1: 6, 2: 2}


def member() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.BatchNorm1d(5), nn.Linear(5, 1))


def data() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(r, c, generator=g, dtype=torch.float64) for r, c in
                 [(ROWS, 3), (ROWS, 1), (20, 3), (20, 1)])  # fmt: skip


def neg_mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return -((out - target) ** 2).mean()


def hits(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Ties on purpose: a share of 20 rows repeats, and a tie is no improvement."""
    return ((out - target).abs() < 0.8).double().mean()


class UserStop(Callback):
    def on_step_end(self, ctx: Context) -> None:
        for i, step in USER_STOPS.items():
            if ctx.step == step:
                ctx.stop([i])


def alone(
    epochs: int, patience: int, monitor: Any, mode: str, restore: bool, decay: float | None
) -> list[tuple[nn.Module, int, int]]:
    """Each member trained alone: Adam, an optional StepLR, stopped by the user or by the
    documented rule (better when strictly lower/higher; stop after `patience` epochs without)."""
    x, y, xv, yv = data()
    out = []
    for i in range(N):
        torch.manual_seed(vmapens.seeds.member_seed(0, i))
        m = member().double()
        opt = torch.optim.Adam(m.parameters(), lr=LRS[i])
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, decay) if decay else None
        best, bad, best_epoch, stopped, step = math.inf, 0, -1, -1, 0
        kept = copy.deepcopy(m.state_dict())
        for epoch in range(epochs):
            for k in range(0, ROWS, BATCH):
                opt.zero_grad()
                nn.functional.mse_loss(m(x[k : k + BATCH]), y[k : k + BATCH]).backward()
                opt.step()
                step += 1
                if USER_STOPS.get(i) == step:
                    stopped = epoch
                    break
            if stopped >= 0:
                break
            m.eval()
            with torch.no_grad():
                value = float((monitor or nn.functional.mse_loss)(m(xv), yv))
            m.train()
            value = value if mode == "min" else -value
            if value < best:
                best, bad, best_epoch, kept = value, 0, epoch, copy.deepcopy(m.state_dict())
            else:
                bad += 1
            if bad >= patience:
                stopped = epoch
                break
            if sched is not None:
                sched.step()
        if restore and best_epoch >= 0:
            m.load_state_dict(kept)
        out.append((m, best_epoch, stopped))
    return out


CASES = [
    pytest.param(2, None, "min", True, None, id="val_loss-restore"),
    pytest.param(3, neg_mse, "max", True, 0.7, id="max-metric-steplr"),
    pytest.param(2, None, "min", False, 0.7, id="no-restore-steplr"),
    pytest.param(1, hits, "max", True, None, id="max-ties"),
]


@pytest.mark.parametrize(("patience", "monitor", "mode", "restore", "decay"), CASES)
def test_early_stopping_per_member_matches_each_member_alone(
    patience, monitor, mode, restore, decay
):
    epochs = 9
    truth = alone(epochs, patience, monitor, mode, restore, decay)
    x, y, xv, yv = data()
    ens = vmapens.Ensemble(member, n=N, seed=0).double()
    stop = EarlyStopping(monitor="val_loss" if monitor is None else "val_m", mode=mode,
                         patience=patience, restore_best=restore)  # fmt: skip
    sched = (lambda o: torch.optim.lr_scheduler.StepLR(o, 1, decay)) if decay else None
    h = vmapens.fit(ens, (x, y), nn.MSELoss(), epochs=epochs, batch_size=BATCH, shuffle=False,
                    val_data=(xv, yv), metrics=None if monitor is None else {"m": monitor},
                    callbacks=[stop, UserStop()], scheduler=sched, progress=False, seed=0,
                    lr=LRS)  # fmt: skip
    assert h.best_epoch.tolist() == [b for _, b, _ in truth]
    assert h.stopped_epoch.tolist() == [s for _, _, s in truth]
    assert len(set(h.stopped_epoch.tolist())) > 2  # members stop at different epochs
    for i, (m, _, _) in enumerate(truth):
        torch.testing.assert_close(ens[i].state_dict(), m.state_dict(), rtol=0, atol=1e-11)


class Boom(Exception):
    pass


class BoomAt(Callback):
    """A crash after the run's step `at` (mid-epoch), once."""

    def __init__(self, at: int) -> None:
        self.at, self.fired = at, False

    def on_step_end(self, ctx: Context) -> None:
        if ctx.step == self.at and not self.fired:
            self.fired = True
            raise Boom


class HalveLr(Callback):
    def on_epoch_end(self, ctx: Context) -> None:
        if ctx.epoch in (1, 3):
            for group in ctx.optimizer.param_groups:
                group["lr"] = group["lr"] * 0.5


def boom_after_epoch_2(history: vmapens.History) -> None:
    if history.epochs == 2:
        raise Boom


def _objects() -> list[Any]:
    torch.manual_seed(1)  # dropout's masks come from the global RNG
    ens = vmapens.Ensemble(
        lambda: nn.Sequential(nn.Linear(3, 5), nn.Dropout(0.2), nn.Tanh(), nn.Linear(5, 1)),
        n=N, seed=0,
    ).double()  # fmt: skip
    return [ens, vmapens.StackedAdam(ens, lr=LRS)]


def _run(path: str, extra: list[Any], objects: list[Any]) -> Any:
    x, y, xv, yv = data()
    ens, opt = objects
    h = vmapens.fit(ens, (x, y), nn.MSELoss(), epochs=6, batch_size=16, val_data=(xv, yv),
                    patience=2, optimizer=opt, callbacks=[HalveLr(), UserStop(), *extra],
                    scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 2, 0.5),
                    checkpoint=path, progress=False, seed=0)  # fmt: skip
    return ens, h


@pytest.mark.parametrize("fresh", [True, False], ids=["new-objects", "same-objects"])
@pytest.mark.parametrize("crash", ["mid-epoch", "between-epochs"])
def test_a_resumed_run_equals_the_uninterrupted_one_bit_for_bit(tmp_path, crash, fresh):
    ref, want = _run(str(tmp_path / "ref.pt"), [], _objects())
    path = str(tmp_path / "cut.pt")
    extra = [BoomAt(7)] if crash == "mid-epoch" else [boom_after_epoch_2]
    objects = _objects()
    with pytest.raises(Boom):
        _run(path, extra, objects)
    ens, got = _run(path, [], _objects() if fresh else objects)
    for (k, a), b in zip(ref.state_dict().items(), ens.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    assert torch.equal(want.train_loss.nan_to_num(7), got.train_loss.nan_to_num(7))
    assert torch.equal(want.stopped_epoch, got.stopped_epoch)
    assert torch.equal(want.best_epoch, got.best_epoch)


@pytest.mark.parametrize(
    "members",
    [1, -1, np.int64(2), torch.tensor(0), [True, False, True, False], [1, 3]],
    ids=["int", "negative", "numpy-int", "0-d-tensor", "list-of-bools", "list"],
)
def test_context_stop_takes_what_torch_indexing_takes(members):
    """`ctx.stop(3)` raised "index must be an integer-like ... got int"."""
    want = torch.zeros(N, dtype=torch.bool)
    want[torch.arange(N)[members]] = True  # torch's own reading of the selection

    class StopAtFirstEpoch(Callback):
        def on_epoch_end(self, ctx: Context) -> None:
            if ctx.epoch == 0:
                ctx.stop(members)

    x, y, _, _ = data()
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 1), n=N, seed=0).double()
    h = vmapens.fit(ens, (x, y), nn.MSELoss(), epochs=2, progress=False, seed=0,
                    callbacks=[StopAtFirstEpoch()])  # fmt: skip
    assert h.stopped_epoch.tolist() == torch.where(want, 0, -1).tolist()


def test_a_member_stopped_before_a_resumed_runs_first_epoch_records_that_epoch(tmp_path):
    """It recorded epoch 0 (`ctx.epoch` before the loop of a resumed run), though its history
    shows it trained epochs 0 and 1: the stop epoch is the first epoch it has no loss in."""

    class StopOnResume(Callback):
        def on_train_start(self, ctx: Context) -> None:
            if ctx.history.epochs:
                ctx.stop(1)

    x, y, _, _ = data()
    path = str(tmp_path / "c.pt")
    for observers in ([boom_after_epoch_2], []):
        ens = vmapens.Ensemble(lambda: nn.Linear(3, 1), n=N, seed=0).double()
        try:
            h = vmapens.fit(ens, (x, y), nn.MSELoss(), epochs=4, progress=False, seed=0,
                            checkpoint=path, callbacks=[StopOnResume(), *observers])  # fmt: skip
        except Boom:
            continue
    first_nan = int(h.train_loss[:, 1].isnan().nonzero()[0])
    assert first_nan == 2 and h.stopped_epoch.tolist() == [-1, first_nan, -1, -1]


class Counter(Callback):
    def __init__(self) -> None:
        self.steps = 0

    def on_step_end(self, ctx: Context) -> None:
        self.steps += 1

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = state["steps"]


class Picky(Callback):
    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse

    def state_dict(self) -> dict[str, Any]:
        return {"picky": True}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.refuse:
            raise KeyError("Picky refuses its state")


def test_a_callback_refusing_its_state_leaves_the_others_as_they_were(tmp_path):
    """The callbacks loaded before the one that refused kept the checkpoint's state."""
    x, y, xv, yv = data()
    path = tmp_path / "c.pt"
    run = dict(batch_size=16, val_data=(xv, yv), patience=2, progress=False, seed=0,
               checkpoint=path)  # fmt: skip
    ens = vmapens.Ensemble(member, n=N, seed=0).double()
    vmapens.fit(ens, (x, y), nn.MSELoss(), epochs=2, callbacks=[Counter(), Picky()], **run)
    written = path.read_bytes()
    counter = Counter()
    counter.steps = -5
    other = vmapens.Ensemble(member, n=N, seed=1).double()
    before = copy.deepcopy(other.state_dict())
    with pytest.raises(ValueError, match="Picky refuses its state"):
        vmapens.fit(other, (x, y), nn.MSELoss(), epochs=4, callbacks=[counter, Picky(True)], **run)
    assert counter.steps == -5
    torch.testing.assert_close(other.state_dict(), before, rtol=0, atol=0)
    assert path.read_bytes() == written


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (
            lambda d: EarlyStopping(restore_best="no"),
            r"^EarlyStopping: `restore_best` must be a bool",
        ),
        (
            lambda d: EarlyStopping(restore_best=None),
            r"^EarlyStopping: `restore_best` must be a bool",
        ),
        (lambda d: Checkpoint(3), r"^Checkpoint: `path` must be a str or os.PathLike, got int"),
    ],
    ids=["restore_best-str", "restore_best-None", "checkpoint-path-int"],
)
def test_bad_callback_arguments_are_refused_by_name(build, match, tmp_path):
    with pytest.raises(TypeError, match=match):
        build(tmp_path)
    assert os.listdir(tmp_path) == []


def test_progress_bar_counts_the_members_still_training():
    class StopTwo(Callback):
        def on_epoch_end(self, ctx: Context) -> None:
            if ctx.epoch == 0:
                ctx.stop([0, 2])

    x, y, _, _ = data()
    out = io.StringIO()
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 1), n=N, seed=0).double()
    h = vmapens.fit(ens, (x, y), nn.MSELoss(), epochs=2, batch_size=20, seed=0,
                    callbacks=[StopTwo(), ProgressBar(out)])  # fmt: skip
    last = out.getvalue().strip().split("\r")[-1]
    live = h.train_loss[-1][h.stopped_epoch == -1]
    assert last.endswith(f"training {len(live)}/{N}]")
    assert f"min {float(live.min()):.4g}, max {float(live.max()):.4g}" in last


def test_an_override_that_names_no_option_is_refused_before_the_first_run_writes(tmp_path):
    """It was accepted until the resume, which then refused it: a crashed run could not go on
    without editing the code that started it."""
    x, y, _, _ = data()
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 1), n=N, seed=0).double()
    before = copy.deepcopy(ens.state_dict())
    with pytest.raises(
        ValueError, match=r"^fit: `Checkpoint.override` names unknown options \['lr'\]"
    ):
        vmapens.fit(ens, (x, y), nn.MSELoss(), progress=False, seed=0,
                    callbacks=[Checkpoint(tmp_path / "c.pt", override=["lr"])])  # fmt: skip
    assert os.listdir(tmp_path) == []
    torch.testing.assert_close(ens.state_dict(), before, rtol=0, atol=0)


class EveryOtherEpoch(Checkpoint):
    """Checkpointing every k epochs, as a user writes it: a Checkpoint that saves less often."""

    def on_epoch_end(self, ctx: Context) -> None:
        if (ctx.epoch + 1) % 2 == 0:
            super().on_epoch_end(ctx)


def test_a_checkpoint_every_other_epoch_resumes_from_the_older_file_exactly(tmp_path):
    ref, want = _run(str(tmp_path / "ref.pt"), [], _objects())
    path = tmp_path / "cut.pt"
    objects = _objects()
    ens, opt = objects
    x, y, xv, yv = data()
    run = dict(epochs=6, batch_size=16, val_data=(xv, yv), patience=2, progress=False, seed=0,
               scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 2, 0.5))  # fmt: skip
    # 3 steps an epoch: saved after epochs 1 and 3; the crash is mid-epoch 3, epoch 2 unsaved
    with pytest.raises(Boom):
        vmapens.fit(ens, (x, y), nn.MSELoss(), optimizer=opt, **run,
                    callbacks=[HalveLr(), UserStop(), EveryOtherEpoch(path), BoomAt(11)])  # fmt: skip
    assert path.exists()  # written after epoch 1: the run goes on from two epochs back
    ens, opt = _objects()
    got = vmapens.fit(ens, (x, y), nn.MSELoss(), optimizer=opt, **run,
                      callbacks=[HalveLr(), UserStop(), EveryOtherEpoch(path)])  # fmt: skip
    for (k, a), b in zip(ref.state_dict().items(), ens.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    assert torch.equal(want.train_loss.nan_to_num(7), got.train_loss.nan_to_num(7))
