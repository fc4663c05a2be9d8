"""Sweeps and PBT against their truths: optuna's trial API, plain modules and torch.optim.

PBT's exploit is, for plain PyTorch, a ``copy.deepcopy`` of the winner's module and a load
of its optimizer's state dict (hyperparameters included) into the loser's optimizer.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from truth import TOL64

import vmapens
from vmapens.pbt import exploit_
from vmapens.step import LossScale

N = 3


def member() -> nn.Module:
    # No bias before the BatchNorm: its true gradient is 0 and round-off would pick its sign.
    return nn.Sequential(
        nn.Linear(3, 4, bias=False), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 1)
    ).double()


def batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(6, 3, generator=g, dtype=torch.float64),
         torch.randn(6, 1, generator=g, dtype=torch.float64))
        for _ in range(count)
    ]  # fmt: skip


def row(kw: dict[str, Any], i: int) -> dict[str, Any]:
    """Member ``i``'s hyperparameters: lists are per member, a tuple of lists a pair."""
    out: dict[str, Any] = {}
    for k, v in kw.items():
        if isinstance(v, list):
            out[k] = v[i]
        elif isinstance(v, tuple):
            out[k] = tuple(x[i] for x in v)
        else:
            out[k] = v
    return out


LR = [0.01, 0.02, 0.03]
OPTIMIZERS: dict[str, tuple[Callable[..., Any], Callable[..., Any], dict[str, Any]]] = {
    "adam-amsgrad-betas": (
        vmapens.StackedAdam,
        torch.optim.Adam,
        dict(
            lr=LR,
            weight_decay=[0.0, 0.1, 0.2],
            betas=([0.9, 0.8, 0.7], [0.99, 0.98, 0.97]),
            amsgrad=True,
        ),
    ),  # fmt: skip
    "adamw": (
        functools.partial(vmapens.StackedAdam, decoupled_weight_decay=True),
        torch.optim.AdamW,
        dict(lr=LR, weight_decay=[0.0, 0.1, 0.2]),
    ),
    "sgd-momentum": (
        vmapens.StackedSGD,
        torch.optim.SGD,
        dict(lr=LR, momentum=[0.9, 0.5, 0.1], weight_decay=[0.0, 0.1, 0.2]),
    ),
    "rmsprop-centered": (
        vmapens.StackedRMSprop,
        torch.optim.RMSprop,
        dict(lr=LR, centered=True, momentum=[0.1, 0.2, 0.3]),
    ),
    "adagrad": (vmapens.StackedAdagrad, torch.optim.Adagrad, dict(lr=LR, lr_decay=[0.0, 0.1, 0.2])),
    "asgd": (vmapens.StackedASGD, torch.optim.ASGD, dict(lr=LR, t0=[1.0, 2.0, 3.0])),
    "rprop": (vmapens.StackedRprop, torch.optim.Rprop, dict(lr=LR)),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_exploit_equals_a_deepcopy_of_the_winner_and_its_optimizer_state(name: str) -> None:
    """Members 1 <- 0 and 2 <- 1 (overlapping: every row read before any is written), after
    masked steps so the members' step counts differ, then trained on: each member equals
    plain modules whose losers took ``deepcopy(winner)`` and the winner's optimizer state."""
    stacked, plain_opt, kw = OPTIMIZERS[name]
    ens = vmapens.Ensemble(member, n=N, seed=0)
    plain = ens.unstack()
    opt = stacked(ens, **kw)
    opts = [plain_opt(m.parameters(), **row(kw, i)) for i, m in enumerate(plain)]
    data = batches(7)

    def train(steps: range, mask: torch.Tensor | None = None) -> None:
        for s in steps:
            x, y = data[s]
            loss = vmapens.per_member(nn.MSELoss())(ens(x), y)
            opt.zero_grad()
            loss.sum().backward()
            opt.step(mask=mask)
            for i, (m, o) in enumerate(zip(plain, opts, strict=True)):
                if mask is not None and not mask[i]:
                    with torch.no_grad():
                        m(x)  # its buffers move in the forward, as the ensemble's do
                    continue
                o.zero_grad()
                nn.functional.mse_loss(m(x), y).backward()
                o.step()

    train(range(2))
    train(range(2, 4), mask=torch.tensor([True, False, True]))
    exploit_(ens, opt, [0, 1], [1, 2])
    modules = [copy.deepcopy(m) for m in plain]
    states = [copy.deepcopy(o.state_dict()) for o in opts]
    for s, d in [(0, 1), (1, 2)]:
        plain[d] = copy.deepcopy(modules[s])
        opts[d] = plain_opt(plain[d].parameters(), **row(kw, d))
        opts[d].load_state_dict(states[s])  # the winner's hyperparameters too
    train(range(4, 7))
    for i, m in enumerate(plain):
        for k, v in m.state_dict().items():
            torch.testing.assert_close(ens.state_dict()[k][i], v, **TOL64, msg=f"{i}: {k}")
        got, want = opt.member_state_dict(i), opts[i].state_dict()
        for p, state in want["state"].items():
            for k, v in state.items():
                torch.testing.assert_close(
                    torch.as_tensor(got["state"][p][k]).double(), torch.as_tensor(v).double(),
                    **TOL64, msg=f"{i}: state {p} {k}",
                )  # fmt: skip
        for k, v in want["param_groups"][0].items():
            if k != "params":
                assert got["param_groups"][0][k] == v, (i, k)


def _snapshot(ens: vmapens.Ensemble, opt: torch.optim.Optimizer) -> Any:
    return copy.deepcopy((ens.state_dict(), opt.state_dict()))


def _assert_same(a: Any, b: Any) -> None:
    la, lb = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


def _stepped() -> tuple[vmapens.Ensemble, torch.optim.Optimizer]:
    ens = vmapens.Ensemble(member, n=4, seed=0)
    opt = vmapens.StackedAdam(ens, lr=[0.1, 0.2, 0.3, 0.4])
    x, y = batches(1)[0]
    vmapens.per_member(nn.MSELoss())(ens(x), y).sum().backward()
    opt.step()
    return ens, opt


@pytest.mark.parametrize("plain", [False, True], ids=["stacked", "torch.optim"])
def test_exploit_refuses_another_ensembles_optimizer_before_changing_anything(plain: bool) -> None:
    ens, opt = _stepped()
    other = vmapens.Ensemble(member, n=3, seed=1)
    wrong = (
        torch.optim.Adam(other.parameters(), lr=0.1)
        if plain
        else vmapens.StackedAdam(other, lr=[0.1, 0.2, 0.3])
    )
    before = _snapshot(ens, opt)
    # It copied the members and left their optimizer state and learning rates behind.
    with pytest.raises(ValueError, match=r"exploit_: `optimizer` holds parameters of \[3\]"):
        exploit_(ens, wrong, [0], [2])
    _assert_same(before, _snapshot(ens, opt))


@pytest.mark.parametrize("dst", [2, 3])
def test_exploit_refuses_another_ensembles_loss_scale_before_changing_anything(dst: int) -> None:
    ens, opt = _stepped()
    before = _snapshot(ens, opt)
    # dst=3: the members and the optimizer were written, then the scale raised IndexError.
    with pytest.raises(ValueError, match=r"exploit_: `loss_scale` holds \[3\] scales"):
        exploit_(ens, opt, [0], [dst], loss_scale=LossScale(3))
    _assert_same(before, _snapshot(ens, opt))


def test_a_name_a_space_asks_twice_gets_its_first_value_as_in_optuna() -> None:
    """optuna's ``Trial.suggest_*`` gives a name it has already suggested the same value again
    (optuna's docs: "the value suggested before is returned"); the plain backends drew anew."""
    x = torch.randn(12, 3, dtype=torch.float64)
    y = torch.randn(12, 1, dtype=torch.float64)

    def space(t: Any) -> dict[str, Any]:
        lr = t.suggest_float("lr", 1e-3, 1e-1, log=True)
        assert t.suggest_int("k", 1, 1000) == t.suggest_int("k", 1, 1000)
        assert t.suggest_categorical("c", list(range(50))) == t.suggest_categorical(
            "c", list(range(50))
        )
        return {"lr": lr, "weight_decay": t.suggest_float("lr", 1e-3, 1e-1, log=True) / 10}

    sweep = vmapens.sweep.Sweep(member, space, backend="random", seed=0)
    result = sweep.run((x, y), nn.MSELoss(), n_trials=3, epochs=1, val_data=(x, y), progress=False)
    for t in result.trials:
        assert t.params["weight_decay"] == t.params["lr"] / 10, t.params


BAD_SPACES = [
    # what optuna's Trial refuses; the random backend drew from [high, low] or failed in math
    (lambda t: t.suggest_float("lr", 1e-1, 1e-3), r"suggest_float\('lr'\): `low` must be <="),
    (lambda t: t.suggest_float("lr", 0.0, 1e-1, log=True), r"`low` must be > 0 with `log=True`"),
    (lambda t: t.suggest_float("lr", 1e-3, 1e-1, log=True, step=1e-3), r"`step` cannot be"),
    (lambda t: t.suggest_float("lr", 0.0, 1e-1, step=0.0), r"`step` must be > 0"),
    (lambda t: 1e-2 * t.suggest_int("k", 5, 1), r"suggest_int\('k'\): `low` must be <="),
    (lambda t: 1e-2 * t.suggest_int("k", 0, 4, log=True), r"`low` must be >= 1 with `log=True`"),
    (lambda t: 1e-2 * t.suggest_int("k", 1, 4, step=0), r"`step` must be > 0"),
    (lambda t: t.suggest_categorical("lr", []), r"`choices` must not be empty"),
]


@pytest.mark.parametrize(("suggest", "message"), BAD_SPACES, ids=[m for _, m in BAD_SPACES])
def test_the_plain_trials_refuse_the_ranges_optuna_refuses_before_any_trial(
    suggest: Callable[[Any], Any], message: str
) -> None:
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)
    sweep = vmapens.sweep.Sweep(member, lambda t: {"lr": suggest(t)}, backend="random", seed=0)
    with pytest.raises(ValueError, match=message):
        sweep.run((x, y), nn.MSELoss(), n_trials=2, epochs=1, val_data=(x, y), progress=False)


