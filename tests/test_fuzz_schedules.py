"""A seeded random search over torch's LR schedulers driving the stacked optimizers.

Each case draws an optimizer with a torch twin (SGD, Adam, AdamW, NAdam, RAdam, Adamax,
Adagrad, Adadelta, RMSprop, Rprop, ASGD) with options shared or one per member
(``tests/test_fuzz_optim.py``'s draws, ``fused=True`` too), float64 or float32 parameters,
two param groups (a head with options of its own), and one or two torch schedulers, built
before the first step or a few steps in: any class of ``torch.optim.lr_scheduler`` and
``SWALR`` (``OneCycleLR`` and ``CyclicLR`` cycling SGD's or RMSprop's momentum or Adam's beta1,
``CosineAnnealingWarmRestarts`` stepped with fractional epochs, ``SequentialLR`` and
``ChainedScheduler`` around the others) with per-member arguments where torch's arithmetic
takes them (``MemberValues`` base and peak learning rates and momenta, ``eta_min``,
``swa_lr``), or ``vmapens.optim.ReduceLROnPlateau`` fed one metric per member or one for all.
Then the calls of each step: ``zero_grad(set_to_none=...)``, a step skipped or masked, an
``lr`` set by hand (one for all, per member, a 1-D tensor), another hyperparameter or flag
edited, ``add_param_group`` mid-run, a ``state_dict()`` round trip of the optimizer and every
scheduler (through ``torch.save``, ``weights_only=True``) into fresh objects built as torch
documents it (scheduler built, then both state dicts loaded).

The truth: each member's own tensors with its own torch optimizer and the same schedulers,
built with that member's values and stepped the same way, never interrupted. After every step
every member's parameters, optimizer state and param groups (``lr``, ``momentum``, ``betas``,
the schedulers' ``initial_lr``, ``max_lr``, ...) and ``get_last_lr()`` must equal its twin's;
where torch raises the stacked run must raise the same exception type (then the case ends),
and warn where torch warns.

Run more seeds by hand: ``python tests/test_fuzz_schedules.py 0 500`` prints the failing seeds;
``python tests/test_fuzz_schedules.py 17`` prints seed 17's draw and runs it.
"""

from __future__ import annotations

import copy
import functools
import io
import random
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_fuzz_optim import DRAWS, NOT_IN_GROUP, compare_state, edit, member_options
from torch import Tensor
from torch.optim import lr_scheduler as sched
from torch.optim.swa_utils import SWALR
from truth import search

import vmapens.optim as vo
from vmapens.optim import MemberValues

F64 = torch.float64
TOL = dict(rtol=1e-10, atol=1e-12)
CLASSES = [c for c in DRAWS if c not in (torch.optim.Adafactor, torch.optim.Muon)]
BETAS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam,
         torch.optim.Adamax)  # fmt: skip
MOMENTUM = (torch.optim.SGD, torch.optim.RMSprop)
FUSED = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad)
SHAPES = {"w": (3, 2), "b": (2,), "head": (4,), "extra": (3,)}  # "extra": added mid-run


def per(values: list[float] | float, i: int | None) -> Any:
    """A scheduler argument: member ``i``'s float for its twin, ``MemberValues`` for the
    stacked optimizer (``i`` None) when it holds one value per member."""
    if not isinstance(values, list):
        return values
    return MemberValues(values) if i is None else values[i]


# -- the schedulers: a drawn spec (a tuple), built for the stacked optimizer or a twin ---------


