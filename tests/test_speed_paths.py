"""Issue 21's speed paths: the chunked eager step, the fast seeded build, compile="auto"'s
decision. Each against an independent truth: members trained alone, vmap's own chunking, the
documented per-member recipe, the decision rule as docs/performance.md states it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.func import functional_call
from truth import TOL64, assert_members_equal, train_each, twins

import vmapens
import vmapens._autocompile as autocompile
import vmapens._members as members

N = 7  # chunk sizes 3 and 2 leave a short last chunk
#: Chunked vs vmap's own chunking, float64: the same kernels on the same rows, so only the
#: order of a few float64 sums may differ (observed: bit-equal).
CHUNK_TOL = dict(rtol=0, atol=1e-12)


class Awkward(nn.Module):
    """BatchNorm buffers, an unused parameter (grad None) and a frozen one."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 8, bias=False)  # no bias before BatchNorm: its grad is ~0
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 2)
        self.unused = nn.Parameter(torch.randn(4))
        self.frozen = nn.Parameter(torch.randn(2), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.bn(self.inp(x)))) + self.frozen


def _batches(per_member: bool, count: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    lead = (N, 10) if per_member else (10,)
    return [
        (torch.randn(*lead, 3, generator=g, dtype=torch.float64),
         torch.randn(*lead, 2, generator=g, dtype=torch.float64))
        for _ in range(count)
    ]  # fmt: skip


@pytest.mark.parametrize("chunk_size", [1, 3, N, None], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("in_dims", [None, 0], ids=["shared", "per-member"])
def test_chunked_step_trains_members_as_alone(chunk_size, in_dims):
    ens = vmapens.Ensemble(Awkward, N, seed=0, chunk_size=chunk_size).double()
    alone = twins(ens.unstack())
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-2), in_dims=in_dims)
    batches = _batches(in_dims == 0)
    for x, y in batches:
        step(x, y)
    train_each(alone, batches, per_member=in_dims == 0)
    assert_members_equal(ens, alone, **TOL64)


def _member_loss(ens: vmapens.Ensemble):
    def member_loss(state, x, y):
        return nn.functional.mse_loss(functional_call(ens.runner, state, (x,)), y)

    return member_loss


@pytest.mark.parametrize("randomness", ["different", "same"])
def test_chunked_step_draws_dropout_as_vmap_chunks(randomness):
    # vmap(chunk_size=3) under autograd (the old path) is the truth for the random draws:
    # chunk after chunk, the RNG restored before each chunk for "same".
    def factory() -> nn.Module:
        return nn.Sequential(nn.Linear(3, 16), nn.Dropout(0.5), nn.Linear(16, 2))

    ens = vmapens.Ensemble(factory, N, seed=0, chunk_size=3, randomness=randomness).double()
    ref = vmapens.Ensemble(factory, N, seed=0, chunk_size=3, randomness=randomness).double()
    x, y = _batches(False, 1)[0]
    sgd = torch.optim.SGD(ens.parameters(), lr=0.0)  # keeps .grad, changes nothing
    step = vmapens.make_step(ens, nn.MSELoss(), sgd, check=False)
    torch.manual_seed(5)
    losses = step(x, y)
    torch.manual_seed(5)
    want = ref.map_members(_member_loss(ref), x, y)
    want_grads = torch.autograd.grad(want.sum(), list(ref.parameters()))
    torch.testing.assert_close(losses, want.detach(), **CHUNK_TOL)
    for p, g in zip(ens.parameters(), want_grads, strict=True):
        torch.testing.assert_close(p.grad, g, **CHUNK_TOL)


def test_chunked_step_keeps_mask_and_loss_scale_per_member():
    ens = vmapens.Ensemble(Awkward, N, seed=0, chunk_size=2).double()
    full = vmapens.Ensemble(Awkward, N, seed=0).double()
    mask = torch.tensor([True, False, True, True, False, True, True])
    for e in (ens, full):
        step = vmapens.make_step(e, nn.MSELoss(), vmapens.StackedAdam(e), clip_grad_norm=0.1)
        for x, y in _batches(False):
            step(x, y, mask)
    torch.testing.assert_close(ens.state_dict(), full.state_dict(), **CHUNK_TOL)


def _recipe(factory, seed: int, n: int) -> list[nn.Module]:
    """docs: member i is ``torch.manual_seed(member_seed(seed, i)); factory()``."""
    out = []
    for i in range(n):
        torch.manual_seed(vmapens.seeds.member_seed(seed, i))
        out.append(factory())
    return out


def _draws() -> nn.Module:
    m = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5))
    m.register_buffer("noise", torch.randn(3))  # a draw outside nn.init
    return m


