"""The training loop: ``fit``, a short driver over the data, the step and the callbacks."""

from __future__ import annotations

import contextlib
import copy
import functools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ._autocompile import AutoStep
from ._data import (
    IterableSource,
    MemberIterables,
    TensorSource,
    data_generators,
    oob_mask,
    rng_state,
    set_rng_state,
    spread_inputs,
    warn_stacked_data,
)
from ._data_checks import is_tensor_data
from ._evaluate import Evaluator, to_device
from ._fit_checks import Checked, build_optimizer, check_arguments, warn_stacked_val
from ._precision import LossScale
from .callbacks import (
    Callback,
    Checkpoint,
    Context,
    Divergence,
    EarlyStopping,
    LRScheduler,
    ProgressBar,
)
from .distributed import world_size
from .ensemble import Ensemble
from .history import History
from .optim import StackedOptimizer
from .seeds import bootstrap_indices
from .step import make_step

__all__ = ["Callback", "fit"]


def fit(
    ens: Ensemble,
    data: Any,
    loss_fn: Callable[[Any, Tensor], Tensor],
    *,
    epochs: int = 1,
    steps: int | None = None,
    batch_size: int | None = None,
    shuffle: bool = True,
    bootstrap: bool = False,
    in_dims: int | tuple[int | None, int | None] | None = None,
    val_data: tuple[Any, Tensor] | str | None = None,
    metrics: Mapping[str, Any] | None = None,
    optimizer: torch.optim.Optimizer | Callable[[Ensemble], torch.optim.Optimizer] | None = None,
    scheduler: Any = None,
    patience: int | None = None,
    callbacks: Sequence[Callback | Callable[[History], Any]] = (),
    checkpoint: str | os.PathLike | None = None,
    progress: bool | Any = True,
    seed: int | None = None,
    **options: Any,
) -> History:
    """Train every member of ``ens`` and return a :class:`History`.

    An *epoch* is one pass over ``data`` or, with ``steps``, ``steps`` optimizer steps that
    cycle over the data (a new pass, reshuffled, starts whenever one ends). The history, the
    validation, the callbacks and checkpoints all work per epoch, so
    ``fit(data, loss, steps=1000)`` is 1000 steps and one history row, and
    ``fit(data, loss, epochs=10, steps=100)`` is 1000 steps in 10 rows.

    Each step runs ``vmapens.make_step``: every member's forward, ``loss_fn`` per member, the sum
    of the member losses back-propagated (each member gets exactly its own gradient). Around it
    run the callbacks (``vmapens.callbacks``), in this order: ``Divergence`` (always: a member
    whose loss is not finite stops), ``EarlyStopping`` (with ``val_data``: best epoch, patience,
    best-epoch restore), ``LRScheduler``, the other ``Callback`` objects of ``callbacks``,
    ``ProgressBar``, ``Checkpoint``; then the plain callables of ``callbacks``.

    Args:
        ens: the ensemble to train, in the mode it should train in (``ens.train()``).
        data: ``(X, Y)`` tensors (``X`` may be a tuple of inputs, ``Y`` a tuple or dict of
            targets such as ``(Y, W)`` with per-sample weights, cut alike), cut into batches of
            ``batch_size`` and reshuffled every pass; or any re-iterable of
            ``(inputs, targets)`` batches, such as a ``DataLoader`` (``inputs`` a tensor, or a
            tuple or list of them: a ``DataLoader`` collates a dataset's ``((u, v), y)``
            into a list). With ``in_dims=0``,
            per-member data: ``(X, Y)`` tensors of shape ``[n, samples, ...]`` (member ``i``
            trains on ``X[i], Y[i]``, e.g. one fold each), or a list of ``n`` DataLoaders (one
            per member, batches of one shape per step).
        loss_fn: ``(output, target) -> scalar`` for one member, e.g. ``nn.CrossEntropyLoss()``.
        epochs: number of epochs.
        steps: optimizer steps per epoch (``None``: one pass over ``data``).
        batch_size: samples per batch for ``(X, Y)`` data (``None``: all of them). Other
            ``data`` yields its own batches (a ``DataLoader``'s ``batch_size``): refused there.
        shuffle: reshuffle ``(X, Y)`` every pass, from ``seed`` and the pass number.
        bootstrap: bagging: each member trains on its own resample of ``(X, Y)`` (see
            :func:`vmapens.seeds.bootstrap_indices`, keyed by the member's global index).
        in_dims: ``None`` (every member sees the same data) or ``0`` (per-member data, see
            ``data``); a pair ``(data's, val_data's)`` when ``val_data`` is per member too
            (``[n, samples, ...]``), e.g. ``(0, 0)``.
        val_data: ``(Xv, Yv)``: each member's validation loss after each epoch, computed in
            eval mode under ``torch.no_grad()`` in one forward (the training mode is restored);
            ``"oob"`` with ``bootstrap=True``: each member's loss on the training rows its
            resample left out (out-of-bag). Adds ``EarlyStopping(patience=patience)`` (each
            member's best epoch in ``history.best_epoch``, its parameters and buffers given
            back at the end) unless ``callbacks`` holds an ``EarlyStopping``.
        metrics: name -> ``(output, target) -> scalar`` for one member (vmapped over the
            members like the loss; one that reads values, such as ``.item()``, and a
            torchmetrics ``Metric`` run member by member), computed
            on ``val_data`` after each epoch in the same eval-mode forward as the validation
            loss: ``history.metrics[name]`` per member and ``history.ensemble_metrics[name]``
            for the output averaged over the members. Needs shared ``(X, Y)`` ``val_data``.
            ``EarlyStopping(monitor="val_<name>")`` watches one. A name may not shadow a
            recorded table: ``"loss"`` (read as ``"val_loss"``), ``"train_loss"``,
            ``"val_loss"``, the loggers' ``"lr"``, ``"epoch"``, ``"member"``, nor another
            metric's ``"val_<name>"`` or ``"ensemble_<name>"``.
        optimizer: an optimizer over ``ens.parameters()``; or a ``vmapens.StackedOptimizer``
            class or a factory ``(ens) -> optimizer``, which ``fit`` calls as
            ``optimizer(ens, **hyperparameters)``. Default: ``vmapens.StackedAdam``. Freezing
            members (early stopping, divergence) needs a ``vmapens.StackedOptimizer``.
        scheduler: an LR scheduler over ``optimizer``, or ``scheduler(optimizer)`` building
            one: ``callbacks.LRScheduler(scheduler)``, stepped after every epoch
            (``LRScheduler(s, interval="step")`` for every step). With ``checkpoint``, a torch
            scheduler built on ``optimizer`` must be given here (its state is checkpointed).
        patience: stop a member once its validation loss has not improved for this many
            epochs; the other members carry on (``callbacks.EarlyStopping(patience=...)``).
        callbacks: ``vmapens.Callback`` objects (see ``vmapens.callbacks``), and plain callables
            ``fn(history)`` run after each epoch, after the checkpoint is written.
        checkpoint: a file written atomically after every epoch
            (``callbacks.Checkpoint(checkpoint)``). When it exists at the start, training
            resumes from it and ends exactly as an uninterrupted run would; every argument of
            this call is compared with the checkpoint's first.
        progress: ``True``: a tqdm bar on stderr when it is a terminal; ``False``: quiet; a
            text stream (``io.StringIO``, an open log file): the bar is drawn there always.
            Only rank 0 draws it when ``torch.distributed`` is initialised.
        seed: seeds shuffling and bootstrap resamples of ``(X, Y)`` data (``None``: drawn
            from torch's global RNG when the data is shuffled or resampled, else not at all,
            so a DataLoader gets the global RNG a plain loop would; pass one for sharded runs,
            so every process draws alike).
        **options: ``make_step``'s options configure the step: ``compile`` (``True``, or
            ``"auto"``: train eagerly and switch to the compiled step once the eager steps
            still to run are estimated to take longer than
            ``vmapens._autocompile.COMPILE_PAYS_AFTER_S``), ``clip_grad_norm``,
            ``clip_grad_value``, ``precision`` (``"bf16"``, ``"fp16"``: with a per-member loss
            scale kept in the checkpoint), ``loss_scale``. Every other keyword goes to the
            optimizer ``fit`` builds: a float, or one value per member (sequence or 1-D tensor
            of length n), e.g. ``lr=[1e-3, 1e-2]``, ``momentum=0.9``.

    Returns:
        The :class:`History`; its rows stop early when every member has stopped.

    Raises:
        ValueError: bad option values, options that need others (``patience`` without
            ``val_data``, ``bootstrap`` or ``batch_size`` without tensor data), a checkpoint
            from another run, ``data`` or ``val_data`` that does not fit, a metric that fails
            on ``val_data`` or gives no real scalar per member (``TypeError`` when it raised
            one); all before the first step.
        TypeError: a keyword that moved in 0.3.0 (the message gives the new spelling),
            ``patience`` with an optimizer that is not a StackedOptimizer, one-shot iterators,
            non-callable ``loss_fn`` or callbacks.

    Example:
        >>> from vmapens import Ensemble
        >>> ens = Ensemble(lambda: torch.nn.Linear(3, 1), n=4, seed=0)
        >>> x, y = torch.randn(64, 3), torch.randn(64, 1)
        >>> h = fit(ens, (x, y), torch.nn.MSELoss(), epochs=3, batch_size=16, progress=False,
        ...         seed=0, lr=[1e-3, 1e-2, 1e-2, 1e-1])
        >>> h.train_loss.shape
        torch.Size([3, 4])
    """
    api, args = "fit", dict(locals())
    c = check_arguments(api, args)
    warn_stacked_data(api, data, len(ens), c.data_dims)  # [n, samples, ...] without in_dims
    if c.data_dims == 0 and c.val_dims is None:  # per-member data, val_data read as shared
        warn_stacked_val(api, data, val_data, len(ens))
    opt = build_optimizer(api, ens, optimizer, c.hyperparameters)
    device, n = next(ens.parameters()).device, len(ens)
    history = History.empty(list(ens.member_ids), val_data is not None, list(c.metrics))
    step_options = dict(c.step_options)
    compile = step_options.pop("compile")
    if step_options["precision"] == "fp16" and step_options["loss_scale"] is None:
        step_options["loss_scale"] = LossScale(n, device=device)
    build = functools.partial(make_step, ens, loss_fn, opt,
                              in_dims=0 if bootstrap or c.data_dims == 0 else None, **step_options)  # fmt: skip
    step: Callable[..., Tensor] = build(compile=compile is True)  # "auto" starts eager
    objects, observers = _assemble(api, args)
    _check_sharded_seed(api, args, objects)
    arguments = {k: v for k, v in args.items() if k != "options"} | c.step_options
    ctx = Context(ens, opt, history, objects, arguments, step_options["loss_scale"])
    evaluator = Evaluator(ens, loss_fn, c.val, c.val_dims, c.metrics)
    # `val_data`, the metrics and the data are checked before the callbacks start (they check
    # their settings, then build on the optimizer, a scheduler, and resume), so a refused call
    # changes nothing; the seed is drawn after them, as a resume gives it.
    evaluator.check(api)  # one forward, loss and metrics: fails now, not after an epoch
    source = _source(api, ctx, data, c)  # draws nothing: a DataLoader is not iterated yet
    # A scheduler is built, then a resume can still be refused, and the data is checked by the
    # first step: until that step is done, a refused run gives the optimizer and RNG back.
    kept = _Kept(opt, data_generators(data))  # a DataLoader's own generator is drawn too
    with kept.on_error():
        for cb in objects:
            cb.on_fit_start(ctx)  # checks, then a resume (Checkpoint runs last)
        ctx.stream.source = _seeded(api, ctx, source, data, c, evaluator)
    ctx.steps_per_epoch = steps if steps is not None else ctx.stream.source.length
    if compile == "auto":
        per_epoch = ctx.steps_per_epoch
        left = None if per_epoch is None else (epochs - history.epochs) * per_epoch
        step = AutoStep(step, functools.partial(build, compile=True), left)
    masked = isinstance(opt, StackedOptimizer)  # the mask freezes stopped members whole
    eager_cpu = compile is False and device.type == "cpu"
    per_step = [cb for cb in objects if type(cb).on_step_end is not Callback.on_step_end]
    first = ctx.step  # a resume's step count
    try:
        for cb in objects:
            cb.on_train_start(ctx)
        for epoch in range(history.epochs, epochs):
            if ctx.totals()["training"] == 0:
                break
            ctx.epoch = epoch
            for cb in objects:
                cb.on_epoch_start(ctx)
            summed, count = torch.zeros(n, dtype=torch.float64, device=device), 0
            while steps is None or count < steps:
                batch = ctx.stream.cycling() if steps is not None else ctx.stream.in_pass()
                if batch is None:
                    break
                inputs, targets = to_device(batch, device)
                inputs = tuple(inputs) if isinstance(inputs, list) else inputs  # collated
                # Every member active: no mask, so the eager optimizer skips the masked path's
                # copies. Not on an accelerator (reading `all()` would sync every step), not
                # compiled (a mask appearing mid-run would compile the step again).
                everyone = eager_cpu and bool(ctx._active.all())
                mask = {"mask": ctx._active} if masked and not everyone else {}
                ctx.losses, ctx.step = step(inputs, targets, **mask), ctx.step + 1
                for cb in per_step:
                    cb.on_step_end(ctx)
                summed, count = summed + ctx.losses.double(), count + 1
            if count == 0:
                raise ValueError(f"{api}: `data` yielded no batches")
            ctx.running = history.stopped_epoch == -1
            diverged = history.diverged | (ctx.running & ~ctx._active.cpu())
            evaluator.record(history, summed / count, ctx.running, diverged)
            ctx.losses = history.train_loss[-1]
            for cb in objects:
                cb.on_epoch_end(ctx)
            for fn in observers:
                fn(history)
        for cb in objects:
            cb.on_fit_end(ctx)
    except BaseException:
        if ctx.step == first:  # refused by the first step (data that does not fit, the check)
            kept.restore()
        raise
    finally:
        for cb in objects:
            cb.teardown(ctx)
    return history


