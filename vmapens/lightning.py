"""Lightning integration: an Ensemble trained by ``lightning.Trainer.fit``.

Optional: needs the ``lightning`` package (``pip install "vmapens[lightning]"``); ``import
vmapens`` does not import this module.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

try:
    import lightning as L
    from lightning.pytorch.strategies import SingleDeviceStrategy
    from lightning.pytorch.trainer.states import TrainerFn
except ImportError as err:  # pragma: no cover - exercised by a test that hides the package
    raise ImportError(
        "vmapens.lightning needs the `lightning` package, which is not installed; install the "
        'extra: pip install "vmapens[lightning]"'
    ) from err

from ._checks import check_choice, check_int, check_loss_fn, positional
from ._fit_checks import check_metric_names
from ._lightning_parts import batch_rows, check_optimizer_arg, is_metric_object, step_kept
from ._lightning_rng import ResumesRNG
from ._metrics import metric_pair
from .ensemble import Ensemble, check_ensemble
from .losses import per_member
from .optim import ReduceLROnPlateau, StackedAdam, StackedOptimizer
from .step import Step, make_step

__all__ = ["EnsembleModule"]

#: Trainer precisions the module accepts: the ensemble's own dtype, unchanged or float64.
#: Mixed precision goes through ``make_step(precision=...)``, which autocasts member by
#: member; Lightning's autocast around the whole step would not be member-exact.
PRECISIONS = ("32-true", "64-true")

OptimizerArg = StackedOptimizer | Callable[[Ensemble], StackedOptimizer]


class EnsembleModule(ResumesRNG, L.LightningModule):
    """A ``LightningModule`` that trains every member of an ``Ensemble`` at once.

    docs/workflows.md ("Lightning") says what it logs, stops, steps and saves, in full.
    ``training_step`` runs one ``vmapens.make_step`` step (manual optimization), so each
    member trains exactly as it would alone with ``torch.optim``; it logs ``train_loss`` and
    ``train_loss/member_{i}``. Validation logs ``val_loss/member_{i}`` (the row-weighted mean
    of the member's batch losses), ``val_loss`` (their mean) and, per metric,
    ``val_{name}/member_{i}``, ``val_{name}`` and ``val_{name}/ensemble`` (the metric of the
    averaged output); ``trainer.test`` logs the same as ``test_...``; ``trainer.predict``
    returns every member's output, ``[n, ...]`` per batch. ``i`` is the member's global id.

    With ``patience``, a member whose ``monitor`` has not improved for ``patience``
    validation epochs inside ``trainer.fit`` is frozen by the optimizer's mask; when all
    have stopped, ``trainer.should_stop`` is set. ``stopped_epoch`` and ``best_epoch``
    (buffers, ``-1`` for none) say when. Schedulers a subclass returns from
    ``configure_optimizers`` are stepped as automatic optimization steps them (``interval``,
    ``frequency``); a ``vmapens.optim.ReduceLROnPlateau`` after each end-of-epoch validation
    with every member's own ``monitor`` value (torch's, one value for all, is refused).

    Batches are ``(inputs, targets)``; ``inputs`` is one positional input or a tuple (or
    list) of them; prediction also takes ``(inputs,)`` or the inputs alone. Checkpoints hold
    the members, the early-stopping state and the global RNG state, so ``trainer.fit(...,
    ckpt_path=...)`` from an epoch's end continues exactly. One process, one device: ``setup``
    refuses multi-process strategies, which would mix members (docs/distributed.md).

    Args:
        ens: the ensemble to train.
        loss_fn: ``(output, target) -> scalar`` for one member, e.g. ``nn.MSELoss()``.
        optimizer: a ``vmapens.StackedOptimizer`` over ``ens``, or a callable ``(ens) ->
            StackedOptimizer`` (a class, ``functools.partial(vmapens.StackedAdam, lr=...)``)
            that ``configure_optimizers`` calls. Default: ``StackedAdam`` with lr 1e-3.
        metrics: name -> ``(output, target) -> scalar`` for one member (vmapped over the
            members, averaged over batches like the loss), or an object with ``reset``,
            ``update`` and ``compute`` (a torchmetrics ``Metric``: one copy per member and
            one for the averaged output, accumulated over the validation epoch).
        patience: validation epochs without improvement before a member stops (``None``:
            never).
        monitor: what early stopping watches: ``"val_loss"`` or ``"val_<name>"`` of a metric.
        mode: ``"min"`` or ``"max"``: whether lower or higher ``monitor`` is better.
        in_dims: ``None`` (every member trains on the batch) or ``0`` (batches hold one slice
            per member along dim 0). Validation batches are shared by all members.
        clip_grad_norm: per-member gradient norm clipping (see ``make_step``).
        clip_grad_value: per-member gradient value clipping (see ``make_step``).
        check: ``make_step``'s self-check on the first training batch.

    Raises:
        TypeError: ``ens`` not an Ensemble, ``loss_fn`` not callable, ``optimizer`` neither a
            StackedOptimizer nor callable, a metric that is neither callable nor a metric
            object.
        ValueError: ``patience`` < 1, an unknown ``mode``, ``in_dims`` not None or 0,
            ``monitor`` not ``"val_loss"`` or ``"val_<name>"`` of ``metrics``; in fit, the
            Trainer's ``gradient_clip_val`` or ``accumulate_grad_batches``, torch's plateau,
            several optimizers from ``configure_optimizers``.

    Example:
        >>> import lightning as L
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> ens = Ensemble(lambda: nn.Linear(3, 1), n=4, seed=0)
        >>> data = DataLoader(TensorDataset(torch.randn(32, 3), torch.randn(32, 1)), batch_size=8)
        >>> module = EnsembleModule(ens, nn.MSELoss(), patience=3)
        >>> trainer = L.Trainer(max_epochs=2, logger=False, enable_checkpointing=False,
        ...                     enable_progress_bar=False, enable_model_summary=False)
        >>> trainer.fit(module, data, data)
        >>> sorted(k for k in trainer.callback_metrics if k.startswith("val_loss"))
        ['val_loss', 'val_loss/member_0', 'val_loss/member_1', 'val_loss/member_2', 'val_loss/member_3']
    """

    # Early-stopping state, per member (registered as buffers).
    active: Tensor
    best: Tensor
    bad: Tensor
    best_epoch: Tensor
    stopped_epoch: Tensor

    def __init__(
        self,
        ens: Ensemble,
        loss_fn: Callable[[Any, Tensor], Tensor],
        *,
        optimizer: OptimizerArg | None = None,
        metrics: Mapping[str, Any] | None = None,
        patience: int | None = None,
        monitor: str = "val_loss",
        mode: str = "min",
        in_dims: int | None = None,
        clip_grad_norm: float | None = None,
        clip_grad_value: float | None = None,
        check: bool = True,
    ) -> None:
        super().__init__()
        api = "EnsembleModule"
        check_ensemble(api, ens)
        check_loss_fn(api, loss_fn)
        check_optimizer_arg(api, optimizer)
        if in_dims not in (None, 0):
            raise ValueError(f"{api}: `in_dims` must be None or 0, got {in_dims!r}")
        if patience is not None:
            check_int(api, "patience", patience, minimum=1)
        check_choice(api, "mode", mode, ("min", "max"))
        metrics = dict(metrics or {})
        for name, fn in metrics.items():
            if not isinstance(name, str) or not (callable(fn) or is_metric_object(fn)):
                raise TypeError(
                    f"{api}: `metrics` must map names to callables (output, target) -> scalar or "
                    f"metric objects, got {name!r}: {type(fn).__name__}"
                )
        check_metric_names(api, metrics)  # "loss" would log a second "val_loss", as in fit
        allowed = ["val_loss", *(f"val_{k}" for k in metrics)]
        if monitor not in allowed:
            raise ValueError(f"{api}: `monitor` must be one of {allowed}, got {monitor!r}")
        self.automatic_optimization = False
        self.ens = ens
        self.loss_fn = loss_fn
        self._optimizer = optimizer
        self._options: dict[str, Any] = dict(
            in_dims=in_dims, clip_grad_norm=clip_grad_norm, clip_grad_value=clip_grad_value
        )
        self._check = check
        self.patience, self.monitor, self.sign = patience, monitor, 1.0 if mode == "min" else -1.0
        n = len(ens)
        self.ids = list(ens.member_ids)
        # Metric objects accumulate over the epoch: one copy per member, one for the average.
        self.metric_objects = nn.ModuleDict()
        self._metric_lists: dict[str, list[Any]] = {}
        self._metric_fns: dict[str, Callable[..., Tensor]] = {}
        for name, fn in metrics.items():
            if is_metric_object(fn):
                copies = [copy.deepcopy(fn) for _ in range(n + 1)]
                if all(isinstance(c, nn.Module) for c in copies):
                    self.metric_objects[name] = nn.ModuleList(copies)
                self._metric_lists[name] = copies
            else:
                self._metric_fns[name] = fn
        # Early-stopping state: buffers, so that the state_dict (and checkpoints) carry it.
        self.register_buffer("active", torch.ones(n, dtype=torch.bool))
        self.register_buffer("best", torch.full((n,), math.inf, dtype=torch.float64))
        self.register_buffer("bad", torch.zeros(n, dtype=torch.int64))
        self.register_buffer("best_epoch", torch.full((n,), -1, dtype=torch.int64))
        self.register_buffer("stopped_epoch", torch.full((n,), -1, dtype=torch.int64))
        self._step: Step | None = None
        self._step_optimizer: Any = None
        self._sums: dict[str, Tensor] = {}
        self._rows = 0
        self._modes: list[tuple[nn.Module, bool]] = []

    # -- Lightning hooks -----------------------------------------------------------------------

    def setup(self, stage: str) -> None:
        """Refuse what would not train members apart: several processes, mixed precision."""
        api = "EnsembleModule"
        trainer = self.trainer
        if trainer.world_size > 1 or not isinstance(trainer.strategy, SingleDeviceStrategy):
            raise ValueError(
                f"{api}: the Trainer's `strategy` must run one process on one device, got "
                f"{type(trainer.strategy).__name__} with {trainer.world_size} processes: they "
                "broadcast rank 0's parameters and average gradients over the processes, which "
                "would mix members; shard them with vmapens.fit under torchrun (docs/distributed.md)"
            )
        if trainer.precision not in PRECISIONS:
            raise ValueError(
                f"{api}: the Trainer's `precision` must be one of {list(PRECISIONS)}, got "
                f"{trainer.precision!r}: Lightning's autocast around the whole step is not "
                "member-exact; use vmapens.fit(precision=...) for mixed precision"
            )

    def configure_callbacks(self) -> list[L.Callback]:
        """Refuse, before Lightning does, the Trainer options manual optimization cannot take:
        Lightning's message says to switch to automatic optimization, which would clip all
        members by one global norm. Named here with this module's own option."""
        trainer, api = self.trainer, "EnsembleModule: the Trainer's"
        if trainer.state.fn == TrainerFn.FITTING and trainer.gradient_clip_val:
            kind = "value" if trainer.gradient_clip_algorithm == "value" else "norm"
            raise ValueError(
                f"{api} `gradient_clip_val` must be None (manual optimization), got "
                f"{trainer.gradient_clip_val}; pass EnsembleModule(clip_grad_{kind}="
                f"{trainer.gradient_clip_val}), which clips each member as Lightning clips one"
            )
        if trainer.state.fn == TrainerFn.FITTING and trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"{api} `accumulate_grad_batches` must be 1, got "
                f"{trainer.accumulate_grad_batches}: each batch is one step; use larger batches"
            )
        return []

    def on_fit_start(self) -> None:
        """Refuse several optimizers and plateau schedulers that cannot be stepped per member."""
        if len(self.trainer.optimizers) != 1:
            raise ValueError(
                "EnsembleModule: `configure_optimizers` must return one StackedOptimizer (each "
                f"step is one make_step on it), got {len(self.trainer.optimizers)} optimizers"
            )
        for config in self.trainer.lr_scheduler_configs:
            if isinstance(config.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) or (
                isinstance(config.scheduler, ReduceLROnPlateau) and config.interval != "epoch"
            ):
                raise ValueError(
                    "EnsembleModule: a plateau `lr_scheduler` must be vmapens.optim's, interval "
                    f"'epoch' (one `monitor` value per member), got {config.scheduler!r}, "
                    f"interval {config.interval!r} (torch's reduces all members on one value)"
                )

    def configure_optimizers(self) -> StackedOptimizer:
        """The stacked optimizer (built from ``optimizer`` when it is a callable)."""
        spec = self._optimizer
        if spec is None:
            opt: Any = StackedAdam(self.ens, lr=1e-3)
        elif isinstance(spec, StackedOptimizer):
            opt = spec
        else:
            opt = spec(self.ens)
        if not isinstance(opt, StackedOptimizer):
            raise TypeError(
                "EnsembleModule: `optimizer` must build a vmapens.StackedOptimizer (its mask "
                f"freezes stopped members), got {type(opt).__name__}"
            )
        return opt

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The ensemble's forward: every output gains a leading member dimension."""
        return self.ens(*args, **kwargs)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        """One stacked step on ``batch = (inputs, targets)``; logs the per-member losses."""
        inputs, targets = batch
        inputs = tuple(inputs) if isinstance(inputs, list) else inputs
        opt: Any = self.optimizers()  # a LightningOptimizer, an instance of the stacked class
        if self._step is None or self._step_optimizer is not opt:
            # Built on Lightning's optimizer wrapper, whose step(mask=...) reaches the stacked
            # optimizer through the strategy: Lightning counts the step (global_step).
            self._step = make_step(self.ens, self.loss_fn, opt, check=self._check, **self._options)
            self._step_optimizer = opt
        active = self.active
        mask = None if bool(active.all()) else active
        losses = self._step(inputs, targets, mask)
        size = batch_rows(targets, member_dim=self._options["in_dims"] == 0)
        self.log("train_loss", losses.mean(), prog_bar=True, batch_size=size)
        self.log_dict(self._per_member("train_loss", losses), batch_size=size)
        self._step_schedulers(batch_idx)
        return losses.mean()

    def _step_schedulers(self, batch_idx: int) -> None:
        """Step the schedulers where automatic optimization would: ``"step"`` ones every
        ``frequency`` batches, ``"epoch"`` ones after the epoch's last batch (before its
        validation, which checkpoints may be written in), through ``lr_scheduler_step``.
        Right after the step, as Lightning does: callbacks' ``on_train_batch_end``
        (``ModelCheckpoint(every_n_train_steps=...)``) must see the stepped schedulers."""
        # Lightning's own rule for the epoch's last batch (limit_train_batches, iterables).
        last = self.trainer.fit_loop.epoch_loop._num_ready_batches_reached()
        for config in self.trainer.lr_scheduler_configs:
            count = batch_idx + 1 if config.interval == "step" else (self.current_epoch + 1) * last
            sched: Any = config.scheduler  # torch's plateau is refused in on_fit_start
            if not isinstance(sched, ReduceLROnPlateau) and count % config.frequency == 0 < count:
                step = functools.partial(self.lr_scheduler_step, sched, None)
                step_kept(sched, self.active, step)  # a stopped member's values stay

    def on_validation_epoch_start(self) -> None:
        """Reset the epoch's per-member sums and the metric objects."""
        self._sums, self._rows = {}, 0
        for copies in self._metric_lists.values():
            for m in copies:
                m.reset()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        """Each member's loss and metrics on ``batch = (inputs, targets)`` (shared by all)."""
        inputs, targets = batch
        out = self.ens(*_positional(inputs))
        rows = batch_rows(targets)
        values = {"loss": per_member(self.loss_fn)(out, targets)}
        mean = out.mean(0)
        for name, fn in self._metric_fns.items():
            members, one = metric_pair(fn)  # as fit's: `.item()` metrics member by member
            values[name] = members(out, targets)
            values[f"{name}/ensemble"] = torch.as_tensor(one(mean, targets))
        for key, v in values.items():
            weighted = v.detach().double() * rows
            self._sums[key] = self._sums[key] + weighted if key in self._sums else weighted
        self._rows += rows
        for copies in self._metric_lists.values():
            for i, m in enumerate(copies[:-1]):
                m.update(out[i], targets)
            copies[-1].update(mean, targets)

    def on_validation_epoch_end(self) -> None:
        """Log the per-member values; while fitting (not sanity checking), step plateaus, stop."""
        if self._rows == 0:
            return
        scores = {k: v / self._rows for k, v in self._sums.items()}
        for name, copies in self._metric_lists.items():
            scores[name] = torch.stack([torch.as_tensor(m.compute()).double() for m in copies[:-1]])
            scores[f"{name}/ensemble"] = torch.as_tensor(copies[-1].compute()).double()
        logged: dict[str, Tensor] = {}
        stage = "test" if self.trainer.testing else "val"
        for key, v in scores.items():
            name = f"{stage}_{key}"
            logged[name] = v.mean()
            if v.dim() > 0:
                logged.update(self._per_member(name, v))
        self.log_dict(logged)
        # trainer.validate() must leave the members as they are, as Lightning's EarlyStopping.
        if self.trainer.state.fn != TrainerFn.FITTING or self.trainer.sanity_checking:
            return
        watched = scores[self.monitor.removeprefix("val_")]
        # Plateaus follow end-of-epoch validation, before the checkpoints its end writes.
        if self.trainer.fit_loop.epoch_loop._num_ready_batches_reached():
            for config in self.trainer.lr_scheduler_configs:
                due = (self.current_epoch + 1) % config.frequency == 0
                sched: Any = config.scheduler  # not one of Lightning's scheduler types
                if isinstance(config.scheduler, ReduceLROnPlateau) and due:
                    if bool(self.active.all()):
                        self.lr_scheduler_step(sched, watched)
                    else:  # a stopped member's own plateau, its run over, steps no more
                        sched.step(watched, mask=self.active.clone())
        if self.patience is not None:
            self._early_stop(watched)

    test_step = validation_step
    on_test_epoch_start = on_validation_epoch_start
    on_test_epoch_end = on_validation_epoch_end

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        """Every member's output on ``(inputs, targets)``, ``(inputs,)`` or ``inputs``."""
        inputs = batch[0] if isinstance(batch, list) or positional(batch) is batch else batch
        return self.ens(*_positional(inputs))

    # Lightning's loops set back the `training` flag of each module they see after eval; the
    # members' (the meta template) are not among them, so the module restores every mode.

    def on_validation_model_eval(self) -> None:
        """Remember every module's mode (the members' too), then ``eval()``."""
        self._modes = [(m, m.training) for m in (*self.modules(), *self.ens.template.modules())]
        self.eval()  # one process, one device (setup): the trainer runs this very module

    def on_validation_model_train(self) -> None:
        """Every module back in the mode it had before validation, the members' too."""
        for m, mode in self._modes:
            m.training = mode

    on_test_model_eval = on_validation_model_eval
    on_test_model_train = on_validation_model_train
    on_predict_model_eval = on_validation_model_eval

    def on_predict_end(self) -> None:
        """The modes back after prediction (Lightning then sets the ones it sees alike)."""
        self.on_validation_model_train()

    # -- helpers -------------------------------------------------------------------------------

    def _per_member(self, name: str, values: Tensor) -> dict[str, Tensor]:
        return {f"{name}/member_{i}": v for i, v in zip(self.ids, values.detach().unbind())}

    def _early_stop(self, watched: Tensor) -> None:
        """Patience per member, as ``vmapens.callbacks.EarlyStopping``: the mask stops it."""
        watched = self.sign * watched.to(self.best.device)
        epoch = self.current_epoch
        improved = self.active & (watched < self.best)
        self.best.copy_(torch.where(improved, watched, self.best))
        self.best_epoch.copy_(torch.where(improved, epoch, self.best_epoch))
        self.bad.copy_(torch.where(improved, 0, self.bad + 1))
        assert self.patience is not None
        stop = self.active & (self.bad >= self.patience)
        self.stopped_epoch.copy_(torch.where(stop, epoch, self.stopped_epoch))
        self.active.copy_(self.active & ~stop)
        if not bool(self.active.any()):
            self.trainer.should_stop = True


def _positional(inputs: Any) -> tuple:
    """A batch's inputs as the forward's positional inputs: a list (as a DataLoader collates a
    dataset's tuple of inputs) as a tuple, then ``positional``."""
    return positional(tuple(inputs) if isinstance(inputs, list) else inputs)
