"""Workloads and reference implementations shared by ``python -m vmapens bench`` and ``bench/``.

Every implementation is a *step factory*: ``factory(n, device)`` builds the models, optimizer and
data once and returns a zero-argument function doing one full training step (forward, loss,
backward, optimizer step). All rows of a table are timed in one process, so every ratio compares
numbers taken under the same conditions. The workloads are described in ``WORKLOADS.md``.

Example:
    >>> from vmapens.bench import WORKLOAD_A, time_step
    >>> step = WORKLOAD_A["torchfunc"](15, torch.device("cpu"))
    >>> time_step(step, repeats=1, min_time_s=0.0).ms > 0
    True
"""

from __future__ import annotations

import copy
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
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


class MLP(nn.Module):
    """Workload A member: ``Linear(2, 20) -> Linear(20, 1) -> sigmoid``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, 20)
        self.fc2 = nn.Linear(20, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.fc2(self.fc1(x)))


class Head(nn.Module):
    """Workload B member: ``Linear(16, 32) -> Tanh -> Linear(32, 4)``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def _data_a(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(5, 2, device=device), torch.ones(5, 1, device=device)


def _data_b(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(256, 16, device=device), torch.randn(256, 4, device=device)


def _members(cls: type[nn.Module], n: int, device: torch.device) -> list[nn.Module]:
    return [cls().to(device) for _ in range(n)]


def _ensemble(cls: type[nn.Module], n: int, device: torch.device) -> Any:
    import vmapens

    # Members are built on `device` by the factory, so no assumption about Ensemble.to is needed.
    return vmapens.Ensemble(lambda: cls().to(device), n, seed=0)


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
    """Stack members' ``fc1``, ``fc2`` as baddbmm leaves ``W [n, in, out]``, ``b [n, 1, out]``."""
    leaves = []
    for name in ("fc1", "fc2"):
        layers = [getattr(m, name) for m in members]
        leaves.append(torch.stack([lin.weight.detach().t() for lin in layers]))
        leaves.append(torch.stack([lin.bias.detach()[None] for lin in layers]))
    return [t.contiguous().requires_grad_() for t in leaves]


def _functional(members: list[nn.Module]) -> tuple[dict, dict, nn.Module]:
    """The torch.func recipe: stacked fresh leaves plus a stateless meta-device template."""
    params, buffers = stack_module_state(members)
    return params, buffers, copy.deepcopy(members[0]).to("meta")


# --- Workload A ---------------------------------------------------------------------------------


def a_naive(n: int, device: torch.device) -> Step:
    """N modules, N ``torch.optim.Adam``, a Python loop over members: the code users write."""
    x, y = _data_a(device)
    models = _members(MLP, n, device)
    opts = [torch.optim.Adam(m.parameters()) for m in models]
    bce = nn.BCELoss()

    def step() -> None:
        for model, opt in zip(models, opts, strict=True):
            opt.zero_grad()
            bce(model(x), y).backward()
            opt.step()

    return step


def a_merged(n: int, device: torch.device) -> Step:
    """Hand-merged rewrite: one wide model whose second weight is block-diagonal under a mask."""
    x, y = _data_a(device)
    fc1, fc2 = nn.Linear(2, n * 20).to(device), nn.Linear(n * 20, n).to(device)
    # Row i may only see hidden units i*20 .. i*20+19, so the N blocks never mix.
    mask = torch.kron(torch.eye(n, device=device), torch.ones(1, 20, device=device))
    with torch.no_grad():
        fc2.weight.mul_(mask)
    opt = torch.optim.Adam([*fc1.parameters(), *fc2.parameters()])
    bce, target = nn.BCELoss(), y.expand(5, n)

    def step() -> None:
        opt.zero_grad()
        bce(torch.sigmoid(fc2(fc1(x))), target).backward()
        fc2.weight.grad.mul_(mask)
        opt.step()

    return step


def a_torchfunc(n: int, device: torch.device) -> Step:
    """The bare torch.func recipe: ``stack_module_state`` + ``functional_call`` + ``vmap``."""
    x, y = _data_a(device)
    params, buffers, base = _functional(_members(MLP, n, device))
    bce = nn.BCELoss()

    def member_loss(p: dict, b: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return bce(functional_call(base, (p, b), (x,)), y)

    losses = vmap(member_loss, in_dims=(0, 0, None, None))
    return _train(params.values(), lambda: losses(params, buffers, x, y).sum())


def a_baddbmm(n: int, device: torch.device) -> Step:
    """Hand-written batched-matmul ensemble: stacked leaf weights, one ``baddbmm`` per layer."""
    x, y = _data_a(device)
    w1, b1, w2, b2 = leaves = _stacked_linears(_members(MLP, n, device))
    xs, ys = x.expand(n, 5, 2), y.expand(n, 5, 1)

    def forward_loss() -> torch.Tensor:
        out = torch.sigmoid(torch.baddbmm(b2, torch.baddbmm(b1, xs, w1), w2))
        return F.binary_cross_entropy(out, ys, reduction="none").mean((1, 2)).sum()

    return _train(leaves, forward_loss)


def _vmapens_a(n: int, device: torch.device, *, compile: bool) -> Step:
    from vmapens.optim import StackedAdam

    x, y = _data_a(device)
    ens = _ensemble(MLP, n, device)
    step = ens.make_step(nn.BCELoss(), StackedAdam(ens), compile=compile)
    return lambda: step(x, y)


a_vmapens_eager = functools.partial(_vmapens_a, compile=False)
a_vmapens_compiled = functools.partial(_vmapens_a, compile=True)

WORKLOAD_A: dict[str, StepFactory] = {
    "naive": a_naive,
    "merged": a_merged,
    "torchfunc": a_torchfunc,
    "baddbmm": a_baddbmm,
    "vmapens_eager": a_vmapens_eager,
    "vmapens_compiled": a_vmapens_compiled,
}


# --- Workload B ---------------------------------------------------------------------------------


class NaiveHeads(nn.Module):
    """The naive ensemble model: an ``nn.ModuleList`` looped over in every forward."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.networks = nn.ModuleList(Head() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([net(x) for net in self.networks])


def b_naive(n: int, device: torch.device, *, loss: str = "mean") -> Step:
    """``NaiveHeads`` with one Adam."""
    x, y = _data_b(device)
    model = NaiveHeads(n).to(device)
    return _train(model.parameters(), lambda: _loss_b(model(x), y, loss))


def b_grouped_conv(n: int, device: torch.device, *, loss: str = "mean") -> Step:
    """The usual hand-merged answer: grouped 1x1 ``Conv1d`` layers, one group per head."""
    x, y = _data_b(device)
    model = nn.Sequential(
        nn.Conv1d(16 * n, 32 * n, kernel_size=1, groups=n),
        nn.Tanh(),
        nn.Conv1d(32 * n, 4 * n, kernel_size=1, groups=n),
    ).to(device)
    xs = x.repeat(1, n).unsqueeze(-1)  # [B, 16 * n, 1]: every group sees the whole input

    def forward_loss() -> torch.Tensor:
        out = model(xs).reshape(-1, n, 4).transpose(0, 1)
        return _loss_b(out, y, loss)

    return _train(model.parameters(), forward_loss)


def b_torchfunc(n: int, device: torch.device, *, loss: str = "mean") -> Step:
    """The bare torch.func recipe, vmapping the forward only; the loss sees ``[heads, B, 4]``."""
    x, y = _data_b(device)
    params, buffers, base = _functional(_members(Head, n, device))

    def fmodel(p: dict, b: dict, x: torch.Tensor) -> torch.Tensor:
        return functional_call(base, (p, b), (x,))

    forward = vmap(fmodel, in_dims=(0, 0, None))
    return _train(params.values(), lambda: _loss_b(forward(params, buffers, x), y, loss))


def b_baddbmm(n: int, device: torch.device, *, loss: str = "mean") -> Step:
    """Hand-written batched-matmul heads."""
    x, y = _data_b(device)
    w1, b1, w2, b2 = leaves = _stacked_linears(_members(Head, n, device))
    xs = x.expand(n, *x.shape)

    def forward_loss() -> torch.Tensor:
        out = torch.baddbmm(b2, torch.tanh(torch.baddbmm(b1, xs, w1)), w2)
        return _loss_b(out, y, loss)

    return _train(leaves, forward_loss)


def b_vmapens_eager(n: int, device: torch.device, *, loss: str = "mean") -> Step:
    """vmapens without compilation; the mean loss is written by hand on ``ens(x)``."""
    from vmapens.optim import StackedAdam

    if loss == "per_head":
        return _vmapens_b_step(n, device, compile=False)
    x, y = _data_b(device)
    ens = _ensemble(Head, n, device)
    opt = StackedAdam(ens)

    def step() -> None:
        opt.zero_grad()
        F.mse_loss(ens(x).mean(0), y).backward()
        opt.step()

    return step


def b_vmapens_compiled(n: int, device: torch.device, *, loss: str = "mean") -> Step:
    """vmapens ``make_step(compile=True)``; it trains per-head losses even in the mean variant."""
    return _vmapens_b_step(n, device, compile=True)


def _vmapens_b_step(n: int, device: torch.device, *, compile: bool) -> Step:
    from vmapens.optim import StackedAdam

    x, y = _data_b(device)
    ens = _ensemble(Head, n, device)
    step = ens.make_step(nn.MSELoss(), StackedAdam(ens), compile=compile)
    return lambda: step(x, y)


_B = {
    "naive": b_naive,
    "grouped_conv": b_grouped_conv,
    "torchfunc": b_torchfunc,
    "baddbmm": b_baddbmm,
    "vmapens_eager": b_vmapens_eager,
    "vmapens_compiled": b_vmapens_compiled,
}
#: Workload B factories by loss variant ("mean": MSE of the averaged output, "per_head": summed
#: per-head MSE), then by implementation.
WORKLOAD_B: dict[str, dict[str, StepFactory]] = {
    loss: {name: functools.partial(f, loss=loss) for name, f in _B.items()}
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


# --- Timing -------------------------------------------------------------------------------------


@dataclass
class Timing:
    """Result of :func:`time_step`.

    Attributes:
        ms: Median over repeats of the mean milliseconds per step.
        first_ms: Milliseconds of the very first call (compile time for compiled steps).
        steps: Steps per timed repeat.
        repeats: Number of timed repeats.
    """

    ms: float
    first_ms: float
    steps: int
    repeats: int


def time_step(
    step: Step,
    *,
    device: torch.device | str = "cpu",
    warmup: int = 3,
    repeats: int = 5,
    min_time_s: float = 0.2,
    min_steps: int = 3,
) -> Timing:
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
        The :class:`Timing`.

    Example:
        >>> time_step(lambda: None, repeats=1, min_time_s=0.0).steps
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
    for _ in range(warmup):
        step()
    steps = max(min_steps, math.ceil(min_time_s / max(timed(1), 1e-7)))
    ms = statistics.median(timed(steps) for _ in range(repeats)) * 1e3
    return Timing(ms=ms, first_ms=first * 1e3, steps=steps, repeats=repeats)


def _measure(factory: StepFactory, n: int, device: torch.device, cfg: dict) -> dict:
    try:
        return {"status": "ok", **asdict(time_step(factory(n, device), device=device, **cfg))}
    except NOT_AVAILABLE as e:
        return {"status": "n/a", "reason": f"{type(e).__name__}: {e}"}


# --- Tables -------------------------------------------------------------------------------------

DEFAULT_SIZES = (1, 5, 15, 64, 256, 1024, 4096)
QUICK_SIZES = (1, 15)
_CFG = {
    False: {"warmup": 3, "repeats": 5, "min_time_s": 0.2, "min_steps": 3},
    True: {"warmup": 1, "repeats": 3, "min_time_s": 0.02, "min_steps": 2},
}
_LABEL = {
    "naive": "naive",
    "merged": "merged",
    "grouped_conv": "groupconv",
    "torchfunc": "torchfunc",
    "baddbmm": "baddbmm",
    "vmapens_eager": "vmapens",
    "vmapens_compiled": "vmapens+c",
}


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
        memory: Also run :func:`build_memory` (a subprocess) and report it.
        log: Called with a progress line before each measurement (e.g. ``print``).

    Returns:
        JSON-serialisable results, rendered by :func:`format_table`. Rows whose vmapens API is
        missing have ``status == "n/a"``.

    Raises:
        ValueError: If `workloads` or `sizes` is invalid.

    Example:
        >>> print(format_table(run(workloads=("A",), quick=True)))  # doctest: +SKIP
    """
    if not set(workloads) <= {"A", "B"} or not workloads:
        raise ValueError(
            f"run: `workloads` must be a non-empty subset of ('A', 'B'), got {workloads}"
        )
    sizes = QUICK_SIZES if quick else tuple(sizes)
    if not sizes or any(not isinstance(n, int) or n < 1 for n in sizes):
        raise ValueError(f"run: `sizes` must be positive ints, got {sizes}")
    device, cfg, say = torch.device(device), _CFG[quick], log or (lambda _: None)
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    results: dict[str, Any] = {
        "meta": {
            "torch": torch.__version__,
            "device": str(device),
            "quick": quick,
            "threads": torch.get_num_threads(),
        },
    }
    try:
        if "A" in workloads:
            say("A: naive N=1 (baseline)")
            base = _measure(a_naive, 1, device, cfg)
            rows = []
            for n in sorted(sizes):
                for impl, factory in WORKLOAD_A.items():
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
            results["A"] = {"sizes": sorted(sizes), "naive_1_ms": base["ms"], "rows": rows}
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
            rows.insert(len(_B) - 1, {**shared, "loss": "mean", "per_head_loss": True})
            results["B"] = {"heads": HEADS, "rows": rows}
        if memory:
            say("memory: building vmapens.Ensemble in a subprocess")
            results["memory"] = build_memory()
    finally:
        torch.set_num_threads(old_threads)
    return results


def _cell(row: dict | None, key: str = "ms") -> str:
    if row is None or row["status"] == "n/a":
        return "n/a"
    if row["status"] == "skipped":
        return "-"
    return f"{row[key]:.3g}" + ("*" if row.get("extrapolated") else "")


def _ratio(num: dict | None, den: dict | None) -> str:
    if not num or not den or num["status"] != "ok" or den["status"] != "ok":
        return "n/a"
    return f"{num['ms'] / den['ms']:.3g}"


def _grid(header: list[str], body: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    return ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *body]]


def format_table(results: dict) -> str:
    """Render :func:`run` results as plain-text tables.

    Args:
        results: What :func:`run` returned (or its JSON round-trip).

    Returns:
        The tables, one block per workload, with footnotes.
    """
    meta = results["meta"]
    out = [
        f"vmapens bench: torch {meta['torch']}, {meta['device']}, {meta['threads']} threads"
        + (", quick" if meta["quick"] else "")
    ]
    refs = {"A": ["merged", "torchfunc", "baddbmm"], "B": ["grouped_conv", "torchfunc", "baddbmm"]}
    vm = {"vmapens_eager": "eager", "vmapens_compiled": "comp"}
    if "A" in results:
        a = results["A"]
        by = {(r["n"], r["impl"]): r for r in a["rows"]}
        out += ["", "Workload A: N MLPs Linear(2,20)->Linear(20,1)->sigmoid, BCE, Adam; ms/step"]
        out += _grid(
            ["N", *(_LABEL[i] for i in WORKLOAD_A)],
            [[str(n), *(_cell(by[n, i]) for i in WORKLOAD_A)] for n in a["sizes"]],
        )
        out += [
            f"* extrapolated as N * t_naive(1) beyond N = {NAIVE_MAX_N}; "
            f"- merged not run beyond N = {MERGED_MAX_N} (dense N x 20N mask)",
            "",
            "S(N) = N * t_naive(1) / t; vmapens/ref = t_vmapens / t_ref (< 1: vmapens faster)",
        ]
        body = []
        for n in a["sizes"]:
            s = [
                f"{n * a['naive_1_ms'] / by[n, v]['ms']:.3g}"
                if by[n, v]["status"] == "ok"
                else "n/a"
                for v in vm
            ]
            body.append([str(n), *s, *(_ratio(by[n, v], by[n, r]) for v in vm for r in refs["A"])])
        out += _grid(
            ["N", "S eager", "S comp", *(f"{vm[v]}/{r}" for v in vm for r in refs["A"])], body
        )
        first = [f"N={n}: {_cell(by[n, 'vmapens_compiled'], 'first_ms')} ms" for n in a["sizes"]]
        out.append("vmapens compile time to first step: " + ", ".join(first))
    if "B" in results:
        b = results["B"]
        by = {(r["loss"], r["impl"]): r for r in b["rows"]}
        losses = list(WORKLOAD_B)
        out += [
            "",
            f"Workload B: {b['heads']} heads Linear(16,32)->Tanh->Linear(32,4), batch 256, "
            "Adam; ms/step",
        ]
        body = [
            [
                loss,
                *(
                    _cell(by[loss, i]) + ("+" if by[loss, i].get("per_head_loss") else "")
                    for i in _B
                ),
            ]
            for loss in losses
        ]
        out += _grid(["loss", *(_LABEL[i] for i in _B)], body)
        out += [
            "+ per-head MSE (make_step takes a per-member loss), same run as the per_head row",
            "",
            "S = t_naive / t; vmapens/ref = t_vmapens / t_ref (< 1: vmapens faster)",
        ]
        body = [
            [
                loss,
                *(_ratio(by[loss, "naive"], by[loss, v]) for v in vm),
                *(_ratio(by[loss, v], by[loss, r]) for v in vm for r in refs["B"]),
            ]
            for loss in losses
        ]
        out += _grid(
            ["loss", "S eager", "S comp", *(f"{vm[v]}/{r}" for v in vm for r in refs["B"])], body
        )
        out.append(
            "vmapens compile time to first step: "
            f"{_cell(by['per_head', 'vmapens_compiled'], 'first_ms')} ms"
        )
    if "memory" in results:
        m = results["memory"]
        out += [
            "",
            f"Memory building vmapens.Ensemble({m.get('n')} x {m.get('params')} params): "
            + (
                f"peak RSS +{m['peak_mb']:.1f} MB vs stacked + one member "
                f"{m['expected_mb']:.1f} MB (x{m['ratio']:.2f})"
                if m["status"] == "ok"
                else f"n/a ({m.get('reason')})"
            ),
        ]
    return "\n".join(out)


# --- Memory -------------------------------------------------------------------------------------


class WideMLP(nn.Module):
    """Memory-test member: ``Linear(512, hidden) -> ReLU -> Linear(hidden, 512)``, ~1M params."""

    def __init__(self, hidden: int = 1024) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(512, hidden), nn.ReLU(), nn.Linear(hidden, 512))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _build_memory_here(n: int, hidden: int) -> dict:
    """Child side of :func:`build_memory`: must run in a fresh process for a clean peak."""
    params = sum(p.numel() for p in WideMLP(hidden).parameters())
    mb = 4 * params / 2**20
    report = {"n": n, "hidden": hidden, "params": params, "expected_mb": (n + 1) * mb}
    try:
        import vmapens
    except ImportError as e:
        return {**report, "status": "n/a", "reason": f"ImportError: {e}"}
    # Writing 5 resets VmHWM to the current RSS, so the peak excludes the import of torch.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_bytes("VmRSS")
    try:
        ens = vmapens.Ensemble(functools.partial(WideMLP, hidden), n, seed=0)
    except NOT_AVAILABLE as e:
        return {**report, "status": "n/a", "reason": f"{type(e).__name__}: {e}"}
    peak = (_status_bytes("VmHWM") - before) / 2**20
    del ens
    return {**report, "status": "ok", "peak_mb": peak, "ratio": peak / report["expected_mb"]}


def build_memory(n: int = 64, hidden: int = 1024) -> dict:
    """Peak RSS increase while building ``vmapens.Ensemble`` of ``n`` ~1M-parameter MLPs.

    The build runs in a fresh ``sys.executable`` subprocess so that allocations of earlier work
    in this process do not hide its peak. The ideal is the stacked parameters plus one member
    (the template is built, copied into the stack, and freed); building all members first and
    then stacking peaks at about twice the stacked size. Linux only (reads ``/proc``).

    Args:
        n: Number of members.
        hidden: Hidden width of :class:`WideMLP` (1024 gives 1,050,112 parameters).

    Returns:
        ``status`` ("ok" or "n/a"), ``peak_mb``, ``expected_mb`` (stacked + one member, float32),
        ``ratio`` (peak / expected), ``n``, ``hidden``, ``params`` per member.

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
    # The child must import this very package even when it is not installed.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"build_memory: subprocess failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
