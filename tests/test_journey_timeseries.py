"""A user journey: deep ensembles of small forecasting models (probabilistic forecasts).

The script a researcher writes from README.md, docs/fit.md, docs/optim.md ("Learning-rate
schedulers"), docs/semantics.md and docs/workflows.md ("Predictions and uncertainty"):

* a TCN: causal `nn.Conv1d` (kernel 2, dilation 1, 2, 4, left padding with `F.pad`), each conv
  under `torch.nn.utils.parametrizations.weight_norm` as in the TCN paper, `nn.GroupNorm` (or
  `nn.LayerNorm` over channels with a transpose), a residual 1x1 conv; RevIN-style per-window
  normalisation in the forward (mean and std over time with `keepdim`, subtracted and added
  back); a 5-step forecast made inside the forward by a Python loop that feeds each step's
  input back with `torch.cat`: the true value (teacher forcing) or the prediction
  (autoregressive), switched by a flag on `ens.template` mid-training; a Gaussian head (softplus
  variance) trained with the NLL;
* an N-BEATS-like MLP (blocks with a backcast and a forecast, the backcast subtracted) with three
  quantile outputs and the pinball loss;
* training with `make_step` on bootstrap windows per member (`in_dims=0`) with torch's AdamW
  (`vmapens.optim.stacked`) and one learning rate per member under `CosineAnnealingLR`; with
  `fit` over a shuffled `DataLoader` of sliding windows (the last batch smaller,
  `drop_last=False`), a cosine schedule per step (`LRScheduler(interval="step")`), validation
  and early stopping; `fit` on tensor windows with `bootstrap=True`, out-of-bag validation and
  `nn.GaussianNLLLoss` under `backend="loop"` (docs/semantics.md: it is refused in a batched
  step, naming that way out); then `predict` (the ensemble mean and the mixture variance, mean
  of the variances plus the variance of the means, by hand from the members' outputs), member
  files and `unstack`.

The truth: each member a plain module (built as the docs say member i is built: the factory
after `torch.manual_seed(member_seed(seed, i))`) trained alone with `torch.optim` (Adam, AdamW)
and torch's scheduler on the same batches (a twin DataLoader seeded alike, docs/fit.md's
batch order and resamples), early stopping and the best-epoch restore by EarlyStopping's
documented rule. float64: the same maths, sums in another order, hence TOL.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.parametrizations import weight_norm
from torch.utils.data import DataLoader, Dataset, TensorDataset
from truth import batch_plan, factory_members, resample

import vmapens
from vmapens.callbacks import LRScheduler

N, CTX, H, SEED = 3, 10, 5, 0
TAUS = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
TOL: dict[str, Any] = {"rtol": 1e-9, "atol": 1e-10}  # float64, sums in another order

_g = torch.Generator().manual_seed(0)
_t = torch.arange(64, dtype=torch.float64)
SERIES = (
    2.0
    + torch.sin(0.5 * _t)
    + 0.4 * torch.sin(1.3 * _t + 1.0)
    + 0.1 * torch.randn(64, generator=_g, dtype=torch.float64)
)
WINDOWS = SERIES.unfold(0, CTX + H, 1)  # [50, CTX + H]: sliding windows
TRAIN, VAL = WINDOWS[:30], WINDOWS[34:]
X, Y = TRAIN[:, :CTX].contiguous(), TRAIN[:, CTX:].contiguous()
XV, YV = VAL[:, :CTX].contiguous(), VAL[:, CTX:].contiguous()


# -- the models ---------------------------------------------------------------------------------


def revin(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """RevIN without its affine part: the window normalised over time, and its statistics."""
    mu = x.mean(-1, keepdim=True)
    sd = (x.var(-1, keepdim=True, unbiased=False) + 1e-5).sqrt()
    return (x - mu) / sd, mu, sd


class TemporalBlock(nn.Module):
    def __init__(self, cin: int, cout: int, dilation: int, norm: str) -> None:
        super().__init__()
        self.left = dilation  # (kernel_size - 1) * dilation
        self.conv = weight_norm(nn.Conv1d(cin, cout, 2, dilation=dilation))
        self.norm_kind = norm
        self.norm = nn.GroupNorm(2, cout) if norm == "group" else nn.LayerNorm(cout)
        self.res = nn.Conv1d(cin, cout, 1)

    def forward(self, x: Tensor) -> Tensor:  # [B, C, T]
        h = self.conv(F.pad(x, (self.left, 0)))
        if self.norm_kind == "group":
            h = self.norm(h)
        else:  # LayerNorm over channels: channels last and back
            h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        return torch.relu(h) + self.res(x)


class TCN(nn.Module):
    """One step ahead from a window; `forward` rolls H steps out inside itself."""

    def __init__(self, norm: str = "group") -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            TemporalBlock(1, 4, 1, norm), TemporalBlock(4, 4, 2, norm), TemporalBlock(4, 4, 4, norm)
        )
        self.head = nn.Linear(4, 2)
        self.teacher_forcing = True

    def one_step(self, x: Tensor) -> tuple[Tensor, Tensor]:
        z, mu, sd = revin(x)
        out = self.head(self.blocks(z.unsqueeze(1))[:, :, -1])
        return out[:, :1] * sd + mu, F.softplus(out[:, 1:]) * sd**2 + 1e-4

    def forward(self, ctx: Tensor, future: Tensor | None = None) -> tuple[Tensor, Tensor]:
        means, variances, x = [], [], ctx
        for k in range(H):
            mean, var = self.one_step(x)
            means.append(mean)
            variances.append(var)
            fed = future[:, k : k + 1] if self.teacher_forcing and future is not None else mean
            x = torch.cat([x[:, 1:], fed], 1)
        return torch.cat(means, 1), torch.cat(variances, 1)


class NBeatsBlock(nn.Module):
    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.fc = nn.Sequential(
            nn.Linear(CTX, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU()
        )
        self.backcast = nn.Linear(hidden, CTX)
        self.forecast = nn.Linear(hidden, H * len(TAUS))


class NBeats(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stack = nn.ModuleList([NBeatsBlock(), NBeatsBlock()])

    def forward(self, x: Tensor) -> Tensor:  # [B, CTX] -> quantiles [B, H, Q]
        r, mu, sd = revin(x)
        f = 0.0
        for block in self.stack:
            h = block.fc(r)
            r = r - block.backcast(h)
            f = f + block.forecast(h)
        return f.view(-1, H, len(TAUS)) * sd.unsqueeze(-1) + mu.unsqueeze(-1)


class FirstOutput(nn.Module):
    """A member's forecast mean alone (its first output), for the tensor reductions."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)[0]


