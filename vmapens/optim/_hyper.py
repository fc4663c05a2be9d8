"""Per-member hyperparameters: their table entries, checks, and the values an update reads."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .._checks import column
from ._values import MemberValues

__all__ = [
    "signed",
    "added",
    "lerped",
    "weight_decayed",
    "decayed_writes",
    "moments_",
    "moment_writes",
    "host_scalars",
    "BETAS",
    "EPS",
    "LR",
    "MOMENTUM",
    "NONNEGATIVE",
    "UNIT",
    "WEIGHT_DECAY",
    "Hyper",
    "Params",
    "PerMember",
    "Scalar",
    "IMPLEMENTATION",
    "check_hyper",
    "check_implementation",
    "implementation_flags",
    "group_args",
    "like",
    "local_values",
    "member_column",
    "member_columns",
    "member_floats",
    "leading_n",
    "nonnegative",
    "params_of",
    "pick_group",
]

#: A hyperparameter as a rule reads it: a float, a float64 ``[n]`` tensor (per member) or a
#: 0-d tensor (a tensor ``lr``, kept in its dtype as torch keeps it).
Scalar = float | Tensor
#: A hyperparameter as a constructor takes it: shared, or one value per member.
PerMember = float | Sequence[float] | Tensor
#: What a constructor's ``params`` takes.
Params = Iterable[Tensor] | Iterable[dict[str, Any]] | nn.Module
_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class Hyper:
    """A per-member hyperparameter: its torch error wording, rule and check.

    ``pair=True`` for a tuple of two values such as Adam's ``betas``; ``tensor=True`` where
    torch keeps a 0-d tensor as it is and computes with it in its dtype (``lr``).
    """

    what: str
    rule: str
    ok: Callable[[float], bool]
    pair: bool = False
    tensor: bool = False


def nonnegative(what: str, tensor: bool = False) -> Hyper:
    """A hyperparameter that must be >= 0; ``what`` is torch's word for it in errors."""
    return Hyper(what, ">= 0", lambda v: v >= 0, tensor=tensor)


NONNEGATIVE = nonnegative("value")
UNIT = Hyper("value", "in [0, 1)", lambda v: 0 <= v < 1)
# The entries most optimizers share, worded as torch words its errors.
LR = nonnegative("learning rate", tensor=True)
BETAS = Hyper("beta parameter", "in [0, 1)", UNIT.ok, pair=True)
EPS = nonnegative("epsilon value")
WEIGHT_DECAY = nonnegative("weight_decay value")
MOMENTUM = nonnegative("momentum value")


def member_column(x: Scalar, like: Tensor) -> Scalar:
    """A hyperparameter as the update rule uses it: a float, or ``[n, 1, ...]`` for ``like``.

    Low-precision parameters take float32 columns: in-place ops compute in the promoted dtype.
    A 0-d tensor becomes ``[1, 1, ...]`` (shared by every member).
    """
    return _column(x, like) if isinstance(x, Tensor) else x


def _column(x: Tensor, like: Tensor) -> Tensor:
    x = x.to(torch.float32 if like.dtype in _LOW_PRECISION else like.dtype)
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
    if not isinstance(x, Tensor):
        return x
    made: dict[tuple[torch.dtype, int], Tensor] = {}
    out = []
    for t in like:
        key = (t.dtype, t.dim())
        if key not in made:
            made[key] = _column(x, t)
        out.append(made[key])
    return out


def add_scaled(x: Sequence[Tensor], y: Sequence[Tensor], s: Scalar) -> list[Tensor]:
    """``x + s * y`` rounded once, as torch's ``x.add(y, alpha=s)``: a float ``s`` as ``alpha``,
    a tensor one (per member, or a 0-d ``lr``) as ``addcmul`` with its columns."""
    if isinstance(s, Tensor):
        columns = [_column(s, t) for t in x]
        return list(torch._foreach_addcmul(list(x), list(y), columns))
    return list(torch._foreach_add(list(x), list(y), alpha=s))


