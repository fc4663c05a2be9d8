"""Journey: adversarial training of an ensemble of small classifiers (float64, 3 members).

A researcher trains an MLP ensemble and a tiny CNN ensemble with BatchNorm adversarially:

(a) PGD (3 steps, sign step, projection with clamp) where each member attacks itself: the
    inputs `x_adv` `[n, B, ...]` require grad, `ens(x_adv, in_dims=0)`, the summed
    `vmapens.per_member` loss and `torch.autograd.grad(..., x_adv)` give row `i` member `i`'s own
    input gradient (docs/semantics.md, "What it found": give each member its own copy); then
    a training step on the adversarial batch with `make_step(..., in_dims=0)`, `fit` or a
    hand loop. The attack runs with the ensemble in eval mode (BatchNorm statistics must not
    move) or in train mode (they move as alone, once per attack forward).
(b) PGD against the ensemble mean (one shared `x_adv` attacking the averaged logits), each
    member then trained on the shared adversarial examples, by `make_step` and by `fit` over
    an iterable that attacks the live ensemble as `fit` reads each batch.
(c) TRADES: a KL attack between clean and adversarial outputs, then CE + beta * KL per
    member, by hand and through `make_step` with the clean logits as a target computed from
    the ensemble and not detached (docs/semantics.md: the eager step back-propagates through
    it into each member as alone).
(d) gradient bookkeeping: `x_adv.grad` accumulated over PGD steps by `loss.backward()` when
    the user forgets to zero it (and the attack's parameter gradients with it), "free"
    adversarial training (one backward for parameters and perturbation), an input that
    still requires grad handed to the step (docs/semantics.md: it gets no `.grad`), and an
    L2 attack kept in the graph (`create_graph=True`) into the batch.

The truth: each member as a plain module, attacked and trained alone with `torch.optim` on the
same clean batches (tests/truth.py's `seeded_members`). Adversarial examples are compared
exactly where a sign or a clamp could flip on round-off (they do not, at these sizes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import vmapens
from tests.models import CNN, MLP
from tests.truth import TOL64, assert_members_equal, seeded_members

N, B, EPS, ALPHA, PGD_STEPS, LR, BETA = 3, 6, 0.1, 0.04, 3, 1e-2, 6.0
ce_each = vmapens.per_member(F.cross_entropy)


def mlp() -> nn.Module:
    return MLP(4, 8, 3).double()


def cnn() -> nn.Module:
    return CNN().double()  # Conv2d (no bias) -> BatchNorm2d -> Linear, 6x6 inputs


SHAPES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "mlp": (mlp, (4,)),
    "cnn": (cnn, (1, 6, 6)),
}


def clean_batches(shape: tuple[int, ...], count: int, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.rand(B, *shape, generator=g, dtype=torch.float64),
            torch.randint(3, (B,), generator=g),
        )
        for _ in range(count)
    ]


def project(xa: Tensor, x: Tensor) -> Tensor:
    return torch.min(torch.max(xa, x - EPS), x + EPS).clamp(0, 1)


def stacked(y: Tensor) -> Tensor:
    return y.expand(N, *y.shape)


def buffers(ens: vmapens.Ensemble) -> dict[str, Tensor]:
    return {k: v.clone() for k, v in ens.state_dict().items() if "running" in k or "tracked" in k}


# The truth: one plain module attacked and trained alone ----------------------------------


def pgd_alone(m: nn.Module, x: Tensor, y: Tensor, eval_attack: bool) -> tuple[Tensor, list]:
    """The user's PGD for one model: eval for the attack (or not), back to the mode it had."""
    was = m.training
    m.train(not eval_attack and was)
    xa, grads = x.clone(), []
    for _ in range(PGD_STEPS):
        xa.requires_grad_()
        (gx,) = torch.autograd.grad(F.cross_entropy(m(xa), y), xa)
        grads.append(gx)
        xa = project(xa.detach() + ALPHA * gx.sign(), x)
    m.train(was)
    return xa.detach(), grads


