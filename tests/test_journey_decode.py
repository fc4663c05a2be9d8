"""User journey: an ensemble of tiny autoregressive character models, trained, then decoded.

The script a researcher writes from README.md and docs/: 3 members (an embedding + `nn.GRU`, or a
1-layer causal `nn.TransformerEncoder` with a causal mask, + a Linear head; vocab 12, sequences
of 8, float64) trained with teacher forcing and `nn.CrossEntropyLoss(ignore_index=PAD)` over the
(batch * seq) logits, viewed flat inside the loss (`make_step` and a hand-written loop with
`per_member`); then generation under `torch.no_grad()` / `ens.eval()`: greedy decoding step by
step, each member fed its own previous tokens (`in_dims=0`, integer tokens); a GRU state passed
in and out of the forward; a key/value cache kept on the module as a plain attribute or in
buffers (docs/semantics.md: a forward's state in plain attributes lives once on the module all
members run, a reassigned buffer is written into the member's row); sampling with
`torch.multinomial` / `Categorical` at a per-member temperature (docs/semantics.md,
"Randomness": `randomness="same"` draws what each member draws alone from the same RNG state);
top-k / beam search with `torch.topk`. The truth: each member a plain module built from its
documented seed (tests/truth.py), trained alone with `torch.optim.Adam` on the same batches and
decoded alone by the same plain-PyTorch code.
"""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call
from truth import assert_members_equal, factory_members

import vmapens

pytestmark = pytest.mark.usefixtures("float64_default")

N, V, PAD, BOS, T, B, D = 3, 12, 0, 1, 8, 4, 8
LRS = [0.01, 0.03, 0.02]
TOL: dict[str, Any] = dict(rtol=1e-9, atol=1e-10)
CE = nn.CrossEntropyLoss(ignore_index=PAD)


class GruLM(nn.Module):
    """Embedding -> GRU -> Linear; the state goes in and comes out explicitly."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 6, padding_idx=PAD)
        self.gru = nn.GRU(6, D, batch_first=True)
        self.head = nn.Linear(D, V)

    def forward(self, tokens: Tensor, h: Tensor | None = None) -> tuple[Tensor, Tensor]:
        out, h = self.gru(self.emb(tokens), h)
        return self.head(out), h


class CausalLM(nn.Module):
    """Token + position embeddings -> 1-layer causal TransformerEncoder -> Linear."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D, padding_idx=PAD)
        self.pos = nn.Embedding(T, D)
        layer = nn.TransformerEncoderLayer(D, 2, 16, dropout=dropout, batch_first=True)
        self.body = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(D, V)

    def forward(self, tokens: Tensor) -> Tensor:
        t = tokens.shape[-1]
        h = self.emb(tokens) + self.pos(torch.arange(t))
        mask = nn.Transformer.generate_square_subsequent_mask(t, dtype=h.dtype)
        return self.head(self.body(h, mask=mask, is_causal=True))


def flat_ce(out: Any, y: Tensor) -> Tensor:
    """Next-token cross entropy of one member over (batch * seq), its logits viewed flat."""
    logits = out[0] if isinstance(out, tuple) else out
    return CE(logits.view(-1, V), y.view(-1))


def corpus(g: torch.Generator, *lead: int) -> tuple[Tensor, Tensor]:
    """Teacher-forcing pairs: BOS + characters, padded after a random length; the targets are
    the inputs shifted by one (PAD, ignored, after the end)."""
    seq = torch.randint(2, V, (*lead, B, T + 1), generator=g)
    seq[..., 0] = BOS
    lengths = torch.randint(3, T + 2, (*lead, B), generator=g)
    seq[torch.arange(T + 1) >= lengths.unsqueeze(-1)] = PAD
    return seq[..., :-1].contiguous(), seq[..., 1:].contiguous()


def batches(count: int, per_member: bool) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [corpus(g, *((N,) if per_member else ())) for _ in range(count)]


def trained_alone(factory: Callable[[], nn.Module], data: list, per_member: bool) -> list:
    """Each member from its documented seed, trained alone with torch.optim.Adam."""
    models = factory_members([factory] * N, seed=0)
    for i, m in enumerate(models):
        opt = torch.optim.Adam(m.parameters(), lr=LRS[i])
        for x, y in data:
            x, y = (x[i], y[i]) if per_member else (x, y)
            opt.zero_grad()
            flat_ce(m(x), y).backward()
            opt.step()
    return models


