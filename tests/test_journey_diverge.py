"""User journey: a learning-rate (and weight-decay) sweep where some members blow up.

A researcher sweeps SGD/Adam learning rates one per member (docs/optim.md), some so large that
those members' losses and parameters go to inf/NaN after a step or two, while the others train
normally. Members are independent: every healthy member must end where `torch.optim` takes it
alone, whatever the diverged ones do, and a diverged member must be what `torch.optim` gives it
alone (NaN/inf where alone it is NaN/inf), or what the docs say instead (`fit` freezes a member
from the step whose loss is not finite, docs/fit.md "Validation, early stopping and
divergence"). Covered: `make_step` with StackedAdam and StackedSGD(momentum); a hand-written
loop with `vmapens.optim.clip_grad_norm_`; `fit` with validation, a metric, patience,
best-epoch restore and a checkpoint (history, ensemble metric, reloaded checkpoint and member
files, resume); a weight-decay sweep with the per-member ReduceLROnPlateau; dropping the
diverged members with `select` and training on; `predict`; and the first-step self-check on a
member whose loss (or gradient) is not finite.

The truth is each member trained alone with `torch.optim` on the same batches, with early
stopping, the plateau schedule and the divergence rule written again from the docs. float64,
tiny sizes. Non-finite values are compared with `equal_nan=True`: inf must be inf of the same
sign, NaN must be NaN.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from torch import nn
from truth import assert_bit_identical, batch_plan, reduce_by_hand

import vmapens
from vmapens._selfcheck_parts import _close
from vmapens.optim import ReduceLROnPlateau

TOL: dict[str, Any] = dict(rtol=1e-9, atol=1e-10, equal_nan=True)
F64 = dict(dtype=torch.float64)
_g = torch.Generator().manual_seed(3)
X, Y = torch.randn(24, 3, generator=_g, **F64), torch.randn(24, 1, generator=_g, **F64)
XV, YV = torch.randn(10, 3, generator=_g, **F64), torch.randn(10, 1, generator=_g, **F64)
BATCHES = [(X[k : k + 8], Y[k : k + 8]) for k in (0, 8, 16, 0, 8, 16)]


def member() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 1)).double()


def mae(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).abs().mean()


def assert_members(ens: vmapens.Ensemble, plain: list[nn.Module], rows: list[int]) -> None:
    """Member `rows[k]` of `ens` equals `plain[k]`, NaN and inf in the same places."""
    for k, i in enumerate(rows):
        got, want = ens[i].state_dict(), plain[k].state_dict()
        for name in want:
            torch.testing.assert_close(got[name], want[name], **TOL, msg=f"member {i} {name}")


def torch_twin(kind: str, params: Any, lr: float) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr)
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


# -- make_step and a hand-written loop ---------------------------------------------------------


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_make_step_lr_sweep_blown_members_step_as_alone(kind: str) -> None:
    """Member 1 grows huge but stays finite (Adam) or overflows slowly (SGD), member 3 is inf
    after one step and NaN after two: every member, losses included, is its torch twin's."""
    lrs = [1e-2, 1e6, 3e-2, 1e300]
    ens = vmapens.Ensemble(member, n=4, seed=0)
    plain = [copy.deepcopy(m) for m in ens.unstack()]
    stacked = vmapens.StackedAdam if kind == "adam" else vmapens.StackedSGD
    opt = stacked(ens, lr=lrs) if kind == "adam" else stacked(ens, lr=lrs, momentum=0.9)
    step = vmapens.make_step(ens, nn.MSELoss(), opt)
    losses = torch.stack([step(x, y).detach() for x, y in BATCHES], 1)
    for i, m in enumerate(plain):
        twin, alone = torch_twin(kind, m.parameters(), lrs[i]), []
        for x, y in BATCHES:
            twin.zero_grad()
            loss = nn.functional.mse_loss(m(x), y)
            loss.backward()
            twin.step()
            alone.append(loss.detach())
        torch.testing.assert_close(losses[i], torch.stack(alone), **TOL)
    assert losses[3, 1].isinf() and losses[3, 2:].isnan().all()  # the sweep blew up
    assert losses[[0, 2]].isfinite().all()
    assert_members(ens, plain, [0, 1, 2, 3])


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_hand_loop_clip_grad_norm_per_member_a_nan_norm_clips_no_one_else(norm_type: float) -> None:
    lrs = [1e-1, 1e300, 3e-1, 1e200]
    ens = vmapens.Ensemble(member, n=4, seed=0)
    plain = [copy.deepcopy(m) for m in ens.unstack()]
    opt = vmapens.StackedSGD(ens, lr=lrs, momentum=0.9)
    norms = []
    for x, y in BATCHES:
        opt.zero_grad()
        vmapens.per_member(nn.MSELoss())(ens(x), y).sum().backward()
        norms.append(vmapens.optim.clip_grad_norm_(ens, 0.5, norm_type=norm_type))
        opt.step()
    for i, m in enumerate(plain):
        twin, alone = torch.optim.SGD(m.parameters(), lr=lrs[i], momentum=0.9), []
        for x, y in BATCHES:
            twin.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            alone.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5, norm_type=norm_type))
            twin.step()
        torch.testing.assert_close(torch.stack(norms, 1)[i], torch.stack(alone), **TOL)
    assert torch.stack(norms, 1)[[1, 3], 1:].isnan().all()
    assert_members(ens, plain, [0, 1, 2, 3])
    with pytest.raises(
        RuntimeError, match=r"members?.*\b1\b"
    ):  # nothing clipped, the members named
        before = [p.grad.clone() for p in ens.parameters()]
        vmapens.optim.clip_grad_norm_(ens, 0.5, error_if_nonfinite=True)
    for p, b in zip(ens.parameters(), before, strict=True):
        assert_bit_identical(p.grad, b)


