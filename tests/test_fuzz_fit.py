"""Seeded random ``fit`` configurations against N plain modules trained by a plain loop.

Each case draws a valid ``vmapens.fit`` configuration (float64, N = 2..4): tensor data (shared,
per member with ``in_dims=0``, bagged with ``bootstrap=True``, both), a ``DataLoader``
(shuffling from torch's global RNG or from its own ``generator=``, ``drop_last``), one
DataLoader per member, a list of batches, or a DataLoader over an ``IterableDataset`` that
draws its order from the global RNG; batch sizes, ``shuffle``, ``epochs``, ``steps``, ``seed``
or none; validation data (shared, per member, out-of-bag) with a metric, early stopping on the
loss or the metric, with or without best-epoch restore; a loss; a stacked optimizer with
shared or per-member hyperparameters (lists or tensors), given as a class, a factory or built;
gradient clipping; an LR scheduler (torch's, or ``vmapens.optim.ReduceLROnPlateau``) per epoch
or per step, given as a builder or built; a callback that stops a member; a member whose loss
overflows; the ``loop`` backend or ``chunk_size=1``; an ensemble in eval mode. Then one of: a
single call, two calls in a row (the second continuing with the same modules and, when built,
the same optimizer and scheduler), a checkpointed run interrupted (at a step, in a callback
before the checkpoint, in a plain callable after it) and resumed in a new process or on the
same objects, or a checkpointed run extended by a second call (and the same call repeated).
The models: an MLP, one with BatchNorm, one with Dropout in training mode
(``randomness="same"``: every member draws the mask it would draw alone from the same RNG
state, as ``torch.func.vmap`` documents; docs/semantics.md, "Randomness in the forward pass").

The truth is the loop a user writes from docs/fit.md: each member a plain module with its own
``torch.optim`` optimizer and scheduler, the batches chosen by the documented recipe
(``tests/truth.py``: ``derived_seed``, ``resample``) or by iterating the same DataLoader, the
mean step loss per epoch, eval-mode validation under ``no_grad``, patience counted per member,
best-epoch state given back at the end. Final parameters and buffers, the modes and the
History's documented fields are compared member by member; a resumed or extended run must
also equal the uninterrupted run bit for bit, its CSV log included.

Run more seeds by hand: ``python tests/test_fuzz_fit.py 0 1000`` runs seeds 0..999 and prints
the failures (``OMP_NUM_THREADS=1`` is faster on a busy machine); ``python
tests/test_fuzz_fit.py 17`` prints seed 17's configuration and runs it.
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import models
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from truth import TOL64, assert_bit_identical, derived_seed, resample, search

import vmapens
from vmapens.callbacks import CSVLogger, EarlyStopping, LRScheduler
from vmapens.optim import stacked

# -- the members ------------------------------------------------------------------------------


MLP, MLPBN, MLPDropout = models.TanhMLP, models.TanhBN, models.TanhDropout
MODELS: dict[str, type[nn.Module]] = {"mlp": MLP, "mlp_bn": MLPBN, "dropout": MLPDropout}

LOSSES: dict[str, Callable[[], nn.Module]] = {
    "mse": nn.MSELoss,
    "l1": nn.L1Loss,
    "huber": lambda: nn.HuberLoss(delta=0.5),
    "smooth_l1": lambda: nn.SmoothL1Loss(beta=0.3),
    "ce": nn.CrossEntropyLoss,
    "ce_smooth": lambda: nn.CrossEntropyLoss(label_smoothing=0.2),
}

#: name -> (torch class, hyperparameters: name -> choices for a shared value)
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, list[Any]]]] = {
    "adam": (torch.optim.Adam, dict(lr=[1e-2, 3e-2], weight_decay=[0.0, 1e-2])),
    "adamw": (torch.optim.AdamW, dict(lr=[1e-2, 2e-2], weight_decay=[1e-2, 0.1])),
    "sgd": (torch.optim.SGD, dict(lr=[0.05, 0.1], momentum=[0.0, 0.9], weight_decay=[0.0, 1e-3])),
    "rmsprop": (torch.optim.RMSprop, dict(lr=[1e-2, 5e-3], momentum=[0.0, 0.5])),
    "adagrad": (torch.optim.Adagrad, dict(lr=[0.05, 0.1])),
    "nadam": (torch.optim.NAdam, dict(lr=[1e-2, 2e-2])),
}

SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "exponential": lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.8),
    "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1.0 / (1 + e)),
    "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=4, eta_min=1e-3),
    # torch's, member by member; the ensemble's is vmapens.optim.ReduceLROnPlateau (below)
    "plateau": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, factor=0.5, patience=0),
}


def ensemble_scheduler(name: str) -> Callable[[torch.optim.Optimizer], Any]:
    """The scheduler builder ``fit`` gets for ``SCHEDULERS[name]``."""
    if name == "plateau":  # one record per member, stepped on each member's validation loss
        return lambda o: vmapens.optim.ReduceLROnPlateau(o, factor=0.5, patience=0)
    return SCHEDULERS[name]


#: data kinds with bootstrap=True, and those with one slice per member (in_dims=0)
BAGGED = ("bootstrap", "member_boot")
PER_MEMBER = ("per_member", "member_boot", "member_loaders")
#: data kinds given as re-iterables of batches (fit's ``batch_size`` and ``shuffle`` unused)
LOADERS = ("loader", "loader_gen", "member_loaders", "batch_list", "iterable")

# -- a configuration --------------------------------------------------------------------------


def draw(seed: int) -> dict[str, Any]:
    """A random, valid fit configuration (and how to run it) from ``seed``."""
    r = random.Random(seed)
    s: dict[str, Any] = dict(seed=seed, model=r.choice(list(MODELS)), n=r.randint(2, 4))
    s["rows"] = r.randint(4, 11)
    s["data"] = r.choice(
        [
            "tensor",
            "tensor",
            "loader",
            "loader_gen",
            "per_member",
            "bootstrap",
            "member_boot",
            "member_loaders",
            "batch_list",
            "iterable",
        ]  # fmt: skip
    )
    loader = s["data"] in LOADERS
    s["batch_size"] = r.choice([None, 1, 2, 3, 4, 5, 16] if not loader else [1, 2, 3, 4, 5])
    s["shuffle"] = r.random() < 0.7
    s["drop_last"] = loader and r.random() < 0.3 and s["batch_size"] <= s["rows"]
    if s["model"] == "mlp_bn":
        # BatchNorm refuses a training batch of one row, alone too; on two rows it outputs
        # +-1 whatever its input, so the layer before it gets round-off for a gradient, which
        # Adam-like rules turn into steps of noise (docs/semantics.md, "What differs").
        b = s["rows"] if s["batch_size"] is None else min(s["batch_size"], s["rows"])
        if b < 3 or (s["rows"] % b in (1, 2) and not s["drop_last"]):
            s["batch_size"], s["rows"] = r.choice([(3, 9), (4, 8), (5, 10), (16, 6)])
            s["drop_last"] = s["drop_last"] and s["batch_size"] <= s["rows"]
        if s["data"] in BAGGED:  # a resample repeats rows: a batch of two distinct ones is rare
            s["batch_size"], s["rows"] = None, r.randint(8, 11)
    s["epochs"] = r.randint(1, 3)
    s["steps"] = r.choice([None, None, None, 1, 2, 3, 5])
    s["loss"] = r.choice(list(LOSSES))
    s["opt"] = r.choice(list(OPTIMIZERS))
    _, choices = OPTIMIZERS[s["opt"]]
    hyper: dict[str, Any] = {}
    for k, values in choices.items():
        if r.random() < 0.4:  # one value per member
            hyper[k] = [r.choice(values) * r.choice([0.5, 1.0, 2.0]) for _ in range(s["n"])]
        elif r.random() < 0.7:
            hyper[k] = r.choice(values)
    s["diverge"] = r.randrange(s["n"]) if s["opt"] == "sgd" and r.random() < 0.3 else None
    if s["diverge"] is not None:  # one member's loss overflows: it stops, the others go on
        lr = hyper.get("lr", 0.05)
        hyper["lr"] = [1e300 if i == s["diverge"] else lr[i] if isinstance(lr, list) else lr
                       for i in range(s["n"])]  # fmt: skip
    s["hyper"] = hyper
    s["opt_given"] = r.choice(["class", "factory", "built"])
    s["clip"] = r.choice([None, None, ("norm", 0.3), ("value", 0.05)])
    s["sched"] = r.choice([None, None, *SCHEDULERS])
    s["interval"] = r.choice(["epoch", "step"])
    s["sched_given"] = r.choice(["builder", "object"]) if s["opt_given"] == "built" else "builder"
    s["val"] = r.choice(
        [None, "shared", "shared", "per_member"] + (["oob"] if s["data"] in BAGGED else [])
    )
    if s["sched"] == "plateau" and s["val"] is None:
        s["sched"] = None
    if s["sched"] == "plateau":
        s["interval"] = "epoch"  # it steps on the validation loss, once an epoch
    s["metric"] = s["val"] == "shared" and r.random() < 0.5
    s["monitor"] = s["metric"] and r.random() < 0.5
    s["stop_at"] = (r.randint(0, 2), r.randrange(s["n"])) if r.random() < 0.25 else None
    s["patience"] = r.choice([None, 1, 2]) if s["val"] else None
    s["restore_best"] = r.random() < 0.6
    s["early_via"] = r.choice(["patience", "callback"])
    # Only where the order does not depend on it: a DataLoader's order comes from its RNG.
    s["fit_seed"] = None if loader and r.random() < 0.5 else r.randint(0, 2**31)
    s["mode"] = r.choice(["once", "once", "twice", "resume", "resume_here", "extend"])
    s["interrupt"] = r.randint(1, 12)  # the step a resumed run's first attempt stops after
    # ... or the epoch (of 0..2): in a Callback (before the checkpoint is written) or in a
    # plain callable (after it)
    s["interrupt_in"] = r.choice(["step", "step", "callback", "observer"])
    s["more_epochs"] = r.randint(1, 2)  # a second call's (or an extended run's) epochs
    s["global_seed"] = r.randint(0, 2**31)
    s["eval_mode"] = r.random() < 0.15  # fit trains in the mode the ensemble is in
    s["hyper_tensor"] = r.random() < 0.3  # one value per member as a 1-D tensor, not a list
    s["backend"] = r.choice([{}, {}, {}, {"backend": "loop"}, {"chunk_size": 1}])
    return s


def make_data(s: dict[str, Any]) -> dict[str, Any]:
    """Training and validation tensors, from the configuration's seed."""
    g = torch.Generator().manual_seed(s["seed"])
    n, rows = s["n"], s["rows"]
    lead = (n, rows) if s["data"] in PER_MEMBER else (rows,)
    x = torch.randn(*lead, 3, generator=g, dtype=torch.float64)
    classes = s["loss"].startswith("ce")

    def targets(*shape: int) -> torch.Tensor:
        if classes:
            return torch.randint(2, shape, generator=g)
        return torch.randn(*shape, 2, generator=g, dtype=torch.float64)

    y = targets(*lead)
    vlead = (n, 5) if s["val"] == "per_member" else (5,)
    xv = torch.randn(*vlead, 3, generator=g, dtype=torch.float64)
    val = (xv, targets(*vlead)) if s["val"] in ("shared", "per_member") else s["val"]
    return dict(x=x, y=y, val=val, classes=classes)


