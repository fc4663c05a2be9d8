"""Sweeps against the truth: each trial equals its model trained alone in plain PyTorch."""

from __future__ import annotations

import models
import pytest
import torch
from test_workflows import TOL, XV, YV, X, Y
from torch import nn
from truth import batch_plan, derived_seed, train_alone

import vmapens
from vmapens.selection import best_k, member_scores

# -- sweeps -------------------------------------------------------------------------------------


def space(trial):
    return {"lr": trial.suggest_float("lr", 1e-3, 1e-1, log=True)}


EPOCHS, BATCH = 3, 8
SWEEP_FIT = dict(epochs=EPOCHS, batch_size=BATCH, val_data=(XV, YV), progress=False)


def alone_values(number: int, lr: float, seed: int = 0) -> list[float]:
    """Trial `number` in plain PyTorch: its member built from the documented seed recipe
    (`torch.manual_seed(member_seed(seed, number))`, the seed recomputed), torch.optim.Adam,
    the batches fit documents for `seed` (reshuffled every pass), and the validation loss in
    eval mode after every epoch."""
    torch.manual_seed(derived_seed(seed, "member", number))
    model = models.MLP().double()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    per_pass = -(-len(X) // BATCH)
    plan = batch_plan(len(X), BATCH, EPOCHS * per_pass, seed)
    values = []
    for epoch in range(EPOCHS):
        rows = plan[epoch * per_pass : (epoch + 1) * per_pass]
        train_alone(model, [(X[r], Y[r]) for r in rows], nn.functional.cross_entropy, opt)
        with torch.no_grad():
            values.append(float(nn.functional.cross_entropy(model.eval()(XV), YV)))
        model.train()
    return values


def double_mlp():
    return models.MLP().double()


@pytest.mark.parametrize("backend", ["random", "grid"])
def test_plain_sweep_equals_each_trial_alone(backend):
    grid = {"lr": [1e-3, 1e-2, 1e-1]} if backend == "grid" else None
    sweep = vmapens.sweep.Sweep(double_mlp, space, backend=backend, grid=grid, seed=0)
    result = sweep.run((X, Y), nn.CrossEntropyLoss(), n_trials=3, per_ensemble=2, **SWEEP_FIT)
    assert [t.number for t in result.trials] == [0, 1, 2]
    assert [t.round for t in result.trials] == [0, 0, 1]
    if grid:
        assert [t.params["lr"] for t in result.trials] == grid["lr"]
    for t in result.trials:
        torch.testing.assert_close(
            torch.tensor(t.values), torch.tensor(alone_values(t.number, t.params["lr"])), **TOL
        )
        assert t.value == min(t.values) and t.state == "complete"
    assert result.best.value == min(t.value for t in result.trials)


def test_bootstrap_over_several_rounds_is_refused():
    # fit keys each resample by the member's index in its round's ensemble: a second round
    # would reuse the first round's rows (trial 2 trained on trial 0's), a silent change.
    sweep = vmapens.sweep.Sweep(double_mlp, space, seed=0)
    with pytest.raises(ValueError, match=r"Sweep\.run: bootstrap=True needs every trial in one"):
        sweep.run((X, Y), nn.CrossEntropyLoss(), n_trials=3, per_ensemble=2, bootstrap=True,
                  **SWEEP_FIT)  # fmt: skip
    result = sweep.run((X, Y), nn.CrossEntropyLoss(), n_trials=2, bootstrap=True, **SWEEP_FIT)
    assert len(result.trials) == 2  # one round: allowed


def test_optuna_sweep_prunes_members_and_equals_each_trial_alone():
    optuna = pytest.importorskip("optuna")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=0),
                                pruner=optuna.pruners.ThresholdPruner(upper=1.05))  # fmt: skip
    sweep = vmapens.sweep.Sweep(double_mlp, space, study=study, seed=0)
    result = sweep.run((X, Y), nn.CrossEntropyLoss(), n_trials=6, per_ensemble=3, **SWEEP_FIT)
    states = [t.state for t in result.trials]
    assert "pruned" in states and "complete" in states, states
    for t, frozen in zip(result.trials, study.trials):
        truth = alone_values(t.number, t.params["lr"])
        torch.testing.assert_close(
            torch.tensor(t.values), torch.tensor(truth[: len(t.values)]), **TOL
        )
        assert frozen.params == t.params
        assert frozen.state.name.lower() == t.state
        assert list(frozen.intermediate_values.values()) == t.values
    assert study.best_value == result.best.value


# -- failures: checked before any trial is asked, or the backend left as it was ---------------

QUICK = dict(epochs=2, batch_size=BATCH, progress=False)


class Steps(vmapens.Callback):
    """Counts the optimizer steps taken."""

    def __init__(self):
        self.steps = 0

    def on_step_end(self, ctx):
        self.steps += 1


