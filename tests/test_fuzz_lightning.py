"""Seeded random Lightning configurations: EnsembleModule under ``lightning.Trainer`` against
members trained alone with plain ``torch.optim``.

Each seed draws a legal configuration the way Lightning users write one: ``max_epochs`` or
``max_steps``, ``limit_train_batches``, ``check_val_every_n_epoch``, a validation loader whose
last batch is shorter, the sanity check on or off, per-member early stopping, a scheduler a
subclass returns from ``configure_optimizers`` (``StepLR`` per step or per epoch with a
``frequency``, ``vmapens.optim.ReduceLROnPlateau`` per epoch), per-member clipping, SGD with
momentum, Adam or AdamW with one learning rate per member, ``Trainer(precision="64-true")``
on a float32 member, and members with BatchNorm or Dropout (``randomness="same"``: each member
draws the mask it would draw alone from the same RNG state; docs/semantics.md). Then
``ModelCheckpoint`` at every epoch's end and ``trainer.fit(..., ckpt_path=...)`` from one of
them, and ``trainer.validate`` / ``test`` / ``predict`` after fit.

The truth: a callback records what Lightning fed the module (each batch, the RNG state before
it, each validation inside fit); every member's twin, a plain module with its own
``torch.optim`` optimizer, scheduler and ``nn.utils`` clipping, replays that record as the
docs describe (docs/workflows.md, "Lightning"): schedulers stepped where Lightning's
automatic optimization steps them, patience counted per member. Parameters and buffers,
every logged per-member value and the predictions are compared member by member; the resumed
run must equal the uninterrupted one bit for bit.

Run more seeds by hand: ``python tests/test_fuzz_lightning.py 0 200`` runs seeds 0..199 and
prints the failures; ``python tests/test_fuzz_lightning.py 17`` prints seed 17's draw and runs it.
"""

from __future__ import annotations

import functools
import math
import random
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import models
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from truth import TOL64, assert_bit_identical, assert_members_equal, search, twins

import vmapens
from vmapens.lightning import EnsembleModule
from vmapens.optim import ReduceLROnPlateau

QUIET = dict(logger=False, enable_progress_bar=False, enable_model_summary=False,
             accelerator="cpu")  # fmt: skip


MLP = functools.partial(models.TanhMLP, 1)
BN = functools.partial(models.TanhBN, 1)
Drop = functools.partial(models.TanhDropout, 1)
MODELS = {"mlp": MLP, "bn": BN, "dropout": Drop}


def draw(seed: int) -> dict[str, Any]:
    """A random, legal configuration."""
    r = random.Random(seed)
    n = r.randint(2, 3)
    rows, batch = r.choice([(12, 4), (10, 4), (9, 3), (8, 8)])
    batches = math.ceil(rows / batch)
    limit = r.choice([None, None, max(1, batches - 1), 0.5 if batches >= 2 else None])
    opt = r.choice(["sgd", "adam", "adamw"])
    sched = r.choice([None, "steplr", "plateau"])
    return dict(
        n=n, model=r.choice(list(MODELS)), f32=r.random() < 0.2, rows=rows, batch=batch,
        limit=limit, val_rows=r.choice([7, 10]), val_batch=r.choice([3, 4]),
        every=r.choice([1, 1, 2]), epochs=r.randint(2, 4),
        max_steps=r.choice([-1, -1, r.randint(2, 8)]), sanity=r.choice([0, 2]), opt=opt,
        lr=[round(r.uniform(0.01, 0.3), 3) for _ in range(n)], sched=sched,
        interval="epoch" if sched == "plateau" else r.choice(["step", "epoch"]),
        frequency=r.choice([1, 1, 2]), patience=r.choice([None, 1, 2]),
        clip=r.choice([None, ("norm", 0.5), ("value", 0.2)]), shuffle=r.random() < 0.5,
        resume=r.random() < 0.5,
    )  # fmt: skip


