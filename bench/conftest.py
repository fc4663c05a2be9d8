"""Shared fixtures for the pytest-benchmark suite (run with ``pytest bench/``)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# `pytest bench/` puts only bench/ on sys.path; the package must import from a plain checkout too.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import Step, StepFactory  # noqa: E402

WARMUP = 3


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def bench_step(benchmark, device: torch.device) -> Callable[[str, StepFactory, int], None]:
    """Build a step, warm it up outside the timed region, then time it with ``benchmark``."""

    def run(impl: str, factory: StepFactory, n: int) -> None:
        step = factory(n, device)
        for _ in range(WARMUP):  # lazy Adam state and compilation are not what is measured
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        benchmark(_synced(step) if device.type == "cuda" else step)

    return run


def _synced(step: Step) -> Step:
    def synced() -> None:
        step()
        torch.cuda.synchronize()

    return synced
