"""Seeded random workflows on an Ensemble and on N plain modules, compared after every call.

Each program builds an ``Ensemble`` (float64, N = 2..5) and the N plain modules it stands for,
each with its own ``torch.optim`` optimizer (and LR scheduler), then applies a random sequence
of the research workflows on top of the ensemble to both sides: training steps (masks too),
scheduler steps, ``vmapens.pbt.exploit_`` (repeats in ``src``, overlapping ``src``/``dst``,
swaps, lists, tuples, tensors, numpy arrays, negative rows), ``vmapens.pbt.explore``,
``best_k`` and ``select`` with the optimizer, and hyperparameter edits. The truth is written
from the documented semantics with plain torch: after ``exploit_`` member ``dst[j]`` is a deep
copy of member ``src[j]``'s module and optimizer (state and hyperparameters, all read before
any is written), so continuing it must equal continuing that copy alone. After every call
member ``i`` is compared with module ``i``: parameters, buffers, hyperparameters and optimizer
state. Bad calls (a ``dst`` with repeats, lengths that differ, rows out of range, a perturbed
value the optimizer refuses) must raise and change nothing.

Run one program by hand: ``python tests/test_fuzz_workflows.py SEED [SEED ...]``.
"""

from __future__ import annotations

import copy
import math
import random
import sys
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import vmapens
from vmapens.optim import MemberValues, stacked
from vmapens.pbt import exploit_, explore
from vmapens.selection import best_k

pytestmark = pytest.mark.usefixtures("float64_default")

TOL = dict(rtol=1e-9, atol=1e-11, equal_nan=True)  # float64: only the order of sums may differ


class MLP(nn.Module):
    def __init__(self, bn: bool) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(3, 4, bias=not bn), nn.Linear(4, 2)
        self.bn = nn.BatchNorm1d(4) if bn else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


# -- random optimizers: (torch class, per-member kwargs drawn for each member) ----------------


def _lr(r: random.Random) -> float:
    return r.choice([1e-2, 3e-2, 0.1])


def _spec(r: random.Random) -> tuple[type[torch.optim.Optimizer], dict[str, Callable[[], Any]]]:
    """A torch optimizer class and, per hyperparameter, a draw of one member's value."""
    kind = r.choice(["sgd", "sgd_nesterov", "adam", "adamw", "rmsprop", "adagrad", "nadam",
                     "radam", "adamax", "adadelta", "asgd", "rprop"])  # fmt: skip
    lr = lambda: _lr(r)  # noqa: E731
    if kind == "sgd":
        return torch.optim.SGD, {
            "lr": lr,
            "momentum": lambda: r.choice([0.0, 0.5, 0.9]),
            "weight_decay": lambda: r.choice([0.0, 1e-2]),
        }
    if kind == "sgd_nesterov":
        return torch.optim.SGD, {"lr": lr, "momentum": lambda: r.choice([0.5, 0.9]),
                                 "nesterov": lambda: True}  # fmt: skip
    if kind == "adam":
        amsgrad = r.random() < 0.5
        return torch.optim.Adam, {
            "lr": lr,
            "betas": lambda: (r.choice([0.8, 0.9]), r.choice([0.99, 0.999])),
            "weight_decay": lambda: r.choice([0.0, 1e-2]),
            "amsgrad": lambda: amsgrad,
        }
    if kind == "adamw":
        return torch.optim.AdamW, {"lr": lr, "weight_decay": lambda: r.choice([0.0, 0.1])}
    if kind == "rmsprop":
        centered = r.random() < 0.5
        return torch.optim.RMSprop, {
            "lr": lr,
            "alpha": lambda: r.choice([0.9, 0.99]),
            "momentum": lambda: r.choice([0.0, 0.5]),
            "centered": lambda: centered,
        }
    if kind == "adagrad":
        return torch.optim.Adagrad, {
            "lr": lr,
            "lr_decay": lambda: r.choice([0.0, 0.1]),
            "initial_accumulator_value": lambda: r.choice([0.0, 0.1]),
        }
    if kind == "nadam":
        return torch.optim.NAdam, {"lr": lr, "momentum_decay": lambda: r.choice([4e-3, 1e-2])}
    if kind == "radam":
        return torch.optim.RAdam, {"lr": lr, "weight_decay": lambda: r.choice([0.0, 1e-2])}
    if kind == "adamax":
        return torch.optim.Adamax, {"lr": lr}
    if kind == "adadelta":
        return torch.optim.Adadelta, {"lr": lambda: r.choice([0.5, 1.0]),
                                      "rho": lambda: r.choice([0.8, 0.9])}  # fmt: skip
    if kind == "asgd":
        return torch.optim.ASGD, {"lr": lr, "lambd": lambda: r.choice([1e-4, 1e-2]),
                                  "t0": lambda: r.choice([1.0, 3.0])}  # fmt: skip
    return torch.optim.Rprop, {"lr": lr}


