"""``vmapens.load`` and ``vmapens.restore`` of a sharded fit checkpoint, in one process.

A user trains sharded on several processes, then loads every member in one process (no
process group) to evaluate or export. Run as a script under torchrun, this file is its own
worker: 3 members with BatchNorm on 2 CPU ranks (gloo on 127.0.0.1; blocks of 2 and 1), one
``fit(..., checkpoint=...)``, and each rank's own state dumped with plain ``torch.save``. The
truth: those dumps, row by row (bit for bit), and the single-process run of the same members
(BatchNorm sums in another order for another number of members: docs/distributed.md).
"""

from __future__ import annotations

import copy
import datetime
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torchrun import torchrun
from truth import TOL64, assert_bit_identical

import vmapens
from vmapens.callbacks import EarlyStopping

SEED, N, EPOCHS, ROWS, BATCH, D_IN, D_OUT = 11, 3, 2, 16, 8, 4, 2
LRS, WEIGHT_DECAY = [1e-2, 3e-2, 1e-1], [0.0, 1e-2, 1e-1]
SETTINGS = dict(randomness="same", chunk_size=2)  # not the defaults: load must keep them
BLOCKS = [[0, 1], [2]]  # member_blocks(3, 2)
# Against the single-process run: a Linear's bias before BatchNorm has a gradient of round-off
# only, which Adam scales up (tests/test_hunt_dist.py); the running mean follows that bias.
TOL_BN = dict(rtol=0, atol=1.8e-8)
BEFORE_BN = ("fc1.bias", "bn.running_mean")


