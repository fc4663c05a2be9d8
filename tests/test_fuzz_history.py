"""Seeded random ``fit`` runs: what the History, the loggers and the progress bar record.

Each case draws a configuration (float64, N = 2..4 members): a list of batches of different
sizes (the last one short), ``epochs``, ``steps`` or one pass, ``StackedSGD`` or
``StackedAdam`` with one learning rate per member, a member whose SGD learning rate makes its
loss overflow, a per-epoch scheduler, validation data with a metric, early stopping (patience,
on the loss or the metric, with or without best-epoch restore), and a checkpointed run
interrupted after some epoch (before the checkpoint, in a ``Callback`` after the loggers, or
after it, in a plain callable) and resumed on new objects.

The truth is the loop a user writes from docs/fit.md and docs/workflows.md: each member a
plain module (seeded as ``Ensemble`` documents) with its own ``torch.optim`` optimizer and
scheduler, the same batches, ``train_loss`` the mean of the epoch's step losses (one weight per
step, whatever the batch's size), eval-mode validation under ``no_grad``, patience counted per
member, the learning rate each epoch started with. Every History field, the CSV file (read
back with ``csv``), TensorBoard's scalars (read back with ``EventAccumulator``) and the
progress bar's last line are compared with it, member by member and epoch by epoch; a resumed
run must equal the uninterrupted one bit for bit (History, CSV and TensorBoard); the History
survives ``state_dict``/``torch.save``/``load_state_dict`` and ``plot``.

Run more seeds by hand: ``python tests/test_fuzz_history.py 0 200`` runs seeds 0..199 and
prints the failures; ``python tests/test_fuzz_history.py 17`` prints seed 17's configuration
and runs it.
"""

from __future__ import annotations

import contextlib
import copy
import csv
import io
import math
import random
import re
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from truth import TOL64, derived_seed, search

import vmapens
from vmapens.callbacks import CSVLogger, EarlyStopping, TensorBoardLogger

pytest.importorskip("matplotlib")


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def factory() -> nn.Module:
    return MLP().double()


def mae(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).abs().mean()


SCHEDULERS = {
    "step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
    "exponential": lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.7),
}


def draw(seed: int) -> dict[str, Any]:
    """A random, valid configuration from ``seed``."""
    r = random.Random(seed)
    s: dict[str, Any] = dict(seed=seed, n=r.randint(2, 4), epochs=r.randint(1, 4))
    s["sizes"] = [r.randint(2, 6) for _ in range(r.randint(1, 3))] + [r.randint(1, 2)]
    s["steps"] = r.choice([None, None, 1, 2, 5])
    s["opt"] = r.choice(["sgd", "adam"])
    s["lr"] = [r.choice([0.01, 0.05, 0.2]) for _ in range(s["n"])]
    s["diverge"] = r.randrange(s["n"]) if s["opt"] == "sgd" and r.random() < 0.4 else None
    if s["diverge"] is not None:
        s["lr"][s["diverge"]] = 1e300
    s["sched"] = r.choice([None, *SCHEDULERS])
    s["val"] = r.random() < 0.8
    s["metric"] = s["val"] and r.random() < 0.6
    s["monitor"] = "val_mae" if s["metric"] and r.random() < 0.4 else "val_loss"
    s["patience"] = r.choice([None, 1, 2]) if s["val"] else None
    s["restore_best"] = r.random() < 0.5
    s["resume"] = r.random() < 0.5 and s["epochs"] >= 2
    s["interrupt"] = r.randrange(s["epochs"] - 1) if s["resume"] else None
    s["interrupt_in"] = r.choice(["callback", "observer"])
    s["tensorboard"] = r.random() < 0.4
    return s


def make_data(s: dict[str, Any]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], Any]:
    g = torch.Generator().manual_seed(s["seed"])
    batches = [
        (torch.randn(b, 3, generator=g, dtype=torch.float64),
         torch.randn(b, 2, generator=g, dtype=torch.float64))
        for b in s["sizes"]
    ]  # fmt: skip
    val = (torch.randn(5, 3, generator=g, dtype=torch.float64),
           torch.randn(5, 2, generator=g, dtype=torch.float64))  # fmt: skip
    return batches, val if s["val"] else None


