"""Seeded random call sequences on an Ensemble and on N plain modules, compared after every call.

Each program builds an ``Ensemble`` (float64, N = 2..4; one size, several sizes through
``from_factories``, or ``from_modules``) and, before any training, the N plain modules with
their own ``torch.optim`` optimizers. It then applies a random sequence of calls that plain
PyTorch allows to both sides: training steps (``make_step`` with shared or per-member data,
masks and clipping; ``zero_grad``/``backward``/``step`` by hand, accumulating over batches),
hyperparameter edits in ``param_groups`` (shared and per member), LR schedulers,
``add_param_group``, freezing, ``train``/``eval``, optimizer and ensemble state_dict round
trips (``strict=False``, ``assign=True``), ``deepcopy``, ``vmapens.save``/``load``/``restore``,
indexing and ``select``/``best_k`` (with the optimizer's state or a new one), ``apply``,
``predict``, ``channels_last``. After every call member ``i`` is compared with module ``i``:
parameters (and their padding), gradients, buffers, ``requires_grad`` flags, modes, optimizer
state and hyperparameters. The truth is plain torch; nothing of vmapens computes it.

Run one program by hand: ``python tests/test_fuzz_sequences.py SEED`` prints its calls.
"""

from __future__ import annotations

import copy
import functools
import math
import random
import sys
import warnings
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import vmapens
from vmapens.optim import MemberValues, stacked

TOL = dict(rtol=1e-9, atol=1e-10)  # float64: only the order of sums may differ


# -- the members ------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, hidden: int = 5) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(3, hidden), nn.Linear(hidden, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class MLPBN(nn.Module):
    def __init__(self, hidden: int = 5) -> None:
        super().__init__()
        # No bias before BatchNorm: its true gradient is 0 (docs/semantics.md, round-off).
        self.fc1, self.fc2 = nn.Linear(3, hidden, bias=False), nn.Linear(hidden, 2)
        self.bn = nn.BatchNorm1d(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


class GRUNet(nn.Module):
    """A recurrent layer (``nn.GRU``; ``LSTMNet``: ``nn.LSTM``) and a head on the last step."""

    layer: type[nn.RNNBase] = nn.GRU

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = self.layer(3, 4, batch_first=True), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(1, 3, 3, bias=False), nn.BatchNorm2d(3)
        self.head = nn.Linear(27, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.bn(self.conv(x))).flatten(1))


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 2)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x)))))


class MLPCumulativeBN(MLPBN):
    def __init__(self, hidden: int = 5) -> None:
        super().__init__(hidden)
        self.bn = nn.BatchNorm1d(hidden, momentum=None)  # a cumulative average: the ensemble's twin


class LSTMNet(GRUNet):
    layer = nn.LSTM


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # bias=False: the key bias's true gradient is 0 (softmax ignores a shift of a row), so
        # its steps are round-off noise (docs/semantics.md, "What differs").
        self.layer = nn.TransformerEncoderLayer(
            4, 2, dim_feedforward=6, dropout=0.0, batch_first=True, bias=False
        )
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x).mean(1))


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.norm, self.head = nn.Embedding(7, 3), nn.LayerNorm(3), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.emb(x)).mean(1))


class WeightNormed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.utils.parametrizations.weight_norm(nn.Linear(3, 5))
        self.fc2 = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


#: kind -> (class, the shape of one input row)
MODELS: dict[str, tuple[type[nn.Module], tuple[int, ...]]] = {
    "mlp": (MLP, (3,)),
    "mlp_bn": (MLPBN, (3,)),
    "gru": (GRUNet, (3, 3)),
    "conv_bn": (ConvBN, (1, 5, 5)),
    "tied": (Tied, (3,)),
    "mlp_cma": (MLPCumulativeBN, (3,)),
    "lstm": (LSTMNet, (3, 3)),
    "encoder": (Encoder, (3, 4)),
    "embed": (Embed, (4,)),  # 4 indices below 7
    "weight_norm": (WeightNormed, (3,)),
}

#: name -> (torch class, constructor kwargs, hyperparameters a program may edit). Programs
#: also give some of them one value per member (a list) and flip implementation flags.
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any], tuple[str, ...]]] = {
    "sgd": (torch.optim.SGD, dict(lr=0.05), ("lr", "weight_decay", "momentum")),
    "sgd_nesterov": (
        torch.optim.SGD,
        dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
        ("lr", "weight_decay", "momentum"),
    ),
    "sgd_dampening": (
        torch.optim.SGD,
        dict(lr=0.05, momentum=0.5, dampening=0.3),
        ("lr", "weight_decay", "momentum"),
    ),
    "adam_amsgrad": (
        torch.optim.Adam,
        dict(lr=1e-2, amsgrad=True, weight_decay=1e-3),
        ("lr", "weight_decay", "betas"),
    ),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2), ("lr", "weight_decay", "betas")),
    "rmsprop": (
        torch.optim.RMSprop,
        dict(lr=1e-2, momentum=0.5, centered=True),
        ("lr", "weight_decay", "momentum"),
    ),
    "adagrad": (torch.optim.Adagrad, dict(lr=0.05, lr_decay=1e-3), ("lr", "weight_decay")),
    "adamax": (torch.optim.Adamax, dict(lr=1e-2), ("lr", "weight_decay", "betas")),
    "nadam": (torch.optim.NAdam, dict(lr=1e-2), ("lr", "weight_decay", "betas")),
    "radam": (
        torch.optim.RAdam,
        dict(lr=1e-2, decoupled_weight_decay=True),
        ("lr", "weight_decay", "betas"),
    ),
    "adadelta": (torch.optim.Adadelta, dict(lr=0.5), ("lr", "weight_decay")),
    "rprop": (torch.optim.Rprop, dict(lr=1e-2), ("lr",)),
    "asgd": (torch.optim.ASGD, dict(lr=1e-2, t0=2.0), ("lr", "weight_decay")),
}

SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1.0 / (1 + e)),
    "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=5, eta_min=1e-4),
    "exponential": lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.8),
    "onecycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(
        o,
        max_lr=0.05,
        total_steps=60,
        cycle_momentum="momentum" in o.defaults or "betas" in o.defaults,
    ),
}


