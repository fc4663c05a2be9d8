"""Per-member ReduceLROnPlateau and gradient clipping against torch's on each member alone."""

from __future__ import annotations

import io
import math
import random

import pytest
import torch

from vmapens import StackedAdam, StackedSGD
from vmapens.optim import ReduceLROnPlateau, clip_grad_norm_, clip_grad_value_, stacked

INF, NAN = math.inf, math.nan


def _lrs(opt: torch.optim.Optimizer, group: int, n: int) -> list[float]:
    lr = opt.param_groups[group]["lr"]
    if isinstance(lr, torch.Tensor) and lr.dim() == 0:
        return [float(lr)] * n
    return [float(v) for v in lr] if hasattr(lr, "__len__") else [float(lr)] * n


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _check_plateau(sched: ReduceLROnPlateau, opt, alone, tops, ngroups: int) -> None:
    n = len(alone)
    for g in range(ngroups):
        assert _lrs(opt, g, n) == [float(o.param_groups[g]["lr"]) for o in tops]
    for i, t in enumerate(alone):
        assert _same(sched.best[i], t.best)
        assert sched.num_bad_epochs[i] == t.num_bad_epochs
        assert sched.cooldown_counter[i] == t.cooldown_counter


@pytest.mark.parametrize("mode", ["min", "max"])
@pytest.mark.parametrize("threshold_mode", ["rel", "abs"])
def test_plateau_infinite_metric_compares_as_torch(mode: str, threshold_mode: str) -> None:
    # torch compares an infinity as any number: -inf in "min" ("inf" in "max") is an
    # improvement and the new best; it was counted a bad epoch for every member.
    good = -INF if mode == "min" else INF
    kw = dict(mode=mode, threshold_mode=threshold_mode, patience=1, factor=0.5, threshold=0.1)
    seq = [[1.0, 1.0, 1.0], [good, NAN, -good], [good, 2.0, good], [0.0, good, 0.0]]
    seq += [[good, 1.0, NAN], [5.0, -5.0, good]]
    n = 3
    opt = StackedSGD([torch.zeros(n, 2, dtype=torch.float64, requires_grad=True)], lr=1.0)
    sched = ReduceLROnPlateau(opt, **kw)
    tops = [torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=1.0) for _ in range(n)]
    alone = [torch.optim.lr_scheduler.ReduceLROnPlateau(o, **kw) for o in tops]
    for metrics in seq:
        sched.step(torch.tensor(metrics, dtype=torch.float64))
        for t, v in zip(alone, metrics, strict=True):
            t.step(v)
        _check_plateau(sched, opt, alone, tops, 1)


@pytest.mark.parametrize("seed", range(40))
def test_plateau_seeded_against_torch(seed: int) -> None:
    """Options, param groups, per-member lrs, masks, non-finite metrics and a
    state_dict round trip mid-run: each member as torch's scheduler on it alone."""
    rng = random.Random(seed)
    n = 3
    kw = dict(
        mode=rng.choice(["min", "max"]),
        factor=rng.choice([0.1, 0.5, 0.9]),
        patience=rng.randint(0, 2),
        threshold=rng.choice([0.0, 1e-4, 0.1, 1.0]),
        threshold_mode=rng.choice(["rel", "abs"]),
        cooldown=rng.randint(0, 2),
        eps=rng.choice([1e-8, 0.01, 0.2]),
        min_lr=rng.choice([0.0, 0.05, [0.02, 0.01]]),
    )
    lrs = [[rng.choice([1.0, 0.3, 0.06]) for _ in range(n)] for _ in range(2)]
    first = [{"lr": lr} for lr in lrs[0]]
    classes = rng.choice([(StackedSGD, torch.optim.SGD), (StackedAdam, torch.optim.Adam)])

    def build_stacked():
        ws = [torch.zeros(n, 2, dtype=torch.float64, requires_grad=True) for _ in range(2)]
        return classes[0]([{"params": [w], "lr": lr} for w, lr in zip(ws, lrs, strict=True)])

    opt = build_stacked()
    sched = ReduceLROnPlateau(opt, **kw)
    tops = [
        classes[1](
            [
                {"params": [torch.zeros(2, requires_grad=True)], **first[i]},
                {"params": [torch.zeros(2, requires_grad=True)], "lr": lrs[1][i]},
            ]
        )
        for i in range(n)
    ]
    alone = [torch.optim.lr_scheduler.ReduceLROnPlateau(o, **kw) for o in tops]
    pool = [1.0, 0.5, 2.0, -1.0, 0.0, NAN, INF, -INF, 0.99999, 3.0]
    for step in range(10):
        if step == 5:  # resume both from their state dicts
            saved, opt_saved = sched.state_dict(), opt.state_dict()
            opt = build_stacked()
            opt.load_state_dict(opt_saved)
            sched = ReduceLROnPlateau(opt, **kw)
            sched.load_state_dict(saved)
            states = [t.state_dict() for t in alone]
            alone = [torch.optim.lr_scheduler.ReduceLROnPlateau(o, **kw) for o in tops]
            for t, s in zip(alone, states, strict=True):
                t.load_state_dict(s)
        metrics = [rng.choice(pool) for _ in range(n)]
        mask = [rng.random() < 0.8 for _ in range(n)]
        sched.step(torch.tensor(metrics, dtype=torch.float64), mask=torch.tensor(mask))
        for t, v, m in zip(alone, metrics, mask, strict=True):
            if m:
                t.step(v)
        _check_plateau(sched, opt, alone, tops, 2)


