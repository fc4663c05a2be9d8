"""The values a rule's update reads, per member: hyperparameter columns, and the steps that
several rules share (the sign of ``maximize``, weight decay, Adam's two moments), as ops and as a
write phase's writes (``optim/_fused.py``)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeGuard

import torch
from torch import Tensor

from .._checks import column
from ._hyper import Scalar

__all__ = [
    "add_scaled",
    "added",
    "alpha_columns",
    "column_dtype",
    "cpu_scalar",
    "decay_factor",
    "decayed_writes",
    "in_lr_dtype",
    "is_tensor_lr",
    "host_scalars",
    "lerped",
    "lerp_column_",
    "like",
    "member_column",
    "member_columns",
    "moment_writes",
    "moments_",
    "signed",
    "weight_decayed",
]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def member_column(x: Scalar, like: Tensor) -> Scalar:
    """A hyperparameter as the update rule uses it: a float, or ``[n, 1, ...]`` for ``like``.

    Low-precision parameters take float32 columns: in-place ops compute in the promoted dtype.
    A 0-d tensor becomes ``[1, 1, ...]`` (shared by every member).
    """
    return _column(x, like) if isinstance(x, Tensor) else x


def column_dtype(like: Tensor) -> torch.dtype:
    """The dtype of a member column for ``like``: float32 for float16 and bfloat16, else
    ``like``'s own (:func:`member_column`)."""
    return torch.float32 if like.dtype in _LOW_PRECISION else like.dtype


def _column(x: Tensor, like: Tensor) -> Tensor:
    x = x.to(column_dtype(like))
    if torch.compiler.is_compiling() and x.dim() == 1:
        # A view that inductor computes once, into a buffer of n values (its lowering of
        # as_strided realizes its input): else it inlines the column's arithmetic (Adam's
        # float64 pow of the step counts) into every vector of every loop that reads it.
        # Workload A's compiled step at N = 1024: 1.33 -> 1.16 ms.
        x = x.as_strided(x.shape, x.stride())
    return x.view([1] * like.dim()) if x.dim() == 0 else column(x, like)


def member_columns(x: Scalar, like: list[Tensor]) -> float | list[Tensor]:
    """A hyperparameter as a ``torch._foreach_*`` op takes it: a float, or one ``[n, 1, ...]``
    column per tensor of ``like`` (see :func:`member_column`; built once per dtype and rank)."""
    return _columns(x, like, _column) if isinstance(x, Tensor) else x


def _columns(
    x: Tensor, like: Sequence[Tensor], make: Callable[[Tensor, Tensor], Tensor]
) -> list[Tensor]:
    """``make(x, t)`` for each tensor ``t`` of ``like``, built once per dtype and rank."""
    made: dict[tuple[torch.dtype, int], Tensor] = {}
    out = []
    for t in like:
        key = (t.dtype, t.dim())
        if key not in made:
            made[key] = make(x, t)
        out.append(made[key])
    return out


def alpha_columns(x: Scalar, like: Sequence[Tensor]) -> float | list[Tensor]:
    """A hyperparameter as torch takes an ``alpha`` (``x.add(y, alpha=s)``) or an added float
    (``x.add(s)``): a float, or one column per tensor of ``like`` (:func:`member_columns`),
    rounded first to the dtype of float16 and bfloat16 tensors, as torch's vector kernels round
    those there (a factor of ``mul``, ``addcmul`` or ``addcdiv``, or a ``lerp`` weight, they
    keep in float32).

    Example:
        >>> like = [torch.zeros(2, 3, dtype=torch.bfloat16)]
        >>> alpha_columns(torch.tensor([0.3, 0.1], dtype=torch.float64), like)[0].flatten()
        tensor([0.3008, 0.1001])
    """
    return _columns(x, like, _alpha_column) if isinstance(x, Tensor) else x


def _alpha_column(x: Tensor, like: Tensor) -> Tensor:
    low = like.dtype in _LOW_PRECISION
    return _column(x.to(torch.float32).to(like.dtype) if low else x, like)


def add_scaled(x: Sequence[Tensor], y: Sequence[Tensor], s: Scalar) -> list[Tensor]:
    """``x + s * y`` rounded once, as torch's ``x.add(y, alpha=s)``: a float ``s`` as ``alpha``,
    a tensor one (per member, or a 0-d ``lr``) as ``addcmul`` with its columns
    (:func:`alpha_columns`). float16 and bfloat16 ``x`` keep their dtype (the float32 columns
    would promote the result)."""
    if isinstance(s, Tensor):
        out = torch._foreach_addcmul(list(x), list(y), _columns(s, x, _alpha_column))
        return [o if o.dtype == t.dtype else o.to(t.dtype) for o, t in zip(out, x, strict=True)]
    return list(torch._foreach_add(list(x), list(y), alpha=s))


