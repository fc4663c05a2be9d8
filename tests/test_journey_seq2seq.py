"""User journey: an ensemble of GRU encoder-decoders with attention, trained, then beam-searched.

The script a researcher writes from README.md and docs/: 3 members (embedding + `nn.GRU`
encoder, `nn.GRUCell` decoder with Bahdanau or dot attention over the encoder states under a
source padding mask, float64), trained with teacher forcing decided by a per-step coin flip,
`nn.CrossEntropyLoss(ignore_index=PAD)`, per-member gradient clipping and learning rates, with
`make_step` on per-member (src, tgt) batches and with `fit` on `((src, tgt), tgt)` tensors;
the coin as `torch.rand(()) < ratio` (docs/semantics.md, "Randomness": with
`randomness="same"` each member draws what it draws alone from the same RNG state) and as the
classic tutorial's `random.random() < ratio` (docs/semantics.md: one Python draw serves every
member, the first training step refuses it). Then decoding: greedy, and beam search (width 3,
`topk` over beam * vocab, back-pointers gathered, length normalisation, stopping when every
beam has ended) with a fixed-length masked loop run on the ensemble step by step
(`ens(..., in_dims=0)`, the decoder state per member), with a data-dependent `while` outside
the members, and inside `map_members` with `backend="loop"` (the documented way out of
`.item()`); member files loaded into the plain class. The truth: each member a plain module
built from its documented seed (tests/truth.py), trained alone with `torch.optim.Adam` on the
same batches, and decoded alone by the same plain-PyTorch code.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call
from truth import assert_members_equal, batch_plan, factory_members

import vmapens

pytestmark = pytest.mark.usefixtures("float64_default")

N, V, PAD, BOS, EOS, S, T, B, E, H = 3, 10, 0, 1, 2, 5, 5, 4, 5, 6
LRS = [0.02, 0.05, 0.03]
CLIP = 0.5
TOL: dict[str, Any] = dict(rtol=1e-9, atol=1e-10)
CE = nn.CrossEntropyLoss(ignore_index=PAD)


class Seq2Seq(nn.Module):
    """GRU encoder, GRUCell decoder with attention; `mode` picks train / encode / one step."""

    def __init__(self, attn: str = "bahdanau", coin: str = "torch", ratio: float = 0.5) -> None:
        super().__init__()
        self.attn, self.coin, self.ratio = attn, coin, ratio
        self.src_emb = nn.Embedding(V, E, padding_idx=PAD)
        self.tgt_emb = nn.Embedding(V, E, padding_idx=PAD)
        self.enc = nn.GRU(E, H, batch_first=True)
        self.cell = nn.GRUCell(E + H, H)
        self.w_q = nn.Linear(H, H, bias=False)
        self.w_k = nn.Linear(H, H)
        self.v = nn.Linear(H, 1, bias=False)
        self.out = nn.Linear(2 * H, V)

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        mem, h = self.enc(self.src_emb(src))
        return mem, h[0], src != PAD

    def step(self, tok: Tensor, h: Tensor, mem: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        if self.attn == "bahdanau":
            scores = self.v(torch.tanh(self.w_q(h)[:, None] + self.w_k(mem)))[..., 0]
        else:
            scores = torch.bmm(mem, h[:, :, None])[..., 0]
        weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
        ctx = torch.bmm(weights[:, None], mem)[:, 0]
        h = self.cell(torch.cat([self.tgt_emb(tok), ctx], -1), h)
        return self.out(torch.cat([h, ctx], -1)), h

    def teacher_forced(self, src: Tensor, tgt: Tensor) -> Tensor:
        mem, h, mask = self.encode(src)
        tok, outs = torch.full_like(tgt[:, 0], BOS), []
        for t in range(tgt.shape[1]):
            logits, h = self.step(tok, h, mem, mask)
            outs.append(logits)
            pred = logits.argmax(-1)
            if self.coin == "torch":  # one coin per step, a tensor: no Python branch
                tok = torch.where(torch.rand(()) < self.ratio, tgt[:, t], pred)
            elif self.coin == "torch_if":  # the tutorial's `if`, on torch's coin
                tok = tgt[:, t] if torch.rand(()) < self.ratio else pred
            else:  # the classic tutorial: Python's own `random`
                tok = tgt[:, t] if random.random() < self.ratio else pred
        return torch.stack(outs, 1)

    def forward(self, a: Tensor, b: Any = None, c: Any = None, d: Any = None, mode: str = "train"):
        if mode == "encode":
            return self.encode(a)
        if mode == "step":
            return self.step(a, b, c, d)
        return self.teacher_forced(a, b)


def flat_ce(logits: Tensor, tgt: Tensor) -> Tensor:
    return CE(logits.reshape(-1, V), tgt.reshape(-1))


def pairs(g: torch.Generator, *lead: int) -> tuple[Tensor, Tensor]:
    """(src, tgt): random tokens, padded after a random length; tgt ends with EOS then PAD."""
    src = torch.randint(3, V, (*lead, B, S), generator=g)
    src[torch.arange(S) >= torch.randint(2, S + 1, (*lead, B), generator=g).unsqueeze(-1)] = PAD
    tgt = torch.randint(3, V, (*lead, B, T), generator=g)
    ends = torch.randint(1, T, (*lead, B), generator=g).unsqueeze(-1)
    tgt[torch.arange(T) == ends] = EOS
    tgt[torch.arange(T) > ends] = PAD
    return src, tgt


def batches(count: int, *lead: int) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [pairs(g, *lead) for _ in range(count)]


def alone_from_same_rng(factory: Any, data: list, per_member: bool, seed: int = 3) -> list:
    """Each member trained alone with torch.optim.Adam and its own clip, every member's step
    started from the same RNG state (docs: `randomness="same"`)."""
    models = factory_members([factory] * N, seed=0)
    opts = [torch.optim.Adam(m.parameters(), lr=lr) for m, lr in zip(models, LRS, strict=True)]
    torch.manual_seed(seed)
    for src, tgt in data:
        state = torch.get_rng_state()
        for i, (m, opt) in enumerate(zip(models, opts, strict=True)):
            torch.set_rng_state(state)
            s, t = (src[i], tgt[i]) if per_member else (src, tgt)
            opt.zero_grad()
            flat_ce(m(s, t), t).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP)
            opt.step()
    return models


def trained_with_step(factory: Any, data: list, per_member: bool, seed: int = 3, **kw: Any):
    ens = vmapens.Ensemble(factory, n=N, seed=0, randomness="same", **kw)
    opt = vmapens.StackedAdam(ens, lr=LRS)
    step = vmapens.make_step(
        ens, flat_ce, opt, in_dims=0 if per_member else None, clip_grad_norm=CLIP
    )
    torch.manual_seed(seed)
    for src, tgt in data:
        step((src, tgt), tgt)
    return ens


# -- training: a per-step coin from torch's RNG, per-member data, clip and lr -------------------


@pytest.mark.parametrize(
    ("attn", "coin", "how"),
    [
        ("bahdanau", "torch", {}),
        ("dot", "torch_if", {}),
        ("bahdanau", "torch_if", {"chunk_size": 2}),  # members in turns: each from one state
        ("dot", "torch", {"backend": "loop"}),
    ],
    ids=["bahdanau-where", "dot-if", "chunked-if", "loop-where"],
)
def test_teacher_forcing_coin_from_torch_with_same_randomness_matches_alone(
    attn: str, coin: str, how: dict
) -> None:
    def factory() -> Seq2Seq:
        return Seq2Seq(attn, coin)

    data = batches(2, N)
    ens = trained_with_step(factory, data, per_member=True, **how)
    after = torch.get_rng_state()
    alone = alone_from_same_rng(factory, data, per_member=True)
    assert_members_equal(ens, alone, **TOL)
    assert torch.equal(after, torch.get_rng_state())  # the global RNG moved as one member's run


def test_coin_in_a_python_if_with_different_randomness_is_refused_naming_the_ways_out() -> None:
    ens = vmapens.Ensemble(lambda: Seq2Seq("dot", "torch_if"), n=N, seed=0)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    step = vmapens.make_step(ens, flat_ce, vmapens.StackedAdam(ens, lr=LRS), in_dims=0)
    src, tgt = batches(1, N)[0]
    with pytest.raises(RuntimeError, match="backend='loop'"):
        step((src, tgt), tgt)
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_python_random_coin_is_refused_by_the_first_step_and_changes_nothing() -> None:
    """docs/semantics.md: one Python draw serves every member; the first step refuses it."""
    ens = vmapens.Ensemble(lambda: Seq2Seq(coin="python"), n=N, seed=0, randomness="same")
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    step = vmapens.make_step(ens, flat_ce, vmapens.StackedAdam(ens, lr=LRS), in_dims=0)
    src, tgt = batches(1, N)[0]
    random.seed(0)
    with pytest.raises(Exception, match=r"(?s)Python's `random`.*torch\.(rand|randint)"):
        step((src, tgt), tgt)
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_fit_on_src_tgt_tuples_with_clip_and_member_lrs_matches_alone() -> None:
    """`fit(ens, ((src, tgt), tgt), ...)`: a tuple of inputs cut by the same rows; the truth
    takes fit's documented batch order (tests/truth.py `batch_plan`)."""
    g = torch.Generator().manual_seed(9)
    src, tgt = (torch.cat(p) for p in zip(*[pairs(g) for _ in range(3)], strict=True))
    factory = lambda: Seq2Seq("bahdanau", "torch", ratio=0.7)  # noqa: E731
    ens = vmapens.Ensemble(factory, n=N, seed=0, randomness="same")
    torch.manual_seed(4)
    vmapens.fit(
        ens, ((src, tgt), tgt), flat_ce, epochs=2, batch_size=5, lr=LRS,
        clip_grad_norm=CLIP, seed=1, progress=False,
    )  # fmt: skip
    plan = batch_plan(len(src), 5, 2 * 3, seed=1)
    alone = alone_from_same_rng(factory, [(src[r], tgt[r]) for r in plan], False, seed=4)
    assert_members_equal(ens, alone, **TOL)


