"""Sweeps against the truth: each trial equals its model trained alone in plain PyTorch."""

from __future__ import annotations

import models
import pytest
import torch
from test_workflows import TOL, XV, YV, X, Y
from torch import nn
from truth import batch_plan, derived_seed, train_alone

import vmapens

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
