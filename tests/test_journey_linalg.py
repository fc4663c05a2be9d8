"""A user journey: deep-kernel GP regressors (and a Gaussian-mixture head) as ensemble members.

The script a researcher writes from README.md, docs/index.md, docs/fit.md and docs/workflows.md
("Predictions and uncertainty"): N deep-kernel GPs, each a feature MLP and an RBF kernel with a
learned log-lengthscale, log-outputscale and log-noise, trained on the exact marginal likelihood
in float64. The member's forward returns its kernel matrix `K + noise * I` on the batch (or the
predictive mean and variance given training data); the loss is the negative log marginal
likelihood written five ways: `cholesky` + `cholesky_solve` + `2 * diag(L).log().sum()`,
`cholesky_ex` + `solve_triangular`, `slogdet` + `linalg.solve`, `eigh`, `linalg.inv`. Trained
with `make_step` and `fit` (a learning rate per member), then `predict` of the predictive
mean/variance and member files loaded into a plain module. One member's kernel matrix made not
positive definite (a huge lengthscale, no noise): alone `cholesky` raises for that model only.
Also a Gaussian-mixture head (`MultivariateNormal(scale_tril=...)`'s `log_prob`).

The truth: each member a plain module trained alone with `torch.optim.Adam` on the same batches.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import Tensor, nn

import vmapens

pytestmark = pytest.mark.usefixtures("float64_default")

N, ROWS, IN, STEPS = 3, 10, 2, 3
LRS = [0.01, 0.03, 0.05]
TOL = {"rtol": 1e-9, "atol": 1e-10}  # float64, the same maths in another summation order
LOG2PI = math.log(2 * math.pi)


class DKL(nn.Module):
    """A deep-kernel GP: feature MLP, RBF kernel on the features, Gaussian noise."""

    def __init__(self) -> None:
        super().__init__()
        # No bias on the last layer: the RBF kernel sees feature differences only, so its true
        # gradient is 0 and Adam steps on round-off (docs/semantics.md, "What differs").
        self.feat = nn.Sequential(nn.Linear(IN, 6), nn.Tanh(), nn.Linear(6, 2, bias=False))
        self.log_ls = nn.Parameter(torch.zeros(()))
        self.log_os = nn.Parameter(torch.zeros(()))
        self.log_noise = nn.Parameter(torch.tensor(-2.0))

    def kernel(self, a: Tensor, b: Tensor) -> Tensor:
        d = torch.cdist(self.feat(a), self.feat(b)) / self.log_ls.exp()
        return self.log_os.exp() * torch.exp(-0.5 * d**2)

    def forward(self, x: Tensor, xtr: Tensor | None = None, ytr: Tensor | None = None):
        if xtr is None:  # training: the kernel matrix of the batch
            return self.kernel(x, x) + self.log_noise.exp() * torch.eye(x.shape[0])
        K = self.kernel(xtr, xtr) + self.log_noise.exp() * torch.eye(xtr.shape[0])
        L = torch.linalg.cholesky(K)
        ks = self.kernel(x, xtr)
        mean = ks @ torch.cholesky_solve(ytr.unsqueeze(-1), L).squeeze(-1)
        v = torch.linalg.solve_triangular(L, ks.T, upper=False)
        return mean, self.log_os.exp() - (v**2).sum(0) + self.log_noise.exp()


def nll_cholesky(K: Tensor, y: Tensor, jitter: float = 1e-8) -> Tensor:
    L = torch.linalg.cholesky(K + jitter * torch.eye(K.shape[-1]))
    alpha = torch.cholesky_solve(y.unsqueeze(-1), L).squeeze(-1)
    return 0.5 * (y @ alpha) + torch.diagonal(L).log().sum() + 0.5 * len(y) * LOG2PI


def nll_no_jitter(K: Tensor, y: Tensor) -> Tensor:
    return nll_cholesky(K, y, jitter=0.0)


def nll_cholesky_ex(K: Tensor, y: Tensor) -> Tensor:
    L, _ = torch.linalg.cholesky_ex(K)
    w = torch.linalg.solve_triangular(L, y.unsqueeze(-1), upper=False).squeeze(-1)
    return 0.5 * (w @ w) + torch.diagonal(L).log().sum() + 0.5 * len(y) * LOG2PI


def nll_slogdet(K: Tensor, y: Tensor) -> Tensor:
    _, logdet = torch.linalg.slogdet(K)
    return 0.5 * (y @ torch.linalg.solve(K, y)) + 0.5 * logdet + 0.5 * len(y) * LOG2PI


def nll_eigh(K: Tensor, y: Tensor) -> Tensor:
    lam, Q = torch.linalg.eigh(K)
    proj = Q.T @ y
    return 0.5 * (proj**2 / lam).sum() + 0.5 * lam.log().sum() + 0.5 * len(y) * LOG2PI


def nll_inv(K: Tensor, y: Tensor) -> Tensor:
    return 0.5 * (y @ torch.linalg.inv(K) @ y) + 0.5 * torch.logdet(K) + 0.5 * len(y) * LOG2PI


LOSSES = [nll_cholesky, nll_cholesky_ex, nll_slogdet, nll_eigh, nll_inv]


def data(count: int = STEPS, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        x = torch.randn(ROWS, IN, generator=g)
        out.append((x, torch.sin(x.sum(1)) + 0.1 * torch.randn(ROWS, generator=g)))
    return out


def train_alone(models: list[nn.Module], batches, loss_fn, lrs=LRS) -> list[list[float]]:
    """The truth: each member alone with torch.optim.Adam, its own lr; its losses per step."""
    losses = []
    for m, lr in zip(models, lrs, strict=True):
        opt = torch.optim.Adam(m.parameters(), lr=lr)
        mine = []
        for x, y in batches:
            opt.zero_grad()
            loss = loss_fn(m(x), y)
            loss.backward()
            opt.step()
            mine.append(loss.item())
        losses.append(mine)
    return losses


def assert_members(ens: vmapens.Ensemble, plain: list[nn.Module], skip=()) -> None:
    for i, m in enumerate(plain):
        if i in skip:
            continue
        got = ens[i].state_dict()
        for k, v in m.state_dict().items():
            torch.testing.assert_close(got[k], v, **TOL, msg=f"member {i} {k}")


def break_member(ens: vmapens.Ensemble, i: int) -> None:
    """Member i's kernel matrix: all outputscale, no noise (a huge lengthscale): rank one."""
    p = dict(ens.named_parameters())
    with torch.no_grad():
        p["log_ls"][i] = 40.0
        p["log_noise"][i] = -60.0


