"""User journey: BatchNorm's edges, where an ensemble most easily differs from its members alone.

Running statistics are per-member state that the forward updates, so every way a forward can
run is a way to get them wrong: BatchNorm1d on 2-D and 3-D inputs, BatchNorm2d/3d,
InstanceNorm1d/2d with running statistics, `nn.SyncBatchNorm` without a process group,
`affine=False`, `track_running_stats=False` (batch statistics in eval too), `momentum=None`
(the cumulative average that `num_batches_tracked` drives) across masked steps and a
save/load resume, a BatchNorm frozen in eval (and its affine frozen) inside a model in train
mode through `fit` with `val_data` and `predict`, the same BatchNorm twice in one forward, a
teacher BatchNorm on a detached path under `torch.no_grad()`, eval batches of one row, a
train batch with one value per channel, `LazyBatchNorm1d`, `reset_running_stats` on the
template and on every member, members of different widths. Under vmap, `chunk_size=2` and
`backend="loop"`.

The truth: each member a plain module (built after `torch.manual_seed(k)`, as `seeds=` builds
member k) trained alone with `torch.optim.Adam` on the same batches, float64. Every layer
before a BatchNorm has `bias=False`: that bias's true gradient is 0 and Adam steps on its
round-off (docs/semantics.md), in plain PyTorch too. Tolerance 1e-10 relative: the same maths,
batched kernels sum in another order.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.checkpoint
from torch import Tensor, nn
from truth import seeded_members

import vmapens
from vmapens.callbacks import Callback, EarlyStopping

N = 3
TOL: dict[str, Any] = dict(rtol=1e-10, atol=1e-12)
BACKENDS = [{}, {"chunk_size": 2}, {"backend": "loop"}]
IDS = ["vmap", "chunks", "loop"]

pytestmark = pytest.mark.usefixtures("float64_default")


def _batches(rows: tuple[int, ...], seed: int = 1) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(r, 3, generator=g), torch.randn(r, 1, generator=g)) for r in rows]


def _alone_step(m: nn.Module, opt: torch.optim.Optimizer, x: Tensor, y: Tensor) -> None:
    opt.zero_grad()
    nn.functional.mse_loss(m(x), y).backward()
    opt.step()


def _train_both(
    ens: vmapens.Ensemble,
    alone: list[nn.Module],
    batches: list[tuple[Tensor, Tensor]],
    masks: list[list[bool] | None] | None = None,
) -> None:
    """Adam steps of the ensemble (make_step + StackedAdam) and of each member alone with
    torch.optim.Adam; a member masked at a step is not called alone at that step."""
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-2))
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in alone]
    for k, (x, y) in enumerate(batches):
        mask = None if masks is None else masks[k]
        step(x, y) if mask is None else step(x, y, torch.tensor(mask))
        for i, (m, opt) in enumerate(zip(alone, opts, strict=True)):
            if mask is None or mask[i]:
                _alone_step(m, opt, x, y)


def _assert_members(ens: vmapens.Ensemble, alone: list[nn.Module], where: str = "") -> None:
    """Parameters, running statistics and num_batches_tracked, key for key."""
    for i, m in enumerate(alone):
        got, want = ens.state_dicts()[i], m.state_dict()
        assert list(got) == list(want)
        for k in want:
            torch.testing.assert_close(got[k], want[k], **TOL, msg=f"{where} member {i} {k}")


def _assert_outputs(ens: vmapens.Ensemble, alone: list[nn.Module], x: Tensor) -> None:
    """Outputs in train mode (which moves the statistics again, under no_grad) then eval."""
    for mode in (True, False):
        ens.train(mode)
        with torch.no_grad():
            out = ens(x)
        for i, m in enumerate(alone):
            with torch.no_grad():
                torch.testing.assert_close(out[i], m.train(mode)(x), **TOL)
        _assert_members(ens, alone, f"after a forward in {'train' if mode else 'eval'} mode")


# -- every norm layer with running statistics, in one member --------------------------------


class Norms(nn.Module):
    """One member holding every norm layer with per-member state, each on its own input
    shape: BatchNorm1d on [B, C] and [B, C, L], BatchNorm2d, BatchNorm3d, InstanceNorm1d and
    InstanceNorm2d with running statistics, SyncBatchNorm, BatchNorm without affine and one
    without running statistics."""

    def __init__(self, momentum: float | None) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 12, bias=False)
        mom = dict(momentum=momentum)
        self.bn1 = nn.BatchNorm1d(12, **mom)
        self.bn1_3d = nn.BatchNorm1d(4, **mom)  # [B, 4, 3]
        self.bn2 = nn.BatchNorm2d(3, **mom)  # [B, 3, 2, 2]
        self.bn3 = nn.BatchNorm3d(3, **mom)  # [B, 3, 1, 2, 2]
        self.in1 = nn.InstanceNorm1d(4, track_running_stats=True, **mom)  # [B, 4, 3]
        self.in2 = nn.InstanceNorm2d(3, affine=True, track_running_stats=True, **mom)
        self.sync = nn.SyncBatchNorm(6, **mom)  # [B, 6, 2]
        self.plain = nn.BatchNorm1d(4, affine=False, **mom)  # [B, 4, 3]
        self.batch_only = nn.BatchNorm1d(12, track_running_stats=False, **mom)
        self.head = nn.Linear(12 * 9, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.bn1(self.fc(x))
        b = x.shape[0]
        outs = [
            self.bn1_3d(h.view(b, 4, 3)),
            self.bn2(h.view(b, 3, 2, 2)),
            self.bn3(h.view(b, 3, 1, 2, 2)),
            self.in1(h.view(b, 4, 3)),
            self.in2(h.view(b, 3, 2, 2)),
            self.sync(h.view(b, 6, 2)),
            self.plain(h.view(b, 4, 3)),
            self.batch_only(h),
            h,
        ]
        return self.head(torch.tanh(torch.cat([o.reshape(b, -1) for o in outs], 1)))


@pytest.mark.parametrize("momentum", [0.3, None], ids=["momentum", "cumulative"])
@pytest.mark.parametrize("options", BACKENDS, ids=IDS)
def test_every_norm_layer_trains_as_alone(momentum: float | None, options: dict) -> None:
    def factory() -> nn.Module:
        return Norms(momentum)

    ens = vmapens.Ensemble(factory, n=N, seeds=range(N), **options)
    alone = seeded_members(factory, N)
    _train_both(ens, alone, _batches((5, 4, 6)))
    _assert_members(ens, alone, "after 3 steps")
    assert ens.get_buffer("bn2.num_batches_tracked").tolist() == [3] * N
    _assert_outputs(ens, alone, _batches((5,), seed=2)[0][0])


# -- momentum=None: masked members and a resume ----------------------------------------------


class Net(nn.Module):
    def __init__(self, momentum: float | None = None, tracked: bool = True) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 8, bias=False)
        self.bn = nn.BatchNorm1d(4, momentum=momentum, track_running_stats=tracked)
        self.head = nn.Linear(8, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.bn(self.fc(x).view(-1, 4, 2))).flatten(1))


@pytest.mark.parametrize("options", BACKENDS, ids=IDS)
def test_cumulative_average_across_masked_steps_and_a_resume(options: dict, tmp_path: Path):
    # A masked member's count, and so its next cumulative factor 1/(count + 1), stays its own;
    # the checkpoint carries the counts, and the loaded ensemble goes on from them.
    factory = functools.partial(Net, None)
    ens = vmapens.Ensemble(factory, n=N, seeds=range(N), **options)
    alone = seeded_members(factory, N)
    opt = vmapens.StackedAdam(ens, lr=1e-2)
    step = vmapens.make_step(ens, nn.MSELoss(), opt)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in alone]
    batches = _batches((5, 4, 6, 3))
    masks = [None, [True, False, True], None, [True, True, False]]

    def both(k: int, step: Callable[..., Tensor]) -> None:
        x, y = batches[k]
        mask = masks[k]
        step(x, y) if mask is None else step(x, y, torch.tensor(mask))
        for i, (m, o) in enumerate(zip(alone, opts, strict=True)):
            if mask is None or mask[i]:
                _alone_step(m, o, x, y)

    both(0, step)
    both(1, step)
    path = tmp_path / "run.pt"
    vmapens.save(ens, path, opt)
    resumed = vmapens.load(path, factory)
    opt2 = vmapens.StackedAdam(resumed, lr=1e-2)
    vmapens.checkpoint.restore(path, resumed, opt2)
    step2 = vmapens.make_step(resumed, nn.MSELoss(), opt2)
    both(2, step2)
    both(3, step2)
    assert resumed.get_buffer("bn.num_batches_tracked").tolist() == [4, 3, 3]
    _assert_members(resumed, alone, "after the resume")


# -- fit with val_data, and predict -----------------------------------------------------------


class StopMemberOne(Callback):
    def on_epoch_end(self, ctx: Any) -> None:
        if ctx.epoch == 0:
            ctx.stop([1])


def _fit_alone(m: nn.Module, stop_after: int | None, restore: bool, *data: Tensor) -> list:
    """The plain loop: 3 epochs of 2 batches, validation in eval mode under no_grad with
    every submodule's own mode back after it, training stopped after epoch `stop_after`, and
    with `restore` the best epoch's state dict loaded at the end (EarlyStopping's default)."""
    X, Y, Xv, Yv = data
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    best, best_state, losses = float("inf"), None, []
    for epoch in range(3):
        if stop_after is not None and epoch > stop_after:
            losses.append(float("nan"))
            continue
        for k in (0, 4):
            _alone_step(m, opt, X[k : k + 4], Y[k : k + 4])
        modes = {name: sub.training for name, sub in m.named_modules()}
        m.eval()
        with torch.no_grad():
            loss = nn.functional.mse_loss(m(Xv), Yv).item()
        for name, sub in m.named_modules():
            sub.training = modes[name]
        losses.append(loss)
        if loss < best:
            best, best_state = loss, copy.deepcopy(m.state_dict())
    if restore:
        m.load_state_dict(best_state)
    return losses


def _frozen(m: nn.Module) -> None:
    m.train()
    m.bn.eval()
    m.bn.requires_grad_(False)


Edit = Callable[[nn.Module], None] | None
CONFIGS: dict[str, tuple[Callable[[], nn.Module], Edit, bool]] = {
    # without the best-epoch restore, the stopped member's frozen statistics are kept to the end
    "cumulative": (functools.partial(Net, None), None, False),
    "batch-stats": (functools.partial(Net, 0.1, False), None, True),
    "frozen-bn": (functools.partial(Net, 0.1), _frozen, True),
}


@pytest.mark.parametrize(
    ("config", "options"),
    [("cumulative", o) for o in BACKENDS]
    + [("frozen-bn", o) for o in BACKENDS]
    + [("batch-stats", {})],
    ids=[f"cumulative-{i}" for i in IDS] + [f"frozen-bn-{i}" for i in IDS] + ["batch-stats"],
)
def test_fit_with_val_data_then_predict_as_alone(config: str, options: dict) -> None:
    # Member 1 stops after the first epoch (its statistics and count freeze); validation runs
    # in eval mode and moves no statistics; every member gets its best epoch's parameters and
    # buffers back (or not); a BatchNorm frozen in eval (its affine frozen too) stays frozen.
    factory, edit, restore = CONFIGS[config]
    ens = vmapens.Ensemble(factory, n=N, seeds=range(N), **options)
    alone = seeded_members(factory, N)
    if edit is not None:
        ens.train()
        ens.template.bn.eval()
        ens.template.bn.requires_grad_(False)
        for m in alone:
            edit(m)
    g = torch.Generator().manual_seed(3)
    X, Y, Xv, Yv = (torch.randn(r, c, generator=g) for r, c in ((8, 3), (8, 1), (6, 3), (6, 1)))
    history = vmapens.fit(
        ens, (X, Y), nn.MSELoss(), epochs=3, batch_size=4, shuffle=False, val_data=(Xv, Yv),
        lr=1e-2, progress=False, callbacks=[StopMemberOne(), EarlyStopping(restore_best=restore)],
    )  # fmt: skip
    data = X, Y, Xv, Yv
    want = [_fit_alone(m, 0 if i == 1 else None, restore, *data) for i, m in enumerate(alone)]
    torch.testing.assert_close(history.val_loss, torch.tensor(want).T, **TOL, equal_nan=True)
    _assert_members(ens, alone, "after fit")
    assert ens.training and ens.template.bn.training is (edit is None)
    predicted = vmapens.predict(ens, Xv, batch_size=4)  # batch statistics: batches of 4 and 2
    for i, m in enumerate(alone):
        m.eval()
        with torch.no_grad():
            torch.testing.assert_close(predicted[i], torch.cat([m(Xv[:4]), m(Xv[4:])]), **TOL)
    assert ens.training and ens.template.bn.training is (edit is None)
    _assert_members(ens, alone, "after predict")


# -- one BatchNorm twice, and a teacher's BatchNorm under no_grad ----------------------------


class TwiceAndTeacher(nn.Module):
    """The same BatchNorm applied twice (its statistics updated twice a forward, its count by
    2), and a teacher BatchNorm fed a detached path under torch.no_grad()."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4, bias=False)
        self.bn = nn.BatchNorm1d(4, momentum=None)
        self.teacher = nn.BatchNorm1d(4, momentum=0.2)
        self.head = nn.Linear(4, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        with torch.no_grad():
            t = self.teacher(h.detach())
        return self.head(torch.tanh(self.bn(torch.tanh(self.bn(h)))) + t)


@pytest.mark.parametrize("options", BACKENDS, ids=IDS)
def test_one_batchnorm_twice_and_a_teacher_path_under_no_grad(options: dict) -> None:
    ens = vmapens.Ensemble(TwiceAndTeacher, n=N, seeds=range(N), **options)
    alone = seeded_members(TwiceAndTeacher, N)
    _train_both(ens, alone, _batches((5, 4, 6)))
    assert ens.get_buffer("bn.num_batches_tracked").tolist() == [6] * N
    assert ens.get_buffer("teacher.num_batches_tracked").tolist() == [3] * N
    _assert_members(ens, alone, "after 3 steps")
    _assert_outputs(ens, alone, _batches((5,), seed=2)[0][0])


# -- batches of one row -----------------------------------------------------------------------


def test_eval_batches_of_one_row_as_alone() -> None:
    factory = functools.partial(Net, 0.1)
    ens = vmapens.Ensemble(factory, n=N, seeds=range(N))
    alone = seeded_members(factory, N)
    _train_both(ens, alone, _batches((5,)))
    x = _batches((4,), seed=2)[0][0]
    ens.eval()
    predicted = vmapens.predict(ens, x, batch_size=1)
    with torch.no_grad():
        out = ens(x[:1])
    for i, m in enumerate(alone):
        m.eval()
        with torch.no_grad():
            torch.testing.assert_close(out[i], m(x[:1]), **TOL)
            torch.testing.assert_close(predicted[i], m(x), **TOL)
    _assert_members(ens, alone, "after eval batches")


def _one_row(norm: Callable[[], nn.Module], shape: tuple[int, ...]) -> Callable[[], nn.Module]:
    class OneRow(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = norm()
            self.scale = nn.Parameter(torch.ones(1))  # something to train without affine

        def forward(self, x: Tensor) -> Tensor:
            h = self.norm(x.view(x.shape[0], *shape)).flatten(1)
            return h.sum(1, keepdim=True) * self.scale

    return OneRow


ONE_VALUE = {
    "bn1d": (lambda: nn.BatchNorm1d(4), (4,), 1),
    "bn1d-3d": (lambda: nn.BatchNorm1d(4, momentum=None), (4, 1), 1),
    "bn2d": (lambda: nn.BatchNorm2d(4), (4, 1, 1), 1),
    "sync": (lambda: nn.SyncBatchNorm(4, momentum=None), (4,), 1),
    "instance": (lambda: nn.InstanceNorm1d(4, track_running_stats=True), (4, 1), 3),
    "batch-stats-eval": (lambda: nn.BatchNorm1d(4, track_running_stats=False), (4,), 1),
}


@pytest.mark.parametrize("name", list(ONE_VALUE))
def test_one_value_per_channel_is_refused_as_alone_and_changes_nothing(name: str) -> None:
    # Alone: ValueError 'Expected more than 1 value per channel' (or 'spatial element') in
    # train mode; in eval mode too without running statistics (batch statistics).
    norm, shape, rows = ONE_VALUE[name]
    factory = _one_row(norm, shape)
    ens = vmapens.Ensemble(factory, n=N, seeds=range(N))
    member = seeded_members(factory, 1)[0]
    if name == "batch-stats-eval":
        ens.eval()
        member.eval()
    x, y = torch.randn(rows, 4), torch.randn(rows, 1)
    with pytest.raises(ValueError, match="Expected more than 1") as alone:
        member(x)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    with pytest.raises(ValueError, match="Expected more than 1") as got:
        ens(x)
    assert str(got.value) == str(alone.value)
    if ens.training:
        step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-2))
        with pytest.raises(ValueError, match="Expected more than 1"):
            step(x, y)
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k


