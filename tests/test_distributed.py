"""Sharded ensembles against one process: 2 CPU ranks (gloo on 127.0.0.1) vs the same seed alone."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import dist_worker
import pytest
import torch
from torch import nn
from torchrun import torchrun

import vmapens
import vmapens.checkpoint
from vmapens import distributed

WORKER = Path(dist_worker.__file__)


def launch(
    scenario: str, out: Path, *, ranks: int = 2, restarts: int = 0, env=None, fails: bool = False
) -> None:
    """Run ``dist_worker.py scenario out`` on ``ranks`` local processes under torchrun.

    ``fails``: the run is meant to fail (a rank is killed): expect a non-zero exit status.
    """
    torchrun(WORKER, [scenario, str(out)], out.name, ranks=ranks, restarts=restarts, env=env,
             fails=fails)  # fmt: skip


def assert_same_state(got: dict, expected: dict) -> None:
    assert list(got) == list(expected)
    for key in expected:
        # Exact: each rank runs the very same per-member arithmetic as the single process.
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0, msg=key)


@pytest.fixture(scope="module")
def steps_run(tmp_path_factory) -> Path:
    """One 2-rank run of dist_worker's "main" scenario; the tests below read its files."""
    out = tmp_path_factory.mktemp("main")
    launch("main", out)
    return out


@pytest.fixture(scope="module")
def single_fit(tmp_path_factory) -> tuple[dict, dict, Path]:
    """The fit scenario in this process, unsharded: state, history, save_members directory."""
    ens, history = dist_worker.fit(8, shard=False)
    members = tmp_path_factory.mktemp("single") / "members"
    vmapens.save_members(ens, members)
    return ens.state_dict(), history.state_dict(), members


def assert_same_fit(path: Path, single_fit: tuple) -> None:
    state, history, _ = single_fit
    got = torch.load(path)
    assert_same_state(got["state"], state)
    assert got["history"]["member_ids"] == list(range(8))
    assert_same_state(
        {k: v for k, v in got["history"].items() if isinstance(v, torch.Tensor)},
        {k: v for k, v in history.items() if isinstance(v, torch.Tensor)},
    )
    assert history["val_loss"] is not None and set(history["metrics"]) == {"mae"}
    # Validation losses and metrics drive early stopping and restore_best: to the bit as well.
    assert_same_state(got["history"]["metrics"], history["metrics"])


def test_sharded_fit_gathers_to_single_process_run(steps_run: Path, single_fit: tuple):
    assert_same_fit(steps_run / "fit.pt", single_fit)


def test_progress_only_on_rank_0_with_totals_over_ranks(steps_run: Path):
    assert (steps_run / "progress.rank1.txt").read_text() == ""
    text = (steps_run / "progress.rank0.txt").read_text()
    assert "training 8/8" in text, text  # 4 members per rank, counted over both


def test_save_members_from_two_ranks_equals_one_process(steps_run: Path, single_fit: tuple):
    expected = single_fit[2]
    names = sorted(p.name for p in expected.iterdir())
    assert sorted(p.name for p in (steps_run / "members").iterdir()) == names
    assert "members.json" in names  # rank 0 wrote the manifest of both ranks' members
    for name in (n for n in names if n.startswith("member_")):
        assert_same_state(torch.load(steps_run / "members" / name), torch.load(expected / name))
    got, want = vmapens.load_members(steps_run / "members"), vmapens.load_members(expected)
    assert len(got) == len(want) == 8
    for a, b in zip(got, want, strict=True):
        assert_same_state(a, b)


