"""A user journey: an ensemble of tiny DDPM denoisers on 2-D toy data, with classifier-free
guidance, hand-written reverse sampling, an EMA copy, `fit` with per-member learning rates and
member files.

The script a researcher writes from README.md, docs/semantics.md ("Buffers and train/eval",
"Randomness in the forward pass", "Inputs and outputs", SWA/EMA), docs/fit.md and
docs/workflows.md:

* the noise schedule as registered buffers (`betas`, `alphas_cumprod`, the square roots;
  non-persistent, as most DDPM code registers them) read with `extract(a, t, shape)`
  (`a.gather(-1, t)`), and a sinusoidal timestep embedding;
* the DDPM objective with the timesteps `torch.randint(0, T, (B,))` and noise
  `torch.randn_like(x0)` drawn (a) in the loop, shared by all members, (b) per member in the
  loop (`in_dims=0`), (c) inside the member's forward (`randomness="same"`: each member draws
  what it draws alone; `"different"`: row i of one batched draw), with the label dropped to a
  null token by `torch.rand(B) < p_uncond` (classifier-free guidance training);
* the reverse sampling loop over T steps by hand under `torch.no_grad()`, each member its own
  chain (`in_dims=0`), guided `eps = (1 + w) eps_c - w eps_u` with two calls or one batched
  call, and with `vmapens.predict`;
* an EMA copy (`AveragedModel` with `get_ema_multi_avg_fn`, and a `copy.deepcopy` updated by
  hand with `lerp_`), `fit` with one learning rate per member, member files into plain modules.

Every member is compared with a plain module trained alone with `torch.optim.Adam` on the same
batches, timesteps and noise. float64 throughout (the same maths: 1e-10).
"""

from __future__ import annotations

import copy
import functools
import math
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import vmapens

sys.path.insert(0, str(Path(__file__).parent))
from truth import batch_plan  # noqa: E402

pytestmark = pytest.mark.usefixtures("float64_default")

N, T, B, CLASSES, EMB, HIDDEN = 3, 6, 5, 2, 4, 12
P_UNCOND, W = 0.3, 2.0
TOL = {"rtol": 1e-10, "atol": 1e-10}


def extract(a: Tensor, t: Tensor, shape: torch.Size) -> Tensor:
    out = a.gather(-1, t)
    return out.reshape(t.shape[0], *((1,) * (len(shape) - 1)))


def timestep_embedding(t: Tensor, dim: int) -> Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device) / half)
    args = t.float()[:, None].to(freqs.dtype) * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class Denoiser(nn.Module):
    """eps_theta(x_t, t, y) for 2-D points; label CLASSES is the null (unconditional) token."""

    def __init__(self) -> None:
        super().__init__()
        betas = torch.linspace(1e-2, 0.3, T)
        ac = torch.cumprod(1.0 - betas, dim=0)
        ac_prev = torch.cat([torch.ones(1), ac[:-1]])
        self.register_buffer("betas", betas, persistent=False)
        self.register_buffer("alphas_cumprod", ac, persistent=False)
        self.register_buffer("sqrt_ac", ac.sqrt(), persistent=False)
        self.register_buffer("sqrt_1m_ac", (1.0 - ac).sqrt(), persistent=False)
        self.register_buffer("sqrt_recip_a", (1.0 / (1.0 - betas)).sqrt(), persistent=False)
        self.register_buffer(
            "sigma", (betas * (1.0 - ac_prev) / (1.0 - ac)).sqrt(), persistent=False
        )
        self.label = nn.Embedding(CLASSES + 1, EMB)
        self.net = nn.Sequential(nn.Linear(2 + 2 * EMB, HIDDEN), nn.SiLU(), nn.Linear(HIDDEN, 2))

    def forward(self, x_t: Tensor, t: Tensor, y: Tensor) -> Tensor:
        h = torch.cat([x_t, timestep_embedding(t, EMB), self.label(y)], dim=-1)
        return self.net(h)

    def q_sample(self, x0: Tensor, t: Tensor, noise: Tensor) -> Tensor:
        return (
            extract(self.sqrt_ac, t, x0.shape) * x0 + extract(self.sqrt_1m_ac, t, x0.shape) * noise
        )

    def p_mean(self, x: Tensor, t: Tensor, eps: Tensor) -> Tensor:
        coef = extract(self.betas, t, x.shape) / extract(self.sqrt_1m_ac, t, x.shape)
        return extract(self.sqrt_recip_a, t, x.shape) * (x - coef * eps)


