"""State a forward keeps in a dict or a list on its module, against each member alone.

A key/value cache ``self.cache = {"k": k}`` (reassigned, or edited in place
``self.cache["k"] = k``), activations collected with ``self.acts.append(h)``, a nested cache
``{"layer": (k, v)}``. Under one vmap the next call read the batched tensor the call before
left on the module, which happened to work; run in turns (``chunk_size`` below ``n``,
``backend="loop"``) every member after the first read the one before's, from the first call
(1.6-4.8 off in the outputs), and ``ens[i].cache`` was ``__init__``'s. The truth: the members
(``ens.unstack()`` before any call) run and trained alone, float64.
"""

from __future__ import annotations

import collections
import copy
from typing import Any

import optree
import pytest
import torch
from torch import Tensor, nn

import vmapens

pytestmark = pytest.mark.usefixtures("float64_default")

N = 3
RUNS = [{}, {"chunk_size": 1}, {"chunk_size": 2}, {"backend": "loop"}]
RUN_IDS = ["vmap", "chunks-1", "chunks-2", "loop"]


class DictSet(nn.Module):
    """``self.cache = {...}``: a new dict every call."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.cache: dict[str, Tensor] = {}

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        if "k" in self.cache:
            h = h + self.cache["k"]
        self.cache = {"k": h.detach()}
        return h


class DictEdited(DictSet):
    """``self.cache["k"] = ...``: the dict of ``__init__``, edited in place."""

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        if "k" in self.cache:
            h = h * self.cache["k"].tanh()
        self.cache["k"] = h.detach()
        return h


class ListAppended(nn.Module):
    """``self.acts.append(h)``: one more tensor every call, read back."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.acts: list[Tensor] = []

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        for a in self.acts:
            h = h + 0.5 * a.mean(0)
        self.acts.append(h.detach())
        return h


class NestedCache(nn.Module):
    """A cache by layer, ``{"fc": (k, v)}``, set in place, read back."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.cache: dict[str, tuple[Tensor, Tensor]] = {}

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        if "fc" in self.cache:
            k, v = self.cache["fc"]
            h = h + k - v.mean(0)
        self.cache["fc"] = (h.detach(), (2 * h).detach())
        return h


KINDS = [DictSet, DictEdited, ListAppended, NestedCache]
ATTR = {DictSet: "cache", DictEdited: "cache", ListAppended: "acts", NestedCache: "cache"}


def _leaves(value: Any) -> list[Tensor]:
    return optree.tree_leaves(value)


def _assert_kept(ens: vmapens.Ensemble, alone: list[nn.Module], attr: str) -> None:
    """``ens[i]``'s kept value is member i's alone, in the same form."""
    for i, m in enumerate(alone):
        want, got = getattr(m, attr), getattr(ens[i], attr)
        assert optree.tree_structure(got) == optree.tree_structure(want)
        for g, w in zip(_leaves(got), _leaves(want), strict=True):
            torch.testing.assert_close(g, w, atol=1e-12, rtol=0)


@pytest.mark.parametrize("kw", RUNS, ids=RUN_IDS)
@pytest.mark.parametrize("cls", KINDS, ids=lambda c: c.__name__)
def test_a_forward_keeping_a_dict_or_list_runs_as_alone(cls: type, kw: dict) -> None:
    ens = vmapens.Ensemble(cls, n=N, seed=0, **kw)
    alone = [copy.deepcopy(m) for m in ens.unstack()]
    g = torch.Generator().manual_seed(0)
    # A cache read back ties the batch size; the activations' mean does not
    for rows in (4, 4, 6) if cls is ListAppended else (4, 4, 4):
        x = torch.randn(rows, 3, generator=g)
        got, want = ens(x), torch.stack([m(x) for m in alone])
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    _assert_kept(ens, alone, ATTR[cls])


@pytest.mark.parametrize("kw", RUNS, ids=RUN_IDS)
@pytest.mark.parametrize("cls", [DictSet, DictEdited, NestedCache], ids=lambda c: c.__name__)
def test_a_step_reading_a_kept_dict_trains_as_alone(cls: type, kw: dict) -> None:
    ens = vmapens.Ensemble(cls, n=N, seed=0, **kw)
    alone = [copy.deepcopy(m) for m in ens.unstack()]
    loss_fn = nn.MSELoss()
    step = vmapens.make_step(ens, loss_fn, vmapens.StackedSGD(ens, lr=0.1))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in alone]
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(5, 3, generator=g), torch.randn(5, 3, generator=g)
        losses = step(x, y)
        for i, (m, opt) in enumerate(zip(alone, opts, strict=True)):
            opt.zero_grad()
            loss = loss_fn(m(x), y)
            loss.backward()
            opt.step()
            torch.testing.assert_close(losses[i], loss.detach(), atol=1e-12, rtol=0)
    for i, m in enumerate(alone):
        for name, t in m.state_dict().items():
            torch.testing.assert_close(ens[i].state_dict()[name], t, atol=1e-12, rtol=0)
    _assert_kept(ens, alone, ATTR[cls])


@pytest.mark.parametrize("kw", RUNS[:2], ids=RUN_IDS[:2])
def test_a_kept_dict_reset_on_the_template_resets_every_member(kw: dict) -> None:
    ens = vmapens.Ensemble(DictEdited, n=N, seed=0, **kw)
    alone = [copy.deepcopy(m) for m in ens.unstack()]
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(2))
    ens(x)
    for m in alone:
        m(x)
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in alone]), atol=1e-12, rtol=0)
    # A reset on the template reaches every member, as on each module alone
    ens.template.cache = {}
    for m in alone:
        m.cache = {}
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in alone]), atol=1e-12, rtol=0)


class Layer(nn.Module):
    def __init__(self, sink: list[Tensor]) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.sink = sink  # the root's list: shared by every layer

    def forward(self, x: Tensor) -> Tensor:
        h = self.lin(x)
        self.sink.append(h.pow(2).mean())
        return h


class SharedSink(nn.Module):
    """One list the root and its layers share (an activity regulariser's terms)."""

    def __init__(self) -> None:
        super().__init__()
        self.sink: list[Tensor] = []
        self.l1, self.l2 = Layer(self.sink), Layer(self.sink)

    def forward(self, x: Tensor) -> Tensor:
        self.sink.clear()
        y = self.l2(self.l1(x))
        return y.sum(-1) + sum(self.sink)


@pytest.mark.parametrize("kw", RUNS, ids=RUN_IDS)
def test_a_list_shared_by_several_modules_stays_shared(kw: dict) -> None:
    # A first version of the container stacking gave each module its own copy of the list
    # (0.8-0.9 off: the root's sum lost the layers' terms)
    ens = vmapens.Ensemble(SharedSink, n=N, seed=0, **kw)
    alone = [copy.deepcopy(m) for m in ens.unstack()]
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(3))
    for _ in range(3):
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in alone]), atol=1e-12, rtol=0)
    assert ens.runner.sink is ens.runner.l1.sink is ens.runner.l2.sink


