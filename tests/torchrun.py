"""Local multi-process runs for the tests: torchrun on the loopback, bounded in time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

#: Seconds a whole torchrun may take before it and every worker it started are killed.
TIMEOUT_S = 120


def torchrun(
    script: str | Path,
    args: list[str],
    run_id: str,
    *,
    ranks: int = 2,
    restarts: int = 0,
    env: dict[str, str] | None = None,
    fails: bool = False,
) -> None:
    """Run ``script *args`` on ``ranks`` local processes under torchrun (gloo, 127.0.0.1).

    ``fails``: the run is meant to fail (a rank is killed): expect a non-zero exit status.
    """
    what = f"torchrun {Path(script).name} {' '.join(args[:-1])}".rstrip()
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "1", "--nproc-per-node", str(ranks), "--max-restarts", str(restarts),
        # Rendezvous and gloo on the loopback only; port 0 lets the OS pick a free one.
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--rdzv-id", run_id,
        str(script), *args,
    ]  # fmt: skip
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    if Path("/sys/class/net/lo").exists():
        full_env["GLOO_SOCKET_IFNAME"] = "lo"
    # A session of its own, so a hung run is killed with every worker it started.
    proc = subprocess.Popen(
        cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        log, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"{what} timed out after {TIMEOUT_S} s:\n{log.decode()[-4000:]}")
    if fails:
        assert proc.returncode != 0, f"{what} should have failed:\n{log.decode()}"
    else:
        assert proc.returncode == 0, f"{what} failed:\n{log.decode()[-4000:]}"
