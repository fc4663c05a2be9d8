"""A Python counter and a first-call flag with members run in turns (``backend="loop"``,
``chunk_size`` below ``n``): every member's turn starts from the plain values the module held
before the call, as each member alone would (docs/semantics.md, "State a forward carries").

The forward-only paths: the loop, torch.func's chunks, and chunks run here in turns (grad on
and a BatchNorm that edits its buffers). ``tests/test_journey_awkward.py`` trains (loop and the
chunked step)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import vmapens

N = 4


class Warm(nn.Module):
    """A warm-up on a Python counter, and a flag the first call adds."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.bn = nn.BatchNorm1d(2)
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        h = self.bn(self.fc(x))
        if not hasattr(self, "started"):
            self.started = True
            h = h * 2
        return torch.tanh(h) if self.calls > 2 else h


@pytest.mark.parametrize(
    "how",
    [{"backend": "loop"}, {"chunk_size": 2}, {"chunk_size": 3, "grad": True}],
    ids=["loop", "torch-func-chunks", "chunks-in-turns"],
)
def test_a_counter_and_a_flag_start_every_turn_from_the_call_before(how: dict) -> None:
    grad = how.pop("grad", False)
    ens = vmapens.Ensemble(lambda: Warm().double(), n=N, seed=0, **how)
    alone = ens.unstack()
    xs = torch.randn(4, 5, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with torch.set_grad_enabled(grad):
        for x in xs:  # the warm-up ends at the third call, the flag's doubling after the first
            got = ens(x)
            for i, m in enumerate(alone):
                torch.testing.assert_close(got[i], m(x), rtol=0, atol=1e-12, msg=f"member {i}")
    assert ens.runner.calls == 4  # once per call, as each member alone
    assert [ens[i].calls for i in range(N)] == [m.calls for m in alone] == [4] * N
    assert all(ens[i].started for i in range(N))
    for i, m in enumerate(alone):  # BatchNorm's statistics: stacked, per member
        torch.testing.assert_close(ens[i].bn.running_mean, m.bn.running_mean, rtol=0, atol=1e-12)
