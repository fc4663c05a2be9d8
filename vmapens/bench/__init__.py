"""Workloads and reference implementations shared by ``python -m vmapens bench`` and ``bench/``.

Every implementation is a *step factory*: ``factory(n, device)`` builds the models, optimizer and
data once and returns a zero-argument function doing one full training step (forward, loss,
backward, optimizer step); the ``WORKLOAD_OPTIM`` factories return the optimizer step alone, on
fixed gradients. All rows of a table are timed in one process, so every ratio compares numbers
taken under the same conditions; the optimizer rows are even timed in interleaved rounds.
Timing, grids and RSS readings live in :mod:`vmapens.bench._tools`.

Example:
    >>> from vmapens.bench import WORKLOAD_A, time_rounds
    >>> step = WORKLOAD_A["torchfunc"](15, torch.device("cpu"))
    >>> time_rounds({"torchfunc": step}, repeats=1, min_time_s=0.0)["torchfunc"]["ms"] > 0
    True
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

from ..ensemble import Ensemble
from ..optim import StackedAdam
from ..step import make_step
from ._tools import (
    NOT_AVAILABLE,
    Step,
    cell,
    child_json,
    grid,
    ratio,
    reset_peak_rss,
    rss_bytes,
    time_rounds,
)

StepFactory = Callable[[int, torch.device], Step]
_ModuleT = TypeVar("_ModuleT", bound=nn.Module)

#: Largest N at which the naive loop is timed; beyond it t(N) is extrapolated as N * t(1).
NAIVE_MAX_N = 64
#: Largest N for the hand-merged model: its masked weight is dense, O(N^2) memory and time.
MERGED_MAX_N = 1024
#: Number of heads in workload B.
HEADS = 128


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


def _members(factory: Callable[[], _ModuleT], n: int, device: torch.device) -> list[_ModuleT]:
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


def _stacked_linears(members: list[nn.Sequential]) -> list[torch.Tensor]:
    """Stack members' two ``Linear`` as baddbmm leaves ``W [n, in, out]``, ``b [n, 1, out]``."""
    layers = [[m for m in member if isinstance(m, nn.Linear)] for member in members]
    leaves = []
    for i in (0, 1):
        leaves.append(torch.stack([ls[i].weight.detach().t() for ls in layers]))
        leaves.append(torch.stack([ls[i].bias.detach()[None] for ls in layers]))
    return [t.contiguous().requires_grad_() for t in leaves]


def _functional(members: Sequence[nn.Module]) -> tuple[dict, dict, nn.Module]:
    """The torch.func recipe: stacked fresh leaves plus a stateless meta-device template."""
    params, buffers = stack_module_state(members)
    return params, buffers, copy.deepcopy(members[0]).to("meta")


def _vmapens_step(workload: str, n: int, device: torch.device, *, compile: bool) -> Step:
    """vmapens ``make_step`` with the per-member loss (BCE for A, MSE for B)."""
    x, y = _data(workload, device)
    member, loss_fn = (mlp, nn.BCELoss()) if workload == "A" else (head, nn.MSELoss())
    # Members are built on `device` by the factory, so nothing is assumed about Ensemble.to.
    ens = Ensemble(lambda: member().to(device), n, seed=0)
    step = make_step(ens, loss_fn, StackedAdam(ens), compile=compile)
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
        assert fc2.weight.grad is not None  # backward() just filled it
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
    x, y = _data("B", device)
    ens = Ensemble(lambda: head().to(device), n, seed=0)
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


# --- Optimizer step -----------------------------------------------------------------------------
# Only ``opt.step()`` is timed, on workload A's stacked parameters with gradients fixed once.


def _graded_ensemble(n: int, device: torch.device) -> nn.Module:
    """Workload A's ``Ensemble(mlp, n, seed=0)``, each parameter with a fixed random gradient."""
    ens = Ensemble(lambda: mlp().to(device), n, seed=0)
    gen = torch.Generator().manual_seed(0)
    for p in ens.parameters():
        p.grad = torch.randn(p.shape, generator=gen).to(device)
    return ens