def tcn() -> nn.Module:
    return TCN("group").double()


def tcn_ln() -> nn.Module:
    return TCN("layer").double()


def nbeats() -> nn.Module:
    return NBeats().double()


def nll(out: tuple[Tensor, Tensor], y: Tensor) -> Tensor:
    """`nn.GaussianNLLLoss`'s formula (full=False, mean) without its value check."""
    mean, var = out
    return 0.5 * (var.log() + (mean - y) ** 2 / var).mean()


def gaussian_nll(out: tuple[Tensor, Tensor], y: Tensor) -> Tensor:
    return nn.GaussianNLLLoss()(out[0], y, out[1])


def pinball(q: Tensor, y: Tensor) -> Tensor:
    e = y.unsqueeze(-1) - q
    return torch.maximum(TAUS * e, (TAUS - 1) * e).mean()


def alone_members(
    factory: Callable[[], nn.Module], n: int = N, seed: int = SEED
) -> list[nn.Module]:
    return factory_members([factory] * n, seed=seed)


def assert_members(ens: vmapens.Ensemble, alone: list[nn.Module], **tol: Any) -> None:
    tol = tol or TOL
    assert len(ens) == len(alone)
    for i, m in enumerate(alone):
        got, want = ens[i].state_dict(), m.state_dict()
        assert list(got) == list(want)
        for k in want:
            torch.testing.assert_close(got[k], want[k], **tol, msg=f"member {i} {k}")


# -- make_step: bootstrap windows per member, AdamW, per-member lr under a cosine schedule ------

LRS, WD, STEPS, BATCH, SWITCH = [1e-2, 2e-2, 5e-3], 0.05, 4, 8, 2


