"""User journey: real model classes written with Python beyond a plain ``forward``.

A researcher's own classes, stacked unchanged: a forward with ``*args``/``**kwargs`` and
keyword-only arguments with defaults (``ens(x, mask=m)``, docs/semantics.md "Inputs and
outputs": keyword inputs are shared); a ``@property`` computed from parameters; a
``functools.cached_property`` / ``hasattr`` lazy cache over a parameter-derived tensor (alone:
computed once, at the first forward, from that member's weights); ``functools.cache`` /
``lru_cache`` on a method; ``__getattr__`` forwarding (as HF wrappers do), a ``__setattr__``
that refuses new attributes, ``self.__class__.helper(self, x)``, static and class methods;
helpers decorated with ``torch.jit.ignore``, ``torch.compiler.disable``, ``torch.no_grad()``
and ``torch.autocast``; a forward that calls ``self.encode``, and ``encode`` called per member
outside the forward (``map_members``); ``zip`` over two ModuleLists, a generator over layers,
a ModuleList indexed by a number from the input's shape, a ModuleDict keyed by a string
input (``step((x, "b"), y)``); dict and dataclass outputs read by the loss.

The truth: each member as a plain module trained alone with ``torch.optim.Adam`` (SGD for the
autocast case) on the same batches, float64 unless said (batched kernels sum in other orders).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

import vmapens

N, B = 3, 5
F64 = torch.float64
TOL: dict[str, Any] = dict(rtol=1e-10, atol=1e-12)
BACKENDS = {"vmap": {}, "chunks": {"chunk_size": 2}, "loop": {"backend": "loop"}}


def _batches(count: int, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(B, 4, generator=g, dtype=F64), torch.randn(B, 2, generator=g, dtype=F64))
        for _ in range(count)
    ]


def _alone(
    models: list[nn.Module], data: list, loss: Any = F.mse_loss, *args: Any, **kw: Any
) -> None:
    """Each member trained alone with torch.optim.Adam: ``loss(m(x, *args, **kw), y)``."""
    for m in models:
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        for x, y in data:
            opt.zero_grad()
            loss(m(x, *args, **kw), y).backward()
            opt.step()


def _assert_members(ens: vmapens.Ensemble, alone: list[nn.Module]) -> None:
    for i, m in enumerate(alone):
        got, want = ens[i].state_dict(), m.state_dict()
        assert list(got) == list(want)
        for k in want:
            torch.testing.assert_close(got[k], want[k], **TOL, msg=f"member {i} {k}")


def _step_vs_alone(factory: Any, loss: Any = F.mse_loss, steps: int = 3, **ens_kw: Any) -> None:
    ens = vmapens.Ensemble(factory, n=N, seed=0, **ens_kw)
    alone, data = ens.unstack(), _batches(steps)
    step = vmapens.make_step(ens, loss, vmapens.StackedAdam(ens, lr=1e-2))
    for x, y in data:
        step(x, y)
    _alone(alone, data, loss)
    _assert_members(ens, alone)


# -- *args, **kwargs, keyword-only arguments with defaults -------------------------------------


class KwArgs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2).double()

    def forward(self, x: Tensor, *extra: Tensor, mask: Tensor | None = None, temp: float = 1.0,
                **opts: Any) -> Tensor:  # fmt: skip
        h = self.fc(x) / temp
        for e in extra:
            h = h + e
        if mask is not None:
            h = h * mask.unsqueeze(-1)
        return -h if opts.get("negate") else h


def test_varargs_and_keyword_only_defaults_train_as_alone() -> None:
    """The step's tuple of inputs fills ``*extra``; a hand-written loop passes shared keyword
    inputs (a mask, a temperature, a ``**opts`` flag) as ``ens(x, e, mask=m, ...)``."""
    g = torch.Generator().manual_seed(5)
    e = torch.randn(B, 2, generator=g, dtype=F64)
    m = (torch.arange(B) % 2).to(F64)
    data = _batches(3)
    ens = vmapens.Ensemble(KwArgs, n=N, seed=0)
    alone = ens.unstack()
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedAdam(ens, lr=1e-2))
    for x, y in data:
        step((x, e), y)
    _alone(alone, data, F.mse_loss, e)
    _assert_members(ens, alone)

    ens = vmapens.Ensemble(KwArgs, n=N, seed=0)
    alone = ens.unstack()
    opt, loss = vmapens.StackedAdam(ens, lr=1e-2), vmapens.per_member(F.mse_loss)
    for x, y in data:
        opt.zero_grad()
        loss(ens(x, e, mask=m, temp=2.0, negate=True), y).sum().backward()
        opt.step()
    _alone(alone, data, F.mse_loss, e, mask=m, temp=2.0, negate=True)
    _assert_members(ens, alone)


def test_a_per_member_mask_passed_positionally_is_each_members_own() -> None:
    g = torch.Generator().manual_seed(6)
    xs = torch.randn(N, B, 4, generator=g, dtype=F64)
    ms = torch.rand(N, B, generator=g, dtype=F64)
    ens = vmapens.Ensemble(lambda: MaskPos(), n=N, seed=0)
    want = torch.stack([m(xs[i], ms[i]) for i, m in enumerate(ens.unstack())])
    torch.testing.assert_close(ens(xs, ms, in_dims=0), want, **TOL)


class MaskPos(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2).double()

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        return self.fc(x) * mask.unsqueeze(-1) if mask is not None else self.fc(x)


def test_a_per_member_keyword_tensor_beside_mapped_inputs_warns() -> None:
    xs = torch.randn(N, B, 4, dtype=F64)
    ms = torch.rand(N, B, dtype=F64)
    ens = vmapens.Ensemble(MaskPos, n=N, seed=0)
    with pytest.warns(UserWarning, match=r"Ensemble: keyword argument `mask`.* in_dims=\(0, 0\)"):
        ens(xs, mask=ms, in_dims=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ens(xs, mask=torch.rand(B, dtype=F64), in_dims=0)  # B rows: shared, as meant
        ens(xs[0], mask=ms)  # nothing mapped, nothing mixed


# -- properties, cached properties, caches on methods ------------------------------------------


class Prop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2).double()
        self.raw = nn.Parameter(torch.randn(2, dtype=F64))

    @property
    def scale(self) -> Tensor:
        return F.softplus(self.raw)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x) * self.scale


def test_a_property_over_parameters_trains_and_a_loss_reading_it_on_the_template_is_refused() -> (
    None
):
    _step_vs_alone(Prop)
    ens = vmapens.Ensemble(Prop, n=N, seed=0)
    before = {k: v.clone() for k, v in ens.state_dict().items()}

    def loss(out: Tensor, y: Tensor) -> Tensor:  # alone: + model.scale.log().sum()
        return F.mse_loss(out, y) + 0.1 * ens.template.scale.log().sum()

    step = vmapens.make_step(ens, loss, vmapens.StackedAdam(ens, lr=1e-2))
    with pytest.raises(RuntimeError, match=r"`loss_fn` read a tensor of `ens.template`"):
        step(*_batches(1)[0])
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k


class Cached(nn.Module):
    """Row norms of the weight at the first forward: alone, each member's own, then fixed."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2).double()

    @functools.cached_property
    def ref(self) -> Tensor:
        with torch.no_grad():
            return self.fc.weight.norm(dim=1).clone()

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x) / self.ref


