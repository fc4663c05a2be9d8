"""A mapped argument (``in_dims=0``) holds tensors with a member dim, or ``None`` (shared, as
an LSTM's ``hx=None``); a number there is refused naming the argument, with either backend
and with chunks, where torch.func, the loop and the chunks each raised their own words."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vmapens


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2, dtype=torch.float64)

    def forward(self, x: torch.Tensor, pair: tuple) -> torch.Tensor:
        return self.fc(x) * pair[0] + pair[1]


@pytest.mark.parametrize("options", [{}, {"backend": "loop"}, {"chunk_size": 2}])
def test_a_number_in_a_mapped_argument_is_refused_naming_it(options: dict) -> None:
    ens = vmapens.Ensemble(_Scaled, n=3, seed=0, **options)
    xs, z = torch.randn(3, 4, 2, dtype=torch.float64), torch.randn(3, 4, 2, dtype=torch.float64)
    with pytest.raises(
        ValueError, match=r"^Ensemble: argument 1 is mapped with in_dims=0 but holds a float"
    ):
        ens(xs, (z, 3.0), in_dims=0)

    # the way out the message gives: the number in an argument of its own, shared
    class _Split(_Scaled):
        def forward(self, x: torch.Tensor, z: torch.Tensor, c: float) -> torch.Tensor:
            return self.fc(x) * z + c

    split = vmapens.Ensemble(_Split, n=3, seed=0, **options)
    got = split(xs, z, 3.0, in_dims=(0, 0, None))
    with torch.no_grad():
        want = torch.stack([m(xs[i], z[i], 3.0) for i, m in enumerate(split.unstack())])
    torch.testing.assert_close(got.detach(), want, rtol=1e-12, atol=1e-12)
