"""User journey: PPO on an ensemble of small actor-critic policies built on torch.distributions.

The script an RL researcher writes from README.md, docs/index.md, docs/optim.md, docs/fit.md
and docs/semantics.md, with the policy written as in CleanRL / Stable-Baselines3: the
member's forward builds `Categorical(logits=...)` (discrete actions) or `Normal(mu,
log_std.exp())` with a state-independent `log_std` parameter (continuous; once wrapped in
`Independent`) and returns the taken actions' log-probabilities, the entropy and the value;
a second policy returns only `(logits, value)` and the loss builds the distribution.
torch's default `validate_args` (on in a fresh process) stays on, but where a test turns it off
for a diverged member.

The PPO update: a fixed rollout buffer per member (seeded random tensors), advantages
normalised per member over the buffer (and, CleanRL-style, again per minibatch inside the
loss), the clipped surrogate against the stored old log-probs, the value loss and the entropy
bonus, several epochs over shuffled minibatches (each member its own order with
`in_dims=0`, or one order for all), per-member gradient clipping, Adam with one learning rate
per member, and SB3's per-member early stop on the approximate KL (a mask). Three ways: a
hand-written loop (`ens(...)`, `per_member`, `loss.sum().backward()`,
`vmapens.optim.clip_grad_norm_`, `StackedAdam.step()`, CleanRL's learning-rate annealing set
by hand in the param group), `vmapens.make_step` (KL stop through `mask=`) and `vmapens.fit`. Then sampling actions inside the ensemble (docs/semantics.md, "Randomness in
the forward pass"), and what torch's argument validation does to a diverged member.

The truth: N plain policies, each trained alone with `torch.optim.Adam` and
`torch.nn.utils.clip_grad_norm_` on the same minibatches, float64.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributions import Categorical, Independent, Normal

import vmapens
from vmapens.optim import MemberValues

sys.path.insert(0, str(Path(__file__).parent))
from truth import batch_plan  # noqa: E402

pytestmark = pytest.mark.usefixtures("float64_default", "validating_distributions")


@pytest.fixture
def validating_distributions() -> Any:
    """torch's default `validate_args` (True), as a fresh process has it: torch._dynamo's
    set-up turns it off for the whole process (`Distribution.set_default_validate_args(False)`
    in `eval_frame`), which any earlier test that compiled has done."""
    was = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(True)
    yield
    torch.distributions.Distribution.set_default_validate_args(was)


N, OBS, A, ACT, H = 4, 3, 3, 2, 8
T, MB, EPOCHS = 16, 8, 2  # rollout rows per member, minibatch rows, epochs: 4 steps
CLIP, ENT_COEF, VF_COEF, MAX_NORM = 0.2, 0.01, 0.5, 0.5
LRS = [3e-3, 1e-3, 3e-2, 1e-2]
EPS = 1e-5  # PPO's Adam eps
TOL = dict(rtol=1e-9, atol=1e-10)  # float64: batched kernels sum in another order


class Discrete(nn.Module):
    """CleanRL's `Agent.get_action_and_value` as the forward."""

    def __init__(self, validate: bool | None = None) -> None:
        super().__init__()
        self.validate = validate  # torch's default (None) unless the test says otherwise
        self.actor = nn.Sequential(nn.Linear(OBS, H), nn.Tanh(), nn.Linear(H, A))
        self.critic = nn.Sequential(nn.Linear(OBS, H), nn.Tanh(), nn.Linear(H, 1))

    def forward(self, obs: Tensor, action: Tensor | None = None) -> tuple[Tensor, ...]:
        dist = Categorical(logits=self.actor(obs), validate_args=self.validate)
        if action is None:
            action = dist.sample()
        return action, dist.log_prob(action), dist.entropy(), self.critic(obs).squeeze(-1)


