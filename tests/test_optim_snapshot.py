"""The rollback copy is planned once and kept from step to step (optim/_keep.py ``Snapshot``):
whatever changes the parameters or the state between steps, a masked step still leaves the
masked members bit-identical and a failed update still changes nothing.

The truth is the values before the step (kept here by cloning), and for the members that do
step, the same run taken again with the last step unmasked.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import vmapens
from vmapens.optim import StackedAdam, StackedOptimizer, StackedSGD

N = 4
MASK = torch.tensor([True, False, True, False])


def factory() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))


def failing(cls: type[StackedOptimizer]) -> type[StackedOptimizer]:
    """``cls`` whose update raises after it has written everything, while ``armed``."""

    class Failing(cls):  # type: ignore[valid-type, misc]
        armed = False

        def update_(self, params, grads, state, group) -> None:  # type: ignore[no-untyped-def]
            super().update_(params, grads, state, group)
            if self.armed:
                raise RuntimeError("injected: update")

    return Failing


# The optimizers: SGD without momentum keeps no tensor shaped like a parameter, so after
# ens.double() every tensor it writes is the same object as before (only data swapped).
OPTIMIZERS: dict[str, Callable[[Any], StackedOptimizer]] = {
    "sgd": lambda params: failing(StackedSGD)(params, lr=0.1),
    "sgd_momentum": lambda params: failing(StackedSGD)(params, lr=0.1, momentum=0.9),
    "adam": lambda params: failing(StackedAdam)(params, lr=0.1),
}


def grads_(params: list[torch.Tensor], seed: int, without: int | None = None) -> None:
    gen = torch.Generator().manual_seed(seed)
    for k, p in enumerate(params):
        g = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype)
        p.grad = None if k == without else g


def double(ens: vmapens.Ensemble, opt: StackedOptimizer, params: list) -> None:
    ens.double()


def float64_to(ens: vmapens.Ensemble, opt: StackedOptimizer, params: list) -> None:
    ens.to(torch.float64)


def new_data(ens: vmapens.Ensemble, opt: StackedOptimizer, params: list) -> None:
    # Same objects, same layout, other storage: the copy must read the new storage.
    for p in params:
        p.data = p.data.clone()


def reload(ens: vmapens.Ensemble, opt: StackedOptimizer, params: list) -> None:
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))


def new_group(ens: vmapens.Ensemble, opt: StackedOptimizer, params: list) -> None:
    gen = torch.Generator().manual_seed(4)
    extra = torch.randn(N, 3, generator=gen, dtype=params[0].dtype).requires_grad_()
    opt.add_param_group({"params": [extra]})
    params.append(extra)


def no_grad_for_one(ens: vmapens.Ensemble, opt: StackedOptimizer, params: list) -> None:
    params[1].skip = True  # read by the steps below: this parameter gets no gradient


CHANGES = [double, float64_to, new_data, reload, new_group, no_grad_for_one]


def written(params: list[torch.Tensor], opt: StackedOptimizer) -> dict[str, torch.Tensor]:
    out = {f"p{k}": p.detach().clone() for k, p in enumerate(params)}
    for k, p in enumerate(params):
        out.update({f"p{k}.{name}": t.clone() for name, t in opt.state[p].items()})
    return out


def setup(make: Callable[[Any], StackedOptimizer], change: Callable) -> tuple:
    """An ensemble and optimizer stepped once, changed, stepped twice more (float64 values)."""
    ens = vmapens.Ensemble(factory, N, seed=0)
    params = list(ens.parameters())
    opt = make(ens)
    grads_(params, 0)
    opt.step()
    change(ens, opt, params)
    for seed in (1, 2):
        skip = next((k for k, p in enumerate(params) if getattr(p, "skip", False)), None)
        grads_(params, seed, skip)
        opt.step()
    skip = next((k for k, p in enumerate(params) if getattr(p, "skip", False)), None)
    grads_(params, 3, skip)
    return ens, opt, params


def assert_same(got: Any, expected: Any) -> None:
    # Exact: the very values kept, or the same arithmetic on the same values.
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("change", CHANGES, ids=[c.__name__ for c in CHANGES])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_masked_members_keep_their_bits_after_the_change(name: str, change: Callable):
    ens, opt, params = setup(OPTIMIZERS[name], change)
    before = written(params, opt)
    _, unmasked_opt, unmasked_params = setup(OPTIMIZERS[name], change)  # the same run again
    unmasked_opt.step()
    opt.step(mask=MASK)
    after, stepped = written(params, opt), written(unmasked_params, unmasked_opt)
    for key, t in after.items():
        assert_same(t[~MASK], before[key][~MASK])
        assert_same(t[MASK], stepped[key][MASK])
    # Not vacuous: the stepping members did move, in float64 where the change made it so.
    assert not torch.equal(after["p0"][MASK], before["p0"][MASK])


@pytest.mark.parametrize("change", CHANGES, ids=[c.__name__ for c in CHANGES])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_failed_update_changes_nothing_after_the_change(name: str, change: Callable):
    ens, opt, params = setup(OPTIMIZERS[name], change)
    before = written(params, opt)
    type(opt).armed = True  # type: ignore[attr-defined]
    try:
        with pytest.raises(RuntimeError, match="injected: update"):
            opt.step()
    finally:
        type(opt).armed = False  # type: ignore[attr-defined]
    assert_same(written(params, opt), before)


def _same_gradients_steps(ens, twins, opt, opts, switch) -> None:
    """Six steps of the stacked optimizer and of each twin's own, on the twins' gradients
    (stacked for the ensemble); ``switch()`` changes the param groups before the fourth."""
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)
    for t in range(6):
        if t == 3:
            switch()
        for m, o in zip(twins, opts, strict=True):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
        for name, p in ens.named_parameters():
            p.grad = torch.stack([m.get_parameter(name).grad for m in twins])
        opt.step()
        for o in opts:
            o.step()


@pytest.mark.parametrize("fused", [False, None], ids=["foreach", "fused"])
@pytest.mark.parametrize(
    ("nesterov", "dampening"),
    [(False, 0.0), (True, 0.0), (False, 0.5)],
    ids=["momentum", "nesterov", "dampened"],
)
def test_momentum_switched_on_mid_run_matches_torch(nesterov, dampening, fused):
    """A schedule that turns momentum on after some steps: torch's SGD creates the buffer at
    that step (the gradient itself, undampened); the stacked one must too, not keep its old
    state. Both get the twins' own gradients, so the optimizers alone are compared: bit for bit
    with ``fused=False``, to rounding with torch's fused kernel (docs/semantics.md)."""
    torch.manual_seed(0)
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 1).double(), n=2, seed=0)
    twins = ens.unstack()
    opt = vmapens.StackedSGD(ens, lr=0.1, momentum=0.0, fused=fused)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.0) for m in twins]

    def switch() -> None:
        for o in [opt, *opts]:
            for g in o.param_groups:
                g["momentum"], g["nesterov"], g["dampening"] = 0.9, nesterov, dampening

    _same_gradients_steps(ens, twins, opt, opts, switch)
    tol = dict(rtol=0.0, atol=0.0) if fused is False else dict(rtol=1e-14, atol=1e-15)
    for i, m in enumerate(twins):
        torch.testing.assert_close(ens[i].state_dict(), m.state_dict(), **tol)


