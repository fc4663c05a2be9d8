"""The recurrent twins refuse the inputs torch's own layers refuse, instead of running them.

The truth is torch's own module called alone on the same inputs: where it raises, the
ensemble (whose members run ``vmapens._recurrent``'s twins) must raise too, naming the
argument, and not return a result. Where torch runs, the ensemble gives each member's result.

* A cell's state of another batch size (one row for a batch of five) broadcast in the twin's
  ops and ran, silently, where torch's cell kernels raise "Input batch size 5 doesn't match
  hidden0 batch size 1".
* A sequence of no time steps failed inside the twin with "stack expects a non-empty
  TensorList", which names nothing the caller passed.

And docs/semantics.md's word on the swapped layers' class: they are no ``nn.LSTM`` instances,
so a forward should tell them apart by ``mode``, which equals torch; one that branches on
``isinstance`` is refused by the first step's self-check.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
from torch import nn

import vmapens

TOL = dict(rtol=1e-10, atol=1e-12)  # float64: the same maths, summed in another order
N, FEATURES, HIDDEN, BATCH = 2, 3, 4, 5


def _members(make: Callable[[], nn.Module]) -> tuple[list[nn.Module], vmapens.Ensemble]:
    torch.manual_seed(0)
    alone = [make().double() for _ in range(N)]
    return alone, vmapens.Ensemble.from_modules(copy.deepcopy(alone))


def _state(cell: type, *shapes: tuple[int, ...]) -> Any:
    g = torch.Generator().manual_seed(1)
    states = [torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes]
    return tuple(states) if cell is nn.LSTMCell else states[0]


BAD_STATES = [
    # (cell, input shape, state shapes, the argument the error names)
    (nn.RNNCell, (BATCH, FEATURES), [(1, HIDDEN)], "`hx`"),
    (nn.GRUCell, (BATCH, FEATURES), [(1, HIDDEN)], "`hx`"),
    (nn.GRUCell, (FEATURES,), [(1, HIDDEN)], "`hx`"),
    (nn.LSTMCell, (BATCH, FEATURES), [(1, HIDDEN), (BATCH, HIDDEN)], "`hx[0]`"),
    (nn.LSTMCell, (BATCH, FEATURES), [(BATCH, HIDDEN), (1, HIDDEN)], "`hx[1]`"),
    (nn.LSTMCell, (FEATURES,), [(HIDDEN,), (1, HIDDEN)], "`hx[1]`"),
]


@pytest.mark.parametrize(
    "cell, shape, states, name",
    BAD_STATES,
    ids=[f"{c.__name__}-{len(s)}d-{n.strip('`')}" for c, s, _, n in BAD_STATES],
)
def test_cells_refuse_a_state_of_another_shape_as_torch_does(cell, shape, states, name):
    """Was: the ensemble broadcast the one-row state over the batch and returned a result."""
    alone, ens = _members(lambda: cell(FEATURES, HIDDEN))
    x = torch.randn(*shape, dtype=torch.float64)
    hx = _state(cell, *states)
    with pytest.raises(RuntimeError):  # the truth: torch's own cell refuses it
        alone[0](x, hx)
    with pytest.raises(ValueError, match=re.escape(f"{name} must have shape")):
        ens(x, hx)


@pytest.mark.parametrize("cell", [nn.RNNCell, nn.GRUCell, nn.LSTMCell], ids=lambda c: c.__name__)
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
def test_cells_with_a_given_state_equal_torch(cell, batched):
    """The check lets through every state torch takes: each member's output as alone."""
    alone, ens = _members(lambda: cell(FEATURES, HIDDEN))
    lead = (BATCH,) if batched else ()
    x = torch.randn(*lead, FEATURES, dtype=torch.float64)
    hx = _state(cell, (*lead, HIDDEN), (*lead, HIDDEN))
    together = ens(x, hx)
    for i, m in enumerate(alone):
        torch.testing.assert_close(optree.tree_map(lambda t, i=i: t[i], together), m(x, hx), **TOL)


@pytest.mark.parametrize("kind", [nn.RNN, nn.GRU, nn.LSTM], ids=lambda k: k.__name__)
@pytest.mark.parametrize("batch_first", [False, True], ids=["time-first", "batch-first"])
def test_a_sequence_of_no_time_steps_is_refused_naming_input(kind, batch_first):
    """Was: "stack expects a non-empty TensorList" from inside the twin."""
    alone, ens = _members(lambda: kind(FEATURES, HIDDEN, batch_first=batch_first))
    x = torch.randn(*((BATCH, 0) if batch_first else (0, BATCH)), FEATURES, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="sequence length"):  # the truth
        alone[0](x)
    with pytest.raises(ValueError, match="`input` must have at least one time step"):
        ens(x)


class LastState(nn.Module):
    """An encoder that takes the last layer's hidden state, whatever its recurrent layer."""

    def __init__(self, kind: type, by_mode: bool) -> None:
        super().__init__()
        self.rnn = kind(FEATURES, HIDDEN, num_layers=2)
        self.head = nn.Linear(HIDDEN, 1)
        self.by_mode = by_mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, h = self.rnn(x)
        lstm = self.rnn.mode == "LSTM" if self.by_mode else isinstance(self.rnn, nn.LSTM)
        return self.head((h[0] if lstm else h)[-1])


@pytest.mark.parametrize("kind", [nn.GRU, nn.LSTM], ids=lambda k: k.__name__)
def test_a_forward_that_branches_on_the_layers_mode_equals_torch(kind):
    """docs/semantics.md's way to tell the layers apart: `mode`, which the twins keep."""
    alone, ens = _members(lambda: LastState(kind, by_mode=True))
    x = torch.randn(5, BATCH, FEATURES, dtype=torch.float64)
    together = ens(x)
    for i, m in enumerate(alone):
        torch.testing.assert_close(together[i], m(x), **TOL)


def test_the_first_step_refuses_a_forward_that_branches_on_isinstance():
    """The swapped nn.LSTM is no nn.LSTM instance (docs/semantics.md): the first step's
    self-check sees the other branch's output and refuses before anything changes."""
    ens = vmapens.Ensemble(lambda: LastState(nn.LSTM, by_mode=False).double(), n=N, seed=0)
    before = copy.deepcopy(ens.state_dict())
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-2))
    x = torch.randn(5, BATCH, FEATURES, dtype=torch.float64)
    with pytest.raises(RuntimeError), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # MSELoss on the other branch's shape
        step(x, torch.randn(BATCH, 1, dtype=torch.float64))
    torch.testing.assert_close(ens.state_dict(), before, rtol=0, atol=0)
