"""Draws from a ``torch.Generator`` a member's forward or loss seeds or holds itself.

Alone, every member draws the same numbers from such a generator (fixed noise, a fixed random
weighting of the loss). Under vmap with ``randomness="different"`` one batched draw gave each
member others, silently (parameters 0.04 off after one SGD step): the step's self-check ran
member 0, which draws first either way. Now the step's probe refuses it, before anything
changes (``ens(x)`` is not checked: docs/semantics.md); ``randomness="same"``,
``backend="loop"`` and chunks of one member run as alone. A generator passed in the call
(``ens(x, g)``, in a dataclass too) or living outside it is the caller's stream and runs. The truth: the members (``ens.unstack()``) run and trained alone, float64.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import Tensor, nn

import vmapens

pytestmark = pytest.mark.usefixtures("float64_default")

N = 3
AS_ALONE = [{"randomness": "same"}, {"backend": "loop"}, {"chunk_size": 1}]
REFUSED = [{}, {"chunk_size": 2}]


class FixedNoise(nn.Module):
    """A BatchNorm (its statistics move in the forward), then noise from a seeded generator."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn = nn.Linear(3, 3), nn.BatchNorm1d(3)

    def forward(self, x: Tensor) -> Tensor:
        g = torch.Generator().manual_seed(0)
        return self.bn(self.fc(x)) + 0.1 * torch.randn(x.shape, generator=g)


class Passed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: Tensor, g: torch.Generator) -> Tensor:
        return self.fc(x) + torch.randn(x.shape, generator=g)


def weighted_loss(out: Tensor, y: Tensor) -> Tensor:
    """A loss with a fixed random weighting, drawn from a generator it seeds."""
    w = torch.rand(out.shape, generator=torch.Generator().manual_seed(0))
    return ((out - y) ** 2 * w).mean()


def _x() -> Tensor:
    return torch.randn(4, 3, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kw", REFUSED, ids=["vmap", "chunks-2"])
def test_a_step_whose_forward_draws_from_its_own_generator_is_refused_and_changes_nothing(
    kw: dict,
) -> None:
    ens = vmapens.Ensemble(FixedNoise, n=N, seed=0, **kw)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1))
    for _ in range(2):  # refused again: a caught error is no pass for the next call
        with pytest.raises(RuntimeError, match="torch.Generator it makes.*randomness='same'"):
            step(_x(), torch.zeros(4, 3))
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("kw", REFUSED, ids=["vmap", "chunks-2"])
def test_a_step_whose_loss_draws_from_its_own_generator_is_refused(kw: dict) -> None:
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 2), n=N, seed=0, **kw)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    step = vmapens.make_step(ens, weighted_loss, vmapens.StackedSGD(ens, lr=0.1))
    with pytest.raises(RuntimeError, match="torch.Generator it makes"):
        step(_x(), torch.zeros(4, 2))
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("kw", AS_ALONE, ids=["same", "loop", "chunks-1"])
def test_where_each_member_draws_as_alone_it_trains_as_alone(kw: dict) -> None:
    ens = vmapens.Ensemble(FixedNoise, n=N, seed=0, **kw)
    alone = [copy.deepcopy(m) for m in ens.unstack()]
    step = vmapens.make_step(ens, weighted_loss, vmapens.StackedSGD(ens, lr=0.1))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in alone]
    y = torch.zeros(4, 3)
    for _ in range(2):
        losses = step(_x(), y)
        for i, (m, opt) in enumerate(zip(alone, opts, strict=True)):
            opt.zero_grad()
            loss = weighted_loss(m(_x()), y)
            loss.backward()
            opt.step()
            torch.testing.assert_close(losses[i], loss.detach(), atol=1e-12, rtol=0)
    for i, m in enumerate(alone):
        for k, v in m.state_dict().items():
            torch.testing.assert_close(ens[i].state_dict()[k], v, atol=1e-12, rtol=0)


class Carried(nn.Module):
    """A generator in a dataclass the batch comes in."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, batch: Batch) -> Tensor:
        noise = torch.randn(batch.x.shape, generator=batch.g)
        return self.fc(batch.x) + noise


@dataclasses.dataclass
class Batch:
    x: Tensor
    g: torch.Generator


def test_generators_passed_in_the_call_are_not_refused() -> None:
    # The caller's one stream: alone, a loop over the members draws from it member after
    # member, other numbers for each, as under "different" (docs/semantics.md)
    ens = vmapens.Ensemble(Passed, n=N, seed=0)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1))
    assert step((_x(), torch.Generator().manual_seed(7)), torch.zeros(4, 3)).shape == (N,)
    ens = vmapens.Ensemble(Carried, n=N, seed=0)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1))
    batch = Batch(_x(), torch.Generator().manual_seed(7))
    assert step(batch, torch.zeros(4, 3)).shape == (N,)


@dataclasses.dataclass(slots=True)
class SlotsBatch:
    x: Tensor


class FixedNoiseOnABatch(FixedNoise):
    def forward(self, batch: SlotsBatch) -> Tensor:  # type: ignore[override]
        return super().forward(batch.x)


def test_a_batch_in_a_slots_dataclass_is_checked_too() -> None:
    # Looking for generators in the batch read `vars()` of a slots dataclass (none): the
    # self-check failed there and let the step run unchecked
    ens = vmapens.Ensemble(FixedNoiseOnABatch, n=N, seed=0)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1))
    with pytest.raises(RuntimeError, match="torch.Generator it makes"):
        step(SlotsBatch(_x()), torch.zeros(4, 3))
