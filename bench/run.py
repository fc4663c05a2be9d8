"""``run``: time the chosen workloads in this process (and the compile-time ones in children).

All implementations of one workload at one N are timed interleaved (:func:`time_rounds`), so
their ratios share the machine's load. A row whose step cannot be built or fails on its first
call (its vmapens API missing, a module vmap cannot batch) is reported as n/a with the reason
instead of stopping the run.

Example:
    >>> sorted(run(workloads=("optim",), quick=True))
    ['meta', 'optim']
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._tools import Step, time_rounds
from .compile_time import first_step_times, time_to_result
from .memory import build_memory, build_time, train_memory
from .optimizers import run_optimizers
from .real import REAL_N, WORKLOAD_REAL
from .widths import THREADS, run_widths
from .workloads import (
    HEADS,
    MERGED_MAX_N,
    NAIVE_MAX_N,
    WORKLOAD_A,
    WORKLOAD_B,
    WORKLOAD_OPTIM,
    StepFactory,
    a_naive,
)

DEFAULT_SIZES = (1, 5, 15, 64, 256, 1024, 4096)
QUICK_SIZES = (1, 15)
#: Ensemble size of the real-model workloads in quick mode (their compiled rows are skipped).
QUICK_REAL_N = 2
REAL = tuple(WORKLOAD_REAL)
#: Everything ``run`` can time; "optimizers" only once ``bench/optimizers.py`` exists.
WORKLOADS = ("A", "B", "optim", *REAL, "result", "compile", "optimizers", "widths")
#: What quick mode times (a CI smoke run, under a minute on 2 cores).
QUICK_WORKLOADS = ("A", "B", "optim", *REAL, "optimizers", "widths")
#: Ensemble sizes of the optimizer-step workload (quick mode: the first only).
OPTIM_SIZES = (15, 256, 1024)
#: time_rounds settings: quick mode's are a smoke test, not a measurement.
_CFG = {
    False: {"warmup": 3, "repeats": 5, "min_time_s": 0.2, "min_steps": 3},
    True: {"warmup": 1, "repeats": 3, "min_time_s": 0.02, "min_steps": 2},
}
#: Quick mode's real models: one timed step each, enough to show that every row runs.
_QUICK_REAL_CFG = {"warmup": 1, "repeats": 1, "min_time_s": 0.0, "min_steps": 1}


class OptionError(ValueError):
    """An argument of :func:`run` refused before anything ran (``python -m bench`` reports it as
    a usage error, not a traceback)."""


def _measure_rounds(
    factories: dict[str, StepFactory], n: int, device: torch.device, cfg: dict
) -> dict[str, dict]:
    """Build each step and call it once (timed: the compile time of a compiled step), then
    time them all interleaved. A step that fails to build or on that first call is n/a."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    steps: dict[str, Step] = {}
    out: dict[str, dict[str, Any]] = {}
    for impl, factory in factories.items():
        try:
            step = factory(n, device)
            sync()
            t0 = time.perf_counter()
            step()
            sync()
        except Exception as e:  # reported in the table, with its reason
            out[impl] = {"status": "n/a", "reason": f"{type(e).__name__}: {e}"[:300]}
            continue
        steps[impl], out[impl] = step, {"first_ms": (time.perf_counter() - t0) * 1e3}
    timed = time_rounds(steps, device=device, **cfg) if steps else {}
    return {
        impl: out[impl] if impl not in steps else {"status": "ok", **timed[impl], **out[impl]}
        for impl in factories
    }


def _run_a(sizes: Sequence[int], device: torch.device, cfg: dict, say: Callable) -> dict:
    # S(N)'s baseline: the naive N=1 step (sizes are sorted, so N=1 comes first).
    base = None if 1 in sizes else _measure_rounds({"naive": a_naive}, 1, device, cfg)["naive"]
    rows = []
    for n in sizes:
        skip = {"naive": n > NAIVE_MAX_N, "merged": n > MERGED_MAX_N}
        here = {k: f for k, f in WORKLOAD_A.items() if not skip.get(k)}
        say(f"A: N={n}: {', '.join(here)}, interleaved")
        timed = _measure_rounds(here, n, device, cfg)
        base = base or timed["naive"]
        for impl in WORKLOAD_A:
            if impl in timed:
                row = timed[impl]
            elif impl == "naive":
                row = {"status": "ok", "ms": n * base["ms"], "extrapolated": True}
            else:
                row = {"status": "skipped", "reason": f"N > {MERGED_MAX_N}"}
            rows.append({"n": n, "impl": impl, **row})
    assert base is not None  # sizes is non-empty
    return {"naive_1_ms": base["ms"], "rows": rows}


def _run_b(device: torch.device, cfg: dict, say: Callable) -> dict:
    rows = []
    for loss, factories in WORKLOAD_B.items():
        # The mean run's compiled row is the per-head make_step: copied, one compile.
        here = {k: f for k, f in factories.items() if (k, loss) != ("vmapens_compiled", "mean")}
        say(f"B: loss={loss}: {', '.join(here)}, interleaved")
        timed = _measure_rounds(here, HEADS, device, cfg)
        rows += [{"loss": loss, "impl": impl, **timed[impl]} for impl in here]
    shared = next(r for r in rows if r["impl"] == "vmapens_compiled")
    rows.insert(len(WORKLOAD_B["mean"]) - 1, {**shared, "loss": "mean", "mark": "+"})
    return {"heads": HEADS, "rows": rows}


