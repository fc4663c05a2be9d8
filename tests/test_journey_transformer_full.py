"""User journey: a full ``nn.Transformer`` and attention layers at evaluation and training time.

A researcher trains 3 small sequence-to-sequence ``nn.Transformer``s (d_model 16, 2 heads, one
encoder and one decoder layer, feed-forward 32; batch-first and sequence-first, post-norm and
pre-norm) with a causal target mask (``tgt_mask`` and ``tgt_is_causal=True``), a source padding
mask and a memory padding mask, next to cross-attention ``nn.MultiheadAttention`` layers with
``kdim``/``vdim`` of their own, ``add_bias_kv``, ``add_zero_attn``, per-head weights and float
and bool masks (shared, and one per member through ``in_dims``). Then evaluates them:
``ens(x)`` under ``torch.no_grad()`` and ``torch.inference_mode()`` after ``ens.eval()``, and
``vmapens.predict``, where each member alone runs torch's eval "fast path" (the fused encoder
layer, nested tensors for ``src_key_padding_mask``, native multi-head attention), which the
ensemble switches off (docs/semantics.md, "CPU attention"); and a linear probe on a frozen
encoder in eval mode.

The truth: each member a plain module in the same grad mode and the same train/eval mode, its
outputs and gradients, and two ``torch.optim.Adam`` steps next to ``make_step`` with
``StackedAdam`` (dropout 0, or dropout with ``randomness="same"``, where each member draws the
masks it draws alone from the same RNG state, docs/semantics.md).

Found here and fixed in session 43: with the fast path off the ensemble computed the
encoder's padded positions, where torch's nested-tensor path alone writes zeros (then the
norm); docs/semantics.md stated that difference for the padded positions only, but any forward
that reads them (a mean over every position, a decoder without a ``memory_key_padding_mask``)
then differed from the member alone at every position, silently, in ``ens(x)``, ``predict``
and evaluation; a frozen encoder in eval mode takes the fast path alone even with grad on, so
a linear probe on it was refused at the first step, and with ``backend='loop'`` too. Still
different (pinned with ``xfail(strict=True)``): a query whose every key is padded gives NaN
alone on the fast path and 0 in the ensemble.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from models import Zoo
from parity import forward_and_steps_as_alone
from torch import Tensor, nn

import vmapens

N, B, S, T, E, H, FF = 3, 2, 5, 4, 16, 2, 32
F64 = torch.float64
# float64; the key third of every `in_proj_bias` has a true gradient of 0 and Adam steps on its
# round-off (docs/semantics.md): hence atol 1e-9 on parameters after the steps.
TOL: dict[str, Any] = dict(rtol=1e-9, atol=1e-9)
FWD: dict[str, Any] = dict(rtol=1e-10, atol=1e-12)

_g = torch.Generator().manual_seed(0)


def _randn(*shape: int) -> Tensor:
    return torch.randn(*shape, generator=_g, dtype=F64)


X = _randn(B, S + T, E)  # source rows, then target rows
SRC_PAD = torch.tensor([[False, False, False, True, True], [False] * 5])  # left-aligned
FULL_PAD = torch.tensor([[True] * S, [False, False, False, False, True]])
TGT_MASK = nn.Transformer.generate_square_subsequent_mask(T, dtype=F64)
# cross-attention: the target rows attend over the source rows, keys and values sized apart
KDIM, VDIM = 7, 5
BOOL_MASK = torch.tensor(
    [[False, True, False, True, False], [False] * 5, [True, False, False, False, True],
     [False, False, True, True, False]]
)  # fmt: skip
FLOAT_MASK = _randn(T, S)
MEMBER_FLOAT = _randn(N, T, S)  # one float mask per member (in_dims)
MEMBER_BOOL = torch.rand(N, T, S, generator=_g) > 0.6
MEMBER_BOOL[..., 0] = False  # every query keeps a key


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torch's own warnings here: nn.Transformer(norm_first=True) builds its encoder with
    ``enable_nested_tensor=True`` and says it will not use it; the fast path alone says the
    nested-tensor API is a prototype."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "enable_nested_tensor is True", UserWarning)
        warnings.filterwarnings("ignore", "The PyTorch API of nested tensors", UserWarning)
        yield


def _split(x: Tensor) -> tuple[Tensor, Tensor]:
    return x[:, :S], x[:, S:]


class Seq2Seq(nn.Module):
    """A full ``nn.Transformer`` with every mask the brief names; batch-first input outside."""

    def __init__(self, batch_first: bool, norm_first: bool, memory_pad: bool = True,
                 dropout: float = 0.0) -> None:  # fmt: skip
        super().__init__()
        self.t = nn.Transformer(
            E, H, 1, 1, FF, dropout=dropout, batch_first=batch_first, norm_first=norm_first
        )
        self.bf, self.memory_pad = batch_first, memory_pad

    def forward(self, x: Tensor) -> Tensor:
        src, tgt = _split(x)
        if not self.bf:
            src, tgt = src.transpose(0, 1), tgt.transpose(0, 1)
        out = self.t(
            src,
            tgt,
            tgt_mask=TGT_MASK,
            tgt_is_causal=True,
            src_key_padding_mask=SRC_PAD,
            memory_key_padding_mask=SRC_PAD if self.memory_pad else None,
        )
        return out if self.bf else out.transpose(0, 1)


class Cross(nn.Module):
    """Cross-attention with ``kdim``/``vdim``: targets query keys and values made of sources."""

    def __init__(self, call: dict[str, Any], batch_first: bool = True, **kw: Any) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(E, H, batch_first=batch_first, kdim=KDIM, vdim=VDIM, **kw)
        self.call, self.bf = call, batch_first

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        src, q = _split(x)
        k, v = src[..., :KDIM], src[..., -VDIM:].sin()
        if not self.bf:
            q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        call = self.call if mask is None else {**self.call, "attn_mask": mask}
        out, w = self.mha(q, k, v, **call)
        out = out if self.bf else out.transpose(0, 1)
        return out.flatten(1) if w is None else torch.cat([out.flatten(1), w.flatten(1)], 1)


PARTS: dict[str, Callable[[], nn.Module]] = {
    "bf_post": lambda: Seq2Seq(True, False),
    "bf_pre": lambda: Seq2Seq(True, True),
    "sf_post": lambda: Seq2Seq(False, False),
    "sf_pre": lambda: Seq2Seq(False, True),
    # kdim/vdim + bias_k/v + a zero key, 2-D bool mask + bool padding, weights per head
    "cross_bool": lambda: Cross(
        {"attn_mask": BOOL_MASK, "key_padding_mask": SRC_PAD, "average_attn_weights": False},
        add_bias_kv=True,
        add_zero_attn=True,
    ),
    # the same with a 2-D float mask, sequence-first, weights per head
    "cross_float_seq_first": lambda: Cross(
        {"attn_mask": FLOAT_MASK, "average_attn_weights": False},
        batch_first=False,
        add_bias_kv=True,
        add_zero_attn=True,
    ),
    # a float mask with a float padding mask (same types: torch warns on mixed ones), no weights
    "cross_float_padding": lambda: Cross(
        {
            "attn_mask": FLOAT_MASK,
            "key_padding_mask": torch.where(SRC_PAD, -1e9, 0.0).to(F64),
            "need_weights": False,
        },
        add_zero_attn=True,
    ),
}


def _members(factory: Callable[[], nn.Module], train: bool = True) -> list[nn.Module]:
    out = []
    with _quiet():
        for k in range(N):
            torch.manual_seed(k)
            out.append(factory().double().train(train))
    return out


def _ensemble(members: list[nn.Module], **opts: Any) -> vmapens.Ensemble:
    return vmapens.Ensemble.from_modules(copy.deepcopy(members), **opts)


# -- training: forward, gradients and Adam steps against each member alone ---------------------


@pytest.mark.parametrize(
    "opts", [{}, {"chunk_size": 2}, {"backend": "loop"}], ids=["vmap", "chunks", "loop"]
)
def test_transformer_zoo_forward_and_gradients_equal_each_member_alone(opts: dict) -> None:
    members = _members(lambda: Zoo(PARTS))
    ens = _ensemble(members, **opts)
    out = ens(X)
    y = torch.zeros_like(out[0])
    vmapens.per_member(F.mse_loss)(out, y).sum().backward()
    stacked = dict(ens.named_parameters())
    for i, m in enumerate(members):
        alone = m(X)
        F.mse_loss(alone, y).backward()
        torch.testing.assert_close(out[i], alone, **FWD)
        for name, p in m.named_parameters():
            assert p.grad is not None, name
            torch.testing.assert_close(stacked[name].grad[i], p.grad, **FWD, msg=f"{i} {name}")


def test_transformer_zoo_trains_as_each_member_alone() -> None:
    # ens(x) under no_grad in train mode, then two make_step steps (StackedAdam, lr 0.05)
    # against torch.optim.Adam on each member alone (tests/parity.py)
    members = _members(lambda: Zoo(PARTS))
    ens = _ensemble(members)
    forward_and_steps_as_alone(
        ens, members, X, lambda want: [(X, _randn(*want.shape[1:])) for _ in range(2)], **TOL
    )


def test_transformer_with_dropout_and_same_randomness_trains_as_each_member_alone() -> None:
    # randomness="same": each member draws the masks it draws alone from the same RNG state
    def make() -> nn.Module:
        return Zoo({"bf": lambda: Seq2Seq(True, False, dropout=0.3),
                    "sf_pre": lambda: Seq2Seq(False, True, dropout=0.3)})  # fmt: skip

    members = _members(make)
    ens = _ensemble(members, randomness="same")
    y = _randn(*members[0](X).shape)
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedAdam(ens, lr=1e-2))
    losses = []
    for t in range(2):
        torch.manual_seed(100 + t)
        losses.append(step(X, y))
    for i, m in enumerate(members):
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        for t in range(2):
            torch.manual_seed(100 + t)
            opt.zero_grad()
            loss = F.mse_loss(m(X), y)
            loss.backward()
            opt.step()
            torch.testing.assert_close(losses[t][i], loss.detach(), **FWD)
        got, want = ens[i].state_dict(), m.state_dict()
        assert list(got) == list(want)
        for key in want:
            torch.testing.assert_close(got[key], want[key], **TOL, msg=f"member {i} {key}")


@pytest.mark.parametrize("mask", [MEMBER_FLOAT, MEMBER_BOOL], ids=["float", "bool"])
def test_a_mask_per_member_trains_as_each_member_alone_with_its_own(mask: Tensor) -> None:
    # ens(x, masks, in_dims=(None, 0)): member i attends under masks[i], kdim/vdim, zero key;
    # a padding mask of the same type (torch warns on mixed types)
    pad = SRC_PAD if mask.dtype == torch.bool else torch.where(SRC_PAD, -1e9, 0.0).to(F64)

    def make() -> nn.Module:
        return Cross({"key_padding_mask": pad, "need_weights": False}, add_zero_attn=True)

    members = _members(make)
    ens = _ensemble(members)
    out = ens(X, mask, in_dims=(None, 0))
    for i, m in enumerate(members):
        torch.testing.assert_close(out[i], m(X, mask[i]), **FWD)
    y = _randn(*out.shape[1:])
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedAdam(ens, lr=1e-2), in_dims=0)
    for _ in range(2):
        step((X.expand(N, *X.shape), mask), y.expand(N, *y.shape))
    for i, m in enumerate(members):
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        for _ in range(2):
            opt.zero_grad()
            F.mse_loss(m(X, mask[i]), y).backward()
            opt.step()
        for key, want in m.state_dict().items():
            torch.testing.assert_close(ens[i].state_dict()[key], want, **TOL, msg=f"{i} {key}")


# -- evaluation: each member alone runs torch's fast path ---------------------------------------


def _alone(members: list[nn.Module], x: Tensor, grad_mode: Callable[[], Any]) -> Tensor:
    with grad_mode(), _quiet():
        return torch.stack([m(x) for m in members])


MODES = [torch.no_grad, torch.inference_mode]


@pytest.mark.parametrize("grad_mode", MODES, ids=["no_grad", "inference_mode"])
def test_evaluation_of_the_zoo_equals_each_member_alone(grad_mode: Callable[[], Any]) -> None:
    # After ens.eval(), under no_grad / inference_mode, and through predict: the members alone
    # run the nested-tensor encoder (bf_post: memory padded, then masked out by the memory
    # padding mask) and native multi-head attention; the ensemble runs torch's regular path.
    members = _members(lambda: Zoo(PARTS), train=False)
    ens = _ensemble(members).eval()
    with grad_mode():
        out = ens(X)
    torch.testing.assert_close(out, _alone(members, X, grad_mode), **FWD)
    torch.testing.assert_close(vmapens.predict(ens, X), _alone(members, X, torch.no_grad), **FWD)
    torch.testing.assert_close(vmapens.predict(ens, X, reduce="mean"), out.mean(0), **FWD)
    # the fast path did run alone: the memory's padded rows are LayerNorm(0), its bias
    t = members[0].parts["bf_post"].t
    with torch.no_grad(), _quiet():
        memory = t.encoder(X[:, :S], src_key_padding_mask=SRC_PAD)
    torch.testing.assert_close(memory[SRC_PAD], t.encoder.norm.bias.expand(int(SRC_PAD.sum()), E))


class Classifier(nn.Module):
    """A text classifier: ``nn.TransformerEncoder`` (nested tensors on), a pooled linear head;
    the pooling is over the unpadded positions (``masked``) or over every position."""

    def __init__(self, masked: bool) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=True)
        self.head = nn.Linear(E, 3)
        self.masked = masked

    def forward(self, x: Tensor) -> Tensor:
        h = self.enc(x[:, :S], src_key_padding_mask=SRC_PAD)
        if self.masked:
            keep = (~SRC_PAD).unsqueeze(-1).to(h.dtype)
            return self.head((h * keep).sum(1) / keep.sum(1))
        return self.head(h.mean(1))


@pytest.mark.parametrize("grad_mode", MODES, ids=["no_grad", "inference_mode"])
def test_a_classifier_pooling_unpadded_positions_evaluates_as_each_member_alone(
    grad_mode: Callable[[], Any],
) -> None:
    members = _members(lambda: Classifier(masked=True), train=False)
    ens = _ensemble(members).eval()
    with grad_mode():
        out = ens(X)
    torch.testing.assert_close(out, _alone(members, X, grad_mode), **FWD)
    torch.testing.assert_close(vmapens.predict(ens, X), _alone(members, X, torch.no_grad), **FWD)


def test_a_classifier_pooling_every_position_predicts_as_each_member_alone() -> None:
    members = _members(lambda: Classifier(masked=False), train=False)
    ens = _ensemble(members)
    torch.testing.assert_close(vmapens.predict(ens, X), _alone(members, X, torch.no_grad), **FWD)


class Pooled(nn.Module):
    """An encoder (a final norm or none) over the source rows, mean-pooled over every
    position, the padding mask an argument: a read of the padded positions shows at once."""

    def __init__(self, norm: bool) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 1, norm=nn.LayerNorm(E) if norm else None)

    def forward(self, x: Tensor, pad: Tensor) -> Tensor:
        return self.enc(x[:, :S], src_key_padding_mask=pad).mean(1)


NOT_ALIGNED = torch.tensor([[True, False, False, False, True], [False] * 5])  # padding first
ADDITIVE = torch.tensor([[0.0, 0.0, -1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, -2.0]], dtype=F64)
PADS: dict[str, Any] = {
    "bool": SRC_PAD,
    "not-left-aligned": NOT_ALIGNED,
    "float-inf": torch.where(SRC_PAD, float("-inf"), 0.0).to(F64),
    # not left aligned, so alone torch's plain encoder path, whose layers take their own eval
    # fast path (torch._transformer_encoder_layer_fwd), which reads a float key padding mask
    # as masked wherever it is not zero (0.09 apart from their Python path; a strict xfail
    # until session 48, vmapens/_encoder_twin.py's layer twin)
    "float-additive": ADDITIVE,
    # left aligned: nested alone, where any value but 0 leaves the position out
    "float-additive-aligned": torch.where(SRC_PAD, -3.0, 0.0).to(F64),
}


@pytest.mark.parametrize("norm", [False, True], ids=["no-norm", "norm"])
@pytest.mark.parametrize("pad", list(PADS.values()), ids=list(PADS))
def test_an_encoder_mask_of_every_kind_evaluates_as_each_member_alone(
    pad: Tensor, norm: bool
) -> None:
    # Alone, torch takes the nested path for a left-aligned mask (mask_check) and pads with
    # zeros before the norm; a mask that is not left aligned runs the plain path.
    members = _members(lambda: Pooled(norm), train=False)
    ens = _ensemble(members).eval()
    mask = pad
    with torch.no_grad():
        got = ens(X, mask)
    with torch.no_grad(), _quiet():
        want = torch.stack([m(X, mask) for m in members])
    torch.testing.assert_close(got, want, **FWD)


def test_per_member_masks_aligned_in_some_members_evaluate_as_each_member_alone() -> None:
    members = _members(lambda: Pooled(True), train=False)
    ens = _ensemble(members).eval()
    masks = torch.stack([SRC_PAD, NOT_ALIGNED, FULL_PAD])  # one member per path, one empty row
    with torch.no_grad():
        got = ens(X, masks, in_dims=(None, 0))
    with torch.no_grad(), _quiet():
        want = torch.stack([m(X, masks[i]) for i, m in enumerate(members)])
    torch.testing.assert_close(got, want, **FWD)


def test_with_the_fast_path_off_the_encoder_evaluates_as_each_member_alone() -> None:
    members = _members(lambda: Pooled(True), train=False)
    ens = _ensemble(members).eval()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad():
            got = ens(X, SRC_PAD)
        with torch.no_grad(), _quiet():
            want = torch.stack([m(X, SRC_PAD) for m in members])
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    torch.testing.assert_close(got, want, **FWD)
    assert torch.backends.mha.get_fastpath_enabled()


def test_a_transformer_without_memory_padding_mask_evaluates_as_each_member_alone() -> None:
    members = _members(lambda: Seq2Seq(True, False, memory_pad=False), train=False)
    ens = _ensemble(members).eval()
    with torch.no_grad():
        out = ens(X)
    torch.testing.assert_close(out, _alone(members, X, torch.no_grad), **FWD)


@pytest.mark.xfail(
    strict=True,
    reason="fast path off under the ensemble: a query whose every key is padded is NaN alone "
    "(torch's native multi-head attention under no_grad in eval) and 0 in the ensemble",
)
def test_a_fully_padded_query_evaluates_as_each_member_alone() -> None:
    class SelfAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mha = nn.MultiheadAttention(E, H, batch_first=True)

        def forward(self, x: Tensor) -> Tensor:
            src = x[:, :S]
            return self.mha(src, src, src, key_padding_mask=FULL_PAD, need_weights=False)[0]

    members = _members(SelfAttention, train=False)
    ens = _ensemble(members).eval()
    with torch.no_grad():
        out = ens(X)
    torch.testing.assert_close(out, _alone(members, X, torch.no_grad), **FWD, equal_nan=True)


# -- a linear probe on a frozen encoder in eval mode ---------------------------------------------


def _probe_trains_as_alone(masked: bool, compile: bool = False, **opts: Any) -> None:
    """The encoder frozen and in eval mode, the head trained: alone, torch takes the fast path
    with grad on (no argument of the encoder requires grad)."""
    members = _members(lambda: Classifier(masked))
    for m in members:
        m.enc.requires_grad_(False).eval()
    ens = _ensemble(members, **opts)
    ens.template.enc.requires_grad_(False).eval()
    y = _randn(B, 3)
    opt = vmapens.StackedAdam(ens, lr=1e-2)
    step = vmapens.make_step(ens, F.mse_loss, opt, compile=compile)
    losses = [step(X, y) for _ in range(2)]
    for i, m in enumerate(members):
        opt = torch.optim.Adam(m.head.parameters(), lr=1e-2)
        for t in range(2):
            opt.zero_grad()
            with _quiet():
                loss = F.mse_loss(m(X), y)
            loss.backward()
            opt.step()
            torch.testing.assert_close(losses[t][i], loss.detach(), **FWD)
        for key, want in m.state_dict().items():
            torch.testing.assert_close(ens[i].state_dict()[key], want, **TOL, msg=f"{i} {key}")


@pytest.mark.parametrize("opts", [{}, {"backend": "loop"}], ids=["vmap", "loop"])
def test_a_linear_probe_pooling_unpadded_positions_trains_as_alone(opts: dict) -> None:
    _probe_trains_as_alone(True, **opts)


@pytest.mark.parametrize(
    "opts", [{}, {"backend": "loop"}, {"compile": True}], ids=["vmap", "loop", "compiled"]
)
def test_a_linear_probe_pooling_every_position_trains_as_alone(opts: dict) -> None:
    # The frozen encoder in eval mode takes torch's nested path alone, grad on or not: its
    # padded positions are zeros before the norm. It was refused at the first step (session
    # 43), and the loop, which the refusal suggested, was refused the same way.
    _probe_trains_as_alone(False, **opts)
