"""What a training step does around the optimizer, shared by the eager and compiled steps.

The argument checks before anything changes, the undo point, the masked members' buffers,
and ``Update``: autocast, the per-member loss scale and gradient clipping.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ._checks import check_choice, check_mask, expand_in_dims, positional
from ._precision import LossScale
from ._step_more import check_targets, clip_bound
from .ensemble import Ensemble
from .optim import StackedOptimizer
from .optim._hyper import group_args
from .optim._keep import keep_masked_
from .optim._values import MemberValues
from .optim.clip import clip_norms_, clip_values_

__all__ = [
    "PRECISIONS",
    "Update",
    "attached_scheduler",
    "build_update",
    "check_call",
    "check_groups",
    "check_optimizer",
    "distinct_grads",
    "frozen_members",
    "graph_hyperparameters",
    "optimizer_errors",
    "own_counters",
    "shared_floats",
    "trainable",
    "undo_point",
]

#: ``precision=`` names and the autocast dtype each member's forward and loss run in.
PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True)
class Update:
    """What a step does around the optimizer: autocast, loss scale, clipping."""

    device_type: str
    dtype: torch.dtype | None
    clip_norm: float | None
    clip_value: float | None
    scale: LossScale | None

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward's autocast (member-exact: see ``Ensemble._member_map``)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, self.dtype)

    def gradients_(
        self, grads: list[torch.Tensor], mask: torch.Tensor | None, held: list[bool]
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Unscale, then clip ``grads`` in place; returns (who steps, who overflowed).

        GradScaler's order: a member's gradients are unscaled before they are clipped. ``held``
        (one flag per gradient): whether the optimizer holds its parameter.
        """
        found_inf = torch.zeros(0, dtype=torch.bool)
        if self.scale is not None:
            # GradScaler.unscale_(optimizer) unscales and checks the optimizer's gradients only:
            # a trainable parameter it does not hold keeps a scaled gradient (clipped as such)
            # and its overflow does not skip the member's step.
            found_inf = self.scale.unscale_([g for g, h in zip(grads, held, strict=True) if h])
            mask = ~found_inf if mask is None else mask & ~found_inf
        if grads and self.clip_norm is not None:
            clip_norms_(grads, self.clip_norm)
        if grads and self.clip_value is not None:
            clip_values_(grads, self.clip_value)
        return mask, found_inf


