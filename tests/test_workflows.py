"""Ensemble workflows against the truth: metrics and early stopping, callbacks and loggers,
sub-ensembles, target networks, population-based training and sweeps, each compared with
plain modules or runs of single members."""

from __future__ import annotations

import copy
import csv
import sys
from pathlib import Path

import models
import pytest
import torch
from torch import nn
from truth import assert_members_equal, train_alone

import vmapens
from vmapens import Callback, StackedAdam
from vmapens.callbacks import EarlyStopping
from vmapens.pbt import PBT, exploit_, explore
from vmapens.rl import polyak_
from vmapens.selection import best_k

TOL = dict(rtol=1e-9, atol=1e-10)  # float64 throughout
F64 = dict(dtype=torch.float64)
SEEDS = [11, 22, 33, 44]
LRS = [3e-3, 1e-2, 3e-2, 1e-1]


def classification(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 4, generator=g, **F64)
    noisy = (x[:, 0] > 0).long() + (torch.rand(rows, generator=g) < 0.3).long()
    return x, noisy % 3


X, Y = classification(24, 1)
XV, YV = classification(30, 2)


def accuracy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.argmax(-1) == y).double().mean()


def build(seeds=SEEDS) -> vmapens.Ensemble:
    return vmapens.Ensemble(models.MLP, n=len(seeds), seeds=seeds).double()


