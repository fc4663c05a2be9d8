"""The main stacked optimizers under option combinations, each member against torch alone.

Adam/AdamW, SGD, RMSprop, Adagrad, Adamax, NAdam and RAdam with flags and per-member values
together (AdamW's amsgrad + maximize + per-member decay, NAdam's and RAdam's decoupled decay,
SGD's nesterov + decay + maximize, RMSprop centered + momentum + per-member alpha, Adagrad's
lr_decay + per-member initial sums), several param groups with their own options, a group
added mid-run, gradients that are None or zero at some steps, masked members that resume,
options changed between steps, a hand-off to torch mid-run, a param group that mixes float32
and float64 parameters. The truth is ``torch.optim`` on each member alone, fed the same
gradients.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import vmapens.optim as vo

N = 3
# float64: the same elementwise arithmetic as torch's; per-member scalars as float64 tensors
# instead of Python floats differ in the last bit or two.
TOL = dict(rtol=1e-12, atol=1e-12)
SHAPES = [(4, 3), (4,), (2, 4), (2,)]
AdamW = vo.stacked(torch.optim.AdamW)


def pick(value: Any, i: int) -> Any:
    """Member i's value of a hyperparameter (a list is one value per member)."""
    if isinstance(value, list):
        return value[i]
    if isinstance(value, vo.MemberValues):
        return value[i]
    if isinstance(value, tuple):
        return tuple(pick(v, i) for v in value)
    return value


def member_group(group: dict[str, Any], i: int) -> dict[str, Any]:
    return {k: pick(v, i) for k, v in group.items()}


class Twins:
    """N members as plain tensors with a torch optimizer each, and their stacked optimizer."""

    def __init__(
        self,
        cls: Any,
        twin: type[torch.optim.Optimizer],
        groups: list[tuple[list[int], dict[str, Any]]],
        kwargs: dict[str, Any],
        dtypes: list[torch.dtype] | None = None,
    ) -> None:
        gen = torch.Generator().manual_seed(0)
        dtypes = dtypes or [torch.float64] * len(SHAPES)
        self.stacked = [
            torch.randn(N, *s, generator=gen, dtype=d).requires_grad_()
            for s, d in zip(SHAPES, dtypes, strict=True)
        ]
        self.members = [
            [p[i].detach().clone().requires_grad_() for p in self.stacked] for i in range(N)
        ]
        self.opt = cls(
            [{"params": [self.stacked[k] for k in ks], **g} for ks, g in groups], **kwargs
        )
        self.twins = [
            twin(
                [
                    {"params": [self.members[i][k] for k in ks], **member_group(g, i)}
                    for ks, g in groups
                ],
                **member_group(kwargs, i),
            )
            for i in range(N)
        ]
        self.gen = torch.Generator().manual_seed(1)

    def step(
        self, mask: list[bool] | None = None, none: tuple[int, ...] = (), zero: tuple[int, ...] = ()
    ) -> None:
        """One step of both: parameters in ``none`` get no gradient, those in ``zero`` zeros."""
        for k, sp in enumerate(self.stacked):
            g = torch.randn(sp.shape, generator=self.gen, dtype=sp.dtype)
            g = None if k in none else torch.zeros_like(g) if k in zero else g
            sp.grad = None if g is None else g.clone()
            for i in range(N):
                self.members[i][k].grad = None if g is None else g[i].clone()
        for i in range(N):
            if mask is None or mask[i]:
                self.twins[i].step()
        self.opt.step(mask=None if mask is None else torch.tensor(mask))

    def assert_match(self, **tol: float) -> None:
        for i in range(N):
            for k, sp in enumerate(self.stacked):
                torch.testing.assert_close(
                    sp[i], self.members[i][k], **(tol or TOL), msg=f"member {i}, param {k}"
                )
        for i in range(N):
            ours, theirs = (
                self.opt.member_state_dict(i)["state"],
                self.twins[i].state_dict()["state"],
            )
            for k, entries in theirs.items():
                for key, value in entries.items():
                    torch.testing.assert_close(
                        ours[k][key], value, **(tol or TOL), msg=f"{key}, member {i}"
                    )


