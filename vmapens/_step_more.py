"""make_step's readings of its arguments as torch users pass them: clip bounds and targets;
the hooks on the stacked parameters, run where ``loss.backward()`` would run them."""

from __future__ import annotations

import functools
from collections.abc import Callable, Container, Iterator, Sequence
from typing import Any

import optree
import torch

__all__ = [
    "check_targets",
    "clip_bound",
    "grad_on",
    "graph_into",
    "reached_leaves",
    "refuse_graph_into",
    "run_grad_hooks",
    "run_post_accumulate_hooks",
]


def run_grad_hooks(params: Sequence[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
    """Each ``Tensor.register_hook`` hook of ``params`` on its gradient in ``grads``, in order,
    as autograd runs a leaf's hooks (a hook's non-None return replaces the gradient): the
    chunked step differentiates fresh leaves cut from the stacked parameters, which autograd
    runs no hook of (a clamp on a stacked parameter was lost, silently)."""
    for j, p in enumerate(params):
        hooks, g = p._backward_hooks, grads[j]
        if hooks and g is not None:
            for hook in list(hooks.values()):
                new = hook(g)
                g = g if new is None else new
            grads[j] = g


def run_post_accumulate_hooks(params: Sequence[torch.Tensor]) -> None:
    """Each ``register_post_accumulate_grad_hook`` hook of ``params`` that has a ``.grad``, in
    order, as ``loss.backward()`` runs them once the gradient is in ``.grad``: the step sets
    ``.grad`` itself and no backward accumulates it (the hooks never ran, silently)."""
    for p in params:
        hooks = getattr(p, "_post_accumulate_grad_hooks", None)
        if hooks and p.grad is not None:
            for hook in list(hooks.values()):
                hook(p)


def clip_bound(api: str, name: str, bound: Any, params: Any = ()) -> float | None:
    """A ``clip_grad_norm`` / ``clip_grad_value`` bound as a float (None: no clipping).

    ``torch.nn.utils.clip_grad_norm_`` and ``clip_grad_value_`` take a 0-d tensor as well as a
    number (``max_norm=torch.tensor(1.0)``); it is read once, when the step is built.
    ``params``: the ``(name, parameter)`` pairs whose gradients a ``clip_grad_value`` clamps.

    Raises:
        TypeError: not a number or a 0-d real tensor.
        ValueError: not > 0; a complex parameter in ``params`` that trains.
    """
    if bound is None:
        return None
    for key, p in params:  # clip_grad_value_ alone refuses them; in the step, as a failed forward
        if p.is_complex() and p.requires_grad:
            raise ValueError(
                f"{api}: `{name}` cannot clip complex gradients (`{key}` is {p.dtype}), as "
                "torch.nn.utils.clip_grad_value_ cannot (clamp is not supported for complex "
                "types); clip by norm with `clip_grad_norm`, which takes them"
            )
    if isinstance(bound, torch.Tensor) and bound.dim() == 0:
        if bound.is_complex() or bound.dtype == torch.bool:
            raise TypeError(f"{api}: `{name}` must be a real number, got a {bound.dtype} tensor")
        bound = bound.item()
    if isinstance(bound, bool) or not isinstance(bound, (int, float)):
        got = (
            f"a tensor of shape {list(bound.shape)}"
            if isinstance(bound, torch.Tensor)
            else (type(bound).__name__)
        )
        raise TypeError(f"{api}: `{name}` must be a float (or a 0-d tensor), got {got}")
    if not bound > 0:
        raise ValueError(f"{api}: `{name}` must be > 0, got {bound}")
    return float(bound)


def check_targets(targets: Any) -> None:
    """``targets``: one tensor, or a tuple, list or dict of them (nested), as a ``loss_fn``
    that takes several targets is called in plain torch (``loss_fn(out, (y, w))``); each
    member's ``loss_fn`` gets the same structure (its rows of each, with ``in_dims=0``).

    Raises:
        TypeError: anything else, or a structure with no tensor in it.
    """
    if isinstance(targets, torch.Tensor):
        return
    structured = isinstance(targets, (tuple, list, dict))
    leaves = optree.tree_leaves(targets, none_is_leaf=True) if structured else [targets]
    bad = [leaf for leaf in leaves if not isinstance(leaf, torch.Tensor)]
    if bad or not leaves:
        got = type(targets).__name__
        if structured:
            got = f"a {got} holding {type(bad[0]).__name__}" if bad else f"an empty {got}"
        hint = ""
        if targets is None or not leaves:  # a loss without targets: density, autoencoders
            hint = (
                "; a loss that takes no targets (a flow's likelihood, an autoencoder) gets "
                "the inputs as targets and ignores them: `step(x, x)`"
            )
        elif any(leaf is None for leaf in bad):  # a task without labels in this batch
            hint = (
                "; for a target missing from this batch (a task without labels), pass an "
                "empty tensor (torch.empty(0), or one row per member: torch.empty(n, 0) with "
                "in_dims=0) and let the loss skip it (`if t.numel():`), or a mask of the rows "
                "that have labels"
            )
        elif any(isinstance(leaf, (int, float)) for leaf in bad):  # CTC's lengths as lists
            hint = (
                "; pass numbers as tensors, one per member with in_dims=0 or shared "
                "(torch.tensor(input_lengths) for nn.CTCLoss), or let loss_fn close over them"
            )
        raise TypeError(
            f"step: `targets` must be a tensor or a tuple, list or dict of tensors, got {got}{hint}"
        )


def grad_on(step: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``step`` run with autograd on, as ``torch.func.grad`` (the compiled step's gradients)
    runs whatever the caller's ``torch.no_grad()``: a step computes its own gradients.

    Without it the eager step under ``no_grad`` recorded no graph and failed with a hint about
    in-place ops, and the compiled one failed in its eager probe: neither said why.

    Raises:
        RuntimeError: (from the step) called under ``torch.inference_mode()``, where autograd
            records nothing even with grad enabled; nothing was changed.
    """

    @functools.wraps(step)
    def run(*args: Any, **kwargs: Any) -> torch.Tensor:
        if torch.is_inference_mode_enabled():
            raise RuntimeError(
                "step: called under torch.inference_mode(), where autograd records nothing and "
                "no gradient can be computed; call the training step outside it (nothing was "
                "changed)"
            )
        with torch.enable_grad():
            return step(*args, **kwargs)

    return run


def graph_into(batch: tuple[tuple, Any], params: Sequence[torch.Tensor]) -> bool:
    """Whether a tensor of ``batch`` (the positional inputs, the targets) is one of ``params``
    or carries an autograd graph that reaches one: a target computed from the ensemble itself
    and not detached (``step(x, 0.9 * ens(x2))``), through which ``loss.backward()`` alone
    back-propagates into each member too.

    Only tensors with a graph are walked: a batch of data costs one look at each tensor.
    """
    flat = [*batch[0], batch[1]]  # (positional inputs, targets): most often all tensors
    if not all(isinstance(t, torch.Tensor) for t in flat):
        flat = optree.tree_leaves(batch)  # type: ignore[arg-type]
    leaves = [t for t in flat if getattr(t, "requires_grad", False)]
    if not leaves:  # data: no graph
        return False
    wanted = {id(p) for p in params}
    if any(id(t) in wanted for t in leaves):
        return True
    return any(True for _ in reached_leaves([t.grad_fn for t in leaves], wanted))


def reached_leaves(roots: Sequence[Any], wanted: Container[int]) -> Iterator[int]:
    """The ids in ``wanted`` of the leaf tensors that the autograd graphs from ``roots``
    (``grad_fn`` nodes, None skipped) accumulate into, each once, as the walk finds them."""
    todo, seen = list(roots), set()  # a node's Python object is cached on it: a stable identity
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = id(getattr(node, "variable", None))  # AccumulateGrad of a leaf
        if leaf in wanted:
            yield leaf
        todo.extend(nxt for nxt, _ in node.next_functions)


def refuse_graph_into(batch: tuple[tuple, Any], params: Sequence[torch.Tensor]) -> None:
    """The compiled step's gradients come from ``torch.func`` inside its graph, which cannot
    follow a graph that ``batch`` brings in from outside into the parameters: those terms
    would be dropped silently. Refused, before anything changes.

    Raises:
        ValueError: a tensor of ``batch`` carries an autograd graph into ``params``.
    """
    if graph_into(batch, params):
        raise ValueError(
            "step: `inputs` or `targets` carry an autograd graph into the ensemble's parameters "
            "(computed from the ensemble and not detached, e.g. 0.9 * ens(x2)); the compiled "
            "step cannot back-propagate through it, as loss.backward() alone would. Detach it "
            "(.detach(), or compute it under torch.no_grad(), as a TD target usually is), or "
            "use compile=False, which back-propagates through it (nothing was changed)"
        )
