"""Journey: an ensemble of small networks trained with hand-written low-bit tricks, as research
code writes them (not torch.ao's `prepare_qat`, which tests/test_journey_compress.py covers).

The researcher's modules: k-bit weights through a straight-through estimator written as
`w + (q(w) - w).detach()`; `torch.fake_quantize_per_tensor_affine` /
`torch.fake_quantize_per_channel_affine` with qparams in buffers, and LSQ's learnable
`torch._fake_quantize_learnable_per_tensor_affine`; running min/max observers kept in buffers
and updated in the forward under `torch.no_grad()` (reassigned with `torch.minimum/maximum`, or
edited in place from `torch.aminmax`), then read for the scale; XNOR-style binarised weights
(`torch.sign` through an STE, scaled by mean |w| per output row); stochastic rounding. They are
trained with `make_step` (masks, `chunk_size`, observers frozen mid-run), a hand-written loop,
`fit` (validation, best-epoch restore), evaluated in eval mode (observers frozen) and written
to member files / unstacked, each member with its own observer statistics.

The truth: each member as a plain module trained alone with torch.optim on the same batches,
float64 (torch 2.13's CPU fake-quantize kernels take float64 inputs; per-channel scales must
be float32) compared to TOL64 (a batched matmul may sum in another order; on these tiny sizes
nothing reaches a rounding boundary), except LSQ's learnable op, whose backward takes float32
only (tolerance justified there). What vmap cannot batch (an old-style `autograd.Function` STE, LSQ's
data-dependent first-batch init, `.item()` for a per-member bit width, a Bernoulli draw from
each member's own weights under `randomness='same'`) must be refused naming
`backend='loop'`, changing nothing, and `backend='loop'` must then be exact.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable

import pytest
import torch
from torch import nn
from truth import TOL64, assert_members_equal, factory_members, seeded_members

import vmapens

N = 3
F64 = torch.float64

pytestmark = [
    # torch's own: vmap's per-member fallback for the fake-quantize ops (no batching rule).
    pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),
]


def _batches(count: int, lead: tuple[int, ...] = (), seed: int = 0) -> list[tuple]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(*lead, 5, 3, generator=g, dtype=F64) * (k + 1),  # growing ranges
            torch.randn(*lead, 5, 2, generator=g, dtype=F64),
        )
        for k in range(count)
    ]


def _train_alone(
    models: list[nn.Module],
    batches: list[tuple],
    make_opt: Callable[[nn.Module], torch.optim.Optimizer],
    *,
    per_member: bool = False,
    masks: list[list[bool]] | None = None,
    between: Callable[[int, nn.Module], None] | None = None,
) -> None:
    """The naive loop: each member alone, its own optimizer, the same batches (its own slice
    with per-member data), skipped where its mask is False; `between(k, m)` before step k."""
    opts = [make_opt(m) for m in models]
    for k, (x, y) in enumerate(batches):
        for i, (m, opt) in enumerate(zip(models, opts, strict=True)):
            if between is not None:
                between(k, m)
            if masks is not None and not masks[k][i]:
                continue
            xi, yi = (x[i], y[i]) if per_member else (x, y)
            opt.zero_grad()
            nn.functional.mse_loss(m(xi), yi).backward()
            opt.step()


def _sgd(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)


def _adam(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(m.parameters(), lr=0.02)


def _ste_round(v: torch.Tensor) -> torch.Tensor:
    return v + (torch.round(v) - v).detach()


# ---------------------------------------------------------------- (a) k-bit STE and (c) XNOR


class KBitLinear(nn.Linear):
    """Symmetric k-bit weights, scale max|w| / qmax, through `w + (q(w) - w).detach()`."""

    def __init__(self, i: int, o: int, bits: int = 3) -> None:
        super().__init__(i, o, dtype=F64)
        self.bits = bits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qmax = 2 ** (self.bits - 1) - 1
        w = self.weight
        s = w.abs().max().detach() / qmax
        wq = torch.clamp(torch.round(w / s), -qmax - 1, qmax) * s
        return nn.functional.linear(x, w + (wq - w).detach(), self.bias)


class XnorLinear(nn.Linear):
    """XNOR-Net weights: sign(w) times mean |w| of its output row; the gradient passes
    straight through where |w| <= 1 (BinaryConnect's clipped STE)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        alpha = w.abs().mean(dim=1, keepdim=True).detach()
        clipped = w.clamp(-1, 1)
        return nn.functional.linear(
            x, clipped + (torch.sign(w) * alpha - clipped).detach(), self.bias
        )


class SignSTE(torch.autograd.Function):
    """The new-style form torch.func runs (setup_context, generate_vmap_rule)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.sign(x)

    @staticmethod
    def setup_context(ctx, inputs, output):  # noqa: ANN001, ANN205
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        (x,) = ctx.saved_tensors
        return grad * (x.abs() <= 1)


class BinActLinear(nn.Linear):
    """Binarised activations and weights through a custom autograd.Function."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.weight.abs().mean().detach()
        return nn.functional.linear(SignSTE.apply(x), SignSTE.apply(self.weight) * alpha, self.bias)


def lowbit_mlp() -> nn.Module:
    return nn.Sequential(
        KBitLinear(3, 6), nn.Tanh(), XnorLinear(6, 6, dtype=F64), nn.Tanh(),
        BinActLinear(6, 2, dtype=F64),
    )  # fmt: skip


def test_kbit_ste_and_xnor_binarised_members_train_as_alone_eager_chunked_and_by_hand():
    batches = _batches(3)
    alone = seeded_members(lowbit_mlp, N)
    _train_alone(alone, batches, _sgd)
    for chunk in (None, 2):
        ens = vmapens.Ensemble(lowbit_mlp, N, seeds=list(range(N)), chunk_size=chunk)
        step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1, momentum=0.9))
        for x, y in batches:
            step(x, y)
        assert_members_equal(ens, alone, **TOL64)
    # the same with the loop written by hand around `ens(x)`
    ens = vmapens.Ensemble(lowbit_mlp, N, seeds=list(range(N)))
    opt = vmapens.StackedSGD(ens, lr=0.1, momentum=0.9)
    for x, y in batches:
        opt.zero_grad()
        vmapens.per_member(nn.MSELoss())(ens(x), y).sum().backward()
        opt.step()
    assert_members_equal(ens, alone, **TOL64)
    x = batches[0][0]
    with torch.no_grad():
        want = torch.stack([a.eval()(x) for a in alone])
    torch.testing.assert_close(vmapens.predict(ens, x), want, **TOL64)


