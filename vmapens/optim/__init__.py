"""Stacked optimizers: one base and one short file per update rule."""

from ._values import MemberValues
from .adagrad import StackedAdagrad, adagrad_update_
from .adam import StackedAdam, adam_update, adam_update_
from .adamax import StackedAdamax, adamax_update_
from .base import StackedOptimizer
from .clip import clip_grad_norm_, clip_grad_value_
from .lion import StackedLion, lion_update_
from .nadam import StackedNAdam, nadam_update_
from .plateau import ReduceLROnPlateau
from .rmsprop import StackedRMSprop, rmsprop_update_
from .sgd import StackedSGD, sgd_update_

__all__ = [
    "MemberValues",
    "ReduceLROnPlateau",
    "StackedAdagrad",
    "StackedAdam",
    "StackedAdamax",
    "StackedLion",
    "StackedNAdam",
    "StackedOptimizer",
    "StackedRMSprop",
    "StackedSGD",
    "adagrad_update_",
    "adam_update",
    "adam_update_",
    "adamax_update_",
    "clip_grad_norm_",
    "clip_grad_value_",
    "lion_update_",
    "nadam_update_",
    "rmsprop_update_",
    "sgd_update_",
]