def added(x: list[Tensor], y: Any, s: Scalar) -> Callable[[], Any]:
    """``x += s * y`` rounded once, as a write phase's write (:func:`add_scaled` in place): a
    float ``s`` as ``alpha``, a tensor one as ``addcmul_`` with its columns."""
    if isinstance(s, Tensor):
        return functools.partial(torch._foreach_addcmul_, x, y, member_columns(s, like=x))
    return functools.partial(torch._foreach_add_, x, y, alpha=s)


def lerped(x: list[Tensor], y: Any, weight: Any) -> Callable[[], Any]:
    """``x.lerp_(y, weight)`` for every tensor of ``x``, as a write phase's write: one
    ``torch._foreach_lerp_``, but one ``lerp_`` per tensor for per-member columns when
    compiling, which inductor fuses into the step's kernels (it has no lowering for the
    foreach form with tensor weights, and ran it as a separate call, 62 us of workload A's
    1.3 ms step at N = 1024)."""
    if torch.compiler.is_compiling() and isinstance(weight, list):
        return functools.partial(_lerp_each_, x, y, weight)
    return functools.partial(torch._foreach_lerp_, x, y, weight)


def _lerp_each_(x: list[Tensor], y: Sequence[Tensor], weight: list[Tensor]) -> None:
    for a, b, w in zip(x, y, weight, strict=True):
        a.lerp_(b, w)


def like(hyper: Scalar, value: Tensor) -> Tensor:
    """A float64 per-member scalar (from the step counts) as torch's Python float meets
    ``hyper``: in a tensor hyperparameter's dtype, where torch computes ``lr / bias_correction``
    (a 0-d float32 ``lr``: in float32, the float rounded first), else float64 as it is."""
    return value.to(hyper.dtype) if isinstance(hyper, Tensor) else value


def check_hyper(
    api: str, name: str, value: Any, hyper: Hyper, n: int, where: str = ""
) -> float | MemberValues:
    """A float (shared) or n values (per member), checked against ``hyper``'s rule.

    A 0-d tensor stays as it is where ``hyper.tensor`` (torch computes with it in its dtype);
    elsewhere it, and every 1-D tensor, is read as its float values.
    """
    if isinstance(value, Tensor) and value.dim() == 0 and hyper.tensor:
        if not value.is_floating_point():
            raise TypeError(
                f"{api}: `{name}` as a tensor must be floating point, got {value.dtype}"
            )
        return _checked(api, name, [float(value.item())], hyper, where, value)
    if isinstance(value, Tensor):
        if value.dim() > 1:
            raise ValueError(
                f"{api}: `{name}` must be a float or 1-D, got shape {tuple(value.shape)}"
            )
        value = value.item() if value.dim() == 0 else value.tolist()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return _checked(api, name, [float(value)], hyper, where, float(value))
    if isinstance(value, (Sequence, MemberValues)) and not isinstance(value, str):
        if len(value) != n:
            raise ValueError(
                f"{api}: `{name}` has {len(value)} values, expected n={n}, one per member"
            )
        vals = [float(v) for v in value]
        return _checked(api, name, vals, hyper, where, MemberValues(vals))
    raise TypeError(
        f"{api}: `{name}` must be a float or a sequence/1-D tensor of n={n} floats, "
        f"got {type(value).__name__}"
    )


def _checked(api: str, name: str, vals: list[float], hyper: Hyper, where: str, out: Any) -> Any:
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
    group: dict[str, Any], hypers: dict[str, Hyper], device: torch.device, *, api: str, n: int
) -> dict[str, Any]:
    """The group with MemberValues as float64 tensors on ``device``: what update_ reads.

    Raises:
        TypeError: a value set in ``group`` after construction (a schedule's edit) is not a
            float, a tensor or ``MemberValues`` (a list of per-member values, say).
        ValueError: ``MemberValues`` that are not one per member.
    """

    def arg(name: str, v: Any) -> Any:
        if isinstance(v, MemberValues):
            if len(v) != n:
                raise ValueError(
                    f"{api}: param group `{name}` has {len(v)} values, expected n={n}, one "
                    "per member"
                )
            return v.tensor.to(device)
        if isinstance(v, Tensor):
            return v.to(device)
        if v is not None and not isinstance(v, (int, float)):  # None: Adafactor's eps
            raise TypeError(
                f"{api}: param group `{name}` must be a float, a tensor or "
                f"vmapens.optim.MemberValues (one float per member), got {type(v).__name__}"
            )
        return v

    out = dict(group)
    for name, hyper in hypers.items():
        value = group[name]
        if hyper.pair:
            if not isinstance(value, (tuple, list)) or len(value) != 2:
                raise TypeError(f"{api}: param group `{name}` must be a pair, got {value!r}")
            out[name] = tuple(arg(f"{name}[{j}]", v) for j, v in enumerate(value))
        else:
            out[name] = arg(name, value)
    return out