def test_rank_dies_mid_training_restart_resumes_from_checkpoints(tmp_path: Path, single_fit):
    # The shared rendezvous store would hand restarted workers the dead attempt's addresses
    # (pytorch/pytorch#135712): keep the workers' store apart from the agent's.
    env = {"VMAPENS_TEST_FAIL_RANK": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    launch("fault", tmp_path, restarts=1, env=env)
    # Rank 0 may finish fitting in the first attempt: it then dies waiting in gather.
    assert not (tmp_path / "attempt0.rank1.json").exists(), "rank 1 should have failed"
    # Rank 1 wrote its epoch-1 checkpoint, died in epoch 2, and ran only epochs 2..4 again.
    assert json.loads((tmp_path / "attempt1.rank1.json").read_text()) == [2, 3, 4]
    # Rank 0 resumed from wherever it was when the group was stopped (possibly the end).
    rank0 = json.loads((tmp_path / "attempt1.rank0.json").read_text())
    assert rank0 == [1, 2, 3, 4][4 - len(rank0) :]
    assert sorted(p.name for p in tmp_path.glob("ckpt*")) == ["ckpt.pt", "ckpt.pt.members"]
    blocks = sorted(p.name for p in (tmp_path / "ckpt.pt.members").iterdir())
    assert blocks == [
        "members-000000-000004.epoch000004.pt",
        "members-000004-000008.epoch000004.pt",
    ]
    assert_same_fit(tmp_path / "fit.pt", single_fit)


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory) -> Path:
    """A 2-rank run whose rank 1 is killed (SIGKILL) in epoch 2: a sharded checkpoint of
    epoch 1. Tests copy the directory before they change anything in it."""
    out = tmp_path_factory.mktemp("killed")
    launch("killed", out, fails=True)
    return out


def test_killed_rank_resumes_on_one_and_on_three_processes(
    tmp_path: Path, single_fit, killed_run: Path
):
    """A 2-rank run loses rank 1 (SIGKILL) in epoch 2; its checkpoint resumes on 1 process and
    on 3, and a 1-process checkpoint on 3: each ends as the uninterrupted run."""
    killed = shutil.copytree(killed_run, tmp_path / "killed")
    manifest = vmapens.checkpoint.read(killed / "ckpt.pt", "test")
    # Epoch 1 is the last committed one: its steps, and each rank's block of it.
    assert manifest["fit"]["global_step"] == dist_worker.ROWS // dist_worker.BATCH
    assert manifest["blocks"] == [
        ("members-000000-000004.epoch000001.pt", [0, 1, 2, 3]),
        ("members-000004-000008.epoch000001.pt", [4, 5, 6, 7]),
    ]
    alone = shutil.copytree(killed, tmp_path / "alone")
    epochs: list[int] = []  # 2 -> 1, in this process: resumes after epoch 1
    ens, history = dist_worker.fit(
        8, shard=False, checkpoint=alone / "ckpt.pt", callbacks=[lambda h: epochs.append(h.epochs)]
    )
    assert epochs == [2, 3, 4]
    write_local(ens, history, alone / "fit.pt")
    assert_same_fit(alone / "fit.pt", single_fit)
    assert not (alone / "ckpt.pt.members").exists()  # a single file again
    one = tmp_path / "one"
    one.mkdir()
    dist_worker.fit(8, shard=False, checkpoint=one / "ckpt.pt", epochs=2)
    paths = [str(killed / "ckpt.pt"), str(one / "ckpt.pt")]  # 2 -> 3 and 1 -> 3
    launch("resume", tmp_path, ranks=3, env={"VMAPENS_TEST_CKPTS": os.pathsep.join(paths)})
    for path, resumed in zip(paths, ([2, 3, 4], [3, 4]), strict=True):
        assert_same_fit(Path(path + ".fit.pt"), single_fit)
        for r in range(3):
            assert json.loads(Path(f"{path}.epochs.rank{r}.json").read_text()) == resumed
    blocks = sorted(p.name for p in (one / "ckpt.pt.members").iterdir())
    assert blocks == [
        f"members-{a:06d}-{b:06d}.epoch000004.pt" for a, b in ((0, 3), (3, 6), (6, 8))
    ]


def resume_alone(ckpt: Path) -> None:
    dist_worker.fit(8, shard=False, checkpoint=ckpt)


def rewrite_block(ckpt: Path, index: int, **changes) -> Path:
    """Block ``index`` of ``ckpt`` written again (digest and all) with ``changes``."""
    name = vmapens.checkpoint.read(ckpt, "test")["blocks"][index][0]
    path = ckpt.with_name(ckpt.name + ".members") / name
    block = vmapens.checkpoint.read(path, "test")
    vmapens.checkpoint.write(path, {**block, **changes})
    return path


