"""Mixed precision: each member gets what torch.autocast (and a GradScaler) gives it alone."""

from __future__ import annotations

import copy

import models
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import vmap

import vmapens
from vmapens._precision import POLICIES
from vmapens.step import LossScale

# float32 master weights, bf16/fp16 activations: members agree with their lone runs to float32
# round-off in the weights (measured <= 3e-8 after these steps). The optimizer is SGD, whose
# stacked update is torch's to the bit: a 1-ulp float32 difference in a weight (Adam's stacked
# arithmetic vs torch's) can flip that weight's bf16 rounding, and Adam's first steps turn
# any gradient difference into lr-sized ones (the encoder then drifts by ~1e-2).
TOL = dict(rtol=1e-5, atol=1e-6)
LR, MOMENTUM = 0.05, 0.9
N = 3
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# (member, input, target, loss, steps): the layers whose batched form autocast gets wrong.
# bf16 training is chaotic at bf16's resolution: one weight 1 float32-ulp off (a gradient summed
# in another order) may round to another bf16 value at the next step, and the encoder's
# members then drift from their lone runs by ~1e-4 after three steps. It gets one step.
CASES = [
    pytest.param(models.MLP, (16, 4), (16, 3), nn.MSELoss(), 3, id="mlp"),
    pytest.param(models.CNN, (8, 1, 6, 6), (8, 3), nn.MSELoss(), 3, id="cnn-batchnorm"),
    pytest.param(models.Encoder, (4, 5, 8), (4, 3), nn.MSELoss(), 1, id="transformer-encoder"),
]


def data(x_shape, y_shape, steps=3):
    return [(torch.randn(*x_shape), torch.randn(*y_shape)) for _ in range(steps)]


def test_premise_autocast_around_vmap_is_not_per_member():
    """Why the package needs MemberAutocast: vmap's batched linear dodges autocast."""
    w, b, x = torch.randn(N, 5, 4), torch.randn(N, 5), torch.randn(7, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        batched = vmap(F.linear, in_dims=(None, 0, 0))(x, w, b)
        alone = F.linear(x, w[0], b[0])
    assert (batched.dtype, alone.dtype) == (torch.float32, torch.bfloat16)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize(("factory", "x_shape", "y_shape", "loss_fn", "steps"), CASES)
def test_user_autocast_forward_matches_members_alone(
    factory, x_shape, y_shape, loss_fn, steps, precision
):
    ens = vmapens.Ensemble(factory, N, seed=0)
    x = torch.randn(*x_shape)
    with torch.no_grad(), torch.autocast("cpu", dtype=DTYPES[precision]):
        got = ens(x)
        want = torch.stack([m(x) for m in ens.unstack()])
    assert got.dtype == want.dtype == DTYPES[precision]
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=0)


def sgd(ens):
    return vmapens.StackedSGD(ens, lr=LR, momentum=MOMENTUM)


def train_alone(modules, batches, loss_fn, dtype, scalers=None, clip=None, per_member=False):
    for i, m in enumerate(modules):
        opt = torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM)
        for x, y in batches:
            x, y = (x[i], y[i]) if per_member else (x, y)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=dtype):
                loss = loss_fn(m(x), y)
            if scalers is None:
                loss.backward()
                opt.step()
                continue
            scalers[i].scale(loss).backward()
            scalers[i].unscale_(opt)
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
            scalers[i].step(opt)
            scalers[i].update()
    return modules


def assert_members(ens, alone):
    for i, m in enumerate(alone):
        for (name, want), got in zip(m.state_dict().items(), ens[i].state_dict().values()):
            torch.testing.assert_close(got, want, **TOL, msg=f"member {i} {name}")


@pytest.mark.parametrize(("factory", "x_shape", "y_shape", "loss_fn", "steps"), CASES)
def test_bf16_step_matches_members_alone(factory, x_shape, y_shape, loss_fn, steps):
    ens = vmapens.Ensemble(factory, N, seed=0)
    alone = ens.unstack()
    batches = data(x_shape, y_shape, steps)
    step = vmapens.make_step(ens, loss_fn, sgd(ens), precision="bf16")
    for x, y in batches:
        step(x, y)
    assert_members(ens, train_alone(alone, batches, loss_fn, torch.bfloat16))


def test_loop_backend_bf16_step_matches_members_alone():
    ens = vmapens.Ensemble(models.MLP, N, seed=0, backend="loop")
    alone = ens.unstack()
    batches = data((16, 4), (16, 3))
    step = vmapens.make_step(ens, nn.MSELoss(), sgd(ens), precision="bf16")
    for x, y in batches:
        step(x, y)
    assert_members(ens, train_alone(alone, batches, nn.MSELoss(), torch.bfloat16))


def overflow_batches(bad_member, bad_step, steps=6):
    """Per-member data [n, B, ...]; an inf target makes one member's gradients non-finite."""
    batches = data((N, 16, 4), (N, 16, 3), steps)
    batches[bad_step][1][bad_member, 0, 0] = float("inf")
    return batches


