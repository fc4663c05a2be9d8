"""Every file vmapens writes carries its digest; reads check it; writes are one atomic rename.

A flipped bit anywhere (zip headers, pickle, tensor data, safetensors header, the digest) and
a file cut at any offset are a ValueError naming the file, never changed values. Several
processes saving one path never fail and never leave a torn file. The rename itself is
tested: the file at the path after a save is the very file that was written and synced.
"""

from __future__ import annotations

import errno
import json
import os
import re
import zipfile
from collections.abc import Callable
from pathlib import Path

import models
import pytest
import torch
from test_faults import in_child
from torch import nn

import vmapens
from vmapens import _files, checkpoint

EXACT = dict(rtol=0, atol=0)
SAVES_PER_PROCESS = 200  # two writers: 400 saves of a tiny file, a few seconds
PER_REGION = 64  # bytes flipped at the start of each region (headers are shorter)
SPREAD = 256  # plus one flip every size/SPREAD bytes over the whole file


def tiny() -> vmapens.Ensemble:
    return vmapens.Ensemble(lambda: nn.Linear(2, 1), n=2, seed=0)


def fit_checkpoint(path: Path) -> None:
    """A real fit checkpoint (weights, Adam moments, step counts, History), kept small."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 2, generator=g), torch.randn(8, 1, generator=g)
    vmapens.fit(tiny(), (x, y), nn.MSELoss(), epochs=2, batch_size=4, seed=0, progress=False,
                val_data=(x, y), patience=3, checkpoint=path)  # fmt: skip


def zip_regions(data: bytes) -> dict[str, range]:
    """Byte ranges of the parts of a torch.save zip: headers, pickle, tensor data, digest."""
    import io

    regions: dict[str, range] = {}
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        for info in z.infolist():
            start = info.header_offset
            name_len, extra_len = (int.from_bytes(data[start + k : start + k + 2], "little")
                                   for k in (26, 28))  # fmt: skip
            body = start + 30 + name_len + extra_len
            regions.setdefault("zip local header", range(start, start + 30))
            kind = "pickle" if info.filename.endswith(".pkl") else "entry data"
            if re.search(r"/data/\d+$", info.filename):
                kind = "tensor data"
            regions.setdefault(kind, range(body, body + info.compress_size))
    eocd = data.rfind(b"PK\x05\x06")
    regions["central directory"] = range(eocd - 40, eocd)
    regions["end of zip record"] = range(eocd, eocd + 22)
    regions["digest"] = range(len(data) - 64, len(data))
    return regions


def positions(size: int, regions: dict[str, range]) -> list[int]:
    """Every byte of each region's first ``PER_REGION`` bytes and its last byte, and a stride
    over the whole file: every class of byte, in a bounded number of reads."""
    chosen = set(range(0, size, max(1, size // SPREAD)))
    for where in regions.values():
        chosen |= {*where[:PER_REGION], where[-1]}
    return sorted(i for i in chosen if 0 <= i < size)


def every_flip_and_cut(path: Path, reader: Callable[[Path], object], regions: dict) -> None:
    """Flip the lowest bit of bytes of every region, cut the file at as many offsets: each
    read must fail with a ValueError naming the file."""
    good = path.read_bytes()
    reader(path)  # the intact file reads
    chosen = positions(len(good), regions)
    for i in chosen:
        bad = bytearray(good)
        bad[i] ^= 0x01
        path.write_bytes(bad)
        with pytest.raises(ValueError, match=re.escape(str(path))):
            reader(path)
    for cut in chosen:
        path.write_bytes(good[:cut])
        with pytest.raises(ValueError, match=re.escape(str(path))):
            reader(path)
    path.write_bytes(good)
    for name, where in regions.items():
        assert len(where) > 0 and where[0] in chosen and where[-1] in chosen, name


def test_every_byte_of_a_fit_checkpoint_is_checked(tmp_path: Path):
    path = tmp_path / "ckpt.pt"
    fit_checkpoint(path)
    payload = checkpoint.read(path, "test")
    assert payload["optimizer"]["state"] and payload["history"]["val_loss"].shape[0] == 2
    regions = zip_regions(path.read_bytes())
    assert {"pickle", "tensor data", "zip local header"} <= set(regions)
    every_flip_and_cut(path, lambda p: checkpoint.read(p, "test"), regions)
    # ... and through the public verbs: restore and resuming fit say the same.
    data = bytearray(path.read_bytes())
    data[regions["tensor data"][0]] ^= 0x01
    path.write_bytes(data)
    with pytest.raises(ValueError, match=r"restore: .*ckpt\.pt is corrupt: its bytes do not"):
        vmapens.restore(path, tiny())
    with pytest.raises(ValueError, match=r"fit: .*ckpt\.pt is corrupt"):
        fit_checkpoint(path)


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_every_byte_of_a_member_file_is_checked(tmp_path: Path, fmt: str):
    ens = vmapens.Ensemble(models.Tied, n=2, seed=0)
    path = vmapens.save_members(ens, tmp_path, format=fmt)[1]
    expected = ens.state_dicts()[1]
    # Still the plain file the user's tools read ...
    if fmt == "pt":
        plain = torch.load(path, weights_only=True)
        regions = zip_regions(path.read_bytes())
    else:
        from safetensors.torch import load_file

        plain = load_file(path)
        data = path.read_bytes()
        end = 8 + int.from_bytes(data[:8], "little")
        header = json.loads(data[8:end])
        assert set(header["__metadata__"]) == {"vmapens-sha256", "vmapens:member_id"}
        regions = {"header length": range(0, 8), "header": range(8, end),
                   "tensor data": range(end, len(data))}  # fmt: skip
    torch.testing.assert_close(plain, expected, **EXACT)
    # ... and the checked reader gives the same values, or refuses.
    torch.testing.assert_close(vmapens.load_member(path), expected, **EXACT)
    every_flip_and_cut(path, vmapens.load_member, regions)


def test_a_block_of_a_sharded_checkpoint_is_checked(tmp_path: Path):
    """Blocks are written by the same writer: one tensor-data flip, read as resume reads it."""
    path = tmp_path / "members-000000-000002.epoch000001.pt"
    rows = [(("ensemble", "weight"), "tensor", 0, torch.arange(4.0).reshape(2, 2))]
    checkpoint.write(path, {"member_ids": [0, 1], "rows": rows, "run": "r", "epoch": 1}, "fit")
    regions = zip_regions(path.read_bytes())
    every_flip_and_cut(path, lambda p: checkpoint.read(p, "fit"), regions)


def test_old_unsealed_member_file_is_refused_by_the_checked_reader(tmp_path: Path):
    torch.save(nn.Linear(2, 1).state_dict(), tmp_path / "member_0000.pt")
    with pytest.raises(ValueError, match=r"load_member: .*member_0000\.pt carries no vmapens"):
        vmapens.load_member(tmp_path / "member_0000.pt")
    with pytest.raises(FileNotFoundError, match=r"^load_member: no file at .*nope\.pt"):
        vmapens.load_member(tmp_path / "nope.pt")
    with pytest.raises(ValueError, match=r"^load_member: cannot read .*: Is a directory"):
        vmapens.load_member(tmp_path)


# -- concurrent saves ------------------------------------------------------------------------


def test_two_processes_saving_one_path_never_fail_or_tear(tmp_path: Path):
    path = tmp_path / "ens.pt"
    members = [vmapens.Ensemble(lambda: nn.Linear(2, 1), n=2, seed=s) for s in (1, 2)]
    vmapens.save(members[0], path)

    def saver(ens: vmapens.Ensemble) -> Callable[[], int]:
        def body() -> int:
            for _ in range(SAVES_PER_PROCESS):
                vmapens.save(ens, path)  # any exception: exit status 1
            return 0

        return body

    pids = [in_child(saver(ens)) for ens in members]
    reads = 0
    while reads < 50 or any(alive(pid) for pid in pids):  # read while they write
        got = vmapens.load(path, lambda: nn.Linear(2, 1)).state_dict()
        assert any(equal(got, ens.state_dict()) for ens in members), "a torn or foreign file"
        reads += 1
    statuses = [
        os.waitstatus_to_exitcode(_reaped[pid] if pid in _reaped else os.waitpid(pid, 0)[1])
        for pid in pids
    ]
    assert statuses == [0, 0], "a save failed"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ens.pt"]  # no temporary file left


_reaped: dict[int, int] = {}


def alive(pid: int) -> bool:
    if pid in _reaped:
        return False
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        _reaped[pid] = status
    return not done


def equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_cleanup_removes_only_temp_files_whose_writer_is_gone(tmp_path: Path):
    path = tmp_path / "ens.pt"
    dead = in_child(lambda: 0)
    os.waitpid(dead, 0)  # reaped: no process has this pid now (until it is reused)
    stale = tmp_path / f".ens.pt.{dead}.abc123.tmp"
    live = tmp_path / f".ens.pt.{os.getppid()}.def456.tmp"  # pytest's parent: alive, unlocked
    stale.write_bytes(b"half")
    live.write_bytes(b"being written")
    vmapens.save(tiny(), path)
    assert not stale.exists() and live.exists()


# -- the rename ------------------------------------------------------------------------------


def test_the_new_file_arrives_by_one_atomic_rename(tmp_path: Path, monkeypatch):
    """The file at ``path`` after a save is the file that was written and fsynced (same
    inode), and a reader that opened the old file before the save still reads it whole: the
    old inode was never written to. A copy into ``path`` (or unlink then copy) fails both."""
    path = tmp_path / "ens.pt"
    vmapens.save(tiny(), path)
    old = path.read_bytes()
    synced: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.fstat(fd).st_ino)
        real_fsync(fd)

    monkeypatch.setattr(_files.os, "fsync", fsync)
    with open(path, "rb") as reader:
        vmapens.save(vmapens.Ensemble(lambda: nn.Linear(2, 1), n=2, seed=7), path)
        assert reader.read() == old
    assert os.stat(path).st_ino in synced
    assert path.read_bytes() != old


@pytest.mark.parametrize("fault", [OSError(errno.EXDEV, "injected"), KeyboardInterrupt()],
                         ids=["oserror", "interrupt"])  # fmt: skip
def test_a_fault_at_the_rename_leaves_the_old_file(tmp_path: Path, monkeypatch, fault):
    path = tmp_path / "ens.pt"
    vmapens.save(tiny(), path)
    old = path.read_bytes()
    calls = []

    def replace(src: str, dst: str) -> None:
        calls.append((Path(src).parent, Path(dst)))
        raise fault

    monkeypatch.setattr(_files.os, "replace", replace)
    error = OSError if isinstance(fault, OSError) else KeyboardInterrupt
    said = "previous file at that path is intact" if error is OSError else None
    with pytest.raises(error, match=said):
        vmapens.save(vmapens.Ensemble(lambda: nn.Linear(2, 1), n=2, seed=7), path)
    assert calls == [(tmp_path, path)]  # the fault struck at the rename itself
    assert path.read_bytes() == old and os.listdir(tmp_path) == ["ens.pt"]


def test_a_process_dying_at_the_rename_leaves_the_old_file(tmp_path: Path):
    path = tmp_path / "ens.pt"
    vmapens.save(tiny(), path)
    old = path.read_bytes()

    def die_at_rename() -> int:
        _files.os.replace = lambda src, dst: os._exit(9)  # the child's own module: no undo
        vmapens.save(vmapens.Ensemble(lambda: nn.Linear(2, 1), n=2, seed=7), path)
        return 1

    _, status = os.waitpid(in_child(die_at_rename), 0)
    assert os.waitstatus_to_exitcode(status) == 9
    assert path.read_bytes() == old
    vmapens.save(tiny(), path)  # the dead writer's temporary file goes with the next save
    assert os.listdir(tmp_path) == ["ens.pt"]


# -- write errors say what went wrong --------------------------------------------------------


@pytest.mark.parametrize(("code", "words"), [(errno.ENOSPC, "the disk is full"),
                         (errno.EFBIG, "the file would exceed the file-size limit")])  # fmt: skip
def test_disk_full_and_file_too_large_say_so(tmp_path: Path, monkeypatch, code: int, words: str):
    path = tmp_path / "ens.pt"
    vmapens.save(tiny(), path)
    old = path.read_bytes()

    def full(fd: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(_files.os, "fsync", full)
    with pytest.raises(OSError, match=rf"save: could not write .*ens\.pt: {words}") as info:
        vmapens.save(tiny(), path)
    assert info.value.errno == code and "previous file at that path is intact" in str(info.value)
    assert path.read_bytes() == old and os.listdir(tmp_path) == ["ens.pt"]


# -- member ids ------------------------------------------------------------------------------

BAD_IDS = [
    ({"member_ids": ["0", "1"], "n_total": 2}, r"`member_ids` must be a list of ints"),
    ({"member_ids": [-1, 0], "n_total": 2}, r"member ids must be in \[0, 2\), got \[-1\]"),
    ({"member_ids": [0, 10**12], "n_total": 2}, r"member ids must be in \[0, 2\), got \[10+\]"),
    ({"member_ids": [0, 0], "n_total": 2}, r"`member_ids` repeat ids"),
    ({"member_ids": [0, 1], "n_total": "2"}, r"`n_total` must be an int >= 1, got '2'"),
    ({"member_ids": [True, 1], "n_total": 2}, r"`member_ids` must be a list of ints"),
]


@pytest.mark.parametrize(("members", "match"), BAD_IDS, ids=[m for _, m in BAD_IDS])
def test_load_checks_member_ids(tmp_path: Path, members: dict, match: str):
    ens = tiny()
    path = tmp_path / "ck.pt"
    parts = {"members": {**checkpoint.members_of(ens), **members},
             "ensemble": ens.state_dict(), "optimizer": None, "history": None}  # fmt: skip
    checkpoint.write(path, parts)  # a file with a valid digest, written by a buggy or hostile tool
    with pytest.raises(ValueError, match=rf"^load: .*ck\.pt: {match}"):
        vmapens.load(path, lambda: nn.Linear(2, 1))


# -- two runs, one path ----------------------------------------------------------------------


class RunOther(vmapens.Callback):
    """At the end of epoch ``at`` (before this run's checkpoint), run ``other``."""

    def __init__(self, at: int, other: Callable[[], object]) -> None:
        self.at, self.other = at, other

    def on_epoch_end(self, ctx: vmapens.callbacks.Context) -> None:
        if ctx.epoch + 1 == self.at:
            self.other()


def run(path: Path, epochs: int, callbacks=(), seed: int = 0):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 2, generator=g), torch.randn(8, 1, generator=g)
    return vmapens.fit(tiny(), (x, y), nn.MSELoss(), epochs=epochs, batch_size=4, seed=seed,
                       progress=False, checkpoint=path, callbacks=callbacks)  # fmt: skip


