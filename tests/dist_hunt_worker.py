"""Scenarios for tests/test_hunt_dist.py: run alone, or on each rank under torchrun.

``python -m torch.distributed.run --nproc-per-node 2 tests/dist_hunt_worker.py OUT`` runs every
scenario once on the launched ranks (one spawn for all: starting processes costs seconds) and
writes the results under ``OUT``; the test process runs the same functions in one process.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import vmapens  # noqa: E402
from vmapens.callbacks import Callback, EarlyStopping, LRScheduler  # noqa: E402
from vmapens.optim import ReduceLROnPlateau  # noqa: E402

SEED = 7
D_IN, D_OUT, ROWS, BATCH = 4, 2, 24, 8
EPOCHS, PARTIAL = 6, 2
# Member 2 (rank 1's only member of 3) overshoots and stops first; the others go on.
LRS = [3e-3, 3e-2, 0.9]
WEIGHT_DECAY = [0.0, 1e-2, 1e-1]


class Net(nn.Module):
    """Awkward on purpose: BatchNorm (an int64 buffer), a bool buffer, a frozen parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D_IN, 6)
        self.bn = nn.BatchNorm1d(6)
        self.fc2 = nn.Linear(6, D_OUT)
        self.fc2.bias.requires_grad_(False)
        self.register_buffer("keep", torch.tensor([True, False, True, True, True, True]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.bn(self.fc1(x))) * self.keep)


def factory() -> nn.Module:
    return Net().double()


class Spectral(nn.Module):
    """A complex buffer (a filter), drawn at construction: gloo has no complex collectives."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D_IN, D_OUT)
        self.register_buffer("filt", torch.randn(D_OUT, dtype=torch.complex64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.filt.real


def data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, D_IN, generator=g, dtype=torch.float64)
    return x, x[:, :D_OUT].sin() + 0.3 * torch.randn(ROWS, D_OUT, generator=g, dtype=torch.float64)


def mae(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).abs().mean()


def fit(
    n: int, shard: bool, epochs: int = EPOCHS, checkpoint: Path | None = None, plateau: bool = False
):
    """Bagging, per-member lr and weight decay, early stopping with best restore and (with
    ``plateau``) a per-member plateau scheduler: the per-member parts of a fit checkpoint."""
    ens = vmapens.Ensemble(factory, n, seed=SEED, shard=shard)
    opt = vmapens.StackedAdam(ens, lr=LRS[:n], weight_decay=WEIGHT_DECAY[:n])
    callbacks: list = [EarlyStopping(patience=1, restore_best=True)]
    if plateau:
        callbacks.append(LRScheduler(lambda o: ReduceLROnPlateau(o, patience=0, factor=0.5)))
    history = vmapens.fit(
        ens, data(0), nn.MSELoss(), epochs=epochs, batch_size=BATCH, bootstrap=True, seed=SEED,
        optimizer=opt, val_data=data(1), metrics={"mae": mae}, callbacks=callbacks,
        checkpoint=checkpoint, progress=False,
    )  # fmt: skip
    return ens, opt, history


def member_states(ens: vmapens.Ensemble, opt: vmapens.StackedOptimizer) -> dict[int, dict]:
    """Global member id -> that member's optimizer state (plain torch layout)."""
    return {gid: opt.member_state_dict(i) for i, gid in enumerate(ens.member_ids)}


def train_steps(n: int, shard: bool) -> tuple[vmapens.Ensemble, dict[int, dict]]:
    ens = vmapens.Ensemble(factory, n, seed=SEED, shard=shard)
    opt = vmapens.StackedAdam(ens, lr=LRS[:n])
    step = vmapens.make_step(ens, nn.MSELoss(), opt)
    x, y = data(0)
    for k in range(3):
        step(x[k * BATCH : (k + 1) * BATCH], y[k * BATCH : (k + 1) * BATCH])
    return ens, member_states(ens, opt)


def _save_all(out: Path, name: str, ens, opt, history, me: int) -> None:
    """The gathered state (on rank 1: `gather(dst=1)`), merged history, optimizer rows."""
    full = vmapens.gather(ens, dst=1)
    merged = vmapens.gather_history(history, dst=1)
    torch.save(member_states(ens, opt), out / f"{name}.opt.rank{me}.pt")
    if me == 1:
        assert full is not None and merged is not None
        torch.save({"state": full.state_dict(), "history": merged.state_dict()}, out / f"{name}.pt")


