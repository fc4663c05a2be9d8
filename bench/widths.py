"""Members of different sizes (issue 22 item 1): a width sweep trained as one padded ensemble.

Workload A's member with a width ``h`` instead of 20, ``Linear(2, h) -> Linear(h, 1) ->
sigmoid``, on workload A's batch (5 inputs, target 1), BCE, default Adam; 4 widths x 8 seeds,
timed side by side in one process, interleaved:

* ``naive``: one module and one ``torch.optim.Adam`` per member, a Python loop (the truth);
* ``separate``: one vmapens ``Ensemble`` per width (8 members each), stepped one after another;
* ``padded_eager`` / ``padded_compiled``: one ``Ensemble.from_factories`` over all 32 members,
  every parameter stored padded to the widest member, ``make_step`` eager or compiled.

Before anything is timed, every row has taken :data:`CHECK_STEPS` steps and its members are
compared with the naive loop's, so the timings compare equal work. The eager rows are timed
again at widths scaled by :data:`SCALES` to find where paying for the widest member on every
member stops being cheaper than one ensemble per width. Every thread count in ``threads`` is a
fresh build (a compiled CPU kernel keeps the thread count it was compiled at).

Example:
    >>> res = run_widths(quick=True, threads=(1,))
    >>> [s["check"]["same"] for s in res["sweeps"]]
    [True]
    >>> "padded/separate" in format_widths(res)
    True
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import optree
import torch
from torch import nn

from vmapens.ensemble import Ensemble
from vmapens.optim import StackedAdam
from vmapens.seeds import member_seed
from vmapens.step import make_step

from ._tools import Step, grid, ratio, time_rounds
from .workloads import _data, loop_step

#: The widths of the sweep and the members per width.
WIDTHS = (16, 32, 64, 128)
SEEDS = 8
#: Multiples of WIDTHS at which the eager rows are timed again (the crossover).
SCALES = (1, 4, 16, 64)
#: Thread counts (``torch.set_num_threads``) of a full run.
THREADS = (1, 2)
#: Quick mode (a smoke test): two widths, two seeds each, no compiled row, no scaled widths.
QUICK_WIDTHS, QUICK_SEEDS = (16, 32), 2
#: Steps every row takes before its members are compared with the naive loop's.
CHECK_STEPS = 3
#: float32 rounding: the padded matmuls add exact zeros but may sum in another order, and the
#: compiled step fuses differently; a wrong update (a padded entry leaking in, a member's Adam
#: state mixed with another's) is off by ~1e-3 after one step at Adam's lr.
EQUAL_TOL = {"rtol": 1e-5, "atol": 1e-6}
#: time_rounds settings (quick: a smoke test, not a measurement).
_CFG: dict[bool, dict[str, Any]] = {
    False: {"warmup": 3, "repeats": 7, "min_time_s": 0.2, "min_steps": 3},
    True: {"warmup": 1, "repeats": 3, "min_time_s": 0.02, "min_steps": 2},
}


def width_mlp(hidden: int = 20) -> nn.Sequential:
    """Workload A's member at width ``hidden``: ``Linear(2, hidden) -> Linear(hidden, 1) ->
    sigmoid`` (``hidden=20`` is workload A's ``mlp``)."""
    return nn.Sequential(nn.Linear(2, hidden), nn.Linear(hidden, 1), nn.Sigmoid())


@dataclass
class Trained:
    """One row of the sweep: its step, and what the equal-work check and the state size read.

    Attributes:
        step: one training step of every member (forward, loss, backward, Adam).
        members: every member's ``state_dict`` at its own size, width-major then seed.
        tensors: every tensor the row holds between steps: parameters, gradients, Adam state.
    """

    step: Step
    members: Callable[[], list[dict[str, torch.Tensor]]]
    tensors: Callable[[], list[torch.Tensor]]


def _built(hidden: int, device: torch.device) -> nn.Sequential:
    return width_mlp(hidden).to(device)


def _factories(widths: Sequence[int], seeds: int, device: torch.device) -> list[Callable]:
    return [functools.partial(_built, h, device) for h in widths for _ in range(seeds)]


def _ensemble_rows(ensembles: list[Ensemble], *, compile: bool, device: torch.device) -> Trained:
    """The step of ``ensembles`` stepped one after another, each with its own StackedAdam."""
    x, y = _data("A", device)
    opts = [StackedAdam(ens) for ens in ensembles]
    steps = [
        make_step(ens, nn.BCELoss(), opt, compile=compile)
        for ens, opt in zip(ensembles, opts, strict=True)
    ]

    def step() -> None:
        for one in steps:
            one(x, y)

    def tensors() -> list[torch.Tensor]:
        found = [t for ens in ensembles for p in ens.parameters() for t in (p, p.grad)]
        found += [leaf for opt in opts for leaf in optree.tree_leaves(opt.state_dict())]
        return [t for t in found if isinstance(t, torch.Tensor)]

    return Trained(
        step,
        lambda: [ens[i].state_dict() for ens in ensembles for i in range(len(ens))],
        tensors,
    )


def w_naive(widths: Sequence[int], seeds: int, device: torch.device) -> Trained:
    """One module and one ``torch.optim.Adam`` per member, looped over: the code users write.

    Member ``i`` is built as ``torch.manual_seed(member_seed(0, i)); factory()``, as member
    ``i`` of ``Ensemble.from_factories(factories, seed=0)``.
    """
    x, y = _data("A", device)
    models = []
    for i, factory in enumerate(_factories(widths, seeds, device)):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(member_seed(0, i))
            models.append(factory())
    opts = [torch.optim.Adam(m.parameters()) for m in models]
    step = loop_step(models, opts, x, y)

    def tensors() -> list[torch.Tensor]:
        found = [t for m in models for p in m.parameters() for t in (p, p.grad)]
        found += [v for opt in opts for s in opt.state.values() for v in s.values()]
        return [t for t in found if isinstance(t, torch.Tensor)]

    def members() -> list[dict[str, torch.Tensor]]:  # copies, as ens[i] gives
        return [{k: v.clone() for k, v in m.state_dict().items()} for m in models]

    return Trained(step, members, tensors)


def w_separate(widths: Sequence[int], seeds: int, device: torch.device) -> Trained:
    """One ``Ensemble`` of ``seeds`` members per width, each with its own step and StackedAdam,
    called one after another: the best vmapens could do before ``from_factories``."""
    everyone = [member_seed(0, i) for i in range(len(widths) * seeds)]
    ensembles = [
        Ensemble(
            functools.partial(_built, h, device),
            seeds,
            seeds=everyone[k * seeds : (k + 1) * seeds],
        )
        for k, h in enumerate(widths)
    ]
    return _ensemble_rows(ensembles, compile=False, device=device)


def w_padded(
    widths: Sequence[int], seeds: int, device: torch.device, *, compile: bool = False
) -> Trained:
    """``Ensemble.from_factories`` over every member, padded to the widest; one step."""
    ens = Ensemble.from_factories(_factories(widths, seeds, device), seed=0)
    return _ensemble_rows([ens], compile=compile, device=device)


#: The rows, in table order: ``factory(widths, seeds, device) -> Trained``.
ROWS: dict[str, Callable[[Sequence[int], int, torch.device], Trained]] = {
    "naive": w_naive,
    "separate": w_separate,
    "padded_eager": w_padded,
    "padded_compiled": functools.partial(w_padded, compile=True),
}


def _compare(got: list[dict], expected: list[dict]) -> float:
    """Largest ``|got - expected|`` over members and tensors; AssertionError unless close."""
    worst = 0.0
    assert len(got) == len(expected), f"{len(got)} members vs {len(expected)}"
    for mine, truth in zip(got, expected, strict=True):
        for name, value in truth.items():
            torch.testing.assert_close(mine[name], value, **EQUAL_TOL)
            worst = max(worst, (mine[name] - value).abs().max().item())
    return worst


def _sweep(
    widths: Sequence[int],
    seeds: int,
    impls: Sequence[str],
    device: torch.device,
    cfg: dict,
) -> dict[str, Any]:
    """Build ``impls`` at ``widths`` and take :data:`CHECK_STEPS` steps each (the first two
    timed: a compiled step compiles in them), check that every member equals the naive loop's,
    then time the rows interleaved. A row that fails to build or to step is n/a, with why."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    built: dict[str, Trained] = {}
    rows: dict[str, dict[str, Any]] = {}
    for impl in impls:
        try:
            row, calls = ROWS[impl](widths, seeds, device), []
            for _ in range(CHECK_STEPS):
                sync()
                start = time.perf_counter()
                row.step()
                sync()
                calls.append((time.perf_counter() - start) * 1e3)
        except Exception as e:  # reported in the table, with its reason
            rows[impl] = {"impl": impl, "status": "n/a", "reason": f"{type(e).__name__}: {e}"[:300]}
            continue
        built[impl] = row
        rows[impl] = {"impl": impl, "first_ms": calls[0], "second_ms": calls[1]}
    check: dict[str, Any] = {"steps": CHECK_STEPS, "same": "naive" in built, "max_abs_diff": 0.0}
    truth = built["naive"].members() if "naive" in built else []
    for impl, row in built.items():
        try:
            diff = _compare(row.members(), truth)
        except AssertionError as e:
            check["same"], check["reason"] = False, f"{impl}: {e}"[:500]
            continue
        check["max_abs_diff"] = max(check["max_abs_diff"], diff)
    timed = time_rounds({k: r.step for k, r in built.items()}, device=device, **cfg)
    for impl, row in built.items():
        # time_rounds's first call is the row's (CHECK_STEPS + 1)-th: keep the real first.
        held = sum(t.numel() * t.element_size() for t in row.tensors())
        rows[impl] |= {"status": "ok", **timed[impl], **rows[impl], "state_kb": held / 1024}
    return {"widths": list(widths), "check": check, "rows": list(rows.values())}


def run_widths(
    quick: bool = False,
    *,
    threads: Sequence[int] = THREADS,
    scales: Sequence[int] = SCALES,
    device: torch.device | str = "cpu",
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Time the width sweep: every row at :data:`WIDTHS`, the eager rows at the scaled widths.

    Args:
        quick: Smoke-test mode: :data:`QUICK_WIDTHS` x :data:`QUICK_SEEDS`, no compiled row,
            no scaled widths, short timings.
        threads: Thread counts to run at, one after another (each a fresh build).
        scales: Multiples of the widths; scale 1 times every row, the others the eager rows.
        device: Device to run on.
        log: Called with a progress line before each measurement (e.g. ``print``).

    Returns:
        JSON-serialisable: ``seeds`` and ``sweeps``, one per thread count and scale, each with
        ``threads``, ``scale``, ``widths``, ``check`` (``same``, ``max_abs_diff`` over every
        member's tensors against the naive loop after ``steps`` steps, ``reason`` if not same)
        and ``rows`` (``impl``, ``status``; when ok, time_rounds's ``ms``, ``min_ms``, ...,
        ``first_ms`` and ``second_ms`` (the first two calls), ``state_kb`` (parameters,
        gradients and optimizer state held)).

    Raises:
        ValueError: ``threads`` or ``scales`` is empty or holds a non-positive int.
    """
    for name, values in (("threads", threads), ("scales", scales)):
        if not values or any(
            not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in values
        ):
            raise ValueError(f"run_widths: `{name}` must be positive ints, got {values}")
    device, say = torch.device(device), log or (lambda _: None)
    widths, seeds = (QUICK_WIDTHS, QUICK_SEEDS) if quick else (WIDTHS, SEEDS)
    old_threads, sweeps = torch.get_num_threads(), []
    try:
        for n_threads in threads:
            torch.set_num_threads(n_threads)
            for scale in (1,) if quick else scales:
                impls = [k for k in ROWS if not (k == "padded_compiled" and (quick or scale != 1))]
                here = [h * scale for h in widths]
                say(f"widths: {here} x {seeds} seeds, {n_threads} threads: {', '.join(impls)}")
                sweep = _sweep(here, seeds, impls, device, _CFG[quick])
                sweeps.append({"threads": n_threads, "scale": scale, **sweep})
    finally:
        torch.set_num_threads(old_threads)
    return {"seeds": seeds, "sweeps": sweeps}


def _timing(row: dict | None) -> str:
    if row is None:
        return "-"
    return f"{row['ms']:.3g} ({row['min_ms']:.3g})" if row["status"] == "ok" else "n/a"


def format_widths(results: dict[str, Any]) -> str:
    """:func:`run_widths` results as plain text: ms/step per row, the ratios, the check.

    Args:
        results: What :func:`run_widths` returned, or its JSON round-trip.

    Returns:
        A table per thread count at scale 1, then the scaled widths (the crossover).
    """
    sweeps, seeds = results["sweeps"], results["seeds"]
    out = [
        f"Width sweep: Linear(2,h)->Linear(h,1)->sigmoid x {seeds} seeds per width, batch 5, "
        "BCE, Adam; ms/step median (min) over interleaved rounds"
    ]
    for s in sweeps:
        same = s["check"]
        verdict = (
            f"yes (max |diff| {same['max_abs_diff']:.1g})"
            if same["same"]
            else (f"NO, the rows do unequal work: {same.get('reason', 'no naive row')}")
        )
        out.append(
            f"h = {s['widths']}, {s['threads']} thread(s): members equal to the naive loop's "
            f"after {same['steps']} steps: {verdict}"
        )
    head = ["threads", "h max", *ROWS, "padded/separate", "padded/naive", "compiled/separate"]
    head += ["compiled/naive"]
    body = []
    for s in sweeps:
        by = {r["impl"]: r for r in s["rows"]}
        ms = {k: r["ms"] if r["status"] == "ok" else None for k, r in by.items()}

        body.append(
            [str(s["threads"]), str(max(s["widths"])), *(_timing(by.get(k)) for k in ROWS)]
            + [
                ratio(ms.get(a), ms.get(b))
                for a in ("padded_eager", "padded_compiled")
                for b in ("separate", "naive")
            ]
        )
    out += grid(head, body)
    out.append("padded = padded_eager, compiled = padded_compiled; - not run (compiled: scale 1")
    out[-1] += " only); x/y < 1: x faster"
    for s in sweeps:
        for r in s["rows"]:
            if r["status"] != "ok":
                out.append(f"n/a {r['impl']} (h max {max(s['widths'])}): {r['reason']}")
            elif r["impl"] == "padded_compiled":
                out.append(
                    f"padded_compiled, {s['threads']} thread(s): first call {r['first_ms'] / 1e3:.1f} s,"
                    f" second {r['second_ms'] / 1e3:.2g} s"
                )
    first = [s for s in sweeps if s["scale"] == 1][:1]
    for s in first:
        kb = ", ".join(f"{r['impl']} {r['state_kb']:.0f}" for r in s["rows"] if r["status"] == "ok")
        out.append(f"held between steps (parameters, gradients, Adam state), KB: {kb}")
    return "\n".join(out)
