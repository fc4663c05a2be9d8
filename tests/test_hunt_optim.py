"""The stacked optimizers as torch users call them, each member against torch alone.

Complex parameters (torch's elementwise optimizers step them as pairs of real numbers),
Adadelta's weight decay in float32, numpy hyperparameters, ``step(closure)`` given
positionally, sparse gradients, torch's schedulers (OneCycleLR, CyclicLR,
CosineAnnealingWarmRestarts, ChainedScheduler, SequentialLR, SWALR, torch's ReduceLROnPlateau)
and a resume through ``torch.save`` with one of them attached. The truth is always plain
``torch.optim`` on each member alone (``tests/truth.py``'s naive loop, or the same gradients
fed to a torch optimizer per member).
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as sched
from torch.optim.swa_utils import SWALR
from truth import float64_batches, step_with_twins, train_alone

import vmapens
import vmapens.optim as vo

N = 3
# float64, a few steps: the same elementwise arithmetic as torch's loop; per-member scalars as
# float64 tensors instead of Python floats differ in the last bit or two.
TOL = dict(rtol=1e-12, atol=1e-12)
LRS = [0.01, 0.02, 0.03]
MASKS = [None, [1, 0, 1], None, [0, 1, 1], None, None]


def member_kwargs(kwargs: dict[str, Any], i: int) -> dict[str, Any]:
    """Member i's plain hyperparameters (lists picked, pairs picked element-wise)."""

    def pick(v: Any) -> Any:
        return v[i] if isinstance(v, list) else v

    return {k: tuple(map(pick, v)) if isinstance(v, tuple) else pick(v) for k, v in kwargs.items()}


def step_both(
    cls: type[vo.StackedOptimizer],
    kwargs: dict[str, Any],
    stacked: list[torch.Tensor],
    masks: list[Any],
    seed: int = 0,
) -> tuple[vo.StackedOptimizer, list[list[torch.Tensor]], list[torch.optim.Optimizer]]:
    """Step ``stacked`` with ``cls`` and a copy of each member with its torch twin, on the
    same random gradients; a masked member's twin does not step."""
    g = torch.Generator().manual_seed(seed)
    alone = [[p[i].detach().clone().requires_grad_() for p in stacked] for i in range(N)]
    opt = cls(stacked, **kwargs)
    assert cls.torch_class is not None
    twins = [cls.torch_class(leaves, **member_kwargs(kwargs, i)) for i, leaves in enumerate(alone)]
    for mask in masks:
        step_with_twins(opt, twins, g, stacked, alone, mask)
    return opt, alone, twins


# -- complex parameters ------------------------------------------------------------------------

# Every stacked optimizer whose torch twin takes complex parameters (all elementwise ones), with
# the options whose state or arithmetic a complex element changes: Adagrad's and Rprop's
# starting values fill both parts, as torch's `complex(v, v)`.
COMPLEX = {
    "Adam-fused": (vo.StackedAdam, {"lr": 0.01, "weight_decay": 0.1}),
    "Adam-amsgrad-maximize-unfused": (
        vo.StackedAdam,
        {"amsgrad": True, "maximize": True, "weight_decay": 0.1, "fused": False},
    ),
    "AdamW-per_member": (
        vo.StackedAdam,
        {"lr": LRS, "weight_decay": [0.0, 0.1, 0.2], "decoupled_weight_decay": True},
    ),
    "SGD-momentum": (vo.StackedSGD, {"lr": 0.1, "momentum": 0.9}),
    "SGD-per_member": (vo.StackedSGD, {"lr": LRS, "momentum": [0.0, 0.5, 0.9]}),
    "RMSprop-centered": (vo.StackedRMSprop, {"lr": LRS, "centered": True, "momentum": 0.5}),
    "Adagrad": (vo.StackedAdagrad, {"initial_accumulator_value": 0.2, "fused": False}),
    "Adagrad-per_member": (vo.StackedAdagrad, {"lr": LRS, "initial_accumulator_value": 0.2}),
    "Adamax": (vo.StackedAdamax, {"lr": LRS, "weight_decay": 0.1}),
    "NAdamW": (vo.StackedNAdam, {"lr": LRS, "decoupled_weight_decay": True, "weight_decay": 0.1}),
    "RAdam": (vo.StackedRAdam, {"lr": LRS, "betas": (0.5, 0.6)}),  # rectified from step 2
    "Adadelta": (vo.StackedAdadelta, {"lr": LRS, "weight_decay": 0.1}),
    "Rprop": (vo.StackedRprop, {"lr": 0.01}),
    "Rprop-per_member": (vo.StackedRprop, {"lr": LRS}),
    "ASGD": (vo.StackedASGD, {"lr": LRS, "t0": 2.0, "lambd": 0.1}),
}


