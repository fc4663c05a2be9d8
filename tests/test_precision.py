"""Mixed precision: each member gets what torch.autocast (and a GradScaler) gives it alone."""

from __future__ import annotations

import copy

import models
import pytest
import torch
import torch.nn.functional as F
import truth
from torch import nn
from torch.func import vmap

import vmapens
from vmapens._precision import POLICIES
from vmapens.step import LossScale

# How close a member's low-precision training run stays to its lone run. Both runs round
# activations and gradients to the low dtype, but in different kernels: the batched member
# computes from rounded inputs in float32, the lone module runs torch's CPU bf16/fp16 kernels,
# which differ by CPU. With oneDNN's native bf16 (avx512_bf16) the CNN's weights agree to
# 3e-4 bf16 eps of the largest update; where oneDNN has no bf16 (AVX2, AVX-512 without bf16,
# simulated with ONEDNN_MAX_CPU_ISA=AVX2) torch falls back to a conv backward that rounds
# its weight gradient differently, and after three SGD steps a CNN member differs from its lone
# run by up to 3.9 eps (16 seeds, 1 and 2 threads; MLP 0, encoder 1e-3, fp16 + GradScaler 0).
# One bound everywhere: every float tensor of member i is within STEP_ULPS * eps(dtype) * the
# distance the member's farthest-moving parameter travelled alone (its per-step changes
# summed). 10 leaves 2.5x room; a 40%-wrong update is off by ~50 eps of that distance.
STEP_ULPS = 10.0
# Forwards: the member rounds a float32 result once, the lone kernel accumulates in its own
# order; the two agree bit for bit on every CPU setting measured (native bf16, oneDNN capped
# at AVX2 and at AVX-512 without bf16, ATen's default kernels, 1 and 2 threads), but a sum that
# lands within float32 round-off of a rounding boundary can flip one ulp on another CPU. Allow
# that in at most FLIP_FRACTION of the elements: rounding twice (the bug MemberAutocast fixes)
# flips 30-70% of them.
FLIP_FRACTION = 0.01
LR, MOMENTUM = 0.05, 0.9
N = 3
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# (member, input, target, loss, steps): the layers whose batched form autocast gets wrong.
# The encoder gets one step: bf16 training is chaotic at bf16's resolution (a weight one
# float32 ulp off may round to another bf16 value at the next step), and after three steps its
# members drift from their lone runs by ~1e-4, more than round-off of the updates explains.
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
    assert_low_precision_equal(got, want)


def assert_low_precision_equal(got, want):
    """Equal but for one-ulp flips in at most FLIP_FRACTION of the elements."""
    ulp = torch.finfo(want.dtype).eps  # relative spacing; up to 2 ulps near a power of two
    torch.testing.assert_close(
        got.float(), want.float(), rtol=ulp, atol=torch.finfo(want.dtype).tiny
    )
    flipped = (got != want).float().mean().item()
    assert flipped <= FLIP_FRACTION, f"{flipped:.1%} of the elements differ"


def sgd(ens):
    return vmapens.StackedSGD(ens, lr=LR, momentum=MOMENTUM)


def sgd_alone(m):
    return torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM)


class Travel:
    """`after_step` for truth.train_alone: how far each float tensor of a module moved, summed
    over the steps (max |change| per step)."""

    def __init__(self, model):
        self.model = model
        self.last = {k: v.clone() for k, v in model.state_dict().items()}
        self.total = dict.fromkeys(self.last, 0.0)

    def __call__(self, _step):
        for name, value in self.model.state_dict().items():
            if value.is_floating_point():
                self.total[name] += (value - self.last[name]).abs().max().item()
            self.last[name] = value.clone()

    def farthest(self):
        return max(self.total[name] for name, _ in self.model.named_parameters())


def train_alone(modules, batches, loss_fn, dtype, refs=None, per_member=False):
    """Each module trained alone (truth.train_alone) under autocast; how far each travelled."""
    travels = []
    for i, m in enumerate(modules):
        own = [(x[i], y[i]) for x, y in batches] if per_member else batches
        travels.append(Travel(m))
        truth.train_alone(
            m, own, loss_fn, sgd_alone, autocast=dtype, after_step=travels[-1],
            scaler=None if refs is None else refs[i],
            clip=None if refs is None else lambda ps: nn.utils.clip_grad_norm_(ps, CLIP),
        )  # fmt: skip
    return travels


def assert_members(ens, alone, travels, dtype):
    """Members equal their lone runs to STEP_ULPS of `dtype`'s resolution (see above)."""
    for i, (m, travel) in enumerate(zip(alone, travels, strict=True)):
        atol = STEP_ULPS * torch.finfo(dtype).eps * travel.farthest()
        got, want = ens[i].state_dict(), m.state_dict()
        assert list(got) == list(want)
        for name, value in want.items():
            tol = dict(rtol=0, atol=atol if value.is_floating_point() else 0)
            torch.testing.assert_close(got[name], value, **tol, msg=f"member {i} {name}")


@pytest.mark.parametrize(("factory", "x_shape", "y_shape", "loss_fn", "steps"), CASES)
def test_bf16_step_matches_members_alone(factory, x_shape, y_shape, loss_fn, steps):
    ens = vmapens.Ensemble(factory, N, seed=0)
    alone = ens.unstack()
    batches = data(x_shape, y_shape, steps)
    step = vmapens.make_step(ens, loss_fn, sgd(ens), precision="bf16")
    for x, y in batches:
        step(x, y)
    assert_members(ens, alone, train_alone(alone, batches, loss_fn, torch.bfloat16), torch.bfloat16)


def test_loop_backend_bf16_step_matches_members_alone():
    ens = vmapens.Ensemble(models.MLP, N, seed=0, backend="loop")
    alone = ens.unstack()
    batches = data((16, 4), (16, 3))
    step = vmapens.make_step(ens, nn.MSELoss(), sgd(ens), precision="bf16")
    for x, y in batches:
        step(x, y)
    travels = train_alone(alone, batches, nn.MSELoss(), torch.bfloat16)
    assert_members(ens, alone, travels, torch.bfloat16)


def overflow_batches(bad_member, bad_step, steps=6):
    """Per-member data [n, B, ...]; an inf target makes one member's gradients non-finite."""
    batches = data((N, 16, 4), (N, 16, 3), steps)
    batches[bad_step][1][bad_member, 0, 0] = float("inf")
    return batches


def scalers(**kw):
    return [torch.amp.GradScaler("cpu", **kw) for _ in range(N)]


SCALE_OPTIONS = dict(init_scale=2.0**10, growth_interval=2)
CLIP = 0.5


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
            clip_grad_norm=CLIP, precision="fp16", loss_scale=scale,
        )  # fmt: skip
        for x, y in b:
            step(x, y)
        runs[name] = scale
    refs = scalers(**SCALE_OPTIONS)
    travels = train_alone(alone, batches, nn.MSELoss(), torch.float16, refs, per_member=True)
    assert_members(ens, alone, travels, torch.float16)
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