def draw_leaf(rng: random.Random, n: int, cls: type, steps: int, nested: bool) -> tuple:
    """One scheduler spec. ``nested``: inside SequentialLR/ChainedScheduler (cycles rarely)."""
    kinds = ["lambda", "multiplicative", "step", "multistep", "exponential", "cosine", "poly",
             "linear", "constant", "warm", "swa"]  # fmt: skip
    kinds += ["cyclic", "onecycle"] if nested else ["cyclic", "onecycle"] * 2
    kind = rng.choice(kinds)
    u = rng.uniform
    if kind == "lambda":
        return (kind, u(0.7, 0.99), u(0.05, 0.5))  # group 0: a**e, the others: 1 / (1 + b e)
    if kind == "multiplicative":
        return (kind, u(0.8, 1.05))
    if kind == "step":
        return (kind, rng.randint(1, 4), u(0.2, 0.9))
    if kind == "multistep":
        return (kind, sorted(rng.choices(range(1, steps), k=rng.randint(1, 3))), u(0.2, 0.9))
    if kind == "exponential":
        return (kind, u(0.7, 0.99))
    if kind == "cosine":
        eta: Any = [u(0, 1e-3) for _ in range(n)] if rng.random() < 0.4 else u(0, 1e-3)
        return (kind, rng.randint(2, steps), eta)
    if kind == "poly":
        return (kind, rng.randint(2, steps), u(0.5, 3.0))
    if kind == "linear":
        return (kind, u(0.1, 1.0), u(0.5, 1.0), rng.randint(1, steps))
    if kind == "constant":
        return (kind, u(0.1, 0.9), rng.randint(1, steps))
    if kind == "warm":
        return (kind, rng.randint(1, 4), rng.randint(1, 3), u(0, 1e-3))
    if kind == "swa":
        swa: Any = [u(1e-3, 0.02) for _ in range(n)] if rng.random() < 0.5 else u(1e-3, 0.02)
        return (kind, swa, rng.randint(0, 4), rng.choice(("cos", "linear")))
    # (cycling the momentum of an optimizer without one: torch refuses it, so must vmapens)
    cycle = rng.random() < (0.7 if cls in BETAS + MOMENTUM else 0.1)
    peak: Any = [u(0.005, 0.05) for _ in range(n)] if rng.random() < 0.6 else u(0.005, 0.05)
    bottom = lambda: 0.0 if rng.random() < 0.2 else u(0.5, 0.85)  # noqa: E731 - 0: none at all
    low: Any = [bottom() for _ in range(n)] if rng.random() < 0.4 else bottom()
    high: Any = [u(0.86, 0.95) for _ in range(n)] if rng.random() < 0.4 else u(0.86, 0.95)
    if kind == "cyclic":
        mode = rng.choice(("triangular", "triangular2", "exp_range"))
        base = [v / 10 for v in peak] if isinstance(peak, list) else peak / 10
        return (kind, base, peak, rng.randint(1, 4), mode, u(0.8, 1.0), cycle, low, high)
    three = rng.random() < 0.3
    total = steps + rng.randint(2, 5)  # torch refuses a step past total_steps
    return (kind, peak, total, rng.choice(("cos", "linear")), three, cycle, low, high,
            u(5, 30), u(1e2, 1e4))  # fmt: skip


def draw_spec(rng: random.Random, n: int, cls: type, steps: int) -> list[tuple]:
    """The case's schedulers: one or two on the optimizer, maybe wrapped, or a plateau."""
    out: list[tuple] = []
    for _ in range(rng.choice((1, 1, 2))):
        r = rng.random()
        if r < 0.15:
            out.append(("plateau", draw_plateau(rng)))
        elif r < 0.3:
            inner = [draw_leaf(rng, n, cls, steps, True) for _ in range(rng.randint(2, 3))]
            milestones = sorted(rng.sample(range(1, steps), len(inner) - 1))
            out.append(("sequential", inner, milestones))
        elif r < 0.42:
            out.append(("chained", [draw_leaf(rng, n, cls, steps, True) for _ in range(2)]))
        else:
            out.append(draw_leaf(rng, n, cls, steps, False))
    if sum(s[0] in ("cyclic", "onecycle") for s in _specs(out)) > 1:
        out = out[:1]  # two cycles would set the momentum twice: not a combination users run
    return out


def draw_plateau(rng: random.Random) -> dict[str, Any]:
    kw: dict[str, Any] = dict(mode=rng.choice(("min", "max")), patience=rng.randint(0, 2))
    kw.update(factor=rng.uniform(0.1, 0.9), cooldown=rng.randint(0, 2))
    kw.update(threshold_mode=rng.choice(("rel", "abs")), threshold=rng.choice((1e-4, 0.01)))
    r = rng.random()
    if r < 0.3:
        kw["min_lr"] = rng.uniform(0, 2e-3)
    elif r < 0.5:
        kw["min_lr"] = [rng.uniform(0, 2e-3), rng.uniform(0, 2e-3)]  # one per param group
    if rng.random() < 0.3:
        kw["eps"] = rng.choice((1e-4, 1e-3))
    kw["shared"] = rng.random() < 0.3  # one metric for every member
    return kw


def _specs(specs: list[tuple]) -> list[tuple]:
    """Every scheduler spec in ``specs``, the ones inside SequentialLR/ChainedScheduler too."""
    out = []
    for spec in specs:
        out.append(spec)
        if spec[0] in ("sequential", "chained"):
            out += _specs(spec[1])
    return out


