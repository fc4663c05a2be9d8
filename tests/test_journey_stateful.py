"""User journey: members that keep state on themselves between calls, trained with
``make_step`` / ``fit`` (eager; ``backend="vmap"``, ``chunk_size=2`` and ``backend="loop"``).

Truncated BPTT (a GRU cell's hidden state kept in ``self.h`` for the next batch, reset between
epochs; an LSTM cell's ``(h, c)`` tuple), a Python warm-up counter, a rotary table built lazily
for growing sequence lengths, and buffers edited in place (a call count, an EMA of the inputs)
under training and ``torch.no_grad()``. The truth: each member as a plain module trained alone
with ``torch.optim.Adam`` on the same batches, float64 (batched kernels sum in other orders).
"""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import vmapens

N, B = 3, 5
F64 = torch.float64
TOL: dict[str, Any] = dict(rtol=1e-10, atol=1e-12)
BACKENDS = [{}, {"chunk_size": 2}, {"backend": "loop"}]
IDS = ["vmap", "chunks", "loop"]


def _batches(count: int, *shape: int, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(B, *shape, generator=g, dtype=F64), torch.randn(B, 1, generator=g, dtype=F64))
        for _ in range(count)
    ]


def _seq_batches(count: int) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(B, 3, 2, generator=g, dtype=F64), torch.randn(B, 3, 1, generator=g, dtype=F64))
        for _ in range(count)
    ]


def _alone_step(m: nn.Module, opt: torch.optim.Optimizer, x: Tensor, y: Tensor) -> None:
    opt.zero_grad()
    nn.functional.mse_loss(m(x), y).backward()
    opt.step()


def _assert_members(ens: vmapens.Ensemble, alone: list[nn.Module]) -> None:
    for i, m in enumerate(alone):
        got, want = ens[i].state_dict(), m.state_dict()
        assert list(got) == list(want)
        for k in want:
            torch.testing.assert_close(got[k], want[k], **TOL, msg=f"member {i} {k}")


# -- truncated BPTT: the hidden state kept on the module ---------------------------------------


class TBPTT(nn.Module):
    """A GRU cell whose forward starts from the hidden state the last batch left."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.GRUCell(2, 4, dtype=F64)
        self.out = nn.Linear(4, 1, dtype=F64)
        self.h: Tensor | None = None

    def reset_state(self) -> None:
        self.h = None

    def forward(self, x: Tensor) -> Tensor:  # [B, T, 2]
        h = self.h if self.h is not None else x.new_zeros(x.shape[0], 4)
        ys = []
        for t in range(x.shape[1]):
            h = self.cell(x[:, t], h)
            ys.append(self.out(h))
        self.h = h.detach()
        return torch.stack(ys, 1)


@pytest.mark.parametrize("how", BACKENDS, ids=IDS)
def test_truncated_bptt_with_a_kept_hidden_state_trains_as_alone(how: dict) -> None:
    """docs/semantics.md: each call hands every member (every chunk, every turn of the loop)
    its own rows of what the forwards kept, so reading it back goes on as alone (each member
    its own hidden state, 4 steps). In turns this was refused before (each member would have
    read the one before's)."""
    ens = vmapens.Ensemble(TBPTT, n=N, seed=0, **how)
    alone = ens.unstack()
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-2))
    batches = _seq_batches(4)
    for x, y in batches:
        step(x, y)
    for m in alone:
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        for x, y in batches:
            _alone_step(m, opt, x, y)
    _assert_members(ens, alone)
    x = batches[0][0]
    with torch.no_grad():  # the next forward starts from each member's own last hidden state
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in alone]), **TOL)


def test_a_reset_on_the_template_after_an_evaluation_reaches_the_members() -> None:
    """Epoch end: evaluate with ens(x), reset the hidden state, go on. docs/semantics.md:
    attributes set on ens.template reach every member at the next call (and Ensemble.apply's
    refusal of `h = None` says to set it there). The members went on from the stale state:
    0.12 off on the next forward."""
    ens = vmapens.Ensemble(TBPTT, n=N, seed=0)
    alone = ens.unstack()
    x, x2 = _seq_batches(2)[0][0], _seq_batches(2)[1][0]
    with torch.no_grad():
        ens(x)
        for m in alone:
            m(x)
        ens.template.reset_state()
        for m in alone:
            m.reset_state()
        torch.testing.assert_close(ens(x2), torch.stack([m(x2) for m in alone]), **TOL)


