"""Workloads A and B and the optimizer step: members, data and the reference implementations.

Every implementation is a *step factory*: ``factory(n, device)`` builds the models, optimizer and
data once and returns a zero-argument function doing one full training step (forward, loss,
backward, optimizer step); the ``WORKLOAD_OPTIM`` factories return the optimizer step alone, on
fixed gradients.

Example:
    >>> step = WORKLOAD_A["torchfunc"](15, torch.device("cpu"))
    >>> step()
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

from vmapens.ensemble import Ensemble
from vmapens.optim import StackedAdam
from vmapens.step import make_step

from ._tools import Step

StepFactory = Callable[[int, torch.device], Step]
_ModuleT = TypeVar("_ModuleT", bound=nn.Module)

#: Largest N at which the naive loop is timed; beyond it t(N) is extrapolated as N * t(1).
NAIVE_MAX_N = 64
#: Largest N for the hand-merged model: its masked weight is dense, O(N^2) memory and time.
MERGED_MAX_N = 1024
#: Number of heads in workload B.
HEADS = 128


def mlp() -> nn.Sequential:
    """Workload A member: ``Linear(2, 20) -> Linear(20, 1) -> sigmoid``."""
    return nn.Sequential(nn.Linear(2, 20), nn.Linear(20, 1), nn.Sigmoid())


def head() -> nn.Sequential:
    """Workload B member: ``Linear(16, 32) -> Tanh -> Linear(32, 4)``."""
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _data(workload: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    if workload == "A":
        return torch.randn(5, 2, device=device), torch.ones(5, 1, device=device)
    return torch.randn(256, 16, device=device), torch.randn(256, 4, device=device)


def _members(factory: Callable[[], _ModuleT], n: int, device: torch.device) -> list[_ModuleT]:
    return [factory().to(device) for _ in range(n)]


def _loss_b(out: torch.Tensor, y: torch.Tensor, loss: str) -> torch.Tensor:
    """Workload B loss of stacked outputs ``[heads, B, 4]``: on the mean, or summed per head."""
    if loss == "mean":
        return F.mse_loss(out.mean(0), y)
    return (out - y).pow(2).mean((1, 2)).sum()


def _train(params: Any, forward_loss: Callable[[], torch.Tensor]) -> Step:
    """Wrap a loss closure into one Adam step over ``params``."""
    opt = torch.optim.Adam(params)

    def step() -> None:
        opt.zero_grad()
        forward_loss().backward()
        opt.step()

    return step


def _stacked_linears(members: list[nn.Sequential]) -> list[torch.Tensor]:
    """Stack members' two ``Linear`` as baddbmm leaves ``W [n, in, out]``, ``b [n, 1, out]``."""
    layers = [[m for m in member if isinstance(m, nn.Linear)] for member in members]
    leaves = []
    for i in (0, 1):
        leaves.append(torch.stack([ls[i].weight.detach().t() for ls in layers]))
        leaves.append(torch.stack([ls[i].bias.detach()[None] for ls in layers]))
    return [t.contiguous().requires_grad_() for t in leaves]


def _functional(members: Sequence[nn.Module]) -> tuple[dict, dict, nn.Module]:
    """The torch.func recipe: stacked fresh leaves plus a stateless meta-device template."""
    params, buffers = stack_module_state(members)
    return params, buffers, copy.deepcopy(members[0]).to("meta")


def _vmapens_step(workload: str, n: int, device: torch.device, *, compile: bool) -> Step:
    """vmapens ``make_step`` with the per-member loss (BCE for A, MSE for B)."""
    x, y = _data(workload, device)
    member, loss_fn = (mlp, nn.BCELoss()) if workload == "A" else (head, nn.MSELoss())
    # Members are built on `device` by the factory, so nothing is assumed about Ensemble.to.
    ens = Ensemble(lambda: member().to(device), n, seed=0)
    step = make_step(ens, loss_fn, StackedAdam(ens), compile=compile)
    return lambda: step(x, y)


# --- Workload A ---------------------------------------------------------------------------------


def a_naive(n: int, device: torch.device) -> Step:
    """N modules, N ``torch.optim.Adam``, a Python loop over members: the code users write."""
    x, y = _data("A", device)
    models = _members(mlp, n, device)
    return loop_step(models, [torch.optim.Adam(m.parameters()) for m in models], x, y)