@pytest.mark.parametrize("when", [1, 2], ids=["before-first-save", "after-a-save"])
def test_a_second_run_writing_the_same_path_is_refused(tmp_path: Path, when: int):
    path = tmp_path / "ckpt.pt"
    # Another run (another seed: another run, not a resume) writes `path` behind this one's back.
    other = RunOther(when, lambda: run(path, epochs=when + 1, seed=1) if when == 1 else
                     run(path, epochs=3))  # fmt: skip
    with pytest.raises(FileExistsError) as info:
        run(path, epochs=4, callbacks=[other])
    ours_and_theirs = re.findall(r"run ([0-9a-f]{32})", str(info.value))
    assert re.match(r"^fit: .*ckpt\.pt was replaced by another writer", str(info.value))
    assert "another `checkpoint` path" in str(info.value)
    theirs = checkpoint.read(path, "test")
    assert ours_and_theirs[0] == theirs["run"]  # the message names the file's run ...
    if when == 1:
        assert "this run (a new run)" in str(info.value)  # ... and this one, which had none yet
    else:
        assert len(ours_and_theirs) == 2  # ... and this one
    assert theirs["epoch"] == 3 - (when == 1)  # the other run's file was left alone


# -- arguments are checked before anything is written ----------------------------------------


def _other_optimizer() -> vmapens.StackedAdam:
    return vmapens.StackedAdam(vmapens.Ensemble(lambda: nn.Linear(2, 2), n=5, seed=0))