def older_rows(ckpt: Path) -> list:
    """Block 1's rows with one epoch fewer of history (what an older epoch's block holds)."""
    name = vmapens.checkpoint.read(ckpt, "test")["blocks"][1][0]
    rows = vmapens.checkpoint.read(ckpt.with_name(ckpt.name + ".members") / name, "t")["rows"]
    return [(p, k, d, v[:0] if p[0] == "history" and d == 1 else v) for p, k, d, v in rows]


BLOCK_FAULTS = [
    ("other-run", lambda c: rewrite_block(c, 1, run="0" * 32), r"of run 0{32} at epoch 1, the "
     r"checkpoint wants members \[4, 5, 6, 7\] of run [0-9a-f]{32} at epoch 1"),
    ("older-epoch", lambda c: rewrite_block(c, 1, epoch=0, rows=older_rows(c)),
     r"at epoch 0, the checkpoint wants .* at epoch 1 \(a block of another run, or left from"),
    ("same-rows-older-epoch", lambda c: rewrite_block(c, 1, epoch=0), r"at epoch 0, the check"),
    ("other-members", lambda c: rewrite_block(c, 1, member_ids=[0, 1, 2, 3]),
     r"holds members \[0, 1, 2, 3\] of run"),
]  # fmt: skip


@pytest.mark.parametrize(("fault", "match"), [f[1:] for f in BLOCK_FAULTS],
                         ids=[f[0] for f in BLOCK_FAULTS])  # fmt: skip
def test_resume_refuses_a_block_of_another_run_or_epoch(tmp_path, killed_run, fault, match):
    ckpt = shutil.copytree(killed_run, tmp_path / "run") / "ckpt.pt"
    path = fault(ckpt)
    with pytest.raises(ValueError, match=rf"^fit: {re.escape(str(path))} is not the block .*"
                       + match):  # fmt: skip
        resume_alone(ckpt)


@pytest.mark.parametrize("name", ["../outside/blk.pt", "/tmp/blk.pt", "sub/members-000000-"
                                  "000004.epoch000001.pt", ""])  # fmt: skip
def test_block_paths_stay_inside_the_members_directory(tmp_path, killed_run, name):
    ckpt = shutil.copytree(killed_run, tmp_path / "run") / "ckpt.pt"
    (tmp_path / "outside").mkdir()
    shutil.copy(rewrite_block(ckpt, 0), tmp_path / "outside" / "blk.pt")  # a valid block there
    manifest = vmapens.checkpoint.read(ckpt, "test")
    manifest["blocks"][0] = (name, manifest["blocks"][0][1])
    vmapens.checkpoint.write(ckpt, manifest)
    with pytest.raises(ValueError, match=r"names the block .*, not a block file name in"):
        resume_alone(ckpt)


def test_a_corrupt_or_missing_block_is_an_error_naming_it(tmp_path, killed_run):
    ckpt = shutil.copytree(killed_run, tmp_path / "run") / "ckpt.pt"
    path = rewrite_block(ckpt, 1)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(data)
    with pytest.raises(ValueError, match=rf"^fit: {re.escape(str(path))} is corrupt"):
        resume_alone(ckpt)
    path.unlink()
    with pytest.raises(ValueError, match=rf"names the block {re.escape(str(path))}, which is miss"):
        resume_alone(ckpt)


def test_four_ranks_resume_on_two(tmp_path: Path, single_fit):
    launch("partial", tmp_path, ranks=4)
    launch("resume", tmp_path, env={"VMAPENS_TEST_CKPTS": str(tmp_path / "ckpt.pt")})
    assert_same_fit(tmp_path / "ckpt.pt.fit.pt", single_fit)
    for r in range(2):
        assert json.loads((tmp_path / f"ckpt.pt.epochs.rank{r}.json").read_text()) == [3, 4]


def write_local(ens, history, path: Path) -> None:
    torch.save({"state": ens.state_dict(), "history": history.state_dict()}, path)


