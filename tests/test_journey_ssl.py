"""A user journey: contrastive self-supervised learning, then time-series forecasting.

(1) SimCLR-style pre-training of 4 members (encoder + projection head with BatchNorm1d), two
augmented views per sample drawn per member (`in_dims=0`), the NT-Xent loss (it mixes the
samples of the batch: cosine similarities of all pairs, a temperature, cross-entropy against the
positive's index), trained with `make_step` and with `fit` (per-member tensors cut by
docs/fit.md's shuffle formula); then a linear probe per member on the frozen encoder
(`ens.template.encoder.requires_grad_(False)`, docs/semantics.md "Buffers and train/eval").

(2) Forecasting with causal dilated Conv1d (left padding), mean and variance heads (softplus),
a Gaussian negative log-likelihood, teacher forcing in training, per-member series
(`in_dims=0`), and an autoregressive rollout (a Python loop of `ens(x)` calls under
`torch.no_grad()`, and of `vmapens.predict`). `nn.GaussianNLLLoss` branches on values, so the
vmapped step refuses it naming `backend="loop"` (docs/semantics.md "What vmap cannot batch"):
that way out, and the loss written without the branch, are both checked.

The truth: each member a plain module (built after `torch.manual_seed(k)`: `seeds=range(n)`)
trained alone with `torch.optim.Adam` on its own slice of the same batches, float64; only the
order of sums may differ, hence TOL.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from truth import batch_plan, seeded_members

import vmapens

N, B, D, TAU, LR = 4, 6, 5, 0.5, 1e-2
TOL: dict[str, Any] = {"rtol": 1e-9, "atol": 1e-10}  # float64, sums in another order


# ----------------------------------------------------------------------------- (1) SSL


class SimCLR(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(D, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh())
        # No bias before BatchNorm (and Tanh, not ReLU, ending the encoder: a ReLU unit positive
        # on the whole tiny batch passes encoder.2's bias straight on): its true gradient is 0,
        # and Adam turns the round-off there into lr-sized noise, alone too (docs/semantics.md,
        # "What differs from training alone").
        self.projector = nn.Sequential(
            nn.Linear(8, 8, bias=False), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4)
        )
        self.probe = nn.Linear(8, 3)

    def forward(self, x1: Tensor, x2: Tensor | None = None) -> Tensor:
        if x2 is None:  # linear probe on the representation
            return self.probe(self.encoder(x1))
        return self.projector(self.encoder(torch.cat([x1, x2])))  # [2B, 4]


def nt_xent(z: Tensor, _unused: Tensor | None = None) -> Tensor:
    """NT-Xent over one member's batch of 2B projections (rows i and i+B are a pair)."""
    z = F.normalize(z, dim=-1)
    sim = z @ z.T / TAU
    two_b = z.shape[0]
    sim = sim.masked_fill(torch.eye(two_b, dtype=torch.bool), float("-inf"))
    half = two_b // 2
    labels = torch.cat([torch.arange(half, two_b), torch.arange(half)])
    return F.cross_entropy(sim, labels)


def ssl_member() -> nn.Module:
    return SimCLR().double()


