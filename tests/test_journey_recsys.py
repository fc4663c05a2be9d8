"""User journey: an ensemble of 3 small recommenders (50 users, 40 items, dim 4).

The script a researcher writes from README.md and docs/: a user `nn.Embedding` (`max_norm`,
`scale_grad_by_freq`), an item `nn.Embedding` with `padding_idx`, an `nn.EmbeddingBag` over
each user's variable-length item history given as flat indices + `offsets` (mode "mean", or
"sum" with `per_sample_weights`; `padding_idx` entries left out of the bag), a dot-product +
small MLP scorer, `BCEWithLogitsLoss` on a positive and a sampled negative per row. Index batches
are shared by all members, or one per member (`in_dims=0`: bootstrapped interactions, each
member its own offsets). Trained with `make_step` and with `fit` over DataLoaders whose
collate_fn samples the negatives (from torch's global RNG, or a loader's own generator), with
SGD (momentum), Adam and Adagrad (`lr_decay`, `weight_decay`, `initial_accumulator_value`);
then top-k scoring under `torch.no_grad()`, `predict`, `save_members` / `load_members` into the
plain class, `unstack`, and Adagrad's state handed to `torch.optim.Adagrad` to go on alone.
`sparse=True` embeddings (docs/semantics.md: refused while the weight trains, with the way out;
frozen or under no_grad they run): `ens.template.<name>.sparse = False` trains each member as
the plain `sparse=True` module trains alone with SGD / Adagrad on its sparse gradients.

The truth: each member a plain module built from its documented seed (tests/truth.py) and
trained alone with torch.optim on the same batches. float64.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from truth import TOL64, assert_members_equal, factory_members

import vmapens

pytestmark = [
    pytest.mark.usefixtures("float64_default"),
    # torch.func has no batching rule for embedding_bag with padding_idx: a per-member loop
    pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),
]

N, USERS, ITEMS, D, B, PAD = 3, 50, 40, 4, 6, 0
BCE = nn.BCEWithLogitsLoss()
OPTS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, dict(lr=0.2, momentum=0.9, weight_decay=1e-3)),
    "adam": (torch.optim.Adam, dict(lr=0.05)),
    "adagrad": (torch.optim.Adagrad, dict(lr=0.3, lr_decay=0.01, weight_decay=1e-3,
                                          initial_accumulator_value=0.1)),
}  # fmt: skip


class Recommender(nn.Module):
    """score(u, i) = <user(u) + history(u), item(i)> + MLP([user, item, history]); the item
    table's padding row is the "no item" slot."""

    def __init__(self, mode: str = "mean", sparse: bool = False) -> None:
        super().__init__()
        # (torch refuses scale_grad_by_freq with sparse gradients)
        self.user = nn.Embedding(USERS, D, max_norm=1.0, scale_grad_by_freq=not sparse,
                                 sparse=sparse)  # fmt: skip
        self.item = nn.Embedding(ITEMS, D, padding_idx=PAD, max_norm=1.5, sparse=sparse)
        self.history = nn.EmbeddingBag(ITEMS, D, mode=mode, padding_idx=PAD)
        self.mlp = nn.Sequential(nn.Linear(3 * D, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, u: Tensor, items: Tensor | None = None, flat: Tensor | None = None,
                offsets: Tensor | None = None, weights: Tensor | None = None) -> Tensor:  # fmt: skip
        """u [B], items [B, 2] (positive, negative), flat/offsets: B bags -> scores [B, 2];
        users alone: every item's dot-product score [B, ITEMS] (for top-k)."""
        if items is None:
            return self.user(u) @ self.item.weight.T
        user, item = self.user(u), self.item(items)
        hist = self.history(flat, offsets, per_sample_weights=weights)
        dot = ((user + hist).unsqueeze(-2) * item).sum(-1)
        both = torch.cat([user, hist], -1).unsqueeze(-2).expand(-1, 2, -1)
        return dot + self.mlp(torch.cat([both, item], -1)).squeeze(-1)


def bce(scores: Tensor, _: Tensor | None = None) -> Tensor:
    """Positive column labelled 1, negative column 0."""
    return BCE(scores, torch.tensor([1.0, 0.0]).expand_as(scores))


def bags(g: torch.Generator, lead: tuple[int, ...], length: int = 14) -> tuple[Tensor, Tensor]:
    """Flat history indices (every third one PAD) and sorted offsets of B bags (some empty);
    with `lead`, each member its own offsets."""
    flat = torch.randint(1, ITEMS, (*lead, length), generator=g)
    flat[..., ::3] = PAD
    cuts = torch.randint(0, length + 1, (*lead, B - 1), generator=g).sort(-1).values
    return flat, torch.cat([torch.zeros(*lead, 1, dtype=torch.long), cuts], -1)


def batch(g: torch.Generator, per_member: bool, weighted: bool = False) -> tuple:
    lead = (N,) if per_member else ()
    u = torch.randint(0, USERS, (*lead, B), generator=g)
    items = torch.randint(1, ITEMS, (*lead, B, 2), generator=g)
    items[..., -1, 1] = PAD  # the last row has no negative: the padding row, never trained
    flat, offsets = bags(g, lead)
    x: tuple = (u, items, flat, offsets)
    if weighted:
        x += (torch.rand(flat.shape, generator=g),)
    return x, torch.zeros(*lead, B)


def own(x: tuple, y: Tensor, i: int | None) -> tuple[tuple, Tensor]:
    return (x, y) if i is None else (tuple(t[i] for t in x), y[i])


def alone(factory: Callable[[], nn.Module], batches: list, opt: str, per_member: bool,
          opts: list | None = None) -> list[nn.Module]:  # fmt: skip
    """Each member built from its documented seed, trained alone with torch.optim (appended
    to `opts`)."""
    cls, hyper = OPTS[opt]
    models = factory_members([factory] * N, seed=0)
    for i, m in enumerate(models):
        o = cls(m.parameters(), **hyper)
        if opts is not None:
            opts.append(o)
        for x, y in batches:
            x, y = own(x, y, i if per_member else None)
            o.zero_grad()
            bce(m(*x), y).backward()
            o.step()
    return models


@pytest.mark.parametrize(
    ("opt", "mode", "per_member"),
    [("sgd", "mean", False), ("adam", "sum", True), ("adagrad", "mean", True),
     ("adagrad", "sum", False)],
)  # fmt: skip
def test_make_step_two_towers_and_history_bag_match_alone(opt, mode, per_member) -> None:
    """max_norm + scale_grad_by_freq user rows, padding_idx items, a padded bag (mean; sum with
    per-sample weights), per-member offsets under in_dims=0: each member as alone."""
    g = torch.Generator().manual_seed(1)
    batches = [batch(g, per_member, weighted=mode == "sum") for _ in range(3)]
    factory = lambda: Recommender(mode)  # noqa: E731
    ens = vmapens.Ensemble(factory, n=N, seed=0)
    cls, hyper = OPTS[opt]
    step = vmapens.make_step(
        ens, bce, vmapens.optim.stacked(cls)(ens, **hyper), in_dims=0 if per_member else None
    )
    for x, y in batches:
        step(x, y)
    models = alone(factory, batches, opt, per_member)
    assert_members_equal(ens, models)
    for i in range(N):  # the padding row never trains
        assert not ens[i].item.weight[PAD].any()


# ---- fit over DataLoaders that sample the negatives ------------------------------------------

_g = torch.Generator().manual_seed(2)
USER_OF = torch.randint(0, USERS, (20,), generator=_g)  # 20 interactions (user, positive item)
POS_OF = torch.randint(1, ITEMS, (20,), generator=_g)
FLAT, OFFSETS = bags(_g, (), length=3 * USERS)
OFFSETS = (
    torch.cat([OFFSETS, torch.randint(0, 3 * USERS, (USERS - B,), generator=_g)]).sort().values
)


ENDS = torch.cat([OFFSETS[1:], torch.tensor([len(FLAT)])])
FLAT_LEN = B * int((ENDS - OFFSETS).max())


def history_of(u: Tensor) -> tuple[Tensor, Tensor]:
    """The users' bags cut out of the whole history (FLAT, OFFSETS: one bag per user), the
    flat indices padded with PAD to FLAT_LEN (the bag leaves PAD out), so that members'
    batches stack."""
    parts = [FLAT[OFFSETS[k] : ENDS[k]] for k in u.tolist()]
    lengths = torch.tensor([len(p) for p in parts])
    flat = F.pad(torch.cat(parts), (0, FLAT_LEN - int(lengths.sum())), value=PAD)
    return flat, torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])


