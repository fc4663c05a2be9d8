"""A hunt over torch's OpInfo database for vmap batching rules whose GRADIENTS are silently
wrong in the path vmapens's eager forward and step take: the forward under ``torch.func.vmap``
with tensors that require grad, ``loss.backward()`` outside it (autograd records the physical
ops the rule calls).

Each op's differentiable samples (CPU, float64, in-place variants on a clone) were run with
every choice of per-member leaves ``[n, ...]``, shared plain tensors and shared tensors that
require grad (a shared trunk's features, an input for saliency or adversarial steps), ``n`` 2,
3 and each size in the sample's shapes, against a loop over the members alone (shared grads
summed): 42,026 cases, then again inside vmapens's rules. Besides ``select_scatter``,
``padding_idx`` and whole-tensor ``max``/``min``/``median`` on ties (fixed since session 35),
three were wrong without an error, each reached here through README's loop (``ens(x)``, a
loss, ``backward()``):

* ``h.index_fill(dim, idx, value)`` with ``idx`` per member and ``value`` a shared 0-d tensor
  that requires grad (``h.mean()`` of a shared trunk's features: mean imputation of each
  member's dropped columns): ``value`` got no gradient (0 instead of alone's). Fixed in
  session 35 (``vmapens/_fixed_rules.py``, patch opgrads-1);
* ``F.embedding(ids, table, scale_grad_by_freq=True)`` with ``ids`` per member and ``table``
  shared and requiring grad: the counts were taken over all members' ids, not each member's
  (``table.grad`` 1/2 of alone's where two members pick one row). Fixed in session 35
  (``vmapens/_embedding_rules.py``, patch opgrads-2);
* ``F.linear_cross_entropy(h, w, y, options=LinearCrossEntropyOptions())`` written in a forward:
  its chunked path gave ``h`` and ``w`` no gradient in README's loop (``make_step``'s first
  step refused it). Fixed in session 36: vmapens reads the op's requires-grad flags as alone
  (``vmapens/_fixed_rules.py``); a vmap of the user's around the call keeps torch's.

The truth: each member a plain module (built after ``torch.manual_seed(k)``, as
``seeds=range(n)`` builds it) run alone on the same input, shared grads summed over members.
float64: only the order of sums may differ, hence TOL.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from truth import seeded_members

import vmapens

F64 = torch.float64
N = 3
TOL: dict[str, Any] = {"rtol": 1e-10, "atol": 1e-12}  # float64, sums in another order


class Impute(nn.Module):
    """Random-subspace head on shared features: each member fills its own dropped columns with
    the features' mean."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 2, dtype=F64)
        self.register_buffer("drop", torch.randperm(6)[:2])

    def forward(self, h: Tensor) -> Tensor:
        return self.lin(h.index_fill(1, self.drop, h.mean()))


class Codes(nn.Module):
    """Reads rows of a shared, trained table at each member's own codes."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, dtype=F64))
        self.register_buffer("ids", torch.randint(0, 4, (5,)))

    def forward(self, table: Tensor) -> Tensor:
        return F.embedding(self.ids, table, scale_grad_by_freq=True) * self.w


class ChunkedHead(nn.Module):
    """A classifier whose forward returns its loss through chunked ``F.linear_cross_entropy``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3, dtype=F64)
        self.head = nn.Linear(3, 5, bias=False, dtype=F64)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        options = nn.LinearCrossEntropyOptions()
        return F.linear_cross_entropy(torch.tanh(self.fc(x)), self.head.weight, y, options=options)


def _shared_grads(factory: Callable[[], nn.Module], shape: tuple[int, ...]) -> None:
    """``ens(s)`` on a shared ``s`` that requires grad, ``(out * w).sum().backward()``: the
    members' and ``s``'s gradients against each member alone (``s.grad`` summed)."""
    g = torch.Generator().manual_seed(0)
    s = torch.randn(*shape, generator=g, dtype=F64, requires_grad=True)
    ens = vmapens.Ensemble(factory, n=N, seeds=range(N))
    out = ens(s)
    w = torch.randn(out.shape, generator=g, dtype=F64)
    (out * w).sum().backward()
    got = s.grad
    s.grad = None
    alone = seeded_members(factory, N)
    for i, m in enumerate(alone):
        (m(s) * w[i]).sum().backward()
    for name, p in ens.named_parameters():
        for i, m in enumerate(alone):
            torch.testing.assert_close(p.grad[i], m.get_parameter(name).grad, **TOL)
    torch.testing.assert_close(got, s.grad, **TOL)