def views(seed: int, rows: int = B) -> tuple[Tensor, Tensor, Tensor]:
    """A shared base batch and each member's own two augmentations of it ([N, rows, D])."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(rows, D, generator=g, dtype=torch.float64)

    def aug() -> Tensor:
        scale = 1 + 0.2 * torch.randn(N, 1, D, generator=g, dtype=torch.float64)
        return base * scale + 0.1 * torch.randn(N, rows, D, generator=g, dtype=torch.float64)

    return base, aug(), aug()


def train_ssl_alone(models: list[nn.Module], batches: list[tuple[Tensor, Tensor]]) -> None:
    for i, m in enumerate(models):
        opt = torch.optim.Adam(m.parameters(), lr=LR)
        for x1, x2 in batches:
            opt.zero_grad()
            nt_xent(m(x1[i], x2[i])).backward()
            opt.step()


def assert_members(ens: vmapens.Ensemble, models: list[nn.Module]) -> None:
    for i, m in enumerate(models):
        got, want = ens[i].state_dict(), m.state_dict()
        assert list(got) == list(want)
        for k in want:
            torch.testing.assert_close(got[k], want[k], **TOL, msg=f"member {i} {k}")


def test_nt_xent_make_step_then_linear_probe_matches_each_member_alone() -> None:
    ens = vmapens.Ensemble(ssl_member, n=N, seeds=range(N))
    alone = seeded_members(ssl_member, N)
    batches = [views(s)[1:] for s in range(3)]
    step = vmapens.make_step(ens, nt_xent, vmapens.StackedAdam(ens, lr=LR), in_dims=0)
    dummy = torch.zeros(N, 1, dtype=torch.float64)  # make_step maps targets too with in_dims=0
    losses = [step((x1, x2), dummy) for x1, x2 in batches]
    # the first step's losses are each member's own NT-Xent before any update
    with torch.no_grad():
        x1, x2 = batches[0]
        first = torch.stack([nt_xent(m(x1[i], x2[i])) for i, m in enumerate(copy.deepcopy(alone))])
    torch.testing.assert_close(losses[0], first, **TOL)
    train_ssl_alone(alone, batches)
    assert_members(ens, alone)

    # linear probe on the frozen encoder, shared labelled data
    ens.template.encoder.requires_grad_(False)
    for m in alone:
        m.encoder.requires_grad_(False)
    g = torch.Generator().manual_seed(9)
    xs = torch.randn(12, D, generator=g, dtype=torch.float64)
    ys = torch.randint(3, (12,), generator=g)
    frozen = ens.stacked_params()["encoder.0.weight"].detach().clone()
    probe_step = vmapens.make_step(ens, nn.CrossEntropyLoss(), vmapens.StackedAdam(ens, lr=LR))
    for _ in range(3):
        probe_step(xs, ys)
    for m in alone:
        opt = torch.optim.Adam(m.parameters(), lr=LR)  # frozen ones get no grad: not stepped
        for _ in range(3):
            opt.zero_grad()
            F.cross_entropy(m(xs), ys).backward()
            opt.step()
    assert torch.equal(ens.stacked_params()["encoder.0.weight"], frozen)
    assert_members(ens, alone)
    with torch.no_grad():
        acc = vmapens.predict(ens, xs).argmax(-1).eq(ys).double().mean(-1)
        alone_acc = torch.stack([m.eval()(xs).argmax(-1).eq(ys).double().mean() for m in alone])
    torch.testing.assert_close(acc, alone_acc)


def test_nt_xent_fit_on_per_member_views_matches_each_member_alone() -> None:
    rows, batch, epochs = 10, 4, 2  # a last batch of 2: still a valid NT-Xent batch
    _, v1, v2 = views(7, rows)
    ens = vmapens.Ensemble(ssl_member, n=N, seeds=range(N))
    alone = seeded_members(ssl_member, N)
    dummy = torch.zeros(N, rows, 1, dtype=torch.float64)
    steps = epochs * -(-rows // batch)
    vmapens.fit(ens, ((v1, v2), dummy), nt_xent, epochs=epochs, batch_size=batch, lr=LR,
                in_dims=0, seed=3, progress=False)  # fmt: skip
    plan = batch_plan(rows, batch, steps, seed=3)
    train_ssl_alone(alone, [(v1[:, r], v2[:, r]) for r in plan])
    assert_members(ens, alone)


# ----------------------------------------------------------------------- (2) forecasting

T, CTX, HORIZON = 12, 8, 4


class CausalConv(nn.Conv1d):
    def forward(self, x: Tensor) -> Tensor:
        left = (self.kernel_size[0] - 1) * self.dilation[0]
        return super().forward(F.pad(x, (left, 0)))


class Forecaster(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = CausalConv(1, 6, 3, dilation=1)
        self.c2 = CausalConv(6, 6, 3, dilation=2)
        self.head = nn.Conv1d(6, 2, 1)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:  # x [B, T] -> mean, var [B, T]
        h = torch.relu(self.c2(torch.relu(self.c1(x.unsqueeze(1)))))
        out = self.head(h)
        return out[:, 0], F.softplus(out[:, 1]) + 1e-3


def gnll_torch(out: tuple[Tensor, Tensor], y: Tensor) -> Tensor:
    return nn.GaussianNLLLoss()(out[0], y, out[1])


def gnll_by_hand(out: tuple[Tensor, Tensor], y: Tensor) -> Tensor:
    """GaussianNLLLoss's formula (full=False, mean) without its value check: var > 1e-3."""
    mean, var = out
    return 0.5 * (var.log() + (mean - y) ** 2 / var).mean()


