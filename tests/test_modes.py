"""Submodule train/eval modes, grad flags and ``apply``: the ensemble keeps what members alone keep.

A BatchNorm frozen in eval mode inside a model in train mode (the usual fine-tuning set-up), a
layer frozen with ``requires_grad_(False)``, and ``apply(fn)`` that sets either: each member
must train exactly as the same module trained alone with ``torch.optim`` (``truth.py``), and
``ens[i]``, ``select`` and evaluation must keep those settings. What ``apply`` cannot carry
(another attribute, members treated differently) is refused and changes nothing.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from truth import TOL64, assert_members_equal, float64_batches, train_alone, train_each, twins

import vmapens

N = 3


def net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 2)).double()


def frozen_bn() -> nn.Sequential:
    model = net()
    model[1].eval()  # the root stays in train mode
    return model


def _batches(steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return float64_batches(steps, 8, 4, 2)


def _sgd(i: int, m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.1)


def _train(ens: vmapens.Ensemble, batches: list) -> None:
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.optim.StackedSGD(ens, lr=0.1))
    for x, y in batches:
        step(x, y)


def test_a_submodule_frozen_in_the_factory_stays_frozen():
    torch.manual_seed(0)
    ens = vmapens.Ensemble(frozen_bn, N, seed=0)
    alone = twins(ens.unstack())
    assert [m[1].training for m in alone] == [False] * N and all(m.training for m in alone)
    assert not ens.template[1].training and not ens[0][1].training and ens.training
    batches = _batches()
    _train(ens, batches)
    train_each(alone, batches, make_opt=_sgd)
    assert_members_equal(ens, alone)  # running statistics included: untouched when frozen


def test_from_modules_keeps_submodule_modes_and_refuses_mixed_ones():
    torch.manual_seed(0)
    modules = [frozen_bn() for _ in range(N)]
    ens = vmapens.Ensemble.from_modules(modules)
    x = _batches(1)[0][0]
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in twins(modules)]), **TOL64)
    mixed = [net() for _ in range(N)]
    mixed[1].eval()
    with pytest.raises(ValueError, match=r"member 1 differs .* mode of the module itself"):
        vmapens.Ensemble.from_modules(mixed)
    mixed[1].train()
    mixed[2][1].eval()
    with pytest.raises(ValueError, match=r"member 2 differs .* mode of submodule `1`"):
        vmapens.Ensemble.from_modules(mixed)


def test_a_mode_set_on_the_template_is_the_mode_members_run_in():
    torch.manual_seed(0)
    ens = vmapens.Ensemble(net, N, seed=0)
    alone = twins(ens.unstack())
    ens.template[1].eval()  # what the error for `ens.bn` points to
    for m in alone:
        m[1].eval()
    batches = _batches()
    _train(ens, batches)
    train_each(alone, batches, make_opt=_sgd)
    assert_members_equal(ens, alone)
    assert not ens[1][1].training


def test_a_mode_set_on_the_template_holds_for_the_next_forward():
    torch.manual_seed(0)
    ens = vmapens.Ensemble(net, N, seed=0)
    alone = twins(ens.unstack())
    ens.template[1].eval()
    x = _batches(1)[0][0]
    for m in alone:
        m[1].eval()
    with torch.no_grad():
        got = ens(x)  # the first use after the change: no ens[i] or select in between
        want = torch.stack([m(x) for m in alone])
    torch.testing.assert_close(got, want, **TOL64)
    assert_members_equal(ens, alone)  # eval mode: running statistics untouched


def test_a_parameter_frozen_after_building_stays_frozen_in_members_and_selections():
    torch.manual_seed(0)
    ens = vmapens.Ensemble(net, N, seed=0)
    ens.stacked_params()["0.weight"].requires_grad_(False)
    assert not ens[2][0].weight.requires_grad
    sub = ens.select([0, 2])
    assert not sub.stacked_params()["0.weight"].requires_grad
    alone = twins(sub.unstack())
    batches = _batches()
    _train(sub, batches)
    train_each(alone, batches, make_opt=_sgd)
    assert_members_equal(sub, alone)
    torch.testing.assert_close(
        sub.stacked_params()["0.weight"], ens.stacked_params()["0.weight"][[0, 2]]
    )


def _freeze_and_eval(m: nn.Module) -> None:
    if isinstance(m, nn.BatchNorm1d):
        m.eval()
    if isinstance(m, nn.Linear) and m.in_features == 4:
        m.requires_grad_(False)


def test_apply_carries_modes_and_grad_flags_like_members_alone():
    torch.manual_seed(0)
    ens = vmapens.Ensemble(net, N, seed=0)
    alone = twins(ens.unstack())
    ens.apply(_freeze_and_eval)
    for m in alone:
        m.apply(_freeze_and_eval)
    assert not ens.template[1].training and not ens.stacked_params()["0.weight"].requires_grad
    batches = _batches()
    _train(ens, batches)
    train_each(alone, batches, make_opt=_sgd)
    assert_members_equal(ens, alone)


def _momentum(m: nn.Module) -> None:
    if isinstance(m, nn.BatchNorm1d):
        m.momentum = 0.5


class _Second:
    """Puts only the second member it visits in eval mode: not every member alike."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, m: nn.Module) -> None:
        if isinstance(m, nn.BatchNorm1d):
            self.calls += 1
            if self.calls == 2:
                m.eval()


