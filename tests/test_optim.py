"""StackedAdam and clip_grad_norm_ against N plain modules, each with its own torch optimizer."""

from __future__ import annotations

import io
import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.func import stack_module_state

import vmapens
from vmapens.optim import MemberValues, StackedAdam, adam_update, clip_grad_norm_

TOL = dict(rtol=1e-10, atol=1e-12)
F64 = torch.float64
N = 5


class Net(nn.Module):
    """Small MLP with the awkward members: an unused parameter and a zero-size one."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(3, 4)
        self.fc2 = nn.Linear(4, 2)
        self.unused = nn.Parameter(torch.randn(2))  # grad stays None
        self.empty = nn.Parameter(torch.zeros(0, 3))  # zero-size, grad is zero-size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x))) + self.empty.sum()


def member_kwargs(kwargs: dict[str, Any], i: int) -> dict[str, Any]:
    """Member i's plain-float hyperparameters from StackedAdam kwargs."""

    def pick(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return float(v[i]) if v.dim() else float(v)
        if isinstance(v, (list, tuple)):
            return float(v[i])
        return v

    out = {k: pick(v) for k, v in kwargs.items() if k != "betas"}
    if "betas" in kwargs:
        out["betas"] = tuple(pick(b) for b in kwargs["betas"])
    return out


class Rig:
    """N plain modules (the truth, each with its own torch optimizer) and their stacked twin."""

    def __init__(self, kwargs: dict[str, Any], n: int = N, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.n = n
        self.members = [Net().double() for _ in range(n)]
        params, _ = stack_module_state(self.members)
        self.stacked = list(params.values())
        self.opt = StackedAdam(self.stacked, **kwargs)
        cls = torch.optim.AdamW if kwargs.get("decoupled_weight_decay") else torch.optim.Adam
        twin_kwargs = {k: v for k, v in kwargs.items() if k != "decoupled_weight_decay"}
        twin_kwargs.setdefault("weight_decay", 0.0)
        self.twins = [
            cls(m.parameters(), **member_kwargs(twin_kwargs, i)) for i, m in enumerate(self.members)
        ]

    def member_grads(self, module: nn.Module, t: int, i: int) -> None:
        """Backward of member i's loss on batch t (the same batch for every member)."""
        g = torch.Generator().manual_seed(1000 + t)
        x = torch.randn(8, 3, generator=g, dtype=torch.float64)
        y = torch.randn(8, 2, generator=g, dtype=torch.float64)
        module.zero_grad(set_to_none=True)
        ((module(x) - y) ** 2).mean().mul(i + 1).backward()

    def step(self, t: int, mask: torch.Tensor | None = None, poison: bool = False) -> None:
        """One step of both; masked-out twins don't step (with `poison` their grads are NaN)."""
        for i, m in enumerate(self.members):
            self.member_grads(m, t, i)
        for k, sp in enumerate(self.stacked):
            gs = [list(m.parameters())[k].grad for m in self.members]
            sp.grad = None if gs[0] is None else torch.stack(gs)
            if poison and sp.grad is not None and mask is not None:
                sp.grad[~mask] = float("nan")
        for i, twin in enumerate(self.twins):
            if mask is None or mask[i]:
                twin.step()
        self.opt.step(mask=mask)

    def assert_matches(self) -> None:
        for i, (m, twin) in enumerate(zip(self.members, self.twins, strict=True)):
            for sp, p in zip(self.stacked, m.parameters(), strict=True):
                torch.testing.assert_close(sp[i], p, **TOL, msg=f"param, member {i}")
                ours, theirs = self.opt.state[sp], twin.state[p]
                if not theirs:  # never stepped by torch: ours must be pristine too
                    assert ours["step"][i] == 0
                    assert not ours["exp_avg"][i].any()
                    continue
                assert ours["step"][i] == theirs["step"], f"step, member {i}"
                for key in theirs:
                    if key != "step":
                        torch.testing.assert_close(ours[key][i], theirs[key], **TOL, msg=key)


MASKS = [None, [1, 0, 1, 1, 0], [0, 0, 0, 0, 0], None, [1, 1, 1, 0, 1], None]
PER = dict(
    lr=[1e-3, 3e-3, 1e-2, 3e-2, 1e-1],
    beta1=[0.0, 0.5, 0.8, 0.9, 0.95],
    beta2=[0.9, 0.99, 0.999, 0.5, 0.0],
    eps=[1e-8, 1e-6, 1e-3, 1e-1, 0.0],
    wd=[0.0, 1e-3, 1e-2, 0.1, 0.5],
)

CASES = {
    "defaults": (dict(), False),
    "shared_all": (dict(lr=0.02, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05), False),
    "per_member_lr": (dict(lr=PER["lr"]), False),
    "per_member_betas": (dict(lr=0.01, betas=(PER["beta1"], PER["beta2"])), False),
    "per_member_eps": (dict(lr=0.01, eps=PER["eps"]), False),
    "per_member_weight_decay": (dict(lr=0.01, weight_decay=PER["wd"]), False),
    "lr_logspace_sweep": (dict(lr=torch.logspace(-4, -1, N, dtype=torch.float64)), False),
    "amsgrad_per_member": (dict(lr=PER["lr"], betas=(0.9, PER["beta2"]), amsgrad=True), False),
    "maximize": (dict(lr=PER["lr"], weight_decay=0.01, maximize=True), False),
    "adamw_per_member": (
        dict(lr=PER["lr"], weight_decay=PER["wd"], decoupled_weight_decay=True),
        False,
    ),
    "masked_nan_grads": (dict(lr=PER["lr"], weight_decay=PER["wd"]), True),
    "everything_masked": (
        dict(
            lr=torch.tensor(PER["lr"], dtype=torch.float64),
            betas=(PER["beta1"], torch.tensor(PER["beta2"])),
            eps=PER["eps"],
            weight_decay=PER["wd"],
            decoupled_weight_decay=True,
            amsgrad=True,
            maximize=True,
        ),
        True,
    ),
}


@pytest.mark.parametrize(("kwargs", "masked"), list(CASES.values()), ids=list(CASES))
def test_matches_torch_adam_per_member(kwargs: dict[str, Any], masked: bool) -> None:
    rig = Rig(kwargs)
    for t, m in enumerate(MASKS):
        mask = torch.tensor(m, dtype=torch.bool) if masked and m is not None else None
        rig.step(t, mask=mask, poison=masked)
    rig.assert_matches()


def test_adam_update_is_pure() -> None:
    p, g = torch.randn(N, 3, dtype=torch.float64), torch.randn(N, 3, dtype=torch.float64)
    m, v, s = torch.zeros_like(p), torch.zeros_like(p), torch.zeros(N)
    before = [x.clone() for x in (p, g, m, v, s)]
    lr = torch.tensor(PER["lr"], dtype=torch.float64)
    out = adam_update(
        p, g, m, v, None, s, lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0
    )
    for x, y in zip((p, g, m, v, s), before, strict=True):
        assert torch.equal(x, y)
    torch.testing.assert_close(out[4], torch.ones(N))
    # First Adam step moves every coordinate by ~lr * sign(g).
    torch.testing.assert_close(out[0], p - lr[:, None] * g.sign(), rtol=0, atol=1e-6)


SCHEDULERS = {
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 0.9**e / (1 + e)),
    "CosineAnnealingLR": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(
        o, T_max=3, eta_min=1e-4
    ),
}


@pytest.mark.parametrize("make", list(SCHEDULERS.values()), ids=list(SCHEDULERS))
def test_schedulers_follow_each_member(make: Any) -> None:
    rig = Rig(dict(lr=PER["lr"]))
    ours = make(rig.opt)
    theirs = [make(t) for t in rig.twins]
    for t in range(7):
        rig.step(t)
        ours.step()
        for s in theirs:
            s.step()
        lrs = rig.opt.param_groups[0]["lr"]
        assert isinstance(lrs, MemberValues)
        assert lrs.tolist() == [tw.param_groups[0]["lr"] for tw in rig.twins]
    rig.assert_matches()


def test_state_dict_round_trip_is_bit_identical() -> None:
    kwargs = dict(lr=PER["lr"], betas=(PER["beta1"], 0.99), amsgrad=True)
    mask = torch.tensor([1, 0, 1, 1, 1], dtype=torch.bool)
    rig = Rig(kwargs)
    for t in range(3):
        rig.step(t)
    buf = io.BytesIO()
    torch.save(rig.opt.state_dict(), buf)
    snapshot = [p.detach().clone() for p in rig.stacked]
    grads_log = []
    for t in range(3, 6):
        rig.step(t, mask=mask)
        grads_log.append([None if p.grad is None else p.grad.clone() for p in rig.stacked])

    params = [p.clone().requires_grad_() for p in snapshot]
    opt = StackedAdam(params, lr=0.5, amsgrad=True)  # wrong lr: loading must restore it
    buf.seek(0)
    opt.load_state_dict(torch.load(buf, weights_only=True))
    assert opt.param_groups[0]["lr"] == MemberValues(PER["lr"])
    for grads in grads_log:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step(mask=mask)
    for ours, ref in zip(params, rig.stacked, strict=True):
        assert torch.equal(ours, ref)
        for key, val in rig.opt.state[ref].items():
            assert torch.equal(opt.state[ours][key], val), key


@pytest.mark.parametrize("decoupled", [False, True], ids=["Adam", "AdamW"])
def test_member_hand_off_continues_alone(decoupled: bool) -> None:
    kwargs = dict(lr=PER["lr"], betas=(PER["beta1"], 0.99), weight_decay=PER["wd"], amsgrad=True)
    kwargs["decoupled_weight_decay"] = decoupled
    rig = Rig(kwargs)
    for t in range(3):
        rig.step(t, mask=torch.tensor([1, 1, 0, 1, 1], dtype=torch.bool) if t == 1 else None)
    i = 2
    alone = Net().double()
    with torch.no_grad():
        for p, sp in zip(alone.parameters(), rig.stacked, strict=True):
            p.copy_(sp[i])
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls(alone.parameters(), lr=0.5)  # wrong hyperparameters: the state dict brings i's
    opt.load_state_dict(rig.opt.member_state_dict(i, module=alone))
    for t in range(3, 6):
        rig.step(t)
        rig.member_grads(alone, t, i)
        opt.step()
    rig.assert_matches()
    for p, sp, q in zip(alone.parameters(), rig.stacked, rig.members[i].parameters(), strict=True):
        torch.testing.assert_close(p, sp[i], **TOL)
        torch.testing.assert_close(p, q, **TOL)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf], ids=["l2", "l1", "inf"])
