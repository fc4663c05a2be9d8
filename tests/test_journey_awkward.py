"""User journey: a researcher's own model with awkward forwards, in an ensemble of 4.

A mixture-of-experts net fed a dict of tensors (an optional entry None), a depth argument that
picks how many blocks of a ModuleList run, a keyword-only ``mask``, a dict output with the
load-balancing aux loss (also kept on ``self.aux_loss``, as users do), a Python counter and a
buffer counter bumped in forward, branches on ``self.training`` and on a curriculum flag set
between steps, ``torch.where`` routing, in-place ops on activations (``relu_``, ``+=``), a
straight-through ``torch.autograd.Function``; NamedTuple / dataclass inputs and outputs;
``.item()`` control flow and an old-style autograd.Function (refused under vmap, exact with
``backend="loop"``). The truth: each member as a plain module trained alone with torch.optim
on the same batches, float64 (batched kernels sum in other orders: 1e-10).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import vmapens
from vmapens.callbacks import EarlyStopping

N, D, E = 4, 6, 3
TOL: dict[str, Any] = dict(rtol=1e-10, atol=1e-10)
F64 = torch.float64


class Round(torch.autograd.Function):
    """Straight-through rounding to quarters, written torch.func's way (vmap rule generated)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor) -> Tensor:
        return torch.round(x * 4) / 4

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        return g


class OldRound(torch.autograd.Function):
    """The same estimator written the old way (forward(ctx, ...)), as most code has it."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        return g


class MoE(nn.Module):
    """Top-1 routing with torch.where; the load-balancing loss kept on ``self.aux_loss``."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(D, E)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(E))
        self.aux_loss: Tensor | None = None

    def forward(self, h: Tensor) -> Tensor:
        probs = self.gate(h).softmax(-1)
        top = probs.argmax(-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            out = out + torch.where((top == e)[:, None], expert(h) * probs[:, e : e + 1], 0.0)
        frac = F.one_hot(top, E).to(h.dtype).mean(0)
        self.aux_loss = E * (frac * probs.mean(0)).sum()
        return out


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, h: Tensor) -> Tensor:
        r = h
        h = self.fc1(h)
        h.relu_()
        h = self.fc2(h)
        h += r
        return h


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.side = nn.Linear(4, D), nn.Linear(2, D)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.moe = MoE()
        self.head = nn.Linear(D, 2)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.calls = 0
        self.quantize = False  # the curriculum switches it on between steps

    def forward(self, batch: dict, depth: int = 3, *, mask: Tensor | None = None) -> dict:
        self.calls += 1
        x = batch["x"]
        self.seen += x.shape[0]
        h = self.inp(x)
        if batch.get("side") is not None:
            h = h + self.side(batch["side"])
        if mask is not None:
            h = torch.where(mask[:, None], h, torch.zeros_like(h))
        for block in self.blocks[:depth]:
            h = block(h)
        if self.training:
            h = h * 0.9
        if self.quantize:
            h = Round.apply(h)
        h = self.moe(h)
        return {"pred": self.head(h), "aux": self.moe.aux_loss}


def dict_loss(out: dict, y: Tensor) -> Tensor:
    return F.mse_loss(out["pred"], y) + 0.1 * out["aux"]


