"""Deep copies of member modules whose functions follow the copy.

``copy.deepcopy`` copies a module's submodules, containers and bound methods, but returns
functions as they are: a lambda or closure set in ``__init__`` (``self.scale = lambda o: o *
self.gain``, or a hook ``lambda m, args, out: out * self.gain``) would still read the ORIGINAL
module's tensors from the copy. The ensemble runs copies of member 0 (its template, the
module it runs, ``ens[i]``), so every member would read member 0's original, untrained
tensors. ``copy_member`` gives each such function a new function object whose closure cells
(and defaults) hold the copy's corresponding modules; a cell holding anything else (a shared
list, a logger, a setting) keeps the very same object, as a plain deep copy of the function.
"""

from __future__ import annotations

import contextlib
import copy
import types
from typing import Any

from torch import nn

from ._hooks import held

_DEPTH = 4  # how deep attributes are searched for functions (containers, partials, closures)


def copy_member(module: nn.Module, memo: dict[int, Any] | None = None) -> nn.Module:
    """``copy.deepcopy(module, memo)``, with every function found in the attributes of
    ``module``'s submodules (hook dicts, containers, partials, plain objects) that
    closes over one of ``module``'s own modules rebound to the copy's.

    Args:
        module: the module to copy.
        memo: ``copy.deepcopy``'s memo (tensors to put in place of the module's), or None.

    Returns:
        The copy.
    """
    memo = {} if memo is None else memo
    pending = prepare_functions([module], memo)
    copied = copy.deepcopy(module, memo)
    rebind_functions(pending, memo)
    return copied


def copy_holding(obj: nn.Module, memo: dict[int, Any], modules: list[nn.Module]) -> Any:
    """``copy.deepcopy``'s own way for ``obj`` (``__new__``, then its ``__getstate__``'s state
    deep-copied into ``__setstate__``), with the functions of ``modules``, modules ``obj``
    holds, rebound to their copies: an object's ``__deepcopy__``."""
    pending = prepare_functions(modules, memo)
    new = type(obj).__new__(type(obj))
    memo[id(obj)] = new
    new.__setstate__(copy.deepcopy(obj.__getstate__(), memo))
    rebind_functions(pending, memo)
    return new


def prepare_functions(
    modules: list[nn.Module], memo: dict[int, Any]
) -> list[tuple[types.FunctionType, types.FunctionType, set[int]]]:
    """Before ``copy.deepcopy(..., memo)`` of something that holds ``modules``: put in ``memo``
    a new function (its cells empty yet) for each function in their attributes that closes over
    one of their modules; ``rebind_functions`` fills the cells after the copy."""
    owned = {id(m) for root in modules for m in root.modules()}
    found: dict[int, types.FunctionType] = {}
    for root in modules:
        for m in root.modules():
            for v in vars(m).values():
                _find(v, found, 0)
    rebound: dict[int, types.FunctionType] = {}
    changed = True
    while changed:  # a function closing over one that is rebound is rebound too
        changed = False
        for key, fn in found.items():
            if key not in rebound and any(id(c) in owned or id(c) in rebound for c in held(fn)):
                rebound[key], changed = fn, True
    pending = []
    for key, fn in rebound.items():
        if key in memo:
            continue
        new = types.FunctionType(
            fn.__code__,
            fn.__globals__,
            fn.__name__,
            fn.__defaults__,
            tuple(types.CellType() for _ in fn.__closure__ or ()),
        )
        new.__kwdefaults__ = fn.__kwdefaults__
        new.__qualname__, new.__module__, new.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
        new.__annotations__ = fn.__annotations__
        new.__dict__.update(fn.__dict__)
        memo[key] = new
        pending.append((fn, new, owned | set(rebound)))
    return pending


def rebind_functions(
    pending: list[tuple[types.FunctionType, types.FunctionType, set[int]]], memo: dict[int, Any]
) -> None:
    """After the deep copy: fill the cells (and defaults) of ``prepare_functions``'s new
    functions with the copies of the modules (and functions) the old ones held."""
    for old, new, owned in pending:

        def moved(v: Any, owned: set[int] = owned) -> Any:
            return memo.get(id(v), v) if id(v) in owned else v

        for cell, fresh in zip(old.__closure__ or (), new.__closure__ or (), strict=True):
            with contextlib.suppress(ValueError):  # an empty cell (bound later) stays empty
                fresh.cell_contents = moved(cell.cell_contents)
        if old.__defaults__:
            new.__defaults__ = tuple(moved(d) for d in old.__defaults__)
        if old.__kwdefaults__:
            new.__kwdefaults__ = {k: moved(d) for k, d in old.__kwdefaults__.items()}


def _find(v: Any, found: dict[int, types.FunctionType], depth: int) -> None:
    """Collect the functions in ``v`` (``found``, by id): in containers, partials, closures
    and plain objects' attributes (``_hooks.held``; a submodule's are searched as its own)."""
    if depth >= _DEPTH:
        return
    if isinstance(v, types.FunctionType):
        if id(v) in found:
            return
        found[id(v)] = v
    for x in held(v):
        _find(x, found, depth + 1)