# -- the truth: a plain loop over N modules ----------------------------------------------------


def plain_run(s: dict[str, Any], batches: list, val: Any) -> dict[str, Any]:
    """What every member records alone (docs/fit.md, "The History"), and the rates."""
    n, loss_fn = s["n"], nn.MSELoss()
    models, opts, scheds = [], [], []
    for i in range(n):
        torch.manual_seed(derived_seed(0, "member", i))
        m = factory()
        models.append(m)
        opt_cls = torch.optim.SGD if s["opt"] == "sgd" else torch.optim.Adam
        opts.append(opt_cls(m.parameters(), lr=s["lr"][i]))
        scheds.append(SCHEDULERS[s["sched"]](opts[-1]) if s["sched"] else None)
    per_epoch = len(batches) if s["steps"] is None else s["steps"]
    nan = math.nan
    train, vloss, vmae, lrs, ens_mae = [], [], [], [], []
    best_epoch, stopped, diverged = [-1] * n, [-1] * n, [False] * n
    best_val, bad = [math.inf] * n, [0] * n
    best_state = [copy.deepcopy(m.state_dict()) for m in models]
    active = [True] * n
    step = 0
    for epoch in range(s["epochs"]):
        if not any(active):
            break
        running = list(active)
        lrs.append([o.param_groups[0]["lr"] for o in opts])
        losses: list[list[float]] = [[] for _ in range(n)]
        for _ in range(per_epoch):
            x, y = batches[step % len(batches)]
            step += 1
            for i, (m, o) in enumerate(zip(models, opts, strict=True)):
                if not running[i]:
                    continue
                loss = loss_fn(m(x), y)
                losses[i].append(loss.item())
                if not active[i]:
                    continue  # diverged earlier this epoch: frozen, its loss still counted
                o.zero_grad()
                loss.backward()
                o.step()
                if not math.isfinite(loss.item()):
                    active[i] = False
        train.append([sum(ls) / len(ls) if running[i] else nan for i, ls in enumerate(losses)])
        for i in range(n):
            if running[i] and not active[i]:
                diverged[i], stopped[i] = True, epoch
        if val is not None:
            xv, yv = val
            with torch.no_grad():
                outs = [m.eval()(xv) for m in models]
            for m in models:
                m.train()
            vloss.append([loss_fn(o, yv).item() if running[i] else nan
                          for i, o in enumerate(outs)])  # fmt: skip
            vmae.append([mae(o, yv).item() if running[i] else nan for i, o in enumerate(outs)])
            kept = [o for i, o in enumerate(outs) if not diverged[i]]
            ens_mae.append(mae(torch.stack(kept).mean(0), yv).item() if kept else nan)
            watched = vmae[-1] if s["monitor"] == "val_mae" else vloss[-1]
            for i in range(n):
                if not active[i]:
                    continue
                if watched[i] < best_val[i]:
                    best_val[i], best_epoch[i], bad[i] = watched[i], epoch, 0
                    best_state[i] = copy.deepcopy(models[i].state_dict())
                else:
                    bad[i] += 1
                if s["patience"] is not None and bad[i] >= s["patience"]:
                    active[i], stopped[i] = False, epoch
        for sch in scheds:
            if sch is not None:
                sch.step()
    if val is not None and s["restore_best"]:
        for i, m in enumerate(models):
            if best_epoch[i] >= 0:
                m.load_state_dict(best_state[i])
    t = lambda rows: torch.tensor(rows, dtype=torch.float64).reshape(-1, n)  # noqa: E731
    return dict(
        train_loss=t(train),
        val_loss=t(vloss) if val is not None else None,
        mae=t(vmae),
        ensemble_mae=torch.tensor(ens_mae, dtype=torch.float64),
        lr=lrs,
        best_epoch=best_epoch,
        stopped_epoch=stopped,
        diverged=diverged,
        active=sum(active),
        per_epoch=per_epoch,
        models=models,
    )


