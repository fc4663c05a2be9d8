"""Journey: a researcher brings optimizers vmapens may not ship (docs/optim.md).

A user-written Lion (`torch.optim.Optimizer` subclass) through `stacked()` and through the
documented extension point (a `vmapens.StackedOptimizer` subclass), plain torch optimizers on
`ens.parameters()`, LBFGS, torch's implementation flags through the stacked twins, param
groups per layer and per member with `add_param_group` mid-run, and `LambdaLR` on a user's
stacked optimizer. The truth is each member trained alone with torch.optim (or the user's own
torch Lion), float64, on the same batches.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from test_optim_family import ReferenceLion
from torch import nn

import vmapens

N, STEPS = 3, 4
TOL = dict(rtol=1e-9, atol=1e-10)  # float64: same ops per element, only summation order differs


class Lion(ReferenceLion):
    """The researcher's own Lion: a `torch.optim.Optimizer` subclass vmapens has no twin for
    (the paper's, as tests/test_optim_family.py writes it)."""


def _column(value: Any, like: torch.Tensor) -> Any:
    """A hyperparameter as the user's rule uses it: a float, or an [n, 1, ...] column."""
    if isinstance(value, torch.Tensor) and value.dim() == 1:
        return value.to(like.dtype).view(-1, *([1] * (like.dim() - 1)))
    return value


def user_lion_rule(params, grads, state, group) -> None:
    """The same Lion written as the docs' `rule(params, grads, state, group)` on stacked tensors."""
    beta1, beta2 = group["betas"]
    state["step"].add_(1)
    for p, g, m in zip(params, grads, state["exp_avg"], strict=True):
        b1, b2 = _column(beta1, p), _column(beta2, p)
        lr, wd = _column(group["lr"], p), _column(group["weight_decay"], p)
        update = (m * b1 + g * (1 - b1)).sign()
        p.sub_((update + p * wd) * lr)
        m.mul_(b2).add_(g * (1 - b2))


class MyStackedLion(vmapens.StackedOptimizer):
    """The way out the docs give for an optimizer vmapens lacks: subclass StackedOptimizer."""

    hyperparameters = dict(vmapens.StackedLion.hyperparameters)  # Hyper itself is private
    torch_class = None
    rule = staticmethod(user_lion_rule)

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, **implementation):
        super().__init__(params, locals())

    def state_names(self, group):
        return ("exp_avg",)


@pytest.fixture(autouse=True)
def _float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def _factory() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def _setup(n: int = N):
    torch.manual_seed(0)
    alone = [_factory() for _ in range(n)]
    ens = vmapens.Ensemble.from_modules([copy.deepcopy(m) for m in alone])
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(6, 3, generator=g), torch.randn(6, 2, generator=g)) for _ in range(STEPS)
    ]
    return ens, alone, batches


def _ens_grads(ens, x, y) -> None:
    ens.zero_grad()
    ((ens(x) - y) ** 2).mean(dim=(1, 2)).sum().backward()


def _alone_grads(m, x, y) -> None:
    m.zero_grad()
    ((m(x) - y) ** 2).mean().backward()


def _assert_members(ens, alone) -> None:
    for i, m in enumerate(alone):
        torch.testing.assert_close(ens[i].state_dict(), m.state_dict(), **TOL, msg=f"member {i}")


# (1) A user-written torch Lion -------------------------------------------------------------


def test_stacked_refuses_a_user_optimizer_class():
    """docs/optim.md: `stacked` names the twin of a torch class; a user's class has none."""
    with pytest.raises(ValueError, match=r"^stacked: `torch_class` .*got Lion"):
        vmapens.optim.stacked(Lion)


def test_stacked_refusal_of_a_user_class_names_the_way_out():
    with pytest.raises(ValueError) as e:
        vmapens.optim.stacked(Lion)
    assert "StackedOptimizer" in str(e.value)


def test_user_lion_as_stacked_subclass_per_member_lr_matches_alone():
    ens, alone, batches = _setup()
    lrs, wds = [1e-3, 3e-3, 1e-2], [0.0, 0.1, 0.5]
    opt = MyStackedLion(ens.parameters(), lr=lrs, betas=(0.9, [0.99, 0.95, 0.9]), weight_decay=wds)
    beta2 = [0.99, 0.95, 0.9]
    twins = [
        Lion(m.parameters(), lr=lrs[i], betas=(0.9, beta2[i]), weight_decay=wds[i])
        for i, m in enumerate(alone)
    ]
    mask = torch.tensor([True, False, True])
    for k, (x, y) in enumerate(batches):
        _ens_grads(ens, x, y)
        opt.step(mask=mask if k == 1 else None)  # member 1 skips step 1, as alone it is not stepped
        for i, (m, o) in enumerate(zip(alone, twins, strict=True)):
            _alone_grads(m, x, y)
            if k != 1 or mask[i]:
                o.step()
    _assert_members(ens, alone)
    for i, (m, o) in enumerate(zip(alone, twins, strict=True)):
        torch.testing.assert_close(
            opt.state[ens.get_parameter("0.weight")]["exp_avg"][i],
            o.state[m[0].weight]["exp_avg"],
            **TOL,
        )


