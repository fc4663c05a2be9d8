"""Recurrent layers that ``torch.func.vmap`` can batch and ``torch.compile`` can trace.

``vmap`` has no batching rule for ``aten::gru``/``lstm``/``rnn_tanh`` (pytorch#105982) and
dynamo refuses ``nn.RNN``/``nn.GRU``/``nn.LSTM`` in ``fullgraph`` mode, so an ensemble of
members holding them cannot be batched as they are. ``vmapens._batchable.batchable``
re-classes those layers (and the three cells) to subclasses whose ``forward`` writes the same
maths in ops that ``vmap`` batches and dynamo traces: one matmul projects every time step's
input at once, and a Python loop over time steps runs only the recurrent part. An eager LSTM
layer (no ``proj_size``) runs its whole recurrence as one autograd node instead
(``_lstm_fused.py``), where that node is known to give the loop's results. Parameter names,
shapes and ``state_dict`` keys stay the original ones, so
``functional_call(batchable(m), m.state_dict(), ...)`` works.

This file imports only torch, its two helpers and ``_precision`` (to say when autocast makes
members inexact): it sits near the bottom of the package.
"""

from __future__ import annotations

import sys
import warnings
from types import FrameType
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from ._lstm_fused import fused_direction
from ._precision import member_autocast
from ._recurrent_steps import (
    check_dtype,
    gru_step,
    lstm_parts,
    project,
    rnn_step,
)

__all__ = [
    "BatchableGRU",
    "BatchableGRUCell",
    "BatchableLSTM",
    "BatchableLSTMCell",
    "BatchableRNN",
    "BatchableRNNCell",
]

_PACKED = (
    "Ensemble: PackedSequence inputs are not batched (torch.func.vmap cannot batch "
    "torch's packed recurrent kernels); pad the sequences (torch.nn.utils.rnn.pad_sequence) "
    "or build the ensemble with backend='loop'"
)


def _warn_if_autocast(layer: nn.Module, input: Tensor) -> None:
    """Warn, once per call site, that under autocast ``layer`` is not what the member runs alone.

    Alone under CPU autocast torch's recurrent kernels cast inside themselves (``nn.LSTM``
    runs oneDNN's bf16 layer and returns bfloat16); the twin's ops get autocast's policy one
    by one and round elsewhere: up to ~1% relative, beyond what docs/semantics.md promises.
    """
    dtype = member_autocast(input)
    if dtype is None:
        return
    name = "nn." + type(layer).__name__.removeprefix("Batchable")
    warnings.warn(
        f"Ensemble: {name} members under autocast ({dtype}) are not exact: the ensemble runs "
        f"a batchable twin of {name} that rounds elsewhere than torch's own {name} kernel "
        "(outputs and gradients up to ~1% relative off; alone nn.LSTM returns the low dtype, "
        "the twin float32). Build the ensemble with "
        "backend='loop' (members run alone: exact), or train without autocast/precision",
        UserWarning,
        stacklevel=_caller_level(),
    )


def _caller_level() -> int:
    """The ``stacklevel`` of whoever called the layer: past this file and ``nn.Module``'s
    call wrappers (one more frame when the module has hooks)."""
    skip = (__file__, nn.modules.module.__file__)
    level = 1  # counted from _warn_if_autocast, which passes the result on
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename in skip:
        level, frame = level + 1, frame.f_back
    return level


