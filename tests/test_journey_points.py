"""A user journey: an ensemble of point-cloud classifiers (float64, 3 members).

A researcher ensembles small PointNet / DGCNN-style classifiers on clouds `x [batch, 3, P]`:

- PointNet: a T-Net (a `Conv1d(k=1)` + BatchNorm1d shared MLP, `torch.max(h, 2)[0]`, a linear
  layer to a per-sample 3x3 matrix plus `torch.eye`), the cloud transformed by `torch.bmm`,
  a shared MLP of `Conv1d(k=1)` + BatchNorm1d, max pooling over points (a duplicated point,
  so the max ties), and the orthogonality regulariser `||I - A A^T||` returned with the
  logits and added in the loss;
- DGCNN: two edge convs, kNN by `torch.cdist` + `topk(k, largest=False)` (the second on the
  member's own learned features, a dynamic graph), neighbours gathered by index arithmetic
  (`idx + torch.arange(B)[:, None, None] * P`, `.view(-1)` rows of a flat view), max over
  neighbours; the clouds lie on a 3x3x3 lattice, so the kNN distances tie;
- farthest point sampling in the forward on the member's own learned coordinates (a Python
  loop, `torch.argmax`, per-member indices under vmap), from a fixed start and from a
  `torch.randint` start (docs/semantics.md, "Randomness in the forward pass": with
  `randomness="same"` each member draws what it draws alone from the same RNG state); the
  pointnet2 reference version (in-place writes, a boolean-mask assignment) is refused under
  vmap naming `backend='loop'`, which is exact.

Augmentation (a random rotation about z and jitter per member) is drawn in the test and
given stacked with `in_dims=0`. Truth: each member a plain module (`ens.unstack()` before
training) trained alone with `torch.optim.Adam` on the same batches. Convs before a
BatchNorm have no bias (docs/semantics.md, "What differs from training alone").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

import vmapens
from tests.truth import TOL64, assert_members_equal, batch_plan

pytestmark = pytest.mark.usefixtures("float64_default")

N, B, P, H, CLS = 3, 6, 8, 8, 3
LR = 0.01


class TNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(3, H, 1, bias=False)
        self.bn = nn.BatchNorm1d(H)
        self.fc = nn.Linear(H, 9)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.bn(self.conv(x)))
        return self.fc(torch.max(h, 2)[0]).view(-1, 3, 3) + torch.eye(3)


class PointNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tnet = TNet()
        self.mlp = nn.Sequential(
            nn.Conv1d(3, H, 1, bias=False), nn.BatchNorm1d(H), nn.ReLU(),
            nn.Conv1d(H, H, 1, bias=False), nn.BatchNorm1d(H), nn.ReLU(),
        )  # fmt: skip
        self.head = nn.Linear(H, CLS)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        a = self.tnet(x)
        h = self.mlp(torch.bmm(a.transpose(1, 2), x))
        eye = torch.eye(3).unsqueeze(0)
        reg = torch.norm(eye - torch.bmm(a, a.transpose(1, 2)), dim=(1, 2)).mean()
        return self.head(torch.max(h, 2)[0]), reg


def pointnet_loss(out: tuple[Tensor, Tensor], y: Tensor) -> Tensor:
    logits, reg = out
    return nn.functional.cross_entropy(logits, y) + 0.01 * reg


def edge_features(x: Tensor, k: int) -> Tensor:
    """DGCNN's `get_graph_feature`: [B, D, P] -> [B, 2D, P, k]."""
    b, d, p = x.shape
    pts = x.transpose(1, 2)
    idx = torch.cdist(pts, pts).topk(k, dim=-1, largest=False)[1]
    idx = (idx + torch.arange(b)[:, None, None] * p).view(-1)
    nb = pts.contiguous().view(b * p, d)[idx, :].view(b, p, k, d)
    ctr = pts.unsqueeze(2).expand(b, p, k, d)
    return torch.cat((nb - ctr, ctr), dim=3).permute(0, 3, 1, 2)


class DGCNN(nn.Module):
    def __init__(self, k: int = 4) -> None:
        super().__init__()
        self.k = k
        self.e1 = nn.Sequential(
            nn.Conv2d(6, H, 1, bias=False), nn.BatchNorm2d(H), nn.LeakyReLU(0.2)
        )
        self.e2 = nn.Sequential(
            nn.Conv2d(2 * H, H, 1, bias=False), nn.BatchNorm2d(H), nn.LeakyReLU(0.2)
        )
        self.head = nn.Linear(2 * H, CLS)

    def forward(self, x: Tensor) -> Tensor:
        h1 = self.e1(edge_features(x, self.k)).max(dim=-1)[0]
        h2 = self.e2(edge_features(h1, self.k)).max(dim=-1)[0]  # the member's own graph
        return self.head(torch.cat([h1, h2], 1).max(dim=-1)[0])