def test_shipped_stacked_lion_matches_the_users_torch_lion_alone():
    ens, alone, batches = _setup()
    lrs = [1e-3, 3e-3, 1e-2]
    opt = vmapens.StackedLion(ens.parameters(), lr=lrs, weight_decay=0.1)
    twins = [Lion(m.parameters(), lr=lrs[i], weight_decay=0.1) for i, m in enumerate(alone)]
    for x, y in batches:
        _ens_grads(ens, x, y)
        opt.step()
        for m, o in zip(alone, twins, strict=True):
            _alone_grads(m, x, y)
            o.step()
    _assert_members(ens, alone)


# (2) A plain torch optimizer over ens.parameters() (shared hyperparameters) ----------------


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
        lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
        lambda ps: Lion(ps, lr=1e-2, weight_decay=0.1),
    ],
    ids=["sgd", "adam", "user-lion"],
)
def test_plain_elementwise_optimizer_on_the_stack_matches_alone(make):
    """docs/semantics.md: any elementwise optimizer over ens.parameters() is each member alone."""
    ens, alone, batches = _setup()
    opt = make(ens.parameters())
    twins = [make(m.parameters()) for m in alone]
    for x, y in batches:
        _ens_grads(ens, x, y)
        opt.step()
        for m, o in zip(alone, twins, strict=True):
            _alone_grads(m, x, y)
            o.step()
    _assert_members(ens, alone)


# (3) LBFGS --------------------------------------------------------------------------------


def test_lbfgs_has_no_stacked_twin_and_says_why():
    with pytest.raises(
        ValueError, match=r"^stacked: `torch_class` LBFGS has no stacked twin.*one LBFGS per member"
    ):
        vmapens.optim.stacked(torch.optim.LBFGS)


def test_stacked_step_takes_a_closure_once_as_torch():
    """A closure given to a stacked step is evaluated once, then the members step alone."""
    ens, alone, batches = _setup()
    opt = vmapens.optim.stacked(torch.optim.Adam)(ens.parameters(), lr=[1e-3, 1e-2, 1e-1])
    twins = [
        torch.optim.Adam(m.parameters(), lr=lr)
        for m, lr in zip(alone, [1e-3, 1e-2, 1e-1], strict=True)
    ]
    calls = []
    for x, y in batches:

        def closure(x=x, y=y):
            calls.append(1)
            _ens_grads(ens, x, y)
            return None

        opt.step(closure)
        for m, o in zip(alone, twins, strict=True):
            o.step(lambda m=m, x=x, y=y: _alone_grads(m, x, y))
    assert len(calls) == STEPS
    _assert_members(ens, alone)


# (4) torch's implementation flags through stacked twins -----------------------------------


@pytest.mark.parametrize("per_member", [False, True], ids=["shared-lr", "per-member-lr"])
@pytest.mark.parametrize(
    "flags", [dict(foreach=False), dict(fused=True), dict(fused=False, foreach=True)]
)
def test_adam_flags_through_stacked_match_alone(flags, per_member):
    """Shared hyperparameters take torch's fused kernel (docs/optim.md), per-member ones the rule."""
    ens, alone, batches = _setup()
    lrs = [1e-3, 1e-2, 1e-1] if per_member else [1e-2] * N
    lr = lrs if per_member else 1e-2
    opt = vmapens.optim.stacked(torch.optim.Adam)(
        ens.parameters(), lr=lr, weight_decay=0.01, **flags
    )
    twins = [
        torch.optim.Adam(m.parameters(), lr=lr, weight_decay=0.01, **flags)
        for m, lr in zip(alone, lrs, strict=True)
    ]
    for x, y in batches:
        _ens_grads(ens, x, y)
        opt.step()
        for m, o in zip(alone, twins, strict=True):
            _alone_grads(m, x, y)
            o.step()
    _assert_members(ens, alone)
    # the flags are kept and handed to torch with the member
    member = ens[2]
    handed = torch.optim.Adam(member.parameters(), **flags)
    handed.load_state_dict(opt.member_state_dict(2, module=member))
    for k, v in flags.items():
        assert handed.param_groups[0][k] == v


