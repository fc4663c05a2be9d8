"""Session 48 hunt (g): fit's data, validation, early stopping and history against plain loops.

The truth: N plain float64 modules (``ens.unstack()`` before training), each trained alone with
``torch.optim`` on the batches docs/fit.md documents (the shuffle rebuilt here from its
sha256 formula), validated and early-stopped by hand.
"""

from __future__ import annotations

import copy
import hashlib
import math

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import vmapens
from vmapens.callbacks import Callback, EarlyStopping
from vmapens.seeds import bootstrap_indices

TOL = dict(rtol=1e-9, atol=1e-11)
N = 3


def _order(seed: int, p: int, size: int) -> torch.Tensor:
    """docs/fit.md: pass p's order, from the first 8 bytes of sha256, little-endian, >> 1."""
    digest = hashlib.sha256(f"vmapens:{seed}:shuffle:{p}".encode()).digest()
    s_p = int.from_bytes(digest[:8], "little") >> 1
    return torch.randperm(size, generator=torch.Generator().manual_seed(s_p))


def _plan(size: int, b: int, seed: int, steps: int) -> list[torch.Tensor]:
    """Positions of ``steps`` batches, cycling over passes (a new pass reshuffled)."""
    out: list[torch.Tensor] = []
    p = 0
    while len(out) < steps:
        order = _order(seed, p, size)
        out += [order[k : k + b] for k in range(0, size, b)]
        p += 1
    return out[:steps]


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def _ensemble(factory=_net):
    ens = vmapens.Ensemble(factory, n=N, seed=0)
    return ens, [copy.deepcopy(m) for m in ens.unstack()]


def _assert_members(ens: vmapens.Ensemble, plain: list[nn.Module]) -> None:
    for i, (got, want) in enumerate(zip(ens.unstack(), plain, strict=True)):
        for (k, a), b in zip(got.state_dict().items(), want.state_dict().values(), strict=True):
            torch.testing.assert_close(a, b, **TOL, msg=lambda m, i=i, k=k: f"member {i} {k}: {m}")


def _data(*shape_x: int, out: int = 2, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape_x, generator=g, dtype=torch.float64)
    y = torch.randn(*shape_x[:-1], out, generator=g, dtype=torch.float64)
    return x, y


def test_bagged_per_member_data_cycling_steps_over_short_last_batches_train_as_alone():
    # in_dims=0 + bootstrap + steps that cross passes + a last batch of 2 rows (7 = 5 + 2).
    ens, plain = _ensemble()
    x, y = _data(N, 7, 3)
    h = vmapens.fit(ens, (x, y), nn.MSELoss(), in_dims=0, bootstrap=True, batch_size=5,
                    steps=3, epochs=2, lr=0.05, progress=False, seed=11)  # fmt: skip
    plan = _plan(7, 5, 11, 6)
    for i, m in enumerate(plain):
        r = bootstrap_indices(7, 11, i)  # docs/fit.md: r_i, member i's resample
        opt = torch.optim.Adam(m.parameters(), lr=0.05)
        losses = []
        for pos in plan:
            rows = r[pos]
            opt.zero_grad()
            loss = nn.functional.mse_loss(m(x[i, rows]), y[i, rows])
            loss.backward()
            opt.step()
            losses.append(loss.item())
        want = torch.tensor([sum(losses[:3]) / 3, sum(losses[3:]) / 3], dtype=torch.float64)
        torch.testing.assert_close(h.train_loss[:, i], want, **TOL)
    _assert_members(ens, plain)


def test_out_of_bag_loss_of_per_member_data_scores_each_members_own_slice():
    ens, plain = _ensemble()
    x, y = _data(N, 6, 3, seed=2)
    h = vmapens.fit(ens, (x, y), nn.MSELoss(), in_dims=0, bootstrap=True, batch_size=4,
                    val_data="oob", epochs=2, lr=0.05, progress=False, seed=4,
                    callbacks=[EarlyStopping(restore_best=False)])  # fmt: skip
    plan = _plan(6, 4, 4, 4)
    for i, m in enumerate(plain):
        r = bootstrap_indices(6, 4, i)
        out = torch.ones(6, dtype=torch.bool)
        out[r] = False
        opt = torch.optim.Adam(m.parameters(), lr=0.05)
        for epoch in range(2):
            for pos in plan[2 * epoch : 2 * epoch + 2]:
                opt.zero_grad()
                nn.functional.mse_loss(m(x[i, r[pos]]), y[i, r[pos]]).backward()
                opt.step()
            with torch.no_grad():
                want = (
                    nn.functional.mse_loss(m(x[i, out]), y[i, out])
                    if out.any()
                    else torch.tensor(math.nan, dtype=torch.float64)
                )
            torch.testing.assert_close(h.val_loss[epoch, i], want, **TOL, equal_nan=True)
    _assert_members(ens, plain)


