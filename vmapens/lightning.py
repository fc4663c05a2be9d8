"""Lightning integration: an Ensemble trained by ``lightning.Trainer.fit``.

Optional: needs the ``lightning`` package (``pip install "vmapens[lightning]"``); ``import
vmapens`` does not import this module.
"""

from __future__ import annotations

import copy
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

from ._checks import check_choice, check_int
from .ensemble import Ensemble, check_ensemble
from .losses import per_member
from .optim import StackedAdam, StackedOptimizer
from .step import Step, make_step

__all__ = ["EnsembleModule"]

#: Trainer precisions the module accepts: the ensemble's own dtype, unchanged or float64.
#: Mixed precision goes through ``make_step(precision=...)``, which autocasts member by
#: member; Lightning's autocast around the whole step would not be member-exact.
PRECISIONS = ("32-true", "64-true")

OptimizerArg = StackedOptimizer | Callable[[Ensemble], StackedOptimizer]


class EnsembleModule(L.LightningModule):
    """A ``LightningModule`` that trains every member of an ``Ensemble`` at once.

    ``training_step`` runs one ``vmapens.make_step`` step (manual optimization: forward,
    per-member loss, the sum back-propagated, the stacked optimizer's update), so each member
    trains exactly as it would alone with ``torch.optim``. It logs ``train_loss`` (the mean
    over the members) and ``train_loss/member_{i}``. ``validation_step`` computes each
    member's loss on the batch; at the end of the validation epoch the module logs
    ``val_loss/member_{i}`` (the batch-size weighted mean of the member's batch losses, as
    ``self.log(on_epoch=True)`` averages) and ``val_loss`` (their mean over the members), and
    for each entry of ``metrics``: ``val_{name}/member_{i}``, ``val_{name}`` (mean over the
    members) and ``val_{name}/ensemble`` (the metric of the output averaged over the
    members). ``i`` is the member's global id.

    With ``patience``, a member whose ``monitor`` value has not improved for ``patience``
    validation epochs stops: the optimizer's mask freezes its parameters, optimizer state
    and buffers, and the others carry on; when every member has stopped, the module sets
    ``trainer.should_stop``. ``stopped_epoch`` and ``best_epoch`` (buffers, ``-1`` for none)
    say when. Members keep the state they stopped with (no best-epoch restore). As for
    Lightning's ``EarlyStopping``, only validation inside ``trainer.fit`` counts:
    ``trainer.validate`` and the sanity check log the values and change nothing.

    Batches are ``(inputs, targets)``; ``inputs`` is the member's single positional input or
    a tuple of them, and a list counts as a tuple (a ``DataLoader`` collates the tuple
    ``((u, v), y)`` a dataset returns into lists).

    Checkpoints: the module's state_dict holds the members, the mask and the early-stopping
    state; Lightning saves the optimizer state itself; ``on_save_checkpoint`` adds the global
    CPU (and CUDA) RNG state, which the data loader's shuffle and dropout draw from, and
    loading a checkpoint restores it. So ``trainer.fit(module, ..., ckpt_path=...)`` from a
    checkpoint written at an epoch's end (``ModelCheckpoint``'s default) continues exactly as
    the run that wrote it would have.

    One process, one device: Lightning's multi-process strategies (DDP and the like) broadcast
    rank 0's parameters to every process and average gradients over processes, which would
    mix members that must train apart. ``setup`` refuses them; shard the members with
    ``vmapens.fit`` under ``torchrun`` instead (docs/distributed.md).

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
            ``monitor`` not ``"val_loss"`` or ``"val_<name>"`` of ``metrics``.

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
        if not callable(loss_fn):
            raise TypeError(f"{api}: `loss_fn` must be callable, got {type(loss_fn).__name__}")
        if optimizer is not None and not (
            isinstance(optimizer, StackedOptimizer) or callable(optimizer)
        ):
            raise TypeError(
                f"{api}: `optimizer` must be a vmapens.StackedOptimizer or a callable (ens) -> "
                f"StackedOptimizer, got {type(optimizer).__name__}"
            )
        if in_dims not in (None, 0):
            raise ValueError(f"{api}: `in_dims` must be None or 0, got {in_dims!r}")
        if patience is not None:
            check_int(api, "patience", patience, minimum=1)
        check_choice(api, "mode", mode, ("min", "max"))
        metrics = dict(metrics or {})
        for name, fn in metrics.items():
            if not isinstance(name, str) or not (callable(fn) or _is_metric_object(fn)):
                raise TypeError(
                    f"{api}: `metrics` must map names to callables (output, target) -> scalar or "
                    f"metric objects, got {name!r}: {type(fn).__name__}"
                )
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
            if _is_metric_object(fn):
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
                f"{type(trainer.strategy).__name__} with {trainer.world_size} processes: "
                "Lightning's multi-process strategies broadcast rank 0's parameters and average "
                "gradients over the processes, which would mix members that must train apart. "
                "To spread members over processes, shard them with vmapens.fit under torchrun "
                "(Ensemble(..., shard=True), docs/distributed.md)"
            )
        if trainer.precision not in PRECISIONS:
            raise ValueError(
                f"{api}: the Trainer's `precision` must be one of {list(PRECISIONS)}, got "
                f"{trainer.precision!r}: Lightning's autocast around the whole step is not "
                "member-exact; use vmapens.make_step(precision=...) or vmapens.fit for mixed "
                "precision"
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
        size = targets.shape[1] if self._options["in_dims"] == 0 else targets.shape[0]
        self.log("train_loss", losses.mean(), prog_bar=True, batch_size=size)
        self.log_dict(self._per_member("train_loss", losses), batch_size=size)
        return losses.mean()

    def on_validation_epoch_start(self) -> None:
        """Reset the epoch's per-member sums and the metric objects."""
        self._sums, self._rows = {}, 0
        for copies in self._metric_lists.values():
            for m in copies:
                m.reset()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        """Each member's loss and metrics on ``batch = (inputs, targets)`` (shared by all)."""
        inputs, targets = batch
        out = self.ens(*(inputs if isinstance(inputs, (tuple, list)) else (inputs,)))
        rows = targets.shape[0]
        values = {"loss": per_member(self.loss_fn)(out, targets)}
        mean = out.mean(0)
        for name, fn in self._metric_fns.items():
            values[name] = per_member(fn)(out, targets)
            values[f"{name}/ensemble"] = torch.as_tensor(fn(mean, targets))
        for key, v in values.items():
            weighted = v.detach().double() * rows
            self._sums[key] = self._sums[key] + weighted if key in self._sums else weighted
        self._rows += rows
        for copies in self._metric_lists.values():
            for i, m in enumerate(copies[:-1]):
                m.update(out[i], targets)
            copies[-1].update(mean, targets)

    def on_validation_epoch_end(self) -> None:
        """Log the epoch's per-member values; while fitting (not in the sanity check), stop
        members."""
        if self._rows == 0:
            return
        scores = {k: v / self._rows for k, v in self._sums.items()}
        for name, copies in self._metric_lists.items():
            scores[name] = torch.stack([torch.as_tensor(m.compute()).double() for m in copies[:-1]])
            scores[f"{name}/ensemble"] = torch.as_tensor(copies[-1].compute()).double()
        logged: dict[str, Tensor] = {}
        for key, v in scores.items():
            name = f"val_{key}"
            if v.dim() == 0:
                logged[name] = v
            else:
                logged[name] = v.mean()
                logged.update(self._per_member(name, v))
        self.log_dict(logged)
        # trainer.validate() must leave the members as they are, as Lightning's EarlyStopping.
        fitting = self.trainer.state.fn == TrainerFn.FITTING
        if self.patience is not None and fitting and not self.trainer.sanity_checking:
            self._early_stop(scores[self.monitor.removeprefix("val_")])

    # Lightning's loops put the module in eval mode and afterwards set back the `training`
    # flag of each module it can see. The ensemble's member modules (its meta template) are
    # not among them: left in eval mode, every later training step would run BatchNorm and
    # dropout as in evaluation. So the module restores every mode itself.

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

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add the global RNG state, which shuffling and dropout draw from."""
        rng: dict[str, Any] = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        checkpoint["vmapens"] = {"rng": rng}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restore the RNG state ``on_save_checkpoint`` saved."""
        rng = checkpoint.get("vmapens", {}).get("rng")
        if rng is not None:
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])

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


def _is_metric_object(fn: Any) -> bool:
    """An object that accumulates: ``reset``, ``update`` and ``compute`` (torchmetrics)."""
    return all(callable(getattr(fn, a, None)) for a in ("reset", "update", "compute"))
