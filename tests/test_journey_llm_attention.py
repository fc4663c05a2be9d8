"""User journey: attention written by hand the way modern LLM code writes it, as members.

A small decoder block as LLM code writes it: token embedding tied to the output head, a
hand-written RMSNorm (``torch.rsqrt``) or ``nn.RMSNorm``, grouped-query attention through
``F.scaled_dot_product_attention`` (``enable_gqa=True``) on ``[B, H, L, E]`` made with
``view``/``transpose`` (non-contiguous q/k/v), rotary position embeddings from cos/sin buffers
(``torch.stack([-x2, x1], -1).flatten(-2)``), ALiBi biases as a buffer, ``is_causal``, a bool
and a float ``attn_mask``, ``scale=``, ``dropout_p`` in training, a SwiGLU MLP, weight-tied
K/V projections; a KV cache kept across calls in eval (a plain attribute and a buffer the
forward reassigns) for greedy decoding under ``torch.inference_mode()``; top-k sampling under
``randomness="same"``; ``nn.MultiheadAttention`` sequence-first with per-head weights.

The truth: N plain modules built from the documented seeds, run alone and trained alone with
``torch.optim.Adam`` (float64 for exact comparisons, one float32 case).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from truth import assert_members_equal, factory_members

import vmapens

N, B, T, V, D, H, KV = 3, 2, 6, 11, 16, 4, 2
HD = D // H
F64 = torch.float64
TOL: dict[str, Any] = dict(rtol=1e-9, atol=1e-10)


# -- the pieces -----------------------------------------------------------------------------------


class HandRMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(length: int, hd: int) -> tuple[Tensor, Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=F64) / hd))
    freqs = torch.outer(torch.arange(length, dtype=F64), inv).repeat_interleave(2, -1)
    return freqs.cos(), freqs.sin()


def rotate(x: Tensor) -> Tensor:
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([-x2, x1], -1).flatten(-2)


def alibi(heads: int, length: int) -> Tensor:
    slopes = torch.tensor([2 ** (-8 * (h + 1) / heads) for h in range(heads)], dtype=F64)
    pos = torch.arange(length)
    dist = (pos[None, :] - pos[:, None]).to(F64)  # j - i, <= 0 in the past
    return slopes[:, None, None] * dist.clamp(max=0)[None]  # [H, L, L]


class LLMBlock(nn.Module):
    """One decoder block with a tied head. ``attn`` picks how SDPA is called."""

    def __init__(
        self,
        attn: str = "causal",
        norm: str = "hand",
        tie_kv: bool = False,
        p: float = 0.0,
        kv_heads: int = KV,
        max_len: int = 16,
    ) -> None:
        super().__init__()
        self.attn, self.p, self.kv_heads = attn, p, kv_heads
        self.embed = nn.Embedding(V, D)
        mk = (lambda: HandRMSNorm(D)) if norm == "hand" else (lambda: nn.RMSNorm(D, eps=1e-6))
        self.norm1, self.norm2, self.norm_f = mk(), mk(), mk()
        self.q = nn.Linear(D, H * HD, bias=False)
        self.k = nn.Linear(D, kv_heads * HD, bias=False)
        self.v = self.k if tie_kv else nn.Linear(D, kv_heads * HD, bias=False)
        self.o = nn.Linear(H * HD, D, bias=False)
        self.w1 = nn.Linear(D, 24, bias=False)
        self.w3 = nn.Linear(D, 24, bias=False)
        self.w2 = nn.Linear(24, D, bias=False)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.embed.weight  # tied input/output embeddings
        cos, sin = rope_tables(max_len, HD)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.register_buffer("alibi", alibi(H, max_len))
        self.register_buffer("causal", torch.ones(max_len, max_len, dtype=torch.bool).tril())

    def heads(self, x: Tensor, past: int = 0) -> tuple[Tensor, Tensor, Tensor]:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, H, HD).transpose(1, 2)  # non-contiguous [B, H, T, E]
        k = self.k(x).view(b, t, self.kv_heads, HD).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv_heads, HD).transpose(1, 2)
        cos, sin = self.cos[past : past + t], self.sin[past : past + t]
        q = q * cos + rotate(q) * sin
        k = k * cos + rotate(k) * sin
        return q, k, v

    def sdpa(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        t = q.shape[-2]
        p = self.p if self.training else 0.0
        gqa = self.kv_heads != H
        if self.attn == "causal":
            return F.scaled_dot_product_attention(
                q, k, v, dropout_p=p, is_causal=True, enable_gqa=gqa
            )
        if self.attn == "bool":
            mask = self.causal[:t, :t]
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=p, enable_gqa=gqa
            )
        if self.attn == "alibi":  # float mask: ALiBi plus -inf above the diagonal
            bias = self.alibi[:, :t, :t].masked_fill(~self.causal[:t, :t], float("-inf"))
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=bias, dropout_p=p, enable_gqa=gqa
            )
        if self.attn == "scale":
            return F.scaled_dot_product_attention(
                q, k, v, dropout_p=p, is_causal=True, scale=0.3, enable_gqa=gqa
            )
        if self.attn == "repeat":  # GQA by hand: repeat_interleave the kv heads
            rep = H // self.kv_heads
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        raise ValueError(self.attn)

    def forward(self, tokens: Tensor) -> Tensor:
        b, t = tokens.shape
        h = self.embed(tokens)
        q, k, v = self.heads(self.norm1(h))
        a = self.sdpa(q, k, v).transpose(1, 2).reshape(b, t, H * HD)
        h = h + self.o(a)
        x = self.norm2(h)
        h = h + self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.head(self.norm_f(h))


def tokens(seed: int, b: int = B, t: int = T) -> Tensor:
    return torch.randint(V, (b, t), generator=torch.Generator().manual_seed(seed))


def ce(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out.flatten(0, -2), y.flatten())


def build(factory: Callable[[], nn.Module], **kw: Any) -> tuple[vmapens.Ensemble, list[nn.Module]]:
    ens = vmapens.Ensemble(factory, n=N, seed=0, **kw)
    alone = factory_members([factory] * N, seed=0)
    return ens, alone


def train_both(
    ens: vmapens.Ensemble,
    alone: list[nn.Module],
    steps: int = 3,
    lr: float = 0.02,
    same_rng: bool = False,
    **tol: Any,
) -> None:
    """`steps` make_step steps against torch.optim.Adam alone; with `same_rng`, every member
    alone starts each step from the RNG state the ensemble's step started from."""
    tol = tol or TOL
    step = vmapens.make_step(ens, ce, vmapens.StackedAdam(ens, lr=lr))
    opts = [torch.optim.Adam(m.parameters(), lr=lr) for m in alone]
    for s in range(steps):
        x, y = tokens(10 + s), tokens(20 + s)
        rng = torch.get_rng_state()
        loss = step(x, y)
        after = torch.get_rng_state()
        want = []
        for m, opt in zip(alone, opts, strict=True):
            if same_rng:
                torch.set_rng_state(rng)
            opt.zero_grad()
            value = ce(m(x), y)
            value.backward()
            opt.step()
            want.append(value.detach())
        if same_rng:
            torch.set_rng_state(after)
        torch.testing.assert_close(loss, torch.stack(want), **tol)
    assert_members_equal(ens, alone, grads=True, **tol)


