"""Seeded random cases over everything vmapens writes to disk, against plain PyTorch.

Each case builds a small Ensemble (an MLP, an MLP with BatchNorm or a GRU; float64 or
float32; members of one size or of several through ``from_factories``) and, next to it, N
plain modules with their own ``torch.optim`` optimizer and LR scheduler. Both train a few
steps on the same batches. Then one writer runs (``vmapens.save``, ``save_members`` as ``.pt``
or ``.safetensors``, a ``fit`` checkpoint, ``torch.save`` of the state dicts, the hand-off of a
member's optimizer state, ``export``) and either

- the matching reader reads it back: every tensor and every optimizer and scheduler state
  must equal the ensemble's and what the plain modules and optimizers hold, and training
  goes on from the file exactly as the run that never stopped (float64: bit for bit); or
- the file is damaged (a flipped byte in tensor data or headers, a cut, a file of another
  run or member swapped in, a renamed key written as a valid file) and the reader must raise
  an error naming the file, leaving the ensemble and optimizer it loads into unchanged.

Run many more cases by hand: ``python tests/test_fuzz_files.py FIRST COUNT``.
"""

from __future__ import annotations

import copy
import functools
import os
import random
import re
import shutil
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn

import vmapens
from vmapens import _checkpoint_files, _files, checkpoint, sharding

F64, F32 = torch.float64, torch.float32
EXACT = dict(rtol=0, atol=0)


def tol(dtype: torch.dtype) -> dict[str, float]:
    """Ensemble vs plain modules: only the order of sums may differ (docs/semantics.md);
    in float32, Adam-like rules scale a round-off gradient up to a step of ``lr``."""
    return dict(rtol=1e-9, atol=1e-10) if dtype == F64 else dict(rtol=1e-3, atol=1e-3)


# -- members ----------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, hidden: int = 4) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(3, hidden), nn.Linear(hidden, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class MLPBN(nn.Module):
    def __init__(self, hidden: int = 4) -> None:
        super().__init__()
        # No bias before BatchNorm: its true gradient is 0 (docs/semantics.md, round-off).
        self.fc1, self.bn = nn.Linear(3, hidden, bias=False), nn.BatchNorm1d(hidden)
        self.fc2 = nn.Linear(hidden, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


class GRUNet(nn.Module):
    def __init__(self, hidden: int = 4) -> None:
        super().__init__()
        self.rnn, self.head = nn.GRU(3, hidden, batch_first=True), nn.Linear(hidden, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


class Tied(nn.Module):
    """Tied weights and a non-persistent buffer: neither may change what a file holds."""

    def __init__(self, hidden: int = 4) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 2)
        self.b.weight = self.a.weight
        self.register_buffer("shift", torch.full((3,), 0.25), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x) + self.shift))))


# -- optimizers: (vmapens class, torch class, hyperparameters drawn per case) -----------------


def _lr(r: random.Random, n: int, per_member: bool, base: float) -> Any:
    return [base * r.choice([0.5, 1.0, 2.0]) for _ in range(n)] if per_member else base


OPTIMIZERS: dict[str, tuple[type, type, Callable[[random.Random], dict[str, Any]]]] = {
    "Adam": (vmapens.StackedAdam, torch.optim.Adam,
             lambda r: dict(betas=(r.choice([0.9, 0.8]), 0.999), amsgrad=r.random() < 0.3,
                            weight_decay=r.choice([0.0, 0.01]))),
    "AdamW": (functools.partial(vmapens.StackedAdam, decoupled_weight_decay=True),
              torch.optim.AdamW, lambda r: dict(weight_decay=r.choice([0.01, 0.1]))),
    "SGD": (vmapens.StackedSGD, torch.optim.SGD,
            lambda r: dict(momentum=r.choice([0.0, 0.9]), weight_decay=r.choice([0.0, 0.01]))),
    "RMSprop": (vmapens.StackedRMSprop, torch.optim.RMSprop,
                lambda r: dict(momentum=r.choice([0.0, 0.5]), centered=r.random() < 0.5)),
    "Adagrad": (vmapens.StackedAdagrad, torch.optim.Adagrad,
                lambda r: dict(lr_decay=r.choice([0.0, 0.01]))),
    "Adamax": (vmapens.StackedAdamax, torch.optim.Adamax, lambda r: {}),
    "NAdam": (vmapens.StackedNAdam, torch.optim.NAdam, lambda r: {}),
    "RAdam": (vmapens.StackedRAdam, torch.optim.RAdam, lambda r: {}),
    "Adadelta": (vmapens.StackedAdadelta, torch.optim.Adadelta, lambda r: {}),
    "Rprop": (vmapens.StackedRprop, torch.optim.Rprop, lambda r: {}),
    "ASGD": (vmapens.StackedASGD, torch.optim.ASGD, lambda r: dict(t0=2.0)),
}  # fmt: skip
LRS = {"Adadelta": 1.0, "SGD": 0.05, "ASGD": 0.05, "Adagrad": 0.1}
SCHEDULERS: dict[str, Callable[[Any], Any] | None] = {
    "none": None,
    "step": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    "exp": lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9),
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5),
    "onecycle": lambda opt: torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=0.05, total_steps=40, cycle_momentum=False
    ),
    "sequential": lambda opt: torch.optim.lr_scheduler.SequentialLR(
        opt,
        [
            torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=2),
            torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9),
        ],
        milestones=[2],
    ),  # fmt: skip
}