def added(x: list[Tensor], y: Any, s: Scalar) -> Callable[[], Any]:
    """``x += s * y`` rounded once, as a write phase's write (:func:`add_scaled` in place): a
    float ``s`` as ``alpha``, a tensor one as ``addcmul_`` with its columns
    (:func:`alpha_columns`)."""
    if isinstance(s, Tensor):
        return functools.partial(torch._foreach_addcmul_, x, y, alpha_columns(s, x))
    return functools.partial(torch._foreach_add_, x, y, alpha=s)


def lerped(x: list[Tensor], y: Any, weight: Any) -> Callable[[], Any]:
    """``x.lerp_(y, weight)`` for every tensor of ``x``, as a write phase's write: one
    ``torch._foreach_lerp_``, but one :func:`lerp_column_` per tensor for per-member columns
    when compiling, which inductor fuses into the step's kernels (it has no lowering for the
    foreach form with tensor weights, and ran it as a separate call, 62 us of workload A's
    1.3 ms step at N = 1024), and on float16/bfloat16 tensors (whose columns are float32)."""
    if isinstance(weight, list) and (
        torch.compiler.is_compiling() or any(t.dtype in _LOW_PRECISION for t in x)
    ):
        return functools.partial(_lerp_each_, x, y, weight)
    return functools.partial(torch._foreach_lerp_, x, y, weight)


def _lerp_each_(x: list[Tensor], y: Sequence[Tensor], weight: list[Tensor]) -> None:
    for a, b, w in zip(x, y, weight, strict=True):
        lerp_column_(a, b, w)


def lerp_column_(x: Tensor, end: Tensor, weight: Any) -> None:
    """``x.lerp_(end, weight)`` with a member column ``weight`` (:func:`member_column`) as
    torch's optimizers lerp with a float weight: float16 and bfloat16 ``x`` in float32 (the
    kernels' opmath for a float weight; their tensor-weight form wants the weight in ``x``'s
    dtype), rounded once to ``x``'s dtype.

    Example:
        >>> x, end = torch.tensor([1.0, 2.0], dtype=torch.bfloat16), torch.zeros(2).bfloat16()
        >>> want = x.clone().lerp_(end, 0.1)  # torch's, with a float weight
        >>> lerp_column_(x, end, torch.tensor([0.1]))
        >>> torch.equal(x, want)
        True
    """
    if x.dtype in _LOW_PRECISION:
        x.copy_(torch.lerp(x.float(), end.float(), weight))
    else:
        x.lerp_(end, weight)


def like(hyper: Scalar, value: Tensor) -> Tensor:
    """A float64 per-member scalar (from the step counts) as torch's Python float meets
    ``hyper``: in a tensor hyperparameter's dtype, where torch computes ``lr / bias_correction``
    (a 0-d float32 ``lr``: in float32, the float rounded first), else float64 as it is."""
    return value.to(hyper.dtype) if isinstance(hyper, Tensor) else value


def is_tensor_lr(lr: Any) -> TypeGuard[Tensor]:
    """Whether ``lr`` is a 0-d tensor, kept in ``param_groups`` as torch keeps it (not a
    per-member ``[n]`` column): torch then computes with it in its dtype."""
    return isinstance(lr, Tensor) and lr.dim() == 0


def in_lr_dtype(lr: Scalar, value: Scalar) -> Scalar:
    """``value`` as torch's Python float meets a 0-d tensor ``lr``: a per-member (float64)
    tensor cast to ``lr``'s dtype, as torch casts a float that it multiplies with the tensor
    (``lr * weight_decay``: in float32 for a float32 ``lr``); anything else as it is."""
    if is_tensor_lr(lr) and isinstance(value, Tensor):
        return value.to(lr.dtype)
    return value


def decay_factor(lr: Scalar, wd: Scalar) -> Scalar:
    """Decoupled weight decay's ``1 - lr * wd``, as torch computes it: in a 0-d tensor
    ``lr``'s dtype (also each member's ``wd``, :func:`in_lr_dtype`), else in float64."""
    return 1 - lr * in_lr_dtype(lr, wd)


def host_scalars(params: Sequence[Tensor], values: Sequence[Any], lr: Scalar = 0.0) -> bool:
    """Whether a rule may take torch's foreach form with Python float scalars.

    That form reads one step count on the host per call (``run_fused``: one call per count
    over the whole tensors, so a member's bits never depend on another's count). It may when
    every member shares the hyperparameters ``values`` (floats, not per-member tensors), the
    parameters are CPU tensors (a host read costs no device sync) and no ``torch.compile``
    trace is running; the choice depends on this configuration only. ``lr``, given apart by a
    rule whose foreach form computes with a 0-d tensor ``lr`` as torch's loop does, may also
    be that tensor (shared by every member).
    """
    per_member = isinstance(lr, Tensor) and lr.dim() > 0
    if per_member or torch.compiler.is_compiling() or any(isinstance(v, Tensor) for v in values):
        return False
    return all(p.device.type == "cpu" for p in params)


