"""NAdam for stacked ensembles: the update rule and its optimizer."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from .base import NONNEGATIVE, UNIT, Hyper, Scalar, StackedOptimizer, member_column

__all__ = ["StackedNAdam", "nadam_update_"]

PerMember = float | Sequence[float] | Tensor


def nadam_update_(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    mu_product: Tensor,
    step: Tensor,
    *,
    lr: Scalar,
    beta1: Scalar,
    beta2: Scalar,
    eps: Scalar,
    weight_decay: Scalar,
    momentum_decay: Scalar,
    decoupled_weight_decay: bool = False,
    maximize: bool = False,
    workspace: Tensor | None = None,
) -> None:
    """One NAdam step in place on a stacked tensor, each member with its own hyperparameters.

    Follows ``torch.optim.NAdam``'s single-tensor update (Dozat, 2016; NAdamW's decoupled
    decay from Loshchilov & Hutter, 2019) per member with step ``t``:

    .. code-block:: text

        g = -g if maximize;  g += wd * p   (or p *= 1 - lr * wd if decoupled)
        mu_t = beta1 * (1 - 0.5 * 0.96**(t * momentum_decay));  P_t = P_{t-1} * mu_t
        m = lerp(m, g, 1 - beta1);  v = beta2 * v + (1 - beta2) * g * g
        d = sqrt(v / (1 - beta2**t)) + eps
        p -= lr * (1 - mu_t) / (1 - P_t) * g / d + lr * mu_{t+1} / (1 - P_t * mu_{t+1}) * m / d

    The momentum product ``P`` (``mu_product``) is float32 ``[n]`` and rounded like torch's
    float32 scalar tensor.

    Args:
        param: Stacked parameter [n, ...], updated in place.
        grad: Its gradient (not modified).
        exp_avg: First moment, updated in place.
        exp_avg_sq: Second moment, updated in place.
        mu_product: Float32 [n] product of the momentum schedule, updated in place.
        step: Float32 [n] per-member step counts, updated in place.
        lr: A float or a float64 [n] tensor, as are the other hyperparameters.
        beta1: First-moment decay.
        beta2: Second-moment decay.
        eps: Denominator term.
        weight_decay: L2 (or decoupled) weight decay.
        momentum_decay: Decay of the momentum schedule.
        decoupled_weight_decay: NAdamW-style decay.
        maximize: Ascend instead of descend.
        workspace: Optional tensor shaped like ``param`` to hold the denominator.

    Example:
        >>> p, g, z, s = torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3), torch.zeros(2)
        >>> nadam_update_(p, g, z, z.clone(), torch.ones(2), s, lr=torch.tensor([0.1, 0.2]),
        ...               beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
        ...               momentum_decay=4e-3)
        >>> p[:, 0]
        tensor([-0.1056, -0.2113])
    """

    def col(x: Scalar) -> Scalar:
        return member_column(x, param)

    g = -grad if maximize else grad
    step.add_(1)
    t = step.double()
    bias_correction2 = 1 - torch.pow(beta2, t)
    if isinstance(weight_decay, Tensor) or weight_decay != 0:
        if decoupled_weight_decay:
            param.mul_(col(1 - lr * weight_decay))
        else:
            g = g + col(weight_decay) * param
    mu = beta1 * (1.0 - 0.5 * torch.pow(0.96, t * momentum_decay))
    mu_next = beta1 * (1.0 - 0.5 * torch.pow(0.96, (t + 1) * momentum_decay))
    # torch multiplies its float32 scalar by a Python float: in float32, mu rounded first.
    mu_product.mul_(mu.float())
    product = mu_product.double()
    exp_avg.lerp_(g, col(1 - beta1))
    if isinstance(beta2, Tensor):
        exp_avg_sq.mul_(col(beta2)).addcmul_(g, g * col(1 - beta2))
    else:
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = torch.div(exp_avg_sq, col(bias_correction2), out=workspace).sqrt_().add_(col(eps))
    param.addcdiv_(g * col(-lr * (1.0 - mu) / (1.0 - product)), denom)
    param.addcdiv_(exp_avg * col((-lr * mu_next) / (1.0 - product * mu_next)), denom)


class StackedNAdam(StackedOptimizer):
    """NAdam (and NAdamW) over stacked parameters, with per-member hyperparameters.

    Member ``i`` is updated exactly as ``torch.optim.NAdam`` would update it alone with
    member ``i``'s hyperparameters; ``member_state_dict(i)`` hands it off to it, its
    ``mu_product`` included.

    Args:
        params: Stacked tensors [n, ...], param-group dicts, or an Ensemble.
        lr: Learning rate, a float or one per member.
        betas: ``(beta1, beta2)``, each a float or one per member.
        eps: Denominator term, a float or one per member.
        weight_decay: Weight decay, a float or one per member.
        momentum_decay: Decay of the momentum schedule, a float or one per member.
        decoupled_weight_decay: NAdamW-style decay.
        maximize: Maximise the objective.

    Raises:
        ValueError: Empty params, mismatched leading sizes, out-of-range or wrong-length
            hyperparameters.

    Example:
        >>> w = torch.zeros(2, 3, requires_grad=True)
        >>> opt = StackedNAdam([w], lr=[0.002, 0.02])
        >>> w.grad = torch.ones(2, 3)
        >>> opt.step()
        >>> w[:, 0], opt.state[w]["mu_product"]
        (tensor([-0.0021, -0.0211], grad_fn=<SelectBackward0>), tensor([0.4501, 0.4501]))
    """

    hyperparameters: ClassVar[dict[str, Hyper]] = {
        "lr": Hyper("learning rate", ">= 0", NONNEGATIVE.ok),
        "betas": Hyper("beta parameter", "in [0, 1)", UNIT.ok, pair=True),
        "eps": Hyper("epsilon value", ">= 0", NONNEGATIVE.ok),
        "weight_decay": Hyper("weight_decay value", ">= 0", NONNEGATIVE.ok),
        "momentum_decay": Hyper("momentum_decay value", ">= 0", NONNEGATIVE.ok),
    }
    torch_class = torch.optim.NAdam

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]] | nn.Module,
        lr: PerMember = 2e-3,
        betas: tuple[PerMember, PerMember] = (0.9, 0.999),
        eps: PerMember = 1e-8,
        weight_decay: PerMember = 0.0,
        momentum_decay: PerMember = 4e-3,
        decoupled_weight_decay: bool = False,
        *,
        maximize: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            momentum_decay=momentum_decay,
            decoupled_weight_decay=decoupled_weight_decay,
            maximize=maximize,
        )
        super().__init__(params, defaults)

    def state_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")

    def scalar_state(self, group: dict[str, Any]) -> dict[str, float]:
        return {"step": 0.0, "mu_product": 1.0}

    def update_(
        self, param: Tensor, grad: Tensor, state: dict[str, Tensor], group: dict[str, Any]
    ) -> None:
        beta1, beta2 = group["betas"]
        nadam_update_(
            param,
            grad,
            state["exp_avg"],
            state["exp_avg_sq"],
            state["mu_product"],
            state["step"],
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            momentum_decay=group["momentum_decay"],
            decoupled_weight_decay=group["decoupled_weight_decay"],
            maximize=group["maximize"],
            workspace=state.get("_workspace"),
        )