BAD_ARGS = [
    ("save_members-ens", lambda ens, d: vmapens.save_members(nn.Linear(2, 1), d / "members"), TypeError, r"^save_members: `ens` must be a vmapens\.Ensemble, got Linear"),
    ("save_members-directory", lambda ens, d: vmapens.save_members(ens, 3), TypeError, r"^save_members: `directory` must be a str or os\.PathLike, got int"),
    ("save-path", lambda ens, d: vmapens.save(ens, 3.5), TypeError, r"^save: `path` must be a str or os\.PathLike, got float"),
    ("save-optimizer-type", lambda ens, d: vmapens.save(ens, d / "o.pt", optimizer="adam"), TypeError, r"^save: `optimizer` must be a torch\.optim\.Optimizer, got str"),
    ("save-history-type", lambda ens, d: vmapens.save(ens, d / "h.pt", history={}), TypeError, r"^save: `history` must be a vmapens\.History, got dict"),
    ("save-other-optimizer", lambda ens, d: vmapens.save(ens, d / "o.pt", optimizer=_other_optimizer()), ValueError, r"^save: `optimizer` parameter 0 \(shape \[5, 2, 2\]\) is not a parameter of this ensemble"),
    ("save-other-history", lambda ens, d: vmapens.save(ens, d / "h.pt", history=vmapens.History.empty(range(5), False)), ValueError, r"^save: `history` must be the History of `ens`'s members \(member ids \[0, 1\]\), got one of member ids \[0, 1, 2, 3, 4\]"),
    ("restore-ens", lambda ens, d: vmapens.restore(d / "ok.pt", nn.Linear(2, 1)), TypeError, r"^restore: `ens` must be a vmapens\.Ensemble, got Linear"),
    ("restore-optimizer-type", lambda ens, d: vmapens.restore(d / "ok.pt", ens, "adam"), TypeError, r"^restore: `optimizer` must be a torch\.optim\.Optimizer, got str"),
    ("restore-history-type", lambda ens, d: vmapens.restore(d / "ok.pt", ens, history={}), TypeError, r"^restore: `history` must be a vmapens\.History, got dict"),
    ("restore-other-optimizer", lambda ens, d: vmapens.restore(d / "ok.pt", ens, _other_optimizer()), ValueError, r"^restore: `optimizer` parameter 0 .* is not a parameter of this ensemble"),
    ("restore-path", lambda ens, d: vmapens.restore(None, ens), TypeError, r"^restore: `path` must be a str or os\.PathLike, got NoneType"),
    ("load-path", lambda ens, d: vmapens.load(7, lambda: nn.Linear(2, 1)), TypeError, r"^load: `path` must be a str or os\.PathLike, got int"),
    ("load_member-path", lambda ens, d: vmapens.load_member(7), TypeError, r"^load_member: `path` must be a str or os\.PathLike, got int"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("call", "error", "match"), [b[1:] for b in BAD_ARGS], ids=[b[0] for b in BAD_ARGS]
)
def test_file_apis_check_their_arguments_before_writing(tmp_path: Path, call, error, match):
    def files() -> dict[Path, bytes | None]:
        return {p: p.read_bytes() if p.is_file() else None for p in tmp_path.rglob("*")}

    ens = tiny()
    vmapens.save(ens, tmp_path / "ok.pt")
    before = files()
    state = {k: v.clone() for k, v in ens.state_dict().items()}
    with pytest.raises(error, match=match):
        call(ens, tmp_path)
    assert files() == before  # no file or directory created, none changed
    torch.testing.assert_close(ens.state_dict(), state, **EXACT)
