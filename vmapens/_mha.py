"""``nn.MultiheadAttention`` self-attention in ops that batch well under ``vmap``, fewer copies.

Under ``torch.func.vmap`` torch's own ``F.multi_head_attention_forward`` pays for layouts
that suit one model: it transposes batch-first input to sequence-first, splits the packed
projection with ``proj[0], proj[1], proj[2]`` (whose backward writes three zero-filled
copies of the whole projection), and on CPU calls the flash kernel, which is slow on the
small heads ensembles use (head dim 8-32, sequences up to 64: the math form below is
0.5-0.8x its time, forward and backward, at one and two threads).

:class:`BatchableMultiheadAttention` keeps the same parameters, constructor and
``state_dict`` and computes the same maths in batch-first order: one projection, a
``view`` + ``permute`` into heads, ``unbind`` (whose backward is one ``stack``), and
``softmax(q k^T * scale) v`` on CPU in float32/float64 when the score matrix has at most
:data:`MATH_SCORES` entries, ``F.scaled_dot_product_attention`` otherwise. Results equal
``nn.MultiheadAttention`` up to float round-off. Any call outside that plain case (masks,
``need_weights``, cross-attention, dropout while training, bias_k/v, zero attention,
separate key/value sizes, unbatched input) runs torch's own ``forward`` unchanged.

This file imports only torch: it sits at the bottom of the package.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

__all__ = ["MATH_SCORES", "BatchableMultiheadAttention"]

#: Largest ``L * S`` (query length times key length) that runs as explicit CPU matmuls and a
#: softmax; above it the flash kernel is as fast or faster (measured, docs/performance.md).
MATH_SCORES = 64 * 64


class BatchableMultiheadAttention(nn.MultiheadAttention):
    """``nn.MultiheadAttention`` whose self-attention ``forward`` batches well under ``vmap``.

    Same constructor, parameters and outputs as ``nn.MultiheadAttention``; the attention
    weights are returned as ``None`` whenever ``need_weights=False``, as torch does.

    Example:
        >>> mha = BatchableMultiheadAttention(8, 2, batch_first=True)
        >>> x = torch.randn(3, 5, 8)
        >>> out, weights = mha(x, x, x, need_weights=False)
        >>> tuple(out.shape), weights
        ((3, 5, 8), None)
    """

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        plain = (
            query is key
            and key is value
            and query.dim() == 3
            and not need_weights
            and key_padding_mask is None
            and attn_mask is None
            and not is_causal
            and not (self.training and self.dropout > 0.0)
            and self._qkv_same_embed_dim
            and self.bias_k is None
            and self.bias_v is None
            and not self.add_zero_attn
            and query.dtype == self.in_proj_weight.dtype
        )
        if not plain:
            return super().forward(
                query,
                key,
                value,
                key_padding_mask=key_padding_mask,
                need_weights=need_weights,
                attn_mask=attn_mask,
                average_attn_weights=average_attn_weights,
                is_causal=is_causal,
            )
        x = query if self.batch_first else query.transpose(0, 1)
        batch, length, embed = x.shape
        heads = self.num_heads
        qkv = F.linear(x, self.in_proj_weight, self.in_proj_bias)
        # [B, L, 3E] -> 3 x [B, H, L, D]: the projection's column order is (q|k|v, head, dim).
        q, k, v = qkv.view(batch, length, 3, heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        out = _attend(q, k, v)
        # In torch's layout, [L, B, E] in memory (a batch-first result is its transpose): a
        # dropout after it draws its mask in memory order, as after torch's own forward.
        out = F.linear(
            out.permute(2, 0, 1, 3).reshape(length, batch, embed),
            self.out_proj.weight,
            self.out_proj.bias,
        )
        return (out.transpose(0, 1) if self.batch_first else out), None


def _attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """``softmax(q k^T / sqrt(D)) v`` over ``[B, H, L, D]``, in the faster form for its size."""
    # float32/64 only: in bf16/fp16 the fused kernel keeps its softmax in float32, two
    # separate matmuls and a softmax would round the scores and weights to the low precision.
    small = q.size(-2) * k.size(-2) <= MATH_SCORES
    if q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64) and small:
        scores = torch.matmul(q, k.transpose(-2, -1)).mul_(q.size(-1) ** -0.5)
        return scores.softmax(-1).matmul(v)
    return F.scaled_dot_product_attention(q, k, v)