def test_index_fill_with_a_shared_value_that_requires_grad_backpropagates_as_alone() -> None:
    _shared_grads(Impute, (4, 6))


def test_embedding_scaled_by_frequency_of_a_shared_table_backpropagates_as_alone() -> None:
    _shared_grads(Codes, (4, 3))


def test_embedding_of_a_shared_table_without_scaling_backpropagates_as_alone() -> None:
    class Plain(Codes):
        def forward(self, table: Tensor) -> Tensor:
            return F.embedding(self.ids, table) * self.w

    _shared_grads(Plain, (4, 3))


@pytest.mark.parametrize("n", [1, 2, 3])
def test_chunked_functional_linear_cross_entropy_in_readmes_loop_trains_as_alone(n) -> None:
    # torch's op takes `h.requires_grad` as a flag; a member's batched `h` reported False and
    # got no gradient, silently. vmapens reads the flags as alone (vmapens/_fixed_rules.py).
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 4, generator=g, dtype=F64), torch.randint(0, 5, (6,), generator=g)
    ens = vmapens.Ensemble(ChunkedHead, n=n, seeds=range(n))
    ens(x, y).sum().backward()
    for i, m in enumerate(seeded_members(ChunkedHead, n)):
        m(x, y).backward()
        for name, p in ens.named_parameters():
            assert p.grad is not None, name
            torch.testing.assert_close(p.grad[i], m.get_parameter(name).grad, **TOL, msg=name)


@pytest.mark.parametrize("backend", ["vmap", "chunks"])
def test_chunked_functional_linear_cross_entropy_trains_as_alone(backend) -> None:
    chunks = {"chunk_size": 2} if backend == "chunks" else {}
    g = torch.Generator().manual_seed(2)
    batches = [
        ((torch.randn(6, 4, generator=g, dtype=F64), torch.randint(0, 5, (6,), generator=g)),
         torch.zeros(6, dtype=F64))
        for _ in range(3)
    ]  # fmt: skip
    ens = vmapens.Ensemble(ChunkedHead, n=3, seeds=range(3), **chunks)
    step = vmapens.make_step(ens, lambda out, _: out, vmapens.StackedAdam(ens, lr=0.05))
    for inputs, target in batches:
        step(inputs, target)
    for i, m in enumerate(seeded_members(ChunkedHead, 3)):
        opt = torch.optim.Adam(m.parameters(), lr=0.05)
        for (x, y), _ in batches:
            opt.zero_grad()
            m(x, y).backward()
            opt.step()
        for name, p in m.named_parameters():
            torch.testing.assert_close(ens.get_parameter(name)[i], p, **TOL, msg=name)


def test_chunked_functional_linear_cross_entropy_in_a_users_vmap_keeps_torchs_rule() -> None:
    # Alone, a vmap the user writes around the op runs torch's rule (its flags False, no
    # gradient for `h`): the member inside the ensemble must do the same, not more.
    class Vmapped(ChunkedHead):
        def forward(self, x: Tensor, y: Tensor) -> Tensor:
            return torch.func.vmap(super().forward, in_dims=(0, 0))(x, y).sum()

    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(2, 6, 4, generator=g, dtype=F64), torch.randint(0, 5, (2, 6), generator=g)
    ens = vmapens.Ensemble(Vmapped, n=2, seeds=range(2))
    ens(x, y).sum().backward()
    for i, m in enumerate(seeded_members(Vmapped, 2)):
        m(x, y).backward()
        for name, p in m.named_parameters():
            got = ens.get_parameter(name).grad
            if p.grad is None:
                assert got is None or not got[i].any(), name
            else:
                assert got is not None, name
                torch.testing.assert_close(got[i], p.grad, **TOL, msg=name)