# ---------------------------------------------------------------- (a) the fake-quantize ops


class PerChannelFQ(nn.Linear):
    """Per-output-channel 4-bit weights: scale max|w_row| / 7 written into a buffer every
    forward, zero points an int32 buffer; torch's kernel is the STE."""

    def __init__(self, i: int, o: int) -> None:
        super().__init__(i, o, dtype=F64)
        self.register_buffer("scale", torch.ones(o))  # torch's kernel wants float32 scales
        self.register_buffer("zero_point", torch.zeros(o, dtype=torch.int32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.scale.copy_(self.weight.abs().amax(dim=1).clamp_min(1e-8) / 7)
        w = torch.fake_quantize_per_channel_affine(
            self.weight, self.scale, self.zero_point, 0, -8, 7
        )
        return nn.functional.linear(x, w, self.bias)


class PerTensorFQ(nn.Linear):
    """Asymmetric 4-bit weights, qparams from aminmax of the weight (per-tensor op)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            lo, hi = torch.aminmax(self.weight)
            scale = ((hi - lo) / 15).clamp_min(1e-8)
            zp = torch.round(-lo / scale).clamp(0, 15).to(torch.int32)
        w = torch.fake_quantize_per_tensor_affine(self.weight, scale, zp, 0, 15)
        return nn.functional.linear(x, w, self.bias)


class LSQLinear(nn.Linear):
    """LSQ: step size and zero point are parameters, learnt through torch's learnable op
    (per tensor or per output channel). Its backward takes float32 only: this layer is
    float32."""

    def __init__(self, i: int, o: int, per_channel: bool = False) -> None:
        super().__init__(i, o)
        size = o if per_channel else 1
        init = self.weight.detach().abs().mean() * 2 / math.sqrt(7)
        self.step_size = nn.Parameter(init.expand(size).clone())
        self.zero_point = nn.Parameter(torch.zeros(size))
        self.per_channel = per_channel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grad_factor = 1.0 / math.sqrt(self.weight.numel() * 7)
        s, z = self.step_size, self.zero_point
        if self.per_channel:
            w = torch._fake_quantize_learnable_per_channel_affine(
                self.weight, s, z, 0, -8, 7, grad_factor
            )
        else:
            w = torch._fake_quantize_learnable_per_tensor_affine(
                self.weight, s, z, -8, 7, grad_factor
            )
        return nn.functional.linear(x, w, self.bias)


def fq_mlp() -> nn.Module:
    return nn.Sequential(PerChannelFQ(3, 6), nn.Tanh(), PerTensorFQ(6, 2, dtype=F64))


def lsq_mlp() -> nn.Module:
    return nn.Sequential(LSQLinear(3, 6, per_channel=True), nn.Tanh(), LSQLinear(6, 2))


def test_fake_quantize_ops_per_channel_and_per_tensor_with_qparams_from_the_weights():
    batches = _batches(3)
    ens = vmapens.Ensemble(fq_mlp, N, seeds=list(range(N)))
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=0.02))
    for x, y in batches:
        step(x, y)
    alone = seeded_members(fq_mlp, N)
    _train_alone(alone, batches, _adam)
    assert_members_equal(ens, alone, **TOL64)
    assert not torch.equal(ens.get_buffer("0.scale")[0], ens.get_buffer("0.scale")[1])


@pytest.mark.skipif(
    not hasattr(torch, "_fake_quantize_learnable_per_channel_affine"), reason="no LSQ op"
)
def test_learnable_lsq_step_sizes_and_zero_points_train_as_alone_in_float32():
    """float32 (the op's backward takes nothing else): round-off is ~1e-7 relative, and the
    fake-quantize op then maps equal weights to equal levels; a weight that lands within
    round-off of a rounding boundary would move one level (1/7 of its range): not on these
    batches (measured bit for bit on this CPU), so 1e-5 leaves room for other kernels' sums."""
    batches = [(x.float(), y.float()) for x, y in _batches(3)]
    ens = vmapens.Ensemble(lsq_mlp, N, seeds=list(range(N)))
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=0.02))
    for x, y in batches:
        step(x, y)
    alone = seeded_members(lsq_mlp, N)
    _train_alone(alone, batches, _adam)
    assert_members_equal(ens, alone, rtol=1e-5, atol=1e-6)  # step sizes, zero points included
    sizes = ens.get_parameter("2.step_size").flatten()
    assert len(set(sizes.tolist())) == N  # each member learnt its own


# ---------------------------------------------------------------- (b) observers in buffers


class ObservedLinear(nn.Linear):
    """4-bit asymmetric input quantization from running min/max kept in buffers, updated in
    training mode only (eval mode reads them frozen; `eval_too`: in every mode, as torch's
    FakeQuantize), in one of two common ways; a counter."""

    eval_too = False

    def __init__(self, i: int, o: int, how: str = "reassign") -> None:
        super().__init__(i, o, dtype=F64)
        self.how = how
        self.observe = True  # the researcher's switch to freeze the observer
        self.register_buffer("lo", torch.tensor(math.inf, dtype=F64))
        self.register_buffer("hi", torch.tensor(-math.inf, dtype=F64))
        self.register_buffer("batches", torch.tensor(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.training or self.eval_too) and self.observe:
            with torch.no_grad():
                if self.how == "reassign":
                    self.lo = torch.minimum(self.lo, x.min())
                    self.hi = torch.maximum(self.hi, x.max())
                else:
                    lo, hi = torch.aminmax(x)
                    self.lo.copy_(torch.minimum(self.lo, lo))
                    self.hi.copy_(torch.maximum(self.hi, hi))
                self.batches += 1
        scale = ((self.hi - self.lo) / 15).clamp_min(1e-8)
        zp = torch.round(-self.lo / scale).clamp(0, 15)
        xq = (torch.clamp(torch.round(x / scale) + zp, 0, 15) - zp) * scale
        return nn.functional.linear(x + (xq - x).detach(), self.weight, self.bias)


def observed(how: str = "reassign") -> Callable[[], nn.Module]:
    return lambda: nn.Sequential(ObservedLinear(3, 6, how), nn.Tanh(), ObservedLinear(6, 2, how))


@pytest.mark.parametrize("how", ["reassign", "inplace"])
def test_observers_keep_each_members_own_statistics_with_per_member_data_and_masks(how):
    """Per-member batches: even the first layer's observer sees each member's own data. A
    masked member's observer does not move either (its forward still ran)."""
    batches = _batches(3, lead=(N,))
    masks = [[True, True, True], [True, False, True], [False, True, True]]
    ens = vmapens.Ensemble(observed(how), N, seeds=list(range(N)))
    step = vmapens.make_step(
        ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1, momentum=0.9), in_dims=0
    )
    for (x, y), m in zip(batches, masks, strict=True):
        step(x, y, mask=torch.tensor(m))
    alone = seeded_members(observed(how), N)
    _train_alone(alone, batches, _sgd, per_member=True, masks=masks)
    assert_members_equal(ens, alone, **TOL64)
    assert ens.get_buffer("0.batches").tolist() == [2, 2, 3]
    lows = ens.get_buffer("0.lo")
    assert len(set(lows.tolist())) == N  # three members, three minima of their own data
    # eval mode: observers frozen, each member's scale its own
    x = 5 * batches[0][0][0]
    with torch.no_grad():
        want = torch.stack([a.eval()(x) for a in alone])
    torch.testing.assert_close(vmapens.predict(ens, x), want, **TOL64)
    assert_members_equal(ens, alone, **TOL64)


def test_observers_frozen_mid_run_by_a_flag_or_eval_mode_on_the_template():
    """The QAT recipe: observe for one step, then freeze (a flag read by the forward, or the
    observer layers put in eval mode), with the step built before the change."""
    batches = _batches(3)

    def freeze(k: int, m: nn.Module) -> None:
        if k == 1:
            m[0].observe = False  # a flag on the first observer
            m[2].eval()  # eval mode on the second

    for backend in ("vmap", "loop"):
        ens = vmapens.Ensemble(observed(), N, seeds=list(range(N)), backend=backend)
        step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1, momentum=0.9))
        for k, (x, y) in enumerate(batches):
            freeze(k, ens.template)
            step(x, y)
        alone = seeded_members(observed(), N)
        _train_alone(alone, batches, _sgd, between=freeze)
        assert_members_equal(ens, alone, **TOL64)
        assert ens.get_buffer("2.batches").tolist() == [1] * N