class Gaussian(nn.Module):
    """A diagonal Gaussian policy with a state-independent `log_std` parameter."""

    def __init__(self, independent: bool = False) -> None:
        super().__init__()
        self.independent = independent
        self.mean = nn.Sequential(nn.Linear(OBS, H), nn.Tanh(), nn.Linear(H, ACT))
        self.log_std = nn.Parameter(torch.full((ACT,), -0.5))
        self.critic = nn.Sequential(nn.Linear(OBS, H), nn.Tanh(), nn.Linear(H, 1))

    def forward(self, obs: Tensor, action: Tensor | None = None) -> tuple[Tensor, ...]:
        dist: Any = Normal(self.mean(obs), self.log_std.exp())
        if self.independent:
            dist = Independent(dist, 1)
        if action is None:
            action = dist.sample()
        logp, ent = dist.log_prob(action), dist.entropy()
        if not self.independent:
            logp, ent = logp.sum(-1), ent.sum(-1)
        return action, logp, ent, self.critic(obs).squeeze(-1)


class Heads(nn.Module):
    """Returns `(logits, value)`: the loss builds the distribution."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(OBS, H), nn.Tanh())
        self.pi, self.v = nn.Linear(H, A), nn.Linear(H, 1)

    def forward(self, obs: Tensor) -> tuple[Tensor, Tensor]:
        h = self.body(obs)
        return self.pi(h), self.v(h).squeeze(-1)


FACTORIES = {
    "categorical": Discrete,
    "normal": Gaussian,
    "independent": lambda: Gaussian(independent=True),
}


def surrogate(logp: Tensor, ent: Tensor, value: Tensor, t: dict[str, Tensor]) -> Tensor:
    adv = t["adv"]
    if t.get("norm_mb") is not None:  # CleanRL's norm_adv: per minibatch, inside the loss
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    ratio = (logp - t["old"]).exp()
    pg = torch.max(-adv * ratio, -adv * ratio.clamp(1 - CLIP, 1 + CLIP)).mean()
    v = 0.5 * ((value - t["ret"]) ** 2).mean()
    return pg - ENT_COEF * ent.mean() + VF_COEF * v


def ppo_loss(out: tuple[Tensor, ...], t: dict[str, Tensor]) -> Tensor:
    """One member's PPO loss on its minibatch; `out` is the forward's tuple."""
    _, logp, ent, value = out
    return surrogate(logp, ent, value, t)


def heads_loss(out: tuple[Tensor, Tensor], t: dict[str, Tensor]) -> Tensor:
    """The distribution built in the loss, from the `(logits, value)` output."""
    logits, value = out
    dist = Categorical(logits=logits)
    return surrogate(dist.log_prob(t["act"]), dist.entropy(), value, t)


def rollout(kind: str, seed: int = 0) -> dict[str, Tensor]:
    """Each member's own rollout: observations, taken actions, returns and advantages, the
    advantages normalised per member over its buffer."""
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(N, T, OBS, generator=g)
    if kind in ("categorical", "heads"):
        act = torch.randint(A, (N, T), generator=g)
    else:
        act = torch.randn(N, T, ACT, generator=g)
    adv = 2.0 + 3.0 * torch.randn(N, T, generator=g)
    adv = (adv - adv.mean(1, keepdim=True)) / (adv.std(1, keepdim=True) + 1e-8)
    return {"obs": obs, "act": act, "adv": adv, "ret": torch.randn(N, T, generator=g)}


def orders(per_member: bool, seed: int = 1) -> list[Tensor]:
    """The minibatches' rows, `[N, MB]` per step: each member its own shuffle, or one."""
    g = torch.Generator().manual_seed(seed)
    plan = []
    for _ in range(EPOCHS):
        if per_member:
            perm = torch.stack([torch.randperm(T, generator=g) for _ in range(N)])
        else:
            perm = torch.randperm(T, generator=g).expand(N, T)
        plan += [perm[:, k : k + MB] for k in range(0, T, MB)]
    return plan


def take(buf: dict[str, Tensor], rows: Tensor) -> dict[str, Tensor]:
    """Every member's rows `rows[i]` of its own buffer: `[N, MB, ...]`."""
    return {k: v[torch.arange(N)[:, None], rows] for k, v in buf.items()}


def approx_kl(logp: Tensor, old: Tensor) -> Tensor:
    log_ratio = logp - old
    return ((log_ratio.exp() - 1) - log_ratio).mean(-1)


