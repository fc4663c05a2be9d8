"""What ``StackedModule._load_from_state_dict`` loads: every key of a state dict checked, and
every value made ready (converted, or made a Parameter for ``assign=True``), before anything of
the ensemble changes, so that a state dict it refuses leaves the ensemble as it was (torch's own
loader copies, or assigns, the keys before the one it raises on)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ._stacking import staged
from ._storage_parts import member_count_hint, padded_values

__all__ = ["loadable", "warn_member_hooks"]


def loadable(
    state_dict: Mapping[str, Any],
    ours: Mapping[str, tuple[str, torch.Tensor]],
    *,
    prefix: str,
    whole: bool,
    kept: set[str],
    n: int,
    padding: Any,
    flags: Mapping[str, bool] | None,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> list[tuple[str, torch.Tensor, torch.Tensor]] | None:
    """``(name, target, value)`` for each key of ``state_dict`` that loads into the stacked
    tensor ``name`` (``target``), or None when nothing may change.

    Args:
        state_dict: the state dict being loaded (a parent's too: keys under ``prefix``).
        ours: each of the ensemble's state-dict keys (``prefix`` included) -> (stacked name,
            stacked tensor).
        prefix: where the ensemble's keys start in ``state_dict``.
        whole: ``strict`` of ``ens.load_state_dict`` itself (inside a parent's loader, False:
            the matching keys load and the parent's loader reports the rest, as torch's do).
        kept: the keys the member's own loader may find missing (BatchNorm's old versions).
        n: the number of members, for the hint on a state dict of another size.
        padding: the ensemble's ``vmapens._padding.Padding``, or None.
        flags: for ``assign=True``, each stacked parameter's ``requires_grad`` (each value
            is then the Parameter or buffer to adopt); None to copy (each value is then in
            its target's dtype and device).
        missing_keys, unexpected_keys, error_msgs: torch's loader's lists, extended.
    """
    unexpected = [k for k in state_dict if k.startswith(prefix) and k not in ours]
    missing = [k for k in ours if k not in state_dict and k not in kept]
    unexpected_keys.extend(unexpected)
    missing_keys.extend(missing)
    errors, pending, mismatched = len(error_msgs), [], []
    for key, (name, target) in ours.items():
        if key not in state_dict:
            continue
        value = state_dict[key]
        if not isinstance(value, torch.Tensor):
            error_msgs.append(  # torch's words for a value that is no tensor
                f'While copying the parameter named "{key}", expected torch.Tensor or '
                f"Tensor-like object from checkpoint but received {type(value)}"
            )
        elif value.shape != target.shape:
            error_msgs.append(
                f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from "
                f"checkpoint, the shape in current model is {tuple(target.shape)}."
            )
            mismatched.append((value, target))
        pending.append((key, name, target, value))
    hint = member_count_hint(mismatched, n, padded=padding is not None)
    error_msgs.extend(hint or padded_values(pending, padding))  # what a mismatch means
    if len(error_msgs) > errors or whole and (missing or unexpected):
        return None
    if flags is None:
        ready = staged(pending, error_msgs)  # every value converts first
        if len(error_msgs) > errors:
            return None
        names = [name for _, name, _, _ in pending]
        return [(name, t, v) for name, (t, v) in zip(names, ready, strict=True)]
    adopted = []
    for key, name, target, value in pending:
        try:
            adopted.append((name, target, _adoptable(value, flags.get(name))))
        except Exception as err:  # as torch's loader words it (and assigns nothing, here)
            error_msgs.append(
                f'While copying the parameter named "{key}", whose dimensions in the model are '
                f"{target.shape} and whose dimensions in the checkpoint are {value.shape}, an "
                f"exception occurred : {err.args}."
            )
    return adopted if len(error_msgs) == errors else None


def _adoptable(value: torch.Tensor, flag: bool | None) -> torch.Tensor:
    """``value`` as ``assign=True`` keeps it: a buffer's (``flag`` None) as it is, a
    parameter's as a Parameter (the state dict's own, or one made now) that can take the
    ensemble's grad flag ``flag``: checked here, before anything is assigned."""
    if torch._debug_has_internal_overlap(value) == 1:  # an `expand`ed tensor: one memory
        stride = tuple(value.stride())
        raise ValueError(
            f"load_state_dict: with assign=True the value becomes the members' storage, and "
            f"this one (stride {stride}, an `expand`ed tensor) holds several elements in one "
            "memory location: the members would write each other's rows (BatchNorm's "
            "statistics, the optimizer's step); pass `value.expand(...).clone()`, or "
            "assign=False to copy it into every member's row"
        )
    if flag is None:
        return value
    if not isinstance(value, nn.Parameter):
        return nn.Parameter(value, requires_grad=flag)  # torch's refusal of an integer one
    if flag and not (value.is_floating_point() or value.is_complex()):
        value.requires_grad_(flag)  # raises torch's own error, changing nothing
    return value


def warn_member_hooks(template: nn.Module, prefix: str = "", metadata: Any = None) -> None:
    """Warn that the members' own load_state_dict hooks do not run: the ensemble loads its
    stacked tensors and never calls its members' loaders, so a hook that renames keys fails
    as a missing key, and one that changes values is skipped. torch's own hooks (the old
    ``spectral_norm``'s, for state dicts of old versions) are left out: they read the formats
    of old torch versions, which an ensemble's state dict never is. Likewise a member module's
    own ``_load_from_state_dict`` (a migration of older versions), when the state dict's
    ``_metadata`` (``metadata``, keys under ``prefix``) gives it no version or another one."""
    hooked, migrating = [], []
    for path, module in template.named_modules():
        hooks = [
            *module._load_state_dict_pre_hooks.values(),
            *module._load_state_dict_post_hooks.values(),
        ]
        if any(not _of_torch(getattr(h, "hook", h)) for h in hooks):
            hooked.append(path or "(the member)")
        loader = type(module)._load_from_state_dict
        if loader is not nn.Module._load_from_state_dict and not _of_torch(loader):
            where = (prefix + path) if path else prefix[:-1]  # torch's metadata key: no dot
            held = (metadata or {}).get(where, {}).get("version")
            if held is None or held != module._version:
                migrating.append(f"{path or '(the member)'} (version {held})")
    if migrating:
        warnings.warn(
            f"load_state_dict: the members' modules {migrating} define their own "
            "_load_from_state_dict, which the ensemble does not run (it loads stacked tensors, "
            "not each member's state dict), and this state dict is of another version (or "
            "says none): a migration of older versions is not applied. To apply it, load each "
            "member's state dict into its own module and stack them with "
            "Ensemble.from_modules",
            stacklevel=4,
        )
    if hooked:
        warnings.warn(
            f"load_state_dict: the members' modules {hooked} have load_state_dict hooks, which "
            "the ensemble does not run (it loads stacked tensors, not each member's state "
            "dict): a hook that changes values is not applied. To apply them, load each "
            "member's state dict into its own module and stack them with "
            "Ensemble.from_modules",
            stacklevel=4,
        )


def _of_torch(hook: Any) -> bool:
    """Whether ``hook`` (a function, a bound method or a callable object) is torch's."""
    owner = getattr(hook, "__func__", hook)
    module = getattr(owner, "__module__", None) or type(owner).__module__
    return module == "torch" or module.startswith("torch.")
