"""Session 48 hunt (d): ``backend="loop"`` with members that read a parameter on some steps
and not others (``vmapens/_member_reach.py``), against each member trained alone with
``torch.optim`` (float64).

The bugs (the first two tests; fixed in session 48 before this file landed): the rows a
backward reached were bound to the ``.grad`` it accumulated into, so a ``.grad`` you set
yourself lost them and every member stepped, silently (no warning: a stacked optimizer holds
the parameter):

- ``torch.autograd.grad`` then ``p.grad = g`` (gradient surgery, a hand-written step):
  alone the unread parameter's gradient is None and ``torch.optim`` skips it;
- ``p.grad = p.grad * 0.5`` (a gradient transform that assigns): alone the unread
  parameter's ``.grad`` stays None (guarded by ``if p.grad is not None``).

The other tests cover what tests/test_member_reach.py and tests/test_hunt_session47_d.py
do not: every stacked optimizer with two param groups, a frozen layer and clipping, its
member hand-off (``member_state_dict``) against the plain optimizer's ``state_dict`` after
uneven step counts, a saved state reloaded, ``select`` and ``exploit_`` after such steps,
``fit`` with a scheduler and clipping, and a forward that adapts its head with
``torch.autograd.grad`` (MAML).
"""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
from torch import nn

import vmapens
from vmapens.pbt import exploit_

pytestmark = pytest.mark.usefixtures("float64_default")

TOL: dict[str, Any] = dict(rtol=1e-10, atol=1e-12)


class TwoHeads(nn.Module):
    """Head `b` or head `e`, by the sign of the batch's first input: members given their own
    batches read different heads, and a member reads a head on some steps only. `c` is
    frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.c = nn.Linear(3, 3), nn.Linear(3, 3)
        self.b, self.e = nn.Linear(3, 2), nn.Linear(3, 2)
        self.c.requires_grad_(False)

    def trunk(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.c(self.a(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.trunk(x)
        return self.b(h) if x[0, 0] > 0 else self.e(h)


class Adapted(TwoHeads):
    """MAML: the head read is adapted by one inner gradient step inside the forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.trunk(x)
        head = self.b if x[0, 0] > 0 else self.e
        with torch.enable_grad():
            (gw,) = torch.autograd.grad(head(h).pow(2).mean(), head.weight, create_graph=True)
        return nn.functional.linear(h, head.weight - 0.5 * gw, head.bias)


def _data(signs: list[list[float]], seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per batch, per member: a batch whose first input is the sign given (+1: head `b`)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for row in signs:
        x = torch.randn(len(row), 4, 3, generator=g)
        x[:, 0, 0] = torch.tensor(row)
        out.append((x, torch.randn(len(row), 4, 2, generator=g)))
    return out


def _members(cls: type = TwoHeads) -> tuple[vmapens.Ensemble, list[nn.Module]]:
    ens = vmapens.Ensemble(cls, n=3, seed=1, backend="loop")
    return ens, [copy.deepcopy(m) for m in ens.unstack()]


def _groups(get: Any, extra: dict) -> list[dict]:
    """The trunk (frozen `c` included) and the heads, with `extra` for the heads."""
    trunk = [get(n) for n in ("a.weight", "a.bias", "c.weight", "c.bias")]
    heads = [get(n) for n in ("b.weight", "b.bias", "e.weight", "e.bias")]
    return [{"params": trunk}, {"params": heads, **extra}]


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).pow(2).mean(dim=(1, 2)).sum()


def _assert_as_alone(ens: vmapens.Ensemble, alone: list[nn.Module]) -> None:
    for i, m in enumerate(alone):
        got, want = ens[i].state_dict(), m.state_dict()
        for k in want:
            torch.testing.assert_close(got[k], want[k], **TOL, msg=f"member {i} {k}")


def _train_alone(
    alone: list[nn.Module], batches: list, name: str, hyper: dict, extra: dict | None = None
) -> list[torch.optim.Optimizer]:
    opts = []
    for i, m in enumerate(alone):
        params = m.parameters() if extra is None else _groups(m.get_parameter, extra)
        one = getattr(torch.optim, name)(params, **hyper)
        for x, y in batches:
            one.zero_grad()
            nn.functional.mse_loss(m(x[i]), y[i]).backward()
            one.step()
        opts.append(one)
    return opts


# -- bugs: a `.grad` set by hand loses the rows the backward reached --------------------------


