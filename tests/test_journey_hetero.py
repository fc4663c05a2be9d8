"""A user journey: a deep ensemble for probabilistic regression (Lakshminarayanan et al., 2017).

The script a researcher writes from README.md, docs/semantics.md ("What vmap cannot batch",
the derivatives paragraph), docs/fit.md ("Validation, early stopping") and `vmapens.predict`:
5 float64 MLPs with two heads, a mean and a variance (softplus + eps) or a log-variance,
trained with `nn.GaussianNLLLoss` (refused inside a batched step, naming the way out;
`vmapens.per_member` and `backend="loop"` train it), the same NLL by hand (batched), beta-NLL
(Seitzer et al., a detached variance weight), a Student-t NLL (`torch.distributions`) and a
Laplace loss, adversarial training with FGSM inputs from each member's own input gradient
(per-member inputs, `torch.autograd.grad` outside the forward; `torch.func.grad` inside it),
the mixture's mean and variance and the coverage of its 90% intervals from `predict`, and
`fit` with `val_data` and early stopping on the NLL.

The truth: the same module trained alone in plain PyTorch with `torch.optim.Adam` on the same
batches (members from `ens.unstack()` before training, which the library documents equal to
the factory under the member's derived seed), and every formula written again here by hand.
float64 throughout: the same maths, sums in another order, so tolerances are 1e-10.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributions import StudentT
from truth import batch_plan

import vmapens

N, LR, EPS_VAR, FGSM = 5, 1e-2, 1e-6, 0.05
TOL: dict[str, Any] = {"rtol": 1e-10, "atol": 1e-10}
Z90 = 1.6448536269514722  # the standard normal's 95% quantile

_g = torch.Generator().manual_seed(7)
X = torch.rand(40, 1, generator=_g, dtype=torch.float64) * 6 - 3
Y = torch.sin(X) + 0.2 * (1 + X.abs()) * torch.randn(40, 1, generator=_g, dtype=torch.float64)
XV = torch.rand(24, 1, generator=_g, dtype=torch.float64) * 6 - 3
YV = torch.sin(XV) + 0.2 * (1 + XV.abs()) * torch.randn(24, 1, generator=_g, dtype=torch.float64)
BATCHES = [(X[k : k + 10], Y[k : k + 10]) for k in range(0, 40, 10)] * 2


class Hetero(nn.Module):
    """Mean and variance heads on one body; `log_var=True` returns the log-variance instead."""

    def __init__(self, log_var: bool = False) -> None:
        super().__init__()
        self.log_var = log_var
        self.body = nn.Sequential(nn.Linear(1, 16), nn.Tanh())
        self.mean, self.var = nn.Linear(16, 1), nn.Linear(16, 1)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = self.body(x)
        s = self.var(h)
        return self.mean(h), s if self.log_var else F.softplus(s) + EPS_VAR


class StudentHead(Hetero):
    """Mean, scale and a learned degrees of freedom (2 + softplus, so the variance exists)."""

    def __init__(self) -> None:
        super().__init__()
        self.df_raw = nn.Parameter(torch.zeros(()))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # type: ignore[override]
        mean, var = super().forward(x)
        return mean, var.sqrt(), 2 + F.softplus(self.df_raw)


class Joined(Hetero):
    """The same heads as one tensor `[samples, 2]`, which `predict`'s reductions take."""

    def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
        return torch.cat(super().forward(x), -1)


def member() -> nn.Module:
    return Hetero().double()


def log_var_member() -> nn.Module:
    return Hetero(log_var=True).double()


def gaussian_nll(out: tuple[Tensor, Tensor], y: Tensor) -> Tensor:
    return nn.GaussianNLLLoss()(out[0], y, out[1])


def nll_by_hand(out: tuple[Tensor, Tensor], y: Tensor) -> Tensor:
    """`nn.GaussianNLLLoss`'s formula (full=False, eps clamp of 1e-6), batchable."""
    mean, var = out
    var = var.clamp(min=1e-6)
    return 0.5 * (var.log() + (y - mean) ** 2 / var).mean()


def nll_log_var(out: tuple[Tensor, Tensor], y: Tensor) -> Tensor:
    mean, log_var = out
    return 0.5 * (log_var + (y - mean) ** 2 * torch.exp(-log_var)).mean()


