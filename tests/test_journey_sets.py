"""A user journey: an ensemble of set / point-cloud models (float64, 3 members, chunk_size=2).

A researcher ensembles four small set models, each taking a padded set `x [batch, S, D]` and a
bool `mask [batch, S]` (True = element present, some rows all False: empty sets):

- DeepSets: phi per element, masked sum, mean and max pooling (`masked_fill(-inf)` before the
  max, `torch.where` for empty sets), rho;
- PointNet-lite: per-point MLP, `torch.max(dim=1)` with its indices, which `gather` a second
  per-point feature at each feature's arg-max point;
- a kNN feature layer: `torch.cdist`, `topk(k, largest=False)` over present elements, the
  neighbours fetched by advanced indexing (`x[rows, idx]`) and by `gather`, an edge MLP, a
  masked max over the neighbours;
- a Set Transformer block: `nn.MultiheadAttention` with `key_padding_mask`, empty sets
  unmasked by `torch.where` and zeroed after.

The truth is the naive loop: each member as a plain module (`ens.unstack()` before training),
trained alone with `torch.optim.Adam` on the same batches. Checked: `make_step` on shared
batches (one mask for all members) and per-member batches (`in_dims=0`, each member its own
mask), `fit` on `((X, M), Y)` tensors, `predict`, and each member's permutation invariance.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

import vmapens
from tests.truth import TOL64, batch_plan

pytestmark = pytest.mark.usefixtures("float64_default")

N, B, S, D, H, K = 3, 5, 6, 2, 8, 3
LR = 0.02


def _present(mask: Tensor) -> Tensor:
    return mask.any(dim=1, keepdim=True)  # [B, 1]: False for an empty set


class DeepSets(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.phi = nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, H))
        self.rho = nn.Sequential(nn.Linear(3 * H, H), nn.Tanh(), nn.Linear(H, 1))

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        h = self.phi(x)  # [B, S, H]
        m = mask.unsqueeze(-1)
        total = (h * m).sum(dim=1)
        count = m.sum(dim=1).clamp(min=1)
        mean = total / count
        top = h.masked_fill(~m, float("-inf")).amax(dim=1)
        top = torch.where(_present(mask), top, torch.zeros_like(top))
        return self.rho(torch.cat([total, mean, top], dim=-1))


class PointNetLite(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.point = nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, H))
        self.side = nn.Linear(D, H)
        self.head = nn.Linear(2 * H, 1)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        h = self.point(x).masked_fill(~mask.unsqueeze(-1), float("-inf"))
        values, idx = torch.max(h, dim=1)  # [B, H] each
        critical = torch.gather(self.side(x), 1, idx.unsqueeze(1)).squeeze(1)  # [B, H]
        feats = torch.cat([values, critical], dim=-1)
        feats = torch.where(_present(mask), feats, torch.zeros_like(feats))
        return self.head(feats)


class KNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.edge = nn.Sequential(nn.Linear(2 * D + 1, H), nn.Tanh(), nn.Linear(H, H))
        self.head = nn.Linear(H, 1)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        dist = torch.cdist(x, x)  # [B, S, S]
        dist = dist.masked_fill(~mask.unsqueeze(1), float("inf"))
        near, idx = dist.topk(K, dim=-1, largest=False)  # [B, S, K]
        rows = torch.arange(x.shape[0]).view(-1, 1, 1)
        nbr = x[rows, idx]  # [B, S, K, D], advanced indexing
        nbr2 = torch.gather(x.unsqueeze(1).expand(-1, x.shape[1], -1, -1), 2,
                            idx.unsqueeze(-1).expand(-1, -1, -1, D))  # fmt: skip
        valid = torch.isfinite(near)  # a neighbour that is a real element
        near = torch.where(valid, near, torch.zeros_like(near))
        centre = x.unsqueeze(2).expand_as(nbr)
        e = self.edge(torch.cat([centre, nbr - nbr2 + nbr - centre, near.unsqueeze(-1)], -1))
        keep = (valid & mask.unsqueeze(-1)).unsqueeze(-1)  # [B, S, K, 1]
        e = e.masked_fill(~keep, float("-inf")).amax(dim=2).amax(dim=1)  # [B, H]
        e = torch.where(_present(mask), e, torch.zeros_like(e))
        return self.head(e)


class SetBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(D, H)
        self.att = nn.MultiheadAttention(H, 2, batch_first=True)
        self.head = nn.Linear(H, 1)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        h = self.embed(x)
        present = _present(mask)
        # An all-masked row gives NaN in torch's attention: unmask an empty set's keys, zero it after.
        keys_off = torch.where(present, ~mask, torch.zeros_like(mask))
        a, _ = self.att(h, h, h, key_padding_mask=keys_off, need_weights=False)
        h = h + a
        m = mask.unsqueeze(-1)
        pooled = (h * m).sum(dim=1) / m.sum(dim=1).clamp(min=1)
        return self.head(torch.where(present, pooled, torch.zeros_like(pooled)))


MODELS: dict[str, Callable[[], nn.Module]] = {
    "deepsets": DeepSets,
    "pointnet": PointNetLite,
    "knn": KNN,
    "settransformer": SetBlock,
}


def sets(g: torch.Generator, lead: tuple[int, ...] = ()) -> tuple[Tensor, Tensor, Tensor]:
    """Padded sets with sizes 0..S (row 0 empty), a mask, and a target per set."""
    x = torch.randn(*lead, B, S, D, generator=g)
    sizes = torch.randint(1, S + 1, (*lead, B), generator=g)
    sizes[..., 0] = 0
    mask = torch.arange(S) < sizes.unsqueeze(-1)
    y = torch.randn(*lead, B, 1, generator=g)
    return x, mask, y


def loss_fn(out: Tensor, y: Tensor) -> Tensor:
    return nn.functional.mse_loss(out, y)


def build(name: str) -> tuple[vmapens.Ensemble, list[nn.Module]]:
    ens = vmapens.Ensemble(MODELS[name], n=N, seed=0, chunk_size=2)
    return ens, ens.unstack()


def train_alone(m: nn.Module, batches: list[tuple[Tensor, Tensor, Tensor]]) -> None:
    opt = torch.optim.Adam(m.parameters(), lr=LR)
    for x, mask, y in batches:
        opt.zero_grad()
        loss_fn(m(x, mask), y).backward()
        opt.step()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_make_step_shared_and_per_member_masks_match_alone(name: str) -> None:
    ens, alone = build(name)
    g = torch.Generator().manual_seed(1)
    shared = [sets(g) for _ in range(2)]
    own = [sets(g, (N,)) for _ in range(2)]
    opt = vmapens.StackedAdam(ens, lr=LR)
    step = vmapens.make_step(ens, loss_fn, opt)
    step_own = vmapens.make_step(ens, loss_fn, opt, in_dims=0)
    for x, mask, y in shared:
        step((x, mask), y)
    for x, mask, y in own:
        step_own((x, mask), y)
    for i, m in enumerate(alone):
        train_alone(m, shared + [(x[i], mk[i], y[i]) for x, mk, y in own])
        torch.testing.assert_close(ens[i].state_dict(), m.state_dict(), **TOL64)
    # predict, shared and per member, against each member alone; and permutation invariance.
    x, mask, _ = sets(g)
    xs, masks, _ = sets(g, (N,))
    got = vmapens.predict(ens, (x, mask))
    got_own = ens(xs, masks, in_dims=0)
    perm = torch.randperm(S, generator=g)
    got_perm = ens(x[:, perm], mask[:, perm])
    with torch.no_grad():
        for i, m in enumerate(alone):
            torch.testing.assert_close(got[i], m(x, mask), **TOL64)
            torch.testing.assert_close(got_own[i], m(xs[i], masks[i]), **TOL64)
            torch.testing.assert_close(got_perm[i], got[i], **TOL64)
            assert torch.isfinite(got[i]).all()


@pytest.mark.parametrize("name", ["deepsets", "settransformer"])
@pytest.mark.parametrize("own", [False, True])
def test_fit_on_masked_sets_matches_alone(name: str, own: bool) -> None:
    # `fit` cuts `((X, M), Y)` by the same rows (per member along dim 1 with `in_dims=0`).
    ens, alone = build(name)
    g = torch.Generator().manual_seed(2)
    lead = (N,) if own else ()
    x, mask, y = (torch.cat(t, dim=len(lead)) for t in zip(*(sets(g, lead) for _ in range(2))))
    vmapens.fit(ens, ((x, mask), y), loss_fn, steps=4, batch_size=4, lr=LR, seed=0,
                in_dims=0 if own else None, progress=False)  # fmt: skip
    plan = batch_plan(2 * B, 4, 4, seed=0)
    for i, m in enumerate(alone):
        xi, mi, yi = (x[i], mask[i], y[i]) if own else (x, mask, y)
        train_alone(m, [(xi[r], mi[r], yi[r]) for r in plan])
        torch.testing.assert_close(ens[i].state_dict(), m.state_dict(), **TOL64)


class SegmentSets(DeepSets):
    """DeepSets pooled by boolean indexing: `h[mask]`, `index_add` and `scatter_reduce`."""

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        flat = self.phi(x)[mask]  # [present elements, H]
        seg = mask.nonzero()[:, 0]
        total = torch.zeros(x.shape[0], H).index_add(0, seg, flat)
        top = torch.full((x.shape[0], H), float("-inf"))
        top = top.scatter_reduce(0, seg[:, None].expand(-1, H), flat, "amax")
        top = torch.where(_present(mask), top, torch.zeros_like(top))
        mean = total / mask.sum(dim=1, keepdim=True).clamp(min=1)
        return self.rho(torch.cat([total, mean, top], dim=-1))


def test_boolean_index_pooling_shared_runs_per_member_mask_refused_then_loop() -> None:
    # docs/semantics.md, "What vmap cannot batch": a boolean mask as an index. With one mask
    # for all members vmap indexes an unbatched mask and runs; with a mask per member it is
    # refused naming backend='loop', which then trains each member as alone.
    g = torch.Generator().manual_seed(3)
    shared, own = sets(g), sets(g, (N,))
    ens = vmapens.Ensemble(SegmentSets, n=N, seed=0, chunk_size=2)
    alone = ens.unstack()
    step = vmapens.make_step(ens, loss_fn, vmapens.StackedAdam(ens, lr=LR), in_dims=0)
    before = ens.state_dict()
    with pytest.raises(RuntimeError, match="backend='loop'"):
        step((own[0], own[1]), own[2])
    torch.testing.assert_close(ens.state_dict(), before, rtol=0, atol=0)
    looped = vmapens.Ensemble(SegmentSets, n=N, seed=0, chunk_size=2, backend="loop")
    opt = vmapens.StackedAdam(looped, lr=LR)
    vmapens.make_step(ens, loss_fn, vmapens.StackedAdam(ens, lr=LR))(shared[:2], shared[2])
    vmapens.make_step(looped, loss_fn, opt, in_dims=0)(own[:2], own[2])
    for i, m in enumerate(alone):
        twin = SegmentSets()
        twin.load_state_dict(m.state_dict())
        train_alone(m, [shared])
        train_alone(twin, [(own[0][i], own[1][i], own[2][i])])
        torch.testing.assert_close(ens[i].state_dict(), m.state_dict(), **TOL64)
        torch.testing.assert_close(looped[i].state_dict(), twin.state_dict(), **TOL64)
