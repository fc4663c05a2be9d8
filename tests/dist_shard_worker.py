"""Scenarios for tests/test_hunt_shard.py, run once on 2 CPU ranks (gloo on 127.0.0.1).

``python -m torch.distributed.run --nproc-per-node 2 tests/dist_shard_worker.py OUT`` writes
``OUT/report.rank<r>.json`` (what each call raised, or None) and the member files under
``OUT``; the test process builds the truth (plain modules) itself.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import vmapens  # noqa: E402

SEED, N = 5, 4


def linear() -> nn.Module:
    return nn.Linear(3, 2).double()


def synced() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.SyncBatchNorm(4)).double()


def said(call) -> str | None:
    try:
        call()
    except Exception as err:  # noqa: BLE001 - the message is the result
        return f"{type(err).__name__}: {err}"
    return None


def main(out: Path) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    me = dist.get_rank()
    report = {
        "synced": said(lambda: vmapens.Ensemble(synced, N, seed=SEED, shard=True)),
        "synced_modules": said(
            lambda: vmapens.Ensemble.from_modules([synced() for _ in range(N)], shard=True)
        ),
    }
    ens = vmapens.Ensemble(linear, N, seed=SEED, shard=True)
    best = ens.select([1])  # one member of each rank's block: not a shard
    # Rank 0 saves first, then rank 1 into the same directory.
    for r in range(2):
        if me == r:
            report["best"] = said(lambda: vmapens.save_members(best, out / "best"))
        dist.barrier()
    report["own"] = said(lambda: vmapens.save_members(best, out / f"own{me}"))
    report["ids"] = list(best.member_ids)
    (out / f"report.rank{me}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
