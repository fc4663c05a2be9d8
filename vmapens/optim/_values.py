"""MemberValues: a per-member hyperparameter that torch's LR schedulers update member by member."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

__all__ = ["MemberValues"]


class MemberValues:
    """An immutable per-member hyperparameter: one Python float per member.

    ``group["lr"]`` holds one of these when learning rates differ across members. It is not
    a Tensor on purpose: torch's LR schedulers ``fill_`` tensor learning rates with a single
    value, but apply plain arithmetic to anything else, so elementwise float arithmetic here
    gives each member exactly the float its own scheduler on a plain Adam would compute.

    Args:
        values: One float per member.
    """

    __slots__ = ("nonzero", "positive", "tensor", "values")

    values: tuple[float, ...]
    tensor: Tensor
    #: Whether any value is != 0 (> 0): what an optimizer's state depends on (a momentum
    #: buffer). One bool, so that a compiled step guards on it, not on every value.
    nonzero: bool
    positive: bool

    def __init__(self, values: Iterable[float]) -> None:
        object.__setattr__(self, "values", tuple(float(v) for v in values))
        # What the optimizer reads: a compiled step sees a tensor input, not n constants, so a
        # scheduler changing the values does not trigger a recompile.
        object.__setattr__(self, "tensor", torch.tensor(self.values, dtype=torch.float64))
        object.__setattr__(self, "nonzero", any(v != 0 for v in self.values))
        object.__setattr__(self, "positive", any(v > 0 for v in self.values))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("MemberValues is immutable")

    def __reduce__(self) -> tuple[Any, ...]:
        return (MemberValues, (self.values,))

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, i: int) -> float:
        return self.values[i]

    def __setitem__(self, i: int, value: float) -> None:
        raise TypeError(
            "MemberValues is immutable: set a new one for all members, "
            "group['lr'] = MemberValues([...]) (one float per member)"
        )

    def __iter__(self) -> Iterator[float]:
        return iter(self.values)

    def __repr__(self) -> str:
        return f"MemberValues({list(self.values)})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MemberValues) and self.values == other.values

    def __hash__(self) -> int:
        return hash(self.values)

    def __float__(self) -> float:
        # float() of n values raised Python's "must be a string or a real number", which did
        # not say why: torch's ReduceLROnPlateau reads one lr per param group this way.
        raise TypeError(
            f"MemberValues: {len(self.values)} values, one per member, have no single float "
            "value; torch's ReduceLROnPlateau reads one learning rate per param group: use "
            "vmapens.optim.ReduceLROnPlateau, which takes one metric per member"
        )

    def tolist(self) -> list[float]:
        """Return the values as a list of floats."""
        return list(self.values)

    def _map(self, other: Any, op: Callable[[float, Any], Any]) -> MemberValues:
        if isinstance(other, MemberValues):
            return MemberValues(op(a, b) for a, b in zip(self.values, other.values, strict=True))
        if isinstance(other, list | tuple) or (isinstance(other, Tensor) and other.dim() == 1):
            # One value per member (a scheduler lambda returning a tensor of factors, a list
            # `eta_min`): member i's with its own, as a float, as its scheduler alone would
            given = other.tolist() if isinstance(other, Tensor) else list(other)
            if len(given) != len(self.values):
                raise ValueError(
                    f"MemberValues: {len(given)} values met {len(self.values)}, one per member"
                )
            return MemberValues(op(a, float(b)) for a, b in zip(self.values, given, strict=True))
        if isinstance(other, Tensor) and other.dim() == 0:
            # A tensor lr's base value (torch's schedulers keep `initial_lr` as a 0-d clone).
            other = other.detach()
        elif not isinstance(other, numbers.Real):  # numpy's floats are Real
            return NotImplemented
        # Each member as its own scheduler computes it, `float op other`: a numpy float32 or a
        # float32 tensor rounds the result as it does there.
        return MemberValues(op(a, other) for a in self.values)

    def __add__(self, o: Any) -> MemberValues:
        return self._map(o, lambda a, b: a + b)

    def __radd__(self, o: Any) -> MemberValues:
        return self._map(o, lambda a, b: b + a)

    def __sub__(self, o: Any) -> MemberValues:
        return self._map(o, lambda a, b: a - b)

    def __rsub__(self, o: Any) -> MemberValues:
        return self._map(o, lambda a, b: b - a)

    def __mul__(self, o: Any) -> MemberValues:
        return self._map(o, lambda a, b: a * b)

    def __rmul__(self, o: Any) -> MemberValues:
        return self._map(o, lambda a, b: b * a)

    def __truediv__(self, o: Any) -> MemberValues:
        return self._map(o, lambda a, b: a / b)

    def __rtruediv__(self, o: Any) -> MemberValues:
        return self._map(o, lambda a, b: b / a)

    def __neg__(self) -> MemberValues:
        return MemberValues(-a for a in self.values)


# State dicts (optimizer and scheduler) hold MemberValues; let weights_only torch.load read them.
torch.serialization.add_safe_globals([MemberValues])
