"""A user journey: deep-ensemble active learning, round after round.

The script a researcher writes from README.md, docs/fit.md, docs/workflows.md ("Predictions
and uncertainty"), docs/semantics.md ("Randomness in the forward pass", "Container
operations") and docs/optim.md: 4 small MLP classifiers with Dropout in float64, trained on a
labelled set that grows every round (so the batch count and the last batch's size change from
round to round), the unlabelled pool scored with `vmapens.predict` (BALD =
`"mutual_information"`, `"entropy"`, `"variance"`, `"vote"`, `"disagreement"`) in batches and
chunks of members, the top-k pool points moved to the labelled set. Between rounds the members
either go on training or start again from scratch, by each documented way to re-initialise an
ensemble (a new `Ensemble` with the same seed, `ens.apply(reset)`, the initial state dict
loaded back, `vmapens.restore` of a file saved at the start) and of resetting its optimizer (a
new stacked optimizer, `load_state_dict` of the initial optimizer state, `fit`'s fresh default
optimizer). Also: `make_step` by hand (members in chunks), per-member acquisition (each member
its own labelled set, `in_dims=0`, scored on its own predictions), early stopping in every
round with the optimizer carried on, a DataLoader per round with a per-step cosine schedule
and `compile="auto"`, rounds resumed from one checkpoint with `override=("data",)`, and the
refusals a round loop runs into.

The truth: the naive loop in plain PyTorch, N modules (each built after
`torch.manual_seed(derived_seed(0, "member", i))`, docs/semantics.md), each with its own
`torch.optim.Adam`, on the batches of docs/fit.md's documented shuffle formula; acquisition
scores from the plain formulas written here; the picks by the same stable sort. Dropout runs
with `randomness="same"`, which docs/semantics.md documents as each member drawing what it
draws alone from the same RNG state: the plain loop gives every member the RNG state the step
starts from, and the RNG state after each round must be the plain loop's too (so nothing in
`fit`, `predict` or the self-check draws what the plain loop does not).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from truth import batch_plan, derived_seed, resample

import vmapens
from vmapens.callbacks import Checkpoint, LRScheduler

N, B, K, ROUNDS, EPOCHS = 4, 4, 3, 3, 2
LRS = [0.01, 0.03, 0.1, 0.3]
START = 6  # labelled rows in round 0: 6, 9, 12 -> batches (4, 2), (4, 4, 1), (4, 4, 4)
TOL: dict[str, Any] = {"rtol": 1e-10, "atol": 1e-12}  # float64, sums in another order
SCORE_TOL: dict[str, Any] = {"rtol": 1e-12, "atol": 1e-12}
ce = nn.functional.cross_entropy

_g = torch.Generator().manual_seed(0)
X = torch.randn(48, 3, generator=_g, dtype=torch.float64)
Y = (X[:, 0] + X[:, 1] > 0).long() + (X[:, 2] > 0.5).long()  # 3 classes
XV, YV = X[40:], Y[40:]  # validation rows, never in the pool


def member() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Dropout(0.25), nn.Linear(8, 3)).double()


def ensemble(**kw: Any) -> vmapens.Ensemble:
    return vmapens.Ensemble(member, n=N, seed=0, randomness="same", **kw)


def alone_members() -> list[nn.Module]:
    """The ensemble's members as plain modules, from docs/semantics.md's seed recipe."""
    out = []
    for i in range(N):
        torch.manual_seed(derived_seed(0, "member", i))
        out.append(member())
    return out


def adams(models: Sequence[nn.Module]) -> list[torch.optim.Optimizer]:
    return [torch.optim.Adam(m.parameters(), lr=lr) for m, lr in zip(models, LRS, strict=True)]


def reset(m: nn.Module) -> None:
    if hasattr(m, "reset_parameters"):
        m.reset_parameters()


def plain_steps(
    models: Sequence[nn.Module],
    opts: Sequence[torch.optim.Optimizer],
    batches: Sequence[tuple[Tensor, Tensor]],
    per_member: bool = False,
) -> list[Tensor]:
    """The naive loop with dropout: every member starts each step from the RNG state the step
    starts from (randomness="same"); after it, the RNG is where one member's draws left it.
    Returns each step's losses, [members]."""
    out = []
    for xb, yb in batches:
        state, losses = torch.get_rng_state(), []
        for i, (m, o) in enumerate(zip(models, opts, strict=True)):
            torch.set_rng_state(state)
            x, y = (xb[i], yb[i]) if per_member else (xb, yb)
            o.zero_grad()
            loss = ce(m(x), y)
            loss.backward()
            o.step()
            losses.append(loss.detach())
        out.append(torch.stack(losses))
    return out


