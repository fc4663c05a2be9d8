"""Workload A: N tiny MLPs; every implementation of one N shares a benchmark group."""

from __future__ import annotations

import pytest

from bench import WORKLOAD_A


@pytest.mark.parametrize("n", [15, 256])
@pytest.mark.parametrize("impl", list(WORKLOAD_A))
def test_workload_a(benchmark, bench_step, impl: str, n: int) -> None:
    benchmark.group = f"A N={n}"
    bench_step(impl, WORKLOAD_A[impl], n)
