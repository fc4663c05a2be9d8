"""Every argument check of ``fit``, up front, before anything changes; the optimizer it builds."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import optree
import torch

from ._checks import check_choice, check_int, check_loss_fn, check_writable_dir
from ._data import check_member_dim, spread_inputs
from ._data_checks import is_tensor_data
from ._metrics import check_metrics
from ._step_parts import check_optimizer
from .ensemble import Ensemble, check_ensemble
from .optim import StackedAdam, StackedOptimizer
from .optim.twins import REFUSED
from .step import make_step

__all__ = [
    "MOVED",
    "STEP_OPTIONS",
    "Checked",
    "build_optimizer",
    "check_arguments",
    "check_metric_names",
]

#: Names a metric cannot take, and what they would shadow: the History's loss tables (a metric
#: is also read as ``"val_<name>"``, as EarlyStopping's ``monitor`` reads it) and the loggers'
#: other per-member columns.
RESERVED_METRIC_NAMES = {
    "loss": "the validation loss 'val_loss' (a metric `name` is also read as 'val_<name>')",
    "train_loss": "the History's training loss 'train_loss'",
    "val_loss": "the History's validation loss 'val_loss'",
    **{k: f"the loggers' column {k!r}" for k in ("lr", "epoch", "member")},
}

#: How others read metric ``name``: prefix -> who reads it so.
_ALIASES = {
    "val_": "EarlyStopping's `monitor`, vmapens.selection and Sweep",
    "ensemble_": "the loggers' column of the averaged ensemble",
}

#: ``fit`` keywords of 0.2 that moved in 0.3.0, and where to (CHANGELOG.md lists them too).
MOVED = {
    "val_in_dims": "in_dims=(<data's in_dims>, 0)",
    "scheduler_interval": (
        "callbacks=[vmapens.callbacks.LRScheduler(scheduler, interval='step')] instead of "
        "scheduler="
    ),
    "override": "callbacks=[vmapens.callbacks.Checkpoint(path, override=...)] instead of checkpoint=",
    "restore_best": "callbacks=[vmapens.callbacks.EarlyStopping(patience=..., restore_best=...)]",
    "monitor": "callbacks=[vmapens.callbacks.EarlyStopping(monitor=..., mode=..., patience=...)]",
    "mode": "callbacks=[vmapens.callbacks.EarlyStopping(monitor=..., mode=..., patience=...)]",
}

#: Keyword arguments of ``fit`` that configure the step: ``make_step``'s own options, read from
#: its signature (``in_dims`` is ``fit``'s, with another meaning). Every other keyword that is
#: not ``fit``'s goes to the optimizer.
STEP_OPTIONS = {
    name: p.default
    for name, p in inspect.signature(make_step).parameters.items()
    if p.kind is p.KEYWORD_ONLY and name != "in_dims"
}


@dataclass
class Checked:
    """``fit``'s arguments sorted after the checks."""

    step_options: dict[str, Any]
    hyperparameters: dict[str, Any]
    metrics: dict[str, Any]
    data_dims: int | None
    val_dims: int | None
    oob: bool
    val: tuple[Any, Any] | None = field(default=None)  # shared or per-member (X, Y)