def test_tcn_make_step_adamw_cosine_bootstrap_windows_teacher_forcing_then_rollout() -> None:
    ens = vmapens.Ensemble(tcn, n=N, seed=SEED)
    alone = alone_members(tcn)
    assert_members(ens, alone, rtol=0, atol=0)  # member i is the factory under its seed
    opt = vmapens.optim.stacked(torch.optim.AdamW)(ens, lr=LRS, weight_decay=WD)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS, eta_min=1e-4)
    step = vmapens.make_step(ens, nll, opt, in_dims=0)
    rows = [vmapens.seeds.bootstrap_indices(len(X), 7, i) for i in range(N)]
    for i in range(N):  # the documented resample, written again from docs/fit.md "Bagging"
        torch.testing.assert_close(rows[i], resample(len(X), 7, i), rtol=0, atol=0)
    plan = batch_plan(len(X), BATCH, STEPS, seed=1)
    for k, pos in enumerate(plan):
        if k == SWITCH:  # curriculum: from teacher forcing to the autoregressive rollout
            ens.template.teacher_forcing = False
        xs = torch.stack([X[r[pos]] for r in rows])
        ys = torch.stack([Y[r[pos]] for r in rows])
        losses = step((xs, ys), ys)
        sched.step()
    assert losses.shape == (N,)

    for i, m in enumerate(alone):
        o = torch.optim.AdamW(m.parameters(), lr=LRS[i], weight_decay=WD)
        s = torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=STEPS, eta_min=1e-4)
        for k, pos in enumerate(plan):
            m.teacher_forcing = k < SWITCH
            o.zero_grad()
            nll(m(X[rows[i][pos]], Y[rows[i][pos]]), Y[rows[i][pos]]).backward()
            o.step()
            s.step()
        assert opt.param_groups[0]["lr"][i] == o.param_groups[0]["lr"]
    assert_members(ens, alone)
    # the flag set on the template reached the members, and `ens[i]`
    assert ens[0].teacher_forcing is False


# -- fit over a shuffled DataLoader, a cosine schedule per step, validation, early stopping -----

EPOCHS, LOADER_BATCH, PATIENCE, NB_LRS = 6, 7, 1, [5e-2, 2e-1, 1e-2]


def loader() -> DataLoader:
    # 30 windows in batches of 7: the last batch has 2 windows
    return DataLoader(TensorDataset(X, Y), batch_size=LOADER_BATCH, shuffle=True,
                      generator=torch.Generator().manual_seed(11), drop_last=False)  # fmt: skip


def nbeats_alone(m: nn.Module, lr: float) -> dict[str, Any]:
    """One N-BEATS member alone: its own loader twin, Adam, a cosine schedule stepped after each
    optimizer step, the validation loss after each epoch, EarlyStopping's rule (an improvement
    is strictly lower; stop after PATIENCE epochs without one) and the best epoch restored."""
    opt = torch.optim.Adam(m.parameters(), lr=lr)
    steps = EPOCHS * len(loader())
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    best, bad, state, best_epoch, stopped, sizes = math.inf, 0, None, -1, -1, []
    data = loader()
    for epoch in range(EPOCHS):
        for x, y in data:
            sizes.append(len(x))
            opt.zero_grad()
            pinball(m(x), y).backward()
            opt.step()
            sched.step()
        with torch.no_grad():
            val = float(pinball(m.eval()(XV), YV))
        m.train()
        if val < best:
            best, bad, state, best_epoch = val, 0, copy.deepcopy(m.state_dict()), epoch
        else:
            bad += 1
        if bad >= PATIENCE:
            stopped = epoch
            break
    m.load_state_dict(state)
    return {"lr": opt.param_groups[0]["lr"], "best": best_epoch, "stopped": stopped, "sizes": sizes}


