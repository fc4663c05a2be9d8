"""``torch.select_scatter`` under vmap: gradients as alone.

functorch's rule for ``aten::select_scatter`` writes ``src`` with ``scatter``, its index
expanded along the selected dim (every position points at ``index``) and ``src`` expanded to
match. The forward is right; its backward, run by ``loss.backward()`` after the ensemble's
eager forward or step, gives ``src`` the gradient once per position of the selected dim
(``scatter``'s backward gathers it for every expanded copy, and the expand sums them):
``size(dim)`` times alone's, silently in ``ens(x)`` + ``backward()`` (the first step's
self-check refuses it; ``vmap(grad(f))`` is right: its autograd runs above the rule).

While ``active()`` (the ensemble's calls), at the outermost vmap level (the ensemble's: a
``torch.func.vmap`` of the user's own inside a forward keeps torch's rule there, as alone), the
rule moves the member dim to the front of both (expanding an unbatched one) and calls
``select_scatter`` itself one dim further in, whose backward is torch's own; elsewhere torch's
rule runs (kept with ``torch.library.get_kernel``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch._C._functorch import _add_batch_dim, _unwrap_batched

from ._vmap_rules import below_vmap, current_vmap, outermost, override

__all__ = ["register_scatter_rules"]


def register_scatter_rules(lib: torch.library.Library, active: Callable[[], bool]) -> None:
    """Register the ``select_scatter`` rule on ``lib`` (``aten``, ``IMPL``), over torch's own
    (a torch without ``torch.library.get_kernel`` keeps its own rule alone)."""
    if not hasattr(torch.library, "get_kernel"):
        return
    torchs = torch.library.get_kernel("aten::select_scatter", "FuncTorchBatched")

    def rule(keyset: Any, self: Tensor, src: Tensor, dim: int, index: int) -> Tensor:
        if not active():
            return torchs.call_boxed(keyset, self, src, dim, index)
        vmap = current_vmap()
        level, n = vmap.level(), vmap.batch_size()
        x, xb = _unwrap_batched(self, level)
        s, sb = _unwrap_batched(src, level)
        if xb is None and sb is None:  # batched at an outer level only: the rule there
            with below_vmap():
                return torch.ops.aten.select_scatter.default(x, s, dim, index)
        if not outermost(level):  # the user's own vmap: torch's rule, as alone
            return torchs.call_boxed(keyset, self, src, dim, index)
        with below_vmap():
            x = x.expand(n, *x.shape) if xb is None else x.movedim(xb, 0)
            s = s.expand(n, *s.shape) if sb is None else s.movedim(sb, 0)
            d = dim + x.dim() - 1 if dim < 0 else dim  # the member's own dim
            out = torch.ops.aten.select_scatter.default(x, s, d + 1, index)
        return _add_batch_dim(out, 0, level)

    override(lib, "select_scatter", rule)
