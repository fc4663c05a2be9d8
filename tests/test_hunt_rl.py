"""vmapens.rl against plain Q-networks with plain target copies and plain torch.optim.

The truth: N plain modules, their targets by ``copy.deepcopy`` with ``requires_grad_(False)``,
soft updates as SAC/TD3 code writes them (``p_targ.mul_(1 - tau).add_(tau * p)``), hard
copies by ``load_state_dict``, buffers copied, REDQ subsets drawn by ``torch.randperm``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import vmapens
from vmapens.rl import make_target, polyak_, random_members

N, OBS = 3, 4
TOL = dict(rtol=1e-9, atol=1e-10)  # float64 throughout: batched and per-member kernels differ


def q_net() -> nn.Module:
    # No bias before BatchNorm: its true gradient is 0, and round-off would make it drift.
    return nn.Sequential(
        nn.Linear(OBS, 6, bias=False),
        nn.BatchNorm1d(6),
        nn.Tanh(),
        nn.Linear(6, 5),
        nn.LayerNorm(5),
        nn.Linear(5, 1),
    ).double()


def assert_members(ens: vmapens.Ensemble, plain: list[nn.Module], what: str) -> None:
    assert len(ens) == len(plain)
    for i, m in enumerate(plain):
        torch.testing.assert_close(ens[i].state_dict(), m.state_dict(), **TOL, msg=what)


def soft(targets: list[nn.Module], models: list[nn.Module], tau: float) -> None:
    """The textbook soft update: parameters by Polyak averaging, buffers copied."""
    with torch.no_grad():
        for t, m in zip(targets, models, strict=True):
            for pt, p in zip(t.parameters(), m.parameters(), strict=True):
                pt.mul_(1 - tau).add_(tau * p)
            for bt, b in zip(t.buffers(), m.buffers(), strict=True):
                bt.copy_(b)


def test_td_training_with_soft_and_hard_updates_follows_plain_targets() -> None:
    online = vmapens.Ensemble(q_net, n=N, seed=0)
    target = make_target(online)
    models = online.unstack()
    targets = [copy.deepcopy(m).requires_grad_(False) for m in models]
    opt = vmapens.StackedAdam(online, lr=1e-2)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in models]
    g, g_plain = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    data = torch.Generator().manual_seed(2)
    for step in range(5):
        s, s2 = (torch.randn(6, OBS, generator=data, dtype=torch.float64) for _ in range(2))
        r = torch.randn(6, 1, generator=data, dtype=torch.float64)
        # REDQ: the min over 2 random members; randperm's draw is the same subset.
        mask = random_members(N, 2, g)
        rows = torch.randperm(N, generator=g_plain)[:2]
        assert mask.nonzero().flatten().tolist() == sorted(rows.tolist())
        q_next = target(s2)[mask].amin(0)  # no no_grad: the target takes no gradient anyway
        assert not q_next.requires_grad
        with torch.no_grad():
            q_plain = torch.stack([targets[i](s2) for i in rows.tolist()]).amin(0)
        torch.testing.assert_close(q_next, q_plain, **TOL)
        loss = ((online(s) - (r + 0.9 * q_next)) ** 2).mean(dim=(1, 2)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        for m, o in zip(models, opts, strict=True):
            o.zero_grad()
            ((m(s) - (r + 0.9 * q_plain)) ** 2).mean().backward()
            o.step()
        assert all(p.grad is None for p in target.parameters())
        if step == 2:  # a hard update, as load_state_dict
            polyak_(target, online, 1.0)
            for t, m in zip(targets, models, strict=True):
                t.load_state_dict(m.state_dict())
        else:
            polyak_(target, online, 0.3)
            soft(targets, models, 0.3)
        assert_members(online, models, f"online, step {step}")
        assert_members(target, targets, f"target, step {step}")
    # A target restored by load_state_dict keeps taking no gradient, and follows again.
    target.load_state_dict(online.state_dict())
    assert not any(p.requires_grad for p in target.parameters())
    # A sub-ensemble of both, by a tensor index, follows its members as plain code does.
    rows = torch.tensor([2, 0])
    sub_target, sub_online = target[rows], online[rows]
    polyak_(sub_target, sub_online, 0.5)
    expected = [copy.deepcopy(models[i]) for i in rows.tolist()]
    assert_members(sub_target, expected, "sub-ensemble")


def test_polyak_hard_copy_replaces_nan_and_inf_as_load_state_dict_does() -> None:
    # Bug: tau=1.0, documented as a hard copy like load_state_dict, ran lerp, whose
    # `end - (end - self) * 0` kept a NaN or inf of a diverged target member.
    online = vmapens.Ensemble(q_net, n=N, seed=0)
    target = make_target(online)
    with torch.no_grad():
        target.stacked_params()["0.weight"][1, 0, 0] = float("nan")
        target.stacked_params()["3.bias"][2, 1] = float("inf")
    targets = [copy.deepcopy(target[i]) for i in range(N)]
    for t, m in zip(targets, online.unstack(), strict=True):
        t.load_state_dict(m.state_dict())
    polyak_(target, online, 1.0)
    for i in range(N):
        torch.testing.assert_close(target[i].state_dict(), targets[i].state_dict(), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        (lambda t: t.float(), r"`0\.weight` is \[3, 6, 4\] torch.float32 on cpu in `target`"),
        (lambda t: t.to("meta"), r"`0\.weight` is \[3, 6, 4\] torch.float64 on meta in `target`"),
    ],
    ids=["dtype", "device"],
)
def test_polyak_refuses_other_dtypes_or_devices_naming_the_tensor(change, pattern) -> None:
    # Bug: a target on another device reached torch's lerp_ ("Tensor on device cpu is not on
    # the expected device meta!", no API, no tensor), and another dtype was refused without
    # saying which tensor or what to do.
    online = vmapens.Ensemble(q_net, n=N, seed=0)
    target = change(make_target(online))
    before = {k: v.clone() for k, v in online.state_dict().items()}
    with pytest.raises(ValueError, match=rf"^polyak_: {pattern}.*`target\.to\(\.\.\.\)`"):
        polyak_(target, online, 0.5)
    torch.testing.assert_close(online.state_dict(), before, rtol=0, atol=0)


def test_polyak_refuses_other_tensors_and_changes_nothing() -> None:
    online = vmapens.Ensemble(q_net, n=N, seed=0)
    target = make_target(online)
    other = vmapens.Ensemble(lambda: nn.Linear(OBS, 1).double(), n=N, seed=0)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(
        ValueError, match=r"^polyak_: `target` holds `0\.weight` and `online` does not"
    ):
        polyak_(target, other, 0.5)
    for bad, error in ((1.5, ValueError), (-0.1, ValueError), (float("nan"), ValueError)):
        with pytest.raises(error, match=r"^polyak_: `tau` must be in \[0, 1\]"):
            polyak_(target, online, bad)
    torch.testing.assert_close(target.state_dict(), before, rtol=0, atol=0)


def test_random_members_refuses_a_seed_as_generator() -> None:
    # Bug: an int seed in place of a Generator failed with "'int' object has no attribute
    # 'device'", naming neither the API nor the argument.
    with pytest.raises(TypeError, match=r"^random_members: `generator` must be a torch\.Gen"):
        random_members(5, 2, 0)  # type: ignore[arg-type]
