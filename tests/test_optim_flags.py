"""Tensor learning rates and torch's implementation flags on the stacked optimizers (issue 18).

Truth: each member's own torch.optim twin, stepped alone on that member's gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import vmapens
from vmapens.optim import (
    StackedAdagrad,
    StackedAdam,
    StackedAdamax,
    StackedLion,
    StackedNAdam,
    StackedRMSprop,
    StackedSGD,
)

N, STEPS = 4, 20
# Per-member scalars (bias corrections, ...) are float64 tensors where torch has Python floats;
# glibc's pow and torch.pow may differ in the last bit of a double: 1e-12 is ~5000 ulps of room
# (measured: equal bits on AVX-512, AVX2 and ATen's default kernels).
TOL64 = dict(rtol=1e-12, atol=0.0)

Make = Callable[[Any], torch.optim.Optimizer]

# (id, stacked(params, lr), torch twin(params, lr)); lr is the same for both, a tensor or float.
TWINS: list[
    tuple[str, Callable[..., torch.optim.Optimizer], Callable[..., torch.optim.Optimizer]]
] = [
    (
        "adamw",
        lambda p, lr: StackedAdam(p, lr=lr, weight_decay=1e-2, decoupled_weight_decay=True),
        lambda p, lr: torch.optim.AdamW(p, lr=lr),
    ),
    ("adam", lambda p, lr: StackedAdam(p, lr=lr), lambda p, lr: torch.optim.Adam(p, lr=lr)),
    (
        "adam-amsgrad-l2",
        lambda p, lr: StackedAdam(p, lr=lr, amsgrad=True, weight_decay=0.1),
        lambda p, lr: torch.optim.Adam(p, lr=lr, amsgrad=True, weight_decay=0.1),
    ),
    ("sgd", lambda p, lr: StackedSGD(p, lr=lr), lambda p, lr: torch.optim.SGD(p, lr=lr)),
    (
        "sgd-momentum",
        lambda p, lr: StackedSGD(p, lr=lr, momentum=0.9, dampening=0.1),
        lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9, dampening=0.1),
    ),
    (
        "sgd-nesterov-l2",
        lambda p, lr: StackedSGD(p, lr=lr, momentum=0.9, weight_decay=0.1, nesterov=True),
        lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9, weight_decay=0.1, nesterov=True),
    ),
    (
        "rmsprop-centered",
        lambda p, lr: StackedRMSprop(p, lr=lr, momentum=0.9, centered=True),
        lambda p, lr: torch.optim.RMSprop(p, lr=lr, momentum=0.9, centered=True),
    ),
    (
        "adagrad",
        lambda p, lr: StackedAdagrad(p, lr=lr, lr_decay=0.01),
        lambda p, lr: torch.optim.Adagrad(p, lr=lr, lr_decay=0.01),
    ),
    ("adamax", lambda p, lr: StackedAdamax(p, lr=lr), lambda p, lr: torch.optim.Adamax(p, lr=lr)),
    ("nadam", lambda p, lr: StackedNAdam(p, lr=lr), lambda p, lr: torch.optim.NAdam(p, lr=lr)),
]


def _problem(dtype: torch.dtype) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(N, 7, 5), (N, 5), (N, 17)]  # a vector's worth and odd tails, as real layers have
    params = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
    grads = [[torch.randn(s, generator=gen, dtype=dtype) for s in shapes] for _ in range(STEPS)]
    return params, grads


def _run_stacked(make: Callable[..., Any], lr: Any, dtype: torch.dtype) -> list[torch.Tensor]:
    start, grads = _problem(dtype)
    params = [p.clone().requires_grad_() for p in start]
    opt = make(params, lr)
    for step in grads:
        for p, g in zip(params, step, strict=True):
            p.grad = g
        opt.step()
    return [p.detach() for p in params]


def _run_alone(make: Callable[..., Any], lr: Callable[[int], Any], dtype: torch.dtype) -> list:
    """Member i's parameters after STEPS steps of its own torch optimizer with `lr(i)`."""
    start, grads = _problem(dtype)
    out = []
    for i in range(N):
        params = [p[i].clone().requires_grad_() for p in start]
        opt = make(params, lr(i))
        for step in grads:
            for p, g in zip(params, step, strict=True):
                p.grad = g[i].clone()
            opt.step()
        out.append([p.detach() for p in params])
    return out


