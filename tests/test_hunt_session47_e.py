"""Hunt (session 47, e): the ensemble used functionally, below ``fit``/``make_step``, as
torch.func users do: ``per_member`` losses, forward-mode AD, ``torch.autograd.functional``,
``jvp`` in the parameters through ``map_members``, a MAML step on members of different sizes,
and a user's own torch.func transform around ``per_member(loss)(ens(x), y)`` where the loss
reads what the forward kept on its module. Every result is compared with the members alone
(``ens.unstack()`` taken first), in float64."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import pytest
import torch
import torch.autograd.forward_ad as fwad
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jvp, vmap

import vmapens

N = 3
TOL = {"rtol": 1e-10, "atol": 1e-12}
OPTIONS = [{}, {"backend": "loop"}, {"chunk_size": 2}]
# torch's forward-mode rules load their decompositions with torch.jit.script, alone too.
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning"
)


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


class Recurrent(nn.Module):
    def __init__(self, hidden: int = 4) -> None:
        super().__init__()
        self.rnn, self.head = nn.GRU(3, hidden, batch_first=True), nn.Linear(hidden, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x.view(2, 3, 3))[0]).reshape(6, 2)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.att, self.head = (
            nn.Linear(3, 4),
            nn.MultiheadAttention(4, 2),
            nn.Linear(4, 2),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.inp(x).view(3, 2, 4)
        return self.head(self.att(z, z, z)[0]).reshape(6, 2)


class Lstm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.LSTM(3, 4, num_layers=2, batch_first=True), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x.view(2, 3, 3))[0]).reshape(6, 2)


class AuxPenalty(nn.Module):
    """An activation penalty kept on the module for the loss to read (as an MoE's aux loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.aux = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        self.aux = h.pow(2).mean()
        return h


def pair(factory: Callable[[], nn.Module], **options) -> tuple[vmapens.Ensemble, list[nn.Module]]:
    ens = vmapens.Ensemble(factory, n=N, seed=0, **options).double()
    return ens, [copy.deepcopy(m) for m in ens.unstack()]


# -- a user's torch.func transform around a loss that reads what the forward kept -----------
#
# docs/semantics.md: a loss given to per_member after ens(x) reads each member's own rows of
# what the forward kept on the template (ens.template.aux). Inside a user's own torch.func
# transform (vmap over several data sets, grad in the input) the kept tensors are wrapped one
# level deeper than the ensemble's vmap: until session 48 vmapens/_kept_stacks.py:_rows
# returned None for them, stack_turns dropped the name, and the template kept what it held
# before (``__init__``'s 0, or the last plain call's stack), so the loss read a stale value,
# silently (up to 1.02 off; with loop a [2, 3, 6] result). Fixed: a tensor of a transform
# still running is each member's value there.


def aux_loss(ens: vmapens.Ensemble, y: torch.Tensor) -> Callable:
    return vmapens.per_member(lambda o, t: F.cross_entropy(o, t) + ens.template.aux)


def alone_loss(m: nn.Module, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(m(z), y) + m.aux


@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_a_loss_reading_a_kept_aux_loss_under_the_users_vmap_over_data_sets(options) -> None:
    ens, members = pair(AuxPenalty, **options)
    xs, y = randn(2, 6, 3), torch.tensor([0, 1, 2, 3, 1, 2])
    got = vmap(lambda xb: aux_loss(ens, y)(ens(xb), y))(xs)  # [2 data sets, N]
    alone = torch.stack([torch.stack([alone_loss(m, xb, y) for m in members]) for xb in xs])
    # the members alone: each data set's own penalty; the ensemble read __init__'s 0
    torch.testing.assert_close(got, alone, **TOL)


@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_the_input_gradient_of_a_loss_reading_a_kept_aux_loss_under_torch_func_grad(
    options,
) -> None:
    ens, members = pair(AuxPenalty, **options)
    x, y = randn(6, 3), torch.tensor([0, 1, 2, 3, 1, 2])
    ens(x)  # a plain call first: the template holds its stack
    got = torch.func.grad(lambda z: aux_loss(ens, y)(ens(z), y).sum())(x)
    alone = sum(torch.func.grad(lambda z, m=m: alone_loss(m, z, y))(x) for m in members)
    # the ensemble's gradient is the cross-entropy's alone (the penalty's term dropped)
    torch.testing.assert_close(got, alone, **TOL)


def test_the_same_loss_with_autograd_grad_is_each_members() -> None:
    # The same computation without a torch.func transform: exact (the control).
    ens, members = pair(AuxPenalty)
    x, y = randn(6, 3), torch.tensor([0, 1, 2, 3, 1, 2])
    xr = x.clone().requires_grad_()
    got = torch.autograd.grad(aux_loss(ens, y)(ens(xr), y).sum(), xr)[0]
    alone = sum(torch.func.grad(lambda z, m=m: alone_loss(m, z, y))(x) for m in members)
    torch.testing.assert_close(got, alone, **TOL)


# -- forward-mode AD and torch.autograd.functional through the ensemble ------------------------


@pytest.mark.parametrize("options", OPTIONS, ids=str)
@pytest.mark.parametrize("factory", [Recurrent, Attention], ids=["gru", "mha"])
def test_dual_tensors_through_the_ensemble_are_each_members_tangent(factory, options) -> None:
    ens, members = pair(factory, **options)
    x, v = randn(6, 3), randn(6, 3, seed=1)
    with fwad.dual_level():
        primal, tangent = fwad.unpack_dual(ens(fwad.make_dual(x, v)))
    for i, m in enumerate(members):
        with fwad.dual_level():
            p, t = fwad.unpack_dual(m(fwad.make_dual(x, v)))
        torch.testing.assert_close(primal[i], p, **TOL)
        torch.testing.assert_close(tangent[i], t, **TOL)


def test_forward_ad_through_batchnorm_in_training_updates_each_members_statistics() -> None:
    def bn() -> nn.Module:
        return nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 2))

    ens, members = pair(bn, chunk_size=2)
    x, v = randn(6, 3), randn(6, 3, seed=1)
    with fwad.dual_level():
        tangent = fwad.unpack_dual(ens(fwad.make_dual(x, v))).tangent
        mean = ens.get_buffer("1.running_mean")
        assert fwad.unpack_dual(mean).tangent is None
    for i, m in enumerate(members):
        with fwad.dual_level():
            torch.testing.assert_close(
                tangent[i], fwad.unpack_dual(m(fwad.make_dual(x, v))).tangent, **TOL
            )
        torch.testing.assert_close(mean[i], m[1].running_mean, **TOL)
        torch.testing.assert_close(ens.get_buffer("1.running_var")[i], m[1].running_var, **TOL)


