"""User journey: small image-to-image ensembles with spatial ops (float64, eager).

A researcher trains three tiny families with `make_step` / `fit` / `predict`: a spatial
transformer (a localisation net predicts theta, `F.affine_grid` + `F.grid_sample`, bilinear and
nearest, padding "border"/"zeros", then a classifier; also a per-member *learned* sampling
grid), a neural cellular automaton (iterated 3x3 depthwise sobel perception with a fixed
buffer, a 1x1 update net, a stochastic update mask `torch.rand(...) < 0.5`, an alive mask from
`F.max_pool2d` of the alpha channel, 8 iterations per forward) and a super-resolution net
(`nn.ReflectionPad2d`, `nn.PixelShuffle`/`PixelUnshuffle`, `F.interpolate` bilinear both
`align_corners`, `scale_factor` and `size`, `antialias=True`, `nn.Upsample`, `nn.Fold`/`Unfold`
patch ops), with channels-last inputs and `ens.to(memory_format=torch.channels_last)`. Batches of
several sizes (1 included), a shuffling DataLoader to `fit`, `predict` over a DataLoader.

The truth: each member a plain module trained alone with `torch.optim.Adam` on the same
batches; for the automaton under `randomness="same"` each member alone replays the RNG state
the step started from (docs/semantics.md, "Randomness in the forward pass": each member draws
what it draws alone, eager, with `chunk_size` and `backend="loop"`).

Documented refusals checked: `affine_grid` has no batching rule, so torch's fallback warns
("There is a performance drop"), and under warnings as errors that warning is the first step's
refusal naming backend='loop', with nothing changed (semantics.md, "What vmap cannot batch");
`randomness="error"` refuses the automaton's draws; `ens.to(memory_format=channels_last)` on a
`Conv3d` member is refused as torch refuses it alone, nothing changed.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import vmapens

pytestmark = [
    pytest.mark.usefixtures("float64_default"),
    # affine_grid's batching falls back to a per-member loop, with torch's performance warning
    pytest.mark.filterwarnings("ignore:There is a performance drop"),
]

N = 3
LRS = [1e-2, 2e-2, 3e-2]
TOL = {"rtol": 1e-9, "atol": 1e-10}
CL = torch.channels_last
BACKENDS = [{}, {"chunk_size": 2}, {"backend": "loop"}]
IDS = ["vmap", "chunk2", "loop"]
C = 4  # automaton channels: RGB + alpha


class STN(nn.Module):
    """Localisation net -> theta -> affine_grid + grid_sample -> conv classifier."""

    def __init__(self, mode: str = "bilinear", pad: str = "border") -> None:
        super().__init__()
        self.mode, self.pad = mode, pad
        self.loc = nn.Sequential(nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(4, 6))
        with torch.no_grad():  # start near the identity transform, as STN papers do
            self.loc[-1].weight.mul_(0.1)
            self.loc[-1].bias.copy_(torch.tensor([1.0, 0, 0, 0, 1, 0]) + 0.05 * torch.randn(6))
        self.conv = nn.Conv2d(1, 3, 3, padding=1)
        self.head = nn.Linear(3 * 16, 4)

    def forward(self, x: Tensor) -> Tensor:
        theta = self.loc(x).view(-1, 2, 3)
        grid = F.affine_grid(theta, list(x.size()), align_corners=False)
        x = F.grid_sample(x, grid, mode=self.mode, padding_mode=self.pad, align_corners=False)
        return self.head(torch.relu(self.conv(x)).flatten(1))


class Warp(nn.Module):
    """A learned sampling grid, one per member, then a 1x1 conv."""

    def __init__(self, mode: str, pad: str) -> None:
        super().__init__()
        self.mode, self.pad = mode, pad
        base = F.affine_grid(torch.eye(2, 3)[None], [1, 1, 4, 4], align_corners=True)
        self.grid = nn.Parameter(base + 0.05 * torch.randn_like(base))
        self.mix = nn.Conv2d(2, 2, 1)

    def forward(self, x: Tensor) -> Tensor:
        grid = self.grid.expand(x.shape[0], -1, -1, -1)
        return self.mix(
            F.grid_sample(x, grid, mode=self.mode, padding_mode=self.pad, align_corners=True)
        )


class NCA(nn.Module):
    """Growing neural cellular automaton (Mordvintsev et al.), tiny."""

    def __init__(self, steps: int = 8, per_channel: bool = False) -> None:
        super().__init__()
        self.steps, self.per_channel = steps, per_channel
        ident = torch.tensor([[0.0, 0, 0], [0, 1, 0], [0, 0, 0]])
        sobel = torch.tensor([[-1.0, 0, 1], [-2, 0, 2], [-1, 0, 1]]) / 8
        kernel = torch.stack([ident, sobel, sobel.T]).repeat(C, 1, 1)[:, None]  # [3C, 1, 3, 3]
        self.register_buffer("kernel", kernel)
        self.update = nn.Sequential(nn.Conv2d(3 * C, 8, 1), nn.ReLU(), nn.Conv2d(8, C, 1))

    def alive(self, x: Tensor) -> Tensor:
        return F.max_pool2d(x[:, 3:4], 3, stride=1, padding=1) > 0.1

    def forward(self, x: Tensor) -> Tensor:
        for _ in range(self.steps):
            pre = self.alive(x)
            dx = self.update(F.conv2d(x, self.kernel, padding=1, groups=C))
            if self.per_channel:  # one coin per cell and channel, drawn into dx's layout
                fire = torch.empty_like(dx).bernoulli_(0.5)
            else:
                fire = (torch.rand(x[:, :1].shape) < 0.5).to(x.dtype)
            x = x + dx * fire
            x = x * (pre & self.alive(x)).to(x.dtype)
        return x


class SuperRes(nn.Module):
    """[B, 3, 4, 4] -> [B, 3, 8, 8] through every up/down-sampling op of the journey."""

    def __init__(self) -> None:
        super().__init__()
        self.pad = nn.ReflectionPad2d(1)
        self.body = nn.Conv2d(3, 8, 3)
        self.to_sub = nn.Conv2d(2, 3 * 4, 3, padding=1)
        self.shuffle, self.unshuffle = nn.PixelShuffle(2), nn.PixelUnshuffle(2)
        self.from_sub = nn.Conv2d(3 * 4, 3, 1)
        self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
        self.unfold, self.fold = nn.Unfold(2, stride=2), nn.Fold((8, 8), 2, stride=2)
        self.patch = nn.Linear(12, 12)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.body(self.pad(x)))  # [B, 8, 4, 4]
        a = self.shuffle(self.to_sub(h[:, :2]))  # sub-pixel conv
        b = F.interpolate(h[:, 2:5], scale_factor=2, mode="bilinear", align_corners=True)
        c = F.interpolate(h[:, 5:8], size=(8, 8), mode="bilinear", align_corners=False)
        big = F.interpolate(h[:, :3], size=(16, 16), mode="bicubic", align_corners=False)
        d = F.interpolate(big, size=(8, 8), mode="bilinear", antialias=True, align_corners=False)
        e = self.from_sub(self.unshuffle(big))  # [B, 12, 8, 8] -> 3
        f = self.up(h[:, 3:6])
        patches = self.unfold(F.interpolate(h[:, :3], scale_factor=2, mode="nearest"))
        g = self.fold(self.patch(patches.transpose(1, 2)).transpose(1, 2))
        return a + b + c + d + e + f + g


def train_alone(
    models: list[nn.Module],
    batches: list[tuple[Tensor, Tensor]],
    loss_fn: Callable[..., Tensor],
    rng_states: list[Tensor] | None = None,
) -> Tensor:
    """Each model with its own torch.optim.Adam (lr LRS[i]); with ``rng_states``, every member
    starts batch k from ``rng_states[k]`` (what one step of a "same" ensemble starts from)."""
    losses = []
    for i, m in enumerate(models):
        opt = torch.optim.Adam(m.parameters(), lr=LRS[i])
        row = []
        for k, (x, y) in enumerate(batches):
            if rng_states is not None:
                torch.set_rng_state(rng_states[k])
            opt.zero_grad()
            loss = loss_fn(m(x), y)
            loss.backward()
            opt.step()
            row.append(loss.detach())
        losses.append(torch.stack(row))
    return torch.stack(losses, 1)  # [steps, n]


def assert_members(ens: vmapens.Ensemble, models: list[nn.Module], **tol: Any) -> None:
    for i, m in enumerate(models):
        got = ens[i].state_dict()
        for name, want in m.state_dict().items():
            torch.testing.assert_close(got[name], want, **(tol or TOL), msg=f"member {i} {name}")


def step_all(
    ens: vmapens.Ensemble, loss_fn: Callable[..., Tensor], batches: list, record: bool = False
) -> tuple[Tensor, list[Tensor]]:
    step = vmapens.make_step(ens, loss_fn, vmapens.StackedAdam(ens, lr=LRS))
    losses, states = [], []
    for x, y in batches:
        states.append(torch.get_rng_state())
        losses.append(step(x, y))
    return torch.stack(losses), states


def image_batches(sizes: list[int], shape: tuple[int, ...], target: Callable, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, *shape, generator=g), target(b, g)) for b in sizes]


# --- spatial transformer ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "mode, pad, kw",
    [("bilinear", "border", {}), ("nearest", "zeros", {"chunk_size": 2})],
    ids=["bilinear-border-vmap", "nearest-zeros-chunk2"],
)  # fmt: skip
def test_spatial_transformer_matches_alone_on_batches_of_1_and_3(mode, pad, kw) -> None:
    """theta from the localisation net, affine_grid + grid_sample, CE classifier: every
    member's losses and weights as alone, with batches of 1 and 3 images (the loop backend's
    turns are the learned-grid test's)."""
    batches = image_batches([1, 3], (1, 4, 4), lambda b, g: torch.randint(4, (b,), generator=g))
    ens = vmapens.Ensemble(lambda: STN(mode, pad), n=N, seed=0, **kw)
    models = ens.unstack()
    losses, _ = step_all(ens, F.cross_entropy, batches)
    torch.testing.assert_close(losses, train_alone(models, batches, F.cross_entropy), **TOL)
    assert_members(ens, models)
    x = torch.randn(1, 1, 4, 4)  # one image, eval mode
    ens.eval()
    out = ens(x)
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m.eval()(x), **TOL)


