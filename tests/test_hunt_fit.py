"""The user-level training API against plain torch: out-of-bag losses, PBT copies and their
schedulers, what the loggers write, and arguments refused before the first step."""

from __future__ import annotations

import copy
import csv
from pathlib import Path

import pytest
import torch
from torch import nn
from truth import resample, train_alone

import vmapens
from vmapens.callbacks import CSVLogger, EarlyStopping, LRScheduler, TensorBoardLogger
from vmapens.pbt import PBT

F64 = dict(dtype=torch.float64)
TOL = dict(rtol=1e-9, atol=1e-10)
G = torch.Generator().manual_seed(0)
X, Y = torch.randn(24, 3, generator=G, **F64), torch.randn(24, 1, generator=G, **F64)
XV, YV = torch.randn(12, 3, generator=G, **F64), torch.randn(12, 1, generator=G, **F64)
CLASSES = torch.randint(0, 3, (24,), generator=G)


def linear() -> nn.Module:
    return nn.Linear(3, 1).double()


def classifier() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()


class Steps(vmapens.Callback):
    def __init__(self) -> None:
        self.steps = 0

    def on_step_end(self, ctx) -> None:
        self.steps += 1


# -- out-of-bag validation ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "loss_fn",
    [
        nn.CrossEntropyLoss(weight=torch.tensor([1.0, 4.0, 0.25], **F64)),
        nn.CrossEntropyLoss(reduction="sum"),
        nn.CrossEntropyLoss(ignore_index=2),
    ],
    ids=["class-weights", "sum", "ignore-index"],
)
def test_out_of_bag_loss_is_loss_fn_on_each_members_left_out_rows(loss_fn):
    # A loss is not always the mean of its rows' losses: the out-of-bag loss is `loss_fn` on
    # the rows the member's resample left out, as for any other validation data.
    ens = vmapens.Ensemble(classifier, n=3, seed=0)
    twins = ens.unstack()
    h = vmapens.fit(ens, (X, CLASSES), loss_fn, bootstrap=True, val_data="oob", epochs=2,
                    lr=1e-2, seed=4, progress=False,
                    callbacks=[EarlyStopping(restore_best=False)])  # fmt: skip
    for i, twin in enumerate(twins):
        rows = resample(24, 4, i)
        train_alone(twin, [(X[rows], CLASSES[rows])] * 2, loss_fn)
        left_out = torch.ones(24, dtype=torch.bool)
        left_out[rows] = False
        with torch.no_grad():
            expected = loss_fn(twin(X[left_out]), CLASSES[left_out])
        torch.testing.assert_close(h.val_loss[-1, i], expected, **TOL)


# -- population-based training --------------------------------------------------------------------


def test_a_pbt_copy_takes_its_sources_plateau_record_and_trains_as_it_does():
    # After a round with factor 1, the copy and its source hold the same weights, optimizer
    # state and lr: from there on they must train alike. A per-member plateau scheduler that
    # kept the copy's own best value and bad-epoch count moved its lr apart.
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 3, generator=g, **F64), torch.randn(32, 1, generator=g, **F64)
    xv, yv = torch.randn(16, 3, generator=g, **F64), torch.randn(16, 1, generator=g, **F64)
    ens = vmapens.Ensemble(linear, n=4, seed=0)
    opt = vmapens.StackedSGD(ens, lr=[0.3, 0.1, 0.03, 0.001])
    plateau = LRScheduler(lambda o: vmapens.optim.ReduceLROnPlateau(o, patience=0, factor=0.5))
    pbt = PBT(interval=3, factors=(1.0,), seed=0)
    vmapens.fit(ens, (x, y), nn.MSELoss(), epochs=5, batch_size=8, optimizer=opt,
                val_data=(xv, yv), callbacks=[EarlyStopping(restore_best=False), plateau, pbt],
                progress=False, seed=0)  # fmt: skip
    ((_, src, dst),) = pbt.log
    states, lr, record = ens.state_dicts(), opt.param_groups[0]["lr"], plateau.scheduler
    assert len(set(lr)) > 1  # the plateau acted
    for s, d in zip(src, dst, strict=True):
        assert lr[d] == lr[s] and record.best[d] == record.best[s]
        assert record.num_bad_epochs[d] == record.num_bad_epochs[s]
        torch.testing.assert_close(states[d], states[s], rtol=0, atol=0)


