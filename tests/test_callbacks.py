"""Each built-in callback used alone against plain PyTorch, and fit's keyword surface.

The truth is plain modules trained alone with torch.optim (tests/truth.py), with early
stopping, best-epoch restore and divergence written out again from their documentation.
"""

from __future__ import annotations

import copy
import inspect
import math

import models
import pytest
import torch
from torch import nn
from truth import assert_members_equal, train_alone, twins

import vmapens
from vmapens._fit_checks import MOVED, STEP_OPTIONS
from vmapens._resume import NOT_COMPARED
from vmapens.callbacks import Checkpoint, Divergence, EarlyStopping

TOL = dict(rtol=1e-9, atol=1e-10)  # float64 throughout: only summation order differs
N = 4
G = torch.Generator().manual_seed(7)
F64 = dict(dtype=torch.float64)
X, Y = torch.randn(12, 4, generator=G, **F64), torch.randn(12, 3, generator=G, **F64)
XV, YV = torch.randn(10, 4, generator=G, **F64), torch.randn(10, 3, generator=G, **F64)
LRS = [1e-3, 1e-2, 3e-2, 1e-1]


def build() -> vmapens.Ensemble:
    return vmapens.Ensemble(models.MLP, n=N, seed=0).double()


def val_loss(model: nn.Module) -> float:
    with torch.no_grad():
        out = nn.functional.mse_loss(model.eval()(XV), YV).item()
    model.train()
    return out


@pytest.mark.parametrize("restore_best", [True, False])
def test_early_stopping_alone_matches_the_naive_early_stopped_loop(restore_best):
    epochs, patience = 14, 2
    ens = build()
    plain = twins(ens.unstack())
    h = vmapens.fit(ens, (X, Y), nn.MSELoss(), epochs=epochs, lr=LRS, shuffle=False,
                    val_data=(XV, YV), progress=False, seed=0,
                    callbacks=[EarlyStopping(patience=patience, restore_best=restore_best)])  # fmt: skip
    # The documented rule, per member alone: after each epoch a member still training improves
    # when its validation loss is below its best; it stops after `patience` epochs without.
    for i, model in enumerate(plain):
        opt = torch.optim.Adam(model.parameters(), lr=LRS[i])
        best, bad, best_epoch, stopped, best_state = math.inf, 0, -1, -1, None
        for epoch in range(epochs):
            train_alone(model, [(X, Y)], make_opt=opt)
            v = val_loss(model)
            torch.testing.assert_close(h.val_loss[epoch, i].item(), v, **TOL)
            if v < best:
                best, bad, best_epoch = v, 0, epoch
                best_state = copy.deepcopy(model.state_dict())
            else:
                bad += 1
            if bad >= patience:
                stopped = epoch
                break
        assert h.best_epoch[i] == best_epoch and h.stopped_epoch[i] == stopped, i
        if restore_best:
            model.load_state_dict(best_state)
    assert (h.stopped_epoch >= 0).any(), "no member stopped: the test would not see patience"
    assert_members_equal(ens, plain, **TOL)


def test_divergence_alone_freezes_the_member_at_its_bad_step_and_spares_the_others():
    lrs = [1e-2, 1e-2, 1e30, 1e-2]  # member 2's loss overflows within a few steps
    ens = build()
    plain = twins(ens.unstack())
    batches = [(X[k : k + 3], Y[k : k + 3]) for k in range(0, 12, 3)]
    h = vmapens.fit(ens, batches, nn.MSELoss(), epochs=3, lr=lrs, optimizer=vmapens.StackedSGD,
                    progress=False, seed=0, callbacks=[Divergence()])  # fmt: skip
    for i, model in enumerate(plain):
        opt = torch.optim.SGD(model.parameters(), lr=lrs[i])
        for _ in range(3):
            for x, y in batches:
                before = copy.deepcopy(model.state_dict())
                loss = nn.functional.mse_loss(model(x), y)
                if not torch.isfinite(loss):  # the documented rule: frozen from this step on
                    model.load_state_dict(before)
                    break
                opt.zero_grad()
                loss.backward()
                opt.step()
            else:
                continue
            break
    assert h.diverged.tolist() == [False, False, True, False]
    assert h.stopped_epoch[2] >= 0 and (h.stopped_epoch[[0, 1, 3]] == -1).all()
    healthy = [0, 1, 3]
    assert_members_equal(ens[healthy], [plain[i] for i in healthy], **TOL)


