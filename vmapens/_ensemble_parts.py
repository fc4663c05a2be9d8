"""What ``Ensemble``'s constructors accept: the sequences they take, and members they refuse
(a ``torch.compile`` wrapper; ``nn.SyncBatchNorm`` in a sharded ensemble); the stacked storage
for a member's tensor, in its layout.

This file imports only torch, ``_members`` and ``_padding``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ._members import check_member, check_same, signature
from ._padding import check_pair

__all__ = [
    "CHANNELS_LAST",
    "check_factories",
    "check_layout",
    "check_modules",
    "refuse_compiled",
    "refuse_synced",
    "stacked_like",
]

#: The channels-last format of a tensor of each rank (``Module.to(memory_format=...)``'s).
CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


def _channels_last(t: torch.Tensor) -> bool:
    """Whether ``t`` is laid out channels-last (and not also plain contiguous)."""
    fmt = CHANNELS_LAST.get(t.dim())
    return fmt is not None and not t.is_contiguous() and t.is_contiguous(memory_format=fmt)


def stacked_like(t: torch.Tensor, n: int) -> torch.Tensor:
    """Empty storage for ``n`` members' ``t``: ``[n, *t.shape]``, each member's row laid out as
    ``t`` where ``t`` is channels-last (a factory's ``.to(memory_format=torch.channels_last)``),
    else contiguous. A conv's output follows its weight's layout, and a random op fills a
    tensor in memory order: a member stored contiguous drew other dropout masks than alone."""
    shape = (n, *t.shape)
    if not _channels_last(t):
        return torch.empty(shape, dtype=t.dtype, device=t.device)
    return torch.empty_strided(shape, (t.numel(), *t.stride()), dtype=t.dtype, device=t.device)


def check_factories(api: str, factories: Any) -> None:
    """``factories`` must be a non-empty sequence of zero-argument callables."""
    _check_sequence(api, "factories", factories, "zero-argument callables")
    for k, factory in enumerate(factories):
        if isinstance(factory, nn.Module) or not callable(factory):
            raise TypeError(
                f"{api}: `factories[{k}]` must be a zero-argument callable returning an "
                f"nn.Module, got {type(factory).__name__}"
            )


def check_modules(api: str, modules: Any, shard: bool = False) -> list[nn.Module]:
    """``modules`` as a list: a non-empty sequence (or an ``nn.ModuleList``, which
    ``torch.func.stack_module_state`` takes too) of initialised modules of one size and one
    setting (member 1's dropout rate would run as member 0's); with ``shard``, no
    ``nn.SyncBatchNorm`` (:func:`refuse_synced`), checked before any process group call."""
    if isinstance(modules, nn.ModuleList):
        modules = list(modules)
    _check_sequence(api, "modules", modules, "nn.Module")
    for i, module in enumerate(modules):
        check_member(module, i, api)
        refuse_compiled(api, module, i)
    reference = signature(modules[0])
    for i, module in enumerate(modules[1:], start=1):
        check_same(reference, module, i, api)
        check_pair(api, modules[0], module, i, padded=False)
    refuse_synced(api, shard, modules)
    return list(modules)


def refuse_compiled(api: str, member: nn.Module, i: int) -> None:
    """Refuse a member that is, or holds, a ``torch.compile`` wrapper (``OptimizedModule``).

    Its settings differ per wrapper (``_torchdynamo_wrapper_id``), so members were refused as
    "differing" at that attribute, and its compiled forward is not the member map's to batch.
    """
    for path, m in member.named_modules():
        if type(m).__name__ == "OptimizedModule" and isinstance(
            m._modules.get("_orig_mod"), nn.Module
        ):
            where = f"`{path}` of member {i}" if path else f"member {i}"
            raise ValueError(
                f"{api}: {where} is wrapped by torch.compile (OptimizedModule), which an "
                "ensemble cannot stack: give it the module torch.compile wraps "
                f"(`{path + '.' if path else ''}_orig_mod`, or build it without torch.compile) "
                "and compile the ensemble's step instead: make_step(..., compile=True) or "
                "fit(..., compile=True)"
            )


def refuse_synced(api: str, shard: bool, members: Sequence[nn.Module]) -> None:
    """Refuse ``nn.SyncBatchNorm`` in the members of a sharded ensemble (``shard=True``).

    In training it averages batch statistics over the process group's ranks, whose blocks
    hold other members (on GPUs; torch raises on CPU): no member would train as it would
    alone, where it computes plain BatchNorm over its own batch.
    """
    if not shard:
        return
    paths = sorted(
        {p or "(the member itself)" for m in members for p, sub in m.named_modules()
         if isinstance(sub, nn.SyncBatchNorm)}
    )  # fmt: skip
    if paths:
        raise ValueError(
            f"{api}: `shard=True` with nn.SyncBatchNorm in the members ({', '.join(paths)}): "
            "in training it averages batch statistics over the processes, whose blocks hold "
            "other members, so no member would train as it would alone; build the members "
            "with nn.BatchNorm1d/2d/3d, which is what each member computes alone (with no "
            "process group)"
        )


def _check_sequence(api: str, name: str, value: Any, of: str) -> None:
    if isinstance(value, nn.Module) or not isinstance(value, Sequence):
        modules = " or an nn.ModuleList" if of == "nn.Module" else ""
        raise TypeError(
            f"{api}: `{name}` must be a sequence (list or tuple){modules} of {of}, got "
            f"{type(value).__name__}"
        )
    if len(value) == 0:
        raise ValueError(f"{api}: `{name}` must not be empty")


def check_layout(api: str, name: str, t: torch.Tensor, first: torch.Tensor, member: int) -> None:
    """Refuse member ``member``'s ``t`` (``name``) laid out otherwise than member 0's row
    ``first`` (channels-last or not): the stack holds one layout, and a random op inside the
    member (dropout after a conv, an init through ``ens.apply``) fills a tensor in memory
    order, so a member stacked in another layout would draw other numbers than alone."""
    mine, theirs = _channels_last(t), _channels_last(first)
    if mine != theirs:
        said = {True: "channels-last", False: "contiguous"}
        raise ValueError(
            f"{api}: member {member}'s `{name}` is {said[mine]} and member 0's is "
            f"{said[theirs]}; the members are stacked in one layout, and a random op inside "
            "a member (dropout after a conv, an init through ens.apply) fills a tensor in "
            "memory order, so a member in another layout would draw other numbers than alone: "
            "build every member in one layout (.to(memory_format=torch.channels_last) on each, "
            "or on none)"
        )