def assert_members(ens: vmapens.Ensemble, models: Sequence[nn.Module], where: str) -> None:
    assert len(ens) == len(models)
    for i, m in enumerate(models):
        got, want = ens[i].state_dict(), m.state_dict()
        assert list(got) == list(want)
        for k in want:
            torch.testing.assert_close(got[k], want[k], **TOL, msg=f"{where}: member {i} {k}")


# -- the acquisition functions, written from their textbook definitions ------------------


def probs_alone(models: Sequence[nn.Module], x: Tensor) -> Tensor:
    """[n, samples, classes]: each member alone, in eval mode, its softmax."""
    out = []
    with torch.no_grad():
        for m in models:
            was = m.training
            out.append(torch.softmax(m.eval()(x), -1))
            m.train(was)
    return torch.stack(out)


def entropy(p: Tensor) -> Tensor:
    return -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1)


def by_hand(p: Tensor) -> dict[str, Tensor]:
    """Every acquisition score of docs/workflows.md's table, from the members' [n, s, c]."""
    n, mean = p.shape[0], p.mean(0)
    labels = p.argmax(-1)  # [n, s]
    counts = torch.stack([(labels == c).sum(0) for c in range(p.shape[-1])], -1)  # [s, c]
    vote = counts.argmax(-1)  # the first of the most votes: the lowest class on a tie
    pairs = sum((labels[i] != labels[j]).double() for i in range(n) for j in range(n) if i != j)
    return {
        "mutual_information": entropy(mean) - entropy(p).mean(0),  # BALD
        "entropy": entropy(mean),
        "variance": ((p - mean) ** 2).mean(0),
        "vote": vote,
        "disagreement": pairs / (n * (n - 1)),
    }


def score_of(reduce: str, value: Tensor) -> Tensor:
    """A per-sample acquisition score from a reduction: the variance summed over classes."""
    return value.sum(-1) if reduce == "variance" else value.double()


def top_k(score: Tensor, k: int = K) -> list[int]:
    return torch.argsort(score, descending=True, stable=True)[:k].tolist()


def acquire(
    ens: vmapens.Ensemble, models: Sequence[nn.Module], pool: list[int], reduce: str
) -> list[int]:
    """Score the pool with predict (batches of 5, 3 members at a time), check every reduction
    against the plain formulas, and return the picked pool rows (ensemble and truth agree)."""
    xp = X[pool]
    truth = by_hand(probs_alone(models, xp))
    for name, want in truth.items():
        got = vmapens.predict(ens, xp, reduce=name, softmax=True, batch_size=5, chunk_size=3)
        torch.testing.assert_close(got, want, **SCORE_TOL, msg=name)
    got = vmapens.predict(ens, xp, reduce=reduce, softmax=True, batch_size=5, chunk_size=3)
    picked = top_k(score_of(reduce, got))
    assert picked == top_k(score_of(reduce, truth[reduce])), reduce
    return [pool[j] for j in picked]


class Ticks(vmapens.Callback):
    def __init__(self) -> None:
        self.steps = 0

    def on_step_end(self, ctx: Any) -> None:
        self.steps += 1


# -- rounds with fit -----------------------------------------------------------------------

REINIT = ["continue", "fresh_default_optimizer", "new_ensemble", "apply_reset", "initial_state",
          "restore"]  # fmt: skip