class Alone:
    """The naive loop: each policy alone with its own Adam, on its own minibatches."""

    def __init__(self, models: list[nn.Module], loss_fn: Any = ppo_loss, logp: Any = None) -> None:
        self.models, self.loss_fn = models, loss_fn
        self.logp = logp or (lambda out, t: out[1])
        self.opts = [torch.optim.Adam(m.parameters(), lr=lr, eps=EPS) for m, lr in zip(models, LRS)]
        self.losses: list[list[float]] = [[] for _ in models]
        self.norms: list[list[float]] = [[] for _ in models]
        self.stopped = [False] * len(models)

    def step(self, i: int, x: tuple[Tensor, ...], t: dict[str, Tensor], kl: float | None) -> None:
        m, opt = self.models[i], self.opts[i]
        if kl is not None and not self.stopped[i]:  # SB3: check before the update
            with torch.no_grad():
                self.stopped[i] = bool(approx_kl(self.logp(m(*x), t), t["old"]) > kl)
        if self.stopped[i]:
            return
        opt.zero_grad()
        loss = self.loss_fn(m(*x), t)
        loss.backward()
        self.norms[i].append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM)))
        opt.step()
        self.losses[i].append(loss.item())

    def run(self, buf: dict[str, Tensor], plan: list[Tensor], kl: float | None = None,
            inputs: tuple[str, ...] = ("obs", "act"), norm_mb: bool = False,
            anneal: bool = False) -> None:  # fmt: skip
        for k, rows in enumerate(plan):
            for i in range(len(self.models)):
                if anneal:  # CleanRL's linear annealing, set by hand in the param group
                    self.opts[i].param_groups[0]["lr"] = (1.0 - k / len(plan)) * LRS[i]
                b = {k: v[i, rows[i]] for k, v in buf.items()}
                if norm_mb:
                    b["norm_mb"] = torch.ones(())
                self.step(i, tuple(b[k] for k in inputs), b, kl)


def old_logp_alone(models: list[nn.Module], buf: dict[str, Tensor]) -> Tensor:
    with torch.no_grad():
        return torch.stack([m(buf["obs"][i], buf["act"][i])[1] for i, m in enumerate(models)])


def assert_members(ens: vmapens.Ensemble, opt: Any, alone: Alone) -> None:
    for i, m in enumerate(alone.models):
        torch.testing.assert_close(ens[i].state_dict(), m.state_dict(), **TOL)
        if alone.opts[i].state:  # a member stopped before its first step has no state
            sd = opt.member_state_dict(i, module=m)
            torch.testing.assert_close(sd["state"], alone.opts[i].state_dict()["state"], **TOL)


# -- (1) the hand-written loop ----------------------------------------------------------------


@pytest.mark.parametrize("kind", list(FACTORIES))
@pytest.mark.parametrize("per_member_order", [True, False], ids=["own-order", "same-order"])
def test_hand_written_ppo_loop_trains_every_policy_as_alone(
    kind: str, per_member_order: bool
) -> None:
    ens = vmapens.Ensemble(FACTORIES[kind], n=N, seed=0)
    alone = Alone(ens.unstack())
    buf = rollout(kind)
    with torch.no_grad():  # the stored old log-probs: the policy at rollout time
        buf["old"] = ens(buf["obs"], buf["act"], in_dims=0)[1]
    torch.testing.assert_close(buf["old"], old_logp_alone(alone.models, buf), **TOL)
    plan = orders(per_member_order)
    alone.run(buf, plan, norm_mb=per_member_order, anneal=True)

    opt = vmapens.StackedAdam(ens, lr=LRS, eps=EPS)
    loss = vmapens.per_member(ppo_loss, in_dims=(0, 0))
    got_losses, got_norms = [], []
    for k, rows in enumerate(plan):
        opt.param_groups[0]["lr"] = (1.0 - k / len(plan)) * MemberValues(LRS)
        b = take(buf, rows)
        if per_member_order:
            b["norm_mb"] = torch.ones(N)  # a per-member flag: vmap maps it with the rest
        out = ens(b["obs"], b["act"], in_dims=0)
        losses = loss(out, b)
        opt.zero_grad()
        losses.sum().backward()
        got_norms.append(vmapens.optim.clip_grad_norm_(ens, MAX_NORM))
        opt.step()
        got_losses.append(losses.detach())
    torch.testing.assert_close(torch.stack(got_losses).T, torch.tensor(alone.losses), **TOL)
    torch.testing.assert_close(torch.stack(got_norms).T, torch.tensor(alone.norms), **TOL)
    assert torch.tensor(alone.norms).max() > MAX_NORM  # clipping did clip
    assert_members(ens, opt, alone)


