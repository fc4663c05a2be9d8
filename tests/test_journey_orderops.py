"""A user journey: order- and position-dependent ops on a member's activations and buffers.

The researcher's forwards reorder and re-lay-out what the member computes: `flip`, `fliplr`,
`rot90`, `roll` (without dims, several dims, dim 0; a per-member shift written as index
arithmetic, since `torch.roll` takes an int), `cumsum`/`cumprod`/`cummax`/`cummin`/
`logcumsumexp` along dim 0, negative dims and with a dtype (position ids from a mask), `diff`
with per-member `prepend`/`append`, `sort(stable=True)` of tied values with the inverse
permutation by `scatter`, `argsort`, `kthvalue`, `msort`, `topk` along dim 0, `searchsorted`
with `side`, `sorter` and `out_int32` against per-member and shared (N-D) boundaries,
`tril`/`triu` with offsets, `tril_indices`, `diag_embed`/`diagonal`/`diagonal_scatter` with
offsets and dims, `slice_scatter`, `repeat_interleave` with shared and per-member tensor
repeats, `F.pad` reflect/replicate/circular over 1, 2 and 3 dims (batched and unbatched
inputs, negative circular pads), `F.unfold`/`F.fold`, `pixel_shuffle`/`pixel_unshuffle`,
`channel_shuffle`, sliding windows with `Tensor.unfold` (an STFT-free framing with a learned
window), and, under `torch.no_grad()`, a ring buffer (`roll` + write), `cumsum_`, `tril_`,
a sorted copy and a flipped copy into per-member buffers.

Sizes coincide on purpose: 3 members, a batch of 3, views with dims of 3 and 2 (the
`chunk_size=2` chunks), buffers `[3, 3]`, so a batching rule that reads the member dim as
another would not raise. The truth: each member a plain module (built after
`torch.manual_seed(k)`, as `seeds=range(n)` builds it) run alone: `ens(x)` under
`torch.no_grad()` in train mode (outputs and buffers after the call), and two `make_step`
steps against `torch.optim.Adam` alone (losses, parameters, buffers, `.grad`), under vmap,
`chunk_size=2` and `backend="loop"`. float64: only the order of sums may differ, hence TOL.

Found and fixed in session 35: `torch.select_scatter(h, src, dim, index)` (a functional row
write) under vmap gave `src` `h.size(dim)` times its gradient alone, silently, in a
hand-written loop over `ens(x)` + `backward()` (README's loop; also a write batched at the
ensemble's level inside a user's own `torch.func.vmap`): torch's batching rule writes with
`scatter` of an expanded `src`. The first `make_step` / `fit` step refused it (its self-check
runs member 0: "computes something else"); `backend="loop"` is exact. vmapens's rule
(`vmapens/_fixed_rules.py`, patch orderops-1) calls `select_scatter` itself one dim further
in; a write batched at the user's own vmap level keeps torch's rule, as alone.
Refused, naming `backend='loop'`, which runs as alone: `pad_sequence` of a member's own
rows (no batching rule) and `repeat_interleave` with per-member repeats of different totals.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from parity import forward_and_steps_as_alone, refused_naming_the_loop
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence
from truth import assert_members_equal, seeded_members

import vmapens

pytestmark = [
    # cumsum_/tril_ on a buffer and repeat_interleave with tensor repeats run through torch's
    # member loop (docs/semantics.md, "What vmap cannot batch"): exact, with this warning.
    pytest.mark.filterwarnings("ignore:There is a performance drop"),
    # torch's searchsorted rule expands a shared sorter: non-contiguous under vmap only
    pytest.mark.filterwarnings("ignore:torch.searchsorted.*non-contiguous:UserWarning"),
]

N, B = 3, 3  # members, batch rows: equal on purpose
F64 = torch.float64
TOL: dict[str, Any] = {"rtol": 1e-10, "atol": 1e-12}  # float64, sums in another order
BACKENDS = [{}, {"chunk_size": 2}, {"backend": "loop"}]
IDS = ["vmap", "chunks", "loop"]


def _flat(parts: list[Tensor]) -> Tensor:
    return torch.cat([p.to(F64).flatten() for p in parts])


def _flips(m: Orders, h: Tensor) -> list[Tensor]:
    t = h.view(3, 3, 2)
    shifted = (torch.arange(6) - m.shift) % 6  # a per-member roll as index arithmetic
    return [
        t.flip(0, -1), torch.fliplr(h), torch.flipud(h), torch.rot90(h.view(3, 2, 3), 1, (0, 2)),
        torch.roll(h * m.w, 2), torch.roll(t, 4),  # no dims: the member's flattened tensor
        torch.roll(h, (1, -2), (0, -1)), torch.roll(t, -1, 0),
        h[:, shifted], h.gather(1, shifted.expand(B, 6)), m.mem.roll(1, 1) @ h[:, :3].T,
    ]  # fmt: skip


def _cumulative(m: Orders, h: Tensor) -> list[Tensor]:
    t = h.view(3, 3, 2)
    cmax, cmin = h.cummax(0), h.cummin(-1)
    return [
        h.cumsum(0), h.cumsum(-1), t.cumprod(-2), cmax.values, cmax.indices,
        cmin.values, cmin.indices, h.logcumsumexp(0), t.logcumsumexp(-2),
        torch.diff(h, dim=0, prepend=m.mem[:1].repeat(1, 2)),  # a per-member first row
        torch.diff(h, n=3, dim=-1, append=m.mem),
        h * ((h > 0).long().cumsum(-1) - 1),  # position ids from a mask
        h * torch.cumsum(h > m.w[:1], 0, dtype=F64) * m.w,
        h.flip(1).cumsum(1).flip(1),  # a reverse cumsum
        torch.cummax((h * 3).long(), 0).values * h,
    ]  # fmt: skip


def _sorts(m: Orders, h: Tensor) -> list[Tensor]:
    tied = torch.round(h * 2) / 2 + 0 * h  # exact ties, the member's own values
    s = torch.sort(tied, dim=1, stable=True)
    inverse = torch.empty_like(s.indices).scatter_(1, s.indices, torch.arange(6).expand(B, 6))
    d = torch.sort(h * m.w, dim=0, stable=True, descending=True)
    back = torch.zeros_like(h).scatter(0, d.indices, d.values)  # the inverse permutation
    rank = torch.argsort(tied, dim=1, stable=True, descending=True)
    grid = torch.arange(15.0, dtype=F64).view(3, 5) / 5 - 1  # shared boundaries, [3, 5]
    x = h.detach()
    return [
        s.values, s.indices, inverse, s.values.gather(1, inverse) - tied, back, d.indices,
        h.gather(1, rank), rank, h[torch.argsort(m.perm)], h[torch.empty_like(m.perm).scatter_(
            0, m.perm, torch.arange(3))],  # the buffer's inverse permutation
        torch.kthvalue(h, 2, -1, keepdim=True).values * h, torch.kthvalue(h, 3, 0).values,
        torch.kthvalue(m.mem, 2, 0).values, torch.msort(h), torch.msort(m.mem) @ h[:, :3].T,
        torch.topk(h, 2, 0).values,
        h * torch.searchsorted(m.bnd, x, side="right"),
        h * torch.searchsorted(m.bnd.flip(0), x, side="left", sorter=torch.arange(4, -1, -1)),
        h * torch.searchsorted(m.bnd, x, out_int32=True, right=True),
        h[:, :3] * torch.searchsorted(grid, m.mem, side="right"),  # shared N-D, own values
        h[:, :2] * torch.searchsorted(grid, x[:, :2].contiguous(), side="left"),
        torch.searchsorted(h.sort(-1).values, m.mem, side="right")[:, :1] * h,
    ]  # fmt: skip


def _triangles(m: Orders, h: Tensor) -> list[Tensor]:
    t, u = h.view(3, 2, 3), h.view(2, 3, 3)
    iu = torch.tril_indices(3, 3, -1)
    return [
        t.tril(1), h.triu(-1), u.triu(2), m.mem.tril(-2) @ h[:, :3].T, u[:, iu[0], iu[1]],
        torch.diag_embed(h, offset=1, dim1=0, dim2=2),
        torch.diag_embed(t, offset=-2, dim1=-1, dim2=1),
        t.diagonal(1, 0, 2), t.diagonal(-1, -1, 0), m.mem.diagonal(1) * h[0, :2],
        torch.diagonal_scatter(t, h[:2, :2] * m.w[:2], offset=1, dim1=0, dim2=2),
        torch.slice_scatter(h, h[:, :3] * 3, dim=1, start=0, end=6, step=2),
        torch.diag(h[:, :3], 1), torch.diagflat(h[0, :3] * m.w[:3], -1),
        h.clone().fill_diagonal_(0.5, wrap=True) * m.w,
    ]  # fmt: skip


def _repeats(m: Orders, h: Tensor) -> list[Tensor]:
    return [
        h.repeat_interleave(torch.tensor([1, 0, 2]), dim=0),
        h.repeat_interleave(torch.tensor([3, 0, 1, 1, 0, 1]), dim=-1),
        h.repeat_interleave(m.perm, dim=0),  # per-member repeats, the same total
        h.repeat_interleave(m.perm, dim=0, output_size=3),
        h[torch.repeat_interleave(m.perm, output_size=3)],
        h.repeat_interleave(2, dim=-1) * m.w.repeat(2),
    ]


def _pads(m: Orders, h: Tensor) -> list[Tensor]:
    t3, t4 = h.view(3, 2, 3), h.view(1, 2, 3, 3)
    return [
        F.pad(t3, (2, 1), mode="reflect"),
        F.pad(h.view(2, 3, 3), (1, 2, 2, 0), mode="reflect"),  # unbatched 2-d
        F.pad(t4, (1, 1, 2, 0, 1, 1), mode="reflect"),  # unbatched 3-d
        F.pad(h.view(2, 9), (3, 1), mode="replicate"),  # unbatched 1-d
        F.pad(h.view(3, 1, 2, 3), (1, 2, 3, 0), mode="replicate"),
        F.pad(t3, (2, 3), mode="circular"),
        F.pad(t4, (-1, 2, 1, -1), mode="circular"),  # a negative pad crops
        F.pad(h.view(1, 1, 2, 3, 3), (1, 2, 0, 1, 1, 1), mode="circular"),
        F.pad(t3, (-1, 2, 1, -1, 0, 1), value=0.5),
        F.pad(m.mem[None], (2, 2, 1, 1), mode="reflect") * m.w[0],  # a per-member buffer
    ]


def _patches(m: Orders, h: Tensor) -> list[Tensor]:
    frames = h.reshape(18).unfold(0, 4, 2) * m.w[:4]  # an STFT-free framing, learned window
    scale = m.mem[:, :1, None, None].repeat(3, 1, 1, 1)  # [9, 1, 1, 1], per member
    return [
        F.unfold(h.view(2, 3, 3), (2, 2), padding=1, stride=2),  # unbatched
        F.fold(h.view(1, 9, 2), (4, 3), (3, 3), padding=1, stride=(2, 3)),
        F.fold(h.reshape(18)[:16].view(4, 4), (3, 3), (2, 2)),  # unbatched
        F.pixel_shuffle(h.view(1, 9, 2, 1) * scale, 3),
        F.pixel_shuffle(h.reshape(18)[:12].view(4, 3, 1), 2),  # unbatched
        F.pixel_unshuffle(h.view(3, 1, 3, 2)[:, :, :2], 2),
        F.channel_shuffle(h.view(1, 6, 3), 3), F.channel_shuffle(h.view(1, 6, 1, 3, 1), 2),
        h.unfold(0, 2, 1), h.unfold(-1, 3, 2), h.view(3, 3, 2).unfold(1, 2, 1).unfold(0, 2, 2),
        m.mem.unfold(1, 2, 1).sum(-1) @ h[:, :2].T, frames, frames.sum(-1).cumsum(0),
    ]  # fmt: skip


def _buffers(m: Orders, h: Tensor) -> list[Tensor]:
    with torch.no_grad():
        m.ring.copy_(m.ring.roll(1, 0))  # a ring buffer of the last batch means
        m.ring[0] = h.mean(0)
        m.count.cumsum_(0)
        m.mem.tril_(-1)
        m.mem.add_(h[:, :3].T.flip(0))
        m.bnd.copy_(torch.sort(m.bnd + h[0, :5], stable=True).values)
        m.perm.copy_(m.perm.flip(0).roll(1))
    return [
        h * m.ring.sum(0),
        h[:, :3] @ m.mem,
        h[:, :5] * m.bnd,
        h * m.count.sum(),
        m.perm[:, None] * h,
        m.w.flip(0).cumsum(0),
    ]


def _select_scatter(m: Orders, h: Tensor) -> list[Tensor]:
    return [
        torch.select_scatter(h, m.w * h[0], 0, -1),  # a functional row write
        torch.select_scatter(h, h[:, 0] * m.w[:3], 1, 2),
        torch.select_scatter(torch.ones(3, 6, dtype=F64), m.w * h[1], 0, 1),  # shared self
        torch.select_scatter(m.mem, h[0, :3], -1, 0),  # into a per-member buffer's copy
    ]


def _own_vmap_inner(m: Orders, h: Tensor) -> list[Tensor]:
    # the user's own vmap over rows, the write batched at its level: torch's rule, alone too
    def row(r: Tensor) -> Tensor:
        return torch.select_scatter(r.view(2, 3), m.w[:3] * r[0], 0, 1)

    return [torch.func.vmap(row)(h)]


def _own_vmap_outer(m: Orders, h: Tensor) -> list[Tensor]:
    # the user's own vmap over a shared scale; the write is batched at the ensemble's level only
    return [torch.func.vmap(lambda z: torch.select_scatter(h, m.w, 0, 0) * z)(torch.arange(2.0))]


def _pad_sequence(m: Orders, h: Tensor) -> list[Tensor]:
    return [pad_sequence([h[0], h[1, :3] * m.w[:3], h[2, :1]], batch_first=True)]


def _repeats_differ(m: Orders, h: Tensor) -> list[Tensor]:
    out = h.repeat_interleave(m.reps, dim=0) * m.w  # alone: m.reps.sum() rows
    return [out.sum(0), out.mean(0)]


FAMILIES = {
    "flips": _flips,
    "cumulative": _cumulative,
    "sorts": _sorts,
    "triangles": _triangles,
    "repeats": _repeats,
    "pads": _pads,
    "patches": _patches,
    "buffers": _buffers,
}
MORE = {"select_scatter": _select_scatter, "own_vmap_inner": _own_vmap_inner,
        "own_vmap_outer": _own_vmap_outer, "pad_sequence": _pad_sequence,
        "repeats_differ": _repeats_differ}  # fmt: skip


class Orders(nn.Module):
    def __init__(self, family: str = "flips") -> None:
        super().__init__()
        self.family = family
        self.fc = nn.Linear(4, 6, dtype=F64)
        self.w = nn.Parameter(torch.randn(6, dtype=F64))
        self.register_buffer("perm", torch.randperm(3))  # also per-member repeats, total 3
        self.register_buffer("shift", torch.randint(0, 6, ()))
        self.register_buffer("bnd", torch.randn(5, dtype=F64).sort().values)
        self.register_buffer("mem", torch.randn(3, 3, dtype=F64))
        self.register_buffer("ring", torch.zeros(3, 6, dtype=F64))
        self.register_buffer("count", torch.arange(4, dtype=F64))
        self.register_buffer("reps", torch.randint(0, 4, (3,)))  # totals differ by member

    def forward(self, x: Tensor) -> Tensor:
        return _flat({**FAMILIES, **MORE}[self.family](self, self.fc(x)))


def _data(count: int, size: int, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    """`count` batches `(x [B, 4], y [size])` of float64 normals."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(B, 4, generator=g, dtype=F64), torch.randn(size, generator=g, dtype=F64))
        for _ in range(count)
    ]


