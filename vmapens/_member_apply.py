"""``Ensemble.apply``: a function run on every member in order, as on each member alone, all
or nothing.

Each member (``ens[i]``, a module of the user's class over its rows) runs ``fn``, and its
tensors are written back into their rows. What ``fn`` may change is checked member by member:
tensors' shapes, dtypes and devices, attributes, submodule classes and hooks must stay, and
every member must come out alike; the train/eval modes and ``requires_grad`` flags it set
carry over to the template and the stacked parameters. If a member raises or is refused, the
members done before get their state back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ._hooks import named_tensors
from ._members import check_same, signature
from ._stacking import check_applied, hooks_of

__all__ = ["apply_members"]


def apply_members(api: str, ens: Any, fn: Callable[[nn.Module], None]) -> None:
    """``ens.apply(fn)`` (a ``StackedModule``), ``fn`` checked callable: see its docstring."""
    stacked = ens.stacked_state()
    saved = {name: t.detach().clone() for name, t in stacked.items()}
    reference: tuple = ()
    try:
        with torch.no_grad():
            for i in range(len(ens)):
                member = ens[i]
                before, hooks = signature(member), hooks_of(member)
                member.apply(fn)
                after = signature(member)
                check_applied(api, before, after, hooks, hooks_of(member))
                reference = reference or after
                check_same(reference, member, i, api, shapes=ens._padding is None)
                state = dict(named_tensors(member))
                for name, t in stacked.items():
                    if ens._padding is None:
                        t[i].copy_(state[name])
                    else:
                        ens._padding.put_(name, t[i], state[name], i)
    except BaseException:  # all members or none: the ones done before get their state back
        with torch.no_grad():
            for name, t in stacked.items():
                t.copy_(saved[name])
        raise
    _, grads, modes, _ = reference
    ens.training = modes[""]
    for name, m in ens.template.named_modules():
        m.training = modes[name]
    for name, p in ens.stacked_params().items():
        p.requires_grad_(grads[name][3])
    ens._follow_template()
