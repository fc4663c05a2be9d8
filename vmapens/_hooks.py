"""Member hooks the ensemble cannot follow, refused before they would go unseen.

* What a member's attributes and module hooks hold: its own tensors, or its own modules. The
  ensemble runs a copy of member 0 (``copy.deepcopy``), which copies modules, containers and
  bound methods along, but not functions: a lambda or closure keeps the very objects it
  closed over. A hook that holds the member itself or one of its submodules (registered in
  ``__init__`` as ``lambda m, args, out: out * self.gain``) read member 0's original tensors
  for every member, never the trained ones, and wrote into member 0's original module.
* torch's global module backward hooks, which never fire under vmap.
* State-dict pre-hooks, which the stacked ``state_dict`` does not run per member.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _global_backward_hooks, _global_backward_pre_hooks

#: Values that hold nothing.
_ATOMS = {bool, int, float, str, bytes, complex, type(None), torch.dtype, torch.device}
_DEPTH = 3  # how deep values are followed into plain objects, closures, containers


def held_tensor(
    v: Any, ids: dict[int, str], depth: int = 0, in_function: bool = False
) -> str | None:
    """The name in ``ids`` of the member's tensor a plain attribute value holds, or of the
    member's module a function in it closes over (``ids`` maps the ``id`` of each)."""
    if isinstance(v, torch.Tensor) or (in_function and isinstance(v, nn.Module)):
        return ids.get(id(v))
    if depth >= _DEPTH or type(v) in _ATOMS or isinstance(v, (nn.Module, type)):
        return None  # a submodule sees the member's tensors in its slots; deepcopy copies it
    if isinstance(v, types.FunctionType):  # not copied: what it holds stays member 0's own
        v, in_function = (
            [_contents(c) for c in v.__closure__ or ()] + list(v.__defaults__ or ()),
            True,
        )
    elif isinstance(v, functools.partial):
        v = [v.func, *v.args, *v.keywords.values()]
    elif not isinstance(v, (tuple, list, set, frozenset)):
        v = list((v if isinstance(v, dict) else getattr(v, "__dict__", {})).values())
    deeper = depth + 1
    return next((h for x in v if (h := held_tensor(x, ids, deeper, in_function)) is not None), None)


def module_ids(member: nn.Module) -> dict[int, str]:
    """``held_tensor``'s ``ids`` for the member's modules: a name that says which one."""
    return {
        id(m): f"module `{path}` ({type(m).__name__})" if path else f"{type(m).__name__} itself"
        for path, m in member.named_modules()
    }


def held_message(api: str, where: str, held: str) -> str:
    """The error for ``where`` (``member 0's attribute `fc._forward_hooks```) holding ``held``."""
    if held.startswith("module ") or held.endswith(" itself"):
        return (
            f"{api}: {where} is a function that closes over the member's {held}; the ensemble "
            "runs a copy of the member, and a function is not copied, so it would read member "
            "0's original tensors for every member. Read the layer through the hook's module "
            "argument (`m`), or register a bound method (`self.fc.register_forward_hook("
            "self._hook)`), which the copy rebinds"
        )
    return (
        f"{api}: {where} holds its tensor `{held}`; members' tensors are swapped into module "
        "slots only, so a forward would read another there: read it via its module (a hook's "
        "m.weight)"
    )


def refuse_global_backward_hooks() -> None:
    """Refuse torch's global module backward hooks under vmap, as a member's own are refused
    (``_unbatchable.refuse_template_hooks``): they fire alone, never on batched tensors.

    Raises:
        RuntimeError: torch has a global backward (pre-)hook, with the ways out.
    """
    if _global_backward_hooks or _global_backward_pre_hooks:
        raise RuntimeError(
            "Ensemble: torch has a global backward hook (register_module_full_backward_hook "
            "or register_module_full_backward_pre_hook); under backend='vmap' it would never "
            "fire on the members' modules: a member's tensors inside torch.func.vmap report "
            "requires_grad=False, so torch attaches no hook, and the members would train "
            "without it. Build the ensemble with backend='loop' (the hook fires once per "
            "member, as alone), remove the hook, or run the forward under torch.no_grad()"
        )


def refuse_state_dict_pre_hooks(api: str, member: nn.Module, i: int) -> None:
    """Refuse a member with a state_dict pre-hook (``register_state_dict_pre_hook``).

    torch runs it on the module before reading its tensors (one that refreshes a buffer from
    the weights); the ensemble reads the stacked tensors without it (``ens.state_dict()``,
    ``state_dicts()``, ``vmapens.save``), which then differed from the member's own
    ``state_dict()`` for every member the hook had not run on, silently. State-dict (post)
    hooks that rename keys are followed; one that changes values is refused elsewhere.

    Raises:
        ValueError: naming the layer and the way out.
    """
    for path, m in member.named_modules():
        if m._state_dict_pre_hooks:
            where = f"`{path}` ({type(m).__name__})" if path else type(m).__name__
            raise ValueError(
                f"{api}: {where} of member {i} has a state_dict pre-hook "
                "(register_state_dict_pre_hook); the ensemble reads its members' stacked "
                "tensors without running it (ens.state_dict(), vmapens.save), so what the "
                "hook would update before saving stays as it was. Do that update in forward "
                "or after each step, or remove the hook (handle.remove()) before stacking"
            )


def _contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell (a name deleted or bound later): holds nothing
        return None