@pytest.mark.parametrize(
    ("fn", "match"),
    [(_momentum, r"changed `1\.momentum` \(0\.1 -> 0\.5\)"), (_Second(), r"member 1 differs")],
    ids=["attribute", "members-differ"],
)
def test_apply_refuses_what_it_cannot_carry_and_changes_nothing(fn, match):
    torch.manual_seed(0)
    ens = vmapens.Ensemble(net, N, seed=0)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        ens.apply(lambda m: (nn.init.zeros_(m.bias) if isinstance(m, nn.Linear) else None, fn(m)))
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert ens.template[1].training and ens.template[1].momentum == 0.1


@pytest.mark.parametrize("how", ["predict", "fit-validation"])
def test_evaluation_gives_every_submodule_its_own_mode_back(how):
    torch.manual_seed(0)
    ens = vmapens.Ensemble(frozen_bn, N, seed=0)
    x, y = _batches(1)[0]
    if how == "predict":
        vmapens.predict(ens, x)
    else:
        vmapens.fit(ens, (x, y), nn.MSELoss(), epochs=2, batch_size=8, val_data=(x, y),
                    progress=False)  # fmt: skip
    assert ens.training and not ens.template[1].training and ens.runner.training
    assert not ens.runner[1].training


def test_apply_that_switches_the_root_switches_the_ensemble():
    torch.manual_seed(0)
    ens = vmapens.Ensemble(net, N, seed=0)
    alone = twins(ens.unstack())
    ens.apply(lambda m: m.eval())
    for m in alone:
        m.apply(lambda m: m.eval())
    assert not ens.training and not ens[0].training
    x = _batches(1)[0][0]
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in alone]), **TOL64)