def collate(g: torch.Generator | None) -> Callable[[list], tuple]:
    """Rows -> ((u, [pos, neg], flat, offsets), dummy targets); the negatives drawn from `g`,
    or from torch's global RNG with None."""

    def make(rows: list) -> tuple:
        u = torch.stack([r[0] for r in rows])
        neg = torch.randint(1, ITEMS, (len(rows),), generator=g)
        items = torch.stack([torch.stack([r[1] for r in rows]), neg], -1)
        return (u, items, *history_of(u)), torch.zeros(len(rows))

    return make


def test_fit_over_a_shuffling_loader_with_global_rng_negatives_matches_the_plain_loop() -> None:
    """docs/fit.md: a shuffling DataLoader gives fit the orders a plain loop over it gets from
    the same RNG state; its collate_fn's negatives are drawn from that RNG too."""

    def loader() -> DataLoader:
        return DataLoader(TensorDataset(USER_OF, POS_OF), batch_size=8, shuffle=True,
                          collate_fn=collate(None))  # fmt: skip

    torch.manual_seed(5)
    ens = vmapens.Ensemble(Recommender, n=N, seed=0)
    torch.manual_seed(5)
    cls, hyper = OPTS["adagrad"]
    vmapens.fit(ens, loader(), bce, epochs=2, optimizer=vmapens.optim.stacked(cls),
                progress=False, **hyper)  # fmt: skip
    torch.manual_seed(5)
    batches = [b for _ in range(2) for b in loader()]  # the batches the plain loop sees
    assert_members_equal(ens, alone(Recommender, batches, "adagrad", False))


