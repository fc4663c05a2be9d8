"""What masked members keep and what a failed update gives back, written once.

An update writes parameters and state in place. :class:`Snapshot` (a component each
:class:`~vmapens.optim.StackedOptimizer` has) copies what the update will write, so that a
failed update can be undone and :func:`keep_masked_` can give the members outside a mask their
old values, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from .._checks import column
from ._kinds import real_views

__all__ = ["Rule", "Snapshot", "keep_masked_", "step_one", "tensors_of"]

#: ``rule(params, grads, state, group)``: one step in place (see ``StackedOptimizer.rule``).
Rule = Callable[[list[Tensor], list[Tensor], dict[str, Any], dict[str, Any]], None]


def keep_masked_(tensors: list[Tensor], old: list[Tensor], mask: Tensor | list[Tensor]) -> None:
    """Members where ``mask`` is False get their ``old`` rows back in every tensor.

    Args:
        tensors: Stacked tensors ``[n, ...]`` (or per-member ``[n]`` counters), updated in place.
        old: Their values before the update, in the same order.
        mask: Bool ``[n]``: the members that keep their new values, on any device (a CPU
            mask for CUDA parameters, as ``torch.tensor([...])`` makes it); or one per tensor.

    The update has written by now, so this must not leave it half kept: every row is computed
    before the first copy, and a failure (a mask that cannot reach the tensors' device, an
    interrupt between two copies) puts every tensor back as it was before the update.
    """
    if not tensors:  # nothing stepped (no parameter had a gradient)
        return
    masks = [mask] * len(tensors) if isinstance(mask, Tensor) else mask
    try:
        kept = [
            torch.where(column(m.to(t.device), t), t, before)
            for t, before, m in zip(tensors, old, masks, strict=True)
        ]
        torch._foreach_copy_(tensors, kept)
    except BaseException:
        Snapshot.restore(tensors, old)
        raise


class Snapshot:
    """Copies of the tensors an update writes, in one buffer per dtype kept from step to step.

    Fresh clones every step would make the CPU allocator hand pages back and fault them in
    again, so the copies are views of buffers planned once and refilled by one
    ``torch._foreach_copy_``. The plan is kept while the tensors are the same objects, in the
    same order, and the caller's ``layout`` token is unchanged: the caller changes it whenever
    a tensor's dtype, shape or device may have changed in place (``ens.double()`` keeps the
    ``Parameter`` objects and swaps their data), so the per-step check is one tuple of ids.
    The planned tensors are held, so that an id cannot be reused by another tensor while the
    plan stands. While tracing for ``torch.compile`` it clones instead: a compiled graph runs
    whole or not at all, so only a mask needs the copy there.
    """

    def __init__(self) -> None:
        self._key: tuple = ()
        self._tensors: list[Tensor] = []
        self._old: list[Tensor] = []

    def take(self, tensors: list[Tensor], mask: Tensor | None, layout: object) -> list[Tensor]:
        """The old values of ``tensors`` (empty when neither a mask nor a rollback needs them).

        Called under ``torch.no_grad()``, as the update itself is.

        Args:
            tensors: What the update writes.
            mask: The members that step (None: all); while compiling only a mask needs copies.
            layout: Equal from call to call while no tensor's dtype, shape or device changed.
        """
        if torch.compiler.is_compiling():
            return [] if mask is None else [t.clone() for t in tensors]
        if not tensors:
            return []
        key = (layout, tuple(map(id, tensors)))
        if key != self._key:
            self._plan(key, tensors)
        torch._foreach_copy_(self._old, tensors)
        return self._old

    def _plan(self, key: tuple, tensors: list[Tensor]) -> None:
        kinds: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for i, t in enumerate(tensors):
            kinds.setdefault((t.dtype, t.device), []).append(i)
        old: list[Tensor] = list(tensors)
        for (dtype, device), rows in kinds.items():
            sizes = [tensors[i].numel() for i in rows]
            buffer = torch.empty(sum(sizes), dtype=dtype, device=device)
            for i, chunk in zip(rows, buffer.split(sizes), strict=True):
                old[i] = chunk.view(tensors[i].shape)
        self._key, self._tensors, self._old = key, list(tensors), old

    @staticmethod
    def restore(tensors: list[Tensor], old: list[Tensor]) -> None:
        """Put every tensor back as it was when ``old`` was taken (after a failed update)."""
        if old:
            torch._foreach_copy_(tensors, old)


def step_one(
    rule: Rule,
    param: Tensor,
    grad: Tensor,
    tensors: Mapping[str, Tensor | None],
    counters: Mapping[str, Tensor],
    group: dict[str, Any],
    mask: Tensor | None = None,
) -> None:
    """``rule`` on one stacked tensor, in place: what the single-tensor ``*_update_`` run.

    Args:
        rule: The update rule.
        param: Stacked parameter [n, ...].
        grad: Its gradient.
        tensors: Its state tensors by name (None: absent).
        counters: The [n] counters (torch's scalar dtype) (``step``, ...).
        group: Hyperparameters and flags; ``fused`` is off (same bits as the foreach form).
        mask: Optional bool [n]; members where it is False come out bit-identical.
    """
    state: dict[str, Any] = {k: [v] for k, v in tensors.items() if v is not None}
    state.update(counters)
    written = tensors_of([param], state)
    before = None if mask is None else [t.clone() for t in written]
    # A complex tensor steps as its real pairs, as the optimizers step it (``real_views``).
    params, grads, views = real_views(([param], [grad], state))
    rule(params, grads, views, {**group, "fused": False, "mask": None})
    if mask is not None and before is not None:
        keep_masked_(written, before, mask)


def tensors_of(params: list[Tensor], state: dict[str, Any]) -> list[Tensor]:
    """Everything a rule writes: the parameters, their state lists and the shared counters."""
    out = list(params)
    for v in state.values():
        out += v if isinstance(v, list) else [v]
    return out