class Case:
    """One random setup: the members, the optimizer, the scheduler and the data."""

    def __init__(self, seed: int) -> None:
        r = self.r = random.Random(seed)
        self.seed = seed
        self.cls = r.choice([MLP, MLPBN, GRUNet, Tied])
        self.dtype = r.choice([F64, F64, F32])
        self.n = r.randint(2, 4)
        sized = self.cls is not Tied and r.random() < 0.4
        self.hiddens = [r.choice([2, 3, 5]) if sized else 4 for _ in range(self.n)]
        self.opt_name = r.choice(sorted(OPTIMIZERS))
        self.hyper = OPTIMIZERS[self.opt_name][2](r)
        self.per_member_lr = r.random() < 0.5
        self.lr = _lr(r, self.n, self.per_member_lr, LRS.get(self.opt_name, 0.01))
        self.sched = r.choice(sorted(SCHEDULERS))
        g = torch.Generator().manual_seed(seed)
        shape = (6, 3, 3) if self.cls is GRUNet else (6, 3)
        self.batches = [
            (torch.randn(shape, generator=g, dtype=self.dtype),
             torch.randn(6, 2, generator=g, dtype=self.dtype))
            for _ in range(4)
        ]  # fmt: skip

    def __repr__(self) -> str:
        return (
            f"Case({self.seed}: {self.cls.__name__} {self.dtype} n={self.n} hidden="
            f"{self.hiddens} {self.opt_name} {self.hyper} lr={self.lr} sched={self.sched})"
        )

    def keep(self, rows: list[int]) -> None:
        """The case of the sub-ensemble of members ``rows``."""
        self.n, self.hiddens = len(rows), [self.hiddens[i] for i in rows]
        if isinstance(self.lr, list):
            self.lr = [self.lr[i] for i in rows]

    @property
    def sized(self) -> bool:
        return len(set(self.hiddens)) > 1

    def factories(self) -> list[Callable[[], nn.Module]]:
        return [lambda h=h: self.cls(h).to(self.dtype) for h in self.hiddens]

    def factory(self) -> Any:
        """What ``vmapens.load`` takes: one factory, or one per member of several sizes."""
        return self.factories() if self.sized else self.factories()[0]

    def ensemble(self) -> vmapens.Ensemble:
        if self.sized:
            return vmapens.Ensemble.from_factories(self.factories(), seed=self.seed)
        return vmapens.Ensemble(self.factories()[0], n=self.n, seed=self.seed)

    def optimizer(self, params: Any) -> torch.optim.Optimizer:
        return OPTIMIZERS[self.opt_name][0](params, lr=self.lr, **self.hyper)

    def plain_optimizer(self, module: nn.Module, i: int) -> torch.optim.Optimizer:
        lr = self.lr[i] if isinstance(self.lr, list) else self.lr
        return OPTIMIZERS[self.opt_name][1](module.parameters(), lr=lr, **self.hyper)

    def scheduler(self, opt: torch.optim.Optimizer) -> Any:
        make = SCHEDULERS[self.sched]
        return None if make is None else make(opt)


