"""A user journey: math ops inside a member's forward, where vmap's batching rules run them.

The script a researcher writes from README.md and docs/semantics.md ("What vmap cannot
batch", "Randomness in the forward pass"): a member whose forward, after a Linear and a
BatchNorm, runs one family of torch's math ops on its own parameters and buffers: SVD,
eigh, QR, lstsq (every CPU driver), pinv with a per-member `rtol`, matrix_exp, nuclear and
spectral norms, householder_product; solves with per-member and shared right-hand sides
(`linalg.solve` vector and matrix cases, `left=False`, `solve_triangular`, `cholesky_solve`,
`lu_solve`); det/slogdet/inv_ex/solve_ex/pinv of an exactly singular member; kron,
block_diag, cartesian_prod, vector norms of order 0 and inf with ties; torch.special;
torch.distributions' log_prob, entropy and kl_divergence with per-member parameters; torch.fft
(`n`, `norm`, fftshift) and `torch.stft` with a per-member window; complex intermediates
(polar, view_as_complex/view_as_real); lerp, clamp with per-member bounds, nan_to_num. Each
family is checked under vmap, `chunk_size=2` (a tail chunk of one) and `backend="loop"`:
`ens(x)`'s outputs in train and eval mode, then two `make_step` steps with `StackedAdam`
(one learning rate per member). Then draws (`rsample`) under the documented randomness
modes, and what is refused: a clear error that changes nothing is a pass.

The truth: N plain modules, member k built after `torch.manual_seed(k)` (docs/semantics.md,
"Seeds": `seeds=[...]`), run and trained alone with `torch.optim.Adam` on the same batches,
float64.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributions import (
    Categorical,
    Dirichlet,
    LowRankMultivariateNormal,
    MultivariateNormal,
    Normal,
    kl_divergence,
)

import vmapens

pytestmark = pytest.mark.usefixtures("float64_default", "validating_distributions")

N, B, STEPS = 3, 4, 2
LRS = [0.01, 0.03, 0.05]
# float64; the batched LAPACK/pocketfft calls run the same kernel per matrix: measured
# differences <= 2e-16, so anything above these is a real difference.
TOL = {"rtol": 1e-10, "atol": 1e-12}
BACKENDS = {"vmap": {}, "chunks": {"chunk_size": 2}, "loop": {"backend": "loop"}}


@pytest.fixture
def validating_distributions() -> Any:
    """torch's default `validate_args` (True), as a fresh process has it (an earlier test that
    compiled turned it off for the process: torch._dynamo's set-up does)."""
    was = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(True)
    yield
    torch.distributions.Distribution.set_default_validate_args(was)


def spd(a: Tensor) -> Tensor:
    return a @ a.mT + torch.eye(a.shape[-1])


def tril_scale(m: nn.Module) -> Tensor:
    return m.A.tril(-1) + torch.diag(m.A.diagonal().exp())


def svd_low_rank(m: nn.Module, h: Tensor) -> Tensor:
    U, S, Vh = torch.linalg.svd(m.A)
    return h @ (U[:, :2] * S[:2]) @ Vh[:2]  # sign-free: U's and V's signs cancel


def eigh_sqrt(m: nn.Module, h: Tensor) -> Tensor:
    lam, Q = torch.linalg.eigh(spd(m.A))
    return h @ (Q * lam.sqrt()) @ Q.mT


def qr_reduced(m: nn.Module, h: Tensor) -> Tensor:
    Q, R = torch.linalg.qr(m.A)
    return h @ Q + R.diagonal()


Family = dict[str, Callable[[nn.Module, Tensor], Tensor]]