def beta_nll(out: tuple[Tensor, Tensor], y: Tensor, beta: float = 0.5) -> Tensor:
    mean, var = out
    nll = 0.5 * (var.log() + (y - mean) ** 2 / var)
    return (nll * var.detach() ** beta).mean()


def student_nll(out: tuple[Tensor, Tensor, Tensor], y: Tensor) -> Tensor:
    mean, scale, df = out
    return -StudentT(df, mean, scale, validate_args=False).log_prob(y).mean()


def laplace(out: tuple[Tensor, Tensor], y: Tensor) -> Tensor:
    mean, var = out  # the second head read as the Laplace scale b
    return ((y - mean).abs() / var + var.log()).mean()


def alone(ens: vmapens.Ensemble) -> list[nn.Module]:
    return [copy.deepcopy(m) for m in ens.unstack()]


def train_alone(model: nn.Module, batches: list, loss_fn: Callable) -> nn.Module:
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for x, y in batches:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return model


def assert_members(ens: vmapens.Ensemble, plain: list[nn.Module], **tol: Any) -> None:
    for i, m in enumerate(ens.unstack()):
        for (name, got), want in zip(m.state_dict().items(), plain[i].state_dict().values()):
            where = f"member {i} {name}"
            torch.testing.assert_close(
                got, want, **(tol or TOL), msg=lambda s, w=where: f"{w}: {s}"
            )


# (a) nn.GaussianNLLLoss ------------------------------------------------------------------


def test_gaussian_nll_loss_is_refused_in_a_batched_step_naming_the_way_out() -> None:
    ens = vmapens.Ensemble(member, n=N, seed=0)
    before = copy.deepcopy(ens.state_dict())
    opt = vmapens.StackedAdam(ens, lr=LR)
    step = vmapens.make_step(ens, gaussian_nll, opt)
    with pytest.raises(RuntimeError, match="backend='loop'") as err:
        step(*BATCHES[0])
    assert "loss_fn" in str(err.value) and "GaussianNLLLoss" in str(err.value)
    for k, v in ens.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)  # nothing changed
    with pytest.raises(RuntimeError, match="backend='loop'"):
        vmapens.fit(ens, (X, Y), gaussian_nll, epochs=1, batch_size=10, progress=False, seed=0)


def test_gaussian_nll_loss_by_per_member_and_by_the_loop_backend_trains_as_alone() -> None:
    ens = vmapens.Ensemble(member, n=N, seed=0)
    plain = [train_alone(m, BATCHES[:4], gaussian_nll) for m in alone(ens)]
    opt = vmapens.StackedAdam(ens, lr=LR)
    for x, y in BATCHES[:4]:  # the README's loop, the loss member by member
        opt.zero_grad()
        vmapens.per_member(gaussian_nll)(ens(x), y).sum().backward()
        opt.step()
    assert_members(ens, plain)
    loop = vmapens.Ensemble(member, n=N, seed=0, backend="loop")
    step = vmapens.make_step(loop, gaussian_nll, vmapens.StackedAdam(loop, lr=LR))
    for x, y in BATCHES[:4]:
        step(x, y)
    assert_members(loop, plain)


# (b)-(d) losses written with torch ops, batched inside the step ----------------------------

LOSSES: dict[str, tuple[Callable[[], nn.Module], Callable]] = {
    "nll_by_hand": (member, nll_by_hand),
    "nll_log_var": (log_var_member, nll_log_var),
    "beta_nll": (member, beta_nll),
    "student_t": (lambda: StudentHead().double(), student_nll),
    "laplace": (member, laplace),
}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_batched_losses_train_every_member_as_alone(name: str) -> None:
    factory, loss_fn = LOSSES[name]
    ens = vmapens.Ensemble(factory, n=N, seed=0)
    plain = [train_alone(m, BATCHES, loss_fn) for m in alone(ens)]
    step = vmapens.make_step(ens, loss_fn, vmapens.StackedAdam(ens, lr=LR))
    losses = [step(x, y) for x, y in BATCHES]
    assert_members(ens, plain)
    assert losses[-1].shape == (N,)


