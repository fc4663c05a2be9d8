"""The self-check (issue 18): member 0 run alone against member 0 inside the ensemble.

The probe must catch forwards that compute something else under vmap (and leave the
ensemble, its optimizer and the RNG as they were), stay silent on every module the suite
trains against plain PyTorch, and cost one member's step on the first call only. The fixes
that come with it are checked against members trained alone: nn.LinearCrossEntropyLoss on
every path, torch.autograd.grad inside the forward with backend="loop", hooks on the template.
"""

from __future__ import annotations

import copy
import warnings

import models
import pytest
import test_real_models
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from truth import TOL64, adam, assert_members_equal, train_alone

import vmapens
from vmapens._data import warn_stacked_data
from vmapens.selfcheck import MEMBER, TRIES

N = 3
ROWS = 8


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


# -- modules that compute something else under vmap ------------------------------------------


class RequiresGradBranch(nn.Module):
    """Scales its output by 2 when its weight requires grad (it reads False under vmap)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * (2.0 if self.fc.weight.requires_grad else 1.0)


class GradModeBranch(nn.Module):
    """Branches as F.linear_cross_entropy does: `is_grad_enabled() and w.requires_grad`."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and self.fc.weight.requires_grad:
            return self.fc(x)
        return self.fc(x).detach()  # no gradient when nobody asks for one


class BiasGradBranch(nn.Module):
    """As GradModeBranch, for the bias only (as the chunked F.linear_cross_entropy's flags
    did under vmap before vmapens read them as alone)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.fc.bias if self.fc.bias.requires_grad else self.fc.bias.detach()
        return F.linear(x, self.fc.weight, bias)


class GradModeOnly(nn.Module):
    """Branches on torch.is_grad_enabled() alone, which reads True in the step either way."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * (3.0 if torch.is_grad_enabled() else 1.0)


class EditsData(nn.Module):
    """Clips its weight through .data in the forward (weight clipping, as in WGAN critics)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.fc.weight.data.clamp_(-0.2, 0.2)
        return self.fc(x)


class CountsWhenTrained(nn.Module):
    """Updates a buffer only when its weight requires grad."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fc.weight.requires_grad:
            self.count += 1
        return self.fc(x)


def chunked_lce(reduction: str = "mean") -> nn.Module:
    return nn.LinearCrossEntropyLoss(
        4, 5, bias=True, reduction=reduction, options=nn.LinearCrossEntropyOptions()
    )


def _undo_lce_fix(ens: vmapens.Ensemble) -> vmapens.Ensemble:
    """The ensemble as before the fix: the runner keeps the chunked path (vmap drops grads)."""
    for module in ens.runner.modules():
        if isinstance(module, nn.LinearCrossEntropyLoss):
            module.options = nn.LinearCrossEntropyOptions()
    return ens


def _lce_batch() -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    return (_x(ROWS, 4), torch.randint(0, 5, (ROWS,))), torch.zeros(ROWS, dtype=torch.float64)