def test_fit_per_member_bootstrapped_loaders_match_each_member_alone() -> None:
    """A list of one DataLoader per member (in_dims=0), each over its own bootstrap resample
    with its own generator for order and negatives; drop_last keeps the batches alike."""

    def loaders() -> list[DataLoader]:
        out = []
        for i in range(N):
            g = torch.Generator().manual_seed(100 + i)
            rows = torch.randint(0, 20, (20,), generator=g)
            out.append(DataLoader(TensorDataset(USER_OF[rows], POS_OF[rows]), batch_size=B,
                                  shuffle=True, drop_last=True, generator=g,
                                  collate_fn=collate(g)))  # fmt: skip
        return out

    ens = vmapens.Ensemble(lambda: Recommender("mean"), n=N, seed=0)
    cls, hyper = OPTS["sgd"]
    vmapens.fit(ens, loaders(), bce, epochs=2, in_dims=0, progress=False,
                optimizer=vmapens.optim.stacked(cls), **hyper)  # fmt: skip
    models = factory_members([Recommender] * N, seed=0)
    for m, dl in zip(models, loaders(), strict=True):
        o = cls(m.parameters(), **hyper)
        for _ in range(2):
            for x, y in dl:
                o.zero_grad()
                bce(m(*x), y).backward()
                o.step()
    assert_members_equal(ens, models)


# ---- after training: top-k, predict, files, unstack, the optimizer handed off -----------------


