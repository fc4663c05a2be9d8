"""Functions a member holds that close over its own modules (a lambda attribute set in
``__init__``, a hook lambda, one in a list, a ``functools.partial``), against each member
built by the factory (so each function closes over its own module) and trained alone with
``torch.optim`` (float64).

Found by the hunt (silent before): the ensemble runs copies of member 0 (its template, the
module it runs, ``ens[i]``, ``select``), and ``copy.deepcopy`` does not copy functions: the
copy's ``self.scale = lambda o: o * self.gain`` kept reading member 0's ORIGINAL, untrained
``gain`` for every member (members up to ~0.07 off after three SGD steps), and a hook closing
over the member's modules was refused. The copies now rebind such functions to the copy's
modules; what else they hold (a shared list) stays the same object.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn
from truth import float64_batches, seeded_members

import vmapens
from vmapens._copies import copy_member

pytestmark = pytest.mark.usefixtures("float64_default")

N = 3
SHARED: list[int] = []  # a shared object a closure also holds: never copied


def _scaled(module: nn.Module, o: torch.Tensor) -> torch.Tensor:
    return o * module.gain


class LambdaAttr(nn.Module):
    """The repro: a plain function attribute closing over the member itself."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.gain = nn.Parameter(torch.rand(2) + 0.5)
        self.scale = lambda o: o * self.gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(self.fc(x))


class Submodule(nn.Module):
    """A lambda over a submodule, one over the member that also holds a shared list, and a
    default argument holding a submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.fc2 = nn.Linear(3, 4), nn.Linear(4, 2)
        seen = SHARED
        self.head = lambda o: self.fc2(o) * (1 + 0 * len(seen))
        self.first = lambda o: torch.tanh(self.fc(o))
        self.shift = lambda o, m=self.fc2: o + m.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shift(self.head(self.first(x)))


class Partial(nn.Module):
    """``functools.partial(fn, self)`` and a bound method (deepcopy copies both already)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.gain = nn.Parameter(torch.rand(2) + 0.5)
        self.scale = functools.partial(_scaled, self)
        self.bound = self._shift

    def _shift(self, o: torch.Tensor) -> torch.Tensor:
        return o + self.gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bound(self.scale(self.fc(x)))


class HookClosure(nn.Module):
    """Hooks closing over the member and its submodule (refused before)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.fc2 = nn.Linear(3, 4), nn.Linear(4, 2)
        self.gain = nn.Parameter(torch.rand(2) + 0.5)
        fc2 = self.fc2
        self.fc.register_forward_hook(lambda m, args, out: out * fc2.bias.sum())
        self.fc2.register_forward_pre_hook(lambda m, args: (args[0] * self.gain.mean(),))
        self.register_forward_hook(lambda m, args, out: out * self.gain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc(x))


class InList(nn.Module):
    """Lambdas over the member kept in a list: refused as members "differing" (the settings'
    comparison reached their cells past its depth and compared them by identity)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.gain = nn.Parameter(torch.rand(2) + 0.5)
        self.steps = [lambda o: torch.tanh(self.fc(o)), lambda o: o * self.gain]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for step in self.steps:
            x = step(x)
        return x


CLASSES = [LambdaAttr, Submodule, Partial, HookClosure, InList]
BATCHES = float64_batches(3, 5, 3, 2)


def _train_alone(models: list[nn.Module]) -> None:
    for m in models:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for x, y in BATCHES:
            opt.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()


