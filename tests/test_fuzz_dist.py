"""Seeded random sharded ``fit`` runs against the same configuration in one process.

Each seed draws a configuration (tests/dist_fuzz_worker.py, ``draw``): 3-7 members, mostly a
number the world sizes do not divide; an MLP (with a frozen bias or not); a loss; a stacked
optimizer (given as a class, built, or fit's default from keywords; ``fused=None`` or
``False``) with shared or per-member hyperparameters (lists or tensors, for all n members),
one member that overflows and stops; gradient clipping; a torch scheduler or
``vmapens.optim.ReduceLROnPlateau``, per epoch or per step; shared, out-of-bag or per-member
validation with a metric; early stopping on the loss or the metric, with or without
best-epoch restore; bagging, shuffling, ``steps``, per-member data; a checkpoint every k
epochs (a ``Checkpoint`` subclass). The run is interrupted at a drawn step on ``w_first``
processes and resumed to the end on ``w_resume`` (1, 2 or 3: 1 is this process, alone), then
gathered onto a drawn rank (``gather``, ``gather_history``), its optimizer rows dumped by
every rank, its members written by every rank with ``save_members``; at a world size above 1
an uninterrupted sharded run too.

The truth is the same configuration run uninterrupted in this process without
``torch.distributed``, which the other tests prove equal to members trained alone with
torch.optim. docs/distributed.md promises the sharded run equal to it bit for bit (no
BatchNorm here; its listed CPU exceptions to round-off, ``dist_fuzz_worker.exact``):
parameters and buffers, every History field but ``ensemble_metrics`` (each rank scores its
own block: documented), each member's optimizer state, the member files and their
manifest, and the sharded checkpoint read in one process (``vmapens.load``, and
``vmapens.restore`` with the optimizer) against the single-process run's.

The stages of many seeds share one launch per world size (starting processes costs seconds):
rounds on 1, 2, 3, 1, 2 processes, a launch only where some stage needs it. Run more seeds
by hand: ``python tests/test_fuzz_dist.py 0 40`` runs seeds 0..39 and prints the failures
(the runs' files are kept in a temporary directory it names); ``python
tests/test_fuzz_dist.py 17`` prints seed 17's configuration and runs it.
"""

from __future__ import annotations

import json
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import dist_fuzz_worker as worker
import pytest
import torch
from torchrun import torchrun
from truth import TOL64, assert_bit_identical

import vmapens
from vmapens.member_files import load_members

#: Seeds run in the suite, two launches (2 ranks, then 3): runs interrupted on 1, 2 or 3
#: processes and resumed on another number (all but 3 -> 2, which takes a third launch;
#: ``python tests/test_fuzz_dist.py 0 40`` has them), with blocks whose members all have
#: momentum 0, a plateau scheduler on a shared learning rate, clipping and a diverging member.
SUITE_SEEDS = [3, 7, 75, 97, 228]
#: The world sizes of the rounds, in order; stage A of a seed runs before its stage B.
ROUNDS = (1, 2, 3, 1, 2)


def execute(
    seeds: list[int], out: Path, launch=torchrun, refusal: bool = False
) -> list[tuple[int, int]]:
    """Run stages A and B of every seed under ``out/seed<k>``; the launches as (ranks, tasks).
    ``refusal``: also stages P (on the 2-rank launch) and Q (on the 3-rank one), in ``out/seed0``."""
    done = dict.fromkeys(seeds, 0)
    launches = []
    for w in ROUNDS:
        tasks = {2: ["P:0"], 3: ["Q:0"]}.get(w, []) if refusal else []
        refusal = refusal and w != 3
        for s in seeds:
            c = worker.draw(s)
            if done[s] < 2 and (c["w_first"], c["w_resume"])[done[s]] == w:
                tasks.append(f"{'AB'[done[s]]}:{s}")
                done[s] += 1
        if not tasks:
            continue
        if w == 1:
            for task in tasks:
                stage, s = task.split(":")
                where = out / f"seed{s}"
                where.mkdir(parents=True, exist_ok=True)
                worker.STAGES[stage](worker.draw(int(s)), where)
        else:
            launch(worker.__file__, [str(out), *tasks], f"{out.name}-{len(launches)}", ranks=w)
            launches.append((w, len(tasks)))
    assert all(v == 2 for v in done.values()), done
    return launches


def single(c: dict[str, Any], out: Path):
    """The truth: configuration ``c`` uninterrupted, in this process, unsharded."""
    ens, opt, history = worker.run(c, shard=False, checkpoint=out / "ckpt.pt")
    vmapens.save_members(ens, out / "members")
    return ens, opt, history


