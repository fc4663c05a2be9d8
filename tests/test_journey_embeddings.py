"""User journey: embedding layers inside a member's forward, each member against itself alone.

The script a researcher writes from README.md and docs/semantics.md: `nn.Embedding` with
`padding_idx` (the row gets no gradient, but weight decay still moves it), `max_norm` with
`norm_type` 1 and 2 (the looked-up rows of the stored weight renormalised in place during the
forward), `scale_grad_by_freq`, indices in int64 or int32, shared by the members or one batch
per member (`in_dims=0`); `nn.EmbeddingBag` (sum with per-member `per_sample_weights` and
offsets, mean over a 2-D input with `padding_idx`, max with `include_last_offset`);
`F.embedding` on a weight computed in the forward; an embedding tied to the output `Linear`
(read after and before its `max_norm` renormalisation); `nn.Embedding.from_pretrained`, frozen
or not per member (documented: members must agree; refused); an index out of range (alone:
`IndexError`). Each under vmap, `chunk_size=2` and `backend="loop"`.

The truth: N plain modules built after `torch.manual_seed(i)`, run alone (outputs in train and
eval mode, the weight after the forward, gradients) and trained alone with `torch.optim.Adam`
/ `torch.optim.SGD` (weight decay, momentum) for 2 steps on the same batches. float64.
Covered elsewhere and not repeated: `sparse=True` (tests/test_journey_text.py,
tests/test_journey_recsys.py, tests/test_container_fixes.py), nn.Embedding's padding row with
per-member indices in fit and a tied LM (tests/test_journey_text.py), shared-offset bags
(tests/test_journey_text.py, tests/test_journey_recsys.py).

Bugs fixed (strict xfails before; one fix for both, a batching rule for `aten::embedding` inside
the ensemble's calls, patch embeddings-1, `vmapens/_embedding_rules.py`):
* `F.embedding(idx, weight, padding_idx=p)` written in the forward (not `nn.Embedding`) with
  per-member indices: vmap's rule keeps only member 0's padding row (per chunk) out of the
  gradient, silently.
* A per-member index out of range (`V`, or `-1`): alone `IndexError`; under vmap it reads the
  next (previous) member's row and trains that member's row on this member's loss, silently.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import vmapens

pytestmark = [
    pytest.mark.usefixtures("float64_default"),
    # nn.EmbeddingBag has no batching rule: torch's per-member loop (docs/semantics.md)
    pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),
]

N, V, D = 3, 7, 3
TOL: dict[str, Any] = dict(rtol=1e-12, atol=1e-13)
BACKENDS = {"vmap": {}, "chunks": {"chunk_size": 2}, "loop": {"backend": "loop"}}
OPTS: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "adam": (vmapens.StackedAdam, torch.optim.Adam, dict(lr=0.1, weight_decay=0.1)),
    "sgd": (vmapens.StackedSGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.1)),
}


def plain_members(factory: Callable[[], nn.Module]) -> list[nn.Module]:
    """Member i: the factory after torch.manual_seed(i)."""
    out = []
    for i in range(N):
        torch.manual_seed(i)
        out.append(factory())
    return out


def own(args: tuple, i: int, in_dims: tuple) -> tuple:
    """Member i's positional inputs (slice i of the per-member ones)."""
    return tuple(a if d is None else a.select(d, i) for a, d in zip(args, in_dims, strict=True))


def loss_of(out: Tensor) -> Tensor:
    """A scalar of every output element: each row's gradient is its own, and not 0 at a zero
    (padding) row."""
    return ((out + 0.5) ** 3).sum()


