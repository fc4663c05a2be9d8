"""Recurrent members in the ways real forwards use them train as each member alone.

The truth is plain torch: each member a plain module with torch's own ``nn.LSTM``/``GRU``/
``RNN`` or cells, trained alone by ``torch.optim.SGD`` (momentum), float64. The ensemble runs
``vmapens._recurrent``'s twins (and ``_lstm_fused``'s one-node LSTM recurrence); each step
compares every member's outputs (sequence, ``h_n``, ``c_n``), the gradients of initial states
passed in, and at the end every parameter.

Combinations the other recurrent tests leave out: initial states per member (``in_dims``) and
shared, both requiring grad; ``proj_size`` with two bidirectional layers; ``batch_first`` with
unbatched input; one time step and one row; losses that use only ``h_n``, only ``c_n`` or only
``out[-1]``; dropout between layers in eval mode; the same layer called twice with its state
carried; a layer in ``nn.Sequential`` followed by a module that takes its tuple; cells in a
Python loop; learned initial states expanded over layers; ``flatten_parameters()`` in the
forward; ``ens.double()`` after the optimizer is built; two backward passes of one graph.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optree
import pytest
import torch
from torch import Tensor, nn

import vmapens

TOL = dict(rtol=1e-9, atol=1e-10)  # float64: the same maths, summed in another order
N, F, H, T, B = 3, 3, 4, 5, 2
LR, MOMENTUM, STEPS = 0.1, 0.9, 2


def _full_loss(out: Any) -> Tensor:
    """Every output leaf reaches the loss, each with its own weight."""
    return sum(((t * t).sum() + t.sum()) * (k + 1) for k, t in enumerate(optree.tree_leaves(out)))


class Twice(nn.Module):
    """One LSTM run twice, the second run starting from the first one's final state."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(F, H, num_layers=2)
        self.head = nn.Linear(H, 1)

    def forward(self, x: Tensor) -> Tensor:
        first, state = self.rnn(x)
        second, _ = self.rnn(x.flip(0), state)
        return self.head(second[-1] + first[0])


class TakeAll(nn.Module):
    """Takes an ``nn.LSTM``'s whole output tuple, as in ``nn.Sequential(lstm, TakeAll())``."""

    def forward(self, result: tuple[Tensor, tuple[Tensor, Tensor]]) -> Tensor:
        out, (h, c) = result
        return out[:, -1] + h[-1] + c[-1]


class CellLoop(nn.Module):
    """A cell stepped over time in Python, from no state (batched) or zeros (unbatched)."""

    def __init__(self, kind: type) -> None:
        super().__init__()
        self.cell = kind(F, H)

    def forward(self, x: Tensor) -> Tensor:
        state: Any = None
        if x.dim() == 2:
            zeros = torch.zeros(H, dtype=x.dtype)
            state = (zeros, zeros) if isinstance(self.cell, nn.LSTMCell) else zeros
        outs = []
        for x_t in x.unbind(0):
            state = self.cell(x_t, state)
            outs.append(state[0] if isinstance(state, tuple) else state)
        return torch.stack(outs)


class Learned(nn.Module):
    """Learned initial states, one row expanded over every layer and direction."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(F, H, num_layers=2, bidirectional=True)
        self.h0 = nn.Parameter(torch.randn(1, 1, H))
        self.c0 = nn.Parameter(torch.randn(1, 1, H))

    def forward(self, x: Tensor) -> Tensor:
        h0, c0 = (s.expand(4, x.size(1), H) for s in (self.h0, self.c0))
        out, (h, _) = self.rnn(x, (h0, c0))
        return out[..., :H].sum(0) + h[-1]


class Flattened(nn.Module):
    """Calls ``flatten_parameters()`` in its forward, as cuDNN-minded code does."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(F, H, bidirectional=True, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        self.rnn.flatten_parameters()
        return self.rnn(x)[0]


def _eval(module: nn.Module) -> nn.Module:
    return module.eval()


@dataclass(frozen=True)
class Case:
    id: str
    make: Callable[[], nn.Module]
    shape: tuple[int, ...]  # the input's
    state: tuple[tuple[int, ...], ...] = ()  # the initial states' shapes; () for none
    per_member: bool = True  # states per member (in_dims=0) or one shared by all
    loss: Callable[[Any], Tensor] = _full_loss

    def __str__(self) -> str:
        return self.id