FLAGS = ("amsgrad", "centered", "nesterov")  # shared by every member


def _stacked_kwargs(per: list[dict[str, Any]]) -> dict[str, Any]:
    """The stacked optimizer's kwargs: a shared float where all members agree (sometimes),
    else one value per member (pairs as two lists)."""
    out: dict[str, Any] = {}
    for name in per[0]:
        values = [p[name] for p in per]
        if name in FLAGS or all(v == values[0] for v in values):
            out[name] = values[0]
        elif isinstance(values[0], tuple):
            out[name] = tuple(list(v) for v in zip(*values, strict=True))
        else:
            out[name] = values
    return out


SCHEDULERS: list[Callable[[torch.optim.Optimizer], Any] | None] = [
    None,
    lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9),
    lambda o: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[1, 3], gamma=0.3),
]


# -- the two sides -----------------------------------------------------------------------------


class World:
    """The ensemble side (ens, opt, sched) and the plain side (modules, optimizers, schedulers)."""

    def __init__(self, seed: int, log: list[str] | None = None) -> None:
        r = self.r = random.Random(seed)
        self.log = log
        n = r.randint(2, 5)
        bn = r.random() < 0.3
        self.factory = lambda: MLP(bn)
        seeds = [r.randrange(10_000) for _ in range(n)]
        self.modules = []
        for s in seeds:
            torch.manual_seed(s)
            self.modules.append(self.factory())
        self.ens = vmapens.Ensemble(self.factory, n, seeds=seeds)
        self.cls, draws = _spec(r)
        per = [{k: d() for k, d in draws.items()} for _ in range(n)]
        self.opts = [self.cls(m.parameters(), **p) for m, p in zip(self.modules, per, strict=True)]
        self.opt = stacked(self.cls)(self.ens, **_stacked_kwargs(per))
        self.make_sched = r.choice(SCHEDULERS)
        self.sched = None if self.make_sched is None else self.make_sched(self.opt)
        self.scheds = [None if self.make_sched is None else self.make_sched(o) for o in self.opts]
        self.say(f"n={n} bn={bn} {self.cls.__name__} {_stacked_kwargs(per)} sched={self.sched}")
        self.data = torch.Generator().manual_seed(seed)

    def say(self, line: str) -> None:
        if self.log is not None:
            self.log.append(line)

    @property
    def n(self) -> int:
        return len(self.ens)

    # -- calls ----------------------------------------------------------------------------------

    def train(self) -> None:
        # BatchNorm over 2 rows outputs +-1 whatever its input: the layers before it get
        # gradients of round-off size, which RMSprop/Adam scale up to whole steps.
        b = self.r.choice([4, 8] if isinstance(self.modules[0].bn, nn.BatchNorm1d) else [2, 5, 8])
        x = torch.randn(b, 3, generator=self.data)
        y = torch.randn(b, 2, generator=self.data)
        keep = None
        if self.r.random() < 0.3:
            keep = [self.r.random() < 0.6 for _ in range(self.n)]
        self.say(f"train b={b} mask={keep}")
        self.opt.zero_grad()
        loss = ((self.ens(x) - y) ** 2).mean(dim=(1, 2)).sum()
        loss.backward()
        self.opt.step(None if keep is None else torch.tensor(keep))
        for i, (m, o) in enumerate(zip(self.modules, self.opts, strict=True)):
            o.zero_grad()
            ((m(x) - y) ** 2).mean().backward()
            if keep is None or keep[i]:
                o.step()
            elif isinstance(m.bn, nn.BatchNorm1d):
                pass  # the forward still updated the running statistics, on both sides

    def sched_step(self) -> None:
        if self.sched is None:
            return self.train()
        self.say("scheduler.step()")
        with warnings.catch_warnings():
            # A scheduler made after select()/exploit_ has not seen its optimizer step yet.
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
            self.sched.step()
            for s in self.scheds:
                s.step()

    def _rows(self, rows: list[int]) -> Any:
        """``rows`` as a user may pass them: list, tuple, tensor, numpy array, negative ints."""
        form = self.r.choice(["list", "tuple", "tensor", "numpy", "negative"])
        if form == "tuple":
            return tuple(rows)
        if form == "tensor":
            return torch.tensor(rows, dtype=self.r.choice([torch.int64, torch.int32]))
        if form == "numpy":
            return np.array(rows)
        if form == "negative":
            return [i - self.n if self.r.random() < 0.5 else i for i in rows]
        return list(rows)

    def exploit(self) -> None:
        n, r = self.n, self.r
        how = r.choice(["random", "swap", "chain", "same"])
        if how == "swap" and n >= 2:
            a, b = r.sample(range(n), 2)
            src, dst = [a, b], [b, a]
        elif how == "chain":  # each dst is also a later src: all rows must be read first
            order = r.sample(range(n), n)
            src, dst = order, order[1:] + order[:1]
        elif how == "same":
            dst = r.sample(range(n), r.randint(1, n))
            src = list(dst)
        else:
            dst = r.sample(range(n), r.randint(1, n))
            src = [r.randrange(n) for _ in dst]  # repeats allowed
        self.say(f"exploit_ src={src} dst={dst}")
        exploit_(self.ens, self.opt, self._rows(src), self._rows(dst))
        copies = [self._copy(s) for s in src]  # all read before any is written
        for d, (m, o, s) in zip(dst, copies, strict=True):
            self.modules[d], self.opts[d], self.scheds[d] = m, o, s

    def _copy(self, i: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
        """A deep copy of member ``i`` alone: its module, optimizer and scheduler."""
        m = copy.deepcopy(self.modules[i])
        o = self.cls(m.parameters())
        o.load_state_dict(copy.deepcopy(self.opts[i].state_dict()))
        s = None
        if self.make_sched is not None:
            s = self.make_sched(o)
            s.load_state_dict(self.scheds[i].state_dict())
        return m, o, s

    def explore(self) -> None:
        names = [k for k, h in self.opt.hyperparameters.items() if not h.pair]
        names = [k for k in names if not isinstance(self.opt.param_groups[0][k], bool)]
        picked = self.r.sample(names, self.r.randint(1, min(2, len(names))))
        rows = self.r.sample(range(self.n), self.r.randint(1, self.n))
        factors = self.r.choice([(0.8, 1.2), (0.5, 2.0), (3.0,), (0.5, 0.25, 1.5)])
        self.say(f"explore rows={rows} names={picked} factors={factors}")
        before = self._hypers()
        g = torch.Generator().manual_seed(self.r.randrange(1000))
        try:
            explore(self.opt, self._rows(rows), factors, g, names=picked)
        except ValueError as err:
            # A perturbed value the optimizer refuses: refused whole, nothing changed.
            assert "would become" in str(err), err
            assert self._hypers() == before
            return
        after = self._hypers()
        for i in range(self.n):
            for name in self.opt.hyperparameters:
                old, new = before[i][name], after[i][name]
                if name in picked and i in rows:
                    # multiplied by one of `factors` (0 stays 0)
                    hits = [f for f in factors if old * f == new]
                    assert hits, (i, name, old, new, factors)
                    for group in self.opts[i].param_groups:
                        group[name] = group[name] * hits[0]
                else:
                    assert new == old, (i, name, old, new)

    def _hypers(self) -> list[dict[str, Any]]:
        """Each member's hyperparameters as the stacked optimizer holds them (group 0)."""
        group = self.opt.param_groups[0]
        out = []
        for i in range(self.n):
            row = {}
            for name in self.opt.hyperparameters:
                v = group[name]
                row[name] = _member(v, i)
            out.append(row)
        return out

    def select(self) -> None:
        n, r = self.n, self.r
        if r.random() < 0.5:
            scores = torch.tensor([r.choice([0.1, 0.2, 0.3, math.nan, math.inf]) for _ in range(n)])
            k = r.randint(1, n)
            mode = r.choice(["min", "max"])
            self.say(f"best_k scores={scores.tolist()} k={k} mode={mode}")
            key = [
                (math.isnan(v), v if mode == "min" else -v, i)
                for i, v in enumerate(scores.tolist())
            ]
            rows = [i for *_, i in sorted(key)][:k]
            sub, sub_opt = best_k(self.ens, scores, k, mode=mode, optimizer=self.opt)
        else:
            rows = [r.randrange(n) for _ in range(r.randint(1, n + 1))]
            self.say(f"select rows={rows}")
            sub = self.ens.select(rows)
            sub_opt = self.opt.select(rows, sub)
        picked = [self._copy(i) for i in rows]
        self.modules = [m for m, _, _ in picked]
        self.opts = [o for _, o, _ in picked]
        self.ens, self.opt = sub, sub_opt
        # The old scheduler drives the old optimizer: a new one on each side.
        self.sched = None if self.make_sched is None else self.make_sched(self.opt)
        self.scheds = [None if self.make_sched is None else self.make_sched(o) for o in self.opts]

    def edit_lr(self) -> None:
        lrs = [_lr(self.r) for _ in range(self.n)]
        self.say(f"lr := {lrs}")
        # As the step reads them: MemberValues, or a 1-D tensor of n values (docs/optim.md).
        tensor = self.sched is None and self.r.random() < 0.5  # schedulers fill_ tensors
        for group in self.opt.param_groups:
            group["lr"] = torch.tensor(lrs) if tensor else MemberValues(lrs)
        for o, lr in zip(self.opts, lrs, strict=True):
            for group in o.param_groups:
                group["lr"] = lr

    def bad(self) -> None:
        """A call that must be refused and change nothing."""
        n, r = self.n, self.r
        before = self.snapshot()
        case = r.choice(["repeat_dst", "lengths", "range", "explore_range"])
        self.say(f"bad {case}")
        with pytest.raises((ValueError, IndexError)):
            if case == "repeat_dst":
                exploit_(self.ens, self.opt, [0, 1], [n - 1, n - 1])
            elif case == "lengths":
                exploit_(self.ens, self.opt, [0, 1], [1])
            elif case == "range":
                exploit_(self.ens, self.opt, [0, n], [1, 0])
            else:
                explore(self.opt, [0, n], names=["lr"])
        after = self.snapshot()
        for a, b in zip(before, after, strict=True):
            if isinstance(a, torch.Tensor):
                torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
            else:
                assert a == b

    def snapshot(self) -> list[Any]:
        out: list[Any] = [t.clone() for t in self.ens.stacked_state().values()]
        for group in self.opt.param_groups:
            out += [
                v.clone() if isinstance(v, torch.Tensor) else v
                for k, v in group.items()
                if k != "params"
            ]
            for p in group["params"]:
                out += [
                    v.clone()
                    for v in self.opt.state.get(p, {}).values()
                    if isinstance(v, torch.Tensor)
                ]
        return out

    # -- the comparison -------------------------------------------------------------------------

    def check(self) -> None:
        assert len(self.ens) == len(self.modules)
        for i, m in enumerate(self.modules):
            got, want = self.ens[i].state_dict(), m.state_dict()
            assert list(got) == list(want)
            for name in want:
                torch.testing.assert_close(got[name], want[name], **TOL, msg=f"member {i} {name}")
        hypers = self._hypers()
        for i, o in enumerate(self.opts):
            group = o.param_groups[0]
            for name, value in hypers[i].items():
                want = group[name]
                if isinstance(want, tuple):
                    assert tuple(float(v) for v in want) == tuple(value), (i, name)
                else:
                    assert float(want) == pytest.approx(value, rel=1e-12), (i, name, value, want)
            alone = o.state_dict()["state"]
            mine = self.opt.member_state_dict(i)["state"]
            for key, state in alone.items():
                for name, v in state.items():
                    if not isinstance(v, torch.Tensor) or name not in mine.get(key, {}):
                        continue  # state made at the first step: none before it
                    torch.testing.assert_close(
                        mine[key][name].to(v.dtype), v, **TOL, msg=f"member {i} state {key}.{name}"
                    )


def _member(v: Any, i: int) -> Any:
    if isinstance(v, MemberValues):
        return v[i]
    if isinstance(v, torch.Tensor) and v.dim() == 1:
        return v[i].item()
    if isinstance(v, tuple):
        return tuple(_member(u, i) for u in v)
    if isinstance(v, bool) or v is None:
        return v
    return float(v)


CALLS = (
    ["train"] * 5
    + ["sched_step"] * 2
    + ["exploit"] * 4
    + ["explore"] * 2
    + ["select", "edit_lr", "bad"]
)


def run_program(seed: int, steps: int = 14, log: list[str] | None = None) -> None:
    w = World(seed, log)
    w.train()
    w.check()
    for _ in range(steps):
        getattr(w, w.r.choice(CALLS))()
        w.check()
    w.train()
    w.train()
    w.check()


@pytest.mark.parametrize("seed", range(16))
def test_workflow_program(seed: int) -> None:
    log: list[str] = []
    try:
        run_program(seed, log=log)
    except BaseException:
        print("\n".join(log))
        raise


# -- targeted cases (each failed before its fix) -------------------------------------------------


def _linear_members(n: int) -> tuple[vmapens.Ensemble, list[nn.Module]]:
    modules = []
    for k in range(n):
        torch.manual_seed(k)
        modules.append(nn.Linear(3, 2))
    return vmapens.Ensemble(lambda: nn.Linear(3, 2), n, seeds=list(range(n))), modules


def _step_both(ens: vmapens.Ensemble, opt: Any, modules: list[nn.Module], opts: list[Any]) -> None:
    x, y = torch.randn(6, 3), torch.randn(6, 2)
    opt.zero_grad()
    ((ens(x) - y) ** 2).mean(dim=(1, 2)).sum().backward()
    opt.step()
    for m, o in zip(modules, opts, strict=True):
        o.zero_grad()
        ((m(x) - y) ** 2).mean().backward()
        o.step()


def test_exploit_copies_a_tensor_of_per_member_hyperparameters():
    # A 1-D tensor in param_groups is one value per member to the step (docs/optim.md);
    # exploit_ left it alone, so a copy went on with its old learning rate.
    ens, modules = _linear_members(3)
    lrs = [0.01, 0.1, 0.3]
    opt = vmapens.StackedAdam(ens, lr=0.5)
    opt.param_groups[0]["lr"] = torch.tensor(lrs)
    opts = [torch.optim.Adam(m.parameters(), lr=lr) for m, lr in zip(modules, lrs, strict=True)]
    _step_both(ens, opt, modules, opts)
    exploit_(ens, opt, [1], [2])
    modules[2] = copy.deepcopy(modules[1])
    opts[2] = torch.optim.Adam(modules[2].parameters())
    opts[2].load_state_dict(copy.deepcopy(opts[1].state_dict()))  # torch's load aliases
    for _ in range(2):
        _step_both(ens, opt, modules, opts)
    for i, m in enumerate(modules):
        for name, p in m.named_parameters():
            torch.testing.assert_close(ens[i].state_dict()[name], p.detach(), **TOL)


def test_select_cuts_a_tensor_of_per_member_hyperparameters():
    ens, _ = _linear_members(3)
    opt = vmapens.StackedSGD(ens, lr=0.1)
    opt.param_groups[0]["lr"] = torch.tensor([0.1, 0.2, 0.3])
    sub, sub_opt = best_k(ens, torch.tensor([3.0, 2.0, 1.0]), 3, optimizer=opt)
    assert [float(v) for v in sub_opt.param_groups[0]["lr"]] == [0.3, 0.2, 0.1]
    one = opt.select([1], ens.select([1]))  # one member: a float, as MemberValues give
    assert one.param_groups[0]["lr"] == 0.2


def test_a_member_handed_off_gets_its_own_value_of_a_tensor_hyperparameter():
    # A 1-D tensor was handed to torch.optim.SGD whole, whose step then failed.
    ens, _ = _linear_members(3)
    opt = vmapens.StackedSGD(ens, lr=0.1)
    opt.param_groups[0]["lr"] = torch.tensor([0.1, 0.2, 0.3])
    member = ens[2]
    plain = torch.optim.SGD(member.parameters(), lr=1.0)
    plain.load_state_dict(opt.member_state_dict(2, member))
    assert plain.param_groups[0]["lr"] == 0.3
    before = [p.detach().clone() for p in member.parameters()]
    for p in member.parameters():
        p.grad = torch.ones_like(p)
    plain.step()
    for b, p in zip(before, member.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), b - 0.3, rtol=0, atol=1e-15)


