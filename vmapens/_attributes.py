"""Plain attributes set on ``ens.template`` after building reach the modules the ensemble runs.

The ensemble runs a deep copy of the template (``ens.runner``, with the layers vmap batches
badly swapped for twins: ``vmapens._batchable``) and, for members of different sizes, one meta
module per size. On a plain module, ``model.drop.p = 0.2``, ``model.bn.momentum = 0.01`` or
``model.temperature = 0.5`` changes the next forward; on ``ens.template`` it would change
nothing the members run, silently. So before every call of the members the template's
attributes are compared with those seen last (by identity: one C-level pass per submodule),
and an attribute assigned a new value is set on every module that follows it. A BatchNorm
given ``momentum=None`` (or given one back) is re-classed as ``batchable`` would have built it.

Not followed: ``nn.Module``'s own bookkeeping (parameters, buffers, hooks, ``training``,
which ``_follow_template`` follows itself), the RNN layers' caches of their weights,
weight_norm's recomputed tensors, and a mutable value changed in place
(``ens.template.sizes.append(3)``): assign a new value instead. A submodule replaced on the
template (``ens.template.act = nn.GELU()``) is refused at the next call: the copies are paired
with the modules the ensemble was built with, and would go on running the old one.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence
from typing import Any

from torch import nn

from ._batchable import twin_class
from ._boxes import cleared, kept_again
from ._hooks import held_tensor
from ._members import named_tensors
from ._plain_turns import INTERNAL, plain_value
from ._stacking import left_by_forward, recomputed, scrubbing
from ._unbatchable import unchunked

__all__ = ["INTERNAL", "Watched", "forward_set"]

#: Each ``Watched``'s ``version``: unique in the process, new at every followed change.
_VERSIONS = itertools.count()

#: Values equal by ``==`` count as unchanged: a deep copy or a pickle round trip gives an int
#: or a tuple of ints back as another object, and a padded template's sizes must stay its own.
_PLAIN = (int, float, bool, str, type(None), tuple)

_VERSION_OF = operator.attrgetter("_version")


def _slots(m: nn.Module) -> list[tuple[str, Any]]:
    return [*m._parameters.items(), *m._buffers.items()]


def _names(module: nn.Module, skip: set[str]) -> list[str]:
    return [k for k in module.__dict__ if k not in INTERNAL and k not in skip]


def _scrubbed(now: object, before: object) -> bool:
    """A forward's tensor replaced by None while ``scrubbed`` is at work (a copy of the
    ensemble, which follows the template with the same ``Watched``), not a value for every
    member. Outside a copy it is the user's reset (``ens.template.h = None``): followed."""
    return (now is None or cleared(now)) and left_by_forward(before) and scrubbing()


def _same(a: object, b: object) -> bool:
    """Whether ``b`` computes as ``a``: ``==`` alone took ``-0.0`` for ``0.0`` (``x / t`` is
    ``-inf`` for one, ``inf`` for the other) and ``(1.0,)`` for ``(1,)``."""
    if a is b:
        return True
    if type(a) is not type(b) or not isinstance(a, _PLAIN):
        return False
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, float) and isinstance(b, float):
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    return a == b


def forward_set(template: nn.Module, runner: nn.Module) -> dict[str, dict[str, object]]:
    """The plain values a forward set on ``runner``'s modules (``self.initialized = True``, a
    counter), by module path: those that differ from the template's (``Watched.follow`` set
    the template's last). A plain module keeps what its forward set, so ``ens[i]`` must too.
    ``unchunked``'s ``options=None`` is the runner's own, not the forward's."""
    found: dict[str, dict[str, object]] = {}
    if runner is template:  # backend="loop": the forward ran on the template itself
        return found
    own = dict(template.named_modules())
    loss = getattr(nn, "LinearCrossEntropyLoss", None)
    for path, m in runner.named_modules():
        kept = vars(own[path]) if path in own else {}
        values = {
            k: v for k, v in vars(m).items()
            if k not in INTERNAL and plain_value(v) and (k not in kept or not _same(v, kept[k]))
            and not (k == "options" and type(m) is loss)
        }  # fmt: skip
        if values:
            found[path] = values
    return found


