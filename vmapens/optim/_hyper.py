"""Per-member hyperparameters: their table entries, their checks, and torch's implementation flags
(the values an update reads from them: ``_columns.py``)."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .._checks import module_params
from ._values import MemberValues

__all__ = [
    "BETAS",
    "EPS",
    "FREE_ON_LOAD",
    "LR",
    "MOMENTUM",
    "NONNEGATIVE",
    "UNIT",
    "WEIGHT_DECAY",
    "any_nonzero",
    "any_positive",
    "as_member_values",
    "Hyper",
    "Params",
    "PerMember",
    "Scalar",
    "check_hyper",
    "check_hypers",
    "group_args",
    "local_values",
    "member_floats",
    "leading_n",
    "nonnegative",
    "params_of",
    "per_member",
    "pick_group",
    "unnamed",
]

#: Hyperparameters a state dict may hold outside the constructor's range, loaded as torch
#: loads them: torch's schedulers set them (a linear one-cycle ends a little below lr 0).
FREE_ON_LOAD = ("lr",)
#: A hyperparameter as a rule reads it: a float, a float64 ``[n]`` tensor (per member) or a
#: 0-d tensor (a tensor ``lr``, kept in its dtype as torch keeps it).
Scalar = float | Tensor
#: A hyperparameter as a constructor takes it: shared, or one value per member.
PerMember = float | Sequence[float] | Tensor
#: What a constructor's ``params`` takes.
Params = Iterable[Tensor] | Iterable[dict[str, Any]] | nn.Module


@dataclasses.dataclass(frozen=True)
class Hyper:
    """A per-member hyperparameter: its torch error wording, rule and check.

    ``pair=True`` for a tuple of two values such as Adam's ``betas``; ``tensor=True`` where
    torch keeps a 0-d tensor as it is and computes with it in its dtype (``lr``);
    ``none_first=True`` where a pair's first may be None (Adafactor's ``eps``).
    """

    what: str
    rule: str
    ok: Callable[[float], bool]
    pair: bool = False
    tensor: bool = False
    none_first: bool = False


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


def check_hyper(
    api: str, name: str, value: Any, hyper: Hyper, n: int, where: str = "", ranges: bool = True
) -> float | MemberValues:
    """A float (shared) or n values (per member), checked against ``hyper``'s rule (its type
    and length only without ``ranges``).

    A 0-d tensor stays as it is where ``hyper.tensor`` (torch computes with it in its dtype);
    elsewhere it, and every 1-D tensor, is read as its float values.
    """
    if not ranges:
        hyper = dataclasses.replace(hyper, ok=lambda v: True)
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


def check_hypers(
    api: str,
    group: dict[str, Any],
    hypers: dict[str, Hyper],
    n: int,
    local: Callable[[Any], Any],
    free: Collection[str] = (),
) -> None:
    """Every hyperparameter of ``group`` checked by :func:`check_hyper` and stored as a rule
    reads it: a float, a 0-d tensor ``lr`` or MemberValues, a pair of them for a ``pair``
    entry; those named in ``free`` without their range. ``local`` cuts values given for every
    member to a shard's (:func:`local_values`)."""
    for name, hyper in hypers.items():
        value, ranges = group[name], name not in free
        if hyper.pair:
            value = _as_pair(value, n)
            if not isinstance(value, (tuple, list)) or len(value) != 2:
                raise ValueError(f"{api}: `{name}` must be a pair, got {value!r}")
            group[name] = tuple(
                check_hyper(api, f"{name}[{j}]", local(v), hyper, n, f" at index {j}", ranges)
                for j, v in enumerate(value)
            )
        else:
            group[name] = check_hyper(api, name, local(value), hyper, n, "", ranges)


def _as_pair(value: Any, n: int) -> Any:
    """``value`` as the documented pair of n values each (``betas=(b1s, b2s)``) when it is a
    list of n tuples of two, one pair per member; read the other way, with n = 2 members,
    ``[(0.9, 0.999), (0.8, 0.99)]`` would silently run member 1 with beta1 = 0.999."""
    pairs = isinstance(value, list) and len(value) == n >= 2
    if pairs and all(isinstance(v, tuple) and len(v) == 2 for v in value):
        return tuple(list(v) for v in zip(*value, strict=True))
    return value


def _checked(api: str, name: str, vals: list[float], hyper: Hyper, where: str, out: Any) -> Any:
    for v in vals:
        if not hyper.ok(v):
            raise ValueError(
                f"{api}: Invalid {hyper.what}{where}: {v} (`{name}` must be {hyper.rule})"
            )
    return out