# -- training parity --------------------------------------------------------------------------


@pytest.mark.parametrize("loss_fn", LOSSES, ids=[f.__name__ for f in LOSSES])
def test_make_step_marginal_likelihood_matches_alone(loss_fn) -> None:
    ens = vmapens.Ensemble(DKL, n=N, seed=0)
    plain = ens.unstack()
    opt = vmapens.StackedAdam(ens, lr=torch.tensor(LRS))
    step = vmapens.make_step(ens, loss_fn, opt)
    batches = data()
    got = torch.stack([step(x, y) for x, y in batches], 1)
    want = train_alone(plain, batches, loss_fn)
    torch.testing.assert_close(got, torch.tensor(want), **TOL)
    assert_members(ens, plain)


def test_fit_predict_and_member_files_match_alone(tmp_path) -> None:
    ens = vmapens.Ensemble(DKL, n=N, seed=0)
    plain = ens.unstack()
    (x, y), (xq, _) = data(2, seed=1)
    # One batch of everything is never permuted (docs/fit.md): three steps on (x, y).
    history = vmapens.fit(
        ens,
        (x, y),
        nll_cholesky,
        steps=STEPS,
        optimizer=lambda e: vmapens.StackedAdam(e, lr=torch.tensor(LRS)),
        progress=False,
    )
    want = train_alone(plain, [(x, y)] * STEPS, nll_cholesky)
    torch.testing.assert_close(history.train_loss[0], torch.tensor(want).mean(1), **TOL)
    assert_members(ens, plain)

    mean, var = vmapens.predict(ens, (xq, x, y))
    for i, m in enumerate(plain):
        with torch.no_grad():
            m_mean, m_var = m(xq, x, y)
        torch.testing.assert_close(mean[i], m_mean, **TOL)
        torch.testing.assert_close(var[i], m_var, **TOL)
        assert (var[i] > 0).all()

    paths = vmapens.save_members(ens, tmp_path)
    for i, path in enumerate(paths):
        loaded = DKL()
        loaded.load_state_dict(torch.load(path, weights_only=True))
        with torch.no_grad():
            # the same weights, bit for bit; the mean within round-off of the batched solve
            torch.testing.assert_close(loaded.log_ls, ens[i].log_ls, rtol=0, atol=0)
            torch.testing.assert_close(loaded(xq, x, y)[0], mean[i], **TOL)


# -- one member not positive definite ---------------------------------------------------------


def test_cholesky_ex_nan_member_stops_alone_and_others_train_on() -> None:
    """cholesky_ex does not raise: the broken member's loss is NaN, as alone; `fit` freezes it
    (history.diverged) and the others end where they end alone."""
    ens = vmapens.Ensemble(DKL, n=N, seed=0)
    break_member(ens, 1)
    plain = ens.unstack()
    one_step = copy.deepcopy(plain[1])
    x, y = data(1)[0]
    K = plain[1](x)
    assert torch.linalg.cholesky_ex(K).info.item() > 0
    with pytest.raises(torch.linalg.LinAlgError, match="not positive-definite"):
        torch.linalg.cholesky(K)  # alone, the plain factorisation raises for this model only
    info = torch.linalg.cholesky_ex(ens(x).detach()).info
    assert info.tolist() == [0, torch.linalg.cholesky_ex(K).info.item(), 0]

    history = vmapens.fit(
        ens,
        (x, y),
        nll_cholesky_ex,
        steps=STEPS,
        optimizer=lambda e: vmapens.StackedAdam(e, lr=torch.tensor(LRS)),
        progress=False,
    )
    want = train_alone(plain, [(x, y)] * STEPS, nll_cholesky_ex)
    assert math.isnan(want[1][0])
    assert history.diverged.tolist() == [False, True, False]
    assert_members(ens, plain, skip=(1,))
    # frozen where the bad step left it (docs/fit.md): alone after that one step
    train_alone([one_step], [(x, y)], nll_cholesky_ex, lrs=LRS[1:2])
    for k, v in one_step.state_dict().items():
        torch.testing.assert_close(ens[1].state_dict()[k], v, rtol=0, atol=0, equal_nan=True)


