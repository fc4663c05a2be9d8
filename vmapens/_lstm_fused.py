"""One LSTM layer's recurrence as one autograd node: the eager ``BatchableLSTM``'s fast path.

Under ``vmap`` and autograd, the per-step loop of ``_recurrent`` costs ~25 small ops a time
step, forward and backward, each dispatched through vmap's batching rules and recorded by
autograd; at 16 members of ``LSTM(8, 32)`` that overhead, not arithmetic, sets the step time
(docs/performance.md, "LSTM: the recurrence as one autograd node"). :class:`_Recurrence`
runs the same maths on the stacked ``[n, ...]`` tensors:

* forward, per time step: one ``bmm`` of ``[x_t, 1, h]`` with ``[w_ih^T; b; w_hh^T]`` into
  the step's block of the gates, and in-place pointwise ops into buffers allocated once;
* backward through time written out: per step the gates' gradient into one buffer and one
  ``bmm`` for the previous ``h``; after the loop, every weight's gradient as one ``bmm`` over
  all steps, and the input's gradient as another.

It runs only where it is known to equal the per-step loop (:func:`fused_direction` returns
None otherwise, and the caller runs the loop): eager (not traced by dynamo or export), under
``vmap`` alone or no functorch transform, float32/float64, no autocast, no
``TorchFunctionMode``, no forward-mode AD, no ``proj_size``. A gradient of the gradient
(``create_graph=True``) differentiates the per-step loop, recomputed from the saved inputs
(:func:`_twice`).

This file imports only torch and ``_workspace``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch._C._functorch import is_legacy_batchedtensor
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
from torch.autograd.forward_ad import unpack_dual

from ._workspace import take

__all__ = ["fused_direction"]

_VMAP = torch._C._functorch.TransformType.Vmap
_DTYPES = (torch.float32, torch.float64)

_sigmoid_backward = torch.ops.aten.sigmoid_backward.grad_input
_tanh_backward = torch.ops.aten.tanh_backward.grad_input


def fused_direction(
    x: Tensor,
    w_ih: Tensor,
    bias: Tensor | None,
    w_hh_t: Tensor,
    h0: Tensor,
    c0: Tensor,
    reverse: bool,
) -> tuple[Tensor, Tensor, Tensor] | None:
    """One direction of one LSTM layer, or None where the fused node does not apply.

    Args:
        x: ``[T, B, I]``, time first.
        w_ih, bias, w_hh_t: ``[4H, I]``, ``[4H]`` (both biases, or None), ``[H, 4H]`` (the
            recurrent weight transposed), the g gate's rows doubled
            (``_recurrent_steps.lstm_weights``).
        h0, c0: ``[B, H]``: the initial state.
        reverse: Run from the last time step to the first.

    Returns:
        ``(out [T, B, H], h_last [B, H], c_last [B, H])``, as the per-step loop.
    """
    if not _usable((x, w_ih, bias, w_hh_t, h0, c0)):
        return None
    out, c_last, *_ = _Recurrence.apply(x, w_ih, bias, w_hh_t, h0, c0, reverse)
    return out, out[0 if reverse else -1], c_last


def _usable(tensors: Sequence[Tensor | None]) -> bool:
    """Whether the node may run on ``tensors``: where it is known to equal the per-step loop.

    That is eager (not traced by dynamo or export), under ``vmap`` alone or no functorch
    transform, float32/float64 on one device, no autocast, no ``TorchFunctionMode`` (vmapens's
    per-member autocast is one) and no forward-mode AD.
    """
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return False
    if torch._C._is_torch_function_mode_enabled():
        return False
    if any(level.key() != _VMAP for level in retrieve_all_functorch_interpreters()):
        return False
    present = [t for t in tensors if t is not None]
    if present[0].numel() == 0:  # an empty batch: its flat views cannot infer the member dim
        return False
    dtype, device = present[0].dtype, present[0].device
    if _autocast(device.type):
        return False
    if dtype not in _DTYPES or any(t.dtype != dtype or t.device != device for t in present):
        return False
    return all(unpack_dual(t).tangent is None for t in present)  # no forward-mode AD


def _autocast(device_type: str) -> bool:
    """Whether autocast is on for the tensors' device: the loop runs its casts there."""
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type without autocast (meta, ...)
        return False