# -- building, resets and modes ---------------------------------------------------------------


def test_lazy_batchnorm_is_refused_at_build_with_the_way_out() -> None:
    def factory() -> nn.Module:
        return nn.Sequential(nn.Linear(3, 4, bias=False), nn.LazyBatchNorm1d())

    with pytest.raises(ValueError, match=r"uninitialised lazy tensor `1\.weight`.*forward pass"):
        vmapens.Ensemble(factory, n=N, seeds=range(N))


def test_members_with_other_momenta_are_refused_and_other_statistics_train_as_alone() -> None:
    with pytest.raises(ValueError, match=r"member 1 differs from member 0 at `bn`.*`momentum`"):
        vmapens.Ensemble.from_modules([Net(0.1), Net(None), Net(0.1)])
    # Members whose statistics and counts differ (each ran its own batches before stacking)
    alone = seeded_members(functools.partial(Net, None), N)
    for k, m in enumerate(alone):
        for x, _ in _batches((4,) * (k + 1), seed=9 + k):
            m(x)
    ens = vmapens.Ensemble.from_modules(copy.deepcopy(alone))
    _train_both(ens, alone, _batches((5, 4)))
    assert ens.get_buffer("bn.num_batches_tracked").tolist() == [3, 4, 5]
    _assert_members(ens, alone, "after 2 steps")


