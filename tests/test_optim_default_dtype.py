"""Stacked optimizers under ``torch.set_default_dtype(torch.float64)`` against plain torch.

torch keeps per-step scalar state (``step``, NAdam's ``mu_product``, ASGD's ``eta`` and
``mu``) in its scalar dtype, read when the state is created: float64 under a float64 default
dtype, float32 otherwise; ``load_state_dict`` keeps ``step`` as it is. Every truth here is a
plain module trained alone with its own torch optimizer (tests/truth.py), in the same default
dtype: member i must match it to float64 rounding, and every counter must have the dtype the
torch twin's has.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from truth import assert_members_equal, float64_batches, train_alone, train_each, twins

import vmapens
from vmapens import optim

N = 3
STEPS = 20
#: float64 end to end, the same ops in torch's order: only the ensemble's batched matmuls sum
#: in another order (about 1e-16 here). A counter kept in float32 instead of float64 drifts by
#: 1e-10 (NAdam) to 1e-9 (ASGD) in 20 steps, far outside this.
TOL = dict(rtol=0.0, atol=1e-12)

#: (stacked class, torch class, options): per-member lists where the optimizer takes them, and
#: shared values too (NAdam, ASGD), which take the fused path over Python floats.
CASES = [
    (optim.StackedNAdam, torch.optim.NAdam, dict(lr=[1e-2, 2e-2, 5e-3])),
    (optim.StackedNAdam, torch.optim.NAdam, dict(lr=1e-2, momentum_decay=[4e-3, 1e-2, 2e-3])),
    (optim.StackedNAdam, torch.optim.NAdam, dict(lr=1e-2, decoupled_weight_decay=True)),
    (optim.StackedASGD, torch.optim.ASGD, dict(lr=[1e-2, 2e-2, 5e-2], lambd=[1e-4, 1e-2, 0.1])),
    (optim.StackedASGD, torch.optim.ASGD, dict(lr=2e-2, lambd=1e-2, t0=2.0)),
    (optim.StackedAdam, torch.optim.Adam, dict(lr=[1e-2, 2e-2, 5e-3])),
    (optim.StackedAdam, torch.optim.Adam, dict(lr=1e-2)),  # torch's fused CPU kernel
    (optim.StackedRAdam, torch.optim.RAdam, dict(lr=[1e-2, 2e-2, 5e-3])),
    (optim.StackedAdamax, torch.optim.Adamax, dict(lr=[1e-2, 2e-2, 5e-3])),
    (optim.StackedAdagrad, torch.optim.Adagrad, dict(lr=[1e-2, 2e-2, 5e-3], lr_decay=0.1)),
    (optim.StackedAdafactor, torch.optim.Adafactor, dict(lr=[1e-2, 2e-2, 5e-3])),
    (optim.StackedRMSprop, torch.optim.RMSprop, dict(lr=[1e-2, 2e-2, 5e-3])),
    (optim.StackedSGD, torch.optim.SGD, dict(lr=[1e-2, 2e-2, 5e-3], momentum=0.9)),
    (optim.StackedRprop, torch.optim.Rprop, dict(lr=[1e-2, 2e-2, 5e-3])),
    (optim.StackedAdadelta, torch.optim.Adadelta, dict(lr=[1.0, 0.5, 0.1])),
]
IDS = [f"{s.__name__}-{'-'.join(kw)}" for s, _, kw in CASES]
#: A bare ASGD t0 (1e6) never averages: these start averaging at step 3.
for _, _, kw in CASES:
    if "lambd" in kw:
        kw.setdefault("t0", [2.0, 3.0, 5.0])


@pytest.fixture
def default64() -> Iterator[None]:
    """``torch.set_default_dtype(torch.float64)`` for the test, restored afterwards."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def batches(count: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return float64_batches(count, 6, 3, 2, seed)


def member(kwargs: dict[str, Any], i: int) -> dict[str, Any]:
    """Member i's options for the torch optimizer."""
    return {k: v[i] if isinstance(v, list) else v for k, v in kwargs.items()}