def assert_close_tree(got: Any, expected: Any, where: str) -> None:
    """As ``assert_bit_identical``, float tensors to TOL64 (NaN equal to NaN)."""
    assert type(got) is type(expected), f"{where}: {type(got)} vs {type(expected)}"
    if isinstance(expected, torch.Tensor):
        torch.testing.assert_close(got, expected, **TOL64, equal_nan=True, msg=where)
    elif isinstance(expected, dict):
        assert list(got) == list(expected), where
        for k in expected:
            assert_close_tree(got[k], expected[k], f"{where}.{k}")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), where
        for k, (a, b) in enumerate(zip(got, expected, strict=True)):
            assert_close_tree(a, b, f"{where}[{k}]")
    else:
        assert got == expected, where


def check_seed(seed: int, out: Path, ref_dir: Path) -> None:
    """Every result of ``seed``'s stages against the one-process run: bit for bit where
    docs/distributed.md promises it (``worker.exact``), else to TOL64."""
    c = worker.draw(seed)
    assert_same = assert_bit_identical if worker.exact(c) else assert_close_tree
    where = out / f"seed{seed}"
    errors = sorted(where.glob("error.rank*.txt"))
    assert not errors, errors[0].read_text()
    ens, opt, history = single(c, ref_dir)
    want_history = history.state_dict()
    want_history.pop("ensemble_metrics")  # each rank's block's (docs/distributed.md)
    ranks = c["w_resume"]
    runs = ["resumed"] + (["fresh"] if ranks > 1 else [])
    for name in runs:
        state, outputs = torch.load(where / f"{name}.state.pt", weights_only=False)
        assert_same(state, ens.state_dict(), f"seed {seed} {name} state")
        if outputs is not None:
            want = vmapens.predict(ens, worker.data(c, 1)[0])
            assert_same(outputs, want, f"seed {seed} {name} gathered outputs")
        got_history = torch.load(where / f"{name}.history.pt", weights_only=False)
        got_history.pop("ensemble_metrics")
        assert_same(got_history, want_history, f"seed {seed} {name} history")
        rows: dict[int, dict] = {}
        for r in range(ranks):
            rows.update(torch.load(where / f"{name}.opt.rank{r}.pt", weights_only=False))
        assert_same(rows, worker.member_rows(ens, opt), f"seed {seed} {name} optimizer")
    # Each rank's member files, and rank 0's manifest of them all: as one process writes them.
    names = sorted(p.name for p in (ref_dir / "members").iterdir())
    assert sorted(p.name for p in (where / "members").iterdir()) == names, seed
    for file in (f for f in names if f.endswith(".pt")):
        got_file, want_file = (torch.load(d / "members" / file) for d in (where, ref_dir))
        assert_same(got_file, want_file, f"seed {seed} {file}")
    manifests = [json.loads((d / "members" / "members.json").read_text()) for d in (where, ref_dir)]
    for m in manifests:
        del m["save_id"], m["vmapens-sha256"]  # this save's own id, and the digest over it
        for entry in m["members"]:
            entry["sha256"] = entry["sha256"] if worker.exact(c) else None  # the files' bytes
    assert manifests[0] == manifests[1], seed
    got_members = load_members(where / "members")
    assert_same(got_members, load_members(ref_dir / "members"), f"seed {seed} members")
    # The sharded run's last checkpoint (or a single file, resumed alone) read in one process.
    factory = worker.MODELS[c["model"]]
    got = vmapens.load(where / "ckpt.pt", factory)
    want = vmapens.load(ref_dir / "ckpt.pt", factory)
    assert list(got.member_ids) == list(range(c["n"])), seed
    assert_same(got.state_dict(), want.state_dict(), f"seed {seed} load")
    # ... and restored into an ensemble of every member and its optimizer, in one process.
    restored = []
    for path in (where / "ckpt.pt", ref_dir / "ckpt.pt"):
        ens = vmapens.Ensemble(factory, c["n"], seed=c["seed"])
        opt = worker.optimizer_for(c, ens)
        vmapens.restore(path, ens, opt)
        restored.append((ens.state_dict(), worker.member_rows(ens, opt)))
    assert_same(restored[0], restored[1], f"seed {seed} restore")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One thread here too, as in the workers (torchrun.py): the same kernels in both."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def suite_run(tmp_path_factory) -> tuple[Path, list[tuple[int, int]]]:
    out = tmp_path_factory.mktemp("fuzzdist")
    return out, execute(SUITE_SEEDS, out, refusal=True)


