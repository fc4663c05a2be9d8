"""fit against the truth: each member trained alone with torch.optim.Adam on the same batches."""

from __future__ import annotations

import copy
import io
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import models
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from truth import adam, assert_bit_identical, resample, train_alone

import vmapens
from bench import mlp
from vmapens import History
from vmapens.callbacks import EarlyStopping
from vmapens.callbacks.scheduler import attached_scheduler

# One tolerance for every member-vs-twin comparison (float64 throughout).
TOL = dict(rtol=1e-9, atol=1e-10)
N = 4
F64 = dict(dtype=torch.float64)


def regression(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 4, generator=g, **F64), torch.randn(rows, 3, generator=g, **F64)


X, Y = regression(20, 1)
XV, YV = regression(12, 2)
XA, YA = (
    torch.randn(5, 2, generator=torch.Generator().manual_seed(3), **F64),
    torch.ones(5, 1, **F64),
)


def slices(x, y, size):
    return [(x[k : k + size], y[k : k + size]) for k in range(0, len(x), size)]


@dataclass
class Case:
    id: str
    factory: Callable[[], nn.Module]
    loss: Callable
    data: Callable[[], Any]
    options: dict
    # The naive batches of member i (global index), in training order.
    plan: Callable[[int], list]
    lr: Any = 1e-3
    own_optimizer: bool = False


def cycle(batches, count):
    return [batches[k % len(batches)] for k in range(count)]


CASES = [
    Case("workload-a-steps", mlp, nn.BCELoss(), lambda: (XA, YA), dict(steps=100),
         lambda i: [(XA, YA)] * 100),
    Case("workload-a-epochs", mlp, nn.BCELoss(), lambda: (XA, YA), dict(epochs=100),
         lambda i: [(XA, YA)] * 100),
    Case("minibatches-in-order", models.MLP, nn.MSELoss(), lambda: (X, Y),
         dict(epochs=3, batch_size=6, shuffle=False), lambda i: slices(X, Y, 6) * 3,
         lr=[1e-3, 3e-3, 1e-2, 3e-2]),
    Case("dataloader", models.MLP, nn.MSELoss(),
         lambda: DataLoader(TensorDataset(X, Y), batch_size=6), dict(epochs=3),
         lambda i: slices(X, Y, 6) * 3, own_optimizer=True, lr=1e-2),
    Case("steps-cycle-over-passes", models.MLP, nn.MSELoss(), lambda: (X, Y),
         dict(epochs=3, steps=5, batch_size=6, shuffle=False),
         lambda i: cycle(slices(X, Y, 6), 15), lr=1e-2),
    Case("bootstrap", models.MLP, nn.MSELoss(), lambda: (X, Y),
         dict(epochs=4, bootstrap=True, seed=7),
         lambda i: [(X[resample(20, 7, i)], Y[resample(20, 7, i)])] * 4,
         own_optimizer=True, lr=[1e-3, 3e-3, 1e-2, 3e-2]),
]  # fmt: skip


def member_lr(lr, i):
    return lr[i] if isinstance(lr, list) else lr


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_fit_matches_members_trained_alone(case: Case):
    twins = [case.factory().double() for _ in range(N)]
    ens = vmapens.Ensemble.from_modules([copy.deepcopy(m) for m in twins])
    opt = vmapens.StackedAdam(ens, lr=case.lr) if case.own_optimizer else None
    options = dict(optimizer=opt) if opt else dict(lr=case.lr)
    history = vmapens.fit(ens, case.data(), case.loss, progress=False, **options, **case.options)

    rows = case.options.get("epochs", 1)
    assert history.train_loss.shape == (rows, N) and history.val_loss is None
    assert torch.isfinite(history.train_loss).all()
    for i, (member, twin) in enumerate(zip(ens.unstack(), twins, strict=True)):
        alone = train_alone(twin, case.plan(i), case.loss, adam(member_lr(case.lr, i)))
        torch.testing.assert_close(member.state_dict(), twin.state_dict(), **TOL)
        if opt is not None:
            ours = opt.member_state_dict(i)["state"]
            for k, state in alone.state_dict()["state"].items():
                for key in ("exp_avg", "exp_avg_sq"):
                    torch.testing.assert_close(ours[k][key], state[key], **TOL)