def test_nbeats_fit_over_a_shuffled_dataloader_with_cosine_and_early_stopping() -> None:
    ens = vmapens.Ensemble(nbeats, n=N, seed=SEED)
    opt = vmapens.StackedAdam(ens, lr=NB_LRS)
    steps = EPOCHS * len(loader())
    cosine = LRScheduler(lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=steps),
                         interval="step")  # fmt: skip
    history = vmapens.fit(ens, loader(), pinball, epochs=EPOCHS, optimizer=opt, val_data=(XV, YV),
                          patience=PATIENCE, callbacks=[cosine], progress=False)  # fmt: skip
    alone = alone_members(nbeats)
    runs = [nbeats_alone(m, NB_LRS[i]) for i, m in enumerate(alone)]
    assert runs[0]["sizes"][: len(loader())] == [7, 7, 7, 7, 2]  # the last batch is smaller
    assert history.best_epoch.tolist() == [r["best"] for r in runs]
    assert history.stopped_epoch.tolist() == [r["stopped"] for r in runs]
    assert len({r["stopped"] for r in runs}) > 1, "members stop at different epochs"
    assert_members(ens, alone)
    for i, r in enumerate(runs):  # a stopped member's lr stays where its schedule left it
        assert opt.param_groups[0]["lr"][i] == pytest.approx(r["lr"], rel=1e-15, abs=0)


# -- fit on bootstrap windows: nn.GaussianNLLLoss under backend="loop", out-of-bag validation --

FIT_LR, FIT_WD, FIT_EPOCHS, FIT_BATCH, FIT_SEED = 2e-2, 0.1, 3, 8, 4


def tcn_fit_alone(m: nn.Module, i: int) -> dict[str, Any]:
    """Member i alone: its resample, docs/fit.md's batch order, AdamW, the out-of-bag NLL after
    each epoch (eval mode, no grad), the best epoch restored (no patience: all epochs run)."""
    rows = resample(len(X), FIT_SEED, i)
    oob = torch.ones(len(X), dtype=torch.bool)
    oob[rows] = False
    opt = torch.optim.AdamW(m.parameters(), lr=FIT_LR, weight_decay=FIT_WD)
    plan = batch_plan(len(X), FIT_BATCH, FIT_EPOCHS * 4, seed=FIT_SEED)
    best, state, vals = math.inf, None, []
    for epoch in range(FIT_EPOCHS):
        for pos in plan[epoch * 4 : (epoch + 1) * 4]:
            r = rows[pos]
            opt.zero_grad()
            gaussian_nll(m(X[r], Y[r]), Y[r]).backward()
            opt.step()
        with torch.no_grad():
            vals.append(float(gaussian_nll(m.eval()(X[oob], Y[oob]), Y[oob])))
        m.train()
        if vals[-1] < best:
            best, state = vals[-1], copy.deepcopy(m.state_dict())
    m.load_state_dict(state)
    return {"val": vals}


@pytest.fixture(scope="module")
def fitted() -> tuple[vmapens.Ensemble, list[nn.Module], vmapens.History]:
    ens = vmapens.Ensemble(tcn_ln, n=N, seed=SEED, backend="loop")
    adamw = vmapens.optim.stacked(torch.optim.AdamW)
    history = vmapens.fit(ens, ((X, Y), Y), gaussian_nll, epochs=FIT_EPOCHS, batch_size=FIT_BATCH,
                          bootstrap=True, val_data="oob", optimizer=adamw, lr=FIT_LR,
                          weight_decay=FIT_WD, seed=FIT_SEED, progress=False)  # fmt: skip
    alone = alone_members(tcn_ln)
    runs = [tcn_fit_alone(m, i) for i, m in enumerate(alone)]
    history.runs = runs  # type: ignore[attr-defined]
    return ens, alone, history


def test_tcn_fit_bootstrap_oob_gaussian_nll_loop_backend_matches_alone(
    fitted: tuple[vmapens.Ensemble, list[nn.Module], vmapens.History],
) -> None:
    ens, alone, history = fitted
    want = torch.tensor([r["val"] for r in history.runs], dtype=torch.float64).T  # type: ignore[attr-defined]
    torch.testing.assert_close(history.val_loss, want, **TOL)
    assert history.best_epoch.tolist() == want.argmin(0).tolist()
    assert_members(ens, alone)


