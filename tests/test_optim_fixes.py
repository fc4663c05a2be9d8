"""Stacked optimizers against their torch twins where they used to part: the twins' defaults,
a compiled step under a momentum schedule, Rprop's step-size bounds, tensor learning rates,
and state dicts that do not fit.

Truth: each member's own ``torch.optim`` optimizer, stepped alone on that member's gradients.
"""

from __future__ import annotations

import copy
from typing import Any

import models
import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler
from truth import assert_members_equal, float64_batches, train_alone, twins

import vmapens
import vmapens.optim as vo

N, STEPS = 4, 20
# float64: per-member scalars are float64 tensors where torch has Python floats, which may
# differ in the last bit of a double; 1e-12 is thousands of ulps of room.
TOL64 = dict(rtol=1e-12, atol=1e-12)
# A compiled graph may fuse and reorder float64 arithmetic (tests/test_step.py's tolerance).
COMPILED_TOL = dict(rtol=1e-9, atol=1e-11)

# -- every twin's defaults are its torch class's ---------------------------------------------

#: Options of a stacked twin that its torch class does not have (docs/optim.md).
EXTRAS = {torch.optim.Muon: {"newton_schulz"}}


@pytest.mark.parametrize("torch_class", list(vo.twins.TWINS), ids=lambda c: c.__name__)
def test_twin_defaults_are_the_torch_class_defaults(torch_class: type) -> None:
    # Muon takes matrices only: a [N, 3, 4] stack is a 3x4 matrix per member.
    ours = vo.stacked(torch_class)([torch.zeros(N, 3, 4, requires_grad=True)])
    theirs = torch_class([torch.zeros(3, 4, requires_grad=True)])
    extras = EXTRAS.get(torch_class, set())
    got = {k: v for k, v in ours.param_groups[0].items() if k != "params" and k not in extras}
    want = {k: v for k, v in theirs.param_groups[0].items() if k != "params"}
    assert got == want


def test_adamw_twin_takes_adamws_arguments_and_trains_as_adamw() -> None:
    # Positional as torch.optim.AdamW takes them: lr, betas, eps, weight_decay, amsgrad.
    args = (1e-2, (0.8, 0.9), 1e-6, 0.1, True)
    ours = vo.stacked(torch.optim.AdamW)([torch.zeros(N, 3, requires_grad=True)], *args)
    theirs = torch.optim.AdamW([torch.zeros(3, requires_grad=True)], *args)
    assert {k: v for k, v in ours.param_groups[0].items() if k != "params"} == {
        k: v for k, v in theirs.param_groups[0].items() if k != "params"
    }
    # Defaults: AdamW's weight decay of 1e-2 moves every member as torch.optim.AdamW does.
    ens = vmapens.Ensemble(models.MLP, N, seed=0).double()
    alone = twins(ens.unstack())
    opt = vo.stacked(torch.optim.AdamW)(ens, lr=0.05)
    batches = float64_batches(5, 6, 4, 3)
    for x, y in batches:
        opt.zero_grad()
        ((ens(x) - y) ** 2).mean(dim=(1, 2)).sum().backward()
        opt.step()
    for twin in alone:
        train_alone(
            twin, batches, nn.functional.mse_loss, torch.optim.AdamW(twin.parameters(), lr=0.05)
        )
    assert_members_equal(ens, alone, **TOL64)


# -- a compiled step under a schedule that changes momentum every step -----------------------

CYCLED = {
    "sgd": (
        lambda ens: vo.StackedSGD(ens, lr=0.05, momentum=0.9),
        lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
    ),
    "rmsprop": (
        lambda ens: vo.StackedRMSprop(ens, lr=0.01, momentum=0.9),
        lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01, momentum=0.9),
    ),
}


def _graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("name", list(CYCLED))
def test_compiled_step_follows_a_cycled_momentum_without_recompiling(name: str) -> None:
    """OneCycleLR cycles momentum every step (cycle_momentum): the compiled step compiles once
    (it recompiled at every value, and fullgraph failed at the 9th), and every member follows
    torch's SGD/RMSprop with the same schedule alone."""
    make, make_alone = CYCLED[name]
    ens = vmapens.Ensemble(models.MLP, N, seed=0).double()
    alone = twins(ens.unstack())
    opt = make(ens)
    sched = lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=12)
    step = vmapens.make_step(ens, nn.MSELoss(), opt, compile=True)
    batches = float64_batches(12, 6, 4, 3)
    momenta = []
    for k, (x, y) in enumerate(batches):
        momenta.append(opt.param_groups[0]["momentum"])
        step(x, y)
        sched.step()
        if k == 0:
            compiled = _graphs()
    # More values than dynamo's recompile limit (8): one graph per value would fail.
    assert len(set(momenta)) > 8, momenta
    assert _graphs() == compiled, "a new momentum recompiled the step"
    for twin in alone:
        member_opt = make_alone(twin)
        member_sched = lr_scheduler.OneCycleLR(member_opt, max_lr=0.1, total_steps=12)
        train_alone(twin, batches, nn.functional.mse_loss, member_opt,
                    after_step=lambda _, s=member_sched: s.step())  # fmt: skip
    assert_members_equal(ens, alone, **COMPILED_TOL)


