"""``t[..., idx, ...] = v`` (``Tensor.index_put_``) on a per-member ``t`` under vmap: as alone.

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

While ``active()`` (the ensemble's calls) this rule writes those two forms with every dim up to
the last advanced index indexed explicitly (the member ``arange``, the index tensors, an
``arange`` for each slice between), each shaped so that the indexed block is laid out as alone,
members first; the value is broadcast to it as alone. Every other call (and every call outside
the ensemble's calls) runs torch's own rule, kept with ``torch.library.get_kernel``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch._C._functorch import _unwrap_batched

from ._vmap_rules import below_vmap, current_vmap, override

__all__ = ["register_index_put_rule"]


def register_index_put_rule(lib: torch.library.Library, active: Callable[[], bool]) -> None:
    """Register the rule on ``lib`` (``aten``, ``IMPL``), over torch's own (kept with
    ``torch.library.get_kernel``; a torch without it keeps its own rule alone)."""
    if not hasattr(torch.library, "get_kernel"):
        return
    torchs = torch.library.get_kernel("aten::index_put_", "FuncTorchBatched")

    def rule(keyset: Any, self: Tensor, indices: list[Tensor | None], values: Tensor,
             accumulate: bool = False) -> Tensor:  # fmt: skip
        if active():
            level = current_vmap().level()
            x, xb = _unwrap_batched(self, level)
            held = [None if t is None else _unwrap_batched(t, level) for t in indices]
            if xb is not None and _torch_misplaces(held):
                v, vb = _unwrap_batched(values, level)
                with below_vmap():
                    done = _write(x.movedim(xb, 0), held, v if vb is None else v.movedim(vb, 0),
                                  vb is not None, accumulate)  # fmt: skip
                if done:
                    return self
        return torchs.call_boxed(keyset, self, indices, values, accumulate)

    override(lib, "index_put_", rule)


def _torch_misplaces(held: list[tuple[Tensor, int | None] | None]) -> bool:
    """Whether torch's rule lays the indexed dims out otherwise than alone (the docstring's
    two forms). Boolean masks are left to torch (their dims are counted otherwise)."""
    at = [d for d, h in enumerate(held) if h is not None]
    if not at or any(h is not None and not _is_long(h[0]) for h in held):
        return False
    adjacent = at == list(range(at[0], at[-1] + 1))
    return not adjacent or (at[0] > 0 and any(h is not None and h[1] is not None for h in held))


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
    where ``v_batched``; every dim up to the last index gets an explicit index tensor, all
    shaped to broadcast to ``[members, *block]``, ``block`` the indexed dims as alone. False
    where ``v`` has more dims than that (torch's rule then raises its shape mismatch)."""
    n, shape = x.shape[0], x.shape[1:]
    at = [d for d, h in enumerate(held) if h is not None]
    idx: dict[int, tuple[Tensor, bool]] = {}
    for d in at:
        t, b = held[d]  # type: ignore[misc]
        idx[d] = (t, False) if b is None else (t.movedim(b, 0), True)
    own = [t.shape[1:] if b else t.shape for t, b in idx.values()]
    joint = torch.broadcast_shapes(*own)  # the advanced indices' dims
    last, sliced = at[-1], [d for d in range(at[-1]) if d not in idx]
    adjacent = at == list(range(at[0], last + 1))
    # alone: the joint dims where the indices stood if adjacent (after the slices before
    # them), else first (then the slices in order)
    joint_at = at[0] if adjacent else 0
    slice_at = {d: (d if adjacent else len(joint) + k) for k, d in enumerate(sliced)}
    rank = len(joint) + len(sliced)

    def placed(t: Tensor, batched: bool, where: int) -> Tensor:
        inner = t.shape[1:] if batched else t.shape
        lead = n if batched else 1
        return t.reshape(lead, *[1] * where, *inner, *[1] * (rank - where - len(inner)))

    explicit = [torch.arange(n, device=x.device).view(n, *[1] * rank)]
    for d in range(last + 1):
        if d in idx:
            t, b = idx[d]
            inner = t.dim() - (1 if b else 0)
            explicit.append(placed(t, b, joint_at + len(joint) - inner))  # right-aligned
        else:
            explicit.append(placed(torch.arange(shape[d], device=x.device), False, slice_at[d]))
    if v_batched:  # right-aligned to the block and the dims after the last index
        block = rank + len(shape) - last - 1
        if v.dim() - 1 > block:
            return False
        v = v.reshape(n, *[1] * (block - (v.dim() - 1)), *v.shape[1:])
    x.index_put_(tuple(explicit), v, accumulate)
    return True
