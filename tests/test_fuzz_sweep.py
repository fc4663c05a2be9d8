"""Seeded random hyperparameter sweeps against each trial trained alone by plain torch.

Each case draws a legal ``vmapens.sweep.Sweep`` the way users write one (float64, 2..5
trials): the random, grid or optuna backend; a stacked optimizer (Adam, Adam with
``decoupled_weight_decay``, SGD, RMSprop) given as the class, a ``functools.partial`` with a
fixed flag, or a lambda; a ``space`` over ``lr`` (log-uniform, uniform with a step, a power
of ten from ``suggest_int``, categorical), ``weight_decay``, ``momentum``, ``betas`` (two
draws), ``alpha``; grids of lists or tensors; rounds (``per_ensemble``); the validation loss,
the training loss or an accuracy (``mode="max"``, ties likely) as the monitor; ``patience``;
an LR scheduler; an explicit ``fit`` seed; sometimes a trial whose loss overflows.

The truth is each trial trained alone, as docs/workflows.md ("Hyperparameter sweeps") and
docs/fit.md describe it: a plain module built after ``torch.manual_seed(member_seed(seed,
number))``, ``torch.optim`` with the hyperparameters the trial reports, the batches of
``fit``'s seed, frozen after a step whose loss is not finite, stopped by patience, pruned
where the study pruned it, its best epoch given back. Compared: final parameters, the
reported values, value and state, which trial is best, the round and row bookkeeping, and
optuna's own record of each trial.

Run more seeds by hand: ``python tests/test_fuzz_sweep.py 0 300`` runs seeds 0..299 and
prints the failures; ``python tests/test_fuzz_sweep.py 17`` prints seed 17's configuration
and runs it.
"""

from __future__ import annotations

import copy
import functools
import itertools
import math
import random
from typing import Any

import pytest
import torch
from torch import nn
from truth import TOL64, batch_plan, derived_seed, search

import vmapens

try:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
except ImportError:  # the optuna cases are skipped
    optuna = None


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(3, 5), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def member() -> nn.Module:
    return MLP().double()


_g = torch.Generator().manual_seed(0)
X = torch.randn(20, 3, generator=_g, dtype=torch.float64)
Y = torch.randint(3, (20,), generator=_g)
XV = torch.randn(12, 3, generator=_g, dtype=torch.float64)
YV = torch.randint(3, (12,), generator=_g)


def accuracy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.argmax(-1) == y).double().mean()


#: name -> (vmapens class, torch class, the hyperparameters a space may sweep)
OPTIMIZERS: dict[str, tuple[Any, Any, tuple[str, ...]]] = {
    "adam": (vmapens.StackedAdam, torch.optim.Adam, ("lr", "betas", "weight_decay", "eps")),
    "sgd": (vmapens.StackedSGD, torch.optim.SGD, ("lr", "momentum", "weight_decay")),
    "rmsprop": (vmapens.StackedRMSprop, torch.optim.RMSprop, ("lr", "alpha", "momentum")),
}
#: flags a ``functools.partial`` fixes, per optimizer
FLAGS = {
    "adam": [{"amsgrad": True}, {"decoupled_weight_decay": True}],
    "sgd": [{"maximize": False}],
    "rmsprop": [{"centered": True}],
}
SCHEDULERS = {
    "step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
    "exponential": lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.8),
}
HUGE = 1e200  # an SGD learning rate whose loss overflows within an epoch

# -- a configuration --------------------------------------------------------------------------


