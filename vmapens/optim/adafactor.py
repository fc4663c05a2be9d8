"""Adafactor for stacked ensembles: the update rule and its optimizer."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, ClassVar, cast

import torch
from torch import Tensor, nn

from ._columns import (
    column_dtype,
    decay_factor,
    is_tensor_lr,
    lerp_column_,
    member_column,
    member_columns,
)
from ._hyper import LR, NONNEGATIVE, Hyper, PerMember, Scalar
from .base import StackedOptimizer

__all__ = ["StackedAdafactor", "adafactor_rule"]


def _per_member_norm(x: Tensor) -> Tensor:
    """The 2-norm of each member's slice ``x[i]``, as ``[n]``."""
    return torch.linalg.vector_norm(x.reshape(x.shape[0], -1), dim=1)


def adafactor_rule(
    params: list[Tensor], grads: list[Tensor], state: dict[str, Any], group: dict[str, Any]
) -> None:
    """One Adafactor step in place on stacked tensors, each member with its own hyperparameters.

    Follows ``torch.optim.Adafactor``'s single-tensor update (Shazeer & Stern, 2018,
    "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost", Algorithms 4 and 5, as
    torch writes it) per member with step ``t``; a member's ``p`` is its slice ``p[i]``, so a
    member parameter of 2 or more dims is factored over its last two dims, as torch factors
    the member's own shape:

    .. code-block:: text

        g = -g if maximize;  w = t**beta2_decay;  rho = min(lr, 1 / sqrt(t))
        alpha = max(eps2, ||p|| / sqrt(numel)) * rho;  p *= 1 - lr * wd
        factored:  R = lerp(R, mean(g * g, -1), w);  C = lerp(C, mean(g * g, -2), w)
                   v = R @ C / max(mean(R, -2), eps1)
        vector:    v = V = lerp(V, g * g, w)
        u = g / sqrt(max(v, eps1 * eps1));  p -= alpha / max(1, ||u|| / (sqrt(numel) * d)) * u

    Norms and ``numel`` are per member. ``eps1`` None is the parameters' dtype's eps.

    Args:
        params: Stacked parameters [n, ...] sharing one step count, updated in place.
        grads: Their gradients (not modified).
        state: ``row_var``, ``col_var`` (factored parameters) or ``variance`` (the others)
            per parameter (the unused ones zero-size ``[n, 0]``), and ``step`` ([n] counts).
        group: ``lr``, ``beta2_decay``, ``eps`` (a pair; its first may be None), ``d``,
            ``weight_decay`` (floats or float64 [n] tensors; ``lr`` also a 0-d tensor) and
            ``maximize``.
    """
    lr, decay, (eps1, eps2), d, wd = (
        group["lr"],
        group["beta2_decay"],
        group["eps"],
        group["d"],
        group["weight_decay"],
    )
    step = state["step"]
    step.add_(1)
    t = step.double()
    weight = torch.pow(t, decay)
    inv = 1 / t**0.5
    rho = torch.minimum(torch.as_tensor(lr, dtype=torch.float64, device=t.device), inv)
    # torch's min(lr, 1 / sqrt(t)) keeps a 0-d tensor lr where it is the smaller (compared in
    # lr's dtype); alpha, its product with a float, and -alpha / denom are then in lr's dtype.
    lr0 = lr if is_tensor_lr(lr) else None
    picks = None if lr0 is None else lr0 <= inv.to(lr0.dtype)
    floor = torch.as_tensor(eps2, dtype=torch.float64)
    # `weight`'s column per parameter, made once per dtype and rank (the state shares both)
    weights = cast(list[Tensor], member_columns(weight, params))  # `weight` is a tensor
    # Per parameter: its update, and per member RMS(p) and the update's clipping denominator
    # (in the parameter's dtype, float64 with a per-member eps2 or d); the step sizes from
    # them are computed for all parameters at once.
    updates: list[tuple[Tensor, Tensor]] = []
    rms: list[Tensor] = []
    denoms: list[Tensor] = []
    for k, (p, grad) in enumerate(zip(params, grads, strict=True)):
        size = math.prod(p.shape[1:])  # a member's numel
        if size == 0:
            continue  # nothing to update (torch's Adafactor divides by zero here)

        def col(x: Scalar, like: Tensor = p) -> Any:
            return member_column(x, like)

        g = -grad if group["maximize"] else grad
        small = torch.finfo(p.dtype).eps if eps1 is None else eps1
        # max(eps2, RMS(p)), and eps2 in float64 as torch's Python float
        rms.append(torch.maximum(_per_member_norm(p).div_(size**0.5), floor))
        if isinstance(wd, Tensor) or wd != 0:
            p.mul_(col(decay_factor(lr, wd)))
        if p.dim() > 2:
            row_var, col_var = state["row_var"][k], state["col_var"][k]
            # torch.norm(g, dim=-1, keepdim=True), which calls this, without its Python wrapper
            row_mean = torch.linalg.vector_norm(g, 2, -1, True).square_().div_(g.size(-1))
            lerp_column_(row_var, row_mean, weights[k])
            col_mean = torch.linalg.vector_norm(g, 2, -2, True).square_().div_(g.size(-2))
            lerp_column_(col_var, col_mean, weights[k])
            # torch writes `row_var @ col_var`: an outer product, one rounded product per
            # element either way, which a matmul with inner size 1 runs ~10x slower.
            estimate = row_var * col_var
            estimate.div_(torch.clamp(row_var.mean(dim=-2, keepdim=True), min=col(small)))
        else:
            variance = state["variance"][k]
            lerp_column_(variance, g * g, weights[k])
            estimate = variance  # torch clones it to clamp in place; clamp below makes a new one
        update = torch.clamp(estimate, min=col(small * small)).rsqrt_().mul_(g)
        # out of place: a per-member d is a float64 tensor, and so is the quotient
        denoms.append(torch.clamp(_per_member_norm(update) / (size**0.5 * d), min=1.0))
        updates.append((p, update))
    if not updates:
        return
    # [parameters, n]: stacking widens mixed dtypes exactly, and the products are float64
    rms_all, denom_all = torch.stack(rms), torch.stack(denoms)
    scale = (rms_all * -rho) / denom_all  # torch's alpha=-alpha / denom
    if lr0 is not None and picks is not None:
        low = (rms_all.to(lr0.dtype) * -lr0) / denom_all.to(lr0.dtype)
        scale = torch.where(picks, low.double(), scale)
    rows: dict[torch.dtype, list[Tensor]] = {}  # the step sizes, cast once per column dtype
    for k, (p, update) in enumerate(updates):
        dtype = column_dtype(p)
        if dtype not in rows:
            rows[dtype] = list(scale.to(dtype).unbind(0))
        p.add_(update * member_column(rows[dtype][k], p))


