"""vmapens._lstm_fused: the eager LSTM recurrence as one autograd node, against nn.LSTM alone.

The truth is each member as torch's own ``nn.LSTM``, run alone: outputs, and the gradients
of every input that asks for one (weights, input sequence, initial state), with the loss on
any subset of the outputs. Each case also checks that the fused node ran (a test that passed
on the per-step loop would prove nothing about it), and the fallbacks check that it did not.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, stack_module_state, vmap
from torch.overrides import TorchFunctionMode
from truth import autograd_nodes

from vmapens import _lstm_fused
from vmapens._batchable import batchable

TOL = dict(atol=1e-10, rtol=1e-10)  # float64: the same maths, summed in another order
N, FEATURES, HIDDEN = 3, 3, 4
FUSED = "_RecurrenceBackward"


def _members(make: Callable[[], nn.LSTM], dtype: torch.dtype = torch.float64) -> list[nn.LSTM]:
    members = []
    for k in range(N):
        torch.manual_seed(10 + k)
        members.append(make().to(dtype))
    return members


def _inputs(lstm: nn.LSTM, steps: int, batch: int, dtype: torch.dtype, hx: bool):
    g = torch.Generator().manual_seed(0)
    shape = (batch, steps, FEATURES) if lstm.batch_first else (steps, batch, FEATURES)
    x = torch.randn(shape, generator=g, dtype=dtype)
    if not hx:
        return x, None
    rows = lstm.num_layers * (2 if lstm.bidirectional else 1)
    h = torch.randn(N, rows, batch, HIDDEN, generator=g, dtype=dtype)
    return x, (h, torch.randn_like(h))


# Which outputs reach the loss: out, h_n, c_n (None: left out).
WEIGHTS = {"all": (1.0, 2.0, 3.0), "out": (1.0, None, None), "h_n": (None, 1.0, None)}
WEIGHTS["c_n"] = (None, None, 1.0)


def _loss(outputs: tuple[Tensor, Tensor, Tensor], weights: tuple) -> Tensor:
    parts = [((t * t).sum() + t.sum()) * w for t, w in zip(outputs, weights) if w is not None]
    return torch.stack(parts).sum()


CASES = {
    "plain": lambda: nn.LSTM(FEATURES, HIDDEN),
    "batch_first": lambda: nn.LSTM(FEATURES, HIDDEN, batch_first=True),
    "2layers-bidirectional": lambda: nn.LSTM(FEATURES, HIDDEN, 2, bidirectional=True),
    "no-bias": lambda: nn.LSTM(FEATURES, HIDDEN, bias=False, batch_first=True),
}


def _check_vmapped(make, weights, steps=5, batch=2, hx=True, grad_input=True, frozen=()):
    members = _members(make)
    template = batchable(copy.deepcopy(members[0]).to("meta"))
    params, _ = stack_module_state(members)
    for name in frozen:
        params[name] = params[name].detach()
    x, hxs = _inputs(members[0], steps, batch, torch.float64, hx)
    x.requires_grad_(grad_input)
    states = () if hxs is None else tuple(t.requires_grad_() for t in hxs)

    def run(p, x, *hx):
        return functional_call(template, p, (x, hx) if hx else (x,))

    out, (h_n, c_n) = vmap(run, in_dims=(0, None, *(0 for _ in states)))(params, x, *states)
    loss = _loss((out, h_n, c_n), weights)
    assert FUSED in autograd_nodes(loss)
    wrt = [t for t in (*params.values(), x, *states) if t.requires_grad]
    got = torch.autograd.grad(loss, wrt, allow_unused=True)

    wants = []
    for k, member in enumerate(members):
        for name, p in member.named_parameters():
            p.requires_grad_(name not in frozen)
        member_hx = None if not states else (states[0][k], states[1][k])
        m_out, (m_h, m_c) = member(x, member_hx)
        torch.testing.assert_close((out[k], h_n[k], c_n[k]), (m_out, m_h, m_c), **TOL)
        m_loss = _loss((m_out, m_h, m_c), weights)
        m_wrt = [p for p in member.parameters() if p.requires_grad] + [x] * grad_input
        wants.append(torch.autograd.grad(m_loss, [*m_wrt, *states], allow_unused=True))
    n_params = sum(p.requires_grad for p in params.values())
    for j, g in enumerate(got[:n_params]):  # stacked weights: member k's row is its own
        for k in range(N):
            torch.testing.assert_close(g[k], wants[k][j], **TOL)
    if grad_input:  # the shared input: the members' gradients add up
        torch.testing.assert_close(got[n_params], sum(w[n_params] for w in wants), **TOL)
    for s in range(-len(states), 0):  # stacked initial states: row k is member k's
        torch.testing.assert_close(got[s], sum(w[s] for w in wants), **TOL)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("weights", WEIGHTS)
def test_vmapped_layer_equals_each_lstm_alone(case, weights):
    _check_vmapped(CASES[case], WEIGHTS[weights])


@pytest.mark.parametrize(("steps", "batch"), [(1, 1), (1, 4), (9, 1), (4, 7)])
def test_sizes(steps, batch):
    _check_vmapped(CASES["2layers-bidirectional"], WEIGHTS["all"], steps=steps, batch=batch)


def test_without_initial_state_or_input_gradient():
    _check_vmapped(CASES["batch_first"], WEIGHTS["all"], hx=False, grad_input=False)


def test_frozen_weights_get_no_gradient_and_the_rest_are_right():
    frozen = ("weight_hh_l0", "bias_ih_l0")
    _check_vmapped(CASES["plain"], WEIGHTS["all"], frozen=frozen)


def test_float32_equals_each_lstm_alone():
    members = _members(CASES["batch_first"], torch.float32)
    template = batchable(copy.deepcopy(members[0]).to("meta"))
    params, _ = stack_module_state(members)
    x, _ = _inputs(members[0], 20, 8, torch.float32, hx=False)
    out, _ = vmap(lambda p, x: functional_call(template, p, (x,)), in_dims=(0, None))(params, x)
    loss = out[:, :, -1].square().sum()
    assert FUSED in autograd_nodes(loss)
    grads = torch.autograd.grad(loss, list(params.values()))
    for k, member in enumerate(members):
        m_out, _ = member(x)
        torch.testing.assert_close(out[k], m_out, atol=1e-6, rtol=1e-5)
        m_grads = torch.autograd.grad(m_out[:, -1].square().sum(), list(member.parameters()))
        for g, m_g in zip(grads, m_grads, strict=True):
            torch.testing.assert_close(g[k], m_g, atol=1e-5, rtol=1e-4)


def test_outside_vmap_equals_the_lstm_itself():
    (member,) = _members(CASES["2layers-bidirectional"])[:1]
    converted = batchable(member)
    x = torch.randn(6, 2, FEATURES, dtype=torch.float64)
    out = converted(x)[0]
    assert FUSED in autograd_nodes(out)
    torch.testing.assert_close(out, member(x)[0], **TOL)
    got = torch.autograd.grad(out.square().sum(), list(converted.parameters()))
    want = torch.autograd.grad(member(x)[0].square().sum(), list(member.parameters()))
    torch.testing.assert_close(got, want, **TOL)


def test_gradient_of_gradient_equals_each_lstm_alone():
    """create_graph=True (a gradient penalty): the node differentiates the per-step loop."""
    members = _members(CASES["plain"])
    template = batchable(copy.deepcopy(members[0]).to("meta"))
    params, _ = stack_module_state(members)
    x = torch.randn(5, 2, FEATURES, dtype=torch.float64)
    out, _ = vmap(lambda p, x: functional_call(template, p, (x,)), in_dims=(0, None))(params, x)
    assert FUSED in autograd_nodes(out)
    first = torch.autograd.grad(out.square().sum(), list(params.values()), create_graph=True)
    penalty = sum(g.square().sum() for g in first)
    second = torch.autograd.grad(penalty, list(params.values()))
    for k, member in enumerate(members):
        m_first = torch.autograd.grad(
            member(x)[0].square().sum(), list(member.parameters()), create_graph=True
        )
        m_second = torch.autograd.grad(sum(g.square().sum() for g in m_first), member.parameters())
        for g, m_g in zip(second, m_second, strict=True):
            torch.testing.assert_close(g[k], m_g, **TOL)


def test_nested_vmap_equals_each_lstm_alone():
    members = _members(CASES["batch_first"])[:2] * 2  # a [2, 2] grid of members
    template = batchable(copy.deepcopy(members[0]).to("meta"))
    params, _ = stack_module_state(members)
    grid = {k: v.unflatten(0, (2, 2)) for k, v in params.items()}
    x = torch.randn(2, 5, FEATURES, dtype=torch.float64)
    run = vmap(vmap(lambda p, x: functional_call(template, p, (x,))[0], in_dims=(0, None)),
               in_dims=(0, None))  # fmt: skip
    out = run(grid, x)
    assert FUSED in autograd_nodes(out)
    grads = torch.autograd.grad(out.square().sum(), list(grid.values()))
    for k, member in enumerate(members):
        m_out = member(x)[0]
        torch.testing.assert_close(out[k // 2, k % 2], m_out, **TOL)
        m_grads = torch.autograd.grad(m_out.square().sum(), list(member.parameters()))
        for g, m_g in zip(grads, m_grads, strict=True):
            torch.testing.assert_close(g[k // 2, k % 2], m_g, **TOL)


class _Spy(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _vmapped_loss(dtype=torch.float64) -> Tensor:
    members = _members(CASES["plain"], dtype)
    template = batchable(copy.deepcopy(members[0]).to("meta"))
    params, _ = stack_module_state(members)
    x = torch.randn(4, 2, FEATURES, dtype=dtype)
    out, _ = vmap(lambda p, x: functional_call(template, p, (x,)), in_dims=(0, None))(params, x)
    return out.float().square().sum()


FALLBACKS = {
    "float16": lambda: _vmapped_loss(torch.float16),
    "bfloat16": lambda: _vmapped_loss(torch.bfloat16),
    "autocast": lambda: _with(torch.autocast("cpu", dtype=torch.bfloat16), _vmapped_loss),
    "torch-function-mode": lambda: _with(_Spy(), _vmapped_loss),
}


def _with(context, fn):
    with context:
        return fn()


@pytest.mark.parametrize("name", FALLBACKS)
def test_per_step_loop_where_the_node_is_not_known_to_equal_it(name):
    loss = FALLBACKS[name]()
    assert torch.isfinite(loss)
    assert FUSED not in autograd_nodes(loss)


def test_grad_transform_runs_the_per_step_loop(monkeypatch):
    """Under torch.func.grad the node is not used: it is only known under vmap and autograd."""
    calls = []
    forward = _lstm_fused._Recurrence.forward
    monkeypatch.setattr(
        _lstm_fused._Recurrence, "forward", staticmethod(lambda *a: calls.append(1) or forward(*a))
    )
    (member,) = _members(CASES["plain"])[:1]
    converted = batchable(member)
    params = {k: v.detach() for k, v in member.named_parameters()}
    x = torch.randn(4, 2, FEATURES, dtype=torch.float64)

    def loss(p):
        return functional_call(converted, p, (x,))[0].square().sum()

    got = grad(loss)(params)
    want = torch.autograd.grad(member(x)[0].square().sum(), list(member.parameters()))
    torch.testing.assert_close(list(got.values()), list(want), **TOL)
    assert not calls
    loss(params)
    assert calls  # the spy sees the node where it runs


# torch's own LSTM reaches torch.jit.script for its forward-mode derivative.
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_forward_mode_ad_runs_the_per_step_loop():
    import torch.autograd.forward_ad as fwAD

    (member,) = _members(CASES["plain"])[:1]
    converted = batchable(member)
    x = torch.randn(4, 2, FEATURES, dtype=torch.float64)
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, torch.ones_like(x))
        got = fwAD.unpack_dual(converted(dual)[0]).tangent
        want = fwAD.unpack_dual(member(dual)[0]).tangent
    torch.testing.assert_close(got, want, **TOL)


def test_output_changed_in_place_keeps_the_gradient_right():
    """The backward reads its own copies of every h, not the output the caller may change."""
    (member,) = _members(CASES["plain"])[:1]
    converted = batchable(member)
    x = torch.randn(4, 2, FEATURES, dtype=torch.float64)
    got_out = converted(x)[0]
    got_out.mul_(3)
    want_out = member(x)[0]
    want_out.mul_(3)
    got = torch.autograd.grad(got_out.square().sum(), list(converted.parameters()))
    want = torch.autograd.grad(want_out.square().sum(), list(member.parameters()))
    torch.testing.assert_close(got, want, **TOL)


def test_traced_forward_runs_the_per_step_loop():
    """dynamo cannot trace the node's checks (functorch's interpreter stack): it sees the loop."""
    (member,) = _members(CASES["plain"])[:1]
    converted = batchable(member)
    x = torch.randn(4, 2, FEATURES, dtype=torch.float64)
    compiled = torch.compile(converted, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x)[0], member(x)[0], **TOL)


def test_shared_weights_mapped_inputs_equal_the_lstm_run_on_each():
    """vmap over inputs with one set of weights (in_dims=None): the weights' gradient is the
    sum over the mapped inputs, as running the LSTM on each input and adding the losses.
    The inputs are mapped along dim 1."""
    (member,) = _members(CASES["2layers-bidirectional"])[:1]
    converted = batchable(member)
    params = dict(member.named_parameters())
    xs = torch.randn(5, N, 2, FEATURES, dtype=torch.float64)
    out = vmap(lambda p, x: functional_call(converted, p, (x,))[0], in_dims=(None, 1))(params, xs)
    assert FUSED in autograd_nodes(out)
    got = torch.autograd.grad(out.square().sum(), list(params.values()))
    alone = torch.stack([member(xs[:, k])[0] for k in range(N)])
    torch.testing.assert_close(out, alone, **TOL)
    want = torch.autograd.grad(alone.square().sum(), list(params.values()))
    torch.testing.assert_close(got, want, **TOL)


def test_vmap_rule_takes_the_mapped_dim_where_it_is():
    """The node's vmap rule on an input mapped along dim 1 (vmap's own batching rules hand it
    dim 0 inside the layer): the same as calling the node on each slice without vmap, which
    the tests above hold to torch's LSTM."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, N, 2, FEATURES, generator=g, dtype=torch.float64)  # mapped along dim 1
    w_ih = torch.randn(4 * HIDDEN, FEATURES, generator=g, dtype=torch.float64)
    w_hh_t = torch.randn(HIDDEN, 4 * HIDDEN, generator=g, dtype=torch.float64)
    bias = torch.randn(4 * HIDDEN, generator=g, dtype=torch.float64)
    h0, c0 = torch.randn(2, 2, HIDDEN, generator=g, dtype=torch.float64)
    weights = (w_ih, bias, w_hh_t, h0, c0)
    node = _lstm_fused.fused_direction
    got = vmap(lambda *a: node(*a)[0], in_dims=(1, *(None for _ in weights), None))(
        x, *weights, False
    )
    want = torch.stack([node(x[:, k], *weights, False)[0] for k in range(N)])
    torch.testing.assert_close(got, want, **TOL)