def forwards_both(ens: vmapens.Ensemble, alone: list[nn.Module], x: Tensor, **tol: Any) -> None:
    """ens(x) in train and eval, under no_grad, inference_mode and with grad, vs alone."""
    tol = tol or TOL
    for mode in ("train", "eval"):
        ens.train(mode == "train")
        for m in alone:
            m.train(mode == "train")
        for ctx in (torch.no_grad, torch.inference_mode, torch.enable_grad):
            with ctx():
                got = ens(x)
                want = torch.stack([m(x) for m in alone])
            torch.testing.assert_close(got, want, **tol, msg=f"{mode} {ctx.__name__}")
    ens.train()
    for m in alone:
        m.train()


# -- the block: forwards and training ------------------------------------------------------------

BLOCKS = {
    "causal-gqa-hand-rms": dict(attn="causal"),
    "bool-mask-gqa-nn-rms": dict(attn="bool", norm="nn"),
    "alibi-float-mask-gqa": dict(attn="alibi"),
    "scale-gqa": dict(attn="scale", norm="nn"),
    "repeat-kv-by-hand": dict(attn="repeat"),
    "causal-mha-tied-kv": dict(attn="causal", tie_kv=True, kv_heads=H),
    "gqa-one-kv-head": dict(attn="alibi", kv_heads=1, tie_kv=True),
}


@pytest.mark.usefixtures("float64_default")
@pytest.mark.parametrize("opts", BLOCKS.values(), ids=list(BLOCKS))
def test_llm_block_forwards_and_trains_as_each_member_alone(opts: dict) -> None:
    factory = lambda: LLMBlock(**opts)  # noqa: E731
    ens, alone = build(factory)
    forwards_both(ens, alone, tokens(0))
    train_both(ens, alone)
    # the trained members come back as plain modules, ties kept
    for i, m in enumerate(ens.unstack()):
        assert m.head.weight is m.embed.weight
        if opts.get("tie_kv"):
            assert m.v is m.k
        torch.testing.assert_close(m(tokens(5)), alone[i](tokens(5)), **TOL)


@pytest.mark.usefixtures("float64_default")
@pytest.mark.parametrize("kw", [{"chunk_size": 2}, {"backend": "loop"}], ids=["chunks", "loop"])
def test_llm_block_in_turns_trains_as_each_member_alone(kw: dict) -> None:
    factory = lambda: LLMBlock(attn="alibi")  # noqa: E731
    ens, alone = build(factory, **kw)
    forwards_both(ens, alone, tokens(0))
    train_both(ens, alone, steps=2)


