"""What ``Sweep.run`` refuses before it asks for any trial: counts and ``fit`` options, a
``monitor`` that ``fit`` will not record, and hyperparameter names that the optimizer does not
take per member (from ``space`` called once on a stand-in trial)."""

from __future__ import annotations

import math
import os
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ._checks import check_int
from ._fit_checks import check_metric_names
from ._sweep_parts import PlainTrial, fixed_names, flag_names, hyper_table
from .callbacks import Checkpoint
from .history import History
from .selection import recorded

__all__ = ["check_monitor", "check_run", "probe_space"]


def check_run(
    api: str,
    n_trials: int | None,
    per_ensemble: int | None,
    fit_options: dict[str, Any],
    grid: Mapping[str, Sequence[Any]] | None,
    asked: int,
) -> tuple[int, int]:
    """``run``'s counts, ``(n_trials, trials per round)``, with the ``fit`` options checked
    against them and against the ``asked`` trials of the Sweep's earlier runs."""
    if n_trials is None:
        if grid is None:
            raise ValueError(f"{api}: `n_trials` is needed unless backend='grid'")
        n_trials = math.prod(len(v) for v in grid.values())
    check_int(api, "n_trials", n_trials, minimum=1)
    per = n_trials if per_ensemble is None else check_int(api, "per_ensemble", per_ensemble, 1)
    taken = sorted({"optimizer", "lr"} & set(fit_options))
    if taken:
        raise ValueError(f"{api}: the sweep builds the optimizer; do not pass {taken}")
    if fit_options.get("bootstrap") and per < n_trials:
        # fit keys each member's resample by its index in the round's ensemble, so a later
        # round would reuse an earlier round's resamples: trial 2 would train on trial 0's.
        raise ValueError(
            f"{api}: bootstrap=True needs every trial in one ensemble (per_ensemble=None "
            f"or >= n_trials), got per_ensemble={per_ensemble} for {n_trials} trials: "
            "later rounds would reuse the first round's resamples"
        )
    if fit_options.get("bootstrap") and asked:
        # The same: this run's member j would train on the resample of the first run's.
        raise ValueError(
            f"{api}: bootstrap=True needs every trial in one ensemble, and this Sweep has "
            f"already asked {asked} trials: its new trials would train on their "
            "resamples; ask every trial in one run, or build a new Sweep with another seed"
        )
    paths = [fit_options["checkpoint"]] if fit_options.get("checkpoint") is not None else []
    paths += [cb.path for cb in fit_options.get("callbacks", ()) if isinstance(cb, Checkpoint)]
    if paths and asked and any(os.path.exists(p) for p in paths):
        # This sweep's next trials are new ones: resuming would report the earlier trials'
        # values for them. A new Sweep asks the same trials again and resumes them.
        raise ValueError(
            f"{api}: the checkpoint {os.fspath(paths[0])!r} exists and this Sweep has "
            f"already asked {asked} trials: its new trials would resume the earlier "
            "ones' run; pass another checkpoint path"
        )
    if paths and per < n_trials:
        # One file for every round: the second round resumed the first's ensemble and
        # history (same member rows, and the same hyperparameters with a cycling grid), so
        # its trials reported the first round's values.
        raise ValueError(
            f"{api}: a checkpoint names one file, and each round trains its own ensemble: "
            f"a later round would resume an earlier one; with per_ensemble={per_ensemble} "
            f"for {n_trials} trials, pass per_ensemble=None (one round) or no checkpoint"
        )
    return n_trials, per


def check_monitor(api: str, monitor: str, options: dict[str, Any]) -> None:
    """Raise unless ``fit`` will record the monitor, given its options."""
    metrics, validated = options.get("metrics"), options.get("val_data") is not None
    if isinstance(metrics, Mapping):
        check_metric_names(api, metrics)  # fit would refuse them after trials were asked
    names = list(metrics) if validated and isinstance(metrics, Mapping) else []
    # The tables a History of fit with these options holds: what metric_table finds.
    tables = list(recorded(History.empty([], validated, names)))
    if monitor not in tables:
        raise ValueError(
            f"{api}: the sweep's `monitor` {monitor!r} is not recorded by fit with "
            f"these options; it records {tables}. Pass `val_data` (and `metrics` for "
            "'val_<name>'), or build the Sweep with one of those as `monitor`"
        )


def probe_space(
    api: str,
    space: Callable[[Any], dict[str, Any]],
    optimizer: Callable[..., Any],
    grid: Mapping[str, Sequence[Any]] | None,
    seed: int,
) -> list[str]:
    """The hyperparameter names ``space`` returns, from a stand-in trial (no backend's)."""
    first = None if grid is None else {k: v[0] for k, v in grid.items()}
    names = list(dict(space(PlainTrial(-1, random.Random(seed), first))))
    hypers = hyper_table(optimizer)
    fixed = sorted(fixed_names(optimizer) & set(names))
    if fixed:
        raise ValueError(
            f"{api}: `space` returned {fixed}, which the `optimizer` partial already "
            "fixes; sweep it or fix it, not both"
        )
    unknown = [k for k in names if hypers is not None and k not in hypers]
    flags = [k for k in unknown if k in flag_names(optimizer)]
    if flags:
        # A flag (SGD's `nesterov`) is taken, but once for all members: not per trial.
        raise ValueError(
            f"{api}: `space` returned {flags}, which "
            f"{getattr(optimizer, '__name__', 'the optimizer')} takes as a flag shared "
            "by every member, not per member; fix it with functools.partial(optimizer, "
            f"{flags[0]}=...) or sweep it in separate Sweeps; per-member hyperparameters: "
            f"{sorted(hypers or ())}"
        )
    if unknown:
        raise ValueError(
            f"{api}: `space` returned {unknown}, which "
            f"{getattr(optimizer, '__name__', 'the optimizer')} does not take; "
            f"per-member hyperparameters: {sorted(hypers or ())}"
        )
    return names
