"""The eager step's forward and backward one chunk of members at a time (``chunk_size``)."""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import optree
import torch
from torch import nn
from torch.nn.utils import parametrize

from ._batch_edits import Versions, refuse_edited, shared_versions
from ._buffer_turns import Slices, Turns
from ._fastcall import vmap_members
from ._generator_draws import generators_in
from ._plain_turns import plain_turns
from ._step_more import run_grad_hooks

__all__ = [
    "Draws",
    "chunk_bounds",
    "chunked_losses_and_grads",
    "in_order",
    "in_turns",
    "rows",
    "uncache",
    "uncached",
    "vmap_in_turns",
]


def chunk_bounds(n: int, chunk_size: int | None) -> list[tuple[int, int]] | None:
    """``[(start, stop), ...]`` covering ``range(n)`` in ``chunk_size`` steps, as
    ``torch.func.vmap(chunk_size=...)`` splits it; ``None`` when one chunk holds every member."""
    if chunk_size is None or chunk_size >= n:
        return None
    return [(a, min(a + chunk_size, n)) for a in range(0, n, chunk_size)]


def in_order(
    bounds: Iterable[tuple[int, int]],
    shared: Versions,
    how: str,
    same_randomness: bool,
    runner: nn.Module | None,
    args: Any = (),
) -> Iterator[tuple[int, int]]:
    """The turns ``bounds`` (members ``a`` to ``b - 1`` each), one after another, as vmap runs
    its chunks: before every turn after the first, one that follows a turn that edited a
    tensor of ``shared`` (the batch all members share) is refused (``refuse_edited``, ``how``:
    the setting that runs turns), for ``randomness="same"`` (``same_randomness``) the random
    states are put back (``Draws``), so that every turn draws what the first drew, and the
    plain values on ``runner``'s modules (the module the members run) are put back
    (``PlainTurns``)."""
    draws = Draws(args, runner) if same_randomness else None
    plain = plain_turns(runner)
    last: tuple[int, int] | None = None
    ends: list[tuple[int, list[torch.Tensor]]] = []  # (first member, states) after each turn
    for a, b in bounds:
        if last is not None:
            refuse_edited(shared, how, *last)
        if draws is not None:
            if last is not None:
                ends.append((last[0], draws.now()))
            draws.restore()
        if plain is not None:
            plain.next_turn()
        yield a, b
        last = (a, b - 1)
    if draws is not None and last is not None:
        _warn_uneven_draws(how, ends, last[0], draws.now())


#: A module's own dicts of tensors and submodules: no generator there.
_TORCH_SLOTS = frozenset(("_parameters", "_buffers", "_modules"))


class Draws:
    """Where every random draw a turn can make starts: torch's global CPU generator, the
    current CUDA device's once CUDA is up, and each ``torch.Generator`` in the call's
    arguments or held by one of ``runner``'s modules (``torch.randn(..., generator=g)``),
    one level into an object there too (a dataclass, a ``functools.partial``), as the
    self-check finds them (``generators_in``; a generator in ``self.cfg.g`` went on from
    where the turn before left it, silently, until session 47)."""

    def __init__(self, args: Any, runner: nn.Module | None) -> None:
        found = generators_in(args)
        for module in () if runner is None else runner.modules():
            found += generators_in([v for k, v in vars(module).items() if k not in _TORCH_SLOTS])
        self.generators = list({id(g): g for g in found}.values())
        self.cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        self.states = self.now()

    def now(self) -> list[torch.Tensor]:
        """Every state, in order."""
        cuda = [torch.cuda.get_rng_state()] if self.cuda else []
        return [torch.get_rng_state(), *cuda, *(g.get_state() for g in self.generators)]

    def restore(self) -> None:
        """Every state as it was when this was made."""
        states = iter(self.states)
        torch.set_rng_state(next(states))
        if self.cuda:
            torch.cuda.set_rng_state(next(states))
        for g in self.generators:
            g.set_state(next(states))


