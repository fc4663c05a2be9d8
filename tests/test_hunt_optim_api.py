"""The stacked optimizers called as users call ``torch.optim.Optimizer`` mid-training.

Truth: N plain tensors, each with its own torch.optim twin, float64, stepped the same way; or
torch's own optimizer given the same hooks and state dicts.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any

import pytest
import torch

from vmapens.optim import StackedAdam, stacked

N = 3
TOL64 = dict(rtol=1e-12, atol=1e-14)


def _stepped_adam() -> tuple[StackedAdam, torch.Tensor]:
    w = torch.randn(N, 2, 3, dtype=torch.float64, requires_grad=True)
    opt = StackedAdam([w], lr=[0.1, 0.2, 0.3])
    w.grad = torch.randn_like(w)
    opt.step()
    return opt, w


def _old_checkpoint(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint of before `decoupled_weight_decay` existed (torch < 2.7 wrote none)."""
    old = copy.deepcopy(state_dict)
    for group in old["param_groups"]:
        del group["decoupled_weight_decay"]
    return old


def _fill_in(opt: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
    groups = [{**g, "decoupled_weight_decay": False} for g in state_dict["param_groups"]]
    return {**state_dict, "param_groups": groups}


def test_load_pre_hook_adapts_the_state_dict_before_it_is_checked() -> None:
    # torch runs load pre-hooks first: one that fills in a missing hyperparameter, or unwraps
    # a checkpoint, makes the state dict loadable. The stacked optimizer refused it unseen.
    v = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    twin = torch.optim.Adam([v])
    v.grad = torch.ones_like(v)
    twin.step()
    again = torch.optim.Adam([v.detach().clone().requires_grad_()])
    again.register_load_state_dict_pre_hook(_fill_in)
    again.load_state_dict(_old_checkpoint(twin.state_dict()))  # torch: fine
    assert again.param_groups[0]["decoupled_weight_decay"] is False

    opt, w = _stepped_adam()
    saved = copy.deepcopy(opt.state_dict())
    new = StackedAdam([w.detach().clone().requires_grad_()], lr=0.5)
    new.register_load_state_dict_pre_hook(_fill_in)
    new.load_state_dict(_old_checkpoint(saved))
    assert list(new.param_groups[0]["lr"]) == [0.1, 0.2, 0.3]
    p = new.param_groups[0]["params"][0]
    torch.testing.assert_close(new.state[p]["exp_avg"], opt.state[w]["exp_avg"], rtol=0, atol=0)

    wrapped = StackedAdam([w.detach().clone().requires_grad_()], lr=0.5)
    wrapped.register_load_state_dict_pre_hook(lambda o, sd: sd.get("optimizer"))
    wrapped.load_state_dict({"optimizer": copy.deepcopy(saved)})
    assert list(wrapped.param_groups[0]["lr"]) == [0.1, 0.2, 0.3]


def test_load_hooks_run_once_each_and_a_bad_result_is_still_refused() -> None:
    opt, w = _stepped_adam()
    saved = copy.deepcopy(opt.state_dict())
    new = StackedAdam([w.detach().clone().requires_grad_()], lr=0.5)
    log: list[str] = []
    new.register_load_state_dict_pre_hook(lambda o, sd: log.append("pre"))
    # A post-hook sees the groups as stepping reads them (a list of n values is MemberValues).
    new.register_load_state_dict_post_hook(
        lambda o: log.append(type(o.param_groups[0]["lr"]).__name__)
    )
    new.load_state_dict(saved)
    assert log == ["pre", "MemberValues"]
    breaks = new.register_load_state_dict_pre_hook(lambda o, sd: _old_checkpoint(sd))
    before = copy.deepcopy(new.state_dict())
    with pytest.raises(ValueError, match="decoupled_weight_decay"):
        new.load_state_dict(saved)
    assert new.param_groups[0]["lr"] == before["param_groups"][0]["lr"]
    breaks.remove()
    log.clear()
    new.load_state_dict(saved)  # the hooks are all still registered, and run once each
    assert log == ["pre", "MemberValues"]


@pytest.mark.parametrize("flag", ["differentiable", "capturable"])
def test_a_flag_set_mid_run_that_the_constructor_refuses_is_refused_by_step(flag: str) -> None:
    # The constructor refuses `differentiable=True` (no graph flows through a stacked step);
    # set in a param group mid-run, the step ignored it silently and stepped without a graph.
    with pytest.raises(ValueError, match=f"`{flag}=True`"):
        StackedAdam([torch.zeros(N, 2, requires_grad=True)], lr=0.1, **{flag: True})
    opt, w = _stepped_adam()
    w.grad = torch.randn_like(w)
    before = [w.detach().clone(), *(v.clone() for v in opt.state[w].values())]
    opt.param_groups[0][flag] = True
    with pytest.raises(ValueError, match=f"StackedAdam.step: `{flag}=True` is not supported"):
        opt.step()
    after = [w.detach(), *opt.state[w].values()]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    opt.param_groups[0][flag] = False  # set back: steps as a twin that never had it set
    v = torch.optim.Adam([w.detach()[0].clone().requires_grad_()], lr=0.1)
    v.load_state_dict(opt.member_state_dict(0))
    v.param_groups[0]["params"][0].grad = w.grad[0].clone()
    opt.step()
    v.step()
    torch.testing.assert_close(w.detach()[0], v.param_groups[0]["params"][0].detach(), **TOL64)


def test_a_set_of_params_in_a_group_is_refused_as_torch_refuses_it() -> None:
    # A set's order follows tensor ids, which change between runs; state dicts match
    # parameters by position, so a resume could swap two same-shaped parameters' moments.
    w, v = torch.zeros(3, 2, requires_grad=True), torch.zeros(3, 3, requires_grad=True)
    with pytest.raises(TypeError, match="ordered collections"):
        torch.optim.Adam([{"params": {w[0].detach().requires_grad_()}}])
    with pytest.raises(TypeError, match="`params` must be an ordered collection"):
        StackedAdam([{"params": {w, v}}])
    opt = StackedAdam([w])
    with pytest.raises(TypeError, match="add_param_group: a param group's `params`"):
        opt.add_param_group({"params": {v}})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [v]})
    assert opt.param_groups[1]["params"] == [v]


