"""User journey: attention layers at their edges, each member against itself alone.

vmapens re-classes every ``nn.MultiheadAttention`` it runs to its own twin (``vmapens/_mha.py``)
and batches CPU attention with its own rule (``vmapens/_attention.py``), so the corners of
torch's attention are the library's own code. A researcher's attention zoo, float64, 3 members:
``kdim``/``vdim``, ``bias=False``, ``add_bias_kv``, ``add_zero_attn``, bool and float key
padding masks (``-inf`` and finite values, a query whose every key is masked), 2-D and per-head
3-D attention masks, attention weights averaged and per head, sequence-first input,
``is_causal`` with its mask, dropout in training (``randomness="same"``: each member draws what
it draws alone, docs/semantics.md) and in eval; ``nn.TransformerEncoderLayer`` with
``norm_first``, ``"gelu"``, a callable activation and ``bias=False``; ``nn.TransformerEncoder``
with nested tensors and a padding mask, in training and in eval (torch's fast path alone);
``nn.TransformerDecoder`` with every mask; ``F.multi_head_attention_forward`` called directly; a
causal mask kept as a buffer, which torch inspects (refused under vmap, with the ways out).

The truth: each member a plain module: its forward (outputs and attention weights) and
gradients under ``backend="vmap"``, ``chunk_size=2`` and ``backend="loop"``, and two
``torch.optim.Adam`` steps next to ``make_step`` with ``StackedAdam``.

Found here: a ``nn.Dropout`` after self-attention drew another mask than the member alone with
``randomness="same"`` (the twin's output was laid out otherwise than torch's; patch mhaedges-1).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from models import Zoo
from torch import Tensor, nn

import vmapens

N, B, L, S, E, H = 3, 2, 4, 5, 8, 2
F64 = torch.float64
# float64; the key third of `in_proj_bias` has a true gradient of 0 and Adam steps on its
# round-off (docs/semantics.md, ~1e-11 after 2 steps here): hence atol 1e-9 on parameters.
TOL: dict[str, Any] = dict(rtol=1e-9, atol=1e-9)
BACKENDS = [{}, {"chunk_size": 2}, {"backend": "loop"}]
IDS = ["vmap", "chunks", "loop"]

_g = torch.Generator().manual_seed(0)


def _randn(*shape: int) -> Tensor:
    return torch.randn(*shape, generator=_g, dtype=F64)


X, Y = _randn(B, L, E), _randn(B, L, E)
PAD = torch.tensor([[False, False, True, True], [False, False, False, True]])
FULL_PAD = torch.tensor([[True, True, True, True], [False, False, False, True]])
FLOAT_PAD = torch.zeros(B, L, dtype=F64)
FLOAT_PAD[0, 2:] = float("-inf")
FLOAT_PAD[1, 1], FLOAT_PAD[1, 3] = -2.5, 0.7
CAUSAL = torch.ones(L, L, dtype=torch.bool).triu(1)
CAUSAL_F = nn.Transformer.generate_square_subsequent_mask(L, dtype=F64)
HEAD_MASK = _randn(B * H, L, L)  # 3-D: one mask per (batch, head)
HEAD_BOOL = (_randn(B * H, L, L) > 0) & ~torch.eye(L, dtype=torch.bool)  # True = masked
MEMORY_MASK = _randn(L, S)
MEMORY_PAD = torch.tensor([[False] * 4 + [True], [False] * 5])


class Attn(nn.Module):
    """``nn.MultiheadAttention`` called with ``call``; the weights (if any) joined to the output."""

    def __init__(self, call: dict[str, Any], cross: bool = False, **kw: Any) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(E, H, **kw)
        self.call, self.cross, self.kw = call, cross, kw

    def forward(self, x: Tensor) -> Tensor:
        bf = self.kw.get("batch_first", False)
        q = x if bf else x.transpose(0, 1)
        k = v = q
        if self.cross:  # other inputs for key and value (kdim / vdim)
            k, v = q[..., : self.kw["kdim"]], q[..., -self.kw["vdim"] :].sin()
        out, w = self.mha(q, k, v, **self.call)
        out = out if bf else out.transpose(0, 1)
        return out.flatten(1) if w is None else torch.cat([out.flatten(1), w.flatten(1)], 1)


class TwoCalls(nn.Module):
    """One layer called twice, with weights and without (torch's two code paths)."""

    def __init__(self, call: dict[str, Any], **kw: Any) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(E, H, batch_first=True, **kw)
        self.call = call

    def forward(self, x: Tensor) -> Tensor:
        a, _ = self.mha(x, x, x, need_weights=False, **self.call)
        b, w = self.mha(x, x, x, average_attn_weights=False, **self.call)
        return torch.cat([a.flatten(1), b.flatten(1), w.flatten(1)], 1)


class Raw(nn.Module):
    """``F.multi_head_attention_forward`` called directly, with its own parameters."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(3 * E, E) * 0.3)  # unused: separate projections
        self.b_in = nn.Parameter(torch.randn(3 * E) * 0.1)
        self.q, self.k, self.v = (nn.Parameter(torch.randn(E, E) * 0.3) for _ in range(3))
        self.bias_k, self.bias_v = (
            nn.Parameter(torch.randn(1, 1, E)),
            nn.Parameter(torch.randn(1, 1, E)),
        )
        self.out = nn.Linear(E, E)
        self.dropout = dropout

    def forward(self, x: Tensor) -> Tensor:
        q = x.transpose(0, 1)
        out, w = F.multi_head_attention_forward(
            q, q, q, E, H, self.w_in, self.b_in, self.bias_k, self.bias_v, True, self.dropout,
            self.out.weight, self.out.bias, training=self.training, key_padding_mask=FLOAT_PAD,
            attn_mask=HEAD_MASK, use_separate_proj_weight=True, q_proj_weight=self.q,
            k_proj_weight=self.k, v_proj_weight=self.v, average_attn_weights=False,
        )  # fmt: skip
        return torch.cat([out.transpose(0, 1).flatten(1), w.flatten(1)], 1)


def _tanh_gelu(t: Tensor) -> Tensor:
    return F.gelu(t, approximate="tanh")


class EncoderLayer(nn.Module):
    def __init__(self, call: dict[str, Any], **kw: Any) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=6, **kw)
        self.call, self.bf = call, kw.get("batch_first", False)

    def forward(self, x: Tensor) -> Tensor:
        h = x if self.bf else x.transpose(0, 1)
        out = self.layer(h, **self.call)
        return (out if self.bf else out.transpose(0, 1)).flatten(1)


class Encoder(nn.Module):
    def __init__(self, nested: bool, call: dict[str, Any], dropout: float = 0.0) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(E, H, 6, dropout=dropout, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested)
        self.call = call

    def forward(self, x: Tensor) -> Tensor:
        return self.enc(x, **self.call)


class Decoder(nn.Module):
    def __init__(self, dropout: float = 0.0, **kw: Any) -> None:
        super().__init__()
        layer = nn.TransformerDecoderLayer(E, H, 6, dropout=dropout, batch_first=True, **kw)
        self.dec = nn.TransformerDecoder(layer, 2, norm=nn.LayerNorm(E))

    def forward(self, x: Tensor) -> Tensor:
        memory = torch.cat([x, x[:, :1]], 1).sin()  # S = L + 1 rows
        out = self.dec(
            x,
            memory,
            tgt_mask=CAUSAL_F,
            memory_mask=MEMORY_MASK,
            tgt_key_padding_mask=FLOAT_PAD.clamp(min=-3.0),  # float masks throughout
            memory_key_padding_mask=torch.where(MEMORY_PAD, -1e9, 0.0).to(F64),
            tgt_is_causal=True,
        )
        return out.flatten(1)


class AttnThenDropout(nn.Module):
    """The common block: attention without its own dropout, then ``nn.Dropout`` on the residual."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(E, H, batch_first=batch_first)
        self.drop = nn.Dropout(0.5)
        self.bf = batch_first

    def forward(self, x: Tensor) -> Tensor:
        h = x if self.bf else x.transpose(0, 1)
        a = self.mha(h, h, h, need_weights=False)[0]
        return x + self.drop(a if self.bf else a.transpose(0, 1))


# -- the truth and the comparison ------------------------------------------------------------


def _members(factory: Callable[[], nn.Module], train: bool = True) -> list[nn.Module]:
    out = []
    for k in range(N):
        torch.manual_seed(k)
        out.append(factory().double().train(train))
    return out


def _ensemble(members: list[nn.Module], opts: dict, same: bool) -> vmapens.Ensemble:
    randomness = "same" if same else "different"
    return vmapens.Ensemble.from_modules(members, randomness=randomness, **opts)


def _forward_and_grads(factory: Callable[[], nn.Module], x: Tensor, opts: dict, same: bool) -> None:
    """Outputs (weights included) and gradients of one call equal each member's alone."""
    members = _members(factory)
    y = torch.zeros_like(members[0](x))
    ens = _ensemble(copy.deepcopy(members), opts, same)
    torch.manual_seed(7)
    out = ens(x)
    vmapens.per_member(F.mse_loss)(out, y).sum().backward()
    stacked = dict(ens.named_parameters())
    for i, m in enumerate(members):
        torch.manual_seed(7)
        alone = m(x)
        F.mse_loss(alone, y).backward()
        torch.testing.assert_close(out[i], alone, rtol=1e-10, atol=1e-12, equal_nan=True)
        for name, p in m.named_parameters():
            got = stacked[name].grad
            if p.grad is None:  # unused alone (Raw's packed weight): no gradient here either
                assert got is None or not got[i].any(), f"{i} {name}"
                continue
            torch.testing.assert_close(
                got[i], p.grad, rtol=1e-10, atol=1e-12, equal_nan=True, msg=f"{i} {name}"
            )


def _trains_as_alone(factory: Callable[[], nn.Module], x: Tensor, opts: dict, same: bool) -> None:
    """Two ``make_step`` steps with ``StackedAdam`` end where ``torch.optim.Adam`` ends alone
    (with dropout: the same seed before each step, alone and in the ensemble)."""
    members = _members(factory)
    y = _randn(*members[0](x).shape)
    ens = _ensemble(copy.deepcopy(members), opts, same)
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedAdam(ens, lr=1e-2))
    for t in range(2):
        torch.manual_seed(100 + t)
        step(x, y)
    for i, m in enumerate(members):
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        for t in range(2):
            torch.manual_seed(100 + t)
            opt.zero_grad()
            F.mse_loss(m(x), y).backward()
            opt.step()
        got, want = ens[i].state_dict(), m.state_dict()
        assert list(got) == list(want)
        for key in want:
            torch.testing.assert_close(got[key], want[key], **TOL, msg=f"member {i} {key}")