# -- stacked tensors stepped from fixed gradients, and each member alone ----------------------


def _problem(
    dtype: torch.dtype, matrices: bool = False
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Stacked parameters (a vector's worth, odd tails, a 3-D one Adafactor factors; only
    matrices for Muon) and STEPS gradients for them."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(N, 7, 5), (N, 4, 9)] if matrices else [(N, 7, 5), (N, 5), (N, 17), (N, 3, 4, 6)]
    params = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
    grads = [[torch.randn(s, generator=gen, dtype=dtype) for s in shapes] for _ in range(STEPS)]
    return params, grads


def _member(kwargs: dict[str, Any], i: int) -> dict[str, Any]:
    """Member i's hyperparameters: lists picked, pairs picked element-wise."""

    def pick(v: Any) -> Any:
        return v[i] if isinstance(v, list) else v

    return {k: tuple(map(pick, v)) if isinstance(v, tuple) else pick(v) for k, v in kwargs.items()}


def _trained(
    torch_class: type,
    kwargs: dict[str, Any],
    dtype: torch.dtype,
    fills: dict[int, float] | None = None,
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]], torch.optim.Optimizer]:
    """The stacked twin's parameters after STEPS steps and each member's alone (torch's class
    with its own values). A tensor ``lr`` is copied for each optimizer and ``fill_``-ed with
    ``fills[k]`` before step k in all of them, as a scheduler fills it."""
    start, grads = _problem(dtype, matrices=torch_class is torch.optim.Muon)

    def run(make: Any, kw: dict[str, Any], params: list[torch.Tensor], row: Any) -> Any:
        lr = kw["lr"].clone() if isinstance(kw.get("lr"), torch.Tensor) else None
        opt = make(params, **{**kw, "lr": kw["lr"] if lr is None else lr})
        for k, step in enumerate(grads):
            if k in (fills or {}):
                lr.fill_(fills[k])  # type: ignore[union-attr]  # the user's own tensor
            for p, g in zip(params, step, strict=True):
                p.grad = g[row].clone()
            opt.step()
        return opt

    stacked = [p.clone().requires_grad_() for p in start]
    opt = run(vo.stacked(torch_class), kwargs, stacked, slice(None))
    alone = []
    for i in range(N):
        params = [p[i].clone().requires_grad_() for p in start]
        run(torch_class, _member(kwargs, i), params, i)
        alone.append([p.detach() for p in params])
    return [p.detach() for p in stacked], alone, opt


def _assert_members(got: list[torch.Tensor], alone: list[list[torch.Tensor]], **tol: Any) -> None:
    for i, want in enumerate(alone):
        for k, w in enumerate(want):
            if tol:
                torch.testing.assert_close(
                    got[k][i], w, **tol, msg=lambda m, i=i, k=k: f"member {i} param {k}: {m}"
                )
            else:
                assert torch.equal(got[k][i], w), f"member {i} param {k} differs"


@pytest.mark.parametrize(
    "step_sizes",
    [(1e-6, [50.0, 0.02, 1.0, 0.004]), ([0.0, 1e-3, 0.02, 1e-6], 50.0)],
    ids=["max-per-member", "min-per-member"],
)
def test_rprop_step_size_bounds_one_per_member_one_shared(step_sizes: tuple) -> None:
    # lr=0.01 starts above some members' max and below some members' min: both bounds bite.
    kwargs = {"lr": 0.01, "step_sizes": step_sizes}
    got, alone, _ = _trained(torch.optim.Rprop, kwargs, torch.float64)
    _assert_members(got, alone)  # bit for bit: the same elementwise ops as torch's loop


# -- a 0-d tensor lr is kept, and members compute with it as torch does ----------------------