def _leaves(x: Any) -> list[Any]:
    """Every value inside a nested spec."""
    if isinstance(x, (tuple, list)) and not (x and isinstance(x[0], float)):
        return [leaf for v in x for leaf in _leaves(v)]
    if isinstance(x, dict):
        return _leaves(list(x.values()))
    return [x]


def build(spec: tuple, opt: Any, i: int | None) -> Any:
    """Scheduler ``spec`` on ``opt``, with member ``i``'s values (all members' for ``i`` None)."""
    kind = spec[0]
    if kind == "lambda":
        a, b = spec[1], spec[2]
        lambdas = [lambda e: a**e] + [lambda e: 1 / (1 + b * e)] * (len(opt.param_groups) - 1)
        return sched.LambdaLR(opt, lambdas)
    if kind == "multiplicative":
        return sched.MultiplicativeLR(opt, lambda e, m=spec[1]: m)
    if kind == "step":
        return sched.StepLR(opt, spec[1], spec[2])
    if kind == "multistep":
        return sched.MultiStepLR(opt, spec[1], spec[2])
    if kind == "exponential":
        return sched.ExponentialLR(opt, spec[1])
    if kind == "cosine":
        return sched.CosineAnnealingLR(opt, spec[1], per(spec[2], i))
    if kind == "poly":
        return sched.PolynomialLR(opt, spec[1], spec[2])
    if kind == "linear":
        return sched.LinearLR(opt, spec[1], spec[2], spec[3])
    if kind == "constant":
        return sched.ConstantLR(opt, spec[1], spec[2])
    if kind == "warm":
        return sched.CosineAnnealingWarmRestarts(opt, spec[1], spec[2], spec[3])
    if kind == "swa":
        return SWALR(opt, per(spec[1], i), anneal_epochs=spec[2], anneal_strategy=spec[3])
    if kind == "cyclic":
        base, peak, up, mode, gamma, cycle, low, high = spec[1:]
        return sched.CyclicLR(opt, per(base, i), per(peak, i), step_size_up=up, mode=mode,
                              gamma=gamma, cycle_momentum=cycle, base_momentum=per(low, i),
                              max_momentum=per(high, i))  # fmt: skip
    if kind == "onecycle":
        peak, total, anneal, three, cycle, low, high, div, final = spec[1:]
        return sched.OneCycleLR(opt, per(peak, i), total_steps=total, anneal_strategy=anneal,
                                three_phase=three, cycle_momentum=cycle, base_momentum=per(low, i),
                                max_momentum=per(high, i), div_factor=div,
                                final_div_factor=final)  # fmt: skip
    if kind == "sequential":
        inner = [build(s, opt, i) for s in spec[1]]
        return sched.SequentialLR(opt, inner, spec[2])
    if kind == "chained":
        return sched.ChainedScheduler([build(s, opt, i) for s in spec[1]])
    assert kind == "plateau"
    kw = {k: v for k, v in spec[1].items() if k != "shared"}
    return vo.ReduceLROnPlateau(opt, **kw) if i is None else sched.ReduceLROnPlateau(opt, **kw)


# -- one case -----------------------------------------------------------------------------------


