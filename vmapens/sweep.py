"""Hyperparameter sweeps where each trial is one member: optuna ask-and-tell, or grid/random.

A round asks for N trials, builds one Ensemble whose member ``j`` is trial ``j`` (its own
seed, its own optimizer hyperparameters), trains it with ``fit`` and tells the results. With
optuna, every member reports its monitored value after each epoch and a pruned trial's
member is frozen (``fit``'s member mask) while the others train on.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._checks import check_choice, check_int
from ._sweep_checks import check_monitor, check_run, probe_space
from ._sweep_parts import PlainTrial, check_direction, grid_values, hyper_table, per_member, tell
from .callbacks import Callback, Context, EarlyStopping
from .ensemble import Ensemble
from .fit import fit
from .history import History
from .optim import StackedAdam
from .seeds import derive_seed, member_seed
from .selection import member_scores, metric_table

__all__ = ["Sweep", "SweepResult", "TrialResult"]

BACKENDS = ("optuna", "random", "grid")


@dataclass
class TrialResult:
    """One trial: its hyperparameters and what its member did.

    Attributes:
        number: the trial number (0, 1, ... in the order asked).
        params: the hyperparameters ``space`` chose.
        value: the best monitored value over its epochs, as ``member_scores`` finds it: the
            best infinity (``+inf`` with mode ``"max"``: a perfect member) is one, and NaN when
            it has no value (only NaN, or the worst infinity).
        state: ``"complete"``, ``"pruned"`` or ``"failed"`` (``value`` is NaN).
        values: the monitored value after each epoch it trained (not NaN: none recorded).
        round: which ensemble (round) it was trained in; ``member``: its row there.
    """

    number: int
    params: dict[str, Any]
    value: float
    state: str
    values: list[float]
    round: int
    member: int


@dataclass
class SweepResult:
    """Every trial's result, and the trained ensembles and histories, one per round."""

    trials: list[TrialResult]
    ensembles: list[Ensemble] = field(default_factory=list)
    histories: list[History] = field(default_factory=list)
    mode: str = "min"

    @property
    def best(self) -> TrialResult:
        """The complete trial with the best value."""
        done = [t for t in self.trials if t.state == "complete"]
        if not done:
            raise ValueError("SweepResult.best: no trial completed")
        sign = 1.0 if self.mode == "min" else -1.0
        return min(done, key=lambda t: sign * t.value)


class _Report(Callback):
    """Reports each member's monitored value to its optuna trial; freezes pruned members."""

    def __init__(self, trials: list[Any], monitor: str, pruning: bool):
        self.trials, self.monitor, self.pruning = trials, monitor, pruning
        self.pruned: set[int] = set()

    def on_train_start(self, ctx: Context) -> None:
        # A resumed run's trials (asked anew) hear the epochs its checkpoint holds, as the
        # interrupted run's did: optuna's intermediate values list the trial's values.
        table = metric_table(ctx.history, self.monitor, "Sweep", "monitor")
        for epoch, row in enumerate(table.tolist()):
            for trial, value in zip(self.trials, row, strict=True):
                if not math.isnan(value):
                    trial.report(value, epoch)

    def on_epoch_end(self, ctx: Context) -> None:
        row = metric_table(ctx.history, self.monitor, "Sweep", "monitor")[-1]
        active = ctx.active.cpu()
        for j, trial in enumerate(self.trials):
            # Every epoch a member trained in, the one early stopping stopped it in too: the
            # pruner compares trials step by step, and the TrialResult lists that value.
            # An infinite value is one (optuna takes it; a +inf PSNR is a perfect score).
            if not bool(ctx.running[j]) or math.isnan(float(row[j])):
                continue
            trial.report(float(row[j]), ctx.epoch)
            if self.pruning and bool(active[j]) and trial.should_prune():
                self.pruned.add(j)
                ctx.stop([j])


