"""torch.nn layers no other test used, trained in an ensemble against each member alone.

The truth is plain PyTorch: each member built alone after ``torch.manual_seed(k)`` (as
``seeds=range(n)`` builds member ``k``) and trained with ``torch.optim.SGD`` on the same
batch. A layer that draws random numbers (FractionalMaxPool, AlphaDropout) is compared under
``randomness="same"``, where every member draws what it draws alone from the same RNG state.
Where vmap cannot run a layer the ensemble must refuse, naming the way out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations, prune
from truth import TOL64, seeded_members

import vmapens

N = 3
LR = 0.05

pytestmark = pytest.mark.usefixtures("float64_default")


def _data(*shape: int, seed: int = 5) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


class _Head(nn.Module):
    """``pre`` (a conv), the layer under test, then a Linear sized for its output."""

    def __init__(self, pre: nn.Module, mid: nn.Module, example: torch.Tensor) -> None:
        super().__init__()
        self.pre, self.mid = pre, mid
        with torch.no_grad():
            width = mid(pre(example)).flatten(1).shape[1]
        self.post = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.mid(self.pre(x)).flatten(1))


def _compare(
    factory: Callable[[], nn.Module],
    inputs: tuple[torch.Tensor, ...],
    target: Any,
    loss_fn: Callable[..., torch.Tensor] = F.mse_loss,
    *,
    steps: int = 2,
    make_step: bool = False,
    reseed: bool = False,
    **ensemble_kw: Any,
) -> None:
    """Forward, then ``steps`` SGD steps, of the ensemble and of each member alone; every
    output and every state_dict entry equal (``ens.state_dicts()`` and ``ens.unstack()``).
    With ``reseed`` each call (the ensemble's and every member's) starts from one RNG state."""
    ens = vmapens.Ensemble(factory, n=N, seeds=range(N), **ensemble_kw)
    plain = seeded_members(factory, N)

    def seeded(k: int) -> None:
        if reseed:
            torch.manual_seed(1000 + k)

    seeded(0)
    out = ens(*inputs)
    for i, m in enumerate(plain):
        seeded(0)
        torch.testing.assert_close(out[i], m(*inputs), **TOL64, msg=f"forward, member {i}")
    opt = vmapens.StackedSGD(ens, lr=LR)
    step = vmapens.make_step(ens, loss_fn, opt) if make_step else None
    torch_opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in plain]
    for k in range(1, steps + 1):
        seeded(k)
        if step is not None:
            step(inputs if len(inputs) > 1 else inputs[0], target)
        else:
            loss = vmapens.per_member(loss_fn)(ens(*inputs), target)
            opt.zero_grad()
            loss.sum().backward()
            opt.step()
        for m, o in zip(plain, torch_opts, strict=True):
            seeded(k)
            o.zero_grad()
            loss_fn(m(*inputs), target).backward()
            o.step()
    states = ens.state_dicts()
    for i, (m, copy) in enumerate(zip(plain, ens.unstack(), strict=True)):
        want = m.state_dict()
        assert list(states[i]) == list(want)
        for key, value in want.items():
            torch.testing.assert_close(states[i][key], value, **TOL64, msg=f"member {i} {key}")
            torch.testing.assert_close(copy.state_dict()[key], value, **TOL64, msg=key)


IMG = _data(2, 3, 8, 8)
SEQ = _data(2, 3, 10, seed=6)
VOL = _data(2, 2, 4, 6, 6, seed=7)
Y = _data(2, 2, seed=8)


def _conv2() -> nn.Module:
    return nn.Conv2d(3, 4, 3, padding=1)


def _conv1() -> nn.Module:
    return nn.Conv1d(3, 4, 3, padding=1)


def _conv3() -> nn.Module:
    return nn.Conv3d(2, 3, 3, padding=1)


LAYERS: dict[str, tuple[Callable[[], nn.Module], Callable[[], nn.Module], torch.Tensor]] = {
    "LPPool2d": (_conv2, lambda: nn.LPPool2d(2, 2), IMG),
    "LPPool1d": (_conv1, lambda: nn.Sequential(nn.ReLU(), nn.LPPool1d(1.5, 3, 2)), SEQ),
    "LPPool3d": (_conv3, lambda: nn.Sequential(nn.Softplus(), nn.LPPool3d(2, 2)), VOL),
    "LocalResponseNorm": (_conv2, lambda: nn.LocalResponseNorm(2), IMG),
    "Softmax2d": (_conv2, nn.Softmax2d, IMG),
    "PixelUnshuffle": (_conv2, lambda: nn.PixelUnshuffle(2), IMG),
    "ChannelShuffle": (_conv2, lambda: nn.ChannelShuffle(2), IMG),
    "Fold(Unfold)": (
        _conv2,
        lambda: nn.Sequential(nn.Unfold(2, stride=2), nn.Fold((8, 8), 2, stride=2)),
        IMG,
    ),
    "Unfold_dilated": (_conv2, lambda: nn.Unfold(3, dilation=2, padding=1), IMG),
    "ReflectionPad1d": (_conv1, lambda: nn.ReflectionPad1d((2, 1)), SEQ),
    "ReplicationPad1d": (_conv1, lambda: nn.ReplicationPad1d(3), SEQ),
    "CircularPad1d": (_conv1, lambda: nn.CircularPad1d(2), SEQ),
    "ConstantPad1d": (_conv1, lambda: nn.ConstantPad1d((1, 3), -2.0), SEQ),
    "ReplicationPad2d": (_conv2, lambda: nn.ReplicationPad2d(2), IMG),
    "CircularPad2d": (_conv2, lambda: nn.CircularPad2d((1, 2, 2, 0)), IMG),
    "ReflectionPad3d": (_conv3, lambda: nn.ReflectionPad3d(1), VOL),
    "ReplicationPad3d": (_conv3, lambda: nn.ReplicationPad3d((1, 0, 2, 1, 0, 1)), VOL),
    "CircularPad3d": (_conv3, lambda: nn.CircularPad3d(1), VOL),
    "ZeroPad3d": (_conv3, lambda: nn.ZeroPad3d((0, 1, 1, 0, 1, 0)), VOL),
    "AdaptiveMaxPool1d": (_conv1, lambda: nn.AdaptiveMaxPool1d(4), SEQ),
    "AdaptiveAvgPool3d": (_conv3, lambda: nn.AdaptiveAvgPool3d((2, 3, 1)), VOL),
    "AdaptiveMaxPool3d": (_conv3, lambda: nn.AdaptiveMaxPool3d(2), VOL),
    "AvgPool3d_ceil": (_conv3, lambda: nn.AvgPool3d(2, (1, 2, 2), 1, ceil_mode=True), VOL),
    "MaxPool3d_dilated": (_conv3, lambda: nn.MaxPool3d(2, 2, dilation=(1, 2, 1)), VOL),
    "InstanceNorm1d_tracked": (
        _conv1,
        lambda: nn.InstanceNorm1d(4, affine=True, track_running_stats=True, momentum=0.3),
        SEQ,
    ),
    "InstanceNorm2d_tracked_cumulative": (
        _conv2,
        lambda: nn.InstanceNorm2d(4, track_running_stats=True, momentum=None),
        IMG,
    ),
    "InstanceNorm3d_tracked": (
        _conv3,
        lambda: nn.InstanceNorm3d(3, affine=True, track_running_stats=True),
        VOL,
    ),
    "ConvTranspose1d_groups": (
        _conv1,
        lambda: nn.ConvTranspose1d(4, 2, 3, stride=2, output_padding=1, groups=2, dilation=2),
        SEQ,
    ),
    "ConvTranspose3d": (_conv3, lambda: nn.ConvTranspose3d(3, 2, 2, stride=2), VOL),
    "UpsamplingBilinear2d": (_conv2, lambda: nn.UpsamplingBilinear2d(scale_factor=2), IMG),
    "UpsamplingNearest2d": (_conv2, lambda: nn.UpsamplingNearest2d(size=(5, 7)), IMG),
    "Upsample_nearest-exact": (
        _conv2,
        lambda: nn.Upsample(scale_factor=1.5, mode="nearest-exact"),
        IMG,
    ),
    "Upsample_trilinear": (
        _conv3,
        lambda: nn.Upsample(scale_factor=(1, 2, 1.5), mode="trilinear"),
        VOL,
    ),
    "Hardshrink": (_conv2, lambda: nn.Hardshrink(0.1), IMG),
    "Softsign+Tanhshrink": (_conv2, lambda: nn.Sequential(nn.Softsign(), nn.Tanhshrink()), IMG),
    "Threshold+Hardtanh": (
        _conv2,
        lambda: nn.Sequential(nn.Threshold(0.1, -1.0), nn.Hardtanh(-0.5, 0.5)),
        IMG,
    ),
    "Conv2d_reflect_same_dilated": (
        lambda: nn.Conv2d(3, 4, (4, 3), padding="same", dilation=(2, 1), padding_mode="reflect"),
        nn.Identity,
        IMG,
    ),
}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layer_trains_as_alone(name: str) -> None:
    pre, mid, x = LAYERS[name]
    _compare(lambda: _Head(pre(), mid(), x), (x,), Y)


@pytest.mark.parametrize("kw", [{"backend": "loop"}, {"chunk_size": 2}], ids=["loop", "chunked"])
@pytest.mark.parametrize("name", ["InstanceNorm3d_tracked", "LPPool2d", "CircularPad3d"])
def test_layer_backends(name: str, kw: dict) -> None:
    pre, mid, x = LAYERS[name]
    _compare(lambda: _Head(pre(), mid(), x), (x,), Y, **kw)


class _Unpool(nn.Module):
    """MaxPool with indices into MaxUnpool (1d, 2d with output_size, 3d)."""

    def __init__(self, dims: int) -> None:
        super().__init__()
        conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dims - 1]
        pool = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)[dims - 1]
        unpool = (nn.MaxUnpool1d, nn.MaxUnpool2d, nn.MaxUnpool3d)[dims - 1]
        channels = 2 if dims == 3 else 3
        self.c = conv(channels, 3, 3, padding=1)
        self.p, self.u = pool(2, return_indices=True), unpool(2)
        size = {1: 3 * 10, 2: 3 * 8 * 8, 3: 3 * 4 * 6 * 6}[dims]
        self.o = nn.Linear(size, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, i = self.p(self.c(x))
        return self.o(self.u(h, i, output_size=x.shape[2:]).flatten(1))


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_max_unpool(dims: int) -> None:
    x = (SEQ, IMG, VOL)[dims - 1]
    _compare(lambda: _Unpool(dims), (x,), Y, make_step=dims == 2)


class _AdaptiveIndices(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, padding=1)
        self.p = nn.AdaptiveMaxPool2d(3, return_indices=True)
        self.o = nn.Linear(4 * 9, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, i = self.p(self.c(x))
        return self.o((h * (1 + i.to(h.dtype) / 64)).flatten(1))


def test_adaptive_max_pool_indices() -> None:
    _compare(_AdaptiveIndices, (IMG,), Y)


class _TransposeToSize(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv3d(2, 3, 3, stride=2, padding=1)
        self.t = nn.ConvTranspose3d(3, 2, 3, stride=2, padding=1)
        self.o = nn.Linear(2 * 4 * 6 * 6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(self.t(self.c(x), output_size=x.shape[2:]).flatten(1))


def test_conv_transpose_output_size() -> None:
    _compare(_TransposeToSize, (VOL,), Y, make_step=True)


class _Fractional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, padding=1)
        self.p = nn.FractionalMaxPool2d(2, output_size=(5, 5))
        self.o = nn.Linear(4 * 25, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(self.p(self.c(x)).flatten(1))


class _AlphaDropouts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.o = nn.Linear(4, 6), nn.Linear(6, 2)
        self.d, self.fd = nn.AlphaDropout(0.3), nn.FeatureAlphaDropout(0.4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(self.fd(self.d(self.a(x)).unsqueeze(-1)).squeeze(-1))


@pytest.mark.parametrize(
    "kw",
    [{}, {"backend": "loop"}, {"chunk_size": 2}],
    ids=["vmap", "loop", "chunked"],
)
@pytest.mark.parametrize("factory", [_Fractional, _AlphaDropouts], ids=lambda f: f.__name__)
def test_random_layers_same_draws(factory: type, kw: dict) -> None:
    x = IMG if factory is _Fractional else _data(2, 4, seed=9)
    _compare(factory, (x,), Y, reseed=True, randomness="same", make_step=not kw, **kw)


def test_fractional_max_pool_3d_same_draws() -> None:
    class Frac3(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c = nn.Conv3d(2, 3, 3, padding=1)
            self.p = nn.FractionalMaxPool3d(2, output_ratio=0.6)
            self.o = nn.Linear(3 * 2 * 3 * 3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.o(self.p(self.c(x)).flatten(1))

    _compare(Frac3, (VOL,), Y, reseed=True, randomness="same")


class _Cells(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.RNNCell(4, 5, nonlinearity="relu")
        self.g = nn.GRUCell(5, 3, bias=False)
        self.o = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = hg = None
        for t in range(3):
            h = self.c(x * (t + 1), h)
            hg = self.g(h, hg)
        return self.o(hg)


def test_relu_rnn_cell() -> None:
    _compare(_Cells, (_data(2, 4, seed=9),), Y, make_step=True)


class _Seq2Seq(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Transformer(
            8, 2, 1, 2, 12, dropout=0.0, batch_first=True, norm_first=True, activation="gelu"
        )
        self.o = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(3)
        return self.o(self.t(x[:, :5], x[:, 5:], tgt_mask=mask, tgt_is_causal=True).mean(1))


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True:UserWarning")
def test_full_transformer() -> None:
    _compare(_Seq2Seq, (_data(2, 8, 8, seed=10),), Y, make_step=True)


@pytest.mark.parametrize("orthogonal_map", ["matrix_exp", "cayley", "householder"])
def test_orthogonal_parametrization(orthogonal_map: str) -> None:
    def factory() -> nn.Module:
        layer = parametrizations.orthogonal(nn.Linear(4, 4), orthogonal_map=orthogonal_map)
        return nn.Sequential(layer, nn.Linear(4, 2))

    _compare(factory, (_data(2, 4, seed=9),), Y)


def test_pruned_layers() -> None:
    def factory() -> nn.Module:
        m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(144, 2))
        prune.ln_structured(m[0], "weight", amount=0.5, n=2, dim=0)
        prune.l1_unstructured(m[0], "weight", amount=0.2)  # a PruningContainer now
        prune.random_unstructured(m[2], "weight", amount=0.3)
        return m

    _compare(factory, (IMG,), Y, make_step=True)


class _Bags(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.e = nn.EmbeddingBag(10, 3, mode=mode, padding_idx=None if mode == "max" else 2)
        self.o = nn.Linear(3, 2)

    def forward(self, idx: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        weights = torch.linspace(0.5, 2, idx.numel()) if self.e.mode == "sum" else None
        return self.o(self.e(idx, offsets, per_sample_weights=weights))


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_modes(mode: str) -> None:
    idx = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9])
    _compare(lambda: _Bags(mode), (idx, torch.tensor([0, 3])), Y, make_step=mode == "max")


class _Distances(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 3)
        self.cos, self.dist = nn.CosineSimilarity(dim=1), nn.PairwiseDistance(1.5, keepdim=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.a(x), self.b(x)
        return torch.cat([self.cos(a, b).unsqueeze(1), self.dist(a, b)], 1)


def test_distance_layers() -> None:
    _compare(_Distances, (_data(2, 4, seed=9),), Y)


def _mlp(out: int) -> Callable[[], nn.Module]:
    return lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, out))


X6 = _data(6, 4, seed=11)
SIGNS = torch.tensor([1.0, -1, 1, -1, -1, 1], dtype=torch.float64)
LOSSES: dict[str, tuple[int, Callable[..., torch.Tensor], torch.Tensor]] = {
    "MultiLabelMarginLoss": (
        5,
        nn.MultiLabelMarginLoss(),
        torch.tensor([[0, 3, -1, 1, 1], [2, -1, 0, 0, 0], [1, 2, 4, -1, 0]] * 2),
    ),
    "MultiLabelSoftMarginLoss": (
        5,
        nn.MultiLabelSoftMarginLoss(weight=torch.linspace(0.2, 1, 5, dtype=torch.float64)),
        (_data(6, 5, seed=12) > 0).double(),
    ),
    "PoissonNLLLoss": (5, nn.PoissonNLLLoss(full=True), _data(6, 5, seed=13).abs().round()),
    "GaussianNLLLoss": (
        5,
        lambda o, t: nn.GaussianNLLLoss(full=True)(o, t, F.softplus(o) + 0.1),
        _data(6, 5, seed=13),
    ),
    "TripletMarginWithDistanceLoss": (
        6,
        lambda o, t: nn.TripletMarginWithDistanceLoss(
            distance_function=nn.PairwiseDistance(), margin=0.4, swap=True
        )(o[:, :2], o[:, 2:4], o[:, 4:]),
        SIGNS,
    ),
    "HingeEmbeddingLoss": (1, lambda o, t: nn.HingeEmbeddingLoss(0.3)(o.squeeze(1), t), SIGNS),
    "SoftMarginLoss": (1, lambda o, t: nn.SoftMarginLoss()(o.squeeze(1), t), SIGNS),
    "MarginRankingLoss": (2, lambda o, t: nn.MarginRankingLoss(0.2)(o[:, 0], o[:, 1], t), SIGNS),
}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_loss_trains_as_alone(name: str) -> None:
    out, loss_fn, target = LOSSES[name]
    _compare(_mlp(out), (X6,), target, loss_fn, make_step=name != "GaussianNLLLoss")


class _CTC(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.r, self.o = nn.GRU(4, 6, batch_first=True), nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.o(self.r(x)[0]), -1).transpose(0, 1)


@pytest.mark.parametrize("make_step", [False, True])
def test_ctc_loss(make_step: bool) -> None:
    ctc = nn.CTCLoss(blank=0, zero_infinity=True)

    def loss_fn(log_probs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return ctc(log_probs, targets, torch.tensor([7, 6]), torch.tensor([3, 2]))

    targets = torch.tensor([[1, 2, 2], [3, 1, 0]])
    _compare(_CTC, (_data(2, 7, 4, seed=14),), targets, loss_fn, make_step=make_step)


class _AdaptiveSoftmax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.s = nn.AdaptiveLogSoftmaxWithLoss(8, 10, [2, 6], div_value=2.0, head_bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.s.log_prob(torch.tanh(self.a(x)))


def test_adaptive_log_softmax() -> None:
    _compare(_AdaptiveSoftmax, (X6,), torch.tensor([0, 7, 3, 9, 1, 5]), F.nll_loss, make_step=True)


class _CrossMap(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c, self.n, self.o = nn.Conv2d(3, 4, 3), nn.CrossMapLRN2d(3, 1e-2), nn.Linear(144, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(self.n(self.c(x)).flatten(1))


def test_cross_map_lrn_refused_under_vmap_exact_in_loop() -> None:
    with pytest.raises(RuntimeError, match="backend='loop'"):
        vmapens.Ensemble(_CrossMap, n=N, seeds=range(N))(IMG)
    _compare(_CrossMap, (IMG,), Y, backend="loop")


# RReLU draws a slope for negative inputs only: members draw different amounts, which the
# loop backend rightly warns about (each call here starts from one RNG state again).
@pytest.mark.filterwarnings("ignore:backend='loop' with randomness='same':UserWarning")
def test_rrelu_refused_under_vmap() -> None:
    class Leaky(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.r, self.o = nn.Linear(4, 6), nn.RReLU(), nn.Linear(6, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.o(self.r(self.a(x)))

    with pytest.raises(RuntimeError, match="rrelu.*backend='loop'"):
        vmapens.Ensemble(Leaky, n=N, seeds=range(N))(_data(2, 4, seed=9))
    _compare(Leaky, (_data(2, 4, seed=9),), Y, reseed=True, randomness="same", backend="loop")


@pytest.mark.parametrize(
    "layer",
    [lambda: nn.LazyLinear(2), lambda: nn.LazyConv2d(2, 3), lambda: nn.LazyInstanceNorm2d()],
    ids=["LazyLinear", "LazyConv2d", "LazyInstanceNorm2d"],
)
def test_lazy_layers_refused_before_materialised(layer: Callable[[], nn.Module]) -> None:
    with pytest.raises(ValueError, match="uninitialised lazy tensor"):
        vmapens.Ensemble(layer, n=N, seeds=range(N))


def test_lazy_layer_materialised_in_factory() -> None:
    def factory() -> nn.Module:
        m = nn.Sequential(nn.LazyLinear(3), nn.Tanh(), nn.LazyLinear(2))
        m(torch.zeros(1, 4))
        return m

    _compare(factory, (_data(2, 4, seed=9),), Y)


# -- bugs --------------------------------------------------------------------------------------


class _SpectralEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.e = parametrizations.spectral_norm(nn.Embedding(10, 4))
        self.o = nn.Linear(4, 2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.o(self.e(idx).mean(1))


@pytest.mark.parametrize("backend", ["vmap", "loop"])
def test_spectral_norm_embedding_called_twice(backend: str) -> None:
    # follow_sparse read the template Embedding's `weight` every call: the parametrization ran
    # its power iteration on the meta template, and the next call refused a write on `_u`
    idx = torch.tensor([[1, 1, 4], [4, 9, 1]])
    _compare(_SpectralEmbedding, (idx,), Y, backend=backend)


def test_spectral_norm_embedding_state_dicts_after_make_step() -> None:
    idx = torch.tensor([[1, 1, 4], [4, 9, 1]])
    ens = vmapens.Ensemble(_SpectralEmbedding, n=N, seeds=range(N))
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedSGD(ens, lr=LR))
    step(idx, Y)
    plain = seeded_members(_SpectralEmbedding, N)
    for m in plain:
        opt = torch.optim.SGD(m.parameters(), lr=LR)
        F.mse_loss(m(idx), Y).backward()
        opt.step()
    # The stacked tensors are right: only reading them out is refused.
    for name, t in [*ens.named_parameters(), *ens.named_buffers()]:
        for i, m in enumerate(plain):
            torch.testing.assert_close(t[i], m.state_dict()[name], **TOL64)
    states = ens.state_dicts()
    for i, m in enumerate(plain):
        for key, value in m.state_dict().items():
            torch.testing.assert_close(states[i][key], value, **TOL64)