# -- fit: history, metric, early stopping, checkpoint, member files ---------------------------

LRS = [0.05, 0.9, 0.1, 1e200]  # member 1 degrades (early-stopped), member 3 diverges in epoch 0
EPOCHS, BATCH, SEED, PATIENCE = 4, 8, 2, 2


def fit_alone(m: nn.Module, lr: float) -> dict[str, Any]:
    """docs/fit.md's rules for one member alone: steps in the documented order; a step whose
    loss is not finite is taken, then the member stops (diverged: that epoch's validation is
    NaN); `patience` epochs without a lower validation loss stop it; the best epoch's weights
    come back at the end. Returns its numbers and its states at each epoch's end."""
    opt = torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9)
    plan = batch_plan(len(X), BATCH, EPOCHS * 3, seed=SEED)
    best, bad, best_epoch, best_state = math.inf, 0, -1, None
    out: dict[str, Any] = dict(train=[], val=[], mae=[], outputs=[], stopped=-1, diverged=False)
    for epoch in range(EPOCHS):
        if out["stopped"] < 0:
            losses = []
            for rows in plan[epoch * 3 : epoch * 3 + 3]:
                opt.zero_grad()
                loss = nn.functional.mse_loss(m(X[rows]), Y[rows])
                loss.backward()
                opt.step()
                losses.append(loss.item())
                if not math.isfinite(losses[-1]):
                    out["diverged"], out["stopped"] = True, epoch
                    break
            with torch.no_grad():
                v, a = nn.functional.mse_loss(m(XV), YV).item(), mae(m(XV), YV).item()
            if out["diverged"]:
                v = a = math.nan
            out["train"].append(sum(losses) / len(losses))
            out["val"].append(v)
            out["mae"].append(a)
            if v < best:
                best, bad, best_epoch, best_state = v, 0, epoch, copy.deepcopy(m.state_dict())
            elif not out["diverged"]:
                bad += 1
                if bad >= PATIENCE:
                    out["stopped"] = epoch
        with torch.no_grad():
            out["outputs"].append(m(XV))
    out["last"] = copy.deepcopy(m.state_dict())
    if best_state is not None:
        m.load_state_dict(best_state)
    out["best_epoch"] = best_epoch
    return out