def _check(
    ens: vmapens.Ensemble, alone: list[nn.Module], tmp_path=None, factory=None, whole=True
) -> None:
    step = vmapens.make_step(ens, nn.functional.mse_loss, vmapens.StackedSGD(ens, lr=0.1))
    for x, y in BATCHES:
        step(x, y)
    _train_alone(alone)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(5))
    wholes = [ens.state_dict()] if whole else []  # padded: its own size is in state_dicts
    if tmp_path is not None:
        vmapens.save(ens, tmp_path / "ens.pt")
        wholes.append(vmapens.load(tmp_path / "ens.pt", factory).state_dict())
    with torch.no_grad():
        batched = ens(x)
    for i, m in enumerate(alone):
        want, out = m.state_dict(), m(x).detach()
        members = [ens[i], ens.unstack()[i], ens.select([i])[0]]
        for got in [*(k.state_dict() for k in members), ens.state_dicts()[i]]:
            assert list(got) == list(want)
            for k in want:
                torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-12, msg=k)
        for whole in wholes:
            for k in want:
                torch.testing.assert_close(whole[k][i], want[k], rtol=0, atol=1e-12, msg=k)
        with torch.no_grad():
            for got in [batched[i], *(k(x) for k in members)]:
                torch.testing.assert_close(got, out, rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", ["vmap", "loop"])
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_from_modules_trains_as_each_alone(cls, backend, tmp_path):
    mods = seeded_members(cls, N)
    ens = vmapens.Ensemble.from_modules(mods, backend=backend)
    _check(ens, seeded_members(cls, N), tmp_path, cls)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_seeded_ensemble_trains_as_each_alone(cls):
    ens = vmapens.Ensemble(cls, n=N, seeds=range(N))
    _check(ens, seeded_members(cls, N))


def test_the_members_given_are_not_changed():
    mods = seeded_members(LambdaAttr, N)
    before = [m.scale for m in mods]
    ens = vmapens.Ensemble.from_modules(mods)
    step = vmapens.make_step(ens, nn.functional.mse_loss, vmapens.StackedSGD(ens, lr=0.1))
    step(*BATCHES[0])
    fresh = seeded_members(LambdaAttr, N)
    for m, f, fn in zip(mods, fresh, before, strict=True):
        assert m.scale is fn
        x = BATCHES[1][0]
        torch.testing.assert_close(m(x), f(x), rtol=0, atol=0)


def test_copy_member_rebinds_only_the_members_modules():
    torch.manual_seed(0)
    m = Submodule()
    inner = lambda o: m.fc2(o)  # noqa: E731
    m.nested = [{"f": lambda o: inner(o)}]  # in containers, through another function
    m.fc.register_forward_hook(lambda mod, args, out: out + 0 * len(SHARED))
    c = copy_member(m)
    cells = {type(v.cell_contents).__name__: v.cell_contents for v in c.head.__closure__}
    assert cells["Submodule"] is c and cells["list"] is SHARED  # the shared list: the same
    assert c.first.__closure__[0].cell_contents is c
    assert c.shift.__defaults__[0] is c.fc2
    nested = c.nested[0]["f"].__closure__[0].cell_contents
    assert nested is not inner and nested.__closure__[0].cell_contents is c
    hook = next(iter(c.fc._forward_hooks.values()))
    assert hook is next(iter(m.fc._forward_hooks.values()))  # holds no module: the same
    assert m.first.__closure__[0].cell_contents is m  # the original keeps its own
    x = torch.randn(2, 3)
    torch.testing.assert_close(c(x), m(x), rtol=0, atol=0)
    with torch.no_grad():
        c.fc2.bias.add_(1.0)
    assert not torch.equal(c(x), m(x))  # the copy reads its own tensors
    torch.testing.assert_close(
        c.nested[0]["f"](x[:, :1].expand(2, 4)), c.fc2(x[:, :1].expand(2, 4))
    )


def test_a_closure_over_the_members_tensor_is_still_refused():
    class TensorClosure(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 2)
            w = self.fc.weight
            self.fc.register_forward_hook(lambda m, args, out: out + w.sum())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)

    with pytest.raises(ValueError, match=r"fc._forward_hooks.*holds its tensor `fc.weight`"):
        vmapens.Ensemble(TensorClosure, n=N, seed=0)


def test_a_closure_setting_keeps_reading_the_setting():
    class Setting(nn.Module):  # tests/test_member_settings.py's case: reads a setting only
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 2)
            self.act = lambda x: torch.tanh(x) * self.fc.out_features

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.act(self.fc(x))

    ens = vmapens.Ensemble.from_modules(seeded_members(Setting, N))
    _check(ens, seeded_members(Setting, N))


class Wide(nn.Module):
    """``LambdaAttr`` at a width of its own (members of different sizes are padded)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc, self.fc2 = nn.Linear(3, hidden), nn.Linear(hidden, 2)
        self.gain = nn.Parameter(torch.rand(2) + 0.5)
        self.scale = lambda o: self.fc2(torch.tanh(self.fc(o))) * self.gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(x)


def test_members_of_different_sizes_train_as_each_alone():
    factories = [functools.partial(Wide, h) for h in (2, 4, 3)]
    ens = vmapens.Ensemble.from_factories(factories, seeds=range(N))
    alone = []
    for k, f in enumerate(factories):
        torch.manual_seed(k)
        alone.append(f())
    _check(ens, alone, whole=False)


@pytest.mark.parametrize("backend", ["vmap", "loop"])
def test_a_deep_copied_ensemble_trains_as_each_alone(backend):
    ens = vmapens.Ensemble.from_modules(seeded_members(HookClosure, N), backend=backend)
    twin = copy.deepcopy(ens)  # its runner's and template's hooks: its own modules
    _check(twin, seeded_members(HookClosure, N))
    untrained = seeded_members(HookClosure, N)
    x = BATCHES[0][0]
    with torch.no_grad():
        for i, m in enumerate(untrained):
            torch.testing.assert_close(ens(x)[i], m(x), rtol=0, atol=1e-12)


def test_a_load_state_dict_pre_hook_over_the_member_sees_the_member():
    seen: list[nn.Module] = []

    class Loader(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 2)
            # torch wraps it in a _WrappedHook, a plain object holding the lambda
            self.register_load_state_dict_pre_hook(lambda *a: seen.append(self))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)

    ens = vmapens.Ensemble(Loader, n=N, seed=0)
    for m in (ens[1], ens.unstack()[2]):
        m.load_state_dict(m.state_dict())
        assert seen[-1] is m  # as alone: the hook's `self` is the module loading
