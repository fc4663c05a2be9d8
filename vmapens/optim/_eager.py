"""torch.optim.Optimizer without the first-call ``torch._dynamo`` import, written once.

torch wraps ``Optimizer.state_dict``, ``load_state_dict``, ``zero_grad`` and
``add_param_group`` in ``torch._disable_dynamo``, whose first call imports ``torch._dynamo``:
1.5-3 s of an eager run that never compiles (every checkpointing ``fit`` in a fresh process,
every ``opt.zero_grad()`` loop). :class:`EagerOptimizer` calls torch's own functions without
that wrapper, and with it while dynamo traces, where the wrapper is what tells dynamo to leave
the call alone. The behaviour is torch's, unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["EagerOptimizer"]


def _torch(name: str) -> Any:
    """``torch.optim.Optimizer.<name>``, unwrapped unless dynamo is tracing."""
    method = getattr(torch.optim.Optimizer, name)
    if torch.compiler.is_compiling():
        return method
    return getattr(method, "__wrapped__", method)


class EagerOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose wrapped methods skip the dynamo import (see module)."""

    def state_dict(self) -> dict[str, Any]:
        """torch's ``Optimizer.state_dict``."""
        return _torch("state_dict")(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's ``Optimizer.load_state_dict``."""
        _torch("load_state_dict")(self, state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``Optimizer.zero_grad``."""
        _torch("zero_grad")(self, set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``Optimizer.add_param_group``."""
        _torch("add_param_group")(self, param_group)
