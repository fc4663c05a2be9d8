"""User journey: convolution, pooling and resampling layers inside a member's forward (float64).

A researcher puts torch's spatial layers in their members and trusts `torch.func.vmap`'s
batching rules with them: every member must compute, and train, as it does alone. Four
composite members, each run with `backend="vmap"`, `chunk_size=2` and `backend="loop"`:

- convolutions: Conv1d/2d/3d with `padding_mode` reflect/circular/replicate, `padding="same"`
  with even kernels and dilation, depthwise and `groups=2`, stride larger than the kernel;
  ConvTranspose1d/2d with `output_padding`, `groups`, `dilation` and an explicit
  `output_size`; `F.conv2d` / `F.conv_transpose1d` with a weight computed per member in the
  forward (a hypernetwork) and with a shared weight made in the forward (unbatched);
- pooling: MaxPool2d(return_indices) + MaxUnpool2d (also with `output_size`, and with the
  indices of the shared input), `ceil_mode` and dilation, AvgPool with `count_include_pad=False`
  and `divisor_override`, LPPool1d/2d, AdaptiveAvg/MaxPool to sizes that do not divide (max with
  `return_indices`), MaxPool3d/AvgPool3d;
- resampling: `F.interpolate` nearest, nearest-exact, (bi/tri)linear and bicubic with
  `align_corners` True and False, `antialias=True`, `scale_factor` with
  `recompute_scale_factor`, area; a learned position table resized by `F.interpolate`;
  PixelShuffle/Unshuffle, ChannelShuffle, `F.unfold`/`F.fold` with overlapping patches;
- a spatial transformer: per-member theta, `F.affine_grid` + `F.grid_sample` in every mode
  (bilinear, nearest, bicubic) and padding mode (zeros, border, reflection), both
  `align_corners`, 2-D and 3-D.

Each is checked for: `ens(x)` in train and eval mode, the gradients of `ens(x)`, and the
parameters after 2 `make_step` steps with `StackedAdam` (one lr per member). FractionalMaxPool
draws its pooling regions from torch's RNG: with `randomness="same"` each member draws what it
draws alone from the step's RNG state (docs/semantics.md, "Randomness in the forward pass");
`"error"` refuses it; `"different"` gives the members their own regions.

A width sweep (`Ensemble.from_factories`, docs/semantics.md "Members of different sizes") of a
CBAM-style channel max pool (`conv(x).amax(1)`) is a strict xfail: a padded channel's output is
0, and where all of a narrower member's own channels are negative the max picks that 0; the
first step's self-check sees it only if it happens on the first batch for the first member of
the size (silent, 0.02 off after 3 steps, with either backend). The way out, a per-member
mask of the member's own channels (a bool buffer, padded with False) and `-inf` elsewhere,
trains as alone.

The truth: each member built from the documented seed (tests/truth.py `factory_members`) as a
plain module, trained alone with `torch.optim.Adam`. float64: the batched kernels sum in other
orders, so results agree to round-off (TOL64), not bit for bit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from truth import TOL64, factory_members

import vmapens

pytestmark = [
    pytest.mark.usefixtures("float64_default"),
    # affine_grid, max_unpool1d/3d and fractional_max_pool3d have no batching rule: torch's
    # per-member fallback runs them, with this warning (docs/semantics.md)
    pytest.mark.filterwarnings("ignore:There is a performance drop"),
    # torch's own warning for padding="same" with an even kernel, alone as in the ensemble
    pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel"),
]

N = 3
LRS = [1e-2, 2e-2, 3e-2]
BACKENDS = [{}, {"chunk_size": 2}, {"backend": "loop"}]
IDS = ["vmap", "chunk2", "loop"]


def _flat(*outs: Tensor) -> Tensor:
    """Every branch's output, flattened per sample and side by side: each one is compared."""
    return torch.cat([o.flatten(1) for o in outs], 1)


# --- members ----------------------------------------------------------------------------------


