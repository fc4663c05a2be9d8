"""A user journey: writes through views, in-place shape methods and layout queries inside a
member's forward, under vmap, `chunk_size=2` and `backend="loop"`, at 3 and 2 members.

The researcher's forwards write through `narrow`, `select`, `diagonal`, `transpose`, `t()`,
`view(-1)`, `unfold`, `as_strided` (offset taken from the tensor) and `expand` views into
clones of the activations (their gradients reach the parameters); reshape a tensor in place
(`unsqueeze_`, `squeeze_`, `t_`, `transpose_`, `swapdims_`, `resize_` of a detached copy); run
in-place activations (`nn.ReLU(inplace=True)` on a strided view, `clamp_`, `add_`/`mul_` on
views of a tensor computed from a weight); branch on `.stride()`, `.is_contiguous()`,
`.storage_offset()` and `.shape`; and, under `torch.no_grad()`, write per-member buffers the
same ways plus `split`/`chunk`/`unbind` views (refused by autograd alone with grad on), a ring
buffer and a key/value cache advanced by a per-member position buffer, and a running window.
The truth: each member a plain module (built after `torch.manual_seed(k)`, as `seeds=range(n)`
builds it) run alone: `ens(x)` under `torch.no_grad()` in train mode (outputs and buffers), and
two `make_step` steps against `torch.optim.Adam` alone (losses, parameters, buffers, `.grad`).
float64: only the order of sums may differ, hence TOL.

Found: `as_strided` with an absolute `storage_offset` on a member's parameter or buffer
(`w.as_strided((4,), (5,), 0)`, the diagonal of the member's own weight) reads and writes
member 0's rows for every member with `backend="loop"`, silently (the self-check runs member
0, whose rows start at offset 0), and raises torch's vmap error, which points to
`backend="loop"`, for every chunk after the first with `chunk_size` (strict xfails). One vmap
over all members is right. And `ens(x)` whose forward asks for a channels-last layout raised
torch's bare "NYI: querying is_contiguous inside of vmap" (no API name, no way out), where the
step names `backend='loop'`; since session 35 `ens(x)` says it as the step does.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from parity import forward_and_steps_as_alone
from torch import Tensor, nn
from truth import seeded_members

import vmapens

B = 4
F64 = torch.float64
TOL: dict[str, Any] = {"rtol": 1e-10, "atol": 1e-12}  # float64, sums in another order
BACKENDS = [{}, {"chunk_size": 2}, {"backend": "loop"}]
IDS = ["vmap", "chunks", "loop"]
SLOTS, CACHE = 5, 8  # ring buffer rows; key/value cache rows (B written a call)


def _activations(m: Views, h: Tensor) -> list[Tensor]:
    s = m.s
    t1 = h.clone()
    t1.narrow(1, 1, 2).mul_(s[:2])
    t1.select(1, 3).add_(s[0])
    t1.select(0, -1).copy_(s)  # a parameter into a row view
    t2 = h.clone()
    t2.diagonal().copy_(s)
    t2.diagonal(-1).sub_(s[1:] * 0.5)
    t2.transpose(0, 1)[1].mul_(s[2])
    t2.t()[2].add_(s)
    t3 = h.clone()
    t3.view(-1)[::3].mul_(s[3])
    t3.view(2, 8).t()[3].mul_(s[:2])  # a view of a view
    t3.unfold(1, 2, 2)[..., 0].mul_(s[:2])  # windows [4, 2, 2]: every other column
    t4 = h.clone()
    t4.as_strided((2, 2), (t4.stride(0), t4.stride(1)), t4.storage_offset() + 5).mul_(s[:2])
    t4.as_strided((2, 2), (4, 1), 2).add_(s[2])  # a fresh clone: its storage starts at 0
    t4[:2].copy_(s.expand(2, 4) * h[2:])  # a broadcast value into a view
    t4[3:].copy_(s[:1])  # a 1-element value broadcast into a row
    return [t1, t2, t3, t4, h.unfold(0, 3, 1).sum(-1).repeat(2, 1)[:4] * s]


def _shapes(m: Views, h: Tensor) -> list[Tensor]:
    s = m.s
    t1 = h.clone()
    t1.unsqueeze_(1)  # [4, 1, 4]
    t1.mul_(s)
    t1.squeeze_(1)
    t2 = h.clone()
    t2.t_()
    t2[0].mul_(s)
    t3 = h.clone().view(2, 2, 4)
    t3.transpose_(0, 2)  # [4, 2, 2]
    t3[1].add_(s[:2])
    t4 = h.clone()
    t4.swapdims_(0, 1)
    t4[2].mul_(s)
    t5 = h.sum(0).detach().clone()
    t5.resize_(2, 2)  # allowed alone: no autograd history
    t6 = h[:1].clone()
    t6.squeeze_(0)
    return [t1, t2.t(), t3.reshape(4, 4), t4, h * t5.sum() * s, (t6 * s).expand(4, 4)]


def _activate(m: Views, h: Tensor) -> list[Tensor]:
    s = m.s
    t1 = (h * s).view(2, 8)
    nn.ReLU(inplace=True)(t1[:, ::2])  # on a strided view
    t2 = h * s
    F.relu(t2, inplace=True)
    t3 = h * s
    t3.clamp_(-0.4, 0.3)
    w = m.fc.weight * 2  # a tensor computed from a weight, edited through its views
    w.t()[1].add_(s)
    w.diagonal().mul_(0.5)
    w[:, 2:].mul_(s[:2])
    return [t1.view(4, 4), t2, t3, h @ w]


def _branch(m: Views, h: Tensor) -> list[Tensor]:
    s = m.s
    t = h.t()  # alone: strides (1, 4), not contiguous, offset 0
    u = t.contiguous() * s if not t.is_contiguous() else t * 100
    v = h * (t.stride(0) + 10 * t.stride(1) + t.storage_offset()) * s  # 41 alone
    w = h * s if h.shape[0] == B and h.is_contiguous() else h * 100
    x = m.fc.weight.is_contiguous() * m.fc.weight.stride(0) * h  # 4 alone
    return [u, v, w, x + s]


def _buffer(m: Views, h: Tensor) -> list[Tensor]:
    with torch.no_grad():
        mem = m.mem
        mem.narrow(0, 1, 2).mul_(0.5)
        mem.select(1, 3).copy_(h[0])
        mem.diagonal().add_(h[1])
        a, b = mem.split([1, 3])  # multi-output views: written only without grad, alone too
        a.copy_(b[0] * 2)
        c, d = mem.chunk(2, 1)
        d.sub_(c)
        rows = mem.unbind(0)
        rows[2].clamp_(-0.3, 0.3)
        mem.t()[0].mul_(-1)
        mem.transpose(0, 1)[2].add_(h[2])
        mem.view(-1)[::5].fill_(0.25)
        mem.unfold(1, 2, 2)[..., 1].add_(1)
        mem.as_strided((2, 2), (4, 1), mem.storage_offset() + 10).mul_(3)
        mem[1:3].copy_(h.mean(0))  # a broadcast copy
        mem.expand(2, 4, 4)[0][3].copy_(h[3])
        mem.unsqueeze(0).squeeze(0).t()[1].mul_(0.5)
    return [h * m.mem.sum(0) + h @ m.mem]


def _ring(m: Views, h: Tensor) -> list[Tensor]:
    with torch.no_grad():  # one row a call, at the member's own position
        m.ring.index_copy_(0, m.pos.view(1), h.mean(0, keepdim=True))
        m.pos.copy_((m.pos + 1) % SLOTS)
        m.win[:-1] = m.win[1:].clone()  # a running window: shift, then the newest last
        m.win.select(0, -1).copy_(h.amax(0))
    return [h * m.ring.sum(0) + h * m.win.mean(0)]


def _kv(m: Views, h: Tensor) -> list[Tensor]:
    k, v = h * m.s, h.flip(1)
    with torch.no_grad():  # B rows from the member's position, then the position moves on
        at = m.kpos + torch.arange(B)
        m.kc.index_copy_(0, at, k.detach())
        m.vc.index_copy_(0, at, v.detach())
        m.kpos.copy_((m.kpos + 3) % (CACHE - B + 1))
    filled = torch.arange(CACHE) < at[-1] + 1  # rows written so far
    scores = (h @ m.kc.t()).masked_fill(~filled, float("-inf"))
    return [scores.softmax(-1) @ m.vc + k]


FAMILIES = {
    "activations": _activations,
    "shapes": _shapes,
    "activate": _activate,
    "branch": _branch,
    "buffer": _buffer,
    "ring": _ring,
    "kv": _kv,
}


class Views(nn.Module):
    def __init__(self, family: str = "activations") -> None:
        super().__init__()
        self.family = family
        self.fc = nn.Linear(4, 4, dtype=F64)
        self.s = nn.Parameter(torch.randn(4, dtype=F64))
        self.register_buffer("mem", torch.randn(4, 4, dtype=F64))
        self.register_buffer("ring", torch.randn(SLOTS, 4, dtype=F64))
        self.register_buffer("pos", torch.randperm(SLOTS)[1])
        self.register_buffer("win", torch.randn(3, 4, dtype=F64))
        self.register_buffer("kc", torch.zeros(CACHE, 4, dtype=F64))
        self.register_buffer("vc", torch.zeros(CACHE, 4, dtype=F64))
        self.register_buffer("kpos", self.pos.view(1) % (CACHE - B + 1))  # a copy

    def forward(self, x: Tensor) -> Tensor:
        return torch.stack(FAMILIES[self.family](self, self.fc(x)))


def _data(count: int, *shape: int, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    """`count` batches `(x [B, 4], y [*shape])` of float64 normals."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(B, 4, generator=g, dtype=F64), torch.randn(*shape, generator=g, dtype=F64))
        for _ in range(count)
    ]