def loop_step(
    models: list[nn.Module], opts: list[torch.optim.Optimizer], x: torch.Tensor, y: torch.Tensor
) -> Step:
    """Workload A's naive step: each model with its own optimizer, one after another."""

    def step() -> None:
        for model, opt in zip(models, opts, strict=True):
            opt.zero_grad()
            F.binary_cross_entropy(model(x), y).backward()
            opt.step()

    return step


def a_merged(n: int, device: torch.device) -> Step:
    """Hand-merged rewrite: one wide model whose second weight is block-diagonal under a mask."""
    x, y = _data("A", device)
    fc1, fc2 = nn.Linear(2, n * 20).to(device), nn.Linear(n * 20, n).to(device)
    # Row i may only see hidden units i*20 .. i*20+19, so the N blocks never mix.
    mask = torch.kron(torch.eye(n, device=device), torch.ones(1, 20, device=device))
    with torch.no_grad():
        fc2.weight.mul_(mask)
    opt = torch.optim.Adam([*fc1.parameters(), *fc2.parameters()])

    def step() -> None:
        opt.zero_grad()
        F.binary_cross_entropy(torch.sigmoid(fc2(fc1(x))), y.expand(5, n)).backward()
        assert fc2.weight.grad is not None  # backward() just filled it
        fc2.weight.grad.mul_(mask)
        opt.step()

    return step


