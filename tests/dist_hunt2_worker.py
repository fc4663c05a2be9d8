"""Scenarios for tests/test_hunt_dist2.py, run once on 2 CPU ranks (gloo on 127.0.0.1).

``python -m torch.distributed.run --nproc-per-node 2 tests/dist_hunt2_worker.py OUT`` runs every
scenario on the launched ranks (one spawn for all: starting processes costs seconds) and writes
its results under ``OUT``; the test process builds the truth (plain modules alone) itself.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import vmapens  # noqa: E402

SEED, N, STEPS = 11, 3, 3
LRS = [1e-2, 2e-2, 4e-2]
T, B, D_IN, HIDDEN = 5, 4, 3, 4


class GRUNet(nn.Module):
    """A recurrent member: vmapens runs its own batched GRU (vmapens/_recurrent.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(D_IN, HIDDEN, batch_first=True)
        self.fc = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.gru(x)[0][:, -1])


def gru() -> nn.Module:
    return GRUNet().double()


def mlp() -> nn.Module:
    """No bias before BatchNorm: its gradient would be round-off only, which Adam scales up."""
    return nn.Sequential(
        nn.Linear(D_IN, 5, bias=False), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 1)
    ).double()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (
            torch.randn(B, T, D_IN, generator=g, dtype=torch.float64),
            torch.randn(B, 1, generator=g, dtype=torch.float64),
        )
        for _ in range(STEPS)
    ]


def flat(x: torch.Tensor) -> torch.Tensor:
    """The MLP's input: the sequence's last step."""
    return x[:, -1]


def train(ens: vmapens.Ensemble, inputs=lambda x: x) -> vmapens.StackedAdam:
    """``STEPS`` Adam steps on the shared batches, one learning rate per member (of all N)."""
    opt = vmapens.StackedAdam(ens, lr=LRS)
    for x, y in batches():
        opt.zero_grad()
        vmapens.per_member(nn.functional.mse_loss)(ens(inputs(x)), y).sum().backward()
        opt.step()
    return opt


def main(out: Path) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    me = dist.get_rank()
    report: dict = {}
    # Recurrent members, 2 + 1 over the ranks, gathered onto rank 0.
    ens = vmapens.Ensemble(gru, N, seed=SEED, shard=True)
    train(ens)
    full = vmapens.gather(ens, dst=0)
    if me == 0:
        torch.save(full.state_dict(), out / "gru.pt")
    # A whole-ensemble file restored into each rank's block, ensemble and optimizer.
    if me == 0:
        whole = vmapens.Ensemble(mlp, N, seed=SEED)
        vmapens.save(whole, out / "whole.pt", train(whole, flat))
    dist.barrier()
    block = vmapens.Ensemble(mlp, N, seed=SEED + 1, shard=True)
    opt = vmapens.StackedAdam(block)
    vmapens.restore(out / "whole.pt", block, opt)
    torch.save((block.state_dict(), opt.state_dict()), out / f"block.rank{me}.pt")
    # A sharded fit checkpoint (blocks of 2 and 1), for restores in one process.
    x, y = batches()[0]
    (out / "ckpt").mkdir(exist_ok=True)
    fit_ens = vmapens.Ensemble(mlp, N, seed=SEED, shard=True)
    vmapens.fit(fit_ens, (flat(x), y), nn.MSELoss(), epochs=2, batch_size=2, lr=LRS, seed=SEED,
                val_data=(flat(x), y), progress=False, checkpoint=out / "ckpt" / "ckpt.pt")  # fmt: skip
    # save_members where rank 1 cannot write its file: every rank raises, no manifest.
    (out / "members" / "member_0002.pt").mkdir(parents=True, exist_ok=True)
    try:
        vmapens.save_members(fit_ens, out / "members")
        report["save_members"] = None
    except Exception as err:  # noqa: BLE001 - the message is the result
        report["save_members"] = f"{type(err).__name__}: {err}"
    (out / f"report.rank{me}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]))
    # As tests/dist_worker.py: skip interpreter finalization, where gloo's threads can abort
    # the process (pytorch/pytorch#179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
