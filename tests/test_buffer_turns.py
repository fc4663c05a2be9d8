"""A forward that edits a buffer in place, with members run in turns.

Each member's rows of a stacked buffer are views of one storage with one version counter:
where members run in turns (``backend="loop"``, ``chunk_size`` below ``n``), the next member's
edit used to mark the rows an earlier member saved for its backward as changed, and the
backward raised "modified by an inplace operation". The truth is each member trained alone
with ``torch.optim`` (float64), parameters and buffers compared after several steps.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from truth import assert_members_equal, train_alone

import vmapens

N, ROWS, STEPS, LR = 3, 6, 3, 0.1

IN_TURNS = [
    pytest.param({"backend": "loop"}, id="loop"),
    pytest.param({"chunk_size": 1}, id="chunk-1"),
    pytest.param({"chunk_size": 2}, id="chunk-2"),  # chunks of 2 and 1 members
]
WITH_VMAP = [*IN_TURNS, pytest.param({}, id="vmap")]


class Counter(nn.Module):
    """Edits a buffer in place, then uses it in a differentiable op (saved for backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x) * self.calls


class CountsAside(nn.Module):
    """Edits a buffer in place that the graph never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x)


class NormedEma(nn.Module):
    """BatchNorm (its kernel edits the running statistics) and an average edited in place
    under no_grad, then multiplied into the output."""

    def __init__(self) -> None:
        super().__init__()
        self.bn, self.lin = nn.BatchNorm1d(3), nn.Linear(3, 2)
        self.register_buffer("ema", torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(self.bn(x))
        with torch.no_grad():
            self.ema.mul_(0.5).add_(0.5 * h.mean(0).abs())
        return h * self.ema


class ConvBN(nn.Module):
    """A CNN with BatchNorm: its statistics are edited in place by torch, never saved."""

    def __init__(self) -> None:
        super().__init__()
        # no conv bias: BatchNorm cancels it, and Adam would blow its round-off gradient up
        self.conv = nn.Conv1d(1, 2, 2, bias=False)
        self.bn, self.fc = nn.BatchNorm1d(2), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x.unsqueeze(1)))).flatten(1))


MODULES = [Counter, CountsAside, NormedEma, ConvBN]


def _ensemble(factory: Callable[[], nn.Module], **settings: Any) -> vmapens.Ensemble:
    return vmapens.Ensemble(factory, n=N, seed=0, **settings).double()


def _batches(count: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randn(ROWS, 3, generator=g, dtype=torch.float64),
         torch.randn(ROWS, 2, generator=g, dtype=torch.float64))
        for _ in range(count)
    ]  # fmt: skip


def _sgd(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=LR)


@pytest.mark.parametrize("settings", WITH_VMAP)
@pytest.mark.parametrize("factory", MODULES)
def test_make_step_trains_as_alone(factory: Callable[[], nn.Module], settings: dict) -> None:
    ens = _ensemble(factory, **settings)
    alone = ens.unstack()
    batches = _batches()
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=LR))
    for x, y in batches:
        step(x, y)
    for m in alone:
        train_alone(m, batches, nn.functional.mse_loss, _sgd)
    assert_members_equal(ens, alone)


@pytest.mark.parametrize("settings", WITH_VMAP)
@pytest.mark.parametrize("factory", MODULES)
def test_forward_then_backward_trains_as_alone(
    factory: Callable[[], nn.Module], settings: dict
) -> None:
    """``ens(x)``, a per-member loss and ``backward()``: the user's own loop."""
    ens = _ensemble(factory, **settings)
    alone = ens.unstack()
    batches = _batches()
    opt = vmapens.StackedAdam(ens, lr=LR)
    loss_fn = vmapens.per_member(nn.MSELoss())
    for x, y in batches:
        opt.zero_grad()
        loss_fn(ens(x), y).sum().backward()
        opt.step()
    for m in alone:
        train_alone(
            m, batches, nn.functional.mse_loss, lambda m: torch.optim.Adam(m.parameters(), lr=LR)
        )
    assert_members_equal(ens, alone)


@pytest.mark.parametrize("settings", WITH_VMAP)
@pytest.mark.parametrize("factory", MODULES)
def test_forward_without_grad_edits_as_alone(
    factory: Callable[[], nn.Module], settings: dict
) -> None:
    ens = _ensemble(factory, **settings)
    alone = ens.unstack()
    for x, _ in _batches(2):
        with torch.no_grad():
            out = ens(x)
            want = [m(x) for m in alone]
        for i, w in enumerate(want):
            torch.testing.assert_close(out[i], w, rtol=1e-12, atol=1e-12)
    assert_members_equal(ens, alone)


