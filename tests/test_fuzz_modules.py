"""Seeded random user modules, each trained in an ensemble against its members trained alone.

A program draws a module the other tests never saw: a stack of blocks over a ``[batch, time,
width]`` tensor (Linear, Bilinear, Conv1d/Conv2d/ConvTranspose1d with groups, strides,
dilations and padding modes, BatchNorm with every flag, LayerNorm/GroupNorm/InstanceNorm/
RMSNorm, dropout variants, Embedding/EmbeddingBag with ``padding_idx`` and ``max_norm`` on
indices computed from the data, MultiheadAttention and TransformerEncoderLayer with masks,
GRU/LSTM/RNN and their cells, activations (in place too), PReLU, residual connections, tied
parameters and buffers, buffers the forward edits or reassigns, parametrizations, and custom
forward code: ``torch.where``, tensor indexing, sorting, ``einsum``, reductions, ``F.*``
calls, plain float attributes). Every block is checked to run alone before it is kept.

Then ``Ensemble`` (or ``from_modules``) stacks N = 2..3 float64 members, and the truth is the
same N modules alone, in plain torch: the train- and eval-mode forward (outputs and buffers),
then two training steps of ``make_step`` with ``StackedAdam`` or ``StackedSGD`` against
``torch.optim`` on each module. Dropout in training mode is compared with
``randomness="same"`` from one RNG state: one mask for every member, the one a member alone
draws (docs/semantics.md, "Randomness in the forward pass"). Where vmap cannot run the module,
the ensemble must refuse with an error that names the API and the way out, having changed
nothing; the way out (``backend="loop"``) must then train as alone. A silent difference is a bug.

Run programs by hand: ``python tests/test_fuzz_modules.py 0 500`` runs seeds 0..499 and prints
each program's blocks and outcome (``-v`` prints the refusals' messages).
"""

from __future__ import annotations

import copy
import random
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import parametrizations, parametrize

import vmapens

TOL = dict(rtol=1e-9, atol=1e-9)  # float64: only the order of sums may differ
ROWS = 4

pytestmark = [
    pytest.mark.usefixtures("float64_default"),
    # Layers without a batching rule run member by member with torch's performance warning
    # (docs/semantics.md, "What vmap cannot batch").
    pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),
]


# -- blocks: each maps [batch, time, width] to [batch, time', width'] ----------------------------


def _idx(h: torch.Tensor, high: int) -> torch.Tensor:
    """Indices in [0, high) computed from the data (differ per member inside the ensemble)."""
    return (h.detach()[..., 0].abs() * 3).long().clamp(max=high - 1)


