"""A seeded random search over the stacked optimizers' options and call patterns.

Each case draws one torch optimizer class with a stacked twin, torch-valid options
(hyperparameters shared or one per member, a 0-d tensor ``lr``, the flags, ``foreach`` /
``fused`` / ``capturable=False`` / ``differentiable=False``), one or two param groups (the
second given to the constructor or added later, with options of its own), parameters of
several member shapes (0-d, one element, a matrix, one that gets no gradient on some steps, a
frozen one), in float64, float32 or (shared floats, ``fused=False``) bit for bit. It runs the
stacked optimizer and each member's own ``torch.optim`` optimizer, built with that member's
options, on the same gradients, drawing the calls of each step: ``zero_grad(set_to_none=...)``,
an edit of a hyperparameter or flag in ``param_groups``, a mask, ``step(closure)``, a
``state_dict()`` round trip through ``torch.save`` into a fresh stacked optimizer, ``select``
of some members. After each, every member's parameters, state (``member_state_dict(i)``, as a
plain optimizer loads it) and hyperparameters must equal its twin's; at the end each member is
handed off to a torch optimizer that must go on as its twin resumed. An Ensemble trained with
``make_step`` or ``backward`` then checks the real path. The truth is torch alone.

What the search found is at the end, each shrunk to a test of its own.
"""

from __future__ import annotations

import copy
import functools
import io
import math
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from truth import TOL64, seeded_members

import vmapens
import vmapens.optim as vo

Options = dict[str, Any]
Draw = Callable[[random.Random, int], Options]

# Member shapes: a matrix, a vector, 0-d, one element; "sometimes" gets no gradient on some
# steps, "frozen" never (requires_grad=False, as a frozen layer).
SHAPES = {"matrix": (3, 4), "vector": (5,), "scalar": (), "one": (1,), "sometimes": (2, 3)}
MATRICES = {"matrix": (3, 4), "wide": (2, 5), "sometimes": (4, 2)}  # Muon takes matrices only
FROZEN = (2, 2)


def _u(rng: random.Random, lo: float, hi: float) -> float:
    return rng.uniform(lo, hi)


def _maybe(rng: random.Random, p: float = 0.5) -> bool:
    return rng.random() < p


def per_member(rng: random.Random, n: int, draw: Callable[[], float], p: float = 0.4) -> Any:
    """One float shared by all members, or (with probability ``p``) one per member."""
    return [draw() for _ in range(n)] if _maybe(rng, p) else draw()


# -- the options of each optimizer, drawn as torch takes them ----------------------------------


def _flags(rng: random.Random, *names: str) -> Options:
    """torch's implementation flags, each left out or at a value the stacked twin takes."""
    values = {"foreach": (None, True, False), "fused": (None, False), "capturable": (False,)}
    values["differentiable"] = (False,)
    return {k: rng.choice(values[k]) for k in names if _maybe(rng, 0.3)}


def _lr(rng: random.Random, n: int, lo: float, hi: float) -> Any:
    if _maybe(rng, 0.2):  # a 0-d tensor, kept as torch keeps it
        return torch.tensor(_u(rng, lo, hi), dtype=rng.choice((torch.float32, torch.float64)))
    return per_member(rng, n, lambda: _u(rng, lo, hi))


def _wd(rng: random.Random, n: int, hi: float = 0.1) -> Any:
    return 0.0 if _maybe(rng, 0.4) else per_member(rng, n, lambda: _u(rng, 0.0, hi))


def _betas(rng: random.Random, n: int) -> tuple[Any, Any]:
    return (
        per_member(rng, n, lambda: _u(rng, 0.5, 0.95)),
        per_member(rng, n, lambda: _u(rng, 0.9, 0.9999)),
    )


def _eps(rng: random.Random, n: int, lo: float = 1e-8, hi: float = 1e-3) -> Any:
    return per_member(rng, n, lambda: 10 ** _u(rng, math.log10(lo), math.log10(hi)))


def sgd(rng: random.Random, n: int) -> Options:
    nesterov = _maybe(rng, 0.3)
    o: Options = {"lr": _lr(rng, n, 0.01, 0.2), "weight_decay": _wd(rng, n)}
    if nesterov:
        o.update(momentum=per_member(rng, n, lambda: _u(rng, 0.1, 0.95)), nesterov=True)
    elif _maybe(rng, 0.7):
        o["momentum"] = per_member(rng, n, lambda: rng.choice((0.0, _u(rng, 0.1, 0.95))))
        o["dampening"] = 0.0 if _maybe(rng) else per_member(rng, n, lambda: _u(rng, 0.0, 0.5))
    return {**o, "maximize": _maybe(rng, 0.3), **_flags(rng, "foreach", "fused", "differentiable")}


def adam(rng: random.Random, n: int) -> Options:
    o: Options = {"lr": _lr(rng, n, 1e-3, 0.05), "betas": _betas(rng, n), "eps": _eps(rng, n)}
    o.update(weight_decay=_wd(rng, n), amsgrad=_maybe(rng), maximize=_maybe(rng, 0.3))
    return {**o, **_flags(rng, "foreach", "fused", "capturable", "differentiable")}


