"""RAdam for stacked ensembles: the update rule and its optimizer."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ._columns import (
    alpha_columns,
    cpu_scalar,
    decayed_writes,
    host_scalars,
    member_columns,
    moment_writes,
    signed,
)
from ._fused import (
    Writes,
    into,
    joined_empty,
    one_kernel_when,
    run_fused,
    safe_in_place,
    write_then_count,
)
from ._hyper import LR, NONNEGATIVE, UNIT, Hyper, PerMember, Scalar
from .base import StackedOptimizer

__all__ = ["StackedRAdam", "radam_rule"]


def _one_go(
    params: list[Tensor], grads: list[Tensor], state: dict[str, Any], group: dict[str, Any]
) -> bool:
    """Whether :func:`radam_rule` writes everything in one go, its write phase (see ``safe_in_place``)."""
    lists = [params, grads, state["exp_avg"], state["exp_avg_sq"]]
    values = [group["lr"], *group["betas"], group["eps"], group["weight_decay"]]
    return safe_in_place(group, lists, values, columns=True)


@one_kernel_when(_one_go)
def radam_rule(
    params: list[Tensor], grads: list[Tensor], state: dict[str, Any], group: dict[str, Any]
) -> None:
    """One RAdam step in place on stacked tensors, each member with its own hyperparameters.

    Follows ``torch.optim.RAdam``'s single-tensor update (Liu et al., 2020, "On the Variance
    of the Adaptive Learning Rate and Beyond", Algorithm 2; decoupled decay as in AdamW) per
    member with step ``t``:

    .. code-block:: text

        g = -g if maximize;  g += wd * p   (or p *= 1 - lr * wd if decoupled)
        m = lerp(m, g, 1 - beta1);  v = beta2 * v + (1 - beta2) * g * g
        rho_inf = 2 / (1 - beta2) - 1;  rho_t = rho_inf - 2 t beta2**t / (1 - beta2**t)
        r = sqrt((rho_t - 4)(rho_t - 2) rho_inf / ((rho_inf - 4)(rho_inf - 2) rho_t))
        p -= m / (1 - beta1**t) * lr * sqrt(1 - beta2**t) / (sqrt(v) + eps) * r   if rho_t > 5
        p -= m / (1 - beta1**t) * lr                                              otherwise

    With shared hyperparameters on CPU, torch's single-tensor arithmetic with Python float
    step sizes and branch, over the whole stacked tensors, one call per step count (see
    ``run_fused``), a 0-d tensor ``lr`` entering its ops as torch's does; per-member values
    take ``[n, 1, ...]`` columns, and each member its own branch (``torch.where`` on its
    ``rho_t``).

    Args:
        params: Stacked parameters [n, ...] sharing one step count, updated in place.
        grads: Their gradients (not modified).
        state: ``exp_avg``, ``exp_avg_sq`` (one per parameter) and ``step`` ([n] counts).
        group: ``lr``, ``betas``, ``eps``, ``weight_decay`` (floats or float64 [n] tensors;
            ``lr`` also a 0-d tensor), ``decoupled_weight_decay`` and ``maximize``.
    """
    lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    exp_avg, exp_avg_sq, step = state["exp_avg"], state["exp_avg_sq"], state["step"]
    if host_scalars(params, [beta1, beta2, eps, wd], lr=lr):
        run_fused(
            functools.partial(_shared_kernel, group=group),
            [params, grads, exp_avg, exp_avg_sq],
            step,
            group["mask"],
        )
        return

    # Per-member values: what allocates first, then the writes (optim/_fused.py).
    col: Callable[[Scalar], Any] = functools.partial(member_columns, like=params)
    g, writes = decayed_writes(signed(grads, group), params, group)
    t = step.double() + 1  # the counts after this step
    bias_correction1 = 1 - torch.pow(beta1, t)
    bias_correction2 = 1 - torch.pow(beta2, t)
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = rho_inf - 2 * t * torch.pow(beta2, t) / bias_correction2
    rect = ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)).sqrt()
    takes = [c.bool() for c in col((rho_t > 5.0).double())]  # each member's own branch
    update, denom, adaptive, rectified, chosen = (
        [torch.empty_like(m) for m in exp_avg] for _ in range(5)
    )
    writes += [
        *moment_writes(exp_avg, exp_avg_sq, g, beta1, beta2),
        *into(torch.div, update, exp_avg, col(bias_correction1)),
        functools.partial(torch._foreach_mul_, update, col(lr)),
        *into(torch.sqrt, denom, exp_avg_sq),
        functools.partial(torch._foreach_add_, denom, alpha_columns(eps, denom)),
        *into(torch.div, adaptive, col(bias_correction2.sqrt()), denom),
        *into(torch.mul, rectified, update, adaptive),
        functools.partial(torch._foreach_mul_, rectified, col(rect)),
        *into(torch.where, chosen, takes, rectified, update),
        functools.partial(torch._foreach_sub_, params, chosen),
    ]
    write_then_count(writes, step)


def _scratch(like: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
    """Scratch for tensors shaped like ``like``: what the whole-buffer ops of
    :func:`_in_place` run on, and the per-tensor views.

    One flat buffer (``joined_empty``) where ``like`` has one dtype; else a tensor each, in
    its own dtype: a flat buffer in the first tensor's dtype would round a float64
    parameter's update to float32 (or compute a float32 one in float64), where torch
    computes each parameter's update in its own dtype.
    """
    if len({t.dtype for t in like}) == 1:
        flat, views = joined_empty(like)
        return [flat], views
    views = [torch.empty_like(t) for t in like]
    return views, views


def _in_place(name: str, out: list[Tensor], arg: Any = None) -> Callable[[], Any]:
    """The write ``out.<name>_(arg)`` on :func:`_scratch`'s buffers: one call on one flat
    buffer, else a ``torch._foreach_<name>_`` (a list ``arg`` pairs with ``out``)."""
    if len(out) == 1:
        method = getattr(out[0], f"{name}_")
        other = arg[0] if isinstance(arg, list) else arg
        return method if arg is None else functools.partial(method, other)
    op = getattr(torch, f"_foreach_{name}_")
    return functools.partial(op, out) if arg is None else functools.partial(op, out, arg)


def _shared_kernel(t: list[list[Tensor]], count: float, group: dict[str, Any]) -> Writes:
    """``torch.optim.RAdam``'s single-tensor step at step ``count + 1``, op for op, on whole
    stacked tensors ``t`` (params, grads, exp_avg, exp_avg_sq) with shared float
    hyperparameters: the same roundings as each member alone. What allocates comes first,
    then the writes (``optim/_fused.py``); the step's scratch is one flat buffer each
    (``joined_empty``), so that its ops are one call each, or a tensor per parameter where the
    group mixes dtypes (:func:`_scratch`)."""
    lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
    p, m, v = t[0], t[2], t[3]
    g, writes = decayed_writes(signed(t[1], group), p, group)
    step = count + 1
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    update, updates = _scratch(m)
    writes += [
        *moment_writes(m, v, g, beta1, beta2),
        *into(torch.div, updates, m, cpu_scalar(bias_correction1, p[0])),
        _in_place("mul", update, lr),
    ]
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = rho_inf - 2 * step * (beta2**step) / bias_correction2
    if rho_t > 5.0:
        # torch: m_hat * lr * (bc2**0.5 / (sqrt(v) + eps)) * rect; a float over a tensor is
        # its reciprocal times the float.
        adaptive, adaptives = _scratch(v)
        rect = (rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)
        writes += [
            *into(torch.sqrt, adaptives, v),
            _in_place("add", adaptive, eps),
            _in_place("reciprocal", adaptive),
            _in_place("mul", adaptive, bias_correction2**0.5),
            _in_place("mul", update, adaptive),
            _in_place("mul", update, rect**0.5),
        ]
    return [*writes, functools.partial(torch._foreach_add_, p, updates, alpha=-1.0)]


class StackedRAdam(StackedOptimizer):
    """RAdam over stacked parameters, with per-member hyperparameters.

    Member ``i`` is updated exactly as ``torch.optim.RAdam`` would update it alone with member
    ``i``'s hyperparameters (each member takes the rectified or the plain step by its own
    ``rho_t``); ``member_state_dict(i)`` hands it off to it.

    Args:
        params: Stacked tensors [n, ...], param-group dicts, or an Ensemble.
        lr: Learning rate: a float, a 0-d tensor (kept, and computed with as torch does), or
            one per member.
        betas: ``(beta1, beta2)``, each a float or one per member.
        eps: Denominator term, a float or one per member.
        weight_decay: Weight decay, a float or one per member.
        decoupled_weight_decay: AdamW-style decay.
        maximize: Maximise the objective.
        **implementation: torch's implementation flags that ``torch.optim.RAdam`` takes
            (see :class:`~vmapens.optim.StackedOptimizer`).

    Raises:
        ValueError: Empty params, mismatched leading sizes, out-of-range or wrong-length
            hyperparameters.

    Example:
        >>> w = torch.zeros(2, 3, requires_grad=True)
        >>> opt = StackedRAdam([w], lr=[1e-3, 1e-2])
        >>> w.grad = torch.ones(2, 3)
        >>> opt.step()  # rho_1 <= 5: the plain step, lr * m / (1 - beta1)
        >>> w[:, 0]
        tensor([-0.0010, -0.0100], grad_fn=<SelectBackward0>)
    """

    hyperparameters: ClassVar[dict[str, Hyper]] = {
        "lr": LR,
        "betas": Hyper("beta parameter", "in [0, 1)", UNIT.ok, pair=True),
        "eps": Hyper("epsilon value", ">= 0", NONNEGATIVE.ok),
        "weight_decay": Hyper("weight_decay value", ">= 0", NONNEGATIVE.ok),
    }
    torch_class = torch.optim.RAdam
    rule = staticmethod(radam_rule)

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]] | nn.Module,
        lr: PerMember = 1e-3,
        betas: tuple[PerMember, PerMember] = (0.9, 0.999),
        eps: PerMember = 1e-8,
        weight_decay: PerMember = 0.0,
        decoupled_weight_decay: bool = False,
        *,
        maximize: bool = False,
        **implementation: Any,
    ) -> None:
        super().__init__(params, locals())

    def state_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")
