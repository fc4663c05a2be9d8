"""The callback protocol of ``fit``: :class:`Callback` hooks and the :class:`Context` they see.

``fit`` is a short driver over a list of callbacks: divergence handling, early stopping with
best-epoch restore, schedulers, checkpointing and the progress bar are callbacks like the ones
a user writes, each owning its state. ``fit(callbacks=[...])`` also takes plain callables
``fn(history)``: observers run after each epoch, *after* the checkpoint is written (raising
from one interrupts training, and a resumed run continues from the checkpoint just written).

A :class:`Callback`'s ``on_epoch_end`` runs *before* the checkpoint is written, so what it
changes (members copied or stopped, hyperparameters perturbed, its own state) is in the
checkpoint and a resumed run continues exactly. A callback with state gives it through
``state_dict()`` / ``load_state_dict()``; the checkpoint stores it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from .._checks import index_rows
from .._data import Stream
from .._precision import LossScale
from ..distributed import all_reduce_stats
from ..ensemble import Ensemble
from ..history import History
from ..optim import StackedOptimizer

__all__ = ["Callback", "Context"]


class Context:
    """What a :class:`Callback` sees: the run, between steps and epochs.

    ``fit`` builds one per run and hands the same object to every hook.

    Attributes:
        ensemble: the ensemble being trained.
        optimizer: its optimizer.
        epoch: the epoch (0-based) running or just ended.
        step: optimizer steps done so far in the whole run (resumed runs included).
        losses: ``[n]`` detached: this step's per-member losses in ``on_step_end``, the
            epoch's mean training losses (``history.train_loss[-1]``) in ``on_epoch_end``.
        history: the :class:`History` so far (this epoch's row included at epoch end).
        callbacks: every :class:`Callback` of the run, in the order their hooks run.
        epochs: the epoch the run ends at (``fit(epochs=)``).
        steps_per_epoch: optimizer steps per epoch, ``None`` when unknown before a pass.
        seed: the run's seed (``None`` until ``fit`` drew it or a checkpoint gave it).
        arguments: ``fit``'s arguments by name (the resume check compares them).
    """

    def __init__(
        self,
        ens: Ensemble,
        optimizer: torch.optim.Optimizer,
        history: History,
        callbacks: list[Callback],
        arguments: dict[str, Any],
        loss_scale: LossScale | None = None,
    ) -> None:
        self.ensemble, self.optimizer, self.history = ens, optimizer, history
        self.callbacks, self.arguments, self.loss_scale = callbacks, arguments, loss_scale
        self.epoch, self.step, self.epochs = 0, 0, int(arguments.get("epochs", 1))
        self.steps_per_epoch: int | None = None
        self.seed: int | None = arguments.get("seed")
        self.losses = torch.zeros(0)
        self.stream = Stream(None)  # fit gives it its source once the seed is known
        # On the device, updated without a host sync per step; False freezes a member whole.
        self._active = torch.ones(len(ens), dtype=torch.bool, device=_device(ens))
        # Members that trained during this epoch (fit sets it at the epoch's end).
        self.running = torch.ones(len(ens), dtype=torch.bool)

    @property
    def active(self) -> Tensor:
        """``[n]`` bool, True for members still training (a copy)."""
        return self._active.clone()

    def stop(self, members: Any) -> None:
        """Stop training ``members`` (a row, rows, or an ``[n]`` bool mask) from now on, as early
        stopping would.

        They are frozen through the optimizer's mask and ``history.stopped_epoch`` records
        this epoch; ``fit``'s schedulers step them no more (their learning rates stay as they
        are now). No members (``[]``, an empty index tensor) stops nobody.

        Raises:
            TypeError: the optimizer is not a ``vmapens.StackedOptimizer`` (nothing could
                freeze the members: they would train on while recorded as stopped).
        """
        if not isinstance(self.optimizer, StackedOptimizer):
            raise TypeError(
                "Context.stop: stopped members are frozen through a vmapens.StackedOptimizer's "
                f"mask, and this run's optimizer is {type(self.optimizer).__name__}, which would "
                "train them on; use a stacked optimizer (fit's default StackedAdam, or "
                "vmapens.optim.stacked(torch.optim.<Name>))"
            )
        stop = torch.zeros(len(self.ensemble), dtype=torch.bool)
        stop[_rows("Context.stop", members, len(self.ensemble))] = True
        self._stop(stop & self._active.cpu())

    def _stop(self, stop: Tensor) -> None:
        """Record ``stop`` (``[n]`` bool) as stopped at this epoch and freeze those members."""
        h = self.history
        h.stopped_epoch = torch.where(stop, self.epoch, h.stopped_epoch)
        self._active &= ~stop.to(self._active.device)

    def inherit(self, src: Any, dst: Any) -> None:
        """Members ``dst`` take over the run's bookkeeping of members ``src``, row by row.

        Every callback's ``on_inherit`` moves its own (early stopping: the best score so far,
        the patience count, the best-epoch snapshot it restores, ``history.best_epoch``): call
        it after copying the members themselves (``vmapens.pbt.exploit_``), as ``vmapens.pbt.PBT``
        does.
        """
        n = len(self.ensemble)
        s, d = _rows("Context.inherit", src, n), _rows("Context.inherit", dst, n)
        if len(s) != len(d):
            raise ValueError(
                f"Context.inherit: `src` and `dst` must have the same length, got {len(s)} and "
                f"{len(d)}"
            )
        for cb in self.callbacks:
            cb.on_inherit(self, s, d)

    def totals(self, losses: Tensor | None = None) -> dict[str, float]:
        """Members still training and their loss statistics, over all ranks (a collective)."""
        active = self._active.cpu()
        live = torch.zeros(0) if losses is None else losses.detach().double().cpu()[active]
        sums = all_reduce_stats(
            {"training": active.sum(), "members": active.numel(), "sum": live.sum()}
        )
        low = all_reduce_stats({"min": live.min() if live.numel() else math.inf}, "min")
        high = all_reduce_stats({"max": live.max() if live.numel() else -math.inf}, "max")
        return {**sums, **low, **high}

    def state_dict(self) -> dict[str, Any]:
        """Where training stands: data position, who trains, step count, loss scales."""
        return {
            "pass": self.stream.pass_,
            "pos": self.stream.pos,
            # DataLoaders only (tensor data reshuffles from `seed`): the RNG their pass began with.
            "pass_rng": self.stream.pass_rng,
            "active": self._active.cpu(),
            "global_step": self.step,
            "loss_scale": None if self.loss_scale is None else self.loss_scale.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()`` (checked first; nothing changes on error)."""
        n = len(self.ensemble)
        active = state.get("active")
        if not isinstance(active, Tensor) or tuple(active.shape) != (n,):
            raise ValueError(f"loop state `active` is not [{n}]")
        if (state.get("loss_scale") is None) != (self.loss_scale is None):
            raise ValueError("loss-scale state does not match (precision='fp16' in one run only)")
        if self.loss_scale is not None:
            self.loss_scale.load_state_dict(state["loss_scale"])
        self.step = state.get("global_step", 0)
        self.stream.pass_, self.stream.pos = state["pass"], state["pos"]
        self.stream.resumed_rng = state.get("pass_rng")
        self._active.copy_(active)