def assert_alone(
    factory: Callable[[], nn.Module], args: tuple, in_dims: tuple, backend: dict
) -> None:
    """Forward (train, eval), the state after it, gradients, and 2 steps of Adam and of SGD:
    member i of the ensemble as plain module i alone."""
    plain = plain_members(factory)
    dims = None if all(d is None for d in in_dims) else in_dims
    alone = copy.deepcopy(plain)
    ens = vmapens.Ensemble.from_modules(copy.deepcopy(plain), **backend)
    for mode in ("train", "eval", "train"):
        ens.train(mode != "eval")
        outs = ens(*args, in_dims=dims)
        for i, m in enumerate(alone):
            m.train(mode != "eval")
            want = m(*own(args, i, in_dims))
            torch.testing.assert_close(outs[i], want, **TOL, msg=f"{mode} output of member {i}")
    sum(loss_of(outs[i]) for i in range(N)).backward()
    stacked = dict(ens.named_parameters())
    for i, m in enumerate(alone):
        loss_of(m(*own(args, i, in_dims))).backward()
        for name, p in m.named_parameters():
            got = stacked[name].grad
            assert (p.grad is None) == (got is None), name
            if got is not None:
                torch.testing.assert_close(got[i], p.grad, **TOL, msg=f"grad {name} {i}")
        for name, t in m.state_dict().items():  # max_norm's in-place edits of the weight
            torch.testing.assert_close(ens[i].state_dict()[name], t, **TOL, msg=name)
    for stacked_cls, torch_cls, kw in OPTS.values():
        alone = copy.deepcopy(plain)
        ens = vmapens.Ensemble.from_modules(copy.deepcopy(plain), **backend)
        stacked_opt = stacked_cls(ens, **kw)
        if len(set(in_dims)) == 1:  # make_step takes in_dims None or 0, for every input
            step = vmapens.make_step(ens, lambda o, _: loss_of(o), stacked_opt, in_dims=in_dims[0])
            for _ in range(2):
                step(args, torch.zeros(()) if in_dims[0] is None else torch.zeros(N))
        else:  # the hand loop of docs/index.md
            for _ in range(2):
                stacked_opt.zero_grad()
                outs = ens(*args, in_dims=in_dims)
                sum(loss_of(outs[i]) for i in range(N)).backward()
                stacked_opt.step()
        for i, m in enumerate(alone):
            opt = torch_cls(m.parameters(), **kw)
            for _ in range(2):
                opt.zero_grad()
                loss_of(m(*own(args, i, in_dims))).backward()
                opt.step()
            for name, t in m.state_dict().items():
                torch.testing.assert_close(
                    ens[i].state_dict()[name], t, rtol=1e-10, atol=1e-12,
                    msg=f"{torch_cls.__name__} {name} of member {i}",
                )  # fmt: skip


def tokens(*lead: int, dtype: torch.dtype = torch.int64) -> Tensor:
    """[*lead, 2, 4] ids with every id in use and repeats (scale_grad_by_freq), 0 first."""
    g = torch.Generator().manual_seed(5)
    t = torch.randint(0, V, (*lead, 2, 4), generator=g)
    t[..., 0, 0], t[..., 1, 1], t[..., 1, 2] = 0, 2, 2
    return t.to(dtype)


# ---- nn.Embedding ------------------------------------------------------------------------------


def refilled(emb: nn.Embedding) -> nn.Embedding:
    """The weight drawn again, padding row included (not 0): weight decay moves it alone."""
    nn.init.normal_(emb.weight)
    return emb


EMBEDDINGS: dict[str, Callable[[], nn.Module]] = {
    "padding": lambda: refilled(nn.Embedding(V, D, padding_idx=0)),
    "max-norm-l2": lambda: nn.Embedding(V, D, max_norm=0.5),
    "max-norm-l1-padding": lambda: nn.Embedding(V, D, max_norm=0.5, norm_type=1.0, padding_idx=0),
    "freq-padding-max-norm-l3": lambda: nn.Embedding(
        V, D, padding_idx=2, max_norm=0.7, norm_type=3.0, scale_grad_by_freq=True
    ),
}


# (kind, per-member ids, backend): per-member ids under every backend, shared ids once each
EMBEDDING_CASES = [
    *[(kind, "per-member", b) for kind in sorted(EMBEDDINGS) for b in sorted(BACKENDS)],
    *[
        (kind, "shared", b)
        for kind, b in zip(sorted(EMBEDDINGS), ["vmap", "chunks", "loop", "vmap"])
    ],
]


@pytest.mark.parametrize(("kind", "per_member", "backend"), EMBEDDING_CASES)
def test_embedding_options_match_each_member_alone(kind: str, per_member: str, backend: str):
    """padding_idx: the row as alone (no gradient, moved by weight decay only); max_norm: the
    looked-up rows renormalised in the stored weight as alone, before and after steps."""
    x, dim = (tokens(N), 0) if per_member == "per-member" else (tokens(), None)
    assert_alone(EMBEDDINGS[kind], (x,), (dim,), BACKENDS[backend])


@pytest.mark.parametrize("backend", ["vmap", "loop"])
def test_int32_indices_train_as_int64_alone(backend: str) -> None:
    """int32 per-member ids through padding_idx + max_norm: member i as alone on its ids."""
    factory = EMBEDDINGS["max-norm-l1-padding"]
    assert_alone(factory, (tokens(N, dtype=torch.int32),), (0,), BACKENDS[backend])


# ---- nn.EmbeddingBag ---------------------------------------------------------------------------


class Bag(nn.Module):
    def __init__(self, mode: str, **kw: Any) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(V, D, mode=mode, **kw)

    def forward(self, x: Tensor, offsets: Tensor | None = None, w: Tensor | None = None):
        return self.bag(x, offsets, per_sample_weights=w)


