"""Real models (CNN, Transformer, GRU, LSTM) at N = 16; each workload is one benchmark group.

Rows whose step cannot be built (a module the bare recipe cannot vmap) are skipped with the
reason; compiled rows compile during the untimed warm-up.
"""

from __future__ import annotations

import pytest

from bench import REAL_N, WORKLOAD_REAL

CASES = [
    pytest.param(workload, impl, id=f"{workload}-{impl}")
    for workload, rows in WORKLOAD_REAL.items()
    for impl in rows
]


@pytest.mark.parametrize(("workload", "impl"), CASES)
def test_real(benchmark, bench_step, workload: str, impl: str) -> None:
    benchmark.group = f"{workload} N={REAL_N}"
    try:
        bench_step(impl, WORKLOAD_REAL[workload][impl], REAL_N)
    except NotImplementedError as err:  # raised while building, before anything is timed
        pytest.skip(f"{impl}: {err}")
