"""Self-contained pieces of ``StackedModule`` (``vmapens._storage``): what its modules and
parameters follow, each member's memory format on a stacked tensor, and the hint a refused
state dict of another ensemble size gets."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ._attributes import Watched
from ._ensemble_parts import CHANNELS_LAST
from ._stacking import recomputed

__all__ = [
    "in_mode",
    "member_count_hint",
    "member_format",
    "metadata_of_member",
    "padded_values",
    "paired",
]

#: ``StackedModule._followers``: (template module, runner or padded module) pairs; (stacked
#: parameter, template parameter) pairs; weight_norm's (module, name, meta tensor); the flags
#: ``follow_flags`` last synced; the template's plain attributes (``vmapens._attributes``).
Followers = tuple[
    list[tuple[nn.Module, nn.Module]],
    list[tuple[torch.Tensor, torch.Tensor]],
    list[tuple[nn.Module, str, torch.Tensor]],
    list[bool],
    Watched,
]


def paired(
    template: nn.Module,
    runner: nn.Module,
    padded: Sequence[nn.Module],
    stacked: Mapping[str, torch.Tensor],
) -> Followers:
    """What ``StackedModule._follow_template`` syncs, paired once (it runs before every call of
    the members): the runner's and padded templates' modules with the template's, for their
    train/eval modes and plain attributes, and each stacked parameter with its template twins,
    for the grad flags."""
    attributes = Watched(template, runner, padded)  # pairs the modules by name
    modules: list[tuple[nn.Module, nn.Module]] = [
        (t, f)
        for t, followers in zip(attributes.modules, attributes.followers, strict=True)
        for f, _ in followers
    ]
    grads: list[tuple[torch.Tensor, torch.Tensor]] = [
        (stacked[name], meta) for t in (template, *padded) for name, meta in t.named_parameters()
    ]
    # weight_norm's tensors, which a forward leaves in the meta modules (``Ensemble.guard``).
    hooked: list[tuple[nn.Module, str, torch.Tensor]] = [
        (m, name, torch.empty_like(m.__dict__[name], device="meta"))
        for t in (template, runner, *padded)
        for m, name, _ in recomputed(t)
    ]
    return modules, grads, hooked, [p.requires_grad for p, _ in grads], attributes


@contextlib.contextmanager
def in_mode(
    root: nn.Module, training: bool, modules: Iterable[nn.Module], then: Callable[[], None]
) -> Iterator[None]:
    """``root.train(training)`` inside; afterwards each of ``modules`` is back in its own mode
    (where ``root.train(not training)`` would also switch a submodule set apart, a BatchNorm
    the user froze in eval mode), then ``then()`` runs (the ensemble's ``_follow_template``,
    for the modules it runs). ``modules`` must hold every module ``root.train`` reaches."""
    kept = [(m, m.training) for m in modules]
    try:
        root.train(training)
        yield
    finally:
        for m, mode in kept:
            m.training = mode
        then()


#: The rank each channels-last format is for.
_LAST = {fmt: rank for rank, fmt in CHANNELS_LAST.items()}


def member_format(t: torch.Tensor, fmt: torch.memory_format) -> torch.Tensor:
    """``t`` (stacked: ``[n, *member]``) with each member laid out as ``member.to(
    memory_format=fmt)`` would be; tensors torch leaves alone (not 4-D or 5-D) as they are."""
    if t.dim() - 1 not in (4, 5) or fmt == torch.preserve_format:
        return t
    if fmt == torch.contiguous_format:
        return t.contiguous()
    if _LAST.get(fmt) != t.dim() - 1:
        rank = {4: "4", 5: "5"}.get(_LAST.get(fmt, 0), "?")
        raise RuntimeError(f"required rank {rank} tensor to use {fmt} format")
    order = [0, 1, *range(3, t.dim()), 2]  # the member's channels (dim 2 here) last
    inverse = [order.index(d) for d in range(t.dim())]
    return t.permute(order).contiguous().permute(inverse)


def member_count_hint(
    mismatched: Sequence[tuple[object, torch.Tensor]], n: int, *, padded: bool = False
) -> list[str]:
    """The one error message to add (or none) when every refused ``(value, target)`` pair differs
    in dim 0 alone, by one count: a state dict of an ensemble of another size; or when every
    value is one member's (no member dim; within the padded shape where members differ in size,
    ``padded``): a member's own state dict. Torch's per-key "size mismatch" text says neither."""
    one = bool(mismatched) and all(
        isinstance(value, torch.Tensor)
        and value.dim() == target.dim() - 1
        and (value.shape == target.shape[1:] or padded and _within(value.shape, target.shape))
        for value, target in mismatched
    )
    if one:
        return [
            "this is one member's state dict (no member dim): load it into a member module "
            "(`ens[i]`'s class), or stack members with `Ensemble.from_modules`"
        ]
    counts = {
        value.shape[0]
        if isinstance(value, torch.Tensor)
        and value.dim() == target.dim() > 0
        and value.shape[1:] == target.shape[1:]
        else None
        for value, target in mismatched
    }
    if len(counts) != 1 or None in counts:
        return []
    return [
        f"the state dict holds {counts.pop()} members per tensor, this ensemble {n}: select the "
        "members first (other.select(rows).state_dict()) or load one member's state dict into "
        "ens[i]'s class"
    ]


def _within(member: torch.Size, stacked: torch.Size) -> bool:
    """Whether a member's shape fits in a padded stacked one, dim by dim."""
    return all(a <= b for a, b in zip(member, stacked[1:], strict=True))


def padded_values(
    pending: Sequence[tuple[str, str, torch.Tensor, object]], padding: Any
) -> list[str]:
    """The error messages for values of a state dict being loaded (``(key, name, target,
    value)``) that are not 0 where ``padding`` (a ``vmapens._padding.Padding``, or None) pads
    this ensemble's members: a state dict of members of other sizes, or of the same sizes in
    another order, has the same padded shapes, and loading it would give each member another's
    entries, with no size mismatch to refuse it by (plain torch refuses members of other
    sizes)."""
    if padding is None:
        return []
    shaped = {n: t for _, n, t, v in pending if isinstance(v, torch.Tensor) and v.shape == t.shape}
    masks = padding.masks(shaped)
    bad = [key for key, name, _, value in pending if name in masks and isinstance(value, torch.Tensor)
           and bool(value.detach()[~masks[name].bool().to(value.device)].ne(0).any())]  # fmt: skip
    return [
        f"{key}: non-zero values where this ensemble pads a member: a state dict of members of "
        "other sizes (or of these sizes in another order), which would give each member "
        "another's entries; load it into an ensemble built from the same factories, in order"
        for key in bad
    ]


def metadata_of_member(destination: Any, prefix: str, member: Mapping[str, Any] | None) -> None:
    """The member's ``_metadata`` (each submodule's ``_version``, ``member``) into the
    ``_metadata`` of a state dict being saved (``destination``), under ``prefix``, as a plain
    module's ``state_dict`` writes it: without it, a state dict that lacks BatchNorm's
    ``num_batches_tracked`` reads as one of an old version and loads, where torch refuses it."""
    metadata = getattr(destination, "_metadata", None)
    if metadata is None or member is None:
        return
    for path, local in member.items():
        metadata[prefix + path if path else prefix[:-1]] = dict(local)