PARTS: dict[str, Callable[[], nn.Module]] = {
    # kdim/vdim (separate projections), no biases, batch-first, no weights
    "kdim_vdim_no_bias": lambda: Attn(
        {"need_weights": False}, cross=True, kdim=5, vdim=3, bias=False, batch_first=True
    ),
    # kdim/vdim, sequence-first, 2-D float causal mask, averaged weights
    "kdim_vdim_float_mask": lambda: Attn({"attn_mask": CAUSAL_F}, cross=True, kdim=5, vdim=3),
    # bias_k/v with a per-head bool mask and a bool padding mask, no weights
    "bias_kv_head_mask_padding": lambda: Attn(
        {"attn_mask": HEAD_BOOL, "key_padding_mask": PAD, "need_weights": False},
        add_bias_kv=True,
        batch_first=True,
    ),
    # bias_k/v and a zero key, per-head float mask, sequence-first, weights per head
    "bias_kv_zero_attn_head_mask": lambda: Attn(
        {"attn_mask": HEAD_MASK, "average_attn_weights": False},
        add_bias_kv=True,
        add_zero_attn=True,
    ),
    # a float padding mask with -inf and finite values, with and without weights
    "float_padding": lambda: TwoCalls({"key_padding_mask": FLOAT_PAD}),
    # a 2-D bool mask and a bool padding mask, with and without weights
    "bool_mask_padding": lambda: TwoCalls({"attn_mask": CAUSAL, "key_padding_mask": PAD}),
    # is_causal with its mask (torch hands SDPA the flag, or keeps the mask with padding)
    "is_causal": lambda: TwoCalls({"attn_mask": CAUSAL_F, "is_causal": True}),
    "is_causal_padding": lambda: Attn(
        {"attn_mask": CAUSAL, "is_causal": True, "key_padding_mask": PAD, "need_weights": False},
        batch_first=True,
    ),
    # a query whose every key is masked: SDPA gives it a zero attention output
    "fully_masked_query": lambda: Attn(
        {"key_padding_mask": FULL_PAD, "need_weights": False}, batch_first=True
    ),
    # plain self-attention (the twin's own path), no biases, sequence-first; with weights
    "plain_no_bias": lambda: Attn({"need_weights": False}, bias=False),
    "plain_weights": lambda: Attn({}, batch_first=True),
    "functional": Raw,
    "encoder_layer": lambda: EncoderLayer(
        {}, norm_first=True, activation="gelu", bias=False, dropout=0.0
    ),
    "encoder_causal_detected": lambda: Encoder(False, {"mask": CAUSAL_F}),
    "decoder_norm_first": lambda: Decoder(norm_first=True),
}

