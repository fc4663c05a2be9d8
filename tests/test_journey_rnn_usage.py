"""User journey: recurrent members used the way sequence code uses them (bug hunt, eager).

Truncated BPTT with the state returned and passed back per member (``in_dims``) or kept on
the module and reset between epochs; ``nn.LSTM(proj_size=...)``, two bidirectional layers
with dropout between them, unbatched input with a learned initial state, hand-unrolled
``nn.LSTMCell``/``nn.GRUCell`` decoders with teacher forcing and attention; eval mode and
``torch.inference_mode()`` generation, ``vmapens.predict`` on sequences, per-member gradient
clipping; and the eager LSTM node's edges (reverse direction, only ``h_n`` or ``c_n`` read,
``retain_graph`` twice, ``create_graph`` gradient penalty, one step, a batch of one, a frozen
``weight_ih``). The truth: each member a plain module with torch's own layers trained alone
with ``torch.optim.Adam`` (and ``torch.nn.utils.clip_grad_norm_``), float64 unless said.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from truth import autograd_nodes

import vmapens

N, T, B, FEAT, H = 3, 4, 2, 3, 5
F64 = torch.float64
TOL: dict[str, Any] = dict(rtol=1e-9, atol=1e-10)
TOL32: dict[str, Any] = dict(rtol=2e-5, atol=2e-5)
CLIP = 1.0
LR = 1e-2


def _data(count: int, *shape: int, seed: int = 0, dtype: torch.dtype = F64) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=dtype) for _ in range(count)]


def _alone(ens: vmapens.Ensemble) -> list[nn.Module]:
    return [copy.deepcopy(m) for m in ens.unstack()]


def _assert_members(ens: vmapens.Ensemble, alone: list[nn.Module], tol: dict = TOL) -> None:
    for i, m in enumerate(alone):
        got, want = ens[i].state_dict(), m.state_dict()
        assert list(got) == list(want)
        for k in want:
            torch.testing.assert_close(
                got[k], want[k], **tol, msg=lambda e, i=i, k=k: f"{i} {k}: {e}"
            )


def _alone_step(m: nn.Module, opt: torch.optim.Optimizer, loss: Tensor, clip: bool = True) -> None:
    opt.zero_grad()
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP)
    opt.step()


# -- truncated BPTT: the state returned and passed back in, one per member ----------------------


class Returns(nn.Module):
    """``forward(x, hx) -> (y, hx)``: the caller carries the state."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        if kind == "lstm":
            self.rnn, width = nn.LSTM(FEAT, H, 2), H
        elif kind == "lstm-proj-bi":
            self.rnn, width = nn.LSTM(FEAT, H, 2, proj_size=2, bidirectional=True), 4
        else:
            self.rnn, width = nn.GRU(FEAT, H, batch_first=True), H
        self.head = nn.Linear(width, 1)

    def forward(self, x: Tensor, hx: Any = None) -> tuple[Tensor, Any]:
        out, hx = self.rnn(x, hx)
        return self.head(out), hx


def _detach(hx: Any) -> Any:
    return tuple(t.detach() for t in hx) if isinstance(hx, tuple) else hx.detach()


@pytest.mark.parametrize("kind", ["lstm", "lstm-proj-bi", "gru-batch_first"])
def test_tbptt_state_passed_back_per_member_with_clip_and_epoch_reset(kind: str) -> None:
    ens = vmapens.Ensemble(lambda: Returns(kind).double(), N, seed=0)
    alone = _alone(ens)
    shape = (B, T, FEAT) if kind.startswith("gru") else (T, B, FEAT)
    xs = _data(3, *shape, seed=1)
    ys = _data(3, *shape[:-1], 1, seed=2)
    opt = vmapens.StackedAdam(ens, lr=LR)
    loss_fn = vmapens.per_member(F.mse_loss)
    for _epoch in range(2):
        hx = None  # reset at the epoch boundary
        for x, y in zip(xs, ys):
            out, hx = ens(x, hx, in_dims=(None, 0))
            opt.zero_grad()
            loss_fn(out, y).sum().backward()
            vmapens.optim.clip_grad_norm_(ens, CLIP)
            opt.step()
            hx = _detach(hx)
    for m in alone:
        m_opt = torch.optim.Adam(m.parameters(), lr=LR)
        for _epoch in range(2):
            h = None
            for x, y in zip(xs, ys):
                out, h = m(x, h)
                _alone_step(m, m_opt, F.mse_loss(out, y))
                h = _detach(h)
    _assert_members(ens, alone)
    with torch.no_grad():  # the last carried state, each member's own
        got, got_h = ens(xs[0], hx, in_dims=(None, 0))
    for i, m in enumerate(alone):
        mine = tuple(t[i] for t in hx) if isinstance(hx, tuple) else hx[i]
        with torch.no_grad():
            want, want_h = m(xs[0], mine)
        torch.testing.assert_close(got[i], want, **TOL)
        want_h = want_h if isinstance(want_h, tuple) else (want_h,)
        got_hi = tuple(t[i] for t in got_h) if isinstance(got_h, tuple) else (got_h[i],)
        torch.testing.assert_close(got_hi, want_h, **TOL)


