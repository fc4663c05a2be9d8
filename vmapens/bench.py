"""Workloads and reference implementations shared by ``python -m vmapens bench`` and ``bench/``.

Every implementation is a *step factory*: ``factory(n, device)`` builds the models, optimizer and
data once and returns a zero-argument function doing one full training step (forward, loss,
backward, optimizer step). All rows of a table are timed in one process, so every ratio compares
numbers taken under the same conditions. The workloads are described in ``WORKLOADS.md``.

Example:
    >>> from vmapens.bench import WORKLOAD_A, time_step
    >>> step = WORKLOAD_A["torchfunc"](15, torch.device("cpu"))
    >>> time_step(step, repeats=1, min_time_s=0.0)["ms"] > 0
    True
"""

from __future__ import annotations

import copy
import functools
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

Step = Callable[[], None]
StepFactory = Callable[[int, torch.device], Step]

#: Largest N at which the naive loop is timed; beyond it t(N) is extrapolated as N * t(1).
NAIVE_MAX_N = 64
#: Largest N for the hand-merged model: its masked weight is dense, O(N^2) memory and time.
MERGED_MAX_N = 1024
#: Number of heads in workload B.
HEADS = 128
#: Errors that mean "the vmapens API this row needs is not there yet", shown as n/a.
NOT_AVAILABLE = (ImportError, AttributeError, NotImplementedError)


def mlp() -> nn.Sequential:
    """Workload A member: ``Linear(2, 20) -> Linear(20, 1) -> sigmoid``."""
    return nn.Sequential(nn.Linear(2, 20), nn.Linear(20, 1), nn.Sigmoid())


