"""Session 48 hunt (e): the recurrent and attention twins against each member alone.

The truth is each member a plain module with torch's own layers, float64.

Found (fixed in session 48, ``vmapens/_encoder_twin.py``): ``nn.TransformerEncoderLayer`` (alone or in an ``nn.TransformerEncoder``) in eval mode
under ``no_grad`` with a float ``src_mask`` holding finite non-zero values. Alone, torch takes
the layer's fast path (``torch._transformer_encoder_layer_fwd``), which reads such a mask
otherwise than the Python path does (here 0.1 apart; a ``randn`` mask gives NaN alone). The
ensemble's calls switch the fast path off and run the Python path: ``ens(x)`` and ``predict``
differ from the member alone, silently. The same with a bare layer's left-aligned float
``src_key_padding_mask`` holding a finite value. docs/semantics.md lists only the encoder's
float *padding* mask that is not left aligned; ``backend="loop"`` is exact. (A training step
refuses it at its first step's self-check.)

Passing checks added here (not covered elsewhere): per-member 3-D float head masks and float
key padding masks with per-member keys/values in unbatched cross attention (``kdim``/``vdim``,
``add_bias_kv``), trained with ``make_step``; an LSTM read through its ``c_n`` only
(bidirectional, two layers, the fused node's backward without an output gradient).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import vmapens

N, B, L, S, E, H = 3, 2, 4, 5, 8, 2
F64 = torch.float64
TOL: dict[str, Any] = dict(rtol=1e-9, atol=1e-10)
# A float attention mask with finite non-zero entries: an additive bias, as torch documents.
MASK = torch.tensor(
    [[0.0, -2.0, 0.0, -1.0], [0.0, 0.0, -3.0, 0.0], [-1.0, 0.0, 0.0, 0.0], [0.0, 0.0, -0.5, 0.0]],
    dtype=F64,
)


# A left-aligned float padding mask with a finite value (the bare layer's fast path too).
PAD = torch.zeros(B, L, dtype=F64)
PAD[0, 3] = -2.0


class EncoderLayerWithMask(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(E, H, 6, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2) if kind == "encoder" else layer
        self.kind = kind

    def forward(self, x: Tensor) -> Tensor:
        if self.kind == "encoder":
            return self.enc(x, mask=MASK)
        if self.kind == "layer_padding":
            return self.enc(x, src_key_padding_mask=PAD)
        return self.enc(x, src_mask=MASK)


def _members(factory: Any) -> list[nn.Module]:
    out = []
    for k in range(N):
        torch.manual_seed(k)
        out.append(factory().double())
    return out


@pytest.mark.parametrize("kind", ["layer", "encoder", "layer_padding"])
def test_encoder_layer_float_src_mask_in_eval_no_grad_equals_each_member_alone(kind: str) -> None:
    members = [m.eval() for m in _members(lambda: EncoderLayerWithMask(kind))]
    x = torch.randn(B, L, E, dtype=F64, generator=torch.Generator().manual_seed(3))
    ens = vmapens.Ensemble.from_modules(copy.deepcopy(members)).eval()
    with torch.no_grad():
        out = ens(x)
        alone = [m(x) for m in members]
    predicted = vmapens.predict(ens, x)
    for i in range(N):
        torch.testing.assert_close(
            out[i], alone[i], **TOL, msg=lambda m, i=i: f"ens(x), member {i}: {m}"
        )
        torch.testing.assert_close(
            predicted[i], alone[i], **TOL, msg=lambda m, i=i: f"predict, member {i}: {m}"
        )


class OwnLayer(nn.TransformerEncoderLayer):
    """A subclass with a forward of its own that reaches torch's through ``super()``, given
    both masks at once (the fast path sums them per head) and a per-member padding mask."""

    def forward(self, src: Tensor, pad: Tensor) -> Tensor:  # type: ignore[override]
        return super().forward(src * 2, src_mask=MASK, src_key_padding_mask=pad)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_a_subclassed_layer_with_both_masks_per_member_evaluates_as_each_member_alone(
    grad: bool,
) -> None:
    """Fixed in session 48 (vmapens/_encoder_twin.py's layer twin). With grad on, torch runs
    the Python path alone too (the masks added): that must stay as it is."""
    members = [m.eval() for m in _members(lambda: OwnLayer(E, H, 6, dropout=0.0, batch_first=True))]
    x = torch.randn(B, L, E, dtype=F64, generator=torch.Generator().manual_seed(4))
    pads = torch.zeros(N, B, L, dtype=F64)
    pads[0, 0, 3], pads[1, 1, 1], pads[2, 0, 0] = -2.0, 1.5, float("-inf")
    ens = vmapens.Ensemble.from_modules(copy.deepcopy(members)).eval()
    with torch.set_grad_enabled(grad):
        out = ens(x, pads, in_dims=(None, 0))
        alone = [m(x, pads[i]) for i, m in enumerate(members)]
    for i in range(N):
        torch.testing.assert_close(out[i], alone[i], **TOL, msg=lambda m, i=i: f"member {i}: {m}")


class CrossAttention(nn.Module):
    """Unbatched cross attention with per-call masks (each member gets its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(E, H, kdim=5, vdim=3, add_bias_kv=True)
        self.head = nn.Linear(E + S + 1, 1)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, pad: Tensor) -> Tensor:
        out, w = self.mha(q, k, v, attn_mask=mask, key_padding_mask=pad)
        return self.head(torch.cat([out, w], -1))


def test_unbatched_cross_attention_with_per_member_masks_trains_as_alone() -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(L, E, dtype=F64, generator=g)
    k = torch.randn(N, S, 5, dtype=F64, generator=g)
    v = torch.randn(N, S, 3, dtype=F64, generator=g)
    mask = torch.randn(N, H, L, S, dtype=F64, generator=g)  # torch adds the bias_k column
    pad = torch.zeros(N, S, dtype=F64)  # float, as the attention mask (torch warns otherwise)
    pad[0, 1], pad[2, 3:5] = float("-inf"), -1.5
    y = torch.randn(L, 1, dtype=F64, generator=g)
    members = _members(CrossAttention)
    ens = vmapens.Ensemble.from_modules(copy.deepcopy(members))
    # in_dims=0 maps every input: the shared query expanded to one per member
    step_inputs = (q.expand(N, L, E), k, v, mask, pad)
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedAdam(ens, lr=1e-2), in_dims=0)
    for _ in range(3):
        step(step_inputs, y.expand(N, L, 1))
    for i, m in enumerate(members):
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        for _ in range(3):
            opt.zero_grad()
            F.mse_loss(m(q, k[i], v[i], mask[i], pad[i]), y).backward()
            opt.step()
        got = ens[i].state_dict()
        for key, want in m.state_dict().items():
            torch.testing.assert_close(got[key], want, rtol=1e-9, atol=1e-9, msg=f"{i} {key}")


class CellStateOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(3, 4, num_layers=2, bidirectional=True, bias=False)
        self.head = nn.Linear(4, 1)

    def forward(self, x: Tensor) -> Tensor:
        _, (_, c) = self.rnn(x)
        return self.head(c[1:]).squeeze(-1)  # layer 0 reverse, layer 1 both


@pytest.mark.parametrize("opts", [{}, {"chunk_size": 2}], ids=["vmap", "chunks"])
def test_lstm_read_through_its_cell_state_only_trains_as_alone(opts: dict) -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, B, 3, dtype=F64, generator=g)
    y = torch.randn(3, B, dtype=F64, generator=g)
    members = _members(CellStateOnly)
    ens = vmapens.Ensemble.from_modules(copy.deepcopy(members), **opts)
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedAdam(ens, lr=1e-2))
    for _ in range(3):
        step(x, y)
    for i, m in enumerate(members):
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        for _ in range(3):
            opt.zero_grad()
            F.mse_loss(m(x), y).backward()
            opt.step()
        got = ens[i].state_dict()
        for key, want in m.state_dict().items():
            torch.testing.assert_close(got[key], want, **TOL, msg=f"{i} {key}")
