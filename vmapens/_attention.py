"""Attention under ``torch.func.vmap`` on CPU: one folded kernel call instead of a member loop.

``F.scaled_dot_product_attention`` on CPU lowers to
``aten::_scaled_dot_product_flash_attention_for_cpu`` (and its ``_backward``), for which
functorch has no batching rule: under ``vmap`` each call falls back to a loop over the
members, with a "performance drop" warning.

Attention is independent along the leading batch dim, so the member dim can be folded into
it: ``[n, B, H, L, E] -> [n * B, H, L, E]``, one kernel call, then unfolded. While
:func:`batched_attention` is active (``Ensemble.guard`` enters it: every ensemble call) both
ops run that rule; outside it they run torch's loop, so other ``vmap`` code in the process is
unchanged.

Why the dispatcher and not a ``TorchFunctionMode``: a mode is popped while it handles a
Python-level overridable function, so the ``scaled_dot_product_attention`` call inside
``F.multi_head_attention_forward`` (``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer``)
never reaches it. A batching rule on the aten op sees every call, whoever makes it, and is
differentiated by the op's own autograd formula, under ``loss.backward()`` and
``torch.func.grad`` alike.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch._C._functorch import _add_batch_dim, _unwrap_batched

from ._embedding_rules import register_embedding_rules
from ._fixed_rules import register_fixed_rules
from ._index_rules import register_index_rules
from ._tie_reductions import register_tie_rules
from ._vmap_rules import below_vmap, current_vmap, members_first

__all__ = ["batched_attention", "fastpath_enabled"]

_FORWARD = "_scaled_dot_product_flash_attention_for_cpu"
_BACKWARD = "_scaled_dot_product_flash_attention_for_cpu_backward"
# Leading positional tensors of each op (the attention mask is keyword-only in both).
_N_TENSORS = {_FORWARD: 3, _BACKWARD: 6}
# What torch's own loop over the members says (functorch's BatchedFallback.cpp).
_SLOW = (
    "There is a performance drop because we have not yet implemented the batching rule for "
    "aten::{}. Please file us an issue on GitHub so that we can prioritize its implementation."
)

# The fast-path switch is process-wide, so one outermost entry turns it off for every thread
# and nesting depth and the last exit restores it: a per-entry save/restore would let one
# thread's exit turn the fast path back on under another thread still inside. The batching
# rule is registered at the first entry and stays (registering costs ~0.1 ms, too much for
# every training step); outside every context it does what torch does, so that other vmap
# code in the process (a bare torch.func recipe benchmarked beside an ensemble) is unchanged.
_lock = threading.Lock()
_depth = 0
_library: torch.library.Library | None = None
_fastpath = True
_efficient = True


@contextlib.contextmanager
def batched_attention() -> Iterator[None]:
    """Run CPU attention under ``torch.func.vmap`` as one call for all members.

    Inside the context:

    * ``F.scaled_dot_product_attention`` on vmapped inputs (directly, or inside
      ``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer``) runs as one fused CPU
      kernel call with the member dim folded into the batch dim, forward and backward, with
      no "performance drop" warning. Results and gradients equal each member run alone.
      Calls without vmapped inputs are untouched. Calls that torch routes to the composite
      math path (``dropout_p > 0``, an attention mask that requires grad) were never
      looped and are untouched too; dropout keeps ``vmap``'s ``randomness`` semantics.
      A mask that requires grad but reaches the kernel anyway (``vmap`` hides the flag
      from SDPA: ``nn.MultiheadAttention``'s learned float ``attn_mask``) runs torch's
      math path, as the member alone does.
    * CUDA's memory-efficient attention kernel, whose backward fails under ``vmap``, is
      switched off (``torch.backends.cuda.enable_mem_efficient_sdp(False)``), restored as
      the fast path below is; SDPA picks flash, cuDNN or the math path instead.
    * The ``nn.MultiheadAttention`` / ``nn.TransformerEncoder`` eval-mode fast path (fused
      encoder layer, nested tensors for ``src_key_padding_mask``), which ``vmap`` cannot
      batch at all, is switched off with ``torch.backends.mha.set_fastpath_enabled(False)``;
      the previous setting comes back when the outermost context exits, also when the
      body raises.

    It works under eager ``vmap`` + ``loss.backward()``, ``vmap(grad_and_value(...))``,
    and a ``torch.compile``-d function of either, provided the context is entered *outside*
    the compiled function (it is read while tracing; dynamo cannot trace entering it).
    Contexts nest and may be entered from several threads; while any is open, ``vmap`` in
    every thread runs the rule. Outside every context vmapped attention is torch's loop over
    the members, with its warning, as in a process without vmapens.

    Returns:
        A context manager yielding ``None``.

    Example:
        >>> import torch.nn.functional as F
        >>> q = torch.randn(3, 2, 4, 5, 8)  # 3 members
        >>> with batched_attention():
        ...     out = torch.func.vmap(F.scaled_dot_product_attention)(q, q, q)
        >>> out.shape
        torch.Size([3, 2, 4, 5, 8])
    """
    _enter()
    try:
        yield
    finally:
        _exit()


def fastpath_enabled() -> bool:
    """``torch.backends.mha.get_fastpath_enabled()`` as the user set it: what a member alone
    runs with, while the ensemble's calls have it off (``_encoder_twin`` reads it)."""
    return _fastpath if _depth else torch.backends.mha.get_fastpath_enabled()


def _enter() -> None:
    global _depth, _library, _fastpath, _efficient
    with _lock:
        if _library is None:
            lib = torch.library.Library("aten", "IMPL")
            for name in (_FORWARD, _BACKWARD):
                lib.impl(name, _batching_rule(name), "FuncTorchBatched", with_keyset=True)
            register_tie_rules(lib, lambda: _depth > 0)  # whole-tensor max/min/median
            register_embedding_rules(lib, lambda: _depth > 0)  # per-member ids: as alone
            register_index_rules(lib, lambda: _depth > 0)  # t[:, idx] = v, t[p, :, i]: as alone
            register_fixed_rules(lib, lambda: _depth > 0)  # select_scatter, index_fill, ...
            _library = lib
        if _depth == 0:
            _fastpath = torch.backends.mha.get_fastpath_enabled()
            torch.backends.mha.set_fastpath_enabled(False)
            # CUDA's memory-efficient kernel under vmap fails in its backward ("LSE is not
            # correctly aligned", torch 2.11 on an H200, the bare recipe too); SDPA then picks
            # another kernel (flash, cuDNN or math). CPU has no such kernel: nothing changes.
            _efficient = torch.backends.cuda.mem_efficient_sdp_enabled()
            torch.backends.cuda.enable_mem_efficient_sdp(False)
        _depth += 1


def _exit() -> None:
    global _depth
    with _lock:
        _depth -= 1
        if _depth == 0:
            torch.backends.mha.set_fastpath_enabled(_fastpath)
            torch.backends.cuda.enable_mem_efficient_sdp(_efficient)


def _batching_rule(name: str) -> Any:
    op = getattr(torch.ops.aten, name).default
    n_tensors = _N_TENSORS[name]

    def rule(
        keyset: Any, *args: Any, attn_mask: Tensor | None = None, scale: float | None = None
    ) -> tuple[Tensor, ...]:
        interpreter = current_vmap()
        level, n = interpreter.level(), interpreter.batch_size()
        unwrapped = [_unwrap_batched(t, level) for t in args[:n_tensors]]
        mask, mask_dim = (None, None) if attn_mask is None else _unwrap_batched(attn_mask, level)
        rest = args[n_tensors:]
        with below_vmap():
            if mask_dim is None and all(d is None for _, d in unwrapped):
                return op(*(t for t, _ in unwrapped), *rest, attn_mask=mask, scale=scale)
            if _depth == 0:
                return _member_loop(name, op, level, n, unwrapped, rest, (mask, mask_dim), scale)
            # The query is argument 1 of the backward (after grad_out), 0 of the forward.
            query, query_dim = unwrapped[1 if name == _BACKWARD else 0]
            batch = query.shape[0] if query_dim is None else query.movedim(query_dim, 0).shape[1]
            folded = [_fold(t, d, n) for t, d in unwrapped]
            mask = _fold_mask(mask, mask_dim, n, batch)
            if name == _FORWARD and mask is not None and _learned(mask):
                # SDPA reads ``requires_grad`` off the vmapped mask, where it is always False,
                # so a learned mask that a view made 4-D (``nn.MultiheadAttention``'s float
                # ``attn_mask``) reaches this kernel, which cannot differentiate it. Alone,
                # torch runs its math path for such a mask: so does the ensemble.
                outs = _math_forward(folded, rest, mask, scale)
            else:
                outs = op(*folded, *rest, attn_mask=mask, scale=scale)
        return tuple(_add_batch_dim(o.unflatten(0, (n, -1)), 0, level) for o in outs)

    return rule


def _learned(mask: Tensor) -> bool:
    """Whether autograd records ``mask`` here: SDPA alone then takes its math path."""
    return mask.requires_grad and torch.is_grad_enabled()


def _math_forward(
    tensors: list[Tensor], rest: tuple, attn_mask: Tensor, scale: float | None
) -> tuple[Tensor, Tensor]:
    """The flash forward's ``(output, logsumexp)`` from torch's math path, differentiable in
    ``attn_mask``: the output is what SDPA computes for the member alone; the logsumexp (which
    an outer ``torch.func.grad`` hands to the flash backward) is the flash kernel's.

    ``tensors`` are the folded query, key and value; ``rest`` the op's ``dropout_p`` and
    ``is_causal``, where given.
    """
    query, key, value = tensors
    dropout_p = rest[0] if rest else 0.0
    is_causal = rest[1] if len(rest) > 1 else False
    heads = query.size(-3)
    gqa = key.size(-3) != heads
    out, _ = torch.ops.aten._scaled_dot_product_attention_math(
        query,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=gqa,
    )
    if gqa:
        key = key.repeat_interleave(heads // key.size(-3), -3)
    factor = query.size(-1) ** -0.5 if scale is None else scale
    # SDPA never passes ``is_causal`` with a mask: the math op above has refused that pair.
    scores = torch.matmul(query, key.transpose(-2, -1)).mul(factor) + attn_mask
    return out, scores.logsumexp(-1)


def _member_loop(
    name: str,
    op: Any,
    level: int,
    n: int,
    unwrapped: list[tuple[Tensor, int | None]],
    rest: tuple,
    mask: tuple[Tensor | None, int | None],
    scale: float | None,
) -> tuple[Tensor, ...]:
    """Outside every context, torch's own fallback: one call per member, stacked, and its
    warning (or its error where the fallback is switched off)."""
    if not torch._C._functorch._is_vmap_fallback_enabled():  # type: ignore[attr-defined]
        raise RuntimeError(
            f"Batching rule not implemented for aten::{name}. We could not generate a fallback."
        )
    warnings.warn(_SLOW.format(name), UserWarning, stacklevel=2)

    def member(t: Tensor | None, d: int | None, i: int) -> Tensor | None:
        return t if t is None or d is None else t.select(d, i)

    shards = [
        op(*(member(t, d, i) for t, d in unwrapped), *rest, attn_mask=member(*mask, i), scale=scale)
        for i in range(n)
    ]
    return tuple(_add_batch_dim(torch.stack(outs), 0, level) for outs in zip(*shards, strict=True))


def _fold(t: Tensor, bdim: int | None, n: int) -> Tensor:
    """``[n, B, ...]`` (member dim at ``bdim``, or none: shared) as ``[n * B, ...]``."""
    return members_first(t, bdim, n).flatten(0, 1)


def _fold_mask(mask: Tensor | None, bdim: int | None, n: int, batch: int) -> Tensor | None:
    """The attention mask for the folded batch: broadcastable to ``[n * batch, H, L, S]``."""
    if mask is None:
        return None
    if bdim is None:
        # A shared mask without a real batch dim broadcasts over the folded one as it is.
        if mask.dim() < 4 or mask.shape[0] == 1:
            return mask
        return mask.expand(n, *mask.shape).flatten(0, 1)
    mask = mask.movedim(bdim, 0)
    mask = mask.reshape(n, *[1] * (5 - mask.dim()), *mask.shape[1:])
    return mask.expand(n, batch, *mask.shape[2:]).flatten(0, 1)
