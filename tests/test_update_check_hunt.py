"""The compiled step's check of its first update (vmapens/_update_check.py), hunted: a correct
compiled step must not be refused, a wrong one must not pass, and a refusal changes nothing.

A wrong compiled update is simulated as in tests/test_update_check.py: a class whose code adds
an error only while torch.compile traces it. The truth is plain torch: each member alone with
torch.optim (and one torch.amp.GradScaler per member)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from truth import assert_members_equal, float64_batches, train_alone

import vmapens
from vmapens import CompiledStepMismatch, LossScale

N = 3
LR = 0.1
CLIP = 1e-3  # clip_grad_value: a step moves an element by LR * CLIP = 1e-4 at most
INIT_SCALE = 2.0**10
# fp16 kernels round the gradients differently alone and batched; clipped, each moves a
# parameter by at most 1e-4, and round-off (~1e-7 of the ~0.5 values) stays far below this.
TOL = dict(rtol=0, atol=1e-6)


def _fp16_batches(bad_member: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One per-member batch [N, 4, ...]; an inf target overflows member ``bad_member``'s
    gradients to +-inf everywhere (one output column: no inf - inf, so no NaN)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 4, 3, generator=g) + 2.0  # no zero input: inf * x stays inf
    y = torch.randn(N, 4, 2, generator=g)
    if bad_member is not None:
        y[bad_member, 0, 0] = float("inf")
    return [(x, y)]


def _fp16_members() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(3, 2) for _ in range(N)]


def _train_alone_fp16(alone: list[nn.Module], batches: list) -> list[torch.amp.GradScaler]:
    """Each member alone: SGD under fp16 autocast with its own GradScaler and
    clip_grad_value_; returns the scalers."""
    scalers = [torch.amp.GradScaler("cpu", init_scale=INIT_SCALE) for _ in range(N)]
    for i, m in enumerate(alone):
        train_alone(m, [(x[i], y[i]) for x, y in batches], nn.MSELoss(),
                    lambda m: torch.optim.SGD(m.parameters(), lr=LR), autocast=torch.float16,
                    scaler=scalers[i], clip=lambda ps: nn.utils.clip_grad_value_(ps, CLIP))  # fmt: skip
    return scalers


def test_fp16_clip_grad_value_member_overflowing_at_the_first_call_is_not_refused():
    # The graph skips member 1 (its scaled gradients are inf) and returns its gradients
    # unscaled and clamped to +-CLIP: finite. The check used to read "finite" from those, step
    # member 1 eagerly, and refuse a correct compiled step. Alone, GradScaler skips it too.
    members = _fp16_members()
    alone = copy.deepcopy(members)
    ens = vmapens.Ensemble.from_modules(members)
    scale = LossScale(N, init_scale=INIT_SCALE)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=LR), in_dims=0,
                             compile=True, clip_grad_value=CLIP, precision="fp16",
                             loss_scale=scale)  # fmt: skip
    batches = _fp16_batches(bad_member=1)
    for x, y in batches:
        step(x, y)
    scalers = _train_alone_fp16(alone, batches)
    assert_members_equal(ens, alone, **TOL)
    torch.testing.assert_close(scale.scale, torch.tensor([s.get_scale() for s in scalers]))
    assert scale.scale[1] < scale.scale[0]  # member 1 overflowed, alone as in the ensemble


class OffInMember1(vmapens.StackedSGD):
    """StackedSGD whose traced update moves member 1's first parameter 1e-6 too far: ~1e-5 of
    its update, in float64 a miscompiled kernel's error, not round-off."""

    def _update(self, grads, mask):
        super()._update(grads, mask)
        if torch.compiler.is_compiling():
            self.param_groups[0]["params"][0][1, 0].add_(1e-6)


