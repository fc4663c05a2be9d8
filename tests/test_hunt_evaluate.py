"""fit's validation rows, metric names, divergence and schedulers, against plain torch.

Every member is checked against a plain module trained alone by a plain torch loop on the same
batches in the same order (``shuffle=False``), validated in eval mode under ``no_grad`` after
each epoch, as docs/fit.md describes.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as sched
from truth import derived_seed, seeded_members

import vmapens
from vmapens.callbacks import EarlyStopping, LRScheduler
from vmapens.sweep import Sweep

F64 = dict(dtype=torch.float64)
TOL = dict(rtol=1e-9, atol=1e-10)
G = torch.Generator().manual_seed(0)
X = torch.randn(32, 3, generator=G, **F64)
Y = (X[:, 0] > 0).long()
XV = torch.randn(16, 3, generator=G, **F64)
YV = (XV[:, 0] > 0).long()
BATCH = 8
HUGE = 1e300  # SGD's first step takes the weights past float64: the next loss is inf/NaN


def classifier() -> nn.Module:
    return nn.Linear(3, 2).double()


def overflowing(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy plus the outputs' square: non-finite once the weights blow up (plain
    cross-entropy of huge logits stays finite, so a huge rate alone never diverges)."""
    return nn.functional.cross_entropy(out, y) + out.pow(2).mean()


def accuracy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.argmax(-1) == y).double().mean()


def plain_run(models: list[nn.Module], lrs: list[float], epochs: int) -> dict[str, Any]:
    """Each model alone with torch.optim.SGD on fit's batches (in order), frozen after the
    step whose loss is not finite; each epoch's mean loss, and its validation loss and
    accuracy on the weights at the epoch's end."""
    opts = [torch.optim.SGD(m.parameters(), lr=lr) for m, lr in zip(models, lrs, strict=True)]
    frozen = [False] * len(models)
    rows: dict[str, list[list[float]]] = {"train": [], "val": [], "acc": []}
    diverged_in: list[int | None] = [None] * len(models)
    for epoch in range(epochs):
        train, val, acc = [], [], []
        for i, (m, opt) in enumerate(zip(models, opts, strict=True)):
            losses = []
            for start in range(0, len(X), BATCH):
                x, y = X[start : start + BATCH], Y[start : start + BATCH]
                loss = overflowing(m(x), y)
                losses.append(float(loss.detach()))
                if frozen[i]:
                    continue
                opt.zero_grad()
                loss.backward()
                opt.step()
                if not math.isfinite(losses[-1]):
                    frozen[i], diverged_in[i] = True, epoch
            train.append(sum(losses) / len(losses))
            with torch.no_grad():
                out = m.eval()(XV)
            m.train()
            val.append(float(overflowing(out, YV)))
            acc.append(float(accuracy(out, YV)))
        rows["train"].append(train)
        rows["val"].append(val)
        rows["acc"].append(acc)
    t = {k: torch.tensor(v, **F64) for k, v in rows.items()}
    return {**t, "diverged_in": diverged_in}


def test_the_epoch_a_member_diverged_in_is_no_score() -> None:
    # Evaluator.record wrote the validation loss and metrics of a member in the epoch it
    # diverged in: an accuracy of the NaN weights the bad step left (argmax of NaN is a
    # number), which selection skipped but Sweep, PBT and the History listed as a score.
    lrs, epochs = [0.1, HUGE], 3
    truth = plain_run(seeded_members(classifier, 2), lrs, epochs)
    assert truth["diverged_in"] == [None, 0]  # it really diverges: its loss is not finite
    assert math.isfinite(truth["acc"][0, 1])  # and its accuracy then is a number
    ens = vmapens.Ensemble(classifier, n=2, seeds=[0, 1])
    h = vmapens.fit(ens, (X, Y), overflowing, epochs=epochs, batch_size=BATCH, shuffle=False,
                    optimizer=vmapens.StackedSGD, lr=lrs, val_data=(XV, YV),
                    metrics={"acc": accuracy}, progress=False, seed=0)  # fmt: skip
    assert h.diverged.tolist() == [False, True] and h.stopped_epoch.tolist() == [-1, 0]
    assert h.metrics is not None and h.val_loss is not None
    torch.testing.assert_close(h.train_loss[:, 0], truth["train"][:, 0], **TOL)
    torch.testing.assert_close(h.val_loss[:, 0], truth["val"][:, 0], **TOL)
    torch.testing.assert_close(h.metrics["acc"][:, 0], truth["acc"][:, 0], **TOL)
    assert not math.isfinite(h.train_loss[0, 1])  # docs/fit.md: non-finite where it diverged
    assert h.val_loss[:, 1].isnan().all() and h.metrics["acc"][:, 1].isnan().all()
    scores = vmapens.selection.member_scores(h, "val_acc", "max")
    assert scores[0] == truth["acc"][:, 0].max() and scores[1].isnan()


