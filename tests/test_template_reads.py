"""A `loss_fn` that reads `ens.template`'s tensors (an L2 penalty written as over
`model.parameters()` in a plain loop) is refused with what happened and the ways out: the
template is on meta and holds no values. Before, the step said "a member's forward or loss
failed (Tensor on device meta ...)" and pointed at vmap and the member's forward.

Truth: nothing changes (the parameters, the optimizer's state) where the refusal is made."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vmapens


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


_READS: dict[str, Callable[[vmapens.Ensemble], torch.Tensor]] = {
    "weight": lambda ens: ens.template[0].weight.pow(2).sum(),
    "all parameters": lambda ens: sum(p.pow(2).sum() for p in ens.template.parameters()),
    "a value": lambda ens: torch.tensor(ens.template[2].bias.abs().max().item()),
}


@pytest.mark.parametrize("read", sorted(_READS))
@pytest.mark.parametrize(
    ("kwargs", "step_kwargs"),
    [({}, {}), ({"backend": "loop"}, {}), ({"chunk_size": 2}, {}), ({}, {"check": False})],
    ids=["vmap", "loop", "chunks", "unchecked"],
)
def test_a_loss_reading_the_template_is_refused_and_changes_nothing(
    read: str, kwargs: dict[str, object], step_kwargs: dict[str, object]
) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(5, 3), torch.randn(5, 1)
    ens = vmapens.Ensemble(_mlp, 3, seed=0, **kwargs)
    opt = vmapens.optim.StackedAdam(ens, lr=0.1)
    before = {k: v.clone() for k, v in ens.stacked_params().items()}

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, target) + 1e-3 * _READS[read](ens)

    step = vmapens.make_step(ens, loss_fn, opt, **step_kwargs)
    with pytest.raises(RuntimeError, match=r"`loss_fn` read a tensor of `ens\.template`") as info:
        step(x, y)
    assert "ens.stacked_params()" in str(info.value) and "meta" in str(info.value)
    for k, v in ens.stacked_params().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    assert opt.state_dict()["state"] == {}


def test_fit_refuses_it_too() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    ens = vmapens.Ensemble(_mlp, 2, seed=0)
    before = {k: v.clone() for k, v in ens.stacked_params().items()}

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, target) + ens.template[2].bias.sum()

    with pytest.raises(RuntimeError, match=r"`loss_fn` read a tensor of `ens\.template`"):
        vmapens.fit(ens, (x, y), loss_fn=loss_fn, epochs=1, progress=False)
    for k, v in ens.stacked_params().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


def test_a_forward_that_fails_alone_on_meta_is_not_called_a_template_read() -> None:
    """The forward's own failure keeps its own message (the case is the loss's only)."""

    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) + torch.ones(1, device="meta")

    ens = vmapens.Ensemble(Broken, 2, seed=0)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.optim.StackedSGD(ens, lr=0.1))
    with pytest.raises(RuntimeError) as info:
        step(torch.randn(4, 3), torch.randn(4, 1))
    assert "ens.template" not in str(info.value)


def test_a_template_parameters_grad_is_refused_while_the_members_hold_one() -> None:
    """``p.grad`` over ``ens.template.parameters()`` (a plain model's logging, ``zero_grad``,
    a torch optimizer) read None while the members held gradients: refused then, None again
    after ``ens.zero_grad()``; ``.half()`` after a backward (``nn.Module._apply`` reads it)
    is refused at the next call as before, naming the write."""
    ens = vmapens.Ensemble(_mlp, 2, seed=0)
    x = torch.randn(4, 3)
    assert all(p.grad is None for p in ens.template.parameters())  # no gradient yet
    ens(x).sum().backward()
    for p in ens.template.parameters():
        with pytest.raises(RuntimeError, match=r"ens\.template: .*ens\.parameters\(\)"):
            _ = p.grad
    ens.zero_grad()
    assert all(p.grad is None for p in ens.template.parameters())
    ens(x).sum().backward()
    ens.template.half()
    with pytest.raises(ValueError, match=r"`ens\.template\.0\.weight` was written in place"):
        ens(x)