def metric(classes: bool) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A validation metric of one member's output: accuracy, or the mean absolute error."""
    if classes:
        return lambda out, y: (out.argmax(-1) == y).double().mean()
    return lambda out, y: (out - y).abs().mean()


class Rows(torch.utils.data.IterableDataset):
    """Rows of ``(x, y)``, in an order drawn from torch's global RNG at every pass."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, shuffle: bool) -> None:
        self.x, self.y, self.shuffle = x, y, shuffle

    def __iter__(self) -> Any:
        order = torch.randperm(len(self.x)) if self.shuffle else torch.arange(len(self.x))
        return iter([(self.x[k], self.y[k]) for k in order])


def loaders(s: dict[str, Any], d: dict[str, Any]) -> Any:
    """The DataLoader(s) of a configuration, new ones each call (their generators fresh)."""

    def one(x: torch.Tensor, y: torch.Tensor, k: int) -> DataLoader:
        own = s["data"] != "loader"  # member loaders always: the draws' interleaving is ours
        g = torch.Generator().manual_seed(s["seed"] * 10 + k) if own else None
        return DataLoader(
            TensorDataset(x, y),
            batch_size=s["batch_size"],
            shuffle=s["shuffle"],
            drop_last=s["drop_last"],
            generator=g,
        )

    if s["data"] == "member_loaders":
        return [one(d["x"][i], d["y"][i], i) for i in range(s["n"])]
    if s["data"] == "iterable":  # no length; shuffles from the global RNG as it starts
        return DataLoader(Rows(d["x"], d["y"], s["shuffle"]), batch_size=s["batch_size"],
                          drop_last=s["drop_last"])  # fmt: skip
    if s["data"] == "batch_list":  # a list of batches: re-iterable, in its own order
        b = s["batch_size"]
        return [(d["x"][k : k + b], d["y"][k : k + b]) for k in range(0, s["rows"], b)]
    return one(d["x"], d["y"], 0)


# -- the truth: a plain loop over N modules ----------------------------------------------------


class PlainData:
    """Where a plain loop stands in the data, from docs/fit.md ("Data, epochs and steps",
    "Bagging"): the batches of member ``i`` at each step."""

    def __init__(self, s: dict[str, Any], d: dict[str, Any], data: Any, seed: int | None) -> None:
        self.s, self.d, self.data, self.seed = s, d, data, seed
        self.pass_, self.pos = 0, 0
        self.its: list[Any] | None = None
        rows = s["rows"]
        if s["data"] in BAGGED:
            assert seed is not None
            self.boot = [resample(rows, seed, i) for i in range(s["n"])]

    def _tensor_batch(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        s, rows = self.s, self.s["rows"]
        b = rows if s["batch_size"] is None else min(s["batch_size"], rows)
        starts = list(range(0, rows, b))
        if self.pos >= len(starts):
            return None
        order = torch.arange(rows)
        if s["shuffle"] and len(starts) > 1:
            assert self.seed is not None
            g = torch.Generator().manual_seed(derived_seed(self.seed, "shuffle", self.pass_))
            order = torch.randperm(rows, generator=g)
        idx = order[starts[self.pos] : starts[self.pos] + b]
        x, y = self.d["x"], self.d["y"]
        if s["data"] == "per_member":
            return [(x[i][idx], y[i][idx]) for i in range(s["n"])]
        if s["data"] == "bootstrap":
            return [(x[self.boot[i][idx]], y[self.boot[i][idx]]) for i in range(s["n"])]
        if s["data"] == "member_boot":
            return [(x[i][self.boot[i][idx]], y[i][self.boot[i][idx]]) for i in range(s["n"])]
        return [(x[idx], y[idx])] * s["n"]

    def _loader_batch(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        sources = self.data if self.s["data"] == "member_loaders" else [self.data]
        if self.its is None:
            self.its = [iter(src) for src in sources]
        got = [next(it, None) for it in self.its]
        if got[0] is None:
            self.its = None
            return None
        if len(got) == 1:
            return [tuple(got[0])] * self.s["n"]  # type: ignore[list-item]
        return [tuple(b) for b in got]  # type: ignore[misc]

    def in_pass(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        tensors = self.s["data"] in ("tensor", "per_member", *BAGGED)
        batch = self._tensor_batch() if tensors else self._loader_batch()
        if batch is None:
            self.pass_, self.pos = self.pass_ + 1, 0
        else:
            self.pos += 1
        return batch

    def cycling(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        batch = self.in_pass()
        if batch is None:
            batch = self.in_pass()
        assert batch is not None
        return batch


def member_hyper(hyper: dict[str, Any], i: int) -> dict[str, Any]:
    return {k: v[i] if isinstance(v, list) else v for k, v in hyper.items()}


class Plain:
    """N plain modules with their own torch optimizers and schedulers, trained by a plain loop."""

    def __init__(self, s: dict[str, Any], models: list[nn.Module]) -> None:
        self.s, self.models = s, models
        self.opts: list[torch.optim.Optimizer] = []
        self.scheds: list[Any] = []
        self.new_optimizers()

    def new_optimizers(self) -> None:
        cls, _ = OPTIMIZERS[self.s["opt"]]
        self.opts = [
            cls(m.parameters(), **member_hyper(self.s["hyper"], i))
            for i, m in enumerate(self.models)
        ]
        self.scheds = []

    def validate(self, d: dict[str, Any], stream: PlainData) -> tuple[list[float], Any]:
        """Each member's validation loss in eval mode under no_grad, and its outputs."""
        s, loss_fn = self.s, LOSSES[self.s["loss"]]()
        vals, outs = [], []
        for i, m in enumerate(self.models):
            if s["val"] == "oob":
                drawn = torch.zeros(s["rows"], dtype=torch.bool)
                drawn[stream.boot[i]] = True
                x, y = (d["x"][i], d["y"][i]) if s["data"] in PER_MEMBER else (d["x"], d["y"])
                xv, yv = x[~drawn], y[~drawn]
            elif s["val"] == "per_member":
                xv, yv = d["val"][0][i], d["val"][1][i]
            else:
                xv, yv = d["val"]
            mode = m.training
            m.eval()
            with torch.no_grad():
                out = m(xv)
                vals.append(float(loss_fn(out, yv)) if len(xv) else math.nan)
            m.train(mode)
            outs.append(out)
        return vals, outs

    def fit(self, d: dict[str, Any], data: Any, epochs: int, seed: int | None) -> dict[str, Any]:
        """One ``fit`` call, written from docs/fit.md; returns the History's fields."""
        s, n = self.s, self.s["n"]
        loss_fn = LOSSES[s["loss"]]()
        if s["sched"] and (s["sched_given"] == "builder" or not self.scheds):
            self.scheds = [SCHEDULERS[s["sched"]](o) for o in self.opts]
        stream = PlainData(s, d, data, seed)
        active = [True] * n
        stopped = [-1] * n
        best_epoch = [-1] * n
        best_val = [math.inf] * n
        bad = [0] * n
        bad_step, diverged = [False] * n, [False] * n
        validated = d["val"] is not None
        restore = validated and s["restore_best"]
        best = [copy.deepcopy(m.state_dict()) for m in self.models] if restore else None
        sign = -1.0 if s["monitor"] and d["classes"] else 1.0  # accuracy: higher is better
        score = metric(d["classes"])
        rows: list[list[float]] = []
        val_rows: list[list[float]] = []
        metric_rows: list[list[float]] = []
        whole_rows: list[float] = []
        for epoch in range(epochs):
            if not any(active):
                break
            summed, count = [0.0] * n, 0
            while s["steps"] is None or count < s["steps"]:
                batch = stream.cycling() if s["steps"] is not None else stream.in_pass()
                if batch is None:
                    break
                start, after = torch.get_rng_state(), None
                for i, (m, opt) in enumerate(zip(self.models, self.opts, strict=True)):
                    if not active[i]:
                        continue
                    torch.set_rng_state(start)  # randomness="same": the draw alone
                    x, y = batch[i]
                    opt.zero_grad()
                    loss = loss_fn(m(x), y)
                    after = torch.get_rng_state()
                    loss.backward()
                    if s["clip"] is not None:
                        kind, c = s["clip"]
                        if kind == "norm":
                            nn.utils.clip_grad_norm_(m.parameters(), c)
                        else:
                            nn.utils.clip_grad_value_(m.parameters(), c)
                    opt.step()
                    summed[i] += float(loss.detach())
                    if not math.isfinite(float(loss.detach())):
                        active[i], bad_step[i] = False, True  # frozen after this step
                if after is not None:
                    torch.set_rng_state(after)
                if s["interval"] == "step":
                    for sch in self.scheds:
                        sch.step()
                count += 1
            running = [e == -1 for e in stopped]
            # The epoch's mean where it diverged is not finite (fit adds the frozen member's
            # later losses too): marked inf, compared as "not finite".
            rows.append([math.inf if running[i] and bad_step[i] else
                         summed[i] / count if running[i] else math.nan for i in range(n)])  # fmt: skip
            for i in range(n):
                if running[i] and bad_step[i]:
                    diverged[i], stopped[i] = True, epoch
            bad_step = [False] * n
            if validated:
                vals, outs = self.validate(d, stream)
                scored = [running[i] and not diverged[i] for i in range(n)]  # not its bad epoch
                vals = [v if scored[i] else math.nan for i, v in enumerate(vals)]
                val_rows.append(vals)
                watched = vals
                if s["metric"]:
                    yv = d["val"][1]
                    scores = [float(score(o, yv)) if scored[i] else math.nan
                              for i, o in enumerate(outs)]  # fmt: skip
                    metric_rows.append(scores)
                    kept = [o for o, gone in zip(outs, diverged, strict=True) if not gone]
                    mean = torch.stack(kept or outs).mean(0)  # without the diverged members
                    whole_rows.append(float(score(mean, yv)))
                    watched = scores if s["monitor"] else vals
                for i in range(n):
                    if active[i] and sign * watched[i] < best_val[i]:
                        best_val[i], best_epoch[i], bad[i] = sign * watched[i], epoch, 0
                        if best is not None:
                            best[i] = copy.deepcopy(self.models[i].state_dict())
                    else:
                        bad[i] += 1
                    if s["patience"] is not None and active[i] and bad[i] >= s["patience"]:
                        active[i], stopped[i] = False, epoch
            if s["sched"] == "plateau":
                for i, sch in enumerate(self.scheds):
                    sch.step(val_rows[-1][i])
            elif s["interval"] == "epoch":
                for sch in self.scheds:
                    sch.step()
            if s["stop_at"] is not None and s["stop_at"][0] == epoch:
                j = s["stop_at"][1]
                if active[j]:
                    active[j], stopped[j] = False, epoch
        if best is not None:
            for i, m in enumerate(self.models):
                if best_epoch[i] >= 0:
                    m.load_state_dict(best[i])
        out: dict[str, Any] = dict(
            train_loss=torch.tensor(rows, dtype=torch.float64).reshape(-1, n),
            val_loss=None,
            best_epoch=torch.tensor(best_epoch),
            stopped_epoch=torch.tensor(stopped),
            diverged=diverged,
        )
        if validated:
            out["val_loss"] = torch.tensor(val_rows, dtype=torch.float64).reshape(-1, n)
        if s["metric"]:
            out["metric"] = torch.tensor(metric_rows, dtype=torch.float64).reshape(-1, n)
            out["whole"] = torch.tensor(whole_rows, dtype=torch.float64)
        return out


