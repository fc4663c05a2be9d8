"""The maths of one recurrent step, written in ops that ``vmap`` batches and dynamo traces.

``vmapens._recurrent``'s layers and cells run these; they follow torch's gate order and bias
placement (``nn.GRU``, ``nn.LSTM``, ``nn.RNN``), and refuse the input dtypes those refuse.
This file imports only torch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "check_dtype",
    "gru_step",
    "lstm_parts",
    "lstm_step",
    "lstm_weights",
    "project",
    "rnn_step",
    "traced_lstm_step",
]


def check_dtype(api: str, input: Tensor, weight: torch.dtype) -> None:
    """Refuse ``input`` of another dtype than the weights, as torch's layers do.

    Not under autocast (ours is a ``TorchFunctionMode``, torch's its own flag), where torch
    lets the layer cast, nor while dynamo traces: the eager first step has checked it.
    """
    if input.dtype == weight or torch.compiler.is_compiling():
        return
    if torch._C._is_any_autocast_enabled() or torch._C._is_torch_function_mode_enabled():
        return
    raise ValueError(
        f"{api}: `input` dtype ({input.dtype}) must match the weights' ({weight}): convert "
        f"the input, input.to({weight}), or the model, as torch's own layer asks"
    )


def gru_step(gi_rz: Tensor, gi_n: Tensor, h: Tensor, w_hh_t: Tensor, b_hh: Tensor | None) -> Tensor:
    """One GRU step from the input projections (gates r, z, n in torch's row order)."""
    # mm then add, not addmm: under vmap addmm costs an mm plus scaled adds (~20% slower).
    gh = torch.mm(h, w_hh_t) if b_hh is None else torch.mm(h, w_hh_t) + b_hh
    # split, not two slices: its backward is one cat instead of two zero-filled copies.
    gh_rz, gh_n = gh.split([gi_rz.size(-1), gi_n.size(-1)], -1)
    r, z = torch.sigmoid(gi_rz + gh_rz).chunk(2, -1)
    # b_hn sits inside r * (...), which is why GRU keeps b_hh out of the input projection.
    n = torch.tanh(torch.addcmul(gi_n, r, gh_n))
    return torch.lerp(n, h, z)  # (1 - z) * n + z * h in one op


def lstm_step(
    gi: Tensor, h: Tensor, c: Tensor, w_hh_t: Tensor, w_hr_t: Tensor | None
) -> tuple[Tensor, Tensor]:
    """One LSTM step from :func:`lstm_weights`' doubled-g projections (gates i, f, g, o).

    ``gi`` holds both biases. One sigmoid over all four gates replaces three sigmoids and a
    tanh: the g gate's pre-activation comes doubled, and tanh(x) = 2 sigmoid(2x) - 1. On CPU
    tanh costs ~5x a sigmoid, and the backward has one sigmoid node instead of four.
    """
    # chunk, not slices: its backward is one cat instead of zero-filled copies.
    i, f, g, o = torch.sigmoid(gi + torch.mm(h, w_hh_t)).chunk(4, -1)
    # f * c + i * (2 g - 1), with the -1 folded into the first term.
    c = torch.addcmul(f * c - i, i, g, value=2)
    # o * tanh(c) = o * (2 sigmoid(2c) - 1)
    h = torch.addcmul(-o, o, torch.sigmoid(2 * c), value=2)
    return (h if w_hr_t is None else torch.mm(h, w_hr_t)), c


def traced_lstm_step(
    gi: Tensor, h: Tensor, c: Tensor, w_hh_t: Tensor, w_hr_t: Tensor | None
) -> tuple[Tensor, Tensor]:
    """:func:`lstm_step` for a compiled step: torch's own weights, each gate's chunk on its own.

    The same maths: tanh as ``2 sigmoid(2x) - 1``, with the sum doubled here instead of the g
    rows of the weights, which is exact. Inductor fuses every gate into one kernel either way,
    but with the g rows doubled in the weights it doubled the bias in each step's kernel
    through a 64-bit index mask per element; chunks have fixed offsets. The compiled benchmark
    step took 0.87x the time (docs/performance.md, "The compiled LSTM without doubled rows").
    """
    i, f, g, o = (gi + torch.mm(h, w_hh_t)).chunk(4, -1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * (2 * torch.sigmoid(2 * g) - 1)
    h = torch.sigmoid(o) * (2 * torch.sigmoid(2 * c) - 1)
    return (h if w_hr_t is None else torch.mm(h, w_hr_t)), c


def lstm_weights(
    w_ih: Tensor, w_hh: Tensor, b_ih: Tensor | None, b_hh: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(w_ih, w_hh^T, b_ih + b_hh)`` with the g gate's rows doubled (see :func:`lstm_step`).

    Doubling is exact in floating point, in the forward and in the gradients through it.
    """
    hidden = w_hh.size(0) // 4
    scale = torch.ones(4 * hidden, 1, dtype=w_hh.dtype, device=w_hh.device)
    scale[2 * hidden : 3 * hidden] = 2
    bias = None if b_ih is None or b_hh is None else (b_ih + b_hh) * scale.squeeze(1)
    return w_ih * scale, (w_hh * scale).t(), bias


def rnn_step(gi: Tensor, h: Tensor, w_hh_t: Tensor, relu: bool) -> Tensor:
    """One Elman step; ``gi`` already holds both biases."""
    pre = gi + torch.mm(h, w_hh_t)
    return torch.relu(pre) if relu else torch.tanh(pre)


def project(x: Tensor, w_ih: Tensor, b_ih: Tensor | None, b_hh: Tensor | None, gru: bool) -> Tensor:
    """The input projection; folds ``b_hh`` in where the maths allows (all but GRU)."""
    if b_ih is not None and b_hh is not None and not gru:
        b_ih = b_ih + b_hh
    return F.linear(x, w_ih, b_ih)


def lstm_parts(
    w_ih: Tensor, w_hh: Tensor, b_ih: Tensor | None, b_hh: Tensor | None, traced: bool
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Callable[..., tuple[Tensor, Tensor]]]:
    """``(w_ih, w_hh^T, b_ih, b_hh, step)`` for an LSTM layer's or cell's steps: eagerly
    :func:`lstm_weights`' doubled g rows (both biases in ``b_ih``) and :func:`lstm_step`;
    traced (a compiled step), torch's own weights and :func:`traced_lstm_step`."""
    if traced:
        return w_ih, w_hh.t(), b_ih, b_hh, traced_lstm_step
    w_ih, w_hh_t, bias = lstm_weights(w_ih, w_hh, b_ih, b_hh)
    return w_ih, w_hh_t, bias, None, lstm_step
