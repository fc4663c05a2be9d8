"""The benchmark library: memory of the build path, and a smoke run (no timing asserted)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from vmapens import bench

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
]


@pytest.mark.parametrize(("kwargs", "match"), BAD_RUNS)
def test_run_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        bench.run(**{"workloads": ("optim",), **kwargs})


@pytest.mark.parametrize("value", [0, -1, 2.0, True])
def test_build_memory_rejects_bad_n(value):
    with pytest.raises(ValueError, match="build_memory: `n` must be a positive int"):
        bench.build_memory(value)