# -- the run under test ------------------------------------------------------------------------


class Interrupt(vmapens.Callback):
    """Raises at the end of epoch ``at``: after the loggers, before the checkpoint."""

    def __init__(self, at: int | None) -> None:
        self.at = at

    def on_epoch_end(self, ctx: vmapens.callbacks.Context) -> None:
        if ctx.epoch == self.at:
            raise KeyboardInterrupt


def run_fit(s, batches, val, out: Path, name: str, interrupt: int | None = None) -> dict:
    """One ``fit`` call (a new ensemble, new loggers); ``interrupt``: stop after that epoch."""
    ens = vmapens.Ensemble(factory, n=s["n"], seed=0)
    stream = io.StringIO()
    loggers: list[Any] = [CSVLogger(out / f"{name}.csv")]
    if s["tensorboard"]:
        loggers.append(TensorBoardLogger(out / f"{name}.tb"))
    callbacks: list[Any] = list(loggers)
    if s["val"]:
        callbacks.insert(0, EarlyStopping(s["monitor"], patience=s["patience"],
                                          restore_best=s["restore_best"]))  # fmt: skip
    if interrupt is not None and s["interrupt_in"] == "callback":
        callbacks.append(Interrupt(interrupt))
    elif interrupt is not None:

        def observer(history: vmapens.History) -> None:
            if history.epochs - 1 == interrupt:
                raise KeyboardInterrupt

        callbacks.append(observer)
    kw = dict(
        epochs=s["epochs"],
        steps=s["steps"],
        val_data=val,
        metrics={"mae": mae} if s["metric"] else None,
        optimizer=vmapens.StackedSGD if s["opt"] == "sgd" else vmapens.StackedAdam,
        lr=s["lr"],
        scheduler=SCHEDULERS[s["sched"]] if s["sched"] else None,
        callbacks=callbacks,
        progress=stream,
        checkpoint=out / f"{name}.pt" if s["resume"] else None,
    )
    try:
        h = vmapens.fit(ens, batches, nn.MSELoss(), **kw)
    except KeyboardInterrupt:
        h = None
    finally:
        for cb in loggers:
            if isinstance(cb, TensorBoardLogger):
                cb.close()
    return dict(history=h, ens=ens, bar=stream.getvalue())


def tensorboard_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory))
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def close(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-10)


def check_history(s: dict[str, Any], h: vmapens.History, truth: dict[str, Any]) -> None:
    n = s["n"]
    assert h.member_ids == list(range(n))
    train, want = h.train_loss, truth["train_loss"]
    assert train.shape == want.shape, (train.shape, want.shape)
    # A diverged member's row is non-finite in its epoch (its value is the overflow's).
    bad = torch.isfinite(want) != torch.isfinite(train)
    assert not bad.any(), (train, want)
    finite = torch.isfinite(want)
    torch.testing.assert_close(train[finite], want[finite], **TOL64)
    assert torch.isnan(train[~finite & torch.isnan(want)]).all()
    assert h.diverged.tolist() == truth["diverged"]
    assert h.stopped_epoch.tolist() == truth["stopped_epoch"], (h.stopped_epoch, truth)
    if not s["val"]:
        assert h.val_loss is None and h.metrics is None and h.ensemble_metrics is None
        assert h.best_epoch.tolist() == [-1] * n
        return
    assert h.val_loss is not None
    torch.testing.assert_close(h.val_loss, truth["val_loss"], equal_nan=True, **TOL64)
    assert h.best_epoch.tolist() == truth["best_epoch"]
    if s["metric"]:
        assert h.metrics is not None and h.ensemble_metrics is not None
        torch.testing.assert_close(h.metrics["mae"], truth["mae"], equal_nan=True, **TOL64)
        torch.testing.assert_close(
            h.ensemble_metrics["mae"], truth["ensemble_mae"], equal_nan=True, **TOL64
        )