def test_a_reset_on_the_template_between_training_steps_reaches_the_members() -> None:
    """The same reset between epochs of `make_step`, with no `ens(x)` between: the step
    leaves the kept hidden state on the template too (it left `__init__`'s None there, so the
    reset to None changed nothing and the members went on from the stale state, silently)."""
    ens = vmapens.Ensemble(TBPTT, n=N, seed=0)
    alone = ens.unstack()
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-2))
    batches = _seq_batches(4)
    for k, (x, y) in enumerate(batches):
        if k == 2:  # a new epoch
            ens.template.reset_state()
        step(x, y)
    for m in alone:
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        for k, (x, y) in enumerate(batches):
            if k == 2:
                m.reset_state()
            _alone_step(m, opt, x, y)
    _assert_members(ens, alone)
    for i, m in enumerate(alone):  # the template holds each member's last hidden state
        torch.testing.assert_close(ens.template.h[i], m.h, **TOL)


class TBPTTBuffer(nn.Module):
    """The same with the hidden state in a buffer (docs: keep state you reset in a buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.GRUCell(2, 4, dtype=F64)
        self.out = nn.Linear(4, 1, dtype=F64)
        self.register_buffer("h", torch.zeros(B, 4, dtype=F64))

    def forward(self, x: Tensor) -> Tensor:
        h, ys = self.h.clone(), []  # the backward needs the old value: read a clone
        for t in range(x.shape[1]):
            h = self.cell(x[:, t], h)
            ys.append(self.out(h))
        self.h = h.detach()
        return torch.stack(ys, 1)


def _reset(m: nn.Module) -> None:
    if isinstance(m, TBPTTBuffer):
        m.h.zero_()


@pytest.mark.parametrize("how", BACKENDS, ids=IDS)
def test_a_hidden_state_in_a_buffer_reset_with_apply_trains_as_alone(how: dict) -> None:
    ens = vmapens.Ensemble(TBPTTBuffer, n=N, seed=0, **how)
    alone = ens.unstack()
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-2))
    batches = _seq_batches(4)
    for k, (x, y) in enumerate(batches):
        if k == 2:  # a new epoch
            ens.apply(_reset)
        step(x, y)
    for m in alone:
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        for k, (x, y) in enumerate(batches):
            if k == 2:
                m.apply(_reset)
            _alone_step(m, opt, x, y)
    _assert_members(ens, alone)  # the buffer `h` included, per member
    assert not torch.equal(ens[0].h, ens[1].h)


class LSTMState(nn.Module):
    """An LSTM cell that keeps its (h, c) tuple for the next batch."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(2, 3, dtype=F64)
        self.out = nn.Linear(3, 1, dtype=F64)
        self.state: tuple[Tensor, Tensor] | None = None

    def forward(self, x: Tensor) -> Tensor:
        s = self.state if self.state is not None else (x.new_zeros(x.shape[0], 3),) * 2
        ys = []
        for t in range(x.shape[1]):
            s = self.cell(x[:, t], s)
            ys.append(self.out(s[0]))
        self.state = (s[0].detach(), s[1].detach())
        return torch.stack(ys, 1)


def test_a_kept_lstm_state_tuple_leaves_the_ensemble_copyable() -> None:
    """Trains as alone under vmap; then a copy holds a copy of the state, as
    `copy.deepcopy(model)` does (since session 46: it started with None), a file none, and the
    original goes on from its own, as docs/semantics.md says for a kept tensor."""
    ens = vmapens.Ensemble(LSTMState, n=N, seed=0)
    alone = ens.unstack()
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-2))
    batches = _seq_batches(3)
    for x, y in batches:
        step(x, y)
    for m in alone:
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        for x, y in batches:
            _alone_step(m, opt, x, y)
    _assert_members(ens, alone)
    x = batches[0][0]
    sub = ens.select([2, 0])
    copied = copy.deepcopy(ens)
    buffer = io.BytesIO()
    torch.save(ens, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    copies = [copy.deepcopy(m) for m in alone]
    fresh = [copy.deepcopy(m) for m in alone]
    for m in fresh:
        m.state = None
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in alone]), **TOL)
        torch.testing.assert_close(sub(x), torch.stack([copies[2](x), copies[0](x)]), **TOL)
        torch.testing.assert_close(copied(x)[1], copies[1](x), **TOL)
        torch.testing.assert_close(loaded(x)[1], fresh[1](x), **TOL)