@pytest.mark.parametrize(("cls", "kwargs"), list(COMPLEX.values()), ids=list(COMPLEX))
def test_complex_parameters_step_as_torchs_optimizers_step_them(
    cls: type[vo.StackedOptimizer], kwargs: dict[str, Any]
) -> None:
    # Bug: the rules ran on the complex tensors themselves: Adam's, RMSprop's, Adagrad's,
    # NAdam's and Adadelta's `g * g` squared the complex gradient (not |g|^2) and moved the
    # members far from torch's without an error; Adam's and SGD's fused kernels, Adamax and
    # Rprop raised. torch views complex tensors as real pairs.
    g = torch.Generator().manual_seed(1)
    stacked = [
        torch.randn(N, 4, 3, dtype=torch.complex128, generator=g).requires_grad_(),
        torch.randn(N, 5, dtype=torch.float64, generator=g).requires_grad_(),
    ]
    opt, alone, twins = step_both(cls, kwargs, stacked, MASKS)
    for i, twin in enumerate(twins):
        for k, (leaf, p) in enumerate(zip(alone[i], stacked, strict=True)):
            torch.testing.assert_close(p[i].detach(), leaf.detach(), **TOL, msg=f"{i}, {k}")
            for key, value in twin.state[leaf].items():
                got = opt.state[p][key][i]
                torch.testing.assert_close(got.to(value.dtype), value, **TOL, msg=f"{key} {i}")
    # the hand-off gives each member's complex state to torch, which continues it alone
    member = [leaf.detach().clone().requires_grad_() for leaf in alone[1]]
    twin = cls.torch_class(member, **member_kwargs(kwargs, 1))  # type: ignore[misc]
    twin.load_state_dict(opt.member_state_dict(1))
    for p, leaf in zip(stacked, member, strict=True):
        p.grad = torch.ones_like(p)
        leaf.grad = torch.ones_like(leaf)
    opt.step()
    twin.step()
    # torch's load_state_dict casts NAdam's float32 `mu_product` to the parameter's dtype, so
    # the loaded twin continues in another precision (docs/optim.md, "Differences from
    # torch.optim": ~1e-9 in the parameters).
    tol = dict(rtol=1e-9, atol=1e-9) if cls is vo.StackedNAdam else TOL
    for p, leaf in zip(stacked, member, strict=True):
        torch.testing.assert_close(p[1].detach(), leaf.detach(), **tol)


@pytest.mark.parametrize("cls", [vo.StackedAdafactor, vo.StackedMuon], ids=lambda c: c.__name__)
def test_complex_parameters_are_refused_where_the_update_reads_the_whole_shape(
    cls: type[vo.StackedOptimizer],
) -> None:
    # torch's Adafactor and Muon refuse them too; viewed as real pairs, a factored or
    # orthogonalised update would silently be another one.
    z = torch.zeros(N, 4, 3, dtype=torch.complex64, requires_grad=True)
    with pytest.raises(ValueError, match=rf"^{cls.__name__}: complex parameters are not supp"):
        cls([z])
    real = torch.zeros(N, 4, 3, requires_grad=True)
    opt = cls([real])
    with pytest.raises(ValueError, match="complex parameters are not supported"):
        opt.add_param_group({"params": [z]})
    assert len(opt.param_groups) == 1 and not opt.state