@pytest.mark.parametrize(
    "flags, match",
    [
        (dict(capturable=True), r"^StackedAdam: `capturable=True` is not supported"),
        (dict(differentiable=True), r"^StackedAdam: `differentiable=True` is not supported"),
        (
            dict(fused=True, foreach=True),
            r"^StackedAdam: `fused` and `foreach` cannot both be True",
        ),
    ],
)
def test_unsupported_flags_are_refused_clearly(flags, match):
    ens, _, _ = _setup()
    with pytest.raises(ValueError, match=match):
        vmapens.optim.stacked(torch.optim.Adam)(ens.parameters(), **flags)


def test_user_stacked_subclass_refuses_any_implementation_flag():
    ens, _, _ = _setup()
    with pytest.raises(TypeError, match="foreach"):
        MyStackedLion(ens.parameters(), foreach=False)


# (5) Param groups: per layer and per member, add_param_group mid-run ----------------------


def test_groups_per_layer_and_member_with_add_param_group_mid_run():
    ens, alone, batches = _setup()
    lr0, lr2, b1 = [1e-3, 1e-2, 3e-2], [5e-2, 1e-3, 2e-2], [0.9, 0.8, 0.5]
    first = [ens.get_parameter("0.weight"), ens.get_parameter("0.bias")]
    opt = vmapens.optim.stacked(torch.optim.AdamW)(
        [{"params": first, "lr": lr0, "weight_decay": [0.0, 0.1, 0.2]}], betas=(b1, 0.999)
    )
    twins = [
        torch.optim.AdamW(
            [{"params": list(m[0].parameters()), "lr": lr0[i], "weight_decay": [0.0, 0.1, 0.2][i]}],
            betas=(b1[i], 0.999),
        )
        for i, m in enumerate(alone)
    ]
    for k, (x, y) in enumerate(batches):
        if k == 2:  # unfreeze the head: a group of its own, its own per-member lr
            opt.add_param_group(
                {"params": [ens.get_parameter("2.weight"), ens.get_parameter("2.bias")], "lr": lr2}
            )
            for i, (m, o) in enumerate(zip(alone, twins, strict=True)):
                o.add_param_group({"params": list(m[2].parameters()), "lr": lr2[i]})
        _ens_grads(ens, x, y)
        opt.step()
        for m, o in zip(alone, twins, strict=True):
            _alone_grads(m, x, y)
            o.step()
    _assert_members(ens, alone)
    assert list(opt.param_groups[1]["betas"][0]) == b1  # the added group took the defaults' betas


# (6) LambdaLR on a user's stacked optimizer -----------------------------------------------


def test_lambdalr_on_user_stacked_lion_matches_alone():
    ens, alone, batches = _setup()
    lrs = [1e-3, 3e-3, 1e-2]

    def warmup(epoch: int) -> float:
        return min(1.0, (epoch + 1) / 3) * 0.9**epoch

    opt = MyStackedLion(ens.parameters(), lr=lrs, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    twins = [
        Lion(m.parameters(), lr=lr, weight_decay=0.1) for m, lr in zip(alone, lrs, strict=True)
    ]
    alone_scheds = [torch.optim.lr_scheduler.LambdaLR(o, warmup) for o in twins]
    for x, y in batches:
        _ens_grads(ens, x, y)
        opt.step()
        sched.step()
        for m, o, s in zip(alone, twins, alone_scheds, strict=True):
            _alone_grads(m, x, y)
            o.step()
            s.step()
    assert list(opt.param_groups[0]["lr"]) == [o.param_groups[0]["lr"] for o in twins]
    _assert_members(ens, alone)
    # the schedule resumes from its state dict, as torch's
    sd = sched.state_dict()
    again = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    again.load_state_dict(sd)
    assert again.last_epoch == alone_scheds[0].last_epoch


def test_make_step_refuses_a_built_lbfgs_naming_why():
    ens, _, batches = _setup()
    with pytest.raises(
        TypeError, match=r"^make_step: `optimizer` torch.optim.LBFGS is not elementwise"
    ):
        vmapens.make_step(ens, nn.functional.mse_loss, torch.optim.LBFGS(ens.parameters()))


class TunedAdafactor(torch.optim.Adafactor):
    """A user's subclass of a torch optimizer that mixes a tensor's rows (row/column stats)."""


def test_make_step_refuses_a_subclass_of_a_mixing_torch_optimizer():
    ens, _, _ = _setup()
    with pytest.raises(TypeError, match="is not elementwise"):
        vmapens.make_step(ens, nn.functional.mse_loss, TunedAdafactor(ens.parameters()))
