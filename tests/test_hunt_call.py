"""The ensemble's call, ``ens(...)``, against each member called alone as a plain module.

Truth: deep copies of the members, each called on its own (float64): outputs, gradients of the
inputs and parameters, and buffers after the call.
"""

from __future__ import annotations

import collections
import copy
import functools

import optree
import pytest
import torch
from torch import nn

import vmapens

N = 3
TOL = {"rtol": 1e-10, "atol": 1e-12}
Pair = collections.namedtuple("Pair", "h total none")


def _members(factory, **options):
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # not .double(): it would leave an alias behind
    try:
        modules = [factory() for _ in range(N)]
    finally:
        torch.set_default_dtype(default)
    alone = [copy.deepcopy(m) for m in modules]
    return vmapens.Ensemble.from_modules(modules, **options), alone


def _stack(outputs):
    return optree.tree_map(lambda *xs: torch.stack(xs), *outputs)


def _same_buffers(ens, alone):
    for i, member in enumerate(alone):
        for name, b in member.named_buffers():
            torch.testing.assert_close(ens.stacked_state()[name][i], b, **TOL)


class Structured(nn.Module):
    """Dict and nested-tuple inputs, keyword, None and number inputs, a structured output."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.bn = nn.Linear(2, 3), nn.Linear(4, 3), nn.BatchNorm1d(3)

    def forward(self, d, scale=1.0, shift=None, *, w):
        h = self.bn(self.a(d["x"]) + self.b(d["y"][0][0]) * scale) * w
        if shift is not None:
            h = h + shift
        return {"h": h, "rest": Pair(h.sum(0), h.mean(), None), "list": [h[0], None]}


def _inputs(per_member: bool):
    lead = (N,) if per_member else ()
    x = torch.randn(*lead, 5, 2, dtype=torch.float64, requires_grad=True)
    y = torch.randn(*lead, 5, 4, dtype=torch.float64)
    return x, y


CALLS = [
    pytest.param({}, id="vmap"),
    pytest.param({"backend": "loop"}, id="loop"),
    pytest.param({"chunk_size": 1}, id="chunk1"),
    pytest.param({"chunk_size": 2}, id="chunk2-not-dividing"),
    pytest.param({"chunk_size": N}, id="chunk-n"),
    pytest.param({"chunk_size": N + 4, "randomness": "same"}, id="chunk-over-n-same"),
    pytest.param({"chunk_size": 2, "randomness": "same"}, id="chunk2-same"),
]


@pytest.mark.parametrize("per_member", [False, True], ids=["shared", "in_dims0"])
@pytest.mark.parametrize("options", CALLS)
def test_structured_call_equals_each_member_alone(options, per_member):
    ens, alone = _members(Structured, **options)
    x, y = _inputs(per_member)
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    shift = torch.randn(3, dtype=torch.float64)
    d = {"x": x, "y": ((y,),)}
    out = ens(d, 0.5, shift, in_dims=(0 if per_member else None, None, None), w=w)

    def arg(t, i):
        return t[i] if per_member else t

    expected = _stack(
        [m({"x": arg(x, i), "y": ((arg(y, i),),)}, 0.5, shift, w=w) for i, m in enumerate(alone)]
    )
    assert type(out["rest"]) is Pair and out["rest"].none is None and out["list"][1] is None
    torch.testing.assert_close(out, expected, **TOL)
    _same_buffers(ens, alone)
    params = list(ens.stacked_params().values())
    got = torch.autograd.grad((out["h"] ** 2).sum() + out["rest"].h.sum(), [x, w, *params])
    loss = (expected["h"] ** 2).sum() + expected["rest"].h.sum()
    twins = [p for m in alone for p in m.parameters()]
    want = torch.autograd.grad(loss, [x, w, *twins])
    torch.testing.assert_close(got[:2], want[:2], **TOL)
    k = len(params)
    for j, g in enumerate(got[2:]):
        torch.testing.assert_close(g, torch.stack(want[2 + j :: k]), **TOL)


class GradModes(nn.Module):
    """Grad modes switched inside the forward, .detach() and torch.where on a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(2, 4), nn.Linear(4, 1)
        self.register_buffer("seen", torch.zeros(4))

    def forward(self, x):
        with torch.no_grad():
            h0 = self.a(x)
            self.seen.add_(h0.mean(0))
        with torch.enable_grad():
            h = self.a(x)
        w = torch.where(self.a.weight > 0, self.a.weight, 2 * self.a.weight.detach())
        return self.b(torch.tanh(h + h0 + x @ w.t()))


