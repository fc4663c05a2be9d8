"""Recurrent and attention members train batched and end where they would alone.

Each ensemble trains with ``make_step`` (eager and compiled); the truth is N plain modules of
the user's own class (nn.GRU, nn.LSTM, nn.MultiheadAttention, ...) with torch.optim.Adam.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import truth
from torch import nn

import vmapens

# float64 throughout: only summation order differs (measured ~1e-16 per step on every CPU
# setting); a wrong gate, projection or update is off by far more.
TOL = dict(rtol=1e-9, atol=1e-10)
N = 3


class Seq(nn.Module):
    """A recurrent layer of torch's, then a linear head on the last step."""

    def __init__(self, make: Callable[[], nn.Module], hidden: int) -> None:
        super().__init__()
        self.rnn = make()
        self.head = nn.Linear(hidden, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.rnn(x)[0]
        return self.head(out[:, -1])


class CellLoop(nn.Module):
    """A GRUCell unrolled by hand, as RL code does."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.GRUCell(4, 6)
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(x.shape[0], 6, dtype=x.dtype)
        for t in range(x.shape[1]):
            h = self.cell(x[:, t], h)
        return self.head(h)


class Attention(nn.Module):
    """nn.MultiheadAttention (need_weights=False: the fused sdpa path) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x, x, x, need_weights=False)[0].mean(1))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(x).mean(1))


MODELS = {
    "gru-2layer-bidirectional": lambda: Seq(
        lambda: nn.GRU(4, 6, num_layers=2, bidirectional=True, batch_first=True), 12
    ),
    "lstm-proj": lambda: Seq(lambda: nn.LSTM(4, 6, proj_size=3, batch_first=True), 3),
    # The eager step's fused recurrence (vmapens/_lstm_fused.py), both directions.
    "lstm-2layer-bidirectional": lambda: Seq(
        lambda: nn.LSTM(4, 6, num_layers=2, bidirectional=True, batch_first=True), 12
    ),
    "rnn-relu-no-bias": lambda: Seq(
        lambda: nn.RNN(4, 6, nonlinearity="relu", bias=False, batch_first=True), 6
    ),
    "gru-cell-loop": CellLoop,
    "multihead-attention": Attention,
    "transformer-encoder": Encoder,
}
# Compiling unrolls the time loop: small cases keep the compile to a few seconds each.
COMPILED_MODELS = {
    "gru-short": lambda: Seq(lambda: nn.GRU(4, 6, batch_first=True), 6),
    # Eager, vmapens's LSTM node is an autograd.Function; compiled, the per-step loop runs in
    # its place, and the compiled step must not refuse it as a user's Function with a backward
    # of its own (_compiling.refuse_custom_backwards).
    "lstm-short": lambda: Seq(lambda: nn.LSTM(4, 6, batch_first=True), 6),
    "encoder-layer": lambda: nn.Sequential(
        nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True),
        nn.Flatten(),
        nn.Linear(3 * 8, 2),
    ),
}


def _train_and_compare(name: str, compile: bool, seq: int = 7, batch: int = 5) -> None:
    torch.manual_seed(0)
    make = {**MODELS, **COMPILED_MODELS}[name]
    twins = [make().double() for _ in range(N)]
    ens = vmapens.Ensemble.from_modules(truth.twins(twins))
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-2), compile=compile)
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(batch, seq, 4 if "attention" not in name and "encoder" not in name else 8,
                     generator=g, dtype=torch.float64),
         torch.randn(batch, 2, generator=g, dtype=torch.float64))
        for _ in range(3)
    ]  # fmt: skip
    for x, y in batches:
        step(x, y)
    truth.train_each(twins, batches)  # torch.optim.Adam, lr 1e-2, MSE
    for member, twin in zip(ens.unstack(), twins, strict=True):
        assert type(member) is type(twin)  # the user's own classes come back
        assert type(member.state_dict()) is type(twin.state_dict())
        torch.testing.assert_close(member.state_dict(), twin.state_dict(), **TOL)


@pytest.mark.parametrize("name", MODELS)
def test_eager_members_equal_twins(name):
    _train_and_compare(name, compile=False)


@pytest.mark.parametrize("name", COMPILED_MODELS)
def test_compiled_members_equal_twins(name):
    _train_and_compare(name, compile=True, seq=3)


def test_compiled_input_weight_gradient_runs_transposed_and_members_equal_twins(monkeypatch):
    """4 input features, 16 x 3 time steps: the input weights' gradient (a sum over the 48
    input rows, 4 columns wide) is the narrow shared product that the compiled step runs
    transposed (vmapens/_matmuls.py). The rows come from the batch rather than from time
    steps: 3 unrolled GRU steps compile in 14 s where the 5 x 12 this test had took 22 s."""
    from vmapens import _matmuls

    calls = []
    transposed = _matmuls._transposed
    monkeypatch.setattr(_matmuls, "_transposed", lambda *args: calls.append(1) or transposed(*args))
    torch._dynamo.reset()  # compile anew, past any cached graph
    with torch._inductor.config.patch(fx_graph_cache=False):
        _train_and_compare("gru-short", compile=True, seq=3, batch=16)
    assert calls


def test_recurrent_members_run_batched_not_looped():
    # The vmap backend runs them (no fallback to the loop backend), and unstack gives nn.GRU.
    ens = vmapens.Ensemble(MODELS["gru-2layer-bidirectional"], N, seed=0)
    assert ens.backend == "vmap"
    assert isinstance(ens[0].rnn, nn.GRU) and isinstance(ens.template.rnn, nn.GRU)
    assert ens(torch.randn(5, 7, 4)).shape == (N, 5, 2)


def test_packed_sequences_point_to_the_loop_backend():
    ens = vmapens.Ensemble(lambda: nn.GRU(4, 6), N, seed=0)
    packed = nn.utils.rnn.pack_sequence([torch.randn(3, 4), torch.randn(2, 4)])
    with pytest.raises(TypeError, match="PackedSequence .* backend='loop'"):
        ens(packed)
