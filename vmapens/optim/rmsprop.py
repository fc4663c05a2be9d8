"""RMSprop for stacked ensembles: the update rule and its optimizer."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ._hyper import member_floats
from .base import NONNEGATIVE, Hyper, Scalar, StackedOptimizer, member_column

__all__ = ["StackedRMSprop", "rmsprop_update_"]

PerMember = float | Sequence[float] | Tensor


def rmsprop_update_(
    param: Tensor,
    grad: Tensor,
    square_avg: Tensor,
    grad_avg: Tensor | None,
    momentum_buffer: Tensor | None,
    step: Tensor,
    *,
    lr: Scalar,
    alpha: Scalar,
    eps: Scalar,
    weight_decay: Scalar,
    momentum: Scalar,
    maximize: bool = False,
    workspace: Tensor | None = None,
) -> None:
    """One RMSprop step in place on a stacked tensor, each member with its own hyperparameters.

    Follows ``torch.optim.RMSprop``'s single-tensor update (Hinton's lecture 6e; the centered
    form from Graves, 2013) per member:

    .. code-block:: text

        g = -g if maximize;  g += wd * p
        v = alpha * v + (1 - alpha) * g * g
        a = sqrt(v - lerp(g_avg, g, 1 - alpha)**2) if centered else sqrt(v);  a += eps
        b = momentum * b + g / a;  p -= lr * b        (p -= lr * g / a without momentum)

    Centered when ``grad_avg`` is given. A member whose momentum is 0 gets ``b = g / a``, the
    plain step, so per-member momenta need no branch.

    Args:
        param: Stacked parameter [n, ...], updated in place.
        grad: Its gradient (not modified).
        square_avg: Running average of the squared gradient, updated in place.
        grad_avg: Running average of the gradient (centered RMSprop), else None.
        momentum_buffer: Shaped like ``param``, updated in place; None when no member uses
            momentum.
        step: Float32 [n] per-member step counts, updated in place.
        lr: A float or a float64 [n] tensor, as are the other hyperparameters.
        alpha: Smoothing constant.
        eps: Denominator term.
        weight_decay: L2 penalty.
        momentum: Momentum factor (read only with a ``momentum_buffer``).
        maximize: Ascend instead of descend.
        workspace: Optional tensor shaped like ``param`` to hold the denominator.

    Example:
        >>> p, g, v, s = torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3), torch.zeros(2)
        >>> rmsprop_update_(p, g, v, None, None, s, lr=torch.tensor([0.01, 0.1]), alpha=0.99,
        ...                 eps=1e-8, weight_decay=0.0, momentum=0.0)
        >>> p[:, 0]
        tensor([-0.1000, -1.0000])
    """

    def col(x: Scalar) -> Scalar:
        return member_column(x, param)

    g = -grad if maximize else grad
    step.add_(1)
    if isinstance(weight_decay, Tensor) or weight_decay != 0:
        g = g + col(weight_decay) * param
    if isinstance(alpha, Tensor):
        square_avg.mul_(col(alpha)).addcmul_(g, g * col(1 - alpha))
    else:
        square_avg.mul_(alpha).addcmul_(g, g, value=1 - alpha)
    if grad_avg is not None:
        grad_avg.lerp_(g, col(1 - alpha))
        avg = torch.addcmul(square_avg, grad_avg, grad_avg, value=-1, out=workspace).sqrt_()
    else:
        avg = torch.sqrt(square_avg, out=workspace)
    avg.add_(col(eps))
    if momentum_buffer is not None:
        momentum_buffer.mul_(col(momentum)).addcdiv_(g, avg)
        step_size = col(-lr)
        if isinstance(step_size, Tensor):
            param.addcmul_(momentum_buffer, step_size)
        else:
            param.add_(momentum_buffer, alpha=step_size)
    elif isinstance(lr, Tensor):
        param.addcdiv_(g * col(-lr), avg)
    else:
        param.addcdiv_(g, avg, value=-lr)


class StackedRMSprop(StackedOptimizer):
    """RMSprop over stacked parameters, with per-member hyperparameters.

    Member ``i`` is updated exactly as ``torch.optim.RMSprop`` would update it alone with
    member ``i``'s hyperparameters; ``member_state_dict(i)`` hands it off to it.

    Args:
        params: Stacked tensors [n, ...], param-group dicts, or an Ensemble.
        lr: Learning rate, a float or one per member.
        alpha: Smoothing constant, a float or one per member.
        eps: Denominator term, a float or one per member.
        weight_decay: L2 penalty, a float or one per member.
        momentum: Momentum factor, a float or one per member.
        centered: Normalise by the estimated variance of the gradient.
        maximize: Maximise the objective.

    Raises:
        ValueError: Empty params, mismatched leading sizes, out-of-range or wrong-length
            hyperparameters.

    Example:
        >>> w = torch.zeros(2, 3, requires_grad=True)
        >>> opt = StackedRMSprop([w], lr=0.01, momentum=[0.0, 0.9])
        >>> for _ in range(2):
        ...     w.grad = torch.ones(2, 3)
        ...     opt.step()
        >>> w[:, 0]
        tensor([-0.1709, -0.2609], grad_fn=<SelectBackward0>)
    """

    hyperparameters: ClassVar[dict[str, Hyper]] = {
        "lr": Hyper("learning rate", ">= 0", NONNEGATIVE.ok),
        "alpha": Hyper("alpha value", ">= 0", NONNEGATIVE.ok),
        "eps": Hyper("epsilon value", ">= 0", NONNEGATIVE.ok),
        "weight_decay": Hyper("weight_decay value", ">= 0", NONNEGATIVE.ok),
        "momentum": Hyper("momentum value", ">= 0", NONNEGATIVE.ok),
    }
    torch_class = torch.optim.RMSprop

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]] | nn.Module,
        lr: PerMember = 1e-2,
        alpha: PerMember = 0.99,
        eps: PerMember = 1e-8,
        weight_decay: PerMember = 0.0,
        momentum: PerMember = 0.0,
        centered: bool = False,
        *,
        maximize: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr,
            alpha=alpha,
            eps=eps,
            weight_decay=weight_decay,
            momentum=momentum,
            centered=centered,
            maximize=maximize,
        )
        super().__init__(params, defaults)

    def state_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        names: tuple[str, ...] = ("square_avg",)
        names += ("momentum_buffer",) if max(member_floats(group["momentum"])) > 0 else ()
        return (*names, "grad_avg") if group["centered"] else names

    def update_(
        self, param: Tensor, grad: Tensor, state: dict[str, Tensor], group: dict[str, Any]
    ) -> None:
        rmsprop_update_(
            param,
            grad,
            state["square_avg"],
            state.get("grad_avg"),
            state.get("momentum_buffer"),
            state["step"],
            lr=group["lr"],
            alpha=group["alpha"],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            momentum=group["momentum"],
            maximize=group["maximize"],
            workspace=state.get("_workspace"),
        )

    def member_state(
        self, state: dict[str, Tensor], group: dict[str, Any], i: int
    ) -> dict[str, Tensor]:
        # torch's RMSprop keeps a momentum buffer only where momentum > 0.
        out = super().member_state(state, group, i)
        momentum = member_floats(group["momentum"])
        if momentum[i % len(momentum)] == 0:
            out.pop("momentum_buffer", None)
        return out
