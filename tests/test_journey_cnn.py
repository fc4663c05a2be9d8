"""A user journey: a deep ensemble of small CNN+BatchNorm classifiers trained with `fit`.

The script a researcher writes: a shuffling DataLoader over a Dataset whose random flip draws
from torch's global RNG (as torchvision's transforms do), AdamW with one learning rate per
member and weight decay only in the non-bias param group, a cosine schedule stepped per epoch
or a one-cycle schedule stepped per step, validation accuracy as the early-stopping monitor
with best-epoch restore, a checkpoint, an interruption at epoch 2 and a resume, then
`save_members` and each file loaded into a plain module. The truth is the naive loop in plain
PyTorch, one member at a time: its own DataLoader with the same generator seed and the same
global RNG state (docs/fit.md: each pass makes one iterator and nothing else draws from the
RNG a DataLoader shuffles with), `torch.optim.AdamW` with the same two groups, torch's
scheduler, and early stopping written from `EarlyStopping`'s documented rule (a member
improves when its monitor is strictly better than its best so far; it stops after `patience`
epochs without improvement, at that epoch's end, and misses that epoch's scheduler step).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

import vmapens
from vmapens.callbacks import Callback, Context, EarlyStopping, LRScheduler
from vmapens.optim import MemberValues

pytestmark = pytest.mark.usefixtures("float64_default")

N, EPOCHS, BATCH, PATIENCE = 4, 6, 16, 2
LRS = [0.1, 0.05, 0.2, 0.03]
WEIGHT_DECAY = 1e-2
GLOBAL_SEED, LOADER_SEED = 123, 7
STEPS_PER_EPOCH = 3  # 48 samples in batches of 16
TOL = {"atol": 1e-10, "rtol": 1e-10}


def member() -> nn.Module:
    # bias=False before BatchNorm: that bias's true gradient is 0 and Adam would step on its
    # round-off (docs/semantics.md), in plain PyTorch as in the ensemble.
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, bias=False),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    )


def label(x: Tensor) -> Tensor:
    # Top rows against bottom rows: a horizontal flip keeps the class.
    d = x[:, 0, :4].mean((1, 2)) - x[:, 0, 4:].mean((1, 2))
    return (d > -0.1).long() + (d > 0.1).long()


def images() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 1, 8, 8, generator=g, dtype=torch.float64)
    xv = torch.randn(40, 1, 8, 8, generator=g, dtype=torch.float64)
    return x, label(x), xv, label(xv)


class Flips(Dataset):
    """A random horizontal flip drawn from torch's global RNG, as torchvision's transform."""

    def __init__(self, x: Tensor, y: Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        x = self.x[i]
        if torch.rand(()) < 0.5:
            x = x.flip(-1)
        return x, self.y[i]


def loader(x: Tensor, y: Tensor) -> DataLoader:
    return DataLoader(
        Flips(x, y),
        batch_size=BATCH,
        shuffle=True,
        generator=torch.Generator().manual_seed(LOADER_SEED),
    )


def accuracy(out: Tensor, target: Tensor) -> Tensor:
    return (out.argmax(-1) == target).double().mean()


def groups(named: Iterable[tuple[str, nn.Parameter]]) -> list[dict[str, Any]]:
    named = list(named)
    return [
        {"params": [p for k, p in named if not k.endswith("bias")], "weight_decay": WEIGHT_DECAY},
        {"params": [p for k, p in named if k.endswith("bias")], "weight_decay": 0.0},
    ]


def schedule(kind: str, opt: torch.optim.Optimizer, max_lr: Any) -> Any:
    if kind == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=EPOCHS)
    return torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=max_lr, total_steps=EPOCHS * STEPS_PER_EPOCH
    )


def alone(kind: str, model: nn.Module, i: int) -> dict[str, Any]:
    """Member `i` trained by the naive loop, from the same global RNG and loader seeds."""
    x, y, xv, yv = images()
    torch.manual_seed(GLOBAL_SEED)
    data = loader(x, y)
    opt = torch.optim.AdamW(groups(model.named_parameters()), lr=LRS[i])
    sched = schedule(kind, opt, LRS[i])
    best, bad, best_state, best_epoch, stopped = -float("inf"), 0, None, -1, -1
    accs, train_losses = [], []
    for epoch in range(EPOCHS):
        model.train()
        losses = []
        for xb, yb in data:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if kind == "onecycle":
                sched.step()
        train_losses.append(sum(losses) / len(losses))
        model.eval()
        with torch.no_grad():
            acc = float(accuracy(model(xv), yv))
        accs.append(acc)
        if acc > best:
            best, bad, best_state, best_epoch = acc, 0, copy.deepcopy(model.state_dict()), epoch
        else:
            bad += 1
        if bad >= PATIENCE:
            stopped = epoch
            break
        if kind == "cosine":
            sched.step()
    assert best_state is not None
    model.load_state_dict(best_state)
    return {
        "model": model.eval(),
        "opt": opt,
        "best_epoch": best_epoch,
        "stopped": stopped,
        "acc": accs,
        "train_loss": train_losses,
    }


class Interrupt(Callback):
    """A pre-empted job: `KeyboardInterrupt` once, at epoch 2's end or in its second step."""

    def __init__(self, where: str) -> None:
        self.where, self.armed = where, True

    def on_epoch_end(self, ctx: Context) -> None:
        if self.where == "epoch_end" and self.armed and ctx.epoch == 2:
            self.armed = False
            raise KeyboardInterrupt

    def on_step_end(self, ctx: Context) -> None:
        if self.where == "mid_epoch" and self.armed and ctx.epoch == 2:
            self.armed = False
            raise KeyboardInterrupt


