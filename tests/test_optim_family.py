"""Every stacked optimizer against N plain modules, each with its own torch optimizer.

One table drives every test: per optimizer, its torch twin (Lion: a reference written from
the paper), every hyperparameter shared and per member, and every flag.
"""

from __future__ import annotations

import copy
import dataclasses
import io
from collections.abc import Callable
from typing import Any

import models
import pytest
import torch
from torch import nn
from torch.func import stack_module_state

import vmapens
from vmapens._compiling import own_code
from vmapens.optim import (
    StackedAdagrad,
    StackedAdam,
    StackedAdamax,
    StackedLion,
    StackedNAdam,
    StackedOptimizer,
    StackedRMSprop,
    StackedSGD,
)

# float64 elementwise optimizer arithmetic against torch's: only the order of a few operations
# differs (~1e-16); held on every CPU setting of docs/semantics.md's hardware section.
TOL = 1e-10
CLOSE = dict(rtol=TOL, atol=TOL)
N = 4


class Net(nn.Module):
    """Small MLP with the awkward members: an unused parameter and a zero-size one."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(3, 4)
        self.fc2 = nn.Linear(4, 2)
        self.unused = nn.Parameter(torch.randn(2))  # grad stays None
        self.empty = nn.Parameter(torch.zeros(0, 3))  # zero-size, grad is zero-size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x))) + self.empty.sum()


class ReferenceLion(torch.optim.Optimizer):
    """Lion as Chen et al. (2023) write it (Program 1, decoupled decay), one tensor at a time."""

    def __init__(self, params: Any, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                m, g = state["exp_avg"], p.grad
                c = beta1 * m + (1 - beta1) * g
                p.sub_(group["lr"] * (torch.sign(c) + group["weight_decay"] * p))
                m.copy_(beta2 * m + (1 - beta2) * g)


@dataclasses.dataclass(frozen=True)
class Spec:
    """One optimizer's row of the table."""

    cls: type[StackedOptimizer]
    twin: type[torch.optim.Optimizer]
    shared: dict[str, Any]  # every hyperparameter shared, none at its default
    per: dict[str, Any]  # every hyperparameter per member (betas: a pair of lists)
    flags: dict[str, dict[str, Any]]  # each flag on, on top of `per`


LR = [1e-3, 3e-3, 1e-2, 3e-2]
WD = [0.0, 1e-3, 1e-2, 0.1]
BETAS = ([0.0, 0.5, 0.9, 0.95], [0.5, 0.9, 0.99, 0.999])
EPS = [1e-8, 1e-6, 1e-3, 1e-1]

SPECS = {
    "SGD": Spec(
        StackedSGD,
        torch.optim.SGD,
        dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
        dict(
            lr=LR, momentum=[0.0, 0.5, 0.9, 0.99], dampening=[0.0, 0.1, 0.5, 1.0], weight_decay=WD
        ),
        {
            "nesterov": dict(nesterov=True, momentum=[0.5, 0.8, 0.9, 0.99], dampening=0.0),
            "maximize": dict(maximize=True),
        },
    ),
    "Adam": Spec(
        StackedAdam,
        torch.optim.Adam,
        dict(lr=0.02, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05),
        dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD),
        {
            "amsgrad": dict(amsgrad=True),
            "maximize": dict(maximize=True),
            "decoupled": dict(decoupled_weight_decay=True),
        },
    ),
    "RMSprop": Spec(
        StackedRMSprop,
        torch.optim.RMSprop,
        dict(lr=0.01, alpha=0.9, eps=1e-6, weight_decay=0.01, momentum=0.5),
        dict(
            lr=LR,
            alpha=[0.5, 0.9, 0.99, 0.999],
            eps=[1e-8, 1e-6, 1e-4, 1e-2],
            weight_decay=WD,
            momentum=[0.0, 0.5, 0.9, 0.99],
        ),
        {"centered": dict(centered=True), "maximize": dict(maximize=True)},
    ),
    "Adagrad": Spec(
        StackedAdagrad,
        torch.optim.Adagrad,
        dict(lr=0.05, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.5, eps=1e-6),
        dict(
            lr=[0.01, 0.03, 0.1, 0.3],
            lr_decay=[0.0, 0.01, 0.1, 1.0],
            weight_decay=WD,
            initial_accumulator_value=[0.0, 0.1, 1.0, 10.0],
            eps=[1e-10, 1e-8, 1e-6, 1e-3],
        ),
        {"maximize": dict(maximize=True)},
    ),
    "Adamax": Spec(
        StackedAdamax,
        torch.optim.Adamax,
        dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05),
        dict(lr=[2e-3, 5e-3, 1e-2, 3e-2], betas=BETAS, eps=EPS, weight_decay=WD),
        {"maximize": dict(maximize=True)},
    ),
    "NAdam": Spec(
        StackedNAdam,
        torch.optim.NAdam,
        dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05, momentum_decay=0.01),
        dict(
            lr=[2e-3, 5e-3, 1e-2, 3e-2],
            betas=BETAS,
            eps=EPS,
            weight_decay=WD,
            momentum_decay=[0.0, 4e-3, 0.1, 1.0],
        ),
        {"decoupled": dict(decoupled_weight_decay=True), "maximize": dict(maximize=True)},
    ),
    "Lion": Spec(
        StackedLion,
        ReferenceLion,
        dict(lr=1e-3, betas=(0.8, 0.95), weight_decay=0.1),
        dict(
            lr=[1e-4, 3e-4, 1e-3, 3e-3],
            betas=([0.0, 0.5, 0.9, 0.95], [0.0, 0.9, 0.99, 0.999]),
            weight_decay=[0.0, 0.01, 0.1, 1.0],
        ),
        {},
    ),
}


