"""A user journey: an ensemble of small normalizing flows (density estimation on 2-D toy data).

The script a researcher writes from README.md, docs/semantics.md, docs/workflows.md and
docs/fit.md, with the flow written as in plain PyTorch: RealNVP affine couplings (the mask a
buffer, the scale through tanh, the log-det a sum), ActNorm with a data-dependent init on the
first batch behind a plain Python flag (docs/semantics.md: "a flag set on the first call, as
Glow's `ActNorm`'s `self.initialized = True`"), Glow's invertible 1x1 "convolution" on 2-D
data, once LU-parametrised (built with `torch.linalg.lu_factor`, inverted with
`torch.linalg.solve_triangular`) and once a full matrix (log-det by `torch.linalg.slogdet`,
inverted with `lu_factor`/`lu_solve` or `torch.linalg.inv`), a standard-normal base
(`torch.distributions.Normal` / `MultivariateNormal`), the negative log-likelihood with the
log-det terms as the loss of a `(z, logdet)` output; sampling runs the inverse (a `reverse=`
keyword of the forward, a method reached through `map_members` on `ens.runner`, and
`unstack()`).

Every member is compared with the same flow trained alone with `torch.optim` on the same
batches, from the same init (`ens.unstack()` copied before training): parameters, ActNorm's
init, per-step losses, held-out log-likelihoods and samples from one seeded base draw.
float64, 3 members, a few steps.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call

import vmapens

sys.path.insert(0, str(Path(__file__).parent))
from truth import batch_plan, train_alone  # noqa: E402

pytestmark = pytest.mark.usefixtures("float64_default")

N, H, STEPS, BATCH = 3, 6, 4, 16
TOL = {"rtol": 1e-9, "atol": 1e-10}  # float64: batched sums in another order only


# -- the flow, as written for one model -----------------------------------------------------


class Coupling(nn.Module):
    """RealNVP affine coupling: the masked half conditions scale and shift of the other."""

    def __init__(self, parity: int) -> None:
        super().__init__()
        self.register_buffer("mask", torch.tensor([1.0, 0.0] if parity == 0 else [0.0, 1.0]))
        self.net = nn.Sequential(nn.Linear(2, H), nn.Tanh(), nn.Linear(H, 4))

    def _st(self, xm: Tensor) -> tuple[Tensor, Tensor]:
        s, t = self.net(xm).chunk(2, -1)
        return torch.tanh(s) * (1 - self.mask), t * (1 - self.mask)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        xm = x * self.mask
        s, t = self._st(xm)
        return xm + (1 - self.mask) * (x * torch.exp(s) + t), s.sum(-1)

    def inverse(self, y: Tensor) -> Tensor:
        ym = y * self.mask
        s, t = self._st(ym)
        return ym + (1 - self.mask) * ((y - t) * torch.exp(-s))


class ActNorm(nn.Module):
    """Glow's ActNorm: per-feature shift and log-scale set from the first batch it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.loc = nn.Parameter(torch.zeros(2))
        self.logs = nn.Parameter(torch.zeros(2))
        self.initialized = False

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        if not self.initialized:
            with torch.no_grad():
                self.loc.copy_(-x.mean(0))
                self.logs.copy_(-torch.log(x.std(0) + 1e-6))
            self.initialized = True
        return (x + self.loc) * torch.exp(self.logs), self.logs.sum().expand(x.shape[0])

    def inverse(self, y: Tensor) -> Tensor:
        return y * torch.exp(-self.logs) - self.loc


class GlowActNorm(ActNorm):
    """The same, written with `.data` as many Glow ports do."""

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        if not self.initialized:
            self.loc.data.copy_(-x.mean(0))
            self.logs.data.copy_(-torch.log(x.std(0) + 1e-6))
            self.initialized = True
        return (x + self.loc) * torch.exp(self.logs), self.logs.sum().expand(x.shape[0])


