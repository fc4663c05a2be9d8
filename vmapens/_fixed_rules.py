"""Five of torch's batching rules that are wrong for some layout, each fixed for that layout.

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

* ``F.linear_cross_entropy(h, w, y, options=...)`` (its chunked path, reduced): the op takes
  ``h.requires_grad`` and ``w.requires_grad`` as flags, to compute their gradients in the
  forward; a member's tensors are batched, report ``False``, and got no gradient, silently in
  ``ens(x)`` + ``backward()`` (the first step refused it). Here the flags are read from the
  tensors under the batching, as alone; torch's rule then runs the op once per member.
  (``nn.LinearCrossEntropyLoss`` runs its reference path in the ensemble, ``unchunked``.)

Each rule acts while ``active()`` (the ensemble's calls), at the ensemble's own vmap level (a
vmap the user writes inside a forward keeps torch's rule, as alone); every other call runs
torch's own rule, kept with ``torch.library.get_kernel``.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch._C._functorch import (
    _add_batch_dim,
    _unwrap_batched,
    get_unwrapped,
    is_batchedtensor,
    maybe_get_level,
)

from ._vmap_rules import (
    below_vmap,
    current_level,
    current_vmap,
    members_first,
    members_level,
    outermost,
    override_keeping,
)

__all__ = ["register_fixed_rules"]

_aten = torch.ops.aten
#: The library that holds the rule over torch's ``torch_nn`` op (``F.linear_cross_entropy``).
_torch_nn: torch.library.Library | None = None


def register_fixed_rules(lib: torch.library.Library, active: Callable[[], bool]) -> None:
    """Register the rules on ``lib`` (``aten``, ``IMPL``), the last on a ``torch_nn`` library
    of this file's, over torch's own (a torch without ``torch.library.get_kernel`` keeps its
    own rules alone)."""
    for name, make in (
        ("select_scatter", _select_scatter),
        ("index_fill.int_Tensor", _index_fill),
        ("squeeze_", _squeeze_),
        ("_prelu_kernel", _prelu_kernel),
    ):
        override_keeping(lib, name, lambda torchs, make=make: make(torchs, active))
    _register_linear_cross_entropy(active)


def _register_linear_cross_entropy(active: Callable[[], bool]) -> None:
    global _torch_nn
    name = "_linear_cross_entropy_batch_chunked"
    try:  # torch registers its op at the first F.linear_cross_entropy call; now (16 ms, once)
        importlib.import_module("torch.nn.modules.linear_cross_entropy")
    except ImportError:  # a torch without it
        return
    if _torch_nn is None and hasattr(torch.ops.torch_nn, name):
        _torch_nn = torch.library.Library("torch_nn", "IMPL")  # kept: its rules live with it
        override_keeping(_torch_nn, name, lambda torchs: _linear_cross_entropy(torchs, active))


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


def _linear_cross_entropy(torchs: Any, active: Callable[[], bool]) -> Any:
    # torch's op: (input, linear_weight, target, linear_bias, weight, reduction, ignore_index,
    # label_smoothing, chunk size, acc policy, acc dtype, allow_retain_graph, then the flags:
    # compute input's, linear_weight's and linear_bias's gradients in the forward)
    flags = ((12, 0), (13, 1), (14, 3))
    # Set while torch's rule runs: the calls it makes at the vmap levels below keep the flags
    # the first level read (a vmap of the user's in the forward runs torch's rule, as alone).
    inside = threading.local()

    def rule(keyset: Any, *args: Any) -> Any:
        if not active() or not torch.is_grad_enabled() or getattr(inside, "busy", False):
            return torchs.call_boxed(keyset, *args)
        ours = members_level()
        given = list(args)
        for flag, i in flags:
            given[flag] = given[flag] or _requires_grad_alone(given[i], ours)
        inside.busy = True
        try:
            return torchs.call_boxed(keyset, *given)
        finally:
            inside.busy = False

    return rule


def _requires_grad_alone(t: Any, ours: int) -> bool:
    """``t.requires_grad`` as the member alone reads it: batched at the ensemble's level only
    (``ours``), its member's tensor's; batched at a vmap of the user's, ``False`` (as alone)."""
    if not isinstance(t, Tensor):
        return False
    while is_batchedtensor(t):
        if maybe_get_level(t) != ours:
            return False
        t = get_unwrapped(t)
    return bool(t.requires_grad)
