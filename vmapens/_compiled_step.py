"""The compiled step: ``make_step(compile=True)``'s whole step as one ``torch.compile`` graph.

Per-member gradients come from ``torch.func.grad_and_value`` through the ensemble's member map,
and the stacked optimizer's update runs inside the same graph. A graph is built for each set of
trained and held parameters, its first call checked against the eager update
(``_update_check``); shared float hyperparameters are constants of the graph until one changes
or a scheduler is attached (then inputs: one recompile).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.func import grad_and_value

from ._batch_edits import batch_kept, refuse_edits_in_turns
from ._chunks import rows
from ._compiling import (
    check_shapes,
    compile_arguments,
    compile_failures,
    own_code,
    refuse_custom_backwards,
    refuse_grad_hooks,
    refuse_kept_reads,
)
from ._kept import slots_for
from ._selfcheck_runs import forked_rng
from ._step_hooks import TemplateHooks, refuse_pre_hooks, run_post_hooks
from ._step_more import refuse_graph_into
from ._step_parts import (
    Update,
    attached_scheduler,
    check_call,
    check_groups,
    check_optimizer,
    counter_sharing,
    distinct_grads,
    frozen_members,
    graph_hyperparameters,
    own_counters,
    shared_floats,
    trainable,
)
from ._update_check import checked_call, static_addresses
from .ensemble import Ensemble
from .optim import StackedOptimizer

__all__ = ["MAX_SHAPES", "compiled_step"]

#: Distinct input shapes one compiled step accepts before refusing (dynamo's default limit).
MAX_SHAPES = 8


def compiled_step(
    ens: Ensemble,
    member_loss: Callable,
    optimizer: StackedOptimizer,
    in_dims: int | None,
    update: Update,
    check: bool,
) -> Callable[..., torch.Tensor]:
    """``step(inputs, targets, mask=None) -> losses[n]`` for ``make_step(compile=True)``
    (``member_loss``: one member's loss, as the eager step runs it)."""
    names = {id(p): name for name, p in ens.named_parameters()}
    scaled = update.scale is not None
    device = next(iter(ens.parameters())).device

    def build(trained: tuple[str, ...], order: tuple[str, ...]) -> tuple[Callable, Callable]:
        """The compiled step that trains the parameters named ``trained`` with an optimizer
        over those named ``order``, and its gradients' part, not compiled."""

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

        def gradients(state: dict, inputs: tuple, targets: Any, mask: Any, scale: Any) -> Any:
            """The step's gradients: the graph's first part, and the update check's eager
            reference (uncompiled)."""
            with update.autocast():
                grads, losses = batched(state, inputs, targets, scale)
            if ens._padding is not None:  # grad takes the masked parameters: padded entries 0
                masks = ens._padding.masks({k: state[k] for k in trained})
                grads = {k: g * masks[k] if k in masks else g for k, g in grads.items()}
            # Clipped as the eager step does it: every gradient, held by the optimizer or not
            # (clip_grad_norm_(member.parameters()) alone counts them all); unscaled: the held.
            live = [grads[name] for name in trained]
            stepping, found_inf = update.gradients_(live, mask, [n in order for n in trained])
            return grads, losses, live, stepping, found_inf

        def body(state: dict, inputs: tuple, targets: Any, mask: Any, scale: Any) -> Any:
            grads, losses, live, stepping, found_inf = gradients(
                state, inputs, targets, mask, scale
            )
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
        compiled = torch.compile(
            own_code(body),
            fullgraph=True,
            dynamic=False,
            **compile_arguments(device),  # CPU: a graph inductor miscompiles, unvectorized
        )
        return compiled, gradients

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
    graphs: dict[tuple, tuple[Callable, Callable]] = {((first, first[0]), None): build(*first)}
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
    eager = ens._member_map(member_loss, (in_dims, in_dims))  # the update check's forward

    def step(inputs: Any, targets: Any, mask: torch.Tensor | None = None) -> torch.Tensor:
        nonlocal baked, tensors, seen
        ens._follow_template()  # as the eager step: the template's flags, read below
        args = check_call(ens, optimizer, inputs, targets, mask, in_dims)
        refuse_graph_into((args, targets), every)
        hooks()
        refuse_pre_hooks(optimizer)  # the update runs inside the graph, not in opt.step()
        refuse_grad_hooks((names[id(p)], p) for p in every)  # nor autograd's hooks
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
        with torch.no_grad(), ens.guard("step", loss=True), frozen_members(ens, mask):
            scale = None if update.scale is None else update.scale.scale
            hyper = graph_hyperparameters(optimizer, made) if tensors else contextlib.nullcontext()
            with hyper, compile_failures():  # torch.compile's errors, named
                compiled, gradients = graphs[graph]
                run = functools.partial(compiled, ens.stacked_state(), args, targets, mask, scale)

                def reference() -> list[torch.Tensor]:  # the graph's gradients, eagerly
                    with batch_kept(args, targets):
                        return gradients(ens.stacked_state(), args, targets, mask, scale)[2]

                def forward() -> None:  # its edits of the parameters: the update starts there
                    with batch_kept(args, targets), update.autocast():
                        eager(ens.stacked_state(), args, targets)

                try:
                    if check and part not in checked:
                        losses, grads = checked_call(
                            run, forward, ens, optimizer, update.scale, trained, now[1], mask,
                            reference=reference, within=update.dtype,
                        )  # fmt: skip
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


def no_gradient(
    ens: Ensemble,
    member_loss: Callable,
    trained: tuple[str, ...],
    args: tuple,
    targets: torch.Tensor,
    in_dims: int | None,
    update: Update,
) -> set[str]:
    """The parameters named in ``trained`` that get no gradient on this batch, from member 0
    run eagerly (a copy of it: nothing of ``ens``, the batch or the RNG changes).

    ``loss.backward()`` leaves such a parameter's ``.grad`` None, and the optimizer skips it;
    ``torch.func.grad`` in the compiled graph gives it zeros, which weight decay would step.

    Raises:
        RuntimeError: the forward edits a batch tensor all members share while the graph runs
            members in turns (``chunk_size``): each chunk would see the edits of those before
            it. Found here, so that ``check=False`` refuses it too, before anything changed.
        CompileFailed: the forward calls a ``torch.autograd.Function`` with a backward of its
            own, which the compiled step cannot run (``refuse_custom_backwards``).
    """
    sub = ens.select([0])
    state = sub.stacked_state()
    batch: Any = (args, targets) if in_dims is None else rows((args, targets), 0, 1)
    forked = forked_rng(sub)
    # batch_kept: a forward that edits its input (x.mul_(2)) edits it once in the step, as
    # alone; without it the graph saw the probe's edit too (4 * x).
    slots = slots_for(ens.runner)  # the one `member_loss` runs
    with batch_kept(*batch) as edited:
        with forked, torch.enable_grad(), sub.guard("step", loss=True), update.autocast():
            seen = slots.seen()
            try:
                losses = sub._member_map(member_loss, (in_dims, in_dims))(state, *batch)
            except AttributeError as err:  # a loss reading `ens.template.aux`, which only
                refuse_kept_reads(err, slots.new(seen))  # the forward sets: what it means
                raise
        unused = set(trained)
        if losses.requires_grad:
            refuse_custom_backwards(losses, type(ens.template).__name__)
            params = [state[name] for name in trained]
            grads = torch.autograd.grad(losses.sum(), params, allow_unused=True)
            unused = {name for name, g in zip(trained, grads, strict=True) if g is None}
    if edited and in_dims is None:
        name = type(ens.template).__name__
        refuse_edits_in_turns("step", name, ens.backend, ens.chunk_size, len(ens))
    return unused