def test_clip_grad_norm_matches_torch_per_member(norm_type: float) -> None:
    members = [Net().double() for _ in range(N)]
    for i, m in enumerate(members):
        for p in m.parameters():
            if p is not m.unused:
                p.grad = torch.randn_like(p) * 10.0 ** (i - 2)  # some members clip, some don't
    members[3].fc1.weight.grad[0, 0] = float("nan")
    params, _ = stack_module_state(members)
    stacked = list(params.values())
    for k, sp in enumerate(stacked):
        g = [list(m.parameters())[k].grad for m in members]
        sp.grad = None if g[0] is None else torch.stack(g)
    norms = clip_grad_norm_(stacked, max_norm=1.0, norm_type=norm_type)
    for i, m in enumerate(members):
        # torch's inf-norm raises on a zero-size grad; ours skips it (it adds nothing to a norm).
        nonempty = [p for p in m.parameters() if p.numel()]
        expected = torch.nn.utils.clip_grad_norm_(nonempty, 1.0, norm_type=norm_type)
        torch.testing.assert_close(norms[i], expected, **TOL, equal_nan=True)
        for sp, p in zip(stacked, m.parameters(), strict=True):
            if p.grad is None:
                assert sp.grad is None
            else:
                torch.testing.assert_close(sp.grad[i], p.grad, **TOL, equal_nan=True)
    assert norms[3].isnan() and norms[[0, 1, 2, 4]].isfinite().all()