@pytest.mark.parametrize("how", REINIT)
def test_fit_rounds_match_the_plain_loop(how: str, tmp_path: Path) -> None:
    """3 rounds of fit (2 epochs, the labelled set 6 -> 9 -> 12 rows), acquisition by BALD,
    entropy and class variance in turn; between rounds the members and the optimizer go on
    (`continue`; `fresh_default_optimizer`: fit's default StackedAdam, built anew per call) or
    start again, each the documented way."""
    ens, models = ensemble(), alone_members()
    opt = vmapens.StackedAdam(ens, lr=LRS)
    opts = adams(models)
    init_ens, init_opt = copy.deepcopy(ens.state_dict()), copy.deepcopy(opt.state_dict())
    init_alone = [copy.deepcopy(m.state_dict()) for m in models]
    init_opts = [copy.deepcopy(o.state_dict()) for o in opts]
    vmapens.save(ens, tmp_path / "init.pt", optimizer=opt)
    labelled, pool = list(range(START)), list(range(START, 40))
    torch.manual_seed(7)
    for rnd, reduce in enumerate(["mutual_information", "entropy", "variance"]):
        rows = torch.tensor(labelled)
        before = torch.get_rng_state()
        ticks = Ticks()
        extra = {"lr": LRS} if how == "fresh_default_optimizer" else {"optimizer": opt}
        vmapens.fit(ens, (X[rows], Y[rows]), nn.CrossEntropyLoss(), epochs=EPOCHS, batch_size=B,
                    seed=rnd, progress=False, callbacks=[ticks], **extra)  # fmt: skip
        after = torch.get_rng_state()
        steps = EPOCHS * math.ceil(len(rows) / B)
        assert ticks.steps == steps
        if how == "fresh_default_optimizer":
            opts = adams(models)
        torch.set_rng_state(before)
        plan = batch_plan(len(rows), B, steps, seed=rnd)
        plain_steps(models, opts, [(X[rows[i]], Y[rows[i]]) for i in plan])
        assert torch.equal(torch.get_rng_state(), after), "fit drew what the plain loop does not"
        assert_members(ens, models, f"round {rnd}")
        picked = acquire(ens, models, pool, reduce)
        labelled += picked
        pool = [p for p in pool if p not in picked]
        # Between rounds: start again (or not), each the documented way.
        if how == "new_ensemble":
            ens, models = ensemble(), alone_members()
            opt, opts = vmapens.StackedAdam(ens, lr=LRS), adams(models)
        elif how == "apply_reset":
            torch.manual_seed(100 + rnd)
            ens.apply(reset)
            torch.manual_seed(100 + rnd)
            for m in models:
                m.apply(reset)
            opt.load_state_dict(copy.deepcopy(init_opt))
            for o, s in zip(opts, init_opts, strict=True):
                o.load_state_dict(copy.deepcopy(s))
        elif how == "initial_state":
            ens.load_state_dict(init_ens)
            opt.load_state_dict(copy.deepcopy(init_opt))
            for m, o, s, so in zip(models, opts, init_alone, init_opts, strict=True):
                m.load_state_dict(s)
                o.load_state_dict(copy.deepcopy(so))
        elif how == "restore":
            vmapens.restore(tmp_path / "init.pt", ens, opt)
            for m, o, s, so in zip(models, opts, init_alone, init_opts, strict=True):
                m.load_state_dict(s)
                o.load_state_dict(copy.deepcopy(so))
        if how not in ("continue", "fresh_default_optimizer"):
            assert_members(ens, models, f"after the reset of round {rnd}")
    assert len(labelled) == START + ROUNDS * K and len(set(labelled)) == len(labelled)


# -- rounds with make_step -------------------------------------------------------------------


