"""Adamax for stacked ensembles: the update rule and its optimizer."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ._columns import (
    alpha_columns,
    cpu_scalar,
    host_scalars,
    lerped,
    like,
    member_columns,
    signed,
    weight_decayed,
)
from ._fused import Writes, into, one_kernel_when, run_fused, safe_in_place, write_then_count
from ._hyper import BETAS, EPS, LR, WEIGHT_DECAY, Params, PerMember, Scalar
from ._keep import step_one
from .base import StackedOptimizer

__all__ = ["StackedAdamax", "adamax_rule", "adamax_update_"]


def _one_go(
    params: list[Tensor], grads: list[Tensor], state: dict[str, Any], group: dict[str, Any]
) -> bool:
    """Whether :func:`adamax_rule` writes everything in one go, its write phase (see ``safe_in_place``)."""
    lists = [params, grads, state["exp_avg"], state["exp_inf"]]
    values = [group["lr"], *group["betas"], group["eps"], group["weight_decay"]]
    return safe_in_place(group, lists, values, columns=True)


@one_kernel_when(_one_go)
def adamax_rule(
    params: list[Tensor], grads: list[Tensor], state: dict[str, Any], group: dict[str, Any]
) -> None:
    """One Adamax step in place on stacked tensors, each member with its own hyperparameters.

    Follows ``torch.optim.Adamax``'s single-tensor update (Kingma & Ba, 2015, Algorithm 2)
    per member with step ``t``:

    .. code-block:: text

        g = -g if maximize;  g += wd * p
        m = lerp(m, g, 1 - beta1);  u = max(beta2 * u, |g| + eps)
        p -= lr / (1 - beta1**t) * m / u

    With shared hyperparameters on CPU, torch's own foreach form with Python float step
    sizes, one call per step count (see ``run_fused``); per-member values take ``[n, 1, ...]``
    columns.

    Args:
        params: Stacked parameters [n, ...] sharing one step count, updated in place.
        grads: Their gradients (not modified).
        state: ``exp_avg``, ``exp_inf`` (one per parameter) and ``step`` ([n] counts).
        group: ``lr``, ``betas``, ``eps``, ``weight_decay`` (floats or float64 [n] tensors)
            and ``maximize``.
    """
    lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    exp_avg, exp_inf, step = state["exp_avg"], state["exp_inf"], state["step"]
    if host_scalars(params, [lr, beta1, beta2, eps, wd]):

        def kernel(t: list[list[Tensor]], count: float) -> Writes:
            p, m, u = t[0], t[2], t[3]
            g = signed(t[1], group)
            g = weight_decayed(g, p, group)
            norm = torch._foreach_abs(g)
            torch._foreach_add_(norm, cpu_scalar(eps, p[0]))
            clr = lr / (1 - beta1 ** (count + 1))
            return [  # the write phase: nothing in it allocates
                functools.partial(torch._foreach_lerp_, m, g, 1 - beta1),
                functools.partial(torch._foreach_mul_, u, cpu_scalar(beta2, p[0])),
                functools.partial(torch._foreach_maximum_, u, norm),
                functools.partial(torch._foreach_addcdiv_, p, m, u, value=-clr),
            ]

        run_fused(kernel, [params, grads, exp_avg, exp_inf], step, group["mask"])
        return

    # Per-member values: what allocates first, then the writes (optim/_fused.py).
    col: Callable[[Scalar], Any] = functools.partial(member_columns, like=params)
    g = weight_decayed(signed(grads, group), params, group)
    norm = torch._foreach_abs(g)
    torch._foreach_add_(norm, alpha_columns(eps, norm))
    clr = lr / like(lr, 1 - torch.pow(beta1, step.double() + 1))  # the counts after this step
    scaled = [torch.empty_like(m) for m in exp_avg]
    writes = [
        lerped(exp_avg, g, col(1 - beta1)),
        functools.partial(torch._foreach_mul_, exp_inf, col(beta2)),
        functools.partial(torch._foreach_maximum_, exp_inf, norm),
        *into(torch.mul, scaled, exp_avg, col(-clr)),
        functools.partial(torch._foreach_addcdiv_, params, scaled, exp_inf),
    ]
    write_then_count(writes, step)


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
    """:func:`adamax_rule` on one stacked tensor and its state, in place.

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
        workspace: Accepted for compatibility and unused.

    Example:
        >>> p, g, z, s = torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3), torch.zeros(2)
        >>> adamax_update_(p, g, z, z.clone(), s, lr=torch.tensor([0.1, 0.2]), beta1=0.9,
        ...                beta2=0.999, eps=0.0, weight_decay=0.0)
        >>> p[:, 0]
        tensor([-0.1000, -0.2000])
    """

    hyper = dict(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
    moments = {"exp_avg": exp_avg, "exp_inf": exp_inf}
    step_one(adamax_rule, param, grad, moments, {"step": step}, {**hyper, "maximize": maximize})


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
        **implementation: torch's implementation flags that ``torch.optim.Adamax`` takes
            (see :class:`~vmapens.optim.StackedOptimizer`).

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

    hyperparameters = {"lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": WEIGHT_DECAY}
    torch_class = torch.optim.Adamax
    rule = staticmethod(adamax_rule)

    def __init__(
        self,
        params: Params,
        lr: PerMember = 2e-3,
        betas: tuple[PerMember, PerMember] = (0.9, 0.999),
        eps: PerMember = 1e-8,
        weight_decay: PerMember = 0.0,
        *,
        maximize: bool = False,
        **implementation: Any,
    ) -> None:
        super().__init__(params, locals())

    def state_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("exp_avg", "exp_inf")
