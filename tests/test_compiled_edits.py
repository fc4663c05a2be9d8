"""The compiled step on a forward that edits the batch in place (``x.mul_(2)``).

Before its first call of each graph the compiled step runs member 0 eagerly to learn which
parameters get a gradient (``_compiled_step.no_gradient``). That run edited the user's batch too,
so the graph then saw ``4 * x`` and every member stepped from the wrong input, without an
error, with or without the self-check. The truth: each member trained alone with
``torch.optim.SGD`` on its own copy of the batch, which its forward edits once.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from truth import assert_members_equal, train_alone

import vmapens

N, STEPS = 3, 2


class Doubles(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return self.fc(x)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, 3, generator=g, dtype=torch.float64), torch.randn(
        6, 2, generator=g, dtype=torch.float64
    )


@pytest.mark.parametrize("check", [True, False], ids=["check", "no-check"])
def test_one_run_for_all_members_edits_the_batch_once_as_alone(check: bool) -> None:
    ens = vmapens.Ensemble(Doubles, n=N, seed=0).double()
    alone = ens.unstack()
    opt = vmapens.optim.StackedSGD(ens, lr=0.1)
    step = vmapens.make_step(ens, nn.functional.mse_loss, opt, compile=True, check=check)
    x, y = _batch()
    for _ in range(STEPS):
        batch = x.clone()
        step(batch, y)
        torch.testing.assert_close(batch, 2 * x, rtol=0, atol=0)  # once, as by one member
    for m in alone:
        train_alone(
            m,
            [(x.clone(), y) for _ in range(STEPS)],
            make_opt=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        )
    assert_members_equal(ens, alone)


def test_chunks_in_turns_are_refused_without_the_self_check_and_nothing_changes() -> None:
    # chunk_size=2 of 3: the graph runs two chunks on one batch; the second would see the
    # first's edit. The self-check refused it; with check=False nothing did.
    ens = vmapens.Ensemble(Doubles, n=N, seed=0, chunk_size=2).double()
    before = {k: v.clone() for k, v in ens.stacked_state().items()}
    opt = vmapens.optim.StackedSGD(ens, lr=0.1)
    step = vmapens.make_step(ens, nn.functional.mse_loss, opt, compile=True, check=False)
    x, y = _batch()
    batch = x.clone()
    with pytest.raises(RuntimeError, match=r"^step: the forward or loss of Doubles edits") as err:
        step(batch, y)
    assert "chunk_size=2" in str(err.value) and "Nothing was changed" in str(err.value)
    torch.testing.assert_close(batch, x, rtol=0, atol=0)
    for name, value in ens.stacked_state().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0, msg=name)
    assert not opt.state
