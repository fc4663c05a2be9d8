"""User journey: an ensemble of 3 knowledge-graph embedding models (12 entities, 3 relations).

The script a researcher writes from README.md and docs/: entity and relation `nn.Embedding`s
scored as TransE (`-||h + r - t||_p`), DistMult (`sum(h * r * t)`) and RotatE (the entity as
a complex vector through `torch.view_as_complex`, the relation a rotation
`torch.polar(1, phase)`); negatives made by corrupting tails with `torch.randint`, in the
training loop (shared by all members, or one set per member with `in_dims=0`) and inside the
member's forward (docs/semantics.md, "Randomness in the forward pass"); the margin ranking
loss and RotatE's self-adversarial loss (softmax of the negatives' scores, detached); TransE's
entity renormalisation after each step written the ways users write it; filtered ranking
(MRR, Hits@k) of every tail with `predict`; per-member learning rates, `fit`, member files;
`sparse=True` refused.

The truth: each member a plain module built from its documented seed (tests/truth.py) and
trained alone with torch.optim on the same batches and negatives. float64.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from truth import TOL64, assert_members_equal, factory_members

import vmapens

pytestmark = pytest.mark.usefixtures("float64_default")

N, E, R, D, B, K = 3, 12, 3, 4, 5, 3  # members, entities, relations, dim, batch, negatives
GAMMA, MARGIN = 2.0, 1.0
_g = torch.Generator().manual_seed(0)
TRIPLES = torch.stack(  # the known graph: (head, relation, tail), 24 distinct triples
    [torch.randint(0, E, (40,), generator=_g), torch.randint(0, R, (40,), generator=_g),
     torch.randint(0, E, (40,), generator=_g)], -1).unique(dim=0)[:24]  # fmt: skip


class KGE(nn.Module):
    """score(h, r, t), broadcasting over leading dims; with `negatives` > 0 the forward also
    corrupts each tail `negatives` times with `torch.randint` and scores those too."""

    def __init__(
        self, kind: str = "transe", p: int = 1, max_norm: float | None = None, negatives: int = 0
    ) -> None:
        super().__init__()
        self.kind, self.p, self.negatives = kind, p, negatives
        self.ent = nn.Embedding(E, D, max_norm=max_norm)
        self.rel = nn.Embedding(R, D // 2 if kind == "rotate" else D)  # RotatE: phases

    def score(self, h: Tensor, r: Tensor, t: Tensor) -> Tensor:
        eh, er, et = self.ent(h), self.rel(r), self.ent(t)
        if self.kind == "transe":
            return -torch.linalg.vector_norm(eh + er - et, ord=self.p, dim=-1)
        if self.kind == "distmult":
            return (eh * er * et).sum(-1)
        ch = torch.view_as_complex(eh.reshape(*eh.shape[:-1], D // 2, 2))
        ct = torch.view_as_complex(et.reshape(*et.shape[:-1], D // 2, 2))
        rot = torch.polar(torch.ones_like(er), er)
        return GAMMA - (ch * rot - ct).abs().sum(-1)

    def forward(self, h: Tensor, r: Tensor, t: Tensor) -> Tensor:
        """[B] triples and [B, k] corrupted tails -> scores [B, 1 + k] (positive first)."""
        if self.negatives:
            t = torch.cat([t[..., None], torch.randint(0, E, (*t.shape, self.negatives))], -1)
        return self.score(h[..., None], r[..., None], t)


def margin(scores: Tensor, _: Tensor | None = None) -> Tensor:
    pos, neg = scores[..., :1].expand_as(scores[..., 1:]), scores[..., 1:]
    return F.margin_ranking_loss(pos, neg, torch.ones_like(neg), margin=MARGIN)


def self_adversarial(scores: Tensor, _: Tensor | None = None, alpha: float = 1.0) -> Tensor:
    """RotatE's loss: the negatives weighted by the softmax of their scores, detached."""
    pos, neg = scores[..., 0], scores[..., 1:]
    w = torch.softmax(alpha * neg, -1).detach()
    return -(F.logsigmoid(pos).mean() + (w * F.logsigmoid(-neg)).sum(-1).mean())


def batch(g: torch.Generator, lead: tuple[int, ...] = ()) -> tuple[tuple[Tensor, ...], Tensor]:
    """B known triples with their tail and K corrupted tails: (h, r, tails [B, 1 + K])."""
    rows = TRIPLES[torch.randint(0, len(TRIPLES), (*lead, B), generator=g)]
    neg = torch.randint(0, E, (*lead, B, K), generator=g)
    return (rows[..., 0], rows[..., 1], torch.cat([rows[..., 2:], neg], -1)), torch.zeros(*lead, B)


