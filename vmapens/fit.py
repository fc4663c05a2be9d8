"""The training loop: ``fit`` (epochs, bagging, early stopping, divergence, resume)."""

from __future__ import annotations

import copy
import functools
import inspect
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ._autocompile import AutoStep
from ._checks import check_choice, check_int, check_writable_dir
from ._data import (
    IterableSource,
    MemberIterables,
    Stream,
    TensorSource,
    bootstrap_indices,
    check_member_dim,
    is_tensor_data,
    oob_mask,
    rows_of,
)
from ._loop import (
    Loop,
    fingerprint,
    hyperparameters_of,
    read_checkpoint,
    scheduler_options,
    to_device,
)
from ._metrics import check_monitor
from ._progress import progress_bar
from ._schedule import build_scheduler, step_scheduler
from .callbacks import Callback, Hooks
from .checkpoint import apply_parts
from .distributed import world_size
from .ensemble import Ensemble
from .history import History
from .optim import StackedAdam, StackedOptimizer
from .step import LossScale, check_optimizer, make_step

__all__ = ["Callback", "fit"]


def fit(
    ens: Ensemble,
    data: Any,
    loss_fn: Callable[[Any, Tensor], Tensor],
    *,
    epochs: int = 1,
    steps: int | None = None,
    optimizer: torch.optim.Optimizer | Callable[[Ensemble], torch.optim.Optimizer] | None = None,
    batch_size: int | None = None,
    shuffle: bool = True,
    bootstrap: bool = False,
    val_data: tuple[Any, Tensor] | str | None = None,
    in_dims: int | None = None,
    val_in_dims: int | None = None,
    scheduler: Any = None,
    scheduler_interval: str = "epoch",
    override: Sequence[str] = (),
    patience: int | None = None,
    restore_best: bool = True,
    metrics: Mapping[str, Any] | None = None,
    monitor: str = "val_loss",
    mode: str = "min",
    compile: bool | str = False,
    clip_grad_norm: float | None = None,
    clip_grad_value: float | None = None,
    precision: str | None = None,
    loss_scale: LossScale | None = None,
    progress: bool | Any = True,
    seed: int | None = None,
    callbacks: Sequence[Callback | Callable[[History], Any]] = (),
    checkpoint: str | os.PathLike | None = None,
    **hyperparameters: Any,
) -> History:
    """Train every member of ``ens`` and return a :class:`History`.

    An *epoch* is one pass over ``data`` or, with ``steps``, ``steps`` optimizer steps that
    cycle over the data (a new pass, reshuffled, starts whenever one ends). The history, the
    validation, early stopping, callbacks and checkpoints all work per epoch, so
    ``fit(data, loss, steps=1000)`` is 1000 steps and one history row, and
    ``fit(data, loss, epochs=10, steps=100)`` is 1000 steps in 10 rows.

    Each step runs ``vmapens.make_step``: every member's forward, ``loss_fn`` per member, the sum
    of the member losses back-propagated (each member gets exactly its own gradient).

    Args:
        ens: the ensemble to train, in the mode it should train in (``ens.train()``).
        data: ``(X, Y)`` tensors (``X`` may be a tuple of inputs), cut into batches of
            ``batch_size`` and reshuffled every pass; or any re-iterable of
            ``(inputs, targets)`` batches, such as a ``DataLoader``. With ``in_dims=0``,
            per-member data: ``(X, Y)`` tensors of shape ``[n, samples, ...]`` (member ``i``
            trains on ``X[i], Y[i]``, e.g. one fold each), or a list of ``n`` DataLoaders (one
            per member, batches of one shape per step).
        loss_fn: ``(output, target) -> scalar`` for one member, e.g. ``nn.CrossEntropyLoss()``.
        epochs: number of epochs.
        steps: optimizer steps per epoch (``None``: one pass over ``data``).
        optimizer: an optimizer over ``ens.parameters()``; or a ``vmapens.StackedOptimizer``
            class or a factory ``(ens) -> optimizer``, which ``fit`` calls as
            ``optimizer(ens, **hyperparameters)``. Default: ``vmapens.StackedAdam``. Freezing
            members (early stopping, divergence) needs a ``vmapens.StackedOptimizer``.
        batch_size: samples per batch for ``(X, Y)`` data (``None``: all of them).
        shuffle: reshuffle ``(X, Y)`` every pass, from ``seed`` and the pass number.
        bootstrap: bagging: each member trains on its own resample of ``(X, Y)`` (see
            :func:`bootstrap_indices`, keyed by the member's global index).
        val_data: ``(Xv, Yv)``: each member's validation loss after each epoch, computed in
            eval mode under ``torch.no_grad()`` in one forward (the training mode is restored);
            ``"oob"`` with ``bootstrap=True``: each member's loss on the training rows its
            resample left out (out-of-bag).
        in_dims: ``None`` (every member sees the same data) or ``0`` (per-member data, see
            ``data``).
        val_in_dims: ``0`` when ``val_data`` is per member (``[n, samples, ...]``).
        scheduler: an LR scheduler over ``optimizer``, or ``scheduler(optimizer)`` building
            one (use that with the default optimizer); stepped after every epoch (or every
            step with ``scheduler_interval="step"``). ``vmapens.ReduceLROnPlateau`` is
            stepped after every epoch with each member's validation loss: it needs
            ``val_data`` and ``scheduler_interval="epoch"`` (checked before the first step).
            Its state is in the checkpoint.
        scheduler_interval: ``"epoch"`` or ``"step"``.
        override: names of options that may differ from the checkpoint's when resuming
            (``"optimizer"``: this run's hyperparameters replace the stored ones; ``"val_data"``,
            ``"scheduler"``: this run's are used, the stored scheduler state is dropped; any
            loop option such as ``"batch_size"``). Without it a difference is an error.
        patience: stop a member once its validation loss has not improved for this many
            epochs; the other members carry on. Needs ``val_data``.
        restore_best: with ``val_data``, give each member its best-epoch parameters and
            buffers back at the end.
        metrics: name -> ``(output, target) -> scalar`` for one member (vmapped over the
            members like the loss; a torchmetrics ``Metric`` runs member by member), computed
            on ``val_data`` after each epoch in the same eval-mode forward as the validation
            loss: ``history.metrics[name]`` per member and ``history.ensemble_metrics[name]``
            for the output averaged over the members. Needs shared ``(X, Y)`` ``val_data``.
        monitor: what improvement means for ``patience``, ``restore_best`` and
            ``history.best_epoch``: ``"val_loss"`` or ``"val_<name>"`` for a metric.
        mode: ``"min"`` or ``"max"``: whether lower or higher ``monitor`` is better.
        compile: compile the training step (see ``make_step``); ``"auto"``: train eagerly and
            switch to the compiled step once the eager steps still to run are estimated to take
            longer than ``vmapens._autocompile.COMPILE_PAYS_AFTER_S`` (60 s), so a short run
            is never slowed by a compile. Results equal the eager ones up to round-off.
        clip_grad_norm: clip each member's gradient norm, as ``torch.nn.utils.clip_grad_norm_``
            clips a model alone (see ``make_step``).
        clip_grad_value: clamp each gradient element to ``[-v, v]`` (see ``make_step``).
        precision: ``"bf16"`` or ``"fp16"``: each member's forward and loss under
            ``torch.autocast`` as for that member alone; ``"fp16"`` with a per-member loss scale
            (one ``GradScaler`` per member), kept in the checkpoint (see ``make_step``).
        loss_scale: the ``vmapens.step.LossScale`` for ``"fp16"`` (default: GradScaler's).
        progress: ``True``: a tqdm bar on stderr when it is a terminal; ``False``: quiet; a
            text stream (``io.StringIO``, an open log file): the bar is drawn there always.
            Only rank 0 draws it when ``torch.distributed`` is initialised.
        seed: seeds shuffling and bootstrap resamples (``None``: drawn from torch's global
            RNG; pass one for sharded runs, so every process draws alike).
        callbacks: callables ``fn(history)`` run after each epoch, after the checkpoint is
            written; and ``vmapens.Callback`` objects, whose ``on_step_end(ctx)`` runs after
            every step and ``on_epoch_end(ctx)`` after each epoch, before the checkpoint (their
            ``state_dict()`` is in it; see ``vmapens.callbacks``).
        checkpoint: a file written atomically after every epoch. When it exists at the start,
            training resumes from it and ends exactly as an uninterrupted run would. Under
            ``torch.distributed`` each rank writes its members to a block file keyed by their
            global ids (in the directory ``<checkpoint>.members``) and rank 0 the rest to
            ``checkpoint``: a run resumes at any number of processes (docs/distributed.md).
        **hyperparameters: keyword arguments that are not ``fit`` options go to the optimizer
            ``fit`` builds: a float, or one value per member (sequence or 1-D tensor of
            length n), e.g. ``lr=[1e-3, 1e-2]``, ``momentum=0.9``. An error with an optimizer
            instance.

    Returns:
        The :class:`History`; its rows stop early when every member has stopped.

    Raises:
        ValueError: bad option values, options that need others (``patience`` without
            ``val_data``, ``bootstrap`` without tensor data), a checkpoint from another run.
        TypeError: ``patience`` with an optimizer that is not a StackedOptimizer, one-shot
            iterators, non-callable ``loss_fn`` or callbacks.

    Example:
        >>> from vmapens import Ensemble
        >>> ens = Ensemble(lambda: torch.nn.Linear(3, 1), n=4, seed=0)
        >>> x, y = torch.randn(64, 3), torch.randn(64, 1)
        >>> h = fit(ens, (x, y), torch.nn.MSELoss(), epochs=3, batch_size=16, progress=False,
        ...         seed=0, lr=[1e-3, 1e-2, 1e-2, 1e-1])
        >>> h.train_loss.shape
        torch.Size([3, 4])
    """
    api = "fit"
    if not isinstance(ens, Ensemble):
        raise TypeError(f"{api}: `ens` must be a vmapens.Ensemble, got {type(ens).__name__}")
    check_int(api, "epochs", epochs, minimum=1)
    for name, value in (("steps", steps), ("batch_size", batch_size), ("patience", patience)):
        if value is not None:
            check_int(api, name, value, minimum=1)
    if not callable(loss_fn):
        raise TypeError(f"{api}: `loss_fn` must be callable, got {type(loss_fn).__name__}")
    hooks = Hooks(tuple(callbacks), api)
    metrics = dict(metrics or {})
    check_monitor(api, monitor, mode, metrics)
    if metrics and (val_data is None or isinstance(val_data, str) or val_in_dims is not None):
        raise ValueError(f"{api}: `metrics` need shared `val_data` as (X, Y) tensors")
    for name, value in (("in_dims", in_dims), ("val_in_dims", val_in_dims)):
        if value not in (None, 0):
            raise ValueError(f"{api}: `{name}` must be None or 0, got {value!r}")
    oob = isinstance(val_data, str)
    if oob and (val_data != "oob" or not bootstrap):
        raise ValueError(
            f"{api}: `val_data` must be an (X, Y) tuple of tensors, or 'oob' with bootstrap=True; "
            f"got {val_data!r}" + ("" if bootstrap else " without bootstrap")
        )
    if val_data is not None and not oob and not is_tensor_data(val_data):
        raise ValueError(f"{api}: `val_data` must be an (X, Y) tuple of tensors")
    if val_in_dims == 0 and not oob and val_data is not None:
        check_member_dim(api, "val_data", val_data, len(ens))
    if patience is not None and val_data is None:
        raise ValueError(f"{api}: `patience` needs `val_data` to measure improvement")
    tensor_data = is_tensor_data(data)
    if bootstrap and not tensor_data:
        raise ValueError(f"{api}: `bootstrap=True` needs `data` as an (X, Y) tuple of tensors")
    if in_dims == 0 and tensor_data:
        check_member_dim(api, "data", data, len(ens))
    elif in_dims == 0 and not isinstance(data, (list, tuple)):
        raise TypeError(
            f"{api}: with `in_dims=0`, `data` must be (X, Y) tensors of shape [n, samples, ...] "
            f"or a list of n DataLoaders, got {type(data).__name__}"
        )
    check_choice(api, "scheduler_interval", scheduler_interval, ("epoch", "step"))
    check_choice(api, "compile", compile, (False, True, "auto"))
    if checkpoint is not None:
        check_writable_dir(api, "checkpoint", checkpoint)
    if isinstance(override, str) or not all(isinstance(o, str) for o in override):
        raise TypeError(f"{api}: `override` must be a sequence of option names, got {override!r}")
    optimizer = _build_optimizer(api, ens, optimizer, hyperparameters)
    maskable = isinstance(optimizer, StackedOptimizer)
    if patience is not None and not maskable:
        raise TypeError(
            f"{api}: `patience` freezes members through a vmapens.StackedOptimizer's mask, got "
            f"{type(optimizer).__name__}"
        )
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise TypeError(f"{api}: `seed` must be an int or None, got {type(seed).__name__}")
    scheduler = build_scheduler(
        api, scheduler, optimizer, scheduler_interval, validated=val_data is not None
    )

    options = {
        "steps": steps,
        "batch_size": batch_size,
        "shuffle": shuffle,
        "bootstrap": bootstrap,
        "patience": patience,
        "validated": val_data is not None,
        "restore_best": restore_best,
        "precision": precision,
        # Only when used: checkpoints of runs without metrics stay resumable.
        **({"metrics": sorted(metrics)} if metrics else {}),
        **({"monitor": (monitor, mode)} if (monitor, mode) != ("val_loss", "min") else {}),
        "in_dims": in_dims,
        "val_data": fingerprint(val_data),
        "optimizer": hyperparameters_of(optimizer),
        "scheduler": scheduler_options(scheduler),
    }
    shared_val = None if isinstance(val_data, str) else val_data
    loop = Loop(ens, optimizer, loss_fn, shared_val, patience,
                restore_best and val_data is not None, val_in_dims=val_in_dims)  # fmt: skip
    loop.scheduler = scheduler
    loop.hooks = hooks
    if metrics or monitor != "val_loss" or mode != "min":
        loop.track(metrics, monitor, mode)
    saved = None
    if checkpoint is not None and os.path.exists(checkpoint):
        saved = read_checkpoint(checkpoint, ens, options, seed, tuple(override))
        seed = saved["fit"]["options"]["seed"]
    elif seed is None:
        if world_size() > 1 and (bootstrap or shuffle):
            raise ValueError(f"{api}: a sharded ensemble needs an int `seed` (same on every rank)")
        seed = int(torch.randint(2**62, ()).item())
    options["seed"] = seed

    n, device = len(ens), next(ens.parameters()).device
    if tensor_data:
        boot = None
        if bootstrap:
            size = rows_of(data[0], in_dims == 0)
            boot = torch.stack([bootstrap_indices(size, seed, i) for i in ens.member_ids])
            if oob:
                loop.use_out_of_bag(to_device(data, device), oob_mask(boot, size), in_dims)
        member_dim = in_dims == 0
        source: Any = TensorSource(data, batch_size, shuffle, seed, boot, api, member_dim)
    elif in_dims == 0:
        source = MemberIterables(data, len(ens), api)
    else:
        source = IterableSource(data, api)
    loop.stream = Stream(source)
    loop.options = options
    per_member_data = bootstrap or in_dims == 0
    if precision == "fp16" and loss_scale is None:
        loss_scale = LossScale(len(ens), device=device)
    loop.loss_scale = loss_scale
    build = functools.partial(
        make_step, ens, loss_fn, optimizer, in_dims=0 if per_member_data else None,
        clip_grad_norm=clip_grad_norm, clip_grad_value=clip_grad_value, precision=precision,
        loss_scale=loss_scale,
    )  # fmt: skip
    # "auto" starts eager; the same checks ran either way before anything changes.
    step: Callable[..., Tensor] = build(compile=compile is True)
    if saved is not None:
        parts = {"ensemble": ens, "optimizer": optimizer, "history": loop.history, "fit": loop}
        if scheduler is not None and "scheduler" not in override:
            parts["scheduler"] = scheduler
        fresh = copy.deepcopy(optimizer.param_groups) if "optimizer" in override else None
        apply_parts(saved, parts, api, os.fspath(checkpoint or ""))
        if fresh is not None:  # this run's hyperparameters replace the stored ones
            for group, new in zip(optimizer.param_groups, fresh, strict=True):
                group.update({k: v for k, v in new.items() if k != "params"})
    loop.check_val(api)  # data that does not fit fails now, not after an epoch
    stream = loop.stream
    history = loop.history

    per_epoch = steps if steps is not None else source.length
    total = epochs * per_epoch if per_epoch else None
    if compile == "auto":
        left = None if total is None else total - history.epochs * (per_epoch or 0)
        step = AutoStep(step, functools.partial(build, compile=True), left)
    bar = progress_bar(progress, total, history.epochs * (per_epoch or 0))
    # Under torch.distributed every rank runs the same epochs (the stop test and the progress
    # totals are collectives at epoch ends); per-step bar updates would only show this rank.
    sharded = world_size() > 1
    try:
        for epoch in range(history.epochs, epochs):
            if loop.totals()["training"] == 0:
                break
            bar.set_description(f"epoch {epoch + 1}/{epochs}")
            summed, count, last_shown = torch.zeros(n, dtype=torch.float64, device=device), 0, 0.0
            while steps is None or count < steps:
                batch = stream.cycling() if steps is not None else stream.in_pass()
                if batch is None:
                    break
                inputs, targets = to_device(batch, device)
                losses = loop.step(step, inputs, targets, maskable)
                if scheduler is not None and scheduler_interval == "step":
                    scheduler.step()
                hooks.step_end(loop, epoch, losses)
                summed += losses.double()
                count += 1
                bar.update(1)
                if not bar.disable and not sharded and time.monotonic() - last_shown > 0.5:
                    bar.set_postfix_str(loop.describe(losses), refresh=False)
                    last_shown = time.monotonic()
            if count == 0:
                raise ValueError(f"{api}: `data` yielded no batches")
            loop.end_epoch(epoch, summed / count)
            if scheduler is not None:
                step_scheduler(scheduler, scheduler_interval, history)
            hooks.epoch_end(loop, epoch)
            bar.set_postfix_str(loop.describe(history.train_loss[-1]))
            if checkpoint is not None:
                loop.save(checkpoint)
            hooks.after_checkpoint(history)
    finally:
        bar.close()
    loop.finish()
    return history


