"""MKL's vector math resolved before anything runs it on several threads (torch's issue 188792).

ATen sends a contiguous float32 or float64 ``sqrt``, ``exp``, ``tanh``... to oneMKL's vector
math (VML, ``aten/src/ATen/cpu/vml.h``), each intra-op thread calling it on its own chunk with
high accuracy asked for. oneMKL 2024.2 (torch 2.13's CPU wheels) picks each function's kernel
lazily at its first call; when that call runs on several threads at once (the first such op on
a tensor of more than 2048 elements with two threads), one thread can run a low-accuracy kernel
for its whole chunk, that one time: ``torch.sqrt`` then errs by up to ~4000 ulps, silently.
Measured here: the first ``torch.sqrt`` of 10240 float32 values with two threads differed from
the second in 5118 elements (3e-4 relative) in 2 of 50 fresh processes; 0 of 50 after the
warm-up below.

An ensemble's first optimizer step or forward is such a call (its tensors are n members wide),
while a member trained alone may stay under the size that splits: the ensemble would then differ
from training alone in its first step, with no error. :func:`warm_vml` calls each function once
on one element, on one thread, which is torch's proposed fix (pull request 188791) done from
outside; ``import vmapens`` runs it.
"""

from __future__ import annotations

import torch

__all__ = ["VML_OPS", "warm_vml"]

#: torch functions whose float32/float64 CPU kernels call MKL's vector math (``vml.h``'s
#: ``IMPLEMENT_VML_MKL`` in torch 2.13); ``tests/test_mkl.py`` checks the list against the
#: header where the installed torch ships it.
VML_OPS = (
    "acos",
    "asin",
    "atan",
    "cos",
    "erf",
    "erfc",
    "erfinv",
    "exp",
    "log",
    "log10",
    "log2",
    "sin",
    "sqrt",
    "tan",
    "tanh",
    "trunc",
)


def warm_vml() -> None:
    """Call each of :data:`VML_OPS` once on one float32 and one float64 element (~0.1 ms).

    Without MKL (``torch.backends.mkl.is_available()`` False: ARM, macOS) there is nothing to
    resolve and nothing runs.
    """
    if not torch.backends.mkl.is_available():
        return
    with torch.inference_mode():
        for dtype in (torch.float32, torch.float64):
            # On the CPU whatever torch.set_default_device says: a CUDA or meta tensor would
            # resolve nothing, and the CPU step's first large op would race as above.
            x = torch.full((1,), 0.5, dtype=dtype, device="cpu")
            for name in VML_OPS:
                getattr(torch, name)(x)
