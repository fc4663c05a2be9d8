"""The self-check's two runs of one member on one batch: alone, as a plain module of the
user's class (``ens[member]``, forward, loss, ``backward()``), and through the ensemble's member
map, as a training step runs it. Both start from the caller's RNG state and leave it, and the
batch, as they were; each returns what a training step uses (outputs, loss, the state after
the forward, the gradients), which ``selfcheck`` compares.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Callable, Iterator
from typing import Any

import optree
import torch

try:  # a forward may draw from numpy's global RNG: told apart from torch's below
    import numpy
except ImportError:  # torch runs without numpy
    numpy = None  # type: ignore[assignment]
from torch import Tensor, nn

from ._attention import batched_attention
from ._batch_edits import batch_kept
from ._batchable import BatchableAlphaDropout, BatchableDropout, in_logical_order
from ._fastcall import call_member
from ._generator_draws import batched_draws, generators_in, made_in_the_call
from ._kept import KeptSlots, as_mapped, give_, kept_on, map_kept, slots_for
from ._kept_loans import loss_with_kept
from ._members import named_tensors
from ._selfcheck_parts import (
    Attributes,
    carried,
    fingerprints,
    plain_attributes,
    set_attributes,
)
from ._step_more import reached_leaves
from ._unbatchable import FAILED
from .ensemble import Ensemble

__all__ = [
    "DRAWS",
    "IN_FORWARD",
    "failure_alone",
    "forked_rng",
    "loss_state_kept",
    "member_slice",
    "own_generator",
    "run_alone",
    "run_together",
]


# Alone, torch fills a channels-last or transposed tensor in memory order; vmap in logical order.
DRAWS = (
    "It draws random numbers: an in-place draw or F.dropout into a tensor laid out otherwise "
    "than contiguous (channels-last, transposed) gets other numbers under vmap; draw into "
    "`.contiguous()` (or use torch.rand_like, nn.Dropout). "
)


@contextlib.contextmanager
def forked_rng(ens: Ensemble, *batch: Any) -> Iterator[None]:
    """A run that starts from the caller's RNG state (both runs: the same dropout draws) and
    leaves it as it was, with each ``torch.Generator`` passed in ``batch`` (``ens(x, g)``:
    the run alone drew from it before the run inside the ensemble, which then drew others)."""
    device = next(iter(ens.stacked_state().values()), torch.empty(0)).device
    passed = generators_in(batch)
    states = [g.get_state() for g in passed]
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            yield
        finally:
            for g, state in zip(passed, states, strict=True):
                g.set_state(state)


def _autocast(ens: Ensemble, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    if dtype is None:
        return contextlib.nullcontext()
    device = next(iter(ens.stacked_state().values()), torch.empty(0)).device
    return torch.autocast(device.type, dtype)


#: The alone module's layers re-classed for the self-check (see ``in_logical_order``).
_LOGICAL_DRAWS = {torch.nn.Dropout: BatchableDropout, torch.nn.AlphaDropout: BatchableAlphaDropout}


def _logical(ens: Ensemble) -> contextlib.AbstractContextManager:
    return in_logical_order() if ens.backend == "vmap" else contextlib.nullcontext()


def _copied(tree: Any) -> Any:
    return optree.tree_map(lambda t: t.detach().clone() if isinstance(t, Tensor) else t, tree)


def _opened(tree: Any) -> Any:
    """``tree`` with each dataclass instance as a dict of its fields: an output node optree
    does not open, compared field by field (the run inside the ensemble holds vmap's
    tensors there, which ``==`` on the dataclass met as escaped ones)."""

    def open_(value: Any) -> Any:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return _opened({f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
        return value

    return optree.tree_map(open_, tree)


def member_slice(tree: Any, member: int, in_dims: int | None, keep_dim: bool) -> Any:
    if in_dims is None:
        return tree
    index = slice(member, member + 1) if keep_dim else member

    def cut(t: Tensor) -> Tensor:
        if keep_dim and t.layout != torch.strided:  # a sparse tensor takes no slice
            return t.index_select(0, torch.tensor([member], device=t.device))
        return t[index]

    return optree.tree_map(lambda t: cut(t) if isinstance(t, Tensor) else t, tree)


#: Set on an error raised by the member's own forward in ``run_alone`` (not by ``loss_fn``).
IN_FORWARD = "_vmapens_member_forward"


def run_alone(
    ens: Ensemble,
    member: int,
    loss_fn: Callable,
    args: tuple,
    targets: Tensor,
    in_dims: int | None,
    autocast: torch.dtype | None,
    attributes: Attributes | None = None,
) -> dict[str, Any]:
    """Member ``member`` as a plain module: outputs, loss, state after, ``.grad``s, and the
    plain attributes its forward set (``attributes``: set these first)."""
    module = ens[member]
    set_attributes(module, attributes or {})
    before = fingerprints(plain_attributes(module))
    slots = KeptSlots(module)
    seen = slots.seen()
    for sub in module.modules() if ens.backend == "vmap" else ():  # see in_logical_order
        sub.__class__ = _LOGICAL_DRAWS.get(type(sub), type(sub))
    python_rng, numpy_rng = random.getstate(), _numpy_state()
    with batch_kept(args, targets) as edited, forked_rng(ens, args, targets), _logical(ens):
        torch_rng = torch.get_rng_state()  # inside the fork: what this run draws
        with _autocast(ens, autocast):
            try:
                out = module(*member_slice(args, member, in_dims, False))
            except Exception as err:
                setattr(err, IN_FORWARD, True)  # not the loss: see ``Probe``
                raise
            target = member_slice(targets, member, in_dims, False)
            set_now = slots.new(seen)  # tensors it set: each member gets its own, in turns too
            loss = loss_with_kept(loss_fn, out, target, ens.template, set_now)
        drew = not torch.equal(torch.get_rng_state(), torch_rng)  # torch's CPU generator
        # Into the parameters only, as the step differentiates: a target or input that
        # requires grad (a teacher's output) keeps its `.grad` (None).
        trained = [p for p in module.parameters() if p.requires_grad]
        reads = _stacked_reads(ens, loss, (args, targets))
        if loss.requires_grad and trained:  # all parameters frozen: nothing to differentiate
            loss.backward(inputs=trained)
        out = _copied(_opened(out))  # an output that is the input edited in place: put back next
    grads = {name: p.grad for name, p in module.named_parameters() if p.requires_grad}
    state = {name: t.detach() for name, t in named_tensors(module)}
    kept = carried(before, plain_attributes(module))
    return {
        "out": out,
        "loss": loss.detach(),
        "state": state,
        "grads": grads,
        "edits": edited,
        "carried": kept,
        "kept": {tuple(name.rsplit(":", 1)) for name in set_now},
        "reads": reads,
        # drew from Python's `random` or numpy's global RNG: named by the refusal
        "python_rng": "Python's `random` module"
        if random.getstate() != python_rng
        else ("numpy's global RNG (`np.random`)" if _numpy_state() != numpy_rng else None),
        "torch_rng": drew,
    }


def own_generator(
    ens: Ensemble,
    member: int,
    loss_fn: Callable,
    args: tuple,
    targets: Tensor,
    in_dims: int | None,
    autocast: torch.dtype | None,
) -> bool:
    """Whether member ``member``'s forward and loss, run alone once more (a copy, the RNG
    forked, the batch kept), draw from a generator they make (``_generator_draws``), where one
    vmap runs several members with ``randomness="different"``."""
    if not batched_draws(ens):
        return False
    module = ens[member]

    def run() -> None:
        with batch_kept(args, targets), forked_rng(ens, args, targets), _autocast(ens, autocast):
            out = module(*member_slice(args, member, in_dims, False))
            loss_fn(out, member_slice(targets, member, in_dims, False))

    with loss_state_kept(loss_fn):
        return made_in_the_call(run, args, targets)


def _numpy_state() -> tuple | None:
    """numpy's global generator state as comparable values (None without numpy)."""
    if numpy is None:
        return None
    state: Any = numpy.random.get_state()  # ("MT19937", keys, pos, has_gauss, gauss)
    return state[1].tobytes(), *state[2:]


