"""make_step: the compiled one-graph step equals the eager step, and compiles once."""

from __future__ import annotations

import copy

import models
import pytest
import torch
from torch import nn

import vmapens

# The compiled graph may fuse and reorder float64 arithmetic: equal up to round-off.
TOL = dict(rtol=1e-9, atol=1e-11)
N = 4


def graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def twin_steps(factory, loss_fn, *, in_dims=None, **opt_kw):
    """The same ensemble twice: one trained by the eager step, one by the compiled step."""
    eager = vmapens.Ensemble(factory, N, seed=0).double()
    compiled = copy.deepcopy(eager)
    step_e = vmapens.make_step(
        eager, loss_fn, vmapens.StackedAdam(eager, **opt_kw), in_dims=in_dims
    )
    step_c = vmapens.make_step(
        compiled, loss_fn, vmapens.StackedAdam(compiled, **opt_kw), in_dims=in_dims, compile=True
    )
    return eager, step_e, compiled, step_c


@pytest.fixture(scope="module")
def cnn_per_member():
    """BatchNorm buffers, per-member inputs and targets, per-member lr: one compile, shared."""
    torch.manual_seed(0)
    lr = torch.logspace(-3, -1, N).tolist()
    return twin_steps(models.CNN, nn.MSELoss(), in_dims=0, lr=lr)


def test_compiled_equals_eager_with_buffers_and_per_member_inputs(cnn_per_member):
    eager, step_e, compiled, step_c = cnn_per_member
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(N, 6, 1, 6, 6, generator=g, dtype=torch.float64)
        y = torch.randn(N, 6, 3, generator=g, dtype=torch.float64)
        torch.testing.assert_close(step_c(x, y), step_e(x, y), **TOL)
    torch.testing.assert_close(compiled.state_dict(), eager.state_dict(), **TOL)
    assert not torch.equal(eager.state_dict()["bn.running_mean"], torch.zeros(N, 4))


def test_compiled_masks_freeze_members_and_do_not_recompile(cnn_per_member):
    eager, step_e, compiled, step_c = cnn_per_member
    mask = torch.tensor([True, False, True, False])
    x = torch.randn(N, 6, 1, 6, 6, dtype=torch.float64)
    y = torch.randn(N, 6, 3, dtype=torch.float64)
    # Parameters and buffers (BatchNorm statistics) of masked member 1, in both ensembles.
    frozen = [{k: v[1].clone() for k, v in e.state_dict().items()} for e in (eager, compiled)]
    torch.testing.assert_close(step_c(x, y, mask), step_e(x, y, mask), **TOL)  # compiles
    before = graphs()
    for _ in range(3):
        torch.testing.assert_close(step_c(x, y, mask), step_e(x, y, mask), **TOL)
    assert graphs() == before, "a later call with the same shapes recompiled"
    torch.testing.assert_close(compiled.state_dict(), eager.state_dict(), **TOL)
    for ens, before in zip((eager, compiled), frozen, strict=True):
        for k, v in ens.state_dict().items():
            assert torch.equal(v[1], before[k]), f"masked member changed at {k}"


def test_compiled_step_trains_like_separate_models():
    """Workload A through the compiled step against N plain modules and torch.optim.Adam."""
    torch.manual_seed(0)
    twins = [
        nn.Sequential(nn.Linear(2, 20), nn.Linear(20, 1), nn.Sigmoid()).double() for _ in range(N)
    ]
    ens = vmapens.Ensemble.from_modules([copy.deepcopy(m) for m in twins])
    step = vmapens.make_step(ens, nn.BCELoss(), vmapens.StackedAdam(ens, lr=1e-2), compile=True)
    x, y = torch.randn(5, 2, dtype=torch.float64), torch.ones(5, 1, dtype=torch.float64)
    for _ in range(20):
        step(x, y)
    for i, twin in enumerate(twins):
        opt = torch.optim.Adam(twin.parameters(), lr=1e-2)
        for _ in range(20):
            opt.zero_grad()
            nn.functional.binary_cross_entropy(twin(x), y).backward()
            opt.step()
        torch.testing.assert_close(ens[i].state_dict(), twin.state_dict(), **TOL)


def test_eager_step_with_plain_torch_optimizer():
    ens = vmapens.Ensemble(models.MLP, N, seed=0)
    before = copy.deepcopy(ens.state_dict())
    step = vmapens.make_step(ens, nn.MSELoss(), torch.optim.SGD(ens.parameters(), lr=0.1))
    losses = step(torch.randn(7, 4), torch.randn(7, 3))
    assert losses.shape == (N,) and not losses.requires_grad
    assert not torch.equal(ens.state_dict()["fc1.weight"], before["fc1.weight"])
    with pytest.raises(TypeError, match="`mask` needs a vmapens.StackedOptimizer"):
        step(torch.randn(7, 4), torch.randn(7, 3), torch.ones(N, dtype=torch.bool))


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"in_dims": 1}, ValueError, r"make_step: `in_dims` must be None or 0, got 1"),
        (
            {"compile": True, "optimizer": "sgd"},
            TypeError,
            r"`compile=True` needs a vmapens.StackedOptimizer",
        ),
        ({"optimizer": "none"}, TypeError, r"`optimizer` must be a torch.optim.Optimizer"),
    ],
    ids=["in-dims", "compile-needs-stacked-adam", "not-an-optimizer"],
)
def test_make_step_bad_input(kwargs, exc, match):
    ens = vmapens.Ensemble(models.MLP, N, seed=0)
    optimizers = {"sgd": torch.optim.SGD(ens.parameters(), lr=0.1), "none": None}
    kwargs["optimizer"] = optimizers.get(kwargs.get("optimizer"), vmapens.StackedAdam(ens))
    with pytest.raises(exc, match=match):
        vmapens.make_step(ens, nn.MSELoss(), **kwargs)


def test_compiled_step_checks_per_member_sizes_like_eager(cnn_per_member):
    eager, step_e, compiled, step_c = cnn_per_member
    before = copy.deepcopy(compiled.state_dict())
    x = torch.randn(N - 1, 6, 1, 6, 6, dtype=torch.float64)  # one slice short
    y = torch.randn(N - 1, 6, 3, dtype=torch.float64)
    for step in (step_e, step_c):
        with pytest.raises(ValueError, match=r"argument 0 is mapped with in_dims=0 but has size 3"):
            step(x, y)
    torch.testing.assert_close(compiled.state_dict(), before, rtol=0, atol=0)