def local_values(value: Any, block: Sequence[int] | None, n_total: int) -> Any:
    """This block's values of a per-member hyperparameter given for all n_total members;
    numpy values as Python ones (:func:`_plain`)."""
    value = _plain(value)
    sized = isinstance(value, (Sequence, MemberValues)) and not isinstance(value, str)
    sized = sized or isinstance(value, Tensor) and value.dim() == 1
    if block is None or not sized or len(value) != n_total:
        return value
    return [value[i] for i in block]


def _plain(value: Any) -> Any:
    """A numpy scalar as a float and a numpy array of at most one dim as its floats: torch's
    optimizers take ``lr=np.float32(1e-3)``, and a sweep's values often come from
    ``np.logspace``. Anything else as it is."""
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, int, float)):
        return float(value)  # np.float32, np.int64 (np.float64 is a float already)
    numpy_array = not isinstance(value, Tensor) and hasattr(value, "__array__")
    if numpy_array and getattr(value, "ndim", 2) <= 1 and hasattr(value, "tolist"):
        return value.tolist()  # 0-d: a float; 1-D: a list
    return value


def group_args(
    group: dict[str, Any], hypers: dict[str, Hyper], device: torch.device, *, api: str, n: int
) -> dict[str, Any]:
    """The group with MemberValues as float64 tensors on ``device``: what update_ reads.

    Raises:
        TypeError: a value set in ``group`` after construction (a schedule's edit) is not a
            float, a tensor or ``MemberValues`` (a list of per-member values, None, a bool).
        ValueError: ``MemberValues`` that are not one per member.
    """

    def arg(name: str, v: Any, none: bool = False) -> Any:
        v = as_member_values(v)
        if isinstance(v, MemberValues):
            if len(v) != n:
                raise ValueError(
                    f"{api}: param group `{name}` has {len(v)} values, expected n={n}, one "
                    "per member"
                )
            return v.tensor.to(device)
        if isinstance(v, Tensor):
            return v.to(device)
        if (v is None and none) or (isinstance(v, (int, float)) and not isinstance(v, bool)):
            return v  # None: Adafactor's eps[0]
        if isinstance(v, numbers.Real):  # np.float32, set by a schedule of the user's own
            return float(v)
        raise TypeError(
            f"{api}: param group `{name}` must be a float, a tensor or "
            f"vmapens.optim.MemberValues (one float per member), got {type(v).__name__}"
        )

    out = dict(group)
    for name, hyper in hypers.items():
        value = group[name]
        if hyper.pair:
            value = _as_pair(value, n)
            if not isinstance(value, (tuple, list)) or len(value) != 2:
                raise TypeError(f"{api}: param group `{name}` must be a pair, got {value!r}")
            out[name] = tuple(
                arg(f"{name}[{j}]", v, hyper.none_first and j == 0) for j, v in enumerate(value)
            )
        else:
            out[name] = arg(name, value)
    return out


def pick_group(group: dict[str, Any], hypers: dict[str, Hyper], rows: list[int]) -> dict[str, Any]:
    """``group``'s options with each per-member value cut to ``rows`` (a float for one row).

    Every ``MemberValues`` in the group is cut, not only the hyperparameters': torch's
    schedulers keep their own per-group values there (``initial_lr``, OneCycleLR's ``max_lr``
    and ``min_lr``, CyclicLR's momenta), which a scheduler built on the new optimizer reads as
    its members' base values.
    """

    def pick(v: Any) -> Any:
        if isinstance(v, Tensor) and v.dim() == 1:  # one value per member (docs/optim.md)
            return float(v[rows[0]]) if len(rows) == 1 else v.detach()[rows].clone()
        if isinstance(v, Tensor):  # a tensor lr: each optimizer gets its own, as torch's has
            return v.detach().clone()
        if isinstance(v, tuple) and any(isinstance(x, MemberValues) for x in v):
            return tuple(pick(x) for x in v)
        if not isinstance(v, MemberValues):
            return v
        return v[rows[0]] if len(rows) == 1 else MemberValues(v[r] for r in rows)

    out = {k: pick(v) for k, v in group.items() if k != "params"}
    for name, hyper in hypers.items():
        out[name] = tuple(pick(v) for v in group[name]) if hyper.pair else pick(group[name])
    return out


def as_member_values(v: Any) -> Any:
    """A param group's value as the step reads it: a 1-D tensor (set after building) as
    ``MemberValues``, one value per member, as when built; anything else as it is."""
    return MemberValues(v.tolist()) if isinstance(v, Tensor) and v.dim() == 1 else v