@pytest.mark.parametrize("options", BACKENDS, ids=IDS)
def test_reset_running_stats_on_the_template_is_refused_and_apply_resets_as_alone(options):
    factory = functools.partial(Net, 0.1)
    ens = vmapens.Ensemble(factory, n=N, seeds=range(N), **options)
    alone = seeded_members(factory, N)
    x = _batches((5,))[0][0]
    ens(x)
    for m in alone:
        m(x)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    ens.template.bn.reset_running_stats()  # on meta: writes nothing
    with pytest.raises(ValueError, match=r"`ens\.template\.bn\.running_mean` was written"):
        ens(x)
    for k, v in ens.state_dict().items():  # refused once: the ensemble goes on
        assert torch.equal(v, before[k]), k

    def reset(m: nn.Module) -> None:
        if isinstance(m, nn.BatchNorm1d):
            m.reset_running_stats()

    fresh = vmapens.Ensemble(factory, n=N, seeds=range(N), **options)
    fresh(x)
    fresh.apply(reset)
    for m in alone:
        m.apply(reset)
    _assert_members(fresh, alone, "after apply(reset)")


# -- bugs -------------------------------------------------------------------------------------


class Wide(nn.Module):
    def __init__(self, width: int, norm: type[nn.Module]) -> None:
        super().__init__()
        self.fc = nn.Linear(3, width, bias=False)
        self.bn = norm(width)
        self.head = nn.Linear(width, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.bn(self.fc(x))))


