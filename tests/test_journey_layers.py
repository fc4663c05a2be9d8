"""User journey: torch.nn layers no other test stacked, trained as members.

Paddings (circular, zero, replication and reflection in 3-d, constant), ``Softmax2d``,
``PixelUnshuffle``, ``ChannelShuffle``, ``Upsample`` (bicubic, trilinear, nearest-exact),
``AdaptiveMaxPool3d``, ``LPPool1d``/``3d``, ``RMSNorm`` (with and without its affine weight,
``eps=None``), ``Unflatten`` and the less common activations (GLU, CELU, Mish, Hardshrink,
Tanhshrink, Softshrink, LogSigmoid, Threshold, Softmin), each between layers with weights, so
that every one sits inside the backward.

The truth: each member as a plain module trained alone with ``torch.optim.Adam`` on the same
batches (``parity.steps_as_alone``: losses, then parameters, buffers and gradients), float64,
under vmap, in chunks of 2 of 3 members, and with ``backend="loop"``. All held when written
(session 37): these tests pin it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from parity import steps_as_alone
from torch import nn

import vmapens

N = 3
TOL: dict[str, Any] = dict(rtol=1e-9, atol=1e-11)
F64 = torch.float64

#: name: (member factory, input shape)
LAYERS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "circular-pad-1d": (
        lambda: nn.Sequential(nn.Conv1d(2, 3, 3), nn.CircularPad1d(2), nn.Conv1d(3, 2, 3)),
        (4, 2, 9),
    ),
    "circular-pad-2d": (
        lambda: nn.Sequential(
            nn.Conv2d(2, 3, 3), nn.CircularPad2d((1, 2, 0, 1)), nn.Conv2d(3, 2, 3)
        ),
        (4, 2, 7, 7),
    ),
    "circular-pad-3d": (
        lambda: nn.Sequential(nn.Conv3d(2, 2, 2), nn.CircularPad3d(1), nn.Conv3d(2, 1, 2)),
        (2, 2, 4, 4, 4),
    ),
    "zero-pad-1d": (
        lambda: nn.Sequential(nn.Conv1d(2, 3, 3), nn.ZeroPad1d(2), nn.Conv1d(3, 2, 3)),
        (4, 2, 9),
    ),
    "zero-pad-2d": (
        lambda: nn.Sequential(nn.Conv2d(2, 3, 3), nn.ZeroPad2d((1, 0, 2, 1)), nn.Conv2d(3, 2, 3)),
        (4, 2, 7, 7),
    ),
    "replication-pad-3d": (
        lambda: nn.Sequential(
            nn.Conv3d(2, 2, 2), nn.ReplicationPad3d((1, 0, 1, 0, 0, 1)), nn.Conv3d(2, 1, 2)
        ),
        (2, 2, 4, 4, 4),
    ),
    "reflection-pad-3d": (
        lambda: nn.Sequential(nn.Conv3d(2, 2, 2), nn.ReflectionPad3d(1), nn.Conv3d(2, 1, 2)),
        (2, 2, 4, 4, 4),
    ),
    "constant-pad-3d": (
        lambda: nn.Sequential(
            nn.Conv3d(2, 2, 2), nn.ConstantPad3d((1, 0, 1, 0, 0, 1), 0.5), nn.Conv3d(2, 1, 2)
        ),
        (2, 2, 4, 4, 4),
    ),
    "softmax2d": (
        lambda: nn.Sequential(nn.Conv2d(2, 3, 3), nn.Softmax2d(), nn.Conv2d(3, 2, 3)),
        (4, 2, 7, 7),
    ),
    "pixel-unshuffle": (
        lambda: nn.Sequential(nn.Conv2d(2, 3, 3), nn.PixelUnshuffle(2), nn.Conv2d(12, 2, 1)),
        (4, 2, 6, 6),
    ),
    "channel-shuffle": (
        lambda: nn.Sequential(nn.Conv2d(2, 4, 3), nn.ChannelShuffle(2), nn.Conv2d(4, 2, 1)),
        (4, 2, 6, 6),
    ),
    "upsample-bicubic": (
        lambda: nn.Sequential(
            nn.Conv2d(2, 3, 3),
            nn.Upsample(scale_factor=1.5, mode="bicubic", align_corners=False),
            nn.Conv2d(3, 2, 3),
        ),
        (4, 2, 7, 7),
    ),
    "upsample-trilinear": (
        lambda: nn.Sequential(
            nn.Conv3d(2, 2, 2), nn.Upsample(scale_factor=2, mode="trilinear"), nn.Conv3d(2, 1, 2)
        ),
        (2, 2, 3, 3, 3),
    ),
    "upsample-nearest-exact": (
        lambda: nn.Sequential(
            nn.Conv2d(2, 3, 3), nn.Upsample(size=(8, 9), mode="nearest-exact"), nn.Conv2d(3, 2, 3)
        ),
        (4, 2, 7, 7),
    ),
    "adaptive-max-pool-3d": (
        lambda: nn.Sequential(
            nn.Conv3d(2, 2, 2), nn.AdaptiveMaxPool3d((2, 3, 2)), nn.Flatten(), nn.Linear(24, 2)
        ),
        (3, 2, 5, 5, 5),
    ),
    "lp-pool-1d": (
        lambda: nn.Sequential(
            nn.Conv1d(2, 3, 3), nn.Softplus(), nn.LPPool1d(3, 2), nn.Flatten(), nn.Linear(9, 2)
        ),
        (4, 2, 8),
    ),
    "lp-pool-3d": (
        lambda: nn.Sequential(
            nn.Conv3d(2, 2, 2), nn.Softplus(), nn.LPPool3d(2, 2), nn.Flatten(), nn.Linear(2, 2)
        ),
        (3, 2, 3, 3, 3),
    ),
    "glu-celu-mish-shrinks": (
        lambda: nn.Sequential(
            nn.Linear(4, 8),
            nn.GLU(),
            nn.CELU(0.7),
            nn.Linear(4, 6),
            nn.Mish(),
            nn.Hardshrink(0.1),
            nn.Tanhshrink(),
            nn.Softshrink(0.2),
            nn.Linear(6, 2),
        ),
        (5, 4),
    ),
    "logsigmoid-threshold-softmin": (
        lambda: nn.Sequential(
            nn.Linear(4, 6),
            nn.LogSigmoid(),
            nn.Threshold(-0.5, 0.3),
            nn.Softmin(-1),
            nn.Linear(6, 2),
        ),
        (5, 4),
    ),
    "rms-norm": (lambda: nn.Sequential(nn.Linear(4, 6), nn.RMSNorm(6), nn.Linear(6, 2)), (5, 4)),
    "rms-norm-no-affine": (
        lambda: nn.Sequential(
            nn.Linear(4, 6), nn.RMSNorm([6], eps=None, elementwise_affine=False), nn.Linear(6, 2)
        ),
        (5, 4),
    ),
    "unflatten": (
        lambda: nn.Sequential(
            nn.Linear(4, 6), nn.Unflatten(1, (2, 3)), nn.Tanh(), nn.Flatten(), nn.Linear(6, 2)
        ),
        (5, 4),
    ),
}
BACKENDS = {"vmap": {}, "chunks": {"chunk_size": 2}, "loop": {"backend": "loop"}}


def _member(name: str) -> nn.Module:
    return LAYERS[name][0]().double()


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("name", list(LAYERS))
def test_members_with_the_layer_train_as_alone(name: str, backend: str) -> None:
    shape = LAYERS[name][1]
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        out_shape = _member(name)(torch.zeros(shape, dtype=F64)).shape
    batches = [
        (torch.randn(shape, generator=g, dtype=F64), torch.randn(out_shape, generator=g, dtype=F64))
        for _ in range(3)
    ]
    ens = vmapens.Ensemble(lambda: _member(name), n=N, seed=0, **BACKENDS[backend])
    steps_as_alone(ens, ens.unstack(), batches, **TOL)
