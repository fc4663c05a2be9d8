"""The eager member call without the per-call Python of ``torch.func.vmap``/``functional_call``.

An ensemble calls the same function on the same kind of arguments every step. Per call,
``torch.func.vmap`` flattens and checks the arguments' pytrees, and ``torch.func.functional_call``
walks the template's modules to find (and untie) the tensors it swaps in. At workload A's size
(15 two-layer MLPs) that Python costs as much as the kernels. Here it is done once:

* ``vmap_members`` runs the same C++ batching as ``torch.func.vmap`` (``_vmap_increment_nesting``,
  ``_add_batch_dim``, ``_remove_batch_dim``), so the kernels, and the results, are the same.
* ``call_member`` swaps the tensors into the slots that ``functional_call`` would (tied
  aliases included), planned once per module and set of names, and puts the old ones back.

A buffer the forward *reassigns* (``self.ema = 0.9 * self.ema + ...``: plain torch keeps the
new tensor in the module) would land in the per-call state dict and be lost. ``call_member``,
and ``tracked`` around a function that calls ``functional_call`` itself, write it into the
tensor it replaced, in place, as BatchNorm writes its statistics: into the member's row of the
stacked storage, with either backend, under ``vmap``, ``grad`` or ``torch.compile``. What the
storage cannot hold as the member alone would is refused (``Reassigned``). ``no_random_ops`` is
``randomness="error"`` for the loop backend.

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

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch._C._functorch import (
    _add_batch_dim,
    _remove_batch_dim,
    _vmap_decrement_nesting,
    _vmap_increment_nesting,
    get_unwrapped,
    is_functorch_wrapped_tensor,
)
from torch._functorch.vmap import _maybe_remove_batch_dim, lazy_load_decompositions
from torch.func import functional_call, vmap
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

__all__ = [
    "names_by_tensor",
    "WRITTEN",
    "Reassigned",
    "call_member",
    "forget_writes",
    "no_random_ops",
    "requires_grad_below",
    "tracked",
    "untraced",
    "vmap_members",
]

#: (slots dict, name in it, state key, its full name: the key, or a tied alias of it) per
#: tensor to swap in.
_Plan = list[tuple[dict, str, str, str]]
#: Per module: the plan for each tuple of state names (None: hand the call to functional_call).
_PLANS: weakref.WeakKeyDictionary[nn.Module, dict[tuple[str, ...], _Plan | None]] = (
    weakref.WeakKeyDictionary()
)
#: The buffers ``write_back_`` wrote since the member map last started (``forget_writes``):
#: what explains autograd's "modified by an inplace operation" in a backward after it.
WRITTEN: list[str] = []


def forget_writes() -> None:
    """A member map starts: ``WRITTEN`` is about its forward from now on."""
    if WRITTEN and not _traced():
        WRITTEN.clear()


def untraced(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``; while dynamo traces (a ``torch.compile`` of the user's own around ``ens(x)``),
    ``fn`` run as eager: dynamo skips it and compiles the rest of the user's function.

    Traced, ``ens(x)`` met a dozen graph breaks (1.9x eager's time), lost the tensors its
    forward keeps on modules, and guarded a cache by its keys' positions (a runner collected
    mid-compile failed the guard's build); eager is exact and faster. ``make_step(compile=True)``
    is the ensemble's compiled path; ``torch.export`` (not dynamo) still traces ``ens(x)``."""
    if torch.compiler.is_dynamo_compiling():
        # fullgraph=True shows this line: the reason is what the user reads
        return torch.compiler.disable(fn, reason="ens(x) runs eager: make_step(compile=True)")
    return fn


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
        ``fn``'s output with the member dim first on every tensor; a ``None`` in it stays
        ``None``, as with the loop backend.
    """
    if chunk_size is not None or _traced() or not _plain(n, state, args, in_dims):
        flat_fn, shape = _tensors_only(fn)
        dims = tuple(_tensor_dims(a, d) for a, d in zip(args, in_dims, strict=True))
        lifted = vmap(flat_fn, in_dims=(0, *dims), randomness=randomness, chunk_size=chunk_size)
        out = iter(lifted(state, *args))
        spec, holes = shape[-1]
        return tree_unflatten([None if hole else next(out) for hole in holes], spec)
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
        return tree_unflatten(
            [None if o is None else _maybe_remove_batch_dim(name, o, level, n, 0) for o in flat],
            spec,
        )
    finally:
        _vmap_decrement_nesting()


def _tensors_only(
    fn: Callable[..., Any],
) -> tuple[Callable[..., list], list[tuple[Any, list[bool]]]]:
    """``fn`` returning its output's non-``None`` leaves, for ``torch.func.vmap``, which
    refuses a ``None`` (``nn.MultiheadAttention``'s weights with ``need_weights=False``);
    the list gets the output's structure and where its ``None`` leaves were, per call."""
    shape: list[tuple[Any, list[bool]]] = []

    def flat_fn(*args: Any) -> list:
        flat, spec = tree_flatten(fn(*args))
        shape.append((spec, [o is None for o in flat]))
        return [o for o in flat if o is not None]

    flat_fn.__name__ = getattr(fn, "__name__", "fn")
    return flat_fn, shape


def _tensor_dims(arg: Any, dim: int | None) -> Any:
    """``dim`` for every leaf of ``arg`` but a ``None`` (an LSTM's ``hx=None`` under
    ``in_dims=0``), which maps to nothing, as with the loop backend and in chunks, where
    torch.func refuses it as a mapped non-tensor (it refuses a number there, as they do)."""
    leaves = [] if dim is None or isinstance(arg, torch.Tensor) else tree_flatten(arg)[0]
    if not any(leaf is None for leaf in leaves):
        return dim  # torch.func's own in_dims, and so its own errors
    return tree_map(lambda leaf: None if leaf is None else dim, arg)


def _plain(n: int, state: dict[str, torch.Tensor], args: tuple, in_dims: tuple) -> bool:
    """Every mapped leaf a tensor of size ``n`` at its (valid) dim: torch.func's checks pass."""
    if not state or any(t.dim() == 0 or t.shape[0] != n for t in state.values()):
        return False
    for a, d in zip(args, in_dims, strict=True):
        if d is None:
            continue
        for t in _leaves(a):
            if not isinstance(t, torch.Tensor) or not -t.dim() <= d < t.dim() or t.shape[d] != n:
                return False
    return True


def _leaves(arg: Any) -> Iterator[Any]:
    """The leaves of a mapped argument: itself, or those of a tuple, list or dict's values
    (the rows of what the forwards kept: ``vmapens._kept.kept_rows``)."""
    if type(arg) in (tuple, list, dict):
        for a in arg.values() if type(arg) is dict else arg:
            yield from _leaves(a)
    else:
        yield arg


def _batched(arg: Any, dim: int | None, level: int) -> Any:
    if dim is None:
        return arg
    if type(arg) in (tuple, list):
        return type(arg)(_batched(t, dim, level) for t in arg)
    if type(arg) is dict:
        return {k: _batched(v, dim, level) for k, v in arg.items()}
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
        What ``module(*args, **kwargs)`` returns with ``state`` in place of its tensors; a
        buffer it reassigns is written into its ``state`` tensor (``write_back_``).

    Raises:
        Reassigned: the forward reassigned a tensor the stacked storage cannot take.
    """
    plan = None if _traced() else _plan(module, tuple(state))
    if plan is None:
        return tracked(lambda st: functional_call(module, st, args, kwargs), module)(state)
    old = [slots[name] for slots, name, _, _ in plan]
    put = [state[key] for _, _, key, _ in plan]
    try:
        for (slots, name, _, _), t in zip(plan, put, strict=True):
            slots[name] = t
        out = module(*args, **(kwargs or {}))
    finally:
        now = [slots[name] for slots, name, _, _ in plan]
        for (slots, name, _, _), was in zip(plan, old, strict=True):
            slots[name] = was
    for (_, _, key, full), t, new in zip(plan, put, now, strict=True):
        if new is not t:  # the forward reassigned it (self.ema = ...)
            write_back_(full, t, new, [k for _, _, k, _ in plan].count(key) > 1)
    return out


def _plan(module: nn.Module, keys: tuple[str, ...]) -> _Plan | None:
    plans = _PLANS.setdefault(module, {})
    if keys not in plans:
        plans[keys] = _make_plan(module, keys)
    return plans[keys]


def names_by_tensor(module: nn.Module) -> dict[int, list[str]]:
    """Every name of each of ``module``'s parameters and buffers (tied aliases, a submodule
    at two paths), by the tensor's id, in the module's order."""
    names: dict[int, list[str]] = {}
    for name, t in [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]:
        names.setdefault(id(t), []).append(name)
    return names


def _make_plan(module: nn.Module, keys: tuple[str, ...]) -> _Plan | None:
    """Where each name's tensor goes, tied aliases too; None if functional_call must decide."""
    aliases = {name: group for group in names_by_tensor(module).values() for name in group}
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
                plan.append((owner._parameters, attr, key, name))
            elif attr in owner._buffers:
                plan.append((owner._buffers, attr, key, name))
            else:
                return None
    return plan