def fps_fixed_start(xyz: Tensor, m: int) -> Tensor:
    b, p, _ = xyz.shape
    distance = torch.full((b, p), 1e10)
    farthest = torch.zeros(b, dtype=torch.long)
    chosen = []
    for _ in range(m):
        chosen.append(farthest)
        centroid = xyz[torch.arange(b), farthest].unsqueeze(1)
        distance = torch.minimum(distance, ((xyz - centroid) ** 2).sum(-1))
        farthest = torch.argmax(distance, -1)
    return torch.stack(chosen, 1)


def fps_random_start(xyz: Tensor, m: int) -> Tensor:
    b, p, _ = xyz.shape
    distance = torch.full((b, p), 1e10)
    farthest = torch.randint(0, p, (b,))
    chosen = []
    for _ in range(m):
        chosen.append(farthest)
        centroid = torch.gather(xyz, 1, farthest.view(b, 1, 1).expand(b, 1, 3))
        distance = torch.minimum(distance, ((xyz - centroid) ** 2).sum(-1))
        farthest = torch.argmax(distance, -1)
    return torch.stack(chosen, 1)


def fps_pointnet2(xyz: Tensor, m: int) -> Tensor:
    """The pointnet2 reference code: in-place writes and a boolean-mask assignment."""
    b, p, _ = xyz.shape
    centroids = torch.zeros(b, m, dtype=torch.long)
    distance = torch.ones(b, p) * 1e10
    farthest = torch.randint(0, p, (b,), dtype=torch.long)
    rows = torch.arange(b, dtype=torch.long)
    for i in range(m):
        centroids[:, i] = farthest
        centroid = xyz[rows, farthest, :].view(b, 1, 3)
        dist = torch.sum((xyz - centroid) ** 2, -1)
        mask = dist < distance
        distance[mask] = dist[mask]
        farthest = torch.max(distance, -1)[1]
    return centroids


class SampleNet(nn.Module):
    """FPS on the member's own learned coordinates, then a PointNet on the sampled points."""

    def __init__(self, fps: Callable[[Tensor, int], Tensor]) -> None:
        super().__init__()
        self.fps = fps
        self.embed = nn.Conv1d(3, 3, 1)
        self.mlp = nn.Conv1d(3, H, 1)
        self.head = nn.Linear(H, CLS)

    def forward(self, x: Tensor) -> Tensor:
        idx = self.fps(self.embed(x).transpose(1, 2).detach(), 4)  # [B, 4], per member
        sub = x[torch.arange(x.shape[0])[:, None], :, idx]  # [B, 4, 3]
        return self.head(torch.relu(self.mlp(sub.transpose(1, 2))).amax(2))