def check_csv(s: dict[str, Any], path: Path, h: vmapens.History, truth: dict) -> None:
    """One row per member and epoch, in order; every cell is the History's (or the rate)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    n, names = s["n"], ["train_loss"]
    names += ["val_loss"] if s["val"] else []
    names += ["mae"] if s["metric"] else []
    assert len(rows) == h.epochs * n
    for k, row in enumerate(rows):
        epoch, col = divmod(k, n)
        assert int(row["epoch"]) == epoch and int(row["member"]) == h.member_ids[col], row
        for name in names:
            table = h.metrics[name] if name == "mae" else getattr(h, name)  # type: ignore[index]
            value = float(table[epoch, col])
            cell = row[name]
            assert (cell == "") if math.isnan(value) else float(cell) == value, (name, row)
        assert close(float(row["lr"]), truth["lr"][epoch][col]), (row, truth["lr"][epoch])
        if s["metric"]:
            assert h.ensemble_metrics is not None
            whole = float(h.ensemble_metrics["mae"][epoch])
            cell = row["ensemble_mae"]
            assert (cell == "") if math.isnan(whole) else float(cell) == whole


def check_tensorboard(s: dict[str, Any], scalars: dict, h: vmapens.History, truth: dict) -> None:
    """``<scalar>/member_<i>`` at step = epoch for members that trained in that epoch only,
    ``<scalar>/mean`` over them (docs: stopped members are not written)."""
    n = s["n"]
    tables: dict[str, torch.Tensor] = {"train_loss": h.train_loss}
    if h.val_loss is not None:
        tables["val_loss"] = h.val_loss
    tables.update(h.metrics or {})
    ran = torch.zeros(h.epochs, n, dtype=torch.bool)
    for e in range(h.epochs):
        ran[e] = (h.stopped_epoch == -1) | (h.stopped_epoch >= e)
    tables["lr"] = torch.tensor(truth["lr"], dtype=torch.float64).masked_fill(~ran, math.nan)
    want: dict[str, list[tuple[int, float]]] = {}
    for name, t in tables.items():
        for col in range(n):
            points = [(e, float(t[e, col])) for e in range(h.epochs) if ran[e, col]]
            points = [(e, v) for e, v in points if not math.isnan(v)]
            if points:
                want[f"{name}/member_{h.member_ids[col]}"] = points
        means = []
        for e in range(h.epochs):
            live = [float(v) for v in t[e][ran[e]] if not math.isnan(float(v))]
            if live:
                means.append((e, sum(live) / len(live)))
        if means:
            want[f"{name}/mean"] = means
    for name, t in (h.ensemble_metrics or {}).items():
        want[f"ensemble/{name}"] = [(e, float(t[e])) for e in range(h.epochs)]
    assert sorted(scalars) == sorted(want), (sorted(scalars), sorted(want))
    for tag, points in want.items():
        got = scalars[tag]
        assert [e for e, _ in got] == [e for e, _ in points], (tag, got, points)
        for (_, a), (_, b) in zip(got, points, strict=True):
            b32 = float(torch.tensor(b, dtype=torch.float32))
            assert (math.isnan(a) and math.isnan(b32)) or a == b32 or close(a, b32), (tag, a, b)


def check_bar(s: dict[str, Any], bar: str, h: vmapens.History, truth: dict) -> None:
    """The bar's last line: the epoch, the steps done of the planned total, who trains."""
    last = bar.replace("\n", "\r").strip("\r").split("\r")[-1]
    per = truth["per_epoch"]
    m = re.search(r"epoch (\d+)/(\d+): .*?\| *(\d+)/(\d+) ", last)
    assert m is not None, last
    assert [int(g) for g in m.groups()] == [h.epochs, s["epochs"], h.epochs * per,
                                             s["epochs"] * per], last  # fmt: skip
    assert f"training {truth['active']}/{s['n']}" in last, last


