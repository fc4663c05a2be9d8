"""``bench/gpu.sh`` stays one runnable command for the day a GPU is lent (issue 21 item 7).

No GPU is needed: the script runs here up to its CUDA check, and every command after the check
is checked against what it calls (the benchmark's argument parser and :func:`bench.run`'s
signature, the CUDA test file's collection), so a renamed option or file fails here first."""

from __future__ import annotations

import inspect
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bench
import bench.__main__ as bench_main

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu.sh"


def _commands(program: str) -> list[list[str]]:
    """The argument lists of every ``python -m <program> ...`` in the script, continuation
    lines joined, up to its redirection or pipe."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    found = re.findall(rf"python -m {re.escape(program)} ([^|>\n]*?)\s*(?:2>&1|\||$)", text, re.M)
    return [shlex.split(args) for args in found]


def test_the_script_parses_and_stops_cleanly_without_a_gpu(tmp_path):
    assert subprocess.run(["bash", "-n", str(SCRIPT)], timeout=30).returncode == 0
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: bench/gpu.sh would run the whole check")
    env = dict(os.environ, OUT=str(tmp_path))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # its `python`
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, timeout=120)
    assert done.returncode == 1, done
    report = (tmp_path / "env.txt").read_text()
    assert f"torch {torch.__version__}" in report
    assert "torch sees no CUDA device; nothing to run" in report


def test_every_benchmark_command_of_the_script_is_accepted(monkeypatch, tmp_path):
    commands = _commands("bench")
    assert len(commands) >= 2, SCRIPT.read_text()
    calls = []
    monkeypatch.setattr(bench_main, "run", lambda **options: calls.append(options) or {})
    monkeypatch.setattr(bench_main, "format_table", lambda results: "")
    for argv in commands:
        argv = [str(tmp_path / "out.json") if a.startswith("$out/") else a for a in argv]
        assert "$" not in " ".join(argv), argv  # every variable is one the test replaced
        assert bench_main.main(argv) == 0
    assert len(calls) == len(commands)
    for options in calls:
        assert options["device"] == "cuda"
        inspect.signature(bench.run).bind(**options)  # every option is one run takes
        assert set(options.get("workloads", ())) <= set(bench.WORKLOADS)


def test_the_cuda_tests_the_script_runs_are_collected(tmp_path):
    (argv,) = _commands("pytest")
    files = [a for a in argv if a.endswith(".py")]
    assert files == ["tests/test_cuda.py"], argv
    root = SCRIPT.parents[1]
    assert (root / files[0]).is_file()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", files[0], "--collect-only", "-q"]
        + ["-o", "addopts=", "-p", "no:cacheprovider"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"^(\d+) tests? collected", done.stdout, re.M), done.stdout
