"""Members of different sizes, second hunt: cases against members trained alone.

The truth is each member built by its own factory and trained alone with ``torch.optim``
(float64: padding adds exact zeros, only the order of the sums differs).
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from truth import assert_members_equal, factory_members, train_alone

import vmapens

EXACT = dict(rtol=0.0, atol=1e-12)

pytestmark = pytest.mark.usefixtures("float64_default")


class SigmoidNorm(nn.Module):
    """A padded unit's activation is sigmoid(0) = 0.5, and BatchNorm's running mean sees it."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(3, hidden), nn.Sigmoid(), nn.BatchNorm1d(hidden), nn.Linear(hidden, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@pytest.mark.parametrize(
    "options,compiled",
    [({}, False), ({"backend": "loop"}, False), ({"chunk_size": 1}, False), ({}, True)],
    ids=["vmap", "loop", "chunks", "compiled"],
)
def test_batchnorm_after_a_padded_unit_keeps_its_state_dict_and_file_loadable(
    tmp_path, options, compiled
):
    """The padded channels' running mean drifted to 0.05 (0.1 * sigmoid(0)): each member was
    right, but the ensemble's own state dict and checkpoint were refused on load as "a state
    dict of members of other sizes"."""
    factories = [functools.partial(SigmoidNorm, h) for h in (4, 6, 5)]
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 3, generator=g), torch.randn(8, 1, generator=g)
    ens = vmapens.Ensemble.from_factories(factories, seed=0, **options)
    opt = vmapens.StackedAdam(ens, lr=0.02, weight_decay=0.1)
    step = vmapens.make_step(ens, nn.MSELoss(), opt, clip_grad_norm=0.5, compile=compiled)
    for _ in range(3):
        step(x, y)
    alone = factory_members(factories)
    for m in alone:
        clip = functools.partial(nn.utils.clip_grad_norm_, max_norm=0.5)
        train_alone(
            m, [(x, y)] * 3, make_opt=torch.optim.Adam(m.parameters(), 0.02, weight_decay=0.1),
            clip=clip,
        )  # fmt: skip
    assert_members_equal(ens, alone, **EXACT)

    copy = vmapens.Ensemble.from_factories(factories, seed=1, **options)
    copy.load_state_dict(ens.state_dict())  # refused before the fix
    assert_members_equal(copy, alone, **EXACT)
    vmapens.save(ens, tmp_path / "ens.pt")
    assert_members_equal(vmapens.load(tmp_path / "ens.pt", factories), alone, **EXACT)
    ens.eval()
    alone_out = torch.stack([m.eval()(x) for m in alone])
    torch.testing.assert_close(ens(x), alone_out, **EXACT)