def _is_loss(out: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
    return out


# case: (id, build the ensemble, batch, loss_fn, message regex)
CAUGHT = [
    ("bias-grad-branch", lambda: vmapens.Ensemble(BiasGradBranch, N, seed=0).double(),
     lambda: (_x(ROWS, 4), _x(ROWS, 1)), nn.MSELoss(), r"`fc\.bias` gets no gradient inside"),
    ("requires-grad-branch", lambda: vmapens.Ensemble(RequiresGradBranch, N, seed=0).double(),
     lambda: (_x(ROWS, 4), _x(ROWS, 1)), nn.MSELoss(), r"the output differs by"),
    ("grad-mode-branch", lambda: vmapens.Ensemble(GradModeBranch, N, seed=0).double(),
     lambda: (_x(ROWS, 4), _x(ROWS, 1)), nn.MSELoss(), r"`fc\.weight` gets no gradient"),
    ("buffer-when-trained", lambda: vmapens.Ensemble(CountsWhenTrained, N, seed=0).double(),
     lambda: (_x(ROWS, 4), _x(ROWS, 1)), nn.MSELoss(), r"`count` after the forward differs"),
    ("edits-data", lambda: vmapens.Ensemble(EditsData, N, seed=0).double(),
     lambda: (_x(ROWS, 4), _x(ROWS, 1)), nn.MSELoss(),
     r"EditsData reads `\.data`.*torch\.no_grad\(\).*backend='loop'"),
]  # fmt: skip


def _snapshot(ens: vmapens.Ensemble, opt: torch.optim.Optimizer) -> tuple:
    return copy.deepcopy(ens.state_dict()), copy.deepcopy(opt.state_dict())


@pytest.mark.parametrize(
    "build,batch,loss_fn,match", [c[1:] for c in CAUGHT], ids=[c[0] for c in CAUGHT]
)
def test_first_step_catches_a_forward_that_differs_under_vmap(build, batch, loss_fn, match):
    ens = build()
    opt = vmapens.StackedSGD(ens, lr=0.1, momentum=0.9)
    inputs, targets = batch()
    before = _snapshot(ens, opt)
    rng = torch.get_rng_state()
    step = vmapens.make_step(ens, loss_fn, opt)
    with pytest.raises(RuntimeError, match=match) as err:
        step(inputs, targets)
    assert type(ens.template).__name__ in str(err.value) and "backend='loop'" in str(err.value)
    after = _snapshot(ens, opt)
    torch.testing.assert_close(after, before, rtol=0, atol=0)  # nothing changed
    assert all(p.grad is None for p in ens.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    with pytest.raises(RuntimeError, match=match):  # and on demand
        vmapens.check(ens, inputs, targets, loss_fn)


class ClipsUnderNoGrad(EditsData):
    """EditsData written the way its refusal names: the edit under torch.no_grad()."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.fc.weight.clamp_(-0.2, 0.2)
        return self.fc(x)


def test_without_the_check_the_same_step_is_silently_wrong():
    # What the probe guards against: the step runs, and the members end elsewhere than alone.
    ens = vmapens.Ensemble(RequiresGradBranch, N, seed=0).double()
    alone = ens.unstack()
    x, y = _x(ROWS, 4), _x(ROWS, 1)
    vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1), check=False)(x, y)
    for m in alone:
        train_alone(m, [(x, y)], make_opt=lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    with pytest.raises(AssertionError):
        assert_members_equal(ens, alone)


def test_the_compiled_step_is_probed_before_its_first_compiled_call():
    # torch.compile traces the parameters as the eager member map sees them (requires_grad
    # False): without the probe this compiled step is as wrong as the eager one.
    ens = vmapens.Ensemble(RequiresGradBranch, N, seed=0).double()
    opt = vmapens.StackedAdam(ens)
    before = _snapshot(ens, opt)
    step = vmapens.make_step(ens, nn.MSELoss(), opt, compile=True)
    with pytest.raises(RuntimeError, match=r"^step: member 0 of RequiresGradBranch computes"):
        step(_x(ROWS, 4), _x(ROWS, 1))
    torch.testing.assert_close(_snapshot(ens, opt), before, rtol=0, atol=0)


# -- silent where the ensemble is exact ------------------------------------------------------


def _batch_for(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    if name in ("TokenModel", "Tied"):
        return torch.randint(0, 10, (ROWS, 5)), _x(ROWS, 3)
    if name == "CNN":
        return _x(ROWS, 1, 6, 6), _x(ROWS, 3)
    if name == "Encoder":
        return _x(ROWS, 5, 8), _x(ROWS, 3)
    if name in test_real_models.MODELS or name in test_real_models.COMPILED_MODELS:
        wide = "attention" in name or "encoder" in name
        return _x(5, 3, 8 if wide else 4), _x(5, 2)
    return _x(ROWS, 4), _x(ROWS, 3)


def _dropout_bn() -> nn.Module:
    # Dropout and BatchNorm: both runs must draw the same masks and update the same statistics.
    return nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.Dropout(0.3), nn.Linear(16, 3))


SILENT = {
    "MLP": models.MLP,
    "CNN": models.CNN,
    "TokenModel": models.TokenModel,
    "Tied": models.Tied,
    "Awkward": models.Awkward,
    "Encoder": models.Encoder,
    "dropout-batchnorm": _dropout_bn,
    "grad-mode-only": GradModeOnly,
    **test_real_models.MODELS,
    **test_real_models.COMPILED_MODELS,
}


@pytest.mark.parametrize("name", SILENT)
def test_probe_is_silent_on_the_suites_modules(name):
    # The compiled step runs the same probe: tests/test_real_models.py's compiled cases and
    # tests/test_step.py train with it on (check=True is the default).
    ens = vmapens.Ensemble(SILENT[name], N, seed=0).double()
    before = copy.deepcopy(ens.state_dict())
    x, y = _batch_for(name)
    vmapens.check(ens, x, y, nn.MSELoss())
    torch.testing.assert_close(ens.state_dict(), before, rtol=0, atol=0)


def test_probe_is_silent_on_per_member_data_and_under_bf16():
    ens = vmapens.Ensemble(models.MLP, N, seed=0).double()
    x, y = _x(N, ROWS, 4), _x(N, ROWS, 3)
    vmapens.check(ens, x, y, nn.MSELoss(), in_dims=0)
    ens32 = vmapens.Ensemble(models.MLP, N, seed=0)
    vmapens.check(ens32, x.float(), y.float(), nn.MSELoss(), autocast=torch.bfloat16)


def test_grad_mode_branch_alone_is_exact_in_the_ensemble():
    # torch.is_grad_enabled() reads True inside the eager step's vmap as alone: nothing to catch.
    ens = vmapens.Ensemble(GradModeOnly, N, seed=0).double()
    alone = ens.unstack()
    batches = [(_x(ROWS, 4), _x(ROWS, 3)) for _ in range(2)]
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-2))
    for x, y in batches:
        step(x, y)
    for m in alone:
        train_alone(m, batches, nn.functional.mse_loss)
    assert_members_equal(ens, alone)


# -- the probe's cost and side effects -------------------------------------------------------


class Counting(models.MLP):
    calls: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Counting.calls.append(1)
        return super().forward(x)


@pytest.mark.parametrize("check,first", [(True, 4), (False, 1)])
def test_probe_runs_once_per_step_object(check, first):
    # With the check: member alone, once more for the generators it draws from (under no_grad,
    # _generator_draws), member in the ensemble, the step itself; then 1 a call.
    ens = vmapens.Ensemble(Counting, N, seed=0).double()
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens), check=check)
    x, y = _x(ROWS, 4), _x(ROWS, 3)
    Counting.calls.clear()
    step(x, y)
    assert len(Counting.calls) == first
    step(x, y)
    assert len(Counting.calls) == first + 1


def test_a_batch_member_0_cannot_run_gets_the_steps_own_error_and_the_probe_waits():
    ens = vmapens.Ensemble(Counting, N, seed=0).double()
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens))
    for _ in range(TRIES - 1):
        with pytest.raises(RuntimeError, match=r"^step: member 0 run alone raises this too"):
            step(_x(ROWS, 5), _x(ROWS, 3))
    Counting.calls.clear()
    step(_x(ROWS, 4), _x(ROWS, 3))
    assert len(Counting.calls) == 4  # still probed on the first good batch


def test_probe_leaves_training_as_without_it():
    # Dropout draws from the global RNG: the probe forks it, so both runs draw the same masks.
    a = vmapens.Ensemble(_dropout_bn, N, seed=0).double()
    b = copy.deepcopy(a)
    batches = [(_x(ROWS, 4), _x(ROWS, 3)) for _ in range(2)]
    for ens, check in ((a, True), (b, False)):
        torch.manual_seed(5)
        step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens), check=check)
        for x, y in batches:
            step(x, y)
    torch.testing.assert_close(a.state_dict(), b.state_dict(), rtol=0, atol=0)


def test_check_argument_errors():
    ens = vmapens.Ensemble(models.MLP, N, seed=0)
    x, y = torch.randn(ROWS, 4), torch.randn(ROWS, 3)
    with pytest.raises(TypeError, match=r"^check: `ens` must be a vmapens.Ensemble"):
        vmapens.check(models.MLP(), x, y, nn.MSELoss())
    with pytest.raises(ValueError, match=r"^check: `in_dims` must be None or 0, got 1"):
        vmapens.check(ens, x, y, nn.MSELoss(), in_dims=1)
    with pytest.raises(ValueError, match=r"^check: member 0 of MLP fails when run alone"):
        vmapens.check(ens, torch.randn(ROWS, 5), y, nn.MSELoss())
    with pytest.raises(TypeError, match=r"^make_step: `check` must be a bool, got str"):
        vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens), check="yes")
    assert MEMBER == 0


# -- nn.LinearCrossEntropyLoss: exact on every path ------------------------------------------

LCE_CASES = [
    (reduction, chunked, bias)
    for reduction in ("mean", "sum", "none")
    for chunked in (True, False)
    for bias in (True, False)
]


def _lce_alone(module: nn.Module, batches: list, reduction: str) -> None:
    opt = torch.optim.SGD(module.parameters(), lr=0.5, momentum=0.9)
    for (x, t), _ in batches:
        opt.zero_grad()
        out = module(x, t)
        (out.mean() if reduction == "none" else out).backward()
        opt.step()


@pytest.mark.parametrize("backend", ["vmap", "loop"])
@pytest.mark.parametrize("reduction,chunked,bias", LCE_CASES)
def test_linear_cross_entropy_trains_as_alone(reduction, chunked, bias, backend):
    options = nn.LinearCrossEntropyOptions() if chunked else None

    def make() -> nn.Module:
        return nn.LinearCrossEntropyLoss(4, 5, bias=bias, reduction=reduction, options=options)

    ens = vmapens.Ensemble(make, N, seed=0, backend=backend).double()
    alone = ens.unstack()
    assert all(m.options == options for m in alone)  # the user's module keeps its options
    _train_both_and_compare(ens, alone, reduction)


def _train_both_and_compare(ens: vmapens.Ensemble, alone: list, reduction: str) -> None:
    """Three SGD steps of the ensemble and of each member alone, on the same batches."""
    batches = [_lce_batch() for _ in range(3)]
    loss = (lambda o, _: o.mean()) if reduction == "none" else _is_loss
    step = vmapens.make_step(ens, loss, vmapens.StackedSGD(ens, lr=0.5, momentum=0.9))
    for inputs, targets in batches:
        step(inputs, targets)
    for m in alone:
        _lce_alone(m, batches, reduction)
    assert_members_equal(ens, alone, **TOL64)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_chunked_linear_cross_entropy_in_the_runner_trains_as_alone(reduction):
    # The runner runs the module's reference path (unchunked); its chunked path, which the
    # functional F.linear_cross_entropy(options=...) takes, gave no gradient under vmap until
    # vmapens read the op's requires-grad flags as alone (vmapens/_fixed_rules.py).
    ens = _undo_lce_fix(vmapens.Ensemble(lambda: chunked_lce(reduction), N, seed=0).double())
    _train_both_and_compare(ens, ens.unstack(), reduction)


def test_linear_cross_entropy_trains_as_alone_compiled():
    ens = vmapens.Ensemble(chunked_lce, N, seed=0).double()
    alone = ens.unstack()
    batches = [_lce_batch() for _ in range(2)]
    step = vmapens.make_step(ens, _is_loss, vmapens.StackedSGD(ens, lr=0.5), compile=True)
    for inputs, targets in batches:
        step(inputs, targets)
    for m in alone:
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        for (x, t), _ in batches:
            opt.zero_grad()
            m(x, t).backward()
            opt.step()
    # The compiled graph may reorder float64 arithmetic (as tests/test_step.py allows).
    assert_members_equal(ens, alone, rtol=1e-9, atol=1e-11)


# -- activation checkpointing and torch.autograd.grad inside the forward ---------------------


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(checkpoint(lambda t: torch.tanh(self.a(t)), x, use_reentrant=False))


class Physics(nn.Module):
    """A physics-informed network: its output includes du/dx, from torch.autograd.grad."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(2, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = self.b(torch.tanh(self.a(x)))
        (du,) = torch.autograd.grad(u.sum(), x, create_graph=True)
        return torch.cat([u, du], dim=-1)


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("backend", ["vmap", "loop"])
def test_activation_checkpointing_is_refused_with_the_reason(backend, check):
    ens = vmapens.Ensemble(Checkpointed, N, seed=0, backend=backend).double()
    opt = vmapens.StackedAdam(ens)
    before = _snapshot(ens, opt)
    step = vmapens.make_step(ens, nn.MSELoss(), opt, check=check)
    with pytest.raises(
        RuntimeError,
        match=r"^step: the forward of Checkpointed uses torch\.utils\.checkpoint.*directly",
    ):
        step(_x(ROWS, 4), _x(ROWS, 1))
    torch.testing.assert_close(_snapshot(ens, opt), before, rtol=0, atol=0)


@pytest.mark.parametrize("check", [True, False])
def test_autograd_grad_in_the_forward_points_to_the_loop_backend(check):
    ens = vmapens.Ensemble(Physics, N, seed=0).double()
    opt = vmapens.StackedAdam(ens)
    before = _snapshot(ens, opt)
    step = vmapens.make_step(ens, nn.MSELoss(), opt, check=check)
    x = _x(ROWS, 2).requires_grad_()
    with pytest.raises(
        RuntimeError,
        match=r"^step: the forward of Physics calls torch\.autograd\.grad.*backend='loop'",
    ):
        step(x, _x(ROWS, 3))
    torch.testing.assert_close(_snapshot(ens, opt), before, rtol=0, atol=0)


def test_autograd_grad_in_the_forward_trains_as_alone_with_the_loop_backend():
    ens = vmapens.Ensemble(Physics, N, seed=0, backend="loop").double()
    alone = ens.unstack()
    batches = [(_x(ROWS, 2).requires_grad_(), _x(ROWS, 3)) for _ in range(3)]
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-2))
    for x, y in batches:
        step(x, y)
    for m in alone:
        train_alone(m, batches, nn.functional.mse_loss)
    assert_members_equal(ens, alone)


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")  # clamp_'s rule
@pytest.mark.parametrize(
    "module, backend",
    [(EditsData, "loop"), (ClipsUnderNoGrad, "vmap")],
    ids=["data-edit-loop", "no-grad-edit-vmap"],
)
def test_the_ways_out_of_a_data_edit_train_as_alone(module: type, backend: str):
    # The two the refusal names: the loop backend, or the edit under torch.no_grad().
    ens = vmapens.Ensemble(module, N, seed=0, backend=backend).double()
    alone = ens.unstack()
    batches = [(_x(ROWS, 4), _x(ROWS, 1)) for _ in range(3)]
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=0.1))
    for x, y in batches:
        step(x, y)
    for m in alone:
        train_alone(m, batches, nn.functional.mse_loss, adam(lr=0.1))
    assert_members_equal(ens, alone)


