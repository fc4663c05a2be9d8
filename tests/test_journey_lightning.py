"""A user journey: a BatchNorm MLP ensemble trained under ``lightning.Trainer`` with
``vmapens.lightning.EnsembleModule``.

The script a Lightning user writes: 4 float64 members, Adam with one learning rate per member,
per-member gradient-norm clipping, a ``StepLR`` or a ``vmapens.optim.ReduceLROnPlateau``
returned from ``configure_optimizers``, a validation loader with a metric, Lightning's own
``ModelCheckpoint`` and ``EarlyStopping`` on the averaged ``val_loss``, ``limit_train_batches``,
``trainer.fit`` for 4 epochs, then a new script resuming from ``last.ckpt`` for 2 more epochs,
``trainer.predict`` on the final members and on the best checkpoint. ``gradient_clip_val`` and
``accumulate_grad_batches`` are refused (docs/workflows.md, "Clipping and accumulation"): the
refusal must leave the module as it was, and the module's own option must clip as Lightning's
``gradient_clip_val`` clips one plain module.

The truth is the naive loop in plain PyTorch: 4 modules, each with its own ``torch.optim.Adam``
and torch scheduler, written from Lightning's documented loop: each epoch one iterator over the
shuffling train loader (its first ``limit_train_batches`` batches), a step per batch with
``clip_grad_norm_`` (Lightning's ``gradient_clip_algorithm="norm"``), then one pass over the
validation loader (a DataLoader iterator draws its base seed from the global RNG; Lightning's
sanity check runs under ``isolate_rng`` and draws nothing), the epoch schedulers, and
``EarlyStopping``'s rule (the monitor improves when strictly below its best; the run stops
after ``patience`` checks without improvement). ``ModelCheckpoint(save_top_k=1)`` keeps the
first epoch with the lowest ``val_loss``.
"""

from __future__ import annotations

import functools
import math
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import vmapens
from vmapens.lightning import EnsembleModule
from vmapens.optim import ReduceLROnPlateau

N, LRS, CLIP, LIMIT, BATCH, VAL_BATCH = 4, [0.003, 0.03, 0.1, 0.3], 0.5, 3, 8, 5
FIRST, MORE, DATA_SEED = 4, 2, 123
# EarlyStopping's patience: with 2, the plateau run stops inside the resumed script, on a
# count of checks without improvement that began before the checkpoint.
PATIENCE = {"step": 3, "plateau": 2}
TOL = dict(rtol=1e-9, atol=1e-10)
QUIET = dict(enable_progress_bar=False, logger=False, enable_model_summary=False, accelerator="cpu")

_g = torch.Generator().manual_seed(1)
X = torch.randn(40, 3, generator=_g, dtype=torch.float64)
Y = X.sum(1, keepdim=True).sin() + 0.3 * torch.randn(40, 1, generator=_g, dtype=torch.float64)
XV = torch.randn(12, 3, generator=_g, dtype=torch.float64)  # batches of 5, 5 and 2
YV = XV.sum(1, keepdim=True).sin()


def mlp() -> nn.Module:
    # No bias before BatchNorm: its true gradient is 0, which Adam would amplify from
    # round-off (docs/semantics.md).
    return nn.Sequential(
        nn.Linear(3, 8, bias=False), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1)
    ).double()


def mae(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).abs().mean()


def loaders() -> tuple[DataLoader, DataLoader]:
    return (
        DataLoader(TensorDataset(X, Y), batch_size=BATCH, shuffle=True),
        DataLoader(TensorDataset(XV, YV), batch_size=VAL_BATCH),
    )


class Journey(EnsembleModule):
    """The user's subclass: a scheduler from configure_optimizers, as Lightning users write."""

    def __init__(self, ens: vmapens.Ensemble, sched: str, **kw: Any) -> None:
        lr = torch.tensor(LRS, dtype=torch.float64)
        super().__init__(
            ens,
            nn.MSELoss(),
            optimizer=functools.partial(vmapens.StackedAdam, lr=lr),
            metrics={"mae": mae},
            **kw,
        )
        self.sched = sched

    def configure_optimizers(self) -> Any:
        opt = super().configure_optimizers()
        if self.sched == "step":
            sched: Any = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        else:
            sched = ReduceLROnPlateau(opt, factor=0.5, patience=0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}


def fresh(sched: str, **kw: Any) -> Journey:
    kw.setdefault("clip_grad_norm", CLIP)
    return Journey(vmapens.Ensemble(mlp, n=N, seeds=range(N)), sched, **kw)


