"""fit's data, seeds and schedulers against truths written again from the documentation.

Every expected batch comes from the recipes in docs/fit.md ("Data, epochs and steps",
"Bagging") and docs/semantics.md (member seeds), rewritten with plain torch generators in
tests/truth.py (`derived_seed`, `resample`, `batch_plan`); every expected model is a plain
module trained alone with torch.optim on those batches. No vmapens helper computes an expected
value: a test here fails when fit draws other rows, reuses a permutation, resumes at the wrong
batch or steps a scheduler at the wrong time.
"""

from __future__ import annotations

import copy

import models
import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler
from torch.utils.data import DataLoader, TensorDataset
from truth import TOL64, adam, assert_members_equal, batch_plan, derived_seed, resample, train_alone

import vmapens
from vmapens.callbacks import EarlyStopping, LRScheduler

N = 3
ROWS = 20
F64 = dict(dtype=torch.float64)
G = torch.Generator().manual_seed(0)
X, Y = torch.randn(ROWS, 4, generator=G, **F64), torch.randn(ROWS, 3, generator=G, **F64)
XV, YV = torch.randn(9, 4, generator=G, **F64), torch.randn(9, 3, generator=G, **F64)
XS, YS = torch.randn(N, ROWS, 4, generator=G, **F64), torch.randn(N, ROWS, 3, generator=G, **F64)
LRS = [1e-2, 2e-2, 3e-2]


def plain_member(seed: int, i: int) -> nn.Module:
    """Member i of `Ensemble(models.MLP, n, seed=seed).double()`, built as docs/semantics.md
    says: `torch.manual_seed(member_seed(seed, i)); factory()`, the seed recomputed."""
    torch.manual_seed(derived_seed(seed, "member", i))
    return models.MLP().double()


def ensemble_and_truth(seed: int, ids=range(N)) -> tuple[vmapens.Ensemble, list[nn.Module]]:
    """An ensemble of the members with global ids `ids` (a shard when not 0..N-1) and the same
    members as plain modules, both built from the documented seed recipe."""
    plain = [plain_member(seed, i) for i in ids]
    if list(ids) == list(range(N)):
        ens = vmapens.Ensemble(models.MLP, N, seed=seed).double()
    else:  # the part of a larger ensemble one process holds
        ens = vmapens.Ensemble.from_modules(copy.deepcopy(plain))
        ens.member_ids, ens.n_total = range(ids[0], ids[-1] + 1), ids[-1] + 1
    return ens, plain


