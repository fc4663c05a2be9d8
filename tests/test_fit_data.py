"""fit with per-member data, per-member and out-of-bag validation, schedulers and resume checks.

The truth is always N plain modules, each trained alone with torch.optim on its own batches.
"""

from __future__ import annotations

import copy

import models
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from truth import assert_members_equal, batch_plan, resample, train_alone

import vmapens
from vmapens.callbacks import Checkpoint, EarlyStopping

TOL = dict(rtol=1e-9, atol=1e-10)
N = 3
F64 = dict(dtype=torch.float64)
G = torch.Generator().manual_seed(0)
XS, YS = torch.randn(N, 12, 4, generator=G, **F64), torch.randn(N, 12, 3, generator=G, **F64)
XV, YV = torch.randn(N, 5, 4, generator=G, **F64), torch.randn(N, 5, 3, generator=G, **F64)


def pair():
    twins = [models.MLP().double() for _ in range(N)]
    return vmapens.Ensemble.from_modules([copy.deepcopy(m) for m in twins]), twins


# -- 5. per-member data ----------------------------------------------------------------------


def test_per_member_tensors_train_each_member_on_its_own_fold():
    ens, twins = pair()
    h = vmapens.fit(ens, (XS, YS), nn.MSELoss(), in_dims=(0, 0), epochs=2, batch_size=4,
                    shuffle=False, lr=1e-2, val_data=(XV, YV), progress=False, seed=0,
                    callbacks=[EarlyStopping(restore_best=False)])  # fmt: skip
    for i, twin in enumerate(twins):
        batches = [(XS[i, k : k + 4], YS[i, k : k + 4]) for k in range(0, 12, 4)] * 2
        train_alone(twin, batches)
    assert_members_equal(ens, twins)
    with torch.no_grad():
        val = torch.stack([nn.functional.mse_loss(t(XV[i]), YV[i]) for i, t in enumerate(twins)])
    torch.testing.assert_close(h.val_loss[-1], val, **TOL)


def test_per_member_tensors_shuffle_like_one_member_alone():
    # The shuffled order is keyed by (seed, pass) (docs/fit.md), the same for every member:
    # member i alone sees its own slice in the order the documented recipe gives.
    ens, twins = pair()
    vmapens.fit(ens, (XS, YS), nn.MSELoss(), in_dims=0, epochs=2, batch_size=5, lr=1e-2,
                progress=False, seed=3)  # fmt: skip
    plan = batch_plan(12, 5, 6, seed=3)  # 3 batches a pass, 2 passes
    for i, twin in enumerate(twins):
        train_alone(twin, [(XS[i, rows], YS[i, rows]) for rows in plan])
    assert_members_equal(ens, twins)


def test_one_dataloader_per_member():
    ens, twins = pair()
    loaders = [DataLoader(TensorDataset(XS[i], YS[i]), batch_size=4) for i in range(N)]
    vmapens.fit(ens, loaders, nn.MSELoss(), in_dims=0, epochs=2, lr=1e-2, progress=False)
    for i, twin in enumerate(twins):
        train_alone(twin, list(loaders[i]) * 2)
    assert_members_equal(ens, twins)