# Dropout in training, with randomness="same": each member draws exactly its own masks, so the
# comparison is exact (docs/semantics.md, "Randomness in the forward pass").
DROPOUT_PARTS: dict[str, Callable[[], nn.Module]] = {
    "weights_per_head": lambda: Attn(
        {"key_padding_mask": PAD, "average_attn_weights": False}, dropout=0.4
    ),
    "no_weights": lambda: Attn(
        {"attn_mask": CAUSAL, "need_weights": False}, dropout=0.4, batch_first=True
    ),
    "encoder_layer": lambda: EncoderLayer(
        {"src_key_padding_mask": PAD}, activation=_tanh_gelu, dropout=0.3, batch_first=True
    ),
    "nested_encoder": lambda: Encoder(True, {"src_key_padding_mask": PAD}, dropout=0.2),
    "decoder": lambda: Decoder(dropout=0.2),
    "functional": lambda: Raw(dropout=0.3),
}


@pytest.mark.parametrize("opts", BACKENDS, ids=IDS)
def test_attention_zoo_forward_and_gradients_equal_each_member_alone(opts: dict) -> None:
    _forward_and_grads(lambda: Zoo(PARTS), X, opts, same=False)


def test_attention_zoo_trains_as_each_member_alone() -> None:
    _trains_as_alone(lambda: Zoo(PARTS), X, {}, same=False)