class Lazy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2).double()

    def forward(self, x: Tensor) -> Tensor:
        if not hasattr(self, "ref"):
            self.ref = self.fc.weight.detach().norm(dim=1).clone()
        return self.fc(x) / self.ref


@pytest.mark.parametrize("cls", [Cached, Lazy], ids=["cached_property", "hasattr"])
def test_a_lazy_cache_over_the_weights_trains_as_alone_under_vmap(cls: type) -> None:
    _step_vs_alone(cls)
    ens = vmapens.Ensemble(cls, n=N, seed=0)
    alone, data = ens.unstack(), _batches(3)
    opt, loss = vmapens.StackedAdam(ens, lr=1e-2), vmapens.per_member(F.mse_loss)
    for x, y in data:
        opt.zero_grad()
        loss(ens(x), y).sum().backward()
        opt.step()
    _alone(alone, data)
    _assert_members(ens, alone)


@pytest.mark.parametrize("how", [{"backend": "loop"}, {"chunk_size": 2}], ids=["loop", "chunks"])
@pytest.mark.parametrize("cls", [Cached, Lazy], ids=["cached_property", "hasattr"])
def test_a_lazy_cache_over_the_weights_trains_as_alone_with_members_in_turns(
    cls: type, how: dict
) -> None:
    """An attribute the first call adds (cached_property, `if not hasattr`) is stacked on the
    template, and every later call hands each turn its members' rows: the checked step
    trains as alone. Until session 44 the first step refused it, naming `ref`; unchecked,
    the chunks read the last chunk's norms (members off after 3 steps)."""
    ens = vmapens.Ensemble(cls, n=N, seed=0, **how)
    alone, data = ens.unstack(), _batches(3)
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedAdam(ens, lr=1e-2))
    for x, y in data:
        step(x, y)
    _alone(alone, data)
    _assert_members(ens, alone)


