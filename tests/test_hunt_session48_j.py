"""Session 48 hunt (j): EnsembleModule under ``lightning.Trainer`` against one plain
``LightningModule`` per member (same init, same data, torch.optim, Lightning's own
``EarlyStopping`` and scheduler stepping), trained by its own ``Trainer``.

What a member must end with: its parameters and its learning rate as the plain run leaves
them. A member that stops early must keep the rate it stopped with (docs/fit.md: "a stopped
member ... is no longer stepped by the schedulers"), and Lightning's ``min_epochs`` and
iteration-based validation (``val_check_interval=int``) must act on each member as on the
plain module.

Four silent differences found, the Lightning path only. Fixed in session 48: a stopped
member's rate under the plateau (now stepped with the running members' mask) and under StepLR
(its values kept, as fit's callback keeps them). Strict xfails, open: min_epochs, and the
plateau with iteration-based validation.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import vmapens
from vmapens.lightning import EnsembleModule
from vmapens.optim import ReduceLROnPlateau

QUIET = dict(logger=False, enable_progress_bar=False, enable_model_summary=False,
             enable_checkpointing=False, accelerator="cpu", devices=1,
             num_sanity_val_steps=0)  # fmt: skip


def data(batch: int) -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 3, generator=g, dtype=torch.float64)
    xv = torch.randn(6, 3, generator=g, dtype=torch.float64)
    train = TensorDataset(x, x.sum(1, keepdim=True))
    val = TensorDataset(xv, xv.sum(1, keepdim=True))
    return DataLoader(train, batch_size=batch), DataLoader(val, batch_size=3)


def torch_sched(kind: str, opt: torch.optim.Optimizer, mode: str) -> dict[str, Any]:
    if kind == "plateau":
        s: Any = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode=mode, patience=0, factor=0.5)
        return {"scheduler": s, "monitor": "val_loss"}
    if kind == "epoch":
        return {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.9), "interval": "epoch"}
    step = torch.optim.lr_scheduler.StepLR(opt, 1, 0.8)
    return {"scheduler": step, "interval": "step", "frequency": 2}


class Plain(L.LightningModule):
    """One member alone: the LightningModule a user writes."""

    def __init__(self, net: nn.Module, lr: float, sched: str | None, mode: str) -> None:
        super().__init__()
        self.net, self.lr, self.sched, self.mode = net, lr, sched, mode

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        if self.sched is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": torch_sched(self.sched, opt, self.mode)}


class Scheduled(EnsembleModule):
    """The same scheduler, returned from a subclass's configure_optimizers (docs)."""

    def __init__(self, *args: Any, sched: str | None, mode: str, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.sched, self.mode = sched, mode

    def configure_optimizers(self) -> Any:
        opt = super().configure_optimizers()
        if self.sched is None:
            return opt
        if self.sched == "plateau":
            s = ReduceLROnPlateau(opt, mode=self.mode, patience=0, factor=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": s}}
        config = torch_sched(self.sched, opt, self.mode)
        return {"optimizer": opt, "lr_scheduler": config}


def compare(
    lrs: list[float],
    *,
    sched: str | None = None,
    mode: str = "min",
    patience: int | None = None,
    batch: int = 4,
    **trainer_kw: Any,
) -> None:
    """Fit the ensemble and each member alone; every member's weights and lr must agree."""
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 1).double(), n=len(lrs), seed=0)
    start = ens.unstack()
    lr = torch.tensor(lrs, dtype=torch.float64)
    mod = Scheduled(ens, nn.MSELoss(), optimizer=lambda e: vmapens.StackedSGD(e, lr=lr),
                    patience=patience, sched=sched, mode=mode)  # fmt: skip
    with warnings.catch_warnings():  # Lightning's advice on tiny loaders and min_epochs
        warnings.simplefilter("ignore")
        trainer = L.Trainer(**QUIET, **trainer_kw)
        trainer.fit(mod, *data(batch))
        alone = []
        for i, m in enumerate(start):
            stop = [EarlyStopping("val_loss", patience=patience)] if patience else []
            t = L.Trainer(callbacks=stop, **QUIET, **trainer_kw)
            t.fit(Plain(m, lrs[i], sched, mode), *data(batch))
            alone.append(t.optimizers[0].param_groups[0]["lr"])
    got = trainer.optimizers[0].param_groups[0]["lr"]
    got = [float(v) for v in (got.values if hasattr(got, "values") else got)]
    for i, (trained, m) in enumerate(zip(ens.unstack(), start, strict=True)):
        for name, p in m.named_parameters():
            torch.testing.assert_close(
                trained.get_parameter(name), p, rtol=1e-9, atol=1e-10,
                msg=lambda s, i=i, name=name: f"member {i} {name}: {s}",
            )  # fmt: skip
    assert got == alone, f"learning rates {got} != members alone {alone}"


