"""Session 48 (c): what leaves the process and comes back.

Checkpoints restored into fresh or permuted sub-ensembles with plain torch optimizers, with
per-group per-member hyperparameters, with parameters whose step counts differ, and with
parametrized members; each checked against plain modules trained alone with torch.optim
(state carried over by ``state_dict()`` / ``load_state_dict()``, as a plain resume does).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

import vmapens

F64 = {"dtype": torch.float64}
G = torch.Generator().manual_seed(0)
X, Y = torch.randn(6, 3, generator=G, **F64), torch.randn(6, 2, generator=G, **F64)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def ens_step(ens, opt, **kw) -> None:
    opt.zero_grad()
    vmapens.per_member(nn.MSELoss())(ens(X, **kw), Y).sum().backward()
    opt.step()


def plain_step(models, opts, **kw) -> None:
    for model, opt in zip(models, opts, strict=True):
        opt.zero_grad()
        nn.functional.mse_loss(model(X, **kw), Y).backward()
        opt.step()


def assert_members(ens, models, atol=1e-13) -> None:
    for member, model in zip(ens.unstack(), models, strict=True):
        torch.testing.assert_close(member.state_dict(), model.state_dict(), rtol=0, atol=atol)


def _groups(params, lr_a, lr_b):
    params = list(params)
    return [{"params": params[:2], "lr": lr_a}, {"params": params[2:], "lr": lr_b}]


def test_a_plain_torch_optimizer_with_two_groups_restores_into_a_permuted_sub_ensemble(tmp_path):
    # torch.optim.AdamW over the stacked parameters (docs/index.md: any elementwise torch
    # optimizer works on the stack), two param groups: its moments cut to the rows [2, 0]
    # of a fresh ensemble's select, its shared 0-dim `step` kept, then trained on.
    ens = vmapens.Ensemble(mlp, n=3, seed=0)
    twins = ens.unstack()
    opt = torch.optim.AdamW(_groups(ens.parameters(), 0.01, 0.1))
    plain = [torch.optim.AdamW(_groups(t.parameters(), 0.01, 0.1)) for t in twins]
    for _ in range(2):
        ens_step(ens, opt)
        plain_step(twins, plain)
    vmapens.save(ens, tmp_path / "c.pt", opt)

    rows = [2, 0]
    sub = vmapens.Ensemble(mlp, n=3, seed=9).select(rows)
    sub_opt = torch.optim.AdamW(_groups(sub.parameters(), 0.5, 0.5))
    vmapens.restore(tmp_path / "c.pt", sub, sub_opt)
    assert [g["lr"] for g in sub_opt.param_groups] == [0.01, 0.1]
    for _ in range(2):
        ens_step(sub, sub_opt)
        plain_step([twins[r] for r in rows], [plain[r] for r in rows])
    assert_members(sub, [twins[r] for r in rows], atol=0)


def test_per_group_per_member_hyperparameters_follow_their_rows_into_a_sub_ensemble(tmp_path):
    # Two groups, each with its own per-member lr; weight_decay per member in one group and a
    # per-member beta1 in a tuple: all cut to the rows [2, 0], as each member's plain Adam has.
    lr_a, lr_b, wd, b1 = [0.01, 0.02, 0.03], [0.1, 0.2, 0.3], [0.0, 0.1, 0.5], [0.9, 0.8, 0.7]
    ens = vmapens.Ensemble(mlp, n=3, seed=0)
    twins = ens.unstack()
    groups = _groups(ens.parameters(), lr_a, lr_b)
    groups[1]["weight_decay"] = wd
    opt = vmapens.StackedAdam(groups, betas=(torch.tensor(b1, **F64), 0.99))
    plain = []
    for i, t in enumerate(twins):
        g = _groups(t.parameters(), lr_a[i], lr_b[i])
        g[1]["weight_decay"] = wd[i]
        plain.append(torch.optim.Adam(g, betas=(b1[i], 0.99)))
    for _ in range(2):
        ens_step(ens, opt)
        plain_step(twins, plain)
    vmapens.save(ens, tmp_path / "c.pt", opt)

    rows = [2, 0]
    sub = vmapens.Ensemble(mlp, n=3, seed=3).select(rows)
    sub_groups = _groups(sub.parameters(), 1.0, 1.0)
    sub_groups[1]["weight_decay"] = 0.0
    sub_opt = vmapens.StackedAdam(sub_groups, betas=(0.5, 0.5))
    vmapens.restore(tmp_path / "c.pt", sub, sub_opt)
    assert list(sub_opt.param_groups[1]["weight_decay"]) == [0.5, 0.0]
    assert list(sub_opt.param_groups[0]["betas"][0]) == [0.7, 0.9]
    for _ in range(2):
        ens_step(sub, sub_opt)
        plain_step([twins[r] for r in rows], [plain[r] for r in rows])
    assert_members(sub, [twins[r] for r in rows])


class TwoBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 2).double(), nn.Linear(3, 2).double()

    def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        return self.a(x) + (self.b(x) if use_b else 0)


STEP_COUNTED = {
    "nadam": (vmapens.StackedNAdam, torch.optim.NAdam, {"lr": 0.05}),
    "asgd": (vmapens.StackedASGD, torch.optim.ASGD, {"lr": 0.05, "t0": 1}),
    "adagrad": (vmapens.StackedAdagrad, torch.optim.Adagrad, {"lr": 0.05, "lr_decay": 0.1}),
}


@pytest.mark.parametrize("name", sorted(STEP_COUNTED))
def test_parameters_with_other_step_counts_resume_into_a_stepped_optimizer(name, tmp_path):
    # Branch `b` gets no gradient for the first two steps, so its step count trails `a`'s by
    # two (plain torch keeps a count per parameter). The file is restored into an optimizer
    # that has stepped on its own (its state must be replaced whole) and into a permuted
    # sub-ensemble; then a file saved before any step (empty state) is restored over a stepped
    # optimizer, which must forget its state, as torch's load_state_dict does.
    stacked, torch_class, kw = STEP_COUNTED[name]
    ens = vmapens.Ensemble(TwoBranches, n=3, seed=0)
    twins = ens.unstack()
    opt = stacked(ens, **kw)
    plain = [torch_class(t.parameters(), **kw) for t in twins]
    for use_b in (False, False, True):
        ens_step(ens, opt, use_b=use_b)
        plain_step(twins, plain, use_b=use_b)
    vmapens.save(ens, tmp_path / "c.pt", opt)
    at_save = copy.deepcopy((twins, plain))

    other = vmapens.Ensemble(TwoBranches, n=3, seed=4)
    other_opt = stacked(other, **kw)
    for _ in range(4):
        ens_step(other, other_opt)
    vmapens.restore(tmp_path / "c.pt", other, other_opt)
    for _ in range(2):
        ens_step(other, other_opt)
        plain_step(twins, plain)
    assert_members(other, twins)

    twins, plain = copy.deepcopy(at_save)
    rows = [1, 2]
    sub = vmapens.Ensemble(TwoBranches, n=3, seed=4).select(rows)
    sub_opt = stacked(sub, **kw)
    vmapens.restore(tmp_path / "c.pt", sub, sub_opt)
    for _ in range(2):
        ens_step(sub, sub_opt)
        plain_step([twins[r] for r in rows], [plain[r] for r in rows])
    assert_members(sub, [twins[r] for r in rows])

    fresh = vmapens.Ensemble(TwoBranches, n=3, seed=0)
    alone = fresh.unstack()
    fresh_opt = stacked(fresh, **kw)
    vmapens.save(fresh, tmp_path / "empty.pt", fresh_opt)
    plain = [torch_class(t.parameters(), **kw) for t in alone]
    empty = [copy.deepcopy(p.state_dict()) for p in plain]
    start = [copy.deepcopy(t.state_dict()) for t in alone]
    for use_b in (True, False):
        ens_step(fresh, fresh_opt, use_b=use_b)
        plain_step(alone, plain, use_b=use_b)
    vmapens.restore(tmp_path / "empty.pt", fresh, fresh_opt)
    for t, p, sd, st in zip(alone, plain, start, empty, strict=True):
        t.load_state_dict(sd)
        p.load_state_dict(st)
    for use_b in (False, True):
        ens_step(fresh, fresh_opt, use_b=use_b)
        plain_step(alone, plain, use_b=use_b)
    assert_members(fresh, alone, atol=0)


def orthogonal() -> nn.Module:
    m = mlp()
    parametrizations.orthogonal(m[0])
    return m


def weight_normed() -> nn.Module:
    m = mlp()
    parametrizations.weight_norm(m[2])
    return m


@pytest.mark.parametrize("factory", [orthogonal, weight_normed], ids=["orthogonal", "weight_norm"])
def test_parametrized_members_resume_into_a_sub_ensemble_and_load_from_member_files(
    factory, tmp_path
):
    # The parametrization's `original` tensors (and orthogonal's `base` buffer) are each
    # member's own: member files load strictly into the user's parametrized class, and a
    # checkpoint restored into a permuted sub-ensemble trains on as each member's plain Adam.
    lrs = [0.01, 0.02, 0.03]
    ens = vmapens.Ensemble(factory, n=3, seed=0)
    twins = ens.unstack()
    opt = vmapens.StackedAdam(ens, lr=lrs)
    plain = [torch.optim.Adam(t.parameters(), lr=lr) for t, lr in zip(twins, lrs, strict=True)]
    for _ in range(2):
        ens_step(ens, opt)
        plain_step(twins, plain)
    for fmt in ("pt", "safetensors"):
        if fmt == "safetensors":
            pytest.importorskip("safetensors")
        vmapens.save_members(ens, tmp_path / fmt, format=fmt)
        for state, twin in zip(vmapens.load_members(tmp_path / fmt), twins, strict=True):
            model = factory()
            model.load_state_dict(state, strict=True)
            torch.testing.assert_close(model.state_dict(), twin.state_dict(), rtol=0, atol=1e-11)
            torch.testing.assert_close(model(X), twin(X), rtol=0, atol=1e-11)
    vmapens.save(ens, tmp_path / "c.pt", opt)
    rows = [2, 0]
    sub = vmapens.Ensemble(factory, n=3, seed=5).select(rows)
    sub_opt = vmapens.StackedAdam(sub, lr=0.9)
    vmapens.restore(tmp_path / "c.pt", sub, sub_opt)
    for _ in range(2):
        ens_step(sub, sub_opt)
        plain_step([twins[r] for r in rows], [plain[r] for r in rows])
    assert_members(sub, [twins[r] for r in rows], atol=1e-11)