def a_torchfunc(n: int, device: torch.device) -> Step:
    """The bare torch.func recipe: ``stack_module_state`` + ``functional_call`` + ``vmap``."""
    x, y = _data("A", device)
    params, buffers, base = _functional(_members(mlp, n, device))

    def member_loss(p: dict, b: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy(functional_call(base, (p, b), (x,)), y)

    losses = vmap(member_loss, in_dims=(0, 0, None, None))
    return _train(params.values(), lambda: losses(params, buffers, x, y).sum())


def a_baddbmm(n: int, device: torch.device) -> Step:
    """Hand-written batched-matmul ensemble: stacked leaf weights, one ``baddbmm`` per layer."""
    x, y = _data("A", device)
    w1, b1, w2, b2 = leaves = _stacked_linears(_members(mlp, n, device))
    xs, ys = x.expand(n, 5, 2), y.expand(n, 5, 1)

    def forward_loss() -> torch.Tensor:
        out = torch.sigmoid(torch.baddbmm(b2, torch.baddbmm(b1, xs, w1), w2))
        return F.binary_cross_entropy(out, ys, reduction="none").mean((1, 2)).sum()

    return _train(leaves, forward_loss)


WORKLOAD_A: dict[str, StepFactory] = {
    "naive": a_naive,
    "merged": a_merged,
    "torchfunc": a_torchfunc,
    "baddbmm": a_baddbmm,
    "vmapens_eager": functools.partial(_vmapens_step, "A", compile=False),
    "vmapens_compiled": functools.partial(_vmapens_step, "A", compile=True),
}


# --- Workload B ---------------------------------------------------------------------------------


class NaiveHeads(nn.Module):
    """The naive ensemble model: an ``nn.ModuleList`` looped over in every forward."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.networks = nn.ModuleList(head() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([net(x) for net in self.networks])


def b_naive(n: int, device: torch.device, loss: str) -> Step:
    """``NaiveHeads`` with one Adam."""
    x, y = _data("B", device)
    model = NaiveHeads(n).to(device)
    return _train(model.parameters(), lambda: _loss_b(model(x), y, loss))


def b_grouped_conv(n: int, device: torch.device, loss: str) -> Step:
    """The usual hand-merged answer: grouped 1x1 ``Conv1d`` layers, one group per head."""
    x, y = _data("B", device)
    model = nn.Sequential(
        nn.Conv1d(16 * n, 32 * n, kernel_size=1, groups=n),
        nn.Tanh(),
        nn.Conv1d(32 * n, 4 * n, kernel_size=1, groups=n),
    ).to(device)
    xs = x.repeat(1, n).unsqueeze(-1)  # [B, 16 * n, 1]: every group sees the whole input
    forward = lambda: model(xs).reshape(-1, n, 4).transpose(0, 1)  # noqa: E731
    return _train(model.parameters(), lambda: _loss_b(forward(), y, loss))


def b_torchfunc(n: int, device: torch.device, loss: str) -> Step:
    """The bare torch.func recipe, vmapping the forward only; the loss sees ``[heads, B, 4]``."""
    x, y = _data("B", device)
    params, buffers, base = _functional(_members(head, n, device))
    forward = vmap(lambda p, b, x: functional_call(base, (p, b), (x,)), in_dims=(0, 0, None))
    return _train(params.values(), lambda: _loss_b(forward(params, buffers, x), y, loss))


def b_baddbmm(n: int, device: torch.device, loss: str) -> Step:
    """Hand-written batched-matmul heads."""
    x, y = _data("B", device)
    w1, b1, w2, b2 = leaves = _stacked_linears(_members(head, n, device))
    xs = x.expand(n, *x.shape)
    forward = lambda: torch.baddbmm(b2, torch.tanh(torch.baddbmm(b1, xs, w1)), w2)  # noqa: E731
    return _train(leaves, lambda: _loss_b(forward(), y, loss))


def b_vmapens_eager(n: int, device: torch.device, loss: str) -> Step:
    """vmapens without compilation; the loss on the mean is written by hand on ``ens(x)``."""
    if loss == "per_head":
        return _vmapens_step("B", n, device, compile=False)
    x, y = _data("B", device)
    ens = Ensemble(lambda: head().to(device), n, seed=0)
    opt = StackedAdam(ens)

    def step() -> None:
        opt.zero_grad()
        F.mse_loss(ens(x).mean(0), y).backward()
        opt.step()

    return step


def b_vmapens_compiled(n: int, device: torch.device, loss: str) -> Step:
    """vmapens ``make_step(compile=True)``: per-head losses even in the mean variant."""
    return _vmapens_step("B", n, device, compile=True)


_B = [b_naive, b_grouped_conv, b_torchfunc, b_baddbmm, b_vmapens_eager, b_vmapens_compiled]
#: Workload B factories by loss variant ("mean": MSE of the averaged output, "per_head": summed
#: per-head MSE), then by implementation.
WORKLOAD_B: dict[str, dict[str, StepFactory]] = {
    loss: {f.__name__[2:]: functools.partial(f, loss=loss) for f in _B}
    for loss in ("mean", "per_head")
}


# --- Optimizer step -----------------------------------------------------------------------------
# Only ``opt.step()`` is timed, on workload A's stacked parameters with gradients fixed once.


def _graded_ensemble(n: int, device: torch.device) -> nn.Module:
    """Workload A's ``Ensemble(mlp, n, seed=0)``, each parameter with a fixed random gradient."""
    ens = Ensemble(lambda: mlp().to(device), n, seed=0)
    gen = torch.Generator().manual_seed(0)
    for p in ens.parameters():
        p.grad = torch.randn(p.shape, generator=gen).to(device)
    return ens


def _member_lrs(n: int) -> torch.Tensor:
    return torch.logspace(-4, -1, n)


def o_stacked_adam(n: int, device: torch.device) -> Step:
    """``vmapens.StackedAdam`` with one shared learning rate."""
    return StackedAdam(_graded_ensemble(n, device)).step


def o_stacked_adam_per_member_lr(n: int, device: torch.device) -> Step:
    """``vmapens.StackedAdam`` with one learning rate per member, ``logspace(-4, -1, n)``."""
    return StackedAdam(_graded_ensemble(n, device), lr=_member_lrs(n)).step


def o_foreach_adam(n: int, device: torch.device) -> Step:
    """``torch.optim.Adam(foreach=True)`` on the same stacked tensors: one shared lr only."""
    return torch.optim.Adam(_graded_ensemble(n, device).parameters(), foreach=True).step


def o_per_member_groups(n: int, device: torch.device) -> Step:
    """The usual workaround for per-member learning rates: one Adam param group per member.

    A view ``p[i]`` of a stacked leaf is not a leaf, so each member owns separate leaf tensors
    (copies of its slices, with its slices of the gradients); ``torch.optim.Adam`` keeps its
    defaults (a per-tensor loop on CPU, foreach within each group on CUDA).
    """
    stacked = list(_graded_ensemble(n, device).parameters())
    groups = []
    for i, lr in enumerate(_member_lrs(n).tolist()):
        leaves = [p[i].detach().clone().requires_grad_() for p in stacked]
        for leaf, p in zip(leaves, stacked, strict=True):
            assert p.grad is not None  # _graded_ensemble gave every parameter one
            leaf.grad = p.grad[i].clone()
        groups.append({"params": leaves, "lr": lr})
    return torch.optim.Adam(groups).step


#: Optimizer-step factories by implementation.
WORKLOAD_OPTIM: dict[str, StepFactory] = {
    f.__name__[2:]: f
    for f in (o_stacked_adam, o_stacked_adam_per_member_lr, o_foreach_adam, o_per_member_groups)
}