def _stacked_params(n: int = N) -> list[torch.Tensor]:
    return [torch.randn(n, 3, 2, dtype=torch.float64).requires_grad_()]


BAD_CONSTRUCTION = {
    "lr_negative": (dict(lr=-1.0), ValueError, r"^StackedAdam: Invalid learning rate: -1.0 \(`lr`"),
    "lr_member_negative": (dict(lr=[1e-3, -1e-3, 1e-3, 1e-3, 1e-3]), ValueError, r"`lr` must"),
    "lr_wrong_length": (
        dict(lr=[1e-3] * 3),
        ValueError,
        r"^StackedAdam: `lr` has 3 values, expected n=5, one per member",
    ),
    "lr_2d_tensor": (dict(lr=torch.ones(N, 1)), ValueError, r"`lr` must be a float or 1-D"),
    "lr_string": (dict(lr="fast"), TypeError, r"^StackedAdam: `lr` must be a float"),
    "eps_negative": (dict(eps=-1e-8), ValueError, r"Invalid epsilon value: .*`eps` must be >= 0"),
    "weight_decay_negative": (
        dict(weight_decay=[0.0, 0.0, -0.1, 0.0, 0.0]),
        ValueError,
        r"`weight_decay` must be >= 0",
    ),
    "beta1_is_one": (dict(betas=(1.0, 0.999)), ValueError, r"`betas\[0\]` must be in \[0, 1\)"),
    "beta2_member_out_of_range": (
        dict(betas=(0.9, [0.999] * 4 + [1.5])),
        ValueError,
        r"index 1: 1.5 \(`betas\[1\]`",
    ),
    "beta2_wrong_length": (dict(betas=(0.9, [0.9] * 6)), ValueError, r"`betas\[1\]` has 6 values"),
    "betas_not_pair": (dict(betas=(0.9,)), ValueError, r"`betas` must be a pair"),
}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"), list(BAD_CONSTRUCTION.values()), ids=list(BAD_CONSTRUCTION)
)
def test_bad_construction(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        StackedAdam(_stacked_params(), **kwargs)


def test_bad_params() -> None:
    with pytest.raises(ValueError, match=r"^StackedAdam: all parameters must share the leading"):
        StackedAdam(_stacked_params(5) + _stacked_params(3))
    with pytest.raises(ValueError, match=r"^StackedAdam: `params` is empty"):
        StackedAdam([])
    opt = StackedAdam(_stacked_params(5))
    with pytest.raises(ValueError, match=r"leading member dim n, got sizes \[3, 5\]"):
        opt.add_param_group({"params": _stacked_params(3)})


BAD_STEP = {
    "mask_float": (
        torch.ones(N),
        TypeError,
        r"^StackedAdam(\.apply_gradients)?: `mask` must be a bool tensor",
    ),
    "mask_list": ([True] * N, TypeError, r"`mask` must be a bool tensor of shape \[5\], got list"),
    "mask_short": (
        torch.ones(N - 1, dtype=torch.bool),
        ValueError,
        r"`mask` must have shape \[5\]",
    ),
    "mask_2d": (torch.ones(N, 1, dtype=torch.bool), ValueError, r"`mask` must have shape \[5\]"),
}


@pytest.mark.parametrize(("mask", "error", "match"), list(BAD_STEP.values()), ids=list(BAD_STEP))
@pytest.mark.parametrize("via", ["step", "apply_gradients"])
def test_bad_mask_changes_nothing(mask: Any, error: type[Exception], match: str, via: str) -> None:
    params = _stacked_params()
    opt = StackedAdam(params, lr=PER["lr"])
    params[0].grad = torch.ones_like(params[0])
    opt.step()
    before = params[0].detach().clone(), {k: v.clone() for k, v in opt.state[params[0]].items()}
    with pytest.raises(error, match=match):
        if via == "step":
            opt.step(mask=mask)
        else:
            opt.apply_gradients([params[0].grad], mask=mask)
    assert torch.equal(params[0], before[0])
    for key, val in before[1].items():
        assert torch.equal(opt.state[params[0]][key], val)


def test_apply_gradients_rejects_misaligned_grads() -> None:
    params = _stacked_params()
    opt = StackedAdam(params)
    with pytest.raises(ValueError, match=r"`grads` has 2 entries, expected 1"):
        opt.apply_gradients([None, None])
    with pytest.raises(ValueError, match=r"`grads\[0\]` is \[5, 2\] .*, expected .*\[5, 3, 2\]"):
        opt.apply_gradients([torch.ones(N, 2)])


# bf16 parameters and state: StackedAdam against torch.optim.Adam on the same bf16 member
# tensors. Both round every intermediate to bf16, in another order (torch folds the step size
# into addcdiv's value in double, StackedAdam divides the bf16 denominator by it), so they
# differ by a few ulps of the value or of the distance travelled: measured at most 2.1 bf16 eps
# of those after five steps (40 seeds; native bf16, oneDNN capped at AVX2, ATen's default
# kernels, 1 and 2 threads: elementwise ops only). 6 leaves 3x room; a 40%-wrong update is off
# by ~0.4 of the distance, ~50 eps.
BF16_ULPS = 6.0


def test_bfloat16_matches_torch_adam_per_member() -> None:
    lrs = torch.logspace(-3, -2, N)
    # |p| ~ 0.1: each update is many bf16 ulps of p, not lost to rounding.
    start = (0.1 * torch.randn(N, 4, 3)).bfloat16()
    low = [start.clone().requires_grad_(), torch.zeros(N, 0, dtype=torch.bfloat16).requires_grad_()]
    twins = [start[i].clone().requires_grad_() for i in range(N)]
    kwargs = dict(weight_decay=0.01, amsgrad=True)
    opt = StackedAdam(low, lr=lrs, **kwargs)
    torch_opts = [torch.optim.Adam([t], lr=float(lrs[i]), **kwargs) for i, t in enumerate(twins)]
    for _ in range(5):
        g = torch.randn(N, 4, 3).bfloat16()
        low[0].grad, low[1].grad = g.clone(), torch.zeros(N, 0, dtype=torch.bfloat16)
        opt.step()
        for i, (t, o) in enumerate(zip(twins, torch_opts, strict=True)):
            t.grad = g[i].clone()
            o.step()
    want = torch.stack([t.detach() for t in twins])
    assert low[0].dtype == opt.state[low[0]]["exp_avg"].dtype == torch.bfloat16
    err = (low[0].detach().float() - want.float()).abs()
    # Per element: ulps of the value, and of the distance travelled (near p = 0 the rounded
    # update, not the rounded value, sets the spacing).
    scale = want.float().abs() + (want.float() - start.float()).abs()
    bound = BF16_ULPS * torch.finfo(torch.bfloat16).eps * scale
    assert (err <= bound).all(), f"{(err / bound).max():.2f} x the bound"
    for i, o in enumerate(torch_opts):
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            ours, theirs = opt.state[low[0]][key][i].float(), o.state[twins[i]][key].float()
            torch.testing.assert_close(
                ours, theirs, rtol=BF16_ULPS * torch.finfo(torch.bfloat16).eps, atol=0, msg=key
            )
    assert not torch.equal(low[0], start)  # it did move, in bf16


def test_compiled_step_and_apply_gradients_match_eager() -> None:
    # aot_eager traces the full graph (fullgraph=True fails on any break) without inductor's
    # C++ compile, keeping the test fast.
    kwargs = dict(lr=PER["lr"], betas=(PER["beta1"], 0.99), weight_decay=0.1, amsgrad=True)
    eager_p, comp_p, func_p = (
        [torch.randn(N, 3, 2, dtype=torch.float64), torch.zeros(N, 0, dtype=torch.float64)]
        for _ in range(3)
    )
    for ps in (comp_p, func_p):
        for p, q in zip(ps, eager_p, strict=True):
            p.copy_(q)
    eager_p, comp_p, func_p = ([p.requires_grad_() for p in ps] for ps in (eager_p, comp_p, func_p))
    eager, comp, func = (StackedAdam(ps, **kwargs) for ps in (eager_p, comp_p, func_p))
    step = torch.compile(comp.step, fullgraph=True, backend="aot_eager")
    apply = torch.compile(func.apply_gradients, fullgraph=True, backend="aot_eager")
    mask = torch.tensor([1, 1, 0, 1, 1], dtype=torch.bool)
    for _ in range(3):
        grads = [torch.randn_like(p) for p in eager_p]
        for ps in (eager_p, comp_p):
            for p, g in zip(ps, grads, strict=True):
                p.grad = g.clone()
        eager.step(mask=mask)
        step(mask=mask)
        apply(grads, mask=mask)
    for ps in (comp_p, func_p):
        for p, q in zip(ps, eager_p, strict=True):
            torch.testing.assert_close(p, q, **TOL)


@torch._dynamo.config.patch(error_on_recompile=True)
def test_per_member_scheduler_does_not_recompile() -> None:
    # Optimizer.step's wrappers are shared code objects, cached by earlier tests' compiles.
    torch.compiler.reset()
    params = _stacked_params()
    opt = StackedAdam(params, lr=PER["lr"])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.prepare()  # state exists before tracing, so the first step does not recompile

    # Not fullgraph: the scheduler wraps opt.step in a step counter that dynamo does not trace
    # (the same holds for torch.optim.Adam).
    @torch.compile(backend="eager")
    def train_step() -> None:
        opt.step()

    for _ in range(4):
        params[0].grad = torch.ones_like(params[0])
        train_step()
        sched.step()
    assert opt.param_groups[0]["lr"] == MemberValues(v * 0.5**4 for v in PER["lr"])


# -- torch's fused CPU kernels, when every member shares hyperparameters and step count --------


@pytest.mark.parametrize(
    "name,kwargs",
    [
        ("adam", dict(lr=0.01, weight_decay=0.01)),
        ("adam", dict(lr=0.01, amsgrad=True, maximize=True)),
        ("adamw", dict(lr=0.01, weight_decay=0.1, decoupled_weight_decay=True)),
        ("sgd", dict(lr=0.1)),
        ("sgd", dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)),
        ("sgd", dict(lr=0.1, momentum=0.9, nesterov=True, maximize=True)),
        ("adagrad", dict(lr=0.1, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1)),
        ("adagrad", dict(lr=0.1, maximize=True)),
    ],
    ids=[
        "adam",
        "adam-amsgrad-maximize",
        "adamw",
        "sgd",
        "sgd-momentum",
        "sgd-nesterov",
        "adagrad-decay",
        "adagrad-maximize",
    ],  # fmt: skip
)
def test_fused_kernels_run_and_equal_torch_alone_also_after_a_mask(monkeypatch, name, kwargs):
    kernels = {"sgd": "_fused_sgd_", "adam": "_fused_adam_", "adamw": "_fused_adamw_"}
    kernel = kernels.get(name, "_fused_adagrad_")
    calls = []
    original = getattr(torch, kernel)
    monkeypatch.setattr(torch, kernel, lambda *a, **k: calls.append(1) or original(*a, **k))
    stacked = {"sgd": vmapens.StackedSGD, "adagrad": vmapens.StackedAdagrad}
    stacked_cls = stacked.get(name, vmapens.StackedAdam)
    twins_of = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
    twin_cls = twins_of.get(name, torch.optim.Adagrad)
    twin_kwargs = {k: v for k, v in kwargs.items() if k != "decoupled_weight_decay"}
    twins = [nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double() for _ in range(N)]
    ens = vmapens.Ensemble.from_modules([m for m in twins])
    opt = stacked_cls(ens, **kwargs)
    step = vmapens.make_step(ens, nn.MSELoss(), opt)
    plain = [twin_cls(t.parameters(), **twin_kwargs) for t in twins]
    g = torch.Generator().manual_seed(0)
    masks = [None, None, torch.tensor([True, False, True, True, True]), None]
    for mask in masks:
        x, y = torch.randn(6, 3, generator=g, dtype=F64), torch.randn(6, 2, generator=g, dtype=F64)
        step(x, y, mask=mask)
        for i, (t, o) in enumerate(zip(twins, plain, strict=True)):
            if mask is None or mask[i]:
                o.zero_grad()
                nn.functional.mse_loss(t(x), y).backward()
                o.step()
    # One call per step, the masked one included; after it member 1's count lags, and the
    # last step takes one call per count (each member computed over the whole tensor). SGD
    # without momentum counts nothing (its count only starts the momentum buffer): one call.
    assert len(calls) == (4 if kwargs == dict(lr=0.1) else 5)
    for member, twin in zip(ens.unstack(), twins, strict=True):
        torch.testing.assert_close(member.state_dict(), twin.state_dict(), **TOL)


