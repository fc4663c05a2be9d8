"""One training step for every member: forward, per-member loss, backward, optimizer step."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.func import functional_call, grad_and_value

from ._checks import check_choice, check_mask, expand_in_dims
from ._chunks import chunk_bounds, chunked_losses_and_grads
from ._precision import LossScale
from .ensemble import Ensemble
from .optim import StackedOptimizer
from .optim._keep import keep_masked_
from .optim.clip import clip_norms_, clip_values_
from .selfcheck import Probe

__all__ = ["PRECISIONS", "LossScale", "Step", "check_optimizer", "make_step"]

Step = Callable[..., torch.Tensor]
#: Distinct input shapes one compiled step accepts before refusing (dynamo's default limit).
MAX_SHAPES = 8
#: ``precision=`` names and the autocast dtype each member's forward and loss run in.
PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}


def make_step(
    ens: Ensemble,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    *,
    in_dims: int | None = None,
    compile: bool = False,
    clip_grad_norm: float | None = None,
    clip_grad_value: float | None = None,
    precision: str | None = None,
    loss_scale: LossScale | None = None,
    check: bool = True,
) -> Step:
    """Build ``step(inputs, targets, mask=None) -> losses[n]`` for an ensemble.

    ``step`` runs every member's forward on ``inputs``, applies ``loss_fn`` per member,
    back-propagates the *sum* of the member losses (so each member gets exactly its own
    gradient) and steps ``optimizer``. ``inputs`` is the member's single positional input,
    or a tuple of them. Both variants run the members through ``ens.member_map``, so
    ``backend``, ``chunk_size`` and ``randomness`` mean the same in both. With ``chunk_size``
    the eager step runs the forward and the backward of one chunk of members before the next
    (members are independent, so the result is the same), which bounds its activation memory
    to one chunk's; the compiled step passes ``chunk_size`` to ``vmap`` inside its graph.

    Eager (``compile=False``), this is the naive loop's code run once for all members. With
    ``compile=True`` the whole step goes through ``torch.compile(fullgraph=True)`` as one
    graph: per-member gradients come from ``torch.func.grad_and_value`` and the stacked
    optimizer's update runs inside the same graph. On CUDA it uses
    ``mode="reduce-overhead"``.

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
            clip that member alone (see ``vmapens.optim.clip_grad_norm_``).
        clip_grad_value: clamp every gradient element to ``[-v, v]``, as
            ``torch.nn.utils.clip_grad_value_`` would.
        precision: ``"bf16"`` or ``"fp16"``: each member's forward and loss run as under
            ``torch.autocast(device_type, dtype)`` for that member alone (docs/semantics.md,
            "Mixed precision"). ``"fp16"`` adds a per-member dynamic loss scale, as one
            ``torch.amp.GradScaler`` per member: gradients are unscaled (then clipped), a
            member with non-finite gradients skips its update. Needs a StackedOptimizer.
        loss_scale: the ``LossScale`` that ``"fp16"`` uses (default: ``LossScale(n)`` with
            GradScaler's defaults); keep a handle on it to checkpoint or configure it.
        check: ``False`` skips the first call's self-check (``vmapens.check``, semantics.md).

    Returns:
        ``step(inputs, targets, mask=None)`` returning the detached per-member losses
        ``[n]`` computed before the update. ``mask`` (bool ``[n]``) freezes the members where
        it is False: their parameters, optimizer state and buffers stay exactly as they were.

    Raises:
        TypeError: ``loss_fn`` not callable; ``optimizer`` not an optimizer; ``compile=True``
            with an optimizer that is not a StackedOptimizer.
        ValueError: ``in_dims`` is not ``None`` or ``0``; ``optimizer`` holds tensors that
            are not this ensemble's parameters; ``compile=True`` with ``backend="loop"``;
            both clip options, a clip bound <= 0, an unknown ``precision``, ``loss_scale``
            without ``"fp16"`` or for another number of members.

    Example:
        >>> from vmapens import Ensemble, StackedAdam
        >>> ens = Ensemble(lambda: torch.nn.Linear(2, 1), n=3, seed=0)
        >>> step = make_step(ens, torch.nn.MSELoss(), StackedAdam(ens, lr=0.1))
        >>> step(torch.randn(5, 2), torch.zeros(5, 1)).shape
        torch.Size([3])
    """
    api = "make_step"
    if not isinstance(ens, Ensemble):
        raise TypeError(f"{api}: `ens` must be a vmapens.Ensemble, got {type(ens).__name__}")
    if in_dims not in (None, 0):
        raise ValueError(f"{api}: `in_dims` must be None or 0, got {in_dims!r}")
    if not callable(loss_fn):
        raise TypeError(f"{api}: `loss_fn` must be callable, got {type(loss_fn).__name__}")
    check_optimizer(api, ens, optimizer)
    update = _update(api, ens, optimizer, clip_grad_norm, clip_grad_value, precision, loss_scale)
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
        return probe.wrap(_compiled_step(ens, member_loss, optimizer, in_dims, update))
    batched = ens.member_map(member_loss, (in_dims, in_dims))

    # The stacked parameters keep their identity through .to() / .double(): list them once.
    params = [p for p in ens.parameters() if p.requires_grad]

    def step(inputs: Any, targets: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        args = _check_call(ens, optimizer, inputs, targets, mask, in_dims)
        old_grads = [p.grad for p in params]
        undo = _undo_point(ens, optimizer)
        try:
            with ens.guard("step"), _frozen_buffers(ens, mask):
                scale = None if update.scale is None else update.scale.scale
                # chunk_size: forward and backward one chunk of members at a time (one chunk's
                # activations alive), where vmap's chunking keeps all until the backward.
                chunks = chunk_bounds(len(ens), ens.chunk_size) if ens.backend == "vmap" else None
                if chunks is None or not params:
                    # Forward and loss in one vmap: half the batching overhead of ens(...) + loss.
                    with update.autocast():
                        losses = batched(ens.stacked_state(), args, targets)
                    scaled = losses if scale is None else losses * scale
                    grads: Sequence[torch.Tensor | None] = torch.autograd.grad(
                        scaled.sum(), params, allow_unused=True
                    )
                else:
                    losses, grads = chunked_losses_and_grads(batched, ens.stacked_state(),
                        params, args, targets, in_dims, scale, chunks,
                        ens.randomness == "same", update.autocast)  # fmt: skip
                for p, new in zip(params, grads, strict=True):
                    p.grad = new
                live = [p.grad for p in params if p.grad is not None]
                stepping, found_inf = update.gradients_(live, mask)
                if stepping is None:
                    optimizer.step()
                else:
                    masked: Callable[..., Any] = optimizer.step  # a StackedOptimizer's
                    masked(mask=stepping)
                if update.scale is not None:
                    update.scale.update_(found_inf, mask)
        except BaseException:
            for p, g in zip(params, old_grads, strict=True):
                p.grad = g
            undo()
            raise
        return losses.detach()

    return probe.wrap(step)


@dataclasses.dataclass(frozen=True)
class _Update:
    """What a step does around the optimizer: autocast, loss scale, clipping."""

    device_type: str
    dtype: torch.dtype | None
    clip_norm: float | None
    clip_value: float | None
    scale: LossScale | None

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward's autocast (member-exact: see ``Ensemble.member_map``)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, self.dtype)

    def gradients_(
        self, grads: list[torch.Tensor], mask: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Unscale, then clip ``grads`` in place; returns (who steps, who overflowed).

        GradScaler's order: a member's gradients are unscaled before they are clipped.
        """
        found_inf = torch.zeros(0, dtype=torch.bool)
        if self.scale is not None:
            found_inf = self.scale.unscale_(grads)
            mask = ~found_inf if mask is None else mask & ~found_inf
        if grads and self.clip_norm is not None:
            clip_norms_(grads, self.clip_norm)
        if grads and self.clip_value is not None:
            clip_values_(grads, self.clip_value)
        return mask, found_inf


def _update(
    api: str,
    ens: Ensemble,
    optimizer: Any,
    clip_norm: float | None,
    clip_value: float | None,
    precision: str | None,
    loss_scale: LossScale | None,
) -> _Update:
    """make_step's options checked, as the step uses them."""
    if clip_norm is not None and clip_value is not None:
        raise ValueError(f"{api}: give one of `clip_grad_norm` and `clip_grad_value`, not both")
    for name, bound in (("clip_grad_norm", clip_norm), ("clip_grad_value", clip_value)):
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, (int, float))):
            raise TypeError(f"{api}: `{name}` must be a float, got {type(bound).__name__}")
        if bound is not None and not bound > 0:
            raise ValueError(f"{api}: `{name}` must be > 0, got {bound}")
    if precision is not None:
        check_choice(api, "precision", precision, tuple(PRECISIONS))
    device = next(iter(ens.parameters())).device
    if precision == "fp16":
        if not isinstance(optimizer, StackedOptimizer):
            raise TypeError(
                f"{api}: `precision='fp16'` skips overflowing members through a "
                f"vmapens.StackedOptimizer's mask, got {type(optimizer).__name__}"
            )
        loss_scale = LossScale(len(ens), device=device) if loss_scale is None else loss_scale
    if loss_scale is not None:
        if not isinstance(loss_scale, LossScale):
            raise TypeError(
                f"{api}: `loss_scale` must be a LossScale, got {type(loss_scale).__name__}"
            )
        if precision != "fp16":
            raise ValueError(f"{api}: `loss_scale` needs `precision='fp16'`, got {precision!r}")
        if loss_scale.scale.shape != (len(ens),):
            raise ValueError(
                f"{api}: `loss_scale` is for {loss_scale.scale.shape[0]} members, the ensemble "
                f"has {len(ens)}"
            )
        loss_scale.scale = loss_scale.scale.to(device)
        loss_scale.growth_tracker = loss_scale.growth_tracker.to(device)
    dtype = None if precision is None else PRECISIONS[precision]
    return _Update(device.type, dtype, clip_norm, clip_value, loss_scale)