def test_hand_loop_member_files_and_unstack_carry_each_members_observers():
    batches = _batches(3)
    ens = vmapens.Ensemble(observed("inplace"), N, seeds=list(range(N)))
    opt = vmapens.StackedAdam(ens, lr=0.02)
    for x, y in batches:
        opt.zero_grad()
        vmapens.per_member(nn.MSELoss())(ens(x), y).sum().backward()
        opt.step()
    alone = seeded_members(observed("inplace"), N)
    _train_alone(alone, batches, _adam)
    assert_members_equal(ens, alone, **TOL64)
    his = ens.get_buffer("2.hi")
    assert len(set(his.tolist())) == N  # the second layer sees each member's own activations
    with tempfile.TemporaryDirectory() as d:
        vmapens.save_members(ens, d)
        states = vmapens.load_members(d)
    x = 4 * batches[0][0]
    for i, (state, member, a) in enumerate(zip(states, ens.unstack(), alone, strict=True)):
        plain = observed("inplace")()  # what a user of the member file does
        plain.load_state_dict(state)
        for got in (plain, member):
            for key, value in a.state_dict().items():
                torch.testing.assert_close(got.state_dict()[key], value, **TOL64, msg=f"{i} {key}")
            with torch.no_grad():
                torch.testing.assert_close(got.eval()(x), a.eval()(x), **TOL64)
            a.train()