def member_kwargs(kwargs: dict[str, Any], i: int) -> dict[str, Any]:
    """Member ``i``'s constructor kwargs: each list replaced by its ``i``-th value."""

    def pick(v: Any) -> Any:
        if isinstance(v, list):
            return v[i]
        if isinstance(v, tuple):
            return tuple(pick(u) for u in v)
        return v

    return {k: pick(v) for k, v in kwargs.items()}


def corner(row: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A member's row of a stacked tensor at the member's own size: its leading corner, where
    members of several sizes are padded to the largest (``Ensemble.from_factories``)."""
    if row.dim() != like.dim() or row.shape == like.shape:
        return row
    return row[tuple(slice(0, k) for k in like.shape)]


# -- both sides -------------------------------------------------------------------------------


class World:
    """An Ensemble with its stacked optimizer, and N plain modules with theirs."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.cls, self.row = MODELS[spec["model"]]
        self.n = spec["n"]
        self.torch_cls, _, self.editable = OPTIMIZERS[spec["opt"]]
        self.opt_kwargs = spec["opt_kwargs"]
        dtype = torch.float32 if spec["late_double"] else torch.float64
        self.dtype = dtype
        # The rows of the first ensemble's members still here (after `select`): a sub-ensemble
        # keeps the padded shapes of the ensemble it came from, and so its state dict's.
        self.rows, self.origin = list(range(self.n)), spec["widths"]
        if spec["from_modules"]:
            # Modules trained a little alone first (each its own way), then stacked.
            self.models = [self.cls().to(dtype) for _ in range(self.n)]
            g = torch.Generator().manual_seed(spec["seed"])
            for i, m in enumerate(self.models):
                with torch.no_grad():
                    m(self.one_batch(2 + i, g))  # BatchNorm's statistics, its count
            self.ens = vmapens.Ensemble.from_modules(self.models, **spec["ens_kw"])
            self.models = [copy.deepcopy(m) for m in self.models]  # from_modules copies them
        else:
            self.ens = self.build(spec["seed"])
            self.models = self.ens.unstack()
        self.make_opts()
        if spec["late_double"]:  # the optimizer built before .double(), as torch allows
            self.ens.double()
            for m in self.models:
                m.double()
            self.dtype = torch.float64  # for the ensembles built later
        self.sched_kind = spec["sched"]
        self.make_scheds()
        self.steps: dict[Any, Callable] = {}
        self.data = torch.Generator().manual_seed(spec["seed"])

    # builders used at the start and by the round trips
    def factories(self) -> list[Callable[[], nn.Module]] | Callable[[], nn.Module]:
        """Members of one size: one factory; of several (``widths``): one per member."""
        widths = self.origin
        if widths is None:
            return lambda: self.cls().to(self.dtype)
        return [
            functools.partial(lambda h: self.cls(h).to(self.dtype), widths[r]) for r in self.rows
        ]

    def build(self, seed: int) -> vmapens.Ensemble:
        """A new ensemble like this one's (other initial values), padded as this one is."""
        if self.origin is None:
            return vmapens.Ensemble(self.factories(), n=self.n, seed=seed, **self.spec["ens_kw"])
        made = [functools.partial(lambda h: self.cls(h).to(self.dtype), h) for h in self.origin]
        full = vmapens.Ensemble.from_factories(made, seed=seed, **self.spec["ens_kw"])
        return full.select(self.rows)

    def make_opts(self) -> None:
        held = self.spec["held_out"]  # a parameter added later with add_param_group, or None
        self.opt = stacked(self.torch_cls)(
            self.ens if held is None and self.spec["seed"] % 2  # over the Ensemble, as README's
            else [p for k, p in self.ens.named_parameters() if k != held], **self.opt_kwargs
        )  # fmt: skip
        self.opts = [
            self.torch_cls([p for k, p in m.named_parameters() if k != held],
                           **member_kwargs(self.opt_kwargs, i))
            for i, m in enumerate(self.models)
        ]  # fmt: skip
        self.steps = {}
        self.group_added = False

    def stacked_opt(self, ens: vmapens.Ensemble) -> vmapens.StackedOptimizer:
        """A new stacked optimizer over ``ens`` with the param groups of ``self.opt``."""
        held = self.spec["held_out"]
        opt = stacked(self.torch_cls)(
            [p for k, p in ens.named_parameters() if k != held], **self.opt_kwargs
        )
        if self.group_added:
            opt.add_param_group({"params": [ens.stacked_params()[held]]})
        return opt

    def make_scheds(self) -> None:
        self.sched_stepped = False  # torch warns on a scheduler step before any optimizer step
        if self.sched_kind is None:
            self.sched, self.scheds = None, []
            return
        self.sched = SCHEDULERS[self.sched_kind](self.opt)
        self.scheds = [SCHEDULERS[self.sched_kind](o) for o in self.opts]

    # data
    def one_batch(self, rows: int, g: torch.Generator) -> torch.Tensor:
        if self.cls is Embed:
            return torch.randint(7, (rows, *self.row), generator=g)
        return torch.randn(rows, *self.row, generator=g, dtype=self.dtype)

    def batch(self, rows: int, per_member: bool) -> tuple[torch.Tensor, torch.Tensor]:
        lead = (self.n, rows) if per_member else (rows,)
        if self.cls is Embed:
            x = torch.randint(7, (*lead, *self.row), generator=self.data)
        else:
            x = torch.randn(*lead, *self.row, generator=self.data, dtype=torch.float64)
        y = torch.randn(*lead, 2, generator=self.data, dtype=torch.float64)
        return x, y

    @staticmethod
    def mine(t: torch.Tensor, i: int, per_member: bool) -> torch.Tensor:
        return t[i] if per_member else t

    # the comparison
    def compare(self, where: str) -> None:
        stacked_params = self.ens.stacked_params()
        stacked_buffers = self.ens.stacked_buffers()
        assert self.ens.training == self.models[0].training, where
        for i, m in enumerate(self.models):
            for name, p in m.named_parameters():
                s = stacked_params[name]
                torch.testing.assert_close(
                    corner(s[i], p).detach(),
                    p.detach(),
                    **TOL,
                    msg=lambda e, n=name, i=i: f"{where}: member {i} `{n}`: {e}",
                )
                if s[i].shape != p.shape:  # padded: the rest of the row stays exactly zero
                    rest = s[i].detach().clone()
                    rest[tuple(slice(0, k) for k in p.shape)] = 0
                    assert not rest.any(), f"{where}: member {i} `{name}` padding"
                assert s.requires_grad == p.requires_grad, f"{where}: `{name}` requires_grad"
                assert (s.grad is None) == (p.grad is None), f"{where}: member {i} `{name}`.grad"
                if p.grad is not None:
                    torch.testing.assert_close(
                        corner(s.grad[i], p),
                        p.grad,
                        **TOL,
                        msg=lambda e, n=name, i=i: f"{where}: member {i} `{n}`.grad: {e}",
                    )
            for name, b in m.named_buffers():
                torch.testing.assert_close(
                    corner(stacked_buffers[name][i], b),
                    b,
                    **TOL,
                    msg=lambda e, n=name, i=i: f"{where}: member {i} buffer `{n}`: {e}",
                )
            modes = {k: sub.training for k, sub in m.named_modules()}
            assert modes == {k: sub.training for k, sub in self.ens.template.named_modules()}, where
            self.compare_opt(i, where)

    def compare_opt(self, i: int, where: str) -> None:
        ours, theirs = self.opt, self.opts[i]
        assert len(ours.param_groups) == len(theirs.param_groups), where
        for g, h in zip(ours.param_groups, theirs.param_groups, strict=True):
            for key, value in h.items():
                if key == "params" or key not in g:
                    continue
                mine = g[key]
                if isinstance(mine, MemberValues):
                    mine = mine[i]
                if isinstance(value, tuple):
                    mine = tuple(v[i] if isinstance(v, MemberValues) else v for v in mine)
                if isinstance(value, (float, int)) and not isinstance(value, bool):
                    assert math.isclose(float(mine), value, rel_tol=1e-12, abs_tol=1e-15), (
                        f"{where}: member {i} group `{key}`: {mine} != {value}"
                    )
                else:
                    assert mine == value, f"{where}: member {i} group `{key}`: {mine} != {value}"
            for p, q in zip(g["params"], h["params"], strict=True):
                state, truth = ours.state.get(p, {}), theirs.state.get(q, {})
                for key, value in truth.items():
                    if key not in state or value is None:
                        continue  # SGD's: stacked keeps `step`, torch a buffer only with momentum
                    got = corner(state[key][i], value)
                    torch.testing.assert_close(
                        got.to(value.dtype).reshape(value.shape), value, **TOL,
                        msg=lambda e, k=key, i=i: f"{where}: member {i} state `{k}`: {e}",
                    )  # fmt: skip


# -- the calls --------------------------------------------------------------------------------


def op_make_step(
    w: World, rows: int, per_member: bool, mask: list[bool] | None, clip: float | None = None
) -> None:
    key = (per_member, clip)
    if key not in w.steps:
        w.steps[key] = vmapens.make_step(
            w.ens, nn.MSELoss(), w.opt, in_dims=0 if per_member else None, clip_grad_norm=clip
        )
    x, y = w.batch(rows, per_member)
    w.steps[key](x, y, mask=None if mask is None else torch.tensor(mask))
    for i, (m, o) in enumerate(zip(w.models, w.opts, strict=True)):
        m.zero_grad()  # the step sets every `.grad` (in the optimizer or not) anew
        buffers = {k: b.clone() for k, b in m.named_buffers()}
        nn.functional.mse_loss(m(w.mine(x, i, per_member)), w.mine(y, i, per_member)).backward()
        if mask is not None and not mask[i]:
            # A masked member gets its gradient but does not step; its buffers stay.
            for k, b in m.named_buffers():
                b.copy_(buffers[k])
            continue
        if clip is not None:
            nn.utils.clip_grad_norm_(m.parameters(), clip)
        o.step()
    w.sched_stepped = True


def op_manual(w: World, rows: int, per_member: bool, set_to_none: bool, batches: int) -> None:
    """``opt.zero_grad(); loss.sum().backward(); opt.step()``; ``batches`` > 1 accumulates."""
    data = [w.batch(rows, per_member) for _ in range(batches)]
    loss_fn = vmapens.per_member(nn.MSELoss(), in_dims=(0, 0 if per_member else None))
    w.opt.zero_grad(set_to_none=set_to_none)
    for x, y in data:
        out = w.ens(x, in_dims=0) if per_member else w.ens(x)
        loss_fn(out, y).sum().backward()
    w.opt.step()
    for i, (m, o) in enumerate(zip(w.models, w.opts, strict=True)):
        o.zero_grad(set_to_none=set_to_none)
        for x, y in data:
            nn.functional.mse_loss(m(w.mine(x, i, per_member)), w.mine(y, i, per_member)).backward()
        o.step()
    w.sched_stepped = True


def op_step_again(w: World) -> None:
    """``opt.step()`` on the gradients already there (stale, or none)."""
    w.opt.step()
    for o in w.opts:
        o.step()
    w.sched_stepped = True


def op_partial_load(w: World, seed: int, keys: list[str]) -> None:
    """``load_state_dict(strict=False)`` of some keys from another ensemble's."""
    other = w.build(seed).state_dict()
    result = w.ens.load_state_dict({k: other[k] for k in keys}, strict=False)
    for i, m in enumerate(w.models):
        own = m.state_dict()
        truth = m.load_state_dict({k: corner(other[k][i], own[k]) for k in keys}, strict=False)
        assert sorted(result.missing_keys) == sorted(truth.missing_keys)
        assert result.unexpected_keys == truth.unexpected_keys == []


def op_zero_grad(w: World, set_to_none: bool) -> None:
    w.opt.zero_grad(set_to_none=set_to_none)
    for o in w.opts:
        o.zero_grad(set_to_none=set_to_none)


def op_set_hyper(w: World, key: str, values: Any) -> None:
    """``group[key] = value`` between steps: a float shared by all, or one per member (in a
    tuple such as ``betas`` too)."""

    def ours(v: Any) -> Any:
        return (
            tuple(map(ours, v))
            if isinstance(v, tuple)
            else MemberValues(v)
            if isinstance(v, list)
            else v
        )

    for g in w.opt.param_groups:
        g[key] = ours(values)
    for i, o in enumerate(w.opts):
        for g in o.param_groups:
            g[key] = member_kwargs({key: values}, i)[key]


def op_sched_step(w: World) -> None:
    w.sched.step()
    with warnings.catch_warnings():
        # A member masked out of every step so far has not stepped its own optimizer: torch
        # warns, and schedules it as the ensemble schedules that member.
        warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)`")
        for s in w.scheds:
            s.step()


def op_freeze(w: World, names: list[str], flag: bool) -> None:
    """``requires_grad_`` on some parameters, as on a sub-module of the member alone."""
    params = w.ens.stacked_params()
    for name in names:
        params[name].requires_grad_(flag)
    for m in w.models:
        for name in names:
            m.get_parameter(name).requires_grad_(flag)


def op_mode(w: World, train: bool) -> None:
    w.ens.train(train)
    for m in w.models:
        m.train(train)


def op_forward(w: World, rows: int, per_member: bool) -> None:
    """A forward outside the step (updates BatchNorm statistics in train mode, as alone)."""
    x, _ = w.batch(rows, per_member)
    with torch.no_grad():
        out = w.ens(x, in_dims=0) if per_member else w.ens(x)
        for i, m in enumerate(w.models):
            torch.testing.assert_close(out[i], m(w.mine(x, i, per_member)), **TOL)


def _reload(w: World, ens: vmapens.Ensemble) -> None:
    """The ensemble side continues on ``ens`` with a new optimizer and scheduler that load the
    old ones' state dicts, built first and loaded after, as torch recommends. The plain side
    goes on uninterrupted: resuming must be exact (docs/optim.md)."""
    saved = w.opt.state_dict()
    sched = w.sched.state_dict() if w.sched is not None else None
    w.ens, w.steps = ens, {}
    w.opt = w.stacked_opt(ens)
    if sched is not None:
        w.sched = SCHEDULERS[w.sched_kind](w.opt)
    w.opt.load_state_dict(saved)
    if sched is not None:
        w.sched.load_state_dict(sched)
    for m in w.models:  # gradients are not in a state dict: a reloaded module has none
        m.zero_grad()
    # A scheduler never stepped checks that its (new) optimizer stepped before its first step.
    w.sched_stepped = w.sched_stepped and (sched is None or sched["_step_count"] > 1)


def op_predict(w: World, rows: int, batch_size: int | None) -> None:
    """``vmapens.predict``: every member in eval mode, as ``model.eval()`` alone; afterwards
    every submodule in its own mode again (nothing else changes)."""
    x, _ = w.batch(rows, False)
    out = vmapens.predict(w.ens, x, batch_size=batch_size)
    for i, m in enumerate(w.models):
        modes = [s.training for s in m.modules()]
        m.eval()
        with torch.no_grad():
            torch.testing.assert_close(out[i], m(x), **TOL)
        for s, mode in zip(m.modules(), modes, strict=True):
            s.training = mode


def op_opt_roundtrip(w: World) -> None:
    """``opt.state_dict()`` into a new optimizer (and scheduler)."""
    grads = [p.grad for p in w.ens.parameters()]
    plain = [[p.grad for p in m.parameters()] for m in w.models]
    _reload(w, w.ens)
    # Both sides keep the same parameters, and so their gradients.
    for p, g in zip(w.ens.parameters(), grads, strict=True):
        p.grad = g
    for m, gs in zip(w.models, plain, strict=True):
        for p, g in zip(m.parameters(), gs, strict=True):
            p.grad = g


def _same_flags(old: vmapens.Ensemble, ens: vmapens.Ensemble) -> None:
    """Modes and ``requires_grad`` flags set again: a state dict holds tensors only."""
    ens.train(old.training)
    for name, sub in old.template.named_modules():
        ens.template.get_submodule(name).train(sub.training)
    for name, p in old.stacked_params().items():
        ens.stacked_params()[name].requires_grad_(p.requires_grad)


def op_ens_roundtrip(w: World, seed: int, assign: bool = False) -> None:
    """``ens.state_dict()`` into a new Ensemble of other initial values (``assign=True``: its
    tensors become the new ensemble's, as in torch)."""
    ens = w.build(seed)
    sd = w.ens.state_dict()
    ens.load_state_dict({k: v.clone() for k, v in sd.items()} if assign else sd, assign=assign)
    _same_flags(w.ens, ens)
    _reload(w, ens)


def op_deepcopy(w: World) -> None:
    """``copy.deepcopy(ens)`` (as ``torch.save(ens)`` pickles it), trained on from there."""
    ens = copy.deepcopy(w.ens)
    _same_flags(w.ens, ens)
    _reload(w, ens)


def op_save_load(w: World, path: Path) -> None:
    """``vmapens.save`` / ``load`` / ``restore`` with the optimizer's state."""
    vmapens.save(w.ens, path, w.opt)
    sched = w.sched.state_dict() if w.sched is not None else None
    ens = vmapens.load(path, w.factories())
    if w.origin is not None:  # built from the kept members' factories: padded to their largest
        w.origin, w.rows = [w.origin[r] for r in w.rows], list(range(w.n))
    _same_flags(w.ens, ens)
    w.ens, w.steps = ens, {}
    w.opt = w.stacked_opt(ens)
    if sched is not None:
        w.sched = SCHEDULERS[w.sched_kind](w.opt)
    vmapens.restore(path, ens, w.opt)
    if sched is not None:
        w.sched.load_state_dict(sched)
    for m in w.models:
        m.zero_grad()
    w.sched_stepped = w.sched_stepped and (sched is None or sched["_step_count"] > 1)


def op_index(w: World, i: int, how: str, rows: list[int]) -> None:
    """``ens[i]`` (int, numpy int, 0-d tensor) and sub-ensembles; nothing may change."""
    key: Any = {"int": i, "numpy": np.int64(i), "tensor": torch.tensor(i)}[how]
    member = w.ens[key]
    subs = [w.ens.select(rows), w.ens[rows], w.ens[torch.tensor(rows)], w.ens[np.array(rows)]]
    mask = [k in rows for k in range(w.n)]
    by_mask = sorted(rows)  # a mask keeps the members in their order
    checks = [(sub, rows) for sub in subs] + [
        (w.ens[torch.tensor(mask)], by_mask),
        (w.ens.select(np.array(mask)), by_mask),
        (w.ens[min(rows) :], list(range(min(rows), w.n))),
        (w.ens[::-1], list(range(w.n))[::-1]),
    ]
    truth = w.models[i]
    for (name, p), (_, q) in zip(member.named_parameters(), truth.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, **TOL)
        assert p.requires_grad == q.requires_grad, name
    for b, c in zip(member.buffers(), truth.buffers(), strict=True):
        torch.testing.assert_close(b, c, **TOL)
    own, theirs = w.ens.state_dicts()[i], truth.state_dict()
    assert list(own) == list(theirs)  # the member's keys, tied aliases too, in its order
    for k, v in theirs.items():
        torch.testing.assert_close(own[k], v, **TOL)
    assert [s.training for s in member.modules()] == [s.training for s in truth.modules()]
    for sub, rows in checks:
        assert list(sub.member_ids) == [w.ens.member_ids[r] for r in rows]
        for k, r in enumerate(rows):
            for name, t in sub.stacked_state().items():
                own = (
                    w.models[r].get_parameter(name)
                    if name in sub.stacked_params()
                    else w.models[r].get_buffer(name)
                )
                torch.testing.assert_close(corner(t[k], own), own, **TOL)
            for name, p in sub.stacked_params().items():
                assert p.requires_grad == w.models[r].get_parameter(name).requires_grad, name
        assert sub.training == w.ens.training
    with torch.no_grad():  # copies: editing them must leave the ensemble as it is
        for t in [*member.parameters(), *(t for sub in subs for t in sub.stacked_state().values())]:
            t.add_(1)


def _rows_of(v: Any, rows: list[int]) -> Any:
    """A per-member optimizer option (a list, or a pair of them) cut to ``rows``."""
    if isinstance(v, tuple):
        return tuple(_rows_of(x, rows) for x in v)
    return [v[r] for r in rows] if isinstance(v, list) else v


def op_select(w: World, rows: list[int]) -> None:
    """Go on with ``ens.select(rows)`` and new optimizers, as with those modules alone."""
    w.ens, w.models, w.n = w.ens.select(rows), [w.models[r] for r in rows], len(rows)
    w.rows = [w.rows[r] for r in rows]
    w.opt_kwargs = {k: _rows_of(v, rows) for k, v in w.opt_kwargs.items()}
    w.make_opts()
    w.make_scheds()
    for m in w.models:
        m.zero_grad()  # the sub-ensemble's are copies without gradients


def op_select_keep(w: World, rows: list[int], how: str) -> None:
    """Go on with ``ens.select(rows)`` and ``opt.select(rows, sub)`` (or ``best_k`` with the
    optimizer): the kept members continue as their modules alone, uninterrupted."""
    if how == "best_k":
        scores = torch.full((w.n,), 10.0, dtype=torch.float64)
        scores[rows] = torch.arange(len(rows), dtype=torch.float64)  # rows[0] best
        sub, opt = vmapens.selection.best_k(w.ens, scores, len(rows), optimizer=w.opt)
    else:
        sub = w.ens.select(rows)
        # The sub-ensemble, or (documented) its parameters in the optimizer's order where the
        # optimizer holds only some of them, or in another order (a group added later).
        names = {id(p): k for k, p in w.ens.named_parameters()}
        held = [sub.stacked_params()[names[id(p)]] for g in w.opt.param_groups for p in g["params"]]
        same = [id(p) for p in held] == [id(p) for p in sub.parameters()]
        opt = w.opt.select(rows, sub if same else held)
    assert list(sub.member_ids) == [w.ens.member_ids[r] for r in rows]
    w.ens, w.opt, w.steps = sub, opt, {}
    w.models, w.opts, w.n = [w.models[r] for r in rows], [w.opts[r] for r in rows], len(rows)
    w.rows = [w.rows[r] for r in rows]
    w.opt_kwargs = {k: _rows_of(v, rows) for k, v in w.opt_kwargs.items()}
    for m in w.models:
        m.zero_grad()  # the sub-ensemble's are copies without gradients


def op_channels_last(w: World) -> None:
    w.ens.to(memory_format=torch.channels_last)
    for m in w.models:
        m.to(memory_format=torch.channels_last)


def op_add_group(w: World, lr: list[float] | float) -> None:
    """The held-out parameter joins the optimizers as a param group of its own."""
    name = w.spec["held_out"]
    w.opt.add_param_group({"params": [w.ens.stacked_params()[name]],
                           "lr": MemberValues(lr) if isinstance(lr, list) else lr})  # fmt: skip
    for i, (m, o) in enumerate(zip(w.models, w.opts, strict=True)):
        o.add_param_group(
            {"params": [m.get_parameter(name)], "lr": lr[i] if isinstance(lr, list) else lr}
        )
    w.group_added = True


def op_apply(w: World, what: str, seed: int) -> None:
    """``ens.apply(fn)`` as ``model.apply(fn)`` on each module, members in order."""
    fns: dict[str, Callable[[nn.Module], Any]] = {
        "init": lambda m: nn.init.normal_(m.weight, std=0.3) if isinstance(m, nn.Linear) else None,
        "bn_eval": lambda m: m.eval() if isinstance(m, nn.modules.batchnorm._BatchNorm) else None,
        "freeze_linear": lambda m: m.requires_grad_(False) if isinstance(m, nn.Linear) else None,
        "reset_bn": lambda m: (
            m.reset_running_stats() if isinstance(m, nn.modules.batchnorm._BatchNorm) else None
        ),
    }
    torch.manual_seed(seed)
    w.ens.apply(fns[what])
    torch.manual_seed(seed)
    for m in w.models:
        m.apply(fns[what])


# -- programs ---------------------------------------------------------------------------------


def program(seed: int) -> tuple[dict[str, Any], list[tuple[str, dict[str, Any]]]]:
    """The setup and the calls of program ``seed``."""
    r = random.Random(seed)
    n = r.randint(2, 4)
    model = r.choice(sorted(MODELS))
    opt = r.choice(sorted(OPTIMIZERS))
    torch_cls, base, editable = OPTIMIZERS[opt]
    kwargs = dict(base)
    if r.random() < 0.4:  # a sweep: per-member learning rates
        kwargs["lr"] = [base["lr"] * r.choice([0.5, 1.0, 2.0]) for _ in range(n)]
    if "weight_decay" in editable and r.random() < 0.3:
        kwargs["weight_decay"] = [r.choice([0.0, 1e-3, 1e-2]) for _ in range(n)]
    if opt in ("sgd", "sgd_dampening") and r.random() < 0.3:
        kwargs["momentum"] = [r.choice([0.0, 0.5, 0.9]) for _ in range(n)]
    if "betas" in editable and r.random() < 0.3:
        kwargs["betas"] = ([r.choice([0.8, 0.9]) for _ in range(n)], 0.999)
    if r.random() < 0.2:
        kwargs["maximize"] = True
    if torch_cls in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad):
        kwargs.update(r.choice([{}, {}, {"fused": False}, {"foreach": False}]))
    # Adagrad's documented difference: torch creates `sum` at construction, before .double().
    late_double = opt != "adagrad" and r.random() < 0.2
    names = [k for k, _ in MODELS[model][0]().named_parameters()]
    state_keys = list(MODELS[model][0]().state_dict())
    linear = [k for k, m in MODELS[model][0]().named_modules() if isinstance(m, nn.Linear)]
    linear_names = [k for k in names if k.rpartition(".")[0] in linear]
    # StepLR & co. on a group added later: torch's schedulers need `initial_lr` in every group.
    sched = r.choice([None, None, *sorted(SCHEDULERS)])
    widths = None
    if model in ("mlp", "mlp_bn", "mlp_cma") and r.random() < 0.4:
        widths = [r.choice([3, 5, 6]) for _ in range(n)]
    held_out = r.choice(names) if sched is None and r.random() < 0.5 else None
    spec = dict(
        seed=seed,
        n=n,
        model=model,
        opt=opt,
        opt_kwargs=kwargs,
        late_double=late_double,
        sched=sched,
        held_out=held_out,
        # Members of several sizes (Ensemble.from_factories), padded to the largest.
        widths=widths,
        from_modules=widths is None and r.random() < 0.25,
        ens_kw=r.choice([{}, {}, {}, {"chunk_size": 1}, {"backend": "loop"}]),
    )
    has_bn = model in ("mlp_bn", "conv_bn", "mlp_cma")
    frozen: set[str] = set()
    stepped = added = False
    calls: list[tuple[str, dict[str, Any]]] = []
    for _ in range(r.randint(6, LONGEST)):
        kind = r.choices(
            ["step", "manual", "zero_grad", "hyper", "sched", "freeze", "mode", "forward",
             "opt_rt", "ens_rt", "save", "index", "apply", "mask", "clip", "select",
             "channels_last", "add_group", "step_again", "partial_load", "deepcopy",
             "select_keep"],
            weights=[6, 4, 1, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2],
        )[0]  # fmt: skip
        # BatchNorm over 2 rows gives +-1 whatever the input: the layers before it get gradients
        # of the size of its eps, which RMSprop and Adam blow up to steps of lr, round-off too.
        rows = r.choice([3, 5] if has_bn else [2, 3, 5])
        per_member = r.random() < 0.4
        stepped = stepped or kind in ("step", "manual")
        if kind == "step":
            calls.append(("make_step", dict(rows=rows, per_member=per_member, mask=None)))
        elif kind == "clip":
            calls.append(("make_step", dict(rows=rows, per_member=per_member, mask=None,
                                            clip=r.choice([0.05, 0.5, 5.0]))))  # fmt: skip
        elif kind == "select" and n > 1:
            old, n = n, r.randint(1, n)
            calls.append(("select", dict(rows=r.sample(range(old), k=n))))
        elif kind == "select_keep" and sched is None:
            old, n = n, r.randint(1, n)
            calls.append(("select_keep", dict(rows=r.sample(range(old), k=n),
                                              how=r.choice(["select", "best_k"]))))  # fmt: skip
        elif kind == "channels_last" and model == "conv_bn":
            calls.append(("channels_last", {}))
        elif kind == "add_group" and held_out is not None and not added:
            added = True
            lrs = [base["lr"] * r.choice([0.5, 1.0, 2.0]) for _ in range(n)]
            calls.append(("add_group", dict(lr=lrs if r.random() < 0.5 else lrs[0])))
        elif kind == "deepcopy":
            calls.append(("deepcopy", {}))
        elif kind == "step_again":
            calls.append(("step_again", {}))
        elif kind == "partial_load":
            keys = [k for k in state_keys if r.random() < 0.4]
            calls.append(("partial_load", dict(seed=r.randint(100, 999), keys=keys)))
        elif kind == "mask":
            mask = [r.random() < 0.6 for _ in range(n)]
            calls.append(("make_step", dict(rows=rows, per_member=per_member, mask=mask)))
        elif kind == "manual":
            calls.append(("manual", dict(rows=rows, per_member=per_member,
                                         set_to_none=r.random() < 0.5, batches=r.choice([1, 1, 2]))))  # fmt: skip
        elif kind == "zero_grad":
            calls.append(("zero_grad", dict(set_to_none=r.random() < 0.5)))
        elif kind == "hyper":
            key = r.choice(editable)
            choices = {"lr": [base["lr"] * f for f in (0.1, 0.5, 1.0, 1.5)],
                       "weight_decay": [0.0, 5e-3, 1e-2], "momentum": [0.0, 0.45, 0.9],
                       "betas": [0.0, 0.5, 0.9, 0.95]}[key]  # fmt: skip
            if opt == "rmsprop" and key == "momentum" and not stepped:
                # torch's RMSprop makes a momentum buffer at its first step only if momentum > 0
                # then, and later raises without one.
                choices = choices[1:]
            values = (
                [r.choice(choices) for _ in range(n)] if r.random() < 0.5 else r.choice(choices)
            )
            if key == "betas":
                values = (values, r.choice([0.99, 0.999]))
            calls.append(("set_hyper", dict(key=key, values=values)))
        elif kind == "sched" and spec["sched"] is not None:
            calls.append(("sched_step", {}))
        elif kind == "freeze":
            flag = bool(frozen) and r.random() < 0.5
            pool = sorted(frozen) if flag else [k for k in names if k not in frozen]
            chosen = r.sample(pool, k=min(len(pool), r.randint(1, 2)))
            if not flag and len(frozen) + len(chosen) >= len(names):
                continue  # all frozen: make_step raises (nothing to train), as documented
            frozen = frozen - set(chosen) if flag else frozen | set(chosen)
            calls.append(("freeze", dict(names=chosen, flag=flag)))
        elif kind == "mode":
            calls.append(("mode", dict(train=r.random() < 0.5)))
        elif kind == "forward" and r.random() < 0.5:
            calls.append(("forward", dict(rows=rows, per_member=per_member)))
        elif kind == "forward":
            calls.append(("predict", dict(rows=rows, batch_size=r.choice([None, 2]))))
        elif kind == "opt_rt":
            calls.append(("opt_roundtrip", {}))
        elif kind == "ens_rt":
            calls.append(("ens_roundtrip", dict(seed=r.randint(100, 999), assign=r.random() < 0.3)))
        elif kind == "save":
            calls.append(("save_load", {}))
        elif kind == "index":
            k = r.randint(1, n)
            calls.append(("index", dict(i=r.randrange(n), how=r.choice(["int", "numpy", "tensor"]),
                                        rows=r.sample(range(n), k=k))))  # fmt: skip
        elif kind == "apply":
            what = r.choice(
                ["init", "bn_eval", "freeze_linear", "reset_bn"] if has_bn else ["init"]
            )
            if what == "freeze_linear":
                if set(names) <= frozen | set(linear_names):
                    continue
                frozen |= set(linear_names)
            calls.append(("apply", dict(what=what, seed=r.randint(0, 99))))
    return spec, calls


OPS: dict[str, Callable[..., None]] = {
    "make_step": op_make_step,
    "manual": op_manual,
    "zero_grad": op_zero_grad,
    "set_hyper": op_set_hyper,
    "sched_step": op_sched_step,
    "freeze": op_freeze,
    "mode": op_mode,
    "forward": op_forward,
    "opt_roundtrip": op_opt_roundtrip,
    "ens_roundtrip": op_ens_roundtrip,
    "save_load": op_save_load,
    "index": op_index,
    "apply": op_apply,
    "select": op_select,
    "channels_last": op_channels_last,
    "add_group": op_add_group,
    "step_again": op_step_again,
    "partial_load": op_partial_load,
    "deepcopy": op_deepcopy,
    "select_keep": op_select_keep,
    "predict": op_predict,
}


def run(
    spec: dict[str, Any], calls: list[tuple[str, dict[str, Any]]], tmp: Path, verbose: bool = False
) -> None:
    w = World(spec)
    w.compare("after building")
    for k, (name, kw) in enumerate(calls):
        if name == "sched_step" and not w.sched_stepped:
            continue  # torch warns on a scheduler step before the first optimizer step
        if verbose:
            print(k, name, kw)
        kw = {**kw, "path": tmp / f"ens{k}.pt"} if name == "save_load" else kw
        OPS[name](w, **kw)
        w.compare(f"call {k} ({name} {kw})")
        if max(float(p.detach().abs().max()) for m in w.models for p in m.parameters()) > 1e3:
            return  # diverged (SGD with Nesterov, say): it amplifies round-off past TOL


LONGEST = 20  # calls per program at most
SEEDS = range(40)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_call_sequence_matches_members_trained_alone(seed: int, tmp_path: Path) -> None:
    spec, calls = program(seed)
    run(spec, calls, tmp_path)


if __name__ == "__main__":
    import tempfile

    for s in map(int, sys.argv[1:]):
        spec, calls = program(s)
        print(spec)
        with tempfile.TemporaryDirectory() as d:
            run(spec, calls, Path(d), verbose=True)


# -- what the programs found, one test each -------------------------------------------------


def _bn_pair() -> tuple[vmapens.Ensemble, list[nn.Module], dict[str, torch.Tensor]]:
    """A trained BatchNorm ensemble, its members alone, and another ensemble's state dict."""
    ens = vmapens.Ensemble(lambda: MLPBN().double(), n=3, seed=0)
    with torch.no_grad():
        ens(torch.randn(4, 3, dtype=torch.float64))  # num_batches_tracked 1
    return ens, ens.unstack(), vmapens.Ensemble(lambda: MLPBN().double(), n=3, seed=1).state_dict()


def test_a_state_dict_without_num_batches_tracked_loads_as_into_each_member_alone() -> None:
    # A state dict without `_metadata` (a dict comprehension drops it) reads as BatchNorm's
    # version 1, which had no num_batches_tracked: torch's loader keeps the layer's count
    # instead of calling it missing. The ensemble used to refuse it with strict=True.
    ens, alone, other = _bn_pair()
    sd = {k: v for k, v in other.items() if k != "bn.num_batches_tracked"}
    ens.load_state_dict(sd)
    for i, m in enumerate(alone):
        m.load_state_dict({k: v[i] for k, v in sd.items()})
        for k, v in m.state_dict().items():
            torch.testing.assert_close(ens.state_dict()[k][i], v, rtol=0, atol=0)
    part = {k: other[k] for k in ("fc1.weight", "bn.running_mean")}
    assert sorted(ens.load_state_dict(part, strict=False).missing_keys) == sorted(
        alone[0].load_state_dict({k: v[0] for k, v in part.items()}, strict=False).missing_keys
    )


def test_a_state_dict_of_batchnorm_version_2_without_num_batches_tracked_is_refused() -> None:
    # With the member's own `_metadata` (version 2) the key is missing, for torch as for us.
    ens, alone, other = _bn_pair()
    member_sd = alone[0].state_dict()
    sd = OrderedDict((k, v) for k, v in other.items() if k != "bn.num_batches_tracked")
    sd._metadata = member_sd._metadata  # type: ignore[attr-defined]
    del member_sd["bn.num_batches_tracked"]
    with pytest.raises(RuntimeError, match="num_batches_tracked"):
        alone[0].load_state_dict(member_sd)
    before = ens.state_dict()
    with pytest.raises(RuntimeError, match="num_batches_tracked"):
        ens.load_state_dict(sd)
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k  # all or nothing


@pytest.mark.parametrize(
    "scores, mode",
    [
        ([math.nan, math.inf, 0.5], "min"),
        ([math.nan, -math.inf, 0.5], "max"),
        ([math.inf, math.nan, -math.inf, 0.5, math.nan], "min"),
        ([0.3, 0.1, 0.3, math.nan], "max"),
    ],
)
def test_best_k_ranks_nan_scores_last_after_infinite_ones(scores: list[float], mode: str) -> None:
    # Documented: best first, ties in row order, NaN last. A NaN used to tie with an
    # infinitely bad score and could come first by its row.
    ens = vmapens.Ensemble(lambda: nn.Linear(2, 1), n=len(scores), seed=0)
    sign = 1 if mode == "min" else -1
    truth = sorted(
        range(len(scores)),
        key=lambda r: (
            math.isnan(scores[r]),
            sign * scores[r] if not math.isnan(scores[r]) else 0,
            r,
        ),
    )
    for k in range(1, len(scores) + 1):
        sub = vmapens.selection.best_k(ens, torch.tensor(scores), k, mode=mode)
        assert list(sub.member_ids) == truth[:k]


@pytest.mark.parametrize("held", ["head only", "reordered"])
def test_best_k_hands_on_an_optimizer_over_some_parameters_or_in_another_order(held: str) -> None:
    # best_k(optimizer=...) passed the sub-ensemble itself to opt.select, which needs the
    # optimizer's parameters in its order: an optimizer over the head only (a frozen body left
    # out) or with a group added later raised. The kept members now go on as alone.
    ens = vmapens.Ensemble(lambda: MLP().double(), n=3, seed=0)
    models = ens.unstack()

    def chosen(named: Any) -> list[torch.Tensor]:
        params = dict(named)
        return [params["fc2.weight"], params["fc2.bias"]] + (
            [params["fc1.bias"], params["fc1.weight"]] if held == "reordered" else []
        )

    opt = torch.optim.SGD  # the twin pair: StackedSGD and torch's
    ours = stacked(opt)(chosen(ens.named_parameters()), lr=[0.1, 0.05, 0.2], momentum=0.9)
    theirs = [
        opt(chosen(m.named_parameters()), lr=lr, momentum=0.9)
        for m, lr in zip(models, [0.1, 0.05, 0.2])
    ]
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 3, generator=g, dtype=torch.float64),
                torch.randn(4, 2, generator=g, dtype=torch.float64)) for _ in range(4)]  # fmt: skip
    loss = vmapens.per_member(nn.MSELoss())
    for k, (x, y) in enumerate(batches):
        if k == 2:  # keep members 2 and 0, best first
            ens, ours = vmapens.selection.best_k(
                ens, torch.tensor([1.0, 3.0, 0.0]), 2, optimizer=ours
            )
            models, theirs = [models[2], models[0]], [theirs[2], theirs[0]]
        ours.zero_grad()
        loss(ens(x), y).sum().backward()
        ours.step()
        for m, o in zip(models, theirs, strict=True):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
    for i, m in enumerate(models):
        for name, p in m.named_parameters():
            torch.testing.assert_close(ens.stacked_params()[name][i], p, **TOL)


def test_a_state_dict_value_that_cannot_be_copied_loads_nothing_and_names_the_key() -> None:
    # A value torch cannot copy (on the meta device) failed after the keys before it were
    # copied, with a bare NotImplementedError. Now nothing changes and the error is torch's
    # loader's, naming the key, as for the member alone.
    ens, alone, other = _bn_pair()
    sd = dict(other)
    sd["fc2.bias"] = torch.empty_like(sd["fc2.bias"], device="meta")
    with pytest.raises(RuntimeError, match='While copying the parameter named "fc2.bias"'):
        alone[0].load_state_dict({k: v[0] for k, v in sd.items()})
    before = ens.state_dict()
    for strict in (True, False):
        with pytest.raises(RuntimeError, match='While copying the parameter named "fc2.bias"'):
            ens.load_state_dict(sd, strict=strict)
        for k, v in ens.state_dict().items():
            assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("chunk_size", [None, 1])
def test_the_steps_grads_are_laid_out_as_their_parameters_as_backward_leaves_them(
    chunk_size: int | None,
) -> None:
    # autograd.grad gives a member Linear's weight gradient transposed (from a batched
    # matmul); loss.backward() leaves `.grad` with its parameter's strides, which
    # `p.grad.view(-1)` and a later backward into a kept `.grad` rely on (torch warns "grad
    # and param do not obey the gradient layout contract" otherwise).
    def mlp() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()

    ens = vmapens.Ensemble(mlp, n=2, seed=0, chunk_size=chunk_size)
    opt = vmapens.StackedSGD(ens.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 4, generator=g, dtype=torch.float64)
    y = torch.randn(5, 2, generator=g, dtype=torch.float64)
    vmapens.make_step(ens, nn.MSELoss(), opt)(x, y)
    for name, p in ens.stacked_params().items():
        assert p.grad is not None and p.grad.stride() == p.stride(), name
        p.grad.view(-1)
    opt.zero_grad(set_to_none=False)
    nn.functional.mse_loss(ens(x), y.expand(2, 5, 2), reduction="sum").backward()  # no warning
