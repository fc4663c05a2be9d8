"""Journey: N tiny NeRF / SIREN coordinate networks trained at once.

A researcher trains N small radiance fields (Fourier positional encoding, SIREN layers with
their special init and `omega_0`, a skip connection concatenating the encoded input) from
different seeds with one learning rate per member, each on its own rays (`in_dims=0`). The
forward renders rays: stratified samples from `torch.linspace` with per-call jitter
(`torch.rand`), transmittance with `torch.cumprod` over `torch.cat` of ones, alpha
compositing, and a fine pass placed by inverse-CDF sampling (`torch.searchsorted` +
`torch.gather`). An SDF variant trains with an eikonal loss. Every member is checked against
the same module trained alone with `torch.optim` from the same init and the same RNG state
(`randomness="same"`, docs/semantics.md "Randomness in the forward pass"), in float64.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn

import vmapens
from tests.truth import TOL64, assert_members_equal

N, RAYS, COARSE, FINE, FREQS = 3, 6, 5, 4, 3
LRS = [1e-3, 3e-3, 5e-3]
mse = nn.MSELoss()

# torch's searchsorted batching rule, not the user's code: under vmap with randomness="same"
# the unbatched `u` meets a batched cdf and torch expands it to a non-contiguous tensor, so a
# UserWarning appears (once per process) that the module alone never gives.
pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.searchsorted....input value tensor is non-contiguous:UserWarning"
)


def encode(x: Tensor) -> Tensor:
    """[..., 3] -> [..., 3 + 6 * FREQS]: x, sin(2^k x), cos(2^k x)."""
    freqs = 2.0 ** torch.arange(FREQS, dtype=x.dtype)
    xb = (x[..., None] * freqs).flatten(-2)
    return torch.cat([x, torch.sin(xb), torch.cos(xb)], -1)


class Sine(nn.Module):
    """A SIREN layer: sin(omega_0 * (W x + b)), W ~ U(-b, b) as in Sitzmann et al."""

    def __init__(self, fan_in: int, fan_out: int, omega_0: float = 30.0, first: bool = False):
        super().__init__()
        self.omega_0, self.linear = omega_0, nn.Linear(fan_in, fan_out)
        bound = 1 / fan_in if first else math.sqrt(6 / fan_in) / omega_0
        with torch.no_grad():
            self.linear.weight.uniform_(-bound, bound)

    def forward(self, x: Tensor) -> Tensor:
        return torch.sin(self.omega_0 * self.linear(x))


class Field(nn.Module):
    """(sigma, rgb logits) at points: encoding -> SIREN -> skip concat of the input -> heads."""

    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        enc = 3 + 6 * FREQS
        self.s1, self.s2 = Sine(enc, hidden, first=True), Sine(hidden, hidden)
        self.s3 = Sine(hidden + enc, hidden)  # skip: the encoded input again
        self.head = nn.Linear(hidden, 4)

    def forward(self, pts: Tensor) -> tuple[Tensor, Tensor]:
        e = encode(pts)
        h = self.s3(torch.cat([self.s2(self.s1(e)), e], -1))
        out = self.head(h)
        return out[..., 0], out[..., 1:]


def composite(field: Field, rays: Tensor, z: Tensor) -> tuple[Tensor, Tensor]:
    """Alpha compositing along each ray at depths z [R, S]: colour [R, 3], weights [R, S]."""
    o, d = rays[:, :3], rays[:, 3:]
    sigma, rgb = field(o[:, None] + d[:, None] * z[..., None])
    delta = torch.cat([z[:, 1:] - z[:, :-1], torch.full_like(z[:, :1], 1e10)], -1)
    alpha = 1 - torch.exp(-torch.relu(sigma) * delta)
    ones = torch.ones_like(alpha[:, :1])
    trans = torch.cumprod(torch.cat([ones, 1 - alpha + 1e-10], -1), -1)[:, :-1]
    w = alpha * trans
    return (w[..., None] * torch.sigmoid(rgb)).sum(1), w


def sample_pdf(bins: Tensor, weights: Tensor, count: int, det: bool) -> Tensor:
    """Inverse-CDF sampling of `count` depths per ray (NeRF's hierarchical sampling)."""
    pdf = weights + 1e-5
    pdf = pdf / pdf.sum(-1, keepdim=True)
    cdf = torch.cat([torch.zeros_like(pdf[:, :1]), torch.cumsum(pdf, -1)], -1)
    rays = cdf.shape[0]
    if det:
        u = torch.linspace(0, 1, count, dtype=cdf.dtype).expand(rays, count).contiguous()
    else:
        u = torch.rand(rays, count, dtype=cdf.dtype)
    inds = torch.searchsorted(cdf, u, right=True)
    below = (inds - 1).clamp(min=0)
    above = inds.clamp(max=cdf.shape[-1] - 1)
    g = torch.stack([below, above], -1)  # [R, count, 2]
    shape = (rays, count, cdf.shape[-1])
    cdf_g = torch.gather(cdf[:, None].expand(shape), 2, g)
    bins_g = torch.gather(bins[:, None].expand(shape), 2, g)
    denom = cdf_g[..., 1] - cdf_g[..., 0]
    denom = torch.where(denom < 1e-5, torch.ones_like(denom), denom)
    t = (u - cdf_g[..., 0]) / denom
    return bins_g[..., 0] + t * (bins_g[..., 1] - bins_g[..., 0])


class NeRF(nn.Module):
    """Rays [R, 6] (origin, direction) -> [R, 6]: the coarse and the fine colour."""

    def __init__(self, near: float = 0.5, far: float = 2.5, fine: bool = True) -> None:
        super().__init__()
        self.near, self.far, self.fine = near, far, fine
        self.field = Field()

    def forward(self, rays: Tensor) -> Tensor:
        t = torch.linspace(self.near, self.far, COARSE + 1, dtype=rays.dtype)
        lower, upper = t[:-1], t[1:]
        if self.training:  # stratified jitter, a fresh draw every call
            z = lower + (upper - lower) * torch.rand(rays.shape[0], COARSE, dtype=rays.dtype)
        else:
            z = (0.5 * (lower + upper)).expand(rays.shape[0], COARSE)
        coarse, w = composite(self.field, rays, z)
        if not self.fine:
            return coarse
        bins = torch.cat([z[:, :1], 0.5 * (z[:, 1:] + z[:, :-1]), z[:, -1:]], -1)
        extra = sample_pdf(bins, w.detach(), FINE, det=not self.training).detach()
        z_all, _ = torch.sort(torch.cat([z, extra], -1), -1)
        fine, _ = composite(self.field, rays, z_all)
        return torch.cat([coarse, fine], -1)


def make_rays(count: int, g: torch.Generator, members: int | None = None) -> Tensor:
    shape = (count,) if members is None else (members, count)
    o = 0.1 * torch.randn(*shape, 3, generator=g, dtype=torch.float64)
    d = torch.nn.functional.normalize(
        torch.randn(*shape, 3, generator=g, dtype=torch.float64), dim=-1
    )
    return torch.cat([o, d], -1)


def data(steps: int, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    """Per-member rays [N, R, 6] and target colours [N, R, 6] (coarse and fine both)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        rays = make_rays(RAYS, g, N)
        rgb = torch.rand(N, RAYS, 3, generator=g, dtype=torch.float64)
        out.append((rays, torch.cat([rgb, rgb], -1)))
    return out


def pair(factory=NeRF, **options) -> tuple[vmapens.Ensemble, list[nn.Module]]:
    ens = vmapens.Ensemble(factory, n=N, seed=0, **options).double()
    return ens, ens.unstack()


def train_alone(models: list[nn.Module], batches, seed: int, loss_fn=mse) -> None:
    """Each member alone with torch.optim.Adam, its own lr, from the same RNG state."""
    for i, (m, lr) in enumerate(zip(models, LRS, strict=True)):
        opt = torch.optim.Adam(m.parameters(), lr=lr)
        torch.manual_seed(seed)
        for rays, target in batches:
            opt.zero_grad()
            loss_fn(m(rays[i]), target[i]).backward()
            opt.step()


# -- (1) rendering with random jitter and hierarchical sampling, each member its own rays ----


@pytest.mark.parametrize(
    "options", [{}, {"chunk_size": 2}, {"backend": "loop"}], ids=["vmap", "chunks", "loop"]
)
def test_make_step_renders_each_member_alone_with_same_randomness(options) -> None:
    # randomness="same": every member draws the jitter and the inverse-CDF u that the module
    # alone draws from the same RNG state (docs/semantics.md), so training is exact.
    ens, alone = pair(randomness="same", **options)
    step = vmapens.make_step(ens, mse, vmapens.StackedAdam(ens, lr=LRS), in_dims=0)
    batches = data(2)
    torch.manual_seed(11)
    for rays, target in batches:
        step(rays, target)
    after = torch.get_rng_state()
    train_alone(alone, batches, 11)
    assert_members_equal(ens, alone)
    for m in alone[:1]:  # the ensemble advanced the RNG as one member alone does
        torch.manual_seed(11)
        for rays, _ in batches:
            m(rays[0])
    assert torch.equal(after, torch.get_rng_state())


def test_fit_with_per_member_rays_and_same_randomness_is_each_member_alone() -> None:
    ens, alone = pair(randomness="same")
    ((rays, target),) = data(1)
    torch.manual_seed(5)
    vmapens.fit(ens, (rays, target), mse, steps=3, lr=LRS, in_dims=0, progress=False, seed=0)
    train_alone(alone, [(rays, target)] * 3, 5)
    assert_members_equal(ens, alone)


def test_different_randomness_gives_each_member_its_own_jitter() -> None:
    # The default: independent draws per member (in distribution as alone, not bit for bit).
    # Two members with the same init and the same rays must then render differently.
    ens = vmapens.Ensemble(lambda: NeRF(fine=False), n=2, seeds=[3, 3]).double()
    rays = make_rays(RAYS, torch.Generator().manual_seed(1))
    out = ens(rays)
    assert not torch.allclose(out[0], out[1])
    ens.eval()
    out = ens(rays)  # no jitter in eval: both the same
    torch.testing.assert_close(out[0], out[1], rtol=0, atol=0)


# -- (2) predict in chunks of rays, member files into a plain module --------------------------


def test_predict_in_chunks_of_rays_and_member_files_load_into_a_plain_module(tmp_path) -> None:
    ens, alone = pair()
    batches = data(2)
    step = vmapens.make_step(ens, mse, vmapens.StackedAdam(ens, lr=LRS), in_dims=0, check=False)
    for rays, target in batches:
        step(rays, target)  # "different" jitter: only the rendering below is compared
    g = torch.Generator().manual_seed(3)
    test_rays = make_rays(10, g, N)
    got = vmapens.predict(ens, test_rays, in_dims=0, batch_size=4)  # chunks of 4, 4, 2 rays
    paths = vmapens.save_members(ens, tmp_path)
    for i, path in enumerate(paths):
        plain = NeRF().double()
        plain.load_state_dict(torch.load(path))
        plain.eval()
        with torch.no_grad():
            want = torch.cat([plain(c) for c in test_rays[i].split(4)])
        torch.testing.assert_close(got[i], want, **TOL64)
    shared = make_rays(7, g)  # the same rays for every member, in one call
    mean = vmapens.predict(ens, shared, reduce="mean", batch_size=3)
    with torch.no_grad():
        members = [m.eval() for m in ens.unstack()]
        torch.testing.assert_close(mean, torch.stack([m(shared) for m in members]).mean(0), **TOL64)


class NoisyRender(NeRF):
    """Renders with jitter and random fine samples in eval too (noisy test-time renders)."""

    def train(self, mode: bool = True) -> NoisyRender:
        return super().train(True)


@pytest.mark.parametrize(
    "options, chunks",
    [({}, {}), ({}, {"chunk_size": 2}), ({"backend": "loop"}, {})],
    ids=["vmap", "member_chunks", "loop"],
)
def test_predict_in_ray_chunks_with_same_randomness_draws_what_each_member_draws(options, chunks):
    ens = vmapens.Ensemble(NoisyRender, n=N, seed=0, randomness="same", **options).double()
    alone = ens.unstack()
    rays = make_rays(10, torch.Generator().manual_seed(3), N)
    torch.manual_seed(4)
    got = vmapens.predict(ens, rays, in_dims=0, batch_size=4, **chunks)
    after = torch.get_rng_state()
    for i, m in enumerate(alone):
        torch.manual_seed(4)
        with torch.no_grad():
            want = torch.cat([m(c) for c in rays[i].split(4)])
        torch.testing.assert_close(got[i], want, **TOL64)
    assert torch.equal(after, torch.get_rng_state())


# -- (3) an SDF network with an eikonal loss -------------------------------------------------


class SDF(nn.Module):
    """A SIREN signed-distance field; forward returns [sdf, |grad_x sdf|] per point."""

    def __init__(self) -> None:
        super().__init__()
        self.field = Field()

    def forward(self, x: Tensor) -> Tensor:
        with torch.enable_grad():
            x = x.clone().requires_grad_()
            sdf = self.field(x)[0]
            (grad,) = torch.autograd.grad(sdf.sum(), x, create_graph=True)
        return torch.stack([sdf, grad.norm(dim=-1)], -1)


def sphere_targets(x: Tensor) -> Tensor:
    return torch.stack([x.norm(dim=-1) - 0.5, torch.ones_like(x[..., 0])], -1)


def test_eikonal_loss_is_refused_under_vmap_and_exact_with_loop() -> None:
    g = torch.Generator().manual_seed(2)
    pts = torch.randn(N, 8, 3, generator=g, dtype=torch.float64)
    ens, _ = pair(SDF)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    step = vmapens.make_step(ens, mse, vmapens.StackedAdam(ens, lr=LRS), in_dims=0)
    with pytest.raises(RuntimeError, match=r"backend='loop'"):
        step(pts, sphere_targets(pts))
    assert all(torch.equal(v, before[k]) for k, v in ens.state_dict().items())

    ens, alone = pair(SDF, backend="loop")
    vmapens.fit(
        ens, (pts, sphere_targets(pts)), mse, steps=3, lr=LRS, in_dims=0, progress=False, seed=0
    )
    for i, (m, lr) in enumerate(zip(alone, LRS, strict=True)):
        opt = torch.optim.Adam(m.parameters(), lr=lr)
        for _ in range(3):
            opt.zero_grad()
            mse(m(pts[i]), sphere_targets(pts[i])).backward()
            opt.step()
    assert_members_equal(ens, alone)