def _warn_uneven_draws(
    how: str, ends: list[tuple[int, list[torch.Tensor]]], final: int, now: list[torch.Tensor]
) -> None:
    """Warn when the turns of a ``randomness="same"`` call left the random states in different
    places (``ends``: each turn's first member and the states it left; the last turn, whose
    first member is ``final``, left ``now``): the next call goes on from the last turn's
    states, which is not where the other members' draws leave their RNG alone."""
    uneven = [i for i, states in ends if not all(map(torch.equal, states, now))]
    if uneven:
        warnings.warn(
            f"{how} with randomness='same': member {uneven[0]} drew other random numbers "
            f"than member {final} in this call (a draw under a condition on the member's "
            f"values, such as a dead-code restart only when a code is unused), so the "
            f"global RNG goes on from member {final}'s state, and from the next call on "
            f"member {uneven[0]} no longer draws what it draws alone. Draw the same numbers "
            "in every member (draw unconditionally, pick with torch.where), or build with "
            "randomness='different' (independent draws, the same in distribution)",
            UserWarning,
            stacklevel=2,
        )


def in_turns(
    fn: Callable[..., Any],
    versions: Versions,
    size: int,
    runner: nn.Module | None,
    draws: Draws | None = None,
) -> Callable[..., Any]:
    """``fn`` as ``torch.func.vmap(chunk_size=size)`` calls it, once per chunk of members in
    turn: a chunk after one that edited a tensor of ``versions`` is refused (``refuse_edited``),
    every chunk starts from the plain values ``runner``'s modules held before the call
    (``PlainTurns``) and, with ``draws`` (``randomness="same"``), from its generators' states
    (torch.func puts back its global RNG only)."""
    plain = plain_turns(runner)
    draws = draws if draws is not None and draws.generators else None
    if not versions and plain is None and draws is None:
        return fn
    turns = itertools.count()

    def turn(*args: Any) -> Any:
        k = next(turns)
        if k and versions:
            refuse_edited(versions, f"chunk_size={size}", (k - 1) * size, k * size - 1)
        if plain is not None:
            plain.next_turn()
        if k and draws is not None:
            draws.restore()
        return fn(*args)

    return turn


def vmap_in_turns(
    fn: Callable[..., Any],
    randomness: str,
    turns: Turns,
    args: tuple,
    in_dims: tuple,
    size: int,
    runner: nn.Module | None,
) -> Any:
    """``vmap(fn, in_dims=(0, *in_dims), randomness=randomness, chunk_size=size)(state, *args)``
    with ``turns.state`` as ``state``, run chunk by chunk here, where torch.func would hand
    every chunk views of one storage per tensor: a chunk's rows of the state come from
    ``turns`` and its slices of the per-member inputs from ``Slices`` (copies once a chunk
    before edited its own, see ``_buffer_turns``). The random draws are torch.func's: chunk
    after chunk, the RNG state restored before each one for ``randomness="same"``; a chunk
    after one that edited a shared input is refused, and each starts from the plain values
    ``runner``'s modules held before the call (``in_order``).
    """
    state = turns.state
    n = next(iter(state.values())).shape[0]
    shared = shared_versions(args, in_dims)
    slices = Slices(args, in_dims)
    outputs = []
    bounds = chunk_bounds(n, size) or [(0, n)]
    how = f"chunk_size={size}"
    for a, b in in_order(bounds, shared, how, randomness == "same", runner, args):
        part = slices.take(slice(a, b))
        outputs.append(vmap_members(fn, b - a, randomness, turns.take(slice(a, b)), part, in_dims))
        turns.give_back(slice(a, b))
        slices.give_back()
    return optree.tree_map(lambda *xs: torch.cat(xs), *outputs)


def rows(tree: Any, a: int, b: int) -> Any:
    """Every tensor of ``tree`` cut to its rows ``a:b`` (members ``a`` to ``b - 1``)."""
    return optree.tree_map(lambda t: t[a:b] if isinstance(t, torch.Tensor) else t, tree)