class Convs(nn.Module):
    """x [B, 2, 6, 5] -> every convolution flavour, side by side."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.ModuleList(
            nn.Conv1d(2, 4, 3, padding=2, dilation=2, padding_mode=m)
            for m in ("reflect", "circular", "replicate")
        )
        self.c2 = nn.ModuleList(
            nn.Conv2d(2, 4, (3, 2), padding=1, stride=(2, 1), padding_mode=m)
            for m in ("reflect", "circular", "replicate")
        )
        self.c3 = nn.Conv3d(2, 2, 3, padding=1, padding_mode="circular")
        self.same = nn.ModuleList(
            [
                nn.Conv2d(2, 4, 4, padding="same", dilation=2, padding_mode="reflect"),
                nn.Conv2d(2, 2, (2, 4), padding="same", dilation=(3, 1)),
                nn.Conv1d(2, 2, 4, padding="same", padding_mode="replicate"),
                nn.Conv3d(2, 2, 2, padding="same", dilation=2, padding_mode="circular"),
            ]
        )
        self.depthwise = nn.Conv2d(2, 4, 3, padding=1, groups=2)
        self.grouped = nn.Conv1d(2, 4, 3, groups=2, stride=4)
        self.stride = nn.Conv2d(2, 3, 2, stride=3)
        self.up1 = nn.ConvTranspose1d(
            2, 4, 3, stride=3, padding=1, output_padding=2, groups=2, dilation=2
        )
        self.up2 = nn.ConvTranspose2d(
            2, 2, (3, 2), stride=(2, 3), output_padding=(1, 2), groups=2, dilation=(1, 2)
        )
        self.up_size = nn.ConvTranspose2d(2, 2, 3, stride=2, padding=1, groups=2)
        self.hyper = nn.Linear(3, 4 * 2 * 3 * 3)  # a hypernetwork: the conv weight per member
        self.z = nn.Parameter(torch.randn(3))
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(2, 1, 1))

    def forward(self, x: Tensor) -> Tensor:
        line, vol = x.flatten(2), x.unsqueeze(2).expand(-1, -1, 2, -1, -1)
        outs = [c(line) for c in self.c1] + [c(x) for c in self.c2] + [self.c3(vol)]
        same2, same2b, same1, same3 = self.same
        outs += [same2(x), same2b(x), same1(line), same3(vol)]
        outs += [self.depthwise(x), self.grouped(line), self.stride(x)]
        outs += [self.up1(line[..., :5]), self.up2(x)]
        outs.append(self.up_size(x, output_size=[12, 10]))  # 11 x 9 without it
        w = self.hyper(self.z).view(4, 2, 3, 3)
        outs.append(F.conv2d(x, w, padding=1, groups=1))
        outs.append(F.conv2d(x, w.view(4, 2, 3, 3)[:, :1], stride=2, groups=2))
        shared = torch.linspace(-1, 1, 2 * 2 * 3).view(2, 2, 3)  # made here: not per member
        h = x * self.scale
        outs.append(F.conv_transpose1d(h.flatten(2), shared, stride=2, groups=2, output_padding=1))
        outs.append(F.conv2d(h, shared.view(2, 2, 3, 1).expand(2, 2, 3, 2), dilation=(1, 2)))
        return _flat(*outs)


class Pools(nn.Module):
    """x [B, 2, 7, 6] -> a 1x1 conv -> every pooling flavour, side by side."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 1)
        self.vol = nn.Conv3d(2, 2, 1)
        self.pool = nn.MaxPool2d(2, return_indices=True)
        self.unpool = nn.MaxUnpool2d(2)
        self.pool3 = nn.MaxPool2d(3, 2, 1, return_indices=True)
        self.unpool3 = nn.MaxUnpool2d(3, 2, 1)
        self.ceil = nn.MaxPool2d(3, 2, 1, dilation=2, ceil_mode=True)
        self.ceil1 = nn.MaxPool1d(2, 2, ceil_mode=True)
        self.ceil3 = nn.MaxPool3d(2, 2, ceil_mode=True)
        self.avg_nopad = nn.AvgPool2d(3, 2, 1, ceil_mode=True, count_include_pad=False)
        self.avg_div = nn.AvgPool2d(2, 3, 1, ceil_mode=True, divisor_override=3)
        self.avg1 = nn.AvgPool1d(4, 3, 2, ceil_mode=True, count_include_pad=False)
        self.avg3 = nn.AvgPool3d(2, 2, 1, ceil_mode=True, divisor_override=5)
        self.lp2 = nn.LPPool2d(2, (3, 2), stride=2, ceil_mode=True)
        self.lp1 = nn.LPPool1d(3, 3, stride=2)
        self.aavg = nn.AdaptiveAvgPool2d((4, 5))
        self.amax = nn.AdaptiveMaxPool2d((4, None))
        self.amax_idx = nn.AdaptiveMaxPool2d((4, 4), return_indices=True)
        self.aavg1 = nn.AdaptiveAvgPool1d(4)
        self.amax3 = nn.AdaptiveMaxPool3d((3, 3, 4))

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv(x)
        r = torch.relu(h)  # ReLU before a max pool: ties at 0 in a window
        p, i = self.pool(r)
        p3, i3 = self.pool3(h)
        _, shared_i = F.max_pool2d(x, 2, return_indices=True)  # indices of the shared input
        am, ai = self.amax_idx(h)
        vol = self.vol(torch.stack([x, x.flip(-1)], 2))
        soft = F.softplus(h)  # LPPool of p=3 takes a cube root: positive inputs
        outs = [self.unpool(p, i), self.unpool3(p3, i3, output_size=h.shape[-2:])]
        outs += [F.max_unpool2d(F.avg_pool2d(h[:, :2], 2), shared_i, 2, output_size=(7, 6))]
        outs += [self.ceil(h), self.ceil1(h.flatten(2)), self.ceil3(vol)]
        outs += [self.avg_nopad(h), self.avg_div(h), self.avg1(h.flatten(2)), self.avg3(vol)]
        outs += [self.lp2(h), self.lp1(soft.flatten(2))]
        outs += [self.aavg(h), self.amax(h), am, ai.to(am.dtype)]
        outs += [self.aavg1(h.flatten(2)), self.amax3(vol)]
        return _flat(*outs)


