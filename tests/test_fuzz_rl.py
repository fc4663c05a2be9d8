"""Seeded random RL programs on a Q-ensemble against N plain Q-networks and N plain targets.

Each case draws a valid program the way RL code uses an ensemble (docs/workflows.md,
"Reinforcement learning"): a Q-ensemble of N = 2..5 MLP heads (sometimes with LayerNorm, or
Dropout in training mode with ``randomness="same"``), its target ensemble (``make_target``,
``copy.deepcopy`` or ``select``, sometimes in eval mode), then steps of: TD targets from the
target ensemble (REDQ's min over a ``random_members`` subset drawn from a generator, the mean,
or each member's own target), per-member bootstrap masks on the batch (Bootstrapped DQN),
training through ``make_step`` (shared or per-member data, gradient clipping, a member mask)
or a hand-written loop (``vmapens.optim.clip_grad_*``), a stacked optimizer with per-member
learning rates, soft updates (``polyak_`` with a float, a NumPy float or a 0-dim tensor) and
hard copies (``polyak_(.., 1.0)``, ``load_state_dict``, a new ``make_target``) at random
intervals, greedy action selection in eval mode under ``no_grad``/``inference_mode``,
sub-ensembles, and a save/resume in the middle (``vmapens.save``/``load``/``restore`` of the
online ensemble with its optimizer, the target ensemble and the subset generator), in float64
or float32, with batches of several sizes.

The truth: N plain modules and N plain target modules (``copy.deepcopy``), each updated with
plain torch (``torch.optim``, ``torch.nn.utils.clip_grad_*``, Polyak as users write it with
``lerp_`` or ``mul_().add_()``, hard copies by ``load_state_dict`` or ``copy.deepcopy``), fed
the same batches and the same subset draws, compared after every step. A resumed run must
also equal the same program run without the interruption, bit for bit.

Run more seeds by hand: ``python tests/test_fuzz_rl.py 0 500`` runs seeds 0..499 and prints
the failures; ``python tests/test_fuzz_rl.py 17`` prints seed 17's program and runs it.
"""

from __future__ import annotations

import copy
import functools
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from truth import search

import vmapens
from vmapens.rl import make_target, polyak_, random_members

OBS, ACTIONS, GAMMA = 3, 2, 0.9
TOLS = {
    torch.float64: dict(rtol=1e-9, atol=1e-10),
    # float32 over ~10 steps: batched and per-member kernels sum in other orders.
    torch.float32: dict(rtol=2e-4, atol=2e-5),
}


class QNet(nn.Module):
    """A Q-head: ``Linear -> [LayerNorm | BatchNorm1d] -> Tanh -> [Dropout] -> Linear``."""

    def __init__(self, kind: str, hidden: int) -> None:
        super().__init__()
        # No bias before BatchNorm (CrossQ's critics): its true gradient is 0, round-off else.
        layers: list[nn.Module] = [nn.Linear(OBS, hidden, bias=kind != "bn")]
        if kind == "ln":
            layers.append(nn.LayerNorm(hidden))
        elif kind == "bn":
            layers.append(nn.BatchNorm1d(hidden))
        layers.append(nn.Tanh())
        if kind == "drop":
            layers.append(nn.Dropout(0.2))
        layers.append(nn.Linear(hidden, ACTIONS))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def member(spec: dict[str, Any]) -> QNet:
    """The factory: a Q-head in the run's dtype (``load`` builds members with it)."""
    return QNet(spec["kind"], spec["hidden"]).to(spec["dtype"])


OPTIMIZERS: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    # name: (stacked class, torch class, shared settings as both take them)
    "adam": (vmapens.StackedAdam, torch.optim.Adam, dict(betas=(0.8, 0.99))),
    "adamw": (
        functools.partial(vmapens.StackedAdam, decoupled_weight_decay=True),
        torch.optim.AdamW,
        dict(weight_decay=0.05),
    ),
    "sgd": (vmapens.StackedSGD, torch.optim.SGD, dict(momentum=0.9, nesterov=True)),
    "rmsprop": (vmapens.StackedRMSprop, torch.optim.RMSprop, dict(alpha=0.9)),
}