@pytest.mark.parametrize("accelerators", [False, True], ids=["cpu-seed", "all-devices-seed"])
def test_seeded_build_gives_the_documented_members(monkeypatch, accelerators):
    monkeypatch.setattr(members, "_accelerators", lambda: accelerators)
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    ens = vmapens.Ensemble(_draws, 9, seed=4)
    assert torch.equal(torch.get_rng_state(), rng)  # the caller's RNG is left alone
    assert_members_equal(ens, _recipe(_draws, 4, 9), rtol=0, atol=0)
    by_seeds = vmapens.Ensemble(_draws, 3, seeds=[7, 8, 9])
    want = []
    for s in (7, 8, 9):
        torch.manual_seed(s)
        want.append(_draws())
    assert_members_equal(by_seeds, want, rtol=0, atol=0)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _auto(monkeypatch, total: int | None, eager_s: float) -> tuple[autocompile.AutoStep, list]:
    clock, calls = _Clock(), []
    monkeypatch.setattr(autocompile.time, "perf_counter", clock)

    def eager() -> torch.Tensor:
        clock.now += eager_s
        calls.append("eager")
        return torch.zeros(1)

    def compiled() -> torch.Tensor:
        calls.append("compiled")
        return torch.zeros(1)

    return autocompile.AutoStep(eager, lambda: compiled, total), calls


@pytest.mark.parametrize(
    ("total", "eager_s", "compiles"),
    [
        (100, 1e-3, False),  # 0.1 s of eager steps left: never worth a compile
        (1000, 1e-3, False),
        (20_006, 1e-3, False),  # 20 s left: under the 60 s budget
        (70_006, 1e-3, True),  # 70 s left: over it
        (100_000, 1e-3, True),  # ~100 s left > 60 s
        (None, 10.0, False),  # unknown length: stays eager
    ],
)
def test_auto_step_compiles_only_when_the_eager_rest_exceeds_the_budget(
    monkeypatch, total, eager_s, compiles
):
    # docs/performance.md: compile once the eager steps still to run would take longer
    # than COMPILE_PAYS_AFTER_S, estimated from TIMED_STEPS steps after one warm-up step.
    step, calls = _auto(monkeypatch, total, eager_s)
    decided = autocompile.TIMED_STEPS + 1
    for _ in range(decided + 3):
        step()
    left_s = None if total is None else (total - decided) * eager_s
    assert (left_s is not None and left_s > autocompile.COMPILE_PAYS_AFTER_S) == compiles
    assert calls[:decided] == ["eager"] * decided
    assert calls[decided:] == ["compiled" if compiles else "eager"] * 3


@pytest.mark.parametrize(
    ("compiled_s", "slow_steps", "stays"),
    [
        (0.5e-3, (), True),  # 2x faster: compiled for the rest of the run
        (2e-3, (), False),  # inductor's code 2x slower than eager: back to eager
        (0.5e-3, (1, 3), True),  # two slow steps of five (a recompile): the median holds
        (2e-3, (0,), False),
    ],
)
def test_auto_step_goes_back_to_eager_where_the_compiled_step_is_slower(
    monkeypatch, compiled_s, slow_steps, stays
):
    # docs/fit.md: after its compile and one warm-up call, TIMED_STEPS compiled steps are
    # timed; where their median is slower than the eager steps' median, fit goes on eagerly
    # (a CNN's compiled step took 3x eager's in sessions 28-29, docs/performance.md).
    step, calls = _auto(monkeypatch, 100_000, 1e-3)  # 1 ms eager steps
    clock = autocompile.time.perf_counter

    def compiled() -> torch.Tensor:  # its compile (100 s), a warm-up call, the timed calls
        k = calls.count("compiled") - 2
        clock.now += 100.0 if k == -2 else compiled_s * (50 if k in slow_steps else 1)
        calls.append("compiled")
        return torch.zeros(1)

    step.build_compiled = lambda: compiled
    decided = autocompile.TIMED_STEPS + 1
    checked = decided + 2 + autocompile.TIMED_STEPS
    for _ in range(checked + 4):
        step()
    assert calls[:decided] == ["eager"] * decided
    assert calls[decided:checked] == ["compiled"] * (checked - decided)
    assert calls[checked:] == ["compiled" if stays else "eager"] * 4


def test_an_eager_run_never_imports_dynamo(tmp_path):
    # torch.optim.Optimizer's add_param_group, state_dict, load_state_dict and zero_grad are
    # wrapped in torch._disable_dynamo, which imports torch._dynamo (1.5-3 s) on its first
    # call; an eager run, checkpoints included, must not pay for it. Fresh interpreter: this
    # process has long imported dynamo.
    code = (
        "import sys, torch\n"
        "from torch import nn\n"
        "import vmapens\n"
        "ens = vmapens.Ensemble(lambda: nn.Linear(2, 1), 3, seed=0)\n"
        "weight, bias = ens.stacked_params().values()\n"
        "opt = vmapens.StackedAdam([weight])\n"
        "opt.add_param_group({'params': [bias], 'lr': 0.1})\n"
        "step = vmapens.make_step(ens, nn.MSELoss(), opt)\n"
        "step(torch.randn(4, 2), torch.zeros(4, 1))\n"
        "opt.zero_grad()\n"
        "opt.load_state_dict(opt.state_dict())\n"
        "x, y = torch.randn(16, 2), torch.zeros(16, 1)\n"
        "vmapens.fit(ens, (x, y), nn.MSELoss(), epochs=1, batch_size=4, progress=False, seed=0,\n"
        "            checkpoint=sys.argv[1])\n"
        "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))\n"
    )
    ckpt = str(tmp_path / "run.ckpt")
    proc = subprocess.run(
        [sys.executable, "-c", code, ckpt], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"
    assert os.path.exists(ckpt)