def test_make_step_rounds_in_member_chunks_with_vote_acquisition() -> None:
    """make_step by hand, members 3 at a time (`chunk_size=3`), the labelled set growing by 3
    each round; picks by vote disagreement (1 - the majority's share) and pairwise
    disagreement, whose many ties the stable sort breaks alike; between rounds every member is
    re-initialised with `ens.apply(reset)` and the optimizer rebuilt with a new step."""
    ens, models = ensemble(chunk_size=3), alone_members()
    labelled, pool = list(range(START)), list(range(START, 40))
    torch.manual_seed(11)
    for rnd, reduce in enumerate(["vote", "disagreement", "vote"]):
        opt, opts = vmapens.StackedAdam(ens, lr=LRS), adams(models)
        step = vmapens.make_step(ens, nn.CrossEntropyLoss(), opt)
        rows = torch.tensor(labelled)
        plan = batch_plan(len(rows), B, EPOCHS * math.ceil(len(rows) / B), seed=rnd)
        for idx in plan:
            state = torch.get_rng_state()
            losses = step(X[rows[idx]], Y[rows[idx]])
            after = torch.get_rng_state()
            torch.set_rng_state(state)
            (alone,) = plain_steps(models, opts, [(X[rows[idx]], Y[rows[idx]])])
            torch.testing.assert_close(losses, alone, **TOL)
            assert torch.equal(torch.get_rng_state(), after), "the step drew what alone does not"
        assert_members(ens, models, f"round {rnd}")
        xp = X[pool]
        p = probs_alone(models, xp)
        truth = by_hand(p)
        if reduce == "vote":
            votes = vmapens.predict(ens, xp, reduce="vote", batch_size=5, chunk_size=3)
            torch.testing.assert_close(votes, truth["vote"], rtol=0, atol=0)
            members = vmapens.predict(ens, xp, softmax=True, batch_size=5, chunk_size=3)
            got = 1 - (members.argmax(-1) == votes).double().mean(0)
            want = 1 - (p.argmax(-1) == truth["vote"]).double().mean(0)
        else:
            got = vmapens.predict(ens, xp, reduce="disagreement", batch_size=5, chunk_size=3)
            want = truth["disagreement"]
        # 1 - agreeing pairs / all pairs there, differing pairs / all pairs here: 1 ulp apart
        # (0.6666666666666667 vs ...666), alike for equal counts, so ties stay ties.
        torch.testing.assert_close(got, want, **SCORE_TOL)
        assert top_k(got) == top_k(want)
        labelled += [pool[j] for j in top_k(got)]
        pool = [q for q in pool if q not in labelled]
        torch.manual_seed(200 + rnd)
        ens.apply(reset)
        torch.manual_seed(200 + rnd)
        for m in models:
            m.apply(reset)
        assert_members(ens, models, f"re-initialised after round {rnd}")


# -- per-member acquisition -----------------------------------------------------------------


def test_per_member_acquisition_each_member_its_own_labelled_set() -> None:
    """Each member its own labelled set ([n, rows, ...], `in_dims=0`), scored on its own pool
    by its own predictive entropy (predict with `in_dims=0`, batches and chunks), picks 2 per
    round; fit carries the optimizer on."""
    ens, models = ensemble(), alone_members()
    opt, opts = vmapens.StackedAdam(ens, lr=LRS), adams(models)
    labs = [list(range(3 * i, 3 * i + 5)) for i in range(N)]  # overlapping starts
    pools = [[j for j in range(40) if j not in lab] for lab in labs]
    torch.manual_seed(5)
    for rnd in range(ROUNDS):
        rows = torch.tensor(labs)  # [n, rows]
        before = torch.get_rng_state()
        vmapens.fit(ens, (X[rows], Y[rows]), nn.CrossEntropyLoss(), epochs=EPOCHS, batch_size=B,
                    in_dims=0, optimizer=opt, seed=rnd, progress=False)  # fmt: skip
        after = torch.get_rng_state()
        torch.set_rng_state(before)
        plan = batch_plan(rows.shape[1], B, EPOCHS * math.ceil(rows.shape[1] / B), seed=rnd)
        plain_steps(models, opts, [(X[rows[:, i]], Y[rows[:, i]]) for i in plan], per_member=True)
        assert torch.equal(torch.get_rng_state(), after)
        assert_members(ens, models, f"round {rnd}")
        own = torch.tensor(pools)  # [n, pool]: each member's own pool
        probs = vmapens.predict(ens, X[own], in_dims=0, softmax=True, batch_size=5, chunk_size=3)
        for i, m in enumerate(models):
            want = probs_alone([m], X[own[i]])[0]
            torch.testing.assert_close(probs[i], want, **SCORE_TOL, msg=f"member {i}")
            picked = top_k(entropy(probs[i]), 2)
            assert picked == top_k(entropy(want), 2)
            labs[i] += [pools[i][j] for j in picked]
            pools[i] = [q for q in pools[i] if q not in labs[i]]
    assert len({tuple(lab[-6:]) for lab in labs}) == N  # members picked differently


