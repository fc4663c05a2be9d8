"""Session 47 hunt (d): members run in turns (``backend="loop"``, ``chunk_size``) with
stateful members, against each member trained alone with ``torch.optim`` (float64).

The bug (fixed in session 48, ``vmapens/_member_reach.py``): with ``backend="loop"``, the
backend docs/semantics.md sends every forward with data-dependent control flow to ("the same
API and results"), a member whose branch does not
read a parameter gets a zero row in that parameter's stacked gradient, where alone its
``.grad`` stays ``None`` and ``torch.optim`` skips the parameter. So weight decay, momentum
and Adam's moments move the parameter the member never used, silently: 0.017 off after 3
SGD steps with ``weight_decay=0.1``, 0.056 with Adam. The first step's self-check runs
member 0 only, which may use every parameter.

The passing test covers members of different widths whose forward edits buffers in place
(a counter, an EMA) beside a cumulative-average BatchNorm, masked steps, a smaller last
batch, under every way of running members in turns.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
from torch import nn

import vmapens

pytestmark = pytest.mark.usefixtures("float64_default")

TOL: dict[str, Any] = dict(rtol=1e-10, atol=1e-12)


def _batches(rows: tuple[int, ...], seed: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(r, 3, generator=g), torch.randn(r, 2, generator=g)) for r in rows]


def _assert_as_alone(ens: vmapens.Ensemble, alone: list[nn.Module]) -> None:
    for i, m in enumerate(alone):
        got, want = ens[i].state_dict(), m.state_dict()
        assert list(got) == list(want)
        for k in want:
            torch.testing.assert_close(got[k], want[k], **TOL, msg=f"member {i} {k}")


# -- a branch per member with backend="loop" ------------------------------------------------


class Gated(nn.Module):
    """Reads head `a` or head `b`, by a per-member flag (a buffer): a Python branch on a
    member's value, which vmap refuses and `backend="loop"` runs as alone."""

    def __init__(self, use_a: bool) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 2), nn.Linear(3, 2)
        self.register_buffer("use_a", torch.tensor(use_a))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) if bool(self.use_a) else self.b(x)


class EarlyExit(nn.Module):
    """Adaptive computation: the second layer runs only when the first one's output is
    positive on average (a branch on the member's own values, which changes between steps)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 2), nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h) if h.mean() > 0 else h


def _gated() -> tuple[vmapens.Ensemble, list[nn.Module]]:
    torch.manual_seed(0)
    members = [Gated(use) for use in (True, False, True)]
    ens = vmapens.Ensemble.from_modules(members, backend="loop")
    return ens, [copy.deepcopy(m) for m in members]


def test_loop_member_that_skips_a_head_leaves_it_as_alone_in_make_step() -> None:
    """Member 1 never reads head `a`, members 0 and 2 never read head `b`: alone, that
    head's `.grad` is None and SGD leaves it as built. Here its rows get zero gradients and
    weight decay shrinks them."""
    ens, alone = _gated()
    built = ens.unstack()
    batches = _batches((5, 5, 4))
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1, weight_decay=0.1))
    for x, y in batches:
        step(x, y)
    for m in alone:
        opt = torch.optim.SGD(m.parameters(), lr=0.1, weight_decay=0.1)
        for x, y in batches:
            opt.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()
    # alone, member 1's head `a` is exactly as built
    torch.testing.assert_close(alone[1].a.state_dict(), built[1].a.state_dict(), rtol=0, atol=0)
    _assert_as_alone(ens, alone)


def test_loop_member_that_skips_a_head_leaves_it_as_alone_in_a_hand_written_loop() -> None:
    """The README's loop over `ens(x)` with a stacked optimizer, `backend="loop"`."""
    ens, alone = _gated()
    batches = _batches((5, 5, 4))
    opt = vmapens.StackedSGD(ens, lr=0.1, weight_decay=0.1)
    for x, y in batches:
        opt.zero_grad()
        vmapens.per_member(nn.MSELoss())(ens(x), y).sum().backward()
        opt.step()
    for m in alone:
        one = torch.optim.SGD(m.parameters(), lr=0.1, weight_decay=0.1)
        for x, y in batches:
            one.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            one.step()
    _assert_as_alone(ens, alone)


