"""Every stacked optimizer against torch's foreach implementation on the same stacked tensors.

Only ``opt.step()`` is timed, on workload A's stacked parameters with gradients fixed once
(as for ``WORKLOAD_OPTIM``). The stacked optimizer and ``torch.optim.X(ens.parameters(),
foreach=True)`` see the same ``[n, ...]`` tensors and do the same arithmetic, so their ratio is
the cost of the stacked machinery (per-member step counts, flat buffers, masks). Lion has no
torch twin: its row has no reference.

Example:
    >>> rows = run_optimizers(sizes=(15,), quick=True)
    >>> sorted({r["optimizer"] for r in rows}) == sorted(OPTIMIZER_FACTORIES)
    True
    >>> "stacked/foreach" in format_optimizers(rows)
    True
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from vmapens.optim import (
    StackedAdadelta,
    StackedAdafactor,
    StackedAdagrad,
    StackedAdam,
    StackedAdamax,
    StackedASGD,
    StackedLion,
    StackedMuon,
    StackedNAdam,
    StackedOptimizer,
    StackedRAdam,
    StackedRMSprop,
    StackedRprop,
    StackedSGD,
)

from ._tools import Step, grid, paired_ratio, ratio, time_rounds
from .workloads import StepFactory, _graded_ensemble

#: Per optimizer: the stacked class, its torch twin (None: none) and the arguments both get.
PAIRS: dict[
    str, tuple[type[StackedOptimizer], Callable[..., torch.optim.Optimizer] | None, dict]
] = {
    "sgd": (StackedSGD, torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
    "adam": (StackedAdam, torch.optim.Adam, {}),
    "rmsprop": (StackedRMSprop, torch.optim.RMSprop, {}),
    "adagrad": (StackedAdagrad, torch.optim.Adagrad, {}),
    "adamax": (StackedAdamax, torch.optim.Adamax, {}),
    "nadam": (StackedNAdam, torch.optim.NAdam, {}),
    "lion": (StackedLion, None, {}),
    "radam": (StackedRAdam, torch.optim.RAdam, {}),
    "adadelta": (StackedAdadelta, torch.optim.Adadelta, {}),
    "rprop": (StackedRprop, torch.optim.Rprop, {}),
    "asgd": (StackedASGD, torch.optim.ASGD, {}),
    # torch's foreach Adafactor on the stacked tensors factors and normalises whole stacks,
    # not members: the same kernels on the same sizes, a different (shared) result.
    "adafactor": (StackedAdafactor, torch.optim.Adafactor, {}),
}
#: time_rounds settings (quick: a smoke test).
_CFG: dict[bool, dict[str, Any]] = {
    False: {"warmup": 3, "repeats": 5, "min_time_s": 0.2, "min_steps": 3},
    True: {"warmup": 1, "repeats": 3, "min_time_s": 0.02, "min_steps": 2},
}


def o_stacked(n: int, device: torch.device, *, optimizer: str) -> Step:
    """The stacked optimizer ``optimizer`` (a key of :data:`PAIRS`) over workload A's ensemble."""
    cls, _, kwargs = PAIRS[optimizer]
    return cls(_graded_ensemble(n, device), **kwargs).step


def o_foreach(n: int, device: torch.device, *, optimizer: str) -> Step:
    """torch's twin of ``optimizer`` with ``foreach=True`` on the same stacked tensors."""
    _, twin, kwargs = PAIRS[optimizer]
    assert twin is not None  # OPTIMIZER_FACTORIES has no foreach row without a twin
    return twin(_graded_ensemble(n, device).parameters(), foreach=True, **kwargs).step


def o_stacked_muon(n: int, device: torch.device) -> Step:
    """``StackedMuon`` over workload A's weight matrices (Muon takes matrices only)."""
    return StackedMuon([p for p in _graded_ensemble(n, device).parameters() if p.dim() == 3]).step


