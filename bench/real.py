"""Real-model workloads: a small CNN, a Transformer encoder, a GRU and an LSTM regressor.

Each workload has the same rows, all step factories ``factory(n, device) -> step``:

Every step returns the members' losses ``[n]``, and member ``i`` is built after
``torch.manual_seed(i)`` in every row, so all rows train the same members.

* ``naive``: N plain modules, each with its own ``torch.optim.Adam``, one after another.
* ``torchfunc``: the bare torch.func recipe: ``stack_module_state`` + ``vmap(functional_call)``
  + the sum of the member losses, ``backward`` and one ``torch.optim.Adam(foreach=True)``.
* ``vmapens_eager`` / ``vmapens_compiled``: ``vmapens.make_step`` over ``Ensemble(member, n)``.

The Transformer adds ``torchfunc_batched_attn``: the same recipe inside
``vmapens._attention.batched_attention`` (the rule ``Ensemble.guard`` applies), so that the
table separates what batched attention buys from the rest. The recurrent workloads add
``torchfunc_batchable``, the recipe on a template converted by ``vmapens._batchable.batchable``:
the plain recipe cannot vmap ``aten::gru``/``aten::lstm`` (no batching rule), so its row is n/a.

Example:
    >>> step = WORKLOAD_REAL["cnn"]["vmapens_eager"](2, torch.device("cpu"))
    >>> step().shape
    torch.Size([2])
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from collections.abc import Callable

import torch
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

from vmapens._attention import batched_attention
from vmapens._batchable import batchable
from vmapens.ensemble import Ensemble
from vmapens.optim import StackedAdam
from vmapens.step import make_step

from ._tools import Step
from .workloads import StepFactory

#: Ensemble size of the real-model workloads.
REAL_N = 16
#: torch.func warns on every call that falls back to a per-member loop: expected in the recipe.
_FALLBACK = "There is a performance drop because we have not yet implemented the batching rule"
#: What vmap (and the Ensemble re-raising it) says when an op has no batching rule.
_UNBATCHABLE = ("Batching rule not implemented", "cannot be batched")


def cnn() -> nn.Sequential:
    """CNN member for 8x8 one-channel images (digits-sized): conv, BatchNorm, pool, 10 logits."""
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 10),
    )


class Encoder(nn.Module):
    """Transformer member: a 2-layer ``nn.TransformerEncoder`` (d_model 32) and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(
            32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


class Recurrent(nn.Module):
    """GRU or LSTM member: ``input 8 -> hidden 32`` (batch first), ``Linear`` on the last step."""

    def __init__(self, cell: type[nn.GRU] | type[nn.LSTM] = nn.GRU) -> None:
        super().__init__()
        self.rnn = cell(8, 32, batch_first=True)
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


#: Member factory, input shape, loss, target maker, per workload.
_SPECS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], nn.Module, str]] = {
    "cnn": (cnn, (64, 1, 8, 8), nn.CrossEntropyLoss(), "classes"),
    "transformer": (Encoder, (32, 16, 32), nn.MSELoss(), "tokens"),
    "gru": (functools.partial(Recurrent, nn.GRU), (32, 20, 8), nn.MSELoss(), "scalar"),
    "lstm": (functools.partial(Recurrent, nn.LSTM), (32, 20, 8), nn.MSELoss(), "scalar"),
}
_TARGETS: dict[str, Callable[[tuple[int, ...], torch.Generator], torch.Tensor]] = {
    "classes": lambda shape, g: torch.randint(10, shape[:1], generator=g),
    "tokens": lambda shape, g: torch.randn(*shape[:2], 1, generator=g),
    "scalar": lambda shape, g: torch.randn(shape[0], 1, generator=g),
}


def _data(workload: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    _, shape, _, target = _SPECS[workload]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g)
    return x.to(device), _TARGETS[target](shape, g).to(device)


def _probe(forward: Callable[[], object]) -> None:
    """Run one forward at build time: a member that cannot be batched becomes an n/a row."""
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", _FALLBACK, UserWarning)
            forward()
    except RuntimeError as err:
        if not any(m in str(err) for m in _UNBATCHABLE):
            raise
        raise NotImplementedError(str(err).split("\n")[0]) from err