def trained_together(
    factory: Callable[[], nn.Module], data: list, per_member: bool, how: str = "step", **kw: Any
) -> vmapens.Ensemble:
    ens = vmapens.Ensemble(factory, n=N, seed=0, **kw)
    opt = vmapens.StackedAdam(ens, lr=LRS)
    if how == "step":
        step = vmapens.make_step(ens, flat_ce, opt, in_dims=0 if per_member else None)
        for x, y in data:
            step(x, y)
        return ens
    loss = vmapens.per_member(flat_ce, in_dims=(0, 0 if per_member else None))
    for x, y in data:  # the hand-written loop of README.md
        out = ens(x, in_dims=0) if per_member else ens(x)
        losses = loss(out, y)
        opt.zero_grad()
        losses.sum().backward()
        opt.step()
    return ens


def assert_members(ens: vmapens.Ensemble, models: list[nn.Module]) -> None:
    assert_members_equal(ens, models, **TOL)


# -- training: teacher forcing, the logits viewed flat inside the loss ---------------------------


@pytest.mark.parametrize("how", ["step", "by_hand"])
@pytest.mark.parametrize(
    ("factory", "per_member"), [(GruLM, True), (CausalLM, False)], ids=["gru-own", "causal-shared"]
)
def test_teacher_forcing_with_flat_logits_matches_alone(factory, per_member, how) -> None:
    data = batches(3, per_member)
    assert_members(
        trained_together(factory, data, per_member, how), trained_alone(factory, data, per_member)
    )


# -- decoding: plain PyTorch for one member, and the same loop over the ensemble -----------------


def logits_of(out: Any) -> Tensor:
    return out[0] if isinstance(out, tuple) else out


def greedy_alone(m: nn.Module, prompt: Tensor, steps: int) -> Tensor:
    """Greedy decoding, the whole prefix fed again at every step."""
    seq = prompt
    for _ in range(steps):
        nxt = logits_of(m(seq))[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], -1)
    return seq


def greedy_together(ens: vmapens.Ensemble, prompts: Tensor, steps: int) -> Tensor:
    """The same loop, each member fed its own tokens: prompts and outputs [n, B, t]."""
    seq = prompts
    for _ in range(steps):
        nxt = logits_of(ens(seq, in_dims=0))[:, :, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], -1)
    return seq


def prompts(lead: tuple[int, ...] = (N,), length: int = 2, rows: int = B) -> Tensor:
    g = torch.Generator().manual_seed(11)
    p = torch.randint(2, V, (*lead, rows, length), generator=g)
    p[..., 0] = BOS
    return p


@pytest.mark.parametrize("factory", [GruLM, CausalLM], ids=["gru", "causal"])
def test_greedy_decoding_on_own_tokens_matches_each_member_alone(factory) -> None:
    data = batches(2, per_member=False)
    ens, alone = trained_together(factory, data, False), trained_alone(factory, data, False)
    p = prompts()
    ens.eval()
    with torch.no_grad():
        got = greedy_together(ens, p, T - 2)
        for i, m in enumerate(alone):
            assert torch.equal(got[i], greedy_alone(m.eval(), p[i], T - 2)), f"member {i}"
        for i, m in enumerate(ens.unstack()):  # the documented way to use members alone
            assert not m.training
            assert torch.equal(got[i], greedy_alone(m, p[i], T - 2)), f"unstacked member {i}"


def test_dropout_lm_trained_with_same_randomness_then_decoded_in_eval_matches_alone() -> None:
    """docs/semantics.md: with `randomness="same"` each member draws the dropout masks it draws
    alone from the same RNG state; in eval mode nothing is drawn."""
    data, factory = batches(2, per_member=False), lambda: CausalLM(dropout=0.2)
    ens = vmapens.Ensemble(factory, n=N, seed=0, randomness="same")
    step = vmapens.make_step(ens, flat_ce, vmapens.StackedAdam(ens, lr=LRS))
    torch.manual_seed(3)
    for x, y in data:
        step(x, y)
    alone = factory_members([factory] * N, seed=0)
    opts = [torch.optim.Adam(m.parameters(), lr=lr) for m, lr in zip(alone, LRS, strict=True)]
    torch.manual_seed(3)
    for x, y in data:
        state = torch.get_rng_state()
        for m, opt in zip(alone, opts, strict=True):
            torch.set_rng_state(state)  # every member from the same RNG state
            opt.zero_grad()
            flat_ce(m(x), y).backward()
            opt.step()
    assert_members(ens, alone)
    p = prompts()
    with torch.no_grad():
        got = greedy_together(ens.eval(), p, T - 2)
    for i, m in enumerate(alone):
        with torch.no_grad():
            assert torch.equal(got[i], greedy_alone(m.eval(), p[i], T - 2)), f"member {i}"