def train(ens: Any, opt: Any, data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The stacked loop: every member on the same batches, one step each."""
    loss = vmapens.per_member(nn.functional.mse_loss)
    for x, y in data:
        opt.zero_grad()
        loss(ens(x), y).sum().backward()
        opt.step()


def assert_counters_like(stacked: Any, plain: list[torch.optim.Optimizer]) -> None:
    """Every per-member counter of ``stacked`` has the dtype torch's twin keeps its own in."""
    for p, q in zip(
        [p for g in stacked.param_groups for p in g["params"]],
        [q for g in plain[0].param_groups for q in g["params"]],
        strict=True,
    ):
        want = {k: v.dtype for k, v in plain[0].state[q].items() if v.dim() == 0}
        got = {k: v.dtype for k, v in stacked.state[p].items() if k in want}
        assert got == want


def run_pair(stacked_cls: Any, torch_cls: Any, kwargs: dict[str, Any]) -> None:
    """Train the stacked optimizer and each member alone; compare parameters and dtypes."""
    ens = vmapens.Ensemble(net, N, seed=1)
    alone = twins(ens.unstack())
    data = batches(STEPS)
    opt = stacked_cls(ens, **kwargs)
    train(ens, opt, data)
    plain = train_each(
        alone, data, make_opt=lambda i, m: torch_cls(m.parameters(), **member(kwargs, i))
    )
    assert_members_equal(ens, alone, **TOL)
    assert_counters_like(opt, plain)


@pytest.mark.parametrize(("stacked_cls", "torch_cls", "kwargs"), CASES, ids=IDS)
def test_default_float64_matches_torch(
    default64: None, stacked_cls: Any, torch_cls: Any, kwargs: dict[str, Any]
) -> None:
    assert torch.tensor(0.0).dtype == torch.float64  # the fixture is in force
    run_pair(stacked_cls, torch_cls, kwargs)


@pytest.mark.parametrize(("stacked_cls", "torch_cls", "kwargs"), CASES[:5], ids=IDS[:5])
def test_default_float32_unchanged(
    stacked_cls: Any, torch_cls: Any, kwargs: dict[str, Any]
) -> None:
    """Under the usual float32 default dtype the counters stay float32, as torch's do."""
    assert torch.get_default_dtype() == torch.float32
    run_pair(stacked_cls, torch_cls, kwargs)
    opt = stacked_cls([torch.zeros(N, 2, dtype=torch.float64, requires_grad=True)], **kwargs)
    opt.prepare()
    assert {v.dtype for v in next(iter(opt.state.values())).values() if v.dim() == 1} == {
        torch.float32
    }


def torch_counters(torch_cls: Any, kwargs: dict[str, Any]) -> dict[str, torch.dtype]:
    """The dtypes torch itself gives its per-step scalars now: a twin's state after one step."""
    m = net()
    own = train_alone(
        m, batches(1), make_opt=lambda m: torch_cls(m.parameters(), **member(kwargs, 0))
    )
    return {k: v.dtype for k, v in own.state[next(m.parameters())].items() if v.dim() == 0}


@pytest.mark.parametrize(("stacked_cls", "torch_cls", "kwargs"), CASES[:5], ids=IDS[:5])
def test_member_state_dict_continues_in_torch(
    default64: None, stacked_cls: Any, torch_cls: Any, kwargs: dict[str, Any]
) -> None:
    """Member i handed to torch midway continues exactly like the stacked member, and the
    handed counters have the dtype torch's own would have."""
    ens = vmapens.Ensemble(net, N, seed=2)
    data = batches(2 * STEPS, seed=3)
    opt = stacked_cls(ens, **kwargs)
    train(ens, opt, data[:STEPS])
    handed = twins(ens.unstack())
    want = torch_counters(torch_cls, kwargs)
    for i, m in enumerate(handed):
        sd = opt.member_state_dict(i, m)
        assert {k: v.dtype for k, v in sd["state"][0].items() if v.dim() == 0} == want
        own = torch_cls(m.parameters(), **member(kwargs, i))
        own.load_state_dict(sd)
        train_alone(m, data[STEPS:], make_opt=own)
    train(ens, opt, data[STEPS:])
    assert_members_equal(ens, handed, **TOL)


def test_counters_keep_their_dtype() -> None:
    """Like torch's, counters keep the dtype they were created in: created under the float32
    default, they stay float32 after the default turns float64; saved from float64 ones, they
    load as float64 under the float32 default (torch's load_state_dict keeps ``step``)."""
    kwargs: dict[str, Any] = dict(lr=[1e-2, 2e-2, 5e-3], momentum_decay=[4e-3, 1e-2, 2e-3])
    data = batches(STEPS, seed=6)
    ens = vmapens.Ensemble(net, N, seed=5)
    alone = twins(ens.unstack())
    opt = optim.StackedNAdam(ens, **kwargs)
    plain = [torch.optim.NAdam(m.parameters(), **member(kwargs, i)) for i, m in enumerate(alone)]
    train(ens, opt, data[:5])
    for m, own in zip(alone, plain, strict=True):
        train_alone(m, data[:5], make_opt=own)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        train(ens, opt, data[5:10])
        for m, own in zip(alone, plain, strict=True):
            train_alone(m, data[5:10], make_opt=own)
        assert_members_equal(ens, alone, **TOL)
        assert_counters_like(opt, plain)  # float32: created under the float32 default
        # A float64 run, saved, then loaded and continued under the float32 default.
        ens64 = vmapens.Ensemble(net, N, seed=8)
        alone64 = twins(ens64.unstack())
        opt64 = optim.StackedNAdam(ens64, **kwargs)
        train(ens64, opt64, data[:10])
        plain64 = train_each(
            alone64,
            data[:10],
            make_opt=lambda i, m: torch.optim.NAdam(m.parameters(), **member(kwargs, i)),
        )
    finally:
        torch.set_default_dtype(before)
    loaded = optim.StackedNAdam(ens64, **kwargs)
    loaded.load_state_dict(opt64.state_dict())
    train(ens64, loaded, data[10:])
    again = [torch.optim.NAdam(m.parameters()) for m in alone64]
    for m, own, new in zip(alone64, plain64, again, strict=True):
        new.load_state_dict(own.state_dict())
        train_alone(m, data[10:], make_opt=new)
    assert_members_equal(ens64, alone64, **TOL)
    assert_counters_like(loaded, again)
    assert loaded.state[next(iter(ens64.parameters()))]["step"].dtype == torch.float64