class Run:
    """An ensemble with its optimizer and scheduler, and the plain twins of its members."""

    def __init__(self, case: Case, ens: vmapens.Ensemble | None = None, twins: bool = True):
        self.case = case
        self.ens = case.ensemble() if ens is None else ens
        self.opt = case.optimizer(self.ens.parameters())
        self.sched = case.scheduler(self.opt)
        self.plain: list[nn.Module] = self.ens.unstack() if twins else []
        self.plain_opts = [case.plain_optimizer(m, i) for i, m in enumerate(self.plain)]
        self.plain_scheds = [case.scheduler(o) for o in self.plain_opts]
        self.steps = 0

    def train(self, steps: int) -> None:
        loss_fn = vmapens.per_member(nn.MSELoss())
        for _ in range(steps):
            x, y = self.case.batches[self.steps % len(self.case.batches)]
            self.steps += 1
            self.opt.zero_grad()
            loss_fn(self.ens(x), y).sum().backward()
            self.opt.step()
            if self.sched is not None:
                self.sched.step()
            for m, o, s in zip(self.plain, self.plain_opts, self.plain_scheds, strict=True):
                o.zero_grad()
                nn.functional.mse_loss(m(x), y).backward()
                o.step()
                if s is not None:
                    s.step()

    def select(self, r: random.Random, case: Case) -> Run:
        """A sub-ensemble of random members with their optimizer state (``select``)."""
        rows = r.sample(range(len(self.ens)), r.randint(1, len(self.ens)))
        sub = copy.copy(self)
        sub.ens = self.ens.select(rows)
        sub.opt = self.opt.select(rows, sub.ens)
        sub.plain = [self.plain[i] for i in rows]
        sub.plain_opts = [self.plain_opts[i] for i in rows]
        sub.plain_scheds = [self.plain_scheds[i] for i in rows]
        case.keep(rows)
        return sub

    def snapshot(self) -> Any:
        """Everything a failed load must leave as it was."""
        return copy.deepcopy((self.ens.state_dict(), self.opt.state_dict(), self.sched_state()))

    def sched_state(self) -> Any:
        return None if self.sched is None else self.sched.state_dict()

    def check_against_plain(self) -> None:
        """Member ``i`` holds what plain module ``i`` and its torch optimizer hold."""
        t = tol(self.case.dtype)
        for i, (m, o) in enumerate(zip(self.plain, self.plain_opts, strict=True)):
            torch.testing.assert_close(self.ens[i].state_dict(), m.state_dict(), **t)
            held = self.opt.member_state_dict(i, module=m)
            truth = o.state_dict()
            torch.testing.assert_close(held["state"], truth["state"], **t)
            for mine, theirs in zip(held["param_groups"], truth["param_groups"], strict=True):
                assert mine["lr"] == pytest.approx(theirs["lr"], rel=1e-12), (i, mine, theirs)


def unchanged(run: Run, before: Any) -> None:
    """``run`` holds bit for bit what ``run.snapshot()`` gave as ``before``."""
    now = run.snapshot()
    torch.testing.assert_close(now[:2], before[:2], **EXACT)
    assert now[2] == before[2]


def same_run(a: Run, b: Run) -> None:
    """Bit for bit: the ensemble, the optimizer and the scheduler."""
    torch.testing.assert_close(a.ens.state_dict(), b.ens.state_dict(), **EXACT)
    torch.testing.assert_close(a.opt.state_dict(), b.opt.state_dict(), **EXACT)
    assert a.sched_state() == b.sched_state()


# -- writers and their readers -----------------------------------------------------------------


def read_save(case: Case, run: Run, path: Path) -> Run:
    """``vmapens.load`` + a new optimizer + ``vmapens.restore``, the scheduler from torch.save."""
    ens = vmapens.load(path, case.factory())
    back = Run(case, ens, twins=False)
    if case.r.random() < 0.5:  # built with other learning rates: the file's come back
        back.opt = OPTIMIZERS[case.opt_name][0](back.ens.parameters(), **case.hyper)
        back.sched = case.scheduler(back.opt)
    vmapens.restore(path, back.ens, back.opt)
    if run.sched is not None:
        back.sched.load_state_dict(torch.load(path.with_suffix(".sched"), weights_only=True))
    return back


