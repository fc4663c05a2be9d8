"""A user journey: an ensemble of 3 tiny U-Nets for semantic segmentation (float64).

The model a segmentation researcher writes: 1-channel 8x8 images, 3 classes; an encoder of
convolutions + BatchNorm2d + ReLU with a MaxPool2d between them, a decoder that upsamples the
bottleneck (`nn.ConvTranspose2d`, or bilinear `F.interpolate(align_corners=False)` and a 1x1
conv) and joins the skip connection with `torch.cat`, a 1x1 head of per-pixel logits
`[B, 3, 8, 8]`. Targets are `[B, 8, 8]` class maps with ignored pixels (255). Losses:
`nn.CrossEntropyLoss(weight=class_weights, ignore_index=255, label_smoothing=0.1)` (its mean is
over the non-ignored pixels, weighted), a soft Dice loss written by hand, and their sum. Each
member sees its own random flips of the same images (per-member batches, `in_dims=0`), so
each member has its own count of ignored pixels: its own denominator.

The truth is the naive loop: each member a plain U-Net trained alone with `torch.optim` (Adam,
SGD with momentum) on its own slice of the same batches; a per-member mean IoU written by hand
from argmax predictions; `predict`'s reductions written by hand; plain `torch.load` of member
files. float64: members agree to round-off (docs/semantics.md). The convs before BatchNorm
have no bias: that bias's true gradient is 0 and Adam steps on its round-off ("What differs
from training alone").

Documented refusal checked: the weighted, smoothed, ignoring loss on per-member targets
cannot be batched inside the step (docs/semantics.md, "What vmap cannot batch"): the error
names `loss_fn` and backend='loop', nothing changes, and backend='loop' and
`vmapens.per_member` run it exactly.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from truth import assert_states, batch_plan

import vmapens
from vmapens.callbacks import EarlyStopping

pytestmark = pytest.mark.usefixtures("float64_default")

N, B, C, S, IGNORE = 3, 4, 3, 8, 255
TOL = {"rtol": 1e-9, "atol": 1e-10}
CL = torch.channels_last
WEIGHT = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)


class UNet(nn.Module):
    def __init__(self, up: str = "transpose") -> None:
        super().__init__()
        self.upsampler = up
        self.enc1 = nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU()
        )
        self.pool = nn.MaxPool2d(2)
        self.enc2 = nn.Sequential(
            nn.Conv2d(4, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU()
        )
        self.up = nn.ConvTranspose2d(6, 4, 2, stride=2)
        self.reduce = nn.Conv2d(6, 4, 1)
        self.dec = nn.Sequential(nn.Conv2d(8, 4, 3, padding=1), nn.ReLU())
        self.head = nn.Conv2d(4, C, 1)  # fmt: skip

    def forward(self, x: Tensor) -> Tensor:
        e1 = self.enc1(x)  # 8x8
        e2 = self.enc2(self.pool(e1))  # 4x4
        if self.upsampler == "transpose":
            u = self.up(e2)
        else:
            u = self.reduce(F.interpolate(e2, scale_factor=2, mode="bilinear", align_corners=False))
        return self.head(self.dec(torch.cat([u, e1], 1)))


CE = nn.CrossEntropyLoss(weight=WEIGHT, ignore_index=IGNORE, label_smoothing=0.1)
CE_W = nn.CrossEntropyLoss(weight=WEIGHT, ignore_index=IGNORE)  # no smoothing: vmap batches it


def dice(logits: Tensor, y: Tensor) -> Tensor:
    """Soft Dice over the classes, ignored pixels left out, written as a user writes it."""
    p = logits.softmax(1)
    valid = (y != IGNORE)[:, None]
    onehot = F.one_hot(torch.where(y == IGNORE, 0, y), C).permute(0, 3, 1, 2).to(p.dtype)
    p, onehot = p * valid, onehot * valid
    inter, total = (p * onehot).sum((0, 2, 3)), p.sum((0, 2, 3)) + onehot.sum((0, 2, 3))
    return 1 - ((2 * inter + 1) / (total + 1)).mean()


def full_loss(out: Tensor, y: Tensor) -> Tensor:
    return CE(out, y) + dice(out, y)


def batchable_loss(out: Tensor, y: Tensor) -> Tensor:
    return CE_W(out, y) + dice(out, y)


def miou(out: Tensor, y: Tensor) -> Tensor:
    """Mean IoU over the classes present in prediction or target, from argmax predictions."""
    pred, valid = out.argmax(1), y != IGNORE
    ious = []
    for c in range(C):
        p, t = (pred == c) & valid, (y == c) & valid
        inter, union = (p & t).sum(), (p | t).sum()
        ious.append(torch.where(union > 0, inter / union.clamp(min=1), torch.nan))
    return torch.stack(ious).nanmean()


def images(count: int, seed: int) -> tuple[Tensor, Tensor]:
    """Images and class maps (a class per intensity band, 15% of pixels ignored)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(count, 1, S, S, generator=g)
    y = torch.bucketize(x[:, 0], torch.tensor([-0.4, 0.4]))
    y[torch.rand(count, S, S, generator=g) < 0.15] = IGNORE
    return x, y


