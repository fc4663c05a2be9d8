"""The training loop: ``fit`` (epochs, bagging, early stopping, divergence, resume) and History."""

from __future__ import annotations

import hashlib
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence, Sized
from typing import TYPE_CHECKING, Any

import optree
import torch
from torch import Tensor

from .distributed import all_reduce_stats, rank_path, world_size
from .ensemble import per_member
from .history import History
from .optim import StackedAdam

if TYPE_CHECKING:
    from .ensemble import Ensemble

__all__ = ["History", "bootstrap_indices", "fit"]

Callback = Callable[["History"], Any]


def bootstrap_indices(n_samples: int, seed: int, member_id: int) -> Tensor:
    """The rows that member ``member_id`` trains on with ``fit(..., bootstrap=True, seed=seed)``.

    A resample with replacement of ``range(n_samples)``, drawn from a generator keyed by
    ``(seed, member_id)``: the global member index, so a member gets the same rows whether it
    is trained alone, in one process or in any shard. Rows that are absent are its out-of-bag
    samples.

    Example:
        >>> idx = bootstrap_indices(10, seed=0, member_id=3)
        >>> idx.shape, bool((idx >= 0).all() and (idx < 10).all())
        (torch.Size([10]), True)
    """
    g = torch.Generator().manual_seed(_derive(seed, "bootstrap", member_id))
    return torch.randint(n_samples, (n_samples,), generator=g)