def _check(factory: Any, backend: dict, n: int) -> None:
    x, _ = _data(1, 1, seed=7)[0]
    ens = vmapens.Ensemble(factory, n=n, seeds=range(n), **backend)
    alone = seeded_members(factory, n)
    forward_and_steps_as_alone(ens, alone, x, lambda want: _data(2, *want.shape[1:]), **TOL)


# chunks of 2 at 3 members: a full chunk, then one of a single member at row 2
RUNS = [(3, {}), (2, {}), (3, {"chunk_size": 2}), (3, {"backend": "loop"})]


@pytest.mark.parametrize(("n", "backend"), RUNS, ids=["vmap-3", "vmap-2", "chunks-3", "loop-3"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_writes_through_views_and_in_place_shapes_match_each_member_alone(
    family: str, backend: dict, n: int
) -> None:
    _check(lambda: Views(family), backend, n)


def test_the_positions_differ_per_member() -> None:
    # the ring and the cache must start at different rows, or a mixed-up member would pass
    alone = seeded_members(Views, 3)
    assert len({int(m.pos) for m in alone}) > 1 and len({int(m.kpos) for m in alone}) > 1


# -- multi-output views with grad on: refused alone, refused inside -----------------------------


class SplitWrite(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4, dtype=F64)

    def forward(self, x: Tensor) -> Tensor:
        t = self.fc(x).clone()
        a, _ = t.split([1, 3], dim=1)
        a.mul_(2)  # autograd refuses it alone: a view of a function that returns several
        return t


@pytest.mark.parametrize("backend", BACKENDS, ids=IDS)
def test_a_write_into_a_split_view_with_grad_on_is_refused_as_alone(backend: dict) -> None:
    x, y = _data(1, B, 4)[0]
    with pytest.raises(RuntimeError, match="returns multiple views"):
        SplitWrite()(x)
    ens = vmapens.Ensemble(SplitWrite, n=3, seeds=range(3), **backend)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedAdam(ens, lr=0.05))
    with pytest.raises(RuntimeError, match="returns multiple views") as err:
        step(x, y)
    assert str(err.value).startswith("step:")
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k


# -- as_strided with an absolute storage offset on a member's own tensors ----------------------


class Strided(nn.Module):
    """The diagonal of the member's own weight read with `as_strided` and an absolute offset
    (0: alone, a parameter's storage starts at it), and a block of a buffer scaled through one
    under `torch.no_grad()`."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4, dtype=F64)
        self.register_buffer("mem", torch.randn(4, 4, dtype=F64))

    def forward(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            self.mem.as_strided((2, 2), (4, 1), 10).mul_(1.5)  # rows 2-3, columns 2-3
        diag = self.fc.weight.as_strided((4,), (5,), 0)
        return self.fc(x) * diag + self.mem[0]


def test_as_strided_with_an_absolute_offset_under_one_vmap_matches_each_member_alone() -> None:
    _check(Strided, {}, 3)  # vmap's rule takes the offset from each member's rows


@pytest.mark.xfail(
    strict=True,
    reason="backend='loop' hands member i its rows at storage offset i * numel: an absolute "
    "as_strided offset reads and writes member 0's rows for every member, silently (the "
    "self-check runs member 0, exact); members 1-2: outputs ~1.1 off, buffers ~1.7, losses "
    "~0.3",
)
def test_as_strided_with_an_absolute_offset_with_backend_loop_matches_each_member_alone() -> None:
    _check(Strided, {"backend": "loop"}, 3)


@pytest.mark.xfail(
    strict=True,
    reason="with chunk_size, a later chunk's rows start past offset 0 and vmap's as_strided "
    "rule raises 'can access memory outside of `tensor`', wrapped with advice to use "
    "backend='loop', which is silently wrong here",
)
def test_as_strided_with_an_absolute_offset_with_chunks_matches_each_member_alone() -> None:
    _check(Strided, {"chunk_size": 2}, 3)


# -- channels-last layout: refused under vmap, as alone with backend="loop" --------------------


class ChannelsLast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1, dtype=F64)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv(x).contiguous(memory_format=torch.channels_last)
        return h.flatten(1)


def _cl_data() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(2, 2, 4, 4, generator=g, dtype=F64), torch.randn(
        2, 32, generator=g, dtype=F64
    )


def test_a_channels_last_layout_in_the_step_is_refused_and_loop_runs_as_alone() -> None:
    x, y = _cl_data()
    ens = vmapens.Ensemble(ChannelsLast, n=3, seeds=range(3))
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedAdam(ens, lr=0.05))
    with pytest.raises(RuntimeError, match="backend='loop'") as err:
        step(x, y)
    assert str(err.value).startswith("step:") and "is_contiguous" in str(err.value)
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k
    loop = vmapens.Ensemble(ChannelsLast, n=3, seeds=range(3), backend="loop")
    alone = seeded_members(ChannelsLast, 3)
    with torch.no_grad():
        torch.testing.assert_close(loop(x), torch.stack([m(x) for m in alone]), **TOL)


def test_a_channels_last_layout_in_ens_x_is_refused_naming_the_way_out() -> None:
    x, _ = _cl_data()
    ens = vmapens.Ensemble(ChannelsLast, n=3, seeds=range(3))
    with pytest.raises(RuntimeError, match="backend='loop'") as err, torch.no_grad():
        ens(x)
    assert str(err.value).startswith("Ensemble:")
