"""Mixed precision and per-member losses against each member alone.

The truth: torch's loss modules applied to each member's slice, plain modules under
``torch.autocast``, and one ``torch.amp.GradScaler("cpu")`` per member. Exact where the
dtype allows (float64 losses; the loss-scale bookkeeping), loose where CPU kernels differ.
"""

from __future__ import annotations

import copy

import models
import pytest
import torch
from torch import nn

import vmapens
from vmapens.step import LossScale

N, B, C = 3, 6, 4
# float64 end to end: only the summation order of batched and single reductions differs.
TOL64 = dict(rtol=1e-10, atol=1e-12)


def _classes(per_member: bool, ignored: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    y = torch.randint(0, C, (N, B) if per_member else (B,), generator=g)
    if ignored is not None and per_member:
        y[1] = ignored  # member 1: every target ignored (torch gives NaN with a mean)
    return y


def _weights() -> torch.Tensor:
    return torch.rand(C, generator=torch.Generator().manual_seed(2), dtype=torch.float64) + 0.5


# (loss module, target kind): "classes" ints, "classes-per-member" [n, B] ints, "real" [B, C].
CASES = [
    pytest.param(nn.CrossEntropyLoss(reduction=r, **kw), t, id=f"ce-{r}-{name}-{t}")
    for r in ("mean", "sum", "none")
    for name, kw in (
        ("plain", {}),
        ("weight", {"weight": _weights()}),
        ("ignore", {"ignore_index": 1}),
        ("smooth", {"label_smoothing": 0.1}),
        ("all", {"weight": _weights(), "ignore_index": 1, "label_smoothing": 0.2}),
    )
    for t in ("classes", "classes-per-member")
] + [
    pytest.param(nn.NLLLoss(weight=_weights(), ignore_index=1), "classes-per-member", id="nll"),
    pytest.param(
        nn.BCEWithLogitsLoss(pos_weight=_weights(), weight=_weights()), "real", id="bce-logits"
    ),
    pytest.param(nn.MultiMarginLoss(weight=_weights()), "classes", id="multi-margin"),
    pytest.param(nn.HuberLoss(reduction="sum", delta=0.3), "real", id="huber-sum"),
    pytest.param(nn.SmoothL1Loss(reduction="none"), "real", id="smooth-l1-none"),
]


@pytest.mark.parametrize(("loss_fn", "target"), CASES)
def test_per_member_matches_each_loss_module_alone(loss_fn, target):
    """per_member(loss) gives member i loss_fn(out[i], y_i), value and gradient; a member
    whose targets are all ignored gets torch's NaN. CrossEntropyLoss with weight,
    ignore_index and label_smoothing on per-member targets raised vmap's masked_select error
    (it was not recognised as a loss that reads values, so no member-by-member fallback)."""
    out = torch.randn(N, B, C, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    out.requires_grad_()
    per = target == "classes-per-member"
    if target == "real":
        y = torch.rand(B, C, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    else:
        y = _classes(per, ignored=1)
    inputs = out.log_softmax(-1) if isinstance(loss_fn, nn.NLLLoss) else out
    got = vmapens.per_member(loss_fn, (0, 0) if per else (0, None))(inputs, y)
    want = torch.stack([loss_fn(inputs[i], y[i] if per else y) for i in range(N)])
    torch.testing.assert_close(got, want, equal_nan=True, **TOL64)
    (got_grad,) = torch.autograd.grad(got.sum(), out, retain_graph=True)
    (want_grad,) = torch.autograd.grad(want.sum(), out)
    torch.testing.assert_close(got_grad, want_grad, equal_nan=True, **TOL64)


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_per_member_cross_entropy_all_options_under_autocast(low):
    """The member-by-member fallback under autocast: each member gets autocast's own
    (float32) cross_entropy, as alone."""
    loss_fn = nn.CrossEntropyLoss(weight=torch.rand(C) + 0.5, ignore_index=1, label_smoothing=0.1)
    out = torch.randn(N, B, C).to(low).requires_grad_()
    y = _classes(True, ignored=1)
    with torch.autocast("cpu", dtype=low):
        got = vmapens.per_member(loss_fn, (0, 0))(out, y)
        want = torch.stack([loss_fn(out[i], y[i]) for i in range(N)])
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-6, atol=1e-6)
    (got_grad,) = torch.autograd.grad(got.nan_to_num().sum(), out)
    (want_grad,) = torch.autograd.grad(want.nan_to_num().sum(), out)
    torch.testing.assert_close(got_grad, want_grad, equal_nan=True, rtol=1e-6, atol=1e-6)


class Products(nn.Module):
    """Products written with torch's C++ composites: autocast casts the mm/bmm inside them."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.w = nn.Parameter(torch.randn(4, 5))
        self.b = nn.Parameter(torch.randn(4))
        if kind == "bilinear":
            self.bilinear = nn.Bilinear(4, 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.b  # before the product: the output is the product's, in its dtype
        if self.kind == "einsum":
            return torch.einsum("bi,ij->bj", x, self.w)
        if self.kind == "tensordot":
            return torch.tensordot(x, self.w, dims=1)
        if self.kind == "inner":
            return torch.inner(x, self.w.t())
        if self.kind == "multi_dot":
            return torch.linalg.multi_dot([x, self.w, torch.eye(5)])
        if self.kind == "linalg_matmul":
            return torch.linalg.matmul(x, self.w)
        return self.bilinear(x, x) + self.w.sum(0)


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "kind", ["einsum", "tensordot", "inner", "multi_dot", "linalg_matmul", "bilinear"]
)
def test_composite_products_get_each_members_autocast(kind, low):
    """torch.einsum (tensordot, inner, multi_dot, linalg.matmul, bilinear) under autocast:
    alone the product inside runs in the low dtype; in the ensemble it stayed float32
    (einsum's output float32 where alone bfloat16, 3e-2 off)."""
    ens = vmapens.Ensemble(lambda: Products(kind), N, seed=0)
    alone = ens.unstack()
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(4))
    with torch.autocast("cpu", dtype=low):
        together = ens(x)
        want = torch.stack([m(x) for m in alone])
    assert together.dtype == want.dtype
    # Same rounded inputs and one rounding at the end; the batched and single low-precision
    # kernels may sum in another order on other CPUs: one low-precision ulp.
    eps = torch.finfo(low).eps
    torch.testing.assert_close(together.float(), want.float(), rtol=2 * eps, atol=2 * eps)
    grads = torch.autograd.grad(together.float().sum(), list(ens.parameters()))
    names = [name for name, _ in ens.named_parameters()]
    for i, m in enumerate(alone):
        own = dict(zip(names, torch.autograd.grad(want[i].float().sum(), list(m.parameters()))))
        for name, g in zip(names, grads, strict=True):
            scale = own[name].abs().max().item()
            torch.testing.assert_close(g[i], own[name], rtol=4 * eps, atol=4 * eps * scale)


OPTIONS = dict(init_scale=2.0**12, growth_interval=2, growth_factor=2.0, backoff_factor=0.5)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    batches = []
    for k in range(5):
        x, y = torch.randn(N, 8, 4, generator=g), torch.randint(0, 3, (N, 8), generator=g)
        if k in (1, 3):
            x[1] *= 3e4  # member 1's fp16 gradients overflow: it alone skips and backs off
        if k == 2:
            y[2] = 2  # member 2's targets all ignored: NaN loss, finite (zero) gradients
        batches.append((x, y))
    return batches


@pytest.mark.parametrize("clip", [None, 0.5], ids=["no-clip", "clip-norm"])
def test_fp16_members_match_their_own_grad_scalers_with_resume(clip):
    """Class-weighted cross entropy with ignore_index under fp16, one GradScaler per member,
    an overflow in one member only, growth every 2 steps, a state_dict round trip mid-run:
    every member's scale and growth tracker exactly as its own scaler's."""
    loss_fn = nn.CrossEntropyLoss(weight=torch.tensor([0.5, 1.0, 2.0]), ignore_index=2)

    def build(state=None):
        ens = vmapens.Ensemble(models.MLP, N, seed=0 if state is None else 7)
        opt = vmapens.StackedSGD(ens, lr=0.1, momentum=0.9)
        scale = LossScale(N, **OPTIONS) if state is None else LossScale(N)
        if state is not None:
            ens.load_state_dict(state[0])
            opt.load_state_dict(state[1])
            scale.load_state_dict(state[2])
        step = vmapens.make_step(
            ens,
            loss_fn,
            opt,
            in_dims=0,
            precision="fp16",
            loss_scale=scale,
            clip_grad_norm=clip,
            check=False,
        )
        return ens, opt, scale, step

    ens, opt, scale, step = build()
    alone = ens.unstack()
    seen = []
    for k, (x, y) in enumerate(_batches()):
        if k == 3:
            state = copy.deepcopy((ens.state_dict(), opt.state_dict(), scale.state_dict()))
            ens, opt, scale, step = build(state)
        step(x, y)
        seen.append((scale.scale.tolist(), scale.growth_tracker.tolist()))
    for i, m in enumerate(alone):
        scaler = torch.amp.GradScaler("cpu", **OPTIONS)
        plain = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        travel = 0.0
        for k, (x, y) in enumerate(_batches()):
            before = [p.detach().clone() for p in m.parameters()]
            plain.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(m(x[i]), y[i])
            scaler.scale(loss).backward()
            scaler.unscale_(plain)
            if clip is not None:
                nn.utils.clip_grad_norm_(m.parameters(), clip)
            scaler.step(plain)
            scaler.update()
            assert seen[k][0][i] == scaler.get_scale(), (k, i)
            assert seen[k][1][i] == int(scaler._growth_tracker), (k, i)
            travel += max((b - p).abs().max().item() for b, p in zip(before, m.parameters()))
        # fp16 kernels differ by CPU: within 10 fp16 eps of the distance travelled.
        atol = 10 * torch.finfo(torch.float16).eps * travel
        for p, q in zip(ens[i].parameters(), m.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=atol)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("scale", torch.tensor([1e39, 1.0, 1.0], dtype=torch.float64)),
        ("scale", torch.tensor([1e-50, 1.0, 1.0], dtype=torch.float64)),
        ("growth_tracker", torch.tensor([2**32, 1, 1])),
    ],
    ids=["scale-inf-in-float32", "scale-zero-in-float32", "tracker-wraps-in-int32"],
)
def test_load_state_dict_refuses_values_the_stored_dtype_cannot_hold(key, value):
    """A float64 scale of 1e39 loaded as float32 inf (every later step skipped, the scale stuck
    at inf), 1e-50 as 0; a tracker of 2**32 wrapped to 0 in int32. Refused, nothing changed."""
    scale = LossScale(N, init_scale=4.0, growth_interval=5)
    scale.update_(torch.tensor([False, True, False]))
    before = scale.state_dict()
    state = scale.state_dict()
    state[key] = value
    with pytest.raises(ValueError, match=f"LossScale.load_state_dict: `{key}`"):
        scale.load_state_dict(state)
    after = scale.state_dict()
    assert torch.equal(after.pop("scale"), before.pop("scale"))
    assert torch.equal(after.pop("growth_tracker"), before.pop("growth_tracker"))
    assert after == before


@pytest.mark.parametrize("init_scale", [1e39, 1e-50], ids=["inf-in-float32", "zero-in-float32"])
def test_init_scale_float32_cannot_hold_is_refused(init_scale):
    """GradScaler keeps its scale in float32: 1e39 became inf, 1e-50 zero, silently."""
    with pytest.raises(ValueError, match="LossScale: `init_scale` must be a finite float > 0"):
        LossScale(N, init_scale=init_scale)
