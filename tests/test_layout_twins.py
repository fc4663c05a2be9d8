"""Dropout draws each member's mask in the member's memory order, as alone, also where the
member's view under vmap is not dense (a conv fed channels-last: the member dim sits between
the batch and the rest). With ``randomness="same"`` that is the mask the member draws alone
from the same RNG state (docs/semantics.md, "Randomness in the forward pass")."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vmapens

CL = torch.channels_last


@pytest.mark.parametrize("where", ["input", "weights"])
@pytest.mark.parametrize("inplace", [False, True])
def test_dropout_after_a_channels_last_conv_draws_each_members_own_mask(where, inplace):
    def member() -> nn.Module:
        return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.Dropout(inplace=inplace))

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
        torch.testing.assert_close(out[i], alone, rtol=1e-6, atol=1e-6)
        assert torch.equal(out[i] == 0, alone == 0), i  # the same mask, element for element
        for (name, p), q in zip(ens.named_parameters(), m.parameters(), strict=True):
            torch.testing.assert_close(p.grad[i], q.grad, rtol=1e-5, atol=1e-6, msg=name)
