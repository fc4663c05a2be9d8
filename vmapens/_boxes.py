"""Containers a forward keeps on its module: dicts, lists and tuples of values, nested.

optree's containers: also ``OrderedDict``, ``defaultdict``, ``deque`` and named tuples (a
subclass optree does not know, ``class Cache(dict)``, is a value like any other).

A key/value cache kept as ``self.cache = {"k": k, "v": v}``, edited in place
(``self.cache["k"] = k``), activations collected with ``self.acts.append(h)``, an LSTM's
``self.state = (h, c)``. The ensemble treats them as it treats one tensor kept there (stacked
per member on the template, each member's rows handed back at the next call, every turn of a
call starting from what the call found): these helpers see them as their leaves (optree's
pytrees) and build them again around other leaves.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict, deque
from collections.abc import Iterable
from typing import Any

import optree
import torch
from torch._C._functorch import is_functorch_wrapped_tensor

__all__ = [
    "BOXES",
    "KEPT_MARK",
    "LARGE",
    "MUTABLE",
    "PLAIN",
    "Place",
    "Shot",
    "box_leaves",
    "cleared",
    "edited",
    "emptied",
    "form",
    "is_box",
    "is_kept",
    "keepable",
    "kept_again",
    "place",
    "plain_leaves",
    "put_back",
    "rebuilt",
    "rows_at",
    "shared",
    "snapshot",
    "tensor_leaves",
]

#: The containers taken apart, by exact type (a subclass may hold more than its items), and
#: named tuples; a forward edits the ``MUTABLE`` ones in place.
BOXES = frozenset({dict, list, tuple, OrderedDict, defaultdict, deque})
MUTABLE = frozenset({dict, list, OrderedDict, defaultdict, deque})
#: Items past which a mutable container is no state a forward keeps per call (a vocabulary, a
#: lookup table): not looked into at every call, which costs its size.
LARGE = 1024


def is_box(value: Any) -> bool:
    """Whether ``value`` is a container ``BOXES`` names, or a named tuple."""
    return type(value) in BOXES or optree.is_namedtuple(value)


def _flat(value: Any) -> tuple[list[Any], Any] | None:
    """optree's leaves and structure of a container; None for one optree cannot take apart
    (tensor keys it cannot sort, nesting deeper than Python's recursion limit)."""
    try:
        return optree.tree_flatten(value)
    except (TypeError, ValueError, RuntimeError, RecursionError):
        return None


def box_leaves(value: Any) -> list[Any]:
    """``value``'s leaves: its own if it is no container (or one optree cannot take apart)."""
    flat = _flat(value) if is_box(value) else None
    return [value] if flat is None else flat[0]


#: Plain values a kept container may hold beside its tensors (``{"k": k, "pos": 3}``): kept
#: as they are, the same in every member's rows (``plain_leaves``).
PLAIN = frozenset({bool, int, float, str})


def tensor_leaves(value: Any) -> list[torch.Tensor] | None:
    """What a forward keeps, as its tensors: a tensor, or a container of tensors (``{"k": k,
    "v": v}``, ``(h, c)``, a list of them), plain numbers and strings beside them too
    (``{"k": k, "pos": 3}``); None for anything else."""
    if isinstance(value, torch.Tensor):
        return [value]
    if not is_box(value) or (flat := _flat(value)) is None:
        return None
    tensors = [t for t in flat[0] if isinstance(t, torch.Tensor)]
    if len(tensors) < len(flat[0]) and not all(type(v) in PLAIN for v in plain_leaves(value)):
        return None
    return tensors or None


def plain_leaves(value: Any) -> tuple[Any, ...]:
    """The leaves of a container that are no tensors (``3`` of ``{"k": k, "pos": 3}``)."""
    return tuple(v for v in box_leaves(value) if not isinstance(v, torch.Tensor))


#: Marks a tensor the members' forward kept, stacked on the template (``vmapens._kept``).
KEPT_MARK = "_vmapens_stacked_kept"


def is_kept(value: Any) -> bool:
    """Whether ``value`` is a tensor marked ``KEPT_MARK``, or a dict, list or tuple of them."""
    leaves = tensor_leaves(value)
    return bool(leaves) and all(getattr(t, KEPT_MARK, False) for t in leaves or ())


def kept_again(now: Any, before: Any) -> bool:
    """Whether ``now``, written over the stacked kept value ``before`` on the template, is each
    member's rows as well, and mark it so: a value of the same form and shapes
    (``ens.template.h = ens.template.h.detach()``, truncated backpropagation through time, or
    a reset to ``torch.zeros_like``), or views of it with a row per member (``h[:, :b]``,
    a last batch of ``b``). It was taken for one value every member shares: each member read
    all members' rows."""
    if now is before or not is_kept(before) or (leaves := tensor_leaves(now)) is None:
        return False
    old = tensor_leaves(before) or []
    if form(now) != form(before) or not all(rows_at(t, place(o)) for t, o in zip(leaves, old)):
        return False
    for t in leaves:
        setattr(t, KEPT_MARK, True)
    return True


#: ``place``: a stacked tensor's shape, row stride, storage offset, device and storage.
Place = tuple[torch.Size, int, int, torch.device, int | None]


def place(stack: torch.Tensor) -> Place:
    """Where ``stack``'s rows lie, for ``rows_at`` (kept without holding the tensor)."""
    stride = stack.stride(0) if stack.dim() else 0
    return (stack.shape, stride, int(stack.storage_offset()), stack.device, _storage(stack))


def _storage(t: torch.Tensor) -> int | None:
    """``t``'s storage's address; None for a tensor a torch.func transform wraps (kept
    inside a transform of the caller's own), which has none to read."""
    return None if is_functorch_wrapped_tensor(t) else t.untyped_storage().data_ptr()


def rows_at(t: torch.Tensor, where: Place) -> bool:
    """Whether ``t`` is each member's rows as the stack at ``where`` (``place``) is: of its
    shape, or a view of it with one row per member (``ens.template.h[:, :b]``, a last batch of
    ``b`` sequences)."""
    shape, stride, offset, device, ptr = where
    if t.shape == shape:
        return True
    if t.dim() == 0 or t.shape[0] != shape[0] or t.device != device:
        return False
    if ptr is None or _storage(t) != ptr:
        return False
    # member i's rows start in the stack's row i: not `h[0]` or `h.T` (batch or width n)
    return t.stride(0) == stride and 0 <= t.storage_offset() - offset < max(stride, 1)


def form(value: Any) -> Any:
    """A container's structure (keys, nesting); None for a tensor."""
    flat = _flat(value) if is_box(value) else None
    return None if flat is None else flat[1]


def rebuilt(value: Any, leaves: list[Any]) -> Any:
    """``leaves`` in ``value``'s form: a new container of ``value``'s structure (a tensor for
    a tensor); given its tensors alone, with ``value``'s plain values beside them."""
    if not is_box(value):
        return leaves[0]
    now, spec = optree.tree_flatten(value)
    if len(now) != len(leaves):
        given = iter(leaves)
        leaves = [next(given) if isinstance(v, torch.Tensor) else v for v in now]
    return optree.tree_unflatten(spec, leaves)


#: ``snapshot``: a container's structure, its leaves and its own items, as found.
Shot = tuple[Any, list[Any], list[Any]]


def snapshot(value: Any) -> Shot | None:
    """A mutable container's structure, leaves and own items now, for ``edited`` and
    ``put_back`` (None for anything else, and for one of more than ``LARGE`` items)."""
    if type(value) not in MUTABLE or len(value) > LARGE or (flat := _flat(value)) is None:
        return None
    return flat[1], flat[0], _items(value, set())


def _items(value: Any, seen: set[int]) -> list[Any]:
    """``value`` and its own items, then the same of each mutable container among them (a
    dict in a list), once each."""
    seen.add(id(value))
    own = list(value.items()) if isinstance(value, dict) else list(value)
    found = [(value, own)]
    for item in value.values() if isinstance(value, dict) else value:
        if type(item) in MUTABLE and id(item) not in seen:
            found += _items(item, seen)
    return found


def edited(shot: Shot) -> bool:
    """Whether the container ``snapshot`` gave ``shot`` for holds other leaves now."""
    spec, leaves, items = shot
    flat = _flat(items[0][0])
    if flat is None:
        return True
    now, now_spec = flat
    return now_spec != spec or len(now) != len(leaves) or not all(map(_is, now, leaves))


def put_back(shots: Iterable[Shot]) -> None:
    """Each edited container's items as ``snapshot`` found them, and those of the containers
    in it, in place: a module that shares one (``Layer(self.sink)``) shares it still."""
    for shot in shots:
        if not edited(shot):
            continue
        for box, own in shot[2]:
            box.clear()
            if isinstance(box, dict):
                box.update(own)
            else:
                box.extend(own)


def cleared(value: Any) -> bool:
    """A stacked dict or list emptied in place on the template (``ens.template.cache.clear()``,
    a ``reset()``): every member starts from an empty one, as each alone."""
    return type(value) in MUTABLE and not value


def keepable(value: Any) -> bool:
    """A tensor, a container of tensors (plain numbers and strings beside them too), or an
    emptied dict or list (``.clear()``)."""
    return tensor_leaves(value) is not None or (type(value) in MUTABLE and not value)


def shared(value: Any, values: list[Any]) -> bool:
    """Whether ``value`` is held by more than one of ``values`` (two modules' attributes)."""
    return sum(v is value for v in values) > 1


def emptied(value: Any) -> Any:
    """What a module that has not run holds where a forward keeps ``value``: an empty
    container of its kind (``self.cache = {}`` in ``__init__``), else None."""
    if type(value) is defaultdict:
        return defaultdict(value.default_factory)
    return type(value)() if type(value) in MUTABLE else None


def _is(a: object, b: object) -> bool:
    return a is b