def flipped(x: Tensor, y: Tensor, seed: int) -> tuple[Tensor, Tensor]:
    """`[N, count, ...]`: each member its own random horizontal and vertical flips and a
    random erased square (image 0, label ignored), so its own count of ignored pixels."""
    g = torch.Generator().manual_seed(seed)
    xs, ys = [], []
    for _ in range(N):
        xi, yi = x, y
        for dim in (-1, -2):
            f = torch.rand(len(x), generator=g) < 0.5
            xi = torch.where(f[:, None, None, None], xi.flip(dim), xi)
            yi = torch.where(f[:, None, None], yi.flip(dim), yi)
        side = int(torch.randint(1, 4, (), generator=g))
        r, c = (int(v) for v in torch.randint(0, S - side, (2,), generator=g))
        xi, yi = xi.clone(), yi.clone()
        xi[..., r : r + side, c : c + side] = 0
        yi[..., r : r + side, c : c + side] = IGNORE
        xs.append(xi)
        ys.append(yi)
    return torch.stack(xs), torch.stack(ys)


def assert_members(ens: vmapens.Ensemble, models: list[nn.Module]) -> None:
    for i, m in enumerate(models):
        got, want = ens[i].state_dict(), m.state_dict()
        assert list(got) == list(want)
        for k in want:
            torch.testing.assert_close(got[k], want[k], **TOL, msg=f"member {i} {k}")


def alone_step(models: list[nn.Module], opts: list[Any], x: Tensor, y: Tensor, loss: Any,
               per_member: bool) -> list[float]:  # fmt: skip
    out = []
    for i, (m, opt) in enumerate(zip(models, opts, strict=True)):
        opt.zero_grad()
        value = loss(m(x[i] if per_member else x), y[i] if per_member else y)
        value.backward()
        opt.step()
        out.append(value.item())
    return out


@pytest.mark.parametrize("up, channels_last", [("transpose", False), ("bilinear", True)])
def test_make_step_adam_full_loss_on_shared_masks_matches_alone(up: str, channels_last: bool):
    """Weighted, smoothed, ignoring CE + Dice on shared masks batches inside the step; with
    `ens.to(memory_format=channels_last)` and channels-last inputs as alone."""
    ens = vmapens.Ensemble(lambda: UNet(up), n=N, seed=0)
    models = ens.unstack()
    if channels_last:
        ens.to(memory_format=CL)
        for m in models:
            m.to(memory_format=CL)
    step = vmapens.make_step(ens, full_loss, vmapens.StackedAdam(ens, lr=[1e-2, 3e-2, 2e-2]))
    opts = [torch.optim.Adam(m.parameters(), lr=lr) for m, lr in zip(models, [1e-2, 3e-2, 2e-2])]
    for k in range(3):
        x, y = images(B, seed=k)
        if channels_last:
            x = x.to(memory_format=CL)
        losses = step(x, y)
        torch.testing.assert_close(
            losses, torch.tensor(alone_step(models, opts, x, y, full_loss, False)), **TOL
        )
    assert_members(ens, models)
    if channels_last:  # the layout each member has alone
        assert ens[1].dec[0].weight.is_contiguous(memory_format=CL)


