"""Callbacks of ``fit``: hooks after every step and every epoch that see the whole run.

``fit(callbacks=[...])`` takes two kinds:

* a plain callable ``fn(history)``: runs after each epoch, *after* the checkpoint is
  written; an observer (raising from it interrupts training, and a resumed run continues
  from the checkpoint just written).
* a :class:`Callback`: ``on_step_end(ctx)`` after every optimizer step and
  ``on_epoch_end(ctx)`` after each epoch's validation, *before* the checkpoint is written,
  so what it changes (members copied or stopped, hyperparameters perturbed, its own state)
  is in the checkpoint and a resumed run continues exactly. A callback with state gives it
  through ``state_dict()`` / ``load_state_dict()``; ``fit`` stores it in its checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .ensemble import Ensemble
from .history import History

__all__ = ["Callback", "Context", "Hooks"]


class Context:
    """What a :class:`Callback` sees: the run at the end of a step or an epoch.

    Attributes:
        ensemble: the ensemble being trained.
        optimizer: its optimizer.
        epoch: the epoch (0-based) running or just ended.
        step: optimizer steps done so far in the whole run (resumed runs included).
        losses: ``[n]`` detached: this step's per-member losses in ``on_step_end``, the
            epoch's mean training losses (``history.train_loss[-1]``) in ``on_epoch_end``.
        history: the :class:`History` so far (this epoch's row included at epoch end).
    """

    def __init__(self, loop: Any, epoch: int, losses: Tensor) -> None:
        self._loop = loop
        self.ensemble: Ensemble = loop.ens
        self.optimizer: torch.optim.Optimizer = loop.optimizer
        self.history: History = loop.history
        self.epoch, self.step, self.losses = epoch, int(loop.global_step), losses

    @property
    def active(self) -> Tensor:
        """``[n]`` bool, True for members still training (a copy)."""
        return self._loop.active.clone()

    def stop(self, members: Any) -> None:
        """Stop training ``members`` (rows) from now on, as early stopping would.

        They are frozen through the optimizer's mask (needs a StackedOptimizer) and
        ``history.stopped_epoch`` records this epoch.
        """
        self._loop.stop(members, self.epoch)

    def inherit(self, src: Any, dst: Any) -> None:
        """Members ``dst`` take over ``fit``'s bookkeeping of members ``src``, row by row.

        The best score so far, the best-epoch snapshot that ``restore_best`` gives back, the
        patience count and ``history.best_epoch``: call it after copying the members
        themselves (``vmapens.exploit_``), as the ``vmapens.PBT`` callback does.
        """
        self._loop.inherit(src, dst)


class Callback:
    """Base class of stateful, step- and epoch-level callbacks (see the module docstring).

    Override what you need; the defaults do nothing. ``state_dict()`` returns ``{}`` when
    there is nothing to checkpoint.

    Example:
        >>> class CountSteps(Callback):
        ...     def __init__(self):
        ...         self.steps = 0
        ...     def on_step_end(self, ctx):
        ...         self.steps += 1
        ...     def state_dict(self):
        ...         return {"steps": self.steps}
        ...     def load_state_dict(self, state):
        ...         self.steps = state["steps"]
        >>> from vmapens import Ensemble, fit
        >>> counter = CountSteps()
        >>> ens = Ensemble(lambda: torch.nn.Linear(2, 1), n=3, seed=0)
        >>> _ = fit(ens, (torch.randn(8, 2), torch.randn(8, 1)), torch.nn.MSELoss(),
        ...         epochs=2, batch_size=4, progress=False, callbacks=[counter])
        >>> counter.steps
        4
    """

    def on_step_end(self, ctx: Context) -> None:
        """After every optimizer step."""

    def on_epoch_end(self, ctx: Context) -> None:
        """After each epoch's history row (and validation), before the checkpoint."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must hold to resume this callback exactly."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``."""


class Hooks:
    """``fit``'s callbacks, checked and sorted by kind; runs them at their points."""

    def __init__(self, callbacks: Sequence[Callback | Callable[[History], Any]], api: str):
        self.objects: list[Callback] = []
        self.plain: list[Callable[[History], Any]] = []
        for k, cb in enumerate(callbacks):
            if isinstance(cb, Callback):
                self.objects.append(cb)
            elif callable(cb):
                self.plain.append(cb)
            else:
                raise TypeError(
                    f"{api}: `callbacks[{k}]` must be callable (fn(history)) or a "
                    f"vmapens.Callback, got {type(cb).__name__}"
                )
        # A Context per step costs a little; build none when no callback looks at steps.
        self.per_step = [
            cb for cb in self.objects if type(cb).on_step_end is not Callback.on_step_end
        ]

    def step_end(self, loop: Any, epoch: int, losses: Tensor) -> None:
        if self.per_step:
            ctx = Context(loop, epoch, losses)
            for cb in self.per_step:
                cb.on_step_end(ctx)

    def epoch_end(self, loop: Any, epoch: int) -> None:
        if self.objects:
            ctx = Context(loop, epoch, loop.history.train_loss[-1])
            for cb in self.objects:
                cb.on_epoch_end(ctx)

    def after_checkpoint(self, history: History) -> None:
        for cb in self.plain:
            cb(history)

    def state_dict(self) -> list[tuple[str, dict[str, Any]]]:
        """(class name, state) of every stateful callback, in order."""
        states = [(type(cb).__name__, cb.state_dict()) for cb in self.objects]
        return [(name, state) for name, state in states if state]

    def load_state_dict(self, states: list[tuple[str, dict[str, Any]]]) -> None:
        stateful = [cb for cb in self.objects if cb.state_dict()]
        names = [type(cb).__name__ for cb in stateful]
        stored = [name for name, _ in states]
        if names != stored:
            raise ValueError(
                f"the checkpoint holds the state of callbacks {stored}, this run has stateful "
                f"callbacks {names}; pass the same callbacks to resume"
            )
        for cb, (_, state) in zip(stateful, states, strict=True):
            cb.load_state_dict(state)
