"""Session 48 hunt (b): RL target updates, SWA and per-member plateaus by hand.

Each test compares against N plain modules with plain torch (``torch.optim``,
``torch.optim.lr_scheduler``, ``torch.optim.swa_utils``), one per member.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import SWALR, AveragedModel
from torch.optim.swa_utils import update_bn as torch_update_bn

import vmapens
from vmapens.optim import ReduceLROnPlateau
from vmapens.swa import update_bn

N = 3


def q_net() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 1))


def _assert_member(module: nn.Module, alone: nn.Module) -> None:
    got, want = module.state_dict(), alone.state_dict()
    assert list(got) == list(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype, k
        torch.testing.assert_close(got[k], v, rtol=0, atol=1e-12, msg=k)


def test_state_dict_soft_update_with_load_state_dict_follows_plain_targets() -> None:
    """The soft update written over state dicts (``{k: tau * o[k] + (1 - tau) * t[k]}`` then
    ``load_state_dict``, BatchNorm's integer counter included) during TD training."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        online = vmapens.Ensemble(q_net, n=N, seed=0).double()
    plain = online.unstack()
    target = copy.deepcopy(online).requires_grad_(False)
    targets = [copy.deepcopy(m).requires_grad_(False) for m in plain]
    opt = vmapens.StackedSGD(online.parameters(), lr=0.1, momentum=0.9)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in plain]
    tau = 0.3
    for _ in range(3):
        s, s2 = (torch.randn(5, 3, generator=g, dtype=torch.float64) for _ in range(2))
        r = torch.randn(5, 1, generator=g, dtype=torch.float64)
        with torch.no_grad():
            q_next = target(s2)
        loss = ((online(s) - r - 0.9 * q_next) ** 2).mean(dim=(1, 2))
        opt.zero_grad()
        loss.sum().backward()
        opt.step()
        for i, (m, t, o) in enumerate(zip(plain, targets, opts, strict=True)):
            with torch.no_grad():
                qi = t(s2)
            torch.testing.assert_close(q_next[i], qi, rtol=0, atol=1e-12)
            li = ((m(s) - r - 0.9 * qi) ** 2).mean()
            o.zero_grad()
            li.backward()
            o.step()
        tsd, osd = target.state_dict(), online.state_dict()
        target.load_state_dict({k: tau * osd[k] + (1 - tau) * tsd[k] for k in tsd})
        for t, m in zip(targets, plain, strict=True):
            tsd, osd = t.state_dict(), m.state_dict()
            t.load_state_dict({k: tau * osd[k] + (1 - tau) * tsd[k] for k in tsd})
    for i in range(N):
        _assert_member(online[i], plain[i])
        _assert_member(target[i], targets[i])
    assert not any(p.requires_grad for p in target.parameters())


def test_plateau_then_swalr_on_the_same_optimizer_as_each_member_alone() -> None:
    """Members' lrs split by vmapens's ReduceLROnPlateau, then torch's SWALR anneals each
    from its own lr to ``swa_lr``, as SWALR does on each member's own optimizer."""
    n = 3
    w = torch.zeros(n, 2, dtype=torch.float64, requires_grad=True)
    opt = vmapens.StackedSGD([w], lr=0.4)
    plateau = ReduceLROnPlateau(opt, patience=0, factor=0.5)
    alone = [torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.4) for _ in range(n)]
    plateaus = [
        torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0, factor=0.5) for o in alone
    ]
    for metrics in ([1.0, 1.0, 1.0], [2.0, 0.5, 2.0], [0.4, 3.0, 3.0]):
        plateau.step(metrics)
        for p, v in zip(plateaus, metrics, strict=True):
            p.step(v)
    lrs = [o.param_groups[0]["lr"] for o in alone]
    assert list(opt.param_groups[0]["lr"]) == lrs and len(set(lrs)) == 2
    swalr = SWALR(opt, swa_lr=0.05, anneal_epochs=3, anneal_strategy="cos")
    swalrs = [SWALR(o, swa_lr=0.05, anneal_epochs=3, anneal_strategy="cos") for o in alone]
    for _ in range(4):
        opt.step()
        swalr.step()
        for o, s in zip(alone, swalrs, strict=True):
            o.step()
            s.step()
        lr = opt.param_groups[0]["lr"]
        got = [lr] * n if isinstance(lr, float) else list(lr)
        assert got == [o.param_groups[0]["lr"] for o in alone]


class ReusedNorm(nn.Module):
    """One BatchNorm called twice per forward: two updates of its statistics per batch."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.bn = nn.BatchNorm1d(3, momentum=0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(self.bn(x)))


@pytest.mark.parametrize("options", [{}, {"chunk_size": 2}, {"backend": "loop"}])
def test_update_bn_of_a_batchnorm_called_twice_as_torch_per_member(options: dict) -> None:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        ens = vmapens.Ensemble(ReusedNorm, n=N, seed=0, **options).double()
        ens(torch.randn(4, 3, generator=g, dtype=torch.float64))  # statistics moved first
    plain = ens.unstack()
    swa, alone = AveragedModel(ens), [AveragedModel(m) for m in plain]
    loader = [
        (torch.randn(5, 3, generator=g, dtype=torch.float64), torch.zeros(5)) for _ in range(3)
    ]
    update_bn(loader, swa)
    for a in alone:
        torch_update_bn(loader, a)
    assert swa.module.get_buffer("bn.num_batches_tracked").tolist() == [6] * N
    assert swa.module.template.bn.momentum == 0.3
    for i in range(N):
        _assert_member(swa.module[i], alone[i].module)
