"""``cpu_scalar``: a shared float as a 0-d tensor gives a foreach op torch's bits with the float.

The write phases pass shared hyperparameters this way (``optim/_columns.py``); the truth is the
same op given the Python float, as torch's single-tensor optimizers call it.
"""

from __future__ import annotations

import math

import pytest
import torch

from vmapens.optim._columns import cpu_scalar

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
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