class Scored(nn.Module):
    """The training loop's negatives: `tails` [B, 1 + K] scored against (h, r)."""

    def __init__(self, *args, **kw) -> None:  # noqa: ANN002, ANN003
        super().__init__()
        self.kge = KGE(*args, **kw)

    def forward(self, h: Tensor, r: Tensor, tails: Tensor) -> Tensor:
        return self.kge.score(h[..., None], r[..., None], tails)


def renorm_(m: nn.Module) -> None:
    """TransE's recipe alone: entity rows back onto the unit sphere after each step."""
    m.kge.ent.weight.data = F.normalize(m.kge.ent.weight.data, p=2, dim=1)


def alone(factory, batches, loss, opt_cls, hypers, per_member=False, after=None) -> list:
    """Each member from its documented seed, trained alone with torch.optim (its own hypers)."""
    models = factory_members([factory] * N, seed=0)
    for i, m in enumerate(models):
        o = opt_cls(m.parameters(), **hypers[i])
        for x, y in batches:
            if per_member:
                x, y = tuple(t[i] for t in x), y[i]
            o.zero_grad()
            loss(m(*x), y).backward()
            o.step()
            if after is not None:
                after(m)
    return models


LRS = [0.05, 0.1, 0.2]


@pytest.mark.parametrize(
    ("kind", "loss", "opt", "per_member"),
    [("transe", margin, "sgd", False), ("distmult", margin, "adam", True),
     ("rotate", self_adversarial, "adam", False), ("rotate", margin, "adagrad", True)],
)  # fmt: skip
def test_make_step_with_loop_negatives_and_per_member_lr_matches_alone(kind, loss, opt, per_member):
    """Negatives drawn in the loop, shared or one set per member (`in_dims=0`), one lr per
    member: TransE (L1), DistMult, RotatE (complex rotation) each member as alone."""
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adagrad": torch.optim.Adagrad}[opt]
    extra = dict(momentum=0.9) if opt == "sgd" else {}
    g = torch.Generator().manual_seed(1)
    batches = [batch(g, (N,) if per_member else ()) for _ in range(3)]
    factory = lambda: Scored(kind)  # noqa: E731
    ens = vmapens.Ensemble(factory, n=N, seed=0)
    stacked = vmapens.optim.stacked(cls)(ens, lr=torch.tensor(LRS), **extra)
    step = vmapens.make_step(ens, loss, stacked, in_dims=0 if per_member else None)
    for x, y in batches:
        step(x, y)
    hypers = [dict(lr=lr, **extra) for lr in LRS]
    assert_members_equal(ens, alone(factory, batches, loss, cls, hypers, per_member))


# ---- negatives drawn inside the member's forward ---------------------------------------------


@pytest.mark.parametrize("backend", ["vmap", "loop"])
def test_forward_negatives_with_randomness_same_are_each_members_own_draws(backend: str) -> None:
    """docs/semantics.md: with randomness="same" each member draws what it draws alone from
    the same RNG state, and the global RNG goes on as after one member's draw."""
    g = torch.Generator().manual_seed(2)
    pos = [TRIPLES[torch.randint(0, len(TRIPLES), (B,), generator=g)] for _ in range(3)]
    batches = [(tuple(p.unbind(-1)), torch.zeros(B)) for p in pos]
    factory = lambda: KGE("transe", p=2, negatives=K)  # noqa: E731
    torch.manual_seed(9)
    ens = vmapens.Ensemble(factory, n=N, seed=0, randomness="same", backend=backend)
    step = vmapens.make_step(ens, margin, vmapens.StackedAdam(ens, lr=torch.tensor(LRS)))
    for x, y in batches:
        step(x, y)
    after = torch.randint(0, 1000, (4,))
    models = factory_members([factory] * N, seed=0)
    opts = [torch.optim.Adam(m.parameters(), lr=lr) for m, lr in zip(models, LRS, strict=True)]
    torch.manual_seed(9)
    for x, y in batches:  # each member from the same RNG state
        state = torch.get_rng_state()
        for m, o in zip(models, opts, strict=True):
            torch.set_rng_state(state)
            o.zero_grad()
            margin(m(*x), y).backward()
            o.step()
    assert torch.equal(after, torch.randint(0, 1000, (4,)))
    assert_members_equal(ens, models)


