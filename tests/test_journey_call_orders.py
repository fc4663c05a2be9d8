"""The order of calls users write, in orders plain PyTorch allows, each against N plain modules.

A CNN with BatchNorm and a small GRU member (tests/models.py) are trained by an ensemble and,
member by member, by plain modules with their own ``torch.optim`` optimizers (and schedulers),
with the same calls in the same order: an optimizer and a scheduler built before a dtype move
(``.double()``, ``.to(torch.float64)``, ``.half()``), a dtype move after steps, a re-init with
``apply`` or ``torch.nn.init`` after steps, state-dict round trips of the optimizer and of the
ensemble between steps, train/eval toggles, sub-ensembles trained and written back, a
parameter frozen after the optimizer was built, batches whose size changes every step, a last
batch of one row with BatchNorm in train mode. Members are built from their seeds
(``seeds=range(N)``; the plain side by ``truth.seeded_members``), never copied out of the
ensemble. The strict xfails document what still differs from plain PyTorch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import models
import pytest
import torch
import torch.nn.functional as F
from parity import assert_refused_changing_nothing
from torch import Tensor, nn
from torch.optim import lr_scheduler as sched
from truth import TOL64, assert_members_equal, seeded_members

import vmapens
from vmapens.optim import MemberValues

N = 3
LRS = [0.01, 0.02, 0.03]
TOL32 = dict(rtol=1e-4, atol=1e-5)  # runs with float32 steps: both sides rounded alike
TOL16 = dict(rtol=4e-3, atol=4e-3)  # float16 steps: a few ulps of values around 1


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    # Small ops: two threads spin on each other's barriers (0.13 s a CNN step against 5 ms).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- the members and their data ----------------------------------------------------------------


@dataclass
class Kind:
    factory: Callable[[], nn.Module]
    loss: Callable[[Tensor, Tensor], Tensor]
    batch: Callable[[torch.Generator, int, torch.dtype], tuple[Tensor, Tensor]]


def _images(g: torch.Generator, b: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return torch.randn(b, 1, 6, 6, generator=g, dtype=dtype), torch.randint(3, (b,), generator=g)


def _sequences(g: torch.Generator, b: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    t = 1 + b % 4  # the sequence length changes with the batch size
    return (torch.randn(b, t, 4, generator=g, dtype=dtype),
            torch.randn(b, 3, generator=g, dtype=dtype))  # fmt: skip


KINDS = {
    "cnn": Kind(models.CNN, F.cross_entropy, _images),
    "gru": Kind(models.Recurrent, F.mse_loss, _sequences),
}


class Pair:
    """An ensemble and its N plain twins, each side with its optimizer and schedulers."""

    def __init__(
        self,
        kind: str,
        make_opt: Callable[[Any], torch.optim.Optimizer],
        make_twin_opt: Callable[[int, nn.Module], torch.optim.Optimizer],
        dtype: torch.dtype = torch.float64,
    ) -> None:
        self.kind = KINDS[kind]
        self.ens = vmapens.Ensemble(self.kind.factory, n=N, seeds=range(N)).to(dtype)
        self.alone = [m.to(dtype) for m in seeded_members(self.kind.factory, N)]
        self.opt = make_opt(self.ens)
        self.opts = [make_twin_opt(i, m) for i, m in enumerate(self.alone)]
        self.step = vmapens.make_step(self.ens, self.kind.loss, self.opt)
        self.scheds: list[Any] = []
        self.twin_scheds: list[list[Any]] = []
        self.g = torch.Generator().manual_seed(0)
        self.dtype = dtype

    def schedule(self, make: Callable[[Any], Any], make_twin: Callable[[int, Any], Any]) -> None:
        self.scheds.append(make(self.opt))
        self.twin_scheds.append([make_twin(i, o) for i, o in enumerate(self.opts)])

    def both(self, on_ens: Callable[[Any], Any], on_member: Callable[[nn.Module], Any]) -> None:
        on_ens(self.ens)
        for m in self.alone:
            on_member(m)

    def move(self, how: str) -> None:
        """A dtype move on both sides; a twin's optimizer that already has state takes it
        through `load_state_dict(state_dict())` (torch's cast; its next step raises without)."""
        dtype = {"double": torch.float64, "to64": torch.float64, "half": torch.float16,
                 "float": torch.float32}[how]  # fmt: skip
        if how == "to64":
            self.both(lambda e: e.to(torch.float64), lambda m: m.to(torch.float64))
        else:
            self.both(lambda e: getattr(e, how)(), lambda m: getattr(m, how)())
        for o in self.opts:
            if o.state:
                o.load_state_dict(o.state_dict())
        self.dtype = dtype

    def data(self, b: int) -> tuple[Tensor, Tensor]:
        return self.kind.batch(self.g, b, self.dtype)

    def train(self, b: int, how: str = "make_step", set_to_none: bool = True) -> None:
        x, y = self.data(b)
        if how == "make_step":
            self.step(x, y)
        else:
            self.opt.zero_grad(set_to_none=set_to_none)
            vmapens.per_member(self.kind.loss)(self.ens(x), y).sum().backward()
            self.opt.step()
        for m, o in zip(self.alone, self.opts, strict=True):
            o.zero_grad(set_to_none=set_to_none)
            self.kind.loss(m(x), y).backward()
            o.step()

    def schedules_step(self, metrics: list[float] | None = None) -> None:
        for s, twins in zip(self.scheds, self.twin_scheds, strict=True):
            if metrics is None:
                s.step()
                for t in twins:
                    t.step()
            else:
                s.step(torch.tensor(metrics, dtype=torch.float64))
                for t, value in zip(twins, metrics, strict=True):
                    t.step(value)

    def assert_same(self, tol: dict | None = None, state: bool = True) -> None:
        assert_members_equal(self.ens, self.alone, **(tol or TOL64))
        if not state:
            return
        for i, (m, o) in enumerate(zip(self.alone, self.opts, strict=True)):
            mine = self.opt.member_state_dict(i, module=m)
            want = o.state_dict()
            assert mine["param_groups"][0]["lr"] == pytest.approx(want["param_groups"][0]["lr"])
            for key, values in want["state"].items():
                for name, value in values.items():
                    got = mine["state"][key][name]
                    if torch.is_tensor(value) and value.dim() > 0:
                        assert got.dtype == value.dtype, (i, key, name)
                    torch.testing.assert_close(
                        torch.as_tensor(got).double(), torch.as_tensor(value).double(),
                        **(tol or TOL64), msg=f"member {i} state {key} {name}",
                    )  # fmt: skip


def adam(**kw: Any) -> tuple[Callable, Callable]:
    return (lambda e: vmapens.StackedAdam(e, lr=LRS, **kw),
            lambda i, m: torch.optim.Adam(m.parameters(), lr=LRS[i], **kw))  # fmt: skip


def sgd(**kw: Any) -> tuple[Callable, Callable]:
    return (lambda e: vmapens.StackedSGD(e, lr=0.01, **kw),
            lambda i, m: torch.optim.SGD(m.parameters(), lr=0.01, **kw))  # fmt: skip


# -- schedulers built before a dtype move -----------------------------------------------------

MAX_LR = [0.05, 0.1, 0.2]
LAMBDAS = [lambda e: 0.9**e, lambda e: 1 / (1 + e), lambda e: 1.0 if e < 2 else 0.1]
SCHEDULES: dict[str, tuple[Callable, Callable, Callable]] = {
    "steplr": (adam(amsgrad=True),
               lambda o: sched.StepLR(o, 2, gamma=0.5),
               lambda i, o: sched.StepLR(o, 2, gamma=0.5)),
    "onecycle": (sgd(momentum=0.9, nesterov=True),
                 lambda o: sched.OneCycleLR(o, max_lr=MemberValues(MAX_LR), total_steps=8),
                 lambda i, o: sched.OneCycleLR(o, max_lr=MAX_LR[i], total_steps=8)),
    "lambdalr": (adam(weight_decay=0.01),  # one lambda per member, as MemberValues
                 lambda o: sched.LambdaLR(o, lambda e: MemberValues([f(e) for f in LAMBDAS])),
                 lambda i, o: sched.LambdaLR(o, LAMBDAS[i])),
    "steplr-sgd": (sgd(momentum=0.9),
                   lambda o: sched.StepLR(o, 2, gamma=0.5),
                   lambda i, o: sched.StepLR(o, 2, gamma=0.5)),
    "plateau": (adam(),  # vmapens's per-member plateau against torch's on each member
                lambda o: vmapens.optim.ReduceLROnPlateau(o, factor=0.5, patience=0),
                lambda i, o: sched.ReduceLROnPlateau(o, factor=0.5, patience=0)),
}  # fmt: skip
METRICS = [[1.0, 1.0, 1.0], [1.0, 2.0, 0.9], [1.0, 1.0, 0.8], [1.0, 2.0, 0.7], [0.5, 1.0, 0.9]]


@pytest.mark.parametrize(
    "kind, schedule, move",
    [("cnn", "steplr", "double"), ("gru", "onecycle", "to64"), ("cnn", "lambdalr", "to64"),
     ("gru", "plateau", "double"), ("cnn", "steplr-sgd", "half")],
)  # fmt: skip
def test_a_scheduler_built_before_a_dtype_move_gives_each_member_its_own_schedule(
    kind: str, schedule: str, move: str
) -> None:
    # opt, scheduler, then the move, then batches of 8, 3, 1, 5, 2 rows: every member's lr,
    # momentum and weights as its own optimizer and scheduler give them alone. (float16 with
    # small steps: with OneCycleLR's 0.2 a weight of member alone moves 0.012 when its conv
    # weight starts 1 ulp away; the ensemble was as far, no further.)
    (make_opt, make_twin_opt), make, make_twin = SCHEDULES[schedule]
    pair = Pair(kind, make_opt, make_twin_opt, torch.float32)
    pair.schedule(make, make_twin)
    pair.move(move)
    for k, b in enumerate((8, 3, 1, 5, 2)):
        pair.train(b)
        pair.schedules_step(METRICS[k] if schedule == "plateau" else None)
    lrs = pair.opt.param_groups[0]["lr"]
    lrs = list(lrs) if isinstance(lrs, MemberValues) else [lrs] * N
    assert lrs == pytest.approx([o.param_groups[0]["lr"] for o in pair.opts], rel=1e-12)
    pair.assert_same(TOL16 if move == "half" else TOL64)


@pytest.mark.parametrize("kind, move", [("cnn", "half"), ("gru", "double"), ("cnn", "to64")])
def test_a_dtype_move_after_steps_with_a_one_cycle_schedule_as_torch_after_its_cast(
    kind: str, move: str
) -> None:
    # float32 steps, then the move mid-schedule. torch's Adam refuses its next step until its
    # state is cast (`opt.load_state_dict(opt.state_dict())`, docs/optim.md); the stack casts.
    # eps=1e-3 keeps float16's Adam off its underflow (docs/semantics.md, fused kernels).
    pair = Pair(kind, *adam(eps=1e-3), dtype=torch.float32)
    pair.schedule(lambda o: sched.OneCycleLR(o, max_lr=0.05, total_steps=10),
                  lambda i, o: sched.OneCycleLR(o, max_lr=0.05, total_steps=10))  # fmt: skip
    for k, b in enumerate((8, 3, 2, 5, 4)):
        if k == 2:
            pair.move(move)
        pair.train(b)
        pair.schedules_step()
    pair.assert_same(TOL16 if move == "half" else TOL32)


@pytest.mark.parametrize("trip", [("half", "float"), ("double", "float")])
def test_a_round_trip_of_dtypes_between_steps_keeps_the_moments_as_torch(trip: tuple) -> None:
    # .half() then .float() with no step between: torch never casts its float32 moments; the
    # stack must not have rounded them to float16 either.
    pair = Pair("gru", *adam(), dtype=torch.float32)
    for k, b in enumerate((4, 6, 3, 5)):
        if k == 2:
            for how in trip:
                pair.both(lambda e, h=how: getattr(e, h)(), lambda m, h=how: getattr(m, h)())
        pair.train(b)
    pair.assert_same(TOL32)


@pytest.mark.parametrize("first", [True, False], ids=["first-step", "later-step"])
def test_backward_then_double_then_step_as_alone(first: bool) -> None:
    # loss.backward() in float32, then .double() (gradients converted too), then opt.step().
    pair = Pair("cnn", *adam(), dtype=torch.float32)
    if not first:
        pair.train(5)
    x, y = pair.data(4)
    pair.opt.zero_grad()
    vmapens.per_member(F.cross_entropy)(pair.ens(x), y).sum().backward()
    for m, o in zip(pair.alone, pair.opts, strict=True):
        o.zero_grad()
        F.cross_entropy(m(x), y).backward()
    pair.move("double")
    assert pair.ens.get_parameter("conv.weight").grad.dtype == torch.float64
    pair.opt.step()
    for o in pair.opts:
        o.step()
    pair.train(3)
    pair.assert_same(TOL32)


def test_an_optimizer_state_dict_saved_before_a_move_loads_after_it_as_torchs() -> None:
    pair = Pair("cnn", *adam(), dtype=torch.float32)
    for b in (4, 5):
        pair.train(b)
    saved = copy.deepcopy(pair.opt.state_dict())
    twins_saved = [copy.deepcopy(o.state_dict()) for o in pair.opts]
    pair.both(lambda e: e.double(), lambda m: m.double())
    pair.dtype = torch.float64
    pair.opt.load_state_dict(saved)  # float32 moments into float64 parameters: cast, as torch
    for o, s in zip(pair.opts, twins_saved, strict=True):
        o.load_state_dict(s)
    assert pair.opt.state[pair.ens.get_parameter("head.weight")]["exp_avg"].dtype == torch.float64
    for b in (3, 1):
        pair.train(b)
    pair.assert_same(TOL32)


# -- re-initialisation after the optimizer and steps ------------------------------------------


def _kaiming(m: nn.Module) -> None:
    if isinstance(m, (nn.Conv2d, nn.Linear)):
        nn.init.kaiming_normal_(m.weight)


def _reset(m: nn.Module) -> None:
    if hasattr(m, "reset_parameters"):
        m.reset_parameters()  # BatchNorm's running statistics too; the GRU's own draws


def _elementwise_on_stacked(e: vmapens.Ensemble) -> None:
    # torch.nn.init on the stacked tensors: fine where it is elementwise (no fans, no draws)
    nn.init.zeros_(e.get_parameter("head.bias"))
    nn.init.constant_(e.get_parameter("head.weight"), 0.05)


def _elementwise_alone(m: nn.Module) -> None:
    nn.init.zeros_(m.head.bias)
    nn.init.constant_(m.head.weight, 0.05)


REINITS = {
    "apply-kaiming": (lambda e: e.apply(_kaiming), lambda m: m.apply(_kaiming)),
    "apply-reset": (lambda e: e.apply(_reset), lambda m: m.apply(_reset)),
    "init-on-stacked": (_elementwise_on_stacked, _elementwise_alone),
}


@pytest.mark.parametrize(
    "kind, reinit",
    [("cnn", "apply-kaiming"), ("cnn", "apply-reset"), ("gru", "apply-reset"),
     ("gru", "init-on-stacked")],
)  # fmt: skip
def test_a_reinit_after_steps_keeps_adams_moments_as_torch_keeps_them(
    kind: str, reinit: str
) -> None:
    # Alone, a re-init leaves Adam's moments and step counts where they were: the next step
    # goes on from them (bias correction of step 3, not 1), as in the ensemble.
    pair = Pair(kind, *adam(weight_decay=0.01))
    on_ens, on_member = REINITS[reinit]
    for k, b in enumerate((5, 3, 4, 2)):
        if k == 2:
            torch.manual_seed(5)  # both sides draw member after member from the global RNG
            on_ens(pair.ens)
            torch.manual_seed(5)
            for m in pair.alone:
                on_member(m)
        pair.train(b, how="manual")
    pair.assert_same()


def test_an_apply_that_raises_midway_changes_nothing_and_training_goes_on() -> None:
    pair = Pair("cnn", *adam())
    pair.train(4)
    before = {k: v.clone() for k, v in pair.ens.stacked_state().items()}
    calls: list[int] = []

    def fails_in_member_1(m: nn.Module) -> None:
        if isinstance(m, nn.Conv2d):
            calls.append(1)
            nn.init.normal_(m.weight)
            if len(calls) == 2:
                raise RuntimeError("boom in member 1")

    with pytest.raises(RuntimeError, match="boom in member 1"):
        pair.ens.apply(fails_in_member_1)
    for k, v in pair.ens.stacked_state().items():
        assert torch.equal(v, before[k]), k
    pair.train(3)
    pair.assert_same()


def _fresh_bias(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        m.bias = nn.Parameter(torch.zeros_like(m.bias))  # a new Parameter object


@pytest.mark.parametrize("how", ["manual", "make_step"])
def test_apply_assigning_a_new_parameter_after_the_optimizer_is_as_alone(how: str) -> None:
    # Alone the new Parameter is in no optimizer: it never moves; the optimizer holds the old
    # object, which no gradient reaches any more. The ensemble gets a new stacked Parameter.
    pair = Pair("cnn", *adam())
    pair.train(4, how=how)
    old = pair.ens.stacked_params()["head.bias"]
    kept = old.detach().clone()
    pair.both(lambda e: e.apply(_fresh_bias), lambda m: m.apply(_fresh_bias))
    assert pair.ens.stacked_params()["head.bias"] is not old
    for b in (3, 5):
        pair.train(b, how=how)
    assert all(torch.equal(m.head.bias, torch.zeros(3, dtype=torch.float64)) for m in pair.alone)
    assert_members_equal(pair.ens, pair.alone)
    assert torch.equal(old.detach(), kept)  # as alone: no gradient reaches it, Adam skips it


def test_an_optimizer_made_after_apply_trains_the_new_parameter_as_alone() -> None:
    pair = Pair("cnn", *adam())
    pair.train(4)
    pair.both(lambda e: e.apply(_fresh_bias), lambda m: m.apply(_fresh_bias))
    pair.opt = vmapens.StackedAdam(pair.ens, lr=LRS)
    pair.opts = [torch.optim.Adam(m.parameters(), lr=LRS[i]) for i, m in enumerate(pair.alone)]
    pair.step = vmapens.make_step(pair.ens, pair.kind.loss, pair.opt)
    for b in (3, 5):
        pair.train(b)
    assert not any(
        torch.equal(m.head.bias, torch.zeros(3, dtype=torch.float64)) for m in pair.alone
    )
    pair.assert_same()


def test_apply_removing_a_parameter_is_refused_changing_nothing() -> None:
    # It raised a bare KeyError('head.bias') after the members' apply had run.
    ens = vmapens.Ensemble(models.CNN, n=N, seeds=range(N))
    before = {k: (t, t.detach().clone()) for k, t in ens.stacked_state().items()}

    def no_bias(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            m.bias = None

    with pytest.raises(ValueError, match=r"`fn` removed `head.bias` \(set it to None"):
        ens.apply(no_bias)
    for k, t in ens.stacked_state().items():
        assert t is before[k][0] and torch.equal(t, before[k][1]), k


def test_apply_replacing_a_parameter_in_one_member_only_is_refused_changing_nothing() -> None:
    ens = vmapens.Ensemble(models.CNN, n=N, seeds=range(N))
    before = {k: (t, t.detach().clone()) for k, t in ens.stacked_state().items()}
    replaced: list[nn.Module] = []

    def first_member_only(m: nn.Module) -> None:
        if isinstance(m, nn.Linear) and not replaced:
            replaced.append(m)
            _fresh_bias(m)

    with pytest.raises(ValueError, match=r"replaced `head.bias` with a new Parameter in member 0 "
                       "but not in every member"):  # fmt: skip
        ens.apply(first_member_only)
    for k, t in ens.stacked_state().items():
        assert t is before[k][0] and torch.equal(t, before[k][1]), k


# -- state-dict round trips and modes between steps -------------------------------------------


@pytest.mark.parametrize("kind", ["cnn", "gru"])
@pytest.mark.parametrize("how", ["make_step", "manual"])
def test_round_trips_and_mode_toggles_between_steps_as_alone(kind: str, how: str) -> None:
    pair = Pair(kind, *adam(amsgrad=True))
    pair.schedule(lambda o: sched.StepLR(o, 2, gamma=0.5), lambda i, o: sched.StepLR(o, 2, 0.5))
    snapshot: list[Any] = []
    for k, b in enumerate((8, 3, 1, 5, 4, 6, 2)):
        if k == 2:  # the optimizer's own state dict back into it, mid-run
            pair.opt.load_state_dict(pair.opt.state_dict())
            for o in pair.opts:
                o.load_state_dict(o.state_dict())
            snapshot = [copy.deepcopy(pair.ens.state_dict())]
            snapshot += [copy.deepcopy(m.state_dict()) for m in pair.alone]
        if k == 3:
            pair.both(lambda e: e.eval(), lambda m: m.eval())
        if k == 4:  # an older snapshot of the weights; the optimizer keeps its moments
            pair.ens.load_state_dict(snapshot[0])
            for m, sd in zip(pair.alone, snapshot[1:], strict=True):
                m.load_state_dict(sd)
            pair.both(lambda e: e.train(), lambda m: m.train())
        if k == 5 and kind == "cnn":  # torch's cumulative average from here on
            pair.both(lambda e: setattr(e.template.bn, "momentum", None),
                      lambda m: setattr(m.bn, "momentum", None))  # fmt: skip
        pair.train(b, how=how)
        pair.schedules_step()
    pair.assert_same()


def test_a_batchnorm_frozen_by_its_own_eval_then_a_dtype_move_as_alone() -> None:
    pair = Pair("cnn", *sgd(momentum=0.9), dtype=torch.float32)
    for k, b in enumerate((4, 6, 1, 3, 5)):
        if k == 1:
            pair.both(lambda e: e.template.bn.eval(), lambda m: m.bn.eval())
        if k == 2:
            pair.move("double")
        if k == 3:
            pair.both(lambda e: e.train(), lambda m: m.train())
        pair.train(b)
    assert pair.ens.template.bn.training
    pair.assert_same(TOL32)


# -- sub-ensembles trained, then written back -------------------------------------------------


@pytest.mark.parametrize(
    "kind, index",
    [("cnn", torch.tensor([2, 0])), ("gru", [1, 2]), ("cnn", slice(0, 2))],
    ids=["cnn-tensor", "gru-list", "cnn-slice"],
)
def test_a_sub_ensemble_cut_after_a_move_trains_and_writes_back_as_alone(
    kind: str, index: Any
) -> None:
    pair = Pair(kind, *adam(), dtype=torch.float32)
    pair.schedule(lambda o: sched.StepLR(o, 2, gamma=0.5), lambda i, o: sched.StepLR(o, 2, 0.5))
    for b in (5, 3):
        pair.train(b)
        pair.schedules_step()
    pair.move("double")  # the stack's moments are still float32 here: cut before its next step
    rows = list(range(N))[index] if isinstance(index, slice) else torch.as_tensor(index).tolist()
    sub = pair.ens[index]
    sub_opt = pair.opt.select(index, sub)
    sub_sched = sched.StepLR(sub_opt, 2, gamma=0.5)
    sub_sched.load_state_dict(pair.scheds[0].state_dict())
    twins = [pair.alone[r] for r in rows]  # the plain members go on, alone
    twin_opts = [pair.opts[r] for r in rows]
    twin_scheds = [pair.twin_scheds[0][r] for r in rows]
    for b in (4, 1, 6):
        x, y = pair.data(b)
        sub_opt.zero_grad()
        vmapens.per_member(pair.kind.loss)(sub(x), y).sum().backward()
        sub_opt.step()
        sub_sched.step()
        for m, o, s in zip(twins, twin_opts, twin_scheds, strict=True):
            o.zero_grad()
            pair.kind.loss(m(x), y).backward()
            o.step()
            s.step()
    assert_members_equal(sub, twins, **TOL32)
    # Written back: values (docs/semantics.md's recipe), the moments' rows and the lr.
    with torch.no_grad():
        sd = pair.ens.state_dict()
        for k, v in sub.state_dict().items():
            sd[k][rows] = v
        for p, q in zip(pair.opt.param_groups[0]["params"], sub_opt.param_groups[0]["params"],
                        strict=True):  # fmt: skip
            for name, value in sub_opt.state[q].items():
                pair.opt.state[p][name][rows] = value.to(pair.opt.state[p][name].dtype)
    lrs = list(pair.opt.param_groups[0]["lr"])
    for j, r in enumerate(rows):
        lrs[r] = sub_opt.param_groups[0]["lr"][j]
    pair.opt.param_groups[0]["lr"] = MemberValues(lrs)
    for b in (3, 5):
        pair.train(b, how="manual")
    pair.assert_same(TOL32)


# -- freezing after the optimizer was built ---------------------------------------------------


@pytest.mark.parametrize(
    "kind, name, how",
    [("cnn", "conv.weight", "make_step"), ("cnn", "bn.weight", "zeros"),
     ("gru", "gru.weight_hh_l0", "make_step"), ("gru", "gru.weight_hh_l0", "zeros"),
     ("cnn", "conv.weight", "before-step")],
)  # fmt: skip
def test_a_parameter_frozen_after_the_optimizer_and_steps_as_alone(
    kind: str, name: str, how: str
) -> None:
    # "zeros": zero_grad(set_to_none=False): the frozen parameter keeps a zero gradient, which
    # torch.optim.Adam still steps (its moments decay and move it). "before-step": frozen
    # between backward and step: its gradient is there and torch steps it this once.
    pair = Pair(kind, *adam(weight_decay=0.01))
    for k, b in enumerate((8, 3, 2, 5, 4)):
        if how == "before-step" and k == 2:
            x, y = pair.data(b)
            pair.opt.zero_grad()
            vmapens.per_member(pair.kind.loss)(pair.ens(x), y).sum().backward()
            for m, o in zip(pair.alone, pair.opts, strict=True):
                o.zero_grad()
                pair.kind.loss(m(x), y).backward()
            pair.both(lambda e: e.get_parameter(name).requires_grad_(False),
                      lambda m: m.get_parameter(name).requires_grad_(False))  # fmt: skip
            pair.opt.step()
            for o in pair.opts:
                o.step()
            continue
        if k == 2:
            pair.both(lambda e: e.get_parameter(name).requires_grad_(False),
                      lambda m: m.get_parameter(name).requires_grad_(False))  # fmt: skip
        if how == "zeros":
            pair.train(b, how="manual", set_to_none=False)
        else:
            pair.train(b, how="make_step" if how == "make_step" else "manual")
    pair.assert_same()
    steps = pair.opt.state[pair.ens.get_parameter(name)]["step"].tolist()
    assert steps == [float(o.state[m.get_parameter(name)]["step"])
                     for m, o in zip(pair.alone, pair.opts, strict=True)]  # fmt: skip


# -- batch sizes that change, a last batch of one row -----------------------------------------


@pytest.mark.parametrize("kind", ["cnn", "gru"])
def test_gradients_accumulated_over_batches_of_other_sizes_before_one_step(kind: str) -> None:
    # Two forwards (other batch sizes, other sequence lengths) before one backward: buffers
    # the first forward saved must survive the second.
    pair = Pair(kind, *adam())
    for sizes in ((4, 3), (2, 7, 1)):
        batches = [pair.data(b) for b in sizes]
        pair.opt.zero_grad()
        total = sum(vmapens.per_member(pair.kind.loss)(pair.ens(x), y).sum() for x, y in batches)
        total.backward()
        pair.opt.step()
        for m, o in zip(pair.alone, pair.opts, strict=True):
            o.zero_grad()
            sum(pair.kind.loss(m(x), y) for x, y in batches).backward()
            o.step()
    pair.assert_same()


def _bn_mlp() -> nn.Module:
    return models.TanhBN(d_out=2)


@pytest.mark.parametrize("how", ["make_step", "manual"])
def test_a_last_batch_of_one_row_in_train_mode_is_refused_and_changes_nothing(how: str) -> None:
    ens = vmapens.Ensemble(_bn_mlp, n=N, seeds=range(N)).double()
    alone = [m.double() for m in seeded_members(_bn_mlp, N)]
    opt = vmapens.StackedAdam(ens, lr=LRS)
    opts = [torch.optim.Adam(m.parameters(), lr=LRS[i]) for i, m in enumerate(alone)]
    step = vmapens.make_step(ens, F.mse_loss, opt)
    g = torch.Generator().manual_seed(0)

    def batch(b: int) -> tuple[Tensor, Tensor]:
        return (torch.randn(b, 3, generator=g, dtype=torch.float64),
                torch.randn(b, 2, generator=g, dtype=torch.float64))  # fmt: skip

    def train(x: Tensor, y: Tensor) -> None:
        if how == "make_step":
            step(x, y)
        else:
            opt.zero_grad()
            vmapens.per_member(F.mse_loss)(ens(x), y).sum().backward()
            opt.step()
        for m, o in zip(alone, opts, strict=True):
            o.zero_grad()
            F.mse_loss(m(x), y).backward()
            o.step()

    for b in (8, 3):
        train(*batch(b))
    x1, y1 = batch(1)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel") as said:
        copy.deepcopy(alone[0])(x1)
    if how == "manual":
        opt.zero_grad()  # what the loop does before its forward
    before = [t.clone() for t in ens.stacked_state().values()]
    moments = [t.clone() for s in opt.state.values() for t in s.values()]
    grads = [p.grad for p in ens.parameters()]
    rng = torch.get_rng_state()
    with pytest.raises(ValueError, match="Expected more than 1 value per channel") as got:
        step(x1, y1) if how == "make_step" else ens(x1)
    assert str(got.value) == str(said.value)
    assert all(torch.equal(a, b) for a, b in zip(before, ens.stacked_state().values()))
    assert all(torch.equal(a, b) for a, b in
               zip(moments, [t for s in opt.state.values() for t in s.values()]))  # fmt: skip
    assert all(a is b for a, b in zip(grads, [p.grad for p in ens.parameters()]))
    assert torch.equal(rng, torch.get_rng_state())
    # The run goes on as the plain members that skipped that batch. (torch's own BatchNorm
    # counts the refused batch in num_batches_tracked before it raises; the ensemble
    # changes nothing, as docs/semantics.md says.)
    for b in (5, 2):
        train(*batch(b))
    with torch.no_grad():  # one row in eval mode runs, on both sides
        ens.eval()
        out = ens(x1)
        for i, m in enumerate(alone):
            torch.testing.assert_close(out[i], m.eval()(x1), **TOL64)
    assert_members_equal(ens, alone)


# -- refusals of a step with a plain torch optimizer ------------------------------------------


def test_a_refused_step_keeps_a_torch_optimizers_param_groups() -> None:
    ens = vmapens.Ensemble(_bn_mlp, n=N, seeds=range(N)).double()
    alone = [m.double() for m in seeded_members(_bn_mlp, N)]
    opt = torch.optim.SGD(ens.parameters(), lr=0.1)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in alone]
    step = vmapens.make_step(ens, F.mse_loss, opt)
    held, twin_held = opt.param_groups[0], [o.param_groups[0] for o in opts]
    g = torch.Generator().manual_seed(0)
    for b in (8, 1, 8, 8):
        x = torch.randn(b, 3, generator=g, dtype=torch.float64)
        y = torch.randn(b, 2, generator=g, dtype=torch.float64)
        if b == 1:  # refused on both sides: a BatchNorm batch of one row in train mode
            with pytest.raises(ValueError, match="Expected more than 1 value"):
                step(x, y)
        else:
            step(x, y)
            for m, o in zip(alone, opts, strict=True):
                o.zero_grad()
                F.mse_loss(m(x), y).backward()
                o.step()
        held["lr"] *= 0.5  # the user's own decay, through the group it holds
        for group in twin_held:
            group["lr"] *= 0.5
    assert opt.param_groups[0]["lr"] == opts[0].param_groups[0]["lr"]
    assert_members_equal(ens, alone, rtol=1e-9, atol=1e-10)


def test_a_refused_step_after_double_leaves_a_torch_optimizers_state_as_it_was() -> None:
    ens = vmapens.Ensemble(models.CNN, n=N, seeds=range(N))
    opt = torch.optim.Adam(ens.parameters(), lr=0.01)
    step = vmapens.make_step(ens, F.cross_entropy, opt)
    g = torch.Generator().manual_seed(0)
    for b in (4, 3):
        step(*_images(g, b, torch.float32))
    ens.double()
    dtypes = [v.dtype for s in opt.state.values() for v in s.values()]
    for _ in range(2):  # refused, and refused again, as torch's Adam alone
        with pytest.raises(RuntimeError, match="expected dtype float"):
            step(*_images(g, 4, torch.float64))
        assert [v.dtype for s in opt.state.values() for v in s.values()] == dtypes


@pytest.mark.parametrize("first", [True, False], ids=["first-step", "later-step"])
def test_an_out_of_range_class_target_is_refused_as_torch_refuses_it(first: bool) -> None:
    # Under vmap the error spoke of the batched tensors ("index 7 is out of bounds for
    # dimension 2 with size 3"), a RuntimeError where F.cross_entropy alone raises IndexError.
    ens = vmapens.Ensemble(models.CNN, n=N, seeds=range(N))
    opt = vmapens.StackedAdam(ens, lr=0.01)
    step = vmapens.make_step(ens, F.cross_entropy, opt)
    g = torch.Generator().manual_seed(0)
    if not first:  # the first call's self-check is done: the step's own failure path
        step(*_images(g, 4, torch.float32))
    x, y = torch.randn(4, 1, 6, 6, generator=g), torch.tensor([0, 1, 7, 2])
    with pytest.raises(IndexError) as alone:
        F.cross_entropy(seeded_members(models.CNN, 1)[0](x), y)
    assert_refused_changing_nothing(step, (x, y), ens, opt, IndexError, "Target 7 is out of bounds")
    with pytest.raises(IndexError) as got:
        step(x, y)
    assert str(got.value).startswith("step: member 0 run alone raises this too, in `loss_fn`")
    assert str(alone.value) in str(got.value)