def test_per_member_bagging_with_out_of_bag_validation() -> None:
    """Per-member labelled sets resampled per member (`bootstrap=True`, `in_dims=0`) and scored
    out of bag (`val_data="oob"`): member i trains on rows r_i of its own slice and is scored
    on the rows of its slice r_i missed; the best epoch is given back (docs/fit.md)."""
    ens, models = ensemble(), alone_members()
    rows = torch.stack([torch.arange(i, i + 9) for i in range(N)])  # [n, 9]
    seed, size = 3, rows.shape[1]
    torch.manual_seed(9)
    before = torch.get_rng_state()
    h = vmapens.fit(ens, (X[rows], Y[rows]), nn.CrossEntropyLoss(), epochs=EPOCHS, batch_size=B,
                    lr=LRS, bootstrap=True, in_dims=0, val_data="oob", seed=seed, progress=False)  # fmt: skip
    after = torch.get_rng_state()
    torch.set_rng_state(before)
    steps = math.ceil(size / B)
    plan = batch_plan(size, B, EPOCHS * steps, seed=seed)
    draws = [torch.stack([resample(size, seed, i)[idx] for i in range(N)]) for idx in plan]
    xs = [torch.stack([X[rows[i, d[i]]] for i in range(N)]) for d in draws]
    ys = [torch.stack([Y[rows[i, d[i]]] for i in range(N)]) for d in draws]
    opts, best = adams(models), [(math.inf, -1, {}) for _ in range(N)]
    for e in range(EPOCHS):
        plain_steps(models, opts, list(zip(xs, ys))[e * steps : (e + 1) * steps], per_member=True)
        for i, m in enumerate(models):
            oob = torch.ones(size, dtype=torch.bool)
            oob[resample(size, seed, i)] = False
            logp = probs_alone([m], X[rows[i, oob]])[0].log()
            val = nn.functional.nll_loss(logp, Y[rows[i, oob]]).item()
            torch.testing.assert_close(float(h.val_loss[e, i]), val, **TOL)
            if val < best[i][0]:
                best[i] = (val, e, copy.deepcopy(m.state_dict()))
    assert torch.equal(torch.get_rng_state(), after)
    assert h.best_epoch.tolist() == [b[1] for b in best]
    for m, b in zip(models, best, strict=True):
        m.load_state_dict(b[2])
    assert_members(ens, models, "best epochs")


# -- early stopping in every round ----------------------------------------------------------