def test_forward_negatives_with_randomness_different_differ_per_member() -> None:
    """The default: every member its own corrupted tails (in distribution as alone); members
    built alike score the same positives and other negatives."""
    ens = vmapens.Ensemble(lambda: KGE("distmult", negatives=8), n=N, seeds=[0] * N)
    h, r, t = TRIPLES[:B].unbind(-1)
    with torch.no_grad():
        scores = ens(h, r, t)
    assert scores.shape == (N, B, 9)
    torch.testing.assert_close(scores[1:, :, 0], scores[:1, :, 0].expand(N - 1, B))
    assert not torch.equal(scores[0, :, 1:], scores[1, :, 1:])


# ---- TransE's entity renormalisation after each step ------------------------------------------

ENT = "kge.ent.weight"


def data_last_dim(ens: vmapens.Ensemble) -> None:
    w = ens.get_parameter(ENT)  # [n, E, D]: the entity rows' dim is now -1 (or 2)
    w.data = F.normalize(w.data, p=2, dim=-1)


def div_no_grad(ens: vmapens.Ensemble) -> None:
    w = ens.get_parameter(ENT)
    with torch.no_grad():
        w.div_(w.norm(dim=-1, keepdim=True))


def each_member(ens: vmapens.Ensemble) -> None:
    ens.apply(lambda m: renorm_(m) if isinstance(m, Scored) else None)


class Renorm(vmapens.Callback):
    def on_step_end(self, ctx) -> None:  # noqa: ANN001
        data_last_dim(ctx.ensemble)


def _transe(max_norm: float | None = None) -> Scored:
    return Scored("transe", p=2, max_norm=max_norm)


@pytest.mark.parametrize("renorm", [data_last_dim, div_no_grad, each_member, "fit", "max_norm"])
def test_transe_entity_renormalisation_after_each_step_matches_alone(renorm) -> None:
    """`.data = F.normalize(..., dim=-1)` and an in-place `div_` on the stacked `[n, E, D]`
    weight, `ens.apply` of the member's own recipe, a `fit` callback, or `max_norm=1` (the
    forward renormalises the rows it looks up): each member as alone with the recipe, one lr
    per member, per-member negatives (shared ones with `fit`)."""
    g = torch.Generator().manual_seed(3)
    per_member = renorm != "fit"  # (fit takes stacked tensors or one loader per member)
    batches = [batch(g, (N,) if per_member else ()) for _ in range(3)]
    max_norm = 1.0 if renorm == "max_norm" else None
    factory = lambda: _transe(max_norm)  # noqa: E731
    ens = vmapens.Ensemble(factory, n=N, seed=0)
    if renorm == "fit":
        vmapens.fit(ens, batches, margin, epochs=1, optimizer=vmapens.StackedSGD,
                    lr=LRS, momentum=0.5, callbacks=[Renorm()], progress=False)  # fmt: skip
    else:
        step = vmapens.make_step(
            ens, margin, vmapens.StackedSGD(ens, lr=torch.tensor(LRS), momentum=0.5), in_dims=0
        )
        for x, y in batches:
            step(x, y)
            if callable(renorm):
                renorm(ens)
    hypers = [dict(lr=lr, momentum=0.5) for lr in LRS]
    after = None if max_norm else renorm_
    models = alone(factory, batches, margin, torch.optim.SGD, hypers, per_member, after)
    assert_members_equal(ens, models)
    norms = ens.get_parameter(ENT).detach().norm(dim=-1)
    if max_norm is None:
        torch.testing.assert_close(norms, torch.ones_like(norms))


def test_transe_renormalisation_with_the_members_dim_1_normalises_entity_columns() -> None:
    """The recipe's `F.normalize(w.data, p=2, dim=1)` written on the stacked weight: dim 1 is
    now the entity dim, so every member's columns get unit norm, not its rows, without an
    error. Documented (docs/semantics.md, "Storage": code that reduces over a parameter's dims
    sees dim 0 as the members; "Nothing can tell such code from a correct one"): pinned here."""
    g = torch.Generator().manual_seed(3)
    batches = [batch(g) for _ in range(2)]
    ens = vmapens.Ensemble(_transe, n=N, seed=0)
    step = vmapens.make_step(ens, margin, vmapens.StackedSGD(ens, lr=torch.tensor(LRS)))
    for x, y in batches:
        step(x, y)
        w = ens.get_parameter(ENT)
        w.data = F.normalize(w.data, p=2, dim=1)
    hypers = [dict(lr=lr) for lr in LRS]
    models = alone(_transe, batches, margin, torch.optim.SGD, hypers, after=renorm_)
    w = ens.get_parameter(ENT).detach()
    torch.testing.assert_close(w.norm(dim=1), torch.ones(N, D))  # columns, not rows
    for i, m in enumerate(models):
        assert (w[i] - m.kge.ent.weight).abs().max() > 0.1