class InvLU(nn.Module):
    """Glow's invertible 1x1 convolution on 2-D data, LU-parametrised: W = P L (U + diag(s))."""

    def __init__(self) -> None:
        super().__init__()
        w = torch.linalg.qr(torch.randn(2, 2))[0]
        P, L, U = torch.lu_unpack(*torch.linalg.lu_factor(w))
        s = torch.diagonal(U)
        self.register_buffer("P", P)
        self.register_buffer("sign_s", torch.sign(s))
        self.register_buffer("lower", torch.tril(torch.ones(2, 2), -1))
        self.L = nn.Parameter(L)
        self.U = nn.Parameter(torch.triu(U, 1))
        self.log_s = nn.Parameter(torch.log(s.abs()))

    def _factors(self) -> tuple[Tensor, Tensor]:
        L = self.L * self.lower + torch.eye(2)
        U = self.U * self.lower.T + torch.diag(self.sign_s * torch.exp(self.log_s))
        return L, U

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        L, U = self._factors()
        return x @ (self.P @ L @ U).T, self.log_s.sum().expand(x.shape[0])

    def inverse(self, y: Tensor) -> Tensor:
        L, U = self._factors()
        b = torch.linalg.solve_triangular(L, self.P.T @ y.T, upper=False, unitriangular=True)
        return torch.linalg.solve_triangular(U, b, upper=True).T


class InvConv(nn.Module):
    """The full-matrix variant: log|det W| by slogdet; the inverse by LU solve or `inv`."""

    def __init__(self) -> None:
        super().__init__()
        self.W = nn.Parameter(torch.linalg.qr(torch.randn(2, 2))[0])
        self.solver = "lu"

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x @ self.W.T, torch.linalg.slogdet(self.W)[1].expand(x.shape[0])

    def inverse(self, y: Tensor) -> Tensor:
        if self.solver == "inv":
            return y @ torch.linalg.inv(self.W).T
        LU, pivots = torch.linalg.lu_factor(self.W)
        return torch.linalg.lu_solve(LU, pivots, y.T).T


class Flow(nn.Module):
    def __init__(self, actnorm: type[nn.Module] = ActNorm) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Coupling(0), actnorm(), InvLU(), Coupling(1), InvConv()])

    def forward(self, x: Tensor, reverse: bool = False) -> tuple[Tensor, Tensor] | Tensor:
        if reverse:
            return self.inverse(x)
        logdet = x.new_zeros(x.shape[0])
        for layer in self.layers:
            x, d = layer(x)
            logdet = logdet + d
        return x, logdet

    def inverse(self, z: Tensor) -> Tensor:
        for layer in reversed(self.layers):
            z = layer.inverse(z)
        return z


def nll(out: tuple[Tensor, Tensor], target: Tensor | None = None) -> Tensor:
    """Negative log-likelihood under a standard normal base (validate_args as default)."""
    z, logdet = out
    base = torch.distributions.Normal(torch.zeros(2), torch.ones(2))
    return -(base.log_prob(z).sum(-1) + logdet).mean()


def nll_mvn(out: tuple[Tensor, Tensor], target: Tensor | None = None) -> Tensor:
    z, logdet = out
    base = torch.distributions.MultivariateNormal(torch.zeros(2), torch.eye(2))
    return -(base.log_prob(z) + logdet).mean()