def loaders(s: dict[str, Any]) -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(s["rows"], 3, generator=g, dtype=torch.float64)
    y = x.sum(1, keepdim=True).sin() + 0.3 * torch.randn(
        s["rows"], 1, generator=g, dtype=torch.float64
    )
    xv = torch.randn(s["val_rows"], 3, generator=g, dtype=torch.float64)
    yv = xv.sum(1, keepdim=True).sin()
    train = DataLoader(TensorDataset(x, y), batch_size=s["batch"], shuffle=s["shuffle"])
    return train, DataLoader(TensorDataset(xv, yv), batch_size=s["val_batch"])


def factory(s: dict[str, Any]) -> nn.Module:
    m = MODELS[s["model"]]()
    return m.float() if s["f32"] else m.double()


def stacked_opt(s: dict[str, Any], ens: vmapens.Ensemble) -> vmapens.StackedOptimizer:
    lr = torch.tensor(s["lr"], dtype=torch.float64)
    if s["opt"] == "sgd":
        return vmapens.StackedSGD(ens, lr=lr, momentum=0.9)
    return vmapens.StackedAdam(ens, lr=lr, weight_decay=0.1 if s["opt"] == "adamw" else 0.0,
                               decoupled_weight_decay=s["opt"] == "adamw")  # fmt: skip


def torch_opt(s: dict[str, Any], m: nn.Module, i: int) -> torch.optim.Optimizer:
    if s["opt"] == "sgd":
        return torch.optim.SGD(m.parameters(), lr=s["lr"][i], momentum=0.9)
    if s["opt"] == "adamw":
        return torch.optim.AdamW(m.parameters(), lr=s["lr"][i], weight_decay=0.1)
    return torch.optim.Adam(m.parameters(), lr=s["lr"][i])