def fc_member() -> nn.Module:
    return Forecaster().double()


def series(seed: int, rows: int = 3) -> Tensor:
    """Each member's own series [N, rows, T]: noisy sines of member-specific phase."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(T, dtype=torch.float64)
    phase = torch.rand(N, rows, 1, generator=g, dtype=torch.float64) * 6
    return torch.sin(0.7 * t + phase) + 0.05 * torch.randn(
        N, rows, T, generator=g, dtype=torch.float64
    )


def train_fc_alone(models: list[nn.Module], batches: list[Tensor]) -> None:
    for i, m in enumerate(models):
        opt = torch.optim.Adam(m.parameters(), lr=LR)
        for s in batches:  # teacher forcing: inputs are the true values, targets one ahead
            opt.zero_grad()
            mean, var = m(s[i, :, :-1])
            F.gaussian_nll_loss(mean, s[i, :, 1:], var).backward()
            opt.step()


def rollout_alone(m: nn.Module, ctx: Tensor) -> Tensor:
    m.eval()
    x = ctx
    with torch.no_grad():
        for _ in range(HORIZON):
            mean, _ = m(x)
            x = torch.cat([x, mean[:, -1:]], 1)
    return x[:, -HORIZON:]


def test_gaussian_nll_loss_in_a_vmapped_step_is_refused_naming_the_way_out() -> None:
    ens = vmapens.Ensemble(fc_member, n=N, seeds=range(N))
    before = copy.deepcopy(ens.state_dict())
    step = vmapens.make_step(ens, gnll_torch, vmapens.StackedAdam(ens, lr=LR), in_dims=0)
    s = series(0)
    with pytest.raises(Exception, match="backend='loop'") as err:
        step(s[:, :, :-1], s[:, :, 1:])
    assert "loss_fn" in str(err.value)
    for k, v in before.items():
        assert torch.equal(ens.state_dict()[k], v), k


@pytest.mark.parametrize("how", ["loop_backend_torch_loss", "vmap_loss_by_hand"])
def test_forecaster_teacher_forcing_and_rollout_match_each_member_alone(how: str) -> None:
    backend, loss = (
        ("loop", gnll_torch) if how == "loop_backend_torch_loss" else ("vmap", gnll_by_hand)
    )
    ens = vmapens.Ensemble(fc_member, n=N, seeds=range(N), backend=backend)
    alone = seeded_members(fc_member, N)
    batches = [series(s) for s in range(3)]
    step = vmapens.make_step(ens, loss, vmapens.StackedAdam(ens, lr=LR), in_dims=0)
    for s in batches:
        step(s[:, :, :-1], s[:, :, 1:])
    train_fc_alone(alone, batches)
    assert_members(ens, alone)

    ctx = series(5)[:, :, :CTX]  # each member's own context [N, 3, CTX]
    want = torch.stack([rollout_alone(m, ctx[i]) for i, m in enumerate(alone)])
    ens.eval()
    x = ctx
    with torch.no_grad():
        for _ in range(HORIZON):
            mean, _ = ens(x, in_dims=0)
            x = torch.cat([x, mean[:, :, -1:]], -1)
    torch.testing.assert_close(x[:, :, -HORIZON:], want, **TOL)
    ens.train()
    x = ctx
    for _ in range(HORIZON):
        mean, var = vmapens.predict(ens, x, in_dims=0)
        assert (var > 0).all()
        x = torch.cat([x, mean[:, :, -1:]], -1)
    torch.testing.assert_close(x[:, :, -HORIZON:], want, **TOL)
    assert ens.training


def test_per_member_gaussian_nll_runs_member_by_member_as_documented() -> None:
    ens = vmapens.Ensemble(fc_member, n=N, seeds=range(N))
    alone = seeded_members(fc_member, N)
    s = series(1)
    out = ens(s[:, :, :-1], in_dims=0)
    got = vmapens.per_member(lambda o, y: gnll_torch(o, y), in_dims=(0, 0))(out, s[:, :, 1:])
    want = torch.stack([gnll_torch(m(s[i, :, :-1]), s[i, :, 1:]) for i, m in enumerate(alone)])
    torch.testing.assert_close(got, want.detach(), **TOL)