# -- decoding ------------------------------------------------------------------------------------


def beam_alone(m: nn.Module, src: Tensor, k: int = 3, steps: int = T, alpha: float = 0.7):
    """One sentence [S] -> (best sequence [steps], normalised score): fixed-length loop, a
    finished beam only extends by PAD at no cost, and the loop stops once every beam ended."""
    mem, h, mask = m(src[None], mode="encode")
    mem, h, mask = mem.expand(k, -1, -1), h.expand(k, -1), mask.expand(k, -1)
    tok = torch.full((k,), BOS)
    scores = torch.tensor([0.0] + [float("-inf")] * (k - 1))
    done, length = torch.zeros(k, dtype=torch.bool), torch.zeros(k)
    seqs = torch.full((k, steps), PAD)
    t = 0
    while t < steps and not bool(done.all()):
        logits, h = m(tok, h, mem, mask, mode="step")
        logp = torch.log_softmax(logits, -1)
        pad_only = torch.full((V,), float("-inf")).index_fill(0, torch.tensor([PAD]), 0.0)
        logp = torch.where(done[:, None], pad_only, logp)
        top, idx = torch.topk((scores[:, None] + logp).flatten(), k)
        back, tok = idx // V, idx % V
        seqs, h, done, length = seqs[back], h[back], done[back], length[back]
        seqs[:, t] = tok
        length = length + (~done).double()
        done = done | (tok == EOS)
        scores = top
        t += 1
    norm = scores / length.clamp(min=1) ** alpha
    best = norm.argmax()
    return seqs[best], norm[best]