def test_explore_reads_a_tensor_of_per_member_hyperparameters():
    ens, _ = _linear_members(3)
    opt = vmapens.StackedSGD(ens, lr=0.1)
    opt.param_groups[0]["lr"] = torch.tensor([0.1, 0.2, 0.3])
    explore(opt, [1], factors=(2.0,))
    assert opt.param_groups[0]["lr"] == MemberValues([0.1, 0.4, 0.3])


@pytest.mark.parametrize(
    ("members", "names", "error", "match"),
    [
        ([1, 1], ("lr",), ValueError, "`members` must not repeat a row"),
        (torch.tensor([0, 2, 0]), ("lr",), ValueError, "`members` must not repeat a row"),
        ([1], ("lr", "lr"), ValueError, "`names` must not repeat a name"),
        ([1], "lr", TypeError, "`names` must be a sequence of names"),
    ],
    ids=["repeated-row", "repeated-row-tensor", "repeated-name", "one-string"],
)
def test_explore_refuses_repeats_and_changes_nothing(members, names, error, match):
    # A repeated row was multiplied twice: by 4.0 with factors=(2.0,), not a drawn factor.
    ens, _ = _linear_members(3)
    opt = vmapens.StackedSGD(ens, lr=[0.1, 0.2, 0.3], momentum=0.5)
    before = copy.deepcopy(opt.param_groups[0])
    with pytest.raises(error, match=match):
        explore(opt, members, factors=(2.0,), names=names)
    after = opt.param_groups[0]
    assert {k: v for k, v in after.items() if k != "params"} == {
        k: v for k, v in before.items() if k != "params"
    }