def test_fit_lr_sweep_diverged_member_history_checkpoint_and_member_files(tmp_path) -> None:
    ens = vmapens.Ensemble(member, n=4, seed=0)
    plain = [copy.deepcopy(m) for m in ens.unstack()]
    options: dict[str, Any] = dict(
        optimizer=vmapens.StackedSGD, lr=LRS, momentum=0.9, epochs=EPOCHS, batch_size=BATCH,
        val_data=(XV, YV), metrics={"mae": mae}, patience=PATIENCE, seed=SEED, progress=False,
    )  # fmt: skip
    h = vmapens.fit(ens, (X, Y), nn.MSELoss(), checkpoint=tmp_path / "run.pt", **options)
    truth = [fit_alone(m, LRS[i]) for i, m in enumerate(plain)]

    assert h.diverged.tolist() == [t["diverged"] for t in truth] == [False, False, False, True]
    assert h.stopped_epoch.tolist() == [t["stopped"] for t in truth]
    assert h.best_epoch.tolist() == [t["best_epoch"] for t in truth]
    assert (h.stopped_epoch[:2] >= 0).all()  # members 0 and 1 early-stopped: patience was seen
    for i, t in enumerate(truth):
        e = len(t["train"])
        healthy = slice(None) if not t["diverged"] else slice(0, e - 1)
        torch.testing.assert_close(
            h.train_loss[:e, i][healthy], torch.tensor(t["train"], **F64)[healthy], **TOL
        )
        torch.testing.assert_close(h.val_loss[:e, i], torch.tensor(t["val"], **F64), **TOL)
        torch.testing.assert_close(h.metrics["mae"][:e, i], torch.tensor(t["mae"], **F64), **TOL)
        assert h.train_loss[e:, i].isnan().all() and h.val_loss[e:, i].isnan().all()
    # The epoch it diverged in: "non-finite" (the mean counts the frozen member's later steps).
    assert not h.train_loss[0, 3].isfinite()
    # The averaged output leaves the diverged member out, keeps the early-stopped ones.
    for e in range(EPOCHS):
        kept = [i for i, t in enumerate(truth) if not t["diverged"] or t["stopped"] > e]
        avg = torch.stack([truth[i]["outputs"][e] for i in kept]).mean(0)
        torch.testing.assert_close(h.ensemble_metrics["mae"][e], mae(avg, YV), **TOL)
    # Returned: best epochs back; member 3 had none, so it holds what its bad step left.
    assert_members(ens, plain, [0, 1, 2, 3])
    assert ens[3].state_dict()["2.weight"].isinf().any()

    # The checkpoint (verified on read) holds the last epoch's members, non-finite ones as such.
    last = [member() for _ in range(4)]
    for m, t in zip(last, truth, strict=True):
        m.load_state_dict(t["last"])
    assert_members(vmapens.load(tmp_path / "run.pt", member), last, [0, 1, 2, 3])
    # Member files of the returned ensemble: read back bit for bit, the NaN/inf member too.
    paths = vmapens.save_members(ens, tmp_path / "members")
    for i, state in enumerate(vmapens.load_members(tmp_path / "members")):
        assert_bit_identical(state, vmapens.load_member(paths[i]))
        assert_bit_identical(dict(state), {k: v for k, v in ens[i].state_dict().items()})
    # Resuming with more epochs ends as the run that never stopped (all members stop by 5).
    straight = vmapens.Ensemble(member, n=4, seed=0)
    h6 = vmapens.fit(
        straight, (X, Y), nn.MSELoss(), checkpoint=tmp_path / "b.pt", **{**options, "epochs": 6}
    )
    again = vmapens.Ensemble(member, n=4, seed=0)
    hr = vmapens.fit(
        again, (X, Y), nn.MSELoss(), checkpoint=tmp_path / "run.pt", **{**options, "epochs": 6}
    )
    assert_bit_identical(again.stacked_state(), straight.stacked_state())
    assert_bit_identical(hr.train_loss, h6.train_loss)