# -- a recurrent state passed in and out of the forward -----------------------------------------


def gru_alone(m: nn.Module, prompt: Tensor, steps: int) -> tuple[Tensor, Tensor]:
    logits, h = m(prompt)  # the prompt in one call, then one token a call with the state
    toks = []
    for _ in range(steps):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        toks.append(nxt)
        logits, h = m(nxt, h)
    return torch.cat(toks, -1), h


@pytest.mark.parametrize("first", ["default", "none"])
def test_gru_state_in_and_out_matches_alone(first: str) -> None:
    data = batches(2, per_member=True)
    ens, alone = trained_together(GruLM, data, True), trained_alone(GruLM, data, True)
    p = prompts()
    with torch.no_grad():
        # h left out (the forward's default) or given as None in a mapped place (docs: a None
        # in a mapped argument reaches every member as None)
        logits, h = ens(p, in_dims=0) if first == "default" else ens(p, None, in_dims=(0, 0))
        toks = []
        for _ in range(5):
            nxt = logits[:, :, -1].argmax(-1, keepdim=True)
            toks.append(nxt)
            logits, h = ens(nxt, h, in_dims=0)
        got = torch.cat(toks, -1)
        assert h.shape == (N, 1, B, D)
        for i, m in enumerate(alone):
            want, h_i = gru_alone(m, p[i], 5)
            assert torch.equal(got[i], want), f"member {i}"
            torch.testing.assert_close(h[i], h_i, **TOL)


# -- a key/value cache kept on the module --------------------------------------------------------


class CachedLM(nn.Module):
    """One causal attention layer that keeps its keys and values from call to call: as plain
    attributes that grow (`self.k = torch.cat(...)`), or in fixed-size buffers with a length
    buffer (slots written by a one-hot matmul, the buffers reassigned). `start=True` begins a
    new sequence."""

    def __init__(self, where: str = "attribute") -> None:
        super().__init__()
        self.where = where
        self.emb, self.pos = nn.Embedding(V, D), nn.Embedding(T, D)
        self.qkv, self.head = nn.Linear(D, 3 * D), nn.Linear(D, V)
        if where == "attribute":
            self.k: Tensor | None = None
            self.v: Tensor | None = None
        else:
            self.register_buffer("k", torch.zeros(B, T, D))
            self.register_buffer("v", torch.zeros(B, T, D))
            self.register_buffer("length", torch.zeros((), dtype=torch.long))

    def forward(self, tokens: Tensor, start: bool) -> Tensor:
        t = tokens.shape[-1]
        if self.where == "attribute":
            past: Any = 0 if start or self.k is None else self.k.shape[-2]
        else:
            if start:
                self.length.zero_()
            past = self.length
        where = past + torch.arange(t)  # absolute positions of the new tokens
        h = self.emb(tokens) + self.pos(where)
        q, k, v = self.qkv(h).chunk(3, -1)
        if self.where == "attribute":
            self.k = k if past == 0 else torch.cat([self.k, k], -2)
            self.v = v if past == 0 else torch.cat([self.v, v], -2)
            keys, values, slots = self.k, self.v, torch.arange(self.k.shape[-2])
        else:
            slots = torch.arange(T)
            onehot = (slots[:, None] == where[None, :]).to(k.dtype)  # [T, t]
            keep = 1 - onehot.sum(-1, keepdim=True)
            self.k = self.k * keep + onehot @ k
            self.v = self.v * keep + onehot @ v
            self.length = self.length + t
            keys, values = self.k, self.v
        scores = q @ keys.transpose(-1, -2) / D**0.5
        scores = scores.masked_fill(slots[None, :] > where[:, None], float("-inf"))
        return self.head(torch.softmax(scores, -1) @ values)