# -- hooks on the template -------------------------------------------------------------------


def test_hooks_on_the_template_are_refused_under_vmap():
    ens = vmapens.Ensemble(models.MLP, N, seed=0)
    ens.template.fc1.register_forward_hook(lambda m, i, o: None)
    with pytest.raises(
        RuntimeError,
        match=r"^Ensemble: `ens\.template\.fc1` has a forward hook.*backend='loop'.*ens\[0\]",
    ):
        ens(torch.randn(ROWS, 4))
    with pytest.raises(RuntimeError, match=r"`ens\.template\.fc1` has a forward hook"):
        vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens))(
            torch.randn(ROWS, 4), torch.randn(ROWS, 3)
        )


def test_hooks_on_the_template_fire_per_member_with_the_loop_backend():
    ens = vmapens.Ensemble(models.MLP, N, seed=0, backend="loop").double()
    alone = ens.unstack()  # before the hook: ens[i] copies the template, hooks included
    seen: list[torch.Tensor] = []
    ens.template.fc1.register_forward_hook(lambda m, i, o: seen.append(o.detach()))
    x = _x(ROWS, 4)
    ens(x)
    assert len(seen) == N
    for got, m in zip(seen, alone, strict=True):
        torch.testing.assert_close(got, m.fc1(x), rtol=0, atol=0)