class Case:
    """A drawn case: optimizer class and options, the head group, schedulers, the tensors."""

    def __init__(self, seed: int, steps: int = 10) -> None:
        rng = self.rng = random.Random(seed)
        self.seed, self.steps = seed, steps
        self.cls = rng.choice(CLASSES)
        self.n = n = rng.choice((1, 2, 3, 3))
        self.dtype = rng.choice((F64, F64, F64, torch.float32))
        self.tol = TOL if self.dtype == F64 else dict(rtol=1e-4, atol=1e-5)
        self.options = DRAWS[self.cls](rng, n)
        head = DRAWS[self.cls](rng, n)
        keys = [k for k in head if k not in NOT_IN_GROUP and k not in ("foreach", "capturable")]
        self.head = {k: head[k] for k in rng.sample(keys, rng.randint(1, min(3, len(keys))))}
        self.head.setdefault("lr", head["lr"])  # a head with its own lr
        # The group added mid-run: an lr of its own, or the defaults' (not a tensor one, which
        # torch's add_param_group shares with the first group until a state_dict round trip).
        self.extra = {"lr": rng.choice((0.01, [rng.uniform(0.005, 0.02) for _ in range(n)]))}
        if rng.random() < 0.3:
            self.extra = {}
        if self.cls in FUSED and rng.random() < 0.3:  # torch's kernels where members agree
            self.options.update(fused=True, foreach=None)
        self.schedulers = draw_spec(rng, n, self.cls, steps)
        self.built_at = rng.choice((0, 0, 0, rng.randint(1, 3)))  # schedulers built mid-run
        cycled = any(spec[0] == "cyclic" and spec[6] or spec[0] == "onecycle" and spec[5]
                     for spec in _specs(self.schedulers))  # fmt: skip
        if self.cls is torch.optim.RMSprop and cycled:
            self.built_at = 0  # torch's RMSprop makes a momentum buffer at its first step only
        per_member = any(isinstance(v, (list, MemberValues)) for v in _leaves(self.schedulers))
        if not self.extra and isinstance(self.options["lr"], Tensor):
            self.options["lr"] = float(self.options["lr"])
        for options in (self.options, self.head):
            if isinstance(options["lr"], Tensor):
                # torch's schedulers fill a 0-d tensor lr with one value: with per-member
                # scheduler values it has none. float64, as float32's rounding is documented.
                lr = float(options["lr"])
                options["lr"] = lr if per_member else torch.tensor(lr, dtype=F64)
        g = torch.Generator().manual_seed(seed)
        self.stacked = {
            k: torch.randn(n, *s, generator=g, dtype=self.dtype).requires_grad_()
            for k, s in SHAPES.items()
        }
        self.alone = [
            {k: p[i].detach().clone().requires_grad_() for k, p in self.stacked.items()}
            for i in range(n)
        ]
        self.groups = 2  # 3 once "extra" is added
        self.groups_at_build = 0  # how many the optimizer had when the schedulers were built

    def drawn(self, options: dict[str, Any]) -> dict[str, Any]:
        """Options as drawn (``test_fuzz_optim.edit`` draws its edits through this)."""
        return options

    def __repr__(self) -> str:
        return (
            f"seed {self.seed}: {self.cls.__name__}(n={self.n}, {self.dtype}, {self.options}), "
            f"head {self.head}, schedulers {self.schedulers}"
        )

    def param_groups(self, i: int | None) -> list[dict[str, Any]]:
        ts = self.stacked if i is None else self.alone[i]
        head = self.head if i is None else member_options(self.head, i)
        groups = [{"params": [ts["w"], ts["b"]]}, {"params": [ts["head"]], **head}]
        return groups

    def extra_group(self, i: int | None) -> dict[str, Any]:
        ts = self.stacked if i is None else self.alone[i]
        # (a list for the stacked one, as its constructor takes one value per member)
        return {"params": [ts["extra"]], **{k: v if i is None else per(v, i)
                                            for k, v in self.extra.items()}}  # fmt: skip

    def optimizer(self, i: int | None, groups: int | None = None) -> Any:
        """A fresh optimizer over the case's first ``groups`` groups (by default all so far):
        stacked (``i`` None) or member i's."""
        if i is None:
            opt = vo.stacked(self.cls)(self.param_groups(None), **copy.deepcopy(self.options))
        else:
            opt = self.cls(self.param_groups(i), **member_options(self.options, i))
        if (groups or self.groups) == 3:
            opt.add_param_group(self.extra_group(i))
        return opt


class Run:
    """One optimizer and its schedulers: the stacked one (``i`` None) or member ``i``'s."""

    def __init__(self, case: Case, i: int | None) -> None:
        self.case, self.i = case, i
        self.opt = case.optimizer(i)
        self.scheds: list[Any] = []  # built at step case.built_at

    def build(self) -> None:
        self.scheds = [build(s, self.opt, self.i) for s in self.case.schedulers]

    def step_schedulers(self, k: int, metrics: list[float]) -> None:
        for spec, s in zip(self.case.schedulers, self.scheds):
            if spec[0] == "plateau":
                if self.i is None:
                    s.step(torch.tensor(metrics) if self.case.seed % 2 else metrics)
                else:
                    s.step(metrics[self.i])
            elif spec[0] == "warm" and k % 2:
                s.step(k + 0.5)  # fractional epochs, as torch's docs step it inside an epoch
            else:
                s.step()

    def round_trip(self) -> None:
        """Optimizer and schedulers into fresh ones, torch's documented order."""
        buf = io.BytesIO()
        torch.save((self.opt.state_dict(), [s.state_dict() for s in self.scheds]), buf)
        buf.seek(0)
        opt_state, states = torch.load(buf, weights_only=True)
        # Built as the first ones were: the schedulers before a group added later (LambdaLR
        # keeps one function per group it saw).
        built = bool(self.scheds)
        self.opt = self.case.optimizer(self.i, groups=self.case.groups_at_build or 2)
        if built:
            self.build()
        if len(self.opt.param_groups) < self.case.groups:
            self.opt.add_param_group(self.case.extra_group(self.i))
        self.opt.load_state_dict(opt_state)
        for s, state in zip(self.scheds, states, strict=True):
            s.load_state_dict(state)


