"""What a member's forward does alone but not under vmap: the way out, or a substitute.

``Ensemble`` runs every member through ``torch.func.vmap`` on batched tensors. Some forwards
fail there with a message about something else (the meta device, a tensor that does not
require grad), some would silently compute something else (backward hooks that never fire;
an input edited in place once per member where members run in turns); this file recognises
them and says what to do, and gives the runner a substitute where one is exact. The batch
edits themselves are watched in ``_batch_edits``.
"""

from __future__ import annotations

import contextlib
import os
import re
import traceback
from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.nn.utils import parametrize

from ._attention import batched_attention
from ._batch_edits import EditedInTurns
from ._fastcall import WRITTEN, Reassigned

__all__ = [
    "FAILED",
    "NARROW_GATHER",
    "NO_STORAGE",
    "Guard",
    "explain_failure",
    "follow_sparse",
    "guarded",
    "sparse_layers",
    "unchunked",
]

# Substrings of torch.func errors that mean "this forward cannot be batched", as opposed to
# an ordinary bug in the user's forward that would fail for a single model too.
_UNBATCHABLE = (
    "Batching rule not implemented",
    "vmap: ",
    "We could not generate a fallback",
    "under vmap transform",  # `.data` of a batched tensor
)
#: How an error of a member's forward or loss that nothing here explains is reported.
FAILED = "a member's forward or loss failed"
#: What torch.func.vmap says of ``.data`` of a batched tensor.
_DATA = "accessing `data` under vmap transform"
#: What torch.func.vmap (and ``_fastcall.no_random_ops``) says of a random op under
#: ``randomness="error"``.
_RANDOM = "randomness error mode"
#: What torch.func.vmap says of a draw from per-member parameters (``torch.multinomial`` of a
#: member's probabilities) under ``randomness="same"``, and of an in-place draw into a tensor
#: the forward made (``torch.empty(...).normal_()``) under ``randomness="different"``.
_SAME_BATCHED = "same randomness with a batched tensor input"
_DIFFERENT_UNBATCHED = "different inplace randomness on an unbatched tensor"
#: What autograd says of a tensor changed in place after it was saved for backward.
_SAVED = "modified by an inplace operation"
#: After an unrecognised error under vmap: what to do when the member runs alone.
_VMAP_HINT = (
    ". If it runs alone, its forward may do what torch.func.vmap cannot batch, such as an "
    "in-place op that writes a member's tensor into one all members share (x.add_(self.bias) "
    "on the input, or on a tensor made in the forward: write x = x + self.bias); "
    "backend='loop' runs members one after another, each as alone"
)
#: What torch.func says of an autograd.Function without ``setup_context``.
_OLD_FUNCTION = "must override the setup_context staticmethod"
#: What ``Tensor.register_hook`` says of a batched tensor (it reports requires_grad=False).
_TENSOR_HOOK = "cannot register a hook on a tensor that doesn't require gradient"
#: What a member's batched tensor says when read as memory (``.tolist()``, ``.numpy()``,
#: ``.data_ptr()``; ``.untyped_storage()``): it has no storage of its own.
NO_STORAGE = ("Tensor that doesn't have storage", "Cannot access storage of BatchedTensorImpl")
#: What torch.func.vmap says of a member output that is not a tensor.
_NOT_TENSOR = "must only return Tensors"
#: Where the loop backend stacks the members' outputs (a TypeError there: not a tensor).
_MEMBERS = os.path.normcase(os.path.join("vmapens", "_member_maps.py"))
_CHECKPOINT = os.path.normcase(os.path.join("torch", "utils", "checkpoint.py"))
_AUTOGRAD = os.path.normcase(os.path.join("torch", "autograd", "__init__.py"))
#: Where torch.distributions checks its arguments (``validate_args``).
_DISTRIBUTIONS = os.path.normcase(os.path.join("torch", "distributions", ""))
#: What that check says of a parameter or a value outside its constraint.
_INVALID = "but found invalid values"
#: Where a check branches on a tensor's values (``MultivariateNormal(covariance_matrix=...)``'s
#: ``if not sym_check.all()``), and what vmap says of that branch.
_CONSTRAINTS = os.path.normcase(os.path.join("torch", "distributions", "constraints.py"))
_CONTROL_FLOW = "data-dependent control flow"
#: What torch says where a sparse gradient (``F.embedding(..., sparse=True)``) meets a member
#: map: vmap's reshape, or the loop's stacking of the members' gradients.
_SPARSE = ("not implemented for sparse tensors", "with arguments from the 'Sparse")
#: vmap's batched ``gather`` (``nll_loss``/``cross_entropy``'s rule) on uint8/int8/int16 indices.
NARROW_GATHER = "gather(): Expected dtype int32/int64 for index"
#: What torch says of a meta tensor (``ens.template``'s) met with real ones.
_META = re.compile(r"\bmeta\b")


