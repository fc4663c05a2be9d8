"""Session 48 hunt (h): mixed precision and per-member loss scaling.

Truth: every member alone, a plain module under ``torch.autocast("cpu", dtype)``, with its own
``torch.amp.GradScaler("cpu")`` and plain ``torch.optim`` where it trains.

Found: C++ composite functions that call an op on autocast's lists *inside* themselves
(``F.affine_grid`` -> ``bmm``, ``torch.cov`` / ``torch.corrcoef`` / ``torch.linalg.matrix_power``
/ ``torch.linalg.pinv`` -> ``mm``/``matmul``, ``F.pad`` reflect/replicate ->
``reflection_pad1d``/``replication_pad1d``) are cast alone, but not inside the ensemble:
``MemberAutocast`` (``vmapens/_precision.py``) matches only the function the member calls by
name, and torch's own autocast is switched off inside the mapped function. The ensemble
silently returns another dtype and other values, and a ``precision="bf16"`` step trains a
spatial transformer on other numbers than each member alone (its self-check lets it pass).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vmapens

N = 3
LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}
PERF = "ignore:There is a performance drop"  # vmap has no batching rule for affine_grid


class Composite(nn.Module):
    """A Linear, then one C++ composite whose inner op autocast casts when the member is alone."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.fc = nn.Linear(4, 6)
        self.w = nn.Parameter(torch.randn(4, 4) * 0.5)
        self.theta = nn.Parameter(torch.tensor([[0.9, 0.2, 0.05], [-0.2, 1.1, 0.02]]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "affine_grid":  # a spatial transformer's grid from a float32 theta
            return F.affine_grid(self.theta[None], [1, 1, 3, 4], align_corners=False)
        if self.kind == "cov":
            return torch.cov(x.T)
        if self.kind == "corrcoef":
            return torch.corrcoef(x.T)
        if self.kind == "matrix_power":
            return torch.linalg.matrix_power(self.w, 3)
        if self.kind == "pinv":
            return torch.linalg.pinv(self.w)
        mode = {"reflect_pad": "reflect", "replicate_pad": "replicate"}[self.kind]
        return F.pad(self.fc(x)[:, None], (2, 2), mode=mode)[:, 0]


KINDS = ["affine_grid", "cov", "corrcoef", "matrix_power", "pinv", "reflect_pad", "replicate_pad"]


@pytest.mark.filterwarnings(PERF)
@pytest.mark.parametrize("low", ["bf16", "fp16"])
@pytest.mark.parametrize("kind", KINDS)
def test_composite_under_autocast_gives_each_member_its_own_dtype(kind, low):
    """Alone, ``torch.autocast`` casts the product inside ``affine_grid``/``cov``/... (output
    bf16) and the padding kernel inside ``F.pad`` (output float32). Inside the ensemble the
    dtype flips: e.g. affine_grid float32 where alone bfloat16, F.pad(reflect) bfloat16 where
    alone float32. Exact on every CPU: autocast's lists decide the dtype, not the kernels."""
    ens = vmapens.Ensemble(lambda: Composite(kind), N, seed=0)
    alone = ens.unstack()
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), torch.autocast("cpu", dtype=LOW[low]):
        together = ens(x)
        want = torch.stack([m(x) for m in alone])
    assert together.dtype == want.dtype, f"{kind}: {together.dtype} inside, {want.dtype} alone"
    # and values as alone up to the low dtype's rounding (a loose bound: the dtype is the claim)
    torch.testing.assert_close(together.float(), want.float(), rtol=0.05, atol=0.05)


class SpatialTransformer(nn.Module):
    """A learned affine warp of a 4x4 image (``affine_grid`` + ``grid_sample``) and a head."""

    def __init__(self) -> None:
        super().__init__()
        base = torch.tensor([[0.9, 0.2, 0.05], [-0.2, 1.1, 0.02]])
        self.theta = nn.Parameter(base + 0.1 * torch.randn(2, 3))
        self.fc = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        img = x.reshape(-1, 1, 4, 4)
        theta = self.theta.expand(img.shape[0], 2, 3)
        grid = F.affine_grid(theta, [img.shape[0], 1, 4, 4], align_corners=False)
        return self.fc(F.grid_sample(img, grid, align_corners=False).flatten(1))


@pytest.mark.filterwarnings(PERF)
def test_bf16_step_of_a_spatial_transformer_computes_each_members_own_loss():
    """``make_step(precision="bf16")``: the losses it returns are computed before the update,
    so each must be the member's own loss under ``torch.autocast`` alone. The grid is not
    rounded to bf16 inside the ensemble: losses 4e-4..5e-3 relative off (seeds 0-5), no error,
    no warning; alone both sides run the same kernels, so the bound 1e-4 is loose."""
    torch.manual_seed(0)
    ens = vmapens.Ensemble(SpatialTransformer, N, seed=0)
    alone = ens.unstack()
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(8, 16, generator=g) * 3, torch.randn(8, 3, generator=g)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1), precision="bf16")
    got = step(x, y)
    want = []
    for m in alone:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            want.append(F.mse_loss(m(x), y).float())
    want = torch.stack(want)
    rel = ((got.float() - want).abs() / want.abs()).max().item()
    assert rel <= 1e-4, f"step losses {got.tolist()} vs alone {want.tolist()} (rel {rel:.1e})"


