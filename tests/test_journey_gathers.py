"""A user journey: reads by index inside a member's forward, under vmap, `chunk_size=2` and
`backend="loop"`.

A researcher's members read their activations, parameters and buffers at indices that differ
per member (index buffers drawn in `__init__`; indices each member computes from its own
activations with argmax, topk, sort, argsort, searchsorted, bucketize) and at indices shared
by all members (`torch.arange(K)`, lists, a constant boolean mask):

- `Tensor.__getitem__` with advanced indices in every layout: first, after a slice, after a
  slice with a step, two non-adjacent, broadcast against each other, with `...`, with an int,
  with `None`, a 0-d computed index, a shared boolean mask;
- `torch.gather`, `take_along_dim` (with a dim and flat), `index_select`, `torch.take`,
  `torch.where` selections, `sort`/`topk` values;
- the models: a pointer network (argmax over attention scores, then the pointed state), a k-NN
  lookup against a per-member learned memory bank (`cdist` + `topk(largest=False)`, keys
  gathered with duplicates across queries), sparse top-k attention, hard routing to an expert
  weight (`experts[argmax]`, duplicate experts in a batch), bucketized features into a
  learned table (`bucketize`/`searchsorted` against each member's sorted edges);
- counters and EMA codebooks in per-member buffers written at computed indices under
  `torch.no_grad()` (`index_add_`, `index_fill_`, `index_copy_` at unique topk positions).

The truth: each member a plain module (built after `torch.manual_seed(k)`, as
`seeds=range(n)` builds it) run alone: `ens(x)` under `torch.no_grad()` in train mode
(outputs and buffers after the call), and two `make_step` steps against `torch.optim.Adam`
alone (losses, parameters, buffers, `.grad`), at 3 members (= the index length `L` and the
slot count `K`, where a batching rule that swaps the member dim with an index dim would hide)
and 4. float64: only the order of sums may differ, hence TOL.

What vmap cannot batch is refused naming `backend="loop"`, which runs as alone: a per-member
boolean mask as an index (data-dependent shape), `narrow`/`select` at a position computed
from a tensor (`index_select` / `gather` are the batched forms).

Found: a 0-d index that differs by member (`p = scores.argmax()`) is, alone, a `select`
(Python's indexing turns a 0-d integer tensor into an int), but torch keeps a batched one as an
index tensor. Beside another index where that changes the layout (`t[p, :, idx]`,
`t[:, idx, ..., p]`) `ens(x)` read the block transposed, or in another shape, and
`mem[p, :, idx] = v` wrote the other block, silently (the first step's self-check refused it);
fixed in session 35 (patch gathers-1: vmapens's index rules lay it out as alone).
`mem[p].mul_(0.5)` (alone a write through the select view) is lost under vmap, where `mem[p]`
is a copy: `ens(x)` leaves `mem` as it was, silently (strict xfail, no patch).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from parity import forward_and_steps_as_alone, refused_naming_the_loop
from torch import Tensor, nn
from truth import assert_members_equal, seeded_members

import vmapens

B, D, M, E = 4, 4, 6, 3  # batch, features, memory slots, experts
L = K = 3  # per-member index length, shared slot count
F64 = torch.float64
TOL: dict[str, Any] = {"rtol": 1e-10, "atol": 1e-12}  # float64, sums in another order
BACKENDS = [{}, {"chunk_size": 2}, {"backend": "loop"}]
IDS = ["vmap", "chunks", "loop"]


def _getitem(m: Reads, h: Tensor) -> list[Tensor]:
    t = h.view(B, 4, 4)
    idx, dup = m.idx, m.dup
    ar = torch.arange(K)
    am = t.sum(-1).argmax(-1)  # [B], computed per member
    top = t.sum((0, 1)).argmax()  # 0-d, computed per member
    return [
        t[idx],  # first
        t[:, idx],  # after a slice
        t[::2, dup],  # after a slice with a step, duplicates
        t[..., idx],  # after an Ellipsis
        t[idx, :, dup],  # two non-adjacent: the joint dim goes first
        t[:, idx, dup],  # two adjacent after a slice
        t[0, :, idx],  # an int, a slice, an index
        t[idx, 1, dup],  # an int between two indices
        t[None, ::2, idx],  # None in front
        t[idx[:, None], :, dup[None, :]],  # broadcast against each other, non-adjacent
        t[idx, ..., dup],  # Ellipsis between two indices
        t[ar, :, ar],  # shared, non-adjacent, K slots
        t[:, ar, ar.flip(0)],  # shared, adjacent after a slice
        t[:, [0, 2]],  # a shared list
        t[:, :, torch.tensor([True, False, True, True])],  # a shared boolean mask
        t[torch.arange(B), am],  # one row per sample at its argmax
        t[:, am],  # computed indices after a slice
        t[..., top],  # a 0-d computed index, alone
        t[idx, :, top],  # 0-d last, non-adjacent: the same layout as an index or a select
        t[top, idx],  # 0-d first, adjacent
        t[:, top, idx],  # 0-d after a slice, adjacent
        m.table[idx, dup],  # a parameter read at per-member indices
        m.table[:, am],  # a parameter read at computed indices (duplicates in a batch)
    ]


def _gathers(m: Reads, h: Tensor) -> list[Tensor]:
    order = h[:, 4:8].argsort(1)  # in 0..3
    s = h.sort(1, descending=True)
    tk = h[:, :4].topk(2, 1)
    edges = m.edges.sort().values  # each member's own sorted boundaries
    return [
        torch.gather(h, 1, m.idx.expand(B, L)),
        torch.gather(h, 0, m.dup[:, None].expand(L, D)),
        torch.gather(h, 1, order),  # sorted through gather: differentiable
        torch.take_along_dim(h, order[:, :2], 1),
        torch.take_along_dim(h, m.dup * 5),  # flat
        torch.take_along_dim(m.table, order[:, :1].T, 1),  # a parameter
        h.index_select(1, m.idx),
        h.index_select(0, m.dup),
        m.table.index_select(1, tk.indices.flatten()),
        torch.take(h, m.dup * 5 + 1),
        torch.where(h > m.thr, h, h.flip(1) * m.thr),
        torch.where(m.idx[:, None] == torch.arange(D), m.table[:L], 0.0),
        s.values,
        tk.values,
        torch.gather(m.table, 1, h[:, :4].sort(1).indices[:L]),
        m.table.view(-1)[torch.bucketize(h, edges)],
        m.table.view(-1)[torch.searchsorted(edges, h.detach(), right=True)],
        h.gather(1, torch.searchsorted(h.sort(1).values, h.flip(1))),
    ]


def _models(m: Reads, h: Tensor) -> list[Tensor]:
    # a pointer network: score each state against a query, point at the best, read it
    enc = h.view(B, 4, 4)
    scores = enc @ m.query  # [B, 4]
    ptr = scores.argmax(-1)
    pointed = enc[torch.arange(B), ptr] * scores.softmax(-1).gather(1, ptr[:, None])
    # k-NN lookup in a learned per-member memory bank: keys gathered with duplicates
    q = h[:, :D]
    near = torch.cdist(q, m.keys).topk(2, -1, largest=False).indices  # [B, 2]
    knn = m.keys[near].mean(1) + m.values.index_select(0, near.flatten()).view(B, 2, D).sum(1)
    # sparse top-k attention over the batch
    att = (q @ q.T) / 2
    top = att.topk(2, -1)
    sparse = (top.values.softmax(-1)[..., None] * h[:, D:][top.indices]).sum(1)
    # hard routing: each sample through its argmax expert
    route = (q @ m.router).argmax(-1)  # [B] in 0..E-1, duplicates
    routed = torch.bmm(m.experts[route], q[:, :, None]).squeeze(-1)
    return [pointed, knn, sparse, routed]


def _buffers(m: Reads, h: Tensor) -> list[Tensor]:
    q = h[:, :D]
    with torch.no_grad():
        nearest = torch.cdist(q, m.codebook).argmin(-1)  # [B], duplicates
        m.counts.index_add_(0, nearest, torch.ones(B, dtype=F64))
        m.codebook.mul_(0.9).index_add_(0, nearest, q, alpha=0.1)
        hot = torch.cdist(q, m.codebook).sum(0).topk(2).indices  # unique slots
        m.mark.index_fill_(0, hot, -1.0)
        m.codebook.index_copy_(0, hot, q[:2] * 0.5)
        m.last.copy_(m.codebook[nearest])
    return [q * m.counts[nearest][:, None], q + m.codebook[nearest], m.mark[None] * q.sum()]


FAMILIES = {"getitem": _getitem, "gathers": _gathers, "models": _models, "buffers": _buffers}


class Reads(nn.Module):
    def __init__(self, family: str = "getitem") -> None:
        super().__init__()
        self.family = family
        self.fc = nn.Linear(D, 16, dtype=F64)
        self.thr = nn.Parameter(torch.randn((), dtype=F64) * 0.3)
        self.table = nn.Parameter(torch.randn(4, 4, dtype=F64))
        self.query = nn.Parameter(torch.randn(4, dtype=F64))
        self.keys = nn.Parameter(torch.randn(M, D, dtype=F64))
        self.values = nn.Parameter(torch.randn(M, D, dtype=F64))
        self.router = nn.Parameter(torch.randn(D, E, dtype=F64))
        self.experts = nn.Parameter(torch.randn(E, D, D, dtype=F64) * 0.5)
        self.register_buffer("idx", torch.randperm(4)[:L])
        self.register_buffer("dup", torch.randint(0, 4, (2,))[[0, 0, 1]])
        self.register_buffer("edges", torch.randn(15, dtype=F64))
        self.register_buffer("codebook", torch.randn(M, D, dtype=F64))
        self.register_buffer("counts", torch.zeros(M, dtype=F64))
        self.register_buffer("mark", torch.zeros(M, dtype=F64))
        self.register_buffer("last", torch.zeros(B, D, dtype=F64))

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([o.reshape(-1) for o in FAMILIES[self.family](self, self.fc(x))])


def _data(count: int, *shape: int, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    """`count` batches `(x [B, D], y [*shape])` of float64 normals."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(B, D, generator=g, dtype=F64), torch.randn(*shape, generator=g, dtype=F64))
        for _ in range(count)
    ]