@pytest.mark.parametrize(
    "norm",
    [
        nn.BatchNorm1d,
        nn.SyncBatchNorm,  # refused as a setting until patch bnedges-1
    ],
)
def test_members_of_different_widths_train_as_alone(norm: type[nn.Module]) -> None:
    factories = [functools.partial(Wide, w, norm) for w in (2, 4, 3)]
    ens = vmapens.Ensemble.from_factories(factories, seed=0)
    alone = [copy.deepcopy(m) for m in ens.unstack()]
    _train_both(ens, alone, _batches((5, 4)))
    _assert_outputs(ens, alone, _batches((5,), seed=2)[0][0])


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4, bias=False)
        self.bn = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 1)

    def block(self, h: Tensor) -> Tensor:
        return torch.tanh(self.bn(h))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.utils.checkpoint.checkpoint(self.block, self.fc(x), use_reentrant=False)
        return self.head(h)


def test_checkpoint_refusal_does_not_promise_the_same_statistics() -> None:
    """The refusal said 'the results are the same' when the checkpointed function is called
    directly, but alone the recompute updates a train-mode BatchNorm's statistics a second time:
    the advice gave other statistics, silently; it says so since patch bnedges-2."""
    member = seeded_members(Checkpointed, 1)[0]
    _alone_step(member, torch.optim.Adam(member.parameters()), *_batches((5,))[0])
    assert int(member.bn.num_batches_tracked) == 2  # alone: the recompute counted again
    ens = vmapens.Ensemble(Checkpointed, n=N, seeds=range(N))
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-2))
    with pytest.raises(RuntimeError, match="torch.utils.checkpoint") as err:
        step(*_batches((5,))[0])
    assert "results are the same" not in str(err.value)
    assert "BatchNorm" in str(err.value) and "second time" in str(err.value)
