"""Sharded ensembles (``shard=True``) where ranks could silently mix members: SyncBatchNorm,
per-rank sub-ensembles saved into one directory, and a shard's optimizer cut by ``select``.

Truth: plain modules and ``torch.optim.Adam``; the single-process checks stand in for ranks
by patching the rank, world size and the process group's store; tests/dist_shard_worker.py
runs the same on 2 real gloo ranks once.
"""

from __future__ import annotations

import json
from pathlib import Path

import dist_shard_worker as worker
import pytest
import torch
from torch import nn
from torchrun import torchrun
from truth import assert_states

import vmapens
from vmapens import _members, distributed, member_files
from vmapens.optim import StackedAdam

EXACT = {"rtol": 0, "atol": 0}


def seeded(factory, ids, seed: int = worker.SEED) -> list[nn.Module]:
    """Member ``i`` as ``Ensemble(..., seed=seed)`` builds it, as a plain module."""
    out = []
    for i in ids:
        torch.manual_seed(vmapens.seeds.member_seed(seed, i))
        out.append(factory())
    return out


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


# -- 1. nn.SyncBatchNorm in a sharded ensemble -------------------------------------------------


class Net(nn.Module):
    def __init__(self, norm: type = nn.SyncBatchNorm) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 4), norm(4), nn.Linear(4, 2), norm(2))


@pytest.fixture
def rank_one_of_two(monkeypatch):
    """This process as rank 1 of 2 for ``Ensemble(..., shard=True)`` (its block of 4: 2, 3)."""
    monkeypatch.setattr(_members, "member_block", lambda n, api: distributed.member_blocks(n, 2)[1])


def test_sync_batchnorm_is_refused_in_a_sharded_ensemble(rank_one_of_two):
    """A member trained alone computes plain BatchNorm over its own batch; SyncBatchNorm would
    average batch statistics over ranks that hold other members. Refused, naming the paths."""
    rng = torch.get_rng_state()
    with pytest.raises(ValueError, match=r"^Ensemble: `shard=True` with nn.SyncBatchNorm in the "
                       r"members \(body.1, body.3\).*nn.BatchNorm1d/2d/3d"):  # fmt: skip
        vmapens.Ensemble(Net, 4, seed=0, shard=True)
    assert torch.equal(torch.get_rng_state(), rng)  # the refused build left the RNG alone
    with pytest.raises(ValueError, match=r"^Ensemble.from_modules: `shard=True` with "
                       r"nn.SyncBatchNorm in the members \(body.1, body.3\)"):  # fmt: skip
        vmapens.Ensemble.from_modules([Net() for _ in range(4)], shard=True)
    # What the message says to do builds, each member exactly as built alone.
    ens = vmapens.Ensemble(lambda: Net(nn.BatchNorm1d), 4, seed=0, shard=True)
    assert list(ens.member_ids) == [2, 3]
    for got, plain in zip(ens.unstack(), seeded(lambda: Net(nn.BatchNorm1d), [2, 3], 0)):
        assert_states([got.state_dict()], [plain])
    # Unsharded, there is no other rank's block to mix with: not refused.
    assert len(vmapens.Ensemble.from_modules([Net(), Net()])) == 2


# -- 2. save_members of a per-rank sub-ensemble into one directory -------------------------------


@pytest.fixture
def two_ranks(monkeypatch):
    """Two ranks of one process group, called one after the other: rank and world size patched
    where save_members reads them, and one store both ranks share, as a real group's."""
    me = {"rank": 0}
    store = torch.distributed.HashStore()
    for module in (member_files, distributed):
        monkeypatch.setattr(module, "world_size", lambda: 2)
        monkeypatch.setattr(module, "rank", lambda: me["rank"])
    monkeypatch.setattr(distributed.dist.distributed_c10d, "_get_default_store", lambda: store)
    return me


