"""Stacked optimizers: one base and one short file per update rule (a foreach function)."""

from ._values import MemberValues
from .adadelta import StackedAdadelta, adadelta_rule
from .adafactor import StackedAdafactor, adafactor_rule
from .adagrad import StackedAdagrad, adagrad_rule, adagrad_update_
from .adam import StackedAdam, adam_rule, adam_update, adam_update_
from .adamax import StackedAdamax, adamax_rule, adamax_update_
from .asgd import StackedASGD, asgd_rule
from .base import StackedOptimizer
from .clip import clip_grad_norm_, clip_grad_value_
from .lion import StackedLion, lion_rule, lion_update_
from .muon import StackedMuon, muon_rule, newton_schulz
from .nadam import StackedNAdam, nadam_rule, nadam_update_
from .plateau import ReduceLROnPlateau
from .radam import StackedRAdam, radam_rule
from .rmsprop import StackedRMSprop, rmsprop_rule, rmsprop_update_
from .rprop import StackedRprop, rprop_rule
from .sgd import StackedSGD, sgd_rule, sgd_update_
from .twins import stacked

__all__ = [
    "StackedASGD",
    "MemberValues",
    "ReduceLROnPlateau",
    "StackedAdadelta",
    "StackedAdafactor",
    "StackedAdagrad",
    "StackedAdam",
    "StackedAdamax",
    "StackedLion",
    "StackedMuon",
    "StackedNAdam",
    "StackedRAdam",
    "StackedOptimizer",
    "StackedRMSprop",
    "StackedRprop",
    "StackedSGD",
    "adadelta_rule",
    "adafactor_rule",
    "adagrad_rule",
    "asgd_rule",
    "adagrad_update_",
    "adam_update",
    "adam_rule",
    "adam_update_",
    "adamax_rule",
    "adamax_update_",
    "clip_grad_norm_",
    "clip_grad_value_",
    "lion_rule",
    "lion_update_",
    "muon_rule",
    "nadam_rule",
    "nadam_update_",
    "newton_schulz",
    "radam_rule",
    "rmsprop_rule",
    "rmsprop_update_",
    "rprop_rule",
    "sgd_rule",
    "sgd_update_",
    "stacked",
]


#: Names users reach for that vmapens spells otherwise, and how (``vmapens`` says it too).
SPELLED = {
    "StackedAdamW": "torch's AdamW is Adam with decoupled weight decay: "
    "vmapens.StackedAdam(ens, weight_decay=..., decoupled_weight_decay=True), as "
    "torch.optim.Adam(decoupled_weight_decay=True) equals AdamW, or "
    "vmapens.optim.stacked(torch.optim.AdamW)",
}


def __getattr__(name: str) -> object:
    if name in SPELLED:
        raise AttributeError(f"module 'vmapens.optim' has no attribute {name!r}: {SPELLED[name]}")
    raise AttributeError(f"module 'vmapens.optim' has no attribute {name!r}")
