"""`t[..., idx, ...] = v` in a member's forward, every layout of the indexed dims, as alone.

Alone, torch lays the dims that advanced indices select where the indices stood when they are
adjacent (`t[:, i, j] = v` writes `v` as `[t.shape[0], len(i), ...]`), and first otherwise
(`t[:, i, :, j] = v` writes `v` as `[len(i), t.shape[0], t.shape[2]]`). torch's vmap rule for
the in-place `index_put_` got two of these layouts wrong (vmapens/_index_rules.py): indices
not adjacent, and adjacent but not first with an index that differs by member. It raised a
shape mismatch, or, where the shapes agreed, wrote other members' values, silently.

The module below writes into a clone of its activations: an index per member (a buffer drawn
in `__init__`) or shared (`torch.arange`), a value per member (a parameter, which trains
through the write) or shared (a constant), assigned (`t[index] = v`) or added (`t[index] += v`:
a read, then a write). The truth: each member a plain module built after
`torch.manual_seed(k)` (as `seeds=range(n)` builds it) run alone, `ens(x)` under
`torch.no_grad()`, and two `make_step` steps against `torch.optim.Adam` alone. float64: only
the order of sums may differ.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from parity import forward_and_steps_as_alone
from torch import Tensor, nn
from truth import seeded_members

import vmapens

F64 = torch.float64
TOL: dict[str, Any] = {"rtol": 1e-10, "atol": 1e-12}
SHAPE = (3, 4, 5, 2)  # the tensor written into, per member
B = 4  # batch rows

# name: the dims indexed; every other dim up to the last indexed one is a slice
LAYOUTS = {
    "first": (0,),  # adjacent, first: torch's rule was right
    "second": (1,),  # adjacent, not first
    "middle-pair": (1, 2),
    "apart": (0, 2),  # not adjacent
    "apart-last": (1, 3),
    "three-apart": (0, 1, 3),
}


class Writer(nn.Module):
    def __init__(self, dims: tuple[int, ...], own_index: bool, own_value: bool, add: bool) -> None:
        super().__init__()
        self.dims, self.own_index, self.add = dims, own_index, add
        self.slots = 2
        self.fc = nn.Linear(3, math.prod(SHAPE), dtype=F64)
        for d in dims:  # drawn per member
            self.register_buffer(f"idx{d}", torch.randperm(SHAPE[d])[: self.slots].clone())
        self.value = nn.Parameter(torch.randn(self._block(), dtype=F64)) if own_value else None

    def _block(self) -> tuple[int, ...]:
        """The shape alone gives `t[index]`: the indexed dims where the indices stood when
        adjacent, else first (torch's advanced-indexing rule, written out)."""
        first, last = self.dims[0], self.dims[-1]
        rest = [SHAPE[d] for d in range(len(SHAPE)) if d not in self.dims]
        if list(self.dims) == list(range(first, last + 1)):
            return (*SHAPE[:first], self.slots, *SHAPE[last + 1 :])
        return (self.slots, *rest)

    def forward(self, x: Tensor) -> Tensor:
        t = self.fc(x).mean(0).view(SHAPE).clone()
        index: list[Any] = [slice(None)] * (self.dims[-1] + 1)
        for d in self.dims:
            index[d] = getattr(self, f"idx{d}") if self.own_index else torch.arange(self.slots)
        value = self.value if self.value is not None else torch.tensor(0.5, dtype=F64)
        if self.add:
            t[tuple(index)] += value
        else:
            t[tuple(index)] = value
        return x.sum(1, keepdim=True) * t.flatten()


CASES = [
    pytest.param(layout, own_index, own_value, add, id=f"{layout}-{i}{v}{a}")
    for layout in LAYOUTS
    for own_index, i in ((True, "own-index"), (False, "shared-index"))
    for own_value, v in ((True, "-own-value"), (False, "-shared-value"))
    for add, a in ((False, ""), (True, "-add"))
    if own_index or own_value  # a shared index and value write the same in every member
]


@pytest.mark.parametrize(("layout", "own_index", "own_value", "add"), CASES)
@pytest.mark.parametrize("n", [3, 2])  # 2: the members as many as the slots
def test_an_indexed_write_gives_each_member_its_own_result_as_alone(
    layout: str, own_index: bool, own_value: bool, add: bool, n: int
) -> None:
    def factory() -> Writer:
        return Writer(LAYOUTS[layout], own_index, own_value, add)

    ens = vmapens.Ensemble(factory, n=n, seeds=range(n))
    alone = seeded_members(factory, n)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, 3, dtype=F64, generator=g)

    def batches(want: Tensor) -> list[tuple[Tensor, Tensor]]:
        return [
            (
                torch.randn(B, 3, dtype=F64, generator=g),
                torch.randn(*want.shape[1:], dtype=F64, generator=g),
            )
            for _ in range(2)
        ]

    forward_and_steps_as_alone(ens, alone, x, batches, **TOL)


class Spelled(nn.Module):
    """Other spellings of a per-member index after a slice (a MoCo queue's `[:, idx]`)."""

    def __init__(self, spelling: str) -> None:
        super().__init__()
        self.spelling = spelling
        self.register_buffer("idx", torch.randperm(4)[:3].clone())
        self.register_buffer("queue", torch.zeros(4, 3, 4, dtype=F64))
        self.w = nn.Parameter(torch.randn(4, 3, 3, dtype=F64))

    def forward(self, x: Tensor) -> Tensor:
        t = (x.sum() + self.w.sum()) * torch.ones(4, 3, 4, dtype=F64)
        idx, w = self.idx, self.w
        if self.spelling == "ellipsis":
            t[..., idx] = w
        elif self.spelling == "step":
            t[::2, :, idx] = w[::2]
        elif self.spelling == "int":
            t[0, :, idx] = w[0]
        elif self.spelling == "add":
            t[:, :, idx] += w
        else:  # a buffer written under no_grad, read by the output
            with torch.no_grad():
                self.queue[:, :, idx] = w
            t = t + self.queue
        return t.flatten()


@pytest.mark.parametrize("spelling", ["ellipsis", "step", "int", "add", "buffer"])
@pytest.mark.parametrize("n", [3, 4])  # 3: as many as the slots; 4: as the first dim
def test_other_spellings_of_an_index_after_a_slice_write_as_alone(spelling: str, n: int) -> None:
    ens = vmapens.Ensemble(lambda: Spelled(spelling), n=n, seeds=range(n))
    alone = seeded_members(lambda: Spelled(spelling), n)
    x = torch.randn(B, 3, dtype=F64)
    with torch.no_grad():
        got = ens(x)
        want = torch.stack([m(x) for m in alone])
    torch.testing.assert_close(got, want, **TOL)
    for i, m in enumerate(alone):
        torch.testing.assert_close(ens[i].queue, m.queue, **TOL, msg=f"member {i}")


def test_outside_the_ensemble_torch_own_rule_runs() -> None:
    # the rule is vmapens's inside its calls only: a bare torch.func.vmap in the same process
    # gets torch's rule, as in a process without vmapens (here its shape mismatch)
    vmapens.Ensemble(lambda: Writer((0, 2), False, True, False), n=2)(torch.randn(B, 3, dtype=F64))
    t, v = torch.zeros(3, *SHAPE), torch.randn(3, 2, 4, 2)
    ar = torch.arange(2)

    def write(t: Tensor, v: Tensor) -> Tensor:
        t = t.clone()
        t[ar, :, ar] = v
        return t

    with pytest.raises(RuntimeError, match="shape mismatch"):
        torch.func.vmap(write)(t, v)
