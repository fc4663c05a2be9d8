"""Twins of layers whose result depends on the input's memory layout, which ``vmap`` changes.

A member's tensor under ``vmap`` is a view into the batched tensor, its strides the layout the
batching rules chose; torch's CPU kernels that follow the input's layout alone then draw or
refuse differently (``_batchable`` re-classes these layers in the ensemble's runner):

* ``nn.Dropout``: draws its mask in memory order alone, in logical order under ``vmap``.
* ``nn.GroupNorm``: torch's ``group_norm`` lays a channels-last input out with
  ``input.contiguous(memory_format=torch.channels_last)``, which ``vmap`` refuses ("NYI:
  querying is_contiguous inside of vmap"); a conv fed a channels-last input, or with
  channels-last weights (``ens.to(memory_format=torch.channels_last)``), gives one.
* ``nn.LayerNorm`` and ``nn.GroupNorm`` fed an input of another dtype than their weights:
  ``vmap``'s rules normalise, then multiply by the member's weight with type promotion, where
  torch's CPU kernel alone refuses (float64 input, float32 weights) or runs its mixed-dtype
  kernel (bf16/fp16 input, float32 weights: float32 arithmetic, output in the input's dtype).
  The twins ask torch's kernel on empty tensors of the same dtypes, then compute as alone.

This file imports only torch: it sits at the bottom of the package.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._prims_common import suggest_memory_format

__all__ = [
    "BatchableAlphaDropout",
    "BatchableDropout",
    "BatchableGroupNorm",
    "BatchableLayerNorm",
    "in_logical_order",
]


def _memory_order(t: Tensor) -> list[int] | None:
    """The dims of ``t`` from the slowest to the fastest in memory, or None where ``t`` is
    contiguous already or its elements overlap (no order then).

    A member's view under ``vmap`` need not be dense: a conv fed a channels-last batch gives
    each member strides ``(768, 1, 96, 12)`` where alone they are ``(256, 1, 32, 4)``, the
    member dim laid between the batch and the rest; its order of dims is still alone's.
    """
    if t.is_contiguous():
        return None
    order = [d for *_, d in sorted((-t.stride(d), -t.size(d), d) for d in range(t.dim()))]
    span = 1  # each dim's stride must step over everything the faster dims cover
    for d in reversed(order):
        if t.size(d) > 1:
            if t.stride(d) < span:
                return None
            span = t.stride(d) * t.size(d)
    return order


#: Set while the self-check runs one member alone and in the ensemble (``in_logical_order``).
_LOGICAL = [False]


@contextlib.contextmanager
def in_logical_order() -> Iterator[None]:
    """Every ``BatchableDropout`` draws its mask in the input's logical order meanwhile.

    A batched tensor's strides are the layout vmap's batching rules chose, which can differ
    from the member's own (``h[:, self.index]`` with an index buffer, stacked per member, is
    laid out time-first under vmap and batch-first alone), so the memory order is not always
    the member's. The self-check compares one member alone and in the ensemble from one RNG
    state: with this order in both runs (the alone module's ``nn.Dropout`` re-classed) their
    masks agree whatever the layouts, and what it compares is the rest of the forward.
    """
    _LOGICAL[0] = True
    try:
        yield
    finally:
        _LOGICAL[0] = False


class BatchableDropout(nn.Dropout):
    """``nn.Dropout`` that draws its mask in the input's memory order under ``vmap`` too.

    Alone, torch's CPU dropout draws into ``empty_like(input)``, which keeps the input's
    strides: a transposed input (``nn.GRU(batch_first=True)``'s output, ``nn.MultiheadAttention
    (batch_first=True)``'s) gets its random numbers in memory order. Under ``vmap`` dropout
    runs ``native_dropout``, which draws into a contiguous mask, in logical order: another
    mask than the member's own. Permuting the input to its memory order first makes the two
    orders one; on a contiguous input this is torch's forward. Under ``in_logical_order`` a
    non-contiguous input is made contiguous first instead (an in-place dropout gets the
    result copied back).
    """

    def forward(self, input: Tensor) -> Tensor:
        # CUDA's dropout alone draws into a contiguous mask too (its fused native_dropout).
        if not (self.training and self.p > 0 and input.device.type == "cpu"):
            return super().forward(input)
        return _in_memory_order(input, self.p, self.inplace, F.dropout)


class BatchableAlphaDropout(nn.AlphaDropout):
    """``nn.AlphaDropout`` that draws its mask in the input's memory order under ``vmap`` too,
    as ``BatchableDropout`` (torch's CPU ``alpha_dropout`` alone draws into ``empty_like``
    too). ``nn.AlphaDropout`` never works in place, whatever its ``inplace``."""

    def forward(self, input: Tensor) -> Tensor:
        if not (self.training and self.p > 0 and input.device.type == "cpu"):
            return super().forward(input)
        return _in_memory_order(input, self.p, False, F.alpha_dropout)


def _in_memory_order(input: Tensor, p: float, inplace: bool, drop: Any) -> Tensor:
    """``drop(input, p, True, inplace)`` with its mask drawn in ``input``'s memory order (in
    logical order under ``in_logical_order``)."""
    order = _memory_order(input)
    if order is not None and _LOGICAL[0]:
        dropped = drop(input.contiguous(), p, True, False)
        return input.copy_(dropped) if inplace else dropped
    if order is None:
        return drop(input, p, True, inplace)
    dropped = drop(input.permute(order), p, True, inplace)
    return dropped.permute([order.index(d) for d in range(len(order))])


def _alone_dtype(
    norm: nn.LayerNorm | nn.GroupNorm, input: Tensor, shape: tuple[int, ...], probe: Any
) -> tuple[torch.dtype, torch.dtype] | None:
    """None where ``input`` has the dtype of ``norm``'s weights; else that dtype and the one
    torch's kernel gives alone, asked with plain empty tensors of the same dtypes
    (``probe(x, weight, bias)``, ``x`` of ``(0, *shape)``): where it refuses the mix, its own
    error is raised, as alone."""
    w = norm.weight if norm.weight is not None else norm.bias
    if w is None or input.dtype == w.dtype:
        return None

    def empty(t: Tensor | None) -> Tensor | None:
        return None if t is None else torch.empty(t.shape, dtype=t.dtype, device=t.device)

    x = torch.empty((0, *shape), dtype=input.dtype, device=input.device)
    return w.dtype, probe(x, empty(norm.weight), empty(norm.bias)).dtype


class BatchableLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` that refuses or rounds an input of another dtype than its weights as
    torch's kernel does alone (``_alone_dtype``)."""

    def forward(self, input: Tensor) -> Tensor:
        shape = tuple(self.normalized_shape)
        mixed = _alone_dtype(
            self, input, shape, lambda x, w, b: F.layer_norm(x, shape, w, b, self.eps)
        )
        if mixed is None:
            return super().forward(input)
        return super().forward(input.to(mixed[0])).to(mixed[1])


class BatchableGroupNorm(nn.GroupNorm):
    """``nn.GroupNorm`` that lays a channels-last CPU input out as torch does, in ops ``vmap``
    batches.

    torch's CPU ``group_norm`` runs ``native_group_norm`` on ``input.contiguous(memory_format=
    input.suggest_memory_format())``: a channels-last input runs the channels-last kernel and
    gives a channels-last output. The twin makes the same layout by permuting to channels
    last, ``contiguous()``, and back (what ``contiguous(channels_last)`` gives), and calls
    ``native_group_norm`` as torch does: the same kernel, output layout and dropout masks
    after it as alone. Other inputs (and other devices, where torch uses ``contiguous()``)
    take torch's ``forward``.
    """

    def forward(self, input: Tensor) -> Tensor:
        groups = self.num_groups
        alone = _alone_dtype(
            self,
            input,
            (self.num_channels,),
            lambda x, w, b: F.group_norm(x, groups, w, b, self.eps),
        )
        if alone is not None:
            return self.forward(input.to(alone[0])).to(alone[1])
        cpu = input.device.type == "cpu" and not input.is_contiguous()  # fast path first
        if not cpu or suggest_memory_format(input) == torch.contiguous_format:
            return super().forward(input)
        last = (0, *range(2, input.dim()), 1)  # channels-last dims, then back
        x = input.permute(last).contiguous().permute(0, -1, *range(1, input.dim() - 1))
        n, c = x.shape[:2]
        hxw = math.prod(x.shape[2:])
        out = torch.native_group_norm(
            x, self.weight, self.bias, n, c, hxw, self.num_groups, self.eps
        )
        return out[0]