def test_shuffle_is_reproducible_from_seed():
    def run(**kw):
        ens = vmapens.Ensemble(models.MLP, n=N, seed=0).double()
        vmapens.fit(
            ens, (X, Y), nn.MSELoss(), epochs=2, batch_size=6, lr=1e-2, progress=False, **kw
        )
        return ens.state_dict()

    a, b = run(seed=1), run(seed=1)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    for other in (run(seed=2), run(seed=1, shuffle=False)):
        assert not torch.equal(a["fc1.weight"], other["fc1.weight"])


def test_bootstrap_is_keyed_by_global_member_index():
    """A shard holding members 2..3 trains them exactly as the full ensemble does."""
    full = vmapens.Ensemble(models.MLP, n=N, seed=0).double()
    shard = vmapens.Ensemble.from_modules(full.unstack()[2:])
    shard.member_ids, shard.n_total = range(2, 4), N
    options = dict(epochs=2, batch_size=8, bootstrap=True, seed=3, lr=1e-2, progress=False)
    vmapens.fit(full, (X, Y), nn.MSELoss(), **options)
    history = vmapens.fit(shard, (X, Y), nn.MSELoss(), **options)
    assert history.member_ids == [2, 3]
    for ours, theirs in zip(shard.unstack(), full.unstack()[2:], strict=True):
        torch.testing.assert_close(ours.state_dict(), theirs.state_dict(), **TOL)


def snapshots(ens, opt, into):
    def record(history: History) -> None:
        into.append((copy.deepcopy(ens.state_dict()), copy.deepcopy(opt.state_dict()["state"])))

    return record


def test_early_stopping_freezes_each_member_and_restores_its_best():
    ens = vmapens.Ensemble(models.MLP, n=N, seed=0).double()
    opt = vmapens.StackedAdam(ens, lr=[1e-3, 1e-2, 3e-2, 1e-1])
    taken: list = []
    h = vmapens.fit(ens, (X[:12], Y[:12]), nn.MSELoss(), epochs=16, optimizer=opt, val_data=(XV, YV),
                patience=3, progress=False, seed=0, callbacks=[snapshots(ens, opt, taken)])  # fmt: skip

    stopped = h.stopped_epoch.tolist()
    assert stopped[0] == -1 and len(set(stopped)) >= 3, stopped  # different epochs
    assert h.epochs == len(taken) == 16 and not h.diverged.any()
    for i, s in enumerate(stopped):
        if s < 0:
            continue
        assert (
            torch.isnan(h.train_loss[s + 1 :, i]).all()
            and torch.isnan(h.val_loss[s + 1 :, i]).all()
        )
        assert torch.isfinite(h.val_loss[: s + 1, i]).all()
        assert int(h.val_loss[: s + 1, i].argmin()) == h.best_epoch[i] == s - 3
        frozen_params, frozen_opt = taken[s]
        for params, state in taken[s + 1 :]:  # bit-identical while the others train on
            for key, t in params.items():
                assert torch.equal(t[i], frozen_params[key][i]), key
            for k, moments in state.items():
                for key, t in moments.items():
                    assert torch.equal(t[i], frozen_opt[k][key][i]), (k, key)
    # The member that never stopped kept moving every epoch.
    assert not torch.equal(taken[-1][0]["fc1.weight"][0], taken[-2][0]["fc1.weight"][0])
    final = ens.state_dict()
    for i, best in enumerate(h.best_epoch.tolist()):
        for key, t in final.items():
            assert torch.equal(t[i], taken[best][0][key][i]), (i, key)


def test_without_restore_best_members_keep_their_last_weights():
    ens = vmapens.Ensemble(models.MLP, n=N, seed=0).double()
    opt = vmapens.StackedAdam(ens, lr=[1e-3, 1e-2, 3e-2, 1e-1])
    taken: list = []
    h = vmapens.fit(ens, (X[:12], Y[:12]), nn.MSELoss(), epochs=16, optimizer=opt, val_data=(XV, YV),
                progress=False, seed=0,
                callbacks=[EarlyStopping(patience=3, restore_best=False), snapshots(ens, opt, taken)])  # fmt: skip
    assert (h.best_epoch < h.epochs - 1).any()
    torch.testing.assert_close(ens.state_dict(), taken[-1][0], rtol=0, atol=0)