def draw(seed: int) -> dict[str, Any]:
    """A random, valid RL program from ``seed``."""
    r = random.Random(seed)
    n = r.randint(2, 5)
    steps = r.randint(5, 10)
    lrs = [r.choice([1e-2, 3e-2, 5e-2]) for _ in range(n)]
    return dict(
        seed=seed,
        n=n,
        dtype=r.choice([torch.float64, torch.float64, torch.float32]),
        kind=r.choice(["mlp", "ln", "drop", "bn"]),
        options=r.choice([{}, {}, {"chunk_size": 2}, {"backend": "loop"}]),
        hidden=r.choice([4, 6]),
        target=r.choice(["make_target", "deepcopy", "select"]),
        target_eval=r.random() < 0.3,
        opt=r.choice(sorted(OPTIMIZERS)),
        lr=r.choice(["list", "tensor", "shared"]),
        lrs=lrs,
        train=r.choice(["step", "manual"]),
        clip=r.choice([None, ("norm", 0.5), ("value", 0.1)]),
        td=r.choice(["redq", "mean", "member"]),
        k=r.randint(1, n),
        boot=r.random() < 0.5,
        steps=steps,
        batches=[r.choice([4, 7]) for _ in range(steps)],
        active=[r.random() < 0.2 for _ in range(steps)],
        update=[r.choice(["soft", "soft", "none", "hard"]) for _ in range(steps)],
        tau=[r.choice([0.005, 0.1, 0.5]) for _ in range(steps)],
        tau_as=[r.choice(["float", "numpy", "tensor"]) for _ in range(steps)],
        hard=[
            r.choice(["polyak", "load_state_dict", "make_target", "deepcopy"]) for _ in range(steps)
        ],
        polyak=r.choice(["lerp", "mul_add"]),
        act=[r.choice([None, None, "no_grad", "inference_mode"]) for _ in range(steps)],
        sub=[r.random() < 0.2 for _ in range(steps)],
        resume=r.choice([None, None, r.randint(1, steps - 1)]),
        resume_how=r.choice(["load", "restore"]),
    )


# -- the truth: plain modules and plain torch --------------------------------------------------


def alone(models: list[nn.Module], fn: Any) -> list[Any]:
    """``fn(i, model)`` for every model, each from the same global RNG state (a dropout mask
    with ``randomness="same"`` is the one a member alone draws), leaving the state one draw
    gives."""
    start = after = torch.get_rng_state()
    outs = []
    for i, m in enumerate(models):
        torch.set_rng_state(start)
        outs.append(fn(i, m))
        after = torch.get_rng_state()
    torch.set_rng_state(after)
    return outs


