"""How every random choice of a member is seeded: its initialisation and its bootstrap resample.

Each seed is derived from ``(seed, purpose, index)`` by SHA-256, so streams never overlap and
a member gets the same ones alone, in one process or in any shard.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from ._checks import check_int, to_index

__all__ = ["bootstrap_indices", "derive_seed", "member_seed"]


def derive_seed(seed: int, purpose: str, index: int) -> int:
    """A 63-bit seed from ``(seed, purpose, index)`` by SHA-256: no two triples share a stream."""
    digest = hashlib.sha256(f"vmapens:{seed}:{purpose}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def member_seed(seed: int, i: int) -> int:
    """The torch seed of member ``i`` of ``Ensemble(factory, n, seed=seed)``.

    ``torch.manual_seed(member_seed(seed, i)); factory()`` rebuilds member ``i`` alone. The
    seed is derived from ``(seed, i)`` by a hash, so ensembles built with different seeds share
    no member (``seed + i`` would make seeds 0 and 1 share all but one).

    Args:
        seed: the ensemble's seed.
        i: the member's global index, ``>= 0``.

    Returns:
        A non-negative int below ``2**63``.

    Example:
        >>> member_seed(0, 1) == member_seed(1, 0)
        False
    """
    check_int("member_seed", "seed", seed)
    check_int("member_seed", "i", i, minimum=0)
    return derive_seed(seed, "member", i)


def bootstrap_indices(n_samples: int, seed: int, member_id: int) -> Tensor:
    """The rows that member ``member_id`` trains on with ``fit(..., bootstrap=True, seed=seed)``.

    A resample with replacement of ``range(n_samples)``, drawn from a generator keyed by
    ``(seed, member_id)``: the global member index, so a member gets the same rows whether it
    is trained alone, in one process or in any shard. Rows that are absent are its out-of-bag
    samples.

    Example:
        >>> idx = bootstrap_indices(10, seed=0, member_id=3)
        >>> idx.shape, bool((idx >= 0).all() and (idx < 10).all())
        (torch.Size([10]), True)
    """
    check_int("bootstrap_indices", "n_samples", n_samples, minimum=1)
    check_int("bootstrap_indices", "seed", seed)
    check_int("bootstrap_indices", "member_id", member_id, minimum=0)
    g = torch.Generator().manual_seed(derive_seed(seed, "bootstrap", member_id))
    return torch.randint(n_samples, (n_samples,), generator=g)


def check_seeds(api: str, seeds: Any, n: int, seed: int | None) -> list[int]:
    """``seeds`` as ``n`` Python ints: a sequence of integer-likes (numpy and 0-d tensor
    integers too) or a 1-D integer tensor or array, as ``torch.manual_seed`` takes each."""
    if seed is not None:
        raise ValueError(f"{api}: give `seed` or `seeds`, not both")
    array = isinstance(seeds, Tensor) or type(seeds).__module__ == "numpy"
    if array and getattr(seeds, "ndim", None) == 1:  # np.random.default_rng().integers(...)
        seeds = seeds.tolist()  # integers as ints; floats and bools are refused below
    if isinstance(seeds, (str, bytes)) or not isinstance(seeds, Sequence):
        raise TypeError(
            f"{api}: `seeds` must be a sequence of {n} ints, got {type(seeds).__name__}"
        )
    if len(seeds) != n:
        raise ValueError(f"{api}: `seeds` has {len(seeds)} values, expected n={n}, one per member")
    out = [to_index(s) for s in seeds]
    for k, (s, v) in enumerate(zip(seeds, out, strict=True)):
        if v is None:
            raise TypeError(f"{api}: `seeds[{k}]` must be an int, got {type(s).__name__}")
        # Refused here, before any member is built: torch.manual_seed would fail only at
        # member k, with an overflow error that names neither the API nor the argument.
        if not -(2**63) <= v < 2**64:
            raise ValueError(
                f"{api}: `seeds[{k}]` must be in [-2**63, 2**64 - 1], the range "
                f"torch.manual_seed takes, got {v}"
            )
    return [int(v) for v in out if v is not None]


@contextlib.contextmanager
def lazy_seeds_kept() -> Iterator[None]:
    """Give back the seeds ``torch.manual_seed`` queues for CUDA before it is initialized.

    ``torch.random.fork_rng`` restores initialized devices only: each member's
    ``torch.manual_seed`` replaced the seed the caller had queued (``torch.manual_seed(123)``,
    then the ensemble, then the first CUDA draw: not seed 123's). A factory that initializes
    CUDA applies the last queued seed; the caller's queued seeds then run again.
    """
    tracker = getattr(torch.cuda, "_lazy_seed_tracker", None)
    saved = None if tracker is None or torch.cuda.is_initialized() else dict(vars(tracker))
    try:
        yield
    finally:
        if saved is not None and not torch.cuda.is_initialized():
            vars(tracker).update(saved)
        elif saved is not None:
            for call in saved["call_order"]:
                if call:
                    call[0]()
