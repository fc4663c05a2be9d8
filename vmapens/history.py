"""History: what ``fit`` recorded, one row per epoch and one column per member."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ._checks import is_int

__all__ = ["History"]


@dataclass
class History:
    """What ``fit`` recorded, one row per epoch and one column per member.

    Attributes:
        train_loss: ``[epochs, n]`` each member's mean training loss over each epoch: the
            mean of the epoch's step losses (as ``loss_fn`` gave them, before each update),
            every step one weight whatever its batch's size; NaN in the epochs after the one
            a member stopped in (early stopping or divergence), non-finite in the epoch it
            diverged in.
        val_loss: ``[epochs, n]`` validation loss (NaN in the epochs after the one a member
            stopped in, and in the epoch it diverged in: no score of the weights a non-finite
            loss left), or ``None`` without ``val_data``.
        best_epoch: ``[n]`` epoch (0-based) of each member's lowest validation loss, ``-1``
            without ``val_data`` (or if it never had a finite one).
        stopped_epoch: ``[n]`` epoch at the end of which each member stopped training (patience
            ran out or it diverged), ``-1`` for members that trained to the end.
        diverged: ``[n]`` bool, True for members whose training loss became NaN/inf.
        member_ids: global index of each column (``ens.member_ids``).
        metrics: name -> ``[epochs, n]`` validation metric of each member (NaN where
            ``val_loss`` is), for ``fit(..., metrics={name: fn})``; ``None`` without metrics.
        ensemble_metrics: name -> ``[epochs]`` the metric of the ensemble's averaged output
            (members that diverged left out); ``None`` without metrics, and in a history
            merged by ``vmapens.sharding.gather_history`` (each rank scored its own block).
    """

    train_loss: Tensor
    val_loss: Tensor | None
    best_epoch: Tensor
    stopped_epoch: Tensor
    diverged: Tensor
    member_ids: list[int] = field(default_factory=list)
    metrics: dict[str, Tensor] | None = None
    ensemble_metrics: dict[str, Tensor] | None = None

    @classmethod
    def empty(
        cls, member_ids: Sequence[int], validated: bool, metrics: Sequence[str] = ()
    ) -> History:
        """A history with no epochs yet, for ``len(member_ids)`` members."""
        n = len(member_ids)
        rows = torch.empty(0, n, dtype=torch.float64)
        names = list(metrics)
        return cls(
            train_loss=rows,
            val_loss=rows.clone() if validated else None,
            best_epoch=torch.full((n,), -1, dtype=torch.int64),
            stopped_epoch=torch.full((n,), -1, dtype=torch.int64),
            diverged=torch.zeros(n, dtype=torch.bool),
            member_ids=list(member_ids),
            metrics={k: rows.clone() for k in names} if names else None,
            ensemble_metrics={k: torch.empty(0, dtype=torch.float64) for k in names}
            if names
            else None,
        )

    @property
    def epochs(self) -> int:
        """Number of epochs recorded."""
        return self.train_loss.shape[0]

    def state_dict(self) -> dict[str, Any]:
        """Plain tensors and lists, loadable with ``torch.load(weights_only=True)``."""
        return {
            "train_loss": self.train_loss.clone(),
            "val_loss": None if self.val_loss is None else self.val_loss.clone(),
            "best_epoch": self.best_epoch.clone(),
            "stopped_epoch": self.stopped_epoch.clone(),
            "diverged": self.diverged.clone(),
            "member_ids": list(self.member_ids),
            "metrics": _clone(self.metrics),
            "ensemble_metrics": _clone(self.ensemble_metrics),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace this history with ``state`` (checked first; nothing changes on error).

        Raises:
            ValueError: missing keys, or tensors of the wrong shape for this many members.
        """
        self.check_state(state, "History.load_state_dict")
        # States written before metrics existed have no metric keys: no metrics.
        state = {"metrics": None, "ensemble_metrics": None, **state}
        for key, value in state.items():
            if isinstance(value, dict):
                value = _clone(value)
            elif isinstance(value, Tensor):
                value = value.clone()
            elif key == "member_ids":  # its own list, as state_dict gives
                value = list(value)
            setattr(self, key, value)

    def plot(self, path: str | os.PathLike, *, title: str | None = None) -> str | os.PathLike:
        """Write a PNG (1000 x 400 pixels) of every member's loss curves and their mean.

        Each member is a thin line, the mean over the members still training a thick one;
        training loss on the left, validation loss (when recorded) on the right, then one
        panel per metric (the averaged ensemble's value dashed). Each panel past two adds 500
        pixels of width.

        Args:
            path: where to write the PNG.
            title: optional figure title.

        Returns:
            ``path``.

        Raises:
            ImportError: matplotlib is not installed (``pip install 'vmapens[plot]'``).
        """
        try:
            from matplotlib.figure import Figure
        except ImportError as err:
            raise ImportError(
                "History.plot needs matplotlib; install it with: pip install 'vmapens[plot]'"
            ) from err
        panels: list[tuple[str, Tensor, Tensor | None]] = [("training loss", self.train_loss, None)]
        if self.val_loss is not None:
            panels.append(("validation loss", self.val_loss, None))
        whole = self.ensemble_metrics or {}
        panels += [(f"validation {k}", v, whole.get(k)) for k, v in (self.metrics or {}).items()]
        # The object API, not pyplot: no global backend or figure state is touched.
        fig = Figure(figsize=(5 * max(2, len(panels)), 4), dpi=100)
        epochs = torch.arange(1, self.epochs + 1).numpy()
        for k, (name, curves, ensemble) in enumerate(panels):
            ax = fig.add_subplot(1, len(panels), k + 1)
            finite = curves.masked_fill(~torch.isfinite(curves), math.nan)
            ax.plot(epochs, finite.numpy(), linewidth=0.6, alpha=0.5)
            ax.plot(epochs, finite.nanmean(dim=1).numpy(), color="black", linewidth=2.5)
            shown = finite[torch.isfinite(finite)]
            if ensemble is not None:
                averaged = ensemble.masked_fill(~torch.isfinite(ensemble), math.nan)
                ax.plot(epochs, averaged.numpy(), color="black", linestyle="--", linewidth=1.5)
                shown = torch.cat([shown, averaged[torch.isfinite(averaged)]])
            ax.set(xlabel="epoch", ylabel=name, title=f"{name}: {curves.shape[1]} members, mean")
            _, margin = ax.margins()  # type: ignore[misc]  # no arguments: the pair
            if _log_axis_fits(shown, margin):
                ax.set_yscale("log")
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(path, format="png")
        return path

    def check_state(self, state: Any, api: str) -> None:
        """Raise ValueError unless ``state`` is a History state for this many members."""
        n = len(self.member_ids)
        keys = {"train_loss", "val_loss", "best_epoch", "stopped_epoch", "diverged", "member_ids"}
        optional = {"metrics", "ensemble_metrics"}  # absent in states from before metrics
        if not isinstance(state, dict) or not keys <= set(state) <= keys | optional:
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"{api}: history state must have keys {sorted(keys)}, got {got}")
        ids = state["member_ids"]
        if (
            not isinstance(ids, (list, tuple, range))
            or len(ids) != n
            or not all(is_int(i) for i in ids)
        ):
            raise ValueError(
                f"{api}: history `member_ids` must be a list of {n} ints, got {ids!r:.60}"
            )
        train = state["train_loss"]
        if not isinstance(train, Tensor) or train.dim() != 2 or train.shape[1] != n:
            raise ValueError(f"{api}: history `train_loss` must be an [epochs, {n}] tensor")
        _check_metrics(state, n, api)
        # Every table has one row per epoch: a row missing from one would shift its epochs.
        tables = [("val_loss", state["val_loss"]), *(state.get("metrics") or {}).items()]
        for key, t in tables:
            if t is None and key == "val_loss":
                continue
            if not isinstance(t, Tensor) or tuple(t.shape) != tuple(train.shape):
                raise ValueError(
                    f"{api}: history `{key}` must be an [epochs, {n}] tensor of as many epochs "
                    f"as `train_loss` ({train.shape[0]}), got "
                    f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}"
                )
        if not all(
            t.is_floating_point() for t in (train, *(t for _, t in tables)) if t is not None
        ):
            raise ValueError(f"{api}: history losses and metrics must be floating-point tensors")
        kinds = {"best_epoch": torch.int64, "stopped_epoch": torch.int64, "diverged": torch.bool}
        for key, dtype in kinds.items():
            t = state[key]
            if not isinstance(t, Tensor) or tuple(t.shape) != (n,) or t.dtype != dtype:
                raise ValueError(f"{api}: history `{key}` must be a [{n}] {dtype} tensor")