@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_autograd_functional_jacobian_and_hvp_of_the_ensemble_are_the_members(options) -> None:
    ens, members = pair(Lstm, **options)
    x, v = randn(6, 3), randn(6, 3, seed=1)
    jac = torch.autograd.functional.jacobian(ens, x)
    for i, m in enumerate(members):
        torch.testing.assert_close(jac[i], torch.autograd.functional.jacobian(m, x), **TOL)
    hvp = torch.autograd.functional.hvp(lambda z: ens(z).pow(2).sum(), x, v)[1]
    alone = sum(torch.autograd.functional.hvp(lambda z, m=m: m(z).pow(2).sum(), x, v)[1]
                for m in members)  # fmt: skip
    torch.testing.assert_close(hvp, alone, **TOL)


# A vectorized backward (torch's jacobian(vectorize=True), autograd.grad(is_grads_batched=True))
# vmaps the backward of the ensemble's fused LSTM node (vmapens/_lstm_fused.py:
# _Recurrence.backward), whose out= ops have no batching rule: "Batching rule not implemented
# for aten::mul.out" where nn.LSTM alone runs (loud; a strict xfail until session 48, when
# such a backward took the node's differentiable path).
@pytest.mark.parametrize("options", [{}, {"chunk_size": 2}], ids=str)
def test_a_vectorized_jacobian_of_an_lstm_ensemble_runs_as_alone(options) -> None:
    ens, members = pair(Lstm, **options)
    x = randn(6, 3)
    jac = torch.autograd.functional.jacobian(ens, x, vectorize=True)
    for i, m in enumerate(members):
        want = torch.autograd.functional.jacobian(m, x, vectorize=True)
        torch.testing.assert_close(jac[i], want, **TOL)


# -- jvp in the parameters, MAML on members of different sizes -------------------------------


