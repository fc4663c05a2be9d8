"""``fit(compile="auto")`` across its switch from the eager to the compiled step, against
plain modules trained alone with ``torch.optim``.

One test compiles (a module-scoped fixture, two graphs: the full and the last partial batch);
the others stay eager.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from truth import assert_members_equal, float64_batches, train_alone

import vmapens
from vmapens import _autocompile
from vmapens._compiling import own_code

N, ROWS, BATCH, EPOCHS, STOP_AT = 3, 22, 5, 3, 8
LRS = [0.01, 0.02, 0.03]


def _cnn() -> nn.Module:
    return nn.Sequential(
        # No conv bias: BatchNorm cancels it, so its gradient is round-off and Adam moves it
        # by round-off-driven steps, not a result to compare.
        nn.Conv2d(1, 2, 3, bias=False),
        nn.BatchNorm2d(2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8, 1),
    )


class _StopOne(vmapens.Callback):
    """Stops member 1 after ``STOP_AT`` steps: after the switch to the compiled step."""

    def on_step_end(self, ctx: vmapens.callbacks.Context) -> None:
        if ctx.step == STOP_AT:
            ctx.stop([1])


@pytest.fixture(scope="module")
def switched() -> tuple[vmapens.Ensemble, list[nn.Module], list[torch.optim.Optimizer], Any]:
    """A float64 CNN+BatchNorm ensemble trained by ``fit(compile="auto")`` forced to switch
    after its timed steps: per-member learning rates as a tensor, a StepLR every epoch, a last
    partial batch, member 1 stopped after the switch; its members trained alone; the
    ensemble's optimizer."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, 1, 4, 4, generator=g, dtype=torch.float64)
    y = torch.randn(ROWS, 1, generator=g, dtype=torch.float64)
    ens = vmapens.Ensemble(_cnn, n=N, seed=0).double()
    alone = [copy.deepcopy(m) for m in ens.unstack()]
    opt = vmapens.StackedAdam(ens, lr=torch.tensor(LRS, dtype=torch.float64))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_autocompile, "COMPILE_PAYS_AFTER_S", 0.0)
        vmapens.fit(ens, (x, y), nn.MSELoss(), epochs=EPOCHS, batch_size=BATCH, shuffle=False,
                    optimizer=opt, scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5),
                    callbacks=[_StopOne()], progress=False, compile="auto")  # fmt: skip
    batches = [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, ROWS, BATCH)]
    plain = []
    for k, m in enumerate(alone):
        o = torch.optim.Adam(m.parameters(), lr=LRS[k])
        sched = torch.optim.lr_scheduler.StepLR(o, 1, 0.5)
        for epoch in range(EPOCHS):
            left = len(batches) if k != 1 else STOP_AT - epoch * len(batches)
            train_alone(m, batches[: max(0, left)], make_opt=o)
            sched.step()
        plain.append(o)
    return ens, alone, plain, opt


def test_auto_switch_with_a_partial_batch_a_schedule_and_a_stopped_member(switched) -> None:
    # Parameters, BatchNorm statistics and counters, Adam's moments and step counts: each member
    # ends where it ends alone, member 1 where it stopped (after the switch).
    ens, alone, plain, opt = switched
    assert_members_equal(ens, alone)
    held = [p for g in opt.param_groups for p in g["params"]]
    for k, o in enumerate(plain):
        mine = [o.state[p] for g in o.param_groups for p in g["params"]]
        for stacked, want in zip(held, mine, strict=True):
            got = opt.state[stacked]
            assert float(got["step"][k]) == float(want["step"])
            for name in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(got[name][k], want[name], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("case", ["torch_optimizer", "loop_backend"])
def test_fit_auto_goes_on_eagerly_when_make_step_cannot_compile(case, monkeypatch) -> None:
    # The decision to compile came after the timed eager steps, and make_step refused to
    # compile (a torch.optim optimizer, backend="loop": both train eagerly): the TypeError or
    # ValueError stopped a long run mid-way. Now it warns and trains on eagerly, to the end.
    monkeypatch.setattr(_autocompile, "COMPILE_PAYS_AFTER_S", 0.0)
    batches = float64_batches(_autocompile.TIMED_STEPS + 4, 4, 3, 2)
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    backend = {"backend": "loop"} if case == "loop_backend" else {}
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 2), n=N, seed=0, **backend).double()
    alone = [copy.deepcopy(m) for m in ens.unstack()]
    if case == "torch_optimizer":
        options: dict[str, Any] = {"optimizer": torch.optim.SGD(ens.parameters(), lr=0.1)}

        def make(m: nn.Module) -> torch.optim.Optimizer:
            return torch.optim.SGD(m.parameters(), lr=0.1)
    else:
        options = {"lr": 0.05}

        def make(m: nn.Module) -> torch.optim.Optimizer:
            return torch.optim.Adam(m.parameters(), lr=0.05)

    with pytest.warns(UserWarning, match=r"make_step: `compile=True` needs .*goes on eagerly"):
        h = vmapens.fit(ens, (x, y), nn.MSELoss(), batch_size=4, shuffle=False, progress=False,
                        compile="auto", **options)  # fmt: skip
    assert h.epochs == 1
    for m in alone:
        train_alone(m, batches, make_opt=make)
    assert_members_equal(ens, alone)


def test_own_code_keeps_keyword_only_defaults() -> None:
    # types.FunctionType takes positional defaults only: the copy of `f(x, *, k=2)` needed `k`.
    def f(x: int, y: int = 1, *, k: int = 2) -> int:
        return (x + y) * k

    g = own_code(f)
    assert g(3) == f(3) and g(3, k=5) == f(3, k=5)
    assert g.__code__ is not f.__code__ and g.__name__ != f.__name__