def _pairs(seed: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Stacked [w, b] and each member's own copies (the twins' parameters)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, 3, 4, dtype=torch.float64, generator=g)
    b = torch.randn(N, 3, dtype=torch.float64, generator=g)
    params = [w.clone().requires_grad_(), b.clone().requires_grad_()]
    return params, [
        [w[i].clone().requires_grad_(), b[i].clone().requires_grad_()] for i in range(N)
    ]


X = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _backward(params: list[torch.Tensor], plain: list[list[torch.Tensor]]) -> None:
    w, b = params
    (torch.einsum("nij,bj->nbi", w, X) + b[:, None]).sin().square().sum().backward()
    for v, c in plain:
        (X @ v.T + c).sin().square().sum().backward()


@pytest.mark.parametrize("how", ["del", "clear", "new dict"])
@pytest.mark.parametrize(
    "cls, kw",
    [
        (torch.optim.Adam, {"lr": 0.01}),
        (torch.optim.SGD, {"lr": 0.01, "momentum": 0.9}),
        (torch.optim.NAdam, {"lr": 0.01}),
        (torch.optim.ASGD, {"lr": 0.01}),
    ],
)
def test_state_deleted_mid_run_starts_again_as_torchs(cls: type, kw: dict, how: str) -> None:
    # `del opt.state[p]` (a layer's moments reset) makes torch start p's state again at its
    # next step, while the others go on; the stacked step raised KeyError: 'step'.
    params, plain = _pairs(0)
    opt = stacked(cls)(params, **kw)
    twins = [cls(p, **kw) for p in plain]
    for step in range(4):
        for o in [opt, *twins]:
            o.zero_grad()
        if step == 2:
            for o, p in [(opt, params[1])] + [(t, q[1]) for t, q in zip(twins, plain)]:
                if how == "del":
                    del o.state[p]
                elif how == "clear":
                    o.state[p].clear()
                else:
                    o.state = defaultdict(dict)
        _backward(params, plain)
        for o in [opt, *twins]:
            o.step()
    for i in range(N):
        for k in range(2):
            torch.testing.assert_close(params[k].detach()[i], plain[i][k].detach(), **TOL64)