def test_a_beta_sweep_with_each_members_beta_in_its_targets_trains_as_alone() -> None:
    """beta-NLL's beta swept over the members: per-member targets `(y, beta)` with in_dims=0."""
    betas = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0], dtype=torch.float64)

    def swept(out: tuple[Tensor, Tensor], target: tuple[Tensor, Tensor]) -> Tensor:
        return beta_nll(out, target[0], target[1])  # type: ignore[arg-type]

    ens = vmapens.Ensemble(member, n=N, seed=0)
    plain = [
        train_alone(m, BATCHES[:4], lambda o, y, b=float(b): beta_nll(o, y, b))
        for m, b in zip(alone(ens), betas)
    ]
    step = vmapens.make_step(ens, swept, vmapens.StackedAdam(ens, lr=LR), in_dims=0)
    for x, y in BATCHES[:4]:
        step(x.expand(N, *x.shape), (y.expand(N, *y.shape), betas))
    assert_members(ens, plain)


def test_the_hand_written_nll_equals_gaussian_nll_loss() -> None:
    ens = vmapens.Ensemble(member, n=N, seed=0)
    out = ens(X)
    torch.testing.assert_close(
        vmapens.per_member(nll_by_hand)(out, Y), vmapens.per_member(gaussian_nll)(out, Y), **TOL
    )


def test_student_t_with_argument_validation_on_runs_as_alone() -> None:
    """torch.distributions validates its arguments (an `if` on values) by default: it runs."""

    def checked(out: tuple[Tensor, Tensor, Tensor], y: Tensor) -> Tensor:
        return -StudentT(out[2], out[0], out[1]).log_prob(y).mean()

    ens = vmapens.Ensemble(lambda: StudentHead().double(), n=N, seed=0)
    plain = [train_alone(m, BATCHES[:2], checked) for m in alone(ens)]
    step = vmapens.make_step(ens, checked, vmapens.StackedAdam(ens, lr=LR))
    for x, y in BATCHES[:2]:
        step(x, y)
    assert_members(ens, plain)


# (e) adversarial training: FGSM from each member's own input gradient -----------------------


def fgsm_alone(model: nn.Module, batches: list, loss_fn: Callable) -> nn.Module:
    """The paper's step: loss on x plus loss on x + eps * sign(d loss / d x), one optimizer."""
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for x, y in batches:
        xg = x.clone().requires_grad_()
        (gx,) = torch.autograd.grad(loss_fn(model(xg), y), xg)
        x_adv = (x + FGSM * gx.sign()).detach()
        opt.zero_grad()
        (loss_fn(model(x), y) + loss_fn(model(x_adv), y)).backward()
        opt.step()
    return model


def test_adversarial_training_with_per_member_inputs_trains_as_alone() -> None:
    ens = vmapens.Ensemble(member, n=N, seed=0)
    plain = [fgsm_alone(m, BATCHES, nll_by_hand) for m in alone(ens)]
    opt = vmapens.StackedAdam(ens, lr=LR)
    nll = vmapens.per_member(nll_by_hand)
    for x, y in BATCHES:
        xs = x.expand(N, *x.shape).clone().requires_grad_()  # one copy per member
        (gx,) = torch.autograd.grad(nll(ens(xs, in_dims=0), y).sum(), xs)
        x_adv = (xs + FGSM * gx.sign()).detach()
        opt.zero_grad()
        (nll(ens(x), y) + nll(ens(x_adv, in_dims=0), y)).sum().backward()
        opt.step()
    assert_members(ens, plain)


def test_a_shared_input_gives_the_sum_of_the_members_input_gradients() -> None:
    """The pitfall docs/semantics.md names: one `x` for all members sums their gradients."""
    ens = vmapens.Ensemble(member, n=N, seed=0)
    x = X[:10].clone().requires_grad_()
    (shared,) = torch.autograd.grad(vmapens.per_member(nll_by_hand)(ens(x), Y[:10]).sum(), x)
    own = []
    for m in alone(ens):
        xg = X[:10].clone().requires_grad_()
        own.append(torch.autograd.grad(nll_by_hand(m(xg), Y[:10]), xg)[0])
    torch.testing.assert_close(shared, torch.stack(own).sum(0), **TOL)