def run(tmp: Path, sched: str, epochs: int, ckpt_path: str | None = None):
    module = fresh(sched)
    saver = ModelCheckpoint(dirpath=tmp, monitor="val_loss", save_last=True, save_top_k=1)
    stopper = EarlyStopping(monitor="val_loss", patience=PATIENCE[sched])
    trainer = L.Trainer(
        max_epochs=epochs, limit_train_batches=LIMIT, callbacks=[saver, stopper], **QUIET
    )
    train, val = loaders()
    torch.manual_seed(DATA_SEED)  # a resumed fit sets the checkpoint's RNG state instead
    with warnings.catch_warnings():  # Lightning's note that the resumed run's folder has files
        warnings.filterwarnings("ignore", "Checkpoint directory .* exists and is not empty")
        trainer.fit(module, train, val, ckpt_path=ckpt_path)
    return module, trainer, saver


def naive(sched: str, epochs: int) -> dict[str, Any]:
    """The plain-PyTorch loop, written from Lightning's documented loop (module docstring)."""
    models = []
    for k in range(N):  # Ensemble(seeds=range(N)): member k built after torch.manual_seed(k)
        torch.manual_seed(k)
        models.append(mlp())
    opts = [torch.optim.Adam(m.parameters(), lr=lr) for m, lr in zip(models, LRS)]
    scheds: list[Any] = [
        torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
        if sched == "step"
        else torch.optim.lr_scheduler.ReduceLROnPlateau(o, factor=0.5, patience=0)
        for o in opts
    ]
    train, val = loaders()
    torch.manual_seed(DATA_SEED)
    best, wait, history, snapshots, norms = math.inf, 0, [], [], []
    stopped = -1
    for epoch in range(epochs):
        for b, (x, y) in enumerate(train):
            if b == LIMIT:
                break
            for m, o in zip(models, opts):
                o.zero_grad()
                nn.functional.mse_loss(m(x), y).backward()
                norms.append(float(nn.utils.clip_grad_norm_(m.parameters(), CLIP)))
                o.step()
        losses, maes = [0.0] * N, [0.0] * N
        for m in models:
            m.eval()
        with torch.no_grad():
            for x, y in val:  # one iterator for all members, as Lightning's loop makes
                for i, m in enumerate(models):
                    out = m(x)
                    losses[i] += nn.functional.mse_loss(out, y).item() * len(y) / len(XV)
                    maes[i] += mae(out, y).item() * len(y) / len(XV)
        for m in models:
            m.train()
        for s, v in zip(scheds, losses):
            s.step() if sched == "step" else s.step(v)
        current = sum(losses) / N
        history.append(dict(loss=losses, mae=maes, mean=current))
        snapshots.append([{k: t.clone() for k, t in m.state_dict().items()} for m in models])
        if current < best:
            best, wait = current, 0
        else:
            wait += 1
            if wait >= PATIENCE[sched]:
                stopped = epoch
                break
    lrs = [o.param_groups[0]["lr"] for o in opts]
    return dict(models=models, history=history, snapshots=snapshots, norms=norms, lrs=lrs,
                stopped=stopped)  # fmt: skip


def assert_members(ens: vmapens.Ensemble, states: list[dict[str, torch.Tensor]]) -> None:
    for i, want in enumerate(states):
        got = ens[i].state_dict()
        assert list(got) == list(want)
        for key, t in want.items():
            torch.testing.assert_close(got[key], t, **TOL, msg=f"member {i} {key}")


def assert_logged(trainer: L.Trainer, epoch: dict[str, Any]) -> None:
    metrics = trainer.callback_metrics
    for i in range(N):
        for name in ("loss", "mae"):
            got = metrics[f"val_{name}/member_{i}"].double()
            torch.testing.assert_close(got.item(), epoch[name][i], **TOL)
    torch.testing.assert_close(metrics["val_loss"].double().item(), epoch["mean"], **TOL)