@pytest.mark.parametrize(
    "opt_cls",
    [vmapens.StackedAdam, vmapens.StackedSGD, vmapens.StackedAdagrad],
    ids=["adam", "sgd", "adagrad"],
)
def test_a_masked_member_leaves_the_others_bit_identical(opt_cls):
    # The fused kernels take one step count: a member that skipped a step must not change,
    # by a single bit, what the others compute (see optim/_flat.run_fused).
    kwargs = dict(lr=0.05, momentum=0.9) if opt_cls is vmapens.StackedSGD else dict(lr=0.05)
    runs = []
    for skip in (False, True):
        torch.manual_seed(0)
        ens = vmapens.Ensemble(lambda: nn.Linear(7, 3), N, seed=0)
        step = vmapens.make_step(ens, nn.MSELoss(), opt_cls(ens, **kwargs))
        g = torch.Generator().manual_seed(1)
        for k in range(5):
            x, y = torch.randn(6, 7, generator=g), torch.randn(6, 3, generator=g)
            mask = torch.tensor([True, False, True, True, True]) if skip and k == 1 else None
            step(x, y, mask=mask)
        runs.append(ens.state_dicts())
    for i in (0, 2, 3, 4):
        for key in runs[0][i]:
            assert torch.equal(runs[0][i][key], runs[1][i][key]), (i, key)