class Lookup(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table, self.out = nn.Embedding(4, 2), nn.Linear(2, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.table(ids))


@pytest.mark.parametrize("unused", [float("nan"), 1e9], ids=["nan", "huge"])
def test_an_error_in_a_member_holding_an_unused_nan_or_huge_value_is_refused(unused):
    # Row 3 of member 1's table is never looked up: it keeps its NaN (or 1e9) while the member
    # trains. Its NaN made every difference of the member NaN, and its 1e9 set the round-off
    # allowed for all of the member's values (8 eps * 1e9 = 1.8e-6): the error went through.
    torch.manual_seed(0)
    members = [Lookup().double() for _ in range(N)]
    with torch.no_grad():
        members[1].table.weight[3] = unused
    ens = vmapens.Ensemble.from_modules(members)
    opt = OffInMember1(ens, lr=LR, momentum=0.9)
    step = vmapens.make_step(ens, nn.MSELoss(), opt, compile=True)
    ids, y = torch.tensor([0, 1, 2, 1]), torch.randn(4, 1, dtype=torch.float64)
    opt.prepare()  # the state the step creates before its graph runs
    before = [t.clone() for t in ens.stacked_state().values()]
    with pytest.raises(CompiledStepMismatch, match=r"`table.weight` \(member 1: differs by 1e-06"):
        step(ids, y)
    for a, b in zip(before, ens.stacked_state().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


class CountsTwiceTraced(LossScale):
    """A LossScale whose traced update counts every member's finite step twice."""

    def update_(self, found_inf, mask=None):
        super().update_(found_inf, mask)
        if torch.compiler.is_compiling():
            self.growth_tracker.add_(1)


def test_a_wrong_loss_scale_update_is_refused_and_the_eager_step_after_it_is_torchs():
    members = _fp16_members()
    alone = copy.deepcopy(members)
    ens = vmapens.Ensemble.from_modules(members)
    scale = CountsTwiceTraced(N, init_scale=INIT_SCALE)
    opt = vmapens.StackedSGD(ens, lr=LR)
    options = dict(in_dims=0, clip_grad_value=CLIP, precision="fp16", loss_scale=scale)
    compiled = vmapens.make_step(ens, nn.MSELoss(), opt, compile=True, **options)
    batches = _fp16_batches(bad_member=None)
    opt.prepare()
    before = [t.clone() for t in [*ens.stacked_state().values(), scale.scale, scale.growth_tracker]]
    with pytest.raises(CompiledStepMismatch, match="the loss scale's `growth_tracker` .member 0"):
        compiled(*batches[0])
    after = [*ens.stacked_state().values(), scale.scale, scale.growth_tracker]
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a, b)
    eager = vmapens.make_step(ens, nn.MSELoss(), opt, **options)
    eager(*batches[0])
    scalers = _train_alone_fp16(alone, batches)
    assert_members_equal(ens, alone, **TOL)
    assert scale.growth_tracker.tolist() == [s._growth_tracker.item() for s in scalers]


class TouchesWhatItMustNot(vmapens.StackedSGD):
    """StackedSGD whose traced update moves masked-out member 1 of its first parameter by one
    ulp, and member 0 of ``self.other``, a parameter it does not hold, by 1e-3."""

    other: torch.Tensor

    def _update(self, grads, mask):
        super()._update(grads, mask)
        if torch.compiler.is_compiling():
            row = self.param_groups[0]["params"][0][1]
            row.copy_(torch.nextafter(row, torch.full_like(row, float("inf"))))
            self.other[0].add_(1e-3)


def test_a_masked_member_moved_by_an_ulp_or_a_parameter_outside_the_optimizer_is_refused():
    # Masked-out members keep their parameters bit for bit, and a parameter the optimizer does
    # not hold stays as it is (eager leaves both be): an ulp used to pass as round-off of the
    # value, and the parameters outside the optimizer were not compared.
    torch.manual_seed(0)
    ens = vmapens.Ensemble.from_modules([
        nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double() for _ in range(N)
    ])  # fmt: skip
    params = dict(ens.named_parameters())
    opt = TouchesWhatItMustNot([params["2.weight"], params["2.bias"]], lr=LR)
    opt.other = params["0.weight"]
    step = vmapens.make_step(ens, nn.MSELoss(), opt, compile=True)
    ((x, y),) = float64_batches(1, 5, 3, 2)
    before = [t.clone() for t in ens.stacked_state().values()]
    with pytest.raises(CompiledStepMismatch) as refused:
        step(x, y, torch.tensor([True, False, True]))
    assert "`2.weight` (member 1: does not step, changed)" in str(refused.value)
    assert "`0.weight` (not in the optimizer, changed)" in str(refused.value)
    for a, b in zip(before, ens.stacked_state().values(), strict=True):
        assert torch.equal(a, b)
