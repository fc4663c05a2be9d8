"""A user journey: indexing writes inside a member's forward (`t[idx] = v`, `index_put_`,
`index_*_`, `masked_*_`, `scatter*_`, `put_`, `take`, writes into views), under vmap,
`chunk_size=2` and `backend="loop"`.

Each member holds its own index buffers (`idx`, two distinct rows; `dup`, three rows with a
duplicate) drawn in `__init__`, so the indices differ per member; a learned threshold `thr`
makes per-member masks and fill values. Writes go into clones of the activations (their
gradients reach the parameters) and, under `torch.no_grad()`, into a per-member buffer that
the output then reads. The truth: each member a plain module (built after
`torch.manual_seed(k)`, as `seeds=range(n)` builds it) run alone: `ens(x)` under
`torch.no_grad()` in train mode (outputs and buffers after the call), and two `make_step` steps
against `torch.optim.Adam` alone (losses, parameters, buffers, `.grad`). float64: only the
order of sums may differ, hence TOL.

What vmap cannot batch is refused, naming `backend="loop"`, which then runs as alone: a
boolean mask (`h[h > self.thr] = 0`; `masked_fill_` is the batched rewrite) and a write into a
tensor the forward made with `torch.zeros(...)` (`h.new_zeros(...)` is batched).
A write with one index shared by all members (`torch.arange(k)`) at two non-adjacent
positions (`t[:, ar, :, ar] = self.diag`) was wrong under torch's `index_put_` batching rule
(the value broadcast along the wrong dims when `k` equals the number of members in the call,
silently, in `ens(x)` and in training; a shape mismatch otherwise); vmapens's own rule
(`vmapens._index_rules`) lays it out as alone, for any member count.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from parity import forward_and_steps_as_alone, refused_naming_the_loop
from torch import Tensor, nn
from truth import seeded_members

import vmapens

N, B = 3, 4
F64 = torch.float64
TOL: dict[str, Any] = {"rtol": 1e-10, "atol": 1e-12}  # float64, sums in another order
BACKENDS = [{}, {"chunk_size": 2}, {"backend": "loop"}]
IDS = ["vmap", "chunks", "loop"]


def _index(m: Writes, h: Tensor) -> list[Tensor]:
    idx, dup = m.idx, m.dup
    t1 = h.clone().index_fill_(1, idx, m.thr)  # a per-member 0-d value
    t2 = h.clone().index_copy_(1, idx, h[:, :2] * 2)
    t3 = h.clone().index_add_(0, dup, h[:3] * h[3:], alpha=2.5)
    t4 = h.clone().index_put_((dup,), h[1:].tanh(), accumulate=True)  # duplicates add up
    t5 = h.clone()
    t5[idx, idx.flip(0)] = h[0, :2] * 3  # two tensor indices, adjacent
    t6 = h.clone()
    t6[idx - 4] = h[2:].exp()  # negative indices
    t7 = h.clone()
    t7.T[idx] = h[:2] ** 2  # through a transposed view: the member's columns
    t8 = h.clone()
    t8[idx, ::2] = h[:2, 1::2]  # a tensor index, then a slice with a step
    t9 = h.clone()
    t9[:, [0, 2]] = h[:, 1:2] * m.thr  # a shared list after a slice, value broadcast
    t10 = h.clone().view(2, 2, 4)
    t10[idx % 2, :, idx] = h[:2, 2:]  # per-member indices, not adjacent
    t11 = h.clone()
    t11[idx] = m.thr  # a 0-d value, broadcast
    return [t1, t2, t3, t4, t5, t6, t7, t8, t9, t10.view(4, 4), t11]


def _scatter(m: Writes, h: Tensor) -> list[Tensor]:
    cols, rows = m.dup[None].expand(4, 3), m.dup[:, None].expand(3, 4)
    return [
        h.clone().scatter_(1, cols, h[:, :3] * 2),
        h.clone().scatter_add_(0, rows, h[1:].sigmoid()),
        h.clone().scatter_reduce_(0, rows, h[1:], "sum", include_self=False),
        h.clone().scatter_reduce_(0, rows, h[:3] * 2, "amax", include_self=True),
        h.clone().scatter_reduce_(0, rows, h[1:] * 3, "amax", include_self=False),
        h.clone().scatter_reduce_(1, cols, h[:, :3], "mean", include_self=False),
        h.clone().scatter_reduce_(1, cols, h[:, 1:], "mean", include_self=True),
        h.clone().scatter_reduce_(1, cols, h[:, 1:] + 2, "prod", include_self=False),
        h.clone().put_(m.dup * 5, h[0, :3] * 3),
        h.clone().put_(m.dup, h[1, :3], accumulate=True),
        h + h.take(m.dup * 4 + 1).sum(),
    ]


def _mask(m: Writes, h: Tensor) -> list[Tensor]:
    k4, k6, k7, k8 = h.clone(), h.clone(), h.clone(), h.clone()
    k4.diagonal().fill_(m.thr)
    k6.view(2, 8)[..., 0].add_(m.thr * 2)  # a write into a view of a view
    k7.narrow(1, 1, 2).copy_(h[:, 2:].flip(0))
    k8.diagonal(1).mul_(m.thr)
    return [
        h.clone().masked_fill_(h > m.thr, 0.0),  # the batched form of h[h > thr] = 0
        h.clone().masked_fill_(h < -m.thr, m.thr),
        h.clone().masked_scatter_(h > 0, h.flip(0) * 2),
        k4,
        h.clone().tril_(-1),
        k6,
        k7,
        k8,
    ]


def _buffer(m: Writes, h: Tensor) -> list[Tensor]:
    with torch.no_grad():
        mem = m.mem
        mem.index_copy_(0, m.idx, h[:2])
        mem.index_put_((m.dup, m.dup.flip(0)), h[0, :3], accumulate=True)
        mem.masked_fill_(mem.abs() > 2, 0.5)
        mem.scatter_reduce_(1, m.dup[None].expand(4, 3), h[:, :3], "amax", include_self=True)
        mem.T[m.idx] = h[2:]
        mem[m.idx, 1:3] = -0.25
        mem.diagonal().add_(0.1)
        mem.index_add_(1, m.dup, h[:, 1:], alpha=-0.5)
        mem.scatter_(1, m.dup[None].expand(4, 3), h[:, :3] * 0.5, reduce="add")
        mem.scatter_(0, m.dup[:, None].expand(3, 4), h[1:].sigmoid(), reduce="multiply")
        mem.index_reduce_(1, m.idx, h[:, 2:], "amax", include_self=False)
        mem.put_(m.dup * 5, h[0, :3])
    return [h * m.mem, h + m.mem.sum()]


FAMILIES = {"index": _index, "scatter": _scatter, "mask": _mask, "buffer": _buffer}


class Writes(nn.Module):
    def __init__(self, family: str = "index") -> None:
        super().__init__()
        self.family = family
        self.fc = nn.Linear(4, 4, dtype=F64)
        self.thr = nn.Parameter(torch.randn((), dtype=F64) * 0.3)
        self.register_buffer("idx", torch.randperm(4)[:2])
        self.register_buffer("dup", torch.randint(0, 4, (2,))[[0, 0, 1]])
        self.register_buffer("mem", torch.randn(4, 4, dtype=F64))

    def forward(self, x: Tensor) -> Tensor:
        return torch.stack(FAMILIES[self.family](self, self.fc(x)))


def _data(count: int, *shape: int, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    """`count` batches `(x [B, 4], y [*shape])` of float64 normals."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(B, 4, generator=g, dtype=F64), torch.randn(*shape, generator=g, dtype=F64))
        for _ in range(count)
    ]


