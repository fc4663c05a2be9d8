"""A user journey: watching a run. `fit` with a progress bar on a stream, a CSV logger and a
TensorBoard logger, a validation metric, early stopping, a per-epoch StepLR, a checkpoint, an
interruption and a resume, then `history.plot` and the History's state_dict round trip.

The truth is the naive loop in plain PyTorch, float64, one member at a time: `torch.optim.SGD`
with momentum, `StepLR`, the data order of docs/fit.md ("pass p takes torch.randperm(S,
generator=Generator().manual_seed(s_p))", `s_p` from sha256), each epoch's training loss the
mean of its step losses, validation loss and metric in eval mode under no_grad, early stopping
from its documented rule (strictly better than the best so far improves; `patience` epochs
without improvement stop the member at that epoch's end, which misses that epoch's scheduler
step), and the documented file formats: one CSV row per epoch and member, empty cells for a
stopped member's losses, its `lr` frozen at its stop; TensorBoard tags `<scalar>/member_<i>`
only for members that trained in the epoch.
"""

from __future__ import annotations

import contextlib
import copy
import csv
import importlib.util
import io
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from truth import derived_seed

import vmapens
from vmapens.callbacks import Callback, Context, CSVLogger, TensorBoardLogger
from vmapens.history import History

pytestmark = pytest.mark.usefixtures("float64_default")

N, EPOCHS, BATCH, PATIENCE, SEED, INTERRUPT_AT = 3, 6, 8, 2, 7, 3
LRS = [0.05, 0.2, 0.4]
MOMENTUM, STEP_SIZE, GAMMA = 0.9, 2, 0.5
TOL = {"rtol": 1e-10, "atol": 1e-12}


def member() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1))


def mae(out: Tensor, y: Tensor) -> Tensor:
    return (out - y).abs().mean()


def data() -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(3)
    x, xv = torch.randn(20, 3, generator=g), torch.randn(6, 3, generator=g)
    w = torch.randn(3, 1, generator=g)
    y = x @ w + 0.5 * torch.randn(20, 1, generator=g)
    yv = xv @ w + 0.5 * torch.randn(6, 1, generator=g)
    return (x, y), (xv, yv)


# -- the naive loop -------------------------------------------------------------------------------


