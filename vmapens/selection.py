"""Sub-ensembles: the k best members by a score or a recorded metric."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._checks import check_choice, check_int
from .ensemble import Ensemble
from .history import History
from .optim import StackedOptimizer

__all__ = ["best_k", "member_scores", "metric_table", "recorded"]


def recorded(history: History) -> dict[str, Tensor]:
    """Every ``[epochs, n]`` table of ``history`` by the names :func:`metric_table` takes:
    ``"train_loss"``, ``"val_loss"`` (with validation) and each metric, as ``"val_<name>"``
    and bare, where no loss or other metric holds that name."""
    tables = {"train_loss": history.train_loss}
    if history.val_loss is not None:
        tables["val_loss"] = history.val_loss
    # The losses keep their names and ``"val_<name>"`` is metric ``name``, as for
    # EarlyStopping's `monitor`: a metric named "loss" read as "val_loss" ranked PBT's rounds
    # and best_k by it while early stopping followed the validation loss.
    metrics = history.metrics or {}
    names: dict[str, Tensor] = {}
    for key, t in metrics.items():
        names.setdefault(f"val_{key}", t)
    for key, t in metrics.items():
        names.setdefault(key, t)
    for key in metrics:  # listed as before: each metric bare, then as "val_<name>"
        for name in (key, f"val_{key}"):
            if name in names:
                tables.setdefault(name, names[name])
    return tables


def metric_table(history: History, name: str, api: str, arg: str) -> Tensor:
    """The ``[epochs, n]`` table of a recorded metric (see :func:`recorded`); an error in the
    words of ``api`` naming its argument ``arg`` when ``history`` has none of that name."""
    tables = recorded(history)
    if name not in tables:
        raise ValueError(f"{api}: `{arg}` {name!r} was not recorded; recorded: {sorted(tables)}")
    return tables[name]


def member_scores(history: History, metric: str = "val_loss", mode: str = "min") -> Tensor:
    """Each member's best value of ``metric`` over the epochs, ``[n]`` float64.

    The best value is what ``fit(..., restore_best=True)`` leaves each member at when
    ``metric`` is the monitored one (``fit`` records no validation score in the epoch a
    member diverged in). The best infinity (``-inf`` for ``"min"``, ``+inf`` for ``"max"``: a
    PSNR of ``+inf``, a perfect member) is a value, as ``EarlyStopping`` counts it; NaN and the
    worst infinity are not (no epoch beats them), and a member with no value gets NaN. After
    ``vmapens.pbt.PBT`` rounds a copied member's column still holds its own values from before
    the copy, while ``restore_best`` gives it its source's best state: rank such a run by the
    early stopper's ``best_val`` (lower is better in either mode): ``best_k(ens,
    stopper.best_val, k)``.

    Args:
        history: what ``fit`` returned.
        metric: ``"val_loss"``, ``"train_loss"``, or a metric ``name`` / ``"val_<name>"`` of
            ``history.metrics``.
        mode: ``"min"`` or ``"max"``: which end is best.

    Returns:
        ``[n]`` scores.

    Raises:
        ValueError: ``metric`` was not recorded, ``history`` has no epochs, or a bad ``mode``.

    Example:
        >>> h = History.empty([0, 1], validated=True)
        >>> h.val_loss = torch.tensor([[3.0, 1.0], [2.0, float("nan")]], dtype=torch.float64)
        >>> member_scores(h)
        tensor([2., 1.], dtype=torch.float64)
    """
    return _scores(history, metric, mode, "member_scores", "history")


def _scores(history: History, metric: str, mode: str, api: str, arg: str) -> Tensor:
    """:func:`member_scores`, its errors in the words of ``api`` (``history`` is its ``arg``)."""
    check_choice(api, "mode", mode, ("min", "max"))
    table = metric_table(history, metric, api, "metric")
    if table.shape[0] == 0:
        raise ValueError(f"{api}: `{arg}` has no epochs recorded, so no member has a score")
    key = table.double() if mode == "min" else -table.double()  # lower is better
    # EarlyStopping keeps an epoch whose value beats +inf in these terms: a PSNR of +inf
    # (a perfect member, mode "max") is its best epoch, the one restore_best leaves. Sweep
    # tells optuna these scores, so a perfect trial is complete there, not failed.
    valid = key < torch.inf
    best = key.masked_fill(~valid, torch.inf).amin(0)
    best = best if mode == "min" else -best
    return best.masked_fill(~valid.any(0), torch.nan)


def best_k(
    ens: Ensemble,
    history_or_scores: History | Tensor,
    k: int,
    *,
    metric: str = "val_loss",
    mode: str = "min",
    optimizer: StackedOptimizer | None = None,
) -> Any:
    """The sub-ensemble of the ``k`` best members, best first (and their optimizer).

    Args:
        ens: the ensemble.
        history_or_scores: the :class:`History` of its training (each member scored by its
            best ``metric``, see :func:`member_scores`, where the best infinity counts as
            ``EarlyStopping`` counts it: a member with a validation PSNR of ``+inf`` in mode
            ``"max"`` ranks first) or a ``[n]`` tensor of scores.
        k: how many members to keep, ``1 <= k <= n``.
        metric: the recorded metric to rank by (with a History).
        mode: ``"min"`` (lower is better) or ``"max"``.
        optimizer: a StackedOptimizer over ``ens``: also return one over the sub-ensemble
            with the kept members' hyperparameters and state (``StackedOptimizer.select``),
            to train them on.

    Returns:
        ``ens.select(rows)`` with the ``k`` best rows in order, best first (ties: lower row
        first; NaN scores rank last), or ``(sub_ensemble, sub_optimizer)`` with
        ``optimizer``.

    Raises:
        ValueError: ``k`` out of range, scores of the wrong shape, an unknown metric, a History
            with no epochs or of other members (its ``member_ids`` are not ``ens.member_ids``).
        TypeError: ``optimizer`` is not a StackedOptimizer.

    Example:
        >>> ens = Ensemble(lambda: torch.nn.Linear(2, 1), n=4, seed=0)
        >>> list(best_k(ens, torch.tensor([0.3, 0.1, 0.4, 0.2]), 2).member_ids)
        [1, 3]
    """
    api = "best_k"
    n = len(ens)
    check_int(api, "k", k, minimum=1)
    if k > n:
        raise ValueError(f"{api}: `k` must be <= the number of members ({n}), got {k}")
    check_choice(api, "mode", mode, ("min", "max"))
    if isinstance(history_or_scores, History):
        ids, own = list(history_or_scores.member_ids), list(ens.member_ids)
        if ids != own:
            raise ValueError(
                f"{api}: `history_or_scores` is a History of members {_ids(ids)}, but `ens` "
                f"holds members {_ids(own)}; pass the History of this ensemble's training, or "
                "for members selected from a trained ensemble their scores from its History "
                "(`member_scores(history)[rows]`)"
            )
        scores = _scores(history_or_scores, metric, mode, api, "history_or_scores")
    elif isinstance(history_or_scores, Tensor):
        scores = history_or_scores.detach().double().cpu()
    else:
        raise TypeError(
            f"{api}: `history_or_scores` must be a History or an [n] tensor, got "
            f"{type(history_or_scores).__name__}"
        )
    if tuple(scores.shape) != (n,):
        raise ValueError(f"{api}: scores must have shape [{n}], got {list(scores.shape)}")
    if optimizer is not None and not isinstance(optimizer, StackedOptimizer):
        raise TypeError(
            f"{api}: `optimizer` must be a vmapens.StackedOptimizer, got {type(optimizer).__name__}"
        )
    # Lower is better, NaN last (after an infinitely bad score too); stable sorts keep ties in
    # row order: by value first, then NaN or not.
    key = scores if mode == "min" else -scores
    rows = torch.sort(torch.where(key.isnan(), 0.0, key), stable=True).indices
    rows = rows[torch.sort(key[rows].isnan().to(torch.uint8), stable=True).indices][:k]
    sub = ens.select(rows)
    if optimizer is None:
        return sub
    # The sub-ensemble's parameters in the optimizer's order: it may hold only some of them
    # (a frozen backbone left out) or hold them in another order.
    names = {id(p): name for name, p in ens.named_parameters()}
    held = [p for group in optimizer.param_groups for p in group["params"]]
    if any(id(p) not in names for p in held):
        raise ValueError(f"{api}: `optimizer` holds tensors that are not parameters of `ens`")
    stacked = sub.stacked_params()
    return sub, optimizer.select(rows, [stacked[names[id(p)]] for p in held])


def _ids(ids: list[int]) -> str:
    """Member ids for a message: all of a few; the count and the ends of a zoo's hundreds."""
    if len(ids) <= 8:
        return str(ids)
    return f"{len(ids)} [{', '.join(map(str, ids[:3]))}, ..., {', '.join(map(str, ids[-2:]))}]"
