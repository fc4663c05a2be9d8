"""Handing optimizer state on: ``StackedOptimizer.select`` to a sub-ensemble,
``member_state_dict`` to a plain torch optimizer, ``best_k(..., optimizer=)``.

Truth: each member's own module and plain ``torch.optim`` twin, built with the same param-group
layout (biases and the first layer in groups of their own, not in the module's order), stepped
on the same batches; the kept members then go on, and must end where their twins end.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import vmapens

pytestmark = pytest.mark.usefixtures("float64_default")

N, ROWS = 4, [2, 0]
# Per-member scalars (bias corrections) are float64 tensors where torch has Python floats:
# glibc's pow and torch.pow may differ in the last bit of a double.
TOL64 = dict(rtol=1e-12, atol=1e-14)


class Net(nn.Module):
    """Two layers of one shape: a mix-up of them passes every shape check."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


Groups = Callable[[dict[str, Any], Any], list[dict[str, Any]]]


def reordered(p: dict[str, Any], lr: Any) -> list[dict[str, Any]]:
    """The second layer first, the first with its own learning rate: not the module's order."""
    return [
        {"params": [p["fc2.weight"], p["fc2.bias"]], "lr": lr},
        {"params": [p["fc1.weight"], p["fc1.bias"]], "lr": 0.1},
    ]


def no_decay_biases(p: dict[str, Any], lr: Any) -> list[dict[str, Any]]:
    """The usual layout: weights decayed, biases (listed first) not."""
    return [
        {"params": [p["fc2.bias"], p["fc1.bias"]], "lr": lr, "weight_decay": 0.0},
        {"params": [p["fc2.weight"], p["fc1.weight"]], "lr": lr},
    ]


def head_only(p: dict[str, Any], lr: Any) -> list[dict[str, Any]]:
    """A frozen backbone (fc1) left out of the optimizer."""
    return [{"params": [p["fc2.bias"], p["fc2.weight"]], "lr": lr}]


# (id, stacked optimizer class, torch class, options, layout, per-member lr)
CASES = [
    ("adam-reordered", vmapens.StackedAdam, torch.optim.Adam, {}, reordered, False),
    ("adam-reordered-lrs", vmapens.StackedAdam, torch.optim.Adam, {}, reordered, True),
    (
        "adamw-no-decay-biases",
        vmapens.StackedAdam,
        torch.optim.AdamW,
        {"weight_decay": 0.1},
        no_decay_biases,
        True,
    ),
    (
        "sgd-momentum-reordered",
        vmapens.StackedSGD,
        torch.optim.SGD,
        {"momentum": 0.9},
        reordered,
        True,
    ),
    ("adam-head-only", vmapens.StackedAdam, torch.optim.Adam, {}, head_only, True),
]
LRS = [1e-2, 3e-2, 5e-3, 2e-2]


class Run:
    """An ensemble and its stacked optimizer beside N plain modules and their twins."""

    def __init__(self, stacked: type, plain: type, options: dict, groups: Groups, per: bool):
        self.ens = vmapens.Ensemble(Net, n=N, seed=0)
        if groups is head_only:
            for name in ("fc1.weight", "fc1.bias"):
                self.ens.stacked_params()[name].requires_grad_(False)
        self.models = self.ens.unstack()
        options = (
            dict(options, decoupled_weight_decay=True) if plain is torch.optim.AdamW else options
        )
        lr = torch.tensor(LRS) if per else 1e-2
        self.opt = stacked(groups(self.ens.stacked_params(), lr), **options)
        opts = dict(options)
        opts.pop("decoupled_weight_decay", None)
        self.twins = [
            plain(groups(dict(m.named_parameters()), LRS[i] if per else 1e-2), **opts)
            for i, m in enumerate(self.models)
        ]
        self.groups, self.x = groups, torch.randn(5, 4)

    def step(self, times: int = 1) -> None:
        for _ in range(times):
            self.opt.zero_grad()
            self.ens(self.x).pow(2).mean(dim=(1, 2)).sum().backward()
            self.opt.step()
            for m, opt in zip(self.models, self.twins, strict=True):
                opt.zero_grad()
                m(self.x).pow(2).mean().backward()
                opt.step()

    def keep(self, rows: list[int], sub: Any, opt: Any) -> None:
        self.ens, self.opt = sub, opt
        self.models, self.twins = [self.models[r] for r in rows], [self.twins[r] for r in rows]

    def check(self) -> None:
        for i, m in enumerate(self.models):
            for name, p in m.named_parameters():
                torch.testing.assert_close(self.ens.stacked_params()[name][i], p, **TOL64)


