"""Seeded random population-based training runs against N plain modules trained alone.

Each case draws a legal ``vmapens.fit`` run the way PBT users write one (float64, 3..6
members): an MLP (sometimes with BatchNorm, sometimes with a scalar parameter, a learnable
temperature, whose stacked tensor is 1-D), SGD, SGD with (Nesterov) momentum, Adam or AdamW with
per-member learning rates (a list or a tensor) and weight decay, sometimes in two param
groups, sometimes a member whose learning rate makes it diverge; ``vmapens.pbt.PBT`` with a random interval, fraction, monitor (validation loss, an
accuracy, the training loss), mode, factors, perturbed names and seed; an ``EarlyStopping`` with
a random monitor, mode, patience and best restore (or none at all: no ``val_data``); an LR
scheduler (StepLR, MultiStepLR, ExponentialLR, CosineAnnealingLR, also past ``T_max``, per
epoch or per step; ``vmapens.optim.ReduceLROnPlateau``); and a checkpoint with an interrupt
(after an epoch, then every object built afresh; mid-epoch, or between a round and its
checkpoint, then the same objects) and a resume, which must also equal the uninterrupted run
bit for bit. After ``fit``, ``vmapens.selection.best_k`` picks members.

The truth is written from the docs alone (docs/fit.md, "Validation, early stopping and
divergence" and "Callbacks"; docs/workflows.md, "Population-based training" and "Keeping the
best members"): N plain modules, each with its own ``torch.optim`` optimizer and scheduler,
trained on ``fit``'s batches; a member whose loss is not finite is frozen after that step; after
each epoch, in ``fit``'s callback order, divergence, early stopping (strict improvement of the
monitor, patience, a best-epoch snapshot), the scheduler, then a PBT round: the members still
training with a finite monitor value are ranked (stable, lower row first on ties), each of the
bottom ``q = min(max(1, int(m * fraction)), m // 2)`` loads a top-``q`` member's module and
optimizer state dicts (hyperparameters included) and takes over its early-stopping bookkeeping
and plateau record, then has each perturbed hyperparameter multiplied by one of ``factors``. The
random draws are not re-derived: which top member each copy took is read from ``PBT.log`` (and
checked to be in the top ``q``), which factor from the hyperparameters after the round (and
checked to be one of ``factors``). Compared: every member's parameters and buffers, its
optimizer state and hyperparameters, the history, the rounds, and ``best_k``'s choice.

Run more seeds by hand: ``python tests/test_fuzz_pbt.py 0 300`` runs seeds 0..299 and prints
the failures; ``python tests/test_fuzz_pbt.py 17`` prints seed 17's configuration and runs it.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from truth import TOL64, assert_bit_identical, batch_plan, search, seeded_members

import vmapens
from vmapens.callbacks import Checkpoint, EarlyStopping
from vmapens.optim import MemberValues

ROWS, VAL_ROWS, FEATURES, CLASSES = 24, 12, 3, 3
_g = torch.Generator().manual_seed(0)
X = torch.randn(ROWS, FEATURES, generator=_g, dtype=torch.float64)
Y = torch.randint(CLASSES, (ROWS,), generator=_g)
XV = torch.randn(VAL_ROWS, FEATURES, generator=_g, dtype=torch.float64)
YV = torch.randint(CLASSES, (VAL_ROWS,), generator=_g)
HUGE = 1e308  # a learning rate whose weights overflow within a few steps, whatever the rule


class Net(nn.Module):
    """``Linear -> [BatchNorm1d] -> Tanh -> Linear [* temperature]``."""

    def __init__(self, hidden: int, bn: bool, temperature: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, hidden, bias=not bn)  # a bias before BatchNorm: round-off
        self.bn = nn.BatchNorm1d(hidden) if bn else nn.Identity()
        self.fc2 = nn.Linear(hidden, CLASSES)
        self.t = nn.Parameter(torch.tensor(1.0)) if temperature else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc2(torch.tanh(self.bn(self.fc1(x))))
        return out if self.t is None else out * self.t


def member(s: dict[str, Any]) -> Net:
    return Net(s["hidden"], s["bn"], s["temperature"]).double()


def accuracy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.argmax(-1) == y).double().mean()


#: name -> (stacked optimizer, torch optimizer, fixed settings both take, names PBT may perturb)
OPTIMIZERS: dict[str, tuple[Any, Any, dict[str, Any], tuple[str, ...]]] = {
    "sgd": (vmapens.StackedSGD, torch.optim.SGD, {}, ("lr", "weight_decay")),
    "momentum": (vmapens.StackedSGD, torch.optim.SGD, {"momentum": 0.9}, ("lr", "weight_decay")),
    "nesterov": (
        vmapens.StackedSGD,
        torch.optim.SGD,
        {"momentum": 0.5, "nesterov": True},
        ("lr",),
    ),  # fmt: skip
    "adam": (vmapens.StackedAdam, torch.optim.Adam, {"betas": (0.8, 0.99)}, ("lr", "weight_decay")),
    "adamw": (
        functools.partial(vmapens.StackedAdam, decoupled_weight_decay=True),
        torch.optim.AdamW,
        {},
        ("lr", "weight_decay", "eps"),
    ),  # fmt: skip
}
#: name -> a builder on an optimizer, torch's own class (the truth builds one per member)
SCHEDULERS: dict[str, Any] = {
    "step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "multistep": lambda o: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[1, 3], gamma=0.3),
    "exponential": lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.8),
    "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=50),
    # Past T_max it adds (base_lr - eta_min) terms: a copy takes its source's base lr, as a
    # plain copy with the source's scheduler state dict loaded does (session 27; it kept its
    # own before, while its param groups' initial_lr was the source's).
    "cosine_short": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=2, eta_min=1e-4),
}
PLATEAU = dict(mode="min", factor=0.5, patience=0)


# -- a configuration --------------------------------------------------------------------------


def draw(seed: int) -> dict[str, Any]:
    """A random, legal PBT run from ``seed``."""
    r = random.Random(seed)
    n = r.randint(3, 6)
    s: dict[str, Any] = {"seed": seed, "n": n, "hidden": r.choice([3, 5])}
    s["bn"], s["temperature"] = r.random() < 0.3, r.random() < 0.4
    s["opt"] = r.choice(sorted(OPTIMIZERS))
    adaptive = s["opt"] in ("adam", "adamw")
    s["lrs"] = [r.choice([0.003, 0.01, 0.03] if adaptive else [0.03, 0.1, 0.3]) for _ in range(n)]
    s["wds"] = [r.choice([0.0, 0.0, 1e-3, 1e-2]) for _ in range(n)]
    s["groups"] = r.random() < 0.3  # fc1 in a group of its own, at a third of the lr
    s["lr_as"] = r.choice(["list", "tensor"])
    s["diverge"] = r.choice([None, None, r.randrange(n)])
    if s["diverge"] is not None:
        s["lrs"][s["diverge"]] = HUGE
    s["validated"] = r.random() < 0.8
    s["epochs"] = r.randint(3, 6)
    s["batch"] = r.choice([None, 8, 10, 12])
    s["fit_seed"] = r.randint(0, 9)
    monitors = ["train_loss"] + (
        ["val_loss", "val_loss", "val_acc", "acc"] if s["validated"] else []
    )
    s["pbt"] = dict(
        interval=r.randint(1, 3),
        fraction=r.choice([0.2, 0.25, 0.34, 0.5]),
        monitor=r.choice(monitors),
        factors=r.choice([(0.8, 1.2), (0.5, 2.0), (1.0,), (0.9, 1.1, 1.5)]),
        names=tuple(r.sample(OPTIMIZERS[s["opt"]][3], r.randint(1, len(OPTIMIZERS[s["opt"]][3])))),
        seed=r.randint(0, 9),
    )
    s["pbt"]["mode"] = "max" if s["pbt"]["monitor"] in ("val_acc", "acc") else "min"
    if r.random() < 0.1:  # the other way round: legal, and ranks the worst first
        s["pbt"]["mode"] = "max" if s["pbt"]["mode"] == "min" else "min"
    s["es"] = None
    if s["validated"]:
        monitor = r.choice(["val_loss", "val_acc"])
        s["es"] = dict(monitor=monitor, mode="max" if monitor == "val_acc" else "min",
                       patience=r.choice([None, 1, 2, 3]), restore_best=r.random() < 0.7)  # fmt: skip
    s["es_given"] = r.choice(["callbacks", "patience"]) if s["es"] else None
    if s["es_given"] == "patience":  # fit's own: monitor val_loss, restore_best
        s["es"].update(monitor="val_loss", mode="min", restore_best=True)
    scheds = [None, None, *SCHEDULERS] + (["plateau"] if s["validated"] else [])
    s["sched"] = r.choice(scheds)
    s["sched_interval"] = (
        r.choice(["epoch", "step"]) if s["sched"] not in (None, "plateau") else "epoch"
    )
    s["resume"] = r.choice([None, None, "epoch", "step", "round"])
    s["resume_at"] = r.randint(1, s["epochs"] - 1)  # the epoch after which, or in which
    s["best_k"] = r.randint(1, n)
    return s


# -- the truth: N plain modules ----------------------------------------------------------------


def plain_optimizer(s: dict[str, Any], i: int, model: nn.Module) -> torch.optim.Optimizer:
    _, cls, fixed, _ = OPTIMIZERS[s["opt"]]
    if not s["groups"]:
        return cls(model.parameters(), lr=s["lrs"][i], weight_decay=s["wds"][i], **fixed)
    first = [p for name, p in model.named_parameters() if name.startswith("fc1.")]
    rest = [p for name, p in model.named_parameters() if not name.startswith("fc1.")]
    return cls([{"params": first, "lr": s["lrs"][i] / 3}, {"params": rest}], lr=s["lrs"][i],
               weight_decay=s["wds"][i], **fixed)  # fmt: skip


def plain_scheduler(s: dict[str, Any], opt: torch.optim.Optimizer) -> Any:
    if s["sched"] is None:
        return None
    if s["sched"] == "plateau":
        return torch.optim.lr_scheduler.ReduceLROnPlateau(opt, **PLATEAU)
    return SCHEDULERS[s["sched"]](opt)


def load_copy(model: nn.Module, opt: torch.optim.Optimizer, module: dict, state: dict) -> None:
    """The plain PBT copy: the source's module and optimizer state dicts loaded."""
    model.load_state_dict(copy.deepcopy(module))
    opt.load_state_dict(copy.deepcopy(state))  # torch's load aliases tensors of the same dtype


