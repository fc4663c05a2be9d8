"""Adagrad for stacked ensembles: the update rule and its optimizer."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from .base import (
    NONNEGATIVE,
    Hyper,
    Scalar,
    StackedOptimizer,
    fusable,
    member_column,
    run_fused,
)

__all__ = ["StackedAdagrad", "adagrad_update_"]

PerMember = float | Sequence[float] | Tensor


def adagrad_update_(
    param: Tensor,
    grad: Tensor,
    state_sum: Tensor,
    step: Tensor,
    *,
    lr: Scalar,
    lr_decay: Scalar,
    weight_decay: Scalar,
    eps: Scalar,
    maximize: bool = False,
    workspace: Tensor | None = None,
) -> None:
    """One Adagrad step in place on a stacked tensor, each member with its own hyperparameters.

    Follows ``torch.optim.Adagrad``'s single-tensor update (Duchi et al., 2011) per member
    with step ``t``:

    .. code-block:: text

        g = -g if maximize;  g += wd * p
        clr = lr / (1 + (t - 1) * lr_decay)
        s += g * g;  p -= clr * g / (sqrt(s) + eps)

    Args:
        param: Stacked parameter [n, ...], updated in place.
        grad: Its gradient (not modified).
        state_sum: Sum of squared gradients, updated in place.
        step: Float32 [n] per-member step counts, updated in place.
        lr: A float or a float64 [n] tensor, as are the other hyperparameters.
        lr_decay: Learning-rate decay per step.
        weight_decay: L2 penalty.
        eps: Denominator term.
        maximize: Ascend instead of descend.
        workspace: Optional tensor shaped like ``param`` to hold the denominator.

    Example:
        >>> p, g, s, t = torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3), torch.zeros(2)
        >>> adagrad_update_(p, g, s, t, lr=torch.tensor([0.1, 0.2]), lr_decay=0.0,
        ...                 weight_decay=0.0, eps=1e-10)
        >>> p[:, 0]
        tensor([-0.1000, -0.2000])
    """

    def col(x: Scalar) -> Scalar:
        return member_column(x, param)

    step.add_(1)
    g = -grad if maximize else grad
    if isinstance(weight_decay, Tensor) or weight_decay != 0:
        g = g + col(weight_decay) * param
    clr = lr / (1 + (step.double() - 1) * lr_decay)
    state_sum.addcmul_(g, g)
    std = torch.sqrt(state_sum, out=workspace).add_(col(eps))
    param.addcdiv_(g * col(-clr), std)


class StackedAdagrad(StackedOptimizer):
    """Adagrad over stacked parameters, with per-member hyperparameters.

    Member ``i`` is updated exactly as ``torch.optim.Adagrad`` would update it alone with
    member ``i``'s hyperparameters; ``member_state_dict(i)`` hands it off to it. The sum of
    squares starts at each member's ``initial_accumulator_value``.

    Args:
        params: Stacked tensors [n, ...], param-group dicts, or an Ensemble.
        lr: Learning rate, a float or one per member.
        lr_decay: Learning-rate decay, a float or one per member.
        weight_decay: L2 penalty, a float or one per member.
        initial_accumulator_value: Starting sum of squares, a float or one per member.
        eps: Denominator term, a float or one per member.
        maximize: Maximise the objective.

    Raises:
        ValueError: Empty params, mismatched leading sizes, out-of-range or wrong-length
            hyperparameters.

    Example:
        >>> w = torch.zeros(2, 3, requires_grad=True)
        >>> opt = StackedAdagrad([w], lr=0.1, initial_accumulator_value=[0.0, 3.0])
        >>> w.grad = torch.ones(2, 3)
        >>> opt.step()
        >>> w[:, 0]
        tensor([-0.1000, -0.0500], grad_fn=<SelectBackward0>)
    """

    hyperparameters: ClassVar[dict[str, Hyper]] = {
        "lr": Hyper("learning rate", ">= 0", NONNEGATIVE.ok),
        "lr_decay": Hyper("lr_decay value", ">= 0", NONNEGATIVE.ok),
        "weight_decay": Hyper("weight_decay value", ">= 0", NONNEGATIVE.ok),
        "initial_accumulator_value": Hyper(
            "initial_accumulator_value value", ">= 0", NONNEGATIVE.ok
        ),
        "eps": Hyper("epsilon value", ">= 0", NONNEGATIVE.ok),
    }
    torch_class = torch.optim.Adagrad

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]] | nn.Module,
        lr: PerMember = 1e-2,
        lr_decay: PerMember = 0.0,
        weight_decay: PerMember = 0.0,
        initial_accumulator_value: PerMember = 0.0,
        eps: PerMember = 1e-10,
        *,
        maximize: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr,
            lr_decay=lr_decay,
            weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value,
            eps=eps,
            maximize=maximize,
        )
        super().__init__(params, defaults)

    def state_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("sum",)

    def initial_state(self, name: str, param: Tensor, group: dict[str, Any]) -> Tensor:
        start = super().initial_state(name, param, group)
        return start.add_(member_column(group["initial_accumulator_value"], param))

    def update_(
        self, param: Tensor, grad: Tensor, state: dict[str, Tensor], group: dict[str, Any]
    ) -> None:
        if fusable(state, [group[k] for k in ("lr", "lr_decay", "weight_decay", "eps")]):
            # torch's fused CPU kernel when members share the hyperparameters (run_fused: one
            # call per step count); like torch, pass the count after this step.

            def kernel(t: list[Tensor], count: float) -> None:
                torch._fused_adagrad_(
                    [t[0]],
                    [t[1]],
                    [t[2]],
                    [torch.tensor(count + 1.0)],
                    lr=group["lr"],
                    lr_decay=group["lr_decay"],
                    weight_decay=group["weight_decay"],
                    eps=group["eps"],
                    maximize=group["maximize"],
                )

            run_fused(kernel, [param, grad, state["sum"]], state["step"], state.get("_mask"))
            return
        adagrad_update_(
            param,
            grad,
            state["sum"],
            state["step"],
            lr=group["lr"],
            lr_decay=group["lr_decay"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
            workspace=state.get("_workspace"),
        )
