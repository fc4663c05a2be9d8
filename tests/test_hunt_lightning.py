"""vmapens.lightning: the options a Lightning user reaches for, against plain torch and plain
Lightning: loading a checkpoint outside ``trainer.fit``, mid-epoch validation
(``val_check_interval``) with BatchNorm members, and ``ckpt_path="last"``."""

from __future__ import annotations

import functools
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from truth import TOL64, assert_bit_identical, assert_members_equal, train_alone, twins

import vmapens
from vmapens.lightning import EnsembleModule

QUIET = dict(
    enable_progress_bar=False,
    enable_model_summary=False,
    accelerator="cpu",
    num_sanity_val_steps=0,
)


def linear() -> nn.Module:
    return nn.Linear(3, 1).double()


def batchnorm() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 1)).double()


def data(shuffle: bool = True) -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 3, generator=g, dtype=torch.float64)
    y = torch.randn(32, 1, generator=g, dtype=torch.float64)
    return (
        DataLoader(TensorDataset(x, y), batch_size=8, shuffle=shuffle),
        DataLoader(TensorDataset(x[:12], y[:12]), batch_size=8),
    )


def module(factory=linear, **kw) -> EnsembleModule:
    ens = vmapens.Ensemble(factory, n=2, seed=0)
    opt = functools.partial(vmapens.StackedAdam, lr=0.1)
    return EnsembleModule(ens, nn.MSELoss(), optimizer=opt, **kw)


def checkpointed_fit(root: Path, epochs: int, ckpt_path: str | None = None) -> EnsembleModule:
    mod = module(patience=1)
    saver = ModelCheckpoint(root / "ck", monitor="val_loss", save_last=True)
    trainer = L.Trainer(
        max_epochs=epochs, logger=False, default_root_dir=root, callbacks=[saver], **QUIET
    )
    trainer.fit(mod, *data(), ckpt_path=ckpt_path)
    return mod


def test_load_from_checkpoint_leaves_the_global_rng_alone(tmp_path: Path):
    # A plain LightningModule's load_from_checkpoint draws nothing and sets no RNG state; the
    # module's checkpoint holds the training run's RNG state, for a resumed fit only.
    checkpointed_fit(tmp_path, 1)
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    ens = vmapens.Ensemble(linear, n=2, seed=0)
    EnsembleModule.load_from_checkpoint(
        tmp_path / "ck" / "last.ckpt", ens=ens, loss_fn=nn.MSELoss()
    )
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_test_with_ckpt_path_draws_as_test_without(tmp_path: Path):
    # trainer.test(ckpt_path=...) loads the weights, not the run's RNG state: the global RNG
    # ends as after trainer.test on the same weights without a checkpoint.
    mod = checkpointed_fit(tmp_path, 1)
    # No ModelCheckpoint in this Trainer: Lightning warns that a resumed fit would need one.
    trainer = L.Trainer(logger=False, default_root_dir=tmp_path, **QUIET)
    val = data()[1]
    torch.manual_seed(0)
    trainer.test(mod, val, verbose=False)
    expected = torch.rand(4)
    torch.manual_seed(0)
    trainer.test(mod, val, ckpt_path=str(tmp_path / "ck" / "last.ckpt"), verbose=False)
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")
def test_resume_from_last_ends_where_the_uninterrupted_run_ends(tmp_path: Path):
    torch.manual_seed(5)
    whole = checkpointed_fit(tmp_path / "whole", 3)
    torch.manual_seed(5)
    checkpointed_fit(tmp_path / "part", 1)
    torch.manual_seed(123)  # the resumed run must not depend on the RNG it starts with
    resumed = checkpointed_fit(tmp_path / "part", 3, ckpt_path="last")
    assert_bit_identical(dict(resumed.state_dict()), dict(whole.state_dict()), "resumed")


class Record(L.Callback):
    def __init__(self) -> None:
        self.batches: list = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches.append((batch[0].clone(), batch[1].clone()))


@pytest.mark.parametrize("interval", [2, 0.5])
def test_mid_epoch_validation_leaves_batchnorm_members_training_as_alone(interval):
    # Validation inside the epoch puts BatchNorm in eval; the next steps must use batch
    # statistics again, as each member trained alone with torch.optim.SGD.
    mod = EnsembleModule(
        vmapens.Ensemble(batchnorm, n=2, seed=0),
        nn.MSELoss(),
        optimizer=functools.partial(vmapens.StackedSGD, lr=0.1),
    )
    plain = twins(vmapens.Ensemble(batchnorm, n=2, seed=0).unstack())
    rec = Record()
    trainer = L.Trainer(
        max_epochs=2,
        val_check_interval=interval,
        logger=False,
        enable_checkpointing=False,
        callbacks=[rec],
        **{**QUIET, "num_sanity_val_steps": 2},
    )
    trainer.fit(mod, *data(shuffle=False))
    for m in plain:
        train_alone(
            m,
            rec.batches,
            nn.functional.mse_loss,
            lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        )
    assert len(rec.batches) == 8
    assert_members_equal(mod.ens, plain, **TOL64)


class TwoOptimizers(EnsembleModule):
    def configure_optimizers(self):
        return [super().configure_optimizers(), vmapens.StackedSGD(self.ens, lr=0.1)]


def test_several_optimizers_are_refused_before_any_step_naming_configure_optimizers():
    ens = vmapens.Ensemble(linear, n=2, seed=0)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    trainer = L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, **QUIET)
    with pytest.raises(ValueError, match="`configure_optimizers` must return one"):
        trainer.fit(TwoOptimizers(ens, nn.MSELoss()), *data())
    assert_bit_identical(dict(ens.state_dict()), before, "after the refusal")
