"""Session 48 (a): population and member-set operations against plain modules and torch.optim.

The truth in every test: plain modules (``ens.unstack()`` copies taken before training, or
built from the same seeds) trained alone with ``torch.optim``; copies done by hand with
``load_state_dict`` of the module and a deep copy of the optimizer's state dict.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import vmapens
from vmapens.pbt import exploit_

X = torch.linspace(-1, 1, 10, dtype=torch.float64).reshape(5, 2)
Y = torch.linspace(0.5, -0.5, 5, dtype=torch.float64).reshape(5, 1)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.BatchNorm1d(3), nn.Linear(3, 1)).double()


def _steps(ens, opt, plains, popts, count, mask=None):
    """``count`` steps of the ensemble and of each plain member (a masked member runs its
    forward, so its BatchNorm statistics move, but does not step)."""
    for _ in range(count):
        opt.zero_grad()
        vmapens.per_member(nn.MSELoss())(ens(X), Y).sum().backward()
        opt.step(mask=mask)
        for i, (m, o) in enumerate(zip(plains, popts, strict=True)):
            o.zero_grad()
            nn.MSELoss()(m(X), Y).backward()
            if mask is None or bool(mask[i]):
                o.step()


def _max_diff(ens, plains) -> float:
    return max(
        (a.double() - b.double()).abs().max().item()
        for mm, m in zip(ens.unstack(), plains, strict=True)
        for a, b in zip(mm.state_dict().values(), m.state_dict().values(), strict=True)
    )


_CASES = {
    "rmsprop": (
        vmapens.StackedRMSprop,
        torch.optim.RMSprop,
        {"lr": [0.01, 0.02, 0.03], "alpha": [0.9, 0.8, 0.99], "momentum": 0.5, "centered": True},
    ),
    "adagrad": (
        vmapens.StackedAdagrad,
        torch.optim.Adagrad,
        {
            "lr": [0.1, 0.2, 0.3],
            "lr_decay": [0.0, 0.1, 0.2],
            "initial_accumulator_value": [0.0, 0.1, 0.3],
        },  # fmt: skip
    ),
    "rprop": (
        vmapens.StackedRprop,
        torch.optim.Rprop,
        {"lr": [0.01, 0.02, 0.03], "etas": ([0.5, 0.4, 0.3], 1.2)},
    ),
    "asgd": (
        vmapens.StackedASGD,
        torch.optim.ASGD,
        {"lr": [0.01, 0.02, 0.03], "t0": [1.0, 2.0, 100.0], "lambd": [1e-4, 1e-3, 1e-2]},
    ),
    "nadam": (
        vmapens.StackedNAdam,
        torch.optim.NAdam,
        {"lr": [0.01, 0.02, 0.03], "momentum_decay": [0.004, 0.005, 0.006]},
    ),
    "adadelta": (
        vmapens.StackedAdadelta,
        torch.optim.Adadelta,
        {"lr": [0.5, 1.0, 1.5], "rho": [0.9, 0.8, 0.7]},
    ),
}


def _member(kw: dict, i: int) -> dict:
    """Member ``i``'s hyperparameters: a list is per member, a tuple a pair."""
    out = {}
    for k, v in kw.items():
        if isinstance(v, list):
            out[k] = v[i]
        elif isinstance(v, tuple):
            out[k] = tuple(x[i] if isinstance(x, list) else x for x in v)
        else:
            out[k] = v
    return out


@pytest.mark.parametrize("name", sorted(_CASES))
def test_exploit_between_members_of_unequal_step_counts_with_buffers(name: str) -> None:
    """After a masked step (member 1 one step behind), rows 0 <- 2 and 1 <- 0 (overlapping),
    for optimizers with counters and lazily started state (Rprop step sizes, ASGD eta/mu,
    NAdam mu_product, Adagrad sum): each copy continues as a plain member that loaded its
    source's module and optimizer state dicts."""
    stacked, plain, kw = _CASES[name]
    ens = vmapens.Ensemble(_mlp, n=3, seed=0)
    plains = ens.unstack()
    opt = stacked(ens, **kw)
    popts = [plain(m.parameters(), **_member(kw, i)) for i, m in enumerate(plains)]
    _steps(ens, opt, plains, popts, 1)
    _steps(ens, opt, plains, popts, 1, torch.tensor([True, False, True]))
    exploit_(ens, opt, [2, 0], [0, 1])
    msd = [copy.deepcopy(m.state_dict()) for m in plains]
    osd = [copy.deepcopy(o.state_dict()) for o in popts]
    for s, d in ((2, 0), (0, 1)):
        plains[d].load_state_dict(msd[s])
        popts[d].load_state_dict(copy.deepcopy(osd[s]))
    _steps(ens, opt, plains, popts, 2)
    assert _max_diff(ens, plains) < 1e-9  # NAdam with BatchNorm: 1e-13 trained straight


