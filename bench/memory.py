"""Peak memory of building an Ensemble, measured in a fresh process.

Example:
    >>> wide_mlp(8)[0].out_features
    8
"""

from __future__ import annotations

import functools

from torch import nn

from vmapens.ensemble import Ensemble

from ._tools import NOT_AVAILABLE, child_json, reset_peak_rss, rss_bytes


def wide_mlp(hidden: int = 1024) -> nn.Sequential:
    """Memory-test member: ``Linear(512, hidden) -> ReLU -> Linear(hidden, 512)``, ~1M params."""
    return nn.Sequential(nn.Linear(512, hidden), nn.ReLU(), nn.Linear(hidden, 512))


def _build_memory_here(n: int, hidden: int) -> dict:
    """Child side of :func:`build_memory`: must run in a fresh process for a clean peak."""
    params = sum(p.numel() for p in wide_mlp(hidden).parameters())
    report = {"n": n, "hidden": hidden, "params": params, "expected_mb": (n + 1) * params / 2**18}
    try:
        before = reset_peak_rss()  # so the peak excludes importing torch
        ens = Ensemble(functools.partial(wide_mlp, hidden), n, seed=0)
        peak, held = (rss_bytes(f) - before for f in ("VmHWM", "VmRSS"))
    except NOT_AVAILABLE as e:
        return {**report, "status": "n/a", "reason": f"{type(e).__name__}: {e}"}
    del ens
    peak_mb, held_mb = peak / 2**20, held / 2**20
    ratio = peak_mb / report["expected_mb"]
    return {**report, "status": "ok", "peak_mb": peak_mb, "held_mb": held_mb, "ratio": ratio}


def build_memory(n: int = 64, hidden: int = 1024) -> dict:
    """Peak RSS increase while building ``vmapens.Ensemble`` of ``n`` ~1M-parameter MLPs.

    The build runs in a fresh ``sys.executable`` subprocess so that earlier allocations of this
    process cannot hide its peak. The ideal is the stacked float32 parameters plus one member;
    building every member before stacking peaks near twice the stacked size. The RSS still held
    once the Ensemble is built shows that it keeps no per-member copies. Linux only.

    Args:
        n: Number of members.
        hidden: Hidden width of :func:`wide_mlp` (1024 gives 1,050,112 parameters).

    Returns:
        ``status`` ("ok" or "n/a" with ``reason``), ``peak_mb``, ``held_mb`` (RSS increase
        after the build, the Ensemble alive), ``expected_mb`` (stacked plus one member),
        ``ratio`` (peak / expected), ``n``, ``hidden``, ``params`` per member.

    Raises:
        ValueError: If `n` or `hidden` is not a positive int.
        RuntimeError: If the subprocess fails.

    Example:
        >>> build_memory(4, hidden=64)["n"]
        4
    """
    for name, value in (("n", n), ("hidden", hidden)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"build_memory: `{name}` must be a positive int, got {value!r}")
    code = (
        "import json; from bench.memory import _build_memory_here; "
        f"print(json.dumps(_build_memory_here({n}, {hidden})))"
    )
    return child_json(code, "build_memory")