def test_early_stopping_every_round_carries_the_optimizer_on() -> None:
    """Each round fits up to 4 epochs with `val_data` and `patience=1`: members stop on their
    own, get their best epoch back, and the next round trains every member again from there
    with the optimizer state where its member stopped (compared through member_state_dict)."""
    ens, models = ensemble(), alone_members()
    opt, opts = vmapens.StackedAdam(ens, lr=LRS), adams(models)
    labelled, pool = list(range(START)), list(range(START, 40))
    torch.manual_seed(13)
    epochs = 4
    for rnd in range(ROUNDS):
        rows = torch.tensor(labelled)
        before = torch.get_rng_state()
        h = vmapens.fit(ens, (X[rows], Y[rows]), nn.CrossEntropyLoss(), epochs=epochs,
                        batch_size=B, optimizer=opt, val_data=(XV, YV), patience=1, seed=rnd,
                        progress=False)  # fmt: skip
        after = torch.get_rng_state()
        torch.set_rng_state(before)
        per = math.ceil(len(rows) / B)
        plan = batch_plan(len(rows), B, epochs * per, seed=rnd)
        active = list(range(N))
        best: list[tuple[float, int, dict]] = [(math.inf, -1, {}) for _ in range(N)]
        stopped = [-1] * N
        for e in range(epochs):
            if not active:
                break
            batches = [(X[rows[i]], Y[rows[i]]) for i in plan[e * per : (e + 1) * per]]
            plain_steps([models[i] for i in active], [opts[i] for i in active], batches)
            for i in list(active):
                logits = probs_alone([models[i]], XV)[0].log()
                val = nn.functional.nll_loss(logits, YV).item()
                if val < best[i][0]:
                    best[i] = (val, e, copy.deepcopy(models[i].state_dict()))
                elif e - best[i][1] >= 1:  # patience 1: one epoch without improvement
                    stopped[i] = e
                    active.remove(i)
        assert torch.equal(torch.get_rng_state(), after)
        assert h.best_epoch.tolist() == [b[1] for b in best]
        assert h.stopped_epoch.tolist() == stopped
        for m, b in zip(models, best, strict=True):
            m.load_state_dict(b[2])
        assert_members(ens, models, f"round {rnd}")
        for i, o in enumerate(opts):
            mine = opt.member_state_dict(i)["state"]
            for k, state in o.state_dict()["state"].items():
                for key, value in state.items():
                    torch.testing.assert_close(torch.as_tensor(mine[k][key]).double(),
                                               torch.as_tensor(value).double(), **TOL,
                                               msg=f"round {rnd} member {i} {k} {key}")  # fmt: skip
        picked = acquire(ens, models, pool, "mutual_information")
        labelled += picked
        pool = [p for p in pool if p not in picked]
    assert (h.stopped_epoch >= 0).any()  # early stopping took part


# -- a DataLoader per round, a per-step schedule, compile="auto" --------------------------------


def test_dataloader_rounds_with_a_per_step_cosine_schedule_and_compile_auto() -> None:
    """A new shuffling DataLoader of the labelled set each round (its own generator), a cosine
    schedule over the round's steps rebuilt every round on the optimizer carried on (torch's
    schedulers keep the group's `initial_lr`), and `compile="auto"` (a few steps: it stays
    eager, so bit-level agreement with the eager truth holds)."""
    ens, models = ensemble(), alone_members()
    opt, opts = vmapens.StackedAdam(ens, lr=LRS), adams(models)
    labelled, pool = list(range(START + 1)), list(range(START + 1, 40))
    torch.manual_seed(17)

    def loader(rows: Tensor, rnd: int) -> DataLoader:
        g = torch.Generator().manual_seed(rnd)
        return DataLoader(TensorDataset(X[rows], Y[rows]), batch_size=B, shuffle=True, generator=g)

    for rnd in range(ROUNDS):
        rows = torch.tensor(labelled)
        total = EPOCHS * len(loader(rows, rnd))

        def cosine(o: torch.optim.Optimizer, total: int = total) -> Any:
            return torch.optim.lr_scheduler.CosineAnnealingLR(o, total, eta_min=1e-3)

        before = torch.get_rng_state()
        vmapens.fit(ens, loader(rows, rnd), nn.CrossEntropyLoss(), epochs=EPOCHS, optimizer=opt,
                    callbacks=[LRScheduler(cosine, interval="step")], compile="auto",
                    progress=False)  # fmt: skip
        after = torch.get_rng_state()
        torch.set_rng_state(before)
        schedulers, plain = [cosine(o) for o in opts], loader(rows, rnd)
        for _ in range(EPOCHS):
            for xb, yb in plain:
                plain_steps(models, opts, [(xb, yb)])
                for s in schedulers:
                    s.step()
        assert torch.equal(torch.get_rng_state(), after)
        assert_members(ens, models, f"round {rnd}")
        for i, o in enumerate(opts):
            group = opt.member_state_dict(i)["param_groups"][0]
            assert group["lr"] == pytest.approx(o.param_groups[0]["lr"], rel=1e-15)
            assert group["initial_lr"] == o.param_groups[0]["initial_lr"] == LRS[i]
        picked = acquire(ens, models, pool, "entropy")
        labelled += picked
        pool = [p for p in pool if p not in picked]


