"""How the compiled step is compiled: inductor's options, and a code object per step.

Kept apart from ``step.py`` so tests that compile a function themselves take the same
options (``cache_keyed_options``) and the same per-function cache (``own_code``).
"""

from __future__ import annotations

import itertools
import types
from collections.abc import Callable
from typing import Any

import torch

from ._matmuls import shared_operand_pass

__all__ = ["cache_keyed_options", "compile_options", "own_code"]


def compile_options(device: torch.device) -> dict[str, Any]:
    """The inductor options of the compiled step on ``device``.

    torch.compile takes a ``mode`` or ``options``, not both, so CUDA's "reduce-overhead" (CUDA
    graphs: one launch per step) is given as its options.
    """
    options: dict[str, Any] = {}
    if device.type == "cpu":  # a member matmul on a shared input becomes one (_matmuls)
        options["post_grad_custom_pre_pass"] = shared_operand_pass()
        options.update(cache_keyed_options())
        # The compiled graph calls its kernels from C++, not Python: a step of many small
        # kernels (a recurrence, a CNN) ran 0.73-0.82x the time, the others 0.94-1.0x, and
        # its first compile took no longer (docs/performance.md).
        options["cpp_wrapper"] = True
    # Inductor otherwise keeps fused intermediates in float32 where eager rounds them to bf16 or
    # fp16: under autocast (make_step's ``precision``), and in an update that computes in bf16 itself
    # (StackedMuon's Newton-Schulz iteration, as torch.optim.Muon's) or on 16-bit parameters.
    options["emulate_precision_casts"] = True
    if device.type == "cuda":
        # Imported here: torch._inductor imports torch._dynamo (seconds), which eager never needs.
        from torch._inductor import list_mode_options

        options.update(list_mode_options("reduce-overhead"))
    return options


def cache_keyed_options() -> dict[str, Any]:
    """Inductor options that put this process's CPU vector ISA into the compile-cache key.

    ``cpp.simdlen`` is the bit width of the ISA inductor picks by itself; given as an option,
    it becomes part of the compiled-graph cache key. torch 2.13 keys its FX graph cache without
    it: a graph cached by a process on AVX-512 and loaded by one on AVX2 (another machine
    sharing ``TORCHINDUCTOR_CACHE_DIR``, or ``ATEN_CPU_CAPABILITY`` set) recompiled 16-wide
    kernel source with AVX2 flags and gave wrong results without an error (the other way
    round: heap corruption), docs/semantics.md. The tests that call ``torch.compile`` themselves pass them too.
    """
    # Imported here: torch._inductor imports torch._dynamo (seconds), which eager never needs.
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return {"cpp.simdlen": pick_vec_isa().bit_width()}


_made = itertools.count()


def own_code(fn: Callable) -> Callable:
    """``fn`` with a code object of its own (same bytecode, a unique name)."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_made)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