@pytest.mark.parametrize("name", sorted(_CASES))
def test_a_repeated_selection_trains_two_independent_copies(name: str) -> None:
    """``ens.select([1, 1])`` and ``opt.select([1, 1], sub)``: two copies of member 1, each
    going on as a plain copy with a deep copy of member 1's optimizer state (the rows must not
    share state)."""
    stacked, plain, kw = _CASES[name]
    ens = vmapens.Ensemble(_mlp, n=3, seed=1)
    plains = ens.unstack()
    opt = stacked(ens, **kw)
    popts = [plain(m.parameters(), **_member(kw, i)) for i, m in enumerate(plains)]
    _steps(ens, opt, plains, popts, 2)
    sub = ens.select([1, 1])
    sub_opt = opt.select([1, 1], sub)
    twins = [copy.deepcopy(plains[1]) for _ in range(2)]
    twin_opts = []
    for m in twins:
        o = plain(m.parameters(), **_member(kw, 1))
        o.load_state_dict(copy.deepcopy(popts[1].state_dict()))
        twin_opts.append(o)
    # the two copies see different data from here on, so shared state would show
    xs = torch.stack([X, X.flip(0) * 0.5])
    for _ in range(2):
        sub_opt.zero_grad()
        vmapens.per_member(nn.MSELoss())(sub(xs, in_dims=0), Y).sum().backward()
        sub_opt.step()
        for m, o, x in zip(twins, twin_opts, xs, strict=True):
            o.zero_grad()
            nn.MSELoss()(m(x), Y).backward()
            o.step()
    assert _max_diff(sub, twins) < 1e-9  # NAdam with BatchNorm: 1e-13 trained straight


_FLAGS = [
    (vmapens.StackedSGD, torch.optim.SGD, "nesterov", {"lr": [0.1, 0.05], "momentum": 0.9}),
    (vmapens.StackedRMSprop, torch.optim.RMSprop, "centered", {"lr": [0.01, 0.02]}),
    (
        vmapens.StackedAdam,
        torch.optim.Adam,
        "decoupled_weight_decay",
        {"lr": [0.1, 0.05], "weight_decay": 0.1},
    ),  # fmt: skip
]


@pytest.mark.parametrize(("stacked", "plain", "flag", "kw"), _FLAGS, ids=[f[2] for f in _FLAGS])
def test_a_flag_given_one_value_per_member_is_refused(stacked, plain, flag, kw) -> None:
    """A flag given as a list of one bool per member (what a sweep over it hands the
    optimizer) was taken and read as one truthy value: the member given ``False`` trained with
    the flag on (SGD's nesterov 0.082 off after 3 steps). Refused now, before anything is
    built; each value alone is what torch's optimizer takes."""
    ens = vmapens.Ensemble(lambda: nn.Linear(2, 1).double(), n=2, seed=0)
    with pytest.raises(TypeError, match=f"`{flag}` must be a bool, got \\[False, True\\]"):
        stacked(ens, **{flag: [False, True]}, **kw)
    opt = stacked(ens, **{flag: True}, **kw)
    with pytest.raises(TypeError, match=f"`{flag}` must be a bool"):
        opt.add_param_group({"params": [torch.zeros(2, 1, requires_grad=True)], flag: [True]})
    assert len(opt.param_groups) == 1
    plains = ens.unstack()
    popts = [plain(m.parameters(), **{flag: True}, **_member(kw, i)) for i, m in enumerate(plains)]
    for _ in range(3):
        opt.zero_grad()
        vmapens.per_member(nn.MSELoss())(ens(X), Y).sum().backward()
        opt.step()
        for m, o in zip(plains, popts, strict=True):
            o.zero_grad()
            nn.MSELoss()(m(X), Y).backward()
            o.step()
    assert _max_diff(ens, plains) < 1e-12


def test_a_sweep_over_a_flag_with_a_lambda_optimizer_is_refused() -> None:
    """``Sweep`` with an optimizer given as a lambda (no table to check names against) and a
    ``space`` that sweeps SGD's ``nesterov``: the trial that drew ``False`` trained with
    Nesterov momentum (0.022 off after 3 epochs). The optimizer refuses the list of flags
    now, as the sweep refuses the flag for the class itself."""

    def factory() -> nn.Module:
        return nn.Linear(2, 1).double()

    sweep = vmapens.sweep.Sweep(
        factory,
        lambda t: {
            "lr": t.suggest_categorical("lr", [0.1, 0.05]),
            "nesterov": t.suggest_categorical("nesterov", [False, True]),
        },
        backend="grid",
        grid={"lr": [0.1, 0.05], "nesterov": [False, True]},
        seed=0,
        monitor="train_loss",
        optimizer=lambda ens, **kw: vmapens.StackedSGD(ens, momentum=0.9, **kw),
    )
    with pytest.raises(TypeError, match="`nesterov` must be a bool"):
        sweep.run((X, Y), nn.MSELoss(), epochs=3, shuffle=False, progress=False)