def explain_failure(
    api: str, name: str, backend: str, err: BaseException, *, loss: bool = False
) -> Exception | None:
    """What went wrong in a member's forward or backward, and the way out; None if unknown.

    Activation checkpointing and ``torch.autograd.grad`` inside the forward are recognised by
    where in torch the error was raised; a buffer the forward reassigns (``_fastcall``), and
    a random op under ``randomness="error"``, with either backend.

    Args:
        api: the calling function's name, for the message.
        name: the member's class name.
        backend: the ensemble's backend.
        err: what the member map raised.
        loss: the member map ran ``loss_fn`` too (``make_step``, ``check``): a loss that
            branches on values (``nn.GaussianNLLLoss``) is what vmap cannot batch as often.

    Returns:
        The error to raise instead (chain ``err`` to it), or None for an ordinary failure.
    """
    if isinstance(err, EditedInTurns):
        return RuntimeError(err.message(api, name))
    if isinstance(err, Reassigned):
        return RuntimeError(
            f"{api}: the forward of {name} {err}. (Either backend refuses it; nothing was changed)"
        )
    if _SAVED in str(err) and WRITTEN:
        written = ", ".join(f"`{k}`" for k in dict.fromkeys(WRITTEN))
        return RuntimeError(
            f"{api}: the forward of {name} reassigns buffer {written} after using its old "
            "value in something its backward needs. The ensemble writes a reassigned buffer "
            "into its stacked storage in place (with either backend), and autograd refuses a "
            "tensor changed after it was saved for backward; where the forward uses the old "
            f"value, use a copy (self.<buffer>.clone()). ({err})"
        )
    if _RANDOM in str(err):
        return RuntimeError(
            f"{api}: the forward of {name} draws random numbers (dropout...), and the ensemble "
            "was built with randomness='error', which refuses them, with either backend. "
            "Build it with randomness='different' (each member its own draws, as separate "
            "models) or 'same' (one draw for all members), or put the random layers in eval "
            f"mode. ({err})"
        )
    what = f"`loss_fn` or the forward of {name}" if loss else f"the forward of {name}"
    if any(s in str(err) for s in _SPARSE):
        first = str(err).split(". ", 1)[0]  # torch's list of dispatch keys left out
        return RuntimeError(
            f"{api}: {what} makes a sparse tensor that torch.func.vmap cannot batch. A sparse "
            "gradient (F.embedding or F.embedding_bag with sparse=True) runs in neither "
            "backend: pass sparse=False (the same values, a dense gradient), freeze the weight, "
            "or run it under torch.no_grad(). A sparse tensor the forward builds from its "
            "inputs (torch.sparse_coo_tensor) runs with backend='loop', each member alone. "
            f"Nothing was changed ({first})"
        )
    if backend == "vmap" and _SAME_BATCHED in str(err):
        return RuntimeError(
            f"{api}: {what} draws random numbers with the member's own parameters "
            "(torch.multinomial, torch.normal or torch.bernoulli of per-member probabilities "
            "or means, as Categorical.sample() and Normal.sample() do), which torch.func.vmap "
            "cannot draw with randomness='same'. Build the ensemble with backend='loop' (with "
            "randomness='same' each member then draws what it draws alone from the same RNG "
            "state) or with randomness='different' (each member its own draws, equal to "
            f"alone's in distribution). ({err})"
        )
    if backend == "vmap" and _DIFFERENT_UNBATCHED in str(err):
        return RuntimeError(
            f"{api}: {what} draws random numbers in place into a tensor it made itself "
            "(torch.empty(...).normal_(), as Normal.rsample() and other reparametrised draws "
            "do), where torch.func.vmap cannot give each member draws of its own "
            "(randomness='different'). Build the ensemble with randomness='same' (each member "
            "draws what it draws alone from the same RNG state: the same noise for all), or "
            "with backend='loop' (members one after another, each its own draws). "
            f"({err})"
        )
    frames = [
        (os.path.normcase(f.filename), f.name) for f in traceback.extract_tb(err.__traceback__)
    ]
    in_distributions = any(_DISTRIBUTIONS in path for path, _ in frames)
    if any(path.endswith(_CHECKPOINT) for path, _ in frames):
        return RuntimeError(
            f"{api}: the forward of {name} uses torch.utils.checkpoint, which recomputes the "
            "checkpointed part during backward, after the member's own tensors have been "
            "swapped out of the module (they are on the meta device there); this fails with "
            "either backend where the checkpointed part calls a layer. Call the checkpointed "
            "function directly inside an ensemble: outputs and gradients are the same, only "
            "memory differs (train fewer members at once); a train-mode BatchNorm there updates "
            "its statistics once a step, where alone the recompute updates them a second time "
            f"(num_batches_tracked counts 2 a step). ({err})"
        )
    if "device meta" in str(err) and any(fn == "_engine_run_backward" for _, fn in frames):
        return RuntimeError(
            f"{api}: the backward of {name}'s forward (an autograd.Function's backward, as in "
            "an adjoint ODE solver, or a tensor hook) calls a module after the member's turn, "
            "when the member's own tensors have been swapped out of it (they are on the meta "
            "device there); this fails with either backend. Pass the parameters to the "
            "Function and call the module on them in its backward with "
            "torch.func.functional_call(module, dict(zip(names, params)), args) (with "
            f"torch.func.vjp there, it runs under vmap too). ({err})"
        )
    if loss and _META.search(str(err)) and not any(fn == "_call_impl" for _, fn in frames):
        return RuntimeError(
            f"{api}: `loss_fn` read a tensor of `ens.template` (its parameters or buffers), "
            "which is on the meta device and holds no values: each member's tensors are in "
            "the ensemble's stacked storage. Compute the term from the member's own tensors "
            "in its forward and return it with the output, or write the step by hand: "
            "`(vmapens.per_member(loss_fn)(ens(x), y) + penalty).sum().backward()` with "
            f"`penalty` one value per member from `ens.stacked_params()`. ({err})"
        )
    in_forward = False
    for path, fn in frames:
        in_forward = in_forward or fn == "_call_impl"  # below a module's forward
        if in_forward and path.endswith(_AUTOGRAD) and fn in ("grad", "backward"):
            break
    else:
        in_forward = "requires_grad_()" in str(err) and "functorch transform" in str(err)
    if in_forward and backend == "vmap":
        return RuntimeError(
            f"{api}: the forward of {name} calls torch.autograd.grad (or backward, or "
            "requires_grad_): inside torch.func.vmap a member's tensors carry no autograd "
            "history of their own, so it cannot differentiate there. Take the derivative "
            "with torch.func instead (torch.func.grad, jacrev, jvp or hessian of a function "
            "of the input: these run under vmap), or build the ensemble with backend='loop': "
            f"members run one after another, each as it would alone, exactly. ({err})"
        )
    if backend == "vmap" and _OLD_FUNCTION in str(err) and in_distributions:
        return RuntimeError(
            f"{api}: {what} draws from torch.distributions' Beta or Dirichlet, whose sample() "
            "runs torch's _Dirichlet, an autograd.Function torch.func.vmap cannot run. Draw "
            "the values outside the ensemble and pass them in (one per member with in_dims=0), "
            "draw two Gamma variables and take their ratio (X / (X + Y) with X ~ Gamma(a), "
            "Y ~ Gamma(b) is Beta(a, b)), or build the ensemble with backend='loop'. "
            f"({err})"
        )
    if backend == "vmap" and _OLD_FUNCTION in str(err):
        return RuntimeError(
            f"{api}: the forward of {name} calls a torch.autograd.Function written the old way "
            "(forward(ctx, ...) without a setup_context staticmethod), which torch.func.vmap "
            "cannot run. Give it setup_context and generate_vmap_rule = True (torch's notes "
            "'Extending torch.func with autograd.Function'), or build the ensemble with "
            f"backend='loop': members one after another, each as it runs alone. ({err})"
        )
    if backend == "vmap" and _TENSOR_HOOK in str(err):
        return RuntimeError(
            f"{api}: the forward of {name} registers a hook on a tensor (Tensor.register_hook); "
            "inside torch.func.vmap a member's tensors report requires_grad=False and take no "
            "hook. Build the ensemble with backend='loop' (the hook then runs for each member, "
            "as alone), or write the gradient change as a torch.autograd.Function with "
            f"generate_vmap_rule = True. ({err})"
        )
    stacked = isinstance(err, TypeError) and "expected Tensor as element" in str(err)
    if _NOT_TENSOR in str(err) or (stacked and frames and frames[-1][0].endswith(_MEMBERS)):
        return RuntimeError(
            f"{api}: the forward of {name} returns something other than tensors (and None): "
            "the ensemble stacks every output along a new member dim, with either backend. "
            f"Return tensors (torch.tensor(3) for a number) or None. ({err})"
        )
    if isinstance(err, ValueError) and _INVALID in str(err) and in_distributions:
        return ValueError(
            f"{api}: {what} builds a torch.distributions distribution whose argument check "
            "(validate_args, on by default) found invalid values (a NaN, say) in some "
            "member's tensors. The check raises for the whole call, so one member's invalid "
            "values (the NaN parameters of a diverged member) stop every member, where alone "
            "only that member would stop; find it with ens[i](inputs). To train the others "
            "on (fit freezes a member whose loss is not finite, history.diverged; a loop of "
            "your own masks it, opt.step(mask=losses.isfinite())), pass validate_args=False "
            "to the distribution or call "
            f"torch.distributions.Distribution.set_default_validate_args(False). ({err})"
        )
    if (
        backend == "vmap"
        and _CONTROL_FLOW in str(err)
        and any(path.endswith(_CONSTRAINTS) for path, _ in frames)
    ):
        return RuntimeError(
            f"{api}: {what} builds a torch.distributions distribution whose argument check "
            "(validate_args, on by default) branches on the member's values (as "
            "MultivariateNormal's covariance_matrix / precision_matrix check does), which "
            "torch.func.vmap cannot batch. Pass validate_args=False to the distribution (or "
            "call torch.distributions.Distribution.set_default_validate_args(False)): the rest "
            "runs batched, each member as alone; or build the ensemble with backend='loop', "
            f"which checks each member alone. ({err})"
        )
    if backend == "vmap" and any(m in str(err) for m in NO_STORAGE):
        return RuntimeError(
            f"{api}: {what} reads a tensor's memory (.tolist(), .numpy(), .data_ptr(), "
            ".untyped_storage()), which a member's batched tensor inside torch.func.vmap does "
            "not have. Compute with tensor ops instead, or build the ensemble with "
            f"backend='loop': members one after another, each as it runs alone. ({err})"
        )
    if backend == "vmap" and _DATA in str(err):
        return RuntimeError(
            f"{api}: {what} reads `.data` of a member's tensor, which torch.func.vmap refuses. "
            "Edit the tensor under torch.no_grad() instead (with torch.no_grad(): "
            "self.loc.copy_(...), as torch.nn.init does), which runs batched, each member its "
            f"own; or build the ensemble with backend='loop'. ({err})"
        )
    if backend == "vmap" and any(m in str(err) for m in _UNBATCHABLE):
        also = " (a loss that branches on values, such as nn.GaussianNLLLoss, needs it too)"
        return RuntimeError(
            f"{api}: {what} cannot be batched with torch.func.vmap ({err}). Build the ensemble "
            "with backend='loop' to run the members one after another on the same stacked "
            f"storage{also if loss else ''}."
        )
    return None