def naive() -> dict[str, Any]:
    """Each member alone; returns its per-epoch numbers, lrs, stop epoch and final weights."""
    (x, y), (xv, yv) = data()
    rows = len(x)
    orders = [
        torch.randperm(
            rows, generator=torch.Generator().manual_seed(derived_seed(SEED, "shuffle", p))
        )
        for p in range(EPOCHS)
    ]
    nan = math.nan
    out: dict[str, Any] = {
        k: torch.full((EPOCHS, N), nan) for k in ("train_loss", "val_loss", "mae")
    }
    out |= {"lr": torch.full((EPOCHS, N), nan), "stopped": [-1] * N, "best": [-1] * N}
    out |= {"models": [], "outputs": torch.zeros(EPOCHS, N, len(xv), 1)}
    for i in range(N):
        torch.manual_seed(derived_seed(SEED, "member", i))
        model = member()
        opt = torch.optim.SGD(model.parameters(), lr=LRS[i], momentum=MOMENTUM)
        sched = torch.optim.lr_scheduler.StepLR(opt, STEP_SIZE, GAMMA)
        best, bad, best_state, stopped = math.inf, 0, copy.deepcopy(model.state_dict()), False
        for epoch in range(EPOCHS):
            out["lr"][epoch, i] = opt.param_groups[0]["lr"]
            if stopped:
                with torch.no_grad():
                    out["outputs"][epoch, i] = model(xv)
                continue
            losses = []
            for k in range(0, rows, BATCH):
                idx = orders[epoch][k : k + BATCH]
                loss = nn.functional.mse_loss(model(x[idx]), y[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
            out["train_loss"][epoch, i] = sum(losses) / len(losses)
            model.eval()
            with torch.no_grad():
                pred = model(xv)
            model.train()
            out["outputs"][epoch, i] = pred
            val = nn.functional.mse_loss(pred, yv).item()
            out["val_loss"][epoch, i], out["mae"][epoch, i] = val, mae(pred, yv).item()
            if val < best:
                best, bad, best_state, out["best"][i] = (
                    val,
                    0,
                    copy.deepcopy(model.state_dict()),
                    epoch,
                )
            else:
                bad += 1
            if bad >= PATIENCE:
                stopped, out["stopped"][i] = True, epoch
            else:
                sched.step()
        model.load_state_dict(best_state)
        out["models"].append(model)
    out["ensemble_mae"] = torch.tensor(
        [mae(out["outputs"][e].mean(0), yv).item() for e in range(EPOCHS)]
    )
    return out


# -- the vmapens run ------------------------------------------------------------------------------


class Interrupt(Callback):
    """A crash at the end of epoch `at`: after the loggers, before the checkpoint."""

    def __init__(self, at: int | None) -> None:
        self.at = at

    def on_epoch_end(self, ctx: Context) -> None:
        if ctx.epoch == self.at:
            raise KeyboardInterrupt


def run(
    where: Path, interrupt: int | None, patience: int = PATIENCE, seed: int = SEED
) -> tuple[vmapens.Ensemble, History | None, str]:
    train, val = data()
    ens = vmapens.Ensemble(member, n=N, seed=seed)
    stream = io.StringIO()
    history = None
    with contextlib.suppress(KeyboardInterrupt):
        history = vmapens.fit(
            ens,
            train,
            nn.MSELoss(),
            epochs=EPOCHS,
            batch_size=BATCH,
            optimizer=vmapens.StackedSGD,
            lr=LRS,
            momentum=MOMENTUM,
            scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, STEP_SIZE, GAMMA),
            val_data=val,
            metrics={"mae": mae},
            patience=patience,
            checkpoint=where / "run.pt",
            progress=stream,
            seed=seed,
            callbacks=[
                CSVLogger(where / "log.csv"),
                TensorBoardLogger(where / "tb"),
                Interrupt(interrupt),
            ],
        )
    return ens, history, stream.getvalue()


def tensorboard_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory))
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def journey(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # module scope: set up before the function fixture
    try:
        straight_dir = tmp_path_factory.mktemp("straight")
        resumed_dir = tmp_path_factory.mktemp("resumed")
        straight, h_straight, bar_straight = run(straight_dir, None)
        _, h_cut, bar_cut = run(resumed_dir, INTERRUPT_AT)
        cut_rows = (resumed_dir / "log.csv").read_text()
        resumed, h_resumed, bar_resumed = run(resumed_dir, None)
        truth = naive()
    finally:
        torch.set_default_dtype(before)
    return {
        "straight": (straight, h_straight, bar_straight, straight_dir),
        "resumed": (resumed, h_resumed, bar_resumed, resumed_dir),
        "cut": (h_cut, bar_cut, cut_rows),
        "truth": truth,
    }


def test_the_truth_stops_members_before_and_at_the_interrupt_and_trains_one_to_the_end(journey):
    # The journey's premise: the data is tuned so that every case of a stop is exercised (one
    # stopped before the checkpoint the resume starts from, one in the epoch it redoes) and
    # one member trains every epoch (the run does not end early).
    stopped = journey["truth"]["stopped"]
    assert sorted(stopped) == sorted([INTERRUPT_AT - 1, INTERRUPT_AT, -1]), stopped


@pytest.mark.parametrize("which", ["straight", "resumed"])
def test_history_and_members_match_the_naive_loop(journey, which):
    ens, h, _, _ = journey[which]
    truth = journey["truth"]
    assert h is not None and h.epochs == EPOCHS
    torch.testing.assert_close(h.train_loss, truth["train_loss"], equal_nan=True, **TOL)
    torch.testing.assert_close(h.val_loss, truth["val_loss"], equal_nan=True, **TOL)
    torch.testing.assert_close(h.metrics["mae"], truth["mae"], equal_nan=True, **TOL)
    torch.testing.assert_close(h.ensemble_metrics["mae"], truth["ensemble_mae"], **TOL)
    assert h.stopped_epoch.tolist() == truth["stopped"]
    assert h.best_epoch.tolist() == truth["best"]
    for got, want in zip(ens.unstack(), truth["models"], strict=True):
        for (k, a), b in zip(got.state_dict().items(), want.state_dict().values(), strict=True):
            torch.testing.assert_close(a, b, **TOL, msg=k)


def test_resumed_history_equals_the_uninterrupted_one_bit_for_bit(journey):
    a, b = journey["straight"][1].state_dict(), journey["resumed"][1].state_dict()
    for key in a:
        if isinstance(a[key], Tensor):
            torch.testing.assert_close(b[key], a[key], rtol=0, atol=0, equal_nan=True, msg=key)
        elif isinstance(a[key], dict):
            for name in a[key]:
                torch.testing.assert_close(
                    b[key][name], a[key][name], rtol=0, atol=0, equal_nan=True
                )
        else:
            assert a[key] == b[key], key


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("which", ["straight", "resumed"])
def test_csv_has_one_row_per_epoch_and_member_with_the_naive_numbers(journey, which):
    where = journey[which][3]
    truth = journey["truth"]
    rows = read_csv(where / "log.csv")
    assert [(int(r["epoch"]), int(r["member"])) for r in rows] == [
        (e, i) for e in range(EPOCHS) for i in range(N)
    ]
    assert set(rows[0]) == {
        "epoch",
        "member",
        "train_loss",
        "val_loss",
        "mae",
        "lr",
        "ensemble_mae",
    }
    for r in rows:
        e, i = int(r["epoch"]), int(r["member"])
        for name in ("train_loss", "val_loss", "mae"):
            want = float(truth[name][e, i])
            if math.isnan(want):  # documented: a stopped member's losses are empty cells
                assert r[name] == "", (name, e, i, r[name])
            else:
                assert float(r[name]) == pytest.approx(want, rel=1e-10), (name, e, i)
        # The rate the epoch trained with; a stopped member's stays as it was when it stopped.
        assert float(r["lr"]) == pytest.approx(float(truth["lr"][e, i]), rel=1e-12), (e, i)
        assert float(r["ensemble_mae"]) == pytest.approx(float(truth["ensemble_mae"][e]), rel=1e-10)


def test_the_interrupted_run_logged_the_epoch_the_resume_redoes(journey):
    # The premise of the duplicate check: the interrupt came after the CSV logger wrote epoch 2
    # and before the checkpoint, so the resume redoes an epoch already in the file.
    h_cut, _, cut_rows = journey["cut"]
    assert h_cut is None
    epochs = [int(r["epoch"]) for r in csv.DictReader(io.StringIO(cut_rows))]
    assert epochs == [e for e in range(INTERRUPT_AT + 1) for _ in range(N)]


def test_csv_after_resume_equals_the_uninterrupted_runs_file(journey):
    a = (journey["straight"][3] / "log.csv").read_text()
    b = (journey["resumed"][3] / "log.csv").read_text()
    assert b == a


def test_tensorboard_after_resume_shows_each_epoch_once_with_the_naive_numbers(journey):
    pytest.importorskip("tensorboard")
    truth = journey["truth"]
    straight = tensorboard_scalars(journey["straight"][3] / "tb")
    resumed = tensorboard_scalars(journey["resumed"][3] / "tb")
    assert resumed == straight
    for name in ("train_loss", "val_loss", "mae", "lr"):
        for i in range(N):
            trained = [e for e in range(EPOCHS) if not math.isnan(float(truth["train_loss"][e, i]))]
            got = resumed[f"{name}/member_{i}"]
            # documented: members that did not train in an epoch are not written for it, lr too
            assert [s for s, _ in got] == trained, (name, i)
            for (_, v), e in zip(got, trained, strict=True):
                # TensorBoard stores float32
                assert v == pytest.approx(float(truth[name][e, i]), rel=1e-6), (name, e, i)
        mean = resumed[f"{name}/mean"]
        assert [s for s, _ in mean] == list(range(EPOCHS))
        for s, v in mean:
            live = [float(truth[name][s, i]) for i in range(N)
                    if not math.isnan(float(truth["train_loss"][s, i]))]  # fmt: skip
            assert v == pytest.approx(sum(live) / len(live), rel=1e-6), (name, s)
    got = [(s, v) for s, v in resumed["ensemble/mae"]]
    assert [s for s, _ in got] == list(range(EPOCHS))
    for s, v in got:
        assert v == pytest.approx(float(truth["ensemble_mae"][s]), rel=1e-6)


def test_progress_bar_after_resume_ends_at_every_step_of_the_run(journey):
    steps = EPOCHS * math.ceil(20 / BATCH)
    stopped = sum(s != -1 for s in journey["truth"]["stopped"])
    for which in ("straight", "resumed"):
        bar = journey[which][2].split("\r")[-1].strip()
        assert f"{steps}/{steps}" in bar, (which, bar)
        assert f"epoch {EPOCHS}/{EPOCHS}" in bar, (which, bar)
        assert f"training {N - stopped}/{N}" in bar, (which, bar)
    cut = journey["cut"][1].split("\r")[-1].strip()
    done = (INTERRUPT_AT + 1) * math.ceil(20 / BATCH)
    assert f"{done}/{steps}" in cut, cut


def test_history_plot_writes_a_png_and_the_state_round_trips(journey, tmp_path):
    pytest.importorskip("matplotlib")
    h = journey["resumed"][1]
    png = h.plot(tmp_path / "h.png", title="journey")
    assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    torch.save(h.state_dict(), tmp_path / "h.pt")
    back = History.empty(list(range(N)), validated=True, metrics=["mae"])
    back.load_state_dict(torch.load(tmp_path / "h.pt", weights_only=True))
    for key, value in h.state_dict().items():
        if isinstance(value, Tensor):
            torch.testing.assert_close(getattr(back, key), value, rtol=0, atol=0, equal_nan=True)
    assert back.member_ids == h.member_ids
    torch.testing.assert_close(
        back.metrics["mae"], h.metrics["mae"], rtol=0, atol=0, equal_nan=True
    )


def test_a_run_that_ends_early_resumes_and_reruns_without_changing_its_logs(tmp_path):
    # patience=1, seed=5: every member has stopped by epoch 4 of 6, so training ends early;
    # interrupted at epoch 3 and resumed, then the finished script run once more (its
    # checkpoint has every member stopped). Truth: the uninterrupted run's history and files.
    early = {"patience": 1, "seed": 5}
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    _, straight, _ = run(tmp_path / "a", None, **early)
    run(tmp_path / "b", 3, **early)
    _, resumed, _ = run(tmp_path / "b", None, **early)
    _, again, bar = run(tmp_path / "b", None, **early)
    assert straight is not None and resumed is not None and again is not None
    assert straight.epochs < EPOCHS and bool((straight.stopped_epoch >= 0).all())
    for h in (resumed, again):
        torch.testing.assert_close(
            h.train_loss, straight.train_loss, rtol=0, atol=0, equal_nan=True
        )
        torch.testing.assert_close(h.val_loss, straight.val_loss, rtol=0, atol=0, equal_nan=True)
        assert h.stopped_epoch.tolist() == straight.stopped_epoch.tolist()
    assert (tmp_path / "b" / "log.csv").read_text() == (tmp_path / "a" / "log.csv").read_text()
    rows = read_csv(tmp_path / "b" / "log.csv")
    assert len(rows) == straight.epochs * N
    assert f"training 0/{N}" in bar.split("\r")[-1]
    if importlib.util.find_spec("tensorboard") is not None:
        assert tensorboard_scalars(tmp_path / "b" / "tb") == tensorboard_scalars(
            tmp_path / "a" / "tb"
        )