class Resample(nn.Module):
    """x [B, 2, 5, 4] -> interpolation, shuffles and patch folds, side by side."""

    MODES: list[dict[str, Any]] = [
        dict(scale_factor=(1.5, 0.75), mode="nearest"),
        dict(size=(3, 7), mode="nearest-exact"),
        dict(scale_factor=1.3, mode="bilinear", align_corners=True),
        dict(scale_factor=1.3, mode="bilinear", align_corners=False, recompute_scale_factor=True),
        dict(size=(7, 3), mode="bicubic", align_corners=True),
        dict(scale_factor=(0.5, 1.6), mode="bicubic", align_corners=False),
        dict(size=(3, 2), mode="bilinear", antialias=True),
        dict(size=(2, 3), mode="bicubic", antialias=True, align_corners=True),
        dict(scale_factor=0.6, mode="bicubic", antialias=True, recompute_scale_factor=True),
        dict(size=(3, 3), mode="area"),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 8, 1)
        self.pos = nn.Parameter(torch.randn(1, 2, 3, 3))  # a ViT-style position table
        self.shuffle, self.unshuffle = nn.PixelShuffle(2), nn.PixelUnshuffle(2)
        self.channels = nn.ChannelShuffle(2)
        self.patch = nn.Linear(2 * 6, 2 * 6)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv(x)
        a = h[:, :2]
        outs = [F.interpolate(a, **kw) for kw in self.MODES]
        line, vol = a.flatten(2), a.unsqueeze(2).expand(-1, -1, 3, -1, -1)
        outs += [F.interpolate(line, scale_factor=1.7, mode="nearest-exact")]
        outs += [F.interpolate(line, scale_factor=0.6, mode="linear", recompute_scale_factor=True)]
        outs += [F.interpolate(line, size=7, mode="linear", align_corners=True)]
        outs += [F.interpolate(vol, size=(4, 3, 5), mode="trilinear", align_corners=True)]
        outs += [F.interpolate(vol, scale_factor=(1.5, 0.6, 2.0), mode="nearest-exact")]
        for kw in (dict(mode="bicubic", align_corners=False), dict(mode="nearest-exact")):
            outs.append(x + F.interpolate(self.pos, size=x.shape[-2:], **kw))
        s = self.shuffle(h)  # [B, 2, 10, 8]
        outs += [s, self.channels(self.unshuffle(s)) * h]
        outs.append(self.shuffle(h.unsqueeze(0)).squeeze(0))  # an extra leading dim
        patches = F.unfold(a, (3, 2), dilation=(1, 2), padding=1, stride=(2, 1))
        patches = self.patch(patches.transpose(1, 2)).transpose(1, 2)
        outs.append(F.fold(patches, (5, 4), (3, 2), dilation=(1, 2), padding=1, stride=(2, 1)))
        return _flat(*outs)