def member_value(v: Any, i: int) -> Any:
    if isinstance(v, (tuple, list)):
        return tuple(member_value(x, i) for x in v)
    if isinstance(v, MemberValues):
        return v[i]
    if isinstance(v, Tensor) and v.dim() == 1:
        return float(v[i])
    return float(v) if isinstance(v, (Tensor, int, float)) else v


KEYS = ("lr", "momentum", "betas", "initial_lr", "max_lr", "min_lr", "base_momentum",
        "max_momentum", "dampening", "swa_lr", "weight_decay", "eps")  # fmt: skip


def compare(case: Case, ours: Run, twins: list[Run], where: str, state: bool = True) -> None:
    for i, twin in enumerate(twins):
        for k, p in case.stacked.items():
            torch.testing.assert_close(p[i].detach(), case.alone[i][k], **case.tol,
                                       msg=lambda m, i=i, k=k: f"{where} member {i} {k}: {m}")  # fmt: skip
        for g, (group, theirs) in enumerate(zip(ours.opt.param_groups, twin.opt.param_groups,
                                                strict=True)):  # fmt: skip
            for key in KEYS:
                if key in theirs:
                    a, b = member_value(group[key], i), member_value(theirs[key], i)
                    assert a == b, f"{where} member {i} group {g} {key}: {a} vs {b}"
        # torch's Adagrad makes its state when built, the stacked one at its first step.
        if state and (case.cls is not torch.optim.Adagrad or len(ours.opt.state)):
            compare_state(ours.opt.member_state_dict(i), twin.opt.state_dict(), case.tol,
                          f"{where} member {i}")  # fmt: skip
        for spec, s, t in zip(case.schedulers, ours.scheds, twin.scheds):
            if spec[0] == "plateau" and "round trip" in where:
                # Loaded, it reads its last lrs from the optimizer, as another scheduler may
                # have left them (torch's keeps its own); stepped, it agrees again.
                continue
            a, b = member_value(s.get_last_lr(), i), member_value(t.get_last_lr(), i)
            assert a == b, f"{where} member {i} get_last_lr {a} vs {b}"


def attempt(fn: Callable[[], Any]) -> tuple[type[BaseException] | None, list[str]]:
    """``fn()``'s exception type (None) and the warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - compared with torch's outcome
            return type(e), [str(w.message) for w in caught]
    return None, [str(w.message) for w in caught]


def together(
    ours: Callable[[], Any], twins: list[Callable[[], Any]], where: str, warned: bool = True
) -> bool:
    """Run ``twins`` (torch) and ``ours``: both must succeed or raise the same type, and (with
    ``warned``) give the same warnings. False when torch raised (the case ends there)."""
    theirs = [attempt(f) for f in twins]
    # Where torch raises for some members only (a plateau lowering one member's lr), the
    # stacked step raises as one of them does.
    raised = {t[0] for t in theirs} - {None}
    got = attempt(ours)
    if got[0] is not None and not raised:
        ours()  # a crash where torch works: raise it again, with its traceback
    assert got[0] in (raised or {None}), f"{where}: torch gave {theirs}, vmapens {got}"
    if warned and not raised:
        assert all(t == got for t in theirs), f"{where}: torch gave {theirs}, vmapens {got}"
    return got[0] is None


def set_lr(opt: Any, index: int, value: Any) -> None:
    """``param_groups[index]["lr"] = value`` as a user writes it; a 0-d tensor lr is filled
    with a value all members share, as torch's schedulers fill it."""
    lr = opt.param_groups[index]["lr"]
    if isinstance(value, MemberValues) and len(set(value)) == 1:
        value = value[0]
    if isinstance(lr, Tensor) and lr.dim() == 0 and isinstance(value, float):
        lr.fill_(value)
    else:
        opt.param_groups[index]["lr"] = value


