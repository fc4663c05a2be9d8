"""A user journey: an ensemble of small generative models, a VAE and a GAN, with dropout.

The script a researcher writes from README.md, docs/index.md, docs/semantics.md ("Randomness
in the forward pass", "How vmapens checks itself"), docs/optim.md and docs/fit.md:

* a VAE whose forward draws its reparameterisation noise with `torch.randn_like`, trained on
  reconstruction + KL with `make_step`, a hand-written loop (`per_member`, a per-member KL
  weight: a beta sweep) and `fit`; then samples from the trained decoders under `no_grad`
  (`map_members` on `ens.runner.dec`, `predict` on an ensemble of the decoders, a forward that
  draws its own latents);
* a GAN: an ensemble of 4 generators against an ensemble of 4 discriminators (member i against
  member i), alternating steps, `fake.detach()` for the discriminator's step, two stacked Adams
  with `betas=(0.5, 0.999)`, written by hand (`loss.sum().backward(); opt.step();
  opt.zero_grad()`, docs/optim.md) and with `make_step` (one ensemble of (G, D) pairs with an
  optimizer over each half; and a `make_step` discriminator step on per-member fakes);
* dropout in the discriminator in train mode, and eval mode's determinism.

What the docs say members draw (docs/semantics.md, "Randomness in the forward pass"): random
ops draw from the global RNG; `randomness="same"` gives every member the draw of one call, so a
member equals the same module trained alone from the same global RNG state, exactly; with
`"different"` "one batched draw replaces n separate draws": member i gets row i of one draw of
the stacked shape, not what it draws alone (equal in distribution only). The truths below are
written from those rules: plain modules trained alone with `torch.optim.Adam`, the noise
injected as the rule gives it. float64 throughout.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn.utils.parametrizations import spectral_norm

import vmapens

sys.path.insert(0, str(Path(__file__).parent))
from truth import batch_plan  # noqa: E402

pytestmark = pytest.mark.usefixtures("float64_default")

N, DATA, LATENT, HIDDEN, BATCH = 3, 8, 2, 6, 5
TOL = {"rtol": 1e-10, "atol": 1e-10}


# -- the VAE ----------------------------------------------------------------------------------


class VAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(DATA, HIDDEN)
        self.mu, self.logvar = nn.Linear(HIDDEN, LATENT), nn.Linear(HIDDEN, LATENT)
        self.dec = nn.Sequential(nn.Linear(LATENT, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, DATA))

    def noise(self, mu: Tensor) -> Tensor:
        return torch.randn_like(mu)

    def forward(self, x: Tensor | None = None, sample: int = 0) -> tuple[Tensor, ...] | Tensor:
        if sample:  # draw latents from the prior and decode them
            return self.dec(torch.randn(sample, LATENT))
        h = torch.tanh(self.enc(x))
        mu, logvar = self.mu(h), self.logvar(h)
        z = mu + self.noise(mu) * torch.exp(0.5 * logvar)
        return self.dec(z), mu, logvar


class Injected(VAE):
    """The truth's VAE: the same module, its noise given (row i of the ensemble's one draw)."""

    def __init__(self, vae: VAE) -> None:
        super().__init__()
        self.load_state_dict(vae.state_dict())
        self.given: list[Tensor] = []

    def noise(self, mu: Tensor) -> Tensor:
        return self.given.pop(0)


def vae_loss(out: tuple[Tensor, Tensor, Tensor], x: Tensor, beta: Tensor | float = 1.0) -> Tensor:
    recon, mu, logvar = out
    rec = nn.functional.mse_loss(recon, x, reduction="sum") / x.shape[0]
    kl = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp()) / x.shape[0]
    return rec + beta * kl


def batches(count: int = 2) -> list[Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(BATCH, DATA, generator=g) for _ in range(count)]


def train_alone_seeded(models: list[nn.Module], xs: list[Tensor], seed: int, lr: float = 1e-2):
    """Each model alone, from the same global RNG state: what `randomness="same"` promises."""
    for m in models:
        opt = torch.optim.Adam(m.parameters(), lr=lr)
        torch.manual_seed(seed)
        for x in xs:
            opt.zero_grad()
            vae_loss(m(x), x).backward()
            opt.step()


def assert_members(ens: vmapens.Ensemble, models: list[nn.Module], **tol) -> None:
    assert len(ens) == len(models)
    for i, m in enumerate(models):
        got = ens[i].state_dict()
        for k, v in m.state_dict().items():
            torch.testing.assert_close(got[k], v, **(tol or TOL), msg=f"member {i} {k}")


@pytest.mark.parametrize(
    "options", [{}, {"chunk_size": 2}, {"backend": "loop"}], ids=["vmap", "chunks", "loop"]
)
def test_vae_with_same_randomness_equals_each_member_alone_from_the_same_seed(options):
    # randomness="same": every member draws what one module draws from the same RNG state;
    # chunks restore the RNG before each chunk, the loop before each member (docs). The
    # first-step self-check forks the RNG, so it adds no draw.
    ens = vmapens.Ensemble(VAE, n=N, seed=0, randomness="same", **options)
    alone = ens.unstack()
    step = vmapens.make_step(ens, vae_loss, vmapens.StackedAdam(ens, lr=1e-2))
    xs = batches()
    torch.manual_seed(7)
    for x in xs:
        step(x, x)
    after = torch.get_rng_state()
    train_alone_seeded(alone, xs, 7)
    assert_members(ens, alone)
    assert torch.equal(after, torch.get_rng_state())  # one draw per step, as alone


@pytest.mark.parametrize("how", ["make_step", "by_hand"])
def test_vae_with_different_randomness_draws_one_batched_draw(how):
    # The default, "different": member i's noise is row i of torch.randn(n, ...) drawn from
    # the step's RNG state ("one batched draw replaces n separate draws"): not what member i
    # draws alone (shown below), so members differ from a seeded lone run.
    ens = vmapens.Ensemble(VAE, n=N, seed=0)
    alone = [Injected(m) for m in ens.unstack()]
    seeded = ens.unstack()
    opt = vmapens.StackedAdam(ens, lr=1e-2)
    step = vmapens.make_step(ens, vae_loss, opt)
    xs = batches()
    for k, x in enumerate(xs):
        torch.manual_seed(100 + k)
        if how == "make_step":
            step(x, x)
        else:
            loss = vmapens.per_member(vae_loss)(ens(x), x)
            loss.sum().backward()
            opt.step()
            opt.zero_grad()
        torch.manual_seed(100 + k)
        draw = torch.randn(N, BATCH, LATENT)
        for i, m in enumerate(alone):
            m.given.append(draw[i])
    for m in alone:
        opt_alone = torch.optim.Adam(m.parameters(), lr=1e-2)
        for x in xs:
            opt_alone.zero_grad()
            vae_loss(m(x), x).backward()
            opt_alone.step()
        assert m.given == []
    assert_members(ens, alone)
    # A member alone from the same seeds draws other numbers (in distribution only).
    for m in seeded:
        opt_alone = torch.optim.Adam(m.parameters(), lr=1e-2)
        for k, x in enumerate(xs):
            torch.manual_seed(100 + k)
            opt_alone.zero_grad()
            vae_loss(m(x), x).backward()
            opt_alone.step()
    far = max((ens[1].state_dict()[k] - v).abs().max() for k, v in seeded[1].state_dict().items())
    assert far > 1e-3


def test_vae_beta_sweep_by_hand_and_fit_with_shuffled_batches():
    # A per-member KL weight through `per_member(..., in_dims=(0, None, 0))`, by hand; then
    # `fit` (shuffled batches from its own generator, docs/fit.md) continues from the same RNG
    # stream as a plain loop: fit draws nothing from the global RNG with `seed` given.
    betas = torch.tensor([0.5, 1.0, 2.0])
    ens = vmapens.Ensemble(VAE, n=N, seed=1, randomness="same")
    alone = ens.unstack()
    opt = vmapens.StackedAdam(ens, lr=1e-2, betas=(0.5, 0.999))
    xs = batches()
    loss_of = vmapens.per_member(vae_loss, in_dims=(0, None, 0))
    torch.manual_seed(3)
    for x in xs:
        loss_of(ens(x), x, betas).sum().backward()
        opt.step()
        opt.zero_grad()
    for m, beta in zip(alone, betas, strict=True):
        opt_alone = torch.optim.Adam(m.parameters(), lr=1e-2, betas=(0.5, 0.999))
        torch.manual_seed(3)
        for x in xs:
            opt_alone.zero_grad()
            vae_loss(m(x), x, beta).backward()
            opt_alone.step()
    assert_members(ens, alone)

    data = torch.cat(xs)
    ens = vmapens.Ensemble(VAE, n=N, seed=2, randomness="same")
    alone = ens.unstack()
    torch.manual_seed(7)
    vmapens.fit(ens, (data, data), vae_loss, epochs=2, batch_size=BATCH, lr=1e-2, seed=3,
                progress=False)  # fmt: skip
    plan = batch_plan(len(data), BATCH, 2 * len(xs), seed=3)  # 2 epochs
    train_alone_seeded(alone, [data[rows] for rows in plan], 7)
    assert_members(ens, alone)


def test_sampling_from_the_trained_decoders_under_no_grad():
    ens = vmapens.Ensemble(VAE, n=N, seed=0, randomness="same")
    step = vmapens.make_step(ens, vae_loss, vmapens.StackedAdam(ens, lr=1e-2))
    for x in batches():
        step(x, x)
    alone = ens.unstack()
    z = torch.randn(10, LATENT)
    want = torch.stack([m.dec(z) for m in alone]).detach()

    def decode(state: dict[str, Tensor], z: Tensor) -> Tensor:
        own = {k.removeprefix("dec."): v for k, v in state.items() if k.startswith("dec.")}
        return functional_call(ens.runner.dec, own, (z,))

    with torch.no_grad():
        mapped = ens.map_members(decode, z)
    decoders = vmapens.Ensemble.from_modules([m.dec for m in alone])
    rng = torch.get_rng_state()
    predicted = vmapens.predict(decoders, z)
    assert torch.equal(rng, torch.get_rng_state())  # a decoder draws nothing
    for got in (mapped, predicted):
        assert not got.requires_grad
        torch.testing.assert_close(got, want, **TOL)

    # Latents drawn inside the forward: "same" gives each member the one draw, "different"
    # row i of one [n, 10, LATENT] draw.
    for randomness in ("same", "different"):
        ens.randomness = randomness
        torch.manual_seed(11)
        with torch.no_grad():
            samples = ens(sample=10)
        torch.manual_seed(11)
        drawn = torch.randn(10, LATENT) if randomness == "same" else torch.randn(N, 10, LATENT)
        lat = [drawn if randomness == "same" else drawn[i] for i in range(N)]
        want = torch.stack([m.dec(lat[i]) for i, m in enumerate(alone)]).detach()
        torch.testing.assert_close(samples, want, **TOL)


# -- the GAN ----------------------------------------------------------------------------------

GAN_N, NOISE, GAN_LR = 4, 4, 2e-3
D_LR = [1e-3, 2e-3, 5e-4, 3e-3]  # one discriminator learning rate per member
BETAS = (0.5, 0.999)
bce = nn.BCEWithLogitsLoss()


def generator() -> nn.Module:
    # bias=False before BatchNorm: that bias's true gradient is 0 (docs/semantics.md).
    return nn.Sequential(nn.Linear(NOISE, 12, bias=False), nn.BatchNorm1d(12), nn.ReLU(),
                         nn.Linear(12, DATA))  # fmt: skip


def discriminator() -> nn.Module:
    return nn.Sequential(nn.Linear(DATA, 12), nn.LeakyReLU(0.2), nn.Linear(12, 1))


def sn_discriminator() -> nn.Module:
    return nn.Sequential(spectral_norm(nn.Linear(DATA, 12)), nn.LeakyReLU(0.2),
                         spectral_norm(nn.Linear(12, 1)))  # fmt: skip


class DropDisc(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(DATA, 12), nn.Dropout(0.25), nn.Linear(12, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.drop(nn.functional.leaky_relu(self.fc1(x), 0.2)))


class GivenMasks(nn.Module):
    """The truth's dropout: multiplies by the scaled masks the documented rule gives."""

    def __init__(self, masks: list[Tensor]) -> None:
        super().__init__()
        self.masks = masks

    def forward(self, x: Tensor) -> Tensor:
        return x * self.masks.pop(0)


