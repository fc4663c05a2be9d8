"""A write phase's shortcuts give torch's bits: ``cpu_scalar`` (a shared float as a 0-d tensor)
and ``joined_empty`` (scratch tensors as views of one flat buffer, an op on it once for all).

The write phases pass shared hyperparameters and keep their scratch this way
(``optim/_columns.py``, ``optim/_fused.py``); the truth is the same op given the Python float,
on each tensor alone, as torch's single-tensor optimizers call it.
"""

from __future__ import annotations

import math

import pytest
import torch

from vmapens.optim._columns import cpu_scalar
from vmapens.optim._fused import joined_empty

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
# Workload A's stacked MLP at n = 256, sizes that are no multiple of a vector width, one element
SHAPES = [(256, 20, 2), (256, 20), (256, 1, 20), (256, 1), (37, 5), (3,), (1,)]
VALUES = [0.1, 1e-8, 0.999, 1 / 3, -0.0, 0.0, 7.123456789e5, -2.5, math.inf, math.nan]
OPS = ["_foreach_mul_", "_foreach_add_", "_foreach_div_", "_foreach_sub_"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_foreach_op_gives_the_floats_bits(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    # sizes that are no multiple of a vector width, and a 0-d-like single element
    xs = [torch.randn(shape, generator=g).to(dtype) for shape in [(37, 5), (3,), (1,)]]
    for value in VALUES:
        for op in OPS:
            want, got = [x.clone() for x in xs], [x.clone() for x in xs]
            getattr(torch, op)(want, value)
            getattr(torch, op)(got, cpu_scalar(value, got[0]))
            for a, b in zip(got, want, strict=True):
                assert a.dtype == b.dtype, (op, value)
                assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), (
                    op,
                    value,
                )
        want, got = torch.empty_like(xs[0]), torch.empty_like(xs[0])
        torch.div(xs[0], value, out=want)
        torch.div(xs[0], cpu_scalar(value, xs[0]), out=got)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), value


def test_signed_zeros_are_kept_apart() -> None:
    x = torch.ones(3)
    assert math.copysign(1.0, float(cpu_scalar(0.0, x))) == 1.0
    assert math.copysign(1.0, float(cpu_scalar(-0.0, x))) == -1.0
    assert math.copysign(1.0, float(cpu_scalar(0.0, x))) == 1.0


def test_what_is_not_a_float_cpu_scalar_passes_as_it_is() -> None:
    column = [torch.ones(2, 1)]
    assert cpu_scalar(column, torch.ones(2)) is column
    t = torch.tensor([0.5, 0.25], dtype=torch.float64)
    assert cpu_scalar(t, torch.ones(2)) is t
    assert cpu_scalar(0.5, torch.ones(2, dtype=torch.bfloat16)) == 0.5
    assert isinstance(cpu_scalar(0.5, torch.ones(2, device="meta")), float)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_ops_on_the_joined_buffer_give_each_tensors_bits(dtype: torch.dtype) -> None:
    # RAdam's update as torch's single-tensor step makes it, tensor by tensor, against the
    # same ops made once on the flat buffers that the views share.
    g = torch.Generator().manual_seed(0)
    ms = [torch.randn(shape, generator=g, dtype=dtype) for shape in SHAPES]
    vs = [torch.rand(shape, generator=g, dtype=dtype) * 1e-6 for shape in SHAPES]
    vs[-1].zero_()  # 1 / eps
    lr, bc1, bc2, eps, rect = 1e-3, 1 - 0.9**7, 1 - 0.999**7, 1e-8, 0.3
    want = [m / bc1 * lr * (bc2**0.5 / (torch.sqrt(v) + eps)) * rect for m, v in zip(ms, vs)]
    update, updates = joined_empty(ms)
    adaptive, adaptives = joined_empty(vs)
    for m, v, u, a in zip(ms, vs, updates, adaptives, strict=True):
        torch.div(m, bc1, out=u)
        torch.sqrt(v, out=a)
    update.mul_(lr)
    adaptive.add_(eps).reciprocal_().mul_(bc2**0.5)
    update.mul_(adaptive).mul_(rect)
    for u, w in zip(updates, want, strict=True):
        assert torch.equal(_bits(u), _bits(w))


def test_the_joined_views_tile_the_buffer_in_order() -> None:
    like = [torch.zeros(4, 3), torch.zeros(2, 1, 5), torch.zeros(6, 2).t(), torch.zeros(1)]
    flat, views = joined_empty(like)
    assert flat.shape == (sum(t.numel() for t in like),) and flat.dtype == like[0].dtype
    flat.copy_(torch.arange(flat.numel(), dtype=flat.dtype))
    start = 0
    for t, view in zip(like, views, strict=True):
        assert view.shape == t.shape and view.is_contiguous()  # also for the transposed one
        want = torch.arange(start, start + t.numel(), dtype=flat.dtype).view(t.shape)
        assert torch.equal(view, want)
        start += t.numel()
