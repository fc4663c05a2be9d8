"""The independent truth every parity test compares against: plain modules trained alone.

Nothing here imports vmapens. Each helper is the naive loop a user would write with
`torch.optim`, one module at a time, so a test that compares an Ensemble with these compares it
with PyTorch itself, never with the code under test.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

Batch = tuple[Any, Any]
MakeOpt = Callable[[nn.Module], torch.optim.Optimizer]

# float64 end-to-end: the same kernels on the same numbers, only summation order may differ.
TOL64 = dict(rtol=1e-9, atol=1e-10)


def adam(lr: float = 1e-2, **kw: Any) -> MakeOpt:
    """A `make_opt` for `train_alone`: torch.optim.Adam over the module's parameters."""
    return lambda m: torch.optim.Adam(m.parameters(), lr=lr, **kw)


def train_alone(
    model: nn.Module,
    batches: Iterable[Batch],
    loss_fn: Callable[..., torch.Tensor] = nn.functional.mse_loss,
    make_opt: MakeOpt | torch.optim.Optimizer | None = None,
    *,
    clip: Callable[[Iterable[nn.Parameter]], Any] | None = None,
    autocast: torch.dtype | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> torch.optim.Optimizer:
    """Train one plain module on `batches` the way a user would; return its optimizer.

    Args:
        model: the module, trained in place.
        batches: `(x, y)` pairs, already this member's own (index per-member data before).
        loss_fn: `loss_fn(model(x), y)` -> scalar.
        make_opt: builds the optimizer from the module (default Adam, lr 1e-2), or an
            optimizer already built over `model`'s parameters.
        clip: called on `model.parameters()` after backward (after unscaling with a scaler).
        autocast: run forward and loss under `torch.autocast("cpu", dtype=autocast)`.
        scaler: a `torch.amp.GradScaler` for fp16: scale, unscale, clip, step, update.
    """
    opt = make_opt if isinstance(make_opt, torch.optim.Optimizer) else (make_opt or adam())(model)
    for x, y in batches:
        opt.zero_grad()
        ctx = (
            torch.autocast("cpu", dtype=autocast)
            if autocast is not None
            else contextlib.nullcontext()
        )
        with ctx:
            loss = loss_fn(model(x), y)
        if scaler is None:
            loss.backward()
            if clip is not None:
                clip(model.parameters())
            opt.step()
            continue
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        if clip is not None:
            clip(model.parameters())
        scaler.step(opt)
        scaler.update()
    return opt


def train_each(
    models: Sequence[nn.Module],
    batches: Sequence[Batch],
    loss_fn: Callable[..., torch.Tensor] = nn.functional.mse_loss,
    make_opt: Callable[[int, nn.Module], torch.optim.Optimizer] | None = None,
    *,
    per_member: bool = False,
    **kw: Any,
) -> list[torch.optim.Optimizer]:
    """`train_alone` for every module; member i gets `make_opt(i, model)`.

    With `per_member=True` each batch is stacked `[n, ...]` and member i trains on `x[i], y[i]`.
    """
    opts = []
    for i, m in enumerate(models):
        own = [(x[i], y[i]) for x, y in batches] if per_member else batches
        opt = make_opt(i, m) if make_opt is not None else None
        opts.append(train_alone(m, own, loss_fn, opt, **kw))
    return opts


def twins(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """Independent deep copies (for `ens.unstack()` or a list of plain modules)."""
    return [copy.deepcopy(m) for m in modules]


def assert_members_equal(ens: Any, modules: Sequence[nn.Module], **tol: Any) -> None:
    """Member i's state_dict (parameters and buffers) equals `modules[i]`'s, key by key."""
    tol = tol or TOL64
    assert len(ens) == len(modules), f"{len(ens)} members vs {len(modules)} modules"
    for i, m in enumerate(modules):
        got = ens[i].state_dict()
        want = m.state_dict()
        assert list(got) == list(want), f"member {i}: keys {list(got)} vs {list(want)}"
        for name in want:
            torch.testing.assert_close(got[name], want[name], **tol, msg=f"member {i} {name}")