def _cases() -> dict[str, tuple[Spec, dict[str, Any]]]:
    out = {}
    for name, spec in SPECS.items():
        out[f"{name}-defaults"] = (spec, {})
        out[f"{name}-shared"] = (spec, spec.shared)
        for key, values in spec.per.items():
            out[f"{name}-per_member_{key}"] = (spec, {**spec.shared, key: values})
        out[f"{name}-all_per_member"] = (spec, spec.per)
        for flag, extra in spec.flags.items():
            out[f"{name}-{flag}"] = (spec, {**spec.per, **extra})
    return out


CASES = _cases()
ALL = pytest.mark.parametrize(("spec", "kwargs"), list(CASES.values()), ids=list(CASES))
# Param groups as indices into Net's parameters: unused (grad None), empty, fc1's and fc2's. A
# group with every gradient takes the flat [n, total] update, one with a None the per-tensor one.
LAYOUTS = {
    "one_group": [[0, 1, 2, 3, 4, 5]],
    "two_groups": [[0, 1], [2, 3, 4, 5]],
    "mixed": [[0, 2], [1, 3, 4, 5]],  # both updates on real parameters
}


def member_kwargs(kwargs: dict[str, Any], i: int) -> dict[str, Any]:
    """Member i's plain-float hyperparameters."""

    def pick(v: Any) -> Any:
        return float(v[i]) if isinstance(v, list) else v

    return {k: tuple(map(pick, v)) if k == "betas" else pick(v) for k, v in kwargs.items()}


def grouped(params: list, layout: str) -> list[dict[str, Any]]:
    return [{"params": [params[k] for k in group]} for group in LAYOUTS[layout]]


def flat_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