def scalers(**kw):
    return [torch.amp.GradScaler("cpu", **kw) for _ in range(N)]


SCALE_OPTIONS = dict(init_scale=2.0**10, growth_interval=2)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_fp16_loss_scale_matches_one_grad_scaler_per_member(compile):
    ens = vmapens.Ensemble(models.MLP, N, seed=0)
    clean = copy.deepcopy(ens)
    alone = ens.unstack()
    batches = overflow_batches(bad_member=1, bad_step=2)
    finite = [(x, torch.nan_to_num(y, posinf=0.0)) for x, y in batches]  # the same but the inf
    runs = {}
    for name, e, b in (("overflow", ens, batches), ("clean", clean, finite)):
        scale = LossScale(N, **SCALE_OPTIONS)
        step = vmapens.make_step(
            e, nn.MSELoss(), sgd(e), in_dims=0, compile=compile,
            clip_grad_norm=0.5, precision="fp16", loss_scale=scale,
        )  # fmt: skip
        for x, y in b:
            step(x, y)
        runs[name] = scale
    refs = scalers(**SCALE_OPTIONS)
    assert_members(
        ens, train_alone(alone, batches, nn.MSELoss(), torch.float16, refs, 0.5, per_member=True)
    )
    want_scale = torch.tensor([s.get_scale() for s in refs])
    torch.testing.assert_close(runs["overflow"].scale, want_scale, rtol=0, atol=0)
    trackers = torch.stack([s._growth_tracker for s in refs]).reshape(N).int()
    torch.testing.assert_close(runs["overflow"].growth_tracker, trackers, rtol=0, atol=0)
    assert want_scale[1] < want_scale[0]  # member 1 backed off
    # The other members never noticed member 1's overflow, bit for bit.
    for i in (0, 2):
        for a, b in zip(ens[i].state_dict().values(), clean[i].state_dict().values()):
            assert torch.equal(a, b)


def test_loss_scale_rule_matches_amp_update_scale():
    scale = LossScale(4, init_scale=3.0, growth_factor=1.7, backoff_factor=0.3, growth_interval=2)
    refs = [torch.full((1,), 3.0) for _ in range(4)]
    trackers = [torch.zeros(1, dtype=torch.int32) for _ in range(4)]
    pattern = torch.tensor(
        [[0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0]], dtype=torch.bool
    )
    for found in pattern:
        scale.update_(found, mask=torch.tensor([True, True, True, False]))
        for i in range(3):
            torch._amp_update_scale_(refs[i], trackers[i], found[i].float()[None], 1.7, 0.3, 2)
    torch.testing.assert_close(scale.scale[:3], torch.cat(refs[:3]), rtol=0, atol=0)
    torch.testing.assert_close(scale.growth_tracker[:3], torch.cat(trackers[:3]), rtol=0, atol=0)
    assert scale.scale[3] == 3.0 and scale.growth_tracker[3] == 0  # masked out: frozen


def test_fit_fp16_checkpoint_resumes_the_loss_scale(tmp_path):
    def run(epochs, path):
        ens = vmapens.Ensemble(models.MLP, N, seed=0)
        scale = LossScale(N, growth_interval=1)
        vmapens.fit(ens, batches, nn.MSELoss(), epochs=epochs, precision="fp16",
                    loss_scale=scale, checkpoint=path, progress=False, seed=0)  # fmt: skip
        return ens, scale

    batches = data((16, 4), (16, 3), steps=2)
    full, full_scale = run(2, tmp_path / "full.pt")
    run(1, tmp_path / "half.pt")
    resumed, resumed_scale = run(2, tmp_path / "half.pt")
    assert torch.equal(resumed_scale.scale, full_scale.scale)
    assert torch.equal(resumed_scale.growth_tracker, full_scale.growth_tracker)
    assert not torch.equal(full_scale.scale, torch.full((N,), 2.0**16))  # it moved
    for a, b in zip(full.state_dict().values(), resumed.state_dict().values()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"other options: precision=None \(checkpoint: 'fp16'\)"):
        vmapens.fit(vmapens.Ensemble(models.MLP, N, seed=0), batches, nn.MSELoss(), epochs=3,
                    checkpoint=tmp_path / "full.pt", progress=False, seed=0)  # fmt: skip


def test_cpu_policy_covers_every_op_autocast_casts():
    """Every aten op with an AutocastCPU kernel is in one of the policy's lists by name."""
    low, fp32, promote = POLICIES["cpu"]
    # Reached only from inside other aten ops (or not batchable under vmap at all).
    internal = {"_grid_sampler_2d_cpu_fallback", "_lu_with_info", "mkldnn_rnn_layer"}
    ops = {
        name[len("aten::") :].split(".")[0]
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("aten::")
        and torch._C._dispatch_has_kernel_for_dispatch_key(name, "AutocastCPU")
    }
    assert ops, "no AutocastCPU kernels found: torch's dispatcher API changed"
    assert sorted(ops - low - fp32 - promote - internal) == []