def test_fit_with_observers_that_record_in_eval_mode_too_matches_the_naive_loop():
    """An observer that records whatever the mode (as torch's FakeQuantize): `fit`'s
    validation forwards move it, as the naive loop's validation does, its up-front check of
    `val_data` does not; best-epoch restore gives back each member's observers of that epoch."""

    class Always(ObservedLinear):
        eval_too = True

    def member() -> nn.Module:
        return nn.Sequential(Always(3, 6), nn.Tanh(), Always(6, 2))

    g = torch.Generator().manual_seed(1)
    X, Y = torch.randn(8, 3, generator=g, dtype=F64), torch.randn(8, 2, generator=g, dtype=F64)
    XV, YV = (
        3 * torch.randn(6, 3, generator=g, dtype=F64),
        torch.randn(6, 2, generator=g, dtype=F64),
    )
    ens = vmapens.Ensemble(member, N, seeds=list(range(N)))
    h = vmapens.fit(
        ens, (X, Y), nn.MSELoss(), epochs=3, val_data=(XV, YV), optimizer=vmapens.StackedSGD,
        lr=0.1, progress=False, seed=0,
    )  # fmt: skip
    alone = seeded_members(member, N)
    opts = [torch.optim.SGD(a.parameters(), lr=0.1) for a in alone]
    val, kept = [], []
    for _ in range(3):
        for a, opt in zip(alone, opts, strict=True):  # one batch of everything: no shuffle
            a.train()
            opt.zero_grad()
            nn.functional.mse_loss(a(X), Y).backward()
            opt.step()
            with torch.no_grad():
                a.eval()
                val.append(nn.functional.mse_loss(a(XV), YV).item())
                a.train()
        kept.append([{k: v.clone() for k, v in a.state_dict().items()} for a in alone])
    torch.testing.assert_close(h.val_loss, torch.tensor(val, dtype=F64).view(3, N), **TOL64)
    best = h.val_loss.argmin(0)
    assert best.tolist() == h.best_epoch.tolist()
    for i, a in enumerate(alone):
        a.load_state_dict(kept[int(best[i])][i])
    assert_members_equal(ens, alone, **TOL64)


