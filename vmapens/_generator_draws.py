"""Draws from a ``torch.Generator`` a member's forward or loss seeds itself, seen by the probe.

A forward or loss that makes and seeds its own generator at every call
(``g = torch.Generator().manual_seed(0)``, then ``torch.rand(shape, generator=g)``: fixed
noise, a fixed random projection, a fixed weighting of the loss) draws the same numbers in
every member alone. Under vmap with ``randomness="different"`` one batched draw gives each
member other numbers (the parameters were 0.04 off after one SGD step), and the probe's two
runs of member 0 agree (it draws first in both). So the step's probe runs member 0's forward
and loss once more, alone, under a function mode that notes the generators torch functions are
given, and refuses if one of them was made in that call (dead after it).

Not refused: a generator passed in the call's arguments (``ens(x, g)``) or living outside the
call (a module-level one): one stream, which a loop over the members draws from member after
member, other numbers for each. The pass is separate from the probe's comparison:
a function mode turns torch's own fast paths off (``nn.TransformerEncoder``'s nested tensors,
``has_torch_function``), which would move the truth the probe compares with.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import weakref
from collections.abc import Callable
from typing import Any

import optree
import torch
from torch.overrides import TorchFunctionMode

try:  # a forward may draw from numpy's global RNG: put back after the pass
    import numpy
except ImportError:  # torch runs without numpy
    numpy = None  # type: ignore[assignment]

__all__ = [
    "GeneratorDraws",
    "batched_draws",
    "generators_in",
    "made_in_the_call",
    "refuse_own_generators",
]


class GeneratorDraws(TorchFunctionMode):
    """The generators torch functions inside it were given (``generator=g``), but those in
    ``given`` (the call's arguments), held weakly: one dead after the call was made in it."""

    def __init__(self, *given: Any) -> None:
        super().__init__()
        self.passed = {id(g) for g in generators_in(given)}
        self.seen: list[weakref.ref] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for g in (*args, *kwargs.values()):
            if isinstance(g, torch.Generator) and id(g) not in self.passed:
                self.seen.append(weakref.ref(g))
        return func(*args, **kwargs)

    def made(self) -> bool:
        """Whether a generator drawn from was made in the call (none holds it after)."""
        return any(r() is None for r in self.seen)


def generators_in(tree: Any) -> list[torch.Generator]:
    """The generators in ``tree``'s leaves, and one level into a leaf's fields (a dataclass
    or another object holding the batch, a ``functools.partial``'s arguments)."""
    try:
        leaves: list[Any] = optree.tree_leaves(tree, none_is_leaf=True)  # type: ignore[arg-type]
    except (TypeError, ValueError, RuntimeError, RecursionError):  # keys optree cannot sort
        return []
    found = []
    for leaf in leaves:
        if isinstance(leaf, torch.Generator):
            found.append(leaf)
            continue
        fields: dict[Any, Any] = dict(getattr(leaf, "__dict__", None) or {})
        if isinstance(leaf, functools.partial):  # `partial(torch.randn, generator=g)`
            fields.update(enumerate(leaf.args), **leaf.keywords)
        if dataclasses.is_dataclass(leaf):  # slots=True: no __dict__
            fields.update((f.name, getattr(leaf, f.name, None)) for f in dataclasses.fields(leaf))
        found += [v for v in fields.values() if isinstance(v, torch.Generator)]
    return found


def batched_draws(ens: Any) -> bool:
    """Whether one vmap runs several members with ``randomness="different"``: a generator's
    draw is then one batched draw, other numbers for each member than alone."""
    return (
        ens.randomness == "different"
        and ens.backend == "vmap"
        and len(ens) > 1
        and ens.chunk_size != 1  # one member per vmap draws from its generator as alone
    )


def made_in_the_call(run: Callable[[], Any], *given: Any) -> bool:
    """Whether ``run()`` (member 0's forward and loss, alone, on a copy, the RNG forked) draws
    from a generator it makes itself; False where it fails (the probe reports that). Python's
    and numpy's RNG states are put back."""
    state = random.getstate()
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        draws = GeneratorDraws(*given)
        with draws, torch.no_grad():  # what it draws from, not its gradients
            run()
    except Exception:
        return False
    finally:
        random.setstate(state)
        if numpy is not None:
            numpy.random.set_state(numpy_state)
    return draws.made()


def refuse_own_generators(api: str, ens: Any, drew: bool) -> None:
    """Refuse a member that draws from a generator it makes (``drew``, seen where
    ``batched_draws``): each member would draw other numbers than alone.

    Raises:
        RuntimeError: naming the ways out.
    """
    if not drew:
        return
    name = type(ens.template).__name__
    raise RuntimeError(
        f"{api}: the forward or loss of {name} draws from a torch.Generator it makes and seeds "
        "itself (`torch.rand(..., generator=g)`): alone every member draws the same numbers "
        "from it, but with randomness='different' one batched draw under vmap gives each "
        "member other numbers. Build the ensemble with randomness='same' or backend='loop' "
        "(each member draws as alone), or make the fixed tensor once in __init__ as a buffer. "
        "Nothing was changed"
    )