# -- truncated BPTT: the state kept on the module, reset on the template ----------------------


class Kept(nn.Module):
    """A two-layer LSTM that keeps ``(h, c)`` for the next batch (``self.state``)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(FEAT, H, 2, batch_first=True)
        self.head = nn.Linear(H, 1)
        self.state: tuple[Tensor, Tensor] | None = None

    def reset_state(self) -> None:
        self.state = None

    def forward(self, x: Tensor) -> Tensor:
        out, (h, c) = self.rnn(x, self.state)
        self.state = (h.detach(), c.detach())
        return self.head(out)


class KeptHC(nn.Module):
    """The same LSTM keeping ``self.h`` and ``self.c`` as two tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(FEAT, H, 2, batch_first=True)
        self.head = nn.Linear(H, 1)
        self.h: Tensor | None = None
        self.c: Tensor | None = None

    def reset_state(self) -> None:
        self.h = self.c = None

    def forward(self, x: Tensor) -> Tensor:
        out, (h, c) = self.rnn(x, None if self.h is None else (self.h, self.c))
        self.h, self.c = h.detach(), c.detach()
        return self.head(out)


class KeptH(nn.Module):
    """A GRU whose ``h`` is kept as one tensor (``self.h = h.detach()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(FEAT, H, 2, batch_first=True)
        self.head = nn.Linear(H, 1)
        self.h: Tensor | None = None

    def reset_state(self) -> None:
        self.h = None

    def forward(self, x: Tensor) -> Tensor:
        out, h = self.rnn(x, self.h)
        self.h = h.detach()
        return self.head(out)


def _kept_of(m: nn.Module) -> list[Tensor]:
    if isinstance(m, Kept):
        assert type(m.state) is tuple and len(m.state) == 2
        return list(m.state)
    return [m.h, m.c] if isinstance(m, KeptHC) else [m.h]


@pytest.mark.parametrize("chunk_size", [None, 1, 2], ids=["one-call", "chunks1", "chunks2"])
@pytest.mark.parametrize(
    "cls",
    [Kept, KeptHC, KeptH],
    ids=["lstm-tuple", "lstm-h-c", "gru-h"],
)
def test_kept_state_with_make_step_clip_and_reset_on_the_template(
    cls: type, chunk_size: int | None
) -> None:
    """With ``chunk_size`` the step runs forward and backward chunk by chunk: each chunk
    reads its members' rows of the kept state (it read the last chunk's, or crashed)."""
    ens = vmapens.Ensemble(lambda: cls().double(), N, seed=0, chunk_size=chunk_size)
    alone = _alone(ens)
    xs, ys = _data(3, B, T, FEAT, seed=1), _data(3, B, T, 1, seed=2)
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedAdam(ens, lr=LR), clip_grad_norm=CLIP)
    for _epoch in range(2):
        ens.template.reset_state()
        for x, y in zip(xs, ys):
            step(x, y)
    for m in alone:
        opt = torch.optim.Adam(m.parameters(), lr=LR)
        for _epoch in range(2):
            m.reset_state()
            for x, y in zip(xs, ys):
                _alone_step(m, opt, F.mse_loss(m(x), y))
    _assert_members(ens, alone)
    for i, m in enumerate(alone):  # ens[i] holds its own kept state, in its form
        for got, want in zip(_kept_of(ens[i]), _kept_of(m), strict=True):
            torch.testing.assert_close(got, want, **TOL)
    ens.eval()
    for m in alone:
        m.eval()
    with torch.no_grad():  # goes on from each member's kept state
        torch.testing.assert_close(ens(xs[1]), torch.stack([m(xs[1]) for m in alone]), **TOL)
    ens.train()


# -- proj_size, two bidirectional layers, dropout between them ---------------------------------


class Deep(nn.Module):
    def __init__(self, proj: int = 2, batch_first: bool = False) -> None:
        super().__init__()
        self.rnn = nn.LSTM(FEAT, H, 2, proj_size=proj, bidirectional=True, dropout=0.3,
                           batch_first=batch_first)  # fmt: skip
        self.head = nn.Linear(2 * (proj or H), 1)

    def forward(self, x: Tensor) -> Tensor:
        out, (h, c) = self.rnn(x)
        extra = c.mean(0).sum(-1, keepdim=True)  # [B, 1], per sample
        return self.head(out) + (extra[:, None] if self.rnn.batch_first else extra[None])


@pytest.mark.parametrize("proj", [0, 2], ids=["fused", "proj"])
def test_bidirectional_dropout_same_randomness_trains_as_alone_with_clip(proj: int) -> None:
    ens = vmapens.Ensemble(lambda: Deep(proj).double(), N, seed=0, randomness="same")
    alone = _alone(ens)
    xs, ys = _data(3, T, B, FEAT, seed=1), _data(3, T, B, 1, seed=2)
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedAdam(ens, lr=LR), clip_grad_norm=CLIP)
    for k, (x, y) in enumerate(zip(xs, ys)):
        torch.manual_seed(50 + k)
        step(x, y)
    for m in alone:
        opt = torch.optim.Adam(m.parameters(), lr=LR)
        for k, (x, y) in enumerate(zip(xs, ys)):
            torch.manual_seed(50 + k)
            _alone_step(m, opt, F.mse_loss(m(x), y))
    _assert_members(ens, alone)


def test_different_randomness_draws_per_member_in_train_and_none_in_eval_then_again() -> None:
    torch.manual_seed(0)
    one = Deep(0).double()
    ens = vmapens.Ensemble.from_modules([copy.deepcopy(one) for _ in range(N)])
    x = _data(1, T, B, FEAT, seed=1)[0]
    with torch.no_grad():
        out = ens(x)
        assert not torch.equal(out[0], out[1])  # own masks in train mode
        ens.eval()
        one.eval()
        out = ens(x)
        for i in range(N):
            torch.testing.assert_close(out[i], one(x), **TOL)
        ens.train()
        out = ens(x)
        assert not torch.equal(out[0], out[2])
    assert ens.training and ens.template.rnn.training


# -- a learned initial state, unbatched input, per-member data ---------------------------------


class Learned(nn.Module):
    """``(h0, c0)`` as parameters, an unbatched ``(T, FEAT)`` sequence, a bidirectional LSTM."""

    def __init__(self, kind: str = "lstm") -> None:
        super().__init__()
        self.kind = kind
        if kind == "lstm":
            self.rnn = nn.LSTM(FEAT, H, bidirectional=True)
            self.c0 = nn.Parameter(torch.randn(2, H) * 0.5)
        else:
            self.rnn = nn.GRU(FEAT, H, bidirectional=True)
        self.h0 = nn.Parameter(torch.randn(2, H) * 0.5)
        self.head = nn.Linear(2 * H, 1)

    def forward(self, x: Tensor) -> Tensor:
        hx = (self.h0, self.c0) if self.kind == "lstm" else self.h0
        out, _ = self.rnn(x, hx)
        return self.head(out)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_learned_initial_state_unbatched_per_member_data(kind: str) -> None:
    ens = vmapens.Ensemble(lambda: Learned(kind).double(), N, seed=0)
    alone = _alone(ens)
    xs, ys = _data(3, N, T, FEAT, seed=1), _data(3, N, T, 1, seed=2)
    step = vmapens.make_step(
        ens, F.mse_loss, vmapens.StackedAdam(ens, lr=LR), in_dims=0, clip_grad_norm=CLIP
    )
    for x, y in zip(xs, ys):
        step(x, y)
    for i, m in enumerate(alone):
        opt = torch.optim.Adam(m.parameters(), lr=LR)
        for x, y in zip(xs, ys):
            _alone_step(m, opt, F.mse_loss(m(x[i]), y[i]))
    _assert_members(ens, alone)
    for i, m in enumerate(alone):  # the gradients of the last step, h0 and c0 included
        for name, p in ens.named_parameters():
            torch.testing.assert_close(p.grad[i], m.get_parameter(name).grad, **TOL)


def test_float32_learned_state_lstm_and_gru_with_clip() -> None:
    class Both(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = Learned("lstm"), Learned("gru")

        def forward(self, x: Tensor) -> Tensor:
            return self.a(x) + self.b(x)

    ens = vmapens.Ensemble(Both, N, seed=0)
    alone = _alone(ens)
    xs = _data(3, T, FEAT, seed=1, dtype=torch.float32)
    ys = _data(3, T, 1, seed=2, dtype=torch.float32)
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedAdam(ens, lr=LR), clip_grad_norm=CLIP)
    for x, y in zip(xs, ys):
        step(x, y)
    for m in alone:
        opt = torch.optim.Adam(m.parameters(), lr=LR)
        for x, y in zip(xs, ys):
            _alone_step(m, opt, F.mse_loss(m(x), y))
    _assert_members(ens, alone, TOL32)


# -- the eager LSTM node's edges ----------------------------------------------------------------


class Pick(nn.Module):
    """An LSTM and a read-out of part of its result (``out``, ``h_n`` or ``c_n`` only)."""

    def __init__(self, pick: str, bidirectional: bool = False, frozen: str = "") -> None:
        super().__init__()
        self.pick = pick
        self.rnn = nn.LSTM(FEAT, H, bidirectional=bidirectional)
        if frozen:
            getattr(self.rnn, frozen).requires_grad_(False)
        d = 2 if bidirectional else 1
        self.head = nn.Linear(d * H, 1)

    def forward(self, x: Tensor) -> Tensor:
        out, (h, c) = self.rnn(x)
        if self.pick == "out":
            return self.head(out)
        s = h if self.pick == "h" else c
        return self.head(torch.cat(s.unbind(0), -1))  # [B, 1] (or [1] unbatched)


EDGES = {  # name: (Pick kwargs, x shape)
    "reverse-h_n-only": (dict(pick="h", bidirectional=True), (T, B, FEAT)),
    "c_n-only": (dict(pick="c"), (T, B, FEAT)),
    "reverse-c_n-only": (dict(pick="c", bidirectional=True), (T, B, FEAT)),
    "one-step": (dict(pick="out", bidirectional=True), (1, B, FEAT)),
    "batch-of-one": (dict(pick="out", bidirectional=True), (T, 1, FEAT)),
    "one-step-batch-of-one-h_n": (dict(pick="h", bidirectional=True), (1, 1, FEAT)),
    "unbatched-c_n": (dict(pick="c", bidirectional=True), (T, FEAT)),
    "frozen-weight_ih": (dict(pick="out", bidirectional=True, frozen="weight_ih_l0"), (T, B, FEAT)),
    "frozen-weight_hh-reverse": (
        dict(pick="out", bidirectional=True, frozen="weight_hh_l0_reverse"), (T, B, FEAT)),
    "frozen-bias_ih": (dict(pick="h", frozen="bias_ih_l0"), (T, B, FEAT)),
}  # fmt: skip


@pytest.mark.parametrize("name", EDGES)
def test_lstm_node_edges_train_as_alone(name: str) -> None:
    kw, shape = EDGES[name]
    ens = vmapens.Ensemble(lambda: Pick(**kw).double(), N, seed=0)
    alone = _alone(ens)
    for m in alone:  # a frozen flag comes back on the members
        for pn, p in m.named_parameters():
            assert p.requires_grad == (pn != f"rnn.{kw.get('frozen')}")
    xs = _data(2, *shape, seed=1)
    ys = [torch.randn(Pick(**kw).double()(x).shape, dtype=F64) for x in xs]
    assert "_RecurrenceBackward" in autograd_nodes(ens(xs[0]))  # the node runs here
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedAdam(ens, lr=LR),
                             clip_grad_norm=CLIP)  # fmt: skip
    for x, y in zip(xs, ys):
        step(x, y)
    for m in alone:
        opt = torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=LR)
        for x, y in zip(xs, ys):
            _alone_step(m, opt, F.mse_loss(m(x), y))
    _assert_members(ens, alone)
    for i, m in enumerate(alone):
        for pn, p in ens.named_parameters():
            g = m.get_parameter(pn).grad
            if g is None:
                assert p.grad is None, pn
            else:
                torch.testing.assert_close(p.grad[i], g, **TOL)


def _grads(params: list[Tensor]) -> list[Tensor]:
    return [p.grad.clone() for p in params]


@pytest.mark.parametrize("pick", ["out", "h", "c"])
def test_retain_graph_backward_twice_accumulates_as_alone(pick: str) -> None:
    ens = vmapens.Ensemble(lambda: Pick(pick, bidirectional=True).double(), N, seed=0)
    alone = _alone(ens)
    x = _data(1, T, B, FEAT, seed=1)[0]
    loss = ens(x).pow(2).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    for i, m in enumerate(alone):
        loss_i = m(x).pow(2).sum()
        loss_i.backward(retain_graph=True)
        loss_i.backward()
        for pn, p in ens.named_parameters():
            torch.testing.assert_close(p.grad[i], m.get_parameter(pn).grad, **TOL)


class Penalised(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(FEAT, H, 2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(2 * H, 1)

    def forward(self, x: Tensor) -> Tensor:
        out, (h, c) = self.rnn(x)
        return self.head(out).sum() + c.pow(2).sum()


PENALISED = {
    "2layers-bidirectional-batch_first": (Penalised, (B, T, FEAT)),
    "reverse-c_n-only": (lambda: Pick("c", bidirectional=True), (T, B, FEAT)),
    "h_n-frozen-weight_ih-unbatched": (
        lambda: Pick("h", bidirectional=True, frozen="weight_ih_l0"), (T, FEAT)),
    "one-step-batch-of-one": (lambda: Pick("out", bidirectional=True), (1, 1, FEAT)),
}  # fmt: skip


@pytest.mark.parametrize("name", PENALISED)
def test_gradient_penalty_with_create_graph_equals_each_member_alone(name: str) -> None:
    """A WGAN-GP style penalty: d out / d x with create_graph, then its norm's gradient."""
    make, shape = PENALISED[name]
    ens = vmapens.Ensemble(lambda: make().double(), N, seed=0)
    alone = _alone(ens)
    x = _data(1, N, *shape, seed=1)[0].requires_grad_()
    out = ens(x, in_dims=0).reshape(N, -1).sum(1)
    assert "_RecurrenceBackward" in autograd_nodes(out)
    (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    penalty = (gx.flatten(1).norm(dim=1) - 1).pow(2)
    (out + penalty).sum().backward()
    for i, m in enumerate(alone):
        xi = x[i].detach().clone().requires_grad_()
        o = m(xi).sum()
        (g,) = torch.autograd.grad(o, xi, create_graph=True)
        torch.testing.assert_close(gx[i], g, **TOL)
        (o + (g.norm() - 1).pow(2)).backward()
        for pn, p in ens.named_parameters():
            g = m.get_parameter(pn).grad
            if g is None:
                assert p.grad is None, pn
            else:
                torch.testing.assert_close(p.grad[i], g, **TOL)


def test_h0_of_another_dtype_is_refused_as_alone() -> None:
    """torch's LSTM refuses a float32 (h0, c0) for float64 weights and input."""
    ens = vmapens.Ensemble(lambda: Pick("out").double(), N, seed=0)
    m = ens[0]
    x = _data(1, T, B, FEAT, seed=1)[0]
    hx = (torch.zeros(1, B, H), torch.zeros(1, B, H))
    with pytest.raises(RuntimeError):
        m.rnn(x, hx)
    runner_rnn = vmapens.Ensemble(lambda: nn.LSTM(FEAT, H).double(), N, seed=0)
    with pytest.raises((RuntimeError, ValueError)):
        runner_rnn(x, hx)


def test_initial_state_per_member_requiring_grad_gets_each_members_gradient() -> None:
    """``(h0, c0)`` made by the caller, one per member, requires_grad: each row's gradient is
    its member's alone (the reverse direction included)."""
    ens = vmapens.Ensemble(lambda: nn.LSTM(FEAT, H, 2, bidirectional=True).double(), N, seed=0)
    alone = _alone(ens)
    x = _data(1, T, B, FEAT, seed=1)[0]
    h0, c0 = (t.requires_grad_() for t in _data(2, N, 4, B, H, seed=3))
    out, (h, c) = ens(x, (h0, c0), in_dims=(None, 0))
    (out.pow(2).sum() + h.sum() + 3 * c.sum()).backward()
    for i, m in enumerate(alone):
        hi, ci = h0[i].detach().clone().requires_grad_(), c0[i].detach().clone().requires_grad_()
        o, (hh, cc) = m(x, (hi, ci))
        (o.pow(2).sum() + hh.sum() + 3 * cc.sum()).backward()
        torch.testing.assert_close(h0.grad[i], hi.grad, **TOL)
        torch.testing.assert_close(c0.grad[i], ci.grad, **TOL)
        for pn, p in ens.named_parameters():
            torch.testing.assert_close(p.grad[i], m.get_parameter(pn).grad, **TOL)


# -- generation: eval mode, inference_mode, outputs fed back in ---------------------------------


class Forecaster(nn.Module):
    """A two-layer LSTM with dropout between layers; ``forward(x, hx)`` -> ``(y, hx)``, y
    the next value of the series (fed back in when generating)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(1, H, 2, dropout=0.3, batch_first=True)
        self.head = nn.Linear(H, 1)

    def forward(self, x: Tensor, hx: Any = None) -> tuple[Tensor, Any]:
        out, hx = self.rnn(x, hx)
        return self.head(out), hx


def _generate_alone(m: nn.Module, warm: Tensor, steps: int) -> Tensor:
    y, hx = m(warm)
    tok, outs = y[:, -1:], []
    for _ in range(steps):
        tok, hx = m(tok, hx)
        outs.append(tok)
    return torch.cat(outs, 1)


@pytest.mark.parametrize("ctx", ["inference_mode", "no_grad"])
def test_autoregressive_generation_in_eval_after_training(ctx: str) -> None:
    ens = vmapens.Ensemble(lambda: Forecaster().double(), N, seed=0, randomness="same")
    alone = _alone(ens)
    xs, ys = _data(2, B, T, 1, seed=1), _data(2, B, T, 1, seed=2)
    step = vmapens.make_step(ens, lambda o, y: F.mse_loss(o[0], y), vmapens.StackedAdam(ens, lr=LR))
    for k, (x, y) in enumerate(zip(xs, ys)):
        torch.manual_seed(7 + k)
        step(x, y)
    for m in alone:
        opt = torch.optim.Adam(m.parameters(), lr=LR)
        for k, (x, y) in enumerate(zip(xs, ys)):
            torch.manual_seed(7 + k)
            _alone_step(m, opt, F.mse_loss(m(x)[0], y), clip=False)
    _assert_members(ens, alone)
    ens.eval()
    manager = torch.inference_mode if ctx == "inference_mode" else torch.no_grad
    with manager():
        y, hx = ens(xs[0])
        tok, outs = y[:, :, -1:], []
        for _ in range(5):
            tok, hx = ens(tok, hx, in_dims=0)
            outs.append(tok)
        got = torch.cat(outs, 2)
        for m in alone:
            m.eval()
        want = torch.stack([_generate_alone(m, xs[0], 5) for m in alone])
    torch.testing.assert_close(got, want, **TOL)
    # then training again: dropout draws again, as alone
    ens.train()
    for m in alone:
        m.train()
    x, y = xs[1], ys[1]
    torch.manual_seed(99)
    step(x, y)
    for m in alone:
        torch.manual_seed(99)
        opt = torch.optim.Adam(m.parameters(), lr=LR)  # a fresh one: compare the grads only
        opt.zero_grad()
        F.mse_loss(m(x)[0], y).backward()
    for i, m in enumerate(alone):
        for pn, p in ens.named_parameters():
            torch.testing.assert_close(p.grad[i], m.get_parameter(pn).grad, **TOL)


def test_predict_on_sequences_in_batches_restores_train_mode() -> None:
    ens = vmapens.Ensemble(lambda: Deep(0, batch_first=True).double(), N, seed=0)
    alone = _alone(ens)
    x = _data(1, 7, T, FEAT, seed=1)[0]
    got = vmapens.predict(ens, x, batch_size=3)
    mean = vmapens.predict(ens, x, reduce="mean", batch_size=4)
    assert ens.training and ens.template.rnn.training
    with torch.no_grad():
        want = torch.stack([m.eval()(x) for m in alone])
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(mean, want.mean(0), **TOL)


def test_a_kept_state_from_inference_mode_is_refused_as_alone_changing_nothing() -> None:
    """Alone, an ``h`` kept under ``torch.inference_mode()`` makes the next training forward
    raise torch's "Inference tensors cannot be saved for backward"; the step raises it too,
    and leaves parameters and the optimizer's state as they were."""
    ens = vmapens.Ensemble(lambda: KeptHC().double(), N, seed=0)
    alone = _alone(ens)
    x, y = _data(1, B, T, FEAT, seed=1)[0], _data(1, B, T, 1, seed=2)[0]
    opt = vmapens.StackedAdam(ens, lr=LR)
    step = vmapens.make_step(ens, F.mse_loss, opt)
    step(x, y)
    with torch.inference_mode():
        ens(x)
    m = alone[0]
    m_opt = torch.optim.Adam(m.parameters(), lr=LR)
    _alone_step(m, m_opt, F.mse_loss(m(x), y), clip=False)
    with torch.inference_mode():
        m(x)
    with pytest.raises(RuntimeError, match="Inference tensors"):
        m(x).sum().backward()
    before = [t.clone() for t in ens.stacked_state().values()]
    moments = [t.clone() for s in opt.state.values() for t in s.values() if isinstance(t, Tensor)]
    with pytest.raises(RuntimeError, match="Inference tensors"):
        step(x, y)
    for a, b in zip(before, ens.stacked_state().values(), strict=True):
        assert torch.equal(a, b)
    after = [t for s in opt.state.values() for t in s.values() if isinstance(t, Tensor)]
    for a, b in zip(moments, after, strict=True):
        assert torch.equal(a, b)


# -- an encoder-decoder with attention, cells unrolled by hand, teacher forcing ----------------

V, S, TT = 7, 5, 4  # vocabulary, source and target lengths


class Seq2Seq(nn.Module):
    """A bidirectional LSTM encoder, an ``nn.LSTMCell`` or ``nn.GRUCell`` decoder with dot
    attention over the encoder's outputs, a learned initial decoder state."""

    def __init__(self, cell: str) -> None:
        super().__init__()
        self.cell_kind = cell
        self.emb = nn.Embedding(V, FEAT)
        self.enc = nn.LSTM(FEAT, H, bidirectional=True, batch_first=True)
        self.bridge = nn.Linear(2 * H, H)
        self.cell = nn.LSTMCell(FEAT + 2 * H, H) if cell == "lstm" else nn.GRUCell(FEAT + 2 * H, H)
        self.key = nn.Linear(2 * H, H, bias=False)
        self.c0 = nn.Parameter(torch.zeros(H))
        self.out = nn.Linear(H + 2 * H, V)

    def encode(self, src: Tensor) -> tuple[Tensor, Any]:
        mem, (h, _c) = self.enc(self.emb(src))
        h = torch.tanh(self.bridge(torch.cat([h[0], h[1]], -1)))
        state = (h, self.c0.expand_as(h)) if self.cell_kind == "lstm" else h
        return mem, state

    def step(self, tok: Tensor, state: Any, mem: Tensor) -> tuple[Tensor, Any]:
        h = state[0] if isinstance(state, tuple) else state
        scores = torch.bmm(self.key(mem), h[:, :, None])[..., 0]
        ctx = torch.bmm(torch.softmax(scores, -1)[:, None], mem)[:, 0]
        state = self.cell(torch.cat([self.emb(tok), ctx], -1), state)
        h = state[0] if isinstance(state, tuple) else state
        return self.out(torch.cat([h, ctx], -1)), state

    def forward(self, src: Tensor, tgt: Any = None, mem: Any = None, mode: str = "train") -> Any:
        if mode == "encode":
            return self.encode(src)
        if mode == "step":
            return self.step(src, tgt, mem)
        mem, state = self.encode(src)  # teacher forcing
        tok, outs = torch.zeros_like(tgt[:, 0]), []
        for t in range(tgt.shape[1]):
            logits, state = self.step(tok, state, mem)
            outs.append(logits)
            tok = tgt[:, t]
        return torch.stack(outs, 1)

    def greedy(self, src: Tensor, steps: int, last: bool = False) -> Tensor:
        mem, state = self.encode(src)
        tok, outs = torch.zeros_like(src[:, 0]), []
        for _ in range(steps):
            logits, state = self.step(tok, state, mem)
            tok = logits.argmax(-1)
            outs.append(tok)
        return logits if last else torch.stack(outs, 1)


def _ce(logits: Tensor, tgt: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1))


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_seq2seq_attention_teacher_forcing_and_greedy_decoding(cell: str) -> None:
    ens = vmapens.Ensemble(lambda: Seq2Seq(cell).double(), N, seed=0)
    alone = _alone(ens)
    g = torch.Generator().manual_seed(4)
    data = [(torch.randint(V, (N, B, S), generator=g), torch.randint(V, (N, B, TT), generator=g))
            for _ in range(3)]  # fmt: skip
    step = vmapens.make_step(ens, _ce, vmapens.StackedAdam(ens, lr=LR), in_dims=0,
                             clip_grad_norm=CLIP)  # fmt: skip
    for src, tgt in data:
        step((src, tgt), tgt)
    for i, m in enumerate(alone):
        opt = torch.optim.Adam(m.parameters(), lr=LR)
        for src, tgt in data:
            _alone_step(m, opt, _ce(m(src[i], tgt[i]), tgt[i]))
    _assert_members(ens, alone)
    src = data[0][0][0]
    ens.eval()
    with torch.inference_mode():  # greedy decoding through the ensemble, state per member
        mem, state = ens(src, mode="encode")
        tok, outs = torch.zeros(B, dtype=torch.long), []
        for t in range(6):
            logits, state = ens(tok, state, mem, mode="step", in_dims=(0 if t else None, 0, 0))
            tok = logits.argmax(-1)
            outs.append(tok)
        got = torch.stack(outs, 2)
        want = torch.stack([m.eval().greedy(src, 6) for m in alone])
        want_logits = torch.stack([m.greedy(src, 6, last=True) for m in alone])
    assert torch.equal(got, want)
    torch.testing.assert_close(logits, want_logits, **TOL)  # the last step's


