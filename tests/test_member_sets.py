"""save_members writes a SET: ``members.json``, written last, names the files of one save.

Truth is plain torch: modules built and kept as ordinary ``nn.Module``s, their own
``state_dict()``, and ``torch.load`` / ``safetensors.torch.load_file`` of each file. A directory
left with files of two saves (a larger earlier ensemble, a save that stopped halfway, a file
copied in) must load as exactly one save's members or be refused naming the file, and bad
input must leave the directory as it was.
"""

from __future__ import annotations

import errno
import hashlib
import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from truth import assert_states

import vmapens
from vmapens import distributed, member_files
from vmapens._member_manifest import _canonical
from vmapens.distributed import member_blocks
from vmapens.member_files import load_members

EXACT = {"rtol": 0, "atol": 0}


class Awkward(nn.Module):
    """Tied weights, BatchNorm buffers, a bool buffer, a channels_last conv, a transposed
    (non-contiguous) parameter: what a member file must carry bit for bit."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 1).to(memory_format=torch.channels_last)
        self.bn = nn.BatchNorm2d(3)
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)
        self.b.weight = self.a.weight
        self.t = nn.Parameter(torch.randn(2, 3).t())
        self.register_buffer("keep", torch.tensor([True, False, True]))
        with torch.no_grad():  # buffers that are not their defaults
            self.bn.running_mean.normal_()
            self.bn.num_batches_tracked.fill_(int(torch.randint(1, 9, ())))


def modules(n: int, seed: int, dtype: torch.dtype = torch.float64, cls: type = Awkward) -> list:
    torch.manual_seed(seed)
    return [cls().to(dtype) for _ in range(n)]


def linears(n: int, seed: int) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Linear(3, 2).double() for _ in range(n)]


def snapshot(directory: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(directory)): p.read_bytes() if p.is_file() else None
        for p in sorted(directory.rglob("*"))
    }


# -- the set -----------------------------------------------------------------------------------


def test_a_smaller_ensemble_replaces_the_larger_set_in_the_directory(tmp_path):
    """The reported case: 8 members saved over 16 leave 8 files, and the set is those 8."""
    big, small = linears(16, seed=0), linears(8, seed=1)
    vmapens.save_members(vmapens.Ensemble.from_modules(big), tmp_path)
    paths = vmapens.save_members(vmapens.Ensemble.from_modules(small), tmp_path)
    globbed = sorted(tmp_path.glob("member_*.pt"))
    assert globbed == paths  # a user who globs gets this save's members only
    assert_states([torch.load(p, weights_only=True) for p in globbed], small)
    assert_states(load_members(tmp_path), small)


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_members_load_bit_for_bit_through_every_reader(fmt, dtype, tmp_path):
    plain = modules(3, seed=0, dtype=dtype)
    paths = vmapens.save_members(vmapens.Ensemble.from_modules(plain), tmp_path, format=fmt)
    read = (lambda p: torch.load(p, weights_only=True)) if fmt == "pt" else load_file
    for got in (load_members(tmp_path), [vmapens.load_member(p) for p in paths], map(read, paths)):
        got = list(got)
        assert_states(got, plain)
        for state in got:  # and into the user's class, tied weights tied
            model = Awkward().to(dtype)
            model.load_state_dict(state)
            assert model.b.weight is model.a.weight


def test_a_sub_ensemble_keeps_its_global_ids_and_order(tmp_path):
    plain = linears(6, seed=0)
    sub = vmapens.Ensemble.from_modules(plain).select([4, 1, 5])
    paths = vmapens.save_members(sub, tmp_path, format="safetensors")
    assert [p.name for p in paths] == [f"member_{i:04d}.safetensors" for i in (4, 1, 5)]
    assert_states(load_members(tmp_path), [plain[4], plain[1], plain[5]])
    listed = json.loads((tmp_path / member_files.MANIFEST).read_text())
    assert [e["id"] for e in listed["members"]] == [4, 1, 5] and listed["n_total"] == 6


def test_switching_format_replaces_the_set(tmp_path):
    first, second = linears(3, seed=0), linears(3, seed=1)
    vmapens.save_members(vmapens.Ensemble.from_modules(first), tmp_path)
    vmapens.save_members(vmapens.Ensemble.from_modules(second), tmp_path, format="safetensors")
    assert sorted(tmp_path.glob("member_*.pt")) == []
    assert_states(load_members(tmp_path), second)


def test_paths_with_odd_characters(tmp_path):
    where = tmp_path / "runs [1]*?" / "ü %s {x}; $HOME"
    plain = linears(2, seed=0)
    vmapens.save_members(vmapens.Ensemble.from_modules(plain), where)
    assert_states(load_members(where), plain)
    assert_states(load_members(str(where)), plain)


# -- files of two saves ------------------------------------------------------------------------


def test_a_save_that_stops_halfway_is_refused_not_mixed(tmp_path, monkeypatch):
    old, new = linears(4, seed=0), linears(4, seed=1)
    vmapens.save_members(vmapens.Ensemble.from_modules(old), tmp_path)
    calls = []
    real = member_files.atomic_write

    def dies_at_the_third_file(path, write_to, api):
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt  # the process stops here
        return real(path, write_to, api)

    monkeypatch.setattr(member_files, "atomic_write", dies_at_the_third_file)
    with pytest.raises(KeyboardInterrupt):
        vmapens.save_members(vmapens.Ensemble.from_modules(new), tmp_path)
    monkeypatch.undo()
    # Every file verifies alone (two new, two old): only the set knows they do not belong.
    assert_states([vmapens.load_member(tmp_path / f"member_{i:04d}.pt") for i in (0, 1)], new[:2])
    assert_states([vmapens.load_member(tmp_path / f"member_{i:04d}.pt") for i in (2, 3)], old[2:])
    with pytest.raises(ValueError, match=r"^load_members: .*member_0000\.pt is not the file"):
        load_members(tmp_path)
    vmapens.save_members(vmapens.Ensemble.from_modules(new), tmp_path)  # saving again heals it
    assert_states(load_members(tmp_path), new)


def test_a_file_of_another_save_or_a_missing_file_is_refused(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    vmapens.save_members(vmapens.Ensemble.from_modules(linears(3, seed=0)), a)
    vmapens.save_members(vmapens.Ensemble.from_modules(linears(3, seed=1)), b)
    shutil.copy(b / "member_0001.pt", a / "member_0001.pt")  # the same member of another run
    with pytest.raises(ValueError, match=r"^load_members: .*a/member_0001\.pt is not the file"):
        load_members(a)
    (b / "member_0002.pt").unlink()
    with pytest.raises(FileNotFoundError, match=r"^load_members: .*b/member_0002\.pt is missing"):
        load_members(b)


def test_files_the_manifest_does_not_list_are_ignored(tmp_path):
    plain = linears(2, seed=0)
    vmapens.save_members(vmapens.Ensemble.from_modules(plain), tmp_path)
    shutil.copy(tmp_path / "member_0001.pt", tmp_path / "member_0007.pt")
    assert_states(load_members(tmp_path), plain)


def test_files_without_a_manifest_are_not_removed_but_named(tmp_path):
    """A directory of vmapens 0.3 (no manifest): its files are not ours to remove; a warning
    names them, and each still loads through load_member."""
    legacy = linears(5, seed=0)
    vmapens.save_members(vmapens.Ensemble.from_modules(legacy), tmp_path)
    (tmp_path / member_files.MANIFEST).unlink()
    with pytest.raises(FileNotFoundError, match=r"^load_members: .* holds no members\.json"):
        load_members(tmp_path)
    new = linears(2, seed=1)
    with pytest.warns(UserWarning, match=r"member_0002\.pt, member_0003\.pt, member_0004\.pt"):
        vmapens.save_members(vmapens.Ensemble.from_modules(new), tmp_path)
    assert_states(
        [vmapens.load_member(tmp_path / f"member_{i:04d}.pt") for i in (2, 3, 4)], legacy[2:]
    )
    assert_states(load_members(tmp_path), new)


def test_a_listed_file_changed_since_is_not_removed(tmp_path):
    vmapens.save_members(vmapens.Ensemble.from_modules(linears(4, seed=0)), tmp_path)
    theirs = {"weight": torch.zeros(2, 3, dtype=torch.float64)}
    torch.save(theirs, tmp_path / "member_0003.pt")  # someone's own file under that name
    with pytest.warns(UserWarning, match=r"\(member_0003\.pt; 1 files\)"):
        vmapens.save_members(vmapens.Ensemble.from_modules(linears(2, seed=1)), tmp_path)
    assert not (tmp_path / "member_0002.pt").exists()  # ours, unchanged: the set moved on
    torch.testing.assert_close(torch.load(tmp_path / "member_0003.pt"), theirs, **EXACT)


# -- the manifest itself -----------------------------------------------------------------------


def test_a_damaged_or_newer_manifest_is_refused(tmp_path):
    vmapens.save_members(vmapens.Ensemble.from_modules(linears(2, seed=0)), tmp_path)
    path = tmp_path / member_files.MANIFEST
    text = path.read_text()
    path.write_text(text.replace('"id": 1', '"id": 0'))
    with pytest.raises(ValueError, match=r"^load_members: .*members\.json is corrupt"):
        load_members(tmp_path)
    path.write_text(text.replace('"version": 1', '"version": 7'))
    with pytest.raises(ValueError, match=r"written by a newer vmapens"):
        load_members(tmp_path)
    path.write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match=r"members\.json is not a manifest of member files: not"):
        load_members(tmp_path)


def test_a_manifest_cannot_name_files_outside_its_directory(tmp_path):
    vmapens.save_members(vmapens.Ensemble.from_modules(linears(1, seed=0)), tmp_path / "d")
    path = tmp_path / "d" / member_files.MANIFEST
    held = json.loads(path.read_text())
    held.pop("vmapens-sha256")
    held["members"][0]["file"] = "../member_0000.pt"
    held["vmapens-sha256"] = hashlib.sha256(_canonical(held)).hexdigest()  # a valid digest
    path.write_text(json.dumps(held))
    with pytest.raises(ValueError, match=r"a bad member entry .*\.\./member_0000\.pt"):
        load_members(tmp_path / "d")


# -- bad input changes nothing ------------------------------------------------------------------


def test_bad_input_changes_nothing_on_disk(tmp_path):
    plain = linears(3, seed=0)
    vmapens.save_members(vmapens.Ensemble.from_modules(plain), tmp_path / "d")
    (tmp_path / "file").write_bytes(b"x")
    before = snapshot(tmp_path)
    twice = vmapens.Ensemble.from_modules(linears(3, seed=1))[[1, 1]]
    cases = [
        (lambda: vmapens.save_members(twice, tmp_path / "d"), ValueError, r"member\(s\) \[1\] more than once"),
        (lambda: vmapens.save_members(twice, tmp_path / "d", format="npz"), ValueError, r"`format`"),
        (lambda: vmapens.save_members(plain[0], tmp_path / "d"), TypeError, r"`ens`"),
        (lambda: vmapens.save_members(twice[0:1], tmp_path / "file"), NotADirectoryError, r"save_members: `directory` .*file is a file, not a directory"),
        (lambda: load_members(tmp_path / "file"), ValueError, r"^load_members: `directory` .*file is a file"),
        (lambda: load_members(tmp_path / "none"), FileNotFoundError, r"^load_members: no directory"),
        (lambda: load_members(3), TypeError, r"^load_members: `directory` must be a str or os\.PathLike"),
    ]  # fmt: skip
    for call, kind, message in cases:
        with pytest.raises(kind, match=message):
            call()
        assert snapshot(tmp_path) == before
    assert_states(load_members(tmp_path / "d"), plain)


def test_a_read_only_directory_changes_nothing(tmp_path, monkeypatch):
    """The first file cannot be written (EROFS, as the OS says it): no file and no manifest
    changes. Simulated, since root writes into a chmod-ed directory anyway."""
    plain = linears(2, seed=0)
    vmapens.save_members(vmapens.Ensemble.from_modules(plain), tmp_path)
    before = snapshot(tmp_path)

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr("tempfile.mkstemp", read_only)
    with pytest.raises(
        OSError, match=r"save_members: could not write .*Read-only file system; any previous"
    ):
        vmapens.save_members(vmapens.Ensemble.from_modules(linears(2, seed=1)), tmp_path)
    assert snapshot(tmp_path) == before


# -- a sharded ensemble: every rank's files, one manifest ---------------------------------------


class TwoRanks:
    """The collectives ``save_members`` uses, for two threads of this process standing in for
    two ranks (spawning real ranks costs seconds; tests/test_distributed.py spawns them)."""

    def __init__(self) -> None:
        self.meeting, self.box, self.me = (
            threading.Barrier(2, timeout=60),
            [None, None],
            threading.local(),
        )

    def rank(self) -> int:
        return self.me.rank

    def all_gather_object(self, out: list, obj: object) -> None:
        self.box[self.rank()] = obj
        self.meeting.wait()
        out[:] = list(self.box)
        self.meeting.wait()

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        if self.rank() == src:
            self.box[src] = obj
        self.meeting.wait()
        got = self.box[src]
        self.meeting.wait()
        return got

    def run(self, blocks: list, directory: Path) -> list[str | None]:
        said: list[str | None] = [None, None]

        def rank(r: int) -> None:
            self.me.rank = r
            try:
                vmapens.save_members(blocks[r], directory)
            except Exception as err:  # noqa: BLE001 - the message is the result
                said[r] = f"{type(err).__name__}: {err}"

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        return said


def test_a_sharded_save_writes_one_manifest_of_all_ranks(tmp_path, monkeypatch):
    ranks = TwoRanks()
    for module in (member_files, distributed):
        monkeypatch.setattr(module, "world_size", lambda: 2)
        monkeypatch.setattr(module, "rank", ranks.rank)
    monkeypatch.setattr(distributed.dist, "all_gather_object", ranks.all_gather_object)
    plain = linears(5, seed=0)
    full = vmapens.Ensemble.from_modules(plain)
    blocks = [full.select(list(b)) for b in member_blocks(5, 2)]  # each rank's block
    assert ranks.run(blocks, tmp_path / "set") == [None, None]
    assert_states(load_members(tmp_path / "set"), plain)
    # Rank 1 cannot write member 4: every rank raises, and no manifest makes the save a set.
    (tmp_path / "broken" / "member_0004.pt").mkdir(parents=True)
    said = ranks.run(blocks, tmp_path / "broken")
    assert said[0].startswith("RuntimeError: save_members: rank 1 could not write its member")
    assert said[1].startswith("IsADirectoryError: [Errno 21] save_members: could not write")
    assert not (tmp_path / "broken" / member_files.MANIFEST).exists()
