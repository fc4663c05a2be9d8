"""Seeded random sharded ``fit`` configurations for tests/test_fuzz_dist.py.

``draw(seed)`` gives one configuration; ``run(cfg, shard, ...)`` trains it, sharded over the
launched ranks or in one process without ``torch.distributed``. Each seed has two stages on
two different numbers of processes (1 is this process, alone; 2 and 3 are torchrun ranks):

- stage ``A`` on ``cfg["w_first"]`` processes: the run, checkpointed every ``cfg["every"]``
  epochs, is interrupted at step ``cfg["halt"]`` (an exception on every rank);
- stage ``B`` on ``cfg["w_resume"]`` processes: the same call again resumes from the
  checkpoint to the end; ``gather`` / ``gather_history`` onto a drawn rank, each rank's
  optimizer rows, ``save_members`` into one directory. With a process group, an uninterrupted
  sharded run of the same configuration too. The test process reads the files and compares.

``python -m torch.distributed.run --nproc-per-node W tests/dist_fuzz_worker.py OUT A:3 B:5``
runs the named stages of those seeds (one launch for many seeds: starting processes costs
seconds), each under ``OUT/seed<k>/``; a stage that raises writes ``error.rank<r>.txt`` there
and the worker goes on with the next one.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import random
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import vmapens  # noqa: E402
from vmapens.callbacks import Callback, Checkpoint, EarlyStopping, LRScheduler  # noqa: E402
from vmapens.optim import stacked  # noqa: E402

D_IN, D_OUT = 3, 2


class MLP(nn.Module):
    def __init__(self, frozen: bool = False) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D_IN, 5), nn.Linear(5, D_OUT)
        self.fc2.bias.requires_grad_(not frozen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


MODELS = {"mlp": lambda: MLP().double(), "frozen": lambda: MLP(frozen=True).double()}

LOSSES = {
    "mse": nn.MSELoss,
    "l1": nn.L1Loss,
    "huber": lambda: nn.HuberLoss(delta=0.5),
    "ce": nn.CrossEntropyLoss,
}

#: name -> (stacked class, hyperparameter -> choices)
OPTIMIZERS: dict[str, tuple[Any, dict[str, list[Any]]]] = {
    "adam": (vmapens.StackedAdam, dict(lr=[1e-2, 3e-2], weight_decay=[0.0, 1e-2])),
    "adamw": (stacked(torch.optim.AdamW), dict(lr=[1e-2, 2e-2], weight_decay=[1e-2, 0.1])),
    "sgd": (vmapens.StackedSGD, dict(lr=[0.05, 0.1], momentum=[0.0, 0.9], weight_decay=[0, 1e-3])),
    "rmsprop": (vmapens.StackedRMSprop, dict(lr=[1e-2, 5e-3], momentum=[0.0, 0.5])),
    "adagrad": (vmapens.StackedAdagrad, dict(lr=[0.05, 0.1])),
    "nadam": (vmapens.StackedNAdam, dict(lr=[1e-2, 2e-2])),
}

#: optimizers with a fused CPU kernel for shared float hyperparameters
FUSED = ("adam", "adamw", "sgd", "adagrad")

SCHEDULERS: dict[str, Any] = {
    "step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "exponential": lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.8),
    "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1.0 / (1 + e)),
    "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=4, eta_min=1e-3),
    "plateau": lambda o: vmapens.optim.ReduceLROnPlateau(o, factor=0.5, patience=0),
}


def mae(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).abs().mean()


def accuracy(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out.argmax(-1) == target).double().mean()


def draw(seed: int) -> dict[str, Any]:
    """A random, valid sharded-fit configuration from ``seed``."""
    r = random.Random(seed)
    c: dict[str, Any] = dict(seed=seed)
    c["w_first"], c["w_resume"] = r.sample([1, 2, 3], 2)
    sizes = [w for w in (c["w_first"], c["w_resume"]) if w > 1]
    # Mostly a number of members no world size divides: blocks of different sizes.
    uneven = [n for n in range(3, 8) if all(n % w for w in sizes)]
    c["n"] = r.choice(uneven) if uneven and r.random() < 0.8 else r.randint(max(sizes), 7)
    c["model"] = r.choice(list(MODELS))
    c["loss"] = r.choice(list(LOSSES))
    c["rows"] = r.randint(7, 14)
    c["batch_size"] = r.choice([None, 3, 4, 5, 8])
    c["steps"] = r.choice([None, None, None, 2, 3])
    c["shuffle"] = r.random() < 0.7
    c["bootstrap"] = r.random() < 0.5
    c["epochs"] = r.randint(3, 5)
    c["opt"] = r.choice(list(OPTIMIZERS))
    hyper: dict[str, Any] = {}
    for k, values in OPTIMIZERS[c["opt"]][1].items():
        if r.random() < 0.6:  # one value per member, for all n (each rank keeps its block's)
            hyper[k] = [r.choice(values) * r.choice([0.5, 1.0, 2.0]) for _ in range(c["n"])]
        elif r.random() < 0.6:
            hyper[k] = r.choice(values)
    if c["opt"] == "sgd" and r.random() < 0.4:  # one member overflows and stops: Divergence
        lr = hyper.get("lr", 0.05)
        bad = r.randrange(c["n"])
        hyper["lr"] = [1e300 if i == bad else lr[i] if isinstance(lr, list) else lr
                       for i in range(c["n"])]  # fmt: skip
    c["hyper"], c["hyper_tensor"] = hyper, r.random() < 0.3
    # torch's fused CPU kernel (shared float hyperparameters, the default fused=None) or
    # torch's single-tensor arithmetic (fused=False): see `exact`.
    c["fused"] = r.choice([None, False]) if c["opt"] in FUSED else None
    # fit's default optimizer is StackedAdam: its hyperparameters may come as fit's keywords.
    c["opt_given"] = r.choice(["class", "built"] + (["keywords"] if c["opt"] == "adam" else []))
    c["clip"] = r.choice([None, None, ("clip_grad_norm", 0.3), ("clip_grad_value", 0.05)])
    c["val"] = r.choice([None, "shared", "shared"] + (["oob"] if c["bootstrap"] else []))
    c["metric"] = c["val"] == "shared" and r.random() < 0.6
    c["monitor"] = "val_score" if c["metric"] and r.random() < 0.4 else "val_loss"
    c["patience"] = r.choice([None, 1, 2]) if c["val"] else None
    c["restore_best"] = r.random() < 0.5
    c["sched"] = r.choice([None, None, *SCHEDULERS])
    if c["sched"] == "plateau" and c["val"] is None:
        c["sched"] = None
    c["interval"] = "epoch" if c["sched"] == "plateau" else r.choice(["epoch", "step"])
    c["fit_seed"] = r.randint(0, 2**31)
    c["every"] = r.choice([1, 1, 2])
    rows = c["rows"]
    per_epoch = c["steps"] or -(-rows // min(c["batch_size"] or rows, rows))
    c["halt"] = r.randint(1, c["epochs"] * per_epoch - 1)
    c["dst"] = r.randrange(c["w_resume"])  # the rank gather hands the ensemble to
    c["history_dst"] = r.randrange(c["w_resume"])
    # Drawn last, so that the earlier draws of a seed stay as they were.
    c["per_member_data"] = not c["bootstrap"] and r.random() < 0.3  # member i trains on X[i]
    c["per_member_val"] = c["per_member_data"] and c["val"] == "shared" and r.random() < 0.5
    if c["per_member_val"]:  # metrics need shared validation data
        c["metric"], c["monitor"] = False, "val_loss"
    # fit's own arguments, where they can say it: scheduler=, checkpoint= (every epoch).
    c["sched_via_fit"] = c["interval"] == "epoch" and r.random() < 0.5
    c["ckpt_via_fit"] = c["every"] == 1 and not c["per_member_data"] and r.random() < 0.5
    return c


def exact(c: dict[str, Any]) -> bool:
    """Whether docs/distributed.md promises the sharded run equal to one process to the bit.

    Not where a block steps in another form than the whole ensemble, an ulp now and then:
    torch's fused CPU kernel (shared float hyperparameters) over a tensor of another number of
    members; a plateau scheduler that lowers a shared learning rate on some ranks only (the
    others keep stepping with one float); RMSprop where a block's members all have momentum 0
    (that block keeps no momentum buffer). ``fused=False`` or per-member values give the bits.
    """
    per_member = any(isinstance(v, list) for v in c["hyper"].values())
    fused = c["opt"] in FUSED and not per_member and c["fused"] is not False
    plateau = c["sched"] == "plateau" and not isinstance(c["hyper"].get("lr"), list)
    momentum = c["hyper"].get("momentum", 0.0)
    idle_block = c["opt"] == "rmsprop" and isinstance(momentum, list) and 0 < sum(
        m == 0 for m in momentum) < len(momentum)  # fmt: skip
    return not (fused or plateau or idle_block)


def data(c: dict[str, Any], which: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Training (``which=0``) or validation (``1``) rows, the same on every rank; with
    ``per_member_data`` (``per_member_val``), ``[n, rows, ...]``: member i's are ``X[i]``."""
    g = torch.Generator().manual_seed(c["seed"] * 2 + which)
    per_member = c["per_member_data"] if which == 0 else c["per_member_val"]
    lead = (c["n"], c["rows"]) if per_member else (c["rows"],)
    x = torch.randn(*lead, D_IN, generator=g, dtype=torch.float64)
    if c["loss"] == "ce":
        return x, torch.randint(0, D_OUT, lead, generator=g)
    return x, torch.randn(*lead, D_OUT, generator=g, dtype=torch.float64)


