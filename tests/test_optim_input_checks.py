"""What torch's optimizers refuse, the stacked ones refuse before anything changes: a state
dict missing a moment (torch's next step raises a KeyError; a stacked step started it at
zeros while the counts went on), a gradient of another dtype than its parameter (torch refuses
``p.grad = g`` unless its ``grad_dtype`` allows it), a parameter listed twice (torch steps it twice per step and warns)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import vmapens


def _stepped(cls: type, **options: object) -> tuple[vmapens.Ensemble, vmapens.StackedOptimizer]:
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 2, dtype=torch.float64), n=2, seed=0)
    opt = cls(ens, **options)
    ens(torch.randn(4, 3, dtype=torch.float64)).sum().backward()
    opt.step()
    return ens, opt


def _same_state(a: dict, b: dict) -> bool:
    return str(a) == str(b)


@pytest.mark.parametrize(
    ("cls", "name"),
    [
        (vmapens.StackedAdam, "exp_avg"),
        (vmapens.StackedAdam, "exp_avg_sq"),
        (vmapens.StackedRMSprop, "square_avg"),
        (vmapens.StackedAdagrad, "sum"),
        (vmapens.StackedRprop, "prev"),
    ],
)
def test_a_state_missing_a_moment_is_refused_and_changes_nothing(cls: type, name: str) -> None:
    # torch's own optimizer raises a KeyError for it at its next step
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 2, dtype=torch.float64), n=1, seed=0)
    plain = ens[0]
    torch_opt = getattr(torch.optim, cls.__name__.removeprefix("Stacked"))(plain.parameters())
    plain(torch.randn(4, 3, dtype=torch.float64)).sum().backward()
    torch_opt.step()
    broken = copy.deepcopy(torch_opt.state_dict())
    del broken["state"][0][name]
    torch_opt.load_state_dict(broken)
    with pytest.raises(KeyError):
        torch_opt.step()

    _, opt = _stepped(cls)
    before = copy.deepcopy(opt.state_dict())
    sd = copy.deepcopy(opt.state_dict())
    del sd["state"][0][name]
    with pytest.raises(ValueError, match=f"parameter 0 .* no `{name}`"):
        opt.load_state_dict(sd)
    assert _same_state(opt.state_dict(), before)


def test_a_lazily_made_state_may_be_missing_as_in_torch() -> None:
    # momentum set from 0 mid-run: torch makes the buffer at the next step; so does a load
    _, opt = _stepped(vmapens.StackedSGD, lr=0.1)
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["momentum"] = 0.9
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["momentum"] == 0.9


def test_a_gradient_of_another_dtype_is_refused_naming_it() -> None:
    ens, opt = _stepped(vmapens.StackedSGD, lr=0.1)
    before = copy.deepcopy(ens.state_dict())
    grads = [torch.ones_like(p) for p in ens.parameters()]
    grads[1] = grads[1].float()
    with pytest.raises(ValueError, match=r"`grads\[1\]` is \[2, 2\] torch.float32, expected"):
        opt.apply_gradients(grads)
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k
    with pytest.raises(RuntimeError, match="grad_dtype"):  # what torch says of p.grad = g
        p = nn.Parameter(torch.zeros(2, dtype=torch.float64))
        p.grad = torch.zeros(2, dtype=torch.float32)


@pytest.mark.parametrize("when", ["constructor", "add_param_group"])
def test_a_parameter_listed_twice_is_refused(when: str) -> None:
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 2), n=2, seed=0)
    weight, bias = ens.stacked_params()["weight"], ens.stacked_params()["bias"]
    if when == "constructor":
        with pytest.raises(ValueError, match=r"same tensor twice \(at 0 and 2\)"):
            vmapens.StackedAdam([weight, bias, weight])
    else:
        opt = vmapens.StackedAdam([weight])
        with pytest.raises(ValueError, match=r"same tensor twice \(at 0 and 1\)"):
            opt.add_param_group({"params": [bias, bias]})
        assert len(opt.param_groups) == 1


def test_adam_takes_amsgrad_by_position_as_torch() -> None:
    # torch.optim.Adam(params, lr, betas, eps, weight_decay, amsgrad)
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 2, dtype=torch.float64), n=2, seed=0)
    plain = [ens[i] for i in range(2)]
    opt = vmapens.optim.stacked(torch.optim.Adam)(ens, 1e-2, (0.9, 0.99), 1e-8, 0.1, True)
    alone = [torch.optim.Adam(m.parameters(), 1e-2, (0.9, 0.99), 1e-8, 0.1, True) for m in plain]
    x = torch.randn(4, 3, dtype=torch.float64)
    for _ in range(3):
        opt.zero_grad()
        ens(x).pow(2).mean((1, 2)).sum().backward()
        opt.step()
        for m, o in zip(plain, alone, strict=True):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
    assert opt.param_groups[0]["amsgrad"] is True
    for i, m in enumerate(plain):
        for (k, a), b in zip(ens[i].state_dict().items(), m.state_dict().values(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14, msg=k)