@pytest.mark.parametrize("outer", ["grad", "no_grad", "inference_mode"])
@pytest.mark.parametrize("options", [{}, {"backend": "loop"}, {"chunk_size": 2}], ids=str)
def test_grad_modes_inside_and_around_the_call_equal_each_member_alone(options, outer):
    ens, alone = _members(GradModes, **options)
    x = torch.randn(5, 2, dtype=torch.float64, requires_grad=True)
    around = {"grad": torch.enable_grad, "no_grad": torch.no_grad}.get(outer, torch.inference_mode)
    with around():
        out = ens(x)
        expected = torch.stack([m(x) for m in alone])
    torch.testing.assert_close(out, expected, **TOL)
    assert out.requires_grad == expected.requires_grad
    _same_buffers(ens, alone)
    out, expected = ens(x), torch.stack([m(x) for m in alone])  # a plain call after it
    got = torch.autograd.grad(out.sum(), x)[0]
    torch.testing.assert_close(got, torch.autograd.grad(expected.sum(), x)[0], **TOL)


def test_train_eval_flips_and_a_tensor_index_equal_each_member_alone():
    def factory():
        return nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4), nn.Dropout(0.0), nn.Linear(4, 1))

    ens, alone = _members(factory)
    x = torch.randn(5, 2, dtype=torch.float64)
    for mode in ["train", "eval", "train", "eval", "train"]:
        getattr(ens, mode)()
        expected = torch.stack([getattr(m, mode)()(x) for m in alone])
        torch.testing.assert_close(ens(x), expected, **TOL)
    sub = ens[torch.tensor([2, 0])]
    torch.testing.assert_close(sub(x), torch.stack([alone[2](x), alone[0](x)]), **TOL)
    for j, i in enumerate([2, 0]):
        for name, b in alone[i].named_buffers():
            torch.testing.assert_close(sub.stacked_state()[name][j], b, **TOL)


class _Config:
    def __init__(self, w: torch.Tensor) -> None:
        self.w = w


class HeldInList(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 3)
        self.ws = [self.fc.weight]

    def forward(self, x):
        return x @ self.ws[0].t()


class HeldInDict(HeldInList):
    def __init__(self) -> None:
        super().__init__()
        self.ws = {"w": self.fc.weight}

    def forward(self, x):
        return x @ self.ws["w"].t()


class HeldInClosure(HeldInList):
    def __init__(self) -> None:
        super().__init__()
        w = self.fc.weight
        self.project = lambda x: x @ w.t()

    def forward(self, x):
        return self.project(x)


class HeldInPartial(HeldInList):
    def __init__(self) -> None:
        super().__init__()
        self.project = functools.partial(nn.functional.linear, weight=self.fc.weight)

    def forward(self, x):
        return self.project(x)


class HeldInConfig(HeldInList):
    def __init__(self) -> None:
        super().__init__()
        self.config = _Config(self.fc.weight)

    def forward(self, x):
        return x @ self.config.w.t()


class BufferAlias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 3)
        self.register_buffer("offset", torch.randn(3))
        self.alias = self.offset  # a plain attribute: nn.Module does not register it again

    def forward(self, x):
        return self.fc(x) + self.alias


class HookClosure(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 3)
        w = self.fc.weight
        self.fc.register_forward_hook(lambda m, args, out: out + w.sum())

    def forward(self, x):
        return self.fc(x)


def _shift(module, args, offset):
    return (args[0] + offset.sum(),)


class PreHookPartial(BufferAlias):
    def __init__(self) -> None:
        super().__init__()
        del self.alias
        self.fc.register_forward_pre_hook(functools.partial(_shift, offset=self.offset))

    def forward(self, x):
        return self.fc(x)


