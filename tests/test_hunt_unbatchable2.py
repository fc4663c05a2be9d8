"""Forwards that read a tensor's memory, and buffers written in place through slices.

``.tolist()``, ``.numpy()``, ``.data_ptr()`` and ``.untyped_storage()`` on a member's tensor
fail inside ``torch.func.vmap`` with "Cannot access data pointer of Tensor that doesn't have
storage" (or a NotImplementedError about ``BatchedTensorImpl``); the ensemble used to answer
with its generic "check the inputs" message about in-place ops. The truth is each member run
alone as a plain module, float64: ``backend="loop"`` must give exactly that.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from truth import assert_members_equal

import vmapens

N, ROWS = 3, 4

READS_MEMORY: dict[str, Callable[[torch.Tensor], float]] = {
    "tolist": lambda h: float(len(h.tolist())),
    "numpy": lambda h: float(h.detach().numpy().shape[0]),
    "data_ptr": lambda h: float(h.data_ptr() != 0),
    "untyped_storage": lambda h: float(h.untyped_storage().nbytes() > 0),
}


class ReadsMemory(nn.Module):
    """BatchNorm (statistics a refused call must give back), then a host read of its output."""

    def __init__(self, how: str = "tolist") -> None:
        super().__init__()
        self.how = how
        self.bn, self.fc = nn.BatchNorm1d(3), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(self.bn(x))
        return h * READS_MEMORY[self.how](h)


def _x() -> torch.Tensor:
    return torch.randn(ROWS, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


@pytest.mark.parametrize("settings", [{}, {"chunk_size": 2}], ids=["vmap", "chunk-2"])
@pytest.mark.parametrize("how", list(READS_MEMORY))
def test_a_forward_that_reads_tensor_memory_is_explained(how: str, settings: dict) -> None:
    ens = vmapens.Ensemble(lambda: ReadsMemory(how), n=N, seed=0, **settings).double()
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    with pytest.raises(
        RuntimeError, match=r"reads a tensor's memory \(\.tolist\(\).*backend='loop'"
    ):
        ens(_x())
    for k, v in ens.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("how", list(READS_MEMORY))
def test_the_way_out_runs_each_member_as_alone(how: str) -> None:
    ens = vmapens.Ensemble(lambda: ReadsMemory(how), n=N, seed=0, backend="loop").double()
    alone = ens.unstack()
    x = _x()
    out = ens(x)
    for i, m in enumerate(alone):
        torch.testing.assert_close(out[i], m(x), rtol=0, atol=0)
    assert_members_equal(ens, alone)


def test_a_loss_that_reads_tensor_memory_names_loss_fn() -> None:
    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out, y) * len(out.tolist())

    ens = vmapens.Ensemble(lambda: nn.Linear(3, 2), n=N, seed=0).double()
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    step = vmapens.make_step(ens, loss_fn, vmapens.StackedSGD(ens, lr=0.1))
    with pytest.raises(RuntimeError, match=r"`loss_fn` or the forward of Linear reads a tensor"):
        step(_x(), torch.zeros(ROWS, 2, dtype=torch.float64))
    for k, v in ens.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, msg=k)


class WritesRows(nn.Module):
    """Writes a buffer through a slice and a row (index_put / copy_ on a view), then
    multiplies it into the output (saved for backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.register_buffer("seen", torch.zeros(ROWS, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        self.seen[:, 0] = h[:, 0].detach()
        self.seen[1] += 1
        return h * self.seen


class CopiesWithGrad(nn.Module):
    """``self.buf.copy_(h.mean(0))`` under no_grad, in train mode only."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.register_buffer("buf", torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.training:
            with torch.no_grad():
                self.buf.copy_(h.mean(0))
        return h * self.buf


SETTINGS = [
    pytest.param({}, id="vmap"),
    pytest.param({"backend": "loop"}, id="loop"),
    pytest.param({"chunk_size": 1}, id="chunk-1"),
    pytest.param({"chunk_size": 2}, id="chunk-2"),
]


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("factory", [WritesRows, CopiesWithGrad])
def test_buffers_written_in_place_train_as_alone(
    factory: Callable[[], nn.Module], settings: dict[str, Any], train: bool
) -> None:
    ens = vmapens.Ensemble(factory, n=N, seed=0, **settings).double().train(train)
    alone = ens.unstack()
    opt = vmapens.StackedSGD(ens, lr=0.1)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in alone]
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        x = torch.randn(ROWS, 3, generator=g, dtype=torch.float64)
        opt.zero_grad()
        ens(x).pow(2).sum().backward()
        opt.step()
        for m, o in zip(alone, opts, strict=True):
            o.zero_grad()
            m(x).pow(2).sum().backward()
            o.step()
        with torch.no_grad():  # and a forward without grad edits them as alone, too
            out = ens(x)
            for i, m in enumerate(alone):
                torch.testing.assert_close(out[i], m(x), rtol=1e-12, atol=1e-12)
    assert_members_equal(ens, alone)


def test_per_member_runs_a_loss_that_reads_tolist_member_by_member() -> None:
    # as with .item(): vmap cannot, so each member's slice runs in turn, as alone
    def loss(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((o - y) ** 2).mean() * (1 + 0 * max(o.detach().flatten().tolist()))

    out = torch.randn(2, 4, 2, dtype=torch.float64)
    y = torch.randn(4, 2, dtype=torch.float64)
    got = vmapens.per_member(loss)(out, y)
    torch.testing.assert_close(got, torch.stack([loss(out[i], y) for i in range(2)]))