def test_per_member_flips_sgd_momentum_each_member_its_own_ignored_pixel_count():
    """CE (weight, ignore_index) + Dice on per-member flipped masks under vmap: each member's
    weighted mean divides by its own sum of weights over its non-ignored pixels."""
    ens = vmapens.Ensemble(lambda: UNet("bilinear"), n=N, seed=1)
    models = ens.unstack()
    opt = vmapens.StackedSGD(ens, lr=[0.1, 0.05, 0.02], momentum=0.9)
    step = vmapens.make_step(ens, batchable_loss, opt, in_dims=0)
    opts = [
        torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9)
        for m, lr in zip(models, [0.1, 0.05, 0.02])
    ]
    for k in range(3):
        xs, ys = flipped(*images(B, seed=10 + k), seed=k)
        # each member its own ignored pixels, so its own weighted mean's denominator
        sums = [float(WEIGHT[ys[i][ys[i] != IGNORE]].sum()) for i in range(N)]
        assert len(set(sums)) > 1, sums
        torch.testing.assert_close(
            step(xs, ys),
            torch.tensor(alone_step(models, opts, xs, ys, batchable_loss, True)),
            **TOL,
        )
    assert_members(ens, models)


def test_full_loss_on_per_member_masks_is_refused_and_the_loop_and_per_member_are_exact():
    xs, ys = flipped(*images(B, seed=3), seed=3)
    ens = vmapens.Ensemble(UNet, n=N, seed=0)
    before = copy.deepcopy(ens.state_dict())
    step = vmapens.make_step(ens, full_loss, vmapens.StackedAdam(ens), in_dims=0)
    with pytest.raises(RuntimeError, match="`loss_fn`.*backend='loop'"):
        step(xs, ys)
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k
    # backend='loop', with chunk_size=2 on top
    loop = vmapens.Ensemble(UNet, n=N, seed=0, backend="loop", chunk_size=2)
    models, hand = loop.unstack(), vmapens.Ensemble(UNet, n=N, seed=0)
    step = vmapens.make_step(loop, full_loss, vmapens.StackedAdam(loop, lr=1e-2), in_dims=0)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in models]
    hand_opt = vmapens.StackedAdam(hand, lr=1e-2)
    for k in range(2):
        xs, ys = flipped(*images(B, seed=20 + k), seed=k)
        losses = step(xs, ys)
        torch.testing.assert_close(
            losses, torch.tensor(alone_step(models, opts, xs, ys, full_loss, True)), **TOL
        )
        # the loop written by hand: per_member runs the loss member by member
        per = vmapens.per_member(full_loss, in_dims=(0, 0))(hand(xs, in_dims=0), ys)
        torch.testing.assert_close(per.detach(), losses, **TOL)
        hand_opt.zero_grad()
        per.sum().backward()
        hand_opt.step()
    assert_members(loop, models)
    assert_members(hand, models)