def test_validation_runs_in_eval_mode_and_restores_train_mode():
    class ModeSpy(models.MLP):
        def forward(self, x):
            out = super().forward(x)
            return out if self.training else out * 0  # eval: constant loss, never improves

    ens = vmapens.Ensemble(ModeSpy, n=2, seed=0).double()
    h = vmapens.fit(ens, (X, Y), nn.MSELoss(), epochs=3, val_data=(XV, YV), progress=False, seed=0)
    torch.testing.assert_close(h.val_loss, (YV**2).mean().expand(3, 2), **TOL)
    assert ens.training and h.best_epoch.tolist() == [0, 0]


def test_diverged_member_is_frozen_and_others_run_as_without_it():
    ens = vmapens.Ensemble(models.MLP, n=N, seed=0).double()
    rest = vmapens.Ensemble.from_modules([m for i, m in enumerate(ens.unstack()) if i != 2])
    options = dict(epochs=4, steps=3, batch_size=8, seed=5, progress=False, val_data=(XV, YV))
    h = vmapens.fit(ens, (X, Y), nn.MSELoss(), lr=[1e-2, 1e-2, 1e200, 1e-2], **options)
    alone = vmapens.fit(rest, (X, Y), nn.MSELoss(), lr=1e-2, **options)

    assert h.diverged.tolist() == [False, False, True, False]
    assert h.stopped_epoch.tolist() == [-1, -1, 0, -1]
    assert not torch.isfinite(h.train_loss[0, 2]) and torch.isnan(h.train_loss[1:, 2]).all()
    keep = [0, 1, 3]
    torch.testing.assert_close(h.train_loss[:, keep], alone.train_loss, **TOL)
    for ours, theirs in zip([ens[i] for i in keep], rest.unstack(), strict=True):
        torch.testing.assert_close(ours.state_dict(), theirs.state_dict(), **TOL)


def test_callbacks_see_the_history_so_far():
    seen = []
    ens = vmapens.Ensemble(models.MLP, n=2, seed=0).double()
    vmapens.fit(
        ens,
        (X, Y),
        nn.MSELoss(),
        epochs=3,
        progress=False,
        callbacks=[lambda h: seen.append(h.epochs)],
    )
    assert seen == [1, 2, 3]


def test_progress_bar_text_goes_to_a_given_stream(capsys):
    stream = io.StringIO()
    ens = vmapens.Ensemble(models.MLP, n=3, seed=0).double()
    vmapens.fit(ens, (X, Y), nn.MSELoss(), epochs=2, batch_size=10, progress=stream, seed=0)
    text = stream.getvalue().split("\r")[-1]
    assert "epoch 2/2" in text and "4/4" in text and "training 3/3" in text, text
    assert "loss " in text and "min " in text and "max " in text, text
    # Pytest's captured stderr is not a terminal: progress=True stays quiet, as does False.
    for progress in (True, False):
        vmapens.fit(ens, (X, Y), nn.MSELoss(), epochs=2, progress=progress, seed=0)
    assert capsys.readouterr().err == ""


def test_plot_writes_a_png_of_the_expected_size(tmp_path):
    image = pytest.importorskip("matplotlib.image")
    ens = vmapens.Ensemble(models.MLP, n=3, seed=0).double()
    h = vmapens.fit(ens, (X, Y), nn.MSELoss(), epochs=3, val_data=(XV, YV), progress=False, seed=0)
    path = h.plot(tmp_path / "history.png", title="three members")
    assert image.imread(path).shape[:2] == (400, 1000)


def test_plot_without_matplotlib_says_how_to_get_it(monkeypatch, tmp_path):
    h = History.empty([0, 1], validated=False)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install 'vmapens\[plot\]'"):
        h.plot(tmp_path / "h.png")


def test_history_state_dict_round_trip():
    ens = vmapens.Ensemble(models.MLP, n=2, seed=0).double()
    h = vmapens.fit(ens, (X, Y), nn.MSELoss(), epochs=2, val_data=(XV, YV), progress=False, seed=0)
    other = History.empty([0, 1], validated=True)
    other.load_state_dict(h.state_dict())
    assert other.epochs == 2 and torch.equal(other.val_loss, h.val_loss)
    with pytest.raises(ValueError, match=r"History.load_state_dict: history `best_epoch`"):
        other.load_state_dict({**h.state_dict(), "best_epoch": torch.zeros(3)})
    assert other.best_epoch.shape == (2,)