def adamw(rng: random.Random, n: int) -> Options:
    return adam(rng, n)


def adam_decoupled(rng: random.Random, n: int) -> Options:
    return {**adam(rng, n), "decoupled_weight_decay": _maybe(rng)}


def adamax(rng: random.Random, n: int) -> Options:
    o: Options = {"lr": _lr(rng, n, 1e-3, 0.05), "betas": _betas(rng, n), "eps": _eps(rng, n)}
    o.update(weight_decay=_wd(rng, n), maximize=_maybe(rng, 0.3))
    return {**o, **_flags(rng, "foreach", "capturable", "differentiable")}


def nadam(rng: random.Random, n: int) -> Options:
    o = adamax(rng, n)
    o.update(momentum_decay=per_member(rng, n, lambda: _u(rng, 0.0, 0.01)))
    return {**o, "decoupled_weight_decay": _maybe(rng)}


def radam(rng: random.Random, n: int) -> Options:
    return {**adamax(rng, n), "decoupled_weight_decay": _maybe(rng)}


def rmsprop(rng: random.Random, n: int) -> Options:
    o: Options = {
        "lr": _lr(rng, n, 1e-3, 0.03),
        "alpha": per_member(rng, n, lambda: _u(rng, 0.8, 0.999)),
    }
    o.update(eps=_eps(rng, n), weight_decay=_wd(rng, n), centered=_maybe(rng))
    if _maybe(rng, 0.6):
        o["momentum"] = per_member(rng, n, lambda: rng.choice((0.0, _u(rng, 0.1, 0.9))))
    return {
        **o,
        "maximize": _maybe(rng, 0.3),
        **_flags(rng, "foreach", "capturable", "differentiable"),
    }


def adagrad(rng: random.Random, n: int) -> Options:
    o: Options = {"lr": _lr(rng, n, 0.01, 0.1), "lr_decay": _wd(rng, n, 0.2)}
    o.update(weight_decay=_wd(rng, n), initial_accumulator_value=_wd(rng, n, 0.5))
    o.update(eps=_eps(rng, n, 1e-10, 1e-4), maximize=_maybe(rng, 0.3))
    return {**o, **_flags(rng, "foreach", "fused", "differentiable")}


def adadelta(rng: random.Random, n: int) -> Options:
    o: Options = {
        "lr": _lr(rng, n, 0.1, 1.0),
        "rho": per_member(rng, n, lambda: _u(rng, 0.5, 0.99)),
    }
    o.update(eps=_eps(rng, n, 1e-7, 1e-4), weight_decay=_wd(rng, n), maximize=_maybe(rng, 0.3))
    return {**o, **_flags(rng, "foreach", "capturable", "differentiable")}


def asgd(rng: random.Random, n: int) -> Options:
    o: Options = {
        "lr": _lr(rng, n, 0.01, 0.1),
        "lambd": per_member(rng, n, lambda: _u(rng, 0, 0.1)),
    }
    o.update(alpha=per_member(rng, n, lambda: _u(rng, 0.5, 1.0)))
    o.update(t0=per_member(rng, n, lambda: float(rng.choice((1, 2, 3, 1e6)))))  # averaging starts
    o.update(weight_decay=_wd(rng, n), maximize=_maybe(rng, 0.3))
    return {**o, **_flags(rng, "foreach", "capturable", "differentiable")}


def rprop(rng: random.Random, n: int) -> Options:
    o: Options = {"lr": _lr(rng, n, 1e-3, 0.05)}
    o["etas"] = (
        per_member(rng, n, lambda: _u(rng, 0.2, 0.8)),
        per_member(rng, n, lambda: _u(rng, 1.05, 1.5)),
    )
    o["step_sizes"] = (
        per_member(rng, n, lambda: _u(rng, 1e-6, 1e-3)),
        per_member(rng, n, lambda: _u(rng, 0.02, 50)),
    )
    return {
        **o,
        "maximize": _maybe(rng, 0.3),
        **_flags(rng, "foreach", "capturable", "differentiable"),
    }


def adafactor(rng: random.Random, n: int) -> Options:
    o: Options = {
        "lr": _lr(rng, n, 1e-3, 0.05),
        "beta2_decay": per_member(rng, n, lambda: _u(rng, -1, -0.5)),
    }
    o.update(eps=(None, per_member(rng, n, lambda: _u(rng, 1e-4, 1e-2))))
    o.update(d=per_member(rng, n, lambda: _u(rng, 1, 2)), weight_decay=_wd(rng, n))
    return {**o, "maximize": _maybe(rng, 0.3), **_flags(rng, "foreach")}


def muon(rng: random.Random, n: int) -> Options:
    o: Options = {"lr": _lr(rng, n, 1e-3, 0.05), "weight_decay": _wd(rng, n)}
    o.update(momentum=per_member(rng, n, lambda: _u(rng, 0.5, 0.99)), nesterov=_maybe(rng))
    o.update(eps=_eps(rng, n, 1e-8, 1e-6), ns_steps=rng.choice((3, 5)))
    return {**o, "adjust_lr_fn": rng.choice((None, "original", "match_rms_adamw"))}