def _member_lrs(n: int) -> torch.Tensor:
    return torch.logspace(-4, -1, n)


def o_stacked_adam(n: int, device: torch.device) -> Step:
    """``vmapens.StackedAdam`` with one shared learning rate."""
    return StackedAdam(_graded_ensemble(n, device)).step


def o_stacked_adam_per_member_lr(n: int, device: torch.device) -> Step:
    """``vmapens.StackedAdam`` with one learning rate per member, ``logspace(-4, -1, n)``."""
    return StackedAdam(_graded_ensemble(n, device), lr=_member_lrs(n)).step


def o_foreach_adam(n: int, device: torch.device) -> Step:
    """``torch.optim.Adam(foreach=True)`` on the same stacked tensors: one shared lr only."""
    return torch.optim.Adam(_graded_ensemble(n, device).parameters(), foreach=True).step


def o_per_member_groups(n: int, device: torch.device) -> Step:
    """The usual workaround for per-member learning rates: one Adam param group per member.

    A view ``p[i]`` of a stacked leaf is not a leaf, so each member owns separate leaf tensors
    (copies of its slices, with its slices of the gradients); ``torch.optim.Adam`` keeps its
    defaults (a per-tensor loop on CPU, foreach within each group on CUDA).
    """
    stacked = list(_graded_ensemble(n, device).parameters())
    groups = []
    for i, lr in enumerate(_member_lrs(n).tolist()):
        leaves = [p[i].detach().clone().requires_grad_() for p in stacked]
        for leaf, p in zip(leaves, stacked, strict=True):
            assert p.grad is not None  # _graded_ensemble gave every parameter one
            leaf.grad = p.grad[i].clone()
        groups.append({"params": leaves, "lr": lr})
    return torch.optim.Adam(groups).step


#: Optimizer-step factories by implementation.
WORKLOAD_OPTIM: dict[str, StepFactory] = {
    f.__name__[2:]: f
    for f in (o_stacked_adam, o_stacked_adam_per_member_lr, o_foreach_adam, o_per_member_groups)
}


# --- Timing and tables -------------------------------------------------------------------------

DEFAULT_SIZES = (1, 5, 15, 64, 256, 1024, 4096)
QUICK_SIZES = (1, 15)
WORKLOADS = ("A", "B", "optim")
#: Ensemble sizes of the optimizer-step workload (quick mode: the first only).
OPTIM_SIZES = (15, 256, 1024)
#: time_rounds settings: a full run of the default sizes stays under 5 minutes on 2 CPU cores.
_CFG = {
    False: {"warmup": 3, "repeats": 5, "min_time_s": 0.2, "min_steps": 3},
    True: {"warmup": 1, "repeats": 3, "min_time_s": 0.02, "min_steps": 2},
}


def _measure_rounds(
    factories: dict[str, StepFactory], n: int, device: torch.device, cfg: dict
) -> dict[str, dict]:
    """Time the factories' steps interleaved (:func:`time_rounds`): their ratios share a load."""
    steps, out = {}, {}
    for impl, factory in factories.items():
        try:
            steps[impl] = factory(n, device)
        except NOT_AVAILABLE as e:
            out[impl] = {"status": "n/a", "reason": f"{type(e).__name__}: {e}"}
    timed = time_rounds(steps, device=device, **cfg) if steps else {}
    return {impl: out.get(impl) or {"status": "ok", **timed[impl]} for impl in factories}