def test_topk_predict_member_files_unstack_and_adagrad_handoff_match_alone(tmp_path: Path):
    g = torch.Generator().manual_seed(3)
    batches = [batch(g, False) for _ in range(3)]
    ens = vmapens.Ensemble(Recommender, n=N, seed=0)
    opt = vmapens.StackedAdagrad(ens, **OPTS["adagrad"][1])
    step = vmapens.make_step(ens, bce, opt)
    for x, y in batches[:2]:
        step(x, y)
    opts: list[torch.optim.Optimizer] = []
    models = alone(Recommender, batches[:2], "adagrad", False, opts)
    assert_members_equal(ens, models)

    users = torch.arange(0, USERS, 7)
    with torch.no_grad():  # top-5 items per user, every member at once
        values, idx = torch.topk(ens(users), 5, dim=-1)
    for i, m in enumerate(models):
        with torch.no_grad():
            v, k = torch.topk(m(users), 5, dim=-1)
        torch.testing.assert_close(values[i], v, **TOL64)
        assert torch.equal(idx[i], k)
    # (max_norm renormalised the looked-up user rows in place, in the ensemble as alone)
    assert_members_equal(ens, models)
    x = batches[2][0]
    pred = vmapens.predict(ens, x, reduce="none")
    with torch.no_grad():
        for i, m in enumerate(models):
            torch.testing.assert_close(pred[i], m(*x), **TOL64)
    torch.testing.assert_close(vmapens.predict(ens, x, reduce="mean"), pred.mean(0), **TOL64)

    paths = vmapens.save_members(ens, tmp_path / "members")
    states = vmapens.load_members(tmp_path / "members")
    for i, (state, path) in enumerate(zip(states, paths, strict=True)):
        for saved in (torch.load(path), state):
            plain = Recommender()
            plain.load_state_dict(saved)
            assert_members_equal(ens[i : i + 1], [plain])
    unstacked = ens.unstack()
    assert all(type(m) is Recommender and m.item.padding_idx == PAD for m in unstacked)
    assert_members_equal(ens, unstacked)

    # member 1 leaves the ensemble with its Adagrad sums and goes on alone for the last batch
    member = unstacked[1]
    handed = torch.optim.Adagrad(member.parameters())
    handed.load_state_dict(opt.member_state_dict(1, module=member))
    x, y = batches[2]
    handed.zero_grad()
    bce(member(*x), y).backward()
    handed.step()
    opts[1].zero_grad()  # the truth: member 1 alone, its own Adagrad from the first step
    bce(models[1](*x), y).backward()
    opts[1].step()
    for k, v in models[1].state_dict().items():
        torch.testing.assert_close(member.state_dict()[k], v, **TOL64, msg=k)


# ---- sparse=True embeddings -------------------------------------------------------------------


@pytest.mark.parametrize("opt", ["sgd", "adagrad"])
@pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")  # torch's sparse Adagrad
def test_sparse_towers_are_refused_and_dense_twins_train_as_sparse_alone(opt: str) -> None:
    """docs/semantics.md: a trained sparse=True layer is refused before anything runs, naming
    sparse=False and `ens.template.<name>.sparse = False`; with that switch each member ends
    where the plain sparse=True module ends alone with torch.optim.SGD / Adagrad on its sparse
    gradients (both take them; Adagrad without weight decay, which torch refuses for them)."""
    g = torch.Generator().manual_seed(4)
    batches = [batch(g, False) for _ in range(3)]
    factory = lambda: Recommender(sparse=True)  # noqa: E731
    ens = vmapens.Ensemble(factory, n=N, seed=0)
    before = copy.deepcopy(ens.state_dict())
    cls = OPTS[opt][0]
    hyper = dict(lr=0.2, momentum=0.9) if opt == "sgd" else dict(lr=0.3, lr_decay=0.01)
    way_out = r"`user` \(Embedding\) is built with sparse=True.*sparse=False.*template\.user"
    with pytest.raises(ValueError, match="^Ensemble: " + way_out):
        ens(*batches[0][0])
    with pytest.raises(ValueError, match="^make_step: " + way_out):
        vmapens.make_step(ens, bce, vmapens.optim.stacked(cls)(ens, **hyper))
    with pytest.raises(ValueError, match=way_out):
        vmapens.fit(ens, batches, bce, epochs=1, optimizer=vmapens.optim.stacked(cls),
                    progress=False, **hyper)  # fmt: skip
    for k, v in ens.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, msg=k)
    with torch.no_grad():  # scoring runs: no gradient, nothing sparse
        top = torch.topk(ens(torch.arange(5)), 3, dim=-1).indices
    ens.template.user.sparse = ens.template.item.sparse = False
    step = vmapens.make_step(ens, bce, vmapens.optim.stacked(cls)(ens, **hyper))
    for x, y in batches:
        step(x, y)
    models = factory_members([factory] * N, seed=0)
    for i, m in enumerate(models):
        with torch.no_grad():
            assert torch.equal(top[i], torch.topk(m(torch.arange(5)), 3, dim=-1).indices)
        o = cls(m.parameters(), **hyper)
        for x, y in batches:
            o.zero_grad()
            bce(m(*x), y).backward()
            assert m.user.weight.grad.is_sparse and m.item.weight.grad.is_sparse
            o.step()
    assert_members_equal(ens, models)


