"""Four of torch's batching rules that are wrong for some layout, each fixed for that layout.

* ``torch.select_scatter(h, src, dim, i)``: functorch's rule writes ``src`` with ``scatter``,
  its index expanded along the selected dim and ``src`` expanded to match. The forward is
  right; its backward, run by ``loss.backward()`` after the ensemble's eager forward or step,
  gives ``src`` the gradient once per position of the selected dim: ``size(dim)`` times
  alone's, silently in ``ens(x)`` + ``backward()`` (the first step's self-check refused it;
  ``vmap(grad(f))`` is right: its autograd runs above the rule). Here ``select_scatter`` runs
  itself one dim further in, whose backward is torch's own.
* ``x.index_fill(dim, idx, value)`` with ``x`` shared (the input every member sees) and
  ``value`` per member (a learned 0-d fill): the rule writes every member's value into one
  shared copy of ``x``, so every member gets the last member's, silently (the self-check runs
  one member, where it is right). Here ``x`` gets a row per member first.
  With ``idx`` per member and ``value`` shared and requiring grad (``h.mean()`` of a shared
  trunk's features), the rule fills with the value's number: it got no gradient, silently.
  Here ``value`` gets a copy per member (an expanded view: its gradients summed).
* ``h.squeeze_()`` (no dim) with one member in the call (``n=1``, a last chunk of one): the rule
  squeezes the member dim too, and ``ens(x)`` loses its member axis (a chunk of one beside
  others fails to stack). Here the member's own size-1 dims are squeezed by number.
* ``nn.PReLU`` (``_prelu_kernel``) on a shared input with a member's own weight: the rule
  resizes an output of the input's shape to the members' (a deprecated-resize UserWarning,
  an error under ``-W error``). Here the input gets a (broadcast) row per member.

Each rule acts while ``active()`` (the ensemble's calls), at the ensemble's own vmap level (a
vmap the user writes inside a forward keeps torch's rule, as alone); every other call runs
torch's own rule, kept with ``torch.library.get_kernel``.
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

__all__ = ["register_fixed_rules"]

_aten = torch.ops.aten


def register_fixed_rules(lib: torch.library.Library, active: Callable[[], bool]) -> None:
    """Register the four rules on ``lib`` (``aten``, ``IMPL``), over torch's own (a torch
    without ``torch.library.get_kernel`` keeps its own rules alone)."""
    for name, make in (
        ("select_scatter", _select_scatter),
        ("index_fill.int_Tensor", _index_fill),
        ("squeeze_", _squeeze_),
        ("_prelu_kernel", _prelu_kernel),
    ):
        override_keeping(lib, name, lambda torchs, make=make: make(torchs, active))


def _select_scatter(torchs: Any, active: Callable[[], bool]) -> Any:
    def rule(keyset: Any, self: Tensor, src: Tensor, dim: int, index: int) -> Tensor:
        if not active():
            return torchs.call_boxed(keyset, self, src, dim, index)
        level = current_level()
        x, xb = _unwrap_batched(self, level)
        s, sb = _unwrap_batched(src, level)
        if xb is None and sb is None:  # batched at an outer level only: the rule there
            with below_vmap():
                return _aten.select_scatter.default(x, s, dim, index)
        if not outermost(level):
            return torchs.call_boxed(keyset, self, src, dim, index)
        n = current_vmap().batch_size()
        with below_vmap():
            x, s = members_first(x, xb, n), members_first(s, sb, n)
            d = dim + x.dim() - 1 if dim < 0 else dim  # the member's own dim
            out = _aten.select_scatter.default(x, s, d + 1, index)
        return _add_batch_dim(out, 0, level)

    return rule


def _index_fill(torchs: Any, active: Callable[[], bool]) -> Any:
    def rule(keyset: Any, self: Tensor, dim: int, index: Tensor, value: Tensor) -> Tensor:
        if active():
            level = current_level()
            x, xb = _unwrap_batched(self, level)
            v, vb = _unwrap_batched(value, level)
            ib = _unwrap_batched(index, level)[1]
            if vb is None and ib is not None and v.requires_grad and outermost(level):
                n = current_vmap().batch_size()
                with below_vmap():  # a shared value that trains: one per member, grads summed
                    value, vb = _add_batch_dim(v.expand(n, *v.shape), 0, level), 0
            if xb is None and vb is not None and outermost(level):
                n = current_vmap().batch_size()
                with below_vmap():  # one row per member, each its own memory
                    x = x.expand(n, *x.shape).clone()
                self = _add_batch_dim(x, 0, level)
        return torchs.call_boxed(keyset, self, dim, index, value)

    return rule


def _prelu_kernel(torchs: Any, active: Callable[[], bool]) -> Any:
    def rule(keyset: Any, self: Tensor, weight: Tensor) -> Tensor:
        if active():
            level = current_level()
            x, xb = _unwrap_batched(self, level)
            if xb is None and _unwrap_batched(weight, level)[1] is not None and outermost(level):
                n = current_vmap().batch_size()
                with below_vmap():  # torch's rule resizes x's out to the members' (deprecated)
                    self = _add_batch_dim(x.expand(n, *x.shape), 0, level)
        return torchs.call_boxed(keyset, self, weight)

    return rule


def _squeeze_(torchs: Any, active: Callable[[], bool]) -> Any:
    def rule(keyset: Any, self: Tensor) -> Tensor:
        if active():
            level = current_level()
            if _unwrap_batched(self, level)[1] is not None and outermost(level):
                dims = [d for d, size in enumerate(self.shape) if size == 1]  # the member's
                return self.squeeze_(dims) if dims else self
        return torchs.call_boxed(keyset, self)

    return rule