# -- a Python warm-up counter ------------------------------------------------------------------


class Warm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 1, dtype=F64)
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        return self.fc(x) * min(1.0, self.calls / 3)


@pytest.mark.parametrize("api", ["step", "fit"])
@pytest.mark.parametrize("how", BACKENDS[:2], ids=IDS[:2])
def test_a_warm_up_counter_advances_once_per_step(how: dict, api: str) -> None:
    """The first step's probe runs member 0 twice more and chunks run in turns: the counter
    still goes up once per step, as alone, and ens[i] holds it."""
    ens = vmapens.Ensemble(Warm, n=N, seed=0, **how)
    alone = ens.unstack()
    batches = _batches(5, 2)
    if api == "step":
        step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-1))
        for x, y in batches:
            step(x, y)
    else:
        data = (torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
        vmapens.fit(ens, data, nn.MSELoss(), batch_size=B, epochs=1, lr=1e-1, shuffle=False,
                    progress=False, seed=0)  # fmt: skip
    for m in alone:
        opt = torch.optim.Adam(m.parameters(), lr=1e-1)
        for x, y in batches:
            _alone_step(m, opt, x, y)
    _assert_members(ens, alone)
    assert [ens[i].calls for i in range(N)] == [m.calls for m in alone] == [5] * N


def test_a_warm_up_counter_with_the_loop_backend_is_refused() -> None:
    """docs/semantics.md: with backend='loop' a plain value read back is refused (it may be
    the member's own); nothing changed."""
    ens = vmapens.Ensemble(Warm, n=N, seed=0, backend="loop")
    before = ens.stacked_params()["fc.weight"].clone()
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-1))
    with pytest.raises(RuntimeError, match=r"`calls`.*backend='loop'"):
        step(*_batches(1, 2)[0])
    assert torch.equal(ens.stacked_params()["fc.weight"], before)


# -- a rotary table built lazily -----------------------------------------------------------------


def _tables(t: int) -> tuple[Tensor, Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, 2, dtype=F64) / 2))
    f = torch.outer(torch.arange(t, dtype=F64), inv)
    return f.cos(), f.sin()


class Rotary(nn.Module):
    def __init__(self, where: str = "attribute") -> None:
        super().__init__()
        self.q = nn.Linear(4, 4, dtype=F64)
        self.out = nn.Linear(4, 1, dtype=F64)
        if where == "attribute":
            self.cos: Tensor | None = None
            self.sin: Tensor | None = None
        elif where == "none-buffer":  # as some rotary layers do
            self.register_buffer("cos", None, persistent=False)
            self.register_buffer("sin", None, persistent=False)
        else:
            cos, sin = _tables(2)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: Tensor) -> Tensor:  # [B, T, 4]
        t = x.shape[1]
        if self.cos is None or self.cos.shape[0] < t:
            self.cos, self.sin = _tables(t)
        h = self.q(x)
        a, b, c, s = h[..., :2], h[..., 2:], self.cos[:t], self.sin[:t]
        return self.out(torch.cat([a * c - b * s, a * s + b * c], -1)).mean(1)


def _growing() -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [
        (torch.randn(B, t, 4, generator=g, dtype=F64), torch.randn(B, 1, generator=g, dtype=F64))
        for t in (2, 3, 5, 4)
    ]