class Scheduled(EnsembleModule):
    """What a Lightning user writes for a scheduler: a dict from configure_optimizers."""

    def __init__(self, *args: Any, spec: dict[str, Any], **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.spec = spec

    def configure_optimizers(self) -> Any:
        opt = super().configure_optimizers()
        s = self.spec
        if s["sched"] is None:
            return opt
        if s["sched"] == "plateau":
            sched: Any = ReduceLROnPlateau(opt, patience=0, factor=0.5)
        else:
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        config = {"scheduler": sched, "interval": s["interval"], "frequency": s["frequency"]}
        return {"optimizer": opt, "lr_scheduler": config}


class Record(L.Callback):
    """What Lightning fed the module: batches (with the RNG state before each) and fit's
    validations, in order."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        x, y = batch
        rng = torch.get_rng_state()
        self.events.append(("batch", trainer.current_epoch, batch_idx, x.clone(), y.clone(), rng))

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.events.append(("val", trainer.current_epoch))


def build(s: dict[str, Any]) -> Scheduled:
    ens = vmapens.Ensemble(functools.partial(factory, s), n=s["n"], seed=0,
                           randomness="same" if s["model"] == "dropout" else "different")  # fmt: skip
    clip = {} if s["clip"] is None else {f"clip_grad_{s['clip'][0]}": s["clip"][1]}
    return Scheduled(ens, nn.MSELoss(), optimizer=functools.partial(stacked_opt, s),
                     patience=s["patience"], spec=s, **clip)  # fmt: skip


def trainer_for(s: dict[str, Any], callbacks: list, **kw: Any) -> L.Trainer:
    return L.Trainer(max_epochs=s["epochs"], max_steps=s["max_steps"],
                     limit_train_batches=s["limit"], check_val_every_n_epoch=s["every"],
                     num_sanity_val_steps=s["sanity"], callbacks=callbacks,
                     precision="64-true" if s["f32"] else "32-true", **QUIET, **kw)  # fmt: skip


def fit(s: dict[str, Any], tmp: Path, ckpt_path: str | None = None):
    mod, rec = build(s), Record()
    saver = ModelCheckpoint(dirpath=tmp, filename="{epoch}", save_top_k=-1)
    trainer = trainer_for(s, [rec, saver])
    train, val = loaders(s)
    with warnings.catch_warnings():  # a resumed run writes into the directory of the first
        warnings.filterwarnings("ignore", "Checkpoint directory .* exists and is not empty")
        trainer.fit(mod, train, val, ckpt_path=ckpt_path)
    return mod, trainer, rec


def per_epoch(s: dict[str, Any]) -> int:
    """Lightning's training batches per epoch, from its documented limit_train_batches."""
    full = math.ceil(s["rows"] / s["batch"])
    if s["limit"] is None:
        return full
    return int(full * s["limit"]) if isinstance(s["limit"], float) else min(full, s["limit"])


def val_losses(models: list[nn.Module], val: DataLoader) -> list[float]:
    """Each member's row-weighted mean validation loss, eval mode, modes given back after."""
    out = []
    for m in models:
        modes = [(k, k.training) for k in m.modules()]
        m.eval()
        with torch.no_grad():
            total = sum(nn.functional.mse_loss(m(x), y).item() * len(y) for x, y in val)
        out.append(total / len(val.dataset))
        for k, mode in modes:
            k.training = mode
    return out


def alone(s: dict[str, Any], start: list[nn.Module], events: list[tuple]):
    """Each member trained alone on Lightning's record, as docs/workflows.md says; returns the
    twins and the per-member values of the last validation."""
    models = twins(start)
    if s["f32"]:
        models = [m.double() for m in models]
    opts = [torch_opt(s, m, i) for i, m in enumerate(models)]
    scheds: list[Any] = []
    if s["sched"] == "steplr":
        scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.7) for o in opts]
    elif s["sched"] == "plateau":
        scheds = [torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0, factor=0.5) for o in opts]  # fmt: skip
    _, val = loaders(s)
    active, best, bad = [True] * s["n"], [math.inf] * s["n"], [0] * s["n"]
    last_val: list[float] = []
    epoch_done = False
    for event in events:
        if event[0] == "batch":
            _, epoch, idx, x, y, rng = event
            for i, (m, opt) in enumerate(zip(models, opts, strict=True)):
                if not active[i]:
                    continue
                torch.set_rng_state(rng)  # randomness="same": the mask drawn alone
                opt.zero_grad()
                nn.functional.mse_loss(m(x), y).backward()
                if s["clip"] is not None:
                    kind, c = s["clip"]
                    clip_fn = (
                        nn.utils.clip_grad_norm_ if kind == "norm" else nn.utils.clip_grad_value_
                    )
                    clip_fn(m.parameters(), c)
                opt.step()
            epoch_done = idx + 1 == per_epoch(s)
            # Lightning's automatic optimization: "step" every `frequency` batches of the
            # epoch, "epoch" after its last batch every `frequency` epochs.
            count = idx + 1 if s["interval"] == "step" else (epoch + 1 if epoch_done else 0)
            if s["sched"] == "steplr" and count and count % s["frequency"] == 0:
                for sch in scheds:
                    sch.step()
        else:
            epoch = event[1]
            last_val = val_losses(models, val)
            if s["sched"] == "plateau" and epoch_done and (epoch + 1) % s["frequency"] == 0:
                for sch, v in zip(scheds, last_val, strict=True):
                    sch.step(v)
            if s["patience"] is not None:
                for i, v in enumerate(last_val):
                    if not active[i]:
                        continue
                    best[i], bad[i] = (v, 0) if v < best[i] else (best[i], bad[i] + 1)
                    active[i] = bad[i] < s["patience"]
    return models, last_val, active


