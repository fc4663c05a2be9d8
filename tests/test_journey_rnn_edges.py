"""User journey: the edge cases of ``nn.RNN``/``nn.GRU``/``nn.LSTM`` that real forwards hit,
trained with ``make_step`` and ``StackedAdam`` (``backend="vmap"``, ``chunk_size=2``,
``backend="loop"``).

vmapens runs its own batchable twins of torch's recurrent layers (``vmapens/_recurrent.py``,
``_recurrent_steps.py``, and ``_lstm_fused.py``, the LSTM's hand-written autograd node), so
each edge case is the library's own code. The truth: each member a plain module with torch's
own layers, trained alone with ``torch.optim.Adam`` on the same batches, float64 (float32 where
said). Covered here, beyond tests/test_recurrent.py, test_lstm_fused.py and
test_hunt_recurrent2.py (layer-level, or SGD with ``backend="vmap"`` only): ``nn.RNN`` relu and
tanh without bias, ``batch_first``, two bidirectional layers, one time step, unbatched
``(seq, feature)`` input, ``h0``/``c0`` shared and per member with ``proj_size``,
``flatten_parameters()`` in the forward, a bidirectional LSTM read through ``h_n[-2:]`` only,
two GRUs sharing their weights, dropout between layers in training (``randomness="same"``:
each member draws its own mask, docs/semantics.md "Randomness in the forward pass") and in
eval, AWD-LSTM's DropConnect on ``weight_hh_l0``, float32 members, ``PackedSequence`` with
``enforce_sorted=False`` and lengths of 1 (``backend="loop"``; refused otherwise), the LSTM
node under ``torch.no_grad`` and ``torch.inference_mode``, ``randomness="error"``, initial
states' and a shared input's gradients with members in turns.

Two bugs, both with ``backend="loop"``: a parametrized RNN (``orthogonal``) could not be given
back (``ens[i]``, ``unstack()``, ``copy.deepcopy(ens)``) after a training step (fixed, patch
rnnedges-1), and a ``spectral_norm``-ed ``weight_hh_l0`` runs half the power iterations it
runs alone, silently (a strict xfail).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.parametrizations import orthogonal, spectral_norm
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import vmapens

N, T, B, FEAT, H = 3, 4, 2, 3, 4
F64 = torch.float64
TOL: dict[str, Any] = dict(rtol=1e-9, atol=1e-10)  # float64: only summation order differs
# float32: torch's oneDNN/fused kernels against the twins' ops, after 2 Adam steps of lr 1e-2
TOL32: dict[str, Any] = dict(rtol=1e-5, atol=1e-5)
BACKENDS = [{}, {"chunk_size": 2}, {"backend": "loop"}]
IDS = ["vmap", "chunks", "loop"]


class Head(nn.Module):
    """A recurrent layer, a pick from its result, a linear head."""

    def __init__(self, rnn: nn.Module, width: int, pick: Callable[[Any], Tensor] | None = None):
        super().__init__()
        self.rnn, self.head, self.pick = rnn, nn.Linear(width, 1), pick

    def forward(self, x: Tensor, *state: Any) -> Tensor:
        result = self.rnn(x, *state)
        return self.head(result[0] if self.pick is None else self.pick(result))


class LSTMWithStates(nn.Module):
    """An LSTM with ``proj_size`` fed ``(h0, c0)`` passed in."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(FEAT, H, proj_size=2, num_layers=2)
        self.head = nn.Linear(2, 1)

    def forward(self, x: Tensor, h0: Tensor, c0: Tensor) -> Tensor:
        out, (h, c) = self.rnn(x, (h0, c0))
        return self.head(out) + (h.sum() + c.sum()) / 10


