"""Hunt: PBT against its documented formula (plain modules and torch.optim as truth), the best
infinity in PBT's ranking, and optuna's GridSampler under Sweep's ask-and-tell."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from torch import nn

from vmapens import Ensemble, StackedAdam, fit
from vmapens.callbacks import EarlyStopping, LRScheduler
from vmapens.optim import ReduceLROnPlateau
from vmapens.pbt import PBT
from vmapens.seeds import member_seed
from vmapens.sweep import Sweep


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 2, generator=g, dtype=torch.float64)
    return x, torch.sin(x.sum(1, keepdim=True))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1)).double()


def _scheduler(kind: str, opt: torch.optim.Optimizer) -> Any:
    if kind == "plateau":
        cls = (
            ReduceLROnPlateau
            if isinstance(opt, StackedAdam)
            else torch.optim.lr_scheduler.ReduceLROnPlateau
        )
        return cls(opt, factor=0.5, patience=0)
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=2, eta_min=0.001)


@pytest.mark.parametrize("kind", ["plateau", "cosine"])
def test_pbt_copy_continues_as_its_source(kind: str) -> None:
    """Documented formula: every `interval` epochs the bottom `fraction` copies a top member
    (weights, Adam moments and step, scheduler state: the plateau record, the cosine base lr)
    and then multiplies its lr by a factor; it then trains on as the source's plain module,
    optimizer and scheduler would (cosine: its restart at epoch 3 starts from the base lr)."""
    x, y = _data()
    lrs, n, epochs, seed = [0.002, 0.05, 0.02, 0.1], 4, 4, 5
    ens = Ensemble(_mlp, n=n, seed=seed)
    opt = StackedAdam(ens, lr=list(lrs))
    pbt = PBT(interval=1, fraction=0.25, factors=(2.0,), seed=0)
    fit(ens, (x, y), nn.MSELoss(), epochs=epochs, batch_size=8, shuffle=False,
        optimizer=opt, val_data=(x, y), progress=False,
        callbacks=[EarlyStopping(restore_best=False), LRScheduler(_scheduler(kind, opt)), pbt])  # fmt: skip

    # Truth: plain modules, torch.optim.Adam and torch's schedulers, PBT written out.
    mods = []
    for i in range(n):
        torch.manual_seed(member_seed(seed, i))
        mods.append(_mlp())
    opts = [torch.optim.Adam(m.parameters(), lr=lr) for m, lr in zip(mods, lrs, strict=True)]
    scheds = [_scheduler(kind, o) for o in opts]
    log = []
    for epoch in range(epochs):
        for m, o in zip(mods, opts, strict=True):
            for b in range(0, 16, 8):
                o.zero_grad()
                nn.functional.mse_loss(m(x[b : b + 8]), y[b : b + 8]).backward()
                o.step()
        with torch.no_grad():
            val = [nn.functional.mse_loss(m(x), y).item() for m in mods]
        for s, v in zip(scheds, val, strict=True):
            s.step(v) if kind == "plateau" else s.step()
        order = sorted(range(n), key=lambda i: val[i])
        src, dst = order[0], order[-1]  # q = 1 of 4: one top member, drawn surely
        mods[dst].load_state_dict(copy.deepcopy(mods[src].state_dict()))
        opts[dst].load_state_dict(copy.deepcopy(opts[src].state_dict()))
        scheds[dst].load_state_dict(copy.deepcopy(scheds[src].state_dict()))
        for group in opts[dst].param_groups:
            group["lr"] *= 2.0
        log.append((epoch, [src], [dst]))
    assert pbt.log == log
    for i, m in enumerate(mods):
        for name, p in m.named_parameters():
            got = ens.stacked_params()[name][i]
            torch.testing.assert_close(got, p.detach(), rtol=1e-9, atol=1e-12)
    assert [float(v) for v in opt.param_groups[0]["lr"]] == pytest.approx(
        [o.param_groups[0]["lr"] for o in opts], rel=1e-12
    )


def _psnr(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return -10 * torch.log10(((out - target) ** 2).mean())


def test_pbt_ranks_a_perfect_member_first() -> None:
    """A +inf PSNR in mode "max" is the best score (as EarlyStopping and member_scores count
    it): the worst member copies it."""
    x = torch.randn(8, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.zeros(8, 1, dtype=torch.float64)
    ens = Ensemble(lambda: nn.Linear(2, 1).double(), n=4, seed=0)
    with torch.no_grad():
        for t in ens.stacked_params().values():
            t[2] = 0.0  # member 2 predicts the target exactly: PSNR +inf
    truth = [_psnr(x @ w.T + b, y).item() for w, b in
             zip(ens.stacked_params()["weight"], ens.stacked_params()["bias"], strict=True)]  # fmt: skip
    assert truth[2] == math.inf
    worst = min(range(4), key=lambda i: truth[i])
    pbt = PBT(interval=1, monitor="val_psnr", mode="max", seed=0)
    # lr 0: every member stays as built, so the ranking is the one computed above
    fit(ens, (x, y), nn.MSELoss(), epochs=1, optimizer=StackedAdam(ens, lr=0.0),
        val_data=(x, y), metrics={"psnr": _psnr}, progress=False, callbacks=[pbt])  # fmt: skip
    assert pbt.log == [(0, [2], [worst])]
    assert torch.equal(ens.stacked_params()["weight"][worst], ens.stacked_params()["weight"][2])


@pytest.mark.parametrize(("n_trials", "per"), [(3, None), (5, 2)])
def test_grid_sampler_study_tells_every_trial(n_trials: int, per: int | None) -> None:
    """GridSampler stops its study from `tell` once the grid is used up (a RuntimeError
    outside `optimize`): every trial is still told (with 5 in rounds of 2, the last round's
    other trial too), and the result is returned."""
    optuna = pytest.importorskip("optuna")
    x, y = _data()
    grid = [0.0, 0.3, 0.1]
    study = optuna.create_study(
        direction="minimize", sampler=optuna.samplers.GridSampler({"lr": grid}, seed=0)
    )
    sweep = Sweep(lambda: nn.Linear(2, 1).double(),
                  lambda t: {"lr": t.suggest_categorical("lr", grid)}, study=study, seed=7)  # fmt: skip
    result = sweep.run((x, y), nn.MSELoss(), n_trials=n_trials, per_ensemble=per, epochs=2,
                       batch_size=16, val_data=(x, y), progress=False)  # fmt: skip
    told = study.trials
    assert [t.state.name for t in told] == ["COMPLETE"] * n_trials
    assert sorted({t.params["lr"] for t in told}) == sorted(grid)
    for t, r in zip(told, result.trials, strict=True):
        # Truth: the trial's member alone, plain Adam, full batch; its best val loss.
        torch.manual_seed(member_seed(7, t.number))
        m = nn.Linear(2, 1).double()
        o = torch.optim.Adam(m.parameters(), lr=t.params["lr"])
        best = math.inf
        for _ in range(2):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
            with torch.no_grad():
                best = min(best, nn.functional.mse_loss(m(x), y).item())
        assert r.state == "complete" and r.params == t.params
        assert t.value == pytest.approx(best, rel=1e-10) and r.value == t.value
