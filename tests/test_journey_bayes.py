"""A user journey: deep ensembles of Bayesian networks (float64, 3 members, tiny MLPs).

The script a researcher writes from README.md, docs/semantics.md ("Randomness in the forward
pass", "Storage" on tensors a forward keeps), docs/workflows.md ("Predictions and
uncertainty": Monte Carlo dropout) and docs/fit.md ("One file per member"):

* Bayes-by-Backprop linear layers (`mu`, `rho`; each forward draws its weights as
  `mu + softplus(rho) * torch.randn_like(mu)`), the KL to a Gaussian prior returned with the
  output, the ELBO `NLL + KL / num_batches`, trained with `make_step`, a hand-written loop
  (`per_member`) and `fit`; MC predictions with `predict`; the KL kept on `self.kl` instead
  (as many codebases do) and read by the training loop after `ens(x)`;
* MC dropout at test time: `ens.eval()` with the dropout layers put back in train mode, T=10
  stochastic passes, the predictive mean and entropy;
* a local-reparameterisation layer (the pre-activations sampled, not the weights), then
  `unstack()` and member files.

The truth (docs/semantics.md): with `randomness="same"` each member draws what it draws alone
from the same global RNG state (exactly, eager, with `chunk_size` and `backend="loop"`); with
`"different"` member `i` gets row `i` of one batched draw of the stacked shape (vmap, no
chunks), not what it draws alone; chunks and the loop draw other numbers, equal in
distribution, which is checked by statistics (independent members, standard normal draws).
Each member is a plain module trained alone with `torch.optim.Adam` on the same batches.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from truth import batch_plan

import vmapens

pytestmark = pytest.mark.usefixtures("float64_default")

N, IN, HIDDEN, NB, ROWS, T = 3, 3, 6, 2, 5, 10
TOL = {"rtol": 1e-10, "atol": 1e-10}  # float64, the same maths summed in another order
OPTIONS = [{}, {"chunk_size": 2}, {"backend": "loop"}]
IDS = ["vmap", "chunks", "loop"]


# -- the layers -------------------------------------------------------------------------------


def kl_normal(mu: Tensor, sigma: Tensor, prior: float) -> Tensor:
    """KL(N(mu, sigma^2) || N(0, prior^2)), summed."""
    return (math.log(prior) - torch.log(sigma) + (sigma**2 + mu**2) / (2 * prior**2) - 0.5).sum()


class BayesLinear(nn.Module):
    """Bayes by Backprop: a weight drawn at every forward (the reparameterisation trick)."""

    def __init__(self, i: int, o: int, prior: float = 1.0) -> None:
        super().__init__()
        self.w_mu = nn.Parameter(0.3 * torch.randn(o, i))
        self.w_rho = nn.Parameter(-3.0 + 0.1 * torch.randn(o, i))
        self.b_mu = nn.Parameter(torch.zeros(o))
        self.b_rho = nn.Parameter(torch.full((o,), -3.0))
        self.prior = prior
        self.kl = 0.0  # as blitz / many codebases: a number until the first forward

    def noise(self, like: Tensor) -> Tensor:
        return torch.randn_like(like)

    def forward(self, x: Tensor) -> Tensor:
        ws, bs = F.softplus(self.w_rho), F.softplus(self.b_rho)
        w = self.w_mu + ws * self.noise(self.w_mu)
        b = self.b_mu + bs * self.noise(self.b_mu)
        self.kl = kl_normal(self.w_mu, ws, self.prior) + kl_normal(self.b_mu, bs, self.prior)
        return F.linear(x, w, b)


class BNN(nn.Module):
    """Returns the output and the KL (the way that needs nothing kept on the module)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = BayesLinear(IN, HIDDEN), BayesLinear(HIDDEN, 1)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        out = self.l2(torch.tanh(self.l1(x)))
        return out, self.l1.kl + self.l2.kl


class Injected(BayesLinear):
    """The truth's layer for `"different"`: its noise given (row i of the ensemble's draws)."""

    given: list[Tensor]

    def noise(self, like: Tensor) -> Tensor:
        return self.given.pop(0)


def elbo(out: tuple[Tensor, Tensor], y: Tensor) -> Tensor:
    pred, kl = out
    return F.mse_loss(pred, y, reduction="sum") + kl / NB


def data(count: int = NB, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(ROWS, IN, generator=g), torch.randn(ROWS, 1, generator=g))
        for _ in range(count)
    ]


def train_alone(models: list[nn.Module], batches: list, seed: int | None, loss=elbo) -> None:
    """Each member alone, with torch.optim.Adam; from `torch.manual_seed(seed)` (what
    `randomness="same"` promises: every member draws from the same RNG state)."""
    for m in models:
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        if seed is not None:
            torch.manual_seed(seed)
        for x, y in batches:
            opt.zero_grad()
            loss(m(x), y).backward()
            opt.step()