@pytest.mark.parametrize(
    "pbt,fit_options,error,match",
    [
        (dict(monitor="val_acc"), {}, ValueError, r"^PBT: `monitor` 'val_acc' was not recorded"),
        (dict(names=("momentum",)), {}, ValueError, r"^PBT: `names` must be among .*'momentum'"),
        ({}, dict(optimizer=lambda e: torch.optim.Adam(e.parameters())), TypeError,
         r"^PBT: needs a vmapens.StackedOptimizer, got Adam"),
    ],
    ids=["monitor", "names", "optimizer"],
)  # fmt: skip
def test_pbt_refuses_its_settings_before_the_first_step(pbt, fit_options, error, match):
    ens = vmapens.Ensemble(linear, n=4, seed=0)
    before, steps = copy.deepcopy(ens.state_dict()), Steps()
    with pytest.raises(error, match=match):
        vmapens.fit(ens, (X, Y), nn.MSELoss(), epochs=3, batch_size=8, val_data=(XV, YV),
                    callbacks=[PBT(interval=2, **pbt), steps], progress=False, seed=0,
                    **fit_options)  # fmt: skip
    assert steps.steps == 0
    torch.testing.assert_close(ens.state_dict(), before, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"^PBT: `factors` must not be empty"):
        PBT(interval=1, factors=())


# -- loggers --------------------------------------------------------------------------------------


LRS = [1.0, 0.1]


def lrs_each_epoch_trained_with(epochs: int) -> list[list[float]]:
    """Per epoch, each member's lr over its steps, from torch's StepLR on a plain SGD."""
    out = []
    for lr in LRS:
        opt = torch.optim.SGD(linear().parameters(), lr=lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        per_epoch = []
        for _ in range(epochs):
            per_epoch.append(opt.param_groups[0]["lr"])  # the lr of this epoch's steps
            opt.step()
            sched.step()
        out.append(per_epoch)
    return [list(row) for row in zip(*out, strict=True)]


def test_csv_logger_logs_the_lr_each_epoch_trained_with(tmp_path: Path):
    path = tmp_path / "log.csv"
    vmapens.fit(vmapens.Ensemble(linear, n=2, seed=0), (X, Y), nn.MSELoss(), epochs=3,
                optimizer=vmapens.StackedSGD, lr=LRS, progress=False, seed=0,
                scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5),
                callbacks=[CSVLogger(path)])  # fmt: skip
    rows = list(csv.DictReader(path.read_text().splitlines()))
    got = [[float(r["lr"]) for r in rows if int(r["epoch"]) == e] for e in range(3)]
    assert got == lrs_each_epoch_trained_with(3)


def test_tensorboard_logger_logs_the_lr_each_epoch_trained_with(tmp_path: Path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(tmp_path)
    vmapens.fit(vmapens.Ensemble(linear, n=2, seed=0), (X, Y), nn.MSELoss(), epochs=3,
                optimizer=vmapens.StackedSGD, lr=LRS, progress=False, seed=0,
                scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5),
                callbacks=[logger])  # fmt: skip
    logger.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    got = [[e.value for e in events.Scalars(f"lr/member_{i}")] for i in range(2)]
    expected = [list(col) for col in zip(*lrs_each_epoch_trained_with(3), strict=True)]
    torch.testing.assert_close(torch.tensor(got, **F64), torch.tensor(expected, **F64))


