"""Adam and AdamW for stacked ensembles: the update rule and its optimizer.

The maths lives once, in :func:`adam_rule`; :class:`StackedAdam` is the rule plus its table of
hyperparameters on :class:`~vmapens.optim.base.StackedOptimizer`.
"""

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
    is_tensor_lr,
    like,
    member_columns,
    moment_writes,
    signed,
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
from ._hyper import BETAS, EPS, LR, WEIGHT_DECAY, Params, PerMember, Scalar
from ._keep import step_one
from .base import StackedOptimizer

__all__ = ["StackedAdam", "adam_rule", "adam_update", "adam_update_"]


def _lists(
    params: list[Tensor], grads: list[Tensor], state: dict[str, Any], group: dict[str, Any]
) -> list[list[Tensor]]:
    moments = [state["exp_avg"], state["exp_avg_sq"]]
    return [params, grads, *moments, *([state["max_exp_avg_sq"]] if group["amsgrad"] else [])]


def _fused(
    params: list[Tensor], grads: list[Tensor], state: dict[str, Any], group: dict[str, Any]
) -> bool:
    """Whether :func:`adam_rule` takes torch's fused kernel (shared hyperparameters, on CPU)."""
    values = [group["lr"], group["eps"], group["weight_decay"], *group["betas"]]
    return fusable(group, _lists(params, grads, state, group), values)


def _one_go(
    params: list[Tensor], grads: list[Tensor], state: dict[str, Any], group: dict[str, Any]
) -> bool:
    """Whether :func:`adam_rule` writes everything in one go: the fused kernel, with
    ``fused=False`` the write phase of :func:`_shared_kernel`, with per-member values its own
    (see ``safe_in_place``)."""
    values = [group["lr"], group["eps"], group["weight_decay"], *group["betas"]]
    return safe_in_place(group, _lists(params, grads, state, group), values, columns=True)


@one_kernel_when(_one_go)
def adam_rule(
    params: list[Tensor], grads: list[Tensor], state: dict[str, Any], group: dict[str, Any]
) -> None:
    r"""One Adam step in place on stacked tensors, each member with its own hyperparameters.

    Follows ``torch.optim.Adam``'s update (Kingma & Ba, 2015, Algorithm 1; AdamW's decoupled
    decay from Loshchilov & Hutter, 2019) per member ``i`` with step ``t``:

    .. code-block:: text

        g   = -g if maximize;  g += wd * p   (or p *= 1 - lr * wd if decoupled)
        m   = lerp(m, g, 1 - beta1)
        v   = v * beta2 + (1 - beta2) * g * g;  v_max = max(v_max, v) if amsgrad
        p  += -(lr / (1 - beta1**t)) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

    A fixed number of ``torch._foreach_*`` ops over the parameters (one list each). Per-member
    scalars are computed in float64 (torch computes them in Python floats) and broadcast as
    ``[n, 1, ...]`` columns; with a 0-d tensor ``lr`` they are in its dtype and the ops in
    torch's single-tensor order, as torch computes them (bit for bit in float32). No ``.item()`` and no branching on tensor values, so it traces
    under ``torch.compile(fullgraph=True)``. When every member shares the hyperparameters, on
    CPU, torch's fused kernel does the same in one pass (see ``run_fused``); with
    ``fused=False`` (or tensors that kernel cannot take), torch's single-tensor ops with Python
    float step sizes, bit for bit each member alone.

    Args:
        params: Stacked parameters [n, ...] sharing one step count, updated in place.
        grads: Their gradients (not modified).
        state: ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq`` with ``amsgrad``): one
            tensor per parameter, updated in place; ``step``: [n] counts, counted here.
        group: ``lr``, ``betas``, ``eps``, ``weight_decay`` (floats or float64 [n] tensors),
            the flags ``decoupled_weight_decay``, ``amsgrad``, ``maximize``, ``fused`` and
            ``mask`` (see :attr:`StackedOptimizer.rule`).
    """
    lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    exp_avg, exp_avg_sq, step = state["exp_avg"], state["exp_avg_sq"], state["step"]
    v_max = state["max_exp_avg_sq"] if group["amsgrad"] else None
    if _fused(params, grads, state, group):
        fused = torch._fused_adamw_ if group["decoupled_weight_decay"] else torch._fused_adam_

        def kernel(t: list[list[Tensor]], count: float) -> Callable[[], Any]:
            return functools.partial(
                fused,
                t[0],
                t[1],
                t[2],
                t[3],
                t[4] if len(t) > 4 else [],
                [torch.tensor(count + 1.0)] * len(t[0]),
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                weight_decay=wd,
                eps=eps,
                amsgrad=group["amsgrad"],
                maximize=group["maximize"],
            )

        run_fused(kernel, _lists(params, grads, state, group), step, group["mask"])
        return
    if host_scalars(params, [lr, beta1, beta2, eps, wd]):  # fused=False: torch's bits
        shared = functools.partial(_shared_kernel, group=group)
        run_fused(shared, _lists(params, grads, state, group), step, group["mask"])
        return

    # Per-member values: what allocates first, then the writes (optim/_fused.py).
    col: Callable[[Scalar], Any] = functools.partial(member_columns, like=params)
    g, writes = decayed_writes(signed(grads, group), params, group)
    t = step.double() + 1  # the counts after this step
    step_size = lr / like(lr, 1 - torch.pow(beta1, t))
    bias_correction2_sqrt = (1 - torch.pow(beta2, t)).sqrt()
    writes += moment_writes(exp_avg, exp_avg_sq, g, beta1, beta2)
    if v_max is not None:
        writes.append(functools.partial(torch._foreach_maximum_, v_max, exp_avg_sq))
    denom = [torch.empty_like(v) for v in exp_avg_sq]
    writes += into(torch.sqrt, denom, exp_avg_sq if v_max is None else v_max)
    writes.append(functools.partial(torch._foreach_div_, denom, col(bias_correction2_sqrt)))
    writes.append(functools.partial(torch._foreach_add_, denom, alpha_columns(eps, denom)))
    if is_tensor_lr(lr):
        # torch's `p.addcdiv_(m, denom, value=-step_size)`: (-step_size * m) / denom.
        scaled = [torch.empty_like(m) for m in exp_avg]
        writes += into(torch.mul, scaled, exp_avg, col(-step_size))
        writes.append(functools.partial(torch._foreach_addcdiv_, params, scaled, denom))
    else:
        # torch's capturable Adam folds the step size into the denominator the same way.
        writes.append(functools.partial(torch._foreach_div_, denom, col(-step_size)))
        writes.append(functools.partial(torch._foreach_addcdiv_, params, exp_avg, denom))
    write_then_count(writes, step)


