"""vmapens: train many same-architecture PyTorch networks at once."""

from ._data import bootstrap_indices
from ._seeds import member_seed
from .checkpoint import load, restore, save, save_members
from .ensemble import Ensemble
from .fit import fit
from .history import History
from .losses import per_member
from .optim import (
    MemberValues,
    ReduceLROnPlateau,
    StackedAdagrad,
    StackedAdam,
    StackedAdamax,
    StackedLion,
    StackedNAdam,
    StackedOptimizer,
    StackedRMSprop,
    StackedSGD,
    adam_update,
    adam_update_,
    clip_grad_norm_,
    clip_grad_value_,
    sgd_update_,
)
from .sharding import gather, gather_history
from .step import make_step

__all__ = [
    "Ensemble",
    "History",
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
    "adam_update",
    "adam_update_",
    "bootstrap_indices",
    "clip_grad_norm_",
    "clip_grad_value_",
    "fit",
    "gather",
    "gather_history",
    "load",
    "make_step",
    "member_seed",
    "per_member",
    "restore",
    "save",
    "save_members",
    "sgd_update_",
]
__version__ = "0.2.0"
