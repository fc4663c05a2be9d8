"""Masked steps and failed steps against plain ``torch.optim`` (optim/_keep.py, _fused.py).

The truth is N plain modules, each with its own ``torch.optim`` optimizer stepped only where
the mask is True (float64), and the documented promise: a masked-out member keeps its
parameters, state and step count bit for bit, and a step that fails changes nothing.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import vmapens
from vmapens.optim import (
    StackedAdagrad,
    StackedAdam,
    StackedLion,
    StackedOptimizer,
    StackedRMSprop,
    StackedRprop,
    StackedSGD,
    _keep,
)

N = 3


def ensemble() -> vmapens.Ensemble:
    return vmapens.Ensemble(lambda: nn.Linear(3, 2), N, seed=0).double()


def grads_(params: list[torch.Tensor], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64)


def saved(params: list[torch.Tensor], opt: StackedOptimizer) -> tuple[list, dict]:
    return [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())


def assert_unchanged(before: tuple[list, dict], params: list[torch.Tensor], opt: Any) -> None:
    old_params, old_state = before
    for p, q in zip(params, old_params, strict=True):
        assert torch.equal(p, q)
    new_state = opt.state_dict()["state"]
    assert new_state.keys() == old_state["state"].keys()
    for k, entry in old_state["state"].items():
        for name, v in entry.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(new_state[k][name], v), (k, name)


OPTIMIZERS: dict[str, Callable[[Any], StackedOptimizer]] = {
    "sgd_fused": lambda p: StackedSGD(p, lr=0.1, momentum=0.9),
    "adam_fused": lambda p: StackedAdam(p, lr=0.1),
    "adagrad_fused": lambda p: StackedAdagrad(p, lr=0.1),
    "adam_sweep": lambda p: StackedAdam(p, lr=[0.1, 0.05, 0.02], weight_decay=0.1),
    "rmsprop": lambda p: StackedRMSprop(p, lr=0.01, momentum=0.5),
    "rprop": lambda p: StackedRprop(p, lr=0.1),
    "lion": lambda p: StackedLion(p, lr=0.1),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_mask_that_cannot_reach_the_parameters_changes_nothing(name: str) -> None:
    """A mask without values (``meta``) is refused naming `mask`, before anything changes,
    even for rules that never read the mask (Rprop, Lion, RMSprop: only the optimizer's own
    keep-the-masked-rows pass reads it, after the update has written; a failure there is
    undone, see the interrupt test below)."""
    ens = ensemble()
    params: list[torch.Tensor] = list(ens.parameters())
    opt = OPTIMIZERS[name](params)
    grads_(params, 1)
    opt.step()
    grads_(params, 2)
    before = saved(params, opt)
    with pytest.raises(ValueError, match="`mask` must hold values"):
        opt.step(mask=torch.tensor([True, False, True], device="meta"))
    assert_unchanged(before, params, opt)


@pytest.mark.parametrize("name", ["adam_fused", "rprop", "adam_sweep"])
def test_interrupt_while_keeping_masked_rows_changes_nothing(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``KeyboardInterrupt`` between the masked rows of two tensors being put back leaves
    the whole step undone, not the update half kept."""
    ens = ensemble()
    params: list[torch.Tensor] = list(ens.parameters())
    opt = OPTIMIZERS[name](params)
    grads_(params, 1)
    opt.step()
    grads_(params, 2)
    before = saved(params, opt)
    column, calls = _keep.column, []

    def interrupted(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return column(values, like)

    monkeypatch.setattr(_keep, "column", interrupted)
    with pytest.raises(KeyboardInterrupt):
        opt.step(mask=torch.tensor([True, False, True]))
    monkeypatch.undo()
    assert_unchanged(before, params, opt)
    opt.step(mask=torch.tensor([True, False, True]))  # and the same step goes through after


#: (stacked optimizer, torch class, per-member torch kwargs): fused one-go paths and copies.
AGAINST_TORCH: dict[str, tuple[Callable[[Any], StackedOptimizer], type, list[dict]]] = {
    "sgd_fused": (
        lambda p: StackedSGD(p, lr=0.1, momentum=0.9, weight_decay=0.1),
        torch.optim.SGD,
        [dict(lr=0.1, momentum=0.9, weight_decay=0.1)] * N,
    ),
    "sgd_sweep": (
        lambda p: StackedSGD(p, lr=[0.1, 0.2, 0.05], momentum=0.9, nesterov=True),
        torch.optim.SGD,
        [dict(lr=lr, momentum=0.9, nesterov=True) for lr in (0.1, 0.2, 0.05)],
    ),
    "adam_fused": (
        lambda p: StackedAdam(p, lr=0.1, weight_decay=0.1),
        torch.optim.Adam,
        [dict(lr=0.1, weight_decay=0.1)] * N,
    ),
    "adamw_sweep": (
        lambda p: StackedAdam(
            p, lr=0.1, weight_decay=[0.0, 0.1, 0.3], decoupled_weight_decay=True, amsgrad=True
        ),
        torch.optim.AdamW,
        [dict(lr=0.1, weight_decay=wd, amsgrad=True) for wd in (0.0, 0.1, 0.3)],
    ),
    "adagrad_fused": (
        lambda p: StackedAdagrad(p, lr=0.1, weight_decay=0.1),
        torch.optim.Adagrad,
        [dict(lr=0.1, weight_decay=0.1)] * N,
    ),
    "rmsprop": (
        lambda p: StackedRMSprop(p, lr=0.01, momentum=0.5, weight_decay=0.1),
        torch.optim.RMSprop,
        [dict(lr=0.01, momentum=0.5, weight_decay=0.1)] * N,
    ),
    "rprop": (lambda p: StackedRprop(p, lr=0.1), torch.optim.Rprop, [dict(lr=0.1)] * N),
}

#: One mask per step: all members, some, none, and a bias whose gradient is None.
MASKS = [None, [True, False, True], [False, False, False], [True, True, True], [False, True, True]]


@pytest.mark.parametrize("name", list(AGAINST_TORCH))
def test_masked_steps_match_each_member_alone(name: str) -> None:
    """Each member ends where its own torch optimizer, stepped only where its mask is True,
    ends: parameters, state and step count, with zero gradient rows for one member (which
    steps, as torch steps a zero gradient) and a step where one parameter has no gradient."""
    make, torch_cls, kwargs = AGAINST_TORCH[name]
    ens = ensemble()
    params: list[torch.Tensor] = list(ens.parameters())
    twins = [nn.Linear(3, 2).double() for _ in range(N)]
    with torch.no_grad():
        for i, twin in enumerate(twins):
            for q, p in zip(twin.parameters(), params, strict=True):
                q.copy_(p[i])
    opt = make(params)
    torch_opts = [torch_cls(t.parameters(), **kw) for t, kw in zip(twins, kwargs, strict=True)]
    for step, rows in enumerate(MASKS):
        grads_(params, step)
        params[0].grad[1] = 0.0  # a member whose gradient rows are zeros still steps
        if step == 3:
            params[1].grad = None  # the bias skips this step in every member
        mask = None if rows is None else torch.tensor(rows)
        opt.step(mask=mask)
        for i, (twin, torch_opt) in enumerate(zip(twins, torch_opts, strict=True)):
            for q, p in zip(twin.parameters(), params, strict=True):
                q.grad = None if p.grad is None else p.grad[i].clone()
            if rows is None or rows[i]:
                torch_opt.step()
    for i, (twin, torch_opt) in enumerate(zip(twins, torch_opts, strict=True)):
        for q, p in zip(twin.parameters(), params, strict=True):
            torch.testing.assert_close(p[i], q, rtol=1e-12, atol=1e-12)
            for key, value in torch_opt.state[q].items():
                mine = opt.state[p][key]
                if key == "step" and torch_cls is not torch.optim.SGD:
                    assert mine[i].item() == value.item(), (i, key)
                elif isinstance(value, torch.Tensor):
                    torch.testing.assert_close(mine[i], value, rtol=1e-12, atol=1e-12)