def write_save(run: Run, path: Path) -> None:
    vmapens.save(run.ens, path, optimizer=run.opt)
    if run.sched is not None:
        torch.save(run.sched.state_dict(), path.with_suffix(".sched"))


def roundtrip_save(case: Case, run: Run, tmp: Path) -> None:
    path = tmp / "ens.pt"
    write_save(run, path)
    back = read_save(case, run, path)
    assert list(back.ens.member_ids) == list(run.ens.member_ids)
    same_run(back, run)
    back.steps = run.steps
    run.train(2)
    back.train(2)
    same_run(back, run)
    run.check_against_plain()


def roundtrip_state_dicts(case: Case, run: Run, tmp: Path) -> None:
    """``torch.save`` of the ensemble's and optimizer's state dicts, loaded into new ones."""
    path = tmp / "sd.pt"
    torch.save({"ens": run.ens.state_dict(), "opt": run.opt.state_dict(),
                "sched": run.sched_state()}, path)  # fmt: skip
    held = torch.load(path, weights_only=True)
    back = Run(case, twins=False)
    back.ens.load_state_dict(held["ens"])
    back.opt.load_state_dict(held["opt"])
    if back.sched is not None:
        back.sched.load_state_dict(held["sched"])
    same_run(back, run)
    back.steps = run.steps
    run.train(2)
    back.train(2)
    same_run(back, run)


def roundtrip_members(case: Case, run: Run, tmp: Path, fmt: str) -> None:
    """Each member file loads into the user's class with plain torch/safetensors and with
    ``load_member``, to the plain twin's values; the member goes on alone with a plain torch
    optimizer given ``member_state_dict`` exactly as inside the ensemble."""
    paths = vmapens.save_members(run.ens, tmp / "members", format=fmt)
    assert [p.name for p in paths] == [f"member_{i:04d}.{fmt}" for i in run.ens.member_ids]
    if fmt == "pt":
        plain = [torch.load(p, weights_only=True) for p in paths]
    else:
        from safetensors.torch import load_file

        plain = [load_file(p) for p in paths]
    t = tol(case.dtype)
    alone = []
    for i, (path, state) in enumerate(zip(paths, plain, strict=True)):
        checked = vmapens.load_member(path)
        torch.testing.assert_close(dict(checked), dict(state), **EXACT)
        module = case.factories()[i]()
        module.load_state_dict(state)
        torch.testing.assert_close(module.state_dict(), run.ens.state_dicts()[i], **EXACT)
        torch.testing.assert_close(module.state_dict(), run.plain[i].state_dict(), **t)
        opt = case.plain_optimizer(module, i)
        opt.load_state_dict(run.opt.member_state_dict(i, module=module))
        alone.append((module, opt))
    before = run.steps
    run.train(2)
    for i, (module, opt) in enumerate(alone):
        for k in range(before, before + 2):
            x, y = case.batches[k % len(case.batches)]
            opt.zero_grad()
            nn.functional.mse_loss(module(x), y).backward()
            opt.step()
        if run.sched is None:  # with one the member's lr would need its own scheduler
            torch.testing.assert_close(module.state_dict(), run.ens[i].state_dict(), **t)


def interrupt_after(epoch: int) -> Callable[[vmapens.History], None]:
    def callback(history: vmapens.History) -> None:
        if history.epochs == epoch:
            raise KeyboardInterrupt

    return callback


def fit_run(case: Case, path: Path, epochs: int, callbacks=(), run: Run | None = None) -> Run:
    run = Run(case, twins=False) if run is None else run
    x = torch.cat([b[0] for b in case.batches])
    y = torch.cat([b[1] for b in case.batches])
    sched = None if case.sched == "none" else SCHEDULERS[case.sched]
    r = random.Random(case.seed)
    extra: dict[str, Any] = {}
    if r.random() < 0.5:
        extra["val_data"] = case.batches[0]
        extra["patience"] = r.choice([1, 5])
        if r.random() < 0.5:
            sched = functools.partial(vmapens.optim.ReduceLROnPlateau, patience=0, factor=0.5)
    if r.random() < 0.3:
        extra["steps"] = r.choice([2, 5])
    extra["bootstrap"] = r.random() < 0.3
    vmapens.fit(run.ens, (x, y), nn.MSELoss(), optimizer=run.opt, scheduler=sched,
                epochs=epochs, batch_size=8, seed=case.seed, progress=False,
                checkpoint=path, callbacks=list(callbacks), **extra)  # fmt: skip
    return run