# -- arguments ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options,match",
    [
        (dict(callbacks=EarlyStopping(), val_data=(XV, YV)),
         r"^fit: `callbacks` must be a sequence \(callbacks=\[...\]\), got EarlyStopping"),
        (dict(metrics=[lambda o, t: (o - t).abs().mean()], val_data=(XV, YV)),
         r"^fit: `metrics` must be a mapping \(metrics=\{name: fn\}\), got list"),
    ],
    ids=["one-callback", "metric-list"],
)  # fmt: skip
def test_callbacks_and_metrics_of_the_wrong_kind_name_the_argument(options, match):
    ens = vmapens.Ensemble(linear, n=2, seed=0)
    before = copy.deepcopy(ens.state_dict())
    with pytest.raises(TypeError, match=match):
        vmapens.fit(ens, (X, Y), nn.MSELoss(), progress=False, seed=0, **options)
    torch.testing.assert_close(ens.state_dict(), before, rtol=0, atol=0)


@pytest.mark.parametrize("patience", [1, 2])
def test_patience_beside_an_early_stopping_callback_is_refused_for_every_value(patience):
    # patience=1 equals True, which the shortcut check let through: the 1 was dropped.
    ens = vmapens.Ensemble(linear, n=2, seed=0)
    with pytest.raises(ValueError, match=r"^fit: `patience` builds a callbacks.EarlyStopping"):
        vmapens.fit(ens, (X, Y), nn.MSELoss(), epochs=3, val_data=(XV, YV), patience=patience,
                    callbacks=[EarlyStopping()], progress=False, seed=0)  # fmt: skip


def test_the_random_backends_stepped_floats_reach_high_as_optunas_do():
    # optuna's suggest_float(low, high, step) draws from low, low + step, ..., high; the random
    # backend counted the steps in binary, (0.3 - 0.0) / 0.1 = 2.999..., and never drew 0.3.
    sweep = vmapens.sweep.Sweep(linear, lambda t: {"lr": t.suggest_float("lr", 0.0, 0.3, step=0.1)},
                                backend="random", monitor="train_loss", seed=0)  # fmt: skip
    result = sweep.run((X, Y), nn.MSELoss(), n_trials=40, epochs=1, progress=False)
    drawn = sorted({round(t.params["lr"], 9) for t in result.trials})
    assert drawn == [0.0, 0.1, 0.2, 0.3]


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 1), nn.Linear(2, 1)

    def forward(self, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.a(u) + self.b(v)


class PairDataset(torch.utils.data.Dataset):
    """Items ``((u, v), y)``: a DataLoader collates the inputs into a list ``[u, v]``."""

    def __init__(self, u: torch.Tensor, v: torch.Tensor, y: torch.Tensor) -> None:
        self.u, self.v, self.y = u, v, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return (self.u[i], self.v[i]), self.y[i]


def test_fit_takes_a_dataloaders_collated_list_as_several_inputs():
    """A dataset of ``((u, v), y)`` through a DataLoader (inputs collated into a list) trains
    each member as a two-input module alone on the same batches."""
    g = torch.Generator().manual_seed(3)
    u, v, y = (torch.randn(16, k, generator=g, dtype=torch.float64) for k in (3, 2, 1))
    loader = torch.utils.data.DataLoader(PairDataset(u, v, y), batch_size=8)
    ens = vmapens.Ensemble(TwoInputs, 2, seed=0).double()
    alone = [copy.deepcopy(m) for m in ens.unstack()]
    vmapens.fit(ens, loader, nn.MSELoss(), epochs=2, lr=0.05, progress=False, seed=0)
    for m in alone:
        opt = torch.optim.Adam(m.parameters(), lr=0.05)
        for _ in range(2):
            for (bu, bv), by in loader:
                opt.zero_grad()
                nn.functional.mse_loss(m(bu, bv), by).backward()
                opt.step()
    for i, m in enumerate(alone):
        for name, p in m.named_parameters():
            torch.testing.assert_close(ens.unstack()[i].get_parameter(name), p, rtol=1e-10, atol=0)
