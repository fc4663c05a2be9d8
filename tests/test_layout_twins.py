"""Layers whose result follows the input's memory layout (vmapens/_layout_twins.py), after a
conv fed channels-last (the input, or the weights by ``ens.to(memory_format=...)``), against
each member alone from the same RNG state (``randomness="same"``: docs/semantics.md,
"Randomness in the forward pass"):

* Dropout draws each member's mask in the member's memory order, as alone, also where the
  member's view under vmap is not dense (the member dim sits between the batch and the rest);
* GroupNorm on a channels-last input, which torch's own forward runs through a query vmap
  refuses ("NYI: querying is_contiguous inside of vmap"), gives each member's values,
  gradients and output layout (the Dropout after it then draws in memory order, as alone; a
  plain ``.contiguous()`` ran but drew another mask).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vmapens

pytestmark = pytest.mark.usefixtures("float64_default")

CL = torch.channels_last
TOL = {"rtol": 1e-9, "atol": 1e-10}
AFTER = {  # the layers after the conv
    "dropout": lambda: [nn.Dropout()],
    "dropout-inplace": lambda: [nn.Dropout(inplace=True)],
    "groupnorm": lambda: [nn.GroupNorm(2, 4), nn.Dropout()],
}


@pytest.mark.parametrize("where", ["input", "weights"])
@pytest.mark.parametrize("after", list(AFTER))
def test_layers_after_a_channels_last_conv_run_as_alone(where: str, after: str) -> None:
    def member() -> nn.Module:
        return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), *AFTER[after]())

    ens = vmapens.Ensemble(member, n=3, seed=0, randomness="same")
    x = torch.randn(2, 2, 8, 8)
    if where == "input":
        x = x.contiguous(memory_format=CL)
    else:
        ens.to(memory_format=CL)
    models, rng = ens.unstack(), torch.get_rng_state()
    out = ens(x)
    out.square().sum().backward()
    for i, m in enumerate(models):
        torch.set_rng_state(rng)
        alone = m(x)
        alone.square().sum().backward()
        assert alone.stride() == (256, 1, 32, 4)  # alone: dense channels-last, drawn so
        if after == "groupnorm":  # the twin gives the member alone's layout
            assert out[i].stride() == alone.stride(), i
        torch.testing.assert_close(out[i], alone, **TOL)
        assert torch.equal(out[i] == 0, alone == 0), i  # the same mask, element for element
        for (name, p), q in zip(ens.named_parameters(), m.parameters(), strict=True):
            torch.testing.assert_close(p.grad[i], q.grad, **TOL, msg=f"{i} {name}")
