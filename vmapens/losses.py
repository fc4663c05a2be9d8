"""Per-member losses: one value per member, whose sum trains each member as if alone."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch
from torch import nn
from torch.func import vmap
from torch.utils import _pytree as pytree

from ._attention import batched_attention
from ._checks import flat_dims, mapped_sizes, warn_stacked_keywords
from ._kept import kept_somewhere, kept_stacks
from ._kept_loans import Lending
from ._plain_turns import PlainTurns
from ._precision import autocast_members
from ._unbatchable import NARROW_GATHER, NO_STORAGE

__all__ = ["per_member"]

# What torch.func.vmap says of a function that reads tensor values: a Python branch on one
# (``nn.GaussianNLLLoss`` checks ``var < 0``), ``.item()``, a boolean mask as an index,
# ``masked_select`` over a per-member mask (``nn.CrossEntropyLoss`` with ``weight``,
# ``ignore_index`` and ``label_smoothing`` on per-member targets).
_READS_VALUES = (
    "data-dependent control flow",
    ".item()",
    "dynamic shape",
    "a differently shaped Tensor",
)
# What it says of an op it has no batching rule for (``torch.equal``, ``torch.allclose``,
# ``narrow`` at a tensor start): each member's slice runs it as alone.
_NO_RULE = ("Batching rule not implemented for", "isn't supported yet")


def per_member(loss_fn: Callable[..., torch.Tensor], in_dims: Any = (0, None)) -> Callable:
    """Wrap a loss so it returns one value per member, shape ``[n]``.

    The ensemble's training loss is the *sum* of these: the gradient of the sum with respect
    to member ``i``'s parameters is exactly the gradient of member ``i``'s own loss, so every
    member trains as it would alone. A mean would scale each member's gradient by ``1/n``.

    The loss runs under ``torch.func.vmap``. A loss that reads tensor values, which vmap
    cannot batch (``nn.GaussianNLLLoss`` checks its variances with an ``if``; ``.item()``,
    ``.tolist()``; a boolean mask as an index), runs on each member's slice in turn instead: the same values
    and gradients, one call per member. Under ``torch.autocast`` each member's loss gets
    autocast's casts as it would alone (``cross_entropy`` in float32, for one), which autocast
    wrapped around vmap would miss (docs/semantics.md, "Mixed precision"). An op vmap has no
    rule for (``torch.equal``) runs member by member too, and a loss module's plain attributes
    (a call counter) start each member's run as the call found them.

    A loss that reads what the forward kept on its module (``ens.template.kl``, stacked
    ``[n, ...]`` there after ``ens(x)``) reads each member's own rows, as alone it reads its
    module's: the stacks are mapped with the outputs. One that empties such a list or dict
    (``m.acts.clear()`` after reading it) empties the stack.

    Args:
        loss_fn: ``(output, target) -> scalar``, e.g. ``nn.BCELoss()`` or a function.
        in_dims: as in ``torch.func.vmap``; the default ``(0, None)`` maps the stacked output
            and shares the target. Use ``(0, 0)`` for per-member targets.

    Returns:
        ``(output, target) -> Tensor[n]``.

    Example:
        >>> from torch import nn
        >>> loss = per_member(nn.MSELoss())(torch.zeros(4, 8, 1), torch.ones(8, 1))
        >>> loss.shape
        torch.Size([4])
    """
    if not callable(loss_fn):
        raise TypeError(f"per_member: `loss_fn` must be callable, got {type(loss_fn).__name__}")

    def loss(*args: Any, **kwargs: Any) -> torch.Tensor:
        flat = isinstance(in_dims, (tuple, list)) and not any(
            isinstance(d, (tuple, list, dict)) for d in in_dims
        )
        if flat and len(in_dims) != len(args):  # vmap's own error prints two tree specs
            raise ValueError(
                f"per_member: `in_dims` has {len(in_dims)} entries, one per positional argument "
                f"of the loss, but it was called with {len(args)} ({in_dims!r}); pass one entry "
                "per argument, 0 for a stacked one, None for a shared one: e.g. "
                f"per_member(loss_fn, in_dims={(0, *[None] * max(len(args) - 1, 0))!r})"
            )
        warn_stacked_keywords(
            "per_member",
            in_dims,
            args,
            kwargs,
            "per_member(loss_fn, in_dims=(0, None, 0))(output, target, {name})",
        )
        # autocast casts below vmap's batching rules: a batched cross_entropy decomposes into
        # ops autocast leaves in bf16, where the member alone gets float32. The member's own
        # policy, applied per torch function (a no-op without an active autocast).
        tree: Any = (args, kwargs)
        tensors = [t for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor)]
        device = tensors[0].device.type if tensors else "cpu"
        fn, dims, mapped, lending = loss_fn, flat_dims(in_dims, len(args)), in_dims, None
        # A loss reading what the forward kept (``ens.template.kl``, stacked ``[n]``) reads its
        # member's rows, as alone its module's: the whole stack gave ``[n, n]``, silently.
        sizes = set()
        if kept_somewhere():  # the flat in_dims' sizes read directly: ~40 us less than pytree's
            sizes = mapped_sizes(args, dims) if dims is not None else _mapped_sizes(args, in_dims)
        if len(sizes) == 1 and (stacks := kept_stacks(*sizes)):
            fn = lending = Lending(loss_fn, stacks)
            every = in_dims if isinstance(in_dims, (tuple, list)) else [in_dims] * len(args)
            args, mapped = ([v for _, _, v in stacks], *args), (0, *every)
            dims = None if dims is None else [0, *dims]
        batched = vmap(autocast_members(fn, device), in_dims=mapped)
        # A loss module's plain state (a call counter for a warm-up): each member's run below
        # starts from it as the call found it, as alone with its own copy (it advanced 1 + n).
        # (torch's own loss modules keep none: not looked into)
        own = not type(loss_fn).__module__.startswith("torch.")
        turns = PlainTurns(loss_fn) if isinstance(loss_fn, nn.Module) and own else None
        try:
            with batched_attention():  # vmap's rules the ensemble's calls run (ties split)
                values = batched(*args, **kwargs)
        except RuntimeError as err:
            if not _unbatchable(err):
                raise
            if dims is None:  # nested in_dims: vmap's own error says what it could not do
                raise
            if lending is not None:
                lending.emptied.clear()  # the failed run's
                lending.reset.clear()
            values = _member_by_member(fn, dims, args, kwargs, turns)
            if values is None:  # not a tensor (a Python float has no gradient): vmap's error
                raise
        if lending is not None:
            lending.settle()
        return values

    return loss


def _mapped_sizes(args: tuple, in_dims: Any) -> set[int]:
    """The sizes of the mapped dims of ``args``' tensors, ``in_dims`` read as vmap reads it
    (nested too: ``((0, 0), None)`` for an output pair and a shared target)."""
    leaves, spec = pytree.tree_flatten(args)
    dims = pytree._broadcast_to_and_flatten(in_dims, spec)
    if dims is None:  # in_dims that do not fit: vmap's error says so
        return set()
    found = zip(leaves, dims, strict=True)
    return {
        t.shape[d]
        for t, d in found
        if d is not None and isinstance(t, torch.Tensor) and -t.dim() <= d < t.dim()
    }


def _unbatchable(err: RuntimeError) -> bool:
    """Whether ``err`` is vmap refusing a function that reads tensor values (``.item()``, an
    ``if`` on a tensor, ``.tolist()``, ``.numpy()``) or an op it has no rule for, or vmap's
    ``gather`` refusing the uint8 class indices that ``cross_entropy`` alone takes: it runs
    member by member instead."""
    said = str(err)
    reads = said.startswith("vmap: ") and any(m in said for m in _READS_VALUES)
    return reads or any(m in said for m in (*_NO_RULE, *NO_STORAGE, NARROW_GATHER))


def _member_by_member(
    loss_fn: Callable,
    dims: list[int | None],
    args: tuple,
    kwargs: dict,
    turns: PlainTurns | None = None,
) -> torch.Tensor | None:
    """``loss_fn`` on member ``i``'s slice of every mapped argument, for each ``i``, stacked;
    None if it returns anything but a tensor. ``turns``: the loss module's plain values, given
    back before each member's run (the failed vmap run was the first turn)."""
    (n,) = mapped_sizes(args, dims)  # vmap checked the mapped sizes agree before it ran

    def member(i: int) -> list[Any]:
        return [
            a if d is None else optree.tree_map(lambda t, d=d: t.select(d, i), a)
            for a, d in zip(args, dims)
        ]

    if turns is not None:
        turns.next_turn()  # the failed vmap run's
    values = []
    for i in range(n):
        if turns is not None:
            turns.next_turn()
        values.append(loss_fn(*member(i), **kwargs))
    return torch.stack(values) if all(isinstance(v, torch.Tensor) for v in values) else None