def test_a_sweep_lists_no_value_of_the_epoch_its_trial_diverged_in() -> None:
    # TrialResult.values listed the diverged epoch's accuracy while TrialResult.value skipped it.
    grid = {"lr": [0.1, HUGE]}
    sweep = Sweep(classifier, lambda t: {"lr": t.suggest_float("lr", 1e-3, 1.0)},
                  backend="grid", grid=grid, optimizer=vmapens.StackedSGD, monitor="val_acc",
                  mode="max")  # fmt: skip
    result = sweep.run((X, Y), overflowing, epochs=2, batch_size=BATCH, shuffle=False,
                       val_data=(XV, YV), metrics={"acc": accuracy}, progress=False)  # fmt: skip
    models = []
    for t in range(2):
        torch.manual_seed(derived_seed(0, "member", t))
        models.append(classifier())
    truth = plain_run(models, grid["lr"], 2)
    assert truth["diverged_in"] == [None, 0] and math.isfinite(truth["acc"][0, 1])
    good, bad = result.trials
    assert good.values == pytest.approx(truth["acc"][:, 0].tolist(), rel=1e-12)
    assert bad.values == [] and bad.state == "failed" and math.isnan(bad.value)


SHADOWING = [
    ({"loss": accuracy}, r"named 'loss': it would shadow the validation loss 'val_loss'"),
    ({"train_loss": accuracy}, r"named 'train_loss': it would shadow the History's training"),
    ({"val_loss": accuracy}, r"named 'val_loss': it would shadow the History's validation"),
    ({"lr": accuracy}, r"named 'lr': it would shadow the loggers' column 'lr'"),
    ({"acc": accuracy, "val_acc": accuracy}, r"names 'val_acc' and 'acc', but 'val_acc' is"),
    ({"acc": accuracy, "ensemble_acc": accuracy}, r"'ensemble_acc' is also how the loggers"),
]


@pytest.mark.parametrize(
    ("metrics", "message"), SHADOWING, ids=lambda v: "-".join(v) if isinstance(v, dict) else ""
)
def test_a_metric_name_that_shadows_a_table_is_refused_before_anything_changes(
    metrics: dict[str, Any], message: str
) -> None:
    ens = vmapens.Ensemble(classifier, n=2, seed=0)
    before = {k: t.clone() for k, t in ens.stacked_state().items()}
    rng = torch.get_rng_state()
    with pytest.raises(ValueError, match=r"^fit: `metrics` .*" + message):
        vmapens.fit(ens, (X, Y), nn.CrossEntropyLoss(), epochs=1, val_data=(XV, YV),
                    metrics=metrics, progress=False)  # fmt: skip
    assert all(torch.equal(t, before[k]) for k, t in ens.stacked_state().items())
    assert torch.equal(torch.get_rng_state(), rng)  # no seed drawn either


def test_a_sweep_refuses_a_shadowing_metric_before_asking_for_a_trial() -> None:
    sweep = Sweep(classifier, lambda t: {"lr": t.suggest_float("lr", 1e-3, 1.0)},
                  backend="random", seed=0)  # fmt: skip
    with pytest.raises(ValueError, match=r"^Sweep.run: `metrics` cannot hold a metric named"):
        sweep.run((X, Y), nn.CrossEntropyLoss(), n_trials=2, val_data=(XV, YV),
                  metrics={"loss": accuracy}, progress=False)  # fmt: skip
    result = sweep.run((X, Y), nn.CrossEntropyLoss(), n_trials=2, val_data=(XV, YV),
                       progress=False)  # fmt: skip
    assert [t.number for t in result.trials] == [0, 1]


