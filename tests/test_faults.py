"""Failures change nothing: faults injected into fit and into checkpoint writes.

A fault in the loss, the optimizer's update, a callback or the data (KeyboardInterrupt) leaves
the ensemble at the last completed step, consistent with its optimizer, and a resume from
the fit checkpoint ends bit-identical to an uninterrupted run. A save killed by SIGKILL, a
full disk or an unwritable path leave the previous checkpoint loadable and no temporary file.
"""

from __future__ import annotations

import copy
import errno
import hashlib
import os
import random
import re
import resource
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import vmapens
from vmapens.checkpoint import read

N, ROWS, BATCH, EPOCHS = 4, 16, 4, 3
STEPS_PER_EPOCH = ROWS // BATCH
FAIL_AT = STEPS_PER_EPOCH + 2  # the second step of epoch 2


def factory() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 2)).double()


class Batches:
    """A re-iterable list of batches; raises ``fault`` when asked for batch ``fail_at``
    (counted over all passes, 1-based)."""

    def __init__(self, fail_at: int | None = None, fault: type[BaseException] = KeyboardInterrupt):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(ROWS, 3, generator=g, dtype=torch.float64)
        y = torch.randn(ROWS, 2, generator=g, dtype=torch.float64)
        self.batches = [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, ROWS, BATCH)]
        self.fail_at, self.fault, self.served = fail_at, fault, 0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for batch in self.batches:
            self.served += 1
            if self.served == self.fail_at:
                raise self.fault("injected: data")
            yield batch