# ---------------------------------------------------------------- what vmap cannot batch


class OldSign(torch.autograd.Function):
    """The STE as most research code writes it: forward(ctx, x), no setup_context."""

    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        ctx.save_for_backward(x)
        return torch.sign(x)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        (x,) = ctx.saved_tensors
        return grad * (x.abs() <= 1)


class OldSignLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.weight.abs().mean().detach()
        return nn.functional.linear(x, OldSign.apply(self.weight) * alpha, self.bias)


class LSQInit(nn.Linear):
    """LSQ's reference code: the step size set from the weights on the first training batch
    (`if self.init_state == 0`, through `.data`), the gradient scaled by g."""

    def __init__(self, i: int, o: int) -> None:
        super().__init__(i, o, dtype=F64)
        self.s = nn.Parameter(torch.ones((), dtype=F64))
        self.register_buffer("init_state", torch.zeros((), dtype=torch.uint8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.init_state == 0:
            self.s.data.copy_(2 * self.weight.abs().mean() / math.sqrt(3))
            self.init_state.fill_(1)
        g = 1.0 / math.sqrt(self.weight.numel() * 3)
        s = (self.s - self.s * g).detach() + self.s * g
        w = _ste_round(torch.clamp(self.weight / s, -4, 3)) * s
        return nn.functional.linear(x, w, self.bias)


class BitsFromBuffer(nn.Linear):
    """A bit-width sweep: each member's bit width in a buffer, read with `int(...)` for
    torch's fake-quantize op, which takes Python ints for the range."""

    def __init__(self, i: int, o: int, bits: int) -> None:
        super().__init__(i, o, dtype=F64)
        self.register_buffer("bits", torch.tensor(bits))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qmax = int(2 ** (self.bits - 1) - 1)
        s = self.weight.abs().max().detach() / qmax
        zp = torch.zeros((), dtype=torch.int32)
        w = torch.fake_quantize_per_tensor_affine(self.weight, s, zp, -qmax - 1, qmax)
        return nn.functional.linear(x, w, self.bias)


def _pair(layer: Callable[[int, int], nn.Module]) -> Callable[[], nn.Module]:
    return lambda: nn.Sequential(layer(3, 6), nn.Tanh(), layer(6, 2)).double()


BITS = (2, 4, 8)


def _observed_pair(layer: Callable[[int, int], nn.Module]) -> Callable[[], nn.Module]:
    """An observer first: its buffers have moved by the time the forward is refused."""
    return lambda: nn.Sequential(ObservedLinear(3, 3), *_pair(layer)())


UNBATCHABLE = {
    "old-style-autograd-function": [_observed_pair(OldSignLinear)] * N,
    "lsq-first-batch-init": [_observed_pair(LSQInit)] * N,
    "per-member-bits-item": [
        _observed_pair(lambda i, o, b=b: BitsFromBuffer(i, o, b)) for b in BITS
    ],
}


@pytest.mark.parametrize("case", list(UNBATCHABLE))
def test_what_vmap_cannot_batch_is_refused_changing_nothing_and_exact_with_the_loop(case):
    factories = UNBATCHABLE[case]
    batches = _batches(3)
    ens = vmapens.Ensemble.from_factories(factories, seed=0)
    opt = vmapens.StackedAdam(ens, lr=0.02)
    step = vmapens.make_step(ens, nn.MSELoss(), opt)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    rng = torch.get_rng_state()
    with pytest.raises(RuntimeError, match=r"^step: .*backend='loop'"):
        step(*batches[0])
    with pytest.raises(RuntimeError, match=r"^Ensemble: .*backend='loop'"):
        ens(batches[0][0])  # the forward alone, in training mode: the same refusal
    assert torch.equal(torch.get_rng_state(), rng)
    for key, value in ens.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0, msg=key)
    ens = vmapens.Ensemble.from_factories(factories, seed=0, backend="loop")
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=0.02))
    for x, y in batches:
        step(x, y)
    alone = factory_members(factories, seed=0)
    _train_alone(alone, batches, _adam)
    assert_members_equal(ens, alone, **TOL64)


