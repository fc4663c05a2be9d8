"""SGD with momentum for stacked ensembles: the update rule and its optimizer."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .._checks import column
from ._columns import (
    add_scaled,
    added,
    alpha_columns,
    host_scalars,
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
from ._hyper import (
    LR,
    MOMENTUM,
    WEIGHT_DECAY,
    Hyper,
    Params,
    PerMember,
    Scalar,
    any_nonzero,
    member_floats,
)
from ._keep import step_one
from .base import StackedOptimizer

__all__ = ["StackedSGD", "sgd_rule", "sgd_update_"]


def _lists(params: list[Tensor], grads: list[Tensor], state: dict[str, Any]) -> list[list[Tensor]]:
    bufs = state.get("momentum_buffer")
    return [params, grads, *([] if bufs is None else [bufs])]


def _fused(
    params: list[Tensor], grads: list[Tensor], state: dict[str, Any], group: dict[str, Any]
) -> bool:
    """Whether :func:`sgd_rule` takes torch's fused kernel (shared hyperparameters, on CPU).

    Not for 16-bit parameters: torch 2.13's CPU ``_fused_sgd_`` leaves most of a bfloat16 or
    float16 tensor unchanged (``torch.optim.SGD(fused=True)`` too; ~4% of the elements move).
    """
    if params and params[0].dtype in (torch.float16, torch.bfloat16):
        return False
    values = [group[k] for k in ("lr", "momentum", "dampening", "weight_decay")]
    return fusable(group, _lists(params, grads, state), values)


def _one_go(
    params: list[Tensor], grads: list[Tensor], state: dict[str, Any], group: dict[str, Any]
) -> bool:
    """Whether :func:`sgd_rule` writes everything in one go: the fused kernel, with
    ``fused=False`` the write phase of :func:`_shared_kernel`, with per-member values its own
    (see ``safe_in_place``)."""
    values = [group[k] for k in ("lr", "momentum", "dampening", "weight_decay")]
    return safe_in_place(group, _lists(params, grads, state), values, columns=True)


@one_kernel_when(_one_go)
def sgd_rule(
    params: list[Tensor], grads: list[Tensor], state: dict[str, Any], group: dict[str, Any]
) -> None:
    """One SGD step in place on stacked tensors, each member with its own hyperparameters.

    Follows ``torch.optim.SGD`` (Sutskever et al., 2013) per member ``i``; the momentum buffer
    starts as the gradient of the member's first step with momentum, undampened (also when a
    schedule turns momentum on mid-run), and a member whose momentum is 0 leaves it alone:

    .. code-block:: text

        g = -g if maximize;  g += wd * p
        b = g if t == 0 else momentum * b + (1 - dampening) * g
        g = g + momentum * b if nesterov else b          (members with momentum != 0)
        p -= lr * g

    With shared hyperparameters on CPU, torch's fused kernel (see ``run_fused``: the first
    step starts the buffer); with ``fused=False``, torch's single-tensor ops, each member's
    bits as alone.

    Args:
        params: Stacked parameters [n, ...] sharing one step count, updated in place.
        grads: Their gradients (not modified).
        state: ``momentum_buffer`` (one per parameter; absent when no member uses momentum)
            and ``step`` ([n] counts of the steps taken with momentum, ``t`` above: torch's
            SGD keeps no step count, only whether the buffer exists), updated in place.
        group: ``lr``, ``momentum``, ``dampening``, ``weight_decay`` (floats or float64 [n]
            tensors), ``nesterov``, ``maximize``, ``fused``, ``mask``.
    """
    lr, momentum, wd = group["lr"], group["momentum"], group["weight_decay"]
    dampening, bufs, step = group["dampening"], state.get("momentum_buffer"), state["step"]
    # A step without momentum leaves the count as it is (a scratch counter takes it).
    counts = step if isinstance(momentum, Tensor) or momentum != 0 else torch.zeros_like(step)
    if _fused(params, grads, state, group):

        def kernel(t: list[list[Tensor]], count: float) -> Callable[[], Any]:
            return functools.partial(
                torch._fused_sgd_,
                t[0],
                t[1],
                t[2] if len(t) > 2 else [],
                weight_decay=wd,
                momentum=momentum,
                lr=lr,
                dampening=dampening,
                nesterov=group["nesterov"],
                maximize=group["maximize"],
                is_first_step=count == 0,
            )

        run_fused(kernel, _lists(params, grads, state), counts, group["mask"])
        return
    if host_scalars(params, [lr, momentum, dampening, wd]):  # fused=False: torch's bits
        shared = functools.partial(_shared_kernel, group=group)
        run_fused(shared, _lists(params, grads, state), counts, group["mask"])
        return

    # Per-member values: what allocates first, then the writes (optim/_fused.py).
    col: Callable[[Scalar], Any] = functools.partial(member_columns, like=params)
    g = weight_decayed(signed(grads, group), params, group)
    writes: list[Callable[[], Any]] = []
    uses = momentum != 0
    if bufs is not None:
        first = step == 0  # a member's first step with momentum starts its buffer as g
        # A member without momentum leaves its buffer as torch's SGD does (unread, unwritten),
        # so that a momentum turned on again goes on from it.
        idle = ~uses if isinstance(uses, Tensor) else None
        if (
            torch.compiler.is_compiling()
            or bool(first.any())
            or (idle is not None and bool(idle.any()))
        ):
            kept = add_scaled(torch._foreach_mul(bufs, col(momentum)), g, 1 - dampening)
            new = [
                torch.where(column(first, b), x, k) for b, x, k in zip(bufs, g, kept, strict=True)
            ]
            if idle is not None:
                new = [torch.where(column(idle, b), b, x) for b, x in zip(bufs, new, strict=True)]
            writes.append(functools.partial(torch._foreach_copy_, bufs, new))
        else:
            writes.append(functools.partial(torch._foreach_mul_, bufs, col(momentum)))
            writes.append(added(bufs, g, 1 - dampening))
        d = bufs
        if group["nesterov"]:  # d = g + momentum * b, from the new buffer
            d = [torch.empty_like(b) for b in bufs]
            if isinstance(momentum, Tensor):  # torch: g.add(b, alpha=momentum)
                writes += into(torch.addcmul, d, g, bufs, alpha_columns(momentum, bufs))
            else:
                writes += into(torch.add, d, g, bufs, alpha=momentum)
        if isinstance(uses, Tensor) and (torch.compiler.is_compiling() or not bool(uses.all())):
            # Members without momentum step on the plain gradient, as torch's SGD does.
            plain, g = g, [torch.empty_like(b) for b in bufs]
            writes += into(torch.where, g, [column(uses, x) for x in plain], d, plain)
        else:
            g = d
    writes.append(added(params, g, -lr))  # torch's `p.add_(g, alpha=-lr)`
    if isinstance(momentum, Tensor):  # counted per member, as a write; the phase's is scratch
        writes.append(functools.partial(step.add_, (momentum != 0).to(step.dtype)))
        counts = torch.zeros_like(step)
    write_then_count(writes, counts)


def _shared_kernel(t: list[list[Tensor]], count: float, group: dict[str, Any]) -> Writes:
    """``torch.optim.SGD``'s single-tensor step, op for op, on whole stacked tensors ``t``
    (params, grads[, momentum_buffer]) with shared float hyperparameters, ``count`` steps
    with momentum before this one: each member's bits as alone. What allocates comes first,
    then the writes (``optim/_fused.py``)."""
    lr, momentum, dampening = group["lr"], group["momentum"], group["dampening"]
    p = t[0]
    g = weight_decayed(signed(t[1], group), p, group)
    if momentum == 0:
        return [functools.partial(torch._foreach_add_, p, g, alpha=-lr)]
    bufs = t[2]
    if count == 0:  # torch starts the buffer as the gradient, undampened
        writes: list[Callable[[], Any]] = [functools.partial(torch._foreach_copy_, bufs, g)]
    else:
        writes = [
            functools.partial(torch._foreach_mul_, bufs, momentum),
            functools.partial(torch._foreach_add_, bufs, g, alpha=1 - dampening),
        ]
    direction = bufs
    if group["nesterov"]:
        direction = [torch.empty_like(x) for x in bufs]
        writes += into(torch.add, direction, g, bufs, alpha=momentum)
    return [*writes, functools.partial(torch._foreach_add_, p, direction, alpha=-lr)]


def sgd_update_(
    param: Tensor,
    grad: Tensor,
    momentum_buffer: Tensor | None,
    step: Tensor,
    *,
    lr: Scalar,
    momentum: Scalar,
    dampening: Scalar,
    weight_decay: Scalar,
    nesterov: bool = False,
    maximize: bool = False,
) -> None:
    """:func:`sgd_rule` on one stacked tensor and its momentum buffer, in place.

    Args:
        param: Stacked parameter [n, ...], updated in place.
        grad: Its gradient (not modified).
        momentum_buffer: Shaped like ``param``, updated in place; None when no member uses
            momentum.
        step: Float32 [n] per-member counts of the steps taken with momentum, updated in place.
        lr: A float or a float64 [n] tensor, as are the other hyperparameters.
        momentum: Momentum factor.
        dampening: Dampening of the momentum.
        weight_decay: L2 penalty.
        nesterov: Nesterov momentum.
        maximize: Ascend instead of descend.

    Example:
        >>> p, g, b, s = torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3), torch.zeros(2)
        >>> sgd_update_(p, g, b, s, lr=torch.tensor([0.1, 0.2]), momentum=0.9, dampening=0.0,
        ...             weight_decay=0.0)
        >>> p[:, 0]
        tensor([-0.1000, -0.2000])
    """

    hyper = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay)
    flags = dict(nesterov=nesterov, maximize=maximize)
    step_one(
        sgd_rule,
        param,
        grad,
        {"momentum_buffer": momentum_buffer},
        {"step": step},
        {**hyper, **flags},
    )


class StackedSGD(StackedOptimizer):
    """SGD (with momentum) over stacked parameters, with per-member hyperparameters.

    Member ``i`` is updated exactly as ``torch.optim.SGD`` would update it alone with member
    ``i``'s hyperparameters; ``member_state_dict(i)`` hands it off to ``torch.optim.SGD``.

    Args:
        params: Stacked tensors [n, ...], param-group dicts, or an Ensemble.
        lr: Learning rate, a float or one per member.
        momentum: Momentum factor, a float or one per member.
        dampening: Dampening for momentum, a float or one per member.
        weight_decay: L2 penalty, a float or one per member.
        nesterov: Nesterov momentum (needs momentum > 0 and dampening 0 for every member).
        maximize: Maximise the objective.
        **implementation: torch's implementation flags that ``torch.optim.SGD`` takes
            (see :class:`~vmapens.optim.StackedOptimizer`).

    Example:
        >>> w = torch.zeros(2, 3, requires_grad=True)
        >>> opt = StackedSGD([w], lr=0.1, momentum=[0.0, 0.9])
        >>> for _ in range(2):
        ...     w.grad = torch.ones(2, 3)
        ...     opt.step()
        >>> w[:, 0]
        tensor([-0.2000, -0.2900], grad_fn=<SelectBackward0>)
    """

    hyperparameters = {
        "lr": LR,
        "momentum": MOMENTUM,
        "dampening": Hyper("dampening value", "a float", lambda v: True),
        "weight_decay": WEIGHT_DECAY,
    }
    torch_class = torch.optim.SGD
    rule = staticmethod(sgd_rule)

    def __init__(
        self,
        params: Params,
        lr: PerMember = 1e-3,
        momentum: PerMember = 0.0,
        dampening: PerMember = 0.0,
        weight_decay: PerMember = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        **implementation: Any,
    ) -> None:
        super().__init__(params, locals())
        for group in self.param_groups:
            if group["nesterov"] and not (
                min(member_floats(group["momentum"])) > 0
                and max(map(abs, member_floats(group["dampening"]))) == 0
            ):
                raise ValueError(
                    "StackedSGD: Nesterov momentum requires a momentum and zero dampening "
                    "(`momentum` > 0 and `dampening` 0 for every member)"
                )

    def state_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        # Called while a compiled step traces: the question is asked so that dynamo guards on
        # its answer only, not on the momenta a schedule changes every step.
        return ("momentum_buffer",) if any_nonzero(group["momentum"]) else ()

    def member_state(
        self, state: dict[str, Tensor], group: dict[str, Any], i: int
    ) -> dict[str, Tensor]:
        # torch's SGD keeps a momentum buffer once the member has stepped with momentum (and
        # keeps it through later steps without): `step` counts those steps.
        if "momentum_buffer" not in state or state["step"][i] == 0:
            return {}
        return {"momentum_buffer": state["momentum_buffer"][i].clone()}