#: A layer whose ``sparse`` flag gives its weight a sparse gradient (``nn.Embedding``,
#: ``nn.EmbeddingBag``): its name, its module in the template (the flag the user sets, the
#: weight's grad flag) and in the runner.
SparseLayer = tuple[str, nn.Module]


def sparse_layers(template: nn.Module) -> list[SparseLayer]:
    """The layers ``follow_sparse`` watches, found once when the storage is adopted: an
    ensemble without them pays one empty-list test per call. Only torch's own layers: a
    ``sparse`` attribute of another module may mean anything."""
    return [
        (name, m)
        for name, m in template.named_modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag))
    ]


def follow_sparse(api: str, layers: Sequence[SparseLayer], grad: bool) -> None:
    """With ``grad`` (a backward may follow), a trained layer with ``sparse=True`` on the
    template is refused. The runner takes the template's flag, set after building too, as it
    takes every attribute (``vmapens._attributes``).

    Alone, ``nn.Embedding(sparse=True)`` gives its weight a sparse gradient; neither backend
    computes one for stacked members, and autograd fails in the backward with a message about
    something else (after a forward that moved BatchNorm statistics). The template's grad
    flags must be current (``StackedModule._follow_template``).

    Raises:
        ValueError: naming the layer and the way out.
    """
    for name, module in layers:
        if not (grad and module.sparse):
            continue
        # A parametrized weight (spectral_norm) read through its parametrization would run it
        # on the template (a power iteration writing its meta `_u`, `_v`): its original
        weight = (
            getattr(cast(Any, module).parametrizations.weight, "original", None)
            if parametrize.is_parametrized(module, "weight")
            else getattr(module, "weight", None)
        )
        if isinstance(weight, torch.Tensor) and weight.requires_grad:
            where = f"`{name}`" if name else "the member"
            raise ValueError(
                f"{api}: {where} ({type(module).__name__}) is built with sparse=True: its "
                "gradient would be a sparse tensor, which neither backend computes for stacked "
                "members; build it with sparse=False (the same values, a dense gradient; "
                f"`ens.template{'.' + name if name else ''}.sparse = False` switches every "
                "member), freeze its weight, or run it under torch.no_grad(). Nothing was changed"
            )


