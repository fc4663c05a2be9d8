"""Hunt: state a member's forward carries in plain attributes, with members run in turns.

A member's parameters and buffers are stacked per member; any other attribute (a Python
counter, a flag set on the first call as in Glow's ActNorm, a tensor kept for the next call)
lives once on the module all members run. With ``backend="loop"`` or ``chunk_size`` below
``n`` member ``i`` read what member ``i - 1`` left there: every member after the first trained
elsewhere than alone, without an error. The first-step self-check now refuses it; one run for
all members (vmap, no ``chunk_size``) stays exact, and so does the way out, a buffer.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn
from truth import TOL64, assert_members_equal, train_each

import vmapens

N = 3
STEPS = 3


class Counted(nn.Module):
    """Scales its output by the number of calls so far, a Python int."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.fc(x) * self.calls


class ActNorm(nn.Module):
    """Glow's data-dependent init: the first call sets the shift from the batch, once."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.loc = nn.Parameter(torch.zeros(2))
        self.initialized = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if not self.initialized:
            with torch.no_grad():
                self.loc.copy_(-h.mean(0))
            self.initialized = True
        return h + self.loc


class Carried(nn.Module):
    """Adds the previous call's output (a stateful model carrying a tensor across batches)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.previous: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if self.previous is not None:
            y = y + self.previous
        self.previous = y.detach()
        return y


