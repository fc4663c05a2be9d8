"""User journey: modern vision members written by hand, the way people copy them from
timm/torchvision (8x8 inputs, a few channels, float64 unless said otherwise).

The members: a ResNet with basic blocks and one with bottlenecks (BatchNorm, zero-init of each
block's last BN weight, `kaiming_normal_(mode="fan_out")`, `inplace=True` ReLUs, `out +=
identity`, a downsample branch), a MobileNetV2 inverted residual (depthwise `Conv2d(groups=
channels)`, `ReLU6`, `Hardswish`) with squeeze-and-excitation (`AdaptiveAvgPool2d(1)`, two 1x1
convs, `Hardsigmoid`), a ConvNeXt block (depthwise 7x7 conv, `LayerNorm` over channels between
permutes, a layer-scale `gamma`, GELU, timm's `drop_path`), and an encoder-decoder with the
resampling layers (`F.interpolate` bilinear/bicubic with `align_corners` both ways and nearest,
`nn.Upsample`, `PixelShuffle`, `nn.Unfold`, `AvgPool2d(ceil_mode=True,
count_include_pad=False)`, `MaxPool2d(return_indices=True)` + `MaxUnpool2d`). Channels-last
inputs and `ens.to(memory_format=torch.channels_last)`; label smoothing; mixup's soft targets
(one lambda and permutation per member, `in_dims=0`); AdamW param groups without decay on
BatchNorm/LayerNorm, biases and layer scale (built over `ens.template`'s names, docs/optim.md);
clipping per member (`make_step(clip_grad_norm=...)` and `vmapens.optim.clip_grad_norm_` in a
hand loop, against `torch.nn.utils.clip_grad_norm_` alone); frozen BatchNorm (`model.train()`
then `apply(lambda m: m.eval() ...)`, its affine frozen too), `track_running_stats=False`,
`momentum=None`, `SyncBatchNorm` without a process group; batches of several sizes, eval
batches of one row; `fit` with those param groups, clipping and validation; one float32 run.

The truth: each member a plain module built from its documented seed (`truth.factory_members`)
and trained alone with `torch.optim` on the same batches. Tolerances: TOL64 where every
parameter has a gradient that is not pure round-off; `ADAM64` (1e-8) for Adam on members
whose zero-init residual branch or train-mode BatchNorm makes some bias's true gradient 0
(docs/semantics.md, "What differs": Adam divides that round-off by its own size and steps by
~lr * 1e-9; measured 1.4e-10 here).

Found here and fixed in session 43: members that the factory builds channels-last
(`cnn().to(memory_format=torch.channels_last)`) were stacked contiguous, so a memory-order
draw inside the member (`nn.Dropout` after a conv with `randomness="same"`, a
`kaiming_normal_` through `ens.apply`) drew other numbers than the member alone, silently: the
first step's self-check rebuilt member 0 from the contiguous storage, so it agreed with the
ensemble, not with the member the factory built. Building now keeps a channels-last layout.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from parity import training_state
from torch import Tensor, nn
from truth import TOL64, assert_members_equal, batch_plan, factory_members

import vmapens

pytestmark = pytest.mark.usefixtures("float64_default")

N = 3
CL = torch.channels_last
ADAM64: dict[str, Any] = dict(rtol=1e-8, atol=1e-8)
CE = nn.CrossEntropyLoss(label_smoothing=0.1)
CLASSES = 5
SIZES = (4, 3, 5)  # batch sizes of the training steps, in turn


# --------------------------------------------------------------------------- the members


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1, norm: Any = nn.BatchNorm2d) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = norm(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = norm(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), norm(cout))

    def forward(self, x: Tensor) -> Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int = 1, norm: Any = nn.BatchNorm2d) -> None:
        super().__init__()
        cout = width * 4
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), norm(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), norm(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), norm(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), norm(cout))

    def forward(self, x: Tensor) -> Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class TinyResNet(nn.Module):
    """torchvision's ResNet at 8x8: stem, max pool, two stages, `zero_init_residual=True`."""

    def __init__(self, block: str = "basic", norm: Any = nn.BatchNorm2d) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, 1, 1, bias=False)
        self.bn1 = norm(4)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        if block == "basic":
            self.layer1, self.layer2, feat = (
                BasicBlock(4, 4, norm=norm),
                BasicBlock(4, 6, 2, norm),
                6,
            )
        else:
            self.layer1, self.layer2, feat = (
                Bottleneck(4, 2, norm=norm),
                Bottleneck(8, 2, 2, norm),
                8,
            )
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(feat, CLASSES)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d) and m.affine:
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)
        for m in self.modules():  # zero_init_residual
            if isinstance(m, Bottleneck) and m.bn3.affine:
                nn.init.constant_(m.bn3.weight, 0)
            elif isinstance(m, BasicBlock) and m.bn2.affine:
                nn.init.constant_(m.bn2.weight, 0)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class SqueezeExcite(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1, self.fc2 = nn.Conv2d(c, c // 2, 1), nn.Conv2d(c // 2, c, 1)
        self.act, self.gate = nn.ReLU(inplace=True), nn.Hardsigmoid(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gate(self.fc2(self.act(self.fc1(self.avgpool(x)))))


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int, norm: Any) -> None:
        super().__init__()
        hid = cin * expand
        self.use_res = stride == 1 and cin == cout
        self.conv = nn.Sequential(
            nn.Conv2d(cin, hid, 1, bias=False), norm(hid), nn.ReLU6(inplace=True),
            nn.Conv2d(hid, hid, 3, stride, 1, groups=hid, bias=False), norm(hid),
            nn.ReLU6(inplace=True), SqueezeExcite(hid),
            nn.Conv2d(hid, cout, 1, bias=False), norm(cout),
        )  # fmt: skip

    def forward(self, x: Tensor) -> Tensor:
        return x + self.conv(x) if self.use_res else self.conv(x)


class TinyMobileNet(nn.Module):
    def __init__(self, norm: Any = nn.BatchNorm2d) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, 2, 1, bias=False), norm(4), nn.Hardswish(True))
        self.blocks = nn.Sequential(
            InvertedResidual(4, 4, 1, 2, norm), InvertedResidual(4, 6, 2, 2, norm)
        )
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, CLASSES))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(self.stem(x)))