# -- Adadelta's weight decay ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"weight_decay": 0.1},
        {"weight_decay": 0.1, "maximize": True, "lr": 0.5},
        {"weight_decay": [0.0, 0.01, 0.5], "lr": [1.0, 0.5, 0.1]},
    ],
    ids=["shared", "maximize", "per_member"],
)
def test_adadelta_weight_decay_in_float32_is_torchs_bits(kwargs: dict[str, Any]) -> None:
    # Bug: `g + wd * p` was a product and a sum, each rounded; torch's `grad.add(p, alpha=wd)`
    # rounds once, so float32 members were ~1e-7 relative off torch's after a few steps.
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 3), (13,), (4, 5, 3)]  # no multiple of a vector width
    stacked = [torch.randn(N, *s, generator=g).requires_grad_() for s in shapes]
    opt, alone, twins = step_both(vo.StackedAdadelta, kwargs, stacked, [None] * 8)
    for i, twin in enumerate(twins):
        for k, (leaf, p) in enumerate(zip(alone[i], stacked, strict=True)):
            assert torch.equal(p[i].detach(), leaf.detach()), (i, k)
            for key in ("square_avg", "acc_delta"):
                assert torch.equal(opt.state[p][key][i], twin.state[leaf][key]), (i, k, key)


# -- what torch takes ---------------------------------------------------------------------------


def test_numpy_hyperparameters_are_taken_as_torch_takes_them() -> None:
    # Bug: `lr=np.float32(...)`, which torch's optimizers take, was refused ("must be a float
    # ... got float32"), as were np.int64, 0-d arrays, a sweep's `np.logspace(...)` and a
    # schedule of one's own writing np.float32 into `param_groups`.
    g = torch.Generator().manual_seed(0)
    p = torch.randn(N, 4, dtype=torch.float64, generator=g).requires_grad_()
    lrs = np.logspace(-2, -1, N, dtype=np.float32)
    opt = vo.StackedSGD([p], lr=lrs, momentum=np.float32(0.9), dampening=np.array(0.1))
    alone = [p[i].detach().clone().requires_grad_() for i in range(N)]
    twins = [
        torch.optim.SGD([a], lr=lrs[i], momentum=np.float32(0.9), dampening=np.array(0.1))
        for i, a in enumerate(alone)
    ]
    for k in range(4):
        if k == 2:  # a hand-written schedule
            opt.param_groups[0]["momentum"] = np.float32(0.5)
            for twin in twins:
                twin.param_groups[0]["momentum"] = np.float32(0.5)
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
        opt.step()
        for i, (a, twin) in enumerate(zip(alone, twins, strict=True)):
            a.grad = p.grad[i].clone()
            twin.step()
    for i, a in enumerate(alone):
        torch.testing.assert_close(p[i].detach(), a.detach(), **TOL)
    assert vo.StackedAdam([p], lr=np.int64(1)).param_groups[0]["lr"] == 1.0
    with pytest.raises(TypeError, match=r"StackedAdam: `lr` must be a float or a seq.*ndarray"):
        vo.StackedAdam([p], lr=np.ones((N, 1)))


def test_step_takes_a_closure_given_first_as_torchs() -> None:
    # Bug: `opt.step(closure)`, torch's documented call, raised "`mask` must be a bool tensor".
    torch.manual_seed(0)
    members = [nn.Linear(3, 1).double() for _ in range(N)]
    ens = vmapens.Ensemble.from_modules(copy.deepcopy(members))
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 1, dtype=torch.float64)
    opt = vo.StackedSGD(ens, lr=LRS, momentum=0.9)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        losses = ((ens(x) - y) ** 2).mean(dim=(1, 2))
        losses.sum().backward()
        return losses.detach()

    losses = [opt.step(closure) for _ in range(3)]
    for i, m in enumerate(members):
        twin = torch.optim.SGD(m.parameters(), lr=LRS[i], momentum=0.9)

        def alone(m: nn.Module = m, twin: torch.optim.Optimizer = twin) -> torch.Tensor:
            twin.zero_grad()
            loss = nn.functional.mse_loss(m(x), y)
            loss.backward()
            return loss

        for k in range(3):
            torch.testing.assert_close(losses[k][i], twin.step(alone).detach(), **TOL)
        torch.testing.assert_close(ens[i].weight, m.weight, **TOL)