class PosCache(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2).double()

    @functools.lru_cache(maxsize=8)  # noqa: B019 - the user's code
    def pos(self, rows: int) -> Tensor:
        return torch.linspace(0, 1, rows, dtype=F64)[:, None]

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x) + self.pos(x.shape[0])


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_an_lru_cache_without_member_tensors_trains_as_alone(backend: str) -> None:
    _step_vs_alone(PosCache, **BACKENDS[backend])


class FreqCache(nn.Module):
    """A table cached per module from a per-member buffer (random frequencies)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2).double()
        self.register_buffer("freq", torch.randn(2, dtype=F64))

    @functools.cache  # noqa: B019 - the user's code
    def table(self, rows: int) -> Tensor:
        return torch.cos(torch.arange(rows, dtype=F64)[:, None] * self.freq)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x) + self.table(x.shape[0])


@pytest.mark.xfail(
    strict=True,
    reason="functools.cache on a method is keyed on `self`: members run in turns on one "
    "module share member 0's table (0.05 off after 3 steps), and the self-check, which runs "
    "each member on a module of its own, does not see it. No patch (see the report)",
)
@pytest.mark.parametrize("backend", ["chunks", "loop"])
def test_a_method_cache_over_a_member_buffer_is_each_members_own_in_turns(backend: str) -> None:
    _step_vs_alone(FreqCache, **BACKENDS[backend])


# -- attribute protocols, dispatch through the class, static and class methods -----------------


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2).double()
        self.gain = nn.Parameter(torch.ones(2, dtype=F64))

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x) * self.gain


class Forwarding(nn.Module):
    """HF-style: unknown attributes forwarded to the wrapped model."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Inner()
        self.head = nn.Linear(2, 2).double()

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.model, name)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.model(x)) + self.fc.bias * self.gain  # both through __getattr__


class ConfigLike(nn.Module):
    """Unknown public names read as None (a config object's defaults)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2).double()

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_"):
                raise
            return None

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        return h if self.dropout_rate is None else h * 0


class Frozen(nn.Module):
    """Refuses new attributes once built."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2).double()
        self._frozen = True

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_frozen", False) and not hasattr(self, name):
            raise AttributeError(f"{type(self).__name__} is frozen: cannot add `{name}`")
        super().__setattr__(name, value)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x)


class Dispatch(nn.Module):
    SCALE = 0.5

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2).double()

    def helper(self, x: Tensor) -> Tensor:
        return torch.tanh(self.fc(x))

    @staticmethod
    def act(h: Tensor) -> Tensor:
        return h * torch.sigmoid(h)

    @classmethod
    def scale(cls) -> float:
        return cls.SCALE

    def forward(self, x: Tensor) -> Tensor:
        h = self.act(self.__class__.helper(self, x)) * self.scale()
        return h + type(self).helper(self, x)


@pytest.mark.parametrize("backend", ["vmap", "loop"])
@pytest.mark.parametrize("cls", [Forwarding, ConfigLike, Frozen, Dispatch])
def test_attribute_protocols_and_class_dispatch_train_as_alone(cls: type, backend: str) -> None:
    _step_vs_alone(cls, **BACKENDS[backend])