def any_nonzero(v: Any) -> bool:
    """Whether any member's value of a hyperparameter is != 0.

    Read from ``MemberValues.nonzero``, not from the values: a compiled step then guards on
    that bool alone, and a schedule that changes the values (OneCycleLR's momentum) does not
    recompile it every step.
    """
    if isinstance(v, Tensor) and v.dim() == 1:  # one value per member, set after building
        return bool((v != 0).any())
    return v.nonzero if isinstance(v, MemberValues) else v != 0


def any_positive(v: Any) -> bool:
    """Whether any member's value of a hyperparameter is > 0 (as :func:`any_nonzero`)."""
    if isinstance(v, Tensor) and v.dim() == 1:
        return bool((v > 0).any())
    return v.positive if isinstance(v, MemberValues) else v > 0


def member_floats(v: Any) -> list[float]:
    """A hyperparameter's values: one per member (MemberValues), or the shared float alone."""
    return list(v) if not isinstance(v, (int, float)) else [float(v)]


def per_member(value: Any, n: int) -> list[float] | None:
    """A hyperparameter's value for each of the ``n`` members: ``MemberValues``' values, a
    1-D tensor's of ``n`` values, a number ``n`` times; ``None`` for anything else, a 0-d
    tensor too (one value every member shares, which torch's schedulers ``fill_``)."""
    if isinstance(value, MemberValues):
        return value.tolist()
    if isinstance(value, Tensor):
        return value.tolist() if value.dim() == 1 and len(value) == n else None
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return [float(value)] * n
    return None


def params_of(params: Any, api: str = "StackedOptimizer") -> list[Any]:
    """What an optimizer's ``params`` argument holds: an Ensemble's parameters, a tensor, or
    an iterable of tensors or param-group dicts."""
    if isinstance(params, nn.Module):
        return module_params(api, params, "params")
    if isinstance(params, Tensor):
        return [params]
    return list(params)


def unnamed(params: Sequence[Any]) -> list[Any]:
    """``params`` with each ``(name, tensor)`` pair (``named_parameters()``, which torch's
    optimizers take since 2.6, keeping the names as ``param_names``) as its tensor."""
    return [p[1] if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) else p
            for p in params]  # fmt: skip


def leading_n(api: str, tensors: Sequence[Any], n: int | None = None) -> int:
    """The leading member dim n that every parameter shares (checked; ``n`` if given);
    ``(name, tensor)`` pairs count as their tensors."""
    tensors = unnamed(tensors)
    if not tensors:
        raise ValueError(f"{api}: `params` is empty; expected at least one stacked tensor")
    if any(not isinstance(t, Tensor) for t in tensors):
        raise TypeError(f"{api}: `params` must hold tensors, got {type(tensors[0]).__name__}")
    if any(t.is_meta for t in tensors):  # ens.template's: no values, never a gradient
        msg = "holds a meta tensor (ens.template's?); pass the ensemble's: ens.get_parameter(name)"
        raise ValueError(f"{api}: `params` {msg}")
    if any(t.dim() == 0 for t in tensors):
        raise ValueError(f"{api}: every parameter needs a leading member dim, got a 0-dim tensor")
    first: dict[int, int] = {}
    for j, t in enumerate(tensors):
        if first.setdefault(id(t), j) != j:
            # torch steps such a tensor once per listing (and warns that this will be an
            # error); one stacked step per tensor would end elsewhere without a word.
            raise ValueError(
                f"{api}: `params` holds the same tensor twice (at {first[id(t)]} and {j}); "
                "list each parameter once"
            )
    sizes = sorted({t.shape[0] for t in tensors} | ({n} if n is not None else set()))
    if len(sizes) != 1:
        raise ValueError(
            f"{api}: all parameters must share the leading member dim n, got sizes {sizes}"
        )
    return sizes[0]


def check_grads(api: str, params: Sequence[Tensor], grads: Sequence[Tensor | None]) -> None:
    """One gradient (or ``None``) per parameter, each of its parameter's shape and gradient
    dtype (``p.grad_dtype``: its dtype unless set; ``None`` takes any), as ``p.grad = g``
    asks."""
    if len(grads) != len(params):
        raise ValueError(
            f"{api}: `grads` has {len(grads)} entries, expected {len(params)} (one per parameter)"
        )
    for k, (p, g) in enumerate(zip(params, grads, strict=True)):
        if g is None:
            continue
        # grad_dtype read only on a mismatch: dynamo cannot trace that attribute.
        want = p.dtype if g.dtype == p.dtype else getattr(p, "grad_dtype", p.dtype)
        if g.shape != p.shape or g.dtype != (want or g.dtype):
            raise ValueError(
                f"{api}: `grads[{k}]` is {list(g.shape)} {g.dtype}, expected its parameter's "
                f"{list(p.shape)} {want or g.dtype}"
            )