def head() -> nn.Sequential:
    """Workload B member: ``Linear(16, 32) -> Tanh -> Linear(32, 4)``."""
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _data(workload: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    if workload == "A":
        return torch.randn(5, 2, device=device), torch.ones(5, 1, device=device)
    return torch.randn(256, 16, device=device), torch.randn(256, 4, device=device)


def _members(factory: Callable[[], nn.Module], n: int, device: torch.device) -> list[nn.Module]:
    return [factory().to(device) for _ in range(n)]


def _loss_b(out: torch.Tensor, y: torch.Tensor, loss: str) -> torch.Tensor:
    """Workload B loss of stacked outputs ``[heads, B, 4]``: on the mean, or summed per head."""
    if loss == "mean":
        return F.mse_loss(out.mean(0), y)
    return (out - y).pow(2).mean((1, 2)).sum()


def _train(params: Any, forward_loss: Callable[[], torch.Tensor]) -> Step:
    """Wrap a loss closure into one Adam step over ``params``."""
    opt = torch.optim.Adam(params)

    def step() -> None:
        opt.zero_grad()
        forward_loss().backward()
        opt.step()

    return step


def _stacked_linears(members: list[nn.Module]) -> list[torch.Tensor]:
    """Stack members' two ``Linear`` as baddbmm leaves ``W [n, in, out]``, ``b [n, 1, out]``."""
    layers = [[m for m in member if isinstance(m, nn.Linear)] for member in members]
    leaves = []
    for i in (0, 1):
        leaves.append(torch.stack([ls[i].weight.detach().t() for ls in layers]))
        leaves.append(torch.stack([ls[i].bias.detach()[None] for ls in layers]))
    return [t.contiguous().requires_grad_() for t in leaves]


def _functional(members: list[nn.Module]) -> tuple[dict, dict, nn.Module]:
    """The torch.func recipe: stacked fresh leaves plus a stateless meta-device template."""
    params, buffers = stack_module_state(members)
    return params, buffers, copy.deepcopy(members[0]).to("meta")


def _vmapens_step(workload: str, n: int, device: torch.device, *, compile: bool) -> Step:
    """vmapens ``make_step`` with the per-member loss (BCE for A, MSE for B)."""
    import vmapens
    from vmapens.optim import StackedAdam

    x, y = _data(workload, device)
    member, loss_fn = (mlp, nn.BCELoss()) if workload == "A" else (head, nn.MSELoss())
    # Members are built on `device` by the factory, so nothing is assumed about Ensemble.to.
    ens = vmapens.Ensemble(lambda: member().to(device), n, seed=0)
    step = ens.make_step(loss_fn, StackedAdam(ens), compile=compile)
    return lambda: step(x, y)


# --- Workload A ---------------------------------------------------------------------------------


def a_naive(n: int, device: torch.device) -> Step:
    """N modules, N ``torch.optim.Adam``, a Python loop over members: the code users write."""
    x, y = _data("A", device)
    models = _members(mlp, n, device)
    opts = [torch.optim.Adam(m.parameters()) for m in models]

    def step() -> None:
        for model, opt in zip(models, opts, strict=True):
            opt.zero_grad()
            F.binary_cross_entropy(model(x), y).backward()
            opt.step()

    return step


def a_merged(n: int, device: torch.device) -> Step:
    """Hand-merged rewrite: one wide model whose second weight is block-diagonal under a mask."""
    x, y = _data("A", device)
    fc1, fc2 = nn.Linear(2, n * 20).to(device), nn.Linear(n * 20, n).to(device)
    # Row i may only see hidden units i*20 .. i*20+19, so the N blocks never mix.
    mask = torch.kron(torch.eye(n, device=device), torch.ones(1, 20, device=device))
    with torch.no_grad():
        fc2.weight.mul_(mask)
    opt = torch.optim.Adam([*fc1.parameters(), *fc2.parameters()])

    def step() -> None:
        opt.zero_grad()
        F.binary_cross_entropy(torch.sigmoid(fc2(fc1(x))), y.expand(5, n)).backward()
        fc2.weight.grad.mul_(mask)
        opt.step()

    return step


def a_torchfunc(n: int, device: torch.device) -> Step:
    """The bare torch.func recipe: ``stack_module_state`` + ``functional_call`` + ``vmap``."""
    x, y = _data("A", device)
    params, buffers, base = _functional(_members(mlp, n, device))

    def member_loss(p: dict, b: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy(functional_call(base, (p, b), (x,)), y)

    losses = vmap(member_loss, in_dims=(0, 0, None, None))
    return _train(params.values(), lambda: losses(params, buffers, x, y).sum())


def a_baddbmm(n: int, device: torch.device) -> Step:
    """Hand-written batched-matmul ensemble: stacked leaf weights, one ``baddbmm`` per layer."""
    x, y = _data("A", device)
    w1, b1, w2, b2 = leaves = _stacked_linears(_members(mlp, n, device))
    xs, ys = x.expand(n, 5, 2), y.expand(n, 5, 1)

    def forward_loss() -> torch.Tensor:
        out = torch.sigmoid(torch.baddbmm(b2, torch.baddbmm(b1, xs, w1), w2))
        return F.binary_cross_entropy(out, ys, reduction="none").mean((1, 2)).sum()

    return _train(leaves, forward_loss)


WORKLOAD_A: dict[str, StepFactory] = {
    "naive": a_naive,
    "merged": a_merged,
    "torchfunc": a_torchfunc,
    "baddbmm": a_baddbmm,
    "vmapens_eager": functools.partial(_vmapens_step, "A", compile=False),
    "vmapens_compiled": functools.partial(_vmapens_step, "A", compile=True),
}


# --- Workload B ---------------------------------------------------------------------------------


class NaiveHeads(nn.Module):
    """The naive ensemble model: an ``nn.ModuleList`` looped over in every forward."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.networks = nn.ModuleList(head() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([net(x) for net in self.networks])


def b_naive(n: int, device: torch.device, loss: str) -> Step:
    """``NaiveHeads`` with one Adam."""
    x, y = _data("B", device)
    model = NaiveHeads(n).to(device)
    return _train(model.parameters(), lambda: _loss_b(model(x), y, loss))


def b_grouped_conv(n: int, device: torch.device, loss: str) -> Step:
    """The usual hand-merged answer: grouped 1x1 ``Conv1d`` layers, one group per head."""
    x, y = _data("B", device)
    model = nn.Sequential(
        nn.Conv1d(16 * n, 32 * n, kernel_size=1, groups=n),
        nn.Tanh(),
        nn.Conv1d(32 * n, 4 * n, kernel_size=1, groups=n),
    ).to(device)
    xs = x.repeat(1, n).unsqueeze(-1)  # [B, 16 * n, 1]: every group sees the whole input
    forward = lambda: model(xs).reshape(-1, n, 4).transpose(0, 1)  # noqa: E731
    return _train(model.parameters(), lambda: _loss_b(forward(), y, loss))


def b_torchfunc(n: int, device: torch.device, loss: str) -> Step:
    """The bare torch.func recipe, vmapping the forward only; the loss sees ``[heads, B, 4]``."""
    x, y = _data("B", device)
    params, buffers, base = _functional(_members(head, n, device))
    forward = vmap(lambda p, b, x: functional_call(base, (p, b), (x,)), in_dims=(0, 0, None))
    return _train(params.values(), lambda: _loss_b(forward(params, buffers, x), y, loss))


def b_baddbmm(n: int, device: torch.device, loss: str) -> Step:
    """Hand-written batched-matmul heads."""
    x, y = _data("B", device)
    w1, b1, w2, b2 = leaves = _stacked_linears(_members(head, n, device))
    xs = x.expand(n, *x.shape)
    forward = lambda: torch.baddbmm(b2, torch.tanh(torch.baddbmm(b1, xs, w1)), w2)  # noqa: E731
    return _train(leaves, lambda: _loss_b(forward(), y, loss))


def b_vmapens_eager(n: int, device: torch.device, loss: str) -> Step:
    """vmapens without compilation; the loss on the mean is written by hand on ``ens(x)``."""
    if loss == "per_head":
        return _vmapens_step("B", n, device, compile=False)
    import vmapens
    from vmapens.optim import StackedAdam

    x, y = _data("B", device)
    ens = vmapens.Ensemble(lambda: head().to(device), n, seed=0)
    opt = StackedAdam(ens)

    def step() -> None:
        opt.zero_grad()
        F.mse_loss(ens(x).mean(0), y).backward()
        opt.step()

    return step


def b_vmapens_compiled(n: int, device: torch.device, loss: str) -> Step:
    """vmapens ``make_step(compile=True)``: per-head losses even in the mean variant."""
    return _vmapens_step("B", n, device, compile=True)


_B = [b_naive, b_grouped_conv, b_torchfunc, b_baddbmm, b_vmapens_eager, b_vmapens_compiled]
#: Workload B factories by loss variant ("mean": MSE of the averaged output, "per_head": summed
#: per-head MSE), then by implementation.
WORKLOAD_B: dict[str, dict[str, StepFactory]] = {
    loss: {f.__name__[2:]: functools.partial(f, loss=loss) for f in _B}
    for loss in ("mean", "per_head")
}


def vmapens_api_missing() -> str | None:
    """Return why the vmapens rows cannot run yet (``None`` once the API they need exists)."""
    try:
        import vmapens
        from vmapens.optim import StackedAdam  # noqa: F401
    except ImportError as e:
        return f"vmapens API missing: {e}"
    if not hasattr(getattr(vmapens, "Ensemble", None), "make_step"):
        return "vmapens API missing: Ensemble.make_step"
    return None


# --- Timing and tables -------------------------------------------------------------------------

DEFAULT_SIZES = (1, 5, 15, 64, 256, 1024, 4096)
QUICK_SIZES = (1, 15)
#: time_step settings: a full run of the default sizes stays under 5 minutes on 2 CPU cores.
_CFG = {
    False: {"warmup": 3, "repeats": 5, "min_time_s": 0.2, "min_steps": 3},
    True: {"warmup": 1, "repeats": 3, "min_time_s": 0.02, "min_steps": 2},
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
    """Time one training step: first call apart, then warm-up, then ``repeats`` timed batches.

    Each batch runs ``max(min_steps, min_time_s worth)`` steps so that timer resolution and Python
    jitter do not dominate micro-steps; the median over batches resists outliers.

    Args:
        step: Zero-argument function doing one training step.
        device: Device the step runs on; CUDA is synchronised around every timed region.
        warmup: Untimed calls after the first (lazy optimizer state, recompilations, caches).
        repeats: Number of timed batches.
        min_time_s: Target duration of one batch.
        min_steps: Fewest steps in one batch.

    Returns:
        ``ms`` (median over batches of ms/step), ``min_ms`` (fastest batch: the steadier figure
        on a shared machine), ``first_ms`` (the first call: compile time for a compiled step),
        ``steps`` per batch and ``repeats``.

    Example:
        >>> time_step(lambda: None, repeats=1, min_time_s=0.0)["steps"]
        3
    """
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)

    def timed(k: int) -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(k):
            step()
        sync()
        return (time.perf_counter() - t0) / k

    first = timed(1)
    # The median of single warm-up steps sizes the batches; one step alone is too noisy for that.
    per_step = statistics.median(timed(1) for _ in range(max(warmup, 1)))
    steps = max(min_steps, math.ceil(min_time_s / max(per_step, 1e-7)))
    batches = [timed(steps) * 1e3 for _ in range(repeats)]
    ms, min_ms = statistics.median(batches), min(batches)
    return {"ms": ms, "min_ms": min_ms, "first_ms": first * 1e3, "steps": steps, "repeats": repeats}


def _measure(factory: StepFactory, n: int, device: torch.device, cfg: dict) -> dict:
    try:
        return {"status": "ok", **time_step(factory(n, device), device=device, **cfg)}
    except NOT_AVAILABLE as e:
        return {"status": "n/a", "reason": f"{type(e).__name__}: {e}"}


def run(
    device: torch.device | str = "cpu",
    sizes: Sequence[int] = DEFAULT_SIZES,
    workloads: Sequence[str] = ("A", "B"),
    quick: bool = False,
    threads: int | None = None,
    *,
    memory: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Time every implementation of the chosen workloads in this process.

    Args:
        device: Device to run on.
        sizes: Ensemble sizes N for workload A (workload B always has 128 heads).
        workloads: Any of ``"A"``, ``"B"``.
        quick: Smoke-test mode: sizes ``(1, 15)`` and short timings, under a minute on 2 cores.
        threads: If given, ``torch.set_num_threads(threads)`` for the run, restored afterwards.
        memory: Also run :func:`build_memory` (in a subprocess) and report it.
        log: Called with a progress line before each measurement (e.g. ``print``).

    Returns:
        JSON-serialisable results for :func:`format_table`. A row has ``status`` "ok", "n/a"
        (its vmapens API is missing) or "skipped" (the reference is too big at this N).

    Raises:
        ValueError: If `workloads` or `sizes` is invalid.

    Example:
        >>> print(format_table(run(workloads=("A",), quick=True)))  # doctest: +SKIP
    """
    if not workloads or not set(workloads) <= {"A", "B"}:
        raise ValueError(
            f"run: `workloads` must be a non-empty subset of ('A', 'B'), got {workloads}"
        )
    sizes = sorted(QUICK_SIZES if quick else sizes)
    if not sizes or any(not isinstance(n, int) or n < 1 for n in sizes):
        raise ValueError(f"run: `sizes` must be positive ints, got {sizes}")
    device, cfg, say = torch.device(device), _CFG[quick], log or (lambda _: None)
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    meta = {"torch": torch.__version__, "device": str(device), "quick": quick}
    results: dict[str, Any] = {"meta": {**meta, "threads": torch.get_num_threads()}}
    try:
        if "A" in workloads:
            say("A: naive N=1 (the baseline of S(N))")
            base, rows = _measure(a_naive, 1, device, cfg), []
            for n, (impl, factory) in itertools.product(sizes, WORKLOAD_A.items()):
                if impl == "naive" and n == 1:
                    row = base
                elif impl == "naive" and n > NAIVE_MAX_N:
                    row = {"status": "ok", "ms": n * base["ms"], "extrapolated": True}
                elif impl == "merged" and n > MERGED_MAX_N:
                    row = {"status": "skipped", "reason": f"N > {MERGED_MAX_N}"}
                else:
                    say(f"A: {impl} N={n}")
                    row = _measure(factory, n, device, cfg)
                rows.append({"n": n, "impl": impl, **row})
            results["A"] = {"naive_1_ms": base["ms"], "rows": rows}
        if "B" in workloads:
            rows = []
            for loss, factories in WORKLOAD_B.items():
                for impl, factory in factories.items():
                    if impl == "vmapens_compiled" and loss == "mean":
                        continue  # the same per-head make_step as below, copied to save a compile
                    say(f"B: {impl} loss={loss}")
                    rows.append(
                        {"loss": loss, "impl": impl, **_measure(factory, HEADS, device, cfg)}
                    )
            shared = next(r for r in rows if r["impl"] == "vmapens_compiled")
            rows.insert(len(_B) - 1, {**shared, "loss": "mean", "mark": "+"})
            results["B"] = {"heads": HEADS, "rows": rows}
        if memory:
            say("memory: building vmapens.Ensemble in a subprocess")
            results["memory"] = build_memory()
    finally:
        torch.set_num_threads(old_threads)
    return results


def _cell(row: dict) -> str:
    if row["status"] != "ok":
        return "-" if row["status"] == "skipped" else "n/a"
    return f"{row['ms']:.3g}" + ("*" if row.get("extrapolated") else "") + row.get("mark", "")


def _ratio(num: float | None, den: float | None) -> str:
    return f"{num / den:.3g}" if num and den else "n/a"


def _grid(header: list[str], body: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    return ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *body]]


def _block(rows: list[dict], key: str, refs: list[str], naive: Callable[[Any], Any]) -> list[str]:
    """Two grids for one workload: ms/step per implementation, then speedups and ratios."""
    by = {(r[key], r["impl"]): r for r in rows}
    keys, impls = list(dict.fromkeys(k for k, _ in by)), list(dict.fromkeys(i for _, i in by))
    ms = {k: r["ms"] if r["status"] == "ok" else None for k, r in by.items()}
    vm = {"vmapens_eager": "eager", "vmapens_compiled": "comp"}
    label = key.upper() if key == "n" else key
    out = _grid([label, *impls], [[str(k), *(_cell(by[k, i]) for i in impls)] for k in keys])
    out += ["", "S = t_naive / t; vmapens/ref = t_vmapens / t_ref (< 1: vmapens faster)"]
    head = [label, *(f"S {v}" for v in vm.values()), *(f"{vm[v]}/{r}" for v in vm for r in refs)]
    body = [
        [str(k), *(_ratio(naive(k), ms[k, v]) for v in vm)]
        + [_ratio(ms[k, v], ms[k, r]) for v in vm for r in refs]
        for k in keys
    ]
    first = [by[k, "vmapens_compiled"].get("first_ms") for k in keys]
    first_s = ", ".join(f"{k}: {f / 1e3:.1f}" if f else f"{k}: n/a" for k, f in zip(keys, first))
    return [*out, *_grid(head, body), f"vmapens_compiled first step (compile), s: {first_s}"]


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
    if "memory" in results:
        m = results["memory"]
        out += ["", f"Memory building vmapens.Ensemble({m['n']} x {m['params']:,} params): "]
        if m["status"] == "ok":
            out[-1] += (
                f"peak RSS +{m['peak_mb']:.1f} MB vs stacked + one member "
                f"{m['expected_mb']:.1f} MB (x{m['ratio']:.2f})"
            )
        else:
            out[-1] += f"n/a ({m['reason']})"
    return "\n".join(out)


# --- Memory -------------------------------------------------------------------------------------


def wide_mlp(hidden: int = 1024) -> nn.Sequential:
    """Memory-test member: ``Linear(512, hidden) -> ReLU -> Linear(hidden, 512)``, ~1M params."""
    return nn.Sequential(nn.Linear(512, hidden), nn.ReLU(), nn.Linear(hidden, 512))


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field + ":")).split()[1]) * 1024