def test_a_scheduler_attached_to_the_optimizer_but_not_given_is_refused_with_a_checkpoint(tmp_path):
    ens = build()
    opt = vmapens.StackedAdam(ens, lr=LRS)
    torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    before = copy.deepcopy(ens.state_dict())
    with pytest.raises(
        ValueError,
        match=r"^fit: a torch LR scheduler is attached to `optimizer`.*`scheduler`.*`checkpoint`",
    ):
        vmapens.fit(ens, (X, Y), nn.MSELoss(), optimizer=opt, progress=False, seed=0,
                    checkpoint=tmp_path / "ck.pt")  # fmt: skip
    torch.testing.assert_close(ens.state_dict(), before, rtol=0, atol=0)
    assert not (tmp_path / "ck.pt").exists()
    # Given to fit, it runs and is checkpointed.
    vmapens.fit(ens, (X, Y), nn.MSELoss(), optimizer=opt, progress=False, seed=0,
                scheduler=torch.optim.lr_scheduler.StepLR(opt, 1),
                checkpoint=tmp_path / "ck.pt")  # fmt: skip
    assert (tmp_path / "ck.pt").exists()


@pytest.mark.parametrize(
    "change,name",
    [
        (dict(data=(X + 1, Y)), "data"),
        (dict(loss_fn=nn.L1Loss()), "loss_fn"),
        (dict(clip_grad_norm=1.0), "clip_grad_norm"),
        (dict(compile="auto"), "compile"),
        (dict(shuffle=False), "shuffle"),
    ],
    ids=["data", "loss_fn", "clip", "compile", "shuffle"],
)
def test_resume_refuses_any_other_fit_argument(tmp_path, change, name):
    path = tmp_path / "ck.pt"
    base = dict(data=(X, Y), loss_fn=nn.MSELoss(), epochs=1, lr=LRS, batch_size=6,
                progress=False, seed=0, checkpoint=path)  # fmt: skip
    vmapens.fit(build(), **base)
    other = build()
    before = copy.deepcopy(other.state_dict())
    with pytest.raises(ValueError, match=rf"^fit: cannot resume .* other options: {name}="):
        vmapens.fit(other, **{**base, **change, "epochs": 2})
    torch.testing.assert_close(other.state_dict(), before, rtol=0, atol=0)
    overridden = {**base, **change, "epochs": 2, "checkpoint": None}
    h = vmapens.fit(other, **overridden, callbacks=[Checkpoint(path, override=(name,))])
    assert h.epochs == 2


def test_every_fit_argument_is_compared_on_resume_unless_listed_with_a_reason(tmp_path):
    params = inspect.signature(vmapens.fit).parameters
    named = {p for p, v in params.items() if v.kind is not v.VAR_KEYWORD}
    assert set(NOT_COMPARED) <= named, "NOT_COMPARED names an argument fit does not have"
    assert all(reason for reason in NOT_COMPARED.values())
    saver = Checkpoint(tmp_path / "ck.pt")
    vmapens.fit(build(), (X, Y), nn.MSELoss(), progress=False, seed=0, callbacks=[saver])
    # What the checkpoint holds to compare: fit's arguments, less the listed ones, plus the
    # step's options (make_step's signature) and the seed.
    expected = (named - set(NOT_COMPARED)) | set(STEP_OPTIONS)
    assert set(saver.options) == expected
    stored = torch.load(tmp_path / "ck.pt", weights_only=False)["fit"]["options"]
    assert set(stored) == expected | {"seed"}


def test_fit_keeps_at_most_15_keywords_and_moved_ones_give_the_new_spelling():
    params = inspect.signature(vmapens.fit).parameters.values()
    keywords = [p.name for p in params if p.kind is p.KEYWORD_ONLY]
    assert len(keywords) <= 15, keywords
    for old, new in MOVED.items():
        with pytest.raises(TypeError, match=rf"^fit: `{old}` moved in vmapens 0.3.0: pass "):
            vmapens.fit(build(), (X, Y), nn.MSELoss(), progress=False, **{old: None})
        assert "vmapens.callbacks." in new or "in_dims" in new


