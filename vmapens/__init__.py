"""vmapens: train many same-architecture PyTorch networks at once."""

from ._data import bootstrap_indices
from ._seeds import member_seed
from .callbacks import Callback, Context, CSVLogger, TensorBoardLogger
from .checkpoint import load, load_member, restore, save, save_members
from .ensemble import Ensemble
from .export import export
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
from .pbt import PBT, exploit_, explore
from .predict import predict
from .rl import make_target, polyak_, random_members
from .selection import best_k
from .selfcheck import check
from .sharding import gather, gather_history
from .step import make_step
from .sweep import Sweep

__all__ = [
    "CSVLogger",
    "Callback",
    "Context",
    "Ensemble",
    "History",
    "MemberValues",
    "PBT",
    "ReduceLROnPlateau",
    "StackedAdagrad",
    "StackedAdam",
    "StackedAdamax",
    "StackedLion",
    "StackedNAdam",
    "StackedOptimizer",
    "StackedRMSprop",
    "StackedSGD",
    "Sweep",
    "TensorBoardLogger",
    "adam_update",
    "adam_update_",
    "best_k",
    "bootstrap_indices",
    "check",
    "clip_grad_norm_",
    "clip_grad_value_",
    "exploit_",
    "export",
    "explore",
    "fit",
    "gather",
    "gather_history",
    "load",
    "load_member",
    "make_step",
    "make_target",
    "member_seed",
    "per_member",
    "polyak_",
    "predict",
    "random_members",
    "restore",
    "save",
    "save_members",
    "sgd_update_",
]
__version__ = "0.2.0"
