"""Seeded search of mixed precision: each member against its own torch.amp.GradScaler.

The truth is every member trained alone: a plain module, ``torch.autocast``, its own
``torch.amp.GradScaler`` with the same options, plain ``torch.optim``. Drawn per seed: fp16,
bf16 or none; shared or per-member data; members whose targets are inf/nan at a step (their
step is skipped and their scale backs off, the others step); growth options; clipping after
unscaling; masks; a state_dict round trip of ensemble, optimizer and loss scale mid-run.
Exact by construction, on every CPU: the scales, growth trackers and which members stepped.
Values: float64 parameters (autocast leaves float64 alone, so only summation order differs)
to truth.TOL64; float32 parameters under fp16 autocast with SGD on an MLP, which the member
matches on every CPU setting measured (docs/semantics.md), to STEP_ULPS fp16 eps of the
distance the member travelled.
"""

from __future__ import annotations

import copy
import random

import models
import pytest
import torch
import truth
from torch import nn

import vmapens
from vmapens.step import LossScale

N = 3
STEP_ULPS = 10.0
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, None: None}


def draw(seed):
    rng = random.Random(seed)
    case = dict(
        precision=rng.choice(["fp16", "fp16", "bf16", None]),
        dtype=rng.choice([torch.float32, torch.float64]),
        per_member=rng.random() < 0.6,
        opt=rng.choice(["sgd", "adam", "adamw"]),
        clip=rng.choice([None, ("norm", 0.5), ("value", 0.1)]),
        steps=rng.randint(2, 5),
        masks=rng.random() < 0.3,
        options=dict(
            init_scale=rng.choice([2.0**4, 2.0**10, 2.0**16, 2.0**30]),
            growth_interval=rng.choice([1, 2, 3]),
            growth_factor=rng.choice([2.0, 1.5]),
            backoff_factor=rng.choice([0.5, 0.25]),
        ),
        chunk=rng.choice([None, None, 2]),
    )
    case["resume_at"] = rng.choice([None, rng.randint(1, case["steps"] - 1)])
    if case["dtype"] == torch.float32:  # values comparable across CPUs: fp16 SGD on an MLP
        case.update(precision="fp16", opt="sgd")
    batches = []
    for _ in range(case["steps"]):
        lead = (N,) if case["per_member"] else ()
        x = torch.randn(*lead, 16, 4, dtype=case["dtype"]) * rng.choice([1.0, 30.0])
        y = torch.randn(*lead, 16, 3, dtype=case["dtype"])
        if case["per_member"] and rng.random() < 0.4:
            y[rng.randrange(N), 0, 0] = rng.choice([float("inf"), float("nan")])
        mask = torch.tensor([rng.random() < 0.7 for _ in range(N)]) if case["masks"] else None
        batches.append((x, y, mask))
    return case, batches


def lr_of(case):
    return 0.05 if case["opt"] == "sgd" else 0.01


def stacked(case, ens):
    if case["opt"] == "sgd":
        return vmapens.StackedSGD(ens, lr=lr_of(case), momentum=0.9)
    adamw = case["opt"] == "adamw"
    return vmapens.StackedAdam(
        ens, lr=lr_of(case), weight_decay=0.1 if adamw else 0.0, decoupled_weight_decay=adamw
    )


def plain(case, m):
    if case["opt"] == "sgd":
        return torch.optim.SGD(m.parameters(), lr=lr_of(case), momentum=0.9)
    if case["opt"] == "adamw":
        return torch.optim.AdamW(m.parameters(), lr=lr_of(case), weight_decay=0.1)
    return torch.optim.Adam(m.parameters(), lr=lr_of(case))


def moved(before, after):
    """Whether any element changed, NaN equal to NaN (a diverged member stays put)."""
    return any(
        not torch.allclose(b, a, rtol=0, atol=0, equal_nan=True)
        for b, a in zip(before, after, strict=True)
    )