def chained(opt: torch.optim.Optimizer) -> Any:
    return sched.ChainedScheduler([sched.StepLR(opt, 2), vmapens.optim.ReduceLROnPlateau(opt)])


def sequential(opt: torch.optim.Optimizer) -> Any:
    first = sched.LinearLR(opt, 0.5, total_iters=2)
    return sched.SequentialLR(opt, [first, vmapens.optim.ReduceLROnPlateau(opt)], milestones=[2])


def nested(opt: torch.optim.Optimizer) -> Any:
    return sched.SequentialLR(opt, [sched.ConstantLR(opt, 0.5, 1), chained(opt)], milestones=[1])


@pytest.mark.parametrize("build", [chained, sequential, nested], ids=lambda f: f.__name__)
@pytest.mark.parametrize("given", ["built", "builder"])
def test_a_plateau_inside_a_chain_is_refused_before_the_first_step(build: Any, given: str) -> None:
    # ChainedScheduler / SequentialLR step what they hold without a metric: the run failed
    # at the first epoch's end (TypeError / AttributeError), one epoch trained.
    ens = vmapens.Ensemble(classifier, n=2, seed=0)
    opt = vmapens.StackedSGD(ens, lr=[0.1, 0.2])
    scheduler = build(opt) if given == "built" else build
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    before = {k: t.clone() for k, t in ens.stacked_state().items()}
    with pytest.raises(ValueError, match=r"^fit: `scheduler` holds a ReduceLROnPlateau inside "
                                         r".*give vmapens.optim.ReduceLROnPlateau as `scheduler=` "
                                         r"on its own"):  # fmt: skip
        vmapens.fit(ens, (X, Y), nn.CrossEntropyLoss(), epochs=2, optimizer=opt,
                    scheduler=scheduler, val_data=(XV, YV), progress=False, seed=0)  # fmt: skip
    assert all(torch.equal(t, before[k]) for k, t in ens.stacked_state().items())
    if given == "builder":  # fit built it: fit gives the optimizer back as it was
        assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups


def test_the_way_out_the_error_gives_matches_plain_torch() -> None:
    # A plateau as `scheduler=` and a StepLR as a callback: each member's rate as a plain loop
    # stepping torch's ReduceLROnPlateau (on its validation loss), then StepLR, every epoch.
    lrs, epochs = [0.5, 0.05], 5
    models = seeded_members(classifier, 2)
    want = []
    for m, lr in zip(models, lrs, strict=True):
        opt = torch.optim.SGD(m.parameters(), lr=lr)
        plateau = sched.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=0.5)
        step = sched.StepLR(opt, 2, gamma=0.1)
        rates = []
        for _ in range(epochs):
            for start in range(0, len(X), BATCH):
                opt.zero_grad()
                nn.functional.cross_entropy(
                    m(X[start : start + BATCH]), Y[start : start + BATCH]
                ).backward()
                opt.step()
            with torch.no_grad():
                val = float(nn.functional.cross_entropy(m.eval()(XV), YV))
            m.train()
            plateau.step(val)
            step.step()
            rates.append(opt.param_groups[0]["lr"])
        want.append(rates)
    ens = vmapens.Ensemble(classifier, n=2, seeds=[0, 1])
    opt = vmapens.StackedSGD(ens, lr=lrs)
    seen: list[list[float]] = []
    vmapens.fit(ens, (X, Y), nn.CrossEntropyLoss(), epochs=epochs, batch_size=BATCH,
                shuffle=False, optimizer=opt, val_data=(XV, YV), progress=False, seed=0,
                scheduler=vmapens.optim.ReduceLROnPlateau(opt, factor=0.5, patience=0,
                                                          threshold=0.5),
                callbacks=[EarlyStopping(restore_best=False),
                           LRScheduler(sched.StepLR(opt, 2, gamma=0.1)),
                           lambda h: seen.append([float(v) for v in opt.param_groups[0]["lr"]])],
                )  # fmt: skip
    got = torch.tensor(seen, **F64)
    torch.testing.assert_close(got, torch.tensor(want, **F64).T, rtol=1e-12, atol=0)
    for m, got in zip(models, ens.unstack(), strict=True):
        for (name, a), b in zip(m.state_dict().items(), got.state_dict().values(), strict=True):
            torch.testing.assert_close(b, a, **TOL, msg=name)