DRAWS: dict[type[torch.optim.Optimizer], Draw] = {
    torch.optim.SGD: sgd,
    torch.optim.Adam: adam_decoupled,
    torch.optim.AdamW: adamw,
    torch.optim.Adamax: adamax,
    torch.optim.NAdam: nadam,
    torch.optim.RAdam: radam,
    torch.optim.RMSprop: rmsprop,
    torch.optim.Adagrad: adagrad,
    torch.optim.Adadelta: adadelta,
    torch.optim.ASGD: asgd,
    torch.optim.Rprop: rprop,
    torch.optim.Adafactor: adafactor,
    torch.optim.Muon: muon,
}
# Options a second param group may not override: Adagrad starts every group's `sum` at the
# constructor's `initial_accumulator_value` (docs/optim.md), SGD's nesterov needs its momentum.
NOT_IN_GROUP = (
    "initial_accumulator_value",
    "nesterov",
    "momentum",
    "dampening",
    "ns_steps",
    "fused",
)


def member_options(options: Options, i: int) -> Options:
    """Member ``i``'s plain options: one value of each per-member list, pairs element-wise."""

    def pick(v: Any) -> Any:
        if isinstance(v, list):
            return v[i]
        if isinstance(v, Tensor):
            return v.clone()  # each optimizer its own tensor lr, as torch's has
        return v

    kept = {k: v for k, v in options.items() if k not in ("foreach", "fused")}
    return {k: tuple(map(pick, v)) if isinstance(v, tuple) else pick(v) for k, v in kept.items()}


# -- one case: the stacked optimizer against each member's twin --------------------------------

EXACT = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad)


class Case:
    """One drawn case: the optimizer class, its options, its param groups, the tensors.

    ``stacked`` holds the stacked tensors by name, ``alone[i]`` member ``i``'s own copies (its
    twin's parameters). With ``exact``, one of :data:`EXACT` with shared floats and
    ``fused=False``: torch's single-tensor arithmetic, compared bit for bit.
    """

    def __init__(
        self,
        seed: int,
        cls: type[torch.optim.Optimizer] | None = None,
        dtype: torch.dtype = torch.float64,
        exact: bool = False,
    ) -> None:
        rng = self.rng = random.Random(seed)
        self.seed, self.dtype, self.exact = seed, dtype, exact
        self.cls = cls or rng.choice(EXACT if exact else list(DRAWS))
        self.n = n = rng.randint(2, 4)
        self.options = self.drawn(DRAWS[self.cls](rng, n))
        g = torch.Generator().manual_seed(seed)
        self.stacked = {
            k: torch.randn(n, *s, generator=g, dtype=dtype).requires_grad_()
            for k, s in (MATRICES if self.cls is torch.optim.Muon else SHAPES).items()
        }
        self.stacked["frozen"] = torch.randn(n, *FROZEN, generator=g, dtype=dtype)
        self.alone = [
            {
                k: p[i].detach().clone().requires_grad_(p.requires_grad)
                for k, p in self.stacked.items()
            }
            for i in range(n)
        ]
        names = list(self.stacked)
        rng.shuffle(names)
        self.layout = rng.choice(("one", "two", "added"))  # the second group added later
        cut = rng.randint(1, len(names) - 1)
        self.names = [names] if self.layout == "one" else [names[:cut], names[cut:]]
        self.group2: Options = {}
        if self.layout != "one":
            other = self.drawn(DRAWS[self.cls](rng, n))
            keys = [k for k in other if k not in NOT_IN_GROUP]
            self.group2 = {k: other[k] for k in rng.sample(keys, rng.randint(1, len(keys)))}
            if isinstance(self.options["lr"], Tensor) and "lr" not in self.group2:
                # A group that takes the defaults' tensor lr shares that tensor with the first
                # group in torch, but no longer after a state_dict round trip (torch's neither:
                # defaults are not saved); a tensor of its own keeps this out of the comparison.
                self.group2["lr"] = self.options["lr"].clone()
        self.add_at = rng.randint(1, 3) if self.layout == "added" else None
        self.first = 1 if self.layout == "added" else len(self.names)

    def drawn(self, options: Options) -> Options:
        """``options``, or for an exact case shared floats only, off torch's fused kernels."""
        if not self.exact:
            return options
        options = {**member_options(options, 0), "fused": False}
        return {k: float(v) if isinstance(v, Tensor) else v for k, v in options.items()}

    def groups(
        self, member: int | None, count: int, ts: dict[str, Tensor] | None = None
    ) -> list[dict[str, Any]]:
        """The first ``count`` param groups, stacked (``member`` None) or member ``member``'s
        (over ``ts``, by default its twin's parameters)."""
        if ts is None:
            ts = self.stacked if member is None else self.alone[member]
        out = []
        for index, names in enumerate(self.names[:count]):
            extra = self.group2 if index == 1 else {}
            extra = extra if member is None else member_options(extra, member)
            out.append({"params": [ts[k] for k in names], **extra})
        return out

    def stacked_opt(self, count: int) -> vo.StackedOptimizer:
        """A stacked optimizer over the first ``count`` groups, built as the case builds it."""
        opt = vo.stacked(self.cls)(self.groups(None, self.first), **copy.deepcopy(self.options))
        for index in range(self.first, count):
            opt.add_param_group(self.groups(None, index + 1)[index])
        return opt

    def twin(
        self, i: int, count: int, ts: dict[str, Tensor] | None = None
    ) -> torch.optim.Optimizer:
        """Member ``i``'s torch optimizer over its first ``count`` groups, on torch's default
        (single-tensor) arithmetic: the stacked one follows that whatever ``foreach`` and
        ``fused`` say (docs/optim.md)."""
        twin = self.cls(self.groups(i, self.first, ts), **member_options(self.options, i))
        for index in range(self.first, count):
            twin.add_param_group(self.groups(i, index + 1, ts)[index])
        return twin

    def tolerance(self) -> dict[str, float]:
        if self.exact:
            return dict(rtol=0, atol=0)  # torch's single-tensor arithmetic, bit for bit
        if self.dtype == torch.float64:
            return dict(rtol=1e-10, atol=1e-12)  # per-member scalars as float64 tensors
        return dict(rtol=1e-4, atol=1e-5)


