"""Optimizer step alone on workload A's stacked parameters; every implementation of one N
shares a benchmark group."""

from __future__ import annotations

import pytest

from bench import OPTIM_SIZES, WORKLOAD_OPTIM


@pytest.mark.parametrize("n", OPTIM_SIZES)
@pytest.mark.parametrize("impl", list(WORKLOAD_OPTIM))
def test_optim_step(benchmark, bench_step, impl: str, n: int) -> None:
    benchmark.group = f"optim step N={n}"
    bench_step(impl, WORKLOAD_OPTIM[impl], n)
