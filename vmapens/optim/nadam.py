"""NAdam for stacked ensembles: the update rule and its optimizer."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ._columns import (
    alpha_columns,
    decayed_writes,
    host_scalars,
    like,
    member_columns,
    moment_writes,
    signed,
)
from ._fused import Writes, into, one_kernel_when, run_fused, safe_in_place, write_then_count
from ._hyper import BETAS, EPS, LR, WEIGHT_DECAY, Params, PerMember, Scalar, nonnegative
from ._keep import step_one
from .base import StackedOptimizer

__all__ = ["StackedNAdam", "nadam_rule", "nadam_update_"]


def _lists(params: list[Tensor], grads: list[Tensor], state: dict[str, Any]) -> list[list[Tensor]]:
    return [params, grads, state["exp_avg"], state["exp_avg_sq"], [state["mu_product"]]]


def _one_go(
    params: list[Tensor], grads: list[Tensor], state: dict[str, Any], group: dict[str, Any]
) -> bool:
    """Whether :func:`nadam_rule` writes everything in one go, its write phase (see ``safe_in_place``)."""
    values = [group["lr"], *group["betas"], group["eps"], group["weight_decay"]]
    values.append(group["momentum_decay"])
    return safe_in_place(group, _lists(params, grads, state), values, columns=True)


@one_kernel_when(_one_go)
def nadam_rule(
    params: list[Tensor], grads: list[Tensor], state: dict[str, Any], group: dict[str, Any]
) -> None:
    """One NAdam step in place on stacked tensors, each member with its own hyperparameters.

    Follows ``torch.optim.NAdam``'s single-tensor update (Dozat, 2016; NAdamW's decoupled
    decay from Loshchilov & Hutter, 2019) per member with step ``t``:

    .. code-block:: text

        g = -g if maximize;  g += wd * p   (or p *= 1 - lr * wd if decoupled)
        mu_t = beta1 * (1 - 0.5 * 0.96**(t * momentum_decay));  P_t = P_{t-1} * mu_t
        m = lerp(m, g, 1 - beta1);  v = beta2 * v + (1 - beta2) * g * g
        d = sqrt(v / (1 - beta2**t)) + eps
        p -= lr * (1 - mu_t) / (1 - P_t) * g / d + lr * mu_{t+1} / (1 - P_t * mu_{t+1}) * m / d

    The momentum product ``P`` (``mu_product``) is ``[n]`` in ``step``'s dtype and rounded like
    torch's scalar tensor (float32, or float64 under a float64 default dtype). With shared
    hyperparameters on CPU, the schedule and bias correction are Python floats, as torch
    computes them, one call per step count (see ``run_fused``); per-member values take
    ``[n, 1, ...]`` columns.

    Args:
        params: Stacked parameters [n, ...] sharing one step count, updated in place.
        grads: Their gradients (not modified).
        state: ``exp_avg``, ``exp_avg_sq`` (one per parameter), ``mu_product`` and ``step``
            (float32 or float64 [n], one dtype).
        group: ``lr``, ``betas``, ``eps``, ``weight_decay``, ``momentum_decay`` (floats or
            float64 [n] tensors), ``decoupled_weight_decay`` and ``maximize``.
    """
    lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    exp_avg, exp_avg_sq, step = state["exp_avg"], state["exp_avg_sq"], state["step"]
    decay = group["momentum_decay"]
    col: Callable[[Scalar], Any] = functools.partial(member_columns, like=params)
    if host_scalars(params, [lr, beta1, beta2, eps, wd, decay]):
        kernel = functools.partial(_shared_kernel, group=group)
        run_fused(kernel, _lists(params, grads, state), step, group["mask"])
        return

    # Per-member values: what allocates first, then the writes (optim/_fused.py).
    g, writes = decayed_writes(signed(grads, group), params, group)
    t = step.double() + 1  # the counts after this step
    bias_correction2 = 1 - torch.pow(beta2, t)
    mu = beta1 * (1.0 - 0.5 * torch.pow(0.96, t * decay))
    mu_next = beta1 * (1.0 - 0.5 * torch.pow(0.96, (t + 1) * decay))
    # torch multiplies its scalar tensor by a Python float: in the product's dtype (float32,
    # or float64 under a float64 default dtype), mu rounded to it first.
    mu_product = state["mu_product"]
    # torch starts the product at 1 at a member's first step (its state is lazy): a member at
    # step 0 (yet to step, or its row reset as docs/semantics.md says) starts there.
    start = torch.where(step.eq(0), 1.0, mu_product)
    new_product = start * mu.to(mu_product.dtype)
    product = new_product.double()
    grad_step = torch._foreach_mul(g, col(-lr * like(lr, 1.0 - mu) / like(lr, 1.0 - product)))
    step_size = (-lr * like(lr, mu_next)) / like(lr, 1.0 - product * mu_next)
    denom = [torch.empty_like(v) for v in exp_avg_sq]
    avg_step = [torch.empty_like(m) for m in exp_avg]
    writes += [
        functools.partial(mu_product.copy_, new_product),
        *moment_writes(exp_avg, exp_avg_sq, g, beta1, beta2),
        *into(torch.div, denom, exp_avg_sq, col(bias_correction2)),
        functools.partial(torch._foreach_sqrt_, denom),
        functools.partial(torch._foreach_add_, denom, alpha_columns(eps, denom)),
        functools.partial(torch._foreach_addcdiv_, params, grad_step, denom),
        *into(torch.mul, avg_step, exp_avg, col(step_size)),
        functools.partial(torch._foreach_addcdiv_, params, avg_step, denom),
    ]
    write_then_count(writes, step)


def _shared_kernel(t: list[list[Tensor]], count: float, group: dict[str, Any]) -> Writes:
    """:func:`nadam_rule` at step ``count + 1`` with float hyperparameters on ``t`` (params,
    grads, exp_avg, exp_avg_sq, [mu_product]), op for op as torch's single-tensor step: what
    allocates first, from the old state, then the writes (``optim/_fused.py``)."""
    lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
    decay = group["momentum_decay"]
    p, m, v, mu_product = t[0], t[2], t[3], t[4][0]
    g, writes = decayed_writes(signed(t[1], group), p, group)
    bias_correction2 = 1 - beta2 ** (count + 1)
    mu = beta1 * (1.0 - 0.5 * (0.96 ** ((count + 1) * decay)))
    mu_next = beta1 * (1.0 - 0.5 * (0.96 ** ((count + 2) * decay)))
    start = torch.ones_like(mu_product) if count == 0 else mu_product  # 1 at the first step
    product = start * mu  # torch's `mu_product *= mu`, aside
    denom = [torch.empty_like(x) for x in v]
    writes += [
        functools.partial(mu_product.copy_, product),
        *moment_writes(m, v, g, beta1, beta2),
        *into(torch.div, denom, v, bias_correction2),
        functools.partial(torch._foreach_sqrt_, denom),
        functools.partial(torch._foreach_add_, denom, eps),
    ]
    low, high = torch.aminmax(product)
    if low == high:  # the members share one product: torch's float step sizes
        shared = float(low)
        grad_size = -lr * (1.0 - mu) / (1.0 - shared)
        avg_size = (-lr * mu_next) / (1.0 - shared * mu_next)
        return [
            *writes,
            functools.partial(torch._foreach_addcdiv_, p, g, denom, value=grad_size),
            functools.partial(torch._foreach_addcdiv_, p, m, denom, value=avg_size),
        ]
    # Each member's own product (state loaded so): the same float64 arithmetic as a column,
    # bit for bit (a float over a tensor would be a reciprocal and a product: two roundings).
    col: Callable[[Scalar], Any] = functools.partial(member_columns, like=p)
    product64 = product.double()
    grad_size = torch.div(product64.new_tensor(-lr * (1.0 - mu)), 1.0 - product64)
    avg_size = torch.div(product64.new_tensor(-lr * mu_next), 1.0 - product64 * mu_next)
    grad_step = torch._foreach_mul(g, col(grad_size))
    avg_step = [torch.empty_like(x) for x in m]
    return [
        *writes,
        functools.partial(torch._foreach_addcdiv_, p, grad_step, denom),
        *into(torch.mul, avg_step, m, col(avg_size)),
        functools.partial(torch._foreach_addcdiv_, p, avg_step, denom),
    ]


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
    """:func:`nadam_rule` on one stacked tensor and its state, in place.

    Args:
        param: Stacked parameter [n, ...], updated in place.
        grad: Its gradient (not modified).
        exp_avg: First moment, updated in place.
        exp_avg_sq: Second moment, updated in place.
        mu_product: Float32 (or float64) [n] product of the momentum schedule, in place.
        step: Float32 (or float64) [n] per-member step counts, updated in place.
        lr: A float or a float64 [n] tensor, as are the other hyperparameters.
        beta1: First-moment decay.
        beta2: Second-moment decay.
        eps: Denominator term.
        weight_decay: L2 (or decoupled) weight decay.
        momentum_decay: Decay of the momentum schedule.
        decoupled_weight_decay: NAdamW-style decay.
        maximize: Ascend instead of descend.
        workspace: Accepted for compatibility and unused.

    Example:
        >>> p, g, z, s = torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3), torch.zeros(2)
        >>> nadam_update_(p, g, z, z.clone(), torch.ones(2), s, lr=torch.tensor([0.1, 0.2]),
        ...               beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
        ...               momentum_decay=4e-3)
        >>> p[:, 0]
        tensor([-0.1056, -0.2113])
    """

    hyper = dict(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
    hyper.update(momentum_decay=momentum_decay, decoupled_weight_decay=decoupled_weight_decay)
    counters = {"step": step, "mu_product": mu_product}
    moments = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    step_one(nadam_rule, param, grad, moments, counters, {**hyper, "maximize": maximize})


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
        **implementation: torch's implementation flags that ``torch.optim.NAdam`` takes
            (see :class:`~vmapens.optim.StackedOptimizer`).

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

    hyperparameters = {
        "lr": LR,
        "betas": BETAS,
        "eps": EPS,
        "weight_decay": WEIGHT_DECAY,
        "momentum_decay": nonnegative("momentum_decay value"),
    }
    torch_class = torch.optim.NAdam
    rule = staticmethod(nadam_rule)

    def __init__(
        self,
        params: Params,
        lr: PerMember = 2e-3,
        betas: tuple[PerMember, PerMember] = (0.9, 0.999),
        eps: PerMember = 1e-8,
        weight_decay: PerMember = 0.0,
        momentum_decay: PerMember = 4e-3,
        decoupled_weight_decay: bool = False,
        *,
        maximize: bool = False,
        **implementation: Any,
    ) -> None:
        super().__init__(params, locals())

    def state_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")

    def scalar_state(self, group: dict[str, Any]) -> dict[str, float]:
        return {"step": 0.0, "mu_product": 1.0}
