"""Where ``fit`` gets its batches: (X, Y) tensors (shuffled, bagged) or any re-iterable."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sized
from typing import Any

import optree
import torch
from torch import Tensor

from ._seeds import derive_seed

__all__ = [
    "IterableSource",
    "Stream",
    "TensorSource",
    "bootstrap_indices",
    "is_tensor_data",
    "rows_of",
]


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
    g = torch.Generator().manual_seed(derive_seed(seed, "bootstrap", member_id))
    return torch.randint(n_samples, (n_samples,), generator=g)


# -- data --------------------------------------------------------------------------------------


def is_tensor_data(data: Any) -> bool:
    if not isinstance(data, tuple) or len(data) != 2 or not isinstance(data[1], Tensor):
        return False
    leaves = optree.tree_leaves(data[0])
    return bool(leaves) and all(isinstance(t, Tensor) for t in leaves)


def rows_of(x: Any) -> int:
    return optree.tree_leaves(x)[0].shape[0]


class TensorSource:
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
        self.size = rows_of(self.x)
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
        return optree.tree_map(lambda t: t[pick], self.x), self.y[pick]


class IterableSource:
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


class Stream:
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