class Halted(Exception):
    """The injected failure of stage A."""


class Halt(Callback):
    """Raises after optimizer step ``at`` (every rank at the same step): a crashed run."""

    def __init__(self, at: int | None) -> None:
        self.at, self.optimizer = at, None

    def on_train_start(self, ctx) -> None:
        self.optimizer = ctx.optimizer  # the one fit built, for the test to read

    def on_step_end(self, ctx) -> None:
        if ctx.step == self.at:
            raise Halted(f"halted after step {ctx.step}")


class EveryK(Checkpoint):
    """A checkpoint every ``k`` epochs only (and at the last), as a user would subclass it."""

    def __init__(self, path: Path, k: int, override: tuple[str, ...] = ()) -> None:
        super().__init__(path, override=override)
        self.k = k

    def on_epoch_end(self, ctx) -> None:
        if ctx.history.epochs % self.k == 0 or ctx.history.epochs == ctx.epochs:
            self.save(ctx)


def hyperparameters(c: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {} if c["fused"] is None else {"fused": c["fused"]}
    for k, v in c["hyper"].items():
        out[k] = torch.tensor(v, dtype=torch.float64) if isinstance(v, list) and c[
            "hyper_tensor"] else v  # fmt: skip
    return out


def optimizer_for(c: dict[str, Any], ens: vmapens.Ensemble) -> Any:
    """The optimizer ``run`` trains ``ens`` with, built by hand (fit's default: StackedAdam)."""
    return OPTIMIZERS[c["opt"]][0](ens, **hyperparameters(c))


def run(c: dict[str, Any], shard: bool, checkpoint: Path | None = None, halt: int | None = None):
    """Train configuration ``c``; returns ``(ens, optimizer, history)``."""
    ens = vmapens.Ensemble(MODELS[c["model"]], c["n"], seed=c["seed"], shard=shard)
    cls = OPTIMIZERS[c["opt"]][0]
    kwargs: dict[str, Any] = {}
    if c["opt_given"] == "built":
        optimizer = optimizer_for(c, ens)
    else:
        optimizer = cls if c["opt_given"] == "class" else None
        kwargs.update(hyperparameters(c))
    if c["clip"] is not None:
        kwargs[c["clip"][0]] = c["clip"][1]
    callbacks: list[Any] = [Halt(halt)]
    if c["val"] is not None:
        mode = "max" if c["monitor"] == "val_score" and c["loss"] == "ce" else "min"
        callbacks.append(EarlyStopping(monitor=c["monitor"], mode=mode, patience=c["patience"],
                                       restore_best=c["restore_best"]))  # fmt: skip
    if c["sched"] is not None and c["sched_via_fit"]:
        kwargs["scheduler"] = SCHEDULERS[c["sched"]]
    elif c["sched"] is not None:
        callbacks.append(LRScheduler(SCHEDULERS[c["sched"]], interval=c["interval"]))
    if checkpoint is not None and c["ckpt_via_fit"]:
        kwargs["checkpoint"] = checkpoint
    elif checkpoint is not None:
        # Per-member data is each rank's block of rows, fingerprinted per rank: at another
        # world size the resume must be told it is this run's (docs/distributed.md).
        override = ("data",) * c["per_member_data"] + ("val_data",) * c["per_member_val"]
        callbacks.append(EveryK(checkpoint, c["every"], override))
    val = {None: None, "shared": data(c, 1), "oob": "oob"}[c["val"]]
    ids = list(ens.member_ids)
    x, y = data(c, 0)
    if c["per_member_data"]:  # each rank passes its own members' rows
        x, y = x[ids], y[ids]
        kwargs["in_dims"] = 0
    if c["per_member_val"]:
        val = tuple(t[ids] for t in data(c, 1))
        kwargs["in_dims"] = (0, 0)
    metrics = {"score": accuracy if c["loss"] == "ce" else mae} if c["metric"] else None
    history = vmapens.fit(
        ens, (x, y), LOSSES[c["loss"]](), epochs=c["epochs"], steps=c["steps"],
        batch_size=c["batch_size"], shuffle=c["shuffle"], bootstrap=c["bootstrap"],
        val_data=val, metrics=metrics, optimizer=optimizer, callbacks=callbacks,
        progress=False, seed=c["fit_seed"], **kwargs,
    )  # fmt: skip
    return ens, callbacks[0].optimizer, history


def member_rows(ens: vmapens.Ensemble, opt) -> dict[int, dict]:
    """Global member id -> that member's optimizer state (plain torch layout)."""
    return {gid: opt.member_state_dict(i) for i, gid in enumerate(ens.member_ids)}


def stage_a(c: dict[str, Any], out: Path) -> None:
    """The run, interrupted at step ``c["halt"]`` (a run that ends before it is no error)."""
    with contextlib.suppress(Halted):
        run(c, shard=dist.is_initialized(), checkpoint=out / "ckpt.pt", halt=c["halt"])


def stage_b(c: dict[str, Any], out: Path) -> None:
    """Resume to the end; gather, gather_history, optimizer rows and member files."""
    sharded = dist.is_initialized()
    me = dist.get_rank() if sharded else 0
    ens, opt, history = run(c, shard=sharded, checkpoint=out / "ckpt.pt")
    write_gathered(ens, opt, history, c, out / "resumed")
    vmapens.save_members(ens, out / "members")
    if sharded:  # and uninterrupted, at this world size
        ens, opt, history = run(c, shard=True)
        write_gathered(ens, opt, history, c, out / "fresh")
    (out / f"done.rank{me}").touch()


def write_gathered(ens, opt, history, c: dict[str, Any], prefix: Path) -> None:
    sharded = dist.is_initialized()
    me = dist.get_rank() if sharded else 0
    full = vmapens.gather(ens, dst=c["dst"] if sharded else 0)
    merged = vmapens.gather_history(history, dst=c["history_dst"] if sharded else 0)
    torch.save(member_rows(ens, opt), f"{prefix}.opt.rank{me}.pt")
    if full is not None:  # it runs: each member's outputs on the validation inputs
        outputs = vmapens.predict(full, data(c, 1)[0]) if not c["per_member_val"] else None
        torch.save((full.state_dict(), outputs), f"{prefix}.state.pt")
    if merged is not None:
        torch.save(merged.state_dict(), f"{prefix}.history.pt")


def refused_resume(out: Path, epochs: int) -> None:
    """4 members on per-member data (each rank passes its block's rows), checkpointed."""
    out.mkdir(parents=True, exist_ok=True)
    ens = vmapens.Ensemble(MODELS["mlp"], 4, seed=0, shard=True)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(4, 6, d, generator=g, dtype=torch.float64) for d in (D_IN, D_OUT))
    ids = list(ens.member_ids)
    vmapens.fit(ens, (x[ids], y[ids]), nn.MSELoss(), epochs=epochs, in_dims=0, seed=0,
                checkpoint=out / "ckpt.pt", progress=False)  # fmt: skip