def roundtrip_fit(case: Case, run: Run, tmp: Path) -> None:
    """A fit checkpoint resumed after an interrupt ends where the uninterrupted run ends."""
    straight = fit_run(case, tmp / "straight.pt", 3)
    with pytest.raises(KeyboardInterrupt):
        fit_run(case, tmp / "run.pt", 3, [interrupt_after(1)])
    resumed = fit_run(case, tmp / "run.pt", 3)
    torch.testing.assert_close(resumed.ens.state_dict(), straight.ens.state_dict(), **EXACT)
    torch.testing.assert_close(resumed.opt.state_dict(), straight.opt.state_dict(), **EXACT)
    # The checkpoints hold the last epoch (fit hands back each member's best with val_data).
    back = vmapens.load(tmp / "run.pt", case.factory())
    truth = vmapens.load(tmp / "straight.pt", case.factory())
    torch.testing.assert_close(back.state_dict(), truth.state_dict(), **EXACT)


def shard(path: Path, out: Path, r: random.Random) -> list[list[int]]:
    """Write the single-file fit checkpoint ``path`` again at ``out`` as ``save_sharded``
    writes it under torch.distributed, with its members in random blocks (one per rank)."""
    payload = checkpoint.read(path, "test")
    ids = list(payload["members"]["member_ids"])
    cuts = sorted(r.sample(range(1, len(ids)), r.randint(0, len(ids) - 1)))
    blocks = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True)]
    listed = [(_checkpoint_files.block_name(b, payload["epoch"]), b) for b in blocks]

    def gathered(into: list, mine: Any) -> None:
        # save_sharded gathers the blocks' layouts (a dict; every block of one run's
        # checkpoint has the same), then the block names.
        into[:] = [mine] * len(blocks) if isinstance(mine, dict) else listed

    fake = types.SimpleNamespace(all_gather_object=gathered)
    for rank in [*range(1, len(blocks)), 0]:  # rank 0 writes the shared part last
        local = _checkpoint_files.localise(payload, path, blocks[rank], "test")
        local = {k: v for k, v in local.items() if k not in ("format", "version")}
        with (
            mock.patch.object(sharding, "dist", fake),
            mock.patch.object(sharding, "rank", lambda r=rank: r),
            mock.patch.object(sharding, "world_size", lambda: len(blocks)),
            mock.patch.object(sharding, "barrier", lambda: None),
        ):
            sharding.save_sharded(out, local, blocks[rank])
    return blocks


def roundtrip_sharded(case: Case, run: Run, tmp: Path) -> None:
    """A sharded fit checkpoint loads as its single-file twin and resumes in one process to
    the run that never stopped."""
    straight = fit_run(case, tmp / "straight.pt", 3)
    with pytest.raises(KeyboardInterrupt):
        fit_run(case, tmp / "run.pt", 3, [interrupt_after(1)])
    shard(tmp / "run.pt", tmp / "sharded.pt", case.r)
    whole = vmapens.load(tmp / "run.pt", case.factory())
    torch.testing.assert_close(
        vmapens.load(tmp / "sharded.pt", case.factory()).state_dict(), whole.state_dict(), **EXACT
    )
    resumed = fit_run(case, tmp / "sharded.pt", 3)
    torch.testing.assert_close(resumed.ens.state_dict(), straight.ens.state_dict(), **EXACT)
    torch.testing.assert_close(resumed.opt.state_dict(), straight.opt.state_dict(), **EXACT)


def roundtrip_export(case: Case, run: Run, tmp: Path) -> None:
    x = case.batches[0][0]
    program = vmapens.export(run.ens, x)
    torch.export.save(program, tmp / "ens.pt2")
    loaded = torch.export.load(tmp / "ens.pt2")
    with torch.no_grad():
        run.ens.eval()
        alone = torch.stack([m.eval()(x) for m in run.ens.unstack()])
        run.ens.train()
    torch.testing.assert_close(loaded.module()(x), alone, **tol(case.dtype))