@pytest.mark.parametrize("how", BACKENDS, ids=IDS)
def test_a_lazy_rotary_table_trains_as_alone_and_round_trips(how: dict, tmp_path) -> None:
    ens = vmapens.Ensemble(Rotary, n=N, seed=0, **how)
    alone = ens.unstack()
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-1))
    batches = _growing()
    for x, y in batches:
        step(x, y)
    for m in alone:
        opt = torch.optim.Adam(m.parameters(), lr=1e-1)
        for x, y in batches:
            _alone_step(m, opt, x, y)
    _assert_members(ens, alone)
    assert list(ens.state_dict()) == ["q.weight", "q.bias", "out.weight", "out.bias"]
    x = torch.randn(2, 6, 4, dtype=F64)  # longer than any batch: the table grows again
    vmapens.save(ens, tmp_path / "ens.pt")
    loaded = vmapens.load(tmp_path / "ens.pt", Rotary)
    with torch.no_grad():
        want = torch.stack([m(x) for m in alone])
        torch.testing.assert_close(ens(x), want, **TOL)
        torch.testing.assert_close(loaded(x), want, **TOL)
        for i, m in enumerate(ens.unstack()):
            torch.testing.assert_close(m(x), want[i], **TOL)


@pytest.mark.parametrize("how", BACKENDS, ids=IDS)
def test_a_rotary_buffer_that_grows_is_refused(how: dict) -> None:
    """docs/semantics.md: a reassigned buffer of another shape is refused, naming it."""
    ens = vmapens.Ensemble(lambda: Rotary("buffer"), n=N, seed=0, **how)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-1))
    with pytest.raises(RuntimeError, match=r"reassigns buffer `cos`.*shape \(2, 2\)"):
        step(*_growing()[1])


@pytest.mark.parametrize("how", BACKENDS, ids=IDS)
def test_a_rotary_table_in_a_none_buffer_is_refused_clearly(how: dict) -> None:
    ens = vmapens.Ensemble(lambda: Rotary("none-buffer"), n=N, seed=0, **how)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-1))
    with pytest.raises(RuntimeError, match=r"`cos`.*registered as None"):
        step(*_growing()[0])


# -- buffers edited in place ------------------------------------------------------------------


class Stats(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 1, dtype=F64)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("mean", torch.zeros(2, dtype=F64))

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            self.count.add_(1)
            self.mean.lerp_(x.mean(0), 0.1)
        return self.fc(x - self.mean) * (1 + 1 / self.count.clamp(min=1))


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")  # lerp_'s rule
@pytest.mark.parametrize("how", BACKENDS, ids=IDS)
def test_buffers_edited_in_place_follow_each_member(how: dict) -> None:
    ens = vmapens.Ensemble(Stats, n=N, seed=0, **how)
    alone = ens.unstack()
    opt = vmapens.StackedAdam(ens, lr=1e-1)
    shared = _batches(3, 2, seed=3)
    g = torch.Generator().manual_seed(4)
    own = [(torch.randn(N, B, 2, generator=g, dtype=F64) * 2 + 1,
            torch.randn(N, B, 1, generator=g, dtype=F64)) for _ in range(2)]  # fmt: skip
    step = vmapens.make_step(ens, nn.MSELoss(), opt)
    for x, y in shared:
        step(x, y)
    step = vmapens.make_step(ens, nn.MSELoss(), opt, in_dims=0)
    for x, y in own:
        step(x, y)
    for i, m in enumerate(alone):
        torch_opt = torch.optim.Adam(m.parameters(), lr=1e-1)
        for x, y in [*shared, *((x[i], y[i]) for x, y in own)]:
            _alone_step(m, torch_opt, x, y)
    _assert_members(ens, alone)
    assert ens.stacked_buffers()["count"].tolist() == [5] * N
    xe = own[0][0]
    with torch.no_grad():
        ens.eval()  # evaluation: the buffers stay
        want = torch.stack([m.eval()(xe[i]) for i, m in enumerate(alone)])
        torch.testing.assert_close(ens(xe, in_dims=0), want, **TOL)
        ens.train()  # a train-mode forward under no_grad moves them, as alone
        want = torch.stack([m.train()(xe[i]) for i, m in enumerate(alone)])
        torch.testing.assert_close(ens(xe, in_dims=0), want, **TOL)
    _assert_members(ens, alone)
    for got, want_m in zip(ens.unstack(), alone, strict=True):
        torch.testing.assert_close(got.mean, want_m.mean, **TOL)
        assert int(got.count) == int(want_m.count) == 6
