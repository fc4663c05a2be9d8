"""A user journey: continual learning with an ensemble of small MLP classifiers, two tasks.

A researcher trains task 1, then task 2, the way continual-learning papers do in plain PyTorch:

* EWC / L2-SP: after task 1, each member's anchors (its own parameters, snapshotted through
  `ens.stacked_params()` clones, `ens.state_dict()` clones or `ens.unstack()`) and its own
  diagonal Fisher (squared per-batch gradients of task 1); task 2 adds
  `lam / 2 * sum(F * (p - anchor) ** 2)` per member, written by hand over the stacked tensors
  (a sum over the non-member dims) in a hand-written loop, or returned by the forward from
  anchor buffers for `fit`.
* Multi-head: a second output head switched in for task 2 by a forward argument
  (`ens(x, task=1)`), a flag on the template (`ens.template.task = 1`) or a per-sample task
  index input; the first head frozen (`requires_grad_(False)` on the template's layer or on
  the stacked tensors) while replayed task-1 examples still train the trunk through it.
* Replay: each member keeps its own buffer of task-1 examples, mixed into every task-2 step
  (`ens(xr, in_dims=0, task=0)`, or per-member `fit` data with `in_dims=0`).
* The optimizer at the task boundary: kept, built anew over the trainable tensors, or its
  state cleared (`opt.state.clear()`), each as `torch.optim.Adam` alone.
* Evaluation on both tasks (`ens(x, task=t)` under `no_grad` in eval mode, `vmapens.predict`
  with the template's flag); checkpoints at the task boundary (`vmapens.save`/`load`/
  `restore`) and a task-2 `fit` interrupted and resumed: bit for bit the run that never
  stopped.

The truth: each member copied out before training (`ens.unstack()`) and trained alone through
both tasks with `torch.optim.Adam`, the same penalty written by hand on the plain module, the
same batches, float64.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from truth import TOL64, assert_bit_identical, assert_members_equal, batch_plan

import vmapens

pytestmark = pytest.mark.usefixtures("float64_default")

N, IN, HID, C = 3, 4, 8, 3
LRS = [0.05, 0.02, 0.08]
LAMS = [0.0, 5.0, 50.0]  # EWC strength per member


class MultiHead(nn.Module):
    """A trunk and one head per task; the head is chosen by `task` or by the `self.task` flag."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(IN, HID), nn.Tanh())
        self.heads = nn.ModuleList([nn.Linear(HID, C), nn.Linear(HID, C)])
        self.task = 0

    def forward(self, x: Tensor, task: int | None = None) -> Tensor:
        return self.heads[self.task if task is None else task](self.trunk(x))


def tasks() -> tuple[list, list, list]:
    """Task 1 (3 batches), task 2 (3 batches, another input distribution), and each member's
    own replay buffer of 6 task-1 rows, served 2 rows per task-2 step: `[n, 2, ...]`."""
    g = torch.Generator().manual_seed(7)
    task1 = [
        (torch.randn(6, IN, generator=g), torch.randint(C, (6,), generator=g)) for _ in range(3)
    ]
    task2 = [
        (torch.randn(6, IN, generator=g) + 1.5, torch.randint(C, (6,), generator=g))
        for _ in range(3)
    ]
    x1, y1 = torch.cat([x for x, _ in task1]), torch.cat([y for _, y in task1])
    rows = torch.stack([torch.randperm(len(x1), generator=g)[:6] for _ in range(N)])  # [n, 6]
    replay = [(x1[rows[:, k : k + 2]], y1[rows[:, k : k + 2]]) for k in range(0, 6, 2)]
    return task1, task2, replay


# -- (1) a hand-written two-task loop: EWC, a new head, a frozen old head, replay ----------


def snapshot(ens: vmapens.Ensemble, how: str) -> dict[str, Tensor]:
    """The anchors: each member's parameters at the end of task 1, stacked `[n, ...]`."""
    if how == "stacked_params":
        return {k: p.detach().clone() for k, p in ens.stacked_params().items()}
    if how == "state_dict":  # its tensors are the storage: clone them
        return {k: v.clone() for k, v in ens.state_dict().items()}
    members = ens.unstack()
    return {
        k: torch.stack([m.get_parameter(k).detach() for m in members])
        for k, _ in ens.named_parameters()
    }