def check_optimizer(api: str, ens: Ensemble, optimizer: Any) -> None:
    """``optimizer`` must be a torch optimizer over (some of) this ensemble's parameters."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"{api}: `optimizer` must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    ours = {id(p) for p in ens.parameters()}
    for k, p in enumerate(q for g in optimizer.param_groups for q in g["params"]):
        if id(p) not in ours:
            raise ValueError(
                f"{api}: `optimizer` parameter {k} (shape {list(p.shape)}) is not a parameter of "
                "this ensemble; build the optimizer from this ensemble, e.g. StackedAdam(ens)"
            )


def _check_call(
    ens: Ensemble, optimizer: Any, inputs: Any, targets: Any, mask: Any, in_dims: int | None
) -> tuple:
    """Everything a step checks before it changes anything; returns the positional inputs."""
    if mask is not None and not isinstance(optimizer, StackedOptimizer):
        raise TypeError(
            f"step: `mask` needs a vmapens.StackedOptimizer, got {type(optimizer).__name__}"
        )
    check_mask("step", mask, len(ens))
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"step: `targets` must be a tensor, got {type(targets).__name__}")
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    expand_in_dims("step", (in_dims, in_dims), (args, targets), len(ens))
    return args


def _undo_point(ens: Ensemble, optimizer: Any) -> Callable[[], None]:
    """A function that puts parameters and optimizer state back as they are now.

    A StackedOptimizer rolls itself back (it checks everything first and undoes a failed
    update); any other optimizer gets a copy of its state and of the parameters it updates.
    """
    if isinstance(optimizer, StackedOptimizer):
        return lambda: None
    params = list(ens.parameters())
    saved = [p.detach().clone() for p in params]
    state = copy.deepcopy(optimizer.state_dict())

    def undo() -> None:
        with torch.no_grad():
            for p, s in zip(params, saved, strict=True):
                p.copy_(s)
        optimizer.load_state_dict(state)

    return undo


@contextlib.contextmanager
def _frozen_buffers(ens: Ensemble, mask: torch.Tensor | None) -> Iterator[None]:
    """Give the members where ``mask`` is False their buffers back after the step.

    The forward updates every member's buffers (BatchNorm statistics); the optimizer's mask
    only covers parameters and optimizer state.
    """
    buffers = [] if mask is None else list(ens.stacked_buffers().values())
    saved = [b.clone() for b in buffers]
    yield
    if mask is not None:
        with torch.no_grad():
            keep_masked_(buffers, saved, mask)


def _member_loss(ens: Ensemble, loss_fn: Callable) -> Callable[..., torch.Tensor]:
    """``(member_state, inputs, target) -> loss`` for one member, as it would run alone."""

    def member_loss(state: Any, inputs: tuple, target: torch.Tensor) -> torch.Tensor:
        return loss_fn(functional_call(ens.runner, state, inputs), target)

    return member_loss


def _compiled_step(
    ens: Ensemble,
    member_loss: Callable,
    optimizer: StackedOptimizer,
    in_dims: int | None,
    update: _Update,
) -> Step:
    names = {id(p): name for name, p in ens.named_parameters()}
    order = [p for group in optimizer.param_groups for p in group["params"]]
    trained = [name for name, p in ens.stacked_params().items() if p.requires_grad]

    def loss_of(params: dict, fixed: dict, inputs: tuple, target: torch.Tensor, scale: Any) -> Any:
        loss = member_loss({**params, **fixed}, inputs, target)
        return (loss if scale is None else loss * scale), loss

    def member_grads(state: dict, inputs: tuple, target: torch.Tensor, scale: Any) -> Any:
        # Buffers go in as an argument, not a closure: grad must not see them as captured
        # tensors, which BatchNorm updates in place.
        fixed = {k: v for k, v in state.items() if k not in trained}
        params = {k: state[k] for k in trained}
        grads, (_, loss) = grad_and_value(loss_of, has_aux=True)(
            params, fixed, inputs, target, scale
        )
        return grads, loss

    scaled = update.scale is not None
    batched = ens.member_map(member_grads, (in_dims, in_dims, 0 if scaled else None))

    def body(state: dict, inputs: tuple, targets: torch.Tensor, mask: Any, scale: Any) -> Any:
        with update.autocast():
            grads, losses = batched(state, inputs, targets, scale)
        # Frozen parameters get no gradient (None), as with loss.backward().
        ordered = [grads.get(names[id(p)]) for p in order]
        stepping, found_inf = update.gradients_([g for g in ordered if g is not None], mask)
        optimizer.apply_gradients(ordered, mask=stepping)
        if update.scale is not None:
            update.scale.update_(found_inf, mask)
        return losses

    device = next(iter(ens.parameters())).device
    mode = "reduce-overhead" if device.type == "cuda" else None
    # Inductor otherwise keeps fused intermediates in float32 where eager rounds to bf16/fp16.
    options: dict[str, Any] | None = (
        None if update.dtype is None else {"emulate_precision_casts": True}
    )
    # dynamic=False: shapes are fixed per ensemble, and functorch's grad cannot trace symbolic
    # sizes. _own_code: dynamo caches compiled graphs on the code object, so every make_step
    # would otherwise share one cache (and its recompile limit) with every other ensemble.
    compiled = torch.compile(
        _own_code(body), fullgraph=True, mode=mode, dynamic=False, options=options
    )
    shapes: set[tuple] = set()

    def step(inputs: Any, targets: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        args = _check_call(ens, optimizer, inputs, targets, mask, in_dims)
        key = _shapes((args, targets, mask))
        if key not in shapes and len(shapes) >= MAX_SHAPES:
            raise ValueError(
                f"step: the compiled step has already compiled for {len(shapes)} input shapes "
                f"({sorted(shapes)[:3]}...) and would compile again for {key}; feed batches of a "
                "fixed size (e.g. DataLoader(drop_last=True), fit(batch_size=...) with a size "
                "that divides the data) or use compile=False"
            )
        optimizer.prepare()  # state is created outside the graph
        # Gradients come from torch.func inside the graph: no autograd graph around it.
        with torch.no_grad(), ens.guard("step"), _frozen_buffers(ens, mask):
            scale = None if update.scale is None else update.scale.scale
            losses = compiled(ens.stacked_state(), args, targets, mask, scale)
        shapes.add(key)
        return losses

    return step


def _shapes(tree: Any) -> tuple:
    leaves = [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]
    return tuple((tuple(t.shape), str(t.dtype)) for t in leaves)


_steps_made = itertools.count()


def _own_code(fn: Callable) -> Callable:
    """``fn`` with a code object of its own (same bytecode, a unique name)."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_steps_made)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
