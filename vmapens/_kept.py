"""Tensors a forward keeps on its modules (``self.kl = kl``), stacked on ``ens.template``.

A plain module keeps what its forward set: a Bayes-by-Backprop loop sums ``m.kl`` over its
layers after ``model(x)``. The ensemble runs ``ens.runner``, where such a tensor is batched
(dead after the call) or the last member's, and ``ens.template`` kept ``__init__``'s value:
the loop read ``0.0`` and dropped the KL, silently. ``Ensemble.forward`` now notes, turn by
turn (one under vmap, one per chunk or member otherwise), the tensors the forward set on the
runner's modules; after the call it unwraps the batched ones (dead outside vmap, their values
and graph intact), stacks them and sets them on the template's module of the same name:
``[n, ...]``, one row per member, with their graph (a tuple or list of tensors, an LSTM's
``self.state = (h, c)``, as one of each). The outputs are untouched and ``ens[i]`` gets row
``i``. The next call hands each turn its members' rows of them (``call_noting``'s ``given``):
a key/value cache or a hidden state read back is the member's own, with ``chunk_size`` too
(each chunk read the cache the last chunk of the call before had left on the runner).
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ._boxes import (
    KEPT_MARK,
    MUTABLE,
    cleared,
    edited,
    is_kept,
    keepable,
    plain_leaves,
    rebuilt,
    shared,
    snapshot,
    tensor_leaves,
)
from ._fastcall import call_member
from ._kept_edits import (
    note_box,
    refuse_held_parameters,
    refuse_items_set,
    rows_again,
    submodule,
)
from ._kept_stacks import dead, revived, stack_turns, turn_rows
from ._plain_turns import INTERNAL
from ._stacking import recomputed

__all__ = [
    "KeptTurns",
    "as_mapped",
    "call_noting",
    "give_",
    "keep_",
    "kept_anywhere",
    "kept_on",
    "kept_rows",
    "kept_somewhere",
    "kept_stacks",
    "map_kept",
    "named_slots",
    "set_kept_",
    "slots_for",
]

#: Each runner's ``KeptSlots``, built once (the runner's modules stay those it was built with).
_SLOTS: weakref.WeakKeyDictionary[nn.Module, KeptSlots] = weakref.WeakKeyDictionary()
#: Where ``set_kept_`` put stacked values on each template, ``(module path, attribute)``:
#: ``kept_on`` reads these alone (a scan of every module's attributes took ~55 us a call for a
#: 3-layer MLP, ~360 us for a 4-layer Transformer encoder); True where handed back at the next
#: call, False where only lent and copied (a container several modules share).
_WHERE: weakref.WeakKeyDictionary[nn.Module, dict[tuple[str, str], bool]] = (
    weakref.WeakKeyDictionary()
)


def map_kept(fn: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    """``fn`` on each tensor of a kept value (``tensor_leaves``), in its form."""
    return rebuilt(value, [fn(t) for t in tensor_leaves(value) or ()])


def _stacked_rows(value: Any) -> int | None:
    """How many rows each tensor of a kept value has (one count for all), else None: None too
    for one kept under a torch.func transform of the caller's own that has ended (dead there,
    not handed back: the next forward sets it anew, or reads it and fails, as alone)."""
    leaves = tensor_leaves(value) or ()
    if any(dead(t) for t in leaves):
        return None
    sizes = {t.shape[0] if t.dim() else None for t in leaves}
    return sizes.pop() if len(sizes) == 1 else None


class KeptSlots:
    """The plain attributes of ``runner``'s modules, to tell the tensors a call set there.

    ``seen`` and ``new`` compare the values by identity in C-level passes (a forward that
    keeps nothing costs ~2 us a call); a new attribute shows as a longer ``__dict__``.

    Args:
        runner: the module the members run.
    """

    def __init__(self, runner: nn.Module) -> None:
        named = list(runner.named_modules())
        self.paths = [path for path, _ in named]
        self.dicts = [vars(m) for _, m in named]
        # weight_norm's, spectral_norm's and prune's computed tensors: set by a hook every call
        self.skip = {(id(vars(m)), name) for m, name, _ in recomputed(runner)}
        self.dropped: set[str] = set()  # ``new``: slots whose value is kept no more
        self.forms: dict[str, Any] = {}  # ``kept_rows``: the stacks mapped as their tensors
        self._index()

    def _index(self) -> None:
        entries = [
            (path, d, k)
            for path, d in zip(self.paths, self.dicts, strict=True)
            for k in d
            if k not in INTERNAL and (id(d), k) not in self.skip
        ]
        self.names = [f"{path}:{k}" for path, _, k in entries]
        self.owned = [d for _, d, _ in entries]
        self.keys = [k for _, _, k in entries]
        self.sizes = list(map(len, self.dicts))

    def seen(self) -> tuple[list[object], list[tuple[int, Any]]]:
        """The values now (held: an id stays theirs while ``new`` compares), and the contents
        of the mutable containers among them (``self.cache["k"] = k`` edits one in place)."""
        values = list(map(dict.get, self.owned, self.keys))
        if not MUTABLE.intersection(map(type, values)):
            return values, []
        return values, [(i, shot) for i, v in enumerate(values) if (shot := snapshot(v))]

    def new(self, before: tuple[list[object], list[tuple[int, Any]]]) -> dict[str, Any]:
        """The tensors set since ``seen`` gave ``before``, by ``"<module path>:<attribute>"``,
        a container edited in place too (one several modules share, ``Layer(self.sink)``: one
        copy all its names hold); one that holds other values now is left out. Neither is
        handed back (``dropped``): each name's rows would part a shared one."""
        values, boxes = before
        now = list(map(dict.get, self.owned, self.keys))
        changed = []
        if any(map(operator.is_not, now, values)):
            changed = [i for i, (v, b) in enumerate(zip(now, values, strict=True)) if v is not b]
        changed += [i for i, shot in boxes if now[i] is values[i] and edited(shot)]
        named = [(self.names[i], now[i]) for i in changed]
        if list(map(len, self.dicts)) != self.sizes:  # an attribute set the first time
            known = set(self.names)
            self._index()
            now = list(map(dict.get, self.owned, self.keys))
            named += [(n, v) for n, v in zip(self.names, now, strict=True) if n not in known]
        found: dict[str, Any] = {}
        copies: dict[int, Any] = {}  # a container as this turn left it (the next edits it on)
        for name, v in named:
            keep, box = keepable(v), type(v) in MUTABLE
            if not keep or (box and shared(v, now)):
                self.dropped.add(name)
            if keep and box and id(v) not in copies:
                copies[id(v)] = rebuilt(v, tensor_leaves(v) or [])
            if keep:
                found[name] = copies[id(v)] if box else v
        return found


