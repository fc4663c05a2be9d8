"""What the compiled step leaves in ``.grad``: this step's gradients, as ``loss.backward()``
and the eager step leave them.

The compiled step computes its gradients with ``torch.func`` inside the graph and never set
``.grad``: after ``fit(compile="auto")`` switched over, ``.grad`` kept the last eager step's
gradients for good, and a gradient-norm logger read them without an error. Truth: plain
modules trained alone with ``torch.optim`` (their ``.grad`` after each ``opt.step()``, clipped
by ``clip_grad_norm_`` as the step's ``clip_grad_norm`` clips).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from truth import TOL64

import vmapens

N, STEPS, CLIP = 3, 3, 0.5


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(5, 3, generator=g, dtype=torch.float64),
         torch.randn(5, 2, generator=g, dtype=torch.float64))
        for _ in range(STEPS)
    ]  # fmt: skip


@pytest.mark.parametrize("check", [True, False], ids=["check", "no-check"])
def test_each_compiled_step_leaves_its_clipped_gradients_in_grad(check: bool) -> None:
    ens = vmapens.Ensemble(_mlp, n=N, seed=0).double()
    alone = ens.unstack()
    for m in alone:
        m[0].bias.requires_grad_(False)
    stacked = dict(ens.named_parameters())
    stacked["0.bias"].requires_grad_(False)  # frozen in every member, as in the modules
    opt = vmapens.optim.StackedAdam(ens, lr=0.05)
    step = vmapens.make_step(
        ens, nn.functional.mse_loss, opt, compile=True, check=check, clip_grad_norm=CLIP
    )
    opts = [
        torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=0.05) for m in alone
    ]
    stale = torch.zeros_like(stacked["2.weight"])
    stacked["2.weight"].grad = stale  # the step replaces what was there
    for x, y in _batches():
        step(x, y)
        for m, o in zip(alone, opts, strict=True):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP)
            o.step()
        for name, p in ens.named_parameters():
            if not p.requires_grad:
                assert p.grad is None, name
                continue
            assert p.grad is not None, name
            want = torch.stack([m.get_parameter(name).grad for m in alone])
            torch.testing.assert_close(p.grad, want, **TOL64, msg=name)
    assert stacked["2.weight"].grad is not stale