def _case(case: tuple) -> Run:
    return Run(*case[1:])


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("how", ["module", "parameters", "deepcopy", "best_k"])
def test_select_goes_on_as_alone(case: tuple, how: str) -> None:
    """A sub-ensemble's optimizer holds each parameter's own state and hyperparameters: the
    kept members go on exactly as their twins (was: parameters matched by the module's order
    to groups in another order, the wrong learning rates and moments, silently)."""
    run = _case(case)
    run.step(2)
    if how == "best_k":
        scores = torch.tensor([3.0, 9.0, 1.0, 8.0])  # rows 2 then 0 best
        sub, opt = vmapens.selection.best_k(run.ens, scores, 2, optimizer=run.opt)
    else:
        sub = run.ens.select(ROWS)
        given = {
            "module": sub,
            "parameters": sub.parameters(),  # the module's order, as torch users pass them
            "deepcopy": copy.deepcopy(sub),  # no record of its source: matched by value
        }[how]
        opt = run.opt.select(ROWS, given)
        sub = given if how == "deepcopy" else sub
    run.keep(ROWS, sub, opt)
    run.step(2)
    run.check()
    for k, twin in enumerate(run.twins):
        mine = run.opt.member_state_dict(k, module=run.models[k])
        theirs = twin.state_dict()
        assert [g["lr"] for g in mine["param_groups"]] == [g["lr"] for g in theirs["param_groups"]]
        for j, state in theirs["state"].items():
            for key, v in state.items():
                torch.testing.assert_close(mine["state"][j][key], v, **TOL64)


def test_select_refuses_what_values_cannot_tell_apart() -> None:
    """A copy of the sub-ensemble (no record of its source) whose parameters values alone do not
    tell apart (biases initialised to zero, before any step) is refused, not guessed."""
    run = _case(CASES[0])
    with torch.no_grad():
        for name in ("fc1.bias", "fc2.bias"):
            run.ens.stacked_params()[name].zero_()
    sub = copy.deepcopy(run.ens.select(ROWS))
    with pytest.raises(ValueError, match=r"StackedAdam\.select: .*values alone.*best_k"):
        run.opt.select(ROWS, sub)


def test_select_refuses_a_list_out_of_order() -> None:
    """A list of the sub-ensemble's own tensors in another order than the optimizer's, with
    some left out so that they cannot all be matched, is refused naming the order."""
    run = _case(CASES[0])
    run.step()
    sub = run.ens.select(ROWS)
    fresh = [p.detach().clone() for p in sub.parameters()]
    mixed = [sub.stacked_params()["fc1.weight"], fresh[1], fresh[2], fresh[3]]
    with pytest.raises(ValueError, match=r"`params\[0\]` holds the rows of .*optimizer's order"):
        run.opt.select(ROWS, mixed)


