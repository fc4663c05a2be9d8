from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from vmapens._members import _accelerators

sys.path.insert(0, str(Path(__file__).parent))
# The benchmark suite is the top-level package bench/, next to tests/ (not in the wheel).
sys.path.insert(1, str(Path(__file__).parent.parent))

# pytest-xdist runs one worker per core (`-n auto`), and torch gives each worker a thread per
# core: on 2 cores, 4 threads whose OpenMP barriers wait for a core another worker holds. A
# test of small ops took 2-25x its one-thread time (test_semantics' zero-gradient test 0.16 s
# alone, 4 s beside another worker), and the CPU time spent spinning is lost to the suite.
# One share of the cores per worker instead; `-n 0` runs (the CI's kernel reruns) keep
# torch's default.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.set_num_threads(
        max(1, torch.get_num_threads() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    )


#: Whether torch could draw from a generator other than the CPU's (read once: it never changes).
_ACCELERATORS = _accelerators()


@pytest.fixture(autouse=True)
def _seed():
    # Every test starts from the same global RNG state, whatever ran before it. Without an
    # accelerator, the CPU generator alone: torch.manual_seed also queues a lazy seed for each
    # device module, formatting the call stack each time (0.6 ms a test in pytest's stacks).
    (torch.manual_seed if _ACCELERATORS else torch.default_generator.manual_seed)(0)


@pytest.fixture(autouse=True, scope="module")
def _default_dtype_kept(request: pytest.FixtureRequest) -> Iterator[None]:
    # A test file that sets torch's default dtype and leaves it (a module-scoped fixture that
    # calls set_default_dtype) made every later file in that xdist worker build float64
    # tensors: 15 unrelated tests failed in one CI run. The file that leaves it fails here.
    before = torch.get_default_dtype()
    yield
    after = torch.get_default_dtype()
    if after != before:
        torch.set_default_dtype(before)
        pytest.fail(
            f"{request.module.__name__} left torch's default dtype at {after} (it was "
            f"{before}): restore it where it is set (see `float64_default`)",
            pytrace=False,
        )


@pytest.fixture
def float64_default() -> Iterator[None]:
    """float64 as torch's default dtype for the test (``pytestmark =
    pytest.mark.usefixtures("float64_default")`` for a whole file), then back."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)
