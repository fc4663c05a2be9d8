"""What members share besides their tensors: classes, settings, tensors kept as attributes.

One forward runs every member with one template module, so a member whose non-tensor state
differs from member 0's (a per-member dropout rate, a random projection kept as a plain
attribute, another activation) would silently run as member 0. Building must refuse it,
naming the member, the attribute and both values; what members do share must run exactly as
each member alone. ``Ensemble.apply`` must refuse what it cannot carry over (a swapped
submodule, a function-valued attribute, a hook), and work on members of different sizes.

The truth is each member built alone by the documented recipe
(``torch.manual_seed(member_seed(seed, i)); factory()``, the seed written again in
``truth.derived_seed``) or the modules passed in, run alone in plain torch, in float64.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize
from truth import TOL64, derived_seed

import vmapens

N = 3


pytestmark = pytest.mark.usefixtures("float64_default")


def alone(factory: Callable[[], nn.Module], n: int = N, seed: int = 0) -> list[nn.Module]:
    """Member i as the user builds it alone, by the documented recipe."""
    members = []
    for i in range(n):
        torch.manual_seed(derived_seed(seed, "member", i))
        members.append(factory())
    return members


def assert_runs_as_alone(
    ens: vmapens.Ensemble, members: list[nn.Module], x: torch.Tensor, indexed: bool = True
) -> None:
    """Outputs, gradients and (``indexed``) ``ens[i]`` equal each member alone."""
    out = ens(x)
    ref = torch.stack([m(x) for m in members])
    torch.testing.assert_close(out, ref, **TOL64)
    out.pow(2).sum().backward()
    ref.pow(2).sum().backward()
    for name, p in ens.stacked_params().items():
        grads = [dict(m.named_parameters())[name].grad for m in members]
        if p.requires_grad:  # padded members: their own corner, zeros around it
            for row, g in zip(p.grad, grads, strict=True):
                corner = row[tuple(slice(0, k) for k in g.shape)]
                torch.testing.assert_close(corner, g, **TOL64, msg=name)
                assert corner.abs().sum() == row.abs().sum(), name
        else:
            assert p.grad is None and grads == [None] * len(members), name
    for i, m in enumerate(members if indexed else []):
        with torch.no_grad():
            torch.testing.assert_close(ens[i](x), m(x), **TOL64)
        # a parametrized module has a class of its own, as alone (torch makes one per module)
        mine, template = type(ens[i]), type(ens.template)
        assert mine is template or (mine.__name__, mine.__bases__) == (
            template.__name__,
            template.__bases__,
        )


# -- settings members must share --------------------------------------------------------------


class RFF(nn.Module):
    """Random Fourier features: a fixed random projection kept as a plain attribute."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.B = torch.randn(3, 8, generator=generator)  # neither parameter nor buffer
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = x @ self.B
        return self.head(torch.cat([z.sin(), z.cos()], -1))


class RFFBuffer(RFF):
    """The way out: the projection as a buffer, stacked per member."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("B", self.__dict__.pop("B"))


def _drawn(values: list) -> Callable[[], Callable[[], object]]:
    """A factory of factories whose member i draws ``values[i]`` (a per-member sweep)."""

    def make() -> Callable[[], object]:
        it = iter(values)
        return lambda: next(it)

    return make


def _dropout(p: Callable[[], object]) -> nn.Module:
    return nn.Sequential(nn.Linear(3, 3), nn.Dropout(p()))  # type: ignore[arg-type]


def _activation(cls: Callable[[], object]) -> nn.Module:
    return nn.Sequential(nn.Linear(3, 3), cls()())  # type: ignore[operator]


def _encoder(act: Callable[[], object]) -> nn.Module:
    return nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, activation=act())  # type: ignore[arg-type]


class Scaled(nn.Module):
    """A function attribute made in ``__init__`` whose closure holds a per-member value."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 1)
        self.act = lambda x: x * scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


def _scaled(scale: Callable[[], object]) -> nn.Module:
    return Scaled(scale())  # type: ignore[arg-type]


