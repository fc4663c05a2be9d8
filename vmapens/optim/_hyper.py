"""Per-member hyperparameters: their table entries, checks, and the values an update reads."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .._checks import column
from ._values import MemberValues

__all__ = [
    "NONNEGATIVE",
    "UNIT",
    "Hyper",
    "Scalar",
    "check_hyper",
    "group_args",
    "local_values",
    "member_column",
    "member_columns",
    "member_floats",
    "leading_n",
    "params_of",
    "pick_group",
]

Scalar = float | Tensor
_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class Hyper:
    """A per-member hyperparameter: its torch error wording, rule and check.

    ``pair=True`` for a tuple of two values such as Adam's ``betas``.
    """

    what: str
    rule: str
    ok: Callable[[float], bool]
    pair: bool = False


NONNEGATIVE = Hyper("value", ">= 0", lambda v: v >= 0)
UNIT = Hyper("value", "in [0, 1)", lambda v: 0 <= v < 1)


def member_column(x: Scalar, like: Tensor) -> Scalar:
    """A hyperparameter as the update rule uses it: a float, or ``[n, 1, ...]`` for ``like``.

    Low-precision parameters take float32 columns: in-place ops compute in the promoted dtype.
    """
    if not isinstance(x, Tensor):
        return x
    dtype = torch.float32 if like.dtype in _LOW_PRECISION else like.dtype
    return column(x.to(dtype), like)


def member_columns(x: Scalar, like: list[Tensor]) -> float | list[Tensor]:
    """A hyperparameter as a ``torch._foreach_*`` op takes it: a float, or one ``[n, 1, ...]``
    column per tensor of ``like`` (see :func:`member_column`; built once per dtype and rank)."""
    if not isinstance(x, Tensor):
        return x
    made: dict[tuple[torch.dtype, int], Tensor] = {}
    out = []
    for t in like:
        key = (t.dtype, t.dim())
        if key not in made:
            made[key] = column(x.to(torch.float32 if t.dtype in _LOW_PRECISION else t.dtype), t)
        out.append(made[key])
    return out


def check_hyper(
    api: str, name: str, value: Any, hyper: Hyper, n: int, where: str = ""
) -> float | MemberValues:
    """A float (shared) or n values (per member), checked against ``hyper``'s rule."""
    out: float | MemberValues
    if isinstance(value, Tensor):
        if value.dim() > 1:
            raise ValueError(
                f"{api}: `{name}` must be a float or 1-D, got shape {tuple(value.shape)}"
            )
        value = value.item() if value.dim() == 0 else value.tolist()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        vals, out = [float(value)], float(value)
    elif isinstance(value, (Sequence, MemberValues)) and not isinstance(value, str):
        if len(value) != n:
            raise ValueError(
                f"{api}: `{name}` has {len(value)} values, expected n={n}, one per member"
            )
        vals = [float(v) for v in value]
        out = MemberValues(vals)
    else:
        raise TypeError(
            f"{api}: `{name}` must be a float or a sequence/1-D tensor of n={n} floats, "
            f"got {type(value).__name__}"
        )
    for v in vals:
        if not hyper.ok(v):
            raise ValueError(
                f"{api}: Invalid {hyper.what}{where}: {v} (`{name}` must be {hyper.rule})"
            )
    return out


def local_values(value: Any, block: Sequence[int] | None, n_total: int) -> Any:
    """This block's values of a per-member hyperparameter given for all n_total members."""
    sized = isinstance(value, (Sequence, MemberValues)) and not isinstance(value, str)
    sized = sized or isinstance(value, Tensor) and value.dim() == 1
    if block is None or not sized or len(value) != n_total:
        return value
    return [value[i] for i in block]


def group_args(
    group: dict[str, Any], hypers: dict[str, Hyper], device: torch.device
) -> dict[str, Any]:
    """The group with MemberValues as float64 tensors on ``device``: what update_ reads."""

    def arg(v: Any) -> Any:
        return v.tensor.to(device) if isinstance(v, MemberValues) else v

    out = dict(group)
    for name, hyper in hypers.items():
        out[name] = tuple(arg(v) for v in group[name]) if hyper.pair else arg(group[name])
    return out


def pick_group(group: dict[str, Any], hypers: dict[str, Hyper], rows: list[int]) -> dict[str, Any]:
    """``group``'s options with each per-member value cut to ``rows`` (a float for one row)."""

    def pick(v: Any) -> Any:
        if not isinstance(v, MemberValues):
            return v
        return v[rows[0]] if len(rows) == 1 else MemberValues(v[r] for r in rows)

    out = {k: v for k, v in group.items() if k != "params"}
    for name, hyper in hypers.items():
        out[name] = tuple(pick(v) for v in group[name]) if hyper.pair else pick(group[name])
    return out


def member_floats(v: Any) -> list[float]:
    """A hyperparameter's values: one per member (MemberValues), or the shared float alone."""
    return list(v) if not isinstance(v, (int, float)) else [float(v)]


def params_of(params: Any) -> list[Any]:
    """What an optimizer's ``params`` argument holds: an Ensemble's parameters, a tensor, or
    an iterable of tensors or param-group dicts."""
    if isinstance(params, nn.Module):
        return list(params.parameters())
    if isinstance(params, Tensor):
        return [params]
    return list(params)


def leading_n(api: str, tensors: Sequence[Any]) -> int:
    """The leading member dim n that every parameter shares (checked)."""
    if not tensors:
        raise ValueError(f"{api}: `params` is empty; expected at least one stacked tensor")
    if any(not isinstance(t, Tensor) for t in tensors):
        raise TypeError(f"{api}: `params` must hold tensors, got {type(tensors[0]).__name__}")
    if any(t.dim() == 0 for t in tensors):
        raise ValueError(f"{api}: every parameter needs a leading member dim, got a 0-dim tensor")
    sizes = sorted({t.shape[0] for t in tensors})
    if len(sizes) != 1:
        raise ValueError(
            f"{api}: all parameters must share the leading member dim n, got sizes {sizes}"
        )
    return sizes[0]
