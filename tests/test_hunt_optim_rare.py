"""The rarer stacked optimizers (ASGD, Rprop, Adadelta, Adafactor, Muon) against torch's own on
each member alone: param-group edits torch takes, 0-d tensor learning rates, and resumes."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
from torch import nn

import vmapens.optim as vo

N = 3


def _members(shapes: tuple[tuple[int, ...], ...], dtype: torch.dtype) -> list[list[nn.Parameter]]:
    g = torch.Generator().manual_seed(0)
    return [
        [nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in shapes] for _ in range(N)
    ]


def _stacked(members: list[list[nn.Parameter]]) -> list[torch.Tensor]:
    return [
        torch.stack([m[k].detach() for m in members]).requires_grad_()
        for k in range(len(members[0]))
    ]


def _step_both(stacked: list[torch.Tensor], opt: Any, members: list, opts: list, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in stacked]
    for p, grad in zip(stacked, grads, strict=True):
        p.grad = grad.clone()
    opt.step()
    for i, (m, o) in enumerate(zip(members, opts, strict=True)):
        for p, grad in zip(m, grads, strict=True):
            p.grad = grad[i].clone()
        o.step()


def _largest_gap(stacked: list[torch.Tensor], members: list) -> float:
    return max(
        (p[i] - m[k]).abs().max().item()
        for i, m in enumerate(members)
        for k, p in enumerate(stacked)
    )


def test_muon_group_with_another_adjust_lr_fn_steps_as_torchs_group() -> None:
    # torch's Muon checks `adjust_lr_fn` in its constructor only; a group added later with any
    # other value steps with the lr as it is (torch's _adjust_lr: ratio 1), not match_rms_adamw.
    members = _members(((3, 4), (5, 2)), torch.float64)
    stacked = _stacked(members)
    opt = vo.StackedMuon(stacked[:1], lr=0.1)
    opt.add_param_group({"params": stacked[1:], "adjust_lr_fn": "unscaled"})
    opts = []
    for m in members:
        o = torch.optim.Muon(m[:1], lr=0.1)
        o.add_param_group({"params": m[1:], "adjust_lr_fn": "unscaled"})
        opts.append(o)
    for s in range(3):
        _step_both(stacked, opt, members, opts, s)
    assert _largest_gap(stacked, members) < 1e-12


def test_muon_ns_steps_of_a_group_over_torchs_limit_is_refused_before_any_write() -> None:
    # torch's Muon raises at the step of a group with ns_steps >= 100; the stacked one ran it.
    stacked = _stacked(_members(((3, 4), (5, 2)), torch.float64))
    opt = vo.StackedMuon([{"params": stacked[:1]}, {"params": stacked[1:]}], lr=0.1)
    for p in stacked:
        p.grad = torch.ones_like(p)
    opt.step()
    before = copy.deepcopy(opt.state_dict())
    params = [p.detach().clone() for p in stacked]
    opt.param_groups[1]["ns_steps"] = 100
    with pytest.raises(ValueError, match="`ns_steps`"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params, stacked, strict=True))
    after = opt.state_dict()["state"]
    for k, state in before["state"].items():
        assert all(torch.equal(v, after[k][key]) for key, v in state.items())
    with pytest.raises(ValueError, match="`ns_coefficients`"):
        opt.add_param_group({"params": [torch.zeros(N, 2, 2)], "ns_coefficients": (1.0, 2.0)})
    with pytest.raises(ValueError, match="`ns_steps`"):
        opt.add_param_group({"params": [torch.zeros(N, 2, 2)], "ns_steps": 150})
    assert len(opt.param_groups) == 2


@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_muon_with_a_float32_tensor_lr_is_torchs_bits(adjust_lr_fn: str | None) -> None:
    # torch adds the update with alpha = -(lr * ratio) (one rounding); a product then a sum
    # was an ulp off in float32.
    members = _members(((3, 5), (7, 2)), torch.float32)
    stacked = _stacked(members)
    kw: dict[str, Any] = dict(weight_decay=0.3, adjust_lr_fn=adjust_lr_fn)
    lr: Any = torch.tensor(0.0123)  # torch's Muon takes a 0-d tensor lr (typed float)
    opt = vo.StackedMuon(stacked, lr=lr.clone(), **kw)
    opts = [torch.optim.Muon(m, lr=lr.clone(), **kw) for m in members]
    for s in range(6):
        _step_both(stacked, opt, members, opts, s)
    assert _largest_gap(stacked, members) == 0.0


CASES = [
    (torch.optim.ASGD, dict(lr=[0.1, 0.05, 0.2], t0=[1.0, 2.0, 0.0], lambd=0.01, weight_decay=0.1)),
    (torch.optim.Rprop, dict(lr=[0.1, 0.05, 0.2], etas=([0.3, 0.5, 0.4], 1.2), maximize=True)),
    (torch.optim.Adadelta, dict(lr=[1.0, 0.5, 2.0], rho=[0.9, 0.5, 0.99], weight_decay=0.1)),
    (torch.optim.Adafactor, dict(lr=[0.01, 0.1, 0.05], d=[1.0, 2.0, 1.5], weight_decay=0.1)),
]


def _member_kwargs(kw: dict[str, Any], i: int) -> dict[str, Any]:
    def pick(v: Any) -> Any:
        if isinstance(v, list):
            return v[i]
        return tuple(pick(x) for x in v) if isinstance(v, tuple) else v

    return {k: pick(v) for k, v in kw.items()}


@pytest.mark.parametrize(("torch_class", "kw"), CASES, ids=lambda c: getattr(c, "__name__", ""))
def test_a_resume_mid_run_with_a_param_without_grad_stays_on_torchs_path(
    torch_class: type, kw: dict[str, Any]
) -> None:
    members = _members(((3, 4), (3,), (2, 3, 2)), torch.float64)
    stacked = _stacked(members)
    opt = vo.stacked(torch_class)(stacked, **kw)
    opts = [torch_class(m, **_member_kwargs(kw, i)) for i, m in enumerate(members)]
    for s in range(7):
        if s == 3:  # through torch.save, into a new optimizer
            buf = io.BytesIO()
            torch.save(opt.state_dict(), buf)
            opt = vo.stacked(torch_class)(stacked, **kw)
            buf.seek(0)
            opt.load_state_dict(torch.load(buf))
        _step_both(stacked, opt, members, opts, s)
        if s == 1:  # the vector parameter gets no gradient at the next step
            stacked[1].grad = None
            for m in members:
                m[1].grad = None
    assert _largest_gap(stacked, members) < 1e-12
    for i, o in enumerate(opts):
        want, got = o.state_dict()["state"], opt.member_state_dict(i)["state"]
        assert sorted(want) == sorted(got)
        for k, state in want.items():
            assert sorted(state) == sorted(got[k])
            for key, v in state.items():
                assert got[k][key].dtype == v.dtype, (k, key)
                torch.testing.assert_close(got[k][key], v, rtol=1e-12, atol=1e-13)
