"""User journey: an ensemble of 5 tiny text classifiers and language models.

The script a researcher writes from README.md and docs/: `nn.Embedding` with `padding_idx`,
`max_norm` (which renormalises the weight in place during the forward) and
`scale_grad_by_freq`; `nn.EmbeddingBag` (mean over offsets, an empty bag, sum with
`per_sample_weights`); an LSTM/GRU over `pack_padded_sequence(..., enforce_sorted=False)` and
`pad_packed_sequence` (documented refused under vmap, exact with `backend="loop"`); a tiny causal
transformer (`nn.TransformerEncoder` with a causal mask, or `F.scaled_dot_product_attention(
is_causal=True)`) whose output layer is tied to its input embedding, trained with
`nn.CrossEntropyLoss(ignore_index=PAD, label_smoothing=...)` over (batch * seq) tokens;
`nn.Embedding(sparse=True)` / `torch.optim.SparseAdam` (documented refused). Token batches are
shared by all members, or one per member (`in_dims=0`). The truth: each member a plain module,
built from its documented seed (tests/truth.py) and trained alone with `torch.optim.Adam` on the
same batches (fit's batches from docs/fit.md's documented order). float64.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from truth import batch_plan, factory_members

import vmapens
from vmapens.callbacks import Callback, Context, EarlyStopping

pytestmark = pytest.mark.usefixtures("float64_default")

N, V, PAD, T, CLASSES = 5, 13, 0, 6, 3
LRS = [0.01, 0.02, 0.05, 0.03, 0.1]
TOL: dict[str, Any] = dict(rtol=1e-9, atol=1e-10)


class Classifier(nn.Module):
    """Embedding (padding row, max_norm, scale_grad_by_freq) -> mean over positions (padding
    included: its row reaches the loss, and only `padding_idx` keeps its gradient 0) -> Linear."""

    def __init__(self, max_norm: float | None = 0.8, freq: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 4, padding_idx=PAD, max_norm=max_norm, scale_grad_by_freq=freq)
        self.head = nn.Linear(4, CLASSES)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.emb(tokens).mean(-2))


class Bag(nn.Module):
    """EmbeddingBag over flat tokens and offsets (per-sample weights with mode="sum")."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(V, 4, mode=mode, max_norm=1.0)
        self.head = nn.Linear(4, CLASSES)

    def forward(self, flat: Tensor, offsets: Tensor, weights: Tensor | None = None) -> Tensor:
        return self.head(self.bag(flat, offsets, per_sample_weights=weights))


class Packed(nn.Module):
    """Embedding -> LSTM/GRU over a PackedSequence of the valid steps -> mean -> Linear."""

    def __init__(self, kind: str = "lstm") -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 4, padding_idx=PAD)
        self.rnn = (nn.LSTM if kind == "lstm" else nn.GRU)(4, 5, batch_first=True)
        self.head = nn.Linear(5, CLASSES)

    def forward(self, tokens: Tensor, lengths: Tensor) -> Tensor:
        packed = pack_padded_sequence(
            self.emb(tokens), lengths, batch_first=True, enforce_sorted=False
        )
        out, _ = self.rnn(packed)
        out, lens = pad_packed_sequence(out, batch_first=True, total_length=tokens.shape[-1])
        return self.head(out.sum(1) / lens.unsqueeze(1).to(out.dtype))


class TinyLM(nn.Module):
    """Causal transformer LM, output layer tied to the input embedding (`out.weight = emb.weight`)."""

    def __init__(self, body: str = "encoder", max_norm: float | None = None) -> None:
        super().__init__()
        self.body_kind = body
        self.emb = nn.Embedding(V, 8, padding_idx=PAD, max_norm=max_norm, scale_grad_by_freq=True)
        self.pos = nn.Parameter(0.1 * torch.randn(T, 8))
        if body == "encoder":
            layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
            self.body = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        else:
            self.qkv, self.proj = nn.Linear(8, 24), nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, V, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, tokens: Tensor) -> Tensor:
        t = tokens.shape[-1]
        h = self.emb(tokens) + self.pos[:t]
        if self.body_kind == "encoder":
            mask = nn.Transformer.generate_square_subsequent_mask(t, dtype=h.dtype)
            h = self.body(h, mask=mask, is_causal=True)
        else:
            q, k, v = (z.transpose(1, 2) for z in self.qkv(h).unflatten(-1, (3, 2, 4)).unbind(-3))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = h + self.proj(a.transpose(1, 2).flatten(-2))
        return self.out(self.norm(h))


