"""Per-member gradient clipping: each member clipped as torch.nn.utils would clip it alone."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from .._checks import column, module_params

__all__ = ["clip_grad_norm_", "clip_grad_value_", "clip_norms_", "clip_values_", "member_norms"]


def _grads(
    api: str, ens_or_params: nn.Module | Tensor | Iterable[Tensor], norm_type: float = 2.0
) -> tuple[list, int, torch.device]:
    params: list[Tensor]
    if isinstance(ens_or_params, nn.Module):
        params = module_params(api, ens_or_params, "ens_or_params")
    elif isinstance(ens_or_params, Tensor):
        params = [ens_or_params]
    else:
        params = list(ens_or_params)
    if not params:
        raise ValueError(f"{api}: no parameters given")
    if any(p.is_meta for p in params):  # ens.template's: no values, never a gradient
        raise ValueError(
            f"{api}: `ens_or_params` holds a meta tensor (ens.template's?), which never has a "
            "gradient: nothing would be clipped; pass the ensemble or ens.parameters()"
        )
    sizes = sorted({p.shape[0] if p.dim() else -1 for p in params})
    if len(sizes) != 1 or sizes[0] < 1:
        raise ValueError(
            f"{api}: all parameters must share a leading member dim n, got sizes {sizes}"
        )
    if norm_type < 0 and any(getattr(p, "_member_padding", None) for p in params):
        # A p-norm with p < 0 (-inf: the smallest |g|) is 0 as soon as one entry is 0, and a
        # padded entry's gradient is 0: the member would not be clipped as alone.
        raise ValueError(
            f"{api}: `norm_type` must be >= 0 for members of different sizes (padded), got "
            f"{norm_type}: the padded entries' zero gradients would count in the norm"
        )
    grads = [p.grad for p in params if p.grad is not None and p.grad.numel() > 0]
    return grads, sizes[0], params[0].device


def clip_grad_norm_(
    ens_or_params: nn.Module | Tensor | Iterable[Tensor],
    max_norm: float | Tensor,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> Tensor:
    """Clip each member's gradients by that member's own total norm, in place.

    Member ``i`` is treated exactly as ``torch.nn.utils.clip_grad_norm_`` would treat it alone:
    ``g *= min(max_norm / (norm_i + 1e-6), 1)``. A member with non-finite gradients gets a
    non-finite norm and leaves the others untouched.

    Args:
        ens_or_params: An ensemble (``nn.Module``), a stacked tensor or an iterable of them.
        max_norm: Maximum total norm per member (a number or a 0-d tensor, as torch takes),
            or a floating-point ``[n]`` tensor: member ``i`` clipped as alone with
            ``max_norm[i]``.
        norm_type: p of the p-norm (``inf`` or ``"inf"`` allowed).
        error_if_nonfinite: raise, with no gradient changed, if some member's norm is NaN or
            inf, as torch raises for the member alone (default: that member gets the
            non-finite norm and the others are clipped).
        foreach: accepted for torch's signature; the stacked gradients always take the
            foreach kernels, which clip as torch's per-tensor loop does.

    Returns:
        The per-member total gradient norms, shape [n] (before clipping).

    Raises:
        ValueError: No parameters, mismatched leading sizes, ``max_norm`` < 0, or
            ``norm_type`` < 0 on members of different sizes (padded zeros would count).
        TypeError: ``max_norm`` is not a number, a 0-d tensor or an ``[n]`` float tensor.
        RuntimeError: ``error_if_nonfinite`` and a member's norm is not finite.

    Example:
        >>> w = torch.zeros(2, 3, requires_grad=True)
        >>> w.grad = torch.tensor([[3.0, 4.0, 0.0], [0.3, 0.4, 0.0]])
        >>> clip_grad_norm_([w], max_norm=1.0)
        tensor([5.0000, 0.5000])
    """
    api = "clip_grad_norm_"
    if isinstance(max_norm, Tensor) and max_norm.dim() == 0 and not max_norm.is_complex():
        max_norm = float(max_norm)  # torch.nn.utils takes a 0-d tensor too
    bound: float | Tensor
    if isinstance(max_norm, Tensor) and max_norm.dim() == 1 and max_norm.is_floating_point():
        bound = max_norm.detach()  # one bound per member (checked against n below)
        if not bool((bound >= 0).all()):
            raise ValueError(f"{api}: `max_norm` must be >= 0, got {max_norm}")
    elif isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
        got = type(max_norm).__name__
        if isinstance(max_norm, Tensor):
            got = f"a {max_norm.dtype} tensor of shape {tuple(max_norm.shape)}"
        raise TypeError(
            f"{api}: `max_norm` must be a float, a 0-d tensor or a floating-point tensor of "
            f"shape [n] (one bound per member), got {got}"
        )
    elif not max_norm >= 0:
        raise ValueError(f"{api}: `max_norm` must be >= 0, got {max_norm}")
    else:
        bound = max_norm
    try:
        p = float(norm_type)  # torch reads "inf" as float("inf") too
    except (TypeError, ValueError):
        raise TypeError(f"{api}: `norm_type` must be a float, got {norm_type!r}") from None
    grads, n, device = _grads(api, ens_or_params, p)
    if isinstance(bound, Tensor) and tuple(bound.shape) != (n,):
        raise ValueError(
            f"{api}: a tensor `max_norm` holds one bound per member: expected shape ({n},), "
            f"got {tuple(bound.shape)}"
        )
    if not grads:
        return torch.zeros(n, device=device)
    if not error_if_nonfinite:
        return clip_norms_(grads, bound, p)
    norms = member_norms(grads, p)
    bad = (~norms.isfinite()).nonzero().flatten().tolist()
    if bad:
        # torch.nn.utils raises before it scales anything: so does this, for the whole stack.
        raise RuntimeError(
            f"{api}: the total norm of order {p} of the gradients of member(s) {bad} is "
            "non-finite, so it cannot be clipped; nothing was changed. Pass "
            "`error_if_nonfinite=False` to clip the others (and skip those members with "
            "`opt.step(mask=norms.isfinite())`)"
        )
    return clip_norms_(grads, bound, p, norms)


def clip_norms_(
    grads: list[Tensor],
    max_norm: float | Tensor,
    norm_type: float = 2.0,
    norms: Tensor | None = None,
) -> Tensor:
    """:func:`clip_grad_norm_` on stacked gradient tensors ``[n, ...]`` (non-empty, none None).

    No host sync and no data-dependent branch: it runs inside a compiled step's graph.
    ``norms``: :func:`member_norms` of ``grads``, where already computed.
    """
    if norms is None:
        norms = member_norms(grads, norm_type)
    if isinstance(max_norm, Tensor):  # one bound per member: each as torch's float bound alone
        bound = max_norm.to(norms.device, norms.dtype)
        coef = torch.clamp((norms + 1e-6).reciprocal() * bound, max=1.0)
    else:
        coef = torch.clamp(max_norm / (norms + 1e-6), max=1.0)
    # torch multiplies each gradient by the coefficient as a 0-d tensor, which type promotion
    # reads as a scalar: in float32 for a float16/bfloat16 gradient, in the coefficient's dtype
    # for a 0-d gradient (a member's scalar parameter), rounded once. The coefficient rounded
    # to the gradient's dtype first, a model with parameters of several dtypes got gradients
    # 1 ulp off the member clipped alone.
    torch._foreach_mul_(grads, [column(coef.to(g.device, _mul_dtype(g, coef)), g) for g in grads])
    return norms


def _torch_order(keys: tuple[tuple[torch.device, torch.dtype], ...]) -> tuple[int, ...]:
    """The order torch.nn.utils stacks per-tensor norms in: its (device, dtype) grouping's.

    Read from torch's grouping at trace time too: dynamo's stand-in for it keeps the groups
    in the order they first occur, which eager torch does not.
    """
    if keys in _ORDERS:  # once per model, not an allocation each step
        return _ORDERS[keys]
    probes: list[Tensor | None] = [torch.empty(0, device=d, dtype=t) for d, t in keys]
    groups = torch._C._group_tensors_by_device_and_dtype([probes], True)
    order = _ORDERS[keys] = tuple(i for _, (_, indices) in groups.items() for i in indices)
    return order


_ORDERS: dict[tuple[tuple[torch.device, torch.dtype], ...], tuple[int, ...]] = {}
# Not traced, run as it is while compiling: what torch._dynamo.assume_constant_result sets,
# set here, as importing torch._dynamo would slow every eager run's start (Time to result).
_torch_order._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _mul_dtype(grad: Tensor, coef: Tensor) -> torch.dtype:
    """The dtype torch computes ``grad_alone * coef_0d`` in (``grad``: stacked ``[n, ...]``)."""
    if grad.dim() == 1:  # both 0-d for the member alone: promoted as tensors
        return torch.promote_types(grad.dtype, coef.dtype)
    return torch.promote_types(grad.dtype, torch.float32)


def member_norms(grads: list[Tensor], norm_type: float = 2.0) -> Tensor:
    """Each member's total ``norm_type``-norm over the stacked gradients ``grads``: ``[n]``."""
    n = grads[0].shape[0]
    if len({(g.device, g.dtype) for g in grads}) > 1:
        # torch.nn.utils stacks the per-tensor norms group by group, (device, dtype) groups in
        # the order of its grouping (not the parameters'); summed in another order, a model
        # with float32 and float16 parameters got a total norm 1 ulp off the member alone.
        grads = [grads[i] for i in _torch_order(tuple((g.device, g.dtype) for g in grads))]
    per_tensor = [
        torch.linalg.vector_norm(g.reshape(n, math.prod(g.shape[1:])), float(norm_type), dim=1)
        for g in grads
    ]
    # Each member's row of per-tensor norms reduced as one contiguous vector, as torch reduces
    # the stacked norms of a model alone (over dim 0 of [tensors, n], the order of the sum
    # depended on n: 1 ulp off the member alone now and then).
    return torch.linalg.vector_norm(torch.stack(per_tensor, dim=1), float(norm_type), dim=1)


