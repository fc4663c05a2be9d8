"""The flags of a stacked optimizer: torch's implementation flags (``foreach``, ``fused``,
``capturable``, ``differentiable``), taken where they change nothing here, and the options
that are one bool for a whole param group (``nesterov``, ``amsgrad``, ``maximize``, ...).
Moved out of ``_hyper.py`` (per-member hyperparameters) at its size cap."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Collection
from typing import Any

__all__ = ["IMPLEMENTATION", "check_flags", "check_implementation", "implementation_flags"]


#: torch's implementation flags: the values that change nothing here, and why the others would.
IMPLEMENTATION: dict[str, tuple[tuple[bool | None, ...], str]] = {
    "foreach": ((None, True, False), ""),
    "fused": ((None, True, False), ""),
    "capturable": (
        (False,),
        "the update reads step counts on the host for torch's fused kernels and rolls back "
        "a failed step, which CUDA-graph capture cannot replay",
    ),
    "differentiable": (
        (False,),
        "the update runs in place under torch.no_grad (masks and rollback copy rows back), "
        "so no autograd graph flows through a step",
    ),
}


def check_flags(api: str, group: dict[str, Any], cls: type, hypers: Collection[str]) -> None:
    """The options of ``cls`` whose default is a bool (``nesterov``, ``amsgrad``,
    ``maximize``, ...) must be bools in ``group``: the rules read them as one truthy value,
    so ``nesterov=[False, True]`` ran every member with Nesterov momentum, silently.

    Checked when a group is built or loaded and before every step (a value set by hand in
    ``param_groups``), before anything is written.

    Raises:
        TypeError: such an option given as another value (a list, a tensor, ...).
    """
    for name in _bool_options(cls):
        value = group.get(name)
        if name in group and not isinstance(value, bool):
            raise TypeError(
                f"{api}: `{name}` must be a bool, got {value!r}: a flag is one value for "
                "every member of a param group, not one per member (per-member "
                f"hyperparameters: {sorted(hypers)}); train the members that differ in it "
                "as separate ensembles"
            )


@functools.cache
def _bool_options(cls: type) -> tuple[str, ...]:
    """The options of ``cls``'s constructor whose default is a bool."""
    params = inspect.signature(cls).parameters.values()
    return tuple(p.name for p in params if isinstance(p.default, bool))


def implementation_flags(torch_class: type | None) -> tuple[str, ...]:
    """The implementation flags ``torch_class``'s constructor takes (none without a twin)."""
    if torch_class is None:
        return ()
    accepted = inspect.signature(torch_class).parameters
    return tuple(flag for flag in IMPLEMENTATION if flag in accepted)


def check_implementation(api: str, flags: tuple[str, ...], given: dict[str, Any]) -> None:
    """Check torch's implementation flags in ``given`` (a group) against what ``flags`` allows.

    Raises:
        TypeError: a flag torch's twin does not take, or a value that is not a bool/None.
        ValueError: a value that would change results (``differentiable=True``, ...).
    """
    for flag, value in given.items():
        if flag not in flags:
            raise TypeError(f"{api}: unexpected keyword argument `{flag}`")
        allowed, why = IMPLEMENTATION[flag]
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{api}: `{flag}` must be a bool or None, got {value!r}")
        if value not in allowed:
            raise ValueError(f"{api}: `{flag}={value}` is not supported: {why}")
    if given.get("foreach") is True and given.get("fused") is True:
        raise ValueError(f"{api}: `fused` and `foreach` cannot both be True (torch refuses it too)")
