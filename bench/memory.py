"""Building and training memory, each measured in a fresh process, and building time.

Example:
    >>> wide_mlp(8)[0].out_features
    8
    >>> mnist_cnn()(torch.zeros(2, 1, 28, 28)).shape
    torch.Size([2, 10])
"""

from __future__ import annotations

import functools
import statistics
import time

import torch
from torch import nn

from vmapens.ensemble import Ensemble
from vmapens.optim import StackedAdam
from vmapens.step import make_step

from ._tools import NOT_AVAILABLE, child_json, reset_peak_rss, rss_bytes, tensor_peak_bytes
from .workloads import mlp as a_mlp


def wide_mlp(hidden: int = 1024) -> nn.Sequential:
    """Memory-test member: ``Linear(512, hidden) -> ReLU -> Linear(hidden, 512)``, ~1M params."""
    return nn.Sequential(nn.Linear(512, hidden), nn.ReLU(), nn.Linear(hidden, 512))


#: The training-memory workload (issue 21): members, batch, steps, and the chunk size compared.
TRAIN_N, TRAIN_BATCH, TRAIN_STEPS, TRAIN_CHUNK = 32, 64, 3, 8


def mnist_cnn() -> nn.Sequential:
    """Training-memory member: ``Conv2d(1, 16, 3) -> ReLU -> Flatten -> Linear(16*26*26, 10)``
    on 1x28x28 images (MNIST-sized)."""
    return nn.Sequential(nn.Conv2d(1, 16, 3), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 26 * 26, 10))


#: glibc's mmap threshold fixed at its initial 128 KiB (no dynamic raise): every buffer of a
#: chunk is mapped and unmapped, so RSS follows live memory (docs/performance.md, "Memory").
FIXED_MMAP = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def _train_memory_here(n: int, chunk_size: int | None, batch: int, steps: int) -> dict:
    """Child side of :func:`train_memory`: peak RSS per phase, each over the RSS it starts at
    (``VmHWM`` reset at each phase's start)."""
    mb = 2**20
    start = reset_peak_rss()
    ens = Ensemble(mnist_cnn, n, seed=0, chunk_size=chunk_size)
    step = make_step(ens, nn.CrossEntropyLoss(), StackedAdam(ens))
    build = rss_bytes("VmHWM") - start
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, 1, 28, 28, generator=g), torch.randint(0, 10, (batch,), generator=g)
    before = reset_peak_rss()  # the run's peaks count from here: after the build
    losses = step(x, y)  # the probe, and the gradients and optimizer state, which stay
    first = rss_bytes("VmHWM") - before
    peak, later = first, 0
    for _ in range(steps - 1):
        held = reset_peak_rss()
        losses = step(x, y)
        top = rss_bytes("VmHWM")
        peak, later = max(peak, top - before), max(later, top - held)
    held = reset_peak_rss()
    with torch.no_grad():
        ens(x)
    top = rss_bytes("VmHWM")
    evaluation, peak = top - held, max(peak, top - before)
    with torch.no_grad():
        digest = float(sum(p.double().sum() for p in ens.parameters()))
    return {"n": n, "chunk_size": chunk_size, "build_mb": build / mb, "first_mb": first / mb,
            "held_mb": (held - before) / mb, "step_mb": later / mb, "eval_mb": evaluation / mb,
            "peak_mb": peak / mb, "total_mb": rss_bytes("VmHWM") / mb,
            "losses": losses.tolist(), "digest": digest}  # fmt: skip


def _tensor_memory_here(n: int, chunk_size: int | None, batch: int, steps: int) -> dict:
    """Child side of :func:`train_memory`'s tensor figure: the same build, steps and
    evaluation, the peak of torch's tensor bytes over the build (:func:`tensor_peak_bytes`)."""
    ens = Ensemble(mnist_cnn, n, seed=0, chunk_size=chunk_size)
    step = make_step(ens, nn.CrossEntropyLoss(), StackedAdam(ens))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, 1, 28, 28, generator=g), torch.randint(0, 10, (batch,), generator=g)

    def run() -> None:
        for _ in range(steps):
            step(x, y)
        with torch.no_grad():
            ens(x)

    return {"peak_mb": tensor_peak_bytes(run) / 2**20}