class _Recurrent(nn.RNNBase):
    """The shared ``forward`` of the three full-sequence layers, dispatched on ``self.mode``.

    The base is ``nn.RNNBase`` rather than ``nn.GRU`` & co. on purpose: dynamo refuses any
    instance of those three classes in ``fullgraph`` mode, subclasses included.
    """

    def forward(
        self, input: Tensor, hx: Tensor | tuple[Tensor, Tensor] | list[Tensor] | None = None
    ) -> tuple[Tensor, Tensor | tuple[Tensor, Tensor]]:
        api = type(self).__name__
        if isinstance(input, PackedSequence):
            raise TypeError(_PACKED)
        _warn_if_autocast(self, input)
        if input.dim() not in (2, 3):
            raise ValueError(
                f"{api}: `input` must be 2-D (unbatched) or 3-D (batched), got {input.dim()}-D"
            )
        if input.size(-1) != self.input_size:
            raise ValueError(
                f"{api}: `input` must have {self.input_size} features (last dim), "
                f"got {input.size(-1)}"
            )
        check_dtype(api, input, cast(Tensor, self.weight_ih_l0).dtype)
        lstm = self.mode == "LSTM"
        batched = input.dim() == 3
        batch_first = batched and self.batch_first
        if input.size(1 if batch_first else 0) == 0:  # torch's kernels refuse it too
            raise ValueError(f"{api}: `input` must have at least one time step, got 0")
        # Time first inside, as torch's kernels: a batch_first output is then a transposed
        # view with torch's strides, and a Dropout after the layer, which draws its mask in
        # memory order, draws the member's own mask (docs/semantics.md, "Randomness").
        x = input.transpose(0, 1) if batch_first else input if batched else input.unsqueeze(1)
        directions = 2 if self.bidirectional else 1
        h0, c0 = self._initial(hx, x.size(1), batched, directions, x)

        h_n: list[Tensor] = []
        c_n: list[Tensor] = []
        for layer in range(self.num_layers):
            if layer and self.dropout and self.training:
                # Between layers only, as torch does: never on the input or the last output.
                x = F.dropout(x, self.dropout, training=True)
            outs = []
            for direction in range(directions):
                k = layer * directions + direction
                out, h, c = self._direction(x, h0[k], c0[k] if lstm else None, layer, direction)
                outs.append(out)
                h_n.append(h)
                if c is not None:
                    c_n.append(c)
            x = outs[0] if directions == 1 else torch.cat(outs, -1)

        h_last = torch.stack(h_n)
        c_last = torch.stack(c_n) if lstm else h_last
        if batch_first:
            x = x.transpose(0, 1)
        if not batched:
            x, h_last, c_last = x.squeeze(1), h_last.squeeze(1), c_last.squeeze(1)
        return x, ((h_last, c_last) if lstm else h_last)

    def _initial(
        self,
        hx: Tensor | tuple[Tensor, Tensor] | list[Tensor] | None,
        batch: int,
        batched: bool,
        directions: int,
        x: Tensor,
    ) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
        """The per-layer-and-direction initial states ``(h0, c0)``, checked, batch dim kept."""
        api = type(self).__name__
        lstm = self.mode == "LSTM"
        rows = self.num_layers * directions
        out_size = self.proj_size if self.proj_size > 0 else self.hidden_size
        if hx is None:
            h = torch.zeros(rows, batch, out_size, dtype=x.dtype, device=x.device)
            c = torch.zeros(rows, batch, self.hidden_size, dtype=x.dtype, device=x.device)
            return h.unbind(0), (c.unbind(0) if lstm else ())
        if lstm and not (isinstance(hx, (tuple, list)) and len(hx) == 2):  # torch takes both
            raise TypeError(f"{api}: `hx` must be a tuple (h_0, c_0), got {type(hx).__name__}")
        if not lstm and not isinstance(hx, Tensor):
            raise TypeError(f"{api}: `hx` must be a Tensor, got {type(hx).__name__}")
        states = hx if lstm else (hx,)
        sizes = (out_size, self.hidden_size)
        checked = []
        for name, state, size in zip(("h_0", "c_0"), states, sizes):
            want = (rows, batch, size) if batched else (rows, size)
            if tuple(state.shape) != want:
                raise ValueError(
                    f"{api}: `hx` ({name}) must have shape {list(want)}, got {list(state.shape)}"
                )
            checked.append((state if batched else state.unsqueeze(1)).unbind(0))
        return checked[0], (checked[1] if lstm else ())

    def _direction(
        self,
        x: Tensor,
        h: Tensor,
        c: Tensor | None,
        layer: int,
        direction: int,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Run one layer in one direction on time-first ``x``: ``(output, last h, last c)``."""
        suffix = f"_l{layer}_reverse" if direction else f"_l{layer}"
        # getattr at call time: functional_call swaps these attributes, not _flat_weights.
        w_ih = getattr(self, "weight_ih" + suffix)
        w_hh = getattr(self, "weight_hh" + suffix)
        w_hh_t = w_hh.t()
        b_ih = getattr(self, "bias_ih" + suffix) if self.bias else None
        b_hh = getattr(self, "bias_hh" + suffix) if self.bias else None
        outs: list[Tensor] = []
        if self.mode == "GRU":
            # The r, z gates and the n gate projected apart, not one projection split: the
            # backward then stacks each part's per-step gradients for its own matmul, where a
            # split's backward copies both stacks into one (a step takes 0.83-0.93x eager,
            # 0.65-0.95x compiled; docs/performance.md, "GRU: two input projections").
            sizes = [2 * self.hidden_size, self.hidden_size]
            biases = (None, None) if b_ih is None else b_ih.split(sizes)
            gi_rz, gi_n = (
                F.linear(x, w, b) for w, b in zip(w_ih.split(sizes), biases, strict=True)
            )
            pairs = list(zip(gi_rz.unbind(0), gi_n.unbind(0)))
            for gi_rz_t, gi_n_t in pairs[::-1] if direction else pairs:
                h = gru_step(gi_rz_t, gi_n_t, h, w_hh_t, b_hh)
                outs.append(h)
        elif c is not None:  # LSTM, the one mode with a cell state
            traced = torch.compiler.is_compiling()
            w_ih, w_hh_t, b_ih, b_hh, step = lstm_parts(w_ih, w_hh, b_ih, b_hh, traced)
            w_hr_t = getattr(self, "weight_hr" + suffix).t() if self.proj_size > 0 else None
            if w_hr_t is None and not traced:
                fused = fused_direction(x, w_ih, b_ih, w_hh_t, h, c, bool(direction))
                if fused is not None:
                    return fused
            steps = _projected_steps(x, w_ih, b_ih, b_hh)
            for gi_t in steps[::-1] if direction else steps:
                h, c = step(gi_t, h, c, w_hh_t, w_hr_t)
                outs.append(h)
        else:
            relu = self.mode == "RNN_RELU"
            steps = project(x, w_ih, b_ih, b_hh, gru=False).unbind(0)
            for gi_t in steps[::-1] if direction else steps:
                h = rnn_step(gi_t, h, w_hh_t, relu)
                outs.append(h)
        if direction:
            outs.reverse()
        return torch.stack(outs), h, c


#: Time steps per input projection in a compiled LSTM step (docs/performance.md, "LSTM: the
#: input projection five steps at a time when compiled").
COMPILED_PROJECTION_STEPS = 5


def _projected_steps(
    x: Tensor, w_ih: Tensor, b_ih: Tensor | None, b_hh: Tensor | None
) -> tuple[Tensor, ...]:
    """Every time step's input projection, one per step (``x`` time first).

    Eager: one matmul over the whole sequence. Compiled: one per
    ``COMPILED_PROJECTION_STEPS`` time steps (the same products, each summed over the same
    input features): the compiled step then allocates and reads a few small buffers instead
    of one of every step's gates (5 MB for 16 members of the benchmark's LSTM), 0.86-0.93x
    its time on three sizes; eager it took 1.09x, one call per chunk.
    """
    chunk = COMPILED_PROJECTION_STEPS if torch.compiler.is_compiling() else x.size(0)
    return tuple(
        step
        for part in x.split(chunk)
        for step in project(part, w_ih, b_ih, b_hh, gru=False).unbind(0)
    )


class BatchableRNN(_Recurrent):
    """``nn.RNN`` with a ``forward`` that ``torch.func.vmap`` batches and dynamo traces.

    Same constructor (``nonlinearity`` keyword-only), parameters, maths and outputs as
    ``nn.RNN``; ``batchable`` turns existing ``nn.RNN`` layers into this class in place of
    building new ones. Not an ``nn.RNN`` subclass (dynamo refuses those).

    Example:
        >>> rnn = BatchableRNN(3, 5, nonlinearity="relu")
        >>> out, h_n = rnn(torch.randn(7, 2, 3))
        >>> tuple(out.shape), tuple(h_n.shape)
        ((7, 2, 5), (1, 2, 5))
    """

    def __init__(self, *args: Any, nonlinearity: str = "tanh", **kwargs: Any) -> None:
        modes = {"tanh": "RNN_TANH", "relu": "RNN_RELU"}
        if nonlinearity not in modes:
            raise ValueError(
                f"BatchableRNN: `nonlinearity` must be one of ('tanh', 'relu'), got {nonlinearity!r}"
            )
        super().__init__(modes[nonlinearity], *args, **kwargs)
        self.nonlinearity = nonlinearity


class BatchableGRU(_Recurrent):
    """``nn.GRU`` with a ``forward`` that ``torch.func.vmap`` batches and dynamo traces.

    Same constructor, parameters, maths and outputs as ``nn.GRU``. Not an ``nn.GRU``
    subclass (dynamo refuses those).

    Example:
        >>> gru = BatchableGRU(3, 5, num_layers=2, batch_first=True)
        >>> out, h_n = gru(torch.randn(2, 7, 3))
        >>> tuple(out.shape), tuple(h_n.shape)
        ((2, 7, 5), (2, 2, 5))
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__("GRU", *args, **kwargs)