def run(s: dict[str, Any], tmp: Path) -> None:
    start = vmapens.Ensemble(functools.partial(factory, s), n=s["n"], seed=0).unstack()
    mod, trainer, rec = fit(s, tmp / "full")
    assert any(e[0] == "batch" for e in rec.events)
    models, last_val, active = alone(s, start, rec.events)
    assert_members_equal(mod.ens, models, **TOL64)
    assert mod.active.tolist() == active
    if last_val:
        for i, v in enumerate(last_val):
            got = trainer.callback_metrics[f"val_loss/member_{i}"]
            torch.testing.assert_close(got.item(), v, **TOL64)
    # After fit: validate, test and predict change nothing and equal the members alone.
    _, val = loaders(s)
    before = {k: v.clone() for k, v in mod.state_dict().items()}
    want = val_losses(models, val)
    for stage in ("val", "test"):
        fn = trainer.validate if stage == "val" else trainer.test
        (logged,) = fn(mod, val, verbose=False)
        for i, v in enumerate(want):
            torch.testing.assert_close(logged[f"{stage}_loss/member_{i}"], v, **TOL64)
    # Prediction batches as (inputs, targets), or (inputs,) from a TensorDataset of inputs.
    inputs_only = DataLoader(TensorDataset(val.dataset.tensors[0]), batch_size=s["val_batch"])
    outs = trainer.predict(mod, val) + trainer.predict(mod, inputs_only)
    for (x, _), out in zip([*val, *val], outs, strict=True):
        with torch.no_grad():
            alone_out = torch.stack([m.eval()(x) for m in models])
        torch.testing.assert_close(out, alone_out, **TOL64)
    assert_bit_identical(dict(mod.state_dict()), before, "state after validate/test/predict")
    assert all(m.training for m in mod.ens.template.modules())

    # Not exact for a plain LightningModule either (lightning 2.6, docs/workflows.md):
    # precision="64-true" on float32 members (Lightning loads the checkpoint before it casts
    # the module), and max_steps (the resumed run skips an epoch).
    if not s["resume"] or s["f32"] or s["max_steps"] != -1:
        return
    saved = sorted((tmp / "full").glob("epoch=*.ckpt"))
    if len(saved) < 2:
        return
    ckpt = saved[random.Random(len(saved)).randrange(len(saved) - 1)]
    resumed, trainer2, rec2 = fit(s, tmp / "full", ckpt_path=str(ckpt))
    assert_bit_identical(dict(resumed.state_dict()), before, f"resumed from {ckpt.name}")
    assert_bit_identical(
        trainer2.optimizers[0].state_dict(), trainer.optimizers[0].state_dict(), "optimizer"
    )
    for c1, c2 in zip(trainer.lr_scheduler_configs, trainer2.lr_scheduler_configs, strict=True):
        assert_bit_identical(c2.scheduler.state_dict(), c1.scheduler.state_dict(), "scheduler")
    assert trainer2.global_step == trainer.global_step


SEEDS = range(6)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_lightning_configuration_matches_members_trained_alone(
    seed: int, tmp_path: Path
) -> None:
    run(draw(seed), tmp_path)


if __name__ == "__main__":
    search(lambda seed, tmp: run(draw(seed), tmp), draw)


# -- what the search found, one test each ------------------------------------------------------


class Plain(L.LightningModule):
    """One member alone, as a Lightning user writes it: automatic optimization, the scheduler
    dict and the Trainer's gradient clipping."""

    def __init__(self, model: nn.Module, lr: float, sched: dict[str, Any]) -> None:
        super().__init__()
        self.model, self.lr, self.sched = model, lr, sched

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, **self.sched}}