def hand_lr(case: Case, ours: Run, twins: list[Run]) -> str:
    """A new ``lr`` in one param group, one for all or one per member, set by hand."""
    rng, n = case.rng, case.n
    index = rng.randrange(len(ours.opt.param_groups))
    draw = lambda: rng.uniform(1e-3, 0.05)  # noqa: E731
    lr: Any = [draw() for _ in range(n)] if rng.random() < 0.5 else draw()
    # As a 1-D tensor (n values): the optimizer reads it, torch's schedulers do not
    # (docs/optim.md), vmapens' ReduceLROnPlateau does.
    plateaus = all(spec[0] == "plateau" for spec in case.schedulers)
    if isinstance(lr, list) and plateaus and rng.random() < 0.5:
        ours.opt.param_groups[index]["lr"] = torch.tensor(lr, dtype=F64)
    else:
        set_lr(ours.opt, index, MemberValues(lr) if isinstance(lr, list) else lr)
    for i, t in enumerate(twins):
        set_lr(t.opt, index, per(lr, i))
    return f"lr[{index}] = {lr}"


def gradients(case: Case, g: torch.Generator, skip_head: bool) -> None:
    """Random gradients of every parameter (not the head's when ``skip_head``), into
    ``.grad`` as backward writes them: into a zeroed one where there is one."""
    for key, p in case.stacked.items():
        if key == "head" and skip_head or key == "extra" and case.groups < 3:
            continue
        grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
        for leaf, row in [(p, grad), *((case.alone[i][key], grad[i]) for i in range(case.n))]:
            if leaf.grad is None:
                leaf.grad = row.clone()
            else:
                leaf.grad.copy_(row)


def optimizer_step(case: Case, ours: Run, twins: list[Run], k: int) -> str:
    """The step of step ``k``: all, masked (twins left out do not step), or none."""
    rng, r = case.rng, case.rng.random()
    if r < 0.08:
        return "no step"
    mask = None
    if k != case.built_at and r < 0.2:  # (not at the first: a twin not stepped would warn)
        mask = torch.tensor([rng.random() < 0.6 for _ in range(case.n)])
    ours.opt.step(mask=mask)
    for i, t in enumerate(twins):
        if mask is None or mask[i]:
            t.opt.step()
    return "" if mask is None else f"mask {mask.tolist()}"


def run_case(case: Case) -> None:
    """``case.steps`` steps of the stacked run and the twins, each step's calls drawn,
    compared after each."""
    rng, n = case.rng, case.n
    g = torch.Generator().manual_seed(case.seed + 1)
    ours, twins = Run(case, None), [Run(case, i) for i in range(n)]
    # torch's warnings are compared until a round trip (a fresh optimizer not yet stepped makes
    # torch warn at the next scheduler step; the twins go on as they are) or a mask (a twin left
    # out may warn where the others do not).
    log, warned = [repr(case)], True
    shared = any(s[0] == "plateau" and s[1]["shared"] for s in case.schedulers)
    try:
        for k in range(case.steps):
            events = []
            if k == case.built_at:
                case.groups_at_build = case.groups
                if not together(ours.build, [t.build for t in twins], f"step {k} built"):
                    return
                compare(case, ours, twins, f"step {k} built", state=k > 0)
            if k and rng.random() < 0.15:
                events.append(hand_lr(case, ours, twins))
            groups = ours.opt.param_groups
            one_d = any(isinstance(gr["lr"], Tensor) and gr["lr"].dim() for gr in groups)
            if k and rng.random() < 0.15 and not one_d:  # another hyperparameter or a flag
                events.append(edit(case, ours.opt, [t.opt for t in twins]))  # type: ignore[arg-type]
            if case.groups == 2 and k and rng.random() < 0.12:
                case.groups = 3
                events.append("add_param_group")
                add = [functools.partial(t.opt.add_param_group, case.extra_group(t.i))
                       for t in twins]  # fmt: skip
                ours_add = functools.partial(ours.opt.add_param_group, case.extra_group(None))
                if not together(ours_add, add, f"step {k} add_param_group"):
                    return
            set_to_none, skip_head = rng.random() < 0.5, rng.random() < 0.3
            for r in [ours, *twins]:
                r.opt.zero_grad(set_to_none=set_to_none)
            gradients(case, g, skip_head)
            events.append(optimizer_step(case, ours, twins, k))
            warned &= not events[-1].startswith("mask")
            values = [rng.choice((0.5, 0.9, 1.0, 1.1)) for _ in range(n)]
            metrics = [values[0]] * n if shared else values
            log.append(f"step {k}: set_to_none={set_to_none} skip_head={skip_head} "
                       f"{' '.join(events)} metrics={metrics}")  # fmt: skip
            steps = [functools.partial(t.step_schedulers, k, metrics) for t in twins]
            ours_step = functools.partial(ours.step_schedulers, k, metrics)
            if not together(ours_step, steps, f"step {k} schedulers", warned):
                return
            compare(case, ours, twins, f"step {k}")
            if rng.random() < 0.2:
                log.append("round trip")
                ours.round_trip()  # the twins go on uninterrupted: a resume must be exact
                warned = False
                compare(case, ours, twins, f"step {k} round trip")
    except AssertionError as e:
        raise AssertionError(f"{e}\n" + "\n".join(log)) from None