def train_ensemble(case, batches, seed):
    def build(state=None):
        ens = vmapens.Ensemble(models.MLP, N, seed=seed, chunk_size=case["chunk"])
        ens.to(case["dtype"])
        opt = stacked(case, ens)
        scale = LossScale(N, **case["options"]) if case["precision"] == "fp16" else None
        if state is not None:
            ens.load_state_dict(state[0])
            opt.load_state_dict(state[1])
            if scale is not None:
                scale.load_state_dict(state[2])
        clip = {}
        if case["clip"] is not None:
            clip = {f"clip_grad_{case['clip'][0]}": case["clip"][1]}
        step = vmapens.make_step(
            ens, nn.MSELoss(), opt, in_dims=0 if case["per_member"] else None,
            precision=case["precision"], loss_scale=scale, **clip,
        )  # fmt: skip
        return ens, opt, scale, step

    ens, opt, scale, step = build()
    alone = ens.unstack()
    stepped = []
    for k, (x, y, mask) in enumerate(batches):
        if k == case["resume_at"]:  # a checkpoint round trip of everything, mid-run
            state = (ens.state_dict(), opt.state_dict(), scale and scale.state_dict())
            ens, opt, scale, step = build(copy.deepcopy(state))
        before = [p.detach().clone() for p in ens.parameters()]
        step(x, y, mask)
        after = [p.detach() for p in ens.parameters()]
        stepped.append([moved([b[i] for b in before], [a[i] for a in after]) for i in range(N)])
    return ens, alone, scale, stepped


def train_alone(case, batches, alone):
    low, clip = DTYPES[case["precision"]], case["clip"]
    scalers, stepped, travel = [], [[False] * N for _ in batches], [0.0] * N
    for i, m in enumerate(alone):
        opt = plain(case, m)
        scaler = torch.amp.GradScaler("cpu", **case["options"]) if low == torch.float16 else None
        scalers.append(scaler)
        for k, (x, y, mask) in enumerate(batches):
            if mask is not None and not mask[i]:
                continue
            own = (x[i], y[i]) if case["per_member"] else (x, y)
            before = [p.detach().clone() for p in m.parameters()]
            opt.zero_grad()
            with torch.autocast("cpu", dtype=low, enabled=low is not None):
                loss = nn.functional.mse_loss(m(own[0]), own[1])
            (loss if scaler is None else scaler.scale(loss)).backward()
            if scaler is not None:
                scaler.unscale_(opt)
            if clip is not None:
                fn = nn.utils.clip_grad_norm_ if clip[0] == "norm" else nn.utils.clip_grad_value_
                fn(m.parameters(), clip[1])
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
            after = [p.detach() for p in m.parameters()]
            stepped[k][i] = moved(before, after)
            travel[i] += max((b - a).abs().max().item() for b, a in zip(before, after))
    return scalers, stepped, travel


@pytest.mark.parametrize("seed", range(8))
def test_members_match_their_own_grad_scalers(seed):
    torch.manual_seed(seed)
    case, batches = draw(seed)
    ens, alone, scale, stepped = train_ensemble(case, batches, seed)
    scalers, want_stepped, travel = train_alone(case, batches, alone)
    assert stepped == want_stepped, "which members stepped at each step"
    if scale is not None:
        init = case["options"]["init_scale"]
        # A scaler that never scaled (every step masked) has no tensors yet: its initial state.
        want = [init if s._scale is None else s.get_scale() for s in scalers]
        tracker = [0 if s._growth_tracker is None else int(s._growth_tracker) for s in scalers]
        assert scale.scale.tolist() == want
        assert scale.growth_tracker.tolist() == tracker
    for i, m in enumerate(alone):
        if case["dtype"] == torch.float64:
            tol = truth.TOL64
        else:
            tol = dict(rtol=0, atol=STEP_ULPS * torch.finfo(torch.float16).eps * travel[i])
        for name, want_value in m.state_dict().items():
            torch.testing.assert_close(
                ens[i].state_dict()[name], want_value, **tol, equal_nan=True,
                msg=lambda s, i=i, name=name: f"seed {seed} member {i} {name}: {s}",
            )  # fmt: skip


