"""Session 48 (f): orders of calls plain PyTorch allows, on an Ensemble and its stacked
optimizers, against N plain modules trained alone with ``torch.optim`` (float64).

The truth in every test: ``ens.unstack()`` copies taken before training, each with its own
``torch.optim`` optimizer, put through the same calls.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import vmapens

X = torch.linspace(-1, 1, 10, dtype=torch.float64).reshape(5, 2)
Y = torch.linspace(0.5, -0.5, 5, dtype=torch.float64).reshape(5, 1)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1)).double()


def _mlp_bn() -> nn.Module:
    # no bias before the BatchNorm: its true gradient is 0 (docs/semantics.md's table)
    return nn.Sequential(
        nn.Linear(2, 3, bias=False), nn.BatchNorm1d(3), nn.Dropout(0.0), nn.Linear(3, 1)
    ).double()


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1, bias=False),
        nn.BatchNorm2d(3),
        nn.ReLU(),
        nn.Conv2d(3, 2, 1),
        nn.Flatten(),
        nn.Linear(2 * 4 * 4, 1),
    ).double()


XC = torch.linspace(-1, 1, 5 * 2 * 4 * 4, dtype=torch.float64).reshape(5, 2, 4, 4).sin()


def _ens_step(ens, opt, x=X) -> None:
    opt.zero_grad()
    vmapens.per_member(nn.MSELoss())(ens(x), Y).sum().backward()
    opt.step()


def _plain_steps(plains, popts, x=X) -> None:
    for m, o in zip(plains, popts, strict=True):
        o.zero_grad()
        nn.MSELoss()(m(x), Y).backward()
        o.step()


def _max_diff(ens, plains) -> float:
    return max(
        (a.double() - b.double()).abs().max().item()
        for mm, m in zip(ens.unstack(), plains, strict=True)
        for a, b in zip(mm.state_dict().values(), m.state_dict().values(), strict=True)
    )


# --- a failed step in a later param group (torch's fused CPU kernels) --------------------------

_FUSED = {
    "adam_weight_decay_none": (vmapens.StackedAdam, torch.optim.Adam, {"lr": 0.05}, "weight_decay", None, 0.0),
    "adam_amsgrad_int": (vmapens.StackedAdam, torch.optim.Adam, {"lr": 0.05}, "amsgrad", 1, False),
    "sgd_dampening_none": (
        vmapens.StackedSGD, torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}, "dampening", None, 0.0,
    ),
    "adagrad_eps_none": (vmapens.StackedAdagrad, torch.optim.Adagrad, {"lr": 0.05}, "eps", None, 1e-10),
}  # fmt: skip


@pytest.mark.parametrize("case", list(_FUSED))
def test_a_step_refused_in_a_later_param_group_leaves_the_earlier_groups_as_they_were(
    case: str,
) -> None:
    """Two param groups, every hyperparameter shared (torch's fused CPU kernel, one call per
    group, no rollback copy). A value set by hand on group 1 that the step's checks let
    through (None, as Adafactor's ``eps`` may be; an int flag, which torch's Adam takes) fails
    in the fused kernel of group 1 after group 0's kernel wrote: group 0's parameters and
    moments moved, its step count did not (``_make_then_count`` re-raises an ``Exception``
    without counting). The step promises all or nothing (``optim/_calls.py``): after the
    value is put right, the run must go on as the members' own optimizers that never saw the
    failed step. Found in session 48: group 0 takes the step twice, with one count."""
    cls, torch_cls, kw, key, bad, good = _FUSED[case]
    ens = vmapens.Ensemble(_mlp, n=3, seed=0)
    plains = ens.unstack()
    params = list(ens.parameters())
    opt = cls([{"params": params[:2]}, {"params": params[2:]}], **kw)
    popts = []
    for m in plains:
        mp = list(m.parameters())
        popts.append(torch_cls([{"params": mp[:2]}, {"params": mp[2:]}], **kw))
    _ens_step(ens, opt)
    _plain_steps(plains, popts)

    opt.zero_grad()
    vmapens.per_member(nn.MSELoss())(ens(X), Y).sum().backward()
    before = [p.detach().clone() for p in params]
    opt.param_groups[1][key] = bad
    with pytest.raises((TypeError, ValueError)):
        opt.step()
    moved = [not torch.equal(a, b) for a, b in zip(before, params, strict=True)]
    opt.param_groups[1][key] = good
    opt.step()  # the same gradients, now with a valid group 1
    _plain_steps(plains, popts)
    _ens_step(ens, opt)
    _plain_steps(plains, popts)
    assert not any(moved), f"the refused step moved parameters {moved}"
    assert _max_diff(ens, plains) < 1e-12


# --- copies of the ensemble together with its optimizer, mid-training ---------------------------


@pytest.mark.parametrize("how", ["deepcopy", "torch_save"])
def test_the_ensemble_and_its_optimizer_copied_together_mid_run_both_train_on_as_alone(
    how: str,
) -> None:
    """``copy.deepcopy((ens, opt))`` and ``torch.save((ens, opt))`` keep the optimizer on the
    copy's own parameters (one memo, as for a plain model and its optimizer), with a layer
    frozen after building and a BatchNorm switched to eval: the copy and the original then
    train apart, each as its plain twins copied the same way."""
    ens = vmapens.Ensemble(_mlp_bn, n=3, seed=0)
    plains = ens.unstack()
    opt = vmapens.StackedAdam(ens, lr=[0.01, 0.02, 0.03])
    popts = [torch.optim.Adam(m.parameters(), lr=lr) for m, lr in zip(plains, [0.01, 0.02, 0.03])]
    _ens_step(ens, opt)
    _plain_steps(plains, popts)
    ens.template[3].bias.requires_grad = False
    ens.template[1].eval()
    for m in plains:
        m[3].bias.requires_grad_(False)
        m[1].eval()
    if how == "deepcopy":
        ens2, opt2 = copy.deepcopy((ens, opt))
        plains2, popts2 = copy.deepcopy((plains, popts))
    else:
        buf = io.BytesIO()
        torch.save((ens, opt, plains, popts), buf)
        buf.seek(0)
        ens2, opt2, plains2, popts2 = torch.load(buf, weights_only=False)
    assert all(a is b for a, b in zip(opt2.param_groups[0]["params"], ens2.parameters()))
    assert [p.requires_grad for p in ens2.parameters()] == [True, True, True, True, False]
    for _ in range(2):
        _ens_step(ens2, opt2)
        _plain_steps(plains2, popts2)
    _ens_step(ens, opt)
    _plain_steps(plains, popts)
    assert _max_diff(ens2, plains2) < 1e-12
    assert _max_diff(ens, plains) < 1e-12


# --- a layer frozen, the optimizer reloaded, the layer unfrozen ------------------------------


_COUNTED = {
    "adam": (vmapens.StackedAdam, torch.optim.Adam, {"lr": 0.05}),
    "radam": (vmapens.StackedRAdam, torch.optim.RAdam, {"lr": 0.05}),
    "asgd": (vmapens.StackedASGD, torch.optim.ASGD, {"lr": 0.05, "t0": 1.0}),
    "adagrad": (vmapens.StackedAdagrad, torch.optim.Adagrad, {"lr": 0.05, "lr_decay": 0.1}),
}


@pytest.mark.parametrize("seq", ["sFsRsUs", "sFMsRUMs"])
@pytest.mark.parametrize("name", list(_COUNTED))
def test_a_layer_frozen_across_an_optimizer_reload_counts_its_steps_as_alone(
    name: str, seq: str
) -> None:
    """Freezing a layer after steps splits its step counts from the others'; a state dict
    round trip into a new optimizer (R) and a masked step (M) while the counts differ, then
    unfreezing it, step each member as its own optimizer reloaded the same way."""
    cls, torch_cls, kw = _COUNTED[name]
    ens = vmapens.Ensemble(_mlp, n=3, seed=0)
    plains = ens.unstack()
    opt = cls(ens, **kw)
    popts = [torch_cls(m.parameters(), **kw) for m in plains]
    mask = torch.tensor([True, False, True])
    for act in seq:
        if act == "s":
            _ens_step(ens, opt)
            _plain_steps(plains, popts)
        elif act in "FU":
            ens.template[0].requires_grad_(act == "U")
            for m in plains:
                m[0].requires_grad_(act == "U")
        elif act == "R":
            sd = copy.deepcopy(opt.state_dict())
            opt = cls(ens, **kw)
            opt.load_state_dict(sd)
            sds = [copy.deepcopy(o.state_dict()) for o in popts]
            popts = [torch_cls(m.parameters(), **kw) for m in plains]
            for o, s in zip(popts, sds, strict=True):
                o.load_state_dict(s)
        else:  # M: member 1 skips the step
            opt.zero_grad()
            vmapens.per_member(nn.MSELoss())(ens(X), Y).sum().backward()
            opt.step(mask=mask)
            for i, (m, o) in enumerate(zip(plains, popts, strict=True)):
                o.zero_grad()
                nn.MSELoss()(m(X), Y).backward()
                if mask[i]:
                    o.step()
    assert _max_diff(ens, plains) < 1e-12


# --- channels-last after the optimizer was built, for the rules with a layout of their own ---


_RULES = {
    "adafactor": (vmapens.StackedAdafactor, torch.optim.Adafactor, {"lr": 0.05}),
    "rprop": (vmapens.StackedRprop, torch.optim.Rprop, {"lr": 0.05}),
    "nadam": (vmapens.StackedNAdam, torch.optim.NAdam, {"lr": 0.05}),
    "adadelta": (vmapens.StackedAdadelta, torch.optim.Adadelta, {"lr": 0.5}),
}


@pytest.mark.parametrize("name", list(_RULES))
def test_channels_last_after_the_optimizer_stepped_steps_as_alone(name: str) -> None:
    """``ens.to(memory_format=torch.channels_last)`` after a step (state made contiguous),
    then steps on a channels-last batch: every member as its plain twin moved the same way
    with its torch optimizer."""
    cls, torch_cls, kw = _RULES[name]
    ens = vmapens.Ensemble(_cnn, n=3, seed=0)
    plains = ens.unstack()
    opt = cls(ens.parameters(), **kw)
    popts = [torch_cls(m.parameters(), **kw) for m in plains]
    _ens_step(ens, opt, XC)
    _plain_steps(plains, popts, XC)
    ens.to(memory_format=torch.channels_last)
    for m in plains:
        m.to(memory_format=torch.channels_last)
    xc = XC.to(memory_format=torch.channels_last)
    for _ in range(2):
        _ens_step(ens, opt, xc)
        _plain_steps(plains, popts, xc)
    assert _max_diff(ens, plains) < 1e-12