def stage_p(c: dict[str, Any], out: Path) -> None:
    """On 2 ranks: the run whose resume on 3 ranks stage ``Q`` tries."""
    refused_resume(out / "refused", epochs=1)


def stage_q(c: dict[str, Any], out: Path) -> None:
    """On 3 ranks, without ``override=("data",)``: ranks 1 and 2 hold other rows than the
    checkpoint's, rank 0 the same; every rank must raise (each writes what it raised)."""
    try:
        refused_resume(out / "refused", epochs=2)
    except Exception as err:  # noqa: BLE001 - the test reads it
        said = f"{type(err).__name__}: {err}"
        (out / "refused" / f"raised.rank{dist.get_rank()}.txt").write_text(said)


STAGES = {"A": stage_a, "B": stage_b, "P": stage_p, "Q": stage_q}


def main(out: Path, tasks: list[str]) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    me = dist.get_rank()
    for task in tasks:
        stage, seed = task.split(":")
        where = out / f"seed{seed}"
        where.mkdir(parents=True, exist_ok=True)
        try:
            STAGES[stage](draw(int(seed)), where)
        except Exception:  # noqa: BLE001 - the test reads it; the other seeds go on
            (where / f"error.rank{me}.txt").write_text(f"stage {stage}:\n{traceback.format_exc()}")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    try:
        main(Path(sys.argv[1]), sys.argv[2:])
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    # Skip interpreter finalization: gloo's threads can abort it (see tests/dist_worker.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
