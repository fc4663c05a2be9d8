"""Hunt (session 48, i): what a forward keeps on its module (an aux loss, a hidden state read
back, a dict or list of tensors) under a torch.func transform of the caller's own (a vmap over
data sets, grad / hessian in the input, nested), and the plain call or step after it. Every
result is compared with each member alone (``ens.unstack()`` taken first) in the same
transform, in float64.

Found and fixed in session 48 (loud errors where each member alone runs, none silent): after
the caller's vmap ended, the next plain call or step was handed the dead batched stack
(`_kept._stacked_rows` hands such a value out no more, as alone the forward sets it anew); a
hidden state kept under a second-order transform (`hessian`, grad of grad) was handed back
still wrapped (`_kept_stacks.revived` unwraps a grad transform that has ended, as such a
tensor computes alone); a kept dict or list under the caller's transform failed reading its
tensors' storage (`_boxes.place`)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad, hessian, vmap

import vmapens

N = 3
TOL = {"rtol": 1e-10, "atol": 1e-12}
OPTIONS = [{}, {"backend": "loop"}, {"chunk_size": 2}]
Y = torch.tensor([0, 1, 2, 3, 1, 2])
# torch's forward-mode rules (hessian) load their decompositions with torch.jit.script, alone too.
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning"
)


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


class AuxPenalty(nn.Module):
    """Sets an aux loss every call and never reads it back (an MoE's balance loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.aux = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        self.aux = h.pow(2).mean()
        return h


class Recurrent(nn.Module):
    """A hidden state carried to the next call (detached, as truncated BPTT keeps it)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.h = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x) + (0 if self.h is None else self.h))
        self.h = h.detach()
        return h


class Kept(nn.Module):
    """Keeps two penalties in a given form for the loss to read."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.fc, self.form, self.st = nn.Linear(3, 4), form, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        a, b = h.pow(2).mean(), h.mean()
        self.st = {
            "dict": lambda: {"a": a, "b": b},
            "list": lambda: [a, b],
            "tuple": lambda: (a, b),
            "const": lambda: torch.ones((), dtype=h.dtype) * 0.5,  # shared by all members
            "input": lambda: x.pow(2).mean(),  # made from the input only
        }[self.form]()
        return h


def read(st, form: str) -> torch.Tensor:
    if form == "dict":
        return st["a"] + st["b"]
    if form in ("list", "tuple"):
        return st[0] * st[1]
    return st


def pair(factory: Callable[[], nn.Module], **options) -> tuple[vmapens.Ensemble, list[nn.Module]]:
    ens = vmapens.Ensemble(factory, n=N, seed=0, **options).double()
    return ens, [copy.deepcopy(m) for m in ens.unstack()]


def same_state(ens: vmapens.Ensemble, members: list[nn.Module]) -> None:
    for i, m in enumerate(members):
        for k, v in m.state_dict().items():
            torch.testing.assert_close(ens.state_dicts()[i][k], v, **TOL)


# -- a plain call / a step after the caller's vmap over data sets ------------------------------
#
# Since today's change (vmapens/_kept_stacks.py:_rows keeps a tensor of a transform still
# running), vmap(ens)(xs) leaves on the template the kept aux loss as the user's BatchedTensor,
# which is dead once the user's vmap returns. The next plain call hands it back to the members
# (vmapens/_kept.py:kept_rows -> call_noting's ``given``, or KeptTurns with loop) and fails,
# though the forward only overwrites it: "INTERNAL ASSERT FAILED ... batched_level" (vmap),
# "your tensor may have escaped" (chunk_size), "zip() argument 2 is shorter than argument 1"
# (loop). Each member alone runs on: vmap(m)(xs); m(x) is a plain call. make_step fails the
# same way, and its message claims member 0 alone fails too.


@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_a_plain_call_after_the_users_vmap_over_data_sets_runs_as_alone(options) -> None:
    ens, members = pair(AuxPenalty, **options)
    xs, x = randn(2, 6, 3), randn(6, 3, seed=1)
    vmap(ens)(xs)
    for m in members:
        vmap(m)(xs)
    out = ens(x)  # raises on the current code
    torch.testing.assert_close(out, torch.stack([m(x) for m in members]), **TOL)
    torch.testing.assert_close(ens.template.aux, torch.stack([m.aux for m in members]), **TOL)


@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_make_step_after_the_users_vmap_over_data_sets_trains_as_alone(options) -> None:
    ens, members = pair(AuxPenalty, **options)
    xs, x = randn(2, 6, 3), randn(6, 3, seed=1)
    vmap(ens)(xs)
    for m in members:
        vmap(m)(xs)
    opt = torch.optim.SGD(ens.parameters(), lr=0.1)
    step = vmapens.make_step(ens, lambda o, t: F.cross_entropy(o, t) + ens.template.aux, opt)
    for _ in range(2):
        step(x, Y)
    for m in members:
        o = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(2):
            o.zero_grad()
            (F.cross_entropy(m(x), Y) + m.aux).backward()
            o.step()
    same_state(ens, members)


# -- a hidden state kept under a second-order transform, then a plain call ----------------------
#
# hessian / grad-of-grad in the input: the state kept there is wrapped twice. Alone the next
# plain call reads its values; the ensemble's vmap path fails ("wrapper == nullptr INTERNAL
# ASSERT FAILED ... Interpreter.cpp"), chunk_size and loop go on as alone.

SECOND_ORDER = {
    "hessian": lambda f, x: hessian(lambda z: f(z).sum())(x),
    "grad_of_grad": lambda f, x: grad(lambda z: grad(lambda w: f(w).pow(2).sum())(z).sum())(x),
}


@pytest.mark.parametrize("options", OPTIONS, ids=str)
@pytest.mark.parametrize("how", list(SECOND_ORDER))
def test_a_hidden_state_kept_under_a_second_order_transform_goes_on_as_alone(how, options) -> None:
    ens, members = pair(Recurrent, **options)
    x, x2 = randn(4, 3), randn(4, 3, seed=1)
    ens(x)
    for m in members:
        m(x)
    got = SECOND_ORDER[how](ens, x)  # the members' sum
    alone = sum(SECOND_ORDER[how](m, x) for m in members)
    torch.testing.assert_close(got, alone, **TOL)
    out = ens(x2)  # the vmap path raises here on the current code
    torch.testing.assert_close(out, torch.stack([m(x2) for m in members]), **TOL)


# -- a kept dict or list under the caller's transform -------------------------------------------
#
# A kept tuple or tensor is each member's under the caller's vmap or grad (below, passing); a
# kept dict or list fails: vmapens/_kept.py:set_kept_ -> _kept_edits.py:note_box ->
# _boxes.py:place calls ``untyped_storage()`` on the user's wrapped tensor ("NotImplementedError:
# Cannot access storage of BatchedTensorImpl / TensorWrapper"), where each member alone runs.


def loss_of(ens: vmapens.Ensemble, form: str) -> Callable:
    return vmapens.per_member(lambda o, t: F.cross_entropy(o, t) + read(ens.template.st, form))


def alone_of(m: nn.Module, form: str) -> Callable:
    return lambda z: F.cross_entropy(m(z), Y) + read(m.st, form)


TRANSFORMS = {
    # [data sets, n]
    "vmap": lambda e, a, xs, x: (vmap(e)(xs), torch.stack([vmap(f)(xs) for f in a], 1)),
    # the input gradient of the members' sum
    "grad": lambda e, a, xs, x: (grad(lambda z: e(z).sum())(x), sum(grad(f)(x) for f in a)),
    # per data set input gradients
    "vmap_of_grad": lambda e, a, xs, x: (
        vmap(grad(lambda z: e(z).sum()))(xs),
        sum(vmap(grad(f))(xs) for f in a),
    ),
    # a gradient through a vmap over two scaled copies
    "grad_of_vmap": lambda e, a, xs, x: (
        grad(lambda z: vmap(e)(torch.stack([z, 2 * z])).sum())(x),
        sum(grad(lambda z, f=f: vmap(f)(torch.stack([z, 2 * z])).sum())(x) for f in a),
    ),
    # the ensemble called twice inside one vmap
    "twice": lambda e, a, xs, x: (
        vmap(lambda z: e(z) + e(2 * z))(xs),
        torch.stack([vmap(lambda z, f=f: f(z) + f(2 * z))(xs) for f in a], 1),
    ),
}


@pytest.mark.parametrize("how", ["vmap", "grad"])
@pytest.mark.parametrize("form", ["dict", "list"])
def test_a_kept_dict_or_list_read_by_the_loss_under_the_users_transform(form, how) -> None:
    ens, members = pair(lambda: Kept(form))
    xs, x = randn(2, 6, 3), randn(6, 3, seed=1)
    ens(x)
    for m in members:
        m(x)
    got, alone = TRANSFORMS[how](
        lambda z: loss_of(ens, form)(ens(z), Y), [alone_of(m, form) for m in members], xs, x
    )
    torch.testing.assert_close(got, alone, **TOL)


# Passing: other forms under nested transforms, with chunks and loop.
@pytest.mark.parametrize("options", OPTIONS, ids=str)
@pytest.mark.parametrize("how", ["vmap_of_grad", "grad_of_vmap", "twice"])
@pytest.mark.parametrize("form", ["tuple", "const", "input"])
def test_a_kept_tuple_or_shared_tensor_under_nested_transforms_is_each_members(
    form, how, options
) -> None:
    ens, members = pair(lambda: Kept(form), **options)
    xs, x = randn(2, 6, 3), randn(6, 3, seed=1)
    ens(x)
    for m in members:
        m(x)
    got, alone = TRANSFORMS[how](
        lambda z: loss_of(ens, form)(ens(z), Y), [alone_of(m, form) for m in members], xs, x
    )
    torch.testing.assert_close(got, alone, **TOL)


# Passing: a hidden state read back by a second call inside grad, then a step after it.
@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_a_state_read_back_twice_inside_grad_then_make_step_trains_as_alone(options) -> None:
    ens, members = pair(Recurrent, **options)
    x, x2 = randn(4, 3), randn(4, 3, seed=1)
    y = randn(4, 3, seed=2)
    ens(x)
    for m in members:
        m(x)

    def twice(f: Callable) -> torch.Tensor:
        return grad(lambda z: (f(z) * f(2 * z)).sum())(x2)

    torch.testing.assert_close(twice(ens), sum(twice(m) for m in members), **TOL)
    opt = torch.optim.SGD(ens.parameters(), lr=0.1)
    step = vmapens.make_step(ens, F.mse_loss, opt)
    for _ in range(2):
        step(x, y)
    for m in members:
        o = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(2):
            o.zero_grad()
            F.mse_loss(m(x), y).backward()
            o.step()
    same_state(ens, members)
    torch.testing.assert_close(ens.template.h, torch.stack([m.h for m in members]), **TOL)