CASES = [
    Case(
        "lstm-proj-bidirectional-2layers-states-per-member",
        lambda: nn.LSTM(F, H, num_layers=2, bidirectional=True, proj_size=2),
        (T, B, F),
        ((4, B, 2), (4, B, H)),
    ),
    Case(
        "lstm-states-shared",
        lambda: nn.LSTM(F, H, num_layers=2),
        (T, B, F),
        ((2, B, H), (2, B, H)),
        per_member=False,
    ),
    Case(
        "gru-bidirectional-no-bias-state-shared",
        lambda: nn.GRU(F, H, bias=False, bidirectional=True),
        (T, B, F),
        ((2, B, H),),
        per_member=False,
    ),
    Case(
        "rnn-relu-no-bias-state-per-member",
        lambda: nn.RNN(F, H, num_layers=2, nonlinearity="relu", bias=False),
        (T, B, F),
        ((2, B, H),),
    ),
    Case(
        "lstm-batch_first-unbatched-states",
        lambda: nn.LSTM(F, H, batch_first=True, proj_size=3),
        (T, F),
        ((1, 3), (1, H)),
    ),
    Case("gru-batch_first-unbatched", lambda: nn.GRU(F, H, batch_first=True, num_layers=2), (T, F)),
    Case("lstm-one-step-one-row", lambda: nn.LSTM(F, H, bidirectional=True), (1, 1, F)),
    Case(
        "lstm-one-step-states",
        lambda: nn.LSTM(F, H, batch_first=True),
        (B, 1, F),
        ((1, B, H), (1, B, H)),
    ),
    Case(
        "lstm-h_n-only",
        lambda: nn.LSTM(F, H, num_layers=2),
        (T, B, F),
        loss=lambda o: o[1][0].square().sum(),
    ),
    Case(
        "lstm-c_n-only",
        lambda: nn.LSTM(F, H, bidirectional=True),
        (T, B, F),
        ((2, B, H), (2, B, H)),
        loss=lambda o: o[1][1].square().sum(),
    ),
    Case(
        "lstm-out-last-step-only",
        lambda: nn.LSTM(F, H, bidirectional=True),
        (T, B, F),
        loss=lambda o: o[0][-1].pow(3).sum(),
    ),
    Case(
        "gru-h_n-only",
        lambda: nn.GRU(F, H, num_layers=2),
        (T, B, F),
        loss=lambda o: o[1].square().sum(),
    ),
    Case("lstm-dropout-eval", lambda: _eval(nn.LSTM(F, H, num_layers=3, dropout=0.5)), (T, B, F)),
    Case("gru-dropout-eval", lambda: _eval(nn.GRU(F, H, num_layers=2, dropout=0.5)), (T, B, F)),
    Case("lstm-twice-state-carried", Twice, (T, B, F)),
    Case(
        "lstm-in-sequential",
        lambda: nn.Sequential(
            nn.LSTM(F, H, num_layers=2, batch_first=True), TakeAll(), nn.Linear(H, 2)
        ),
        (B, T, F),
    ),
    Case("lstmcell-loop", lambda: CellLoop(nn.LSTMCell), (T, B, F)),
    Case("lstmcell-loop-unbatched", lambda: CellLoop(nn.LSTMCell), (T, F)),
    Case("grucell-loop", lambda: CellLoop(nn.GRUCell), (T, B, F)),
    Case("rnncell-loop", lambda: CellLoop(nn.RNNCell), (T, B, F)),
    Case("lstm-learned-states", Learned, (T, B, F)),
    Case("gru-flatten_parameters", Flattened, (B, T, F)),
]


def _members(make: Callable[[], nn.Module]) -> list[nn.Module]:
    members = []
    for k in range(N):
        torch.manual_seed(10 + k)
        members.append(make().double())
    return members


def _states(case: Case, g: torch.Generator) -> list[Any]:
    """Each member's initial states (the same object for all when shared), or Nones."""
    if not case.state:
        return [None] * N
    draws = [
        [torch.randn(s, generator=g, dtype=torch.float64) for s in case.state]
        for _ in range(N if case.per_member else 1)
    ]
    one = [d[0] if len(d) == 1 else tuple(d) for d in draws]
    return one if case.per_member else one * N