def test_predict_gives_the_mixture_mean_and_variance_of_the_members(
    fitted: tuple[vmapens.Ensemble, list[nn.Module], vmapens.History],
) -> None:
    ens, alone, _ = fitted
    assert ens.training
    with torch.no_grad():  # the rollout (no future given), each member alone in eval mode
        means = torch.stack([m.eval()(XV)[0] for m in alone])
        variances = torch.stack([m(XV)[1] for m in alone])
    mix_mean = means.mean(0)
    mix_var = variances.mean(0) + ((means - mix_mean) ** 2).mean(0)
    out_mean, out_var = vmapens.predict(ens, XV)
    torch.testing.assert_close(out_mean, means, **TOL)
    torch.testing.assert_close(out_var, variances, **TOL)
    # the mixture by hand from the members' outputs, cut in batches and from a DataLoader
    for data, size in ((XV, 4), (DataLoader(TensorDataset(XV), batch_size=3), None)):
        m_out, v_out = vmapens.predict(ens, data, batch_size=size)
        got_mean = m_out.mean(0)
        torch.testing.assert_close(got_mean, mix_mean, **TOL)
        torch.testing.assert_close(v_out.mean(0) + m_out.var(0, unbiased=False), mix_var, **TOL)
    # reduce="variance" is the population variance of the means (divides by n)
    by_members = vmapens.predict(vmapens.Ensemble.from_modules([FirstOutput(m) for m in alone]),
                                 XV, reduce="variance")  # fmt: skip
    torch.testing.assert_close(by_members, ((means - mix_mean) ** 2).mean(0), **TOL)
    # a reduction over a tuple output is refused, naming reduce="none"
    with pytest.raises(TypeError, match="reduce='none'"):
        vmapens.predict(ens, XV, reduce="mean")
    assert ens.training  # predict gave the mode back
    # per-member windows: member i forecasts its own windows
    own = torch.stack([XV[i : i + 4] for i in range(N)])
    got = vmapens.predict(ens, own, in_dims=0)[0]
    with torch.no_grad():
        torch.testing.assert_close(
            got, torch.stack([m(own[i])[0] for i, m in enumerate(alone)]), **TOL
        )


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_member_files_and_unstack_give_plain_weight_normed_tcns(
    fitted: tuple[vmapens.Ensemble, list[nn.Module], vmapens.History], tmp_path: Path, fmt: str
) -> None:
    ens, alone, _ = fitted
    paths = vmapens.save_members(ens, tmp_path, format=fmt)
    states = vmapens.load_members(tmp_path)
    for i, (path, state) in enumerate(zip(paths, states, strict=True)):
        plain = tcn_ln()
        plain.load_state_dict(state)
        assert isinstance(plain.blocks[0].conv.parametrizations.weight[0], type(
            alone[i].blocks[0].conv.parametrizations.weight[0]))  # fmt: skip
        member = ens[i].state_dict()
        for k, v in alone[i].state_dict().items():
            torch.testing.assert_close(plain.state_dict()[k], member[k], rtol=0, atol=0, msg=k)
            torch.testing.assert_close(plain.state_dict()[k], v, **TOL, msg=k)
        again = tcn_ln()
        again.load_state_dict(vmapens.load_member(path))
        with torch.no_grad():
            torch.testing.assert_close(again.eval()(XV), plain.eval()(XV), rtol=0, atol=0)
            torch.testing.assert_close(again(XV), alone[i].eval()(XV), **TOL)
    for i, m in enumerate(ens.unstack()):
        assert isinstance(m, TCN) and m.training
        with torch.no_grad():
            torch.testing.assert_close(m.eval()(XV, YV), alone[i].eval()(XV, YV), **TOL)


# -- refused: nn.GaussianNLLLoss in a batched fit, over a DataLoader of (ctx, future) windows -----


class Windows(Dataset):
    """Sliding windows as ((context, future), future): the future is the teacher-forcing input."""

    def __init__(self, w: Tensor) -> None:
        self.w = w

    def __len__(self) -> int:
        return len(self.w)

    def __getitem__(self, i: int) -> tuple[tuple[Tensor, Tensor], Tensor]:
        return (self.w[i, :CTX], self.w[i, CTX:]), self.w[i, CTX:]