# -- (2) make_step, with SB3's early stop on the approximate KL per member ---------------------

KL_STOP = 0.02


def heads_logp(out: tuple[Tensor, Tensor], t: dict[str, Tensor]) -> Tensor:
    return Categorical(logits=out[0]).log_prob(t["act"])


@pytest.mark.parametrize("kind", ["categorical", "independent", "heads"])
def test_make_step_ppo_stops_each_member_on_its_own_kl_as_alone(kind: str) -> None:
    heads = kind == "heads"
    factory, loss_fn = (Heads, heads_loss) if heads else (FACTORIES[kind], ppo_loss)
    logp = heads_logp if heads else (lambda out, t: out[1])
    inputs = ("obs",) if heads else ("obs", "act")
    ens = vmapens.Ensemble(factory, n=N, seed=1)
    alone = Alone(ens.unstack(), loss_fn, logp)
    buf = rollout(kind, seed=2)
    with torch.no_grad():
        buf["old"] = logp(ens(*(buf[k] for k in inputs), in_dims=0), buf)
    plan = orders(True, seed=3) * 2  # four epochs
    alone.run(buf, plan, kl=KL_STOP, inputs=inputs)
    assert any(alone.stopped) and not all(alone.stopped)  # the early stop happened, per member

    opt = vmapens.StackedAdam(ens, lr=LRS, eps=EPS)
    step = vmapens.make_step(ens, loss_fn, opt, in_dims=0, clip_grad_norm=MAX_NORM)
    active = torch.ones(N, dtype=torch.bool)
    got: list[list[float]] = [[] for _ in range(N)]
    for rows in plan:
        b = take(buf, rows)
        x = tuple(b[k] for k in inputs)
        with torch.no_grad():
            active &= approx_kl(logp(ens(*x, in_dims=0), b), b["old"]) <= KL_STOP
        losses = step(x if len(x) > 1 else x[0], b, mask=active)
        for i in active.nonzero().flatten().tolist():
            got[i].append(float(losses[i]))
    assert (~active).tolist() == alone.stopped
    for i in range(N):
        torch.testing.assert_close(torch.tensor(got[i]), torch.tensor(alone.losses[i]), **TOL)
    assert_members(ens, opt, alone)


# -- (3) fit: PPO's epochs over one shuffled order for all members -----------------------------


