"""``backend="loop"``: a member whose forward never reads a parameter trains as alone, where
``torch.optim`` skips a parameter whose ``.grad`` is None (``vmapens/_member_reach.py``).

Truth: each member trained alone with ``torch.optim`` (float64). tests/test_hunt_session47_d.py
covers gated heads and early exits under ``make_step`` and a hand-written loop; this file the
other ways a ``.grad`` comes to be: gradients accumulated over two backwards, ``zero_grad``
that keeps zeros, a penalty on the stacked parameters, masked steps, and ``torch.optim`` on
the stack (warned).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import vmapens

pytestmark = pytest.mark.usefixtures("float64_default")


class Branchy(nn.Module):
    """Head `b` runs only on a batch whose first input sums positive: a branch on the data,
    so members given their own batches (``in_dims=0``) read different parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 2), nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h) if x[0].sum() > 0 else h


def _members(n: int = 3) -> tuple[vmapens.Ensemble, list[nn.Module]]:
    ens = vmapens.Ensemble(Branchy, n=n, seed=4, backend="loop")
    return ens, [copy.deepcopy(m) for m in ens.unstack()]


def _data(signs: list[list[float]], seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per batch, per member: a batch whose first row sums to the sign given (so head `b` runs
    for +1 and not for -1)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for row in signs:
        x = torch.randn(len(row), 4, 3, generator=g)
        x[:, 0] = torch.tensor(row)[:, None] / 3
        out.append((x, torch.randn(len(row), 4, 2, generator=g)))
    return out


def _assert_as_alone(ens: vmapens.Ensemble, alone: list[nn.Module]) -> None:
    for i, m in enumerate(alone):
        torch.testing.assert_close(ens[i].state_dict(), m.state_dict(), rtol=1e-10, atol=1e-12)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The sum over members of each one's MSE on its own targets."""
    return (out - y).pow(2).mean(dim=(1, 2)).sum()


def test_gradients_accumulated_over_two_backwards_step_whoever_read_once() -> None:
    """Two micro-batches before one step: a member that read head `b` in either has a
    `.grad` alone, and steps it; one that read it in neither does not (Adam, weight decay)."""
    ens, alone = _members()
    steps = [_data([[1, -1, -1], [-1, -1, 1]], seed=1), _data([[-1, -1, 1], [-1, 1, -1]], seed=2)]
    opt = vmapens.StackedAdam(ens, lr=0.1, weight_decay=0.1)
    for micro in steps:
        opt.zero_grad()
        for x, y in micro:
            _loss(ens(x, in_dims=0), y).backward()
        opt.step()
    for i, m in enumerate(alone):
        one = torch.optim.Adam(m.parameters(), lr=0.1, weight_decay=0.1)
        for micro in steps:
            one.zero_grad()
            for x, y in micro:
                nn.functional.mse_loss(m(x[i]), y[i]).backward()
            one.step()
    # member 0 read `b` in the first step only, member 2 in one micro-batch of the second
    assert alone[0].b.weight.grad is None and alone[2].b.weight.grad is not None
    _assert_as_alone(ens, alone)


def test_zero_grad_that_keeps_zeros_steps_a_member_that_read_once() -> None:
    """`zero_grad(set_to_none=False)`: once a member read head `b`, alone its `.grad` stays a
    zero tensor and SGD's weight decay and momentum step it on every later step."""
    ens, alone = _members()
    batches = _data([[-1, 1, -1], [1, -1, -1], [-1, -1, -1]])
    opt = vmapens.StackedSGD(ens, lr=0.1, momentum=0.9, weight_decay=0.1)
    for x, y in batches:
        opt.zero_grad(set_to_none=False)
        _loss(ens(x, in_dims=0), y).backward()
        opt.step()
    for i, m in enumerate(alone):
        one = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
        for x, y in batches:
            one.zero_grad(set_to_none=False)
            nn.functional.mse_loss(m(x[i]), y[i]).backward()
            one.step()
    assert alone[2].b.weight.grad is None and alone[0].b.weight.grad is not None
    _assert_as_alone(ens, alone)


def test_a_penalty_on_the_stacked_parameters_reaches_every_member() -> None:
    """An L2 penalty summed over `ens.parameters()` reads every member's head `b`, as the same
    penalty over `m.parameters()` alone does: every member steps it."""
    ens, alone = _members()
    batches = _data([[1, -1, -1], [-1, 1, -1]])
    opt = vmapens.StackedAdam(ens, lr=0.05)
    for x, y in batches:
        opt.zero_grad()
        penalty = sum(p.pow(2).sum() for p in ens.parameters())
        (_loss(ens(x, in_dims=0), y) + 0.01 * penalty).backward()
        opt.step()
    for i, m in enumerate(alone):
        one = torch.optim.Adam(m.parameters(), lr=0.05)
        for x, y in batches:
            one.zero_grad()
            penalty = sum(p.pow(2).sum() for p in m.parameters())
            (nn.functional.mse_loss(m(x[i]), y[i]) + 0.01 * penalty).backward()
            one.step()
    _assert_as_alone(ens, alone)


def test_a_masked_step_and_unread_rows_together() -> None:
    """`opt.step(mask=...)` freezes member 0; member 2 never reads head `b`: each keeps what
    its own plain optimizer (not stepped, or stepped without `b`) gives."""
    ens, alone = _members()
    batches = _data([[1, 1, -1], [1, 1, -1]])
    mask = torch.tensor([False, True, True])
    opt = vmapens.StackedAdam(ens, lr=0.1, weight_decay=0.1)
    for x, y in batches:
        opt.zero_grad()
        _loss(ens(x, in_dims=0), y).backward()
        opt.step(mask=mask)
    for i, m in enumerate(alone):
        if not mask[i]:
            continue
        one = torch.optim.Adam(m.parameters(), lr=0.1, weight_decay=0.1)
        for x, y in batches:
            one.zero_grad()
            nn.functional.mse_loss(m(x[i]), y[i]).backward()
            one.step()
    _assert_as_alone(ens, alone)
    state = opt.state[ens.get_parameter("b.weight")]
    # Adam's step counts, per member: frozen, read twice, never read
    torch.testing.assert_close(state["step"], torch.tensor([0.0, 2.0, 0.0]), rtol=0, atol=0)


def test_torch_optim_on_the_stack_is_warned_where_a_member_did_not_read() -> None:
    """`torch.optim` cannot skip one member's row: the backward warns, naming the members and
    the parameter, and the stacked optimizers say nothing."""
    ens, _ = _members()
    ((x, y),) = _data([[1, -1, 1]])
    torch.optim.SGD(ens.parameters(), lr=0.1, weight_decay=0.1)
    with pytest.warns(
        UserWarning, match=r"never read `b.bias` \(members \[1\]\), `b.weight` \(members \[1\]\)"
    ):
        _loss(ens(x, in_dims=0), y).backward()
    ens, _ = _members()
    vmapens.StackedSGD(ens, lr=0.1, weight_decay=0.1)
    _loss(ens(x, in_dims=0), y).backward()  # filterwarnings=error: no warning
