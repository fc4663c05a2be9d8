"""A forward that draws from numpy's global RNG: the ensemble follows torch's RNG only, so the
first step's self-check refuses it, naming numpy and torch's way (as for Python's `random`,
tests/test_journey_audio.py). Alone, each member draws its own numbers; inside the ensemble one
draw serves every member (vmap), or the members draw in turn (the loop)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import vmapens


class NumpyJitter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * (1.0 + 0.1 * float(np.random.randn()))


@pytest.mark.parametrize("how", [{}, {"backend": "loop"}], ids=["vmap", "loop"])
def test_a_numpy_draw_in_the_forward_is_refused_naming_numpy(how: dict) -> None:
    # The draws came from numpy's global state as earlier tests in the worker left it. Once
    # (a cold CI run in session 36, [loop]) nothing was refused; most likely the probe's two
    # draws came out within the self-check's tolerance of each other (not reproduced: seeds
    # 0-59 all refused, both backends). A fixed state makes the test's draws its own.
    np.random.seed(0)
    ens = vmapens.Ensemble(NumpyJitter, n=3, seed=0, **how)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1))
    with pytest.raises(RuntimeError, match=r"(?s)numpy's global RNG.*torch\.(rand|randint)"):
        step(torch.randn(4, 3), torch.randn(4, 1))
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k