def beam_ensemble(ens: vmapens.Ensemble, src: Tensor, k: int = 3, steps: int = T, alpha=0.7):
    """The same search for all members at once: src [n, S]; the decoder state per member
    (`in_dims=0`), topk per member over beam * vocab, back-pointers gathered per member."""
    n = src.shape[0]
    mem, h, mask = ens(src[:, None], mode="encode", in_dims=0)
    mem, h = mem.expand(n, k, -1, -1), h.expand(n, k, -1)
    mask = mask.expand(n, k, -1)
    tok = torch.full((n, k), BOS)
    scores = torch.tensor([0.0] + [float("-inf")] * (k - 1)).repeat(n, 1)
    done, length = torch.zeros(n, k, dtype=torch.bool), torch.zeros(n, k)
    seqs = torch.full((n, k, steps), PAD)
    t = 0
    while t < steps and not bool(done.all()):  # outside the members: a plain tensor
        logits, h = ens(tok, h, mem, mask, mode="step", in_dims=0)
        logp = torch.log_softmax(logits, -1)
        pad_only = torch.full((V,), float("-inf")).index_fill(0, torch.tensor([PAD]), 0.0)
        logp = torch.where(done[..., None], pad_only, logp)
        top, idx = torch.topk((scores[..., None] + logp).flatten(1), k)
        back, tok = idx // V, idx % V
        seqs = seqs.gather(1, back[..., None].expand(-1, -1, steps)).clone()
        h = h.gather(1, back[..., None].expand(-1, -1, H))
        done, length = done.gather(1, back), length.gather(1, back)
        seqs[:, :, t] = tok
        length = length + (~done).double()
        done = done | (tok == EOS)
        scores = top
        t += 1
    norm = scores / length.clamp(min=1) ** alpha
    best = norm.argmax(-1)
    return seqs[torch.arange(n), best], norm[torch.arange(n), best]