def test_affine_grid_fallback_warning_as_error_is_the_first_steps_refusal() -> None:
    """Under warnings as errors, torch's fallback warning for affine_grid refuses the step,
    naming backend='loop', and changes nothing (semantics.md, "What vmap cannot batch")."""
    ens = vmapens.Ensemble(STN, n=N, seed=0)
    before = copy.deepcopy(ens.state_dict())
    step = vmapens.make_step(ens, F.cross_entropy, vmapens.StackedAdam(ens))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match="backend='loop'") as err:
            step(torch.randn(2, 1, 4, 4), torch.tensor([0, 1]))
    assert "affine_grid" in str(err.value)
    for name, value in ens.state_dict().items():
        assert torch.equal(value, before[name]), name


@pytest.mark.parametrize(
    "mode, pad, kw",
    [("bilinear", "zeros", {}), ("nearest", "border", {"chunk_size": 2}),
     ("bicubic", "reflection", {"backend": "loop"})],
    ids=["bilinear-zeros-vmap", "nearest-border-chunk2", "bicubic-reflection-loop"],
)  # fmt: skip
def test_learned_grid_per_member_trains_as_alone(mode, pad, kw) -> None:
    batches = image_batches([3, 1, 2], (2, 4, 4), lambda b, g: torch.randn(b, 2, 4, 4, generator=g))
    ens = vmapens.Ensemble(lambda: Warp(mode, pad), n=N, seed=0, **kw)
    models = ens.unstack()
    start = ens.state_dict()["grid"].clone()
    losses, _ = step_all(ens, F.mse_loss, batches)
    torch.testing.assert_close(losses, train_alone(models, batches, F.mse_loss), **TOL)
    assert_members(ens, models)
    moved = not torch.equal(ens.state_dict()["grid"], start)
    assert moved == (mode != "nearest")  # nearest sampling gives the grid no gradient, alone too


