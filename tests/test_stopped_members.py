"""A member that stops in `fit` keeps its hyperparameters: its scheduler is no longer stepped.

The truth is a plain loop: each member a plain module with its own `torch.optim` optimizer and
torch scheduler, trained on the same batches, that stops stepping both when the member stops
(early stopping and divergence before that step's or epoch's scheduler step, as `fit` runs
`Divergence` and `EarlyStopping` before `LRScheduler`; a user callback's `Context.stop` after
it). Everything is float64, so members, learning rates and momenta compare exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as L

import vmapens
from vmapens.callbacks import Callback, Context, EarlyStopping, LRScheduler
from vmapens.optim import MemberValues, ReduceLROnPlateau

N, ROWS, BATCH = 3, 12, 4
LRS = [0.1, 0.05, 0.02]
PEAKS = [0.3, 0.2, 0.1]  # OneCycleLR's max_lr, one per member
TOL = dict(rtol=1e-12, atol=1e-12)


def member() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()


def data(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x, xv = (torch.randn(ROWS, 3, generator=g, dtype=torch.float64) for _ in range(2))
    y, yv = (torch.randn(ROWS, 1, generator=g, dtype=torch.float64) for _ in range(2))
    return x, y, xv, yv


class StopAt(Callback):
    """Stops member m at the end of epoch plan[m] (after the scheduler's epoch step)."""

    def __init__(self, plan: dict[int, int]) -> None:
        self.plan = plan

    def on_epoch_end(self, ctx: Context) -> None:
        ctx.stop([m for m, e in self.plan.items() if e == ctx.epoch])


def alone(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    sched: Any,
    epochs: int,
    interval: str,
    *,
    val: tuple[torch.Tensor, torch.Tensor] | None = None,
    patience: int | None = None,
    stop_after: int | None = None,
    seed: int = 0,
) -> None:
    """One member trained alone with plain torch, as docs/fit.md describes `fit`'s loop."""
    x, y = data(seed)[:2]
    best, bad = math.inf, 0
    for epoch in range(epochs):
        for k in range(0, ROWS, BATCH):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x[k : k + BATCH]), y[k : k + BATCH])
            loss.backward()
            opt.step()
            if not torch.isfinite(loss):  # Divergence: frozen before this step's scheduler
                return
            if interval == "step":
                sched.step()
        v = math.nan
        if val is not None:
            with torch.no_grad():
                v = nn.functional.mse_loss(model.eval()(val[0]), val[1]).item()
            model.train()
            best, bad = (v, 0) if v < best else (best, bad + 1)
            if patience is not None and bad >= patience:  # EarlyStopping runs first
                return
        if isinstance(sched, L.ReduceLROnPlateau):
            sched.step(v)
        elif interval == "epoch":
            sched.step()
        if stop_after == epoch:  # a user callback's Context.stop, after the scheduler
            return


SCHEDULES: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "step_lr": ("epoch", lambda o: L.StepLR(o, 1, gamma=0.5)),
    "cosine": ("step", lambda o: L.CosineAnnealingLR(o, 20)),
    "linear": ("step", lambda o: L.LinearLR(o, start_factor=0.5, total_iters=12)),
    "one_cycle": ("step", lambda o: L.OneCycleLR(o, max_lr=MemberValues(PEAKS), total_steps=20)),
    "chained": (
        "epoch",
        lambda o: L.ChainedScheduler([L.StepLR(o, 1, 0.9), L.ExponentialLR(o, 0.8)]),
    ),
}


def _per_member(value: Any, n: int = N) -> list[float]:
    return list(value) if isinstance(value, MemberValues) else [float(value)] * n


def _compare(ens: vmapens.Ensemble, opt: Any, twins: list[nn.Module], outs: list[Any]) -> None:
    """Members, learning rates and momenta (OneCycleLR cycles it) as the plain loop's."""
    for key in ("lr", "momentum"):
        got = _per_member(opt.param_groups[0][key])
        assert got == [o.param_groups[0][key] for o in outs], key
    for i, (twin, mine) in enumerate(zip(twins, ens.unstack(), strict=True)):
        for a, b in zip(twin.parameters(), mine.parameters(), strict=True):
            torch.testing.assert_close(b, a, **TOL, msg=f"member {i}")


def _twins(ens: vmapens.Ensemble) -> list[nn.Module]:
    return [m.train() for m in ens.unstack()]


def _torch_opt(m: nn.Module, i: int) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=LRS[i], momentum=0.9)


