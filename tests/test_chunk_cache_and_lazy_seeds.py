"""``parametrize.cached()`` with ``chunk_size``: each chunk of members computes its own
parametrized tensors, as each member alone does. ``Ensemble(seed=...)`` leaves the seed the
caller queued for a CUDA device not yet initialized (``torch.manual_seed``'s lazy seed)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.utils.parametrizations as P
from torch import nn
from torch.nn.utils import parametrize

import vmapens
import vmapens._members as members


def _member() -> nn.Module:
    return nn.Sequential(P.orthogonal(nn.Linear(4, 4)), nn.Tanh(), nn.Linear(4, 2)).double()


@pytest.mark.parametrize(("n", "chunk_size"), [(4, 2), (3, 2), (4, 1)])
def test_cached_parametrizations_per_chunk_equal_each_member_alone(n: int, chunk_size: int) -> None:
    ens = vmapens.Ensemble(_member, n=n, seeds=range(n), chunk_size=chunk_size)
    x = torch.randn(5, 4, dtype=torch.float64)
    with torch.no_grad():
        alone = torch.stack([m(x) for m in ens.unstack()])
        with parametrize.cached():
            together = ens(x)
    torch.testing.assert_close(together, alone, rtol=1e-12, atol=1e-12)


def _queued_seed() -> object:
    tracker = torch.cuda._lazy_seed_tracker
    call = tracker.manual_seed_all_cb
    return None if call is None else call[0].__closure__[0].cell_contents  # the seed it holds


def test_the_callers_queued_cuda_seed_survives_a_seeded_build(monkeypatch) -> None:
    if torch.cuda.is_initialized():
        pytest.skip("the lazy seed exists only before CUDA is initialized")
    # As on a machine with an accelerator: every member is seeded with torch.manual_seed,
    # which queues its seed for CUDA; fork_rng gives back initialized devices only.
    monkeypatch.setattr(members, "_accelerators", lambda: True)
    torch.manual_seed(123)
    assert _queued_seed() == 123
    vmapens.Ensemble(lambda: nn.Linear(2, 2), n=3, seed=0)
    assert _queued_seed() == 123