def one_shot():
    return iter([(X, Y)])


BAD = [
    ("zero-epochs", dict(epochs=0), ValueError, r"fit: `epochs` must be >= 1, got 0"),
    ("float-steps", dict(steps=2.0), TypeError, r"fit: `steps` must be an int"),
    ("patience-no-val", dict(patience=2), ValueError, r"`patience` needs `val_data`"),
    ("patience-torch-adam", dict(patience=2, val_data=(XV, YV), optimizer="adam"), TypeError,
     r"StackedOptimizer's mask, got Adam"),
    ("bootstrap-iterable", dict(data=[(X, Y)], bootstrap=True), ValueError,
     r"`bootstrap=True` needs `data` as an \(X, Y\)"),
    ("one-shot-iterator", dict(data=one_shot()), TypeError, r"must be re-iterable"),
    ("lr-and-optimizer", dict(lr=0.1, optimizer="adam"), ValueError, r"`lr` configures"),
    ("bad-progress", dict(progress=42), TypeError, r"`progress` must be True, False or a text"),
    ("bad-callback", dict(callbacks=[3]), TypeError, r"`callbacks\[0\]` must be callable"),
    ("bad-val", dict(val_data=[XV, YV]), ValueError, r"`val_data` must be an \(X, Y\)"),
    ("ragged-data", dict(data=(X, Y[:5])), ValueError, r"same number of samples"),
]  # fmt: skip


