"""``fit(compile="auto")``: train eagerly, and compile only when the run is long enough to pay."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ._compiling import CompileFailed, TooManyShapes
from ._step_hooks import PreHookRefused
from ._update_check import CompiledStepMismatch

__all__ = ["COMPILE_PAYS_AFTER_S", "AutoStep"]

#: Compile once the eager steps still to run would take longer than this. A first compile costs
#: 3-40 s on a CPU (workload A to a small Transformer, docs/performance.md), and the compiled
#: step is 2-7x faster, so below this budget compiling could make the run slower end to end.
COMPILE_PAYS_AFTER_S = 60.0
#: Eager steps timed before deciding (after one untimed warm-up step).
TIMED_STEPS = 5


class AutoStep:
    """A training step that starts eager and switches to the compiled step when it pays.

    After a warm-up step and ``TIMED_STEPS`` timed eager steps, it estimates the eager time of
    the steps still to come; above ``COMPILE_PAYS_AFTER_S`` it builds the compiled step and
    uses it from then on (if ``make_step`` refuses to compile, a torch.optim optimizer or
    ``backend="loop"``, it warns and stays eager). With an unknown number of steps it stays
    eager. The compiled step equals the eager one up to round-off (tests: 1e-9 in float64).
    After its first call (the compile) and one warm-up call, ``TIMED_STEPS`` compiled steps are
    timed too: where their median is slower than the eager steps' median (inductor's code for
    the model is slower than eager), it goes back to the eager step for the rest of the run.

    Args:
        eager: the eager step it starts with.
        build_compiled: builds the compiled step, when it pays.
        total_steps: steps this run will take (``None`` if unknown).
    """

    def __init__(
        self,
        eager: Callable[..., torch.Tensor],
        build_compiled: Callable[[], Callable[..., torch.Tensor]],
        total_steps: int | None,
    ) -> None:
        self.build_compiled = build_compiled
        self.total_steps = total_steps
        self.eager = self.step = eager
        self.compiled = False
        self.done = 0
        self.eager_s: list[float] = []
        self.compiled_s: list[float] = []
        self.compiled_calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        timed = self._timed()
        start = time.perf_counter()
        try:
            losses = self.step(*args, **kwargs)
        except (CompiledStepMismatch, PreHookRefused, CompileFailed, TooManyShapes) as err:
            # The compiled step refused or failed before it changed anything: go on eagerly.
            if self.step is self.eager:
                raise
            warnings.warn(f"fit: {err}. fit(compile='auto') goes on eagerly.", stacklevel=3)
            self.step = self.eager
            timed = None
            losses = self.step(*args, **kwargs)
        if timed is not None:
            timed.append(time.perf_counter() - start)
        self.done += 1
        if self.step is not self.eager:
            self.compiled_calls += 1
            checked = timed is not None and len(self.compiled_s) == TIMED_STEPS
            if checked and _median(self.compiled_s) > _median(self.eager_s):
                self.step = self.eager  # inductor's code is slower here: eager it is
        elif not self.compiled and len(self.eager_s) == TIMED_STEPS:
            self.compiled = True  # decided: not built again after a refusal
            left = self.total_steps - self.done if self.total_steps is not None else 0
            if left * _median(self.eager_s) > COMPILE_PAYS_AFTER_S:
                try:
                    self.step = self.build_compiled()
                except (TypeError, ValueError) as err:
                    # make_step refuses to compile what the eager step trains (a torch.optim
                    # optimizer, backend="loop"): that stopped the run after its timed steps.
                    warnings.warn(f"fit: {err}. fit(compile='auto') goes on eagerly.", stacklevel=3)
        return losses

    def _timed(self) -> list[float] | None:
        """Where this call's time goes: the eager steps after the warm-up, until
        ``TIMED_STEPS`` are timed; the compiled steps after its compile and one warm-up call,
        until as many are; else None."""
        if self.step is self.eager:
            deciding = not self.compiled and self.total_steps is not None and self.done > 0
            return self.eager_s if deciding and len(self.eager_s) < TIMED_STEPS else None
        if self.compiled_calls >= 2 and len(self.compiled_s) < TIMED_STEPS:  # then decided
            return self.compiled_s
        return None


def _median(times: list[float]) -> float:
    """The median of ``times`` (the upper one of an even count)."""
    return sorted(times)[len(times) // 2]
