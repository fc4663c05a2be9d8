"""vmapens.export hunted further: every member of the served program (saved and loaded back)
against the member run alone as a plain module, float64."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from truth import twins

import vmapens

F64 = torch.float64


def _alone(modules: list[nn.Module], *xs: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack([copy.deepcopy(m).eval()(*xs) for m in modules])


class SoftmaxHead(nn.Module):
    """A head named as export's own flags: `softmax` (an nn.Softmax) and `reduce`."""

    def __init__(self) -> None:
        super().__init__()
        self.reduce = nn.Linear(4, 3)
        self.softmax = nn.Softmax(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.softmax(self.reduce(x))


@pytest.mark.parametrize("reduce", [None, "mean"])
def test_member_with_submodules_named_softmax_and_reduce_exports(reduce, tmp_path) -> None:
    """Was: TypeError "cannot assign 'bool' as child module 'softmax'" (the program set its
    flags as attributes over the member's own submodules)."""
    torch.manual_seed(0)
    modules = [SoftmaxHead().to(F64) for _ in range(3)]
    ens = vmapens.Ensemble.from_modules(twins(modules))
    x = torch.randn(5, 4, dtype=F64)
    torch.export.save(vmapens.export(ens, x, reduce=reduce), tmp_path / "p.pt2")
    served = torch.export.load(tmp_path / "p.pt2").module()
    want = _alone(modules, x)
    want = want if reduce is None else want.mean(0)
    torch.testing.assert_close(served(x), want, rtol=1e-12, atol=1e-12)


class PythonCounter(nn.Module):
    """State carried to the next call in a plain attribute, which ens(x) supports
    (docs/semantics.md) and a traced program cannot: it would be a constant there."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.fc(x) * self.calls


def test_export_leaves_attributes_the_forward_sets_as_they_were() -> None:
    """Was: each trace ran the forward on the ensemble's own modules, so after an export (even
    a refused one) `ens(x)` started two calls ahead of the members alone."""
    torch.manual_seed(0)
    modules = [PythonCounter().to(F64) for _ in range(2)]
    ens = vmapens.Ensemble.from_modules(twins(modules))
    x = torch.randn(5, 4, dtype=F64)
    for options in (dict(check=False), dict(reduce="mean")):  # refused: PythonCounter's below
        with pytest.raises(RuntimeError, match=r"export: the forward of PythonCounter changes"):
            vmapens.export(ens, x, **options)
    with torch.no_grad():
        got = [ens(x), ens(x)]
    for want in (_alone(modules, x), _alone(modules, x) * 2):  # calls 1, then 2
        torch.testing.assert_close(got.pop(0), want, rtol=1e-12, atol=1e-12)


class ActNorm(nn.Module):
    """Glow's ActNorm: a data-dependent initialisation, flagged done in a plain attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.register_buffer("loc", torch.zeros(3))
        self.initialized = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if not self.initialized:
            with torch.no_grad():
                self.loc.copy_(y.mean(0))
            self.initialized = True
        return y - self.loc


class ListCounter(PythonCounter):
    """State carried in a list it appends to: no plain value changes, the output does."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(1)
        return self.fc(x) * len(self.seen)


@pytest.mark.parametrize("cls", [PythonCounter, ActNorm, ListCounter])
def test_export_refuses_state_carried_in_a_plain_attribute(cls) -> None:
    """Was, with the attributes given back: the probe's first call agreed and the served
    program held the trace's value on every later call, silently (an uninitialised ActNorm
    re-initialised from every batch: off by 1.1 on a second input)."""
    torch.manual_seed(0)
    modules = [cls().to(F64) for _ in range(2)]
    ens = vmapens.Ensemble.from_modules(twins(modules))
    x = torch.randn(5, 4, dtype=F64)
    said = r"changes `(calls|initialized)` \((0|False) -> (1|True)\)|on a second call"
    with pytest.raises(RuntimeError, match=rf"export: .*({said}).*in a buffer"):
        vmapens.export(ens, x)
    with torch.no_grad():  # and left as it was: the ensemble runs its first call, as alone
        torch.testing.assert_close(ens(x), _alone(modules, x), rtol=1e-12, atol=1e-12)
    if cls is ActNorm:  # initialised (its way out): the program is the members
        y = torch.randn(5, 4, dtype=F64)
        served = vmapens.export(ens, x).module()
        initialised = [copy.deepcopy(m) for m in modules]
        with torch.no_grad():
            for m in initialised:
                m(x)  # their first call, as ens(x)'s
        torch.testing.assert_close(served(y), _alone(initialised, y), rtol=1e-12, atol=1e-12)