def _stacked_reads(ens: Ensemble, loss: Tensor, given: Any) -> list[str]:
    """The names of ``ens``'s own stacked parameters that ``loss`` (of a member run alone, a
    copy) reaches outside the member and the batch ``given`` (inputs or targets computed from
    the ensemble, which the step back-propagates as alone): a ``loss_fn`` that reads
    ``ens.stacked_params()``."""
    leaves = {id(p): name for name, p in ens.stacked_params().items() if p.requires_grad}
    batch = [t.grad_fn for t in optree.tree_leaves(given) if isinstance(t, Tensor)]
    via_batch = set(reached_leaves(batch, leaves))
    read = set(reached_leaves([getattr(loss, "grad_fn", None)], leaves)) - via_batch
    return sorted(leaves[i] for i in read)


def run_together(
    sub: Ensemble,
    member: int,
    loss_fn: Callable,
    args: tuple,
    targets: Tensor,
    in_dims: int | None,
    autocast: torch.dtype | None,
    *,
    template: torch.nn.Module,
) -> dict[str, Any]:
    """The same member through the ensemble's member map (``sub``: that member alone, at
    its own size: a padded member's tensors are cut to it; ``template``: the ensemble's,
    where ``loss_fn`` may read what the forward kept, as in the step)."""
    state = sub.stacked_state()
    trained = [name for name, p in sub.stacked_params().items() if p.requires_grad]

    structure: list = []
    slots = slots_for(sub.runner)
    # The member's rows of what the forwards kept (a hidden state read back): ``sub``, a copy,
    # starts with None there, where the step's runner and ``ens[member]`` hold the member's.
    kept = {} if sub._padding is not None else {
        f"{path}:{k}": map_kept(lambda t: t[member : member + 1], v)
        for path, k, v in kept_on(template)
    }  # fmt: skip
    kept = as_mapped(sub.runner, kept)

    def run(st: dict, inputs: tuple, target: Tensor, rows: dict) -> tuple[Any, Tensor]:
        give_(sub.runner, rows)
        seen = slots.seen()
        out = call_member(sub.runner, st, inputs)
        leaves, spec = optree.tree_flatten(_opened(out))
        structure[:] = [spec, leaves]  # a number in the output is no vmap output: kept here
        loss = loss_with_kept(loss_fn, out, target, template, slots.new(seen))
        return [t for t in leaves if isinstance(t, Tensor)], loss

    mine = member_slice(args, member, in_dims, True)
    target = member_slice(targets, member, in_dims, True)
    attention = batched_attention() if sub.backend == "vmap" else contextlib.nullcontext()
    with batch_kept(args, targets), forked_rng(sub, args, targets), attention, _logical(sub):
        with _autocast(sub, autocast):
            tensors, loss = sub._member_map(run, (in_dims, in_dims, 0))(state, mine, target, kept)
        spec, leaves = structure
        outs = iter(tensors)
        out = spec.unflatten([next(outs) if isinstance(t, Tensor) else t for t in leaves])
        params = [state[name] for name in trained]
        found: Any = [None] * len(params)
        if params and loss.requires_grad:
            found = torch.autograd.grad(loss.sum(), params, allow_unused=True)
        out = _copied(out)
    padding = sub._padding

    def own(name: str, t: Tensor) -> Tensor:
        return t[0] if padding is None else padding.take(name, t[0], 0)

    grads = {k: None if g is None else own(k, g) for k, g in zip(trained, found, strict=True)}
    after = {name: own(name, t.detach()) for name, t in sub.stacked_state().items()}
    first = optree.tree_map(lambda t: t[0] if isinstance(t, Tensor) else t, out)
    return {"out": first, "loss": loss.detach()[0], "state": after, "grads": grads}


