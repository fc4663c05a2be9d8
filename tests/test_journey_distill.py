"""Journey: distilling a deep ensemble, every member checked against the naive loop.

A researcher trains a deep ensemble (4 members, float64, an MLP with BatchNorm and Dropout)
with `make_step(randomness="same")`, then (1) distils it into one plain student on the
ensemble's averaged, temperature-scaled soft targets (`vmapens.predict(..., reduce="mean",
softmax=True)` and `predict`'s logits), and into a student *ensemble* whose loss module holds
the frozen teacher ensemble (`requires_grad_(False)`, `eval()`: no loss-parameter warning,
docs/semantics.md "Inputs and outputs"), or whose members each carry their own frozen teacher
member as a submodule (eval, or train mode with its dropout and BatchNorm on); (2) trains a
mean teacher per member in a hand-written loop, the EMA kept in a second ensemble and moved
with `torch._foreach_lerp_` on the stacked tensors (truth: `AveragedModel` with
`get_ema_multi_avg_fn` and `lerp_` per plain module), with a consistency loss between the
student and the teacher under their own dropout masks; (3) born-again: a new run of member i
distilled from member i's old predictions with `fit(in_dims=0)`; (4) `predict`'s "vote",
"entropy" and "variance" as targets and sample weights.

The truth is N plain modules trained alone with torch.optim on the same batches. Dropout is
bit-for-bit under `randomness="same"`: docs/semantics.md, "Randomness in the forward pass",
says each member then draws what it draws alone from the same RNG state, so member i alone
starts every step from the RNG state the ensemble's step started from.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from truth import TOL64, assert_members_equal, batch_plan, entropy, seeded_members

import vmapens

N = 4
T = 2.0  # distillation temperature

pytestmark = [
    # torch's own notice: vmap has no batching rule for aten::kl_div (it loops, exactly)
    pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),
]


def net() -> nn.Module:
    return nn.Sequential(
        # no bias before BatchNorm: it cancels its gradient, round-off Adam would amplify
        nn.Linear(4, 8, bias=False),
        nn.BatchNorm1d(8),
        nn.ReLU(),
        nn.Dropout(0.3),
        nn.Linear(8, 3),
    ).double()


def _data(rows: int = 16, seed: int = 0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 4, generator=g, dtype=torch.float64)
    return x, (x[:, :2].sum(1) > 0).long() + (x[:, 2] > 0.5).long()


def _step_alone(models, opts, loss_of) -> None:
    """One step of each plain module alone, each from the RNG state the step started from
    (what `randomness="same"` promises); the RNG then goes on as after one member's step."""
    start = torch.get_rng_state()
    for i, (m, opt) in enumerate(zip(models, opts, strict=True)):
        torch.set_rng_state(start)
        opt.zero_grad()
        loss_of(i, m).backward()
        opt.step()


_TRAINED: list = []


def _teachers():
    """The deep ensemble and its naive-loop twins, trained alike with dropout on (3 steps of
    Adam on one batch); trained once per session, each test gets its own copies."""
    if not _TRAINED:
        x, y = _data()
        ens = vmapens.Ensemble(net, N, seeds=range(N), randomness="same")
        alone = seeded_members(net, N)
        step = vmapens.make_step(ens, nn.CrossEntropyLoss(), vmapens.StackedAdam(ens, lr=1e-2))
        opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in alone]
        for _ in range(3):
            state = torch.get_rng_state()
            step(x, y)
            torch.set_rng_state(state)
            _step_alone(alone, opts, lambda i, m: F.cross_entropy(m(x), y))
        assert_members_equal(ens, alone)
        _TRAINED[:] = [ens, alone]
    return copy.deepcopy(_TRAINED[0]), copy.deepcopy(_TRAINED[1])


def _kd(student_logits: Tensor, teacher_probs: Tensor) -> Tensor:
    log_p = F.log_softmax(student_logits / T, dim=-1)
    return F.kl_div(log_p, teacher_probs, reduction="batchmean") * T * T


# ---------------------------------------------------------------- (1) distillation