ROUNDTRIPS = {
    "save": roundtrip_save,
    "state_dicts": roundtrip_state_dicts,
    "members_pt": functools.partial(roundtrip_members, fmt="pt"),
    "members_safetensors": functools.partial(roundtrip_members, fmt="safetensors"),
    "fit": roundtrip_fit,
    "sharded": roundtrip_sharded,
    "export": roundtrip_export,
}


# -- damage ------------------------------------------------------------------------------------


def damaged_save(case: Case, run: Run, tmp: Path, r: random.Random) -> None:
    """A damaged ``vmapens.save`` file: ``restore`` raises naming it and changes nothing."""
    path = tmp / "ens.pt"
    vmapens.save(run.ens, path, optimizer=run.opt)
    how = damage(path, r, tmp, case, run)
    target = Run(case, twins=False)
    target.train(1)
    before = target.snapshot()
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        vmapens.restore(path, target.ens, target.opt)
    assert os.fspath(path) in str(err.value), (how, err.value)
    unchanged(target, before)


def damaged_member(case: Case, run: Run, tmp: Path, r: random.Random) -> None:
    fmt = r.choice(["pt", "safetensors"])
    paths = vmapens.save_members(run.ens, tmp / "members", format=fmt)
    i = r.randrange(len(paths))
    how = damage(paths[i], r, tmp, case, run, members=paths)
    if how.startswith("renamed"):  # a valid state dict of other keys: the module refuses it
        # (BatchNorm fills in a missing num_batches_tracked: then only the new key is named.)
        with pytest.raises(RuntimeError, match=r"(Missing|Unexpected) key\(s\) in state_dict"):
            case.factories()[i]().load_state_dict(vmapens.load_member(paths[i]))
        return
    with pytest.raises(ValueError) as err:
        vmapens.load_member(paths[i])
    assert os.fspath(paths[i]) in str(err.value), (how, err.value)


def damage(path: Path, r: random.Random, tmp: Path, case: Case, run: Run, members=None) -> str:
    """Change the file at ``path`` one random way; returns what it did."""
    data = bytearray(path.read_bytes())
    kinds = ["flip", "cut", "key"] + (["swap"] if members and len(members) > 1 else [])
    kind = r.choice(kinds)
    if kind == "flip":
        at = r.randrange(len(data))
        data[at] ^= 1 << r.randrange(8)
        path.write_bytes(bytes(data))
        return f"flip at {at}/{len(data)}"
    if kind == "cut":
        at = r.randrange(len(data))
        path.write_bytes(bytes(data[:at]))
        return f"cut at {at}/{len(data)}"
    if kind == "swap":
        other = r.choice([p for p in members if p != path])
        shutil.copyfile(other, path)
        return f"swap {other.name}"
    renamed = rename_key(path, r)
    return f"renamed {renamed}"