class Transformer(nn.Module):
    """A spatial transformer: theta per member and per image, every grid_sample setting."""

    SETTINGS = [
        (m, p, ac)
        for m in ("bilinear", "nearest", "bicubic")
        for p in ("zeros", "border", "reflection")
        for ac in (True, False)
    ]

    def __init__(self) -> None:
        super().__init__()
        self.loc2, self.loc3 = nn.Linear(2, 6), nn.Linear(2, 12)
        with torch.no_grad():  # near the identity, so the grids reach in and out of the image
            for loc, d in ((self.loc2, 2), (self.loc3, 3)):
                loc.weight.mul_(0.3)
                loc.bias.copy_(
                    1.3 * torch.eye(d, d + 1).flatten() + 0.1 * torch.randn(loc.out_features)
                )
        self.head = nn.Conv2d(2, 2, 1)  # gives nearest sampling's path a trained parameter

    def forward(self, x: Tensor) -> Tensor:
        feat = x.flatten(2).mean(-1)  # [B, 2]
        theta2 = self.loc2(feat).view(-1, 2, 3)
        theta3 = self.loc3(feat).view(-1, 3, 4)
        vol = torch.stack([x, x.transpose(-1, -2)[..., :4, :], -x], 2)  # [B, 2, 3, 4, 4]
        outs = []
        for mode, pad, ac in self.SETTINGS:
            grid = F.affine_grid(theta2, [x.shape[0], 2, 5, 3], align_corners=ac)
            out = F.grid_sample(x, grid, mode=mode, padding_mode=pad, align_corners=ac)
            outs.append(self.head(out))
            if mode != "bicubic":  # 5-D grid_sample has no bicubic
                grid3 = F.affine_grid(theta3, [x.shape[0], 2, 2, 3, 3], align_corners=ac)
                outs.append(
                    F.grid_sample(vol, grid3, mode=mode, padding_mode=pad, align_corners=ac)
                )
        return _flat(*outs)


FAMILIES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "convs": (Convs, (2, 6, 5)),
    "pools": (Pools, (2, 7, 6)),
    "resample": (Resample, (2, 5, 4)),
    "transformer": (Transformer, (2, 4, 4)),
}


# --- the checks -------------------------------------------------------------------------------


def _alone(factory: Callable[[], nn.Module]) -> list[nn.Module]:
    """Member i as `Ensemble(factory, n=N, seed=0)` documents it: built after its own seed."""
    return factory_members([factory] * N, seed=0)


def _assert_members(ens: vmapens.Ensemble, alone: list[nn.Module]) -> None:
    for i, m in enumerate(alone):
        got = ens[i].state_dict()
        for name, want in m.state_dict().items():
            torch.testing.assert_close(got[name], want, **TOL64, msg=f"member {i} {name}")