FAMILIES: dict[str, Family] = {
    "decompositions": {
        "svd": svd_low_rank,
        "svdvals": lambda m, h: h * torch.linalg.svdvals(m.A),
        "svdvals_of_h": lambda m, h: torch.linalg.svdvals(h.unsqueeze(-1) * m.A)[..., :2],
        "eigh": eigh_sqrt,
        "eigvalsh_upper": lambda m, h: h * torch.linalg.eigvalsh(spd(m.A), UPLO="U"),
        "qr": qr_reduced,
        "qr_of_h": lambda m, h: torch.linalg.qr(h.unsqueeze(-1) * m.A)[1].diagonal(0, -2, -1),
        "gelsy": lambda m, h: torch.linalg.lstsq(m.A, h.T, driver="gelsy").solution.T,
        "gelsd": lambda m, h: torch.linalg.lstsq(m.A, h.T, driver="gelsd").solution.T,
        "gelss": lambda m, h: torch.linalg.lstsq(m.A, h.T, driver="gelss").solution.T,
        "gels_tall": lambda m, h: (
            torch.linalg.lstsq(
                torch.cat([m.A, m.v[None]]), torch.cat([h.T, h[:, :1].T]), driver="gels"
            ).solution.T
        ),
        "lstsq_rank": lambda m, h: torch.linalg.lstsq(m.A, h.T, driver="gelsy").rank,
        "pinv_rtol": lambda m, h: h @ torch.linalg.pinv(m.A, rtol=m.tol),
        "pinv_hermitian": lambda m, h: h @ torch.linalg.pinv(spd(m.A), hermitian=True),
        "matrix_exp": lambda m, h: h @ torch.linalg.matrix_exp(0.5 * m.A),
        "nuc": lambda m, h: h * torch.linalg.matrix_norm(m.A, ord="nuc"),
        "norm2": lambda m, h: h * torch.linalg.matrix_norm(m.A, ord=2),
        "householder": lambda m, h: h @ torch.linalg.householder_product(m.A, m.tau),
    },
    "solves": {
        "member_rhs": lambda m, h: h * torch.linalg.solve(m.A, m.v),
        "shared_vector": lambda m, h: h * torch.linalg.solve(m.A, torch.tensor([1.0, 2, 3])),
        "shared_matrix": lambda m, h: h @ torch.linalg.solve(m.A, m.X0)[:, :3],
        "h_rhs": lambda m, h: torch.linalg.solve(m.A, h.T).T,
        "right": lambda m, h: torch.linalg.solve(m.A, h, left=False),
        # a batch of 2 matrices and 2 shared vectors: B.shape == A.shape[:-1] (vector case)
        "batched_vectors": lambda m, h: (
            h * torch.linalg.solve(torch.stack([m.A, m.A.T]), torch.ones(2, 3)).sum(0)
        ),
        "shared_A": lambda m, h: (
            h * torch.linalg.solve(torch.stack([torch.eye(3) + 2, torch.eye(3) + 3]), m.V2).sum(0)
        ),
        "triangular": lambda m, h: (
            torch.linalg.solve_triangular(m.A.triu() + 3 * torch.eye(3), h.T, upper=True).T
        ),
        "triangular_right": lambda m, h: torch.linalg.solve_triangular(
            m.A.tril() + 3 * torch.eye(3), h, upper=False, left=False
        ),
        "unitriangular": lambda m, h: (
            torch.linalg.solve_triangular(m.A, h.T, upper=False, unitriangular=True).T
        ),
        "triangular_shared_rhs": lambda m, h: (
            h
            * torch.linalg.solve_triangular(
                m.A.triu() + 3 * torch.eye(3), torch.ones(3, 1), upper=True
            ).T
        ),
        "cholesky_solve_upper": lambda m, h: (
            torch.cholesky_solve(h.T, torch.linalg.cholesky(spd(m.A), upper=True), upper=True).T
        ),
        "cholesky_solve_shared_L": lambda m, h: (
            torch.cholesky_solve((h * m.v).T, torch.linalg.cholesky(torch.eye(3) + 2)).T
        ),
        "lu_solve_adjoint": lambda m, h: (
            torch.linalg.lu_solve(*torch.linalg.lu_factor(m.A), h.T, adjoint=True).T
        ),
        "inv_ex": lambda m, h: h @ torch.linalg.inv_ex(m.A).inverse,
        "det": lambda m, h: h * torch.linalg.det(m.A),
        "slogdet": lambda m, h: (
            h * torch.linalg.slogdet(m.A).logabsdet + torch.linalg.slogdet(m.A).sign
        ),
    },
    # member 1's A gets an exact zero row (`make_singular`): det 0, logabsdet -inf, info 3
    "singular": {
        "det": lambda m, h: h @ m.A * torch.linalg.det(m.A),
        "slogdet_sign": lambda m, h: h * torch.linalg.slogdet(m.A).sign,
        # -inf for member 1; its gradient there is NaN, alone as here: kept out of the loss
        "logabsdet": lambda m, h: torch.linalg.slogdet(m.A.detach()).logabsdet.expand(B, 1),
        "inv_ex_info": lambda m, h: torch.linalg.inv_ex(m.A).info,
        "inv_ex": lambda m, h: torch.linalg.inv_ex(m.A.detach()).inverse.sum(0).expand(B, 3),
        "solve_ex_info": lambda m, h: torch.linalg.solve_ex(m.A, m.v).info,
        "pinv": lambda m, h: h @ torch.linalg.pinv(m.A),
        "svdvals": lambda m, h: h * torch.linalg.svdvals(m.A),
        "rank": lambda m, h: h * torch.linalg.matrix_rank(m.A),
        "gelsd": lambda m, h: torch.linalg.lstsq(m.A, h.T, driver="gelsd").solution.T,
    },
    "products_norms": {
        "kron": lambda m, h: torch.kron(h, m.v[:2]),
        "kron_matrices": lambda m, h: h.repeat(1, 3) @ torch.kron(m.A, m.A[:1]).T,
        "block_diag": lambda m, h: (
            torch.cat([h, h[:, :1]], 1) @ torch.block_diag(m.A[:2, :2], m.A, m.v[:1, None])[:4]
        ),
        "cartesian_prod": lambda m, h: h * torch.cartesian_prod(m.v, m.v.flip(0)).prod(-1)[:3],
        "cartesian_shared": lambda m, h: (
            h * (torch.cartesian_prod(m.v, torch.tensor([1.0, 2.0])) ** 2).sum()
        ),
        "norm0": lambda m, h: (
            h * torch.linalg.vector_norm(m.ties, ord=0)
            + torch.linalg.vector_norm(h.relu(), ord=0, dim=-1, keepdim=True)
        ),
        # ties: the inf-norm's gradient is split among the tied entries
        "norm_inf": lambda m, h: torch.linalg.vector_norm(h * 0 + m.ties, ord=float("inf"), dim=-1),
        "norm_ninf": lambda m, h: torch.linalg.vector_norm(h * m.ties, ord=-float("inf"), dim=-1),
        "norm_inf_all": lambda m, h: h * torch.linalg.vector_norm(m.ties, ord=float("inf")),
        "cross": lambda m, h: torch.linalg.cross(h, m.v.expand_as(h)),
    },
    "special": {
        "erfcx": lambda m, h: torch.special.erfcx(h * m.v),
        "i0e": lambda m, h: torch.special.i0e(h * m.v),
        "i1e": lambda m, h: torch.special.i1e(h * m.v),
        "xlogy": lambda m, h: torch.special.xlogy(torch.relu(h * m.v), (h * m.v).exp()),
        "xlogy_scalar": lambda m, h: torch.special.xlogy(2.0, (h * m.v).exp()),
        "zeta": lambda m, h: torch.special.zeta(3.0, 1 + (h * m.v) ** 2),
        "polygamma": lambda m, h: torch.special.polygamma(2, 1 + (h * m.v) ** 2),
        "log_ndtr": lambda m, h: torch.special.log_ndtr(3 * h * m.v),
        "sinc": lambda m, h: torch.special.sinc(torch.relu(h) * m.v),  # 0 where h <= 0
        "entr": lambda m, h: torch.special.entr(h * m.v),  # -inf for negative arguments
        "logit_eps": lambda m, h: torch.special.logit(torch.sigmoid(5 * h * m.v), eps=0.01),
    },
    "distributions": {
        "normal_log_prob": lambda m, h: Normal(h * m.v, m.v.exp()).log_prob(torch.ones(3)),
        "normal_entropy": lambda m, h: h * Normal(m.v, m.v.exp()).entropy(),
        "normal_kl": lambda m, h: (
            h * kl_divergence(Normal(m.v, m.v.exp()), Normal(m.v.flip(0), (2 * m.v).exp()))
        ),
        "normal_cdf_icdf": lambda m, h: (
            Normal(m.v, m.v.exp()).cdf(h) + Normal(m.v, m.v.exp()).icdf(torch.sigmoid(h))
        ),
        "categorical_log_prob": lambda m, h: Categorical(logits=h * m.v).log_prob(
            torch.tensor([0, 1, 2, 1])
        ),
        "categorical_probs": lambda m, h: Categorical(probs=torch.softmax(h * m.v, -1)).log_prob(
            torch.tensor([2, 1, 0, 0])
        ),
        "categorical_entropy": lambda m, h: Categorical(logits=h * m.v).entropy(),
        "dirichlet_log_prob": lambda m, h: Dirichlet(m.v.exp()).log_prob(torch.softmax(h, -1)),
        "dirichlet_entropy": lambda m, h: h * Dirichlet(m.v.exp()).entropy(),
        "dirichlet_kl": lambda m, h: (
            h * kl_divergence(Dirichlet(m.v.exp()), Dirichlet(torch.ones(3)))
        ),
        "mvn_log_prob": lambda m, h: MultivariateNormal(m.v, scale_tril=tril_scale(m)).log_prob(h),
        "mvn_entropy": lambda m, h: h * MultivariateNormal(m.v, scale_tril=tril_scale(m)).entropy(),
        "mvn_kl": lambda m, h: (
            h
            * kl_divergence(
                MultivariateNormal(m.v, scale_tril=tril_scale(m)),
                MultivariateNormal(m.v.flip(0), scale_tril=tril_scale(m).T.tril() + torch.eye(3)),
            )
        ),
        "lowrank_log_prob": lambda m, h: LowRankMultivariateNormal(
            m.v, m.A[:, :1], m.v.exp()
        ).log_prob(h),
    },
    "fft": {
        "rfft_n_pad": lambda m, h: torch.view_as_real(torch.fft.rfft(h * m.v, n=5)).flatten(-2),
        "rfft_n_cut": lambda m, h: torch.fft.rfft(h * m.v, n=2).abs(),
        "irfft_n": lambda m, h: torch.fft.irfft(torch.fft.rfft(h * m.v), n=5),
        "irfft_n_even": lambda m, h: torch.fft.irfft(torch.complex(h, h * m.v), n=4),
        "ortho": lambda m, h: torch.fft.irfft(
            torch.fft.rfft(h * m.v, norm="ortho"), n=3, norm="ortho"
        ),
        "forward_norm": lambda m, h: torch.fft.fft(h * m.v, norm="forward").real,
        "fftshift_all_dims": lambda m, h: torch.fft.fftshift(h * m.v),
        "ifftshift_all_dims": lambda m, h: torch.fft.ifftshift(h * m.v),
        "fft2_shift": lambda m, h: h @ torch.fft.fftshift(torch.fft.fft2(m.A)).abs(),
        "rfft2": lambda m, h: h @ torch.fft.irfft2(torch.fft.rfft2(m.A), s=(3, 3)),
        "stft_member_window": lambda m, h: (
            torch.stft(h.flatten().repeat(2), 8, 2, window=m.win * m.v[0], return_complex=True)
            .abs()
            .sum(0)[:B, None]
            * h
        ),
        "istft": lambda m, h: torch.istft(
            torch.stft(h.flatten().repeat(2) * m.v[0], 8, 2, window=m.win, return_complex=True),
            8,
            2,
            window=m.win,
            length=24,
        )[:12].view(B, 3),
    },
    "complex": {
        "polar": lambda m, h: torch.view_as_real(torch.polar(m.v.exp(), h)).flatten(-2),
        "view_as_complex_stack": lambda m, h: torch.view_as_complex(
            torch.stack([h, h * m.v], -1)
        ).abs(),
        "view_as_complex_param": lambda m, h: (
            h.to(torch.cdouble) @ torch.view_as_complex(m.P)
        ).abs(),
        "view_as_complex_view": lambda m, h: torch.view_as_complex(
            torch.cat([h, h[:, :1] * m.v[0]], 1).view(B, 2, 2)
        ).angle(),
        "view_as_complex_transposed": lambda m, h: torch.view_as_complex(
            (h[:, :2] @ m.A[:2, :2]).T.contiguous().view(-1, 2)
        ).abs(),
        "view_as_real_param": lambda m, h: (
            torch.view_as_real(torch.complex(m.A, m.A.T)).sum(-1) @ h.T
        ),
        "product": lambda m, h: torch.view_as_real(
            torch.complex(h, m.v.expand_as(h)) * torch.polar(m.v.exp(), m.v)
        ).sum(-1),
    },
    "elementwise": {
        "lerp_param_weight": lambda m, h: torch.lerp(h, h * m.v, m.w),
        "lerp_buffer_weight": lambda m, h: torch.lerp(h, m.v.expand_as(h), m.wb),
        "lerp_shared_start": lambda m, h: torch.lerp(torch.ones(3), h, m.wb),
        "lerp_in_place": lambda m, h: (h * 1).lerp_(m.v.expand_as(h), m.wb),
        "clamp": lambda m, h: torch.clamp(h, min=m.lo, max=m.hi),
        "clamp_min": lambda m, h: torch.clamp(h, min=m.lo),
        "clamp_crossed": lambda m, h: torch.clamp(h, min=m.hi, max=m.lo),  # min > max: max
        "clamp_vectors": lambda m, h: torch.clamp(h, min=m.v - 1, max=m.v + 0.2),
        "clamp_shared_input": lambda m, h: torch.clamp(
            torch.linspace(-1, 1, 3), min=m.v - 0.5, max=m.v
        ),
        "clamp_in_place": lambda m, h: (h * 1).clamp_(min=m.lo, max=m.hi),
        "nan_to_num": lambda m, h: torch.nan_to_num(
            torch.log(h * m.v), nan=0.5, posinf=2.0, neginf=-2.0
        ),
        "nan_to_num_default": lambda m, h: torch.nan_to_num(torch.log(h * m.v)) / 1e300,
        # x / 0's gradient is NaN alone too: the infinities are made without one
        "nan_to_num_inf": lambda m, h: (
            h
            * torch.nan_to_num((h * m.v / torch.relu(h)).detach(), nan=0.0, posinf=3.0, neginf=-3.0)
        ),
    },
}


