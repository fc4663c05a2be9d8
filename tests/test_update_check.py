"""The compiled step checks its first update against the optimizer's eager update on the same
gradients (vmapens/_update_check.py): a miscompiled update is refused and changes nothing;
``fit(compile="auto")`` then goes on eagerly; a correct one keeps the compiled bits.

A miscompiled update is simulated by an optimizer that steps differently while traced, as the
inductor bug of tests/test_compiled_fusion.py did (members stepped from wrong gradients)."""

from __future__ import annotations

import copy

import pytest
import torch
from parity import assert_refused_changing_nothing, training_state
from torch import nn
from truth import assert_bit_identical, assert_members_equal, float64_batches, train_each

import vmapens
from vmapens import CompiledStepMismatch, _autocompile


class Miscompiled(vmapens.StackedSGD):
    """StackedSGD whose update, traced by torch.compile, adds 1e-3 to member 2's weight: what
    a wrong kernel would do, and only under compile."""

    def _update(self, grads, mask, *rest):
        super()._update(grads, mask, *rest)
        if torch.compiler.is_compiling():
            weight = self.param_groups[0]["params"][0]
            weight[2].add_(1e-3)


def _ensemble(dropout: float = 0.0) -> vmapens.Ensemble:
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(3, 2), nn.Dropout(dropout)).double() for _ in range(4)]
    return vmapens.Ensemble.from_modules(members)


def test_a_compiled_update_that_differs_from_eager_is_refused_and_changes_nothing():
    ens = _ensemble(dropout=0.5)  # the compiled forward draws from the global RNG
    opt = Miscompiled(ens, lr=0.1, momentum=0.9)
    step = vmapens.make_step(ens, nn.MSELoss(), opt, compile=True)
    x, y = float64_batches(1, 5, 3, 2)[0]
    assert_refused_changing_nothing(step, (x, y), ens, opt, CompiledStepMismatch,
                                    r"`0.weight` \(member 2.*compile=False")  # fmt: skip
    # Refused again: the graph is checked until one call passes.
    with pytest.raises(CompiledStepMismatch):
        step(x, y)


def test_fit_auto_goes_on_eagerly_when_the_compiled_update_differs(monkeypatch):
    monkeypatch.setattr(_autocompile, "COMPILE_PAYS_AFTER_S", 0.0)  # compile after the timing
    torch.manual_seed(1)
    members = [nn.Linear(3, 2).double() for _ in range(3)]
    alone = [copy.deepcopy(m) for m in members]
    ens = vmapens.Ensemble.from_modules(members)
    batches = float64_batches(9, 6, 3, 2, seed=3)  # 6 eager steps decide, then 3 more
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    with pytest.warns(UserWarning, match="compile='auto'. goes on eagerly"):
        vmapens.fit(ens, (x, y), nn.MSELoss(), optimizer=Miscompiled(ens, lr=0.2),
                    batch_size=6, shuffle=False, compile="auto", progress=False)  # fmt: skip
    train_each(alone, batches, make_opt=lambda i, m: torch.optim.SGD(m.parameters(), lr=0.2))
    assert_members_equal(ens, alone)


def test_a_checked_compiled_step_keeps_the_compiled_results_bit_for_bit():
    # Adam with weight decay and a mask: moments, counters and frozen members all go through
    # the check; the second step runs unchecked, the graph already passed.
    x, y = float64_batches(1, 5, 3, 2)[0]
    mask = torch.tensor([True, False, True, True])
    results = []
    for check in (True, False):
        ens = _ensemble()
        opt = vmapens.StackedAdam(ens, lr=0.1, weight_decay=0.01)
        step = vmapens.make_step(ens, nn.MSELoss(), opt, compile=True, check=check)
        losses = [step(x, y, mask), step(x, y)]
        results.append((losses, training_state(ens, opt)))
    assert_bit_identical(results[0], results[1])
