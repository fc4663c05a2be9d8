"""A user journey: a model zoo of hundreds of tiny nets that differ only in seed.

The script a researcher writes: `Ensemble(factory, N, seed=...)` with a `chunk_size` that does
not divide N, `fit` on per-member data and per-member validation data (`in_dims=(0, 0)`),
`StackedSGD` with one learning rate per member from a `torch.logspace` (the largest diverge),
patience early stopping with best-epoch restore and a callback that stops "finished" members
(training loss under a threshold) through `Context.stop`; then `selection.best_k` of the 10
best by validation loss, `save_members` of those, `save`/`load` of the whole zoo, and a resize:
the zoo's first 100 members stacked with 50 fresh ones by `Ensemble.from_modules` and trained
on. The truth is the naive loop in plain PyTorch for a subset of members (first and last chunk,
the chunk boundaries, the 10 best): each its own module built as docs/semantics.md "Seeds"
says (the `member_seed` formula written again here), its own `torch.optim.SGD`, batches in the
order docs/fit.md documents (`randperm` seeded from SHA-256 of `vmapens:{seed}:shuffle:{p}`),
divergence and early stopping written from their documented rules; best_k from its
documented rule (best validation loss over the epochs, ascending, ties by row, NaN last).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from truth import derived_seed

import vmapens
from vmapens.callbacks import Callback, Context

pytestmark = pytest.mark.usefixtures("float64_default")

N, CHUNK, SEED, FIT_SEED = 300, 64, 7, 11
N_KEEP, N_NEW, NEW_SEED, FIT2_SEED = 100, 50, 8, 12
S_TRAIN, S_VAL, BATCH, EPOCHS, EPOCHS2, PATIENCE = 12, 6, 5, 6, 2, 2
MOMENTUM, FINISHED, GAMMA = 0.9, 0.4, 0.5
TOP_SEED, EPOCHS_TOP = 13, 2
TOL: dict[str, Any] = {"atol": 1e-10, "rtol": 1e-10, "equal_nan": True}


def member() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def built_alone(seed: int, i: int) -> nn.Module:
    torch.manual_seed(derived_seed(seed, "member", i))
    return member()


def zoo_data(n: int, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, 4, 2, generator=g)
    x = torch.randn(n, S_TRAIN + S_VAL, 4, generator=g)
    y = x @ w + 0.05 * torch.randn(n, S_TRAIN + S_VAL, 2, generator=g)
    return x[:, :S_TRAIN], y[:, :S_TRAIN], x[:, S_TRAIN:], y[:, S_TRAIN:]


class StopFinished(Callback):
    """Stop a member whose epoch training loss is under FINISHED (done: no need to go on)."""

    def on_epoch_end(self, ctx: Context) -> None:
        ctx.stop(ctx.active & (ctx.losses < FINISHED))


class Alone:
    """One member alone, as the researcher's naive loop trains it: its own module,
    `torch.optim.SGD` and `StepLR`, batches in the documented order, divergence, early
    stopping and the finished rule written from their documented rules."""

    def __init__(self, model: nn.Module, lr: float, schedule: bool) -> None:
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, 2, GAMMA) if schedule else None

    def train(
        self, data: tuple[Tensor, Tensor, Tensor | None, Tensor | None], epochs: int, fit_seed: int
    ) -> dict[str, Any]:
        model, opt, (x, y, xv, yv) = self.model, self.opt, data
        mse = nn.MSELoss()
        train_loss = torch.full((epochs,), torch.nan)
        val_loss = torch.full((epochs,), torch.nan)
        best, best_epoch, bad, best_state = torch.inf, -1, 0, None
        stopped, diverged = -1, False
        for e in range(epochs):
            g = torch.Generator().manual_seed(derived_seed(fit_seed, "shuffle", e))
            order = torch.randperm(x.shape[0], generator=g)
            losses = []
            for k in range(0, x.shape[0], BATCH):
                rows = order[k : k + BATCH]
                loss = mse(model(x[rows]), y[rows])
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
                if not torch.isfinite(loss):  # docs/fit.md: frozen at once, after its bad step
                    diverged = True
                    break
            train_loss[e] = sum(losses) / len(losses)
            if diverged:
                break
            if xv is not None and yv is not None:  # EarlyStopping's documented rule
                with torch.no_grad():
                    model.eval()
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
            if xv is not None and train_loss[e] < FINISHED:  # the user's callback, after it
                stopped = e
                break
        if best_state is not None:  # best-epoch restore
            model.load_state_dict(best_state)
        return {
            "train_loss": train_loss,
            "val_loss": val_loss,
            "best_epoch": best_epoch,
            "stopped": stopped,
            "diverged": diverged,
        }


def assert_member(sd: dict[str, Tensor], model: nn.Module, what: str) -> None:
    for k, v in model.state_dict().items():
        torch.testing.assert_close(sd[k], v, **TOL, msg=f"{what}: {k} differs")


def best_k_rule(val_loss: Tensor, k: int) -> list[int]:
    # docs/workflows.md: each member's best val_loss over the epochs, best first, ties by row,
    # NaN last.
    best = [min((v for v in col.tolist() if v == v), default=None) for col in val_loss.T]
    ranked = sorted(range(len(best)), key=lambda i: (best[i] is None, best[i] or 0.0, i))
    return ranked[:k]


def test_model_zoo_journey(tmp_path: Path) -> None:
    x, y, xv, yv = zoo_data(N, 0)
    lrs = torch.logspace(-2, 0.3, N)

    # --- the zoo: seeds as documented -------------------------------------------------------
    zoo = vmapens.Ensemble(member, N, seed=SEED, chunk_size=CHUNK)
    g = torch.Generator().manual_seed(1)
    rows = {0, 1, CHUNK - 1, CHUNK, 2 * CHUNK - 1, 2 * CHUNK, N - CHUNK, N - 2, N - 1}
    rows |= set(torch.randint(N, (3,), generator=g).tolist())
    for i in sorted(rows):
        assert vmapens.seeds.member_seed(SEED, i) == derived_seed(SEED, "member", i)
        assert_member(
            zoo.state_dicts()[i] if i == 0 else zoo[i].state_dict(),
            built_alone(SEED, i),
            f"member {i} at build",
        )

    # --- train ---------------------------------------------------------------------------
    opt = vmapens.StackedSGD(zoo, lr=lrs, momentum=MOMENTUM)
    history = vmapens.fit(
        zoo,
        (x, y),
        nn.MSELoss(),
        epochs=EPOCHS,
        batch_size=BATCH,
        in_dims=(0, 0),
        val_data=(xv, yv),
        optimizer=opt,
        scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 2, GAMMA),
        patience=PATIENCE,
        callbacks=[StopFinished()],
        seed=FIT_SEED,
        progress=False,
    )
    assert history.val_loss is not None
    top_rows = best_k_rule(history.val_loss, 10)
    truth: dict[int, Alone] = {}
    for i in sorted(rows | set(top_rows)):
        alone = truth[i] = Alone(built_alone(SEED, i), float(lrs[i]), schedule=True)
        out = alone.train((x[i], y[i], xv[i], yv[i]), EPOCHS, FIT_SEED)
        assert_member(zoo[i].state_dict(), alone.model, f"member {i} after fit")
        torch.testing.assert_close(history.train_loss[:, i], out["train_loss"], **TOL)
        if not out["diverged"]:
            torch.testing.assert_close(history.val_loss[:, i], out["val_loss"], **TOL)
            assert int(history.stopped_epoch[i]) == out["stopped"], i
        assert bool(history.diverged[i]) == out["diverged"], i
        assert int(history.best_epoch[i]) == out["best_epoch"], i
        assert opt.param_groups[0]["lr"][i] == alone.opt.param_groups[0]["lr"], i
    # The journey covers divergence, early stopping, the finished rule and training to the end.
    assert history.diverged.any() and not history.diverged.all()
    assert (history.stopped_epoch == -1).any() and (history.stopped_epoch >= 0).any()
    finished = (history.train_loss < FINISHED).any(0)
    assert finished.any() and any(finished[i] for i in truth)

    # --- the whole zoo to one file and back --------------------------------------------------
    vmapens.save(zoo, tmp_path / "zoo.pt")
    loaded = vmapens.load(tmp_path / "zoo.pt", member)
    assert len(loaded) == N and list(loaded.member_ids) == list(range(N))
    assert loaded.chunk_size == CHUNK
    for a, b in zip(loaded.state_dict().values(), zoo.state_dict().values()):
        assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())

    # --- the 10 best, one file each, trained on with their own optimizer state ---------------
    top, top_opt = vmapens.selection.best_k(zoo, history, 10, optimizer=opt)
    assert list(top.member_ids) == top_rows
    paths = vmapens.save_members(top, tmp_path / "best")
    assert [p.name for p in paths] == [f"member_{i:04d}.pt" for i in top_rows]
    for i, path, state in zip(top_rows, paths, vmapens.load_members(tmp_path / "best")):
        plain = member()
        plain.load_state_dict(torch.load(path))
        assert_member(plain.state_dict(), truth[i].model, f"file of member {i}")
        assert_member(state, truth[i].model, f"load_members of member {i}")
    vmapens.fit(
        top,
        (x[top_rows], y[top_rows]),
        nn.MSELoss(),
        epochs=EPOCHS_TOP,
        batch_size=BATCH,
        in_dims=0,
        optimizer=top_opt,
        seed=TOP_SEED,
        progress=False,
    )
    for row, i in enumerate(top_rows):
        alone = copy.deepcopy(truth[i])
        alone.sched = None
        alone.train((x[i], y[i], None, None), EPOCHS_TOP, TOP_SEED)
        assert_member(top[row].state_dict(), alone.model, f"top member {i} trained on")

    # --- resize: the first 100 plus 50 fresh members, trained on -----------------------------
    fresh = vmapens.Ensemble(member, N_NEW, seed=NEW_SEED)
    grown = vmapens.Ensemble.from_modules(
        loaded[:N_KEEP].unstack() + fresh.unstack(), chunk_size=CHUNK
    )
    n2 = N_KEEP + N_NEW
    x2, y2, _, _ = zoo_data(n2, 1)
    lrs2 = torch.logspace(-2, -0.5, n2)
    history2 = vmapens.fit(
        grown,
        (x2, y2),
        nn.MSELoss(),
        epochs=EPOCHS2,
        batch_size=BATCH,
        in_dims=0,
        optimizer=vmapens.StackedSGD,
        lr=lrs2,
        momentum=MOMENTUM,
        seed=FIT2_SEED,
        progress=False,
    )
    kept = sorted(i for i in truth if i < N_KEEP)
    for i in kept + [N_KEEP, N_KEEP + 1, 2 * CHUNK - 1, 2 * CHUNK, n2 - 1]:
        model = truth[i].model if i < N_KEEP else built_alone(NEW_SEED, i - N_KEEP)
        alone = Alone(model, float(lrs2[i]), schedule=False)
        out = alone.train((x2[i], y2[i], None, None), EPOCHS2, FIT2_SEED)
        assert_member(grown[i].state_dict(), model, f"grown member {i}")
        torch.testing.assert_close(history2.train_loss[:, i], out["train_loss"], **TOL)


def test_per_member_val_data_read_as_shared_warns() -> None:
    # The zoo's script with `in_dims=0` where `in_dims=(0, 0)` was meant: each member is then
    # scored on every member's validation slice (its loss over all of them), so early stopping
    # and best_k rank by the wrong numbers, silently. `data` in the same shape without
    # `in_dims` warns (docs/fit.md); `val_data` should too.
    n = 5
    x, y, xv, yv = zoo_data(n, 0)
    zoo = vmapens.Ensemble(member, n, seed=SEED)
    with pytest.warns(UserWarning, match=r"in_dims=\(0, 0\)"):
        history = vmapens.fit(
            zoo, (x, y), nn.MSELoss(), in_dims=0, val_data=(xv, yv), seed=0, progress=False
        )
    # What it computed: each member's loss over all slices, not over its own (the naive loop's).
    assert history.val_loss is not None
    own = torch.stack([nn.MSELoss()(zoo[i].eval()(xv[i]), yv[i]) for i in range(n)])
    assert not torch.allclose(history.val_loss[0], own)
