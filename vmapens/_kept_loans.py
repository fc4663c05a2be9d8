"""What a forward kept, lent to the losses and metrics that read it (``ens.template.kl``),
held for the members that did not run (``held_rows``), and copied to ``ens[i]`` and to
copies of the ensemble (``rows_of_kept_``, ``carry_kept_``).

A VAE's loss adds ``model.kl``, which its forward set; a mixture of experts' adds each
layer's ``aux_loss``. The ensemble stacks such values on the template, ``[n, ...]``
(``vmapens._kept``). A loss run once per member reads its member's own there, as alone it
reads its module's: the step's and ``fit``'s loss, right after the member's forward, what
that turn kept (``loss_with_kept``); ``per_member`` and ``fit``'s metrics, after
``ens(x)``, the member's rows of the stacks (``Lending``, ``lent_row``). The whole stack read there was
added to every member's loss: ``[n, n]`` losses, gradients of every member's KL in each.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ._boxes import MUTABLE, form, plain_leaves, tensor_leaves
from ._kept import kept_on, map_kept, named_slots, set_kept_

__all__ = ["Lending", "carry_kept_", "held_rows", "lent_row", "loss_with_kept", "rows_of_kept_"]

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


class Lending:
    """``fn`` taking one more argument first, the rows of ``stacks`` (``kept_stacks``; mapped
    over the members, each member's own), set where the stacks are while it runs.

    A loss that empties one it read (``m.acts.clear()``, as a plain loop clears its
    module's after reading it) empties the stack too, once every member ran (``settle``), and
    one that sets it to an empty container or None (``m.acts = []``) sets that there: the next
    call starts from it, as each member alone does. Its rows emptied, the stack was put back
    whole, and the next call appended to it (a graph more every step).
    """

    def __init__(self, fn: Callable, stacks: list[tuple[dict[str, Any], str, Any]]) -> None:
        self.fn, self.stacks = fn, stacks
        self.emptied: list[Any] = []
        self.reset: list[tuple[dict[str, Any], str, Any]] = []

    def __call__(self, rows: list[Any], *args: Any, **kwargs: Any) -> Any:
        lent = [(owned, key, row) for (owned, key, _), row in zip(self.stacks, rows, strict=True)]
        with _lent(lent):
            try:
                return self.fn(*args, **kwargs)
            finally:
                for (owned, key, row), (_, _, stack) in zip(lent, self.stacks, strict=True):
                    now = owned.get(key, _NONE)
                    if type(row) in MUTABLE and now is row and not row and stack:
                        self.emptied.append(stack)
                    elif now is not row and (now is None or (type(now) in MUTABLE and not now)):
                        self.reset.append((owned, key, now))  # `m.acts = []`, `m.h = None`

    def settle(self) -> None:
        """Empty the stacks a member's run emptied its rows of; set what it reset there."""
        for stack in self.emptied:
            stack.clear()
        for owned, key, now in self.reset:
            owned[key] = type(now)() if now is not None else None
        self.emptied.clear()
        self.reset.clear()


def lent_row(fn: Callable, stacks: list[tuple[dict[str, Any], str, Any]], i: int) -> Any:
    """``fn()`` with row ``i`` of each of ``stacks`` set where it is (one member's call)."""
    with _lent((owned, key, map_kept(lambda t: t[i], v)) for owned, key, v in stacks):
        return fn()


def held_rows(template: nn.Module, running: torch.Tensor | None) -> Callable[[], None]:
    """What puts back, after a call that ran every member, the rows of the stacked kept tensors
    on the template for the members where ``running`` is False (stopped, masked): alone such a
    member does not run, so its hidden state stays (a stopped member's went on from the
    frozen weights, and its next forward started from there, silently). In place: the module
    the members run (under vmap, one chunk) reads the same storage at the next call."""
    if running is None:
        return lambda: None
    before = {(path, k): v for path, k, v in kept_on(template, lent=True)}

    def back() -> None:
        frozen = ~running.to(torch.bool)
        if not bool(frozen.any()):
            return
        writes = []  # the old rows read out first: a new stack may be an old one (`prev = cur`)
        for path, k, value in kept_on(template, lent=True):
            old = before.get((path, k))
            if old is None or old is value or form(old) != form(value):
                continue  # another form (a key added): no row of it is the old one's
            if plain_leaves(old) != plain_leaves(value):  # one value for all: cannot stay
                _warn_plain_moved(path, k, plain_leaves(old), plain_leaves(value))
            for o, v in zip(tensor_leaves(old) or (), tensor_leaves(value) or (), strict=False):
                if o.shape != v.shape or o.dtype != v.dtype or v.stride(0) == 0:
                    continue  # stride 0: one the members share
                rows = frozen.to(v.device)
                writes.append((v, rows, o[rows]))  # indexing with a mask copies
        with torch.no_grad():
            for v, rows, o in writes:
                v[rows] = o

    return back


def _warn_plain_moved(path: str, key: str, old: tuple, new: tuple) -> None:
    warnings.warn(
        f"Ensemble: the forward keeps `{key}` on {path or 'the module'} with plain values "
        f"beside its tensors ({old} -> {new}); a member that did not run (masked, stopped) "
        "keeps its tensors' rows as alone, but those values are every member's: they moved "
        "for it too. Keep such a value as a tensor (one row per member) to hold it",
        UserWarning,
        stacklevel=4,
    )


def carry_kept_(template: nn.Module, copied: Any, rows: torch.Tensor | None = None) -> None:
    """What the forwards kept on ``template`` (``set_kept_``'s stacks), on the template of the
    ensemble ``copied`` from it (``copy.deepcopy(ens)``; ``select``: its ``rows``), as copies
    handed back at that one's next call: a copy of a plain module holds its hidden state too
    (``copy.deepcopy(model)``; an averaged model's ``update_bn`` went on from it). The copy
    started with none there (0.75 off in ``update_bn``'s statistics, silently). One with a
    graph (right after ``ens(x)``, before a step) is left behind: alone ``deepcopy`` refuses
    it; so are those of members of different sizes (stacked at the padded size)."""
    if copied._padding is not None:  # members of different sizes: kept at the padded size
        return
    kept, copies, unreturned = {}, {}, set()  # a container several modules share: one copy
    handed = {(path, key) for path, key, _ in kept_on(template)}
    for path, key, value in kept_on(template, lent=True):
        if any(t.requires_grad for t in tensor_leaves(value) or ()):
            continue
        pick = (lambda t: t.clone()) if rows is None else (lambda t: t[rows].clone())
        if id(value) not in copies:
            copies[id(value)] = map_kept(pick, value)
        kept[f"{path}:{key}"] = copies[id(value)]
        if (path, key) not in handed:
            unreturned.add(f"{path}:{key}")
    if kept:
        copied._followers[4].settle(set_kept_(copied._template, kept, unreturned))


def rows_of_kept_(member: nn.Module, template: nn.Module, i: int) -> None:
    """Row ``i`` of each tensor ``set_kept_`` put on the template, on ``member``'s module of the
    same name, detached (a copy: a module that ran keeps its own)."""
    modules, rows = dict(member.named_modules()), {}  # a shared container: one row for all
    for path, key, value in kept_on(template, lent=True):
        if path in modules:
            if id(value) not in rows:
                rows[id(value)] = map_kept(lambda t: t[i].detach().clone(), value)
            modules[path].__dict__[key] = rows[id(value)]
