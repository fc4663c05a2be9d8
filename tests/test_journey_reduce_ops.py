"""A user journey: less common reductions, orderings and searches inside a member's forward.

The script a researcher writes from README.md and docs/semantics.md ("What vmap cannot
batch"): members whose forward uses median/nanmedian/mode/kthvalue with a dim and exact ties,
quantile/nanquantile in every interpolation mode (also a quantile per member),
cummax/cummin, logcumsumexp of -inf, cumprod through zeros (its backward), nansum/nanmean,
var/std with a correction, aminmax, topk with ties and ``sorted=False``,
``sort(stable=True)``, argsort, searchsorted/bucketize of per-member boundaries sorted in the
forward, take_along_dim, gather with an expanded index, histc, bincount of per-member weights,
diff, trapezoid, cdist/pdist (p = 1, 2, inf) at zero distance, logsumexp of a -inf row,
softmax over a fully masked row (NaN, as alone), renorm, ``F.gumbel_softmax(hard=True)``
under ``randomness="same"`` and ``F.embedding(max_norm=...)`` (it renormalises the member's
weight in place). Each is run as ``ens(x)`` in train and eval mode and trained 2 steps with
``make_step`` + ``StackedAdam``, under vmap, ``chunk_size=2`` and ``backend="loop"``.

The truth: each member alone (``ens.unstack()`` before anything ran), the same forward, and
``torch.optim.Adam`` on the same batches, float64.

Found: ``torch.max`` / ``torch.min`` / ``torch.median`` / ``torch.nanmedian`` of a whole tensor
(no ``dim``) with tied values. Alone, autograd splits the gradient evenly among the tied
elements; under ``torch.func.vmap`` followed by ``loss.backward()`` (the ensemble's eager
forward and step) one element gets all of it, because vmap's batching rule reduces with the
``dim`` overload, whose backward goes to one index. ``vmap(grad(f))`` is right. The first
step's self-check refuses it when member 0 has the tie; a hand-written loop over ``ens(x)``,
or ties in another member only (per-member data), trained wrong, silently, until patch
reduceops-1 (``vmapens/_tie_reductions.py``: the ensemble's calls split the ties as alone).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import vmapens

pytestmark = [
    pytest.mark.usefixtures("float64_default"),
    # histc, bincount and friends run through torch's member loop (docs/semantics.md).
    pytest.mark.filterwarnings("ignore:There is a performance drop"),
]

N, B, IN, D = 3, 5, 3, 6
TOL: dict[str, Any] = dict(rtol=1e-9, atol=1e-10)  # float64; batched kernels sum in other orders
BACKENDS = [{}, {"chunk_size": 2}, {"backend": "loop"}]
BACKEND_IDS = ["vmap", "chunks", "loop"]
INF = float("inf")


def ties(h: Tensor) -> Tensor:
    """``h`` on a grid of 0.5: exact ties, values still the member's own."""
    return torch.round(h * 2) / 2


def _idx(t: Tensor, like: Tensor) -> Tensor:
    return t.to(like.dtype).flatten()


