"""Workload B: 128 heads, averaged output; one benchmark group per loss variant."""

from __future__ import annotations

import pytest

from bench import HEADS, WORKLOAD_B


@pytest.mark.parametrize("impl", list(WORKLOAD_B["mean"]))
@pytest.mark.parametrize("loss", list(WORKLOAD_B))
def test_workload_b(benchmark, bench_step, loss: str, impl: str) -> None:
    benchmark.group = f"B {HEADS} heads loss={loss}"
    bench_step(impl, WORKLOAD_B[loss][impl], HEADS)