def _log_axis_fits(values: Tensor, margin: float) -> bool:
    """Whether a log axis can show ``values`` (finite): all positive, and the top margin
    (``margin`` of the decades shown) below float64's limit. A member about to diverge can
    score 1e299; matplotlib would overflow framing it on a log axis."""
    if values.numel() == 0 or not bool((values > 0).all()):
        return False
    low, high = math.log10(float(values.min())), math.log10(float(values.max()))
    return high + margin * (high - low) < 300


def _clone(tables: dict[str, Tensor] | None) -> dict[str, Tensor] | None:
    return None if tables is None else {k: t.clone() for k, t in tables.items()}


def _check_metrics(state: dict[str, Any], n: int, api: str) -> None:
    """Metric tables: per member ``[epochs, n]``, of the ensemble ``[epochs]`` (or ``None``
    in a history merged by ``gather_history``), same names."""
    per_member, whole = state.get("metrics"), state.get("ensemble_metrics")
    if per_member is None and whole is not None:
        raise ValueError(f"{api}: history `ensemble_metrics` without `metrics`")
    if per_member is None:
        return
    if not isinstance(per_member, dict) or not isinstance(whole, (dict, type(None))):
        raise ValueError(f"{api}: history metrics must be dicts of tensors")
    if whole is not None and sorted(per_member) != sorted(whole):
        raise ValueError(
            f"{api}: history `metrics` {sorted(per_member)} and `ensemble_metrics` "
            f"{sorted(whole)} name different metrics"
        )
    for name, t in per_member.items():
        if not isinstance(t, Tensor) or t.dim() != 2 or t.shape[1] != n:
            raise ValueError(f"{api}: history metric `{name}` must be an [epochs, {n}] tensor")
        if whole is None:
            continue
        if not isinstance(whole[name], Tensor) or tuple(whole[name].shape) != (t.shape[0],):
            raise ValueError(
                f"{api}: history ensemble metric `{name}` must be a [{t.shape[0]}] tensor"
            )
