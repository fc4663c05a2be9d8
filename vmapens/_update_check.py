"""The compiled step's check of its own update, at the first call of each graph it compiles.

The first-step probe (``selfcheck``) runs member 0 eagerly, alone and inside the ensemble; it
cannot see what inductor does to the update that follows. torch 2.13's inductor once inlined
a gradient that reads another parameter into the kernel that writes the parameters, and wrote
that parameter first: members stepped from wrong gradients, without an error
(docs/semantics.md). So the first call of each compiled graph is run twice from the same
state: the compiled step, then the optimizer's own eager update on the gradients the graph
returned. Parameters and optimizer state must agree to ``tolerance`` of each member's update;
if they do, the compiled results are kept, bit for bit; if not, everything is put back as it
was and ``CompiledStepMismatch`` is raised.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from ._checks import tolerance
from .ensemble import Ensemble
from .optim import StackedOptimizer

__all__ = ["CompiledStepMismatch", "checked_call"]


class CompiledStepMismatch(RuntimeError):
    """The compiled step's update differs from the same update run eagerly.

    Raised by the first call of a compiled graph (``make_step(compile=True)``), which then
    changed nothing. ``fit(compile="auto")`` catches it, warns, and goes on eagerly.
    """


def checked_call(
    call: Callable[[], tuple[Tensor, list[Tensor]]],
    ens: Ensemble,
    optimizer: StackedOptimizer,
    scale: Any,
    trained: Sequence[str],
    order: Sequence[str],
    mask: Tensor | None,
) -> Tensor:
    """``call()`` (the compiled step: losses and the gradients it stepped with), checked
    against ``optimizer.apply_gradients`` run eagerly on those gradients from the same state.

    Args:
        call: runs the compiled graph once.
        ens: the ensemble it trains.
        optimizer: the optimizer inside the graph.
        scale: the step's LossScale, or None.
        trained: the names of the parameters the graph differentiates.
        order: the names of the parameters the optimizer holds, in its order.
        mask: the step's ``mask``.

    Returns:
        The losses ``call`` returned; the state is what ``call`` left.

    Raises:
        CompiledStepMismatch: the two updates differ; the state is as before the call.
    """
    saved = _Saved(ens, optimizer, scale)
    device = next(iter(ens.parameters())).device
    rng = _rng_state(device)
    losses, grads = call()
    compiled = saved.current()
    saved.restore(saved.before)
    returned = iter(grads)
    names = set(trained)
    ordered = [next(returned) if name in names else None for name in order]
    stepping = mask
    if scale is not None:  # the graph skipped members whose gradients overflowed
        live = [g for g in ordered if g is not None]
        finite = torch.stack([g.reshape(len(ens), -1).isfinite().all(1) for g in live]).all(0)
        stepping = finite if mask is None else mask & finite
    try:
        optimizer.apply_gradients(ordered, mask=stepping)
        found = list(_differences(optimizer, order, saved.before, compiled, len(ens)))
    except BaseException:
        saved.restore(saved.before)
        raise
    if found:
        saved.restore(saved.before)
        _set_rng_state(device, rng)  # the compiled forward's dropout draws: not taken either
        raise CompiledStepMismatch(
            f"step: the compiled step updates {'; '.join(found[:3])} differently from the "
            "optimizer's eager update on the same gradients. That is torch.compile's code for "
            "this step, not your model; the step changed nothing. Train with compile=False "
            "(make_step or fit), which is exact, and please report it with your torch version"
        )
    saved.restore(compiled)
    return losses


def _rng_state(device: torch.device) -> tuple[Tensor, Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(device: torch.device, state: tuple[Tensor, Tensor | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


class _Saved:
    """Every tensor a step writes in place: parameters, buffers, optimizer state, loss scale."""

    def __init__(self, ens: Ensemble, optimizer: StackedOptimizer, scale: Any) -> None:
        self.ens, self.optimizer, self.scale = ens, optimizer, scale
        self.before = self.current()

    def _tensors(self) -> Iterator[tuple[Any, Tensor]]:
        for name, t in self.ens.stacked_state().items():
            yield ("ens", name), t
        for p, state in self.optimizer.state.items():
            for key, t in state.items():
                if isinstance(t, Tensor):
                    yield (id(p), key), t
        if self.scale is not None:
            yield ("scale", "scale"), self.scale.scale
            yield ("scale", "growth_tracker"), self.scale.growth_tracker

    def current(self) -> dict[Any, Tensor]:
        return {key: t.detach().clone() for key, t in self._tensors()}

    def restore(self, values: dict[Any, Tensor]) -> None:
        with torch.no_grad():
            for key, t in self._tensors():
                t.copy_(values[key])


def _differences(
    optimizer: StackedOptimizer,
    order: Sequence[str],
    before: dict[Any, Tensor],
    compiled: dict[Any, Tensor],
    n: int,
) -> Iterator[str]:
    """What the eager update (now in place) left that the compiled one did not."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for name, p in zip(order, params, strict=True):
        key = ("ens", name)
        yield from _close(f"`{name}`", before[key], compiled[key], p.detach(), n)
        for state_key, t in optimizer.state.get(p, {}).items():
            if isinstance(t, Tensor):
                k = (id(p), state_key)
                yield from _close(
                    f"the state `{state_key}` of `{name}`", before[k], compiled[k], t, n
                )


def _close(what: str, before: Tensor, compiled: Tensor, eager: Tensor, n: int) -> Iterator[str]:
    """Whether ``compiled`` is ``eager`` to ``tolerance`` of each member's change."""
    if not (eager.is_floating_point() or eager.is_complex()):
        if not torch.equal(compiled, eager):
            yield f"{what} (exact values expected for {eager.dtype})"
        return
    rows = n if eager.dim() and eager.shape[0] == n else 1
    real = eager.real.dtype if eager.is_complex() else eager.dtype
    # 16-bit values are compared in float32; float32 and float64 in their own dtype, whose
    # round-off is a few eps of the values, under the bound. Each member's largest magnitude
    # is one pass (aminmax), without an abs copy: this runs over all the state.
    low = real in (torch.float16, torch.bfloat16)

    def up(t: Tensor) -> Tensor:
        return t.float() if low else t

    def largest(t: Tensor) -> Tensor:
        t = torch.view_as_real(t) if t.is_complex() else t
        t = up(t).reshape(rows, -1)
        if not t.shape[1]:
            return torch.zeros(rows, dtype=t.dtype, device=t.device)
        smallest, biggest = torch.aminmax(t, dim=1)
        return torch.maximum(-smallest, biggest)  # NaN where the member holds a NaN

    # Each member's change sets the scale: a member with a small learning rate is compared
    # to its own update. Round-off of the values themselves (a few eps) is always allowed.
    change = largest(up(eager) - up(before))
    bound = tolerance(real) * change + 8 * torch.finfo(real).eps * (largest(before) + change)
    diff = largest(up(compiled) - up(eager))
    bad = (diff > bound).nonzero().flatten().tolist()
    for m in diff.isnan().nonzero().flatten().tolist():  # NaN in either: in the same places?
        rows_c, rows_e = (t.reshape(rows, -1)[m] for t in (compiled, eager))
        if not torch.equal(rows_c.isnan(), rows_e.isnan()):
            bad.append(m)
    if bad:
        m = min(bad)
        who = f"member {m}" if rows == n else "all members"
        yield f"{what} ({who}: differs by {float(diff[m]):.3g}, its update is {float(change[m]):.3g})"