# (id, member builder taking a per-member draw, the draws, the error it must name)
DIFFERENT = [
    ("tensor-attribute", lambda _: RFF(), None,
     r"member 1 differs from member 0 at RFF: `B` is a tensor of shape \(3, 8\).* vs a tensor "
     r".*register it as a buffer \(self\.register_buffer\('B'"),
    ("dropout-rate", _dropout, [0.0, 0.9, 0.9],
     r"member 1 differs from member 0 at `1` \(Dropout\): `p` is 0\.9 vs 0\.0; .*per-member "
     r"hyperparameter"),
    ("activation-class", _activation, [nn.Tanh, nn.ReLU, nn.ReLU],
     r"member 1 (has a ReLU at `1` where member 0 has a Tanh|has another structure than member "
     r"0 at `1` \(ReLU vs Tanh\))"),
    ("activation-function", _encoder, ["relu", "gelu", "gelu"],
     r"member 1 differs from member 0 at TransformerEncoderLayer: `activation` is gelu vs relu"),
    ("closure-value", _scaled, [1.0, 2.0, 2.0], r"member 1 differs from member 0 at Scaled: `act`"),
]  # fmt: skip


def _factory(build: Callable, draws: list | None) -> Callable[[], nn.Module]:
    take = _drawn(draws or [None] * N)()
    return functools.partial(build, take)


@pytest.mark.parametrize(
    ("build", "draws", "match"), [d[1:] for d in DIFFERENT], ids=[d[0] for d in DIFFERENT]
)
@pytest.mark.parametrize("api", ["Ensemble", "from_modules", "from_factories"])
def test_members_whose_settings_differ_are_refused(api, build, draws, match):
    rng = torch.get_rng_state()
    with pytest.raises(ValueError, match=match):
        if api == "Ensemble":
            vmapens.Ensemble(_factory(build, draws), N, seed=0)
        elif api == "from_modules":
            vmapens.Ensemble.from_modules(alone(_factory(build, draws)))
        else:
            factory = _factory(build, draws)
            vmapens.Ensemble.from_factories([factory] * N, seed=0)
    if api != "from_modules":
        assert torch.equal(torch.get_rng_state(), rng)  # a refused build leaves the RNG alone


def test_the_way_out_a_buffer_runs_each_member_with_its_own_projection():
    ens = vmapens.Ensemble(RFFBuffer, N, seed=0)
    members = alone(RFFBuffer)
    assert not torch.equal(members[0].B, members[1].B)
    assert_runs_as_alone(ens, members, torch.randn(5, 3))


class Shared(nn.Module):
    """What members may hold besides tensors, equal in all: a tensor attribute drawn from
    its own fixed generator, a lambda and a bound method made in ``__init__``, a config
    object without ``__eq__``, a list of settings, a NaN."""

    class Config:
        def __init__(self) -> None:
            self.width, self.names = 4, ["a", "b"]

    def __init__(self) -> None:
        super().__init__()
        self.B = torch.randn(3, 4, generator=torch.Generator().manual_seed(7))
        self.fc = nn.Linear(4, 2)
        self.act = lambda x: torch.tanh(x) * self.fc.out_features
        self.post = self._post
        self.config, self.sizes, self.missing = Shared.Config(), [4, 2], float("nan")

    def _post(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.config.width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.act(self.fc(x @ self.B)))


@pytest.mark.parametrize("backend", ["vmap", "loop"])
def test_members_that_share_their_settings_run_as_alone(backend):
    x = torch.randn(5, 3)
    assert_runs_as_alone(vmapens.Ensemble(Shared, N, seed=0, backend=backend), alone(Shared), x)
    members = alone(Shared, seed=1)
    assert_runs_as_alone(vmapens.Ensemble.from_modules(members, backend=backend), members, x)


def test_a_tensor_a_hook_recomputes_before_every_forward_is_not_compared():
    """``torch.nn.utils.spectral_norm`` keeps ``weight`` as a plain tensor that its forward
    pre-hook recomputes from the member's own parameters and buffers (vmap cannot batch its
    power iteration: ``backend="loop"``)."""

    def factory() -> nn.Module:
        return nn.utils.spectral_norm(nn.Linear(3, 2))

    ens = vmapens.Ensemble(factory, N, seed=0, backend="loop")
    members = alone(factory)
    assert not torch.equal(members[0].weight, members[1].weight)
    assert_runs_as_alone(ens, members, torch.randn(5, 3), indexed=False)


