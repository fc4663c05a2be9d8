"""Sweeps against the truth: every trial equals its member trained alone; the sweep demo."""

from __future__ import annotations

import models
import pytest
import torch
from test_workflows import TOL, XV, YV, X, Y
from torch import nn

import vmapens

# -- sweeps -------------------------------------------------------------------------------------


def space(trial):
    return {"lr": trial.suggest_float("lr", 1e-3, 1e-1, log=True)}


SWEEP_FIT = dict(epochs=3, batch_size=8, val_data=(XV, YV), progress=False)


def alone_values(number: int, lr: float, seed: int = 0) -> list[float]:
    ens = vmapens.Ensemble(models.MLP, n=1, seeds=[vmapens.member_seed(seed, number)]).double()
    h = vmapens.fit(ens, (X, Y), nn.CrossEntropyLoss(), lr=[lr], seed=seed, **SWEEP_FIT)
    return h.val_loss[:, 0].tolist()


def double_mlp():
    return models.MLP().double()


@pytest.mark.parametrize("backend", ["random", "grid"])
def test_plain_sweep_equals_each_trial_alone(backend):
    grid = {"lr": [1e-3, 1e-2, 1e-1]} if backend == "grid" else None
    sweep = vmapens.Sweep(double_mlp, space, backend=backend, grid=grid, seed=0)
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


def test_optuna_sweep_prunes_members_and_equals_each_trial_alone():
    optuna = pytest.importorskip("optuna")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=0),
                                pruner=optuna.pruners.ThresholdPruner(upper=1.05))  # fmt: skip
    sweep = vmapens.Sweep(double_mlp, space, study=study, seed=0)
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
