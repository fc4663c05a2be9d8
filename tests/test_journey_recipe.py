"""A user journey: a standard image-classifier training recipe ported to a seed/lr sweep.

The recipe a researcher carries from project to project: AdamW with two param groups (weight
decay on the weights of Linear layers, none on biases and norm layers, the usual `no_decay`
split: minGPT's, by module type and parameter name), a linear warmup then a cosine schedule
(`SequentialLR` of `LinearLR` + `CosineAnnealingLR`, a warmup-cosine `LambdaLR`, `OneCycleLR`
cycling AdamW's beta1), gradient accumulation over 3 micro-batches per optimizer step written by
hand (docs: neither `make_step` nor `fit` accumulates), gradient clipping by norm per member,
label smoothing in `CrossEntropyLoss`, one learning rate and weight decay per member, BatchNorm
and LayerNorm in the model, and an uneven last batch (50 rows in micro-batches of 8: the last
micro-batch has 2 rows, the last optimizer step accumulates 1 micro-batch). Then the same with
`make_step` and `fit` (no accumulation there), and the call orders plain PyTorch allows: the
optimizer and scheduler built before `ens.double()` / `.to(torch.float64)`, a `.double()` after
steps, and the optimizer's and scheduler's state dicts saved mid-run and loaded into new ones.

The truth is the naive loop in plain PyTorch: 6 plain modules built from the documented member
seeds, each trained alone with `torch.optim.AdamW`, the same schedulers and
`torch.nn.utils.clip_grad_norm_`. After every run each member's parameters, buffers, optimizer
state (`exp_avg`, `exp_avg_sq`, `step`), hyperparameters (`lr`, `betas`, `weight_decay`,
`initial_lr`) and its scheduler's last lrs equal its twin's, read from the stacked tensors
themselves, not through `member_state_dict`.
"""

from __future__ import annotations

import copy
import io
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from truth import batch_plan, factory_members

import vmapens
from vmapens.callbacks import LRScheduler
from vmapens.optim import MemberValues

LS = torch.optim.lr_scheduler
N, ACC, CLIP, MICRO, ROWS = 6, 3, 0.5, 8, 50
LRS = [1e-3, 3e-3, 1e-2, 3e-3, 1e-2, 3e-2]
WDS = [0.0, 1e-2, 5e-2, 1e-1, 1e-2, 0.2]
WARMUP, TOTAL = 2, 6  # optimizer steps; 3 per epoch with accumulation, 2 epochs
# float64 end to end: the same kernels on the same numbers (observed <= 3e-15).
TOL = {"rtol": 1e-11, "atol": 1e-12}
CRIT = nn.CrossEntropyLoss(label_smoothing=0.1)
AdamW = vmapens.optim.stacked(torch.optim.AdamW)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # bias=False before BatchNorm: that bias's true gradient is 0 and Adam would step on
        # its round-off (docs/semantics.md), alone as in the ensemble.
        self.fc1 = nn.Linear(5, 12, bias=False)
        self.bn = nn.BatchNorm1d(12)
        self.fc2 = nn.Linear(12, 12)
        self.ln = nn.LayerNorm(12)
        self.head = nn.Linear(12, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.relu(self.ln(self.fc2(torch.relu(self.bn(self.fc1(x)))))))


def no_decay_split(module: nn.Module, params: dict[str, Tensor]) -> tuple[list, list]:
    """minGPT's split: weights of Linear layers decay; biases and norm layers' weights do not.
    `module` gives the layer types (`ens.template` for an ensemble, docs/semantics.md), `params`
    the tensors to train by the same names (`ens.named_parameters()`)."""
    decay, no_decay = set(), set()
    for mn, m in module.named_modules():
        for pn, _ in m.named_parameters(recurse=False):
            name = f"{mn}.{pn}" if mn else pn
            if pn.endswith("bias") or isinstance(m, (nn.LayerNorm, nn.BatchNorm1d)):
                no_decay.add(name)
            elif isinstance(m, nn.Linear):
                decay.add(name)
    assert decay | no_decay == set(params) and not decay & no_decay
    return [params[k] for k in sorted(decay)], [params[k] for k in sorted(no_decay)]


def data() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, 5, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 4, (ROWS,), generator=g)


def warm_cosine(k: int) -> float:
    if k < WARMUP:
        return 0.1 + 0.9 * k / WARMUP
    return 0.5 * (1 + math.cos(math.pi * (k - WARMUP) / (TOTAL - WARMUP)))