class Appended(nn.Module):
    """Scales its output by the length of a list it appends to."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.shape[0])
        return self.fc(x) * len(self.seen)


class EditedTensor(nn.Module):
    """Edits a plain tensor attribute (no buffer) in place and scales by it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.scale = torch.ones(2, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.scale.mul_(2.0)
        return self.fc(x) * self.scale.clone()


class KeptOnly(nn.Module):
    """Keeps its last output on the module but never reads it: nothing to refuse."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.last: torch.Tensor | None = None
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last = y = self.fc(x)
        self.calls += 1  # counted, never read
        return y


class BufferCounted(nn.Module):
    """The way out: ``Counted`` with its count in a buffer, one row per member."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.register_buffer("calls", torch.zeros((), dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = self.calls + 1
        return self.fc(x) * self.calls.clone()


class MemberScaled(nn.Module):
    """Keeps a float read from its own weights for the next call (``.item()``: the loop only):
    a plain value, but each member alone holds its own."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.scale: float | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x) if self.scale is None else self.fc(x) * self.scale
        self.scale = float(self.fc.weight.detach().abs().sum())
        return y


CARRYING = [Counted, ActNorm, Carried, Appended, EditedTensor]
IN_TURNS = {"loop": dict(backend="loop"), "chunk": dict(chunk_size=2)}


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(6, 3, generator=g, dtype=torch.float64), torch.randn(6, 2, generator=g))
        for _ in range(STEPS)
    ]


def _factory(cls: type[nn.Module]) -> Callable[[], nn.Module]:
    return lambda: cls().double()


def _train(ens: vmapens.Ensemble, check: bool = True) -> list[nn.Module]:
    """Train ``ens`` with the eager step; return its members alone trained on the same
    batches with ``torch.optim.SGD`` (copies taken before)."""
    alone = [copy.deepcopy(m) for m in ens.unstack()]
    batches = [(x, y.double()) for x, y in _batches()]
    opt = vmapens.StackedSGD(ens, lr=0.1)
    step = vmapens.make_step(ens, nn.MSELoss(), opt, check=check)
    for x, y in batches:
        step(x.clone(), y)
    train_each(alone, batches, nn.MSELoss(), lambda i, m: torch.optim.SGD(m.parameters(), lr=0.1))
    return alone


@pytest.mark.parametrize("cls", [Counted, ActNorm], ids=lambda c: c.__name__)
def test_plain_values_carried_in_chunks_train_as_alone_with_the_checked_step(
    cls: type[nn.Module],
) -> None:
    # Every turn starts from the plain values of the call (_plain_turns), the same for every
    # member under vmap: the probe lets them through (it refused them; they trained as alone).
    ens = vmapens.Ensemble(_factory(cls), n=N, seed=0, **IN_TURNS["chunk"])
    alone = _train(ens)
    assert_members_equal(ens, alone, **TOL64)
    x, y = _batches()[0]
    vmapens.check(ens, x, y.double(), nn.MSELoss())  # passes


@pytest.mark.parametrize("how", IN_TURNS)
def test_a_tensor_set_and_read_back_in_turns_trains_as_alone_with_the_checked_step(
    how: str,
) -> None:
    # Each turn (a chunk, a member of the loop) gets its members' rows of what the forwards
    # set before (vmapens._kept): the probe lets it through (it refused it).
    ens = vmapens.Ensemble(_factory(Carried), n=N, seed=0, **IN_TURNS[how])
    alone = _train(ens)
    assert_members_equal(ens, alone, **TOL64)
    x, y = _batches()[0]
    vmapens.check(ens, x, y.double(), nn.MSELoss())  # passes


@pytest.mark.parametrize(
    "cls, how",
    [
        (c, h)
        for c in CARRYING
        for h in IN_TURNS
        if c is not Carried and (c not in (Counted, ActNorm, Appended) or h == "loop")
    ],
    ids=lambda v: v if isinstance(v, str) else v.__name__,
)
def test_state_carried_in_plain_attributes_is_refused_in_turns(
    cls: type[nn.Module], how: str
) -> None:
    unchecked = vmapens.Ensemble(_factory(cls), n=N, seed=0, **IN_TURNS[how])
    alone = _train(unchecked, check=False)
    # A list of ints appended to: a turn starts from a new list of the items the call found
    # (session 45; every member appended to one list before, silently)
    if cls in (
        Counted,
        ActNorm,
        Appended,
    ):  # the same for every member, but the loop cannot tell it
        assert_members_equal(unchecked, alone, **TOL64)  # from one a member holds its own of
    else:  # what the probe refuses: members trained elsewhere
        with pytest.raises(AssertionError):
            assert_members_equal(unchecked, alone, **TOL64)
    ens = vmapens.Ensemble(_factory(cls), n=N, seed=0, **IN_TURNS[how])
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1))
    x, y = _batches()[0]
    with pytest.raises(RuntimeError, match="register_buffer") as err:
        step(x, y.double())
    assert cls.__name__ in str(err.value) and "Nothing was changed" in str(err.value)
    for key, value in ens.state_dict().items():
        assert torch.equal(value, before[key]), key
    with pytest.raises(RuntimeError, match="register_buffer"):
        vmapens.check(ens, x, y.double(), nn.MSELoss())


def test_a_plain_value_each_member_holds_its_own_of_is_refused_in_turns() -> None:
    unchecked = vmapens.Ensemble(_factory(MemberScaled), n=N, seed=0, backend="loop")
    alone = _train(unchecked, check=False)
    with pytest.raises(AssertionError):  # every turn read the last member's scale
        assert_members_equal(unchecked, alone, **TOL64)
    ens = vmapens.Ensemble(_factory(MemberScaled), n=N, seed=0, backend="loop")
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1))
    x, y = _batches()[0]
    with pytest.raises(RuntimeError, match=r"`scale` \([0-9.]+\).*backend='loop'"):
        step(x, y.double())
    for key, value in ens.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_a_counter_read_in_compiled_chunks_is_still_refused() -> None:
    # The compiled step's chunks run inside its graph, without _plain_turns: trained with
    # check=False, Counted with chunk_size=2 ended 0.1-1 off alone (runner.calls 7 after 3
    # steps; measured once, not run here: a compile). The probe refuses before it compiles.
    ens = vmapens.Ensemble(_factory(Counted), n=N, seed=0, chunk_size=2)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    opt = vmapens.StackedSGD(ens, lr=0.1)
    step = vmapens.make_step(ens, nn.MSELoss(), opt, compile=True)
    x, y = _batches()[0]
    with pytest.raises(RuntimeError, match=r"`calls` \(1\).*chunk_size=2"):
        step(x, y.double())
    for key, value in ens.state_dict().items():
        assert torch.equal(value, before[key]), key


@pytest.mark.parametrize("cls", CARRYING, ids=lambda c: c.__name__)
def test_one_run_for_all_members_carries_state_as_alone(cls: type[nn.Module]) -> None:
    ens = vmapens.Ensemble(_factory(cls), n=N, seed=0)
    alone = _train(ens)
    assert_members_equal(ens, alone, **TOL64)


@pytest.mark.parametrize("how", list(IN_TURNS), ids=list(IN_TURNS))
@pytest.mark.parametrize("cls", [KeptOnly, BufferCounted], ids=lambda c: c.__name__)
def test_state_never_read_or_in_a_buffer_trains_as_alone_in_turns(
    cls: type[nn.Module], how: str
) -> None:
    ens = vmapens.Ensemble(_factory(cls), n=N, seed=0, **IN_TURNS[how])
    alone = _train(ens)
    assert_members_equal(ens, alone, **TOL64)