class BitsAttribute(nn.Linear):
    def __init__(self, i: int, o: int, bits: int) -> None:
        super().__init__(i, o, dtype=F64)
        self.bits = bits


class BitsBuffer(nn.Linear):
    """The way out for a bit-width sweep under vmap: the range from a per-member buffer,
    the rounding written by hand."""

    def __init__(self, i: int, o: int, bits: int) -> None:
        super().__init__(i, o, dtype=F64)
        self.register_buffer("bits", torch.tensor(bits))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qmax = 2 ** (self.bits - 1) - 1
        s = self.weight.abs().max().detach() / qmax
        wq = torch.clamp(torch.round(self.weight / s), -qmax - 1, qmax) * s
        return nn.functional.linear(x, self.weight + (wq - self.weight).detach(), self.bias)


def test_a_bit_width_sweep_as_an_attribute_is_refused_and_as_a_buffer_trains_as_alone():
    attribute = [_pair(lambda i, o, b=b: BitsAttribute(i, o, b)) for b in BITS]
    with pytest.raises(ValueError, match=r"member 1 differs .*`bits` is 4 vs 2.*buffer"):
        vmapens.Ensemble.from_factories(attribute, seed=0)
    factories = [_pair(lambda i, o, b=b: BitsBuffer(i, o, b)) for b in BITS]
    batches = _batches(3)
    ens = vmapens.Ensemble.from_factories(factories, seed=0)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=0.02))
    for x, y in batches:
        step(x, y)
    alone = factory_members(factories, seed=0)
    _train_alone(alone, batches, _adam)
    assert_members_equal(ens, alone, **TOL64)
    assert [int(m[0].bits) for m in ens.unstack()] == list(BITS)


# ---------------------------------------------------------------- (d) stochastic rounding