def outputs(states: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    out = []
    for state in states:
        m = mlp()
        m.load_state_dict(state)
        with torch.no_grad():
            out.append(m.eval()(XV))
    return torch.stack(out)


@pytest.mark.parametrize("sched", ["step", "plateau"])
def test_lightning_journey_matches_the_naive_loop(tmp_path: Path, sched: str) -> None:
    # Script 1: 4 epochs.
    module, trainer, saver = run(tmp_path, sched, FIRST)
    truth = naive(sched, FIRST)
    # The premises: clipping bites on some steps, not all; the run did not stop early.
    assert any(n > CLIP for n in truth["norms"]) and any(n < CLIP for n in truth["norms"])
    assert truth["stopped"] == -1 and trainer.current_epoch == FIRST
    assert_members(module.ens, [m.state_dict() for m in truth["models"]])
    assert_logged(trainer, truth["history"][-1])
    lr = trainer.optimizers[0].param_groups[0]["lr"]
    assert [float(v) for v in lr] == pytest.approx(truth["lrs"], rel=1e-12)

    # Script 2, a new process in real life: a fresh module resumed from last.ckpt.
    resumed, trainer2, saver2 = run(tmp_path, sched, FIRST + MORE, ckpt_path="last")
    truth = naive(sched, FIRST + MORE)
    ran = len(truth["history"])
    assert ran > FIRST  # the resumed script trained
    assert (truth["stopped"] == FIRST) == (sched == "plateau")  # and the plateau run stopped
    stopper = next(c for c in trainer2.callbacks if isinstance(c, EarlyStopping))
    assert stopper.stopped_epoch == max(truth["stopped"], 0)
    assert trainer2.current_epoch == ran
    assert_members(resumed.ens, [m.state_dict() for m in truth["models"]])
    assert_logged(trainer2, truth["history"][-1])
    lr = trainer2.optimizers[0].param_groups[0]["lr"]
    assert [float(v) for v in lr] == pytest.approx(truth["lrs"], rel=1e-12)

    # Predict: every member in eval mode (BatchNorm's running statistics), then training again.
    pred = DataLoader(TensorDataset(XV), batch_size=VAL_BATCH)
    got = torch.cat(trainer2.predict(resumed, pred), dim=1)
    torch.testing.assert_close(got, outputs(truth["snapshots"][-1]), **TOL)
    assert all(m.training for m in resumed.ens[0].modules())
    # ModelCheckpoint's best: the first epoch with the lowest averaged val_loss, over both runs.
    means = [h["mean"] for h in truth["history"]]
    best = means.index(min(means))
    assert Path(saver2.best_model_path).name.startswith(f"epoch={best}-")
    got = torch.cat(trainer2.predict(resumed, pred, ckpt_path="best"), dim=1)
    torch.testing.assert_close(got, outputs(truth["snapshots"][best]), **TOL)


class Plain(L.LightningModule):
    """One member as a plain LightningModule: automatic optimization, Lightning clips."""

    def __init__(self, k: int, lr: float) -> None:
        super().__init__()
        torch.manual_seed(k)
        self.m, self.lr = mlp(), lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.m(batch[0]), batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def one_epoch(module: L.LightningModule, **trainer_kw: Any) -> None:
    trainer = L.Trainer(
        max_epochs=1, limit_train_batches=LIMIT, enable_checkpointing=False, **QUIET, **trainer_kw
    )
    train, val = loaders()
    torch.manual_seed(DATA_SEED)
    trainer.fit(module, train, val if isinstance(module, EnsembleModule) else None)


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_trainer_clipping_is_refused_untouched_and_the_modules_option_clips_as_lightning(
    algorithm: str,
) -> None:
    # The user passes the module's option and, out of habit, the Trainer's.
    module = fresh("step", clip_grad_norm=0.05 if algorithm == "norm" else None,
                   clip_grad_value=0.05 if algorithm == "value" else None)  # fmt: skip
    before = {k: t.clone() for k, t in module.state_dict().items()}
    with pytest.raises(ValueError, match=f"`gradient_clip_val`.*clip_grad_{algorithm}=0.05"):
        one_epoch(module, gradient_clip_val=0.05, gradient_clip_algorithm=algorithm)
    for k, t in module.state_dict().items():
        assert torch.equal(t, before[k]), k
    # The same module, the Trainer's option dropped: each member clipped exactly as Lightning's
    # gradient_clip_val clips it trained alone.
    one_epoch(module)
    for k, lr in enumerate(LRS):
        alone = Plain(k, lr)
        one_epoch(alone, gradient_clip_val=0.05, gradient_clip_algorithm=algorithm)
        for key, t in alone.m.state_dict().items():
            torch.testing.assert_close(module.ens[k].state_dict()[key], t, **TOL, msg=key)


def test_accumulate_grad_batches_is_refused_before_any_step() -> None:
    module = fresh("plateau")
    before = {k: t.clone() for k, t in module.state_dict().items()}
    with pytest.raises(ValueError, match="`accumulate_grad_batches` must be 1, got 2"):
        one_epoch(module, accumulate_grad_batches=2)
    for k, t in module.state_dict().items():
        assert torch.equal(t, before[k]), k