def rename_key(path: Path, r: random.Random) -> str:
    """Rewrite the file as a valid, sealed file of its kind with one tensor's key renamed."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file, save

        tensors = load_file(path)
        key = r.choice(sorted(tensors))
        tensors["x" + key] = tensors.pop(key)
        path.write_bytes(_files.seal_safetensors(save, tensors))
        return key
    if path.name.startswith("member_"):
        sd = torch.load(path, weights_only=True)
        key = r.choice(sorted(sd))
        sd["x" + key] = sd.pop(key)
        _files.atomic_write(path, _files.seal_torch(sd), "test")
        return key
    payload = checkpoint.read(path, "test")
    if "rows" in payload:  # a block of a sharded checkpoint: rows by their path
        rows = payload["rows"]
        at = r.choice([j for j, row in enumerate(rows) if row[0][0] == "ensemble"])
        where, *rest = rows[at]
        key = where[1]
        rows[at] = ((where[0], "x" + key, *where[2:]), *rest)
    else:
        key = r.choice(sorted(payload["ensemble"]))
        payload["ensemble"]["x" + key] = payload["ensemble"].pop(key)
    checkpoint.write(path, {k: v for k, v in payload.items() if k not in ("format", "version")})
    return key


def damaged_fit(case: Case, run: Run, tmp: Path, r: random.Random) -> None:
    """A damaged fit checkpoint (or a block of a sharded one): resuming raises naming the
    file and changes nothing, the global RNG included."""
    with pytest.raises(KeyboardInterrupt):
        fit_run(case, tmp / "run.pt", 3, [interrupt_after(1)])
    path = victim = tmp / "run.pt"
    if r.random() < 0.5:
        path = tmp / "sharded.pt"
        blocks = shard(tmp / "run.pt", path, r)
        names = sorted(_checkpoint_files.parts_dir(path).iterdir())
        assert len(names) == len(blocks)
        victim = r.choice([path, *names])
    if victim.parent.name.endswith(".members") and r.random() < 0.3:
        # A block of another run of the same members: same values, another run id.
        with pytest.raises(KeyboardInterrupt):
            fit_run(case, tmp / "other.pt", 3, [interrupt_after(1)])
        other = tmp / "other_sharded.pt"
        while len(shard(tmp / "other.pt", other, random.Random(r.random()))) < 2:
            pass
        twin = _checkpoint_files.parts_dir(other) / victim.name
        if not twin.exists():
            return
        shutil.copyfile(twin, victim)
        how = "block of another run"
    else:
        how = damage(victim, r, tmp, case, run)
    target = Run(case, twins=False)
    before = target.snapshot()
    rng = torch.get_rng_state()
    with pytest.raises(ValueError) as err:
        fit_run(case, path, 3, run=target)
    assert os.fspath(victim) in str(err.value), (how, err.value)
    assert "other options" not in str(err.value), err.value
    unchanged(target, before)
    assert torch.equal(torch.get_rng_state(), rng), how


DAMAGES = {
    "damaged_save": damaged_save,
    "damaged_member": damaged_member,
    "damaged_fit": damaged_fit,
}


def run_case(seed: int, tmp: Path, what: str | None = None) -> None:
    """Case ``seed``: train, maybe keep a random sub-ensemble, then one writer and its reader
    (``what``, else a random one)."""
    case = Case(seed)
    r = random.Random(seed * 7919 + 1)
    run = Run(case)
    run.train(r.randint(1, 3))
    run.check_against_plain()
    if case.sched == "none" and r.random() < 0.3:
        run = run.select(r, case)
        run.train(1)
        run.check_against_plain()
    what = what or os.environ.get("ONLY") or r.choice([*ROUNDTRIPS, *DAMAGES])
    if what in DAMAGES:
        DAMAGES[what](case, run, tmp, r)
    else:
        ROUNDTRIPS[what](case, run, tmp)


#: (writer or damage, seed): every writer and reader once, in well under 15 s on one core.
SUITE = [("save", 1), ("state_dicts", 2), ("members_pt", 3), ("members_safetensors", 4),
         ("fit", 5), ("sharded", 6), ("export", 7), ("damaged_save", 8), ("damaged_member", 9),
         ("damaged_fit", 18)]  # fmt: skip


@pytest.mark.parametrize(("what", "seed"), SUITE, ids=[f"{w}-{s}" for w, s in SUITE])
def test_random_file_case(what: str, seed: int, tmp_path: Path) -> None:
    run_case(seed, tmp_path, what)


# -- found by this hunt --------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_a_member_file_copied_over_another_is_refused(fmt: str, tmp_path: Path) -> None:
    """A digest proves a file whole, not whose it is: member 2's file copied over member 1's
    loaded as member 1 with member 2's values. A file renamed by hand names no member and
    loads, with plain torch / safetensors too."""
    from safetensors.torch import load_file

    ens = vmapens.Ensemble(MLP, n=3, seed=0)
    paths = vmapens.save_members(ens, tmp_path, format=fmt)
    shutil.copyfile(paths[2], paths[1])
    where = re.escape(os.fspath(paths[1]))
    with pytest.raises(ValueError, match=rf"^load_member: {where} holds member 2, not member 1"):
        vmapens.load_member(paths[1])
    kept = paths[2].rename(tmp_path / f"best.{fmt}")
    truth = MLP()
    truth.load_state_dict(ens.state_dicts()[2])
    for state in (vmapens.load_member(kept), torch.load(kept) if fmt == "pt" else load_file(kept)):
        module = MLP()
        module.load_state_dict(state)
        torch.testing.assert_close(module.state_dict(), truth.state_dict(), **EXACT)


def test_a_block_without_the_rows_its_checkpoint_names_is_named(tmp_path: Path) -> None:
    """A sealed block whose rows are not the ones the checkpoint names (another layout, a
    renamed key) was "the member blocks of <checkpoint> do not fit together (KeyError)",
    naming no block; now the block is named, and nothing changes."""
    case = Case(3)
    with pytest.raises(KeyboardInterrupt):
        fit_run(case, tmp_path / "run.pt", 3, [interrupt_after(1)])
    path, r = tmp_path / "sharded.pt", random.Random(0)
    while len(shard(tmp_path / "run.pt", path, r)) < 2:
        pass
    block = sorted(_checkpoint_files.parts_dir(path).iterdir())[1]
    rename_key(block, r)
    target = Run(case, twins=False)
    before = target.snapshot()
    named = rf"{re.escape(os.fspath(block))} does not hold the member rows .*sharded\.pt names"
    with pytest.raises(ValueError, match=rf"^load: {named}"):
        vmapens.load(path, case.factory())
    with pytest.raises(ValueError, match=rf"^restore: {named}"):
        vmapens.restore(path, target.ens, target.opt)
    with pytest.raises(ValueError, match=rf"^fit: {named}"):
        fit_run(case, path, 3, run=target)
    unchanged(target, before)


def test_a_file_given_to_the_wrong_reader_says_which_reader_reads_it(tmp_path: Path) -> None:
    """A member file, a block and a checkpoint given to one another's readers said "carries no
    vmapens digest: a truncated or corrupt file" (a sound safetensors file) or "holds no member
    list (got NoneType)" (a block); now each message names the reader that reads the file."""
    ens = vmapens.Ensemble(MLP, n=2, seed=0)
    vmapens.save(ens, tmp_path / "ens.pt")
    member = vmapens.save_members(ens, tmp_path / "pt")[0]
    member_st = vmapens.save_members(ens, tmp_path / "st", format="safetensors")[0]
    case = Case(3)
    with pytest.raises(KeyboardInterrupt):
        fit_run(case, tmp_path / "run.pt", 3, [interrupt_after(1)])
    shard(tmp_path / "run.pt", tmp_path / "sharded.pt", random.Random(0))
    block = sorted(_checkpoint_files.parts_dir(tmp_path / "sharded.pt").iterdir())[0]
    calls = [
        (lambda: vmapens.load(member, MLP), r"holds a state_dict .*vmapens\.load_member"),
        (lambda: vmapens.restore(member_st, ens), r"safetensors file.*vmapens\.load_member"),
        (lambda: vmapens.load(block, MLP), r"block of a sharded checkpoint.*belongs to, .*sharded\.pt$"),
        (lambda: vmapens.load_member(block), r"block of a sharded checkpoint: vmapens\.load the"),
        (lambda: vmapens.load_member(tmp_path / "ens.pt"), r"vmapens checkpoint: read it with vmapens\.load"),
    ]  # fmt: skip
    for call, match in calls:
        with pytest.raises(ValueError, match=match):
            call()
    # A checkpoint that its writer named .safetensors is still a checkpoint.
    vmapens.save(ens, tmp_path / "ens.safetensors")
    back = vmapens.load(tmp_path / "ens.safetensors", MLP)
    torch.testing.assert_close(back.state_dict(), ens.state_dict(), **EXACT)


if __name__ == "__main__":
    import tempfile
    import traceback

    first, count = int(sys.argv[1]), int(sys.argv[2])
    failed = 0
    for seed in range(first, first + count):
        with tempfile.TemporaryDirectory() as d:
            try:
                run_case(seed, Path(d))
            except BaseException as err:  # noqa: BLE001
                failed += 1
                print("FAIL", seed, Case(seed), type(err).__name__, str(err)[:400])
                if "-v" in sys.argv:
                    traceback.print_exc()
    print(f"{failed} of {count} failed")


def test_save_refuses_a_member_held_twice_and_writes_nothing(tmp_path: Path) -> None:
    # vmapens.save wrote ens.select([1, 1]) into a file that vmapens.load then refused
    # ("repeat ids"): refused up front now, as save_members refuses it.
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 2), n=3, seed=0)
    with pytest.raises(ValueError, match=r"^save: `ens` holds a member more than once"):
        vmapens.save(ens.select([1, 1]), tmp_path / "twice.pt")
    assert not list(tmp_path.iterdir())
