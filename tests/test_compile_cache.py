"""The compiled step and torch's on-disk compile cache, across CPU vector ISAs.

torch 2.13 keys its FX graph cache without the vector ISA inductor generates kernels for: a
process on AVX-512 fills the cache, a process on AVX2 (another machine sharing
``TORCHINDUCTOR_CACHE_DIR``, or ``ATEN_CPU_CAPABILITY=avx2``) loads the 16-wide kernel source,
compiles it with AVX2 flags and computes wrong numbers without an error. vmapens puts the ISA
into its compile options (``vmapens._compiling.cache_keyed_options``), so each ISA gets its own entry.

Truth: the eager step on a copy of the same ensemble, in the same process.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

# One process: a compiled step and an eager one from the same start, three steps each.
CHILD = """
import copy, torch, vmapens
from torch import nn
torch.manual_seed(0)
ens = vmapens.Ensemble(lambda: nn.Sequential(nn.Linear(7, 37), nn.Tanh(), nn.Linear(37, 3)),
                       n=5, seed=0).double()
twin = copy.deepcopy(ens)
compiled = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=0.01),
                             compile=True, check=False)
eager = vmapens.make_step(twin, nn.MSELoss(), vmapens.StackedAdam(twin, lr=0.01), check=False)
g = torch.Generator().manual_seed(1)
for _ in range(3):
    x, y = torch.randn(19, 7, generator=g).double(), torch.randn(19, 3, generator=g).double()
    torch.testing.assert_close(compiled(x, y), eager(x, y), rtol=1e-9, atol=1e-12)
torch.testing.assert_close(ens.state_dict(), twin.state_dict(), rtol=1e-9, atol=1e-12)
print("equal", torch.backends.cpu.get_cpu_capability())
"""


def _run(cache: str, capability: str | None) -> subprocess.CompletedProcess:
    # TORCHINDUCTOR_VEC_ISA_OK=1: inductor takes the vector ISAs the CPU reports as buildable
    # instead of building and loading a probe library for each (AVX2, AVX-512, VNNI, AMX) in
    # the fresh cache: ~10 s of the first process's ~22 s of CPU. The cache key and the ISA
    # each process compiles for stay as they were; the bf16/AMX probes still run.
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TORCHINDUCTOR_VEC_ISA_OK": "1"}
    env.pop("ATEN_CPU_CAPABILITY", None)
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    return subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
    reason="needs a CPU whose ATen kernels are vectorized (x86-64 with AVX2 at least)",
)
def test_a_cache_filled_on_another_vector_isa_gives_the_eager_result(tmp_path):
    # The second process runs on a narrower ISA than the first filled the cache with:
    # AVX2 after AVX-512 (wrong numbers before the fix), or no vectors after AVX2 (a C++
    # compile error before the fix). With one key for both, the second would load the
    # first's kernels; a third process on the first ISA (a cache hit) added no case and ~10 s.
    best = torch.backends.cpu.get_cpu_capability()
    narrower = "avx2" if best == "AVX512" else "default"
    cache = str(tmp_path / "inductor")
    for capability in (None, narrower):
        proc = _run(cache, capability)
        assert proc.returncode == 0 and "equal" in proc.stdout, (
            f"ATEN_CPU_CAPABILITY={capability}: {proc.stdout[-2000:]}{proc.stderr[-3000:]}"
        )
