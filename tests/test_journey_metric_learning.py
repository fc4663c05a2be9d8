"""A user journey: metric learning losses torch ships, on triplets and pairs from the loader.

A researcher ensembles 3 tiny embedding MLPs (float64, to an L2-normalised 4-d embedding via
`F.normalize`) and trains them with, one at a time:

* `nn.TripletMarginLoss` on (anchor, positive, negative) triplets the data loader gives
  (inputs `[batch, 3, features]`);
* batch-hard triplet mining in the loss (`torch.cdist`, label masks, hardest positive by `max`,
  hardest negative by `min` over `masked_fill`ed distances);
* a supervised-contrastive / InfoNCE loss with a temperature (`logsumexp` over masked
  similarities, self pairs filled with `-inf`);
* `nn.CosineEmbeddingLoss` on pairs (inputs `[batch, 2, features]`, target +1 / -1 from the
  labels).

The loss gets the member's embeddings and the labels: shared labels, or per-member relabelled
batches (`in_dims=0`: each member its own grouping of the rows). Paths: `make_step`
with StackedAdam and StackedSGD (momentum), `fit` on a list of batches, the README's hand
loop with `vmapens.per_member`, and retrieval (recall@1 by nearest neighbour per member under
`no_grad`, and on the ensemble-averaged embedding re-normalised). tests/test_journey_metric.py
covers ArcFace, mined `argsort`/`topk` triplets and P x K loaders; this file does not repeat it.

The truth: every member copied out before training (`ens.unstack()`) and trained alone with
`torch.optim.Adam` / `torch.optim.SGD(momentum=...)` on the same batches. float64; only the
order of sums may differ, hence TOL.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import vmapens

pytestmark = pytest.mark.usefixtures("float64_default")

N, D, E, C, B, STEPS = 3, 5, 4, 3, 9, 3
TOL: dict[str, Any] = {"rtol": 1e-9, "atol": 1e-10}


class Embedder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 8), nn.Linear(8, E)

    def forward(self, x: Tensor) -> Tensor:  # any leading dims: [B, D], [B, 3, D], [B, 2, D]
        return F.normalize(self.fc2(torch.tanh(self.fc1(x))), dim=-1)


def triplet(emb: Tensor, y: Tensor) -> Tensor:  # emb [B, 3, E]; labels unused
    return nn.TripletMarginLoss(margin=0.5)(emb[:, 0], emb[:, 1], emb[:, 2])


def batch_hard(emb: Tensor, y: Tensor, margin: float = 0.3) -> Tensor:
    dist = torch.cdist(emb, emb)
    same = y[:, None] == y[None, :]
    hardest_pos = dist.masked_fill(~same, float("-inf")).max(dim=1).values
    hardest_neg = dist.masked_fill(same, float("inf")).min(dim=1).values
    return F.relu(hardest_pos - hardest_neg + margin).mean()


def supcon(emb: Tensor, y: Tensor, tau: float = 0.2) -> Tensor:
    sim = emb @ emb.T / tau
    eye = torch.eye(len(y), dtype=torch.bool)
    pos = (y[:, None] == y[None, :]) & ~eye
    log_prob = sim - torch.logsumexp(sim.masked_fill(eye, float("-inf")), dim=1, keepdim=True)
    return -(log_prob.masked_fill(~pos, 0.0).sum(1) / pos.sum(1)).mean()


def cosine_pairs(emb: Tensor, y: Tensor) -> Tensor:  # emb [B, 2, E], y [B, 2]
    target = torch.where(y[:, 0] == y[:, 1], 1.0, -1.0)
    return nn.CosineEmbeddingLoss(margin=0.2)(emb[:, 0], emb[:, 1], target)


# name -> (loss, inputs per row: 1 plain, 3 triplet, 2 pair)
LOSSES: dict[str, tuple[Callable[[Tensor, Tensor], Tensor], int]] = {
    "triplet_margin": (triplet, 3),
    "batch_hard": (batch_hard, 1),
    "supcon": (supcon, 1),
    "cosine_embedding": (cosine_pairs, 2),
}


def batches(width: int, seed: int, per_member: bool = False) -> list[tuple[Tensor, Tensor]]:
    """STEPS batches `(x, y)`: every class 3 times a batch (so each row has a positive); with
    `per_member` the labels are `[N, ...]`, member 0's the shared ones, the others' these
    shuffled over the rows (and the inputs `[N, ...]`, the same rows for every member)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        y = torch.arange(C).repeat(B // C)[torch.randperm(B, generator=g)]
        if width == 2:
            y = torch.stack([y, y[torch.randperm(B, generator=g)]], 1)
        centres = torch.randn(C, D, generator=g)
        shape = (B, width, D) if width > 1 else (B, D)
        x = torch.randn(*shape, generator=g) * 0.5
        x = x + (centres[y] if width != 3 else 0.0)
        if per_member:
            # member i > 0: the labels shuffled over the rows, another grouping of the same rows
            y = torch.stack([y] + [y[torch.randperm(B, generator=g)] for _ in range(N - 1)])
            x = x.expand(N, *x.shape).clone()
        out.append((x, y))
    return out


class Batches:
    """A re-iterable of stacked per-member batches that is not a list (a list with in_dims=0
    is one loader per member)."""

    def __init__(self, data: list) -> None:
        self.data = data

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        return iter(self.data)


OPTS = {
    "adam": (vmapens.StackedAdam, torch.optim.Adam, {"lr": 0.05}),
    "sgd_momentum": (vmapens.StackedSGD, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
}


def train_alone(alone: list[nn.Module], data: list, loss_fn: Callable, kind: str) -> Tensor:
    """Each member alone with torch.optim; member i reads slice i of per-member batches."""
    _, torch_cls, kw = OPTS[kind]
    losses = []
    for i, m in enumerate(alone):
        opt = torch_cls(m.parameters(), **kw)
        row = []
        for x, y in data:
            xi, yi = (x[i], y[i]) if x.dim() > 2 and y.dim() > 1 and len(y) == N else (x, y)
            opt.zero_grad()
            loss = loss_fn(m(xi), yi)
            loss.backward()
            opt.step()
            row.append(loss.detach())
        losses.append(torch.stack(row))
    return torch.stack(losses, 1)  # [steps, n]


def assert_members(ens: vmapens.Ensemble, alone: list[nn.Module]) -> None:
    for i, m in enumerate(alone):
        want = m.state_dict()
        for k, v in ens[i].state_dict().items():
            torch.testing.assert_close(v, want[k], **TOL, msg=f"member {i} {k}")


@pytest.mark.parametrize("kind", list(OPTS))
@pytest.mark.parametrize("name", list(LOSSES))
def test_make_step_with_each_loss_trains_every_member_as_alone(name: str, kind: str) -> None:
    loss_fn, width = LOSSES[name]
    data = batches(width, seed=1)
    ens = vmapens.Ensemble(Embedder, n=N, seed=0)
    alone = ens.unstack()
    stacked_cls, _, kw = OPTS[kind]
    step = vmapens.make_step(ens, loss_fn, stacked_cls(ens, **kw))
    together = torch.stack([step(x, y) for x, y in data])
    torch.testing.assert_close(together, train_alone(alone, data, loss_fn, kind), **TOL)
    assert_members(ens, alone)
    assert not torch.equal(ens[0].fc1.weight, vmapens.Ensemble(Embedder, n=N, seed=0)[0].fc1.weight)


@pytest.mark.parametrize("name", ["batch_hard", "supcon"])
def test_fit_on_per_member_relabelled_batches_trains_each_member_as_alone(name: str) -> None:
    loss_fn, width = LOSSES[name]
    data = batches(width, seed=2, per_member=True)
    ens = vmapens.Ensemble(Embedder, n=N, seed=0)
    alone = ens.unstack()
    opt = vmapens.StackedSGD(ens, lr=0.1, momentum=0.9)
    kw: dict[str, Any] = {"optimizer": opt, "epochs": 1, "in_dims": 0, "progress": False}
    # in_dims=0 takes stacked (X, Y) tensors or a list of n DataLoaders (docs/fit.md): a list
    # or another iterable of stacked batches is refused, not misread.
    with pytest.raises(TypeError, match="^fit: `data\\[0\\]`"):
        vmapens.fit(ens, data, loss_fn, **kw)
    with pytest.raises(TypeError, match="^fit: with `in_dims=0`.*got Batches"):
        vmapens.fit(ens, Batches(data), loss_fn, **kw)
    stacked = (torch.cat([x for x, _ in data], 1), torch.cat([y for _, y in data], 1))
    vmapens.fit(ens, stacked, loss_fn, batch_size=B, shuffle=False, **kw)
    train_alone(alone, data, loss_fn, "sgd_momentum")
    assert_members(ens, alone)


def test_hand_loop_with_shared_inputs_and_per_member_labels_as_alone() -> None:
    """README's loop: `per_member(loss, in_dims=(0, 0))` on `ens(x)` (shared inputs, output
    `[n, ...]`) and per-member labels `[n, B]`: member i is scored against its own labels."""
    shared = batches(1, seed=3)
    relabelled = batches(1, seed=3, per_member=True)
    data = [(x, yy) for (x, _), (_, yy) in zip(shared, relabelled)]
    ens = vmapens.Ensemble(Embedder, n=N, seed=0)
    alone = ens.unstack()
    opt = vmapens.StackedAdam(ens, lr=0.05)
    together = []
    for x, y in data:
        loss = vmapens.per_member(supcon, in_dims=(0, 0))(ens(x), y)
        opt.zero_grad()
        loss.sum().backward()
        opt.step()
        together.append(loss.detach())
    truth = []
    for i, m in enumerate(alone):
        o = torch.optim.Adam(m.parameters(), lr=0.05)
        row = []
        for x, y in data:
            o.zero_grad()
            loss = supcon(m(x), y[i])
            loss.backward()
            o.step()
            row.append(loss.detach())
        truth.append(torch.stack(row))
    torch.testing.assert_close(torch.stack(together), torch.stack(truth, 1), **TOL)
    assert_members(ens, alone)


def recall_at_1(emb: Tensor, y: Tensor) -> Tensor:
    d = torch.cdist(emb, emb).fill_diagonal_(float("inf"))
    return (y[d.argmin(1)] == y).double().mean()


def test_retrieval_recall_per_member_and_on_the_averaged_embedding() -> None:
    data = batches(1, seed=4)
    ens = vmapens.Ensemble(Embedder, n=N, seed=0)
    alone = ens.unstack()
    step = vmapens.make_step(ens, batch_hard, vmapens.StackedAdam(ens, lr=0.05))
    for x, y in data:
        step(x, y)
    train_alone(alone, data, batch_hard, "adam")
    g = torch.Generator().manual_seed(9)
    y = torch.arange(C).repeat(4)
    x = torch.randn(C, D, generator=g)[y] + 0.5 * torch.randn(len(y), D, generator=g)
    with torch.no_grad():
        emb = ens(x)  # [n, rows, E]
        want = torch.stack([m(x) for m in alone])
        torch.testing.assert_close(emb, want, **TOL)
        for i in range(N):
            assert recall_at_1(emb[i], y) == recall_at_1(want[i], y)
        avg = F.normalize(emb.mean(0), dim=-1)
        torch.testing.assert_close(avg, F.normalize(want.mean(0), dim=-1), **TOL)
        assert recall_at_1(avg, y) == recall_at_1(F.normalize(want.mean(0), dim=-1), y)
        pred = vmapens.predict(ens, x, reduce="none")
        torch.testing.assert_close(pred, want, **TOL)