def _shared_kernel(t: list[list[Tensor]], count: float, group: dict[str, Any]) -> Writes:
    """``torch.optim.Adam``'s single-tensor step at step ``count + 1``, op for op, on whole
    stacked tensors ``t`` (params, grads, exp_avg, exp_avg_sq[, max_exp_avg_sq]) with shared
    float hyperparameters: each member's bits as alone (Python float step sizes). What
    allocates comes first, then the writes (``optim/_fused.py``)."""
    lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
    p, m, v = t[0], t[2], t[3]
    g, writes = decayed_writes(signed(t[1], group), p, group)
    step = count + 1
    step_size = lr / (1 - beta1**step)
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    denom = [torch.empty_like(x) for x in v]
    writes += moment_writes(m, v, g, beta1, beta2)
    if group["amsgrad"]:
        v = t[4]
        writes.append(functools.partial(torch._foreach_maximum_, v, t[3]))
    return [
        *writes,
        *into(torch.sqrt, denom, v),
        functools.partial(torch._foreach_div_, denom, bias_correction2_sqrt),
        functools.partial(torch._foreach_add_, denom, eps),
        functools.partial(torch._foreach_addcdiv_, p, m, denom, value=-step_size),
    ]


def adam_update_(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    max_exp_avg_sq: Tensor | None,
    step: Tensor,
    *,
    lr: Scalar,
    beta1: Scalar,
    beta2: Scalar,
    eps: Scalar,
    weight_decay: Scalar,
    decoupled_weight_decay: bool = False,
    amsgrad: bool = False,
    maximize: bool = False,
    mask: Tensor | None = None,
    workspace: Tensor | None = None,
) -> None:
    """:func:`adam_rule` on one stacked tensor and its state, in place.

    Args:
        param: Stacked parameter [n, ...], updated in place.
        grad: Its gradient (not modified).
        exp_avg: First moment, shaped like ``param``, updated in place.
        exp_avg_sq: Second moment, shaped like ``param``, updated in place.
        max_exp_avg_sq: Running maximum of the second moment (``amsgrad``), else None.
        step: Float32 [n] per-member step counts, updated in place.
        lr: Learning rate, a float or a float64 [n] tensor.
        beta1: First-moment decay, a float or a float64 [n] tensor.
        beta2: Second-moment decay, a float or a float64 [n] tensor.
        eps: Denominator term, a float or a float64 [n] tensor.
        weight_decay: L2 (or decoupled) weight decay, a float or a float64 [n] tensor.
        decoupled_weight_decay: Use AdamW's decoupled weight decay.
        amsgrad: Normalise by the running maximum of the second moment.
        maximize: Ascend instead of descend.
        mask: Optional bool [n]; members where it is False come out bit-identical.
        workspace: Accepted for compatibility and unused (the rule's temporaries are its own).

    Raises:
        TypeError: ``amsgrad`` without a ``max_exp_avg_sq`` tensor.

    Example:
        >>> p, g = torch.zeros(3, 2), torch.ones(3, 2)
        >>> m, v, s = torch.zeros(3, 2), torch.zeros(3, 2), torch.zeros(3)
        >>> adam_update_(p, g, m, v, None, s, lr=torch.tensor([0.1, 0.2, 0.3]),
        ...              beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
        >>> p[:, 0], s
        (tensor([-0.1000, -0.2000, -0.3000]), tensor([1., 1., 1.]))
    """
    if amsgrad and max_exp_avg_sq is None:
        raise TypeError(
            "adam_update_: `max_exp_avg_sq` must be a tensor when `amsgrad=True`, got None"
        )
    hyper = dict(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
    flags = dict(decoupled_weight_decay=decoupled_weight_decay, amsgrad=amsgrad, maximize=maximize)
    moments = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "max_exp_avg_sq": max_exp_avg_sq}
    if not amsgrad:
        moments["max_exp_avg_sq"] = None
    step_one(adam_rule, param, grad, moments, {"step": step}, {**hyper, **flags}, mask)