# ---- passing: coverage no other test has ------------------------------------------------


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # No bias before BatchNorm: its gradient is round-off, which Adam/Rprop blow up.
        self.fc1, self.bn = nn.Linear(3, 4, bias=False), nn.BatchNorm1d(4)
        self.fc2 = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


OPTIMIZERS = {
    "sgd_dampening": (
        lambda e: vmapens.StackedSGD(e, lr=0.1, momentum=0.9, dampening=0.5),
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, dampening=0.5),
    ),
    "sgd_nesterov": (
        lambda e: vmapens.StackedSGD(e, lr=0.1, momentum=0.9, nesterov=True),
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True),
    ),
    "adam_amsgrad": (
        lambda e: vmapens.StackedAdam(e, lr=0.1, amsgrad=True),
        lambda m: torch.optim.Adam(m.parameters(), lr=0.1, amsgrad=True),
    ),
    "nadam": (
        lambda e: vmapens.StackedNAdam(e, lr=0.1),
        lambda m: torch.optim.NAdam(m.parameters(), lr=0.1),
    ),
    "radam": (
        lambda e: vmapens.StackedRAdam(e, lr=0.1),
        lambda m: torch.optim.RAdam(m.parameters(), lr=0.1),
    ),
    "rmsprop_centered": (
        lambda e: vmapens.StackedRMSprop(e, lr=0.01, momentum=0.5, centered=True),
        lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01, momentum=0.5, centered=True),
    ),
    "asgd": (
        lambda e: vmapens.StackedASGD(e, lr=0.1, t0=1),
        lambda m: torch.optim.ASGD(m.parameters(), lr=0.1, t0=1),
    ),
    "rprop": (
        lambda e: vmapens.StackedRprop(e, lr=0.1),
        lambda m: torch.optim.Rprop(m.parameters(), lr=0.1),
    ),
}


def product_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Finite loss, gradient ``target / numel``: a target of 1e306 overflows only once scaled."""
    return (out * target).mean()


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fp16_gradient_only_overflow_skips_a_members_first_step_as_its_grad_scaler(name):
    """Member 1's *first* step overflows in its scaled gradient only (its loss is finite): it
    skips that step (lazy optimizer state: momentum buffers, step counts, ASGD's eta/mu start
    at its first real step), backs off, and its BatchNorm statistics still move (the forward
    ran, as alone). float64 parameters: autocast leaves them alone, so values compare to
    float64 round-off; scales exactly."""
    make_stacked, make_plain = OPTIMIZERS[name]
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(N, 6, 3, generator=g, dtype=torch.float64) for _ in range(3)]
    ys = [torch.randn(N, 6, 2, generator=g, dtype=torch.float64) for _ in range(3)]
    ys[0][1] *= 1e306
    options = dict(init_scale=2.0**16, growth_interval=1)
    ens = vmapens.Ensemble(BNNet, N, seed=0).double()
    alone = ens.unstack()
    scale = vmapens.LossScale(N, **options)
    step = vmapens.make_step(
        ens, product_loss, make_stacked(ens), in_dims=0, precision="fp16", loss_scale=scale
    )
    for x, y in zip(xs, ys, strict=True):
        step(x, y)
    want_scales = []
    for i, m in enumerate(alone):
        opt, scaler = make_plain(m), torch.amp.GradScaler("cpu", **options)
        for x, y in zip(xs, ys, strict=True):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = product_loss(m(x[i]), y[i])
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        want_scales.append(scaler.get_scale())
        for key, value in m.state_dict().items():
            torch.testing.assert_close(
                ens[i].state_dict()[key], value, rtol=1e-9, atol=1e-10,
                msg=lambda s, i=i, key=key: f"member {i} {key}: {s}",
            )  # fmt: skip
    assert scale.scale.tolist() == want_scales
    assert want_scales[1] < want_scales[0]  # the premise: member 1 skipped and backed off