def cached_alone(m: nn.Module, prompt: Tensor, steps: int) -> Tensor:
    seq, logits = prompt, m(prompt, True)
    for _ in range(steps):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], -1)
        logits = m(nxt, False)
    return seq


def cached_together(ens: vmapens.Ensemble, prompts: Tensor, steps: int) -> Tensor:
    seq, logits = prompts, ens(prompts, True, in_dims=(0, None))
    for _ in range(steps):
        nxt = logits[:, :, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], -1)
        logits = ens(nxt, False, in_dims=(0, None))
    return seq


@pytest.mark.parametrize("where", ["attribute", "buffer"])
def test_kv_cache_decoding_twice_matches_alone(where: str) -> None:
    """docs/semantics.md: state a forward keeps in plain attributes lives once on the module all
    members run, set once per call by one vmapped run, as alone; a reassigned buffer is written
    into the member's row of the stacked storage."""
    factory = lambda: CachedLM(where)  # noqa: E731
    ens = vmapens.Ensemble(factory, n=N, seed=0)
    alone = factory_members([factory] * N, seed=0)
    ens.eval()
    with torch.no_grad():
        for length in (2, 3):  # two sequences in a row: the second starts afresh
            p = prompts(length=length)
            got = cached_together(ens, p, T - length)
            for i, m in enumerate(alone):
                # the cached sequence is the one recomputed from scratch (the cache is right)
                fresh = greedy_alone(lambda s, m=m: m(s, True), p[i], T - length)
                assert torch.equal(got[i], fresh), f"member {i}"
                assert torch.equal(got[i], cached_alone(m, p[i], T - length)), f"member {i}"
    for i, m in enumerate(alone):
        kept = ens[i]
        if where == "buffer":  # the member's own cache rows, as alone
            torch.testing.assert_close(kept.k, m.k, **TOL)
            assert kept.length == m.length == T
        else:  # docs: a tensor the forward keeps is member i's own in ens[i], as alone
            torch.testing.assert_close(kept.k, m.k, **TOL)
            torch.testing.assert_close(kept.v, m.v, **TOL)


# -- sampling at a per-member temperature --------------------------------------------------------


class Sampler(GruLM):
    """The GRU model's next token drawn in its forward at a given temperature."""

    def __init__(self, draw: str = "multinomial") -> None:
        super().__init__()
        self.draw = draw

    def forward(self, tokens: Tensor, h: Tensor | None, temperature: Tensor) -> Any:  # type: ignore[override]
        logits, h = super().forward(tokens, h)
        probs = torch.softmax(logits[:, -1] / temperature, -1)
        if self.draw == "multinomial":
            nxt = torch.multinomial(probs, 1)
        else:
            nxt = torch.distributions.Categorical(probs=probs).sample().unsqueeze(-1)
        return nxt, h


TEMPS = torch.tensor([0.5, 1.0, 2.0])


def sample_alone(m: nn.Module, prompt: Tensor, temperature: Tensor, steps: int) -> Tensor:
    nxt, h = m(prompt, None, temperature)
    toks = [nxt]
    for _ in range(steps - 1):
        nxt, h = m(nxt, h, temperature)
        toks.append(nxt)
    return torch.cat(toks, -1)


def sample_together(ens: vmapens.Ensemble, prompts: Tensor, temps: Tensor, steps: int) -> Tensor:
    nxt, h = ens(prompts, None, temps, in_dims=0)
    toks = [nxt]
    for _ in range(steps - 1):
        nxt, h = ens(nxt, h, temps, in_dims=0)
        toks.append(nxt)
    return torch.cat(toks, -1)


@pytest.mark.parametrize("draw", ["multinomial", "categorical"])
def test_sampling_with_same_randomness_in_turns_draws_each_members_own_tokens(draw: str) -> None:
    """`backend="loop"` with `randomness="same"`: each member draws what it draws alone from
    the same RNG state, call after call (docs/semantics.md, "Randomness")."""
    factory = lambda: Sampler(draw)  # noqa: E731
    ens = vmapens.Ensemble(factory, n=N, seed=0, randomness="same", backend="loop")
    alone, p = factory_members([factory] * N, seed=0), prompts()
    with torch.no_grad():
        torch.manual_seed(5)
        got = sample_together(ens.eval(), p, TEMPS, 6)
        after = torch.get_rng_state()
        for i, m in enumerate(alone):
            torch.manual_seed(5)
            assert torch.equal(got[i], sample_alone(m.eval(), p[i], TEMPS[i], 6)), f"member {i}"
            assert torch.equal(torch.get_rng_state(), after)  # the RNG advanced as by one