class _Recurrence(torch.autograd.Function):
    """The recurrence on tensors with leading member dims (none, or any number under vmap).

    Buffers, ``m`` members, ``K = I + 1 + H`` (``I + H`` without bias):

    * ``xh [m, T, B, K]``: each step's ``[x_t, 1, h_prev]``, the rows of the forward's
      products and of the weights' gradient;
    * ``gates [T, m, B, 4H]``: after the sigmoid. Time first, so that each step's ``bmm``
      writes one contiguous block (BLAS's batched path needs that; a strided result runs
      member by member);
    * ``cs``, ``tanh_c [T, m, B, H]``: every cell state and its tanh (``2 sigmoid(2c) - 1``);
    * ``out [m, T, B, H]``: the output, as the caller lays it out.
    """

    #: A compiled step runs the per-step loop in its place (``_usable``): its backward is not
    #: one torch.compile would have to call (``_compiling.refuse_custom_backwards``).
    traced_twin = True

    @staticmethod
    def forward(  # type: ignore[override]
        x: Tensor,
        w_ih: Tensor,
        bias: Tensor | None,
        w_hh_t: Tensor,
        h0: Tensor,
        c0: Tensor,
        reverse: bool,
    ) -> Any:
        lead = x.shape[:-3]
        x, w_ih, w_hh_t = _flat(x, 3), _flat(w_ih, 2), _flat(w_hh_t, 2)
        h, c = _flat(h0, 2), _flat(c0, 2)
        m, steps, batch, features = x.shape
        hidden = w_hh_t.size(-2)
        inner = features + (bias is not None)  # where h starts in a row of xh
        weight = take(x, m, inner + hidden, 4 * hidden)  # [w_ih^T; b; w_hh^T]
        weight[:, :features] = w_ih.transpose(1, 2)
        if bias is not None:
            weight[:, features] = _flat(bias, 1)
        weight[:, inner:] = w_hh_t
        xh = take(x, m, steps, batch, inner + hidden)
        xh[..., :features] = x
        xh[..., features:inner] = 1
        run = _order(steps, reverse)
        xh[:, run[0], :, inner:] = h
        gates = take(x, steps, m, batch, 4 * hidden)
        cs = take(x, steps, m, batch, hidden)
        tanh_c = take(x, steps, m, batch, hidden)
        result = x.new_empty(*lead, steps, batch, hidden)  # not a view: the caller may change it
        out = _flat(result, 3)
        # Every step's views made at once (unbind): per-step indexing costs ~1 us a view.
        i, f, g, o = (t.unbind(0) for t in gates.chunk(4, -1))
        rows, gate_rows, c_rows, tanh_rows = (
            xh.unbind(1),
            gates.unbind(0),
            cs.unbind(0),
            tanh_c.unbind(0),
        )
        h_rows, out_rows = xh[..., inner:].unbind(1), out.unbind(1)
        # Doublings as sums and 1 as a tensor: a Python scalar is made a tensor in every op it is
        # passed to (~2 us a call); x + x is exactly 2 x.
        one = x.new_ones(())
        for step, k in enumerate(run):
            torch.bmm(rows[k], weight, out=gate_rows[k]).sigmoid_()
            # f c + i tanh(g), with tanh(g) = 2 sigmoid(2 g) - 1 from the doubled g rows
            c = torch.mul(f[k], c, out=c_rows[k]).sub_(i[k]).addcmul_(i[k], g[k], value=2)
            # tanh(c) = 2 sigmoid(2 c) - 1: four ops at ~half of tanh's time on CPU (as lstm_step)
            tanh_k = torch.add(c, c, out=tanh_rows[k]).sigmoid_()
            tanh_k.add_(tanh_k).sub_(one)
            h = torch.mul(o[k], tanh_k, out=out_rows[k])
            if step + 1 < steps:
                h_rows[run[step + 1]].copy_(h)
        c_last = c.reshape(*lead, batch, hidden).clone()
        return result, c_last, xh, weight, gates, cs, tanh_c

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        x, w_ih, bias, w_hh_t, h0, c0, reverse = inputs
        _, _, xh, weight, gates, cs, tanh_c = output
        ctx.mark_non_differentiable(xh, weight, gates, cs, tanh_c)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, w_ih, bias, w_hh_t, h0, c0, xh, weight, gates, cs, tanh_c)
        ctx.reverse = reverse

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, d_out: Tensor | None, d_c_last: Tensor | None, *_: Any
    ) -> Any:
        x, w_ih, bias, w_hh_t, h0, c0, xh, weight, gates, cs, tanh_c = ctx.saved_tensors
        need = ctx.needs_input_grad[:6]
        batched = any(is_legacy_batchedtensor(d) for d in (d_out, d_c_last) if d is not None)
        # create_graph=True (a graph for a gradient of gradients), or gradients batched by
        # torch's legacy vmap (jacobian(vectorize=True), is_grads_batched), which cannot batch
        # the out= writes below: the same maths recomputed in differentiable ops
        if torch.is_grad_enabled() or batched:
            inputs = (x, w_ih, bias, w_hh_t, h0, c0)
            return (*_twice(need, inputs, ctx.reverse, (d_out, d_c_last)), None)
        steps, m, batch, four = gates.shape
        hidden, features = four // 4, x.size(-1)
        inner = weight.size(1) - hidden
        d_out = None if d_out is None else _flat(d_out, 3)
        dc = cs.new_zeros(m, batch, hidden)
        if d_c_last is not None:
            dc += _flat(d_c_last, 2)
        d_gates = take(x, m, steps, batch, four)
        i, f, g, o = (t.unbind(0) for t in gates.chunk(4, -1))
        di, df, dg, do = (t.unbind(1) for t in d_gates.chunk(4, -1))
        gate_rows, d_rows, c_rows, tanh_rows = (
            gates.unbind(0),
            d_gates.unbind(1),
            cs.unbind(0),
            tanh_c.unbind(0),
        )
        d_out_rows = None if d_out is None else d_out.unbind(1)
        c_first = _flat(c0, 2)
        w_hh = weight[:, inner:].transpose(1, 2)
        run = _order(steps, ctx.reverse)
        dh = dc.new_empty(m, batch, hidden)  # h's gradient from the step after (at last d_h0)
        scratch = dc.new_empty(m, batch, hidden)
        for step in range(steps - 1, -1, -1):
            k = run[step]
            c_prev = c_first if step == 0 else c_rows[run[step - 1]]
            after = step + 1 < steps  # a later step has written dh
            if d_out_rows is None:
                dh_k = dh if after else dh.zero_()
            else:
                dh_k = dh.add_(d_out_rows[k]) if after else d_out_rows[k]
            torch.mul(dh_k, tanh_rows[k], out=do[k])
            torch.mul(dh_k, o[k], out=scratch)
            dc.add_(_tanh_backward(scratch, tanh_rows[k], grad_input=scratch))
            dc2 = torch.add(dc, dc, out=scratch)  # 2 dc, exactly, without a Python scalar
            torch.mul(dc2, g[k], out=di[k]).sub_(dc)  # dc (2 sigmoid(2g) - 1)
            torch.mul(dc, c_prev, out=df[k])
            torch.mul(dc2, i[k], out=dg[k])
            dc.mul_(f[k])
            _sigmoid_backward(d_rows[k], gate_rows[k], grad_input=d_rows[k])
            if step or need[4]:
                torch.bmm(d_rows[k], w_hh, out=dh)
        rows = d_gates.view(m, steps * batch, four)
        d_x = d_w_ih = d_bias = d_w_hh_t = None
        if need[0]:
            d_x = torch.bmm(rows, weight[:, :features].transpose(1, 2)).view(x.shape)
        if need[1] or need[2] or need[3]:
            d_weight = torch.bmm(xh.view(m, steps * batch, -1).transpose(1, 2), rows)
            d_w_ih = d_weight[:, :features].transpose(1, 2).reshape(w_ih.shape)
            d_bias = d_weight[:, features].reshape(bias.shape) if bias is not None else None
            d_w_hh_t = d_weight[:, inner:].reshape(w_hh_t.shape)
        d_h0 = dh.reshape(h0.shape) if need[4] else None
        d_c0 = dc.reshape(c0.shape) if need[5] else None
        return d_x, d_w_ih, d_bias, d_w_hh_t, d_h0, d_c0, None

    @staticmethod
    def vmap(info: Any, in_dims: tuple, *args: Any) -> Any:
        """The tensors with the mapped dim first (shared ones expanded); outputs mapped along 0."""

        def moved(t: Tensor | None, dim: int | None) -> Tensor | None:
            if t is None:
                return None
            return t.expand(info.batch_size, *t.shape) if dim is None else t.movedim(dim, 0)

        stacked = [moved(t, d) for t, d in zip(args[:6], in_dims[:6], strict=True)]
        outs = _Recurrence.apply(*stacked, args[6])
        return outs, (0,) * len(outs)