HELD = [
    HeldInList,
    HeldInDict,
    HeldInClosure,
    HeldInPartial,
    HeldInConfig,
    BufferAlias,
    HookClosure,
    PreHookPartial,
]


@pytest.mark.parametrize("factory", HELD, ids=lambda f: f.__name__)
@pytest.mark.parametrize("backend", ["vmap", "loop"])
def test_a_plain_attribute_holding_a_members_tensor_is_refused(factory, backend):
    # Alone each member reads its own tensor through the attribute; the ensemble swaps the
    # members' tensors into the modules' slots only, so the forward would read another one.
    key = {BufferAlias: "alias", HeldInClosure: "project", HeldInPartial: "project"}
    key.update({HeldInConfig: "config", HookClosure: "fc._forward_hooks"})
    name = key.get(factory, "fc._forward_pre_hooks" if factory is PreHookPartial else "ws")
    with pytest.raises(ValueError, match=rf"from_modules: member 0's attribute `{name}`"):
        _members(factory, backend=backend)
    with pytest.raises(ValueError, match=rf"Ensemble: member 0's attribute `{name}`"):
        vmapens.Ensemble(factory, n=2, backend=backend)


class ReadsThroughModule(nn.Module):
    """What the refusal points to: a reference to the module, read through its slots."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 3)
        self.layers = {"fc": self.fc}
        self.project = self.fc.forward
        self.act = torch.tanh
        self.fc.register_forward_hook(lambda m, args, out: out + m.weight.sum())

    def forward(self, x):
        return self.act(self.project(x)) + self.layers["fc"](x)


@pytest.mark.parametrize("backend", ["vmap", "loop"])
def test_attributes_reaching_a_member_tensor_through_its_module_equal_each_member_alone(backend):
    ens, alone = _members(ReadsThroughModule, backend=backend)
    x = torch.randn(5, 2, dtype=torch.float64)
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in alone]), **TOL)


class OptionalState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.bn = nn.LSTM(2, 3, batch_first=True), nn.BatchNorm1d(3)

    def forward(self, x, hx=None):
        if hx is not None and hx[1] is None:  # the cell state optional too
            hx = (hx[0], torch.zeros_like(hx[0]))
        out, _ = self.lstm(x, hx)
        return self.bn(out[:, -1])


@pytest.mark.parametrize("options", [{}, {"backend": "loop"}, {"chunk_size": 2}], ids=str)
def test_none_in_a_mapped_argument_is_shared_as_each_member_alone(options):
    # ens(x, None, in_dims=0), the LSTM's hx=None: vmap refused the None as a mapped input,
    # where the loop backend and chunks map nothing for it.
    ens, alone = _members(OptionalState, **options)
    x = torch.randn(N, 4, 5, 2, dtype=torch.float64)
    h = torch.randn(N, 1, 4, 3, dtype=torch.float64)
    expected = torch.stack([m(x[i], None) for i, m in enumerate(alone)])
    torch.testing.assert_close(ens(x, None, in_dims=0), expected, **TOL)
    expected = torch.stack([m(x[i], (h[i], None)) for i, m in enumerate(alone)])
    torch.testing.assert_close(ens(x, (h, None), in_dims=0), expected, **TOL)
    _same_buffers(ens, alone)


def test_a_hook_whose_closure_cell_is_empty_builds_and_fails_as_alone() -> None:
    # an empty closure cell holds no tensor: the build check must not trip on it
    def member() -> nn.Module:
        fc = nn.Linear(2, 2, dtype=torch.float64)
        later = 2.0

        def hook(module: nn.Module, args: object, out: torch.Tensor) -> torch.Tensor:
            return out * later  # noqa: F821  (deleted below: the cell is empty)

        fc.register_forward_hook(hook)
        del later  # the cell is empty now
        return fc

    alone = member()
    with pytest.raises(NameError):
        alone(torch.randn(3, 2, dtype=torch.float64))
    ens = vmapens.Ensemble(member, n=2, seed=0, backend="loop")
    with pytest.raises(NameError):
        ens(torch.randn(3, 2, dtype=torch.float64))
