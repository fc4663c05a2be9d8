"""The benchmark suite (top-level bench/): memory of the build path, and a smoke run (no timing
asserted). Its docstring examples run in tests/test_docs.py with every other module's."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

import bench

#: Peak (and held) RSS over the stacked parameters plus one member, as the issue bounds it.
MEMORY_FACTOR = 1.2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_build_memory_peaks_near_stacked_plus_one_member():
    # 64 members of 197,312 parameters: 48 MB stacked, well above allocator noise, built in a
    # few seconds. Building all members before stacking would peak near twice that.
    m = bench.build_memory(64, hidden=192)
    assert m["status"] == "ok", m
    stacked_mb = m["n"] * m["params"] * 4 / 2**20
    assert stacked_mb >= 30
    assert m["peak_mb"] <= MEMORY_FACTOR * m["expected_mb"], m
    # The Ensemble keeps only the stacked tensors: no per-member copies are held.
    assert m["held_mb"] <= MEMORY_FACTOR * m["expected_mb"], m


def test_run_quick_optim_smoke(capsys):
    results = bench.run(workloads=("optim",), quick=True, log=print)
    assert set(results) == {"meta", "optim"}
    assert json.loads(json.dumps(results)) == results
    rows = results["optim"]["rows"]
    assert {r["impl"] for r in rows} == set(bench.WORKLOAD_OPTIM)
    assert {r["n"] for r in rows} == {bench.OPTIM_SIZES[0]}
    assert all(r["status"] == "ok" and r["ms"] > 0 for r in rows), rows
    table = bench.format_table(results)
    for impl in bench.WORKLOAD_OPTIM:
        assert impl in table
    assert "stacked/foreach" in table and "groups/stacked" in table
    assert "optim: " in capsys.readouterr().out


def _stacked_after(impl: str, n: int, steps: int) -> list[torch.Tensor]:
    """Run an optimizer-step factory and return its parameters stacked per member."""
    step = bench.WORKLOAD_OPTIM[impl](n, torch.device("cpu"))
    for _ in range(steps):
        step()
    groups = step.__self__.param_groups  # the factories return a bound Optimizer.step
    if len(groups) == 1:
        return [p.detach() for p in groups[0]["params"]]
    return [torch.stack([g["params"][j].detach() for g in groups]) for j in range(4)]


# Each row of the benchmark must do the same work: pairs that apply the same update.
SAME_UPDATE = [
    ("stacked_adam", "foreach_adam"),
    ("stacked_adam_per_member_lr", "per_member_groups"),
]


@pytest.mark.parametrize(
    ("impl", "reference"), SAME_UPDATE, ids=[f"{a}-vs-{b}" for a, b in SAME_UPDATE]
)
def test_optim_rows_apply_the_same_update(impl, reference):
    start = _stacked_after(impl, 5, 0)
    got, expected = _stacked_after(impl, 5, 3), _stacked_after(reference, 5, 3)
    assert all(not torch.equal(a, b) for a, b in zip(got, start))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)


BAD_RUNS = [
    pytest.param(
        {"workloads": ()}, "run: `workloads` must be a non-empty subset", id="no-workload"
    ),
    pytest.param({"workloads": ("C",)}, "run: `workloads` must be", id="unknown-workload"),
    pytest.param({"sizes": (0,)}, "run: `sizes` must be positive ints", id="zero-size"),
    pytest.param({"optim_sizes": ()}, "run: `optim_sizes` must be", id="no-optim-size"),
    pytest.param({"real_n": 0}, "run: `real_n` must be positive ints", id="zero-real-n"),
]


@pytest.mark.parametrize(("kwargs", "match"), BAD_RUNS)
def test_run_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        bench.run(**{"workloads": ("optim",), **kwargs})


@pytest.mark.parametrize("value", [0, -1, 2.0, True])
def test_build_memory_rejects_bad_n(value):
    with pytest.raises(ValueError, match="build_memory: `n` must be a positive int"):
        bench.build_memory(value)


#: The losses of the real-model rows agree with the naive loop's to float32 rounding.
REAL_TOL = {"rtol": 1e-5, "atol": 1e-6}
REAL_ROWS = [
    pytest.param(workload, impl, id=f"{workload}-{impl}")
    for workload, rows in bench.WORKLOAD_REAL.items()
    for impl in rows
    if impl not in ("naive", "vmapens_compiled")
    and (workload, impl) not in {("gru", "torchfunc"), ("lstm", "torchfunc")}
]


@pytest.mark.parametrize(("workload", "impl"), REAL_ROWS)
def test_real_rows_train_the_same_members_as_the_naive_loop(workload, impl):
    # Losses of three steps: the first checks the forward, the next two the updates.
    cpu = torch.device("cpu")
    naive = bench.WORKLOAD_REAL[workload]["naive"](2, cpu)
    step = bench.WORKLOAD_REAL[workload][impl](2, cpu)
    expected = torch.stack([naive() for _ in range(3)])
    torch.testing.assert_close(torch.stack([step() for _ in range(3)]), expected, **REAL_TOL)


@pytest.mark.parametrize("workload", ["gru", "lstm"])
def test_recipe_without_batchable_is_reported_not_raised(workload):
    with pytest.raises(NotImplementedError, match="Batching rule not implemented"):
        bench.WORKLOAD_REAL[workload]["torchfunc"](2, torch.device("cpu"))


def test_run_quick_real_smoke():
    # One workload that batches and one whose bare recipe cannot: both kinds of row.
    results = bench.run(workloads=("cnn", "gru"), quick=True, threads=1)
    assert json.loads(json.dumps(results)) == results
    for workload in ("cnn", "gru"):
        factories = bench.WORKLOAD_REAL[workload]
        rows = {r["impl"]: r for r in results[workload]["rows"]}
        assert list(rows) == list(factories)
        assert results[workload]["n"] == bench.QUICK_REAL_N
        assert rows["vmapens_compiled"]["status"] == "skipped"
        assert rows["naive"]["status"] == rows["vmapens_eager"]["status"] == "ok", rows
    gru = {r["impl"]: r for r in results["gru"]["rows"]}
    assert gru["torchfunc"]["status"] == "n/a" and "aten::gru" in gru["torchfunc"]["reason"]
    table = bench.format_table(results)
    assert "target: vmapens_eager >= 2x naive" in table
    assert "n/a torchfunc: NotImplementedError" in table


def test_time_to_result_runs_in_fresh_processes():
    # The two kinds of row: a step factory (merged: the table's reference) and fit. The naive
    # row runs the very path of merged, a process more; bench.compile_time's docstring
    # example runs it. Asked out of order: the rows come back in RESULT_ROWS' order.
    rows = bench.time_to_result(2, 3, rows=["vmapens_fit", "merged"])
    assert [r["impl"] for r in rows] == ["merged", "vmapens_fit"]
    for r in rows:
        assert 0 < r["run_s"] < r["process_s"], r
        assert r["graphs"] == 0  # nothing compiled in an eager run
    assert 0 < rows[0]["first_s"] <= rows[0]["run_s"]
    assert math.isnan(rows[1]["first_s"])  # fit times no first step of its own
    table = bench.format_table({"meta": _META, "result": {"rows": rows}})
    assert "Time to result" in table and "run/merged" in table
    assert "target: vmapens_fit <= 1.0x merged (process)" in table


_META = {"torch": torch.__version__, "device": "cpu", "threads": 1, "quick": True}


def test_compile_table_renders_every_mode():
    rows = [
        {"workload": "A", "mode": mode, "first_s": 1.0, "second_s": 1e-3, "process_s": 3.0,
         "graphs": 1, "fx_hit": int(mode != "cold"), "fx_miss": int(mode == "cold"),
         "aot_hit": 0, "aot_miss": 1}
        for mode in ("cold", "warm", "mega")
    ]  # fmt: skip
    table = bench.format_table({"meta": _META, "compile": {"rows": rows}})
    assert "First compiled step" in table and "0/1" in table and "1/0" in table


def _memory_run(n: int, chunk_size: int | None, peak: float, step: float) -> dict:
    """One variant of bench.train_memory's result (its documented keys), made-up figures."""
    return {"n": n, "chunk_size": chunk_size, "build_mb": 17.0, "first_mb": peak - 80,
            "held_mb": 100.0, "step_mb": step, "eval_mb": 50.0, "peak_mb": peak,
            "total_mb": peak + 240, "losses": [2.3], "digest": 1.0}  # fmt: skip