@pytest.mark.parametrize("seed", range(40))
def test_random_schedules_and_edits_match_torch_alone(seed: int) -> None:
    run_case(Case(seed))


# -- what the search found, each shrunk to a test of its own --------------------------------------


def _pair(lrs: Any, n: int = 3) -> tuple[Tensor, list[Tensor], Any, list[Any]]:
    """A stacked SGD over one [n, 4] tensor and each member's own SGD (member i's ``lrs``)."""
    g = torch.Generator().manual_seed(0)
    stacked = torch.randn(n, 4, generator=g, dtype=F64).requires_grad_()
    alone = [stacked[i].detach().clone().requires_grad_() for i in range(n)]
    opt = vo.StackedSGD([stacked], lr=lrs, momentum=0.5)
    twins = [torch.optim.SGD([a], lr=per(lrs, i), momentum=0.5) for i, a in enumerate(alone)]
    return stacked, alone, opt, twins


def _step(stacked: Tensor, alone: list[Tensor], opt: Any, twins: list[Any]) -> None:
    stacked.grad = torch.randn(stacked.shape, dtype=F64)
    opt.step()
    for i, twin in enumerate(twins):
        alone[i].grad = stacked.grad[i].clone()
        twin.step()


def test_plateau_with_min_lr_per_group_goes_on_after_an_added_group_until_it_reduces() -> None:
    # torch's ReduceLROnPlateau checks the param groups against `min_lr` only when it lowers a
    # learning rate; the per-member one refused every step after add_param_group, so a run
    # whose metric kept improving stopped where torch's went on.
    stacked, alone, opt, twins = _pair([0.1, 0.2, 0.3])
    ours = vo.ReduceLROnPlateau(opt, patience=0, min_lr=[1e-3])
    theirs = [sched.ReduceLROnPlateau(t, patience=0, min_lr=[1e-3]) for t in twins]
    extra = torch.zeros(3, 2, dtype=F64, requires_grad=True)
    opt.add_param_group({"params": [extra]})
    for i, t in enumerate(twins):
        t.add_param_group({"params": [extra[i].detach().clone().requires_grad_()]})
    for metric in (1.0, 0.5, 0.25):  # improving: nothing to lower
        _step(stacked, alone, opt, twins)
        ours.step([metric] * 3)
        for s in theirs:
            s.step(metric)
        assert ours.num_bad_epochs == [s.num_bad_epochs for s in theirs]
    before = copy.deepcopy((ours.state_dict(), opt.state_dict()["param_groups"]))
    for s in theirs:  # a plateau: torch raises now
        with pytest.raises(RuntimeError, match="differs"):
            s.step(1.0)
    with pytest.raises(RuntimeError, match=r"^ReduceLROnPlateau.step: .*`min_lr`"):
        ours.step([1.0] * 3)
    assert (ours.state_dict(), opt.state_dict()["param_groups"]) == before  # nothing changed


def test_plateau_lowers_a_per_member_lr_set_by_hand_as_a_1d_tensor() -> None:
    # The optimizer reads a 1-D tensor set in a param group as one lr per member
    # (docs/optim.md); the per-member plateau raised "only one element tensors can be
    # converted to Python scalars" at its first reduction.
    stacked, alone, opt, twins = _pair(0.1)
    ours = vo.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    theirs = [sched.ReduceLROnPlateau(t, patience=0, factor=0.5) for t in twins]
    lrs = [0.1, 0.2, 0.3]
    opt.param_groups[0]["lr"] = torch.tensor(lrs, dtype=F64)
    for t, lr in zip(twins, lrs, strict=True):
        t.param_groups[0]["lr"] = lr
    for metrics in ([1.0, 1.0, 1.0], [2.0, 0.5, 2.0], [3.0, 0.25, 1.0]):
        _step(stacked, alone, opt, twins)
        ours.step(metrics)
        for s, metric in zip(theirs, metrics, strict=True):
            s.step(metric)
        for i, t in enumerate(twins):
            assert member_value(opt.param_groups[0]["lr"], i) == t.param_groups[0]["lr"]
            torch.testing.assert_close(stacked[i], alone[i], **TOL)
    assert len(set(opt.param_groups[0]["lr"])) == 3


