"""Plain attributes set on ``ens.template`` after building reach the modules the ensemble runs.

The ensemble runs a deep copy of the template (``ens.runner``, with the layers vmap batches
badly swapped for twins: ``vmapens._batchable``) and, for members of different sizes, one meta
module per size. On a plain module, ``model.drop.p = 0.2``, ``model.bn.momentum = 0.01`` or
``model.temperature = 0.5`` changes the next forward; on ``ens.template`` it would change
nothing the members run, silently. So before every call of the members the template's
attributes are compared with those seen last (by identity: one C-level pass per submodule),
and an attribute assigned a new value is set on every module that follows it. A BatchNorm
given ``momentum=None`` (or given one back) is re-classed as ``batchable`` would have built it.

Not followed: ``nn.Module``'s own bookkeeping (parameters, buffers, submodules, hooks,
``training``, which ``_follow_template`` follows itself), the RNN layers' caches of their
weights, weight_norm's recomputed tensors, and a mutable value changed in place
(``ens.template.sizes.append(3)``): assign a new value instead.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from typing import Any

from torch import nn

from ._batchable import twin_class
from ._stacking import recomputed

__all__ = ["Watched"]

#: ``nn.Module``'s own entries in a module's ``__dict__``, and ``nn.RNNBase``'s views of its
#: weights (kept per module object; functional_call writes them in place).
INTERNAL = frozenset(nn.Module().__dict__) | {
    "_flat_weights",
    "_flat_weights_names",
    "_all_weights",
    "_flat_weight_refs",
}

#: Each ``Watched``'s ``version``: unique in the process, new at every followed change.
_VERSIONS = itertools.count()

#: Values equal by ``==`` count as unchanged: a deep copy or a pickle round trip gives an int
#: or a tuple of ints back as another object, and a padded template's sizes must stay its own.
_PLAIN = (int, float, bool, str, type(None), tuple)


def _names(module: nn.Module, skip: set[str]) -> list[str]:
    return [k for k in module.__dict__ if k not in INTERNAL and k not in skip]


def _same(a: object, b: object) -> bool:
    return a is b or (type(a) is type(b) and isinstance(a, _PLAIN) and a == b)


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
        self.modules = [m for _, m in template.named_modules()]
        self.followers = [followers.get(name, []) for name, _ in template.named_modules()]
        self.skip = [skip.get(id(m), set()) for m in self.modules]
        self.names = [_names(m, s) for m, s in zip(self.modules, self.skip, strict=True)]
        self._seen()

    def _seen(self) -> None:
        """The values now, flat: ``follow`` compares them in two C-level passes; a new
        ``version`` (what a compiled step keys its graphs' parts by, as it keys modes)."""
        self.version = next(_VERSIONS)
        self.dicts: list[dict[str, Any]] = [m.__dict__ for m in self.modules]
        self.sizes = list(map(len, self.dicts))
        self.owners = [m for m, names in zip(self.modules, self.names, strict=True) for _ in names]
        self.keys = [k for names in self.names for k in names]
        self.owned: list[dict[str, Any]] = [m.__dict__ for m in self.owners]
        self.values = list(map(dict.get, self.owned, self.keys))

    def __getstate__(self) -> dict[str, Any]:  # the copies' ``__dict__``s are other objects
        return {k: v for k, v in vars(self).items() if k not in ("dicts", "owned")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update(state)
        self.dicts = [m.__dict__ for m in self.modules]
        self.owned = [m.__dict__ for m in self.owners]

    def follow(self) -> None:
        """What changed on the template since the last call, set on its followers."""
        if list(map(len, self.dicts)) == self.sizes and all(
            map(operator.is_, map(dict.get, self.owned, self.keys), self.values)
        ):
            return
        before = {
            (id(m), k): v for m, k, v in zip(self.owners, self.keys, self.values, strict=True)
        }
        for i, module in enumerate(self.modules):
            state, old = vars(module), self.names[i]
            self.names[i] = _names(module, self.skip[i])
            changed = [
                k for k in self.names[i]
                if (id(module), k) not in before or not _same(state[k], before[id(module), k])
            ]  # fmt: skip
            gone = [k for k in old if k not in state]
            for f, is_runner in self.followers[i]:
                for k in changed:
                    vars(f)[k] = state[k]
                for k in gone:
                    vars(f).pop(k, None)
                if is_runner and type(f) is not twin_class(module):
                    f.__class__ = twin_class(module)
        self._seen()
