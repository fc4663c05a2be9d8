"""User journey: workload B as RL people train it, against the naive loop in plain PyTorch.

A Q-ensemble of 8 heads ``Linear(16, 32) -> Tanh -> Linear(32, 4)`` (float64) trained on TD
targets from a target ensemble that follows it by Polyak averaging: each head on its own
bootstrap mask of the batch (``in_dims=0``), its loss on Q(s, a) gathered by action indices,
per-member gradient clipping, Adam with one learning rate per member and a scheduler, two
members frozen mid-run by the step's mask, then the best half kept (``ens.select`` or
``best_k``, a member kept twice too) and trained on with ``opt.select``; acting by the mean
over heads. The truth: 8 plain heads, each with its own ``torch.optim.Adam`` and scheduler, a
``copy.deepcopy`` target, ``clip_grad_norm_``/``clip_grad_value_``, the same data, float64.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

import vmapens
from vmapens.rl import make_target, polyak_

N, B, S, A = 8, 12, 16, 4
GAMMA, TAU, MAX_NORM, MAX_VALUE = 0.9, 0.1, 0.5, 0.05
TOL = dict(rtol=1e-9, atol=1e-10)  # float64: batched and per-member kernels sum in other orders
LRS = torch.logspace(-3, -2, N, dtype=torch.float64)
FROZEN = [1, 5]


def head() -> nn.Module:
    return nn.Sequential(nn.Linear(S, 32), nn.Tanh(), nn.Linear(32, A)).double()


def td_loss(q: Tensor, t: dict[str, Tensor]) -> Tensor:
    """One member: q [B, A]; the TD target, action and bootstrap weight of each row."""
    q_a = q.gather(-1, t["a"].unsqueeze(-1)).squeeze(-1)
    w = t["w"]
    return (w * (q_a - t["y"]) ** 2).sum() / w.sum().clamp(min=1)


class Plain:
    """The naive loop: plain heads, each with its own Adam, scheduler and deepcopy target."""

    def __init__(self, heads: list[nn.Module], clip: str) -> None:
        self.heads = heads
        self.targets = [copy.deepcopy(h).requires_grad_(False) for h in heads]
        self.opts = [
            torch.optim.Adam(h.parameters(), lr=float(lr)) for h, lr in zip(heads, LRS, strict=True)
        ]
        self.scheds = [torch.optim.lr_scheduler.ExponentialLR(o, 0.9) for o in self.opts]
        self.clip = clip

    def td_targets(self, r: Tensor, s2: Tensor) -> Tensor:
        with torch.no_grad():
            return torch.stack([r + GAMMA * t(s2).amax(-1) for t in self.targets])

    def step(self, i: int, s: Tensor, t: dict[str, Tensor]) -> Tensor:
        h, o = self.heads[i], self.opts[i]
        o.zero_grad()
        loss = td_loss(h(s), t)
        loss.backward()
        if self.clip == "norm":
            torch.nn.utils.clip_grad_norm_(h.parameters(), MAX_NORM)
        else:
            torch.nn.utils.clip_grad_value_(h.parameters(), MAX_VALUE)
        o.step()
        return loss.detach()

    def end_step(self) -> None:
        for sched in self.scheds:  # one schedule in time for all, as the ensemble's scheduler
            sched.step()
        with torch.no_grad():
            for t, h in zip(self.targets, self.heads, strict=True):
                for pt, p in zip(t.parameters(), h.parameters(), strict=True):
                    pt.lerp_(p, TAU)

    def keep(self, rows: list[int]) -> None:
        """The kept heads, a head kept twice as two independent copies."""
        heads, opts, scheds = [], [], []
        for i in rows:
            h = copy.deepcopy(self.heads[i])
            o = torch.optim.Adam(h.parameters(), lr=1.0)
            # deepcopy: torch's load_state_dict keeps the source's moment tensors (`.to` of
            # the same dtype is the same tensor), so two copies would share them.
            o.load_state_dict(copy.deepcopy(self.opts[i].state_dict()))
            sched = torch.optim.lr_scheduler.ExponentialLR(o, 0.9)
            sched.load_state_dict(self.scheds[i].state_dict())
            heads.append(h), opts.append(o), scheds.append(sched)
        self.targets = [copy.deepcopy(self.targets[i]) for i in rows]
        self.heads, self.opts, self.scheds = heads, opts, scheds


def assert_matches(
    online: vmapens.Ensemble,
    target: vmapens.Ensemble,
    opt: vmapens.optim.StackedOptimizer,
    plain: Plain,
) -> None:
    assert len(online) == len(plain.heads)
    for i, h in enumerate(plain.heads):
        torch.testing.assert_close(online[i].state_dict(), h.state_dict(), **TOL)
        torch.testing.assert_close(target[i].state_dict(), plain.targets[i].state_dict(), **TOL)
        sd = opt.member_state_dict(i, module=h)
        torch.testing.assert_close(sd["state"], plain.opts[i].state_dict()["state"], **TOL)
        assert sd["param_groups"][0]["lr"] == pytest.approx(plain.opts[i].param_groups[0]["lr"])
    x = torch.randn(5, S, dtype=torch.float64)
    with torch.no_grad():  # acting: the mean over heads
        want = torch.stack([h(x) for h in plain.heads]).mean(0)
        torch.testing.assert_close(online(x).mean(0), want, **TOL)
        assert torch.equal(online(x).mean(0).argmax(-1), want.argmax(-1))


def soft_by_hand(target: vmapens.Ensemble, online: vmapens.Ensemble) -> None:
    with torch.no_grad():
        for pt, p in zip(target.parameters(), online.parameters(), strict=True):
            pt.lerp_(p, TAU)


CASES = [
    # (build, target, soft update, clip, selection, frozen members get NaN targets)
    ("seed", "make_target", "polyak_", "norm", "select", False),
    ("modules", "deepcopy", "by_hand", "value", "best_k", True),
    ("seed", "deepcopy", "polyak_", "norm", "getitem", True),
    ("modules", "make_target", "by_hand", "norm", "twice", False),
]


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_bootstrapped_q_ensemble_journey_matches_plain_heads(case: tuple) -> None:
    build, how_target, how_soft, clip, how_select, nan_frozen = case
    torch.manual_seed(0)
    if build == "seed":
        online = vmapens.Ensemble(head, n=N, seed=0)
        heads = online.unstack()
    else:  # the ModuleList of heads the naive code already has
        heads = [head() for _ in range(N)]
        online = vmapens.Ensemble.from_modules(heads)
        heads = [copy.deepcopy(h) for h in heads]
    if how_target == "make_target":
        target = make_target(online)
    else:
        target = copy.deepcopy(online).requires_grad_(False)
    soft: Callable[[vmapens.Ensemble, vmapens.Ensemble], None] = (
        (lambda t, o: polyak_(t, o, TAU)) if how_soft == "polyak_" else soft_by_hand
    )
    plain = Plain(heads, clip)
    opt = vmapens.StackedAdam(online, lr=LRS)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, 0.9)
    clip_kw = {"clip_grad_norm": MAX_NORM} if clip == "norm" else {"clip_grad_value": MAX_VALUE}
    step = vmapens.make_step(online, td_loss, opt, in_dims=0, **clip_kw)
    g = torch.Generator().manual_seed(3)

    def batch(n: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        s, s2 = (torch.randn(B, S, generator=g, dtype=torch.float64) for _ in range(2))
        a = torch.randint(A, (B,), generator=g)
        r = torch.randn(B, generator=g, dtype=torch.float64)
        w = (torch.rand(n, B, generator=g) < 0.6).double()  # each head's bootstrap mask
        return s, s2, a, r, w

    active = torch.ones(N, dtype=torch.bool)
    for t in range(4):
        if t == 2:
            active[FROZEN] = False
            frozen_params = {k: v.detach().clone() for k, v in online.stacked_params().items()}
            frozen_state = copy.deepcopy(opt.state_dict()["state"])
        s, s2, a, r, w = batch(N)
        with torch.no_grad():
            y = r + GAMMA * target(s2).amax(-1)  # [N, B]: each head's own target
        want_y = plain.td_targets(r, s2)
        torch.testing.assert_close(y, want_y, **TOL)
        if nan_frozen:  # a frozen head's data may be garbage: it must not matter
            y = y.masked_fill(~active[:, None], float("nan"))
        losses = step(s.expand(N, B, S), {"y": y, "a": a.expand(N, B), "w": w}, mask=active)
        stepped = active.nonzero().flatten().tolist()
        for i in stepped:
            want = plain.step(i, s, {"y": want_y[i], "a": a, "w": w[i]})
            torch.testing.assert_close(losses[i], want, **TOL)
        sched.step()
        soft(target, online)
        plain.end_step()

    for k, v in online.stacked_params().items():  # frozen: bit for bit, optimizer state too
        assert torch.equal(v[FROZEN], frozen_params[k][FROZEN]), k
    for p, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            if isinstance(v, Tensor) and v.dim() > 0:
                assert torch.equal(v[FROZEN], frozen_state[p][k][FROZEN]), k
    assert_matches(online, target, opt, plain)

    score = losses.masked_fill(~active, float("inf"))  # frozen heads rank last
    rows = score.argsort()[: N // 2]
    if how_select == "select":
        sub = online.select(rows)
        sub_opt = opt.select(rows, sub)
    elif how_select == "getitem":
        sub = online[rows]
        sub_opt = opt.select(rows, sub.parameters())
    elif how_select == "best_k":
        sub, sub_opt = vmapens.selection.best_k(online, score, N // 2, optimizer=opt)
        assert list(sub.member_ids) == rows.tolist()
    else:  # the best head twice, then the next ones
        rows = torch.cat([rows[:1], rows[: N // 2 - 1]])
        sub = online.select(rows)
        sub_opt = opt.select(rows, sub)
    sub_target = target.select(rows)
    sub_sched = torch.optim.lr_scheduler.ExponentialLR(sub_opt, 0.9)
    sub_sched.load_state_dict(sched.state_dict())
    plain.keep(rows.tolist())
    n = len(rows)
    step = vmapens.make_step(sub, td_loss, sub_opt, in_dims=0, **clip_kw)
    for _ in range(3):
        s, s2, a, r, w = batch(n)
        with torch.no_grad():
            y = r + GAMMA * sub_target(s2).amax(-1)
        want_y = plain.td_targets(r, s2)
        step(s.expand(n, B, S), {"y": y, "a": a.expand(n, B), "w": w})
        for i in range(n):
            plain.step(i, s, {"y": want_y[i], "a": a, "w": w[i]})
        sub_sched.step()
        soft(sub_target, sub)
        plain.end_step()
    assert_matches(sub, sub_target, sub_opt, plain)


def test_mean_over_heads_loss_manual_clip_mask_and_unfreeze_matches_plain_heads() -> None:
    """Double DQN on the heads' mean, a loss on the averaged output plus per-head losses, the
    loop written by hand: ``clip_grad_norm_`` per member, ``opt.step(mask=...)`` freezing two
    heads and later waking one, hard copies by ``load_state_dict`` between soft updates."""
    online = vmapens.Ensemble(head, n=N, seed=1)
    heads = online.unstack()
    target = make_target(online)
    targets = [copy.deepcopy(h).requires_grad_(False) for h in heads]
    wd = torch.linspace(0, 0.1, N, dtype=torch.float64)
    opt = vmapens.StackedAdam(online, lr=1e-2, weight_decay=wd)
    opts = [torch.optim.Adam(h.parameters(), lr=1e-2, weight_decay=float(d)) for h, d in zip(heads, wd, strict=True)]  # fmt: skip
    g = torch.Generator().manual_seed(0)
    active = torch.ones(N, dtype=torch.bool)
    for t in range(6):
        if t == 2:
            active[[2, 6]] = False
        if t == 4:
            active[2] = True  # woken: it goes on with its own step count and moments
        s, s2 = (torch.randn(B, S, generator=g, dtype=torch.float64) for _ in range(2))
        a = torch.randint(A, (B,), generator=g)
        r = torch.randn(B, generator=g, dtype=torch.float64)
        with torch.no_grad():  # the online mean picks the action, the target mean rates it
            a2 = online(s2).mean(0).argmax(-1, keepdim=True)
            y = r + GAMMA * target(s2).mean(0).gather(-1, a2).squeeze(-1)
            a2_plain = torch.stack([h(s2) for h in heads]).mean(0).argmax(-1, keepdim=True)
            q2_plain = torch.stack([h(s2) for h in targets]).mean(0)
            y_plain = r + GAMMA * q2_plain.gather(-1, a2_plain).squeeze(-1)
        assert torch.equal(a2, a2_plain)
        torch.testing.assert_close(y, y_plain, **TOL)
        idx = a.expand(N, B).unsqueeze(-1)
        q_a = online(s).gather(-1, idx).squeeze(-1)  # [N, B]
        loss = ((q_a.mean(0) - y) ** 2).mean() + ((q_a - y) ** 2).mean(1).sum()
        opt.zero_grad()
        loss.backward()
        norms = vmapens.optim.clip_grad_norm_(online, MAX_NORM)
        opt.step(mask=active)
        for o in opts:
            o.zero_grad()
        q_plain = torch.stack([h(s) for h in heads]).gather(-1, idx).squeeze(-1)
        (((q_plain.mean(0) - y_plain) ** 2).mean() + ((q_plain - y_plain) ** 2).mean(1).sum()).backward()  # fmt: skip
        for i, (h, o) in enumerate(zip(heads, opts, strict=True)):
            norm = torch.nn.utils.clip_grad_norm_(h.parameters(), MAX_NORM)
            torch.testing.assert_close(norms[i], norm, **TOL)
            if active[i]:
                o.step()
        if t % 3 == 2:
            target.load_state_dict(online.state_dict())
            for h_t, h in zip(targets, heads, strict=True):
                h_t.load_state_dict(h.state_dict())
        else:
            polyak_(target, online, TAU)
            with torch.no_grad():
                for h_t, h in zip(targets, heads, strict=True):
                    for pt, p in zip(h_t.parameters(), h.parameters(), strict=True):
                        pt.lerp_(p, TAU)
    assert not any(p.requires_grad for p in target.parameters())
    for i in range(N):
        torch.testing.assert_close(online[i].state_dict(), heads[i].state_dict(), **TOL)
        torch.testing.assert_close(target[i].state_dict(), targets[i].state_dict(), **TOL)
        sd = opt.member_state_dict(i, module=heads[i])
        torch.testing.assert_close(sd["state"], opts[i].state_dict()["state"], **TOL)