def _check_family(
    factory: Callable[[], nn.Module], shape: tuple[int, ...], kw: dict[str, Any]
) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, *shape, generator=g)
    ens = vmapens.Ensemble(factory, n=N, seed=0, **kw)
    alone = _alone(factory)
    _assert_members(ens, alone)  # the same start
    for train in (True, False):
        ens.train(train)
        out = ens(x)
        for i, m in enumerate(alone):
            torch.testing.assert_close(out[i], m.train(train)(x), **TOL64, msg=f"member {i}")
    ens.train()
    (ens(x) ** 2).sum().backward()
    for i, m in enumerate(alone):
        m.train().zero_grad()
        (m(x) ** 2).sum().backward()
        own = dict(m.named_parameters())
        for name, p in ens.named_parameters():
            assert p.grad is not None and own[name].grad is not None, name
            torch.testing.assert_close(p.grad[i], own[name].grad, **TOL64, msg=f"{i} {name}")
        m.zero_grad()
    ens.zero_grad()
    y = torch.randn(out.shape[1:], generator=g)
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedAdam(ens, lr=LRS))
    opts = [torch.optim.Adam(m.parameters(), lr=LRS[i]) for i, m in enumerate(alone)]
    for _ in range(2):
        step(x, y)
        for m, opt in zip(alone, opts, strict=True):
            opt.zero_grad()
            F.mse_loss(m(x), y).backward()
            opt.step()
    _assert_members(ens, alone)


@pytest.mark.parametrize("kw", BACKENDS, ids=IDS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_spatial_layers_compute_and_train_as_each_member_alone(family: str, kw: dict) -> None:
    """Outputs (train and eval), gradients and 2 Adam steps of every member equal the member
    alone, for each family of layers, under vmap, in chunks of 2 and with the loop."""
    factory, shape = FAMILIES[family]
    _check_family(factory, shape, kw)


# --- FractionalMaxPool: pooling regions drawn from torch's RNG ----------------------------------


class Fractional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.vol = nn.Conv2d(2, 2, 1), nn.Conv3d(2, 2, 1)
        self.fmp = nn.FractionalMaxPool2d(2, output_ratio=0.6, return_indices=True)
        self.fmp_size = nn.FractionalMaxPool2d((3, 2), output_size=(4, 3))
        self.fmp3 = nn.FractionalMaxPool3d(2, output_size=(2, 3, 2))
        self.register_buffer("samples", torch.rand(2, 2, 2))  # given regions, per member

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv(x)
        p, i = self.fmp(h)
        vol = self.vol(torch.stack([x, x.flip(-2), -x, x.flip(-1)], 2))
        given = F.fractional_max_pool2d(h, 2, output_size=(3, 2), _random_samples=self.samples)
        return _flat(F.max_unpool2d(p, i, 2, output_size=h.shape[-2:]), self.fmp_size(h),
                     self.fmp3(vol), given)  # fmt: skip


@pytest.mark.parametrize("kw", BACKENDS, ids=IDS)
def test_fractional_max_pool_same_randomness_draws_what_each_member_draws_alone(kw) -> None:
    """randomness="same": each member's regions are those it draws alone from the RNG state
    the call (and each step) started from, and the RNG ends where alone's does."""
    x = torch.randn(2, 2, 7, 6)
    ens = vmapens.Ensemble(Fractional, n=N, seed=0, randomness="same", **kw)
    alone = _alone(Fractional)
    start = torch.get_rng_state()
    out = ens(x)
    end = torch.get_rng_state()
    for i, m in enumerate(alone):
        torch.set_rng_state(start)
        torch.testing.assert_close(out[i], m(x), **TOL64, msg=f"member {i}")
        assert torch.equal(torch.get_rng_state(), end)
    y = torch.randn(out.shape[1:])
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedAdam(ens, lr=LRS))
    states = []
    for _ in range(2):
        states.append(torch.get_rng_state())
        step(x, y)
    for i, m in enumerate(alone):
        opt = torch.optim.Adam(m.parameters(), lr=LRS[i])
        for state in states:
            torch.set_rng_state(state)
            opt.zero_grad()
            F.mse_loss(m(x), y).backward()
            opt.step()
    _assert_members(ens, alone)


