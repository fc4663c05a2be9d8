"""Learning-rate schedules over a run, every member against its own torch scheduler alone.

Every class of ``torch.optim.lr_scheduler`` on stacked optimizers with per-member base
learning rates (docs/optim.md, "Learning-rate schedulers") and two param groups, in a plain
loop and inside ``vmapens.fit`` (per step and per epoch, and a run interrupted and resumed from
its checkpoint mid-schedule); ``vmapens.optim.ReduceLROnPlateau`` against one torch
``ReduceLROnPlateau`` per member fed that member's metric; state_dict round trips, ``last_epoch``
resumption and the hand-off of a scheduled member to plain torch. The truth is always N plain
tensors or modules with the torch twin and the same scheduler class stepped the same way
(``tests/truth.py``), in float64.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import models
import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as sched
from truth import TOL64, assert_members_equal, batch_plan, derived_seed, train_alone

import vmapens
from vmapens.callbacks import EarlyStopping, LRScheduler
from vmapens.optim import MemberValues

N = 3
LRS = [0.01, 0.02, 0.05]  # group 0: one lr per member
SHARED = 0.03  # group 1: one lr for all
F64 = torch.float64


def per(values: list[float], i: int | None) -> Any:
    """A per-member scheduler argument: ``MemberValues`` for the ensemble (``i`` None), member
    ``i``'s float for its torch twin."""
    return MemberValues(values) if i is None else values[i]


