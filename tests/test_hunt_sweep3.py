"""Sweep, PBT and selection against plain torch: infinite scores, rounds, bad input.

The truth is each trial's member trained alone with ``torch.optim.SGD`` and the documented
rule for a score: a member's best value over its epochs, where the best infinity (``+inf``
for mode ``"max"``, ``-inf`` for ``"min"``) is a value, as ``EarlyStopping`` counts it (an
epoch improves when it beats the best so far, which starts at the worst infinity), and NaN
is none.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import vmapens
from vmapens.seeds import member_seed
from vmapens.selection import best_k, member_scores
from vmapens.sweep import Sweep

NAN, INF = math.nan, math.inf
_g = torch.Generator().manual_seed(0)
X = torch.randn(8, 2, generator=_g, dtype=torch.float64)
Y = torch.zeros(8, 1, dtype=torch.float64)
EPOCHS = 3


def factory() -> nn.Module:
    # A large enough step kills the ReLU on every row: the output is exactly Y, a perfect
    # member with a PSNR of +inf from then on.
    return nn.Sequential(nn.Linear(2, 1), nn.ReLU()).double()


def psnr(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 10 * torch.log10(1.0 / ((out - y) ** 2).mean())


def neg_psnr(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return -psnr(out, y)


def best_value(values: list[float], mode: str) -> float:
    """The documented score: the best value, the best infinity one of them, NaN none."""
    worst = INF if mode == "min" else -INF
    kept = [v for v in values if not math.isnan(v) and v != worst]
    return (min if mode == "min" else max)(kept) if kept else NAN


def alone(seed: int, number: int, lr: float, metric: object) -> list[float]:
    """The monitored value after each epoch of trial ``number``'s member trained alone."""
    torch.manual_seed(member_seed(seed, number))
    m = factory()
    opt = torch.optim.SGD(m.parameters(), lr=lr)
    values = []
    for _ in range(EPOCHS):
        opt.zero_grad()
        nn.functional.mse_loss(m(X), Y).backward()
        opt.step()
        with torch.no_grad():
            values.append(float(metric(m(X), Y)))  # type: ignore[operator]
    return values


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b or math.isclose(a, b, rel_tol=1e-9)


# -- member_scores, best_k and EarlyStopping agree on infinities ----------------------------

TABLE = [
    [3.0, NAN, INF, -INF, NAN],
    [2.0, NAN, 4.0, 1.0, INF],
    [NAN, NAN, -INF, 5.0, -INF],
]


@pytest.mark.parametrize("mode", ["min", "max"])
def test_member_scores_count_the_best_infinity_as_early_stopping(mode: str) -> None:
    h = vmapens.History.empty(list(range(5)), validated=True)
    h.val_loss = torch.tensor(TABLE, dtype=torch.float64)
    truth = [best_value(list(col), mode) for col in zip(*TABLE, strict=True)]
    got = member_scores(h, mode=mode)
    torch.testing.assert_close(got, torch.tensor(truth, dtype=torch.float64), equal_nan=True)
    # best_k with the History ranks by those very scores
    ens = vmapens.Ensemble(lambda: nn.Linear(2, 1), 5, seed=0)
    assert list(best_k(ens, h, 5, mode=mode).member_ids) == list(
        best_k(ens, torch.tensor(truth), 5, mode=mode).member_ids
    )


# -- Sweep: a perfect trial is complete, with its infinite value ----------------------------

GRID = [0.0, 3.0, 1.0]  # 3.0 turns its member perfect within the epochs (see alone())


@pytest.mark.parametrize(("mode", "metric"), [("max", psnr), ("min", neg_psnr)], ids=["max", "min"])
def test_sweep_tells_a_perfect_trial_complete_with_its_infinite_value(
    mode: str, metric: object
) -> None:
    sweep = Sweep(
        factory,
        lambda t: {"lr": t.suggest_float("lr", 0.0, 5.0)},
        backend="grid",
        grid={"lr": GRID},
        optimizer=vmapens.StackedSGD,
        monitor="val_m",
        mode=mode,
        seed=3,
    )
    result = sweep.run(
        (X, Y), nn.MSELoss(), n_trials=3, per_ensemble=2, epochs=EPOCHS, val_data=(X, Y),
        metrics={"m": metric}, shuffle=False, progress=False,
    )  # fmt: skip
    perfect = 0
    for t in result.trials:
        values = alone(3, t.number, t.params["lr"], metric)
        want = best_value(values, mode)
        perfect += math.isinf(want)
        assert t.params == {"lr": GRID[t.number]}
        assert same(t.value, want), (t.number, t.value, want)
        assert t.state == ("failed" if math.isnan(want) else "complete"), t
        assert len(t.values) == len(values)
        assert all(same(a, b) for a, b in zip(t.values, values, strict=True)), t.values
    assert perfect >= 1  # the case this test is about happened
    assert math.isinf(result.best.value)


@pytest.mark.parametrize(("mode", "metric"), [("max", psnr), ("min", neg_psnr)], ids=["max", "min"])
def test_optuna_hears_the_perfect_trial_as_complete(mode: str, metric: object) -> None:
    optuna = pytest.importorskip("optuna")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        direction="minimize" if mode == "min" else "maximize",
        pruner=optuna.pruners.NopPruner(),
    )
    for lr in GRID:  # asked in this order
        study.enqueue_trial({"lr": lr})
    sweep = Sweep(
        factory,
        lambda t: {"lr": t.suggest_float("lr", 0.0, 5.0)},
        study=study,
        optimizer=vmapens.StackedSGD,
        monitor="val_m",
        mode=mode,
        seed=3,
    )
    result = sweep.run(
        (X, Y), nn.MSELoss(), n_trials=3, epochs=EPOCHS, val_data=(X, Y),
        metrics={"m": metric}, shuffle=False, progress=False,
    )  # fmt: skip
    states = {"complete": optuna.trial.TrialState.COMPLETE}
    perfect = 0
    for t, frozen in zip(result.trials, study.trials, strict=True):
        values = alone(3, t.number, t.params["lr"], metric)
        want = best_value(values, mode)
        perfect += math.isinf(want)
        assert frozen.params == t.params
        assert frozen.state == states[t.state] and same(frozen.value, want), frozen
        inter = [frozen.intermediate_values[e] for e in sorted(frozen.intermediate_values)]
        assert all(same(a, b) for a, b in zip(inter, values, strict=True)) and len(inter) == 3
    assert perfect >= 1
    assert same(study.best_value, result.best.value) and math.isinf(study.best_value)