def batches(count: int, rows: int = 8, seed: int = 1) -> list[tuple[dict, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(count):
        x, side = (
            torch.randn(rows, 4, generator=g, dtype=F64),
            torch.randn(rows, 2, generator=g, dtype=F64),
        )
        y = torch.randn(rows, 2, generator=g, dtype=F64)
        out.append(({"x": x, "side": None if k % 2 else side}, y))
    return out


def net64() -> vmapens.Ensemble:
    return vmapens.Ensemble(lambda: Net().double(), n=N, seed=0)


def assert_members(ens: vmapens.Ensemble, alone: list[nn.Module], **tol: Any) -> None:
    for i, m in enumerate(alone):
        got, want = ens[i].state_dict(), m.state_dict()
        assert list(got) == list(want)
        for k in want:
            torch.testing.assert_close(got[k], want[k], **(tol or TOL), msg=f"member {i} {k}")


def test_make_step_on_the_awkward_net_matches_each_member_alone() -> None:
    ens = net64()
    alone = ens.unstack()
    data = batches(3)
    step = vmapens.make_step(ens, dict_loss, vmapens.StackedAdam(ens, lr=0.01))
    for k, (b, y) in enumerate(data):
        if k == 1:
            ens.template.quantize = True  # curriculum: the straight-through estimator from now
        step((b, 2 + k % 2), y)  # depth: 2 or 3 blocks, an int beside the dict
    for m in alone:
        opt = torch.optim.Adam(m.parameters(), lr=0.01)
        for k, (b, y) in enumerate(data):
            m.quantize = k >= 1
            opt.zero_grad()
            dict_loss(m(b, 2 + k % 2), y).backward()
            opt.step()
    assert_members(ens, alone)
    # The Python counter advanced once per step (the first step's self-check leaves it), the
    # buffer counter by the rows, as alone.
    assert [ens[i].calls for i in range(N)] == [m.calls for m in alone] == [3] * N
    assert ens.get_buffer("seen").tolist() == [int(m.seen) for m in alone] == [24] * N
    # Eval mode (the self.training branch) with a keyword-only mask, shared by the members.
    b, _ = batches(1, seed=5)[0]
    keep = torch.tensor([1, 0, 1, 1, 0, 1, 1, 0], dtype=torch.bool)
    ens.eval()
    got = ens(b, 1, mask=keep)
    for i, m in enumerate(alone):
        m.eval()
        want = m(b, 1, mask=keep)
        torch.testing.assert_close(got["pred"][i], want["pred"], **TOL)
        torch.testing.assert_close(got["aux"][i], want["aux"], **TOL)
    assert ens[0].calls == alone[0].calls == 4


def test_aux_loss_read_from_the_module_after_the_forward() -> None:
    """The loss reads ``model.moe.aux_loss`` after the forward, as users write it: inside the
    ensemble that module is ``ens.runner`` (docs/semantics.md: the members run copies of the
    template), and each member reads its own aux loss."""
    ens = net64()
    alone = ens.unstack()
    data = batches(2)

    def loss(out: dict, y: Tensor) -> Tensor:
        return F.mse_loss(out["pred"], y) + 0.1 * ens.runner.moe.aux_loss

    step = vmapens.make_step(ens, loss, vmapens.StackedSGD(ens, lr=0.1, momentum=0.9))
    for b, y in data:
        step(b, y)
    for m in alone:
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        for b, y in data:
            opt.zero_grad()
            out = m(b)
            (F.mse_loss(out["pred"], y) + 0.1 * m.moe.aux_loss).backward()
            opt.step()
    assert_members(ens, alone)


def test_fit_with_dict_inputs_and_a_dict_output_matches_alone() -> None:
    ens = net64()
    alone = ens.unstack()
    g = torch.Generator().manual_seed(2)
    X = {
        "x": torch.randn(16, 4, generator=g, dtype=F64),
        "side": torch.randn(16, 2, generator=g, dtype=F64),
    }
    Y = torch.randn(16, 2, generator=g, dtype=F64)
    vmapens.fit(
        ens,
        (X, Y),
        dict_loss,
        epochs=1,
        batch_size=8,
        shuffle=False,
        lr=0.01,
        seed=0,
        progress=False,
    )
    halves = [({k: v[s] for k, v in X.items()}, Y[s]) for s in (slice(0, 8), slice(8, 16))]
    for m in alone:
        opt = torch.optim.Adam(m.parameters(), lr=0.01)
        for b, y in halves:
            opt.zero_grad()
            dict_loss(m(b), y).backward()
            opt.step()
    assert_members(ens, alone)
    assert [ens[i].calls for i in range(N)] == [m.calls for m in alone] == [2] * N


class Pair(NamedTuple):
    x: Tensor
    side: Tensor


@dataclasses.dataclass
class Record:
    x: Tensor
    side: Tensor | None = None


class Out(NamedTuple):
    pred: Tensor
    aux: Tensor


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 2), nn.Linear(2, 2)

    def forward(self, batch: Pair | Record) -> Out:
        h = self.a(batch.x)
        if batch.side is not None:
            h = h + self.b(batch.side)
        return Out(h, h.pow(2).mean())


def out_loss(out: Out, y: Tensor) -> Tensor:
    return F.mse_loss(out.pred, y) + 0.1 * out.aux


def test_namedtuple_and_dataclass_inputs_and_a_namedtuple_output() -> None:
    """A NamedTuple is a tuple, which the step reads as the forward's positional inputs
    (make_step's docstring): wrap it, ``step((pair,), y)``. A dataclass is one input."""
    g = torch.Generator().manual_seed(3)
    x, s, y = (torch.randn(6, k, generator=g, dtype=F64) for k in (4, 2, 2))
    ens = vmapens.Ensemble(lambda: Small().double(), n=N, seed=0)
    alone = ens.unstack()
    out = ens(Pair(x, s))
    assert type(out) is Out and out.pred.shape == (N, 6, 2)
    step = vmapens.make_step(ens, out_loss, vmapens.StackedSGD(ens, lr=0.1))
    inputs = [(Pair(x, s),), Record(x, s), Record(x)]
    for inp in inputs:
        step(inp, y)
    for m in alone:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for inp in inputs:
            opt.zero_grad()
            out_loss(m(*inp) if isinstance(inp, tuple) else m(inp), y).backward()
            opt.step()
    assert_members(ens, alone)


class ItemGated(nn.Module):
    """``.item()`` control flow, an old-style straight-through Function, a buffer counter."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.extra = nn.Linear(4, 2), nn.Linear(2, 2)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: Tensor) -> Tensor:
        self.steps += 1
        h = OldRound.apply(self.fc(x))
        if h.abs().mean().item() > 0.4:
            h = self.extra(h)
        return h


def test_item_control_flow_is_refused_under_vmap_and_exact_with_loop() -> None:
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(6, 4, generator=g, dtype=F64), torch.randn(6, 2, generator=g, dtype=F64)
    ens = vmapens.Ensemble(lambda: ItemGated().double(), n=N, seed=0)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    with pytest.raises(RuntimeError, match="backend='loop'"):
        vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1))(x, y)
    for k, v in ens.state_dict().items():  # refused: nothing changed
        assert torch.equal(v, before[k]), k
    loop = vmapens.Ensemble(lambda: ItemGated().double(), n=N, seed=0, backend="loop")
    alone = loop.unstack()
    step = vmapens.make_step(loop, nn.MSELoss(), vmapens.StackedSGD(loop, lr=0.3))
    for _ in range(3):
        step(x, y)
    for m in alone:
        opt = torch.optim.SGD(m.parameters(), lr=0.3)
        for _ in range(3):
            opt.zero_grad()
            F.mse_loss(m(x), y).backward()
            opt.step()
    assert_members(loop, alone, rtol=0, atol=0)  # members one at a time: torch's own kernels
    assert loop.get_buffer("steps").tolist() == [3] * N


class Warmup(nn.Module):
    """A Python counter read against a warm-up length, a first-call flag (ActNorm-like)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.calls = 0
        self.initialized = False

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        h = self.fc(x)
        if not self.initialized:
            self.initialized = True
            h = h * 0.5
        if self.calls > 2:  # warm-up over
            h = torch.tanh(h)
        return h


class Counted(nn.Module):
    """Only the counter: the first step's numbers do not depend on it yet."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        h = self.fc(x)
        return torch.tanh(h) if self.calls > 2 else h


def _warmup_data() -> tuple[Tensor, ...]:
    g = torch.Generator().manual_seed(6)
    return tuple(
        torch.randn(r, c, generator=g, dtype=F64) for r, c in ((8, 3), (8, 2), (4, 3), (4, 2))
    )


def test_fit_val_data_check_leaves_a_first_call_flag_and_a_counter_alone() -> None:
    x, y, xv, yv = _warmup_data()
    ens = vmapens.Ensemble(lambda: Warmup().double(), n=N, seed=0)
    alone = ens.unstack()
    vmapens.fit(ens, (x, y), nn.MSELoss(), epochs=2, val_data=(xv, yv), optimizer=vmapens.StackedSGD,
                lr=0.1, seed=0, progress=False, callbacks=[EarlyStopping(restore_best=False)])  # fmt: skip
    for m in alone:  # the plain loop: train an epoch, validate in eval mode
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(2):
            m.train()
            opt.zero_grad()
            F.mse_loss(m(x), y).backward()
            opt.step()
            m.eval()
            with torch.no_grad():
                m(xv)
        m.train()
    assert [ens[i].calls for i in range(N)] == [m.calls for m in alone] == [4] * N
    assert_members(ens, alone)


@pytest.mark.parametrize("how", [{"backend": "loop"}, {"chunk_size": 1}])
def test_a_python_counter_with_members_in_turns_is_refused_or_exact(how: dict) -> None:
    x, y, _, _ = _warmup_data()
    ens = vmapens.Ensemble(lambda: Counted().double(), n=N, seed=0, **how)
    alone = ens.unstack()
    try:
        step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1))
        for _ in range(4):
            step(x, y)
    except RuntimeError as err:  # a clear refusal, naming the counter and the way out
        assert "`calls`" in str(err) and "register_buffer" in str(err)
        return
    for m in alone:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(4):
            opt.zero_grad()
            F.mse_loss(m(x), y).backward()
            opt.step()
    assert [ens[i].calls for i in range(N)] == [m.calls for m in alone]
    assert_members(ens, alone)