def gan_batches(count: int = 2) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, DATA, generator=g) + 1.0, torch.randn(6, NOISE, generator=g))
            for _ in range(count)]  # fmt: skip


def train_pair_alone(g: nn.Module, d: nn.Module, data, d_lr: float, joint: bool = False) -> None:
    """The textbook loop: D on real and detached fake, then G through D; zero_grad after each."""
    opt_g = torch.optim.Adam(g.parameters(), lr=GAN_LR, betas=BETAS)
    opt_d = torch.optim.Adam(d.parameters(), lr=d_lr, betas=BETAS)
    for real, z in data:
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(z), 1)
        fake = g(z)
        if joint:  # one discriminator call on real and fake together
            loss_d = bce(d(torch.cat([real, fake.detach()])), torch.cat([ones, zeros]))
        else:
            loss_d = bce(d(real), ones) + bce(d(fake.detach()), zeros)
        loss_d.backward()
        opt_d.step()
        opt_d.zero_grad()
        bce(d(fake), ones).backward()
        opt_g.step()
        opt_g.zero_grad()
        opt_d.zero_grad()


@pytest.mark.parametrize("disc", [discriminator, sn_discriminator], ids=["plain", "spectral"])
def test_gan_by_hand_with_two_ensembles_and_two_stacked_adams(disc):
    ens_g = vmapens.Ensemble(generator, n=GAN_N, seed=1)
    ens_d = vmapens.Ensemble(disc, n=GAN_N, seed=2)
    gs, ds = ens_g.unstack(), ens_d.unstack()
    opt_g = vmapens.StackedAdam(ens_g, lr=GAN_LR, betas=BETAS)
    opt_d = vmapens.StackedAdam(ens_d, lr=D_LR, betas=BETAS)
    shared, own = vmapens.per_member(bce), vmapens.per_member(bce, in_dims=(0, None))
    data = gan_batches()
    for real, z in data:
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(z), 1)
        fake = ens_g(z)  # [n, 6, DATA]: member i's fakes, for discriminator i
        loss_d = shared(ens_d(real), ones) + own(ens_d(fake.detach(), in_dims=0), zeros)
        loss_d.sum().backward()
        opt_d.step()
        opt_d.zero_grad()
        own(ens_d(fake, in_dims=0), ones).sum().backward()
        opt_g.step()
        opt_g.zero_grad()
        opt_d.zero_grad()
    for i in range(GAN_N):
        train_pair_alone(gs[i], ds[i], data, D_LR[i])
    assert_members(ens_g, gs)
    assert_members(ens_d, ds)


