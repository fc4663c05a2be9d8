"""The compiled step's first-call work (the eager no-gradient run of member 0 and the check of
the update against the optimizer's eager one) on real modules: tied weights, a spectral-norm
layer, BatchNorm, a frozen layer and an unused parameter; a CNN in float32 with per-member
learning rates, a schedule and clipping over two batch sizes; a checkpointed compiled ``fit``
with bagging and dropout, interrupted and resumed; and the RNG the check leaves.

Found by this hunt and fixed in vmapens/step.py: which parameters get a gradient (and whether
a graph was checked) was kept per trainable names and input shapes, not per train/eval mode,
so a step in eval mode after train mode stepped a training-only head with zero gradients; and
a frozen head's shared Adam step count was overwritten inside the graph (``own_counters``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils.parametrizations import spectral_norm
from torch.optim.lr_scheduler import StepLR
from truth import assert_members_equal, float64_batches, train_alone, train_each

import vmapens

# float32 through conv, BatchNorm and Adam on any CPU's kernels, a few steps.
TOL32 = dict(rtol=1e-4, atol=1e-5)


class TiedNet(nn.Module):
    """A small language-model head: the output layer's weight is the embedding's, a
    spectral-norm hidden layer (power-iteration buffers), BatchNorm, a frozen layer and a
    parameter the forward never reads (no gradient alone: torch.optim leaves it)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 4)
        self.hidden = spectral_norm(nn.Linear(4, 4))
        self.bn = nn.BatchNorm1d(4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.out = nn.Linear(4, 5)
        self.out.weight = self.emb.weight
        self.unused = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.hidden(self.bn(self.emb(x))))  # no bias right before the BatchNorm
        return self.out(h + self.frozen(h))


def test_tied_spectral_frozen_and_unused_members_train_compiled_as_alone(float64_default):
    torch.manual_seed(0)
    members = [TiedNet() for _ in range(3)]
    alone = copy.deepcopy(members)
    ens = vmapens.Ensemble.from_modules(members)
    opt = vmapens.StackedAdam(ens, lr=0.05, weight_decay=0.01)
    step = vmapens.make_step(ens, nn.CrossEntropyLoss(), opt, compile=True)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(5, (6,), generator=g), torch.randint(5, (6,), generator=g))
               for _ in range(3)]  # fmt: skip
    for x, y in batches:
        step(x, y)
    train_each(alone, batches, nn.functional.cross_entropy,
               make_opt=lambda i, m: torch.optim.Adam(m.parameters(), lr=0.05, weight_decay=0.01))  # fmt: skip
    assert_members_equal(ens, alone)
    assert torch.equal(ens.stacked_state()["unused"], torch.ones(3, 3))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3)
        self.bn = nn.BatchNorm2d(3)
        self.fc = nn.Linear(3 * 4 * 4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def test_float32_cnn_with_per_member_rates_schedule_and_clipping_is_not_refused():
    # Learning rates from 1e-7 to 1e-1: the check holds each member to its own update, over
    # two batch sizes (two graphs, each checked), with StepLR and clip_grad_norm. eps=1e-3:
    # BatchNorm leaves the conv bias a gradient of round-off, whose sign (kernel-dependent)
    # Adam's default eps would turn into a step of +-lr.
    n, lrs = 6, torch.logspace(-7, -1, 6)
    torch.manual_seed(0)
    members = [CNN() for _ in range(n)]
    alone = copy.deepcopy(members)
    ens = vmapens.Ensemble.from_modules(members)
    opt = vmapens.StackedAdam(ens, lr=lrs, weight_decay=1e-2, eps=1e-3)
    sched = StepLR(opt, 1, gamma=0.5)
    step = vmapens.make_step(ens, nn.MSELoss(), opt, compile=True, clip_grad_norm=0.3)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(r, 1, 6, 6, generator=g), torch.randn(r, 2, generator=g))
               for r in (4, 5, 4)]  # fmt: skip
    for x, y in batches:
        step(x, y)
        sched.step()
    for i, m in enumerate(alone):
        own = torch.optim.Adam(m.parameters(), lr=float(lrs[i]), weight_decay=1e-2, eps=1e-3)
        own_sched = StepLR(own, 1, gamma=0.5)
        train_alone(m, batches, nn.functional.mse_loss, own,
                    clip=lambda ps: nn.utils.clip_grad_norm_(ps, 0.3),
                    after_step=lambda _, s=own_sched: s.step())  # fmt: skip
    assert_members_equal(ens, alone, **TOL32)


class DropNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(torch.tanh(self.bn(self.a(x)))))


