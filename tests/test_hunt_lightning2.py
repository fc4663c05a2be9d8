"""vmapens.lightning, hunted against plain Lightning and plain torch: what a checkpoint written
inside an epoch (``ModelCheckpoint(every_n_train_steps=...)``) holds of the schedulers, and
the schedulers' ``lr_scheduler_step`` hook."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from truth import assert_members_equal, train_alone, twins

import vmapens
from vmapens.lightning import EnsembleModule

QUIET = dict(
    enable_progress_bar=False,
    enable_model_summary=False,
    accelerator="cpu",
    num_sanity_val_steps=0,
    logger=False,
)
LRS = [0.1, 0.2]


def linear() -> nn.Module:
    return nn.Linear(3, 1).double()


def train_data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 3, generator=g, dtype=torch.float64)
    y = torch.randn(24, 1, generator=g, dtype=torch.float64)
    return DataLoader(TensorDataset(x, y), batch_size=8)


def step_lr(opt: Any, interval: str) -> dict[str, Any]:
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": interval}}


class Scheduled(EnsembleModule):
    def __init__(self, interval: str) -> None:
        ens = vmapens.Ensemble(linear, n=len(LRS), seed=0)
        opt = functools.partial(vmapens.StackedSGD, lr=torch.tensor(LRS, dtype=torch.float64))
        super().__init__(ens, nn.MSELoss(), optimizer=opt)
        self.interval = interval

    def configure_optimizers(self) -> Any:
        return step_lr(super().configure_optimizers(), self.interval)


class Plain(L.LightningModule):
    """One member, as a Lightning user trains it alone (automatic optimization)."""

    def __init__(self, m: nn.Module, lr: float, interval: str) -> None:
        super().__init__()
        self.m, self.lr, self.interval = m, lr, interval

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.m(batch[0]), batch[1])

    def configure_optimizers(self) -> Any:
        return step_lr(torch.optim.SGD(self.parameters(), lr=self.lr), self.interval)


def saved_lrs(root: Path, module: L.LightningModule) -> list[tuple[str, Any, Any]]:
    """Fit one epoch, saving after every step; each checkpoint's scheduler and optimizer lr."""
    saver = ModelCheckpoint(root, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    val = [train_data()] if isinstance(module, EnsembleModule) else []
    L.Trainer(max_epochs=1, callbacks=[saver], **QUIET).fit(module, train_data(), *val)
    out = []
    for path in sorted(root.glob("step=*.ckpt")):
        ck = torch.load(path, weights_only=False)
        sched = ck["lr_schedulers"][0]
        out.append((path.name, sched["last_epoch"], ck["optimizer_states"][0]["param_groups"]))
    return out


# Lightning (2.6) warns for every manual-optimization module that its checkpoints hold the
# state after the step, as they do for a plain (automatic) module: what this test wants.
@pytest.mark.filterwarnings("ignore:Using ModelCheckpoint with manual optimization")
@pytest.mark.parametrize("interval", ["step", "epoch"])
def test_a_checkpoint_written_after_a_step_holds_the_stepped_scheduler(tmp_path: Path, interval):
    # The module stepped the schedulers in its own on_train_batch_end, which Lightning calls
    # after the callbacks' (ModelCheckpoint(every_n_train_steps=...) saves there): every such
    # checkpoint held the scheduler one step behind, and a run resumed from it kept the whole
    # schedule one step late. Plain Lightning steps them before the callbacks run.
    got = saved_lrs(tmp_path / "ens", Scheduled(interval))
    start = vmapens.Ensemble(linear, n=len(LRS), seed=0).unstack()
    for i, m in enumerate(twins(start)):
        want = saved_lrs(tmp_path / f"plain{i}", Plain(m, LRS[i], interval))
        assert [w[:2] for w in want] == [g[:2] for g in got]
        for (name, _, groups), (_, _, plain_groups) in zip(got, want, strict=True):
            assert float(groups[0]["lr"][i]) == plain_groups[0]["lr"], (name, i)


class Recording:
    """An ``lr_scheduler_step`` override that records where it is called, then steps."""

    calls: list[tuple[int, int, str]]

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        trainer: Any = self.trainer  # type: ignore[attr-defined]
        where = (trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_idx)
        self.calls.append((*where, type(scheduler).__name__))
        scheduler.step()


class RecordingScheduled(Recording, Scheduled):
    pass


class RecordingPlain(Recording, Plain):
    pass


def test_schedulers_are_stepped_through_the_lr_scheduler_step_hook() -> None:
    # Lightning steps a module's schedulers through its `lr_scheduler_step` hook, which users
    # override for schedulers with another step signature (timm's step(epoch)); the module
    # called scheduler.step() itself, so an override was silently skipped.
    kw = dict(max_epochs=2, enable_checkpointing=False, **QUIET)
    ens, plain = RecordingScheduled("step"), RecordingPlain(linear(), LRS[0], "step")
    ens.calls, plain.calls = [], []
    L.Trainer(**kw).fit(ens, train_data(), train_data())
    L.Trainer(**kw).fit(plain, train_data())
    assert ens.calls == plain.calls and len(plain.calls) == 6


def test_a_torch_optimizer_class_is_refused_naming_its_stacked_twin() -> None:
    # torch.optim.Adam is callable, so it passed as `optimizer` and failed at trainer.fit, deep
    # in torch ("optimizer can only optimize Tensors, but one of the params is ...Linear").
    ens = vmapens.Ensemble(linear, n=2, seed=0)
    for opt in (torch.optim.Adam, functools.partial(torch.optim.SGD, lr=0.1)):
        with pytest.raises(
            TypeError, match=r"EnsembleModule: `optimizer` .*optim\.stacked\(torch\.optim"
        ):
            EnsembleModule(ens, nn.MSELoss(), optimizer=opt)
    twin = functools.partial(vmapens.optim.stacked(torch.optim.SGD), lr=0.1)
    assert isinstance(EnsembleModule(ens, nn.MSELoss(), optimizer=twin).configure_optimizers(),
                      vmapens.StackedSGD)  # fmt: skip


def weighted_mse(out: torch.Tensor, target: Any) -> torch.Tensor:
    y, w = target
    return (w * (out - y) ** 2).mean()


class Weighted(torch.utils.data.Dataset):
    """``(x, (y, w))`` rows: targets a pair, as a weighted loss takes them."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(20, 3, generator=g), torch.randn(20, 1, generator=g)
        self.w = torch.rand(20, 1, generator=g)

    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> Any:
        return self.x[i].double(), (self.y[i].double(), self.w[i].double())


def test_targets_that_are_a_pair_train_and_validate_as_members_alone() -> None:
    # make_step takes targets that are a tuple (a weighted loss's (y, w)), and a DataLoader
    # collates them into a list; the module read `targets.shape` for the logged batch size and
    # crashed after the step had changed the members.
    ens = vmapens.Ensemble(linear, n=len(LRS), seed=0)
    start = ens.unstack()
    opt = functools.partial(vmapens.StackedSGD, lr=torch.tensor(LRS, dtype=torch.float64))
    mod = EnsembleModule(ens, weighted_mse, optimizer=opt)
    train, val = DataLoader(Weighted(), batch_size=8), DataLoader(Weighted(), batch_size=12)
    trainer = L.Trainer(max_epochs=1, enable_checkpointing=False, **QUIET)
    trainer.fit(mod, train, val)
    alone = twins(start)
    for i, m in enumerate(alone):
        train_alone(m, list(train), weighted_mse, torch.optim.SGD(m.parameters(), lr=LRS[i]))
        with torch.no_grad():  # the row-weighted mean of the batch losses
            want = sum(weighted_mse(m(x), t) * len(x) for x, t in val) / len(val.dataset)
        got = trainer.callback_metrics[f"val_loss/member_{i}"]
        torch.testing.assert_close(got.double(), want, rtol=1e-9, atol=1e-10)
    assert_members_equal(ens, alone)


def test_a_metric_calling_item_is_logged_per_member_as_alone():
    # A metric that reads a value (`.item()`) failed in validation_step inside vmap; fit ran it
    # member by member already. Truth: the metric on each member's own output, by plain torch,
    # averaged over the validation batches by their rows (Lightning's batch_size weighting).
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 3, generator=g), torch.randn(12, 1, generator=g)
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 1), 3, seed=0)
    module = EnsembleModule(
        ens, nn.MSELoss(), metrics={"mae": lambda o, t: (o - t).abs().mean().item()}
    )
    trainer = L.Trainer(max_epochs=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.validate(module, DataLoader(TensorDataset(x, y), batch_size=8), verbose=False)
    for i in range(3):
        member = ens[i]
        with torch.no_grad():
            parts = [(member(x[k : k + 8]) - y[k : k + 8]).abs().mean().item() * len(y[k : k + 8])
                     for k in (0, 8)]  # fmt: skip
        got = float(trainer.callback_metrics[f"val_mae/member_{i}"])
        assert got == pytest.approx(sum(parts) / 12, rel=1e-6)