def test_out_of_bag_validation_is_each_members_loss_on_its_left_out_rows():
    x, y = XS[0], YS[0]
    ens, twins = pair()
    h = vmapens.fit(ens, (x, y), nn.MSELoss(), bootstrap=True, val_data="oob", epochs=2,
                    lr=1e-2, progress=False, seed=5, callbacks=[EarlyStopping(restore_best=False)])  # fmt: skip
    for i, twin in enumerate(twins):
        rows = resample(12, 5, i)
        train_alone(twin, [(x[rows], y[rows])] * 2)
        left_out = torch.ones(12, dtype=torch.bool)
        left_out[rows] = False
        with torch.no_grad():
            expected = nn.functional.mse_loss(twin(x[left_out]), y[left_out])
        torch.testing.assert_close(h.val_loss[-1, i], expected, **TOL)
    assert_members_equal(ens, twins)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(in_dims=0, data=(XS[:2], YS[:2])), ValueError, r"every tensor of `data` needs shape \[n=3, samples"),
        (dict(in_dims=1), ValueError, r"`in_dims` must be None, 0 or a pair \(data's, val_data's\) of them, got 1"),
        (dict(val_data="oob"), ValueError, r"`val_data` must be .* or 'oob' with bootstrap=True"),
        (dict(val_data=(XV[:2], YV[:2]), in_dims=(None, 0)), ValueError, r"every tensor of `val_data` needs shape"),
        (dict(in_dims=0, data=[DataLoader(TensorDataset(XS[0], YS[0]))] * 2), ValueError,
         r"one DataLoader per member: expected 3, got 2"),
        (dict(in_dims=(0, 1)), ValueError, r"`in_dims` must be None, 0 or a pair"),
        (dict(scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau), TypeError,
         r"vmapens.optim.ReduceLROnPlateau"),
        (dict(scheduler=3), TypeError, r"`scheduler` must be an LR scheduler"),
    ],
    ids=["short-member-dim", "in-dims-1", "oob-without-bootstrap", "short-val", "loader-count",
         "in-dims-pair", "torch-plateau", "not-a-scheduler"],
)  # fmt: skip
def test_bad_data_options_change_nothing(kwargs, error, match):
    ens, _ = pair()
    before = copy.deepcopy(ens.state_dict())
    options = dict(data=(XS, YS), in_dims=0, epochs=1, progress=False) | kwargs
    data = options.pop("data")
    if "in_dims" in kwargs and kwargs["in_dims"] == 1:
        data = (XS[0], YS[0])
    with pytest.raises(error, match="fit: .*" + match):
        vmapens.fit(ens, data, nn.MSELoss(), **options)
    torch.testing.assert_close(ens.state_dict(), before, rtol=0, atol=0)


# -- 6. schedulers and resuming with other arguments -------------------------------------------


def test_scheduler_per_epoch_matches_step_lr_on_each_member():
    ens, twins = pair()
    x, y = XS[0], YS[0]
    vmapens.fit(ens, (x, y), nn.MSELoss(), epochs=4, lr=[1e-2, 2e-2, 3e-2], progress=False,
                scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))  # fmt: skip
    for i, twin in enumerate(twins):
        opt = torch.optim.Adam(twin.parameters(), lr=[1e-2, 2e-2, 3e-2][i])
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        for _ in range(4):
            opt.zero_grad()
            nn.functional.mse_loss(twin(x), y).backward()
            opt.step()
            sched.step()
    assert_members_equal(ens, twins)


def test_per_member_plateau_matches_torch_plateau_on_each_member():
    ens = vmapens.Ensemble(models.MLP, N, seed=0)
    opt = vmapens.StackedSGD(ens, lr=[0.1, 0.2, 0.3])
    sched = vmapens.optim.ReduceLROnPlateau(opt, patience=1, factor=0.5, cooldown=1)
    plain = [torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr) for lr in (0.1, 0.2, 0.3)]
    scheds = [torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=1, factor=0.5, cooldown=1)
              for o in plain]  # fmt: skip
    metrics = torch.tensor([[3.0, 3, 3], [2, 3, 4], [2, 3, 4], [2, 1, 4], [2, 1, 5], [1, 1, 5]])
    for row in metrics:
        sched.step(row)
        for s, v in zip(scheds, row.tolist(), strict=True):
            s.step(v)
        assert list(opt.param_groups[0]["lr"]) == [o.param_groups[0]["lr"] for o in plain]


def _interrupted_then_resumed(tmp_path, **options):
    """A fit stopped by a callback after epoch 2, then resumed: the final state."""

    class Stop(Exception):
        pass

    def stop_after_two(history):
        if history.epochs == 2:
            raise Stop

    ens = vmapens.Ensemble(models.MLP, N, seed=0).double()
    with pytest.raises(Stop):
        vmapens.fit(ens, **options, callbacks=[stop_after_two])
    resumed = vmapens.Ensemble(models.MLP, N, seed=0).double()
    history = vmapens.fit(resumed, **options)
    return resumed, history


