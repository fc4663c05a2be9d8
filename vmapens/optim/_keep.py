"""What masked members keep and what a failed update gives back, written once.

An update writes parameters and state in place. :class:`Snapshot` (a component each
:class:`~vmapens.optim.StackedOptimizer` has) copies what the update will write, so that a
failed update can be undone and :func:`keep_masked_` can give the members outside a mask their
old values, bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._checks import column

__all__ = ["Snapshot", "keep_masked_"]


def keep_masked_(tensors: list[Tensor], old: list[Tensor], mask: Tensor) -> None:
    """Members where ``mask`` is False get their ``old`` rows back in every tensor.

    Args:
        tensors: Stacked tensors ``[n, ...]`` (or per-member ``[n]`` counters), updated in place.
        old: Their values before the update, in the same order.
        mask: Bool ``[n]``: the members that keep their new values.
    """
    for t, before in zip(tensors, old, strict=True):
        t.copy_(torch.where(column(mask, t), t, before))


class Snapshot:
    """Copies of the tensors an update writes, in buffers reused from step to step.

    Fresh clones every step would make the CPU allocator hand pages back and fault them in
    again; the buffers are kept while the tensors (by identity, shape, dtype, device) are.
    While tracing for ``torch.compile`` it clones instead: a compiled graph runs whole or not
    at all, so only a mask needs the copy there.
    """

    def __init__(self) -> None:
        self._key: tuple = ()
        self._buffers: list[Tensor] = []

    def take(self, tensors: list[Tensor], mask: Tensor | None) -> list[Tensor]:
        """The old values of ``tensors`` (empty when neither a mask nor a rollback needs them)."""
        if torch.compiler.is_compiling():
            return [] if mask is None else [t.clone() for t in tensors]
        if not tensors:
            return []
        key = tuple((id(t), t.shape, t.dtype, t.device) for t in tensors)
        if key != self._key:
            self._key, self._buffers = key, [torch.empty_like(t) for t in tensors]
        torch._foreach_copy_(self._buffers, tensors)
        return self._buffers

    @staticmethod
    def restore(tensors: list[Tensor], old: list[Tensor]) -> None:
        """Put every tensor back as it was when ``old`` was taken (after a failed update)."""
        if old:
            torch._foreach_copy_(tensors, old)
