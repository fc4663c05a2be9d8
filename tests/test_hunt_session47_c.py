"""Session 47 (c): the lifecycle of an ensemble around training.

Checkpoints that resume, sub-ensembles cut by index and restored from a file of other
members, masked steps around a save, each checked against plain modules trained alone with
torch.optim (or, for a resumed fit, against the run that never stopped, bit for bit).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    RandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

import vmapens
from vmapens.seeds import bootstrap_indices

F64 = {"dtype": torch.float64}
G = torch.Generator().manual_seed(0)
X, Y = torch.randn(6, 3, generator=G, **F64), torch.randn(6, 2, generator=G, **F64)


def mlp():
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def ens_step(ens, opt, mask=None):
    opt.zero_grad()
    vmapens.per_member(nn.MSELoss())(ens(X), Y).sum().backward()
    opt.step(mask)


def plain_step(models, opts):
    for model, opt in zip(models, opts, strict=True):
        opt.zero_grad()
        nn.functional.mse_loss(model(X), Y).backward()
        opt.step()


def assert_members(ens, models, atol=1e-13):
    for member, model in zip(ens.unstack(), models, strict=True):
        torch.testing.assert_close(member.state_dict(), model.state_dict(), rtol=0, atol=atol)


def test_permuted_sub_ensemble_restored_from_a_sub_checkpoint_trains_as_plain_adam(tmp_path):
    # A file holding members [3, 0, 2] (a sub-ensemble with its own optimizer) restored into
    # another run's fresh[[0, 3]]: each row must get its own member's weights, Adam moments,
    # step count and learning rate, whatever the order of either side.
    lrs = [0.01, 0.02, 0.03, 0.04]
    ens = vmapens.Ensemble(mlp, n=4, seed=0)
    twins = ens.unstack()
    opt = vmapens.StackedAdam(ens, lr=lrs)
    plain = [torch.optim.Adam(t.parameters(), lr=lr) for t, lr in zip(twins, lrs, strict=True)]
    ens_step(ens, opt)
    plain_step(twins, plain)
    rows = [3, 0, 2]
    sub = ens[rows]
    sub_opt = opt.select(rows, sub)
    ens_step(sub, sub_opt)
    plain_step([twins[r] for r in rows], [plain[r] for r in rows])
    vmapens.save(sub, tmp_path / "sub.pt", sub_opt)

    fresh = vmapens.Ensemble(mlp, n=4, seed=7)
    fresh_opt = vmapens.StackedAdam(fresh, lr=0.5)
    kept = [0, 3]
    target = fresh[torch.tensor(kept)]
    target_opt = fresh_opt.select(kept, target)
    vmapens.restore(tmp_path / "sub.pt", target, target_opt)
    assert list(target_opt.param_groups[0]["lr"]) == [0.01, 0.04]
    for _ in range(2):
        ens_step(target, target_opt)
        plain_step([twins[r] for r in kept], [plain[r] for r in kept])
    assert_members(target, [twins[r] for r in kept])

    # and its member files load into plain modules as exactly those members
    paths = vmapens.save_members(target, tmp_path / "members")
    assert [p.name for p in paths] == ["member_0000.pt", "member_0003.pt"]
    for k, path in enumerate(paths):
        model = mlp()
        model.load_state_dict(torch.load(path, weights_only=True))
        for a, b in zip(model.state_dict().values(), target[k].state_dict().values(), strict=True):
            assert torch.equal(a, b)


OPTIMIZERS = {
    "adamw": (
        lambda e: vmapens.optim.stacked(torch.optim.AdamW)(e, lr=0.05, weight_decay=0.1),
        lambda p: torch.optim.AdamW(p, lr=0.05, weight_decay=0.1),
    ),
    "nadam": (
        lambda e: vmapens.StackedNAdam(e, lr=0.05, weight_decay=0.1, decoupled_weight_decay=True),
        lambda p: torch.optim.NAdam(p, lr=0.05, weight_decay=0.1, decoupled_weight_decay=True),
    ),
    "asgd": (
        lambda e: vmapens.StackedASGD(e, lr=0.05, t0=1),
        lambda p: torch.optim.ASGD(p, lr=0.05, t0=1),
    ),
    "rprop": (lambda e: vmapens.StackedRprop(e, lr=0.05), lambda p: torch.optim.Rprop(p, lr=0.05)),
    "adagrad": (
        lambda e: vmapens.StackedAdagrad(e, lr=0.05, lr_decay=0.1),
        lambda p: torch.optim.Adagrad(p, lr=0.05, lr_decay=0.1),
    ),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_masked_steps_a_checkpoint_and_a_bool_mask_keep_each_members_step_count(tmp_path, name):
    # Members 1 and 2 train alone twice (mask), the ensemble goes through save/load/restore,
    # all train twice, then the bool-mask sub-ensemble [0, 2] once more: member 0 has taken 3
    # steps, member 2 five, each with its own count (bias corrections, ASGD's eta/mu, NAdam's
    # mu_product, Adagrad's decayed lr), as with one plain optimizer each.
    stacked, plain_class = OPTIMIZERS[name]
    ens = vmapens.Ensemble(mlp, n=3, seed=0)
    twins = ens.unstack()
    opt = stacked(ens)
    plain = [plain_class(t.parameters()) for t in twins]
    mask = torch.tensor([False, True, True])
    for _ in range(2):
        ens_step(ens, opt, mask)
        plain_step(twins[1:], plain[1:])
    vmapens.save(ens, tmp_path / "c.pt", opt)
    ens = vmapens.load(tmp_path / "c.pt", mlp)
    opt = stacked(ens)
    vmapens.restore(tmp_path / "c.pt", ens, opt)
    for _ in range(2):
        ens_step(ens, opt)
        plain_step(twins, plain)
    keep = torch.tensor([True, False, True])
    sub = ens[keep]
    sub_opt = opt.select(keep, sub)
    ens_step(sub, sub_opt)
    plain_step([twins[0], twins[2]], [plain[0], plain[2]])
    assert_members(sub, [twins[0], twins[2]])


def test_bootstrap_on_a_sub_ensemble_loaded_from_a_checkpoint_uses_its_global_ids(tmp_path):
    # A checkpoint of ens[[3, 1]] loads with member ids (3, 1); fit's bagging then draws
    # member 3's and member 1's own rows, as bootstrap_indices gives them to a plain loop.
    xs = torch.randn(12, 3, generator=G, **F64)
    ys = torch.randn(12, 2, generator=G, **F64)
    vmapens.save(vmapens.Ensemble(mlp, n=4, seed=0)[[3, 1]], tmp_path / "s.pt")
    sub = vmapens.load(tmp_path / "s.pt", mlp)
    assert tuple(sub.member_ids) == (3, 1) and sub.n_total == 4
    twins = sub.unstack()
    vmapens.fit(
        sub, (xs, ys), nn.MSELoss(), epochs=2, batch_size=12, shuffle=False, bootstrap=True,
        seed=5, progress=False, optimizer=lambda e: vmapens.StackedSGD(e, lr=0.1),
    )  # fmt: skip
    for twin, member_id in zip(twins, sub.member_ids, strict=True):
        rows = bootstrap_indices(12, seed=5, member_id=member_id)
        opt = torch.optim.SGD(twin.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            nn.functional.mse_loss(twin(xs[rows]), ys[rows]).backward()
            opt.step()
    assert_members(sub, twins, atol=0)


class _Stop(Exception):
    pass


def _loader(kind):
    g = torch.Generator()
    xs = torch.randn(40, 3, generator=g.manual_seed(3), **F64)
    ys = torch.randn(40, 1, generator=g, **F64)
    data = TensorDataset(xs, ys)
    if kind == "batch_sampler":  # the generator sits on the batch sampler's sampler
        sampler = RandomSampler(data, generator=torch.Generator().manual_seed(2))
        return DataLoader(data, batch_sampler=BatchSampler(sampler, 8, drop_last=False))
    weights = torch.rand(40, generator=torch.Generator().manual_seed(1), **F64)
    sampler = WeightedRandomSampler(weights, 40, generator=torch.Generator().manual_seed(2))
    return DataLoader(data, batch_size=8, sampler=sampler)


def _run(kind, path, steps, stop_at=None):
    torch.manual_seed(11)
    ens = vmapens.Ensemble(
        lambda: nn.Sequential(
            nn.Linear(3, 8), nn.Dropout(0.3), nn.Tanh(), nn.Linear(8, 1)
        ).double(),
        n=3,
        seed=0,
    )
    opt = vmapens.StackedAdam(ens, lr=[0.1, 0.05, 0.01])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)

    def stop(history):
        if history.epochs == stop_at:
            raise _Stop

    history = vmapens.fit(
        ens, _loader(kind), nn.MSELoss(), epochs=4, steps=steps, optimizer=opt, scheduler=sched,
        callbacks=[stop] if stop_at else [], val_data=_VAL, patience=1, progress=False,
        checkpoint=path,
    )  # fmt: skip
    return ens, opt, history


_VAL = (torch.randn(10, 3, generator=G, **F64), torch.randn(10, 1, generator=G, **F64))


@pytest.mark.parametrize("steps", [None, 3], ids=["whole-passes", "cut-mid-pass"])
@pytest.mark.parametrize("kind", ["batch_sampler", "weighted"])
def test_resume_with_a_samplers_own_generator_dropout_and_stopped_members_is_exact(
    tmp_path, kind, steps
):
    # A sampler's own generator (inside a BatchSampler, or a WeightedRandomSampler's), dropout
    # from the global RNG, StepLR and early-stopped members: interrupted after epoch 2 and
    # resumed in a new ensemble with another global RNG state, the run ends bit for bit where
    # the run that never stopped ends.
    straight, straight_opt, straight_h = _run(kind, tmp_path / "a.pt", steps)
    with pytest.raises(_Stop):
        _run(kind, tmp_path / "b.pt", steps, stop_at=2)
    torch.manual_seed(999)
    resumed, resumed_opt, resumed_h = _run(kind, tmp_path / "b.pt", steps)
    for a, b in zip(straight.state_dict().values(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(straight_h.stopped_epoch, resumed_h.stopped_epoch)
    for a, b in [
        (straight_h.train_loss, resumed_h.train_loss),
        (straight_h.val_loss, resumed_h.val_loss),
    ]:
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert list(straight_opt.param_groups[0]["lr"]) == list(resumed_opt.param_groups[0]["lr"])
