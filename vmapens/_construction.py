"""What ``Ensemble``'s constructors check and build before the container takes the members.

Their arguments (a factory, not a module; ``n``; ``seed`` or ``seeds``; ``randomness``,
``backend`` and ``chunk_size``), the members built each as it would be built alone and stacked,
the caller's global RNG left as it was when a build fails, and the runner: the module the
members run, made from the template.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ._batchable import batchable
from ._checks import check_choice, check_int
from ._container_ops import put_back
from ._ensemble_parts import refuse_synced
from ._members import Factory, build_members
from ._stacking import Stacked, recomputed, stack_one_size, stack_sizes
from ._unbatchable import unchunked
from .seeds import check_seeds

__all__ = [
    "BACKENDS",
    "RANDOMNESS",
    "check_factory",
    "check_options",
    "check_seeding",
    "factories_members",
    "factory_members",
    "rng_kept",
    "runner_for",
]

RANDOMNESS = ("different", "same", "error")
BACKENDS = ("vmap", "loop")


def check_factory(api: str, factory: Any, n: Any, seed: Any, seeds: Any) -> Sequence[int] | None:
    """``Ensemble(factory, n, seed=, seeds=)``'s arguments; returns ``seeds`` as checked."""
    if isinstance(factory, nn.Module):
        raise TypeError(
            f"{api}: `factory` must build a new member on each call, got an instance of "
            f"{type(factory).__name__}; pass the class (or a lambda), or use "
            "Ensemble.from_modules([...]) to stack existing modules"
        )
    if not callable(factory):
        raise TypeError(
            f"{api}: `factory` must be a zero-argument callable returning an nn.Module, "
            f"got {type(factory).__name__}"
        )
    check_int(api, "n", n, minimum=1)
    return check_seeding(api, n, seed, seeds)


def check_seeding(api: str, n: int, seed: Any, seeds: Any) -> Sequence[int] | None:
    """``seed`` (an int or None) and ``seeds`` (one int per member, or None); returns ``seeds``
    as checked."""
    if seed is not None:
        check_int(api, "seed", seed)
    if seeds is not None:
        seeds = check_seeds(api, seeds, n, seed)
    return seeds


def check_options(api: str, randomness: Any, chunk_size: Any, backend: Any) -> None:
    """The options every constructor takes: ``randomness``, ``chunk_size``, ``backend``."""
    check_choice(api, "randomness", randomness, RANDOMNESS)
    check_choice(api, "backend", backend, BACKENDS)
    if chunk_size is not None:
        check_int(api, "chunk_size", chunk_size, minimum=1)


def factory_members(
    api: str,
    factory: Factory,
    seed: int | None,
    seeds: Sequence[int] | None,
    member_ids: range,
    shard: bool,
) -> Stacked:
    """Members ``member_ids`` of ``Ensemble(factory, ...)``, built and stacked (one size)."""
    members = build_members(factory, seed, seeds, member_ids)
    stacked = stack_one_size(members, member_ids, api)
    refuse_synced(api, shard, [stacked.template])
    return stacked


def factories_members(
    api: str, factories: Sequence[Factory], seed: int | None, seeds: Sequence[int] | None
) -> Stacked:
    """``Ensemble.from_factories``'s members, built and stacked (sizes may differ)."""
    return stack_sizes(list(build_members(factories, seed, seeds, range(len(factories)))), api)


@contextlib.contextmanager
def rng_kept() -> Iterator[None]:
    """A failed build leaves the caller's global RNG as it was."""
    rng = torch.get_rng_state()
    try:
        yield
    except BaseException:
        torch.set_rng_state(rng)
        raise


def runner_for(template: nn.Module) -> nn.Module:
    """The module the members run: a batchable copy of ``template``."""
    runner = unchunked(batchable(template))
    for m, name, _ in recomputed(runner):  # leaked, a compiled step's graph fails
        m.register_forward_hook(functools.partial(put_back, name, m.__dict__[name]))
    return runner