def check_arguments(api: str, args: dict[str, Any]) -> Checked:
    """Check ``fit``'s arguments (by name, as ``fit`` got them); nothing changes on error."""
    ens, data, loss_fn, options = args["ens"], args["data"], args["loss_fn"], args["options"]
    for old, new in MOVED.items():
        if old in options:
            raise TypeError(f"{api}: `{old}` moved in vmapens 0.3.0: pass {new}")
    check_ensemble(api, ens)
    check_int(api, "epochs", args["epochs"], minimum=1)
    for name in ("steps", "batch_size", "patience"):
        if args[name] is not None:
            check_int(api, name, args[name], minimum=1)
    check_loss_fn(api, loss_fn)
    seed = args["seed"]
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise TypeError(f"{api}: `seed` must be an int or None, got {type(seed).__name__}")
    for name in ("shuffle", "bootstrap"):  # a string "no" would be read as True, silently
        if not isinstance(args[name], bool):
            raise TypeError(f"{api}: `{name}` must be a bool, got {type(args[name]).__name__}")
    data_dims, val_dims = _in_dims(api, args["in_dims"])
    val_data, bootstrap = args["val_data"], args["bootstrap"]
    for name, kind, example in (
        ("metrics", Mapping, "{name: fn}"),
        ("callbacks", Sequence, "[...]"),
    ):
        value = args[name]
        if value is not None and (not isinstance(value, kind) or isinstance(value, str)):
            raise TypeError(
                f"{api}: `{name}` must be a {kind.__name__.lower()} ({name}={example}), got "
                f"{type(value).__name__}"
            )
    metrics = dict(args["metrics"] or {})
    check_metrics(api, metrics)
    check_metric_names(api, metrics)
    if metrics and (val_data is None or isinstance(val_data, str) or val_dims is not None):
        got = "no `val_data`" if val_data is None else f"val_data={val_data!r}"
        got = f"per-member `val_data` (in_dims={val_dims})" if val_dims is not None else got
        raise ValueError(
            f"{api}: `metrics` need shared `val_data` as (X, Y) tensors, got {got}: give shared "
            "(X, Y), or score each member's own rows in a Callback's `on_epoch_end`"
        )
    oob = isinstance(val_data, str)
    if oob and (val_data != "oob" or not bootstrap):
        raise ValueError(
            f"{api}: `val_data` must be an (X, Y) tuple of tensors, or 'oob' with bootstrap=True; "
            f"got {val_data!r}" + ("" if bootstrap else " without bootstrap")
        )
    if val_data is not None and not oob and not is_tensor_data(val_data):
        pair = isinstance(val_data, tuple) and len(val_data) == 2
        both = pair and all(isinstance(part, (tuple, list)) for part in val_data)
        raise ValueError(
            f"{api}: `val_data` must be an (X, Y) tuple of tensors"
            + (
                "; a tuple X with a tuple Y reads as two batches (as in `data`): give the "
                "targets as one tensor or a dict ({'y': y, 'mask': m})"
                if both
                else ""
            )
        )
    if val_dims == 0 and not oob and val_data is not None:
        check_member_dim(api, "val_data", val_data, len(ens))
    if args["patience"] is not None and val_data is None:
        raise ValueError(f"{api}: `patience` needs `val_data` to measure improvement")
    tensor_data = is_tensor_data(data)
    if oob and tensor_data and not isinstance(data[1], torch.Tensor):  # cut row by row per member
        raise ValueError(
            f"{api}: `val_data='oob'` needs the targets of `data` as one tensor, got "
            f"{type(data[1]).__name__}; pass `val_data` as (X, Y) tensors instead"
        )
    if bootstrap and not tensor_data:
        raise ValueError(f"{api}: `bootstrap=True` needs `data` as an (X, Y) tuple of tensors")
    if args["batch_size"] is not None and not tensor_data:  # it would be ignored, silently
        raise ValueError(
            f"{api}: `batch_size` cuts `data` given as (X, Y) tensors; this `data` "
            f"({type(data).__name__}) yields its own batches: set their size there "
            "(DataLoader(..., batch_size=...)) and leave `batch_size` None"
        )
    if tensor_data and ens.backend != "loop":  # one member after another takes uint8 as alone
        _check_class_targets(api, loss_fn, data[1])
    if data_dims == 0 and tensor_data:
        check_member_dim(api, "data", data, len(ens))
    elif data_dims == 0 and not isinstance(data, (list, tuple)):
        raise TypeError(
            f"{api}: with `in_dims=0`, `data` must be (X, Y) tensors of shape [n, samples, ...] "
            f"or a list of n DataLoaders, got {type(data).__name__}"
        )
    checkpoint = args["checkpoint"]
    if checkpoint is not None:
        check_writable_dir(api, "checkpoint", checkpoint)
    step_options = {k: options.get(k, default) for k, default in STEP_OPTIONS.items()}
    check_choice(api, "compile", step_options["compile"], (False, True, "auto"))
    hyperparameters = {k: v for k, v in options.items() if k not in STEP_OPTIONS}
    return Checked(
        step_options, hyperparameters, metrics, data_dims, val_dims, oob,
        None if oob or val_data is None else spread_inputs(val_data),  # forward(x1, x2)
    )  # fmt: skip


def check_metric_names(api: str, metrics: Mapping[str, Any]) -> None:
    """Refuse metric names that would shadow another table: a loss table of the History, a
    logger column, or another metric's ``"val_<name>"`` (EarlyStopping's ``monitor``,
    ``selection``) or ``"ensemble_<name>"`` (the loggers' averaged ensemble)."""
    for name in metrics:
        if name in RESERVED_METRIC_NAMES:
            raise ValueError(
                f"{api}: `metrics` cannot hold a metric named {name!r}: it would shadow "
                f"{RESERVED_METRIC_NAMES[name]}; rename it"
            )
        for prefix, reader in _ALIASES.items():
            other = name.removeprefix(prefix)
            if name.startswith(prefix) and other in metrics:
                raise ValueError(
                    f"{api}: `metrics` names {name!r} and {other!r}, but {name!r} is also how "
                    f"{reader} read metric {other!r}; rename one"
                )


#: Losses that read class indices with ``gather``, which vmap's batching rule runs on int32 or
#: int64 indices only: torch alone takes uint8 ("Byte") too, but fails inside the ensemble.
_CLASS_LOSSES = (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss)
_CLASS_FUNCTIONS = (torch.nn.functional.cross_entropy, torch.nn.functional.nll_loss)
_NARROW_INDICES = (torch.uint8, torch.int8, torch.int16)


