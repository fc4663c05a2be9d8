"""vmapens.lightning: an Ensemble under lightning.Trainer.fit, against members trained alone.

The truth is tests/truth.py: every member's twin trained alone with torch.optim on the batches
Lightning fed the ensemble (recorded by a callback), with the patience rule written again from
the docs. Resuming from Lightning's own ModelCheckpoint is compared bit for bit with the
uninterrupted run.
"""

from __future__ import annotations

import functools
import importlib
import math
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from truth import TOL64, assert_members_equal, train_alone, twins

import vmapens
from vmapens.lightning import EnsembleModule

N = 3
LRS = [1e-3, 0.05, 0.8]  # a slow member that keeps improving, a fast one, one that overshoots
EPOCHS = 6
PATIENCE = 1
QUIET = dict(
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    accelerator="cpu",
    num_sanity_val_steps=0,
)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def data() -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(24, 3, generator=g, dtype=torch.float64)
    y = x.sum(1, keepdim=True).sin() + 0.3 * torch.randn(24, 1, generator=g, dtype=torch.float64)
    xv = torch.randn(16, 3, generator=g, dtype=torch.float64)
    yv = xv.sum(1, keepdim=True).sin()
    # shuffle=True draws the order of every epoch from the global RNG: resuming must restore it.
    train = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    return train, DataLoader(TensorDataset(xv, yv), batch_size=16)


class Record(L.Callback):
    """The batches Lightning feeds the module, by epoch (the data order under test is theirs)."""

    def __init__(self) -> None:
        self.batches: dict[int, list] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        x, y = batch
        self.batches.setdefault(trainer.current_epoch, []).append((x.clone(), y.clone()))


def module(ens: vmapens.Ensemble, **kw) -> EnsembleModule:
    lr = torch.tensor(LRS, dtype=torch.float64)
    return EnsembleModule(
        ens, nn.MSELoss(), optimizer=functools.partial(vmapens.StackedAdam, lr=lr), **kw
    )


def run(tmp: Path, ckpt_path: str | None = None) -> tuple[EnsembleModule, L.Trainer, Record]:
    ens = vmapens.Ensemble(mlp, n=N, seed=0)
    mod = module(ens, patience=PATIENCE)
    rec = Record()
    saver = ModelCheckpoint(dirpath=tmp, filename="{epoch}", save_top_k=-1)
    trainer = L.Trainer(max_epochs=EPOCHS, callbacks=[rec, saver], **QUIET)
    train, val = data()
    trainer.fit(mod, train, val, ckpt_path=ckpt_path)
    return mod, trainer, rec


def alone_with_patience(batches: dict[int, list], val: tuple) -> tuple[list[nn.Module], list]:
    """Each twin trained alone with torch.optim.Adam, epoch by epoch, stopping as the docs say:
    after each epoch a member improves when its val loss is below its best so far; one that has
    not improved for PATIENCE epochs trains no more. Returns the twins and their stop epochs."""
    xv, yv = val
    models = twins(vmapens.Ensemble(mlp, n=N, seed=0).unstack())
    stopped = []
    for i, m in enumerate(models):
        opt = torch.optim.Adam(m.parameters(), lr=LRS[i])
        best, bad, stop = math.inf, 0, -1
        for epoch in sorted(batches):
            train_alone(m, batches[epoch], nn.functional.mse_loss, opt)
            with torch.no_grad():
                v = nn.functional.mse_loss(m(xv), yv).item()
            best, bad = (v, 0) if v < best else (best, bad + 1)
            if bad >= PATIENCE:
                stop = epoch
                break
        stopped.append(stop)
    return models, stopped