def chunked_losses_and_grads(
    batched: Callable[..., torch.Tensor],
    state: dict[str, torch.Tensor],
    params: Sequence[torch.Tensor],
    args: tuple,
    in_dims: tuple,
    scale: torch.Tensor | None,
    chunks: list[tuple[int, int]],
    same_randomness: bool,
    autocast: Callable[[], contextlib.AbstractContextManager],
    runner: nn.Module | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Per-member losses ``[n]`` and the gradients of their sum, one chunk of members at a time.

    Members are independent: member ``i``'s gradient depends on member ``i``'s rows alone. So
    each chunk runs its forward and its backward before the next one starts, on fresh leaves
    that are views of its rows of the stacked parameters, and its gradients are written into
    the rows of full-size gradients: only one chunk's activations are alive at a time, where
    ``vmap(chunk_size=...)`` under autograd keeps every chunk's until the backward. The random
    draws are vmap's own: chunk after chunk in member order, the RNG state restored before
    each chunk for ``randomness="same"`` (as ``vmap`` does), so the result equals the one
    ``vmap(chunk_size=...)`` gives. A chunk after one that edited a batch tensor all members
    share is refused (``EditedInTurns``): it would see that chunk's edits.

    Args:
        batched: ``(state, *args, rows=slice) -> losses[chunk]``, the ensemble's member map of
            the member loss (``rows``: which members ``state`` holds).
        state: the stacked parameters and buffers by name.
        params: the trained stacked parameters (tensors of ``state``), in the order of the
            returned gradients.
        args: the member loss's arguments after the state (the step's inputs, its targets,
            the rows of what the forwards kept); ``in_dims``: one per argument, ``0`` where
            it holds one slice per member, else ``None``.
        scale: a per-member loss scale ``[n]`` multiplied into the differentiated loss, or
            ``None``.
        chunks: the member ranges, from :func:`chunk_bounds`.
        same_randomness: restore the RNG state before every chunk (``randomness="same"``).
        autocast: the forward's autocast context (the backward runs outside it).
        runner: the module the members run: each chunk starts from the plain values its
            modules held before the step (``in_order``); ``None``: no module to keep.

    Returns:
        The detached losses ``[n]`` (unscaled) and one gradient per ``params`` entry (``None``
        where no member's loss depends on it).
    """
    names = {id(t): name for name, t in state.items()}
    # A tensor the optimizer holds that the ensemble has no more (a parameter replaced since,
    # `load_state_dict(assign=True)`, a new head) gets no gradient, as alone.
    known = [j for j, p in enumerate(params) if id(p) in names]
    trained = [names[id(params[j])] for j in known]
    found: list[torch.Tensor | None] = [None] * len(known)
    losses = []
    # A forward that edits a shared batch tensor would show chunk k the edits of chunks < k.
    shared = shared_versions(args, in_dims)
    how = f"chunk_size={chunks[0][1]}"
    for a, b in in_order(chunks, shared, how, same_randomness, runner, args):
        member_args = tuple(
            x if d is None else rows(x, a, b) for x, d in zip(args, in_dims, strict=True)
        )
        losses.append(
            _run_chunk(batched, state, trained, found, member_args, scale, a, b, autocast)
        )
    grads: list[torch.Tensor | None] = [None] * len(params)
    for j, g in zip(known, found, strict=True):
        grads[j] = g
    run_grad_hooks(params, grads)  # the stacked parameters' own: one backward runs them
    return torch.cat(losses), grads


def _run_chunk(
    batched: Callable[..., torch.Tensor],
    state: dict[str, torch.Tensor],
    trained: list[str],
    grads: list[torch.Tensor | None],
    member_args: tuple,
    scale: torch.Tensor | None,
    a: int,
    b: int,
    autocast: Callable[[], contextlib.AbstractContextManager],
) -> torch.Tensor:
    """Forward and backward of members ``a:b``; their gradients go into rows ``a:b`` of
    ``grads`` (a full-size zero gradient is made where an entry is still ``None``).

    A function of its own so that nothing of the chunk outlives it: its gradients, loss and
    graph are freed on return, before the next chunk allocates its activations.

    Returns:
        The chunk's detached losses ``[b - a]``.
    """
    leaves = {k: state[k][a:b].detach().requires_grad_() for k in trained}
    part = {k: leaves.get(k, v[a:b]) for k, v in state.items()}
    with autocast():
        loss = batched(part, *member_args, rows=slice(a, b))
    scaled = loss if scale is None else loss * scale[a:b]
    found = torch.autograd.grad(scaled.sum(), [leaves[k] for k in trained], allow_unused=True)
    for j, g in enumerate(found):
        if g is None:
            continue
        full = grads[j]
        if full is None:
            full = grads[j] = torch.zeros_like(state[trained[j]])
        full[a:b] = g
    return loss.detach()


def uncache() -> None:
    """Drop what ``torch.nn.utils.parametrize.cached()`` holds: it caches a parametrized tensor
    by module, and the members share their modules."""
    if parametrize._cache_enabled:
        parametrize._cache.clear()


def uncached(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` starting each call (one chunk of members) with an empty ``parametrize`` cache:
    a later chunk read the first chunk's parametrized tensors (members 2 and 3 of 4 off by
    ~0.6 under ``parametrize.cached()`` with ``chunk_size=2``)."""

    def call(*args: Any) -> Any:
        uncache()
        return fn(*args)

    return call
