"""What tensors the stacked optimizers step: complex parameters as pairs of real numbers, as
torch's optimizers step them; sparse gradients refused, with the way out.

torch's elementwise optimizers view a complex parameter, its gradient and its state as real
(``torch.view_as_real``) and run their real update on the pairs; a complex value to start from
fills both parts (Adagrad's ``sum``, Rprop's step sizes: ``complex(v, v)``). Optimizers whose
update depends on a parameter's whole shape (Adafactor, Muon) refuse complex parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["check_complex", "check_dense", "check_ordered", "initial", "real_views"]


def real_views(
    part: tuple[list[Tensor], list[Tensor], dict[str, Any]],
) -> tuple[list[Tensor], list[Tensor], dict[str, Any]]:
    """A bucket (``buckets``: parameters, gradients, state) with its complex tensors viewed as
    real pairs (``torch.view_as_real``), as torch's optimizers step complex parameters. Without
    the views a rule would square a complex gradient (``g * g``, not ``|g|^2``) and move each
    member elsewhere than torch, silently."""

    def real(t: Any) -> Any:
        return torch.view_as_real(t) if isinstance(t, Tensor) and t.is_complex() else t

    params, grads, state = part
    views = {k: [real(t) for t in v] if isinstance(v, list) else v for k, v in state.items()}
    return [real(p) for p in params], [real(g) for g in grads], views


def initial(
    make: Callable[[str, Tensor, dict[str, Any]], Tensor],
    name: str,
    param: Tensor,
    group: dict[str, Any],
) -> Tensor:
    """State ``name`` of ``param`` before its first step, ``make(name, param, group)``; for a
    complex ``param`` made on its real view, so that a value to start from fills both parts,
    as torch starts Adagrad's ``sum`` and Rprop's step sizes at ``complex(v, v)``."""
    if not param.is_complex():
        return make(name, param, group)
    return torch.view_as_complex(make(name, torch.view_as_real(param), group))


def check_complex(api: str, params: Sequence[Tensor], elementwise: bool) -> bool:
    """Whether ``params`` hold complex tensors, refused where the rule is not elementwise
    (torch's Adafactor and Muon refuse them too: a factored or orthogonalised update of the
    real pairs is not that of the complex tensor)."""
    found = any(p.is_complex() for p in params)
    if found and not elementwise:
        raise ValueError(
            f"{api}: complex parameters are not supported (its update depends on the "
            "parameter's whole shape, as torch's refuses them); give them to an elementwise "
            "optimizer (StackedAdam, StackedSGD...), which steps them as torch does"
        )
    return found


def check_ordered(api: str, params: Any) -> None:
    """Refuse a set as a param group's ``params``, as torch's ``add_param_group`` does: its
    order (by tensor id) changes between runs, and state dicts match parameters by position,
    so a resumed run could give one parameter another's state (same shapes pass the checks)."""
    if isinstance(params, (set, frozenset)):
        raise TypeError(
            f"{api}: a param group's `params` must be an ordered collection (a list), not a "
            "set: the order of a set changes between runs, and state dicts match parameters "
            "by position (torch refuses it too)"
        )


def check_dense(api: str, grads: Sequence[Tensor | None]) -> None:
    """Raise a ``TypeError`` naming the first sparse gradient in ``grads``, if any.

    Called after a step failed (a check on every step would cost each step its time): the
    rules' dense ops fail on a sparse gradient with errors that do not say why. An ensemble's
    own gradients are dense (vmap gives no sparse gradients); torch's SGD and Adagrad take
    sparse ones, which a member alone could get from ``nn.Embedding(sparse=True)``.
    """
    for k, g in enumerate(grads):
        if g is not None and g.layout != torch.strided:
            raise TypeError(
                f"{api}: the gradient of parameter {k} is sparse ({g.layout}), and stacked "
                "optimizers step dense gradients only; pass `p.grad.to_dense()` instead"
            )