def _members(workload: str, n: int, device: torch.device) -> list[nn.Module]:
    """Member ``i`` is built after ``torch.manual_seed(i)``, in every row: the same members."""
    members = []
    for i in range(n):
        torch.manual_seed(i)
        members.append(_SPECS[workload][0]().to(device))
    return members


def naive(workload: str, n: int, device: torch.device) -> Step:
    """N modules, N ``torch.optim.Adam``, a Python loop over members."""
    x, y = _data(workload, device)
    loss_fn, models = _SPECS[workload][2], _members(workload, n, device)
    opts = [torch.optim.Adam(m.parameters()) for m in models]

    def step() -> torch.Tensor:
        losses = []
        for model, opt in zip(models, opts, strict=True):
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return torch.stack(losses)

    return step


def torchfunc(
    workload: str, n: int, device: torch.device, *, convert: bool = False, attn: bool = False
) -> Step:
    """The bare recipe; ``convert``: template through ``batchable``; ``attn``: batched attention.

    The recipe takes no care of buffers: BatchNorm's running statistics are updated in place
    through ``functional_call`` on the stacked buffers, as they are in the docs' recipe.
    """
    x, y = _data(workload, device)
    loss_fn, members = _SPECS[workload][2], _members(workload, n, device)
    params, buffers = stack_module_state(members)
    base = copy.deepcopy(members[0]).to("meta")
    base = batchable(base) if convert else base

    def member_loss(p: dict, b: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return loss_fn(functional_call(base, (p, b), (x,)), y)

    losses = vmap(member_loss, in_dims=(0, 0, None, None))
    _probe(lambda: losses(params, buffers, x, y))
    opt = torch.optim.Adam(params.values(), foreach=True)

    def step() -> torch.Tensor:
        opt.zero_grad()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", _FALLBACK, UserWarning)
            with batched_attention() if attn else contextlib.nullcontext():
                out = losses(params, buffers, x, y)
            out.sum().backward()
        opt.step()
        return out.detach()

    return step


def vmapens_step(workload: str, n: int, device: torch.device, *, compile: bool) -> Step:
    """``vmapens.make_step`` over ``Ensemble(member, n)``: what a user writes, nothing converted.

    One forward runs at build time, so that a member the ensemble cannot batch is reported
    (as n/a) before any timing starts.
    """
    x, y = _data(workload, device)
    factory, _, loss_fn, _ = _SPECS[workload]
    ens = Ensemble(lambda: factory().to(device), n, seeds=range(n))
    _probe(lambda: ens(x))
    step = make_step(ens, loss_fn, StackedAdam(ens), compile=compile)
    return lambda: step(x, y)


def _rows(workload: str) -> dict[str, StepFactory]:
    rows: dict[str, Callable[..., Step]] = {
        "naive": naive,
        "torchfunc": torchfunc,
        "vmapens_eager": functools.partial(vmapens_step, compile=False),
        "vmapens_compiled": functools.partial(vmapens_step, compile=True),
    }
    if workload == "transformer":
        rows["torchfunc_batched_attn"] = functools.partial(torchfunc, attn=True)
    if workload in ("gru", "lstm"):
        rows["torchfunc_batchable"] = functools.partial(torchfunc, convert=True)
    return {impl: functools.partial(f, workload) for impl, f in rows.items()}


#: Step factories by workload ("cnn", "transformer", "gru", "lstm"), then by implementation.
WORKLOAD_REAL: dict[str, dict[str, StepFactory]] = {w: _rows(w) for w in _SPECS}
#: One line per workload for the tables.
DESCRIPTIONS = {
    "cnn": "Conv2d(1,8,3)+BatchNorm2d+ReLU+MaxPool2d(2)+Linear(128,10), 8x8 inputs, batch 64, "
    "CrossEntropy",
    "transformer": "TransformerEncoder(2 layers, d_model 32, 4 heads, ff 64) + Linear(32,1), "
    "seq 16, batch 32, MSE",
    "gru": "GRU(8, 32, batch_first) + Linear(32,1) on the last step, seq 20, batch 32, MSE",
    "lstm": "LSTM(8, 32, batch_first) + Linear(32,1) on the last step, seq 20, batch 32, MSE",
}
