"""``nn.TransformerEncoder`` whose padded positions come out as the member alone gets them.

Alone, in eval mode with a ``src_key_padding_mask`` (and nothing that needs gradients), torch
runs the encoder's layers on a nested tensor that holds only the unpadded positions, pads the
result with zeros and then applies the final norm: a padded position comes out as ``norm(0)``.
``vmap`` cannot batch nested tensors, so the ensemble's calls run with that fast path off
(``_attention.batched_attention``), and the layers compute values at the padded positions. The
unpadded positions agree either way, but a forward that reads every position (a mean over the
sequence, a decoder attending to the memory without ``memory_key_padding_mask``) then differs
everywhere, silently. :class:`BatchableTransformerEncoder` asks torch's own conditions and,
where the member alone takes the nested path, zeroes the padded positions before the norm.

Alone, an ``nn.TransformerEncoderLayer`` in eval mode with nothing that needs gradients runs
its own fast path (``torch._transformer_encoder_layer_fwd``), whose native softmax reads the
merged float mask as masked wherever it is not zero; its Python path, which the ensemble's
calls run, adds the mask. A float ``src_mask`` or padding mask with other values than 0 and
``-inf`` then differed (0.05-0.27 here), silently: :class:`BatchableTransformerEncoderLayer`
merges the masks as torch does where the member alone takes that path, and passes them on
as the bool mask the native softmax reads.

This file imports only torch, ``_attention``, ``_fastcall`` and ``_precision``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import _get_current_function_mode_stack

from ._attention import fastpath_enabled
from ._fastcall import requires_grad_below
from ._precision import MemberAutocast

__all__ = ["BatchableTransformerEncoder", "BatchableTransformerEncoderLayer"]

_DEVICES = ("cpu", "cuda", "xpu")


class BatchableTransformerEncoder(nn.TransformerEncoder):
    """``nn.TransformerEncoder`` as the member alone runs it, under ``vmap`` too.

    Where torch's ``forward`` would convert the input to a nested tensor (its fast path), the
    layers run on the padded input with the padded keys masked out, as they are in the nested
    tensor, and the padded positions are set to zero before the norm, as
    ``to_padded_tensor(0.0)`` sets them. Everywhere else it is torch's ``forward``.
    """

    def forward(  # type: ignore[override]
        self,
        src: Tensor,
        mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool | None = None,
    ) -> Tensor:
        if src_key_padding_mask is None or not self._nested_alone(src, mask):
            return super().forward(src, mask, src_key_padding_mask, is_causal)
        padding = F._canonical_mask(
            mask=src_key_padding_mask,
            mask_name="src_key_padding_mask",
            other_type=None,
            other_name="mask",
            target_type=src.dtype,
        )
        assert padding is not None
        padded = padding != 0  # what the nested tensor leaves out (torch: the mask's logical_not)
        if not getattr(self, "mask_check", True):
            # The user vouches that the mask is left aligned: torch's nested tensor keeps each
            # row's first `len` positions, `len` its unpadded count, wherever the mask has them.
            count = padded.logical_not().sum(-1, keepdim=True)
            padded = torch.arange(padded.shape[-1], device=padded.device) >= count
        # On the nested tensor each layer takes its own fast path, which has no causal mask
        # to apply: an `is_causal` hint without `mask` changes nothing alone.
        output = self._layers(src, padded, False)
        if getattr(self, "mask_check", True):
            # Alone, a mask that is not left aligned (each row's padding after its tokens)
            # takes the plain path, whose layers add a float mask as it is; the member's own
            # mask picks (under vmap a tensor, not an `if`).
            causal = nn.modules.transformer._detect_is_causal_mask(None, is_causal, src.size(1))
            plain = (
                output
                if src_key_padding_mask.dtype == torch.bool
                else self._layers(src, padding, causal)
            )
            keep = padded.logical_not()
            aligned = (keep[..., 1:] <= keep[..., :-1]).all()
            output = torch.where(aligned, output.masked_fill(padded.unsqueeze(-1), 0.0), plain)
        else:
            output = output.masked_fill(padded.unsqueeze(-1), 0.0)
        return output if self.norm is None else self.norm(output)

    def _layers(self, src: Tensor, padding: Tensor, causal: bool) -> Tensor:
        output = src
        for layer in self.layers:
            output = layer(output, src_mask=None, is_causal=causal, src_key_padding_mask=padding)
        return output

    def _nested_alone(self, src: Tensor, mask: Tensor | None) -> bool:
        """Whether torch's ``forward`` would run the member alone, eagerly, on a nested tensor,
        given a padding mask: its conditions, but the fast path's switch as the user set it
        (the ensemble's calls turn it off), vmapens's per-member autocast as ``torch.autocast``
        (it is how the ensemble runs the user's autocast), gradients asked below ``vmap``, and
        a compiled step as eager (the member trains eagerly alone)."""
        first = self.layers[0]
        if not fastpath_enabled() or not getattr(self, "use_nested_tensor", False):
            return False
        if first.training or src.dim() != 3 or src.is_nested or mask is not None:
            return False
        if getattr(self, "mask_check", True) and torch.compiler.is_exporting():
            return False  # as torch.export of the member alone (torch.compile: eager's path)
        if _autocasting():
            return False
        return _tensors_allow(first, src)


def _autocasting() -> bool:
    """``torch.autocast`` on, or vmapens's per-member autocast (how the ensemble runs the
    user's): either turns torch's fast paths off alone."""
    modes = _get_current_function_mode_stack()
    return torch.is_autocast_enabled() or any(isinstance(m, MemberAutocast) for m in modes)


def _tensors_allow(layer: nn.TransformerEncoderLayer, src: Tensor) -> bool:
    """The tensor conditions of torch's fast paths for ``layer`` on ``src``: no mode or
    tensor subclass (torch's ``has_torch_function``), a supported device, and no gradient
    asked through them (below ``vmap``: a batched tensor says requires_grad=False)."""
    attn = layer.self_attn
    tensors = (src, attn.in_proj_weight, attn.in_proj_bias, attn.out_proj.weight,
               attn.out_proj.bias, layer.norm1.weight, layer.norm1.bias, layer.norm2.weight,
               layer.norm2.bias, layer.linear1.weight, layer.linear1.bias,
               layer.linear2.weight, layer.linear2.bias)  # fmt: skip
    present = [t for t in tensors if t is not None]
    modes = _get_current_function_mode_stack()
    if modes or any(type(t) not in (Tensor, nn.Parameter) for t in present):
        return False  # alone, torch's has_torch_function: a mode or a subclass
    if any(t.device.type not in _DEVICES for t in present):
        return False
    return not (torch.is_grad_enabled() and any(requires_grad_below(t) for t in present))


class BatchableTransformerEncoderLayer(nn.TransformerEncoderLayer):
    """``nn.TransformerEncoderLayer`` as the member alone runs it, under ``vmap`` too.

    Where torch's ``forward`` would take its fast path, the masks are merged as that path
    merges them (``merge_masks``: a padding mask, an attention mask, or their sum per head)
    and passed on as a bool mask, true where the merge is not zero, as its native softmax
    reads it. Everywhere else it is torch's ``forward``.
    """

    def forward(  # type: ignore[override]
        self,
        src: Tensor,
        src_mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
    ) -> Tensor:
        if (src_mask is None and src_key_padding_mask is None) or not self._fast_alone(src):
            return super().forward(src, src_mask, src_key_padding_mask, is_causal)
        padding = F._canonical_mask(
            mask=src_key_padding_mask,
            mask_name="src_key_padding_mask",
            other_type=F._none_or_dtype(src_mask),
            other_name="src_mask",
            target_type=src.dtype,
        )
        attention = F._canonical_mask(
            mask=src_mask,
            mask_name="src_mask",
            other_type=None,
            other_name="",
            target_type=src.dtype,
            check_other=False,
        )
        merged, kind = self.self_attn.merge_masks(attention, padding, src)
        assert merged is not None
        masked = merged != 0  # the fast path ignores `is_causal`: the merged mask is all
        if kind == 1:  # the padding mask alone, [batch, keys]
            return super().forward(src, None, masked, False)
        return super().forward(src, masked.flatten(0, 1), None, False)  # [batch * heads, ...]

    def _fast_alone(self, src: Tensor) -> bool:
        """Whether torch's ``forward`` would run the member alone, eagerly, on its fast path:
        its conditions in its order, the fast path's switch as the user set it (the
        ensemble's calls turn it off), vmapens's per-member autocast as ``torch.autocast``."""
        attn = self.self_attn
        if not fastpath_enabled() or src.dim() != 3 or self.training or src.is_nested:
            return False
        if not attn.batch_first or attn.in_proj_bias is None or not attn._qkv_same_embed_dim:
            return False
        if not self.activation_relu_or_gelu or self.norm1.eps != self.norm2.eps:
            return False
        if attn.num_heads % 2 == 1 or torch.compiler.is_exporting():
            return False
        if _autocasting():
            return False
        if any(m._forward_hooks or m._forward_pre_hooks for m in self.modules()):
            return False
        return _tensors_allow(self, src)