FLAT = torch.tensor([[0, 1, 2, 2, 3, 0, 6, 1], [5, 5, 0, 1, 4, 2, 0, 3], [6, 0, 0, 2, 1, 1, 3, 4]])
OFFSETS = torch.tensor([0, 3, 3, 5])  # an empty bag too
BAGS: dict[str, tuple[Callable[[], nn.Module], tuple, tuple]] = {
    # per-member flat ids and per_sample_weights, shared offsets
    "sum-weights-per-member": (
        lambda: Bag("sum", max_norm=0.6, padding_idx=0),
        (FLAT, OFFSETS, torch.linspace(0.1, 2.4, 24, dtype=torch.float64).view(N, 8)),
        (0, None, 0),
    ),
    "mean-2d-padding": (lambda: Bag("mean", padding_idx=0), (FLAT.view(N, 2, 4),), (0,)),
    "max-last-offset": (
        lambda: Bag("max", include_last_offset=True, max_norm=0.5, norm_type=1.0),
        (FLAT[0], torch.tensor([0, 3, 3, 5, 8])),
        (None, None),
    ),
    "sum-2d-freq-weights": (
        lambda: Bag("sum", scale_grad_by_freq=True),
        (FLAT[1].view(2, 4), None, torch.linspace(-1, 1, 8, dtype=torch.float64).view(2, 4)),
        (None, None, None),
    ),
}


@pytest.mark.parametrize(
    ("kind", "backend"),
    [*[(kind, "vmap") for kind in sorted(BAGS)], ("sum-weights-per-member", "chunks"),
     ("mean-2d-padding", "loop")],
)  # fmt: skip
def test_embedding_bag_modes_match_each_member_alone(kind: str, backend: str) -> None:
    factory, args, in_dims = BAGS[kind]
    assert_alone(factory, args, in_dims, BACKENDS[backend])


# ---- F.embedding on a computed weight, tied output layers ---------------------------------------


class Computed(nn.Module):
    """F.embedding on a low-rank table computed in the forward (a plain Parameter with
    `computed=False`)."""

    def __init__(self, computed: bool = True, **kw: Any) -> None:
        super().__init__()
        self.a, self.b = nn.Parameter(torch.randn(V, 2)), nn.Parameter(torch.randn(2, D))
        self.computed, self.kw = computed, kw

    def forward(self, idx: Tensor) -> Tensor:
        return F.embedding(idx, self.a @ self.b if self.computed else self.a, **self.kw)


class Tied(nn.Module):
    """Embedding tied to the output Linear. `late`: the Linear reads the weight before the
    embedding renormalises it in place (legal alone: its input needs no gradient, so the
    Linear saves no weight for the backward)."""

    def __init__(self, late: bool = False, **kw: Any) -> None:
        super().__init__()
        self.emb, self.out = nn.Embedding(V, D, **kw), nn.Linear(D, V)
        self.out.weight, self.late = self.emb.weight, late

    def forward(self, idx: Tensor) -> Tensor:
        if self.late:
            return self.emb(idx) * self.out(torch.ones(D)).sum()
        return self.out(torch.tanh(self.emb(idx)))


FUNCTIONAL: dict[str, Callable[[], nn.Module]] = {
    "computed-max-norm": lambda: Computed(max_norm=0.5),
    "computed-freq": lambda: Computed(scale_grad_by_freq=True),
    "tied-max-norm-padding": lambda: Tied(max_norm=0.5, padding_idx=0, norm_type=1.0),
    "tied-late-max-norm": lambda: Tied(late=True, max_norm=0.5),
}


@pytest.mark.parametrize(
    ("kind", "backend"),
    [*[(kind, "vmap") for kind in sorted(FUNCTIONAL)], ("computed-freq", "chunks"),
     ("tied-max-norm-padding", "chunks"), ("tied-late-max-norm", "loop")],
)  # fmt: skip
def test_functional_and_tied_embeddings_match_each_member_alone(kind: str, backend: str):
    assert_alone(FUNCTIONAL[kind], (tokens(N),), (0,), BACKENDS[backend])


@pytest.mark.parametrize("backend", ["vmap", "chunks"])
def test_functional_padding_idx_on_shared_ids_matches_alone(backend: str) -> None:
    assert_alone(lambda: Computed(padding_idx=0), (tokens(),), (None,), BACKENDS[backend])


@pytest.mark.parametrize("backend", ["vmap", "chunks"])
@pytest.mark.parametrize("computed", [True, False], ids=["computed", "parameter"])
def test_functional_padding_idx_on_per_member_ids_matches_alone(computed: bool, backend: str):
    """Alone, F.embedding's padding row gets no gradient; in the ensemble member 1's (and 2's
    under plain vmap) does: SGD ends 0.2-1.4 off after 2 steps."""
    factory = lambda: Computed(computed, padding_idx=0)  # noqa: E731
    assert_alone(factory, (tokens(N),), (0,), BACKENDS[backend])


def test_functional_padding_idx_on_per_member_ids_with_the_loop_backend_matches_alone():
    assert_alone(lambda: Computed(padding_idx=0), (tokens(N),), (0,), BACKENDS["loop"])