def test_transe_renormalisation_written_on_the_template_is_refused() -> None:
    """The recipe run on `ens.template` (`m.kge.ent.weight.data = F.normalize(...)`): the
    template is on meta and holds no values, so no member is renormalised. docs/semantics.md
    says a write that reaches a template tensor, through `.data` too, is refused at the next
    call; an in-place write is, this assignment of new `.data` trains on silently (members
    end up to 2.2 from alone after 3 steps)."""
    g = torch.Generator().manual_seed(3)
    x, y = batch(g)
    ens = vmapens.Ensemble(_transe, n=N, seed=0)
    step = vmapens.make_step(ens, margin, vmapens.StackedSGD(ens, lr=0.1))
    step(x, y)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    renorm_(ens.template)
    with pytest.raises(ValueError, match=r"ens\.template\.kge\.ent\.weight.*ens\.apply"):
        step(x, y)
    for k, v in ens.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, msg=k)


# ---- filtered ranking, member files, sparse=True ----------------------------------------------


def filtered_ranks(scores: Tensor, h: Tensor, r: Tensor, t: Tensor) -> Tensor:
    """Rank of each true tail among all entities, the other known tails of (h, r) masked."""
    known = (TRIPLES[:, None, 0] == h) & (TRIPLES[:, None, 1] == r)  # [triples, B]
    mask = torch.zeros_like(scores, dtype=torch.bool)
    for j in range(len(h)):
        mask[..., j, TRIPLES[known[:, j], 2]] = True
        mask[..., j, t[j]] = False
    order = scores.masked_fill(mask, -torch.inf).argsort(dim=-1, descending=True, stable=True)
    return (order == t[:, None]).nonzero()[..., -1].reshape(scores.shape[:-1]) + 1


def test_filtered_mrr_and_hits_of_predict_over_all_entities_and_member_files(tmp_path: Path):
    """RotatE trained with fit (one lr per member), then every entity scored as a tail with
    `predict(reduce="none")`: per-member filtered MRR / Hits@3 as alone; the member files load
    into the plain class; an entity table with sparse=True is refused, naming the way out."""
    g = torch.Generator().manual_seed(4)
    batches = [batch(g) for _ in range(3)]
    factory = lambda: Scored("rotate")  # noqa: E731
    ens = vmapens.Ensemble(factory, n=N, seed=0)
    vmapens.fit(ens, batches, self_adversarial, epochs=1, optimizer=vmapens.StackedAdam,
                lr=LRS, progress=False)  # fmt: skip
    models = alone(factory, batches, self_adversarial, torch.optim.Adam, [dict(lr=x) for x in LRS])
    assert_members_equal(ens, models)

    h, r, t = TRIPLES[:8].unbind(-1)
    every = torch.arange(E).expand(len(h), E)
    scores = vmapens.predict(ens, (h, r, every), reduce="none")
    ranks = filtered_ranks(scores, h, r, t)
    for i, m in enumerate(models):
        with torch.no_grad():
            own = m(h, r, every)
        torch.testing.assert_close(scores[i], own, **TOL64)
        assert torch.equal(ranks[i], filtered_ranks(own, h, r, t))
    mrr, hits3 = (1 / ranks).mean(-1), (ranks <= 3).double().mean(-1)
    assert mrr.shape == hits3.shape == (N,) and bool((ranks >= 1).all())

    vmapens.save_members(ens, tmp_path / "members")
    for i, state in enumerate(vmapens.load_members(tmp_path / "members")):
        plain = factory()
        plain.load_state_dict(state)
        torch.testing.assert_close(plain(h, r, every), scores[i], rtol=0, atol=0)

    sparse = vmapens.Ensemble(lambda: KGE(), n=N, seed=0)
    sparse.template.ent.sparse = True
    with pytest.raises(ValueError, match=r"`ent` \(Embedding\) is built with sparse=True.*"
                       r"sparse=False.*template\.ent"):  # fmt: skip
        sparse(*TRIPLES[:B].unbind(-1))