class Member(nn.Module):
    """A Linear and a BatchNorm, then one family of ops on the member's own tensors."""

    def __init__(self, family: str) -> None:
        super().__init__()
        self.family = family
        # no bias before BatchNorm: its true gradient is 0 and Adam would step on round-off
        # (docs/semantics.md, "What differs"), alone as in the ensemble
        self.lin = nn.Linear(3, 3, bias=False)
        self.bn = nn.BatchNorm1d(3)
        self.A = nn.Parameter(torch.randn(3, 3) * 0.5 + torch.eye(3))
        self.v = nn.Parameter(torch.randn(3) * 0.5)
        self.V2 = nn.Parameter(torch.randn(2, 3))
        self.P = nn.Parameter(torch.randn(3, 3, 2))
        self.ties = nn.Parameter(torch.randn(3).round())  # integers: ties and zeros
        self.w = nn.Parameter(torch.rand(()))
        self.register_buffer("tol", torch.rand(()) * 0.7)
        self.register_buffer("wb", torch.rand(3))
        self.register_buffer("lo", -torch.rand(()))
        self.register_buffer("hi", torch.rand(()))
        self.register_buffer("tau", torch.rand(3))
        self.register_buffer("win", torch.hann_window(8) + torch.rand(8) * 0.1)
        self.register_buffer("X0", torch.randn(3, 4))

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        h = self.bn(self.lin(x))
        return tuple(op(self, h) for op in FAMILIES[self.family].values())


