"""Where ``fit`` gets its batches: (X, Y) tensors (shuffled, bagged) or any re-iterable."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Iterator, Sequence, Sized
from typing import Any

import optree
import torch
from torch import Tensor
from torch.utils.data import default_collate

from ._data_checks import check_batch, check_listed_batch, is_tensor_data
from .seeds import derive_seed

__all__ = [
    "warn_stacked_data",
    "IterableSource",
    "MemberIterables",
    "Stream",
    "TensorSource",
    "check_member_dim",
    "data_generators",
    "oob_mask",
    "rng_state",
    "rows_of",
    "set_rng_state",
    "spread_inputs",
]


def oob_mask(boot: Tensor, n_samples: int) -> Tensor:
    """``[n, n_samples]`` bool: the rows each member's resample ``boot[i]`` left out."""
    drawn = torch.zeros(boot.shape[0], n_samples, dtype=torch.bool)
    drawn[torch.arange(boot.shape[0])[:, None], boot] = True
    return ~drawn


# -- data --------------------------------------------------------------------------------------


def spread_inputs(data: tuple) -> tuple:
    """``(inputs, targets)`` with a list of inputs made a tuple: ``forward(x1, x2)``, as a
    training step spreads them (a DataLoader collates ``((u, v), y)`` into a list), so that
    validation calls the forward the way training does."""
    x, y = data
    return (tuple(x), y) if isinstance(x, list) else (x, y)


def rows_of(x: Any, member_dim: bool = False) -> int:
    """Samples in a tree of tensors: dim 0, or dim 1 when dim 0 is the member dim."""
    return optree.tree_leaves(x)[0].shape[1 if member_dim else 0]


def check_member_dim(api: str, name: str, tree: Any, n: int) -> None:
    """Every tensor of per-member data needs the member dim first, of size ``n``."""
    for leaf in optree.tree_leaves(tree):
        if isinstance(leaf, Tensor) and (leaf.dim() < 2 or leaf.shape[0] != n):
            raise ValueError(
                f"{api}: with `in_dims=0` every tensor of `{name}` needs shape [n={n}, samples, "
                f"...], one slice per member; got {tuple(leaf.shape)}"
            )


class TensorSource:
    """(X, Y) tensors cut into batches; pass ``p`` is shuffled by a generator keyed by p.

    With ``member_dim``, every tensor is ``[n, samples, ...]`` (member ``i`` trains on its own
    slice); batches then cut dim 1, in the same order for every member.
    """

    #: Its order comes from ``seed`` and the pass number, not from torch's RNG.
    pass_rng: Any = None

    def __init__(
        self,
        data: tuple,
        batch_size: int | None,
        shuffle: bool,
        seed: int,
        boot: Tensor | None,
        api: str,
        member_dim: bool = False,
    ):
        self.x, self.y = data
        self.member_dim = member_dim
        axis = 1 if member_dim else 0
        leaves = [*optree.tree_leaves(self.x), *optree.tree_leaves(self.y)]
        for leaf in leaves:
            if leaf.dim() <= axis:
                raise ValueError(
                    f"{api}: every tensor in `data` needs its samples along dim {axis}, got a "
                    f"tensor of shape {tuple(leaf.shape)}"
                )
        self.size = rows_of(self.x, member_dim)
        if self.size == 0:
            raise ValueError(f"{api}: `data` has no samples")
        for leaf in leaves:
            if leaf.shape[axis] != self.size:
                raise ValueError(
                    f"{api}: every tensor in `data` needs the same number of samples (dim "
                    f"{axis}), got {leaf.shape[axis]} and {self.size}: each is cut by rows. "
                    "Pass an input every batch takes whole (a time grid) in a list of batches, "
                    "data=[((x, ts), y), ...], or keep it on the module (a buffer)"
                )
        self.batch = self.size if batch_size is None else min(batch_size, self.size)
        self.length = math.ceil(self.size / self.batch)
        # One batch of everything is the same set in any order: no permutation to round off.
        self.shuffle = shuffle and self.length > 1
        self.seed, self.boot = seed, boot
        self._order: tuple[int, Tensor | None] = (-1, None)

    def get(self, pass_: int, pos: int) -> tuple[Any, Any] | None:
        if pos >= self.length:
            return None
        if self._order[0] != pass_:
            order = None
            if self.shuffle:
                g = torch.Generator().manual_seed(derive_seed(self.seed, "shuffle", pass_))
                order = torch.randperm(self.size, generator=g)
            self._order = (pass_, order)
        order = self._order[1]
        rows = slice(pos * self.batch, (pos + 1) * self.batch)
        pick: Tensor | slice = torch.arange(self.size)[rows] if order is None else order[rows]
        if self.boot is not None:
            pick = self.boot[:, pick]  # [n, batch]: each member's own resampled rows
        elif order is None:
            pick = rows
        if self.member_dim:
            if isinstance(pick, Tensor) and pick.dim() == 2:  # per member and per row
                members = torch.arange(pick.shape[0])[:, None]
                return self._cut(lambda t: t[members, pick])
            return self._cut(lambda t: t[:, pick])
        return self._cut(lambda t: t[pick])

    def _cut(self, rows: Any) -> tuple[Any, Any]:
        return optree.tree_map(rows, self.x), optree.tree_map(rows, self.y)