@pytest.mark.parametrize(("name", "stacked", "alone"), TWINS, ids=[t[0] for t in TWINS])
def test_tensor_lr_float32_is_bit_equal_to_torch(name: str, stacked: Any, alone: Any) -> None:
    # A 0-d float32 lr: torch computes lr / bias_correction in float32; so must the members.
    got = _run_stacked(stacked, torch.tensor(1e-3), torch.float32)
    want = _run_alone(alone, lambda i: torch.tensor(1e-3), torch.float32)
    for i in range(N):
        for k, w in enumerate(want[i]):
            assert torch.equal(got[k][i], w), f"{name}: member {i} parameter {k} differs"


@pytest.mark.parametrize("lr_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("name", "stacked", "alone"), TWINS, ids=[t[0] for t in TWINS])
def test_tensor_lr_float64_params_match_torch(
    name: str, stacked: Any, alone: Any, lr_dtype: torch.dtype
) -> None:
    # float64 parameters: the scalar arithmetic still runs in lr's dtype, as torch's does.
    got = _run_stacked(stacked, torch.tensor(1e-3, dtype=lr_dtype), torch.float64)
    want = _run_alone(alone, lambda i: torch.tensor(1e-3, dtype=lr_dtype), torch.float64)
    for i in range(N):
        for k, w in enumerate(want[i]):
            torch.testing.assert_close(got[k][i], w, **TOL64, msg=f"{name} member {i} param {k}")


def test_tensor_lr_is_not_float_lr() -> None:
    # The test above can fail: a float32 lr read as a Python float (the old behaviour) moves
    # members off torch's tensor-lr trajectory, by more than the bits they must match. Which
    # members and parameters move by a bit depends on the CPU's kernels (on one Intel CPU the
    # AdamW row alone stayed equal), so the whole table is asked: some member must move.
    lr = torch.tensor(1e-3)
    moved = []
    for name, stacked, alone in TWINS:
        got = _run_stacked(stacked, float(lr), torch.float32)
        want = _run_alone(alone, lambda i: lr, torch.float32)
        if not all(torch.equal(got[k][i], w) for i in range(N) for k, w in enumerate(want[i])):
            moved.append(name)
    assert moved, "a float lr gave every twin's tensor-lr bits: the test above proves nothing"


def test_tensor_lr_stays_a_tensor_in_param_groups_and_hands_off() -> None:
    params = [p.clone().requires_grad_() for p in _problem(torch.float32)[0]]
    lr = torch.tensor(1e-3)
    opt = StackedAdam(params, lr=lr, decoupled_weight_decay=True, weight_decay=1e-2)
    assert opt.param_groups[0]["lr"] is lr  # as torch keeps it, so schedulers fill_ it
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    member = opt.member_state_dict(1)
    handed = member["param_groups"][0]["lr"]
    assert isinstance(handed, torch.Tensor) and handed is not lr and torch.equal(handed, lr)
    twin = torch.optim.AdamW([p[1].detach().clone() for p in params], lr=torch.tensor(1.0))
    twin.load_state_dict(member)
    assert torch.equal(twin.param_groups[0]["lr"], lr)


def test_per_member_tensor_lr_is_read_as_floats() -> None:
    # Documented: a 1-D tensor holds n values; member i is torch with lr=float(lr[i]), floats'
    # arithmetic (float64 scalars), whatever the tensor's dtype.
    lrs = torch.tensor([1e-3, 3e-3, 1e-2, 3e-2])  # float32
    got = _run_stacked(TWINS[0][1], lrs, torch.float64)
    want = _run_alone(TWINS[0][2], lambda i: float(lrs[i]), torch.float64)
    for i in range(N):
        for k, w in enumerate(want[i]):
            torch.testing.assert_close(got[k][i], w, **TOL64, msg=f"member {i} param {k}")


# -- implementation flags --------------------------------------------------------------------

# Written from torch 2.13's constructors: the implementation flags each twin takes.
TAKES: dict[type, tuple[str, ...]] = {
    StackedSGD: ("foreach", "differentiable", "fused"),
    StackedAdam: ("foreach", "capturable", "differentiable", "fused"),
    StackedRMSprop: ("capturable", "foreach", "differentiable"),
    StackedAdagrad: ("foreach", "differentiable", "fused"),
    StackedAdamax: ("foreach", "differentiable", "capturable"),
    StackedNAdam: ("foreach", "capturable", "differentiable"),
    StackedLion: (),  # no torch twin
}
# Values that change nothing here; the others would (see docs/optim.md).
HARMLESS = {
    "foreach": (None, True, False),
    "fused": (None, True, False),
    "capturable": (False,),
    "differentiable": (False,),
}
REFUSED = {"capturable": (True,), "differentiable": (True,)}
CASES = [
    (cls, flag, value, "ok" if flag in takes else "untaken")
    for cls, takes in TAKES.items()
    for flag, values in HARMLESS.items()
    for value in values
] + [
    (cls, flag, value, "refused" if flag in takes else "untaken")
    for cls, takes in TAKES.items()
    for flag, values in REFUSED.items()
    for value in values
]


def _params() -> list[torch.Tensor]:
    return [p.clone().requires_grad_() for p in _problem(torch.float32)[0]]


@pytest.mark.parametrize(
    ("cls", "flag", "value", "outcome"),
    CASES,
    ids=[f"{c.__name__}-{f}={v}-{o}" for c, f, v, o in CASES],
)
def test_implementation_flags(cls: type, flag: str, value: Any, outcome: str) -> None:
    if outcome == "untaken":
        with pytest.raises(
            TypeError, match=rf"^{cls.__name__}: unexpected keyword argument `{flag}`"
        ):
            cls(_params(), **{flag: value})
        return
    if outcome == "refused":
        with pytest.raises(ValueError, match=rf"^{cls.__name__}: `{flag}=True` is not supported: "):
            cls(_params(), **{flag: value})
        return
    params, plain = _params(), _params()
    opt, reference = cls(params, **{flag: value}), cls(plain)
    assert opt.param_groups[0][flag] is value  # kept in param_groups, as torch keeps it
    for step in _problem(torch.float32)[1][:3]:
        for p, q, g in zip(params, plain, step, strict=True):
            p.grad, q.grad = g, g.clone()
        opt.step()
        reference.step()
    # fused=False keeps the update off torch's fused kernels: equal to rounding, not in bits.
    tol = dict(rtol=1e-6, atol=1e-7) if (flag, value) == ("fused", False) else dict(rtol=0, atol=0)
    for p, q in zip(params, plain, strict=True):
        torch.testing.assert_close(p, q, **tol)


@pytest.mark.parametrize(
    "cls", [c for c, takes in TAKES.items() if takes], ids=lambda c: c.__name__
)
def test_flags_hand_off_to_torch_and_round_trip(cls: type) -> None:
    flags = {f: HARMLESS[f][-1] for f in TAKES[cls]}  # False for each, which torch also takes
    opt = cls(_params(), **flags)
    saved = opt.state_dict()
    again = cls(_params())
    again.load_state_dict(saved)
    for flag, value in flags.items():
        assert again.param_groups[0][flag] is value
    member = opt.member_state_dict(0)
    twin = cls.torch_class([torch.zeros(s.shape[1:]) for s in _params()])
    twin.load_state_dict(member)
    for flag, value in flags.items():
        assert twin.param_groups[0][flag] is value
    # every key torch's group holds is there (nothing left for torch's __setstate__ to invent)
    assert set(cls.torch_class([torch.zeros(1)]).param_groups[0]) - {"params"} <= set(
        member["param_groups"][0]
    ) | {"decoupled_weight_decay"}


def test_refused_flag_in_a_param_group_and_bad_value_type() -> None:
    opt = StackedAdam(_params()[:1])
    with pytest.raises(ValueError, match=r"^StackedAdam: `differentiable=True` is not supported"):
        opt.add_param_group({"params": _params()[1:], "differentiable": True})
    assert len(opt.param_groups) == 1
    with pytest.raises(
        TypeError, match=r"^StackedSGD: `foreach` must be a bool or None, got 'yes'"
    ):
        StackedSGD(_params(), foreach="yes")
    with pytest.raises(
        ValueError, match=r"^StackedAdam: `fused` and `foreach` cannot both be True"
    ):
        StackedAdam(_params(), fused=True, foreach=True)


def test_select_keeps_flags() -> None:
    opt = StackedAdam(_params(), foreach=False, fused=False)
    sub = opt.select([0, 2], [p[[0, 2]].detach().clone().requires_grad_() for p in _params()])
    assert sub.param_groups[0]["foreach"] is False and sub.param_groups[0]["fused"] is False
    assert isinstance(sub, vmapens.StackedAdam)
