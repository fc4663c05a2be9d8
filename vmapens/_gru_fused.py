"""One GRU layer's recurrence as one autograd node: the eager ``BatchableGRU``'s fast path.

The GRU twin of ``_lstm_fused`` (see there, and docs/performance.md, "GRU: the recurrence as
one autograd node"). torch's GRU (gates r, z, n):

    r, z = sigmoid(W_i{r,z} x + b_i{r,z} + W_h{r,z} h + b_h{r,z})
    n = tanh(W_in x + b_in + r * (W_hn h + b_hn))
    h' = (1 - z) n + z h

The n gate needs its input and hidden parts apart (r multiplies only the hidden one), so each
step's one ``bmm`` of ``[x_t, 1, h]`` makes four blocks of H columns, ``[r, z, x part of n,
h part of n]``, with a weight ``[[W_ir^T W_iz^T W_in^T 0]; [b_r b_z b_in b_hn]; [W_hr^T
W_hz^T 0 W_hn^T]]`` (``b_r = b_ir + b_hr``). The two zero blocks are the price of one product
a step; their gradients are computed and dropped.

It runs where :func:`_fused_node.usable` allows; elsewhere the caller runs the per-step loop.

This file imports only torch and ``_fused_node``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._fused_node import flat, member_first, order, twice, usable

__all__ = ["fused_gru_direction"]

_sigmoid_backward = torch.ops.aten.sigmoid_backward.grad_input
_tanh_backward = torch.ops.aten.tanh_backward.grad_input


def fused_gru_direction(
    x: Tensor,
    w_ih: Tensor,
    b_ih: Tensor | None,
    w_hh: Tensor,
    b_hh: Tensor | None,
    h0: Tensor,
    reverse: bool,
) -> tuple[Tensor, Tensor] | None:
    """One direction of one GRU layer, or None where the fused node does not apply.

    Args:
        x: ``[T, B, I]``, time first.
        w_ih, b_ih, w_hh, b_hh: torch's ``[3H, I]``, ``[3H]``, ``[3H, H]``, ``[3H]`` (the
            biases both or neither).
        h0: ``[B, H]``: the initial state.
        reverse: Run from the last time step to the first.

    Returns:
        ``(out [T, B, H], h_last [B, H])``, as the per-step loop.
    """
    if (b_ih is None) != (b_hh is None) or not usable((x, w_ih, b_ih, w_hh, b_hh, h0)):
        return None
    out, *_ = _Recurrence.apply(x, w_ih, b_ih, w_hh, b_hh, h0, reverse)
    return out, out[0 if reverse else -1]


class _Recurrence(torch.autograd.Function):
    """The recurrence on tensors with leading member dims (none, or any number under vmap).

    Buffers, ``m`` members, ``K = I + 1 + H`` (``I + H`` without bias): ``xh [m, T, B, K]``
    (each step's ``[x_t, 1, h_prev]``), ``pre [T, m, B, 4H]`` (each step's product, the r and
    z blocks after their sigmoid), ``n [T, m, B, H]``, ``out [m, T, B, H]``.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        x: Tensor,
        w_ih: Tensor,
        b_ih: Tensor | None,
        w_hh: Tensor,
        b_hh: Tensor | None,
        h0: Tensor,
        reverse: bool,
    ) -> Any:
        lead = x.shape[:-3]
        x, w_ih, w_hh, h = flat(x, 3), flat(w_ih, 2), flat(w_hh, 2), flat(h0, 2)
        m, steps, batch, features = x.shape
        hidden = w_hh.size(-1)
        inner = features + (b_ih is not None)  # where h starts in a row of xh
        weight = x.new_zeros(m, inner + hidden, 4 * hidden)
        weight[:, :features, : 3 * hidden] = w_ih.transpose(1, 2)
        weight[:, inner:, : 2 * hidden] = w_hh[:, : 2 * hidden].transpose(1, 2)
        weight[:, inner:, 3 * hidden :] = w_hh[:, 2 * hidden :].transpose(1, 2)
        if b_ih is not None and b_hh is not None:
            b_ih, b_hh = flat(b_ih, 1), flat(b_hh, 1)
            torch.add(
                b_ih[:, : 2 * hidden], b_hh[:, : 2 * hidden], out=weight[:, features, : 2 * hidden]
            )
            weight[:, features, 2 * hidden : 3 * hidden] = b_ih[:, 2 * hidden :]
            weight[:, features, 3 * hidden :] = b_hh[:, 2 * hidden :]
        xh = x.new_empty(m, steps, batch, inner + hidden)
        xh[..., :features] = x
        xh[..., features:inner] = 1
        run = order(steps, reverse)
        xh[:, run[0], :, inner:] = h
        pre = x.new_empty(steps, m, batch, 4 * hidden)
        n = x.new_empty(steps, m, batch, hidden)
        result = x.new_empty(*lead, steps, batch, hidden)  # not a view: the caller may change it
        out = flat(result, 3)
        rows, pre_rows, n_rows = xh.unbind(1), pre.unbind(0), n.unbind(0)
        h_rows, out_rows = xh[..., inner:].unbind(1), out.unbind(1)
        rz, gi_n, gh_n = (t.unbind(0) for t in pre.split([2 * hidden, hidden, hidden], -1))
        for step, k in enumerate(run):
            torch.bmm(rows[k], weight, out=pre_rows[k])
            r, z = rz[k].sigmoid_().chunk(2, -1)
            n_k = torch.addcmul(gi_n[k], r, gh_n[k], out=n_rows[k]).tanh_()
            h = torch.lerp(n_k, h, z, out=out_rows[k])  # (1 - z) n + z h
            if step + 1 < steps:
                h_rows[run[step + 1]].copy_(h)
        return result, xh, weight, pre, n

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        x, w_ih, b_ih, w_hh, b_hh, h0, reverse = inputs
        _, xh, weight, pre, n = output
        ctx.mark_non_differentiable(xh, weight, pre, n)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, w_ih, b_ih, w_hh, b_hh, h0, xh, weight, pre, n)
        ctx.reverse = reverse

    @staticmethod
    def backward(ctx: Any, d_out: Tensor | None, *_: Any) -> Any:  # type: ignore[override]
        x, w_ih, b_ih, w_hh, b_hh, h0, xh, weight, pre, n = ctx.saved_tensors
        need = ctx.needs_input_grad[:6]
        inputs = (x, w_ih, b_ih, w_hh, b_hh, h0)
        if d_out is None:
            return (None,) * 7
        if torch.is_grad_enabled():  # create_graph=True: a graph for a gradient of gradients
            return (*twice(_loop, need, inputs, ctx.reverse, (d_out,)), None)
        steps, m, batch, four = pre.shape
        hidden, features = four // 4, x.size(-1)
        inner = weight.size(1) - hidden
        d_out_rows = flat(d_out, 3).unbind(1)
        d_pre = x.new_empty(m, steps, batch, four)
        d_rz, d_gi_n, d_gh_n = (t.unbind(1) for t in d_pre.split([2 * hidden, hidden, hidden], -1))
        d_rows = d_pre.unbind(1)
        rz, _, gh_n = (t.unbind(0) for t in pre.split([2 * hidden, hidden, hidden], -1))
        n_rows, h_prev = n.unbind(0), xh[..., inner:].unbind(1)
        w_h = weight[:, inner:].transpose(1, 2)
        run = order(steps, ctx.reverse)
        dh = None
        for step in range(steps - 1, -1, -1):
            k = run[step]
            dh_k = d_out_rows[k] if dh is None else d_out_rows[k] + dh
            r, z = rz[k].chunk(2, -1)
            d_r, d_z = d_rz[k].chunk(2, -1)
            through_z = dh_k * z  # h' = n + z (h - n): the direct part of dh_prev
            torch.sub(h_prev[k], n_rows[k], out=d_z).mul_(dh_k)
            _tanh_backward(dh_k - through_z, n_rows[k], grad_input=d_gi_n[k])
            torch.mul(d_gi_n[k], r, out=d_gh_n[k])
            torch.mul(d_gi_n[k], gh_n[k], out=d_r)
            _sigmoid_backward(d_rz[k], rz[k], grad_input=d_rz[k])
            if step or need[5]:
                dh = torch.baddbmm(through_z, d_rows[k], w_h)
        rows = d_pre.view(m, steps * batch, four)
        d_x = d_w_ih = d_b_ih = d_w_hh = d_b_hh = None
        if need[0]:
            d_x = torch.bmm(rows, weight[:, :features].transpose(1, 2)).view(x.shape)
        if any(need[1:5]):
            d_weight = torch.bmm(xh.view(m, steps * batch, -1).transpose(1, 2), rows)
            d_w_ih = d_weight[:, :features, : 3 * hidden].transpose(1, 2).reshape(w_ih.shape)
            d_h = d_weight[:, inner:]
            d_w_hh = torch.cat([d_h[..., : 2 * hidden], d_h[..., 3 * hidden :]], -1)
            d_w_hh = d_w_hh.transpose(1, 2).reshape(w_hh.shape)
            if b_ih is not None and b_hh is not None:
                d_b = d_weight[:, features]
                d_b_ih = d_b[:, : 3 * hidden].reshape(b_ih.shape)
                d_b_hh = torch.cat([d_b[:, : 2 * hidden], d_b[:, 3 * hidden :]], -1)
                d_b_hh = d_b_hh.reshape(b_hh.shape)
        d_h0 = dh.reshape(h0.shape) if need[5] and dh is not None else None
        return d_x, d_w_ih, d_b_ih, d_w_hh, d_b_hh, d_h0, None

    @staticmethod
    def vmap(info: Any, in_dims: tuple, *args: Any) -> Any:
        return member_first(_Recurrence.apply, info, in_dims, 6, args)


def _loop(
    x: Tensor,
    w_ih: Tensor,
    b_ih: Tensor | None,
    w_hh: Tensor,
    b_hh: Tensor | None,
    h: Tensor,
    reverse: bool,
) -> tuple[Tensor]:
    """The same maths in differentiable ops, any leading dims: ``(out,)``."""
    gi = x @ w_ih.transpose(-1, -2).unsqueeze(-3)
    if b_ih is not None:
        gi = gi + b_ih.unsqueeze(-2).unsqueeze(-2)
    outs: list[Tensor] = []
    for k in order(x.size(-3), reverse):
        gh = h @ w_hh.transpose(-1, -2)
        if b_hh is not None:
            gh = gh + b_hh.unsqueeze(-2)
        i_rz, i_n = gi.select(-3, k).split([2 * h.size(-1), h.size(-1)], -1)
        h_rz, h_n = gh.split([2 * h.size(-1), h.size(-1)], -1)
        r, z = torch.sigmoid(i_rz + h_rz).chunk(2, -1)
        n = torch.tanh(i_n + r * h_n)
        h = (1 - z) * n + z * h
        outs.append(h)
    if reverse:
        outs.reverse()
    return (torch.stack(outs, -3),)
