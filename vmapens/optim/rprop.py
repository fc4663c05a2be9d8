"""Rprop for stacked ensembles: the update rule and its optimizer."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from .._checks import column
from ._columns import member_column, member_columns, signed
from ._hyper import LR, NONNEGATIVE, Hyper, PerMember, Scalar, member_floats
from .base import StackedOptimizer

__all__ = ["StackedRprop", "rprop_rule"]


def rprop_rule(
    params: list[Tensor], grads: list[Tensor], state: dict[str, Any], group: dict[str, Any]
) -> None:
    """One Rprop step in place on stacked tensors, each member with its own hyperparameters.

    Follows ``torch.optim.Rprop``'s single-tensor update (Riedmiller & Braun, 1993, "A Direct
    Adaptive Method for Faster Backpropagation Learning: The RPROP Algorithm") per member and
    element:

    .. code-block:: text

        g = -g if maximize;  s = sign(g * prev)
        f = etaplus if s > 0, etaminus if s < 0, 1 if s == 0
        step_size = clamp(step_size * f, step_size_min, step_size_max)
        g = 0 where s < 0
        p -= sign(g) * step_size;  prev = g

    The step sizes start at each member's ``lr`` (:meth:`StackedRprop.initial_state`).

    Args:
        params: Stacked parameters [n, ...] sharing one step count, updated in place.
        grads: Their gradients (not modified).
        state: ``prev``, ``step_size`` (one per parameter) and ``step`` ([n] counts,
            counted; Rprop does not read it).
        group: ``etas`` and ``step_sizes`` (pairs of floats or float64 [n] tensors) and
            ``maximize``.
    """
    (etaminus, etaplus), (size_min, size_max) = group["etas"], group["step_sizes"]
    prevs, step_sizes = state["prev"], state["step_size"]

    def col(x: Scalar) -> list[Any]:
        out = member_columns(x, params)
        return out if isinstance(out, list) else [out] * len(params)

    # torch makes a parameter's step sizes at its own first step, from the group's lr then:
    # a member yet to step (the parameter had no gradient, or the member was masked) starts
    # from today's lr, not from the lr when the stacked state was made.
    fresh = state["step"].eq(0)
    for size, start in zip(step_sizes, col(group["lr"]), strict=True):
        size.copy_(torch.where(column(fresh, size), start, size))
    state["step"].add_(1)
    g = signed(grads, group)
    signs = torch._foreach_mul(g, prevs)
    torch._foreach_sign_(signs)
    kept = []
    for s, grad, size, lo, hi, minus, plus in zip(
        signs,
        g,
        step_sizes,
        col(size_min),
        col(size_max),
        col(etaminus),
        col(etaplus),
        strict=True,
    ):
        negative = s.lt(0)
        factor = torch.where(s.gt(0), plus, s)
        factor = torch.where(negative, minus, factor)
        factor = torch.where(factor.eq(0), 1.0, factor)
        # torch's clamp_(lo, hi), as max then min: clamp takes two floats or two tensors,
        # and one bound may be shared (a float) while the other is per member (a column).
        size.copy_(torch.clamp_max(torch.clamp_min(size * factor, lo), hi))
        kept.append(torch.where(negative, 0.0, grad))
    torch._foreach_addcmul_(params, torch._foreach_sign(kept), step_sizes, value=-1)
    torch._foreach_copy_(prevs, kept)


class StackedRprop(StackedOptimizer):
    """Rprop over stacked parameters, with per-member hyperparameters.

    Member ``i`` is updated exactly as ``torch.optim.Rprop`` would update it alone with member
    ``i``'s hyperparameters; ``member_state_dict(i)`` hands it off to it.

    Args:
        params: Stacked tensors [n, ...], param-group dicts, or an Ensemble.
        lr: Initial step size: a float, a 0-d tensor (kept, as torch keeps it; the step sizes
            start at its value at the first step), or one per member.
        etas: ``(etaminus, etaplus)``, each a float or one per member, with
            ``0 < etaminus < 1 < etaplus``.
        step_sizes: ``(min, max)`` step sizes, each a float or one per member.
        maximize: Maximise the objective.
        **implementation: torch's implementation flags that ``torch.optim.Rprop`` takes
            (see :class:`~vmapens.optim.StackedOptimizer`).

    Raises:
        ValueError: Empty params, mismatched leading sizes, out-of-range or wrong-length
            hyperparameters.

    Example:
        >>> w = torch.zeros(2, 3, requires_grad=True)
        >>> opt = StackedRprop([w], lr=[0.01, 0.1])
        >>> for _ in range(2):
        ...     w.grad = torch.ones(2, 3)
        ...     opt.step()
        >>> w[:, 0]  # lr, then lr * 1.2
        tensor([-0.0220, -0.2200], grad_fn=<SelectBackward0>)
    """

    hyperparameters: ClassVar[dict[str, Hyper]] = {
        "lr": LR,
        "etas": Hyper("eta value", "> 0", lambda v: v > 0, pair=True),
        "step_sizes": Hyper("step size", ">= 0", NONNEGATIVE.ok, pair=True),
    }
    torch_class = torch.optim.Rprop
    rule = staticmethod(rprop_rule)

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]] | nn.Module,
        lr: PerMember = 1e-2,
        etas: tuple[PerMember, PerMember] = (0.5, 1.2),
        step_sizes: tuple[PerMember, PerMember] = (1e-6, 50.0),
        *,
        maximize: bool = False,
        **implementation: Any,
    ) -> None:
        super().__init__(params, locals())

    def _normalise(self, group: dict[str, Any], free: tuple[str, ...] = ()) -> None:
        super()._normalise(group, free)
        minus, plus = (member_floats(v) for v in group["etas"])
        for m, p in zip(minus * len(plus), plus * len(minus), strict=False):
            if not 0.0 < m < 1.0 < p:
                raise ValueError(
                    f"{self._api}: Invalid eta values: {m}, {p} "
                    "(`etas` must satisfy 0 < etas[0] < 1 < etas[1] for every member)"
                )

    def state_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("prev", "step_size")

    def initial_state(self, name: str, param: Tensor, group: dict[str, Any]) -> Tensor:
        start = super().initial_state(name, param, group)
        # torch starts every step size at the group's lr (full_like(grad, lr)).
        return start.add_(member_column(group["lr"], param)) if name == "step_size" else start
