"""``t[..., idx, ...] = v`` and ``t[p, :, idx]`` (``index_put_``, ``index``) under vmap: as alone.

functorch's rule for the in-place ``aten::index_put_`` on a batched ``self`` indexes the
member dim with an ``arange`` of its own. That moves torch's "where do the indexed dims go"
decision: alone, ``t[:, idx] = v`` writes ``v`` laid out ``[t.shape[0], len(idx), ...]``; with
the member ``arange`` in front the advanced indices are no longer adjacent, the indexed dims
go first, and the value is broadcast in the other order. Two forms are wrong:

* the advanced indices are not adjacent (``t[:, ar, :, ar] = v``, a shared ``ar``);
* they are adjacent but not first, and an index differs by member
  (``queue[:, idx] = keys.T`` with each member's own ``idx``).

Where the shapes differ torch raises a shape mismatch that alone does not; where they happen to
agree (the member count equal to a slot count, a square value) it writes other members' values
or the value transposed, silently. The out-of-place ``index_put`` rule is right.

A third form is wrong for reads (``aten::index``) too: a 0-d integer index that differs by member
(``t[p, :, idx]`` with ``p = scores.argmax()``). Alone, Python's indexing turns a 0-d index into
``select`` (no dim, and the other indices are laid out without it: ``[t.shape[1], len(idx)]``);
torch's indexing keeps a batched one as an index tensor, so there it counts as an advanced index
(``[len(idx), t.shape[1]]``: transposed, or a shape alone does not give).

While ``active()`` (the ensemble's calls) these rules write (and read) those forms with every dim
up to the last advanced index indexed explicitly (the member ``arange``, the index tensors, an
``arange`` for each slice between), each shaped so that the indexed block is laid out as alone,
members first; the value is broadcast to it as alone. Every other call (every call outside the
ensemble's calls, and at a vmap of the user's own inside a forward, where alone runs torch's
rule too) runs torch's own rule, kept with ``torch.library.get_kernel``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch._C._functorch import _add_batch_dim, _unwrap_batched

from ._vmap_rules import (
    below_vmap,
    current_level,
    current_vmap,
    members_first,
    outermost,
    override_keeping,
)

__all__ = ["register_index_rules"]


def register_index_rules(lib: torch.library.Library, active: Callable[[], bool]) -> None:
    """Register the two rules on ``lib`` (``aten``, ``IMPL``), over torch's own (kept with
    ``torch.library.get_kernel``; a torch without it keeps its own rules alone)."""
    override_keeping(lib, "index_put_", lambda torchs: _index_put_(torchs, active))
    override_keeping(lib, "index.Tensor", lambda torchs: _index(torchs, active))


def _index_put_(torchs: Any, active: Callable[[], bool]) -> Any:
    def rule(keyset: Any, self: Tensor, indices: list[Tensor | None], values: Tensor,
             accumulate: bool = False) -> Tensor:  # fmt: skip
        if active() and _maybe_misplaced(indices):
            level = current_level()
            x, xb = _unwrap_batched(self, level)
            held = [None if t is None else _unwrap_batched(t, level) for t in indices]
            if xb is not None and _torch_misplaces(held) and outermost(level):
                v, vb = _unwrap_batched(values, level)
                with below_vmap():
                    done = _write(x.movedim(xb, 0), held, v if vb is None else v.movedim(vb, 0),
                                  vb is not None, accumulate)  # fmt: skip
                if done:
                    return self
        return torchs.call_boxed(keyset, self, indices, values, accumulate)

    return rule


def _index(torchs: Any, active: Callable[[], bool]) -> Any:
    def read(keyset: Any, self: Tensor, indices: list[Tensor | None]) -> Tensor:
        if active() and any(t is not None and t.dim() == 0 for t in indices):  # cheap first
            level = current_level()
            held = [None if t is None else _unwrap_batched(t, level) for t in indices]
            if _member_scalar(held) and outermost(level):
                x, xb = _unwrap_batched(self, level)
                n = current_vmap().batch_size()
                with below_vmap():
                    x = members_first(x, xb, n)
                    explicit, _ = _explicit(n, x.shape[1:], held, x.device)
                    return _add_batch_dim(x[explicit], 0, level)
        return torchs.call_boxed(keyset, self, indices)

    return read


def _maybe_misplaced(indices: list[Tensor | None]) -> bool:
    """False where torch's rule is right whatever is batched (checked before unwrapping: the
    common ``t[idx] = v``): the indices first and adjacent, none of them 0-d."""
    at = [d for d, t in enumerate(indices) if t is not None]
    return at != list(range(len(at))) or any(t is not None and t.dim() == 0 for t in indices)


def _torch_misplaces(held: list[tuple[Tensor, int | None] | None]) -> bool:
    """Whether torch's rule lays the indexed dims out otherwise than alone (the docstring's
    two forms). Boolean masks are left to torch (their dims are counted otherwise)."""
    at = [d for d, h in enumerate(held) if h is not None]
    if not at or any(h is not None and not _is_long(h[0]) for h in held):
        return False
    adjacent = at == list(range(at[0], at[-1] + 1))
    batched = any(h is not None and h[1] is not None for h in held)
    return not adjacent or (at[0] > 0 and batched) or _member_scalar(held)


def _member_scalar(held: list[tuple[Tensor, int | None] | None]) -> bool:
    """A 0-d integer index that differs by member (alone a ``select``) beside another index:
    torch's indexing counts it as an advanced index, alone it is none."""
    if any(h is not None and not _is_long(h[0]) for h in held):
        return False
    scalar = [_scalar(h) for h in held]
    return any(scalar) and sum(h is not None for h in held) > sum(scalar)


