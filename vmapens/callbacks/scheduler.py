"""Learning-rate schedulers in ``fit``: built on the optimizer, stepped per epoch or per step."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from .._checks import check_choice
from .._step_parts import attached_scheduler
from ..optim import MemberValues, ReduceLROnPlateau, StackedOptimizer
from ..optim._hyper import per_member
from .base import Callback, Context

__all__ = ["LRScheduler", "attached_scheduler", "build_scheduler", "step_keeping"]


#: ReduceLROnPlateau's record of the run so far: a best value, a bad-epoch count, a cooldown.
_RECORD = ("best", "num_bad_epochs", "cooldown_counter")


class LRScheduler(Callback):
    """Step a learning-rate scheduler after every epoch, or after every optimizer step.

    ``fit(scheduler=s)`` is ``callbacks=[LRScheduler(s)]``. A torch scheduler
    (``torch.optim.lr_scheduler.StepLR``, ...) follows each member's own learning rate;
    ``vmapens.optim.ReduceLROnPlateau`` steps after every epoch on each member's validation loss (it
    needs ``val_data`` and ``interval="epoch"``, checked before the first step). The scheduler's
    state is in the checkpoint.

    A member that stopped training (early stopping, divergence, ``Context.stop``) is not
    stepped by the scheduler, as its own scheduler would no longer be stepped in a plain loop:
    its learning rate (and what else the schedule sets, such as OneCycleLR's momentum) stays
    as it was when it stopped, one value per member (``MemberValues``) from then on. The
    schedulers run after ``Divergence`` and ``EarlyStopping``, so a member they stop at a step
    or an epoch's end misses that step's or epoch's scheduler step. A 0-d tensor
    hyperparameter holds one value for every member (torch's schedulers ``fill_`` it): the
    stopped members' value then moves on with the others' (a ``UserWarning`` says so).

    Args:
        scheduler: an LR scheduler over the optimizer ``fit`` trains with, or a callable
            ``scheduler(optimizer)`` building one (use that with ``fit``'s default optimizer).
        interval: ``"epoch"`` or ``"step"``.

    Raises:
        ValueError: a bad ``interval``; at fit start, a scheduler on another optimizer, or
            ``vmapens.optim.ReduceLROnPlateau`` per step or without ``val_data``.
        TypeError: torch's ``ReduceLROnPlateau``, or something that is no scheduler.

    Example:
        >>> import torch
        >>> from vmapens import Ensemble, fit
        >>> from vmapens.callbacks import LRScheduler
        >>> ens = Ensemble(lambda: torch.nn.Linear(3, 1), n=2, seed=0)
        >>> cosine = LRScheduler(lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, 8),
        ...                      interval="step")
        >>> _ = fit(ens, (torch.randn(16, 3), torch.randn(16, 1)), torch.nn.MSELoss(),
        ...         epochs=2, batch_size=4, progress=False, callbacks=[cosine], lr=0.1)
        >>> cosine.scheduler.last_epoch
        8
    """

    state_key = "scheduler"  # vmapens.optim.ReduceLROnPlateau's per-member rows are split by rank

    def __init__(self, scheduler: Any, interval: str = "epoch") -> None:
        check_choice("LRScheduler", "interval", interval, ("epoch", "step"))
        self.given, self.interval = scheduler, interval
        self.scheduler: Any = None
        self._warned = False

    def on_fit_start(self, ctx: Context) -> None:
        validated = ctx.history.val_loss is not None
        self.scheduler = build_scheduler("fit", self.given, ctx.optimizer, self.interval, validated)
        if isinstance(self.scheduler, ReduceLROnPlateau):
            # What torch's schedulers do when built: keep each group's lr as built in
            # `initial_lr`, which the resume check compares while the scheduler moves `lr`
            # (the same objects going on after an interrupt have an lr past the checkpoint's).
            for group in ctx.optimizer.param_groups:
                lr = group["lr"]
                group.setdefault("initial_lr", lr.clone() if isinstance(lr, Tensor) else lr)

    def on_step_end(self, ctx: Context) -> None:
        if self.interval == "step":
            self._step(ctx, _stopped_at_step(ctx))

    def on_epoch_end(self, ctx: Context) -> None:
        stopped = ~ctx._active.cpu()
        if isinstance(self.scheduler, ReduceLROnPlateau):
            assert ctx.history.val_loss is not None  # build_scheduler checked there is val_data
            mask = ~stopped if bool(stopped.any()) else None
            self.scheduler.step(ctx.history.val_loss[-1], mask=mask)
        elif self.interval == "epoch":
            self._step(ctx, stopped)
        elif ctx._active.device.type != "cpu":
            self._warn_diverged(ctx)

    def _step(self, ctx: Context, stopped: Tensor) -> None:
        """Step the torch scheduler, then give the ``stopped`` members (``[n]`` bool) back
        each group value the step changed for them."""
        shared = step_keeping(self.scheduler, ctx.optimizer, stopped, self.scheduler.step)
        if shared is not None:
            self._warn_tensor(shared)

    def _warn_tensor(self, key: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"fit: the scheduler changed `{key}`, a 0-d tensor, for the members that stopped "
                "training too: a tensor holds one value for all members (torch's schedulers "
                f"fill_ it), so theirs moves on with the others'; give `{key}` as a float or one "
                "value per member to keep a stopped member's value",
                stacklevel=3,
            )

    def _warn_diverged(self, ctx: Context) -> None:
        """On an accelerator a per-step scheduler learns of a member that diverged mid-epoch at
        the epoch's end (reading ``ctx._active`` on the host every step would wait for the
        device every step): it stepped that member's values until then."""
        h = ctx.history
        late = h.diverged & (h.stopped_epoch == ctx.epoch)
        if bool(late.any()) and isinstance(ctx.optimizer, StackedOptimizer):
            warnings.warn(
                f"fit: members {late.nonzero().flatten().tolist()} diverged during epoch "
                f"{ctx.epoch}; on {ctx._active.device.type} the per-step scheduler kept stepping "
                "their learning rates until the epoch's end (on the CPU they stop at the step "
                "they diverged at)",
                stacklevel=3,
            )

    def on_inherit(self, ctx: Context, src: Tensor, dst: Tensor) -> None:
        # vmapens.optim.ReduceLROnPlateau keeps a best value, a bad-epoch count and a cooldown
        # per member: a copy (PBT) takes its source's, or its lr would follow its old record.
        if not isinstance(self.scheduler, ReduceLROnPlateau):
            return
        for key in _RECORD:
            rows = getattr(self.scheduler, key)
            taken = [rows[i] for i in src.tolist()]  # every row read before any is written
            for j, value in zip(dst.tolist(), taken, strict=True):
                rows[j] = value

    def settings(self) -> dict[str, Any] | None:
        """The scheduler's own settings (not what it derived from the optimizer) and the
        interval, for the resume check; ``None`` before ``fit`` built it."""
        if self.scheduler is None:
            return None
        return {"class": type(self.scheduler).__name__, "interval": self.interval,
                **_own_settings(self.scheduler)}  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        return {} if self.scheduler is None else self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)