def test_autograd_grad_assigned_to_grad_skips_unread_members_as_alone() -> None:
    """`torch.autograd.grad` then `p.grad = g`: alone member 0 never reads head `e`, its
    gradient is None and SGD leaves `e` as built. Here `e`'s zero row is stepped by weight
    decay and momentum (0.007 off after 2 steps), silently."""
    ens, alone = _members()
    built = ens.unstack()
    batches = _data([[1, -1, 1], [1, 1, -1]])
    hyper = dict(lr=0.1, momentum=0.9, weight_decay=0.1)
    opt = vmapens.StackedSGD(ens, **hyper)
    params = [p for p in ens.parameters() if p.requires_grad]
    for x, y in batches:
        opt.zero_grad()
        grads = torch.autograd.grad(_loss(ens(x, in_dims=0), y), params, allow_unused=True)
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()
    for i, m in enumerate(alone):
        one = torch.optim.SGD(m.parameters(), **hyper)
        mine = [p for p in m.parameters() if p.requires_grad]
        for x, y in batches:
            one.zero_grad()
            loss = nn.functional.mse_loss(m(x[i]), y[i])
            for p, g in zip(mine, torch.autograd.grad(loss, mine, allow_unused=True), strict=True):
                p.grad = g
            one.step()
    torch.testing.assert_close(alone[0].e.state_dict(), built[0].e.state_dict(), rtol=0, atol=0)
    _assert_as_alone(ens, alone)


def test_a_gradient_transform_that_assigns_grad_keeps_unread_members_skipped() -> None:
    """`p.grad = p.grad * 0.5` between backward and step (guarded by `p.grad is not None`,
    as alone needs): member 0 never reads head `e` and Adam with weight decay must not step
    it. Here every member steps it (0.2 off after 2 steps), silently."""
    ens, alone = _members()
    batches = _data([[1, -1, 1], [1, 1, -1]])
    hyper = dict(lr=0.1, weight_decay=0.1)
    opt = vmapens.StackedAdam(ens, **hyper)
    for x, y in batches:
        opt.zero_grad()
        _loss(ens(x, in_dims=0), y).backward()
        for p in ens.parameters():
            if p.grad is not None:
                p.grad = p.grad * 0.5
        opt.step()
    for i, m in enumerate(alone):
        one = torch.optim.Adam(m.parameters(), **hyper)
        for x, y in batches:
            one.zero_grad()
            nn.functional.mse_loss(m(x[i]), y[i]).backward()
            for p in m.parameters():
                if p.grad is not None:
                    p.grad = p.grad * 0.5
            one.step()
    assert alone[0].e.weight.grad is None
    _assert_as_alone(ens, alone)


# -- every stacked optimizer, hand-off, reload, select, exploit --------------------------------

OPTIMIZERS = [
    ("SGD", dict(lr=0.1, momentum=0.9, weight_decay=0.05, nesterov=True), dict(lr=0.05)),
    ("Adam", dict(lr=0.1, weight_decay=0.1, amsgrad=True), dict(lr=0.05)),
    ("Adam", dict(lr=0.1, weight_decay=0.1, decoupled_weight_decay=True), dict(weight_decay=0.3)),
    ("RMSprop", dict(lr=0.05, momentum=0.5, centered=True, weight_decay=0.1), dict(alpha=0.9)),
    ("Adagrad", dict(lr=0.1, lr_decay=0.1, weight_decay=0.1, initial_accumulator_value=0.1), {}),
    ("Adamax", dict(lr=0.1, weight_decay=0.1), dict(lr=0.05)),
    ("NAdam", dict(lr=0.1, weight_decay=0.1, decoupled_weight_decay=True), dict(lr=0.05)),
    ("RAdam", dict(lr=0.1, weight_decay=0.1), dict(lr=0.05)),
    ("Adadelta", dict(lr=1.0, weight_decay=0.1), dict(rho=0.5)),
    ("Rprop", dict(lr=0.1), dict(etas=(0.3, 1.5))),
    ("ASGD", dict(lr=0.1, t0=1, weight_decay=0.1, lambd=0.1), dict(lr=0.05)),
]
IDS = ["sgd", "amsgrad", "adamw", "rmsprop", "adagrad", "adamax", "nadamw", "radam",
       "adadelta", "rprop", "asgd"]  # fmt: skip