def slots_for(runner: nn.Module) -> KeptSlots:
    """``runner``'s ``KeptSlots``."""
    slots = _SLOTS.get(runner)
    if slots is None:
        slots = _SLOTS[runner] = KeptSlots(runner)
    return slots


def set_kept_(
    template: nn.Module, kept: dict[str, Any], unreturned: set[str]
) -> list[tuple[nn.Module, str]]:
    """Set every stacked ``kept`` tensor on the template's module of its name; returns where.
    Those not ``unreturned`` are handed back at the next call (``kept_rows``).

    With ``backend="loop"`` the template is the module the members run: ``KeptTurns`` gives
    each member its own row there while it runs."""
    where = []
    slots = _WHERE.setdefault(template, {})
    modules = dict(template.named_modules())
    for name, value in kept.items():
        path, _, key = name.rpartition(":")
        if (module := modules.get(path)) is None:  # a module of the runner's own
            continue
        for t in tensor_leaves(value) or ():
            setattr(t, KEPT_MARK, True)
        module.__dict__[key] = value
        where.append((module, key))
        slots[path, key] = name not in unreturned
        if type(value) in MUTABLE:
            note_box(template, path, key, value)
    return where


def named_slots(module: nn.Module, values: dict[str, Any]) -> list[tuple[nn.Module, str, Any]]:
    """``(submodule, attribute, value)`` for each of ``values`` named
    ``"<module path>:<attribute>"`` (as ``KeptSlots.new`` names them) whose submodule
    ``module`` has."""
    if not values:
        return []
    modules = dict(module.named_modules())
    found = []
    for name, value in values.items():
        path, _, key = name.rpartition(":")
        if path in modules:
            found.append((modules[path], key, value))
    return found


