"""Steps that keep no rollback copy must still change nothing when they fail, and finish when
interrupted (optim/_fused.py: fused kernels and write phases).

On CPU these optimizers (with shared or per-member hyperparameters, one param group or
several) write their parameters and state only in a last phase of in-place ops that neither
fail nor allocate, so a step needs no copy of what it writes. The truth here is not the code's own claim but what a step does, op by op, as a
``TorchDispatchMode`` sees it: nothing that allocates runs after the first write to a parameter
or a state tensor (an allocation is what can fail: out of memory), and a real ``SIGINT`` that
arrives between two writes leaves the run exactly where an uninterrupted run would be.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import vmapens
from vmapens.optim import (
    StackedAdadelta,
    StackedAdagrad,
    StackedAdam,
    StackedAdamax,
    StackedNAdam,
    StackedOptimizer,
    StackedRAdam,
    StackedRMSprop,
    StackedSGD,
)

N = 4

#: Optimizers (and settings) whose steps, with shared float hyperparameters on CPU, keep no
#: rollback copy: one fused kernel, or a write phase after everything that allocates.
FUSED: dict[str, Callable[[Any], StackedOptimizer]] = {
    "sgd_momentum": lambda p: StackedSGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: StackedAdam(p, lr=0.1),
    "adagrad": lambda p: StackedAdagrad(p, lr=0.1),
}
WRITE_PHASES: dict[str, Callable[[Any], StackedOptimizer]] = {
    # fused=False: torch's single-tensor ops, each member's bits as alone
    "sgd_unfused": lambda p: StackedSGD(p, lr=0.1, momentum=0.9, nesterov=True, fused=False),
    "adam_unfused": lambda p: StackedAdam(p, lr=0.1, amsgrad=True, fused=False),
    "adamw_unfused": lambda p: StackedAdam(
        p, lr=0.1, weight_decay=0.1, decoupled_weight_decay=True, fused=False
    ),
    "adagrad_unfused": lambda p: StackedAdagrad(p, lr=0.1, weight_decay=0.1, fused=False),
    # per-member values (a sweep): [n, 1, ...] columns in the parameters' dtype
    "adam_sweep": lambda p: StackedAdam(
        p, lr=[0.1, 0.05, 0.02, 0.01], betas=(0.9, [0.99, 0.999, 0.98, 0.995]), amsgrad=True
    ),
    "adamw_sweep": lambda p: StackedAdam(
        p, lr=0.1, weight_decay=[0.0, 0.1, 0.2, 0.3], decoupled_weight_decay=True
    ),
    "sgd_sweep": lambda p: StackedSGD(
        p, lr=[0.1, 0.05, 0.02, 0.01], momentum=[0.0, 0.5, 0.9, 0.99], dampening=0.1
    ),
    "sgd_sweep_nesterov": lambda p: StackedSGD(
        p, lr=[0.1, 0.05, 0.02, 0.01], momentum=0.9, nesterov=True, weight_decay=[0, 0.1, 0, 0.1]
    ),
    "rmsprop_sweep": lambda p: StackedRMSprop(
        p, lr=[0.01, 0.02, 0.005, 0.01], alpha=[0.9, 0.99, 0.95, 0.9], momentum=[0, 0.9, 0, 0.5]
    ),
    "rmsprop_sweep_centered": lambda p: StackedRMSprop(
        p, lr=torch.tensor(0.01), centered=True, weight_decay=[0.0, 0.1, 0.0, 0.1]
    ),
    "adamax_sweep": lambda p: StackedAdamax(
        p,
        lr=[0.1, 0.05, 0.02, 0.01],
        betas=([0.9, 0.8, 0.9, 0.8], 0.999),
        eps=[1e-8, 1e-6, 1e-8, 1e-6],
    ),
    "adadelta_sweep": lambda p: StackedAdadelta(
        p, lr=[0.5, 1.0, 0.5, 1.0], rho=[0.9, 0.95, 0.99, 0.9], weight_decay=[0, 0.1, 0, 0.1]
    ),
    "nadam_sweep": lambda p: StackedNAdam(
        p, lr=[0.1, 0.05, 0.02, 0.01], weight_decay=0.1, decoupled_weight_decay=True
    ),
    "radam_sweep": lambda p: StackedRAdam(
        p, lr=[0.1, 0.05, 0.02, 0.01], betas=(0.9, [0.999, 0.9, 0.99, 0.5])
    ),
    "adagrad_sweep": lambda p: StackedAdagrad(
        p, lr=[0.1, 0.05, 0.02, 0.01], lr_decay=[0, 0.1, 0, 0.1]
    ),
    "adam_tensor_lr": lambda p: StackedAdam(
        p, lr=torch.tensor(0.01), betas=([0.8, 0.9, 0.85, 0.95], 0.999)
    ),
    "adamax": lambda p: StackedAdamax(p, lr=0.1),
    "adamax_decay": lambda p: StackedAdamax(p, lr=0.1, weight_decay=0.1, maximize=True),
    "rmsprop": lambda p: StackedRMSprop(p, lr=0.01),
    "rmsprop_momentum": lambda p: StackedRMSprop(p, lr=0.01, momentum=0.9, weight_decay=0.1),
    "rmsprop_centered": lambda p: StackedRMSprop(p, lr=0.01, centered=True, momentum=0.5),
    "nadam": lambda p: StackedNAdam(p, lr=0.1),
    "nadamw": lambda p: StackedNAdam(p, lr=0.1, weight_decay=0.1, decoupled_weight_decay=True),
    "radam": lambda p: StackedRAdam(p, lr=0.1),
    "radamw": lambda p: StackedRAdam(p, lr=0.1, weight_decay=0.1, decoupled_weight_decay=True),
    "adadelta": lambda p: StackedAdadelta(p, lr=0.5, weight_decay=0.1),
}
NO_COPY = {**FUSED, **WRITE_PHASES}


def factory() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))


def grads_(params: list[torch.Tensor], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def setup(name: str, steps: int, groups: bool = False) -> tuple[list[torch.Tensor], Any]:
    """The ensemble's parameters and optimizer after ``steps`` steps (the next gradients set).
    Eight steps: RAdam's rectified branch starts at step 6. With ``groups``, two param groups
    (the second with its own ``lr``): two calls of the rule, whose writes all come last."""
    params = list(vmapens.Ensemble(factory, N, seed=0).parameters())
    if groups:
        opt = NO_COPY[name]([{"params": params[:2]}, {"params": params[2:], "lr": 0.05}])
    else:
        opt = NO_COPY[name](params)
    for t in range(steps):
        grads_(params, t)
        opt.step()
    grads_(params, steps)
    return params, opt


def owned(params: list[torch.Tensor], opt: StackedOptimizer) -> list[torch.Tensor]:
    """Every tensor a step may write: the parameters and all their optimizer state."""
    state = [t for p in params for t in opt.state[p].values() if isinstance(t, torch.Tensor)]
    return params + state


def written_by(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors ``func`` writes (its schema's mutable arguments, ``out=`` included)."""
    out: list[Any] = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            out += list(value) if isinstance(value, (list, tuple)) else [value]
    return [t for t in out if isinstance(t, torch.Tensor)]