def compare(case: Case, opt: vo.StackedOptimizer, twins: list[torch.optim.Optimizer]) -> None:
    """Every member's parameters, state and hyperparameters against its twin's."""
    tol = case.tolerance()
    for i, twin in enumerate(twins):
        for k, p in case.stacked.items():
            torch.testing.assert_close(
                p[i].detach(),
                case.alone[i][k],
                **tol,
                msg=lambda m, i=i, k=k: f"member {i} {k}: {m}",
            )
        compare_state(opt.member_state_dict(i), twin.state_dict(), tol, f"member {i}")


def compare_state(
    mine: dict[str, Any], theirs: dict[str, Any], tol: dict[str, float], where: str
) -> None:
    """A member's ``member_state_dict`` against its twin's ``state_dict()``: hyperparameters
    and state, key by key (the implementation flags aside: the twin runs torch's default)."""
    assert len(mine["param_groups"]) == len(theirs["param_groups"]), where
    for ours, their in zip(mine["param_groups"], theirs["param_groups"]):
        for key, b in their.items():
            if key in ("params", "foreach", "fused"):
                continue
            assert key in ours, f"{where}: param group without {key}"
            a = ours[key]
            if isinstance(a, Tensor) or isinstance(b, Tensor):  # a tensor lr: its dtype's value
                a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
                torch.testing.assert_close(a, b, rtol=1e-7, atol=0, msg=f"{where}: {key}")
            elif isinstance(b, float):
                assert a == pytest.approx(b, rel=1e-12, abs=0), f"{where}: {key} {a} vs {b}"
            else:
                assert a == b, f"{where}: {key} {a!r} vs {b!r}"
    for index in set(mine["state"]) - set(theirs["state"]):
        # torch's Adagrad makes state when it is built, for the constructor's groups only: a
        # parameter of a later group that never stepped has it here, at its first-step value.
        assert mine["state"][index].get("step") == 0, f"{where}: state of param {index}"
    assert set(theirs["state"]) <= set(mine["state"]), f"{where}: state of other parameters"
    for index, state in theirs["state"].items():
        assert set(mine["state"][index]) == set(state), f"{where}: param {index}'s state keys"
        for key, b in state.items():
            a = torch.as_tensor(mine["state"][index][key])
            b = torch.as_tensor(b)
            assert a.shape == b.shape, f"{where}: param {index} {key} shape {a.shape} vs {b.shape}"
            torch.testing.assert_close(
                a.to(b.dtype),
                b,
                **tol,
                msg=lambda m, at=f"param {index} {key}": f"{where}: {at}: {m}",
            )


def backward(
    grads: dict[str, Tensor], ts: dict[str, Tensor], loss: Tensor, member: int | None
) -> Tensor:
    """``grads`` (member ``member``'s rows, or all) as the gradients of ``ts``, the way
    backward gives them: into a zeroed ``.grad`` where there is one; ``loss`` back."""
    for k, g in grads.items():
        g = g if member is None else g[member]
        if ts[k].grad is None:
            ts[k].grad = g.clone()
        else:
            ts[k].grad.copy_(g)
    return loss.clone()


