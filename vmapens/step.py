"""One training step for every member: forward, per-member loss, backward, optimizer step."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.func import grad_and_value

from ._chunks import chunk_bounds, chunked_losses_and_grads
from ._compiling import check_shapes, compile_failures, compile_options, own_code
from ._fastcall import call_member
from ._precision import LossScale
from ._step_hooks import TemplateHooks, refuse_pre_hooks, run_post_hooks
from ._step_more import grad_on, graph_into, refuse_graph_into
from ._step_parts import (
    Update,
    attached_scheduler,
    build_update,
    check_call,
    check_groups,
    check_optimizer,
    counter_sharing,
    distinct_grads,
    frozen_buffers,
    graph_hyperparameters,
    no_gradient,
    optimizer_errors,
    own_counters,
    shared_floats,
    trainable,
    undo_point,
)
from ._update_check import checked_call, static_addresses
from .ensemble import Ensemble
from .optim import StackedOptimizer
from .selfcheck import Probe, check_step_arguments

__all__ = ["LossScale", "Step", "make_step"]

Step = Callable[..., torch.Tensor]
#: Distinct input shapes one compiled step accepts before refusing (dynamo's default limit).
MAX_SHAPES = 8


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
        ``[n]`` computed before the update. ``targets`` is one tensor or a tuple, list or
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
    member_loss = _member_loss(ens, loss_fn)
    probe = Probe(ens, loss_fn, in_dims, update.dtype, enabled=check)
    if compile:
        if not isinstance(optimizer, StackedOptimizer):
            raise TypeError(
                f"{api}: `compile=True` needs a vmapens.StackedOptimizer (its update runs inside "
                f"the compiled graph), got {type(optimizer).__name__}"
            )
        if ens.backend == "loop":
            raise ValueError(
                f"{api}: `compile=True` needs an ensemble with backend='vmap'; the 'loop' backend "
                "runs members one after another in Python, which torch.compile would unroll n "
                "times. Use compile=False with backend='loop'."
            )
        compiled = _compiled_step(ens, member_loss, optimizer, in_dims, update, check)
        return grad_on(probe.wrap(compiled))
    batched = ens._member_map(member_loss, (in_dims, in_dims))

    # The stacked parameters keep their identity through .to() / .double(): list them once.
    # Which of them train is read every call, as loss.backward() reads it.
    every: list[torch.Tensor] = list(ens.parameters())
    hooks = TemplateHooks(ens)  # `batched` was lifted now: hooks added later are seen here

    def step(inputs: Any, targets: Any, mask: torch.Tensor | None = None) -> torch.Tensor:
        ens._follow_template()  # ens.template.<layer>.requires_grad_(False) before the flags
        args = check_call(ens, optimizer, inputs, targets, mask, in_dims)
        hooks()
        params = trainable(every)
        old_grads = [p.grad for p in every]
        undo = undo_point(ens, optimizer)
        try:
            with ens.guard("step", loss=True), frozen_buffers(ens, mask):
                scale = None if update.scale is None else update.scale.scale
                # chunk_size: forward and backward one chunk at a time (one chunk's activations
                # alive; vmap's chunking keeps all), unless the batch has a graph into the
                # parameters: one backward through it, as alone (the chunks' leaves cut it).
                chunks = chunk_bounds(len(ens), ens.chunk_size) if ens.backend == "vmap" else None
                if chunks is None or not params or graph_into((args, targets), params):
                    # Forward and loss in one vmap: half the batching overhead of ens(...) + loss.
                    with update.autocast():
                        losses = batched(ens.stacked_state(), args, targets)
                    scaled = losses if scale is None else losses * scale
                    grads: Sequence[torch.Tensor | None] = distinct_grads(
                        torch.autograd.grad(scaled.sum(), params, allow_unused=True), params
                    )
                else:
                    losses, grads = chunked_losses_and_grads(batched, ens.stacked_state(),
                        params, args, targets, in_dims, scale, chunks,
                        ens.randomness == "same", update.autocast)  # fmt: skip
                for p in every:  # a layer frozen since the last step: no gradient, no step
                    p.grad = None  # (zero_grad's set_to_none)
                for p, new in zip(params, grads, strict=True):
                    p.grad = new
                held = {id(q) for group in optimizer.param_groups for q in group["params"]}
                live = [p.grad for p in params if p.grad is not None]
                owned = [id(p) in held for p in params if p.grad is not None]
                stepping, found_inf = update.gradients_(live, mask, owned)
                with optimizer_errors(optimizer):
                    if stepping is None:
                        optimizer.step()
                    else:
                        masked: Callable[..., Any] = optimizer.step  # a StackedOptimizer's
                        masked(mask=stepping)
                if update.scale is not None:
                    update.scale.update_(found_inf, mask)
        except BaseException:
            for p, g in zip(every, old_grads, strict=True):
                p.grad = g
            undo()
            raise
        return losses.detach()

    return grad_on(probe.wrap(step))


def _member_loss(ens: Ensemble, loss_fn: Callable) -> Callable[..., torch.Tensor]:
    """``(member_state, inputs, target) -> loss`` for one member, as it would run alone."""

    def member_loss(state: Any, inputs: tuple, target: Any) -> torch.Tensor:
        loss = loss_fn(call_member(ens.runner, state, inputs), target)
        # loss.backward() alone refuses more than one value; the sum over members would not.
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(
                f"step: `loss_fn` must return one value per member (a scalar tensor), got {got}; "
                "reduce it, e.g. reduction='mean'"
            )
        return loss.reshape(())

    return member_loss


def _compiled_step(
    ens: Ensemble,
    member_loss: Callable,
    optimizer: StackedOptimizer,
    in_dims: int | None,
    update: Update,
    check: bool,
) -> Step:
    names = {id(p): name for name, p in ens.named_parameters()}
    scaled = update.scale is not None
    device = next(iter(ens.parameters())).device

    def build(trained: tuple[str, ...], order: tuple[str, ...]) -> Callable[..., Any]:
        """The compiled step that trains the parameters named ``trained`` with an optimizer
        over those named ``order``."""

        def loss_of(params: dict, fixed: dict, inputs: tuple, target: Any, scale: Any) -> Any:
            loss = member_loss({**params, **fixed}, inputs, target)
            return (loss if scale is None else loss * scale), loss

        def member_grads(state: dict, inputs: tuple, target: Any, scale: Any) -> Any:
            # Buffers go in as an argument, not a closure: grad must not see them as captured
            # tensors, which BatchNorm updates in place.
            fixed = {k: v for k, v in state.items() if k not in trained}
            params = {k: state[k] for k in trained}
            grads, (_, loss) = grad_and_value(loss_of, has_aux=True)(
                params, fixed, inputs, target, scale
            )
            return grads, loss

        batched = ens._member_map(member_grads, (in_dims, in_dims, 0 if scaled else None))

        def body(state: dict, inputs: tuple, targets: Any, mask: Any, scale: Any) -> Any:
            with update.autocast():
                grads, losses = batched(state, inputs, targets, scale)
            if ens._padding is not None:  # grad takes the masked parameters: padded entries 0
                masks = ens._padding.masks({k: state[k] for k in trained})
                grads = {k: g * masks[k] if k in masks else g for k, g in grads.items()}
            # Clipped as the eager step does it: every gradient, held by the optimizer or not
            # (clip_grad_norm_(member.parameters()) alone counts them all); unscaled: the held.
            live = [grads[name] for name in trained]
            stepping, found_inf = update.gradients_(live, mask, [n in order for n in trained])
            # Frozen parameters get no gradient (None), as with loss.backward().
            optimizer.apply_gradients([grads.get(name) for name in order], mask=stepping)
            if update.scale is not None:
                update.scale.update_(found_inf, mask)
            # The gradients are outputs, so inductor computes each into a buffer of its own,
            # ordered before the parameter writes that follow its reads. Otherwise it inlines a
            # gradient that reads another parameter (a * b: b's reads a; weight norm's g reads
            # v) into the foreach kernel that writes the parameters, which can write that
            # parameter first (torch 2.13): members stepped from wrong gradients, silently.
            return losses, live

        # dynamic=False: shapes are fixed per ensemble, and functorch's grad cannot trace
        # symbolic sizes. own_code: dynamo caches compiled graphs on the code object, so every
        # make_step would otherwise share one cache (and its recompile limit) with every other.
        return torch.compile(
            own_code(body),
            fullgraph=True,
            dynamic=False,
            options=compile_options(device),
        )

    # Which parameters train, and which the optimizer holds, are read every call, as
    # loss.backward() and opt.step() read them: a layer frozen or unfrozen after make_step, or
    # a param group added, gets a graph of its own (compiled once for each such pair).
    every = [p for _, p in ens.named_parameters()]

    def graph_key(trained: list[torch.Tensor]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The names of ``trained`` and of the parameters the optimizer holds, in order."""
        held = [p for group in optimizer.param_groups for p in group["params"]]
        if any(id(p) not in names for p in held):  # a param group added holds another tensor
            check_optimizer("step", ens, optimizer)  # raises, naming it
        return tuple(names[id(p)] for p in trained), tuple(names[id(p)] for p in held)

    first = graph_key([p for p in every if p.requires_grad])
    # torch.compile wraps now and compiles at the first call; a graph is keyed by (trainable
    # and held names, the names it differentiates) and which share step counts (None: any).
    graphs: dict[tuple, Callable[..., Any]] = {((first, first[0]), None): build(*first)}
    # For each (graph key, input shapes, train/eval modes, dtypes), for the template's
    # attributes as they are (`seen` below): the graph, the parameters that get a gradient
    # (no_gradient: member 0 run eagerly; a forward may read a parameter only in training
    # mode, an auxiliary head, or for some shapes), and the ids of those it
    # steps when the optimizer holds others (they need step counts of their own: own_counters),
    # and the parameters whose gradients the graph returns, held by the optimizer or not (.grad).
    parts: dict[tuple, tuple[tuple, tuple[str, ...], set[int] | None, list[torch.Tensor]]] = {}
    # The template's modes: the runner takes them only inside ens.guard, after this key is
    # read (ens.template.head.eval() between steps reused train mode's parts once).
    modules = list(ens.template.modules())
    # The parts whose first call was checked against the eager update (_update_check): dynamo
    # compiles anew for new shapes, a mask or another mode.
    checked: set[tuple] = set()
    shapes: set[tuple] = set()
    made: dict[tuple, Any] = {}  # graph_hyperparameters' MemberValues, kept between calls
    # Shared float hyperparameters are constants of the graph (dynamo guards on their values)
    # until one changes or a scheduler is attached; from then on they go in as tensors
    # (graph_hyperparameters): a schedule recompiles once, not every step. As constants they
    # are 17-46 us a step cheaper at N = 15 (docs/performance.md).
    baked: tuple | None = None  # the floats the graphs were built with
    # The template's attributes' version the parts were found with (a flag may switch a head
    # on): an edit's version never comes back, so the parts of earlier ones go.
    seen = ens._followers[4].version
    tensors = False  # whether they go in as tensors
    hooks = TemplateHooks(ens)  # the graphs' member maps are lifted once each

    def step(inputs: Any, targets: Any, mask: torch.Tensor | None = None) -> torch.Tensor:
        nonlocal baked, tensors, seen
        ens._follow_template()  # as the eager step: the template's flags, read below
        args = check_call(ens, optimizer, inputs, targets, mask, in_dims)
        refuse_graph_into((args, targets), every)
        hooks()
        refuse_pre_hooks(optimizer)  # the update runs inside the graph, not in opt.step()
        key = _shapes((args, targets, mask))
        check_shapes(shapes, key, MAX_SHAPES)
        now = graph_key(trainable(every))
        if not tensors:
            floats = shared_floats(optimizer)
            baked = floats if baked is None else baked
            if floats != baked or attached_scheduler(optimizer):
                tensors = True
                graphs.clear()  # new code objects: the baked graphs' cache entries go with them
                checked.clear()
        if ens._followers[4].version != seen:  # an edit: dynamo compiles anew, to be checked
            seen = ens._followers[4].version
            parts.clear()
            checked.clear()
        # The parameters' dtypes too: after ens.double() dynamo compiles anew, to be checked.
        part = (now, key, tuple([m.training for m in modules]), tuple([p.dtype for p in every]))
        if part not in parts:
            unused = no_gradient(ens, member_loss, now[0], args, targets, in_dims, update)
            trained = tuple(name for name in now[0] if name not in unused)
            stepped = {id(p) for p in every if names[id(p)] in trained}
            returned: list[torch.Tensor] = [p for p in every if names[id(p)] in trained]
            own = stepped if set(now[1]) - set(trained) else None
            parts[part] = ((now, trained), trained, own, returned)
        traced, trained, stepping, returned = parts[part]
        optimizer.prepare()  # state is created outside the graph
        if stepping is not None:  # the optimizer holds parameters this graph does not step
            own_counters(optimizer, stepping)
        graph = (traced, counter_sharing(optimizer))  # a graph of its own: dynamo does not guard it
        if graph not in graphs:  # the first call takes the graph built above
            built = graphs.pop((traced, None), None)
            graphs[graph] = build(trained, now[1]) if built is None else built
        cuda = every[0].device.type == "cuda"  # moved there after make_step, too
        if cuda:
            static_addresses(ens, optimizer)
        # Gradients come from torch.func inside the graph: no autograd graph around it.
        with torch.no_grad(), ens.guard("step", loss=True), frozen_buffers(ens, mask):
            scale = None if update.scale is None else update.scale.scale
            hyper = graph_hyperparameters(optimizer, made) if tensors else contextlib.nullcontext()
            with hyper, compile_failures():  # torch.compile's errors, named
                run = functools.partial(
                    graphs[graph], ens.stacked_state(), args, targets, mask, scale
                )
                try:
                    if check and part not in checked:
                        losses, grads = checked_call(
                            run, ens, optimizer, update.scale, trained, now[1], mask
                        )
                        checked.add(part)
                    else:
                        losses, grads = run()
                except Exception:
                    check_groups(optimizer)  # a bad group value: the eager step's TypeError
                    raise
        # It stepped the optimizer without opt.step(): say so to torch's LR schedulers, as the
        # wrapper they put on opt.step does (else: "lr_scheduler.step() before optimizer.step()").
        optimizer._opt_called = True  # type: ignore[attr-defined]
        shapes.add(key)
        # .grad as the eager step leaves it: this step's gradients (unscaled, clipped), None
        # where none. A CUDA graph's outputs are overwritten by its next replay: copies there.
        for p in every:
            p.grad = None
        # Laid out as their parameters (channels_last), as torch's .grad and the eager step's.
        for param, grad in zip(returned, distinct_grads(grads, returned), strict=True):
            param.grad = grad.clone() if cuda and grad is not None else grad
        run_post_hooks(optimizer, mask)
        return losses

    return step


def _shapes(tree: Any) -> tuple:
    leaves = [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]
    return tuple((tuple(t.shape), str(t.dtype)) for t in leaves)