def clouds(steps: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(steps, B, 3, P, generator=g)
    x[..., 1] = x[..., 0]  # a duplicated point: the max over points ties
    return x, torch.randint(0, CLS, (steps, B), generator=g)


def augment(x: Tensor, seed: int) -> Tensor:
    """Each member's own rotation about z and jitter: [n, ..., 3, P] from [..., 3, P]."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.rand(N, generator=g) * 2 * math.pi
    c, s, z, o = theta.cos(), theta.sin(), torch.zeros(N), torch.ones(N)
    rot = torch.stack([c, -s, z, s, c, z, z, z, o], 1).view(N, 3, 3)
    shape = (N, *([1] * (x.dim() - 2)), 3, 3)
    out = rot.view(shape) @ x.unsqueeze(0)
    return out + 0.01 * torch.randn(out.shape, generator=g)


def train_steps(
    factory: Callable[[], nn.Module],
    loss_fn: Callable[..., Tensor],
    xs: Tensor,
    ys: Tensor,
    *,
    own: bool = False,
    replay_rng: bool = False,
    **build: object,
) -> tuple[vmapens.Ensemble, list[nn.Module]]:
    """`make_step` on every batch against the naive loop; `own`: `xs[k]`, `ys[k]` are `[n, ...]`."""
    ens = vmapens.Ensemble(factory, n=N, seed=0, **build)
    alone = ens.unstack()
    step = vmapens.make_step(
        ens, loss_fn, vmapens.StackedAdam(ens, lr=LR), in_dims=0 if own else None
    )
    opts = [torch.optim.Adam(m.parameters(), lr=LR) for m in alone]
    for x, y in zip(xs, ys, strict=True):
        before = torch.get_rng_state()
        step(x, y)
        after = torch.get_rng_state()
        for i, (m, opt) in enumerate(zip(alone, opts, strict=True)):
            if replay_rng:  # randomness="same": each member draws from the step's RNG state
                torch.set_rng_state(before)
            opt.zero_grad()
            loss_fn(m(x[i]), y[i]).backward() if own else loss_fn(m(x), y).backward()
            opt.step()
        torch.set_rng_state(after)
    return ens, alone


@pytest.mark.parametrize("own", [False, True], ids=["shared", "rotated-per-member"])
def test_pointnet_with_tnet_and_orthogonality_term_trains_as_alone(own: bool) -> None:
    xs, ys = clouds(3)
    if own:
        xs = torch.stack([augment(x, seed=k) for k, x in enumerate(xs)])
        ys = ys.unsqueeze(1).expand(-1, N, -1)  # [steps, n, B]: make_step's in_dims=0 maps both
    ens, alone = train_steps(PointNet, pointnet_loss, xs, ys, own=own)
    assert_members_equal(ens, alone)
    ens.eval()
    x = xs[0][0] if own else xs[0]
    logits, reg = ens(x)
    for i, m in enumerate(alone):
        want = m.eval()(x)
        torch.testing.assert_close(logits[i], want[0], **TOL64)
        torch.testing.assert_close(reg[i], want[1], **TOL64)


def test_dgcnn_dynamic_graph_on_a_lattice_with_tied_distances_trains_as_alone() -> None:
    g = torch.arange(3.0)
    grid = torch.stack(torch.meshgrid(g, g, g, indexing="ij"), 0).reshape(3, 27)
    xs = grid.expand(2, 4, 3, 27) * torch.tensor([1.0, 0.5, 2.0, 1.5]).view(1, 4, 1, 1)
    ys = torch.tensor([[0, 1, 2, 0], [1, 2, 0, 1]])
    ens, alone = train_steps(DGCNN, nn.functional.cross_entropy, xs, ys)
    assert_members_equal(ens, alone)
    ens.eval()
    out = ens(xs[0])
    for i, m in enumerate(alone):
        torch.testing.assert_close(out[i], m.eval()(xs[0]), **TOL64)


@pytest.mark.parametrize(
    ("fps", "build"),
    [
        (fps_fixed_start, {}),
        (fps_random_start, {"randomness": "same"}),
        (fps_random_start, {"randomness": "same", "backend": "loop"}),
        (fps_pointnet2, {"randomness": "same", "backend": "loop"}),
    ],
    ids=["fixed-start", "randint-same", "randint-same-loop", "pointnet2-loop"],
)
def test_farthest_point_sampling_on_member_features_trains_as_alone(
    fps: Callable[[Tensor, int], Tensor], build: dict[str, str]
) -> None:
    xs, ys = clouds(3, seed=1)
    torch.manual_seed(5)
    ens, alone = train_steps(
        lambda: SampleNet(fps), nn.functional.cross_entropy, xs, ys, replay_rng=True, **build
    )
    assert_members_equal(ens, alone)


def test_pointnet2_fps_in_place_writes_are_refused_under_vmap_naming_the_loop_backend() -> None:
    ens = vmapens.Ensemble(lambda: SampleNet(fps_pointnet2), n=N, seed=0, randomness="same")
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    step = vmapens.make_step(ens, nn.functional.cross_entropy, vmapens.StackedAdam(ens, lr=LR))
    xs, ys = clouds(1)
    with pytest.raises(RuntimeError, match="backend='loop'"):
        step(xs[0], ys[0])
    for k, v in ens.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


def test_fit_per_member_lr_on_rotated_clouds_then_predict_and_member_files(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 3, P, generator=g)
    y = torch.randint(0, CLS, (8,), generator=g)
    xr, yr = augment(x, seed=7), y.expand(N, 8)  # [n, 8, 3, P], [n, 8]
    lrs = [0.005, 0.01, 0.02]
    ens = vmapens.Ensemble(PointNet, n=N, seed=0)
    alone = ens.unstack()
    vmapens.fit(ens, (xr, yr), pointnet_loss, steps=4, batch_size=4, lr=lrs, in_dims=0,
                seed=0, progress=False)  # fmt: skip
    for i, m in enumerate(alone):
        opt = torch.optim.Adam(m.parameters(), lr=lrs[i])
        for rows in batch_plan(8, 4, 4, seed=0):
            opt.zero_grad()
            pointnet_loss(m(xr[i][rows]), yr[i][rows]).backward()
            opt.step()
    assert_members_equal(ens, alone)

    test = torch.randn(5, 3, P, generator=g)
    logits, reg = vmapens.predict(ens, test)
    assert ens.training  # predict gives the mode back
    vmapens.save_members(ens, tmp_path)
    for i, m in enumerate(alone):
        want = m.eval()(test)
        torch.testing.assert_close(logits[i], want[0], **TOL64)
        torch.testing.assert_close(reg[i], want[1], **TOL64)
        plain = PointNet()
        plain.load_state_dict(torch.load(tmp_path / f"member_{i:04d}.pt"))
        torch.testing.assert_close(plain.eval()(test)[0], want[0], **TOL64)