class Rig:
    """N plain modules, each with its own twin optimizer, and their stacked optimizer."""

    def __init__(self, spec: Spec, kwargs: dict[str, Any], layout: str = "two_groups") -> None:
        torch.manual_seed(0)
        self.spec, self.kwargs, self.layout = spec, kwargs, layout
        self.members = [Net().double() for _ in range(N)]
        self.stacked = list(stack_module_state(self.members)[0].values())
        self.opt = spec.cls(grouped(self.stacked, layout), **kwargs)
        self.twins = [
            spec.twin(grouped(list(m.parameters()), layout), **member_kwargs(kwargs, i))
            for i, m in enumerate(self.members)
        ]

    @staticmethod
    def member_grads(module: nn.Module, t: int, i: int) -> None:
        """Backward of member i's loss on batch t (the same batch for every member)."""
        g = torch.Generator().manual_seed(1000 + t)
        x = torch.randn(8, 3, generator=g, dtype=torch.float64)
        y = torch.randn(8, 2, generator=g, dtype=torch.float64)
        module.zero_grad(set_to_none=True)
        ((module(x) - y) ** 2).mean().mul(i + 1).backward()

    def grads(self, t: int) -> list[torch.Tensor | None]:
        """The stacked gradients of step t, one per stacked parameter."""
        for i, m in enumerate(self.members):
            self.member_grads(m, t, i)
        per_param = zip(*(m.parameters() for m in self.members), strict=True)
        return [
            None if ps[0].grad is None else torch.stack([p.grad for p in ps]) for ps in per_param
        ]

    def step(self, t: int, mask: list[int] | None = None) -> None:
        """One step of both; masked-out members get NaN gradients and their twins don't step."""
        m = None if mask is None else torch.tensor(mask, dtype=torch.bool)
        for sp, g in zip(self.stacked, self.grads(t), strict=True):
            if g is not None and m is not None:
                g[~m] = float("nan")
            sp.grad = g
        for i, twin in enumerate(self.twins):
            if m is None or m[i]:
                twin.step()
        self.opt.step(mask=m)

    def assert_member(self, i: int, twin: torch.optim.Optimizer, params: list) -> None:
        """Member i's parameters and state equal ``twin``'s over ``params``."""
        ours = self.opt.member_state_dict(i)["state"]
        theirs = twin.state_dict()["state"]
        for k, (sp, p) in enumerate(zip(flat_params(self.opt), params, strict=True)):
            torch.testing.assert_close(sp[i], p, **CLOSE, msg=f"member {i}, param {k}")
            if not theirs.get(k):  # no state in the twin: none for us, or a never-stepped one
                assert k not in ours or self.opt.state[sp]["step"][i] == 0, (i, k)
                continue
            assert set(ours[k]) == set(theirs[k]), (i, k)
            for key, value in theirs[k].items():
                torch.testing.assert_close(ours[k][key], value, **CLOSE, msg=f"{key}, member {i}")

    def assert_matches(self) -> None:
        for i, twin in enumerate(self.twins):
            self.assert_member(i, twin, flat_params(twin))

    def snapshot(self) -> list[torch.Tensor]:
        params = flat_params(self.opt)
        return [t.clone() for p in params for t in (p.detach(), *self.opt.state[p].values())]


@ALL
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_matches_torch_twin_per_member(spec: Spec, kwargs: dict, layout: str) -> None:
    rig = Rig(spec, kwargs, layout)
    for t in range(4):
        rig.step(t)
    rig.assert_matches()


@ALL
def test_mask_freezes_members_bit_for_bit(spec: Spec, kwargs: dict) -> None:
    rig = Rig(spec, kwargs)
    rig.step(0)
    for t, mask in ((1, [1, 0, 1, 0]), (2, [0, 1, 1, 0])):
        before = rig.snapshot()
        rig.step(t, mask)
        for old, new in zip(before, rig.snapshot(), strict=True):
            for i in (i for i in range(N) if not mask[i]):
                assert torch.equal(new[i], old[i]), f"member {i} moved at step {t}"
    rig.assert_matches()


@ALL
def test_member_hand_off_continues_alone(spec: Spec, kwargs: dict) -> None:
    rig = Rig(spec, kwargs, "one_group")
    for t, mask in enumerate([None, [1, 1, 0, 1], None]):
        rig.step(t, mask)
    i = 2
    alone = Net().double()
    with torch.no_grad():
        for p, sp in zip(alone.parameters(), rig.stacked, strict=True):
            p.copy_(sp[i])
    twin = spec.twin(alone.parameters())  # default hyperparameters: the state dict brings i's
    twin.load_state_dict(rig.opt.member_state_dict(i, module=alone))
    counters = set(rig.opt.scalar_state(rig.opt.param_groups[0])) - {"step"}
    for state in twin.state.values():
        for key in counters & set(state):
            # torch's load_state_dict casts all state but `step` to the parameter's dtype: a
            # torch NAdam reloaded from its own state dict, too, keeps mu_product in float64
            # from then on. Uninterrupted, it keeps float32, as the ensemble does.
            state[key] = state[key].float()
    for t in range(3, 6):
        rig.step(t)
        rig.member_grads(alone, t, i)
        twin.step()
    rig.assert_matches()
    rig.assert_member(i, twin, list(alone.parameters()))