def step_keeping(scheduler: Any, opt: Any, stopped: Tensor, step: Any) -> str | None:
    """``step()`` (a step of ``scheduler`` on ``opt``), then the ``stopped`` members (``[n]``
    bool) given back each group value it changed for them, as their own schedulers, no longer
    stepped, would leave it (``fit``'s callback and ``vmapens.lightning``). Returns the name
    of a value that could not be kept (a 0-d tensor: one value for all), else None."""
    if not isinstance(opt, StackedOptimizer) or not bool(stopped.any()):
        step()  # the common path: nothing to keep
        return None
    before = [
        {k: v.clone() if isinstance(v, Tensor) else v for k, v in g.items() if k != "params"}
        for g in opt.param_groups
    ]
    step()
    rows, shared = stopped.tolist(), None
    for group, old in zip(opt.param_groups, before, strict=True):
        for key, value in old.items():
            kept = _keep_rows(value, group[key], rows)
            if kept is _SHARED:
                shared = key
            else:
                group[key] = kept
    if isinstance(getattr(scheduler, "_last_lr", None), list):  # get_last_lr()
        scheduler._last_lr = [
            g["lr"].clone() if isinstance(g["lr"], Tensor) else g["lr"] for g in opt.param_groups
        ]
    return shared


#: What :func:`_keep_rows` gives for a value that holds one number for every member.
_SHARED = object()


def _stopped_at_step(ctx: Context) -> Tensor:
    """``[n]`` bool, the members a per-step scheduler leaves alone: those not training, read
    from ``ctx._active`` on the CPU; on an accelerator those the host knows stopped
    (``history.stopped_epoch``), without waiting for the device: one that diverged during
    this epoch is known at the epoch's end."""
    if ctx._active.device.type == "cpu":
        return ~ctx._active
    return ctx.history.stopped_epoch >= 0


def _keep_rows(old: Any, new: Any, stopped: list[bool]) -> Any:
    """``new``, one group value as a scheduler step left it, with the ``stopped`` members'
    rows of ``old`` (its value before the step) put back: ``MemberValues`` where members then
    differ, ``new`` itself where the step changed none of theirs. ``_SHARED`` where that cannot
    be held: a 0-d tensor changed (one value for all members)."""
    if new is old:
        return new
    if isinstance(old, tuple) and isinstance(new, tuple) and len(old) == len(new):
        parts = [_keep_rows(o, w, stopped) for o, w in zip(old, new, strict=True)]
        return _SHARED if any(p is _SHARED for p in parts) else tuple(parts)
    olds, news = per_member(old, len(stopped)), per_member(new, len(stopped))
    if olds is None or news is None:  # not a number: torch's schedulers set numbers only
        if isinstance(old, Tensor) and isinstance(new, Tensor):
            return new if torch.equal(old, new) else _SHARED
        return new
    if all(o == w for o, w, s in zip(olds, news, stopped, strict=True) if s):
        return new
    return MemberValues(o if s else w for o, w, s in zip(olds, news, stopped, strict=True))