def call_noting(
    runner: nn.Module,
    state: dict,
    args: tuple,
    kw: dict | None,
    turns: list,
    given: dict[str, Any] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """``call_member(runner, state, args, kw)`` and the tensors its forward kept on the
    runner's modules (``KeptSlots.new``), noted in ``turns`` as ``(members, kept)`` for
    ``keep_``: one turn per call (the whole ensemble under vmap, a chunk, or one member).

    ``given``: the turn's rows of what the forwards kept before (``kept_rows``, mapped into
    the members), set on the runner first: the forward reads its members' own. Returned
    with what the forward kept this time (that first), as a ``loss_fn`` reads them."""
    slots = slots_for(runner)
    given = give_(runner, given) if given else given
    before = slots.seen()
    out = call_member(runner, state, args, kw)
    if kept := slots.new(before):
        if torch.is_grad_enabled():
            refuse_held_parameters(kept, state)
        turns.append((turn_rows(state), kept))
    return out, {**given, **kept} if given else kept


def keep_(
    template: nn.Module,
    watched: Any,
    turns: list,
    n: int,
    detach: bool,
    runner: nn.Module,
    stacked: dict[str, Any] | None = None,
) -> None:
    """Set what the turns' forwards kept (``(members, kept)`` each) on the template, stacked,
    where a loop over its modules reads them (``detach``: after a step, its graph is spent),
    and tell ``watched`` (the template's ``Watched``) they are no user's write. A slot whose
    value ``runner``'s forwards made other than a keepable one is handed out no more."""
    slots, unreturned = _SLOTS.get(runner), set()
    if slots is not None and slots.dropped:
        where = _WHERE.get(template, {})
        for name in slots.dropped:
            path, _, key = name.rpartition(":")
            where.pop((path, key), None)  # a shared one stacked below is set again, lent only
        unreturned, slots.dropped = slots.dropped, set()
    if stacked is None:  # ``stack_turns(turns, n)``, made already by the step
        stacked = stack_turns(turns, n) if turns else {}
    kept = stacked
    if kept:
        if detach:  # once per value: names that share one container share its detached copy
            done = {id(v): v for v in kept.values()}
            done = {i: map_kept(torch.Tensor.detach, v) for i, v in done.items()}
            kept = {k: done[id(v)] for k, v in kept.items()}
        watched.settle(set_kept_(template, kept, unreturned))


class KeptTurns:
    """The loop's turns over the stacked kept tensors on the template (the module the members
    run there): member ``i`` runs with row ``i`` of each, its own, as alone, not all members'
    (a cache read back, ``if self.cos is None or self.cos.shape[0] < t``, read the stack).
    After the turns, one the forwards did not set again is put back whole.

    Args:
        runner: the module the members run.
        n: how many members run.
    """

    def __init__(self, runner: nn.Module, n: int) -> None:
        self.kept = [
            (m.__dict__, k, v)
            for _, m, k, v in _kept_slots(runner)
            if _stacked_rows(v) == n or cleared(v)
        ]
        self.rows: list[Any] = []

    def take(self, i: int) -> None:
        """Before member ``i``'s turn: its rows."""
        self.rows = [map_kept(operator.itemgetter(i), v) for _, _, v in self.kept]
        for (d, k, _), row in zip(self.kept, self.rows, strict=True):
            d[k] = row

    def end(self) -> None:
        """After the turns (or a failed one): the stacks back where a row is still there."""
        for (d, k, v), row in zip(self.kept, self.rows, strict=True):
            if d.get(k) is row:
                d[k] = v


def kept_anywhere(template: nn.Module) -> bool:
    """Whether ``set_kept_`` put a stacked value on the template (another may be there now)."""
    return bool(_WHERE.get(template))


def kept_on(template: nn.Module, lent: bool = False) -> list[tuple[str, str, Any]]:
    """``(module path, attribute, stacked value)`` for each ``set_kept_`` put there and hands
    back (``lent``: those only lent and copied too)."""
    return [(path, k, v) for path, _, k, v in _kept_slots(template, lent)]


def kept_somewhere() -> bool:
    """Whether ``set_kept_`` put a stacked value on any ensemble's template (a fast check)."""
    return bool(_WHERE) and any(_WHERE.values())  # ``len`` first: ~0.2 us, iterating ~4


def kept_stacks(n: int) -> list[tuple[dict[str, Any], str, Any]]:
    """``(module __dict__, attribute, stacked value)`` for every value of ``n`` rows that
    ``set_kept_`` put on an ensemble's template (any ensemble still alive)."""
    return [
        (vars(m), k, v)
        for t in list(_WHERE)
        for _, m, k, v in _kept_slots(t, lent=True)
        if _stacked_rows(v) == n
    ]


def _kept_slots(template: nn.Module, lent: bool = False) -> list[tuple[str, nn.Module, str, Any]]:
    """``(module path, module, attribute, stacked value)`` for each ``set_kept_`` put there
    (still there: not replaced since) and hands back (``lent``: the others too)."""
    found = []
    for (path, key), returned in _WHERE.get(template, {}).items():
        if not (returned or lent):
            continue
        if (module := submodule(template, path)) is None:
            continue
        value = module.__dict__.get(key)
        if is_kept(value) or cleared(value) or rows_again(template, path, key, value):
            if (alive := revived(value)) is not value:  # kept under a grad that has ended
                module.__dict__[key] = value = alive
            found.append((path, module, key, value))
    return found


def kept_rows(template: nn.Module, n: int, runner: nn.Module) -> dict[str, Any]:
    """The stacked ``[n, ...]`` values ``set_kept_`` put on the template (or emptied there),
    by ``"<module path>:<attribute>"``, mapped into the members (``call_noting``'s ``given``):
    a forward reading one back (a hidden state, a cache) and a ``loss_fn`` reading one the
    forward did not set again (an aux loss) read their member's rows."""
    if runner is template:  # the loop's: ``KeptTurns``; an item set there is read as it is
        found = []
    else:
        refuse_items_set(template)
        found = kept_on(template)
    rows = {f"{path}:{k}": v for path, k, v in found if _stacked_rows(v) == n or cleared(v)}
    return as_mapped(runner, rows)


def as_mapped(runner: nn.Module, rows: dict[str, Any]) -> dict[str, Any]:
    """``rows`` of kept values as vmap maps them into ``runner``'s members: one with plain
    values beside its tensors (``{"k": k, "pos": 3}``) as its tensors alone (``give_``)."""
    forms = slots_for(runner).forms = {k: v for k, v in rows.items() if plain_leaves(v)}
    return {k: tensor_leaves(v) if k in forms else v for k, v in rows.items()}


def give_(runner: nn.Module, given: dict[str, Any]) -> dict[str, Any]:
    """Set ``as_mapped``'s rows, mapped into a turn, on ``runner``'s modules, each in its form
    again; returns them so."""
    if forms := slots_for(runner).forms:
        given = {k: rebuilt(forms[k], v) if k in forms else v for k, v in given.items()}
    for module, key, value in named_slots(runner, given):
        module.__dict__[key] = value
    return given