@pytest.mark.usefixtures("float64_default")
def test_llm_block_with_per_member_tokens_trains_as_alone() -> None:
    factory = lambda: LLMBlock(attn="causal")  # noqa: E731
    ens, alone = build(factory)
    xs = torch.stack([tokens(30 + i) for i in range(N)])
    ys = torch.stack([tokens(40 + i) for i in range(N)])
    with torch.no_grad():
        torch.testing.assert_close(
            ens(xs, in_dims=0), torch.stack([m(x) for m, x in zip(alone, xs)]), **TOL
        )
    step = vmapens.make_step(ens, ce, vmapens.StackedAdam(ens, lr=0.02), in_dims=0)
    opts = [torch.optim.Adam(m.parameters(), lr=0.02) for m in alone]
    for _ in range(2):
        loss = step(xs, ys)
        want = []
        for m, o, x, y in zip(alone, opts, xs, ys, strict=True):
            o.zero_grad()
            v = ce(m(x), y)
            v.backward()
            o.step()
            want.append(v.detach())
        torch.testing.assert_close(loss, torch.stack(want), **TOL)
    assert_members_equal(ens, alone, grads=True, **TOL)


def test_llm_block_in_float32_trains_as_each_member_alone() -> None:
    factory = lambda: LLMBlock(attn="causal").float()  # noqa: E731
    ens, alone = build(factory)
    tol = dict(rtol=1e-4, atol=1e-5)
    forwards_both(ens, alone, tokens(0), **tol)
    train_both(ens, alone, steps=3, **tol)


# -- dropout inside SDPA with randomness="same" ---------------------------------------------------


@pytest.mark.usefixtures("float64_default")
@pytest.mark.parametrize("attn", ["causal", "bool", "alibi", "repeat"])
def test_sdpa_dropout_with_same_randomness_draws_as_each_member_alone(attn: str) -> None:
    """docs/semantics.md: with randomness="same" each member draws what it draws alone from
    the same RNG state (a dropout mask)."""
    factory = lambda: LLMBlock(attn=attn, p=0.3)  # noqa: E731
    ens, alone = build(factory, randomness="same")
    x = tokens(0)
    rng = torch.get_rng_state()
    with torch.no_grad():
        got = ens(x)
    want = []
    for m in alone:
        torch.set_rng_state(rng)
        with torch.no_grad():
            want.append(m(x))
    torch.testing.assert_close(got, torch.stack(want), **TOL)
    train_both(ens, alone, steps=2, same_rng=True)


@pytest.mark.usefixtures("float64_default")
def test_sdpa_dropout_is_off_in_eval_as_alone() -> None:
    factory = lambda: LLMBlock(attn="causal", p=0.5)  # noqa: E731
    ens, alone = build(factory)  # "different": off in eval anyway
    ens.eval()
    with torch.inference_mode():
        got = ens(tokens(0))
        want = torch.stack([m.eval()(tokens(0)) for m in alone])
    torch.testing.assert_close(got, want, **TOL)


# -- incremental decoding with a KV cache ---------------------------------------------------------


class CachedLM(LLMBlock):
    """The block with a KV cache for decoding: `self.kc`/`self.vc` as plain attributes
    (torch.cat), or buffers of a fixed length the forward reassigns, with a position buffer."""

    def __init__(self, where: str = "attribute", max_len: int = 16) -> None:
        super().__init__(attn="causal", max_len=max_len)
        self.where = where
        if where == "buffer":
            self.register_buffer("kc", torch.zeros(B, KV, max_len, HD))
            self.register_buffer("vc", torch.zeros(B, KV, max_len, HD))
            self.register_buffer("pos", torch.zeros((), dtype=torch.long))
        else:
            self.kc: Tensor | None = None
            self.vc: Tensor | None = None
            self.past = 0

    def forward(self, tokens: Tensor, start: bool = True) -> Tensor:  # type: ignore[override]
        b, t = tokens.shape
        h = self.embed(tokens)
        if self.where == "buffer":
            past = 0 if start else None
            if past is None:
                # positions from the buffer: a one-hot over slots (no .item() under vmap)
                slots = torch.arange(self.kc.shape[-2])
                where = self.pos + torch.arange(t)
            else:
                slots = torch.arange(self.kc.shape[-2])
                where = torch.arange(t)
            cos = self.cos[where]
            sin = self.sin[where]
            x = self.norm1(h)
            q = self.q(x).view(b, t, H, HD).transpose(1, 2)
            k = self.k(x).view(b, t, KV, HD).transpose(1, 2)
            v = self.v(x).view(b, t, KV, HD).transpose(1, 2)
            q, k = q * cos + rotate(q) * sin, k * cos + rotate(k) * sin
            onehot = (slots[:, None] == where[None, :]).to(k.dtype)  # [S, t]
            keep = 1 - onehot.sum(-1)[:, None]
            kc = self.kc * (0 if start else 1)
            vc = self.vc * (0 if start else 1)
            self.kc = kc * keep + onehot @ k
            self.vc = vc * keep + onehot @ v
            self.pos = where[-1] + 1
            mask = slots[None, :] <= where[:, None]  # [t, S]
            a = F.scaled_dot_product_attention(q, self.kc, self.vc, attn_mask=mask, enable_gqa=True)
        else:
            if start:
                self.kc = self.vc = None
                self.past = 0
            q, k, v = self.heads(self.norm1(h), self.past)
            self.kc = k if self.kc is None else torch.cat([self.kc, k], -2)
            self.vc = v if self.vc is None else torch.cat([self.vc, v], -2)
            self.past += t
            if start:
                a = F.scaled_dot_product_attention(
                    q, self.kc, self.vc, is_causal=True, enable_gqa=True
                )
            else:  # one new token attends to everything cached
                a = F.scaled_dot_product_attention(q, self.kc, self.vc, enable_gqa=True)
        a = a.transpose(1, 2).reshape(b, t, H * HD)
        h = h + self.o(a)
        x = self.norm2(h)
        h = h + self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.head(self.norm_f(h))


