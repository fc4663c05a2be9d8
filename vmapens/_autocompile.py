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
    eager. The compiled step
    equals the eager one up to round-off (tests: 1e-9 in float64).

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
        self.timed_s = 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        deciding = not self.compiled and self.total_steps is not None and self.done <= TIMED_STEPS
        start = time.perf_counter()
        try:
            losses = self.step(*args, **kwargs)
        except (CompiledStepMismatch, PreHookRefused, CompileFailed, TooManyShapes) as err:
            # The compiled step refused or failed before it changed anything: go on eagerly.
            if self.step is self.eager:
                raise
            warnings.warn(f"fit: {err}. fit(compile='auto') goes on eagerly.", stacklevel=3)
            self.step = self.eager
            losses = self.step(*args, **kwargs)
        if deciding and self.done > 0:  # the first step warms caches up: not timed
            self.timed_s += time.perf_counter() - start
        self.done += 1
        if deciding and self.done == TIMED_STEPS + 1 and self.total_steps is not None:
            left = self.total_steps - self.done
            if left * self.timed_s / TIMED_STEPS > COMPILE_PAYS_AFTER_S:
                self.compiled = True  # decided: not built again after a refusal
                try:
                    self.step = self.build_compiled()
                except (TypeError, ValueError) as err:
                    # make_step refuses to compile what the eager step trains (a torch.optim
                    # optimizer, backend="loop"): that stopped the run after its timed steps.
                    warnings.warn(f"fit: {err}. fit(compile='auto') goes on eagerly.", stacklevel=3)
        return losses
