"""Session 47 (a): manual training loops with a stacked optimizer, against plain torch.optim.

A user starts with the loop of docs/index.md, where "any elementwise torch optimizer works on
the stack" (`torch.optim.SGD(ens.parameters(), momentum=...)`), then switches to the stacked
twin (per-member learning rates, masks) by loading the torch optimizer's state dict into it:
`vmapens.StackedSGD(ens.parameters()).load_state_dict(torch_sgd.state_dict())`. torch's SGD
keeps no step count, only the momentum buffer; a buffer present means the member has started.
Every stacked optimizer refuses a torch state dict (its counts are one per member; torch's
Adam keeps a 0-d `step`, its SGD none at all), and the refusal changes nothing. The truth for
the run around it: N plain modules (built from the same seeds), each trained alone by
`torch.optim.SGD`.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import vmapens

N, STEPS, SWITCH = 3, 4, 2


def member() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(5, 3, generator=g, dtype=torch.float64),
            torch.randn(5, 2, generator=g, dtype=torch.float64),
        )
        for _ in range(STEPS)
    ]


def plain_members() -> list[nn.Module]:
    out = []
    for i in range(N):
        torch.manual_seed(100 + i)
        out.append(member().double())
    return out


@pytest.mark.parametrize(
    "kw",
    [
        {"lr": 0.1, "momentum": 0.9},
        {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
    ],
    ids=["momentum", "nesterov"],
)
def test_a_torch_sgd_state_dict_given_to_stacked_sgd_is_refused_and_changes_nothing(
    kw: dict,
) -> None:
    # Was silent (session 47): StackedSGD took the loaded momentum buffers with a new step
    # count of 0, and its next step started each buffer again from the gradient (0.06-0.17
    # off after 4 float64 steps). Every other stacked optimizer refuses torch's 0-d `step`.
    plain = plain_members()
    ens = vmapens.Ensemble.from_modules([copy.deepcopy(m) for m in plain])
    data = batches()
    opt = torch.optim.SGD(ens.parameters(), **kw)
    for x, y in data[:SWITCH]:
        opt.zero_grad()
        ((ens(x) - y) ** 2).mean(dim=(1, 2)).sum().backward()
        opt.step()
    stacked = vmapens.StackedSGD(ens.parameters(), **kw)
    x, y = data[SWITCH]
    stacked.zero_grad()
    ((ens(x) - y) ** 2).mean(dim=(1, 2)).sum().backward()
    stacked.step()  # one step of its own: the state the refused load must leave as it is
    before = copy.deepcopy(stacked.state_dict())
    with pytest.raises(ValueError, match=r"has \['momentum_buffer'\] but no `step`.*n=3"):
        stacked.load_state_dict(opt.state_dict())
    after = stacked.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for k, state in before["state"].items():
        assert after["state"][k].keys() == state.keys()
        for name, value in state.items():
            assert torch.equal(after["state"][k][name], value), (k, name)

    # Its own state dict, saved and loaded into a fresh one, goes on as each member alone.
    again = vmapens.StackedSGD(ens.parameters(), **kw)
    again.load_state_dict(before)
    x, y = data[SWITCH + 1]
    again.zero_grad()
    ((ens(x) - y) ** 2).mean(dim=(1, 2)).sum().backward()
    again.step()
    for m in plain:  # torch's SGD, then a new one (the stacked one started its own momentum)
        for t, (x, y) in enumerate(data):
            if t in (0, SWITCH):
                alone = torch.optim.SGD(m.parameters(), **kw)
            alone.zero_grad()
            ((m(x) - y) ** 2).mean().backward()
            alone.step()
    for i, (got, want) in enumerate(zip(ens.unstack(), plain, strict=True)):
        torch.testing.assert_close(
            got.state_dict(),
            want.state_dict(),
            rtol=1e-10,
            atol=1e-12,
            msg=lambda s, i=i: f"member {i}: {s}",
        )