def full_greedy(m: nn.Module, prompt: Tensor, steps: int) -> Tensor:
    seq = prompt
    for _ in range(steps):
        nxt = m(seq, True)[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], -1)
    return seq


def cached_greedy(
    m: Callable[..., Tensor], prompt: Tensor, steps: int
) -> tuple[Tensor, list[Tensor]]:
    """Greedy decoding through the cache: the sequence and every call's logits. `m` may be the
    ensemble (then `prompt` is [n, B, t] and outputs lead with n)."""
    seq, logits = prompt, m(prompt, True)
    seen = [logits]
    for _ in range(steps):
        nxt = logits.select(-2, -1).argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], -1)
        logits = m(nxt, False)
        seen.append(logits)
    return seq, seen


def decode_as_alone(ens: vmapens.Ensemble, alone: list[nn.Module], grad_mode: str) -> None:
    """Two prompts in a row (the second restarts the cache), greedy through the cache: every
    call's logits and the tokens, member by member, against the member alone; the member
    alone's cached decoding against its decoding from scratch (the test's own cache is right)."""
    ens.eval()
    for m in alone:
        m.eval()
    ctx = getattr(torch, grad_mode)
    steps = 5
    for length in (3, 2):
        prompt = tokens(length, t=length)
        with ctx():
            got, got_logits = cached_greedy(
                lambda t, s: ens(t, s, in_dims=(0, None)), prompt.expand(N, -1, -1), steps
            )
        for i, m in enumerate(alone):
            with ctx():
                want, want_logits = cached_greedy(m, prompt, steps)
                fresh = full_greedy(copy.deepcopy(m), prompt, steps)
            assert torch.equal(want, fresh), "the test's own cache is wrong"
            for k, (a, b) in enumerate(zip(got_logits, want_logits, strict=True)):
                torch.testing.assert_close(a[i], b, **TOL, msg=f"member {i}, call {k}")
            assert torch.equal(got[i], want), f"member {i}, prompt {length}"
    for i, m in enumerate(alone):  # the members' caches, as alone
        torch.testing.assert_close(ens[i].kc, m.kc, **TOL)
        torch.testing.assert_close(ens[i].vc, m.vc, **TOL)


@pytest.mark.usefixtures("float64_default")
@pytest.mark.parametrize("where", ["attribute", "buffer"])
@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])
def test_kv_cache_greedy_decoding_matches_each_member_alone(where: str, grad_mode: str) -> None:
    factory = lambda: CachedLM(where)  # noqa: E731
    decode_as_alone(*build(factory), grad_mode)


@pytest.mark.usefixtures("float64_default")
@pytest.mark.parametrize(
    "where,kw",
    [("attribute", {"backend": "loop"}), ("buffer", {"backend": "loop"}),
     ("buffer", {"chunk_size": 1}), ("buffer", {"chunk_size": 2})],
    ids=["attribute-loop", "buffer-loop", "buffer-chunks1", "buffer-chunks2"],
)  # fmt: skip
def test_kv_cache_greedy_decoding_in_turns_matches_each_member_alone(where: str, kw: dict) -> None:
    """docs/semantics.md: with backend="loop" each member's turn runs with its own row of
    every stacked tensor the forward kept, so a cache read back is the member's own; a buffer
    the forward reassigns is the member's own row with any backend."""
    factory = lambda: CachedLM(where)  # noqa: E731
    decode_as_alone(*build(factory, **kw), "inference_mode")