LM_CE = nn.CrossEntropyLoss(ignore_index=PAD, label_smoothing=0.1)


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Next-token cross entropy over (batch * seq) tokens, padding ignored."""
    return LM_CE(logits.reshape(-1, V), targets.reshape(-1))


def tokens(g: torch.Generator, *lead: int, rows: int = 4, length: int = T) -> Tensor:
    """Padded token rows (valid lengths 2..length, PAD after), all ids in use."""
    seq = torch.randint(1, V, (*lead, rows, length), generator=g)
    lengths = torch.randint(2, length + 1, (*lead, rows), generator=g)
    seq[torch.arange(length) >= lengths.unsqueeze(-1)] = PAD
    return seq


def own(batch: Any, i: int | None) -> Any:
    """Member i's slice of a per-member batch (all of a shared one, i None)."""
    if i is None:
        return batch
    return tuple(own(b, i) for b in batch) if isinstance(batch, tuple) else batch[i]


def alone(
    factory: Callable[[], nn.Module], batches: list, loss_fn: Callable, per_member: bool
) -> list[nn.Module]:
    """Each member built from its documented seed and trained alone with torch.optim.Adam."""
    models = factory_members([factory] * N, seed=0)
    for i, m in enumerate(models):
        opt = torch.optim.Adam(m.parameters(), lr=LRS[i])
        for x, y in batches:
            x, y = own(x, i if per_member else None), own(y, i if per_member else None)
            opt.zero_grad()
            loss_fn(m(*(x if isinstance(x, tuple) else (x,))), y).backward()
            opt.step()
    return models


def stepped(
    factory: Callable[[], nn.Module], batches: list, loss_fn: Callable, per_member: bool, **kw: Any
) -> vmapens.Ensemble:
    ens = vmapens.Ensemble(factory, n=N, seed=0, **kw)
    step = vmapens.make_step(
        ens, loss_fn, vmapens.StackedAdam(ens, lr=LRS), in_dims=0 if per_member else None
    )
    for x, y in batches:
        step(x, y)
    return ens


def assert_members(ens: vmapens.Ensemble, models: list[nn.Module], loose: tuple = ()) -> None:
    """Member i equals models[i]; `loose` names the parameters whose true gradient is 0 in part
    (docs/semantics.md, "What differs": the key third of attention's in-projection bias takes
    lr-sized Adam steps of round-off sign, 4e-10 after 20 steps at lr 1e-2)."""
    for i, m in enumerate(models):
        got, want = ens[i].state_dict(), m.state_dict()
        assert list(got) == list(want)
        for k in want:
            tol = dict(rtol=0, atol=1e-7) if k.endswith(loose) and loose else TOL
            torch.testing.assert_close(got[k], want[k], **tol, msg=f"member {i} {k}")


@pytest.mark.parametrize("per_member", [False, True], ids=["shared", "per-member"])
def test_embedding_padding_max_norm_and_freq_classifier_matches_alone(per_member: bool) -> None:
    g = torch.Generator().manual_seed(1)
    lead = (N,) if per_member else ()
    batches = [
        (tokens(g, *lead), torch.randint(0, CLASSES, (*lead, 4), generator=g)) for _ in range(3)
    ]
    ce = nn.CrossEntropyLoss()
    ens = stepped(Classifier, batches, ce, per_member)
    models = alone(Classifier, batches, ce, per_member)
    assert_members(ens, models)
    for i in range(N):  # the padding row (zeros from torch's init) never trains
        assert not ens[i].emb.weight[PAD].any()


