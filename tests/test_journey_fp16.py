"""Journey test: fp16 mixed precision with per-member loss scales, as a user on CPU runs it.

Four float32 MLPs trained with ``fit(..., precision="fp16")`` (and a hand-written loop over
``make_step(..., precision="fp16")``): per-member data and validation data (``in_dims=(0, 0)``),
per-member learning rates, SGD with momentum, clipping by norm, ``vmapens.optim``'s
ReduceLROnPlateau, a user ``LossScale`` (small init scale, fast growth) and one member whose
targets are 300x the others', so its gradients overflow fp16 on some steps: its step is skipped
and its scale backs off while the others step and grow. A callback records every member's
scale after every step (``History`` does not record it). The run is interrupted and resumed
from its checkpoint.

Truth: each member alone in plain torch, ``torch.autocast("cpu", dtype=torch.float16)``, its
own ``torch.amp.GradScaler("cpu")`` with the same options, ``clip_grad_norm_`` after
``scaler.unscale_``, torch's ``ReduceLROnPlateau`` on its validation loss (float32, eval mode,
no autocast: docs/fit.md), batches in the order docs/fit.md documents, and the best epoch's
weights restored at the end (``val_data``'s default ``EarlyStopping``). Exact on any CPU: the
scales after every step, which steps were skipped, the learning rates. Parameters: within 10
fp16 eps of the distance the member travelled (docs/semantics.md's table for fp16 SGD MLPs).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import truth
from torch import nn

import vmapens
from vmapens.callbacks import Callback
from vmapens.step import LossScale, make_step

N, ROWS, BATCH, EPOCHS, SEED = 4, 24, 8, 5, 0
LRS = [0.05, 0.02, 0.05, 0.01]
CLIP = 1.0
OPTIONS = dict(init_scale=2.0**10, growth_interval=2)  # GradScaler's other defaults
LOUD = 2  # the member whose gradients overflow fp16 on some steps
STEP_ULPS = 10.0


def member() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 2))


def data() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, ROWS, 3, generator=g), torch.randn(N, ROWS, 2, generator=g)
    xv, yv = torch.randn(N, 10, 3, generator=g), torch.randn(N, 10, 2, generator=g)
    y[LOUD] *= 300  # its scaled output gradient exceeds fp16's 65504 at a scale of 2**9
    yv[LOUD] *= 300
    return x, y, xv, yv


class Scales(Callback):
    """Every member's loss scale after every step: what a user logs next to the losses."""

    def __init__(self) -> None:
        self.rows: list[torch.Tensor] = []

    def on_step_end(self, ctx) -> None:
        self.rows.append(ctx.loss_scale.scale.clone())


