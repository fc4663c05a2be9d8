"""vmapens: train many same-architecture PyTorch networks at once."""

from .ensemble import Ensemble, per_member
from .history import History
from .optim import StackedAdam, adam_update, adam_update_, clip_grad_norm_
from .step import make_step

__all__ = [
    "Ensemble",
    "History",
    "StackedAdam",
    "adam_update",
    "adam_update_",
    "clip_grad_norm_",
    "make_step",
    "per_member",
]
__version__ = "0.1.0"