def check_round_trip(h: vmapens.History, out: Path) -> None:
    torch.save(h.state_dict(), out / "history.pt")
    back = vmapens.History.empty([0] * len(h.member_ids), h.val_loss is not None)
    back.load_state_dict(torch.load(out / "history.pt", weights_only=True))
    assert_same_history(back, h)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's warnings on NaN-only curves too
        h.plot(out / "history.png", title="fuzz")
    assert (out / "history.png").stat().st_size > 0


def assert_same_history(a: vmapens.History, b: vmapens.History) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        x, y = sa[key], sb[key]
        if isinstance(x, dict):
            assert x.keys() == y.keys(), key
            for k in x:
                torch.testing.assert_close(x[k], y[k], rtol=0, atol=0, equal_nan=True)
        elif isinstance(x, torch.Tensor):
            torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
        else:
            assert x == y, key


def run_case(seed: int, out: Path) -> None:
    s = draw(seed)
    batches, val = make_data(s)
    truth = plain_run(s, batches, val)
    got = run_fit(s, batches, val, out, "straight")
    h = got["history"]
    check_history(s, h, truth)
    for i, m in enumerate(truth["models"]):
        member = got["ens"].unstack()[i].state_dict()
        for k, v in m.state_dict().items():
            torch.testing.assert_close(member[k], v, equal_nan=True, **TOL64)
    check_csv(s, out / "straight.csv", h, truth)
    if s["tensorboard"]:
        check_tensorboard(s, tensorboard_scalars(out / "straight.tb"), h, truth)
    check_bar(s, got["bar"], h, truth)
    check_round_trip(h, out)
    if not s["resume"]:
        return
    first = run_fit(s, batches, val, out, "resumed", interrupt=s["interrupt"])
    if first["history"] is not None:  # every member stopped before the interrupt
        return
    if s["tensorboard"]:
        # TensorBoard orders a directory's event files by name: the creation second, then a
        # per-process counter written unpadded (".9" after ".10"). Two runs of one process in
        # one second can sort the resumed file first, and its reader then drops the later
        # epochs as out of order. Runs in separate processes, or seconds apart, sort in time.
        time.sleep(1.01 - time.time() % 1)
    again = run_fit(s, batches, val, out, "resumed")
    assert_same_history(again["history"], h)
    assert (out / "resumed.csv").read_text() == (out / "straight.csv").read_text()
    if s["tensorboard"]:
        assert tensorboard_scalars(out / "resumed.tb") == tensorboard_scalars(out / "straight.tb")
    check_bar(s, again["bar"], h, truth)


# -- the bugs the search found, each alone -----------------------------------------------------


def _two_members(out: Path, callbacks: list, epochs: int = 3, **kw: Any) -> vmapens.History:
    """Member 1 stops after epoch 0 (patience 1, its validation loss never improves on it)."""
    g = torch.Generator().manual_seed(0)
    x, y = (
        torch.randn(6, 3, generator=g, dtype=torch.float64),
        torch.zeros(6, 2, dtype=torch.float64),
    )
    ens = vmapens.Ensemble(factory, n=2, seed=0)
    return vmapens.fit(ens, [(x, y)], nn.MSELoss(), epochs=epochs, val_data=(x, y),
                       optimizer=vmapens.StackedSGD, lr=[0.01, 5.0], patience=1,
                       progress=False, callbacks=callbacks, **kw)  # fmt: skip


def test_tensorboard_writes_no_learning_rate_for_a_stopped_member(tmp_path: Path) -> None:
    # Truth: the docs: members that did not train in an epoch are not written for it; the
    # stopped member's lr was written every epoch, and lr/mean averaged it in.
    pytest.importorskip("tensorboard")
    logger = TensorBoardLogger(tmp_path / "tb")
    h = _two_members(tmp_path, [logger])
    logger.close()
    assert h.stopped_epoch.tolist()[1] >= 0 and h.epochs > h.stopped_epoch[1] + 1
    scalars = tensorboard_scalars(tmp_path / "tb")
    last = int(h.stopped_epoch[1])
    assert [e for e, _ in scalars["lr/member_1"]] == list(range(last + 1))
    assert [e for e, _ in scalars["train_loss/member_1"]] == list(range(last + 1))
    assert [v for e, v in scalars["lr/mean"] if e > last] == [pytest.approx(0.01)] * (
        h.epochs - last - 1
    )