class Record:
    """A loss that records the targets it is given (shared data: the real batch tensors)."""

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def __call__(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.seen.append(y.detach().clone())
        return nn.functional.mse_loss(out, y)


# -- seeds and the bootstrap draw --------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 5])
def test_members_are_built_from_the_documented_seed(seed):
    ens, plain = ensemble_and_truth(seed)
    assert_members_equal(ens, plain, rtol=0, atol=0)


@pytest.mark.parametrize("seed", [0, 7])
def test_bootstrap_indices_are_the_documented_draw(seed):
    rows = [vmapens.seeds.bootstrap_indices(ROWS, seed, i) for i in range(5)]
    for i, r in enumerate(rows):
        assert torch.equal(r, resample(ROWS, seed, i)), f"member {i}"
        # With replacement: 20 draws from 20 rows repeat one with probability 1 - 20!/20^20.
        assert r.unique().numel() < ROWS, f"member {i} drew no row twice"
    assert len({tuple(r.tolist()) for r in rows}) == len(rows), "two members share a resample"


# -- batches: reshuffled every pass, bagged, per member ------------------------------------------


PLANS = [
    # id, fit options, how member i's batch is cut from the plan's rows
    ("shuffle-epochs", dict(epochs=3, batch_size=6, seed=4), "shared"),
    ("shuffle-steps-cross-passes", dict(epochs=2, steps=5, batch_size=6, seed=4), "shared"),
    ("in-order", dict(epochs=2, batch_size=6, shuffle=False, seed=4), "shared"),
    ("one-batch-never-permuted", dict(epochs=2, seed=4), "shared"),
    ("bootstrap-one-batch", dict(epochs=3, bootstrap=True, seed=7), "bootstrap"),
    ("bootstrap-shuffled", dict(epochs=2, batch_size=6, bootstrap=True, seed=7), "bootstrap"),
    ("bootstrap-shard", dict(epochs=2, batch_size=6, bootstrap=True, seed=7), "shard"),
    ("per-member-shuffled", dict(epochs=2, batch_size=6, in_dims=0, seed=3), "per-member"),
]  # fmt: skip


def member_batches(kind: str, member: int, plan: list[torch.Tensor], seed: int) -> list:
    if kind in ("bootstrap", "shard"):
        own = resample(ROWS, seed, member)
        return [(X[own[idx]], Y[own[idx]]) for idx in plan]
    if kind == "per-member":
        return [(XS[member, idx], YS[member, idx]) for idx in plan]
    return [(X[idx], Y[idx]) for idx in plan]


@pytest.mark.parametrize("options,kind", [p[1:] for p in PLANS], ids=[p[0] for p in PLANS])
def test_fit_trains_on_the_documented_batches(options, kind):
    seed, batch = options["seed"], options.get("batch_size")
    ids = range(2, 5) if kind == "shard" else range(N)
    ens, plain = ensemble_and_truth(0, ids)
    per_pass = -(-ROWS // (batch or ROWS))
    count = options["epochs"] * options.get("steps", per_pass)
    plan = batch_plan(ROWS, batch, count, seed, options.get("shuffle", True))
    if options.get("shuffle", True) and per_pass > 1:  # the truth tells passes apart
        assert not torch.equal(plan[0], plan[per_pass])
    loss = Record()
    data = (XS, YS) if kind == "per-member" else (X, Y)
    # check=False: the first step's self-check would call the recording loss twice more.
    vmapens.fit(ens, data, loss, lr=LRS, progress=False, check=False, **options)
    for col, (member, model) in enumerate(zip(ids, plain, strict=True)):
        batches = member_batches(kind, member, plan, seed)
        train_alone(model, batches, make_opt=adam(LRS[col]))
    assert_members_equal(ens, plain)
    if kind == "shared":  # the loss saw the real targets: exactly the planned ones, in order
        assert len(loss.seen) == count
        for k, (seen, idx) in enumerate(zip(loss.seen, plan, strict=True)):
            assert torch.equal(seen, Y[idx]), f"step {k}"


# -- resuming mid-pass ---------------------------------------------------------------------------


class StopAt(vmapens.Callback):
    """Interrupts training right after global step `at`: mid-epoch, after a checkpoint."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, ctx: vmapens.callbacks.Context) -> None:
        if ctx.step == self.at:
            raise KeyboardInterrupt


BATCH, STEPS, EPOCHS = 6, 3, 4  # 4 batches a pass, 3 steps an epoch: epochs end mid-pass
LOADER_BATCHES = [(X[k : k + BATCH], Y[k : k + BATCH]) for k in range(0, ROWS, BATCH)]
SOURCES = {
    "dataloader": lambda: (DataLoader(TensorDataset(X, Y), batch_size=BATCH), {}),
    "list": lambda: (list(LOADER_BATCHES), {}),
    "tensors-shuffled": lambda: ((X, Y), dict(batch_size=BATCH, seed=2)),
    "dataloader-per-member": lambda: (
        [DataLoader(TensorDataset(XS[i], YS[i]), batch_size=BATCH) for i in range(N)],
        dict(in_dims=0),
    ),
}


def planned(source: str, member: int) -> list:
    """Member `member`'s batches of all EPOCHS * STEPS steps, from the documented plan."""
    count = EPOCHS * STEPS
    if source == "tensors-shuffled":
        return [(X[idx], Y[idx]) for idx in batch_plan(ROWS, BATCH, count, seed=2)]
    if source == "dataloader-per-member":
        own = [
            (XS[member, k : k + BATCH], YS[member, k : k + BATCH]) for k in range(0, ROWS, BATCH)
        ]
        return [own[k % len(own)] for k in range(count)]
    return [LOADER_BATCHES[k % len(LOADER_BATCHES)] for k in range(count)]


@pytest.mark.parametrize("source", list(SOURCES))
def test_resume_mid_pass_sees_the_batches_an_uninterrupted_run_sees(tmp_path, source):
    # Interrupted at step 8 (in epoch 3); the checkpoint of epoch 2 stands 2 batches into pass 1.
    data, extra = SOURCES[source]()
    path = tmp_path / "ck.pt"
    # check=False: the first step's self-check would call the recording loss twice more.
    options = dict(epochs=EPOCHS, steps=STEPS, lr=LRS, progress=False, checkpoint=path,
                   check=False, **extra)  # fmt: skip
    options.setdefault("seed", 0)
    first, plain = ensemble_and_truth(0)
    with pytest.raises(KeyboardInterrupt):  # the same loss as the resumed run: a resume checks it
        vmapens.fit(first, data, Record(), callbacks=[StopAt(8)], **options)
    resumed, _ = ensemble_and_truth(0)
    loss = Record()
    vmapens.fit(resumed, data, loss, **options)
    straight, _ = ensemble_and_truth(0)
    vmapens.fit(straight, data, nn.MSELoss(), **{**options, "checkpoint": tmp_path / "s.pt"})

    torch.testing.assert_close(resumed.state_dict(), straight.state_dict(), rtol=0, atol=0)
    for i, model in enumerate(plain):
        train_alone(model, planned(source, i), make_opt=adam(LRS[i]))
    assert_members_equal(resumed, plain)
    if source != "dataloader-per-member":  # shared batches: the loss saw the real targets
        expected = [y for _, y in planned(source, 0)[2 * STEPS :]]
        assert len(loss.seen) == len(expected)
        for k, (seen, y) in enumerate(zip(loss.seen, expected, strict=True)):
            assert torch.equal(seen, y), f"resumed step {k}"


# -- schedulers ----------------------------------------------------------------------------------


SCHEDULERS = {
    "step-lr": lambda opt: lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    "exponential": lambda opt: lr_scheduler.ExponentialLR(opt, gamma=0.8),
    "one-cycle": lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=12),
    "lambda": lambda opt: lr_scheduler.LambdaLR(opt, lambda k: 1 / (1 + k)),
}
PER_EPOCH = 4  # 20 rows in batches of 6: 12 steps in 3 epochs, what one-cycle is built for


def lrs_of(optimizer: torch.optim.Optimizer, n: int) -> list[float]:
    lr = optimizer.param_groups[0]["lr"]
    return [float(v) for v in lr] if not isinstance(lr, float) else [lr] * n


@pytest.mark.parametrize("given", ["builder", "instance"])
@pytest.mark.parametrize("interval", ["step", "epoch"])
@pytest.mark.parametrize("kind", list(SCHEDULERS))
def test_scheduler_matches_torch_scheduler_on_each_member_alone(kind, interval, given):
    make = SCHEDULERS[kind]
    ens, plain = ensemble_and_truth(0)
    options = dict(epochs=3, batch_size=6, shuffle=False, progress=False, seed=0)
    optimizer = None  # the builder case: fit builds StackedAdam, then the scheduler on it
    if given == "builder":
        vmapens.fit(ens, (X, Y), nn.MSELoss(), callbacks=[LRScheduler(make, interval=interval)],
                    lr=LRS, **options)  # fmt: skip
    else:
        optimizer = vmapens.StackedAdam(ens, lr=LRS)
        vmapens.fit(ens, (X, Y), nn.MSELoss(), optimizer=optimizer,
                    callbacks=[LRScheduler(make(optimizer), interval=interval)], **options)  # fmt: skip
    batches = batch_plan(ROWS, 6, 3 * PER_EPOCH, shuffle=False)
    final = []
    for i, model in enumerate(plain):
        opt = torch.optim.Adam(model.parameters(), lr=LRS[i])
        sched = make(opt)

        def after_step(k, sched=sched):
            if interval == "step" or (k + 1) % PER_EPOCH == 0:
                sched.step()

        train_alone(model, [(X[b], Y[b]) for b in batches], make_opt=opt, after_step=after_step)
        final.append(opt.param_groups[0]["lr"])
    assert_members_equal(ens, plain)
    if optimizer is not None:
        torch.testing.assert_close(lrs_of(optimizer, N), final, **TOL64)
    assert final != LRS, "the schedule never changed the lr: the test would not see it"


@pytest.mark.parametrize("kind", list(SCHEDULERS))
def test_per_step_scheduler_resumes_from_a_checkpoint_as_if_never_stopped(tmp_path, kind):
    # Interrupted in epoch 2 (step 6 of 12): the checkpoint of epoch 1 holds the scheduler's
    # state (its step count), which a resumed run must continue from, not restart.
    make = SCHEDULERS[kind]
    options = dict(epochs=3, batch_size=6, shuffle=False, progress=False, seed=0, lr=LRS,
                   checkpoint=tmp_path / "ck.pt")  # fmt: skip
    first, plain = ensemble_and_truth(0)
    with pytest.raises(KeyboardInterrupt):
        vmapens.fit(first, (X, Y), nn.MSELoss(), **options,
                    callbacks=[LRScheduler(make, interval="step"), StopAt(6)])  # fmt: skip
    resumed, _ = ensemble_and_truth(0)
    vmapens.fit(resumed, (X, Y), nn.MSELoss(), callbacks=[LRScheduler(make, interval="step")],
                **options)  # fmt: skip
    batches = batch_plan(ROWS, 6, 3 * PER_EPOCH, shuffle=False)
    for i, model in enumerate(plain):
        opt = torch.optim.Adam(model.parameters(), lr=LRS[i])
        sched = make(opt)
        train_alone(model, [(X[b], Y[b]) for b in batches], make_opt=opt,
                    after_step=lambda k, sched=sched: sched.step())  # fmt: skip
    assert_members_equal(resumed, plain)


def plateau(opt):
    return vmapens.optim.ReduceLROnPlateau(opt, patience=0, factor=0.5)


@pytest.mark.parametrize(
    "options,match",
    [
        (dict(interval="step", val_data=(XV, YV)), r"`LRScheduler.interval` must be 'epoch'"),
        (dict(), r"needs `val_data`"),
    ],
    ids=["step-interval", "no-val-data"],
)  # fmt: skip
@pytest.mark.parametrize("given", ["builder", "instance"])
def test_plateau_scheduler_misuse_is_refused_before_anything_changes(options, match, given):
    ens, _ = ensemble_and_truth(0)
    optimizer = vmapens.StackedAdam(ens, lr=LRS)
    before = copy.deepcopy(ens.state_dict())
    opt_before = copy.deepcopy(optimizer.state_dict())
    scheduler = plateau if given == "builder" else plateau(optimizer)
    options = dict(options)
    if "interval" in options:
        options["callbacks"] = [LRScheduler(scheduler, interval=options.pop("interval"))]
    else:
        options["scheduler"] = scheduler
    with pytest.raises(ValueError, match=r"^fit: .*" + match):
        vmapens.fit(ens, (X, Y), nn.MSELoss(), optimizer=optimizer,
                    epochs=2, batch_size=6, progress=False, seed=0, **options)  # fmt: skip
    torch.testing.assert_close(ens.state_dict(), before, rtol=0, atol=0)
    assert repr(optimizer.state_dict()) == repr(opt_before)


def test_plateau_per_epoch_matches_torch_plateau_fed_each_members_val_loss():
    ens, plain = ensemble_and_truth(0)
    lrs = [0.05, 0.2, 0.5]  # large enough to overshoot: validation losses rise, lrs drop
    epochs = 6
    optimizer = vmapens.StackedAdam(ens, lr=lrs)
    h = vmapens.fit(ens, (X, Y), nn.MSELoss(), optimizer=optimizer, scheduler=plateau,
                    val_data=(XV, YV), callbacks=[EarlyStopping(restore_best=False)], epochs=epochs, batch_size=10,
                    shuffle=False, progress=False, seed=0)  # fmt: skip
    batches = batch_plan(ROWS, 10, 2, shuffle=False)
    final = []
    for i, model in enumerate(plain):
        opt = torch.optim.Adam(model.parameters(), lr=lrs[i])
        sched = lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
        for epoch in range(epochs):
            train_alone(model, [(X[b], Y[b]) for b in batches], make_opt=opt)
            with torch.no_grad():
                val = nn.functional.mse_loss(model.eval()(XV), YV)
            model.train()
            torch.testing.assert_close(h.val_loss[epoch, i], val, **TOL64)
            sched.step(float(val))
        final.append(opt.param_groups[0]["lr"])
    assert_members_equal(ens, plain)
    assert lrs_of(optimizer, N) == final
    assert final != lrs, "no plateau: the test would not see a wrong reduction"


@pytest.mark.parametrize("per_member", [False, True], ids=["shared", "per-member"])
def test_shuffling_dataloader_resumed_mid_pass_sees_the_uninterrupted_batches(tmp_path, per_member):
    # A DataLoader(shuffle=True) draws its order from torch's RNG when its iterator is made; a
    # resumed pass must re-make it from that state, or it skips batches of another permutation.
    def loaders():
        if per_member:
            return [
                DataLoader(TensorDataset(XS[i], YS[i]), batch_size=BATCH, shuffle=True)
                for i in range(N)
            ]
        return DataLoader(TensorDataset(X, Y), batch_size=BATCH, shuffle=True)

    extra = dict(in_dims=0) if per_member else {}
    options = dict(epochs=EPOCHS, steps=STEPS, lr=LRS, progress=False, seed=0, check=False,
                   **extra)  # fmt: skip
    first, _ = ensemble_and_truth(0)
    torch.manual_seed(5)
    with pytest.raises(KeyboardInterrupt):
        vmapens.fit(first, loaders(), Record() if not per_member else nn.MSELoss(),
                    callbacks=[StopAt(8)],
                    checkpoint=tmp_path / "ck.pt", **options)  # fmt: skip
    resumed, _ = ensemble_and_truth(0)
    resumed_seen = Record() if not per_member else nn.MSELoss()
    torch.manual_seed(123)  # the resumed process starts from another RNG state
    vmapens.fit(resumed, loaders(), resumed_seen, checkpoint=tmp_path / "ck.pt", **options)
    straight, _ = ensemble_and_truth(0)
    straight_seen = Record() if not per_member else nn.MSELoss()
    torch.manual_seed(5)
    vmapens.fit(straight, loaders(), straight_seen, checkpoint=tmp_path / "s.pt", **options)

    torch.testing.assert_close(resumed.state_dict(), straight.state_dict(), rtol=0, atol=0)
    if per_member:  # the loss sees each member's batch inside vmap: compare the states only
        return
    tail = straight_seen.seen[2 * STEPS :]  # the checkpoint of epoch 2 was at step 6
    assert len(resumed_seen.seen) == len(tail)
    for k, (got, want) in enumerate(zip(resumed_seen.seen, tail, strict=True)):
        assert torch.equal(got, want), f"resumed step {k}"


@pytest.mark.parametrize("own_generator", [False, True], ids=["torch-rng", "own-generator"])
def test_shuffling_dataloader_gives_fit_the_order_a_plain_loop_sees(own_generator):
    # Truth: each member alone, trained by a plain loop over the same DataLoader from the same
    # RNG state. fit draws nothing from the RNG the loader shuffles with (torch's, or its own
    # generator) but what each pass's iterator draws: before, checking that `data` is
    # re-iterable made an iterator, one draw, and the first pass saw another order.
    def loader() -> DataLoader:
        g = torch.Generator().manual_seed(3) if own_generator else None
        return DataLoader(TensorDataset(X, Y), batch_size=BATCH, shuffle=True, generator=g)

    ens, plain = ensemble_and_truth(0)
    torch.manual_seed(11)
    vmapens.fit(ens, loader(), nn.MSELoss(), epochs=3, lr=LRS, progress=False, seed=0)
    for i, model in enumerate(plain):
        torch.manual_seed(11)
        data = loader()
        batches = [batch for _ in range(3) for batch in data]  # MLP: no draws in training
        train_alone(model, batches, make_opt=adam(LRS[i]))
    assert_members_equal(ens, plain)


@pytest.mark.parametrize(("steps", "stop"), [(STEPS, 4), (None, 5)], ids=["mid-pass", "pass-end"])
def test_dataloader_with_its_own_generator_resumes_exactly(tmp_path, steps, stop):
    # DataLoader(shuffle=True, generator=g), the usual way to make shuffling reproducible,
    # draws every pass's order from g: the checkpoint keeps g's state (and the state g had when
    # the pass began, for a pass cut by `steps`), or a resumed run replays other orders.
    def loader() -> DataLoader:
        g = torch.Generator().manual_seed(3)  # a new process makes a new loader
        return DataLoader(TensorDataset(X, Y), batch_size=BATCH, shuffle=True, generator=g)

    # With `steps`, the checkpoint after epoch 0 is 3 batches into a pass of 4; without, at a
    # pass's end.
    options = dict(epochs=EPOCHS, steps=steps, lr=LRS, progress=False, seed=0, check=False)
    first, _ = ensemble_and_truth(0)
    with pytest.raises(KeyboardInterrupt):
        vmapens.fit(first, loader(), nn.MSELoss(), callbacks=[StopAt(stop)],
                    checkpoint=tmp_path / "ck.pt", **options)  # fmt: skip
    resumed, _ = ensemble_and_truth(0)
    vmapens.fit(resumed, loader(), nn.MSELoss(), checkpoint=tmp_path / "ck.pt", **options)
    straight, plain = ensemble_and_truth(0)
    vmapens.fit(straight, loader(), nn.MSELoss(), checkpoint=tmp_path / "s.pt", **options)
    torch.testing.assert_close(resumed.state_dict(), straight.state_dict(), rtol=0, atol=0)
    data = loader()  # the truth: a plain loop, one pass after another
    batches = [batch for _ in range(EPOCHS) for batch in data][: EPOCHS * (steps or 4)]
    for i, model in enumerate(plain):
        train_alone(model, batches, make_opt=adam(LRS[i]))
    assert_members_equal(straight, plain)


def test_resume_refuses_data_with_other_generators(tmp_path):
    # The checkpoint's loader drew from its own generator, this run's from torch's RNG: the
    # resumed orders could not be the uninterrupted run's. Refused, nothing restored.
    def loader(g: torch.Generator | None) -> DataLoader:
        return DataLoader(TensorDataset(X, Y), batch_size=BATCH, shuffle=True, generator=g)

    options = dict(epochs=3, lr=LRS, progress=False, seed=0, check=False)
    first, _ = ensemble_and_truth(0)
    with pytest.raises(KeyboardInterrupt):  # 4 steps a pass: after the first checkpoint
        vmapens.fit(first, loader(torch.Generator().manual_seed(3)), nn.MSELoss(),
                    callbacks=[StopAt(6)], checkpoint=tmp_path / "ck.pt", **options)  # fmt: skip
    again, plain = ensemble_and_truth(0)
    with pytest.raises(ValueError, match=r"generator\(s\) of its own"):
        vmapens.fit(again, loader(None), nn.MSELoss(), checkpoint=tmp_path / "ck.pt", **options)
    assert_members_equal(again, plain, rtol=0, atol=0)