def _check(factory: Any, backend: dict, n: int = N) -> None:
    x, _ = _data(1, 1, seed=7)[0]
    ens = vmapens.Ensemble(factory, n=n, seeds=range(n), **backend)
    alone = seeded_members(factory, n)
    assert (
        len({int(m.shift) for m in alone}) > 1 or len({tuple(m.perm.tolist()) for m in alone}) > 1
    )
    forward_and_steps_as_alone(ens, alone, x, lambda want: _data(2, want.shape[1]), **TOL)
    assert all(p.grad is not None for p in ens.parameters())  # each trained alone


@pytest.mark.parametrize("backend", BACKENDS, ids=IDS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_order_and_position_ops_match_each_member_alone(family: str, backend: dict) -> None:
    _check(lambda: Orders(family), backend)


# -- select_scatter: torch's batching rule scales the gradient of `src` -------------------------


def _alone_steps(alone: list[nn.Module], batches: list[tuple[Tensor, Tensor]]) -> Tensor:
    losses = []
    for m in alone:
        opt = torch.optim.Adam(m.parameters(), lr=0.05)
        for x, y in batches:
            opt.zero_grad()
            loss = F.mse_loss(m(x), y)
            loss.backward()
            opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


@pytest.mark.parametrize("backend", BACKENDS, ids=IDS)
def test_select_scatter_forward_under_no_grad_matches_each_member_alone(backend: dict) -> None:
    x, _ = _data(1, 1, seed=7)[0]
    ens = vmapens.Ensemble(lambda: Orders("select_scatter"), n=N, seeds=range(N), **backend)
    alone = seeded_members(lambda: Orders("select_scatter"), N)
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in alone]), **TOL)
    assert_members_equal(ens, alone, **TOL)