@pytest.mark.parametrize("draw", ["multinomial", "categorical"])
def test_sampling_with_different_randomness_is_greedy_when_cold(draw: str) -> None:
    """Under vmap each member draws its own numbers (in distribution only); at a temperature
    near 0 every draw is the argmax, so each member's sequence is its greedy one alone."""
    factory = lambda: Sampler(draw)  # noqa: E731
    ens = vmapens.Ensemble(factory, n=N, seed=0)
    alone, p = factory_members([factory] * N, seed=0), prompts()
    with torch.no_grad():
        hot = sample_together(ens, p, TEMPS, 6)
        assert hot.shape == (N, B, 6) and hot.dtype == torch.int64
        assert int(hot.min()) >= 0 and int(hot.max()) < V
        cold = sample_together(ens, p, torch.full((N,), 1e-9), 6)
        for i, m in enumerate(alone):
            plain = GruLM()
            plain.load_state_dict(m.state_dict())
            want, _ = gru_alone(plain, p[i], 6)
            assert torch.equal(cold[i], want), f"member {i}"


def test_batched_sampling_with_same_randomness_under_vmap_is_refused_with_its_way_out() -> None:
    """docs/semantics.md: vmap cannot draw `randomness="same"` from each member's own
    probabilities; refused naming the setting and the ways out (backend='loop' is exact, above)."""
    ens = vmapens.Ensemble(Sampler, n=N, seed=0, randomness="same")
    with torch.no_grad(), pytest.raises(RuntimeError) as err:
        ens(prompts(), None, TEMPS, in_dims=0)
    msg = str(err.value)
    assert "randomness='same'" in msg and "randomness='different'" in msg, msg
    assert "backend='loop'" in msg and "in-place" not in msg, msg


# -- beam search with torch.topk, inside one call per step and all in one map -------------------