def after_two_epochs(history: vmapens.History) -> None:
    if history.epochs == 2:  # a plain callable runs after the checkpoint is written
        raise KeyboardInterrupt


def build(kind: str) -> tuple[vmapens.Ensemble, vmapens.StackedAdam, list[Callback]]:
    ens = vmapens.Ensemble(member, n=N, seed=0)
    opt = vmapens.StackedAdam(groups(ens.named_parameters()), lr=LRS, decoupled_weight_decay=True)
    interval = "epoch" if kind == "cosine" else "step"
    sched = LRScheduler(lambda o: schedule(kind, o, MemberValues(LRS)), interval=interval)
    return ens, opt, [EarlyStopping("val_acc", "max", patience=PATIENCE), sched]


CASES = [
    # (schedule, interruption, whether the resume rebuilds every object as a new process would)
    pytest.param("cosine", "callable", True, id="cosine-epoch-callable-new-process"),
    pytest.param("onecycle", "callable", True, id="onecycle-step-callable-new-process"),
    pytest.param("onecycle", "mid_epoch", False, id="onecycle-step-mid-epoch-same-objects"),
    pytest.param("cosine", "epoch_end", False, id="cosine-epoch-callback-same-objects"),
]
_ALONE: dict[str, list[dict[str, Any]]] = {}


@pytest.mark.parametrize(("kind", "interrupt", "new_process"), CASES)
def test_cnn_ensemble_journey_matches_the_naive_loop(
    tmp_path: Path, kind: str, interrupt: str, new_process: bool
) -> None:
    x, y, xv, yv = images()
    ens, opt, callbacks = build(kind)
    init = [copy.deepcopy(m) for m in ens.unstack()]
    options: dict[str, Any] = dict(
        epochs=EPOCHS,
        val_data=(xv, yv),
        metrics={"acc": accuracy},
        progress=False,
        checkpoint=tmp_path / "run.pt",
    )
    crash: Any = after_two_epochs if interrupt == "callable" else Interrupt(interrupt)
    data = loader(x, y)
    torch.manual_seed(GLOBAL_SEED)
    with pytest.raises(KeyboardInterrupt):
        vmapens.fit(ens, data, nn.CrossEntropyLoss(), optimizer=opt,
                    callbacks=[*callbacks, crash], **options)  # fmt: skip
    torch.manual_seed(999)  # whatever the process did since: the checkpoint holds the RNG
    if new_process:
        ens, opt, callbacks = build(kind)
        data = loader(x, y)
    else:
        callbacks = [*callbacks, crash]  # disarmed: the same list, called again
    history = vmapens.fit(ens, data, nn.CrossEntropyLoss(), optimizer=opt,
                          callbacks=callbacks, **options)  # fmt: skip

    if kind not in _ALONE:
        _ALONE[kind] = [alone(kind, copy.deepcopy(init[i]), i) for i in range(N)]
    truth = _ALONE[kind]
    paths = vmapens.save_members(ens, tmp_path / "members")
    members = vmapens.predict(ens, xv)
    assert history.stopped_epoch.tolist() == [t["stopped"] for t in truth]
    assert history.best_epoch.tolist() == [t["best_epoch"] for t in truth]
    assert history.metrics is not None
    for i, t in enumerate(truth):
        ran = len(t["acc"])
        torch.testing.assert_close(history.metrics["acc"][:ran, i], torch.tensor(t["acc"]))
        torch.testing.assert_close(
            history.train_loss[:ran, i], torch.tensor(t["train_loss"]), **TOL
        )
        assert history.metrics["acc"][ran:, i].isnan().all()
        # The ensemble's member (best epoch restored), its file in a plain module, the naive one.
        plain = member()
        plain.load_state_dict(torch.load(paths[i], weights_only=True))
        for got in (ens[i].state_dict(), plain.state_dict()):
            for (name, want), have in zip(t["model"].state_dict().items(), got.values()):
                torch.testing.assert_close(have, want, **TOL, msg=f"member {i} {name}")
        with torch.no_grad():
            out = plain.eval()(xv)
            torch.testing.assert_close(out, t["model"](xv), **TOL)
        torch.testing.assert_close(members[i], out, **TOL)
        # The optimizer where the member stopped: its own lr and beta1 from its schedule.
        mine, theirs = opt.member_state_dict(i), t["opt"].state_dict()
        for group, want_group in zip(mine["param_groups"], theirs["param_groups"]):
            for key in ("lr", "betas", "weight_decay", "initial_lr"):
                assert group[key] == pytest.approx(want_group[key], rel=1e-12), (i, key)
        for key, state in theirs["state"].items():
            for name in ("step", "exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(mine["state"][key][name], state[name], **TOL)
    probs = vmapens.predict(ens, xv, reduce="mean", softmax=True)
    with torch.no_grad():
        want = torch.stack([t["model"](xv).softmax(-1) for t in truth]).mean(0)
    torch.testing.assert_close(probs, want, **TOL)
