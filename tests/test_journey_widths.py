"""A user journey: an architecture sweep over hidden widths in one padded ensemble.

The script a researcher writes (docs/semantics.md "Members of different sizes"): 3 hidden
widths x 2 seeds of an MLP built by `Ensemble.from_factories`, float64, trained with `fit`
(`StackedAdam` with one learning rate per member, a `StepLR`, validation data,
`EarlyStopping(patience=..., restore_best=True)`); then the best seed of each width by
`selection.best_k` on the scores of that width's rows, `save_members` of the winners (each file
loads strictly into its own width's plain module), `vmapens.save`/`load` of the whole padded
ensemble, `ens.select` of one member per width with `opt.select`, trained on, and
`predict(reduce="mean")` over members of different widths. Two architectures: Linear-ReLU-
Linear-Tanh-Linear (both dims of the middle Linear padded) and Linear-BatchNorm1d-ReLU-Linear
(BatchNorm over a padded width, in train and eval mode). The truth is the naive loop: each
member its own module at its own width, built as docs/semantics.md "Seeds" says, its own
`torch.optim.Adam` and `StepLR`, batches in the order docs/fit.md documents, early stopping
and best-epoch restore written from their documented rules.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from truth import derived_seed

import vmapens
from vmapens.callbacks import EarlyStopping

pytestmark = pytest.mark.usefixtures("float64_default")

WIDTHS, SEEDS_PER_WIDTH, SEED, FIT_SEED, FIT2_SEED = (3, 5, 7), 2, 3, 5, 9
S_TRAIN, S_VAL, BATCH, EPOCHS, EPOCHS2, PATIENCE, STEP, GAMMA = 12, 7, 5, 7, 2, 2, 2, 0.5
LRS = [0.3, 0.003, 0.05, 0.01, 0.005, 0.1]
TOL: dict[str, Any] = {"atol": 1e-10, "rtol": 1e-10}
NAN_TOL: dict[str, Any] = {**TOL, "equal_nan": True}


class Plain(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(3, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.Tanh(),
            nn.Linear(hidden, 2),
        )  # fmt: skip

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class Normed(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        # No bias before the BatchNorm, as usual: its gradient is zero but for round-off,
        # which Adam would blow up to lr * round-off / eps, in any two kernels differently.
        self.fc1, self.bn = nn.Linear(3, hidden, bias=False), nn.BatchNorm1d(hidden)
        self.fc2 = nn.Linear(hidden, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def data() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(S_TRAIN + S_VAL, 3, generator=g)
    y = torch.stack([torch.sin(2 * x[:, 0]) + x[:, 1] * x[:, 2], x[:, 0] - x[:, 2] ** 2], 1)
    y = y + 0.1 * torch.randn(y.shape, generator=g)
    return x[:S_TRAIN], y[:S_TRAIN], x[S_TRAIN:], y[S_TRAIN:]


class Alone:
    """One member as the naive loop trains it: its own module, Adam and StepLR."""

    def __init__(self, model: nn.Module, lr: float, schedule: bool) -> None:
        self.model = model
        self.opt = torch.optim.Adam(model.parameters(), lr=lr)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, STEP, GAMMA) if schedule else None

    def train(self, d: tuple[Tensor, ...], epochs: int, fit_seed: int) -> dict[str, Any]:
        model, opt, mse = self.model, self.opt, nn.MSELoss()
        x, y = d[0], d[1]
        xv, yv = (d[2], d[3]) if len(d) == 4 else (None, None)
        train_loss = torch.full((epochs,), torch.nan)
        val_loss = torch.full((epochs,), torch.nan)
        best, best_epoch, bad, best_state, stopped = torch.inf, -1, 0, None, -1
        for e in range(epochs):
            order = torch.randperm(
                len(x),
                generator=torch.Generator().manual_seed(derived_seed(fit_seed, "shuffle", e)),
            )
            losses = []
            for k in range(0, len(x), BATCH):
                rows = order[k : k + BATCH]
                loss = mse(model(x[rows]), y[rows])
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
            train_loss[e] = sum(losses) / len(losses)
            if xv is not None and yv is not None:  # EarlyStopping's documented rule
                model.eval()
                with torch.no_grad():
                    val_loss[e] = mse(model(xv), yv)
                model.train()
                if val_loss[e] < best:
                    best, best_epoch, bad = float(val_loss[e]), e, 0
                    best_state = copy.deepcopy(model.state_dict())
                else:
                    bad += 1
                if bad >= PATIENCE:  # stopped at this epoch's end: misses its scheduler step
                    stopped = e
                    break
            if self.sched is not None:
                self.sched.step()
        if best_state is not None:  # restore_best: parameters and buffers, not the optimizer
            model.load_state_dict(best_state)
        return {"train_loss": train_loss, "val_loss": val_loss, "best": best,
                "best_epoch": best_epoch, "stopped": stopped}  # fmt: skip


def assert_member(sd: dict[str, Tensor], model: nn.Module, what: str) -> None:
    own = model.state_dict()
    assert sorted(sd) == sorted(own), what
    for k, v in own.items():
        assert sd[k].shape == v.shape, f"{what}: {k} has shape {sd[k].shape}, alone {v.shape}"
        torch.testing.assert_close(sd[k], v, **TOL, msg=f"{what}: {k} differs")


@pytest.mark.parametrize("cls", [Plain, Normed])
def test_width_sweep_journey(cls: type[nn.Module], tmp_path: Path) -> None:
    x, y, xv, yv = data()
    widths = [h for h in WIDTHS for _ in range(SEEDS_PER_WIDTH)]
    factories = [functools.partial(cls, h) for h in widths]
    n = len(factories)

    # --- build: each member at its own width, seeded as documented ---------------------------
    ens = vmapens.Ensemble.from_factories(factories, seed=SEED)
    alone_models = []
    for i, f in enumerate(factories):
        torch.manual_seed(derived_seed(SEED, "member", i))
        alone_models.append(f())
        assert_member(ens[i].state_dict(), alone_models[i], f"member {i} at build")

    # --- train: per-member lrs, StepLR, validation, early stopping with best restore --------
    opt = vmapens.StackedAdam(ens, lr=LRS)
    history = vmapens.fit(
        ens,
        (x, y),
        nn.MSELoss(),
        epochs=EPOCHS,
        batch_size=BATCH,
        optimizer=opt,
        scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, STEP, GAMMA),
        val_data=(xv, yv),
        callbacks=[EarlyStopping(patience=PATIENCE, restore_best=True)],
        seed=FIT_SEED,
        progress=False,
    )
    assert history.val_loss is not None
    truth = [Alone(m, lr, schedule=True) for m, lr in zip(alone_models, LRS)]
    outs = [t.train((x, y, xv, yv), EPOCHS, FIT_SEED) for t in truth]
    for i, (t, out) in enumerate(zip(truth, outs)):
        assert_member(ens[i].state_dict(), t.model, f"member {i} (width {widths[i]}) after fit")
        e = history.epochs  # fit ends when every member has stopped
        torch.testing.assert_close(history.train_loss[:, i], out["train_loss"][:e], **NAN_TOL)
        torch.testing.assert_close(history.val_loss[:, i], out["val_loss"][:e], **NAN_TOL)
        assert int(history.best_epoch[i]) == out["best_epoch"], i
        assert int(history.stopped_epoch[i]) == out["stopped"], i
        assert opt.param_groups[0]["lr"][i] == t.opt.param_groups[0]["lr"], i
        member_opt = torch.optim.Adam(t.model.parameters())  # the hand-off at its own width
        member_opt.load_state_dict(opt.member_state_dict(i, module=t.model))
        for p in t.model.parameters():
            for key in ("exp_avg", "exp_avg_sq", "step"):
                torch.testing.assert_close(member_opt.state[p][key], t.opt.state[p][key], **TOL)
    # The journey covers early stopping and training to the end.
    assert (history.stopped_epoch >= 0).any() and (history.stopped_epoch == -1).any()

    # --- the best seed of each width ---------------------------------------------------------
    scores = vmapens.selection.member_scores(history)
    winners = []
    for h in WIDTHS:
        rows = [i for i in range(n) if widths[i] == h]
        masked = torch.full((n,), torch.nan, dtype=torch.float64)
        masked[rows] = scores[rows]
        best, best_opt = vmapens.selection.best_k(ens, masked, 1, optimizer=opt)
        (row,) = best.member_ids
        # docs/workflows.md: the lowest best validation loss, ties by row.
        assert row == min(rows, key=lambda i: (outs[i]["best"], i))
        assert_member(best[0].state_dict(), truth[row].model, f"best of width {h}")
        handed = best_opt.member_state_dict(0, module=best[0])["param_groups"][0]["lr"]
        assert handed == truth[row].opt.param_groups[0]["lr"]
        winners.append(row)

    # --- one file per winner, each loading strictly into its own width's plain module -------
    sub = ens.select(winners)
    paths = vmapens.save_members(sub, tmp_path / "best")
    assert [p.name for p in paths] == [f"member_{i:04d}.pt" for i in winners]
    for i, path, state in zip(winners, paths, vmapens.load_members(tmp_path / "best")):
        plain = factories[i]()
        plain.load_state_dict(torch.load(path), strict=True)
        assert_member(plain.state_dict(), truth[i].model, f"file of member {i}")
        assert_member(state, truth[i].model, f"load_members of member {i}")

    # --- the whole padded ensemble to one file and back, with its optimizer -----------------
    vmapens.save(ens, tmp_path / "sweep.pt", optimizer=opt, history=history)
    loaded = vmapens.load(tmp_path / "sweep.pt", factories)
    assert list(loaded.member_ids) == list(range(n))
    for (k, a), b in zip(loaded.state_dict().items(), ens.state_dict().values()):
        assert torch.equal(a, b), k
    for i in range(n):
        assert_member(loaded[i].state_dict(), truth[i].model, f"loaded member {i}")
    loaded_opt = vmapens.StackedAdam(loaded, lr=LRS)
    vmapens.restore(tmp_path / "sweep.pt", loaded, loaded_opt)
    assert list(loaded_opt.param_groups[0]["lr"]) == list(opt.param_groups[0]["lr"])

    # --- one member per width, trained on (from the loaded copy and from the original) ------
    trained: dict[int, Alone] = {}
    for source, source_opt in ((ens, opt), (loaded, loaded_opt)):
        top = source.select(winners)
        top_opt = source_opt.select(winners, top)
        vmapens.fit(top, (x, y), nn.MSELoss(), epochs=EPOCHS2, batch_size=BATCH,
                    optimizer=top_opt, seed=FIT2_SEED, progress=False)  # fmt: skip
        for row, i in enumerate(winners):
            alone = copy.deepcopy(truth[i])
            alone.sched = None
            alone.train((x, y), EPOCHS2, FIT2_SEED)
            assert_member(top[row].state_dict(), alone.model, f"winner {i} trained on")
            trained[i] = alone

    # --- the averaged prediction over members of different widths ---------------------------
    mean = vmapens.predict(top, xv, reduce="mean")
    with torch.no_grad():
        each = torch.stack([trained[i].model.eval()(xv) for i in winners])
    torch.testing.assert_close(mean, each.mean(0), **TOL)
    assert top.training  # predict restores the mode


def test_layer_norm_over_a_padded_width_is_refused_naming_it() -> None:
    # docs/semantics.md: a LayerNorm whose normalized_shape differs is refused when building.
    def normed(h: int) -> nn.Module:
        return nn.Sequential(nn.Linear(3, h), nn.LayerNorm(h), nn.Linear(h, 1))

    with pytest.raises(ValueError, match="LayerNorm"):
        vmapens.Ensemble.from_factories([functools.partial(normed, h) for h in (3, 5)], seed=0)


def test_a_member_replaced_in_its_corner_trains_as_alone_and_round_trips(tmp_path: Path) -> None:
    # The researcher re-initialises the worst seed of the narrowest width by hand (docs/
    # semantics.md "Container operations": copy the module's values into member i's storage),
    # at a padded member into its own corner, then trains on and saves.
    x, y, _, _ = data()
    factories = [functools.partial(Plain, h) for h in (1, 3, 5)]
    ens = vmapens.Ensemble.from_factories(factories, seed=SEED)
    torch.manual_seed(123)
    fresh = factories[0]()
    sd = ens.state_dict()
    with torch.no_grad():
        for k, v in fresh.state_dict().items():
            sd[k][0][tuple(slice(0, s) for s in v.shape)].copy_(v)
    alone = [copy.deepcopy(fresh)] + [copy.deepcopy(ens[i]) for i in (1, 2)]
    vmapens.fit(ens, (x, y), nn.MSELoss(), epochs=2, batch_size=BATCH, optimizer=vmapens.StackedAdam,
                lr=LRS[:3], seed=FIT2_SEED, progress=False)  # fmt: skip
    for i, model in enumerate(alone):
        Alone(model, LRS[i], schedule=False).train((x, y), 2, FIT2_SEED)
        assert_member(ens[i].state_dict(), model, f"member {i}")
    vmapens.save(ens, tmp_path / "e.pt")
    loaded = vmapens.load(tmp_path / "e.pt", factories)
    for i, model in enumerate(alone):
        assert_member(loaded[i].state_dict(), model, f"loaded member {i}")


def test_save_refuses_a_padded_ensemble_that_load_would_refuse(tmp_path: Path) -> None:
    # The same replacement with the recipe as written (`sd[k][i].copy_(v)`): a width-1 member's
    # row broadcasts over its padded rows, where torch.Tensor.copy_ raises for any other width.
    # The forward masks them, so training is unchanged, but `vmapens.save` writes a file that
    # `vmapens.load` refuses as "a state dict of members of other sizes": the run's only
    # checkpoint is unloadable. `save` should refuse it, naming the member and the tensor.
    factories = [functools.partial(Plain, h) for h in (1, 3, 5)]
    ens = vmapens.Ensemble.from_factories(factories, seed=SEED)
    torch.manual_seed(123)
    fresh = factories[0]()
    sd = ens.state_dict()
    with torch.no_grad():
        for k, v in fresh.state_dict().items():
            sd[k][0].copy_(v)
    assert_member(ens[0].state_dict(), fresh, "member 0 reads as replaced")
    with pytest.raises(ValueError, match=r"^save: member row 0 .*`net\.0\.weight`"):
        vmapens.save(ens, tmp_path / "e.pt")
    assert not (tmp_path / "e.pt").exists()


def test_best_k_of_one_width_from_the_sweeps_history_says_how() -> None:
    # The natural per-width call, `best_k(ens.select(rows_of_width), history, 1)`, is refused
    # (by design: tests/test_sweep.py), telling the researcher to "pass the History of this
    # ensemble's training", which a sub-ensemble never trained on its own does not have. The
    # message should name what works: the scores of those rows.
    x, y, xv, yv = data()
    factories = [functools.partial(Plain, h) for h in (3, 3, 5, 5)]
    ens = vmapens.Ensemble.from_factories(factories, seed=SEED)
    history = vmapens.fit(ens, (x, y), nn.MSELoss(), epochs=1, val_data=(xv, yv), seed=0,
                          progress=False)  # fmt: skip
    with pytest.raises(ValueError, match=r"member_scores\(history\)\[rows\]"):
        vmapens.selection.best_k(ens.select([2, 3]), history, 1)
    # What works: the sub-ensemble ranked by its rows of the sweep's scores.
    scores = vmapens.selection.member_scores(history)[[2, 3]]
    best = vmapens.selection.best_k(ens.select([2, 3]), scores, 1)
    assert list(best.member_ids) == [2 + int(scores.argmin())]