@pytest.mark.parametrize("settings", IN_TURNS)
def test_fit_trains_as_alone(settings: dict) -> None:
    ens = _ensemble(NormedEma, **settings)
    alone = ens.unstack()
    batches = _batches()
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    vmapens.fit(ens, (x, y), nn.MSELoss(), epochs=2, batch_size=ROWS, shuffle=False,
                optimizer=vmapens.StackedSGD, lr=LR, progress=False)  # fmt: skip
    for m in alone:
        train_alone(m, batches * 2, nn.functional.mse_loss, _sgd)
    assert_members_equal(ens, alone)


class Drops(nn.Module):
    """Dropout next to a buffer: the chunks' random draws must stay torch.func's."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.drop = nn.Linear(3, 4), nn.Dropout(0.5)
        self.register_buffer("shift", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.lin(x)) + self.shift


@pytest.mark.parametrize("randomness", ["different", "same"])
def test_chunks_draw_as_torch_func_chunks(randomness: str) -> None:
    ens = _ensemble(Drops, chunk_size=2, randomness=randomness)
    state = torch.func.stack_module_state(ens.unstack())
    state = {**state[0], **state[1]}
    template = copy.deepcopy(ens[0])
    x = _batches(1)[0][0]

    def member(s: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.func.functional_call(template, s, (x,))

    torch.manual_seed(5)
    want = torch.func.vmap(member, chunk_size=2, randomness=randomness)(state)
    torch.manual_seed(5)
    got = ens(x)
    assert got.requires_grad
    torch.testing.assert_close(got, want, rtol=0, atol=0)


class Reads(nn.Module):
    """Reads its buffer, edits nothing: members must get the stacked rows themselves."""

    seen: list[int] = []

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Reads.seen.append(self.scale.untyped_storage().data_ptr())
        return self.lin(x) * self.scale


def test_a_forward_that_edits_nothing_gets_no_copies() -> None:
    ens = _ensemble(Reads, backend="loop")
    Reads.seen.clear()
    ens(_batches(1)[0][0]).sum().backward()
    stacked = ens.stacked_buffers()["scale"].untyped_storage().data_ptr()
    assert Reads.seen == [stacked] * N


class ScalesItsInput(nn.Module):
    """Doubles its own input in place, then saves it for the backward (``x * w``)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(-1.0, 1.0, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return (x * self.w).sin()


@pytest.mark.parametrize("settings", WITH_VMAP)
def test_per_member_inputs_edited_in_place_as_alone(settings: dict) -> None:
    """``ens(x, in_dims=0)`` then ``backward()``: each member's gradient as alone, and ``x``
    ends edited by every member, as alone (each member edits its own slice)."""
    ens = _ensemble(ScalesItsInput, **settings)
    alone = ens.unstack()
    x = torch.randn(N, ROWS, 3, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    mine = x.clone()
    out = ens(x, in_dims=0)
    out.square().sum().backward()
    for i, m in enumerate(alone):
        want = m(mine[i])
        want.square().sum().backward()
        torch.testing.assert_close(out[i], want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(ens.w.grad[i], m.w.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x, mine, rtol=0, atol=0)


class CountsWhenFlagged(nn.Module):
    """Edits its buffer only where its flag (a per-member buffer) is set."""

    def __init__(self, flag: float) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.register_buffer("calls", torch.ones(()))
        self.register_buffer("flag", torch.tensor(flag))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.flag:
            self.calls += 1
        return self.lin(x) * self.calls


def test_a_first_edit_after_a_member_that_saved_is_not_silent() -> None:
    """docs/semantics.md: member 0 saved its row unedited, member 1 edits first: torch's
    error in the backward, as documented, not a wrong gradient."""
    modules = [CountsWhenFlagged(f).double() for f in (0.0, 1.0, 1.0)]
    ens = vmapens.Ensemble.from_modules(modules, backend="loop")
    x = _batches(1)[0][0]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        ens(x).sum().backward()
    # the forward itself ran as alone
    torch.testing.assert_close(ens.calls, torch.tensor([1.0, 2.0, 2.0], dtype=torch.float64))