class Flattened(nn.Module):
    """``flatten_parameters()`` in the forward, a GRU without bias fed ``h0``."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(FEAT, H, bias=False, batch_first=True)
        self.head = nn.Linear(H, 1)

    def forward(self, x: Tensor, h0: Tensor) -> Tensor:
        self.rnn.flatten_parameters()
        return self.head(self.rnn(x, h0)[0])


class TiedGRUs(nn.Module):
    """Two GRUs sharing every weight, one reading the sequence reversed."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.GRU(FEAT, H), nn.GRU(FEAT, H)
        for name in ("weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0"):
            setattr(self.b, name, getattr(self.a, name))
        self.head = nn.Linear(H, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.a(x)[0] + self.b(x.flip(0))[0])


class WeightDrop(nn.Module):
    """AWD-LSTM's DropConnect: ``weight_hh_l0`` recomputed from a raw parameter each call."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(FEAT, H)
        raw = self.rnn.weight_hh_l0.detach().clone()
        del self.rnn._parameters["weight_hh_l0"]
        self.rnn.register_parameter("weight_hh_l0_raw", nn.Parameter(raw))
        self.rnn.weight_hh_l0 = torch.zeros_like(raw)  # the same in every member
        self.head = nn.Linear(H, 1)

    def forward(self, x: Tensor) -> Tensor:
        self.rnn.weight_hh_l0 = F.dropout(self.rnn.weight_hh_l0_raw, 0.3, self.training)
        return self.head(self.rnn(x)[0])


def _last_two(result: Any) -> Tensor:
    """A bidirectional classifier's read-out: the last layer's two final states only."""
    h = result[1][0]
    return torch.cat((h[-2], h[-1]), 1)


V, C, L = "vmap", "chunks", "loop"
# name: (make, input shapes, target shape, inputs per member (in_dims=0), randomness,
# backends). Every backend runs where members in turns could differ (dropout, shared weights);
# elsewhere the twins' maths is the same with or without chunks, and the loop runs torch's.
CASES: dict[str, tuple[Callable[[], nn.Module], list[tuple[int, ...]], tuple[int, ...], bool,
                       str, str]] = {
    "rnn-relu-no-bias-batch_first-bidirectional-2layers": (
        lambda: Head(
            nn.RNN(FEAT, H, 2, nonlinearity="relu", bias=False, batch_first=True,
                   bidirectional=True), 2 * H),
        [(B, T, FEAT)], (B, T, 1), False, "different", V,
    ),
    "rnn-tanh-one-step": (lambda: Head(nn.RNN(FEAT, H), H), [(1, B, FEAT)], (1, B, 1), False,
                          "different", C),
    "lstm-proj-states-shared": (
        LSTMWithStates, [(T, B, FEAT), (2, B, 2), (2, B, H)], (T, B, 1), False, "different", V),
    "lstm-proj-states-per-member": (
        LSTMWithStates, [(T, B, FEAT), (2, B, 2), (2, B, H)], (T, B, 1), True, "different", C),
    "gru-flatten_parameters-h0-per-member": (
        Flattened, [(B, T, FEAT), (1, B, H)], (B, T, 1), True, "different", C),
    "lstm-bidirectional-2layers-h_n-last-two-only": (
        lambda: Head(nn.LSTM(FEAT, H, 2, bidirectional=True), 2 * H, _last_two),
        [(T, B, FEAT)], (B, 1), False, "different", V,
    ),
    "gru-tied-weights": (TiedGRUs, [(T, B, FEAT)], (T, B, 1), False, "different", V + L),
    "lstm-dropout-train": (lambda: Head(nn.LSTM(FEAT, H, 2, dropout=0.5), H), [(T, B, FEAT)],
                           (T, B, 1), False, "same", V + C + L),
    "gru-dropout-train-bidirectional-batch_first": (
        lambda: Head(nn.GRU(FEAT, H, 2, dropout=0.5, bidirectional=True, batch_first=True),
                     2 * H),
        [(B, T, FEAT)], (B, T, 1), False, "same", C,
    ),
    "rnn-dropout-train-3layers-unbatched": (
        lambda: Head(nn.RNN(FEAT, H, 3, dropout=0.4), H), [(T, FEAT)], (T, 1), False, "same",
        V),
    "lstm-weight-drop": (WeightDrop, [(T, B, FEAT)], (T, B, 1), False, "same", V + L),
}  # fmt: skip
RUNS = [(name, b) for name, case in CASES.items() for b in IDS if b in case[5]]


def _batches(shapes: list[tuple[int, ...]], target: tuple[int, ...], lead: tuple[int, ...],
             dtype: torch.dtype = F64) -> list[tuple[Any, Tensor]]:  # fmt: skip
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(2):
        xs = tuple(torch.randn(*lead, *s, generator=g, dtype=dtype) for s in shapes)
        out.append(
            (xs[0] if len(xs) == 1 else xs, torch.randn(*lead, *target, generator=g, dtype=dtype))
        )
    return out  # fmt: skip


def _train_alone(m: nn.Module, batches: list[tuple[Any, Tensor]], i: int | None) -> None:
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    for k, (x, y) in enumerate(batches):
        if i is not None:  # this member's own rows
            x, y = optree.tree_map(lambda t: t[i], x), y[i]
        torch.manual_seed(100 + k)  # the RNG state the ensemble's step starts from
        opt.zero_grad()
        F.mse_loss(m(*x) if isinstance(x, tuple) else m(x), y).backward()
        opt.step()


def _assert_members(ens: vmapens.Ensemble, alone: list[nn.Module], tol: dict[str, Any]) -> None:
    for i, m in enumerate(alone):
        got = ens.state_dicts()[i]
        want = {k: v for k, v in m.state_dict().items() if k in got}
        assert list(got) == list(want)
        for k in want:
            torch.testing.assert_close(
                got[k], want[k], **tol, msg=lambda e, i=i, k=k: f"member {i} `{k}`: {e}"
            )


def _train_both(make: Callable[[], nn.Module], batches: list, per_member: bool,
                randomness: str, kw: dict, dtype: torch.dtype | None = F64) -> tuple:  # fmt: skip
    """Both sides trained; ``dtype`` None keeps the factory's (``.to()`` on a parametrized RNN
    leaves its computed weight in ``_flat_weights``, which torch's deepcopy refuses)."""
    factory = make if dtype is None else lambda: make().to(dtype)
    ens = vmapens.Ensemble(factory, N, seed=0, randomness=randomness, **kw)
    alone = [copy.deepcopy(m) for m in ens.unstack()]
    step = vmapens.make_step(
        ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-2), in_dims=0 if per_member else None
    )
    for k, (x, y) in enumerate(batches):
        torch.manual_seed(100 + k)
        step(x, y)
    for i, m in enumerate(alone):
        _train_alone(m, batches, i if per_member else None)
    return ens, alone


