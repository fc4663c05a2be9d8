"""RAdam with weight decay given per member: each member torch.optim.RAdam's bits alone.

A per-member ``weight_decay`` sends RAdam down its per-member-column path (the shared-float
path is covered bit for bit in tests/test_optim_new.py). Torch applies L2 decay as
``grad.add(param, alpha=weight_decay)``, one rounding; ``g + p * wd`` rounds twice and moves
the moments by an ulp now and then, so this compares with ``torch.equal``, no tolerance.
"""

from __future__ import annotations

import pytest
import torch
from models import MLP
from truth import train_each, twins

import vmapens
import vmapens.optim as vo

N = 3
STEPS = 5
# No power of two among the nonzero values: p * 0.5 is exact, so it could not show a second
# rounding. Member 0 decays nothing, as a torch RAdam with weight_decay=0 skips the decay.
WEIGHT_DECAY = [0.0, 0.1, 0.3]
LR = 1e-2


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 4, generator=g), torch.randn(6, 3, generator=g)) for _ in range(STEPS)]


@pytest.mark.parametrize("decoupled", [False, True], ids=["l2", "decoupled"])
def test_per_member_weight_decay_gives_each_member_torchs_bits_alone(decoupled: bool) -> None:
    torch.manual_seed(0)
    members = [MLP() for _ in range(N)]  # float32
    data = _batches()
    # The loop backend runs each member's forward and backward with the plain module's own
    # kernels, so the gradients are the plain modules' bits and any difference is RAdam's.
    ens = vmapens.Ensemble.from_modules(twins(members), backend="loop")
    opt = vo.StackedRAdam(ens, lr=LR, weight_decay=WEIGHT_DECAY, decoupled_weight_decay=decoupled)
    for x, y in data:
        opt.zero_grad()
        ((ens(x) - y) ** 2).mean(dim=(1, 2)).sum().backward()
        opt.step()

    alone = twins(members)
    torch_opts = train_each(
        alone,
        data,
        make_opt=lambda i, m: torch.optim.RAdam(
            m.parameters(),
            lr=LR,
            weight_decay=WEIGHT_DECAY[i],
            decoupled_weight_decay=decoupled,
        ),
    )
    for i, (module, twin) in enumerate(zip(alone, torch_opts, strict=True)):
        for name, p in module.named_parameters():
            assert torch.equal(ens[i].get_parameter(name), p), (i, name)
        ours, theirs = opt.member_state_dict(i)["state"], twin.state_dict()["state"]
        assert set(ours) == set(theirs), (i, set(ours), set(theirs))
        for k, state in theirs.items():
            assert set(ours[k]) == set(state), (i, k, set(ours[k]), set(state))
            for key, value in state.items():
                assert torch.equal(ours[k][key], value), (i, k, key)