class Adversarial(nn.Module):
    """FGSM inside the forward with torch.func.grad: returns clean and adversarial outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Hetero()

    def forward(self, x: Tensor, y: Tensor) -> tuple[Any, Any]:
        gx = torch.func.grad(lambda xi: nll_by_hand(self.net(xi), y))(x)
        return self.net(x), self.net(x + FGSM * gx.sign())


def adversarial_loss(out: tuple[Any, Any], y: Tensor) -> Tensor:
    return nll_by_hand(out[0], y) + nll_by_hand(out[1], y)


def test_adversarial_training_with_torch_func_in_the_forward_trains_as_alone() -> None:
    ens = vmapens.Ensemble(lambda: Adversarial().double(), n=N, seed=0)
    plain = alone(ens)
    for m in plain:
        opt = torch.optim.Adam(m.parameters(), lr=LR)
        for x, y in BATCHES:
            xg = x.clone().requires_grad_()
            (gx,) = torch.autograd.grad(nll_by_hand(m.net(xg), y), xg)
            opt.zero_grad()
            (nll_by_hand(m.net(x), y) + nll_by_hand(m.net(x + FGSM * gx.sign()), y)).backward()
            opt.step()
    step = vmapens.make_step(ens, adversarial_loss, vmapens.StackedAdam(ens, lr=LR))
    for x, y in BATCHES:
        step((x, y), y)
    assert_members(ens, plain)


# (f) the mixture prediction ---------------------------------------------------------------


def test_mixture_mean_variance_and_coverage_from_predict() -> None:
    ens = vmapens.Ensemble(member, n=N, seed=0)
    step = vmapens.make_step(ens, nll_by_hand, vmapens.StackedAdam(ens, lr=LR))
    for x, y in BATCHES:
        step(x, y)
    ens.train()
    plain = [m.eval() for m in ens.unstack()]
    with torch.no_grad():
        mus = torch.stack([m(XV)[0] for m in plain])
        vars_ = torch.stack([m(XV)[1] for m in plain])
    mix_mean = mus.mean(0)
    mix_var = (vars_ + mus**2).mean(0) - mix_mean**2  # the paper's formula
    means, variances = vmapens.predict(ens, XV, batch_size=7)  # reduce="none"
    torch.testing.assert_close(means, mus, **TOL)
    torch.testing.assert_close(variances, vars_, **TOL)
    with pytest.raises(TypeError, match="reduce='none'"):  # two heads: refused, clearly
        vmapens.predict(ens, XV, reduce="mean")
    joined = vmapens.Ensemble(lambda: Joined().double(), n=N, seed=0)  # one [samples, 2]
    joined.load_state_dict(ens.state_dict())
    avg_mu, avg_var = vmapens.predict(joined, XV, reduce="mean").unbind(-1)
    spread = vmapens.predict(joined, XV, reduce="variance")[:, 0]  # population variance
    avg_mu, avg_var = avg_mu[:, None], avg_var[:, None]
    spread = spread[:, None]
    torch.testing.assert_close(avg_mu, mix_mean, **TOL)
    torch.testing.assert_close(avg_var + spread, mix_var, **TOL)
    assert ens.training  # predict restored the mode
    z = torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(0.95, dtype=torch.float64))
    half = z * (avg_var + spread).sqrt()
    covered = ((YV - avg_mu).abs() <= half).double().mean()
    want = ((YV - mix_mean).abs() <= z * mix_var.sqrt()).double().mean()
    assert covered == want and 0 < covered <= 1


# (g) fit with val_data and early stopping on the NLL ----------------------------------------


def coverage90(out: tuple[Tensor, Tensor], y: Tensor) -> Tensor:
    """The fraction of targets inside the member's central 90% interval."""
    return ((y - out[0]).abs() <= Z90 * out[1].sqrt()).double().mean()