def allocates(func: Any) -> bool:
    """Whether ``func`` returns new tensors (writes nothing, returns a tensor not a view)."""
    schema = func._schema
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return False
    returns = [r for r in schema.returns if "Tensor" in str(r.type)]
    return any(r.alias_info is None for r in returns)


class Ops(TorchDispatchMode):
    """Records each op as ("write", name) when it writes one of ``owned``, else ("alloc", name)
    when it allocates; ``interrupt`` raises a real SIGINT right after the first write."""

    def __init__(self, owned: list[torch.Tensor], interrupt: bool = False) -> None:
        super().__init__()
        self.owned = {t.untyped_storage().data_ptr() for t in owned}
        self.interrupt, self.events = interrupt, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        writes = [
            t
            for t in written_by(func, args, kwargs)
            if t.untyped_storage().data_ptr() in self.owned
        ]
        if writes:
            first = not any(kind == "write" for kind, _ in self.events)
            self.events.append(("write", str(func)))
            if first and self.interrupt:
                signal.raise_signal(signal.SIGINT)  # Python's handler runs at the next bytecode
        elif allocates(func):
            self.events.append(("alloc", str(func)))
        return result


@pytest.mark.parametrize("groups", [False, True], ids=["one_group", "two_groups"])
@pytest.mark.parametrize("name", list(NO_COPY))
def test_nothing_allocates_after_the_first_write(name: str, groups: bool):
    """The step keeps no rollback copy, and once it has written a parameter or a state tensor
    nothing that can fail (allocate) runs: a failure leaves everything as it was."""
    params, opt = setup(name, 8, groups)
    assert_writes_last(params, opt)