def pgd_ens(ens: vmapens.Ensemble, x: Tensor, y: Tensor, eval_attack: bool) -> tuple[Tensor, list]:
    """The same PGD, every member attacking itself: one copy of the batch per member."""
    was = ens.training
    if eval_attack:
        ens.eval()
    xs = x.expand(N, *x.shape)
    xa, grads = xs.clone(), []
    for _ in range(PGD_STEPS):
        xa.requires_grad_()
        (gx,) = torch.autograd.grad(ce_each(ens(xa, in_dims=0), y).sum(), xa)
        grads.append(gx)
        xa = project(xa.detach() + ALPHA * gx.sign(), xs)
    ens.train(was)
    return xa.detach(), grads


# (a) each member attacks itself, then trains on its own adversarial batch -------------------


CASES = [
    ("mlp", True, "fit"),
    ("cnn", True, "step"),
    ("cnn", False, "step"),
    ("cnn", True, "fit"),
    ("cnn", False, "hand"),
]


@pytest.mark.parametrize(
    ("model", "eval_attack", "trainer"),
    CASES,
    ids=[f"{m}-{'eval' if e else 'train'}-attack-{t}" for m, e, t in CASES],
)
def test_pgd_where_each_member_attacks_itself_trains_as_alone(
    model: str, eval_attack: bool, trainer: str
) -> None:
    factory, shape = SHAPES[model]
    batches = clean_batches(shape, 2)
    ens = vmapens.Ensemble(factory, n=N, seeds=range(N))
    plain = seeded_members(factory, N)
    opts = [torch.optim.Adam(m.parameters(), lr=LR) for m in plain]
    stacked_opt = vmapens.StackedAdam(ens, lr=LR)
    step = vmapens.make_step(ens, F.cross_entropy, stacked_opt, in_dims=0)
    for k, (x, y) in enumerate(batches):
        before = buffers(ens)
        xa, grads = pgd_ens(ens, x, y, eval_attack)
        assert ens.training
        owns = []
        for i, m in enumerate(plain):
            own, own_grads = pgd_alone(m, x, y, eval_attack)
            owns.append(own)
            for got, want in zip(grads, own_grads, strict=True):
                torch.testing.assert_close(got[i], want, **TOL64)  # member i's own gradient
            torch.testing.assert_close(xa[i], own, rtol=0, atol=1e-15)
        if eval_attack:  # the attack moved no statistics
            for name, value in buffers(ens).items():
                torch.testing.assert_close(value, before[name], rtol=0, atol=0, msg=name)
        assert_members_equal(ens, plain)  # train-mode attacks moved them as alone
        if trainer == "step":
            step(xa, stacked(y))
        elif trainer == "fit":
            vmapens.fit(
                ens, (xa, stacked(y)), F.cross_entropy, steps=1, in_dims=0,
                optimizer=stacked_opt, progress=False, seed=k,
            )  # fmt: skip
        else:
            stacked_opt.zero_grad()
            ce_each(ens(xa, in_dims=0), y).sum().backward()
            stacked_opt.step()
        for m, opt, own in zip(plain, opts, owns, strict=True):
            opt.zero_grad()
            F.cross_entropy(m(own), y).backward()
            opt.step()
    assert_members_equal(ens, plain)


def test_robust_accuracy_per_member_on_its_own_examples_as_alone() -> None:
    """`predict(..., in_dims=0)` scores each member on its own adversarial batch, in eval."""
    ens = vmapens.Ensemble(cnn, n=N, seeds=range(N))
    plain = seeded_members(cnn, N)
    ((x, y),) = clean_batches((1, 6, 6), 1, seed=3)
    xa, _ = pgd_ens(ens, x, y, eval_attack=True)
    got = vmapens.predict(ens, xa, in_dims=0)
    for i, m in enumerate(plain):
        own, _ = pgd_alone(m, x, y, eval_attack=True)
        torch.testing.assert_close(got[i], m.eval()(own), **TOL64)
    assert ens.training


# (b) one attack against the ensemble mean, every member trained on it ---------------------


def mean_attack(models: Callable[[Tensor], Tensor], x: Tensor, y: Tensor) -> Tensor:
    xa = x.clone()
    for _ in range(PGD_STEPS):
        xa.requires_grad_()
        (gx,) = torch.autograd.grad(F.cross_entropy(models(xa).mean(0), y), xa)
        xa = project(xa.detach() + ALPHA * gx.sign(), x)
    return xa.detach()