def build_update(
    api: str,
    ens: Ensemble,
    optimizer: Any,
    clip_norm: float | torch.Tensor | None,
    clip_value: float | torch.Tensor | None,
    precision: str | None,
    loss_scale: LossScale | None,
) -> Update:
    """make_step's options checked, as the step uses them."""
    if clip_norm is not None and clip_value is not None:
        raise ValueError(f"{api}: give one of `clip_grad_norm` and `clip_grad_value`, not both")
    norm = clip_bound(api, "clip_grad_norm", clip_norm)
    value = clip_bound(api, "clip_grad_value", clip_value, ens.named_parameters())
    if precision is not None:
        check_choice(api, "precision", precision, tuple(PRECISIONS))
    device = next(iter(ens.parameters())).device
    if precision == "fp16":
        if not isinstance(optimizer, StackedOptimizer):
            raise TypeError(
                f"{api}: `precision='fp16'` skips overflowing members through a "
                f"vmapens.StackedOptimizer's mask, got {type(optimizer).__name__}"
            )
        half = [name for name, p in ens.named_parameters() if p.dtype == torch.float16]
        if half:
            # torch.amp.GradScaler refuses to unscale float16 gradients; so does LossScale.
            raise ValueError(
                f"{api}: `precision='fp16'` needs float32 (or float64) parameters to unscale "
                f"the gradients in, got float16 {half[0]!r}; autocast computes in float16 "
                "anyway: keep the parameters float32, or use precision=None"
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
    return Update(device.type, dtype, norm, value, loss_scale)


def check_optimizer(api: str, ens: Ensemble, optimizer: Any) -> None:
    """``optimizer`` must be a torch optimizer over (some of) this ensemble's parameters."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"{api}: `optimizer` must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    # Rules that are not elementwise read a whole stacked tensor as one: across its members.
    mixing = {"Adafactor": "vmapens.optim.StackedAdafactor", "Muon": "vmapens.optim.StackedMuon"}
    kinds = [c for c in type(optimizer).__mro__ if c.__module__.startswith("torch.optim")]
    name = next((c.__name__ for c in kinds if c.__name__ in (*mixing, "LBFGS")), "")
    if name:
        instead = f"use {mixing[name]}" if name in mixing else "no stacked twin exists"
        raise TypeError(
            f"{api}: `optimizer` torch.optim.{name} is not elementwise: over the stacked [n, ...] "
            f"parameters its update mixes the members (row/column statistics, whole-matrix or "
            f"line-search steps); {instead}"
        )
    ours = {id(p) for p in ens.parameters()}
    for k, p in enumerate(q for g in optimizer.param_groups for q in g["params"]):
        if id(p) not in ours:
            raise ValueError(
                f"{api}: `optimizer` parameter {k} (shape {list(p.shape)}) is not a parameter of "
                "this ensemble; build the optimizer from this ensemble, e.g. StackedAdam(ens)"
            )


def check_call(
    ens: Ensemble, optimizer: Any, inputs: Any, targets: Any, mask: Any, in_dims: int | None
) -> tuple:
    """Everything a step checks before it changes anything; returns the positional inputs."""
    if mask is not None and not isinstance(optimizer, StackedOptimizer):
        raise TypeError(
            f"step: `mask` needs a vmapens.StackedOptimizer, got {type(optimizer).__name__}"
        )
    check_mask("step", mask, len(ens))
    check_targets(targets)
    args = positional(inputs)
    expand_in_dims("step", (in_dims, in_dims), (args, targets), len(ens))
    return args


def undo_point(ens: Ensemble, optimizer: Any) -> Callable[[], None]:
    """A function that puts parameters and optimizer state back as they are now.

    A StackedOptimizer rolls itself back (it checks everything first and undoes a failed
    update); any other optimizer gets a copy of its state and of the parameters it updates.
    The optimizer's own objects are put back, not new ones: ``load_state_dict`` would make new
    ``param_groups`` dicts (a group the user holds, ``group["lr"] *= 0.5``, would stop reaching
    the optimizer) and cast the state to the parameters' dtype (after ``ens.double()``, a
    refused step would leave float64 moments that a retry trains with, where alone it raises).
    """
    if isinstance(optimizer, StackedOptimizer):
        return lambda: None
    params = list(ens.parameters())
    saved = [p.detach().clone() for p in params]
    groups = [_kept(group) for group in optimizer.param_groups]
    state = {p: _kept(s) for p, s in optimizer.state.items()}

    def undo() -> None:
        with torch.no_grad():
            for p, s in zip(params, saved, strict=True):
                p.copy_(s)
            for group, kept in zip(optimizer.param_groups, groups, strict=True):
                _put_back(group, kept)
            for p in [p for p in optimizer.state if p not in state]:
                del optimizer.state[p]  # state the refused step created
            for p, kept in state.items():
                _put_back(optimizer.state[p], kept)

    return undo


def _kept(values: dict) -> dict[Any, tuple[Any, Any]]:
    """Each entry of an optimizer's group or state (but ``params``) with a copy of its value."""
    return {
        k: (v, v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v))
        for k, v in values.items()
        if k != "params"
    }