class Sweep:
    """A sweep of ``space`` over members of one architecture: one trial per member.

    Args:
        factory: builds one member (as for ``Ensemble``).
        space: ``space(trial) -> dict`` of optimizer hyperparameters (``lr``,
            ``weight_decay``, ...), drawn with ``trial.suggest_float`` / ``suggest_int`` /
            ``suggest_categorical`` (an ``optuna.Trial``, or the same methods in the grid
            and random backends).
        backend: ``"optuna"`` (needs ``pip install 'vmapens[optuna]'``), ``"random"`` or
            ``"grid"``.
        study: the optuna study to ask and tell (default: a new one with a TPE sampler
            seeded with ``seed``, and optuna's median pruner).
        grid: with ``backend="grid"``: name -> list of values; trials run their product in
            order.
        seed: trial ``t``'s member is built with ``vmapens.seeds.member_seed(seed, t)``; also the
            random backend's draws and fit's ``seed`` (shuffling) unless given to ``run``.
        optimizer: ``optimizer(ens, **per_member_hyperparameters)``, e.g. ``StackedAdam``.
        monitor: ``"val_loss"``, ``"train_loss"`` or ``"val_<metric>"`` (a metric given to
            ``run`` through ``fit``'s ``metrics``): what trials are judged by. ``run`` checks
            that ``fit`` will record it (``val_data``, ``metrics``) before asking for a trial.
        mode: ``"min"`` or ``"max"``.

    Example:
        >>> import torch
        >>> x, y = torch.randn(32, 3), torch.randn(32, 1)
        >>> sweep = Sweep(lambda: torch.nn.Linear(3, 1),
        ...               lambda t: {"lr": t.suggest_float("lr", 1e-3, 1e-1, log=True)},
        ...               backend="random", seed=0)
        >>> result = sweep.run((x, y), torch.nn.MSELoss(), n_trials=4, epochs=2,
        ...                    val_data=(x, y), progress=False)
        >>> len(result.trials), result.best.state
        (4, 'complete')
    """

    def __init__(
        self,
        factory: Callable[[], Any],
        space: Callable[[Any], dict[str, Any]],
        *,
        backend: str = "optuna",
        study: Any = None,
        grid: Mapping[str, Sequence[Any]] | None = None,
        seed: int = 0,
        optimizer: Callable[..., Any] = StackedAdam,
        monitor: str = "val_loss",
        mode: str = "min",
    ) -> None:
        api = "Sweep"
        check_choice(api, "backend", backend, BACKENDS)
        check_choice(api, "mode", mode, ("min", "max"))
        check_int(api, "seed", seed)
        if not callable(space):
            raise TypeError(f"{api}: `space` must be callable, got {type(space).__name__}")
        if not isinstance(monitor, str):
            raise TypeError(f"{api}: `monitor` must be a str, got {type(monitor).__name__}")
        if (grid is None) != (backend != "grid"):
            raise ValueError(f"{api}: `grid` is needed with backend='grid', and only there")
        lists = {k: grid_values(v) for k, v in (grid or {}).items()}
        scalars = {k: v for k, v in (grid or {}).items() if lists[k] is None}
        if scalars:  # a float has no len(); a string's letters were tried as values
            raise TypeError(f"{api}: `grid` maps each name to a list of values, got {scalars!r}")
        empty = sorted(k for k, v in lists.items() if not v)
        if empty:
            raise ValueError(
                f"{api}: `grid` needs at least one value per name, got none for {empty}"
            )
        if study is not None and backend != "optuna":
            raise ValueError(f"{api}: `study` needs backend='optuna', got {backend!r}")
        if study is not None:
            check_direction(api, study, mode)
        self.factory, self.space, self.backend, self.seed = factory, space, backend, seed
        self.optimizer, self.monitor, self.mode = optimizer, monitor, mode
        self.grid = None if grid is None else {k: v or [] for k, v in lists.items()}
        self.study = study
        if backend == "optuna":
            self.study = study if study is not None else self._new_study()
        self._asked = 0

    def _new_study(self) -> Any:
        try:
            import optuna
        except ImportError as err:
            raise ImportError(
                "Sweep(backend='optuna') needs optuna; install it with: "
                "pip install 'vmapens[optuna]', or use backend='random' or 'grid'"
            ) from err
        return optuna.create_study(
            direction="minimize" if self.mode == "min" else "maximize",
            sampler=optuna.samplers.TPESampler(seed=self.seed),
            pruner=optuna.pruners.MedianPruner(),
        )

    def _ask(self) -> Any:
        number = self._asked
        self._asked += 1
        if self.backend == "optuna":
            return self.study.ask()
        grid = None
        if self.grid is not None:
            combos = list(itertools.product(*self.grid.values()))
            grid = dict(zip(self.grid, combos[number % len(combos)], strict=True))
        return PlainTrial(number, random.Random(derive_seed(self.seed, "sweep", number)), grid)

    def run(
        self,
        data: Any,
        loss_fn: Callable[[Any, Any], Any],
        *,
        n_trials: int | None = None,
        per_ensemble: int | None = None,
        **fit_options: Any,
    ) -> SweepResult:
        """Ask, train and tell ``n_trials`` trials, ``per_ensemble`` members at a time.

        Args:
            data: training data, as for ``fit``.
            loss_fn: the member loss, as for ``fit``.
            n_trials: trials in all (default with ``backend="grid"``: the grid's size).
            per_ensemble: trials per round (default: all in one). Later rounds let optuna's
                sampler learn from earlier ones, and its pruner compare with them.
            **fit_options: passed to ``fit`` (``epochs``, ``batch_size``, ``val_data``,
                ``metrics``, ``callbacks``, ...; not ``optimizer`` or ``lr``).

        Before any trial is asked, ``run`` checks its arguments, that ``fit`` will record the
        sweep's ``monitor`` with these options, and the names ``space`` returns (called once on
        a stand-in trial that offers the three ``suggest_*`` methods). If it raises anyway (in
        ``fit``, say), the random and grid backends are left as before the call: the next
        ``run`` numbers and seeds its trials as this one would have. With optuna, the trials
        of the failing round are told ``FAIL`` (none is left ``RUNNING``); earlier rounds' stay
        told.

        Returns:
            A :class:`SweepResult`.

        Raises:
            ValueError: bad counts, ``fit`` options the sweep sets itself, a ``monitor`` that
                ``fit`` will not record, hyperparameters the optimizer does not take,
                ``bootstrap=True`` over several rounds or runs, a checkpoint over several
                rounds, a checkpoint that exists once this Sweep has asked trials (its new
                trials would resume them).
        """
        api = "Sweep.run"
        n_trials, per = check_run(api, n_trials, per_ensemble, fit_options, self.grid, self._asked)
        check_monitor(api, self.monitor, fit_options)
        names = probe_space(api, self.space, self.optimizer, self.grid, self.seed)
        given = list(fit_options.get("callbacks", ()))
        watched = self.monitor.startswith("val_") and fit_options.get("val_data") is not None
        if watched and not any(isinstance(cb, EarlyStopping) for cb in given):
            # Each member's best epoch (and its restore) follows the sweep's monitor.
            patience = fit_options.pop("patience", None)
            stop = EarlyStopping(self.monitor, self.mode, patience=patience)
            fit_options = {**fit_options, "callbacks": [stop, *given]}
        fit_options.setdefault("seed", self.seed)
        result = SweepResult([], mode=self.mode)
        asked = self._asked
        try:
            for start in range(0, n_trials, per):
                self._round(data, loss_fn, min(per, n_trials - start), fit_options, names, result)
        except BaseException:
            self._asked = asked  # the plain backends' trial numbers (and seeds) are not used up
            raise
        return result

    def _round(
        self,
        data: Any,
        loss_fn: Any,
        count: int,
        options: dict[str, Any],
        names: list[str],
        result: SweepResult,
    ) -> None:
        trials: list[Any] = []
        try:
            for _ in range(count):
                trials.append(self._ask())
            params = [dict(self.space(t)) for t in trials]
            if any(list(p) != names for p in params):
                raise ValueError(
                    f"Sweep: `space` must return the same hyperparameter names every time: "
                    f"{names} first, then {[list(p) for p in params]}"
                )
            seeds = [member_seed(self.seed, t.number) for t in trials]
            ens = Ensemble(self.factory, count, seeds=seeds)
            hypers = hyper_table(self.optimizer)
            hyper = {k: per_member([p[k] for p in params], hypers, k) for k in names}
            optimizer = self.optimizer(ens, **hyper)
            report = _Report(trials, self.monitor, self.backend == "optuna")
            callbacks = [*options.get("callbacks", ()), report]
            history = fit(
                ens, data, loss_fn, optimizer=optimizer, **{**options, "callbacks": callbacks}
            )
        except BaseException:
            if self.backend == "optuna":
                for trial in trials:
                    self._tell(trial, "failed", math.nan)  # leave none RUNNING
            raise
        best = member_scores(history, self.monitor, self.mode)
        table = metric_table(history, self.monitor, "Sweep", "monitor")
        for j, trial in enumerate(trials):
            values = [float(v) for v in table[:, j] if not math.isnan(float(v))]
            value = float(best[j])
            state = "pruned" if j in report.pruned else "complete"
            state = "failed" if math.isnan(value) else state
            if self.backend == "optuna":
                self._tell(trial, state, value)
            result.trials.append(
                TrialResult(trial.number, params[j], value, state, values, len(result.ensembles), j)
            )
        result.ensembles.append(ens)
        result.histories.append(history)

    def _tell(self, trial: Any, state: str, value: float) -> None:
        tell(self.study, trial, state, value)