def test_select_scatter_trains_as_alone_with_backend_loop() -> None:
    _check(lambda: Orders("select_scatter"), {"backend": "loop"})


@pytest.mark.parametrize("backend", BACKENDS[:2], ids=IDS[:2])
def test_select_scatter_in_a_hand_written_loop_trains_as_alone(backend: dict) -> None:
    # README's loop: ens(x), a per-member loss, sum().backward(), a stacked optimizer's step
    batches = _data(2, 63)
    ens = vmapens.Ensemble(lambda: Orders("select_scatter"), n=N, seeds=range(N), **backend)
    alone = seeded_members(lambda: Orders("select_scatter"), N)
    opt = vmapens.StackedAdam(ens, lr=0.05)
    for x, y in batches:
        opt.zero_grad()
        loss = vmapens.per_member(F.mse_loss)(ens(x), y)
        loss.sum().backward()
        opt.step()
    torch.testing.assert_close(loss.detach(), _alone_steps(alone, batches), **TOL)
    assert_members_equal(ens, alone, grads=True, **TOL)
    assert all(p.grad is not None for p in ens.parameters())  # each trained alone


@pytest.mark.parametrize("backend", BACKENDS[:2], ids=IDS[:2])
def test_select_scatter_trains_as_alone_with_make_step(backend: dict) -> None:
    _check(lambda: Orders("select_scatter"), backend)