class Pair(nn.Module):
    """One member: a generator and its discriminator. `forward(z)` is D(G(z)) for G's step;
    `forward(z, real)` scores real and detached fake together for D's step."""

    def __init__(self) -> None:
        super().__init__()
        self.G, self.D = generator(), discriminator()

    def forward(self, z: Tensor, real: Tensor | None = None) -> Tensor:
        if real is None:
            return self.D(self.G(z))
        return self.D(torch.cat([real, self.G(z).detach()]))


def test_gan_with_make_step_and_an_optimizer_over_each_half():
    # Two make_steps on one ensemble, each with a stacked Adam over one half of the member:
    # the G step's gradients reach D's parameters, which the D step must not see (each step
    # holds its own gradients, docs/semantics.md), as the lone loop's zero_grad gives.
    ens = vmapens.Ensemble(Pair, n=GAN_N, seed=3)
    alone = ens.unstack()
    named = dict(ens.named_parameters())
    half = {h: [p for k, p in named.items() if k.startswith(h + ".")] for h in ("G", "D")}
    opt_g = vmapens.StackedAdam(half["G"], lr=GAN_LR, betas=BETAS)
    opt_d = vmapens.StackedAdam(half["D"], lr=D_LR, betas=BETAS)
    step_d = vmapens.make_step(ens, bce, opt_d)
    step_g = vmapens.make_step(ens, bce, opt_g)
    data = gan_batches()
    for real, z in data:
        step_d((z, real), torch.cat([torch.ones(6, 1), torch.zeros(6, 1)]))
        step_g(z, torch.ones(6, 1))
    for i, m in enumerate(alone):  # the member alone runs G twice too (BatchNorm counts)
        opt_g = torch.optim.Adam(m.G.parameters(), lr=GAN_LR, betas=BETAS)
        opt_d = torch.optim.Adam(m.D.parameters(), lr=D_LR[i], betas=BETAS)
        for real, z in data:
            opt_d.zero_grad()
            bce(m(z, real), torch.cat([torch.ones(6, 1), torch.zeros(6, 1)])).backward()
            opt_d.step()
            opt_g.zero_grad()
            bce(m(z), torch.ones(6, 1)).backward()
            opt_g.step()
    assert_members(ens, alone)


