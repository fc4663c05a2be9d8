"""Lion for stacked ensembles: the update rule and its optimizer (torch has no twin)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ._columns import member_columns
from ._hyper import BETAS, LR, WEIGHT_DECAY, Params, PerMember, Scalar
from ._keep import step_one
from .base import StackedOptimizer

__all__ = ["StackedLion", "lion_rule", "lion_update_"]


def lion_rule(
    params: list[Tensor], grads: list[Tensor], state: dict[str, Any], group: dict[str, Any]
) -> None:
    """One Lion step in place on stacked tensors, each member with its own hyperparameters.

    Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms", Program 1, with the
    paper's decoupled weight decay, per member:

    .. code-block:: text

        c = beta1 * m + (1 - beta1) * g
        p -= lr * (sign(c) + wd * p)
        m = beta2 * m + (1 - beta2) * g

    Args:
        params: Stacked parameters [n, ...] sharing one step count, updated in place.
        grads: Their gradients (not modified).
        state: ``exp_avg`` (one per parameter) and ``step`` ([n] counts, counted; Lion does
            not read it).
        group: ``lr``, ``betas``, ``weight_decay`` (floats or float64 [n] tensors).
    """
    lr, (beta1, beta2), wd, exp_avg = (
        group["lr"],
        group["betas"],
        group["weight_decay"],
        state["exp_avg"],
    )

    col: Callable[[Scalar], Any] = functools.partial(member_columns, like=params)
    state["step"].add_(1)
    update = torch._foreach_mul(exp_avg, col(beta1))
    torch._foreach_add_(update, torch._foreach_mul(grads, col(1 - beta1)))
    torch._foreach_sign_(update)
    if isinstance(wd, Tensor) or wd != 0:
        torch._foreach_add_(update, torch._foreach_mul(params, col(wd)))
    torch._foreach_mul_(update, col(lr))
    torch._foreach_sub_(params, update)
    torch._foreach_mul_(exp_avg, col(beta2))
    torch._foreach_add_(exp_avg, torch._foreach_mul(grads, col(1 - beta2)))


def lion_update_(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    step: Tensor,
    *,
    lr: Scalar,
    beta1: Scalar,
    beta2: Scalar,
    weight_decay: Scalar,
    workspace: Tensor | None = None,
) -> None:
    """:func:`lion_rule` on one stacked tensor and its state, in place.

    Args:
        param: Stacked parameter [n, ...], updated in place.
        grad: Its gradient (not modified).
        exp_avg: The momentum ``m``, updated in place.
        step: Float32 [n] per-member step counts, updated in place (Lion does not read it).
        lr: A float or a float64 [n] tensor, as are the other hyperparameters.
        beta1: Interpolation factor of the update direction.
        beta2: Decay of the momentum.
        weight_decay: Decoupled weight decay.
        workspace: Accepted for compatibility and unused.

    Example:
        >>> p, g, m, s = torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3), torch.zeros(2)
        >>> lion_update_(p, g, m, s, lr=torch.tensor([0.1, 0.2]), beta1=0.9, beta2=0.99,
        ...              weight_decay=0.0)
        >>> p[:, 0], m[:, 0]
        (tensor([-0.1000, -0.2000]), tensor([0.0100, 0.0100]))
    """

    hyper = dict(lr=lr, betas=(beta1, beta2), weight_decay=weight_decay)
    step_one(lion_rule, param, grad, {"exp_avg": exp_avg}, {"step": step}, hyper)


class StackedLion(StackedOptimizer):
    """Lion (EvoLved Sign Momentum) over stacked parameters, with per-member hyperparameters.

    Lion (Chen et al., 2023) steps every coordinate by ``lr`` in the sign of an interpolated
    momentum; use a learning rate 3-10x smaller than AdamW's and a weight decay as much
    larger. torch has no Lion: :attr:`torch_class` is None, and ``member_state_dict(i)``
    gives member ``i``'s momentum as ``{"exp_avg": ...}`` per parameter.

    Args:
        params: Stacked tensors [n, ...], param-group dicts, or an Ensemble.
        lr: Learning rate, a float or one per member.
        betas: ``(beta1, beta2)``, each a float or one per member.
        weight_decay: Decoupled weight decay, a float or one per member.
        **implementation: none is taken (torch has no Lion); any raises TypeError.

    Raises:
        ValueError: Empty params, mismatched leading sizes, out-of-range or wrong-length
            hyperparameters.

    Example:
        >>> w = torch.zeros(2, 3, requires_grad=True)
        >>> opt = StackedLion([w], lr=[1e-4, 1e-3])
        >>> w.grad = torch.tensor([[1.0, -2.0, 0.0]]).repeat(2, 1)
        >>> opt.step()
        >>> (w.detach() * 1e4).tolist()
        [[-1.0, 1.0, 0.0], [-10.0, 10.0, 0.0]]
    """

    hyperparameters = {"lr": LR, "betas": BETAS, "weight_decay": WEIGHT_DECAY}
    torch_class = None
    rule = staticmethod(lion_rule)

    def __init__(
        self,
        params: Params,
        lr: PerMember = 1e-4,
        betas: tuple[PerMember, PerMember] = (0.9, 0.99),
        weight_decay: PerMember = 0.0,
        **implementation: Any,
    ) -> None:
        super().__init__(params, locals())

    def state_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("exp_avg",)

    def member_state(
        self, state: dict[str, Tensor], group: dict[str, Any], i: int
    ) -> dict[str, Tensor]:
        return {"exp_avg": state["exp_avg"][i].clone()}
