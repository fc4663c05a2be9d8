"""The sweep's parts: the plain backends' trial, hyperparameters as the optimizer takes them,
grid and study checks; and PBT's warning about schedulers that undo its learning rates."""

from __future__ import annotations

import functools
import inspect
import math
import random
import warnings
from collections.abc import Callable, Mapping, Sequence
from decimal import Decimal
from typing import Any

import torch

__all__ = [
    "PlainTrial",
    "check_direction",
    "fixed_names",
    "flag_names",
    "grid_values",
    "hyper_table",
    "per_member",
    "tell",
    "warn_recomputing_schedulers",
]


class PlainTrial:
    """The part of ``optuna.Trial`` a ``space`` uses, for the grid and random backends."""

    def __init__(self, number: int, rng: random.Random, grid: Mapping[str, Any] | None):
        self.number, self._rng, self._grid = number, rng, grid
        self.params: dict[str, Any] = {}
        self.intermediate_values: dict[int, float] = {}

    def _pick(self, name: str, draw: Callable[[], Any]) -> Any:
        if name in self.params:  # as optuna: a name asked again gives the value it gave first
            return self.params[name]
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
            _check_range("suggest_float", name, low, high, log, step, 0.0)
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
            _check_range("suggest_int", name, low, high, log, None if step == 1 else step, 1)
            if log:
                return round(math.exp(self._rng.uniform(math.log(low), math.log(high))))
            return low + step * self._rng.randint(0, (high - low) // step)

        return self._pick(name, draw)

    def suggest_categorical(self, name: str, choices: Sequence[Any]) -> Any:
        options = list(choices)
        if not options:
            raise ValueError(f"Sweep: suggest_categorical({name!r}): `choices` must not be empty")
        return self._pick(name, lambda: self._rng.choice(options))

    def report(self, value: float, step: int) -> None:
        self.intermediate_values[step] = value

    def should_prune(self) -> bool:
        return False  # the plain backends do not prune


def _check_range(
    method: str, name: str, low: float, high: float, log: bool, step: float | None, least: float
) -> None:
    """Refuse what optuna's ``method`` refuses (the draws would leave the range, or fail in
    ``math.log``, a modulo by zero); ``least``: the lowest ``low`` with ``log`` (1 for ints)."""
    where = f"Sweep: {method}({name!r})"
    if not low <= high:
        raise ValueError(f"{where}: `low` must be <= `high`, got low={low}, high={high}")
    if log and step is not None:
        raise ValueError(f"{where}: `step` cannot be combined with `log=True`, got step={step}")
    if log and not (low > 0 and low >= least):
        bound = f">= {least}" if least else "> 0"
        raise ValueError(f"{where}: `low` must be {bound} with `log=True`, got {low}")
    if step is not None and not step > 0:
        raise ValueError(f"{where}: `step` must be > 0, got {step}")


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


def flag_names(optimizer: Any) -> set[str]:
    """The keyword arguments the optimizer class takes besides its per-member hyperparameters
    (``nesterov``, ``amsgrad``, ...); none for a callable that does not say (a lambda)."""
    hypers = hyper_table(optimizer)
    if hypers is None:
        return set()
    params = inspect.signature(_unwrapped(optimizer)).parameters.values()
    named = {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    return named - set(hypers) - {"params", "ens", "ensemble"}


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


def grid_values(values: Any) -> list[Any] | None:
    """A grid entry as a list of values; ``None`` for one value (a number, a string)."""
    if isinstance(values, (str, bytes)):
        return None
    try:
        return list(values)
    except TypeError:  # not iterable (a 0-d tensor too)
        return None


def check_direction(api: str, study: Any, mode: str) -> None:
    """Refuse a study that optimizes the other way (or several objectives)."""
    directions = [getattr(d, "name", str(d)).lower() for d in study.directions]
    want = "minimize" if mode == "min" else "maximize"
    if directions != [want]:
        raise ValueError(
            f"{api}: `study` has directions {directions}, but `mode` is {mode!r}: optuna would "
            f"rank and prune the trials the other way; create it with direction={want!r} or "
            f"pass mode={'max' if mode == 'min' else 'min'!r}"
        )


def tell(study: Any, trial: Any, state: str, value: float) -> None:
    """Tell optuna's ``study`` that ``trial`` ended in ``state`` (``"complete"`` with ``value``,
    ``"pruned"`` or ``"failed"``)."""
    import optuna  # optional: only the optuna backend tells

    kind = optuna.trial.TrialState
    try:
        if state == "complete":
            study.tell(trial, value)
        else:
            study.tell(trial, state=kind.PRUNED if state == "pruned" else kind.FAIL)
    except RuntimeError as err:
        # GridSampler calls `study.stop()` in `tell` once its grid is used up, which raises
        # outside `study.optimize`; `tell` stores the trial first (in a `finally`), so it is
        # told, and the round's other trials and its results go on.
        told = study.get_trials(deepcopy=False)[trial.number]
        if "Study.stop" not in str(err) or told.state == kind.RUNNING:
            raise


#: torch schedulers that set each lr from the group's base lr (``base_lrs``), not from its
#: current value: they undo what PBT's ``exploit_`` and ``explore`` wrote at their next step
#: (SequentialLR at its next milestone: it restarts the next scheduler from ``base_lrs``).
_RECOMPUTING = (
    torch.optim.lr_scheduler.LambdaLR,
    torch.optim.lr_scheduler.OneCycleLR,
    torch.optim.lr_scheduler.CyclicLR,
    torch.optim.lr_scheduler.CosineAnnealingWarmRestarts,
    torch.optim.lr_scheduler.SequentialLR,
)


def warn_recomputing_schedulers(callbacks: Sequence[Any]) -> None:
    """Warn (once per call) when a scheduler callback among ``callbacks`` would undo the
    learning rates a PBT round copies and perturbs."""
    for cb in callbacks:
        scheduler = getattr(cb, "scheduler", None)
        inner = [scheduler, *getattr(scheduler, "_schedulers", [])]
        found = [type(s).__name__ for s in inner if isinstance(s, _RECOMPUTING)]
        if found:
            warnings.warn(
                f"PBT: the {found[0]} scheduler sets each member's lr from its base lr at every "
                "step (SequentialLR: at each milestone), so the learning rates PBT copies and "
                "perturbs last only until then; use "
                "a scheduler that scales the current lr (StepLR, ExponentialLR, "
                "CosineAnnealingLR, ...) or perturb other hyperparameters (`names`)",
                UserWarning,
                stacklevel=2,
            )
            return