# -- more of the node: two calls in one graph, BPTT across chunks, half a learned state ---------


class Siamese(nn.Module):
    """One LSTM run on two sequences of different lengths, a learned ``h0`` (``c0`` zeros)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(FEAT, H, batch_first=True)
        self.h0 = nn.Parameter(torch.randn(1, 1, H))
        self.head = nn.Linear(2 * H, 1)

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        h0 = self.h0.expand(1, a.shape[0], H).contiguous()
        c0 = torch.zeros_like(h0)
        _, (ha, _) = self.rnn(a, (h0, c0))
        ob, _ = self.rnn(b, (h0, c0))
        return self.head(torch.cat([ha[0], ob[:, -1]], -1))


def test_one_lstm_twice_in_a_forward_with_a_learned_h0_only() -> None:
    ens = vmapens.Ensemble(lambda: Siamese().double(), N, seed=0)
    alone = _alone(ens)
    g = torch.Generator().manual_seed(3)
    data = [((torch.randn(B, T, FEAT, generator=g, dtype=F64),
              torch.randn(B, T + 2, FEAT, generator=g, dtype=F64)),
             torch.randn(B, 1, generator=g, dtype=F64)) for _ in range(3)]  # fmt: skip
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedAdam(ens, lr=LR), clip_grad_norm=CLIP)
    for x, y in data:
        step(x, y)
    for m in alone:
        opt = torch.optim.Adam(m.parameters(), lr=LR)
        for x, y in data:
            _alone_step(m, opt, F.mse_loss(m(*x), y))
    _assert_members(ens, alone)


def test_two_forwards_then_one_backward_and_bptt_across_two_chunks() -> None:
    """The state carried without detaching into a second chunk, each chunk's loss backward
    with retain_graph (the second backward runs through the first chunk's node again), and two
    ensemble calls alive in one graph."""
    ens = vmapens.Ensemble(lambda: nn.LSTM(FEAT, H, 2).double(), N, seed=0)
    alone = _alone(ens)
    x1, x2 = _data(2, T, B, FEAT, seed=1)
    o1, hx = ens(x1)
    o1.pow(2).sum().backward(retain_graph=True)
    o2, (h, c) = ens(x2, hx, in_dims=(None, 0))
    o3, _ = ens(x2.flip(0))
    (o2.sum() + c.pow(2).sum() + (o3 * o2).sum()).backward()
    for i, m in enumerate(alone):
        p1, mhx = m(x1)
        p1.pow(2).sum().backward(retain_graph=True)
        p2, (mh, mc) = m(x2, mhx)
        p3, _ = m(x2.flip(0))
        (p2.sum() + mc.pow(2).sum() + (p3 * p2).sum()).backward()
        torch.testing.assert_close(o2[i], p2, **TOL)
        for pn, p in ens.named_parameters():
            torch.testing.assert_close(p.grad[i], m.get_parameter(pn).grad, **TOL)


@pytest.mark.parametrize("how", [{"chunk_size": 2}, {"backend": "loop"}], ids=["chunks", "loop"])
def test_tbptt_state_passed_back_in_turns(how: dict) -> None:
    ens = vmapens.Ensemble(lambda: Returns("lstm-proj-bi").double(), N, seed=0, **how)
    alone = _alone(ens)
    xs, ys = _data(3, T, B, FEAT, seed=1), _data(3, T, B, 1, seed=2)
    opt = vmapens.StackedAdam(ens, lr=LR)
    hx = None
    for x, y in zip(xs, ys):
        out, hx = ens(x, hx, in_dims=(None, 0))
        opt.zero_grad()
        vmapens.per_member(F.mse_loss)(out, y).sum().backward()
        opt.step()
        hx = _detach(hx)
    for m in alone:
        m_opt = torch.optim.Adam(m.parameters(), lr=LR)
        h = None
        for x, y in zip(xs, ys):
            out, h = m(x, h)
            _alone_step(m, m_opt, F.mse_loss(out, y), clip=False)
            h = _detach(h)
    _assert_members(ens, alone)


def test_a_kept_state_tuple_reset_on_the_template_reaches_the_members_in_a_forward() -> None:
    """Found by a hunt: a kept ``(h, c)`` tuple stayed on ``ens.runner`` only, so
    ``ens.template.state`` was still None after a call, a reset there (``state = None``) was
    no change, and the members went on from their stale state, silently. Now the tuple is
    stacked on the template as one of each (docs/semantics.md)."""
    ens = vmapens.Ensemble(lambda: Kept().double(), N, seed=0)
    alone = _alone(ens)
    x = _data(1, B, T, FEAT, seed=1)[0]
    with torch.no_grad():
        ens(x)
        for m in alone:
            m(x)
        ens.template.state = None  # a reset between epochs
        for m in alone:
            m.state = None
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in alone]), **TOL)
