"""A forward that edits its parameters in place (``nn.Embedding(max_norm=...)`` renormalises
the rows it looks up, then the optimizer steps the renormalised weight) under the compiled
step's first-call check (vmapens/_update_check.py): the check's eager reference starts from
the parameters as the forward left them. It once started from those before the forward and
refused the right compiled update ("differs by 1.88, its update is 0.05"), blaming
torch.compile; ``fit(compile="auto")`` then went on eagerly."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from parity import training_state
from torch import nn
from torch.nn import functional as F
from truth import assert_members_equal, train_each

import vmapens
from vmapens import CompiledStepMismatch
from vmapens._update_check import checked_call


class Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 4, max_norm=0.6)
        self.out = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(x).mean(1))


def _members() -> list[nn.Module]:
    torch.manual_seed(0)
    return [Bag().double() for _ in range(3)]


def _batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(20, (6, 5), generator=g), torch.randint(3, (6,), generator=g))
            for _ in range(count)]  # fmt: skip


def test_compiled_adam_on_max_norm_embeddings_trains_each_member_as_alone():
    members = _members()
    alone = [copy.deepcopy(m) for m in members]
    ens = vmapens.Ensemble.from_modules(members)
    opt = vmapens.StackedAdam(ens, lr=0.05)
    step = vmapens.make_step(ens, nn.CrossEntropyLoss(), opt, compile=True)  # check=True
    batches = _batches(3)
    for x, y in batches:
        step(x, y)
    train_each(
        alone, batches, F.cross_entropy, lambda i, m: torch.optim.Adam(m.parameters(), lr=0.05)
    )
    assert_members_equal(ens, alone)  # float64: the same maths, round-off of the order only


def _grads(ens: vmapens.Ensemble, x: torch.Tensor, y: torch.Tensor) -> tuple:
    """The losses and gradients of every member, the forward renormalising in place."""
    with torch.enable_grad():
        losses = torch.stack([F.cross_entropy(o, y) for o in ens(x)])
        return losses.detach(), list(torch.autograd.grad(losses.sum(), list(ens.parameters())))


def _check(kind: str, mask: torch.Tensor | None, held: str = "all", checked: bool = True) -> tuple:
    """``checked_call`` on an eager stand-in for the compiled graph: ``"right"`` (forward, then
    the update from what it left), ``"unedited"`` (the update from the parameters before the
    forward) or ``"wrong"`` (right, then member 1's embedding moved by 1e-6), with an optimizer
    that holds every parameter (``held="all"``) or the output layer's (``"out"``: the
    embedding is edited by the forward only). Returns the state before, the state after, and
    the error raised (or None); ``checked=False``: the stand-in alone."""
    ens = vmapens.Ensemble.from_modules(_members())
    names = [name for name, _ in ens.named_parameters()]
    order = names if held == "all" else [name for name in names if name.startswith("out.")]
    params = dict(ens.named_parameters())
    opt = vmapens.StackedAdam([params[name] for name in order], lr=0.05)
    opt.prepare()
    x, y = _batches(1)[0]

    def call() -> tuple:
        start = [p.detach().clone() for p in ens.parameters()]
        losses, grads = _grads(ens, x, y)
        if kind == "unedited":
            for p, s in zip(ens.parameters(), start, strict=True):
                p.copy_(s)
        mine = dict(zip(names, grads, strict=True))
        opt.apply_gradients([mine[name] for name in order], mask=mask)
        if kind == "wrong":
            ens.stacked_state()["emb.weight"][1].add_(1e-6)
        return losses, grads

    before, error = training_state(ens, opt), None
    with torch.no_grad():
        try:
            if checked:
                checked_call(call, lambda: ens(x), ens, opt, None, names, order, mask)
            else:
                call()
        except CompiledStepMismatch as e:
            error = e
    return before, training_state(ens, opt), error


MASK = torch.tensor([True, False, True])


@pytest.mark.parametrize(("mask", "held"), [(None, "all"), (MASK, "all"), (MASK, "out")])
def test_the_update_check_starts_from_the_parameters_as_the_forward_left_them(mask, held):
    before, after, error = _check("right", mask, held)
    assert error is None
    _, alone, _ = _check("right", mask, held, checked=False)
    assert not torch.equal(before[0], after[0])  # emb.weight: renormalised (and stepped)
    for got, want in zip(after, alone, strict=True):  # what the stand-in left, bit for bit
        assert torch.equal(got, want)


@pytest.mark.parametrize("kind", ["unedited", "wrong"])
@pytest.mark.parametrize(("mask", "held"), [(None, "all"), (MASK, "all"), (None, "out")])
def test_an_update_that_misses_the_forward_edit_or_is_wrong_is_refused(kind, mask, held):
    # With the mask, member 1 does not step: it keeps the forward's edit, to round-off.
    before, after, error = _check(kind, mask, held)
    member = "[02]" if kind == "unedited" else "1"
    assert error is not None
    said = rf"`emb.weight`( \(not in the optimizer\))? \(member {member}: differs"
    assert re.search(rf"{said}.*edits `emb.weight` in place", error.args[0])
    assert "most likely torch.compile" not in error.args[0]
    for got, want in zip(after, before, strict=True):  # the step changed nothing
        assert torch.equal(got, want)