def test_soft_targets_from_predict_distil_a_plain_student_as_from_the_members_alone() -> None:
    ens, alone = _teachers()
    x, _ = _data(24, seed=1)
    for m in alone:
        m.eval()
    with torch.no_grad():
        lone_mean = torch.stack([F.softmax(m(x), -1) for m in alone]).mean(0)
        lone_soft = torch.stack([F.softmax(m(x) / T, -1) for m in alone]).mean(0)
    mean = vmapens.predict(ens, x, reduce="mean", softmax=True)
    torch.testing.assert_close(mean, lone_mean, **TOL64)
    soft = F.softmax(vmapens.predict(ens, x) / T, -1).mean(0)  # temperature-scaled logits
    torch.testing.assert_close(soft, lone_soft, **TOL64)
    assert ens.training and all(m.training for m in ens[0].modules())  # predict restores

    # the single student, plain PyTorch, trained on either target: the same student
    students = []
    for target in (soft, lone_soft):
        torch.manual_seed(11)
        s = net()
        opt = torch.optim.SGD(s.parameters(), lr=0.5, momentum=0.9)
        torch.manual_seed(12)  # the same dropout masks for both
        for _ in range(3):
            opt.zero_grad()
            _kd(s(x), target).backward()
            opt.step()
        students.append(s.state_dict())
    for key, want in students[1].items():
        torch.testing.assert_close(students[0][key], want, **TOL64)


class EnsembleKD(nn.Module):
    """The loss a user writes for one student: KD against a frozen teacher's mean."""

    def __init__(self, teacher: nn.Module, members: list[nn.Module] | None = None) -> None:
        super().__init__()
        self.teacher = teacher  # an Ensemble, or (alone) a ModuleList of the plain teachers
        self.members = members

    def forward(self, out: Tensor, x: Tensor) -> Tensor:
        with torch.no_grad():
            if isinstance(self.teacher, nn.ModuleList):
                target = torch.stack([F.softmax(t(x) / T, -1) for t in self.teacher]).mean(0)
            else:
                target = F.softmax(self.teacher(x) / T, -1).mean(0)
        return _kd(out, target)


def test_a_student_ensemble_with_the_frozen_teacher_ensemble_in_its_loss() -> None:
    teacher, alone_teachers = _teachers()
    student = vmapens.Ensemble(net, N, seed=7, randomness="same")
    with pytest.warns(
        UserWarning, match=r"make_step: `loss_fn` \(EnsembleKD\).*teacher\.0\.weight"
    ):
        vmapens.make_step(student, EnsembleKD(teacher), vmapens.StackedSGD(student, lr=0.5))
    teacher.eval().requires_grad_(False)  # the way out the warning names
    for m in alone_teachers:
        m.eval().requires_grad_(False)
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    x, _ = _data(24, seed=1)
    alone = [copy.deepcopy(student[i]) for i in range(N)]
    loss = EnsembleKD(teacher)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a frozen teacher is no trainable loss parameter
        warnings.filterwarnings("ignore", "There is a performance drop")
        step = vmapens.make_step(student, loss, vmapens.StackedSGD(student, lr=0.5, momentum=0.9))
        lone_loss = EnsembleKD(nn.ModuleList(alone_teachers))
        opts = [torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9) for m in alone]
        for _ in range(3):
            state = torch.get_rng_state()
            step(x, x)
            torch.set_rng_state(state)
            _step_alone(alone, opts, lambda i, m: lone_loss(m(x), x))
    assert_members_equal(student, alone)
    for k, v in teacher.state_dict().items():  # eval: the teacher's statistics stay
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    assert all(p.grad is None for p in teacher.parameters())


class Pair(nn.Module):
    """One student and its own teacher member, frozen: `forward` returns both logits."""

    def __init__(self, student: nn.Module, teacher: nn.Module) -> None:
        super().__init__()
        self.student, self.teacher = student, teacher.requires_grad_(False)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        with torch.no_grad():
            t = self.teacher(x)
        return self.student(x), t


def _pair_kd(out: tuple[Tensor, Tensor], y: Tensor) -> Tensor:
    s, t = out
    return _kd(s, F.softmax(t / T, -1)) + 0.5 * F.cross_entropy(s, y)


@pytest.mark.parametrize("teacher_mode", ["eval", "train"])
def test_each_student_member_with_its_own_frozen_teacher_member(teacher_mode: str) -> None:
    teacher, _ = _teachers()
    x, y = _data(24, seed=1)
    torch.manual_seed(7)
    pairs = []
    for i in range(N):
        p = Pair(net(), teacher[i])  # the trained teacher member, as a plain module
        if teacher_mode == "eval":
            p.teacher.eval()  # its dropout off, its BatchNorm on running statistics
        pairs.append(p)
    alone = copy.deepcopy(pairs)
    ens = vmapens.Ensemble.from_modules(pairs, randomness="same")
    assert ens.training and ens[0].teacher.training == (teacher_mode == "train")
    step = vmapens.make_step(ens, _pair_kd, vmapens.StackedAdam(ens, lr=1e-2))
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in alone]
    for _ in range(3):
        state = torch.get_rng_state()
        step(x, y)
        torch.set_rng_state(state)
        _step_alone(alone, opts, lambda i, m: _pair_kd(m(x), y))
    assert_members_equal(ens, alone)
    stats = ens.get_buffer("teacher.1.running_mean")
    moved = not torch.equal(stats, teacher.get_buffer("1.running_mean"))
    assert moved == (teacher_mode == "train")  # train mode: the teacher's statistics move
    assert ens.get_parameter("teacher.0.weight").grad is None


