"""The compiled step's graph rewrites: a member matmul on a shared operand is one matmul.

Under ``vmap``, ``x @ W[i].T`` with the same ``x`` for every member (an ``in_dims=None``
input, the usual first layer) becomes ``bmm(x.expand(n, ...), W)``: n small matrix products,
which CPU BLAS runs one by one (290 us for workload A's 1024 members of ``Linear(2, 20)``).
The same products are one matrix multiply, ``x @ [W[0].T | W[1].T | ...]``, which is what a
hand-merged ensemble (``Linear(2, n * 20)``) runs. :func:`shared_operand_pass` is an inductor
post-grad pass that rewrites every ``bmm`` whose first or second operand has batch stride 0
(the same matrix for every member) that way, in the forward and in the gradient alike, where
the per-member products are small (see ``_SMALL``: for larger ones bmm is as fast).

The weight gradient of such a layer when its input has few features (``x`` with ``w`` <=
``_NARROW`` columns) runs transposed: ``g[i]^T @ x`` has an output ``w`` columns wide, which
CPU BLAS runs 2-7x slower than the transposed product ``(x^T @ g[i])^T``, which it becomes,
merged into one ``mm`` as above for small products and as a transposed ``bmm`` for larger ones.

Only the order of additions inside each dot product can change (the BLAS kernel differs), as
inductor's own fusions already change it: see docs/semantics.md, "compiled vs eager step".
It applies on CPU to float32 and float64 (the dtypes whose compiled steps are tested against
members alone) with static sizes (``make_step`` compiles with ``dynamic=False``); other graphs
keep their ``bmm``.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

__all__ = ["rewrite_shared_operands", "shared_operand_pass"]

_aten = torch.ops.aten
_DTYPES = (torch.float32, torch.float64)
# Per-member products up to this many multiply-adds (m * k * w) are rewritten. Measured on
# one thread (compiled, bmm vs the rewrite): 200 (workload A) 0.15-0.20x, 512-1280 0.58-0.75x,
# 4096-8192 0.82-1.27x (the layout copies around the mm cost more than bmm's per-member
# overhead saves), workload B's 131072 1.10x. Products with m or w = 1 are left to inductor,
# which already turns them into reductions (up to 6x faster than the rewrite).
_SMALL = 2048
# A larger product with a shared second operand of at most this many columns runs transposed.
# Measured (one and two threads, bmm vs the transposed bmm, n = 4-1024): 2-8 columns with
# m >= 2 * w rows and k >= 32: 0.13-0.59x; w = 12-16: 0.47-0.89x; m = w = 8: 1.07-1.61x.
_NARROW = 8


@functools.cache
def shared_operand_pass() -> Any:
    """The pass ``make_step`` hands to ``torch.compile`` (inductor's ``post_grad_custom_pre_pass``).

    A ``CustomGraphPass``, built on first use: importing ``torch._inductor`` imports
    ``torch._dynamo`` (seconds), which an eager run never needs.
    """
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    class SharedOperand(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            rewrite_shared_operands(graph)

        def uuid(self) -> Any:
            # Part of the compile caches' keys (AOTAutograd's and inductor's): a change to this
            # file, or to _compiling.py, which compiles some graphs unvectorized (a choice the
            # keys do not see otherwise), compiles anew.
            here = os.path.dirname(__file__)
            return get_hash_for_files((__file__, os.path.join(here, "_compiling.py")))

    return SharedOperand()


def rewrite_shared_operands(graph: torch.fx.Graph) -> int:
    """Rewrite, in place, every ``aten.bmm`` of ``graph`` that has a shared operand.

    Args:
        graph: An aten-level FX graph whose nodes carry fake values (``meta["val"]``).

    Returns:
        How many ``bmm`` were rewritten.
    """
    done = 0
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is _aten.bmm.default:
            done += _rewrite(graph, node)
    return done


def _rewrite(graph: torch.fx.Graph, node: torch.fx.Node) -> int:
    a, b = node.args
    if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)):
        return 0
    va, vb = a.meta.get("val"), b.meta.get("val")
    if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)):
        return 0
    if va.device.type != "cpu" or va.dtype not in _DTYPES or vb.dtype != va.dtype:
        return 0
    # Symbolic sizes (a graph compiled with dynamic shapes) would enter the new nodes' args as
    # raw SymInts, which the graph cannot run: such a bmm is left as it is.
    if not all(type(d) is int for d in (*va.shape, *vb.shape, *va.stride(), *vb.stride())):
        return 0
    (n, m, k), w = va.shape, vb.shape[2]
    if n < 2 or not (va.stride(0) == 0 or vb.stride(0) == 0) or min(m, w) < 2:
        return 0
    if m * k * w <= _SMALL:
        out = _one_matmul(graph, node, a, b, va, vb)
    elif vb.stride(0) == 0 and w <= _NARROW and m >= 2 * w and k >= 32:
        out = _transposed(graph, node, a, b)
    else:
        return 0
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    return 1


def _transposed(
    graph: torch.fx.Graph, node: torch.fx.Node, a: torch.fx.Node, b: torch.fx.Node
) -> torch.fx.Node:
    """``node``'s ``a[i] @ b[0]``, a few columns wide, as ``(b[0]^T @ a[i]^T)^T``."""
    with graph.inserting_before(node):
        flipped = _op(
            graph,
            _aten.bmm.default,
            _op(graph, _aten.permute.default, b, [0, 2, 1]),
            _op(graph, _aten.permute.default, a, [0, 2, 1]),
        )
        return _contiguous(graph, _op(graph, _aten.permute.default, flipped, [0, 2, 1]))


def _one_matmul(
    graph: torch.fx.Graph,
    node: torch.fx.Node,
    a: torch.fx.Node,
    b: torch.fx.Node,
    va: torch.Tensor,
    vb: torch.Tensor,
) -> torch.fx.Node:
    """The members' products on a shared operand as one ``mm``, shaped like ``node``'s."""
    (n, m, k), w = va.shape, vb.shape[2]
    with graph.inserting_before(node):
        if va.stride(0) == 0:
            # out[i] = a[0] @ b[i]: a[0] @ [b[0] | b[1] | ...], then back to [n, m, w].
            columns = _contiguous(graph, _op(graph, _aten.permute.default, b, [1, 0, 2]))
            product = _op(
                graph,
                _aten.mm.default,
                _op(graph, _aten.select.int, a, 0, 0),
                _op(graph, _aten.view.default, columns, [k, n * w]),
            )
            split = _op(graph, _aten.view.default, product, [m, n, w])
            out = _contiguous(graph, _op(graph, _aten.permute.default, split, [1, 0, 2]))
        else:
            # out[i] = a[i] @ b[0]: the rows of every a[i] stacked, times b[0].
            shared = _op(graph, _aten.select.int, b, 0, 0)
            if w <= _NARROW:
                # A few columns (a weight gradient on few input features): transposed, as in
                # _transposed, b[0]^T @ [a[0]^T | a[1]^T | ...]. Compiled step, bmm rewritten
                # as this vs as rows @ b[0], one process: 0.89-0.95x at n = 1024, 0.95-0.98x
                # at 256, 1.0x at 15. The columns are copied row-major ([k, n * m]): MKL on an
                # AVX-512 Xeon ran the column-major [k, n * m] view of the stacked rows 34x
                # slower (320 vs 9.4 us for workload A's [2, 5] @ [5, 20480]).
                t = _aten.permute.default
                columns = _contiguous(graph, _op(graph, t, a, [2, 0, 1]))
                product = _op(graph, _aten.mm.default, _op(graph, t, shared, [1, 0]),
                              _op(graph, _aten.view.default, columns, [k, n * m]))  # fmt: skip
                # [w, n * m] back to rows, as a buffer of its own: inlined into its consumers
                # (the optimizer's loops), the transposition became a gather of w elements
                # into each mostly masked 16-wide vector; realized, inductor writes it as one
                # tiled transpose and the consumers read rows. Workload A's compiled step,
                # one thread: 1.10 -> 0.88 ms at n = 1024, 0.45 -> 0.39 at 256.
                rows = _realized(graph, _contiguous(graph, _op(graph, t, product, [1, 0])))
                out = _op(graph, _aten.view.default, rows, [n, m, w])
            else:
                rows = _op(graph, _aten.view.default, _contiguous(graph, a), [n * m, k])
                product = _op(graph, _aten.mm.default, rows, shared)
                out = _op(graph, _aten.view.default, product, [n, m, w])
    return out


def _op(graph: torch.fx.Graph, target: Any, *args: Any, **kwargs: Any) -> torch.fx.Node:
    """A new node computing ``target(*args, **kwargs)``, with its fake value as later passes
    expect."""
    node = graph.call_function(target, args, kwargs)
    vals = (a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args)
    node.meta["val"] = target(*vals, **kwargs)
    return node


def _contiguous(graph: torch.fx.Graph, x: torch.fx.Node) -> torch.fx.Node:
    return _op(graph, _aten.clone.default, x, memory_format=torch.contiguous_format)


def _realized(graph: torch.fx.Graph, x: torch.fx.Node) -> torch.fx.Node:
    """``x`` as a view that inductor computes into a buffer of its own, not into each consumer
    (its lowering of ``as_strided`` realizes its input, as ``optim/_columns._column`` uses)."""
    val = x.meta["val"]
    return _op(graph, _aten.as_strided.default, x, list(val.shape), list(val.stride()))
