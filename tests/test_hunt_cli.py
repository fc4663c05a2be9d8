"""The command lines users type: ``python -m bench`` and ``python -m vmapens demo``.

Bad values stop at the parser (exit 2, one line naming the option, nothing run), every command
the docs show is accepted, and ``--json`` writes its file whole or not at all. Arguments are
parsed in-process (a subprocess importing torch and the benchmarks costs seconds) with the
benchmark and the demos replaced by recorders."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import bench
import bench.__main__ as bench_main
from bench.run import OptionError
from vmapens import __main__ as demo_main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def bench_calls(monkeypatch):
    """The options `python -m bench` hands to `run`, with nothing timed."""
    calls: list[dict] = []
    monkeypatch.setattr(bench_main, "run", lambda **options: calls.append(options) or {"x": 1})
    monkeypatch.setattr(bench_main, "format_table", lambda results: "")
    return calls


def _usage_error(capsys, main, argv) -> str:
    with pytest.raises(SystemExit) as raised:
        main(argv)
    assert raised.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


BAD_BENCH = [
    (["--sizes", "0"], "--sizes", "positive integer"),
    (["--sizes", "15", "-3"], "--sizes", "positive integer"),
    (["--sizes", "ten"], "--sizes", "positive integer"),
    (["--threads", "0"], "--threads", "positive integer"),
    (["--threads", "-1"], "--threads", "positive integer"),
    (["--real-n", "0"], "--real-n", "positive integer"),  # was silently the default 16
    (["--real-n", "-2"], "--real-n", "positive integer"),
    (["--quick", "--sizes", "4096"], "--sizes", "not allowed with --quick"),
    (["--quick", "--real-n", "4"], "--real-n", "not allowed with --quick"),
    (["--workloads", "C"], "--workloads", "invalid choice"),
    (["--device", "tpu"], "--device", "invalid choice"),
    (["--json", "no-such-folder/out.json"], "--json", "does not exist"),
]


@pytest.mark.parametrize(("argv", "option", "expected"), BAD_BENCH, ids=lambda v: str(v))
def test_bench_refuses_bad_values_before_running(capsys, bench_calls, argv, option, expected):
    line = _usage_error(capsys, bench_main.main, argv)
    assert line.startswith(f"python -m bench: error: argument {option}"), line
    assert expected in line, line
    assert bench_calls == []


def test_bench_json_that_is_a_folder_is_refused(capsys, bench_calls, tmp_path):
    line = _usage_error(capsys, bench_main.main, ["--json", str(tmp_path)])
    assert "argument --json" in line and "folder" in line
    assert bench_calls == []


def test_bench_cuda_without_a_gpu_is_a_usage_error(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(OptionError, match=r"^run: `device` is 'cuda' but torch sees"):
        bench.run(device="cuda", workloads=("A",), sizes=(1,))
    out = tmp_path / "out.json"
    argv = ["--device", "cuda", "--workloads", "A", "--sizes", "1", "--json", str(out)]
    line = _usage_error(capsys, bench_main.main, argv)
    assert "`device`" in line and "no CUDA device" in line
    assert not out.exists()


@pytest.mark.parametrize("threads", [0, -2, True, 1.5])
def test_bench_run_refuses_bad_threads_before_setting_them(threads):
    before = torch.get_num_threads()
    with pytest.raises(ValueError, match=r"^run: `threads` must be a positive int"):
        bench.run(workloads=("optim",), threads=threads)
    assert torch.get_num_threads() == before


def test_bench_options_reach_run(bench_calls, capsys):
    argv = ["--sizes", "15", "15", "1", "--real-n", "4", "--threads", "1", "--workloads", "A", "A"]
    assert bench_main.main(argv) == 0
    (options,) = bench_calls
    assert options["sizes"] == (15, 1)  # each N once: a repeated N would be timed twice
    assert options["real_n"] == 4 and options["threads"] == 1 and options["workloads"] == ("A",)
    capsys.readouterr()
    options["log"]("A: N=15")  # progress goes to stderr, apart from the table on stdout
    assert capsys.readouterr() == ("", "A: N=15\n")


def test_bench_json_is_written_whole(bench_calls, tmp_path):
    out = tmp_path / "out.json"
    assert bench_main.main(["--workloads", "A", "--json", str(out)]) == 0
    assert json.loads(out.read_text()) == {"x": 1}
    plain = tmp_path / "plain.txt"  # an ordinary file: its mode is what the umask gives
    plain.write_text("")
    assert out.stat().st_mode == plain.stat().st_mode


def test_bench_json_failure_leaves_the_old_file(monkeypatch, tmp_path):
    monkeypatch.setattr(bench_main, "run", lambda **options: {"rows": [1, 2, object()]})
    monkeypatch.setattr(bench_main, "format_table", lambda results: "")
    out = tmp_path / "out.json"
    out.write_text('{"old": true}')
    with pytest.raises(TypeError, match="not JSON serializable"):
        bench_main.main(["--json", str(out)])
    assert json.loads(out.read_text()) == {"old": True}
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # no temporary file left


def _documented(program: str) -> list[list[str]]:
    """Every ``python -m <program> ...`` in the README and docs/ (a line that goes on with
    ``--`` joined), `T` (a thread count) read as 1."""
    text = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md"))])
    words = r"(?:(?:[ \t]+|\n(?=--))(?:--[\w-]+|[\w.]+))*"
    found = re.findall(rf"python -m {program}({words})", text)
    return [["1" if w == "T" else w for w in args.split()] for args in found]


def test_every_documented_bench_command_is_accepted(bench_calls, tmp_path):
    commands = _documented("bench")
    assert len(commands) >= 10
    for argv in commands:
        argv = [str(tmp_path / a) if a.endswith(".json") else a for a in argv]
        assert bench_main.main(argv) == 0, argv
    assert len(bench_calls) == len(commands)


def test_bench_help_names_every_workload():
    (action,) = [a for a in bench_main._parser()._actions if "--workloads" in a.option_strings]
    assert action.choices == bench.WORKLOADS
    for name in bench.WORKLOADS:
        assert re.search(rf"(^|[ /]){name}[:/]", action.help), name


@pytest.fixture
def demo_calls(monkeypatch):
    """Which demo `python -m vmapens demo` starts, with none run."""
    calls: list[tuple] = []
    for name in ("workload_a", "digits", "sharded_demo", "sweep_demo"):
        monkeypatch.setattr(demo_main, name, lambda *a, _n=name, **k: calls.append((_n, k)))
    return calls


BAD_DEMO = [
    (["demo", "--steps", "0"], "argument --steps: expected an integer >= 2"),  # was 1/0
    (["demo", "--steps", "-5"], "argument --steps: expected an integer >= 2"),
    # One step leaves nothing to time after the first (compiling) one: "0 ms/step".
    (["demo", "--steps", "1"], "argument --steps: expected an integer >= 2"),
    (["demo", "--sharded", "--sweep"], "not allowed with argument --sharded"),
    (["demo", "--sweep", "--steps", "5"], "argument --steps: not allowed with --sweep"),
    (["demo", "--sharded", "--steps", "5"], "argument --steps: not allowed with --sharded"),
    (["run"], "argument command: invalid choice"),
    ([], "the following arguments are required: command"),
]


@pytest.mark.parametrize(("argv", "expected"), BAD_DEMO, ids=lambda v: str(v))
def test_demo_refuses_bad_values_before_running(capsys, demo_calls, argv, expected):
    line = _usage_error(capsys, demo_main.main, argv)
    assert line.startswith("python -m vmapens"), line
    assert expected in line, line
    assert demo_calls == []


def test_demo_steps_reach_workload_a(demo_calls):
    assert demo_main.main(["demo", "--steps", "7"]) == 0
    assert demo_calls == [("workload_a", {"steps": 7}), ("digits", {})]
    demo_calls.clear()
    assert demo_main.main(["demo"]) == 0
    assert demo_calls == [("workload_a", {"steps": 1000}), ("digits", {})]


@pytest.mark.parametrize("argv", [["bench"], ["bench", "--quick"], ["bench", "--help"]])
def test_vmapens_bench_says_where_the_benchmarks_went(capsys, argv):
    assert demo_main.main(argv) == 2
    assert "run `python -m bench`" in capsys.readouterr().err


def test_every_documented_demo_command_is_accepted(demo_calls):
    commands = _documented("vmapens")
    assert ["demo", "--sweep"] in commands
    for argv in commands:
        assert demo_main.main(argv) == 0, argv