def edit(case: Case, opt: vo.StackedOptimizer, twins: list[torch.optim.Optimizer]) -> str:
    """Change one hyperparameter or flag of one param group, as a schedule of one's own would
    (a tensor lr is ``fill_``-ed, as torch's schedulers fill it; per-member values are set as
    ``MemberValues``, the documented way)."""
    rng = case.rng
    index = rng.randrange(len(opt.param_groups))
    group = opt.param_groups[index]
    # AdamW's load_state_dict sets decoupled_weight_decay back to True: not one to flip.
    flags = (
        ("maximize",) if case.cls is torch.optim.AdamW else ("maximize", "decoupled_weight_decay")
    )
    flags = tuple(k for k in flags if k in group)
    if flags and _maybe(rng, 0.2):
        key = rng.choice(flags)
        flipped = not group[key]
        for t in [opt, *twins]:
            t.param_groups[index][key] = flipped
        return f"{key}[{index}] = {flipped}"
    fresh = case.drawn(DRAWS[case.cls](rng, case.n))
    keys = [k for k in opt.hyperparameters if k in fresh and k != "initial_accumulator_value"]
    if case.cls is torch.optim.RMSprop or group.get("nesterov") and case.cls is torch.optim.SGD:
        # torch's RMSprop makes its buffer at the first step only; Nesterov needs momentum.
        keys = [k for k in keys if k not in ("momentum", "dampening")]
    key = "lr" if _maybe(rng) else rng.choice(keys)
    value = fresh[key]
    if isinstance(group[key], Tensor):
        v = float(value[0] if isinstance(value, list) else value)
        for t in [opt, *twins]:
            t.param_groups[index][key].fill_(v)
        return f"{key}[{index}].fill_({v})"

    def stacked(v: Any) -> Any:
        return vo.MemberValues(v) if isinstance(v, list) else v if v is None else float(v)

    group[key] = tuple(map(stacked, value)) if isinstance(value, tuple) else stacked(value)
    for i, twin in enumerate(twins):
        mine = member_options({key: value}, i)[key]
        twin.param_groups[index][key] = float(mine) if isinstance(mine, Tensor) else mine
    return f"{key}[{index}] = {value}"


def round_trip(case: Case, opt: vo.StackedOptimizer) -> vo.StackedOptimizer:
    """``opt``'s state dict through torch.save/torch.load (weights_only) into a fresh stacked
    optimizer built as the case builds it."""
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    fresh = case.stacked_opt(len(opt.param_groups))
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    return fresh


def select(
    case: Case, opt: vo.StackedOptimizer, twins: list[torch.optim.Optimizer]
) -> tuple[vo.StackedOptimizer, list[torch.optim.Optimizer]]:
    """Some members (reordered; picked by a list, a tensor, a bool mask or a slice) into a new
    stacked optimizer over new stacked tensors, ``opt.select``; their twins go on."""
    rng, n = case.rng, case.n
    rows = rng.sample(range(n), rng.randint(1, n))
    form = rng.choice(("list", "tensor", "mask", "slice"))
    index: Any = torch.tensor(rows) if form == "tensor" else rows
    if form == "mask":
        rows.sort()
        index = torch.tensor([i in rows for i in range(n)])
    elif form == "slice":
        start = rng.randrange(n)
        index, rows = slice(start, None), list(range(start, n))
    old, case.stacked = case.stacked, {}
    for k, p in old.items():
        case.stacked[k] = p[rows].detach().clone().requires_grad_(p.requires_grad)
        case.stacked[k].grad = None if p.grad is None else p.grad[rows].clone()  # as the twins'
    case.alone, case.n = [case.alone[i] for i in rows], len(rows)

    def pick(v: Any) -> Any:
        if isinstance(v, tuple):
            return tuple(map(pick, v))
        return [v[i] for i in rows] if isinstance(v, list) else v

    case.options = {k: pick(v) for k, v in case.options.items()}
    case.group2 = {k: pick(v) for k, v in case.group2.items()}
    params = [case.stacked[k] for names in case.names[: len(opt.param_groups)] for k in names]
    return opt.select(index, params), [twins[i] for i in rows]


def hand_off(
    case: Case, opt: vo.StackedOptimizer, twins: list[torch.optim.Optimizer], g: torch.Generator
) -> None:
    """Each member handed to a torch optimizer of its own (``member_state_dict(i)``), which must
    go on as its twin resumed from the twin's own ``state_dict()`` (torch's load_state_dict
    casts some state, NAdam's ``mu_product``). One more step of all, after a new lr in every
    group, with a gradient for every parameter (one that never had one starts its state now)."""
    count = len(opt.param_groups)

    def resumed(state: dict[str, Any], i: int) -> tuple[torch.optim.Optimizer, dict[str, Tensor]]:
        ts = {
            k: p.detach().clone().requires_grad_(p.requires_grad) for k, p in case.alone[i].items()
        }
        for group in state["param_groups"]:  # torch's default arithmetic, as the twin's
            group.update({k: None for k in ("foreach", "fused") if k in group})
        new = case.twin(i, count, ts)
        new.load_state_dict(state)
        return new, ts

    handed = [resumed(opt.member_state_dict(i), i) for i in range(case.n)]
    truth = [resumed(copy.deepcopy(twin.state_dict()), i) for i, twin in enumerate(twins)]
    everyone = [opt, *twins, *(t for t, _ in handed + truth)]
    for t in everyone:
        for group in t.param_groups:
            if isinstance(group["lr"], Tensor):
                group["lr"].fill_(0.0123)
            else:
                group["lr"] = 0.0123
    for k, p in case.stacked.items():
        if p.requires_grad:
            p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
            for i in range(case.n):
                for ts in (case.alone[i], handed[i][1], truth[i][1]):
                    ts[k].grad = p.grad[i].clone()
    for t in everyone:
        t.step()
    compare(case, opt, twins)
    for i in range(case.n):
        for k in case.stacked:
            torch.testing.assert_close(
                handed[i][1][k],
                truth[i][1][k],
                **case.tolerance(),
                msg=lambda m, i=i, k=k: f"member {i} handed off, {k}: {m}",
            )