# --- neural cellular automaton ---------------------------------------------------------------


def seeds(b: int, s: int = 5) -> Tensor:
    """One live cell in the middle of each image."""
    x = torch.zeros(b, C, s, s)
    x[:, :, s // 2, s // 2] = torch.tensor([0.5, 0.5, 0.5, 1.0])
    return x


NCA_TARGET = torch.rand(2, C, 5, 5, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("kw", BACKENDS, ids=IDS)
def test_automaton_same_randomness_each_member_draws_what_it_draws_alone(kw) -> None:
    """8 stochastic iterations per forward: with randomness="same" every member's update masks
    are those it draws alone from the step's RNG state, and the RNG ends where alone's does."""
    batches = [(seeds(2), NCA_TARGET), (seeds(1), NCA_TARGET[:1])]
    ens = vmapens.Ensemble(NCA, n=N, seed=0, randomness="same", **kw)
    models = ens.unstack()
    torch.manual_seed(11)
    losses, states = step_all(ens, F.mse_loss, batches)
    after = torch.get_rng_state()
    torch.testing.assert_close(losses, train_alone(models, batches, F.mse_loss, states), **TOL)
    assert torch.equal(torch.get_rng_state(), after)  # the last member alone ends there too
    assert_members(ens, models)


@pytest.mark.parametrize("kw", BACKENDS[:2], ids=IDS[:2])
def test_automaton_different_randomness_gives_each_member_its_own_masks(kw) -> None:
    """Identical members with randomness="different" grow differently (own masks each); with
    randomness="error" the step refuses the draws, naming the modes."""
    torch.manual_seed(0)
    base = NCA()
    nn.init.normal_(base.update[2].weight, std=0.3)
    ens = vmapens.Ensemble.from_modules([copy.deepcopy(base) for _ in range(N)], **kw)
    out = ens(seeds(1))
    assert all(not torch.equal(out[0], out[i]) for i in range(1, N))
    strict = vmapens.Ensemble(lambda: NCA(1), n=N, seed=0, randomness="error", **kw)
    with pytest.raises(RuntimeError, match="randomness='different'"):
        vmapens.make_step(strict, F.mse_loss, vmapens.StackedAdam(strict))(seeds(2), NCA_TARGET)


def test_automaton_fit_on_a_shuffling_loader_and_predict_over_a_loader() -> None:
    """`fit` on a shuffling DataLoader (batches 2, 1) for 2 epochs, randomness="same": each
    member as a plain loop over the same loader from the same RNG state; then `predict` over a
    DataLoader whose last batch is one image, each member as alone from the same RNG state."""
    g = torch.Generator().manual_seed(0)
    xs = seeds(3) + 0.1 * torch.rand(3, C, 5, 5, generator=g)
    ys = torch.rand(3, C, 5, 5, generator=g)
    loader = DataLoader(TensorDataset(xs, ys), batch_size=2, shuffle=True)
    ens = vmapens.Ensemble(NCA, n=N, seed=0, randomness="same")
    models = ens.unstack()
    torch.manual_seed(7)
    start = torch.get_rng_state()
    vmapens.fit(ens, loader, nn.MSELoss(), epochs=2, lr=LRS, progress=False)
    end = torch.get_rng_state()
    for i, m in enumerate(models):
        torch.set_rng_state(start)
        opt = torch.optim.Adam(m.parameters(), lr=LRS[i])
        for _ in range(2):
            for x, y in loader:  # each pass's iterator draws its base seed, as fit's does
                opt.zero_grad()
                F.mse_loss(m(x), y).backward()
                opt.step()
    assert torch.equal(torch.get_rng_state(), end)
    assert_members(ens, models)

    images = DataLoader(TensorDataset(xs), batch_size=2)
    torch.manual_seed(9)
    start = torch.get_rng_state()
    got = vmapens.predict(ens, images)
    assert got.shape == (N, 3, C, 5, 5)
    for i, m in enumerate(models):
        torch.set_rng_state(start)
        with torch.no_grad():
            want = torch.cat([m.eval()(x) for (x,) in images])
        torch.testing.assert_close(got[i], want, **TOL)


def test_same_randomness_draw_into_channels_last_tensor_refusal_names_the_layout() -> None:
    """A per-channel update mask `torch.empty_like(dx).bernoulli_(0.5)` on channels-last
    activations: alone torch fills it in memory order, under vmap in logical order, so member 0
    differs from alone by O(1) and the first step refuses (right). The message should say why
    (a draw into a tensor laid out otherwise: `.contiguous()` first, or `backend='loop'`)."""
    ens = vmapens.Ensemble(lambda: NCA(2, per_channel=True), n=N, seed=0, randomness="same")
    ens.to(memory_format=CL)
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedAdam(ens))
    with pytest.raises(RuntimeError, match="computes something else") as err:
        step(seeds(2).to(memory_format=CL), NCA_TARGET)
    assert "contiguous" in str(err.value)


# --- super-resolution ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, channels_last",
    [({}, True), ({"chunk_size": 2}, False), ({"backend": "loop"}, True)],
    ids=["vmap-channels_last", "chunk2", "loop-channels_last"],
)
def test_super_resolution_ops_train_as_alone(kw, channels_last: bool) -> None:
    """PixelShuffle/Unshuffle, interpolate (bilinear both align_corners, scale_factor and size,
    bicubic, antialias), Upsample, ReflectionPad2d, Unfold/Fold; channels-last inputs and a
    channels-last ensemble (`ens.to(memory_format=...)`) against members converted alike."""
    batches = image_batches([3, 1], (3, 4, 4), lambda b, g: torch.randn(b, 3, 8, 8, generator=g))
    ens = vmapens.Ensemble(SuperRes, n=N, seed=0, **kw)
    models = ens.unstack()
    if channels_last:
        batches = [(x.to(memory_format=CL), y) for x, y in batches]
        ens.to(memory_format=CL)
        for m in models:
            m.to(memory_format=CL)
    losses, _ = step_all(ens, F.l1_loss, batches)
    torch.testing.assert_close(losses, train_alone(models, batches, F.l1_loss), **TOL)
    assert_members(ens, models)
    x = batches[0][0]
    got = vmapens.predict(ens, x, batch_size=2)  # batches of 2 and 1
    for i, m in enumerate(models):
        torch.testing.assert_close(got[i], m.eval()(x), **TOL)