def test_suite_seeds_cover_every_pair_of_world_sizes(suite_run):
    pairs = {(worker.draw(s)["w_first"], worker.draw(s)["w_resume"]) for s in SUITE_SEEDS}
    assert pairs == {(a, b) for a in (1, 2, 3) for b in (1, 2, 3) if a != b} - {(3, 2)}
    assert [w for w, _ in suite_run[1]] == [2, 3]  # two launches in all


def test_a_resume_refused_on_some_ranks_is_refused_on_every_rank(suite_run):
    # 4 members checkpointed on 2 ranks, resumed on 3 without override=("data",): ranks 1 and
    # 2 pass other per-member rows than the checkpoint's and refuse; rank 0's block is the
    # same as before, and it once went on into fit's first collective and waited there until
    # the group's timeout. Now every rank raises at once (distributed.raise_together).
    errors = sorted((suite_run[0] / "seed0").glob("error.rank*.txt"))
    assert not errors, errors[0].read_text()
    where = suite_run[0] / "seed0" / "refused"
    said = {r: (where / f"raised.rank{r}.txt").read_text() for r in range(3)}
    for r in (1, 2):
        assert said[r].startswith("ValueError: fit: cannot resume"), said[r]
    assert said[0].startswith("RuntimeError: fit: rank 1 failed, so every rank stops"), said[0]


@pytest.mark.parametrize("seed", SUITE_SEEDS)
def test_sharded_run_equals_one_process(suite_run, seed: int, tmp_path: Path):
    check_seed(seed, suite_run[0], tmp_path)


# -- found by the search, outside the files it covers ----------------------------------------


def test_clip_grad_norm_as_alone():
    """Each member's clipped gradients and norm as torch.nn.utils.clip_grad_norm_ gives them
    for that member alone, bit for bit: a sharded block of another size clips alike. The
    per-tensor norms were once summed down a strided [tensors, n] column, in an order that
    depended on n (1 ulp off the member alone in about 1 of 3 cases)."""
    g = torch.Generator().manual_seed(0)
    shapes = [(5, 3), (5,), (2, 5)]
    for n in (2, 3, 4, 5, 6) * 4:
        grads = [torch.randn(n, *s, generator=g, dtype=torch.float64) for s in shapes]
        stacked = [torch.zeros(n, *s, dtype=torch.float64, requires_grad=True) for s in shapes]
        for p, grad in zip(stacked, grads, strict=True):
            p.grad = grad.clone()
        norms = vmapens.optim.clip_grad_norm_(stacked, max_norm=0.3)
        for i in range(n):
            alone = [torch.zeros(s, dtype=torch.float64, requires_grad=True) for s in shapes]
            for p, grad in zip(alone, grads, strict=True):
                p.grad = grad[i].clone()
            norm = torch.nn.utils.clip_grad_norm_(alone, max_norm=0.3)
            assert torch.equal(norms[i], norm), (n, i)
            for p, q in zip(stacked, alone, strict=True):
                assert torch.equal(p.grad[i], q.grad), (n, i)


if __name__ == "__main__":
    torch.set_num_threads(1)
    if len(sys.argv) == 2:
        seeds = [int(sys.argv[1])]
        print(worker.draw(seeds[0]))
    else:
        seeds = list(range(int(sys.argv[1]), int(sys.argv[2])))

    def launch(*args: Any, **kwargs: Any) -> None:
        """torchrun, and on a failed launch its log; the seeds it ran report their errors."""
        try:
            torchrun(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001 - pytest.fail's outcome is a BaseException
            print("a launch failed:", str(err)[-3000:])

    failed = []
    tmp = Path(tempfile.mkdtemp(prefix="fuzzdist-"))  # kept: the runs' files, for a look
    print("launches (ranks, stages):", execute(seeds, tmp / "runs", launch), "files in", tmp)
    for s in seeds:
        ref = tmp / f"ref{s}"
        ref.mkdir()
        try:
            check_seed(s, tmp / "runs", ref)
        except Exception as err:  # noqa: BLE001 - a search: report and go on
            failed.append(s)
            print(s, worker.draw(s))
            print("   ", type(err).__name__, str(err).splitlines()[0][:300] if str(err) else "")
            if "-v" in sys.argv or len(seeds) == 1:
                traceback.print_exc()
    print("failed:", failed)
