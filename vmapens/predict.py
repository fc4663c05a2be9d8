"""Predictions of a trained ensemble: every member's outputs, or one of their reductions."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import optree
import torch
from torch import Tensor
from torch.utils.data import Dataset, IterableDataset

from ._checks import check_choice, check_int, positional
from .ensemble import Ensemble, check_ensemble

__all__ = ["REDUCTIONS", "predict", "reduce_members"]

REDUCTIONS = (
    "none",
    "mean",
    "vote",
    "min",
    "max",
    "variance",
    "entropy",
    "mutual_information",
    "disagreement",
)
_CLASSES = ("vote", "entropy", "mutual_information", "disagreement")


def predict(
    ens: Ensemble,
    data: Any,
    *,
    reduce: str = "none",
    batch_size: int | None = None,
    in_dims: Any = None,
    softmax: bool = False,
    chunk_size: int | None = None,
) -> Any:
    """Run every member on ``data`` in eval mode under ``torch.no_grad()``, batch by batch.

    The ensemble's mode is restored afterwards. Reductions work per sample, over the member
    dim, on each member's output ``[samples, ...]``; the class reductions read the last dim
    as classes:

    * ``"none"``: the members' outputs, ``[n, samples, ...]`` (any pytree of tensors).
    * ``"mean"``, ``"min"``, ``"max"``: elementwise over the members, ``[samples, ...]``.
    * ``"variance"``: elementwise population variance over the members (divides by n).
    * ``"vote"``: each member's argmax class, the most frequent one per sample (ties go to
      the lowest class index), ``[samples, ...]`` int64.
    * ``"entropy"``: the entropy of the mean predicted distribution, ``H[mean_i p_i]``
      (natural log), ``[samples, ...]``: total predictive uncertainty.
    * ``"mutual_information"``: ``H[mean_i p_i] - mean_i H[p_i]`` (BALD), the part of the
      entropy that comes from members disagreeing.
    * ``"disagreement"``: the fraction of member pairs ``i != j`` whose argmax classes
      differ (0 when n is 1).

    ``entropy`` and ``mutual_information`` need probabilities: pass ``softmax=True`` when the
    members return logits (outputs that are not probabilities over the last dim are refused).
    ``variance`` works on any output (regression too), so it cannot tell logits from
    probabilities: pass ``softmax=True`` for the variance of probabilities.

    Args:
        ens: the ensemble.
        data: the member's input (a tensor), a tuple of its positional inputs (tensors, and
            ``None`` for an input left out: ``(tokens, None, mask)``), or an iterable
            of batches, each one input or a tuple/list of inputs (a ``DataLoader`` over
            ``TensorDataset(x)`` yields ``[x]``).
        reduce: one of ``REDUCTIONS``.
        batch_size: cut tensor ``data`` into batches of this many samples (``None``: one
            batch, the inputs as given, so an input may broadcast over the samples). Samples
            are dim 0 of each input, or dim 1 for inputs mapped with ``in_dims=0`` (one slice
            per member); the batches' outputs are joined along the samples, which must come
            first in every output (``[n, samples, ...]``).
        in_dims: as in ``Ensemble.forward``: ``None`` (every member sees the same inputs),
            an int, or one entry per positional input.
        softmax: apply ``softmax`` over the last dim of each member's output first (members
            that return logits; ``"mean"`` then averages probabilities).
        chunk_size: run at most this many members at once (overrides ``ens.chunk_size`` for
            this call, to bound the activation memory).

    Returns:
        A tensor (or, with ``reduce="none"``, the output pytree) of the predictions.

    Raises:
        ValueError: an unknown ``reduce``, bad ``batch_size``/``chunk_size``, per-member
            inputs of the wrong size, inputs of different sample counts cut by
            ``batch_size``, data with no batches, batches whose outputs do not have the
            samples first; ``entropy`` or ``mutual_information`` of outputs that are not
            probabilities (logits without ``softmax=True``); a class reduction of outputs
            with one class (a last dim of size 1, such as a sigmoid's probability).
        TypeError: ``ens`` is not an Ensemble; ``data`` is a dict (pass ``[data]``) or a
            map-style ``Dataset`` (pass a ``DataLoader``); a reduction of a non-tensor
            output; a batch of more inputs than the member's forward takes (a
            ``DataLoader`` that yields the targets too).

    Example:
        >>> ens = Ensemble(lambda: torch.nn.Linear(4, 3), n=5, seed=0)
        >>> x = torch.randn(10, 4)
        >>> predict(ens, x, batch_size=4).shape
        torch.Size([5, 10, 3])
        >>> predict(ens, x, reduce="entropy", softmax=True).shape
        torch.Size([10])
    """
    api = "predict"
    check_ensemble(api, ens)
    check_choice(api, "reduce", reduce, REDUCTIONS)
    for name, value in (("batch_size", batch_size), ("chunk_size", chunk_size)):
        if value is not None:
            check_int(api, name, value, minimum=1)
    if isinstance(data, Mapping):
        raise TypeError(
            f"{api}: `data` is a {type(data).__name__}, which would be iterated over its keys; "
            "pass [data] for one batch whose input it is, or an iterable of such batches"
        )
    if isinstance(data, Dataset) and not isinstance(data, IterableDataset):
        # Its items are single samples: each ran as a batch without a sample dim, and their
        # outputs were joined along the classes ([samples * classes]), silently.
        raise TypeError(
            f"{api}: `data` is a {type(data).__name__}, whose items are single samples without "
            "a batch dim; pass DataLoader(data, batch_size=...) (or DataLoader(data, "
            "batch_size=None) when each item is already a batch)"
        )
    outputs: list[Any] = []
    samples: list[set[int]] = []
    chunks = ens.chunk_size
    if chunk_size is not None:
        ens.chunk_size = chunk_size
    try:
        with torch.no_grad(), ens._evaluating():
            for batch in _batches(data, batch_size, in_dims, api):
                try:
                    out = ens(*batch, in_dims=in_dims)
                except TypeError as err:
                    if len(batch) < 2 or "positional argument" not in str(err):
                        raise
                    raise TypeError(
                        f"{api}: each batch of `data` is the member's positional inputs, and "
                        f"this one holds {len(batch)} ({err}); a DataLoader over (x, y) "
                        "yields the targets too: predict over TensorDataset(x), or pass "
                        "(x for x, _ in loader)"
                    ) from err
                if softmax:
                    out = optree.tree_map(lambda t: t.softmax(-1), out)
                outputs.append(out if reduce == "none" else reduce_members(out, reduce))
                samples.append(_samples(batch, in_dims))
    finally:
        ens.chunk_size = chunks
    if not outputs:
        raise ValueError(f"{api}: `data` yielded no batches")
    if len(outputs) == 1:  # one batch: the outputs as they are, whatever their shapes
        return outputs[0]
    dim = 1 if reduce == "none" else 0
    _check_joinable(outputs, samples, dim, api)
    return optree.tree_map(lambda *ts: torch.cat(ts, dim=dim), outputs[0], *outputs[1:])


def reduce_members(out: Tensor, reduce: str) -> Tensor:
    """One of ``predict``'s reductions of a stacked output ``[n, samples, ...]`` over dim 0.

    Example:
        >>> reduce_members(torch.tensor([[0.0, 1.0], [2.0, 5.0]]), "variance")
        tensor([1., 4.])
    """
    check_choice("reduce_members", "reduce", reduce, REDUCTIONS)
    if not isinstance(out, Tensor):
        raise TypeError(
            f"predict: `reduce={reduce!r}` needs the members to return one tensor, got "
            f"{type(out).__name__}; use reduce='none'"
        )
    if reduce == "none":
        return out
    if reduce in _CLASSES and (out.dim() < 2 or out.shape[-1] < 2):
        # One column is no class dim: a vote, a disagreement, a softmax's entropy over it are
        # all 0, whatever the members say (a sigmoid output, p = P(class 1)).
        raise ValueError(
            f"predict: `reduce={reduce!r}` reads the last dim of each member's output as its "
            f"classes, got member outputs of shape {tuple(out.shape[1:])}: one class, for which "
            "every vote, disagreement and entropy is 0; for a binary model with one output, "
            "give both classes: from vmapens.predict import reduce_members; p = "
            f"vmapens.predict(ens, x); reduce_members(torch.cat([1 - p, p], -1), {reduce!r}) "
            "(for a logit z: torch.cat([torch.zeros_like(z), z], -1).softmax(-1))"
        )
    if reduce == "mean":
        return out.mean(0)
    if reduce == "min":
        return out.amin(0)
    if reduce == "max":
        return out.amax(0)
    if reduce == "variance":
        # No samples: torch's var warns about the empty reduction (0/0 degrees of freedom).
        return out.var(0, correction=0) if out.numel() else out.mean(0)
    if reduce in ("entropy", "mutual_information"):
        _check_probabilities(out, reduce)
        total = _entropy(out.mean(0))
        return total if reduce == "entropy" else total - _entropy(out).mean(0)
    n, classes = out.shape[0], out.shape[-1]
    counts = torch.nn.functional.one_hot(out.argmax(-1), classes).sum(0)  # [samples, ..., C]
    if reduce == "vote":
        return counts.argmax(-1)  # argmax returns the first maximum: ties go to the lowest class
    # A fraction: in the outputs' float dtype, or the default one for integer outputs (scores
    # or counts), which int64 would truncate to 0 whenever the members are not unanimous.
    dtype = out.dtype if out.is_floating_point() else torch.get_default_dtype()
    if n == 1:
        return torch.zeros(counts.shape[:-1], dtype=dtype, device=out.device)
    # In float64, then rounded once: float16 overflows past 256 members (counts 256 * 255),
    # bfloat16 rounds the pair count (up to 20% off).
    agree = (counts * (counts - 1)).sum(-1).to(torch.float64)
    return (1 - agree / (n * (n - 1))).to(dtype)


def _check_probabilities(p: Tensor, reduce: str) -> None:
    """Entropies of logits come out NaN or meaningless without an error: refuse them.

    Probabilities are in ``[0, 1]`` and sum to 1 over the last dim, up to ``sqrt(eps)`` of
    their dtype (a softmax rounds each entry by ``eps`` of itself, so the sum is off by about
    ``eps``; the bound is 3e-4 in float32, 0.09 in bfloat16), and never tighter than float32's:
    float64 outputs of a softmax taken in float32 (``softmax(x, -1, dtype=torch.float32)
    .type_as(x)``, as attention code does) sum to 1 only to float32's precision.
    Non-finite entries (a diverged member) are left to show as NaN.
    """
    dtype = p.dtype if p.is_floating_point() else torch.float32
    tol = math.sqrt(max(torch.finfo(dtype).eps, torch.finfo(torch.float32).eps))
    finite = p.isfinite().all(-1)
    rows = p[finite]
    if rows.numel() == 0:
        return
    low, high = float(rows.min()), float(rows.max())
    sums = rows.sum(-1)
    worst = float((sums - 1).abs().max())
    if low < -tol or high > 1 + tol or worst > tol:
        raise ValueError(
            f"predict: `reduce={reduce!r}` needs each member's output to be probabilities "
            f"over the last dim (in [0, 1], summing to 1), got values in [{low:.3g}, {high:.3g}] "
            f"with sums up to {worst:.3g} away from 1; pass softmax=True when the members "
            "return logits or log-probabilities"
        )


def _entropy(p: Tensor) -> Tensor:
    return -torch.special.xlogy(p, p).sum(-1)


def _batches(data: Any, batch_size: int | None, in_dims: Any, api: str) -> Iterable[tuple]:
    """Tuples of positional inputs: tensor data cut along the samples, or the given batches."""
    if isinstance(data, Tensor) or (  # a None among the inputs (`tags=None`) is an input too
        isinstance(data, tuple)
        and any(isinstance(t, Tensor) for t in data)
        and all(isinstance(t, Tensor) or t is None for t in data)
    ):
        args = data if isinstance(data, tuple) else (data,)
        dims = in_dims if isinstance(in_dims, tuple) else (in_dims,) * len(args)
        # A list would be read as one entry, cut at the wrong dim before the forward refuses it.
        if len(dims) != len(args) or not isinstance(in_dims, (tuple, int, type(None))):
            raise ValueError(
                f"{api}: `in_dims` must be None, an int, or a tuple with one entry per input "
                f"({len(args)}), got {in_dims!r}"
            )
        if batch_size is None:  # one batch: the inputs as given (a broadcast one included)
            yield args
            return
        cut = [(a, _sample_axis(a, d)) for a, d in zip(args, dims) if a is not None]
        sizes = [a.shape[ax] if a.dim() > ax else None for a, ax in cut]
        size = sizes[0]
        if size is None or any(s != size for s in sizes):
            shapes = ", ".join(
                f"input {k}: {tuple(a.shape)}" for k, a in enumerate(args) if a is not None
            )
            raise ValueError(
                f"{api}: `batch_size` cuts every input of `data` along its samples (dim 0 of "
                f"what a member sees), so they need as many samples each, got {shapes}; for "
                "an input shared by every sample, pass batch_size=None or an iterable of "
                "batches, e.g. [(x[i:i + b], z) for i in range(0, len(x), b)]"
            )
        # No samples: one empty batch, whose outputs have no samples either (as alone).
        for start in range(0, max(size, 1), batch_size):
            cuts = iter([a.narrow(ax, start, min(batch_size, size - start)) for a, ax in cut])
            yield tuple(None if a is None else next(cuts) for a in args)
        return
    if batch_size is not None:
        raise ValueError(f"{api}: `batch_size` cuts tensor `data`; an iterable is already batched")
    for batch in data:
        yield tuple(batch) if isinstance(batch, list) else positional(batch)


def _sample_axis(t: Tensor, dim: Any) -> int:
    """Samples are dim 0 of what each member sees: dim 1 of an input mapped at its dim 0."""
    mapped = isinstance(dim, int) and t.dim() > 0 and dim % t.dim() == 0
    return 1 if mapped else 0


def _samples(batch: tuple, in_dims: Any) -> set[int]:
    """The sample counts of a batch's inputs (dim 0 of what a member sees of each tensor)."""
    dims = in_dims if isinstance(in_dims, tuple) else (in_dims,) * len(batch)
    return {
        leaf.shape[_sample_axis(leaf, dim)]
        for arg, dim in zip(batch, dims)
        for leaf in optree.tree_leaves(arg)
        if isinstance(leaf, Tensor) and leaf.dim() > _sample_axis(leaf, dim)
    }


def _check_joinable(outputs: list[Any], samples: list[set[int]], dim: int, api: str) -> None:
    """Batches are joined along the samples, ``dim`` of every output: an output whose samples
    are elsewhere (an RNN's final hidden state, ``[layers, samples, ...]``) would be joined
    along another dim, silently or with a shape error from ``torch.cat``."""
    for k, (out, sizes) in enumerate(zip(outputs, samples)):
        for leaf in optree.tree_leaves(out):
            if (
                sizes
                and isinstance(leaf, Tensor)
                and (leaf.dim() <= dim or leaf.shape[dim] not in sizes)
            ):
                raise ValueError(
                    f"{api}: the batches' outputs are joined along the samples (dim {dim} of "
                    f"each output), but batch {k} of {min(sizes)} samples gave an output of shape "
                    f"{tuple(leaf.shape)}; for outputs whose samples are not first (an RNN's "
                    "final hidden state), predict in one batch (batch_size=None)"
                )
