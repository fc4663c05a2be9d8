"""One training step for every member: forward, per-member loss, backward, optimizer step."""

from __future__ import annotations

import contextlib
import inspect
import itertools
import types
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.func import functional_call, grad_and_value, vmap

from .ensemble import _expand_in_dims

if TYPE_CHECKING:
    from .ensemble import Ensemble

__all__ = ["make_step"]

Step = Callable[..., torch.Tensor]


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
    or a tuple of them.

    Eager (``compile=False``), this is the naive loop's code run once for all members. With
    ``compile=True`` the whole step goes through ``torch.compile(fullgraph=True)`` as one
    graph: per-member gradients come from ``torch.func.grad_and_value`` under ``vmap``
    (instead of ``loss.backward()``, which would break the graph) and the StackedAdam update
    is applied inside the same graph; buffers such as BatchNorm statistics are still updated.
    On CUDA it uses ``mode="reduce-overhead"`` so the step replays as a CUDA graph.

    Args:
        ens: the ensemble to train.
        loss_fn: ``(output, target) -> scalar`` for one member, e.g. ``nn.BCELoss()``.
        optimizer: a ``StackedAdam`` (required for ``compile=True`` and for ``mask``) or any
            optimizer over ``ens.parameters()``.
        in_dims: ``None`` when every member sees the same ``inputs`` and ``targets``; ``0``
            when both hold one slice per member along dim 0 (bagging, per-member data).
        compile: compile the whole step into one graph.

    Returns:
        ``step(inputs, targets, mask=None)`` returning the detached per-member losses
        ``[n]`` computed before the update. ``mask`` (bool ``[n]``) freezes the members where
        it is False for this step: their parameters, optimizer state and buffers (BatchNorm
        statistics) stay exactly as they were.

    Raises:
        TypeError: ``compile=True`` or a ``mask`` with an optimizer that is not a StackedAdam.
        ValueError: ``in_dims`` is not ``None`` or ``0``.

    Example:
        >>> from vmapens import Ensemble, StackedAdam
        >>> ens = Ensemble(lambda: torch.nn.Linear(2, 1), n=3, seed=0)
        >>> step = make_step(ens, torch.nn.MSELoss(), StackedAdam(ens, lr=0.1))
        >>> step(torch.randn(5, 2), torch.zeros(5, 1)).shape
        torch.Size([3])
    """
    if in_dims not in (None, 0):
        raise ValueError(f"make_step: `in_dims` must be None or 0, got {in_dims!r}")
    if not callable(loss_fn):
        raise TypeError(f"make_step: `loss_fn` must be callable, got {type(loss_fn).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"make_step: `optimizer` must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    masked_ok = "mask" in inspect.signature(optimizer.step).parameters
    member_loss = _member_loss(ens, loss_fn)
    if compile:
        if not hasattr(optimizer, "apply_gradients"):
            raise TypeError(
                "make_step: `compile=True` needs a vmapens.StackedAdam (its update runs inside the "
                f"compiled graph), got {type(optimizer).__name__}"
            )
        return _compiled_step(ens, member_loss, optimizer, in_dims)

    def step(inputs: Any, targets: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if mask is not None and not masked_ok:
            raise TypeError(
                f"step: `mask` needs a vmapens.StackedAdam, got {type(optimizer).__name__}"
            )
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        with _frozen_buffers(ens, mask):
            # Forward and loss in one vmap: half the batching overhead of ens(...) then the loss.
            losses = ens.map_members(member_loss, args, targets, in_dims=in_dims)
            optimizer.zero_grad()
            losses.sum().backward()
            if mask is None:
                optimizer.step()
            else:
                # Any optimizer whose step takes `mask` (masked_ok), not only StackedAdam.
                masked_step: Callable[..., Any] = optimizer.step
                masked_step(mask=mask)
        return losses.detach()

    return step


@contextlib.contextmanager
def _frozen_buffers(ens: Ensemble, mask: torch.Tensor | None) -> Iterator[None]:
    """Give the members where ``mask`` is False their buffers back after the step.

    The forward updates every member's buffers (BatchNorm statistics); the optimizer's mask
    only covers parameters and optimizer state.
    """
    buffers = [] if mask is None else list(ens._stacked_buffers().values())
    saved = [b.clone() for b in buffers]
    yield
    if mask is not None:
        with torch.no_grad():
            for b, old in zip(buffers, saved, strict=True):
                b.copy_(torch.where(mask.view(-1, *[1] * (b.dim() - 1)), b, old))


def _member_loss(ens: Ensemble, loss_fn: Callable) -> Callable[..., torch.Tensor]:
    """``(member_state, inputs, target) -> loss`` for one member, as it would run alone."""

    def member_loss(state: Any, inputs: tuple, target: torch.Tensor) -> torch.Tensor:
        return loss_fn(functional_call(ens.template, state, inputs), target)

    return member_loss


def _compiled_step(
    ens: Ensemble, member_loss: Callable, optimizer: Any, in_dims: int | None
) -> Step:
    names = {id(p): name for name, p in ens.named_parameters()}
    order = [p for group in optimizer.param_groups for p in group["params"]]
    foreign = [i for i, p in enumerate(order) if id(p) not in names]
    if foreign:
        raise ValueError(
            f"make_step: optimizer parameter {foreign[0]} is not a parameter of this ensemble; "
            "build the optimizer from ens.parameters()"
        )

    def split_loss(trained: dict, fixed: dict, inputs: tuple, target: torch.Tensor) -> Any:
        return member_loss((trained, fixed), inputs, target)  # gradients for `trained` only

    grads_and_losses = vmap(
        grad_and_value(split_loss),
        in_dims=(0, 0, in_dims, in_dims),
        randomness=ens.randomness,
        chunk_size=ens.chunk_size,
    )

    def body(trained: dict, fixed: dict, inputs: tuple, targets: torch.Tensor, mask: Any) -> Any:
        grads, losses = grads_and_losses(trained, fixed, inputs, targets)
        # Frozen parameters get no gradient (None), as with loss.backward().
        optimizer.apply_gradients([grads.get(names[id(p)]) for p in order], mask=mask)
        return losses

    device = next(iter(ens.parameters())).device
    mode = "reduce-overhead" if device.type == "cuda" else None
    # dynamic=False: shapes are fixed per ensemble, and functorch's grad cannot trace symbolic
    # sizes. _own_code: dynamo caches compiled graphs on the code object, so every make_step
    # would otherwise share one cache (and its recompile limit) with every other ensemble.
    compiled = torch.compile(_own_code(body), fullgraph=True, mode=mode, dynamic=False)

    def step(inputs: Any, targets: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        # The checks map_members makes on the eager path, before tracing could bury them.
        _expand_in_dims((in_dims, in_dims), (args, targets), len(ens))
        params = ens._stacked_params()
        trained = {k: p for k, p in params.items() if p.requires_grad}
        fixed: dict[str, torch.Tensor] = {k: p for k, p in params.items() if not p.requires_grad}
        fixed.update(ens._stacked_buffers())
        # Gradients come from torch.func inside the graph: no autograd graph around it.
        with torch.no_grad(), _frozen_buffers(ens, mask):
            return compiled(trained, fixed, args, targets, mask)

    return step


_steps_made = itertools.count()


def _own_code(fn: Callable) -> Callable:
    """``fn`` with a code object of its own (same bytecode, a unique name)."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_steps_made)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
