"""What ``Ensemble`` does to its members' modules: build member ``i`` from the stacked storage,
set ``requires_grad`` on the stacked parameters and the template together, and read or refuse
what indexing and calls are given."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from ._attributes import forward_set
from ._batchable import own_parametrized_classes_
from ._checks import to_index, warn_stacked_keywords
from ._copies import copy_member
from ._members import named_tensors
from ._padding import Padding
from ._stacking import recompute_

__all__ = [
    "check_call",
    "member_index",
    "member_module",
    "put_back",
    "refused_assignment",
    "set_flags_",
]


def member_module(
    template: nn.Module,
    runner: nn.Module,
    stacked: dict[str, torch.Tensor],
    padding: Padding | None,
    i: int,
) -> nn.Module:
    """Member ``i`` as a module of the user's class: a deep copy of its (meta) template (the
    ensemble's ``template``, or its size's when ``padding``) with row ``i`` of every stacked
    tensor (at its own size when ``padding``), cloned, and the plain values the forward set on
    ``runner``, the module the members ran (``forward_set``): a module trained alone keeps
    them (a flag set on the first call, a counter)."""
    set_by_forward = forward_set(template, runner)
    if padding is not None:
        template = padding.templates[padding.kind_of[i]]
    memo: dict[int, Any] = {}
    with torch.no_grad():
        for name, meta in named_tensors(template):
            row = stacked[name][i]
            value = (row if padding is None else padding.take(name, row, i)).clone()
            if isinstance(meta, nn.Parameter):
                value = nn.Parameter(value, requires_grad=meta.requires_grad)
            memo[id(meta)] = value
    # A class of its own per parametrized submodule: torch's remove_parametrizations on this
    # member deletes the property from its class, which a deep copy shares with the template.
    member = own_parametrized_classes_(copy_member(template, memo))
    modules = dict(member.named_modules())
    for path, values in set_by_forward.items():
        if path in modules:
            modules[path].__dict__.update(values)
    recompute_(member)
    return member


def set_flags_(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], flag: bool) -> None:
    """``requires_grad_(flag)`` on both tensors of each ``(stacked, template)`` pair: the two
    sides agree at once, whether or not the template's parameters are linked to the stacked ones
    yet (``_stacking.follow_flags``)."""
    for p, meta in pairs:
        if p.requires_grad != flag:
            p.requires_grad_(flag)
        if meta.requires_grad != flag:
            meta.requires_grad_(flag)


def member_index(index: Any) -> int | None:
    """``index`` as one member's index if it is an integer-like (int, numpy integer, 0-d integer
    tensor or 0-d numpy integer array, as ``nn.Sequential`` takes), else None (a selection)."""
    if type(index).__module__ == "numpy" and getattr(index, "ndim", None) == 0:
        index = index[()]  # np.array(2) -> np.int64(2); np.argmax(scores) gives the latter
    return to_index(index)


def refused_assignment(index: Any) -> str:
    """Why ``ens[index] = module`` is refused, and the way to the same result."""
    return (
        f"Ensemble: members cannot be assigned (`ens[{index!r}] = module`): all members live "
        "in one stacked storage, with one optimizer state; copy the module's values into the "
        "member instead (one size): sd = ens.state_dict(), then under torch.no_grad() "
        "sd[k][i].copy_(v) for each k, v in module.state_dict().items() (sd's tensors are the "
        "storage), or build a new ensemble with Ensemble.from_modules([...])"
    )


def check_call(args: tuple, kwargs: dict, in_dims: Any, backend: str) -> None:
    """Refuse what ``ens(*args, in_dims=..., **kwargs)`` cannot do as asked: ``in_dims`` with
    only keyword inputs (shared by every member: each ran on all members' slices, silently),
    and ``PackedSequence`` inputs, which vmap cannot batch (``backend="loop"`` runs them).
    Warn of a keyword tensor with one row per member beside mapped inputs (it stays shared)."""
    if isinstance(in_dims, int) and not isinstance(in_dims, bool) and not args and kwargs:
        raise ValueError(
            f"Ensemble: `in_dims` ({in_dims!r}) maps positional inputs only, and this call has "
            f"none: keyword inputs ({', '.join(kwargs)}) are shared by every member; pass the "
            "per-member inputs positionally, e.g. ens(x, in_dims=0)"
        )
    example = "ens(x, {name}, in_dims=(0, 0))"
    warn_stacked_keywords("Ensemble", in_dims, args, kwargs, example, rank=2)
    packed = [a for a in (*args, *kwargs.values()) if isinstance(a, PackedSequence)]
    if packed and backend == "vmap":
        raise TypeError(
            "Ensemble: PackedSequence inputs are not batched by vmap; pad the sequences "
            "(torch.nn.utils.rnn.pad_sequence) or build the ensemble with backend='loop'"
        )


def put_back(name: str, meta: torch.Tensor, module: nn.Module, *_: Any) -> None:
    """A forward hook: weight_norm's tensor, computed under vmap, back to its meta tensor."""
    setattr(module, name, meta)