class BatchableLSTM(_Recurrent):
    """``nn.LSTM`` with a ``forward`` that ``torch.func.vmap`` batches and dynamo traces.

    Same constructor (``proj_size`` included), parameters, maths and outputs as ``nn.LSTM``.
    Not an ``nn.LSTM`` subclass (dynamo refuses those).

    Example:
        >>> lstm = BatchableLSTM(3, 5, proj_size=4)
        >>> out, (h_n, c_n) = lstm(torch.randn(7, 3))
        >>> tuple(out.shape), tuple(h_n.shape), tuple(c_n.shape)
        ((7, 4), (1, 4), (1, 5))
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__("LSTM", *args, **kwargs)


def _cell_inputs(cell: nn.RNNCellBase, input: Tensor) -> tuple[Tensor, bool]:
    """Check a cell's input and return it with a batch dim, and whether it had one."""
    api = type(cell).__name__
    if isinstance(input, PackedSequence):
        raise TypeError(_PACKED)
    if input.dim() not in (1, 2):
        raise ValueError(
            f"{api}: `input` must be 1-D (unbatched) or 2-D (batched), got {input.dim()}-D"
        )
    if input.size(-1) != cell.input_size:
        raise ValueError(
            f"{api}: `input` must have {cell.input_size} features (last dim), got {input.size(-1)}"
        )
    batched = input.dim() == 2
    return (input if batched else input.unsqueeze(0)), batched


