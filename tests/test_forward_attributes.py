"""Plain values a member's forward sets on itself (a flag set on the first call, as Glow's
ActNorm's ``initialized``, a Python counter) come back in ``ens[i]`` and ``ens.unstack()``
as on the module trained alone. Truth: the plain modules trained alone with torch.optim."""

from __future__ import annotations

import copy

import torch
from torch import nn

import vmapens


class Scaled(nn.Module):
    """A child whose forward counts its calls (a Python int) and remembers a tuple."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, 2)
        self.calls = 0
        self.shape_seen: tuple[int, ...] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.shape_seen = tuple(x.shape)
        return self.lin(x) * (1.0 + 0.1 * self.calls)


class Warmed(nn.Module):
    """The first call takes another branch and sets a flag (ActNorm's ``initialized``)."""

    def __init__(self, width: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(3, width)
        self.head = Scaled(width)
        self.initialized = False
        self.mode = "start"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if not self.initialized:
            self.initialized = True
            self.mode = "warm"
            h = h * 0.5
        return self.head(h)


def _train_alone(models: list[nn.Module], x: torch.Tensor, y: torch.Tensor, steps: int) -> None:
    for m in models:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(steps):
            opt.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()


def _train_ensemble(ens: vmapens.Ensemble, x: torch.Tensor, y: torch.Tensor, steps: int) -> None:
    opt = torch.optim.SGD(ens.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        out = ens(x)
        sum(nn.functional.mse_loss(o, y) for o in out).backward()
        opt.step()


def _attributes(m: nn.Module, sized: bool = True) -> list[object]:
    # padded members run at the largest size: a value from a shape is that size's (docs)
    shape = m.head.shape_seen if sized else None
    return [m.initialized, m.mode, m.head.calls, shape]


def _check_members(
    ens: vmapens.Ensemble, alone: list[nn.Module], x: torch.Tensor, sized: bool = True
) -> None:
    for members in ([ens[i] for i in range(len(ens))], ens.unstack()):
        for member, plain in zip(members, alone, strict=True):
            assert _attributes(member, sized) == _attributes(plain, sized)
            # the next forward of each (on copies: it sets the attributes again)
            got, want = copy.deepcopy(member)(x), copy.deepcopy(plain)(x)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_members_keep_what_forward_set() -> None:
    torch.manual_seed(0)
    alone = [Warmed().double() for _ in range(3)]
    ens = vmapens.Ensemble.from_modules(alone)
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    _train_ensemble(ens, x, y, 3)
    _train_alone(alone, x, y, 3)
    _check_members(ens, alone, x)


def test_members_of_different_sizes_keep_what_forward_set() -> None:
    torch.manual_seed(0)
    widths = [2, 4, 3]
    alone = [Warmed(w).double() for w in widths]
    start = [copy.deepcopy(m) for m in alone]
    ens = vmapens.Ensemble.from_factories([lambda m=m: copy.deepcopy(m) for m in start])
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    _train_ensemble(ens, x, y, 2)
    _train_alone(alone, x, y, 2)
    _check_members(ens, alone, x, sized=False)


def test_loop_members_keep_what_the_template_ran_with() -> None:
    # backend="loop" runs every member on the template in turns, each from the plain values
    # the template held before the call (docs/semantics.md), and ens[i] is built from it
    ens = vmapens.Ensemble(Warmed, n=3, seed=0, backend="loop").double()
    ens(torch.randn(4, 3, dtype=torch.float64))
    for member in (ens[2], ens.unstack()[0]):
        assert member.initialized and member.mode == "warm"
        assert member.head.calls == ens.template.head.calls == 1  # one call, as alone


def test_a_value_set_on_the_template_afterwards_wins() -> None:
    torch.manual_seed(0)
    plain = Warmed().double()
    ens = vmapens.Ensemble.from_modules([plain])
    x = torch.randn(4, 3, dtype=torch.float64)
    ens(x), plain(x)
    ens.template.mode = plain.mode = "manual"  # as on a plain module: the last value set
    ens.template.head.calls = plain.head.calls = 7
    assert _attributes(ens[0]) == _attributes(plain)
    torch.testing.assert_close(ens(x)[0], plain(x), rtol=1e-12, atol=1e-12)
    assert _attributes(ens.unstack()[0]) == _attributes(plain)
