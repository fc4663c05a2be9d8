"""A member's forward that branches on its recurrent layer's class, inside the ensemble.

The runner swaps ``nn.GRU``/``nn.LSTM``/``nn.RNN`` for batchable twins that are not instances
of those classes: dynamo refuses any instance of them, subclasses included
(``torch/_dynamo/variables/builder.py``: "Attempted to wrap RNN, GRU, or LSTM"), so a twin that
subclassed them would break ``make_step(compile=True)`` and ``torch.compile(batchable(m))``.
docs/semantics.md ("What vmap cannot batch") documents the consequence and the cure (branch on
``.mode``). These tests pin what does hold: the cell twins are instances of their torch classes,
a ``.mode`` branch and a cell ``isinstance`` branch give the member alone's outputs and training
(float64, plain torch as truth), ``backend="loop"`` runs the plain layers, and an ``isinstance``
branch on a full layer is refused by the first step, never trained wrong.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

import vmapens

TOL = {"atol": 1e-10, "rtol": 1e-10}
LAYERS = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}
CELLS = {"lstm": nn.LSTMCell, "gru": nn.GRUCell, "rnn": nn.RNNCell}


class ByMode(nn.Module):
    """Branches as docs/semantics.md advises: on ``mode`` for the layer, on the cell's class."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.rnn = LAYERS[kind](3, 4, batch_first=True)
        self.cell = CELLS[kind](3, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: Tensor) -> Tensor:
        if self.rnn.mode == "LSTM":
            out, (_, _) = self.rnn(x)
        else:
            out, _ = self.rnn(x)
        if isinstance(self.cell, nn.LSTMCell):
            h, _ = self.cell(x[:, 0])
        elif isinstance(self.cell, (nn.GRUCell, nn.RNNCell)):
            h = self.cell(x[:, 0])
        else:  # the branch a twin that is not its cell's instance would take
            h = torch.zeros_like(out[:, 0])
        return self.head(out[:, -1] + h)


class ByClass(ByMode):
    """Branches on the full layer's class: the documented limitation."""

    def forward(self, x: Tensor) -> Tensor:
        if isinstance(self.rnn, nn.LSTM):
            out, (_, _) = self.rnn(x)
            return self.head(out[:, -1])
        out, _ = self.rnn(x)
        return self.head(out[:, -1] if isinstance(self.rnn, (nn.GRU, nn.RNN)) else -out[:, -1])


def _members(cls: type[ByMode], kind: str, n: int = 3) -> list[nn.Module]:
    torch.manual_seed(0)
    return [cls(kind).double() for _ in range(n)]


def _data() -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(2, 5, 3, generator=g, dtype=torch.float64), torch.randn(2, 1, generator=g))
        for _ in range(3)
    ]


@pytest.mark.parametrize("kind", LAYERS)
def test_cell_twins_are_instances_of_their_torch_class(kind):
    ens = vmapens.Ensemble.from_modules(_members(ByMode, kind, 2))
    assert isinstance(ens.runner.cell, CELLS[kind])
    assert type(ens.runner.cell) is not CELLS[kind]  # the twin runs
    assert type(ens[0].cell) is CELLS[kind] and type(ens[0].rnn) is LAYERS[kind]
    assert all(type(m.rnn) is LAYERS[kind] for m in ens.unstack())


@pytest.mark.parametrize("chunk_size", [None, 2])
@pytest.mark.parametrize("backend", ["vmap", "loop"])
@pytest.mark.parametrize("kind", LAYERS)
def test_branch_on_mode_and_cell_class_gives_the_member_alone(kind, backend, chunk_size):
    members = _members(ByMode, kind)
    x = _data()[0][0]
    want = torch.stack([m(x) for m in members])
    ens = vmapens.Ensemble.from_modules(
        [copy.deepcopy(m) for m in members], backend=backend, chunk_size=chunk_size
    )
    torch.testing.assert_close(ens(x), want, **TOL)


@pytest.mark.parametrize("kind", LAYERS)
def test_branch_on_mode_and_cell_class_trains_as_alone(kind):
    members = _members(ByMode, kind)
    ens = vmapens.Ensemble.from_modules([copy.deepcopy(m) for m in members])
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-2))
    for x, y in _data():
        step(x, y)
    for i, m in enumerate(members):
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        for x, y in _data():
            opt.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()
        torch.testing.assert_close(ens[i].state_dict(), m.state_dict(), **TOL)


@pytest.mark.parametrize("chunk_size", [None, 2])
@pytest.mark.parametrize("kind", LAYERS)
def test_branch_on_layer_class_runs_exact_with_the_loop_backend(kind, chunk_size):
    members = _members(ByClass, kind)
    x = _data()[0][0]
    want = torch.stack([m(x) for m in members])
    ens = vmapens.Ensemble.from_modules(
        [copy.deepcopy(m) for m in members], backend="loop", chunk_size=chunk_size
    )
    torch.testing.assert_close(ens(x), want, **TOL)


@pytest.mark.parametrize("kind", LAYERS)
def test_branch_on_layer_class_is_refused_by_the_first_step(kind):
    """The documented limitation: the first step's self-check refuses, nothing is stepped."""
    ens = vmapens.Ensemble.from_modules(_members(ByClass, kind))
    before = {k: v.clone() for k, v in ens.stacked_state().items()}
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-2))
    x, y = _data()[0]
    with pytest.raises(RuntimeError, match="differs"):
        step(x, y)
    torch.testing.assert_close(ens.stacked_state(), before, atol=0, rtol=0)
