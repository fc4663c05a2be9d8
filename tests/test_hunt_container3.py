"""Reshaping an ensemble mid-training, each against plain torch.

The truth is N plain modules, each with its own ``torch.optim`` optimizer (and scheduler),
trained alone; a selected member's twin is a fresh module loaded with the plain member's
state dict and an optimizer loaded with the plain optimizer's state dict, as a user would
carry one member on. Everything is float64, so members agree to summation order.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from truth import assert_members_equal, seeded_members

import vmapens

N = 4
LRS = [0.01, 0.02, 0.03, 0.04]
BETAS = [(0.9, 0.99), (0.8, 0.999), (0.7, 0.9), (0.95, 0.95)]


def mlp() -> nn.Module:
    # No bias before the BatchNorm: its gradient is rounding noise, which Adam amplifies.
    return nn.Sequential(
        nn.Linear(3, 4, bias=False), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2)
    ).double()


def sized(h: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(3, h, bias=False), nn.BatchNorm1d(h), nn.Tanh(), nn.Linear(h, 2)
    ).double()


def batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(5, 3, generator=g, dtype=torch.float64),
         torch.randn(5, 2, generator=g, dtype=torch.float64))
        for _ in range(count)
    ]  # fmt: skip


def ens_step(ens: vmapens.Ensemble, opt: Any, x: torch.Tensor, y: torch.Tensor, mask: Any) -> None:
    opt.zero_grad()
    ((ens(x) - y) ** 2).mean(dim=(1, 2)).sum().backward()  # member i's grad: its own loss's
    opt.step(mask=None if mask is None else torch.tensor(mask, dtype=torch.bool))


def plain_step(models: list, opts: list, x: torch.Tensor, y: torch.Tensor, mask: Any) -> None:
    for i, (m, o) in enumerate(zip(models, opts, strict=True)):
        if mask is None or mask[i]:
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
        else:  # a masked member still runs the forward: its BatchNorm statistics move
            m(x)


def carried(
    factory: Callable[[], nn.Module], models: list, opts: list, rows: list[int], **kw: Any
) -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
    """Independent plain twins of ``models[r]`` for each ``r`` in ``rows`` (repeats give two
    independent copies), each with an Adam loaded from ``opts[r]``'s state dict."""
    twins, twin_opts = [], []
    for r in rows:
        twin = factory()
        twin.load_state_dict(models[r].state_dict())
        opt = torch.optim.Adam(twin.parameters(), **kw)
        opt.load_state_dict(copy.deepcopy(opts[r].state_dict()))
        twins.append(twin)
        twin_opts.append(opt)
    return twins, twin_opts