class LayerNorm2d(nn.LayerNorm):
    """timm's: a LayerNorm over channels of an NCHW tensor, between permutes."""

    def forward(self, x: Tensor) -> Tensor:
        x = F.layer_norm(
            x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias, self.eps
        )
        return x.permute(0, 3, 1, 2)


def drop_path(x: Tensor, drop_prob: float, training: bool) -> Tensor:
    """timm's `drop_path` (stochastic depth), as written there."""
    if drop_prob == 0.0 or not training:
        return x
    keep_prob = 1 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    random_tensor = x.new_empty(shape).bernoulli_(keep_prob)
    random_tensor.div_(keep_prob)
    return x * random_tensor


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int, drop: float = 0.0) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1, self.act, self.pwconv2 = (
            nn.Linear(dim, 4 * dim),
            nn.GELU(),
            nn.Linear(4 * dim, dim),
        )
        self.gamma = nn.Parameter(0.1 * torch.ones(dim))
        self.drop = drop

    def forward(self, x: Tensor) -> Tensor:
        shortcut = x
        x = self.dwconv(x).permute(0, 2, 3, 1)
        x = self.gamma * self.pwconv2(self.act(self.pwconv1(self.norm(x))))
        return shortcut + drop_path(x.permute(0, 3, 1, 2), self.drop, self.training)


class TinyConvNeXt(nn.Module):
    def __init__(self, drop: float = 0.0) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 2, 2), LayerNorm2d(4, eps=1e-6))
        self.stage1 = ConvNeXtBlock(4, drop)
        self.down = nn.Sequential(LayerNorm2d(4, eps=1e-6), nn.Conv2d(4, 6, 2, 2))
        self.stage2 = ConvNeXtBlock(6, drop)
        self.norm, self.head = nn.LayerNorm(6, eps=1e-6), nn.Linear(6, CLASSES)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.trunc_normal_(m.weight, std=0.2)
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stage2(self.down(self.stage1(self.stem(x))))
        return self.head(self.norm(x.mean([-2, -1])))