@pytest.mark.parametrize("sched", [dict(interval="step", frequency=2), dict(interval="epoch")])
def test_a_scheduler_from_configure_optimizers_steps_as_plain_lightning_steps_it(sched) -> None:
    # Manual optimization (which EnsembleModule uses) never steps the schedulers returned by
    # configure_optimizers: the learning rate stayed where it started, without a word. Now the
    # module steps them where automatic optimization would, and clip_grad_norm clips each
    # member as Trainer(gradient_clip_val=...) clips a plain module.
    s = dict(draw(0), n=2, model="mlp", f32=False, rows=10, batch=4, opt="sgd", lr=[0.1, 0.2],
             sched="steplr", clip=("norm", 0.5), patience=None, **sched)  # fmt: skip
    start = vmapens.Ensemble(functools.partial(factory, s), n=2, seed=0).unstack()
    mod = build(s)
    kw = dict(max_epochs=3, enable_checkpointing=False, num_sanity_val_steps=0, **QUIET)
    trainer = L.Trainer(**kw)
    train, val = loaders(s)
    trainer.fit(mod, train, val)
    for i, m in enumerate(twins(start)):
        plain = L.Trainer(gradient_clip_val=0.5, **kw)
        plain.fit(Plain(m, s["lr"][i], sched), train)
        torch.testing.assert_close(
            trainer.optimizers[0].param_groups[0]["lr"][i],
            plain.optimizers[0].param_groups[0]["lr"],
        )
        for name, want in m.state_dict().items():
            torch.testing.assert_close(mod.ens[i].state_dict()[name], want, **TOL64)


@pytest.mark.parametrize(
    ("trainer_kw", "match"),
    [
        (
            dict(gradient_clip_val=0.5),
            r"`gradient_clip_val` .* EnsembleModule\(clip_grad_norm=0.5\)",
        ),
        (dict(gradient_clip_val=0.5, gradient_clip_algorithm="value"), r"clip_grad_value=0.5"),
        (dict(accumulate_grad_batches=2), r"`accumulate_grad_batches` must be 1, got 2"),
    ],
)
def test_trainer_options_manual_optimization_cannot_take_name_the_modules_own(
    trainer_kw, match
) -> None:
    # Lightning refused them with "switch to automatic optimization", which an EnsembleModule
    # user cannot do (and which would clip all members by one global norm).
    mod = build(dict(draw(0), model="mlp", f32=False, sched=None, clip=None))
    before = {k: v.clone() for k, v in mod.state_dict().items()}
    trainer = L.Trainer(max_epochs=1, enable_checkpointing=False, **QUIET, **trainer_kw)
    with pytest.raises(ValueError, match=r"^EnsembleModule: the Trainer's .*" + match):
        trainer.fit(mod, *loaders(draw(0)))
    assert_bit_identical(dict(mod.state_dict()), before)


def test_torchs_plateau_scheduler_is_refused() -> None:
    # torch's ReduceLROnPlateau steps on one value: every member's lr would follow their mean.
    class TorchPlateau(EnsembleModule):
        def configure_optimizers(self) -> Any:
            opt = super().configure_optimizers()
            sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}

    s = dict(draw(0), model="mlp", f32=False)
    mod = TorchPlateau(vmapens.Ensemble(functools.partial(factory, s), n=2, seed=0), nn.MSELoss())
    trainer = L.Trainer(max_epochs=1, enable_checkpointing=False, **QUIET)
    with pytest.raises(
        ValueError, match=r"plateau `lr_scheduler` must be vmapens.optim's.*torch's reduces all"
    ):
        trainer.fit(mod, *loaders(s))


def test_a_checkpoint_written_in_validation_every_second_epoch_resumes_exactly(tmp_path) -> None:
    # ModelCheckpoint saves in the validation after an epoch's last batch when
    # check_val_every_n_epoch > 1, and Lightning re-enters that epoch on resume, drawing one
    # more shuffle: with the RNG state set back when the checkpoint loaded, every later epoch
    # of the resumed run had another batch order. Now it is set when the next epoch starts.
    s = dict(draw(0), n=2, model="dropout", f32=False, rows=9, batch=3, limit=None,
             val_rows=7, val_batch=4, every=2, epochs=4, max_steps=-1, sanity=0, opt="adam",
             lr=[0.056, 0.108], sched="steplr", interval="epoch", frequency=2, patience=None,
             clip=None, shuffle=True, resume=True)  # fmt: skip
    run(s, tmp_path)
