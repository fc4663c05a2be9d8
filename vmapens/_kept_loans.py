"""What a forward kept, lent to the losses and metrics that read it (``ens.template.kl``).

A VAE's loss adds ``model.kl``, which its forward set; a mixture of experts' adds each
layer's ``aux_loss``. The ensemble stacks such values on the template, ``[n, ...]``
(``vmapens._kept``). A loss run once per member reads its member's own there, as alone it
reads its module's: the step's and ``fit``'s loss, right after the member's forward, what
that turn kept (``loss_with_kept``); ``per_member`` and ``fit``'s metrics, after
``ens(x)``, the member's rows of the stacks (``lending``). The whole stack read there was
added to every member's loss: ``[n, n]`` losses, gradients of every member's KL in each.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ._kept import named_slots

__all__ = ["lending", "loss_with_kept"]

_NONE = object()  # no such attribute before


@contextlib.contextmanager
def _lent(slots: Iterable[tuple[dict[str, Any], str, Any]]) -> Iterator[None]:
    """Each ``(module __dict__, attribute, value)`` set there meanwhile, then given back."""
    lent = []
    for owned, key, value in slots:
        lent.append((owned, key, owned.get(key, _NONE)))
        owned[key] = value
    try:
        yield
    finally:
        for owned, key, old in reversed(lent):
            if old is _NONE:
                owned.pop(key, None)
            else:
                owned[key] = old


def loss_with_kept(
    loss_fn: Callable, out: Any, target: Any, template: nn.Module, kept: dict[str, torch.Tensor]
) -> Any:
    """``loss_fn(out, target)`` with the tensors one run's forward ``kept`` (``KeptSlots.new``:
    a member's, or a turn's batched ones) set on the template's module of the same name
    meanwhile: a ``loss_fn`` that reads ``ens.template.moe.aux_loss`` reads the member's own
    there, as alone it reads its module's (it read ``__init__``'s value)."""
    with _lent((vars(module), key, value) for module, key, value in named_slots(template, kept)):
        return loss_fn(out, target)


def lending(fn: Callable, stacks: list[tuple[dict[str, Any], str, Any]]) -> Callable:
    """``fn`` taking one more argument first, the rows of ``stacks`` (``kept_stacks``; mapped
    over the members, each member's own), set where the stacks are while it runs."""

    def run(rows: list[Any], *args: Any, **kwargs: Any) -> Any:
        with _lent((owned, key, row) for (owned, key, _), row in zip(stacks, rows, strict=True)):
            return fn(*args, **kwargs)

    return run