def _check(factory: Any, backend: dict, n: int) -> None:
    x, _ = _data(1, 1, seed=7)[0]
    ens = vmapens.Ensemble(factory, n=n, seeds=range(n), **backend)
    alone = seeded_members(factory, n)
    assert len({tuple(m.idx.tolist()) for m in alone}) > 1  # the indices differ per member
    forward_and_steps_as_alone(ens, alone, x, lambda want: _data(2, *want.shape[1:]), **TOL)


# L members: as many as an index has entries and as shared slots (K), where a rule that swapped
# the member dim with an index dim would give the right shape; 4: another count
CASES = [(L, {}), (4, {}), (4, {"chunk_size": 2}), (L, {"backend": "loop"})]
CASE_IDS = ["vmap-3", "vmap-4", "chunks-4", "loop-3"]


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # torch.take: torch's loop
@pytest.mark.parametrize(("n", "backend"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_reads_by_index_match_each_member_alone(family: str, n: int, backend: dict) -> None:
    _check(lambda: Reads(family), backend, n)


# -- a 0-d index per member beside another index --------------------------------------------


class Pointed(nn.Module):
    """`t[p, :, self.idx]` with `p` the member's own argmax (a pointer): alone, Python's
    indexing selects at a 0-d index (`[4, L]`); a batched one torch keeps as an index tensor,
    which is then not adjacent to `idx`, and lays out `[L, 4]`. Under `torch.no_grad()` the same
    write into a per-member buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, 16, dtype=F64)
        self.register_buffer("idx", torch.randperm(4)[:L])
        self.register_buffer("mem", torch.randn(4, 4, 4, dtype=F64))

    def forward(self, x: Tensor) -> Tensor:
        t = self.fc(x).view(B, 4, 4)
        p = t.sum((1, 2)).argmax()
        with torch.no_grad():
            self.mem[p, :, self.idx] = t[0, :, :L] * 0.5  # alone: a [4, L] block of row p
        return torch.cat([t[p, :, self.idx].reshape(-1), self.mem.sum((0, 2))])


@pytest.mark.parametrize(("n", "backend"), [(L, {}), (4, {"chunk_size": 2})], ids=IDS[:2])
def test_a_per_member_0d_index_beside_another_reads_and_writes_as_alone(
    n: int, backend: dict
) -> None:
    _check(Pointed, backend, n)


def test_a_per_member_0d_index_beside_another_runs_as_alone_with_backend_loop() -> None:
    _check(Pointed, {"backend": "loop"}, L)


class SelectView(nn.Module):
    """`self.mem[p].mul_(0.5)`: alone `mem[p]` with a 0-d `p` is a `select`, a view, and the
    write lands in `mem`; under vmap a per-member `p` indexes, a copy, and the write is lost."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, 4, dtype=F64)
        self.register_buffer("idx", torch.randperm(4)[:L])
        self.register_buffer("mem", torch.randn(4, 4, dtype=F64))

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        with torch.no_grad():
            self.mem[h.sum(0).argmax()].mul_(0.5)
        return h * self.mem.sum(0)


@pytest.mark.xfail(
    strict=True,
    reason="gathers-2: `mem[p].mul_(0.5)` with a 0-d index per member is lost under vmap "
    "(alone a select view writes into `mem`); ens(x) silently leaves `mem` as it was, the "
    "first step refuses it (no patch: a rule cannot return a per-member view)",
)
def test_a_write_through_a_per_member_0d_select_reaches_the_buffer() -> None:
    x, _ = _data(1, 1, seed=7)[0]
    ens = vmapens.Ensemble(SelectView, n=L, seeds=range(L))
    alone = seeded_members(SelectView, L)
    with torch.no_grad():
        out = ens(x)
        want = torch.stack([m(x) for m in alone])
    torch.testing.assert_close(out, want, **TOL)
    assert_members_equal(ens, alone, **TOL)


# -- refused under vmap, exact with backend="loop" --------------------------------------------


class Positions(nn.Module):
    """Reads at a position or mask vmap cannot batch: `narrow`/`select` at a position computed
    from a tensor, a per-member boolean mask (8 of 16 set, so every member reads as many)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.fc = nn.Linear(D, 16, dtype=F64)
        self.register_buffer("idx", torch.randperm(4)[:L])
        self.register_buffer("mask", torch.randperm(16) < 8)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        at = h.sum(0)[:8].argmax()
        if self.kind == "narrow":
            return h.narrow(1, at, 4) + h.select(1, self.idx[0])
        if self.kind == "select":
            return h.select(1, at)
        return h[:, self.mask] + h[h > 0].sum()


@pytest.mark.parametrize(
    ("kind", "says"),
    [("narrow", "narrow.Tensor"), ("select", ".item()"), ("mask", "boolean mask")],
)
def test_positions_vmap_cannot_batch_are_refused_and_backend_loop_runs_as_alone(
    kind: str, says: str
) -> None:
    ens = vmapens.Ensemble(lambda: Positions(kind), n=L, seeds=range(L))
    x, y = _data(1, B, 4)[0]
    refused_naming_the_loop(ens, x, y, says)
    _check(lambda: Positions(kind), {"backend": "loop"}, L)