def test_training_memory_table_shows_the_ratio_with_glibc_fixed_too():
    # Distinct figures for glibc's defaults and glibc fixed, so a line that printed one
    # setting's figures under the other's label fails; 0.64 misses the 0.5 target, 0.49 meets it.
    fixed = {"unchunked": _memory_run(32, None, 368.0, 267.0),
             "chunked": _memory_run(32, 8, 181.0, 80.0), "ratio": 181 / 368,
             "step_ratio": 80 / 267}  # fmt: skip
    memory = {"unchunked": _memory_run(32, None, 375.0, 265.0),
              "chunked": _memory_run(32, 8, 240.0, 100.0), "ratio": 240 / 375,
              "step_ratio": 100 / 265, "same": True, "fixed": fixed}  # fmt: skip
    memory["batch"] = 48
    memory["tensors"] = {"unchunked": {"peak_mb": 306.0}, "chunked": {"peak_mb": 120.0},
                         "ratio": 120 / 306}  # fmt: skip
    lines = bench.format_table({"meta": _META, "train_memory": memory}).splitlines()
    assert any("batch 48)" in line for line in lines), "the heading names the run's batch"
    labels = [k for k, line in enumerate(lines) if line.strip().startswith("glibc")]
    assert len(labels) == 2, lines
    defaults, glibc_fixed = (lines[k] + lines[k + 1] for k in labels)
    assert "glibc's defaults" in defaults
    assert "240 / 375 MB = 0.64x" in defaults and "100 / 265 MB = 0.38x" in defaults
    assert "glibc fixed (MALLOC_MMAP_THRESHOLD_=131072" in glibc_fixed
    assert "181 / 368 MB = 0.49x" in glibc_fixed and "80 / 267 MB = 0.30x" in glibc_fixed
    tensors = next(k for k, line in enumerate(lines) if "tensors only" in line)
    assert "120 / 306 MB = 0.39x" in lines[tensors + 1]
    assert "glibc's defaults missed, glibc fixed met, tensors met" in lines[-1]
    del memory["tensors"]  # results saved before the tensor figure still print
    lines = bench.format_table({"meta": _META, "train_memory": memory}).splitlines()
    assert "glibc's defaults missed, glibc fixed met" in lines[-1] and "tensors" not in lines[-1]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        pytest.param(
            lambda: bench.time_to_result(rows=["fast"]), "time_to_result: `rows`", id="row"
        ),
        pytest.param(
            lambda: bench.first_step_times(["gru"]), "first_step_times: `workloads`", id="wl"
        ),
    ],
)
def test_compile_time_rejects_unknown_names(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_the_optimizer_table_pairs_each_round_with_its_twin():
    # Two rounds in which the machine ran slow for both steps alike: the ratio of the medians
    # mixes rounds, the paired column divides within each round.
    from bench.optimizers import format_optimizers

    stacked = [1.0, 3.0, 1.1, 3.3, 1.2]
    twin = [0.9, 2.9, 1.0, 3.0, 0.8]
    rows = [
        {"optimizer": "radam", "n": 256, "impl": impl, "ms": sorted(r)[2], "min_ms": min(r)}
        | {"rounds_ms": r}
        for impl, r in (("stacked", stacked), ("foreach", twin))
    ]
    line = next(x for x in format_optimizers(rows).splitlines() if x.split()[0] == "radam")
    per_round = sorted(s / t for s, t in zip(stacked, twin, strict=True))
    assert line.split()[-1] == f"{per_round[2]:.3g}"
    rows[0].pop("rounds_ms")  # a row saved before rounds were kept
    line = next(x for x in format_optimizers(rows).splitlines() if x.split()[0] == "radam")
    assert line.split()[-1] == "n/a"