def _check_class_targets(api: str, loss_fn: Any, y: Any) -> None:
    """Refuse training targets of class indices the step's batched ``gather`` cannot index
    with (validation runs such a loss member by member, as alone)."""
    if not (isinstance(loss_fn, _CLASS_LOSSES) or any(loss_fn is f for f in _CLASS_FUNCTIONS)):
        return
    if isinstance(y, torch.Tensor) and y.dtype in _NARROW_INDICES:
        raise ValueError(
            f"{api}: the targets of `data` are {y.dtype} class indices, which "
            f"{getattr(loss_fn, '__name__', type(loss_fn).__name__)} cannot index with inside "
            "the ensemble's step (vmap's gather takes int64 or int32); pass them as Y.long()"
        )


def _in_dims(api: str, in_dims: Any) -> tuple[int | None, int | None]:
    """(training data's, validation data's) from ``in_dims``: one value for both sides' data
    dims is the training data's (validation data is shared), or a pair."""
    pair = in_dims if isinstance(in_dims, tuple) else (in_dims, None)
    if len(pair) != 2 or any(v not in (None, 0) or isinstance(v, bool) for v in pair):
        raise ValueError(
            f"{api}: `in_dims` must be None, 0 or a pair (data's, val_data's) of them, got "
            f"{in_dims!r}"
        )
    return pair[0], pair[1]


def build_optimizer(
    api: str, ens: Ensemble, optimizer: Any, hyperparameters: dict[str, Any]
) -> torch.optim.Optimizer:
    """``optimizer`` as ``fit`` takes it: None (StackedAdam), an instance, or a class or
    factory called as ``optimizer(ens, **hyperparameters)``."""
    if isinstance(optimizer, torch.optim.Optimizer):
        foreign = [k for k in hyperparameters if k not in optimizer.defaults]
        if foreign:  # an option of nothing here (a trainer's accumulate_grad_batches, say)
            raise TypeError(
                f"{api}: {', '.join(f'`{k}`' for k in foreign)} is not an option of {api}, of "
                f"the step (make_step's options: {', '.join(STEP_OPTIONS)}) or of "
                f"{type(optimizer).__name__}; drop it"
            )
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
        way_out = (  # an instance of LBFGS or SparseAdam is refused too: say why, and what works
            f"it has no stacked twin: {REFUSED[build]}"
            if build in REFUSED
            else "pass an instance over ens.parameters() or a factory `lambda ens: ...` instead"
        )
        raise TypeError(
            f"{api}: an `optimizer` class must be a vmapens.StackedOptimizer, got "
            f"{build.__name__}; {way_out}"
        )
    if not callable(build):
        raise TypeError(
            f"{api}: `optimizer` must be an optimizer, a StackedOptimizer class or a factory "
            f"`(ens) -> optimizer`, got {type(build).__name__}"
        )
    name = getattr(build, "__name__", type(build).__name__)

    def unknown(err: TypeError) -> TypeError:
        return TypeError(
            f"{api}: {name} does not take these keyword arguments ({err}); {api}'s keyword "
            "arguments that are not its own options go to the step (make_step's options: "
            f"{', '.join(STEP_OPTIONS)}) or to the optimizer"
        )

    try:
        inspect.signature(build).bind(ens, **hyperparameters)
    except TypeError as err:
        raise unknown(err) from None
    except ValueError:  # no signature to check (a builtin): the call will say
        pass
    try:
        built = build(ens, **hyperparameters)
    except TypeError as err:  # a stacked optimizer takes **flags and names unknown ones itself
        if "unexpected keyword argument" in str(err):
            raise unknown(err) from None
        raise
    check_optimizer(api, ens, built)
    return built


def warn_stacked_val(api: str, data: Any, val_data: Any, n: int) -> None:
    """Warn when ``val_data`` looks per-member ([n, samples, ...], as ``data`` with
    ``in_dims=0``) but is read as shared: every member would be scored on all the slices."""
    if not (is_tensor_data(data) and is_tensor_data(val_data)):
        return
    dims = [t.dim() for t in optree.tree_leaves(data[0])]
    vals = [t for t in optree.tree_leaves(val_data[0]) if isinstance(t, torch.Tensor)]
    if vals and all(t.shape[0] == n and t.dim() == d for t, d in zip(vals, dims, strict=False)):
        warnings.warn(
            f"{api}: `val_data` inputs have shape {[tuple(t.shape) for t in vals]}: one slice "
            f"per member, as `data`'s with in_dims=0? As given, `val_data` is shared and every "
            "member is scored on all of it; pass in_dims=(0, 0) for per-member validation data",
            UserWarning,
            stacklevel=3,
        )