def _alone_scheduler(name: str, i: int, o: torch.optim.Optimizer) -> Any:
    if name == "one_cycle":
        return L.OneCycleLR(o, max_lr=PEAKS[i], total_steps=20)
    return SCHEDULES[name][1](o)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_a_stopped_member_keeps_the_lr_it_stopped_with(name: str) -> None:
    interval, build = SCHEDULES[name]
    epochs, plan = 5, {1: 1, 2: 3}
    x, y = data()[:2]
    ens = vmapens.Ensemble(member, n=N, seed=0)
    twins = _twins(ens)
    opt = vmapens.StackedSGD(ens, lr=LRS, momentum=0.9)
    cb = LRScheduler(build, interval=interval)
    vmapens.fit(ens, (x, y), nn.MSELoss(), epochs=epochs, batch_size=BATCH, shuffle=False,
                optimizer=opt, callbacks=[cb, StopAt(plan)], progress=False)  # fmt: skip
    outs, scheds = [], []
    for i, twin in enumerate(twins):
        o = _torch_opt(twin, i)
        scheds.append(_alone_scheduler(name, i, o))
        alone(twin, o, scheds[-1], epochs, interval, stop_after=plan.get(i))
        outs.append(o)
    _compare(ens, opt, twins, outs)
    assert _per_member(cb.scheduler.get_last_lr()[0]) == [s.get_last_lr()[0] for s in scheds]


def test_one_cycle_keeps_a_stopped_adam_members_beta1() -> None:
    x, y = data()[:2]
    ens = vmapens.Ensemble(member, n=N, seed=0)
    twins = _twins(ens)
    opt = vmapens.StackedAdam(ens, lr=LRS)
    cycle = lambda o: L.OneCycleLR(o, max_lr=0.1, total_steps=20)  # noqa: E731
    vmapens.fit(ens, (x, y), nn.MSELoss(), epochs=4, batch_size=BATCH, shuffle=False,
                optimizer=opt, callbacks=[LRScheduler(cycle, interval="step"), StopAt({0: 1})],
                progress=False)  # fmt: skip
    outs = []
    for i, twin in enumerate(twins):
        o = torch.optim.Adam(twin.parameters(), lr=LRS[i])
        alone(twin, o, cycle(o), 4, "step", stop_after={0: 1}.get(i))
        outs.append(o)
    for key in ("lr", "betas"):
        got = opt.param_groups[0][key]
        per = [_per_member(v) for v in got] if key == "betas" else [_per_member(got)]
        want = [o.param_groups[0][key] for o in outs]
        want = [list(b) for b in zip(*want, strict=True)] if key == "betas" else [want]
        assert per == want, key
    for twin, mine in zip(twins, ens.unstack(), strict=True):
        for a, b in zip(twin.parameters(), mine.parameters(), strict=True):
            torch.testing.assert_close(b, a, **TOL)


def _fit_and_alone(
    sched: Callable[[Any], Any],
    alone_sched: Callable[[int, torch.optim.Optimizer], Any],
    interval: str,
    epochs: int,
    lrs: list[float],
    patience: int | None,
    **fit_kwargs: Any,
) -> tuple[vmapens.Ensemble, Any, list[nn.Module], list[Any], vmapens.History]:
    x, y, xv, yv = data()
    ens = vmapens.Ensemble(member, n=N, seed=0)
    twins = _twins(ens)
    opt = vmapens.StackedSGD(ens, lr=lrs, momentum=0.9)
    callbacks: list[Any] = [LRScheduler(sched, interval=interval)]
    if patience is not None:
        callbacks.append(EarlyStopping(patience=patience, restore_best=False))
    h = vmapens.fit(ens, (x, y), nn.MSELoss(), epochs=epochs, batch_size=BATCH, shuffle=False,
                    optimizer=opt, callbacks=callbacks, progress=False,
                    val_data=(xv, yv) if patience is not None else None, **fit_kwargs)  # fmt: skip
    outs = []
    for i, twin in enumerate(twins):
        o = torch.optim.SGD(twin.parameters(), lr=lrs[i], momentum=0.9)
        val = (xv, yv) if patience is not None else None
        alone(twin, o, alone_sched(i, o), epochs, interval, val=val, patience=patience)
        outs.append(o)
    return ens, opt, twins, outs, h


def test_early_stopped_members_miss_the_schedulers_step_of_the_epoch_they_stop_in() -> None:
    ens, opt, twins, outs, h = _fit_and_alone(
        lambda o: L.StepLR(o, 1, gamma=0.7),
        lambda i, o: L.StepLR(o, 1, gamma=0.7),
        "epoch",
        8,
        [0.4, 0.1, 0.02],
        patience=1,
    )
    stopped = h.stopped_epoch.tolist()
    assert any(0 <= e < 7 for e in stopped) and len(set(stopped)) > 1, stopped
    _compare(ens, opt, twins, outs)