def test_bootstrap_in_a_second_run_is_refused_as_over_several_rounds() -> None:
    """fit keys a member's resample by its row: the second run's trial 2 (row 0) trained on
    trial 0's rows, as a second round's would (which ``run`` refuses)."""
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)
    sweep = vmapens.sweep.Sweep(
        member, lambda t: {"lr": t.suggest_float("lr", 1e-3, 1e-1)}, backend="random", seed=0
    )
    options: dict[str, Any] = dict(epochs=1, bootstrap=True, val_data=(x, y), progress=False)
    sweep.run((x, y), nn.MSELoss(), n_trials=2, **options)
    with pytest.raises(ValueError, match=r"Sweep\.run: bootstrap=True .* already asked 2"):
        sweep.run((x, y), nn.MSELoss(), n_trials=2, **options)
    # refused before asking: the next run without bootstrap numbers its trials 2 and 3
    result = sweep.run((x, y), nn.MSELoss(), n_trials=2, epochs=1, val_data=(x, y), progress=False)
    assert [t.number for t in result.trials] == [2, 3]


@pytest.mark.parametrize("values", [0.01, "0.01", torch.tensor(0.01)], ids=["float", "str", "0-d"])
def test_a_grid_entry_that_is_not_a_list_of_values_is_refused_naming_grid(values: Any) -> None:
    # a float raised len()'s TypeError; a string ran its letters as three trials
    with pytest.raises(TypeError, match=r"Sweep: `grid` maps each name to a list of values"):
        vmapens.sweep.Sweep(
            member, lambda t: {"lr": t.suggest_float("lr", 0, 1)}, backend="grid",
            grid={"lr": values},
        )  # fmt: skip