def _build_optimizer(
    api: str, ens: Ensemble, optimizer: Any, hyperparameters: dict[str, Any]
) -> torch.optim.Optimizer:
    """``optimizer`` as ``fit`` takes it: None (StackedAdam), an instance, or a class or
    factory called as ``optimizer(ens, **hyperparameters)``."""
    if isinstance(optimizer, torch.optim.Optimizer):
        if hyperparameters:
            names = ", ".join(f"`{k}`" for k in hyperparameters)
            verb = "configures" if len(hyperparameters) == 1 else "configure"
            raise ValueError(
                f"{api}: {names} {verb} the optimizer that {api} builds, but `optimizer` is "
                f"already built ({type(optimizer).__name__}); give them to its constructor, or "
                "pass its class"
            )
        check_optimizer(api, ens, optimizer)
        return optimizer
    build = StackedAdam if optimizer is None else optimizer
    if isinstance(build, type) and not issubclass(build, StackedOptimizer):
        raise TypeError(
            f"{api}: an `optimizer` class must be a vmapens.StackedOptimizer, got "
            f"{build.__name__}; pass an instance over ens.parameters() or a factory "
            "`lambda ens: ...` instead"
        )
    if not callable(build):
        raise TypeError(
            f"{api}: `optimizer` must be an optimizer, a StackedOptimizer class or a factory "
            f"`(ens) -> optimizer`, got {type(build).__name__}"
        )
    name = getattr(build, "__name__", type(build).__name__)
    try:
        inspect.signature(build).bind(ens, **hyperparameters)
    except TypeError as err:
        raise TypeError(
            f"{api}: {name} does not take these keyword arguments ({err}); {api}'s keyword "
            "arguments that are not its own options go to the optimizer"
        ) from None
    except ValueError:  # no signature to check (a builtin): the call will say
        pass
    built = build(ens, **hyperparameters)
    check_optimizer(api, ens, built)
    return built