def alone_step(m, opt, scaler, x, y) -> None:
    """The plain torch AMP step, as torch's AMP recipe writes it (clipping after unscale_)."""
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(m(x), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    nn.utils.clip_grad_norm_(m.parameters(), CLIP)
    scaler.step(opt)
    scaler.update()


def val_loss(m, x, y) -> float:
    m.eval()
    with torch.no_grad():
        v = nn.functional.mse_loss(m(x), y).item()
    m.train()
    return v


def train_alone(i, m, x, y, xv, yv, epochs, plan_rows):
    """Member ``i`` alone: scales after each step, validation losses, final lr, travel."""
    opt = torch.optim.SGD(m.parameters(), lr=LRS[i], momentum=0.9)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    scaler = torch.amp.GradScaler("cpu", **OPTIONS)
    scales, vals, travel = [], [], 0.0
    best, best_state = float("inf"), None
    steps_per_epoch = -(-ROWS // BATCH)
    for e in range(epochs):
        for rows in plan_rows[e * steps_per_epoch : (e + 1) * steps_per_epoch]:
            before = [p.detach().clone() for p in m.parameters()]
            alone_step(m, opt, scaler, x[i, rows], y[i, rows])
            travel += max((p - b).abs().max().item() for p, b in zip(m.parameters(), before))
            scales.append(scaler.get_scale())
        vals.append(val_loss(m, xv[i], yv[i]))
        if vals[-1] < best:
            best, best_state = vals[-1], copy.deepcopy(m.state_dict())
        plateau.step(vals[-1])
    m.load_state_dict(best_state)
    return scales, vals, opt.param_groups[0]["lr"], travel


def skipped(scales: torch.Tensor, init: float) -> torch.Tensor:
    """[steps, n] True where the step was skipped: GradScaler backs off exactly there."""
    before = torch.cat([torch.full_like(scales[:1], init), scales[:-1]])
    return scales < before


def fit_run(ens, x, y, xv, yv, *, checkpoint=None, stop_after=None, built=None):
    scales = Scales()

    def sgd(e, **hyperparameters):  # fit's optimizer factory: kept to read its rates after
        opt = vmapens.StackedSGD(e, **hyperparameters)
        (built if built is not None else []).append(opt)
        return opt

    callbacks: list = [scales]
    if stop_after is not None:

        def interrupt(history):
            if history.epochs == stop_after:
                raise KeyboardInterrupt  # a pre-empted job

        callbacks.append(interrupt)
    history = vmapens.fit(
        ens,
        (x, y),
        nn.MSELoss(),
        epochs=EPOCHS,
        batch_size=BATCH,
        in_dims=(0, 0),
        val_data=(xv, yv),
        optimizer=sgd,
        lr=LRS,
        momentum=0.9,
        clip_grad_norm=CLIP,
        precision="fp16",
        loss_scale=LossScale(N, **OPTIONS),  # a fresh one each call, as a rerun script makes
        scheduler=lambda opt: vmapens.optim.ReduceLROnPlateau(opt, patience=0, factor=0.5),
        callbacks=callbacks,
        checkpoint=checkpoint,
        progress=False,
        seed=SEED,
    )
    return history, scales


def test_fit_fp16_members_match_their_own_grad_scalers_and_resume_exactly(tmp_path):
    x, y, xv, yv = data()
    ens = vmapens.Ensemble(member, n=N, seed=SEED)
    alone = truth.twins(ens.unstack())
    built: list = []
    history, recorded = fit_run(ens, x, y, xv, yv, built=built)
    got = torch.stack(recorded.rows)

    plan = truth.batch_plan(ROWS, BATCH, EPOCHS * -(-ROWS // BATCH), seed=SEED)
    runs = [train_alone(i, m, x, y, xv, yv, EPOCHS, plan) for i, m in enumerate(alone)]
    want = torch.tensor([r[0] for r in runs]).T
    assert got.tolist() == want.tolist(), "each member's scale after each step"
    init = OPTIONS["init_scale"]
    assert torch.equal(skipped(got, init), skipped(want, init)), "which steps were skipped"
    # The journey's premise: the loud member skips some steps, the others step through.
    skips = skipped(want, init)
    assert skips[:, LOUD].sum() >= 3 and not skips[:3].any(0)[[0, 1, 3]].any()
    lr = built[0].param_groups[0]["lr"]
    assert list(lr) == [r[2] for r in runs], "ReduceLROnPlateau's per-member rates"
    torch.testing.assert_close(
        history.val_loss, torch.tensor([r[1] for r in runs]).T.double(), rtol=1e-5, atol=0
    )
    for i, m in enumerate(alone):
        tol = STEP_ULPS * torch.finfo(torch.float16).eps * runs[i][3]
        for name, value in m.state_dict().items():
            torch.testing.assert_close(ens[i].state_dict()[name], value, rtol=0, atol=tol)

    # Interrupted after epoch 2 and resumed by rerunning the same script: bit for bit.
    path = tmp_path / "run.pt"
    first = vmapens.Ensemble(member, n=N, seed=SEED)
    with pytest.raises(KeyboardInterrupt):
        fit_run(first, x, y, xv, yv, checkpoint=path, stop_after=2)
    resumed = vmapens.Ensemble(member, n=N, seed=SEED)
    again, tail = fit_run(resumed, x, y, xv, yv, checkpoint=path)
    assert torch.equal(torch.stack(tail.rows), got[-len(tail.rows) :])
    assert torch.equal(again.val_loss, history.val_loss)
    assert torch.equal(again.train_loss, history.train_loss)
    for name, value in ens.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name


def test_make_step_fp16_loop_with_plateau_step_lr_and_state_dict_resume():
    """The hand-written loop: make_step, a per-step StepLR (it moves on over skipped steps, as
    torch's does), vmapens' ReduceLROnPlateau per epoch, and a state_dict round trip of the
    ensemble, optimizer, loss scale and both schedulers after epoch 1."""
    x, y, xv, yv = data()
    steps = -(-ROWS // BATCH)
    xs, ys = x.reshape(N, steps, BATCH, 3), y.reshape(N, steps, BATCH, 2)

    def build(ens):
        opt = vmapens.StackedSGD(ens, lr=LRS, momentum=0.9)
        scale = LossScale(N, **OPTIONS)
        step = make_step(ens, nn.MSELoss(), opt, in_dims=0, precision="fp16",
                         loss_scale=scale, clip_grad_norm=CLIP)  # fmt: skip
        every = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
        plateau = vmapens.optim.ReduceLROnPlateau(opt, patience=0, factor=0.5)
        return opt, scale, step, every, plateau

    ens = vmapens.Ensemble(member, n=N, seed=SEED)
    alone = truth.twins(ens.unstack())
    opt, scale, step, every, plateau = build(ens)
    got = []
    for epoch in range(3):
        if epoch == 1:  # the user's checkpoint, loaded into new objects
            saved = [copy.deepcopy(o.state_dict()) for o in (ens, opt, scale, every, plateau)]
            ens = vmapens.Ensemble(member, n=N, seed=SEED + 1)
            opt, scale, step, every, plateau = build(ens)
            for o, state in zip((ens, opt, scale, every, plateau), saved, strict=True):
                o.load_state_dict(state)
        for k in range(steps):
            step(xs[:, k], ys[:, k])
            every.step()
            got.append(scale.scale.clone())
        with torch.no_grad():
            out = ens.eval()(xv, in_dims=0)
        ens.train()
        plateau.step(((out - yv) ** 2).mean((1, 2)))

    want, lrs = [], []
    for i, m in enumerate(alone):
        o = torch.optim.SGD(m.parameters(), lr=LRS[i], momentum=0.9)
        every_i = torch.optim.lr_scheduler.StepLR(o, 2, gamma=0.5)
        plateau_i = torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0, factor=0.5)
        scaler = torch.amp.GradScaler("cpu", **OPTIONS)
        row = []
        for _ in range(3):
            for k in range(steps):
                alone_step(m, o, scaler, xs[i, k], ys[i, k])
                with warnings.catch_warnings():  # a first step skipped: torch warns, goes on
                    warnings.simplefilter("ignore")
                    every_i.step()
                row.append(scaler.get_scale())
            plateau_i.step(val_loss(m, xv[i], yv[i]))
        want.append(row)
        lrs.append(o.param_groups[0]["lr"])
    want_t = torch.tensor(want).T
    assert torch.stack(got).tolist() == want_t.tolist()
    assert skipped(want_t, OPTIONS["init_scale"])[:, LOUD].any()
    assert list(opt.param_groups[0]["lr"]) == lrs
    for i, m in enumerate(alone):
        for name, value in m.state_dict().items():
            torch.testing.assert_close(ens[i].state_dict()[name], value, rtol=0, atol=1e-5)


def test_resume_with_other_loss_scale_options_is_refused(tmp_path):
    """docs/fit.md: every fit argument must match the checkpoint's, else a ValueError names
    the difference. A LossScale has no repr, so its options were compared as "LossScale":
    a resume with growth_interval=1000 was accepted and silently ran with the checkpoint's 2."""
    # A LossScale had no repr: the resume check compared every one as "LossScale".
    x, y = torch.randn(16, 3), torch.randn(16, 2)
    path = tmp_path / "run.pt"
    options = dict(epochs=2, batch_size=4, precision="fp16", progress=False, seed=0)

    def interrupt(history):
        raise KeyboardInterrupt

    ens = vmapens.Ensemble(lambda: nn.Linear(3, 2), n=2, seed=0)
    with pytest.raises(KeyboardInterrupt):
        vmapens.fit(ens, (x, y), nn.MSELoss(), loss_scale=LossScale(2, growth_interval=2),
                    callbacks=[interrupt], checkpoint=path, **options)  # fmt: skip
    other = LossScale(2, growth_interval=1000)
    with pytest.raises(ValueError, match="loss_scale"):
        vmapens.fit(ens, (x, y), nn.MSELoss(), loss_scale=other, checkpoint=path, **options)
    assert other.growth_interval == 1000  # refused before anything loaded
    # The same options (a rerun script's fresh LossScale) still resume.
    vmapens.fit(ens, (x, y), nn.MSELoss(), loss_scale=LossScale(2, growth_interval=2),
                checkpoint=path, **options)  # fmt: skip
