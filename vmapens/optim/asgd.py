"""ASGD (averaged SGD) for stacked ensembles: the update rule and its optimizer."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ._columns import (
    host_scalars,
    in_lr_dtype,
    is_tensor_lr,
    member_columns,
    signed,
    weight_decayed,
)
from ._fused import run_fused
from ._hyper import LR, NONNEGATIVE, Hyper, PerMember, Scalar
from .base import StackedOptimizer

__all__ = ["StackedASGD", "asgd_rule"]


#: torch checks neither ``lambd``, ``alpha`` nor ``t0``: any float is taken.
_ANY = Hyper("value", "a float", lambda v: True)


def asgd_rule(
    params: list[Tensor], grads: list[Tensor], state: dict[str, Any], group: dict[str, Any]
) -> None:
    """One ASGD step in place on stacked tensors, each member with its own hyperparameters.

    Follows ``torch.optim.ASGD``'s single-tensor update (Polyak & Juditsky, 1992,
    "Acceleration of Stochastic Approximation by Averaging"; the step-size schedule of Bottou,
    2012) per member with step ``t``:

    .. code-block:: text

        eta = lr (at the member's first step)
        g = -g if maximize;  g += wd * p
        p *= 1 - lambd * eta;  p -= eta * g
        ax = p if mu == 1 else ax + mu * (p - ax)
        eta = lr / (1 + lambd * lr * t)**alpha;  mu = 1 / max(1, t - t0)

    ``eta`` and ``mu`` are ``[n]`` in ``step``'s dtype, rounded as torch's scalar tensors
    (float32, or float64 under a float64 default dtype). With shared hyperparameters on CPU,
    each is read as a Python float, as torch reads its own, and the update runs over the whole
    stacked tensors, one call per step count (see ``run_fused``); per-member values take
    ``[n, 1, ...]`` columns.

    Args:
        params: Stacked parameters [n, ...] sharing one step count, updated in place.
        grads: Their gradients (not modified).
        state: ``ax`` (one per parameter), ``step``, ``eta`` and ``mu`` (float32 or float64
            [n], one dtype).
        group: ``lr``, ``lambd``, ``alpha``, ``t0``, ``weight_decay`` (floats or float64 [n]
            tensors; ``lr`` also a 0-d tensor, in whose dtype torch computes the new ``eta``)
            and ``maximize``.
    """
    lr, lambd, alpha, t0 = group["lr"], group["lambd"], group["alpha"], group["t0"]
    ax, step, eta, mu = state["ax"], state["step"], state["eta"], state["mu"]
    if host_scalars(params, [lambd, alpha, t0, group["weight_decay"]], lr=lr):
        mask = group["mask"]

        def kernel(t: list[list[Tensor]], count: float) -> None:
            # Each member's eta and mu as Python floats, as torch reads its 0-d scalar
            # tensors (eta made from lr at the first step); the members of one count share
            # them unless their states were loaded apart.
            etas, mus = t[3][0], t[4][0]
            if count == 0:
                etas.fill_(lr)
            eta_now = _shared(etas, step, mask, count)
            _apply(t[0], t[1], t[2], eta_now, _shared(mus, step, mask, count), group)
            # torch.as_tensor of a Python float, copied into eta: rounded to eta's dtype; with
            # a 0-d tensor lr, torch's expression is tensor arithmetic in lr's dtype, as here.
            etas.fill_(lr / ((1 + lambd * lr * (count + 1)) ** alpha))
            mus.fill_(1 / max(1, count + 1 - t0))

        run_fused(kernel, [params, grads, ax, [eta], [mu]], step, mask)
        return

    # torch creates eta from the group's lr at a member's first step (its state is lazy).
    eta.copy_(torch.where(step == 0, lr, eta))
    step.add_(1)
    _apply(params, grads, ax, eta.double(), mu.double(), group)
    t = step.double()
    if is_tensor_lr(lr):
        # torch's expression with a tensor lr is tensor arithmetic in lr's dtype, its floats
        # cast to it, but for pow's exponent: one element's pow runs in double, then rounds.
        base = 1 + in_lr_dtype(lr, lambd) * lr * t.to(lr.dtype)
        eta.copy_(lr / torch.pow(base.double(), alpha).to(lr.dtype))
    else:
        eta.copy_(lr / torch.pow(1 + lambd * lr * t, alpha))
    mu.copy_(1 / torch.clamp(t - t0, min=1))


def _shared(values: Tensor, step: Tensor, mask: Tensor | None, count: float) -> Scalar:
    """The members' value of ``values`` (``[n]``) at step ``count``: a float when the
    stepping members of that count share it, else float64 ``[n]`` (each member its own)."""
    low, high = torch.aminmax(values)
    if low == high:
        return float(low)
    rows = step == count
    if mask is not None:
        rows &= mask
    low, high = torch.aminmax(values[rows])
    return float(low) if low == high else values.double()


def _apply(
    params: list[Tensor],
    grads: list[Tensor],
    ax: list[Tensor],
    eta: Scalar,
    mu: Scalar,
    group: dict[str, Any],
) -> None:
    """torch's single-tensor ASGD update of ``params`` and ``ax`` with ``eta`` and ``mu``:
    Python floats as torch reads them (the same roundings), or float64 ``[n]`` per member."""
    lambd = group["lambd"]
    col: Callable[[Scalar], Any] = functools.partial(member_columns, like=params)
    g = signed(grads, group)
    g = weight_decayed(g, params, group)
    torch._foreach_mul_(params, col(1 - lambd * eta))
    if isinstance(eta, Tensor):
        torch._foreach_addcmul_(params, g, col(-eta))
    else:
        torch._foreach_add_(params, g, alpha=-eta)
    if not isinstance(mu, Tensor):
        if mu == 1:
            torch._foreach_copy_(ax, params)
        else:
            diff = torch._foreach_sub(params, ax)
            torch._foreach_mul_(diff, mu)
            torch._foreach_add_(ax, diff)
        return
    averaged = torch._foreach_sub(params, ax)
    torch._foreach_mul_(averaged, col(mu))
    torch._foreach_add_(averaged, ax)
    for a, p, new, copy in zip(ax, params, averaged, col((mu == 1).double()), strict=True):
        a.copy_(torch.where(copy.bool(), p, new))


class StackedASGD(StackedOptimizer):
    """Averaged SGD over stacked parameters, with per-member hyperparameters.

    Member ``i`` is updated exactly as ``torch.optim.ASGD`` would update it alone with member
    ``i``'s hyperparameters, its own ``eta`` and ``mu`` included; ``member_state_dict(i)``
    hands it off to it. The average ``ax`` is in ``opt.state[p]["ax"]``.

    Args:
        params: Stacked tensors [n, ...], param-group dicts, or an Ensemble.
        lr: Learning rate: a float, a 0-d tensor (kept, and computed with as torch does), or
            one per member.
        lambd: Decay term, a float or one per member.
        alpha: Power of the ``eta`` schedule, a float or one per member.
        t0: Step at which averaging starts, a float or one per member.
        weight_decay: L2 penalty, a float or one per member.
        maximize: Maximise the objective.
        **implementation: torch's implementation flags that ``torch.optim.ASGD`` takes
            (see :class:`~vmapens.optim.StackedOptimizer`).

    Raises:
        ValueError: Empty params, mismatched leading sizes, out-of-range or wrong-length
            hyperparameters.

    Example:
        >>> w = torch.zeros(2, 3, requires_grad=True)
        >>> opt = StackedASGD([w], lr=[0.01, 0.1], t0=[0.0, 1e6])
        >>> w.grad = torch.ones(2, 3)
        >>> opt.step()
        >>> w[:, 0], opt.state[w]["ax"][:, 0]
        (tensor([-0.0100, -0.1000], grad_fn=<SelectBackward0>), tensor([-0.0100, -0.1000]))
    """

    hyperparameters: ClassVar[dict[str, Hyper]] = {
        "lr": LR,
        "lambd": _ANY,
        "alpha": _ANY,
        "t0": _ANY,
        "weight_decay": Hyper("weight_decay value", ">= 0", NONNEGATIVE.ok),
    }
    torch_class = torch.optim.ASGD
    rule = staticmethod(asgd_rule)

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]] | nn.Module,
        lr: PerMember = 1e-2,
        lambd: PerMember = 1e-4,
        alpha: PerMember = 0.75,
        t0: PerMember = 1e6,
        weight_decay: PerMember = 0.0,
        *,
        maximize: bool = False,
        **implementation: Any,
    ) -> None:
        super().__init__(params, locals())

    def state_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("ax",)

    def scalar_state(self, group: dict[str, Any]) -> dict[str, float]:
        # eta's start is a placeholder: the rule sets it from lr at a member's first step.
        return {"step": 0.0, "eta": 0.0, "mu": 1.0}