# ---------------------------------------------------------------- (2) mean teacher

DECAY = 0.9
L = 8  # labelled rows first in each batch, the rest unlabelled


def _mean_teacher_loss(s_out: Tensor, t_out: Tensor, y: Tensor) -> Tensor:
    """One member: cross-entropy on the labelled rows plus the consistency between the
    student's and the teacher's class probabilities (each under its own dropout mask) on the
    unlabelled ones."""
    cons = (F.softmax(s_out[L:], -1) - F.softmax(t_out, -1)) ** 2
    return F.cross_entropy(s_out[:L], y) + 2.0 * cons.mean()


@pytest.mark.parametrize("how", ["foreach_lerp", "averaged_model"])
def test_mean_teacher_with_an_ema_per_member_in_a_hand_written_loop(how: str) -> None:
    x, y = _data(20, seed=2)
    y = y[:L]
    student = vmapens.Ensemble(net, N, seeds=range(N), randomness="same")
    alone = seeded_members(net, N)
    if how == "foreach_lerp":  # a second ensemble holds the EMA, moved in one fused call
        ema = copy.deepcopy(student).requires_grad_(False)
        lone_ema = [copy.deepcopy(m).requires_grad_(False) for m in alone]
    else:  # torch's own EMA, as for one model
        ema = AveragedModel(student, multi_avg_fn=get_ema_multi_avg_fn(DECAY))
        lone_ema = [AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(DECAY)) for m in alone]
    opt = vmapens.StackedAdam(student, lr=1e-2)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in alone]
    for _ in range(4):
        state = torch.get_rng_state()
        s_out = student(x)
        with torch.no_grad():
            t_out = ema(x[L:])  # train mode: the teacher's own dropout mask and statistics
        opt.zero_grad()
        vmapens.per_member(_mean_teacher_loss, in_dims=(0, 0, None))(
            s_out, t_out, y
        ).sum().backward()
        opt.step()
        with torch.no_grad():
            if how == "foreach_lerp":
                torch._foreach_lerp_(list(ema.parameters()), list(student.parameters()), 1 - DECAY)
            else:
                ema.update_parameters(student)
        after = torch.get_rng_state()
        for m, t, o in zip(alone, lone_ema, opts, strict=True):
            torch.set_rng_state(state)
            out = m(x)
            with torch.no_grad():
                t_i = t(x[L:])
            o.zero_grad()
            _mean_teacher_loss(out, t_i, y).backward()
            o.step()
            with torch.no_grad():
                if how == "foreach_lerp":
                    for pt, p in zip(t.parameters(), m.parameters(), strict=True):
                        pt.lerp_(p, 1 - DECAY)
                else:
                    t.update_parameters(m)
        assert torch.equal(torch.get_rng_state(), after)
    assert_members_equal(student, alone)
    if how == "foreach_lerp":
        assert_members_equal(ema, lone_ema)
    else:
        assert_members_equal(ema.module, [t.module for t in lone_ema])
        assert ema.n_averaged.item() == 4


# ---------------------------------------------------------------- (3) born-again


