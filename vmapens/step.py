"""One training step for every member: forward, per-member loss, backward, optimizer step."""

from __future__ import annotations

import contextlib
import copy
import itertools
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.func import functional_call, grad_and_value

from ._checks import check_mask, column, expand_in_dims
from .ensemble import Ensemble
from .optim import StackedOptimizer

__all__ = ["Step", "check_optimizer", "make_step"]

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
) -> Step:
    """Build ``step(inputs, targets, mask=None) -> losses[n]`` for an ensemble.

    ``step`` runs every member's forward on ``inputs``, applies ``loss_fn`` per member,
    back-propagates the *sum* of the member losses (so each member gets exactly its own
    gradient) and steps ``optimizer``. ``inputs`` is the member's single positional input,
    or a tuple of them. Both variants run the members through ``ens.member_map``, so
    ``backend``, ``chunk_size`` and ``randomness`` mean the same in both.

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

    Returns:
        ``step(inputs, targets, mask=None)`` returning the detached per-member losses
        ``[n]`` computed before the update. ``mask`` (bool ``[n]``) freezes the members where
        it is False: their parameters, optimizer state and buffers stay exactly as they were.

    Raises:
        TypeError: ``loss_fn`` not callable; ``optimizer`` not an optimizer; ``compile=True``
            with an optimizer that is not a StackedOptimizer.
        ValueError: ``in_dims`` is not ``None`` or ``0``; ``optimizer`` holds tensors that
            are not this ensemble's parameters; ``compile=True`` with ``backend="loop"``.

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
    member_loss = _member_loss(ens, loss_fn)
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
        return _compiled_step(ens, member_loss, optimizer, in_dims)
    batched = ens.member_map(member_loss, (in_dims, in_dims))

    def step(inputs: Any, targets: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        args = _check_call(ens, optimizer, inputs, targets, mask, in_dims)
        params = [p for p in ens.parameters() if p.requires_grad]
        old_grads = [p.grad for p in params]
        undo = _undo_point(ens, optimizer)
        try:
            with ens.guard("step"), _frozen_buffers(ens, mask):
                # Forward and loss in one vmap: half the batching overhead of ens(...) + loss.
                losses = batched(ens.stacked_state(), args, targets)
                grads = torch.autograd.grad(losses.sum(), params, allow_unused=True)
                for p, new in zip(params, grads, strict=True):
                    p.grad = new
                if mask is None:
                    optimizer.step()
                else:
                    masked: Callable[..., Any] = optimizer.step  # a StackedOptimizer's
                    masked(mask=mask)
        except BaseException:
            for p, g in zip(params, old_grads, strict=True):
                p.grad = g
            undo()
            raise
        return losses.detach()

    return step


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
            for b, old in zip(buffers, saved, strict=True):
                b.copy_(torch.where(column(mask, b), b, old))


def _member_loss(ens: Ensemble, loss_fn: Callable) -> Callable[..., torch.Tensor]:
    """``(member_state, inputs, target) -> loss`` for one member, as it would run alone."""

    def member_loss(state: Any, inputs: tuple, target: torch.Tensor) -> torch.Tensor:
        return loss_fn(functional_call(ens.template, state, inputs), target)

    return member_loss


def _compiled_step(
    ens: Ensemble, member_loss: Callable, optimizer: StackedOptimizer, in_dims: int | None
) -> Step:
    names = {id(p): name for name, p in ens.named_parameters()}
    order = [p for group in optimizer.param_groups for p in group["params"]]
    trained = [name for name, p in ens.stacked_params().items() if p.requires_grad]

    def loss_of(params: dict, fixed: dict, inputs: tuple, target: torch.Tensor) -> torch.Tensor:
        return member_loss({**params, **fixed}, inputs, target)

    def member_grads(state: dict, inputs: tuple, target: torch.Tensor) -> Any:
        # Buffers go in as an argument, not a closure: grad must not see them as captured
        # tensors, which BatchNorm updates in place.
        fixed = {k: v for k, v in state.items() if k not in trained}
        params = {k: state[k] for k in trained}
        return grad_and_value(loss_of)(params, fixed, inputs, target)

    batched = ens.member_map(member_grads, (in_dims, in_dims))

    def body(state: dict, inputs: tuple, targets: torch.Tensor, mask: Any) -> Any:
        grads, losses = batched(state, inputs, targets)
        # Frozen parameters get no gradient (None), as with loss.backward().
        optimizer.apply_gradients([grads.get(names[id(p)]) for p in order], mask=mask)
        return losses

    device = next(iter(ens.parameters())).device
    mode = "reduce-overhead" if device.type == "cuda" else None
    # dynamic=False: shapes are fixed per ensemble, and functorch's grad cannot trace symbolic
    # sizes. _own_code: dynamo caches compiled graphs on the code object, so every make_step
    # would otherwise share one cache (and its recompile limit) with every other ensemble.
    compiled = torch.compile(_own_code(body), fullgraph=True, mode=mode, dynamic=False)
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
            losses = compiled(ens.stacked_state(), args, targets, mask)
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