def test_fit_runs_the_ppo_epochs_as_alone() -> None:
    ens = vmapens.Ensemble(lambda: Gaussian(independent=True), n=N, seed=2)
    alone = Alone(ens.unstack())
    buf = rollout("independent", seed=4)
    with torch.no_grad():
        buf["old"] = ens(buf["obs"], buf["act"], in_dims=0)[1]
    targets = {k: buf[k] for k in ("old", "adv", "ret")}
    opt = vmapens.StackedAdam(ens, lr=LRS, eps=EPS)
    history = vmapens.fit(ens, ((buf["obs"], buf["act"]), targets), ppo_loss, optimizer=opt,
                          epochs=EPOCHS, batch_size=MB, in_dims=0, clip_grad_norm=MAX_NORM,
                          seed=5, progress=False)  # fmt: skip
    plan = [r.expand(N, MB) for r in batch_plan(T, MB, EPOCHS * T // MB, seed=5)]
    alone.run(buf, plan)
    assert_members(ens, opt, alone)
    per_epoch = torch.tensor(alone.losses).view(N, EPOCHS, -1).mean(-1).T
    torch.testing.assert_close(history.train_loss, per_epoch, **TOL)


# -- (4) acting: sampling actions inside the ensemble -------------------------------------------


def test_sampled_actions_follow_each_members_own_policy() -> None:
    """Default `randomness="different"`: each member its own draws, equal to alone in
    distribution only (docs/semantics.md): frequencies against each member's own policy."""
    draws = 4000
    ens = vmapens.Ensemble(Discrete, n=N, seed=3)
    obs = torch.randn(1, OBS).expand(draws, OBS)
    with torch.no_grad():
        acts = ens(obs)[0]
        probs = torch.stack([m.actor(obs[0]).softmax(-1) for m in ens.unstack()])
    freq = torch.nn.functional.one_hot(acts, A).double().mean(1)  # [N, A]
    sd = (probs * (1 - probs) / draws).sqrt()
    assert ((freq - probs).abs() <= 5 * sd).all(), (freq, probs)
    assert not all(torch.equal(acts[0], a) for a in acts[1:])  # members draw independently
    gauss = vmapens.Ensemble(Gaussian, n=N, seed=3)
    with torch.no_grad():
        acts = gauss(obs)[0]  # [N, draws, ACT]
        want = [(m.mean(obs[0]), m.log_std.exp()) for m in gauss.unstack()]
    for a, (mu, std) in zip(acts, want):
        assert ((a.mean(0) - mu).abs() <= 5 * std / draws**0.5).all()
        assert ((a.std(0) / std - 1).abs() < 0.1).all()
    # the rollout's stored log-probs are those of the actions each member drew
    acts, logp, _, value = ens(obs[:6])
    for i, m in enumerate(ens.unstack()):
        _, want, _, v = m(obs[:6], acts[i])
        torch.testing.assert_close(logp[i], want, **TOL)
        torch.testing.assert_close(value[i], v, **TOL)


@pytest.mark.parametrize("kind", ["categorical", "normal"])
def test_same_randomness_draws_each_members_actions_as_alone_with_the_loop_backend(
    kind: str,
) -> None:
    """docs/semantics.md: with `randomness="same"` and `backend="loop"` each member draws what
    it draws alone from the same RNG state."""
    ens = vmapens.Ensemble(FACTORIES[kind], n=N, seed=0, randomness="same", backend="loop")
    obs = torch.randn(5, OBS)
    torch.manual_seed(3)
    got = ens(obs)[0]
    want = []
    for m in ens.unstack():
        torch.manual_seed(3)
        want.append(m(obs)[0])
    assert torch.equal(got, torch.stack(want))


class Reparam(nn.Module):
    """SAC-style: a reparametrised Gaussian draw (`rsample`) in the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.mean = nn.Linear(OBS, ACT)
        self.log_std = nn.Parameter(torch.full((ACT,), -0.5))

    def forward(self, obs: Tensor) -> Tensor:
        return Normal(self.mean(obs), self.log_std.exp()).rsample()


def test_rsample_draws_as_alone_with_same_randomness_and_is_refused_with_different() -> None:
    obs = torch.randn(5, OBS)
    ens = vmapens.Ensemble(Reparam, n=N, seed=0, randomness="same")
    torch.manual_seed(3)
    got = ens(obs)
    want = []
    for m in ens.unstack():
        torch.manual_seed(3)
        want.append(m(obs))
    torch.testing.assert_close(got, torch.stack(want), **TOL)
    # the default: one unbatched noise tensor cannot hold every member's own draws
    with pytest.raises(RuntimeError, match="backend='loop'"):
        vmapens.Ensemble(Reparam, n=N, seed=0)(obs)


def test_same_randomness_refuses_a_draw_from_each_members_own_policy() -> None:
    """`Categorical.sample()` draws with each member's own probabilities: vmap refuses
    `randomness="same"` there. The refusal is torch's words wrapped in a hint about in-place
    ops; it names `backend='loop'`, but not the randomness setting that caused it."""
    ens = vmapens.Ensemble(Discrete, n=N, seed=0, randomness="same")
    with pytest.raises(RuntimeError, match="backend='loop'") as err:
        ens(torch.randn(5, OBS))
    assert "same randomness" in str(err.value)


def test_same_randomness_refusal_names_the_setting_and_its_ways_out() -> None:
    ens = vmapens.Ensemble(Discrete, n=N, seed=0, randomness="same")
    with pytest.raises(RuntimeError) as err:
        ens(torch.randn(5, OBS))
    msg = str(err.value)
    assert "randomness='same'" in msg and "randomness='different'" in msg
    assert "backend='loop'" in msg and "in-place" not in msg


# -- (5) torch's argument validation and a diverged member ------------------------------------


def poisoned(validate: bool | None) -> tuple[vmapens.Ensemble, list[nn.Module]]:
    """Member 2's policy head holds a NaN (a diverged member), the others are fine."""
    ens = vmapens.Ensemble(lambda: Discrete(validate), n=N, seed=0)
    with torch.no_grad():
        ens.get_parameter("actor.2.bias")[2, 1] = float("nan")
    return ens, ens.unstack()


def test_validate_args_check_every_member_at_once() -> None:
    """Under vmap torch's `validate_args` check (`.all()` of the constraint) covers every
    member: one member's NaN logits raise for all, where alone only that member raises."""
    assert torch.distributions.Distribution._validate_args  # torch's default in a fresh process
    obs = torch.randn(5, OBS)
    ens, alone = poisoned(None)
    with pytest.raises(ValueError, match="Expected parameter logits"):
        alone[2](obs)
    with pytest.raises(ValueError, match="Expected parameter logits"):
        ens(obs)
    for i in (0, 1, 3):
        alone[i](obs)  # the others run alone
    ens, alone = poisoned(False)  # validate_args=False: each member its own numbers
    acts = torch.randint(A, (N, 5))
    out = ens(obs.expand(N, 5, OBS), acts, in_dims=0)
    assert out[1][2].isnan().all() and not out[1][[0, 1, 3]].isnan().any()
    for i in (0, 1, 3):
        torch.testing.assert_close(out[1][i], alone[i](obs, acts[i])[1], **TOL)


def diverging_rollout() -> dict[str, Tensor]:
    """Member 2's buffer holds a NaN advantage (a corrupted environment step)."""
    buf = rollout("categorical", seed=6)
    buf["adv"][2, 3] = float("nan")
    return buf


def fit_ppo(ens: vmapens.Ensemble, buf: dict[str, Tensor]) -> vmapens.History:
    targets = {k: buf[k] for k in ("old", "adv", "ret")}
    return vmapens.fit(ens, ((buf["obs"], buf["act"]), targets), ppo_loss, lr=LRS, eps=EPS,
                       epochs=EPOCHS, batch_size=MB, in_dims=0, clip_grad_norm=MAX_NORM,
                       seed=7, progress=False)  # fmt: skip


def test_fit_freezes_a_diverged_policy_and_trains_the_others_as_alone() -> None:
    """docs/fit.md: a member whose loss becomes NaN is frozen, the others carry on as alone
    (with `validate_args=False`: the check would stop every member, above)."""
    ens = vmapens.Ensemble(lambda: Discrete(False), n=N, seed=4)
    alone = Alone(ens.unstack())
    buf = diverging_rollout()
    with torch.no_grad():
        buf["old"] = ens(buf["obs"], buf["act"], in_dims=0)[1]
    history = fit_ppo(ens, buf)
    assert history.diverged.tolist() == [False, False, True, False]
    plan = [r.expand(N, MB) for r in batch_plan(T, MB, EPOCHS * T // MB, seed=7)]
    alone.run(buf, plan)
    for i in (0, 1, 3):
        torch.testing.assert_close(ens[i].state_dict(), alone.models[i].state_dict(), **TOL)


def test_fit_says_why_validate_args_stops_every_member() -> None:
    ens = vmapens.Ensemble(Discrete, n=N, seed=4)
    buf = diverging_rollout()
    with torch.no_grad():
        buf["old"] = ens(buf["obs"], buf["act"], in_dims=0)[1]
    with pytest.raises(ValueError) as err:
        fit_ppo(ens, buf)
    assert str(err.value).split(":")[0] in ("fit", "step")  # the API that ran the member
    assert "validate_args=False" in str(err.value) and "every member" in str(err.value)