# -- decorated helpers ----------------------------------------------------------------------


class Decorated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3).double()
        self.out = nn.Linear(3, 2).double()
        self.register_buffer("ema", torch.zeros(3, dtype=F64))

    @torch.jit.ignore
    def squash(self, h: Tensor) -> Tensor:
        return torch.tanh(h)

    @torch.compiler.disable
    def swish(self, h: Tensor) -> Tensor:
        return h * torch.sigmoid(h)

    @torch.no_grad()
    def track(self, h: Tensor) -> Tensor:  # an EMA of the features, and a norm with no graph
        self.ema.mul_(0.9).add_(0.1 * h.mean(0))
        return self.fc.weight.norm()

    def forward(self, x: Tensor) -> Tensor:
        h = self.squash(self.fc(x))
        return self.out(self.swish(h)) / self.track(h)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_helpers_under_jit_ignore_compiler_disable_and_no_grad_train_as_alone(
    backend: str,
) -> None:
    _step_vs_alone(Decorated, **BACKENDS[backend])  # the EMA buffer compared too


class AutocastHelper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(4, 8), nn.Linear(8, 2)

    @torch.autocast("cpu")  # bf16 on CPU, for this helper only
    def body(self, x: Tensor) -> Tensor:
        return torch.relu(self.fc(x))

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.body(x).float())


def test_an_autocast_decorated_helper_is_refused_under_vmap_and_exact_in_turns() -> None:
    """vmapens applies autocast's policy per member when the autocast is around the call
    (docs/semantics.md, "Mixed precision"); one entered inside the forward is torch's own,
    below vmap: the first step refuses it, nothing changed; ``backend="loop"`` is exact."""
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(B, 4, generator=g), torch.randn(B, 2, generator=g)
    ens = vmapens.Ensemble(AutocastHelper, n=N, seed=0)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedSGD(ens, lr=0.1))
    with pytest.raises(RuntimeError, match="computes something else inside the ensemble") as err:
        step(x, y)
    assert "torch.autocast entered in the forward" in str(err.value)  # the likely cause named
    assert "precision=" in str(err.value) and "backend='loop'" in str(err.value)
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k

    ens = vmapens.Ensemble(AutocastHelper, n=N, seed=0, backend="loop")
    alone = ens.unstack()
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedSGD(ens, lr=0.1))
    for _ in range(2):
        step(x, y)
    for m in alone:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            F.mse_loss(m(x), y).backward()
            opt.step()
    for i, m in enumerate(alone):
        for k, v in m.state_dict().items():
            torch.testing.assert_close(ens[i].state_dict()[k], v, rtol=0, atol=0)


class AutocastInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 8)

    def forward(self, x: Tensor) -> Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.fc(x)


@pytest.mark.xfail(
    strict=True,
    reason="an autocast entered inside the forward is not given vmapens's per-member policy: "
    "ens(x) returns float32 where each member alone returns bf16 (an autocast-decorated "
    "helper: values 2e-3 off), silently (the step refuses it, naming autocast in the forward). "
    "No patch (see the report)",
)
def test_ens_of_a_forward_that_enters_autocast_equals_the_members_alone() -> None:
    x = torch.randn(B, 4)
    ens = vmapens.Ensemble(AutocastInside, n=N, seed=0)
    with torch.no_grad():
        got = ens(x)
        want = torch.stack([m(x) for m in ens.unstack()])
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, want)


# -- methods besides forward, loops over layers, string inputs, dict and dataclass outputs -----


class Multi(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4).double() for _ in range(2)])
        self.norms = nn.ModuleList([nn.LayerNorm(4).double() for _ in range(2)])
        self.heads = nn.ModuleList([nn.Linear(4, 2).double() for _ in range(3)])
        self.tasks = nn.ModuleDict({"a": nn.Linear(4, 2).double(), "b": nn.Linear(4, 2).double()})

    def encode(self, x: Tensor) -> Tensor:
        h = x
        for layer, norm in zip(self.layers, self.norms, strict=True):
            h = norm(torch.tanh(layer(h)))
        return h

    def weights(self) -> Any:
        yield from (layer.weight for layer in self.layers)

    def forward(self, x: Tensor, task: str = "a") -> dict[str, Tensor]:
        h = self.encode(x)
        head = self.heads[x.shape[0] % len(self.heads)]  # picked by the batch's size
        return {
            "pred": head(h) + self.tasks[task](h),
            "l2": sum(w.pow(2).sum() for w in self.weights()),
        }