@pytest.mark.parametrize("randomness", ["different", "same"])
def test_gan_dropout_discriminator_make_step_on_per_member_fakes(randomness):
    # D's step through make_step on each member's own fakes (in_dims=0), G's step by hand
    # without zeroing D's gradients (make_step's step holds its own). Dropout in D draws per
    # the documented rule: "same" one mask for all, "different" row i of one stacked draw.
    ens_g = vmapens.Ensemble(generator, n=GAN_N, seed=1)
    ens_d = vmapens.Ensemble(DropDisc, n=GAN_N, seed=2, randomness=randomness)
    gs, ds = ens_g.unstack(), ens_d.unstack()
    opt_g = vmapens.StackedAdam(ens_g, lr=GAN_LR, betas=BETAS)
    step_d = vmapens.make_step(ens_d, bce, vmapens.StackedAdam(ens_d, lr=D_LR, betas=BETAS),
                               in_dims=0)  # fmt: skip
    data = gan_batches()
    ones, labels = torch.ones(6, 1), torch.cat([torch.ones(6, 1), torch.zeros(6, 1)])
    masks: list[list[Tensor]] = [[] for _ in range(GAN_N)]
    for k, (real, z) in enumerate(data):
        torch.manual_seed(50 + k)
        fake = ens_g(z)
        step_d(torch.cat([real.expand(GAN_N, -1, -1), fake.detach()], 1),
               labels.expand(GAN_N, -1, -1))  # fmt: skip
        own = vmapens.per_member(bce, in_dims=(0, None))(ens_d(fake, in_dims=0), ones)
        own.sum().backward()
        opt_g.step()
        opt_g.zero_grad()
        torch.manual_seed(50 + k)
        for rows in (12, 6):  # D's step, then G's step
            lead = (GAN_N,) if randomness == "different" else ()
            drawn = torch.empty(*lead, rows, 12).bernoulli_(0.75).div_(0.75)
            for i in range(GAN_N):
                masks[i].append(drawn[i] if lead else drawn)
    for i in range(GAN_N):
        ds[i].drop = GivenMasks(masks[i])
        train_pair_alone(gs[i], ds[i], data, D_LR[i], joint=True)
        assert masks[i] == []
    assert_members(ens_g, gs)
    assert_members(ens_d, ds)