class Watched:
    """The template's modules, the attribute values seen last, and the modules that follow
    each template module: those of the same name in the runner (re-classed as ``batchable``
    would) and in the padded templates."""

    def __init__(self, template: nn.Module, runner: nn.Module, padded: Sequence[nn.Module]) -> None:
        skip: dict[int, set[str]] = {}
        for m, name, _ in recomputed(template):  # weight_norm's tensors, set every forward
            skip.setdefault(id(m), set()).add(name)
        followers: dict[str, list[tuple[nn.Module, bool]]] = {}
        for tree, is_runner in ((runner, True), *((t, False) for t in padded)):
            for name, m in tree.named_modules():
                followers.setdefault(name, []).append((m, is_runner))
        named = list(template.named_modules())
        self.prefixes = [name for name, _ in named]
        self.modules = [m for _, m in named]
        self.built_children = [dict(m._modules) for m in self.modules]
        self.built_tensors = [(set(m._parameters), set(m._buffers)) for m in self.modules]
        self.built_held = [{k for k, t in _slots(m) if t is not None} for m in self.modules]
        self.followers = [followers.get(name, []) for name in self.prefixes]
        self.skip = [skip.get(id(m), set()) for m in self.modules]
        self.names = [_names(m, s) for m, s in zip(self.modules, self.skip, strict=True)]
        self._seen()

    def _seen(self) -> None:
        """The values now, flat: ``follow`` compares them in two C-level passes; a new
        ``version`` (what a compiled step keys its graphs' parts by, as it keys modes). The
        submodules ride along, in ``_modules`` (``count``: the attributes' entries first)."""
        self.version = next(_VERSIONS)
        modules = self.modules
        self.owners = [m for m, names in zip(modules, self.names, strict=True) for _ in names]
        self.keys = [k for names in self.names for k in names]
        self.count = len(self.keys)
        self.keys += [k for m in modules for k in m._modules]
        self.keys += [k for m in modules for d in (m._parameters, m._buffers) for k in d]
        self._link()
        self.sizes = list(map(len, self.dicts))
        self.values = list(map(dict.get, self.owned, self.keys))
        named = [
            (f"{prefix}.{k}" if prefix else k, t)
            for prefix, m in zip(self.prefixes, modules, strict=True)
            for d in (m._parameters, m._buffers)
            for k, t in d.items()
            if t is not None
        ]
        self.paths = [path for path, _ in named]
        self.tensors = [t for _, t in named]
        self.stamps = list(map(_VERSION_OF, self.tensors))  # in-place writes bump `_version`

    def _link(self) -> None:
        """The dicts ``follow`` reads (a copy's are other objects): every module's ``__dict__``
        and ``_modules``, and the dict each of ``keys`` is in (the owners' ``__dict__``, then
        ``_modules``)."""
        self.dicts: list[dict[str, Any]] = [m.__dict__ for m in self.modules] + [
            m._modules for m in self.modules
        ]
        # Their lengths too: a parameter or buffer registered after building is no member's.
        self.dicts += [d for m in self.modules for d in (m._parameters, m._buffers)]
        self.owned: list[dict[str, Any]] = [m.__dict__ for m in self.owners] + [
            m._modules for m in self.modules for _ in m._modules
        ]  # then each parameter and buffer, by identity: one replaced is refused
        self.owned += [d for m in self.modules for d in (m._parameters, m._buffers) for _ in d]
        owners = zip(self.owners, self.keys[: self.count], strict=True)
        self.slot = {(id(m), k): j for j, (m, k) in enumerate(owners)}  # for ``settle``

    def settle(self, kept: list[tuple[nn.Module, str]]) -> None:
        """``(template module, attribute)`` for each tensor ``Ensemble.forward`` set on the
        template (what the forward kept, stacked): seen as it is, without a new ``version``,
        and never followed (the runner keeps its own for the next call). An attribute the
        template had not is taken once by ``follow``'s slow path (``left_by_forward``)."""
        for module, key in kept:
            j = self.slot.get((id(module), key))
            if j is not None:
                self.values[j] = vars(module)[key]

    def __getstate__(self) -> dict[str, Any]:  # the copies' ``__dict__``s are other objects
        state = {k: v for k, v in vars(self).items() if k not in ("dicts", "owned", "slot")}
        # as ``scrub_`` leaves the template: torch copies no tensor with a graph
        state["values"] = [None if left_by_forward(v) else v for v in self.values]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update(state)
        self._link()

    def follow(self) -> None:
        """What changed on the template since the last call, set on its followers.

        Raises:
            ValueError: a submodule of the template was replaced, added or deleted.
        """
        if (
            list(map(len, self.dicts)) == self.sizes
            and all(map(operator.is_, map(dict.get, self.owned, self.keys), self.values))
            and list(map(_VERSION_OF, self.tensors)) == self.stamps
        ):
            return
        self._refuse_new_children()
        self._refuse_written()
        attributes = zip(self.owners, self.keys[: self.count], self.values, strict=False)
        before = {(id(m), k): v for m, k, v in attributes}
        changes = []
        for i, module in enumerate(self.modules):
            state, names = vars(module), _names(module, self.skip[i])
            changed = [
                k for k in names
                if ((id(module), k) not in before or not _same(state[k], before[id(module), k]))
                and not left_by_forward(state[k])
                and not _scrubbed(state[k], before.get((id(module), k)))
                and not kept_again(state[k], before.get((id(module), k)))
            ]  # fmt: skip
            changes.append((names, changed))
        self._refuse_held_tensors(changes)
        for i, module in enumerate(self.modules):
            state, old = vars(module), self.names[i]
            self.names[i], changed = changes[i]
            gone = [k for k in old if k not in state]
            for f, is_runner in self.followers[i]:
                for k in changed:
                    vars(f)[k] = state[k]
                for k in gone:
                    vars(f).pop(k, None)
                if is_runner and type(f) is not twin_class(module):
                    f.__class__ = twin_class(module)
                if is_runner and changed:
                    unchunked(f)  # LinearCrossEntropyLoss's `options`: its chunked path
        self._seen()

    def _refuse_held_tensors(self, changes: list[tuple[list[str], list[str]]]) -> None:
        """A value set on the template that holds one of its tensors (``template.ws =
        [template.fc.weight]``): a member would read the template's ``meta`` tensor, not its
        own (as at build, ``_members.check_member``). Refused before any follower changes."""
        if not any(changed for _, changed in changes):
            return
        ids = {id(t): name for name, t in named_tensors(self.modules[0])}
        for prefix, module, (_, changed) in zip(self.prefixes, self.modules, changes, strict=True):
            for k in changed:
                if (held := held_tensor(vars(module)[k], ids)) is not None:
                    path = f"{prefix}.{k}" if prefix else k
                    raise ValueError(
                        f"Ensemble: `ens.template.{path}` holds the template's tensor `{held}`; "
                        "members' tensors are swapped into module slots only, so a forward "
                        "would read the template's (on meta) there: read it via its module"
                    )

    def check_written(self) -> None:
        """``_refuse_new_children`` and ``_refuse_written``: before the members' values are read
        out (``state_dict``, ``save``), so that a write or a new head on the template is not
        saved as if it had been made (the files held the old head, silently)."""
        self._refuse_new_children()
        if list(map(_VERSION_OF, self.tensors)) != self.stamps:
            self._refuse_written()

    def _refuse_written(self) -> None:
        """A template tensor written in place (``ens.template.apply(init)``,
        ``reset_parameters()``, ``nn.init.normal_(ens.template.fc.weight)``): it is on meta, so
        the write kept nothing and no member changed. Refused once (the write cannot be undone),
        naming the way to initialise the members."""
        for t, stamp, path in zip(self.tensors, self.stamps, self.paths, strict=True):
            if t._version != stamp:
                self.stamps = list(map(_VERSION_OF, self.tensors))
                raise ValueError(
                    f"Ensemble: `ens.template.{path}` was written in place (an initialisation, "
                    "`reset_parameters()` or a `.data` write on the template); it is on meta and "
                    "holds no values, so no member changed. Run it on every member with "
                    "ens.apply(fn), or write ens.stacked_params()[name] under torch.no_grad()"
                )

    def _refuse_new_children(self) -> None:
        """A submodule replaced on the template would never run: the runner and the padded
        templates keep the modules they were built with, their modes paired with those. A
        parameter or buffer registered (or deleted) after building is held by no member: the
        forward would read one tensor for all, never trained nor saved."""
        for prefix, m, (params, buffers) in zip(
            self.prefixes, self.modules, self.built_tensors, strict=True
        ):
            added = sorted((set(m._parameters) ^ params) | (set(m._buffers) ^ buffers))
            if added:
                path = f"{prefix}.{added[0]}" if prefix else added[0]
                raise ValueError(
                    f"Ensemble: the parameter or buffer `ens.template.{path}` was registered "
                    "or deleted after building; the ensemble stacks the tensors it was built "
                    "with, so no member would hold (train, save) it. Build a new ensemble from "
                    "members that have it (Ensemble.from_modules(...), or a factory that makes it)"
                )
        for prefix, m, held in zip(self.prefixes, self.modules, self.built_held, strict=True):
            for name, t in _slots(m):
                path = f"{prefix}.{name}" if prefix else name
                if t is None and name in held:  # the key stays: the members went on using theirs
                    raise ValueError(
                        f"Ensemble: `ens.template.{path}` was set to None after building; "
                        "every member holds its own and "
                        "would go on using it. Set it back, or build a new ensemble from members "
                        "without it (set it to None on each of ens.unstack(), then "
                        "Ensemble.from_modules(...))"
                    )
                if t is not None and not t.is_meta:
                    raise ValueError(
                        f"Ensemble: `ens.template.{path}` was replaced by a tensor on {t.device} "
                        "(load_state_dict(..., assign=True), an assignment, or a forward run "
                        "with backend='loop' that sets a buffer registered as None: register it "
                        "with a tensor of its final shape); the template is "
                        "on meta and every member holds its own tensors, so no member would "
                        "read it. Load values into the members: ens.load_state_dict() with "
                        "[n, ...] tensors, ens.stacked_params()[name].copy_(...), or build "
                        "the members with them"
                    )
        for prefix, m, built in zip(self.prefixes, self.modules, self.built_children, strict=True):
            now = dict(m._modules)
            for name in sorted(set(built) | set(now), key=str):
                if built.get(name) is not now.get(name):
                    path = f"{prefix}.{name}" if prefix else name
                    raise ValueError(
                        f"Ensemble: the submodule `ens.template.{path}` was replaced, added or "
                        "deleted after building; the members run copies of the modules the "
                        "ensemble was built with, so it would not run. Assign the built one "
                        "back, or build a new ensemble with it (Ensemble.from_modules(ens."
                        "unstack()) after editing the members, or a factory that makes it)"
                    )
