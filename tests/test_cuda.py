"""CUDA: the stacked optimizers, the compiled step and a late move to the GPU, each against N
plain CUDA modules trained alone. Skipped where torch sees no GPU (``bench/gpu.sh`` runs it)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, stack_module_state, vmap
from truth import autograd_nodes

import vmapens
from vmapens._batchable import batchable
from vmapens.step import LossScale

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    # inductor's advice on a GPU with TF32 tensor cores; the tests keep float32 matmuls exact.
    pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores:UserWarning"),
    # torch 2.11's CUDA-graph trees capture an empty graph for a partition without kernels.
    pytest.mark.filterwarnings("ignore:The CUDA Graph is empty:UserWarning"),
]

N, STEPS = 4, 5
#: One tolerance for every comparison: float32 on CUDA, a few steps, kernels that may differ.
TOL = {"rtol": 1e-4, "atol": 1e-5}


def member() -> nn.Module:
    # No bias before the BatchNorm: its exact gradient is 0, so Adam would step on the
    # gradient's float32 rounding noise, which no two implementations share (0.03 apart after
    # five steps on an H200).
    return nn.Sequential(
        nn.Linear(3, 16, bias=False), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 2)
    )


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 3, generator=g).cuda(), torch.randn(8, 2, generator=g).cuda()


def _plain(optimizer: str) -> list[nn.Module]:
    """N CUDA modules, member i built after ``torch.manual_seed(i)``, each trained alone."""
    x, y = _data()
    models = []
    for i in range(N):
        torch.manual_seed(i)
        model = member().cuda()
        opt = OPTIMIZERS[optimizer][0](model.parameters())
        for _ in range(STEPS):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        models.append(model)
    return models


OPTIMIZERS = {
    "adam": (lambda p: torch.optim.Adam(p, lr=1e-2), lambda e: vmapens.StackedAdam(e, lr=1e-2)),
    "sgd": (
        lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
        lambda e: vmapens.StackedSGD(e, lr=1e-2, momentum=0.9),
    ),
}
CASES = [
    pytest.param("adam", False, False, id="adam-eager"),
    pytest.param("sgd", False, False, id="sgd-eager"),
    pytest.param("adam", True, False, id="adam-compiled-reduce-overhead"),
    pytest.param("adam", False, True, id="adam-to-cuda-after-optimizer"),
]


@pytest.mark.parametrize(("optimizer", "compile", "late_move"), CASES)
def test_matches_plain_cuda_modules(optimizer: str, compile: bool, late_move: bool) -> None:
    x, y = _data()
    if late_move:  # built on CPU, the optimizer made there, then the ensemble moved
        ens = vmapens.Ensemble(member, N, seeds=range(N))
        opt = OPTIMIZERS[optimizer][1](ens)
        ens.to("cuda")
    else:
        ens = vmapens.Ensemble(lambda: member().cuda(), N, seeds=range(N))
        opt = OPTIMIZERS[optimizer][1](ens)
    step = vmapens.make_step(ens, nn.MSELoss(), opt, compile=compile)
    for _ in range(STEPS):
        losses = step(x, y)
    torch.cuda.synchronize()
    assert losses.device.type == "cuda" and losses.shape == (N,)
    for got, expected in zip(ens.unstack(), _plain(optimizer), strict=True):
        for (name, a), b in zip(got.state_dict().items(), expected.state_dict().values()):
            assert a.device.type == "cuda", name
            torch.testing.assert_close(a, b, **TOL, msg=lambda m, name=name: f"{name}: {m}")


def test_fp16_loss_scale_matches_one_grad_scaler_per_member_on_cuda() -> None:
    # Issue 12's CUDA check: precision="fp16" with one member overflowing equals N separate
    # torch.amp.GradScaler("cuda") runs, and the other members never notice the overflow.
    options = {"init_scale": 2.0**10, "growth_interval": 2}
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(N, 16, 3, generator=g), torch.randn(N, 16, 2, generator=g))
               for _ in range(5)]  # fmt: skip
    batches[2][1][1, 0, 0] = float("inf")  # member 1's gradients overflow at step 2
    batches = [(x.cuda(), y.cuda()) for x, y in batches]
    torch.manual_seed(0)
    alone = [nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 2)).cuda() for _ in range(N)]
    ens = vmapens.Ensemble.from_modules(alone)
    scale = LossScale(N, device=torch.device("cuda"), **options)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.05, momentum=0.9),
                             in_dims=0, precision="fp16", loss_scale=scale)  # fmt: skip
    for x, y in batches:
        step(x, y)
    scalers = [torch.amp.GradScaler("cuda", **options) for _ in range(N)]
    for i, (model, scaler) in enumerate(zip(alone, scalers, strict=True)):
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for x, y in batches:
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x[i]), y[i])
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    for i, model in enumerate(alone):
        for (name, want), got in zip(model.state_dict().items(), ens[i].state_dict().values()):
            torch.testing.assert_close(got, want, **TOL, msg=f"member {i} {name}")
    want = torch.tensor([s.get_scale() for s in scalers])
    torch.testing.assert_close(scale.scale.cpu(), want, rtol=0, atol=0)
    assert want[1] < want[0]


def test_fused_lstm_recurrence_matches_each_lstm_alone_on_cuda() -> None:
    """The eager LSTM's one-node recurrence (vmapens/_lstm_fused.py) on CUDA, float64, against
    each member as torch's own nn.LSTM alone (cuDNN off: its float64 path is not the truth)."""
    torch.manual_seed(0)
    members = [nn.LSTM(3, 5, num_layers=2, bidirectional=True).double().cuda() for _ in range(N)]
    template = batchable(nn.LSTM(3, 5, num_layers=2, bidirectional=True).to("meta"))
    params, _ = stack_module_state(members)
    x = torch.randn(6, 2, 3, dtype=torch.float64, device="cuda")
    out, _ = vmap(lambda p, x: functional_call(template, p, (x,)), in_dims=(0, None))(params, x)
    assert "_RecurrenceBackward" in autograd_nodes(out)
    grads = torch.autograd.grad(out.square().sum(), list(params.values()))
    with torch.backends.cudnn.flags(enabled=False):
        for k, m in enumerate(members):
            m_out, _ = m(x)
            torch.testing.assert_close(out[k], m_out, rtol=1e-10, atol=1e-10)
            m_grads = torch.autograd.grad(m_out.square().sum(), list(m.parameters()))
            for g, m_g in zip(grads, m_grads, strict=True):
                torch.testing.assert_close(g[k], m_g, rtol=1e-10, atol=1e-10)


def test_random_members_draws_from_a_cuda_generator_as_randperm_does() -> None:
    # torch.randperm draws on the CPU unless told the generator's device, and refuses a CUDA
    # generator there: random_members now draws where its generator is.
    g = torch.Generator(device="cuda").manual_seed(0)
    twin = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(3):
        mask = vmapens.rl.random_members(10, 3, g, device="cuda")
        rows = torch.randperm(10, generator=twin, device="cuda")[:3]
        want = torch.zeros(10, dtype=torch.bool, device="cuda")
        want[rows] = True
        assert mask.device.type == "cuda" and torch.equal(mask, want)