# -- the ensemble side -------------------------------------------------------------------------


class Interrupt(vmapens.Callback):
    """Stops the run after optimizer step ``at`` (a crash, a pre-empted job), or at the end
    of epoch ``at`` with ``epoch=True``."""

    def __init__(self, at: int, epoch: bool = False) -> None:
        self.at, self.epoch = at, epoch

    def on_step_end(self, ctx: vmapens.callbacks.Context) -> None:
        if not self.epoch and ctx.step == self.at:
            raise KeyboardInterrupt

    def on_epoch_end(self, ctx: vmapens.callbacks.Context) -> None:
        if self.epoch and ctx.epoch == self.at:
            raise KeyboardInterrupt


def interrupt(s: dict[str, Any]) -> Any:
    """The interrupting callback of configuration ``s``."""
    if s["interrupt_in"] == "observer":

        def stop(history: vmapens.History) -> None:
            if history.epochs == 1 + s["interrupt"] % 3:
                raise KeyboardInterrupt

        return stop
    if s["interrupt_in"] == "callback":
        return Interrupt(s["interrupt"] % 3, epoch=True)
    return Interrupt(s["interrupt"])


def build(s: dict[str, Any]) -> vmapens.Ensemble:
    randomness = "same" if s["model"] == "dropout" else "different"
    cls = MODELS[s["model"]]
    ens = vmapens.Ensemble(lambda: cls().double(), n=s["n"], seed=s["seed"],
                           randomness=randomness, **s.get("backend", {}))  # fmt: skip
    return ens.train(not s.get("eval_mode", False))


