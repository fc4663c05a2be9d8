"""User journey: a long run's lifecycle with members that keep tensors on themselves.

Two members a researcher trains for a while: one keeps an auxiliary loss (``self.aux = ...``,
read by the ``loss_fn`` as ``ens.template.aux``, as a plain loop reads ``model.aux``), one
keeps a GRU cell's hidden state for the next batch (``self.h = h.detach()``: truncated BPTT,
under vmap only: docs/semantics.md, members in turns refuse it). Each goes through what a
long run meets: ``fit`` with validation, early stopping (patience) and the best epoch
restored, a callback reading the kept tensor each epoch, a checkpoint and a resume (in a new
ensemble, and again on the same one), a reset of the hidden state between epochs, ``ens[i]``,
``unstack``, ``select``, ``best_k``, ``copy.deepcopy``, ``torch.save``, ``vmapens.save``/
``load``, ``Ensemble.apply`` and PBT's ``exploit_``.

The truth: each member a plain module trained alone with ``torch.optim.Adam`` on the same
batches (``shuffle=False``), with early stopping, best-state restore and PBT's copy written by
hand (``load_state_dict``, which, like a plain resume, carries no plain attribute), float64.
"""

from __future__ import annotations

import copy
import io
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import vmapens

N, B, T = 3, 4, 3
F64 = torch.float64
TOL: dict[str, Any] = dict(rtol=1e-9, atol=1e-10)
BACKENDS = [{}, {"chunk_size": 2}, {"backend": "loop"}]
IDS = ["vmap", "chunks", "loop"]
LRS = [0.3, 0.05, 0.01]  # member 0 overshoots and stops early, member 1 later, member 2 never
W = 0.1  # the aux loss's weight


def _mse(out: Tensor, y: Tensor) -> Tensor:
    return nn.functional.mse_loss(out, y)


def _assert_members(ens: vmapens.Ensemble, alone: list[nn.Module]) -> None:
    for i, m in enumerate(alone):
        got, want = ens[i].state_dict(), m.state_dict()
        for k in want:
            torch.testing.assert_close(got[k], want[k], **TOL, msg=f"member {i} {k}")


# -- a member that keeps an auxiliary loss ----------------------------------------------------


class Aux(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 5, dtype=F64)
        self.head = nn.Linear(5, 1, dtype=F64)
        self.aux: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.fc(x))
        self.aux = h.pow(2).mean()
        return self.head(h)


def _xy(rows: int, seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 3, generator=g, dtype=F64)
    return x, x.sum(1, keepdim=True).sin() + 0.3 * torch.randn(rows, 1, generator=g, dtype=F64)


TRAIN, VAL = _xy(24, 0), _xy(10, 1)


def _aux_alone(m: Aux, lr: float, epochs: int, patience: int) -> tuple[list[float], list[float]]:
    """The naive loop: Adam, batches of 8 in order, validation after each epoch (eval, no
    grad), stop after `patience` epochs without improvement, best state restored. Returns the
    validation losses and `m.aux` read after each validation."""
    opt = torch.optim.Adam(m.parameters(), lr=lr)
    x, y = TRAIN
    best, bad, best_state = float("inf"), 0, copy.deepcopy(m.state_dict())
    vals, auxes = [], []
    for _ in range(epochs):
        for k in range(0, len(x), 8):
            opt.zero_grad()
            out = m(x[k : k + 8])
            assert m.aux is not None
            (_mse(out, y[k : k + 8]) + W * m.aux).backward()
            opt.step()
        m.eval()
        with torch.no_grad():
            v = (_mse(m(VAL[0]), VAL[1]) + W * m.aux).item()
        m.train()
        vals.append(v)
        auxes.append(float(m.aux))
        if v < best:
            best, bad, best_state = v, 0, copy.deepcopy(m.state_dict())
        else:
            bad += 1
        if bad >= patience:
            break
    m.load_state_dict(best_state)
    return vals, auxes


class ReadAux(vmapens.Callback):
    """What a logger does: read each member's kept aux loss after the epoch's validation."""

    def __init__(self) -> None:
        self.seen: list[Tensor] = []

    def on_epoch_end(self, ctx: Any) -> None:
        self.seen.append(ctx.ensemble.template.aux.clone())


