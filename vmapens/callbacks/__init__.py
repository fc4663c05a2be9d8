"""Callbacks of ``fit``: what a training run does besides stepping, each one object with its
state. ``fit``'s shortcut keywords build the common ones (``patience`` -> EarlyStopping,
``scheduler`` -> LRScheduler, ``checkpoint`` -> Checkpoint, ``progress`` -> ProgressBar)."""

from .base import Callback, Context
from .checkpointing import Checkpoint
from .divergence import Divergence
from .early_stopping import EarlyStopping
from .loggers import CSVLogger, TensorBoardLogger, epoch_scalars
from .progress import ProgressBar
from .scheduler import LRScheduler

__all__ = [
    "CSVLogger",
    "Callback",
    "Checkpoint",
    "Context",
    "Divergence",
    "EarlyStopping",
    "LRScheduler",
    "ProgressBar",
    "TensorBoardLogger",
    "epoch_scalars",
]