def test_embedding_bag_mean_offsets_and_sum_with_per_sample_weights_match_alone() -> None:
    g = torch.Generator().manual_seed(2)
    offsets = torch.tensor([0, 3, 3, 7])  # bag 1 is empty: zeros, as alone
    mean = [
        ((torch.randint(0, V, (10,), generator=g), offsets), torch.randint(0, 3, (4,), generator=g))
    ]
    mean *= 2
    ce = nn.CrossEntropyLoss()
    assert_members(
        stepped(lambda: Bag("mean"), mean, ce, False), alone(lambda: Bag("mean"), mean, ce, False)
    )
    # per-member bags (in_dims=0): each member its own tokens, offsets and weights
    flat = torch.randint(0, V, (N, 10), generator=g)
    summed = [
        (
            (flat, offsets.expand(N, 4), torch.rand(N, 10, generator=g)),
            torch.randint(0, 3, (N, 4), generator=g),
        )
    ]
    summed *= 2
    ens = stepped(lambda: Bag("sum"), summed, ce, True)
    assert_members(ens, alone(lambda: Bag("sum"), summed, ce, True))
    # torch refuses per-sample weights with mode="mean"; so does the ensemble, in torch's words
    with pytest.raises(NotImplementedError, match="only supported for mode='sum'"):
        vmapens.Ensemble(lambda: Bag("mean"), n=N, seed=0)(flat[0], offsets, torch.rand(10))


def test_packed_sequences_are_refused_under_vmap_and_train_as_alone_with_the_loop_backend() -> None:
    g = torch.Generator().manual_seed(3)
    x = tokens(g, rows=6)
    lengths = (x != PAD).sum(-1)  # unsorted: enforce_sorted=False sorts them
    y = torch.randint(0, CLASSES, (6,), generator=g)
    ens = vmapens.Ensemble(Packed, n=N, seed=0)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    step = vmapens.make_step(ens, nn.CrossEntropyLoss(), vmapens.StackedAdam(ens, lr=LRS))
    with pytest.raises(RuntimeError, match="PackedSequence.*backend='loop'"):
        step((x, lengths), y)
    with pytest.raises(TypeError, match="PackedSequence.*backend='loop'"):
        ens(x, lengths)
    assert all(torch.equal(v, before[k]) for k, v in ens.state_dict().items())
    # fit with backend="loop": batches of 4 in docs/fit.md's order, 2 epochs
    loop = vmapens.Ensemble(lambda: Packed("gru"), n=N, seed=0, backend="loop")
    vmapens.fit(loop, ((x, lengths), y), nn.CrossEntropyLoss(), epochs=2, batch_size=4,
                lr=LRS, seed=0, progress=False)  # fmt: skip
    plan = batch_plan(6, 4, 4, seed=0)
    batches = [((x[r], lengths[r]), y[r]) for r in plan]
    assert_members(loop, alone(lambda: Packed("gru"), batches, nn.CrossEntropyLoss(), False))
    # per-member sequences and lengths, make_step with in_dims=0
    xs = tokens(g, N, rows=5)
    pm = [((xs, (xs != PAD).sum(-1)), torch.randint(0, CLASSES, (N, 5), generator=g))]
    ens = stepped(Packed, pm, nn.CrossEntropyLoss(), True, backend="loop")
    assert_members(ens, alone(Packed, pm, nn.CrossEntropyLoss(), True))


@pytest.mark.parametrize("max_norm", [None, 1.0], ids=["plain", "max-norm"])
def test_causal_encoder_lm_with_tied_output_matches_alone_on_shared_tokens(max_norm) -> None:
    g = torch.Generator().manual_seed(4)
    seqs = [tokens(g, length=T + 1) for _ in range(3)]
    batches = [(s[:, :-1], s[:, 1:]) for s in seqs]  # next-token targets, PAD ignored
    factory = lambda: TinyLM("encoder", max_norm)  # noqa: E731
    ens = stepped(factory, batches, lm_loss, False)
    assert_members(ens, alone(factory, batches, lm_loss, False), loose=("in_proj_bias",))
    member = ens[2]
    assert member.out.weight is member.emb.weight  # still tied in the member it hands back
    assert list(ens.state_dict()) == list(factory().state_dict())


