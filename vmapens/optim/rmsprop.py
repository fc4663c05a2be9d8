"""RMSprop for stacked ensembles: the update rule and its optimizer."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .._checks import column
from ._columns import (
    added,
    alpha_columns,
    cpu_scalar,
    lerped,
    member_columns,
    signed,
    weight_decayed,
)
from ._fused import Writes, into, one_kernel_when, safe_in_place, write_then_count
from ._hyper import (
    EPS,
    LR,
    MOMENTUM,
    WEIGHT_DECAY,
    Params,
    PerMember,
    Scalar,
    any_positive,
    member_floats,
    nonnegative,
)
from ._keep import step_one
from ._values import MemberValues
from .base import StackedOptimizer

__all__ = ["StackedRMSprop", "rmsprop_rule", "rmsprop_update_"]


def _lists(params: list[Tensor], grads: list[Tensor], state: dict[str, Any]) -> list[list[Tensor]]:
    names = ("square_avg", "momentum_buffer", "grad_avg")
    return [params, grads, *(state[k] for k in names if k in state)]


def _one_go(
    params: list[Tensor], grads: list[Tensor], state: dict[str, Any], group: dict[str, Any]
) -> bool:
    """Whether :func:`rmsprop_rule` writes everything in one go, its write phase (see ``safe_in_place``)."""
    values = [group[k] for k in ("lr", "alpha", "eps", "weight_decay", "momentum")]
    return safe_in_place(group, _lists(params, grads, state), values, columns=True)


@one_kernel_when(_one_go)
def rmsprop_rule(
    params: list[Tensor], grads: list[Tensor], state: dict[str, Any], group: dict[str, Any]
) -> None:
    """One RMSprop step in place on stacked tensors, each member with its own hyperparameters.

    Follows ``torch.optim.RMSprop``'s single-tensor update (Hinton's lecture 6e; the centered
    form from Graves, 2013) per member:

    .. code-block:: text

        g = -g if maximize;  g += wd * p
        v = alpha * v + (1 - alpha) * g * g
        a = sqrt(v - lerp(g_avg, g, 1 - alpha)**2) if centered else sqrt(v);  a += eps
        b = momentum * b + g / a;  p -= lr * b        (p -= lr * g / a without momentum)

    Centered when ``grad_avg`` is given. A member whose momentum is 0 gets ``b = g / a``, the
    plain step, so per-member momenta need no branch. Everything that allocates comes first and
    the writes last, in place (``optim/_fused.py``).

    Args:
        params: Stacked parameters [n, ...] sharing one step count, updated in place.
        grads: Their gradients (not modified).
        state: ``square_avg``, ``momentum_buffer`` (when a member uses momentum), ``grad_avg``
            (centered) one per parameter, and ``step`` ([n] counts).
        group: ``lr``, ``alpha``, ``eps``, ``weight_decay``, ``momentum`` (floats or float64
            [n] tensors) and ``maximize``.
    """
    # The count is not in the arithmetic: what allocates first, then the writes
    # (optim/_fused.py), then the count, for every member.
    write_then_count(_write_phase(params, grads, state, group), state["step"])


def _write_phase(
    params: list[Tensor], grads: list[Tensor], state: dict[str, Any], group: dict[str, Any]
) -> Writes:
    """:func:`rmsprop_rule`'s step as its write phase: what allocates first (the gradients
    with weight decay, per-member products, the buffers ``sqrt(v)`` goes to), then the writes."""
    lr, alpha, eps = group["lr"], group["alpha"], group["eps"]
    square_avg, grad_avg, bufs = (
        state["square_avg"],
        state.get("grad_avg"),
        state.get("momentum_buffer"),
    )
    col: Callable[[Scalar], Any] = functools.partial(member_columns, like=params)
    g = weight_decayed(signed(grads, group), params, group)
    avg = [torch.empty_like(v) for v in square_avg]
    g2: Any = torch._foreach_mul(g, col(1 - alpha)) if isinstance(alpha, Tensor) else g
    value = 1.0 if isinstance(alpha, Tensor) else 1 - alpha
    writes: list[Callable[[], Any]] = [
        functools.partial(torch._foreach_mul_, square_avg, cpu_scalar(col(alpha), params[0])),
        functools.partial(torch._foreach_addcmul_, square_avg, g, g2, value=value),
    ]
    if grad_avg is not None:  # avg = v - grad_avg**2, its square root taken in place
        writes.append(lerped(grad_avg, g, col(1 - alpha)))
        writes += into(torch.addcmul, avg, square_avg, grad_avg, grad_avg, value=-1)
        writes.append(functools.partial(torch._foreach_sqrt_, avg))
    else:
        writes += into(torch.sqrt, avg, square_avg)
    writes.append(
        functools.partial(torch._foreach_add_, avg, cpu_scalar(alpha_columns(eps, avg), params[0]))
    )
    if bufs is not None:
        momentum = group["momentum"]
        writes += [
            functools.partial(torch._foreach_mul_, bufs, cpu_scalar(col(momentum), params[0])),
            functools.partial(torch._foreach_addcdiv_, bufs, g, avg),
            added(params, bufs, -lr),
        ]
        idle = momentum == 0 if isinstance(momentum, Tensor) else None
        if idle is not None and (torch.compiler.is_compiling() or bool(idle.any())):
            # A member without momentum steps on g / a (its buffer's value here) and keeps its
            # buffer, as torch's RMSprop, which then neither reads nor writes it: a momentum
            # turned on again goes on from it.
            held = [b.clone() for b in bufs]
            writes += into(torch.where, bufs, [column(idle, b) for b in bufs], held, bufs)
        return writes
    if isinstance(lr, Tensor):
        scaled = [torch.empty_like(x) for x in g]
        writes += into(torch.mul, scaled, g, col(-lr))
        return [*writes, functools.partial(torch._foreach_addcdiv_, params, scaled, avg)]
    return [*writes, functools.partial(torch._foreach_addcdiv_, params, g, avg, value=-lr)]


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
    """:func:`rmsprop_rule` on one stacked tensor and its state, in place.

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
        workspace: Accepted for compatibility and unused.

    Example:
        >>> p, g, v, s = torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3), torch.zeros(2)
        >>> rmsprop_update_(p, g, v, None, None, s, lr=torch.tensor([0.01, 0.1]), alpha=0.99,
        ...                 eps=1e-8, weight_decay=0.0, momentum=0.0)
        >>> p[:, 0]
        tensor([-0.1000, -1.0000])
    """

    hyper = dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum)
    tensors = {"square_avg": square_avg, "grad_avg": grad_avg, "momentum_buffer": momentum_buffer}
    step_one(rmsprop_rule, param, grad, tensors, {"step": step}, {**hyper, "maximize": maximize})


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
        **implementation: torch's implementation flags that ``torch.optim.RMSprop`` takes
            (see :class:`~vmapens.optim.StackedOptimizer`).

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

    hyperparameters = {
        "lr": LR,
        "alpha": nonnegative("alpha value"),
        "eps": EPS,
        "weight_decay": WEIGHT_DECAY,
        "momentum": MOMENTUM,
    }
    torch_class = torch.optim.RMSprop
    rule = staticmethod(rmsprop_rule)

    def __init__(
        self,
        params: Params,
        lr: PerMember = 1e-2,
        alpha: PerMember = 0.99,
        eps: PerMember = 1e-8,
        weight_decay: PerMember = 0.0,
        momentum: PerMember = 0.0,
        centered: bool = False,
        *,
        maximize: bool = False,
        **implementation: Any,
    ) -> None:
        super().__init__(params, locals())

    def state_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        names: tuple[str, ...] = ("square_avg",)
        momentum = group["momentum"]
        # any_positive: a compiled step guards on its answer, not on the momenta (sgd.py). A
        # value of another type (a list set by hand) is left to the step's check, which names
        # `momentum`, where comparing it with 0 would raise a TypeError that names nothing.
        known = isinstance(momentum, (int, float, Tensor, MemberValues))
        names += ("momentum_buffer",) if not known or any_positive(momentum) else ()
        return (*names, "grad_avg") if group["centered"] else names

    def member_state(
        self, state: dict[str, Tensor], group: dict[str, Any], i: int
    ) -> dict[str, Tensor]:
        # torch's RMSprop keeps a momentum buffer where momentum was > 0 at the first step, and
        # keeps it while momentum is 0 later: a member at 0 with a buffer at zero never had any.
        out = super().member_state(state, group, i)
        momentum = member_floats(group["momentum"])
        buffer = out.get("momentum_buffer")
        if momentum[i % len(momentum)] == 0 and buffer is not None and not buffer.any():
            out.pop("momentum_buffer")
        return out