#: (torch class, options with a float lr, fills of the tensor lr before step k). The fill before
#: step 0 reaches state made lazily from lr (Rprop's step sizes, ASGD's eta); Adafactor's
#: second fill makes 1 / sqrt(t) the smaller, torch's float branch.
TENSOR_LR: dict[str, tuple[type, dict[str, Any], dict[int, float]]] = {
    "RAdam": (torch.optim.RAdam, {"lr": 1e-2}, {0: 7e-3, 7: 3e-3}),
    "RAdam-l2": (torch.optim.RAdam, {"lr": 1e-2, "weight_decay": 0.1}, {0: 7e-3, 7: 3e-3}),
    "RAdam-decoupled": (
        torch.optim.RAdam,
        {"lr": 1e-2, "weight_decay": 0.1, "decoupled_weight_decay": True},
        {0: 7e-3, 7: 3e-3},
    ),
    "Adadelta": (torch.optim.Adadelta, {"lr": 0.5}, {0: 0.35, 7: 0.15}),
    "Rprop": (torch.optim.Rprop, {"lr": 1e-2}, {0: 7e-3, 7: 3e-3}),
    "ASGD": (torch.optim.ASGD, {"lr": 0.05, "lambd": 0.1, "t0": 5.0}, {0: 0.035, 7: 0.015}),
    "Adafactor": (torch.optim.Adafactor, {"lr": 1e-2}, {0: 7e-3, 7: 0.5}),
    "Adafactor-decay": (
        torch.optim.Adafactor,
        {"lr": 1e-2, "weight_decay": 0.1},
        {0: 7e-3, 7: 0.5},
    ),
}
#: Every hyperparameter but lr per member (torch class, options): the per-member ops with a 0-d
#: lr, which torch meets with each member's floats (``1 - lr * wd`` in the lr's dtype).
PER_MEMBER: dict[str, tuple[type, dict[str, Any]]] = {
    "AdamW": (torch.optim.AdamW, {"lr": 1e-2, "betas": ([0.0, 0.5, 0.9, 0.95], [0.5, 0.9, 0.99, 0.999]), "weight_decay": [0.0, 1e-3, 1e-2, 0.1]}),
    "NAdamW": (torch.optim.NAdam, {"lr": 1e-2, "weight_decay": [0.0, 1e-3, 1e-2, 0.1], "decoupled_weight_decay": True}),
    "RAdamW": (torch.optim.RAdam, {"lr": 1e-2, "betas": ([0.0, 0.5, 0.9, 0.95], [0.5, 0.9, 0.99, 0.999]), "eps": [1e-8, 1e-6, 1e-3, 1e-1], "weight_decay": [0.0, 1e-3, 1e-2, 0.1], "decoupled_weight_decay": True}),
    "Adadelta": (torch.optim.Adadelta, {"lr": 0.5, "rho": [1.0, 0.9, 0.5, 0.0], "eps": [1e-8, 1e-6, 1e-4, 1e-2], "weight_decay": [0.0, 1e-3, 0.1, 0.9]}),
    "Rprop": (torch.optim.Rprop, {"lr": 1e-2, "etas": ([0.1, 0.5, 0.6, 0.9], [1.1, 1.2, 1.5, 2.0]), "step_sizes": ([0.0, 1e-6, 1e-4, 1e-3], [0.005, 0.02, 1.0, 50.0])}),
    "ASGD": (torch.optim.ASGD, {"lr": 0.05, "lambd": [0.0, 1e-4, 0.1, 1.0], "alpha": [0.5, 0.75, 1.0, 0.6], "t0": [0.0, 5.0, 12.0, 1e6], "weight_decay": [0.0, 1e-3, 0.1, 0.5]}),
    "Adafactor": (torch.optim.Adafactor, {"lr": 1e-2, "beta2_decay": [-0.5, -0.8, -1.0, 0.0], "eps": ([1e-30, 1e-10, 1e-3, 0.1], [1e-3, 1e-2, 1e-1, 1.0]), "d": [1.0, 1.5, 3.0, 1.001], "weight_decay": [0.0, 1e-3, 0.1, 0.5]}),
    "Muon": (torch.optim.Muon, {"lr": 1e-2, "weight_decay": [0.0, 0.1, 0.2, 0.5], "momentum": [0.0, 0.5, 0.8, 0.95]}),
}  # fmt: skip
#: Bit for bit in float32: not Adafactor, whose per-member norms reduce in another order than
#: torch's norm of the member alone (float32 rounding; docs/optim.md).
BITS = [name for name in TENSOR_LR if not name.startswith("Adafactor")]


def _tensor_lr(name: str, dtype: torch.dtype = torch.float32) -> tuple[type, dict, dict]:
    torch_class, kwargs, fills = TENSOR_LR[name]
    return torch_class, {**kwargs, "lr": torch.tensor(kwargs["lr"], dtype=dtype)}, fills


