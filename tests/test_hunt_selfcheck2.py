"""Hunt: the self-check itself changes nothing a user can see.

``vmapens.check`` (and the first step's probe) runs member 0 alone and inside the ensemble.
Both runs must leave the ensemble as it was: its parameters and buffers, the ``.grad`` a
previous backward left, the global RNG, and the plain attributes a forward sets on the module
all members run (a Python counter, a list it appends to), with either backend.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vmapens


class Counting(nn.Module):
    """Dropout, BatchNorm, a random op, and plain attributes its forward sets (never reads)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn, self.drop = nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Dropout(0.3)
        self.out = nn.Linear(4, 2)
        self.calls = 0
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.seen.append(x.shape[0])
        noise = torch.randn_like(x[:, :2]) * 1e-3
        return self.out(self.drop(self.bn(self.fc(x)))) + noise


def _attributes(module: nn.Module) -> tuple:
    return module.calls, list(module.seen), type(module.drop), module.training


@pytest.mark.parametrize("backend", ["vmap", "loop"])
def test_check_leaves_state_grads_rng_and_attributes_as_they_were(backend: str) -> None:
    ens = vmapens.Ensemble(lambda: Counting().double(), n=3, seed=0, backend=backend)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3, generator=g, dtype=torch.float64)
    y = torch.randn(6, 2, generator=g, dtype=torch.float64)
    vmapens.per_member(nn.MSELoss())(ens(x), y).sum().backward()  # .grad set, attributes set
    state = {k: v.clone() for k, v in ens.state_dict().items()}
    grads = {k: p.grad.clone() for k, p in ens.named_parameters()}
    template, runner = _attributes(ens.template), _attributes(ens.runner)
    rng = torch.get_rng_state()
    vmapens.check(ens, x, y, nn.MSELoss())
    assert torch.equal(torch.get_rng_state(), rng)
    for key, value in ens.state_dict().items():
        assert torch.equal(value, state[key]), key
    for key, p in ens.named_parameters():
        assert p.grad is not None and torch.equal(p.grad, grads[key]), key
    assert _attributes(ens.template) == template and _attributes(ens.runner) == runner


class VersionCached(nn.Module):
    """Caches a weight-derived tensor until ``weight._version`` changes: alone the
    optimizer's in-place update invalidates it; each member's tensors in turn read version 0,
    so member 1 would reuse member 0's cache."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.version = -1
        self.cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cache is None or self.version != self.fc.weight._version:
            self.cache, self.version = self.fc.weight.detach() * 1.0, self.fc.weight._version
        return self.fc(x) + 0.1 * (x @ self.cache.T)


@pytest.mark.parametrize("in_turns", [dict(backend="loop"), dict(chunk_size=1)])
def test_state_read_back_only_by_another_member_is_refused_in_turns(in_turns: dict) -> None:
    ens = vmapens.Ensemble(lambda: VersionCached().double(), n=3, seed=0, **in_turns)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3, generator=g, dtype=torch.float64)
    y = torch.randn(6, 2, generator=g, dtype=torch.float64)
    # Truth from plain torch: member 1 alone differs from member 1 reading member 0's cache.
    first, second = ens[0], ens[1]
    first(x)
    second.cache, second.version = first.cache, first.version
    assert not torch.allclose(second(x), ens[1](x))
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1))
    with pytest.raises(RuntimeError, match="member 1 run after member 0"):
        step(x, y)
    for key, value in ens.state_dict().items():
        assert torch.equal(value, before[key]), key