class AttackingBatches:
    """Re-iterable data for `fit`: each clean batch attacked against the live ensemble's mean
    (in eval mode, back to the mode it had) when `fit` reads it."""

    def __init__(self, ens: vmapens.Ensemble, clean: list[tuple[Tensor, Tensor]]) -> None:
        self.ens, self.clean = ens, clean

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        for x, y in self.clean:
            was = self.ens.training
            self.ens.eval()
            xa = mean_attack(self.ens, x, y)
            self.ens.train(was)
            yield xa, y


@pytest.mark.parametrize("trainer", ["step", "fit"])
def test_attack_on_the_ensemble_mean_then_every_member_trains_on_it(trainer: str) -> None:
    clean = clean_batches((1, 6, 6), 3, seed=1)
    ens = vmapens.Ensemble(cnn, n=N, seeds=range(N))
    plain = seeded_members(cnn, N)
    opts = [torch.optim.Adam(m.parameters(), lr=LR) for m in plain]
    if trainer == "fit":
        vmapens.fit(
            ens, AttackingBatches(ens, clean), F.cross_entropy, epochs=1,
            optimizer=lambda e: vmapens.StackedAdam(e, lr=LR), progress=False, seed=0,
        )  # fmt: skip
    else:  # attack in train mode: every member's statistics move, as each alone
        step = vmapens.make_step(ens, F.cross_entropy, vmapens.StackedAdam(ens, lr=LR))
        for x, y in clean:
            step(mean_attack(ens, x, y), y)
    for x, y in clean:
        for m in plain:
            m.train(trainer == "step")
        xa = mean_attack(lambda z: torch.stack([m(z) for m in plain]), x, y)
        for m, opt in zip(plain, opts, strict=True):
            m.train()
            opt.zero_grad()
            F.cross_entropy(m(xa), y).backward()
            opt.step()
    assert_members_equal(ens, plain)


# (c) TRADES ---------------------------------------------------------------------------------


def kl(adv: Tensor, nat: Tensor) -> Tensor:
    return F.kl_div(F.log_softmax(adv, -1), F.softmax(nat, -1), reduction="sum")


def trades_loss(out_adv: Tensor, target: tuple[Tensor, Tensor]) -> Tensor:
    y, nat = target
    return F.cross_entropy(nat, y) + BETA / B * kl(out_adv, nat)


@pytest.mark.parametrize("trainer", ["hand", "step"])
def test_trades_with_a_kl_attack_per_member_trains_as_alone(trainer: str) -> None:
    clean = clean_batches((1, 6, 6), 2, seed=2)
    g = torch.Generator().manual_seed(7)
    starts = [1e-3 * torch.randn(N, B, 1, 6, 6, generator=g, dtype=torch.float64) for _ in clean]
    ens = vmapens.Ensemble(cnn, n=N, seeds=range(N))
    opt = vmapens.StackedAdam(ens, lr=LR)
    step = vmapens.make_step(ens, trades_loss, opt, in_dims=0)
    kl_each = vmapens.per_member(kl, in_dims=(0, 0))
    for (x, y), start in zip(clean, starts, strict=True):
        ens.eval()
        xa = x + start
        for _ in range(PGD_STEPS):
            xa.requires_grad_()
            (gx,) = torch.autograd.grad(kl_each(ens(xa, in_dims=0), ens(x)).sum(), xa)
            xa = project(xa.detach() + ALPHA * gx.sign(), x)
        ens.train()
        if trainer == "step":  # the clean logits: a target from the ensemble, not detached
            step(xa, (stacked(y), ens(x)))
        else:
            opt.zero_grad()
            nat = ens(x)
            (ce_each(nat, y) + BETA / B * kl_each(ens(xa, in_dims=0), nat)).sum().backward()
            opt.step()
    plain = seeded_members(cnn, N)
    for i, m in enumerate(plain):
        alone = torch.optim.Adam(m.parameters(), lr=LR)
        for (x, y), start in zip(clean, starts, strict=True):
            m.eval()
            xa = x + start[i]
            for _ in range(PGD_STEPS):
                xa.requires_grad_()
                (gx,) = torch.autograd.grad(kl(m(xa), m(x)), xa)
                xa = project(xa.detach() + ALPHA * gx.sign(), x)
            m.train()
            alone.zero_grad()
            nat = m(x)
            trades_loss(m(xa), (y, nat)).backward()
            alone.step()
    assert_members_equal(ens, plain)