def test_sdpa_causal_lm_fit_on_per_member_token_streams_matches_alone() -> None:
    g = torch.Generator().manual_seed(5)
    seqs = tokens(g, N, rows=6, length=T + 1)  # one corpus per member: [N, 6, T + 1]
    data = (seqs[..., :-1], seqs[..., 1:])
    ens = vmapens.Ensemble(lambda: TinyLM("sdpa"), n=N, seed=0)
    history = vmapens.fit(ens, data, lm_loss, epochs=2, batch_size=4, lr=LRS, in_dims=0,
                          seed=0, progress=False)  # fmt: skip
    plan = batch_plan(6, 4, 4, seed=0)  # per-member tensors are cut along dim 1, one order
    batches = [(data[0][:, r], data[1][:, r]) for r in plan]
    models = alone(lambda: TinyLM("sdpa"), batches, lm_loss, True)
    # the k third of qkv.bias has a zero true gradient (docs/semantics.md, "What differs")
    assert_members(ens, models, loose=("qkv.bias",))
    assert history.train_loss.shape == (2, N) and bool(history.train_loss.isfinite().all())


def test_weighted_smoothed_ignoring_loss_on_per_member_targets_is_refused_and_loop_is_exact():
    """docs/semantics.md: CrossEntropyLoss with weight, ignore_index and label_smoothing
    together on per-member targets cannot be batched in the step: the error names loss_fn and
    backend='loop', which runs it exactly."""
    g = torch.Generator().manual_seed(6)
    weighted = nn.CrossEntropyLoss(weight=torch.rand(V, generator=g) + 0.5, ignore_index=PAD,
                                   label_smoothing=0.1)  # fmt: skip

    def loss(logits: Tensor, targets: Tensor) -> Tensor:
        return weighted(logits.reshape(-1, V), targets.reshape(-1))

    seqs = tokens(g, N, length=T + 1)
    batches = [(seqs[..., :-1], seqs[..., 1:])]
    ens = vmapens.Ensemble(lambda: TinyLM("sdpa"), n=N, seed=0)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    step = vmapens.make_step(ens, loss, vmapens.StackedAdam(ens, lr=LRS), in_dims=0)
    with pytest.raises(RuntimeError, match="`loss_fn`.*backend='loop'"):
        step(*batches[0])
    assert all(torch.equal(v, before[k]) for k, v in ens.state_dict().items())
    loop = stepped(lambda: TinyLM("sdpa"), batches, loss, True, backend="loop")
    assert_members(loop, alone(lambda: TinyLM("sdpa"), batches, loss, True), loose=("qkv.bias",))


def test_sparse_embedding_and_sparse_adam_are_refused_and_run_under_no_grad() -> None:
    make = lambda: nn.Sequential(nn.Embedding(V, 4, sparse=True), nn.Linear(4, 2))  # noqa: E731
    ens = vmapens.Ensemble(make, n=N, seed=0)
    x = tokens(torch.Generator().manual_seed(7))
    with pytest.raises(
        ValueError, match=r"`0` \(Embedding\) is built with sparse=True.*sparse=False"
    ):
        ens(x)
    with pytest.raises(ValueError, match="SparseAdam has no stacked twin") as refused:
        vmapens.optim.stacked(torch.optim.SparseAdam)
    # It named StackedAdam "its dense twin": in plain torch, Adam moves an embedding row the
    # second batch does not index (its first moment goes on), SparseAdam leaves it.
    assert "StackedAdam is no replacement" in str(refused.value)
    lazy, dense = nn.Embedding(V, 4, sparse=True), nn.Embedding(V, 4)
    dense.load_state_dict(lazy.state_dict())
    opts = [torch.optim.SparseAdam(lazy.parameters()), torch.optim.Adam(dense.parameters())]
    for rows in (torch.tensor([0, 1]), torch.tensor([1])):
        for emb, opt in zip((lazy, dense), opts, strict=True):
            opt.zero_grad()
            emb(rows).sum().backward()
            opt.step()
    torch.testing.assert_close(lazy.weight[1:], dense.weight[1:], rtol=0, atol=1e-6)
    assert not torch.allclose(lazy.weight[0], dense.weight[0])
    with pytest.raises(ValueError, match="sparse=True"):
        vmapens.make_step(ens, nn.CrossEntropyLoss(), vmapens.StackedAdam(ens))
    with torch.no_grad():
        out = ens(x)
    for i, m in enumerate(factory_members([make] * N, seed=0)):
        torch.testing.assert_close(out[i], m(x).detach(), **TOL)


# ---- bugs: a forward that edits a parameter in place (max_norm) reaches members that, alone,
# would not run at that moment.


