"""What vmapens's own ``torch.func.vmap`` rules share (``_attention``, ``_tie_reductions``,
``_embedding_rules``, ``_index_rules``, ``_fixed_rules``): the current vmap level, the
dispatch below it, a tensor laid out members first, and the registration over torch's own
rule (``override``), or over it keeping it for the calls a rule need not fix
(``override_keeping``).

vmapens's rules act at the ensemble's own vmap level only (``outermost``): a vmap the user
writes inside a forward gets torch's rules, as the member alone does.

A ``FuncTorchBatched`` kernel runs while a vmap level is the current one: it unwraps its
tensors at that level (``_unwrap_batched``), computes below it, where they are ordinary again
(or batched at an outer level), and wraps the result (``_add_batch_dim``).

This file imports only torch: it sits at the bottom of the package.
"""

from __future__ import annotations

import warnings
from typing import Any, cast

import torch
from torch._C._functorch import TransformType, current_level, get_interpreter_stack
from torch._functorch.pyfunctorch import VmapInterpreter, retrieve_current_functorch_interpreter

__all__ = [
    "below_vmap",
    "current_level",
    "current_vmap",
    "members_first",
    "members_level",
    "outermost",
    "override",
    "override_keeping",
]


def current_vmap() -> VmapInterpreter:
    """The vmap level a ``FuncTorchBatched`` kernel runs at (``.level()``, ``.batch_size()``).
    ``current_level()`` (torch's) gives the level alone, ~50x cheaper (0.07 against 3.7 us):
    a rule that hands most calls to torch reads that first."""
    return cast(VmapInterpreter, retrieve_current_functorch_interpreter())


def members_level(default: int = 0) -> int:
    """The lowest vmap level running (``default`` when none runs): the ensemble's own."""
    stack = get_interpreter_stack() or []
    return min((i.level() for i in stack if i.key() == TransformType.Vmap), default=default)


def outermost(level: int) -> bool:
    """Whether no vmap runs below ``level``: the ensemble's own level. A ``torch.func.vmap`` of
    the user's inside a forward runs above it, and keeps torch's rules there, as alone."""
    return level <= members_level(default=level)


def members_first(t: torch.Tensor, bdim: int | None, n: int) -> torch.Tensor:
    """An unwrapped tensor with its member dim (``bdim``) first; a shared one (``bdim`` None)
    expanded to ``n`` rows (a view)."""
    return t.expand(n, *t.shape) if bdim is None else t.movedim(bdim, 0)


def below_vmap() -> Any:
    """A context in which ops dispatch below the current vmap level."""
    return torch._C._ExcludeDispatchKeyGuard(
        torch._C.DispatchKeySet(torch._C.DispatchKey.FuncTorchBatched)
    )


def override(lib: torch.library.Library, name: str, rule: Any) -> None:
    """Register ``rule`` for ``<name>`` on ``lib`` (``aten`` or another namespace, ``IMPL``) in
    place of torch's own batching rule, without torch's "Overriding a previously registered
    kernel" warning: the override is ours."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lib.impl(name, rule, "FuncTorchBatched", with_keyset=True)


def override_keeping(lib: torch.library.Library, name: str, make: Any) -> None:
    """``override`` with ``make(torchs)``, a rule that hands the calls it need not fix to
    ``torchs``, torch's own rule for ``<lib's namespace>::<name>``
    (``torch.library.get_kernel``). A torch without ``get_kernel`` keeps its own rule."""
    if hasattr(torch.library, "get_kernel"):
        torchs = torch.library.get_kernel(f"{lib.ns}::{name}", "FuncTorchBatched")
        override(lib, name, make(torchs))