# Each family: one forward that runs several ops on the member's own activations `h` [B, D]
# (and its own parameters), returning everything flat. Indices are returned too, and the
# gradient reaches `h` through `gather` at them, so a tie broken otherwise shows.
def _order(s: Any, h: Tensor) -> Tensor:
    t = ties(h)
    md = torch.median(t, dim=1)
    nan = torch.where(h > 0.3, float("nan"), h)
    nmd = torch.nanmedian(nan, dim=0)
    mode = torch.mode(t, dim=1)
    kth = torch.kthvalue(t, 2, dim=0, keepdim=True)
    top = torch.topk(t, 3, dim=1, sorted=False)
    top_small = torch.topk(t, 2, dim=0, largest=False)
    srt = torch.sort(t, dim=1, stable=True, descending=True)
    arg = torch.argsort(h, dim=0)
    cmax = torch.cummax(t + 0 * h, dim=1)
    cmin = torch.cummin(torch.cat([h, h * s.scale], 1), dim=1)
    amm = torch.aminmax(t + 0 * h, dim=0)
    parts = [
        md.values, _idx(md.indices, h), h.gather(1, md.indices[:, None]).flatten(),
        nmd.values, _idx(nmd.indices, h),
        mode.values, _idx(mode.indices, h), h.gather(1, mode.indices[:, None]).flatten(),
        kth.values.flatten(), h.gather(0, kth.indices).flatten(),
        top.values.flatten(), _idx(top.indices, h), h.gather(1, top.indices).flatten(),
        _idx(top_small.indices, h), h.gather(0, top_small.indices).flatten(),
        srt.values.flatten(), _idx(srt.indices, h), h.gather(1, srt.indices).flatten(),
        _idx(arg, h), h.gather(0, arg).flatten(),
        cmax.values.flatten(), _idx(cmax.indices, h), cmin.values.flatten(),
        amm.min, amm.max,
    ]  # fmt: skip
    return torch.cat(parts)


def _quantiles(s: Any, h: Tensor) -> Tensor:
    nan = torch.where(h > 0.3, float("nan"), h)
    q = torch.sigmoid(s.q)  # a quantile per member
    parts = [torch.quantile(h, torch.tensor([0.1, 0.5, 0.9]), dim=1).flatten()]
    for how in ("linear", "lower", "higher", "midpoint", "nearest"):
        parts.append(torch.quantile(h, 0.35, dim=0, interpolation=how))
        parts.append(torch.quantile(h, q, dim=1, interpolation=how).flatten())
        parts.append(torch.nanquantile(nan, 0.4, dim=1, interpolation=how))
    parts.append(torch.quantile(ties(h) + 0 * h, 0.5, dim=1, interpolation="nearest"))
    parts.append(torch.nanquantile(nan, torch.tensor([0.2, 0.7])))
    return torch.cat(parts)


def _cumulative(s: Any, h: Tensor) -> Tensor:
    parts = [
        torch.logcumsumexp(h, dim=1).flatten(),
        torch.logcumsumexp(h.masked_fill(s.m, -INF), dim=1).flatten(),  # rows of -inf
        torch.cumprod(h * s.zeros, dim=1).flatten(),  # two zeros in a row: cumprod's backward
        torch.cumprod(torch.where(h.abs() < 0.3, 0.0, h), dim=0).flatten(),
        torch.diff(h, dim=1).flatten(),
        torch.diff(h, n=2, dim=0, prepend=s.w[None], append=h[:1]).flatten(),
        torch.trapezoid(h, dim=1),
        torch.trapezoid(h, x=s.xs.exp().cumsum(0), dim=0),  # per-member sample points
        torch.trapezoid(h, dx=0.3),
        torch.cumulative_trapezoid(h, x=s.xs.cumsum(0), dim=0).flatten(),
    ]
    return torch.cat(parts)


def _nan_and_moments(s: Any, h: Tensor) -> Tensor:
    nan = torch.where(h > 0.3, float("nan"), h)
    parts = [
        torch.nansum(nan, dim=1), torch.nanmean(nan, dim=0), torch.nanmean(nan).reshape(1),
        torch.nanmean(h.masked_fill(s.m, float("nan")), dim=1),  # an all-NaN row: NaN
        torch.var(h, dim=1, correction=0), torch.var(h, dim=0, correction=2),
        torch.var(h, correction=3).reshape(1), torch.std(h, dim=(0, 1), correction=2).reshape(1),
        *torch.var_mean(h, dim=1, correction=1.5), torch.std_mean(h, dim=0, correction=0)[0],
        *torch.aminmax(h, dim=1), torch.stack(torch.aminmax(h)),
    ]  # fmt: skip
    return torch.cat(parts)


