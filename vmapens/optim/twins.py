"""The stacked twin of a torch optimizer class, and why some have none."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._hyper import Params, PerMember
from .adadelta import StackedAdadelta
from .adafactor import StackedAdafactor
from .adagrad import StackedAdagrad
from .adam import StackedAdam
from .adamax import StackedAdamax
from .asgd import StackedASGD
from .base import StackedOptimizer
from .muon import StackedMuon
from .nadam import StackedNAdam
from .radam import StackedRAdam
from .rmsprop import StackedRMSprop
from .rprop import StackedRprop
from .sgd import StackedSGD

__all__ = ["REFUSED", "TWINS", "stacked", "stacked_adamw"]


def stacked_adamw(
    params: Params,
    lr: PerMember = 1e-3,
    betas: tuple[PerMember, PerMember] = (0.9, 0.999),
    eps: PerMember = 1e-8,
    weight_decay: PerMember = 1e-2,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
    **implementation: Any,
) -> StackedAdam:
    """``torch.optim.AdamW``'s twin: :class:`StackedAdam` with decoupled weight decay, called
    as ``AdamW`` is, with its defaults (``weight_decay=1e-2``, where Adam's is 0).

    Args:
        params, lr, betas, eps, weight_decay, amsgrad, maximize, **implementation: As for
            :class:`StackedAdam` (each hyperparameter a float or one per member), in
            ``torch.optim.AdamW``'s order.

    Returns:
        A :class:`StackedAdam` with ``decoupled_weight_decay=True``.

    Example:
        >>> stacked_adamw([torch.zeros(2, 3, requires_grad=True)]).param_groups[0]["weight_decay"]
        0.01
    """
    return StackedAdam(
        params,
        lr,
        betas,
        eps,
        weight_decay,
        decoupled_weight_decay=True,
        amsgrad=amsgrad,
        maximize=maximize,
        **implementation,
    )


#: torch.optim class -> its stacked twin, with the torch class's defaults (AdamW:
#: StackedAdam with decoupled weight decay and AdamW's weight_decay=1e-2).
TWINS: dict[type[torch.optim.Optimizer], Callable[..., StackedOptimizer]] = {
    torch.optim.SGD: StackedSGD,
    torch.optim.Adam: StackedAdam,
    torch.optim.AdamW: stacked_adamw,
    torch.optim.RMSprop: StackedRMSprop,
    torch.optim.Adagrad: StackedAdagrad,
    torch.optim.Adamax: StackedAdamax,
    torch.optim.NAdam: StackedNAdam,
    torch.optim.RAdam: StackedRAdam,
    torch.optim.Adadelta: StackedAdadelta,
    torch.optim.Rprop: StackedRprop,
    torch.optim.ASGD: StackedASGD,
    torch.optim.Adafactor: StackedAdafactor,
    torch.optim.Muon: StackedMuon,
}

#: torch.optim classes with no stacked twin, and why.
REFUSED: dict[type[torch.optim.Optimizer], str] = {
    torch.optim.LBFGS: (
        "it needs a closure that re-evaluates the loss several times per step (its line "
        "search and inner iterations stop on conditions of its own), so members would have to "
        "share one sequence of evaluations; train one LBFGS per member instead"
    ),
    torch.optim.SparseAdam: (
        "it takes sparse gradients only, and stacked parameters get dense gradients. "
        "StackedAdam is no replacement: it updates every row, so rows the batch did not index "
        "keep moving and their moments decay, where SparseAdam leaves them as they were. For "
        "SparseAdam's results, train one SparseAdam per member (ens.unstack())"
    ),
}


def stacked(torch_class: type[torch.optim.Optimizer]) -> Callable[..., StackedOptimizer]:
    """The stacked optimizer that updates each member as ``torch_class`` would update it alone.

    Args:
        torch_class: A ``torch.optim`` optimizer class.

    Returns:
        The stacked class (for ``AdamW``, :func:`stacked_adamw`: ``StackedAdam`` with
        ``decoupled_weight_decay=True`` and AdamW's ``weight_decay=1e-2``), to be called as the
        torch class is, with stacked parameters; its defaults are the torch class's.

    Raises:
        ValueError: ``torch_class`` has no stacked twin (LBFGS, SparseAdam: the reason says
            why) or is not a torch optimizer class vmapens knows.

    Example:
        >>> stacked(torch.optim.RAdam).__name__
        'StackedRAdam'
    """
    if torch_class in TWINS:
        return TWINS[torch_class]
    name = getattr(torch_class, "__name__", repr(torch_class))
    if torch_class in REFUSED:
        raise ValueError(
            f"stacked: `torch_class` {name} has no stacked twin: {REFUSED[torch_class]}"
        )
    known = ", ".join(sorted(c.__name__ for c in TWINS))
    raise ValueError(
        f"stacked: `torch_class` must be one of {known}, got {name}; for an optimizer of your "
        "own, subclass vmapens.StackedOptimizer with its `rule` (docs/optim.md; Lion ships as "
        "vmapens.StackedLion), or use an elementwise one directly over `ens.parameters()` with "
        "shared hyperparameters"
    )
