"""Time to result and time to the first compiled step, each in a fresh process.

A compiled step pays for compilation once per process; how much depends on torch's on-disk
caches (inductor's FX graph cache and the AOTAutograd cache, both on by default, both under
``TORCHINDUCTOR_CACHE_DIR``) and on whether their artifacts were carried over from another
process (``torch.compiler.save_cache_artifacts`` / ``load_cache_artifacts``, the "mega-cache").
Every measurement here runs in a fresh ``sys.executable`` on one thread, with the cache
directory it names:

* ``cold``: an empty cache directory, as on a fresh machine or after a torch upgrade.
* ``warm``: the directory a ``cold`` run of the same step just filled, as on a second run.
* ``mega``: an empty directory, filled by ``load_cache_artifacts`` with the bytes that the
  ``cold`` run saved (``save_cache_artifacts``), as when a cache travels with a job.

Example:
    >>> sorted(FIRST_STEP_WORKLOADS)
    ['A', 'cnn', 'transformer']
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from vmapens.ensemble import Ensemble
from vmapens.fit import fit

from ._tools import Step, child_json
from .real import WORKLOAD_REAL
from .workloads import WORKLOAD_A, StepFactory, _data, mlp

#: Ensemble size and step count of the time-to-result run (the seed workload A).
RESULT_N, RESULT_STEPS = 15, 1000
#: Implementations of the time-to-result run: a workload A factory and a cache mode.
RESULT_ROWS: dict[str, tuple[str, str | None]] = {
    "naive": ("naive", None),
    "merged": ("merged", None),
    "vmapens_eager": ("vmapens_eager", None),
    "vmapens_fit": ("vmapens_fit", None),
    "vmapens_compiled_cold": ("vmapens_compiled", "cold"),
    "vmapens_compiled_warm": ("vmapens_compiled", "warm"),
}
#: Compiled step factories whose first step is timed, with their ensemble size.
FIRST_STEP_WORKLOADS: dict[str, tuple[StepFactory, int]] = {
    "A": (WORKLOAD_A["vmapens_compiled"], RESULT_N),
    "cnn": (WORKLOAD_REAL["cnn"]["vmapens_compiled"], 16),
    "transformer": (WORKLOAD_REAL["transformer"]["vmapens_compiled"], 16),
}
CACHE_MODES = ("cold", "warm", "mega")


def _counts() -> dict[str, int]:
    """What torch compiled and which caches it hit, from its own counters."""
    # Read where torch keeps them, without importing dynamo (2-3 s): a process that never
    # compiled has not imported it, and its time to result must not pay for it.
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return dict.fromkeys(("graphs", "fx_hit", "fx_miss", "aot_hit", "aot_miss"), 0)
    counters = utils.counters
    stats, inductor, aot = counters["stats"], counters["inductor"], counters["aot_autograd"]
    return {
        "graphs": stats["unique_graphs"],
        "fx_hit": inductor["fxgraph_cache_hit"],
        "fx_miss": inductor["fxgraph_cache_miss"],
        "aot_hit": aot["autograd_cache_hit"],
        "aot_miss": aot["autograd_cache_miss"],
    }


def _timed(step: Step) -> float:
    t0 = time.perf_counter()
    step()
    return time.perf_counter() - t0


def _result_here(impl: str, n: int, steps: int) -> dict:
    """Child side of :func:`time_to_result`: build and train, timed from after the imports."""
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    if impl == "vmapens_fit":  # what a user writes: fit with its default settings
        x, y = _data("A", torch.device("cpu"))
        fit(Ensemble(mlp, n, seed=0), (x, y), nn.BCELoss(), steps=steps, batch_size=len(x))
        return {"run_s": time.perf_counter() - t0, "first_s": float("nan"), **_counts()}
    step = WORKLOAD_A[impl](n, torch.device("cpu"))
    first = _timed(step)
    for _ in range(steps - 1):
        step()
    return {"run_s": time.perf_counter() - t0, "first_s": first, **_counts()}


def _first_step_here(workload: str, save: str | None, load: str | None) -> dict:
    """Child side of :func:`first_step_times`: the first steps of one compiled step."""
    torch.set_num_threads(1)
    if load:
        with open(load, "rb") as f:
            torch.compiler.load_cache_artifacts(f.read())
    factory, n = FIRST_STEP_WORKLOADS[workload]
    step = factory(n, torch.device("cpu"))
    first = _timed(step)
    second = _timed(step)
    for _ in range(3):  # a recompilation would show up in `graphs`
        step()
    if save:
        artifacts = torch.compiler.save_cache_artifacts()
        assert artifacts is not None  # the step just compiled, so there is something to save
        with open(save, "wb") as f:
            f.write(artifacts[0])
    return {"first_s": first, "second_s": second, **_counts()}


def _child(code: str, api: str, cache_dir: str | None) -> dict:
    """``child_json`` with its own inductor cache directory, timed as a whole process."""
    env = {"TORCHINDUCTOR_CACHE_DIR": cache_dir} if cache_dir else {}
    t0 = time.perf_counter()
    out = child_json(code, api, env=env)
    return {**out, "process_s": time.perf_counter() - t0}


def time_to_result(
    n: int = RESULT_N,
    steps: int = RESULT_STEPS,
    *,
    rows: Sequence[str] = tuple(RESULT_ROWS),
    log: Callable[[str], None] | None = None,
) -> list[dict]:
    """Workload A trained from scratch, compilation included, each row in a fresh process.

    Args:
        n: Number of MLPs.
        steps: Training steps.
        rows: Keys of :data:`RESULT_ROWS` to run, in its order.
        log: Called with a progress line before each row.

    Returns:
        One row per :data:`RESULT_ROWS` entry: ``impl``, ``run_s`` (build and train, after
        the imports), ``first_s`` (its first step), ``process_s`` (the whole child process,
        interpreter start and ``import torch`` included) and torch's compile counters.

    Raises:
        ValueError: If a row is unknown.

    Example:
        >>> [r["impl"] for r in time_to_result(2, 3, rows=["naive"])]
        ['naive']
    """
    unknown = [r for r in rows if r not in RESULT_ROWS]
    if unknown:
        raise ValueError(f"time_to_result: `rows` must be among {list(RESULT_ROWS)}, got {unknown}")
    out = []
    with tempfile.TemporaryDirectory(prefix="vmapens-inductor-") as cache:
        for name, (impl, mode) in RESULT_ROWS.items():
            if name not in rows:
                continue
            if log:
                log(f"time to result: {name}, {steps} steps, fresh process")
            code = (
                "import json; from bench.compile_time import _result_here; "
                f"print(json.dumps(_result_here({impl!r}, {n}, {steps})))"
            )
            # `warm` follows `cold` in RESULT_ROWS: it finds the directory cold just filled.
            out.append({"impl": name, **_child(code, "time_to_result", cache if mode else None)})
    return out


def first_step_times(
    workloads: Sequence[str] = tuple(FIRST_STEP_WORKLOADS),
    *,
    log: Callable[[str], None] | None = None,
) -> list[dict]:
    """Time the first compiled steps of each workload, cold, warm and from the mega-cache.

    Args:
        workloads: Keys of :data:`FIRST_STEP_WORKLOADS`.
        log: Called with a progress line before each measurement.

    Returns:
        One row per workload and cache mode: ``workload``, ``mode``, ``first_s``, ``second_s``,
        ``process_s`` and torch's counters (``graphs`` compiled in the first five steps, FX graph
        and AOTAutograd cache hits and misses).

    Raises:
        ValueError: If a workload is unknown.
    """
    unknown = [w for w in workloads if w not in FIRST_STEP_WORKLOADS]
    if unknown:
        raise ValueError(
            f"first_step_times: `workloads` must be among {sorted(FIRST_STEP_WORKLOADS)}, "
            f"got {unknown}"
        )
    rows = []
    for workload in workloads:
        with tempfile.TemporaryDirectory(prefix="vmapens-inductor-") as tmp:
            blob = os.path.join(tmp, "artifacts.bin")
            cache, fresh = os.path.join(tmp, "cache"), os.path.join(tmp, "fresh")
            plans: dict[str, tuple[str, str | None, str | None]] = {
                "cold": (cache, blob, None),
                "warm": (cache, None, None),
                "mega": (fresh, None, blob),
            }
            for mode, (directory, save, load) in plans.items():
                if log:
                    log(f"first compiled step: {workload}, {mode} cache, fresh process")
                code = (
                    "import json; from bench.compile_time import _first_step_here; "
                    f"print(json.dumps(_first_step_here({workload!r}, {save!r}, {load!r})))"
                )
                row = _child(code, "first_step_times", directory)
                rows.append({"workload": workload, "mode": mode, **row})
    return rows