def _clip_case(dtypes: list[torch.dtype], shapes: list[tuple], n: int, seed: int, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.zeros((n, *s), dtype=d, requires_grad=True) for s, d in zip(shapes, dtypes)]
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen, dtype=torch.float64) * scale).to(p.dtype)
    members = []
    for i in range(n):
        mine = [torch.zeros(s, dtype=d, requires_grad=True) for s, d in zip(shapes, dtypes)]
        for m, p in zip(mine, params, strict=True):
            m.grad = p.grad[i].clone()
        members.append(mine)
    return params, members


def _check_clipped(params, members, got: torch.Tensor | None, want: list[torch.Tensor]) -> None:
    if got is not None:
        assert torch.equal(got.nan_to_num(7.0), torch.stack(want).nan_to_num(7.0))
    for i, mine in enumerate(members):
        for m, p in zip(mine, params, strict=True):
            if m.grad is None:
                assert p.grad is None
            else:
                assert torch.equal(p.grad[i].nan_to_num(7.0), m.grad.nan_to_num(7.0))


@pytest.mark.parametrize(
    "dtypes",
    [
        # torch stacks the per-tensor norms grouped by dtype: float64 first here.
        [torch.float32, torch.float64, torch.float32, torch.float64],
        # float16 gradients scaled in float32 by torch (the coefficient is a float32 scalar).
        [torch.float16, torch.float32, torch.float16, torch.float32],
        [torch.float16, torch.float64, torch.float32, torch.bfloat16],
    ],
)
@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, INF])
def test_clip_norm_mixed_dtypes_as_torch(dtypes: list[torch.dtype], norm_type: float) -> None:
    shapes = [(7,), (3, 5), (), (11,)]  # a 0-d member parameter: scaled in float64 by torch
    for seed in range(6):
        scale = [1e3, 1.0, 1e-3, 30.0]
        params, members = _clip_case(dtypes, shapes, 3, seed)
        for p, s in zip(params, scale, strict=True):
            p.grad.mul_(s)
        for mine in members:
            for m, s in zip(mine, scale, strict=True):
                m.grad.mul_(s)
        want = [torch.nn.utils.clip_grad_norm_(m, 0.5, norm_type) for m in members]
        got = clip_grad_norm_(params, 0.5, norm_type)
        _check_clipped(params, members, got, want)


def test_clip_norm_mixed_dtypes_compiled_as_torch_eager() -> None:
    # Under dynamo torch's dtype grouping keeps the groups in the order they occur; the
    # members alone are grouped (and their norms summed) in eager torch's order.
    from vmapens.optim.clip import clip_norms_

    step = torch.compile(lambda g: clip_norms_(g, 0.5), backend="aot_eager", fullgraph=True)
    dtypes = [torch.float32, torch.float64, torch.float32, torch.float64]
    for seed in range(16):
        params, members = _clip_case(dtypes, [(5,), (4,), (7,), (2,)], 3, seed)
        for p, s in zip(params, [1e3, 1.0, 1e-3, 1e2], strict=True):
            p.grad.mul_(s)
        for mine in members:
            for m, s in zip(mine, [1e3, 1.0, 1e-3, 1e2], strict=True):
                m.grad.mul_(s)
        want = [torch.nn.utils.clip_grad_norm_(m, 0.5) for m in members]
        got = step([p.grad for p in params])
        _check_clipped(params, members, got, want)