@pytest.mark.parametrize("opts", BACKENDS, ids=IDS)
def test_dropout_zoo_with_same_randomness_equals_each_member_alone(opts: dict) -> None:
    _forward_and_grads(lambda: Zoo(DROPOUT_PARTS), X, opts, same=True)


def test_dropout_zoo_with_same_randomness_trains_as_each_member_alone() -> None:
    _trains_as_alone(lambda: Zoo(DROPOUT_PARTS), X, {}, same=True)


def test_dropout_zoo_in_eval_equals_each_member_alone() -> None:
    # eval with grad on: no draws, torch's regular path alone (its fast path needs no_grad)
    members = _members(lambda: Zoo(DROPOUT_PARTS), train=False)
    for opts in BACKENDS:
        ens = _ensemble(copy.deepcopy(members), opts, same=False).eval()
        out = ens(X)
        for i, m in enumerate(members):
            torch.testing.assert_close(out[i], m(X), rtol=1e-10, atol=1e-12)


def test_nested_tensor_encoder_in_eval_equals_each_member_alone_in_each_grad_mode() -> None:
    # Alone, eval under no_grad runs torch's fast path (nested tensors: zeros at padded
    # positions); with grad on, its regular path computes them. The ensemble gives each
    # (until session 43 it computed them in both: docs/semantics.md).
    members = _members(lambda: Encoder(True, {"src_key_padding_mask": PAD}), train=False)
    for opts in BACKENDS:
        ens = _ensemble(copy.deepcopy(members), opts, same=False).eval()
        with torch.no_grad():
            out = ens(X)
            torch.testing.assert_close(vmapens.predict(ens, X, reduce="none"), out)
        with_grad = ens(X)
        for i, m in enumerate(members):
            with torch.no_grad(), warnings.catch_warnings():
                warnings.filterwarnings("ignore", "The PyTorch API of nested tensors", UserWarning)
                alone = m(X)
            assert torch.all(alone[PAD] == 0)  # it did run the fast path
            torch.testing.assert_close(out[i], alone, rtol=1e-10, atol=1e-12)
            regular = m(X)  # with grad on, torch's regular path alone
            assert not torch.all(regular[PAD] == 0)
            torch.testing.assert_close(with_grad[i], regular, rtol=1e-10, atol=1e-12)


class BufferMaskEncoder(nn.Module):
    """The causal mask as a buffer: stacked per member, so torch's causal-mask detection
    (``(mask == causal).all()`` when ``is_causal`` is not given) branches on a member's value."""

    def __init__(self, is_causal: bool | None) -> None:
        super().__init__()
        self.enc = Encoder(False, {}).enc
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(L))
        self.is_causal = is_causal

    def forward(self, x: Tensor) -> Tensor:
        return self.enc(x, mask=self.mask, is_causal=self.is_causal)


def test_a_buffer_mask_torch_inspects_is_refused_and_the_ways_out_train_as_alone() -> None:
    members = _members(lambda: BufferMaskEncoder(None))
    ens = _ensemble(members, {}, same=False)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"(?s)BufferMaskEncoder.*backend='loop'"):
        ens(X)
    for k, v in ens.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    _trains_as_alone(lambda: BufferMaskEncoder(None), X, {"backend": "loop"}, same=False)
    _trains_as_alone(lambda: BufferMaskEncoder(True), X, {}, same=False)


@pytest.mark.parametrize(
    ("batch_first", "opts"),
    [
        pytest.param(True, {}, id="batch-first-vmap"),
        pytest.param(False, {}, id="seq-first-vmap"),
        pytest.param(True, {"chunk_size": 2}, id="batch-first-chunks"),
        pytest.param(True, {"backend": "loop"}, id="batch-first-loop"),
    ],
)
def test_dropout_after_self_attention_with_same_randomness_draws_each_members_mask(
    batch_first: bool, opts: dict
) -> None:
    # docs/semantics.md: with randomness="same" each member draws what it draws alone from the
    # same RNG state (a dropout mask). Members ended 0.04 off after 2 Adam steps at lr 1e-2 until
    # patch mhaedges-1; the first step's self-check draws both runs' masks in logical order.
    _trains_as_alone(lambda: AttnThenDropout(batch_first), X, opts, same=True)
