"""Members with parametrized and converted layers, against the same modules alone.

The truth is plain PyTorch: each member built alone (seeded as ``seeds=`` builds it) with
torch's own parametrizations (``torch.nn.utils.parametrize``) or old-style hooks, trained
with ``torch.optim`` on the same batches, in float64; compared member by member (parameters,
``spectral_norm``'s ``_u``/``_v`` and other buffers, outputs), and through ``ens[i]``,
``unstack()`` and ``state_dicts()``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize
from truth import assert_members_equal, float64_batches, seeded_members

import vmapens
from vmapens._batchable import own_parametrized_classes_

pytestmark = pytest.mark.usefixtures("float64_default")

N = 3
LR = 0.05
TOL = dict(rtol=1e-9, atol=1e-10)


class _Symmetric(nn.Module):
    """A custom parametrization without ``right_inverse``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu() + x.triu(1).transpose(-1, -2)


class _SymmetricInverse(_Symmetric):
    """The same with ``right_inverse``: assigning the weight stores its upper triangle."""

    def right_inverse(self, a: torch.Tensor) -> torch.Tensor:
        return a.triu()


class _Double(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x

    def right_inverse(self, x: torch.Tensor) -> torch.Tensor:
        return x / 2


def _square(register: Callable[[nn.Linear], object]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        layer = nn.Linear(4, 4)
        register(layer)
        return nn.Sequential(layer, nn.Tanh(), nn.Linear(4, 2))

    return build


def _reg(p: Callable[[], nn.Module], **kw: object) -> Callable[[nn.Linear], object]:
    return lambda m: parametrize.register_parametrization(m, "weight", p(), **kw)  # type: ignore[arg-type]


CASES: dict[str, Callable[[], nn.Module]] = {
    "spectral-iterations": _square(
        lambda m: parametrizations.spectral_norm(m, n_power_iterations=2)
    ),
    "weight-norm": _square(parametrizations.weight_norm),
    "weight-norm-dim-none": _square(lambda m: parametrizations.weight_norm(m, dim=None)),
    "orthogonal-matrix-exp": _square(
        lambda m: parametrizations.orthogonal(m, orthogonal_map="matrix_exp")
    ),
    "orthogonal-cayley": _square(lambda m: parametrizations.orthogonal(m, orthogonal_map="cayley")),
    "orthogonal-householder": _square(
        lambda m: parametrizations.orthogonal(m, orthogonal_map="householder")
    ),
    "custom": _square(_reg(_Symmetric)),
    "custom-unsafe": _square(_reg(_Symmetric, unsafe=True)),
    "custom-stacked-with-spectral": _square(
        lambda m: (_reg(_SymmetricInverse)(m), _reg(_Double)(m), parametrizations.spectral_norm(m))
    ),
    "old-spectral-iterations": _square(lambda m: nn.utils.spectral_norm(m, n_power_iterations=2)),
}


def _train_alone(models: list[nn.Module], batches: list, eval_from: int) -> None:
    for m in models:
        opt = torch.optim.SGD(m.parameters(), lr=LR, momentum=0.5)
        for k, (x, y) in enumerate(batches):
            m.train(k < eval_from)
            opt.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()


def _train_ensemble(factory: Callable[[], nn.Module], batches: list, eval_from: int, **kw: object):
    ens = vmapens.Ensemble(factory, n=N, seeds=range(N), **kw)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=LR, momentum=0.5))
    for k, (x, y) in enumerate(batches):
        ens.train(k < eval_from)
        step(x, y)
    return ens


@pytest.mark.parametrize("name", list(CASES))
def test_parametrized_members_train_as_alone_in_train_and_eval_mode(name):
    factory = CASES[name]
    batches = float64_batches(3, 5, 4, 2)
    ens = _train_ensemble(factory, batches, eval_from=2)
    alone = seeded_members(factory, N)
    _train_alone(alone, batches, eval_from=2)
    assert_members_equal(ens, alone)
    x = batches[0][0]
    for mode in (True, False):  # a training forward runs the power iteration once more
        ens.train(mode)
        members = ens.unstack()
        for m in alone:
            m.train(mode)
        want = [m(x) for m in alone]
        torch.testing.assert_close(ens(x), torch.stack(want), **TOL)
        # the unstacked members went on from the state before that forward, as `alone` did
        for i, member in enumerate(members):
            member.train(mode)
            torch.testing.assert_close(member(x), want[i], **TOL, msg=f"member {i}")
    assert_members_equal(ens, alone)