class TinyUNet(nn.Module):
    """An encoder-decoder with every resampling layer of the brief, fused into a classifier."""

    def __init__(self, mode: str = "bilinear", align: bool | None = False) -> None:
        super().__init__()
        self.mode, self.align = mode, align
        self.enc = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(True)
        )
        self.pool, self.unpool = nn.MaxPool2d(2, 2, return_indices=True), nn.MaxUnpool2d(2, 2)
        self.avg = nn.AvgPool2d(3, 2, padding=1, ceil_mode=True, count_include_pad=False)
        self.mid = nn.Conv2d(4, 8, 3, padding=1)
        self.shuffle, self.up = nn.PixelShuffle(2), nn.Upsample(scale_factor=2, mode="nearest")
        self.unfold = nn.Unfold(kernel_size=2, stride=2)
        self.fuse = nn.Conv2d(14, 6, 1)
        self.head = nn.Linear(6 + 16, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        h = self.enc(x)
        p, idx = self.pool(h)  # ReLU zeros: tied maxima
        un = self.unpool(p, idx, output_size=h.shape[-2:])
        s = self.shuffle(F.relu(self.mid(self.avg(h))))
        s = F.interpolate(s, size=h.shape[-2:], mode=self.mode, align_corners=self.align)
        u = F.interpolate(
            self.up(p), size=h.shape[-2:], mode="bilinear", align_corners=not self.align
        )
        z = F.relu(self.fuse(torch.cat([un, s, u, h], 1)))
        patches = self.unfold(h[:, :, :4, :4])
        return self.head(torch.cat([z.mean((2, 3)), patches.mean(-1)], 1))


# --------------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True)
def _no_fallback_noise():
    # `AdaptiveAvgPool2d(1)` on a channels-last input restrides its output with `as_strided_`,
    # which vmap runs through its per-member fallback (correct, with a performance warning);
    # the project's config ignores that warning, a plain `-W error` does not.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "There is a performance drop")
        yield


def batches(
    count: int, hw: int = 8, seed: int = 1, sizes: tuple[int, ...] = SIZES
) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(count):
        b = sizes[k % len(sizes)]
        out.append(
            (torch.randn(b, 3, hw, hw, generator=g), torch.randint(0, CLASSES, (b,), generator=g))
        )
    return out


def built(
    factory: Callable[[], nn.Module], layout: str = "contiguous", **ekw: Any
) -> tuple[vmapens.Ensemble, list[nn.Module]]:
    """The ensemble and its members alone, both in `layout` ("weights": `.to(channels_last)`
    on both sides after building; "input": the batches channels-last only)."""
    ens = vmapens.Ensemble(factory, n=N, seed=0, **ekw)
    alone = factory_members([factory] * N, seed=0)
    if layout == "weights":
        ens.to(memory_format=CL)
        alone = [m.to(memory_format=CL) for m in alone]
    return ens, alone


def laid_out(x: Tensor, layout: str) -> Tensor:
    return x.to(memory_format=CL) if layout != "contiguous" else x


def train_both(
    ens: vmapens.Ensemble,
    alone: list[nn.Module],
    data: list[tuple[Tensor, Tensor]],
    layout: str,
    opt: str = "adam",
    replay_rng: bool = False,
    loss_tol: dict | None = None,
    **step_kw: Any,
) -> None:
    """`make_step` on the ensemble and the naive loop alone, batch by batch; losses compared."""
    if opt == "adam":
        stacked = vmapens.StackedAdam(ens, lr=0.05)
        opts = [torch.optim.Adam(m.parameters(), lr=0.05) for m in alone]
    else:
        stacked = vmapens.StackedSGD(ens, lr=0.05, momentum=0.9)
        opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in alone]
    step = vmapens.make_step(ens, CE, stacked, **step_kw)
    for x, y in data:
        x = laid_out(x, layout)
        rng = torch.get_rng_state()
        losses = step(x, y)
        want = []
        for m, o in zip(alone, opts, strict=True):
            if replay_rng:
                torch.set_rng_state(rng)
            o.zero_grad()
            loss = CE(m(x), y)
            loss.backward()
            if "clip_grad_norm" in step_kw:
                torch.nn.utils.clip_grad_norm_(m.parameters(), step_kw["clip_grad_norm"])
            o.step()
            want.append(loss.detach())
        torch.testing.assert_close(losses, torch.stack(want), **(loss_tol or ADAM64))