def run_case(case: Case, steps: int = 6) -> None:
    """``steps`` steps of the case's stacked optimizer and of each member's twin, each step's
    calls drawn (zero_grad, an edit, which parameters get a gradient, a mask, a closure, a
    state_dict round trip, a selection of members), compared after each; then the hand-off."""
    rng, log = case.rng, [f"{case.cls.__name__}(n={case.n}, {case.options}), {case.names}"]
    log.append(f"group 2: {case.group2}, {case.layout} (at step {case.add_at})")
    opt, twins = case.stacked_opt(case.first), [case.twin(i, case.first) for i in range(case.n)]
    g = torch.Generator().manual_seed(case.seed + 1)
    try:
        for step in range(steps):
            if step == case.add_at:
                opt.add_param_group(case.groups(None, 2)[1])
                for i, twin in enumerate(twins):
                    twin.add_param_group(case.groups(i, 2)[1])
            if _maybe(rng, 0.25):
                log.append(edit(case, opt, twins))
            set_to_none = _maybe(rng)
            for t in [opt, *twins]:
                t.zero_grad(set_to_none=set_to_none)
            skip = _maybe(rng)  # "sometimes" gets no gradient
            grads = {
                k: torch.randn(p.shape, generator=g, dtype=p.dtype)
                for k, p in case.stacked.items()
                if p.requires_grad and not (k == "sometimes" and skip)
            }
            mask = (
                torch.tensor([_maybe(rng, 0.7) for _ in range(case.n)])
                if _maybe(rng, 0.2)
                else None
            )
            closure = _maybe(rng, 0.2)
            log.append(
                f"step {step}: set_to_none={set_to_none}, skip={skip}, mask={mask}, closure={closure}"
            )
            # With a closure, the gradients come from it, as torch's step(closure) runs it first
            # (given positionally); its loss comes back.
            loss = torch.tensor(float(step))
            closures = [functools.partial(backward, grads, ts, loss) for ts in case.alone]
            if closure:
                call = functools.partial(backward, grads, case.stacked, loss, member=None)
                got = opt.step(call) if mask is None else opt.step(mask, call)
                assert torch.equal(got, loss)
            else:
                backward(grads, case.stacked, loss, member=None)
                assert opt.step(mask=mask) is None
            for i, twin in enumerate(twins):
                if mask is None or mask[i]:
                    twin.step(functools.partial(closures[i], member=i))
                else:  # a member left out still has its gradients, in the ensemble as here
                    closures[i](member=i)
            compare(case, opt, twins)
            if _maybe(rng, 0.25):
                opt = round_trip(case, opt)
                log.append("state_dict round trip")
                compare(case, opt, twins)
            if _maybe(rng, 0.15):
                opt, twins = select(case, opt, twins)
                log.append(f"select: n={case.n}")
                compare(case, opt, twins)
        log.append("hand-off")
        hand_off(case, opt, twins, g)
    except AssertionError as e:
        raise AssertionError(f"seed {case.seed}: {e}\n" + "\n".join(log)) from None


# -- the tests ---------------------------------------------------------------------------------

CLASSES = {cls.__name__: cls for cls in DRAWS}


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("name", CLASSES)
def test_random_options_and_calls_match_torch_alone_float64(name: str, seed: int) -> None:
    run_case(Case(seed, CLASSES[name]))


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("name", CLASSES)
def test_random_options_and_calls_match_torch_alone_float32(name: str, seed: int) -> None:
    run_case(Case(100 + seed, CLASSES[name], torch.float32))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("name", [cls.__name__ for cls in EXACT])
def test_unfused_shared_floats_match_torch_bit_for_bit(name: str, seed: int) -> None:
    run_case(Case(200 + seed, CLASSES[name], exact=True))


# -- the real path: an Ensemble, backward or make_step, against plain modules ----------------


