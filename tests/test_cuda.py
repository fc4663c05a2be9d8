"""CUDA: the stacked optimizers, the compiled step and a late move to the GPU, each against N
plain CUDA modules trained alone. Skipped where torch sees no GPU (``bench/gpu.sh`` runs it)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vmapens

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

N, STEPS = 4, 5
#: One tolerance for every comparison: float32 on CUDA, a few steps, kernels that may differ.
TOL = {"rtol": 1e-4, "atol": 1e-5}


def member() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 2))


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
