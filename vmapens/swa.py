"""Stochastic weight averaging of an ensemble: ``update_bn``, torch's for every member at once.

``torch.optim.swa_utils.AveragedModel(ens)`` averages an ensemble as it averages one module
(its SWA mean and ``get_ema_multi_avg_fn``'s EMA are elementwise, so every member gets the
average it gets alone). ``torch.optim.swa_utils.update_bn`` does not reach the members: it
looks for BatchNorm submodules, and an ensemble holds none (the members' layers are
``ens.template``, on the meta device, and the statistics are stacked ``[n, ...]`` buffers),
so it silently changes nothing. :func:`update_bn` here is torch's for every member.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm
from torch.optim.swa_utils import AveragedModel

from ._storage_parts import in_mode
from .ensemble import Ensemble

__all__ = ["update_bn"]

_STATS = ("running_mean", "running_var", "num_batches_tracked")


def _ensemble_of(model: Any) -> Ensemble:
    if isinstance(model, Ensemble):
        return model
    if isinstance(model, AveragedModel) and isinstance(model.module, Ensemble):
        return model.module
    inner = f" of {type(model.module).__name__}" if isinstance(model, AveragedModel) else ""
    raise TypeError(
        "update_bn: `model` must be a vmapens.Ensemble or a torch.optim.swa_utils.AveragedModel "
        f"of one, got {type(model).__name__}{inner}; for a plain module use "
        "torch.optim.swa_utils.update_bn"
    )


def _batch_norms(ens: Ensemble) -> list[tuple[str, _BatchNorm]]:
    """The member's BatchNorm layers (torch's ``_BatchNorm``, not InstanceNorm) that keep
    running statistics, by name, as torch's ``update_bn`` finds them in one member."""
    return [
        (name, m)
        for name, m in ens.template.named_modules()
        if isinstance(m, _BatchNorm) and m.track_running_stats and m.running_mean is not None
    ]


def _check_device(device: Any) -> None:
    """Refuse a ``device`` that ``batch.to(device)`` would misread (a float or a bool as a dtype)
    or would refuse only after the statistics were reset."""
    if device is None or isinstance(device, torch.device):
        return
    if isinstance(device, bool) or not isinstance(device, (int, str)):
        raise TypeError(
            "update_bn: `device` must be None, an int, a str or a torch.device, got "
            f"{type(device).__name__}"
        )
    if isinstance(device, str):
        try:
            torch.device(device)
        except RuntimeError as e:
            raise ValueError(f"update_bn: `device` {device!r} is not a device ({e})") from None


def _stat_name(prefix: str, stat: str) -> str:
    return f"{prefix}.{stat}" if prefix else stat


@torch.no_grad()
def _reset_(ens: Ensemble, layers: list[tuple[str, _BatchNorm]]) -> None:
    """``reset_running_stats()`` of every layer, on every member's rows.

    A padded member (``Ensemble.from_factories``) gets ``running_var`` 1 in its own channels
    only: its padded channels stay 0, as in the storage built for it.
    """
    padding = ens._padding
    for prefix, _ in layers:
        mean, var, count = (ens.get_buffer(_stat_name(prefix, s)) for s in _STATS)
        mean.zero_()
        count.zero_()
        name = _stat_name(prefix, "running_var")
        masks = {} if padding is None else padding.masks({name: var})
        if name in masks:
            var.copy_(masks[name])
        else:
            var.fill_(1)


