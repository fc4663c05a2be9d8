"""Hunt: the options around a step's optimizer (clipping, masks, loss scale, undo) against
N plain modules trained with torch.optim and torch's own clipping, in float64."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import vmapens

N = 3


def factory() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def ensemble_with_grads() -> tuple[vmapens.Ensemble, list[nn.Module]]:
    """An ensemble and its members alone, with the same float64 gradients set by hand (so
    that only the clipping is compared, not the batched backward's round-off)."""
    ens = vmapens.Ensemble(factory, n=N, seed=0).double()
    alone = [copy.deepcopy(m) for m in ens.unstack()]
    gen = torch.Generator().manual_seed(1)
    for name, p in ens.stacked_params().items():
        p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64)
        for i, m in enumerate(alone):
            m.get_parameter(name).grad = p.grad[i].clone()
    return ens, alone


def assert_grads_equal(ens: vmapens.Ensemble, alone: list[nn.Module]) -> None:
    for name, p in ens.stacked_params().items():
        for i, m in enumerate(alone):
            torch.testing.assert_close(p.grad[i], m.get_parameter(name).grad, rtol=1e-15, atol=0)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, "inf"])
@pytest.mark.parametrize("kwargs", [{"foreach": True}, {"foreach": None}, {}])
def test_clip_grad_norm_takes_torchs_keywords(norm_type, kwargs):
    ens, alone = ensemble_with_grads()
    norms = vmapens.optim.clip_grad_norm_(ens, 0.5, norm_type=norm_type, **kwargs)
    want = [torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5, norm_type, **kwargs) for m in alone]
    torch.testing.assert_close(norms, torch.stack(want), rtol=1e-15, atol=0)
    assert_grads_equal(ens, alone)


def test_clip_grad_norm_takes_a_tensor_max_norm_as_torch_does():
    ens, alone = ensemble_with_grads()
    vmapens.optim.clip_grad_norm_(ens, torch.tensor(0.5))
    for m in alone:
        torch.nn.utils.clip_grad_norm_(m.parameters(), torch.tensor(0.5))
    assert_grads_equal(ens, alone)


def test_clip_grad_value_takes_foreach():
    ens, alone = ensemble_with_grads()
    vmapens.optim.clip_grad_value_(ens, 0.3, foreach=True)
    for m in alone:
        torch.nn.utils.clip_grad_value_(m.parameters(), 0.3, foreach=True)
    assert_grads_equal(ens, alone)


def test_error_if_nonfinite_raises_for_a_bad_member_and_changes_nothing():
    ens, alone = ensemble_with_grads()
    ens.stacked_params()["2.bias"].grad[1, 0] = float("nan")
    alone[1].get_parameter("2.bias").grad[0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        torch.nn.utils.clip_grad_norm_(alone[1].parameters(), 0.5, error_if_nonfinite=True)
    before = {k: p.grad.clone() for k, p in ens.stacked_params().items()}
    with pytest.raises(RuntimeError, match=r"clip_grad_norm_: .*member\(s\) \[1\]"):
        vmapens.optim.clip_grad_norm_(ens, 0.5, error_if_nonfinite=True)
    for k, p in ens.stacked_params().items():
        torch.testing.assert_close(p.grad, before[k], rtol=0, atol=0, equal_nan=True)


def test_error_if_nonfinite_clips_finite_members_as_torch():
    ens, alone = ensemble_with_grads()
    norms = vmapens.optim.clip_grad_norm_(ens, 0.5, 2.0, True)
    want = [torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5, 2.0, True) for m in alone]
    torch.testing.assert_close(norms, torch.stack(want), rtol=1e-15, atol=0)
    assert_grads_equal(ens, alone)


@pytest.mark.parametrize("value", [torch.tensor(0.3), "0.3", 1])
def test_clip_grad_value_reads_its_bound_as_torch_does(value):
    ens, alone = ensemble_with_grads()
    vmapens.optim.clip_grad_value_(ens, value)
    for m in alone:
        torch.nn.utils.clip_grad_value_(m.parameters(), value)
    assert_grads_equal(ens, alone)


def test_clip_grad_value_names_a_bound_it_cannot_read():
    ens, _ = ensemble_with_grads()
    before = {k: p.grad.clone() for k, p in ens.stacked_params().items()}
    with pytest.raises(TypeError, match="clip_grad_value_: `clip_value`"):
        vmapens.optim.clip_grad_value_(ens, [0.3])
    for k, p in ens.stacked_params().items():
        assert torch.equal(p.grad, before[k])


def test_fp16_step_with_clipping_and_a_mask_is_one_grad_scaler_per_member():
    """GradScaler's order per member: scale, backward, unscale_, clip, step (skipped on
    overflow), update; a masked member is not trained at all (its scaler not touched)."""
    torch.manual_seed(0)
    ens = vmapens.Ensemble(factory, n=N, seed=0)
    alone = [copy.deepcopy(m) for m in ens.unstack()]
    scale = vmapens.step.LossScale(N, init_scale=2.0**20, growth_interval=2)
    step = vmapens.make_step(
        ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.01), precision="fp16",
        loss_scale=scale, clip_grad_norm=0.5,
    )  # fmt: skip
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in alone]
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=2) for _ in alone]
    x, y = torch.randn(8, 3) * 100, torch.randn(8, 2)
    for t in range(4):
        xx, mask = x * 10.0 ** (t % 3), [True, t % 2 == 0, True]
        step(xx, y, mask=torch.tensor(mask))
        for m, opt, scaler, on in zip(alone, opts, scalers, mask, strict=True):
            if not on:
                continue
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(m(xx), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            scaler.step(opt)
            scaler.update()
        assert scale.scale.tolist() == [s.get_scale() for s in scalers]
    for i, m in enumerate(alone):
        for name, value in m.state_dict().items():
            torch.testing.assert_close(
                ens.unstack()[i].state_dict()[name], value, rtol=1e-5, atol=1e-6
            )


def test_a_loss_that_raises_on_the_second_call_changes_nothing_with_clipping_and_a_mask():
    ens = vmapens.Ensemble(
        lambda: nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)), n=N, seed=0,
        chunk_size=2,
    ).double()  # fmt: skip
    opt = vmapens.StackedAdam(ens, lr=0.1)
    calls = [0]

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] > limit:
            raise ValueError("boom")
        return nn.functional.mse_loss(out, target)

    limit = 10**9
    step = vmapens.make_step(ens, loss, opt, clip_grad_norm=0.1, check=False)
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    step(x, y)
    state = {k: v.clone() for k, v in ens.stacked_state().items()}
    grads = {k: p.grad.clone() for k, p in ens.stacked_params().items()}
    saved = copy.deepcopy(opt.state_dict())
    limit = calls[0] + 1  # the second chunk's loss raises, after the first chunk's backward
    with pytest.raises(ValueError, match="boom"):
        step(x, y, mask=torch.tensor([True, False, True]))
    for k, v in ens.stacked_state().items():
        assert torch.equal(v, state[k])
    for k, p in ens.stacked_params().items():
        assert torch.equal(p.grad, grads[k])
    for key, value in opt.state_dict()["state"].items():
        for name, t in value.items():
            assert torch.equal(t, saved["state"][key][name])