class Odd(nn.Module):
    """Parameters of several shapes: a Linear, 0-d, one element, a matrix the forward reads
    only for even batch sizes (no gradient on the other steps), a frozen one."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.shift = nn.Parameter(torch.zeros(1))
        self.extra = nn.Parameter(torch.randn(2, 2))
        self.frozen = nn.Parameter(torch.randn(2), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        y = self.lin(x) * self.scale + self.shift + self.frozen
        return y @ self.extra if x.shape[0] % 2 == 0 else y


@pytest.mark.usefixtures("float64_default")
@pytest.mark.parametrize("how", ["make_step", "backward"])
@pytest.mark.parametrize("name", [k for k in CLASSES if k != "Muon"])  # Muon: matrices only
def test_an_ensemble_trains_each_member_as_torch_alone(name: str, how: str) -> None:
    cls, rng = CLASSES[name], random.Random(name)
    n = rng.randint(2, 4)
    options = DRAWS[cls](rng, n)
    ens = vmapens.Ensemble(Odd, n=n, seeds=range(n))
    members = seeded_members(Odd, n)
    opt = vo.stacked(cls)(ens, **options)
    twins = [cls(m.parameters(), **member_options(options, i)) for i, m in enumerate(members)]
    step = vmapens.make_step(ens, nn.MSELoss(), opt)
    g = torch.Generator().manual_seed(0)
    for t in range(4):
        rows = (4, 3, 5, 6)[t]  # the even sizes read `extra`
        x, y = torch.randn(rows, 3, generator=g), torch.randn(rows, 2, generator=g)
        if how == "make_step":
            step(x, y)
        else:
            opt.zero_grad()
            vmapens.per_member(nn.MSELoss())(ens(x), y).sum().backward()
            opt.step()
        for m, twin in zip(members, twins):
            twin.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            twin.step()
        for i, (m, twin) in enumerate(zip(members, twins)):
            for (key, p), q in zip(m.named_parameters(), ens[i].parameters()):
                torch.testing.assert_close(q, p, **TOL64, msg=f"step {t}, member {i}, {key}")
            compare_state(opt.member_state_dict(i), twin.state_dict(), TOL64, f"step {t}, {i}")


# -- what the search found, each shrunk to its smallest case -----------------------------------


def _copies(stacked: list[Tensor]) -> list[list[Tensor]]:
    """Each member's own leaves, copies of its rows of ``stacked``."""
    return [
        [p[i].detach().clone().requires_grad_() for p in stacked] for i in range(len(stacked[0]))
    ]


def _grads(
    stacked: list[Tensor], alone: list[list[Tensor]], given: list[bool], g: torch.Generator
) -> None:
    """Random gradients for the stacked tensors with ``given`` True (the others None), and
    each member's rows of them for its own leaves."""
    for k, p in enumerate(stacked):
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype) if given[k] else None
        for i, leaves in enumerate(alone):
            leaves[k].grad = None if p.grad is None else p.grad[i].clone()


@pytest.mark.parametrize("how", ["no gradient", "masked"])
def test_rprop_step_sizes_start_from_the_lr_of_a_members_first_step(how: str) -> None:
    # torch's Rprop makes a parameter's step sizes at its first step, from the lr then. The
    # stacked one made them for the whole group at the group's first step: a parameter first
    # stepped after an lr change (a scheduler) kept the old lr as its step sizes, 0.49 off.
    g = torch.Generator().manual_seed(0)
    stacked = [torch.randn(2, 3, dtype=torch.float64, generator=g).requires_grad_() for _ in "ab"]
    alone = _copies(stacked)
    opt = vo.StackedRprop(stacked, lr=0.01)
    twins = [torch.optim.Rprop(leaves, lr=0.01) for leaves in alone]
    _grads(stacked, alone, [True, how == "masked"], g)
    opt.step(mask=torch.tensor([True, False]) if how == "masked" else None)
    for twin in twins if how == "no gradient" else twins[:1]:
        twin.step()
    for i, twin in enumerate(twins):  # a member's hand-off holds only what torch's holds
        assert opt.member_state_dict(i)["state"].keys() == twin.state_dict()["state"].keys()
    for t in [opt, *twins]:
        t.param_groups[0]["lr"] = 0.5
    _grads(stacked, alone, [True, True], g)
    for t in [opt, *twins]:
        t.step()
    for i, leaves in enumerate(alone):
        for p, leaf in zip(stacked, leaves):
            torch.testing.assert_close(p[i], leaf, rtol=0, atol=0)


@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.RMSprop], ids=lambda c: c.__name__)
def test_a_member_without_momentum_for_a_while_keeps_its_momentum_buffer(cls: type) -> None:
    # torch's SGD and RMSprop neither read nor write a buffer while momentum is 0: turned on
    # again, it goes on from it. With per-member momenta, the stacked ones overwrote a member's
    # buffer with the plain step while its momentum was 0 (0.30 / 2.19 off one step later).
    g = torch.Generator().manual_seed(0)
    stacked = [torch.randn(2, 3, dtype=torch.float64, generator=g).requires_grad_()]
    alone = _copies(stacked)
    opt = vo.stacked(cls)(stacked, lr=0.05, momentum=[0.9, 0.5])
    twins = [cls(leaves, lr=0.05, momentum=m) for leaves, m in zip(alone, [0.9, 0.5])]
    for momenta in ([0.9, 0.5], [0.9, 0.5], [0.0, 0.5], [0.0, 0.0], [0.9, 0.5]):
        opt.param_groups[0]["momentum"] = vo.MemberValues(momenta)
        for twin, m in zip(twins, momenta):
            twin.param_groups[0]["momentum"] = m
        _grads(stacked, alone, [True], g)
        for t in [opt, *twins]:
            t.step()
        for i, twin in enumerate(twins):
            torch.testing.assert_close(stacked[0][i], alone[i][0], **TOL64)
            buffer = opt.member_state_dict(i)["state"][0]["momentum_buffer"]  # as handed off
            torch.testing.assert_close(buffer, twin.state[alone[i][0]]["momentum_buffer"], **TOL64)