@pytest.mark.usefixtures("float64_default")
@pytest.mark.parametrize("chunk_size", [1, 2], ids=["chunks1", "uneven-chunks2"])
def test_kv_cache_in_an_attribute_with_chunks_decodes_as_alone(chunk_size: int) -> None:
    """docs/semantics.md: each call hands every chunk its members' rows of what the forwards
    kept. Found by a hunt: with chunks of one, every chunk read the cache the last chunk of
    the call before had left on the module the members run (member 0 read member 2's, logits
    ~3 off, silently); with chunks of 2 of 3 members the second decode call crashed in
    torch.cat (1 row against 2)."""
    factory = lambda: CachedLM("attribute")  # noqa: E731
    decode_as_alone(*build(factory, chunk_size=chunk_size), "inference_mode")


# -- top-k sampling under randomness="same" ------------------------------------------------------


class TopKSampler(LLMBlock):
    """Next token by Gumbel-max over the top-k logits: a draw that does not depend on the
    member's parameters (torch.rand_like), picked with argmax and gather."""

    def __init__(self, k: int = 4, temperature: float = 0.8) -> None:
        super().__init__(attn="causal")
        self.topk, self.temperature = k, temperature

    def forward(self, tokens: Tensor) -> Tensor:  # type: ignore[override]
        logits = super().forward(tokens)[:, -1] / self.temperature
        vals, idx = torch.topk(logits, self.topk, dim=-1)
        gumbel = -torch.log(-torch.log(torch.rand_like(vals).clamp_min(1e-12)))
        pick = (vals + gumbel).argmax(-1, keepdim=True)
        return idx.gather(-1, pick)


class TopKMultinomial(TopKSampler):
    def forward(self, tokens: Tensor) -> Tensor:  # type: ignore[override]
        logits = LLMBlock.forward(self, tokens)[:, -1] / self.temperature
        vals, idx = torch.topk(logits, self.topk, dim=-1)
        pick = torch.multinomial(torch.softmax(vals, -1), 1)
        return idx.gather(-1, pick)


def sample_loop(m: Callable[[Tensor], Tensor], prompt: Tensor, steps: int) -> Tensor:
    seq = prompt
    for _ in range(steps):
        seq = torch.cat([seq, m(seq)], -1)
    return seq


@pytest.mark.usefixtures("float64_default")
@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])
def test_topk_gumbel_sampling_with_same_randomness_draws_as_each_member_alone(
    grad_mode: str,
) -> None:
    ens, alone = build(TopKSampler, randomness="same")
    ens.eval()
    prompt = tokens(3, t=2)
    ctx = getattr(torch, grad_mode)
    rng = torch.get_rng_state()
    with ctx():
        got = sample_loop(lambda s: ens(s, in_dims=0), prompt.expand(N, -1, -1).clone(), 5)
    after = torch.get_rng_state()
    for i, m in enumerate(alone):
        torch.set_rng_state(rng)
        with ctx():
            want = sample_loop(m.eval(), prompt, 5)
        assert torch.equal(got[i], want), f"member {i}"
        assert torch.equal(torch.get_rng_state(), after), "the RNG advanced otherwise than alone"


@pytest.mark.usefixtures("float64_default")
def test_topk_multinomial_sampling_in_turns_with_same_randomness_draws_as_alone() -> None:
    """docs: a multinomial of a member's own probabilities under "same" needs backend="loop",
    where each member draws what it draws alone."""
    ens, alone = build(TopKMultinomial, randomness="same", backend="loop")
    ens.eval()
    prompt = tokens(3, t=2)
    rng = torch.get_rng_state()
    with torch.inference_mode():
        got = sample_loop(lambda s: ens(s, in_dims=0), prompt.expand(N, -1, -1).clone(), 4)
    for i, m in enumerate(alone):
        torch.set_rng_state(rng)
        with torch.inference_mode():
            want = sample_loop(m.eval(), prompt, 4)
        assert torch.equal(got[i], want), f"member {i}"


@pytest.mark.usefixtures("float64_default")
def test_topk_multinomial_under_vmap_with_same_randomness_is_refused_changing_nothing() -> None:
    ens, _ = build(TopKMultinomial, randomness="same")
    ens.eval()
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    rng = torch.get_rng_state()
    with pytest.raises(Exception) as err, torch.no_grad():
        ens(tokens(3, t=2))
    text = str(err.value)
    assert "loop" in text or "different" in text, text
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k
    del rng


# -- nn.MultiheadAttention, sequence first, per-head weights --------------------------------------


class SeqFirstMHA(nn.Module):
    def __init__(self, causal: bool = True) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(D, H, batch_first=False)
        self.causal = causal
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(T))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        if self.causal:
            return self.mha(
                x, x, x, attn_mask=self.mask, is_causal=True, need_weights=True,
                average_attn_weights=False,
            )  # fmt: skip
        return self.mha(x, x, x, need_weights=True, average_attn_weights=False)