def test_a_sparse_gradient_is_refused_by_name_and_nothing_steps() -> None:
    # Bug: "unsupported memory format option Contiguous" from inside the update.
    for cls in (vo.StackedSGD, vo.StackedAdam, vo.StackedAdagrad, vo.StackedRprop):
        dense = torch.zeros(N, 2, requires_grad=True)
        sparse = torch.zeros(N, 2, requires_grad=True)
        opt = cls([dense, sparse])
        dense.grad = torch.ones(N, 2)
        sparse.grad = torch.eye(N, 2).to_sparse()
        with pytest.raises(TypeError, match=rf"^{cls.__name__}.step: the gradient of parameter 1"):
            opt.step()
        assert not dense.detach().any() and not sparse.detach().any(), cls
        sparse.grad = sparse.grad.to_dense()  # the way out the message gives
        opt.step()
        assert dense.detach().all(), cls


def test_torchs_plateau_scheduler_on_per_member_lrs_names_the_per_member_one() -> None:
    # Bug: Python's "float() argument must be a string or a real number, not 'MemberValues'".
    p = torch.zeros(N, 2, requires_grad=True)
    opt = vo.StackedAdam([p], lr=LRS)
    plateau = sched.ReduceLROnPlateau(opt, patience=0)
    plateau.step(1.0)
    with pytest.raises(TypeError, match=r"^MemberValues: 3 values.*vmapens.optim.ReduceLROnPl"):
        plateau.step(2.0)
    assert opt.param_groups[0]["lr"] == vo.MemberValues(LRS)


@pytest.mark.parametrize(
    ("metrics", "error", "match"),
    [
        (1.0, TypeError, r"needs one value per member \(3 values\), got float"),
        (torch.tensor(1.0), ValueError, r"needs one value per member, shape \[3\], got shape \[\]"),
        (torch.ones(N, 1), ValueError, r"needs one .* got shape \[3, 1\]"),
        (["a", "b", "c"], TypeError, "must hold numbers"),
        ([1.0, 2.0], ValueError, "needs 3 values, got 2"),
    ],
    ids=["float", "0-d", "column", "strings", "short"],
)
def test_per_member_plateau_refuses_metrics_that_are_not_one_per_member(
    metrics: Any, error: type[Exception], match: str
) -> None:
    # Bug: a scalar (torch's plateau takes one) gave "'float' object is not iterable".
    opt = vo.StackedAdam([torch.zeros(N, 2, requires_grad=True)], lr=LRS)
    plateau = vo.ReduceLROnPlateau(opt, patience=0)
    with pytest.raises(error, match=r"^ReduceLROnPlateau.step: `metrics` " + match):
        plateau.step(metrics)
    assert plateau.last_epoch == 0 and plateau.num_bad_epochs == [0] * N
    plateau.step(np.array([1.0, 2.0, 3.0]))  # numpy, one per member
    assert plateau.last_epoch == 1


# -- torch's schedulers, and a resume with one ------------------------------------------------

Make = Callable[[torch.optim.Optimizer], Any]
SCHEDULERS: dict[str, tuple[type[vo.StackedOptimizer], dict[str, Any], Make]] = {
    "OneCycleLR-Adam": (
        vo.StackedAdam,
        {"betas": (0.9, [0.99, 0.999, 0.95])},
        lambda o: sched.OneCycleLR(o, max_lr=0.05, total_steps=8),
    ),
    "OneCycleLR-RMSprop-three_phase": (
        vo.StackedRMSprop,
        {"momentum": 0.9},
        lambda o: sched.OneCycleLR(o, max_lr=0.05, total_steps=8, three_phase=True),
    ),
    "CyclicLR-SGD": (
        vo.StackedSGD,
        {"momentum": 0.9},
        lambda o: sched.CyclicLR(o, 0.01, 0.1, step_size_up=2, mode="triangular2"),
    ),
    "CosineAnnealingWarmRestarts-NAdam": (
        vo.StackedNAdam,
        {},
        lambda o: sched.CosineAnnealingWarmRestarts(o, T_0=2, T_mult=2, eta_min=1e-4),
    ),
    "ChainedScheduler-Adamax": (
        vo.StackedAdamax,
        {},
        lambda o: sched.ChainedScheduler([sched.ExponentialLR(o, 0.9), sched.StepLR(o, 2, 0.5)]),
    ),
    "SequentialLR-Adagrad": (
        vo.StackedAdagrad,
        {},
        lambda o: sched.SequentialLR(
            o, [sched.LinearLR(o, 0.1, 1.0, 3), sched.CosineAnnealingLR(o, 5)], milestones=[3]
        ),
    ),
    "SWALR-SGD": (vo.StackedSGD, {"momentum": 0.5}, lambda o: SWALR(o, 0.005, anneal_epochs=3)),
    "ReduceLROnPlateau-shared_lr-RAdam": (
        vo.StackedRAdam,
        {"lr": 0.02},
        lambda o: sched.ReduceLROnPlateau(o, patience=0, factor=0.5),
    ),
}
# torch's plateau scheduler reads one metric: the same made-up series for every member.
PLATEAU_METRICS = [1.0, 0.5, 0.6, 0.7, 0.4, 0.4, 0.5, 0.5]