# ---- pretrained tables ---------------------------------------------------------------------------


class Pretrained(nn.Module):
    """A frozen pretrained table (renormalised in place by max_norm even though frozen, as
    alone) under a trained head."""

    def __init__(self, freeze: bool = True) -> None:
        super().__init__()
        table = torch.randn(V, D)
        self.emb = nn.Embedding.from_pretrained(table, freeze=freeze, padding_idx=1, max_norm=1.0)
        self.head = nn.Linear(D, 2)

    def forward(self, idx: Tensor) -> Tensor:
        return self.head(self.emb(idx))


@pytest.mark.parametrize(("freeze", "backend"), [(True, "vmap"), (True, "loop"), (False, "chunks")])
def test_pretrained_tables_frozen_or_trained_match_alone(freeze: bool, backend: str) -> None:
    assert_alone(lambda: Pretrained(freeze), (tokens(N),), (0,), BACKENDS[backend])


def test_members_frozen_differently_are_refused_naming_the_weight() -> None:
    """Member i frozen when i is even: refused at build (members must agree on
    requires_grad), not trained as if all were frozen or all trained."""
    built = []
    for i in range(N):
        torch.manual_seed(i)
        built.append(nn.Embedding.from_pretrained(torch.randn(V, D), freeze=i % 2 == 0))
    with pytest.raises(
        ValueError, match=r"^Ensemble.from_modules: member 1 differs .*`weight`.*requires_grad"
    ):
        vmapens.Ensemble.from_modules(built)


# ---- ids out of range ----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("bad", [V, -1])
def test_a_shared_id_out_of_range_raises_as_alone_and_changes_nothing(bad: int, backend: str):
    plain = plain_members(lambda: nn.Embedding(V, D))
    ids = torch.tensor([[1, bad]])
    with pytest.raises(IndexError):
        plain[0](ids)
    ens = vmapens.Ensemble.from_modules(copy.deepcopy(plain), **BACKENDS[backend])
    with pytest.raises(IndexError):
        ens(ids)
    step = vmapens.make_step(ens, lambda o, _: loss_of(o), vmapens.StackedSGD(ens, lr=0.1))
    with pytest.raises(IndexError):
        step(ids, torch.zeros(()))
    for i, m in enumerate(plain):
        torch.testing.assert_close(ens[i].weight, m.weight, rtol=0, atol=0)


def per_member_bad_ids(member: int, bad: int) -> Tensor:
    ids = torch.tensor([[[1, 2]], [[3, 4]], [[5, 6]]])
    ids[member, 0, 1] = bad
    return ids


@pytest.mark.parametrize("backend", ["loop", "last-member"])
def test_a_per_member_id_out_of_range_raises_where_no_other_member_is_read(backend: str):
    """`backend="loop"`, or the last member's id V under vmap (nothing after its rows)."""
    plain = plain_members(lambda: nn.Embedding(V, D))
    ids = per_member_bad_ids(N - 1 if backend == "last-member" else 0, V)
    ens = vmapens.Ensemble.from_modules(copy.deepcopy(plain), **BACKENDS.get(backend, {}))
    with pytest.raises(IndexError):
        ens(ids, in_dims=0)
    step = vmapens.make_step(
        ens, lambda o, _: loss_of(o), vmapens.StackedSGD(ens, lr=0.1), in_dims=0
    )
    with pytest.raises(IndexError):
        step(ids, torch.zeros(N))
    for i, m in enumerate(plain):
        torch.testing.assert_close(ens[i].weight, m.weight, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["vmap", "chunks"])
@pytest.mark.parametrize(("member", "bad"), [(0, V), (1, -1)], ids=["V", "minus-1"])
def test_a_per_member_id_out_of_range_raises_as_alone(member: int, bad: int, backend: str):
    """Alone member 0 raises IndexError on id V (member 1 on id -1). Under vmap member 0's id V
    reads member 1's row 0 (member 1's -1 reads member 0's last row), and a step moves that
    other member's row by this member's gradient."""
    plain = plain_members(lambda: nn.Embedding(V, D))
    ids = per_member_bad_ids(member, bad)
    with pytest.raises(IndexError):
        plain[member](ids[member])
    ens = vmapens.Ensemble.from_modules(copy.deepcopy(plain), **BACKENDS[backend])
    step = vmapens.make_step(
        ens, lambda o, _: loss_of(o), vmapens.StackedSGD(ens, lr=0.1), in_dims=0
    )
    try:
        with pytest.raises(IndexError):
            step(ids, torch.zeros(N))
    finally:
        for i, m in enumerate(plain):
            torch.testing.assert_close(ens[i].weight, m.weight, rtol=0, atol=0)
    with pytest.raises(IndexError):
        ens(ids, in_dims=0)