class FailingLoss:
    """MSE that raises on its ``fail_at``-th call (one call per step: traced once by vmap)."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.calls, self.fail_at = 0, fail_at

    def __call__(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected: loss")
        return nn.functional.mse_loss(out, target)


class FailingAdam(vmapens.StackedAdam):
    """StackedAdam whose update raises on its ``fail_at``-th call, after it has written the
    parameters and moments in place: a failure in the middle of the optimizer step."""

    fail_at: int | None = None
    calls = 0

    def update_(self, param, grad, state, group) -> None:  # type: ignore[no-untyped-def]
        super().update_(param, grad, state, group)
        type(self).calls += 1
        if type(self).calls == self.fail_at:
            raise RuntimeError("injected: optimizer")


class Recorder(vmapens.Callback):
    """Keeps the state after every step; raises after step ``fail_at`` when asked to."""

    def __init__(self, ens: vmapens.Ensemble, opt: torch.optim.Optimizer, fail_at: int | None):
        self.ens, self.opt, self.fail_at, self.after = ens, opt, fail_at, [state_of(ens, opt)]

    def on_step_end(self, ctx: vmapens.callbacks.Context) -> None:
        self.after.append(state_of(self.ens, self.opt))
        if ctx.step == self.fail_at:
            raise RuntimeError("injected: callback")


def state_of(ens: vmapens.Ensemble, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "ensemble": {k: t.detach().clone() for k, t in ens.stacked_state().items()},
        "optimizer": copy.deepcopy(opt.state_dict()["state"]),
    }


def assert_same(got: Any, expected: Any) -> None:
    # Exact: the same arithmetic on the same values, or the very values kept.
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


def run(kind: str | None, checkpoint: Path | None) -> tuple[vmapens.Ensemble, Any, Recorder]:
    """fit for EPOCHS epochs with the fault ``kind`` armed (None: no fault)."""
    ens = vmapens.Ensemble(factory, N, seed=0)
    opt_class = FailingAdam
    FailingAdam.fail_at, FailingAdam.calls = (FAIL_AT if kind == "optimizer" else None), 0
    opt = opt_class(ens, lr=[1e-2, 2e-2, 3e-2, 4e-2])
    recorder = Recorder(ens, opt, FAIL_AT if kind == "callback" else None)
    data = Batches(FAIL_AT if kind == "interrupt" else None)
    loss = FailingLoss(FAIL_AT if kind == "loss" else None)
    history = vmapens.fit(
        ens, data, loss, epochs=EPOCHS, optimizer=opt, progress=False, seed=0,
        checkpoint=checkpoint, callbacks=[recorder],
        check=False,  # the first step's self-check would call the counting loss twice more
    )  # fmt: skip
    return ens, history, recorder


@pytest.fixture(scope="module")
def uninterrupted() -> tuple[dict, dict]:
    ens, history, recorder = run(None, None)
    return recorder.after[-1], history.state_dict()


# (fault, error, steps completed when it strikes)
FAULTS = [
    ("loss", RuntimeError, FAIL_AT - 1),
    ("optimizer", RuntimeError, FAIL_AT - 1),
    ("callback", RuntimeError, FAIL_AT),  # after the step: the step itself completed
    ("interrupt", KeyboardInterrupt, FAIL_AT - 1),
]


@pytest.mark.parametrize(("kind", "error", "completed"), FAULTS, ids=[f[0] for f in FAULTS])
def test_fault_leaves_last_step_and_resume_matches_uninterrupted(
    tmp_path: Path, uninterrupted: tuple, kind: str, error: type, completed: int
):
    ckpt = tmp_path / "ckpt.pt"
    with pytest.raises(error, match=f"injected: {'data' if kind == 'interrupt' else kind}"):
        run(kind, ckpt)
    # The recorder of the failed run is gone with it: rerun to the fault to read its steps.
    ens = vmapens.Ensemble(factory, N, seed=0)
    FailingAdam.fail_at, FailingAdam.calls = (FAIL_AT if kind == "optimizer" else None), 0
    opt = FailingAdam(ens, lr=[1e-2, 2e-2, 3e-2, 4e-2])
    recorder = Recorder(ens, opt, FAIL_AT if kind == "callback" else None)
    data = Batches(FAIL_AT if kind == "interrupt" else None)
    loss = FailingLoss(FAIL_AT if kind == "loss" else None)
    with pytest.raises(error):
        vmapens.fit(ens, data, loss, epochs=EPOCHS, optimizer=opt, progress=False, seed=0,
                    callbacks=[recorder], check=False)  # fmt: skip
    assert len(recorder.after) == completed + 1
    assert_same(state_of(ens, opt), recorder.after[completed])  # bit-identical, incl. moments
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in ens.parameters())
    # The checkpoint holds epoch 1; resuming from it ends as the uninterrupted run.
    assert read(ckpt, "test")["fit"]["global_step"] == STEPS_PER_EPOCH
    ens, history, recorder = run(None, ckpt)
    final, expected_history = uninterrupted
    assert_same(recorder.after[-1], final)
    assert_same(
        {k: v for k, v in history.state_dict().items() if isinstance(v, torch.Tensor)},
        {k: v for k, v in expected_history.items() if isinstance(v, torch.Tensor)},
    )


# -- checkpoint writes -----------------------------------------------------------------------


def big_ensemble() -> vmapens.Ensemble:
    return vmapens.Ensemble(lambda: nn.Linear(512, 512), 24, seed=0)  # ~25 MB


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def temps(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob(".*.tmp"))


def in_child(body: Callable[[], int]) -> int:
    """Run ``body`` in a forked child process; its return value is the exit status."""
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 1
        try:
            code = body()
        finally:
            os._exit(code)
    return pid


def test_kill_during_save_leaves_previous_checkpoint(tmp_path: Path):
    ens, path = big_ensemble(), tmp_path / "ckpt.pt"
    vmapens.save(ens, path)
    rng = random.Random(0)

    def save_forever() -> int:
        while True:
            vmapens.save(ens, path)

    deadline = time.monotonic() + 60
    for _ in range(10):
        pid = in_child(save_forever)
        time.sleep(rng.uniform(0.02, 0.4))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        restored = vmapens.load(path, lambda: nn.Linear(512, 512))  # the previous save, whole
        assert_same(restored.state_dict(), ens.state_dict())
        assert time.monotonic() < deadline, "kill loop took too long"
    vmapens.save(ens, path)  # the next save removes what killed saves left
    assert temps(tmp_path) == []


def test_disk_full_fails_clearly_and_keeps_old_file(tmp_path: Path):
    path = tmp_path / "ckpt.pt"
    vmapens.save(vmapens.Ensemble(lambda: nn.Linear(4, 4), 2, seed=0), path)
    before = digest(path)
    ens = big_ensemble()

    def save_with_small_disk() -> int:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
        try:
            vmapens.save(ens, path)
        except OSError as err:
            said = "save: could not write" in str(err) and "previous file" in str(err)
            said = said and "the file would exceed the file-size limit" in str(err)
            return 3 if said and err.errno == errno.EFBIG else 4
        return 5

    _, status = os.waitpid(in_child(save_with_small_disk), 0)
    assert os.waitstatus_to_exitcode(status) == 3
    assert digest(path) == before
    assert temps(tmp_path) == []


def test_unwritable_path_fails_clearly_and_keeps_old_file(tmp_path: Path):
    """A path under a regular file fails even as root (chmod does not stop root)."""
    (tmp_path / "file").write_text("not a directory")
    ens = vmapens.Ensemble(lambda: nn.Linear(4, 4), 2, seed=0)
    with pytest.raises(NotADirectoryError, match=r"save: could not write .*previous file"):
        vmapens.save(ens, tmp_path / "file" / "ckpt.pt")
    assert (tmp_path / "file").read_text() == "not a directory"


def test_read_only_directory_fails_clearly_and_keeps_old_file():
    # Root writes into read-only directories: as root, the save runs in a forked child that
    # drops to the unprivileged uid/gid 65534 (torch is already imported: nothing to read).
    directory = Path(tempfile.mkdtemp(dir="/tmp", prefix="vmapens-ro-"))
    try:
        directory.chmod(0o755)
        path = directory / "ckpt.pt"
        ens = vmapens.Ensemble(lambda: nn.Linear(4, 4), 2, seed=0)
        vmapens.save(ens, path)
        path.chmod(0o644)
        before = digest(path)
        directory.chmod(0o555)

        def save_unprivileged() -> int:
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
            try:
                vmapens.save(ens, path)
            except PermissionError as err:
                return 3 if re.search(r"save: could not write .*previous file", str(err)) else 4
            return 5

        _, status = os.waitpid(in_child(save_unprivileged), 0)
        assert os.waitstatus_to_exitcode(status) == 3
        assert digest(path) == before and temps(directory) == []
    finally:
        directory.chmod(0o700)
        shutil.rmtree(directory)
