"""A batch the forward takes whole as a NamedTuple (``forward(self, batch)``: ``batch.x``,
``batch.mask``), as ``ens(batch)`` gives it: ``step``, its first-call check, ``fit`` (tensor
data and batches), validation and ``predict`` give it to each member whole, as the member alone
takes it. A plain tuple stays several positional inputs (``step((x1, x2), y)``).

Truth: each member trained alone with ``torch.optim.SGD`` on the same batches.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import pytest
import torch
from torch import Tensor, nn

import vmapens

N, ROWS, BATCH, LR = 3, 10, 4, 0.1


class Batch(NamedTuple):
    x: Tensor
    mask: Tensor


class Masked(nn.Module):
    """A forward that takes the batch whole."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, batch: Batch) -> Tensor:
        return self.fc(batch.x) * batch.mask


class TwoInputs(Masked):
    def forward(self, x: Tensor, mask: Tensor) -> Tensor:  # type: ignore[override]
        return self.fc(x) * mask


def _data() -> tuple[Batch, Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, 3, generator=g, dtype=torch.float64)
    mask = (torch.rand(ROWS, 1, generator=g) > 0.3).double()
    return Batch(x, mask), torch.randn(ROWS, 2, generator=g, dtype=torch.float64)


def _alone(ens: vmapens.Ensemble, batches: list[tuple[Batch, Tensor]]) -> list[nn.Module]:
    members = [copy.deepcopy(m) for m in ens.unstack()]
    for m in members:
        opt = torch.optim.SGD(m.parameters(), lr=LR)
        for b, y in batches:
            opt.zero_grad()
            nn.functional.mse_loss(m(b), y).backward()
            opt.step()
    return members


def _assert_members(ens: vmapens.Ensemble, members: list[nn.Module]) -> None:
    for k, m in enumerate(members):
        torch.testing.assert_close(ens[k].state_dict(), m.state_dict(), msg=f"member {k}")


def _cut(b: Batch, y: Tensor) -> list[tuple[Batch, Tensor]]:
    return [
        (Batch(b.x[i : i + BATCH], b.mask[i : i + BATCH]), y[i : i + BATCH])
        for i in range(0, ROWS, BATCH)
    ]


def test_step_gives_each_member_the_named_tuple_whole() -> None:
    b, y = _data()
    ens = vmapens.Ensemble(Masked, n=N, seed=0).double()
    want = _alone(ens, _cut(b, y))
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=LR))  # checked
    for bb, yy in _cut(b, y):
        losses = step(bb, yy)
    assert losses.shape == (N,)
    _assert_members(ens, want)


def test_a_plain_tuple_stays_several_inputs() -> None:
    b, y = _data()
    ens = vmapens.Ensemble(TwoInputs, n=N, seed=0).double()
    members = [copy.deepcopy(m) for m in ens.unstack()]
    for m in members:
        opt = torch.optim.SGD(m.parameters(), lr=LR)
        nn.functional.mse_loss(m(b.x, b.mask), y).backward()
        opt.step()
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=LR))
    step((b.x, b.mask), y)
    _assert_members(ens, members)


@pytest.mark.parametrize("as_batches", [False, True], ids=["tensors", "batches"])
def test_fit_validation_and_predict_give_the_named_tuple_whole(as_batches: bool) -> None:
    b, y = _data()
    ens = vmapens.Ensemble(Masked, n=N, seed=0).double()
    want = _alone(ens, _cut(b, y))
    data = _cut(b, y) if as_batches else (b, y)
    kwargs = {} if as_batches else {"batch_size": BATCH, "shuffle": False}
    history = vmapens.fit(ens, data, nn.MSELoss(), optimizer=vmapens.StackedSGD(ens, lr=LR),
                          epochs=1, val_data=(b, y), progress=False, **kwargs)  # fmt: skip
    _assert_members(ens, want)
    val = torch.stack([nn.functional.mse_loss(m(b), y) for m in want])
    torch.testing.assert_close(history.val_loss[-1], val)
    out = vmapens.predict(ens, [b], reduce="none")  # an iterable of batches
    torch.testing.assert_close(out, torch.stack([m(b) for m in want]).detach())


def test_lightning_predict_step_gives_the_named_tuple_whole() -> None:
    from vmapens.lightning import EnsembleModule

    b, y = _data()
    ens = vmapens.Ensemble(Masked, n=N, seed=0).double()
    want = torch.stack([m(b) for m in ens.unstack()]).detach()
    module = EnsembleModule(ens, nn.MSELoss())
    for batch in (b, (b,), (b, y)):  # inputs, (inputs,), (inputs, targets)
        torch.testing.assert_close(module.predict_step(batch, 0).detach(), want)
