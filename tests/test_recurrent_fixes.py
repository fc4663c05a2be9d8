"""Recurrent members with Dropout train as alone; under autocast they say they are inexact.

* A Dropout after ``nn.GRU(batch_first=True)`` (or after ``nn.TransformerEncoderLayer``'s
  attention) got another mask inside the ensemble than alone: torch's CPU dropout draws in
  the input's memory order, and torch's recurrent output is a time-first tensor seen batch
  first. The first step's self-check refused such members.
* Under autocast the batchable recurrent twins round elsewhere than torch's kernels: members
  are not exact, so the ensemble warns and points to ``backend="loop"``.

The truth is plain torch: each member trained alone with ``torch.optim.Adam`` from the same
global RNG state (``randomness="same"``: every member draws the mask a member alone draws).
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn
from truth import NO_BF16_LSTM, lstm_runs_under_bf16_autocast

import vmapens
from vmapens._batchable import batchable

TOL = dict(rtol=1e-9, atol=1e-10)  # float64: only summation order may differ
FEATURES, HIDDEN, ROWS, STEPS = 3, 4, 6, 5


class Seq(nn.Module):
    """A recurrent layer, then Dropout on its (batch-first, possibly strided) output."""

    def __init__(self, kind: type, batch_first: bool, bidirectional: bool) -> None:
        super().__init__()
        self.rnn = kind(
            FEATURES, HIDDEN, num_layers=2, dropout=0.3, batch_first=batch_first,
            bidirectional=bidirectional,
        )  # fmt: skip
        self.batch_first = batch_first
        self.drop = nn.Dropout(0.4)
        self.head = nn.Linear(HIDDEN * (1 + bidirectional), 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.rnn(x if self.batch_first else x.transpose(0, 1))[0]
        out = out if self.batch_first else out.transpose(0, 1)
        return self.head(self.drop(out).mean(1))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(4, 2, 8, dropout=0.3, batch_first=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(torch.cat([x, x[..., :1]], -1)).mean(1))


CASES: dict[str, Callable[[], nn.Module]] = {
    "gru-batch-first": functools.partial(Seq, nn.GRU, True, False),
    "gru-time-first": functools.partial(Seq, nn.GRU, False, False),
    "gru-bidirectional-batch-first": functools.partial(Seq, nn.GRU, True, True),
    "lstm-batch-first": functools.partial(Seq, nn.LSTM, True, False),
    "lstm-bidirectional-time-first": functools.partial(Seq, nn.LSTM, False, True),
    "rnn-bidirectional-batch-first": functools.partial(Seq, nn.RNN, True, True),
    "transformer-encoder-layer": Encoder,
}


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(ROWS, 5, FEATURES, generator=g, dtype=torch.float64),
         torch.randn(ROWS, 2, generator=g, dtype=torch.float64))
        for _ in range(STEPS)
    ]  # fmt: skip


@pytest.mark.parametrize(
    "n, randomness", [(1, "different"), (3, "same")], ids=["1-different", "3-same"]
)
@pytest.mark.parametrize("name", CASES)
def test_members_with_dropout_train_as_alone(name, n, randomness):
    """Was: the first step refused ("member 0 ... output differs by 0.06")."""
    factory = CASES[name]
    ens = vmapens.Ensemble(lambda: factory().double(), n, seed=0, randomness=randomness)
    alone = [copy.deepcopy(m) for m in ens.unstack()]
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-2))
    for k, (x, y) in enumerate(_batches()):
        torch.manual_seed(100 + k)
        step(x, y)
    for m in alone:
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        for k, (x, y) in enumerate(_batches()):
            torch.manual_seed(100 + k)  # the RNG state the ensemble's step started from
            opt.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()
    for i, m in enumerate(alone):
        torch.testing.assert_close(ens[i].state_dict(), m.state_dict(), **TOL)


def test_fit_trains_a_gru_followed_by_dropout():
    """The brief's repro: ``fit`` refused it with a RuntimeError from the self-check."""

    class G(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gru = nn.GRU(8, 8, batch_first=True)
            self.d = nn.Dropout(0.1)
            self.h = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.h(self.d(self.gru(x)[0]).mean(1))

    data = (torch.randn(12, 5, 8), torch.randn(12, 2))
    vmapens.fit(vmapens.Ensemble(G, n=2, seed=0), data, nn.MSELoss(), batch_size=6, seed=0,
                progress=False)  # fmt: skip


@pytest.mark.parametrize("kind", [nn.GRU, nn.LSTM, nn.RNN], ids=lambda k: k.__name__)
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch-first", "time-first"])
@pytest.mark.parametrize("bidirectional", [False, True], ids=["one-way", "bidirectional"])
def test_recurrent_outputs_have_torchs_strides(kind, batch_first, bidirectional):
    layer = kind(FEATURES, HIDDEN, num_layers=2, batch_first=batch_first,
                 bidirectional=bidirectional).double()  # fmt: skip
    x = torch.randn(6, 5, FEATURES, dtype=torch.float64)
    want, got = layer(x)[0], batchable(layer)(x)[0]
    assert got.stride() == want.stride()
    torch.testing.assert_close(got, want, **TOL)


# -- autocast: the twins are not exact, and say so --------------------------------------------

AUTOCAST_CASES: dict[str, Callable[[], nn.Module]] = {
    "gru": lambda: nn.GRU(FEATURES, HIDDEN, batch_first=True),
    "lstm": lambda: nn.LSTM(FEATURES, HIDDEN),
    "rnn": lambda: nn.RNN(FEATURES, HIDDEN),
    "gru-cell": lambda: nn.GRUCell(FEATURES, HIDDEN),
    "lstm-cell": lambda: nn.LSTMCell(FEATURES, HIDDEN),
    "rnn-cell": lambda: nn.RNNCell(FEATURES, HIDDEN),
}


def _first(out: object) -> torch.Tensor:
    while isinstance(out, (tuple, list)):
        out = out[0]
    assert isinstance(out, torch.Tensor)
    return out


def _input(name: str) -> torch.Tensor:
    return torch.randn(4, FEATURES) if "cell" in name else torch.randn(4, 5, FEATURES)


@pytest.mark.parametrize("name", AUTOCAST_CASES)
def test_recurrent_members_under_autocast_warn(name):
    ens = vmapens.Ensemble(AUTOCAST_CASES[name], n=2, seed=0)
    cls = type(AUTOCAST_CASES[name]()).__name__
    warned = pytest.warns(UserWarning, match=rf"nn\.{cls} members under autocast .*backend='loop'")
    with warned, torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ens(_input(name))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ens(_input(name))  # no autocast: exact, silent


def test_precision_bf16_step_warns():
    ens = vmapens.Ensemble(lambda: Seq(nn.LSTM, True, False), n=2, seed=0)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens), precision="bf16")
    x, y = torch.randn(ROWS, 5, FEATURES), torch.randn(ROWS, 2)
    if not lstm_runs_under_bf16_autocast():  # an AVX2 CPU: torch's LSTM alone fails there
        before = {k: v.clone() for k, v in ens.state_dict().items()}
        refused = pytest.raises(RuntimeError, match=f"member 0 of Seq fails alone.*{NO_BF16_LSTM}")
        # the twin ran inside (its warning); the self-check then ran a member alone
        with refused, pytest.warns(UserWarning, match=r"nn\.LSTM members under autocast"):
            step(x, y)
        assert all(torch.equal(v, before[k]) for k, v in ens.state_dict().items())
        return
    with pytest.warns(UserWarning, match=r"nn\.LSTM members under autocast \(torch\.bfloat16\)"):
        step(x, y)


@pytest.mark.parametrize("name", AUTOCAST_CASES)
def test_loop_backend_under_autocast_is_exact_and_silent(name):
    ens = vmapens.Ensemble(AUTOCAST_CASES[name], n=2, seed=0, backend="loop")
    x = _input(name)
    if name == "lstm" and not lstm_runs_under_bf16_autocast():  # AVX2: fails alone, so here
        bf16 = torch.autocast("cpu", dtype=torch.bfloat16)
        with pytest.raises(RuntimeError, match=NO_BF16_LSTM), torch.no_grad(), bf16:
            ens(x)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            together = _first(ens(x))
            alone = torch.stack([_first(m(x)) for m in ens.unstack()])
    assert together.dtype == alone.dtype
    torch.testing.assert_close(together, alone, rtol=0, atol=0)


def test_float64_members_under_autocast_are_silent():
    # autocast leaves float64 alone, so the twins compute what torch computes.
    ens = vmapens.Ensemble(lambda: nn.GRU(FEATURES, HIDDEN).double(), n=2, seed=0)
    x = torch.randn(5, 4, FEATURES, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            together = ens(x)[0]
    alone = torch.stack([m(x)[0] for m in ens.unstack()])
    torch.testing.assert_close(together, alone.detach(), **TOL)