def fit_alone(
    model: nn.Module, lr: float, epochs: int, batch: int, patience: int, loss_fn: Callable
) -> tuple[nn.Module, list[float], int, int, list[tuple[float, float]]]:
    """docs/fit.md by hand: fit's batch order, validation in eval mode under no_grad after
    every epoch, stop after `patience` epochs without improvement, best weights restored."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    plan = batch_plan(len(X), batch, epochs * math.ceil(len(X) / batch), seed=0)
    per_epoch = math.ceil(len(X) / batch)
    best, best_epoch, best_state, bad, val, metrics = math.inf, -1, None, 0, [], []
    for e in range(epochs):
        for rows in plan[e * per_epoch : (e + 1) * per_epoch]:
            opt.zero_grad()
            loss_fn(model(X[rows]), Y[rows]).backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            out = model(XV)
            v = float(loss_fn(out, YV))
            metrics.append((float(gaussian_nll(out, YV)), float(coverage90(out, YV))))
        model.train()
        val.append(v)
        if v < best:
            best, best_epoch, best_state, bad = v, e, copy.deepcopy(model.state_dict()), 0
        else:
            bad += 1
            if bad >= patience:
                break
    model.load_state_dict(best_state)
    return model, val, best_epoch, (e if bad >= patience else -1), metrics


@pytest.mark.parametrize("backend", ["vmap", "loop"])
def test_fit_with_val_data_and_early_stopping_on_the_nll(backend: str) -> None:
    loss_fn = nll_by_hand if backend == "vmap" else gaussian_nll
    epochs, batch, patience = 8, 20, 1
    ens = vmapens.Ensemble(member, n=N, seed=0, backend=backend)
    lrs = [0.01, 0.05, 0.03, 0.05, 0.02]  # one learning rate per member: stops differ
    runs = [fit_alone(m, lr, epochs, batch, patience, loss_fn) for m, lr in zip(alone(ens), lrs)]
    history = vmapens.fit(
        ens, (X, Y), loss_fn, epochs=epochs, batch_size=batch, lr=lrs,
        val_data=(XV, YV), patience=patience, progress=False, seed=0,
        metrics={"gnll": gaussian_nll, "coverage": coverage90},
    )  # fmt: skip
    assert_members(ens, [r[0] for r in runs], rtol=1e-9, atol=1e-9)
    assert history.best_epoch.tolist() == [r[2] for r in runs]
    assert history.stopped_epoch.tolist() == [r[3] for r in runs]
    assert len({r[3] for r in runs}) >= 3  # members stopped at different epochs
    assert history.metrics is not None and history.ensemble_metrics is not None
    for i, (_, val, _, _, metrics) in enumerate(runs):
        got = history.val_loss[: len(val), i]
        torch.testing.assert_close(got, torch.tensor(val, dtype=got.dtype), **TOL)
        assert history.val_loss[len(val) :, i].isnan().all()
        for k, name in enumerate(("gnll", "coverage")):
            got = history.metrics[name][: len(val), i]
            want = torch.tensor([m[k] for m in metrics], dtype=got.dtype)
            torch.testing.assert_close(got, want, **TOL)
    # the ensemble's metric is the metric of the averaged output, tensor by tensor
    # (docs/workflows.md): mean of the means and mean of the variances, not the mixture's
    epoch0 = [fit_alone(m, lr, 1, batch, patience, loss_fn)[0] for m, lr in zip(alone(
        vmapens.Ensemble(member, n=N, seed=0)), lrs)]  # fmt: skip
    with torch.no_grad():
        outs = [m.eval()(XV) for m in epoch0]
        mean_out = (
            torch.stack([o[0] for o in outs]).mean(0),
            torch.stack([o[1] for o in outs]).mean(0),
        )
    got = history.ensemble_metrics["gnll"][0]
    torch.testing.assert_close(got, gaussian_nll(mean_out, YV).to(got.dtype), **TOL)


# A stacked variance given to a per-member loss by keyword -----------------------------------


def nll_three(mean: Tensor, y: Tensor, var: Tensor) -> Tensor:
    return 0.5 * (var.log() + (y - mean) ** 2 / var).mean()


def test_a_stacked_variance_passed_positionally_gives_each_members_own_nll() -> None:
    ens = vmapens.Ensemble(member, n=N, seed=0)
    mean, var = ens(X)
    got = vmapens.per_member(nll_three, in_dims=(0, None, 0))(mean, Y, var)
    want = torch.stack([nll_three(m(X)[0], Y, m(X)[1]) for m in alone(ens)])
    torch.testing.assert_close(got, want, **TOL)


def test_a_stacked_variance_passed_by_keyword_is_not_mixed_silently() -> None:
    ens = vmapens.Ensemble(member, n=N, seed=0)
    mean, var = ens(X)
    with pytest.warns(UserWarning, match=r"per_member: keyword argument `var`.*in_dims"):
        vmapens.per_member(nll_three)(mean, Y, var=var)
    with (
        pytest.warns(UserWarning, match=r"per_member: keyword argument `var`"),
        pytest.raises(ValueError, match="var is of incorrect size"),
    ):
        vmapens.per_member(nn.GaussianNLLLoss())(mean, Y, var=var)