def alone(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return models.MLP().double()


#: What fit(batch_size=8, shuffle=False) feeds every member in one epoch.
BATCHES = [(X[k : k + 8], Y[k : k + 8]) for k in range(0, len(X), 8)]


def plain(seeds=SEEDS, lrs=LRS) -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
    """The members as plain modules, each with its own torch.optim.Adam."""
    members = [alone(s) for s in seeds]
    return members, [torch.optim.Adam(m.parameters(), lr=lr) for m, lr in zip(members, lrs)]


def states_equal(a: vmapens.Ensemble, b: vmapens.Ensemble) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


# -- metrics, monitor and early stopping -----------------------------------------------------


def naive_metric_run(epochs: int, patience: int) -> dict:
    """Plain modules and torch.optim.Adam, early-stopped on validation accuracy by hand."""
    members, opts = plain()
    best = [-1.0] * len(members)
    best_state = [copy.deepcopy(m.state_dict()) for m in members]
    best_epoch, stopped, bad = [-1] * 4, [-1] * 4, [0] * 4
    accs, whole = [], []
    for epoch in range(epochs):
        row = []
        for i, (m, opt) in enumerate(zip(members, opts)):
            if stopped[i] < 0:
                train_alone(m, BATCHES, nn.functional.cross_entropy, opt)
        with torch.no_grad():
            outs = [m(XV) for m in members]
        for i, out in enumerate(outs):
            acc = float(accuracy(out, YV))
            row.append(acc if stopped[i] < 0 else float("nan"))
            if stopped[i] >= 0:
                continue
            if acc > best[i]:
                best[i], best_epoch[i], bad[i] = acc, epoch, 0
                best_state[i] = copy.deepcopy(members[i].state_dict())
            else:
                bad[i] += 1
                if bad[i] >= patience:
                    stopped[i] = epoch
        accs.append(row)
        whole.append(float(accuracy(sum(outs) / len(outs), YV)))
    for m, s in zip(members, best_state):
        m.load_state_dict(s)
    return dict(members=members, acc=accs, ensemble=whole, best=best_epoch, stopped=stopped)


def test_metric_early_stopping_matches_a_hand_written_loop():
    epochs, patience = 12, 2
    naive = naive_metric_run(epochs, patience)
    ens = build()
    h = vmapens.fit(ens, (X, Y), nn.CrossEntropyLoss(), epochs=epochs, batch_size=8,
                    shuffle=False, lr=LRS, val_data=(XV, YV), metrics={"acc": accuracy},
                    callbacks=[EarlyStopping("val_acc", "max", patience=patience)],
                    progress=False)  # fmt: skip
    assert (h.stopped_epoch >= 0).any(), "the case must stop some member early"
    assert h.stopped_epoch.tolist() == naive["stopped"]
    assert h.best_epoch.tolist() == naive["best"]
    torch.testing.assert_close(h.metrics["acc"], torch.tensor(naive["acc"], **F64)[: h.epochs],
                               equal_nan=True, **TOL)  # fmt: skip
    torch.testing.assert_close(
        h.ensemble_metrics["acc"], torch.tensor(naive["ensemble"], **F64)[: h.epochs], **TOL
    )
    for got, expected in zip(ens.unstack(), naive["members"]):
        torch.testing.assert_close(got.state_dict(), expected.state_dict(), **TOL)


def test_metrics_are_checkpointed_and_resume(tmp_path: Path):
    options = dict(epochs=4, batch_size=8, lr=LRS, val_data=(XV, YV), seed=0, progress=False,
                   metrics={"acc": accuracy})  # fmt: skip

    def watch(monitor="val_acc"):
        return EarlyStopping(monitor, "max")

    def stop_after_two(history):
        if history.epochs == 2:
            raise KeyboardInterrupt

    first = build()
    with pytest.raises(KeyboardInterrupt):
        vmapens.fit(first, (X, Y), nn.CrossEntropyLoss(), checkpoint=tmp_path / "a.pt",
                    callbacks=[watch(), stop_after_two], **options)  # fmt: skip
    resumed = build()
    h = vmapens.fit(resumed, (X, Y), nn.CrossEntropyLoss(), checkpoint=tmp_path / "a.pt",
                    callbacks=[watch()], **options)  # fmt: skip
    straight = build()
    h2 = vmapens.fit(straight, (X, Y), nn.CrossEntropyLoss(), callbacks=[watch()], **options)
    assert states_equal(resumed, straight)
    assert torch.equal(h.metrics["acc"], h2.metrics["acc"])
    assert torch.equal(h.ensemble_metrics["acc"], h2.ensemble_metrics["acc"])
    with pytest.raises(ValueError, match="other options: metrics"):
        vmapens.fit(build(), (X, Y), nn.CrossEntropyLoss(), checkpoint=tmp_path / "a.pt",
                    callbacks=[watch("val_a2")], **{**options, "metrics": {"a2": accuracy}})  # fmt: skip


class StatefulAccuracy:
    """The reset/update/compute protocol of a torchmetrics Metric (not installed here)."""

    def reset(self):
        self.hits, self.count = 0.0, 0

    def update(self, out, y):
        self.hits += float((out.argmax(-1) == y).sum())
        self.count += len(y)

    def compute(self):
        return torch.tensor(self.hits / self.count, **F64)


def test_stateful_metric_objects_run_member_by_member():
    options = dict(epochs=2, batch_size=8, lr=LRS, val_data=(XV, YV), seed=0, progress=False)
    fn = vmapens.fit(build(), (X, Y), nn.CrossEntropyLoss(), metrics={"acc": accuracy}, **options)
    obj = vmapens.fit(build(), (X, Y), nn.CrossEntropyLoss(), metrics={"acc": StatefulAccuracy()},
                      **options)  # fmt: skip
    torch.testing.assert_close(obj.metrics["acc"], fn.metrics["acc"], **TOL)
    torch.testing.assert_close(obj.ensemble_metrics["acc"], fn.ensemble_metrics["acc"], **TOL)


METRIC_ERRORS = [
    (
        "monitor-unknown",
        dict(callbacks=[EarlyStopping(monitor="val_f1")]),
        ValueError,
        r"fit: `EarlyStopping.monitor` must be one of",
    ),
    ("mode-moved", dict(mode="max"), TypeError, r"fit: `mode` moved in vmapens 0.3.0"),
    ("no-val", dict(val_data=None), ValueError, r"fit: `metrics` need shared `val_data`"),
    ("not-callable", dict(metrics={"acc": 3}), TypeError, r"fit: `metrics` must map names"),
]


@pytest.mark.parametrize(("case", "options", "exc", "match"), METRIC_ERRORS,
                         ids=[c[0] for c in METRIC_ERRORS])  # fmt: skip
def test_metric_options_are_checked(case, options, exc, match):
    options = {"val_data": (XV, YV), "metrics": {"acc": accuracy}, **options}
    with pytest.raises(exc, match=match):
        vmapens.fit(build(), (X, Y), nn.CrossEntropyLoss(), progress=False, **options)


# -- callbacks and loggers ---------------------------------------------------------------------


class Recorder(Callback):
    def __init__(self):
        self.steps, self.epochs = [], []

    def on_step_end(self, ctx):
        self.steps.append((ctx.epoch, ctx.step, ctx.losses.clone()))

    def on_epoch_end(self, ctx):
        self.epochs.append((ctx.epoch, ctx.history.epochs, ctx.losses.clone()))


def test_callbacks_see_every_step_and_epoch():
    rec, plain = Recorder(), []
    ens = build()
    h = vmapens.fit(ens, (X, Y), nn.CrossEntropyLoss(), epochs=2, batch_size=8, shuffle=False,
                    lr=LRS, progress=False, callbacks=[rec, plain.append])  # fmt: skip
    assert [(e, s) for e, s, _ in rec.steps] == [(0, 1), (0, 2), (0, 3), (1, 4), (1, 5), (1, 6)]
    per_epoch = torch.stack([loss for _, _, loss in rec.steps]).view(2, 3, 4).mean(1)
    torch.testing.assert_close(per_epoch, h.train_loss, **TOL)
    assert [(e, rows) for e, rows, _ in rec.epochs] == [(0, 1), (1, 2)]
    assert plain == [h, h]


def test_context_stop_freezes_members_as_early_stopping_does():
    class StopOne(Callback):
        def on_epoch_end(self, ctx):
            if ctx.epoch == 0:
                ctx.stop([1])

    ens = build()
    h = vmapens.fit(ens, (X, Y), nn.CrossEntropyLoss(), epochs=3, batch_size=8, lr=LRS,
                    shuffle=False, progress=False, callbacks=[StopOne()])  # fmt: skip
    members, opts = plain()
    for i, (m, opt) in enumerate(zip(members, opts)):
        train_alone(m, BATCHES * (1 if i == 1 else 3), nn.functional.cross_entropy, opt)
    assert h.stopped_epoch.tolist() == [-1, 0, -1, -1]
    assert torch.isnan(h.train_loss[1:, 1]).all()
    assert_members_equal(ens, members, **TOL)


def test_csv_logger_writes_the_history(tmp_path: Path):
    path = tmp_path / "log.csv"
    ens = build()
    h = vmapens.fit(ens, (X, Y), nn.CrossEntropyLoss(), epochs=3, batch_size=8, lr=LRS,
                    val_data=(XV, YV), metrics={"acc": accuracy}, progress=False,
                    callbacks=[vmapens.callbacks.CSVLogger(path)])  # fmt: skip
    rows = list(csv.DictReader(path.read_text().splitlines()))
    assert len(rows) == 3 * 4
    for r in rows:
        e, m = int(r["epoch"]), int(r["member"])
        assert float(r["train_loss"]) == h.train_loss[e, m].item()
        assert float(r["val_loss"]) == h.val_loss[e, m].item()
        assert float(r["acc"]) == h.metrics["acc"][e, m].item()
        assert float(r["ensemble_acc"]) == h.ensemble_metrics["acc"][e].item()
        assert float(r["lr"]) == LRS[m]


def test_tensorboard_logger_writes_per_member_scalars(tmp_path: Path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = vmapens.callbacks.TensorBoardLogger(tmp_path)
    h = vmapens.fit(build(), (X, Y), nn.CrossEntropyLoss(), epochs=2, lr=LRS, progress=False,
                    callbacks=[logger])  # fmt: skip
    logger.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert {f"train_loss/member_{i}" for i in range(4)} <= set(events.Tags()["scalars"])
    got = [e.value for e in events.Scalars("train_loss/member_2")]
    torch.testing.assert_close(torch.tensor(got, **F64), h.train_loss[:, 2], rtol=1e-6, atol=0)


def test_tensorboard_logger_without_tensorboard_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"pip install 'vmapens\[tensorboard\]'"):
        vmapens.callbacks.TensorBoardLogger(tmp_path)


# -- sub-ensembles ----------------------------------------------------------------------------


def test_best_k_then_training_equals_training_only_those_members():
    options = dict(batch_size=8, shuffle=False, progress=False)
    ens = build()
    opt = StackedAdam(ens, lr=LRS)
    h = vmapens.fit(ens, (X, Y), nn.CrossEntropyLoss(), epochs=3, optimizer=opt,
                    val_data=(XV, YV), callbacks=[EarlyStopping(restore_best=False)],
                    **options)  # fmt: skip
    sub, sub_opt = best_k(ens, h, 2, optimizer=opt)
    rows = list(sub.member_ids)
    scores = h.val_loss.nan_to_num(torch.inf).amin(0)
    assert rows == scores.argsort()[:2].tolist()
    vmapens.fit(sub, (X, Y), nn.CrossEntropyLoss(), epochs=2, optimizer=sub_opt, **options)
    members, opts = plain([SEEDS[r] for r in rows], [LRS[r] for r in rows])
    for m, opt in zip(members, opts):  # 3 epochs in the ensemble, 2 in the sub-ensemble
        train_alone(m, BATCHES * 5, nn.functional.cross_entropy, opt)
    assert_members_equal(sub, members, **TOL)


RANKINGS = [
    ("min", [0.3, 0.1, 0.4, 0.2], "min", [1, 3]),
    ("max", [0.3, 0.1, 0.4, 0.2], "max", [2, 0]),
    ("nan-last", [float("nan"), 0.5, 0.5, 0.9], "min", [1, 2]),
    ("nan-last-max", [float("nan"), 0.5, 0.1, 0.9], "max", [3, 1]),
]


@pytest.mark.parametrize(("case", "scores", "mode", "rows"), RANKINGS, ids=[r[0] for r in RANKINGS])
def test_best_k_ranks_scores(case, scores, mode, rows):
    sub = best_k(build(), torch.tensor(scores), 2, mode=mode)
    assert list(sub.member_ids) == rows


# -- reinforcement learning ---------------------------------------------------------------------


@pytest.mark.parametrize("tau", [0.0, 0.005, 0.3, 1.0])
def test_polyak_matches_a_per_parameter_loop(tau):
    online = vmapens.Ensemble(models.CNN, n=3, seed=0).double()
    target = vmapens.rl.make_target(online)
    twins = [m for m in target.unstack()]
    with torch.no_grad():
        online(torch.randn(4, 1, 6, 6, **F64))  # new running statistics in online's buffers
        for p in online.parameters():
            p.add_(torch.randn_like(p))
    polyak_(target, online, tau)
    for twin, src in zip(twins, online.unstack()):
        with torch.no_grad():
            for p, q in zip(twin.parameters(), src.parameters()):
                p.mul_(1 - tau).add_(q, alpha=tau)
            for b, c in zip(twin.buffers(), src.buffers()):
                b.copy_(c)
    for got, expected in zip(target.unstack(), twins):
        torch.testing.assert_close(got.state_dict(), expected.state_dict(), **TOL)
    assert not any(p.requires_grad for p in target.parameters())
    assert all(p.requires_grad for p in online.parameters())


def test_random_members():
    masks = [vmapens.rl.random_members(8, 3, torch.Generator().manual_seed(5)) for _ in range(2)]
    assert torch.equal(masks[0], masks[1]) and masks[0].dtype == torch.bool
    assert int(masks[0].sum()) == 3
    with pytest.raises(ValueError, match=r"random_members: `k` must be <= `n`"):
        vmapens.rl.random_members(2, 3)


# -- population-based training ------------------------------------------------------------------


def trained(optimizer_cls=StackedAdam):
    ens = build()
    opt = (
        optimizer_cls(ens, lr=LRS)
        if optimizer_cls is StackedAdam
        else optimizer_cls(ens.parameters())
    )
    vmapens.fit(ens, (X, Y), nn.CrossEntropyLoss(), epochs=2, batch_size=8, optimizer=opt,
                progress=False, seed=0)  # fmt: skip
    return ens, opt


@pytest.mark.parametrize("optimizer_cls", [StackedAdam, torch.optim.Adam], ids=["stacked", "torch"])
def test_exploit_copies_members_and_their_optimizer_state(optimizer_cls):
    ens, opt = trained(optimizer_cls)
    stacked = optimizer_cls is StackedAdam
    before = copy.deepcopy(ens.state_dicts())
    opt_before = [opt.member_state_dict(i) for i in range(4)] if stacked else []
    exploit_(ens, opt, [0, 1], [3, 0])  # rows read before written: 0 -> 3 and 1 -> 0
    after = ens.state_dicts()
    for dst, src in ((3, 0), (0, 1), (1, 1), (2, 2)):
        torch.testing.assert_close(after[dst], before[src], rtol=0, atol=0)
        if stacked:  # moments, step counts and the member's own lr
            torch.testing.assert_close(opt.member_state_dict(dst), opt_before[src], rtol=0, atol=0)
    # From here on, rows 0 and 1 (both copies of the old member 1) train alike.
    vmapens.fit(ens, (X, Y), nn.CrossEntropyLoss(), epochs=1, optimizer=opt, progress=False, seed=0)
    states = ens.state_dicts()
    torch.testing.assert_close(states[0], states[1], rtol=0, atol=0)


def test_explore_is_seeded_and_keeps_member_values():
    def run():
        opt = StackedAdam(build(), lr=1e-2)
        explore(opt, [1, 3], factors=(0.5, 2.0), generator=torch.Generator().manual_seed(3))
        return opt.param_groups[0]["lr"]

    lr = run()
    assert isinstance(lr, vmapens.optim.MemberValues) and lr == run()
    assert lr[0] == lr[2] == 1e-2 and {lr[1], lr[3]} <= {5e-3, 2e-2}
    with pytest.raises(ValueError, match=r"explore: `names` must be among"):
        explore(StackedAdam(build()), [0], names=("betas",))


def pbt_fit(path: Path | None = None, callbacks=(), pbt_seed: int = 0):
    ens = build()
    pbt = PBT(interval=2, fraction=0.25, seed=pbt_seed)
    opt = StackedAdam(ens, lr=LRS)
    h = vmapens.fit(ens, (X, Y), nn.CrossEntropyLoss(), epochs=6, batch_size=8, seed=0,
                    optimizer=opt, val_data=(XV, YV), progress=False, checkpoint=path,
                    callbacks=[pbt, *callbacks])  # fmt: skip
    return ens, pbt, h, opt


def test_pbt_is_deterministic_and_acts():
    a, pbt_a, h, opt_a = pbt_fit()
    b, pbt_b, _, opt_b = pbt_fit()
    assert states_equal(a, b) and pbt_a.log == pbt_b.log
    assert opt_a.param_groups[0]["lr"] == opt_b.param_groups[0]["lr"]
    assert [e for e, _, _ in pbt_a.log] == [1, 3, 5]
    # The first round: the worst member at epoch 1 copies the best one, then its lr moves.
    (_, src, dst) = pbt_a.log[0]
    assert dst == [int(h.val_loss[1].argmax())] and src == [int(h.val_loss[1].argmin())]
    assert opt_a.param_groups[0]["lr"].tolist() != LRS


def test_pbt_resumes_bit_identical(tmp_path: Path):
    def stop_after_three(history):
        if history.epochs == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pbt_fit(tmp_path / "pbt.pt", callbacks=[stop_after_three])
    resumed, pbt_r, h_r, _ = pbt_fit(tmp_path / "pbt.pt")
    straight, pbt_s, h_s, _ = pbt_fit(tmp_path / "straight.pt")
    assert states_equal(resumed, straight)
    assert pbt_r.log == pbt_s.log
    assert torch.equal(h_r.val_loss, h_s.val_loss)
