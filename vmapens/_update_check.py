"""The compiled step's check of its own update, at the first call of each graph it compiles.

The first-step probe (``selfcheck``) runs member 0 eagerly, alone and inside the ensemble; it
cannot see what inductor does to the update that follows. torch 2.13's inductor once inlined
a gradient that reads another parameter into the kernel that writes the parameters, and wrote
that parameter first: members stepped from wrong gradients, without an error
(docs/semantics.md). So the first call of each compiled graph is run twice from the same
state: the compiled step, then the optimizer's own eager update on the gradients the graph
returned. A forward may edit parameters in place (``nn.Embedding(max_norm=...)`` renormalises
the rows it looks up) and the optimizer steps the edited values: the eager forward runs first
(the batch, the RNG and the rest of the state put back after it), and the eager update starts
from the parameters it left. Parameters, optimizer state and the loss scale must agree to ``tolerance``
of each member's update, plus a few eps of each value; if they do, the compiled results are
kept, bit for bit; if not, everything is put back as it was and ``CompiledStepMismatch`` is
raised.

The gradients the graph returned are compared too, with the same function run eagerly from the
same state (``reference``), unless its forward draws random numbers: a gradient torch.compile
computes differently (a custom ``autograd.Function``'s backward dropped, pytorch#193279) went
through the update check, which steps the compiled gradients both ways.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from ._checks import tolerance
from .ensemble import Ensemble
from .optim import StackedOptimizer

__all__ = ["CompiledStepMismatch", "checked_call", "static_addresses", "written"]


class CompiledStepMismatch(RuntimeError):
    """The compiled step's update differs from the same update run eagerly.

    Raised by the first call of a compiled graph (``make_step(compile=True)``), which then
    changed nothing. ``fit(compile="auto")`` catches it, warns, and goes on eagerly.
    """


def checked_call(
    call: Callable[[], tuple[Tensor, list[Tensor]]],
    forward: Callable[[], object],
    ens: Ensemble,
    optimizer: StackedOptimizer,
    scale: Any,
    trained: Sequence[str],
    order: Sequence[str],
    mask: Tensor | None,
    *,
    reference: Callable[[], Sequence[Tensor]] | None = None,
    within: torch.dtype | None = None,
) -> tuple[Tensor, list[Tensor]]:
    """``call()`` (the compiled step: losses and the gradients it stepped with), checked
    against ``forward()`` then ``optimizer.apply_gradients`` run eagerly on those gradients,
    from the same state; its gradients against ``reference()``'s where one is given.

    Args:
        call: runs the compiled graph once; its gradients are those of ``trained``, in order.
        forward: runs the step's forward eagerly on the ensemble's state, leaving the batch as
            it was; only what it does to the parameters is kept (the RNG and the rest of the
            state are put back here).
        ens: the ensemble it trains.
        optimizer: the optimizer inside the graph.
        scale: the step's LossScale, or None.
        trained: the names of the parameters the graph differentiates.
        order: the names of the parameters the optimizer holds, in its order.
        mask: the step's ``mask``.
        reference: the graph's gradients computed eagerly (the same function, not compiled),
            as ``call`` returns them; compared member by member to ``tolerance`` of the
            member's largest gradient, unless its forward draws random numbers (the compiled
            graph draws its own).
        within: the dtype whose ``tolerance`` the gradients are compared to (autocast's),
            else each gradient's own.

    Returns:
        The losses and gradients ``call`` returned; the state is what ``call`` left.

    Raises:
        CompiledStepMismatch: the two updates, or the gradients, differ; the state is as before
            the call.
    """
    saved = _Saved(ens, optimizer, scale)
    try:
        forward()  # the optimizer steps what the forward left (Embedding's max_norm)
        start, edited = _edited(ens, saved.before)
    finally:
        saved.undo()
    expected = None if reference is None else _eager_gradients(reference, saved)
    losses, grads = call()
    if expected is not None:
        wrong = _gradient_differences(trained, grads, expected, len(ens), within)
        if wrong:
            saved.undo()
            raise CompiledStepMismatch(
                f"step: the compiled step's gradients differ from the same step's run eagerly "
                f"(torch.func.grad without torch.compile): {'; '.join(wrong[:3])}; the step "
                "changed nothing. One of the two is wrong: most likely torch.compile's code for "
                "this step (or a forward that branches on torch.compiler.is_compiling()), not "
                "your model. Train with compile=False (make_step or fit), and please report it "
                "with your torch version"
            )
    compiled = saved.current()
    saved.restore(start)
    returned = dict(zip(trained, grads, strict=True))
    ordered = [returned.get(name) for name in order]
    stepping, overflowed = mask, None
    if scale is not None:  # fp16
        # The graph skipped the members whose scaled gradients overflowed and backed their
        # scale off (LossScale's backoff_factor < 1, its other updates keep or grow it). The
        # gradients it returns are unscaled and clipped, which cannot tell: clip_grad_value
        # turns an inf into a finite bound.
        key = ("scale", "scale")
        overflowed = compiled[key] < saved.before[key]
        stepping = ~overflowed if mask is None else mask & ~overflowed
    try:
        optimizer.apply_gradients(ordered, mask=stepping)
        n = len(ens)
        found = list(_differences(optimizer, order, start, compiled, n, stepping, edited))
        # The parameters the optimizer does not hold (a frozen layer): eager leaves them be,
        # but for the forward's edits.
        held = set(order)
        for name, _ in ens.named_parameters():
            key = ("ens", name)
            if name in held:
                continue
            if name in edited:
                found += _close(f"`{name}` (not in the optimizer)", start[key], compiled[key],
                                start[key], n)  # fmt: skip
            elif not bool(_same(compiled[key], start[key]).all()):
                found.append(f"`{name}` (not in the optimizer, changed)")
        if overflowed is not None:  # the scale's update too: ints and exact float products
            scale.update_(overflowed, mask)
            for name in ("scale", "growth_tracker"):
                eager = getattr(scale, name)
                found += _close(f"the loss scale's `{name}`", saved.before[("scale", name)],
                                compiled[("scale", name)], eager, n)  # fmt: skip
    except BaseException:
        saved.undo()
        raise
    if found:
        saved.undo()  # the compiled forward's dropout draws: not taken either
        raise CompiledStepMismatch(_message(found, edited))
    saved.restore(compiled)
    return losses, grads


def _eager_gradients(
    reference: Callable[[], Sequence[Tensor]], saved: _Saved
) -> list[Tensor] | None:
    """``reference()``'s gradients from the state before the step (put back after it), or
    None where its forward drew random numbers: the compiled graph may draw its own (dropout's
    masks: on the CPU one Dropout drew eager's, two and a ``randn_like`` did not;
    docs/semantics.md), so its gradients are not compared."""
    try:
        grads = [g.detach() for g in reference()]  # fresh tensors: restore() writes none of them
        now = _rng_state(saved.device)
        drew = any(
            a is not None and b is not None and not torch.equal(a, b)
            for a, b in zip(now, saved.rng, strict=True)
        )
    finally:
        saved.undo()
    return None if drew else grads


def _gradient_differences(
    names: Sequence[str],
    compiled: Sequence[Tensor],
    eager: Sequence[Tensor],
    n: int,
    within: torch.dtype | None,
) -> list[str]:
    """Where a compiled gradient is further from the eager one than ``tolerance`` of the
    member's largest eager gradient (over all its parameters: a gradient that is round-off, a
    bias before BatchNorm, is compared to that bound only). A member whose eager gradients are
    not all finite (an fp16 overflow: the step skips it) is not compared."""

    def rows(t: Tensor) -> Tensor:  # [n, -1], complex as pairs, 16-bit values in float32
        t = torch.view_as_real(t) if t.is_complex() else t
        return (t.float() if t.dtype in (torch.float16, torch.bfloat16) else t).reshape(n, -1)

    flat = [rows(t) for t in eager]
    finite = torch.ones(n, dtype=torch.bool, device=eager[0].device if eager else None)
    largest = torch.zeros(n, dtype=torch.float64, device=finite.device)
    for e in flat:
        if e.shape[1]:
            finite &= e.isfinite().all(dim=1)
            largest = torch.maximum(largest, e.abs().nan_to_num(0.0, 0.0, 0.0).amax(dim=1))
    found = []
    for name, c, t, e in zip(names, compiled, eager, flat, strict=True):
        if not e.shape[1]:
            continue
        real = t.real.dtype if t.is_complex() else t.dtype
        bound = tolerance(within or real) * largest
        gap = (rows(c) - e).abs().amax(dim=1).double().nan_to_num(float("inf"))
        bad = finite & (gap > bound)
        if bool(bad.any()):
            m = int(bad.nonzero()[0])
            found.append(
                f"`{name}` (member {m}: {float(gap[m]):.3g} from the eager gradient, whose "
                f"largest is {float(largest[m]):.3g})"
            )
    return found


def _edited(ens: Ensemble, before: dict[Any, Tensor]) -> tuple[dict[Any, Tensor], set[str]]:
    """``before`` with the parameters as the forward left them, and the names it edited."""
    start, edited = dict(before), set()
    for name, p in ens.named_parameters():
        key = ("ens", name)
        if not bool(_same(p.detach(), before[key]).all()):
            start[key] = p.detach().clone()
            edited.add(name)
    return start, edited


def _message(found: list[str], edited: set[str]) -> str:
    said = (
        f"step: the compiled step updates {'; '.join(found[:3])} differently from the same "
        "update run eagerly (the optimizer's apply_gradients) on the gradients the compiled "
        "step computed"
    )
    if not edited:
        return said + (
            "; the step changed nothing. One of the two is wrong: most likely torch.compile's "
            "code for this step, not your model. Train with compile=False (make_step or fit), "
            "and please report it with your torch version"
        )
    names = ", ".join(f"`{name}`" for name in sorted(edited)[:3])
    return said + (
        f", from the parameters as the eager forward left them (it edits {names} in place); "
        "the step changed nothing. One of the two is wrong: the compiled forward's in-place "
        "edit of the parameters may differ from the eager one (a forward that edits its "
        "parameters depending on the RNG, or on anything but its inputs and the parameters, "
        "does), or torch.compile's code for this step. Train with compile=False (make_step or "
        "fit), and please report it with your torch version"
    )


def _rng_state(device: torch.device) -> tuple[Tensor, Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(device: torch.device, state: tuple[Tensor, Tensor | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def written(
    ens: Ensemble, optimizer: StackedOptimizer, scale: Any = None
) -> Iterator[tuple[Any, Tensor]]:
    """Every tensor a training step writes in place, by a key: the parameters and buffers,
    the optimizer's state and the loss scale's (``scale``, a LossScale, or None)."""
    for name, t in ens.stacked_state().items():
        yield ("ens", name), t
    for p, state in optimizer.state.items():
        for key, t in state.items():
            if isinstance(t, Tensor):
                yield (id(p), key), t
    if scale is not None:
        yield ("scale", "scale"), scale.scale
        yield ("scale", "growth_tracker"), scale.growth_tracker


def static_addresses(ens: Ensemble, optimizer: StackedOptimizer) -> None:
    """Mark the tensors the step updates in place as static inputs of the compiled graph.

    CUDA-graph trees (``mode="reduce-overhead"``) skip any graph that mutates an input that is
    not static ("skipping cudagraphs due to mutated inputs"), which is every training step:
    it writes the parameters, buffers and optimizer state. Marked, they keep their addresses
    from step to step and the step replays as one CUDA graph (as ``torch.optim`` marks its own
    state when compiled).
    """
    from torch._dynamo import mark_static_address

    for _, t in written(ens, optimizer):
        if not hasattr(t, "_dynamo_static_input_type"):
            mark_static_address(t)


class _Saved:
    """Copies of what a step writes (``written``) and of the RNG, taken and put back."""

    def __init__(self, ens: Ensemble, optimizer: StackedOptimizer, scale: Any) -> None:
        self.ens, self.optimizer, self.scale = ens, optimizer, scale
        self.before = self.current()
        self.device = next(iter(ens.parameters())).device
        self.rng = _rng_state(self.device)

    def undo(self) -> None:
        """Everything as before the step: what it writes, and the RNG."""
        self.restore(self.before)
        _set_rng_state(self.device, self.rng)

    def current(self) -> dict[Any, Tensor]:
        return {key: t.detach().clone() for key, t in written(self.ens, self.optimizer, self.scale)}

    def restore(self, values: dict[Any, Tensor]) -> None:
        with torch.no_grad():
            for key, t in written(self.ens, self.optimizer, self.scale):
                t.copy_(values[key])


def _differences(
    optimizer: StackedOptimizer,
    order: Sequence[str],
    before: dict[Any, Tensor],
    compiled: dict[Any, Tensor],
    n: int,
    stepping: Tensor | None,
    edited: set[str],
) -> Iterator[str]:
    """What the eager update (now in place) left that the compiled one did not. ``edited``:
    the parameters the forward edits; a member that does not step keeps the compiled forward's
    edit (``frozen_members`` puts it back after the step), to round-off of the eager one's."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for name, p in zip(order, params, strict=True):
        key = ("ens", name)
        skip = None if name in edited else stepping
        yield from _close(f"`{name}`", before[key], compiled[key], p.detach(), n, skip)
        for state_key, t in optimizer.state.get(p, {}).items():
            if isinstance(t, Tensor):
                k = (id(p), state_key)
                what = f"the state `{state_key}` of `{name}`"
                yield from _close(what, before[k], compiled[k], t, n, stepping)


