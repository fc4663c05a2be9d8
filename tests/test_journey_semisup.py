"""Journey: semi-supervised members (FixMatch, pseudo-labelling rounds, Mean Teacher).

A researcher trains 4 float64 members (an MLP with BatchNorm) on a few labelled rows and a
larger unlabelled pool. (1) FixMatch with `make_step(in_dims=0)`: each member gets its own weak
and strong augmentations (noise and feature masking drawn in the training loop), pseudo-labels
from its weak view's softmax under `torch.no_grad()`, a confidence mask `max_prob >= tau` (each
member its own), masked cross-entropy on the strong view, supervised + lambda * unsupervised;
per-member learning rates; the mask's mean written as `.mean()` and as `sum / mask.sum()`
(guarded, and unguarded: a member with no confident sample then has a NaN loss, alone too, and
that NaN must stay in that member, also when it is member 0, whom the first step's self-check
runs alone). (2) Pseudo-labelling rounds: `vmapens.predict` over the pool, per-member argmax
labels, `fit(in_dims=0)` on the union of labelled rows and the member's own pseudo-labelled
pool, then member files loaded into plain modules. (3) Mean Teacher with the EMA teacher a
second ensemble moved by `torch._foreach_mul_` / `_foreach_add_` over the stacked parameters
and buffers (BatchNorm in both), the teacher's softmax the student's per-member targets in
`make_step(in_dims=0)`.

The truth: each member a plain module built after `torch.manual_seed(k)` (or the very module
`Ensemble.from_modules` stacked), trained alone with `torch.optim.Adam` on its own slice of the
same batches; float64, only the order of sums may differ (TOL64).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from truth import TOL64, assert_members_equal, batch_plan, seeded_members

import vmapens

N, D, C = 4, 5, 3
L, U = 6, 8  # labelled and unlabelled rows per step
TAU, LAM = 0.5, 1.0
LRS = [1e-2, 3e-2, 5e-3, 2e-2]


def net() -> nn.Module:
    return nn.Sequential(
        nn.Linear(D, 8, bias=False),  # no bias before BatchNorm (its true gradient is 0)
        nn.BatchNorm1d(8),
        nn.Tanh(),
        nn.Linear(8, C),
    ).double()


def labelled(rows: int = L, seed: int = 0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, D, generator=g, dtype=torch.float64)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()


def fixmatch_batch(seed: int) -> tuple[Tensor, Tensor]:
    """Per-member `[N, L + 2U, D]` inputs (labelled, weak view, strong view) and `[N, L]`
    labels: the augmentations are drawn per member in the loop."""
    g = torch.Generator().manual_seed(100 + seed)
    xl, yl = labelled(seed=seed)
    xu = 2 * torch.randn(U, D, generator=g, dtype=torch.float64)
    weak = xu + 0.05 * torch.randn(N, U, D, generator=g, dtype=torch.float64)
    keep = (torch.rand(N, U, D, generator=g) > 0.3).double()  # feature masking
    strong = xu * keep + 0.5 * torch.randn(N, U, D, generator=g, dtype=torch.float64)
    x = torch.cat([xl.expand(N, L, D), weak, strong], dim=1)
    return x, yl.expand(N, L).clone()


def fixmatch_loss(reduce: str):
    def loss(out: Tensor, y: Tensor) -> Tensor:
        lab, weak, strong = out[:L], out[L : L + U], out[L + U :]
        with torch.no_grad():
            conf, pseudo = F.softmax(weak, -1).max(-1)
            mask = (conf >= TAU).to(out.dtype)
        ce = F.cross_entropy(strong, pseudo, reduction="none") * mask
        if reduce == "mean":
            unsup = ce.mean()
        elif reduce == "ratio_guarded":
            unsup = ce.sum() / mask.sum().clamp_min(1)
        else:  # "ratio": 0 / 0 = NaN for a member with no confident sample, alone too
            unsup = ce.sum() / mask.sum()
        return F.cross_entropy(lab, y) + LAM * unsup

    return loss


def confident(m: nn.Module, x: Tensor) -> int:
    with torch.no_grad():
        probe = copy.deepcopy(m)  # its BatchNorm statistics must not move
        return int((F.softmax(probe(x)[L : L + U], -1).max(-1).values >= TAU).sum())


def run_fixmatch(reduce: str, unsure: int | None, steps: int = 3):
    """FixMatch in the ensemble (make_step) and alone; member `unsure` (if any) starts with a
    zero last layer, so its softmax is uniform (1/3 < TAU): no confident sample."""
    alone = seeded_members(net, N)
    if unsure is not None:
        with torch.no_grad():
            alone[unsure][3].weight.zero_()
            alone[unsure][3].bias.zero_()
    ens = vmapens.Ensemble.from_modules(copy.deepcopy(alone))
    step = vmapens.make_step(
        ens, fixmatch_loss(reduce), vmapens.StackedAdam(ens, lr=LRS), in_dims=0
    )
    batches = [fixmatch_batch(s) for s in range(steps)]
    loss_fn = fixmatch_loss(reduce)
    counts = [[confident(m, x[i]) for i, m in enumerate(alone)] for x, _ in batches[:1]]
    got = [step(x, y) for x, y in batches]
    want = []
    for i, m in enumerate(alone):
        opt = torch.optim.Adam(m.parameters(), lr=LRS[i])
        losses = []
        for x, y in batches:
            opt.zero_grad()
            loss = loss_fn(m(x[i]), y[i])
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        want.append(torch.stack(losses))
    return ens, alone, torch.stack(got, 1), torch.stack(want), counts[0]


@pytest.mark.parametrize("reduce", ["mean", "ratio_guarded"])
def test_fixmatch_per_member_views_masks_and_lrs_match_each_member_alone(reduce: str) -> None:
    ens, alone, got, want, counts = run_fixmatch(reduce, unsure=None)
    assert len(set(counts)) > 1, counts  # the members' masks differ (each its own confidence)
    torch.testing.assert_close(got, want, **TOL64)
    assert_members_equal(ens, alone)


@pytest.mark.parametrize(
    ("reduce", "unsure"), [("mean", 1), ("ratio_guarded", 0), ("ratio", 0), ("ratio", 1)]
)
def test_a_member_with_no_confident_sample_alone_and_in_the_ensemble(
    reduce: str, unsure: int
) -> None:
    ens, alone, got, want, counts = run_fixmatch(reduce, unsure=unsure, steps=2)
    assert counts[unsure] == 0 and sum(counts) > 0, counts
    others = [i for i in range(N) if counts[i] > 0]  # members 0 and 2 have none here anyway
    if reduce == "ratio":  # NaN alone: the ensemble's member is NaN too, and nobody else is
        assert torch.isnan(want[unsure]).all() and torch.isnan(got[unsure]).all()
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        assert torch.isnan(ens.stacked_params()["3.weight"][unsure]).all()
        assert torch.isfinite(got[others]).all()
        for name, p in ens.stacked_params().items():
            assert torch.isfinite(p[others]).all(), name
        for name, b in ens.stacked_buffers().items():
            if b.is_floating_point():
                assert torch.isfinite(b[others]).all(), name
        torch.testing.assert_close(got[others], want[others], **TOL64)
        for i in others:
            for k, v in alone[i].state_dict().items():
                torch.testing.assert_close(ens[i].state_dict()[k], v, **TOL64, msg=f"{i} {k}")
    else:  # 0 unsupervised loss for it, exactly the supervised loss alone
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, **TOL64)
        assert_members_equal(ens, alone)


# ------------------------------------------------------------ (2) pseudo-labelling rounds

POOL, BATCH, EPOCHS = 16, 8, 2


def weighted_ce(out: Tensor, y: Tensor) -> Tensor:
    """Targets `[rows, 2]`: the label and the row's weight (1 labelled, confident or not)."""
    w = y[:, 1]
    ce = F.cross_entropy(out, y[:, 0].long(), reduction="none")
    return (ce * w).sum() / w.sum().clamp_min(1)


