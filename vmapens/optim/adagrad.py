"""Adagrad for stacked ensembles: the update rule and its optimizer."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ._columns import (
    alpha_columns,
    host_scalars,
    like,
    member_column,
    member_columns,
    signed,
    weight_decayed,
)
from ._fused import (
    Writes,
    fusable,
    into,
    one_kernel_when,
    run_fused,
    safe_in_place,
    write_then_count,
)
from ._hyper import EPS, LR, WEIGHT_DECAY, Params, PerMember, Scalar, nonnegative
from ._keep import step_one
from .base import StackedOptimizer

__all__ = ["StackedAdagrad", "adagrad_rule", "adagrad_update_"]


def _fused(
    params: list[Tensor], grads: list[Tensor], state: dict[str, Any], group: dict[str, Any]
) -> bool:
    """Whether :func:`adagrad_rule` takes torch's fused kernel (shared hyperparameters, on CPU)."""
    values = [group[k] for k in ("lr", "lr_decay", "weight_decay", "eps")]
    return fusable(group, [params, grads, state["sum"]], values)


def _one_go(
    params: list[Tensor], grads: list[Tensor], state: dict[str, Any], group: dict[str, Any]
) -> bool:
    """Whether :func:`adagrad_rule` writes everything in one go: the fused kernel, or with
    ``fused=False`` the write phase of :func:`_shared_kernel` (see ``safe_in_place``)."""
    values = [group[k] for k in ("lr", "lr_decay", "weight_decay", "eps")]
    return safe_in_place(group, [params, grads, state["sum"]], values, columns=True)


@one_kernel_when(_one_go)
def adagrad_rule(
    params: list[Tensor], grads: list[Tensor], state: dict[str, Any], group: dict[str, Any]
) -> None:
    """One Adagrad step in place on stacked tensors, each member with its own hyperparameters.

    Follows ``torch.optim.Adagrad``'s single-tensor update (Duchi et al., 2011) per member
    with step ``t``:

    .. code-block:: text

        g = -g if maximize;  g += wd * p
        clr = lr / (1 + (t - 1) * lr_decay)
        s += g * g;  p -= clr * g / (sqrt(s) + eps)

    With shared hyperparameters on CPU, torch's fused kernel (see ``run_fused``).

    Args:
        params: Stacked parameters [n, ...] sharing one step count, updated in place.
        grads: Their gradients (not modified).
        state: ``sum`` (one per parameter) and ``step`` ([n] counts), updated in place.
        group: ``lr``, ``lr_decay``, ``weight_decay``, ``eps`` (floats or float64 [n]
            tensors), ``maximize``, ``fused``, ``mask``.
    """
    lr, lr_decay, wd, eps = (group[k] for k in ("lr", "lr_decay", "weight_decay", "eps"))
    sums, step = state["sum"], state["step"]
    if _fused(params, grads, state, group):
        # Like torch, the kernel gets the count after this step.

        def kernel(t: list[list[Tensor]], count: float) -> Callable[[], Any]:
            return functools.partial(
                torch._fused_adagrad_,
                t[0],
                t[1],
                t[2],
                [torch.tensor(count + 1.0)] * len(t[0]),
                lr=lr,
                lr_decay=lr_decay,
                weight_decay=wd,
                eps=eps,
                maximize=group["maximize"],
            )

        run_fused(kernel, [params, grads, sums], step, group["mask"])
        return
    if host_scalars(params, [lr, lr_decay, wd, eps]):  # fused=False: torch's bits
        shared = functools.partial(_shared_kernel, group=group)
        run_fused(shared, [params, grads, sums], step, group["mask"])
        return

    # Per-member values: what allocates first, then the writes (optim/_fused.py).
    col: Callable[[Scalar], Any] = functools.partial(member_columns, like=params)
    g = weight_decayed(signed(grads, group), params, group)
    t = step.double() + 1  # the counts after this step
    clr = lr / like(lr, 1 + (t - 1) * lr_decay)
    scaled = torch._foreach_mul(g, col(-clr))
    std = [torch.empty_like(s) for s in sums]
    writes = [
        functools.partial(torch._foreach_addcmul_, sums, g, g),
        *into(torch.sqrt, std, sums),
        functools.partial(torch._foreach_add_, std, alpha_columns(eps, std)),
        functools.partial(torch._foreach_addcdiv_, params, scaled, std),
    ]
    write_then_count(writes, step)


def _shared_kernel(t: list[list[Tensor]], count: float, group: dict[str, Any]) -> Writes:
    """``torch.optim.Adagrad``'s single-tensor step at step ``count + 1``, op for op, on whole
    stacked tensors ``t`` (params, grads, sum) with shared float hyperparameters: each
    member's bits as alone. What allocates comes first, then the writes (``optim/_fused.py``)."""
    lr, lr_decay, eps = group["lr"], group["lr_decay"], group["eps"]
    p, sums = t[0], t[2]
    g = weight_decayed(signed(t[1], group), p, group)
    clr = lr / (1 + count * lr_decay)  # torch: (step - 1) with the step after this one
    std = [torch.empty_like(x) for x in sums]
    return [
        functools.partial(torch._foreach_addcmul_, sums, g, g),
        *into(torch.sqrt, std, sums),
        functools.partial(torch._foreach_add_, std, eps),
        functools.partial(torch._foreach_addcdiv_, p, g, std, value=-clr),
    ]


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
    """:func:`adagrad_rule` on one stacked tensor and its state, in place.

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
        workspace: Accepted for compatibility and unused.

    Example:
        >>> p, g, s, t = torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3), torch.zeros(2)
        >>> adagrad_update_(p, g, s, t, lr=torch.tensor([0.1, 0.2]), lr_decay=0.0,
        ...                 weight_decay=0.0, eps=1e-10)
        >>> p[:, 0]
        tensor([-0.1000, -0.2000])
    """

    hyper = dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay, eps=eps)
    step_one(
        adagrad_rule,
        param,
        grad,
        {"sum": state_sum},
        {"step": step},
        {**hyper, "maximize": maximize},
    )


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
        **implementation: torch's implementation flags that ``torch.optim.Adagrad`` takes
            (see :class:`~vmapens.optim.StackedOptimizer`).

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

    hyperparameters = {
        "lr": LR,
        "lr_decay": nonnegative("lr_decay value"),
        "weight_decay": WEIGHT_DECAY,
        "initial_accumulator_value": nonnegative("initial_accumulator_value value"),
        "eps": EPS,
    }
    torch_class = torch.optim.Adagrad
    rule = staticmethod(adagrad_rule)

    def __init__(
        self,
        params: Params,
        lr: PerMember = 1e-2,
        lr_decay: PerMember = 0.0,
        weight_decay: PerMember = 0.0,
        initial_accumulator_value: PerMember = 0.0,
        eps: PerMember = 1e-10,
        *,
        maximize: bool = False,
        **implementation: Any,
    ) -> None:
        super().__init__(params, locals())

    def state_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("sum",)

    def member_state(
        self, state: dict[str, Tensor], group: dict[str, Any], i: int
    ) -> dict[str, Tensor]:
        # torch's Adagrad makes its state when it is built: also before a member's first step.
        return {key: v[i].clone() for key, v in state.items()}

    def initial_state(self, name: str, param: Tensor, group: dict[str, Any]) -> Tensor:
        start = super().initial_state(name, param, group)
        return start.add_(member_column(group["initial_accumulator_value"], param))