def _scalar(h: tuple[Tensor, int | None] | None) -> bool:
    return h is not None and h[1] is not None and h[0].dim() == 1


def _is_long(t: Tensor) -> bool:
    return t.dtype in (torch.long, torch.int)


def _write(
    x: Tensor,
    held: list[tuple[Tensor, int | None] | None],
    v: Tensor,
    v_batched: bool,
    accumulate: bool,
) -> bool:
    """``x[member, *held] = v`` laid out as alone: ``x`` members first, ``v`` members first
    where ``v_batched``. False where ``v`` has more dims than the indexed block and the dims
    after it (torch's rule then raises its shape mismatch)."""
    n, shape = x.shape[0], x.shape[1:]
    explicit, block = _explicit(n, shape, held, x.device)
    if v_batched:  # right-aligned to the block and the dims after the last index
        if v.dim() - 1 > block:
            return False
        v = v.reshape(n, *[1] * (block - (v.dim() - 1)), *v.shape[1:])
    x.index_put_(explicit, v, accumulate)
    return True


def _explicit(
    n: int, shape: torch.Size, held: list[tuple[Tensor, int | None] | None], device: Any
) -> tuple[tuple[Tensor, ...], int]:
    """Indices for ``x[members, *held]`` (``x`` members first) laid out as alone, and how many
    dims the result has after the members: every dim up to the last index gets an explicit
    index tensor, all shaped to broadcast to ``[members, *block]``, ``block`` the indexed dims
    as alone. A 0-d index per member (``_scalar``) is alone a ``select``: it takes no dim and
    does not count among the advanced indices."""
    last = max(d for d, h in enumerate(held) if h is not None)
    kept = [d for d in range(last + 1) if not _scalar(held[d])]  # the dims alone indexes
    idx: dict[int, tuple[Tensor, bool]] = {}
    for d, h in enumerate(held):
        if h is not None:
            t, b = h
            idx[d] = (t, False) if b is None else (t.movedim(b, 0), True)
    at = [r for r, d in enumerate(kept) if d in idx]  # advanced, ranks among the kept dims
    own = [t.shape[1:] if b else t.shape for d, (t, b) in idx.items() if d in kept]
    joint = torch.broadcast_shapes(*own)  # the advanced indices' dims
    adjacent = at == list(range(at[0], at[-1] + 1)) if at else True
    # alone: the joint dims where the indices stood if adjacent (after the slices before
    # them), else first (then the slices in order)
    joint_at = at[0] if adjacent and at else 0
    sliced = [(r, d) for r, d in enumerate(kept) if d not in idx]
    slice_at = {
        d: (r if r < joint_at else r - len(at) + len(joint)) if adjacent else len(joint) + k
        for k, (r, d) in enumerate(sliced)
    }
    rank = len(joint) + len(sliced)

    def placed(t: Tensor, batched: bool, where: int) -> Tensor:
        inner = t.shape[1:] if batched else t.shape
        lead = n if batched else 1
        return t.reshape(lead, *[1] * where, *inner, *[1] * (rank - where - len(inner)))

    explicit = [torch.arange(n, device=device).view(n, *[1] * rank)]
    for d in range(last + 1):
        if d in idx:
            t, b = idx[d]
            inner = t.dim() - (1 if b else 0)
            explicit.append(placed(t, b, joint_at + len(joint) - inner))  # right-aligned
        else:
            explicit.append(placed(torch.arange(shape[d], device=device), False, slice_at[d]))
    return tuple(explicit), rank + len(shape) - last - 1