def ewc_by_hand(
    ens: vmapens.Ensemble, how: str, opt_at_boundary: str, freeze: str
) -> dict[str, Tensor]:
    task1, task2, replay = tasks()
    opt = vmapens.StackedAdam(ens, lr=LRS)
    ce = vmapens.per_member(F.cross_entropy)
    for x, y in task1:
        opt.zero_grad()
        ce(ens(x, task=0), y).sum().backward()
        opt.step()
    fisher = {}
    for x, y in task1:  # per-batch Fisher: squared batch gradients, averaged
        opt.zero_grad()
        ce(ens(x, task=0), y).sum().backward()
        for k, p in ens.stacked_params().items():
            if p.grad is not None:  # the task-2 head has none yet
                fisher[k] = fisher.get(k, 0) + p.grad.detach() ** 2 / len(task1)
    anchors = snapshot(ens, how)
    if freeze == "template":
        ens.template.heads[0].requires_grad_(False)
    else:
        for k, p in ens.stacked_params().items():
            if k.startswith("heads.0."):
                p.requires_grad_(False)
    if opt_at_boundary == "new":
        opt = vmapens.StackedAdam([p for p in ens.parameters() if p.requires_grad], lr=LRS)
    elif opt_at_boundary == "cleared":
        opt.state.clear()
    lam = torch.tensor(LAMS)
    old_ce = vmapens.per_member(F.cross_entropy, in_dims=(0, 0))
    for (x, y), (xr, yr) in zip(task2, replay, strict=True):
        opt.zero_grad()
        new = ce(ens(x, task=1), y)
        old = old_ce(ens(xr, in_dims=0, task=0), yr)
        ewc = sum(
            (fisher[k] * (p - anchors[k]) ** 2).flatten(1).sum(1)
            for k, p in ens.stacked_params().items()
            if k in fisher
        )
        (new + old + lam / 2 * ewc).sum().backward()
        opt.step()
    return anchors


def ewc_alone(models: list[nn.Module], opt_at_boundary: str) -> None:
    task1, task2, replay = tasks()
    for i, m in enumerate(models):
        opt = torch.optim.Adam(m.parameters(), lr=LRS[i])
        for x, y in task1:
            opt.zero_grad()
            F.cross_entropy(m(x, task=0), y).backward()
            opt.step()
        fisher = {}
        for x, y in task1:
            opt.zero_grad()
            F.cross_entropy(m(x, task=0), y).backward()
            for k, p in m.named_parameters():
                if p.grad is not None:
                    fisher[k] = fisher.get(k, 0) + p.grad.detach() ** 2 / len(task1)
        anchors = {k: p.detach().clone() for k, p in m.named_parameters()}
        m.heads[0].requires_grad_(False)
        if opt_at_boundary == "new":
            opt = torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=LRS[i])
        elif opt_at_boundary == "cleared":
            opt.state.clear()
        for (x, y), (xr, yr) in zip(task2, replay, strict=True):
            opt.zero_grad()
            ewc = sum(
                (fisher[k] * (p - anchors[k]) ** 2).sum()
                for k, p in m.named_parameters()
                if k in fisher
            )
            loss = F.cross_entropy(m(x, task=1), y) + F.cross_entropy(m(xr[i], task=0), yr[i])
            (loss + LAMS[i] / 2 * ewc).backward()
            opt.step()


@pytest.mark.parametrize(
    ("how", "opt_at_boundary", "freeze"),
    [
        ("stacked_params", "kept", "template"),
        ("state_dict", "new", "stacked"),
        ("unstack", "cleared", "template"),
    ],
)
def test_two_tasks_by_hand_with_ewc_a_new_head_and_replay_end_as_alone(
    how: str, opt_at_boundary: str, freeze: str
) -> None:
    ens = vmapens.Ensemble(MultiHead, N, seed=0)
    alone = ens.unstack()
    init = {k: v.clone() for k, v in ens.state_dict().items()}
    anchors = ewc_by_hand(ens, how, opt_at_boundary, freeze)
    ewc_alone(alone, opt_at_boundary)
    assert_members_equal(ens, alone)
    # The frozen head kept its end-of-task-1 values bit for bit (it moved in task 1); the
    # trunk moved in task 2.
    for k in ("heads.0.weight", "heads.0.bias"):
        assert torch.equal(ens.get_parameter(k), anchors[k])
        assert not torch.equal(anchors[k], init[k])
    assert not torch.equal(ens.get_parameter("trunk.0.weight"), anchors["trunk.0.weight"])

    # Evaluation on both tasks: eval mode, no grad, each head; `predict` with the flag.
    _, task2, replay = tasks()
    x1, x2 = replay[0][0][0], task2[0][0]
    ens.eval()
    for m in alone:
        m.eval()
    with torch.no_grad():
        for t, x in ((0, x1), (1, x2)):
            want = torch.stack([m(x, task=t) for m in alone])
            torch.testing.assert_close(ens(x, task=t), want, **TOL64)
            ens.template.task = t
            got = vmapens.predict(ens, x, reduce="none", batch_size=4)
            torch.testing.assert_close(got, want, **TOL64)
            acc = (got.argmax(-1) == want.argmax(-1)).all()
            assert bool(acc)


