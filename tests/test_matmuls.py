"""The compiled step's rewrite of member matmuls on a shared operand (vmapens/_matmuls.py).

Truth: ``torch.bmm`` itself on the same tensors. That the compiled step runs the rewrite and
still trains members as alone: tests/test_step.py::test_compiled_step_trains_like_separate_models.
"""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from vmapens import _matmuls

# mm and bmm may sum a dot product's terms in another order: float64 round-off only.
TOL = dict(rtol=1e-12, atol=1e-14)
N, M, K, W = 6, 5, 3, 7


def _shared_first(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.bmm(x.expand(N, M, K), w)


def _shared_second(a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.bmm(a, v.expand(N, K, W))


def _per_member(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.bmm(a, w)


CASES = {
    "first-shared": (_shared_first, ((M, K), (N, K, W)), 1),
    "second-shared": (_shared_second, ((N, M, K), (K, W)), 1),
    "second-shared-transposed-first": (
        lambda a, v: torch.bmm(a.transpose(1, 2), v.expand(N, K, W)),
        ((N, K, M), (K, W)),
        1,
    ),
    "none-shared": (_per_member, ((N, M, K), (N, K, W)), 0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rewritten_graph_equals_bmm_and_keeps_no_shared_bmm(case):
    fn, shapes, expected = CASES[case]
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    gm = make_fx(fn, tracing_mode="fake")(*args)
    assert _matmuls.rewrite_shared_operands(gm.graph) == expected
    gm.recompile()
    bmms = [n for n in gm.graph.nodes if n.target is torch.ops.aten.bmm.default]
    assert len(bmms) == 1 - expected
    torch.testing.assert_close(gm(*args), torch.bmm(*_expanded(fn, args)), **TOL)


def _expanded(fn, args):
    """The operands as fn hands them to bmm, written out again."""
    if fn is _shared_first:
        return args[0].expand(N, M, K), args[1]
    if fn is _shared_second:
        return args[0], args[1].expand(N, K, W)
    if fn is _per_member:
        return args
    return args[0].transpose(1, 2), args[1].expand(N, K, W)


@pytest.mark.parametrize(
    "dtype,n,m,w",
    [
        (torch.float16, N, M, W),
        (torch.bfloat16, N, M, W),
        (torch.float64, 1, M, W),
        (torch.float64, N, 16, 64),  # 3072 multiply-adds per member: bmm is as fast
        (torch.float64, N, M, 1),  # a matrix-vector product: inductor's own reduction
    ],
    ids=["float16", "bfloat16", "one-member", "large-products", "vector"],
)
def test_other_dtypes_single_members_large_and_vector_products_keep_their_bmm(dtype, n, m, w):
    def fn(x, v):
        return torch.bmm(x.expand(n, m, K), v)

    args = (torch.randn(m, K, dtype=dtype), torch.randn(n, K, w, dtype=dtype))
    gm = make_fx(fn, tracing_mode="fake")(*args)
    assert _matmuls.rewrite_shared_operands(gm.graph) == 0


# The weight gradient of a layer on few shared input features: g[i]^T @ x, x of W <= 8 columns.
NARROW = {
    "narrow": ((N, 20, 40), (40, 4), 1),  # 3200 multiply-adds per member: too many to merge
    "narrow-transposed-first": ((N, 40, 20), (40, 4), 1),
    "eight-columns": ((N, 16, 32), (32, 8), 1),
    "wider": ((N, 40, 40), (40, 12), 0),  # only the column count keeps its bmm
    "square": ((N, 8, 64), (64, 8), 0),  # m < 2 w: bmm is as fast
    "short": ((N, 120, 20), (20, 4), 0),  # k < 32
}


@pytest.mark.parametrize("case", list(NARROW))
def test_narrow_shared_products_run_transposed_and_equal_bmm(case):
    a_shape, v_shape, expected = NARROW[case]
    transposed = case.endswith("transposed-first")

    def fn(a, v):
        return torch.bmm(a.transpose(1, 2) if transposed else a, v.expand(N, *v_shape))

    g = torch.Generator().manual_seed(0)
    args = [torch.randn(s, generator=g, dtype=torch.float64) for s in (a_shape, v_shape)]
    gm = make_fx(fn, tracing_mode="fake")(*args)
    assert _matmuls.rewrite_shared_operands(gm.graph) == expected
    gm.recompile()
    (bmm,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.bmm.default]
    m, w = (a_shape[2] if transposed else a_shape[1]), v_shape[1]
    # Rewritten: the product runs as [n, w, m] (x^T @ g[i]^T); kept: as [n, m, w].
    assert tuple(bmm.meta["val"].shape) == ((N, w, m) if expected else (N, m, w))
    out = gm(*args)
    want = fn(*args)
    assert out.is_contiguous()
    torch.testing.assert_close(out, want, **TOL)


@pytest.mark.parametrize("w,transposed", [(2, True), (8, True), (9, False)])
def test_merged_products_of_few_columns_run_transposed_and_equal_bmm(w, transposed):
    """Small products on a shared second operand (workload A's weight gradient: g[i]^T @ x,
    x with 2 features) merge into one mm; with <= 8 columns it runs as x^T @ [g^T ...]."""
    n, m, k = 6, 20, 5

    def fn(a, v):
        return torch.bmm(a, v.expand(n, k, w))

    g = torch.Generator().manual_seed(0)
    args = [torch.randn(s, generator=g, dtype=torch.float64) for s in ((n, m, k), (k, w))]
    gm = make_fx(fn, tracing_mode="fake")(*args)
    assert _matmuls.rewrite_shared_operands(gm.graph) == 1
    gm.recompile()
    (mm,) = [node for node in gm.graph.nodes if node.target is torch.ops.aten.mm.default]
    assert tuple(mm.meta["val"].shape) == ((w, n * m) if transposed else (n * m, w))
    # Row-major columns: MKL ran the column-major view of the rows 34x slower (_matmuls).
    assert mm.args[1].meta["val"].is_contiguous()
    if transposed:  # turned back into rows in a buffer of its own, which inductor realizes
        (realized,) = [
            node for node in gm.graph.nodes if node.target is torch.ops.aten.as_strided.default
        ]
        assert realized.args[0].args[0].args[0] is mm  # as_strided(clone(permute(mm)))
    out = gm(*args)
    assert out.is_contiguous() and out.shape == (n, m, w)
    torch.testing.assert_close(out, fn(*args), **TOL)