def data_generators(data: Any) -> list[torch.Generator]:
    """The ``torch.Generator`` objects ``fit``'s ``data`` draws its order from, each once: a
    DataLoader's ``generator=``, its sampler's and its batch sampler's sampler's (one per
    DataLoader of a per-member list, in order). Tensor data: none (it shuffles from ``seed``).

    Example:
        >>> from torch.utils.data import DataLoader
        >>> g = torch.Generator()
        >>> data_generators(DataLoader(range(4), shuffle=True, generator=g)) == [g]
        True
    """
    if is_tensor_data(data):
        return []
    if isinstance(data, (list, tuple)):
        return [g for item in data for g in data_generators(item)]
    batch_sampler = getattr(data, "batch_sampler", None)
    owners = (data, getattr(data, "sampler", None), getattr(batch_sampler, "sampler", None))
    found: dict[int, torch.Generator] = {}
    for owner in owners:
        g = getattr(owner, "generator", None)
        if isinstance(g, torch.Generator):
            found.setdefault(id(g), g)
    return list(found.values())


def rng_state(generators: Sequence[torch.Generator]) -> Any:
    """torch's global RNG state, with the states of ``generators`` when there are any."""
    now = torch.get_rng_state()
    return {"global": now, "generators": [g.get_state() for g in generators]} if generators else now


def set_rng_state(state: Any, generators: Sequence[torch.Generator]) -> None:
    """Undo to :func:`rng_state`'s ``state`` (a bare tensor sets the global RNG only)."""
    if isinstance(state, dict):
        torch.set_rng_state(state["global"])
        for g, saved in zip(generators, state["generators"], strict=True):
            g.set_state(saved)
    else:
        torch.set_rng_state(state)