class Spy(Callback):
    """Records whether a run got as far as the callbacks' ``on_fit_start``."""

    def __init__(self) -> None:
        self.started = False

    def on_fit_start(self, ctx) -> None:
        self.started = True


def seed_none(report: dict) -> None:
    """A sharded fit with ``seed=None`` (bootstrap and shuffle need one seed on every rank):
    refused, and what had changed by then."""
    ens = vmapens.Ensemble(factory, 3, seed=SEED, shard=True)
    opt = vmapens.StackedAdam(ens, lr=0.1)
    spy = Spy()
    step_lr = LRScheduler(lambda o: torch.optim.lr_scheduler.StepLR(o, 1))
    try:
        vmapens.fit(
            ens, data(0), nn.MSELoss(), epochs=1, batch_size=BATCH, optimizer=opt,
            callbacks=[spy, step_lr], progress=False,
        )  # fmt: skip
        report["seed_none"] = None
    except ValueError as err:
        report["seed_none"] = str(err)
    report["seed_none_changed"] = {
        "on_fit_start_ran": spy.started,
        "optimizer_changed": "initial_lr" in opt.param_groups[0],
    }


def _attempt(report: dict, key: str, fn) -> None:
    try:
        fn()
        report[key] = None
    except Exception as err:  # noqa: BLE001 - the message is the result
        report[key] = f"{type(err).__name__}: {err}"


def main(out: Path) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    me = dist.get_rank()
    report: dict = {}
    # make_step on 3 members over 2 ranks (uneven), gathered onto rank 1.
    ens, states = train_steps(3, shard=True)
    full = vmapens.gather(ens, dst=1)
    torch.save(states, out / f"steps.opt.rank{me}.pt")
    if me == 1:
        assert full is not None
        torch.save(full.state_dict(), out / "steps.pt")
        report["steps_ids"] = list(full.member_ids)
        report["steps_frozen"] = {k: p.requires_grad for k, p in full.stacked_params().items()}
        full.eval()
        with torch.no_grad():
            torch.save(full(data(1)[0]), out / "steps.forward.pt")
    spectral = vmapens.gather(vmapens.Ensemble(Spectral, 3, seed=SEED, shard=True), dst=0)
    if me == 0:
        assert spectral is not None
        torch.save(spectral.state_dict(), out / "spectral.pt")
    # fit, uninterrupted; then a run stopped after PARTIAL epochs and resumed.
    ens, opt, history = fit(3, shard=True)
    _save_all(out, "fit", ens, opt, history, me)
    vmapens.save_members(ens, out / "members")
    ckpt = out / "ckpt" / "ckpt.pt"
    ckpt.parent.mkdir(exist_ok=True)
    fit(3, shard=True, epochs=PARTIAL, checkpoint=ckpt)
    dist.barrier()
    if me == 0:  # kept for a resume in one process
        shutil.copytree(ckpt.parent, out / "partial")
    dist.barrier()
    ens, opt, history = fit(3, shard=True, checkpoint=ckpt)
    _save_all(out, "resumed", ens, opt, history, me)
    plateau = out / "plateau" / "ckpt.pt"
    plateau.parent.mkdir(exist_ok=True)
    fit(3, shard=True, epochs=PARTIAL, checkpoint=plateau, plateau=True)
    # As many members as ranks: one each.
    ens, opt, history = fit(2, shard=True)
    _save_all(out, "two", ens, opt, history, me)
    # A rank whose ensemble is not its block, or whose `dst` differs: every rank must refuse,
    # none may wait in the collective until the group's timeout.
    whole = vmapens.Ensemble(factory, 4, seed=SEED, shard=me == 1)
    _attempt(report, "gather_unsharded_rank0", lambda: vmapens.gather(whole))
    _attempt(report, "gather_dst_differs", lambda: vmapens.gather(ens, dst=me))
    _attempt(report, "gather_history_dst_differs", lambda: vmapens.gather_history(history, dst=me))
    _attempt(report, "gather_dst_out_of_range_on_rank1", lambda: vmapens.gather(ens, dst=2 * me))
    seed_none(report)
    (out / f"report.rank{me}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    try:
        main(Path(sys.argv[1]))
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    # Skip interpreter finalization: gloo's threads can abort it (see tests/dist_worker.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
