"""Plain-text tables of :func:`vmapens.bench.run` results, with ratios and the issue's targets.

Example:
    >>> print(format_table({"meta": {"torch": "2", "device": "cpu", "threads": 1, "quick": True}}))
    vmapens bench: torch 2, cpu, 1 threads, quick
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._optional import format_optimizers
from ._tools import cell, grid, ratio
from .real import DESCRIPTIONS
from .workloads import MERGED_MAX_N, NAIVE_MAX_N


def _block(rows: list[dict], key: str, refs: list[str], naive: Callable[[Any], Any]) -> list[str]:
    """Two grids for one workload: ms/step per implementation, then speedups and ratios."""
    by = {(r[key], r["impl"]): r for r in rows}
    keys, impls = list(dict.fromkeys(k for k, _ in by)), list(dict.fromkeys(i for _, i in by))
    ms = {k: r["ms"] if r["status"] == "ok" else None for k, r in by.items()}
    vm = {"vmapens_eager": "eager", "vmapens_compiled": "comp"}
    label = key.upper() if key == "n" else key
    out = grid([label, *impls], [[str(k), *(cell(by[k, i]) for i in impls)] for k in keys])
    out += ["", "S = t_naive / t; vmapens/ref = t_vmapens / t_ref (< 1: vmapens faster)"]
    head = [label, *(f"S {v}" for v in vm.values()), *(f"{vm[v]}/{r}" for v in vm for r in refs)]
    body = [
        [str(k), *(ratio(naive(k), ms[k, v]) for v in vm)]
        + [ratio(ms[k, v], ms[k, r]) for v in vm for r in refs]
        for k in keys
    ]
    first = [by[k, "vmapens_compiled"].get("first_ms") for k in keys]
    first_s = ", ".join(f"{k}: {f / 1e3:.1f}" if f else f"{k}: n/a" for k, f in zip(keys, first))
    return [*out, *grid(head, body), f"vmapens_compiled first step (compile), s: {first_s}"]


#: Ratio columns of the optimizer table: label, numerator, denominator.
_OPTIM_RATIOS = (
    ("stacked/foreach", "stacked_adam", "foreach_adam"),
    ("stacked_lr/foreach", "stacked_adam_per_member_lr", "foreach_adam"),
    ("groups/stacked", "per_member_groups", "stacked_adam"),
    ("groups/stacked_lr", "per_member_groups", "stacked_adam_per_member_lr"),
)


def _optim_block(rows: list[dict]) -> list[str]:
    """The optimizer-step grids: median (min) ms/step, then ratios of medians (of mins)."""
    by = {(r["n"], r["impl"]): r for r in rows}
    ns, impls = list(dict.fromkeys(n for n, _ in by)), list(dict.fromkeys(i for _, i in by))

    def ms(n: int, impl: str, key: str) -> float | None:
        row = by.get((n, impl))
        return row[key] if row and row["status"] == "ok" else None

    def timing(n: int, impl: str) -> str:
        row = by[n, impl]
        return f"{row['ms']:.3g} ({row['min_ms']:.3g})" if row["status"] == "ok" else cell(row)

    def quotient(n: int, num: str, den: str) -> str:
        mins = ratio(ms(n, num, "min_ms"), ms(n, den, "min_ms"))
        return f"{ratio(ms(n, num, 'ms'), ms(n, den, 'ms'))} ({mins})"

    out = grid(["N", *impls], [[str(n), *(timing(n, i) for i in impls)] for n in ns])
    out += ["", "ratios of medians (of mins); targets at N = 256: stacked/foreach <= 1.3, "]
    out[-1] += "groups/stacked >= 10"
    head = ["N", *(label for label, _, _ in _OPTIM_RATIOS)]
    return out + grid(
        head, [[str(n), *(quotient(n, a, b) for _, a, b in _OPTIM_RATIOS)] for n in ns]
    )


def format_table(results: dict) -> str:
    """Render :func:`run` results as plain-text tables.

    Args:
        results: What :func:`run` returned, or its JSON round-trip.

    Returns:
        One block per workload (ms/step, then speedups and ratios), with footnotes.
    """
    meta = results["meta"]
    out = [f"vmapens bench: torch {meta['torch']}, {meta['device']}, {meta['threads']} threads"]
    out[0] += ", quick" if meta["quick"] else ""
    if "A" in results:
        a = results["A"]
        out += ["", "Workload A: N MLPs Linear(2,20)->Linear(20,1)->sigmoid, BCE, Adam; ms/step"]
        refs = ["merged", "torchfunc", "baddbmm"]
        out += _block(a["rows"], "n", refs, lambda n: n * a["naive_1_ms"])
        out.append(
            f"* naive not run beyond N = {NAIVE_MAX_N}: N * t_naive(1); "
            f"- merged not run beyond N = {MERGED_MAX_N} (dense N x 20N mask)"
        )
    if "B" in results:
        b = results["B"]
        naive = {r["loss"]: r.get("ms") for r in b["rows"] if r["impl"] == "naive"}
        out += ["", f"Workload B: {b['heads']} heads Linear(16,32)->Tanh->Linear(32,4), batch 256"]
        out += _block(b["rows"], "loss", ["grouped_conv", "torchfunc", "baddbmm"], naive.get)
        out.append("+ make_step takes a per-member loss: this is the per_head run")
    if "optim" in results:
        out += ["", "Optimizer step alone on workload A's stacked parameters, fixed gradients;"]
        out[-1] += " ms/step, median (min) over interleaved rounds"
        out += _optim_block(results["optim"]["rows"])
        out.append("groups: one torch.optim.Adam param group per member, on per-member leaves")
    if "memory" in results:
        m = results["memory"]
        out += ["", f"Memory building Ensemble({m['n']} x {m['params']:,} params): "]
        if m["status"] == "ok":
            out[-1] += (
                f"peak RSS +{m['peak_mb']:.1f} MB vs stacked + one member "
                f"{m['expected_mb']:.1f} MB (x{m['ratio']:.2f}); held after: "
                f"+{m['held_mb']:.1f} MB"
            )
        else:
            out[-1] += f"n/a ({m['reason']})"
    return "\n".join(out)