def test_per_rank_sub_ensembles_into_one_directory_are_refused(tmp_path, two_ranks):
    """best-of-block on each rank, saved into one directory: each rank would commit its own
    members.json and load_members would read the last rank's members only."""
    plain = seeded(worker.linear, range(worker.N))
    full = vmapens.Ensemble.from_modules(plain)
    best = [full.select([1]), full.select([3])]  # one member of each rank's block (0-1, 2-3)
    vmapens.save_members(best[0], tmp_path / "best")  # rank 0
    before = snapshot(tmp_path / "best")
    two_ranks["rank"] = 1
    with pytest.raises(ValueError, match=r"^save_members: rank 1 saves members \[3\] into .*best, "
                       r"where rank 0 of this process group saved its own.*gather"):  # fmt: skip
        vmapens.save_members(best[1], tmp_path / "best")
    assert snapshot(tmp_path / "best") == before  # nothing written
    assert_states(member_files.load_members(tmp_path / "best"), [plain[1]])
    # One directory per rank: each its own set.
    vmapens.save_members(best[1], tmp_path / "own1")
    assert_states(member_files.load_members(tmp_path / "own1"), [plain[3]])
    # Rank 0 saves again where it saved (a later epoch), and a gathered ensemble, on rank 0.
    two_ranks["rank"] = 0
    vmapens.save_members(best[0], tmp_path / "best")
    vmapens.save_members(full, tmp_path / "best")
    assert_states(member_files.load_members(tmp_path / "best"), plain)
    # The gathered ensemble saved by rank 1 too (every rank saving what it gathered): the same
    # members, the same files; rank 1's own block there is refused still.
    two_ranks["rank"] = 1
    vmapens.save_members(full, tmp_path / "best")
    assert_states(member_files.load_members(tmp_path / "best"), plain)
    with pytest.raises(ValueError, match=r"^save_members: rank 1 saves members \[3\]"):
        vmapens.save_members(best[1], tmp_path / "best")


# -- 3. a shard's optimizer, cut by select -------------------------------------------------------


def test_select_of_a_shard_optimizer_cuts_later_values_by_global_id():
    """A shard's optimizer (rank 1's block 2-3 of 4) takes per-member values for all 4 members;
    its ``select([1])`` holds global member 3 and must take them too, cut to member 3, as the
    optimizer built on that sub-ensemble does (it refused them: 4 values for n=1)."""
    torch.manual_seed(0)
    lrs = [1e-3, 2e-3, 4e-3, 8e-3]
    full = vmapens.Ensemble.from_modules([nn.Linear(3, 1).double() for _ in range(4)])
    block = full.select([2, 3])  # what a shard holds: member_ids (2, 3), n_total 4
    sub = block.select([1])
    opt = StackedAdam(block, lr=lrs).select([1], sub)
    extra = torch.randn(1, 3, dtype=torch.float64)
    mine = extra.clone().requires_grad_()
    opt.add_param_group({"params": [mine], "lr": lrs})
    alone = extra[0].clone().requires_grad_()
    plain = torch.optim.Adam([alone], lr=lrs[3])
    for step in range(3):
        (mine * step).sum().add((mine**2).sum()).backward()
        (alone * step).sum().add((alone**2).sum()).backward()
        opt.step()
        plain.step()
        opt.zero_grad()
        plain.zero_grad()
    torch.testing.assert_close(mine[0], alone, **EXACT)


# -- the same on 2 real ranks (gloo, 127.0.0.1): one spawn ----------------------------------------


def test_two_real_ranks(tmp_path):
    torchrun(worker.__file__, [str(tmp_path)], tmp_path.name)
    said = [json.loads((tmp_path / f"report.rank{r}.json").read_text()) for r in range(2)]
    for r in range(2):
        assert said[r]["synced"].startswith(
            "ValueError: Ensemble: `shard=True` with nn.SyncBatchNorm in the members (1)"
        )
        assert said[r]["synced_modules"].startswith(
            "ValueError: Ensemble.from_modules: `shard=True` with nn.SyncBatchNorm"
        )
        assert said[r]["own"] is None
    ids = [said[r]["ids"] for r in range(2)]
    assert ids == [[1], [3]]
    assert said[0]["best"] is None
    assert said[1]["best"].startswith("ValueError: save_members: rank 1 saves members [3] into")
    plain = seeded(worker.linear, range(worker.N))
    assert_states(member_files.load_members(tmp_path / "best"), [plain[1]])
    for r in range(2):
        assert_states(member_files.load_members(tmp_path / f"own{r}"), [plain[ids[r][0]]])