def test_fit_weight_decay_sweep_per_member_plateau_as_each_members_own() -> None:
    """Weight decay 1e100: the weights grow 1e100-fold a step; epoch 1's validation loss is inf
    while the training loss was finite (a bad epoch to its plateau, as torch's), epoch 2's
    training loss is inf (frozen, no more scheduler steps). Weight decay 30 only degrades."""
    x, y = X[:12], torch.cat([Y[:12], -Y[:12]], 1)
    xv, yv = XV[:6], torch.cat([YV[:6], YV[:6]], 1)
    wds, epochs = [0.0, 1e100, 1e-2, 30.0], 5
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 2).double(), n=4, seed=0)
    plain = [copy.deepcopy(m) for m in ens.unstack()]
    opt = vmapens.StackedSGD(ens, lr=0.3, momentum=0.5, weight_decay=wds)
    plateau = ReduceLROnPlateau(opt, patience=0, factor=0.5)
    h = vmapens.fit(ens, (x, y), nn.MSELoss(), optimizer=opt, scheduler=plateau, epochs=epochs,
                    val_data=(xv, yv), seed=0, progress=False)  # fmt: skip
    lrs = []
    for i, m in enumerate(plain):
        twin = torch.optim.SGD(m.parameters(), lr=0.3, momentum=0.5, weight_decay=wds[i])
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(twin, patience=0, factor=0.5)
        best, best_state, vals = math.inf, None, []
        for _ in range(epochs):
            twin.zero_grad()
            loss = nn.functional.mse_loss(m(x), y)
            loss.backward()
            twin.step()
            if not torch.isfinite(loss):
                break
            with torch.no_grad():
                vals.append(nn.functional.mse_loss(m(xv), yv).item())
            if vals[-1] < best:
                best, best_state = vals[-1], copy.deepcopy(m.state_dict())
            sched.step(vals[-1])
        m.load_state_dict(best_state)
        lrs.append(twin.param_groups[0]["lr"])
        torch.testing.assert_close(h.val_loss[: len(vals), i], torch.tensor(vals, **F64), **TOL)
    assert h.diverged.tolist() == [False, True, False, False] and h.val_loss[1, 1].isinf()
    assert list(opt.param_groups[0]["lr"]) == lrs and lrs[1] == 0.15
    assert_members(ens, plain, [0, 1, 2, 3])


# -- dropping the diverged members, predict ---------------------------------------------------


def test_select_the_healthy_members_and_train_on_as_alone() -> None:
    lrs, wds = [1e-2, 1e300, 3e-2, 1e6], [0.0, 0.0, 1e-2, 0.0]
    ens = vmapens.Ensemble(member, n=4, seed=0)
    plain = [copy.deepcopy(m) for m in ens.unstack()]
    opt = vmapens.StackedAdam(ens, lr=lrs, amsgrad=True, weight_decay=wds)
    step = vmapens.make_step(ens, nn.MSELoss(), opt)
    for x, y in BATCHES[:3]:
        losses = step(x, y)
    keep = [
        i
        for i in range(4)
        if all(bool(t[i].isfinite().all()) for t in ens.stacked_state().values())
    ]
    assert keep == [0, 2, 3] and losses[1].isnan()
    sub = ens.select(keep)
    sub_step = vmapens.make_step(sub, nn.MSELoss(), opt.select(keep, sub))
    for x, y in BATCHES[3:]:
        sub_step(x, y)
    for i, m in enumerate(plain):
        twin = torch.optim.Adam(m.parameters(), lr=lrs[i], amsgrad=True, weight_decay=wds[i])
        for x, y in BATCHES:
            twin.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            twin.step()
    assert_members(sub, [plain[i] for i in keep], [0, 1, 2])
    # The diverged member hands off to a plain torch Adam, NaN moments and all.
    alone = copy.deepcopy(ens[1])
    twin = torch.optim.Adam(alone.parameters(), amsgrad=True)
    twin.load_state_dict(opt.member_state_dict(1, module=alone))
    assert twin.param_groups[0]["lr"] == 1e300
    assert all(s["exp_avg"].isnan().all() for s in twin.state.values())


@pytest.mark.parametrize("softmax", [False, True])
def test_predict_with_nan_and_inf_members_reduces_as_by_hand(softmax: bool) -> None:
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 4).double(), n=4, seed=0)
    with torch.no_grad():
        ens.weight[1, 0, 0], ens.bias[3, 2] = math.nan, math.inf
    outs = [m(XV).detach() for m in ens.unstack()]
    outs = [o.softmax(-1) for o in outs] if softmax else outs
    reductions = ["none", "mean", "min", "max", "variance", "vote", "disagreement"]
    for reduce in reductions + (["entropy", "mutual_information"] if softmax else []):
        got = vmapens.predict(ens, XV, reduce=reduce, softmax=softmax)
        torch.testing.assert_close(got, reduce_by_hand(outs, reduce), **TOL, msg=reduce)


# -- the first-step self-check with non-finite values -----------------------------------------


class LogLoss(nn.Module):
    """A loss that is NaN for a member whose mean output is below -5 (log of a negative), with
    finite gradients there: alone, torch steps such a member on."""

    def forward(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out, target) + torch.log(out.mean() + 5)


