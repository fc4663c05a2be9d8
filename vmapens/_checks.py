"""Argument checks, the per-member broadcast and the probe's tolerance, written once for the
whole package.

Every public function validates at its boundary with these helpers, so messages read alike:
they start with the API name, name the argument in backticks and say expected vs got.
"""

from __future__ import annotations

import math
import numbers
import os
import warnings
import weakref
from collections import Counter
from collections.abc import Sequence
from typing import Any

import optree
import torch
from torch import Tensor, nn

from ._template_parameter import TemplateParameter

__all__ = [
    "as_ids",
    "check_choice",
    "check_int",
    "check_mask",
    "check_writable_dir",
    "column",
    "expand_in_dims",
    "flat_dims",
    "index_rows",
    "is_int",
    "mapped_sizes",
    "positional",
    "repeated",
    "to_index",
    "tolerance",
    "warn_stacked_keywords",
]


def repeated(ids: Sequence[int]) -> list[int]:
    """The ids that occur more than once in ``ids``, sorted (one pass: a zoo has thousands)."""
    return sorted(i for i, count in Counter(ids).items() if count > 1)


def is_int(value: Any) -> bool:
    """Whether ``value`` is a Python int and not a bool (``True`` is an int to Python)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(api: str, name: str, value: Any, minimum: int | None = None) -> int:
    """Return ``value`` if it is a Python int (not a bool) ``>= minimum``; raise otherwise."""
    if not is_int(value):
        raise TypeError(f"{api}: `{name}` must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{api}: `{name}` must be >= {minimum}, got {value}")
    return value


def positional(inputs: Any) -> tuple:
    """The forward's positional inputs: a tuple is several (``step((x1, x2), y)`` calls
    ``forward(x1, x2)``), anything else one, a NamedTuple too (a batch the forward takes whole,
    as ``ens(batch)`` gives it)."""
    return inputs if isinstance(inputs, tuple) and not hasattr(inputs, "_fields") else (inputs,)


def check_choice(api: str, name: str, value: Any, choices: tuple) -> Any:
    """Return ``value`` if it is one of ``choices``; raise ValueError otherwise."""
    if value not in choices:
        raise ValueError(f"{api}: `{name}` must be one of {choices}, got {value!r}")
    return value


def to_index(value: Any) -> int | None:
    """An integer-like (int, numpy integer, 0-d integer tensor) as an int, else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, Tensor):
        if value.dim() == 0 and not value.is_floating_point() and value.dtype != torch.bool:
            return int(value.item())
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    return None


def check_mask(api: str, mask: Any, n: int, name: str = "mask") -> None:
    """A per-member mask must be a bool tensor of shape ``[n]`` (or None)."""
    if mask is None:
        return
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
        raise TypeError(f"{api}: `{name}` must be a bool tensor of shape [{n}], got {got}")
    if tuple(mask.shape) != (n,):
        raise ValueError(
            f"{api}: `{name}` must have shape [{n}] (one per member), got {list(mask.shape)}"
        )
    if mask.is_meta:  # no values: torch's "Cannot copy out of meta tensor" names nothing
        raise ValueError(f"{api}: `{name}` must hold values, got a tensor on the meta device")


