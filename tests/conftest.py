from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _seed_and_threads():
    # Tests compare tiny float64 models: determinism matters more than threads.
    torch.manual_seed(0)
    yield
