"""torch.optim.Optimizer without the first-call ``torch._dynamo`` import, written once.

torch wraps ``Optimizer.state_dict``, ``load_state_dict``, ``zero_grad`` and
``add_param_group`` in ``torch._disable_dynamo``, whose first call imports ``torch._dynamo``:
1.5-3 s of an eager run that never compiles (every checkpointing ``fit`` in a fresh process,
every ``opt.zero_grad()`` loop). :class:`EagerOptimizer` calls torch's own functions without
that wrapper, and with it while dynamo traces, where the wrapper is what tells dynamo to leave
the call alone. The behaviour is torch's, unchanged.

:func:`hooked_step` does the same for ``step``: torch wraps every optimizer's ``step`` in
``Optimizer.profile_hook_step`` (the step hooks and a ``record_function`` label), 10-15 us a
step of which nothing is used unless a hook is registered or a profiler records; it then runs
torch's wrapper, and otherwise the step alone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

__all__ = ["EagerOptimizer", "hooked_step"]


def _torch(name: str) -> Any:
    """``torch.optim.Optimizer.<name>``, unwrapped unless dynamo is tracing."""
    method = getattr(torch.optim.Optimizer, name)
    if torch.compiler.is_compiling():
        return method
    return getattr(method, "__wrapped__", method)


def hooked_step(step: Callable[..., Any]) -> Callable[..., Any]:
    """``step`` with torch's ``Optimizer.profile_hook_step`` around it whenever that does
    something: a step pre- or post-hook is registered (on the optimizer, or globally by
    ``torch.optim.optimizer.register_optimizer_step_pre_hook``), a profiler is recording (which
    then shows the ``Optimizer.step#<class>.step`` label), or dynamo traces the call.
    Otherwise ``step`` alone, then ``_optimizer_step_code()`` as torch's wrapper calls it.

    Marked ``hooked``, so that ``torch.optim.Optimizer.__init__`` does not wrap it again.
    """
    torch_wrapped = torch.optim.Optimizer.profile_hook_step(step)
    enabled = torch._C._autograd._profiler_enabled

    @functools.wraps(step)
    def wrapper(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if (
            torch.compiler.is_compiling()  # first: dynamo cannot trace `enabled()`
            or self._optimizer_step_pre_hooks
            or self._optimizer_step_post_hooks
            or _global_optimizer_pre_hooks
            or _global_optimizer_post_hooks
            or enabled()
        ):
            return torch_wrapped(self, *args, **kwargs)
        out = step(self, *args, **kwargs)
        self._optimizer_step_code()
        return out

    wrapper.hooked = True  # type: ignore[attr-defined]
    return wrapper


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