def _aux_fit(how: dict, checkpoint: Path | None = None, callbacks: list | None = None) -> Any:
    ens = vmapens.Ensemble(Aux, n=N, seed=0, **how)
    opt = vmapens.StackedAdam(ens, lr=torch.tensor(LRS, dtype=F64))

    def loss(out: Tensor, y: Tensor) -> Tensor:  # each member's own aux, as alone
        return _mse(out, y) + W * ens.template.aux

    history = vmapens.fit(ens, TRAIN, loss, epochs=6, batch_size=8, shuffle=False,
                          val_data=VAL, optimizer=opt, patience=2, progress=False, seed=0,
                          callbacks=callbacks or [], checkpoint=checkpoint)  # fmt: skip
    return ens, history


@pytest.mark.parametrize("how", BACKENDS, ids=IDS)
def test_aux_loss_fit_with_patience_best_restore_and_a_logger_equals_alone(how: dict) -> None:
    """fit's step and validation loss read each member's own `ens.template.aux`; members stop
    at their own epochs (3, 5, never) and get their best epochs back; a callback reading the
    kept aux after each epoch reads each member's, a stopped member's the last it computed."""
    reader = ReadAux()
    ens, history = _aux_fit(how, callbacks=[reader])
    alone = vmapens.Ensemble(Aux, n=N, seed=0).unstack()
    naive = [_aux_alone(m, lr, 6, 2) for m, lr in zip(alone, LRS)]
    _assert_members(ens, alone)
    assert history.stopped_epoch.tolist() == [3, 5, -1]
    seen = torch.stack(reader.seen)  # [epochs, n]
    for i, (vals, auxes) in enumerate(naive):
        got = history.val_loss[:, i]
        torch.testing.assert_close(got[: len(vals)], torch.tensor(vals, dtype=F64), **TOL)
        assert got[len(vals) :].isnan().all()
        torch.testing.assert_close(seen[: len(auxes), i], torch.tensor(auxes, dtype=F64), **TOL)
        torch.testing.assert_close(seen[len(auxes) :, i], seen[len(auxes) - 1, i].expand(
            len(seen) - len(auxes)), **TOL)  # fmt: skip
    with torch.no_grad():  # and after the run: every member's aux for a new batch
        ens(VAL[0])
        for i, m in enumerate(alone):
            m(VAL[0])
            torch.testing.assert_close(ens.template.aux[i], m.aux, **TOL)