def schedule(kind: str, opt: torch.optim.Optimizer, lr: Any, total: int = TOTAL) -> Any:
    """The same scheduler alone (`lr` a float) and on the stacked optimizer (`MemberValues`)."""
    if kind == "sequential":
        return LS.SequentialLR(
            opt,
            [
                LS.LinearLR(opt, start_factor=0.1, total_iters=WARMUP),
                LS.CosineAnnealingLR(opt, T_max=total - WARMUP, eta_min=lr * 0.01),
            ],
            milestones=[WARMUP],
        )
    if kind == "lambda":
        return LS.LambdaLR(opt, warm_cosine)
    assert kind == "onecycle"  # cycles AdamW's beta1 too
    return LS.OneCycleLR(opt, max_lr=lr, total_steps=total, pct_start=0.3)


KINDS = ["sequential", "lambda", "onecycle"]


def twin_optimizer(m: nn.Module, i: int) -> torch.optim.AdamW:
    decay, no_decay = no_decay_split(m, dict(m.named_parameters()))
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": WDS[i]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LRS[i],
    )


def twins(kind: str, total: int = TOTAL) -> list[list[Any]]:
    """[module, AdamW, scheduler] per member, the modules built from the documented seeds."""
    out = []
    for i, m in enumerate(factory_members([Net] * N, seed=0)):
        opt = twin_optimizer(m, i)
        out.append([m, opt, schedule(kind, opt, LRS[i], total)])
    return out