def train_memory(
    n: int = TRAIN_N,
    chunk_size: int = TRAIN_CHUNK,
    batch: int = TRAIN_BATCH,
    steps: int = TRAIN_STEPS,
) -> dict:
    """Peak RSS of eager training, unchunked vs ``chunk_size``, per phase, fresh processes.

    ``n`` :func:`mnist_cnn` members, one batch of ``batch`` 1x28x28 images, ``steps`` steps of
    ``make_step(ens, CrossEntropyLoss(), StackedAdam(ens))`` (self-check on), then one
    ``no_grad`` forward; each variant in its own ``sys.executable`` so that neither sees the
    other's freed memory. Both variants run twice: with glibc's defaults, and with its mmap
    threshold fixed (:data:`FIXED_MMAP`), where RSS follows the live tensors instead of what
    the heap keeps of freed chunk buffers; then once more under the profiler, for the peak of
    the tensors themselves.

    Args:
        n: Number of members.
        chunk_size: The chunked variant's ``Ensemble(chunk_size=...)``.
        batch: Images per batch.
        steps: Training steps measured.

    Returns:
        ``unchunked`` and ``chunked`` (glibc's defaults), each with ``build_mb`` (peak of
        building the ensemble, optimizer and step), ``first_mb`` (peak of the first step over
        the RSS after the build: probe, gradients and optimizer state created), ``held_mb``
        (RSS held after the steps, over the build), ``step_mb`` (the largest peak of a later
        step over the RSS held before it: what one step needs on top), ``eval_mb`` (a
        ``no_grad`` forward, likewise), ``peak_mb`` (the run's peak over the RSS after the
        build: steps and evaluation), ``total_mb`` (the process's peak RSS, ``import torch``
        included), ``losses`` of the last step and ``digest`` (the sum of all parameters after
        training); ``ratio`` (chunked / unchunked ``peak_mb``), ``step_ratio`` (of
        ``step_mb``; ``inf`` where the unchunked later step needed no new RSS), ``same``
        (losses and digests agree to 1e-6: float32 round-off),
        ``fixed``: ``unchunked``, ``chunked``, ``ratio`` and ``step_ratio`` with
        :data:`FIXED_MMAP`; ``tensors``: ``unchunked`` and ``chunked`` (each ``peak_mb``:
        the peak of torch's tensor bytes over the build, the same phases, glibc's defaults:
        what ``torch.cuda.max_memory_allocated`` measures on a GPU) and their ``ratio``;
        ``batch``.

    Raises:
        RuntimeError: If a subprocess fails.

    Example (not run by the doctests: six fresh processes, ~15 s of CPU;
    ``tests/test_chunk_memory.py`` runs it and checks the figures)::

        result = train_memory(4, 2, batch=2, steps=2)
        assert result["same"]  # the chunked run trains the members the unchunked one does
        print(result["ratio"], result["tensors"]["ratio"])
    """
    code = "import json; from bench.memory import _train_memory_here; print(json.dumps({}))"
    runs: dict[str, dict] = {"default": {}, "fixed": {}}
    for env_name, env in (("default", None), ("fixed", FIXED_MMAP)):
        for name, size in (("unchunked", None), ("chunked", chunk_size)):
            call = f"_train_memory_here({n}, {size}, {batch}, {steps})"
            runs[env_name][name] = child_json(code.format(call), "train_memory", env)

    def ratios(a: dict, b: dict) -> dict:
        # Under glibc's defaults a later unchunked step may need no new RSS at all (the heap
        # kept the first step's buffers): its ratio is then infinite, not an error.
        step = b["step_mb"] / a["step_mb"] if a["step_mb"] > 0 else float("inf")
        return {"ratio": b["peak_mb"] / a["peak_mb"], "step_ratio": step}

    a, b = runs["default"]["unchunked"], runs["default"]["chunked"]
    same = all(
        abs(u["digest"] - v["digest"]) <= 1e-6 * max(1.0, abs(u["digest"]))
        and all(abs(p - q) <= 1e-6 for p, q in zip(u["losses"], v["losses"], strict=True))
        for u, v in ((a, b), (a, runs["fixed"]["unchunked"]), (a, runs["fixed"]["chunked"]))
    )
    fixed = {**runs["fixed"], **ratios(runs["fixed"]["unchunked"], runs["fixed"]["chunked"])}
    code = code.replace("_train_memory_here", "_tensor_memory_here")
    tensors: dict = {
        name: child_json(code.format(f"_tensor_memory_here({n}, {size}, {batch}, {steps})"),
            "train_memory")
        for name, size in (("unchunked", None), ("chunked", chunk_size))
    }  # fmt: skip
    tensors["ratio"] = tensors["chunked"]["peak_mb"] / tensors["unchunked"]["peak_mb"]
    return {**runs["default"], **ratios(a, b), "same": same, "fixed": fixed, "tensors": tensors,
            "batch": batch}  # fmt: skip


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


#: Ensemble size of the build-time comparison (issue 21 item 5).
BUILD_N = 4096


def build_time(n: int = BUILD_N, repeats: int = 3) -> dict:
    """Seconds to build workload A's MLP ``n`` times: ``Ensemble(mlp, n, seed=0)`` against the
    recipe ``[mlp() for _ in range(n)]`` + ``torch.func.stack_module_state``, interleaved.

    Args:
        n: Number of members.
        repeats: Rounds; each times both once, in alternating order.

    Returns:
        ``recipe_s`` and ``vmapens_s`` (medians over the rounds) and ``ratio`` (vmapens /
        recipe, the median of the per-round ratios).

    Example:
        >>> sorted(build_time(4, repeats=1))
        ['n', 'ratio', 'recipe_s', 'vmapens_s']
    """

    def recipe() -> None:
        torch.func.stack_module_state([a_mlp() for _ in range(n)])

    def ours() -> None:
        Ensemble(a_mlp, n, seed=0)

    times: dict[str, list[float]] = {"recipe_s": [], "vmapens_s": []}
    for r in range(repeats):
        order = [("recipe_s", recipe), ("vmapens_s", ours)]
        for key, build in order if r % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            build()
            times[key].append(time.perf_counter() - t0)
    ratios = [v / r for v, r in zip(times["vmapens_s"], times["recipe_s"], strict=True)]
    return {
        "n": n,
        **{k: statistics.median(v) for k, v in times.items()},
        "ratio": statistics.median(ratios),
    }