def unchunked(runner: nn.Module) -> nn.Module:
    """``runner`` with every ``nn.LinearCrossEntropyLoss`` on its reference path (in place).

    Its chunked path (``options`` set) computes gradients in the forward only for inputs that
    report ``requires_grad``, which a member's batched tensors never do under vmap: the
    weight and bias would get no gradient. The reference path (``options=None``) is the same
    maths, logits materialised, and vmap batches it. Only the runner changes: ``ens[i]`` and
    ``ens.template`` keep the user's options.
    """
    for module in runner.modules():
        if type(module) is getattr(nn, "LinearCrossEntropyLoss", None):
            setattr(module, "options", None)  # noqa: B010 (nn.Module.__setattr__ typing)
    return runner


class Guard:
    """What ``guarded`` yields: set ``members_ran`` once the members' forward and backward are
    done, so that a later error (clipping, the optimizer) is not explained as theirs."""

    members_ran = False


@contextlib.contextmanager
def guarded(
    buffers: Sequence[torch.Tensor], api: str, name: str, backend: str, loss: bool = False
) -> Iterator[Guard]:
    """``Ensemble.guard``: buffers given back on any exception, errors explained (``loss``: as
    in ``explain_failure``) until ``Guard.members_ran``, batched attention on with
    ``backend="vmap"`` (see there)."""
    saved = [b.clone() for b in buffers]
    guard = Guard()
    try:
        # The loop runs each member as alone: torch's own attention and its fast path
        with batched_attention() if backend == "vmap" else contextlib.nullcontext():
            yield guard
    except BaseException as err:
        with torch.no_grad():
            for b, s in zip(buffers, saved, strict=True):
                b.copy_(s)
        if not isinstance(err, Exception) or guard.members_ran:
            raise
        explained = explain_failure(api, name, backend, err, loss=loss)
        if explained is not None:
            raise explained from err
        if NARROW_GATHER in str(err):  # "gather():" read as naming where it came from
            raise RuntimeError(
                f"{api}: a member's forward or loss indexes with a uint8, int8 or int16 tensor "
                "(uint8 class targets, as read from an image mask), which vmap's gather cannot "
                f"index with (int64 or int32 only): pass .long() ({err})"
            ) from err
        if type(err) in (RuntimeError, NotImplementedError) and (
            ":" not in str(err).split(" ", 1)[0] or str(err).startswith("NYI:")
        ):
            # torch's own message (a shape mismatch, an op a layout lacks: "Could not run
            # 'aten::view' with arguments from the 'SparseCPU' backend") does not say where
            # it came from
            raise RuntimeError(
                f"{api}: {FAILED} ({err}); check the inputs "
                f"against one member run alone, e.g. ens[0](inputs){_VMAP_HINT * (backend == 'vmap')}"
            ) from err
        raise