def test_per_member_plateau_leaves_stopped_members_out() -> None:
    # vmapens's plateau on each member's val loss; the truth: torch's on that member's alone,
    # never stepped again once the member stopped (NaN val losses do not count as bad epochs).
    ens, opt, twins, outs, h = _fit_and_alone(
        lambda o: ReduceLROnPlateau(o, patience=0, factor=0.5),
        lambda i, o: L.ReduceLROnPlateau(o, patience=0, factor=0.5),
        "epoch",
        8,
        [0.4, 0.1, 0.02],
        patience=2,
    )
    stopped = h.stopped_epoch.tolist()
    assert any(0 <= e < 6 for e in stopped), stopped
    assert any(o.param_groups[0]["lr"] != lr for o, lr in zip(outs, [0.4, 0.1, 0.02])), "reduced"
    _compare(ens, opt, twins, outs)


def test_a_diverged_member_keeps_the_lr_of_the_step_it_diverged_at() -> None:
    cosine = lambda o: L.CosineAnnealingLR(o, 20)  # noqa: E731
    ens, opt, twins, outs, h = _fit_and_alone(
        cosine, lambda i, o: cosine(o), "step", 4, [0.1, 1e40, 0.02], patience=None
    )
    assert h.diverged.tolist() == [False, True, False]
    got = _per_member(opt.param_groups[0]["lr"])
    assert got == [o.param_groups[0]["lr"] for o in outs]
    for i in (0, 2):
        for a, b in zip(twins[i].parameters(), ens.unstack()[i].parameters(), strict=True):
            torch.testing.assert_close(b, a, **TOL)


RESUMED: dict[str, tuple[str, Callable[[Any], Any], Callable[[int, Any], Any]]] = {
    "one_cycle": (
        "step",
        lambda o: L.OneCycleLR(o, max_lr=MemberValues(PEAKS), total_steps=24),
        lambda i, o: L.OneCycleLR(o, max_lr=PEAKS[i], total_steps=24),
    ),
    "plateau": (
        "epoch",
        lambda o: ReduceLROnPlateau(o, patience=0, factor=0.5),
        lambda i, o: L.ReduceLROnPlateau(o, patience=0, factor=0.5),
    ),
}


@pytest.mark.parametrize("name", list(RESUMED))
def test_resumed_after_a_stop_the_lrs_are_the_uninterrupted_runs(tmp_path: Any, name: str) -> None:
    x, y, xv, yv = data()
    interval, build, own = RESUMED[name]
    lrs = [0.4, 0.1, 0.02]

    def run(epochs: int, path: Any) -> tuple[vmapens.Ensemble, Any, vmapens.History]:
        ens = vmapens.Ensemble(member, n=N, seed=0)
        opt = vmapens.StackedSGD(ens, lr=lrs, momentum=0.9)
        h = vmapens.fit(ens, (x, y), nn.MSELoss(), epochs=epochs, batch_size=BATCH,
                        shuffle=False, optimizer=opt, val_data=(xv, yv), checkpoint=path,
                        callbacks=[EarlyStopping(patience=2, restore_best=False),
                                   LRScheduler(build, interval=interval)],
                        progress=False)  # fmt: skip
        return ens, opt, h

    whole, whole_opt, h = run(8, tmp_path / "whole.pt")
    _, _, first = run(3, tmp_path / "cut.pt")
    assert bool((first.stopped_epoch >= 0).any()), "a member stopped before the cut"
    assert bool((h.stopped_epoch > 2).any()), "a member trains on after the cut"
    resumed, resumed_opt, _ = run(8, tmp_path / "cut.pt")
    for key in ("lr", "momentum"):
        assert resumed_opt.param_groups[0][key] == whole_opt.param_groups[0][key], key
    for a, b in zip(whole.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    outs = []
    for i in range(N):
        twin = vmapens.Ensemble(member, n=N, seed=0).unstack()[i].train()
        o = torch.optim.SGD(twin.parameters(), lr=lrs[i], momentum=0.9)
        alone(twin, o, own(i, o), 8, interval, val=(xv, yv), patience=2)
        outs.append(o)
    for key in ("lr", "momentum"):
        assert _per_member(whole_opt.param_groups[0][key]) == [o.param_groups[0][key] for o in outs]


def test_a_stopped_members_optimizer_handed_off_goes_on_as_its_own() -> None:
    """`member_state_dict(i)` of a stopped member holds the lr it stopped with: a plain
    optimizer and a new scheduler from it go on as the member's own would have."""
    name = "cosine"
    interval, build = SCHEDULES[name]
    x, y = data()[:2]
    ens = vmapens.Ensemble(member, n=N, seed=0)
    twins = _twins(ens)
    opt = vmapens.StackedSGD(ens, lr=LRS, momentum=0.9)
    vmapens.fit(ens, (x, y), nn.MSELoss(), epochs=4, batch_size=BATCH, shuffle=False,
                optimizer=opt, callbacks=[LRScheduler(build, interval=interval), StopAt({0: 1})],
                progress=False)  # fmt: skip
    twin = twins[0]
    own = _torch_opt(twin, 0)
    alone(twin, own, build(own), 4, interval, stop_after=1)
    handed = _torch_opt(ens.unstack()[0], 0)
    handed.load_state_dict(opt.member_state_dict(0))
    assert handed.param_groups[0]["lr"] == own.param_groups[0]["lr"]
    assert handed.param_groups[0]["initial_lr"] == own.param_groups[0]["initial_lr"]


def test_plateau_mask_leaves_the_masked_members_record_as_torchs_unstepped() -> None:
    w = torch.zeros(N, 2, requires_grad=True)
    opt = vmapens.StackedSGD([w], lr=LRS)
    sched = ReduceLROnPlateau(opt, patience=0, factor=0.5, cooldown=1)
    twins = [torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=lr) for lr in LRS]
    theirs = [L.ReduceLROnPlateau(o, patience=0, factor=0.5, cooldown=1) for o in twins]
    rows = [[1.0, 1.0, 1.0], [2.0, 0.5, 2.0], [math.nan, 3.0, 3.0], [math.nan, 0.1, 4.0]]
    masks = [None, None, [False, True, True], [False, True, False]]
    for metrics, mask in zip(rows, masks, strict=True):
        sched.step(metrics, mask=None if mask is None else torch.tensor(mask))
        for i, t in enumerate(theirs):
            if mask is None or mask[i]:
                t.step(metrics[i])
    assert _per_member(opt.param_groups[0]["lr"]) == [o.param_groups[0]["lr"] for o in twins]
    for key in ("best", "num_bad_epochs", "cooldown_counter"):
        assert getattr(sched, key) == [getattr(t, key) for t in theirs], key