class Renormed(nn.Module):
    """An embedding whose rows start above max_norm: any lookup renormalises them."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 4, max_norm=0.5)
        self.head = nn.Linear(4, CLASSES)

    def forward(self, t: Tensor) -> Tensor:
        return self.head(self.emb(t).mean(-2))


def test_a_masked_member_keeps_its_embedding_rows_as_a_member_that_does_not_step() -> None:
    """docs/optim.md, "Masks": members where the mask is False do not step. The forward runs
    them anyway and renormalises their max_norm rows in place: they get their parameters back
    with their buffers (it was 2.4 off when only buffers came back)."""
    ens = vmapens.Ensemble(Renormed, n=3, seed=0)
    before = copy.deepcopy(ens[1].state_dict())
    step = vmapens.make_step(ens, nn.CrossEntropyLoss(), vmapens.StackedAdam(ens, lr=0.05))
    g = torch.Generator().manual_seed(8)
    step(torch.randint(0, 20, (6, 5), generator=g), torch.randint(0, 3, (6,), generator=g),
         torch.tensor([True, False, True]))  # fmt: skip
    for k, v in before.items():
        torch.testing.assert_close(ens[1].state_dict()[k], v, rtol=0, atol=0, msg=k)


class _StopFirst(Callback):
    def on_epoch_end(self, ctx: Context) -> None:
        if ctx.epoch == 0:
            ctx.stop([0])


def _fit_against_alone(x, y, xv, yv, epochs, stop_first, opt_cls, **hyper):
    """fit with val_data (no best restore) vs the plain loop: train, then evaluate each epoch;
    member 0 stops after epoch 0 when `stop_first`."""
    ens = vmapens.Ensemble(Renormed, n=3, seed=0)
    vmapens.fit(ens, (x, y), nn.CrossEntropyLoss(), epochs=epochs, batch_size=4, seed=0,
                val_data=(xv, yv), optimizer=vmapens.optim.stacked(opt_cls), progress=False,
                callbacks=[EarlyStopping(patience=None, restore_best=False)]
                + ([_StopFirst()] if stop_first else []), lr=[0.3, 0.1, 0.05], **hyper)  # fmt: skip
    plan = batch_plan(len(x), 4, epochs * 3, seed=0)
    ce = nn.CrossEntropyLoss()
    for i, m in enumerate(factory_members([Renormed] * 3, seed=0)):
        opt = opt_cls(m.parameters(), lr=[0.3, 0.1, 0.05][i], **hyper)
        for e in range(1 if stop_first and i == 0 else epochs):
            m.train()
            for rows in plan[3 * e : 3 * e + 3]:
                opt.zero_grad()
                ce(m(x[rows]), y[rows]).backward()
                opt.step()
            m.eval()
            with torch.no_grad():
                m(xv)  # the validation forward renorms, alone too
        for k, v in m.state_dict().items():
            torch.testing.assert_close(ens[i].state_dict()[k], v, **TOL, msg=f"member {i} {k}")


def test_fit_a_member_stopped_by_a_callback_ends_where_it_stopped() -> None:
    """Member 0 stops after epoch 0 (Context.stop); later epochs' training forwards renorm its
    rows too, and the step gives them back (0.066 off with restore_best=False before)."""
    g = torch.Generator().manual_seed(9)
    x, xv = torch.randint(0, 20, (12, 5), generator=g), torch.randint(0, 20, (6, 5), generator=g)
    _fit_against_alone(x, x[:, 0] % 3, xv, xv[:, 0] % 3, 3, True, torch.optim.Adam)


def test_fit_val_data_check_leaves_the_members_as_built() -> None:
    """fit's first forward on val_data (Evaluator.check: "nothing changes") renorms the rows of
    the validation tokens before any step, and gives them back; alone they are renormed after
    epoch 0, so with weight decay the rows ended elsewhere before (0.06 off)."""
    g = torch.Generator().manual_seed(10)
    x, xv = torch.randint(0, 10, (12, 5), generator=g), torch.randint(10, 20, (6, 5), generator=g)
    _fit_against_alone(x, x[:, 0] % 3, xv, xv[:, 0] % 3, 2, False, torch.optim.AdamW,
                       weight_decay=0.5)  # fmt: skip