def assert_members(ens: vmapens.Ensemble, models: list[nn.Module]) -> None:
    for i, m in enumerate(models):
        got = ens[i].state_dict()
        for k, v in m.state_dict().items():
            torch.testing.assert_close(got[k], v, **TOL, msg=f"member {i} {k}")


# -- Bayes by Backprop ------------------------------------------------------------------------


@pytest.mark.parametrize("options", OPTIONS, ids=IDS)
def test_bbb_same_randomness_make_step_equals_each_member_alone(options):
    ens = vmapens.Ensemble(BNN, n=N, seed=0, randomness="same", **options)
    alone = ens.unstack()
    step = vmapens.make_step(ens, elbo, vmapens.StackedAdam(ens, lr=1e-2))
    batches = data() * 2  # two epochs of NB batches
    torch.manual_seed(5)
    for x, y in batches:
        losses = step(x, y)
    after = torch.get_rng_state()
    assert losses.shape == (N,)
    train_alone(alone, batches, seed=5)
    assert_members(ens, alone)
    assert torch.equal(after, torch.get_rng_state())  # one member's draws per step, as alone


def test_bbb_different_hand_loop_draws_rows_of_one_batched_draw():
    # The default "different", a hand-written loop: member i's noise is row i of
    # torch.randn(n, *shape), one draw per `randn_like` in forward order.
    ens = vmapens.Ensemble(BNN, n=N, seed=0)
    alone = ens.unstack()
    opt = vmapens.StackedAdam(ens, lr=1e-2)
    draws: list[list[Tensor]] = []
    for k, (x, y) in enumerate(data()):
        torch.manual_seed(100 + k)
        loss = vmapens.per_member(elbo)(ens(x), y)
        assert loss.shape == (N,)
        loss.sum().backward()
        opt.step()
        opt.zero_grad()
        torch.manual_seed(100 + k)
        draws.append([torch.randn(N, *p.shape) for p in (alone[0].l1.w_mu, alone[0].l1.b_mu)])
        draws[-1] += [torch.randn(N, *p.shape) for p in (alone[0].l2.w_mu, alone[0].l2.b_mu)]
    for i, m in enumerate(alone):
        for layer, first in ((m.l1, 0), (m.l2, 2)):
            layer.__class__ = Injected
            layer.given = [d[j][i] for d in draws for j in (first, first + 1)]
    train_alone(alone, data(), seed=None)
    assert all(layer.given == [] for m in alone for layer in (m.l1, m.l2))
    assert_members(ens, alone)


def test_bbb_fit_same_randomness_with_shuffled_batches_equals_alone():
    # fit with a seed shuffles with its own generator (docs/fit.md), leaving the global RNG
    # to the forward's draws; its first-step self-check forks the RNG.
    ens = vmapens.Ensemble(BNN, n=N, seed=0, randomness="same")
    alone = ens.unstack()
    x = torch.cat([b[0] for b in data()])
    y = torch.cat([b[1] for b in data()])
    torch.manual_seed(11)
    history = vmapens.fit(
        ens, (x, y), elbo, epochs=2, batch_size=ROWS, lr=1e-2, seed=3, progress=False
    )
    after = torch.get_rng_state()
    assert history.epochs == 2
    plan = batch_plan(len(x), ROWS, 2 * NB, seed=3)
    train_alone(alone, [(x[r], y[r]) for r in plan], seed=11)
    assert_members(ens, alone)
    assert torch.equal(after, torch.get_rng_state())


def test_bbb_mc_predict_same_and_different():
    # MC predictions: T calls of `predict` (eval mode, no grad; the layers sample anyway).
    ens = vmapens.Ensemble(BNN, n=N, seed=0, randomness="same")
    alone = ens.unstack()
    x = data(1, seed=4)[0][0]
    torch.manual_seed(21)
    samples = torch.stack([vmapens.predict(ens, x)[0] for _ in range(T)])  # [T, n, rows, 1]
    for i, m in enumerate(alone):
        torch.manual_seed(21)
        with torch.no_grad():
            own = torch.stack([m.eval()(x)[0] for _ in range(T)])
        torch.testing.assert_close(samples[:, i], own, **TOL)
    mean, spread = samples.mean((0, 1)), samples.var((0, 1))  # predictive mean and variance
    assert mean.shape == spread.shape == (ROWS, 1) and bool((spread > 0).all())

    ens.randomness = "different"
    torch.manual_seed(22)
    got = vmapens.predict(ens, x)[0]
    torch.manual_seed(22)
    rows = [torch.randn(N, *p.shape) for p in (alone[0].l1.w_mu, alone[0].l1.b_mu)]
    rows += [torch.randn(N, *p.shape) for p in (alone[0].l2.w_mu, alone[0].l2.b_mu)]
    for i, m in enumerate(alone):
        m.l1.__class__ = m.l2.__class__ = Injected
        m.l1.given, m.l2.given = [rows[0][i], rows[1][i]], [rows[2][i], rows[3][i]]
        with torch.no_grad():
            torch.testing.assert_close(got[i], m(x)[0], **TOL)