def test_pbt_refuses_repeated_or_string_names_when_built():
    # A repeated name passed fit's start check and was refused by explore at the first
    # round, after exploit_ had already copied members.
    with pytest.raises(ValueError, match="`names` must not repeat a name"):
        vmapens.pbt.PBT(1, names=("lr", "lr"))
    with pytest.raises(TypeError, match="`names` must be a sequence of names"):
        vmapens.pbt.PBT(1, names="lr")


@pytest.mark.parametrize(
    "seeds",
    [np.array([3, 7, 11]), torch.tensor([3, 7, 11]), [np.int64(3), np.int32(7), torch.tensor(11)]],
    ids=["numpy-array", "tensor", "numpy-and-tensor-ints"],
)
def test_ensemble_takes_numpy_and_tensor_seeds(seeds):
    # torch.manual_seed takes numpy and tensor integers; `seeds` refused them.
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 2), 3, seeds=seeds)
    for i, k in enumerate([3, 7, 11]):
        torch.manual_seed(k)
        alone = nn.Linear(3, 2)
        for name, p in alone.named_parameters():
            assert torch.equal(ens[i].state_dict()[name], p.detach())


@pytest.mark.parametrize(
    "seeds", [np.array([1.0, 2.0]), torch.tensor([True, False]), [1, 2.0]], ids=str
)
def test_ensemble_refuses_seeds_that_are_not_integers(seeds):
    with pytest.raises(TypeError, match=r"`seeds(\[\d\])?` must be"):
        vmapens.Ensemble(lambda: nn.Linear(3, 2), 2, seeds=seeds)


if __name__ == "__main__":
    torch.set_default_dtype(torch.float64)
    for arg in sys.argv[1:]:
        lines: list[str] = []
        try:
            run_program(int(arg), log=lines)
        finally:
            print(f"-- seed {arg}\n" + "\n".join(lines))