class Windowed(nn.Module):
    """A list that empties itself every other call, and a deque of the last two states."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.acts: list[Tensor] = []
        self.hist: collections.deque[Tensor] = collections.deque(maxlen=2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x) + (sum(self.acts) if self.acts else 0)
        h = h + (sum(self.hist) if self.hist else 0)
        self.acts.append(h.detach())
        self.hist.append(h.detach().tanh())
        if len(self.acts) > 1:
            self.acts.clear()
        return h


@pytest.mark.parametrize("kw", RUNS, ids=RUN_IDS)
def test_a_kept_list_emptied_and_a_deque_run_as_alone_and_copy(kw: dict) -> None:
    # An emptied list kept the stack of the call before, handed back (3.9 off); a deque's
    # stacks were left in copies (deepcopy failed on their graph)
    ens = vmapens.Ensemble(Windowed, n=N, seed=0, **kw)
    alone = [copy.deepcopy(m) for m in ens.unstack()]
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(4))
    for _ in range(4):
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in alone]), atol=1e-12, rtol=0)
        copy.deepcopy(ens)
        assert isinstance(ens[0].hist, collections.deque)


class TensorKeys(nn.Module):
    """A memo keyed by tensors (optree cannot sort its keys): no state, left as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 1)
        self.memo: dict[Tensor, int] = {}

    def forward(self, x: Tensor) -> Tensor:
        self.memo[torch.ones(2)] = 1
        return self.fc(x)


@pytest.mark.parametrize("kw", RUNS, ids=RUN_IDS)
def test_a_dict_keyed_by_tensors_runs(kw: dict) -> None:
    ens = vmapens.Ensemble(TensorKeys, n=N, seed=0, **kw)
    alone = [copy.deepcopy(m) for m in ens.unstack()]
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(5))
    for _ in range(2):
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in alone]), atol=1e-12, rtol=0)


class GainsACount(nn.Module):
    """A cache that holds tensors alone at the first call, then a count beside them."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.cache: dict[str, Any] = {}

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        if "k" in self.cache:
            h = h + self.cache["k"]
            self.cache["n"] = self.cache.get("n", 0) + 1
        self.cache["k"] = h.detach()
        return h * (1 + self.cache.get("n", 0))


def test_a_kept_dict_that_comes_to_hold_a_count_is_handed_back_no_more() -> None:
    # Stacked at the first call, then no member's own (a count beside the tensor): the stack
    # of the first call was handed back at every call after (19-46 off). Under one vmap the
    # module the members run keeps its own, as before such dicts were stacked. (In turns a
    # dict holding plain values is not each member's own: docs/semantics.md.)
    ens = vmapens.Ensemble(GainsACount, n=N, seed=0)
    alone = [copy.deepcopy(m) for m in ens.unstack()]
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(6))
    for _ in range(4):
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in alone]), atol=1e-12, rtol=0)