def _check(factory: Any, backend: dict, n: int = N) -> None:
    x, _ = _data(1, 1, seed=7)[0]
    ens = vmapens.Ensemble(factory, n=n, seeds=range(n), **backend)
    alone = seeded_members(factory, n)
    if hasattr(alone[0], "idx"):  # the indices differ per member
        assert len({tuple(m.idx.tolist()) for m in alone}) > 1
    forward_and_steps_as_alone(ens, alone, x, lambda want: _data(2, *want.shape[1:]), **TOL)


@pytest.mark.filterwarnings("ignore:The reduce argument of torch.scatter")  # reduce= (buffer)
@pytest.mark.filterwarnings("ignore:index_reduce\\(\\) is in beta")
@pytest.mark.parametrize("backend", BACKENDS, ids=IDS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_indexed_writes_with_per_member_indices_match_each_member_alone(
    family: str, backend: dict
) -> None:
    _check(lambda: Writes(family), backend)


# -- refused under vmap, exact with backend="loop" ----------------------------------------------


class BoolMask(nn.Module):
    """`h[h > self.thr] = 0`: a boolean mask from the member's own parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4, dtype=F64)
        self.thr = nn.Parameter(torch.randn((), dtype=F64) * 0.3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        h[h > self.thr] = 0
        return h[None]


class Fresh(nn.Module):
    """A tensor made in the forward (`torch.zeros`), then written at the member's indices."""

    def __init__(self, like: bool = False) -> None:
        super().__init__()
        self.like = like
        self.fc = nn.Linear(4, 4, dtype=F64)
        self.register_buffer("idx", torch.randperm(4)[:2])

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        t = h.new_zeros(4, 4) if self.like else torch.zeros(4, 4, dtype=F64)
        t[self.idx] = h[:2]
        return (t + h)[None]


@pytest.mark.parametrize(
    ("factory", "says"),
    [(BoolMask, "boolean mask"), (Fresh, "index_put_")],
    ids=["bool_mask", "torch_zeros"],
)
def test_what_vmap_cannot_batch_is_refused_and_backend_loop_runs_as_alone(
    factory: Any, says: str
) -> None:
    ens = vmapens.Ensemble(factory, n=N, seeds=range(N))
    x, y = _data(1, 1, B, 4)[0]
    refused_naming_the_loop(ens, x, y, says)
    _check(factory, {"backend": "loop"})


@pytest.mark.parametrize("backend", BACKENDS, ids=IDS)
def test_a_tensor_made_with_new_zeros_is_per_member_and_runs_as_alone(backend: dict) -> None:
    _check(lambda: Fresh(like=True), backend)


class Reduced(nn.Module):
    """`index_reduce_` (amax) into a clone of the activations, differentiated."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4, dtype=F64)
        self.register_buffer("idx", torch.randperm(4)[:2])

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        return h.clone().index_reduce_(1, self.idx, h[:, 2:] * 2, "amax", include_self=False)


@pytest.mark.filterwarnings("ignore:index_reduce\\(\\) is in beta")
@pytest.mark.parametrize("backend", BACKENDS[:2], ids=IDS[:2])
def test_a_differentiated_index_reduce_under_vmap_is_refused_and_loop_runs_as_alone(
    backend: dict,
) -> None:
    # torch's vmap fails its backward alone too ("modified by an inplace operation", a
    # torch-only reproduction: vmap(f)(w, idx).sum().backward()); vmap(grad(f)) runs
    ens = vmapens.Ensemble(Reduced, n=N, seeds=range(N), **backend)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedAdam(ens, lr=0.05))
    x, y = _data(1, B, 4)[0]
    with pytest.raises(RuntimeError, match="backend='loop'") as err:
        step(x, y)
    assert "modified by an inplace operation" in str(err.value)
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in ens.parameters())
    _check(Reduced, {"backend": "loop"})


# -- one shared index at two non-adjacent positions -------------------------------------------

K, FEAT = 2, 3  # slots, features: `t[:, ar, :, ar]` with ar = torch.arange(K)


class PairTable(nn.Module):
    """A pairwise table `[B, K, F, K]` whose self-pairs take a learned per-member vector."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, K * FEAT * K, dtype=F64)
        self.diag = nn.Parameter(torch.randn(FEAT, dtype=F64))

    def forward(self, x: Tensor) -> Tensor:
        t = self.fc(x).view(-1, K, FEAT, K).clone()
        ar = torch.arange(K)
        t[:, ar, :, ar] = self.diag  # alone: [K, B, F] at the self-pairs
        return t.flatten(1)


class PairMemory(nn.Module):
    """The same write into a per-member buffer under `torch.no_grad()`."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4, dtype=F64)
        self.register_buffer("mem", torch.zeros(K, FEAT, K, dtype=F64))

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        ar = torch.arange(K)
        with torch.no_grad():
            self.mem[ar, :, ar] = h[0, :FEAT]  # alone: value [F] broadcast to [K, F]
        return h * self.mem.sum()


@pytest.mark.parametrize("factory", [PairTable, PairMemory])
@pytest.mark.parametrize(
    ("n", "backend"),
    [(N, {}), (K, {}), (2 * K, {"chunk_size": K}), (K, {"backend": "loop"})],
    ids=["vmap-3-members", "vmap-2-members", "chunks", "loop"],
)
def test_a_shared_non_adjacent_index_matches_each_member_alone(
    factory: Any, n: int, backend: dict
) -> None:
    # torch's index_put_ rule raised a shape mismatch for N != K members and, for K members,
    # wrote other members' values, silently (ens(x) and every step: the self-check runs member
    # 0 in a vmap of one member, where torch's rule is right); vmapens's rule lays it out as alone
    _check(factory, backend, n=n)