def test_a_members_momentum_switched_on_mid_run_starts_its_own_buffer():
    """Per-member momenta: member 0 steps without momentum while member 1 uses it, then a
    schedule gives member 0 momentum too. Its torch SGD starts the buffer then (the gradient,
    undampened), whatever the stacked buffer's row held; member 1's goes on."""
    torch.manual_seed(0)
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 1).double(), n=2, seed=0)
    twins = ens.unstack()
    opt = vmapens.StackedSGD(ens, lr=0.1, momentum=[0.0, 0.9], dampening=0.5)
    opts = [
        torch.optim.SGD(m.parameters(), lr=0.1, momentum=mom, dampening=0.5)
        for m, mom in zip(twins, [0.0, 0.9], strict=True)
    ]

    def switch() -> None:
        opt.param_groups[0]["momentum"] = vmapens.optim.MemberValues([0.9, 0.9])
        opts[0].param_groups[0]["momentum"] = 0.9

    _same_gradients_steps(ens, twins, opt, opts, switch)
    for i, (m, o) in enumerate(zip(twins, opts, strict=True)):
        assert all(
            torch.equal(a, b) for a, b in zip(ens[i].state_dict().values(), m.state_dict().values())
        ), i
        handed = opt.member_state_dict(i)["state"]
        for k, p in enumerate(m.parameters()):
            assert torch.equal(handed[k]["momentum_buffer"], o.state[p]["momentum_buffer"]), (i, k)