class Reassigned(RuntimeError):
    """A forward reassigned a tensor that the stacked storage cannot take as the member alone
    would; the message says which and why (``_unbatchable.explain_failure`` words it)."""


def tracked(fn: Callable[..., Any], module: nn.Module | None = None) -> Callable[..., Any]:
    """``fn(state, *args)`` that writes what its forward reassigned back into the tensors
    ``state`` held (``functional_call`` puts it into ``state`` in their place).

    Args:
        fn: ``(state, *args) -> output``, calling ``functional_call`` with ``state``.
        module: the module ``fn`` runs, if known: a reassigned buffer it holds under several
            names is refused (a tie the stacked storage keeps).
    """

    def run(state: dict[str, torch.Tensor], *args: Any) -> Any:
        given = list(state.items())
        out = fn(state, *args)
        for key, t in given:
            new = state.get(key)
            if new is not t:
                state[key] = t
                write_back_(key, t, new, module is not None and _tied(module, key))
        return out

    return run


def _tied(module: nn.Module, key: str) -> bool:
    try:
        mine = module.get_buffer(key)
    except AttributeError:  # not a buffer
        return False
    return sum(b is mine for _, b in module.named_buffers(remove_duplicate=False)) > 1


def write_back_(key: str, old: torch.Tensor, new: Any, tied: bool = False) -> None:
    """Write ``new``, which a member's forward assigned in place of its tensor ``old``, into
    ``old``: in place, so into the member's row of the stacked storage, whose identity the
    step's masks and rollbacks and compiled graphs hold. ``WRITTEN`` gets ``key``.

    Raises:
        Reassigned: a parameter or a tied buffer reassigned, a buffer set to a non-tensor or
            to another shape, dtype or device (one per buffer in the storage), or to a tensor
            with autograd history (alone, the buffer would carry that graph into the next
            forward).
    """
    if isinstance(new, nn.Parameter) or (tied and isinstance(new, torch.Tensor)):
        what = "parameter" if isinstance(new, nn.Parameter) else "buffer"
        why = "the optimizer steps it" if what == "parameter" else "its names share one tensor"
        raise Reassigned(
            f"reassigns {what} `{key}`, which the stacked storage cannot replace ({why}); "
            "change its values in place under torch.no_grad() instead (.copy_(...))"
        )
    if not isinstance(new, torch.Tensor):
        raise Reassigned(
            f"sets `{key}` to {type(new).__name__}, where the stacked storage keeps a tensor; "
            "keep it a tensor"
        )
    if (new.shape, new.dtype, new.device) != (old.shape, old.dtype, old.device):
        raise Reassigned(
            f"reassigns buffer `{key}` ({_kind(old)}) to a tensor of {_kind(new)}; the stacked "
            "storage keeps each buffer's shape, dtype and device: give the buffer its final "
            "ones when it is registered, or convert the new value (.to(self.<buffer>))"
        )
    if requires_grad_below(new):
        raise Reassigned(
            f"reassigns buffer `{key}` to a tensor with autograd history (alone, the buffer "
            "would carry that graph into the next forward, whose backward then fails); "
            "assign a detached value (.detach())"
        )
    with torch.no_grad():
        old.copy_(new.clone())  # a view of `old` itself (self.m = self.m.t()) is a new value
    if not _traced():
        WRITTEN.append(key)