def test_dropout_eval_mode_is_deterministic_and_draws_nothing():
    ens = vmapens.Ensemble(DropDisc, n=GAN_N, seed=2)
    alone = ens.unstack()
    x = torch.randn(7, DATA)
    ens.eval()
    rng = torch.get_rng_state()
    first, second = ens(x), ens(x)
    assert torch.equal(first, second) and torch.equal(rng, torch.get_rng_state())
    want = torch.stack([m.eval()(x) for m in alone]).detach()
    torch.testing.assert_close(first.detach(), want, **TOL)
    ens.train()
    predicted = vmapens.predict(ens, x)  # eval under no_grad, the mode given back
    assert ens.template.drop.training and torch.equal(rng, torch.get_rng_state())
    torch.testing.assert_close(predicted, want, **TOL)
    # Monte Carlo dropout (docs/workflows.md): dropout alone back in train mode, per member.
    ens.eval().apply(lambda m: m.train() if isinstance(m, nn.Dropout) else None)
    torch.manual_seed(5)
    with torch.no_grad():
        mc = ens(x)
    torch.manual_seed(5)
    drawn = torch.empty(GAN_N, 7, 12).bernoulli_(0.75).div_(0.75)
    for i, m in enumerate(alone):
        m.eval().drop = GivenMasks([drawn[i]])
        torch.testing.assert_close(mc[i], m(x).detach(), **TOL)
    assert not torch.equal(mc[0], mc[1])


# -- fit's up-front validation forward (Evaluator.check) leaves the global RNG as it was ------


def test_fit_with_val_data_draws_what_the_plain_loop_draws():
    data, val = torch.cat(batches(2)), batches(3)[2]
    ens = vmapens.Ensemble(VAE, n=N, seed=0, randomness="same")
    alone = ens.unstack()
    torch.manual_seed(7)
    history = vmapens.fit(ens, (data, data), vae_loss, epochs=1, batch_size=BATCH, lr=1e-2,
                          shuffle=False, val_data=(val, val), progress=False)  # fmt: skip
    scores = []
    for m in alone:  # train one epoch, then validate in eval mode under no_grad
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        torch.manual_seed(7)
        for x in (data[:BATCH], data[BATCH:]):
            opt.zero_grad()
            vae_loss(m(x), x).backward()
            opt.step()
        with torch.no_grad():
            scores.append(vae_loss(copy.deepcopy(m).eval()(val), val))
    assert_members(ens, alone)
    torch.testing.assert_close(history.val_loss[0], torch.stack(scores), **TOL)