def _assemble(
    api: str, args: dict[str, Any]
) -> tuple[list[Callback], list[Callable[[History], Any]]]:
    """The run's callbacks, in the order they run, from ``callbacks`` and the shortcuts; and
    the plain callables."""
    objects: list[Callback] = []
    observers: list[Callable[[History], Any]] = []
    for k, cb in enumerate(args["callbacks"]):
        if isinstance(cb, Callback):
            objects.append(cb)
        elif callable(cb):
            observers.append(cb)
        else:
            raise TypeError(
                f"{api}: `callbacks[{k}]` must be callable (fn(history)) or a "
                f"vmapens.Callback, got {type(cb).__name__}"
            )

    def given(kind: type, shortcut: str) -> bool:
        found = any(isinstance(cb, kind) for cb in objects)
        # `is`, not `in (None, True)`: patience=1 equals True and was dropped without a word.
        if found and args[shortcut] is not None and args[shortcut] is not True:
            raise ValueError(
                f"{api}: `{shortcut}` builds a callbacks.{kind.__name__}, but `callbacks` holds one "
                "already; give the setting to that one"
            )
        return found

    built: list[Callback] = (
        [] if any(isinstance(cb, Divergence) for cb in objects) else [Divergence()]
    )
    if not given(EarlyStopping, "patience") and args["val_data"] is not None:
        built.append(EarlyStopping(patience=args["patience"]))
    if args["scheduler"] is not None:
        built.append(LRScheduler(args["scheduler"]))
    if not given(ProgressBar, "progress"):
        objects.append(ProgressBar(args["progress"]))
    if not given(Checkpoint, "checkpoint") and args["checkpoint"] is not None:
        objects.append(Checkpoint(args["checkpoint"]))
    rank = (Divergence, EarlyStopping, LRScheduler, Callback, ProgressBar, Checkpoint)
    ordered = sorted(built + objects, key=lambda cb: _first(rank, cb))
    return ordered, observers