class Net(nn.Module):
    """BatchNorm (running stats, an int64 counter) and a frozen parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(D_IN, 6), nn.BatchNorm1d(6), nn.Linear(6, D_OUT)
        self.fc2.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


def factory() -> nn.Module:
    return Net().double()


def data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, D_IN, generator=g, dtype=torch.float64)
    return x, x[:, :D_OUT].sin() + 0.3 * torch.randn(ROWS, D_OUT, generator=g, dtype=torch.float64)


def mae(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).abs().mean()


def run(shard: bool, checkpoint: Path) -> tuple:
    """Bagging, per-member lr and weight decay, validation with a metric, a checkpoint.

    No best-epoch restore: the members end as the checkpoint of the last epoch holds them
    (with it, ``fit`` hands back each member's best epoch, the checkpoint the last one)."""
    ens = vmapens.Ensemble(factory, N, seed=SEED, shard=shard, **SETTINGS)
    opt = vmapens.StackedAdam(ens, lr=LRS, weight_decay=WEIGHT_DECAY)
    history = vmapens.fit(
        ens, data(0), nn.MSELoss(), epochs=EPOCHS, batch_size=BATCH, bootstrap=True, seed=SEED,
        optimizer=opt, val_data=data(1), metrics={"mae": mae}, checkpoint=checkpoint,
        callbacks=[EarlyStopping(restore_best=False)], progress=False,
    )  # fmt: skip
    return ens, opt, history


def worker(out: Path) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    ens, opt, history = run(True, out / "ckpt.pt")
    own = {"ids": list(ens.member_ids), "state": ens.state_dict(), "opt": opt.state_dict()}
    torch.save({**own, "history": history.state_dict()}, out / f"rank{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()


# -- the two runs -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """The 2-rank run's directory: ckpt.pt, ckpt.pt.members/, rank0.pt and rank1.pt."""
    out = tmp_path_factory.mktemp("sharded")
    torchrun(__file__, [str(out)], out.name)
    return out


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    """The same run in this process: a plain fit checkpoint of the same members."""
    path = tmp_path_factory.mktemp("single") / "ckpt.pt"
    run(False, path)
    return path


def ranks(out: Path) -> list[dict]:
    held = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert [h["ids"] for h in held] == BLOCKS
    return held


def fresh() -> tuple:
    """An ensemble of all members (other values), its optimizer and an empty History."""
    ens = vmapens.Ensemble(factory, N, seed=SEED + 1)
    opt = vmapens.StackedAdam(ens, lr=0.5)
    return ens, opt, vmapens.History.empty(range(N), True, ["mae"])


def rows_of(t: torch.Tensor, block: list[int], dim: int = 0) -> torch.Tensor:
    return t.index_select(dim, torch.tensor(block))


def assert_rows(got: dict, held: list[dict], where: str) -> None:
    """Each stacked tensor of ``got`` (all members) holds each rank's rows, bit for bit."""
    for block, rank in zip(BLOCKS, held, strict=True):
        assert list(got) == list(rank[where]), where
        for key, want in rank[where].items():
            assert_bit_identical(rows_of(got[key], block), want, f"{where} {key} {block}")


def assert_close_to(got: dict, expected: dict, where: str) -> None:
    assert list(got) == list(expected), where
    for key, want in expected.items():
        tol = TOL_BN if key in BEFORE_BN else TOL64
        torch.testing.assert_close(got[key], want, **tol, msg=f"{where} {key}")


# -- load and restore ---------------------------------------------------------------------------


def test_load_gives_every_member_as_the_ranks_held_it(sharded: Path, single: Path):
    ens = vmapens.load(sharded / "ckpt.pt", factory)
    assert list(ens.member_ids) == list(range(N)) and ens.n_total == N and len(ens) == N
    assert_rows(ens.state_dict(), ranks(sharded), "state")
    plain = vmapens.load(single, factory)
    assert (ens.backend, ens.randomness, ens.chunk_size) == (
        plain.backend,
        plain.randomness,
        plain.chunk_size,
    )
    assert (plain.randomness, plain.chunk_size) == ("same", 2)
    assert_close_to(ens.state_dict(), plain.state_dict(), "state")
    # The loaded ensemble runs: member i's output is that of member i of the plain run.
    x = data(2)[0]
    ens.eval(), plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(ens(x), plain(x), **TOL_BN)


def test_restore_fills_ensemble_optimizer_and_history(sharded: Path, single: Path):
    ens, opt, history = fresh()
    vmapens.restore(sharded / "ckpt.pt", ens, opt, history)
    held = ranks(sharded)
    assert_rows(ens.state_dict(), held, "state")
    state = opt.state_dict()
    for block, rank in zip(BLOCKS, held, strict=True):
        for k, entry in rank["opt"]["state"].items():
            for name, want in entry.items():
                got = state["state"][k][name]
                mine = rows_of(got, block) if got.dim() and want.shape[:1] == (len(block),) else got
                assert_bit_identical(mine, want, f"optimizer state {k} {name} {block}")
        for group, theirs in zip(state["param_groups"], rank["opt"]["param_groups"], strict=True):
            assert [group["lr"][i] for i in block] == list(theirs["lr"])
            assert [group["weight_decay"][i] for i in block] == list(theirs["weight_decay"])
        columns = {"train_loss": 1, "val_loss": 1, "best_epoch": 0, "stopped_epoch": 0}
        for name, dim in columns.items():
            want = rank["history"][name]
            assert_bit_identical(rows_of(getattr(history, name), block, dim), want, name)
        want = rank["history"]["metrics"]["mae"]
        assert_bit_identical(rows_of(history.metrics["mae"], block, 1), want, "mae")
    assert history.member_ids == list(range(N))
    # Each rank scored the ensemble metric on its own block: not the ensemble's (gather_history).
    assert history.ensemble_metrics is None

    # The same as restoring the single-process run's checkpoint (BatchNorm: to round-off).
    ens1, opt1, history1 = fresh()
    vmapens.restore(single, ens1, opt1, history1)
    assert_close_to(ens.state_dict(), ens1.state_dict(), "state")
    got, want = opt.state_dict(), opt1.state_dict()
    assert got["param_groups"] == want["param_groups"]
    for k, entry in want["state"].items():
        assert_close_to(got["state"][k], entry, f"optimizer state {k}")
    got, want = history.state_dict(), history1.state_dict()
    assert want["ensemble_metrics"] is not None
    got["ensemble_metrics"] = want["ensemble_metrics"] = None
    torch.testing.assert_close(got, want, **TOL_BN)


# -- refused, and nothing changes ---------------------------------------------------------------


def spoil(out: Path, case: str, tmp_path: Path) -> Path:
    """A copy of the sharded checkpoint with rank 1's block missing, corrupt or another epoch's."""
    shutil.copytree(out, tmp_path / "run", ignore=shutil.ignore_patterns("rank*.pt"))
    path = tmp_path / "run" / "ckpt.pt"
    block = next((tmp_path / "run" / "ckpt.pt.members").glob("members-000002-000003.*.pt"))
    if case == "missing":
        block.unlink()
    elif case == "corrupt":
        data = bytearray(block.read_bytes())
        data[len(data) // 2] ^= 0xFF
        block.write_bytes(bytes(data))
    else:  # a block of another epoch under the name the checkpoint gives
        held = vmapens.checkpoint.read(block, "test")
        parts = {k: v for k, v in held.items() if k not in ("format", "version")}
        vmapens.checkpoint.write(block, {**parts, "epoch": held["epoch"] - 1})
    return path


SPOILED = {
    "missing": r"names the block .*members-000002-000003\.epoch000002\.pt, which is missing$",
    "corrupt": r"members-000002-000003\.epoch000002\.pt",
    "foreign": r"members-000002-000003\.epoch000002\.pt is not the block .*ckpt\.pt names",
}


@pytest.mark.parametrize("case", list(SPOILED))
def test_a_bad_block_is_refused_naming_the_api_and_changes_nothing(
    case: str, sharded: Path, single: Path, tmp_path: Path
):
    path = spoil(sharded, case, tmp_path)
    with pytest.raises(ValueError, match=rf"^load: .*{SPOILED[case]}"):
        vmapens.load(path, factory)
    ens, opt, history = fresh()
    vmapens.restore(single, ens, opt, history)
    before = copy.deepcopy((ens.state_dict(), opt.state_dict(), history.state_dict()))
    with pytest.raises(ValueError, match=rf"^restore: .*{SPOILED[case]}"):
        vmapens.restore(path, ens, opt, history)
    assert_bit_identical((ens.state_dict(), opt.state_dict(), history.state_dict()), before)


def test_other_members_are_named_before_any_block_is_read(sharded: Path, tmp_path: Path):
    path = spoil(sharded, "missing", tmp_path)
    ens = vmapens.Ensemble(factory, N - 1, seed=SEED)
    before = copy.deepcopy(ens.state_dict())
    with pytest.raises(ValueError, match=r"^restore: .*holds 3 members .*this ensemble has 2"):
        vmapens.restore(path, ens)
    assert_bit_identical(ens.state_dict(), before)


if __name__ == "__main__":
    torch.set_num_threads(1)
    worker(Path(sys.argv[1]))
    # As tests/dist_worker.py: skip interpreter finalization, where gloo's threads can abort
    # the process (pytorch/pytorch#179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