def _kind(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, {t.dtype}, on {t.device}"


def requires_grad_below(t: torch.Tensor) -> bool:
    """Whether ``t`` requires grad, at its own level or below vmap's wrappers (a batched
    tensor reports ``requires_grad=False`` whatever it wraps)."""
    while not t.requires_grad:
        if _traced() or not is_functorch_wrapped_tensor(t):
            return False
        t = get_unwrapped(t)
    return True


class _NoRandomOps(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if torch.Tag.nondeterministic_seeded in func.tags and not _draws_nothing(
            func, args, kwargs
        ):
            raise RuntimeError(
                f"loop: called random operation {func} while in randomness error mode "
                "(randomness='error')"
            )
        return func(*args, **(kwargs or {}))


def _draws_nothing(func: Any, args: Any, kwargs: Any) -> bool:
    """A random op that draws nothing on this call: ``nn.RReLU`` in eval mode is a leaky ReLU
    with the mean slope (``rrelu_with_noise`` with ``training=False``), and draws nothing alone."""
    if func is not torch.ops.aten.rrelu_with_noise.default:
        return False
    return not (args[4] if len(args) > 4 else (kwargs or {}).get("training", False))


def no_random_ops(active: bool = True) -> contextlib.AbstractContextManager:
    """``randomness="error"`` for members run one at a time (``active``): a random op raises,
    as under ``torch.func.vmap(..., randomness="error")`` (random ops carry torch's
    ``nondeterministic_seeded`` tag)."""
    return _NoRandomOps() if active and not _traced() else contextlib.nullcontext()