@pytest.mark.parametrize(("cls", "kwargs", "make"), list(SCHEDULERS.values()), ids=list(SCHEDULERS))
def test_torch_schedulers_give_each_member_its_own_schedule(
    cls: type[vo.StackedOptimizer], kwargs: dict[str, Any], make: Make
) -> None:
    kwargs = {"lr": LRS, **kwargs}
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double() for _ in "abc"]
    ens = vmapens.Ensemble.from_modules(copy.deepcopy(members))
    data = float64_batches(8, 6, 3, 2)
    opt = cls(ens, **kwargs)
    scheduler = make(opt)
    plateau = isinstance(scheduler, sched.ReduceLROnPlateau)
    for k, (x, y) in enumerate(data):
        opt.zero_grad()
        ((ens(x) - y) ** 2).mean(dim=(1, 2)).sum().backward()
        opt.step()
        scheduler.step(PLATEAU_METRICS[k]) if plateau else scheduler.step()
    for i, m in enumerate(members):
        assert cls.torch_class is not None
        twin = cls.torch_class(m.parameters(), **member_kwargs(kwargs, i))
        theirs = make(twin)

        def step(k: int, s: Any = theirs) -> None:
            s.step(PLATEAU_METRICS[k]) if plateau else s.step()

        train_alone(m, data, nn.functional.mse_loss, twin, after_step=step)
        for name, p in m.named_parameters():
            torch.testing.assert_close(ens[i].get_parameter(name), p, **TOL, msg=f"{i} {name}")
        lr = opt.param_groups[0]["lr"]
        assert (lr[i] if isinstance(lr, vo.MemberValues) else lr) == twin.param_groups[0]["lr"]