class IterableSource:
    """Any re-iterable of (inputs, targets) batches: a DataLoader, a list."""

    def __init__(self, data: Iterable, api: str, name: str = "data"):
        # Not ``iter(data) is data``: a DataLoader's iterator draws a seed from the RNG (and
        # starts its workers) when it is made, so the first pass would see another order.
        if isinstance(data, Iterator):
            raise TypeError(
                f"{api}: `data` must be re-iterable (a DataLoader, a list of batches or an "
                "(X, Y) tuple of tensors), got a one-shot iterator"
            )
        if isinstance(data, (list, tuple)):  # its batches are known now: check them before a step
            for k, item in enumerate(data):
                check_listed_batch(api, name, k, item, data)
        self.data = data
        self.length = _length(data)
        self.generators = data_generators(data)
        self._it: Any = None
        self._at = (-1, 0)
        # The RNG states when this pass's iterator was made (torch's, and the DataLoader's own
        # generator's): a shuffling DataLoader draws its order (and its workers' seeds) from
        # them then, so a resumed pass needs them back.
        self.pass_rng: Any = None

    def get(self, pass_: int, pos: int) -> tuple[Any, Any] | None:
        if self._at != (pass_, pos):
            # A fresh pass, or resuming mid-pass: start over and skip what was already used,
            # from the RNG states the pass began with; then they are where they were (resumed).
            now = rng_state(self.generators)
            if pos > 0 and self.pass_rng is not None:
                set_rng_state(self.pass_rng, self.generators)
            else:
                self.pass_rng = now
            self._it = iter(self.data)
            for _ in range(pos):
                next(self._it, None)
            if pos > 0:
                set_rng_state(now, self.generators)
        self._at = (pass_, pos + 1)
        batch = next(self._it, None)
        if batch is None:
            return None
        return check_batch(batch)


def _length(data: Iterable) -> int | None:
    """Batches per pass, None when unknown: a DataLoader over an ``IterableDataset`` without
    ``__len__`` has a ``__len__`` that raises ``TypeError``."""
    if not isinstance(data, Sized):
        return None
    try:
        return len(data)
    except TypeError:
        return None


def _batch_rows(data: Any) -> tuple[int, int] | None:
    """A DataLoader's rows per batch and in its last batch, where its settings say them (a
    ``batch_size``, a sized sampler, torch's own collate); None otherwise."""
    size, sampler = getattr(data, "batch_size", None), getattr(data, "sampler", None)
    collate = getattr(data, "collate_fn", None)
    if (
        not isinstance(size, int)
        or not isinstance(sampler, Sized)
        or collate is not default_collate
    ):
        return None
    last = len(sampler) % size
    return size, size if last == 0 or getattr(data, "drop_last", False) else last


class MemberIterables:
    """One re-iterable per member (a DataLoader each): a step stacks one batch of each."""

    def __init__(self, loaders: Sequence[Iterable], n: int, api: str):
        if len(loaders) != n:
            raise ValueError(
                f"{api}: with `in_dims=0`, `data` as a list holds one DataLoader per member: "
                f"expected {n}, got {len(loaders)}"
            )
        self.sources = [IterableSource(d, api, f"data[{i}]") for i, d in enumerate(loaders)]
        lengths = [src.length for src in self.sources]
        if len(set(lengths)) != 1:
            raise ValueError(
                f"{api}: the per-member DataLoaders must yield the same number of batches per "
                f"pass (a step stacks one batch of every member), got {lengths} (member by "
                "member); give every loader as many batches (a sampler with `num_samples`), "
                "or step members with less data fewer times with make_step's `mask`"
            )
        self.length = self.sources[0].length
        # Batches of other row counts fail to stack at that step, after the steps before it
        # trained: where the loaders' settings say their batches' rows, refuse before any.
        rows = [_batch_rows(src.data) for src in self.sources]
        if None not in rows and len(set(rows)) > 1:
            raise ValueError(
                f"{api}: the per-member DataLoaders give batches of other sizes (rows per batch, "
                f"rows in the last batch: {rows}); a step stacks one batch of each member, so "
                "they must agree at every step: give them one batch_size and drop_last=True"
            )

    @property
    def pass_rng(self) -> list[Any]:
        return [src.pass_rng for src in self.sources]

    @pass_rng.setter
    def pass_rng(self, states: list[Any]) -> None:
        for src, state in zip(self.sources, states, strict=True):
            src.pass_rng = state

    def get(self, pass_: int, pos: int) -> tuple[Any, Any] | None:
        got = [src.get(pass_, pos) for src in self.sources]
        batches = [b for b in got if b is not None]
        if not batches:
            return None
        if len(batches) != len(got):
            raise ValueError(
                "fit: the per-member DataLoaders ran out of batches at different steps"
            )
        try:
            stacked = [optree.tree_map(lambda *ts: torch.stack(ts), *p) for p in zip(*batches)]
            return stacked[0], stacked[1]  # inputs and targets, each a tensor or a tree
        except RuntimeError as err:
            raise ValueError(
                f"fit: the per-member batches of step {pos} differ in shape; every member's "
                f"DataLoader must give batches of one shape per step (drop_last=True): {err}"
            ) from err