@pytest.mark.parametrize("how", BACKENDS[::2], ids=IDS[::2])
def test_aux_loss_fit_resumed_is_bit_identical_then_best_k_keeps_own_aux(
    how: dict, tmp_path: Path
) -> None:
    """docs/fit.md: a run interrupted after epoch 2 and resumed in a new ensemble (the loss
    closes over the new one) ends bit for bit as the uninterrupted run; `best_k`'s
    sub-ensemble starts with None there and its call keeps each kept member's own aux."""

    def stop(history: Any) -> None:
        if history.epochs == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _aux_fit(how, tmp_path / "run.pt", [stop])
    resumed, h1 = _aux_fit(how, tmp_path / "run.pt")
    straight, h2 = _aux_fit(how, tmp_path / "straight.pt")
    for a, b in zip(resumed.state_dict().values(), straight.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(h1.val_loss.nan_to_num(), h2.val_loss.nan_to_num())
    top = vmapens.selection.best_k(resumed, h1, 2)
    rows = list(top.member_ids)
    members = [resumed[i] for i in rows]
    torch.testing.assert_close(top.template.aux, torch.stack([m.aux for m in members]), **TOL)
    with torch.no_grad():
        out = top(VAL[0])
        torch.testing.assert_close(out, torch.stack([m(VAL[0]) for m in members]), **TOL)
    torch.testing.assert_close(top.template.aux, torch.stack([m.aux for m in members]), **TOL)


# -- a member that keeps its hidden state: truncated BPTT -------------------------------------


class TBPTT(nn.Module):
    """A GRU cell that starts from the hidden state the last batch left (zeros for a batch of
    another size, such as a validation set)."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.GRUCell(2, 3, dtype=F64)
        self.out = nn.Linear(3, 1, dtype=F64)
        self.h: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:  # [B, T, 2]
        h = self.h
        if h is None or h.shape[0] != x.shape[0]:
            h = x.new_zeros(x.shape[0], 3)
        ys = []
        for t in range(x.shape[1]):
            h = self.cell(x[:, t], h)
            ys.append(self.out(h))
        self.h = h.detach()
        return torch.stack(ys, 1)


def _seq(rows: int, seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, T, 2, generator=g, dtype=F64),
            torch.randn(rows, T, 1, generator=g, dtype=F64))  # fmt: skip


SEQ, SEQ_VAL = _seq(3 * B, 0), _seq(B, 1)  # a validation set of one batch's size
FIT: dict[str, Any] = dict(batch_size=B, shuffle=False, lr=1e-2, progress=False, seed=0)


def _alone_epochs(m: TBPTT, opt: torch.optim.Optimizer, epochs: int, reset: bool = False) -> None:
    x, y = SEQ
    for _ in range(epochs):
        if reset:
            m.h = None
        for k in range(0, len(x), B):
            opt.zero_grad()
            _mse(m(x[k : k + B]), y[k : k + B]).backward()
            opt.step()


def _trained(steps: int) -> tuple[vmapens.Ensemble, Any, Any, list[TBPTT], list[Any]]:
    ens = vmapens.Ensemble(TBPTT, n=N, seed=0)
    alone = ens.unstack()
    opt = vmapens.StackedAdam(ens, lr=1e-2)
    step = vmapens.make_step(ens, nn.MSELoss(), opt)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in alone]
    for k in range(steps):
        _both_step(step, alone, opts, k)
    return ens, step, opt, alone, opts


def _both_step(step: Any, alone: list[TBPTT], opts: list[Any], k: int) -> None:
    x, y = SEQ[0][k * B : (k + 1) * B], SEQ[1][k * B : (k + 1) * B]
    step(x, y)
    for m, opt in zip(alone, opts, strict=True):
        opt.zero_grad()
        _mse(m(x), y).backward()
        opt.step()


def _fresh(m: TBPTT) -> TBPTT:
    """A plain module that has not run (or was loaded from a state dict): no hidden state."""
    new = copy.deepcopy(m)
    new.h = None
    return new


def test_tbptt_copies_and_files_after_a_step_follow_the_docs_and_the_run_goes_on() -> None:
    """docs/semantics.md: `ens[i]`/`unstack()` hold row i of the hidden state; `select`,
    `best_k` and `copy.deepcopy` give copies that hold a copy of it, as `copy.deepcopy(model)`
    does (since session 46); `torch.save` and `vmapens.save`/`load` files hold none, as a module
    that has not run; the ensemble itself goes on from its own, as alone."""
    ens, step, _, alone, opts = _trained(1)
    x = SEQ[0][B : 2 * B]
    for i, m in enumerate(ens.unstack()):
        torch.testing.assert_close(m.h, alone[i].h, **TOL)
    buffer = io.BytesIO()
    torch.save(ens, buffer)
    buffer.seek(0)
    copies = {
        "select": (ens.select([2, 0]), [2, 0]),
        "best_k": (vmapens.selection.best_k(ens, torch.tensor([3.0, 2.0, 1.0]), 2), [2, 1]),
        "deepcopy": (copy.deepcopy(ens), [0, 1, 2]),
        "torch.load": (torch.load(buffer, weights_only=False), [0, 1, 2]),
    }
    with torch.no_grad():
        for name, (sub, rows) in copies.items():
            if name == "torch.load":
                assert sub.template.h is None, name
            like = _fresh if name == "torch.load" else copy.deepcopy
            want = torch.stack([like(alone[r])(x) for r in rows])
            torch.testing.assert_close(sub(x), want, **TOL, msg=name)
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in alone]), **TOL)
    _both_step(step, alone, opts, 2)  # after all that, training goes on as alone
    _assert_members(ens, alone)
    for i, m in enumerate(alone):
        torch.testing.assert_close(ens.template.h[i], m.h, **TOL)


def test_tbptt_member_files_round_trip_without_the_hidden_state(tmp_path: Path) -> None:
    ens, _, _, alone, _ = _trained(2)
    vmapens.save(ens, tmp_path / "ens.pt")
    loaded = vmapens.load(tmp_path / "ens.pt", TBPTT)
    assert loaded.template.h is None
    x = SEQ[0][:B]
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), torch.stack([_fresh(m)(x) for m in alone]), **TOL)


class ResetEachEpoch(vmapens.Callback):
    def on_epoch_start(self, ctx: Any) -> None:
        ctx.ensemble.template.h = None  # docs/semantics.md: the members follow at the next call


def test_tbptt_fit_with_a_reset_of_the_hidden_state_each_epoch_equals_alone() -> None:
    ens = vmapens.Ensemble(TBPTT, n=N, seed=0)
    alone = ens.unstack()
    vmapens.fit(ens, SEQ, nn.MSELoss(), epochs=3, callbacks=[ResetEachEpoch()], **FIT)
    for m in alone:
        _alone_epochs(m, torch.optim.Adam(m.parameters(), lr=1e-2), 3, reset=True)
    _assert_members(ens, alone)
    for i, m in enumerate(alone):
        torch.testing.assert_close(ens.template.h[i], m.h, **TOL)


def test_tbptt_fit_resumed_in_a_new_ensemble_starts_over_as_a_plain_resume(tmp_path: Path) -> None:
    """A checkpoint holds state dicts: the resumed members start from no hidden state, as plain
    modules loaded from state dicts (with the optimizer's state) do."""

    def stop(history: Any) -> None:
        if history.epochs == 1:
            raise KeyboardInterrupt

    first = vmapens.Ensemble(TBPTT, n=N, seed=0)
    alone = first.unstack()
    with pytest.raises(KeyboardInterrupt):
        vmapens.fit(first, SEQ, nn.MSELoss(), epochs=3, checkpoint=tmp_path / "c.pt",
                    callbacks=[stop], **FIT)  # fmt: skip
    ens = vmapens.Ensemble(TBPTT, n=N, seed=0)
    vmapens.fit(ens, SEQ, nn.MSELoss(), epochs=3, checkpoint=tmp_path / "c.pt", **FIT)
    for j, m in enumerate(alone):
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        _alone_epochs(m, opt, 1)
        resumed = _fresh(m)
        state = copy.deepcopy(opt.state_dict())
        opt = torch.optim.Adam(resumed.parameters(), lr=1e-2)
        opt.load_state_dict(state)
        _alone_epochs(resumed, opt, 2)
        alone[j] = resumed
    _assert_members(ens, alone)
    for i, m in enumerate(alone):
        torch.testing.assert_close(ens.template.h[i], m.h, **TOL)


def test_apply_touching_the_kept_hidden_state_is_refused_and_changes_nothing() -> None:
    """docs/semantics.md: reset it on `ens.template`; `apply` carries tensor values of
    parameters and buffers only, so one that sets or edits `h` is refused, naming it."""
    ens, _, _, alone, _ = _trained(1)
    before = ens.template.h.clone()

    def zero(m: nn.Module) -> None:
        if isinstance(m, TBPTT) and m.h is not None:
            m.h.zero_()

    def drop(m: nn.Module) -> None:
        if isinstance(m, TBPTT):
            m.h = None

    for fn in (zero, drop):
        with pytest.raises(ValueError, match=r"Ensemble.apply: `fn` changed `h`.*ens.template"):
            ens.apply(fn)
        assert torch.equal(ens.template.h, before)
    x = SEQ[0][B : 2 * B]
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in alone]), **TOL)