def eval_as_alone(
    ens: vmapens.Ensemble, alone: list[nn.Module], layout: str, tol: dict, hw: int = 8
) -> None:
    """Eval batches of 1 and 2 rows: `ens(x)` and `predict(reduce="mean", softmax=True)`."""
    ens.eval()
    for m in alone:
        m.eval()
    g = torch.Generator().manual_seed(9)
    for b in (1, 2):
        x = laid_out(torch.randn(b, 3, hw, hw, generator=g), layout)
        with torch.no_grad():
            want = torch.stack([m(x) for m in alone])
            torch.testing.assert_close(ens(x), want, **tol)
        mean = vmapens.predict(ens, x, reduce="mean", softmax=True)
        torch.testing.assert_close(mean, want.softmax(-1).mean(0), **tol)


# --------------------------------------------------------------------------- the tests

LAYOUTS = ["contiguous", "weights", "input"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("block", ["basic", "bottleneck"])
def test_resnet_trains_as_alone(block: str, layout: str) -> None:
    """Zero-init residual ResNets with SGD + momentum: every parameter to TOL64 (a zero
    gradient stays an exact zero under SGD), running statistics, gradients, then eval."""
    ens, alone = built(lambda: TinyResNet(block), layout)
    train_both(ens, alone, batches(3), layout, opt="sgd")
    assert_members_equal(ens, alone, grads=True)
    eval_as_alone(ens, alone, layout, TOL64)


@pytest.mark.parametrize(
    "name,factory,layout,ekw",
    [
        ("mobilenet", TinyMobileNet, "contiguous", {}),
        ("mobilenet", TinyMobileNet, "weights", {}),
        ("mobilenet", TinyMobileNet, "input", {"chunk_size": 2}),
        ("convnext", TinyConvNeXt, "contiguous", {}),
        ("convnext", TinyConvNeXt, "weights", {"chunk_size": 2}),
        ("convnext", TinyConvNeXt, "input", {"backend": "loop"}),
    ],
)
def test_mobilenet_se_and_convnext_train_as_alone(
    name: str, factory: Any, layout: str, ekw: dict
) -> None:
    ens, alone = built(factory, layout, **ekw)
    train_both(ens, alone, batches(3), layout, clip_grad_norm=0.3)
    assert_members_equal(ens, alone, grads=True, **ADAM64)
    eval_as_alone(ens, alone, layout, TOL64)


@pytest.mark.parametrize(
    "ekw", [{}, {"chunk_size": 2}, {"backend": "loop"}], ids=["vmap", "chunk", "loop"]
)
def test_convnext_drop_path_with_same_randomness_draws_as_alone(ekw: dict) -> None:
    """timm's `drop_path` (`x.new_empty(shape).bernoulli_(keep)`) with `randomness="same"`:
    each member draws its own row mask from the step's RNG state, as alone."""
    ens, alone = built(lambda: TinyConvNeXt(drop=0.4), "contiguous", randomness="same", **ekw)
    train_both(ens, alone, batches(3), "contiguous", replay_rng=True)
    assert_members_equal(ens, alone, grads=True, **ADAM64)


@pytest.mark.parametrize("layout,hw", [("contiguous", 8), ("weights", 7)])
@pytest.mark.parametrize(
    "mode,align", [("bilinear", False), ("bilinear", True), ("nearest", None), ("bicubic", True)]
)
def test_resampling_encoder_decoder_trains_as_alone(
    mode: str, align: Any, layout: str, hw: int
) -> None:
    """8x8 and 7x7 inputs (odd: `ceil_mode` pools a partial window, the unpool and the
    interpolations go back to 7x7), contiguous and channels-last."""
    ens, alone = built(lambda: TinyUNet(mode, align), layout)
    train_both(ens, alone, batches(2, hw=hw), layout)
    assert_members_equal(ens, alone, grads=True, **ADAM64)
    eval_as_alone(ens, alone, layout, TOL64, hw=hw)


# ---- AdamW param groups without decay on norms, biases and layer scale; mixup; clipping

LRS, WDS = [0.05, 0.02, 0.1], [0.1, 0.05, 0.0]


def no_decay_names(model: nn.Module) -> set[str]:
    """timm/torchvision's split, by module type and name: norms, biases, layer scale."""
    out = set()
    for mname, m in model.named_modules():
        for pname, _ in m.named_parameters(recurse=False):
            if isinstance(m, (nn.BatchNorm2d, nn.LayerNorm)) or pname in ("bias", "gamma"):
                out.add(f"{mname}.{pname}" if mname else pname)
    return out


def groups_alone(m: nn.Module, i: int) -> list[dict]:
    no = no_decay_names(m)
    named = list(m.named_parameters())
    return [
        {"params": [p for k, p in named if k not in no], "weight_decay": WDS[i]},
        {"params": [p for k, p in named if k in no], "weight_decay": 0.0},
    ]


def groups_stacked(ens: vmapens.Ensemble) -> list[dict]:
    """docs/optim.md: walk `ens.template` and take the stacked tensors by the same names."""
    no = no_decay_names(ens.template)
    names = [k for k, _ in ens.template.named_parameters()]
    return [
        {"params": [ens.get_parameter(k) for k in names if k not in no], "weight_decay": WDS},
        {"params": [ens.get_parameter(k) for k in names if k in no], "weight_decay": 0.0},
    ]


def mixed(data: list[tuple[Tensor, Tensor]], seed: int = 3) -> list[tuple[Tensor, Tensor]]:
    """Per-member mixup: member i's own lambda and permutation, soft targets `[n, B, C]`."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for x, y in data:
        soft = F.one_hot(y, CLASSES).to(x.dtype)
        lams = torch.rand(N, generator=g)
        perms = [torch.randperm(len(x), generator=g) for _ in range(N)]
        xs = torch.stack([lams[i] * x + (1 - lams[i]) * x[perms[i]] for i in range(N)])
        ys = torch.stack([lams[i] * soft + (1 - lams[i]) * soft[perms[i]] for i in range(N)])
        out.append((xs, ys))
    return out


@pytest.mark.parametrize("how", ["make_step", "hand_loop"])
@pytest.mark.parametrize("factory", [TinyResNet, TinyMobileNet, TinyConvNeXt])
def test_adamw_no_decay_groups_mixup_and_clipping_as_alone(factory: Any, how: str) -> None:
    ens, alone = built(factory)
    opt = vmapens.StackedAdam(groups_stacked(ens), lr=LRS, decoupled_weight_decay=True)
    opts = [torch.optim.AdamW(groups_alone(m, i), lr=LRS[i]) for i, m in enumerate(alone)]
    assert len(opt.param_groups[1]["params"]) == len(opts[0].param_groups[1]["params"]) > 0
    step = vmapens.make_step(ens, CE, opt, clip_grad_norm=0.5, in_dims=0)
    for xs, ys in mixed(batches(3)):
        if how == "make_step":
            step(xs, ys)
        else:
            opt.zero_grad()
            vmapens.per_member(CE, in_dims=(0, 0))(ens(xs, in_dims=0), ys).sum().backward()
            vmapens.optim.clip_grad_norm_(ens, 0.5)
            opt.step()
        for i, (m, o) in enumerate(zip(alone, opts, strict=True)):
            o.zero_grad()
            CE(m(xs[i]), ys[i]).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            o.step()
    assert_members_equal(ens, alone, grads=True, **ADAM64)
    stacked = [p for g in opt.param_groups for p in g["params"]]
    for i, o in enumerate(opts):
        plain = [p for g in o.param_groups for p in g["params"]]
        for p, q in zip(stacked, plain, strict=True):
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(opt.state[p][key][i], o.state[q][key], **ADAM64)


# ---- BatchNorm variants, frozen BatchNorm


def freeze_bn(m: nn.Module) -> None:
    if isinstance(m, nn.BatchNorm2d):
        m.eval()


NORMS = {
    "bn": nn.BatchNorm2d,
    "no_stats": functools.partial(nn.BatchNorm2d, track_running_stats=False),
    "cumulative": functools.partial(nn.BatchNorm2d, momentum=None),
    "sync": nn.SyncBatchNorm,
}


@pytest.mark.parametrize(
    "norm,freeze,layout,ekw",
    [
        ("bn", "ens.apply", "weights", {}),
        ("bn", "template.apply", "input", {}),
        ("bn", "ens.apply", "contiguous", {"chunk_size": 2}),
        ("no_stats", None, "weights", {}),
        ("no_stats", "ens.apply", "contiguous", {}),
        ("cumulative", None, "input", {"chunk_size": 2}),
        ("cumulative", "ens.apply", "weights", {}),
        ("sync", None, "weights", {}),
        ("sync", "template.apply", "contiguous", {"backend": "loop"}),
    ],
)
def test_batchnorm_variants_and_frozen_batchnorm_as_alone(
    norm: str, freeze: Any, layout: str, ekw: dict
) -> None:
    """`model.train()` then BatchNorm layers put in eval (the frozen-BN fine-tuning set-up);
    `track_running_stats=False`, `momentum=None`, `SyncBatchNorm` alone."""
    factory = lambda: TinyResNet("bottleneck", NORMS[norm])  # noqa: E731
    ens, alone = built(factory, layout, **ekw)
    ens.train()
    for m in alone:
        m.train()
    if freeze == "ens.apply":
        ens.apply(freeze_bn)
    elif freeze == "template.apply":
        ens.template.apply(freeze_bn)
    if freeze is not None:
        for m in alone:
            m.apply(freeze_bn)
    train_both(ens, alone, batches(3), layout, opt="sgd")
    assert_members_equal(ens, alone, grads=True)
    modes = {k: s.training for k, s in alone[0].named_modules()}
    assert {k: s.training for k, s in ens[0].named_modules()} == modes
    eval_as_alone(ens, alone, layout, TOL64)
    ens.train()  # as `model.train()` alone: every BatchNorm back in train mode
    assert all(s.training for s in ens[1].modules())


def test_frozen_batchnorm_affine_is_not_decayed_and_clipping_counts_only_trained() -> None:
    """BatchNorm frozen with its affine (`requires_grad_(False)`) but still in AdamW's group:
    torch skips a parameter without a gradient (no decay) and the clip counts the others."""

    def freeze(m: nn.Module) -> None:
        if isinstance(m, nn.BatchNorm2d):
            m.eval()
            m.requires_grad_(False)

    ens, alone = built(TinyResNet)
    ens.apply(freeze)
    for m in alone:
        m.apply(freeze)
    opt = vmapens.StackedAdam(
        ens.parameters(), lr=0.05, weight_decay=WDS, decoupled_weight_decay=True
    )
    opts = [
        torch.optim.AdamW(m.parameters(), lr=0.05, weight_decay=w)
        for m, w in zip(alone, WDS, strict=True)
    ]
    step = vmapens.make_step(ens, CE, opt, clip_grad_norm=0.5)
    for x, y in batches(3):
        step(x, y)
        for m, o in zip(alone, opts, strict=True):
            o.zero_grad()
            CE(m(x), y).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            o.step()
    assert_members_equal(ens, alone, grads=True)


def test_train_batch_of_one_value_per_channel_refused_as_alone_and_changes_nothing() -> None:
    """A batch of one 2x2 image reaches `layer2`'s BatchNorm as one value per channel: torch
    refuses it alone; the step and `ens(x)` refuse it in torch's words, nothing changed."""
    ens, alone = built(TinyResNet)
    x, y = torch.randn(1, 3, 2, 2), torch.tensor([1])
    with pytest.raises(ValueError, match="Expected more than 1 value per channel") as plain:
        copy.deepcopy(alone[0])(x)  # a copy: alone, the BatchNorms before it updated already
    opt = vmapens.StackedAdam(ens, lr=0.05)
    step = vmapens.make_step(ens, CE, opt)
    opt.prepare()
    before, rng = training_state(ens, opt), torch.get_rng_state()
    with pytest.raises(ValueError) as err:
        step(x, y)
    assert str(err.value) == str(plain.value)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        ens(x)
    for a, b in zip(before, training_state(ens, opt), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(rng, torch.get_rng_state())
    ens.eval()  # in eval the running statistics serve, alone and here
    alone[0].eval()
    with torch.no_grad():
        torch.testing.assert_close(ens(x)[0], alone[0](x), **TOL64)


# ---- channels-last conversions, member files, init through `apply`


def test_optimizer_built_before_channels_last_and_member_files(tmp_path: Any) -> None:
    """`StackedAdam` built, two steps, then `ens.to(memory_format=channels_last)` (torch keeps
    the Parameter objects, so the optimizer goes on), two more steps; then member files
    loaded into channels-last plain modules."""
    ens, alone = built(TinyResNet)
    opt = vmapens.StackedAdam(ens, lr=0.05)
    opts = [torch.optim.Adam(m.parameters(), lr=0.05) for m in alone]
    step = vmapens.make_step(ens, CE, opt)
    for k, (x, y) in enumerate(batches(4)):
        if k == 2:
            ens.to(memory_format=CL)
            for m in alone:
                m.to(memory_format=CL)
        step(x, y)
        for m, o in zip(alone, opts, strict=True):
            o.zero_grad()
            CE(m(x), y).backward()
            o.step()
    assert_members_equal(ens, alone, grads=True, **ADAM64)
    assert ens[2].layer1.conv1.weight.stride() == alone[2].layer1.conv1.weight.stride()
    vmapens.save_members(ens, tmp_path)
    for i, state in enumerate(vmapens.load_members(tmp_path)):
        m = TinyResNet().to(memory_format=CL)
        m.load_state_dict(state)
        for k, v in alone[i].state_dict().items():
            torch.testing.assert_close(m.state_dict()[k], v, **ADAM64, msg=k)


def kaiming(m: nn.Module) -> None:
    if isinstance(m, nn.Conv2d):
        nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")


def test_kaiming_init_through_apply_after_to_channels_last_draws_as_alone() -> None:
    """`normal_` fills a channels-last tensor in memory order: after `ens.to(channels_last)`
    each `ens[i]` is channels-last, so `ens.apply(init)` draws member i's values as alone."""
    ens, alone = built(TinyMobileNet, "weights")
    torch.manual_seed(5)
    ens.apply(kaiming)
    torch.manual_seed(5)
    for m in alone:
        m.apply(kaiming)
    assert_members_equal(ens, alone, rtol=0, atol=0)


# ---- fit: param groups, clipping, uneven batches, validation with frozen BatchNorm


def test_fit_with_no_decay_groups_clipping_and_frozen_batchnorm_validation() -> None:
    rows, batch, epochs, steps = 13, 5, 2, 3  # batches of 5, 5, 3
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(rows, 3, 8, 8, generator=g), torch.randint(0, CLASSES, (rows,), generator=g)
    xv, yv = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, CLASSES, (4,), generator=g)
    ens, alone = built(TinyResNet, "input")
    ens.apply(lambda m: m.eval() if isinstance(m, nn.BatchNorm2d) and m.num_features == 4 else None)
    history = vmapens.fit(
        ens, (x.to(memory_format=CL), y), CE, epochs=epochs, batch_size=batch, val_data=(xv, yv),
        optimizer=lambda e: vmapens.StackedAdam(groups_stacked(e), lr=LRS, decoupled_weight_decay=True),
        clip_grad_norm=0.5, seed=7, progress=False,
    )  # fmt: skip
    plan = batch_plan(rows, batch, epochs * steps, seed=7)
    for i, m in enumerate(alone):
        m.apply(
            lambda s: s.eval() if isinstance(s, nn.BatchNorm2d) and s.num_features == 4 else None
        )
        modes = {k: s.training for k, s in m.named_modules()}
        opt = torch.optim.AdamW(groups_alone(m, i), lr=LRS[i])
        best, best_state, vals = float("inf"), None, []
        for e in range(epochs):
            for r in plan[e * steps : (e + 1) * steps]:
                opt.zero_grad()
                CE(m(x[r].to(memory_format=CL)), y[r]).backward()
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
                opt.step()
            m.eval()
            with torch.no_grad():
                vals.append(float(CE(m(xv), yv)))
            for k, s in m.named_modules():
                s.training = modes[k]
            if vals[-1] < best:
                best, best_state = vals[-1], copy.deepcopy(m.state_dict())
        m.load_state_dict(best_state)
        torch.testing.assert_close(history.val_loss[:, i], torch.tensor(vals), **ADAM64)
    assert_members_equal(ens, alone, **ADAM64)
    assert {k: s.training for k, s in ens[0].named_modules()} == modes


# ---- float32


def test_float32_resnet_and_convnext_within_float32_round_off() -> None:
    """One float32 run, channels-last: 3 steps, members to float32 round-off (1e-5). The ResNet
    with SGD: under Adam its zero-true-gradient biases (bn1's, see the module docstring) take
    lr-sized steps of round-off sign in float32, 8e-5 apart in the loss after 3 steps, in
    plain PyTorch too (docs/semantics.md, "What differs")."""
    torch.set_default_dtype(torch.float32)
    tol = dict(rtol=1e-5, atol=1e-5)
    for factory, opt in ((TinyResNet, "sgd"), (TinyConvNeXt, "adam")):
        ens, alone = built(factory, "weights")
        assert all(p.dtype == torch.float32 for p in ens.parameters())
        data = [(x.float(), y) for x, y in batches(3)]
        train_both(ens, alone, data, "weights", opt=opt, loss_tol=tol)
        assert_members_equal(ens, alone, grads=True, **tol)
        eval_as_alone(ens, alone, "weights", tol)


# ---- members built channels-last by the factory (fixed in session 43)


class ConvDrop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.drop, self.fc = (
            nn.Conv2d(2, 4, 3, padding=1),
            nn.Dropout(0.5),
            nn.Linear(64, 3),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.drop(self.conv(x)).flatten(1))


@pytest.mark.parametrize("backend", ["vmap", "loop"])
def test_channels_last_factory_with_dropout_and_same_randomness_trains_as_alone(
    backend: str,
) -> None:
    def member() -> nn.Module:
        return ConvDrop().to(memory_format=CL)

    ens = vmapens.Ensemble(member, n=N, seed=0, randomness="same", backend=backend)
    alone = factory_members([member] * N, seed=0)
    x, y = torch.randn(2, 2, 4, 4), torch.randn(2, 3)
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedSGD(ens, lr=0.1))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in alone]
    for _ in range(2):
        rng = torch.get_rng_state()
        step(x, y)
        for m, o in zip(alone, opts, strict=True):
            torch.set_rng_state(rng)
            o.zero_grad()
            F.mse_loss(m(x), y).backward()
            o.step()
    assert_members_equal(ens, alone)