@pytest.mark.parametrize("n", [8, 7], ids=["n8-even", "n7-uneven"])
def test_sharded_steps_gather_to_single_process_run(steps_run: Path, n: int):
    expected = dist_worker.train_steps(n, shard=False).state_dict()
    assert_same_state(torch.load(steps_run / f"steps{n}.pt"), expected)


@pytest.mark.parametrize(
    ("n", "blocks"), [(8, [[0, 4], [4, 8]]), (7, [[0, 4], [4, 7]])], ids=["n8", "n7"]
)
def test_ranks_hold_contiguous_blocks(steps_run: Path, n: int, blocks: list):
    reports = [json.loads((steps_run / f"rank{r}.json").read_text()) for r in range(2)]
    assert [rep[str(n)] for rep in reports] == [[*b, n] for b in blocks]


def test_world_size_above_n_is_an_error(steps_run: Path):
    for r in range(2):
        message = json.loads((steps_run / f"rank{r}.json").read_text())["too_many_ranks"]
        assert message.startswith("Ensemble: `shard=True` with world size 2 > `n`=1")


# -- in one process: no process group -------------------------------------------------------

BLOCKS = [
    (8, 2, [range(0, 4), range(4, 8)]),
    (7, 2, [range(0, 4), range(4, 7)]),
    (10, 4, [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]),
    (3, 3, [range(0, 1), range(1, 2), range(2, 3)]),
    (5, 1, [range(0, 5)]),
]


@pytest.mark.parametrize(("n", "world", "blocks"), BLOCKS, ids=lambda v: str(v)[:12])
def test_member_blocks(n: int, world: int, blocks: list):
    assert distributed.member_blocks(n, world) == blocks
    sizes = [len(b) for b in blocks]
    assert max(sizes) - min(sizes) <= 1


BAD_BLOCKS = [
    (2, 3, ValueError, r"^member_blocks: world size 3 > `n`=2 would leave 1 rank\(s\)"),
    (0, 1, ValueError, r"^member_blocks: `n` must be >= 1, got 0"),
    (4, 0, ValueError, r"^member_blocks: `world_size` must be >= 1, got 0"),
    (4.0, 2, TypeError, r"^member_blocks: `n` must be an int, got float"),
]


@pytest.mark.parametrize(("n", "world", "error", "match"), BAD_BLOCKS, ids=lambda v: str(v)[:12])
def test_member_blocks_rejects(n, world, error, match):
    with pytest.raises(error, match=match):
        distributed.member_blocks(n, world)


SHARD_WITHOUT_GROUP = [
    ("ensemble", lambda: vmapens.Ensemble(nn.Linear, 4, seed=0, shard=True), "Ensemble"),
    (
        "from_modules",
        lambda: vmapens.Ensemble.from_modules([nn.Linear(2, 1)] * 2, shard=True),
        "Ensemble.from_modules",
    ),
    ("member_block", lambda: distributed.member_block(4), "member_block"),
]


@pytest.mark.parametrize(
    ("build", "api"), [c[1:] for c in SHARD_WITHOUT_GROUP], ids=[c[0] for c in SHARD_WITHOUT_GROUP]
)
def test_shard_without_process_group_is_a_clear_error(build, api):
    pattern = rf"^{api}: `shard=True` needs an initialised torch.distributed process group"
    with pytest.raises(RuntimeError, match=pattern) as info:
        build()
    assert "init_process_group" in str(info.value) and "torchrun" in str(info.value)


def test_single_process_helpers_are_identities(tmp_path: Path):
    ens = vmapens.Ensemble(lambda: nn.Linear(2, 1), 3, seed=0)
    assert vmapens.gather(ens) is ens
    assert (distributed.rank(), distributed.world_size()) == (0, 1)
    assert distributed.all_reduce_stats({"a": 1, "b": 2.5}) == {"a": 1.0, "b": 2.5}
    with pytest.raises(ValueError, match=r"^gather: `dst` must be a rank in \[0, 1\), got 1"):
        vmapens.gather(ens, dst=1)


def test_sharded_demo_outside_torchrun_says_how_to_launch(monkeypatch):
    from vmapens.__main__ import main

    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit, match=r"torchrun --standalone --nproc-per-node 2 -m vmapens"):
        main(["demo", "--sharded"])