def test_fit_with_val_miou_ensemble_miou_and_best_restore_by_metric_matches_alone():
    """`fit` on per-member flips (chunk_size=2), shared validation; EarlyStopping on the
    hand-written mean IoU (member 1 stops after epoch 2): history, the ensemble's metric and
    the best-epoch restore as alone."""
    xs, ys = flipped(*images(6, seed=30), seed=30)
    xv, yv = images(4, seed=31)
    lrs, epochs, patience = [5e-2, 1e-1, 2e-2], 5, 2
    ens = vmapens.Ensemble(lambda: UNet("bilinear"), n=N, seed=2, chunk_size=2)
    models = ens.unstack()
    history = vmapens.fit(
        ens, (xs, ys), batchable_loss, epochs=epochs, batch_size=4, in_dims=0, val_data=(xv, yv),
        metrics={"miou": miou}, lr=lrs, seed=0, progress=False,
        callbacks=[EarlyStopping("val_miou", "max", patience=patience)],
    )  # fmt: skip
    plan = batch_plan(6, 4, 2 * epochs, seed=0)
    val = torch.full((epochs, N), torch.nan)
    met = torch.full((epochs, N), torch.nan)
    outs = torch.zeros(epochs, N, 4, C, S, S)  # a stopped member keeps its last output
    best_epoch, stopped = [], []
    for i, m in enumerate(models):
        opt = torch.optim.Adam(m.parameters(), lr=lrs[i])
        best, best_state, bad, best_e, stop = -1.0, None, 0, -1, -1
        for e in range(epochs):
            m.train()
            for rows in plan[2 * e : 2 * e + 2]:
                opt.zero_grad()
                batchable_loss(m(xs[i, rows]), ys[i, rows]).backward()
                opt.step()
            m.eval()
            with torch.no_grad():
                out = m(xv)
            val[e, i], met[e, i] = batchable_loss(out, yv), miou(out, yv)
            outs[e:, i] = out
            if met[e, i] > best:
                best, best_state, bad, best_e = (
                    float(met[e, i]),
                    copy.deepcopy(m.state_dict()),
                    0,
                    e,
                )
            else:
                bad += 1
            if bad >= patience:  # recorded at the last epoch too (patience ran out there)
                stop = e
                break
        m.load_state_dict(best_state)
        best_epoch.append(best_e)
        stopped.append(stop)
    assert stopped == [-1, 2, 4]  # member 1 stops early: its NaN rows are checked too
    torch.testing.assert_close(history.val_loss, val, **TOL, equal_nan=True)
    torch.testing.assert_close(history.metrics["miou"], met, **TOL, equal_nan=True)
    assert history.best_epoch.tolist() == best_epoch
    assert history.stopped_epoch.tolist() == stopped
    # the metric of the output averaged over the members (docs/workflows.md): a stopped
    # member takes part with the weights it stopped with
    ens_miou = torch.stack([miou(outs[e].mean(0), yv) for e in range(epochs)])
    torch.testing.assert_close(history.ensemble_metrics["miou"], ens_miou, **TOL)
    assert_members(ens, models)


def test_predict_mean_of_softmax_chunked_vs_by_hand_and_member_files():
    ens = vmapens.Ensemble(UNet, n=N, seed=0)
    step = vmapens.make_step(ens, full_loss, vmapens.StackedAdam(ens, lr=1e-2))
    for k in range(2):
        step(*images(B, seed=40 + k))
    models = ens.unstack()
    x = images(5, seed=42)[0].to(memory_format=CL)
    with torch.no_grad():
        logits = [m.eval()(x) for m in models]
    # docs: softmax=True is over the last dim, and "mean" averages the probabilities
    got = vmapens.predict(ens, x, reduce="mean", softmax=True, chunk_size=2, batch_size=2)
    torch.testing.assert_close(got, sum(o.softmax(-1) for o in logits) / N, **TOL)
    # the class probabilities of a segmentation net (classes at dim 1): from reduce="none"
    every = vmapens.predict(ens, x, chunk_size=2, batch_size=2)
    torch.testing.assert_close(
        every.softmax(2).mean(0), sum(o.softmax(1) for o in logits) / N, **TOL
    )
    assert ens.training  # predict gave the mode back
    # member files: plain torch.load into a plain UNet, and the checked set
    with tempfile.TemporaryDirectory() as tmp:
        paths = vmapens.save_members(ens, Path(tmp))
        assert_states(vmapens.load_members(Path(tmp)), models)
        for i, path in enumerate(paths):
            plain = UNet()
            plain.load_state_dict(torch.load(path, weights_only=True))
            with torch.no_grad():
                torch.testing.assert_close(plain.eval()(x), logits[i], rtol=0, atol=0)


# ---- bugs


def test_uint8_masks_in_make_step_are_refused_naming_the_step_and_long():
    """Segmentation masks read from PNGs are uint8 (255: ignored). torch alone refuses them
    for [B, C, H, W] logits ("expected scalar type Long but found Byte"); the step raised
    vmap's own "gather(): Expected dtype int32/int64 for index": no API name, no way out.
    `fit` says it for a CrossEntropyLoss module (docs/fit.md: "pass them as Y.long()"), not
    for a loss of one's own (CE + Dice)."""
    x, y = images(B, seed=50)
    ens = vmapens.Ensemble(UNet, n=N, seed=0)
    before = copy.deepcopy(ens.state_dict())
    step = vmapens.make_step(ens, full_loss, vmapens.StackedAdam(ens))
    with pytest.raises(RuntimeError, match=r"^step: .*\.long\(\)"):
        step(x, y.to(torch.uint8))
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k