class Stream:
    """Where training stands in the data: pass number and batch position, for checkpoints."""

    def __init__(self, source: Any, pass_: int = 0, pos: int = 0):
        self.source, self.pass_, self.pos = source, pass_, pos
        # A checkpoint's ``pass_rng``, given to the source (made later) at the first batch.
        self.resumed_rng: Any = None

    @property
    def pass_rng(self) -> Any:
        """The RNG state(s) the current pass of a DataLoader began with (None for tensors)."""
        return None if self.source is None else self.source.pass_rng

    def in_pass(self) -> tuple[Any, Any] | None:
        if self.resumed_rng is not None:
            self.source.pass_rng, self.resumed_rng = self.resumed_rng, None
        batch = self.source.get(self.pass_, self.pos)
        if batch is None:
            self.pass_, self.pos = self.pass_ + 1, 0
        else:
            self.pos += 1
        return batch

    def cycling(self) -> tuple[Any, Any]:
        batch = self.in_pass()
        if batch is None:
            batch = self.in_pass()
        if batch is None:
            raise ValueError("fit: `data` yielded no batches")
        return batch


def warn_stacked_data(api: str, data: Any, n: int, in_dims: int | None) -> None:
    """Warn when shared tensor data looks like per-member data passed without ``in_dims=0``.

    Per-member data is stacked ``[n, samples, ...]``, inputs and targets alike. Without
    ``in_dims=0`` every member trains on all of it with the member dim taken as the samples,
    which runs without error. The sign: every input (each of a tuple of inputs) and the
    targets have ``n`` rows and agree on dim 1 as well (the samples of a stack). Shared data
    can look like that (``n`` samples, as many features as target columns), so this warns
    instead of refusing.

    Args:
        api: the calling function's name, for the message.
        data: ``(inputs, targets)`` tensors, or anything else (not checked).
        n: the number of members.
        in_dims: the caller's ``in_dims``; only ``None`` is checked.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_stacked_data("fit", (torch.randn(4, 32, 3), torch.randn(4, 32, 1)), 4, None)
        >>> "in_dims=0" in str(caught[0].message)
        True
    """
    if in_dims is not None or not isinstance(data, (tuple, list)) or len(data) != 2:
        return
    x, y = data
    # Every input, not only a lone tensor: `X` may be a tuple (or dict) of inputs, each stacked.
    leaves = optree.tree_leaves(x)
    tensors = [t for t in leaves if isinstance(t, Tensor)]
    if not leaves or len(tensors) != len(leaves) or not isinstance(y, Tensor) or y.dim() < 2:
        return
    if y.shape[0] == n and all(t.dim() >= 2 and t.shape[:2] == y.shape[:2] for t in tensors):
        shapes = tuple(x.shape) if isinstance(x, Tensor) else [tuple(t.shape) for t in tensors]
        warnings.warn(
            f"{api}: `data` inputs {shapes} and targets {tuple(y.shape)} both have "
            f"{n} rows, the number of members, and agree on dim 1: if they hold one slice per "
            "member ([n, samples, ...]), pass in_dims=0; as given, every member trains on all "
            f"of it with dim 0 as the samples. If they are {n} shared samples, silence this "
            f"with warnings.filterwarnings('ignore', message='{api}: `data`')",
            UserWarning,
            stacklevel=3,
        )