def test_pbt_exploit_copies_weights_and_the_destination_keeps_its_hidden_state() -> None:
    """`vmapens.pbt.exploit_` copies parameters and optimizer state; the copy's hidden state
    stays its own, as `dst.load_state_dict(src.state_dict())` leaves a plain module's."""
    ens, step, opt, alone, opts = _trained(2)
    vmapens.pbt.exploit_(ens, opt, [0], [2])
    alone[2].load_state_dict(alone[0].state_dict())
    opts[2].load_state_dict(copy.deepcopy(opts[0].state_dict()))
    torch.testing.assert_close(ens.template.h[2], alone[2].h, **TOL)
    assert not torch.allclose(ens.template.h[2], ens.template.h[0])
    _both_step(step, alone, opts, 2)
    _assert_members(ens, alone)
    for i, m in enumerate(alone):
        torch.testing.assert_close(ens.template.h[i], m.h, **TOL)


# -- bugs ------------------------------------------------------------------------------------


def test_fit_again_on_the_same_ensemble_goes_on_from_each_members_hidden_state() -> None:
    """docs/fit.md: calling fit again with more epochs continues. Alone the module goes on
    from the hidden state it kept; refused: 'member 0 computes something else inside the
    ensemble than alone', pointing to backend='loop', which refuses it too."""
    ens = vmapens.Ensemble(TBPTT, n=N, seed=0)
    alone = ens.unstack()
    vmapens.fit(ens, SEQ, nn.MSELoss(), epochs=1, **FIT)
    vmapens.fit(ens, SEQ, nn.MSELoss(), epochs=1, **FIT)
    for m in alone:
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        _alone_epochs(m, opt, 1)
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)  # a new fit: a new optimizer
        _alone_epochs(m, opt, 1)
    _assert_members(ens, alone)