def stacked_optimizer(ens: vmapens.Ensemble) -> vmapens.StackedOptimizer:
    decay, no_decay = no_decay_split(ens.template, dict(ens.named_parameters()))
    return AdamW(
        [{"params": decay, "weight_decay": WDS}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LRS,
    )


def accumulated_step(
    forward: Callable[[Tensor], Tensor], loss: Callable, params: Any, clip: Callable, group: list
) -> None:
    """One optimizer step's gradients: `ACC` micro-batches (fewer at the end of the data), each
    loss divided by `ACC` as the recipe writes it, then clipping."""
    for x, y in group:
        (loss(forward(x), y) / ACC).sum().backward()
    clip(params, CLIP)


def step_groups() -> list[list[tuple[Tensor, Tensor]]]:
    x, y = data()
    micro = [(x[k : k + MICRO], y[k : k + MICRO]) for k in range(0, ROWS, MICRO)]
    return [micro[k : k + ACC] for k in range(0, len(micro), ACC)]


def train_twins(tw: list[list[Any]], group: list) -> None:
    for m, opt, sched in tw:
        opt.zero_grad()
        accumulated_step(m, CRIT, m.parameters(), torch.nn.utils.clip_grad_norm_, group)
        opt.step()
        sched.step()


def train_ensemble(ens: vmapens.Ensemble, opt: Any, sched: Any, group: list) -> None:
    opt.zero_grad()
    loss = vmapens.per_member(CRIT)
    accumulated_step(ens, loss, ens, vmapens.optim.clip_grad_norm_, group)
    opt.step()
    sched.step()


def member_value(v: Any, i: int) -> Any:
    """Member `i`'s value in `v`: a hyperparameter, a pair of them, a scheduler's state dict."""
    if isinstance(v, MemberValues):
        return float(v[i])
    if isinstance(v, dict):
        return {k: member_value(u, i) for k, u in v.items()}
    if isinstance(v, (tuple, list)):
        return type(v)(member_value(u, i) for u in v)
    return v


def assert_members(ens: vmapens.Ensemble, opt: Any, sched: Any, tw: list[list[Any]]) -> None:
    """Each member against its twin: parameters, buffers, every optimizer state tensor (the
    stacked rows themselves), each group's hyperparameters and the scheduler's last lrs."""
    stacked = ens.state_dict()
    for i, (m, t_opt, t_sched) in enumerate(tw):
        for key, value in m.state_dict().items():
            assert stacked[key].dtype == value.dtype, key
            torch.testing.assert_close(
                stacked[key][i], value, **TOL, msg=lambda m, i=i, key=key: f"member {i} {key}: {m}"
            )
        for g, t_g in zip(opt.param_groups, t_opt.param_groups, strict=True):
            for key in ("lr", "betas", "weight_decay", "initial_lr", "eps"):
                got, want = member_value(g[key], i), t_g[key]
                assert got == pytest.approx(want, rel=1e-15, abs=0), (i, key, got, want)
            for p, t_p in zip(g["params"], t_g["params"], strict=True):
                state, t_state = opt.state[p], t_opt.state[t_p]
                assert set(state) == set(t_state)
                for key, value in t_state.items():
                    assert state[key].dtype == value.dtype, key
                    tol = {"rtol": 0, "atol": 0} if key == "step" else TOL
                    torch.testing.assert_close(state[key][i], value, **tol, msg=f"{i} {key}")
        assert [member_value(v, i) for v in sched.get_last_lr()] == pytest.approx(
            t_sched.get_last_lr(), rel=1e-15, abs=0
        )


@pytest.fixture
def float64(float64_default: None) -> None:
    """float64 parameters from the start (the `float64_default` fixture of conftest)."""


@pytest.mark.parametrize("kind", KINDS)
def test_hand_loop_recipe_with_accumulation(float64: None, kind: str) -> None:
    # The whole recipe written by hand: accumulation, clipping, two groups, per-member lr/wd.
    ens = vmapens.Ensemble(Net, n=N, seed=0)
    opt = stacked_optimizer(ens)
    sched = schedule(kind, opt, MemberValues(LRS))  # built before the first step
    tw = twins(kind)
    for _ in range(2):
        for group in step_groups():
            train_ensemble(ens, opt, sched, group)
            train_twins(tw, group)
    assert_members(ens, opt, sched, tw)


@pytest.mark.parametrize("convert", ["double", "to"])
def test_optimizer_and_scheduler_built_before_double(convert: str) -> None:
    # float32 members; the optimizer and the scheduler are built, then the members converted,
    # as plain PyTorch allows (torch.optim creates its state at the first step).
    assert torch.get_default_dtype() == torch.float32
    ens = vmapens.Ensemble(Net, n=N, seed=0)
    opt = stacked_optimizer(ens)
    sched = schedule("sequential", opt, MemberValues(LRS))
    tw = twins("sequential")
    if convert == "double":
        ens.double()
    else:
        ens.to(torch.float64)
    for m, _, _ in tw:
        m.double() if convert == "double" else m.to(torch.float64)
    for group in step_groups() * 2:
        train_ensemble(ens, opt, sched, group)
        train_twins(tw, group)
    assert_members(ens, opt, sched, tw)


def test_double_after_steps_continues_as_the_member_alone() -> None:
    # docs/optim.md: after a step too, the stacked state follows the parameters' dtype (torch's
    # Adam then needs `opt.load_state_dict(opt.state_dict())`). Two float32 steps, then
    # `ens.double()`; each member is handed off at that point (module, AdamW state, scheduler
    # count) and both go on in float64.
    ens = vmapens.Ensemble(Net, n=N, seed=0)
    opt = stacked_optimizer(ens)
    sched = schedule("sequential", opt, MemberValues(LRS))
    groups = step_groups()
    for group in groups[:2]:
        train_ensemble(ens, opt, sched, [(x.float(), y) for x, y in group])
    ens.double()
    tw = []
    for i in range(N):
        m = ens[i]
        t_opt = twin_optimizer(m, i)
        t_sched = schedule("sequential", t_opt, LRS[i])  # sets lr: before the optimizer's load
        t_opt.load_state_dict(opt.member_state_dict(i, module=m))
        t_sched.load_state_dict(member_value(sched.state_dict(), i))
        tw.append([m, t_opt, t_sched])
    for group in groups[2:] + groups:
        train_ensemble(ens, opt, sched, group)
        train_twins(tw, group)
    assert_members(ens, opt, sched, tw)


@pytest.mark.parametrize("order", ["scheduler_first", "optimizer_first"])
def test_state_dicts_round_trip_mid_run(float64: None, order: str) -> None:
    # Save the ensemble, optimizer and scheduler mid-run (to bytes, loaded with
    # weights_only=True), build new ones and load them, in either order plain PyTorch allows.
    ens = vmapens.Ensemble(Net, n=N, seed=0)
    opt = stacked_optimizer(ens)
    sched = schedule("sequential", opt, MemberValues(LRS))
    tw = twins("sequential")
    groups = step_groups() * 2
    for group in groups[:3]:
        train_ensemble(ens, opt, sched, group)
        train_twins(tw, group)

    def reload(state: dict, make_opt: Callable, lr: Any) -> tuple[Any, Any]:
        new_opt = make_opt()
        if order == "optimizer_first":
            new_opt.load_state_dict(state["opt"])
            new_sched = schedule("sequential", new_opt, lr)
        else:
            new_sched = schedule("sequential", new_opt, lr)
            new_opt.load_state_dict(state["opt"])
        new_sched.load_state_dict(state["sched"])
        return new_opt, new_sched

    buf = io.BytesIO()
    torch.save({"ens": ens.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    ens = vmapens.Ensemble(Net, n=N, seed=99)  # other weights, all replaced by the load
    ens.load_state_dict(saved["ens"])
    opt, sched = reload(saved, lambda: stacked_optimizer(ens), MemberValues(LRS))
    for i, t in enumerate(tw):
        state = copy.deepcopy({"opt": t[1].state_dict(), "sched": t[2].state_dict()})
        t[1], t[2] = reload(state, lambda m=t[0], i=i: twin_optimizer(m, i), LRS[i])
    for group in groups[3:]:
        train_ensemble(ens, opt, sched, group)
        train_twins(tw, group)
    assert_members(ens, opt, sched, tw)


def train_twins_plain(tw: list[list[Any]], batches: list[Tensor], x: Tensor, y: Tensor) -> None:
    for rows in batches:
        for m, opt, sched in tw:
            opt.zero_grad()
            CRIT(m(x[rows]), y[rows]).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP)
            opt.step()
            sched.step()


@pytest.mark.parametrize("kind", ["sequential", "onecycle"])  # LambdaLR: the hand loop's
def test_fit_recipe(float64: None, kind: str) -> None:
    # fit has no accumulation: one batch of 8 per step, reshuffled every pass as docs/fit.md
    # says, the last batch of each pass 2 rows; the scheduler stepped after every step.
    steps = 2 * math.ceil(ROWS / MICRO)
    x, y = data()
    ens = vmapens.Ensemble(Net, n=N, seed=0)
    opt = stacked_optimizer(ens)
    sched = schedule(kind, opt, MemberValues(LRS), total=steps)
    vmapens.fit(ens, (x, y), CRIT, epochs=2, batch_size=MICRO, optimizer=opt,
                callbacks=[LRScheduler(sched, interval="step")], clip_grad_norm=CLIP,
                progress=False, seed=0)  # fmt: skip
    tw = twins(kind, total=steps)
    train_twins_plain(tw, batch_plan(ROWS, MICRO, steps, seed=0), x, y)
    assert_members(ens, opt, sched, tw)


def test_make_step_recipe(float64: None) -> None:
    steps = 2 * math.ceil(ROWS / MICRO)
    x, y = data()
    ens = vmapens.Ensemble(Net, n=N, seed=0)
    opt = stacked_optimizer(ens)
    sched = schedule("sequential", opt, MemberValues(LRS), total=steps)
    step = vmapens.make_step(ens, CRIT, opt, clip_grad_norm=CLIP)
    plan = batch_plan(ROWS, MICRO, steps, shuffle=False)
    for rows in plan:
        step(x[rows], y[rows])
        sched.step()
    tw = twins("sequential", total=steps)
    train_twins_plain(tw, plan, x, y)
    assert_members(ens, opt, sched, tw)


def test_fit_refuses_an_accumulation_option(float64: None) -> None:
    # fit has no gradient accumulation; the recipe's option is refused, naming it, before
    # anything changes.
    x, y = data()
    ens = vmapens.Ensemble(Net, n=N, seed=0)
    before = copy.deepcopy(ens.state_dict())
    with pytest.raises(TypeError, match="accumulate_grad_batches.*make_step's options"):
        vmapens.fit(ens, (x, y), CRIT, batch_size=MICRO, accumulate_grad_batches=ACC,
                    progress=False, seed=0)  # fmt: skip
    for key, value in ens.state_dict().items():
        assert torch.equal(value, before[key])


def test_fit_accumulation_option_with_a_built_optimizer_is_named_as_unknown(
    float64: None,
) -> None:
    x, y = data()
    ens = vmapens.Ensemble(Net, n=N, seed=0)
    opt = stacked_optimizer(ens)
    with pytest.raises(TypeError, match="accumulate_grad_batches") as err:
        vmapens.fit(ens, (x, y), CRIT, batch_size=MICRO, optimizer=opt,
                    accumulate_grad_batches=ACC, progress=False, seed=0)  # fmt: skip
    assert "constructor" not in str(err.value)