def test_a_run_refused_by_its_first_step_gives_the_optimizer_and_rng_back() -> None:
    # The scheduler fit built on the user's optimizer had set its lr (LinearLR: half of it),
    # added initial_lr and wrapped opt.step when the first step refused data that does not
    # fit; the same call again with the right data trained with a quarter of the rate.
    lrs, epochs = [0.1, 0.2], 3
    models = seeded_members(classifier, 2)
    want = []
    for m, lr in zip(models, lrs, strict=True):
        opt = torch.optim.SGD(m.parameters(), lr=lr)
        linear = sched.LinearLR(opt, 0.5, total_iters=2)
        for _ in range(epochs):
            opt.zero_grad()
            nn.functional.cross_entropy(m(X), Y).backward()
            opt.step()
            linear.step()
        want.append(opt.param_groups[0]["lr"])
    ens = vmapens.Ensemble(classifier, n=2, seeds=[0, 1])
    opt = vmapens.StackedSGD(ens, lr=lrs)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    options = dict(optimizer=opt, scheduler=lambda o: sched.LinearLR(o, 0.5, total_iters=2),
                   epochs=epochs, progress=False)  # fmt: skip
    wide = torch.randn(32, 4, generator=G, **F64)  # a feature too many: the step refuses it
    rng = torch.get_rng_state()
    with pytest.raises(RuntimeError, match=r"^step: member 0 run alone raises this too"):
        vmapens.fit(ens, (wide, Y), nn.CrossEntropyLoss(), batch_size=BATCH, **options)
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups
    assert "step" not in vars(opt)  # the scheduler's wrapper is gone
    assert torch.equal(torch.get_rng_state(), rng)  # the seed drawn for shuffling given back
    vmapens.fit(ens, (X, Y), nn.CrossEntropyLoss(), **options)
    torch.testing.assert_close(torch.tensor(list(opt.param_groups[0]["lr"]), **F64),
                               torch.tensor(want, **F64), rtol=1e-12, atol=0)  # fmt: skip
    for m, got in zip(models, ens.unstack(), strict=True):
        for (name, a), b in zip(m.state_dict().items(), got.state_dict().values(), strict=True):
            torch.testing.assert_close(b, a, **TOL, msg=name)


def two_phases(milestone: int, then: Any) -> Any:
    return lambda o: sched.SequentialLR(o, [sched.ConstantLR(o, 0.5, 2), then(o)], [milestone])


def halving(o: torch.optim.Optimizer) -> Any:
    return sched.StepLR(o, 1, gamma=0.5)


@pytest.mark.parametrize(
    ("resumed", "differs"),
    [
        (two_phases(3, halving), r"'milestones': '\[3\]'"),
        (two_phases(2, lambda o: sched.ExponentialLR(o, 0.5)), r"'class': 'ExponentialLR'"),
        (two_phases(2, lambda o: sched.StepLR(o, 1, gamma=0.25)), r"'gamma': '0.25'"),
        (lambda o: sched.ChainedScheduler([sched.ConstantLR(o, 0.5, 2), halving(o)]),
         r"'class': 'ChainedScheduler'"),
    ],
    ids=["milestones", "inner-class", "inner-setting", "chained"],
)  # fmt: skip
def test_a_resume_compares_the_schedulers_a_sequential_lr_holds(
    tmp_path: Any, resumed: Any, differs: str
) -> None:
    # The resume check compared a SequentialLR / ChainedScheduler by its class alone (their
    # schedulers and milestones are under `_` keys): a run resumed with another milestone or
    # inner scheduler went on silently, the checkpoint's inner states loaded over this run's.
    lrs, epochs, path = [0.1, 0.2], 4, tmp_path / "run.pt"
    models = seeded_members(classifier, 2)
    for m, lr in zip(models, lrs, strict=True):  # the truth: each alone, one batch an epoch
        opt = torch.optim.SGD(m.parameters(), lr=lr)
        schedule = two_phases(2, halving)(opt)
        for _ in range(epochs):
            opt.zero_grad()
            nn.functional.cross_entropy(m(X), Y).backward()
            opt.step()
            schedule.step()

    def run(scheduler: Any, stop: int | None) -> tuple[vmapens.Ensemble, Any]:
        def interrupt(h: vmapens.History) -> None:
            if h.epochs == stop:
                raise KeyboardInterrupt

        ens = vmapens.Ensemble(classifier, n=2, seeds=[0, 1])
        opt = vmapens.StackedSGD(ens, lr=lrs)
        vmapens.fit(ens, (X, Y), nn.CrossEntropyLoss(), epochs=epochs, optimizer=opt,
                    scheduler=scheduler, checkpoint=path, callbacks=[interrupt],
                    progress=False, seed=0)  # fmt: skip
        return ens, opt

    with pytest.raises(KeyboardInterrupt):
        run(two_phases(2, halving), 2)
    with pytest.raises(ValueError, match=r"^fit: cannot resume from .*scheduler=.*" + differs):
        run(resumed, None)
    ens, opt = run(two_phases(2, halving), None)  # the same schedule resumes, exactly
    for m, got in zip(models, ens.unstack(), strict=True):
        for (name, a), b in zip(m.state_dict().items(), got.state_dict().values(), strict=True):
            torch.testing.assert_close(b, a, **TOL, msg=name)


