"""What a member's forward does to its own state, and to the RNG, inside the ensemble.

A forward may *reassign* a buffer (``self.ema = 0.9 * self.ema + ...``): plain torch stores
the new tensor in the module. Each member must end with the buffer it would hold alone, with
either backend, under ``torch.no_grad``, and through ``make_step`` (eager, chunked,
compiled), checked against the members of ``ens.unstack()`` taken before and run alone. What
the stacked storage cannot hold as the member alone would is refused, naming the buffer, and
changes nothing. ``randomness="error"`` refuses a random op with either backend.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn
from torch.func import functional_call
from truth import float64_batches, train_each, twins

import vmapens

N = 3
BACKENDS = ["vmap", "loop"]
#: float64 end to end: only the order of a batched kernel's sums may differ.
TOL = dict(rtol=0, atol=1e-12)


class EMA(nn.Module):
    """A running mean of its hidden layer kept by reassignment, next to BatchNorm's in-place
    statistics, and an integer counter reassigned too."""

    def __init__(self, hidden: int = 6) -> None:
        super().__init__()
        self.fc = nn.Linear(4, hidden)
        self.bn = nn.BatchNorm1d(hidden)
        self.out = nn.Linear(hidden, 2)
        self.register_buffer("ema", torch.zeros(hidden))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.bn(self.fc(x)))
        if self.training:
            self.ema = 0.9 * self.ema + 0.1 * h.mean(0).detach()
            self.calls = self.calls + 1
        return self.out(h - self.ema)


def ema(hidden: int = 6) -> nn.Module:
    return EMA(hidden).double()


def _assert_state_equal(ens: vmapens.Ensemble, alone: list[nn.Module]) -> None:
    for i, m in enumerate(alone):
        got, want = ens[i].state_dict(), m.state_dict()
        assert list(got) == list(want)
        for key in want:
            torch.testing.assert_close(got[key], want[key], **TOL, msg=f"member {i} `{key}`")


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_reassigned_buffer_is_kept_as_alone(backend, grad):
    ens = vmapens.Ensemble(ema, N, seed=0, backend=backend)
    alone = twins(ens.unstack())
    for x, _ in float64_batches(3, 8, 4, 2):
        with torch.set_grad_enabled(grad):
            out = ens(x)
            want = torch.stack([m(x) for m in alone])
        torch.testing.assert_close(out, want, **TOL)
    assert int(alone[0].calls) == 3 and bool(alone[0].ema.abs().sum() > 0)
    _assert_state_equal(ens, alone)


STEPS = {
    "vmap": dict(backend="vmap"),
    "loop": dict(backend="loop"),
    "chunked": dict(backend="vmap", chunk_size=2),
    "compiled": dict(backend="vmap", compile=True),
}


@pytest.mark.parametrize("case", list(STEPS))
def test_a_reassigned_buffer_trains_as_alone(case):
    options = dict(STEPS[case])
    compile = options.pop("compile", False)
    ens = vmapens.Ensemble(ema, N, seed=0, **options)
    alone = twins(ens.unstack())
    batches = float64_batches(3, 8, 4, 2)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1), compile=compile)
    for x, y in batches:  # the first call runs the self-check too
        step(x, y)
    train_each(alone, batches, make_opt=lambda i, m: torch.optim.SGD(m.parameters(), lr=0.1))
    _assert_state_equal(ens, alone)


@pytest.mark.parametrize("backend", BACKENDS)
def test_padded_members_keep_their_reassigned_buffers(backend):
    factories = [functools.partial(ema, h) for h in (4, 4, 8)]
    ens = vmapens.Ensemble.from_factories(factories, seed=0, backend=backend)
    alone = twins(ens.unstack())
    batches = float64_batches(2, 8, 4, 2)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1))
    for x, y in batches:
        step(x, y)
    train_each(alone, batches, make_opt=lambda i, m: torch.optim.SGD(m.parameters(), lr=0.1))
    _assert_state_equal(ens, alone)


@pytest.mark.parametrize("padded", [False, True], ids=["one_size", "padded"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_map_members_with_functional_call_keeps_a_reassigned_buffer(backend, padded):
    factories = [functools.partial(ema, h) for h in ((6, 6) if not padded else (4, 6))]
    ens = vmapens.Ensemble.from_factories(factories, seed=0, backend=backend)
    alone = twins(ens.unstack())
    x = float64_batches(1, 8, 4, 2)[0][0]
    ens.map_members(lambda state, x: functional_call(ens.runner, state, (x,)), x)
    for m in alone:
        m(x)
    _assert_state_equal(ens, alone)


class Reassigns(nn.Module):
    """Reassigns something the stacked storage cannot hold as the member alone would."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.fc = nn.Linear(3, 2)
        self.bn = nn.BatchNorm1d(2)  # updated in place first: the refusal must undo it
        self.register_buffer("ema", torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.fc(x))
        if self.how == "shape":
            self.ema = torch.cat([self.ema, self.ema])
        elif self.how == "dtype":
            self.ema = self.ema.float() + 1
        elif self.how == "history":
            self.ema = 0.9 * self.ema + 0.1 * h.mean(0)
        elif self.how == "none":
            self.ema = None
        elif self.how == "parameter":
            self.fc.bias = nn.Parameter(torch.zeros(2, dtype=h.dtype))
        elif self.how == "saved":  # the old value is saved for backward, then replaced
            out = h * self.ema
            self.ema = self.ema + 1
            return out
        return h


class TiedBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        f64 = torch.float64  # built in float64: .double() would untie the buffer
        self.a, self.b = nn.Linear(3, 2, dtype=f64), nn.Linear(3, 2, dtype=f64)
        shared = torch.zeros(2, dtype=f64)
        self.a.register_buffer("s", shared)
        self.b.register_buffer("s", shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.b.s = self.b.s + 1  # alone: b.s is a new tensor, a.s keeps the old one
        return self.a(x) + self.a.s + self.b.s


REFUSED = [
    ("shape", r"reassigns buffer `ema` \(shape \(2,\), torch.float64.*shape \(4,\)"),
    ("dtype", r"reassigns buffer `ema` \(shape \(2,\), torch.float64.*torch.float32"),
    ("history", r"reassigns buffer `ema` to a tensor with autograd history.*\.detach\(\)"),
    ("none", r"sets `ema` to NoneType"),
    ("parameter", r"reassigns parameter `fc.bias`.*in place"),
    ("tied", r"reassigns buffer `b.s`.*share one tensor"),
]


def _module(how: str) -> nn.Module:
    return TiedBuffer() if how == "tied" else Reassigns(how).double()


def _refused(call, api: str, pattern: str, ens: vmapens.Ensemble) -> None:
    before = copy.deepcopy(ens.state_dict())
    with pytest.raises(RuntimeError, match=rf"^{api}: the forward of \w+ {pattern}") as info:
        call()
    assert "backend='loop'" not in str(info.value)  # the loop backend refuses it too
    torch.testing.assert_close(ens.state_dict(), before, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("how", "pattern"), REFUSED, ids=[c[0] for c in REFUSED])
def test_what_the_storage_cannot_hold_is_refused(how, pattern, backend):
    ens = vmapens.Ensemble(functools.partial(_module, how), N, seed=0, backend=backend)
    x, y = float64_batches(1, 8, 3, 2)[0]
    _refused(lambda: ens(x), "Ensemble", pattern, ens)
    for check in (True, False):  # the self-check's words, then the step's own
        step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1), check=check)
        _refused(lambda step=step: step(x, y), "step", pattern, ens)


@pytest.mark.parametrize("check", [True, False], ids=["probe", "step"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_backward_through_the_old_value_of_a_reassigned_buffer_is_refused(backend, check):
    # Alone the old tensor stays as autograd saved it; the ensemble writes the new value into
    # the same storage, which autograd refuses: explained, not advised to the loop backend.
    ens = vmapens.Ensemble(functools.partial(_module, "saved"), N, seed=0, backend=backend)
    x, y = float64_batches(1, 8, 3, 2)[0]
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1), check=check)
    pattern = r"reassigns buffer `ema` after using its old value.*self.<buffer>.clone\(\)"
    _refused(lambda: step(x, y), "step", pattern, ens)


def dropout_net() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 1)).double()


@pytest.mark.parametrize("backend", BACKENDS)
def test_randomness_error_refuses_a_random_op_with_either_backend(backend):
    ens = vmapens.Ensemble(dropout_net, N, seed=0, randomness="error", backend=backend)
    x, y = float64_batches(1, 8, 3, 1)[0]
    rng = torch.get_rng_state()
    pattern = r"draws random numbers.*randomness='error'.*randomness='different'.*'same'"
    _refused(lambda: ens(x), "Ensemble", pattern, ens)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1))
    _refused(lambda: step(x, y), "step", pattern, ens)
    assert torch.equal(torch.get_rng_state(), rng)  # refused before anything was drawn
    ens.eval()  # nothing random: every member computes what it computes alone
    alone = [m.eval() for m in ens.unstack()]
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in alone]), **TOL)