class StopMember(vmapens.Callback):
    """Stops member ``member`` at the end of epoch ``epoch`` (``Context.stop``)."""

    def __init__(self, epoch: int, member: int) -> None:
        self.epoch, self.member = epoch, member

    def on_epoch_end(self, ctx: vmapens.callbacks.Context) -> None:
        if ctx.epoch == self.epoch:
            ctx.stop([self.member])


def optimizer_arg(s: dict[str, Any], ens: vmapens.Ensemble) -> tuple[Any, dict[str, Any], Any]:
    """``fit``'s ``optimizer=``, the keywords that go with it and a scheduler built on it."""
    cls, _ = OPTIMIZERS[s["opt"]]
    twin = stacked(cls)
    sched = ensemble_scheduler(s["sched"]) if s["sched"] else None
    hyper = {
        k: torch.tensor(v, dtype=torch.float64)
        if isinstance(v, list) and s.get("hyper_tensor")
        else v
        for k, v in s["hyper"].items()
    }
    if s["opt_given"] == "built":
        built = twin(ens.parameters(), **hyper)
        if sched is not None and s["sched_given"] == "object":
            sched = sched(built)
        return built, {}, sched
    if s["opt_given"] == "factory":
        return (lambda e, **kw: twin(e.parameters(), **kw)), hyper, sched
    return twin, hyper, sched