@pytest.mark.parametrize("options,exc,match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_arguments_raise_clearly_and_change_nothing(options, exc, match):
    ens = vmapens.Ensemble(models.MLP, n=2, seed=0).double()
    before = copy.deepcopy(ens.state_dict())
    if options.get("optimizer") == "adam":
        options["optimizer"] = torch.optim.Adam(ens.parameters())
    options = {"data": (X, Y), **options}
    with pytest.raises(exc, match=match):
        vmapens.fit(ens, options.pop("data"), nn.MSELoss(), **options)
    torch.testing.assert_close(ens.state_dict(), before, rtol=0, atol=0)


def trained(lr: Any = 1e-2) -> tuple[vmapens.Ensemble, vmapens.StackedAdam]:
    """An ensemble and its optimizer after one epoch: optimizer state to keep."""
    ens = vmapens.Ensemble(models.MLP, n=N, seed=0).double()
    opt = vmapens.StackedAdam(ens, lr=lr)
    vmapens.fit(ens, (X, Y), nn.MSELoss(), optimizer=opt, batch_size=5, progress=False, seed=0)
    return ens, opt


def loaders(*rows: int) -> list[DataLoader]:
    return [DataLoader(TensorDataset(X[:r], Y[:r]), batch_size=4, shuffle=True) for r in rows]


# Calls refused by a check of `data` or `val_data` that ran after the scheduler was built on the
# optimizer and the seed drawn; the last, by a callback once fit has taken in a DataLoader.
REFUSED = [
    ("ragged-data", dict(data=(X, Y[:19])), ValueError, r"same number of samples \(dim 0\)"),
    ("no-samples", dict(data=(X[:0], Y[:0])), ValueError, r"`data` has no samples"),
    ("val-too-narrow", dict(val_data=(XV[:, :3], YV)), ValueError, r"`val_data` does not fit"),
    ("one-shot-iterator", dict(data=one_shot()), TypeError, r"must be re-iterable"),
    ("member-loaders-differ", dict(data=loaders(20, 20, 12, 20), in_dims=0), ValueError,
     r"same number of batches per pass"),
    ("loader-then-callback-refuses", dict(data=loaders(20)[0], callbacks=[EarlyStopping()]),
     ValueError, r"`EarlyStopping` \(monitor 'val_loss'\) needs `val_data`"),
]  # fmt: skip


@pytest.mark.parametrize("options,exc,match", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_refused_fit_leaves_optimizer_and_global_rng_as_they_were(options, exc, match):
    """docs/fit.md, Failure semantics: bad arguments change nothing. Here a scheduler builder
    (which sets the lr and adds `initial_lr`) and `seed=None` (a seed drawn from the global
    RNG) must not have run when the call is refused."""
    ens, opt = trained(lr=[1e-3, 2e-3, 3e-3, 4e-3])
    ens_before, opt_before = copy.deepcopy(ens.state_dict()), copy.deepcopy(opt.state_dict())
    rng = torch.get_rng_state()
    options = {"data": (X, Y), **options}
    if isinstance(options["data"], tuple):  # batch_size cuts tensors only
        options["batch_size"] = 4
    with pytest.raises(exc, match=f"^fit: .*{match}"):
        vmapens.fit(ens, options.pop("data"), nn.MSELoss(), optimizer=opt, epochs=2,
                    scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 0.1),
                    seed=None, progress=False, **options)  # fmt: skip
    assert_bit_identical(opt.state_dict(), opt_before)  # param_groups (lr, no initial_lr), state
    assert not attached_scheduler(opt)  # else a later fit(checkpoint=...) would refuse it
    assert torch.equal(torch.get_rng_state(), rng)
    assert_bit_identical(ens.state_dict(), ens_before)


def mae(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).abs().mean()


class PerColumn:
    """A metric object (reset/update/compute) giving one value per output column."""

    def reset(self) -> None:
        self.value = torch.zeros(0)

    def update(self, out: torch.Tensor, target: torch.Tensor) -> None:
        self.value = (out - target).abs().mean(0)

    def compute(self) -> torch.Tensor:
        return self.value


# A metric that cannot give one real scalar per member, the error, and what it chains.
BAD_METRICS = [
    ("bool-mean", lambda o, t: (o > t).mean(), ValueError,
     r"failed on `val_data` .*mean\(\): could not infer output dtype", RuntimeError),
    ("raises-type-error", lambda o, t: o.argmax(-1, "last"), TypeError,
     r"failed on `val_data`", TypeError),
    ("vector-per-member", lambda o, t: (o - t).abs().mean(0), ValueError,
     r"must return a real scalar .*, got a torch.float64 tensor of shape \(3,\) for each member",
     None),
    ("complex", lambda o, t: (o - t).abs().mean().to(torch.complex128), ValueError,
     r"must return a real scalar .*, got a torch.complex128 tensor of shape \(\)", None),
    ("object-vector", PerColumn(), ValueError,
     r"must return .* tensor of shape \(3,\) for each member", None),
]  # fmt: skip


@pytest.mark.parametrize(
    "metric,exc,match,cause", [b[1:] for b in BAD_METRICS], ids=[b[0] for b in BAD_METRICS]
)
def test_a_metric_that_cannot_run_fails_before_training_naming_it(metric, exc, match, cause):
    """fit checks every metric on val_data with the loss, before the first step: an error that
    names it (not torch's, after an epoch), and the ensemble and optimizer unchanged."""
    ens, opt = trained()
    ens_before, opt_before = copy.deepcopy(ens.state_dict()), copy.deepcopy(opt.state_dict())
    steps = []

    class CountSteps(vmapens.Callback):
        def on_step_end(self, ctx):
            steps.append(ctx.step)

    with pytest.raises(exc, match=rf"^fit: `metrics\['bad'\]` {match}") as caught:
        vmapens.fit(ens, (X, Y), nn.MSELoss(), optimizer=opt, epochs=2, batch_size=5,
                    val_data=(XV, YV), metrics={"mae": mae, "bad": metric},
                    callbacks=[CountSteps()], seed=0, progress=False)  # fmt: skip
    assert type(caught.value.__cause__) is (cause or type(None))
    assert steps == []
    assert_bit_identical(ens.state_dict(), ens_before)
    assert_bit_identical(opt.state_dict(), opt_before)


def test_metrics_of_a_real_dtype_are_recorded_per_member_and_for_the_mean():
    """What the check lets through still runs: float, int and bool scalars, as float64."""
    metrics = {
        "mae": mae,
        "hits": lambda o, t: ((o - t).abs() < 1).sum(),
        "bounded": lambda o, t: (o.abs() < 1e3).all(),
    }
    ens, opt = trained()
    history = vmapens.fit(
        ens,
        (X, Y),
        nn.MSELoss(),
        optimizer=opt,
        epochs=2,
        batch_size=5,
        val_data=(XV, YV),
        metrics=metrics,
        seed=0,
        progress=False,
        callbacks=[EarlyStopping(restore_best=False)],  # the last epoch's members
    )
    with torch.no_grad():
        out = ens(XV)
    for name, fn in metrics.items():
        members = torch.stack([fn(o, YV) for o in out]).double()
        assert history.metrics[name].shape == (2, N) and history.metrics[name].dtype == F64["dtype"]
        torch.testing.assert_close(history.metrics[name][-1], members, **TOL)
        torch.testing.assert_close(
            history.ensemble_metrics[name][-1], fn(out.mean(0), YV).double(), **TOL
        )
    assert history.metrics["hits"][-1].sum() > 0 and bool(history.metrics["bounded"].all())


def test_compiled_fit_equals_eager_fit():
    """fit(compile=True) runs the one-graph step, masks included (early stopping, bagging)."""

    def run(compile: bool):
        ens = vmapens.Ensemble(models.MLP, N, seed=0).double()
        history = vmapens.fit(
            ens,
            (X, Y),
            nn.MSELoss(),
            epochs=4,
            batch_size=5,
            bootstrap=True,
            val_data=(XV, YV),
            patience=1,
            lr=[1e-3, 1e-2, 1e-1, 3e-1],
            seed=0,
            progress=False,
            compile=compile,
        )
        return ens, history

    eager, h_eager = run(False)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled, h_compiled = run(True)
    # One graph: members stopping mid-run (a mask from then on) must not compile it again.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == before + 1
    torch.testing.assert_close(compiled.state_dict(), eager.state_dict(), **TOL)
    torch.testing.assert_close(h_compiled.train_loss, h_eager.train_loss, equal_nan=True, **TOL)
    assert torch.equal(h_compiled.stopped_epoch, h_eager.stopped_epoch)
    assert (h_eager.stopped_epoch >= 0).any(), "no member stopped: the mask path went untested"


def test_compiled_fit_follows_a_per_step_scheduler_on_a_shared_lr():
    """fit(compile=True) with LRScheduler(interval="step") on a float lr, 12 steps: no
    recompile (it failed at the 9th), the same as the eager fit."""

    def run(compile: bool):
        ens = vmapens.Ensemble(models.MLP, N, seed=0).double()
        opt = vmapens.StackedAdam(ens, lr=0.05)
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.8)
        vmapens.fit(ens, (X, Y), nn.MSELoss(), epochs=3, batch_size=5, optimizer=opt,
                    callbacks=[vmapens.callbacks.LRScheduler(sched, interval="step")],
                    seed=0, progress=False, compile=compile)  # fmt: skip
        return ens, opt

    eager, opt_e = run(False)
    compiled, opt_c = run(True)
    torch.testing.assert_close(compiled.state_dict(), eager.state_dict(), **TOL)
    assert opt_c.param_groups[0]["lr"] == opt_e.param_groups[0]["lr"] == 0.05 * 0.8**12