class Widths(nn.Module):
    def __init__(self, hidden: int, scale: int) -> None:
        super().__init__()
        self.hidden, self.scale = hidden, scale
        self.net = nn.Sequential(nn.Linear(3, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.scale


def test_members_of_one_size_must_share_their_int_settings():
    """Sizes may differ between sizes; member 1 (width 4 like member 0) with another int
    setting would run as the largest member, and the self-check only runs member 0."""
    factories = [functools.partial(Widths, h, s) for h, s in ((4, 1), (4, 2), (8, 1))]
    with pytest.raises(ValueError, match=r"member 1 differs from member 0 at Widths: `scale` is 2"):
        vmapens.Ensemble.from_factories(factories, seed=0)
    ok = [functools.partial(Widths, h, 1) for h in (4, 4, 8)]
    vmapens.Ensemble.from_factories(ok, seed=0)


class WideRFF(RFF):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.head = nn.Sequential(nn.Linear(16, hidden), nn.Tanh(), nn.Linear(hidden, 1))


def test_a_tensor_attribute_that_differs_between_sizes_is_refused():
    """Padded members run as the largest one: its projection would replace the others'."""
    factories = [functools.partial(WideRFF, h) for h in (4, 8)]
    with pytest.raises(ValueError, match=r"member 1 differs from member 0 at WideRFF: `B` is a"):
        vmapens.Ensemble.from_factories(factories, seed=0)


# -- apply ------------------------------------------------------------------------------------


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


def _swap(m: nn.Module) -> None:
    if isinstance(m, nn.Sequential):
        m[1] = nn.Sigmoid()


def _gelu(m: nn.Module) -> None:
    if isinstance(m, nn.TransformerEncoderLayer):
        m.activation = nn.functional.gelu


def _hook(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        m.register_forward_hook(lambda *_: None)


def _scale_b(m: nn.Module) -> None:
    if isinstance(m, RFF):
        m.B.mul_(2)


def _encoder_relu() -> nn.Module:
    return nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0)


def _fixed_rff() -> nn.Module:
    return RFF(torch.Generator().manual_seed(0))


# (id, factory, fn, the error it must name)
APPLY_REFUSED = [
    ("submodule-class", _mlp, _swap, r"`fn` replaced `1` \(Tanh -> Sigmoid\)"),
    ("function-attribute", _encoder_relu, _gelu, r"`fn` changed `activation` \(relu -> gelu\)"),
    ("hook", _mlp, _hook, r"`fn` registered or removed a hook on `0`"),
    ("tensor-attribute-in-place", _fixed_rff, _scale_b, r"`fn` changed `B` \(a tensor"),
    ("parametrization", _mlp,
     lambda m: parametrizations.weight_norm(m) if isinstance(m, nn.Linear) else None,
     r"`fn` replaced `0` \(Linear -> Linear with parametrized weight\)"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("factory", "fn", "match"), [r[1:] for r in APPLY_REFUSED], ids=[r[0] for r in APPLY_REFUSED]
)
def test_apply_refuses_what_it_cannot_carry_and_changes_nothing(factory, fn, match):
    ens = vmapens.Ensemble(factory, N, seed=0)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    template = repr(ens.template)
    init = lambda m: nn.init.zeros_(m.bias) if isinstance(m, nn.Linear) else None  # noqa: E731
    with pytest.raises(ValueError, match=match):
        ens.apply(lambda m: (init(m), fn(m)))
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert repr(ens.template) == template and repr(ens[0]) == template
    x = torch.randn(2, 5, 8) if factory is _encoder_relu else torch.randn(5, 3)
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in alone(factory)]), **TOL64)


class MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(3, hidden), nn.BatchNorm1d(hidden), nn.Sigmoid(), nn.Linear(hidden, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _init(m: nn.Module) -> None:
    """A custom initialisation drawing from the global RNG, and a frozen, eval-mode norm."""
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, std=0.5)
        nn.init.uniform_(m.bias)
    if isinstance(m, nn.BatchNorm1d):
        m.eval()
        m.weight.requires_grad_(False)