def cpu_scalar(value: Any, like: Tensor) -> Any:
    """``value`` as a ``torch._foreach_*`` op over tensors like ``like`` takes it fastest: a
    shared float as a float64 0-d tensor when ``like`` is a float32 or float64 CPU tensor,
    anything else (per-member columns, other dtypes and devices) as it is.

    The same bits as the Python float, ~1 us a tensor faster: the op wraps a float into just
    such a double tensor for every tensor of the list (a 0-d tensor does not promote the list's
    dtype) and casts it as it casts this one. Not so for float16 and bfloat16, whose kernels
    read a wrapped float apart (``x * 0.1`` differs there), nor for ``lerp``, whose tensor
    weight takes another kernel. Cached by value and sign (constant hyperparameters are built
    once); never written. Not while ``torch.compile`` traces (the float is a graph constant).

    Example:
        >>> x = torch.tensor([1.0, 3.0])
        >>> torch.equal(x * cpu_scalar(0.1, x), x * 0.1)
        True
    """
    if (
        not isinstance(value, (int, float))
        or like.dtype not in (torch.float32, torch.float64)
        or not like.is_cpu
        or torch.compiler.is_compiling()
    ):
        return value
    return _cpu_scalar(value, math.copysign(1.0, value))


@functools.lru_cache(maxsize=256)
def _cpu_scalar(value: float, sign: float) -> Tensor:  # the sign tells 0.0 from -0.0
    return torch.scalar_tensor(value, dtype=torch.float64)


def signed(grads: list[Tensor], group: dict[str, Any]) -> list[Tensor] | tuple[Tensor, ...]:
    """The gradients a rule descends along: negated with ``maximize``, as torch's rules do."""
    return torch._foreach_neg(grads) if group["maximize"] else grads


def weight_decayed(
    grads: list[Tensor] | tuple[Tensor, ...], params: list[Tensor], group: dict[str, Any]
) -> list[Tensor] | tuple[Tensor, ...]:
    """The gradients after torch's weight decay, as every rule applies it: ``g + wd * p``
    rounded once, or with ``decoupled_weight_decay`` (AdamW, NAdamW, RAdam) ``p *= 1 - lr * wd``
    in place and ``g`` unchanged. ``lr`` and ``weight_decay`` are read from ``group``, floats
    (torch's float arithmetic) or per-member tensors (columns)."""
    lr, wd = group["lr"], group["weight_decay"]
    if not isinstance(wd, Tensor) and wd == 0:
        return grads
    if group.get("decoupled_weight_decay", False):
        torch._foreach_mul_(params, member_columns(decay_factor(lr, wd), params))
        return grads
    return add_scaled(grads, params, wd)


def decayed_writes(
    grads: list[Tensor] | tuple[Tensor, ...], params: list[Tensor], group: dict[str, Any]
) -> tuple[list[Tensor] | tuple[Tensor, ...], list[Callable[[], Any]]]:
    """:func:`weight_decayed` for a write phase (``optim/_fused.py``): the gradients, and the
    decoupled decay ``p *= 1 - lr * wd`` as the phase's first write instead of made here."""
    lr, wd = group["lr"], group["weight_decay"]
    if not group.get("decoupled_weight_decay", False) or (not isinstance(wd, Tensor) and wd == 0):
        return weight_decayed(grads, params, group), []
    scale = member_columns(decay_factor(lr, wd), params)
    return grads, [functools.partial(torch._foreach_mul_, params, scale)]


def moments_(
    exp_avg: list[Tensor],
    exp_avg_sq: list[Tensor],
    grads: list[Tensor] | tuple[Tensor, ...],
    beta1: Scalar,
    beta2: Scalar,
) -> None:
    """Adam's two moments in place, in torch's ops (Adam, NAdam, RAdam):
    ``m = lerp(m, g, 1 - beta1)``, ``v = beta2 * v + (1 - beta2) * g * g``; floats, or per-member
    tensors as columns."""
    for write in moment_writes(exp_avg, exp_avg_sq, grads, beta1, beta2):
        write()


def moment_writes(
    exp_avg: list[Tensor],
    exp_avg_sq: list[Tensor],
    grads: list[Tensor] | tuple[Tensor, ...],
    beta1: Scalar,
    beta2: Scalar,
) -> list[Callable[[], Any]]:
    """:func:`moments_` as a write phase's writes (``optim/_fused.py``): what they need that
    allocates (``(1 - beta2) * g`` for per-member ``beta2``) is computed now."""
    col = functools.partial(member_columns, like=exp_avg)
    g2, value = (
        (torch._foreach_mul(grads, col(1 - beta2)), 1.0)
        if isinstance(beta2, Tensor)
        else (grads, 1 - beta2)
    )
    return [
        lerped(exp_avg, grads, col(1 - beta1)),
        functools.partial(torch._foreach_mul_, exp_avg_sq, cpu_scalar(col(beta2), exp_avg_sq[0])),
        functools.partial(torch._foreach_addcmul_, exp_avg_sq, grads, g2, value=value),
    ]