def _plain_early_stopping(plain, batches, val, epochs, lrs, patience, score, mode):
    """Each member alone: SGD, validate each epoch in eval mode, keep the best copy, stop after
    ``patience`` epochs without strict improvement, restore the best copy at the end."""
    results = []
    for i, m in enumerate(plain):
        opt = torch.optim.SGD(m.parameters(), lr=lrs[i])
        best, best_epoch, bad, stopped, rows = math.inf, -1, 0, -1, []
        best_state = copy.deepcopy(m.state_dict())
        for epoch in range(epochs):
            m.train()
            losses = []
            for xb, yb in batches:
                opt.zero_grad()
                loss = nn.functional.mse_loss(m(xb), yb)
                loss.backward()
                opt.step()
                losses.append(loss.item())
            m.eval()
            with torch.no_grad():
                s = float(score(m(val[0]), val[1]))
            m.train()
            rows.append((sum(losses) / len(losses), s))
            watched = s if mode == "min" else -s
            if watched < best:
                best, best_epoch, bad = watched, epoch, 0
                best_state = copy.deepcopy(m.state_dict())
            else:
                bad += 1
            if bad >= patience:
                stopped = epoch
                break
        if best_epoch >= 0:
            m.load_state_dict(best_state)
        results.append((rows, best_epoch, stopped))
    return results


def _neg_mse(out, y):
    return -((out - y) ** 2).mean()


def test_early_stopping_on_a_max_metric_restores_each_members_best_epoch():
    ens, plain = _ensemble()
    x, y = _data(8, 3, seed=3)
    xv, yv = _data(5, 3, seed=4)
    lrs = [0.9, 2.5, 0.05]  # a member that oscillates, one that overshoots, one that learns
    stop = EarlyStopping(monitor="val_negmse", mode="max", patience=2)
    h = vmapens.fit(ens, (x, y), nn.MSELoss(), batch_size=5, shuffle=False, epochs=6,
                    optimizer=vmapens.StackedSGD, lr=lrs, val_data=(xv, yv),
                    metrics={"negmse": _neg_mse}, callbacks=[stop], progress=False, seed=0)  # fmt: skip
    batches = [(x[:5], y[:5]), (x[5:], y[5:])]
    truth = _plain_early_stopping(plain, batches, (xv, yv), 6, lrs, 2, _neg_mse, "max")
    for i, (rows, best_epoch, stopped) in enumerate(truth):
        assert int(h.best_epoch[i]) == best_epoch, (i, h.best_epoch, truth)
        assert int(h.stopped_epoch[i]) == stopped, (i, h.stopped_epoch, truth)
        for e, (train, s) in enumerate(rows):
            torch.testing.assert_close(h.train_loss[e, i].item(), train, **TOL)
            torch.testing.assert_close(h.metrics["negmse"][e, i].item(), s, **TOL)
        assert torch.isnan(h.train_loss[len(rows) :, i]).all()
    _assert_members(ens, plain)


class _StopAt(Callback):
    """Stops ``member`` after the run's ``step``-th step (mid-epoch)."""

    def __init__(self, member: int, step: int) -> None:
        self.member, self.at = member, step

    def on_step_end(self, ctx) -> None:
        if ctx.step == self.at:
            ctx.stop(self.member)


def test_a_member_stopped_mid_epoch_gets_its_best_earlier_epoch_back():
    # Member 1 stops after step 4 = the first step of epoch 1 (3 batches an epoch: 5 + 5 + 1).
    ens, plain = _ensemble()
    x, y = _data(11, 3, seed=5)
    xv, yv = _data(4, 3, seed=6)
    h = vmapens.fit(ens, (x, y), nn.MSELoss(), batch_size=5, shuffle=False, epochs=3,
                    optimizer=vmapens.StackedSGD, lr=0.1, val_data=(xv, yv),
                    callbacks=[_StopAt(1, 4)], progress=False, seed=0)  # fmt: skip
    batches = [(x[k : k + 5], y[k : k + 5]) for k in range(0, 11, 5)]
    for i, m in enumerate(plain):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        best, best_state, best_epoch, step = math.inf, None, -1, 0
        for epoch in range(3):
            for xb, yb in batches:
                opt.zero_grad()
                nn.functional.mse_loss(m(xb), yb).backward()
                opt.step()
                step += 1
                if i == 1 and step == 4:
                    break
            if i == 1 and step >= 4:
                break
            with torch.no_grad():
                v = nn.functional.mse_loss(m(xv), yv).item()
            torch.testing.assert_close(h.val_loss[epoch, i].item(), v, **TOL)
            if v < best:
                best, best_epoch, best_state = v, epoch, copy.deepcopy(m.state_dict())
        m.load_state_dict(best_state)
        assert int(h.best_epoch[i]) == best_epoch
    assert h.stopped_epoch.tolist() == [-1, 1, -1]
    assert torch.isnan(h.train_loss[1:, 1]).all() and torch.isnan(h.val_loss[1:, 1]).all()
    _assert_members(ens, plain)