def test_tensorboard_shows_each_epoch_once_across_a_resume(tmp_path: Path) -> None:
    # The interrupting callback runs after the logger, before the checkpoint: epoch 1 was
    # logged, then redone by the resumed run. Truth: the uninterrupted run's scalars.
    pytest.importorskip("tensorboard")

    def run(name: str, interrupt: int | None) -> None:
        logger = TensorBoardLogger(tmp_path / f"{name}.tb")
        try:
            _two_members(tmp_path, [logger, Interrupt(interrupt)], epochs=4,
                         checkpoint=tmp_path / f"{name}.pt")  # fmt: skip
        except KeyboardInterrupt:
            pass
        finally:
            logger.close()

    run("straight", None)
    run("resumed", 1)
    run("resumed", None)
    straight = tensorboard_scalars(tmp_path / "straight.tb")
    assert straight["val_loss/member_0"][-1][0] == 3
    assert tensorboard_scalars(tmp_path / "resumed.tb") == straight


def test_plot_frames_a_member_about_to_diverge(tmp_path: Path) -> None:
    # A member whose weights overflowed scores ~1e299 before its loss turns inf: a log axis
    # framing that overflowed in matplotlib (a RuntimeWarning, an error under -W error).
    h = vmapens.History.empty([0, 1], validated=True, metrics=["mae"])
    h.train_loss = torch.tensor([[1.0, 1.2], [0.5, math.inf]], dtype=torch.float64)
    h.val_loss = torch.tensor([[1.0, 1e299], [0.5, math.nan]], dtype=torch.float64)
    assert h.metrics is not None and h.ensemble_metrics is not None
    h.metrics["mae"] = h.val_loss.clone()
    h.ensemble_metrics["mae"] = torch.tensor([5e298, 0.5], dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        h.plot(tmp_path / "h.png")
        h.stopped_epoch = torch.tensor([0, 0])  # and members that stopped at epoch 0
        h.train_loss[1:] = math.nan
        h.plot(tmp_path / "h0.png")
    assert (tmp_path / "h.png").stat().st_size > 0


def test_resumed_bar_says_where_the_checkpoint_ended(tmp_path: Path) -> None:
    # Every member stopped by the checkpoint: the resumed run has no epoch left, and its bar
    # showed a count with no epoch and no "training 0/2". Truth: the uninterrupted run's line.
    def run(stream: io.StringIO, interrupt: int | None) -> None:
        def observer(history: vmapens.History) -> None:
            if history.epochs - 1 == interrupt:
                raise KeyboardInterrupt

        g = torch.Generator().manual_seed(0)
        x = torch.randn(6, 3, generator=g, dtype=torch.float64)
        ens = vmapens.Ensemble(factory, n=2, seed=0)
        with contextlib.suppress(KeyboardInterrupt):
            vmapens.fit(ens, [(x, torch.zeros(6, 2, dtype=torch.float64))], nn.MSELoss(),
                        epochs=5, val_data=(x, x[:, :2]), optimizer=vmapens.StackedSGD,
                        lr=[5.0, 5.0], patience=1, progress=stream, callbacks=[observer],
                        checkpoint=tmp_path / "ck.pt")  # fmt: skip

    first, resumed = io.StringIO(), io.StringIO()
    run(first, 1)
    assert "training 0/2" in first.getvalue()
    run(resumed, None)
    last = resumed.getvalue().replace("\n", "\r").strip("\r").split("\r")[-1]
    assert re.search(r"epoch 2/5: .*\| *2/5 .*training 0/2", last), last


@pytest.mark.parametrize("seed", range(8))
def test_fuzz_history(seed: int, tmp_path: Path) -> None:
    run_case(seed, tmp_path)


if __name__ == "__main__":
    search(run_case, draw)