def draw(seed: int) -> dict[str, Any]:
    """A random, legal sweep configuration from ``seed``."""
    r = random.Random(seed)
    backends = ["random", "grid"] + (["optuna"] if optuna is not None else [])
    s: dict[str, Any] = {"seed": seed, "backend": r.choice(backends), "sweep_seed": r.randint(0, 9)}
    s["opt"] = r.choice(list(OPTIMIZERS))
    s["given"] = r.choice(["class", "partial", "lambda"])
    s["flags"] = r.choice(FLAGS[s["opt"]]) if s["given"] != "class" else {}
    names = ["lr", *r.sample(OPTIMIZERS[s["opt"]][2][1:], r.randint(0, 2))]
    s["lr_kind"] = r.choice(["log", "step", "int", "categorical"])
    s["diverge"] = s["opt"] == "sgd" and s["lr_kind"] == "categorical" and r.random() < 0.7
    s["names"] = names
    if s["backend"] == "grid":
        s["grid"] = grid_of(r, s)
        size = math.prod(len(v) for v in s["grid"].values())
        s["n_trials"] = r.choice([None, size, size + 1])
    else:
        s["n_trials"] = r.randint(2, 5)
    total = s["n_trials"] or size
    s["per_ensemble"] = r.choice([None, r.randint(1, total)])
    s["monitor"] = r.choice(["val_loss", "val_loss", "train_loss", "val_acc"])
    s["validated"] = s["monitor"] != "train_loss" or r.random() < 0.5
    s["patience"] = r.choice([None, 1, 2]) if s["validated"] else None
    s["epochs"] = r.randint(1, 3)
    s["batch"] = r.choice([None, 5, 8])
    s["sched"] = r.choice([None, None, "step", "exponential"])
    s["fit_seed"] = r.choice([None, r.randint(0, 9)])
    return s


def grid_of(r: random.Random, s: dict[str, Any]) -> dict[str, Any]:
    """Grid values for every name the space asks for (1..3 each, lists or tensors)."""
    choices = {
        "lr": [1e-3, 1e-2, 5e-2, 0.1], "weight_decay": [0.0, 1e-3, 1e-2],
        "momentum": [0.0, 0.5, 0.9], "alpha": [0.9, 0.99], "eps": [1e-8, 1e-6],
        "beta1": [0.5, 0.9], "beta2": [0.99, 0.999],
    }  # fmt: skip
    keys = [k for name in s["names"] for k in (("beta1", "beta2") if name == "betas" else (name,))]
    if s["lr_kind"] == "int":
        keys[0] = "k"
    grid: dict[str, Any] = {}
    for k in keys:
        values = [1, 2] if k == "k" else r.sample(choices[k], r.randint(1, min(3, len(choices[k]))))
        if s["diverge"] and k == "lr":
            values = [*values[:1], HUGE]
        grid[k] = torch.tensor(values) if k != "k" and r.random() < 0.3 else values
    return grid


