"""The width-sweep benchmark (bench/widths.py): its rows train the members plain PyTorch trains,
its equal-work check can fail, and a quick run renders (no timing asserted)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from truth import derived_seed, train_alone

from bench import format_table, run
from bench import widths as bw
from bench.workloads import _data

#: float32: the padded matmuls add exact zeros but may sum in another order than one member's.
TOL32 = {"rtol": 1e-5, "atol": 1e-6}
WIDTHS, SEEDS, STEPS = (3, 5, 8), 2, 3
CPU = torch.device("cpu")


def _adam(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters())  # workload A's default Adam (lr 1e-3)


def _alone() -> list[dict[str, torch.Tensor]]:
    """Every member built from its documented seed and trained alone with torch.optim.Adam."""
    x, y = _data("A", CPU)
    out = []
    for i, h in enumerate(h for h in WIDTHS for _ in range(SEEDS)):
        torch.manual_seed(derived_seed(0, "member", i))
        model = bw.width_mlp(h)
        train_alone(model, [(x, y)] * STEPS, F.binary_cross_entropy, _adam)
        out.append(model.state_dict())
    return out


@pytest.mark.parametrize("impl", ["naive", "separate", "padded_eager"])
def test_rows_train_each_member_as_it_trains_alone(impl):
    row = bw.ROWS[impl](WIDTHS, SEEDS, CPU)
    before = row.members()
    for _ in range(STEPS):
        row.step()
    got, truth = row.members(), _alone()
    assert [m["0.weight"].shape[0] for m in got] == [h for h in WIDTHS for _ in range(SEEDS)]
    assert not torch.equal(before[0]["0.weight"], got[0]["0.weight"])  # it trained
    for i, (mine, theirs) in enumerate(zip(got, truth, strict=True)):
        assert list(mine) == list(theirs)
        for name in theirs:
            torch.testing.assert_close(mine[name], theirs[name], **TOL32, msg=f"{i} {name}")


def test_quick_run_checks_equal_work_and_renders():
    results = run(workloads=("widths",), quick=True, threads=1)
    assert json.loads(json.dumps(results)) == results
    (sweep,) = results["widths"]["sweeps"]
    assert sweep["widths"] == list(bw.QUICK_WIDTHS) and sweep["threads"] == 1
    assert sweep["check"]["same"] and sweep["check"]["max_abs_diff"] < TOL32["atol"], sweep
    rows = {r["impl"]: r for r in sweep["rows"]}
    assert list(rows) == ["naive", "separate", "padded_eager"]  # quick mode: nothing compiled
    assert all(r["status"] == "ok" and r["ms"] > 0 and r["state_kb"] > 0 for r in rows.values())
    # Padded storage holds every member at the widest size: more than one ensemble per width.
    assert rows["padded_eager"]["state_kb"] > rows["separate"]["state_kb"]
    table = format_table(results)
    assert "Width sweep" in table and "padded/separate" in table and ": yes (" in table


def test_unequal_work_is_reported(monkeypatch):
    def twice(widths, seeds, device):
        row = bw.w_padded(widths, seeds, device)
        return bw.Trained(lambda: (row.step(), row.step()), row.members, row.tensors)

    monkeypatch.setitem(bw.ROWS, "padded_eager", twice)
    results = bw.run_widths(quick=True, threads=(1,))
    check = results["sweeps"][0]["check"]
    assert not check["same"] and check["reason"].startswith("padded_eager"), check
    assert "NO, the rows do unequal work: padded_eager" in bw.format_widths(results)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"threads": ()}, "`threads` must be positive ints", id="no-threads"),
        pytest.param({"scales": (0,)}, "`scales` must be positive ints", id="zero-scale"),
    ],
)
def test_run_widths_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=f"run_widths: {match}"):
        bw.run_widths(quick=True, **kwargs)