class Twins:
    """The truth: N plain Q-networks, N plain targets, N torch optimizers."""

    def __init__(self, spec: dict[str, Any], seeds: list[int]) -> None:
        self.spec = spec
        self.online = []
        for k in seeds:
            torch.manual_seed(k)
            self.online.append(QNet(spec["kind"], spec["hidden"]).to(spec["dtype"]))
        self.target = [self.copy(m) for m in self.online]
        _, cls, shared = OPTIMIZERS[spec["opt"]]
        lrs = spec["lrs"] if spec["lr"] != "shared" else [spec["lrs"][0]] * spec["n"]
        self.opts = [cls(m.parameters(), lr=lr, **shared) for m, lr in zip(self.online, lrs)]

    def copy(self, m: nn.Module) -> nn.Module:
        t = copy.deepcopy(m).requires_grad_(False)
        return t.eval() if self.spec["target_eval"] else t.train()

    def td_targets(self, s2, r, d, subset) -> torch.Tensor:
        with torch.no_grad():
            qn = torch.stack(alone(self.target, lambda i, m: m(s2)))
        return td(self.spec["td"], qn, r, d, subset)

    def train(self, s, a, y, w, active) -> torch.Tensor:
        clip = self.spec["clip"]

        def one(i: int, m: nn.Module) -> torch.Tensor:
            if active is not None and not active[i]:
                # Left out of make_step's step, a member keeps its buffers (BatchNorm's
                # statistics); a hand-written loop runs its forward and masks the optimizer's
                # step only. Either way the global RNG is drawn once for every member.
                (copy.deepcopy(m) if self.spec["train"] == "step" else m)(s)
                return torch.tensor(float("nan"), dtype=self.spec["dtype"])
            opt = self.opts[i]
            opt.zero_grad()
            q = m(s).gather(-1, a[:, None]).squeeze(-1)
            loss = member_loss(q, y[i], w[i])
            loss.backward()
            if clip is not None and clip[0] == "norm":
                nn.utils.clip_grad_norm_(m.parameters(), clip[1])
            elif clip is not None:
                nn.utils.clip_grad_value_(m.parameters(), clip[1])
            opt.step()
            return loss.detach()

        return torch.stack(alone(self.online, one))

    def polyak(self, tau: Any) -> None:
        with torch.no_grad():
            for t, m in zip(self.target, self.online):
                for p, q in zip(t.parameters(), m.parameters()):
                    if self.spec["polyak"] == "lerp":
                        p.lerp_(q, tau)
                    else:
                        p.mul_(1 - tau).add_(tau * q)
                for b, c in zip(t.buffers(), m.buffers()):
                    b.copy_(c)

    def hard(self, how: str) -> None:
        if how == "load_state_dict":
            for t, m in zip(self.target, self.online):
                t.load_state_dict(m.state_dict())
        else:
            self.target = [self.copy(m) for m in self.online]


def td(kind: str, qn: torch.Tensor, r, d, subset) -> torch.Tensor:
    """``[n, B]`` TD targets from the targets' ``[n, B, A]`` Q-values (one formula, fed
    the ensemble's stacked output or the plain targets' outputs stacked)."""
    n = qn.shape[0]
    if kind == "redq":
        nxt = qn[subset].amin(0).amax(-1).expand(n, -1)
    elif kind == "mean":
        nxt = qn.mean(0).amax(-1).expand(n, -1)
    else:
        nxt = qn.amax(-1)
    return r + GAMMA * (1 - d) * nxt