class Lin(nn.Module):
    def __init__(self, d: int, out: int, bias: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(d, out, bias=bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc(h)


class Bil(nn.Module):
    def __init__(self, d: int, out: int, bias: bool) -> None:
        super().__init__()
        self.b = nn.Bilinear(d, d, out, bias=bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.b(h, torch.tanh(h.flip(-1)))


class Conv1(nn.Module):
    def __init__(self, d: int, transpose: bool, **kw: Any) -> None:
        super().__init__()
        self.conv = (nn.ConvTranspose1d if transpose else nn.Conv1d)(d, **kw)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.conv(h.transpose(1, 2)).transpose(1, 2)


class Conv2(nn.Module):
    """Width d = c * w folded into c channels of a [time, w] image."""

    def __init__(self, d: int, c: int, **kw: Any) -> None:
        super().__init__()
        self.c = c
        self.conv = nn.Conv2d(c, **kw)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        img = h.reshape(b, t, self.c, d // self.c).permute(0, 2, 1, 3)
        out = self.conv(img)
        return out.permute(0, 2, 1, 3).flatten(2)


class ChannelNorm(nn.Module):
    """A norm over channels: [batch, width, time] (or [batch * time, width] for ``flat``)."""

    def __init__(self, norm: nn.Module, flat: bool = False) -> None:
        super().__init__()
        self.norm, self.flat = norm, flat

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.flat:
            return self.norm(h.reshape(-1, h.shape[-1])).reshape(h.shape)
        return self.norm(h.transpose(1, 2)).transpose(1, 2)


#: Programs rerun with contiguous dropout inputs (docs/semantics.md: a mask is the member's own
#: where vmap lays the input out as the member alone does): set by ``run``.
CONTIGUOUS_DROPOUT = [False]


class Last(nn.Module):
    """A layer over the last dimension as it is (LayerNorm, RMSNorm, activations, dropout)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if CONTIGUOUS_DROPOUT[0] and isinstance(self.layer, nn.Dropout):
            h = h.contiguous()
        return self.layer(h)


class Embed(nn.Module):
    def __init__(self, d: int, vocab: int, dim: int, bag: str | None, weighted: bool, **kw: Any):
        super().__init__()
        self.vocab, self.weighted = vocab, weighted
        if bag is None:
            self.emb: nn.Module = nn.Embedding(vocab, dim, **kw)
        else:
            self.emb = nn.EmbeddingBag(vocab, dim, mode=bag, **kw)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        idx = _idx(h, self.vocab)
        if isinstance(self.emb, nn.Embedding):
            return torch.cat([h, self.emb(idx)], -1)
        w = torch.softmax(h[..., -1], -1) if self.weighted else None
        bag = self.emb(idx, per_sample_weights=w)
        return torch.cat([h, bag.unsqueeze(1).expand(-1, h.shape[1], -1)], -1)


class Attn(nn.Module):
    def __init__(
        self, d: int, heads: int, batch_first: bool, mask: str, weights: str, **kw: Any
    ) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(d, heads, batch_first=batch_first, **kw)
        self.batch_first, self.mask, self.weights = batch_first, mask, weights

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        t = h.shape[1]
        attn_mask = key_padding = None
        if self.mask == "causal":
            attn_mask = nn.Transformer.generate_square_subsequent_mask(t)
        elif self.mask == "bool":
            attn_mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        elif self.mask == "padding":
            key_padding = torch.zeros(h.shape[0], t, dtype=torch.bool)
            key_padding[:, -1] = True
        x = h if self.batch_first else h.transpose(0, 1)
        out, w = self.mha(
            x,
            x,
            x,
            attn_mask=attn_mask,
            key_padding_mask=key_padding,
            need_weights=self.weights != "none",
            average_attn_weights=self.weights == "mean",
        )
        out = out if self.batch_first else out.transpose(0, 1)
        if w is not None:
            out = out + w.sum(-1).reshape(h.shape[0], -1)[:, :1, None]
        return out


class Encoder(nn.Module):
    def __init__(self, d: int, mask: str, stack: int, activation: str, **kw: Any) -> None:
        super().__init__()
        act: Any = F.silu if activation == "silu" else activation
        layer = nn.TransformerEncoderLayer(d, activation=act, batch_first=True, **kw)
        self.enc: nn.Module = (
            nn.TransformerEncoder(layer, stack, enable_nested_tensor=False) if stack else layer
        )
        self.mask = mask

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        t = h.shape[1]
        kw: dict[str, Any] = {}
        if self.mask == "causal":
            kw = dict(src_mask=nn.Transformer.generate_square_subsequent_mask(t), is_causal=True)
        elif self.mask == "padding":
            pad = torch.zeros(h.shape[0], t, dtype=torch.bool)
            pad[:, -1] = True
            kw = dict(src_key_padding_mask=pad)
        return self.enc(h, **kw)


class Recurrent(nn.Module):
    def __init__(self, d: int, kind: str, h0: bool, last: bool, **kw: Any) -> None:
        super().__init__()
        self.rnn = getattr(nn, kind)(d, **kw)
        self.kind, self.h0, self.last = kind, h0, last

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        rnn = self.rnn
        x = h if rnn.batch_first else h.transpose(0, 1)
        state = None
        if self.h0:
            layers = rnn.num_layers * (2 if rnn.bidirectional else 1)
            size = rnn.proj_size or rnn.hidden_size if self.kind == "LSTM" else rnn.hidden_size
            h0 = torch.tanh(h.mean(1)[:, :1]).expand(h.shape[0], size).unsqueeze(0)
            h0 = h0.repeat(layers, 1, 1)
            state = (
                (h0, torch.zeros(layers, h.shape[0], rnn.hidden_size))
                if self.kind == "LSTM"
                else h0
            )
        out, hn = rnn(x, state)
        out = out if rnn.batch_first else out.transpose(0, 1)
        if self.last:
            hn = hn[0] if isinstance(hn, tuple) else hn
            out = out + hn[-1].sum(-1)[:, None, None]
        return out


class Cell(nn.Module):
    def __init__(self, d: int, kind: str, hidden: int, **kw: Any) -> None:
        super().__init__()
        self.cell = getattr(nn, kind)(d, hidden, **kw)
        self.kind = kind

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        state: Any = None
        outs = []
        for t in range(h.shape[1]):
            state = self.cell(h[:, t], state)
            outs.append(state[0] if self.kind == "LSTMCell" else state)
        return torch.stack(outs, 1)


class Residual(nn.Module):
    def __init__(self, d: int, inner: str, inplace: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d) if inner == "norm" else nn.Identity()
        self.act = nn.ReLU(inplace=inplace)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.act(self.fc(self.norm(h)))


class Tied(nn.Module):
    """Two layers sharing a weight, and a buffer registered twice that the forward edits."""

    def __init__(self, d: int, buffer: bool) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d, bias=False)
        self.b.weight = self.a.weight
        if buffer:
            shared = torch.zeros(d)
            self.register_buffer("run", shared)
            self.b.register_buffer("run", shared)
        self.buffer = buffer

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = self.b(torch.tanh(self.a(h)))
        if self.buffer:
            if self.training:
                self.run.mul_(0.5).add_(0.5 * out.detach().mean((0, 1)))
            out = out - self.b.run
        return out


class Stateful(nn.Module):
    """Buffers the forward edits in place or reassigns, and an int counter."""

    def __init__(self, d: int, how: str, momentum: float) -> None:
        super().__init__()
        self.register_buffer("ema", torch.zeros(d))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.how, self.momentum = how, momentum
        self.fc = nn.Linear(d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.fc(h)
        if self.training:
            new = h.detach().mean((0, 1))
            if self.how == "inplace":
                self.ema.mul_(self.momentum).add_((1 - self.momentum) * new)
            else:
                self.ema = self.momentum * self.ema + (1 - self.momentum) * new
            self.calls += 1
        return h - self.ema * self.calls.clamp(max=3)


class Symmetric(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu() + x.triu(1).transpose(-1, -2)


class Param(nn.Module):
    def __init__(self, d: int, how: str) -> None:
        super().__init__()
        fc = nn.Linear(d, d)
        if how == "weight_norm":
            fc = parametrizations.weight_norm(fc)
        elif how == "old_weight_norm":
            fc = nn.utils.weight_norm(fc)
        elif how.startswith("orthogonal"):
            fc = parametrizations.orthogonal(fc, orthogonal_map=how.split(":")[1])
        elif how == "spectral_norm":
            fc = parametrizations.spectral_norm(fc)
        elif how == "old_spectral_norm":
            fc = nn.utils.spectral_norm(fc)
        else:
            parametrize.register_parametrization(fc, "weight", Symmetric())
        self.fc = fc

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc(h)


def _custom_ops() -> dict[str, Callable[[Any, torch.Tensor], torch.Tensor]]:
    """Forward code a user writes by hand, each op keeping the shape [b, t, d]."""
    return {
        "where": lambda m, h: torch.where(h > 0, h, m.alpha * h),
        "sort": lambda m, h: h.sort(-1).values * m.scale,
        "gather_argsort": lambda m, h: h.gather(-1, h.detach().argsort(-1, descending=True)),
        "perm_index": lambda m, h: h[:, :, m.perm] + h,
        "index_select": lambda m, h: h.index_select(-1, m.perm) * m.alpha,
        "tensor_index_rows": lambda m, h: h[:, m.perm % h.shape[1]],
        "einsum": lambda m, h: torch.einsum("btd,de->bte", h, m.w),
        "centre": lambda m, h: h - h.sum(-1, keepdim=True) / h.shape[-1],
        "cumsum": lambda m, h: h.cumsum(1) * m.scale,
        "normalize": lambda m, h: F.normalize(h, dim=-1) + h,
        "masked_fill": lambda m, h: h.masked_fill(h.abs() < 0.1, 0.0),
        "softmax_gate": lambda m, h: h * F.softmax(h, -1),
        "logsumexp": lambda m, h: h - torch.logsumexp(h, 1, keepdim=True),
        "max_broadcast": lambda m, h: h - h.max(-1, keepdim=True).values,
        "roll_flip": lambda m, h: h.roll(1, 1) + h.flip(-1),
        "scatter_add": lambda m, h: torch.zeros_like(h).scatter_add(
            -1, h.detach().argsort(-1), h * m.alpha
        ),
        "setitem": _setitem,
        "index_add": lambda m, h: h.index_add(-1, m.perm, h * m.scale),
        "clamp_tensor": lambda m, h: torch.clamp(h, min=-m.alpha.abs(), max=m.alpha.abs()),
        "bmm_gram": lambda m, h: torch.bmm(torch.softmax(h @ h.transpose(1, 2), -1), h),
        "layer_norm_fn": lambda m, h: F.layer_norm(h, (h.shape[-1],), m.alpha, m.w[0]),
        "pad_slice": lambda m, h: F.pad(h, (1, 1), mode="reflect")[..., 2:] * m.scale,
        "gelu_tanh": lambda m, h: F.gelu(h, approximate="tanh"),
        "diff": lambda m, h: torch.diff(h, dim=1, prepend=h[:, :1]),
        "interpolate": lambda m, h: F.interpolate(
            h.transpose(1, 2), scale_factor=2.0, mode="linear"
        ).transpose(1, 2)[:, ::2],
        "cdist": lambda m, h: torch.cdist(h, h).mean(-1, keepdim=True) + h,
        "inplace_chain": _inplace_chain,
        "topk": lambda m, h: h - h.topk(2, -1).values.sum(-1, keepdim=True),
        "std": lambda m, h: h / (h.std(1, keepdim=True) + 1),
        "chunk_cat": lambda m, h: torch.cat(h.flip(-1).chunk(2, -1)[::-1], -1),
        "nan_to_num": lambda m, h: torch.nan_to_num(torch.log(h.abs()), neginf=0.0),
    }


def _setitem(m: Any, h: torch.Tensor) -> torch.Tensor:
    out = h.clone()
    out[:, :, m.perm[:1]] = h[:, :, m.perm[-1:]] * m.scale
    return out


def _inplace_chain(m: Any, h: torch.Tensor) -> torch.Tensor:
    out = h * m.alpha
    out.mul_(2).add_(1).relu_()
    return out


CUSTOM = _custom_ops()
#: Forward code vmap cannot batch: the ensemble must refuse it, pointing to backend='loop'.
UNBATCHABLE_OPS: dict[str, Callable[[Any, torch.Tensor], torch.Tensor]] = {
    "branch": lambda m, h: h if h.sum() > 0 else -h,
    "item": lambda m, h: h * float(h.detach().abs().max().item()),
    "bool_mask": lambda m, h: h - h[h > 0].sum(),
    "nonzero": lambda m, h: h + h.nonzero().shape[0],
}


class Custom(nn.Module):
    def __init__(self, d: int, ops: list[str], scale: float, perm: list[int]) -> None:
        super().__init__()
        self.ops, self.scale = ops, scale  # a plain float attribute
        self.alpha = nn.Parameter(torch.rand(d) + 0.5)
        self.w = nn.Parameter(torch.randn(d, d) / d)
        self.register_buffer("perm", torch.tensor(perm))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for op in self.ops:
            h = (CUSTOM.get(op) or UNBATCHABLE_OPS[op])(self, h)
        return h


ACTIVATIONS: dict[str, Callable[[int], nn.Module]] = {
    "relu_inplace": lambda d: nn.ReLU(inplace=True),
    "leaky_inplace": lambda d: nn.LeakyReLU(0.1, inplace=True),
    "elu": lambda d: nn.ELU(),
    "selu_inplace": lambda d: nn.SELU(inplace=True),
    "silu_inplace": lambda d: nn.SiLU(inplace=True),
    "hardtanh_inplace": lambda d: nn.Hardtanh(-0.5, 0.5, inplace=True),
    "gelu": lambda d: nn.GELU(),
    "tanh": lambda d: nn.Tanh(),
    "softplus": lambda d: nn.Softplus(beta=2.0),
    "mish": lambda d: nn.Mish(),
    "hardswish": lambda d: nn.Hardswish(),
    "celu": lambda d: nn.CELU(0.5),
    "threshold_inplace": lambda d: nn.Threshold(0.1, -1.0, inplace=True),
    "prelu": lambda d: nn.PReLU(),
    "prelu_channels": lambda d: nn.PReLU(d, init=0.1),
    "softmax": lambda d: nn.Softmax(-1),
    "logsoftmax": lambda d: nn.LogSoftmax(-1),
    "glu": lambda d: nn.GLU(),
    "rrelu_eval": lambda d: nn.RReLU(),  # random in training: a random block
}


# -- drawing a program -------------------------------------------------------------------------

Draw = Callable[[random.Random, int, int], tuple[type[nn.Module], dict[str, Any]]]


def _divisors(k: int) -> list[int]:
    return [g for g in range(1, k + 1) if k % g == 0]


def _draw_linear(r: random.Random, t: int, d: int):
    return Lin, dict(d=d, out=r.choice([3, 4, 6]), bias=r.random() < 0.7)


def _draw_bilinear(r: random.Random, t: int, d: int):
    return Bil, dict(d=d, out=r.choice([2, 4]), bias=r.random() < 0.7)


def _draw_conv1(r: random.Random, t: int, d: int):
    transpose = r.random() < 0.3
    out = r.choice([2, 4, 6])
    groups = r.choice([g for g in _divisors(d) if out % g == 0])
    kw: dict[str, Any] = dict(
        transpose=transpose,
        out_channels=out,
        kernel_size=r.choice([1, 2, 3]),
        stride=r.choice([1, 1, 2]),
        dilation=r.choice([1, 1, 2]),
        groups=groups,
        bias=r.random() < 0.6,
    )
    if transpose:
        kw["padding"] = r.choice([0, 1])
        kw["output_padding"] = r.choice([0, 1]) if kw["stride"] > 1 else 0
    else:
        kw["padding"] = r.choice([0, 1, 2, "same"]) if kw["stride"] == 1 else r.choice([0, 1])
        kw["padding_mode"] = r.choice(["zeros", "reflect", "replicate", "circular"])
    return Conv1, dict(d=d, **kw)


def _draw_conv2(r: random.Random, t: int, d: int):
    c = r.choice(_divisors(d))
    out = r.choice([2, 4])
    groups = r.choice([g for g in _divisors(c) if out % g == 0])
    return Conv2, dict(
        d=d,
        c=c,
        out_channels=out,
        kernel_size=(r.choice([1, 2, 3]), r.choice([1, 2])),
        stride=r.choice([1, (1, 2), 2]),
        padding=r.choice([0, 1, (1, 0)]),
        dilation=r.choice([1, (2, 1)]),
        groups=groups,
        padding_mode=r.choice(["zeros", "reflect", "replicate", "circular"]),
        bias=r.random() < 0.5,
    )


def _draw_batchnorm(r: random.Random, t: int, d: int):
    bn = nn.BatchNorm1d(
        d,
        momentum=r.choice([0.1, None, 0.5]),
        affine=r.random() < 0.7,
        track_running_stats=r.random() < 0.8,
        eps=r.choice([1e-5, 1e-3]),
    )
    return ChannelNorm, dict(norm=bn, flat=r.random() < 0.4)


def _draw_norm(r: random.Random, t: int, d: int):
    kind = r.choice(["layer", "group", "instance", "rms"])
    if kind == "layer":
        return Last, dict(
            layer=nn.LayerNorm(d, elementwise_affine=r.random() < 0.7, bias=r.random() < 0.7)
        )
    if kind == "rms":
        return Last, dict(
            layer=nn.RMSNorm(d, eps=r.choice([None, 1e-4]), elementwise_affine=r.random() < 0.7)
        )
    if kind == "group":
        return ChannelNorm, dict(
            norm=nn.GroupNorm(r.choice(_divisors(d)), d, affine=r.random() < 0.7)
        )
    norm = nn.InstanceNorm1d(d, affine=r.random() < 0.5, track_running_stats=r.random() < 0.5)
    return ChannelNorm, dict(norm=norm)


def _draw_dropout(r: random.Random, t: int, d: int):
    p = r.choice([0.2, 0.5])
    kind = r.choice(["dropout", "dropout_inplace", "alpha", "feature_alpha", "dropout1d"])
    if kind == "dropout1d":
        return ChannelNorm, dict(norm=nn.Dropout1d(p))
    layer = {
        "dropout": lambda: nn.Dropout(p),
        "dropout_inplace": lambda: nn.Dropout(p, inplace=True),
        "alpha": lambda: nn.AlphaDropout(p),
        "feature_alpha": lambda: nn.FeatureAlphaDropout(p),
    }[kind]()
    return Last, dict(layer=layer)


def _draw_embedding(r: random.Random, t: int, d: int):
    bag = r.choice([None, None, "sum", "mean", "max"])
    kw: dict[str, Any] = dict(
        d=d,
        vocab=r.choice([4, 6]),
        dim=r.choice([2, 3]),
        bag=bag,
        weighted=bag == "sum" and r.random() < 0.5,
        padding_idx=r.choice([None, 0, 1]),
        max_norm=r.choice([None, None, 0.5, 1.0]),
    )
    if bag is None:
        kw["scale_grad_by_freq"] = r.random() < 0.3
    return Embed, kw


def _draw_attention(r: random.Random, t: int, d: int):
    return Attn, dict(
        d=d,
        heads=r.choice(_divisors(d)),
        batch_first=r.random() < 0.5,
        mask=r.choice(["none", "none", "causal", "bool", "padding"]),
        weights=r.choice(["none", "mean", "heads"]),
        bias=r.random() < 0.7,
        add_bias_kv=r.random() < 0.3,
        add_zero_attn=r.random() < 0.3,
        dropout=r.choice([0.0, 0.0, 0.3]),
    )


def _draw_encoder(r: random.Random, t: int, d: int):
    return Encoder, dict(
        d=d,
        nhead=r.choice(_divisors(d)),
        dim_feedforward=r.choice([4, 8]),
        dropout=r.choice([0.0, 0.0, 0.2]),
        activation=r.choice(["relu", "gelu", "silu"]),
        norm_first=r.random() < 0.5,
        bias=r.random() < 0.7,
        mask=r.choice(["none", "causal", "padding"]),
        stack=r.choice([0, 0, 2]),
    )


def _draw_recurrent(r: random.Random, t: int, d: int):
    kind = r.choice(["GRU", "LSTM", "RNN"])
    layers = r.choice([1, 2])
    kw: dict[str, Any] = dict(
        d=d,
        kind=kind,
        hidden_size=r.choice([3, 4]),
        num_layers=layers,
        bidirectional=r.random() < 0.4,
        batch_first=r.random() < 0.5,
        bias=r.random() < 0.8,
        dropout=r.choice([0.0, 0.3]) if layers > 1 else 0.0,
        h0=r.random() < 0.4,
        last=r.random() < 0.4,
    )
    if kind == "LSTM":
        kw["proj_size"] = r.choice([0, 0, 2])
    if kind == "RNN":
        kw["nonlinearity"] = r.choice(["tanh", "relu"])
    return Recurrent, kw


def _draw_cell(r: random.Random, t: int, d: int):
    kind = r.choice(["GRUCell", "LSTMCell", "RNNCell"])
    kw: dict[str, Any] = dict(d=d, kind=kind, hidden=r.choice([3, 4]), bias=r.random() < 0.8)
    if kind == "RNNCell":
        kw["nonlinearity"] = r.choice(["tanh", "relu"])
    return Cell, kw


def _draw_activation(r: random.Random, t: int, d: int):
    return Last, dict(layer=ACTIVATIONS[r.choice(sorted(ACTIVATIONS))](d))


def _draw_residual(r: random.Random, t: int, d: int):
    return Residual, dict(d=d, inner=r.choice(["plain", "norm"]), inplace=r.random() < 0.5)


def _draw_tied(r: random.Random, t: int, d: int):
    return Tied, dict(d=d, buffer=r.random() < 0.5)


def _draw_stateful(r: random.Random, t: int, d: int):
    return Stateful, dict(d=d, how=r.choice(["inplace", "reassign"]), momentum=r.choice([0.5, 0.9]))


def _draw_param(r: random.Random, t: int, d: int):
    hows = ["weight_norm", "old_weight_norm", "orthogonal:matrix_exp", "orthogonal:cayley"]
    hows += ["orthogonal:householder", "spectral_norm", "old_spectral_norm", "symmetric"]
    return Param, dict(d=d, how=r.choice(hows))


def _draw_custom(r: random.Random, t: int, d: int):
    ops = r.sample(sorted(CUSTOM), r.choice([1, 2, 3]))
    if r.random() < 0.08:
        ops.insert(r.randrange(len(ops) + 1), r.choice(sorted(UNBATCHABLE_OPS)))
    perm = list(range(d))
    r.shuffle(perm)
    return Custom, dict(d=d, ops=ops, scale=r.choice([0.5, 2.0, -1.0]), perm=perm)


DRAWS: dict[str, Draw] = {
    "linear": _draw_linear,
    "bilinear": _draw_bilinear,
    "conv1": _draw_conv1,
    "conv2": _draw_conv2,
    "batchnorm": _draw_batchnorm,
    "norm": _draw_norm,
    "dropout": _draw_dropout,
    "embedding": _draw_embedding,
    "attention": _draw_attention,
    "encoder": _draw_encoder,
    "recurrent": _draw_recurrent,
    "cell": _draw_cell,
    "activation": _draw_activation,
    "residual": _draw_residual,
    "tied": _draw_tied,
    "stateful": _draw_stateful,
    "param": _draw_param,
    "custom": _draw_custom,
}

Spec = list[tuple[type[nn.Module], dict[str, Any]]]


class Fuzz(nn.Module):
    """The drawn blocks, a mean over time and a linear head."""

    def __init__(self, spec: Spec, width: int, dict_out: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(cls(**copy.deepcopy(kw)) for cls, kw in spec)
        self.head = nn.Linear(width, 2)
        self.dict_out = dict_out

    def forward(self, x: torch.Tensor) -> Any:
        h = x
        for block in self.blocks:
            h = block(h)
        y = self.head(h.mean(1))
        return {"y": y, "features": h} if self.dict_out else y


def _random_kinds(spec: Spec) -> bool:
    """Whether the module draws random numbers in training mode."""
    probe = Fuzz(spec, 1, False)
    for m in probe.modules():
        dropout = (nn.Dropout, nn.AlphaDropout, nn.FeatureAlphaDropout, nn.Dropout1d)
        if isinstance(m, dropout) and m.p > 0:
            return True
        if isinstance(m, (nn.MultiheadAttention, nn.RNNBase)) and m.dropout > 0:
            return True
        if isinstance(m, nn.RReLU):
            return True
    return False


def program(seed: int) -> dict[str, Any]:
    """A module spec and the run's settings, drawn from ``seed``; every block runs alone."""
    r = random.Random(seed)
    t, width = r.choice([3, 4, 5]), r.choice([2, 4, 6])
    t_in, d_in = t, width
    spec: Spec = []
    for _ in range(r.choice([1, 2, 3, 4])):
        for _ in range(50):
            kind = r.choice(sorted(DRAWS))
            cls, kw = DRAWS[kind](r, t, width)
            try:
                with torch.random.fork_rng():
                    torch.manual_seed(0)
                    block = cls(**copy.deepcopy(kw)).double()
                    out = block(torch.randn(ROWS, t, width, dtype=torch.float64))
                    block.eval()
                    block(torch.randn(ROWS, t, width, dtype=torch.float64))
            except Exception:
                continue  # a draw plain torch refuses (a kernel wider than the input, ...)
            if out.dim() != 3 or out.shape[1] < 1 or out.shape[-1] > 24 or out.shape[1] > 12:
                continue
            if not torch.isfinite(out).all():
                continue
            spec.append((cls, kw))
            t, width = out.shape[1], out.shape[-1]
            break
    return dict(
        spec=spec,
        width=width,
        t=t_in,
        d=d_in,
        n=r.choice([2, 3]),
        how=r.choice(["seeds", "seeds", "from_modules"]),
        optim=r.choice(["adam", "sgd"]),
        dict_out=r.random() < 0.2,
        random=_random_kinds(spec),
        seed=seed,
    )


# -- running one program -----------------------------------------------------------------------


class Refused(Exception):
    """The ensemble refused the module, as it may: the message is in ``args``."""


def _snapshot(ens: vmapens.Ensemble) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in ens.state_dict(keep_vars=True).items()}


def _unchanged(ens: vmapens.Ensemble, before: dict[str, torch.Tensor], where: str) -> None:
    after = ens.state_dict(keep_vars=True)
    assert list(after) == list(before), where
    for k, v in before.items():
        assert torch.equal(after[k].detach(), v) or (
            v.is_floating_point() and torch.equal(after[k].isnan(), v.isnan())
        ), f"{where}: `{k}` changed by a refused call"


def _refused(err: Exception, api: str, before: dict, ens: vmapens.Ensemble | None) -> Refused:
    """Check a refusal is clear (names the API and a way out) and changed nothing."""
    msg = str(err)
    assert isinstance(err, (RuntimeError, ValueError, TypeError, NotImplementedError)), repr(err)
    assert msg.startswith(f"{api}:") or msg.startswith(f"{api} "), f"unclear refusal: {msg!r}"
    if ens is not None:
        _unchanged(ens, before, msg)
    return Refused(msg)


def _loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out["y"] if isinstance(out, dict) else out, y)


def _close(got: Any, want: Any, where: str) -> None:
    if isinstance(want, dict):
        for k in want:
            _close(got[k], want[k], f"{where}[{k}]")
        return
    torch.testing.assert_close(got, want, **TOL, equal_nan=True, msg=lambda m: f"{where}: {m}")


def _compare_state(ens: vmapens.Ensemble, models: list[nn.Module], where: str) -> None:
    for i, m in enumerate(models):
        got, want = ens[i].state_dict(), m.state_dict()
        assert list(got) == list(want), f"{where}: member {i} keys"
        for k in want:
            _close(got[k], want[k], f"{where}: member {i} `{k}`")


def _optimizers(kind: str, ens: vmapens.Ensemble, models: list[nn.Module]):
    if kind == "adam":
        # eps 1e-5: a parameter whose true gradient is 0 (a bias before a norm) steps by its
        # round-off over eps, not by lr (docs/semantics.md, "What differs").
        return (
            vmapens.StackedAdam(ens, lr=1e-2, eps=1e-5, weight_decay=1e-3),
            [
                torch.optim.Adam(m.parameters(), lr=1e-2, eps=1e-5, weight_decay=1e-3)
                for m in models
            ],
        )
    return (
        vmapens.StackedSGD(ens, lr=0.05, momentum=0.9),
        [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models],
    )


def run(prog: dict[str, Any], backend: str = "vmap") -> str:
    """Build, compare the forwards, train two steps; return "exact" or raise ``Refused``.

    A program with dropout in training mode whose masks differ from the members' own is run
    again with every ``nn.Dropout`` block's input made contiguous: vmap may lay out a tensor
    otherwise than the member alone (docs/semantics.md, "What vmap cannot batch"), and then
    the mask is another one, equal in distribution only. Everything else must be exact.
    """
    try:
        return _run(prog, backend)
    except AssertionError:
        if not prog["random"]:
            raise
        CONTIGUOUS_DROPOUT[0] = True
        try:
            _run(prog, backend)
        finally:
            CONTIGUOUS_DROPOUT[0] = False
        return "exact (dropout inputs contiguous)"


def _built(factory: Callable[[], nn.Module], n: int) -> list[nn.Module]:
    """Member k built after ``torch.manual_seed(k)``, as ``seeds=range(n)`` builds it."""
    out = []
    for k in range(n):
        torch.manual_seed(k)
        out.append(factory())
    return out


def _run(prog: dict[str, Any], backend: str) -> str:
    spec, n = prog["spec"], prog["n"]

    def factory() -> nn.Module:
        return Fuzz(spec, prog["width"], prog["dict_out"])

    models = _built(factory, n)
    randomness = "same" if prog["random"] else "different"
    options = dict(randomness=randomness, backend=backend)
    try:
        if prog["how"] == "seeds":
            ens = vmapens.Ensemble(factory, n=n, seeds=range(n), **options)
        else:
            ens = vmapens.Ensemble.from_modules(_built(factory, n), **options)
    except Exception as err:
        raise _refused(
            err, "Ensemble" if prog["how"] == "seeds" else "Ensemble.from_modules", {}, None
        ) from err
    _compare_state(ens, models, "after building")

    g = torch.Generator().manual_seed(prog["seed"])
    xs = [torch.randn(ROWS, prog["t"], prog["d"], generator=g) for _ in range(4)]
    ys = [torch.randn(ROWS, 2, generator=g) for _ in range(4)]

    for mode in ("train", "eval"):
        ens.train(mode == "train")
        for m in models:
            m.train(mode == "train")
        before = _snapshot(ens)
        torch.manual_seed(100)
        x = xs[0].clone()  # a forward may edit its input in place (an in-place dropout)
        try:
            got = ens(x)
        except Exception as err:
            raise _refused(err, "Ensemble", before, ens) from err
        for i, m in enumerate(models):
            torch.manual_seed(100)
            alone = xs[0].clone()
            want = m(alone)
            _close(_member(got, i), want, f"{mode} forward, member {i}")
            if i == 0:  # one vmapped run edits a shared input once, as one member alone
                _close(x, alone, f"{mode} forward, the input after it")
        _compare_state(ens, models, f"after the {mode} forward")
    ens.train()
    for m in models:
        m.train()

    opt, opts = _optimizers(prog["optim"], ens, models)
    step = vmapens.make_step(ens, _loss, opt)
    for k in range(2):
        want = []
        try:  # alone first: a forward whose backward fails alone must fail in the ensemble
            for m, o in zip(models, opts):
                torch.manual_seed(200 + k)
                o.zero_grad()
                loss = _loss(m(xs[k + 1].clone()), ys[k + 1])
                loss.backward()
                o.step()
                want.append(loss.detach())
        except RuntimeError:
            with pytest.raises(RuntimeError, match=r"^step: "):
                step(xs[k + 1].clone(), ys[k + 1])
            return "fails alone too"
        before = _snapshot(ens)
        torch.manual_seed(200 + k)
        try:
            losses = step(xs[k + 1].clone(), ys[k + 1])
        except Exception as err:
            raise _refused(err, "step", before, ens) from err
        for i in range(n):
            _close(losses[i].detach(), want[i], f"step {k} loss, member {i}")
        _compare_state(ens, models, f"after step {k}")
    return "exact"


def _member(out: Any, i: int) -> Any:
    return {k: v[i] for k, v in out.items()} if isinstance(out, dict) else out[i]


#: Seeds run in the suite (~15 s); ``python tests/test_fuzz_modules.py 0 1000`` runs more.
SEEDS = range(10)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_module_trains_as_each_member_alone_or_is_refused(seed: int) -> None:
    prog = program(seed)
    try:
        run(prog)
    except Refused as err:
        # Refused clearly and unchanged (checked in ``run``); the way out it names must work.
        if "backend='loop'" in str(err):
            try:
                run(prog, backend="loop")
            except Refused as loop_err:
                assert "backend='loop'" in str(loop_err) or "in turns" in str(loop_err)


# -- what the programs found, one test each ---------------------------------------------------


class _IndexedDropout(nn.Module):
    """Columns picked by an index buffer (stacked per member), then ``nn.Dropout``: vmap lays
    ``h[:, self.index]`` out time-first, the member alone batch-first."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(4, 4), nn.Linear(4, 2)
        self.register_buffer("index", torch.tensor([3, 1, 0, 2]))
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.fc(x)[:, self.index]).mean(1))


class _IndexedDropoutBranch(_IndexedDropout):
    """The same, and a branch on ``requires_grad`` (False under vmap): the probe must still
    refuse it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 2.0 if self.fc.weight.requires_grad else 1.0
        return super().forward(x) * scale


def test_the_probe_does_not_refuse_dropout_on_a_tensor_vmap_lays_out_otherwise():
    """The first step refused it ("the output differs by 2.8"): under vmap the runner's
    Dropout drew its mask in the batched tensor's memory order, which vmap had chosen, and
    the member alone in its own. Masks are equal in distribution either way; the probe now
    draws both runs' masks in logical order and compares the rest."""
    x = torch.randn(ROWS, 4, 4)
    y = torch.randn(ROWS, 2)
    ens = vmapens.Ensemble(_IndexedDropout, n=2, seeds=range(2))
    before = _snapshot(ens)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1))
    step(x, y)
    assert any(not torch.equal(v, before[k]) for k, v in _snapshot(ens).items())
    # Without dropout's randomness (eval mode) each member trains exactly as alone.
    ens, models = vmapens.Ensemble(_IndexedDropout, n=2, seeds=range(2)), _built(_IndexedDropout, 2)
    ens.eval()
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1))
    step(x, y)
    for m in models:
        m.eval()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        F.mse_loss(m(x), y).backward()
        opt.step()
    _compare_state(ens, models, "eval-mode step")

    ens = vmapens.Ensemble(_IndexedDropoutBranch, n=2, seeds=range(2))
    before = _snapshot(ens)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1))
    with pytest.raises(RuntimeError, match=r"^step: member 0 of _IndexedDropoutBranch computes"):
        step(x, y)
    _unchanged(ens, before, "a refused step")