def _first(kinds: tuple[type, ...], cb: Callback) -> int:
    """Where ``cb`` runs: the first of ``kinds`` it is an instance of (``Callback`` catches
    every user callback; the sort keeps their order)."""
    order = [k for k, kind in enumerate(kinds) if isinstance(cb, kind) and kind is not Callback]
    return order[0] if order else kinds.index(Callback)


class _Kept:
    """``opt``'s hyperparameters and ``step``, torch's global RNG and ``generators`` (the data's
    own), as they were when made.

    A torch scheduler built on ``opt`` sets ``lr`` (``fill_`` for a tensor ``lr``), adds
    ``initial_lr`` and wraps ``opt.step``, and ``fit`` draws its seed from the RNG: a run
    refused before its first step (a resume refused, data that does not fit) gives them back,
    so a second call with the same optimizer starts from the same learning rates.
    """

    def __init__(self, opt: torch.optim.Optimizer, generators: list[torch.Generator]) -> None:
        self.opt, self.generators, self.rng = opt, generators, rng_state(generators)
        self.groups = [
            {k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups
        ]
        self.step = vars(opt).get("step")

    @contextlib.contextmanager
    def on_error(self) -> Iterator[None]:
        try:
            yield
        except BaseException:
            self.restore()
            raise

    def restore(self) -> None:
        opt = self.opt
        with torch.no_grad():
            for group, saved in zip(opt.param_groups, self.groups, strict=True):
                for k in [k for k in group if k != "params" and k not in saved]:
                    del group[k]
                for k, v in saved.items():
                    if isinstance(group[k], Tensor) and isinstance(v, Tensor):
                        group[k].copy_(v)  # the tensor itself: a scheduler holds on to it
                    else:
                        group[k] = v
        if self.step is None:
            vars(opt).pop("step", None)
        else:
            opt.step = self.step  # type: ignore[method-assign]
        set_rng_state(self.rng, self.generators)


def _source(api: str, ctx: Context, data: Any, c: Checked) -> Any:
    """The batches of the run, checked. Tensor data's order and resamples need the run's seed,
    which a resume may give: ``_seeded`` keys them."""
    ens, args = ctx.ensemble, ctx.arguments
    if not is_tensor_data(data):
        return (
            MemberIterables(data, len(ens), api) if c.data_dims == 0 else IterableSource(data, api)
        )
    return TensorSource(data, args["batch_size"], args["shuffle"], 0, None, api, c.data_dims == 0)


_SEED_NEEDED = "{api}: a sharded ensemble needs an int `seed` (same on every rank)"


def _needs_seed(args: dict[str, Any]) -> bool:
    """Every rank must shuffle and resample alike: one seed, not one drawn per process."""
    return world_size() > 1 and bool(args["bootstrap"] or args["shuffle"])


def _check_sharded_seed(api: str, args: dict[str, Any], objects: Sequence[Callback]) -> None:
    """Refuse a sharded run without a seed before any callback starts (a scheduler is built
    on the optimizer there); a checkpoint to resume from gives its seed."""
    resuming = any(isinstance(cb, Checkpoint) and os.path.exists(cb.path) for cb in objects)
    if args["seed"] is None and _needs_seed(args) and not resuming:
        raise ValueError(_SEED_NEEDED.format(api=api))


def _seeded(
    api: str, ctx: Context, source: Any, data: Any, c: Checked, evaluator: Evaluator
) -> Any:
    """``source`` keyed by the run's seed, drawn now unless given or resumed: tensor data
    shuffled and, with ``bootstrap``, resampled by it."""
    ens, args = ctx.ensemble, ctx.arguments
    if ctx.seed is None and _needs_seed(args):  # a checkpoint at the path held none
        raise ValueError(_SEED_NEEDED.format(api=api))
    # Drawn only for what uses it: a DataLoader shuffling from torch's global RNG must get the
    # orders a plain loop gets from the same RNG state (docs/fit.md), and dropout its masks.
    keyed = isinstance(source, TensorSource) and (source.shuffle or bool(args["bootstrap"]))
    if ctx.seed is None and keyed:
        ctx.seed = int(torch.randint(2**62, ()).item())
    if not isinstance(source, TensorSource):
        return source
    seed = 0 if ctx.seed is None else ctx.seed  # None: nothing is shuffled or resampled
    boot = None
    if args["bootstrap"]:
        size = source.size
        boot = torch.stack([bootstrap_indices(size, seed, i) for i in ens.member_ids])
        if c.oob:
            device = next(ens.parameters()).device
            rows = to_device(spread_inputs(data), device)  # [x1, x2]: forward(x1, x2)
            evaluator.use_out_of_bag(rows, oob_mask(boot, size), c.data_dims)
    source.seed, source.boot = seed, boot  # checked by _source: keyed now
    return source