def test_channels_last_factory_kaiming_init_through_apply_draws_as_alone() -> None:
    def member() -> nn.Module:
        return TinyMobileNet().to(memory_format=CL)

    ens = vmapens.Ensemble(member, n=N, seed=0)
    alone = factory_members([member] * N, seed=0)
    torch.manual_seed(5)
    ens.apply(kaiming)
    torch.manual_seed(5)
    for m in alone:
        m.apply(kaiming)
    assert_members_equal(ens, alone, rtol=0, atol=0)


def test_channels_last_factory_then_to_channels_last_is_the_way_out() -> None:
    """The documented way out (docs/semantics.md): `ens.to(memory_format=channels_last)`
    after building; then the same Dropout run trains as alone."""

    def member() -> nn.Module:
        return ConvDrop().to(memory_format=CL)

    ens = vmapens.Ensemble(member, n=N, seed=0, randomness="same")
    ens.to(memory_format=CL)
    alone = factory_members([member] * N, seed=0)
    x, y = torch.randn(2, 2, 4, 4), torch.randn(2, 3)
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedSGD(ens, lr=0.1))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in alone]
    for _ in range(2):
        rng = torch.get_rng_state()
        step(x, y)
        for m, o in zip(alone, opts, strict=True):
            torch.set_rng_state(rng)
            o.zero_grad()
            F.mse_loss(m(x), y).backward()
            o.step()
    assert_members_equal(ens, alone)