def moons(rows: int, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(rows, generator=g) * torch.pi
    x = torch.stack([torch.cos(t), torch.sin(t) - 0.5], -1)
    return x + 0.1 * torch.randn(rows, 2, generator=g)


BATCHES = [moons(BATCH, seed=k) for k in range(STEPS)]
HELD_OUT = moons(40, seed=99)


def _alone(ens: vmapens.Ensemble) -> list[nn.Module]:
    """The members as plain modules, before any training (ActNorm not yet initialised)."""
    return [copy.deepcopy(m) for m in ens.unstack()]


def _train_plain(models, batches, loss_fn=nll, make_opt=None, **kw) -> list[list[float]]:
    """Each model alone (truth.train_alone, targets = inputs); returns its per-step losses."""
    losses: list[list[float]] = []
    for i, m in enumerate(models):
        own: list[float] = []

        def recorded(out, y, own=own):
            loss = loss_fn(out, y)
            own.append(loss.item())
            return loss

        opt = make_opt(i, m) if make_opt else torch.optim.Adam(m.parameters(), lr=1e-2)
        train_alone(m, [(x, x) for x in batches], recorded, opt, **kw)
        losses.append(own)
    return losses


def _assert_members(ens: vmapens.Ensemble, alone: list[nn.Module]) -> None:
    for i, m in enumerate(alone):
        got, want = ens[i].state_dict(), m.state_dict()
        assert list(got) == list(want)
        for k in want:
            torch.testing.assert_close(got[k], want[k], **TOL, msg=f"member {i} {k}")
        assert ens[i].layers[1].initialized is m.layers[1].initialized is True


def _assert_samples(ens: vmapens.Ensemble, alone: list[nn.Module]) -> None:
    """Samples from one seeded base draw: the inverse run three documented ways."""
    torch.manual_seed(5)  # one seeded base draw, shared by every member and its twin
    z = torch.distributions.Normal(torch.zeros(2), torch.ones(2)).sample((8,))
    with torch.no_grad():
        want = torch.stack([m.inverse(z) for m in alone])
        torch.testing.assert_close(ens(z, reverse=True), want, **TOL)  # a forward keyword

        class Inverse(nn.Module):  # functional_call runs `forward`: wrap the method
            def __init__(self, flow: nn.Module) -> None:
                super().__init__()
                self.flow = flow

            def forward(self, z: Tensor) -> Tensor:
                return self.flow.inverse(z)

        inv = Inverse(ens.runner)
        got = ens.map_members(
            lambda s, z: functional_call(inv, {f"flow.{k}": v for k, v in s.items()}, (z,)), z
        )
        torch.testing.assert_close(got, want, **TOL)
        torch.testing.assert_close(torch.stack([m.inverse(z) for m in ens.unstack()]), want, **TOL)
        # and the inverse pass is an inverse: z -> x -> z
        zz, _ = ens(want[0])
        torch.testing.assert_close(zz[0], z, rtol=1e-9, atol=1e-9)


# -- (1) the README's manual loop -----------------------------------------------------------


def test_readme_manual_loop_trains_every_flow_as_alone() -> None:
    ens = vmapens.Ensemble(Flow, n=N, seed=0)
    alone = _alone(ens)
    lrs = [1e-2, 5e-3, 2e-2]
    opt = vmapens.StackedAdam(ens, lr=torch.tensor(lrs))
    got = []
    for x in BATCHES:
        loss = vmapens.per_member(nll)(ens(x), x)
        opt.zero_grad()
        loss.sum().backward()
        opt.step()
        got.append(loss.detach())
    want = _train_plain(
        alone, BATCHES, make_opt=lambda i, m: torch.optim.Adam(m.parameters(), lr=lrs[i])
    )
    torch.testing.assert_close(torch.stack(got).T, torch.tensor(want), **TOL)
    _assert_members(ens, alone)
    # ActNorm's data-dependent init ran for each member on its own activations
    locs = torch.stack([ens[i].layers[1].loc for i in range(N)])
    assert (locs != 0).all() and not torch.allclose(locs[0], locs[1])
    _assert_samples(ens, alone)


# -- (2) make_step and fit with the (z, logdet) output ---------------------------------------


def test_make_step_with_a_tuple_output_loss_matches_alone() -> None:
    ens = vmapens.Ensemble(Flow, n=N, seed=1)
    alone = _alone(ens)
    step = vmapens.make_step(ens, nll_mvn, vmapens.StackedAdam(ens, lr=1e-2))
    got = torch.stack([step(x, x) for x in BATCHES])  # no targets: the inputs stand in
    want = _train_plain(alone, BATCHES, nll_mvn)
    torch.testing.assert_close(got.T, torch.tensor(want), **TOL)
    _assert_members(ens, alone)
    ens.template.layers[4].solver = "inv"  # an attribute set on the template reaches members
    for m in alone:
        m.layers[4].solver = "inv"
    _assert_samples(ens, alone)


def test_a_step_without_targets_is_refused_naming_targets() -> None:
    ens = vmapens.Ensemble(Flow, n=N, seed=1)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    step = vmapens.make_step(ens, nll, vmapens.StackedAdam(ens, lr=1e-2))
    for targets in (None, ()):
        with pytest.raises(TypeError, match=r"^step: `targets` must be a tensor"):
            step(BATCHES[0], targets)
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert ens.runner.layers[1].initialized is False


def test_a_step_without_targets_says_how_to_train_a_loss_without_targets() -> None:
    ens = vmapens.Ensemble(Flow, n=N, seed=1)
    step = vmapens.make_step(ens, nll, vmapens.StackedAdam(ens, lr=1e-2))
    with pytest.raises(TypeError, match=r"step\(x, x\)"):
        step(BATCHES[0], None)


def test_fit_with_weight_decay_clipping_and_a_schedule_matches_alone() -> None:
    # (2) + (4): fit over (X, X), AdamW (StackedAdam with decoupled_weight_decay) with per-member lr and weight decay, clipping by norm,
    # a per-step StepLR; the truth is torch's AdamW, clip_grad_norm_ and StepLR per member.
    X = torch.cat(BATCHES)
    ens = vmapens.Ensemble(Flow, n=N, seed=2)
    alone = _alone(ens)
    lrs, wds = [1e-2, 2e-2, 5e-3], [0.0, 0.1, 0.01]
    sched = vmapens.callbacks.LRScheduler(
        lambda o: torch.optim.lr_scheduler.StepLR(o, 2, gamma=0.5), interval="step"
    )
    history = vmapens.fit(
        ens, (X, X), nll, optimizer=vmapens.StackedAdam, lr=lrs, weight_decay=wds,
        decoupled_weight_decay=True,
        clip_grad_norm=0.5, callbacks=[sched], batch_size=BATCH, epochs=1, steps=5,
        val_data=(HELD_OUT, HELD_OUT), seed=0, progress=False,
    )  # fmt: skip
    plan = [X[rows] for rows in batch_plan(len(X), BATCH, 5, seed=0)]
    scheds = []

    def make_opt(i: int, m: nn.Module) -> torch.optim.Optimizer:
        opt = torch.optim.AdamW(m.parameters(), lr=lrs[i], weight_decay=wds[i])
        scheds.append(torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5))
        return opt

    want = []
    for i, m in enumerate(alone):
        want += _train_plain(
            [m], plan, make_opt=lambda _, m, i=i: make_opt(i, m),
            clip=lambda ps: nn.utils.clip_grad_norm_(ps, 0.5),
            after_step=lambda k: scheds[-1].step(),
        )  # fmt: skip
    torch.testing.assert_close(history.train_loss[0], torch.tensor(want).mean(1), **TOL)
    _assert_members(ens, alone)
    with torch.no_grad():  # its up-front val_data forward left ActNorm to the first batch
        held_out = torch.stack([nll(m(HELD_OUT)) for m in alone])
    torch.testing.assert_close(history.val_loss[0], held_out, **TOL)
    _assert_samples(ens, alone)