def test_members_are_parametrized_as_alone_and_load_into_plain_modules():
    factory = CASES["custom-stacked-with-spectral"]
    batches = float64_batches(2, 5, 4, 2)
    ens = _train_ensemble(factory, batches, eval_from=2)
    alone = seeded_members(factory, N)
    _train_alone(alone, batches, eval_from=2)
    x = batches[0][0]
    for i, (member, state, plain) in enumerate(
        zip(ens.unstack(), ens.state_dicts(), alone, strict=True)
    ):
        kinds = [type(p) for p in member[0].parametrizations.weight]
        assert kinds == [type(p) for p in plain[0].parametrizations.weight]
        loaded = factory()
        loaded.load_state_dict(state)
        want = plain(x)
        for m in (member, loaded):
            torch.testing.assert_close(m(x), want, **TOL, msg=f"member {i}")
            torch.testing.assert_close(m.state_dict(), plain.state_dict(), **TOL)


class _Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(6, 3, padding_idx=0)
        parametrize.register_parametrization(self.emb, "weight", _Double())
        self.out = nn.Linear(3, 2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(idx).mean(1))


def test_parametrized_embedding_padding_row_gets_no_gradient_with_per_member_indices():
    """vmap's embedding rule with per-member indices gave the padding row of every member but
    the first a gradient; the runner's parametrized Embedding now has the twin's fix too."""
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 6, (2, N, 5, 3), generator=g)
    idx[:, :, 0, 0] = 0  # every member looks its padding row up
    y = torch.randn(5, 2, generator=g)
    alone = seeded_members(_Bag, N)
    for i, m in enumerate(alone):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for batch in idx:
            opt.zero_grad()
            nn.functional.mse_loss(m(batch[i]), y).backward()
            opt.step()
    ens = vmapens.Ensemble(_Bag, n=N, seeds=range(N))
    opt = vmapens.StackedSGD(ens, lr=0.1)
    for batch in idx:
        opt.zero_grad()
        ((ens(batch, in_dims=0) - y) ** 2).mean((1, 2)).sum().backward()
        opt.step()
    assert_members_equal(ens, alone)


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = parametrizations.weight_norm(nn.GRU(1, 3, batch_first=True), "weight_hh_l0")
        self.out = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.gru(x.unsqueeze(-1))[0][:, -1])


def test_parametrized_gru_trains_as_alone_under_vmap():
    """A parametrized GRU kept torch's fused kernel, which vmap cannot batch (it raised)."""
    batches = float64_batches(2, 5, 4, 2)
    ens = _train_ensemble(_Recurrent, batches, eval_from=2)
    alone = seeded_members(_Recurrent, N)
    _train_alone(alone, batches, eval_from=2)
    assert_members_equal(ens, alone)


def test_remove_parametrizations_on_a_member_leaves_the_ensemble_running():
    """``ens[i]`` deep-copies the template, and torch's deep copy keeps the template's
    ``Parametrized*`` class, from which ``remove_parametrizations`` deletes the property: the
    ensemble's own forward must not lose its weight with it."""
    factory = CASES["weight-norm"]
    ens = vmapens.Ensemble(factory, n=N, seeds=range(N))
    alone = seeded_members(factory, N)
    x = float64_batches(1, 5, 4, 2)[0][0]
    member = ens[0]
    parametrize.remove_parametrizations(member[0], "weight")
    plain = seeded_members(factory, 1)[0]
    parametrize.remove_parametrizations(plain[0], "weight")
    torch.testing.assert_close(member(x), plain(x), **TOL)
    assert type(member[0]) is nn.Linear
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in alone]), **TOL)


def test_own_parametrized_classes_keeps_a_copy_apart_from_the_original():
    """torch's deep copy keeps the ``Parametrized*`` class; ``remove_parametrizations`` on the
    copy deleted the original's property with it. The helper ``ens[i]`` can use."""
    original = CASES["weight-norm"]()
    x = float64_batches(1, 5, 4, 2)[0][0]
    want = original(x)
    member = own_parametrized_classes_(copy.deepcopy(original))
    parametrize.remove_parametrizations(member[0], "weight")
    torch.testing.assert_close(member(x), want, **TOL)
    torch.testing.assert_close(original(x), want, **TOL)
    assert parametrize.is_parametrized(original[0], "weight")
