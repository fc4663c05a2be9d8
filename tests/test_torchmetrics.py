"""Real torchmetrics objects in fit(metrics=...) and EnsembleModule(metrics=...).

The truth: every member's twin trained alone with torch.optim.Adam on fit's documented batch
order (tests/truth.py), and a fresh torchmetrics object run on that twin's own validation
output after every epoch (and on the average of the twins' outputs for the ensemble value).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanSquaredError
from torchmetrics.classification import (
    MulticlassAccuracy,
    MulticlassCalibrationError,
    MulticlassF1Score,
)
from truth import TOL64, adam, assert_members_equal, batch_plan, train_alone, twins

import vmapens
from vmapens.callbacks import EarlyStopping
from vmapens.lightning import EnsembleModule

N, ROWS, BATCH, EPOCHS, LR, CLASSES = 3, 60, 20, 3, 0.05, 3
# torchmetrics keeps its states in float32 (its default): the members' float64 outputs equal
# the twins' to ~1e-12 and round to the same float32 values except for a last-bit flip now and
# then; 1e-6 is about 8 float32 ulps of the value. (Accuracy and F1 count argmax hits, which
# the ~1e-12 difference never flips on these data: their values come out equal.)
METRIC_TOL = dict(rtol=1e-6, atol=1e-7)

CLASSIFICATION = {
    "acc": lambda: MulticlassAccuracy(num_classes=CLASSES),
    "f1": lambda: MulticlassF1Score(num_classes=CLASSES),
    "ece": lambda: MulticlassCalibrationError(num_classes=CLASSES),
}
REGRESSION = {"mse": MeanSquaredError}
CASES = [
    pytest.param(CLASSIFICATION, CLASSES, nn.functional.cross_entropy, id="classification"),
    pytest.param(REGRESSION, 1, nn.functional.mse_loss, id="regression"),
]


def problem(outputs: int) -> tuple[tuple, tuple]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(ROWS + 40, 4, generator=g, dtype=torch.float64)
    if outputs == 1:
        y = x[:, :2].sum(1, keepdim=True).sin()
    else:
        y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return (x[:ROWS], y[:ROWS]), (x[ROWS:], y[ROWS:])


def member(outputs: int):
    return lambda: nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, outputs)).double()


@pytest.mark.parametrize(("metrics", "outputs", "loss_fn"), CASES)
def test_fit_metrics_equal_torchmetrics_on_each_member_alone(metrics, outputs, loss_fn):
    (x, y), (xv, yv) = problem(outputs)
    ens = vmapens.Ensemble(member(outputs), n=N, seed=0)
    models = twins(ens.unstack())
    history = vmapens.fit(
        ens, (x, y), loss_fn, epochs=EPOCHS, batch_size=BATCH, seed=0, lr=LR, progress=False,
        val_data=(xv, yv), metrics={k: make() for k, make in metrics.items()},
        callbacks=[EarlyStopping(restore_best=False)],  # members end at the last epoch
    )  # fmt: skip

    # The truth, epoch by epoch: the twins on fit's documented batches, then torchmetrics.
    per_epoch = ROWS // BATCH
    plan = batch_plan(ROWS, BATCH, EPOCHS * per_epoch, seed=0)
    opts = [adam(LR)(m) for m in models]
    for epoch in range(EPOCHS):
        rows = plan[epoch * per_epoch : (epoch + 1) * per_epoch]
        for m, opt in zip(models, opts):
            train_alone(m, [(x[r], y[r]) for r in rows], loss_fn, opt)
        with torch.no_grad():
            outs = [m(xv) for m in models]
        for name, make in metrics.items():
            for i, out in enumerate(outs):
                want = make()(out, yv).double()
                got = history.metrics[name][epoch, i]
                torch.testing.assert_close(got, want, **METRIC_TOL, msg=f"{name} member {i}")
            want = make()(torch.stack(outs).mean(0), yv).double()
            got = history.ensemble_metrics[name][epoch]
            torch.testing.assert_close(got, want, **METRIC_TOL, msg=f"{name} ensemble")
    assert_members_equal(ens, models, **TOL64)
    # Not vacuous: the members score differently, so a metric of the wrong output would show.
    for name in metrics:
        assert len(set(history.metrics[name][-1].tolist())) == N, name


def test_lightning_module_with_torchmetrics():
    """EnsembleModule(metrics=...) with torchmetrics objects: one copy per member and one for
    the averaged output, accumulated over validation batches of unequal size (32 + 8 rows),
    equal to one torchmetrics object run on each member alone over the whole set."""
    (x, y), (xv, yv) = problem(CLASSES)
    ens = vmapens.Ensemble(member(CLASSES), n=N, seed=0)
    metrics = {k: make() for k, make in CLASSIFICATION.items()}
    module = EnsembleModule(ens, nn.CrossEntropyLoss(), metrics=metrics)
    trainer = L.Trainer(
        max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu",
    )  # fmt: skip
    val = DataLoader(TensorDataset(xv, yv), batch_size=32)
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=BATCH), val)
    with torch.no_grad():
        outs = [m(xv) for m in ens.unstack()]
    got = trainer.callback_metrics
    for name, make in CLASSIFICATION.items():
        values = []
        for i, out in enumerate(outs):
            values.append(make()(out, yv).double())
            torch.testing.assert_close(got[f"val_{name}/member_{i}"], values[-1], **METRIC_TOL)
        torch.testing.assert_close(got[f"val_{name}"], torch.stack(values).mean(), **METRIC_TOL)
        want = make()(torch.stack(outs).mean(0), yv).double()
        torch.testing.assert_close(got[f"val_{name}/ensemble"], want, **METRIC_TOL)