class StochasticRound(nn.Linear):
    """2-bit-ish weights rounded up with probability frac(w / s): `floor(v + U[0, 1))`, or
    `floor(v) + bernoulli(frac(v))` (a draw from the member's own weights)."""

    how = "uniform"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.weight.abs().max().detach() / 3
        v = self.weight / s
        if self.how == "uniform":
            q = torch.floor(v + torch.rand_like(v))
        else:
            q = torch.floor(v) + torch.bernoulli((v - torch.floor(v)).detach())
        return nn.functional.linear(x, self.weight + (q * s - self.weight).detach(), self.bias)


class BernoulliRound(StochasticRound):
    how = "bernoulli"


def _train_seeded(ens: vmapens.Ensemble, alone: list[nn.Module], batches: list[tuple]) -> None:
    """Step k from torch.manual_seed(100 + k), for the ensemble and for each member alone."""
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1))
    opts = [torch.optim.SGD(a.parameters(), lr=0.1) for a in alone]
    for k, (x, y) in enumerate(batches):
        torch.manual_seed(100 + k)
        step(x, y)
        after = torch.get_rng_state()
        for a, opt in zip(alone, opts, strict=True):
            torch.manual_seed(100 + k)
            opt.zero_grad()
            nn.functional.mse_loss(a(x), y).backward()
            opt.step()
        assert torch.equal(after, torch.get_rng_state())  # the RNG advanced as for one member


@pytest.mark.parametrize(
    ("layer", "backend"),
    [(StochasticRound, "vmap"), (StochasticRound, "loop"), (BernoulliRound, "loop")],
)
def test_stochastic_rounding_with_randomness_same_draws_what_each_member_draws_alone(
    layer, backend
):
    factory = _pair(layer)
    batches = _batches(3)
    ens = vmapens.Ensemble(factory, N, seeds=list(range(N)), randomness="same", backend=backend)
    alone = seeded_members(factory, N)
    _train_seeded(ens, alone, batches)
    assert_members_equal(ens, alone, **TOL64)


def test_a_bernoulli_draw_from_each_members_weights_under_same_is_refused_naming_the_loop():
    ens = vmapens.Ensemble(_pair(BernoulliRound), N, seeds=list(range(N)), randomness="same")
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1))
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"^step: .*own parameters.*backend='loop'"):
        step(*_batches(1)[0])
    for key, value in ens.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("layer", [StochasticRound, BernoulliRound])
def test_stochastic_rounding_with_randomness_different_is_unbiased_and_independent(layer):
    """In distribution only (docs/semantics.md): every member rounds its own weights with its
    own draws, up with probability frac(w / s), as alone."""

    class Probe(layer):  # returns the rounded weights instead of the layer's output
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(torch.eye(self.in_features, dtype=F64)) - self.bias

    def member() -> nn.Module:
        m = Probe(500, 4, dtype=F64)
        with torch.no_grad():
            m.weight.fill_(0.25)  # v = 0.25 / (0.25 / 3) = 3 exactly: no rounding left
            m.weight[:, 1:].fill_(0.0625)  # v = 0.75: up to 1 with probability 0.75
        return m

    ens = vmapens.Ensemble(member, 4, seeds=list(range(4)))
    torch.manual_seed(0)
    with torch.no_grad():
        q = ens(torch.zeros(1)) / (0.25 / 3)  # [members, in, out]: the levels drawn
    q = q.transpose(1, 2)[:, :, 1:]  # the 0.75 entries
    torch.testing.assert_close(q, q.round(), rtol=0, atol=1e-12)  # levels (STE round-off)
    q = q.round()
    assert set(q.unique().tolist()) == {0.0, 1.0}
    draws = q.numel()  # 4 members x 4 rows x 499
    assert abs(q.mean().item() - 0.75) < 5 * math.sqrt(0.75 * 0.25 / draws)
    agree = (q[0] == q[1]).double().mean().item()  # independent: 0.75^2 + 0.25^2 = 0.625
    assert abs(agree - 0.625) < 5 * math.sqrt(0.625 * 0.375 / q[0].numel())