# -- bugs ------------------------------------------------------------------------------------


def test_a_stopped_members_plateau_rate_stays_where_it_stopped_as_alone():
    # Member 0 (lr 1.4) diverges and stops at epoch 1; alone, Lightning's EarlyStopping ends
    # its run there with lr 0.7. The module keeps stepping its plateau with its frozen
    # val_loss (no `mask=`): 0.175 after 4 epochs.
    compare([1.4, 0.05], sched="plateau", patience=1, max_epochs=4)


def test_a_stopped_members_epoch_steplr_rate_stays_where_it_stopped_as_alone():
    # Alone: StepLR stepped at epochs 0 and 1, then the run stops: 1.4 * 0.9**2 = 1.134.
    # The module steps it for the stopped member at epochs 2 and 3 too: 0.91854.
    compare([1.4, 0.05], sched="epoch", patience=1, max_epochs=4)


@pytest.mark.xfail(
    strict=True,
    reason="vmapens/lightning.py:_early_stop freezes a member once patience runs out, ignoring Trainer(min_epochs/min_steps), which Lightning honours alone (fit_loop._can_stop_early): that member's weights differ completely, silently (open, session 48)",
)
def test_min_epochs_keeps_an_early_stopped_member_training_as_lightning_does():
    # Trainer(min_epochs=4): Lightning's EarlyStopping signals a stop at epoch 1, but the
    # Trainer goes on ("the required min_epochs=4 ... has not been met. Training will
    # continue"): member 0 alone trains 4 epochs. The module masks it from epoch 2 on.
    compare([1.4, 0.05], patience=1, max_epochs=5, min_epochs=4)


@pytest.mark.xfail(
    strict=True,
    reason="vmapens/lightning.py:on_validation_epoch_end steps the plateau only after a validation that ends an epoch; with val_check_interval=int none does and it never steps, where Lightning steps it at each epoch's end on the last val_loss (rates [0.3, 0.05] where alone [0.075, 0.0125]) (open, session 48)",
)
def test_plateau_steps_every_epoch_with_iteration_based_validation_as_lightning():
    # 4 batches an epoch, validation every 3rd batch of the epoch (never at its end): plain
    # Lightning steps the plateau at every epoch's end with the last logged val_loss
    # (lr 0.3 -> 0.075 in 3 epochs, mode "max" on a falling loss); the module steps it only
    # after a validation that ends an epoch, so never (lr stays 0.3, and the weights differ).
    compare([0.3, 0.05], sched="plateau", mode="max", batch=2, max_epochs=3,
            val_check_interval=3)  # fmt: skip


# -- what held -------------------------------------------------------------------------------


def test_step_scheduler_with_frequency_and_max_steps_mid_epoch_as_lightning():
    # 4 batches an epoch, StepLR every 2nd batch of the epoch, max_steps=7 stops in the
    # second epoch: weights and the final lr as each plain LightningModule's.
    compare([0.1, 0.05], sched="step", batch=2, max_epochs=3, max_steps=7)


def test_epoch_steplr_with_max_steps_mid_epoch_as_lightning():
    # The epoch the max_steps cut short steps no "epoch" scheduler, alone or in the module.
    compare([0.1, 0.05], sched="epoch", batch=2, max_epochs=3, max_steps=6)


def test_members_stopping_at_different_epochs_train_as_alone_without_schedulers():
    # Early stopping per member without schedulers (the weights only): as Lightning alone.
    compare([1.4, 0.05, 0.9], patience=1, max_epochs=4)
