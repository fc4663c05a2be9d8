"""The compiled step checks the gradients of each graph's first call against the same
gradients computed eagerly (vmapens/_update_check.py): the update check alone compared the
update given the compiled gradients, so a gradient that torch.compile computes differently from
eager went through unseen (torch 2.13 drops an autograd.Function's backward under
``torch.func.grad`` in some arrangements, pytorch/pytorch#193279).

A wrong compiled gradient is simulated by a forward that branches on
``torch.compiler.is_compiling()``, the one way a model's own code can make compiled and eager
differ; the truth is each member trained alone with ``torch.optim``."""

from __future__ import annotations

import copy

import pytest
import torch
from parity import assert_refused_changing_nothing
from torch import nn
from truth import assert_members_equal, float64_batches, seeded_members, train_each

import vmapens
from vmapens import CompiledStepMismatch, _autocompile
from vmapens._update_check import _gradient_differences

N = 3


class Drifts(nn.Module):
    """Scales its hidden layer by 1.5 only while torch.compile traces it."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        return self.head(h * 1.5 if torch.compiler.is_compiling() else h)


def test_compiled_gradients_that_differ_from_eager_are_refused_and_change_nothing() -> None:
    ens = vmapens.Ensemble(Drifts, N, seeds=range(N)).double()
    opt = vmapens.StackedAdam(ens, lr=0.1)
    step = vmapens.make_step(ens, nn.MSELoss(), opt, compile=True)
    x, y = float64_batches(1, 5, 3, 2)[0]
    assert_refused_changing_nothing(step, (x, y), ens, opt, CompiledStepMismatch,
                                    r"gradients differ.*`head.weight` \(member 0")  # fmt: skip
    assert all(p.grad is None for p in ens.parameters())
    with pytest.raises(CompiledStepMismatch, match=r"compile=False"):
        step(x, y)  # checked again: refused until a call passes


def test_without_the_check_the_compiled_gradients_step_the_members() -> None:
    # The injection is real: unchecked, the compiled step trains the 1.5-scaled forward, and
    # the members end away from where they end alone.
    ens = vmapens.Ensemble(Drifts, N, seeds=range(N)).double()
    alone = [m.double() for m in seeded_members(Drifts, N)]
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1), check=False, compile=True)  # fmt: skip
    batches = float64_batches(2, 5, 3, 2)
    for x, y in batches:
        step(x, y)
    train_each(alone, batches, make_opt=lambda i, m: torch.optim.SGD(m.parameters(), lr=0.1))
    with pytest.raises(AssertionError):
        assert_members_equal(ens, alone)


def test_fit_auto_goes_on_eagerly_when_the_compiled_gradients_differ(monkeypatch) -> None:
    monkeypatch.setattr(_autocompile, "COMPILE_PAYS_AFTER_S", 0.0)  # compile after the timing
    ens = vmapens.Ensemble(Drifts, N, seeds=range(N)).double()
    alone = [copy.deepcopy(m) for m in ens.unstack()]
    batches = float64_batches(_autocompile.TIMED_STEPS + 3, 6, 3, 2, seed=3)
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    with pytest.warns(UserWarning, match=r"gradients differ.*compile='auto'. goes on eagerly"):
        vmapens.fit(ens, (x, y), nn.MSELoss(), optimizer=vmapens.StackedSGD(ens, lr=0.2),
                    batch_size=6, shuffle=False, compile="auto", progress=False)  # fmt: skip
    train_each(alone, batches, make_opt=lambda i, m: torch.optim.SGD(m.parameters(), lr=0.2))
    assert_members_equal(ens, alone)


def test_the_comparison_member_by_member() -> None:
    # Two parameters, three members. Member 0: round-off in both tensors (within sqrt(eps) of
    # its largest gradient, 2.0: passes, though the small tensor moves by 100% of itself);
    # member 1: its small gradient off by 1e-3 of its largest (fails); member 2: overflowed
    # eagerly (inf: skipped, as the step skips it).
    eps = torch.finfo(torch.float32).eps
    big = torch.tensor([[2.0, -1.0], [1.0, 0.5], [float("inf"), 1.0]])
    small = torch.tensor([[1e-6], [1e-3], [0.0]])
    moved_big = big + torch.tensor([[4 * eps, 0.0], [0.0, 0.0], [0.0, 0.0]])
    moved_small = small + torch.tensor([[1e-6], [1e-3], [5.0]])
    found = _gradient_differences(["w", "b"], [moved_big, moved_small], [big, small], 3, None)
    assert len(found) == 1 and found[0].startswith("`b` (member 1: ")
    # NaN where eager is finite is a difference; autocast's dtype widens the bound.
    nan = small.clone()
    nan[0, 0] = float("nan")
    assert _gradient_differences(["b"], [nan], [small], 3, None)[0].startswith("`b` (member 0")
    widened = _gradient_differences(["w", "b"], [big, moved_small], [big, small], 3, torch.bfloat16)
    assert widened == []
    # A complex gradient is compared in both parts: an imaginary-only difference counts.
    z = torch.tensor([[1 + 1j], [2 + 0j], [1j]], dtype=torch.complex64)
    moved_z = z + torch.tensor([[0.5j], [0j], [0j]], dtype=torch.complex64)
    assert _gradient_differences(["z"], [moved_z], [z], 3, None)[0].startswith("`z` (member 0")