def _searches(s: Any, h: Tensor) -> Tensor:
    bounds = torch.sort(s.bounds)[0]  # per member, sorted in the forward
    rows = torch.sort(s.rows, dim=-1)[0]
    x = h.detach()
    counts = torch.bincount((x.abs() * 3).long().clamp(max=4).flatten(), minlength=6)
    parts = [
        torch.searchsorted(bounds, x).flatten(),
        torch.searchsorted(bounds, x, right=True).flatten(),
        torch.searchsorted(bounds, s.shared).flatten(),  # shared values, own boundaries
        torch.searchsorted(rows, x.contiguous()).flatten(),  # a boundary row per batch row
        torch.searchsorted(s.bounds, x, sorter=torch.argsort(s.bounds)).flatten(),
        torch.bucketize(x, bounds).flatten(),
        torch.bucketize(s.shared, bounds, right=True).flatten(),
        torch.histc(x, bins=4, min=-1, max=1),
        torch.histc(x, bins=3),  # range from the data
        counts,
        torch.bincount(torch.tensor([0, 2, 2, 1, 0, 3]), weights=x[0], minlength=5),
    ]
    found = torch.cat([p.to(h.dtype) for p in parts])
    by_rank = torch.argsort(h, dim=1)
    gathered = [
        torch.take_along_dim(h, by_rank, dim=1).flatten(),
        torch.take_along_dim(h, torch.argsort(h.flatten())[:4]),
        torch.take_along_dim(h, torch.tensor([[0, 2, 5]]), dim=1).flatten(),  # broadcast index
        h.gather(1, torch.tensor([[1], [0], [3], [2], [5]]).expand(B, 4)).flatten(),
        h.gather(1, torch.argmax(h, 1, keepdim=True).expand(B, 3)).flatten(),
        s.w.expand(B, D).gather(1, by_rank).flatten(),  # an expanded source
    ]
    return torch.cat([found, *gathered])


def _distances(s: Any, h: Tensor) -> Tensor:
    dup = torch.cat([h, h[:2]])  # two pairs of rows at distance zero
    parts = []
    for p in (1.0, 2.0, INF):
        parts += [torch.cdist(h, s.c, p=p).flatten(), torch.cdist(h, h, p=p).flatten()]
        parts.append(F.pdist(dup, p=p))
    masked = h.masked_fill(s.m, -INF)
    parts += [
        torch.logsumexp(masked, dim=1), torch.logsumexp(masked, dim=0),  # -inf rows: -inf
        torch.softmax(masked, dim=1).flatten(),  # a fully masked row: NaN, as alone
        torch.renorm(h, p=2, dim=0, maxnorm=0.5).flatten(),
        torch.renorm(h, p=INF, dim=1, maxnorm=0.3).flatten(),
        (h @ torch.renorm(s.c, p=1, dim=1, maxnorm=0.7).T).flatten(),
    ]  # fmt: skip
    return torch.cat(parts)


FAMILIES: dict[str, Callable[[Any, Tensor], Tensor]] = {
    "order": _order,
    "quantiles": _quantiles,
    "cumulative": _cumulative,
    "nan_moments": _nan_and_moments,
    "searches": _searches,
    "distances": _distances,
}


class Member(nn.Module):
    def __init__(self, family: str) -> None:
        super().__init__()
        self.family = family
        # No bias: cdist/pdist/diff cancel it, and its gradient would be pure round-off that
        # Adam turns into lr-sized steps (docs/semantics.md, "What differs").
        self.fc = nn.Linear(IN, D, bias=False)
        self.scale = nn.Parameter(torch.ones(()))
        self.q = nn.Parameter(torch.randn(2))
        self.w = nn.Parameter(torch.randn(D))
        self.c = nn.Parameter(torch.randn(4, D))
        self.bounds = nn.Parameter(torch.randn(5))
        self.rows = nn.Parameter(torch.randn(B, 4))
        self.xs = nn.Parameter(torch.randn(B))
        self.register_buffer("zeros", torch.tensor([1.0, 0, 0, 1, 0, 1]))
        self.register_buffer("shared", torch.randn(7))
        rows = [[True] * D, [False, True] * 3, [False] * D, [True] * D, [True] * 5 + [False]]
        self.register_buffer("m", torch.tensor(rows))

    def forward(self, x: Tensor) -> Tensor:
        return FAMILIES[self.family](self, self.fc(x))