@pytest.mark.parametrize("kw", BACKENDS, ids=IDS)
def test_fractional_max_pool_different_randomness_gives_members_their_own_regions(kw) -> None:
    ens = vmapens.Ensemble(lambda: nn.FractionalMaxPool2d(2, output_ratio=0.5), n=N, **kw)
    x = torch.randn(2, 3, 7, 6)  # 8 x 8 to 4 x 4 with kernel 2 has one set of regions only
    out = ens(x)
    assert out.shape == (N, 2, 3, 3, 3)
    assert not torch.equal(out[0], out[1]) and not torch.equal(out[1], out[2])


@pytest.mark.parametrize("backend", ["vmap", "loop"])
def test_fractional_max_pool_error_randomness_refuses_and_changes_nothing(backend: str) -> None:
    ens = vmapens.Ensemble(Fractional, n=N, seed=0, randomness="error", backend=backend)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedAdam(ens))
    with pytest.raises(RuntimeError, match="randomness='error'"):
        step(torch.randn(2, 2, 7, 6), torch.randn(2, 144))
    for name, value in ens.state_dict().items():
        assert torch.equal(value, before[name]), name


# --- a width sweep with a channel max pool ------------------------------------------------------


class ChannelMax(nn.Module):
    """A CBAM-style channel max pool: conv -> max over the channels -> linear head."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, channels, 3, padding=1, bias=False)
        nn.init.uniform_(self.conv.weight, 0.0, 1.0)  # intensity filters
        self.head = nn.Linear(16, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.conv(x).amax(1).flatten(1))


def _width_sweep(member: Callable[[int], nn.Module], kw: dict[str, Any]) -> None:
    """Widths (2, 2, 3). Batch 1 is images in [0, 1) (every response positive: the self-check
    passes), batches 2-3 are images in [-1, 1): where both of a width-2 member's responses are
    negative, a max over the padded storage reads the padded channel's 0. Each member must
    end as alone, or the step must refuse naming the member's class."""
    factories = [functools.partial(member, c) for c in (2, 2, 3)]
    g = torch.Generator().manual_seed(0)
    batches = [
        (torch.rand(4, 1, 4, 4, generator=g) * scale - shift, torch.randn(4, 2, generator=g))
        for scale, shift in ((1, 0), (2, 1), (2, 1))
    ]
    ens = vmapens.Ensemble.from_factories(factories, seed=0, **kw)
    alone = factory_members(factories, seed=0)
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedAdam(ens, lr=1e-2))
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in alone]
    try:
        for x, y in batches:
            step(x, y)
            for m, opt in zip(alone, opts, strict=True):
                opt.zero_grad()
                F.mse_loss(m(x), y).backward()
                opt.step()
    except RuntimeError as err:  # a refusal is a pass
        assert member.__name__ in str(err)
        return
    _assert_members(ens, alone)


@pytest.mark.xfail(
    strict=True,
    reason="a padded channel's 0 wins a max over the channels where a narrower member's own "
    "channels are all negative; the first step's self-check sees it only on the first batch",
)
@pytest.mark.parametrize("kw", [{}, {"backend": "loop"}], ids=["vmap", "loop"])
def test_width_sweep_channel_max_pool_trains_as_alone_or_is_refused(kw: dict) -> None:
    _width_sweep(ChannelMax, kw)  # members 0 and 1: 0.019 and 0.025 off after 3 steps


class MaskedChannelMax(ChannelMax):
    """The way out: a per-member mask of its own channels (padded with False) and -inf."""

    def __init__(self, channels: int) -> None:
        super().__init__(channels)
        self.register_buffer("own", torch.ones(channels, 1, 1, dtype=torch.bool))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.where(self.own, self.conv(x), float("-inf"))
        return self.head(h.amax(1).flatten(1))


@pytest.mark.parametrize("kw", [{}, {"backend": "loop"}], ids=["vmap", "loop"])
def test_width_sweep_channel_max_pool_over_own_channels_trains_as_alone(kw: dict) -> None:
    _width_sweep(MaskedChannelMax, kw)