@pytest.mark.parametrize("name", list(TENSOR_LR))
def test_tensor_lr_is_kept_in_param_groups_and_handed_off(name: str) -> None:
    torch_class, kwargs, _ = _tensor_lr(name)
    params = [p.requires_grad_() for p in _problem(torch.float32)[0]]
    opt = vo.stacked(torch_class)(params, **kwargs)
    assert opt.param_groups[0]["lr"] is kwargs["lr"]  # as torch keeps it: schedulers fill_ it
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    handed = opt.member_state_dict(1)["param_groups"][0]["lr"]
    assert isinstance(handed, torch.Tensor) and handed is not kwargs["lr"]
    assert torch.equal(handed, kwargs["lr"])


@pytest.mark.parametrize("name", BITS)
def test_tensor_lr_float32_is_bit_equal_to_torch(name: str) -> None:
    # A 0-d float32 lr, filled before the first step and mid-run: torch computes with it in
    # float32 where its expressions meet the tensor (RAdam's m_hat * lr, ASGD's new eta).
    torch_class, kwargs, fills = _tensor_lr(name)
    got, alone, _ = _trained(torch_class, kwargs, torch.float32, fills)
    _assert_members(got, alone)


@pytest.mark.parametrize("lr_dtype", [torch.float32, torch.float64], ids=["lr32", "lr64"])
@pytest.mark.parametrize("name", list(TENSOR_LR))
def test_tensor_lr_float64_params_match_torch(name: str, lr_dtype: torch.dtype) -> None:
    # A float32 lr on float64 parameters: what torch rounds to float32 (Adafactor's alpha,
    # ASGD's eta) must be rounded so here too, 1e-8 relative apart otherwise.
    torch_class, kwargs, fills = _tensor_lr(name, lr_dtype)
    got, alone, _ = _trained(torch_class, kwargs, torch.float64, fills)
    _assert_members(got, alone, **TOL64)


@pytest.mark.parametrize("name", list(PER_MEMBER))
def test_tensor_lr_with_per_member_hyperparameters_matches_torch(name: str) -> None:
    torch_class, kwargs = PER_MEMBER[name]
    kwargs = {**kwargs, "lr": torch.tensor(kwargs["lr"])}  # float32, on float64 parameters
    fills = {7: 0.3 * float(kwargs["lr"])}
    got, alone, _ = _trained(torch_class, kwargs, torch.float64, fills)
    _assert_members(got, alone, **TOL64)


def test_adafactor_eps2_floor_is_torchs_float_on_float64_parameters() -> None:
    # Zero parameters: alpha = eps2 * rho while their RMS is below eps2; eps2 was read as a
    # float32 tensor (1e-3 off by 5e-8 relative) where torch has a Python float.
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(N, 6, generator=gen, dtype=torch.float64) for _ in range(3)]
    w = torch.zeros(N, 6, dtype=torch.float64, requires_grad=True)
    opt = vo.StackedAdafactor([w], lr=1e-2)
    for g in grads:
        w.grad = g
        opt.step()
    for i in range(N):
        p = torch.zeros(6, dtype=torch.float64, requires_grad=True)
        alone = torch.optim.Adafactor([p], lr=1e-2)
        for g in grads:
            p.grad = g[i].clone()
            alone.step()
        torch.testing.assert_close(w[i].detach(), p.detach(), **TOL64)


# -- a state dict that does not fit raises, and changes nothing ------------------------------