#: The members ``failure_alone`` runs at most, one after another, to find the one that fails.
_TRIED = 64


@contextlib.contextmanager
def loss_state_kept(loss_fn: Callable) -> Iterator[None]:
    """Put a loss module's buffers and gradients back after the probe's runs of the loss: a
    frozen teacher in train mode inside the loss updated its BatchNorm statistics twice more
    on the first step than alone, silently."""
    if not isinstance(loss_fn, nn.Module):
        yield
        return
    kept = [(m, k, t, t.detach().clone()) for m in loss_fn.modules()
            for k, t in m._buffers.items() if t is not None]  # fmt: skip
    grads = [(p, None if p.grad is None else p.grad.detach().clone()) for p in loss_fn.parameters()]
    try:
        yield
    finally:
        with torch.no_grad():
            for module, key, tensor, value in kept:
                tensor.copy_(value)
                module._buffers[key] = tensor
        for p, grad in grads:
            p.grad = grad


def failure_alone(
    api: str,
    failed: Exception,
    ens: Ensemble,
    loss_fn: Callable,
    args: tuple,
    targets: Any,
    in_dims: int | None,
    autocast: torch.dtype | None,
) -> Exception | None:
    """The error a member raises run alone on a batch the ensemble failed on (``failed``), in
    its own type with the step's words in front, or None where it runs alone or ``failed``
    already is that error.

    Under ``vmap`` an error speaks of the batched tensors (a class target out of range: "index
    7 is out of bounds for dimension 2 with size 3", a ``RuntimeError`` where ``F.cross_entropy``
    alone raises ``IndexError: Target 7 is out of bounds.``). Where a member fails alone too,
    its own error is what the user would see without the ensemble, and ``except IndexError``
    catches it as it would. Member 0 is run, and with per-member data (``in_dims=0``) the next
    ones until one fails (at most ``_TRIED``). An error the ensemble explains itself (a loss
    with ``reduction="none"``, an op vmap cannot batch) is kept: only torch's own words, or the
    step's "a member's forward or loss failed", are replaced. Nothing of the ensemble changes
    (``run_alone`` runs a copy, the RNG forked); a loss module's buffers are put back.
    """
    said = str(failed)
    if said.startswith(f"{api}:") and not said.startswith(f"{api}: {FAILED}"):
        return None
    for member in range(min(len(ens), _TRIED) if in_dims is not None else 1):
        try:
            with loss_state_kept(loss_fn):
                run_alone(ens, member, loss_fn, args, targets, in_dims, autocast)
        except Exception as err:
            if type(err) is type(failed) and str(err) in said:
                return None
            return _as_alone(api, member, err)
    return None


def _as_alone(api: str, member: int, err: Exception) -> Exception:
    """``err`` with the step's words in front: a builtin exception whose one argument is its
    message is made anew with them; any other (its own arguments, attributes) is raised as it
    is, the words added as a note where Python has notes (3.11)."""
    where = "its forward" if getattr(err, IN_FORWARD, False) else "`loss_fn`"
    lead = (
        f"{api}: member {member} run alone raises this too, in {where}: the batch or the code "
        "is what fails, not the ensemble."
    )
    plain = type(err).__module__ == "builtins" and not isinstance(err, KeyError)
    if plain and len(err.args) == 1 and isinstance(err.args[0], str):
        return type(err)(f"{lead} {err}")
    if hasattr(err, "add_note"):
        err.add_note(lead)
    return err