def test_unscale_bf16_gradients_rounds_once_as_grad_scaler():
    """A non-power-of-two scale: GradScaler multiplies by the float32 inverse, rounds once."""
    scale = LossScale(2, init_scale=3.0)
    grads = torch.randn(2, 1000).bfloat16()
    want = grads.clone()
    inv = torch.full((1,), 3.0).double().reciprocal().float()
    torch._amp_foreach_non_finite_check_and_unscale_([want], torch.zeros(1), inv)
    got = grads.clone()
    found = scale.unscale_([got])
    assert torch.equal(got, want)
    assert found.tolist() == [False, False]


def test_fp16_parameters_are_refused_like_grad_scaler():
    m = nn.Linear(4, 2).half()
    scaler, opt = torch.amp.GradScaler("cpu"), torch.optim.SGD(m.parameters(), lr=0.1)
    scaler.scale(m(torch.randn(8, 4).half()).float().pow(2).mean()).backward()
    with pytest.raises(ValueError, match="FP16 gradients"):
        scaler.step(opt)  # the premise: torch refuses them
    ens = vmapens.Ensemble(lambda: nn.Linear(4, 2), N, seed=0)
    opt = vmapens.StackedSGD(ens, lr=0.1)
    with pytest.raises(ValueError, match=r"make_step: `precision='fp16'` .* float16 'weight'"):
        vmapens.make_step(ens.half(), nn.MSELoss(), opt, precision="fp16")
    ens.float()
    step = vmapens.make_step(ens, nn.MSELoss(), opt, precision="fp16", check=False)
    ens.half()  # after make_step: the step refuses and changes nothing
    before = copy.deepcopy(ens.state_dict())
    with pytest.raises(ValueError, match="LossScale: cannot unscale float16 gradients"):
        step(torch.randn(8, 4).half(), torch.randn(8, 2).half())
    for name, value in ens.state_dict().items():
        assert torch.equal(value, before[name]), name


def _state(**changes):
    state = LossScale(N, init_scale=8.0).state_dict()
    for key, value in changes.items():
        if value is None:
            del state[key]
        else:
            state[key] = value
    return state


BAD_STATES = [
    pytest.param(_state(growth_factor=None), "lacks \\['growth_factor'\\]", id="missing-key"),
    pytest.param(_state(backoff_factor=2.0), "`backoff_factor` must be in", id="backoff-2"),
    pytest.param(_state(growth_interval=0), "`growth_interval` must be", id="interval-0"),
    pytest.param(_state(scale=torch.tensor([1.0, -1.0, 2.0])), "`scale`", id="negative-scale"),
    pytest.param(_state(scale=torch.tensor([1.0, float("nan"), 2.0])), "`scale`", id="nan-scale"),
    pytest.param(_state(scale=torch.tensor([1, 2, 3])), "`scale`", id="integer-scale"),
    pytest.param(
        _state(growth_tracker=torch.tensor([0.5, 1.0, 2.0])), "`growth_tracker`", id="float-tracker"
    ),
    pytest.param(_state(scale=torch.ones(2)), r"shape \[3\]", id="other-n"),
]


@pytest.mark.parametrize(("state", "message"), BAD_STATES)
def test_load_state_dict_checks_everything_before_changing(state, message):
    scale = LossScale(N, init_scale=4.0, growth_interval=5)
    scale.update_(torch.tensor([False, True, False]))
    before = scale.state_dict()
    with pytest.raises(ValueError, match=message):
        scale.load_state_dict(copy.deepcopy(state))
    after = scale.state_dict()
    assert torch.equal(after.pop("scale"), before.pop("scale"))
    assert torch.equal(after.pop("growth_tracker"), before.pop("growth_tracker"))
    assert after == before


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(n=0), "`n` must be an int >= 1"),
        (dict(n=-1), "`n` must be an int >= 1"),
        (dict(n=3, init_scale=float("inf")), "`init_scale` must be a finite float"),
        (dict(n=3, init_scale="8"), "`init_scale` must be a finite float"),
        (dict(n=3, growth_interval=2.5), "`growth_interval` must be an int"),
        (dict(n=3, growth_interval=True), "`growth_interval` must be an int"),
        (dict(n=3, growth_factor=float("inf")), "`growth_factor` must be > 1"),
    ],
)
def test_loss_scale_options_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LossScale(**kwargs)