def assert_writes_last(params: list[torch.Tensor], opt: StackedOptimizer) -> None:
    """One step keeps no copy and allocates nothing after its first write."""
    with Ops(owned(params, opt)) as ops:
        opt.step()
    assert not opt._snapshot._old  # no copy held
    kinds = [kind for kind, _ in ops.events]
    assert "write" in kinds
    late = [op for kind, op in ops.events[kinds.index("write") :] if kind == "alloc"]
    assert not late, f"allocated after the first write: {late}"


@pytest.mark.parametrize("name", ["nadam", "nadamw"])
def test_nadam_with_its_members_own_momentum_products_writes_last(name: str):
    """Members that share their step count but not their momentum product (a state loaded
    so) take per-member step sizes, computed before the writes like the rest."""
    params, opt = setup(name, 8)
    product = opt.state[params[0]]["mu_product"]  # shared by every parameter's state
    product[0] *= 0.5
    assert_writes_last(params, opt)


class Stop(BaseException):
    """What a SIGINT handler of the user's own raises."""


def own_handler(signum: int, frame: Any) -> None:
    raise Stop(signum)


@pytest.mark.parametrize("groups", [False, True], ids=["one_group", "two_groups"])
@pytest.mark.parametrize("handler", ["python", "own"])
@pytest.mark.parametrize("name", list(NO_COPY))
def test_a_sigint_between_writes_finishes_the_step(name: str, handler: str, groups: bool):
    """A SIGINT that arrives after the first write is handled when the step is whole, by
    Python's handler (KeyboardInterrupt) or one of the user's own: the run continues exactly as
    one that was not interrupted (parameters, state and step counts)."""
    runs = []
    for interrupted in (False, True):
        params, opt = setup(name, 8, groups)
        if interrupted:
            raised = KeyboardInterrupt if handler == "python" else Stop
            # Python's own handler set here too: a process started in the background by a
            # non-interactive shell inherits SIGINT ignored, and Python then keeps it so.
            own = own_handler if handler == "own" else signal.default_int_handler
            before = signal.signal(signal.SIGINT, own)
            try:
                with pytest.raises(raised), Ops(owned(params, opt), interrupt=True):
                    opt.step()
            finally:
                signal.signal(signal.SIGINT, before)
        else:
            opt.step()
        grads_(params, 9)
        opt.step()
        runs.append([t.clone() for t in owned(params, opt)])
    for new, old in zip(runs[1], runs[0], strict=True):
        assert torch.equal(new, old)


@pytest.mark.parametrize("groups", [False, True], ids=["one_group", "two_groups"])
@pytest.mark.parametrize("last", [False, True], ids=["first", "last"])
@pytest.mark.parametrize("name", list(NO_COPY))
def test_a_failed_allocation_changes_nothing(name: str, last: bool, groups: bool):
    """The first, or the last, allocation of a step fails (out of memory): nothing changed,
    step counts included."""
    params, opt = setup(name, 8, groups)  # the same run twice: how many allocations a step makes
    with Ops(owned(params, opt)) as ops:
        opt.step()
    count = sum(kind == "alloc" for kind, _ in ops.events)
    assert count > 0
    params, opt = setup(name, 8, groups)
    before = [t.clone() for t in owned(params, opt)]

    class OutOfMemory(TorchDispatchMode):
        seen = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if allocates(func):
                self.seen += 1
                if self.seen == (count if last else 1):
                    raise torch.OutOfMemoryError("injected: out of memory")
            return func(*args, **(kwargs or {}))

    with pytest.raises(torch.OutOfMemoryError, match="injected"), OutOfMemory():
        opt.step()
    for new, old in zip(owned(params, opt), before, strict=True):
        assert torch.equal(new, old)