def fit_kwargs(s: dict[str, Any], d: dict[str, Any], opt: Any) -> dict[str, Any]:
    """One fit call's arguments, the callbacks new (each call gets its own objects)."""
    loader = s["data"] in LOADERS
    kw: dict[str, Any] = dict(
        batch_size=None if loader else s["batch_size"],
        shuffle=s["shuffle"],
        steps=s["steps"],
        progress=False,
        seed=s["fit_seed"],
        loss_fn=LOSSES[s["loss"]](),
    )
    data_dims = 0 if s["data"] in PER_MEMBER else None
    kw["in_dims"] = (data_dims, 0) if s["val"] == "per_member" else data_dims
    if s["data"] in BAGGED:
        kw["bootstrap"] = True
    callbacks: list[Any] = []
    if d["val"] is not None:
        kw["val_data"] = d["val"]
        name = "acc" if d["classes"] else "mae"
        if s["metric"]:
            kw["metrics"] = {name: metric(d["classes"])}
        if s["monitor"]:
            mode = "max" if d["classes"] else "min"
            callbacks.append(EarlyStopping(monitor=f"val_{name}", mode=mode,
                                           patience=s["patience"], restore_best=s["restore_best"]))  # fmt: skip
        elif s["early_via"] == "callback" or not s["restore_best"]:
            callbacks.append(EarlyStopping(patience=s["patience"], restore_best=s["restore_best"]))
        elif s["patience"] is not None:
            kw["patience"] = s["patience"]
    built, hyper, sched = opt
    if sched is not None:
        if s["interval"] == "step":
            callbacks.append(LRScheduler(sched, interval="step"))
        else:
            kw["scheduler"] = sched
    if s["stop_at"] is not None:
        callbacks.append(StopMember(*s["stop_at"]))
    if s["clip"] is not None:
        kind, c = s["clip"]
        kw["clip_grad_norm" if kind == "norm" else "clip_grad_value"] = c
    kw["optimizer"] = built
    kw.update(hyper)
    kw["callbacks"] = callbacks
    return kw


