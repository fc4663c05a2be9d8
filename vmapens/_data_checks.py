"""What ``fit``'s ``data`` is, and what a batch that is no batch is.

``data`` is ``(X, Y)`` tensors (each a tensor or a tree of them) or a re-iterable of
``(inputs, targets)`` batches. A batch that is something else (a ``TensorDataset``'s
``[x1, x2, y]``, numpy arrays, ``[X, Y]`` read as two batches) is refused with what it is and
the likely fix.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import optree
from torch import Tensor

__all__ = ["check_batch", "check_listed_batch", "is_tensor_data"]


def is_tensor_data(data: Any) -> bool:
    """Whether ``data`` is ``(X, Y)``, each a tensor or a tree of them: ``(X, (Y, W))``."""
    x, y = data if isinstance(data, tuple) and len(data) == 2 else (None, None)
    if isinstance(x, (tuple, list)) and isinstance(y, (tuple, list)):  # or two batches: read so
        return False
    return _tensor_tree(x) and _tensor_tree(y)


def check_batch(batch: Any) -> tuple[Any, ...]:
    """A batch a re-iterable yielded, as a tuple: an (inputs, targets) pair of tensors."""
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise TypeError(f"fit: each batch of `data` must be an {_PAIR}, got {_kind(batch)}")
    for part, tree in zip(("inputs", "targets"), batch):
        odd = [type(t).__name__ for t in optree.tree_leaves(tree) if not isinstance(t, Tensor)]
        if odd:
            raise TypeError(
                f"fit: each batch of `data` must hold tensors (nested in tuples, lists or "
                f"dicts), got {odd[0]} in its {part}; turn it into a tensor in the Dataset "
                "or a DataLoader `collate_fn`"
            )
    return tuple(batch)


_PAIR = "(inputs, targets) pair (several inputs: ((x1, x2), y))"


def _kind(batch: Any, loader: bool = True) -> str:
    """What a batch that is no pair is, and the likely fix (``loader``: a DataLoader's)."""
    if isinstance(batch, (tuple, list)):  # TensorDataset(x1, x2, y) yields [x1, x2, y]
        fix = "; give the Dataset or the DataLoader's `collate_fn` ((x1, x2), y) pairs"
        return f"a {type(batch).__name__} of {len(batch)} items" + (fix if loader else "")
    if type(batch).__module__ == "numpy":
        return f"{type(batch).__name__} (arrays: pass (torch.as_tensor(X), torch.as_tensor(Y)))"
    return type(batch).__name__


def check_listed_batch(api: str, name: str, k: int, item: Any, data: Sequence) -> None:
    """Item ``k`` of ``data`` given as a list or tuple of batches must be a batch: a pair."""
    if isinstance(item, (tuple, list)) and len(item) == 2:
        return
    per_member = name != "data"  # one item of in_dims=0's list
    # An iterable that is no batch: a DataLoader, not a tensor or an array (_kind says that).
    loader = isinstance(item, Iterable) and not isinstance(item, (Tensor, str, bytes))
    loader = loader and type(item).__module__ != "numpy"
    hint = ""
    if per_member and is_tensor_data(tuple(data)):  # [(X0, Y0), (X1, Y1), ...]
        hint = "; per-member tensors go stacked: data=(torch.stack(Xs), torch.stack(Ys))"
    elif is_tensor_data(tuple(data)):  # [X, Y]: read as two batches, X and Y
        hint = "; (X, Y) tensors go in a tuple: data=(X, Y)"
    elif isinstance(data, tuple) and len(data) == 2 and all(map(_tensor_tree, data)):
        hint = (  # ((u, v), (Y, W)): inputs and targets in tuples read as two batches
            "; a tuple of two tuples reads as two batches: give tuples of inputs and of targets "
            "as batches (a DataLoader, or a list of (inputs, targets) pairs)"
        )
    elif not per_member and loader:
        hint = "; a list of one DataLoader per member needs in_dims=0"
    raise TypeError(
        f"{api}: `{name}` as a {type(data).__name__} holds batches, each an {_PAIR}; "
        f"`{name}[{k}]` is {_kind(item, loader=False)}{hint}"
    )


def _tensor_tree(tree: Any) -> bool:
    """Whether ``tree`` holds tensors and nothing else (at least one)."""
    leaves = optree.tree_leaves(tree)
    return bool(leaves) and all(isinstance(t, Tensor) for t in leaves)