def trained_pair() -> tuple[vmapens.Ensemble, Any, Any, list, list, list]:
    """An ensemble and its plain twins after three Adam steps with per-member learning rates
    and betas, a StepLR, and masked steps (so members' step counts differ)."""
    members = seeded_members(mlp, N)
    ens = vmapens.Ensemble.from_modules(members)
    opt = vmapens.StackedAdam(ens, lr=LRS, betas=BETAS, amsgrad=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    opts = [
        torch.optim.Adam(m.parameters(), lr=LRS[i], betas=BETAS[i], amsgrad=True)
        for i, m in enumerate(members)
    ]
    scheds = [torch.optim.lr_scheduler.StepLR(o, 2, gamma=0.5) for o in opts]
    for (x, y), mask in zip(batches(3), [None, [1, 0, 1, 0], [0, 1, 1, 1]], strict=True):
        ens_step(ens, opt, x, y, mask)
        plain_step(members, opts, x, y, mask)
        sched.step()
        for s in scheds:
            s.step()
    assert_members_equal(ens, members)
    return ens, opt, sched, members, opts, scheds


INDICES = [
    pytest.param([0, 0], id="duplicate"),
    pytest.param([3, 1], id="list"),
    pytest.param([-1, 0, -1], id="negative-duplicate"),
    pytest.param(slice(None, None, -2), id="reversed-slice"),
    pytest.param(torch.tensor([2, 2, 0]), id="int-tensor"),
    pytest.param(torch.tensor([True, False, True, False]), id="bool-mask"),
    pytest.param(np.array([1, 3]), id="numpy"),
]


@pytest.mark.parametrize("index", INDICES)
def test_a_selection_trains_on_as_plain_copies_of_its_members(index: Any) -> None:
    ens, opt, sched, members, opts, scheds = trained_pair()
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    if isinstance(index, slice):
        rows = list(range(N))[index]
    else:
        rows = torch.arange(N)[torch.as_tensor(index)].tolist()
    sub = ens[index]
    sub_opt = opt.select(index, sub)
    sub_sched = torch.optim.lr_scheduler.StepLR(sub_opt, 2, gamma=0.5)
    sub_sched.load_state_dict(sched.state_dict())
    twins, twin_opts = carried(mlp, members, opts, rows)
    twin_scheds = []
    for r, o in zip(rows, twin_opts, strict=True):
        s = torch.optim.lr_scheduler.StepLR(o, 2, gamma=0.5)
        s.load_state_dict(scheds[r].state_dict())
        twin_scheds.append(s)
    for x, y in batches(6)[3:]:
        ens_step(sub, sub_opt, x, y, None)
        plain_step(twins, twin_opts, x, y, None)
        sub_sched.step()
        for s in twin_scheds:
            s.step()
    assert_members_equal(sub, twins)  # repeated rows too: two independent copies
    for j, twin_opt in enumerate(twin_opts):
        got, want = sub_opt.member_state_dict(j), twin_opt.state_dict()
        assert got["param_groups"][0]["lr"] == want["param_groups"][0]["lr"]
        assert got["param_groups"][0]["betas"] == want["param_groups"][0]["betas"]
        for key, state in want["state"].items():
            for name, value in state.items():
                torch.testing.assert_close(got["state"][key][name], value, rtol=1e-9, atol=1e-10)
    for k, v in ens.state_dict().items():  # training the copy left the original alone
        assert torch.equal(v, before[k]), k


def test_the_original_trains_on_as_before_after_a_selection_trained() -> None:
    ens, opt, _, members, opts, _ = trained_pair()
    sub = ens[[1, 1]]
    sub_opt = opt.select([1, 1], sub)
    data = batches(6)[3:]
    for x, y in data:
        ens_step(sub, sub_opt, x, y, None)
    for x, y in data:
        ens_step(ens, opt, x, y, None)
        plain_step(members, opts, x, y, None)
    assert_members_equal(ens, members)


def test_a_selection_of_a_selection_carries_the_first_ones_members() -> None:
    ens, opt, _, members, opts, _ = trained_pair()
    sub = ens[[2, 2, 1]]
    sub_opt = opt.select([2, 2, 1], sub)
    inner = sub[[2, 0]]
    inner_opt = sub_opt.select([2, 0], inner)
    assert list(inner.member_ids) == [1, 2]
    twins, twin_opts = carried(mlp, members, opts, [1, 2])
    for x, y in batches(5)[3:]:
        ens_step(inner, inner_opt, x, y, None)
        plain_step(twins, twin_opts, x, y, None)
    assert_members_equal(inner, twins)


def test_members_of_different_sizes_selected_train_on_as_alone() -> None:
    widths = [2, 5, 3, 5]
    ens = vmapens.Ensemble.from_factories([partial(sized, h) for h in widths], seed=0)
    members = ens.unstack()
    opt = vmapens.StackedAdam(ens, lr=LRS, weight_decay=0.01)
    opts = [torch.optim.Adam(m.parameters(), lr=LRS[i], weight_decay=0.01) for i, m in
            enumerate(members)]  # fmt: skip
    data = batches(5)
    for x, y in data[:2]:
        ens_step(ens, opt, x, y, None)
        plain_step(members, opts, x, y, None)
    rows = [3, 0, 0, 2]
    sub = ens[rows]
    sub_opt = opt.select(rows, sub)
    twins, twin_opts = [], []
    for r in rows:
        twin, twin_opt = carried(partial(sized, widths[r]), members, opts, [r])
        twins += twin
        twin_opts += twin_opt
    for x, y in data[2:]:
        ens_step(sub, sub_opt, x, y, None)
        plain_step(twins, twin_opts, x, y, None)
    assert_members_equal(sub, twins)


def test_a_selection_converted_to_float32_after_its_optimizer_trains_as_alone() -> None:
    ens, opt, _, members, opts, _ = trained_pair()
    rows = [3, 1, 3]
    sub = ens[rows]
    sub_opt = opt.select(rows, sub)  # the optimizer first, then .to(): torch allows it
    sub.to(torch.float32)
    assert sub.state_dict()["1.num_batches_tracked"].dtype == torch.int64
    twins = [m.float() for m in carried(mlp, members, opts, rows)[0]]
    twin_opts = []
    for r, twin in zip(rows, twins, strict=True):
        o = torch.optim.Adam(twin.parameters())
        o.load_state_dict(copy.deepcopy(opts[r].state_dict()))  # torch casts the state
        twin_opts.append(o)
    for x, y in batches(6)[3:]:
        ens_step(sub, sub_opt, x.float(), y.float(), None)
        plain_step(twins, twin_opts, x.float(), y.float(), None)
    assert_members_equal(sub, twins, rtol=1e-5, atol=1e-6)


BAD = [
    (4, IndexError, r"member index 4 out of range for 4 members"),
    ([0, -5], IndexError, r"member index -5 out of range"),
    (torch.tensor([0.0, 1.0]), TypeError, r"index must be an integer-like"),
    (torch.tensor([[0, 1]]), TypeError, r"1-D integer/bool tensor"),
    (torch.tensor([True, False]), IndexError, r"bool mask must have shape \[4\]"),
    ("0", TypeError, r"index must be an integer-like.*got str"),
    # torch reads a uint8 tensor as a mask ([1, 0, 1, 0] picks rows 0 and 2), where it was
    # taken as the rows 1, 0, 1, 0: refused, naming both readings.
    (torch.tensor([1, 0, 1, 0], dtype=torch.uint8), TypeError, r"uint8 tensor.*index\.bool\(\)"),
]


def test_a_bad_index_is_refused_and_changes_nothing() -> None:
    ens, opt, _, members, opts, _ = trained_pair()
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    opt_before = str(opt.state_dict())
    for index, error, message in BAD:
        with pytest.raises(error, match=r"^Ensemble: .*" + message):
            ens[index]
        with pytest.raises(error, match=r"^StackedAdam\.select: .*" + message):
            opt.select(index, ens)
    with pytest.raises(IndexError, match=r"^Ensemble: selecting no members"):
        ens[4:]
    for empty in (slice(4, None), torch.zeros(4, dtype=torch.bool)):  # said as Ensemble's
        with pytest.raises(IndexError, match=r"^StackedAdam\.select: selecting no members"):
            opt.select(empty, ens)
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert str(opt.state_dict()) == opt_before
    for x, y in batches(4)[3:]:  # and both train on as before
        ens_step(ens, opt, x, y, None)
        plain_step(members, opts, x, y, None)
    assert_members_equal(ens, members)