def member_loss(q: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """One member's bootstrapped TD loss: mean squared error over its own rows."""
    return (w * (q - y) ** 2).sum() / w.sum().clamp(min=1)


def packed_loss(out: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``member_loss`` as ``make_step``'s ``loss_fn``: targets ``[B, 3]`` = (y, action, w)."""
    q = out.gather(-1, packed[:, 1:2].long()).squeeze(-1)
    return member_loss(q, packed[:, 0], packed[:, 2])


# -- the program on the ensemble ---------------------------------------------------------------


def stacked(models: list[nn.Module]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([m.state_dict()[k] for m in models]) for k in models[0].state_dict()}


def assert_same(ens: vmapens.Ensemble, models: list[nn.Module], tol: dict, where: str) -> None:
    got = {k: v.detach() for k, v in ens.state_dict().items()}
    torch.testing.assert_close(got, stacked(models), **tol, msg=lambda m: f"{where}: {m}")
    assert ens.training == models[0].training, where


class Program:
    """The ensemble side: the objects a user holds, rebuilt on resume."""

    def __init__(self, spec: dict[str, Any], seeds: list[int]) -> None:
        self.spec = spec
        self.factory = functools.partial(member, spec)
        randomness = "same" if spec["kind"] == "drop" else "different"
        self.online = vmapens.Ensemble(
            self.factory, n=spec["n"], seeds=seeds, randomness=randomness, **spec["options"]
        )
        self.online.to(spec["dtype"])
        self.opt = self.optimizer(self.online)
        if spec["target"] == "make_target":
            self.target = make_target(self.online)
        elif spec["target"] == "deepcopy":
            self.target = copy.deepcopy(self.online).requires_grad_(False)
        else:
            self.target = self.online.select(slice(None)).requires_grad_(False)
        self.target_mode()
        self.subsets = torch.Generator().manual_seed(spec["seed"])
        self.step = self.make_step()

    def optimizer(self, ens: vmapens.Ensemble) -> torch.optim.Optimizer:
        cls, _, shared = OPTIMIZERS[self.spec["opt"]]
        lr: Any = {
            "list": self.spec["lrs"],
            "tensor": torch.tensor(self.spec["lrs"], dtype=torch.float64),
            "shared": self.spec["lrs"][0],
        }[self.spec["lr"]]
        return cls(ens, lr=lr, **shared)

    def make_step(self) -> Any:
        clip = self.spec["clip"] or (None, None)
        return vmapens.make_step(
            self.online,
            packed_loss,
            self.opt,
            in_dims=0 if self.per_member() else None,
            clip_grad_norm=clip[1] if clip[0] == "norm" else None,
            clip_grad_value=clip[1] if clip[0] == "value" else None,
        )

    def per_member(self) -> bool:
        return self.spec["td"] == "member" or self.spec["boot"]

    def target_mode(self) -> None:
        self.target.eval() if self.spec["target_eval"] else self.target.train()

    def td_targets(self, s2, r, d, subset) -> torch.Tensor:
        with torch.no_grad():
            qn = self.target(s2)
        return td(self.spec["td"], qn, r, d, subset)

    def train(self, s, a, y, w, active) -> torch.Tensor:
        n, b = self.spec["n"], s.shape[0]
        if self.spec["train"] == "step":
            packed = torch.stack([y, a.to(y.dtype).expand(n, b), w], -1)
            if self.per_member():
                return self.step(s.expand(n, *s.shape), packed, active)
            return self.step(s, packed[0], active)
        self.opt.zero_grad()
        q = self.online(s).gather(-1, a[None, :, None].expand(n, b, 1)).squeeze(-1)
        losses = (w * (q - y) ** 2).sum(1) / w.sum(1).clamp(min=1)
        losses.sum().backward()
        clip = self.spec["clip"]
        if clip is not None and clip[0] == "norm":
            vmapens.optim.clip_grad_norm_(self.online, clip[1])
        elif clip is not None:
            vmapens.optim.clip_grad_value_(self.online, clip[1])
        self.opt.step(mask=active)
        return losses.detach()

    def hard(self, how: str) -> None:
        if how == "polyak":
            polyak_(self.target, self.online, 1.0)
        elif how == "load_state_dict":
            self.target.load_state_dict(self.online.state_dict())
        elif how == "make_target":
            self.target = make_target(self.online)
            self.target_mode()
        else:
            self.target = copy.deepcopy(self.online).requires_grad_(False)
            self.target_mode()

    def save(self, tmp: Path) -> dict[str, Any]:
        vmapens.save(self.online, tmp / "online.pt", optimizer=self.opt)
        vmapens.save(self.target, tmp / "target.pt")
        return dict(subsets=self.subsets.get_state())

    def resume(self, tmp: Path, saved: dict[str, Any]) -> None:
        """New objects, as a new process builds them (the global RNG is the test's)."""
        if self.spec["resume_how"] == "load":
            self.online = vmapens.load(tmp / "online.pt", self.factory)
            self.opt = self.optimizer(self.online)
            vmapens.restore(tmp / "online.pt", self.online, self.opt)
            # Flags and modes are not in a checkpoint (docs/fit.md): set them again.
            self.target = vmapens.load(tmp / "target.pt", self.factory).requires_grad_(False)
        else:
            randomness = self.online.randomness
            self.online = vmapens.Ensemble(
                self.factory,
                n=self.spec["n"],
                seed=7,
                randomness=randomness,
                **self.spec["options"],
            )
            self.opt = self.optimizer(self.online)
            vmapens.restore(tmp / "online.pt", self.online, self.opt)
            self.target = make_target(self.online)
            vmapens.restore(tmp / "target.pt", self.target)
        self.target_mode()
        self.subsets = torch.Generator().set_state(saved["subsets"])
        self.step = self.make_step()


def tau_value(spec: dict[str, Any], t: int) -> Any:
    """Step ``t``'s tau as the user holds it (a tensor in the run's dtype: a float32 tensor
    would round 0.1, for the twins' ``lerp_`` alike)."""
    tau, dtype = spec["tau"][t], spec["dtype"]
    return {"float": tau, "numpy": np.float64(tau), "tensor": torch.tensor(tau, dtype=dtype)}[
        spec["tau_as"][t]
    ]


def run(spec: dict[str, Any], tmp: Path, *, interrupt: bool = True) -> dict[str, torch.Tensor]:
    """Run ``spec`` on the ensemble and on the twins, comparing after every step; return
    the final online and target state."""
    torch.manual_seed(spec["seed"])  # the dropout masks' stream
    n, dtype, tol = spec["n"], spec["dtype"], TOLS[spec["dtype"]]
    seeds = [1000 * spec["seed"] + i for i in range(n)]
    ens, twins = Program(spec, seeds), Twins(spec, seeds)
    data = torch.Generator().manual_seed(spec["seed"] + 1)
    assert_same(ens.online, twins.online, tol, "init")
    assert_same(ens.target, twins.target, tol, "init target")
    for t in range(spec["steps"]):
        where = f"step {t}"
        if interrupt and spec["resume"] == t:
            ens.resume(tmp, ens.save(tmp))
        b = spec["batches"][t]
        s, s2 = (torch.randn(b, OBS, generator=data, dtype=dtype) for _ in range(2))
        a = torch.randint(ACTIONS, (b,), generator=data)
        r = torch.randn(b, generator=data, dtype=dtype)
        d = (torch.rand(b, generator=data) < 0.2).to(dtype)
        w = (torch.rand(n, b, generator=data) < 0.6).to(dtype)
        w = w if spec["boot"] else torch.ones_like(w)
        active = torch.rand(n, generator=data) < 0.5 if spec["active"][t] else None
        subset = random_members(n, spec["k"], ens.subsets) if spec["td"] == "redq" else None

        state = torch.get_rng_state()
        y = ens.td_targets(s2, r, d, subset)
        after = torch.get_rng_state()
        torch.set_rng_state(state)
        y_twin = twins.td_targets(s2, r, d, subset)
        assert torch.equal(torch.get_rng_state(), after), f"{where}: the target's RNG draws"
        torch.testing.assert_close(y, y_twin, **tol, msg=lambda m, at=where: f"{at} TD: {m}")

        state = torch.get_rng_state()
        losses = ens.train(s, a, y, w, active)
        after = torch.get_rng_state()
        torch.set_rng_state(state)
        twin_losses = twins.train(s, a, y_twin, w, active)
        assert torch.equal(torch.get_rng_state(), after), f"{where}: the online RNG draws"
        kept = slice(None) if active is None else active
        torch.testing.assert_close(losses[kept], twin_losses[kept], **tol)
        assert_same(ens.online, twins.online, tol, where)

        update = spec["update"][t]
        if update == "soft":
            tau = tau_value(spec, t)
            polyak_(ens.target, ens.online, tau)
            twins.polyak(tau)
        elif update == "hard":
            ens.hard(spec["hard"][t])
            twins.hard(spec["hard"][t])
        assert_same(ens.target, twins.target, tol, f"{where} target")
        assert not any(p.requires_grad for p in ens.target.parameters()), where
        assert all(p.requires_grad for p in ens.online.parameters()), where

        if spec["act"][t] is not None:  # greedy actions, in eval mode, between steps
            grad_off = torch.no_grad if spec["act"][t] == "no_grad" else torch.inference_mode
            ens.online.eval()
            for m in twins.online:
                m.eval()
            with grad_off():
                q = ens.online(s2)
                q_twin = torch.stack([m(s2) for m in twins.online])
            ens.online.train()
            for m in twins.online:
                m.train()
            torch.testing.assert_close(q, q_twin, **tol)
        if spec["sub"][t]:  # a sub-ensemble, and its own target
            rows = sorted(random.Random(t).sample(range(n), max(1, n // 2)))
            sub = ens.online[rows]
            sub_target = make_target(sub)
            assert list(sub_target.member_ids) == [ens.online.member_ids[i] for i in rows]
            polyak_(sub_target, sub, 0.5)
            assert_same(sub_target, [twins.online[i] for i in rows], tol, f"{where} sub")
    return {
        **{f"online.{k}": v.detach().clone() for k, v in ens.online.state_dict().items()},
        **{f"target.{k}": v.detach().clone() for k, v in ens.target.state_dict().items()},
    }


def check(spec: dict[str, Any], tmp: Path) -> None:
    got = run(spec, tmp)
    if spec["resume"] is not None:  # a resume must be the run without it, bit for bit
        straight = run(spec, tmp, interrupt=False)
        assert list(got) == list(straight)
        for k in got:
            assert torch.equal(got[k], straight[k]), f"resume differs at {k}"


@pytest.mark.parametrize("seed", range(12))
def test_fuzz_rl(seed: int, tmp_path: Path) -> None:
    check(draw(seed), tmp_path)


# -- what the search found ---------------------------------------------------------------------


def q_ensemble(n: int = 3) -> vmapens.Ensemble:
    return vmapens.Ensemble(functools.partial(QNet, "mlp", 4), n=n, seed=0).double()


def lerped(target: vmapens.Ensemble, online: vmapens.Ensemble, tau: float) -> list[nn.Module]:
    """The truth: each target member moved toward its online member by plain ``lerp_``."""
    out = target.unstack()
    with torch.no_grad():
        for t, m in zip(out, online.unstack(), strict=True):
            for p, q in zip(t.parameters(), m.parameters(), strict=True):
                p.lerp_(q, tau)
    return out


def test_polyak_refuses_a_target_of_other_members_and_changes_nothing() -> None:
    # A target of all members following a reordered or re-selected online ensemble has the
    # same shapes: it used to move member 0 toward member 2, silently.
    online = q_ensemble()
    target = make_target(online)
    with torch.no_grad():
        for p in online.parameters():
            p.add_(1.0)
    before = copy.deepcopy(target.state_dict())
    with pytest.raises(ValueError, match=r"polyak_: `target` holds members \[0, 1, 2\]"):
        polyak_(target, online.select([2, 1, 0]), 0.5)
    torch.testing.assert_close(target.state_dict(), before, rtol=0, atol=0)
    # The same members of both, in the same order, follow as plain lerp_ does.
    sub_target, sub = target.select([2, 0]), online.select([2, 0])
    expected = lerped(sub_target, sub, 0.5)
    polyak_(sub_target, sub, 0.5)
    assert_same(sub_target, expected, TOLS[torch.float64], "sub")


def test_polyak_takes_a_tau_that_requires_grad_as_lerp_does() -> None:
    # A learned or scheduled tau held as a tensor with requires_grad: float() of it warned
    # (an error under pytest's warnings-as-errors); torch's lerp_ takes it under no_grad.
    online, tau = q_ensemble(), torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    target = make_target(online)
    with torch.no_grad():
        for p in online.parameters():
            p.mul_(2.0)
    expected = lerped(target, online, 0.3)
    polyak_(target, online, tau)
    assert_same(target, expected, TOLS[torch.float64], "tau")


@pytest.mark.parametrize(
    ("n", "k"),
    [(np.int64(5), 2), (5, np.int32(2)), (torch.tensor(5), torch.tensor(2)), (5, 2)],
    ids=["numpy-n", "numpy-k", "tensor-n-k", "ints"],
)
def test_random_members_takes_integer_likes_as_randperm_does(n: Any, k: Any) -> None:
    # `random_members(len(ens), k)` with k from NumPy (a config) or a 0-dim tensor: torch's
    # randperm takes both; random_members refused them ("`n` must be an int, got int64").
    mask = random_members(n, k, torch.Generator().manual_seed(3))
    assert mask.dtype == torch.bool and mask.shape == (5,) and int(mask.sum()) == 2
    assert torch.equal(mask, random_members(5, 2, torch.Generator().manual_seed(3)))
    with pytest.raises(TypeError, match=r"random_members: `k` must be an int, got float"):
        random_members(5, 2.0)
    with pytest.raises(TypeError, match=r"random_members: `n` must be an int, got bool"):
        random_members(True, 1)


if __name__ == "__main__":
    search(lambda seed, tmp: check(draw(seed), tmp), draw)