# -- rounds resumed from one checkpoint ---------------------------------------------------------


def test_rounds_resumed_from_one_checkpoint_with_the_data_overridden(tmp_path: Path) -> None:
    """One checkpoint for the whole run: each round calls fit with 2 more epochs on the grown
    labelled set and `Checkpoint(path, override=("data",))` (docs/fit.md). It resumes from the
    last round's file and goes on as a plain loop that switches data at the round: passes
    2r and 2r+1 (counted across the run) over the new rows, Adam carried on."""
    path = tmp_path / "al.pt"
    ens, models = ensemble(), alone_members()
    opts = adams(models)
    labelled, pool = list(range(START)), list(range(START, 40))
    torch.manual_seed(19)
    for rnd in range(ROUNDS):
        rows = torch.tensor(labelled)
        before = torch.get_rng_state()
        h = vmapens.fit(ens, (X[rows], Y[rows]), nn.CrossEntropyLoss(), epochs=EPOCHS * (rnd + 1),
                        batch_size=B, lr=LRS, seed=0, progress=False,
                        callbacks=[Checkpoint(path, override=("data",))])  # fmt: skip
        after = torch.get_rng_state()
        assert h.epochs == EPOCHS * (rnd + 1)
        per = math.ceil(len(rows) / B)
        plan = batch_plan(len(rows), B, per * EPOCHS * (rnd + 1), seed=0)[per * EPOCHS * rnd :]
        torch.set_rng_state(before)
        plain_steps(models, opts, [(X[rows[i]], Y[rows[i]]) for i in plan])
        assert torch.equal(torch.get_rng_state(), after)
        assert_members(ens, models, f"round {rnd}")
        picked = acquire(ens, models, pool, "mutual_information")
        labelled += picked
        pool = [p for p in pool if p not in picked]


# -- what a round loop runs into ------------------------------------------------------------------


def _state(ens: vmapens.Ensemble) -> list[Tensor]:
    return [t.clone() for t in ens.state_dict().values()]


def _refused(call: Callable[[], Any], ens: vmapens.Ensemble, *words: str) -> None:
    before = _state(ens)
    with pytest.raises(ValueError) as err:
        call()
    for w in words:
        assert w in str(err.value), (w, str(err.value))
    assert all(torch.equal(a, b) for a, b in zip(before, _state(ens), strict=True))


def test_what_a_round_loop_runs_into_is_refused_clearly(tmp_path: Path) -> None:
    """A new Ensemble with the old optimizer (it steps the old members' tensors), and one
    checkpoint path for rounds whose data grew, without `override`: each refused before the
    first step, naming the way out, and nothing changes."""
    rows = torch.arange(START)
    old = ensemble()
    opt = vmapens.StackedAdam(old, lr=LRS)
    vmapens.fit(old, (X[rows], Y[rows]), nn.CrossEntropyLoss(), optimizer=opt, batch_size=B,
                seed=0, progress=False, checkpoint=tmp_path / "c.pt")  # fmt: skip
    new = ensemble()
    _refused(
        lambda: vmapens.fit(new, (X[rows], Y[rows]), nn.CrossEntropyLoss(), optimizer=opt,
                            batch_size=B, seed=0, progress=False),  # fmt: skip
        new, "fit: `optimizer`", "not a parameter of this ensemble", "StackedAdam(ens)",
    )  # fmt: skip
    more = torch.arange(START + K)
    _refused(
        lambda: vmapens.fit(old, (X[more], Y[more]), nn.CrossEntropyLoss(), optimizer=opt,
                            batch_size=B, seed=0, progress=False, checkpoint=tmp_path / "c.pt"),
        old, "cannot resume", "data=", "override=('data',)",
    )  # fmt: skip