# -- (3) chunk_size and backend="loop" -------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [1, 2])
def test_chunks_train_actnorm_flows_as_alone(chunk_size: int) -> None:
    # docs/semantics.md: with members in turns each turn starts from the plain values held
    # before the call, so ActNorm's first-call flag inits every member on its first batch.
    ens = vmapens.Ensemble(Flow, n=N, seed=3, chunk_size=chunk_size)
    alone = _alone(ens)
    step = vmapens.make_step(ens, nll, vmapens.StackedAdam(ens, lr=1e-2))
    got = torch.stack([step(x, x) for x in BATCHES[:3]])
    want = _train_plain(alone, BATCHES[:3])
    torch.testing.assert_close(got.T, torch.tensor(want), **TOL)
    _assert_members(ens, alone)
    _assert_samples(ens, alone)


def test_loop_backend_refuses_the_actnorm_flag_clearly_and_trains_as_alone_unchecked() -> None:
    # The probe cannot tell a flag every member sets alike from a value each member holds its
    # own of with the loop (tests/test_hunt_selfcheck.py); it refuses, naming the way out.
    ens = vmapens.Ensemble(Flow, n=N, seed=4, backend="loop")
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    step = vmapens.make_step(ens, nll, vmapens.StackedAdam(ens, lr=1e-2))
    with pytest.raises(RuntimeError, match=r"layers\.1\.initialized.*register_buffer") as err:
        step(BATCHES[0], BATCHES[0])
    assert "Nothing was changed" in str(err.value)
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert ens.runner.layers[1].initialized is False
    # unchecked, the loop runs each member as alone (every turn from the call's plain values)
    alone = _alone(ens)
    step = vmapens.make_step(ens, nll, vmapens.StackedAdam(ens, lr=1e-2), check=False)
    got = torch.stack([step(x, x) for x in BATCHES[:3]])
    torch.testing.assert_close(got.T, torch.tensor(_train_plain(alone, BATCHES[:3])), **TOL)
    _assert_members(ens, alone)


