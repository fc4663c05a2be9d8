"""Hooks around a training step that the step's own code would otherwise pass by.

* A forward or backward hook registered on ``ens.template`` after ``make_step`` (or a backward
  hook on ``ens.runner``): the step's member map was lifted once, when the step was built,
  and ``Ensemble`` refuses such hooks only when a member map is lifted, so a step built
  before them ran without them, silently (``TemplateHooks``).
* The optimizer's step hooks (``register_step_pre_hook`` / ``register_step_post_hook``, and
  torch's global ones): the compiled step runs the update inside its graph through
  ``apply_gradients``, not ``optimizer.step()``, so torch's wrapper that calls them never
  ran (``refuse_pre_hooks``, ``run_post_hooks``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks
from torch.utils.hooks import RemovableHandle

from ._hooks import refuse_template_hooks
from .ensemble import Ensemble

__all__ = ["PreHookRefused", "TemplateHooks", "refuse_pre_hooks", "run_post_hooks"]


class TemplateHooks:
    """``refuse_template_hooks`` for every call of a step, at the cost of one integer read
    while no hook was registered anywhere since the last look.

    torch numbers every hook handle it makes (``RemovableHandle.next_id``: module hooks of
    every kind, tensor hooks, optimizer hooks), so a number unchanged since the last check
    means no new hook; the full check walks the template's modules (~9 us for an MLP).
    """

    def __init__(self, ens: Ensemble) -> None:
        self.ens, self.seen = ens, -1

    def __call__(self) -> None:
        """Raise ``refuse_template_hooks``'s error for a hook the members would not run."""
        now = RemovableHandle.next_id
        if now == self.seen or self.ens.backend != "vmap":
            return
        with torch.enable_grad():  # a backward follows: the runner's backward hooks too
            refuse_template_hooks(self.ens.template, self.ens.runner)
        self.seen = now  # not before: a hook refused once is refused again until removed


class PreHookRefused(ValueError):
    """The compiled step was called with an optimizer step pre-hook in place; it changed
    nothing. ``fit(compile="auto")`` goes on eagerly, where ``optimizer.step()`` runs it."""


def refuse_pre_hooks(optimizer: torch.optim.Optimizer) -> None:
    """The compiled step cannot run an optimizer step pre-hook: its gradients and its update
    are one graph, and a pre-hook runs between them (it may read ``.grad`` or change the
    arguments of ``step``).

    Raises:
        PreHookRefused: (a ValueError) the optimizer, or torch globally, has a step pre-hook.
    """
    if optimizer._optimizer_step_pre_hooks or _global_optimizer_pre_hooks:
        where = "`optimizer`" if optimizer._optimizer_step_pre_hooks else "torch (globally)"
        raise PreHookRefused(
            f"step: {where} has a step pre-hook (register_step_pre_hook / "
            "register_optimizer_step_pre_hook), which the compiled step cannot run: it computes "
            "the gradients and the update in one graph, and a pre-hook runs between them. Use "
            "compile=False (the eager step calls optimizer.step(), hooks included), or a step "
            "post-hook, which the compiled step runs after its update. Nothing was changed"
        )


def run_post_hooks(optimizer: torch.optim.Optimizer, mask: torch.Tensor | None) -> None:
    """Call the optimizer's step post-hooks, then torch's global ones, as torch's wrapper of
    ``optimizer.step`` does after the update, with the arguments the eager step gives
    ``step``: ``(optimizer,)`` and ``{"mask": mask}`` when the step has a mask."""
    hooks = [*optimizer._optimizer_step_post_hooks.values(), *_global_optimizer_post_hooks.values()]
    if not hooks:
        return
    args: tuple[Any, ...] = (optimizer,)
    kwargs: dict[str, Any] = {} if mask is None else {"mask": mask}
    for hook in hooks:
        hook(optimizer, args, kwargs)
