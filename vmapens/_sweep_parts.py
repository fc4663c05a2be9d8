"""The sweep's parts: the plain backends' trial, hyperparameters as the optimizer takes them."""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable, Mapping, Sequence
from decimal import Decimal
from typing import Any

__all__ = ["PlainTrial", "fixed_names", "hyper_table", "per_member"]


class PlainTrial:
    """The part of ``optuna.Trial`` a ``space`` uses, for the grid and random backends."""

    def __init__(self, number: int, rng: random.Random, grid: Mapping[str, Any] | None):
        self.number, self._rng, self._grid = number, rng, grid
        self.params: dict[str, Any] = {}
        self.intermediate_values: dict[int, float] = {}

    def _pick(self, name: str, draw: Callable[[], Any]) -> Any:
        if self._grid is not None:
            if name not in self._grid:
                raise ValueError(f"Sweep: `space` asked for {name!r}, which `grid` does not hold")
            value = self._grid[name]
        else:
            value = draw()
        self.params[name] = value
        return value

    def suggest_float(
        self, name: str, low: float, high: float, *, log: bool = False, step: float | None = None
    ) -> float:
        def draw() -> float:
            if log:
                return math.exp(self._rng.uniform(math.log(low), math.log(high)))
            if step is not None:
                # In decimal, as optuna counts them: (0.3 - 0.0) / 0.1 is 2.999... in binary,
                # and int() of it left 0.3 out of the draws.
                count = (Decimal(str(high)) - Decimal(str(low))) // Decimal(str(step))
                return low + step * self._rng.randint(0, int(count))
            return self._rng.uniform(low, high)

        return self._pick(name, draw)

    def suggest_int(
        self, name: str, low: int, high: int, *, step: int = 1, log: bool = False
    ) -> int:
        def draw() -> int:
            if log:
                return round(math.exp(self._rng.uniform(math.log(low), math.log(high))))
            return low + step * self._rng.randint(0, (high - low) // step)

        return self._pick(name, draw)

    def suggest_categorical(self, name: str, choices: Sequence[Any]) -> Any:
        return self._pick(name, lambda: self._rng.choice(list(choices)))

    def report(self, value: float, step: int) -> None:
        self.intermediate_values[step] = value

    def should_prune(self) -> bool:
        return False  # the plain backends do not prune


def _unwrapped(optimizer: Any) -> Any:
    while isinstance(optimizer, functools.partial):
        optimizer = optimizer.func
    return optimizer


def hyper_table(optimizer: Any) -> dict[str, Any] | None:
    """The optimizer's per-member hyperparameter table (through ``functools.partial``), or
    None for a callable that does not say (a lambda)."""
    hypers = getattr(_unwrapped(optimizer), "hyperparameters", None)
    return hypers if isinstance(hypers, dict) else None


def fixed_names(optimizer: Any) -> set[str]:
    """The keyword arguments ``functools.partial`` layers already fix."""
    names: set[str] = set()
    while isinstance(optimizer, functools.partial):
        names |= set(optimizer.keywords)
        optimizer = optimizer.func
    return names


def per_member(values: list[Any], table: dict[str, Any] | None, name: str) -> Any:
    """One hyperparameter's per-member values as the optimizer takes them: a pair (``betas``)
    as two per-member lists. Without a table (a lambda) the values say it: a tuple or list per
    trial is a pair; left as a list of pairs, two trials' ``betas`` read as a pair of
    per-member lists, and member 0 trained with trial 0's and trial 1's first values."""
    if table is not None and name in table:
        pair = bool(table[name].pair)
    else:
        pair = all(isinstance(v, (tuple, list)) for v in values)
    if pair:
        return tuple(list(v) for v in zip(*values, strict=True))
    return values
