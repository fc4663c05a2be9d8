"""vmapens._recurrent: batchable recurrent layers against torch's own modules, the truth."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, replace

import optree
import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value, stack_module_state, vmap
from torch.nn.utils.rnn import pack_padded_sequence

from vmapens._batchable import batchable
from vmapens._compiling import compile_arguments
from vmapens._recurrent import (
    BatchableGRU,
    BatchableLSTM,
    BatchableRNN,
    BatchableRNNCell,
)

TOL = 1e-10  # float64 throughout: the same maths, summed in a slightly different order
N = 3
FEATURES, HIDDEN, STEPS, BATCH = 3, 4, 7, 2


class Head(nn.Module):
    """A member whose recurrent layer is a submodule, followed by an ordinary layer."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(FEATURES, HIDDEN, batch_first=True)
        self.out = nn.Linear(HIDDEN, 2)

    def forward(self, x: Tensor, hx: Tensor | None = None) -> Tensor:
        seq, _ = self.gru(x, hx)
        return self.out(seq[:, -1])


@dataclass(frozen=True)
class Case:
    id: str
    make: Callable[[], nn.Module]
    unbatched: bool = False
    hx: bool = False
    steps: int = STEPS

    def __str__(self) -> str:
        return self.id


def _cases() -> list[Case]:
    f, h = FEATURES, HIDDEN
    return [
        Case("gru", lambda: nn.GRU(f, h)),
        Case("gru-2layers", lambda: nn.GRU(f, h, num_layers=2)),
        Case("gru-bidirectional-2layers", lambda: nn.GRU(f, h, num_layers=2, bidirectional=True)),
        Case("gru-batch_first", lambda: nn.GRU(f, h, batch_first=True)),
        Case("gru-no-bias", lambda: nn.GRU(f, h, bias=False)),
        Case("gru-unbatched", lambda: nn.GRU(f, h, num_layers=2), unbatched=True),
        Case("gru-hx", lambda: nn.GRU(f, h, num_layers=2, bidirectional=True), hx=True),
        Case("lstm", lambda: nn.LSTM(f, h)),
        Case("lstm-2layers", lambda: nn.LSTM(f, h, num_layers=2)),
        Case("lstm-bidirectional", lambda: nn.LSTM(f, h, bidirectional=True)),
        Case("lstm-batch_first", lambda: nn.LSTM(f, h, batch_first=True)),
        Case("lstm-no-bias", lambda: nn.LSTM(f, h, bias=False)),
        Case("lstm-proj", lambda: nn.LSTM(f, h, proj_size=2)),
        Case(
            "lstm-proj-bidirectional-2layers-hx",
            lambda: nn.LSTM(f, h, num_layers=2, bidirectional=True, proj_size=2),
            hx=True,
        ),
        Case("lstm-unbatched-hx", lambda: nn.LSTM(f, h), unbatched=True, hx=True),
        Case("rnn-tanh", lambda: nn.RNN(f, h)),
        Case(
            "rnn-relu-bidirectional-2layers",
            lambda: nn.RNN(f, h, num_layers=2, bidirectional=True, nonlinearity="relu"),
        ),
        Case("rnn-no-bias-batch_first", lambda: nn.RNN(f, h, bias=False, batch_first=True)),
        Case(
            "rnn-unbatched-hx", lambda: nn.RNN(f, h, nonlinearity="relu"), unbatched=True, hx=True
        ),
        Case("grucell", lambda: nn.GRUCell(f, h)),
        Case("grucell-hx-unbatched", lambda: nn.GRUCell(f, h), unbatched=True, hx=True),
        Case("lstmcell", lambda: nn.LSTMCell(f, h)),
        Case("lstmcell-no-bias-hx", lambda: nn.LSTMCell(f, h, bias=False), hx=True),
        Case("rnncell-relu-hx", lambda: nn.RNNCell(f, h, nonlinearity="relu"), hx=True),
        Case("rnncell-no-bias-unbatched", lambda: nn.RNNCell(f, h, bias=False), unbatched=True),
        Case("submodule-gru-hx", Head, hx=True),
    ]


CASES = _cases()


def _recurrent(module: nn.Module) -> nn.Module:
    return module.gru if isinstance(module, Head) else module