@pytest.mark.parametrize("seed", range(60))
def test_clip_seeded_against_torch(seed: int) -> None:
    """norm_type, max_norm as a 0-d tensor, None grads, non-finite members, error_if_nonfinite,
    foreach, clip_grad_value_: every member as torch.nn.utils on it alone."""
    rng = random.Random(seed)
    n = rng.randint(1, 4)
    dtype = rng.choice([torch.float64, torch.float32])
    shapes = [(3,), (2, 4), (), (5, 1, 2)]
    params, members = _clip_case([dtype] * 4, shapes, n, seed, rng.choice([0.01, 1.0, 100.0]))
    for k, p in enumerate(params):
        if rng.random() < 0.2:
            p.grad = None
            for mine in members:
                mine[k].grad = None
        elif rng.random() < 0.15:
            i, bad = rng.randrange(n), rng.choice([NAN, INF, -INF])
            p.grad[i].view(-1)[0] = bad
            members[i][k].grad.view(-1)[0] = bad
    foreach = rng.choice([None, True, False])
    if all(p.grad is None for p in params):
        assert torch.equal(clip_grad_norm_(params, 1.0), torch.zeros(n))
        return
    if rng.random() < 0.25:
        value = rng.choice([0.1, 1.0, torch.tensor(0.5)])
        for mine in members:
            torch.nn.utils.clip_grad_value_(mine, value, foreach=foreach)
        clip_grad_value_(params, value, foreach=foreach)
        _check_clipped(params, members, None, [])
        return
    norm_type = rng.choice([1, 2.0, INF, "inf", 3.0, 0.5])
    max_norm = rng.choice([0.0, 0.1, 1.0, torch.tensor(0.5, dtype=torch.float64)])
    strict = rng.random() < 0.4
    before = [None if p.grad is None else p.grad.clone() for p in params]
    want, raised = [], False
    for mine in members:
        try:
            want.append(torch.nn.utils.clip_grad_norm_(mine, max_norm, norm_type, strict, foreach))
        except RuntimeError:
            raised = True
    if raised:
        with pytest.raises(RuntimeError, match="error_if_nonfinite"):
            clip_grad_norm_(params, max_norm, norm_type, strict, foreach)
        for b, p in zip(before, params, strict=True):  # nothing changed
            assert b is None or torch.equal(b.nan_to_num(7.0), p.grad.nan_to_num(7.0))
        return
    got = clip_grad_norm_(params, max_norm, norm_type, strict, foreach)
    _check_clipped(params, members, got, want)


@pytest.mark.parametrize(
    ("torch_class", "options"),
    [
        (torch.optim.AdamW, {}),
        (torch.optim.Adam, {"weight_decay": 0.1, "amsgrad": True}),
        (torch.optim.RMSprop, {"momentum": 0.5, "centered": True}),
        (torch.optim.NAdam, {}),
        (torch.optim.Adafactor, {}),
    ],
)
def test_stacked_twin_steps_as_torch(torch_class, options: dict) -> None:
    n, gen = 2, torch.Generator().manual_seed(0)
    w0 = torch.randn(n, 3, 2, generator=gen, dtype=torch.float64)
    grads = [torch.randn(n, 3, 2, generator=gen, dtype=torch.float64) for _ in range(3)]
    w = w0.clone().requires_grad_()
    opt = stacked(torch_class)([w], lr=0.01, **options)
    alone = [w0[i].clone().requires_grad_() for i in range(n)]
    tops = [torch_class([a], lr=0.01, **options) for a in alone]
    for g in grads:
        w.grad = g.clone()
        opt.step()
        for i, (a, o) in enumerate(zip(alone, tops, strict=True)):
            a.grad = g[i].clone()
            o.step()
    for i in range(n):
        assert torch.equal(w.detach()[i], alone[i].detach())