def _same(a: Tensor, b: Tensor) -> Tensor:
    """Elementwise: equal, or NaN in both."""
    return (a == b) | (a.isnan() & b.isnan())


def _close(
    what: str,
    before: Tensor,
    compiled: Tensor,
    eager: Tensor,
    n: int,
    stepping: Tensor | None = None,
) -> Iterator[str]:
    """Whether ``compiled`` is ``eager`` to ``tolerance`` of each member's change, and
    exactly ``before`` in the members that do not step (``stepping`` False, bool [n])."""
    rows = n if eager.dim() and eager.shape[0] == n else 1

    def who(m: int) -> str:
        return f"member {m}" if rows == n else "all members"

    if rows == n and stepping is not None:  # masked out, or overflowed: kept bit for bit
        moved = ~_same(compiled, before).reshape(rows, -1).all(dim=1) & ~stepping
        if bool(moved.any()):
            yield f"{what} ({who(int(moved.nonzero()[0]))}: does not step, changed)"
            return
    if not (eager.is_floating_point() or eager.is_complex()):
        wrong = (compiled != eager).reshape(rows, -1).any(dim=1)
        if bool(wrong.any()):
            yield f"{what} ({who(int(wrong.nonzero()[0]))}: exact values expected, {eager.dtype})"
        return
    real = eager.real.dtype if eager.is_complex() else eager.dtype
    info = torch.finfo(real)
    # 16-bit values are compared in float32; float32 and float64 in their own dtype.
    low = real in (torch.float16, torch.bfloat16)
    b, c, e = ((t.float() if low else t).reshape(rows, -1) for t in (before, compiled, eager))
    if not e.shape[1]:
        return
    # Each member's change sets the scale: a member with a small learning rate is compared to
    # its own update (a change to inf or NaN sets none). Round-off of the values is allowed
    # element by element, a few eps of each one's own size (down to the subnormals' spacing):
    # a member's largest value does not hide an error in its small ones. In place where it
    # can: this runs over all the state.
    delta = e - b
    change = _largest(delta)
    if not bool(change.isfinite().all()):
        change = _largest(torch.where(delta.isfinite(), delta, 0))
    bound = b.abs()
    bound += e.abs()
    bound.mul_(8 * info.eps).add_(tolerance(real) * change + 8 * info.eps * info.tiny)
    diff = (c - e).abs() if c.is_complex() else torch.sub(c, e, out=delta).abs_()
    bad_elements = diff > bound
    if bool(diff.sum().isnan()):  # unordered: bad unless NaN (or the same inf) in both
        bad_elements |= diff.isnan() & ~_same(c, e)
    bad = bad_elements.any(dim=1)
    if bool(bad.any()):
        m = int(bad.nonzero()[0])
        inf = float("inf")  # where one holds NaN or inf and the other not
        gap = float(torch.where(_same(c[m], e[m]), 0.0, diff[m]).nan_to_num(inf, inf).amax())
        yield f"{what} ({who(m)}: differs by {gap:.3g}, its update is {abs(float(change[m])):.3g})"


def _largest(t: Tensor) -> Tensor:
    """Each row's largest magnitude, ``[rows, 1]``: one pass (aminmax), without an abs copy."""
    t = torch.view_as_real(t).reshape(t.shape[0], -1) if t.is_complex() else t
    smallest, biggest = torch.aminmax(t, dim=1, keepdim=True)
    return torch.maximum(-smallest, biggest)