def the_data(s: dict[str, Any], d: dict[str, Any]) -> Any:
    if s["data"] in LOADERS:
        return loaders(s, d)
    return d["x"], d["y"]


def run_fit(
    s: dict[str, Any], d: dict[str, Any], ens: vmapens.Ensemble, opt: Any, epochs: int, **extra: Any
) -> vmapens.History:
    kw = fit_kwargs(s, d, opt)
    kw["callbacks"] = kw["callbacks"] + extra.pop("callbacks", [])
    kw.update(extra)
    return vmapens.fit(ens, the_data(s, d), epochs=epochs, **kw)


def close(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    torch.testing.assert_close(got, want, **TOL64, equal_nan=True,
                               msg=lambda e: f"{where}: {e}")  # fmt: skip


def compare_history(h: vmapens.History, t: dict[str, Any], where: str) -> None:
    want = t["train_loss"]
    bad = want.isinf()  # the epoch a member diverged in: not finite, whatever the value
    assert torch.equal(
        ~h.train_loss[bad].isfinite(), torch.ones_like(want[bad], dtype=torch.bool)
    ), f"{where}: train_loss where a member diverged: {h.train_loss} vs {want}"
    close(torch.where(bad, 0.0, h.train_loss), torch.where(bad, 0.0, want), f"{where}: train_loss")
    if t["val_loss"] is None:
        assert h.val_loss is None, where
    else:
        assert h.val_loss is not None, where
        close(h.val_loss, t["val_loss"], f"{where}: val_loss")
    if "metric" in t:
        assert h.metrics is not None and h.ensemble_metrics is not None, where
        (got,), (whole,) = h.metrics.values(), h.ensemble_metrics.values()
        close(got, t["metric"], f"{where}: metrics")
        close(whole, t["whole"], f"{where}: ensemble_metrics")
    else:
        assert h.metrics is None, where
    assert h.best_epoch.tolist() == t["best_epoch"].tolist(), f"{where}: best_epoch"
    assert h.stopped_epoch.tolist() == t["stopped_epoch"].tolist(), f"{where}: stopped_epoch"
    assert h.diverged.tolist() == t["diverged"], f"{where}: diverged"


def compare_members(ens: vmapens.Ensemble, models: list[nn.Module], where: str) -> None:
    for i, m in enumerate(models):
        assert ens.training == m.training, f"{where}: member {i}'s mode"
        got = ens[i].state_dict()
        for name, want in m.state_dict().items():
            torch.testing.assert_close(got[name], want, **TOL64, equal_nan=True,
                                       msg=lambda e, k=name, i=i: f"{where}: member {i} {k}: {e}")  # fmt: skip


def truth_seed(s: dict[str, Any]) -> int | None:
    return s["fit_seed"]


def run(s: dict[str, Any], tmp: Path) -> None:
    """Run configuration ``s`` through fit and through the plain loop; compare."""
    d = make_data(s)
    mode, epochs = s["mode"], s["epochs"]
    ens = build(s)
    plain = Plain(s, ens.unstack())
    opt = optimizer_arg(s, ens)
    torch.manual_seed(s["global_seed"])
    if mode == "once":
        h = run_fit(s, d, ens, opt, epochs)
        torch.manual_seed(s["global_seed"])
        t = plain.fit(d, the_data(s, d), epochs, truth_seed(s))
        compare_history(h, t, "fit")
        compare_members(ens, plain.models, "fit")
    elif mode == "twice":
        h1 = run_fit(s, d, ens, opt, epochs)
        again = opt if s["opt_given"] == "built" else optimizer_arg(s, ens)
        h2 = run_fit(s, d, ens, again, s["more_epochs"])
        torch.manual_seed(s["global_seed"])
        t1 = plain.fit(d, the_data(s, d), epochs, truth_seed(s))
        if s["opt_given"] != "built":
            plain.new_optimizers()
        t2 = plain.fit(d, the_data(s, d), s["more_epochs"], truth_seed(s))
        compare_history(h1, t1, "first fit")
        compare_history(h2, t2, "second fit")
        compare_members(ens, plain.models, "second fit")
    else:
        total = epochs + s["more_epochs"] if mode == "extend" else epochs
        straight = build(s)
        torch.manual_seed(s["global_seed"])
        hs = run_fit(s, d, straight, optimizer_arg(s, straight), total,
                     checkpoint=tmp / "straight.pt", callbacks=[CSVLogger(tmp / "straight.csv")])  # fmt: skip
        torch.manual_seed(s["global_seed"])
        t = plain.fit(d, the_data(s, d), total, truth_seed(s))
        compare_history(hs, t, "straight run")
        compare_members(straight, plain.models, "straight run")
        path, log = tmp / "run.pt", tmp / "run.csv"
        torch.manual_seed(s["global_seed"])
        if mode == "extend":
            run_fit(s, d, ens, opt, epochs, checkpoint=path, callbacks=[CSVLogger(log)])
            h = run_fit(s, d, ens, opt, total, checkpoint=path, callbacks=[CSVLogger(log)])
        else:
            # The interrupt may come after the last step (no interrupt then).
            with contextlib.suppress(KeyboardInterrupt):
                stop = interrupt(s)
                run_fit(s, d, ens, opt, total, checkpoint=path, callbacks=[CSVLogger(log), stop])
            if mode == "resume" or not path.exists():
                ens = build(s)  # a new process: new objects, the checkpoint's state
                opt = optimizer_arg(s, ens)
            # else fit again in the same process, on the same objects (docs/fit.md)
            torch.manual_seed(s["global_seed"])  # the script's own seeding, if it restarts
            h = run_fit(s, d, ens, opt, total, checkpoint=path, callbacks=[CSVLogger(log)])
        assert_bit_identical(h.state_dict(), hs.state_dict(), f"{mode}: history")
        assert_bit_identical(
            dict(ens.state_dict()), dict(straight.state_dict()), f"{mode}: ensemble"
        )
        # CSVLogger: a resumed run drops the rows of the epochs it redoes (docs/workflows.md)
        assert log.read_text() == (tmp / "straight.csv").read_text(), f"{mode}: CSV log"
        if mode == "extend":  # the same call again, in a new process: nothing left to train
            again = build(s)
            torch.manual_seed(s["global_seed"])
            h = run_fit(s, d, again, optimizer_arg(s, again), total, checkpoint=path,
                        callbacks=[CSVLogger(log)])  # fmt: skip
            assert_bit_identical(h.state_dict(), hs.state_dict(), "repeated: history")
            assert_bit_identical(
                dict(again.state_dict()), dict(straight.state_dict()), "repeated: ensemble"
            )


SEEDS = range(30)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_fit_configuration_matches_members_trained_alone(seed: int, tmp_path: Path) -> None:
    run(draw(seed), tmp_path)


if __name__ == "__main__":
    search(lambda seed, tmp: run(draw(seed), tmp), draw)


# -- what the search found, one test each ------------------------------------------------------


class _Recorded(torch.utils.data.Dataset):
    """A dataset that records which rows are read, in order."""

    def __init__(self, rows: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(rows, 3, generator=g, dtype=torch.float64)
        self.y = torch.randn(rows, 2, generator=g, dtype=torch.float64)
        self.read: list[int] = []

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.read.append(k)
        return self.x[k], self.y[k]


@pytest.mark.parametrize("model", ["mlp", "dropout"])
def test_a_dataloader_shuffling_from_the_global_rng_without_a_seed_gets_a_plain_loops_orders(
    model: str,
) -> None:
    # docs/fit.md: "nothing else draws from the RNG a DataLoader shuffles with, so a shuffling
    # DataLoader gives fit the orders a plain loop over it gets from the same RNG state". With
    # seed=None, fit drew a seed from torch's global RNG before the first pass although only
    # tensor data uses it: the DataLoader then saw other orders (and dropout other masks).
    data = _Recorded(12)
    loader = DataLoader(data, batch_size=4, shuffle=True)
    s = dict(draw(0), model=model, n=3, data="loader", rows=12, batch_size=4, shuffle=True,
             loss="mse", steps=None, clip=None, sched=None, interval="epoch", val=None,
             metric=False, monitor=False, stop_at=None, opt="sgd", hyper=dict(lr=0.1))  # fmt: skip
    ens = build(s)
    plain = Plain(s, ens.unstack())
    torch.manual_seed(0)
    vmapens.fit(ens, loader, nn.MSELoss(), epochs=2, optimizer=vmapens.StackedSGD, lr=0.1,
                progress=False)  # fmt: skip
    seen, data.read = data.read, []
    torch.manual_seed(0)
    d = dict(x=data.x, y=data.y, val=None, classes=False)
    plain.fit(d, loader, 2, None)
    assert seen == data.read
    compare_members(ens, plain.models, "fit")


@pytest.mark.parametrize(
    "sched, given, interrupt_in",
    [("step", "object", "step"), ("step", "builder", "step"), ("plateau", "object", "callback")],
)
def test_fit_again_on_the_same_objects_after_an_interrupt_resumes_exactly(
    sched: str, given: str, interrupt_in: str, tmp_path: Path
) -> None:
    # docs/fit.md: calling fit again with the same optimizer and scheduler objects continues.
    # After a KeyboardInterrupt mid-epoch (a notebook's Ctrl-C), a per-step scheduler had moved
    # `lr` past the checkpoint's, and the resume check refused the run as one with "other
    # options" (optimizer.group0.lr); so did an interrupt in a callback at an epoch's end, after
    # vmapens.optim.ReduceLROnPlateau lowered a member's lr and before the checkpoint. The check
    # now compares a scheduled lr as built (`initial_lr`, which fit's LRScheduler keeps for the
    # plateau scheduler as torch's schedulers do); the resume loads the checkpoint's lr, and
    # the run ends as one that never stopped.
    s = dict(draw(3), model="mlp", data="tensor", rows=8, batch_size=2, steps=None, epochs=3,
             opt="sgd", hyper=dict(lr=[0.1, 0.2, 0.05, 0.3], momentum=0.9), diverge=None, n=4,
             opt_given="built", sched=sched, sched_given=given, interval="step",
             val="shared" if sched == "plateau" else None, metric=False, monitor=False,
             stop_at=None, patience=None, mode="resume_here", interrupt=6 if interrupt_in == "step" else 1,
             interrupt_in=interrupt_in, fit_seed=3, clip=None, loss="mse")  # fmt: skip
    if sched == "plateau":
        s["interval"] = "epoch"
    run(s, tmp_path)


def test_context_stop_with_an_optimizer_that_cannot_freeze_members_is_an_error() -> None:
    # Context.stop freezes members through a StackedOptimizer's mask. With another optimizer
    # over ens.parameters() (torch.optim.Adam, which fit takes for plain training) nothing
    # froze them: the member trained on to the end while history.stopped_epoch said it had
    # stopped (and its train_loss was NaN). Now the call says so.
    ens = build(dict(draw(0), model="mlp", n=2))
    opt = torch.optim.Adam(ens.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 3, generator=g, dtype=torch.float64)
    y = torch.randn(8, 2, generator=g, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"Context\.stop: .*StackedOptimizer.*Adam"):
        vmapens.fit(ens, (x, y), nn.MSELoss(), epochs=3, optimizer=opt, progress=False,
                    callbacks=[StopMember(0, 0)], seed=0)  # fmt: skip


def test_a_checkpointed_run_on_a_dataloader_without_a_length_resumes_exactly(
    tmp_path: Path,
) -> None:
    # A DataLoader over an IterableDataset has a __len__ that raises TypeError. The resume
    # check's fingerprint of `data` called it, so fit(checkpoint=...) crashed before the first
    # step, where a plain loop over the same DataLoader trains. Here the dataset also draws
    # its order from the global RNG at every pass, which the resume must give back.
    s = dict(draw(26190), mode="resume", interrupt=4, interrupt_in="step", stop_at=None)
    assert s["data"] == "iterable" and s["shuffle"]
    run(s, tmp_path)