# (d) gradient bookkeeping -------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["vmap", "loop"])
def test_a_forgotten_x_adv_grad_accumulates_as_alone_and_the_step_ignores_it(backend: str) -> None:
    """PGD with `loss.backward()` and no `x_adv.grad.zero_()`: the gradients pile up in
    `x_adv.grad` (and in the parameters' `.grad`) exactly as alone; `make_step` then replaces
    the parameters' `.grad` (docs/fit.md) as the plain loop's `zero_grad`, and leaves
    `x_adv.grad` as the attack left it."""
    ((x, y),) = clean_batches((1, 6, 6), 1, seed=4)
    ens = vmapens.Ensemble(cnn, n=N, seeds=range(N), backend=backend)
    step = vmapens.make_step(ens, F.cross_entropy, vmapens.StackedAdam(ens, lr=LR), in_dims=0)
    xa = x.expand(N, *x.shape).clone().requires_grad_()
    piled = []
    for _ in range(PGD_STEPS):
        ce_each(ens(xa, in_dims=0), y).sum().backward()
        piled.append(xa.grad.clone())
        with torch.no_grad():
            xa += ALPHA * xa.grad.sign()
            xa.copy_(project(xa, x))
    param_grads = [p.grad.clone() for p in ens.parameters()]
    step(xa, stacked(y))  # still requires grad: gets no .grad from the step
    torch.testing.assert_close(xa.grad, piled[-1], rtol=0, atol=0)
    plain = seeded_members(cnn, N)
    for i, m in enumerate(plain):
        own = x.clone().requires_grad_()
        for k in range(PGD_STEPS):
            F.cross_entropy(m(own), y).backward()
            torch.testing.assert_close(piled[k][i], own.grad, **TOL64)
            with torch.no_grad():
                own += ALPHA * own.grad.sign()
                own.copy_(project(own, x))
        for p, stacked_grad in zip(m.parameters(), param_grads, strict=True):
            torch.testing.assert_close(stacked_grad[i], p.grad, **TOL64)  # piled up as alone
        opt = torch.optim.Adam(m.parameters(), lr=LR)
        opt.zero_grad()
        F.cross_entropy(m(own.detach()), y).backward()
        opt.step()
        torch.testing.assert_close(xa[i].detach(), own.detach(), rtol=0, atol=0)
    assert_members_equal(ens, plain)


def test_free_adversarial_training_one_backward_for_parameters_and_perturbation() -> None:
    """Shafahi et al.'s replay: one backward feeds the optimizer and the perturbation `delta`
    (never zeroed here, as the user forgot): the stacked optimizer steps the ensemble's
    parameters only and `delta.grad` piles up per member as alone."""
    clean = clean_batches((1, 6, 6), 2, seed=5)
    ens = vmapens.Ensemble(cnn, n=N, seeds=range(N))
    opt = vmapens.StackedAdam(ens, lr=LR)
    delta = torch.zeros(N, B, 1, 6, 6, dtype=torch.float64, requires_grad=True)
    for x, y in clean:
        for _ in range(2):
            opt.zero_grad()
            ce_each(ens((x + delta).clamp(0, 1), in_dims=0), y).sum().backward()
            opt.step()
            with torch.no_grad():
                delta += EPS * delta.grad.sign()
                delta.clamp_(-EPS, EPS)
    plain = seeded_members(cnn, N)
    for i, m in enumerate(plain):
        alone = torch.optim.Adam(m.parameters(), lr=LR)
        own = torch.zeros(B, 1, 6, 6, dtype=torch.float64, requires_grad=True)
        for x, y in clean:
            for _ in range(2):
                alone.zero_grad()
                F.cross_entropy(m((x + own).clamp(0, 1)), y).backward()
                alone.step()
                with torch.no_grad():
                    own += EPS * own.grad.sign()
                    own.clamp_(-EPS, EPS)
        torch.testing.assert_close(delta.grad[i], own.grad, **TOL64)
        torch.testing.assert_close(delta[i].detach(), own.detach(), rtol=0, atol=0)
    assert_members_equal(ens, plain)


def l2_step(gx: Tensor, dims: int) -> Tensor:
    norm = gx.flatten(gx.dim() - dims).norm(dim=-1)
    return EPS * gx / (norm.view(*norm.shape, *[1] * dims) + 1e-12)