@pytest.mark.parametrize("lr", [1e-3, torch.tensor(1e-3)], ids=["float-lr", "tensor-lr"])
def test_refused_resume_leaves_the_optimizer_as_it_was(tmp_path, lr):
    # The scheduler is built on the optimizer before the resume check can refuse the run (it
    # compares the built scheduler's settings): what it set is given back. A tensor `lr` is
    # the same tensor afterwards, with its value (torch's schedulers fill_ it).
    ck = tmp_path / "ck.pt"
    vmapens.fit(vmapens.Ensemble(models.MLP, n=N, seed=0).double(), (X, Y), nn.MSELoss(),
                batch_size=5, seed=0, progress=False, checkpoint=ck)  # fmt: skip
    ens = vmapens.Ensemble(models.MLP, n=N, seed=0).double()
    opt = vmapens.StackedAdam(ens, lr=lr)
    held, opt_before = copy.deepcopy(ens.state_dict()), copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=r"batch_size"):
        vmapens.fit(ens, (X, Y), nn.MSELoss(), optimizer=opt, batch_size=4, seed=0,
                    scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 0.1),
                    progress=False, checkpoint=ck)  # fmt: skip
    assert_bit_identical(opt.state_dict(), opt_before)  # lr, no initial_lr
    assert opt.param_groups[0]["lr"] is lr or not isinstance(lr, torch.Tensor)
    assert not attached_scheduler(opt)  # opt.step is the optimizer's own again
    assert_bit_identical(ens.state_dict(), held)
