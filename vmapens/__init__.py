"""vmapens: train many same-architecture PyTorch networks at once.

The core is here: the :class:`Ensemble` container, the verbs over it (``fit``, ``make_step``,
``predict``, ``check``, ``export``, ``save``/``load``/``restore``, ``save_members``/
``load_members``/``load_member``, ``gather``/``gather_history``), the stacked optimizers,
``History``, ``Callback``, ``LossScale``, ``per_member``, ``CompiledStepMismatch`` and
``CompileFailed``. The rest lives in namespaces: ``vmapens.optim`` (update rules, clipping,
``MemberValues``, ``ReduceLROnPlateau``), ``vmapens.callbacks`` (early stopping, schedulers,
checkpoints, progress, loggers), ``vmapens.seeds``, ``vmapens.rl``, ``vmapens.pbt``,
``vmapens.sweep``, ``vmapens.selection``, ``vmapens.swa`` (``update_bn`` for
``torch.optim.swa_utils.AveragedModel(ens)``) and the optional ``vmapens.lightning``.
"""

# The namespaces, reachable as vmapens.optim etc. after `import vmapens`.
from . import callbacks as callbacks
from . import optim as optim
from . import pbt as pbt
from . import rl as rl
from . import seeds as seeds
from . import selection as selection
from . import swa as swa
from . import sweep as sweep
from ._compiling import CompileFailed
from ._mkl import warm_vml
from ._precision import LossScale
from ._update_check import CompiledStepMismatch
from .callbacks import Callback
from .checkpoint import load, restore, save
from .ensemble import Ensemble
from .export import export
from .fit import fit
from .history import History
from .losses import per_member
from .member_files import load_member, load_members, save_members
from .optim import (
    StackedAdadelta,
    StackedAdafactor,
    StackedAdagrad,
    StackedAdam,
    StackedAdamax,
    StackedASGD,
    StackedLion,
    StackedMuon,
    StackedNAdam,
    StackedOptimizer,
    StackedRAdam,
    StackedRMSprop,
    StackedRprop,
    StackedSGD,
)
from .predict import predict
from .selfcheck import check
from .sharding import gather, gather_history
from .step import make_step

# MKL's vector math picks its kernels before any op runs it on several threads (_mkl.py).
warm_vml()

__all__ = [
    "Callback",
    "CompileFailed",
    "CompiledStepMismatch",
    "Ensemble",
    "History",
    "LossScale",
    "StackedASGD",
    "StackedAdadelta",
    "StackedAdafactor",
    "StackedAdagrad",
    "StackedAdam",
    "StackedAdamax",
    "StackedLion",
    "StackedMuon",
    "StackedNAdam",
    "StackedOptimizer",
    "StackedRAdam",
    "StackedRMSprop",
    "StackedRprop",
    "StackedSGD",
    "check",
    "export",
    "fit",
    "gather",
    "gather_history",
    "load",
    "load_member",
    "load_members",
    "make_step",
    "per_member",
    "predict",
    "restore",
    "save",
    "save_members",
]
__version__ = "0.3.0"

#: Top-level names of 0.2 that moved to a namespace in 0.3.0 (CHANGELOG), and where to.
_MOVED = {
    "CSVLogger": "vmapens.callbacks.CSVLogger",
    "Context": "vmapens.callbacks.Context",
    "TensorBoardLogger": "vmapens.callbacks.TensorBoardLogger",
    "MemberValues": "vmapens.optim.MemberValues",
    "ReduceLROnPlateau": "vmapens.optim.ReduceLROnPlateau",
    "adam_update": "vmapens.optim.adam_update",
    "adam_update_": "vmapens.optim.adam_update_",
    "sgd_update_": "vmapens.optim.sgd_update_",
    "clip_grad_norm_": "vmapens.optim.clip_grad_norm_",
    "clip_grad_value_": "vmapens.optim.clip_grad_value_",
    "PBT": "vmapens.pbt.PBT",
    "exploit_": "vmapens.pbt.exploit_",
    "explore": "vmapens.pbt.explore",
    "Sweep": "vmapens.sweep.Sweep",
    "best_k": "vmapens.selection.best_k",
    "make_target": "vmapens.rl.make_target",
    "polyak_": "vmapens.rl.polyak_",
    "random_members": "vmapens.rl.random_members",
    "member_seed": "vmapens.seeds.member_seed",
    "bootstrap_indices": "vmapens.seeds.bootstrap_indices",
}


def __getattr__(name: str) -> object:
    if name in _MOVED:
        raise AttributeError(f"vmapens.{name} moved to {_MOVED[name]} in 0.3.0")
    if name in optim.SPELLED:
        raise AttributeError(f"module 'vmapens' has no attribute {name!r}: {optim.SPELLED[name]}")
    raise AttributeError(f"module 'vmapens' has no attribute {name!r}")
