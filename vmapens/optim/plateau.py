"""ReduceLROnPlateau per member: each member's learning rate follows its own metric."""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .._checks import check_choice, check_mask
from ._hyper import as_member_values
from ._values import MemberValues
from .base import StackedOptimizer

__all__ = ["ReduceLROnPlateau", "plateaus_on"]


class ReduceLROnPlateau:
    """``torch.optim.lr_scheduler.ReduceLROnPlateau`` for every member on its own.

    ``step(metrics)`` takes one value per member; member ``i``'s learning rate, best value,
    bad-epoch count and cooldown evolve exactly as a torch ReduceLROnPlateau would evolve them
    on a plain optimizer fed member ``i``'s values alone. Learning rates become
    :class:`~vmapens.optim.MemberValues` in ``param_groups``. Metrics compare as in torch's: a
    NaN is a bad epoch, and so is an infinity, but for ``-inf`` in mode ``"min"`` (``inf`` in
    ``"max"``), which is an improvement and the new best; ``step(metrics, mask=...)`` leaves the
    members that stopped training out instead, as their own schedulers would no longer be
    stepped (``fit`` passes the members still training).

    Args:
        optimizer: a StackedOptimizer.
        mode: ``"min"`` or ``"max"``.
        factor: multiply the learning rate by this on a plateau.
        patience: epochs without improvement before reducing.
        threshold: the least change that counts as an improvement.
        threshold_mode: ``"rel"`` or ``"abs"``.
        cooldown: epochs to wait after a reduction.
        min_lr: lower bound of every learning rate (float, or one per param group).
        eps: reductions smaller than this are skipped.

    Example:
        >>> import torch
        >>> from vmapens import StackedSGD
        >>> w = torch.zeros(2, 3, requires_grad=True)
        >>> opt = StackedSGD([w], lr=1.0)
        >>> sched = ReduceLROnPlateau(opt, patience=0, factor=0.5)
        >>> sched.step(torch.tensor([1.0, 1.0]))
        >>> sched.step(torch.tensor([0.5, 2.0]))  # member 1 got worse
        >>> opt.param_groups[0]["lr"]
        MemberValues([1.0, 0.5])
    """

    def __init__(
        self,
        optimizer: StackedOptimizer,
        mode: str = "min",
        factor: float = 0.1,
        patience: int = 10,
        threshold: float = 1e-4,
        threshold_mode: str = "rel",
        cooldown: int = 0,
        min_lr: float | Sequence[float] = 0.0,
        eps: float = 1e-8,
    ) -> None:
        api = "ReduceLROnPlateau"
        if not isinstance(optimizer, StackedOptimizer):
            raise TypeError(
                f"{api}: `optimizer` must be a vmapens.StackedOptimizer, got "
                f"{type(optimizer).__name__}; for a plain optimizer use torch's ReduceLROnPlateau"
            )
        if factor >= 1.0:
            raise ValueError(f"{api}: `factor` must be < 1.0, got {factor}")
        check_choice(api, "mode", mode, ("min", "max"))
        check_choice(api, "threshold_mode", threshold_mode, ("rel", "abs"))
        groups = optimizer.param_groups
        # As torch's: a single min_lr also bounds param groups added later; one per group
        # cannot guess the new group's.
        self.default_min_lr: float | None = None
        if not isinstance(min_lr, (int, float)):
            if len(min_lr) != len(groups):
                raise ValueError(
                    f"{api}: expected {len(groups)} values of `min_lr`, got {len(min_lr)}"
                )
            self.min_lrs = [float(v) for v in min_lr]
        else:
            self.default_min_lr = float(min_lr)
            self.min_lrs = [float(min_lr)] * len(groups)
        self.optimizer = optimizer
        self.mode, self.factor, self.patience = mode, factor, patience
        self.threshold, self.threshold_mode = threshold, threshold_mode
        self.cooldown, self.eps = cooldown, eps
        n = optimizer.num_members
        worst = math.inf if mode == "min" else -math.inf
        self.best = [worst] * n
        self.num_bad_epochs = [0] * n
        self.cooldown_counter = [0] * n
        self.last_epoch = 0
        # The dtype of each param group's 0-d tensor lr (by index), once members' lrs differ
        # and it became one float per member: torch keeps filling each member's own tensor,
        # which rounds every new value to it.
        self._lr_dtypes: dict[int, torch.dtype] = {}
        self._last_lr = _lrs(optimizer)
        _BUILT.setdefault(optimizer, weakref.WeakSet()).add(self)

    def _better(self, a: float, best: float) -> bool:
        # torch's comparisons as they are: NaN compares False (a bad epoch), and -inf in "min"
        # ("inf" in "max") beats any finite best, as it does for torch's scheduler.
        if self.mode == "min":
            limit = (
                best * (1 - self.threshold)
                if self.threshold_mode == "rel"
                else best - self.threshold
            )
            return a < limit
        limit = (
            best * (self.threshold + 1) if self.threshold_mode == "rel" else best + self.threshold
        )
        return a > limit

    def step(self, metrics: Tensor | Sequence[float], mask: Tensor | None = None) -> None:
        """Record one value per member and reduce the learning rates of members on a plateau.

        Args:
            metrics: One value per member: a sequence, or a ``[n]`` tensor or numpy array.
            mask: Optional bool ``[n]``: the members this step is for. The others keep their
                best value, bad-epoch count, cooldown and learning rate, as a member's own
                scheduler that is no longer stepped (their ``metrics`` are not read: NaN for
                a member that stopped training).

        Raises:
            TypeError: ``metrics`` is one value (torch's scheduler takes one; this one takes
                one per member) or holds something else than numbers; ``mask`` is not a bool
                tensor.
            ValueError: ``metrics`` does not hold n values; ``mask`` is not ``[n]``.
            RuntimeError: a step that lowers a learning rate, after a param group was added
                to the optimizer and ``min_lr`` was given one value per group (torch's scheduler
                raises it then too); nothing changes.
        """
        api, n = "ReduceLROnPlateau.step", self.optimizer.num_members
        got: Any = metrics
        if isinstance(got, Tensor) or hasattr(got, "__array__"):  # numpy too
            if len(got.shape) != 1:
                raise ValueError(
                    f"{api}: `metrics` needs one value per member, shape [{n}], got shape "
                    f"{list(got.shape)}"
                )
            got = got.tolist()
        if isinstance(got, str) or not isinstance(got, Sequence):
            raise TypeError(
                f"{api}: `metrics` needs one value per member ({n} values), got "
                f"{type(got).__name__}; torch's ReduceLROnPlateau takes one for all"
            )
        if len(got) != n:
            raise ValueError(f"{api}: `metrics` needs {n} values, got {len(got)}")
        check_mask(api, mask, n)
        stepped = [True] * n if mask is None else mask.tolist()
        try:
            values = [float(v) for v in got]
        except (TypeError, ValueError) as err:
            raise TypeError(f"{api}: `metrics` must hold numbers, got {list(got)!r}") from err
        # Every record computed first and kept only once nothing can raise: torch's scheduler
        # checks the param groups only when it reduces (a step without a reduction goes on).
        best, bad, cooldown = (
            list(self.best),
            list(self.num_bad_epochs),
            list(self.cooldown_counter),
        )
        reduce = [False] * n
        for i, current in enumerate(values):
            if not stepped[i]:
                continue
            if self._better(current, best[i]):
                best[i], bad[i] = current, 0
            else:
                bad[i] += 1
            if cooldown[i] > 0:
                cooldown[i] -= 1
                bad[i] = 0
            if bad[i] > self.patience:
                reduce[i], cooldown[i], bad[i] = True, self.cooldown, 0
        groups = self.optimizer.param_groups
        min_lrs = self.min_lrs
        if any(reduce) and len(groups) != len(min_lrs):  # add_param_group since
            if self.default_min_lr is None:
                raise RuntimeError(
                    f"{api}: the optimizer has {len(groups)} param groups, `min_lr` was given "
                    f"for {len(min_lrs)}: a param group was added after the scheduler was "
                    "built; set `min_lrs` to one value per param group"
                )
            min_lrs = [self.default_min_lr] * len(groups)
        self.min_lrs, self.last_epoch = min_lrs, self.last_epoch + 1
        self.best, self.num_bad_epochs, self.cooldown_counter = best, bad, cooldown
        if any(reduce):
            for k, (group, min_lr) in enumerate(zip(groups, self.min_lrs, strict=True)):
                self._reduce(k, group, reduce, min_lr)
        self._last_lr = _lrs(self.optimizer)

    def _reduce(self, k: int, group: dict[str, Any], reduce: list[bool], min_lr: float) -> None:
        """Lower the learning rates of the members in ``reduce``, as torch's scheduler lowers
        a group's: ``max(float(lr) * factor, min_lr)`` unless that changes it by <= eps."""
        lr, n = group["lr"], len(reduce)
        values = as_member_values(lr)  # a 1-D tensor set by hand: one value per member
        old = [float(v) for v in values] if isinstance(values, MemberValues) else [float(lr)] * n
        new = [max(v * self.factor, min_lr) for v in old]
        lower = [r and v - w > self.eps for r, v, w in zip(reduce, old, new, strict=True)]
        if isinstance(lr, Tensor) and lr.dim() == 0 and len(set(lower)) == 1:
            # Every member alike: torch fills a tensor lr in place and computes on with it.
            if lower[0]:
                lr.fill_(new[0])
            return
        if isinstance(lr, Tensor):
            self._lr_dtypes[k] = lr.dtype
        if k in self._lr_dtypes:  # each member's tensor lr rounds its new value (float32: 5e-10)
            new = torch.tensor(new, dtype=self._lr_dtypes[k]).tolist()
        # One float per member, not a 1-D tensor: torch's other schedulers fill_ a tensor lr
        # with one value (a 1-D one raises), and compute on anything else member by member.
        group["lr"] = MemberValues(w if c else v for v, w, c in zip(old, new, lower, strict=True))

    def get_last_lr(self) -> list[Any]:
        """The learning rate of each param group after the last ``step`` (``MemberValues``
        where members differ), as torch's ``get_last_lr``."""
        return self._last_lr

    def state_dict(self) -> dict[str, Any]:
        """Everything but the optimizer, as plain values, copied: later steps leave it as it
        is (the per-member records are lists this scheduler updates in place)."""
        # _last_lr is the optimizer's to hold: a sharded checkpoint keeps one rank's
        # per-member values here, so load_state_dict reads it from the optimizer again.
        return {
            k: (list(v) if isinstance(v, list) else v)
            for k, v in self.__dict__.items()
            if k not in ("optimizer", "_last_lr")
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()`` (checked first; the optimizer's state loaded before it,
        as for torch's schedulers)."""
        # default_min_lr, _lr_dtypes: not in state dicts written before they were kept.
        missing = set(self.state_dict()) - set(state) - {"default_min_lr", "_lr_dtypes"}
        if missing:
            raise ValueError(f"ReduceLROnPlateau.load_state_dict: missing {sorted(missing)}")
        n = self.optimizer.num_members
        for key in ("best", "num_bad_epochs", "cooldown_counter"):
            value = state[key]
            if not isinstance(value, (list, tuple)) or len(value) != n:
                # torch's scheduler keeps one record for all: its `best` has no len().
                raise ValueError(
                    f"ReduceLROnPlateau.load_state_dict: `{key}` must hold one value per member "
                    f"(n={n}), got {value!r}; torch's ReduceLROnPlateau keeps one for all"
                )
        self.default_min_lr, self._lr_dtypes = None, {}
        self.__dict__.update(
            {
                k: (list(v) if isinstance(v, list) else v)
                for k, v in state.items()
                if k not in ("optimizer", "_last_lr")
            }
        )
        self._last_lr = _lrs(self.optimizer)


#: The per-member plateau schedulers alive on each optimizer. torch's mark the optimizer
#: (its wrapped ``step``); this one does not touch it, and ``fit(checkpoint=...)`` must still
#: refuse one it does not step, whose record a resumed run would lose.
_BUILT: weakref.WeakKeyDictionary[StackedOptimizer, weakref.WeakSet[ReduceLROnPlateau]] = (
    weakref.WeakKeyDictionary()
)


def plateaus_on(optimizer: Any) -> list[ReduceLROnPlateau]:
    """The :class:`ReduceLROnPlateau` schedulers built on ``optimizer`` and still alive."""
    try:
        return list(_BUILT.get(optimizer, ()))
    except TypeError:  # an optimizer that takes no weak reference holds none of these
        return []


def _lrs(optimizer: StackedOptimizer) -> list[Any]:
    """Each param group's learning rate, a tensor one copied (torch's ``_last_lr``)."""
    return [
        g["lr"].clone() if isinstance(g["lr"], Tensor) else g["lr"] for g in optimizer.param_groups
    ]