def test_gaussian_nll_loss_in_a_batched_fit_is_refused_and_changes_nothing() -> None:
    ens = vmapens.Ensemble(tcn_ln, n=N, seed=SEED)
    before = copy.deepcopy(ens.state_dict())
    opt = vmapens.optim.stacked(torch.optim.AdamW)(ens, lr=LRS, weight_decay=WD)
    gen = torch.Generator().manual_seed(5)
    data = DataLoader(Windows(TRAIN), batch_size=LOADER_BATCH, shuffle=True, generator=gen)
    rng = gen.get_state()
    global_rng = torch.get_rng_state()
    cosine = LRScheduler(lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10),
                         interval="step")  # fmt: skip
    with pytest.raises(Exception, match="backend='loop'") as err:
        vmapens.fit(ens, data, gaussian_nll, epochs=2, optimizer=opt, callbacks=[cosine],
                    progress=False)  # fmt: skip
    assert "loss_fn" in str(err.value)
    for k, v in before.items():
        assert torch.equal(ens.state_dict()[k], v), k
    assert list(opt.param_groups[0]["lr"]) == LRS and "initial_lr" not in opt.param_groups[0]
    assert not opt.state
    assert torch.equal(gen.get_state(), rng) and torch.equal(torch.get_rng_state(), global_rng)
    # the way out: the same loader, the loss without its value check, trains as alone on the
    # loader's ((context, future), future) batches, the future fed as the teacher's input
    vmapens.fit(ens, data, nll, epochs=1, optimizer=opt, progress=False)
    alone = alone_members(tcn_ln)
    for i, m in enumerate(alone):
        o = torch.optim.AdamW(m.parameters(), lr=LRS[i], weight_decay=WD)
        twin = torch.Generator().manual_seed(5)
        for (ctx, future), y in DataLoader(Windows(TRAIN), LOADER_BATCH, True, generator=twin):
            o.zero_grad()
            nll(m(ctx, future), y).backward()
            o.step()
    assert_members(ens, alone)


# -- validation metrics of a (mean, variance) output; out-of-bag validation takes none ----------


def mae(out: tuple[Tensor, Tensor], y: Tensor) -> Tensor:
    return (out[0] - y).abs().mean()


def test_metrics_of_the_gaussian_head_per_member_and_of_the_averaged_output() -> None:
    ens = vmapens.Ensemble(tcn_ln, n=N, seed=SEED)
    before = copy.deepcopy(ens.state_dict())
    with pytest.raises(ValueError, match="`metrics` need shared `val_data`"):
        vmapens.fit(ens, ((X, Y), Y), nll, epochs=2, batch_size=FIT_BATCH, bootstrap=True,
                    val_data="oob", metrics={"mae": mae}, seed=FIT_SEED, progress=False)  # fmt: skip
    for k, v in before.items():
        assert torch.equal(ens.state_dict()[k], v), k
    history = vmapens.fit(ens, ((X, Y), Y), nll, epochs=2, batch_size=FIT_BATCH, lr=FIT_LR,
                          val_data=(XV, YV), metrics={"mae": mae}, seed=FIT_SEED,
                          progress=False)  # fmt: skip
    alone = alone_members(tcn_ln)
    plan = batch_plan(len(X), FIT_BATCH, 8, seed=FIT_SEED)
    per_member, averaged = [], []
    for m in alone:
        opt, rows = torch.optim.Adam(m.parameters(), lr=FIT_LR), []
        for epoch in range(2):
            for pos in plan[epoch * 4 : (epoch + 1) * 4]:
                opt.zero_grad()
                nll(m(X[pos], Y[pos]), Y[pos]).backward()
                opt.step()
            with torch.no_grad():
                rows.append(m.eval()(XV))  # val_data's input is XV alone: the rollout
            m.train()
        per_member.append([float(mae(o, YV)) for o in rows])
        averaged.append(rows)
    want = torch.tensor(per_member, dtype=torch.float64).T
    torch.testing.assert_close(history.metrics["mae"], want, **TOL)
    # the averaged output is averaged tensor by tensor (docs/workflows.md): the members' means
    ens_mae = [float(mae((torch.stack([a[e][0] for a in averaged]).mean(0), None), YV))
               for e in range(2)]  # fmt: skip
    torch.testing.assert_close(
        history.ensemble_metrics["mae"], torch.tensor(ens_mae, dtype=torch.float64), **TOL
    )
    assert_members(ens, alone)


def test_the_refusal_of_metrics_on_out_of_bag_rows_names_what_it_got_and_the_way_out() -> None:
    ens = vmapens.Ensemble(nbeats, n=N, seed=SEED)
    with pytest.raises(ValueError) as err:
        vmapens.fit(ens, (X, Y), pinball, bootstrap=True, val_data="oob", metrics={"mae": mae},
                    progress=False)  # fmt: skip
    assert "'oob'" in str(err.value) and "Callback" in str(err.value)