def _build_memory_here(n: int, hidden: int) -> dict:
    """Child side of :func:`build_memory`: must run in a fresh process for a clean peak."""
    params = sum(p.numel() for p in wide_mlp(hidden).parameters())
    report = {"n": n, "hidden": hidden, "params": params, "expected_mb": (n + 1) * params / 2**18}
    try:
        import vmapens

        # Writing 5 resets VmHWM to the current RSS, so the peak excludes importing torch.
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status_bytes("VmRSS")
        ens = vmapens.Ensemble(functools.partial(wide_mlp, hidden), n, seed=0)
        peak = (_status_bytes("VmHWM") - before) / 2**20
    except NOT_AVAILABLE as e:
        return {**report, "status": "n/a", "reason": f"{type(e).__name__}: {e}"}
    del ens
    return {**report, "status": "ok", "peak_mb": peak, "ratio": peak / report["expected_mb"]}


def build_memory(n: int = 64, hidden: int = 1024) -> dict:
    """Peak RSS increase while building ``vmapens.Ensemble`` of ``n`` ~1M-parameter MLPs.

    The build runs in a fresh ``sys.executable`` subprocess so that earlier allocations of this
    process cannot hide its peak. The ideal is the stacked float32 parameters plus one member;
    building every member before stacking peaks near twice the stacked size. Linux only.

    Args:
        n: Number of members.
        hidden: Hidden width of :func:`wide_mlp` (1024 gives 1,050,112 parameters).

    Returns:
        ``status`` ("ok" or "n/a" with ``reason``), ``peak_mb``, ``expected_mb`` (stacked plus
        one member), ``ratio`` (peak / expected), ``n``, ``hidden``, ``params`` per member.

    Raises:
        ValueError: If `n` or `hidden` is not a positive int.
        RuntimeError: If the subprocess fails.

    Example:
        >>> build_memory(4, hidden=64)["n"]
        4
    """
    for name, value in (("n", n), ("hidden", hidden)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"build_memory: `{name}` must be a positive int, got {value!r}")
    code = (
        "import json; from vmapens.bench import _build_memory_here; "
        f"print(json.dumps(_build_memory_here({n}, {hidden})))"
    )
    # The child must import this very package even from an uninstalled checkout.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"build_memory: subprocess failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
