"""Where the compiled step differed from members trained alone without an error, found by the
hunt on its update check: a parameter that gets no gradient, a graph dynamo compiled again
for a mask (never checked), and Muon's bf16 iteration kept in float32 by inductor."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from truth import assert_members_equal, float64_batches, train_each

import vmapens


class Unused(nn.Module):
    """A parameter the forward never reads: autograd gives it no gradient (None)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.unused = nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


@pytest.mark.parametrize("check", [True, False])
def test_a_parameter_without_gradient_is_not_stepped_by_weight_decay(check):
    # torch.func.grad gives it zeros, which Adam's weight decay stepped; alone, its .grad is
    # None and torch.optim.Adam leaves it.
    torch.manual_seed(0)
    members = [Unused().double() for _ in range(3)]
    alone = [copy.deepcopy(m) for m in members]
    ens = vmapens.Ensemble.from_modules(members)
    opt = vmapens.StackedAdam(ens, lr=0.1, weight_decay=0.1)
    step = vmapens.make_step(ens, nn.MSELoss(), opt, compile=True, check=check)
    batches = float64_batches(3, 4, 3, 2)
    for x, y in batches:
        step(x, y)
    train_each(alone, batches, make_opt=lambda i, m: torch.optim.Adam(m.parameters(), lr=0.1,
                                                                        weight_decay=0.1))  # fmt: skip
    assert_members_equal(ens, alone)
    assert torch.equal(ens.stacked_state()["unused"], torch.ones(3, 2, dtype=torch.float64))


class MiscompiledWithMask(vmapens.StackedSGD):
    """StackedSGD whose update is wrong only when traced with a mask: a graph dynamo compiles
    again at the first masked call, after a first unmasked one passed the check."""

    def _update(self, grads, mask):
        super()._update(grads, mask)
        if torch.compiler.is_compiling() and mask is not None:
            self.param_groups[0]["params"][0].add_(1e-3)


def test_a_graph_compiled_again_for_a_mask_is_checked_at_its_first_call():
    torch.manual_seed(0)
    ens = vmapens.Ensemble.from_modules([nn.Linear(3, 2).double() for _ in range(3)])
    step = vmapens.make_step(ens, nn.MSELoss(), MiscompiledWithMask(ens, lr=0.1), compile=True)
    x, y = float64_batches(1, 4, 3, 2)[0]
    step(x, y)
    before = ens.stacked_state()["weight"].clone()
    with pytest.raises(vmapens.CompiledStepMismatch, match="`weight`"):
        step(x, y, torch.tensor([True, False, True]))
    assert torch.equal(ens.stacked_state()["weight"], before)


def test_compiled_muon_steps_each_member_as_torch_muon_alone():
    # Muon's Newton-Schulz iteration runs in bfloat16, as torch.optim.Muon's; inductor kept its
    # fused intermediates in float32 (0.3 lr off after two steps) until the compiled step
    # asked it to round as eager does.
    torch.manual_seed(0)
    members = [nn.Linear(6, 5, bias=False).double() for _ in range(3)]
    alone = [copy.deepcopy(m) for m in members]
    ens = vmapens.Ensemble.from_modules(members)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedMuon(ens, lr=0.02), compile=True)
    batches = float64_batches(2, 8, 6, 5)
    for x, y in batches:
        step(x, y)
    train_each(alone, batches, make_opt=lambda i, m: torch.optim.Muon(m.parameters(), lr=0.02))
    assert_members_equal(ens, alone)


def test_a_list_lr_set_between_compiled_steps_gets_the_eager_steps_error():
    torch.manual_seed(0)
    ens = vmapens.Ensemble.from_modules([nn.Linear(3, 2).double() for _ in range(3)])
    opt = vmapens.StackedSGD(ens, lr=0.1)
    step = vmapens.make_step(ens, nn.MSELoss(), opt, compile=True)
    x, y = float64_batches(1, 4, 3, 2)[0]
    step(x, y)
    opt.param_groups[0]["lr"] = [0.1, 0.2, 0.3]  # MemberValues would be right
    before = {k: v.clone() for k, v in ens.stacked_state().items()}
    with pytest.raises(TypeError, match=r"param group `lr` must be a float, a tensor or"):
        step(x, y)
    for k, v in ens.stacked_state().items():
        assert torch.equal(v, before[k])
