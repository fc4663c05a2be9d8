"""Whole-tensor ``max``/``min``/``median``/``nanmedian`` under vmap: ties split as alone.

Alone, ``torch.max(t)`` (no ``dim``) and its kin differentiate with torch's
``evenly_distribute_backward``: every element equal to the result gets ``grad / count``.
functorch batches them with the ``dim`` overload (``max(t.flatten(1), 1)``), whose backward
gives the whole gradient to one index: under ``vmap`` + ``loss.backward()`` (the ensemble's
eager forward and step) a member with a tie trains otherwise than alone, silently
(``vmap(grad(f))`` is right: its autograd runs above the batching rule).

The rule here computes the same value, ``v = max(t.flatten(1), 1)`` (detached), and returns
``v + where(mask, t - v, 0).sum(1) / mask.sum(1)``: the added term is exactly zero (the masked
elements equal ``v``), and its gradient is ``mask / count``, torch's split (``mask`` the NaNs
where the result is NaN, as torch's). :mod:`._attention` registers it with its own rules and
runs it inside its context only, at the ensemble's own vmap level; outside it (and at a vmap of
the user's own inside a forward, as alone), torch's reduction runs as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch._C._functorch import _add_batch_dim, _unwrap_batched

from ._vmap_rules import below_vmap, current_level, outermost, override

__all__ = ["register_tie_rules"]

_BY_DIM = {
    "max": torch.ops.aten.max.dim,
    "min": torch.ops.aten.min.dim,
    "median": torch.ops.aten.median.dim,
    "nanmedian": torch.ops.aten.nanmedian.dim,
}


def register_tie_rules(lib: torch.library.Library, active: Callable[[], bool]) -> None:
    """Register the four rules on ``lib`` (``aten``, ``IMPL``); each splits ties as alone
    while ``active()``, and reduces as torch's own rule otherwise."""
    for name in _BY_DIM:
        override(lib, name, _rule(name, active))


def _rule(name: str, active: Callable[[], bool]) -> Any:
    whole, by_dim = getattr(torch.ops.aten, name).default, _BY_DIM[name]

    def rule(keyset: Any, t: Tensor) -> Tensor:
        level = current_level()
        x, bdim = _unwrap_batched(t, level)
        with below_vmap():
            if bdim is None:
                return whole(x)
            flat = x.movedim(bdim, 0).reshape(x.shape[bdim], -1)  # 0-d members too
            if not (active() and flat.is_floating_point() and outermost(level)):
                return _add_batch_dim(by_dim(flat, 1)[0], 0, level)
            v = by_dim(flat.detach(), 1, True)[0]
            mask = torch.where(v.isnan(), flat.isnan(), flat == v)
            finite = torch.where(v.isfinite(), v, 0)
            tied = torch.where(mask, flat - finite, 0).sum(1, keepdim=True)
            # `v - (-tied) / count`, not `v + tied / count`: the same value and gradient, and
            # a -0.0 result stays -0.0 (-0.0 + 0.0 is +0.0).
            out = v - (-tied) / mask.sum(1, keepdim=True)
        return _add_batch_dim(out[:, 0], 0, level)

    return rule