@pytest.mark.parametrize("name", [k for k in CLASSES if k not in ("Adagrad", "Muon")])
def test_member_state_dict_holds_no_state_a_member_has_not_made(name: str) -> None:
    # torch makes a parameter's state at its first step (Adagrad when it is built): a member's
    # hand-off held zeros and step 0 for a parameter it never stepped, which torch then loaded
    # and kept (NAdam's mu_product cast to the parameter's dtype, Rprop's old step sizes).
    cls, g = CLASSES[name], torch.Generator().manual_seed(0)
    stacked = [torch.randn(2, 3, dtype=torch.float64, generator=g).requires_grad_() for _ in "ab"]
    alone = _copies(stacked)
    opt = vo.stacked(cls)(stacked)
    twins = [cls(leaves) for leaves in alone]
    _grads(stacked, alone, [True, False], g)
    opt.step(mask=torch.tensor([True, False]))
    twins[0].step()
    for i, twin in enumerate(twins):
        assert opt.member_state_dict(i)["state"].keys() == twin.state_dict()["state"].keys()


@pytest.mark.parametrize("name", ["Muon", "Adafactor", "Lion"])
@pytest.mark.parametrize("how", ["load_state_dict", "deepcopy"])
def test_add_param_group_after_load_state_dict_or_a_copy(name: str, how: str) -> None:
    # torch's Optimizer.__setstate__ (load_state_dict, deepcopy, unpickling) adds
    # `differentiable` to the defaults, which add_param_group then gave every new group:
    # refused for the optimizers whose twin takes no such flag (Muon, Adafactor; Lion).
    cls = {"Muon": vo.StackedMuon, "Adafactor": vo.StackedAdafactor, "Lion": vo.StackedLion}[name]
    a, b = (torch.randn(2, 3, 4, requires_grad=True) for _ in range(2))
    opt = cls([a], lr=0.01)
    if how == "deepcopy":
        opt = copy.deepcopy(opt)
    else:
        opt.load_state_dict(opt.state_dict())
    opt.add_param_group({"params": [b], "lr": 0.02})
    assert opt.param_groups[1]["lr"] == 0.02 and "differentiable" not in opt.param_groups[1]
    if cls.torch_class is not None:  # torch's own does the same
        twin = cls.torch_class([a[0].detach().clone().requires_grad_()], lr=0.01)
        twin.load_state_dict(twin.state_dict())
        twin.add_param_group({"params": [b[0].detach().clone().requires_grad_()], "lr": 0.02})


@pytest.mark.parametrize("twin", [torch.optim.Adam, torch.optim.SGD], ids=["Adam", "SGD"])
def test_named_parameters_as_torch_takes_them(twin: type) -> None:
    # torch's optimizers take `model.named_parameters()` since 2.6 and keep the names as each
    # group's `param_names`; the stacked ones refused the (name, tensor) pairs.
    stacked_class = vmapens.optim.stacked(twin)
    ens = vmapens.Ensemble(
        lambda: nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double(), n=3, seed=0
    )
    alone = ens.unstack()
    named = list(ens.named_parameters())
    opt = stacked_class(named[:2], lr=0.05)
    opt.add_param_group({"params": named[2:], "lr": 0.1})  # named in every group, as torch needs
    mine = []
    for m in alone:
        pairs = list(m.named_parameters())
        o = twin(pairs[:2], lr=0.05)
        o.add_param_group({"params": pairs[2:], "lr": 0.1})
        mine.append(o)
    assert [g["param_names"] for g in opt.param_groups] == [
        g["param_names"] for g in mine[0].param_groups
    ]
    step = vmapens.make_step(ens, nn.functional.mse_loss, opt)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(5, 3, generator=g, dtype=torch.float64)
        y = torch.randn(5, 2, generator=g, dtype=torch.float64)
        step(x, y)
        for m, o in zip(alone, mine, strict=True):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
    for i, m in enumerate(alone):
        for (name, a), b in zip(ens[i].named_parameters(), m.parameters(), strict=True):
            torch.testing.assert_close(a, b, **TOL64, msg=name)
    member = ens[1]  # handed off: torch's optimizer over the named member loads it
    handed = twin(list(member.named_parameters())[:2], lr=0.05)
    handed.add_param_group({"params": list(member.named_parameters())[2:], "lr": 0.1})
    handed.load_state_dict(opt.member_state_dict(1, module=member))
    assert handed.param_groups[1]["param_names"] == ["2.weight", "2.bias"]
    again = stacked_class(named[:2], lr=0.05)  # a state dict round trip keeps the names
    again.add_param_group({"params": named[2:], "lr": 0.1})
    again.load_state_dict(opt.state_dict())
    assert again.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
