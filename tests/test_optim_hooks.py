"""A stacked optimizer's ``step`` keeps torch's step hooks and profiler label.

torch wraps every optimizer's ``step`` in ``Optimizer.profile_hook_step``; vmapens runs that
wrapper only when it does something (``optim/_eager.py``, ``hooked_step``). The truth here is
torch's own optimizer with the same hooks, under the same profiler.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from vmapens.optim import StackedAdam, StackedSGD


def _pair(cls: type, twin: type) -> tuple[Any, Any, torch.Tensor, torch.Tensor]:
    w = torch.randn(3, 4, requires_grad=True)
    v = w.detach().clone().requires_grad_()
    w.grad, v.grad = torch.ones(3, 4), torch.ones(3, 4)
    return cls([w], lr=0.1), twin([v], lr=0.1), w, v


def _record(opt: Any, log: list) -> list:
    return [
        opt.register_step_pre_hook(lambda o, args, kwargs: log.append(("pre", type(o), args))),
        opt.register_step_post_hook(lambda o, args, kwargs: log.append(("post", type(o), args))),
    ]


@pytest.mark.parametrize(
    "cls, twin", [(StackedSGD, torch.optim.SGD), (StackedAdam, torch.optim.Adam)]
)
def test_step_hooks_run_as_on_torchs_optimizer(cls: type, twin: type) -> None:
    opt, ref, w, v = _pair(cls, twin)
    got: list = []
    want: list = []
    handles = _record(opt, got) + _record(ref, want)
    opt.step()
    ref.step()
    assert want == [("pre", twin, (ref,)), ("post", twin, (ref,))]
    assert got == [("pre", cls, (opt,)), ("post", cls, (opt,))]
    torch.testing.assert_close(w.detach(), v.detach(), rtol=0, atol=0)
    for h in handles:
        h.remove()
    got.clear()
    opt.step()  # removed: the step alone, still stepping
    ref.step()
    assert got == []
    torch.testing.assert_close(w.detach(), v.detach(), rtol=0, atol=0)
    opt.register_step_post_hook(lambda o, args, kwargs: got.append("post alone"))
    opt.step()
    assert got == ["post alone"]


def test_a_pre_hook_may_replace_the_steps_arguments() -> None:
    w = torch.zeros(2, 3, requires_grad=True)
    w.grad = torch.ones(2, 3)
    opt = StackedSGD([w], lr=0.5)
    keep_first = torch.tensor([True, False])
    opt.register_step_pre_hook(lambda o, args, kwargs: ((o, keep_first), kwargs))
    opt.step()
    torch.testing.assert_close(w.detach()[:, 0], torch.tensor([-0.5, 0.0]), rtol=0, atol=0)


@pytest.mark.parametrize(
    "register", [register_optimizer_step_pre_hook, register_optimizer_step_post_hook]
)
def test_global_step_hooks_are_called(register: Any) -> None:
    opt, _, _, _ = _pair(StackedSGD, torch.optim.SGD)
    log: list = []
    handle = register(lambda o, a, k: log.append(o))
    try:
        opt.step()
    finally:
        handle.remove()
    assert log == [opt]
    opt.step()
    assert log == [opt]


def test_profiler_shows_one_step_label_as_for_torchs_optimizer() -> None:
    opt, ref, _, _ = _pair(StackedAdam, torch.optim.Adam)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
        ref.step()
    names = [e.name for e in prof.events()]
    assert names.count("Optimizer.step#StackedAdam.step") == 1  # wrapped once, not twice
    assert names.count("Optimizer.step#Adam.step") == 1