def loss_fn(out: tuple[Tensor, ...], _: Tensor) -> Tensor:
    """Every floating output in the loss; -inf/NaN entries (a singular member) left out."""
    total = torch.zeros(())
    for o in out:
        if o.is_floating_point() or o.is_complex():
            o = o.real if o.is_complex() else o
            o = torch.where(o.isfinite(), o, torch.zeros(()))
            total = total + (o**2).mean() + o.mean()
    return total


def make_singular(modules: list[nn.Module], member: int = 1) -> None:
    with torch.no_grad():
        modules[member].A[2] = 0.0


def alone(factory: Callable[[], nn.Module]) -> list[nn.Module]:
    """The truth's members: member k is `factory()` built after torch.manual_seed(k)."""
    out = []
    for k in range(N):
        torch.manual_seed(k)
        out.append(factory())
    return out


def batches() -> list[Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(B, 3, generator=g) for _ in range(STEPS + 1)]


def assert_outputs(got: tuple[Tensor, ...], want: list[tuple[Tensor, ...]], family: str) -> None:
    for j, name in enumerate(FAMILIES[family]):
        for i, w in enumerate(want):
            torch.testing.assert_close(
                got[j][i],
                w[j],
                **TOL,
                equal_nan=True,
                msg=lambda s, name=name, i=i: f"{name} member {i}: {s}",
            )


