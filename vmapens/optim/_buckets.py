"""Which parameters a rule steps together: those with a gradient that share their step counts.

A rule takes one list of parameters and one set of per-member counters (``step``, ...). After
``load_state_dict`` or a step where some parameters had no gradient, parameters of one param
group may count differently; each set of shared counters is then one call of the rule.
The counters' dtype is torch's for per-step scalars (:func:`scalar_dtype`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["buckets", "counter_dtype", "layout", "same_counts", "scalar_dtype", "share_counts"]


def buckets(
    params: list[Tensor],
    grads: Sequence[Tensor | None],
    states: list[dict[str, Any]],
    names: tuple[str, ...],
    counters: tuple[str, ...],
) -> list[tuple[list[Tensor], list[Tensor], dict[str, Any]]]:
    """The parameters with a gradient, by the counters they share, with their state.

    A parameter without a gradient is skipped, as torch's optimizers skip it, and keeps a count
    of its own: its counters are cloned (in ``states``) when they were shared with one that steps.

    Args:
        params: One param group's stacked parameters.
        grads: Their gradients (None: none), in the same order.
        states: Their state dicts, in the same order.
        names: The per-parameter state tensors the rule reads.
        counters: The per-member counters (``step`` first), shared by identity.

    Returns:
        Per bucket: its parameters, their gradients, and the rule's state (per name a list of
        tensors, per counter the shared tensor).
    """
    given = [g for g in grads if g is not None]
    first = states[0] if states else {}
    # Not while dynamo traces: torch 2.13's dynamo folds `is` between optimizer state tensors
    # to a constant without guarding their identity (torch issue 196173), so a step traced
    # with shared counters ran again after a frozen layer got counters of its own, and stepped
    # every parameter with that layer's count (tests/test_modes.py, a layer frozen and
    # unfrozen). The grouping below reads `id()`, which dynamo guards.
    if (
        states
        and not torch.compiler.is_compiling()
        and len(given) == len(params)
        and all([s[k] is first[k] for s in states for k in counters])
    ):  # the usual step: one bucket of everything, as below, without the grouping (~2 us)
        one: dict[str, Any] = {k: [s[k] for s in states] for k in names}
        one.update({k: first[k] for k in counters})
        return [(list(params), given, one)]
    live = {i: g for i, g in enumerate(grads) if g is not None}
    if len(live) < len(params):
        stepping = {id(states[i]["step"]) for i in live}
        for s, g in zip(states, grads, strict=True):
            if g is None and id(s["step"]) in stepping:
                s.update({k: s[k].clone() for k in counters})
    rows_by: dict[tuple[int, ...], list[int]] = {}
    for i in live:
        s = states[i]
        rows_by.setdefault(tuple([id(s[k]) for k in counters]), []).append(i)
    out = []
    for rows in rows_by.values():
        state: dict[str, Any] = {k: [states[i][k] for i in rows] for k in names}
        state.update({k: states[rows[0]][k] for k in counters})
        out.append(([params[i] for i in rows], [live[i] for i in rows], state))
    return out


def scalar_dtype() -> torch.dtype:
    """torch's dtype for per-step scalar state (``step``, NAdam's ``mu_product``, ASGD's
    ``eta`` and ``mu``), read when the state is created: float64 under
    ``torch.set_default_dtype(torch.float64)``, else float32 (torch's ``_get_scalar_dtype``)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def counter_dtype(step: Any) -> torch.dtype:
    """The dtype of a parameter's per-member counters: its ``step``'s (float32 or float64,
    kept when state moves or is loaded), or :func:`scalar_dtype` for new state."""
    if isinstance(step, Tensor) and step.dtype in (torch.float32, torch.float64):
        return step.dtype
    return scalar_dtype()


def layout(params: list[Tensor]) -> tuple:
    """What state must be re-checked against when it changes (``ens.double()``, ``.to()``)."""
    return tuple([(p.dtype, p.device, p.shape) for p in params])


def same_counts(a: Tensor, b: Tensor) -> bool:
    """Whether two parameters' counters are equal, so that they may share one tensor."""
    return a is b or (a.device == b.device and torch.equal(a, b))


def share_counts(states: list[dict[str, Any]], counters: tuple[str, ...]) -> None:
    """Parameters (their ``states``) whose counters are equal (after ``load_state_dict``) share
    them again, by identity, as :func:`buckets` groups them."""
    kept: list[dict[str, Any]] = []
    for state in states:
        for other in kept:
            if all(same_counts(other[k], state[k]) for k in counters):
                state.update({k: other[k] for k in counters})
                break
        else:
            kept.append(state)
