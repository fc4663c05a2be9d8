"""Weight normalisation (new and old style) trains in the ensemble as each member alone.

torch's fused ``_weight_norm`` kernel has no batching rule: the ensemble runs twins of the
parametrization and of the old-style hook (``vmapens/_weight_norm.py``) that write its formula
in ops vmap batches. The truth: each member a plain module with torch's own weight norm,
trained alone with torch.optim.Adam on the same batches, float64 (the fused kernel sums the
squares in another order: rounding only).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations
from truth import TOL64, assert_members_equal, seeded_members, train_each

import vmapens


def new_style(dim: int | None) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        conv = parametrizations.weight_norm(nn.Conv1d(2, 3, 3, dilation=2), dim=dim)
        head = parametrizations.weight_norm(nn.Linear(3 * 4, 2), dim=0 if dim is None else 1)
        return nn.Sequential(conv, nn.ReLU(), nn.Flatten(), head).double()

    return build


def old_style() -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch deprecates the old style
        conv = nn.utils.weight_norm(nn.Conv1d(2, 3, 3, dilation=2))
        head = nn.utils.weight_norm(nn.Linear(3 * 4, 2), dim=None)
    return nn.Sequential(conv, nn.Tanh(), nn.Flatten(), head).double()


BUILDS = {"new-dim0": new_style(0), "new-dim1-none": new_style(None), "old": old_style}
N = 3


def batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(5, 2, 8, generator=g, dtype=torch.float64),
         torch.randn(5, 2, generator=g, dtype=torch.float64))
        for _ in range(count)
    ]  # fmt: skip


@pytest.mark.parametrize("build", list(BUILDS))
def test_weight_normed_members_train_as_alone_without_a_member_loop(build: str) -> None:
    factory = BUILDS[build]
    ens = vmapens.Ensemble(factory, N, seeds=range(N))
    alone = seeded_members(factory, N)
    data = batches(3)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=0.05))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for x, y in data:
            step(x, y)
    slow = [str(w.message) for w in seen if "_weight_norm" in str(w.message)]
    assert not slow, slow  # torch's per-member fallback: "There is a performance drop ..."
    train_each(alone, data, nn.functional.mse_loss, lambda i, m: torch.optim.Adam(
        m.parameters(), lr=0.05))  # fmt: skip
    assert_members_equal(ens, alone, **TOL64)
    x = data[0][0]
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in alone]), **TOL64)
    # ens[i] is a module of the user's classes, with torch's own weight norm
    kinds = {type(h).__module__ for m in ens[1].modules() for h in m._forward_pre_hooks.values()}
    kinds |= {
        type(p).__module__
        for m in ens[1].modules()
        if hasattr(m, "parametrizations")
        for p in m.parametrizations.weight
    }
    assert kinds and all(k.startswith("torch.") for k in kinds), kinds