def test_per_member_loaders_with_per_member_validation_score_each_member_alone():
    ens, plain = _ensemble()
    x, y = _data(N, 7, 3, seed=7)
    xv, yv = _data(N, 4, 3, seed=8)
    loaders = [DataLoader(TensorDataset(x[i], y[i]), batch_size=3) for i in range(N)]
    h = vmapens.fit(ens, loaders, nn.MSELoss(), in_dims=(0, 0), epochs=2, lr=0.05,
                    val_data=(xv, yv), callbacks=[EarlyStopping(restore_best=False)],
                    progress=False)  # fmt: skip
    for i, m in enumerate(plain):
        opt = torch.optim.Adam(m.parameters(), lr=0.05)
        for epoch in range(2):
            losses = []
            for xb, yb in loaders[i]:
                opt.zero_grad()
                loss = nn.functional.mse_loss(m(xb), yb)
                loss.backward()
                opt.step()
                losses.append(loss.item())
            torch.testing.assert_close(h.train_loss[epoch, i].item(), sum(losses) / 3, **TOL)
            with torch.no_grad():
                v = nn.functional.mse_loss(m(xv[i]), yv[i]).item()
            torch.testing.assert_close(h.val_loss[epoch, i].item(), v, **TOL)
    _assert_members(ens, plain)


def _bn_net() -> nn.Module:
    return nn.Sequential(
        nn.Linear(3, 4, bias=False), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2)
    ).double()


def test_batchnorm_members_validate_in_eval_mode_after_a_short_last_batch():
    ens, plain = _ensemble(_bn_net)
    x, y = _data(8, 3, seed=9)
    xv, yv = _data(5, 3, seed=10)
    mae = {"mae": lambda out, t: (out - t).abs().mean()}
    h = vmapens.fit(ens, (x, y), nn.MSELoss(), batch_size=3, epochs=2, lr=0.05, seed=21,
                    val_data=(xv, yv), metrics=mae, callbacks=[EarlyStopping(restore_best=False)],
                    progress=False)  # fmt: skip
    plan = _plan(8, 3, 21, 6)
    for i, m in enumerate(plain):
        opt = torch.optim.Adam(m.parameters(), lr=0.05)
        m.train()
        for epoch in range(2):
            for pos in plan[3 * epoch : 3 * epoch + 3]:
                opt.zero_grad()
                nn.functional.mse_loss(m(x[pos]), y[pos]).backward()
                opt.step()
            m.eval()
            with torch.no_grad():
                out = m(xv)
            m.train()
            torch.testing.assert_close(
                h.val_loss[epoch, i].item(), nn.functional.mse_loss(out, yv).item(), **TOL
            )
            torch.testing.assert_close(
                h.metrics["mae"][epoch, i].item(), (out - yv).abs().mean().item(), **TOL
            )
    assert ens.training
    _assert_members(ens, plain)


def _global_rng_loaders(x, y, b):
    return [DataLoader(TensorDataset(x[i], y[i]), batch_size=b, shuffle=True) for i in range(N)]


def test_per_member_global_rng_loaders_cycled_by_steps_draw_member_by_member():
    # 7 rows in batches of 3 (3, 3, 1; no drop_last: every member's last batch has 1 row);
    # steps=4 over 2 epochs: 8 steps that cross the pass boundary mid-epoch, twice.
    ens, plain = _ensemble()
    x, y = _data(N, 7, 3, seed=12)
    torch.manual_seed(123)
    h = vmapens.fit(ens, _global_rng_loaders(x, y, 3), nn.MSELoss(), in_dims=0, steps=4,
                    epochs=2, lr=0.05, progress=False)  # fmt: skip
    torch.manual_seed(123)
    loaders = _global_rng_loaders(x, y, 3)
    batches: list[list] = [[] for _ in range(N)]
    while len(batches[0]) < 8:  # docs/fit.md: member 0's iterator and first batch, then 1's...
        its: list = [None] * N
        for pos in range(3):
            for i in range(N):
                if pos == 0:
                    its[i] = iter(loaders[i])
                batches[i].append(next(its[i]))
    for i, m in enumerate(plain):
        opt = torch.optim.Adam(m.parameters(), lr=0.05)
        losses = []
        for xb, yb in batches[i][:8]:
            opt.zero_grad()
            loss = nn.functional.mse_loss(m(xb), yb)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        want = torch.tensor([sum(losses[:4]) / 4, sum(losses[4:]) / 4], dtype=torch.float64)
        torch.testing.assert_close(h.train_loss[:, i], want, **TOL)
    _assert_members(ens, plain)
