"""``Ensemble.apply``: a function run on every member in order, as on each member alone, all
or nothing.

Each member (``ens[i]``, a module of the user's class over its rows) runs ``fn``, and its
tensors are written back into their rows. What ``fn`` may change is checked member by member:
tensors' shapes, dtypes and devices, attributes, submodule classes and hooks must stay, and
every member must come out alike; the train/eval modes and ``requires_grad`` flags it set
carry over to the template and the stacked parameters. If a member raises or is refused, the
members done before get their state back.

A parameter that ``fn`` replaces (``m.bias = nn.Parameter(...)``) gets a new stacked Parameter,
as each member alone gets a new object: an optimizer made before holds the old one and no
longer moves the member's weights, alone and here (``load_state_dict(assign=True)`` adopts
its tensors the same way).
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
    params = set(ens.stacked_params())
    reference: tuple = ()
    replaced: dict[str, torch.Tensor] | None = None  # new storage for the replaced parameters
    try:
        with torch.no_grad():
            for i in range(len(ens)):
                member = ens[i]
                before, hooks = signature(member), hooks_of(member)
                objects = dict(named_tensors(member))
                member.apply(fn)
                after = signature(member)
                check_applied(api, before, after, hooks, hooks_of(member))
                reference = reference or after
                check_same(reference, member, i, api, shapes=ens._padding is None)
                state = dict(named_tensors(member))
                gone = [k for k in stacked if k not in state]
                if gone:
                    raise ValueError(
                        f"{api}: `fn` removed `{gone[0]}` (set it to None or deleted it); the "
                        "ensemble keeps one structure for all members: build the members "
                        "without it, or zero it in place (nn.init.zeros_) and freeze it"
                    )
                new = {k for k in params if state[k] is not objects[k]}
                if replaced is None:
                    replaced = {k: stacked[k].detach().clone() for k in new}
                elif new != set(replaced):
                    raise ValueError(_unalike(api, i, set(replaced), new))
                for name, t in stacked.items():
                    row = replaced[name][i] if name in replaced else t[i]
                    if ens._padding is None:
                        row.copy_(state[name])
                    else:
                        ens._padding.put_(name, row, state[name], i)
    except BaseException:  # all members or none: the ones done before get their state back
        with torch.no_grad():
            for name, t in stacked.items():
                t.copy_(saved[name])
        raise
    if replaced:  # new Parameters, as alone; the old ones keep their values
        ens._adopt({**stacked, **replaced}, ens.member_ids, ens.n_total, ens.training)
    _, grads, modes, _ = reference
    ens.training = modes[""]
    for name, m in ens.template.named_modules():
        m.training = modes[name]
    for name, p in ens.stacked_params().items():
        p.requires_grad_(grads[name][3])
    ens._follow_template()


def _unalike(api: str, i: int, first: set[str], now: set[str]) -> str:
    """The refusal of an ``fn`` that replaced other parameters in member ``i`` than in member 0."""
    names = ", ".join(f"`{k}`" for k in sorted(first ^ now))
    return (
        f"{api}: `fn` replaced {names} with a new Parameter in member {i if now - first else 0} "
        "but not in every member; the members share one stacked Parameter per name: replace "
        "it in every member, or write the new values in place (nn.init.*_, tensor.copy_)"
    )