@ALL
def test_state_dict_round_trip_is_bit_identical(spec: Spec, kwargs: dict) -> None:
    rig = Rig(spec, kwargs)
    for t in range(2):
        rig.step(t)
    buf = io.BytesIO()
    torch.save(rig.opt.state_dict(), buf)
    params = [p.detach().clone().requires_grad_() for p in rig.stacked]
    replay = []
    for t, mask in ((2, [1, 0, 1, 1]), (3, None)):
        rig.step(t, mask)
        replay.append(([p.grad for p in rig.stacked], mask))
    fresh = spec.cls(grouped(params, rig.layout))  # defaults: loading brings the real ones
    buf.seek(0)
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    for grads, mask in replay:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        fresh.step(mask=None if mask is None else torch.tensor(mask, dtype=torch.bool))
    for ours, ref in zip(params, rig.stacked, strict=True):
        assert torch.equal(ours, ref)
        assert rig.opt.state[ref].keys() == fresh.state[ours].keys()
        for key, value in rig.opt.state[ref].items():
            assert torch.equal(fresh.state[ours][key], value), key


#: One case per optimizer for the compiled test: its first flag, on top of everything per member.
RICHEST = {
    name: f"{name}-{next(iter(spec.flags), 'all_per_member')}" for name, spec in SPECS.items()
}
#: ...and with every hyperparameter a shared float, which make_step(compile=True) bakes into
#: its graph as constants until one changes (vmapens/step.py).
COMPILED = [*RICHEST.values(), *(f"{name}-shared" for name in SPECS)]


@pytest.mark.parametrize("case", COMPILED)
def test_compiled_apply_gradients_matches_eager(case: str) -> None:
    spec, kwargs = CASES[case]
    rig = Rig(spec, kwargs, "mixed")
    eager = rig.opt
    params = [p.detach().clone().requires_grad_() for p in rig.stacked]
    compiled_opt = spec.cls(grouped(params, rig.layout), **kwargs)
    compiled_opt.prepare()  # state exists before tracing

    def apply(grads: list, mask: torch.Tensor) -> None:
        compiled_opt.apply_gradients(grads, mask=mask)

    # aot_eager traces the whole graph (fullgraph fails on any break) without inductor's C++
    # compile; make_step's test below runs inductor.
    apply_c = torch.compile(own_code(apply), fullgraph=True, backend="aot_eager")
    for t, mask in enumerate(([1, 1, 1, 1], [1, 0, 1, 1], [0, 1, 1, 1])):
        m = torch.tensor(mask, dtype=torch.bool)
        grads = rig.grads(t)
        grads = [grads[k] for group in LAYOUTS[rig.layout] for k in group]  # the optimizer's order
        eager.apply_gradients(grads, mask=m)
        apply_c(grads, m)
    for p, q in zip(params, rig.stacked, strict=True):
        torch.testing.assert_close(p, q, **CLOSE)
        for key, value in eager.state[q].items():
            torch.testing.assert_close(compiled_opt.state[p][key], value, **CLOSE, msg=key)


def test_make_step_compiled_sgd_equals_eager() -> None:
    torch.manual_seed(0)
    eager = vmapens.Ensemble.from_modules([models.MLP().double() for _ in range(N)])
    compiled = copy.deepcopy(eager)
    kwargs = dict(lr=0.05, momentum=[0.0, 0.5, 0.9, 0.99], dampening=0.1, weight_decay=WD)
    step_e = vmapens.make_step(eager, nn.MSELoss(), StackedSGD(eager, **kwargs))
    opt_c = StackedSGD(compiled, **kwargs)
    step_c = vmapens.make_step(compiled, nn.MSELoss(), opt_c, compile=True)
    g = torch.Generator().manual_seed(0)
    for mask in (None, torch.tensor([1, 0, 1, 1], dtype=torch.bool), None):
        x = torch.randn(6, 4, generator=g, dtype=torch.float64)
        y = torch.randn(6, 3, generator=g, dtype=torch.float64)
        torch.testing.assert_close(step_c(x, y, mask), step_e(x, y, mask), **CLOSE)
    torch.testing.assert_close(compiled.state_dict(), eager.state_dict(), **CLOSE)
    # SGD counts the steps taken with momentum (member 0 has none; member 1 was masked once).
    assert opt_c.state[next(compiled.parameters())]["step"].tolist() == [0.0, 2.0, 3.0, 3.0]