def _dict_loss(out: dict[str, Tensor], y: Tensor) -> Tensor:
    return F.mse_loss(out["pred"], y) + 1e-3 * out["l2"]


def test_layer_loops_a_string_task_input_and_a_dict_output_train_as_alone() -> None:
    data = _batches(3) + [(x[:4], y[:4]) for x, y in _batches(2, seed=1)]  # two head indices
    ens = vmapens.Ensemble(Multi, n=N, seed=0)
    alone = ens.unstack()
    step = vmapens.make_step(ens, _dict_loss, vmapens.StackedAdam(ens, lr=1e-2))
    for x, y in data:
        step((x, "b"), y)
    _alone(alone, data, _dict_loss, "b")
    _assert_members(ens, alone)


class Call(nn.Module):
    """Calls one method of ``module`` (functional_call runs ``forward`` only)."""

    def __init__(self, module: nn.Module, method: str) -> None:
        super().__init__()
        self.m, self.method = module, method

    def forward(self, *args: Any) -> Any:
        return getattr(self.m, self.method)(*args)


def test_encode_called_for_every_member_through_map_members() -> None:
    """``ens.map_members`` with ``functional_call`` of a wrapper that calls ``encode``:
    each member's own features, and their gradients reach each member's stacked rows."""
    x = torch.randn(B, 4, dtype=F64)
    ens = vmapens.Ensemble(Multi, n=N, seed=0)
    alone = ens.unstack()
    enc = Call(ens.runner, "encode")
    got = ens.map_members(
        lambda s, x: functional_call(enc, {f"m.{k}": v for k, v in s.items()}, (x,)), x
    )
    want = torch.stack([m.encode(x) for m in alone])
    torch.testing.assert_close(got, want, **TOL)
    got.pow(2).sum().backward()
    want.pow(2).sum().backward()
    for i, m in enumerate(alone):
        torch.testing.assert_close(ens.stacked_params()["layers.0.weight"].grad[i],
                                   m.layers[0].weight.grad, **TOL)  # fmt: skip


@pytest.mark.xfail(
    strict=True,
    reason="ens.template.encode(x) fails with torch's bare 'Tensor on device meta is not on "
    "the expected device cpu!', naming neither the template nor the way to run a method per "
    "member (map_members). No patch",
)
def test_calling_a_method_of_the_template_says_what_to_do() -> None:
    ens = vmapens.Ensemble(Multi, n=N, seed=0)
    with pytest.raises(RuntimeError, match="ens.template"):
        ens.template.encode(torch.randn(B, 4, dtype=F64))


@dataclasses.dataclass
class Out:
    pred: Tensor
    aux: Tensor


class DataOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2).double()

    def forward(self, x: Tensor) -> Out:
        p = self.fc(x)
        return Out(p, p.pow(2).mean())


def _fields_loss(out: Out, y: Tensor) -> Tensor:
    return F.mse_loss(out.pred, y) + 0.1 * out.aux


def test_a_dataclass_output_is_refused_by_ens_naming_what_to_return() -> None:
    ens = vmapens.Ensemble(DataOut, n=N, seed=0)
    with pytest.raises(RuntimeError, match="returns something other than tensors"):
        ens(torch.randn(B, 4, dtype=F64))


@pytest.mark.parametrize("backend", ["vmap", "loop"])
def test_a_dataclass_output_read_by_the_loss_trains_as_alone(backend: str) -> None:
    """The self-check compared the dataclass with == and raised functorch's 'your tensor may
    have escaped' (check=False trained as alone) until patch pythonic-2."""
    _step_vs_alone(DataOut, _fields_loss, **BACKENDS[backend])
