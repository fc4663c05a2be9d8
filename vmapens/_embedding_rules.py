"""``F.embedding`` under vmap with per-member indices and per-member weights: as alone.

functorch's rule for ``aten::embedding`` with both the weight and the indices batched stacks
the members' tables into one (``[n * V, D]``) and offsets member ``i``'s indices by ``i * V``.
Two things alone does are lost, silently: an index out of range (``V``, or a negative one)
reads a neighbour's row instead of raising ``IndexError`` (and trains that row on this
member's loss), and ``padding_idx`` is passed on unchanged: under ``vmap`` + ``backward()``
(the ensemble's eager forward and step) only member 0's padding row keeps its zero gradient
(``vmap(grad(...))`` is right: ``embedding_dense_backward``'s rule fills every member's).
One table shared by the members (requiring grad) read at per-member indices with
``scale_grad_by_freq=True`` had its gradient scaled by the counts over all members' indices;
here each member counts its own. ``nn.Embedding`` has a twin
(``_batchable.BatchableEmbedding``); ``F.embedding`` written in a forward reaches this rule only.

While ``active()`` (the ensemble's calls), at the ensemble's own vmap level, the rule checks
the range per member and reads every member's padding row detached; otherwise (a vmap of the
user's own inside a forward included, as alone) it computes as torch's own rule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch._C._functorch import _add_batch_dim, _unwrap_batched

from ._vmap_rules import below_vmap, current_level, current_vmap, outermost, override

__all__ = ["register_embedding_rules"]

_aten = torch.ops.aten


def register_embedding_rules(lib: torch.library.Library, active: Callable[[], bool]) -> None:
    """Register the rule on ``lib`` (``aten``, ``IMPL``)."""
    override(lib, "embedding", _forward(active))


def _offsets(idx: Tensor, n: int, rows: int) -> Tensor:
    """``i * rows`` for member ``i``, shaped to add to ``idx`` (members first)."""
    return (torch.arange(n, device=idx.device) * rows).view(n, *([1] * (idx.dim() - 1)))


def _check_range(idx: Tensor, rows: int) -> None:
    ok = ((idx >= 0) & (idx < rows)).all()
    if torch.compiler.is_compiling():
        torch._assert_async(ok, "embedding: index out of range in self")
    elif not bool(ok):
        raise IndexError("index out of range in self")


def _forward(active: Callable[[], bool]) -> Any:
    def rule(keyset: Any, weight: Tensor, indices: Tensor, padding_idx: int = -1,
             scale_grad_by_freq: bool = False, sparse: bool = False) -> Tensor:  # fmt: skip
        level = current_level()
        w, wb = _unwrap_batched(weight, level)
        idx, ib = _unwrap_batched(indices, level)
        with below_vmap():
            if (
                wb is None
                and ib is not None
                and scale_grad_by_freq
                and active()
                and outermost(level)
            ):
                w, wb = w.expand(current_vmap().batch_size(), *w.shape), 0  # each its own count
            if wb is None:  # one table, per-member indices: torch's own call
                out = _aten.embedding(w, idx, padding_idx, scale_grad_by_freq, sparse)
                return out if ib is None else _add_batch_dim(out, ib, level)
            w = w.movedim(wb, 0)
            n, rows = w.shape[0], w.shape[1]
            if ib is None:  # shared indices: the members' columns side by side
                flat = w.movedim(0, 1).flatten(1)
                out = _aten.embedding(flat, idx, padding_idx, scale_grad_by_freq, sparse)
                return _add_batch_dim(out.unflatten(-1, (n, -1)).movedim(-2, 0), 0, level)
            idx = idx.movedim(ib, 0)
            if active() and outermost(level):
                _check_range(idx, rows)
                if padding_idx >= 0:  # every member's padding row read detached
                    pad = torch.arange(rows, device=w.device).unsqueeze(-1) == padding_idx
                    w, padding_idx = torch.where(pad, w.detach(), w), -1
            flat_idx = idx + _offsets(idx, n, rows)
            out = _aten.embedding(
                w.flatten(0, 1), flat_idx, padding_idx, scale_grad_by_freq, sparse
            )
            return _add_batch_dim(out, 0, level)

    return rule