def _put_back(values: dict, kept: dict[Any, tuple[Any, Any]]) -> None:
    """``values`` as :func:`_kept` found them: its tensors refilled in place, nothing added."""
    for k in [k for k in values if k != "params" and k not in kept]:
        del values[k]
    for k, (obj, copied) in kept.items():
        if isinstance(obj, torch.Tensor):
            if obj.shape == copied.shape and obj.dtype == copied.dtype:
                obj.copy_(copied)
            else:
                obj.set_(copied.clone())
            values[k] = obj
        else:
            values[k] = copy.deepcopy(copied)


def distinct_grads(
    grads: Sequence[torch.Tensor | None], params: Sequence[torch.Tensor]
) -> list[torch.Tensor | None]:
    """``grads`` of ``params`` as ``loss.backward()`` leaves them in ``.grad``: each a tensor
    of its own that can be written in place, laid out as its parameter.

    ``torch.autograd.grad`` may return one tensor for two inputs (``b1 + b2``; the fused
    LSTM's ``bias_ih`` and ``bias_hh``): as ``.grad`` of two parameters, an in-place clip,
    unscale or optimizer op would apply twice to both. It may return an expanded tensor (the
    gradient of ``w.sum()``), which in-place ops refuse, or a transposed one (a member
    Linear's weight, from a batched matmul): torch's ``.grad`` has its parameter's strides
    (``AccumulateGrad`` copies where they differ), which ``p.grad.view(-1)`` and a later
    ``loss.backward()`` into that ``.grad`` rely on.
    """
    seen: set[int] = set()
    out: list[torch.Tensor | None] = []
    for g, p in zip(grads, params, strict=True):
        if g is not None:
            if id(g) in seen or g.stride() != p.stride():
                g = torch.empty_like(p).copy_(g)
            seen.add(id(g))
        out.append(g)
    return out