class Weights(nn.Module):
    """One Bayesian layer that returns its drawn noise: the draws themselves, for statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.mu = nn.Parameter(torch.zeros(40, 50))

    def forward(self) -> Tensor:
        return torch.randn_like(self.mu)


@pytest.mark.parametrize("options", OPTIONS, ids=IDS)
def test_different_draws_are_independent_standard_normals_per_member(options):
    # Where bits cannot match ("different" with chunks or the loop), the docs promise the
    # same distribution: each member standard normal, independent of the others. 2000 draws
    # per member: a correlation or mean beyond 0.1 is 4.5 standard errors.
    ens = vmapens.Ensemble(Weights, n=N, seed=0, **options)
    eps = ens().reshape(N, -1)
    assert eps.mean(1).abs().max() < 0.1 and (eps.std(1) - 1).abs().max() < 0.1
    corr = torch.corrcoef(eps)
    assert (corr - torch.eye(N)).abs().max() < 0.1
    same = vmapens.Ensemble(Weights, n=N, seed=0, randomness="same", **options)
    torch.manual_seed(0)
    shared = same()
    torch.manual_seed(0)
    own = torch.randn(40, 50)  # what one member draws alone from that state
    assert all(torch.equal(shared[i], own) for i in range(N))


# -- the KL kept on the module ----------------------------------------------------------------


def layer_kl(layer: nn.Module) -> Tensor:
    """A BayesLinear's KL written again from its formula, on a plain module."""
    return kl_normal(layer.w_mu, F.softplus(layer.w_rho), 1.0) + kl_normal(
        layer.b_mu, F.softplus(layer.b_rho), 1.0
    )


def own_kl(m: BNN) -> Tensor:
    return layer_kl(m.l1) + layer_kl(m.l2)


@pytest.mark.parametrize("how", [{}, {"chunk_size": 2}, {"backend": "loop"}])
def test_kl_kept_on_the_module_is_in_each_members_copy(how: dict) -> None:
    # docs/semantics.md: after `ens(x)`, `ens[i]` holds member i's own kept tensor (detached),
    # as member i alone holds its own after the same forward.
    ens = vmapens.Ensemble(BNN, n=N, seed=0, **how)
    out, kl = ens(data(1)[0][0])
    assert out.shape == (N, ROWS, 1) and kl.shape == (N,)
    for i, m in enumerate(ens.unstack()):
        torch.testing.assert_close(kl[i], own_kl(m), **TOL)  # the returned KL: each its own
        for name in ("l1", "l2"):
            got = getattr(ens[i], name).kl
            assert got.grad_fn is None  # a copy, detached
            torch.testing.assert_close(got, layer_kl(getattr(m, name)), **TOL)


@pytest.mark.parametrize("how", [{}, {"chunk_size": 2}, {"backend": "loop"}])
def test_hand_loop_reading_the_kept_kl_gets_each_members_own(how: dict) -> None:
    # The loop of many Bayes-by-Backprop codebases: `out = model(x)`, then the KL summed over
    # the Bayesian layers' `self.kl`. The ensemble's modules are `ens.template`'s (ens.modules()
    # yields the ensemble alone, docs/workflows.md). Until session 32 the template kept
    # __init__'s 0.0 there and the ELBO trained without its KL, silently; now each layer holds
    # its members' KLs stacked, [n], with their graph: the KL's gradients are each member's own.
    ens = vmapens.Ensemble(BNN, n=N, seed=0, **how)
    alone = ens.unstack()
    ens(data(1)[0][0])
    kl = sum(m.kl for m in ens.template.modules() if isinstance(m, BayesLinear))
    assert isinstance(kl, Tensor) and kl.shape == (N,)
    kl.sum().backward()
    for i, m in enumerate(alone):
        want = own_kl(m)
        want.backward()
        torch.testing.assert_close(kl[i], want, **TOL)
        for name, p in m.named_parameters():
            torch.testing.assert_close(ens.stacked_params()[name].grad[i], p.grad, **TOL)
    # a second call sets them anew (the runner keeps its own; nothing is followed to it)
    ens.zero_grad()
    again = ens(data(1)[0][0])[1]
    kl = sum(m.kl for m in ens.template.modules() if isinstance(m, BayesLinear))
    torch.testing.assert_close(kl, again, **TOL)


# -- MC dropout ---------------------------------------------------------------------------------


def dropout_member() -> nn.Module:
    return nn.Sequential(nn.Linear(IN, 8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 3))