def _same_state(got: Any, want: Any, where: str = "") -> None:
    if isinstance(want, dict):
        assert set(got) == set(want), f"{where}: {sorted(got, key=str)} vs {sorted(want, key=str)}"
        for k in want:
            _same_state(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for j, (a, b) in enumerate(zip(got, want, strict=True)):
            _same_state(a, b, f"{where}[{j}]")
    elif torch.is_tensor(want):
        torch.testing.assert_close(torch.as_tensor(got), want, **TOL, msg=where)
    else:
        assert got == want, where


@pytest.mark.parametrize(("name", "hyper", "extra"), OPTIMIZERS, ids=IDS)
def test_uneven_reach_hand_off_reload_and_select(name: str, hyper: dict, extra: dict) -> None:
    """Two param groups, a frozen layer, clipping in `make_step`; member 0 and 2 never read
    head `e`, member 1 once. Each member's `member_state_dict` is its plain optimizer's
    `state_dict` (no entry for a head never read); the state saved, loaded into a new
    optimizer, and `select([2, 0])` continue as alone."""
    ens, alone = _members()
    first, later = _data([[1, -1, 1], [1, 1, 1]]), _data([[-1, 1, -1], [1, -1, -1]], seed=5)
    cls = getattr(vmapens, f"Stacked{name}")
    opt = cls(_groups(ens.get_parameter, extra), **hyper)
    step = vmapens.make_step(ens, nn.MSELoss(), opt, in_dims=0, clip_grad_norm=0.5)
    for x, y in first:
        step(x, y)
    opts = []
    for i, m in enumerate(alone):
        one = getattr(torch.optim, name)(_groups(m.get_parameter, extra), **hyper)
        for x, y in first:
            one.zero_grad()
            nn.functional.mse_loss(m(x[i]), y[i]).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            one.step()
        _same_state(opt.member_state_dict(i), one.state_dict(), f"member {i}")
        opts.append(one)
    _assert_as_alone(ens, alone)
    saved = io.BytesIO()
    torch.save(opt.state_dict(), saved)
    saved.seek(0)
    again = cls(_groups(ens.get_parameter, extra), **hyper)
    again.load_state_dict(torch.load(saved))
    sub = ens.select([2, 0])
    step = vmapens.make_step(sub, nn.MSELoss(), again.select([2, 0], sub), in_dims=0)
    for x, y in later:
        step(x[[2, 0]], y[[2, 0]])
    for i in (2, 0):
        for x, y in later:
            opts[i].zero_grad()
            nn.functional.mse_loss(alone[i](x[i]), y[i]).backward()
            opts[i].step()
    _assert_as_alone(sub, [alone[2], alone[0]])


@pytest.mark.parametrize(("name", "hyper", "extra"), OPTIMIZERS[1:5], ids=IDS[1:5])
def test_exploit_after_uneven_reach(name: str, hyper: dict, extra: dict) -> None:
    """`exploit_` copies member 0 (never read `e`) over member 1 (read `e`) and member 1's
    copy continues as a plain module and optimizer loaded from member 0's."""
    ens, alone = _members()
    first, later = _data([[1, -1, 1], [1, 1, 1]]), _data([[-1, -1, -1], [1, -1, -1]], seed=7)
    opt = getattr(vmapens, f"Stacked{name}")(_groups(ens.get_parameter, extra), **hyper)
    step = vmapens.make_step(ens, nn.MSELoss(), opt, in_dims=0)
    for x, y in first:
        step(x, y)
    exploit_(ens, opt, [0], [1])
    for x, y in later:
        step(x, y)
    opts = _train_alone(alone, first, name, hyper, extra)
    alone[1].load_state_dict(alone[0].state_dict())
    opts[1].load_state_dict(copy.deepcopy(opts[0].state_dict()))
    for i, m in enumerate(alone):
        for x, y in later:
            opts[i].zero_grad()
            nn.functional.mse_loss(m(x[i]), y[i]).backward()
            opts[i].step()
    _assert_as_alone(ens, alone)


def test_fit_with_a_scheduler_and_clipping_skips_unread_heads() -> None:
    """`fit` (per-member data, two batches an epoch, a StepLR per epoch, `clip_grad_norm`):
    member 0 never reads head `e`, members 1 and 2 read each head once an epoch."""
    ens, alone = _members()
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(3, 8, 3, generator=g), torch.randn(3, 8, 2, generator=g)
    x[:, 0, 0], x[:, 4, 0] = torch.tensor([1.0, -1, 1]), torch.tensor([1.0, 1, -1])
    hyper = dict(lr=0.1, weight_decay=0.1, decoupled_weight_decay=True)
    opt = vmapens.StackedAdam(_groups(ens.get_parameter, dict(lr=0.05)), **hyper)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    vmapens.fit(ens, (x, y), nn.MSELoss(), epochs=2, batch_size=4, shuffle=False, in_dims=0,
                optimizer=opt, scheduler=sched, progress=False, clip_grad_norm=0.3)  # fmt: skip
    for i, m in enumerate(alone):
        one = torch.optim.Adam(_groups(m.get_parameter, dict(lr=0.05)), **hyper)
        one_sched = torch.optim.lr_scheduler.StepLR(one, 1, gamma=0.5)
        for _ in range(2):
            for k in (0, 4):
                one.zero_grad()
                nn.functional.mse_loss(m(x[i, k : k + 4]), y[i, k : k + 4]).backward()
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.3)
                one.step()
            one_sched.step()
    assert alone[0].e.weight.grad is None
    _assert_as_alone(ens, alone)


@pytest.mark.parametrize("use_step", [False, True], ids=["hand-written", "make_step"])
def test_a_forward_that_adapts_its_head_with_autograd_grad(use_step: bool) -> None:
    """MAML: each member's forward takes `torch.autograd.grad` of the head it reads (a
    backward of its own, during the forward): the heads it never read stay skipped."""
    ens, alone = _members(Adapted)
    batches = _data([[1, -1, 1], [1, 1, -1], [1, 1, 1]])
    hyper = dict(lr=0.1, weight_decay=0.1)
    opt = vmapens.StackedAdam(ens, **hyper)
    step = vmapens.make_step(ens, nn.MSELoss(), opt, in_dims=0) if use_step else None
    for x, y in batches:
        if step is not None:
            step(x, y)
            continue
        opt.zero_grad()
        _loss(ens(x, in_dims=0), y).backward()
        opt.step()
    _train_alone(alone, batches, "Adam", hyper)
    _assert_as_alone(ens, alone)