class StackedAdafactor(StackedOptimizer):
    """Adafactor over stacked parameters, with per-member hyperparameters.

    Member ``i`` is updated exactly as ``torch.optim.Adafactor`` would update it alone with
    member ``i``'s hyperparameters: a parameter whose member shape has 2 or more dims keeps
    factored row and column second moments (``row_var`` ``[n, ..., rows, 1]`` and
    ``col_var`` ``[n, ..., 1, cols]``), the others a full ``variance``;
    ``member_state_dict(i)`` hands it off to it with the keys torch has for that parameter.

    Args:
        params: Stacked tensors [n, ...], param-group dicts, or an Ensemble.
        lr: Learning rate: a float, a 0-d tensor (kept, and computed with as torch does), or
            one per member.
        beta2_decay: Decay of the second-moment rate (``<= 0``), a float or one per member.
        eps: ``(eps1, eps2)``: eps1 None (the dtype's eps) or a float or one per member;
            eps2 a float or one per member.
        d: Clipping threshold (``>= 1``), a float or one per member.
        weight_decay: Decoupled weight decay, a float or one per member.
        maximize: Maximise the objective.
        **implementation: torch's implementation flags that ``torch.optim.Adafactor`` takes
            (see :class:`~vmapens.optim.StackedOptimizer`).

    Raises:
        ValueError: Empty params, mismatched leading sizes, out-of-range or wrong-length
            hyperparameters.

    Example:
        >>> w = torch.ones(2, 3, 4, requires_grad=True)
        >>> opt = StackedAdafactor([w], lr=[1e-2, 1e-1])
        >>> w.grad = torch.ones(2, 3, 4)
        >>> opt.step()
        >>> w[:, 0, 0], opt.state[w]["row_var"].shape
        (tensor([0.9900, 0.9000], grad_fn=<SelectBackward0>), torch.Size([2, 3, 1]))
    """

    hyperparameters: ClassVar[dict[str, Hyper]] = {
        "lr": LR,
        "beta2_decay": Hyper("beta2_decay value", "<= 0", lambda v: v <= 0),
        "eps": Hyper("epsilon value", ">= 0", NONNEGATIVE.ok, pair=True, none_first=True),
        "d": Hyper("clipping threshold d", ">= 1", lambda v: v >= 1),
        "weight_decay": Hyper("weight_decay value", ">= 0", NONNEGATIVE.ok),
    }
    torch_class = torch.optim.Adafactor
    elementwise = False  # row and column means of the squared gradient
    rule = staticmethod(adafactor_rule)

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]] | nn.Module,
        lr: PerMember = 1e-2,
        beta2_decay: PerMember = -0.8,
        eps: tuple[PerMember | None, PerMember] = (None, 1e-3),
        d: PerMember = 1.0,
        weight_decay: PerMember = 0.0,
        *,
        maximize: bool = False,
        **implementation: Any,
    ) -> None:
        super().__init__(params, locals())

    def _normalise(self, group: dict[str, Any], free: tuple[str, ...] = ()) -> None:
        eps = group["eps"]
        if not (isinstance(eps, (tuple, list)) and len(eps) == 2 and eps[0] is None):
            super()._normalise(group, free)
            return
        # eps1 None (the dtype's eps, as torch) is kept as None; eps2 is checked as usual.
        group["eps"] = (0.0, eps[1])
        try:
            super()._normalise(group, free)
        finally:
            group["eps"] = (None, group["eps"][1])

    def state_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("row_var", "col_var", "variance")

    def initial_state(self, name: str, param: Tensor, group: dict[str, Any]) -> Tensor:
        factored = param.dim() > 2
        if (name == "variance") == factored:
            return param.new_zeros(param.shape[0], 0)  # a slot this parameter does not use
        if name == "variance":
            return super().initial_state(name, param, group)
        shape = list(param.shape)
        shape[-1 if name == "row_var" else -2] = 1
        return param.new_zeros(shape)

    def member_state(
        self, state: dict[str, Tensor], group: dict[str, Any], i: int
    ) -> dict[str, Tensor]:
        if state["step"][i] == 0:  # torch makes its state at a parameter's first step
            return {}
        # Factored state is at least [n, rows, 1]; the unused slots are [n, 0].
        keys = ("row_var", "col_var") if state["row_var"].dim() > 2 else ("variance",)
        return {k: state[k][i].clone() for k in ("step", *keys)}