def check_writable_dir(api: str, name: str, path: str | os.PathLike) -> None:
    """The directory that file ``path`` goes in must exist and be writable."""
    if not isinstance(path, (str, os.PathLike)):  # os.fspath's error names no argument
        raise TypeError(f"{api}: `{name}` must be a str or os.PathLike, got {type(path).__name__}")
    parent = os.path.dirname(os.fspath(path)) or "."
    if not os.path.exists(parent):
        raise FileNotFoundError(
            f"{api}: `{name}` directory {parent} does not exist; create it first"
        )
    if not os.path.isdir(parent):
        raise NotADirectoryError(f"{api}: `{name}` directory {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"{api}: `{name}` directory {parent} is not writable")


def column(values: Tensor, like: Tensor) -> Tensor:
    """A per-member ``[n]`` tensor viewed as ``[n, 1, ...]`` to broadcast over ``like``."""
    return values.view(-1, *[1] * (like.dim() - 1))


def flat_dims(in_dims: Any, count: int) -> list[int | None] | None:
    """One member dim (or None) per positional argument; None for in_dims nested deeper."""
    if in_dims is None or isinstance(in_dims, int):
        return [in_dims] * count
    flat = isinstance(in_dims, (tuple, list)) and len(in_dims) == count
    return list(in_dims) if flat and all(d is None or isinstance(d, int) for d in in_dims) else None


def mapped_sizes(args: tuple, dims: list[int | None]) -> set[int]:
    """The sizes of the mapped dims of the positional arguments' tensors (one: ``n``, where
    vmap accepts them)."""
    return {
        leaf.shape[d]
        for a, d in zip(args, dims, strict=True)
        if d is not None
        for leaf in optree.tree_leaves(a)
        if isinstance(leaf, Tensor) and -leaf.dim() <= d < leaf.dim()
    }


def warn_stacked_keywords(
    api: str, in_dims: Any, args: tuple, kwargs: dict, call: str, rank: int = 1
) -> None:
    """Warn of a keyword tensor with as many rows as there are members: vmap maps positional
    arguments only, so each member gets all of it (a stacked ``mask=`` mixes the members').

    ``call`` shows the way out with ``{name}`` for the keyword, e.g. ``"ens(x, {name},
    in_dims=(0, 0))"``. Tensors of fewer than ``rank`` dims are not looked at (a forward's
    shared vector of features, ``w=torch.ones(3)``, may have as many as there are members).
    """
    dims = flat_dims(in_dims, len(args)) if kwargs else None  # most calls: no keywords
    if dims is None:
        return
    sizes = mapped_sizes(args, dims)
    for name, value in kwargs.items():
        leaves = [t for t in optree.tree_leaves(value) if isinstance(t, Tensor)]
        n = next((t.shape[0] for t in leaves if t.dim() >= rank and t.shape[0] in sizes), None)
        if n is not None:
            warnings.warn(
                f"{api}: keyword argument `{name}` reaches every member whole (vmap maps "
                f"positional arguments only), but its dim 0 has {n} rows, one per member; if "
                "it holds one slice per member, pass it positionally with an in_dims entry of "
                f"0, e.g. {call.format(name=name)}; if it is shared, silence this with "
                f"warnings.filterwarnings('ignore', message='{api}: keyword')",
                UserWarning,
                stacklevel=3,
            )


def expand_in_dims(api: str, in_dims: Any, args: tuple, n: int) -> tuple:
    """One in_dim (int or None) per positional argument, after checking per-member sizes."""
    if in_dims is None or isinstance(in_dims, int) and not isinstance(in_dims, bool):
        dims = (in_dims,) * len(args)
    elif isinstance(in_dims, tuple) and len(in_dims) == len(args):
        dims = in_dims
    else:
        raise ValueError(
            f"{api}: `in_dims` must be None, an int, or a tuple with one entry per positional "
            f"argument ({len(args)}), got {in_dims!r}"
        )
    for pos, (arg, dim) in enumerate(zip(args, dims, strict=True)):
        if dim is None:
            continue
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise ValueError(f"{api}: `in_dims[{pos}]` must be an int or None, got {dim!r}")
        for leaf in optree.tree_leaves(arg):  # optree drops None leaves: shared, as alone
            if not isinstance(leaf, Tensor):
                raise ValueError(
                    f"{api}: argument {pos} is mapped with in_dims={dim} but holds a "
                    f"{type(leaf).__name__} ({leaf!r:.40}), which has no member dim; pass it "
                    f"in an argument of its own with in_dims None, e.g. in_dims=(0, None)"
                )
            if not -leaf.dim() <= dim < leaf.dim() or leaf.shape[dim] != n:
                size = leaf.shape[dim] if -leaf.dim() <= dim < leaf.dim() else "no such dim"
                raise ValueError(
                    f"{api}: argument {pos} is mapped with in_dims={dim} but has size {size} "
                    f"there (shape {tuple(leaf.shape)}); expected {n}, one slice per member"
                )
    return dims


def index_rows(api: str, index: Any, n: int) -> torch.Tensor:
    """A selection (one integer-like, slice, sequence, int or bool tensor or numpy array) as a
    1-D int64 tensor of rows; one integer-like is one row."""
    one = to_index(index)
    if one is not None:  # pbt.exploit_(ens, opt, 0, 3), ens.select(2): one row, as [2]
        index = [one]
    if isinstance(index, slice):  # range's slicing: negative steps too, as nn.Sequential's
        return torch.tensor(range(n)[index], dtype=torch.int64)
    if isinstance(index, torch.Tensor) and index.dtype == torch.uint8:
        # torch indexes with a uint8 tensor as a (deprecated) mask, numpy with a uint8 array
        # as rows: read either way, members would be picked silently where the user did not.
        raise TypeError(
            f"{api}: `index` is a uint8 tensor, which torch reads as a mask and numpy as rows; "
            "pass a bool mask (index.bool()) or int64 rows (index.long())"
        )
    if type(index).__module__ == "numpy" and getattr(index, "ndim", None) == 1:
        index = torch.as_tensor(index)  # np.argsort(scores)[:k], a numpy bool mask
    if isinstance(index, torch.Tensor) and index.dtype == torch.bool:
        if tuple(index.shape) != (n,):
            raise IndexError(f"{api}: a bool mask must have shape [{n}], got {list(index.shape)}")
        return index.nonzero().flatten().cpu()
    if isinstance(index, torch.Tensor) and index.dim() == 1 and not index.is_floating_point():
        items = index.tolist()
    elif isinstance(index, Sequence) and not isinstance(index, str):
        items = [to_index(v) for v in index]
    else:
        raise TypeError(
            f"{api}: index must be an integer-like, a slice, a sequence of ints or a 1-D "
            f"integer/bool tensor, got {type(index).__name__}"
        )
    if any(i is None for i in items):
        raise TypeError(f"{api}: every index must be an integer-like, got {index!r}")
    if not items:
        raise IndexError(f"{api}: selecting no members; an Ensemble needs at least one")
    for i in items:
        if not -n <= i < n:
            raise IndexError(f"{api}: member index {i} out of range for {n} members")
    return torch.tensor([i % n for i in items], dtype=torch.int64)


def as_ids(ids: list[int]) -> Sequence[int]:
    """Contiguous ids as a range (what sharded code expects), others as a tuple."""
    if ids == list(range(ids[0], ids[0] + len(ids))):
        return range(ids[0], ids[0] + len(ids))
    return tuple(ids)


def tolerance(dtype: torch.dtype) -> float:
    """The largest relative difference the probe (``vmapens.check``, ``export``'s check, the
    padded-layer locator) accepts between a member alone and in the ensemble, in ``dtype``.

    ``sqrt(eps)``: a batched kernel sums in another order than the member's own, which moves
    a result by a few ``eps`` times the size of what is summed (1e-16 in float64, 1e-7 in
    float32, ~1e-2 in bfloat16), while a forward that takes another branch inside the
    ensemble changes results by their own size. Half the digits sits orders of magnitude from
    both: 1.5e-8 in float64, 3.5e-4 in float32, 0.09 in bfloat16.

    Example:
        >>> tolerance(torch.float64) < 1e-7 < tolerance(torch.float32) < 1e-3
        True
    """
    return math.sqrt(torch.finfo(dtype).eps)


def module_params(api: str, module: nn.Module, arg: str) -> list[Tensor]:
    """``module.parameters()``, refused for a model that holds an ensemble beside layers of
    its own (a shared encoder): their rows are not members, yet a leading size equal to n
    read them as members (each row its own lr, its own clipping norm), silently."""
    inner = [(k, m) for k, m in module.named_modules() if hasattr(m, "stacked_params")]
    if inner and not hasattr(module, "stacked_params"):
        stacked = {id(p) for _, m in inner for p in m.parameters()}
        other = [k for k, p in module.named_parameters() if id(p) not in stacked]
        if other:
            raise ValueError(
                f"{api}: `{arg}` is a {type(module).__name__} that holds the ensemble "
                f"`{inner[0][0]}` and parameters of its own ({', '.join(other[:3])}"
                f"{', ...' if len(other) > 3 else ''}), whose rows are not members: pass the "
                f"ensemble (`model.{inner[0][0]}`) and give the others to a torch.optim "
                "optimizer or torch.nn.utils.clip_grad_norm_"
            )
    return list(module.parameters())


#: The loss modules ``check_loss_fn`` has warned about.
_WARNED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def check_loss_fn(api: str, loss_fn: Any) -> None:
    """A callable ``loss_fn``; warn if it holds parameters that require grad.

    The step differentiates and steps the ensemble's parameters only, so a loss module's own
    (a learned temperature) stays as built, where alone a user who puts it in the optimizer
    trains it. Alone, a loss module's parameters outside the optimizer (a GAN's discriminator,
    a distillation teacher) do not train either: hence a warning, not an error.
    """
    if not callable(loss_fn):
        raise TypeError(f"{api}: `loss_fn` must be callable, got {type(loss_fn).__name__}")
    if isinstance(loss_fn, nn.Module) and not hasattr(loss_fn, "stacked_params"):
        # A template module the loss holds to read what its forward kept (``ens.template.a``):
        # its parameters are the members' own, which the step trains.
        names = [
            k
            for k, p in loss_fn.named_parameters()
            if p.requires_grad and not isinstance(p, TemplateParameter)
        ]
        if names and loss_fn not in _WARNED:  # fit, then the make_step it calls: once
            _WARNED.add(loss_fn)
            warnings.warn(
                f"{api}: `loss_fn` ({type(loss_fn).__name__}) holds parameters that require "
                f"grad ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}), which the "
                "step neither differentiates nor steps (it trains the ensemble's parameters "
                "only; one loss module cannot be every member's own). To train them, move them "
                "into the member module (each member then learns its own, as alone); if they "
                "are not to train (a teacher, a discriminator trained apart), freeze them with "
                "`loss_fn.requires_grad_(False)`, which also silences this warning",
                UserWarning,
                stacklevel=3,
            )