@pytest.mark.parametrize("case", CASES, ids=str)
def test_members_train_as_alone(case: Case):
    alone = _members(case.make)
    ens = vmapens.Ensemble.from_modules(copy.deepcopy(alone))
    opt = vmapens.StackedSGD(ens, lr=LR, momentum=MOMENTUM)
    opts = [torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM) for m in alone]
    g = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        x = torch.randn(case.shape, generator=g, dtype=torch.float64)
        states = _states(case, g)
        # The truth: each member alone, from its own leaf copy of its states.
        leaves = [optree.tree_map(lambda t: t.clone().requires_grad_(), s) for s in states]
        outs = []
        for m, o, s in zip(alone, opts, leaves, strict=True):
            out = m(x) if s is None else m(x, s)
            o.zero_grad()
            case.loss(out).backward()
            o.step()
            outs.append(out)
        if states[0] is None:
            together, given = ens(x), None
        elif case.per_member:
            given = optree.tree_map(lambda *t: torch.stack(t).requires_grad_(), *states)
            together = ens(x, given, in_dims=(None, 0))
        else:
            given = optree.tree_map(lambda t: t.clone().requires_grad_(), states[0])
            together = ens(x, given)
        opt.zero_grad()
        sum(case.loss(optree.tree_map(lambda t, i=i: t[i], together)) for i in range(N)).backward()
        opt.step()
        for i in range(N):
            torch.testing.assert_close(
                optree.tree_map(lambda t, i=i: t[i], together), outs[i], **TOL
            )
        if given is not None:
            if case.per_member:
                for i in range(N):
                    got = optree.tree_map(lambda t, i=i: t.grad[i], given)
                    torch.testing.assert_close(
                        got, optree.tree_map(lambda t: t.grad, leaves[i]), **TOL
                    )
            else:  # a shared state's gradient sums every member's
                want = optree.tree_map(lambda *t: sum(s.grad for s in t), *leaves)
                torch.testing.assert_close(optree.tree_map(lambda t: t.grad, given), want, **TOL)
    for i, m in enumerate(alone):
        torch.testing.assert_close(ens[i].state_dict(), m.state_dict(), **TOL)


def test_double_after_the_optimizer_is_built_trains_as_alone():
    """float32 members, the optimizers built, then ``.double()`` on both sides (torch allows it)."""
    alone = []
    for k in range(N):
        torch.manual_seed(10 + k)
        alone.append(nn.LSTM(F, H, num_layers=2, bidirectional=True))
    ens = vmapens.Ensemble.from_modules(copy.deepcopy(alone))
    opt = vmapens.StackedAdam(ens, lr=1e-2)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in alone]
    ens.double()
    for m in alone:
        m.double()
    g = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        x = torch.randn(T, B, F, generator=g, dtype=torch.float64)
        for m, o in zip(alone, opts, strict=True):
            o.zero_grad()
            _full_loss(m(x)).backward()
            o.step()
        opt.zero_grad()
        together = ens(x)
        sum(_full_loss(optree.tree_map(lambda t, i=i: t[i], together)) for i in range(N)).backward()
        opt.step()
    for i, m in enumerate(alone):
        assert ens[i].weight_ih_l0.dtype == torch.float64
        torch.testing.assert_close(ens[i].state_dict(), m.state_dict(), **TOL)


@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU], ids=lambda k: k.__name__)
def test_a_graph_kept_for_a_second_backward_gives_the_same_gradients_again(kind: type):
    """``backward(retain_graph=True)`` twice accumulates twice each member's own gradient."""
    alone = _members(lambda: kind(F, H, num_layers=2))
    ens = vmapens.Ensemble.from_modules(copy.deepcopy(alone))
    x = torch.randn(T, B, F, dtype=torch.float64)
    loss = sum(_full_loss(optree.tree_map(lambda t, i=i: t[i], ens(x))) for i in range(N))
    loss.backward(retain_graph=True)
    loss.backward()
    for i, m in enumerate(alone):
        _full_loss(m(x)).backward(retain_graph=True)
        _full_loss(m(x)).backward()
        grads = {k: p.grad[i] for k, p in ens.named_parameters()}
        torch.testing.assert_close(grads, {k: p.grad for k, p in m.named_parameters()}, **TOL)


@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU, nn.RNN], ids=lambda k: k.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64], ids=str)
def test_an_input_of_another_dtype_is_refused_naming_input_as_torch_does(kind: type, dtype):
    """Was: a RuntimeError from inside the twin's matmul ("expected scalar type Double but
    found Float"), where torch's layer raises a ValueError that names the input's dtype."""
    alone = _members(lambda: kind(F, H))
    ens = vmapens.Ensemble.from_modules(copy.deepcopy(alone))
    x = torch.ones(T, B, F).to(dtype)
    with pytest.raises(ValueError, match="input dtype"):  # the truth
        alone[0](x)
    with pytest.raises(ValueError, match=r"`input` dtype \(torch\.(float32|int64)\) must match"):
        ens(x)


def test_an_input_of_another_dtype_under_autocast_still_runs_as_alone():
    """Under autocast torch lets the layer cast (no dtype check), and so does the twin."""
    alone = [nn.LSTM(F, H) for _ in range(N)]
    ens = vmapens.Ensemble.from_modules(copy.deepcopy(alone))
    x = torch.randn(T, B, F, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.warns(UserWarning, match="autocast"):
        together = ens(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = [m(x) for m in alone]
    for i, out in enumerate(outs):  # ~1% relative under bf16 autocast (docs/semantics.md)
        torch.testing.assert_close(together[0][i].float(), out[0].float(), rtol=0.05, atol=0.05)