def loss_fn(out: Tensor, y: Tensor) -> Tensor:
    # Every output element weighted differently; NaN/inf outputs (a masked softmax row, a
    # -inf logsumexp) are kept out of the loss as a user would.
    out = torch.where(torch.isfinite(out), out, 0.0)
    return (out * torch.linspace(0.5, 1.5, out.numel())).sin().sum() * y.mean()


def _batches(count: int) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(B, IN, generator=g), torch.randn(B, 1, generator=g)) for _ in range(count)]


def _assert_members(ens: vmapens.Ensemble, alone: list[nn.Module]) -> None:
    for i, m in enumerate(alone):
        got = ens[i].state_dict()
        for k, v in m.state_dict().items():
            torch.testing.assert_close(got[k], v, **TOL, msg=f"member {i} {k}")


def _alone_steps(alone: list[nn.Module], batches: list[tuple[Tensor, Tensor]]) -> None:
    opts = [torch.optim.Adam(m.parameters(), lr=0.05) for m in alone]
    for x, y in batches:
        for m, opt in zip(alone, opts):
            opt.zero_grad()
            loss_fn(m(x), y).backward()
            opt.step()


@pytest.mark.parametrize("kw", BACKENDS, ids=BACKEND_IDS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_reductions_in_the_forward_match_each_member_alone(family: str, kw: dict) -> None:
    batches = _batches(2)
    ens = vmapens.Ensemble(lambda: Member(family), n=N, seed=0, **kw)
    alone = ens.unstack()
    for mode in ("train", "eval"):
        ens.train(mode == "train")
        with torch.no_grad():
            got = ens(batches[0][0])
            for i, m in enumerate(alone):
                want = m.train(mode == "train")(batches[0][0])
                torch.testing.assert_close(got[i], want, **TOL, equal_nan=True)
    ens.train()
    [m.train() for m in alone]
    step = vmapens.make_step(ens, loss_fn, vmapens.StackedAdam(ens, lr=0.05))
    for x, y in batches:
        step(x, y)
    _alone_steps(alone, batches)
    _assert_members(ens, alone)


# -- randomness and in-place weight edits in the forward --------------------------------------


class Gumbel(nn.Module):
    """A straight-through Gumbel-softmax choice (hard one-hot forward, soft backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.logits = nn.Linear(IN, D)
        self.value = nn.Linear(D, 1)

    def forward(self, x: Tensor) -> Tensor:
        y = F.gumbel_softmax(self.logits(x), tau=0.7, hard=True)
        return torch.cat([y.flatten(), self.value(y).flatten()])


@pytest.mark.parametrize("kw", [BACKENDS[0], BACKENDS[2]], ids=["vmap", "loop"])
def test_gumbel_softmax_hard_same_randomness_draws_what_each_member_draws_alone(kw: dict) -> None:
    # docs/semantics.md, "Randomness in the forward pass": with "same" each member draws what
    # it draws alone from the same RNG state, with chunk_size and backend="loop" too.
    batches = _batches(2)
    ens = vmapens.Ensemble(Gumbel, n=N, seed=0, randomness="same", **kw)
    alone = ens.unstack()
    state = torch.get_rng_state()
    got = ens(batches[0][0])
    for i, m in enumerate(alone):
        torch.set_rng_state(state)
        torch.testing.assert_close(got[i], m(batches[0][0]), **TOL)
    step = vmapens.make_step(ens, loss_fn, vmapens.StackedAdam(ens, lr=0.05))
    states = []
    for x, y in batches:
        states.append(torch.get_rng_state())
        step(x, y)
    opts = [torch.optim.Adam(m.parameters(), lr=0.05) for m in alone]
    for (x, y), state in zip(batches, states):
        for m, opt in zip(alone, opts):
            torch.set_rng_state(state)
            opt.zero_grad()
            loss_fn(m(x), y).backward()
            opt.step()
    _assert_members(ens, alone)


@pytest.mark.parametrize("kw", BACKENDS, ids=BACKEND_IDS)
def test_gumbel_softmax_different_randomness_gives_members_their_own_noise(kw: dict) -> None:
    # With equal members, "different" still draws other one-hot choices per member.
    ens = vmapens.Ensemble.from_modules([Gumbel()] * N, randomness="different", **kw)
    out = ens(torch.zeros(40, IN))[:, : 40 * D].reshape(N, 40, D)
    assert ((out == 0) | (out == 1)).all() and (out.sum(-1) == 1).all()
    assert not torch.equal(out[0], out[1]) and not torch.equal(out[1], out[2])


class MaxNormLookup(nn.Module):
    """``F.embedding(..., max_norm=1)`` on its own weight, with indices from its own values."""

    def __init__(self) -> None:
        super().__init__()
        self.pick = nn.Linear(IN, 1)
        self.table = nn.Parameter(torch.randn(7, 4) * 2)

    def forward(self, x: Tensor) -> Tensor:
        idx = (torch.sigmoid(self.pick(x)) * 6.99).long().flatten()  # per member
        e = F.embedding(idx, self.table, max_norm=1.0)
        e2 = F.embedding(torch.tensor([0, 6, 6]), self.table, max_norm=1.5, norm_type=1.0)
        return torch.cat([e.flatten(), e2.flatten()]) + self.pick(x).sum()


@pytest.mark.parametrize("kw", BACKENDS, ids=BACKEND_IDS)
def test_functional_embedding_max_norm_renorms_each_members_own_rows(kw: dict) -> None:
    batches = _batches(2)
    ens = vmapens.Ensemble(MaxNormLookup, n=N, seed=0, **kw)
    alone = ens.unstack()
    with torch.no_grad():
        got = ens(batches[0][0])  # renormalises rows of each member's table in place
        for i, m in enumerate(alone):
            torch.testing.assert_close(got[i], m(batches[0][0]), **TOL)
    _assert_members(ens, alone)
    assert not torch.equal(ens[0].table, ens[1].table)
    step = vmapens.make_step(ens, loss_fn, vmapens.StackedAdam(ens, lr=0.05))
    for x, y in batches:
        step(x, y)
    _alone_steps(alone, batches)
    _assert_members(ens, alone)


# -- what vmap cannot batch: refused, nothing changed -----------------------------------------


class Uniques(nn.Module):
    def __init__(self, consecutive: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(IN, D)
        self.consecutive = consecutive

    def forward(self, x: Tensor) -> Tensor:
        t = ties(self.fc(x)).detach()
        u = torch.unique_consecutive(t) if self.consecutive else torch.unique(t)
        return u[:2] + self.fc(x).sum()  # alone: fine, a value per call


@pytest.mark.parametrize("consecutive", [False, True], ids=["unique", "unique_consecutive"])
@pytest.mark.parametrize("chunk", [None, 2], ids=["vmap", "chunks"])
def test_unique_is_refused_under_vmap_and_changes_nothing(consecutive: bool, chunk: Any) -> None:
    ens = vmapens.Ensemble(lambda: Uniques(consecutive), n=N, seed=0, chunk_size=chunk)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    x, y = _batches(1)[0]
    with pytest.raises(RuntimeError, match="cannot be batched.*backend='loop'"):
        ens(x)
    step = vmapens.make_step(ens, loss_fn, vmapens.StackedAdam(ens, lr=0.05))
    with pytest.raises(RuntimeError, match="cannot be batched.*backend='loop'"):
        step(x, y)
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k
    # The way out the error names: members in turns, each as alone.
    looped = vmapens.Ensemble(lambda: Uniques(consecutive), n=N, seed=0, backend="loop")
    alone = looped.unstack()
    batches = _batches(2)
    step = vmapens.make_step(looped, loss_fn, vmapens.StackedAdam(looped, lr=0.05))
    for xb, yb in batches:
        step(xb, yb)
    _alone_steps(alone, batches)
    _assert_members(looped, alone)


class InPlaceCumprod(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(IN, D)
        self.register_buffer("zeros", torch.tensor([1.0, 0, 1, 1, 0, 1]))

    def forward(self, x: Tensor) -> Tensor:
        return (self.fc(x) * self.zeros).cumprod_(1)  # alone: autograd is fine with it


@pytest.mark.xfail(
    strict=True,
    reason="torch's vmap fallback for the in-place `cumprod_` bumps the version of cumprod's "
    "saved output: the backward raises 'modified by an inplace operation' where the member "
    "alone trains (torch's; `torch.cumprod` out of place, or backend='loop', works)",
)
@pytest.mark.parametrize("chunk", [None, 2], ids=["vmap", "chunks"])
def test_in_place_cumprod_trains_as_alone(chunk: Any) -> None:
    batches = _batches(2)
    ens = vmapens.Ensemble(InPlaceCumprod, n=N, seed=0, chunk_size=chunk)
    alone = ens.unstack()
    step = vmapens.make_step(ens, loss_fn, vmapens.StackedAdam(ens, lr=0.05))
    for x, y in batches:
        step(x, y)
    _alone_steps(alone, batches)
    _assert_members(ens, alone)


# -- whole-tensor max / min / median / nanmedian with ties: the gradient's split ----------------


class PoolStats(nn.Module):
    """A set summary: one statistic of all the features, from a zero-initialised layer (as
    ReZero / LoRA-style zero inits start), so every feature ties on the first step."""

    def __init__(self, reduce: str) -> None:
        super().__init__()
        self.reduce = reduce
        self.fc = nn.Linear(IN, 4)
        nn.init.zeros_(self.fc.weight)
        nn.init.zeros_(self.fc.bias)
        self.head = nn.Linear(1, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(getattr(torch, self.reduce)(self.fc(x)).reshape(1, 1))


REDUCES = ["max", "min", "median", "nanmedian"]


def _hand_loop(ens: vmapens.Ensemble, x: Tensor, y: Tensor, steps: int) -> None:
    opt = vmapens.StackedAdam(ens, lr=0.1)
    for _ in range(steps):  # README's loop: per_member loss, summed, backward, step
        loss = vmapens.per_member(nn.MSELoss())(ens(x), y).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _pool_case(reduce: str, kw: dict) -> None:
    x, y = torch.randn(6, IN, generator=torch.Generator().manual_seed(0)), torch.ones(1, 1)
    ens = vmapens.Ensemble(lambda: PoolStats(reduce), n=N, seed=0, **kw)
    alone = ens.unstack()
    _hand_loop(ens, x, y, steps=2)
    opts = [torch.optim.Adam(m.parameters(), lr=0.1) for m in alone]
    for _ in range(2):
        for m, opt in zip(alone, opts):
            opt.zero_grad()
            F.mse_loss(m(x), y).backward()
            opt.step()
    _assert_members(ens, alone)


@pytest.mark.parametrize("kw", BACKENDS[:2], ids=BACKEND_IDS[:2])
@pytest.mark.parametrize("reduce", REDUCES)
def test_hand_loop_whole_tensor_reduction_with_ties_trains_as_alone(reduce: str, kw: dict) -> None:
    _pool_case(reduce, kw)  # 0.23 (max, min) and 0.37 (median) off in fc.weight after 2 steps


@pytest.mark.parametrize("reduce", REDUCES)
def test_hand_loop_whole_tensor_reduction_with_ties_in_turns_is_exact(reduce: str) -> None:
    _pool_case(reduce, {"backend": "loop"})


@pytest.mark.parametrize("reduce", REDUCES)
def test_step_refuses_ties_member_0_has_and_changes_nothing(reduce: str) -> None:
    x, y = torch.randn(6, IN, generator=torch.Generator().manual_seed(0)), torch.ones(1, 1)
    ens = vmapens.Ensemble(lambda: PoolStats(reduce), n=N, seed=0)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=0.1))
    try:
        step(x, y)
    except RuntimeError as err:  # the first step's self-check (member 0 alone vs inside)
        assert "member 0 of PoolStats computes something else" in str(err)
        for k, v in ens.state_dict().items():
            assert torch.equal(v, before[k]), k
    else:  # fixed: then it trains as alone
        alone = [PoolStats(reduce) for _ in range(N)]
        for m, sd in zip(
            alone, vmapens.Ensemble(lambda: PoolStats(reduce), n=N, seed=0).state_dicts()
        ):
            m.load_state_dict(sd)
            opt = torch.optim.Adam(m.parameters(), lr=0.1)
            F.mse_loss(m(x), y).backward()
            opt.step()
        _assert_members(ens, alone)


def _linf(out: Tensor, y: Tensor) -> Tensor:
    return (out - y).abs().max()  # minimax (Chebyshev) regression


def _lmeds(out: Tensor, y: Tensor) -> Tensor:
    return ((out - y) ** 2).median()  # least median of squares


@pytest.mark.parametrize("kw", BACKENDS[:2], ids=BACKEND_IDS[:2])
@pytest.mark.parametrize("loss", [_linf, _lmeds], ids=["linf", "lmeds"])
def test_step_per_member_data_ties_in_member_1_only_train_as_alone(loss: Any, kw: dict) -> None:
    # Bagging: each member its own rows (`in_dims=0`). Integer targets and a zero-initialised
    # head: on the first step member 1's and member 2's residuals tie, member 0's do not, so
    # the self-check (member 0) passes, and members 1 and 2 step wrong: 0.07-0.23 off.
    def member() -> nn.Module:
        m = nn.Linear(IN, 1)
        nn.init.zeros_(m.weight)
        nn.init.zeros_(m.bias)
        return m

    X = torch.randn(N, 6, IN, generator=torch.Generator().manual_seed(0))
    Y = torch.tensor([[1.0, 2, 3, 4, 5, 6], [3, 1, 3, 2, 0, 1], [2, -2, 0, 1, 1, 2]])[..., None]
    ens = vmapens.Ensemble(member, n=N, seed=0, **kw)
    alone = ens.unstack()
    step = vmapens.make_step(ens, loss, vmapens.StackedAdam(ens, lr=0.1), in_dims=0)
    opts = [torch.optim.Adam(m.parameters(), lr=0.1) for m in alone]
    for _ in range(2):
        step(X, Y)
        for i, (m, opt) in enumerate(zip(alone, opts)):
            opt.zero_grad()
            loss(m(X[i]), Y[i]).backward()
            opt.step()
    _assert_members(ens, alone)


def test_torch_func_vmap_then_backward_splits_ties_as_alone() -> None:
    """The torch-only reproduction (documentation of the cause, runs either way)."""
    y = torch.tensor([1.0, 3.0, 3.0, 1.0, 2.0])
    alone = torch.func.grad(torch.max)(y)
    assert alone.tolist() == [0.0, 0.5, 0.5, 0.0, 0.0]
    assert torch.func.vmap(torch.func.grad(torch.max))(y[None])[0].tolist() == alone.tolist()
    Y = y[None].clone().requires_grad_()
    torch.func.vmap(torch.max)(Y).sum().backward()
    assert Y.grad is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        split = Y.grad[0].tolist()
    assert split in ([0.0, 1.0, 0.0, 0.0, 0.0], alone.tolist())  # torch 2.13: the former