def ce(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out, y)


def entropy(p: Tensor) -> Tensor:
    return -(p * p.log()).sum(-1)


@pytest.mark.parametrize("how", ["template", "apply"])
def test_mc_dropout_after_training_equals_each_member_alone(how):
    ens = vmapens.Ensemble(dropout_member, n=N, seed=0, randomness="same")
    alone = ens.unstack()
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(ROWS, IN, generator=g), torch.randint(3, (ROWS,), generator=g))
        for _ in range(3)
    ]
    step = vmapens.make_step(ens, ce, vmapens.StackedAdam(ens, lr=1e-2))
    torch.manual_seed(2)
    for x, y in batches:
        step(x, y)
    train_alone(alone, batches, seed=2, loss=ce)
    assert_members(ens, alone)

    ens.eval()
    if how == "template":  # the brief's way: the template's Dropout layers back in train mode
        for m in ens.template.modules():
            if isinstance(m, nn.Dropout):
                m.train()
    else:  # docs/workflows.md's way
        ens.apply(lambda m: m.train() if isinstance(m, nn.Dropout) else None)
    assert not ens.training and ens[0][2].training and not ens[0][0].training
    x_test = torch.randn(7, IN, generator=g)
    torch.manual_seed(9)
    with torch.no_grad():
        probs = torch.stack([ens(x_test).softmax(-1) for _ in range(T)])  # [T, n, 7, 3]
    mean = probs.mean((0, 1))
    owns = []
    for i, m in enumerate(alone):
        m.eval()
        m[2].train()
        torch.manual_seed(9)
        with torch.no_grad():
            own = torch.stack([m(x_test).softmax(-1) for _ in range(T)])
        torch.testing.assert_close(probs[:, i], own, **TOL)
        owns.append(own)
    assert not torch.equal(probs[0], probs[1])  # the passes draw new masks
    # The predictive mean over passes and members, and its entropy (total uncertainty).
    by_hand = torch.stack(owns).mean((0, 1))
    torch.testing.assert_close(mean, by_hand, **TOL)
    torch.testing.assert_close(entropy(mean), entropy(by_hand), **TOL)
    assert bool((entropy(mean) > 0).all())
    # predict runs every module in eval mode (no masks), then gives the modes back.
    plain = vmapens.predict(ens, x_test, reduce="mean", softmax=True)
    with torch.no_grad():
        torch.testing.assert_close(
            plain, torch.stack([m.eval()(x_test).softmax(-1) for m in alone]).mean(0), **TOL
        )
    assert ens[0][2].training and not ens[0][0].training


# -- local reparameterisation --------------------------------------------------------------------


class LocalReparam(nn.Module):
    """Samples the pre-activations: mean x mu^T, variance x^2 softplus(rho)^2^T."""

    def __init__(self, i: int, o: int) -> None:
        super().__init__()
        self.mu = nn.Parameter(0.3 * torch.randn(o, i))
        self.rho = nn.Parameter(-3.0 + 0.1 * torch.randn(o, i))

    def forward(self, x: Tensor) -> Tensor:
        mean = F.linear(x, self.mu)
        var = F.linear(x**2, F.softplus(self.rho) ** 2)
        return mean + var.sqrt() * torch.randn_like(mean)


class LRTNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = LocalReparam(IN, HIDDEN), LocalReparam(HIDDEN, 1)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        kl = sum(kl_normal(m.mu, F.softplus(m.rho), 1.0) for m in (self.l1, self.l2))
        return self.l2(torch.tanh(self.l1(x))), kl


@pytest.mark.parametrize("options", OPTIONS, ids=IDS)
def test_local_reparameterisation_same_then_unstack_and_member_files(options, tmp_path):
    ens = vmapens.Ensemble(LRTNet, n=N, seed=0, randomness="same", **options)
    alone = ens.unstack()
    step = vmapens.make_step(ens, elbo, vmapens.StackedAdam(ens, lr=1e-2))
    torch.manual_seed(31)
    for x, y in data():
        step(x, y)
    train_alone(alone, data(), seed=31)
    assert_members(ens, alone)
    paths = vmapens.save_members(ens, tmp_path / "members")
    for i, (model, path) in enumerate(zip(ens.unstack(), paths, strict=True)):
        fresh = LRTNet()
        fresh.load_state_dict(torch.load(path))  # plain torch reads a member file
        for k, v in alone[i].state_dict().items():
            torch.testing.assert_close(fresh.state_dict()[k], v, **TOL)
            torch.testing.assert_close(model.state_dict()[k], v, **TOL)
    loaded = vmapens.load_members(tmp_path / "members")
    assert len(loaded) == N
    for sd, m in zip(loaded, alone, strict=True):
        for k, v in m.state_dict().items():
            torch.testing.assert_close(sd[k], v, **TOL)
