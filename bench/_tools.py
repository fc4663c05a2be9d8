"""How :mod:`bench` measures and prints: timing, plain-text grids, peak RSS.

Nothing here knows a workload; :mod:`bench` says what is measured and imports this.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping

import torch

Step = Callable[[], object]  # what a step returns is ignored
#: Errors that mean "the vmapens API this row needs is not there yet", shown as n/a.
NOT_AVAILABLE = (ImportError, AttributeError, NotImplementedError)


def time_rounds(
    steps: Mapping[str, Step],
    *,
    device: torch.device | str = "cpu",
    warmup: int = 3,
    repeats: int = 5,
    min_time_s: float = 0.2,
    min_steps: int = 3,
) -> dict[str, dict]:
    """Time several steps interleaved: ``repeats`` rounds, each timing one batch of every step.

    Every step gets its first call apart, then warm-up calls, and a batch size of
    ``max(min_steps, min_time_s worth)`` steps so that timer resolution and Python jitter do
    not dominate micro-steps. Each round times one batch per step, in an order rotated from
    round to round, so that load on a shared machine lands on all of them alike and their
    ratios stay meaningful; the median over rounds resists outliers.

    Args:
        steps: Zero-argument functions by name, each doing one step.
        device: Device the steps run on; CUDA is synchronised around every timed region.
        warmup: Untimed calls after the first (lazy optimizer state, recompilations, caches).
        repeats: Number of rounds.
        min_time_s: Target duration of one batch.
        min_steps: Fewest steps in one batch.

    Returns:
        By name: ``ms`` (median over rounds of ms/step), ``min_ms`` (fastest batch: the steadier
        figure on a shared machine), ``rounds_ms`` (each round's ms/step, in round order: for
        ratios paired by round, see :func:`paired_ratio`), ``first_ms`` (the first call: compile time for a compiled
        step), ``steps`` per batch and ``repeats``.

    Example:
        >>> out = time_rounds({"a": lambda: None, "b": lambda: None}, min_time_s=0.0)
        >>> sorted(out), out["a"]["steps"], out["b"]["repeats"]
        (['a', 'b'], 3, 5)
    """
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)

    def timed(step: Step, k: int) -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(k):
            step()
        sync()
        return (time.perf_counter() - t0) / k

    names, first, sizes = list(steps), {}, {}
    for name in names:
        first[name] = timed(steps[name], 1)
        # The median of single warm-up steps sizes the batches; one step alone is too noisy.
        per_step = statistics.median(timed(steps[name], 1) for _ in range(max(warmup, 1)))
        sizes[name] = max(min_steps, math.ceil(min_time_s / max(per_step, 1e-7)))
    batches: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            batches[name].append(timed(steps[name], sizes[name]) * 1e3)
    return {
        name: {
            "ms": statistics.median(batches[name]),
            "min_ms": min(batches[name]),
            "rounds_ms": batches[name],
            "first_ms": first[name] * 1e3,
            "steps": sizes[name],
            "repeats": repeats,
        }
        for name in names
    }


def time_step(
    step: Step,
    *,
    device: torch.device | str = "cpu",
    warmup: int = 3,
    repeats: int = 5,
    min_time_s: float = 0.2,
    min_steps: int = 3,
) -> dict:
    """Time one step alone: :func:`time_rounds` of a single step, same arguments and result.

    Example:
        >>> time_step(lambda: None, repeats=1, min_time_s=0.0)["steps"]
        3
    """
    timed = time_rounds(
        {"step": step},
        device=device,
        warmup=warmup,
        repeats=repeats,
        min_time_s=min_time_s,
        min_steps=min_steps,
    )
    return timed["step"]


def cell(row: dict) -> str:
    """A row's ms/step for a grid: ``n/a`` (API missing), ``-`` (skipped), then its marks."""
    if row["status"] != "ok":
        return "-" if row["status"] == "skipped" else "n/a"
    return f"{row['ms']:.3g}" + ("*" if row.get("extrapolated") else "") + row.get("mark", "")


def ratio(num: float | None, den: float | None) -> str:
    """``num / den`` to three significant digits, ``n/a`` when either is missing."""
    return f"{num / den:.3g}" if num and den else "n/a"


def paired_ratio(num: dict | None, den: dict | None) -> str:
    """The median over rounds of ``num``'s ms/step over ``den``'s in the same round
    (:func:`time_rounds` rows), three significant digits; ``n/a`` when either is missing or
    has no ``rounds_ms`` (rows written before it was kept).

    Load on a shared machine that changes between rounds moves both steps of a round alike, so
    this ratio is steadier than the ratio of the two medians, which may come from different
    rounds.

    Example:
        >>> paired_ratio({"rounds_ms": [2.0, 4.0, 3.0]}, {"rounds_ms": [1.0, 4.0, 2.0]})
        '1.5'
    """
    a, b = (num or {}).get("rounds_ms"), (den or {}).get("rounds_ms")
    if not a or not b or len(a) != len(b):
        return "n/a"
    return f"{statistics.median(x / y for x, y in zip(a, b, strict=True)):.3g}"


def grid(header: list[str], body: list[list[str]]) -> list[str]:
    """Right-aligned columns, one line per row."""
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    return ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *body]]


def rss_bytes(field: str = "VmRSS") -> int:
    """This process's ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field + ":")).split()[1]) * 1024


def reset_peak_rss() -> int:
    """Reset ``VmHWM`` (the peak RSS) to the current RSS and return that, in bytes. Linux only."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss_bytes()


def tensor_peak_bytes(run: Callable[[], object]) -> int:
    """The peak of the bytes torch's CPU allocator holds for tensors while ``run()`` runs, over
    what it held at the start: the CPU's ``torch.cuda.max_memory_allocated``.

    Read from the profiler's memory events (``profile_memory=True``): every allocation and
    free, in order, summed. Tensors only, so neither the C library's heap nor other libraries'
    buffers count.

    Example:
        >>> tensor_peak_bytes(lambda: torch.empty(1000, dtype=torch.float64)) >= 8000
        True
    """
    cpu = torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[cpu], profile_memory=True) as prof:
        run()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    level = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        if str(e.device_type()) == "DeviceType.CPU":
            level += e.nbytes()
            peak = max(peak, level)
    return peak


def child_json(code: str, api: str, env: Mapping[str, str] | None = None) -> dict:
    """Run ``code`` in a fresh ``sys.executable`` and return the JSON on its last output line.

    The child imports this very package even from an uninstalled checkout, and runs on one
    thread so that no thread pool's buffers blur what it measures; ``env`` adds variables.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    full = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full)
    if proc.returncode != 0:
        raise RuntimeError(f"{api}: subprocess failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