def _own_settings(scheduler: Any) -> dict[str, Any]:
    """``scheduler``'s own settings as text, and those of the schedulers a ``SequentialLR`` /
    ``ChainedScheduler`` holds with its milestones (their state keys start with ``_``, which a
    resume compared as nothing: another inner scheduler or milestone resumed unnoticed, and
    the checkpoint's states then overwrote this run's)."""
    state = scheduler.state_dict()
    own = {k: repr(v) for k, v in state.items() if not k.startswith("_")}
    # Derived from the optimizer, or the run's state (ReduceLROnPlateau's record, one
    # entry per member here: a rank's block or another world size holds other members).
    # default_min_lr: whether min_lr was one value, which min_lrs shows; checkpoints
    # written before the per-member ReduceLROnPlateau kept it hold no such setting.
    for derived in ("base_lrs", "last_epoch", "optimizer", "default_min_lr", *_RECORD):
        own.pop(derived, None)
    if "_milestones" in state:
        own["milestones"] = repr(state["_milestones"])
    inner = getattr(scheduler, "_schedulers", None)
    if inner:
        own["schedulers"] = repr([{"class": type(s).__name__, **_own_settings(s)} for s in inner])
    return own


def build_scheduler(
    api: str,
    scheduler: Any,
    optimizer: torch.optim.Optimizer,
    interval: str = "epoch",
    validated: bool = True,
) -> Any:
    """``scheduler`` itself, or ``scheduler(optimizer)`` when it is a builder; checked.

    ``vmapens.optim.ReduceLROnPlateau`` steps on each member's validation loss, which exists once per
    epoch: it needs validation data and ``interval="epoch"``. Both are checked here, before the
    first step, so a wrong combination changes nothing.
    """
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise TypeError(
            f"{api}: `scheduler` is torch's ReduceLROnPlateau, which lowers every member's "
            "learning rate on one number; use vmapens.optim.ReduceLROnPlateau, which follows each "
            "member's own validation loss"
        )
    if isinstance(scheduler, type) or not (
        hasattr(scheduler, "step") and hasattr(scheduler, "state_dict")
    ):
        if not callable(scheduler):
            # fit(scheduler=LRScheduler(s, interval="step")) reads as the per-step shortcut
            hint = "; give an LRScheduler in `callbacks=[...]`" * isinstance(scheduler, Callback)
            raise TypeError(
                f"{api}: `scheduler` must be an LR scheduler or a callable building one from the "
                f"optimizer, got {type(scheduler).__name__}{hint}"
            )
        scheduler = scheduler(optimizer)
        return build_scheduler(api, scheduler, optimizer, interval, validated)
    _refuse_nested_plateau(api, scheduler)
    if getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise ValueError(
            f"{api}: `scheduler` was built on another optimizer; build it on the one fit "
            "trains with (pass a builder, lambda opt: StepLR(opt, ...), for the default one)"
        )
    if isinstance(scheduler, ReduceLROnPlateau):
        if interval != "epoch":
            raise ValueError(
                f"{api}: `LRScheduler.interval` must be 'epoch' with vmapens.optim.ReduceLROnPlateau, "
                f"which steps on each member's validation loss (measured once per epoch), got "
                f"{interval!r}"
            )
        if not validated:
            raise ValueError(
                f"{api}: `scheduler` vmapens.optim.ReduceLROnPlateau steps on each member's "
                "validation loss and needs `val_data`, got None"
            )
    return scheduler


def _refuse_nested_plateau(api: str, scheduler: Any, outer: str = "") -> None:
    """Refuse a ReduceLROnPlateau inside a ``ChainedScheduler`` / ``SequentialLR``.

    Those step what they hold without a metric, so vmapens's ReduceLROnPlateau (torch refuses
    its own there) failed at the first epoch's end, after an epoch of training.
    """
    for k, inner in enumerate(getattr(scheduler, "_schedulers", None) or ()):
        where = f"{outer}{type(scheduler).__name__}[{k}]"
        if isinstance(inner, (ReduceLROnPlateau, torch.optim.lr_scheduler.ReduceLROnPlateau)):
            raise ValueError(
                f"{api}: `scheduler` holds a ReduceLROnPlateau inside {where}, which steps it "
                "without the validation loss it needs; give vmapens.optim.ReduceLROnPlateau as "
                "`scheduler=` on its own and the other schedulers as "
                "`callbacks=[vmapens.callbacks.LRScheduler(...)]` (each steps after every epoch, "
                "the `scheduler=` one first)"
            )
        _refuse_nested_plateau(api, inner, f"{where} > ")