class HookedAtBuild(models.MLP):
    """Registers its own hook in __init__: it is part of every member, batched as well."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1.register_forward_hook(lambda m, i, o: o * 2)


def test_hooks_the_module_brings_still_run_batched():
    ens = vmapens.Ensemble(HookedAtBuild, N, seed=0).double()
    x = _x(ROWS, 4)
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in ens.unstack()]), **TOL64)


# -- per-member data without in_dims ---------------------------------------------------------

STACKED = [
    # (id, x shape, y shape, warns)
    ("stacked", (N, ROWS, 4), (N, ROWS, 1), True),
    ("stacked-images", (N, ROWS, 1, 6, 6), (N, ROWS, 3), True),
    ("shared", (ROWS, 4), (ROWS, 1), False),
    ("shared-n-samples-other-width", (N, 4), (N, 1), False),
    ("shared-1d-targets", (N, 4), (N,), False),
]


@pytest.mark.parametrize(
    "x_shape,y_shape,warns", [c[1:] for c in STACKED], ids=[c[0] for c in STACKED]
)
def test_stacked_data_without_in_dims_warns(x_shape, y_shape, warns):
    data = (torch.randn(*x_shape), torch.randn(*y_shape))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_stacked_data("fit", data, N, None)
        warn_stacked_data("fit", data, N, 0)  # with in_dims=0: what the user meant
    assert len(caught) == int(warns)
    if warns:
        assert str(caught[0].message).startswith("fit: `data`") and "in_dims=0" in str(
            caught[0].message
        )


def test_fit_warns_on_stacked_data_without_in_dims():
    ens = vmapens.Ensemble(lambda: nn.Linear(4, 1), N, seed=0)
    stacked = (torch.randn(N, ROWS, 4), torch.randn(N, ROWS, 1))
    with pytest.warns(UserWarning, match=r"^fit: `data` inputs .* pass in_dims=0"):
        vmapens.fit(ens, stacked, nn.MSELoss(), epochs=1, progress=False, seed=0)
    vmapens.fit(ens, stacked, nn.MSELoss(), epochs=1, in_dims=0, progress=False, seed=0)
