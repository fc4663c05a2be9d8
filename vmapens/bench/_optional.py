"""The stacked-optimizer comparison (``vmapens/bench/optimizers.py``), where it exists.

``run`` and ``format_table`` call it through :func:`run_optimizers` and
:func:`format_optimizers`, which pass only the keyword arguments its functions accept, so the
rest of the benchmark works with or without it.

Example:
    >>> AVAILABLE in (True, False)
    True
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

# Only its absence is tolerated: an optimizers.py that fails to import raises as usual.
optimizers: ModuleType | None = None
if importlib.util.find_spec(f"{__package__}.optimizers") is not None:
    from . import optimizers  # type: ignore[attr-defined,no-redef,unused-ignore]

#: Whether ``vmapens/bench/optimizers.py`` exists.
AVAILABLE: bool = optimizers is not None


def _accepted(fn: Callable, **kwargs: Any) -> dict[str, Any]:
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def run_optimizers(device: torch.device, quick: bool, log: Callable[[str], None]) -> Any:
    """``optimizers.run_optimizers`` with the arguments it accepts among these."""
    assert optimizers is not None  # run() only calls this when AVAILABLE
    fn = optimizers.run_optimizers
    return fn(**_accepted(fn, device=device, quick=quick, log=log))


def format_optimizers(results: Any) -> list[str]:
    """``optimizers.format_optimizers(results)`` as lines."""
    assert optimizers is not None  # format_table only calls this on results run() produced
    text = optimizers.format_optimizers(results)
    return text.splitlines() if isinstance(text, str) else list(text)