LOSSES = [
    pytest.param(nn.CrossEntropyLoss(), "classes", id="cross-entropy"),
    pytest.param(nn.CrossEntropyLoss(label_smoothing=0.1), "classes", id="label-smoothing"),
    pytest.param(nn.BCEWithLogitsLoss(), "probabilities", id="bce-with-logits"),
    pytest.param(
        lambda o, t: nn.functional.nll_loss(nn.functional.log_softmax(o, -1), t),
        "classes",
        id="nll-of-log-softmax",
    ),
    pytest.param(nn.MSELoss(), "probabilities", id="mse"),
]


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("loss_fn", "target"), LOSSES)
def test_per_member_loss_under_autocast_is_each_members_own(loss_fn, target, low):
    """The README's loop under torch.autocast: per_member(loss)(ens(x), y) gives each member
    the loss (dtype, value, gradient) autocast gives it alone; around vmap, autocast missed
    cross_entropy's float32 cast and computed it in the low dtype (7e-3 off in bf16)."""
    out = torch.randn(N, 16, 5).to(low).requires_grad_()
    y = torch.randint(0, 5, (16,)) if target == "classes" else torch.rand(16, 5)
    with torch.autocast("cpu", dtype=low):
        got = vmapens.per_member(loss_fn)(out, y)
        want = torch.stack([loss_fn(out[i], y) for i in range(N)])
    assert got.dtype == want.dtype
    (got_grad,) = torch.autograd.grad(got.sum(), out)
    (want_grad,) = torch.autograd.grad(want.sum(), out)
    # Both compute in float32 from the same rounded inputs: batched and single float32
    # reductions differ by summation order only, a few float32 ulps.
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # The gradient is rounded to the low dtype at the end: one low-precision ulp at most.
    eps = torch.finfo(low).eps
    torch.testing.assert_close(got_grad.float(), want_grad.float(), rtol=eps, atol=1e-6)


def test_per_member_loss_under_autocast_takes_keyword_arguments():
    """per_member hands keyword arguments to every member's loss, as without autocast."""

    def weighted(out: torch.Tensor, y: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
        return weight * nn.functional.cross_entropy(out, y)

    out, y = torch.randn(N, 16, 5).to(torch.bfloat16), torch.randint(0, 5, (16,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = vmapens.per_member(weighted)(out, y, weight=3.0)
        want = torch.stack([weighted(out[i], y, weight=3.0) for i in range(N)])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_overflow_outside_the_optimizer_does_not_skip_the_step():
    """An optimizer over the head while the body still requires grad: GradScaler.unscale_(opt)
    checks the head's gradients only, so a body overflow neither skips the step nor backs the
    scale off. The step checked every trainable gradient and skipped members alone would step."""
    ens = vmapens.Ensemble(models.MLP, N, seed=0)
    with torch.no_grad():  # a tiny first layer and a huge input: only fc1's gradient overflows
        ens.stacked_params()["fc1.weight"].mul_(1e-5)
    alone = ens.unstack()
    head = [p for name, p in ens.named_parameters() if name.startswith("fc2")]
    scale = LossScale(N)
    step = vmapens.make_step(
        ens, nn.MSELoss(), vmapens.StackedSGD(head, lr=0.1), precision="fp16", loss_scale=scale
    )
    x, y = torch.randn(16, 4) * 3e3, torch.randn(16, 3)
    step(x, y)
    for i, m in enumerate(alone):
        scaler, opt = torch.amp.GradScaler("cpu"), torch.optim.SGD(m.fc2.parameters(), lr=0.1)
        before = [p.detach().clone() for p in m.fc2.parameters()]
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(m(x), y)
        scaler.scale(loss).backward()
        assert not m.fc1.weight.grad.isfinite().all() and m.fc2.weight.grad.isfinite().all()
        scaler.step(opt)
        scaler.update()
        assert scale.scale[i].item() == scaler.get_scale()
        travel = max((a - b).abs().max().item() for a, b in zip(m.fc2.parameters(), before))
        assert travel > 0  # the member alone stepped
        for name, value in m.state_dict().items():
            torch.testing.assert_close(
                ens[i].state_dict()[name], value, rtol=0,
                atol=STEP_ULPS * torch.finfo(torch.float16).eps * travel,
            )  # fmt: skip