@pytest.mark.parametrize("kind", ["cosine", "multiplicative"])
def test_a_schedule_meets_per_member_lrs_with_tensor_values(kind: str) -> None:
    # Built on a 0-d tensor lr, CosineAnnealingLR keeps tensor base lrs and reads them with
    # the group's lr at each restart of its cosine; a multiplicative factor may be a 0-d tensor.
    # Per-member values set in the group (by hand, or vmapens.pbt's explore) met them in
    # `MemberValues - Tensor`, a TypeError.
    make = {
        "cosine": lambda o, i: sched.CosineAnnealingLR(o, T_max=3, eta_min=1e-3),
        "multiplicative": lambda o, i: sched.MultiplicativeLR(
            o, lambda e: torch.tensor(0.9, dtype=F64)
        ),
    }[kind]
    g = torch.Generator().manual_seed(0)
    stacked = torch.randn(3, 4, generator=g, dtype=F64).requires_grad_()
    alone = [stacked[i].detach().clone().requires_grad_() for i in range(3)]
    opt = vo.StackedAdam([stacked], lr=torch.tensor(0.05, dtype=F64))
    twins = [torch.optim.Adam([a], lr=torch.tensor(0.05, dtype=F64)) for a in alone]
    ours, theirs = make(opt, None), [make(t, i) for i, t in enumerate(twins)]
    for k in range(8):
        if k == 2:
            lrs = [0.01, 0.02, 0.03]
            opt.param_groups[0]["lr"] = MemberValues(lrs)
            for t, lr in zip(twins, lrs, strict=True):
                t.param_groups[0]["lr"].fill_(lr)
        _step(stacked, alone, opt, twins)
        ours.step()
        for s in theirs:
            s.step()
        for i, t in enumerate(twins):
            assert member_value(opt.param_groups[0]["lr"], i) == float(t.param_groups[0]["lr"])
            torch.testing.assert_close(stacked[i], alone[i], **TOL)


def test_plateau_refuses_torchs_state_dict_before_changing_anything() -> None:
    # torch's ReduceLROnPlateau keeps one record for all members; loaded into the per-member
    # one, it failed with Python's "object of type 'float' has no len()".
    stacked, alone, opt, twins = _pair(0.1)
    ours = vo.ReduceLROnPlateau(opt, patience=0)
    theirs = sched.ReduceLROnPlateau(twins[0], patience=0)
    theirs.step(1.0)
    before = ours.state_dict()
    with pytest.raises(ValueError, match=r"^ReduceLROnPlateau.load_state_dict: `best` must hold"):
        ours.load_state_dict(theirs.state_dict())
    assert ours.state_dict() == before


@pytest.mark.parametrize("kind", ["lambda", "multiplicative"])
def test_a_numpy_factor_gives_each_member_the_lr_torch_gives_it(kind: str) -> None:
    # `MemberValues * np.float32(...)` fell to numpy, which made an array of the values: the
    # next step refused the group's lr ("got ndarray"). torch computes with the numpy float.
    np = pytest.importorskip("numpy")
    factor = lambda e: np.float32(0.9) ** e  # noqa: E731
    make = {
        "lambda": lambda o: sched.LambdaLR(o, factor),
        "multiplicative": lambda o: sched.MultiplicativeLR(o, lambda e: np.float32(0.9)),
    }[kind]
    lrs = [0.1, 0.2, 0.3]
    stacked, alone, opt, twins = _pair(lrs)
    ours, theirs = make(opt), [make(t) for t in twins]
    for _ in range(4):
        _step(stacked, alone, opt, twins)
        for s in [ours, *theirs]:
            s.step()
        for i, t in enumerate(twins):
            assert opt.param_groups[0]["lr"][i] == float(t.param_groups[0]["lr"])
            torch.testing.assert_close(stacked[i], alone[i], **TOL)


if __name__ == "__main__":
    search(lambda seed, tmp: run_case(Case(seed)), Case)