@pytest.fixture(scope="module")
def trained() -> tuple[vmapens.Ensemble, list[nn.Module]]:
    before = torch.get_default_dtype()  # module-scoped: set up before `float64_default`
    torch.set_default_dtype(torch.float64)
    try:
        data = batches(2, N)
        ens = trained_with_step(Seq2Seq, data, per_member=True)
        alone = alone_from_same_rng(Seq2Seq, data, per_member=True)
    finally:  # the next test file in this worker gets torch's default back
        torch.set_default_dtype(before)
    return ens.eval(), [m.eval() for m in alone]


def sources(rows: int = 2) -> Tensor:
    g = torch.Generator().manual_seed(21)
    return pairs(g, N)[0][:, :rows]  # [n, rows, S], padded


def test_greedy_decoding_step_by_step_with_the_state_per_member_matches_alone(trained) -> None:
    ens, alone = trained
    src = sources()
    with torch.no_grad():
        mem, h, mask = ens(src, mode="encode", in_dims=0)
        tok, got = torch.full((N, src.shape[1]), BOS), []
        for _ in range(T):
            logits, h = ens(tok, h, mem, mask, mode="step", in_dims=0)
            tok = logits.argmax(-1)
            got.append(tok)
        for i, m in enumerate(alone):
            mem_i, h_i, mask_i = m(src[i], mode="encode")
            tok_i = torch.full((src.shape[1],), BOS)
            for t in range(T):
                logits_i, h_i = m(tok_i, h_i, mem_i, mask_i, mode="step")
                tok_i = logits_i.argmax(-1)
                assert torch.equal(got[t][i], tok_i), f"member {i} step {t}"
            torch.testing.assert_close(h[i], h_i, **TOL)


def test_beam_search_on_the_ensemble_matches_each_members_beam_search_alone(trained) -> None:
    ens, alone = trained
    src = sources(rows=1)[:, 0]
    with torch.no_grad():
        seqs, norm = beam_ensemble(ens, src)
        for i, m in enumerate(alone):
            want, want_norm = beam_alone(m, src[i])
            assert torch.equal(seqs[i], want), f"member {i}"
            torch.testing.assert_close(norm[i], want_norm, **TOL)


def test_beam_search_with_a_while_in_map_members_runs_with_the_loop_backend(trained) -> None:
    """`while not done.all()` inside a member needs a Python bool: refused under vmap, naming
    `backend='loop'`; an ensemble built with that backend runs it member by member, as alone."""
    ens, alone = trained

    def member(runner: nn.Module, state: dict[str, Tensor], src: Tensor) -> Any:
        class Call(nn.Module):  # the member's forward with its own tensors
            def forward(self, *args: Any, mode: str = "train") -> Any:
                return functional_call(runner, state, args, {"mode": mode})

        return beam_alone(Call(), src)

    src = sources(rows=1)[:, 0]
    with torch.no_grad(), pytest.raises(RuntimeError, match="backend='loop'"):
        ens.map_members(lambda s, x: member(ens.runner, s, x), src, in_dims=0)
    looped = vmapens.Ensemble(Seq2Seq, n=N, seed=0, backend="loop")
    looped.load_state_dict(ens.state_dict())
    looped.eval()
    with torch.no_grad():
        seqs, norm = looped.map_members(lambda s, x: member(looped.runner, s, x), src, in_dims=0)
        for i, m in enumerate(alone):
            want, want_norm = beam_alone(m, src[i])
            assert torch.equal(seqs[i], want), f"member {i}"
            torch.testing.assert_close(norm[i], want_norm, **TOL)


def test_member_files_load_into_the_plain_class_and_beam_search_as_the_ensemble(
    trained, tmp_path: Path
) -> None:
    ens, _ = trained
    paths = vmapens.save_members(ens, tmp_path / "members")
    src = sources(rows=1)[:, 0]
    with torch.no_grad():
        seqs, norm = beam_ensemble(ens, src)
        for i, path in enumerate(paths):
            m = Seq2Seq()
            m.load_state_dict(torch.load(path))
            assert type(m.enc) is nn.GRU
            want, want_norm = beam_alone(m.eval(), src[i])
            assert torch.equal(seqs[i], want), f"member {i}"
            torch.testing.assert_close(norm[i], want_norm, **TOL)
