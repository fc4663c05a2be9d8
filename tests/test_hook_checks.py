"""`ens(x)` checks the hooks the members would not run only when a hook handle was made since
the last check passed (or the grad mode changed): a hook added after a call that passed is
refused at the next call all the same."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vmapens


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1))


class BackwardHooked(nn.Module):
    """Registers a backward hook on itself in `__init__` (runner and template have it)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 1)
        self.fc.register_full_backward_hook(lambda m, gi, go: None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


@pytest.mark.parametrize("where", ["template", "runner"])
def test_a_forward_hook_added_after_a_call_that_passed_is_refused(where: str) -> None:
    ens = vmapens.Ensemble(_mlp, n=3, seed=0)
    x = torch.randn(4, 2)
    before = ens(x)  # passes, and again: nothing new
    torch.testing.assert_close(ens(x), before)
    handle = getattr(ens, where)[2].register_forward_hook(lambda m, a, out: None)
    with pytest.raises(RuntimeError, match=rf"`ens\.{where}\.2` has a forward hook"):
        ens(x)
    with pytest.raises(RuntimeError, match="forward hook"):  # refused until removed
        ens(x)
    handle.remove()
    torch.testing.assert_close(ens(x), before)


def test_a_backward_hook_passes_without_grad_and_is_refused_with_it() -> None:
    ens = vmapens.Ensemble(BackwardHooked, n=3, seed=0)
    x = torch.randn(4, 2)
    with torch.no_grad():  # no backward follows
        ens(x)
    with pytest.raises(RuntimeError, match="backward hook"):
        ens(x)
