"""Seeds derived from (seed, purpose, index): independent streams that never overlap."""

from __future__ import annotations

import hashlib

from ._checks import check_int

__all__ = ["derive_seed", "member_seed"]


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