def test_trains_like_members_alone_and_resumes_bit_identical(tmp_path: Path):
    full, trainer, rec = run(tmp_path / "full")
    _, val = data()
    xv, yv = next(iter(val))
    models, stopped = alone_with_patience(rec.batches, (xv, yv))
    # The premise: members stop at different epochs, one of them never.
    assert len(set(stopped)) > 1 and -1 in stopped, stopped
    assert full.stopped_epoch.tolist() == stopped
    assert_members_equal(full.ens, models, **TOL64)
    for i, m in enumerate(models):
        with torch.no_grad():
            want = nn.functional.mse_loss(m(xv), yv)
        got = trainer.callback_metrics[f"val_loss/member_{i}"]
        torch.testing.assert_close(got, want, **TOL64)
    assert trainer.global_step == sum(len(b) for b in rec.batches.values())

    # Interrupted at the end of epoch 1 (Lightning's own checkpoint), resumed by Lightning.
    with warnings.catch_warnings():  # Lightning's note that the run's directory holds files
        warnings.filterwarnings("ignore", "Checkpoint directory .* exists and is not empty")
        resumed, _, rec2 = run(tmp_path / "full", ckpt_path=str(tmp_path / "full" / "epoch=1.ckpt"))
    assert sorted(rec2.batches) == [e for e in sorted(rec.batches) if e >= 2]
    for epoch, batches in rec2.batches.items():
        for (x, y), (x0, y0) in zip(batches, rec.batches[epoch], strict=True):
            assert torch.equal(x, x0) and torch.equal(y, y0), f"epoch {epoch}: another batch order"
    for key, want in full.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], want), key
    opt_full = trainer.optimizers[0].state_dict()["state"]
    opt_resumed = resumed.trainer.optimizers[0].state_dict()["state"]
    for k, state in opt_full.items():
        for name, t in state.items():
            assert torch.equal(opt_resumed[k][name], t), (k, name)


def test_all_members_stopped_stops_the_trainer(tmp_path: Path):
    ens = vmapens.Ensemble(mlp, n=2, seed=0)
    # lr 5: every member overshoots at once, so both stop after their first epochs.
    mod = EnsembleModule(
        ens, nn.MSELoss(), optimizer=functools.partial(vmapens.StackedSGD, lr=5.0), patience=1
    )
    trainer = L.Trainer(max_epochs=20, enable_checkpointing=False, **QUIET)
    train, val = data()
    trainer.fit(mod, train, val)
    assert not bool(mod.active.any())
    assert trainer.current_epoch == int(mod.stopped_epoch.max()) + 1 < 20