# -- (2) `fit` for each task: L2-SP from anchor buffers, a per-sample head index, replay as
#        per-member data, the boundary saved and reloaded, task 2 interrupted and resumed ----


class Anchored(MultiHead):
    """Per-sample task index `tid` picks the head; returns `(logits, L2-SP penalty)` with the
    anchors and the strength kept as buffers (each member its own)."""

    def __init__(self) -> None:
        super().__init__()
        for k, p in list(self.named_parameters()):
            self.register_buffer("anchor_" + k.replace(".", "_"), torch.zeros_like(p))
        self.register_buffer("lam", torch.zeros(()))

    def forward(self, x: Tensor, tid: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        h = self.trunk(x)
        out = torch.where(tid[:, None] == 0, self.heads[0](h), self.heads[1](h))
        pen = sum(
            ((p - self.get_buffer("anchor_" + k.replace(".", "_"))) ** 2).sum()
            for k, p in self.named_parameters()
        )
        return out, self.lam / 2 * pen


def anchored_ce(out: tuple[Tensor, Tensor], y: Tensor) -> Tensor:
    return F.cross_entropy(out[0], y) + out[1]


def fit_data() -> tuple[tuple, tuple]:
    """Task 1 shared `((X, tid), Y)`; task 2 per member: the task-2 rows and the member's own
    replay rows, `[n, 24, ...]`, tid 1 for task 2 and 0 for replayed task-1 rows."""
    task1, task2, replay = tasks()
    x1, y1 = torch.cat([x for x, _ in task1]), torch.cat([y for _, y in task1])
    x2, y2 = torch.cat([x for x, _ in task2]), torch.cat([y for _, y in task2])
    xr, yr = torch.cat([x for x, _ in replay], 1), torch.cat([y for _, y in replay], 1)
    xm = torch.cat([x2.expand(N, *x2.shape), xr], 1)
    ym = torch.cat([y2.expand(N, *y2.shape), yr], 1)
    tm = torch.cat([torch.ones(N, len(x2), dtype=torch.long), torch.zeros_like(yr)], 1)
    return ((x1, torch.zeros_like(y1)), y1), ((xm, tm), ym)


def at_boundary(ens: vmapens.Ensemble) -> None:
    """Anchors through the state dict (its tensors are the storage), the strengths, the old
    head frozen on the template."""
    sd = ens.state_dict()
    with torch.no_grad():
        for k, _ in ens.named_parameters():
            sd["anchor_" + k.replace(".", "_")].copy_(sd[k])
        sd["lam"].copy_(torch.tensor(LAMS))
    ens.template.heads[0].requires_grad_(False)


def run_task2(ens: vmapens.Ensemble, opt: torch.optim.Optimizer | None, path: Path, **kw) -> None:
    _, (xs, ys) = fit_data()
    chosen = {"optimizer": opt} if opt is not None else {"lr": LRS}
    vmapens.fit(ens, (xs, ys), anchored_ce, epochs=2, batch_size=6, in_dims=0, seed=2,
                progress=False, checkpoint=path, **chosen, **kw)  # fmt: skip


def test_fit_per_task_with_boundary_checkpoint_and_interrupted_task2_ends_as_alone(
    tmp_path: Path,
) -> None:
    """The optimizer is kept across the tasks (through the boundary file, `restore`); built
    anew and cleared are (1)'s."""
    (xs1, y1), (xs2, y2) = fit_data()
    kept = True

    def task1(ens: vmapens.Ensemble, path: Path) -> vmapens.StackedAdam:
        opt = vmapens.StackedAdam(ens, lr=LRS)
        vmapens.fit(ens, (xs1, y1), anchored_ce, optimizer=opt, epochs=2, batch_size=6,
                    seed=1, progress=False, checkpoint=path)  # fmt: skip
        return opt

    # The straight run.
    straight = vmapens.Ensemble(Anchored, N, seed=0)
    alone = straight.unstack()
    opt = task1(straight, tmp_path / "a1.pt")
    at_boundary(straight)
    # Reusing task 1's checkpoint path for task 2 is refused, naming the data, and changes
    # nothing.
    before = {k: v.clone() for k, v in straight.state_dict().items()}
    with pytest.raises(ValueError, match="data"):
        run_task2(straight, opt if kept else None, tmp_path / "a1.pt")
    assert_bit_identical(dict(straight.state_dict()), before)
    run_task2(straight, opt if kept else None, tmp_path / "a2.pt")

    # Each member alone: the same batches (docs/fit.md's order), the same penalty.
    for i, m in enumerate(alone):
        adam = torch.optim.Adam(m.parameters(), lr=LRS[i])
        for rows in batch_plan(18, 6, 6, seed=1):
            adam.zero_grad()
            anchored_ce(m(xs1[0][rows], xs1[1][rows]), y1[rows]).backward()
            adam.step()
        with torch.no_grad():
            for k, p in m.named_parameters():
                m.get_buffer("anchor_" + k.replace(".", "_")).copy_(p)
            m.lam.fill_(LAMS[i])
        m.heads[0].requires_grad_(False)
        if not kept:
            adam = torch.optim.Adam(m.parameters(), lr=LRS[i])
        for rows in batch_plan(24, 6, 8, seed=2):  # 18 task-2 rows + 6 replayed
            adam.zero_grad()
            anchored_ce(m(xs2[0][i][rows], xs2[1][i][rows]), y2[i][rows]).backward()
            adam.step()
    assert_members_equal(straight, alone)  # parameters, anchors and strengths

    # The interrupted run: task 1, the boundary saved; a new process loads it, freezes the
    # head again (flags are not in files), trains one epoch of task 2 and dies; another new
    # process loads the boundary again and resumes task 2 from its checkpoint.
    first = vmapens.Ensemble(Anchored, N, seed=0)
    at_boundary_opt = task1(first, tmp_path / "b1.pt")
    at_boundary(first)
    vmapens.save(first, tmp_path / "boundary.pt", optimizer=at_boundary_opt)

    def reloaded() -> tuple[vmapens.Ensemble, vmapens.StackedAdam | None]:
        ens = vmapens.load(tmp_path / "boundary.pt", Anchored)
        opt = vmapens.StackedAdam(ens, lr=LRS)
        vmapens.restore(tmp_path / "boundary.pt", ens, opt)
        ens.template.heads[0].requires_grad_(False)
        return ens, opt if kept else None

    def die_after_one(history: vmapens.History) -> None:
        if history.epochs == 1:
            raise KeyboardInterrupt

    second, opt2 = reloaded()
    with pytest.raises(KeyboardInterrupt):
        run_task2(second, opt2, tmp_path / "c2.pt", callbacks=[die_after_one])
    resumed, opt3 = reloaded()
    run_task2(resumed, opt3, tmp_path / "c2.pt")
    assert_bit_identical(dict(resumed.state_dict()), dict(straight.state_dict()))
    if kept:
        assert opt3 is not None
        assert_bit_identical(opt3.state_dict()["state"], opt.state_dict()["state"])

    # Both tasks evaluated after training: the head index picks each task's head.
    resumed.eval()
    with torch.no_grad():
        for tid, x in ((0, xs1[0]), (1, xs2[0][0])):
            t = torch.full((len(x),), tid)
            got = vmapens.predict(resumed, (x, t), reduce="none")
            want = torch.stack([m.eval()(x, t)[0] for m in alone])
            torch.testing.assert_close(got[0], want, **TOL64)


# -- (3) the penalty written into `fit`'s loss from the stacked tensors --------------------


def test_a_fit_loss_reading_the_stacked_parameters_is_refused_not_trained_n_times() -> None:
    """The user's first try at L2-SP with `fit`: the loss closes over the ensemble and adds
    the penalty from `ens.stacked_params()`, summed to the one value per member `make_step`
    asks for. Inside the step every member's loss holds every member's penalty, so the
    summed loss back-propagates n times each member's own penalty gradient (alone: once)."""
    task1, _, _ = tasks()
    ens = vmapens.Ensemble(MultiHead, N, seed=0)
    alone = ens.unstack()
    anchors = {k: p.detach().clone() + 0.1 for k, p in ens.stacked_params().items()}

    def l2sp(out: Tensor, y: Tensor) -> Tensor:
        pen = sum(
            ((p - anchors[k]) ** 2).flatten(1).sum(1) for k, p in ens.stacked_params().items()
        )
        return F.cross_entropy(out, y) + 0.5 * pen.sum()

    try:
        vmapens.fit(ens, task1, l2sp, optimizer=vmapens.StackedSGD(ens, lr=0.1), progress=False)
    except ValueError as err:  # the fix: refused before the first step, naming the way out
        assert "loss_fn" in str(err) and "stacked" in str(err)
        assert_members_equal(ens, alone)  # nothing changed: the members as built
        return
    for i, m in enumerate(alone):  # what the user meant: each member its own penalty, once
        sgd = torch.optim.SGD(m.parameters(), lr=0.1)
        for x, y in task1:
            sgd.zero_grad()
            pen = sum(((p - anchors[k][i]) ** 2).sum() for k, p in m.named_parameters())
            (F.cross_entropy(m(x), y) + 0.5 * pen).backward()
            sgd.step()
    assert_members_equal(ens, alone)  # 0.02 off per step in every parameter (n = 3)