def test_select_refuses_copies_in_the_module_order() -> None:
    """A list of copies (no record of their source) in the module's order, where the values
    show that the optimizer's groups are in another order, is refused, not taken by position."""
    run = _case(CASES[0])
    run.step()
    copies = [p.detach().clone() for p in run.ens.select(ROWS).parameters()]
    with pytest.raises(ValueError, match=r"`params\[0\]` holds the rows of this optimizer's "):
        run.opt.select(ROWS, copies)
    names = {id(p): k for k, p in run.ens.named_parameters()}
    by_name = dict(zip([k for k, _ in run.ens.named_parameters()], copies, strict=True))
    order = [by_name[names[id(p)]] for g in run.opt.param_groups for p in g["params"]]
    sub_opt = run.opt.select(ROWS, order)  # the optimizer's order: taken as given
    held = [p for g in sub_opt.param_groups for p in g["params"]]
    assert all(p is q for p, q in zip(held, order, strict=True))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_member_state_dict_hands_off_any_group_layout(case: tuple) -> None:
    """``member_state_dict(i, module=)`` takes a member whose optimizer has groups in another
    order than its module (was refused: shapes compared in group order), and the member then
    goes on alone as its twin."""
    run = _case(case)
    run.step(2)
    i = 1
    member = run.ens[i]
    plain = type(run.twins[i])
    opt = plain(run.groups(dict(member.named_parameters()), 0.5))
    opt.load_state_dict(run.opt.member_state_dict(i, module=member))
    for _ in range(2):
        for m, o in ((member, opt), (run.models[i], run.twins[i])):
            o.zero_grad()
            m(run.x).pow(2).mean().backward()
            o.step()
    for (name, p), q in zip(member.named_parameters(), run.models[i].parameters(), strict=True):
        torch.testing.assert_close(p, q, **TOL64, msg=name)


def test_member_state_dict_still_refuses_another_module() -> None:
    run = _case(CASES[0])
    with pytest.raises(ValueError, match=r"member_state_dict: `module` parameters do not match"):
        run.opt.member_state_dict(0, module=nn.Linear(4, 3))


def test_select_refuses_a_sub_ensemble_of_other_rows() -> None:
    """``opt.select(rows, ens.select(other_rows))`` would give each kept member another
    member's moments and learning rate: refused, naming both."""
    run = _case(CASES[1])
    run.step()
    with pytest.raises(ValueError, match=r"cut from rows \[0, 2\].*rows \[2, 0\]"):
        run.opt.select(ROWS, run.ens.select([0, 2]))
    mask = torch.tensor([True, False, True, False])  # the same rows, written otherwise
    assert len(run.opt.select(mask, run.ens.select([0, 2])).param_groups) == 2


def _held_as_laid_out(opt: Any, sub: Any) -> None:
    """``opt`` holds ``sub``'s parameters in the optimizer's layout, with its learning rates."""
    held = [[id(p) for p in g["params"]] for g in opt.param_groups]
    assert held == [[id(p) for p in g["params"]] for g in reordered(sub.stacked_params(), 0)]
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 0.1]


def test_select_after_the_sub_ensemble_is_converted_to_new_parameters() -> None:
    """``sub.float()`` under ``set_overwrite_module_params_on_conversion(True)`` gives the
    sub-ensemble new Parameters: still matched by name, also where values cannot tell them
    apart (biases initialised to zero, before any step)."""
    run = _case(CASES[0])
    with torch.no_grad():
        for name in ("fc1.bias", "fc2.bias"):
            run.ens.stacked_params()[name].zero_()
    sub = run.ens.select(ROWS)
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        before = dict(sub.stacked_params())
        sub.float()
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    assert all(sub.stacked_params()[k] is not p for k, p in before.items())
    _held_as_laid_out(run.opt.select(ROWS, sub), sub)


def test_select_matches_a_cast_copy_by_value() -> None:
    """A copy of the sub-ensemble cast to float32 (no record of its source) is matched by its
    values in its own dtype (was: refused, float64 rows never equal float32 tensors)."""
    run = _case(CASES[0])
    run.step()
    sub = copy.deepcopy(run.ens.select(ROWS)).float()
    _held_as_laid_out(run.opt.select(ROWS, sub), sub)


