"""Flat optimizer state: one ``[n, total]`` buffer per state name and param group.

While every parameter of a group has a gradient and the group shares its step count, an
update runs once on the concatenated ``[n, total]`` tensor: a handful of kernels whatever the
depth of the model, instead of a handful per parameter.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .._checks import column

__all__ = ["FlatState", "fusable", "layout", "rows", "run_fused"]


def rows(t: Tensor) -> Tensor:
    """View a stacked tensor as [n, k] (k may be 0) so per-member scalars broadcast as [n, 1]."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:]))


def layout(params: list[Tensor]) -> tuple:
    return tuple((p.dtype, p.device, tuple(p.shape)) for p in params)


class FlatState:
    """The packing half of :class:`~vmapens.optim.StackedOptimizer`."""

    num_members: int
    param_groups: list[dict[str, Any]]
    state: Any
    _flat: list[dict[str, Any] | None]

    def state_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        raise NotImplementedError

    def scalar_state(self, group: dict[str, Any]) -> dict[str, float]:
        raise NotImplementedError

    def _pack(self, index: int) -> None:
        """Move the group's state into flat ``[n, total]`` buffers that the state keeps views of.

        While every parameter of the group has a gradient and one shared step count, a step
        is then one update on a single ``[n, total]`` tensor.
        """
        group = self.param_groups[index]
        params = group["params"]
        key = layout(params)
        if len({(p.dtype, p.device) for p in params}) != 1:
            self._flat[index] = {"key": key, "step": None}  # mixed: per-tensor updates only
            return
        states = [self.state[p] for p in params]
        scalars = {}
        for name in self.scalar_state(group):
            shared = states[0][name]
            if not torch.compiler.is_compiling() and all(
                torch.equal(s[name], shared) for s in states
            ):
                for s in states:  # equal counts (e.g. after load_state_dict): share them again
                    s[name] = shared
            scalars[name] = shared
        flat: dict[str, Any] = {"key": key, "step": scalars["step"], "scalars": scalars}
        flat["views"] = {}
        # Kept between steps for the concatenated parameters, gradients and a scratch tensor:
        # on CPU, fresh [n, total] temporaries every step make the system allocator hand pages
        # back and fault them in again (3x slower at n=4096). CUDA's allocator reuses blocks.
        total = sum(p[0].numel() for p in params)
        p0 = params[0]
        flat["workspace"] = (
            torch.empty(3, self.num_members, total, dtype=p0.dtype).unbind()
            if p0.device.type == "cpu"
            else (None, None, None)
        )
        for name in self.state_names(group):
            flat[name] = torch.cat([rows(s[name]) for s in states], dim=1)
            offset, views = 0, []
            for s, p in zip(states, params, strict=True):
                size = p[0].numel()
                s[name] = flat[name][:, offset : offset + size].view(p.shape)
                views.append(s[name])
                offset += size
            flat["views"][name] = views
        self._flat[index] = flat

    def _flat_state(self, index: int, grads: list[Tensor | None]) -> dict | None:
        """Group ``index``'s flat buffers when the single-tensor update applies, else None."""
        flat = self._flat[index]
        if flat is None or flat["step"] is None or any(g is None for g in grads):
            return None
        params = self.param_groups[index]["params"]
        for k, p in enumerate(params):
            s = self.state[p]
            if not p.is_contiguous() or any(s[c] is not v for c, v in flat["scalars"].items()):
                return None
            if any(s[key] is not views[k] for key, views in flat["views"].items()):
                return None
        return flat


def fusable(state: dict[str, Any], values: list[Any]) -> bool:
    """Whether a rule may run torch's fused CPU kernel (see :func:`fused_groups`).

    It may on the flat CPU path, whose gradient is a scratch copy (the kernels may write to
    their gradients), when every member shares the hyperparameters (floats, not per-member
    tensors), and not while tracing for ``torch.compile``. The choice depends on this
    configuration only, never on other members' step counts or masks, so a member's result
    does not depend on what happens to the others, bit for bit.
    """
    if "_workspace" not in state or torch.compiler.is_compiling():
        return False
    return not any(isinstance(v, Tensor) for v in values)


def run_fused(
    kernel: Callable[[list[Tensor], float], None],
    tensors: list[Tensor],
    step: Tensor,
    mask: Tensor | None,
) -> None:
    """Run a fused kernel ``kernel(tensors, step_count)`` over the whole ``[n, total]`` tensors,
    then count the step (``step += 1``; masked members get theirs back from the base).

    A fused kernel takes one step count. The stepping members usually share theirs: one call,
    in place (rows of masked members are computed too, and the base gives them their old
    values back). When counts differ (a member skipped a step), one call per count runs on
    copies of the whole tensors and each member takes the rows of its own count. Every member
    is thus always computed by a call over the whole tensor with its own count, as in a run
    where no other member skipped: its result does not depend on the others, bit for bit (a
    call on a subset of rows would move the kernel's vector/tail split).
    """
    _run_fused(kernel, tensors, step, mask)
    step.add_(1)


def _run_fused(
    kernel: Callable[[list[Tensor], float], None],
    tensors: list[Tensor],
    step: Tensor,
    mask: Tensor | None,
) -> None:
    if mask is None:  # the common case, checked cheaply: every member steps with one count
        first = float(step[0])
        if bool((step == first).all()):
            kernel(tensors, first)
            return
    stepping = torch.ones_like(step, dtype=torch.bool) if mask is None else mask.to(step.device)
    counts = step[stepping].unique().tolist()
    if len(counts) == 1:
        kernel(tensors, counts[0])
        return
    before = [t.clone() for t in tensors]
    for count in counts:
        work = [t.clone() for t in before]
        kernel(work, count)
        rows = stepping & (step == count)
        for t, new in zip(tensors, work, strict=True):
            t.copy_(torch.where(column(rows, t), new, t))