@torch.no_grad()
def update_bn(
    loader: Iterable[Any],
    model: Ensemble | AveragedModel,
    device: int | str | torch.device | None = None,
    *,
    in_dims: Any = None,
) -> None:
    """``torch.optim.swa_utils.update_bn`` for every member of an ensemble.

    What torch's ``update_bn`` does to one module, done to every member at once: every
    BatchNorm layer of the member (``nn.BatchNorm1d/2d/3d``, ``SyncBatchNorm``; not
    InstanceNorm) that tracks running statistics has them reset (``reset_running_stats``:
    mean 0, variance 1, ``num_batches_tracked`` 0) and its ``momentum`` set to ``None`` (a
    cumulative average); then the ensemble runs once on every batch of ``loader`` in train
    mode, under ``torch.no_grad()``. Afterwards each member's statistics are those that
    ``update_bn(loader, AveragedModel(member))`` gives it alone; ``momentum`` and the
    train/eval mode of every submodule (the template's included) are back as they were (torch
    sets every submodule to the root's mode). As in torch, a member without any BatchNorm
    layer returns at once and ``loader`` is not read; one whose BatchNorm layers keep no
    statistics still has the pass run (other buffers, such as ``spectral_norm``'s, move as
    they do in torch's pass). Members of different sizes (``Ensemble.from_factories``) each
    get their own statistics; their padded channels stay 0.

    If anything raises during the pass (the forward, the loader), every buffer, ``momentum``
    and mode is as it was before the call.

    Args:
        loader: an iterable of batches: tensors, or lists/tuples whose first element is the
            input (a ``DataLoader`` of ``(x, y)`` pairs), as for torch's ``update_bn``.
        model: the ``vmapens.Ensemble``, or a ``torch.optim.swa_utils.AveragedModel`` of one
            (its ``module`` is updated, through its own forward).
        device: where each batch is moved first (``batch.to(device)``), as in torch.
        in_dims: passed on to the ensemble's forward: ``0`` when every batch holds one slice
            per member along dim 0 (bagging), as in ``ens(x, in_dims=0)``.

    Raises:
        TypeError: ``model`` is not an Ensemble or an AveragedModel of one; ``loader`` is
            not iterable; ``device`` is not an int, a str or a ``torch.device``. Nothing
            changes then.
        ValueError: ``device`` is a string that names no device. Nothing changes then.
        RuntimeError: a BatchNorm subclass with its own ``forward`` reaches torch's
            cumulative factor, which ``vmap`` cannot batch: build with ``backend="loop"``
            (``vmapens._batchable``). Nothing changes then.

    Example:
        >>> from torch import nn
        >>> from torch.optim.swa_utils import AveragedModel
        >>> ens = Ensemble(lambda: nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)), n=2, seed=0)
        >>> swa = AveragedModel(ens)
        >>> update_bn([torch.randn(8, 3), torch.randn(8, 3)], swa)
        >>> swa.module.get_buffer("1.num_batches_tracked").tolist()
        [2, 2]
    """
    ens = _ensemble_of(model)
    # `for` also walks an object with only `__getitem__` (a map-style Dataset of batches), as
    # in torch's update_bn.
    if not isinstance(loader, Iterable) and not hasattr(type(loader), "__getitem__"):
        raise TypeError(
            "update_bn: `loader` must be an iterable of batches (a DataLoader, a list of "
            f"tensors), got {type(loader).__name__}"
        )
    _check_device(device)
    # torch's update_bn returns only where the member holds no BatchNorm at all: one that
    # keeps no statistics still has the pass run in train mode, which moves other buffers
    # (spectral_norm's power iteration, a buffer the forward updates) as torch's pass does.
    if not any(isinstance(m, _BatchNorm) for m in ens.template.modules()):
        return
    layers = _batch_norms(ens)
    # Modes of every module involved: the wrapper, the ensemble and the member's submodules.
    modules = [*model.modules(), *ens.template.modules()]
    # Set on the template, as torch sets it on the model: the module the ensemble runs
    # follows it at the next call (under vmap, as a twin that keeps torch's 1/count factor a
    # tensor), and follows it back at the end.
    momenta = [(m, m.momentum) for _, m in layers]
    saved = {k: t.clone() for k, t in ens.stacked_buffers().items()}
    with in_mode(model, True, modules, ens._follow_template):
        try:
            _reset_(ens, layers)
            for layer, _ in momenta:
                layer.momentum = None
            for batch in loader:
                if isinstance(batch, (list, tuple)):
                    batch = batch[0]
                if device is not None:
                    batch = batch.to(device)
                if in_dims is None:
                    model(batch)
                else:
                    model(batch, in_dims=in_dims)
        except BaseException:
            for k, t in ens.stacked_buffers().items():
                t.copy_(saved[k])
            raise
        finally:
            for layer, momentum in momenta:
                layer.momentum = momentum
