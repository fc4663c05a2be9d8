"""The eager member call without the per-call Python of ``torch.func.vmap``/``functional_call``.

An ensemble calls the same function on the same kind of arguments every step. Per call,
``torch.func.vmap`` flattens and checks the arguments' pytrees, and ``torch.func.functional_call``
walks the template's modules to find (and untie) the tensors it swaps in. At workload A's size
(15 two-layer MLPs) that Python costs as much as the kernels. Here it is done once:

* ``vmap_members`` runs the same C++ batching as ``torch.func.vmap`` (``_vmap_increment_nesting``,
  ``_add_batch_dim``, ``_remove_batch_dim``), so the kernels, and the results, are the same.
* ``call_member`` swaps the tensors into the slots that ``functional_call`` would (tied
  aliases included), planned once per module and set of names, and puts the old ones back.

Anything outside the plain case is handed to torch.func, which then does what it always does
(including raising its own errors): tracing by ``torch.compile``/``torch.export``, ``chunk_size``,
a mapped argument that is not a tensor or a tuple of tensors, a mapped size that is not ``n``,
names that are not a module's parameter or buffer, two names of one tied tensor.

Example:
    >>> lin = torch.nn.Linear(2, 1)
    >>> state = {"weight": torch.ones(3, 1, 2), "bias": torch.zeros(3, 1)}
    >>> vmap_members(lambda s, x: call_member(lin, s, (x,)), 3, "error", state, (torch.ones(2),),
    ...              (None,)).shape
    torch.Size([3, 1])
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._C._functorch import (
    _add_batch_dim,
    _remove_batch_dim,
    _vmap_decrement_nesting,
    _vmap_increment_nesting,
)
from torch._functorch.vmap import _maybe_remove_batch_dim, lazy_load_decompositions
from torch.func import functional_call, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["call_member", "vmap_members"]

#: (slots dict, name in it, state key, whether that key was given) per tensor to swap in.
_Plan = list[tuple[dict, str, str, bool]]
#: Per module: the plan for each tuple of state names (None: hand the call to functional_call).
_PLANS: weakref.WeakKeyDictionary[nn.Module, dict[tuple[str, ...], _Plan | None]] = (
    weakref.WeakKeyDictionary()
)


def _traced() -> bool:
    """Whether torch.compile or torch.export is tracing: they must see torch.func itself."""
    return torch.compiler.is_compiling() or torch.compiler.is_exporting()


def vmap_members(
    fn: Callable[..., Any],
    n: int,
    randomness: str,
    state: dict[str, torch.Tensor],
    args: tuple,
    in_dims: tuple,
    chunk_size: int | None = None,
) -> Any:
    """``vmap(fn, in_dims=(0, *in_dims), randomness=randomness)(state, *args)``, same result.

    Args:
        fn: ``(member_state, *member_args) -> tensor or pytree of tensors``.
        n: The number of members: every ``state`` tensor's leading size.
        randomness: As in ``torch.func.vmap``.
        state: The stacked tensors by name, each ``[n, ...]``.
        args: The positional arguments, mapped along ``in_dims`` (``None``: shared).
        in_dims: One int or ``None`` per argument.
        chunk_size: As in ``torch.func.vmap`` (not ``None``: torch.func runs the call).

    Returns:
        ``fn``'s output with the member dim first on every tensor.
    """
    if chunk_size is not None or _traced() or not _plain(n, state, args, in_dims):
        lifted = vmap(fn, in_dims=(0, *in_dims), randomness=randomness, chunk_size=chunk_size)
        return lifted(state, *args)
    lazy_load_decompositions()
    level = _vmap_increment_nesting(n, randomness)
    try:
        batched = {k: _add_batch_dim(t, 0, level) for k, t in state.items()}
        member_args = [_batched(a, d, level) for a, d in zip(args, in_dims, strict=True)]
        out = fn(batched, *member_args)
        if isinstance(out, torch.Tensor):
            return _remove_batch_dim(out, level, n, 0)
        flat, spec = tree_flatten(out)
        name = getattr(fn, "__name__", "fn")
        return tree_unflatten([_maybe_remove_batch_dim(name, o, level, n, 0) for o in flat], spec)
    finally:
        _vmap_decrement_nesting()


def _plain(n: int, state: dict[str, torch.Tensor], args: tuple, in_dims: tuple) -> bool:
    """Every mapped leaf a tensor of size ``n`` at its (valid) dim: torch.func's checks pass."""
    if not state or any(t.dim() == 0 or t.shape[0] != n for t in state.values()):
        return False
    for a, d in zip(args, in_dims, strict=True):
        if d is None:
            continue
        leaves = a if type(a) is tuple else (a,)
        for t in leaves:
            if not isinstance(t, torch.Tensor) or not -t.dim() <= d < t.dim() or t.shape[d] != n:
                return False
    return True


def _batched(arg: Any, dim: int | None, level: int) -> Any:
    if dim is None:
        return arg
    if type(arg) is tuple:
        return tuple(_add_batch_dim(t, dim, level) for t in arg)
    return _add_batch_dim(arg, dim, level)  # negative dims wrap in C++


def call_member(
    module: nn.Module,
    state: dict[str, torch.Tensor],
    args: tuple,
    kwargs: dict[str, Any] | None = None,
) -> Any:
    """``torch.func.functional_call(module, state, args, kwargs)``, same result.

    Args:
        module: The module to run (its own tensors are put back afterwards).
        state: Tensors by the module's parameter/buffer names (tied aliases follow).
        args: Positional inputs.
        kwargs: Keyword inputs.

    Returns:
        What ``module(*args, **kwargs)`` returns with ``state`` in place of its tensors.
    """
    plan = None if _traced() else _plan(module, tuple(state))
    if plan is None:
        return functional_call(module, state, args, kwargs)
    old = [slots[name] for slots, name, _, _ in plan]
    try:
        for slots, name, key, _ in plan:
            slots[name] = state[key]
        return module(*args, **(kwargs or {}))
    finally:
        for (slots, name, key, given), was in zip(plan, old, strict=True):
            now = slots[name]
            slots[name] = was
            if given:  # as functional_call: a tensor the forward reassigned goes to `state`
                state[key] = now


def _plan(module: nn.Module, keys: tuple[str, ...]) -> _Plan | None:
    plans = _PLANS.setdefault(module, {})
    if keys not in plans:
        plans[keys] = _make_plan(module, keys)
    return plans[keys]


def _make_plan(module: nn.Module, keys: tuple[str, ...]) -> _Plan | None:
    """Where each name's tensor goes, tied aliases too; None if functional_call must decide."""
    names: dict[int, list[str]] = {}
    for name, t in [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]:
        names.setdefault(id(t), []).append(name)
    aliases = {name: group for group in names.values() for name in group}
    given = set(keys)
    plan: _Plan = []
    for key in keys:
        group = aliases.get(key, [key])
        if len(given.intersection(group)) > 1:
            return None  # two values for one tied tensor: functional_call's rule and error
        for name in group:
            prefix, _, attr = name.rpartition(".")
            try:
                owner = module.get_submodule(prefix)
            except AttributeError:
                return None
            if attr in owner._parameters:
                plan.append((owner._parameters, attr, key, name == key))
            elif attr in owner._buffers:
                plan.append((owner._buffers, attr, key, name == key))
            else:
                return None
    return plan