@pytest.mark.usefixtures("float64_default")
@pytest.mark.parametrize("causal", [True, False], ids=["causal-mask", "no-mask"])
@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode", "enable_grad"])
def test_seq_first_mha_per_head_weights_in_eval_match_alone(causal: bool, grad_mode: str) -> None:
    factory = lambda: SeqFirstMHA(causal)  # noqa: E731
    ens, alone = build(factory)
    ens.eval()
    x = torch.randn(T, B, D, generator=torch.Generator().manual_seed(1))
    with getattr(torch, grad_mode)():
        out, w = ens(x)
        outs = [m.eval()(x) for m in alone]
    assert w.shape == (N, B, H, T, T)
    torch.testing.assert_close(out, torch.stack([o for o, _ in outs]), **TOL)
    torch.testing.assert_close(w, torch.stack([a for _, a in outs]), **TOL)


@pytest.mark.usefixtures("float64_default")
def test_seq_first_mha_with_causal_mask_trains_as_alone() -> None:
    ens, alone = build(SeqFirstMHA)
    x = torch.randn(T, B, D, generator=torch.Generator().manual_seed(1))
    y = torch.randn(T, B, D, generator=torch.Generator().manual_seed(2))
    loss_fn = lambda out, t: F.mse_loss(out[0], t) + out[1].square().mean()  # noqa: E731
    step = vmapens.make_step(ens, loss_fn, vmapens.StackedAdam(ens, lr=0.02))
    opts = [torch.optim.Adam(m.parameters(), lr=0.02) for m in alone]
    for _ in range(3):
        loss = step(x, y)
        want = []
        for m, o in zip(alone, opts, strict=True):
            o.zero_grad()
            v = loss_fn(m(x), y)
            v.backward()
            o.step()
            want.append(v.detach())
        torch.testing.assert_close(loss, torch.stack(want), **TOL)
    # the key third of in_proj_bias: round-off gradient (docs/semantics.md): looser atol
    assert_members_equal(ens, alone, grads=True, rtol=1e-9, atol=1e-9)


# -- predict over a tied-embedding LM -------------------------------------------------------------


@pytest.mark.usefixtures("float64_default")
def test_predict_of_the_lm_equals_the_plain_average() -> None:
    factory = lambda: LLMBlock(attn="alibi", p=0.2)  # noqa: E731
    ens, alone = build(factory)
    x = tokens(9)
    got = vmapens.predict(ens, x, reduce="mean", softmax=True)
    with torch.no_grad():
        want = sum(torch.softmax(m.eval()(x), -1) for m in alone) / N
    torch.testing.assert_close(got, want, **TOL)
    assert ens.training  # mode restored
    assert math.isfinite(float(got.sum()))


# -- Meta's Llama reference code: complex RoPE, slice-assigned KV cache -------------------------


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].double() / dim))
    t = torch.arange(end, device=freqs.device).double()
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def reshape_for_broadcast(freqs_cis, x):
    ndim = x.ndim
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.double().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.double().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x, n_rep):
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (
        x[:, :, :, None, :]
        .expand(bs, slen, n_kv_heads, n_rep, head_dim)
        .reshape(bs, slen, n_kv_heads * n_rep, head_dim)
    )


