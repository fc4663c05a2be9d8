from __future__ import annotations

import sys
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