class Wide(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(3, h), nn.Linear(h, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def test_select_padded_members_with_groups_out_of_order() -> None:
    """Members of different sizes (``from_factories``), biases without weight decay in a group
    listed first, a masked step: the kept members go on as their AdamW twins (was refused: the
    module's shapes compared in group order)."""
    widths, rows, x = [2, 5, 3, 5], [1, 2], torch.randn(5, 3)
    ens = vmapens.Ensemble.from_factories([lambda h=h: Wide(h) for h in widths], seed=0)
    models = ens.unstack()
    opt = vmapens.StackedAdam(
        no_decay_biases(ens.stacked_params(), torch.tensor(LRS)),
        weight_decay=0.1,
        decoupled_weight_decay=True,
    )
    twins = [
        torch.optim.AdamW(no_decay_biases(dict(m.named_parameters()), LRS[i]), weight_decay=0.1)
        for i, m in enumerate(models)
    ]

    def step(ens: Any, opt: Any, mask: torch.Tensor | None = None) -> None:
        opt.zero_grad()
        ens(x).pow(2).mean(dim=(1, 2)).sum().backward()
        opt.step(mask=mask)
        for i, (m, twin) in enumerate(zip(models, twins, strict=True)):
            if mask is None or mask[i]:
                twin.zero_grad()
                m(x).pow(2).mean().backward()
                twin.step()

    step(ens, opt)
    step(ens, opt, torch.tensor([True, False, True, True]))
    sub = ens.select(rows)
    sub_opt = opt.select(rows, sub)
    models, twins = [models[r] for r in rows], [twins[r] for r in rows]
    step(sub, sub_opt)
    for k, (m, twin) in enumerate(zip(models, twins, strict=True)):
        mine = sub[k]
        for (name, p), q in zip(mine.named_parameters(), m.parameters(), strict=True):
            torch.testing.assert_close(p, q, **TOL64, msg=name)
        handed = sub_opt.member_state_dict(k, module=mine)
        for j, state in twin.state_dict()["state"].items():
            for key, v in state.items():
                torch.testing.assert_close(handed["state"][j][key], v, **TOL64)


@pytest.mark.parametrize("bad", ["fc1", [{"params": []}], 3.0], ids=["str", "groups", "float"])
def test_select_names_params_of_the_wrong_type(bad: Any) -> None:
    run = _case(CASES[0])
    with pytest.raises(TypeError, match=r"StackedAdam\.select: `params` must be"):
        run.opt.select(ROWS, bad)


def test_member_state_dict_names_a_module_of_the_wrong_type() -> None:
    run = _case(CASES[0])
    with pytest.raises(TypeError, match=r"member_state_dict: `module` must be an nn.Module"):
        run.opt.member_state_dict(0, module=dict(run.models[0].named_parameters()))


def test_member_state_dict_checks_by_name_with_param_names() -> None:
    """With ``param_names`` (groups of ``(name, tensor)`` pairs, as torch takes them), the
    module is checked name by name: a module whose layers swap names but not shapes as a
    whole is refused; the member's own, with groups out of order, is taken."""

    class Net2(nn.Module):
        def __init__(self, swap: bool = False) -> None:
            super().__init__()
            a, b = nn.Linear(4, 3), nn.Linear(3, 4)
            self.fc1, self.fc2 = (b, a) if swap else (a, b)

    ens = vmapens.Ensemble(Net2, n=2, seed=0)
    p = dict(ens.named_parameters())
    opt = vmapens.StackedAdam(
        [
            {"params": [(k, p[k]) for k in ("fc2.bias", "fc2.weight")]},
            {"params": [(k, p[k]) for k in ("fc1.weight", "fc1.bias")], "lr": 0.1},
        ]
    )
    groups = opt.member_state_dict(1, module=ens[1])["param_groups"]
    assert [g["param_names"] for g in groups] == [
        ["fc2.bias", "fc2.weight"],
        ["fc1.weight", "fc1.bias"],
    ]
    with pytest.raises(ValueError, match=r"`module` parameters \['fc2.bias'.*not a member"):
        opt.member_state_dict(1, module=Net2(swap=True))