@pytest.mark.parametrize(
    ("mask", "error", "match"),
    [
        ([True, False, True], TypeError, "`mask` must be a bool tensor"),
        (torch.ones(2, dtype=torch.bool), ValueError, r"`mask` must have shape \[3\]"),
    ],
    ids=["list", "wrong_length"],
)
def test_plateau_refuses_a_bad_mask_before_changing_anything(mask, error, match) -> None:
    opt = vmapens.StackedSGD([torch.zeros(N, 2, requires_grad=True)], lr=0.1)
    sched = ReduceLROnPlateau(opt, patience=0)
    with pytest.raises(error, match=match):
        sched.step([1.0, 1.0, 1.0], mask=mask)
    assert sched.last_epoch == 0 and sched.num_bad_epochs == [0, 0, 0]


def test_a_tensor_lr_cannot_keep_a_stopped_members_value_and_warns() -> None:
    x, y = data()[:2]
    ens = vmapens.Ensemble(member, n=N, seed=0)
    opt = vmapens.StackedSGD(ens, lr=torch.tensor(0.1, dtype=torch.float64))
    with pytest.warns(UserWarning, match="`lr`, a 0-d tensor, for the members that stopped"):
        vmapens.fit(ens, (x, y), nn.MSELoss(), epochs=3, batch_size=BATCH, optimizer=opt,
                    scheduler=lambda o: L.StepLR(o, 1, 0.5), callbacks=[StopAt({0: 0})],
                    progress=False, seed=0)  # fmt: skip


def test_nothing_stopped_leaves_a_shared_lr_shared() -> None:
    x, y = data()[:2]
    ens = vmapens.Ensemble(member, n=N, seed=0)
    opt = vmapens.StackedSGD(ens, lr=0.1)
    vmapens.fit(ens, (x, y), nn.MSELoss(), epochs=2, batch_size=BATCH, optimizer=opt,
                scheduler=lambda o: L.StepLR(o, 1, 0.5), progress=False, seed=0)  # fmt: skip
    assert opt.param_groups[0]["lr"] == 0.1 * 0.5 * 0.5


@pytest.mark.parametrize(
    "nobody",
    [[], (), torch.zeros(0, dtype=torch.int64), torch.zeros(N, dtype=torch.bool)],
    ids=["list", "tuple", "int_tensor", "bool_mask"],
)
def test_context_stop_of_no_members_stops_nobody(nobody: Any) -> None:
    """`ctx.stop(bad.nonzero().flatten())` when no member is bad: a plain loop stops nobody."""

    class StopNobody(Callback):
        def on_epoch_end(self, ctx: Context) -> None:
            ctx.stop(nobody)
            ctx.inherit(nobody, nobody)

    x, y = data()[:2]
    ens = vmapens.Ensemble(member, n=N, seed=0)
    h = vmapens.fit(ens, (x, y), nn.MSELoss(), epochs=2, batch_size=BATCH, progress=False,
                    callbacks=[StopNobody()], seed=0)  # fmt: skip
    assert h.stopped_epoch.tolist() == [-1] * N