def clip_grad_value_(
    ens_or_params: nn.Module | Tensor | Iterable[Tensor],
    clip_value: float | str | Tensor,
    foreach: bool | None = None,
) -> None:
    """Clamp every gradient element to ``[-clip_value, clip_value]``, as torch.nn.utils does.

    Elementwise, so each member is clipped exactly as it would be alone. ``foreach`` is
    accepted for torch's signature (the foreach kernels clip as torch's loop does).

    Example:
        >>> w = torch.zeros(2, 2, requires_grad=True)
        >>> w.grad = torch.tensor([[3.0, -0.5], [-2.0, 0.1]])
        >>> clip_grad_value_([w], 1.0)
        >>> w.grad
        tensor([[ 1.0000, -0.5000],
                [-1.0000,  0.1000]])
    """
    try:
        value = float(clip_value)  # as torch.nn.utils reads it: a 0-d tensor, "0.5"
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(
            f"clip_grad_value_: `clip_value` must be a float, got {clip_value!r}"
        ) from None
    grads, _, _ = _grads("clip_grad_value_", ens_or_params)
    if grads:
        clip_values_(grads, value)


def clip_values_(grads: list[Tensor], clip_value: float) -> None:
    """:func:`clip_grad_value_` on gradient tensors (non-empty, none None), in place."""
    torch._foreach_clamp_min_(grads, -clip_value)
    torch._foreach_clamp_max_(grads, clip_value)