def test_a_checkpointed_compiled_fit_resumes_exactly(float64_default, tmp_path):
    # Bagging, dropout (the global RNG), BatchNorm buffers, StepLR and clipping; a resumed
    # run rebuilds and checks its compiled step again.
    g = torch.Generator().manual_seed(3)
    data = (torch.randn(12, 3, generator=g), torch.randn(12, 2, generator=g))
    options = dict(epochs=3, batch_size=4, bootstrap=True, seed=1, progress=False, lr=0.05,
                   compile=True, clip_grad_norm=0.5, scheduler=lambda o: StepLR(o, 1, gamma=0.5))  # fmt: skip

    def interrupt(history: vmapens.History) -> None:
        if history.epochs == 1:
            raise KeyboardInterrupt

    torch.manual_seed(7)
    first = vmapens.Ensemble(DropNet, n=3, seed=0)
    with pytest.raises(KeyboardInterrupt):
        vmapens.fit(first, data, nn.MSELoss(), callbacks=[interrupt],
                    checkpoint=tmp_path / "run.pt", **options)  # fmt: skip
    torch.manual_seed(99)  # another process: the checkpoint brings the RNG back
    resumed = vmapens.Ensemble(DropNet, n=3, seed=0)
    vmapens.fit(resumed, data, nn.MSELoss(), checkpoint=tmp_path / "run.pt", **options)
    torch.manual_seed(7)
    straight = vmapens.Ensemble(DropNet, n=3, seed=0)
    vmapens.fit(straight, data, nn.MSELoss(), checkpoint=tmp_path / "straight.pt", **options)
    for (name, a), b in zip(resumed.state_dict().items(), straight.state_dict().values(),
                            strict=True):  # fmt: skip
        assert torch.equal(a, b), name


def test_the_first_call_checks_leave_the_rng_and_results_of_an_unchecked_step(float64_default):
    # The probe and the no-gradient run fork the RNG, the check adds no draw: with dropout,
    # the first call draws what a later call of the same graph draws, and a checked compiled
    # step leaves what check=False leaves, bit for bit, RNG included.
    batches = float64_batches(2, 4, 3, 2)
    runs = []
    for check in (True, False):
        ens = vmapens.Ensemble(DropNet, n=3, seed=0)
        step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=0.05),
                                 compile=True, check=check)  # fmt: skip
        draws = []
        for x, y in batches:
            torch.manual_seed(5)
            step(x, y)
            draws.append(torch.get_rng_state())
        assert torch.equal(draws[0], draws[1])
        runs.append((draws[0], ens.state_dict()))
    assert torch.equal(runs[0][0], runs[1][0])
    for name, t in runs[0][1].items():
        assert torch.equal(t, runs[1][1][name]), name


class AuxHead(nn.Module):
    """An auxiliary head used only in training mode (as torchvision's Inception's)."""

    def __init__(self) -> None:
        super().__init__()
        self.main, self.aux = nn.Linear(3, 2), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.main(x)
        return out + self.aux(x) if self.training else out


def test_a_step_in_eval_mode_after_train_mode_leaves_a_training_only_head(float64_default):
    # Alone, the aux head's .grad is None in eval mode and Adam leaves it; the compiled step
    # kept train mode's list of parameters with a gradient, so Adam's momentum moved it.
    torch.manual_seed(0)
    members = [AuxHead() for _ in range(3)]
    alone = copy.deepcopy(members)
    ens = vmapens.Ensemble.from_modules(members)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=0.05), compile=True)
    batches = float64_batches(3, 4, 3, 2)
    step(*batches[0])
    ens.eval()
    for x, y in batches[1:]:
        step(x, y)
    opts = [torch.optim.Adam(m.parameters(), lr=0.05) for m in alone]
    for k, (x, y) in enumerate(batches):
        for m, opt in zip(alone, opts, strict=True):
            m.train(k == 0)
            opt.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()
    assert_members_equal(ens, alone)


class Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


def test_a_head_frozen_then_unfrozen_starts_its_adam_count_at_one(float64_default):
    # Alone, a frozen head has no Adam state; unfrozen, its first step has bias corrections
    # of step 1. The compiled step counted the frozen steps into it (4 where torch has 2).
    torch.manual_seed(0)
    members = [Body() for _ in range(3)]
    alone = copy.deepcopy(members)
    ens = vmapens.Ensemble.from_modules(members)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=0.05), compile=True)
    head = [p for name, p in ens.named_parameters() if name.startswith("head")]
    batches = float64_batches(5, 4, 3, 2)
    for k, (x, y) in enumerate(batches):
        for p in head:
            p.requires_grad_(k >= 3)
        step(x, y)
    for m in alone:
        opt = torch.optim.Adam(m.parameters(), lr=0.05)
        for k, (x, y) in enumerate(batches):
            m.head.requires_grad_(k >= 3)
            opt.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()
    assert_members_equal(ens, alone)