def _stepped(make: Any) -> tuple[list[torch.Tensor], vo.StackedOptimizer]:
    params = [p.clone().requires_grad_() for p in _problem(torch.float64)[0]]
    opt = make(params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    return params, opt


def _edit(path: tuple, value: Any) -> Any:
    """An edit of an Adam state dict: ``value`` at ``path`` (None: the key removed)."""

    def edit(sd: dict[str, Any]) -> None:
        *parents, key = path
        for k in parents:
            sd = sd[k]
        if value is None:
            del sd[key]
        else:
            sd[key] = value

    return edit


BAD_STATE_DICTS = {
    "another optimizer's": (
        "replace",
        ValueError,
        r"param group 0 has no `betas`, `eps`, `amsgrad`, `decoupled_weight_decay`: not a "
        r"state dict of StackedAdam \(it has \['dampening', 'momentum', 'nesterov'\]\)",
    ),
    "no param_groups": (_edit(("param_groups",), None), ValueError, "`state_dict` must be a dict"),
    "another group size": (
        _edit(("param_groups", 0, "params"), [0, 1]),
        ValueError,
        r"the state dict.s param groups hold \[2\] parameters, this optimizer's \[4\]",
    ),
    "lr of the wrong length": (
        _edit(("param_groups", 0, "lr"), vo.MemberValues([0.1, 0.2])),
        ValueError,
        r"param group 0: `lr` has 2 values, expected n=4",
    ),
    "beta2 out of range": (
        _edit(("param_groups", 0, "betas"), (0.9, 1.5)),
        ValueError,
        r"param group 0: Invalid beta parameter at index 1: 1.5",
    ),
    "an unsupported flag": (
        _edit(("param_groups", 0, "differentiable"), True),
        ValueError,
        r"param group 0: `differentiable=True` is not supported",
    ),
    "unknown parameter": (
        _edit(("state", 7), {}),
        ValueError,
        r"state for unknown parameter 7",
    ),
    "a moment of another shape": (
        _edit(("state", 0, "exp_avg"), torch.zeros(N, 2, 5, dtype=torch.float64)),
        ValueError,
        r"`exp_avg` of parameter 0 has shape \(4, 2, 5\), expected \(4, 7, 5\)",
    ),
    "a count as a number": (
        _edit(("state", 1, "step"), 1),
        ValueError,
        r"`step` of parameter 1 must be a tensor of shape \[n=4\].*got int",
    ),
    "a count of another member dim": (
        _edit(("state", 2, "step"), torch.ones(3)),
        ValueError,
        r"`step` of parameter 2 must be a tensor of shape \[n=4\].*got \(3,\)",
    ),
}


@pytest.mark.parametrize("case", list(BAD_STATE_DICTS))
def test_load_state_dict_that_does_not_fit_raises_and_changes_nothing(case: str) -> None:
    edit, error, match = BAD_STATE_DICTS[case]
    params, opt = _stepped(lambda p: vo.StackedAdam(p, lr=0.01))
    if edit == "replace":
        bad = _stepped(lambda p: vo.StackedSGD(p, lr=0.1, momentum=0.9))[1].state_dict()
    else:
        bad = copy.deepcopy(opt.state_dict())
        edit(bad)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(error, match=r"^StackedAdam\.load_state_dict: " + match):
        opt.load_state_dict(bad)
    torch.testing.assert_close(opt.state_dict(), before, rtol=0, atol=0)
    for p in params:  # and it still steps
        p.grad = torch.ones_like(p)
    opt.step()
    assert opt.state[params[0]]["step"].tolist() == [2.0] * N


def test_load_state_dict_reads_per_member_lists_as_the_constructor_does() -> None:
    _, opt = _stepped(lambda p: vo.StackedAdam(p, lr=0.01))
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["lr"] = [0.1, 0.2, 0.3, 0.4]  # a list: one value per member
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == vo.MemberValues([0.1, 0.2, 0.3, 0.4])


@pytest.mark.parametrize("n", [2, 3])
def test_betas_given_as_one_pair_per_member_train_each_member_with_its_pair(n: int) -> None:
    # betas=[(b1, b2) of member 0, (b1, b2) of member 1]: with 2 members it was read as
    # (beta1s, beta2s), member 1 silently running beta1 = 0.999; with 3 it raised.
    pairs = [(0.9, 0.999), (0.8, 0.99), (0.5, 0.9)][:n]
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 2).double(), n=n, seed=0)
    alone = ens.unstack()
    opt = vmapens.StackedAdam(ens, lr=0.1, betas=pairs)
    step = vmapens.make_step(ens, nn.MSELoss(), opt)
    plain = [torch.optim.Adam(m.parameters(), lr=0.1, betas=b) for m, b in zip(alone, pairs)]
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(5, 3, generator=g, dtype=torch.float64)
        y = torch.randn(5, 2, generator=g, dtype=torch.float64)
        step(x, y)
        for m, o in zip(alone, plain, strict=True):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
    for i, m in enumerate(alone):
        for k, v in m.state_dict().items():
            torch.testing.assert_close(ens[i].state_dict()[k], v, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("cls", [torch.optim.Adafactor, torch.optim.LBFGS])
def test_a_torch_optimizer_that_is_not_elementwise_is_refused_by_make_step(cls) -> None:
    # torch.optim.Adafactor over stacked [n, ...] parameters factors its second moment over
    # rows and columns that span the members: 1e-3 off each member alone, silently.
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 2), n=2, seed=0)
    with pytest.raises(TypeError, match=rf"^make_step: `optimizer` torch.optim.{cls.__name__} is"):
        vmapens.make_step(ens, nn.MSELoss(), cls(ens.parameters()))