class _EpochLog(vmapens.Callback):
    """State that grows: empty at the start of a run, one entry per epoch."""

    def __init__(self) -> None:
        self.log: dict[str, float] = {}

    def on_epoch_end(self, ctx: vmapens.callbacks.Context) -> None:
        self.log[f"epoch{ctx.epoch}"] = float(ctx.history.train_loss[-1].sum())

    def state_dict(self) -> dict[str, float]:
        return dict(self.log)

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.log = dict(state)


class _Interrupt(vmapens.Callback):
    """Raises at the end of epoch `at`, after the callbacks before it, before the checkpoint."""

    def __init__(self, at: int | None) -> None:
        self.at = at

    def on_epoch_end(self, ctx: vmapens.callbacks.Context) -> None:
        if ctx.epoch == self.at:
            raise KeyboardInterrupt


def _fit_resumable(path, callbacks: list, epochs: int = 3) -> vmapens.Ensemble:
    ens = build()
    vmapens.fit(ens, (X, Y), nn.MSELoss(), epochs=epochs, batch_size=4, seed=0, progress=False,
                checkpoint=path, callbacks=callbacks)  # fmt: skip
    return ens


def test_callback_whose_state_starts_empty_resumes(tmp_path):
    # Truth: the uninterrupted run's log. The callback defines state_dict, so it is stateful
    # even while its state is empty (at the start of the resumed run, before loading).
    straight = _EpochLog()
    _fit_resumable(tmp_path / "straight.pt", [straight])
    first = _EpochLog()
    with pytest.raises(KeyboardInterrupt):
        _fit_resumable(tmp_path / "ck.pt", [first, _Interrupt(1)])
    resumed = _EpochLog()
    _fit_resumable(tmp_path / "ck.pt", [resumed, _Interrupt(None)])
    assert resumed.log == straight.log and len(straight.log) == 3


def test_csv_logger_logs_each_epoch_once_across_a_resume(tmp_path):
    # The interrupting callback runs after the logger and before the checkpoint: epoch 1 was
    # logged but not checkpointed, and the resumed run redoes it. Truth: the file of the
    # uninterrupted run, row for row.
    straight, log = tmp_path / "straight.csv", tmp_path / "log.csv"
    _fit_resumable(tmp_path / "s.pt", [vmapens.callbacks.CSVLogger(straight)])
    with pytest.raises(KeyboardInterrupt):
        _fit_resumable(tmp_path / "ck.pt", [vmapens.callbacks.CSVLogger(log), _Interrupt(1)])
    assert [row.split(",")[0] for row in log.read_text().splitlines()[1:]].count("1") == N
    _fit_resumable(tmp_path / "ck.pt", [vmapens.callbacks.CSVLogger(log), _Interrupt(None)])
    assert log.read_text() == straight.read_text()


@pytest.mark.parametrize(
    ("changed", "shown"),
    [(nn.HuberLoss(delta=2.0), "delta=2.0"), (nn.HuberLoss(reduction="sum"), "reduction='sum'")],
)
def test_resume_refuses_a_loss_with_other_settings(tmp_path, changed, shown):
    # A loss's repr leaves its settings out (both print "HuberLoss()"): a resumed run that
    # changed them would go on training another objective without a word.
    ens = build()

    def run(loss: nn.Module, *callbacks: vmapens.Callback) -> None:
        vmapens.fit(ens, (X, Y), loss, epochs=3, batch_size=4, seed=0, progress=False,
                    checkpoint=tmp_path / "ck.pt", callbacks=list(callbacks))  # fmt: skip

    with pytest.raises(KeyboardInterrupt):
        run(nn.HuberLoss(), _Interrupt(1))
    held = copy.deepcopy(ens.state_dict())
    with pytest.raises(ValueError, match=rf"loss_fn.*{shown}"):
        run(changed)
    torch.testing.assert_close(ens.state_dict(), held, rtol=0, atol=0)
    run(nn.HuberLoss())  # the same settings resume