@pytest.mark.parametrize("how", ["argument", "callback"])
def test_a_sweep_over_several_rounds_refuses_one_checkpoint_file(tmp_path: Any, how: str) -> None:
    # Round 2 resumed round 1's checkpoint (same member rows; a grid cycling over the same
    # rates): trials 2 and 3 reported the values of trials 0 and 1, trained from other seeds.
    path = tmp_path / "sweep.pt"
    saving: dict[str, Any] = (
        {"checkpoint": path}
        if how == "argument"
        else {"callbacks": [vmapens.callbacks.Checkpoint(path)]}
    )
    sweep = Sweep(classifier, lambda t: {"lr": t.suggest_float("lr", 1e-3, 1.0)},
                  backend="grid", grid={"lr": [0.01, 0.1]})  # fmt: skip
    with pytest.raises(ValueError, match=r"^Sweep.run: a checkpoint names one file, and each "):
        sweep.run((X, Y), nn.CrossEntropyLoss(), n_trials=4, per_ensemble=2, epochs=1,
                  val_data=(XV, YV), progress=False, **saving)  # fmt: skip
    assert not path.exists()
    one_round = sweep.run((X, Y), nn.CrossEntropyLoss(), n_trials=4, epochs=1,
                          val_data=(XV, YV), progress=False, **saving)  # fmt: skip
    assert [t.number for t in one_round.trials] == [0, 1, 2, 3] and path.exists()
    models = []
    for t in range(4):
        torch.manual_seed(derived_seed(0, "member", t))
        models.append(classifier())
    for t, (m, lr) in enumerate(zip(models, [0.01, 0.1, 0.01, 0.1], strict=True)):
        opt = torch.optim.Adam(m.parameters(), lr=lr)
        opt.zero_grad()
        nn.functional.cross_entropy(m(X), Y).backward()
        opt.step()
        with torch.no_grad():
            want = float(nn.functional.cross_entropy(m.eval()(XV), YV))
        assert one_round.trials[t].values == pytest.approx([want], rel=1e-9), t
    # The same Sweep's next trials (4..7, other seeds, the grid's rates again) would resume
    # trials 0..3's run; a new Sweep asks trials 0..3 again and resumes them.
    with pytest.raises(ValueError, match=r"^Sweep.run: the checkpoint .* exists and this Sweep"):
        sweep.run((X, Y), nn.CrossEntropyLoss(), n_trials=4, epochs=1, val_data=(XV, YV),
                  progress=False, **saving)  # fmt: skip
    again = Sweep(classifier, lambda t: {"lr": t.suggest_float("lr", 1e-3, 1.0)},
                  backend="grid", grid={"lr": [0.01, 0.1]})  # fmt: skip
    resumed = again.run((X, Y), nn.CrossEntropyLoss(), n_trials=4, epochs=1,
                        val_data=(XV, YV), progress=False, **saving)  # fmt: skip
    assert [t.values for t in resumed.trials] == [t.values for t in one_round.trials]