@pytest.mark.parametrize(
    "family",
    ["own_vmap_inner", "own_vmap_outer"],
)
def test_select_scatter_inside_a_users_own_vmap_gets_the_gradients_of_alone(family: str) -> None:
    x, _ = _data(1, 1, seed=7)[0]
    ens = vmapens.Ensemble(lambda: Orders(family), n=N, seeds=range(N))
    alone = seeded_members(lambda: Orders(family), N)
    ens(x).pow(2).sum().backward()
    for m in alone:
        m(x).pow(2).sum().backward()
    assert_members_equal(ens, alone, grads=True, **TOL)
    assert all(p.grad is not None for p in ens.parameters())  # each trained alone


# -- what vmap cannot batch: refused, naming backend='loop', which runs as alone ---------------


@pytest.mark.parametrize(
    ("family", "says"),
    [("pad_sequence", "pad_sequence"), ("repeats_differ", "equal size")],
    ids=["pad_sequence_of_member_rows", "repeats_with_per_member_totals"],
)
def test_what_vmap_cannot_batch_is_refused_and_backend_loop_runs_as_alone(
    family: str, says: str
) -> None:
    ens = vmapens.Ensemble(lambda: Orders(family), n=N, seeds=range(N))
    alone = seeded_members(lambda: Orders(family), N)
    assert len({int(m.reps.sum()) for m in alone}) == N  # every member its own row count
    x, y = _data(1, 12)[0]
    refused_naming_the_loop(ens, x, y, says, says_in_step=True)
    assert all(p.grad is None for p in ens.parameters())
    _check(lambda: Orders(family), {"backend": "loop"})