def _flat(t: Tensor, rank: int) -> Tensor:
    """``t`` with its leading (member) dims as one: ``[m, *core]``, ``m = 1`` without any."""
    return t.reshape(-1, *t.shape[t.dim() - rank :])


def _order(steps: int, reverse: bool) -> list[int]:
    """The time steps in the order a direction runs them."""
    return list(range(steps - 1, -1, -1)) if reverse else list(range(steps))


def _loop(
    x: Tensor,
    w_ih: Tensor,
    bias: Tensor | None,
    w_hh_t: Tensor,
    h: Tensor,
    c: Tensor,
    reverse: bool,
) -> tuple[Tensor, Tensor]:
    """The same maths in differentiable ops, any leading dims: ``(out, c_last)``."""
    gi = x @ w_ih.transpose(-1, -2).unsqueeze(-3)
    if bias is not None:
        gi = gi + bias.unsqueeze(-2).unsqueeze(-2)
    outs: list[Tensor] = []
    for k in _order(x.size(-3), reverse):
        i, f, g, o = torch.sigmoid(gi.select(-3, k) + h @ w_hh_t).chunk(4, -1)
        c = f * c + i * (2 * g - 1)
        h = o * (2 * torch.sigmoid(2 * c) - 1)  # tanh(c), as the node's forward
        outs.append(h)
    if reverse:
        outs.reverse()
    return torch.stack(outs, -3), c


def _twice(
    need: Sequence[bool],
    inputs: tuple[Tensor | None, ...],
    reverse: bool,
    grads_out: Sequence[Tensor | None],
) -> tuple[Tensor | None, ...]:
    """The backward as a graph (``create_graph=True``): :func:`_loop`, the same maths in
    differentiable ops, recomputed and differentiated.

    Returns:
        One gradient per input (None where ``need`` is False or no output depends on it).
    """
    wanted = [t for t, n in zip(inputs, need, strict=True) if n and t is not None]
    with torch.enable_grad():
        x, w_ih, bias, w_hh_t, h0, c0 = inputs
        assert x is not None and w_ih is not None and w_hh_t is not None
        assert h0 is not None and c0 is not None
        results = _loop(x, w_ih, bias, w_hh_t, h0, c0, reverse)
        outs = [(t, d) for t, d in zip(results, grads_out, strict=True) if d is not None]
        if not outs or not wanted:
            return (None,) * len(inputs)
        found = torch.autograd.grad(
            [t for t, _ in outs], wanted, [d for _, d in outs], create_graph=True, allow_unused=True
        )
    grads = iter(found)
    return tuple(next(grads) if n and t is not None else None for t, n in zip(inputs, need))