def test_stacked_refuses_with_reason() -> None:
    with pytest.raises(ValueError, match="torch_class.*LBFGS"):
        stacked(torch.optim.LBFGS)
    with pytest.raises(ValueError, match="torch_class"):
        stacked(torch.nn.Linear)  # type: ignore[arg-type]


#: Stacked optimizers whose step with per-member lrs is torch's with each member's tensor lr
#: bit for bit, and those whose torch twin computes its step size in a tensor lr's dtype
#: (float32 here), which per-member lrs compute in float64 (docs/semantics.md).
EXACT_SPLIT = ["SGD", "RMSprop", "Adagrad", "RAdam", "Adadelta", "Rprop"]
ROUNDED_SPLIT = ["Adam", "Adamax", "NAdam", "ASGD"]


@pytest.mark.parametrize("name", EXACT_SPLIT + ROUNDED_SPLIT)
def test_plateau_float32_tensor_lr_rounds_as_torch_once_members_differ(name: str) -> None:
    # torch fills each member's float32 lr tensor, so every lowered lr is rounded to float32;
    # once members' lrs differed they were kept as Python floats, 5e-10 apart from torch's,
    # and SGD's steps after it 1e-9 apart. Float64 parameters: only the lr's rounding differs.
    n, factor = 3, 0.3  # 0.1 * 0.3 is not a float32 number
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(n, 4, dtype=torch.float64, generator=gen)
    w = w0.clone().requires_grad_()
    opt = stacked(getattr(torch.optim, name))([w], lr=torch.tensor(0.1))
    sched = ReduceLROnPlateau(opt, factor=factor, patience=0)
    mine = [w0[i].clone().requires_grad_() for i in range(n)]
    tops = [getattr(torch.optim, name)([m], lr=torch.tensor(0.1)) for m in mine]
    alone = [torch.optim.lr_scheduler.ReduceLROnPlateau(o, factor=factor, patience=0) for o in tops]
    metrics = [[1.0, 1.0, 1.0], [2.0, 0.5, 2.0], [3.0, 0.1, 0.5], [4.0, 5.0, 0.1], [5.0, 6.0, 7.0]]
    for step, row in enumerate(metrics):
        if step == 3:  # resumed after the split, through a file: the lr's dtype goes with it
            buffer = io.BytesIO()
            torch.save(sched.state_dict(), buffer)
            buffer.seek(0)
            sched = ReduceLROnPlateau(opt, factor=factor, patience=0)
            sched.load_state_dict(torch.load(buffer, weights_only=True))
        grad = torch.randn(n, 4, dtype=torch.float64, generator=gen)
        w.grad = grad.clone()
        opt.step()
        for i, (m, o) in enumerate(zip(mine, tops, strict=True)):
            m.grad = grad[i].clone()
            o.step()
        sched.step(torch.tensor(row, dtype=torch.float64))
        for t, v in zip(alone, row, strict=True):
            t.step(v)
        _check_plateau(sched, opt, alone, tops, 1)
        want = torch.stack([m.detach() for m in mine])
        if name in EXACT_SPLIT:
            assert torch.equal(w.detach(), want)
        else:  # a float32 step size: within its rounding (2^-24) of the lr-sized steps
            torch.testing.assert_close(w.detach(), want, rtol=0, atol=1e-7)


def test_plateau_split_tensor_lr_still_takes_torchs_other_schedulers() -> None:
    # torch's schedulers fill_ a tensor lr with one value; the split lrs stay one float per
    # member (not a 1-D tensor, which fill_ refuses), so a StepLR beside the plateau goes on
    # lowering each member's own lr.
    w = torch.zeros(3, 2, dtype=torch.float64, requires_grad=True)
    opt = StackedSGD([w], lr=torch.tensor(0.1))
    sched = ReduceLROnPlateau(opt, factor=0.5, patience=0)
    other = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    sched.step(torch.tensor([1.0, 1.0, 1.0]))
    sched.step(torch.tensor([2.0, 0.5, 2.0]))  # members 0 and 2 lowered
    w.grad = torch.ones(3, 2, dtype=torch.float64)
    opt.step()
    other.step()
    half = float(torch.tensor(0.1 * 0.5, dtype=torch.float32))
    assert list(opt.param_groups[0]["lr"]) == [
        half * 0.9,
        float(torch.tensor(0.1)) * 0.9,
        half * 0.9,
    ]