def test_cholesky_of_one_bad_member_raises_for_all_and_changes_nothing() -> None:
    """Alone only member 1's step raises; in one vmapped call torch's batched cholesky raises
    for the whole call (as `validate_args` does, docs/semantics.md). Nothing changed; torch's
    "Batch element 1" is member 1 here (unchunked vmap)."""
    ens = vmapens.Ensemble(DKL, n=N, seed=0)
    break_member(ens, 1)
    before = copy.deepcopy(ens.state_dict())
    step = vmapens.make_step(ens, nll_no_jitter, vmapens.StackedAdam(ens, lr=torch.tensor(LRS)))
    x, y = data(1)[0]
    with pytest.raises(torch.linalg.LinAlgError, match="Batch element 1"):
        step(x, y)
    for k, v in ens.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, msg=k)


@pytest.mark.parametrize(
    "options",
    [
        pytest.param(
            {"chunk_size": 2},
            marks=pytest.mark.xfail(
                strict=True,
                reason="with chunk_size=2 torch's 'Batch element k' counts inside the chunk "
                "and vmapens cannot tell which chunk raised (torch.func's own chunking): the "
                "message explains the count and the ways out but names no member",
            ),
        ),
        {"backend": "loop"},
    ],
    ids=["chunks", "loop"],
)
def test_cholesky_error_names_the_member_in_chunks(options) -> None:
    ens = vmapens.Ensemble(DKL, n=4, seed=0, **options)
    break_member(ens, 2)
    step = vmapens.make_step(ens, nll_no_jitter, vmapens.StackedAdam(ens, lr=0.01))
    x, y = data(1)[0]
    with pytest.raises(torch.linalg.LinAlgError, match="member 2"):
        step(x, y)


@pytest.mark.parametrize("options", [{}, {"chunk_size": 2}], ids=["vmap", "chunks"])
def test_cholesky_error_says_what_batch_element_counts_and_the_ways_out(options) -> None:
    # Since session 32: torch's error stays a LinAlgError, said as a member's, with the count
    # torch's "batch element" is and the ways out; nothing changes.
    ens = vmapens.Ensemble(DKL, n=4, seed=0, **options)
    break_member(ens, 2)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    step = vmapens.make_step(ens, nll_no_jitter, vmapens.StackedAdam(ens, lr=0.01))
    x, y = data(1)[0]
    with pytest.raises(torch.linalg.LinAlgError) as caught:
        step(x, y)
    said = str(caught.value)
    assert "not member indices" in said and "cholesky_ex" in said and "jitter" in said
    assert ("one chunk" in said) == bool(options)
    for k, v in ens.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, msg=k)


# -- a Gaussian-mixture head ------------------------------------------------------------------


class Mixture(nn.Module):
    """A mixture of 3 full-covariance Gaussians: log p(x) via MultivariateNormal(scale_tril)."""

    def __init__(self) -> None:
        super().__init__()
        self.loc = nn.Parameter(torch.randn(3, IN))
        self.raw = nn.Parameter(0.3 * torch.randn(3, IN, IN))
        self.logits = nn.Parameter(torch.zeros(3))

    def forward(self, x: Tensor) -> Tensor:
        diag = torch.diag_embed(self.raw.diagonal(dim1=-2, dim2=-1).exp())
        dist = torch.distributions.MultivariateNormal(
            self.loc, scale_tril=torch.tril(self.raw, -1) + diag
        )
        return torch.logsumexp(dist.log_prob(x.unsqueeze(1)) + self.logits.log_softmax(0), 1)


def neg_log_lik(logp: Tensor, _: Tensor) -> Tensor:
    return -logp.mean()


def test_mixture_head_log_prob_trains_as_alone() -> None:
    ens = vmapens.Ensemble(Mixture, n=N, seed=0)
    plain = ens.unstack()
    step = vmapens.make_step(ens, neg_log_lik, vmapens.StackedAdam(ens, lr=torch.tensor(LRS)))
    batches = data()
    got = torch.stack([step(x, y) for x, y in batches], 1)
    torch.testing.assert_close(got, torch.tensor(train_alone(plain, batches, neg_log_lik)), **TOL)
    assert_members(ens, plain)
    # the Mahalanobis distance of each member, from its own scale_tril
    x = batches[0][0]
    d2 = vmapens.predict(ens, x[:1].expand(3, IN))  # members' log p at one point, 3 times
    for i, m in enumerate(plain):
        torch.testing.assert_close(d2[i], m(x[:1].expand(3, IN)).detach(), **TOL)