def _saved(obj: Any) -> Any:
    """``obj`` through ``torch.save`` and ``torch.load(weights_only=True)``."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# -- the plain loop: stacked tensors and each member's own tensors, the same gradients ---------

OPTIMIZERS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "sgd": (
        lambda groups, lr: vmapens.StackedSGD(groups, lr=lr, momentum=0.9),
        lambda groups, lr: torch.optim.SGD(groups, lr=lr, momentum=0.9),
    ),
    "adam": (
        lambda groups, lr: vmapens.StackedAdam(groups, lr=lr),
        lambda groups, lr: torch.optim.Adam(groups, lr=lr),
    ),
}
Make = Callable[[Any, "int | None"], Any]


def _cyclic(opt: Any, i: int | None, **kw: Any) -> Any:
    base = per([v / 10 for v in LRS], i)
    return sched.CyclicLR(opt, base_lr=base, max_lr=per(LRS, i), step_size_up=3, **kw)


SCHEDULERS: dict[str, Make] = {
    "step": lambda o, i: sched.StepLR(o, step_size=3, gamma=0.5),
    "multistep": lambda o, i: sched.MultiStepLR(o, milestones=[2, 5, 5], gamma=0.3),
    "constant": lambda o, i: sched.ConstantLR(o, factor=0.4, total_iters=4),
    "linear": lambda o, i: sched.LinearLR(o, start_factor=0.2, end_factor=0.9, total_iters=5),
    "exponential": lambda o, i: sched.ExponentialLR(o, gamma=0.9),
    "polynomial": lambda o, i: sched.PolynomialLR(o, total_iters=7, power=2.0),
    "cosine": lambda o, i: sched.CosineAnnealingLR(o, T_max=4, eta_min=1e-4),
    "warm-restarts": lambda o, i: sched.CosineAnnealingWarmRestarts(o, 3, T_mult=2, eta_min=1e-4),
    "cyclic": lambda o, i: _cyclic(o, i, base_momentum=0.8, max_momentum=0.9),
    "cyclic-triangular2": lambda o, i: _cyclic(o, i, mode="triangular2", cycle_momentum=False),
    "cyclic-exp-range": lambda o, i: _cyclic(o, i, mode="exp_range", gamma=0.9),
    "one-cycle": lambda o, i: sched.OneCycleLR(o, max_lr=per(LRS, i), total_steps=12),
    "one-cycle-linear-3-phase": lambda o, i: sched.OneCycleLR(
        o, max_lr=per(LRS, i), total_steps=12, anneal_strategy="linear", three_phase=True
    ),
    "lambda": lambda o, i: sched.LambdaLR(o, [lambda e: 0.9**e, lambda e: 1 / (1 + e)]),
    "multiplicative": lambda o, i: sched.MultiplicativeLR(o, lambda e: 0.95),
    "sequential": lambda o, i: sched.SequentialLR(
        o, [sched.LinearLR(o, 0.1, 1.0, 3), sched.ExponentialLR(o, 0.8)], milestones=[3]
    ),
    "chained": lambda o, i: sched.ChainedScheduler(
        [sched.ConstantLR(o, 0.5, 4), sched.ExponentialLR(o, 0.9)]
    ),
}
STEPS = 12  # one-cycle's total_steps: every phase of every schedule is passed


class Pair:
    """Two stacked parameters in two param groups (group 0 per-member lrs, group 1 one shared
    lr) with a stacked optimizer, and each member's own tensors with its torch twin."""

    def __init__(self, optimizer: str, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.g = g
        self.stacked = [
            torch.randn(N, 3, 2, generator=g, dtype=F64).requires_grad_(),
            torch.randn(N, 2, generator=g, dtype=F64).requires_grad_(),
        ]
        self.alone = [
            [p[i].detach().clone().requires_grad_() for p in self.stacked] for i in range(N)
        ]
        stacked, twin = OPTIMIZERS[optimizer]
        self.opt = stacked(self._groups(self.stacked), LRS)
        self.twins = [twin(self._groups(a), LRS[i]) for i, a in enumerate(self.alone)]

    @staticmethod
    def _groups(params: list[torch.Tensor]) -> list[dict[str, Any]]:
        return [{"params": params[:1]}, {"params": params[1:], "lr": SHARED}]

    def step(self) -> None:
        """One step on fresh random gradients, the stacked one and each member's alone."""
        for p in self.stacked:
            p.grad = torch.randn(p.shape, generator=self.g, dtype=F64)
        self.opt.step()
        for i, (twin, alone) in enumerate(zip(self.twins, self.alone, strict=True)):
            for leaf, p in zip(alone, self.stacked, strict=True):
                leaf.grad = p.grad[i].clone()
            twin.step()

    def check(self, where: str = "") -> None:
        """Every member's hyperparameters (exactly: the same float arithmetic) and tensors."""
        for i, twin in enumerate(self.twins):
            for k, (group, theirs) in enumerate(zip(self.opt.param_groups, twin.param_groups)):
                for key in ("lr", "momentum", "betas"):
                    if key in theirs:
                        assert member_value(group[key], i) == _floats(theirs[key]), (
                            f"{where} member {i} group {k} {key}"
                        )
            for p, leaf in zip(self.stacked, self.alone[i], strict=True):
                torch.testing.assert_close(p[i], leaf, **TOL64, msg=f"{where} member {i}")


def member_value(v: Any, i: int) -> Any:
    """Member ``i``'s value of a hyperparameter (a pair: each of its two)."""
    if isinstance(v, tuple):
        return tuple(member_value(x, i) for x in v)
    return float(v[i]) if isinstance(v, MemberValues) else float(v)


def _floats(v: Any) -> Any:
    return tuple(float(x) for x in v) if isinstance(v, tuple) else float(v)


def last_lrs(scheduler: Any, i: int) -> list[float]:
    return [member_value(v, i) for v in scheduler.get_last_lr()]


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("kind", list(SCHEDULERS))
def test_every_torch_scheduler_gives_each_member_its_own_schedule(
    kind: str, optimizer: str
) -> None:
    pair = Pair(optimizer)
    make = SCHEDULERS[kind]
    ours = make(pair.opt, None)
    theirs = [make(twin, i) for i, twin in enumerate(pair.twins)]
    seen = set()
    for k in range(STEPS):
        pair.step()
        ours.step()
        for s in theirs:
            s.step()
        pair.check(f"step {k}")
        for i, s in enumerate(theirs):
            assert last_lrs(ours, i) == s.get_last_lr(), f"step {k} member {i}"
        seen.add(member_value(pair.opt.param_groups[0]["lr"], 0))
    assert len(seen) > 1, "the schedule never changed the lr: the test would not see it"


def test_warm_restarts_stepped_with_fractional_epochs_as_torch_documents() -> None:
    # torch's docs step CosineAnnealingWarmRestarts with `epoch + i / iters` inside an epoch.
    epochs = [0.25, 0.5, 0.75, 1.0, 1.5, 2.9, 3.0, 3.4, 7.9, 9.2, 9.5, 12.3]
    pair = Pair("sgd")
    make = SCHEDULERS["warm-restarts"]
    ours = make(pair.opt, None)
    theirs = [make(twin, i) for i, twin in enumerate(pair.twins)]
    for k, epoch in enumerate(epochs):
        pair.step()
        ours.step(epoch)
        for s in theirs:
            s.step(epoch)
        pair.check(f"epoch {epoch}")
        assert ours.T_cur == theirs[0].T_cur and ours.T_i == theirs[0].T_i, k


def test_torchs_plateau_on_the_mean_loss_with_a_shared_lr_is_torchs() -> None:
    # One lr for all members, one metric for all: torch's own scheduler works as it would on
    # each member alone fed that same number (docs/fit.md refuses it in fit, not here).
    pair = Pair("adam")
    for group in pair.opt.param_groups:
        group["lr"] = SHARED
    for twin in pair.twins:
        for group in twin.param_groups:
            group["lr"] = SHARED
    ours = sched.ReduceLROnPlateau(pair.opt, patience=1, factor=0.5, cooldown=1)
    theirs = [sched.ReduceLROnPlateau(t, patience=1, factor=0.5, cooldown=1) for t in pair.twins]
    for k, metric in enumerate([1.0, 0.9, 0.95, 0.95, 0.94, 0.96, 0.99, 0.93, 0.93, 0.92]):
        pair.step()
        ours.step(torch.tensor(metric))
        for s in theirs:
            s.step(torch.tensor(metric))
        pair.check(f"epoch {k}")
        assert ours.get_last_lr() == theirs[0].get_last_lr()
    assert pair.opt.param_groups[0]["lr"] < SHARED


# -- vmapens.optim.ReduceLROnPlateau against one torch ReduceLROnPlateau per member ------------

METRICS = torch.tensor(
    [[1.0, 1.0, 1.0], [0.9, 1.1, 1.0], [0.95, 1.2, 0.8], [0.95, 1.0, 0.8], [0.8, 1.3, 0.81],
     [0.85, 1.3, 0.82], [0.9, 0.5, 0.83], [0.7, 0.6, 0.84], [0.7, 0.6, 0.85], [0.71, 0.6, 0.8]],
    dtype=F64,
)  # fmt: skip
PLATEAUS = {
    "cooldown": dict(patience=1, factor=0.5, cooldown=1),
    "max-abs-min-lr": dict(
        mode="max", patience=0, threshold_mode="abs", threshold=0.01, min_lr=0.004
    ),  # fmt: skip
    "min-lr-per-group-eps": dict(patience=0, factor=0.1, min_lr=[1e-4, 5e-3], eps=1e-3),
}


def _plateaus(pair: Pair, kw: dict[str, Any]) -> tuple[Any, list[Any]]:
    ours = vmapens.optim.ReduceLROnPlateau(pair.opt, **kw)
    return ours, [sched.ReduceLROnPlateau(t, **kw) for t in pair.twins]


def _plateau_step(pair: Pair, ours: Any, theirs: list[Any], k: int) -> None:
    pair.step()
    ours.step(METRICS[k])
    for i, s in enumerate(theirs):
        s.step(float(METRICS[k, i]))


def check_records(ours: Any, theirs: list[Any], where: str) -> None:
    for i, s in enumerate(theirs):
        for key in ("best", "num_bad_epochs", "cooldown_counter"):
            assert getattr(ours, key)[i] == getattr(s, key), f"{where} member {i} {key}"
        assert last_lrs(ours, i) == s.get_last_lr(), f"{where} member {i} get_last_lr"
    assert ours.last_epoch == theirs[0].last_epoch


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("kind", list(PLATEAUS))
def test_per_member_plateau_is_torchs_plateau_on_each_members_metric(
    kind: str, optimizer: str
) -> None:
    pair = Pair(optimizer)
    ours, theirs = _plateaus(pair, PLATEAUS[kind])
    check_records(ours, theirs, "built")  # get_last_lr before any step: the built lrs
    apart = False
    for k in range(len(METRICS)):
        _plateau_step(pair, ours, theirs, k)
        pair.check(f"epoch {k}")
        check_records(ours, theirs, f"epoch {k}")
        apart |= len(set(pair.opt.param_groups[0]["lr"])) == N
    assert apart, "the members' lrs never all differed: the test would not see a mix-up"


def test_plateau_state_dict_is_a_snapshot_and_round_trips_mid_run() -> None:
    # The state dict held the scheduler's own per-member lists: the steps after it changed a
    # state dict already taken, and loading it back went on from the later state.
    pair = Pair("sgd")
    kw = PLATEAUS["cooldown"]
    ours, theirs = _plateaus(pair, kw)
    for k in range(3):
        _plateau_step(pair, ours, theirs, k)
    saved = ours.state_dict()
    opt_saved = pair.opt.state_dict()
    twins_saved = [(t.state_dict(), s.state_dict()) for t, s in zip(pair.twins, theirs)]
    kept = copy.deepcopy(saved)
    for k in range(3, 6):  # went on: the saved dict must not follow
        _plateau_step(pair, ours, theirs, k)
    assert saved == kept, "a later step changed a state dict already taken"
    pair.opt.load_state_dict(_saved(opt_saved))  # the optimizer first, as for torch's
    ours = vmapens.optim.ReduceLROnPlateau(pair.opt, **kw)
    ours.load_state_dict(_saved(saved))
    for twin, s, (opt_state, state) in zip(pair.twins, theirs, twins_saved, strict=True):
        twin.load_state_dict(opt_state)
        s.load_state_dict(state)
    check_records(ours, theirs, "reloaded")
    for k in range(3, len(METRICS)):
        _plateau_step(pair, ours, theirs, k)
        check_records(ours, theirs, f"epoch {k}")
    for i, twin in enumerate(pair.twins):
        assert member_value(pair.opt.param_groups[0]["lr"], i) == twin.param_groups[0]["lr"]


def test_plateau_bounds_a_param_group_added_later_as_torch_does() -> None:
    # A single min_lr bounds a group added after the scheduler (torch's default_min_lr): the
    # per-member scheduler raised zip()'s "argument 2 is shorter" at its first reduction.
    pair = Pair("sgd")
    extra = torch.randn(N, 4, generator=pair.g, dtype=F64).requires_grad_()
    kw = dict(patience=0, factor=0.5, min_lr=0.004)
    ours, theirs = _plateaus(pair, kw)
    pair.opt.add_param_group({"params": [extra], "lr": 0.02})
    for i, twin in enumerate(pair.twins):
        twin.add_param_group({"params": [extra[i].detach().clone().requires_grad_()], "lr": 0.02})
    for k in range(len(METRICS)):
        _plateau_step(pair, ours, theirs, k)
        for i, twin in enumerate(pair.twins):
            for group, alone in zip(pair.opt.param_groups, twin.param_groups, strict=True):
                assert member_value(group["lr"], i) == alone["lr"], f"epoch {k} member {i}"
    assert min(pair.opt.param_groups[2]["lr"]) == 0.004  # reduced down to min_lr


def test_plateau_with_min_lr_per_group_refuses_an_added_group_when_it_reduces() -> None:
    pair = Pair("sgd")
    ours = vmapens.optim.ReduceLROnPlateau(pair.opt, patience=0, min_lr=[0.0, 0.0])
    pair.opt.add_param_group({"params": [torch.zeros(N, 2, dtype=F64, requires_grad=True)]})
    ours.step([1.0] * N)  # an improvement: nothing to lower, so torch's scheduler goes on too
    before = ours.state_dict()
    with pytest.raises(RuntimeError, match=r"^ReduceLROnPlateau.step: .*3 param groups.*`min_lr`"):
        ours.step([1.0] * N)
    assert ours.state_dict() == before


def test_plateau_keeps_a_tensor_lr_as_torch_does_while_members_agree() -> None:
    # torch fills a 0-d tensor lr in place and goes on computing with it in its dtype; the
    # per-member scheduler turned it into float64 MemberValues at the first reduction, and the
    # members then stepped with other bits than torch's (docs/optim.md, tensor learning rates).
    g = torch.Generator().manual_seed(0)
    stacked = torch.randn(N, 4, generator=g, dtype=F64).requires_grad_()
    alone = [stacked[i].detach().clone().requires_grad_() for i in range(N)]
    lr = torch.tensor(0.01)  # float32, as torch.tensor(0.01) is
    opt = vmapens.StackedAdam([stacked], lr=lr)
    twins = [torch.optim.Adam([a], lr=torch.tensor(0.01)) for a in alone]
    ours = vmapens.optim.ReduceLROnPlateau(opt, patience=0, factor=0.3)
    theirs = [sched.ReduceLROnPlateau(t, patience=0, factor=0.3) for t in twins]
    for metric in [1.0, 2.0, 0.5, 3.0, 3.0]:
        stacked.grad = torch.randn(stacked.shape, generator=g, dtype=F64)
        opt.step()
        for i, twin in enumerate(twins):
            alone[i].grad = stacked.grad[i].clone()
            twin.step()
        ours.step([metric] * N)
        for s in theirs:
            s.step(metric)
    assert opt.param_groups[0]["lr"] is lr and torch.equal(lr, twins[0].param_groups[0]["lr"])
    for i in range(N):
        assert torch.equal(stacked[i], alone[i]), f"member {i}"


# -- state dicts, last_epoch, hand-off and sub-ensembles --------------------------------------

RESUMED = ["cosine", "one-cycle", "cyclic", "step", "sequential", "warm-restarts", "polynomial"]


@pytest.mark.parametrize("way", ["state-dicts", "last-epoch"])
@pytest.mark.parametrize("kind", RESUMED)
def test_a_schedule_resumed_mid_run_is_torchs_resumed_the_same_way(kind: str, way: str) -> None:
    # "state-dicts": torch's recommended order (build, then load both state dicts) must end
    # where an uninterrupted run ends. "last-epoch": load the optimizer, then build the
    # scheduler with last_epoch=K (needs `initial_lr` in the loaded groups): torch's own
    # result, whatever it is, for each member.
    make, stop = SCHEDULERS[kind], 5
    straight = Pair("sgd")
    s = make(straight.opt, None)
    for _ in range(STEPS):
        straight.step()
        s.step()
    pair = Pair("sgd")
    ours = make(pair.opt, None)
    theirs = [make(t, i) for i, t in enumerate(pair.twins)]
    for _ in range(stop):
        pair.step()
        for x in [ours, *theirs]:
            x.step()
    saved = _saved([(o.state_dict(), x.state_dict()) for o, x in zip([pair.opt, *pair.twins],
                                                                  [ours, *theirs])])  # fmt: skip
    stacked, twin = OPTIMIZERS["sgd"]
    pair.opt = stacked(pair._groups(pair.stacked), LRS)
    pair.twins = [twin(pair._groups(a), LRS[i]) for i, a in enumerate(pair.alone)]
    rebuilt = []
    for k, (opt, (opt_state, state)) in enumerate(zip([pair.opt, *pair.twins], saved)):
        i = None if k == 0 else k - 1
        if way == "state-dicts":
            x = make(opt, i)
            opt.load_state_dict(opt_state)
            x.load_state_dict(state)
        else:
            opt.load_state_dict(opt_state)
            x = _rebuilt_at(kind, opt, i, stop)
        rebuilt.append(x)
    # Built with last_epoch=K, a scheduler steps once more at once (torch's way): one step less
    # keeps one-cycle within its total_steps.
    for k in range(stop, STEPS if way == "state-dicts" else STEPS - 1):
        pair.step()
        for x in rebuilt:
            x.step()
        pair.check(f"{way} step {k}")
    if way == "state-dicts":
        for a, b in zip(straight.stacked, pair.stacked, strict=True):
            assert torch.equal(a, b)
        assert straight.opt.param_groups[0]["lr"] == pair.opt.param_groups[0]["lr"]


def _rebuilt_at(kind: str, opt: Any, i: int | None, last_epoch: int) -> Any:
    """The scheduler ``kind`` built again with ``last_epoch`` (torch's resumption argument)."""
    if kind == "sequential":
        inner = [sched.LinearLR(opt, 0.1, 1.0, 3, last_epoch=last_epoch),
                 sched.ExponentialLR(opt, 0.8, last_epoch=last_epoch)]  # fmt: skip
        return sched.SequentialLR(opt, inner, milestones=[3], last_epoch=last_epoch)
    built = {
        "cosine": lambda: sched.CosineAnnealingLR(opt, 4, 1e-4, last_epoch=last_epoch),
        "one-cycle": lambda: sched.OneCycleLR(
            opt, per(LRS, i), total_steps=12, last_epoch=last_epoch
        ),  # fmt: skip
        "cyclic": lambda: _cyclic(
            opt, i, base_momentum=0.8, max_momentum=0.9, last_epoch=last_epoch
        ),  # fmt: skip
        "step": lambda: sched.StepLR(opt, 3, 0.5, last_epoch=last_epoch),
        "warm-restarts": lambda: sched.CosineAnnealingWarmRestarts(
            opt, 3, T_mult=2, eta_min=1e-4, last_epoch=last_epoch
        ),
        "polynomial": lambda: sched.PolynomialLR(opt, 7, 2.0, last_epoch=last_epoch),
    }
    return built[kind]()


def test_a_scheduled_member_handed_off_to_torch_goes_on_with_its_own_schedule() -> None:
    # member_state_dict(i) handed every member's `initial_lr`, `max_lr` and `min_lr` (the
    # scheduler's MemberValues in the group) to member i's torch optimizer: a torch scheduler
    # resumed on it set the member's lr to all members' values and torch's SGD failed.
    pair = Pair("sgd")
    make, stop = SCHEDULERS["one-cycle"], 5
    ours = make(pair.opt, None)
    theirs = [make(t, i) for i, t in enumerate(pair.twins)]
    for _ in range(stop):
        pair.step()
        for x in [ours, *theirs]:
            x.step()
    for i in range(N):
        handed = [p[i].detach().clone().requires_grad_() for p in pair.stacked]
        member = torch.optim.SGD(Pair._groups(handed), lr=LRS[i], momentum=0.9)
        member.load_state_dict(pair.opt.member_state_dict(i))
        alone = torch.optim.SGD(Pair._groups(pair.alone[i]), lr=LRS[i], momentum=0.9)
        alone.load_state_dict(pair.twins[i].state_dict())
        schedules = [_rebuilt_at("one-cycle", o, i, stop) for o in (member, alone)]
        g = torch.Generator().manual_seed(i)
        for _ in range(stop, STEPS - 1):  # built with last_epoch=K: one step taken at once
            for a, b in zip(handed, pair.alone[i], strict=True):
                a.grad = torch.randn(a.shape, generator=g, dtype=F64)
                b.grad = a.grad.clone()
            for o, s in zip((member, alone), schedules, strict=True):
                o.step()
                s.step()
            assert member.param_groups[0]["lr"] == alone.param_groups[0]["lr"]
        for a, b in zip(handed, pair.alone[i], strict=True):
            torch.testing.assert_close(a, b, **TOL64, msg=f"member {i}")


def test_a_sub_ensemble_keeps_its_members_base_lrs_for_the_next_schedule() -> None:
    # opt.select permuted `lr` but not `initial_lr`: a scheduler built on the new optimizer
    # (torch's setdefault keeps an initial_lr already there) annealed member k from another
    # member's base lr, silently.
    pair = Pair("sgd")
    first = sched.StepLR(pair.opt, 1, 0.5)
    twins_first = [sched.StepLR(t, 1, 0.5) for t in pair.twins]
    for _ in range(2):
        pair.step()
        for x in [first, *twins_first]:
            x.step()
    order = [2, 0, 1]
    sub = [p[order].detach().clone().requires_grad_() for p in pair.stacked]
    opt = pair.opt.select(order, sub)
    assert opt.param_groups[0]["initial_lr"] == MemberValues([LRS[k] for k in order])
    cosine = sched.CosineAnnealingLR(opt, T_max=4)
    alone = [sched.CosineAnnealingLR(pair.twins[k], T_max=4) for k in order]
    for _ in range(3):
        for p in sub:
            p.grad = torch.zeros_like(p)
        opt.step()
        pair.step()  # the twins' own steps (their tensors are not compared here)
        for s in [cosine, *alone]:
            s.step()
    for row, s in enumerate(alone):
        assert last_lrs(cosine, row) == s.get_last_lr(), f"member {order[row]} as row {row}"


# -- in fit: the scheduler callback per step and per epoch, and a resumed run ------------------

ROWS, BATCH, PER_EPOCH, EPOCHS = 20, 6, 4, 3
G = torch.Generator().manual_seed(0)
X, Y = torch.randn(ROWS, 4, generator=G, dtype=F64), torch.randn(ROWS, 3, generator=G, dtype=F64)
XV, YV = torch.randn(9, 4, generator=G, dtype=F64), torch.randn(9, 3, generator=G, dtype=F64)
FIT = dict(epochs=EPOCHS, batch_size=BATCH, shuffle=False, progress=False, seed=0, lr=LRS)
FIT_OPTIMIZERS: dict[str, tuple[dict[str, Any], Callable[[nn.Module, int], Any]]] = {
    "sgd": (
        dict(optimizer=vmapens.StackedSGD, momentum=0.9),
        lambda m, i: torch.optim.SGD(m.parameters(), lr=LRS[i], momentum=0.9),
    ),  # fmt: skip
    "adam": (dict(), lambda m, i: torch.optim.Adam(m.parameters(), lr=LRS[i])),
}
# (scheduler, optimizer, interval); one-cycle is built for STEPS = EPOCHS * PER_EPOCH steps.
FIT_CASES = [
    ("cyclic", "sgd", "step"),
    ("cyclic", "adam", "epoch"),
    ("one-cycle", "adam", "step"),
    ("one-cycle", "sgd", "step"),
    ("warm-restarts", "sgd", "epoch"),
    ("warm-restarts", "adam", "step"),
    ("sequential", "adam", "step"),
    ("chained", "sgd", "epoch"),
    ("polynomial", "adam", "step"),
]


class StopAt(vmapens.Callback):
    """Interrupts training right after global step ``at`` (mid-epoch, after a checkpoint)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, ctx: vmapens.callbacks.Context) -> None:
        if ctx.step == self.at:
            raise KeyboardInterrupt


def plain(i: int) -> nn.Module:
    """Member i of ``Ensemble(models.MLP, N, seed=0).double()`` (docs/semantics.md's recipe)."""
    torch.manual_seed(derived_seed(0, "member", i))
    return models.MLP().double()


def fitted(kind: str, optimizer: str, interval: str, *, stop: int | None = None,
           path: Path | None = None) -> tuple[vmapens.Ensemble, Any]:  # fmt: skip
    ens = vmapens.Ensemble(models.MLP, N, seed=0).double()
    make = SCHEDULERS[kind]
    callbacks: list[Any] = [LRScheduler(lambda o: make(o, None), interval=interval)]
    callbacks += [StopAt(stop)] if stop is not None else []
    try:
        vmapens.fit(ens, (X, Y), nn.MSELoss(), callbacks=callbacks, checkpoint=path,
                    **FIT_OPTIMIZERS[optimizer][0], **FIT)  # fmt: skip
    except KeyboardInterrupt:
        assert stop is not None
    return ens, callbacks[0].scheduler


def trained_alone(kind: str, optimizer: str, interval: str) -> tuple[list[nn.Module], list[Any]]:
    batches = batch_plan(ROWS, BATCH, EPOCHS * PER_EPOCH, shuffle=False)
    members, schedulers = [], []
    for i in range(N):
        model = plain(i)
        opt = FIT_OPTIMIZERS[optimizer][1](model, i)
        s = SCHEDULERS[kind](opt, i)

        def after(k: int, s: Any = s) -> None:
            if interval == "step" or (k + 1) % PER_EPOCH == 0:
                s.step()

        train_alone(model, [(X[b], Y[b]) for b in batches], make_opt=opt, after_step=after)
        members.append(model)
        schedulers.append(s)
    return members, schedulers


@pytest.mark.parametrize(("kind", "optimizer", "interval"), FIT_CASES,
                         ids=["-".join(c) for c in FIT_CASES])  # fmt: skip
def test_fit_resumed_mid_schedule_ends_as_uninterrupted_and_as_torch_alone(
    tmp_path: Path, kind: str, optimizer: str, interval: str
) -> None:
    straight, scheduler = fitted(kind, optimizer, interval, path=tmp_path / "straight.pt")
    fitted(kind, optimizer, interval, stop=PER_EPOCH + 2, path=tmp_path / "cut.pt")
    resumed, resumed_scheduler = fitted(kind, optimizer, interval, path=tmp_path / "cut.pt")
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    assert resumed_scheduler.get_last_lr() == scheduler.get_last_lr()
    assert getattr(resumed_scheduler, "last_epoch", 0) == getattr(scheduler, "last_epoch", 0)
    members, alone = trained_alone(kind, optimizer, interval)
    assert_members_equal(straight, members)
    for i, s in enumerate(alone):
        assert last_lrs(scheduler, i) == s.get_last_lr(), f"member {i}"


def _plateau_fit(path: Path, stop: int | None = None) -> tuple[vmapens.Ensemble, Any]:
    ens = vmapens.Ensemble(models.MLP, N, seed=0).double()
    plateau = LRScheduler(lambda o: vmapens.optim.ReduceLROnPlateau(o, patience=0, factor=0.5))
    callbacks: list[Any] = [plateau, EarlyStopping(restore_best=False)]
    callbacks += [StopAt(stop)] if stop is not None else []
    try:
        vmapens.fit(ens, (X, Y), nn.MSELoss(), val_data=(XV, YV), callbacks=callbacks,
                    checkpoint=path, **{**FIT, "lr": [0.05, 0.2, 0.5], "epochs": 5})  # fmt: skip
    except KeyboardInterrupt:
        assert stop is not None
    return ens, plateau.scheduler


def test_fit_with_per_member_plateau_resumed_ends_as_uninterrupted_and_as_torch(tmp_path):
    straight, scheduler = _plateau_fit(tmp_path / "straight.pt")
    _plateau_fit(tmp_path / "cut.pt", stop=2 * PER_EPOCH + 1)
    resumed, again = _plateau_fit(tmp_path / "cut.pt")
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    assert again.state_dict() == scheduler.state_dict()
    batches = batch_plan(ROWS, BATCH, PER_EPOCH, shuffle=False)
    members = []
    for i, lr in enumerate([0.05, 0.2, 0.5]):
        model = plain(i)
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        s = sched.ReduceLROnPlateau(opt, patience=0, factor=0.5)
        for _ in range(5):
            train_alone(model, [(X[b], Y[b]) for b in batches], make_opt=opt)
            with torch.no_grad():
                s.step(float(nn.functional.mse_loss(model(XV), YV)))
        assert member_value(scheduler.get_last_lr()[0], i) == s.get_last_lr()[0], f"member {i}"
        members.append(model)
    assert_members_equal(straight, members)
    assert len(set(straight_lrs := scheduler.get_last_lr()[0])) > 1, straight_lrs


OWN_OPTIMIZER = {k: v for k, v in FIT.items() if k != "lr"}  # fit given a built optimizer


def test_fit_refuses_a_per_member_plateau_it_does_not_step_with_a_checkpoint(tmp_path):
    # A plateau stepped by the user's own callable: its record is not in fit's checkpoint, so
    # a resumed run restarted it and lowered other learning rates than the uninterrupted run,
    # silently. torch's schedulers are refused for this (docs/fit.md); this one was not.
    ens = vmapens.Ensemble(models.MLP, N, seed=0).double()
    opt = vmapens.StackedAdam(ens, lr=LRS)
    plateau = vmapens.optim.ReduceLROnPlateau(opt, patience=0)
    before = copy.deepcopy(ens.state_dict())
    with pytest.raises(ValueError, match=r"^fit: a vmapens.optim.ReduceLROnPlateau is built on"):
        vmapens.fit(ens, (X, Y), nn.MSELoss(), optimizer=opt, val_data=(XV, YV),
                    callbacks=[lambda h: plateau.step(h.val_loss[-1])],
                    checkpoint=tmp_path / "ck.pt", **OWN_OPTIMIZER)  # fmt: skip
    torch.testing.assert_close(ens.state_dict(), before, rtol=0, atol=0)
    assert not (tmp_path / "ck.pt").exists()
    # Given to fit, the same scheduler is stepped and checkpointed: no refusal.
    vmapens.fit(ens, (X, Y), nn.MSELoss(), optimizer=opt, val_data=(XV, YV), scheduler=plateau,
                checkpoint=tmp_path / "ck.pt", **{**OWN_OPTIMIZER, "epochs": 1})  # fmt: skip
    assert plateau.last_epoch == 1


@pytest.mark.parametrize("kind", ["cosine", "warm-restarts"])
def test_fit_called_again_with_more_epochs_continues_the_same_objects(tmp_path, kind) -> None:
    # The documented way to train further: call fit again with more epochs. With the same
    # optimizer and scheduler objects, whose settings the schedule has moved since they were
    # built, the resume check refused the run as "other options". Truth: one run of all epochs.
    def run(epochs: list[int], path: Path) -> tuple[vmapens.Ensemble, Any]:
        ens = vmapens.Ensemble(models.MLP, N, seed=0).double()
        opt = vmapens.StackedSGD(ens, lr=LRS, momentum=0.9)
        sched = SCHEDULERS[kind](opt, None)
        for e in epochs:
            vmapens.fit(ens, (X, Y), nn.MSELoss(), optimizer=opt, scheduler=sched,
                        checkpoint=path, **{**OWN_OPTIMIZER, "epochs": e})  # fmt: skip
        return ens, sched

    straight, s1 = run([4], tmp_path / "straight.pt")
    continued, s2 = run([2, 4], tmp_path / "continued.pt")
    for (name, a), b in zip(straight.state_dict().items(), continued.state_dict().values()):
        assert torch.equal(a, b), name
    assert s1.get_last_lr() == s2.get_last_lr()
    # A fresh optimizer and scheduler, built as the first run's were, still resume as before.
    fresh, s3 = run([4], tmp_path / "continued.pt")
    assert s3.get_last_lr() == s1.get_last_lr()


def test_a_finished_linear_one_cycle_run_loads_its_own_checkpoint(tmp_path) -> None:
    # torch's linear one-cycle leaves the lr a little below 0 after its last step; torch's
    # optimizers load any lr, the stacked ones refused it as out of range, so rerunning the
    # finished fit (or restoring its checkpoint) failed. Other hyperparameters stay checked.
    def run() -> vmapens.Ensemble:
        ens = vmapens.Ensemble(models.MLP, N, seed=0).double()
        cycle = LRScheduler(
            lambda o: sched.OneCycleLR(o, max_lr=MemberValues(LRS), total_steps=EPOCHS * PER_EPOCH,
                                 anneal_strategy="linear"),
            interval="step",
        )  # fmt: skip
        vmapens.fit(ens, (X, Y), nn.MSELoss(), callbacks=[cycle], checkpoint=tmp_path / "c.pt",
                    **FIT)  # fmt: skip
        return ens

    first = run()
    again = run()  # resumes the finished run: nothing left to train
    for (name, a), b in zip(first.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name
    opt = vmapens.StackedAdam(first, lr=0.1)
    torch_opt = torch.optim.Adam(plain(0).parameters(), lr=0.1)
    state = opt.state_dict()
    state["param_groups"][0]["lr"] = -1e-3  # as torch's Adam loads it
    opt.load_state_dict(state)
    torch_state = torch_opt.state_dict()
    torch_state["param_groups"][0]["lr"] = -1e-3
    torch_opt.load_state_dict(torch_state)
    assert opt.param_groups[0]["lr"] == torch_opt.param_groups[0]["lr"] == -1e-3


# -- hyperparameters edited by hand between steps, as a schedule of one's own edits them -------

EDITS: dict[str, tuple[type, type, dict[str, Any], list[tuple[str, Any]]]] = {
    "sgd": (vmapens.StackedSGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9),
            [("momentum", 0.5), ("dampening", 0.3), ("weight_decay", 0.1), ("nesterov", True),
             ("momentum", 0.0), ("momentum", 0.7)]),
    "adam": (vmapens.StackedAdam, torch.optim.Adam, dict(lr=0.05),
             [("betas", (0.8, 0.99)), ("eps", 1e-3), ("weight_decay", 0.1),
              ("decoupled_weight_decay", True)]),
    "rmsprop": (vmapens.StackedRMSprop, torch.optim.RMSprop, dict(lr=0.01, momentum=0.5),
                [("alpha", 0.9), ("momentum", 0.9), ("eps", 1e-3)]),
    "adagrad": (vmapens.StackedAdagrad, torch.optim.Adagrad, dict(lr=0.05),
                [("lr_decay", 0.1), ("eps", 1e-3), ("weight_decay", 0.1)]),
    "nadam": (vmapens.StackedNAdam, torch.optim.NAdam, dict(lr=0.05),
              [("betas", (0.8, 0.99)), ("momentum_decay", 0.01), ("weight_decay", 0.1)]),
    "adadelta": (vmapens.StackedAdadelta, torch.optim.Adadelta, dict(lr=1.0),
                 [("rho", 0.5), ("eps", 1e-3), ("weight_decay", 0.1)]),
    "rprop": (vmapens.StackedRprop, torch.optim.Rprop, dict(lr=0.05),
              [("etas", (0.3, 1.5)), ("step_sizes", (1e-4, 0.1))]),
    "asgd": (vmapens.StackedASGD, torch.optim.ASGD, dict(lr=0.05, t0=2),
             [("lambd", 1e-2), ("alpha", 0.5), ("weight_decay", 0.1)]),
}  # fmt: skip


# "tensor": the per-member values as a 1-D tensor, which the constructors read as MemberValues;
# set mid-run it failed with "Boolean value of Tensor ... is ambiguous" (SGD's momentum).
@pytest.mark.parametrize("style", ["shared", "per-member", "tensor"])
@pytest.mark.parametrize("name", list(EDITS))
def test_hyperparameters_edited_mid_run_move_each_member_as_torch(name: str, style: str) -> None:
    stacked_class, torch_class, kw, edits = EDITS[name]
    g = torch.Generator().manual_seed(0)
    stacked = [torch.randn(N, 4, 3, generator=g, dtype=F64).requires_grad_()]
    alone = [[stacked[0][i].detach().clone().requires_grad_()] for i in range(N)]
    opt = stacked_class(stacked, **kw)
    twins = [torch_class(a, **kw) for a in alone]

    def step() -> None:
        stacked[0].grad = torch.randn(stacked[0].shape, generator=g, dtype=F64)
        opt.step()
        for i, twin in enumerate(twins):
            alone[i][0].grad = stacked[0].grad[i].clone()
            twin.step()

    for key, value in edits:
        step()
        first = value[0] if isinstance(value, tuple) else value
        if style != "shared" and isinstance(first, float) and first != 0:
            # A pair's first value differs per member (its second is shared), a float's too.
            values = [first * (1 - 0.1 * i) for i in range(N)]  # in range: alpha < 1
            per = MemberValues(values) if style == "per-member" else torch.tensor(values, dtype=F64)
            opt.param_groups[0][key] = (per, value[1]) if isinstance(value, tuple) else per
            for i, twin in enumerate(twins):
                twin.param_groups[0][key] = (
                    (values[i], value[1]) if isinstance(value, tuple) else values[i]
                )
        else:
            opt.param_groups[0][key] = value
            for twin in twins:
                twin.param_groups[0][key] = value
        step()
        for i in range(N):
            torch.testing.assert_close(stacked[0][i], alone[i][0], **TOL64, msg=f"{key} {i}")