@pytest.mark.parametrize(
    ("name", "hyper"),
    [("Adam", dict(lr=0.1)), ("SGD", dict(lr=0.1, momentum=0.9))],
    ids=["adam", "sgd-momentum"],
)
def test_loop_early_exit_trains_as_alone(name: str, hyper: dict) -> None:
    """A member that exits early at a step after it used its second layer: alone that
    layer's `.grad` is None there and torch.optim does not step it (Adam's moments and
    SGD's momentum buffer wait); here the zero row is stepped on its momentum."""
    ens = vmapens.Ensemble(EarlyExit, n=4, seed=0, backend="loop")
    alone = [copy.deepcopy(m) for m in ens.unstack()]
    batches = _batches((5, 5, 4))
    step = vmapens.make_step(ens, nn.MSELoss(), getattr(vmapens, f"Stacked{name}")(ens, **hyper))
    for x, y in batches:
        step(x, y)
    skipped_after_use = False
    for m in alone:
        opt = getattr(torch.optim, name)(m.parameters(), **hyper)
        used = False
        for x, y in batches:
            opt.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            skipped_after_use |= used and m.b.weight.grad is None
            used |= m.b.weight.grad is not None
            opt.step()
    assert skipped_after_use  # the case under test happens
    _assert_as_alone(ens, alone)


# -- members of different widths with buffers edited in place, in turns ---------------------


class Wide(nn.Module):
    """A counter and an EMA edited in place beside a cumulative-average BatchNorm."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(3, width, bias=False)
        self.bn = nn.BatchNorm1d(width, momentum=None)
        self.head = nn.Linear(width, 2)
        self.register_buffer("count", torch.zeros(()))
        self.register_buffer("ema", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        h = self.bn(self.fc(x))
        with torch.no_grad():
            self.ema.mul_(0.5).add_(h.mean(0))
        return self.head(torch.tanh(h + self.ema)) / self.count


@pytest.mark.parametrize(
    "settings",
    [{"chunk_size": 1}, {"chunk_size": 3}, {"chunk_size": 3, "randomness": "same"},
     {"backend": "loop"}],
    ids=["chunk-1", "chunk-n-1", "chunk-n-1-same", "loop"],
)  # fmt: skip
def test_padded_members_with_in_place_buffers_and_masks_in_turns(settings: dict) -> None:
    factories = [functools.partial(Wide, w) for w in (2, 4, 3, 4)]
    ens = vmapens.Ensemble.from_factories(factories, seed=0, **settings)
    alone = [copy.deepcopy(m) for m in ens.unstack()]
    batches = _batches((6, 5, 3))
    masks = [None, [False, True, True, False], [True, False, True, True]]
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=0.05))
    for (x, y), mask in zip(batches, masks, strict=True):
        step(x, y) if mask is None else step(x, y, torch.tensor(mask))
    for i, m in enumerate(alone):
        opt = torch.optim.Adam(m.parameters(), lr=0.05)
        for (x, y), mask in zip(batches, masks, strict=True):
            if mask is None or mask[i]:
                opt.zero_grad()
                nn.functional.mse_loss(m(x), y).backward()
                opt.step()
    _assert_as_alone(ens, alone)
    x = _batches((4,), seed=5)[0][0]
    with torch.no_grad():
        out = ens(x)  # train mode: moves the statistics and the buffers once more
        for i, m in enumerate(alone):
            torch.testing.assert_close(out[i], m(x), **TOL)
    _assert_as_alone(ens, alone)
    got = vmapens.predict(ens, x, chunk_size=2)
    for i, m in enumerate(alone):
        m.eval()
        with torch.no_grad():
            torch.testing.assert_close(got[i], m(x), **TOL)
    _assert_as_alone(ens, alone)
