"""A value set on ``ens.template`` after building that holds one of its tensors is refused at
the next call, with either backend, before any follower changes: the members would read the
template's ``meta`` tensor, not their own (it returned uninitialized memory)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vmapens


class _Listed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.ws = nn.Linear(2, 3, dtype=torch.float64), None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.ws[0] if self.ws else self.fc.weight).t()


@pytest.mark.parametrize("backend", ["vmap", "loop"])
def test_a_template_attribute_holding_its_tensor_is_refused(backend: str) -> None:
    ens = vmapens.Ensemble(_Listed, n=3, seed=0, backend=backend)
    x = torch.randn(4, 2, dtype=torch.float64)
    with torch.no_grad():
        want = torch.stack([m(x) for m in ens.unstack()])
    ens.template.ws = [ens.template.fc.weight]
    for _ in range(2):  # every call, until it is taken back
        with pytest.raises(
            ValueError, match=r"`ens.template.ws` holds the template's tensor `fc.weight`"
        ):
            ens(x)
    if ens.runner is not ens.template:  # vmap's runner: nothing reached it
        assert ens.runner.ws is None
    ens.template.ws = None
    with torch.no_grad():
        torch.testing.assert_close(ens(x), want, rtol=1e-12, atol=1e-12)


class _Extra(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 3, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc(x)
        return out + self.extra if hasattr(self, "extra") else out


@pytest.mark.parametrize("backend", ["vmap", "loop"])
@pytest.mark.parametrize("kind", ["parameter", "buffer"])
def test_a_tensor_registered_on_the_template_after_building_is_refused(
    backend: str, kind: str
) -> None:
    # alone, a parameter registered later is trained and saved; no member holds this one
    ens = vmapens.Ensemble(_Extra, n=3, seed=0, backend=backend)
    x = torch.randn(4, 2, dtype=torch.float64)
    with torch.no_grad():
        want = torch.stack([m(x) for m in ens.unstack()])
    extra = torch.ones(3, dtype=torch.float64)
    if kind == "parameter":
        ens.template.extra = nn.Parameter(extra)
    else:
        ens.template.register_buffer("extra", extra)
    with pytest.raises(
        ValueError, match=r"`ens.template.extra` was registered or deleted after building"
    ):
        ens(x)
    del ens.template.extra
    with torch.no_grad():
        torch.testing.assert_close(ens(x), want, rtol=1e-12, atol=1e-12)