def o_loop_muon(n: int, device: torch.device) -> Step:
    """One ``torch.optim.Muon`` per member over its own weight matrices (torch's Muon has no
    foreach form), stepped in a loop: what a Muon sweep does without vmapens."""
    stacked = [p for p in _graded_ensemble(n, device).parameters() if p.dim() == 3]
    opts = []
    for i in range(n):
        leaves = [p[i].detach().clone().requires_grad_() for p in stacked]
        for leaf, p in zip(leaves, stacked, strict=True):
            leaf.grad = p.grad[i].clone()
        opts.append(torch.optim.Muon(leaves))

    def step() -> None:
        for opt in opts:
            opt.step()

    return step


#: Step factories per optimizer: ``stacked`` and, where torch has the optimizer, ``foreach``
#: (Muon: ``loop``, N torch optimizers).
OPTIMIZER_FACTORIES: dict[str, dict[str, StepFactory]] = {
    **{
        name: {
            "stacked": functools.partial(o_stacked, optimizer=name),
            **({"foreach": functools.partial(o_foreach, optimizer=name)} if twin else {}),
        }
        for name, (_, twin, _) in PAIRS.items()
    },
    "muon": {"stacked": o_stacked_muon, "loop": o_loop_muon},
}


def run_optimizers(
    sizes: Sequence[int] = (256, 1024),
    quick: bool = False,
    *,
    device: torch.device | str = "cpu",
    log: Callable[[str], None] | None = None,
) -> list[dict]:
    """Time every optimizer's stacked and foreach steps, interleaved per optimizer and N.

    Args:
        sizes: Ensemble sizes N.
        quick: Smoke-test mode: the first size only, short timings.
        device: Device to run on.
        log: Called with a progress line before each measurement (e.g. ``print``).

    Returns:
        JSON-serialisable rows: ``optimizer``, ``n``, ``impl`` (``stacked``/``foreach``) and
        :func:`~bench._tools.time_rounds`'s fields (``ms``, ``min_ms``, ...).

    Raises:
        ValueError: ``sizes`` is empty or holds a non-positive size.
    """
    if not sizes or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in sizes):
        raise ValueError(f"run_optimizers: `sizes` must be positive ints, got {sizes}")
    device, say = torch.device(device), log or (lambda _: None)
    rows = []
    for n in sizes[:1] if quick else sizes:
        for name, factories in OPTIMIZER_FACTORIES.items():
            say(f"optimizers: {name} N={n}: {', '.join(factories)}, interleaved")
            steps = {impl: factory(n, device) for impl, factory in factories.items()}
            timed = time_rounds(steps, device=device, **_CFG[quick])
            rows += [{"optimizer": name, "n": n, "impl": k, **v} for k, v in timed.items()]
    return rows


def format_optimizers(rows: list[dict]) -> str:
    """:func:`run_optimizers` rows as a grid: median (min) ms per step and stacked/foreach.

    Args:
        rows: What :func:`run_optimizers` returned, or its JSON round-trip.

    Returns:
        Plain text, one line per optimizer and N.
    """
    by = {(r["optimizer"], r["n"], r["impl"]): r for r in rows}
    keys = list(dict.fromkeys((r["optimizer"], r["n"]) for r in rows))

    def timing(key: tuple, impl: str) -> str:
        row = by.get((*key, impl))
        row = row or (by.get((*key, "loop")) if impl == "foreach" else None)
        return f"{row['ms']:.3g} ({row['min_ms']:.3g})" if row else "-"

    def quotient(key: tuple, field: str) -> str:
        num = by.get((*key, "stacked"))
        den = by.get((*key, "foreach")) or by.get((*key, "loop"))
        return ratio(num[field] if num else None, den[field] if den else None)

    def paired(key: tuple) -> str:
        den = by.get((*key, "foreach")) or by.get((*key, "loop"))
        return paired_ratio(by.get((*key, "stacked")), den)

    head = ["optimizer", "N", "stacked ms", "foreach ms", "stacked/foreach", "paired"]
    body = [
        [name, str(n), timing((name, n), "stacked"), timing((name, n), "foreach")]
        + [f"{quotient((name, n), 'ms')} ({quotient((name, n), 'min_ms')})", paired((name, n))]
        for name, n in keys
    ]
    note = (
        "optimizer step alone, median (min) over rounds; paired: median over rounds of the "
        "round's stacked/foreach; target: stacked/foreach <= 1.3 "
        "(muon: foreach ms is N torch Muons in a loop)"
    )
    return "\n".join([note, *grid(head, body)])