def pick_group(group: dict[str, Any], hypers: dict[str, Hyper], rows: list[int]) -> dict[str, Any]:
    """``group``'s options with each per-member value cut to ``rows`` (a float for one row)."""

    def pick(v: Any) -> Any:
        if isinstance(v, Tensor):  # a tensor lr: each optimizer gets its own, as torch's has
            return v.detach().clone()
        if not isinstance(v, MemberValues):
            return v
        return v[rows[0]] if len(rows) == 1 else MemberValues(v[r] for r in rows)

    out = {k: v for k, v in group.items() if k != "params"}
    for name, hyper in hypers.items():
        out[name] = tuple(pick(v) for v in group[name]) if hyper.pair else pick(group[name])
    return out


#: torch's implementation flags: the values that change nothing here, and why the others would.
IMPLEMENTATION: dict[str, tuple[tuple[bool | None, ...], str]] = {
    "foreach": ((None, True, False), ""),
    "fused": ((None, True, False), ""),
    "capturable": (
        (False,),
        "the update reads step counts on the host for torch's fused kernels and rolls back "
        "a failed step, which CUDA-graph capture cannot replay",
    ),
    "differentiable": (
        (False,),
        "the update runs in place under torch.no_grad (masks and rollback copy rows back), "
        "so no autograd graph flows through a step",
    ),
}


def implementation_flags(torch_class: type | None) -> tuple[str, ...]:
    """The implementation flags ``torch_class``'s constructor takes (none without a twin)."""
    if torch_class is None:
        return ()
    accepted = inspect.signature(torch_class).parameters
    return tuple(flag for flag in IMPLEMENTATION if flag in accepted)


def check_implementation(api: str, flags: tuple[str, ...], given: dict[str, Any]) -> None:
    """Check torch's implementation flags in ``given`` (a group) against what ``flags`` allows.

    Raises:
        TypeError: a flag torch's twin does not take, or a value that is not a bool/None.
        ValueError: a value that would change results (``differentiable=True``, ...).
    """
    for flag, value in given.items():
        if flag not in flags:
            raise TypeError(f"{api}: unexpected keyword argument `{flag}`")
        allowed, why = IMPLEMENTATION[flag]
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{api}: `{flag}` must be a bool or None, got {value!r}")
        if value not in allowed:
            raise ValueError(f"{api}: `{flag}={value}` is not supported: {why}")
    if given.get("foreach") is True and given.get("fused") is True:
        raise ValueError(f"{api}: `fused` and `foreach` cannot both be True (torch refuses it too)")


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


def host_scalars(params: Sequence[Tensor], values: Sequence[Any]) -> bool:
    """Whether a rule may take torch's foreach form with Python float scalars.

    That form reads one step count on the host per call (``run_fused``: one call per count
    over the whole tensors, so a member's bits never depend on another's count). It may when
    every member shares the hyperparameters ``values`` (floats, not per-member tensors), the
    parameters are CPU tensors (a host read costs no device sync) and no ``torch.compile``
    trace is running; the choice depends on this configuration only.
    """
    if torch.compiler.is_compiling() or any(isinstance(v, Tensor) for v in values):
        return False
    return all(p.device.type == "cpu" for p in params)


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
        torch._foreach_mul_(params, member_columns(1 - lr * wd, params))
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
    scale = member_columns(1 - lr * wd, params)
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
        functools.partial(torch._foreach_mul_, exp_avg_sq, col(beta2)),
        functools.partial(torch._foreach_addcmul_, exp_avg_sq, grads, g2, value=value),
    ]