def test_a_frozen_sparse_pretrained_item_table_trains_the_rest_as_alone() -> None:
    """A pretrained item table, `from_pretrained(..., freeze=True, sparse=True)`: frozen, it
    gets no gradient, so the ensemble takes it (docs: "freeze its weight")."""
    table = torch.randn(ITEMS, D, generator=torch.Generator().manual_seed(6))

    def factory() -> nn.Module:
        m = Recommender()
        m.item = nn.Embedding.from_pretrained(table, freeze=True, padding_idx=PAD, sparse=True)
        return m

    g = torch.Generator().manual_seed(7)
    batches = [batch(g, True) for _ in range(2)]
    ens = vmapens.Ensemble(factory, n=N, seed=0)
    cls, hyper = OPTS["adam"]
    step = vmapens.make_step(ens, bce, vmapens.optim.stacked(cls)(ens, **hyper), in_dims=0)
    for x, y in batches:
        step(x, y)
    assert_members_equal(ens, alone(factory, batches, "adam", True))
    assert all(m.item.sparse and not m.item.weight.requires_grad for m in ens.unstack())


# ---- bugs -------------------------------------------------------------------------------------


class FunctionalSparse(nn.Module):
    """Matrix factorisation with the tables as parameters and F.embedding(..., sparse=True)."""

    def __init__(self) -> None:
        super().__init__()
        self.users = nn.Parameter(torch.randn(USERS, D))
        self.items = nn.Parameter(torch.randn(ITEMS, D))

    def forward(self, u: Tensor, items: Tensor, *_: Tensor) -> Tensor:
        user = F.embedding(u, self.users, sparse=True)
        return (user.unsqueeze(-2) * F.embedding(items, self.items, sparse=True)).sum(-1)


@pytest.mark.parametrize("backend", ["vmap", "loop"])
def test_a_functional_sparse_lookup_is_refused_naming_sparse_false(backend: str) -> None:
    """Alone it trains (sparse gradients, torch.optim.SGD / Adagrad); stacked it cannot."""
    ens = vmapens.Ensemble(FunctionalSparse, n=N, seed=0, backend=backend)
    before = copy.deepcopy(ens.state_dict())
    x, y = batch(torch.Generator().manual_seed(8), False)
    alone_member = factory_members([FunctionalSparse], seed=0)[0]
    bce(alone_member(*x), y).backward()
    assert alone_member.users.grad is not None and alone_member.users.grad.is_sparse
    step = vmapens.make_step(ens, bce, vmapens.StackedAdagrad(ens, lr=0.1))
    with pytest.raises(RuntimeError, match=r"^step: .*sparse=True.*sparse=False") as err:
        step(x, y)
    assert "SparseCsrCPU" not in str(err.value)  # not torch's list of dispatch keys
    for k, v in ens.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, msg=k)