def _rows(api: str, members: Any, n: int) -> Tensor:
    """``members`` as rows; an empty selection as no rows (``index_rows`` refuses it, as an
    Ensemble of no members): ``ctx.stop(bad.nonzero().flatten())`` stops nobody when no member
    is bad, as ``ctx.stop(bad)`` with an all-False mask does. One member (``ctx.stop(3)``, a
    numpy or 0-d tensor integer) is a row, and a list of ``n`` bools a mask, as torch indexes."""
    if isinstance(members, (list, tuple)) and members and all(type(m) is bool for m in members):
        members = torch.tensor(members)
    if isinstance(members, Tensor) or type(members).__module__ == "numpy":
        mask = "bool" in str(members.dtype)  # torch's or numpy's: a mask keeps its shape check
        empty = not mask and members.ndim == 1 and len(members) == 0
    else:
        empty = isinstance(members, Sequence) and not isinstance(members, str) and not members
    return torch.zeros(0, dtype=torch.int64) if empty else index_rows(api, members, n)


def _device(ens: Ensemble) -> torch.device:
    return next(ens.parameters()).device


class Callback:
    """Base class of stateful, step- and epoch-level callbacks (see the module docstring).

    Override what you need; the defaults do nothing. ``state_dict()`` returns ``{}`` when
    there is nothing to checkpoint. Hooks run in the order of ``ctx.callbacks``.

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

    #: Where a checkpoint keeps this callback's state: ``None`` in the list of callback states
    #: (matched by class name), or a top-level part name (``"scheduler"``) or ``"fit"`` (merged
    #: into the loop state) for built-in callbacks whose per-member rows a sharded checkpoint
    #: splits by rank (``vmapens.sharding``).
    state_key: ClassVar[str | None] = None

    def on_fit_start(self, ctx: Context) -> None:
        """Before the first step (and before a resume): check the run, build what it needs.

        Raise here, before anything changes, when the run cannot work with this callback.
        """

    def on_train_start(self, ctx: Context) -> None:
        """After every ``on_fit_start`` (a resume included), the data ready: before the loop."""

    def on_epoch_start(self, ctx: Context) -> None:
        """Before each epoch's first step."""

    def on_step_end(self, ctx: Context) -> None:
        """After every optimizer step."""

    def on_epoch_end(self, ctx: Context) -> None:
        """After each epoch's history row (and validation), before the checkpoint."""

    def on_fit_end(self, ctx: Context) -> None:
        """After the last epoch, when training ended normally."""

    def teardown(self, ctx: Context) -> None:
        """At the very end, also when training raised: release files, bars, writers."""

    def on_inherit(self, ctx: Context, src: Tensor, dst: Tensor) -> None:
        """Rows ``dst`` take over this callback's per-member bookkeeping of rows ``src``."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must hold to resume this callback exactly."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``."""


Observer = Callable[[History], Any]