def _cell_state(
    cell: nn.RNNCellBase, hx: Tensor | None, x: Tensor, batched: bool, name: str = "hx"
) -> Tensor:
    """A cell state with a batch dim: ``hx`` as given (checked), or zeros."""
    if hx is None:
        return torch.zeros(x.size(0), cell.hidden_size, dtype=x.dtype, device=x.device)
    # Exactly torch's shape: a state of another batch size (one row, say) would broadcast
    # in the twin's ops and run, where torch's cell kernels refuse it.
    want = (x.size(0), cell.hidden_size) if batched else (cell.hidden_size,)
    if tuple(hx.shape) != want:
        raise ValueError(
            f"{type(cell).__name__}: `{name}` must have shape {list(want)} (batch and hidden "
            f"size of `input`), got {list(hx.shape)}"
        )
    return hx if batched else hx.unsqueeze(0)


class BatchableRNNCell(nn.RNNCell):
    """``nn.RNNCell`` with a ``forward`` written in ops that ``torch.func.vmap`` batches.

    Example:
        >>> cell = BatchableRNNCell(3, 5)
        >>> tuple(cell(torch.randn(2, 3)).shape)
        (2, 5)
    """

    def forward(self, input: Tensor, hx: Tensor | None = None) -> Tensor:
        _warn_if_autocast(self, input)
        x, batched = _cell_inputs(self, input)
        h = _cell_state(self, hx, x, batched)
        gi = project(x, self.weight_ih, self.bias_ih, self.bias_hh, gru=False)
        h = rnn_step(gi, h, self.weight_hh.t(), self.nonlinearity == "relu")
        return h if batched else h.squeeze(0)


class BatchableGRUCell(nn.GRUCell):
    """``nn.GRUCell`` with a ``forward`` written in ops that ``torch.func.vmap`` batches.

    Example:
        >>> cell = BatchableGRUCell(3, 5)
        >>> tuple(cell(torch.randn(3)).shape)
        (5,)
    """

    def forward(self, input: Tensor, hx: Tensor | None = None) -> Tensor:
        _warn_if_autocast(self, input)
        x, batched = _cell_inputs(self, input)
        h = _cell_state(self, hx, x, batched)
        gi = project(x, self.weight_ih, self.bias_ih, self.bias_hh, gru=True)
        gi_rz, gi_n = gi.split([2 * self.hidden_size, self.hidden_size], -1)
        h = gru_step(gi_rz, gi_n, h, self.weight_hh.t(), self.bias_hh)
        return h if batched else h.squeeze(0)


class BatchableLSTMCell(nn.LSTMCell):
    """``nn.LSTMCell`` with a ``forward`` written in ops that ``torch.func.vmap`` batches.

    Example:
        >>> cell = BatchableLSTMCell(3, 5)
        >>> h, c = cell(torch.randn(2, 3))
        >>> tuple(h.shape), tuple(c.shape)
        ((2, 5), (2, 5))
    """

    def forward(
        self, input: Tensor, hx: tuple[Tensor, Tensor] | list[Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        if hx is not None and not (isinstance(hx, (tuple, list)) and len(hx) == 2):
            raise TypeError(
                f"BatchableLSTMCell: `hx` must be a tuple (h_0, c_0), got {type(hx).__name__}"
            )
        _warn_if_autocast(self, input)
        x, batched = _cell_inputs(self, input)
        h = _cell_state(self, None if hx is None else hx[0], x, batched, "hx[0]")
        c = _cell_state(self, None if hx is None else hx[1], x, batched, "hx[1]")
        weights = (self.weight_ih, self.weight_hh, self.bias_ih, self.bias_hh)
        w_ih, w_hh_t, b_ih, b_hh, step = lstm_parts(*weights, torch.compiler.is_compiling())
        h, c = step(project(x, w_ih, b_ih, b_hh, gru=False), h, c, w_hh_t, None)
        return (h, c) if batched else (h.squeeze(0), c.squeeze(0))
