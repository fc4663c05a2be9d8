"""User journey: a hyperparameter sweep, then a bagged final ensemble with the best trial's values.

The script a researcher writes with vmapens: `vmapens.sweep.Sweep` with the random backend over
SGD's `lr`, `weight_decay` and `momentum` (and the grid backend over Adam's `lr` and `betas`),
several rounds (`per_ensemble` below `n_trials`), early stopping on the validation loss, then
`result.best.params` trained as a bagged ensemble of 4 members (`fit(..., bootstrap=True)`,
out-of-bag validation) and `predict(reduce="mean")`; also a sweep interrupted mid-round and
resumed from its checkpoint, and a `space` that names what the optimizer does not take.

The truth is the naive loop the same researcher writes in plain PyTorch: each trial a module
built after `torch.manual_seed(member_seed(seed, number))` (docs/workflows.md "Hyperparameter
sweeps"), its own `torch.optim` optimizer, the batches of docs/fit.md's documented order, early
stopping and the best-epoch restore by EarlyStopping's documented rule, the resamples of
docs/fit.md "Bagging", all written again here from the docs. float64, tiny sizes.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from truth import derived_seed

import vmapens
from vmapens.sweep import Sweep

TOL: dict[str, Any] = dict(rtol=1e-9, atol=1e-10)
EPOCHS, BATCH, PATIENCE, SEED = 4, 7, 1, 3
_g = torch.Generator().manual_seed(0)
X = torch.randn(18, 3, generator=_g, dtype=torch.float64)
Y = torch.randint(3, (18,), generator=_g)
XV = torch.randn(10, 3, generator=_g, dtype=torch.float64)
YV = torch.randint(3, (10,), generator=_g)


def member() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def fixed_member() -> nn.Module:
    """The same weights whatever the torch seed: trials with the same values tie exactly."""
    m, g = member(), torch.Generator().manual_seed(42)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)
    return m


def accuracy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.argmax(-1) == y).double().mean()


def sgd_space(trial: Any) -> dict[str, Any]:
    return {"lr": trial.suggest_float("lr", 0.05, 2.0, log=True),
            "weight_decay": trial.suggest_float("weight_decay", 0.0, 1e-2),
            "momentum": trial.suggest_float("momentum", 0.0, 0.9)}  # fmt: skip


def adam_space(trial: Any) -> dict[str, Any]:
    return {"lr": trial.suggest_float("lr", 1e-3, 1e-1, log=True),
            "betas": (trial.suggest_float("b1", 0.5, 0.9), trial.suggest_float("b2", 0.9, 0.999))}  # fmt: skip


# -- the truth, written again from the docs ---------------------------------------------------


def order(samples: int, seed: int, p: int) -> torch.Tensor:
    return torch.randperm(
        samples, generator=torch.Generator().manual_seed(derived_seed(seed, "shuffle", p))
    )


def resample(samples: int, seed: int, member_id: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(derived_seed(seed, "bootstrap", member_id))
    return torch.randint(samples, (samples,), generator=g)


def naive(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    *,
    seed: int,
    epochs: int,
    patience: int | None,
    mode: str = "min",
    rows: torch.Tensor | None = None,
    val: Callable[[nn.Module], dict[str, float]] | None = None,
    monitor: str = "val_loss",
) -> dict[str, Any]:
    """One module trained alone: docs/fit.md's batches (a resample's rows with `rows`),
    frozen after a non-finite loss, the monitored value after each epoch, EarlyStopping's rule
    (an improvement is strictly better than the best so far; stop after `patience` epochs
    without one) and the best epoch given back."""
    own = torch.arange(len(X)) if rows is None else rows
    val = val or (lambda m: scores(m(XV), YV))
    sign = 1.0 if mode == "min" else -1.0
    best, bad, state, values, diverged = math.inf, 0, None, [], False
    for epoch in range(epochs):
        perm = order(len(X), seed, epoch)
        for k in range(0, len(X), BATCH):
            r = own[perm[k : k + BATCH]]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(X[r]), Y[r])
            loss.backward()
            opt.step()
            if not math.isfinite(loss.item()):
                diverged = True  # frozen from here; this epoch's scores are no scores
                break
        with torch.no_grad():
            watched = math.nan if diverged else val(model.eval())[monitor]
        model.train()
        if not math.isnan(watched):
            values.append(watched)
        if sign * watched < best:
            best, bad, state = sign * watched, 0, copy.deepcopy(model.state_dict())
        else:
            bad += 1
        if diverged or (patience is not None and bad >= patience):
            break
    if state is not None:
        model.load_state_dict(state)
    finite = [v for v in values if sign * v < math.inf]
    value = (min if mode == "min" else max)(finite) if finite else math.nan
    return {"model": model, "values": values, "value": value}


def scores(out: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    return {
        "val_loss": float(nn.functional.cross_entropy(out, y)),
        "val_acc": float(accuracy(out, y)),
    }


def trial_alone(
    factory: Callable[[], nn.Module], opt_cls: Any, t: Any, **kw: Any
) -> dict[str, Any]:
    torch.manual_seed(derived_seed(SEED, "member", t.number))
    model = factory()
    return naive(model, opt_cls(model.parameters(), **t.params), seed=SEED, **kw)


def assert_member(ens: Any, row: int, model: nn.Module, where: str) -> None:
    got = ens[row].state_dict()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(got[k], v, **TOL, equal_nan=True, msg=f"{where}: {k}")


def assert_trials(result: Any, truths: list[dict[str, Any]]) -> None:
    for t, want in zip(result.trials, truths, strict=True):
        where = f"trial {t.number}"
        assert len(t.values) == len(want["values"]), (where, t.values, want["values"])
        torch.testing.assert_close(torch.tensor(t.values, dtype=torch.float64),
                                   torch.tensor(want["values"], dtype=torch.float64), **TOL)  # fmt: skip
        if math.isnan(want["value"]):
            assert math.isnan(t.value) and t.state == "failed", where
        else:
            assert t.state == "complete", where  # the plain backends never prune
            assert math.isclose(t.value, want["value"], rel_tol=1e-9, abs_tol=1e-12), where
        assert_member(result.ensembles[t.round], t.member, want["model"], where)


def documented_best(trials: list[Any], mode: str) -> Any:
    """The documented best: "the complete trial with the best value"; ties: the first."""
    sign = 1.0 if mode == "min" else -1.0
    done = [t for t in trials if t.state == "complete"]
    top = min(sign * t.value for t in done)
    return next(t for t in done if sign * t.value == top)


# -- the journey ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sgd_sweep() -> Any:
    sweep = Sweep(member, sgd_space, backend="random", seed=SEED, optimizer=vmapens.StackedSGD)
    return sweep.run((X, Y), nn.CrossEntropyLoss(), n_trials=5, per_ensemble=2, epochs=EPOCHS,
                     batch_size=BATCH, val_data=(XV, YV), patience=PATIENCE, progress=False)  # fmt: skip


def test_an_sgd_sweep_over_rounds_with_early_stopping_is_each_trial_trained_alone(
    sgd_sweep: Any,
) -> None:
    result = sgd_sweep
    assert [(t.number, t.round, t.member) for t in result.trials] == [
        (k, k // 2, k % 2) for k in range(5)
    ]
    assert [len(e) for e in result.ensembles] == [2, 2, 1]
    for t in result.trials:
        assert list(t.params) == ["lr", "weight_decay", "momentum"]
        assert 0.05 <= t.params["lr"] <= 2.0 and 0.0 <= t.params["weight_decay"] <= 1e-2
        assert 0.0 <= t.params["momentum"] <= 0.9
    truths = [trial_alone(member, torch.optim.SGD, t, epochs=EPOCHS, patience=PATIENCE)
              for t in result.trials]  # fmt: skip
    assert_trials(result, truths)
    assert any(len(t.values) < EPOCHS for t in result.trials)  # early stopping stopped one
    assert result.best is documented_best(result.trials, "min")


def test_the_best_trial_trained_again_as_a_bagged_ensemble_and_averaged(sgd_sweep: Any) -> None:
    params, seeds, fit_seed = sgd_sweep.best.params, [11, 12, 13, 14], 5
    ens = vmapens.Ensemble(member, 4, seeds=seeds)
    history = vmapens.fit(ens, (X, Y), nn.CrossEntropyLoss(), optimizer=vmapens.StackedSGD,
                          **params, bootstrap=True, val_data="oob", patience=PATIENCE,
                          epochs=EPOCHS, batch_size=BATCH, seed=fit_seed, progress=False)  # fmt: skip
    mean = vmapens.predict(ens, XV, reduce="mean")
    outs = []
    for i, s in enumerate(seeds):
        torch.manual_seed(s)
        model = member()
        rows = resample(len(X), fit_seed, i)
        oob = torch.ones(len(X), dtype=torch.bool)
        oob[rows] = False
        assert oob.any()  # every member has out-of-bag rows to be scored on

        def out_of_bag(m: nn.Module, oob: torch.Tensor = oob) -> dict[str, float]:
            return scores(m(X[oob]), Y[oob])

        want = naive(model, torch.optim.SGD(model.parameters(), **params), seed=fit_seed,
                     epochs=EPOCHS, patience=PATIENCE, rows=rows, val=out_of_bag)  # fmt: skip
        assert_member(ens, i, want["model"], f"bagged member {i}")
        assert history.val_loss is not None
        trained = history.val_loss[:, i]
        torch.testing.assert_close(trained[~trained.isnan()],
                                   torch.tensor(want["values"], dtype=torch.float64), **TOL)  # fmt: skip
        with torch.no_grad():
            outs.append(want["model"].eval()(XV))
    torch.testing.assert_close(mean, sum(outs) / len(outs), **TOL)


def test_an_adam_betas_grid_on_accuracy_names_the_first_of_tied_best_trials() -> None:
    # The grid cycles (n_trials twice its size) and the members start from the same weights,
    # so trial k and trial k + 3 train alike: the best value is always tied.
    grid = {"lr": [0.05, 0.2, 0.4], "b1": [0.5], "b2": [0.99]}
    sweep = Sweep(fixed_member, adam_space, backend="grid", grid=grid, seed=SEED,
                  optimizer=vmapens.StackedAdam, monitor="val_acc", mode="max")  # fmt: skip
    result = sweep.run((X, Y), nn.CrossEntropyLoss(), n_trials=6, per_ensemble=4, epochs=3,
                       batch_size=BATCH, val_data=(XV, YV), metrics={"acc": accuracy},
                       patience=2, progress=False)  # fmt: skip
    for t in result.trials:
        combo = t.number % 3
        assert t.params == {"lr": grid["lr"][combo], "betas": (0.5, 0.99)}
    truths = [trial_alone(fixed_member, torch.optim.Adam, t, epochs=3, patience=2, mode="max",
                          monitor="val_acc") for t in result.trials]  # fmt: skip
    assert_trials(result, truths)
    best = documented_best(result.trials, "max")
    assert result.best is best and best.number < 3


def test_a_diverging_trial_fails_and_is_never_the_best() -> None:
    # tanh saturates, so even lr=1e200 keeps the loss finite: an infinite lr overflows at once.
    grid = {"lr": [math.inf, 0.3]}
    sweep = Sweep(member, lambda t: {"lr": t.suggest_float("lr", 0.0, 1.0)}, backend="grid",
                  grid=grid, seed=SEED, optimizer=vmapens.StackedSGD)  # fmt: skip
    result = sweep.run((X, Y), nn.CrossEntropyLoss(), epochs=2, batch_size=BATCH,
                       val_data=(XV, YV), progress=False)  # fmt: skip
    truths = [trial_alone(member, torch.optim.SGD, t, epochs=2, patience=None)
              for t in result.trials]  # fmt: skip
    assert_trials(result, truths)
    assert result.trials[0].state == "failed" and result.trials[0].values == []
    assert result.best is result.trials[1]
    failed = Sweep(member, lambda t: {"lr": t.suggest_float("lr", 0.0, 1.0)}, backend="grid",
                   grid={"lr": [math.inf]}, seed=SEED, optimizer=vmapens.StackedSGD)  # fmt: skip
    none = failed.run((X, Y), nn.CrossEntropyLoss(), epochs=1, batch_size=BATCH,
                      val_data=(XV, YV), progress=False)  # fmt: skip
    with pytest.raises(ValueError, match="no trial completed"):
        _ = none.best


def test_a_sweep_interrupted_mid_round_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    def interrupt(history: Any) -> None:
        if history.epochs == 2:
            raise KeyboardInterrupt  # a pre-empted job, mid-round

    options: dict[str, Any] = dict(n_trials=3, epochs=EPOCHS, batch_size=BATCH, val_data=(XV, YV),
                   patience=PATIENCE, progress=False, checkpoint=tmp_path / "sweep.pt")  # fmt: skip
    sweep = Sweep(member, sgd_space, backend="random", seed=SEED, optimizer=vmapens.StackedSGD)
    with pytest.raises(KeyboardInterrupt):
        sweep.run((X, Y), nn.CrossEntropyLoss(), callbacks=[interrupt], **options)
    assert (tmp_path / "sweep.pt").exists()
    # docs/workflows.md: a new Sweep with the same seed resumes the same trials from it.
    again = Sweep(member, sgd_space, backend="random", seed=SEED, optimizer=vmapens.StackedSGD)
    result = again.run((X, Y), nn.CrossEntropyLoss(), **options)
    truths = [trial_alone(member, torch.optim.SGD, t, epochs=EPOCHS, patience=PATIENCE)
              for t in result.trials]  # fmt: skip
    assert_trials(result, truths)
    assert result.best is documented_best(result.trials, "min")


def test_a_space_naming_what_the_optimizer_does_not_take_is_refused_before_training(
    tmp_path: Path,
) -> None:
    built: list[int] = []

    def factory() -> nn.Module:
        built.append(1)
        return member()

    cases = [
        (vmapens.StackedSGD, lambda t: {"lr": t.suggest_float("lr", 0.01, 0.1), "betas": (0.9, 0.99)}, "betas"),
        (vmapens.StackedAdam, lambda t: {"lr": 0.01, "momentum": t.suggest_float("momentum", 0.0, 0.9)}, "momentum"),
    ]  # fmt: skip
    for opt, space, name in cases:
        sweep = Sweep(factory, space, backend="random", seed=SEED, optimizer=opt)
        with pytest.raises(ValueError, match=rf"^Sweep\.run: `space` returned \['{name}'\], which "
                                             rf"{opt.__name__} does not take"):  # fmt: skip
            sweep.run((X, Y), nn.CrossEntropyLoss(), n_trials=2, per_ensemble=None, epochs=1,
                      val_data=(XV, YV), progress=False, checkpoint=tmp_path / "c.pt")  # fmt: skip
        assert built == [] and not (tmp_path / "c.pt").exists()
    # A checkpoint over several rounds is refused before any member is built, too.
    sweep = Sweep(factory, sgd_space, backend="random", seed=SEED, optimizer=vmapens.StackedSGD)
    with pytest.raises(ValueError, match=r"^Sweep\.run: a checkpoint names one file"):
        sweep.run((X, Y), nn.CrossEntropyLoss(), n_trials=3, per_ensemble=2, epochs=1,
                  val_data=(XV, YV), progress=False, checkpoint=tmp_path / "c.pt")  # fmt: skip
    assert built == [] and not (tmp_path / "c.pt").exists()


def test_a_swept_flag_is_refused_as_a_flag_not_as_a_name_the_optimizer_does_not_take() -> None:
    # StackedSGD takes `nesterov` (as torch.optim.SGD does), one value for every member: the
    # refusal said "StackedSGD does not take" it and listed other names, not how to set it.
    built: list[int] = []

    def factory() -> nn.Module:
        built.append(1)
        return member()

    space = lambda t: {"lr": 0.1, "momentum": 0.9,  # noqa: E731
                       "nesterov": t.suggest_categorical("nesterov", [True, False])}  # fmt: skip
    sweep = Sweep(factory, space, backend="random", seed=SEED, optimizer=vmapens.StackedSGD)
    with pytest.raises(ValueError, match=r"`space` returned \['nesterov'\], which StackedSGD "
                                         r"takes as a flag .*functools\.partial"):  # fmt: skip
        sweep.run((X, Y), nn.CrossEntropyLoss(), n_trials=2, epochs=1, val_data=(XV, YV),
                  progress=False)  # fmt: skip
    assert built == []
