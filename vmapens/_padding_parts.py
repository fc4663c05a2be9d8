"""Members of different sizes: which member's module the others are padded to.

This file imports only torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["check_zero_padding", "largest"]


def largest(api: str, shapes: Sequence[Mapping[str, tuple[int, ...]]]) -> int:
    """The kind whose every tensor is at least as large as every other kind's, in every dim.

    Raises:
        ValueError: no kind is largest everywhere, or a tensor's number of dims differs.
    """
    for k, candidate in enumerate(shapes):
        if all(
            len(s[name]) == len(candidate[name])
            and all(a <= b for a, b in zip(s[name], candidate[name], strict=True))
            for s in shapes
            for name in candidate
        ):
            return k
    for s in shapes[1:]:
        for name, shape in s.items():
            if len(shape) != len(shapes[0][name]):
                raise ValueError(
                    f"{api}: members differ in the number of dims of `{name}`: {shape} vs "
                    f"{shapes[0][name]}"
                )
    sizes = [sum(math.prod(v) for v in s.values()) for s in shapes]
    raise ValueError(
        f"{api}: no member is the largest in every dimension (e.g. hidden sizes (16, 64) "
        "and (64, 16)): members are padded to one member's module, which must be at least as "
        f"wide as every other everywhere; got {len(shapes)} sizes (parameter counts {sizes})"
    )


def check_zero_padding(api: str, state: Mapping[str, Any], padding: Any) -> None:
    """Refuse stacked tensors (``{name: [n, ...]}``) that are not 0 where ``padding`` (a
    ``vmapens._padding.Padding``, or None) pads a member, naming the first.

    ``load`` reads such a file as one of members of other sizes and refuses it, so it is
    refused before it is written: a member's values copied in by hand over its padded entries
    (``sd[k][i].copy_(v)`` broadcasts a width-1 member's row over them)."""
    if padding is None:
        return
    for name, mask in padding.masks(state).items():
        wrong = state[name].detach().ne(0) & mask.eq(0)
        rows = wrong.flatten(1).any(1).nonzero().flatten().tolist()
        if rows:
            raise ValueError(
                f"{api}: member row {rows[0]} of `ens` holds non-zero values in `{name}` where "
                "it is padded to the largest member (a value copied over the padding by "
                "hand?), which `load` would refuse; copy a member's values into its own corner "
                "(`t[i][:h]`) and keep the padded entries 0"
            )