def beam_search(call: Callable[[Tensor], Tensor], prompt: Tensor, beams: int, steps: int) -> Any:
    """prompt [t] -> the best `beams` sequences [beams, t + steps] and their log-probs."""
    seqs, scores = prompt[None], torch.zeros(1)
    for _ in range(steps):
        logp = torch.log_softmax(call(seqs)[:, -1], -1) + scores[:, None]
        scores, idx = torch.topk(logp.flatten(), beams)
        seqs = torch.cat([seqs[idx // V], (idx % V)[:, None]], -1)
    return seqs, scores


def test_beam_search_with_topk_in_a_member_map_matches_alone() -> None:
    data = batches(2, per_member=False)
    ens = trained_together(CausalLM, data, False).eval()
    alone = trained_alone(CausalLM, data, False)
    p = prompts(rows=1)[:, 0]  # one prompt per member, [n, t]

    def member(state: dict[str, Tensor], prompt: Tensor) -> Any:
        return beam_search(lambda s: functional_call(ens.runner, state, (s,)), prompt, 3, 4)

    with torch.no_grad():
        seqs, scores = ens.map_members(member, p, in_dims=0)
        for i, m in enumerate(alone):
            want_seqs, want_scores = beam_search(m.eval(), p[i], 3, 4)
            assert torch.equal(seqs[i], want_seqs), f"member {i}"
            torch.testing.assert_close(scores[i], want_scores, **TOL)


def test_stopping_at_an_end_token_inside_the_map_is_refused_naming_the_loop_backend() -> None:
    """A Python `if` on the members' tokens cannot run batched (docs/semantics.md)."""
    ens = vmapens.Ensemble(CausalLM, n=N, seed=0).eval()

    def member(state: dict[str, Tensor], prompt: Tensor) -> Tensor:
        seq = prompt
        for _ in range(4):
            nxt = functional_call(ens.runner, state, (seq,))[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], -1)
            if (nxt == PAD).all():
                break
        return seq

    with torch.no_grad(), pytest.raises(RuntimeError, match="cannot be batched.*backend='loop'"):
        ens.map_members(member, prompts(), in_dims=0)


# -- truncated backpropagation through time: the state carried between chunks, detached ----------


@pytest.mark.parametrize("how", ["step", "by_hand"])
def test_truncated_bptt_with_the_state_carried_between_chunks_matches_alone(how: str) -> None:
    g = torch.Generator().manual_seed(3)
    stream = torch.randint(2, V, (N, B, 3 * 4 + 1), generator=g)  # one stream per member
    chunks = [
        (stream[..., k : k + 4].contiguous(), stream[..., k + 1 : k + 5].contiguous())
        for k in range(0, 12, 4)
    ]
    alone = factory_members([GruLM] * N, seed=0)
    for i, m in enumerate(alone):
        opt, h = torch.optim.Adam(m.parameters(), lr=LRS[i]), None
        for x, y in chunks:
            opt.zero_grad()
            out = m(x[i], h)
            flat_ce(out, y[i]).backward()
            opt.step()
            h = out[1].detach()
    ens = vmapens.Ensemble(GruLM, n=N, seed=0)
    opt, h = vmapens.StackedAdam(ens, lr=LRS), None
    if how == "step":
        step = vmapens.make_step(ens, flat_ce, opt, in_dims=0)
        for x, y in chunks:
            with torch.no_grad():
                h_next = ens(x, h, in_dims=0)[1]  # the state this chunk hands on, before the step
            step((x, h), y)
            h = h_next
    else:
        loss = vmapens.per_member(flat_ce, in_dims=(0, 0))
        for x, y in chunks:
            out = ens(x, h, in_dims=0)
            opt.zero_grad()
            loss(out, y).sum().backward()
            opt.step()
            h = out[1].detach()
    assert_members(ens, alone)


# -- the ensemble as one model: decoding from the members' averaged distribution ----------------


def test_decoding_from_the_averaged_distribution_with_predict_matches_the_plain_average() -> None:
    data = batches(2, per_member=False)
    ens, alone = trained_together(CausalLM, data, False), trained_alone(CausalLM, data, False)
    seq = prompts(lead=())
    want = seq
    for _ in range(T - 2):
        seq = torch.cat([seq, vmapens.predict(ens, seq, reduce="mean", softmax=True)[:, -1]
                         .argmax(-1, keepdim=True)], -1)  # fmt: skip
        with torch.no_grad():
            probs = sum(torch.softmax(m.eval()(want), -1) for m in alone) / N
        want = torch.cat([want, probs[:, -1].argmax(-1, keepdim=True)], -1)
    assert torch.equal(seq, want)
    assert ens.training  # predict gives the mode back


def fork_of(ens: vmapens.Ensemble, how: str) -> object:
    """The ensemble copied or written mid-generation, as a user does."""
    if how == "deepcopy":
        return copy.deepcopy(ens)
    if how == "select":
        return ens.select([0, 2])
    if how == "copy":
        return copy.copy(ens)
    if how == "pickle":
        return pickle.loads(pickle.dumps(ens))
    buffer = io.BytesIO()
    torch.save(ens, buffer)  # "torch.save"
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("fork", ["deepcopy", "select", "copy", "pickle", "torch.save"])
def test_copying_the_ensemble_mid_generation_keeps_its_attribute_cache(fork: str) -> None:
    factory = lambda: CachedLM("attribute")  # noqa: E731
    ens = vmapens.Ensemble(factory, n=N, seed=0).eval()
    alone = factory_members([factory] * N, seed=0)
    p = prompts(length=2)
    with torch.no_grad():
        got = ens(p, True, in_dims=(0, None))
        want = [m(p[i], True) for i, m in enumerate(alone)]
        for k in range(4):
            if k == 2:  # fork the run (a copy, or a sub-ensemble), then go on with the original
                copies = [copy.deepcopy(m) for m in alone]  # alone: the original keeps its cache
                assert len(copies) == N
                kept = fork_of(ens, fork)
                assert kept is not ens
            got = ens(got[:, :, -1].argmax(-1, keepdim=True), False, in_dims=(0, None))
            want = [
                m(w[:, -1].argmax(-1, keepdim=True), False)
                for m, w in zip(alone, want, strict=True)
            ]
    for i in range(N):
        torch.testing.assert_close(got[i], want[i], **TOL, msg=f"member {i}")
