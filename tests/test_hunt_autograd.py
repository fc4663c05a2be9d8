"""Hunt: autograd beyond one backward around the ensemble (grad modes around a step, a batch
with a graph into the ensemble, torch.func transforms of ``ens(x)``, double backward, per-sample
gradients) against N plain modules alone, in float64."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import vmapens
from vmapens._step_more import graph_into

N = 3


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1))


def normed() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 5), nn.LayerNorm(5), nn.GELU(), nn.Linear(5, 2))


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.LSTM(3, 4, batch_first=True), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x.view(2, 3, 3))[0])


def pair(factory: Callable[[], nn.Module], **kwargs: Any) -> tuple[vmapens.Ensemble, list]:
    ens = vmapens.Ensemble(factory, n=N, seed=0, **kwargs).double()
    return ens, [copy.deepcopy(m) for m in ens.unstack()]


def assert_members(ens: vmapens.Ensemble, members: list[nn.Module], tol: float = 1e-12) -> None:
    for name, t in [*ens.named_parameters(), *ens.named_buffers()]:
        alone = torch.stack(
            [dict([*m.named_parameters(), *m.named_buffers()])[name] for m in members]
        )
        torch.testing.assert_close(t, alone, rtol=tol, atol=tol, msg=name)


def train_alone(members: list[nn.Module], loss_of: Callable, steps: int, lr: float = 0.1) -> None:
    for m in members:
        opt = torch.optim.SGD(m.parameters(), lr=lr)
        for _ in range(steps):
            opt.zero_grad()
            loss_of(m).backward()
            opt.step()


def data(rows: int = 6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x, x2, y = (torch.randn(rows, k, generator=g, dtype=torch.float64) for k in (3, 3, 1))
    return x, x2, y


# -- grad modes around a step ---------------------------------------------------------------


def test_an_eager_step_under_no_grad_trains_as_alone() -> None:
    # The compiled step's gradients come from torch.func.grad, which ignores an outer no_grad;
    # the eager step recorded no graph there and failed with a hint about in-place ops.
    x, _, y = data()
    ens, members = pair(mlp)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1))
    with torch.no_grad():
        step(x, y)
        step(x, y)
    assert torch.is_grad_enabled()
    train_alone(members, lambda m: nn.functional.mse_loss(m(x), y), 2)
    assert_members(ens, members)


def test_a_step_under_inference_mode_is_refused_and_changes_nothing() -> None:
    x, _, y = data()
    ens = vmapens.Ensemble(mlp, n=N, seed=0)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1))
    with torch.inference_mode(), pytest.raises(RuntimeError, match="inference_mode"):
        step(x.float(), y.float())
    assert all(torch.equal(v, before[k]) for k, v in ens.state_dict().items())
    assert all(p.grad is None for p in ens.parameters())


# -- a batch with a graph into the ensemble's parameters -------------------------------------


@pytest.mark.parametrize("through", ["targets", "inputs"])
def test_a_chunked_step_back_propagates_through_a_batch_computed_from_the_ensemble(
    through: str,
) -> None:
    # A target from the ensemble itself, not detached: loss.backward() alone back-propagates
    # into the member through it. The chunked step ran each chunk on leaves of its own and
    # dropped that term, silently.
    x, x2, y = data()
    ens, members = pair(mlp, chunk_size=2)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1), in_dims=0)
    for _ in range(2):
        if through == "targets":
            step(x.expand(N, 6, 3), 0.9 * ens(x2))
        else:
            step(ens(x2).repeat(1, 1, 3), y.expand(N, 6, 1))

    def loss_of(m: nn.Module) -> torch.Tensor:
        if through == "targets":
            return nn.functional.mse_loss(m(x), 0.9 * m(x2))
        return nn.functional.mse_loss(m(m(x2).repeat(1, 3)), y)

    train_alone(members, loss_of, 2)
    assert_members(ens, members)


def test_the_compiled_step_refuses_a_target_with_a_graph_into_the_ensemble() -> None:
    # torch.func.grad inside the graph cannot follow it: members stepped without that term.
    x, x2, _ = data()
    ens = vmapens.Ensemble(mlp, n=N, seed=0).double()
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    opt = vmapens.StackedSGD(ens, lr=0.1)
    step = vmapens.make_step(ens, nn.MSELoss(), opt, in_dims=0, compile=True)
    with pytest.raises(ValueError, match=r"autograd graph into the ensemble.*detach"):
        step(x.expand(N, 6, 3), 0.9 * ens(x2))
    assert all(torch.equal(v, before[k]) for k, v in ens.state_dict().items())
    assert all(p.grad is None for p in ens.parameters())


def test_only_a_graph_that_reaches_the_parameters_counts() -> None:
    ens = vmapens.Ensemble(mlp, n=N, seed=0)
    params = list(ens.parameters())
    x = torch.randn(6, 3)
    teacher = nn.Linear(3, 1)
    assert not graph_into(((x,), torch.randn(6, 1)), params)
    assert not graph_into(((x.requires_grad_(),), teacher(x)), params)  # not the ensemble's
    assert graph_into(((x,), {"t": ens(x).sum(0) * 2}), params)
    assert graph_into(((params[0],), torch.zeros(1)), params)


# -- autograd inside the loss ----------------------------------------------------------------


def test_a_gradient_penalty_inside_the_loss_is_refused_under_vmap_and_exact_with_loop() -> None:
    # docs/semantics.md: torch.autograd.grad inside the forward is refused under vmap, exact
    # with backend="loop"; in a loss_fn it is the same.
    x, _, y = data()
    xx = x.clone().requires_grad_()

    def penalised(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        (g,) = torch.autograd.grad(out.sum(), xx, create_graph=True)
        return nn.functional.mse_loss(out, target) + 0.5 * g.pow(2).sum(1).mean()

    ens = vmapens.Ensemble(normed, n=N, seed=0).double()
    step = vmapens.make_step(ens, penalised, vmapens.StackedSGD(ens, lr=0.05))
    with pytest.raises(RuntimeError, match="backend='loop'"):
        step(xx, y.expand(6, 2))
    ens, members = pair(normed, backend="loop")
    step = vmapens.make_step(ens, penalised, vmapens.StackedSGD(ens, lr=0.05))
    for _ in range(2):
        step(xx, y.expand(6, 2))
    train_alone(members, lambda m: penalised(m(xx), y.expand(6, 2)), 2, lr=0.05)
    assert_members(ens, members)


# -- torch.func of ens(x) and double backward ------------------------------------------------


# torch.func.jvp loads torch's jvp decompositions with torch.jit.script, alone too.
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("factory", [normed, Recurrent], ids=["layernorm_gelu", "lstm"])
def test_jacobians_and_hessians_of_the_ensemble_in_its_input_are_the_members(
    factory: Callable[[], nn.Module],
) -> None:
    x, v, _ = data()
    ens, members = pair(factory)
    torch.testing.assert_close(
        torch.func.jacrev(ens)(x), torch.stack([torch.func.jacrev(m)(x) for m in members])
    )
    torch.testing.assert_close(
        torch.func.jvp(ens, (x,), (v,))[1],
        torch.stack([torch.func.jvp(m, (x,), (v,))[1] for m in members]),
    )
    torch.testing.assert_close(
        torch.func.hessian(lambda z: ens(z).pow(2).sum())(x),
        sum(torch.func.hessian(lambda z, m=m: m(z).pow(2).sum())(x) for m in members),
    )


@pytest.mark.parametrize("factory", [normed, Recurrent], ids=["layernorm_gelu", "lstm"])
@pytest.mark.parametrize("train", [True, False])
def test_double_backward_of_an_input_gradient_penalty_is_each_members(
    factory: Callable[[], nn.Module], train: bool
) -> None:
    x, _, _ = data()
    ens, members = pair(factory)
    ens.train(train)
    xs = x.repeat(N, 1, 1).requires_grad_()  # one copy per member: its own input gradient
    out = ens(xs, in_dims=0)
    (g,) = torch.autograd.grad(out.sum(), xs, create_graph=True)
    got = torch.autograd.grad(g.pow(2).sum() + 0.1 * out.pow(2).sum(), list(ens.parameters()))
    for i, m in enumerate(members):
        m.train(train)
        xi = x.clone().requires_grad_()
        o = m(xi)
        (gi,) = torch.autograd.grad(o.sum(), xi, create_graph=True)
        alone = torch.autograd.grad(gi.pow(2).sum() + 0.1 * o.pow(2).sum(), list(m.parameters()))
        for a, b in zip(got, alone, strict=True):
            torch.testing.assert_close(a[i], b)


def test_a_batchnorm_members_double_backward_and_statistics_are_each_members() -> None:
    def bn() -> nn.Module:
        return nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 2))

    x, _, _ = data()
    ens, members = pair(bn)
    xs = x.repeat(N, 1, 1).requires_grad_()
    (g,) = torch.autograd.grad(ens(xs, in_dims=0).sum(), xs, create_graph=True)
    got = torch.autograd.grad(g.pow(2).sum(), list(ens.parameters())[:-1])  # last bias: unused
    for i, m in enumerate(members):
        xi = x.clone().requires_grad_()
        (gi,) = torch.autograd.grad(m(xi).sum(), xi, create_graph=True)
        alone = torch.autograd.grad(gi.pow(2).sum(), list(m.parameters())[:-1])
        for a, b in zip(got, alone, strict=True):
            torch.testing.assert_close(a[i], b)
    assert_members(ens, members)  # running statistics: one update each


def test_per_sample_gradients_inside_the_member_map_are_each_members() -> None:
    x, _, y = data(4)

    def per_sample(state: dict, x: torch.Tensor, y: torch.Tensor) -> dict:
        def loss(s: dict, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
            return nn.functional.mse_loss(functional_call(ens.runner, s, (xi[None],)), yi[None])

        return vmap(grad(loss), in_dims=(None, 0, 0))(state, x, y)

    ens, members = pair(normed)
    got = ens.map_members(per_sample, x, y.expand(4, 2))
    for i, m in enumerate(members):
        for j in range(4):
            m.zero_grad()
            nn.functional.mse_loss(m(x[j : j + 1]), y[j : j + 1].expand(1, 2)).backward()
            for name, p in m.named_parameters():
                torch.testing.assert_close(got[name][i, j], p.grad)


def test_the_ensemble_inside_the_users_vmap_over_batches_is_the_members() -> None:
    x, x2, _ = data()
    ens, members = pair(Recurrent)
    batches = torch.stack([x, x2])  # two independent batches, mapped by the user's own vmap
    got = vmap(ens)(batches)
    alone = torch.stack([torch.stack([m(b) for m in members]) for b in batches])
    torch.testing.assert_close(got, alone)