class Converted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 3, padding=1)
        self.c2 = nn.Conv2d(4, 3, 1)
        self.line = nn.Conv1d(3, 3, 1)  # a 3-D weight: torch leaves it as it is

    def forward(self, x: Tensor) -> Tensor:
        h = self.c2(torch.tanh(self.c1(x)))
        return h + self.line(h.flatten(2)).view_as(h)


def test_channels_last_conversion_mid_training_keeps_the_optimizer_and_matches_alone() -> None:
    """`ens.to(memory_format=channels_last)` after two steps, with a StackedAdam built before
    (as `module.to(...)` keeps torch.optim's parameters): the same parameters train on, 4-D
    weights channels-last in each member as alone, the Conv1d weight untouched as alone."""
    ens = vmapens.Ensemble(Converted, n=N, seed=0)
    models = ens.unstack()
    params = list(ens.parameters())
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedAdam(ens, lr=LRS))
    opts = [torch.optim.Adam(m.parameters(), lr=lr) for m, lr in zip(models, LRS)]
    batches = image_batches(
        [2, 3, 1, 2], (3, 4, 4), lambda b, g: torch.randn(b, 3, 4, 4, generator=g)
    )
    for k, (x, y) in enumerate(batches):
        if k == 2:
            ens.to(memory_format=CL)
            for m in models:
                m.to(memory_format=CL)
        if k >= 2:
            x = x.to(memory_format=CL)
        got = step(x, y)
        for i, (m, opt) in enumerate(zip(models, opts)):
            opt.zero_grad()
            loss = F.mse_loss(m(x), y)
            loss.backward()
            opt.step()
            torch.testing.assert_close(got[i], loss.detach(), **TOL)
    assert list(ens.parameters()) == params and all(
        a is b for a, b in zip(ens.parameters(), params)
    )
    assert_members(ens, models)
    member = ens[1]
    assert member.c1.weight.is_contiguous(memory_format=CL)
    assert member.line.weight.stride() == models[1].line.weight.stride()


def test_channels_last_on_a_conv3d_member_is_refused_as_alone_and_changes_nothing() -> None:
    def factory() -> nn.Module:
        return nn.Sequential(nn.Conv2d(3, 3, 1), nn.Conv3d(2, 3, 1))

    with pytest.raises(RuntimeError, match="rank 4"):
        factory().to(memory_format=CL)  # torch alone
    ens = vmapens.Ensemble(factory, n=N, seed=0)
    before = {k: (v.clone(), v.stride()) for k, v in ens.state_dict().items()}
    with pytest.raises(RuntimeError, match="rank 4"):
        ens.to(memory_format=CL)
    for name, value in ens.state_dict().items():
        assert torch.equal(value, before[name][0]) and value.stride() == before[name][1], name