@pytest.mark.parametrize("widths", [(4, 8, 4), (8, 8, 8)], ids=["sizes-differ", "one-size"])
def test_apply_on_members_of_different_sizes_matches_each_member_alone(widths):
    factories = [functools.partial(MLP, h) for h in widths]
    ens = vmapens.Ensemble.from_factories(factories, seed=0)
    members = []
    for i, factory in enumerate(factories):
        torch.manual_seed(derived_seed(0, "member", i))
        members.append(factory())
    torch.manual_seed(5)
    assert ens.apply(_init) is ens
    torch.manual_seed(5)
    for m in members:  # in member order, one RNG: as the docs say
        m.apply(_init)
    for i, m in enumerate(members):
        ours = ens[i].state_dict()
        for k, v in m.state_dict().items():
            torch.testing.assert_close(ours[k], v, rtol=0, atol=0, msg=k)
        assert not ens[i].net[1].training and not ens[i].net[1].weight.requires_grad
    assert_runs_as_alone(ens, members, torch.randn(6, 3))
    ens.apply(lambda m: None)  # a no-op is a no-op


# -- parametrized modules ---------------------------------------------------------------------


def _weight_norm() -> nn.Module:
    return parametrizations.weight_norm(nn.Linear(4, 3))


def _orthogonal() -> nn.Module:
    return nn.Sequential(parametrizations.orthogonal(nn.Linear(4, 4)), nn.Tanh())


@pytest.mark.parametrize("factory", [_weight_norm, _orthogonal], ids=["weight_norm", "orthogonal"])
@pytest.mark.parametrize("backend", ["vmap", "loop"])
@pytest.mark.parametrize("api", ["Ensemble", "from_modules"])
def test_parametrized_members_run_as_alone(api, backend, factory):
    """``parametrize`` gives every parametrized module a class of its own; members
    parametrized alike are one class for the ensemble."""
    members = alone(factory)
    assert type(members[0]) is not type(members[1]) or factory is _orthogonal
    if api == "Ensemble":
        ens = vmapens.Ensemble(factory, N, seed=0, backend=backend)
    else:
        ens = vmapens.Ensemble.from_modules(members, backend=backend)
    assert_runs_as_alone(ens, members, torch.randn(5, 4))


def _bias_parametrized() -> nn.Module:
    layer = nn.Linear(4, 3)
    parametrize.register_parametrization(layer, "bias", nn.Identity())
    return layer


@pytest.mark.parametrize(
    ("modules", "match"),
    [
        ([_weight_norm, _bias_parametrized],
         r"member 1 is a Linear with parametrized bias, member 0 is a Linear with parametrized "
         r"weight"),
        ([_weight_norm, lambda: nn.Linear(4, 3)],
         r"member 1 is a Linear, member 0 is a Linear with parametrized weight"),
    ],
    ids=["other-tensor", "unparametrized"],
)  # fmt: skip
def test_members_parametrized_differently_are_refused_by_name(modules, match):
    with pytest.raises(ValueError, match=match):
        vmapens.Ensemble.from_modules([m() for m in modules])


def test_a_parametrized_layer_whose_size_differs_is_refused():
    """Its tensor is computed from the padded originals: weight_norm divides padded zeros by
    their zero norm (NaN)."""

    def net(h: int) -> nn.Module:
        return nn.Sequential(parametrizations.weight_norm(nn.Linear(3, h)), nn.Linear(h, 1))

    with pytest.raises(ValueError, match=r"`0` \(ParametrizedLinear\) computes its parametrized"):
        vmapens.Ensemble.from_factories([functools.partial(net, h) for h in (4, 8)], seed=0)


# -- extra state ------------------------------------------------------------------------------


class WithExtra(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(3, 2)
        self.version = 1

    def get_extra_state(self) -> dict:
        return {"version": self.version}

    def set_extra_state(self, state: dict) -> None:
        self.version = state["version"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


@pytest.mark.parametrize(
    "build",
    [
        lambda: vmapens.Ensemble(WithExtra, N, seed=0),
        lambda: vmapens.Ensemble(lambda: nn.Sequential(WithExtra()), N, seed=0),
        lambda: vmapens.Ensemble.from_modules([WithExtra() for _ in range(N)]),
        lambda: vmapens.Ensemble.from_factories([WithExtra] * N, seed=0),
    ],
    ids=["root", "submodule", "from_modules", "from_factories"],
)
def test_a_member_with_extra_state_is_refused_clearly(build):
    with pytest.raises(ValueError, match=r"WithExtra\)? has extra state \(it defines get_extra"):
        build()