def adam_update(
    param: Tensor, grad: Tensor, *state: Tensor | None, **hyperparameters: Any
) -> tuple[Tensor | None, ...]:
    """The pure form of :func:`adam_update_`: returns new tensors, mutates nothing.

    Takes the same arguments and returns ``(param, exp_avg, exp_avg_sq, max_exp_avg_sq,
    step)``, for functional training steps (``torch.func``, ``torch.compile``).

    Example:
        >>> p, g, z, s = torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3), torch.zeros(2)
        >>> new_p, *_ = adam_update(p, g, z, z, None, s, lr=0.1, beta1=0.9, beta2=0.999,
        ...                         eps=1e-8, weight_decay=0.0)
        >>> new_p[0], p[0]
        (tensor([-0.1000, -0.1000, -0.1000]), tensor([0., 0., 0.]))
    """
    new = [None if t is None else t.clone() for t in (param, *state)]
    adam_update_(new[0], grad, *new[1:], **hyperparameters)  # type: ignore[arg-type]
    return tuple(new)


class StackedAdam(StackedOptimizer):
    """Adam/AdamW over stacked ensemble parameters, with per-member hyperparameters.

    Member ``i`` is updated exactly as ``torch.optim.Adam`` (``AdamW`` when
    ``decoupled_weight_decay``) would update it alone with member ``i``'s hyperparameters.
    A hyperparameter given per member is stored in ``param_groups`` as
    :class:`~vmapens.optim.MemberValues` (a float when shared), which torch's LR schedulers
    update member by member.

    Args:
        params: Stacked tensors [n, ...], param-group dicts, or an ``nn.Module`` (an Ensemble).
        lr: Learning rate: a float, a 0-d tensor (computed with in its dtype, as torch does),
            or a sequence / 1-D tensor with one per member.
        betas: ``(beta1, beta2)``, each a float or one per member.
        eps: Denominator term, a float or one per member.
        weight_decay: Weight decay, a float or one per member.
        decoupled_weight_decay: AdamW-style decay.
        amsgrad: Use the AMSGrad variant.
        maximize: Maximise the objective.
        **implementation: torch's ``foreach``, ``fused``, ``capturable``, ``differentiable``
            (see :class:`~vmapens.optim.StackedOptimizer`).

    Raises:
        ValueError: Empty params, mismatched leading sizes, out-of-range or wrong-length
            hyperparameters, or an implementation flag that would change the results.
        TypeError: A hyperparameter of an unsupported type, or an unknown keyword.

    Example:
        >>> w = torch.zeros(4, 3, requires_grad=True)
        >>> opt = StackedAdam([w], lr=torch.logspace(-3, 0, 4))
        >>> w.grad = torch.ones(4, 3)
        >>> opt.step(mask=torch.tensor([True, True, False, True]))
        >>> [round(v, 6) for v in w[:, 0].tolist()]
        [-0.001, -0.01, 0.0, -1.0]
    """

    hyperparameters = {"lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": WEIGHT_DECAY}
    torch_class = torch.optim.Adam
    rule = staticmethod(adam_rule)

    def __init__(
        self,
        params: Params,
        lr: PerMember = 1e-3,
        betas: tuple[PerMember, PerMember] = (0.9, 0.999),
        eps: PerMember = 1e-8,
        weight_decay: PerMember = 0.0,
        amsgrad: bool = False,  # positional as in torch.optim.Adam
        *,
        decoupled_weight_decay: bool = False,
        maximize: bool = False,
        **implementation: Any,
    ) -> None:
        super().__init__(params, locals())

    def state_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        moments = ("exp_avg", "exp_avg_sq")
        return (*moments, "max_exp_avg_sq") if group["amsgrad"] else moments