def assert_state(ens: vmapens.Ensemble, plain: list[nn.Module]) -> None:
    for i, m in enumerate(plain):
        got = ens[i].state_dict()
        for k, v in m.state_dict().items():
            torch.testing.assert_close(got[k], v, **TOL, equal_nan=True, msg=f"member {i} {k}")


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_runs_and_trains_as_each_member_alone(family: str, backend: str) -> None:
    ens = vmapens.Ensemble(
        functools.partial(Member, family), n=N, seeds=range(N), **BACKENDS[backend]
    )
    plain = alone(functools.partial(Member, family))
    if family == "singular":
        make_singular(plain)
        make_singular_stacked(ens)
    xs = batches()
    # ens(x) in train mode (BatchNorm's batch statistics, running stats updated) and eval
    for mode in ("train", "eval"):
        getattr(ens, mode)()
        got = ens(xs[0])
        assert_outputs(got, [getattr(m, mode)()(xs[0]) for m in plain], family)
        if family == "singular":  # the outputs compared hold member 1's singular values
            assert got[list(FAMILIES[family]).index("inv_ex_info")].tolist() == [0, 3, 0]
    ens.train()
    step = vmapens.make_step(ens, loss_fn, vmapens.StackedAdam(ens, lr=torch.tensor(LRS)))
    losses = torch.stack([step(x, x) for x in xs[1:]], 1)
    want = []
    for m, lr in zip(plain, LRS, strict=True):
        m.train()
        opt = torch.optim.Adam(m.parameters(), lr=lr)
        mine = []
        for x in xs[1:]:
            opt.zero_grad()
            loss = loss_fn(m(x), x)
            loss.backward()
            opt.step()
            mine.append(loss.detach())
        want.append(torch.stack(mine))
    torch.testing.assert_close(losses, torch.stack(want), **TOL)
    assert_state(ens, plain)