def _input(case: Case, module: nn.Module) -> Tensor:
    core = _recurrent(module)
    if isinstance(core, nn.RNNCellBase):
        shape = [FEATURES] if case.unbatched else [BATCH, FEATURES]
    elif case.unbatched:
        shape = [case.steps, FEATURES]
    else:
        shape = [BATCH, case.steps, FEATURES] if core.batch_first else [case.steps, BATCH, FEATURES]
    return torch.randn(shape, dtype=torch.float64)


def _state(case: Case, module: nn.Module) -> Tensor | tuple[Tensor, Tensor] | None:
    """A random initial state of the right shape, or None when the case uses the default."""
    if not case.hx:
        return None
    core = _recurrent(module)
    batch = [] if case.unbatched else [BATCH]
    if isinstance(core, nn.RNNCellBase):
        h = torch.randn([*batch, core.hidden_size], dtype=torch.float64)
        return (h, torch.randn_like(h)) if isinstance(core, nn.LSTMCell) else h
    rows = core.num_layers * (2 if core.bidirectional else 1)
    out_size = core.proj_size or core.hidden_size
    h = torch.randn([rows, *batch, out_size], dtype=torch.float64)
    if isinstance(core, nn.LSTM):
        return h, torch.randn([rows, *batch, core.hidden_size], dtype=torch.float64)
    return h


def _members(case: Case, n: int) -> list[nn.Module]:
    members = []
    for k in range(n):
        torch.manual_seed(100 + k)
        members.append(case.make().double())
    return members


def _loss(out: object) -> Tensor:
    # Every output leaf (sequence, h_n, c_n) reaches the loss, with distinct weights.
    return sum(((t * t).sum() + t.sum()) * (k + 1) for k, t in enumerate(optree.tree_leaves(out)))


def _run(module: nn.Module, params: dict[str, Tensor], x: Tensor, hx: object) -> object:
    args = (x,) if hx is None else (x, hx)
    return functional_call(module, params, args)


def _meta_template(member: nn.Module) -> nn.Module:
    return batchable(copy.deepcopy(member).to("meta"))


def _truth(members: list[nn.Module], x: Tensor, hxs: list[object]) -> tuple[list, list, list]:
    """Each member run alone by torch: outputs, loss values, gradients by parameter name."""
    outs, values, grads = [], [], []
    for m, hx in zip(members, hxs):
        params = dict(m.named_parameters())
        out = m(x) if hx is None else m(x, hx)
        loss = _loss(out)
        outs.append(out)
        values.append(loss.detach())
        grads.append(dict(zip(params, torch.autograd.grad(loss, list(params.values())))))
    return outs, values, grads


def _stacked_states(hxs: list[object]) -> object:
    if hxs[0] is None:
        return None
    return optree.tree_map(lambda *ts: torch.stack(ts), *hxs)