@pytest.mark.parametrize("how", ["eager", "chunked", "compiled"])
def test_a_layer_frozen_and_unfrozen_between_steps_of_one_step_function(how):
    """Fine-tuning freezes a layer mid-run: torch's loop (zero_grad, backward, step) then gives
    it no gradient, so Adam neither moves it nor counts its step, until it is unfrozen. One
    ``make_step`` must do the same (the eager step refused with a misleading error, and the
    compiled one kept training the frozen layer). No BatchNorm: Adam would magnify the rounding
    noise of the first bias's gradient, which BatchNorm makes zero."""

    def mlp() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()

    torch.manual_seed(0)
    ens = vmapens.Ensemble(mlp, N, seed=0, chunk_size=2 if how == "chunked" else None)
    alone = twins(ens.unstack())
    opt = vmapens.StackedAdam(ens, lr=0.1)
    step = vmapens.make_step(ens, nn.MSELoss(), opt, compile=how == "compiled")
    opts = [torch.optim.Adam(m.parameters(), lr=0.1) for m in alone]
    batches = _batches(6)
    weight = ens.stacked_params()["0.weight"]
    before = weight.detach().clone()
    for phase, frozen in enumerate([False, True, False]):
        weight.requires_grad_(not frozen)
        for m, o in zip(alone, opts, strict=True):
            m[0].weight.requires_grad_(not frozen)
            train_alone(m, batches[2 * phase : 2 * phase + 2], make_opt=o)
        for x, y in batches[2 * phase : 2 * phase + 2]:
            step(x, y)
        if frozen:
            torch.testing.assert_close(weight, before, rtol=0, atol=0)
        before = weight.detach().clone()
    assert_members_equal(ens, alone)
    for i, o in enumerate(opts):  # the frozen layer's Adam state skipped the frozen steps
        want = o.state_dict()["state"]
        got = opt.member_state_dict(i)["state"]
        for k in want:
            torch.testing.assert_close(got[k], want[k], **TOL64)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_every_layer_frozen_says_so_and_changes_nothing(compile):
    ens = vmapens.Ensemble(net, N, seed=0)
    opt = vmapens.StackedAdam(ens, lr=0.1)
    step = vmapens.make_step(ens, nn.MSELoss(), opt, compile=compile)
    x, y = _batches(1)[0]
    for p in ens.parameters():
        p.requires_grad_(False)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    with pytest.raises(RuntimeError, match="no parameter of the ensemble requires grad"):
        step(x, y)
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not opt.state


class _Broken(torch.optim.SGD):
    def step(self, closure=None):  # type: ignore[no-untyped-def, override]
        torch.ones(2) + torch.ones(3)  # torch's own error: "The size of tensor a (2) must ..."


def test_an_optimizer_that_fails_is_named_not_the_forward():
    """The step's guard reports torch's unexplained errors as a member's forward or loss
    failing; one from ``optimizer.step()`` must name the optimizer instead, and leave the
    parameters, buffers and gradients as they were."""
    ens = vmapens.Ensemble(net, N, seed=0)
    step = vmapens.make_step(ens, nn.MSELoss(), _Broken(ens.parameters(), lr=0.1), check=False)
    x, y = _batches(1)[0]
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"^step: _Broken.step\(\) failed \(The size of tensor"):
        step(x, y)
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in ens.parameters())


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_a_layer_unfrozen_into_a_new_param_group_mid_run(compile):
    """Fine-tuning's other half: the optimizer starts over the trainable layers only, then a
    frozen layer is unfrozen and added as a param group of its own (another lr), as with
    torch alone. The compiled step read the optimizer's parameters once and failed."""

    def mlp() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()

    torch.manual_seed(0)
    ens = vmapens.Ensemble(mlp, N, seed=0)
    alone = twins(ens.unstack())
    weight = ens.stacked_params()["0.weight"].requires_grad_(False)
    frozen = weight.detach().clone()
    for m in alone:
        m[0].weight.requires_grad_(False)
    opt = vmapens.StackedAdam([p for p in ens.parameters() if p.requires_grad], lr=0.1)
    opts = [torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=0.1) for m in alone]
    step = vmapens.make_step(ens, nn.MSELoss(), opt, compile=compile)
    batches = _batches(4)
    for k, (x, y) in enumerate(batches):
        if k == 2:
            opt.add_param_group({"params": [weight.requires_grad_(True)], "lr": 0.05})
            for m, o in zip(alone, opts, strict=True):
                o.add_param_group({"params": [m[0].weight.requires_grad_(True)], "lr": 0.05})
        step(x, y)
        for m, o in zip(alone, opts, strict=True):
            train_alone(m, [(x, y)], make_opt=o)
    assert_members_equal(ens, alone)
    assert not torch.equal(weight, frozen)  # not vacuous: the unfrozen layer trained
