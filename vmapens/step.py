"""One training step for every member: forward, per-member loss, backward, optimizer step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._chunks import chunk_bounds, chunked_losses_and_grads
from ._compiled_step import compiled_step
from ._fastcall import call_member
from ._kept import call_noting, kept_rows
from ._kept_edits import refuse_items_set
from ._kept_loans import held_rows, loss_with_kept
from ._kept_stacks import stack_turns
from ._precision import LossScale
from ._selfcheck_runs import failure_alone
from ._step_hooks import TemplateHooks
from ._step_more import grad_on, graph_into, run_post_accumulate_hooks
from ._step_parts import (
    build_update,
    check_call,
    check_optimizer,
    distinct_grads,
    frozen_members,
    optimizer_errors,
    trainable,
    undo_point,
)
from .ensemble import Ensemble
from .optim import StackedOptimizer
from .selfcheck import Probe, check_step_arguments

__all__ = ["LossScale", "Step", "make_step"]

Step = Callable[..., torch.Tensor]


def make_step(
    ens: Ensemble,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    *,
    in_dims: int | None = None,
    compile: bool = False,
    clip_grad_norm: float | torch.Tensor | None = None,
    clip_grad_value: float | torch.Tensor | None = None,
    precision: str | None = None,
    loss_scale: LossScale | None = None,
    check: bool = True,
) -> Step:
    """Build ``step(inputs, targets, mask=None) -> losses[n]`` for an ensemble.

    ``step`` runs every member's forward on ``inputs``, applies ``loss_fn`` per member,
    back-propagates the *sum* of the member losses (so each member gets exactly its own
    gradient) and steps ``optimizer``. ``inputs`` is the member's single positional input,
    or a tuple of them. Both variants run the members through ``ens._member_map``, so
    ``backend``, ``chunk_size`` and ``randomness`` mean the same in both. With ``chunk_size``
    the eager step runs the forward and the backward of one chunk of members before the next
    (members are independent, so the result is the same), which bounds its activation memory
    to one chunk's; the compiled step passes ``chunk_size`` to ``vmap`` inside its graph.

    Eager (``compile=False``), this is the naive loop's code run once for all members. With
    ``compile=True`` the whole step goes through ``torch.compile(fullgraph=True)`` as one
    graph: per-member gradients come from ``torch.func.grad_and_value`` and the stacked
    optimizer's update runs inside the same graph. On CUDA it uses
    ``mode="reduce-overhead"``. Shared float hyperparameters are constants of the graph until
    one changes or a torch LR scheduler is attached; then they become inputs (one recompile),
    so a schedule does not recompile every step.

    A step is all or nothing: its arguments are checked before anything changes, and if the
    forward, the loss or the optimizer raises, parameters, buffers, gradients and optimizer
    state are left as they were.

    Args:
        ens: the ensemble to train.
        loss_fn: ``(output, target) -> scalar`` for one member, e.g. ``nn.BCELoss()``.
        optimizer: a ``vmapens.StackedOptimizer`` over ``ens`` (required for ``compile=True``
            and for ``mask``) or any torch optimizer over ``ens.parameters()``.
        in_dims: ``None`` when every member sees the same ``inputs`` and ``targets``; ``0``
            when both hold one slice per member along dim 0 (bagging, per-member data).
        compile: compile the whole step into one graph.
        clip_grad_norm: clip each member's gradients to this total 2-norm, as
            ``torch.nn.utils.clip_grad_norm_(member.parameters(), clip_grad_norm)`` would
            clip that member alone (see ``vmapens.optim.clip_grad_norm_``). A number or, as
            torch takes it, a 0-d tensor (read once, here).
        clip_grad_value: clamp every gradient element to ``[-v, v]``, as
            ``torch.nn.utils.clip_grad_value_`` would (a number or a 0-d tensor).
        precision: ``"bf16"`` or ``"fp16"``: each member's forward and loss run as under
            ``torch.autocast(device_type, dtype)`` for that member alone (docs/semantics.md,
            "Mixed precision"). ``"fp16"`` adds a per-member dynamic loss scale, as one
            ``torch.amp.GradScaler`` per member: gradients are unscaled (then clipped), a
            member with non-finite gradients skips its update. Needs a StackedOptimizer.
        loss_scale: the ``LossScale`` that ``"fp16"`` uses (default: ``LossScale(n)`` with
            GradScaler's defaults); keep a handle on it to checkpoint or configure it.
        check: ``False`` skips the first call's self-check (``vmapens.check``, semantics.md)
            and, with ``compile=True``, the check of each compiled graph's first update
            against the optimizer's eager update.

    Returns:
        ``step(inputs, targets, mask=None)`` returning the detached per-member losses
        ``[n]`` computed before the update. ``inputs`` is the forward's input, or a tuple of
        its positional inputs (a NamedTuple is one input, given whole as ``ens(batch)``
        gives it). ``targets`` is one tensor or a tuple, list or
        dict of tensors, given to ``loss_fn`` as it is (each member's rows with
        ``in_dims=0``). ``mask`` (bool ``[n]``) freezes the members where it is False: their
        parameters, optimizer state and buffers stay exactly as they were.

    Raises:
        TypeError: ``loss_fn`` not callable; ``optimizer`` not an optimizer; ``compile=True``
            with an optimizer that is not a StackedOptimizer; a clip bound that is not a
            number or a 0-d real tensor.
        ValueError: ``in_dims`` is not ``None`` or ``0``; ``optimizer`` holds tensors that
            are not this ensemble's parameters; ``compile=True`` with ``backend="loop"``;
            both clip options, a clip bound <= 0, an unknown ``precision``, ``loss_scale``
            without ``"fp16"`` or for another number of members.
        CompiledStepMismatch: (from the step, ``compile=True``) a compiled graph's first
            update differs from the eager one; that call changed nothing.
        RuntimeError: (from the step) called under ``torch.inference_mode()``; under
            ``torch.no_grad()`` a step runs with grad on, as ``torch.func.grad`` does.
        Exception: (from the eager step) where the members' forward or loss fails and member 0
            run alone on the batch fails too, member 0's own error, in its own type (an
            ``IndexError`` for a class target out of range, as ``F.cross_entropy`` alone).

    Example:
        >>> from vmapens import Ensemble, StackedAdam
        >>> ens = Ensemble(lambda: torch.nn.Linear(2, 1), n=3, seed=0)
        >>> step = make_step(ens, torch.nn.MSELoss(), StackedAdam(ens, lr=0.1))
        >>> step(torch.randn(5, 2), torch.zeros(5, 1)).shape
        torch.Size([3])
    """
    api = "make_step"
    check_step_arguments(api, ens, loss_fn, in_dims)
    check_optimizer(api, ens, optimizer)
    update = build_update(
        api, ens, optimizer, clip_grad_norm, clip_grad_value, precision, loss_scale
    )
    probe = Probe(ens, loss_fn, in_dims, update.dtype, enabled=check, compiled=compile)

    def arguments(inputs: Any, targets: Any, mask: torch.Tensor | None) -> None:
        check_call(ens, optimizer, inputs, targets, mask, in_dims)  # before the probe too
        refuse_items_set(ens.template)  # the step's kept_rows refuses it after the probe

    if compile:
        if not isinstance(optimizer, StackedOptimizer):
            raise TypeError(
                f"{api}: `compile=True` needs a vmapens.StackedOptimizer (its update runs inside "
                f"the compiled graph), got {type(optimizer).__name__}"
            )
        if type(optimizer).step is not StackedOptimizer.step:
            # The graph runs the update as apply_gradients, never optimizer.step().
            raise TypeError(
                f"{api}: `compile=True` runs the update inside the compiled graph, never through "
                f"`optimizer.step()`, and {type(optimizer).__name__} overrides `step`: its own "
                "step would be skipped. Use compile=False (the eager step calls "
                "optimizer.step()), or move the change into `update_` (which the graph calls)"
            )
        if ens.backend == "loop":
            raise ValueError(
                f"{api}: `compile=True` needs an ensemble with backend='vmap'; the 'loop' backend "
                "runs members one after another in Python, which torch.compile would unroll n "
                "times. Use compile=False with backend='loop'."
            )
        compiled = compiled_step(ens, _member_loss(ens, loss_fn), optimizer, in_dims, update, check)
        return grad_on(probe.wrap(compiled, arguments))
    turns: list = []  # what the forward kept, by turn: on the template after the step
    # With each member's rows of what the forwards kept before (the loop's: ``KeptTurns``)
    batched = ens._member_map(_member_loss(ens, loss_fn, turns), (in_dims, in_dims, 0))

    hooks = TemplateHooks(ens)  # `batched` was lifted now: hooks added later are seen here

    def step(inputs: Any, targets: Any, mask: torch.Tensor | None = None) -> torch.Tensor:
        ens._follow_template()  # ens.template.<layer>.requires_grad_(False) before the flags
        args = check_call(ens, optimizer, inputs, targets, mask, in_dims)
        hooks()
        # Listed every call, as loss.backward() reaches the module's parameters of the moment
        # (ens.apply(fn) that replaces one, load_state_dict(assign=True) give new Parameters),
        # with the optimizer's, which zero_grad clears (an old one it holds: no step on it).
        held_now = (q for group in optimizer.param_groups for q in group["params"])
        every: list[torch.Tensor] = list(dict.fromkeys([*ens.parameters(), *held_now]))
        params = trainable(every)
        old_grads = [p.grad for p in every]
        undo = undo_point(ens, optimizer)
        turns.clear()
        frozen = held_rows(ens.template, mask)  # a frozen member's kept hidden state stays
        own = kept_rows(ens.template, len(ens), ens.runner)
        guard = None
        try:
            with ens.guard("step", loss=True) as guard, frozen_members(ens, mask):
                scale = None if update.scale is None else update.scale.scale
                # chunk_size: forward and backward one chunk at a time (one chunk's activations
                # alive; vmap's chunking keeps all), unless the batch has a graph into the
                # parameters: one backward through it, as alone (the chunks' leaves cut it).
                chunks = chunk_bounds(len(ens), ens.chunk_size) if ens.backend == "vmap" else None
                if chunks is None or not params or graph_into((args, targets), params):
                    # Forward and loss in one vmap: half the batching overhead of ens(...) + loss.
                    with update.autocast():
                        losses = batched(ens.stacked_state(), args, targets, own)
                    scaled = losses if scale is None else losses * scale
                    grads: Sequence[torch.Tensor | None] = distinct_grads(
                        torch.autograd.grad(scaled.sum(), params, allow_unused=True), params
                    )
                else:
                    losses, grads = chunked_losses_and_grads(batched, ens.stacked_state(),
                        params, (args, targets, own), (in_dims, in_dims, 0), scale, chunks,
                        ens.randomness == "same", update.autocast, ens.runner)  # fmt: skip
                guard.members_ran = True  # errors from here on are not the members'
                for p in every:  # a layer frozen since the last step: no gradient, no step
                    p.grad = None  # (zero_grad's set_to_none)
                for p, new in zip(params, grads, strict=True):
                    p.grad = new
                run_post_accumulate_hooks(params)  # as loss.backward() runs them
                held = {id(q) for group in optimizer.param_groups for q in group["params"]}
                live = [p.grad for p in params if p.grad is not None]
                owned = [id(p) in held for p in params if p.grad is not None]
                stepping, found_inf = update.gradients_(live, mask, owned)
                stacked = stack_turns(turns, len(ens))  # refused here, before the update
                with optimizer_errors(optimizer):
                    if stepping is None:
                        optimizer.step()
                    else:
                        masked: Callable[..., Any] = optimizer.step  # a StackedOptimizer's
                        masked(mask=stepping)
                if update.scale is not None:
                    update.scale.update_(found_inf, mask)
        except BaseException as err:
            for p, g in zip(every, old_grads, strict=True):
                p.grad = g
            undo()
            ours = guard is None or not guard.members_ran  # the members' forward or loss
            if isinstance(err, Exception) and ours and ens.backend == "vmap":
                alone = failure_alone(
                    "step", err, ens, loss_fn, args, targets, in_dims, update.dtype
                )
                if alone is not None:
                    raise alone from err
            raise
        ens._keep(turns, True, stacked)  # as ens(x) leaves them: a reset on the template is seen
        frozen()
        turns.clear()
        return losses.detach()

    return grad_on(probe.wrap(step, arguments))


def _member_loss(
    ens: Ensemble, loss_fn: Callable, turns: list | None = None
) -> Callable[..., torch.Tensor]:
    """``(member_state, inputs, target) -> loss`` for one member, as it would run alone.

    With ``turns`` (the eager step's), what each turn's forward keeps on the runner's modules
    (``self.aux_loss = ...``) is noted there, as ``Ensemble.forward`` notes it, and lent to
    the template while ``loss_fn`` runs: a loss that reads ``ens.template.moe.aux_loss``
    reads the member's own. The compiled step passes none: dynamo cannot guard that scan, and
    a tensor kept on a module leaves its graph (refused, ``CompileFailed``)."""

    def member_loss(state: Any, inputs: tuple, target: Any, own: Any = None) -> torch.Tensor:
        runner, template = ens.runner, ens.template
        if turns is None:
            loss = loss_fn(call_member(runner, state, inputs), target)
        else:  # ``own``: its rows of what the forwards kept before (``kept_rows``)
            out, kept = call_noting(runner, state, inputs, None, turns, own)
            lent = kept if runner is not template else {}  # the loop kept them there
            loss = loss_with_kept(loss_fn, out, target, template, lent)
        # loss.backward() alone refuses more than one value; the sum over members would not.
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(
                f"step: `loss_fn` must return one value per member (a scalar tensor), got {got}; "
                "reduce it, e.g. reduction='mean'"
            )
        return loss.reshape(())

    return member_loss
