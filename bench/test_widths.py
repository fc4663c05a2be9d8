"""Width sweep: 4 widths x 8 seeds of workload A's MLP, the naive loop, one ensemble per
width and one padded ensemble (eager, compiled) in one benchmark group."""

from __future__ import annotations

import pytest

from bench.widths import ROWS, SEEDS, WIDTHS


@pytest.mark.parametrize("impl", list(ROWS))
def test_widths(benchmark, bench_step, impl: str) -> None:
    benchmark.group = f"widths {WIDTHS} x {SEEDS} seeds"
    bench_step(impl, lambda n, device: ROWS[impl](WIDTHS, n, device).step, SEEDS)