class Llama(nn.Module):
    """Meta's Llama reference code, shrunk: complex RoPE (view_as_complex, polar), a KV
    cache written by slice assignment into buffers at `start_pos`, repeat_kv by expand."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.wq = nn.Linear(D, H * HD, bias=False)
        self.wk = nn.Linear(D, KV * HD, bias=False)
        self.wv = nn.Linear(D, KV * HD, bias=False)
        self.wo = nn.Linear(H * HD, D, bias=False)
        self.n1 = nn.RMSNorm(D, eps=1e-5)
        self.n2 = nn.RMSNorm(D, eps=1e-5)
        self.w1 = nn.Linear(D, 24, bias=False)
        self.w2 = nn.Linear(24, D, bias=False)
        self.w3 = nn.Linear(D, 24, bias=False)
        self.out = nn.Linear(D, V, bias=False)
        self.register_buffer("freqs_cis", precompute_freqs_cis(HD, 16), persistent=False)
        self.register_buffer("cache_k", torch.zeros(B, 16, KV, HD))
        self.register_buffer("cache_v", torch.zeros(B, 16, KV, HD))

    def forward(self, tokens, start_pos: int):
        bsz, seqlen = tokens.shape
        h = self.tok(tokens)
        freqs_cis = self.freqs_cis[start_pos : start_pos + seqlen]
        mask = None
        if seqlen > 1:
            mask = torch.full((seqlen, seqlen), float("-inf"))
            mask = torch.triu(mask, diagonal=1)
            mask = torch.hstack([torch.zeros((seqlen, start_pos)), mask]).type_as(h)
        x = self.n1(h)
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bsz, seqlen, H, HD)
        xk = xk.view(bsz, seqlen, KV, HD)
        xv = xv.view(bsz, seqlen, KV, HD)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        self.cache_k = self.cache_k.to(xq)
        self.cache_v = self.cache_v.to(xq)
        self.cache_k[:bsz, start_pos : start_pos + seqlen] = xk
        self.cache_v[:bsz, start_pos : start_pos + seqlen] = xv
        keys = self.cache_k[:bsz, : start_pos + seqlen]
        values = self.cache_v[:bsz, : start_pos + seqlen]
        keys = repeat_kv(keys, H // KV)
        values = repeat_kv(values, H // KV)
        xq = xq.transpose(1, 2)
        keys = keys.transpose(1, 2)
        values = values.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(HD)
        if mask is not None:
            scores = scores + mask
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        output = torch.matmul(scores, values)
        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        h = h + self.wo(output)
        x = self.n2(h)
        h = h + self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.out(h).float()


def llama_generate(
    m: Callable[..., Tensor], prompt: Tensor, steps: int
) -> tuple[Tensor, list[Tensor]]:
    seq, logits, pos = prompt, m(prompt, 0), prompt.shape[-1]
    seen = [logits]
    for _ in range(steps):
        nxt = logits.select(-2, -1).argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], -1)
        logits = m(nxt, pos)
        seen.append(logits)
        pos += 1
    return seq, seen


@pytest.mark.usefixtures("float64_default")
@pytest.mark.parametrize(
    "kw", [{}, {"chunk_size": 2}, {"backend": "loop"}], ids=["vmap", "chunks", "loop"]
)
def test_llama_reference_decoding_with_its_kv_cache_matches_each_member_alone(kw: dict) -> None:
    ens, alone = build(Llama, **kw)
    ens.eval()
    prompt = tokens(4, t=3)
    with torch.inference_mode():
        got, got_logits = llama_generate(
            lambda t, p: ens(t, p, in_dims=(0, None)), prompt.expand(N, -1, -1), 5
        )
        for i, m in enumerate(alone):
            want, want_logits = llama_generate(m.eval(), prompt, 5)
            for k, (a, b) in enumerate(zip(got_logits, want_logits, strict=True)):
                torch.testing.assert_close(a[i], b, **TOL, msg=f"member {i}, call {k}")
            assert torch.equal(got[i], want)
    for i, m in enumerate(alone):
        torch.testing.assert_close(ens[i].cache_k, m.cache_k, **TOL)
        torch.testing.assert_close(ens[i].cache_v, m.cache_v, **TOL)


# -- nanoGPT: SDPA or masked attention with dropout, loss in the forward, top-k sampling ----------

TG = 8


class CausalSelfAttention(nn.Module):
    def __init__(self, flash, dropout=0.1):
        super().__init__()
        self.c_attn = nn.Linear(D, 3 * D)
        self.c_proj = nn.Linear(D, D)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        self.dropout = dropout
        self.flash = flash
        if not self.flash:
            self.register_buffer("bias", torch.tril(torch.ones(TG, TG)).view(1, 1, TG, TG))

    def forward(self, x):
        Bb, Tt, C = x.size()
        q, k, v = self.c_attn(x).split(D, dim=2)
        k = k.view(Bb, Tt, H, C // H).transpose(1, 2)
        q = q.view(Bb, Tt, H, C // H).transpose(1, 2)
        v = v.view(Bb, Tt, H, C // H).transpose(1, 2)
        if self.flash:
            y = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=None,
                dropout_p=self.dropout if self.training else 0,
                is_causal=True,
            )
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :Tt, :Tt] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(Bb, Tt, C)
        return self.resid_dropout(self.c_proj(y))


class GPT(nn.Module):
    def __init__(self, flash=True, dropout=0.1):
        super().__init__()
        self.wte = nn.Embedding(V, D)
        self.wpe = nn.Embedding(TG, D)
        self.drop = nn.Dropout(dropout)
        self.ln_1 = nn.LayerNorm(D)
        self.attn = CausalSelfAttention(flash, dropout)
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, V, bias=False)
        self.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        x = x + self.attn(self.ln_1(x))
        x = self.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1
            )
        else:
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss


class Sampler(GPT):
    def forward(self, idx, temperature=1.0, top_k=3):
        idx_cond = idx if idx.size(1) <= TG else idx[:, -TG:]
        logits, _ = super().forward(idx_cond)
        logits = logits[:, -1, :] / temperature
        if top_k is not None:
            v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
            logits[logits < v[:, [-1]]] = -float("Inf")
        probs = F.softmax(logits, dim=-1)
        return torch.multinomial(probs, num_samples=1)


@pytest.mark.usefixtures("float64_default")
@pytest.mark.parametrize("flash", [True, False], ids=["sdpa", "manual"])
@pytest.mark.parametrize(
    "kw", [{}, {"chunk_size": 2}, {"backend": "loop"}], ids=["vmap", "chunks", "loop"]
)
def test_nanogpt_with_dropout_and_same_randomness_trains_as_each_member_alone(
    flash: bool, kw: dict
) -> None:
    factory = lambda: GPT(flash)  # noqa: E731
    ens, alone = build(factory, randomness="same", **kw)
    step = vmapens.make_step(ens, lambda out, y: out[1], vmapens.StackedAdam(ens, lr=0.01))
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in alone]
    for s in range(3):
        g = torch.Generator().manual_seed(s)
        x, y = torch.randint(V, (B, TG), generator=g), torch.randint(V, (B, TG), generator=g)
        rng = torch.get_rng_state()
        loss = step((x, y), y)
        after = torch.get_rng_state()
        want = []
        for m, o in zip(alone, opts, strict=True):
            torch.set_rng_state(rng)
            o.zero_grad()
            value = m(x, y)[1]
            value.backward()
            o.step()
            want.append(value.detach())
        assert torch.equal(torch.get_rng_state(), after)
        torch.testing.assert_close(loss, torch.stack(want), **TOL)
    assert_members_equal(ens, alone, grads=True, rtol=1e-9, atol=1e-9)


@pytest.mark.usefixtures("float64_default")
def test_nanogpt_topk_sampling_in_turns_with_same_randomness_draws_as_alone() -> None:
    ens, alone = build(Sampler, randomness="same", backend="loop")
    ens.eval()
    prompt = tokens(0, t=3)
    rng = torch.get_rng_state()
    with torch.no_grad():
        seq = prompt.expand(N, -1, -1)
        for _ in range(7):  # past TG: the context is cropped
            seq = torch.cat([seq, ens(seq, in_dims=0)], -1)
    for i, m in enumerate(alone):
        torch.set_rng_state(rng)
        s = prompt
        with torch.no_grad():
            for _ in range(7):
                s = torch.cat([s, m.eval()(s)], -1)
        assert torch.equal(s, seq[i]), f"member {i}"


@pytest.mark.usefixtures("float64_default")
def test_nanogpt_topk_masking_under_vmap_is_refused_naming_the_loop_and_changing_nothing() -> None:
    ens, _ = build(Sampler, randomness="same")
    ens.eval()
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    with pytest.raises(RuntimeError, match="backend='loop'"), torch.no_grad():
        ens(tokens(0, t=3))
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k


# -- per-member left padding with a bool mask -----------------------------------------------------


class PadAttn(LLMBlock):
    def forward(self, tokens: Tensor, pad: Tensor) -> Tensor:  # type: ignore[override]
        b, t = tokens.shape
        h = self.embed(tokens)
        q, k, v = self.heads(self.norm1(h))
        keep = ~pad[:, None, None, :] & self.causal[:t, :t]  # [B, 1, T, T]; some rows all False
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=self.kv_heads != H)
        a = a.transpose(1, 2).reshape(b, t, H * HD)
        return self.head(self.norm_f(h + self.o(a)))


@pytest.mark.usefixtures("float64_default")
@pytest.mark.parametrize("kv_heads", [H, KV], ids=["mha", "gqa"])
@pytest.mark.parametrize(
    "kw", [{}, {"chunk_size": 2}, {"backend": "loop"}], ids=["vmap", "chunks", "loop"]
)
def test_per_member_left_padding_masks_match_each_member_alone(kv_heads: int, kw: dict) -> None:
    factory = lambda: PadAttn(kv_heads=kv_heads)  # noqa: E731
    ens, alone = build(factory, **kw)
    xs = torch.stack([tokens(i) for i in range(N)])
    pads = torch.zeros(N, B, T, dtype=torch.bool)
    pads[0, 0, :2] = pads[1, 1, :3] = pads[2, 0, :1] = True
    for ctx in (torch.no_grad, torch.enable_grad):
        with ctx():
            got = ens(xs, pads, in_dims=0)
            want = torch.stack([m(x, p) for m, x, p in zip(alone, xs, pads, strict=True)])
        torch.testing.assert_close(got, want, **TOL, equal_nan=True)


class CausalHintOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(D, H)

    def forward(self, x: Tensor) -> Tensor:
        return self.mha(x, x, x, is_causal=True, need_weights=True, average_attn_weights=False)[0]


@pytest.mark.usefixtures("float64_default")
def test_mha_is_causal_without_a_mask_is_refused_with_torchs_words_changing_nothing() -> None:
    x = torch.randn(T, B, D, generator=torch.Generator().manual_seed(1))
    with pytest.raises(RuntimeError, match="Need attn_mask"):
        CausalHintOnly()(x)  # alone
    ens, _ = build(CausalHintOnly)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    with pytest.raises(RuntimeError, match="Need attn_mask"):
        ens(x)
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedAdam(ens, lr=0.1))
    with pytest.raises(RuntimeError, match="Need attn_mask"):
        step(x, x)
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k
