"""Bug hunt, session 47 (b): random draws inside real members, trained with `make_step`
against each member alone with `torch.optim.SGD` (docs/semantics.md, "Randomness in the
forward pass").

The truth is plain PyTorch: members built after `torch.manual_seed(k)` (as `seeds=range(N)`
builds them), each trained alone. With `randomness="same"` the docs promise that each member
draws what it draws alone from the same random states, in the eager step, with `chunk_size` and
with `backend="loop"`; "the states put back before each turn are every state a turn draws from:
the global CPU generator, the current CUDA device's, and each `torch.Generator` passed to the
forward (`ens(x, g)`) or held by the member's modules". So the truth starts every member of a
step from the step's global RNG state and from the generator's state at that step.

Found here, fixed in session 47 (`Draws` finds generators as the self-check's
`generators_in` does, which now opens a `functools.partial` too):
- a `torch.Generator` shared by every member but held one level down on the module (a plain
  object `self.noise.g`, a dataclass `self.cfg.g`, a `functools.partial(torch.randn,
  generator=g)`) with `chunk_size=2` or `backend="loop"`: the turns after the first draw on
  from where the first turn left the generator (only generators that optree's leaves reach,
  directly or in lists, tuples and dicts, are put back: `vmapens/_chunks.py`, `Draws`), so
  those members train on other noise, silently (0.10-0.30 off in the parameters after 3 SGD
  steps). A direct attribute `self.g` trains as alone, and so does unchunked vmap.
- the same for a generator passed to the forward in a dataclass or a plain object
  (`ens(x, Noise(g))`), which the docs name as a place of the call's generators: with
  `chunk_size=2` or `backend="loop"` member 2 (the loop: members 1 and 2) gets other noise
  (outputs 2.2 off), and `make_step` trains them so.

Passing (not covered elsewhere): in-place draws of rarer distributions (`exponential_`,
`geometric_`, `cauchy_`, `random_`) into a tensor made like a member's activation, and
`rsample()` of `Laplace`, `StudentT`, `Uniform`, `RelaxedOneHotCategorical` and
`LowRankMultivariateNormal` over a member's own parameters, with `"same"`, all three ways of
running the members.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from truth import TOL64, seeded_members

import vmapens

pytestmark = pytest.mark.usefixtures("float64_default")

N, LR, STEPS = 3, 0.1, 3
TURNS = {"chunk": {"chunk_size": 2}, "loop": {"backend": "loop"}}
WAYS = {"vmap": {}, **TURNS}


def _batch() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)


def _assert_members(ens: vmapens.Ensemble, alone: list[nn.Module]) -> None:
    states = ens.state_dicts()
    for i, m in enumerate(alone):
        for k, v in m.state_dict().items():
            torch.testing.assert_close(
                states[i][k], v, **TOL64, msg=lambda m, i=i, k=k: f"member {i} {k}: {m}"
            )


def _sgd_alone(
    models: list[nn.Module],
    x: Tensor,
    y: Tensor,
    steps: int,
    inputs: Callable[[nn.Module], tuple] | None = None,
) -> None:
    """SGD steps of each model alone, every member of a step starting from the step's global
    RNG state (what "same" promises); ``inputs(model)`` gives a model its positional inputs."""
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in models]
    for _ in range(steps):
        start, end = torch.get_rng_state(), None
        for m, opt in zip(models, opts, strict=True):
            torch.set_rng_state(start)
            opt.zero_grad()
            F.mse_loss(m(*(inputs(m) if inputs else (x,))), y).backward()
            opt.step()
            end = torch.get_rng_state()
        torch.set_rng_state(end)


# -- a generator shared by the members, held one level down on the module --------------------


@dataclasses.dataclass
class NoiseConfig:
    g: torch.Generator


class NoiseSource:
    def __init__(self, g: torch.Generator) -> None:
        self.g = g


class HeldDeeper(nn.Module):
    """Noise from a generator held inside a plain attribute: a plain object, a dataclass, or
    a `functools.partial` of `torch.randn`."""

    def __init__(self, how: str, g: torch.Generator) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.how = how
        if how == "object":
            self.source = NoiseSource(g)
        elif how == "dataclass":
            self.cfg = NoiseConfig(g)
        else:
            self.noise = functools.partial(torch.randn, generator=g)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        if self.how == "object":
            return h + torch.randn(h.shape, generator=self.source.g)
        if self.how == "dataclass":
            return h + torch.randn(h.shape, generator=self.cfg.g)
        return h + self.noise(h.shape)


@pytest.mark.parametrize("kw", list(WAYS))
@pytest.mark.parametrize("how", ["object", "dataclass", "partial"])
def test_a_generator_held_inside_a_plain_attribute_with_same_trains_as_alone(
    how: str, kw: str
) -> None:
    """One generator shared by every member (as `NoiseHeld(shared)` in
    test_journey_random_forward.py, there a direct attribute), each member alone holding its
    own generator seeded alike: 3 `make_step` SGD steps equal each member's 3 steps alone.
    Fails with `chunk_size=2` and `backend="loop"` (0.10-0.30 off): the turns after the first
    draw from the generator as the first turn left it."""
    x, y = _batch()
    shared = torch.Generator().manual_seed(7)
    ens = vmapens.Ensemble(
        lambda: HeldDeeper(how, shared), N, seeds=range(N), randomness="same", **WAYS[kw]
    )
    alone = []
    for k in range(N):
        torch.manual_seed(k)
        alone.append(HeldDeeper(how, torch.Generator().manual_seed(7)))
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedSGD(ens, lr=LR))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(STEPS):
            step(x, y)
    _sgd_alone(alone, x, y, STEPS)
    _assert_members(ens, alone)


# -- a generator passed to the forward inside a dataclass or a plain object -------------------


class NoiseFrom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: Tensor, source: Any) -> Tensor:
        h = self.fc(x)
        return h + torch.randn(h.shape, generator=source.g)


@pytest.mark.parametrize("kw", list(WAYS))
@pytest.mark.parametrize("box", [NoiseConfig, NoiseSource], ids=["dataclass", "object"])
def test_a_generator_passed_inside_a_dataclass_with_same_draws_as_alone(box: type, kw: str) -> None:
    """`ens(x, NoiseConfig(g))` under `no_grad`: each member's output as alone given a
    generator in g's state; g left where one member alone leaves it. Fails in turns (2.2
    off: member 2 with `chunk_size=2`, members 1 and 2 with the loop)."""
    x, _ = _batch()
    ens = vmapens.Ensemble(NoiseFrom, N, seeds=range(N), randomness="same", **WAYS[kw])
    alone = seeded_members(NoiseFrom, N)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        out = ens(x, box(g))
    want, end = [], None
    for m in alone:
        own = torch.Generator().manual_seed(9)
        with torch.no_grad():
            want.append(m(x, box(own)))
        end = own.get_state()
    torch.testing.assert_close(out, torch.stack(want), **TOL64)
    assert torch.equal(g.get_state(), end)


@pytest.mark.parametrize("kw", list(TURNS))
def test_make_step_with_a_generator_passed_inside_a_dataclass_trains_as_alone(kw: str) -> None:
    """`step((x, NoiseConfig(g)), y)`, 3 SGD steps, each member alone starting every step from
    g's state at that step. Fails in turns, silently (no refusal, no warning; 0.04-0.12
    off in the parameters)."""
    x, y = _batch()
    ens = vmapens.Ensemble(NoiseFrom, N, seeds=range(N), randomness="same", **TURNS[kw])
    alone = seeded_members(NoiseFrom, N)
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedSGD(ens, lr=LR))
    g = torch.Generator().manual_seed(9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(STEPS):
            step((x, NoiseConfig(g)), y)
    g = torch.Generator().manual_seed(9)
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in alone]
    for _ in range(STEPS):
        start, end = g.get_state(), None
        for m, opt in zip(alone, opts, strict=True):
            g.set_state(start)
            opt.zero_grad()
            F.mse_loss(m(x, NoiseConfig(g)), y).backward()
            opt.step()
            end = g.get_state()
        g.set_state(end)
    _assert_members(ens, alone)


# -- passing: rarer draws with "same" ---------------------------------------------------------


DRAWS: dict[str, Callable[[Tensor], Tensor]] = {
    "exponential_": lambda h: h * torch.empty_like(h).exponential_(),
    "geometric_": lambda h: h * torch.empty_like(h).geometric_(0.3),
    "cauchy_": lambda h: h + 0.01 * torch.empty_like(h).cauchy_(),
    "random_": lambda h: h * torch.empty_like(h).random_(0, 3),
    "Laplace.rsample": lambda h: torch.distributions.Laplace(h, 1.0).rsample(),
    "StudentT.rsample": lambda h: torch.distributions.StudentT(3.0, h, 1.0).rsample(),
    "Uniform.rsample": lambda h: torch.distributions.Uniform(h, h + 1).rsample(),
    "RelaxedOneHotCategorical.rsample": lambda h: torch.distributions.RelaxedOneHotCategorical(
        torch.tensor(0.5), logits=h
    ).rsample(),
    "LowRankMultivariateNormal.rsample": lambda h: torch.distributions.LowRankMultivariateNormal(
        h, 0.1 * torch.ones(4, 1), torch.ones(4)
    ).rsample(),
}


class Drawn(nn.Module):
    def __init__(self, draw: str) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)
        self.draw = draw

    def forward(self, x: Tensor) -> Tensor:
        return self.b(DRAWS[self.draw](self.a(x)))


@pytest.mark.parametrize("kw", list(WAYS))
@pytest.mark.parametrize("draw", list(DRAWS))
def test_rarer_draws_with_same_train_as_alone(draw: str, kw: str) -> None:
    x, y = _batch()
    ens = vmapens.Ensemble(lambda: Drawn(draw), N, seeds=range(N), randomness="same", **WAYS[kw])
    alone = seeded_members(lambda: Drawn(draw), N)
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedSGD(ens, lr=LR))
    torch.manual_seed(11)
    for _ in range(2):
        step(x, y)
    after = torch.get_rng_state()
    torch.manual_seed(11)
    _sgd_alone(alone, x, y, 2)
    _assert_members(ens, alone)
    assert torch.equal(after, torch.get_rng_state())
