"""Benchmarks shared by ``python -m bench`` and the pytest-benchmark suite in ``bench/``.

* :mod:`~bench.workloads`: workloads A (tiny MLPs) and B (heads), the optimizer step.
* :mod:`~bench.real`: a CNN, a Transformer encoder, a GRU and an LSTM.
* :mod:`~bench.compile_time`: time to result and to the first compiled step.
* :mod:`~bench.memory`: peak memory of building an Ensemble.
* :mod:`~bench.run` and :mod:`~bench.tables`: ``run`` and ``format_table``.
* :mod:`~bench._tools`: timing, grids, RSS, child processes.

Every implementation is a *step factory* ``factory(n, device) -> step``; all rows of a table
are timed in one process, interleaved, so every ratio compares numbers taken under one load.

Example:
    >>> sorted(WORKLOAD_REAL), list(WORKLOAD_A)[:2]
    (['cnn', 'gru', 'lstm', 'transformer'], ['naive', 'merged'])
"""

from ._tools import NOT_AVAILABLE, Step, time_rounds, time_step
from .compile_time import FIRST_STEP_WORKLOADS, RESULT_ROWS, first_step_times, time_to_result
from .memory import build_memory, wide_mlp
from .real import REAL_N, WORKLOAD_REAL, Encoder, Recurrent, cnn
from .run import (
    DEFAULT_SIZES,
    OPTIM_SIZES,
    QUICK_REAL_N,
    QUICK_SIZES,
    QUICK_WORKLOADS,
    WORKLOADS,
    run,
)
from .tables import REAL_TARGETS, format_table
from .workloads import (
    HEADS,
    MERGED_MAX_N,
    NAIVE_MAX_N,
    WORKLOAD_A,
    WORKLOAD_B,
    WORKLOAD_OPTIM,
    StepFactory,
    head,
    mlp,
)

__all__ = [
    "DEFAULT_SIZES",
    "FIRST_STEP_WORKLOADS",
    "HEADS",
    "MERGED_MAX_N",
    "NAIVE_MAX_N",
    "NOT_AVAILABLE",
    "OPTIM_SIZES",
    "QUICK_REAL_N",
    "QUICK_SIZES",
    "QUICK_WORKLOADS",
    "REAL_N",
    "REAL_TARGETS",
    "RESULT_ROWS",
    "WORKLOADS",
    "WORKLOAD_A",
    "WORKLOAD_B",
    "WORKLOAD_OPTIM",
    "WORKLOAD_REAL",
    "Encoder",
    "Recurrent",
    "Step",
    "StepFactory",
    "build_memory",
    "cnn",
    "first_step_times",
    "format_table",
    "head",
    "mlp",
    "run",
    "time_rounds",
    "time_step",
    "time_to_result",
    "wide_mlp",
]