def sweep_of(backend, built=None, space=space, **kwargs):
    """A Sweep whose factory appends every member it builds to `built`."""

    def factory():
        module = double_mlp()
        if built is not None:
            built.append(module)
        return module

    # `learning_rate` is on the grid so that StackedAdam, not the grid, refuses it.
    grid = {"lr": [1e-3, 1e-2, 1e-1], "learning_rate": [0.1]} if backend == "grid" else None
    if backend == "optuna":
        optuna = pytest.importorskip("optuna")
        optuna.logging.set_verbosity(optuna.logging.WARNING)
    return vmapens.sweep.Sweep(factory, space, backend=backend, grid=grid, seed=0, **kwargs)


def unknown_name(trial):
    return {**space(trial), "learning_rate": trial.suggest_float("learning_rate", 0.1, 0.2)}


def off_grid(trial):
    return {**space(trial), "weight_decay": trial.suggest_float("weight_decay", 0.0, 0.1)}


VAL = dict(val_data=(XV, YV))
ACC = dict(**VAL, metrics={"acc": lambda out, y: (out.argmax(-1) == y).double().mean()})
TOP1 = dict(**VAL, metrics={"top1": ACC["metrics"]["acc"]})
EARLY_ERRORS = [  # id, Sweep kwargs, bad run kwargs, corrected run kwargs, expected message
    ("val-monitor-without-val_data", {}, {}, VAL,
     r"^Sweep\.run: the sweep's `monitor` 'val_loss' is not recorded by fit with these options; "
     r"it records \['train_loss'\]"),
    ("metric-monitor-without-metrics", dict(monitor="val_acc", mode="max"), VAL, ACC,
     r"^Sweep\.run: the sweep's `monitor` 'val_acc' is not recorded .* \['train_loss', 'val_loss'\]"),
    ("metric-monitor-other-metric", dict(monitor="val_acc", mode="max"), TOP1, ACC,
     r"^Sweep\.run: the sweep's `monitor` 'val_acc' is not recorded .*'val_top1'\]"),
    ("unknown-hyperparameter", dict(space=unknown_name), VAL, VAL,
     r"^Sweep\.run: `space` returned \['learning_rate'\], which StackedAdam does not take"),
    ("name-off-the-grid", dict(space=off_grid), VAL, VAL,
     r"^Sweep: `space` asked for 'weight_decay', which `grid` does not hold"),
]  # fmt: skip
ROUNDS = dict(n_trials=3, per_ensemble=2, **QUICK)


def assert_same_results(got, fresh):
    """Trial by trial: number (so seed), round and row, parameters, state, values."""
    place = [(t.number, t.round, t.member, t.params, t.state) for t in got.trials]
    assert place == [(t.number, t.round, t.member, t.params, t.state) for t in fresh.trials]
    for a, b in zip(got.trials, fresh.trials, strict=True):
        torch.testing.assert_close(torch.tensor(a.values), torch.tensor(b.values), **TOL)


@pytest.mark.parametrize(
    ("backend", "sweep_kwargs", "bad", "good", "message"),
    [
        (backend, *case[1:])
        for case in EARLY_ERRORS
        for backend in ("random", "grid", "optuna")
        if backend == "grid" or "grid" not in case[-1]  # only the grid backend has a grid
    ],
    ids=[
        f"{backend}-{case[0]}"
        for case in EARLY_ERRORS
        for backend in ("random", "grid", "optuna")
        if backend == "grid" or "grid" not in case[-1]
    ],
)
def test_bad_monitor_or_space_fails_before_any_trial(backend, sweep_kwargs, bad, good, message):
    built, steps = [], Steps()
    sweep = sweep_of(backend, built, **sweep_kwargs)
    with pytest.raises(ValueError, match=message):
        sweep.run((X, Y), nn.CrossEntropyLoss(), callbacks=[steps], **ROUNDS, **bad)
    assert built == [] and steps.steps == 0  # no member built, none trained
    if backend == "optuna":
        assert sweep.study.trials == []  # nothing asked
    # Corrected, the same sweep runs as a fresh one would: same trial numbers, seeds, values.
    sweep.space = space
    fresh = sweep_of(backend, **{k: v for k, v in sweep_kwargs.items() if k != "space"})
    loss = nn.CrossEntropyLoss()
    assert_same_results(sweep.run((X, Y), loss, **ROUNDS, **good),
                        fresh.run((X, Y), loss, **ROUNDS, **good))  # fmt: skip


class FailInRound(vmapens.Callback):
    """Raises at the first epoch's end of the `round`-th fit it sees (0-based)."""

    def __init__(self, round):
        self.round, self.fits = round, -1

    def on_fit_start(self, ctx):
        self.fits += 1

    def on_epoch_end(self, ctx):
        if self.fits == self.round:
            raise RuntimeError("boom")