def make_space(s: dict[str, Any]) -> Any:
    """``space(trial)``: the drawing calls a user writes for these names."""

    def space(trial: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in s["names"]:
            if name == "lr":
                kind = s["lr_kind"]
                if kind == "log":
                    out["lr"] = trial.suggest_float("lr", 1e-3, 1e-1, log=True)
                elif kind == "step":
                    out["lr"] = trial.suggest_float("lr", 0.01, 0.05, step=0.01)
                elif kind == "int":
                    out["lr"] = 10.0 ** -trial.suggest_int("k", 1, 3)
                else:
                    big = HUGE if s["diverge"] else 0.03
                    out["lr"] = trial.suggest_categorical("lr", [0.01, big])
            elif name == "betas":
                out["betas"] = (trial.suggest_float("beta1", 0.5, 0.9),
                                trial.suggest_float("beta2", 0.99, 0.999))  # fmt: skip
            elif name in ("weight_decay", "momentum"):
                out[name] = trial.suggest_float(name, 0.0, 0.9 if name == "momentum" else 1e-2)
            elif name == "alpha":
                out["alpha"] = trial.suggest_float("alpha", 0.8, 0.99)
            else:
                out["eps"] = trial.suggest_float("eps", 1e-8, 1e-6, log=True)
        return out

    return space


def optimizer_arg(s: dict[str, Any]) -> Any:
    cls = OPTIMIZERS[s["opt"]][0]
    if s["given"] == "class":
        return cls
    if s["given"] == "partial":
        return functools.partial(cls, **s["flags"])
    flags = s["flags"]
    return lambda ens, **hyper: cls(ens, **hyper, **flags)


def make_sweep(s: dict[str, Any]) -> vmapens.sweep.Sweep:
    mode = "max" if s["monitor"] == "val_acc" else "min"
    study = None
    if s["backend"] == "optuna":
        study = optuna.create_study(
            direction="minimize" if mode == "min" else "maximize",
            sampler=optuna.samplers.TPESampler(seed=s["sweep_seed"], n_startup_trials=2),
            pruner=optuna.pruners.MedianPruner(n_startup_trials=1),
        )
    return vmapens.sweep.Sweep(
        member, make_space(s), backend=s["backend"], study=study, grid=s.get("grid"),
        seed=s["sweep_seed"], optimizer=optimizer_arg(s), monitor=s["monitor"], mode=mode,
    )  # fmt: skip


def fit_options(s: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = dict(epochs=s["epochs"], batch_size=s["batch"], progress=False)
    if s["validated"]:
        out["val_data"] = (XV, YV)
        out["metrics"] = {"acc": accuracy}
    if s["patience"] is not None:
        out["patience"] = s["patience"]
    if s["sched"] is not None:
        out["scheduler"] = SCHEDULERS[s["sched"]]
    if s["fit_seed"] is not None:
        out["seed"] = s["fit_seed"]
    return out


# -- the truth: one trial alone ----------------------------------------------------------------


def torch_hypers(s: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The trial's reported hyperparameters (and the fixed flags) as torch.optim takes them."""
    out = {k: tuple(float(b) for b in v) if k == "betas" else float(v) for k, v in params.items()}
    return {"cls": OPTIMIZERS[s["opt"]][1], **out, **s["flags"]}


def alone(s: dict[str, Any], number: int, params: dict[str, Any], epochs: int) -> dict[str, Any]:
    """Trial ``number`` trained alone for at most ``epochs`` epochs, from docs/fit.md."""
    torch.manual_seed(derived_seed(s["sweep_seed"], "member", number))
    model = member()
    hyper = torch_hypers(s, params)
    opt = hyper.pop("cls")(model.parameters(), **hyper)
    sched = SCHEDULERS[s["sched"]](opt) if s["sched"] else None
    fit_seed = s["sweep_seed"] if s["fit_seed"] is None else s["fit_seed"]
    per_pass = -(-len(X) // (s["batch"] or len(X)))
    plan = batch_plan(len(X), s["batch"], s["epochs"] * per_pass, fit_seed)
    mode = "max" if s["monitor"] == "val_acc" else "min"
    sign = -1.0 if mode == "max" else 1.0
    best, best_state, bad, watched = math.inf, None, 0, []
    diverged = False
    for epoch in range(epochs):
        summed = 0.0
        for rows in plan[epoch * per_pass : (epoch + 1) * per_pass]:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(X[rows]), Y[rows])
            loss.backward()
            opt.step()
            summed += loss.item()
            if not math.isfinite(loss.item()):
                diverged = True  # frozen after this step
                break
        if sched is not None:
            sched.step()
        value = math.inf if diverged else summed / per_pass
        if s["validated"]:
            with torch.no_grad():
                out = model.eval()(XV)
            model.train()
            val = {"val_loss": float(nn.functional.cross_entropy(out, YV)),
                   "val_acc": float(accuracy(out, YV))}  # fmt: skip
            if s["monitor"] != "train_loss":
                value = val[s["monitor"]]
            early = sign * val["val_acc" if s["monitor"] == "val_acc" else "val_loss"]
            if early < best:
                best, bad, best_state = early, 0, copy.deepcopy(model.state_dict())
            else:
                bad += 1
        watched.append(value)
        if diverged or (s["patience"] is not None and bad >= s["patience"]):
            break
    if best_state is not None:
        model.load_state_dict(best_state)
    finite = [v for v in watched if math.isfinite(v)]
    return {"model": model, "values": finite, "diverged": diverged,
            "value": (max if mode == "max" else min)(finite) if finite else math.nan}  # fmt: skip


def space_output(s: dict[str, Any], drawn: dict[str, Any]) -> dict[str, Any]:
    """What ``space`` returns for the values a study drew (by their suggest names)."""
    out = {k: v for k, v in drawn.items() if k not in ("k", "beta1", "beta2")}
    if "k" in drawn:
        out["lr"] = 10.0 ** -drawn["k"]
    if "beta1" in drawn:
        out["betas"] = (drawn["beta1"], drawn["beta2"])
    return {name: out[name] for name in s["names"]}


# -- a run ------------------------------------------------------------------------------------


def run(s: dict[str, Any]) -> None:
    sweep = make_sweep(s)
    result = sweep.run((X, Y), nn.CrossEntropyLoss(), n_trials=s["n_trials"],
                       per_ensemble=s["per_ensemble"], **fit_options(s))  # fmt: skip
    n = s["n_trials"] or math.prod(len(v) for v in s["grid"].values())
    per = s["per_ensemble"] or n
    assert [t.number for t in result.trials] == list(range(n))
    assert [(t.round, t.member) for t in result.trials] == [(k // per, k % per) for k in range(n)]
    assert [len(e) for e in result.ensembles] == [min(per, n - k) for k in range(0, n, per)]
    if s["backend"] == "grid":  # the product, in order, from the start again after its end
        keys = list(s["grid"])
        combos = [dict(zip(keys, c)) for c in itertools.product(*s["grid"].values())]
        for t in result.trials:
            combo = combos[t.number % len(combos)]
            assert sorted(t.params) == sorted(s["names"]), t.params
            assert float(t.params["lr"]) == float(
                10.0 ** -combo["k"] if s["lr_kind"] == "int" else combo["lr"]
            )
            if "betas" in t.params:
                assert tuple(map(float, t.params["betas"])) == (
                    float(combo["beta1"]), float(combo["beta2"]))  # fmt: skip
    mode = "max" if s["monitor"] == "val_acc" else "min"
    for t in result.trials:
        where = f"trial {t.number}"
        assert list(t.params) == s["names"], where
        if t.state == "pruned":
            assert s["backend"] == "optuna", where
        epochs = len(t.values) if t.state == "pruned" else s["epochs"]
        want = alone(s, t.number, t.params, epochs)
        assert len(t.values) == len(want["values"]), (where, t.values, want["values"])
        if t.values:
            torch.testing.assert_close(torch.tensor(t.values), torch.tensor(want["values"]),
                                       **TOL64, msg=where)  # fmt: skip
        assert t.state == ("failed" if math.isnan(want["value"]) else t.state), where
        if t.state != "failed":
            assert t.state in ("complete", "pruned"), where
            assert math.isclose(t.value, want["value"], rel_tol=1e-9, abs_tol=1e-10), where
        got = result.ensembles[t.round][t.member].state_dict()
        for k, v in want["model"].state_dict().items():
            torch.testing.assert_close(got[k], v, **TOL64, equal_nan=True, msg=f"{where}: {k}")
    done = [t for t in result.trials if t.state == "complete"]
    if done:
        sign = -1.0 if mode == "max" else 1.0
        top = min(sign * t.value for t in done)
        assert sign * result.best.value == top
        # Ties: the first trial with the best value, as optuna's study.best_trial.
        assert result.best.number == min(t.number for t in done if sign * t.value == top)
    if s["backend"] == "optuna":
        frozen = sweep.study.trials
        assert len(frozen) == n
        for t, f in zip(result.trials, frozen, strict=True):
            assert f.number == t.number and f.state.name.lower() == t.state.replace(
                "failed", "fail"
            )
            assert space_output(s, f.params) == t.params, t.number  # what optuna drew
            assert list(f.intermediate_values.values()) == t.values, t.number
        if done:
            assert sweep.study.best_trial.number == result.best.number


SEEDS = range(24)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_sweep_equals_each_trial_trained_alone(seed: int) -> None:
    run(draw(seed))


# -- what the search found, one test each ------------------------------------------------------


def betas_space(trial: Any) -> dict[str, Any]:
    return {"betas": (trial.suggest_float("beta1", 0.5, 0.9),
                      trial.suggest_float("beta2", 0.99, 0.999))}  # fmt: skip


@pytest.mark.parametrize("given", ["partial", "lambda"])
def test_swept_betas_reach_their_own_member_through_a_partial_or_a_lambda(given: str) -> None:
    # Without StackedAdam's table in sight, two trials' betas went in as [(b1, b2), (b1', b2')],
    # which StackedAdam reads as the pair (beta1 per member, beta2 per member): member 0
    # trained with beta1 = b1 and beta2 = b1', silently (three trials: a crash).
    s = {"sweep_seed": 0, "backend": "random", "opt": "adam", "given": given, "flags": {"amsgrad": True},
         "names": ["betas"], "n_trials": 2, "per_ensemble": None, "monitor": "val_loss",
         "validated": True, "patience": None, "epochs": 2, "batch": 8, "sched": None,
         "fit_seed": None}  # fmt: skip
    sweep = vmapens.sweep.Sweep(member, betas_space, backend="random", seed=s["sweep_seed"],
                                optimizer=optimizer_arg(s))  # fmt: skip
    result = sweep.run((X, Y), nn.CrossEntropyLoss(), n_trials=2, **fit_options(s))
    for t in result.trials:
        want = alone(s, t.number, t.params, s["epochs"])
        got = result.ensembles[0][t.member].state_dict()
        for k, v in want["model"].state_dict().items():
            torch.testing.assert_close(got[k], v, **TOL64, msg=f"trial {t.number}: {k}")


def test_a_partial_that_fixes_a_swept_name_is_refused_before_any_trial() -> None:
    built: list[nn.Module] = []
    opt = functools.partial(vmapens.StackedSGD, lr=0.1)
    sweep = vmapens.sweep.Sweep(lambda: built.append(member()) or built[-1],
                                lambda t: {"lr": t.suggest_float("lr", 1e-3, 1e-1)},
                                backend="random", optimizer=opt)  # fmt: skip
    with pytest.raises(ValueError, match=r"^Sweep\.run: `space` returned \['lr'\], which the "
                                         r"`optimizer` partial already fixes"):  # fmt: skip
        sweep.run((X, Y), nn.CrossEntropyLoss(), n_trials=2, epochs=1, progress=False,
                  val_data=(XV, YV))  # fmt: skip
    assert built == []


@pytest.mark.skipif(optuna is None, reason="needs optuna")
@pytest.mark.parametrize(
    ("directions", "mode"),
    [(["maximize"], "min"), (["minimize"], "max"), (["minimize", "minimize"], "min")],
)
def test_a_study_that_optimizes_the_other_way_is_refused(directions: list[str], mode: str) -> None:
    # The sweep told a maximizing study validation losses: study.best_trial, TPE's draws and
    # the pruner all favoured the worst trials while SweepResult.best named the best.
    study = optuna.create_study(directions=directions)
    with pytest.raises(ValueError, match=r"^Sweep: `study` has directions .* but `mode` is"):
        vmapens.sweep.Sweep(member, betas_space, study=study, mode=mode)
    assert study.trials == []


@pytest.mark.skipif(optuna is None, reason="needs optuna")
def test_optuna_hears_the_value_of_the_epoch_early_stopping_stopped_a_member_in() -> None:
    # The report skipped members that EarlyStopping had just frozen, so that epoch's value (in
    # TrialResult.values) never reached the pruner, which compares trials epoch by epoch.
    s = {"sweep_seed": 0, "backend": "optuna", "opt": "sgd", "given": "class", "flags": {},
         "names": ["lr"], "lr_kind": "categorical", "diverge": False, "monitor": "val_loss",
         "validated": True, "patience": 1, "epochs": 3, "batch": 5, "sched": None,
         "fit_seed": 0, "n_trials": 4, "per_ensemble": None}  # fmt: skip
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=0))
    sweep = vmapens.sweep.Sweep(member, lambda t: {"lr": t.suggest_float("lr", 0.3, 3.0)},
                                study=study, optimizer=vmapens.StackedSGD)  # fmt: skip
    result = sweep.run((X, Y), nn.CrossEntropyLoss(), n_trials=4, **fit_options(s))
    stopped = result.histories[0].stopped_epoch
    assert bool((stopped >= 0).any()), stopped  # a member stopped early: the case under test
    for t, f in zip(result.trials, sweep.study.trials, strict=True):
        want = alone(s, t.number, t.params, s["epochs"])["values"]
        torch.testing.assert_close(torch.tensor(list(f.intermediate_values.values())),
                                   torch.tensor(want), **TOL64)  # fmt: skip


if __name__ == "__main__":
    search(lambda seed, tmp: run(draw(seed)), draw)