def test_pseudo_label_rounds_with_predict_fit_and_member_files(tmp_path: Path) -> None:
    xl, yl = labelled(12, seed=5)
    pool = 2 * torch.randn(POOL, D, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    ens = vmapens.Ensemble(net, N, seeds=range(N))
    alone = seeded_members(net, N)
    ones = torch.ones(12, dtype=torch.float64)
    # round 0: the labelled rows, shared by every member
    vmapens.fit(ens, (xl, torch.stack([yl.double(), ones], -1)), weighted_ce, epochs=EPOCHS,
                batch_size=BATCH, lr=LRS, seed=0, progress=False)  # fmt: skip
    x_union = torch.cat([xl, pool])
    kept = []
    for rnd in range(2):
        with torch.no_grad():
            probs = vmapens.predict(ens, pool, softmax=True)  # [N, POOL, C], eval mode
        conf, pseudo = probs.max(-1)
        keep = (conf >= 0.6).double()
        kept.append(keep.sum(1).tolist())
        Y = torch.cat(
            [torch.stack([yl.double(), ones], -1).expand(N, 12, 2),
             torch.stack([pseudo.double(), keep], -1)], 1
        )  # fmt: skip
        X = x_union.expand(N, *x_union.shape)
        vmapens.fit(ens, (X, Y), weighted_ce, epochs=EPOCHS, batch_size=BATCH, lr=LRS,
                    seed=rnd + 1, in_dims=0, progress=False)  # fmt: skip
    vmapens.save_members(ens, tmp_path)

    # alone: the same rounds, batch orders from docs/fit.md's recipe
    for i, m in enumerate(alone):
        target = torch.stack([yl.double(), ones], -1)
        x_i = xl
        for rnd in range(3):
            rows = x_i.shape[0]
            plan = batch_plan(rows, BATCH, EPOCHS * math.ceil(rows / BATCH), seed=rnd)
            opt = torch.optim.Adam(m.parameters(), lr=LRS[i])
            m.train()
            for idx in plan:
                opt.zero_grad()
                weighted_ce(m(x_i[idx]), target[idx]).backward()
                opt.step()
            if rnd == 2:
                break
            m.eval()
            with torch.no_grad():
                conf_i, pseudo_i = F.softmax(m(pool), -1).max(-1)
            m.train()
            assert (conf_i >= 0.6).sum().item() == kept[rnd][i]
            target = torch.cat(
                [torch.stack([yl.double(), ones], -1),
                 torch.stack([pseudo_i.double(), (conf_i >= 0.6).double()], -1)]
            )  # fmt: skip
            x_i = x_union
    assert len(set(kept[0])) > 1 and len(set(kept[1])) > 1, kept  # the members' masks differ
    assert_members_equal(ens, alone)
    for i in range(N):  # plain PyTorch loads each member's file: member i's bits
        plain = net()
        plain.load_state_dict(torch.load(tmp_path / f"member_{i:04d}.pt"))
        for k, v in ens[i].state_dict().items():
            torch.testing.assert_close(plain.state_dict()[k], v, rtol=0, atol=0, msg=k)
    assert [len(s) for s in vmapens.load_members(tmp_path)] == [len(m.state_dict()) for m in alone]


# ---------------------------------------------------------------------- (3) Mean Teacher

DECAY = 0.9


def mean_teacher_loss(out: Tensor, t: Tensor) -> Tensor:
    """Targets `[L + U, C]`: the one-hot labels, then the teacher's class probabilities."""
    cons = ((F.softmax(out[L:], -1) - t[L:]) ** 2).mean()
    return F.cross_entropy(out[:L], t[:L]) + 2.0 * cons


def ema_(teacher: list[Tensor], student: list[Tensor]) -> None:
    torch._foreach_mul_(teacher, DECAY)
    torch._foreach_add_(teacher, student, alpha=1 - DECAY)


def floats(named: dict[str, Tensor]) -> list[Tensor]:
    return [t for t in named.values() if t.is_floating_point()]


def test_mean_teacher_second_ensemble_moved_by_foreach_on_stacked_tensors() -> None:
    student = vmapens.Ensemble(net, N, seeds=range(N))
    teacher = copy.deepcopy(student).requires_grad_(False)
    alone = seeded_members(net, N)
    lone_t = [copy.deepcopy(m).requires_grad_(False) for m in alone]
    opts = [torch.optim.Adam(m.parameters(), lr=LRS[i]) for i, m in enumerate(alone)]
    step = vmapens.make_step(
        student, mean_teacher_loss, vmapens.StackedAdam(student, lr=LRS), in_dims=0
    )
    xl, yl = labelled()
    onehot = F.one_hot(yl, C).double()
    g = torch.Generator().manual_seed(11)
    for _ in range(3):
        xu = 2 * torch.randn(U, D, generator=g, dtype=torch.float64)
        xs = xu + 0.1 * torch.randn(N, U, D, generator=g, dtype=torch.float64)
        xt = xu + 0.1 * torch.randn(N, U, D, generator=g, dtype=torch.float64)
        with torch.no_grad():  # train mode: the teacher's own batch statistics and buffers
            tp = F.softmax(teacher(xt, in_dims=0), -1)
        X = torch.cat([xl.expand(N, L, D), xs], 1)
        T = torch.cat([onehot.expand(N, L, C), tp], 1)
        step(X, T)
        with torch.no_grad():
            ema_(floats(teacher.stacked_params()), floats(student.stacked_params()))
            ema_(floats(teacher.stacked_buffers()), floats(student.stacked_buffers()))
        for i, (m, t, o) in enumerate(zip(alone, lone_t, opts, strict=True)):
            with torch.no_grad():
                tp_i = F.softmax(t(xt[i]), -1)
            o.zero_grad()
            mean_teacher_loss(m(torch.cat([xl, xs[i]])), torch.cat([onehot, tp_i])).backward()
            o.step()
            with torch.no_grad():
                ema_(floats(dict(t.named_parameters())), floats(dict(m.named_parameters())))
                ema_(floats(dict(t.named_buffers())), floats(dict(m.named_buffers())))
    assert_members_equal(student, alone)
    assert_members_equal(teacher, lone_t)
    # num_batches_tracked: the teacher's own forwards counted it, as alone
    assert teacher[0].state_dict()["1.num_batches_tracked"].item() == 3


def test_fixmatch_hand_loop_on_shared_views_keeps_a_nan_member_to_itself() -> None:
    """The same step written by hand over shared views (`ens(x)`, `per_member`), the
    unguarded ratio: members with no confident sample go NaN, alone and here, the others not."""
    alone = seeded_members(net, N)
    ens = vmapens.Ensemble.from_modules(copy.deepcopy(alone))
    opt = vmapens.StackedAdam(ens, lr=LRS)
    loss_fn = fixmatch_loss("ratio")
    batches = [(x[0], y[0]) for x, y in (fixmatch_batch(s) for s in range(3))]
    got = []
    for x, y in batches:
        opt.zero_grad()
        losses = vmapens.per_member(loss_fn)(ens(x), y)
        losses.sum().backward()  # NaN in total: each member still gets its own gradient
        opt.step()
        got.append(losses.detach())
    want = []
    for i, m in enumerate(alone):
        o = torch.optim.Adam(m.parameters(), lr=LRS[i])
        row = []
        for x, y in batches:
            o.zero_grad()
            loss = loss_fn(m(x), y)
            loss.backward()
            o.step()
            row.append(loss.detach())
        want.append(torch.stack(row))
    got_t, want_t = torch.stack(got, 1), torch.stack(want)
    assert torch.equal(torch.isnan(got_t), torch.isnan(want_t))
    fine = [i for i in range(N) if torch.isfinite(want_t[i]).all()]
    assert 0 < len(fine) < N, want_t
    torch.testing.assert_close(got_t[fine], want_t[fine], **TOL64)
    for i in fine:
        for k, v in alone[i].state_dict().items():
            torch.testing.assert_close(ens[i].state_dict()[k], v, **TOL64, msg=f"{i} {k}")