@pytest.mark.parametrize("failing_round", [0, 1])
@pytest.mark.parametrize("backend", ["random", "grid"])
def test_plain_backends_are_left_as_they_were_by_a_run_that_fails(backend, failing_round):
    sweep = sweep_of(backend)
    with pytest.raises(RuntimeError, match="boom"):
        sweep.run((X, Y), nn.CrossEntropyLoss(), callbacks=[FailInRound(failing_round)],
                  **ROUNDS, **VAL)  # fmt: skip
    loss = nn.CrossEntropyLoss()
    assert_same_results(sweep.run((X, Y), loss, **ROUNDS, **VAL),
                        sweep_of(backend).run((X, Y), loss, **ROUNDS, **VAL))  # fmt: skip


@pytest.mark.parametrize("failing_round", [0, 1])
def test_optuna_trials_of_a_failing_round_are_told_failed(failing_round):
    sweep = sweep_of("optuna")
    with pytest.raises(RuntimeError, match="boom"):
        sweep.run((X, Y), nn.CrossEntropyLoss(), callbacks=[FailInRound(failing_round)],
                  **ROUNDS, **VAL)  # fmt: skip
    states = [t.state.name for t in sweep.study.trials]
    # Round 0 is trials 0 and 1, round 1 trial 2: the failing round's are FAIL, none RUNNING.
    assert states == (["COMPLETE", "COMPLETE", "FAIL"] if failing_round else ["FAIL", "FAIL"])
    result = sweep.run((X, Y), nn.CrossEntropyLoss(), **ROUNDS, **VAL)
    assert [t.state.name for t in sweep.study.trials][len(states) :] == ["COMPLETE"] * 3
    assert [t.number for t in result.trials] == [len(states) + k for k in range(3)]


def test_sweep_bad_arguments():
    with pytest.raises(TypeError, match=r"^Sweep: `monitor` must be a str, got int"):
        vmapens.sweep.Sweep(double_mlp, space, backend="random", monitor=0)
    with pytest.raises(ValueError, match=r"^Sweep: `grid` needs at least one value per name, "
                                         r"got none for \['wd'\]"):  # fmt: skip
        vmapens.sweep.Sweep(double_mlp, space, backend="grid", grid={"lr": [0.1], "wd": []})


# -- best_k over a History ----------------------------------------------------------------------


def test_best_k_refuses_a_history_without_epochs():
    ens = vmapens.Ensemble(double_mlp, n=3, seed=0)
    empty = vmapens.History.empty(list(ens.member_ids), validated=True)
    with pytest.raises(ValueError, match=r"^best_k: `history_or_scores` has no epochs recorded"):
        best_k(ens, empty, 1)
    with pytest.raises(ValueError, match=r"^member_scores: `history` has no epochs recorded"):
        member_scores(empty)


def test_best_k_refuses_another_ensembles_history():
    ens = vmapens.Ensemble(double_mlp, n=4, seed=0)
    h = vmapens.fit(ens, (X, Y), nn.CrossEntropyLoss(), **QUICK, **VAL)
    sub = ens.select(torch.tensor([3, 1]))
    with pytest.raises(ValueError, match=r"^best_k: `history_or_scores` is a History of members "
                                         r"\[0, 1, 2, 3\], but `ens` holds members \[3, 1\]"):  # fmt: skip
        best_k(sub, h, 1)
    other = vmapens.Ensemble(double_mlp, n=2, seed=0)  # as many members, other ids
    with pytest.raises(ValueError, match=r"History of members \[3, 1\], but `ens` holds members "
                                         r"\[0, 1\]"):  # fmt: skip
        best_k(other, vmapens.fit(sub, (X, Y), nn.CrossEntropyLoss(), **QUICK, **VAL), 1)
    # The sub-ensemble's own history ranks its members, as its scores do.
    h_sub = vmapens.fit(sub, (X, Y), nn.CrossEntropyLoss(), **QUICK, **VAL)
    assert list(best_k(sub, h_sub, 1).member_ids) == list(
        best_k(sub, member_scores(h_sub), 1).member_ids
    )


# -- the demo -----------------------------------------------------------------------------------


def test_sweep_demo_runs_small(capsys, monkeypatch):
    pytest.importorskip("sklearn")
    from vmapens import __main__ as cli

    cli.sweep_demo(n=4, epochs=4, k=2)
    out = capsys.readouterr().out
    assert "best member" in out and "averaged ensemble" in out
    calls = []
    monkeypatch.setattr(cli, "sweep_demo", lambda: calls.append("sweep"))
    assert cli.main(["demo", "--sweep"]) == 0 and calls == ["sweep"]


def test_best_k_says_a_zoo_of_other_members_briefly():
    # A zoo's hundreds of ids buried the point: the count and the ends are given instead.
    scores_of = vmapens.History.empty(list(range(300)), validated=True)
    scores_of.val_loss = torch.zeros(1, 300, dtype=torch.float64)
    ens = vmapens.Ensemble(double_mlp, n=300, seed=0)[torch.arange(100)]
    with pytest.raises(ValueError, match=r"members 300 \[0, 1, 2, \.\.\., 298, 299\], but `ens` "
                                         r"holds members 100 \[0, 1, 2, \.\.\., 98, 99\]") as got:  # fmt: skip
        best_k(ens, scores_of, 3)
    assert len(str(got.value)) < 300