def _derive(seed: int, purpose: str, index: int) -> int:
    """A 63-bit generator seed from (seed, purpose, index): independent streams, no overlap."""
    digest = hashlib.sha256(f"vmapens:{seed}:{purpose}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


# -- data --------------------------------------------------------------------------------------


def _is_tensor_data(data: Any) -> bool:
    if not isinstance(data, tuple) or len(data) != 2 or not isinstance(data[1], Tensor):
        return False
    leaves = optree.tree_leaves(data[0])
    return bool(leaves) and all(isinstance(t, Tensor) for t in leaves)


def _rows_of(x: Any) -> int:
    return optree.tree_leaves(x)[0].shape[0]


class _TensorSource:
    """(X, Y) tensors cut into batches; pass ``p`` is shuffled by a generator keyed by p."""

    def __init__(
        self,
        data: tuple,
        batch_size: int | None,
        shuffle: bool,
        seed: int,
        boot: Tensor | None,
        api: str,
    ):
        self.x, self.y = data
        self.size = _rows_of(self.x)
        if self.size == 0:
            raise ValueError(f"{api}: `data` has no samples")
        for leaf in [*optree.tree_leaves(self.x), self.y]:
            if leaf.shape[0] != self.size:
                raise ValueError(
                    f"{api}: every tensor in `data` needs the same number of samples (dim 0), "
                    f"got {leaf.shape[0]} and {self.size}"
                )
        self.batch = self.size if batch_size is None else min(batch_size, self.size)
        self.length = math.ceil(self.size / self.batch)
        # One batch of everything is the same set in any order: no permutation to round off.
        self.shuffle = shuffle and self.length > 1
        self.seed, self.boot = seed, boot
        self._order: tuple[int, Tensor | None] = (-1, None)

    def get(self, pass_: int, pos: int) -> tuple[Any, Tensor] | None:
        if pos >= self.length:
            return None
        if self._order[0] != pass_:
            order = None
            if self.shuffle:
                g = torch.Generator().manual_seed(_derive(self.seed, "shuffle", pass_))
                order = torch.randperm(self.size, generator=g)
            self._order = (pass_, order)
        order = self._order[1]
        rows = slice(pos * self.batch, (pos + 1) * self.batch)
        pick: Tensor | slice = torch.arange(self.size)[rows] if order is None else order[rows]
        if self.boot is not None:
            pick = self.boot[:, pick]  # [n, batch]: each member's own resampled rows
        elif order is None:
            pick = rows
        return optree.tree_map(lambda t: t[pick], self.x), self.y[pick]


class _IterableSource:
    """Any re-iterable of (inputs, targets) batches: a DataLoader, a list."""

    def __init__(self, data: Iterable, api: str):
        if iter(data) is data:
            raise TypeError(
                f"{api}: `data` must be re-iterable (a DataLoader, a list of batches or an "
                "(X, Y) tuple of tensors), got a one-shot iterator"
            )
        self.data = data
        self.length = len(data) if isinstance(data, Sized) else None
        self._it: Any = None
        self._at = (-1, 0)

    def get(self, pass_: int, pos: int) -> tuple[Any, Tensor] | None:
        if self._at != (pass_, pos):
            # A fresh pass, or resuming mid-pass: start over and skip what was already used.
            self._it = iter(self.data)
            for _ in range(pos):
                next(self._it, None)
        self._at = (pass_, pos + 1)
        batch = next(self._it, None)
        if batch is None:
            return None
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise TypeError(
                f"fit: each batch of `data` must be an (inputs, targets) pair, got "
                f"{type(batch).__name__}"
            )
        return tuple(batch)


class _Stream:
    """Where training stands in the data: pass number and batch position, for checkpoints."""

    def __init__(self, source: Any, pass_: int = 0, pos: int = 0):
        self.source, self.pass_, self.pos = source, pass_, pos

    def in_pass(self) -> tuple[Any, Tensor] | None:
        batch = self.source.get(self.pass_, self.pos)
        if batch is None:
            self.pass_, self.pos = self.pass_ + 1, 0
        else:
            self.pos += 1
        return batch

    def cycling(self) -> tuple[Any, Tensor]:
        batch = self.in_pass()
        if batch is None:
            batch = self.in_pass()
        if batch is None:
            raise ValueError("fit: `data` yielded no batches")
        return batch


# -- the loop ------------------------------------------------------------------------------------


def fit(
    ens: Ensemble,
    data: Any,
    loss_fn: Callable[[Any, Tensor], Tensor],
    *,
    epochs: int = 1,
    steps: int | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    lr: float | Sequence[float] | Tensor = 1e-3,
    batch_size: int | None = None,
    shuffle: bool = True,
    bootstrap: bool = False,
    val_data: tuple[Any, Tensor] | None = None,
    patience: int | None = None,
    restore_best: bool = True,
    compile: bool = False,
    progress: bool | Any = True,
    seed: int | None = None,
    callbacks: Sequence[Callback] = (),
    checkpoint: str | os.PathLike | None = None,
) -> History:
    """Train every member of ``ens`` and return a :class:`History`.

    An *epoch* is one pass over ``data`` or, with ``steps``, ``steps`` optimizer steps that
    cycle over the data (a new pass, reshuffled, starts whenever one ends). The history, the
    validation, early stopping, callbacks and checkpoints all work per epoch, so
    ``fit(data, loss, steps=1000)`` is 1000 steps and one history row, and
    ``fit(data, loss, epochs=10, steps=100)`` is 1000 steps in 10 rows.

    Each step runs ``ens.make_step``: every member's forward, ``loss_fn`` per member, the sum
    of the member losses back-propagated (each member gets exactly its own gradient).

    Args:
        ens: the ensemble to train, in the mode it should train in (``ens.train()``).
        data: ``(X, Y)`` tensors (``X`` may be a tuple of inputs), cut into batches of
            ``batch_size`` and reshuffled every pass; or any re-iterable of
            ``(inputs, targets)`` batches, such as a ``DataLoader``.
        loss_fn: ``(output, target) -> scalar`` for one member, e.g. ``nn.CrossEntropyLoss()``.
        epochs: number of epochs.
        steps: optimizer steps per epoch (``None``: one pass over ``data``).
        optimizer: defaults to ``StackedAdam(ens, lr=lr)``. Any optimizer over
            ``ens.parameters()`` works; freezing members (early stopping, divergence) needs a
            ``StackedAdam``.
        lr: learning rate of the default optimizer: a float, or one per member (sequence or
            1-D tensor of length n).
        batch_size: samples per batch for ``(X, Y)`` data (``None``: all of them).
        shuffle: reshuffle ``(X, Y)`` every pass, from ``seed`` and the pass number.
        bootstrap: bagging: each member trains on its own resample of ``(X, Y)`` (see
            :func:`bootstrap_indices`, keyed by the member's global index).
        val_data: ``(Xv, Yv)``: each member's validation loss after each epoch, computed in
            eval mode under ``torch.no_grad()`` in one forward (the training mode is restored).
        patience: stop a member once its validation loss has not improved for this many
            epochs; the other members carry on. Needs ``val_data``.
        restore_best: with ``val_data``, give each member its best-epoch parameters and
            buffers back at the end.
        compile: compile the training step (see ``make_step``).
        progress: ``True``: a tqdm bar on stderr when it is a terminal; ``False``: quiet; a
            text stream (``io.StringIO``, an open log file): the bar is drawn there always.
            Only rank 0 draws it when ``torch.distributed`` is initialised.
        seed: seeds shuffling and bootstrap resamples (``None``: drawn from torch's global
            RNG; pass one for sharded runs, so every process draws alike).
        callbacks: callables run after each epoch (and after the checkpoint is written) with
            the history so far.
        checkpoint: a file written atomically after every epoch. When it exists at the start,
            training resumes from it and ends exactly as an uninterrupted run would. Under
            ``torch.distributed`` each rank uses its own ``vmapens.distributed.rank_path``.

    Returns:
        The :class:`History`; its rows stop early when every member has stopped.

    Raises:
        ValueError: bad option values, options that need others (``patience`` without
            ``val_data``, ``bootstrap`` without tensor data), a checkpoint from another run.
        TypeError: ``patience`` with an optimizer other than ``StackedAdam``, one-shot
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
    _check_count(api, "epochs", epochs)
    for name, value in (("steps", steps), ("batch_size", batch_size), ("patience", patience)):
        if value is not None:
            _check_count(api, name, value)
    if not callable(loss_fn):
        raise TypeError(f"{api}: `loss_fn` must be callable, got {type(loss_fn).__name__}")
    callbacks = tuple(callbacks)
    for k, cb in enumerate(callbacks):
        if not callable(cb):
            raise TypeError(f"{api}: `callbacks[{k}]` must be callable, got {type(cb).__name__}")
    if val_data is not None and not _is_tensor_data(val_data):
        raise ValueError(f"{api}: `val_data` must be an (X, Y) tuple of tensors")
    if patience is not None and val_data is None:
        raise ValueError(f"{api}: `patience` needs `val_data` to measure improvement")
    tensor_data = _is_tensor_data(data)
    if bootstrap and not tensor_data:
        raise ValueError(f"{api}: `bootstrap=True` needs `data` as an (X, Y) tuple of tensors")
    if optimizer is None:
        optimizer = StackedAdam(ens, lr=lr)
    elif not isinstance(lr, float) or lr != 1e-3:
        raise ValueError(f"{api}: `lr` configures the default optimizer; give it to `optimizer`")
    maskable = isinstance(optimizer, StackedAdam)
    if patience is not None and not maskable:
        raise TypeError(
            f"{api}: `patience` freezes members through vmapens.StackedAdam's mask, got "
            f"{type(optimizer).__name__}"
        )
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise TypeError(f"{api}: `seed` must be an int or None, got {type(seed).__name__}")

    options = {
        "steps": steps,
        "batch_size": batch_size,
        "shuffle": shuffle,
        "bootstrap": bootstrap,
        "patience": patience,
        "validated": val_data is not None,
        "restore_best": restore_best,
    }
    loop = _Loop(ens, optimizer, loss_fn, val_data, patience, restore_best and val_data is not None)
    saved = None
    if checkpoint is not None:
        checkpoint = rank_path(checkpoint)  # under torch.distributed, each rank its own block
    if checkpoint is not None and os.path.exists(checkpoint):
        saved = loop.read(checkpoint, options, seed)  # checked in full; nothing changed yet
        seed = saved["seed"]
    elif seed is None:
        if len(ens) != ens.n_total and (bootstrap or shuffle):
            raise ValueError(f"{api}: a sharded ensemble needs an int `seed` (same on every rank)")
        seed = int(torch.randint(2**62, ()).item())
    options["seed"] = seed

    n, device = len(ens), next(ens.parameters()).device
    if tensor_data:
        boot = None
        if bootstrap:
            size = _rows_of(data[0])
            boot = torch.stack([bootstrap_indices(size, seed, i) for i in ens.member_ids])
        source: Any = _TensorSource(data, batch_size, shuffle, seed, boot, api)
    else:
        source = _IterableSource(data, api)
    stream = _Stream(source)
    if saved is not None:
        loop.apply(saved, stream)
    step = ens.make_step(loss_fn, optimizer, in_dims=0 if bootstrap else None, compile=compile)
    history = loop.history

    per_epoch = steps if steps is not None else source.length
    total = epochs * per_epoch if per_epoch else None
    bar = _progress_bar(progress, total, history.epochs * (per_epoch or 0))
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
                inputs, targets = _to_device(batch, device)
                losses = loop.step(step, inputs, targets, maskable)
                summed += losses.double()
                count += 1
                bar.update(1)
                if not bar.disable and not sharded and time.monotonic() - last_shown > 0.5:
                    bar.set_postfix_str(loop.describe(losses), refresh=False)
                    last_shown = time.monotonic()
            if count == 0:
                raise ValueError(f"{api}: `data` yielded no batches")
            loop.end_epoch(epoch, summed / count)
            bar.set_postfix_str(loop.describe(history.train_loss[-1]))
            if checkpoint is not None:
                loop.save(checkpoint, stream, options)
            for cb in callbacks:
                cb(history)
    finally:
        bar.close()
    loop.finish()
    return history


class _Loop:
    """Per-member training state between steps and epochs: who trains, best so far, history."""

    def __init__(
        self,
        ens: Ensemble,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable,
        val_data: tuple[Any, Tensor] | None,
        patience: int | None,
        keep_best: bool,
    ):
        self.ens, self.optimizer, self.patience = ens, optimizer, patience
        n, device = len(ens), next(ens.parameters()).device
        self.val: tuple[Any, Tensor] | None = (
            None if val_data is None else _to_device(val_data, device)
        )
        self.val_loss = per_member(loss_fn)
        self.history = History.empty(list(ens.member_ids), val_data is not None)
        # On the device, updated without a host sync per step.
        self.active = torch.ones(n, dtype=torch.bool, device=device)
        self.best_val = torch.full((n,), math.inf, dtype=torch.float64)
        self.bad = torch.zeros(n, dtype=torch.int64)
        self.best = {k: t.detach().clone() for k, t in self._state().items()} if keep_best else None

    def _state(self) -> dict[str, Tensor]:
        return {**self.ens._stacked_params(), **self.ens._stacked_buffers()}

    def step(self, step: Callable, inputs: Any, targets: Tensor, maskable: bool) -> Tensor:
        # The mask freezes stopped members whole: parameters, optimizer state and buffers.
        losses = step(inputs, targets, mask=self.active) if maskable else step(inputs, targets)
        self.active &= torch.isfinite(losses)
        return losses

    def totals(self, losses: Tensor | None = None) -> dict[str, float]:
        """Members still training and their loss statistics, over all ranks (a collective)."""
        active = self.active.cpu()
        live = torch.zeros(0) if losses is None else losses.detach().double().cpu()[active]
        sums = all_reduce_stats(
            {"training": active.sum(), "members": active.numel(), "sum": live.sum()}
        )
        low = all_reduce_stats({"min": live.min() if live.numel() else math.inf}, "min")
        high = all_reduce_stats({"max": live.max() if live.numel() else -math.inf}, "max")
        return {**sums, **low, **high}

    def describe(self, losses: Tensor) -> str:
        """The progress bar's text: loss mean/min/max over members still training, and count."""
        t = self.totals(losses)
        stats = ""
        if t["training"]:
            mean = t["sum"] / t["training"]
            stats = f"loss {mean:.4g} (min {t['min']:.4g}, max {t['max']:.4g}), "
        return f"{stats}training {int(t['training'])}/{int(t['members'])}"

    def end_epoch(self, epoch: int, mean_loss: Tensor) -> None:
        h = self.history
        running = h.stopped_epoch == -1  # trained during this epoch
        active = self.active.cpu()
        diverged = running & ~active
        stop = diverged.clone()
        h.diverged |= diverged
        nan = torch.tensor(math.nan, dtype=torch.float64)
        h.train_loss = torch.cat([h.train_loss, torch.where(running, mean_loss.cpu(), nan)[None]])
        if self.val is not None:
            val = torch.where(running, self._validate(), nan)
            assert h.val_loss is not None  # History.empty made it: there is validation data
            h.val_loss = torch.cat([h.val_loss, val[None]])
            improved = active & (val < self.best_val)
            self.best_val = torch.where(improved, val, self.best_val)
            h.best_epoch = torch.where(improved, epoch, h.best_epoch)
            self.bad = torch.where(improved, 0, self.bad + 1)
            if self.patience is not None:
                stop |= active & (self.bad >= self.patience)
            if self.best is not None and bool(improved.any()):
                keep = improved.to(self.active.device)
                with torch.no_grad():
                    for name, t in self._state().items():
                        self.best[name] = torch.where(_col(keep, t), t, self.best[name])
        h.stopped_epoch = torch.where(stop, epoch, h.stopped_epoch)
        self.active &= ~stop.to(self.active.device)

    def _validate(self) -> Tensor:
        assert self.val is not None  # called only with validation data
        x, y = self.val
        training = self.ens.training
        self.ens.eval()
        try:
            with torch.no_grad():
                out = self.ens(*(x if isinstance(x, tuple) else (x,)))
                return self.val_loss(out, y).double().cpu()
        finally:
            self.ens.train(training)

    def finish(self) -> None:
        if self.best is None:
            return
        restore = (self.history.best_epoch >= 0).to(self.active.device)
        with torch.no_grad():
            for name, t in self._state().items():
                t.copy_(torch.where(_col(restore, t), self.best[name], t))

    # -- checkpoints ---------------------------------------------------------------------------

    def save(self, path: str | os.PathLike, stream: _Stream, options: dict) -> None:
        from .checkpoint import write_checkpoint

        state = {
            "options": dict(options),
            "pass": stream.pass_,
            "pos": stream.pos,
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
            "active": self.active.cpu(),
            "best_val": self.best_val,
            "bad": self.bad,
            "best": None if self.best is None else {k: t.cpu() for k, t in self.best.items()},
        }
        write_checkpoint(self.ens, path, self.optimizer, self.history, fit_state=state)

    def read(self, path: str | os.PathLike, options: dict, seed: int | None) -> dict:
        """Read and check a fit checkpoint against this run; changes nothing."""
        from .checkpoint import read_checkpoint

        payload = read_checkpoint(path, self.ens, self.optimizer, self.history, "fit")
        state = payload["fit"]
        if state is None:
            raise ValueError(
                f"fit: {os.fspath(path)} was written by save(), not by fit(checkpoint=...): it "
                "holds no training-loop state to resume from; use another path"
            )
        stored = state["options"]
        ours = {**options, "seed": stored["seed"] if seed is None else seed}
        differ = [k for k in ours if stored.get(k) != ours[k]]
        if differ:
            got = ", ".join(f"{k}={ours[k]!r} (checkpoint: {stored.get(k)!r})" for k in differ)
            raise ValueError(
                f"fit: cannot resume from {os.fspath(path)}: it was written by a run with other "
                f"options: {got}"
            )
        n = len(self.ens)
        for key in ("active", "best_val", "bad"):
            if tuple(state[key].shape) != (n,):
                raise ValueError(f"fit: {os.fspath(path)}: loop state `{key}` is not [{n}]")
        if (state["best"] is None) != (self.best is None) or (
            self.best is not None
            and {k: t.shape for k, t in state["best"].items()}
            != {k: t.shape for k, t in self.best.items()}
        ):
            raise ValueError(f"fit: {os.fspath(path)}: best-epoch state does not match")
        return {**payload, "seed": stored["seed"]}

    def apply(self, payload: dict, stream: _Stream) -> None:
        from .checkpoint import apply_checkpoint

        apply_checkpoint(payload, self.ens, self.optimizer, self.history)
        state = payload["fit"]
        stream.pass_, stream.pos = state["pass"], state["pos"]
        self.active.copy_(state["active"])
        self.best_val, self.bad = state["best_val"].clone(), state["bad"].clone()
        if self.best is not None:
            self.best = {k: t.to(self.best[k].device) for k, t in state["best"].items()}
        torch.set_rng_state(state["rng"])
        if state["cuda_rng"]:
            torch.cuda.set_rng_state_all(state["cuda_rng"])


def _to_device(tree: Any, device: torch.device) -> Any:
    """``tree`` with every tensor moved to ``device``."""
    return optree.tree_map(lambda t: t.to(device), tree)


def _col(mask: Tensor, like: Tensor) -> Tensor:
    """A per-member bool [n] shaped to broadcast over a stacked [n, ...] tensor."""
    return mask.view(-1, *[1] * (like.dim() - 1))


def _check_count(api: str, name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{api}: `{name}` must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{api}: `{name}` must be >= 1, got {value}")


class _NoBar:
    disable = True

    def set_description(self, *_: Any) -> None: ...

    def set_postfix_str(self, *_: Any, **__: Any) -> None: ...

    def update(self, *_: Any) -> None: ...

    def close(self) -> None: ...


def _progress_bar(progress: Any, total: int | None, done: int) -> Any:
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if progress is False or (distributed and torch.distributed.get_rank() != 0):
        return _NoBar()
    if progress is True:
        from tqdm.auto import tqdm as auto

        # disable=None: tqdm stays quiet when stderr is not a terminal (logs, CI).
        return auto(total=total, initial=done, file=sys.stderr, disable=None, unit="step")
    if not callable(getattr(progress, "write", None)):
        raise TypeError(
            f"fit: `progress` must be True, False or a text stream, got {type(progress).__name__}"
        )
    from tqdm import tqdm

    return tqdm(total=total, initial=done, file=progress, unit="step", ncols=120, mininterval=0)