def test_fit_with_validation_data_of_the_batch_size_trains_a_kept_hidden_state() -> None:
    ens = vmapens.Ensemble(TBPTT, n=N, seed=0)
    alone = ens.unstack()
    history = vmapens.fit(ens, SEQ, nn.MSELoss(), epochs=2, val_data=SEQ_VAL, **FIT)
    for j, m in enumerate(alone):
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        for e in range(2):
            _alone_epochs(m, opt, 1)
            m.eval()
            with torch.no_grad():
                v = _mse(m(SEQ_VAL[0]), SEQ_VAL[1])
            m.train()
            torch.testing.assert_close(history.val_loss[e, j], v, **TOL)


class StopMember1(vmapens.Callback):
    def on_epoch_end(self, ctx: Any) -> None:
        if ctx.epoch == 0:
            ctx.stop([1])


def test_a_stopped_members_kept_hidden_state_stays_where_it_stopped() -> None:
    """docs/fit.md: a stopped member is frozen; alone it does not run again, so its hidden
    state, and its next forward after the run, are those of the epoch it stopped in."""
    ens = vmapens.Ensemble(TBPTT, n=N, seed=0)
    alone = ens.unstack()
    vmapens.fit(ens, SEQ, nn.MSELoss(), epochs=2, callbacks=[StopMember1()], **FIT)
    for i, m in enumerate(alone):
        _alone_epochs(m, torch.optim.Adam(m.parameters(), lr=1e-2), 1 if i == 1 else 2)
    _assert_members(ens, alone)
    for i, m in enumerate(alone):
        torch.testing.assert_close(ens[i].h, m.h, **TOL, msg=f"member {i}")
    x = SEQ[0][:B]
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in alone]), **TOL)


def test_tbptt_fit_with_patience_and_best_restore_equals_alone() -> None:
    """The long run: validation of one batch's size (its hidden state flows on into the next
    epoch, as alone), patience 1, best epochs restored, then one more forward."""
    ens = vmapens.Ensemble(TBPTT, n=N, seed=0)
    alone = ens.unstack()
    opt = vmapens.StackedAdam(ens, lr=torch.tensor([0.3, 0.1, 0.01], dtype=F64))
    fit = {k: v for k, v in FIT.items() if k != "lr"}
    history = vmapens.fit(ens, SEQ, nn.MSELoss(), epochs=5, val_data=SEQ_VAL, patience=1,
                          optimizer=opt, **fit)  # fmt: skip
    for j, (m, lr) in enumerate(zip(alone, [0.3, 0.1, 0.01], strict=True)):
        o = torch.optim.Adam(m.parameters(), lr=lr)
        best, best_state = float("inf"), copy.deepcopy(m.state_dict())
        for e in range(5):
            _alone_epochs(m, o, 1)
            m.eval()
            with torch.no_grad():
                v = _mse(m(SEQ_VAL[0]), SEQ_VAL[1]).item()
            m.train()
            assert abs(float(history.val_loss[e, j]) - v) < 1e-9
            if v >= best:
                break
            best, best_state = v, copy.deepcopy(m.state_dict())
        m.load_state_dict(best_state)
    assert (history.stopped_epoch >= 0).any()
    _assert_members(ens, alone)
    x = SEQ[0][:B]
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in alone]), **TOL)
