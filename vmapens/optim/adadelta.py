"""Adadelta for stacked ensembles: the update rule and its optimizer."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ._columns import added, alpha_columns, member_columns, signed, weight_decayed
from ._fused import Writes, into, one_kernel_when, safe_in_place, write_then_count
from ._hyper import LR, NONNEGATIVE, Hyper, PerMember, Scalar
from .base import StackedOptimizer

__all__ = ["StackedAdadelta", "adadelta_rule"]


def _one_go(
    params: list[Tensor], grads: list[Tensor], state: dict[str, Any], group: dict[str, Any]
) -> bool:
    """Whether :func:`adadelta_rule` writes everything in one go, its write phase (see ``safe_in_place``)."""
    lists = [params, grads, state["square_avg"], state["acc_delta"]]
    values = [group[k] for k in ("lr", "rho", "eps", "weight_decay")]
    return safe_in_place(group, lists, values, columns=True)


@one_kernel_when(_one_go)
def adadelta_rule(
    params: list[Tensor], grads: list[Tensor], state: dict[str, Any], group: dict[str, Any]
) -> None:
    """One Adadelta step in place on stacked tensors, each member with its own hyperparameters.

    Follows ``torch.optim.Adadelta``'s single-tensor update (Zeiler, 2012, "ADADELTA: An
    Adaptive Learning Rate Method", Algorithm 1, times ``lr``) per member:

    .. code-block:: text

        g = -g if maximize;  g += wd * p
        v = rho * v + (1 - rho) * g * g
        d = sqrt(u + eps) / sqrt(v + eps) * g
        u = rho * u + (1 - rho) * d * d
        p -= lr * d

    Args:
        params: Stacked parameters [n, ...] sharing one step count, updated in place.
        grads: Their gradients (not modified).
        state: ``square_avg`` (``v``), ``acc_delta`` (``u``), one per parameter, and ``step``
            ([n] counts, counted; Adadelta does not read it).
        group: ``lr``, ``rho``, ``eps``, ``weight_decay`` (floats or float64 [n] tensors;
            ``lr`` also a 0-d tensor) and ``maximize``.
    """
    # The count is not in the arithmetic: what allocates first, then the writes
    # (optim/_fused.py), then the count, for every member.
    write_then_count(_write_phase(params, grads, state, group), state["step"])


def _write_phase(
    params: list[Tensor], grads: list[Tensor], state: dict[str, Any], group: dict[str, Any]
) -> Writes:
    """:func:`adadelta_rule`'s step as its write phase: what allocates first (the gradients
    with weight decay, ``sqrt(u + eps)`` from the old ``u``, per-member products, the buffers
    ``sqrt(v + eps)`` goes to), then the writes."""
    lr, rho, eps = group["lr"], group["rho"], group["eps"]
    square_avg, acc_delta = state["square_avg"], state["acc_delta"]
    col: Callable[[Scalar], Any] = functools.partial(member_columns, like=params)
    # g + wd * p rounded once, as torch's grad.add(param, alpha=wd) (a product then a sum
    # rounded twice, 1e-7 relative off in float32)
    g = weight_decayed(signed(grads, group), params, group)
    std = [torch.empty_like(v) for v in square_avg]
    delta = torch._foreach_add(acc_delta, alpha_columns(eps, acc_delta))
    torch._foreach_sqrt_(delta)
    per_member = isinstance(rho, Tensor)  # (1 - rho) * x * x as x * ((1 - rho) * x)
    g2 = torch._foreach_mul(g, col(1 - rho)) if per_member else g
    writes: list[Callable[[], Any]] = [
        functools.partial(torch._foreach_mul_, square_avg, col(rho)),
        functools.partial(
            torch._foreach_addcmul_, square_avg, g, g2, value=1.0 if per_member else 1 - rho
        ),
        *into(torch.add, std, square_avg, alpha_columns(eps, square_avg)),
        functools.partial(torch._foreach_sqrt_, std),
        functools.partial(torch._foreach_div_, delta, std),
        functools.partial(torch._foreach_mul_, delta, g),
        functools.partial(torch._foreach_mul_, acc_delta, col(rho)),
    ]
    if per_member:
        delta2 = [torch.empty_like(d) for d in delta]
        writes += into(torch.mul, delta2, delta, col(1 - rho))
        writes.append(functools.partial(torch._foreach_addcmul_, acc_delta, delta, delta2))
    else:
        writes.append(
            functools.partial(torch._foreach_addcmul_, acc_delta, delta, delta, value=1 - rho)
        )
    return [*writes, added(params, delta, -lr)]


class StackedAdadelta(StackedOptimizer):
    """Adadelta over stacked parameters, with per-member hyperparameters.

    Member ``i`` is updated exactly as ``torch.optim.Adadelta`` would update it alone with
    member ``i``'s hyperparameters; ``member_state_dict(i)`` hands it off to it.

    Args:
        params: Stacked tensors [n, ...], param-group dicts, or an Ensemble.
        lr: Coefficient of the delta: a float, a 0-d tensor (kept, and computed with as torch
            does), or one per member.
        rho: Decay of the running averages, a float or one per member.
        eps: Term inside both square roots, a float or one per member.
        weight_decay: L2 penalty, a float or one per member.
        maximize: Maximise the objective.
        **implementation: torch's implementation flags that ``torch.optim.Adadelta`` takes
            (see :class:`~vmapens.optim.StackedOptimizer`).

    Raises:
        ValueError: Empty params, mismatched leading sizes, out-of-range or wrong-length
            hyperparameters.

    Example:
        >>> w = torch.zeros(2, 3, requires_grad=True)
        >>> opt = StackedAdadelta([w], lr=[1.0, 10.0], rho=0.9, eps=1e-6)
        >>> w.grad = torch.ones(2, 3)
        >>> opt.step()  # sqrt(eps) / sqrt(0.1 + eps) * lr
        >>> w[:, 0]
        tensor([-0.0032, -0.0316], grad_fn=<SelectBackward0>)
    """

    hyperparameters: ClassVar[dict[str, Hyper]] = {
        "lr": LR,
        "rho": Hyper("rho value", "in [0, 1]", lambda v: 0 <= v <= 1),
        "eps": Hyper("epsilon value", ">= 0", NONNEGATIVE.ok),
        "weight_decay": Hyper("weight_decay value", ">= 0", NONNEGATIVE.ok),
    }
    torch_class = torch.optim.Adadelta
    rule = staticmethod(adadelta_rule)

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]] | nn.Module,
        lr: PerMember = 1.0,
        rho: PerMember = 0.9,
        eps: PerMember = 1e-6,
        weight_decay: PerMember = 0.0,
        *,
        maximize: bool = False,
        **implementation: Any,
    ) -> None:
        super().__init__(params, locals())

    def state_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("square_avg", "acc_delta")
