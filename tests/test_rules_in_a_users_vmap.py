"""vmapens's own vmap rules act at the ensemble's vmap level only.

A member whose forward runs a `torch.func.vmap` of its own gets torch's batching rules there
when it runs alone. vmapens replaces some of torch's rules inside the ensemble's calls (ties of
a whole-tensor max, indexed writes and reads, `select_scatter`'s gradient, per-member
embedding ids); at the user's own level it must keep torch's, or the member would compute
otherwise than alone. The truth: each member a plain module (built after
`torch.manual_seed(k)`) run alone, its `backward()` gradients and outputs; float64.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn
from truth import assert_grads_equal, seeded_members

import vmapens

F64 = torch.float64
N = 3


class OwnVmap(nn.Module):
    """A forward that maps a per-row function over its batch with its own vmap."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.w = nn.Parameter(torch.ones(3, dtype=F64))  # equal in every member: ties
        self.v = nn.Parameter(torch.randn(2, 3, dtype=F64))

    def row(self, r: Tensor) -> Tensor:
        if self.kind == "tie":  # alone under the user's vmap: torch's rule, no tie split
            return torch.max(r * self.w).expand(3)
        t = (self.v[:, :, None].expand(2, 3, 2) * r.sum()).clone()  # per row of the user's vmap
        ar = torch.arange(2)  # as many slots as the user's vmap has rows
        t[ar, :, ar] = r * self.w  # indices apart: torch's rule under the user's vmap, alone too
        return t.flatten()[:3]

    def forward(self, x: Tensor) -> Tensor:
        return torch.func.vmap(self.row)(x)


@pytest.mark.parametrize("kind", ["tie", "write"])
def test_a_users_own_vmap_inside_a_forward_keeps_torchs_rules_as_alone(kind: str) -> None:
    def factory() -> Any:
        return OwnVmap(kind)

    x = torch.tensor([[1.0, 1.0, 0.5], [2.0, 0.0, 2.0]], dtype=F64)  # tied maxima
    ens = vmapens.Ensemble(factory, n=N, seeds=range(N))
    alone = seeded_members(factory, N)
    out = ens(x)
    out.pow(2).sum().backward()
    want = []
    for m in alone:
        y = m(x)
        y.pow(2).sum().backward()
        want.append(y.detach())
    torch.testing.assert_close(out.detach(), torch.stack(want))
    assert_grads_equal(ens, alone)