def test_a_deep_copy_steps_as_the_original():
    """copy.deepcopy (and pickle) of a stacked optimizer keeps what torch's __getstate__
    drops: the member count; the copy then steps its copied parameters exactly alike."""
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 1).double(), n=3, seed=0)
    opt = StackedAdam(ens, lr=[0.1, 0.2, 0.3])
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)
    step = vmapens.make_step(ens, nn.MSELoss(), opt)
    step(x, y)
    ens2, opt2 = copy.deepcopy((ens, opt))
    assert opt2.num_members == 3
    step2 = vmapens.make_step(ens2, nn.MSELoss(), opt2)
    for _ in range(3):
        step(x, y)
        step2(x, y, torch.tensor([True, False, True]))
    for key, v in ens.state_dict().items():
        assert torch.equal(ens2.state_dict()[key][0], v[0]), key
        assert torch.equal(ens2.state_dict()[key][2], v[2]), key


#: Optimizers whose update is one torch fused kernel (shared hyperparameters, CPU): the name
#: of that kernel in ``torch`` and a constructor.
FUSED: dict[str, tuple[str, Callable[[Any], StackedOptimizer]]] = {
    "sgd": ("_fused_sgd_", lambda params: StackedSGD(params, lr=0.1, momentum=0.9)),
    "adam": ("_fused_adam_", lambda params: StackedAdam(params, lr=0.1)),
    "adamw": (
        "_fused_adamw_",
        lambda params: StackedAdam(params, lr=0.1, weight_decay=0.1, decoupled_weight_decay=True),
    ),
    "adagrad": ("_fused_adagrad_", lambda params: vmapens.optim.StackedAdagrad(params, lr=0.1)),
}


def two_steps(make: Callable[[Any], StackedOptimizer], counts: str) -> tuple[list, Any]:
    """Two steps, the second masked when ``counts`` is "differing"; the next gradients set."""
    ens = vmapens.Ensemble(factory, N, seed=0)
    params = list(ens.parameters())
    opt = make(ens)
    grads_(params, 0)
    opt.step()
    grads_(params, 1)
    opt.step(mask=MASK if counts == "differing" else None)
    grads_(params, 2)
    return params, opt


@pytest.mark.parametrize("counts", ["shared", "differing"])
@pytest.mark.parametrize("name", list(FUSED))
def test_a_failing_fused_kernel_changes_nothing(name: str, counts: str, monkeypatch):
    """Where one fused kernel writes everything, the optimizer keeps no rollback copy (the
    memory of the parameters and their moments once more). A kernel that fails must then
    leave every parameter, state tensor and step count as it was: when the members' step
    counts differ (after a masked step) the kernel runs once per count, and the last one
    fails after the first has run."""
    kernel, make = FUSED[name]
    params, opt = two_steps(make, counts)
    if counts == "shared":
        assert not opt._snapshot._old  # no copy held: only masked steps take one
    before = written(params, opt)
    real, calls = getattr(torch, kernel), []

    def fails_last(*args: Any, **kwargs: Any) -> None:
        calls.append(None)
        if len(calls) == (2 if counts == "differing" else 1):
            raise RuntimeError("injected: kernel")
        real(*args, **kwargs)

    monkeypatch.setattr(torch, kernel, fails_last)
    with pytest.raises(RuntimeError, match="injected: kernel"):
        opt.step()
    assert len(calls) == (2 if counts == "differing" else 1)  # the fused path did run
    assert_same(written(params, opt), before)


@pytest.mark.parametrize("counts", ["shared", "differing"])
@pytest.mark.parametrize("name", list(FUSED))
def test_an_interrupt_as_the_fused_kernel_returns_completes_the_step(
    name: str, counts: str, monkeypatch
):
    """Python raises a KeyboardInterrupt that arrives while a native kernel runs as soon as the
    kernel returns, when it has written everything: without a rollback copy the step must then
    be counted too, so that the interrupted run continues exactly as one whose step finished
    (parameters, state and step counts). With differing counts the one write is the copy."""
    kernel, make = FUSED[name]
    runs = []
    for interrupted in (False, True):
        params, opt = two_steps(make, counts)
        if interrupted:
            op = kernel if counts == "shared" else "_foreach_copy_"
            real = getattr(torch, op)

            def signal(*args: Any, real: Callable = real, **kwargs: Any) -> None:
                real(*args, **kwargs)
                raise KeyboardInterrupt("injected: signal")

            with monkeypatch.context() as patch:
                patch.setattr(torch, op, signal)
                with pytest.raises(KeyboardInterrupt, match="injected: signal"):
                    opt.step()
        else:
            opt.step()
        grads_(params, 3)
        opt.step()
        runs.append(written(params, opt))
    assert_same(runs[1], runs[0])