class _NormOfNormed(nn.Module):
    """BatchNorm over BatchNorm's output: the second one's running mean is round-off of 0."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.bn1, self.bn2 = nn.BatchNorm1d(4), nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.bn2(self.bn1(self.fc(x)))))


def test_the_probe_compares_a_buffer_of_round_off_against_its_layer():
    """The first step refused it ("`bn2.running_mean` after the forward differs by 3.7e-17
    (tolerance 1.5e-08 x scale 5.7e-17)"): a buffer was held to its own size, and a running
    mean of normalised inputs is pure round-off, which a batched kernel changes."""
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 3, generator=g), torch.randn(8, 2, generator=g)) for _ in range(3)]
    models = _built(_NormOfNormed, 3)
    ens = vmapens.Ensemble.from_modules(_built(_NormOfNormed, 3))
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-2))
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in models]
    for x, y in batches:
        step(x, y)
        for m, o in zip(models, opts):
            o.zero_grad()
            F.mse_loss(m(x), y).backward()
            o.step()
    _compare_state(ens, models, "after 3 steps")


class _Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 3, padding_idx=0)
        self.head = nn.Linear(3, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(tokens).mean(1))


def test_embedding_padding_row_gets_no_gradient_with_per_member_tokens():
    """Each member trained on its own tokens (``in_dims=0``): vmap's embedding rule moved
    every member's padding row but member 0's (Adam moved it by lr), silently; the probe runs
    member 0 only."""
    g = torch.Generator().manual_seed(5)
    n = 3
    batches = [
        (torch.randint(0, 7, (n, ROWS, 4), generator=g), torch.randn(n, ROWS, 2, generator=g))
        for _ in range(2)
    ]
    models = _built(_Tokens, n)
    ens = vmapens.Ensemble(_Tokens, n=n, seeds=range(n))
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-2), in_dims=0)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in models]
    for x, y in batches:
        step(x, y)
        for i, (m, o) in enumerate(zip(models, opts)):
            o.zero_grad()
            F.mse_loss(m(x[i]), y[i]).backward()
            o.step()
    _compare_state(ens, models, "after 2 steps")
    assert all(not m.emb.weight[0].detach().any() for m in models)  # the truth


def describe(prog: dict[str, Any]) -> str:
    blocks = ", ".join(f"{cls.__name__}({_short(kw)})" for cls, kw in prog["spec"])
    extra = {k: prog[k] for k in ("n", "how", "optim", "dict_out", "random", "t", "d")}
    return f"{blocks} | {extra}"


def _short(kw: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kw.items() if k != "d")


def hunt(seeds: range, verbose: bool) -> None:
    """Run programs outside pytest; print each outcome, and the failures in full."""
    import traceback
    import warnings

    warnings.simplefilter("ignore")
    torch.set_default_dtype(torch.float64)
    counts: dict[str, int] = {}
    for seed in seeds:
        prog = program(seed)
        try:
            outcome = run(prog)
        except Refused as err:
            outcome = "refused"
            try:
                run(prog, backend="loop")
                outcome = "refused, loop exact"
            except Refused as err2:
                outcome = "refused, loop refused"
                if verbose:
                    print("   loop:", str(err2)[:300])
            except Exception:
                outcome = "refused, LOOP FAILS"
                traceback.print_exc()
            if verbose or "FAILS" in outcome:
                print("   ", str(err)[:400])
        except Exception:
            outcome = "FAIL"
            traceback.print_exc()
        counts[outcome] = counts.get(outcome, 0) + 1
        print(seed, outcome, describe(prog), flush=True)
    print(counts)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "-v"]
    hunt(range(int(args[0]), int(args[1])), "-v" in sys.argv)