def test_born_again_each_member_distilled_from_its_own_old_predictions_with_fit() -> None:
    old, lone_old = _teachers()
    x, y = _data(20, seed=3)
    probs = F.softmax(vmapens.predict(old, x) / T, -1)  # [n, rows, classes]: member i's own
    for m in lone_old:
        m.eval()
    with torch.no_grad():
        lone_probs = [F.softmax(m(x) / T, -1) for m in lone_old]
    torch.testing.assert_close(probs, torch.stack(lone_probs), **TOL64)

    def born_again(out: Tensor, target: Tensor) -> Tensor:
        return _kd(out, target[:, :3]) + F.cross_entropy(out, target[:, 3].long())

    packed = torch.cat([probs, y.double().expand(N, -1)[..., None]], -1)  # [n, rows, 4]
    new = vmapens.Ensemble(net, N, seeds=range(10, 10 + N), randomness="same")
    alone = [copy.deepcopy(new[i]) for i in range(N)]
    state = torch.get_rng_state()  # fit draws the dropout masks from it, step by step
    history = vmapens.fit(new, (x.expand(N, *x.shape), packed), born_again, in_dims=0,
                          epochs=2, batch_size=8, lr=1e-2, seed=5, progress=False)  # fmt: skip
    assert history.train_loss.shape == (2, N)
    torch.set_rng_state(state)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in alone]
    for rows in batch_plan(20, 8, 6, seed=5):  # 3 batches a pass, 2 passes
        _step_alone(alone, opts, lambda i, m, rows=rows: born_again(m(x[rows]), packed[i, rows]))
    assert_members_equal(new, alone)


# ---------------------------------------------------------------- (4) reductions as targets


def test_vote_entropy_and_variance_of_the_teacher_as_targets_and_weights() -> None:
    teacher, lone = _teachers()
    x, _ = _data(24, seed=4)
    votes = vmapens.predict(teacher, x, reduce="vote")
    ent = vmapens.predict(teacher, x, reduce="entropy", softmax=True)
    var = vmapens.predict(teacher, x, reduce="variance", softmax=True)
    for m in lone:
        m.eval()
    with torch.no_grad():
        p = torch.stack([F.softmax(m(x), -1) for m in lone])
        logits = torch.stack([m(x) for m in lone])
    hard = F.one_hot(logits.argmax(-1), 3).sum(0).argmax(-1)  # ties: lowest class
    torch.testing.assert_close(votes, hard, rtol=0, atol=0)
    torch.testing.assert_close(ent, entropy(p.mean(0)), **TOL64)
    torch.testing.assert_close(var, p.var(0, unbiased=False), **TOL64)

    # hard labels from the vote, each sample weighted by the teacher's confidence
    weight = 1 - ent / torch.log(torch.tensor(3.0, dtype=torch.float64))
    target = torch.cat([votes.double()[:, None], weight[:, None], var], -1)

    def weighted(out: Tensor, t: Tensor) -> Tensor:
        ce = F.cross_entropy(out, t[:, 0].long(), reduction="none")
        return (t[:, 1] * ce).mean() + (F.softmax(out, -1).var(-1) - t[:, 2:].sum(-1)).abs().mean()

    student = vmapens.Ensemble(net, N, seed=9, randomness="same")
    alone = [copy.deepcopy(student[i]) for i in range(N)]
    step = vmapens.make_step(student, weighted, vmapens.StackedSGD(student, lr=0.3, momentum=0.5))
    opts = [torch.optim.SGD(m.parameters(), lr=0.3, momentum=0.5) for m in alone]
    for _ in range(3):
        state = torch.get_rng_state()
        step(x, target)
        torch.set_rng_state(state)
        _step_alone(alone, opts, lambda i, m: weighted(m(x), target))
    assert_members_equal(student, alone)


# ----------------------------- a bug found on this journey: the self-check and a loss module


class PlainKD(nn.Module):
    def __init__(self, teacher: nn.Module) -> None:
        super().__init__()
        self.teacher = teacher

    def forward(self, out: Tensor, x: Tensor) -> Tensor:
        with torch.no_grad():
            target = F.softmax(self.teacher(x) / T, -1)
        return _kd(out, target)


def test_the_first_step_updates_a_train_mode_teacher_in_the_loss_as_alone() -> None:
    x, _ = _data(24, seed=1)
    torch.manual_seed(3)
    teacher = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)).double()
    teacher.requires_grad_(False)  # frozen, left in train mode (its batch statistics)
    lone_teachers = [copy.deepcopy(teacher) for _ in range(N)]  # each run alone: its own
    student = vmapens.Ensemble(net, N, seed=7, randomness="same")
    alone = [copy.deepcopy(student[i]) for i in range(N)]
    step = vmapens.make_step(student, PlainKD(teacher), vmapens.StackedSGD(student, lr=0.5))
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in alone]
    for _ in range(2):
        state = torch.get_rng_state()
        step(x, x)
        torch.set_rng_state(state)
        _step_alone(alone, opts, lambda i, m: PlainKD(lone_teachers[i])(m(x), x))
    assert_members_equal(student, alone)  # the students are right either way
    for t in lone_teachers:
        for key, want in t.state_dict().items():
            torch.testing.assert_close(teacher.state_dict()[key], want, **TOL64, msg=key)