@pytest.mark.parametrize(("target", "chunk_size"), [("own", None), ("mean", None), ("own", 2)])
def test_an_attack_kept_in_the_graph_back_propagates_into_each_member_as_alone(
    target: str, chunk_size: int | None
) -> None:
    """An L2 attack with `create_graph=True` and no detach: the step's loss back-propagates
    through `x_adv` into the members (docs/semantics.md, inputs computed from the ensemble),
    each member's own (`own`) or every member through the ensemble mean (`mean`), as
    `sum(losses).backward()` over plain modules does."""
    clean = clean_batches((1, 6, 6), 2, seed=6)
    ens = vmapens.Ensemble(cnn, n=N, seeds=range(N), chunk_size=chunk_size)
    step = vmapens.make_step(
        ens,
        F.cross_entropy,
        vmapens.StackedSGD(ens, lr=0.1),
        in_dims=0 if target == "own" else None,
    )
    for x, y in clean:
        if target == "own":
            xs = x.expand(N, *x.shape).clone().requires_grad_()
            (gx,) = torch.autograd.grad(ce_each(ens(xs, in_dims=0), y).sum(), xs, create_graph=True)
            step(xs + l2_step(gx, 4), stacked(y))
        else:
            xs = x.clone().requires_grad_()
            (gx,) = torch.autograd.grad(F.cross_entropy(ens(xs).mean(0), y), xs, create_graph=True)
            step(xs + EPS * gx / gx.norm(), y)
    plain = seeded_members(cnn, N)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in plain]
    for x, y in clean:
        for opt in opts:
            opt.zero_grad()
        if target == "own":
            total: Any = 0
            for m in plain:
                xs = x.clone().requires_grad_()
                (gx,) = torch.autograd.grad(F.cross_entropy(m(xs), y), xs, create_graph=True)
                total = total + F.cross_entropy(m(xs + l2_step(gx, 4)), y)
        else:
            xs = x.clone().requires_grad_()
            mean = torch.stack([m(xs) for m in plain]).mean(0)
            (gx,) = torch.autograd.grad(F.cross_entropy(mean, y), xs, create_graph=True)
            total = sum(F.cross_entropy(m(xs + EPS * gx / gx.norm()), y) for m in plain)
        total.backward()
        for opt in opts:
            opt.step()
    assert_members_equal(ens, plain)


def test_fit_refuses_a_lazy_iterable_of_per_member_batches_with_the_way_out() -> None:
    """`fit(..., in_dims=0)` takes stacked tensors or one DataLoader per member: an iterable
    attacking each member on the fly is refused before anything changed (attack by hand and
    step with `make_step(..., in_dims=0)`, test (a))."""
    ens = vmapens.Ensemble(cnn, n=N, seeds=range(N))
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    clean = clean_batches((1, 6, 6), 1)
    lazy = ((pgd_ens(ens, x, y, True)[0], stacked(y)) for _ in range(1) for x, y in clean)

    class Reiterable:
        def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
            return lazy

    with pytest.raises(TypeError, match=r"fit: with `in_dims=0`.*list of n DataLoaders"):
        vmapens.fit(ens, Reiterable(), F.cross_entropy, epochs=1, in_dims=0, progress=False)
    for name, value in ens.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0, msg=name)


# The first-step self-check on a loss at its minimum -----------------------------------------


def test_the_self_check_takes_a_consistency_step_at_attack_radius_zero() -> None:
    """Virtual adversarial / TRADES-style consistency with the radius warmed up from 0: the
    adversarial batch is the clean one, so KL(p(x) || p(x_adv)) sits at its minimum and its
    value and gradients are round-off. Plain torch steps by that round-off; the step's first
    call must not refuse it."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(B, 4, generator=g, dtype=torch.float64)
    ens = vmapens.Ensemble(mlp, n=N, seeds=range(N))
    step = vmapens.make_step(ens, kl_to_target, vmapens.StackedSGD(ens, lr=0.1), in_dims=0)
    x_adv = x.expand(N, *x.shape).clone()  # radius 0: the attack leaves x as it is
    step(x_adv, ens(x).detach())
    plain = seeded_members(mlp, N)
    for m in plain:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        kl_to_target(m(x), m(x).detach()).backward()
        opt.step()
    assert_members_equal(ens, plain)


def kl_to_target(out: Tensor, target: Tensor) -> Tensor:
    return F.kl_div(F.log_softmax(out, -1), F.softmax(target, -1), reduction="sum")