def _saved(obj: Any) -> Any:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_a_resume_with_a_one_cycle_schedule_through_torch_save_is_exact() -> None:
    kwargs = {"lr": LRS, "betas": (0.9, [0.99, 0.999, 0.95])}

    def build(ens: vmapens.Ensemble) -> tuple[vo.StackedAdam, Any]:
        opt = vo.StackedAdam(ens, **kwargs)  # type: ignore[arg-type]
        max_lr = vo.MemberValues([0.05, 0.1, 0.2])  # one peak per member
        return opt, sched.OneCycleLR(opt, max_lr=max_lr, total_steps=8)  # type: ignore[arg-type]

    data = float64_batches(8, 6, 3, 2)
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 2), n=N, seed=0).double()
    resumed = copy.deepcopy(ens)
    runs = []
    for model, stop in ((ens, None), (resumed, 4)):
        opt, scheduler = build(model)
        for k, (x, y) in enumerate(data):
            if k == stop:
                saved = _saved({"opt": opt.state_dict(), "sched": scheduler.state_dict()})
                opt, scheduler = build(model)
                opt.load_state_dict(saved["opt"])
                scheduler.load_state_dict(saved["sched"])
            opt.zero_grad()
            ((model(x) - y) ** 2).mean(dim=(1, 2)).sum().backward()
            opt.step()
            scheduler.step()
        runs.append(opt)
    for a, b in zip(ens.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    assert runs[0].param_groups[0]["lr"] == runs[1].param_groups[0]["lr"]
    assert runs[0].param_groups[0]["betas"] == runs[1].param_groups[0]["betas"]


def test_member_state_dict_takes_integer_indices_only() -> None:
    # Bug: `member_state_dict(1.0)` raised "tuple indices must be integers" from inside, and
    # `member_state_dict(True)` handed off member 1.
    opt = vo.StackedAdam([torch.zeros(N, 2, requires_grad=True)], lr=LRS)
    for bad in (1.0, True):
        with pytest.raises(TypeError, match=r"^StackedAdam.member_state_dict: `i` must be an int"):
            opt.member_state_dict(bad)  # type: ignore[arg-type]
    for i in (np.int64(1), torch.tensor(1), -2):
        assert opt.member_state_dict(i)["param_groups"][0]["lr"] == LRS[1]  # type: ignore[arg-type]


def test_apply_gradients_takes_any_iterable_of_gradients() -> None:
    # Bug: a generator of gradients raised "object of type 'generator' has no len()".
    p = torch.zeros(N, 2, requires_grad=True)
    opt = vo.StackedSGD([p], lr=LRS)
    opt.apply_gradients(torch.ones_like(t) for t in [p])  # type: ignore[arg-type]
    torch.testing.assert_close(p.detach(), -torch.tensor(LRS)[:, None].expand(N, 2))


@pytest.mark.parametrize("built", ["before", "after"])
def test_adagrad_and_double_as_docs_semantics_says(built: str) -> None:
    # docs/semantics.md, "What differs": torch's Adagrad makes its `sum` when built, and
    # `.double()` leaves it float32; the stacked one makes it at the first step, in float64.
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)) for _ in range(N)]
    ens = vmapens.Ensemble.from_modules(copy.deepcopy(members))
    kwargs = {"lr": 0.05, "initial_accumulator_value": 0.1}

    def build() -> tuple[vo.StackedAdagrad, list[torch.optim.Optimizer]]:
        twins = [torch.optim.Adagrad(m.parameters(), **kwargs) for m in members]
        return vo.StackedAdagrad(ens, **kwargs), twins  # type: ignore[arg-type]

    if built == "before":
        opt, twins = build()
    ens.double()
    for m in members:
        m.double()
    if built == "after":
        opt, twins = build()
    data = float64_batches(20, 5, 3, 2)
    for x, y in data:
        opt.zero_grad()
        ((ens(x) - y) ** 2).mean(dim=(1, 2)).sum().backward()
        opt.step()
    for m, twin in zip(members, twins, strict=True):
        train_alone(m, data, nn.functional.mse_loss, twin)
    sums = twins[0].state[members[0][0].weight]["sum"]
    assert sums.dtype == (torch.float32 if built == "before" else torch.float64)
    # documented: ~8e-9 with these settings when built before
    tol = dict(rtol=0.0, atol=1e-7) if built == "before" else TOL
    for i, m in enumerate(members):
        for name, p in m.named_parameters():
            torch.testing.assert_close(ens[i].get_parameter(name), p, **tol, msg=f"{i} {name}")


@pytest.mark.parametrize(
    "cls", [vo.StackedAdam, vo.StackedAdamax, vo.StackedNAdam, vo.StackedRAdam]
)
def test_tensor_betas_are_read_as_floats_as_docs_semantics_says(
    cls: type[vo.StackedOptimizer],
) -> None:
    # docs/semantics.md, "What differs": a member equals torch given the betas' float values;
    # torch given the float32 tensors computes its bias corrections in float32 (~1e-6 apart).
    betas = (torch.tensor(0.9), torch.tensor(0.999))
    g = torch.Generator().manual_seed(0)
    p = torch.randn(N, 5, dtype=torch.float64, generator=g).requires_grad_()
    start = p.detach().clone()
    _, tensors, _ = step_both(cls, {"lr": 0.01, "betas": betas}, [p], [None] * 10)
    as_floats = {"lr": 0.01, "betas": tuple(float(b) for b in betas)}
    _, floats, _ = step_both(cls, as_floats, [start.requires_grad_()], [None] * 10)
    for i in range(N):
        torch.testing.assert_close(p[i].detach(), floats[i][0].detach(), **TOL)
        # torch given the tensors: its float32 bias corrections, measured up to 1.3e-6
        torch.testing.assert_close(p[i].detach(), tensors[i][0].detach(), rtol=1e-5, atol=0.0)