ALL = [([0, 1, 2, 3], {})]
TWO = [([0, 1], {}), ([2, 3], {})]
COMBOS = {
    "adamw-amsgrad-maximize-per-member-decay": (
        AdamW,
        torch.optim.AdamW,
        ALL,
        dict(lr=[0.01, 0.02, 0.03], amsgrad=True, maximize=True, weight_decay=[0.0, 0.1, 0.5]),
    ),
    "adam-decoupled-per-member-decay": (
        vo.StackedAdam,
        torch.optim.Adam,
        ALL,
        dict(lr=0.01, decoupled_weight_decay=True, weight_decay=[0.0, 0.1, 0.5], amsgrad=True),
    ),
    "adam-decoupled-tensor-lr": (
        vo.StackedAdam,
        torch.optim.Adam,
        ALL,
        dict(lr=torch.tensor(0.01), decoupled_weight_decay=True, weight_decay=[0.0, 0.1, 0.5]),
    ),
    "nadam-decoupled-per-member-momentum-decay": (
        vo.StackedNAdam,
        torch.optim.NAdam,
        ALL,
        dict(
            lr=0.01,
            decoupled_weight_decay=True,
            weight_decay=[0.0, 0.1, 0.5],
            momentum_decay=[0.0, 4e-3, 0.5],
        ),
    ),
    "radam-decoupled-per-member": (
        vo.StackedRAdam,
        torch.optim.RAdam,
        ALL,
        dict(lr=0.01, decoupled_weight_decay=True, weight_decay=[0.0, 0.1, 0.5]),
    ),
    "radam-decoupled-shared-maximize": (
        vo.StackedRAdam,
        torch.optim.RAdam,
        ALL,
        dict(
            lr=0.01, betas=(0.9, 0.9), decoupled_weight_decay=True, weight_decay=0.2, maximize=True
        ),
    ),
    "sgd-nesterov-decay-maximize": (
        vo.StackedSGD,
        torch.optim.SGD,
        ALL,
        dict(
            lr=0.01,
            nesterov=True,
            momentum=[0.5, 0.9, 0.1],
            dampening=0,
            weight_decay=[0.0, 0.1, 0.5],
            maximize=True,
        ),
    ),
    "rmsprop-centered-momentum-per-member-alpha": (
        vo.StackedRMSprop,
        torch.optim.RMSprop,
        ALL,
        dict(
            lr=0.01,
            centered=True,
            momentum=[0.0, 0.5, 0.9],
            alpha=[0.5, 0.9, 0.99],
            weight_decay=0.1,
            maximize=True,
        ),
    ),
    "adagrad-lr-decay-per-member-initial-sum": (
        vo.StackedAdagrad,
        torch.optim.Adagrad,
        ALL,
        dict(
            lr=0.05,
            lr_decay=[0.0, 0.1, 1.0],
            initial_accumulator_value=[0.0, 0.5, 2.0],
            weight_decay=0.1,
            maximize=True,
        ),
    ),
    "adamax-per-member-beta1-decay": (
        vo.StackedAdamax,
        torch.optim.Adamax,
        ALL,
        dict(lr=0.05, betas=([0.5, 0.9, 0.0], 0.99), weight_decay=[0.0, 0.1, 1.0], maximize=True),
    ),
    "adam-groups-own-flags": (
        vo.StackedAdam,
        torch.optim.Adam,
        [
            ([0, 1], {"lr": 0.1, "amsgrad": True}),
            ([2, 3], {"weight_decay": [0.1, 0.2, 0.3], "maximize": True}),
        ],
        dict(lr=0.01),
    ),
    "sgd-groups-own-flags": (
        vo.StackedSGD,
        torch.optim.SGD,
        [
            ([0, 1], {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
            ([2, 3], {"weight_decay": [0.1, 0.2, 0.3], "maximize": True}),
        ],
        dict(lr=0.01),
    ),
    "rmsprop-groups-own-flags": (
        vo.StackedRMSprop,
        torch.optim.RMSprop,
        [
            ([0, 1], {"lr": 0.1, "momentum": 0.9, "centered": True}),
            ([2, 3], {"alpha": [0.1, 0.2, 0.3], "maximize": True}),
        ],
        dict(lr=0.01),
    ),
    "nadam-groups-own-flags": (
        vo.StackedNAdam,
        torch.optim.NAdam,
        [
            ([0, 1], {"lr": 0.1, "decoupled_weight_decay": True, "weight_decay": 0.1}),
            ([2, 3], {"momentum_decay": [0.1, 0.2, 0.3], "maximize": True}),
        ],
        dict(lr=0.01),
    ),
    "radam-groups-own-flags": (
        vo.StackedRAdam,
        torch.optim.RAdam,
        [
            ([0, 1], {"lr": 0.1, "decoupled_weight_decay": True, "weight_decay": 0.1}),
            ([2, 3], {"betas": (0.5, [0.9, 0.8, 0.7]), "maximize": True}),
        ],
        dict(lr=0.01),
    ),
}


@pytest.mark.parametrize(
    ("cls", "twin", "groups", "kwargs"), list(COMBOS.values()), ids=list(COMBOS)
)
def test_option_combinations_with_none_and_zero_grads_and_masks(
    cls: Any, twin: type[torch.optim.Optimizer], groups: list, kwargs: dict[str, Any]
) -> None:
    """Parameter 1 has no gradient at every other step, parameter 2 a zero one once (torch
    then still decays and moves it), and members stop and resume."""
    rig = Twins(cls, twin, groups, kwargs)
    masks = [None, [True, False, True], [False, False, True], None, [True, True, False], None]
    for t, mask in enumerate(masks):
        rig.step(mask, none=(1,) if t % 2 == 0 else (), zero=(2,) if t == 1 else ())
    rig.assert_match()


ADDED = {
    "adamw": (
        AdamW,
        torch.optim.AdamW,
        dict(lr=[0.01, 0.02, 0.03], amsgrad=True),
        dict(lr=0.1, maximize=True, amsgrad=False),
    ),
    "adam": (
        vo.StackedAdam,
        torch.optim.Adam,
        dict(lr=0.01),
        dict(lr=[0.1, 0.2, 0.3], amsgrad=True, decoupled_weight_decay=True, weight_decay=0.1),
    ),
    "sgd": (
        vo.StackedSGD,
        torch.optim.SGD,
        dict(lr=0.01, momentum=0.9, nesterov=True),
        dict(lr=0.1, momentum=[0.9, 0.0, 0.5], dampening=0.5),
    ),
    "rmsprop": (
        vo.StackedRMSprop,
        torch.optim.RMSprop,
        dict(lr=0.01),
        dict(lr=0.1, centered=True, momentum=[0.9, 0.0, 0.5]),
    ),
    "adagrad": (
        vo.StackedAdagrad,
        torch.optim.Adagrad,
        dict(lr=0.01, initial_accumulator_value=0.3),
        dict(lr=0.1, lr_decay=[0.1, 0.0, 0.2]),
    ),
    "adamax": (
        vo.StackedAdamax,
        torch.optim.Adamax,
        dict(lr=0.01),
        dict(lr=0.1, maximize=True, weight_decay=[0.1, 0.0, 0.2]),
    ),
    "radam": (
        vo.StackedRAdam,
        torch.optim.RAdam,
        dict(lr=0.01),
        dict(lr=0.1, decoupled_weight_decay=True, weight_decay=[0.1, 0.0, 0.2]),
    ),
}


@pytest.mark.parametrize(("cls", "twin", "kwargs", "added"), list(ADDED.values()), ids=list(ADDED))
def test_group_added_mid_run_then_handed_off_to_torch(
    cls: Any, twin: type[torch.optim.Optimizer], kwargs: dict[str, Any], added: dict[str, Any]
) -> None:
    rig = Twins(cls, twin, [([0, 1], {})], kwargs)
    for mask in [None, [True, False, True], None]:
        rig.step(mask)
    rig.opt.add_param_group({"params": rig.stacked[2:], **added})
    for i in range(N):
        rig.twins[i].add_param_group({"params": rig.members[i][2:], **member_group(added, i)})
    for mask in [None, [False, True, True], None]:
        rig.step(mask)
    for i in range(N):  # each member goes on in a fresh torch optimizer from its hand-off
        fresh = twin([{"params": rig.members[i][:2]}, {"params": rig.members[i][2:]}], lr=0.5)
        fresh.load_state_dict(rig.opt.member_state_dict(i))
        rig.twins[i] = fresh
    for _ in range(2):
        rig.step()
    rig.assert_match()


CHANGES = {
    "adam-decoupled-on": (
        vo.StackedAdam,
        torch.optim.Adam,
        dict(lr=0.1, weight_decay=0.1),
        dict(decoupled_weight_decay=True, maximize=True),
    ),
    "adamw-per-member-eps-and-decay": (
        AdamW,
        torch.optim.AdamW,
        dict(lr=[0.01, 0.02, 0.03], amsgrad=True),
        dict(
            weight_decay=vo.MemberValues([0.3, 0.2, 0.1]),
            eps=vo.MemberValues([1e-3, 1e-2, 1e-1]),
            betas=(0.5, 0.9),
        ),
    ),
    "adam-tensor-lr": (
        vo.StackedAdam,
        torch.optim.Adam,
        dict(lr=[0.1, 0.2, 0.3]),
        dict(lr=torch.tensor(0.05)),
    ),
    "sgd-nesterov-on": (
        vo.StackedSGD,
        torch.optim.SGD,
        dict(lr=0.1, momentum=0.9),
        dict(nesterov=True, maximize=True),
    ),
    "rmsprop-momentum-off-per-member": (
        vo.StackedRMSprop,
        torch.optim.RMSprop,
        dict(lr=0.1, momentum=[0.9, 0.5, 0.1]),
        dict(momentum=vo.MemberValues([0.0, 0.5, 0.0])),
    ),
    "adagrad-lr-decay": (
        vo.StackedAdagrad,
        torch.optim.Adagrad,
        dict(lr=0.1),
        dict(lr_decay=vo.MemberValues([0.1, 0.0, 0.2]), maximize=True),
    ),
    "nadam-decoupled-on": (
        vo.StackedNAdam,
        torch.optim.NAdam,
        dict(lr=0.1, weight_decay=0.1),
        dict(decoupled_weight_decay=True, momentum_decay=0.3),
    ),
    "radam-betas": (
        vo.StackedRAdam,
        torch.optim.RAdam,
        dict(lr=0.1),
        dict(
            betas=(0.3, vo.MemberValues([0.9, 0.99, 0.5])),
            decoupled_weight_decay=True,
            weight_decay=0.1,
        ),
    ),
}


@pytest.mark.parametrize(
    ("cls", "twin", "kwargs", "change"), list(CHANGES.values()), ids=list(CHANGES)
)
def test_options_set_between_steps_as_on_torchs(
    cls: Any, twin: type[torch.optim.Optimizer], kwargs: dict[str, Any], change: dict[str, Any]
) -> None:
    rig = Twins(cls, twin, ALL, kwargs)
    for _ in range(3):
        rig.step()
    for key, value in change.items():
        rig.opt.param_groups[0][key] = value
        for i in range(N):
            rig.twins[i].param_groups[0][key] = pick(value, i)
    for mask in [None, [False, True, True], None]:
        rig.step(mask)
    rig.assert_match()


@pytest.mark.parametrize(
    "first", [torch.float32, torch.float64], ids=["float32_first", "float64_first"]
)
def test_radam_group_of_float32_and_float64_params_steps_each_in_its_dtype(
    first: torch.dtype,
) -> None:
    """RAdam's shared-hyperparameter step once computed a whole group's update in one scratch
    buffer of the first parameter's dtype: a float64 parameter after a float32 one moved by a
    float32-rounded update (2e-8 off torch's after 6 steps)."""
    other = torch.float64 if first == torch.float32 else torch.float32
    rig = Twins(
        vo.StackedRAdam, torch.optim.RAdam, ALL, dict(lr=0.1, betas=(0.9, 0.9)), [first, other] * 2
    )
    for _ in range(6):  # beta2 = 0.9 takes the rectified branch from step 3
        rig.step()
    for i in range(N):
        for k, sp in enumerate(rig.stacked):
            tol = TOL if sp.dtype == torch.float64 else dict(rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(
                sp[i], rig.members[i][k], **tol, msg=f"member {i}, param {k}"
            )


@pytest.mark.parametrize(
    "first", [torch.float32, torch.float64], ids=["float32_first", "float64_first"]
)
def test_adafactor_group_of_float32_and_float64_params_steps_each_in_its_dtype(
    first: torch.dtype,
) -> None:
    """Adafactor computes the step sizes of all a call's parameters at once, from each
    parameter's RMS and clipping denominator stacked: a stack in the first parameter's dtype
    would round a float64 parameter's to float32. Factored ([4, 3], [2, 4]) and vector
    parameters alternate dtypes; a masked step gives the members different step counts."""
    other = torch.float64 if first == torch.float32 else torch.float32
    rig = Twins(
        vo.StackedAdafactor,
        torch.optim.Adafactor,
        ALL,
        dict(lr=0.1, weight_decay=0.01),
        [first, other] * 2,
    )
    for mask in [None, None, [True, False, True], None, None]:
        rig.step(mask)
    for i in range(N):
        for k, sp in enumerate(rig.stacked):
            tol = TOL if sp.dtype == torch.float64 else dict(rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(
                sp[i], rig.members[i][k], **tol, msg=f"member {i}, param {k}"
            )


@pytest.mark.parametrize("stepped", [0, 2], ids=["before_the_first_step", "mid_run"])
def test_rmsprop_momentum_of_a_wrong_type_set_by_hand_is_named(stepped: int) -> None:
    """A list set into ``param_groups`` (torch's schedulers write MemberValues or floats) was
    compared with 0 first and raised "'>' not supported between instances of 'list' and
    'int'"; now the step's own check names `momentum`, and nothing moves."""
    rig = Twins(vo.StackedRMSprop, torch.optim.RMSprop, ALL, dict(lr=0.01, momentum=0.5))
    for _ in range(stepped):
        rig.step()
    before = [p.detach().clone() for p in rig.stacked]
    rig.opt.param_groups[0]["momentum"] = [0.1, 0.2, 0.3]
    with pytest.raises(TypeError, match=r"StackedRMSprop\.step: param group `momentum`"):
        rig.opt.step()
    for p, old in zip(rig.stacked, before, strict=True):
        assert torch.equal(p, old)