@pytest.mark.parametrize("name, backend", RUNS, ids=[f"{n}-{b}" for n, b in RUNS])
def test_members_train_as_alone(name: str, backend: str) -> None:
    make, shapes, target, per_member, randomness, _ = CASES[name]
    batches = _batches(shapes, target, (N,) if per_member else ())
    ens, alone = _train_both(make, batches, per_member, randomness, BACKENDS[IDS.index(backend)])
    _assert_members(ens, alone, TOL)


def test_float32_members_train_as_alone() -> None:
    """The LSTM node and the GRU twin in float32 against torch's own float32 kernels."""

    class Both(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(FEAT, H, 2)
            self.gru = nn.GRU(H, H, bidirectional=True)
            self.head = nn.Linear(2 * H, 1)

        def forward(self, x: Tensor) -> Tensor:
            return self.head(self.gru(self.lstm(x)[0])[0])

    batches = _batches([(T, B, FEAT)], (T, B, 1), (), torch.float32)
    ens, alone = _train_both(Both, batches, False, "different", {}, torch.float32)
    assert all(p.dtype == torch.float32 for p in ens.parameters())
    _assert_members(ens, alone, TOL32)


class Packed(nn.Module):
    """Padded sequences packed in the forward, unsorted, some of length 1."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(FEAT, H, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * H, 1)

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, (h, _) = self.rnn(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=x.size(1))
        return self.head(out) + h.sum((0, 2))[:, None, None]


def _packed_batches() -> list[tuple[tuple[Tensor, Tensor], Tensor]]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([1, 4, 1, 3])
    return [
        ((torch.randn(4, 4, FEAT, generator=g, dtype=F64), lengths),
         torch.randn(4, 4, 1, generator=g, dtype=F64))
        for _ in range(2)
    ]  # fmt: skip


def test_packed_sequences_train_as_alone_with_the_loop_backend() -> None:
    ens, alone = _train_both(Packed, _packed_batches(), False, "different", {"backend": "loop"})
    _assert_members(ens, alone, TOL)


def test_packed_sequences_under_vmap_are_refused_pointing_to_the_loop_backend() -> None:
    ens = vmapens.Ensemble(lambda: Packed().double(), N, seed=0, chunk_size=2)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-2))
    (x, y) = _packed_batches()[0]
    with pytest.raises(
        RuntimeError,
        match=r"PackedSequence inputs are not batched.*pad the sequences.*backend=.loop.",
    ):
        step(x, y)
    torch.testing.assert_close(ens.state_dict(), before, rtol=0, atol=0)


class Outputs(nn.Module):
    """Every output of a bidirectional two-layer LSTM (the fused node)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(FEAT, H, 2, bidirectional=True)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        out, (h, c) = self.rnn(x)
        return out, h, c


@pytest.mark.parametrize("kw", BACKENDS[:2], ids=IDS[:2])
@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_the_lstm_node_without_autograd_equals_each_member(mode: Callable, kw: dict) -> None:
    ens = vmapens.Ensemble(lambda: Outputs().double(), N, seed=0, **kw)
    alone = ens.unstack()
    x = torch.randn(T, B, FEAT, dtype=F64)
    with mode():
        got = ens(x)
        want = [m(x) for m in alone]
    assert not any(t.requires_grad for t in got)
    for i in range(N):
        torch.testing.assert_close(tuple(t[i] for t in got), want[i], **TOL)


@pytest.mark.parametrize("kw", BACKENDS, ids=IDS)
def test_randomness_error_refuses_dropout_between_layers_in_training_only(kw: dict) -> None:
    ens = vmapens.Ensemble(
        lambda: nn.LSTM(FEAT, H, 2, dropout=0.5).double(), N, seed=0, randomness="error", **kw
    )
    x = torch.randn(T, B, FEAT, dtype=F64)
    with pytest.raises(RuntimeError, match="randomness='error'"):
        ens(x)
    ens.eval()
    got = ens(x)[0]
    for i, m in enumerate(ens.unstack()):
        torch.testing.assert_close(got[i], m.eval()(x)[0], **TOL)


@pytest.mark.parametrize("kw", BACKENDS, ids=IDS)
def test_different_randomness_gives_each_member_its_own_dropout_between_layers(kw: dict) -> None:
    """Identical members: in training every pair differs (its own masks, docs/semantics.md),
    in eval each equals the module alone."""
    torch.manual_seed(0)
    m = nn.LSTM(FEAT, H, 2, dropout=0.5).double()
    ens = vmapens.Ensemble.from_modules([copy.deepcopy(m) for _ in range(4)], **kw)
    x = torch.randn(T, B, FEAT, dtype=F64)
    out = ens(x)[0]
    assert all(not torch.equal(out[i], out[j]) for i in range(4) for j in range(i))
    ens.eval()
    out = ens(x)[0]
    for i in range(4):
        torch.testing.assert_close(out[i], m.eval()(x)[0], **TOL)


@pytest.mark.parametrize(
    "kind, kw",
    [(nn.LSTM, {}), (nn.LSTM, {"chunk_size": 2}), (nn.LSTM, {"backend": "loop"}),
     (nn.GRU, {"chunk_size": 2})],
    ids=["lstm-vmap", "lstm-chunks", "lstm-loop", "gru-chunks"],
)  # fmt: skip
def test_state_and_shared_input_gradients_equal_the_sum_of_each_member(kind: type,
                                                                      kw: dict) -> None:  # fmt: skip
    """Per-member ``h0``/``c0`` (``in_dims=0``) get each member's gradient; a shared input the
    sum of every member's (docs/semantics.md); with members in turns too."""
    ens = vmapens.Ensemble(lambda: kind(FEAT, H, 2).double(), N, seed=0, **kw)
    alone = ens.unstack()
    lstm = kind is nn.LSTM
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(T, B, FEAT, generator=g, dtype=F64)
    s0 = [torch.randn(N, 2, B, H, generator=g, dtype=F64) for _ in range(2 if lstm else 1)]

    def loss(out: Any) -> Tensor:
        return out[0].pow(2).sum() + (out[1][1] if lstm else out[1]).pow(3).sum()

    x = x0.clone().requires_grad_()
    states = [s.clone().requires_grad_() for s in s0]
    loss(ens(x, tuple(states) if lstm else states[0], in_dims=(None, 0))).backward()
    x_grad = torch.zeros_like(x0)
    for i, m in enumerate(alone):
        xi = x0.clone().requires_grad_()
        si = [s[i].clone().requires_grad_() for s in s0]
        loss(m(xi, tuple(si) if lstm else si[0])).backward()
        x_grad += xi.grad
        for s, own in zip(states, si, strict=True):
            torch.testing.assert_close(s.grad[i], own.grad, **TOL)
    torch.testing.assert_close(x.grad, x_grad, **TOL)


class Orthogonal(nn.Module):
    """An orthogonal RNN: ``weight_hh_l0`` under torch's ``orthogonal`` parametrization."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = orthogonal(nn.RNN(FEAT, H, dtype=F64), "weight_hh_l0")
        self.head = nn.Linear(H, 1, dtype=F64)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.rnn(x)[0])


def test_a_parametrized_rnn_with_the_loop_backend_gives_its_members_back() -> None:
    ens, alone = _train_both(Orthogonal, _batches([(T, B, FEAT)], (T, B, 1), ()), False,
                             "different", {"backend": "loop"}, None)  # fmt: skip
    _assert_members(ens, alone, TOL)  # the training itself is exact
    torch.testing.assert_close(ens[1].state_dict(), alone[1].state_dict(), **TOL)
    copy.deepcopy(ens)


class Spectral(nn.Module):
    """An LSTM whose recurrent weight is under torch's ``spectral_norm`` parametrization (its
    power iteration advances ``_u``/``_v`` each time the weight is computed in training)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = spectral_norm(nn.LSTM(FEAT, H, dtype=F64), "weight_hh_l0")
        self.head = nn.Linear(H, 1, dtype=F64)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.rnn(x)[0])


@pytest.mark.xfail(
    strict=True,
    reason="backend='loop' is not exact for a spectral-normed RNN weight other than the first: "
    "alone, nn.LSTM's forward computes weight_hh_l0 4 times (hasattr+getattr in "
    "_weights_have_changed, then in _init_flat_weights), so 4 power iterations; in the loop "
    "the member's swapped weight_ih_l0 makes _weights_have_changed stop at it, so 2: `_u`/`_v` "
    "advance half as fast, silently (0.003 in `_u`, 3e-4 in the weight after 2 Adam steps). "
    "Under vmap the twin computes it once and the self-check refuses, pointing to the loop",
)
def test_a_spectral_normed_lstm_trains_as_alone_with_the_loop_backend() -> None:
    ens, alone = _train_both(Spectral, _batches([(T, B, FEAT)], (T, B, 1), ()), False,
                             "different", {"backend": "loop"}, None)  # fmt: skip
    _assert_members(ens, alone, TOL)