@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_jvp_in_each_members_parameters_through_map_members(options) -> None:
    ens, members = pair(Lstm, **options)
    x = randn(6, 3)
    names = [k for k, _ in ens.named_parameters()]
    tangents = {k: randn(*p.shape, seed=2 + j) for j, (k, p) in enumerate(ens.named_parameters())}

    def member(state: dict, t: dict, xb: torch.Tensor) -> torch.Tensor:
        params = {k: state[k] for k in names}
        run = lambda p: functional_call(ens.runner, {**state, **p}, (xb,))  # noqa: E731
        return jvp(run, (params,), (t,))[1]

    got = ens.map_members(member, tangents, x, in_dims=(0, None))
    for i, m in enumerate(members):
        params = {k: p.detach() for k, p in m.named_parameters()}
        mine = {k: tangents[k][i] for k in names}
        want = jvp(lambda p, m=m: functional_call(m, p, (x,)), (params,), (mine,))[1]
        torch.testing.assert_close(got[i], want, **TOL)


def _own(stacked: torch.Tensor, alone: torch.Tensor, name: str) -> torch.Tensor:
    """Member's entries of a padded GRU tensor: each of the 3 gate blocks padded on its own."""
    if name.startswith("rnn."):
        big, small = stacked.shape[0] // 3, alone.shape[0] // 3
        stacked = stacked[torch.cat([torch.arange(g * big, g * big + small) for g in range(3)])]
    return stacked[tuple(slice(0, s) for s in alone.shape)]


@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_a_maml_step_on_members_of_different_sizes_is_each_members(options) -> None:
    factories = [functools.partial(Recurrent, h) for h in (3, 5, 4)]
    ens = vmapens.Ensemble.from_factories(factories, seed=0, **options).double()
    members = [copy.deepcopy(m) for m in ens.unstack()]
    x, y, x2, y2 = randn(6, 3), randn(6, 2, seed=1), randn(6, 3, seed=2), randn(6, 2, seed=3)
    params = dict(ens.named_parameters())
    inner = vmapens.per_member(F.mse_loss)(ens(x), y).sum()
    grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
    fast = {k: p - 0.3 * g for (k, p), g in zip(params.items(), grads, strict=True)}
    out = ens.map_members(
        lambda s, f, xb: functional_call(ens.runner, {**s, **f}, (xb,)), fast, x2,
        in_dims=(0, None),
    )  # fmt: skip
    outer = vmapens.per_member(F.mse_loss)(out, y2)
    got = torch.autograd.grad(outer.sum(), list(params.values()))
    for i, m in enumerate(members):
        own = dict(m.named_parameters())
        g = torch.autograd.grad(F.mse_loss(m(x), y), list(own.values()), create_graph=True)
        f = {k: p - 0.3 * gk for (k, p), gk in zip(own.items(), g, strict=True)}
        loss = F.mse_loss(functional_call(m, f, (x2,)), y2)
        torch.testing.assert_close(outer[i], loss, **TOL)
        want = torch.autograd.grad(loss, list(own.values()))
        for name, a, b in zip(params, got, want, strict=True):
            torch.testing.assert_close(_own(a[i], b, name), b, **TOL, msg=name)


# -- per_member: per-member class weights, label smoothing, ignore_index, uint8 targets --------


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8], ids=str)
@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_per_member_cross_entropy_with_per_member_weights_and_targets(options, dtype) -> None:
    ens, members = pair(
        lambda: nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4)), **options
    )
    x = randn(6, 3)
    y = torch.tensor([[0, 1, 2, 3, 1, 2], [3, 3, 0, 1, 2, 2], [1, 0, 0, 2, 3, 1]], dtype=dtype)
    w = torch.rand(N, 4, generator=torch.Generator().manual_seed(4), dtype=torch.float64) + 0.5

    def loss(o: torch.Tensor, t: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
        plain = F.cross_entropy(o, t, reduction="none", ignore_index=2).mean()
        return (
            plain
            + F.cross_entropy(o, t, weight=wt, ignore_index=1)
            + F.cross_entropy(o, t, label_smoothing=0.2)
        )

    got = vmapens.per_member(loss, in_dims=(0, 0, 0))(ens(x), y, w)
    grads = torch.autograd.grad(got.sum(), list(ens.parameters()))
    for i, m in enumerate(members):
        value = loss(m(x), y[i], w[i])
        torch.testing.assert_close(got[i], value, **TOL)
        for a, b in zip(grads, torch.autograd.grad(value, list(m.parameters())), strict=True):
            torch.testing.assert_close(a[i], b, **TOL)
