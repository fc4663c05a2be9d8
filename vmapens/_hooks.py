"""Member hooks the ensemble cannot follow, refused before they would go unseen.

* What a member's attributes and module hooks hold: its own tensors. The ensemble swaps each
  member's tensors into the module slots of a copy of member 0 (``_copies.copy_member``,
  which rebinds functions closing over the member's modules to the copy's), so a tensor held
  elsewhere (a list, a closure: ``w = self.fc.weight; lambda o: o * w``) would stay member
  0's original for every member, never the trained one.
* torch's global module backward hooks, which never fire under vmap.
* State-dict pre-hooks, which the stacked ``state_dict`` does not run per member.

And the walks over a member's modules and tensors that look for them (``modules_of``,
``named_tensors``): the checks walk every member, each a few times.
"""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _global_backward_hooks, _global_backward_pre_hooks
from torch.utils.hooks import RemovableHandle

#: Values that hold nothing.
ATOMS = {bool, int, float, str, bytes, complex, type(None), torch.dtype, torch.device}
DEPTH = 3  # how deep values are followed into plain objects, closures, containers


def modules_of(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``list(module.named_modules())``: walked once, shared by the checks of one member."""
    return list(module.named_modules())


def named_tensors(
    module: nn.Module, modules: list[tuple[str, nn.Module]] | None = None
) -> list[tuple[str, torch.Tensor]]:
    """Unique parameters then buffers, by their first name (tied tensors appear once), as
    ``named_parameters`` then ``named_buffers``; ``modules``: ``modules_of(module)`` if known."""
    cls = type(module)  # FSDP's, say, name them otherwise
    if (cls._named_members, cls.named_parameters, cls.named_buffers) != _PLAIN:
        return [*module.named_parameters(), *module.named_buffers()]
    modules = modules_of(module) if modules is None else modules
    found: list[tuple[str, torch.Tensor]] = []
    for kind in ("_parameters", "_buffers"):
        seen: set[int] = set()  # by id, as torch's set of tensors (their hash is their id)
        for path, m in modules:
            for k, t in m.__dict__[kind].items():
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    found.append((f"{path}.{k}" if path else k, t))
    return found


_PLAIN = (nn.Module._named_members, nn.Module.named_parameters, nn.Module.named_buffers)


def held(v: Any) -> list[Any]:
    """What a plain value holds, one level down: a function's closure contents and defaults, a
    partial's function and arguments, a container's items, a plain object's attributes (torch's
    ``_WrappedHook``, a config). Nothing for an atom, a tensor, a module (its tensors sit in its
    slots; the copy rebinds it), a class, a bound method or a Python module."""
    leaves = (torch.Tensor, nn.Module, type, types.ModuleType, types.MethodType)
    if type(v) in ATOMS or isinstance(v, leaves):
        return []
    if isinstance(v, types.FunctionType):
        cells = [_contents(c) for c in v.__closure__ or ()]
        return [*cells, *(v.__defaults__ or ()), *(v.__kwdefaults__ or {}).values()]
    if isinstance(v, functools.partial):
        return [v.func, *v.args, *v.keywords.values()]
    if isinstance(v, dict):
        return list(v.values())
    if isinstance(v, (list, tuple, set, frozenset)):
        return list(v)
    own = getattr(v, "__dict__", None)
    return list(own.values()) if isinstance(own, dict) else []


def held_tensor(v: Any, ids: dict[int, str], depth: int = 0) -> str | None:
    """The name in ``ids`` (``id`` to name) of the member's tensor a plain attribute value
    holds, in containers, plain objects, partials and closures (``held``)."""
    if isinstance(v, torch.Tensor):
        return ids.get(id(v))
    if depth >= DEPTH:
        return None
    return next((h for x in held(v) if (h := held_tensor(x, ids, depth + 1)) is not None), None)


def held_message(api: str, where: str, held: str) -> str:
    """The error for ``where`` (``member 0's attribute `fc._forward_hooks```) holding ``held``."""
    return (
        f"{api}: {where} holds its tensor `{held}`; members' tensors are swapped into module "
        "slots only, so a forward would read another there: read it via its module (a hook's "
        "m.weight)"
    )


def refuse_global_backward_hooks() -> None:
    """Refuse torch's global module backward hooks under vmap, as a member's own are refused
    (``refuse_template_hooks``): they fire alone, never on batched tensors.

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


#: Per runner, ``(RemovableHandle.next_id, grad mode)`` when its hooks last passed ``check``.
_PASSED: weakref.WeakKeyDictionary[nn.Module, tuple[int, bool]] = weakref.WeakKeyDictionary()


def checked_hooks(
    check: Callable[[nn.Module, nn.Module], None], template: nn.Module, runner: nn.Module
) -> None:
    """``check(template, runner)``, skipped while no hook was registered since it last passed
    in this grad mode: torch numbers every hook handle it makes (``RemovableHandle.next_id``),
    and the walk over the modules costs ~10 us a call. A refused hook is refused again."""
    now = (RemovableHandle.next_id, torch.is_grad_enabled())
    if _PASSED.get(runner) != now:
        check(template, runner)
        _PASSED[runner] = now


#: The hooks ``nn.Module`` runs around a forward or backward, by attribute name.
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def refuse_template_hooks(template: nn.Module, runner: nn.Module) -> None:
    """Hooks that would never fire, or fire on dead batched tensors, under vmap: refuse them.

    The vmap backend runs ``runner``, a copy of ``template`` made at build time: forward hooks
    the module registered itself (in its ``__init__``) are in both and run batched.
    - A hook added to ``ens.template`` later is only on the template: it would never fire.
    - A forward hook added to ``ens.runner`` later fires once on all members' batched
      tensors, so a hook that stores its output (feature extraction, ``feats.append(o)``)
      kept dead BatchedTensors, silently until read (functorch's "tensor may have escaped").
      The runner's own ``put_back`` hooks (``_construction.runner_for``) are the ensemble's.
    - Backward hooks never fire under vmap (torch attaches them only to tensors that report
      ``requires_grad``, which a member's batched tensors do not), so with grad enabled a
      runner's backward hook, or torch's global one, is refused too.
    One walk pairs the two modules by path.

    Raises:
        RuntimeError: naming the layer and the ways out.
    """
    backward = torch.is_grad_enabled()
    if backward:
        refuse_global_backward_hooks()
    twins = dict(runner.named_modules(remove_duplicate=False))
    for name, module in template.named_modules(remove_duplicate=False):
        twin = twins.pop(name, None)
        for kind in _HOOKS:
            if twin is None or not set(getattr(module, kind)) <= set(getattr(twin, kind)):
                _refuse_template_hook(name, kind)
        if twin is not None:
            _refuse_runner_hooks(name, twin, module, backward)
    for name, twin in twins.items():  # the runner's own modules (none the template has)
        _refuse_runner_hooks(name, twin, None, backward)


def _refuse_template_hook(name: str, kind: str) -> None:
    where = f"ens.template.{name}" if name else "ens.template"
    raise RuntimeError(
        f"Ensemble: `{where}` has a {kind[1:-1].replace('_', ' ')} registered after the "
        "ensemble was built; with backend='vmap' the members run as one batched copy of the "
        "template, so it would never fire. Build the ensemble with backend='loop' (hooks on "
        "the template then fire once per member: forward hooks in member order, backward "
        "hooks as autograd reaches them), register the hook on a member run alone "
        "(m = ens[0]; m.<layer>.register_forward_hook(...)), or return the activation from "
        "forward"
    )


def _refuse_runner_hooks(
    name: str, module: nn.Module, twin: nn.Module | None, backward: bool
) -> None:
    """A forward hook on the runner's ``module`` that its template ``twin`` lacks, or, with
    ``backward``, any backward hook on it (``refuse_template_hooks``)."""
    for kind in ("_forward_hooks", "_forward_pre_hooks"):
        mine = getattr(twin, kind) if twin is not None else {}
        for key, hook in getattr(module, kind).items():
            func = getattr(hook, "func", None)
            if key in mine or getattr(func, "__name__", "") == "put_back":
                continue
            raise RuntimeError(
                f"Ensemble: `ens.runner.{name}` has a {kind[1:-1].replace('_', ' ')} "
                "registered after the ensemble was built; with backend='vmap' it fires once "
                "on all members' batched tensors, which are dead after the call. Build the "
                "ensemble with backend='loop' and register it on `ens.template` (it then "
                "fires once per member), register it on a member run alone (m = ens[0]), or "
                "keep the activation on the module in forward (self.feat = h: ens.template "
                "holds it stacked after the call)"
            )
    if backward and (module._backward_hooks or module._backward_pre_hooks):
        where = f"`{name}` ({type(module).__name__})" if name else "the member"
        raise RuntimeError(
            f"Ensemble: {where} has a backward hook (register_full_backward_hook, "
            "register_full_backward_pre_hook or register_backward_hook); under "
            "backend='vmap' it would never fire: a member's tensors inside torch.func.vmap "
            "report requires_grad=False, so torch attaches no hook, and the members would "
            "train without it. Build the ensemble with backend='loop' (the hook fires once "
            "per member, as alone), or run the forward under torch.no_grad()"
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
    for path, m in modules_of(member):
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
