"""Per-member dynamic loss scale for fp16: one ``torch.amp.GradScaler`` per member."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ._checks import column, is_int

__all__ = ["LossScale"]


class LossScale:
    """Per-member dynamic loss scale: ``n`` ``torch.amp.GradScaler`` s, one per member.

    Member ``i``'s loss is multiplied by ``scale[i]`` before the backward pass and its gradients
    divided by it after. A member whose gradients are not all finite skips its optimizer step
    and has its scale multiplied by ``backoff_factor``; a member that stepped
    ``growth_interval`` times in a row has it multiplied by ``growth_factor``. The arithmetic
    is ``GradScaler``'s (``torch._amp_update_scale_``), member by member.

    Args:
        n: number of members.
        init_scale: every member's first scale (GradScaler's default).
        growth_factor: scale multiplier after ``growth_interval`` finite steps.
        backoff_factor: scale multiplier after a step with non-finite gradients.
        growth_interval: finite steps in a row before the scale grows.
        device: where the ``[n]`` scale and growth tracker live.

    Example:
        >>> ls = LossScale(3, init_scale=8.0)
        >>> ls.update_(torch.tensor([False, True, False]))
        >>> ls.scale
        tensor([8., 4., 8.])
    """

    def __init__(
        self,
        n: int,
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        device: torch.device | str | None = None,
    ) -> None:
        api = "LossScale"
        if not is_int(n) or n < 1:
            raise ValueError(f"{api}: `n` must be an int >= 1 (the number of members), got {n!r}")
        _check_options(api, init_scale, growth_factor, backoff_factor, growth_interval)
        self.init_scale = float(init_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.scale = torch.full((n,), float(init_scale), dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros(n, dtype=torch.int32, device=device)

    def __repr__(self) -> str:
        # The options, not the running scales: fit's resume check compares its arguments by
        # repr, and a run's LossScale has moved on from the one a rerun script builds.
        return (
            f"LossScale({self.scale.shape[0]}, init_scale={self.init_scale!r}, "
            f"growth_factor={self.growth_factor!r}, backoff_factor={self.backoff_factor!r}, "
            f"growth_interval={self.growth_interval!r})"
        )

    def unscale_(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Divide each member's gradients by its scale in place; True where any is non-finite."""
        half = next((g for g in grads if g.dtype == torch.float16), None)
        if half is not None:
            # GradScaler.unscale_ refuses them too: a gradient divided by 2**16 in float16 is
            # mostly subnormal or zero, which no member alone would be trained with.
            raise ValueError(
                "LossScale: cannot unscale float16 gradients (torch.amp.GradScaler refuses them "
                "too); keep the parameters float32 with `precision='fp16'` (autocast computes in "
                "float16) or train float16 parameters with `precision=None`"
            )
        inv = self.scale.double().reciprocal().float()  # as GradScaler.unscale_ computes it
        found = torch.zeros_like(self.scale, dtype=torch.bool)
        for g in grads:
            found = found | ~torch.isfinite(g).reshape(g.shape[0], -1).all(dim=1)
        # The float32 inverse, not one rounded to a bf16 gradient's dtype first: GradScaler's
        # kernel multiplies in float32 and rounds once (a scale of 3 rounded twice flips ulps).
        torch._foreach_mul_(grads, [column(inv, g) for g in grads])
        return found

    def update_(self, found_inf: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Back off where ``found_inf``, count (and maybe grow) elsewhere; ``mask`` False: frozen."""
        grown = self.growth_tracker + 1
        grow = ~found_inf & (grown == self.growth_interval)
        # float32 * double rounded to float32, and no growth to inf: _amp_update_scale_'s rule.
        bigger = (self.scale.double() * self.growth_factor).float()
        smaller = (self.scale.double() * self.backoff_factor).float()
        scale = torch.where(grow & torch.isfinite(bigger), bigger, self.scale)
        scale = torch.where(found_inf, smaller, scale)
        tracker = torch.where(found_inf | grow, 0, grown).to(torch.int32)
        if mask is not None:
            scale = torch.where(mask, scale, self.scale)
            tracker = torch.where(mask, tracker, self.growth_tracker)
        self.scale.copy_(scale)
        self.growth_tracker.copy_(tracker)

    def state_dict(self) -> dict[str, Any]:
        """The ``[n]`` scales and growth trackers and the options, on the CPU."""
        return {
            "scale": self.scale.cpu().clone(),
            "growth_tracker": self.growth_tracker.cpu().clone(),
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load ``state_dict()`` (checked first; nothing changes on error)."""
        api, n = "LossScale.load_state_dict", self.scale.shape[0]
        if not isinstance(state, dict):
            raise TypeError(f"{api}: `state` must be a dict from LossScale.state_dict()")
        missing = [k for k in (*_TENSORS, *_OPTIONS) if k not in state]
        if missing:
            raise ValueError(f"{api}: `state` lacks {missing}; pass LossScale.state_dict()")
        for key, (dtypes, ok, rule) in _TENSORS.items():
            t = state[key]
            if (
                not isinstance(t, torch.Tensor)
                or tuple(t.shape) != (n,)
                or t.dtype not in dtypes
                or not bool(ok(t).all())
            ):
                raise ValueError(f"{api}: `{key}` must be a tensor of shape [{n}] with {rule}")
        _check_options(api, 1.0, *(state[k] for k in _OPTIONS))
        self.scale.copy_(state["scale"])
        self.growth_tracker.copy_(state["growth_tracker"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])


_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INTS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
#: The tensors of a LossScale's state: (dtypes, check, what the check asks for).
#: Checked as stored: a float64 scale of 1e39 becomes float32 inf (every step then skipped and
#: the scale stuck), 1e-50 becomes 0, a tracker of 2**32 wraps to 0 in int32.
_TENSORS: dict[str, tuple[tuple[torch.dtype, ...], Callable[[torch.Tensor], Any], str]] = {
    "scale": (
        _FLOATS,
        lambda t: torch.isfinite(t.float()) & (t.float() > 0),
        "values finite and > 0 in float32",
    ),
    "growth_tracker": (
        _INTS,
        lambda t: (t >= 0) & (t <= torch.iinfo(torch.int32).max),
        "integer values in [0, 2**31 - 1]",
    ),
}
_OPTIONS = ("growth_factor", "backoff_factor", "growth_interval")


def _check_options(
    api: str, init_scale: Any, growth_factor: Any, backoff_factor: Any, growth_interval: Any
) -> None:
    """Raise ``ValueError`` naming the first option GradScaler's rule cannot work with."""

    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    for name, value, ok, rule in (
        (
            "init_scale",
            init_scale,
            # kept in float32, as GradScaler keeps it: 1e39 would be inf there, 1e-50 zero
            number(init_scale) and _positive_float32(init_scale),
            "a finite float > 0, in float32 too",
        ),
        ("growth_factor", growth_factor, number(growth_factor) and growth_factor > 1, "> 1"),
        (
            "backoff_factor",
            backoff_factor,
            number(backoff_factor) and 0 < backoff_factor < 1,
            "in (0, 1)",
        ),
        (
            "growth_interval",
            growth_interval,
            is_int(growth_interval) and growth_interval >= 1,
            "an int >= 1",
        ),
    ):
        if not ok:
            raise ValueError(f"{api}: `{name}` must be {rule}, got {value!r}")


def _positive_float32(value: float) -> bool:
    """Whether ``value`` stays finite and > 0 rounded to float32."""
    as32 = torch.tensor(float(value), dtype=torch.float32)
    return bool(torch.isfinite(as32)) and bool(as32 > 0)