def test_first_step_self_check_takes_member_zeros_nan_loss() -> None:
    ens = vmapens.Ensemble(member, n=3, seed=0)
    with torch.no_grad():
        ens.stacked_state()["2.bias"][0] = -10.0  # member 0, the probed one, has a NaN loss
    plain = [copy.deepcopy(m) for m in ens.unstack()]
    fitted = copy.deepcopy(ens)
    step = vmapens.make_step(ens, LogLoss(), vmapens.StackedSGD(ens, lr=0.05))
    losses = torch.stack([step(x, y).detach() for x, y in BATCHES[:3]], 1)
    h = vmapens.fit(fitted, BATCHES[:3], LogLoss(), optimizer=vmapens.StackedSGD, lr=0.05,
                    epochs=1, progress=False, seed=0)  # fmt: skip
    assert losses[0].isnan().all() and losses[1:].isfinite().all()
    frozen = copy.deepcopy(plain[0])
    for i, m in enumerate(plain):
        twin = torch.optim.SGD(m.parameters(), lr=0.05)
        for k, (x, y) in enumerate(BATCHES[:3]):
            twin.zero_grad()
            LogLoss()(m(x), y).backward()
            twin.step()
            if i == 0 and k == 0:
                frozen.load_state_dict(m.state_dict())  # fit: frozen after its first bad step
    assert_members(ens, plain, [0, 1, 2])  # make_step: trained on with finite weights, as alone
    assert h.diverged.tolist() == [True, False, False]
    assert_members(fitted, [frozen, *plain[1:]], [0, 1, 2])


class QuantisedWithScale(nn.Module):
    """A quantised linear layer trained with a straight-through estimator when its weight
    reports `requires_grad`, the class of forward the self-check is there for (docs/semantics.md
    "How vmapens checks itself"), and a learnable scale that starts at 0 under a square root:
    its first gradient is -inf, which `clip_grad_value` makes -1, and training goes on."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.s = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.fc.weight
        q = torch.round(w * 4) / 4
        w = w + (q - w).detach() if w.requires_grad else q  # inside vmap: no gradient through
        return nn.functional.linear(x, w, self.fc.bias) + torch.sqrt(self.s)


class SignedScale(nn.Module):
    """`sqrt` of a scale that starts at 0, added or subtracted by whether it reports
    `requires_grad`: the outputs (+0, -0) and the loss agree, the scale's gradient is -inf alone
    and +inf inside the ensemble."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.s = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sign = 1.0 if self.s.requires_grad else -1.0
        return self.fc(x) + sign * torch.sqrt(self.s)


def test_self_check_is_not_blinded_by_an_inf_gradient() -> None:
    ens = vmapens.Ensemble(QuantisedWithScale, n=2, seed=0).double()
    step = vmapens.make_step(
        ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1), clip_grad_value=1.0
    )
    x, y = XV[:8], torch.full((8, 2), 5.0, **F64)
    # Without the scale the check refuses (`fc.weight`'s gradient differs by 3.99); with it,
    # the step trains member 0's weight with zero gradients where alone it moves 0.1 a step.
    with pytest.raises(RuntimeError, match=r"gradient of `fc.weight` differs"):
        step(x, y)


def test_self_check_tells_plus_from_minus_infinity() -> None:
    ens = vmapens.Ensemble(SignedScale, n=2, seed=0).double()
    step = vmapens.make_step(
        ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1), clip_grad_value=1.0
    )
    x, y = XV[:8], torch.full((8, 2), 5.0, **F64)
    # Accepted, member 0's scale steps to -0.1 (its next loss NaN) where alone it steps to +0.1
    # and trains on (loss 24.4 then 19.4).
    with pytest.raises(RuntimeError, match=r"gradient of `s`"):
        step(x, y)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_self_checks_infinities_round_off_only_in_half_precision(dtype: torch.dtype) -> None:
    """docs/semantics.md, "How vmapens checks itself": in half precision a value at the top of
    the range rounds to inf on one side and stays finite on the other (a loss scaler's
    overflow), and is accepted; +inf against -inf never is, nor inf against a number in
    float32."""
    top = torch.finfo(dtype).max
    alone = torch.tensor([1.0, float("inf"), 2.0], dtype=dtype)
    rounded = torch.tensor([1.0, top, 2.0], dtype=dtype)
    flipped = torch.tensor([1.0, float("-inf"), 2.0], dtype=dtype)
    found = list(_close("g", alone, rounded, None))
    assert found == (
        [] if dtype in (torch.float16, torch.bfloat16) else ["g is infinite in other places"]
    )
    assert list(_close("g", alone, flipped, None)) == ["g is +inf where the other is -inf"]
    assert list(_close("g", alone, alone.clone(), None)) == []