def test_metrics_per_member_and_averaged():
    """A callable metric and a metric object, per member and for the averaged output, equal
    the same metric of each member's own output written again by hand."""

    class MeanAbs:  # the reset/update/compute protocol of a torchmetrics Metric
        def reset(self):
            self.total, self.count = 0.0, 0

        def update(self, out, y):
            self.total += (out - y).abs().sum().item()
            self.count += y.numel()

        def compute(self):
            return torch.tensor(self.total / self.count, dtype=torch.float64)

    ens = vmapens.Ensemble(mlp, n=N, seed=0)
    metrics = {"max": lambda out, y: (out - y).abs().max(), "mae": MeanAbs()}
    mod = EnsembleModule(ens, nn.MSELoss(), metrics=metrics)
    trainer = L.Trainer(max_epochs=1, enable_checkpointing=False, **QUIET)
    train, _ = data()
    xv, yv = train.dataset.tensors
    # Two validation batches of unequal size (16 + 8 rows): values are row-weighted means.
    trainer.fit(mod, train, DataLoader(TensorDataset(xv, yv), batch_size=16))
    outs = [m(xv).detach() for m in ens.unstack()]
    got = trainer.callback_metrics
    maxes = []
    for i, out in enumerate(outs):
        per_batch = [(out[:16] - yv[:16]).abs().max(), (out[16:] - yv[16:]).abs().max()]
        maxes.append((per_batch[0] * 16 + per_batch[1] * 8) / 24)
        torch.testing.assert_close(got[f"val_max/member_{i}"], maxes[i], **TOL64)
        mae = (out - yv).abs().mean()
        torch.testing.assert_close(got[f"val_mae/member_{i}"], mae, **TOL64)
    torch.testing.assert_close(got["val_max"], torch.stack(maxes).mean(), **TOL64)
    mean = torch.stack(outs).mean(0)
    torch.testing.assert_close(got["val_mae/ensemble"], (mean - yv).abs().mean(), **TOL64)


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        (dict(ens=nn.Linear(2, 1)), TypeError, r"EnsembleModule: `ens` must be"),
        (dict(loss_fn=3), TypeError, r"EnsembleModule: `loss_fn` must be callable"),
        (dict(optimizer="adam"), TypeError, r"EnsembleModule: `optimizer` must be"),
        (dict(patience=0), ValueError, r"EnsembleModule: `patience`"),
        (dict(mode="up"), ValueError, r"EnsembleModule: `mode`"),
        (dict(in_dims=1), ValueError, r"EnsembleModule: `in_dims` must be None or 0, got 1"),
        (dict(monitor="val_acc"), ValueError, r"EnsembleModule: `monitor` must be one of"),
        (dict(metrics={"acc": 3}), TypeError, r"EnsembleModule: `metrics` must map"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_arguments(kw, error, match):
    args = dict(ens=vmapens.Ensemble(mlp, n=2, seed=0), loss_fn=nn.MSELoss()) | kw
    with pytest.raises(error, match=match):
        EnsembleModule(args.pop("ens"), args.pop("loss_fn"), **args)


def test_optimizer_factory_must_build_a_stacked_optimizer():
    ens = vmapens.Ensemble(mlp, n=2, seed=0)
    mod = EnsembleModule(ens, nn.MSELoss(), optimizer=lambda e: torch.optim.SGD(e.parameters()))
    trainer = L.Trainer(max_epochs=1, enable_checkpointing=False, **QUIET)
    with pytest.raises(
        TypeError, match=r"`optimizer` must build a vmapens.StackedOptimizer .*got SGD"
    ):
        trainer.fit(mod, *data())


def test_mixed_precision_refused():
    mod = EnsembleModule(vmapens.Ensemble(mlp, n=2, seed=0), nn.MSELoss())
    trainer = L.Trainer(max_epochs=1, enable_checkpointing=False, precision="bf16-mixed", **QUIET)
    with pytest.raises(ValueError, match=r"`precision` must be one of .* got 'bf16-mixed'"):
        trainer.fit(mod, *data())


WORKER = textwrap.dedent(
    """
    import sys
    import vmapens
    print("after import vmapens:", sorted(m for m in sys.modules if "lightning" in m), flush=True)
    import lightning as L, torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    import vmapens
    from vmapens.lightning import EnsembleModule

    ens = vmapens.Ensemble(lambda: nn.Linear(3, 1), n=4, seed=0)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    data = DataLoader(TensorDataset(torch.randn(8, 3), torch.randn(8, 1)), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    try:
        trainer.fit(EnsembleModule(ens, nn.MSELoss()), data)
    except ValueError as err:
        unchanged = all(torch.equal(ens.state_dict()[k], v) for k, v in before.items())
        print(f"rank {trainer.global_rank} refused, unchanged={unchanged}: {err}", flush=True)
    """
)


def test_two_processes_refused(tmp_path: Path):
    """Trainer(devices=2, strategy="ddp") on CPU with gloo, both processes started as a
    launcher starts them (LOCAL_RANK, MASTER_ADDR/PORT set: Lightning spawns nothing): every
    rank refuses in setup, before a step, and says why and what to do instead."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    root = Path(__file__).resolve().parent.parent
    # The rendezvous store is served from here, as torchrun's agent serves it: bound to a port
    # the OS picks and held. A port found free, closed, then bound by rank 0 seconds later (after
    # its imports) can be taken in between by another process (the other xdist worker's torchrun
    # tests bind ports too): rank 0 would fail with EADDRINUSE, or rank 1 meet a foreign server.
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(root),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), NODE_RANK="0", WORLD_SIZE="2",
               TORCHELASTIC_USE_AGENT_STORE="True")  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env=env | {"LOCAL_RANK": str(rank)},
            cwd=root,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for rank in (0, 1)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for rank, out in enumerate(outs):
        want = f"rank {rank} refused, unchanged=True: EnsembleModule: the Trainer's `strategy`"
        assert want in out, out
        assert "DDPStrategy with 2 processes" in out and "average gradients" in out, out
        # The same processes show that the extra is optional: import vmapens leaves it out.
        assert "after import vmapens: []" in out, out


def test_import_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "lightning", None)  # as if the package were not installed
    monkeypatch.delitem(sys.modules, "vmapens.lightning")
    with pytest.raises(ImportError, match=r'pip install "vmapens\[lightning\]"'):
        importlib.import_module("vmapens.lightning")