def test_scheduler_state_is_in_the_checkpoint_resume_is_bit_identical(tmp_path):
    options = dict(data=(XS[0], YS[0]), loss_fn=nn.MSELoss(), epochs=4, batch_size=5,
                   lr=[1e-2, 2e-2, 3e-2], progress=False, seed=1, checkpoint=tmp_path / "ck.pt",
                   scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))  # fmt: skip
    resumed, _ = _interrupted_then_resumed(tmp_path, **options)
    straight = vmapens.Ensemble(models.MLP, N, seed=0).double()
    vmapens.fit(straight, **{**options, "checkpoint": tmp_path / "straight.pt"})
    torch.testing.assert_close(resumed.state_dict(), straight.state_dict(), rtol=0, atol=0)


@pytest.mark.parametrize(
    "change,name",
    [
        (dict(lr=[1e-2, 2e-2, 1.0]), "optimizer"),
        (dict(val_data=(XV[0] + 1, YV[0])), "val_data"),
        (
            dict(scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9)),
            "scheduler",
        ),
    ],
    ids=["lr", "val_data", "scheduler"],
)
def test_resume_with_other_arguments_is_refused_unless_overridden(tmp_path, change, name):
    path = tmp_path / "ck.pt"
    options = dict(epochs=2, lr=[1e-2, 2e-2, 3e-2], val_data=(XV[0], YV[0]), progress=False,
                   seed=1, checkpoint=path,
                   scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))  # fmt: skip
    ens = vmapens.Ensemble(models.MLP, N, seed=0).double()
    vmapens.fit(ens, (XS[0], YS[0]), nn.MSELoss(), **options)
    file_before = path.read_bytes()
    other = vmapens.Ensemble(models.MLP, N, seed=0).double()
    before = copy.deepcopy(other.state_dict())
    with pytest.raises(ValueError, match=rf"cannot resume .*{name}.*override=\('{name}',\)"):
        vmapens.fit(other, (XS[0], YS[0]), nn.MSELoss(), **{**options, **change, "epochs": 3})
    torch.testing.assert_close(other.state_dict(), before, rtol=0, atol=0)
    assert path.read_bytes() == file_before
    # With override the run resumes and this run's value wins.
    seen = LrAtStart()
    opt_override = {**options, **change, "epochs": 3, "checkpoint": None,
                    "callbacks": [Checkpoint(path, override=(name,)), seen]}  # fmt: skip
    h = vmapens.fit(other, (XS[0], YS[0]), nn.MSELoss(), **opt_override)
    assert h.epochs == 3
    if name == "optimizer":  # this run's learning rates, not the checkpoint's scheduled ones
        assert seen.lr == change["lr"]


class LrAtStart(vmapens.Callback):
    def on_train_start(self, ctx: vmapens.callbacks.Context) -> None:
        self.lr = [float(v) for v in ctx.optimizer.param_groups[0]["lr"]]


# -- compile="auto" ------------------------------------------------------------------------------


def _graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.parametrize(
    "pays_after_s", [0.0, 3600.0], ids=["long-run-compiles", "short-run-eager"]
)
def test_auto_compile_switches_only_when_it_pays_and_results_agree(monkeypatch, pays_after_s):
    monkeypatch.setattr(vmapens._autocompile, "COMPILE_PAYS_AFTER_S", pays_after_s)
    options = dict(epochs=3, batch_size=4, shuffle=False, lr=1e-2, progress=False)
    auto, twins = pair()
    eager = vmapens.Ensemble.from_modules(twins)
    before = _graphs()
    vmapens.fit(auto, (XS[0], YS[0]), nn.MSELoss(), compile="auto", **options)
    compiled = _graphs() > before
    assert compiled == (pays_after_s == 0.0)
    vmapens.fit(eager, (XS[0], YS[0]), nn.MSELoss(), **options)
    torch.testing.assert_close(auto.state_dict(), eager.state_dict(), **TOL)