def _run_real(
    workload: str, n: int, quick: bool, device: torch.device, cfg: dict, say: Callable
) -> dict[str, Any]:
    factories = WORKLOAD_REAL[workload]
    # Quick mode is a smoke run: compiling a Transformer or a GRU step takes tens of seconds.
    here = {k: f for k, f in factories.items() if not (quick and "compiled" in k)}
    say(f"{workload}: N={n}: {', '.join(here)}, interleaved")
    timed = _measure_rounds(here, n, device, _QUICK_REAL_CFG if quick else cfg)
    skipped = {"status": "skipped", "reason": "quick mode"}
    return {"n": n, "rows": [{"impl": k, **timed.get(k, skipped)} for k in factories]}


def run(
    device: torch.device | str = "cpu",
    sizes: Sequence[int] = DEFAULT_SIZES,
    workloads: Sequence[str] | None = None,
    quick: bool = False,
    threads: int | None = None,
    *,
    optim_sizes: Sequence[int] = OPTIM_SIZES,
    real_n: int = REAL_N,
    memory: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Time every implementation of the chosen workloads.

    Args:
        device: Device to run on (the "result" and "compile" workloads run on CPU).
        sizes: Ensemble sizes N for workload A (workload B always has 128 heads).
        workloads: Any of :data:`WORKLOADS`: ``"A"``, ``"B"``, ``"optim"`` (the optimizer step
            alone), ``"cnn"``, ``"transformer"``, ``"gru"``, ``"lstm"``, ``"result"`` (time to
            result of workload A, fresh processes), ``"compile"`` (first compiled steps, cold
            and warm caches, fresh processes), ``"optimizers"`` (when available), ``"widths"``
            (4 widths x 8 seeds in one padded ensemble, :mod:`bench.widths`). Default: all,
            or :data:`QUICK_WORKLOADS` in quick mode.
        quick: Smoke-test mode: sizes ``(1, 15)``, real models at N = 2 without their compiled
            rows, short timings; under a minute on 2 cores.
        threads: If given, ``torch.set_num_threads(threads)`` for the run, restored afterwards
            (the width sweep then runs at that count only, else at 1 and 2 threads).
        optim_sizes: Ensemble sizes N for the ``"optim"`` workload.
        real_n: Ensemble size N of the real-model workloads.
        memory: Also run :func:`build_memory` and :func:`train_memory` (in subprocesses) and
            :func:`build_time`, and report them.
        log: Called with a progress line before each measurement (e.g. ``print``).

    Returns:
        JSON-serialisable results for :func:`format_table`. A row has ``status`` "ok", "n/a"
        (with ``reason``) or "skipped" (the reference is too big at this N, or quick mode).

    Raises:
        OptionError: A ``ValueError``: if `workloads`, `sizes`, `optim_sizes`, `real_n` or
            `threads` is invalid, or `device` is CUDA and torch sees no CUDA device.
    """
    chosen = (
        tuple(workloads) if workloads is not None else (QUICK_WORKLOADS if quick else WORKLOADS)
    )
    if not chosen or not set(chosen) <= set(WORKLOADS):
        raise OptionError(
            f"run: `workloads` must be a non-empty subset of {WORKLOADS}, got {chosen}"
        )
    sizes = sorted(QUICK_SIZES if quick else sizes)
    optim_sizes = sorted(OPTIM_SIZES[:1] if quick else optim_sizes)
    real_n = QUICK_REAL_N if quick else real_n
    for name, ns in (("sizes", sizes), ("optim_sizes", optim_sizes), ("real_n", [real_n])):
        if not ns or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in ns):
            raise OptionError(f"run: `{name}` must be positive ints, got {ns}")
    if threads is not None and (
        not isinstance(threads, int) or isinstance(threads, bool) or threads < 1
    ):
        raise OptionError(f"run: `threads` must be a positive int or None, got {threads!r}")
    device, cfg, say = torch.device(device), _CFG[quick], log or (lambda _: None)
    # Else every row fails to build: rows of n/a, or a KeyError once workload A has no naive row.
    if device.type == "cuda" and not torch.cuda.is_available():
        raise OptionError(
            f"run: `device` is {str(device)!r} but torch sees no CUDA device "
            f"(torch {torch.__version__}, torch.cuda.is_available() is False)"
        )
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    meta = {"torch": torch.__version__, "device": str(device), "quick": quick}
    results: dict[str, Any] = {"meta": {**meta, "threads": torch.get_num_threads()}}
    try:
        if "A" in chosen:
            results["A"] = _run_a(sizes, device, cfg, say)
        if "B" in chosen:
            results["B"] = _run_b(device, cfg, say)
        if "optim" in chosen:
            rows = []
            for n in optim_sizes:
                say(f"optim: {', '.join(WORKLOAD_OPTIM)} N={n}, interleaved")
                timed = _measure_rounds(WORKLOAD_OPTIM, n, device, cfg)
                rows += [{"n": n, "impl": impl, **row} for impl, row in timed.items()]
            results["optim"] = {"rows": rows}
        for workload in REAL:
            if workload in chosen:
                results[workload] = _run_real(workload, real_n, quick, device, cfg, say)
        if "optimizers" in chosen:
            results["optimizers"] = run_optimizers(quick=quick, device=device, log=say)
        if "widths" in chosen:
            counts = THREADS if threads is None else (threads,)
            results["widths"] = run_widths(quick=quick, threads=counts, device=device, log=say)
        if "result" in chosen:
            results["result"] = {"rows": time_to_result(log=say)}
        if "compile" in chosen:
            results["compile"] = {"rows": first_step_times(log=say)}
        if memory:
            say("memory: building vmapens.Ensemble in a subprocess")
            results["memory"] = build_memory()
            say("memory: training 32 CNN members, unchunked and chunk_size=8, subprocesses")
            results["train_memory"] = train_memory()
            say("build time: Ensemble(mlp, 4096, seed=0) vs the stack_module_state recipe")
            results["build_time"] = build_time()
    finally:
        torch.set_num_threads(old_threads)
    return results