def trainable(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters that require grad now (a layer may be frozen between steps).

    Raises:
        RuntimeError: none does (as ``loss.backward()`` raises when nothing requires grad).
    """
    live = [p for p in params if p.requires_grad]
    if not live:
        raise RuntimeError(
            "step: no parameter of the ensemble requires grad (every layer is frozen), so there "
            "is nothing to train; unfreeze one (ens.stacked_params()[name].requires_grad_(True)) "
            "or use vmapens.predict for forward passes"
        )
    return live


@contextlib.contextmanager
def optimizer_errors(optimizer: Any) -> Iterator[None]:
    """Name the optimizer in torch's own ``RuntimeError`` from its step.

    The ensemble's guard reports an unexplained torch error as a member's forward or loss
    failing; one raised by ``optimizer.step()`` comes from elsewhere and says so.
    """
    try:
        yield
    except RuntimeError as err:
        if type(err) is not RuntimeError or ":" in str(err).split(" ", 1)[0]:
            raise
        raise RuntimeError(f"step: {type(optimizer).__name__}.step() failed ({err})") from err


@contextlib.contextmanager
def frozen_members(ens: Ensemble, mask: torch.Tensor | None) -> Iterator[None]:
    """Give the members where ``mask`` is False their buffers and parameters back after the step.

    The forward updates every member's buffers (BatchNorm statistics) and may edit parameters
    in place (``nn.Embedding(max_norm=...)`` renormalises its weight); the optimizer's mask
    only covers its own update. A member that does not step does not run alone.
    """
    state = [] if mask is None else list(ens.stacked_state().values())
    saved = [t.clone() for t in state]
    yield
    if mask is not None:
        with torch.no_grad():
            keep_masked_(state, saved, mask)


def attached_scheduler(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a torch LR scheduler was built on ``optimizer``.

    ``torch.optim.lr_scheduler.LRScheduler.__init__`` wraps ``optimizer.step`` once, in a
    function it marks ``_wrapped_by_lr_sched`` (torch >= 2.0; also what it tests itself to warn
    about a wrong call order), so the mark stays however many schedulers share the optimizer.
    """
    return bool(getattr(optimizer.step, "_wrapped_by_lr_sched", False))


def shared_floats(optimizer: StackedOptimizer) -> tuple:
    """The shared float hyperparameters of every param group (None where a value is not a
    float: per-member values), in a fixed order: what a compiled step bakes into its graph."""
    return tuple(
        tuple(_float(v) for v in value) if hyper.pair else _float(value)
        for group in optimizer.param_groups
        for name, hyper in optimizer.hyperparameters.items()
        for value in [group[name]]
    )


def _float(v: Any) -> float | None:
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


@contextlib.contextmanager
def graph_hyperparameters(optimizer: StackedOptimizer, made: dict[tuple, Any]) -> Iterator[None]:
    """Shared float hyperparameters as :class:`MemberValues` while a compiled step runs.

    dynamo bakes a Python float into the graph and guards on its value, so a scheduler that
    changes ``lr`` every step would recompile every step (and ``fullgraph`` fails after 8).
    ``MemberValues`` (n equal floats) reaches the graph as a float64 ``[n]`` tensor input, as
    per-member values always have; the floats are back in ``param_groups`` afterwards.
    ``made`` keeps each slot's last ``MemberValues``, rebuilt only when its float changes.
    """
    n, swapped = optimizer.num_members, []

    def graph(v: Any, slot: tuple) -> Any:
        if _float(v) is None:
            return v
        if slot not in made or made[slot][0] != v:
            made[slot] = (v, MemberValues([v] * n))
        return made[slot][1]

    for k, group in enumerate(optimizer.param_groups):
        for name, hyper in optimizer.hyperparameters.items():
            value = group[name]
            if hyper.pair:
                new = tuple(graph(v, (k, name, j)) for j, v in enumerate(value))
                changed = any(a is not b for a, b in zip(new, value, strict=True))
            else:
                new = graph(value, (k, name))
                changed = new is not value
            if changed:
                swapped.append((group, name, value))
                group[name] = new
    try:
        yield
    finally:
        for group, name, value in reversed(swapped):
            group[name] = value


def check_groups(optimizer: StackedOptimizer) -> None:
    """Raise the eager step's error for a param group value it cannot take (a list ``lr``
    set after construction), which dynamo reports as "Observed exception" while tracing."""
    for group in optimizer.param_groups:
        group_args(group, optimizer.hyperparameters, torch.device("meta"), **optimizer._who)


def own_counters(optimizer: StackedOptimizer, stepped: set[int]) -> None:
    """Give each held parameter outside ``stepped`` (ids) step counts of its own, outside the
    compiled graph.

    A param group's parameters start with one shared count. A compiled graph that does not
    step one of them (frozen, or no gradient) clones the shared count for it while tracing,
    and dynamo guards only the first parameter's: later calls kept writing the stepping
    parameters' count into it, so an unfrozen head started Adam at step 4 where torch's
    starts at 1.
    """
    for group in optimizer.param_groups:
        counters = tuple(optimizer.scalar_state(group))
        states = [optimizer.state[p] for p in group["params"]]
        live = {
            id(s[k])
            for p, s in zip(group["params"], states, strict=True)
            if id(p) in stepped
            for k in counters
            if k in s
        }
        for p, s in zip(group["params"], states, strict=True):
            if id(p) not in stepped and any(id(s.get(k)) in live for k in counters):
                s.update({k: s[k].clone() for k in counters})


def counter_sharing(optimizer: StackedOptimizer) -> tuple:
    """Per group, for each parameter the first one whose step counts are the same tensors.
    dynamo does not guard this aliasing: a graph traced with one shared count kept stepping
    it alone after a frozen layer got counts of its own (unfrozen, it stayed at its step)."""
    shared, state = [], optimizer.state
    for group in optimizer.param_groups:
        keys, first = tuple(optimizer.scalar_state(group)), {}  # type: ignore[var-annotated]
        ids = [tuple([id(state[p].get(k)) for k in keys]) for p in group["params"]]
        shared.append(tuple(first.setdefault(i, k) for k, i in enumerate(ids)))
    return tuple(shared)