def truth(s: dict[str, Any], rounds: list[tuple[int, list[int], list[int]]],
          after: dict[int, dict[str, list[float]]]) -> dict[str, Any]:  # fmt: skip
    """Each member trained alone, fit's callbacks written again from the docs."""
    n, epochs = s["n"], s["epochs"]
    models = seeded_members(lambda: member(s), n)
    opts = [plain_optimizer(s, i, m) for i, m in enumerate(models)]
    scheds = [plain_scheduler(s, o) for o in opts]
    per_pass = -(-ROWS // (s["batch"] or ROWS))
    plan = batch_plan(ROWS, s["batch"], epochs * per_pass, s["fit_seed"])
    es, pbt = s["es"], s["pbt"]
    sign = -1.0 if es and es["mode"] == "max" else 1.0
    best_val, bad, best_epoch = [math.inf] * n, [0] * n, [-1] * n
    snapshot = [copy.deepcopy(m.state_dict()) for m in models]
    active, stopped, diverged = [True] * n, [-1] * n, [False] * n
    table = {k: torch.full((epochs, n), math.nan, dtype=torch.float64)
             for k in ("train_loss", "val_loss", "acc")}  # fmt: skip
    logged = list(rounds)
    for epoch in range(epochs):
        if not any(active):
            table = {k: v[:epoch] for k, v in table.items()}
            break
        running = list(active)
        for i in range(n):
            if not running[i]:
                continue
            losses = []
            for rows in plan[epoch * per_pass : (epoch + 1) * per_pass]:
                if active[i]:
                    opts[i].zero_grad()
                    loss = nn.functional.cross_entropy(models[i](X[rows]), Y[rows])
                    loss.backward()
                    opts[i].step()
                    losses.append(loss.item())
                    active[i] = math.isfinite(losses[-1])
                else:  # frozen from the step its loss was not finite on
                    losses.append(losses[-1])
                if s["sched_interval"] == "step":
                    scheds[i].step()
            table["train_loss"][epoch, i] = sum(losses) / len(losses)
        for i in range(n):
            if s["sched_interval"] == "step" and not running[i]:
                for _ in range(per_pass):
                    scheds[i].step()
        if s["validated"]:
            for i in range(n):
                if running[i] and active[i]:
                    with torch.no_grad():
                        out = models[i].eval()(XV)
                    models[i].train()
                    table["val_loss"][epoch, i] = nn.functional.cross_entropy(out, YV).item()
                    table["acc"][epoch, i] = accuracy(out, YV).item()
        for i in range(n):  # Divergence
            if running[i] and not active[i]:
                diverged[i], stopped[i] = True, epoch
        if es is not None:  # EarlyStopping
            key = "acc" if es["monitor"] == "val_acc" else "val_loss"
            for i in range(n):
                if not active[i]:
                    continue
                v = sign * float(table[key][epoch, i])
                if v < best_val[i]:
                    best_val[i], bad[i], best_epoch[i] = v, 0, epoch
                    snapshot[i] = copy.deepcopy(models[i].state_dict())
                else:
                    bad[i] += 1
                if es["patience"] is not None and bad[i] >= es["patience"]:
                    active[i], stopped[i] = False, epoch
        if s["sched"] == "plateau":  # each member on its own validation loss
            for i in range(n):
                if running[i]:
                    scheds[i].step(float(table["val_loss"][epoch, i]))
        elif s["sched"] is not None and s["sched_interval"] == "epoch":
            for sched in scheds:
                sched.step()
        if (epoch + 1) % pbt["interval"]:
            continue
        monitor = "acc" if pbt["monitor"] in ("acc", "val_acc") else pbt["monitor"]
        values = table[monitor][epoch]
        rank_sign = -1.0 if pbt["mode"] == "max" else 1.0
        eligible = [i for i in range(n) if active[i] and math.isfinite(float(values[i]))]
        m = len(eligible)
        q = min(max(1, int(m * pbt["fraction"])), m // 2)
        if q == 0:
            continue
        order = sorted(eligible, key=lambda i: (rank_sign * float(values[i]), i))
        top, bottom = order[:q], order[m - q :]
        assert logged, f"epoch {epoch}: no PBT round logged, expected {bottom} <- {top}"
        got_epoch, src, dst = logged.pop(0)
        assert (got_epoch, dst) == (epoch, bottom), (got_epoch, dst, epoch, bottom)
        assert len(src) == q and set(src) <= set(top), (epoch, src, top)
        saved = [(copy.deepcopy(models[a].state_dict()), copy.deepcopy(opts[a].state_dict()),
                  snapshot[a], best_val[a], bad[a], best_epoch[a],
                  scheds[a].state_dict() if s["sched"] is not None else None)
                 for a in src]  # fmt: skip
        for b, (module, state, snap, bv, bd, be, plateau) in zip(dst, saved, strict=True):
            load_copy(models[b], opts[b], module, state)
            snapshot[b], best_val[b], bad[b], best_epoch[b] = copy.deepcopy(snap), bv, bd, be
            if plateau is not None and s["sched"] == "plateau":
                for k in ("best", "num_bad_epochs", "cooldown_counter"):
                    setattr(scheds[b], k, plateau[k])
            elif plateau is not None:  # a torch scheduler: the source's base lr
                scheds[b].base_lrs = list(plateau["base_lrs"])
        for name in pbt["names"]:  # one factor per member and name, in every group
            for b in dst:
                groups = opts[b].param_groups
                old = [g[name] for g in groups]
                new = [seen[name][b] for seen in after[epoch]]
                factor = [f for f in pbt["factors"] if [v * f for v in old] == new]
                assert factor, f"epoch {epoch}: member {b}'s {name} {old} became {new}"
                for g, v in zip(groups, old, strict=True):
                    g[name] = v * factor[0]
    assert not logged, f"rounds logged that the truth did not run: {logged}"
    if es is not None and es["restore_best"]:
        for i in range(n):
            if best_epoch[i] >= 0:
                models[i].load_state_dict(snapshot[i])
    return dict(models=models, opts=opts, table=table, best_epoch=best_epoch, stopped=stopped,
                diverged=diverged, active=active)  # fmt: skip


# -- the run ----------------------------------------------------------------------------------


class After(vmapens.Callback):
    """The perturbed hyperparameters after each round (it runs after PBT, listed after it)."""

    def __init__(self, pbt: vmapens.pbt.PBT) -> None:
        self.pbt, self.seen = pbt, {}

    def on_epoch_end(self, ctx: Any) -> None:
        if self.pbt.log and self.pbt.log[-1][0] == ctx.epoch:
            self.seen[ctx.epoch] = [{k: [float(v) for v in g[k]] for k in self.pbt.names}
                                    for g in ctx.optimizer.param_groups]  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        return {"seen": copy.deepcopy(self.seen)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = copy.deepcopy(state["seen"])


class Interrupt(vmapens.Callback):
    """Raises ``KeyboardInterrupt`` after one step, or at one epoch's end after PBT's round
    and before that epoch's checkpoint (listed after PBT)."""

    def __init__(self, step: int | None = None, epoch: int | None = None) -> None:
        self.step, self.epoch = step, epoch

    def on_step_end(self, ctx: Any) -> None:
        if ctx.step == self.step:
            raise KeyboardInterrupt

    def on_epoch_end(self, ctx: Any) -> None:
        if ctx.epoch == self.epoch:
            raise KeyboardInterrupt


def build(s: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """Every object of one run, built afresh."""
    ens = vmapens.Ensemble(functools.partial(member, s), s["n"], seeds=range(s["n"]))
    cls, _, fixed, _ = OPTIMIZERS[s["opt"]]
    lrs = torch.tensor(s["lrs"], dtype=torch.float64) if s["lr_as"] == "tensor" else list(s["lrs"])
    params: Any = ens
    if s["groups"]:
        named = list(ens.named_parameters())
        params = [{"params": [p for k, p in named if k.startswith("fc1.")], "lr": lrs / 3 if
                   s["lr_as"] == "tensor" else [v / 3 for v in lrs]},
                  {"params": [p for k, p in named if not k.startswith("fc1.")]}]  # fmt: skip
    opt = cls(params, lr=lrs, weight_decay=list(s["wds"]), **fixed)
    pbt = vmapens.pbt.PBT(**s["pbt"])
    callbacks: list[Any] = [pbt, After(pbt)]
    options: dict[str, Any] = dict(epochs=s["epochs"], batch_size=s["batch"], seed=s["fit_seed"],
                                   optimizer=opt, progress=False)  # fmt: skip
    if s["validated"]:
        options.update(val_data=(XV, YV), metrics={"acc": accuracy})
    if s["es_given"] == "callbacks":
        callbacks.insert(0, EarlyStopping(**s["es"]))
    elif s["es_given"] == "patience":
        options["patience"] = s["es"]["patience"]
    if s["sched"] == "plateau":
        options["scheduler"] = lambda o: vmapens.optim.ReduceLROnPlateau(o, **PLATEAU)
    elif s["sched"] is not None:
        sched = vmapens.callbacks.LRScheduler(SCHEDULERS[s["sched"]], interval=s["sched_interval"])
        callbacks.append(sched)
    if s["resume"] is not None:
        callbacks.append(Checkpoint(tmp / "run.pt"))
    options["callbacks"] = callbacks
    return dict(ens=ens, opt=opt, pbt=pbt, after=callbacks[callbacks.index(pbt) + 1],
                options=options)  # fmt: skip


def fit(s: dict[str, Any], tmp: Path) -> tuple[dict[str, Any], Any]:
    """``fit`` as drawn: uninterrupted, or interrupted and resumed."""
    run = build(s, tmp)
    loss = nn.CrossEntropyLoss()
    if s["resume"] is None:
        return run, vmapens.fit(run["ens"], (X, Y), loss, **run["options"])
    per_pass = -(-ROWS // (s["batch"] or ROWS))
    first = dict(run["options"])
    if s["resume"] == "epoch":

        def stop(history: Any) -> None:
            if history.epochs == s["resume_at"]:
                raise KeyboardInterrupt

        first["callbacks"] = [*first["callbacks"], stop]
    elif s["resume"] == "step":  # in epoch `resume_at`, after its first step
        step = s["resume_at"] * per_pass + 1
        first["callbacks"] = [*first["callbacks"], Interrupt(step=step)]
    else:  # at the end of epoch `resume_at`, its checkpoint not written
        first["callbacks"] = [*first["callbacks"], Interrupt(epoch=s["resume_at"])]
    # Every member may have stopped before the interrupt: the second call finds the run done.
    with contextlib.suppress(KeyboardInterrupt):
        vmapens.fit(run["ens"], (X, Y), loss, **first)
    if s["resume"] == "epoch":
        run = build(s, tmp)  # every object afresh: all comes from the checkpoint
    return run, vmapens.fit(run["ens"], (X, Y), loss, **run["options"])


def check(s: dict[str, Any], tmp: Path) -> None:
    run, h = fit(s, tmp)
    if s["resume"] is not None:  # bit for bit the run without the interrupt (docs/fit.md)
        whole = build(dict(s, resume=None), tmp)
        h0 = vmapens.fit(whole["ens"], (X, Y), nn.CrossEntropyLoss(), **whole["options"])
        assert_bit_identical(h.state_dict(), h0.state_dict(), "history")
        assert_bit_identical(run["ens"].state_dict(), whole["ens"].state_dict(), "ensemble")
        assert_bit_identical(run["opt"].state_dict(), whole["opt"].state_dict(), "optimizer")
        assert run["pbt"].log == whole["pbt"].log
    want = truth(s, run["pbt"].log, run["after"].seen)
    ens, opt, n = run["ens"], run["opt"], s["n"]
    tol = dict(**TOL64, equal_nan=True)
    for i in range(n):
        got, alone = ens[i].state_dict(), want["models"][i].state_dict()
        assert list(got) == list(alone)
        for k, v in alone.items():
            torch.testing.assert_close(got[k], v, **tol, msg=f"member {i}: {k}")
    assert h.diverged.tolist() == want["diverged"]
    assert h.stopped_epoch.tolist() == want["stopped"]
    assert h.best_epoch.tolist() == want["best_epoch"]
    table = want["table"]
    # A diverged member's loss is non-finite in the epoch it diverged (its value is not told).
    ok = ~torch.tensor(want["diverged"])
    for i in (~ok).nonzero().flatten().tolist():
        at = want["stopped"][i]
        assert not math.isfinite(h.train_loss[at, i]) and not math.isfinite(
            table["train_loss"][at, i]
        )
    torch.testing.assert_close(h.train_loss[:, ok], table["train_loss"][:, ok], **tol)
    if s["validated"]:
        for got, key in ((h.val_loss, "val_loss"), (h.metrics["acc"], "acc")):
            torch.testing.assert_close(got[:, ok], table[key][:, ok], **tol)
    for i in range(n):  # optimizer state and hyperparameters of the members still training
        if not want["active"][i]:
            continue
        mine, theirs = opt.member_state_dict(i), want["opts"][i].state_dict()
        for ours, plain in zip(mine["param_groups"], theirs["param_groups"], strict=True):
            for k, v in plain.items():
                if k in ("lr", "weight_decay", "eps", "momentum", "initial_lr"):
                    assert math.isclose(ours[k], v, rel_tol=1e-12), (i, k, ours[k], v)
        for p, state in theirs["state"].items():
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    torch.testing.assert_close(mine["state"][p][k].to(v.dtype), v, **tol,
                                               msg=f"member {i}: state {p}.{k}")  # fmt: skip
    # best_k: the k best by each member's best recorded value of the PBT monitor.
    metric, mode = s["pbt"]["monitor"], s["pbt"]["mode"]
    key = "acc" if metric in ("acc", "val_acc") else metric
    values = table[key].clone()
    values[~torch.isfinite(values)] = math.inf if mode == "min" else -math.inf
    best = values.amin(0) if mode == "min" else values.amax(0)
    best[~torch.isfinite(table[key]).any(0)] = math.nan
    order = sorted(range(n), key=lambda i: (math.isnan(best[i]), (1 if mode == "min" else -1)
                                            * (0.0 if math.isnan(best[i]) else float(best[i])), i))  # fmt: skip
    top, top_opt = vmapens.selection.best_k(ens, h, s["best_k"], metric=metric, mode=mode,
                                            optimizer=opt)  # fmt: skip
    assert list(top.member_ids) == order[: s["best_k"]], (list(top.member_ids), order)
    for j, i in enumerate(order[: s["best_k"]]):
        for k, v in top[j].state_dict().items():
            torch.testing.assert_close(v, ens[i].state_dict()[k], rtol=0, atol=0, equal_nan=True)
        assert (
            top_opt.member_state_dict(j)["param_groups"][0]["lr"]
            == (opt.member_state_dict(i)["param_groups"][0]["lr"])
        )


#: A spread of the search's seeds: every interrupt, a divergence, BatchNorm, a scalar
#: parameter, two param groups, ReduceLROnPlateau, a cosine schedule past T_max.
SEEDS = [4, 9, 11, 15, 17, 22, 35, 36]


@pytest.mark.parametrize("seed", SEEDS)
def test_random_pbt_run_equals_members_trained_alone(seed: int, tmp_path: Path) -> None:
    check(draw(seed), tmp_path)


# -- what the search found, one test each ------------------------------------------------------


def test_exploit_keeps_the_optimizer_on_a_scalar_parameter() -> None:
    # A member's scalar parameter (a temperature) is stacked [n]: 1-D with n entries, which
    # exploit_ took for a per-member hyperparameter in the group's "params" list and replaced
    # by a detached copy. The optimizer then trained the copy; the member's own stayed put.
    s = dict(hidden=3, bn=False, temperature=True)
    ens = vmapens.Ensemble(functools.partial(member, s), 3, seeds=range(3))
    plain = [ens[i] for i in range(3)]
    opt = vmapens.StackedSGD(ens, lr=[0.1, 0.2, 0.3], momentum=0.9)
    opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9)
            for m, lr in zip(plain, [0.1, 0.2, 0.3], strict=True)]  # fmt: skip
    step = vmapens.make_step(ens, nn.CrossEntropyLoss(), opt)

    def train(k: int) -> None:
        step(X[k::3], Y[k::3])
        for m, o in zip(plain, opts, strict=True):
            o.zero_grad()
            nn.functional.cross_entropy(m(X[k::3]), Y[k::3]).backward()
            o.step()

    train(0)
    vmapens.pbt.exploit_(ens, opt, [0], [2])
    load_copy(plain[2], opts[2], plain[0].state_dict(), opts[0].state_dict())
    train(1)
    train(2)
    for i, m in enumerate(plain):
        for k, v in m.state_dict().items():
            torch.testing.assert_close(ens[i].state_dict()[k], v, **TOL64, msg=f"{i} {k}")


def test_a_member_is_not_scored_by_the_epoch_it_diverged_in() -> None:
    # fit freezes a member after the step whose loss is not finite, and early stopping never
    # takes that epoch as its best, yet its validation metrics of that epoch are recorded
    # (numbers: an accuracy of huge or NaN logits). member_scores counted them, so best_k
    # ranked the diverged member first when those labels were its own argmax.
    lrs = [0.1, 0.1, HUGE]
    alone = [Net(3, False, False).double() for _ in lrs]
    ens = vmapens.Ensemble.from_modules(alone)
    for m, lr in zip(alone, lrs, strict=True):  # the truth: each member alone, one epoch
        opt = torch.optim.SGD(m.parameters(), lr=lr)
        for k in range(0, ROWS, 8):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(m(X[k : k + 8]), Y[k : k + 8])
            loss.backward()
            opt.step()
            if not torch.isfinite(loss):
                break  # frozen from here on
    with torch.no_grad():
        labels = alone[2].eval()(XV).argmax(-1)  # all right for the diverged weights
    assert not torch.isfinite(loss)  # member 2 diverged in epoch 0
    h = vmapens.fit(ens, (X, Y), nn.CrossEntropyLoss(), epochs=2, batch_size=8, shuffle=False,
                    optimizer=vmapens.StackedSGD, lr=lrs, val_data=(XV, labels),
                    metrics={"acc": accuracy}, progress=False, seed=0)  # fmt: skip
    assert h.diverged.tolist() == [False, False, True] and h.stopped_epoch[2] == 0
    scores = vmapens.selection.member_scores(h, "acc", "max")
    assert math.isnan(scores[2]) and bool(torch.isfinite(scores[:2]).all()), scores
    assert list(vmapens.selection.best_k(ens, h, 3, metric="acc", mode="max").member_ids)[-1] == 2


def test_a_resume_with_other_pbt_settings_is_refused(tmp_path: Path) -> None:
    # PBT's settings were not in the checkpoint: a resume with another interval (or fraction,
    # monitor, factors, names) went on silently as a run that neither setting gives.
    def run(interval: int, stop_at: int | None) -> vmapens.pbt.PBT:
        ens = vmapens.Ensemble(functools.partial(member, dict(hidden=3, bn=False,
                                                              temperature=False)), 4, seed=0)  # fmt: skip
        pbt = vmapens.pbt.PBT(interval, seed=0)

        def stop(history: Any) -> None:
            if history.epochs == stop_at:
                raise KeyboardInterrupt

        vmapens.fit(ens, (X, Y), nn.CrossEntropyLoss(), epochs=4, val_data=(XV, YV), seed=0,
                    lr=[1e-3, 1e-2, 3e-2, 1e-1], progress=False, checkpoint=tmp_path / "c.pt",
                    callbacks=[pbt, stop])  # fmt: skip
        return pbt

    with pytest.raises(KeyboardInterrupt):
        run(1, 2)
    with pytest.raises(ValueError, match=r"the checkpoint's PBT has settings .*'interval': 1"):
        run(2, None)
    assert [e for e, _, _ in run(1, None).log] == [0, 1, 2, 3]  # the same settings resume


def test_a_metric_named_loss_is_refused_and_an_older_history_keeps_val_loss_its_own() -> None:
    # recorded() let metric "loss" take the name "val_loss": member_scores (whose default it
    # is) and PBT's default monitor ranked by that metric, while EarlyStopping("val_loss")
    # followed the validation loss. fit now refuses the name before anything changes; a
    # History written before that (built here by hand) still ranks by the validation loss.
    alone = [Net(3, False, False).double() for _ in range(3)]
    ens = vmapens.Ensemble.from_modules(alone)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    wrong = {"loss": lambda out, y: 1 - accuracy(out, y)}  # an error rate, named "loss"
    with pytest.raises(ValueError, match="`metrics` cannot hold a metric named 'loss'"):
        vmapens.fit(ens, (X, Y), nn.CrossEntropyLoss(), epochs=2, optimizer=vmapens.StackedSGD,
                    lr=[0.01, 0.1, 0.5], val_data=(XV, YV), metrics=wrong, progress=False)  # fmt: skip
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k
    h = vmapens.History.empty([0, 1, 2], True, ["loss"])
    g = torch.Generator().manual_seed(5)
    h.val_loss = torch.rand(2, 3, generator=g, dtype=torch.float64)
    h.metrics = {"loss": torch.rand(2, 3, generator=g, dtype=torch.float64)}
    assert torch.equal(vmapens.selection.member_scores(h), h.val_loss.amin(0))
    assert torch.equal(vmapens.selection.member_scores(h, "loss"), h.metrics["loss"].amin(0))


def test_a_perturbation_the_optimizer_refuses_copies_nothing() -> None:
    # PBT's round copied the members (exploit_, then the bookkeeping) before explore refused
    # a rho pushed past 1: the run stopped with members copied and the round not logged.
    alone = [Net(3, False, False).double() for _ in range(4)]
    ens = vmapens.Ensemble.from_modules(alone)
    lrs = [0.1, 0.3, 1.0, 3.0]
    opts = [torch.optim.Adadelta(m.parameters(), lr=lr, rho=0.9) for m, lr in zip(alone, lrs)]
    for m, o in zip(alone, opts, strict=True):  # the truth: one epoch alone, no copy
        o.zero_grad()
        nn.functional.cross_entropy(m(X), Y).backward()
        o.step()
    opt = vmapens.optim.StackedAdadelta(ens, lr=lrs, rho=0.9)
    pbt = vmapens.pbt.PBT(1, monitor="train_loss", names=("rho",), factors=(2.0,), seed=0)
    fresh = pbt.generator.get_state()
    with pytest.raises(ValueError, match=r"^PBT: member \d's `rho` would become 1\.8, must be "
                                         r"in \[0, 1\], at epoch 0 .* nothing was copied"):  # fmt: skip
        vmapens.fit(ens, (X, Y), nn.CrossEntropyLoss(), epochs=2, optimizer=opt,
                    progress=False, callbacks=[pbt])  # fmt: skip
    assert pbt.log == [] and torch.equal(pbt.generator.get_state(), fresh)
    assert opt.param_groups[0]["rho"] == 0.9 and list(opt.param_groups[0]["lr"]) == lrs
    for i, (m, o) in enumerate(zip(alone, opts, strict=True)):
        for k, v in m.state_dict().items():
            torch.testing.assert_close(ens[i].state_dict()[k], v, **TOL64, msg=f"{i} {k}")
        mine = opt.member_state_dict(i)["state"]
        for p, state in o.state_dict()["state"].items():
            for k, v in state.items():
                torch.testing.assert_close(mine[p][k].to(v.dtype), v, **TOL64, msg=f"{i} {k}")


@pytest.mark.parametrize("factors", [(0.8, -1.2), (0.0,), (float("inf"),), (None,)])
def test_pbt_refuses_factors_that_are_not_positive_numbers_when_built(factors: Any) -> None:
    with pytest.raises(ValueError, match=r"^PBT: `factors` must be finite numbers > 0"):
        vmapens.pbt.PBT(1, factors=factors)


def test_after_pbt_the_stoppers_best_val_ranks_the_restored_members() -> None:
    # member_scores reads each member's own column of the History, which after a PBT copy
    # holds values of weights the member no longer has; the stopper's best_val follows the
    # copies, as the member_scores docstring says: it is each restored member's value.
    ens = vmapens.Ensemble(functools.partial(member, dict(hidden=5, bn=False, temperature=False)),
                           4, seed=2)  # fmt: skip
    stopper, pbt = EarlyStopping(), vmapens.pbt.PBT(1, seed=0)
    vmapens.fit(ens, (X, Y), nn.CrossEntropyLoss(), epochs=6, batch_size=8, val_data=(XV, YV),
                lr=[1e-3, 3e-2, 0.3, 1.0], optimizer=vmapens.StackedSGD, progress=False, seed=0,
                callbacks=[stopper, pbt])  # fmt: skip
    with torch.no_grad():  # each restored member alone, as a plain module
        value = [float(nn.functional.cross_entropy(m.eval()(XV), YV)) for m in ens.unstack()]
    torch.testing.assert_close(stopper.best_val, torch.tensor(value, dtype=torch.float64), **TOL64)
    top = vmapens.selection.best_k(ens, stopper.best_val, 2)
    assert list(top.member_ids) == sorted(range(4), key=lambda i: (value[i], i))[:2]


def test_pbt_warns_when_sequential_lr_would_restart_its_learning_rates() -> None:
    # SequentialLR restarts the next scheduler from the base lrs at each milestone (a closed
    # form, step(0)), undoing PBT's copied and perturbed lrs, as a plain optimizer shows.
    p = nn.Parameter(torch.zeros(1))
    plain = torch.optim.SGD([p], lr=0.1)
    inner = [torch.optim.lr_scheduler.ExponentialLR(plain, 0.9),
             torch.optim.lr_scheduler.StepLR(plain, 5, 0.5)]  # fmt: skip
    sched = torch.optim.lr_scheduler.SequentialLR(plain, inner, milestones=[2])
    for _ in range(2):
        plain.step()
        plain.param_groups[0]["lr"] = 7.0  # what a PBT round writes
        sched.step()
    assert plain.param_groups[0]["lr"] == 0.1  # the base lr again at the milestone
    ens = vmapens.Ensemble(functools.partial(member, dict(hidden=3, bn=False, temperature=False)),
                           4, seed=0)  # fmt: skip
    opt = vmapens.StackedSGD(ens, lr=[0.01, 0.03, 0.1, 0.3])
    steps = [torch.optim.lr_scheduler.ExponentialLR(opt, 0.9),
             torch.optim.lr_scheduler.StepLR(opt, 5, 0.5)]  # fmt: skip
    sequential = torch.optim.lr_scheduler.SequentialLR(opt, steps, milestones=[2])
    pbt = vmapens.pbt.PBT(1, monitor="train_loss", seed=0)
    with pytest.warns(UserWarning, match=r"^PBT: the SequentialLR scheduler sets each member's"):
        vmapens.fit(ens, (X, Y), nn.CrossEntropyLoss(), epochs=1, optimizer=opt,
                    scheduler=sequential, progress=False, callbacks=[pbt])  # fmt: skip


@pytest.mark.parametrize("edited", [False, True], ids=["as-left", "edited-by-hand"])
def test_the_same_objects_resume_after_an_interrupt_between_a_round_and_its_checkpoint(
    tmp_path: Path, edited: bool
) -> None:
    # The round changed the optimizer's lrs after the last checkpoint was written; calling fit
    # again on the same objects was refused as "other options" (and the override it offered
    # kept the unsaved lrs over the checkpoint's). A hand edit since is still refused.
    def run(objects: dict[str, Any], epochs: int, *extra: Any) -> vmapens.History:
        return vmapens.fit(objects["ens"], (X, Y), nn.CrossEntropyLoss(), epochs=epochs,
                           batch_size=8, val_data=(XV, YV), optimizer=objects["opt"], seed=0,
                           progress=False, checkpoint=tmp_path / "c.pt",
                           callbacks=[objects["pbt"], *extra])  # fmt: skip

    def build() -> dict[str, Any]:
        ens = vmapens.Ensemble(functools.partial(member, dict(hidden=3, bn=False,
                                                              temperature=False)), 4, seed=0)  # fmt: skip
        opt = vmapens.StackedSGD(ens, lr=[0.01, 0.03, 0.1, 0.3])
        return dict(ens=ens, opt=opt, pbt=vmapens.pbt.PBT(1, factors=(2.0,), seed=0))

    same = build()
    with pytest.raises(KeyboardInterrupt):
        run(same, 3, Interrupt(epoch=1))  # after epoch 1's round, before its checkpoint
    if edited:
        same["opt"].param_groups[0]["lr"] = MemberValues([0.5] * 4)
        with pytest.raises(ValueError, match=r"cannot resume .* other options: optimizer"):
            run(same, 3)
        return
    h = run(same, 3)
    whole = build()
    (tmp_path / "c.pt").unlink()
    h0 = run(whole, 3)
    assert_bit_identical(h.state_dict(), h0.state_dict(), "history")
    assert_bit_identical(same["ens"].state_dict(), whole["ens"].state_dict(), "ensemble")
    assert_bit_identical(same["opt"].state_dict(), whole["opt"].state_dict(), "optimizer")
    assert same["pbt"].log == whole["pbt"].log and len(whole["pbt"].log) == 3


if __name__ == "__main__":
    search(lambda seed, tmp: check(draw(seed), tmp), draw)