def _vmapped_inputs(case: Case, members: list[nn.Module]) -> tuple[Tensor, list, object]:
    x = _input(case, members[0])
    hxs = [_state(case, m) for m in members]
    return x, hxs, _stacked_states(hxs)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_single_member_matches_torch(case: Case):
    (member,) = _members(case, 1)
    x, hx = _input(case, member), _state(case, member)
    converted = batchable(member)
    params = dict(member.named_parameters())
    out = _run(converted, params, x, hx)
    (want,), _, (want_grads,) = _truth([member], x, [hx])
    torch.testing.assert_close(out, want, atol=TOL, rtol=TOL)
    grads = torch.autograd.grad(_loss(out), list(params.values()))
    torch.testing.assert_close(dict(zip(params, grads)), want_grads, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_vmap_matches_each_member(case: Case):
    members = _members(case, N)
    template = _meta_template(members[0])
    params, _ = stack_module_state(members)
    x, hxs, hx = _vmapped_inputs(case, members)
    run = vmap(lambda p, x, hx: _run(template, p, x, hx), in_dims=(0, None, _dim(hx)))
    out = run(params, x, hx)
    want, _, want_grads = _truth(members, x, hxs)
    loss = sum(_loss(optree.tree_map(lambda t, k=k: t[k], out)) for k in range(N))
    grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
    for k in range(N):
        torch.testing.assert_close(
            optree.tree_map(lambda t, k=k: t[k], out), want[k], atol=TOL, rtol=TOL
        )
        torch.testing.assert_close(
            {n: g[k] for n, g in grads.items()}, want_grads[k], atol=TOL, rtol=TOL
        )


def _dim(hx: object) -> int | None:
    return None if hx is None else 0


def _per_member_grads(template: nn.Module, hx: object) -> Callable:
    def member_loss(p: dict[str, Tensor], x: Tensor, hx: object) -> Tensor:
        return _loss(_run(template, p, x, hx))

    return vmap(grad_and_value(member_loss), in_dims=(0, None, _dim(hx)))


def _check_per_member(case: Case, compiled: bool) -> None:
    members = _members(case, N)
    params, _ = stack_module_state(members)
    params = {name: p.detach() for name, p in params.items()}
    x, hxs, hx = _vmapped_inputs(case, members)
    fn = _per_member_grads(_meta_template(members[0]), hx)
    if compiled:
        # With the compiled step's backend and options: its vector ISA in the cache key (a run
        # under ATEN_CPU_CAPABILITY=avx2 after one on AVX-512 read 16-wide kernels from torch's
        # compile cache otherwise), and its C++ wrapper, which compiles the graph's kernels as
        # one C++ file (one compile for the LSTM's graph where each kernel took one: 34 s cold
        # became 24 s).
        fn = torch.compile(fn, fullgraph=True, dynamic=False, **compile_arguments(x.device))
    grads, values = fn(params, x, hx)
    _, want_values, want_grads = _truth(members, x, hxs)
    torch.testing.assert_close(values, torch.stack(want_values), atol=TOL, rtol=TOL)
    for k in range(N):
        torch.testing.assert_close(
            {n: g[k] for n, g in grads.items()}, want_grads[k], atol=TOL, rtol=TOL
        )


@pytest.mark.parametrize("case", CASES, ids=str)
def test_vmap_grad_and_value_matches_each_member(case: Case):
    _check_per_member(case, compiled=False)


# Compiled: 3 steps in input projections of 2 (COMPILED_PROJECTION_STEPS set for the test), so
# still two projections, the last one partial, through every layer, direction, projection and
# state path, and 12 unrolled LSTM cells to compile where 7 steps of 5 gave 28 (most of the
# file's time with a cold compile cache). The LSTM cell: its traced step on torch's own weights.
COMPILED_STEPS, COMPILED_CHUNK = 3, 2
COMPILED = [
    replace(c, steps=COMPILED_STEPS)
    for c in CASES
    if c.id in ("gru-batch_first", "lstm-proj-bidirectional-2layers-hx", "lstmcell")
]


@pytest.mark.parametrize("case", COMPILED, ids=str)
def test_compiled_grad_and_value_matches_each_member(case: Case, monkeypatch):
    monkeypatch.setattr("vmapens._recurrent.COMPILED_PROJECTION_STEPS", COMPILED_CHUNK)
    torch._dynamo.reset()
    _check_per_member(case, compiled=True)


DROPOUT = [
    Case("gru-dropout", lambda: nn.GRU(FEATURES, HIDDEN, num_layers=2, dropout=0.5)),
    Case(
        "lstm-dropout-bidirectional",
        lambda: nn.LSTM(FEATURES, HIDDEN, num_layers=3, dropout=0.5, bidirectional=True),
    ),
]


@pytest.mark.parametrize("case", DROPOUT, ids=str)
def test_dropout_between_layers(case: Case):
    members = _members(case, N)
    template = _meta_template(members[0])
    params, _ = stack_module_state(members)
    x = _input(case, members[0])
    run = vmap(lambda p, x: _run(template, p, x, None), in_dims=(0, None), randomness="different")

    out, _ = run(params, x)
    assert out.shape == (N, STEPS, BATCH, (2 if members[0].bidirectional else 1) * HIDDEN)
    assert torch.isfinite(out).all()
    again, _ = run(params, x)
    assert not torch.equal(out, again), "training mode must draw fresh dropout masks"

    template.eval()
    for m in members:
        m.eval()
    want, _, _ = _truth(members, x, [None] * N)
    first, second = run(params, x), run(params, x)
    torch.testing.assert_close(first, second, atol=0, rtol=0)
    for k in range(N):
        torch.testing.assert_close(
            optree.tree_map(lambda t, k=k: t[k], first), want[k], atol=TOL, rtol=TOL
        )


def _packed() -> object:
    x = torch.randn(STEPS, BATCH, FEATURES)
    return pack_padded_sequence(x, torch.tensor([STEPS, STEPS - 2]))


BAD = [
    (
        "packed-gru",
        lambda: batchable(nn.GRU(FEATURES, HIDDEN))(_packed()),
        TypeError,
        r"^Ensemble: PackedSequence inputs are not batched.*pad the sequences.*backend='loop'",
    ),
    (
        "packed-lstm",
        lambda: batchable(nn.LSTM(FEATURES, HIDDEN))(_packed()),
        TypeError,
        r"^Ensemble: PackedSequence",
    ),
    (
        "input-4d",
        lambda: BatchableGRU(FEATURES, HIDDEN)(torch.randn(1, STEPS, BATCH, FEATURES)),
        ValueError,
        r"^BatchableGRU: `input` must be 2-D .* got 4-D",
    ),
    (
        "input-features",
        lambda: BatchableRNN(FEATURES, HIDDEN)(torch.randn(STEPS, BATCH, 7)),
        ValueError,
        r"^BatchableRNN: `input` must have 3 features .* got 7",
    ),
    (
        "lstm-hx-tensor",
        lambda: BatchableLSTM(FEATURES, HIDDEN)(
            torch.randn(STEPS, BATCH, FEATURES), torch.zeros(1, BATCH, HIDDEN)
        ),
        TypeError,
        r"^BatchableLSTM: `hx` must be a tuple",
    ),
    (
        "gru-hx-shape",
        lambda: BatchableGRU(FEATURES, HIDDEN)(
            torch.randn(STEPS, BATCH, FEATURES), torch.zeros(2, BATCH, HIDDEN)
        ),
        ValueError,
        r"^BatchableGRU: `hx` \(h_0\) must have shape \[1, 2, 4\], got \[2, 2, 4\]",
    ),
    (
        "cell-input-3d",
        lambda: BatchableRNNCell(FEATURES, HIDDEN)(torch.randn(1, BATCH, FEATURES)),
        ValueError,
        r"^BatchableRNNCell: `input` must be 1-D .* got 3-D",
    ),
    (
        "rnn-nonlinearity",
        lambda: BatchableRNN(FEATURES, HIDDEN, nonlinearity="gelu"),
        ValueError,
        r"^BatchableRNN: `nonlinearity` must be one of",
    ),
    (
        "not-a-module",
        lambda: batchable(lambda x: x),
        TypeError,
        r"^batchable: `module` must be a torch.nn.Module, got function",
    ),
]


@pytest.mark.parametrize(("call", "error", "match"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_inputs_raise(call: Callable, error: type, match: str):
    with pytest.raises(error, match=match):
        call()


def test_batchable_leaves_its_argument_alone():
    member = Head()
    before = {k: v.clone() for k, v in member.state_dict().items()}
    converted = batchable(member)
    assert type(member.gru) is nn.GRU and type(converted.gru) is BatchableGRU
    assert list(converted.state_dict()) == list(before)
    torch.testing.assert_close(member.state_dict(), before, atol=0, rtol=0)
    assert all(a is not b for a, b in zip(member.parameters(), converted.parameters()))


def test_batchable_without_recurrent_layers_is_an_equal_copy():
    member = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))
    converted = batchable(member)
    assert converted is not member
    assert [type(m) for m in converted.modules()] == [type(m) for m in member.modules()]
    torch.testing.assert_close(converted.state_dict(), member.state_dict(), atol=0, rtol=0)
    x = torch.randn(BATCH, FEATURES)
    torch.testing.assert_close(converted(x), member(x), atol=0, rtol=0)


def test_subclasses_are_left_alone():
    class MyGRU(nn.GRU):
        pass

    converted = batchable(nn.Sequential(MyGRU(FEATURES, HIDDEN)))
    assert type(converted[0]) is MyGRU


def test_batchable_layers_are_rebuilt_by_batchable_again():
    twice = batchable(batchable(nn.LSTM(FEATURES, HIDDEN)))
    assert type(twice) is BatchableLSTM
