"""What vmapens's own ``torch.func.vmap`` rules share (``_attention``, ``_tie_reductions``,
``_embedding_rules``): the current vmap level, the dispatch below it, and the registration
over torch's own rule.

A ``FuncTorchBatched`` kernel runs while a vmap level is the current one: it unwraps its
tensors at that level (``_unwrap_batched``), computes below it, where they are ordinary again
(or batched at an outer level), and wraps the result (``_add_batch_dim``).

This file imports only torch: it sits at the bottom of the package.
"""

from __future__ import annotations

import warnings
from typing import Any, cast

import torch
from torch._functorch.pyfunctorch import VmapInterpreter, retrieve_current_functorch_interpreter

__all__ = ["below_vmap", "current_vmap", "override"]


def current_vmap() -> VmapInterpreter:
    """The vmap level a ``FuncTorchBatched`` kernel runs at (``.level()``, ``.batch_size()``)."""
    return cast(VmapInterpreter, retrieve_current_functorch_interpreter())


def below_vmap() -> Any:
    """A context in which ops dispatch below the current vmap level."""
    return torch._C._ExcludeDispatchKeyGuard(
        torch._C.DispatchKeySet(torch._C.DispatchKey.FuncTorchBatched)
    )


def override(lib: torch.library.Library, name: str, rule: Any) -> None:
    """Register ``rule`` for ``aten::<name>`` on ``lib`` (``aten``, ``IMPL``) in place of
    torch's own batching rule, without torch's "Overriding a previously registered kernel"
    warning: the override is ours."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lib.impl(name, rule, "FuncTorchBatched", with_keyset=True)