class Interrupt(Exception):
    pass


def test_an_optuna_sweep_resumed_from_its_checkpoint_reports_every_epoch(tmp_path: Any) -> None:
    """docs/workflows.md: ``study.trials[i].intermediate_values`` lists
    ``result.trials[i].values``; the resumed run's new trials heard only the epochs after the
    checkpoint."""
    optuna = pytest.importorskip("optuna")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    x, y = torch.randn(16, 3, dtype=torch.float64), torch.randn(16, 1, dtype=torch.float64)

    def space(t: Any) -> dict[str, Any]:
        return {"lr": t.suggest_float("lr", 1e-3, 1e-1, log=True)}

    def interrupt(history: Any) -> None:
        if len(history.train_loss) == 2:
            raise Interrupt

    options: dict[str, Any] = dict(epochs=3, batch_size=8, val_data=(x, y), progress=False)
    whole = vmapens.sweep.Sweep(member, space, backend="optuna", seed=0)
    want = whole.run((x, y), nn.MSELoss(), n_trials=2, **options)
    path = tmp_path / "sweep.pt"
    with pytest.raises(Interrupt):
        vmapens.sweep.Sweep(member, space, backend="optuna", seed=0).run(
            (x, y), nn.MSELoss(), n_trials=2, checkpoint=path, callbacks=[interrupt], **options
        )
    resumed = vmapens.sweep.Sweep(member, space, backend="optuna", seed=0)
    got = resumed.run((x, y), nn.MSELoss(), n_trials=2, checkpoint=path, **options)
    for w, g, study_trial in zip(want.trials, got.trials, resumed.study.trials, strict=True):
        assert (g.params, g.values, g.state) == (w.params, w.values, w.state)
        assert len(g.values) == 3
        assert list(study_trial.intermediate_values.values()) == g.values


def test_pbt_load_state_dict_with_a_malformed_log_changes_nothing() -> None:
    pbt = vmapens.pbt.PBT(interval=1, seed=0)
    other = vmapens.pbt.PBT(interval=1, seed=1).state_dict()
    before = pbt.generator.get_state()
    with pytest.raises((TypeError, ValueError)):
        pbt.load_state_dict({**other, "log": [(1, [0])]})  # (epoch, src) without dst
    assert torch.equal(pbt.generator.get_state(), before) and pbt.log == []
