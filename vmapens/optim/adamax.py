"""Adamax for stacked ensembles: the update rule and its optimizer."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from .base import NONNEGATIVE, UNIT, Hyper, Scalar, StackedOptimizer, member_column

__all__ = ["StackedAdamax", "adamax_update_"]

PerMember = float | Sequence[float] | Tensor


def adamax_update_(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_inf: Tensor,
    step: Tensor,
    *,
    lr: Scalar,
    beta1: Scalar,
    beta2: Scalar,
    eps: Scalar,
    weight_decay: Scalar,
    maximize: bool = False,
    workspace: Tensor | None = None,
) -> None:
    """One Adamax step in place on a stacked tensor, each member with its own hyperparameters.

    Follows ``torch.optim.Adamax``'s single-tensor update (Kingma & Ba, 2015, Algorithm 2)
    per member with step ``t``:

    .. code-block:: text

        g = -g if maximize;  g += wd * p
        m = lerp(m, g, 1 - beta1);  u = max(beta2 * u, |g| + eps)
        p -= lr / (1 - beta1**t) * m / u

    Args:
        param: Stacked parameter [n, ...], updated in place.
        grad: Its gradient (not modified).
        exp_avg: First moment, updated in place.
        exp_inf: Exponentially weighted infinity norm, updated in place.
        step: Float32 [n] per-member step counts, updated in place.
        lr: A float or a float64 [n] tensor, as are the other hyperparameters.
        beta1: First-moment decay.
        beta2: Infinity-norm decay.
        eps: Term added to ``|g|``.
        weight_decay: L2 penalty.
        maximize: Ascend instead of descend.
        workspace: Optional tensor shaped like ``param`` for the temporaries.

    Example:
        >>> p, g, z, s = torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3), torch.zeros(2)
        >>> adamax_update_(p, g, z, z.clone(), s, lr=torch.tensor([0.1, 0.2]), beta1=0.9,
        ...                beta2=0.999, eps=0.0, weight_decay=0.0)
        >>> p[:, 0]
        tensor([-0.1000, -0.2000])
    """

    def col(x: Scalar) -> Scalar:
        return member_column(x, param)

    g = -grad if maximize else grad
    step.add_(1)
    if isinstance(weight_decay, Tensor) or weight_decay != 0:
        g = g + col(weight_decay) * param
    exp_avg.lerp_(g, col(1 - beta1))
    # clamp_min_ is torch.maximum in place (NaN included); `out=` would break dynamo's graph
    # on a non-contiguous state view.
    exp_inf.mul_(col(beta2)).clamp_min_(torch.abs(g, out=workspace).add_(col(eps)))
    clr = lr / (1 - torch.pow(beta1, step.double()))
    param.addcdiv_(torch.mul(exp_avg, col(-clr), out=workspace), exp_inf)


class StackedAdamax(StackedOptimizer):
    """Adamax over stacked parameters, with per-member hyperparameters.

    Member ``i`` is updated exactly as ``torch.optim.Adamax`` would update it alone with
    member ``i``'s hyperparameters; ``member_state_dict(i)`` hands it off to it.

    Args:
        params: Stacked tensors [n, ...], param-group dicts, or an Ensemble.
        lr: Learning rate, a float or one per member.
        betas: ``(beta1, beta2)``, each a float or one per member.
        eps: Term added to ``|g|``, a float or one per member.
        weight_decay: L2 penalty, a float or one per member.
        maximize: Maximise the objective.

    Raises:
        ValueError: Empty params, mismatched leading sizes, out-of-range or wrong-length
            hyperparameters.

    Example:
        >>> w = torch.zeros(2, 3, requires_grad=True)
        >>> opt = StackedAdamax([w], lr=[0.002, 0.02])
        >>> w.grad = torch.ones(2, 3)
        >>> opt.step()
        >>> w[:, 0]
        tensor([-0.0020, -0.0200], grad_fn=<SelectBackward0>)
    """

    hyperparameters: ClassVar[dict[str, Hyper]] = {
        "lr": Hyper("learning rate", ">= 0", NONNEGATIVE.ok),
        "betas": Hyper("beta parameter", "in [0, 1)", UNIT.ok, pair=True),
        "eps": Hyper("epsilon value", ">= 0", NONNEGATIVE.ok),
        "weight_decay": Hyper("weight_decay value", ">= 0", NONNEGATIVE.ok),
    }
    torch_class = torch.optim.Adamax

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]] | nn.Module,
        lr: PerMember = 2e-3,
        betas: tuple[PerMember, PerMember] = (0.9, 0.999),
        eps: PerMember = 1e-8,
        weight_decay: PerMember = 0.0,
        *,
        maximize: bool = False,
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults)

    def state_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("exp_avg", "exp_inf")

    def update_(
        self, param: Tensor, grad: Tensor, state: dict[str, Tensor], group: dict[str, Any]
    ) -> None:
        beta1, beta2 = group["betas"]
        adamax_update_(
            param,
            grad,
            state["exp_avg"],
            state["exp_inf"],
            state["step"],
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            maximize=group["maximize"],
            workspace=state.get("_workspace"),
        )
