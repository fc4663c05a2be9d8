"""The compiled step against members trained alone where one parameter's gradient reads
another parameter: inductor fused such a gradient into the foreach kernel that writes the
parameters, and read a parameter after writing it (torch 2.13), so every member stepped from
wrong gradients without an error while the eager step was exact."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from truth import assert_members_equal, float64_batches, train_each

import vmapens


class Coupled(nn.Module):
    """Parameters whose gradients read each other: an elementwise product ``a * b`` (b's
    gradient reads a), weight norm (``g``'s gradient reads ``v``), LayerNorm's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(4, 3))
        self.norm = nn.utils.parametrizations.weight_norm(nn.Linear(4, 4))
        self.ln = nn.LayerNorm(4)
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ (self.a * self.b).T)
        return self.out(self.ln(torch.tanh(self.norm(h))))


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
def test_compiled_sgd_steps_coupled_parameters_as_each_member_alone():
    torch.manual_seed(0)
    members = [Coupled().double() for _ in range(3)]
    alone = [copy.deepcopy(m) for m in members]
    ens = vmapens.Ensemble.from_modules(members)
    # Plain SGD: the update is the gradient itself, so a wrong gradient shows at once.
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.5), compile=True)
    batches = float64_batches(3, 6, 3, 1)
    for x, y in batches:
        step(x, y)
    train_each(alone, batches, make_opt=lambda i, m: torch.optim.SGD(m.parameters(), lr=0.5))
    assert_members_equal(ens, alone)
