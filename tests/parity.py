"""The parity check several journeys run: an ensemble against its members trained alone.

`truth.py` holds the plain-PyTorch side and imports nothing of vmapens; this module puts the
ensemble's side (`ens(x)`, `vmapens.make_step`) next to it, so the journeys that check a
forward and two training steps write it once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from truth import assert_members_equal

import vmapens

Batches = list[tuple[Tensor, Tensor]]


def training_state(ens: vmapens.Ensemble, opt: torch.optim.Optimizer) -> list[Tensor]:
    """Copies of everything a step writes: the stacked parameters and buffers, then every
    tensor of the optimizer's state (a refused step must leave them all as they were)."""
    tensors = [t.clone() for t in ens.stacked_state().values()]
    for s in opt.state.values():
        tensors += [t.clone() for t in s.values() if isinstance(t, Tensor)]
    return tensors


def assert_refused_changing_nothing(
    step: Callable[..., Any],
    batch: tuple[Tensor, Tensor],
    ens: vmapens.Ensemble,
    opt: vmapens.StackedOptimizer,
    exc: type[BaseException],
    match: str,
) -> None:
    """`step(*batch)` raises `exc` matching `match`, and leaves everything a step writes
    (`training_state`, with the optimizer's state made first) and the global RNG as they were."""
    opt.prepare()  # the state the step creates before its graph runs
    before, rng = training_state(ens, opt), torch.get_rng_state()
    with pytest.raises(exc, match=match):
        step(*batch)
    for a, b in zip(before, training_state(ens, opt), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(rng, torch.get_rng_state())


def forward_and_steps_as_alone(
    ens: vmapens.Ensemble,
    alone: Sequence[nn.Module],
    x: Tensor,
    batches: Callable[[Tensor], Batches],
    **tol: Any,
) -> None:
    """`ens(x)` under `torch.no_grad()` in train mode (what an evaluation or a warm-up runs)
    against each member alone: outputs, then states (the buffers the forward wrote). Then one
    `make_step` step per batch of `batches(want)` (`want`: the members' stacked outputs) with
    `StackedAdam(lr=0.05)` on `F.mse_loss` against `torch.optim.Adam(lr=0.05)` alone: losses,
    then states and gradients."""
    with torch.no_grad():
        out = ens(x)
        want = torch.stack([m(x) for m in alone])
    torch.testing.assert_close(out, want, **tol)
    assert_members_equal(ens, alone, **tol)
    steps_as_alone(ens, alone, batches(want), **tol)


def steps_as_alone(
    ens: vmapens.Ensemble, alone: Sequence[nn.Module], batches: Batches, **tol: Any
) -> None:
    """One `make_step` step per `(x, y)` of `batches` with `StackedAdam(lr=0.05)` on
    `F.mse_loss` against `torch.optim.Adam(lr=0.05)` on each member alone: losses, then
    states and gradients."""
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedAdam(ens, lr=0.05))
    opts = [torch.optim.Adam(m.parameters(), lr=0.05) for m in alone]
    for xb, yb in batches:
        loss = step(xb, yb)
        want_loss = []
        for m, opt in zip(alone, opts, strict=True):
            opt.zero_grad()
            value = F.mse_loss(m(xb), yb)
            value.backward()
            opt.step()
            want_loss.append(value.detach())
        torch.testing.assert_close(loss, torch.stack(want_loss), **tol)
    assert_members_equal(ens, alone, grads=True, **tol)


def refused_naming_the_loop(
    ens: vmapens.Ensemble, x: Tensor, y: Tensor, says: str, says_in_step: bool = False
) -> None:
    """`ens(x)` and a `make_step` step both refuse with a RuntimeError that names
    `backend='loop'` (`ens(x)`'s starting "Ensemble:" and holding `says`; the step's starting
    "step:", holding `says` too with `says_in_step`), and neither changes the state dict."""
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    with pytest.raises(RuntimeError, match="backend='loop'") as err:
        ens(x)
    assert says in str(err.value) and str(err.value).startswith("Ensemble:")
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedAdam(ens, lr=0.05))
    with pytest.raises(RuntimeError, match="backend='loop'") as err:
        step(x, y)
    assert str(err.value).startswith("step:")
    if says_in_step:
        assert says in str(err.value)
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k  # nothing changed
