"""Stacked optimizers: one base and one short file per update rule."""

from ._values import MemberValues
from .adam import StackedAdam, adam_update, adam_update_
from .base import StackedOptimizer
from .clip import clip_grad_norm_, clip_grad_value_
from .sgd import StackedSGD, sgd_update_

__all__ = [
    "MemberValues",
    "StackedAdam",
    "StackedOptimizer",
    "StackedSGD",
    "adam_update",
    "adam_update_",
    "clip_grad_norm_",
    "clip_grad_value_",
    "sgd_update_",
]
