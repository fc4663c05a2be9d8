"""Learning-rate schedulers inside ``fit``: built on the optimizer, stepped per epoch or step."""

from __future__ import annotations

from typing import Any

import torch

from .history import History
from .optim import ReduceLROnPlateau

__all__ = ["build_scheduler", "step_scheduler"]


def build_scheduler(
    api: str,
    scheduler: Any,
    optimizer: torch.optim.Optimizer,
    interval: str = "epoch",
    validated: bool = True,
) -> Any:
    """``scheduler`` itself, or ``scheduler(optimizer)`` when it is a builder; checked.

    ``vmapens.ReduceLROnPlateau`` steps on each member's validation loss, which exists once per
    epoch: it needs validation data and ``interval="epoch"``. Both are checked here, before the
    first step, so a wrong combination changes nothing.
    """
    if scheduler is None:
        return None
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise TypeError(
            f"{api}: `scheduler` is torch's ReduceLROnPlateau, which lowers every member's "
            "learning rate on one number; use vmapens.ReduceLROnPlateau, which follows each "
            "member's own validation loss"
        )
    if isinstance(scheduler, type) or not (
        hasattr(scheduler, "step") and hasattr(scheduler, "state_dict")
    ):
        if not callable(scheduler):
            raise TypeError(
                f"{api}: `scheduler` must be an LR scheduler or a callable building one from the "
                f"optimizer, got {type(scheduler).__name__}"
            )
        scheduler = scheduler(optimizer)
        return build_scheduler(api, scheduler, optimizer, interval, validated)
    if getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise ValueError(
            f"{api}: `scheduler` was built on another optimizer; build it on the one fit "
            "trains with (pass a builder, lambda opt: StepLR(opt, ...), for the default one)"
        )
    if isinstance(scheduler, ReduceLROnPlateau):
        if interval != "epoch":
            raise ValueError(
                f"{api}: `scheduler_interval` must be 'epoch' with vmapens.ReduceLROnPlateau, "
                f"which steps on each member's validation loss (measured once per epoch), got "
                f"{interval!r}"
            )
        if not validated:
            raise ValueError(
                f"{api}: `scheduler` vmapens.ReduceLROnPlateau steps on each member's "
                "validation loss and needs `val_data`, got None"
            )
    return scheduler


def step_scheduler(scheduler: Any, interval: str, history: History) -> None:
    """The end-of-epoch step: plateau schedulers get each member's validation loss."""
    if isinstance(scheduler, ReduceLROnPlateau):
        assert history.val_loss is not None  # build_scheduler checked there is val_data
        scheduler.step(history.val_loss[-1])
    elif interval == "epoch":
        scheduler.step()