def run(
    device: torch.device | str = "cpu",
    sizes: Sequence[int] = DEFAULT_SIZES,
    workloads: Sequence[str] = WORKLOADS,
    quick: bool = False,
    threads: int | None = None,
    *,
    optim_sizes: Sequence[int] = OPTIM_SIZES,
    memory: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Time every implementation of the chosen workloads in this process.

    Args:
        device: Device to run on.
        sizes: Ensemble sizes N for workload A (workload B always has 128 heads).
        workloads: Any of ``"A"``, ``"B"``, ``"optim"`` (the optimizer step alone).
        quick: Smoke-test mode: sizes ``(1, 15)`` and short timings, under a minute on 2 cores.
        threads: If given, ``torch.set_num_threads(threads)`` for the run, restored afterwards.
        optim_sizes: Ensemble sizes N for the ``"optim"`` workload.
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
    if not workloads or not set(workloads) <= set(WORKLOADS):
        raise ValueError(
            f"run: `workloads` must be a non-empty subset of {WORKLOADS}, got {workloads}"
        )
    sizes = sorted(QUICK_SIZES if quick else sizes)
    optim_sizes = sorted(OPTIM_SIZES[:1] if quick else optim_sizes)
    for name, ns in (("sizes", sizes), ("optim_sizes", optim_sizes)):
        if not ns or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in ns):
            raise ValueError(f"run: `{name}` must be positive ints, got {ns}")
    device, cfg, say = torch.device(device), _CFG[quick], log or (lambda _: None)
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    meta = {"torch": torch.__version__, "device": str(device), "quick": quick}
    results: dict[str, Any] = {"meta": {**meta, "threads": torch.get_num_threads()}}
    try:
        if "A" in workloads:
            # All implementations at one N are timed interleaved: their ratios share a load.
            # S(N)'s baseline: the naive N=1 step (sizes are sorted, so N=1 comes first).
            base = (
                None if 1 in sizes else _measure_rounds({"naive": a_naive}, 1, device, cfg)["naive"]
            )
            rows = []
            for n in sizes:
                skip = {"naive": n > NAIVE_MAX_N, "merged": n > MERGED_MAX_N}
                here = {k: f for k, f in WORKLOAD_A.items() if not skip.get(k)}
                say(f"A: N={n}: {', '.join(here)}, interleaved")
                timed = _measure_rounds(here, n, device, cfg)
                base = base or timed["naive"]
                assert base is not None
                for impl in WORKLOAD_A:
                    if impl in timed:
                        row = timed[impl]
                    elif impl == "naive":
                        row = {"status": "ok", "ms": n * base["ms"], "extrapolated": True}
                    else:
                        row = {"status": "skipped", "reason": f"N > {MERGED_MAX_N}"}
                    rows.append({"n": n, "impl": impl, **row})
            assert base is not None
            results["A"] = {"naive_1_ms": base["ms"], "rows": rows}
        if "B" in workloads:
            rows = []
            for loss, factories in WORKLOAD_B.items():
                # The mean run's compiled row is the per-head make_step: copied, one compile.
                here = {
                    k: f for k, f in factories.items() if (k, loss) != ("vmapens_compiled", "mean")
                }
                say(f"B: loss={loss}: {', '.join(here)}, interleaved")
                timed = _measure_rounds(here, HEADS, device, cfg)
                rows += [{"loss": loss, "impl": impl, **timed[impl]} for impl in here]
            shared = next(r for r in rows if r["impl"] == "vmapens_compiled")
            rows.insert(len(_B) - 1, {**shared, "loss": "mean", "mark": "+"})
            results["B"] = {"heads": HEADS, "rows": rows}
        if "optim" in workloads:
            rows = []
            for n in optim_sizes:
                say(f"optim: {', '.join(WORKLOAD_OPTIM)} N={n}, interleaved")
                timed = _measure_rounds(WORKLOAD_OPTIM, n, device, cfg)
                rows += [{"n": n, "impl": impl, **row} for impl, row in timed.items()]
            results["optim"] = {"rows": rows}
        if memory:
            say("memory: building vmapens.Ensemble in a subprocess")
            results["memory"] = build_memory()
    finally:
        torch.set_num_threads(old_threads)
    return results


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


# --- Memory -------------------------------------------------------------------------------------


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
        "import json; from vmapens.bench import _build_memory_here; "
        f"print(json.dumps(_build_memory_here({n}, {hidden})))"
    )
    return child_json(code, "build_memory")
