from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
# The benchmark suite is the top-level package bench/, next to tests/ (not in the wheel).
sys.path.insert(1, str(Path(__file__).parent.parent))


@pytest.fixture(autouse=True)
def _seed():
    # Every test starts from the same global RNG state, whatever ran before it.
    torch.manual_seed(0)


@pytest.fixture
def float64_default() -> Iterator[None]:
    """float64 as torch's default dtype for the test (``pytestmark =
    pytest.mark.usefixtures("float64_default")`` for a whole file), then back."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)