class Noised(Denoiser):
    """(a)/(b): the loop draws t and noise; the forward noises x0 and predicts the noise."""

    def forward(self, x0: Tensor, t: Tensor, noise: Tensor, y: Tensor) -> Tensor:  # type: ignore[override]
        return super().forward(self.q_sample(x0, t, noise), t, y)


class SelfNoised(Denoiser):
    """(c): the forward draws t, the noise and the label drop itself; returns (eps_hat, noise)."""

    def forward(self, x0: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        t, noise, drop = self.draw(x0)
        y = torch.where(drop, torch.full_like(y, CLASSES), y)
        return super().forward(self.q_sample(x0, t, noise), t, y), noise

    def draw(self, x0: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        t = torch.randint(0, T, (x0.shape[0],))
        noise = torch.randn_like(x0)
        return t, noise, torch.rand(x0.shape[0]) < P_UNCOND


class Injected(SelfNoised):
    """The truth for `"different"`: member i's draws given (row i of the one batched draw)."""

    def __init__(self, member: SelfNoised) -> None:
        super().__init__()
        self.label = copy.deepcopy(member.label)  # its padding_idx too
        self.load_state_dict(member.state_dict())
        self.given: list[tuple[Tensor, Tensor, Tensor]] = []

    def draw(self, x0: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.given.pop(0)


def eps_loss(out: tuple[Tensor, Tensor], _: Tensor) -> Tensor:
    eps_hat, noise = out
    return nn.functional.mse_loss(eps_hat, noise)


def data(count: int = 3, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    """Two-moons-like toy points with a class label each."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        y = torch.randint(0, CLASSES, (B,), generator=g)
        ang = torch.rand(B, generator=g) * math.pi
        x0 = torch.stack([torch.cos(ang) + y, torch.sin(ang) * (1 - 2 * y)], -1)
        out.append((x0 + 0.05 * torch.randn(B, 2, generator=g), y))
    return out


def drop_labels(y: Tensor, g: torch.Generator) -> Tensor:
    return torch.where(torch.rand(y.shape, generator=g) < P_UNCOND, torch.full_like(y, CLASSES), y)


def assert_members(ens: vmapens.Ensemble, models: list[nn.Module]) -> None:
    assert len(ens) == len(models)
    for i, m in enumerate(models):
        got = dict(ens[i].named_parameters()) | dict(ens[i].named_buffers())
        for k, v in (dict(m.named_parameters()) | dict(m.named_buffers())).items():
            torch.testing.assert_close(got[k], v, **TOL, msg=f"member {i} {k}")


def train_alone(models: list[nn.Module], batches: list[tuple], lr: float | Tensor = 1e-2) -> None:
    lrs = lr if isinstance(lr, Tensor) else [lr] * len(models)
    for i, m in enumerate(models):
        opt = torch.optim.Adam(m.parameters(), lr=float(lrs[i]))
        for x0, t, noise, y in batches:
            if t.dim() == 2:  # per member (in_dims=0): member i's row
                t, noise = t[i], noise[i]
            opt.zero_grad()
            nn.functional.mse_loss(m(x0, t, noise, y), noise).backward()
            opt.step()


# -- the DDPM objective -----------------------------------------------------------------------


def test_schedule_buffers_are_per_member_and_not_in_the_state_dict():
    ens = vmapens.Ensemble(Denoiser, n=N, seed=0)
    alone = Denoiser()
    assert list(ens.state_dict()) == list(alone.state_dict())  # non-persistent: not saved
    assert ens.get_buffer("alphas_cumprod").shape == (N, T)
    for i in range(N):
        torch.testing.assert_close(ens[i].sqrt_1m_ac, alone.sqrt_1m_ac, rtol=0, atol=0)


@pytest.mark.parametrize("how", ["make_step", "by_hand"])
def test_shared_timesteps_and_noise_drawn_in_the_loop(how):
    # (a) one draw per step in the training loop, every member sees the same t and noise.
    ens = vmapens.Ensemble(Noised, n=N, seed=0)
    alone = ens.unstack()
    opt = vmapens.StackedAdam(ens, lr=1e-2)
    step = vmapens.make_step(ens, nn.MSELoss(), opt)
    g = torch.Generator().manual_seed(1)
    batches = []
    for x0, y in data():
        t = torch.randint(0, T, (B,), generator=g)
        noise = torch.randn(x0.shape, generator=g)
        y = drop_labels(y, g)
        batches.append((x0, t, noise, y))
        if how == "make_step":
            step((x0, t, noise, y), noise)
        else:
            loss = vmapens.per_member(nn.MSELoss())(ens(x0, t, noise, y), noise)
            loss.sum().backward()
            opt.step()
            opt.zero_grad()
    train_alone(alone, batches)
    assert_members(ens, alone)


@pytest.mark.parametrize("how", ["make_step", "by_hand"])
def test_per_member_timesteps_and_noise_drawn_in_the_loop(how):
    # (b) each member its own t and noise (dim 0 of n rows), the data shared: in_dims per input.
    ens = vmapens.Ensemble(Noised, n=N, seed=0)
    alone = ens.unstack()
    opt = vmapens.StackedAdam(ens, lr=1e-2)
    step = vmapens.make_step(ens, nn.MSELoss(), opt, in_dims=0)
    g = torch.Generator().manual_seed(2)
    batches = []
    for x0, y in data():
        t = torch.randint(0, T, (N, B), generator=g)
        noise = torch.randn((N, *x0.shape), generator=g)
        batches.append((x0, t, noise, y))
        if how == "make_step":  # in_dims=0 maps every input: give the shared ones n rows
            step((x0.expand(N, -1, -1), t, noise, y.expand(N, -1)), noise)
        else:
            out = ens(x0, t, noise, y, in_dims=(None, 0, 0, None))
            vmapens.per_member(nn.MSELoss(), in_dims=(0, 0))(out, noise).sum().backward()
            opt.step()
            opt.zero_grad()
    train_alone(alone, batches)
    assert_members(ens, alone)


@pytest.mark.parametrize(
    "options", [{}, {"chunk_size": 2}, {"backend": "loop"}], ids=["vmap", "chunks", "loop"]
)
def test_draws_inside_the_forward_with_same_randomness_equal_each_member_alone(options):
    # (c) with randomness="same" every member draws what it draws alone from the RNG state.
    ens = vmapens.Ensemble(SelfNoised, n=N, seed=0, randomness="same", **options)
    alone = ens.unstack()
    step = vmapens.make_step(ens, eps_loss, vmapens.StackedAdam(ens, lr=1e-2))
    batches = data()
    torch.manual_seed(5)
    for x0, y in batches:
        step((x0, y), x0)
    after = torch.get_rng_state()
    for m in alone:
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        torch.manual_seed(5)
        for x0, y in batches:
            opt.zero_grad()
            eps_loss(m(x0, y), x0).backward()
            opt.step()
    assert_members(ens, alone)
    assert torch.equal(after, torch.get_rng_state())  # one draw of each per step, as alone


class PaddedNull(SelfNoised):
    """The null token as the label embedding's `padding_idx` (a zero, untrained row)."""

    def __init__(self) -> None:
        super().__init__()
        self.label = nn.Embedding(CLASSES + 1, EMB, padding_idx=CLASSES)


@pytest.mark.parametrize("how", ["by_hand", "make_step_padding_idx"])
def test_draws_inside_the_forward_with_different_randomness_are_one_batched_draw(how):
    # (c) "different": member i gets row i of randint(0, T, (n, B)), randn(n, B, 2), rand(n, B),
    # drawn in the forward's order ("one batched draw replaces n separate draws"). With a
    # `padding_idx` null token the dropped rows differ per member (indices made in the forward).
    cls = SelfNoised if how == "by_hand" else PaddedNull
    ens = vmapens.Ensemble(cls, n=N, seed=0)
    alone = [Injected(m) for m in ens.unstack()]
    opt = vmapens.StackedAdam(ens, lr=1e-2)
    step = vmapens.make_step(ens, eps_loss, opt)
    batches = data()
    for k, (x0, y) in enumerate(batches):
        torch.manual_seed(50 + k)
        if how == "by_hand":
            vmapens.per_member(eps_loss)(ens(x0, y), x0).sum().backward()
            opt.step()
            opt.zero_grad()
        else:
            step((x0, y), x0)
        torch.manual_seed(50 + k)
        t, noise = torch.randint(0, T, (N, B)), torch.randn(N, B, 2)
        drop = torch.rand(N, B) < P_UNCOND
        for i, m in enumerate(alone):
            m.given.append((t[i], noise[i], drop[i]))
    for m in alone:
        opt_alone = torch.optim.Adam(m.parameters(), lr=1e-2)
        for x0, y in batches:
            opt_alone.zero_grad()
            eps_loss(m(x0, y), x0).backward()
            opt_alone.step()
        assert m.given == []
    assert_members(ens, alone)


# -- sampling ---------------------------------------------------------------------------------


@functools.cache
def trained_state() -> dict[str, Tensor]:
    ens = vmapens.Ensemble(Denoiser, n=N, seed=0)
    opt = vmapens.StackedAdam(ens, lr=3e-2)
    g = torch.Generator().manual_seed(9)
    for x0, y in data():
        t = torch.randint(0, T, (B,), generator=g)
        noise = torch.randn(x0.shape, generator=g)
        x_t = Denoiser().q_sample(x0, t, noise)  # the schedule is every member's
        vmapens.per_member(nn.MSELoss())(ens(x_t, t, drop_labels(y, g)), noise).sum().backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in ens.state_dict().items()}


def trained(factory: type[Denoiser] = Denoiser, **options) -> vmapens.Ensemble:
    ens = vmapens.Ensemble(factory, n=N, seed=0, **options)
    ens.load_state_dict(trained_state())
    return ens


def sample_alone(m: Denoiser, x: Tensor, y: Tensor, zs: Tensor, guided: bool) -> Tensor:
    null = torch.full_like(y, CLASSES)
    for s in reversed(range(T)):
        t = torch.full((x.shape[0],), s, dtype=torch.long)
        eps = m(x, t, y)
        if guided:
            eps = (1 + W) * eps - W * m(x, t, null)
        x = m.p_mean(x, t, eps)
        if s > 0:
            x = x + extract(m.sigma, t, x.shape) * zs[s]
    return x


@pytest.mark.parametrize("guided", ["none", "two_calls", "one_call", "predict"])
def test_reverse_sampling_each_member_its_own_chain(guided):
    ens = trained()
    alone = ens.unstack()
    g = torch.Generator().manual_seed(4)
    x_T = torch.randn(N, B, 2, generator=g)
    zs = torch.randn(T, N, B, 2, generator=g)
    y = torch.arange(B) % CLASSES
    null = torch.full_like(y, CLASSES)
    sch = {
        k: ens.get_buffer(k)[:, None, None]
        for k in ("betas", "sqrt_1m_ac", "sqrt_recip_a", "sigma")
    }
    x = x_T
    with torch.no_grad():
        for s in reversed(range(T)):
            t = torch.full((B,), s, dtype=torch.long)
            if guided == "none":
                eps = ens(x, t, y, in_dims=(0, None, None))
            elif guided == "two_calls":
                eps_c = ens(x, t, y, in_dims=(0, None, None))
                eps = (1 + W) * eps_c - W * ens(x, t, null, in_dims=(0, None, None))
            elif guided == "one_call":
                both = ens(
                    torch.cat([x, x], 1), t.repeat(2), torch.cat([y, null]), in_dims=(0, None, None)
                )
                eps = (1 + W) * both[:, :B] - W * both[:, B:]
            else:
                eps_c = vmapens.predict(ens, (x, t, y), in_dims=(0, None, None), batch_size=2)
                eps_u = vmapens.predict(ens, (x, t, null), in_dims=(0, None, None))
                eps = (1 + W) * eps_c - W * eps_u
            x = sch["sqrt_recip_a"][..., s] * (
                x - sch["betas"][..., s] / sch["sqrt_1m_ac"][..., s] * eps
            )
            if s > 0:
                x = x + sch["sigma"][..., s] * zs[s]
    assert not x.requires_grad
    with torch.no_grad():
        want = torch.stack(
            [sample_alone(m, x_T[i], y, zs[:, i], guided != "none") for i, m in enumerate(alone)]
        )
    torch.testing.assert_close(x, want, **TOL)


# -- EMA, fit, member files --------------------------------------------------------------------


def test_ema_copy_averaged_model_and_by_hand_then_sample():
    decay = 0.8
    ens = vmapens.Ensemble(Noised, n=N, seed=0)
    alone = ens.unstack()
    ema = AveragedModel(ens, multi_avg_fn=get_ema_multi_avg_fn(decay))
    shadow = copy.deepcopy(ens)
    timm = copy.deepcopy(ens)  # timm's ModelEmaV2: in place over the state dict's values
    opt = vmapens.StackedAdam(ens, lr=1e-2)
    g = torch.Generator().manual_seed(3)
    batches = []
    for x0, y in data(4):
        t, noise = torch.randint(0, T, (B,), generator=g), torch.randn(x0.shape, generator=g)
        batches.append((x0, t, noise, y))
        vmapens.per_member(nn.MSELoss())(ens(x0, t, noise, y), noise).sum().backward()
        opt.step()
        opt.zero_grad()
        ema.update_parameters(ens)
        with torch.no_grad():
            for pe, p in zip(shadow.parameters(), ens.parameters(), strict=True):
                pe.lerp_(p, 1 - decay)
            for ve, v in zip(timm.state_dict().values(), ens.state_dict().values(), strict=True):
                ve.copy_(ve * decay + (1 - decay) * v)
    emas_alone, shadows_alone = [], []
    for m in alone:
        e, s = AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(decay)), copy.deepcopy(m)
        opt_alone = torch.optim.Adam(m.parameters(), lr=1e-2)
        for x0, t, noise, y in batches:
            opt_alone.zero_grad()
            nn.functional.mse_loss(m(x0, t, noise, y), noise).backward()
            opt_alone.step()
            e.update_parameters(m)
            with torch.no_grad():
                for pe, p in zip(s.parameters(), m.parameters(), strict=True):
                    pe.lerp_(p, 1 - decay)
        emas_alone.append(e.module)
        shadows_alone.append(s)
    assert_members(ens, alone)
    assert_members(ema.module, emas_alone)
    assert_members(shadow, shadows_alone)
    for i, m in enumerate(shadows_alone):  # the same average, in another order of operations
        for k, v in m.named_parameters():
            torch.testing.assert_close(timm[i].get_parameter(k), v, rtol=1e-12, atol=1e-12)
    x0, t, noise, y = batches[0]
    with torch.no_grad():
        got = ema(x0, t, noise, y)
        want = torch.stack([m(x0, t, noise, y) for m in emas_alone])
    torch.testing.assert_close(got, want, **TOL)


def test_fit_with_per_member_lr_then_member_files_into_plain_modules(tmp_path):
    lrs = torch.tensor([3e-3, 1e-2, 3e-2])
    ens = vmapens.Ensemble(Noised, n=N, seed=4)
    alone = ens.unstack()
    g = torch.Generator().manual_seed(6)
    x0 = torch.cat([x for x, _ in data(2)])
    y = torch.cat([yy for _, yy in data(2)])
    t = torch.randint(0, T, (len(x0),), generator=g)
    noise = torch.randn(x0.shape, generator=g)
    vmapens.fit(ens, ((x0, t, noise, y), noise), nn.MSELoss(), epochs=2, batch_size=4, lr=lrs,
                seed=1, progress=False)  # fmt: skip
    plan = batch_plan(len(x0), 4, 2 * math.ceil(len(x0) / 4), seed=1)
    train_alone(alone, [(x0[r], t[r], noise[r], y[r]) for r in plan], lr=lrs)
    assert_members(ens, alone)

    vmapens.save_members(ens, tmp_path)
    for i, path in enumerate(sorted(tmp_path.glob("member_*.pt"))):
        plain = Noised()
        plain.load_state_dict(torch.load(path))  # strict: the schedule is the factory's own
        assert_members(ens.select([i]), [plain])
    loaded = vmapens.load_members(tmp_path)
    plain = [Noised() for _ in range(N)]
    for m, sd in zip(plain, loaded, strict=True):
        m.load_state_dict(sd)
    assert_members(vmapens.Ensemble.from_modules(plain), alone)


def test_fit_with_draws_inside_the_forward_draws_one_batched_draw_per_step():
    # fit (seed given) draws nothing of its own from the global RNG: step k's forward draws
    # row i of each batched draw, in the order of fit's batches (docs/fit.md).
    ens = vmapens.Ensemble(SelfNoised, n=N, seed=0)
    alone = [Injected(m) for m in ens.unstack()]
    x0 = torch.cat([x for x, _ in data(2)])
    y = torch.cat([yy for _, yy in data(2)])
    torch.manual_seed(77)
    vmapens.fit(ens, ((x0, y), x0), eps_loss, epochs=2, batch_size=4, lr=1e-2, seed=1,
                progress=False)  # fmt: skip
    plan = batch_plan(len(x0), 4, 2 * math.ceil(len(x0) / 4), seed=1)
    torch.manual_seed(77)
    for rows in plan:
        t, noise = torch.randint(0, T, (N, len(rows))), torch.randn(N, len(rows), 2)
        drop = torch.rand(N, len(rows)) < P_UNCOND
        for i, m in enumerate(alone):
            m.given.append((t[i], noise[i], drop[i]))
    for m in alone:
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        for rows in plan:
            opt.zero_grad()
            eps_loss(m(x0[rows], y[rows]), x0[rows]).backward()
            opt.step()
        assert m.given == []
    assert_members(ens, alone)


class ChainSampler(Denoiser):
    """A forward that runs the whole reverse chain, drawing x_T and every step's noise."""

    def forward(self, y: Tensor) -> Tensor:  # type: ignore[override]
        x = torch.randn(y.shape[0], 2)
        for s in reversed(range(T)):
            t = torch.full((y.shape[0],), s, dtype=torch.long)
            x = self.p_mean(x, t, super().forward(x, t, y))
            if s > 0:
                x = x + extract(self.sigma, t, x.shape) * torch.randn_like(x)
        return x


def test_sampling_chain_inside_the_forward_with_same_randomness_and_predict():
    ens = trained(ChainSampler, randomness="same")
    y = torch.arange(B) % CLASSES
    torch.manual_seed(3)
    got = vmapens.predict(ens, (y,))
    want = []
    for m in ens.unstack():
        torch.manual_seed(3)
        with torch.no_grad():
            want.append(m(y))
    torch.testing.assert_close(got, torch.stack(want), **TOL)
