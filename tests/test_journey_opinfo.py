"""A hunt over torch's OpInfo database (``op_db``) for vmap batching rules that are silently
wrong for some layout of per-member and shared arguments, replayed through the user's path.

Each op's samples were run under ``torch.func.vmap`` with every choice of per-member and
shared tensor arguments and member counts 2, 3 and every size in the sample's shapes, against
a loop calling the op on each member alone (torch 2.13, CPU, float64): 41,238 cases, and again
inside vmapens's rules. Two rules a forward can reach were wrong without an error:

* ``x.index_fill(dim, idx, value)`` with ``x`` shared (the input every member sees) and
  ``value`` a member's own 0-d tensor (a learned mask value): every member got the last
  member's value, in ``ens(x)`` and in training (``make_step``'s losses were other members',
  with no refusal: the self-check runs one member, where the rule is right);
* ``h.squeeze_()`` (in place, no dim) in a call with one member (``n=1``, a last chunk of one):
  the member dim was squeezed too, so ``ens(x)`` had no member axis (``[rows]`` for
  ``[1, rows]``).

And vmapens's own rule for whole-tensor ``max``/``min``/``median``/``nanmedian`` raised
``IndexError`` on a member's 0-d tensor (``self.t.max()``), where alone runs. All three are
fixed since session 35 (``vmapens/_fixed_rules.py``, ``vmapens/_tie_reductions.py``; patches
opinfo-1 to -3): these tests failed before.

The truth: each member a plain module (built after ``torch.manual_seed(k)``, as
``seeds=range(n)`` builds it) run alone. float64; only the order of sums may differ, hence TOL.
The same forwards with a per-member ``x`` (``index_fill``) or more members (``squeeze_``) are
right and pinned.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from truth import seeded_members

import vmapens

F64 = torch.float64
TOL: dict[str, Any] = {"rtol": 1e-10, "atol": 1e-12}  # float64, sums in another order


class MaskCols(nn.Module):
    """Replaces columns of the input with a learned value (per member), then a linear head;
    ``own=True`` fills the member's own activation instead of the shared input."""

    def __init__(self, own: bool = False) -> None:
        super().__init__()
        self.own = own
        self.pre = nn.Linear(4, 4, dtype=F64)
        self.lin = nn.Linear(4, 2, dtype=F64)
        self.fill = nn.Parameter(torch.randn((), dtype=F64))
        self.register_buffer("cols", torch.tensor([0, 2]))

    def forward(self, x: Tensor) -> Tensor:
        h = self.pre(x) if self.own else x
        return self.lin(h.index_fill(1, self.cols, self.fill))


class SqueezeHead(nn.Module):
    """A one-output head squeezed in place: ``[rows, 1, 1] -> [rows]``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1, dtype=F64)

    def forward(self, x: Tensor) -> Tensor:
        h = self.lin(x).unsqueeze(1)
        h.squeeze_()
        return h


class ScalarMax(nn.Module):
    """Scales a linear head by the whole-tensor ``max()`` / ``median()`` of a 0-d parameter."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.lin = nn.Linear(4, 1, dtype=F64)
        self.t = nn.Parameter(torch.randn((), dtype=F64))

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x) * getattr(self.t, self.name)()


def _check(factory: Any, n: int, **backend: Any) -> None:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(3), dtype=F64)
    ens = vmapens.Ensemble(factory, n=n, seeds=range(n), **backend)
    alone = seeded_members(factory, n)
    with torch.no_grad():
        out = ens(x)
        want = torch.stack([m(x) for m in alone])
    torch.testing.assert_close(out, want, **TOL)


@pytest.mark.parametrize("backend", [{}, {"chunk_size": 2}], ids=["vmap", "chunk2"])
def test_index_fill_of_the_shared_input_with_a_per_member_value_matches_alone(
    backend: dict,
) -> None:
    _check(MaskCols, 3, **backend)


def test_index_fill_of_the_shared_input_trains_as_alone() -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(5, 4, generator=g, dtype=F64), torch.randn(5, 2, generator=g, dtype=F64)
    ens = vmapens.Ensemble(MaskCols, n=3, seeds=range(3))
    alone = seeded_members(MaskCols, 3)
    loss = vmapens.make_step(ens, F.mse_loss, vmapens.StackedAdam(ens, lr=0.05))(x, y)
    want = [F.mse_loss(m(x), y) for m in alone]  # the first step's losses: before any update
    torch.testing.assert_close(loss, torch.stack(want).detach(), **TOL)


def test_index_fill_of_a_member_activation_with_a_per_member_value_matches_alone() -> None:
    _check(lambda: MaskCols(own=True), 3)


@pytest.mark.parametrize(
    "n, backend", [(1, {}), (3, {"chunk_size": 2})], ids=["n1", "chunk-of-one"]
)
def test_inplace_squeeze_in_a_call_with_one_member_matches_alone(n: int, backend: dict) -> None:
    _check(SqueezeHead, n, **backend)


def test_inplace_squeeze_with_several_members_matches_alone() -> None:
    _check(SqueezeHead, 3)


@pytest.mark.parametrize("name", ["max", "min", "median", "nanmedian"])
def test_whole_tensor_reduction_of_a_0d_parameter_matches_alone(name: str) -> None:
    _check(lambda: ScalarMax(name), 2)