def make_singular_stacked(ens: vmapens.Ensemble, member: int = 1) -> None:
    with torch.no_grad():
        ens.get_parameter("A")[member, 2] = 0.0


# -- draws (docs/semantics.md, "Randomness in the forward pass") ------------------------------


class Draws(nn.Module):
    """Reparametrised draws from each member's own distributions."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.A = nn.Parameter(torch.randn(3, 3) * 0.5 + torch.eye(3))
        self.v = nn.Parameter(torch.randn(3) * 0.5)

    def forward(self, x: Tensor) -> Tensor:
        if self.kind == "mvn":
            dist: Any = MultivariateNormal(self.v, scale_tril=tril_scale(self))
        elif self.kind == "lowrank":
            dist = LowRankMultivariateNormal(self.v, self.A[:, :1], self.v.exp())
        else:
            dist = Dirichlet(self.v.exp())
        return dist.rsample((B,)) * x


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("kind", ["mvn", "lowrank"])
def test_same_randomness_draws_what_each_member_draws_alone(kind: str, backend: str) -> None:
    ens = vmapens.Ensemble(
        functools.partial(Draws, kind), n=N, seeds=range(N), randomness="same", **BACKENDS[backend]
    )
    plain = alone(functools.partial(Draws, kind))
    x = torch.randn(B, 3)
    torch.manual_seed(5)
    got = ens(x)
    for i, m in enumerate(plain):
        torch.manual_seed(5)
        torch.testing.assert_close(got[i], m(x), **TOL)


@pytest.mark.parametrize("kind", ["mvn", "lowrank", "dirichlet"])
@pytest.mark.parametrize("backend", ["vmap", "chunks"])
def test_draws_vmap_cannot_give_each_member_are_refused_with_the_way_out(
    kind: str, backend: str
) -> None:
    """rsample's in-place `normal_()` under "different", Dirichlet's `_Dirichlet` Function in
    either mode: refused, naming `backend='loop'`."""
    ens = vmapens.Ensemble(functools.partial(Draws, kind), n=N, seed=0, **BACKENDS[backend])
    with pytest.raises(RuntimeError, match="backend='loop'"):
        ens(torch.randn(B, 3))


# -- refusals: a clear error, nothing changed -------------------------------------------------


class Refused(nn.Module):
    def __init__(self, kind: str, validate: bool | None = None) -> None:
        super().__init__()
        self.kind, self.validate = kind, validate
        self.lin = nn.Linear(3, 3)
        self.A = nn.Parameter(torch.randn(3, 3) * 0.5 + torch.eye(3))

    def forward(self, x: Tensor) -> Tensor:
        h = self.lin(x)
        if self.kind == "categorical_kl":  # torch's formula indexes with a boolean mask
            return kl_divergence(Categorical(logits=h), Categorical(logits=h @ self.A))
        if self.kind == "mvn_covariance":  # validate_args' positive-definite check branches
            mvn = MultivariateNormal(
                self.A[0], covariance_matrix=spd(self.A), validate_args=self.validate
            )
            return mvn.log_prob(h)
        return h * torch.linalg.qr(self.A, mode="r")[1].diagonal()  # no derivative


def mean_loss(out: Tensor, _: Tensor) -> Tensor:
    return out.mean()


def train_refused_alone(
    kind: str, xs: list[Tensor], validate: bool | None = None
) -> list[nn.Module]:
    plain = alone(functools.partial(Refused, kind, validate))
    for m, lr in zip(plain, LRS, strict=True):
        opt = torch.optim.Adam(m.parameters(), lr=lr)
        for x in xs:
            opt.zero_grad()
            mean_loss(m(x), x).backward()
            opt.step()
    return plain


@pytest.mark.parametrize("kind", ["categorical_kl", "mvn_covariance"])
def test_what_vmap_cannot_batch_is_refused_and_the_loop_trains_as_alone(kind: str) -> None:
    xs = batches()[:STEPS]
    for options in ({}, {"chunk_size": 2}):
        ens = vmapens.Ensemble(functools.partial(Refused, kind), n=N, seeds=range(N), **options)
        before = copy.deepcopy(ens.state_dict())
        step = vmapens.make_step(ens, mean_loss, vmapens.StackedAdam(ens, lr=torch.tensor(LRS)))
        with pytest.raises(RuntimeError, match="backend='loop'"):
            step(xs[0], xs[0])
        for k, v in ens.state_dict().items():
            torch.testing.assert_close(v, before[k], rtol=0, atol=0, msg=k)
    ens = vmapens.Ensemble(functools.partial(Refused, kind), n=N, seeds=range(N), backend="loop")
    step = vmapens.make_step(ens, mean_loss, vmapens.StackedAdam(ens, lr=torch.tensor(LRS)))
    for x in xs:
        step(x, x)
    assert_state(ens, train_refused_alone(kind, xs))


def test_mvn_covariance_without_validation_runs_under_vmap_as_alone() -> None:
    xs = batches()[:STEPS]
    factory = functools.partial(Refused, "mvn_covariance", False)
    ens = vmapens.Ensemble(factory, n=N, seeds=range(N), chunk_size=2)
    step = vmapens.make_step(ens, mean_loss, vmapens.StackedAdam(ens, lr=torch.tensor(LRS)))
    for x in xs:
        step(x, x)
    assert_state(ens, train_refused_alone("mvn_covariance", xs, validate=False))


def test_mvn_covariance_refusal_names_validate_args() -> None:
    """The positive-definite check's `if not sym_check.all()` was refused as 'data-dependent
    control flow' with backend='loop' as the only way out; validate_args=False, which keeps
    vmap and trains as alone, is named since patch mathops-1."""
    ens = vmapens.Ensemble(functools.partial(Refused, "mvn_covariance"), n=N, seed=0)
    with pytest.raises(RuntimeError) as caught:
        ens(torch.randn(B, 3))
    assert "validate_args=False" in str(caught.value)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_qr_mode_r_backward_fails_as_alone_and_changes_nothing(backend: str) -> None:
    x = torch.randn(B, 3)
    with pytest.raises(RuntimeError, match="mode='r'"):
        mean_loss(Refused("qr_r")(x), x).backward()  # alone
    ens = vmapens.Ensemble(functools.partial(Refused, "qr_r"), n=N, seed=0, **BACKENDS[backend])
    before = copy.deepcopy(ens.state_dict())
    step = vmapens.make_step(ens, mean_loss, vmapens.StackedAdam(ens, lr=0.01))
    with pytest.raises(RuntimeError, match="mode='r'"):
        step(x, x)
    for k, v in ens.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, msg=k)
    with torch.no_grad():  # the forward itself runs, as alone
        out = ens(x)
    for i, m in enumerate(ens.unstack()):
        torch.testing.assert_close(out[i], m(x).detach(), **TOL)


@pytest.mark.parametrize("backend", ["vmap", "loop"])
def test_solve_of_a_singular_member_raises_a_linalg_error_and_changes_nothing(backend: str) -> None:
    ens = vmapens.Ensemble(functools.partial(Member, "solves"), n=N, seed=0, **BACKENDS[backend])
    make_singular_stacked(ens)
    before = copy.deepcopy(ens.state_dict())
    step = vmapens.make_step(ens, loss_fn, vmapens.StackedAdam(ens, lr=0.01))
    x = torch.randn(B, 3)
    with pytest.raises(torch.linalg.LinAlgError, match="solve_ex"):
        step(x, x)
    for k, v in ens.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, msg=k)