def test_glow_actnorm_with_data_is_refused_under_vmap_naming_no_grad_and_the_loop() -> None:
    ens = vmapens.Ensemble(lambda: Flow(GlowActNorm), n=N, seed=5)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    step = vmapens.make_step(ens, nll, vmapens.StackedAdam(ens, lr=1e-2))
    # The loop then refuses ActNorm's flag (above): the message names torch.no_grad() first,
    # the way out that trains (the Flow's own ActNorm, tested above, is written so).
    with pytest.raises(RuntimeError, match=r"reads `\.data`.*torch\.no_grad\(\).*backend='loop'"):
        step(BATCHES[0], BATCHES[0])
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k


# -- (5) member files and held-out log-likelihood -------------------------------------------


def test_member_files_load_into_plain_flows_with_alone_log_likelihoods(tmp_path: Path) -> None:
    ens = vmapens.Ensemble(Flow, n=N, seed=6)
    alone = _alone(ens)
    step = vmapens.make_step(ens, nll, vmapens.StackedAdam(ens, lr=1e-2))
    for x in BATCHES[:3]:
        step(x, x)
    _train_plain(alone, BATCHES[:3])
    paths = vmapens.save_members(ens, tmp_path / "flows")
    states = vmapens.load_members(tmp_path / "flows")
    assert [p.name for p in paths] == [f"member_{i:04d}.pt" for i in range(N)]
    loaded = []
    for i, state in enumerate(states):
        plain = Flow()
        plain.load_state_dict(torch.load(paths[i]))
        again = Flow()
        again.load_state_dict(state)
        for m in (plain, again):  # a state dict holds no attribute, in plain torch either:
            m.layers[1].initialized = True  # ActNorm must not re-init on the held-out data
        loaded.append((plain, again))
    with torch.no_grad():
        want = torch.stack([-nll(m(HELD_OUT)) for m in alone])
        torch.testing.assert_close(-vmapens.per_member(nll)(ens(HELD_OUT), HELD_OUT), want, **TOL)
        for i, (plain, again) in enumerate(loaded):
            torch.testing.assert_close(-nll(plain(HELD_OUT)), want[i], **TOL)
            torch.testing.assert_close(-nll(again(HELD_OUT)), want[i], **TOL)
    # the loaded members run as an ensemble again, and sample as alone
    back = vmapens.Ensemble.from_modules([again for _, again in loaded])
    _assert_members(back, alone)
    _assert_samples(back, alone)
