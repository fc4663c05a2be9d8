"""Norm layers in an ensemble against plain torch: cases a bug hunt found.

Every truth here is plain PyTorch: the same modules built alone (seeded as ``seeds=`` builds
the members), trained with ``torch.optim``, and ``torch.optim.swa_utils`` on each.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel
from torch.optim.swa_utils import update_bn as torch_update_bn
from truth import seeded_members

import vmapens

N = 3
TOL = dict(rtol=1e-10, atol=1e-12)  # float64: the same maths, sums in another order

pytestmark = pytest.mark.usefixtures("float64_default")


# -- BatchNorm subclasses with momentum=None ------------------------------------------------


class PlainSub(nn.BatchNorm1d):
    pass


class Tagged(nn.BatchNorm2d):
    """A subclass that adds an attribute and a method, and keeps torch's forward."""

    def __init__(self, channels: int, momentum: float | None = 0.1) -> None:
        super().__init__(channels, momentum=momentum)
        self.tag = "bn"

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tag={self.tag}"


class OwnForward(nn.BatchNorm1d):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input) * 2


class MLP(nn.Module):
    def __init__(self, norm: type[nn.Module] = PlainSub, momentum: float | None = None) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.bn = norm(4, momentum=momentum)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.fc(x))))


class CNN(nn.Module):
    def __init__(self, momentum: float | None = None) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.bn = Tagged(3, momentum=momentum)
        self.head = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def _x(model: str, rows: int) -> torch.Tensor:
    return torch.randn(rows, 3) if model == "mlp" else torch.randn(rows, 2, 5, 5)


def _factory(model: str, momentum: float | None) -> Callable[[], nn.Module]:
    if model == "mlp":
        return lambda: MLP(PlainSub, momentum)
    return lambda: CNN(momentum)


def _train_both(
    ens: vmapens.Ensemble,
    alone: list[nn.Module],
    model: str,
    steps: int,
    edit: Callable[[nn.Module], None] | None = None,
) -> None:
    """``steps`` SGD steps of the ensemble and of each member alone on the same batches, with
    ``edit`` applied to ``ens.template`` and to every lone member before the first."""
    if edit is not None:
        edit(ens.template)
        for m in alone:
            edit(m)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1, momentum=0.5))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.5) for m in alone]
    for rows in (6, 4, 5)[:steps]:
        x, y = _x(model, rows), torch.randn(rows, 1)
        step(x, y)
        for m, opt in zip(alone, opts, strict=True):
            opt.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()


def _assert_as_alone(ens: vmapens.Ensemble, alone: list[nn.Module], model: str) -> None:
    """Parameters, running statistics, ``num_batches_tracked`` and outputs in train and eval
    mode (the train-mode forward moves the statistics again: compared after it too)."""
    for i, m in enumerate(alone):
        torch.testing.assert_close(ens.state_dicts()[i], m.state_dict(), **TOL)
    x = _x(model, 5)
    for mode in (False, True):
        ens.train(mode)
        with torch.no_grad():
            out = ens(x)
        for i, m in enumerate(alone):
            with torch.no_grad():
                torch.testing.assert_close(out[i], m.train(mode)(x), **TOL)
            torch.testing.assert_close(ens.state_dicts()[i], m.state_dict(), **TOL)


@pytest.mark.parametrize("options", [{}, {"chunk_size": 2}], ids=["vmap", "chunked"])
@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_batchnorm_subclass_with_cumulative_average_trains_as_alone(model, options):
    factory = _factory(model, None)
    ens = vmapens.Ensemble(factory, n=N, seeds=range(N), **options)
    alone = seeded_members(factory, N)
    _train_both(ens, alone, model, steps=3)
    assert int(ens.get_buffer("bn.num_batches_tracked")[0]) == 3
    _assert_as_alone(ens, alone, model)
    assert isinstance(ens[0].bn, (PlainSub, Tagged)) and ens[0].bn.momentum is None


def _cumulative(template: nn.Module) -> None:
    template.bn.momentum = None


def test_momentum_none_set_on_the_template_after_building_and_back():
    # docs/semantics.md: `ens.template.bn.momentum = None` reaches every member at the next
    # call; for a subclass of BatchNorm too.
    factory = _factory("cnn", 0.3)
    ens = vmapens.Ensemble(factory, n=N, seeds=range(N))
    alone = seeded_members(factory, N)
    _train_both(ens, alone, "cnn", steps=2, edit=_cumulative)
    _train_both(ens, alone, "cnn", steps=2, edit=lambda t: setattr(t.bn, "momentum", 0.2))
    _assert_as_alone(ens, alone, "cnn")
    assert type(ens.runner.bn) is Tagged  # back to the user's own class with a float momentum


def test_a_subclass_twin_survives_deepcopy_and_pickle():
    factory = _factory("mlp", None)
    ens = vmapens.Ensemble(factory, n=N, seeds=range(N))
    alone = seeded_members(factory, N)
    _train_both(ens, alone, "mlp", steps=1)
    buffer = io.BytesIO()
    torch.save(ens, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for other in (copy.deepcopy(ens), loaded):
        twins = copy.deepcopy(alone)
        assert isinstance(other.runner.bn, PlainSub)
        _train_both(other, twins, "mlp", steps=2)
        _assert_as_alone(other, twins, "mlp")


def test_a_subclass_with_its_own_forward_is_refused_clearly_and_loop_trains_it():
    def factory() -> nn.Module:
        return MLP(OwnForward, None)

    ens = vmapens.Ensemble(factory, n=N, seeds=range(N))
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"OwnForward.*own `forward`.*backend='loop'"):
        ens(torch.randn(4, 3))
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k
    looped = vmapens.Ensemble(factory, n=N, seeds=range(N), backend="loop")
    alone = seeded_members(factory, N)
    _train_both(looped, alone, "mlp", steps=2)
    _assert_as_alone(looped, alone, "mlp")


def test_sync_batchnorm_with_cumulative_average_trains_as_alone():
    # Without a process group SyncBatchNorm computes as BatchNorm, momentum=None included
    # (it failed under vmap: torch's `.item()` of num_batches_tracked).
    def factory() -> nn.Module:
        return MLP(nn.SyncBatchNorm, None)

    ens = vmapens.Ensemble(factory, n=N, seeds=range(N))
    alone = seeded_members(factory, N)
    _train_both(ens, alone, "mlp", steps=2)
    _assert_as_alone(ens, alone, "mlp")


# -- vmapens.swa.update_bn against torch's on each member -----------------------------------


@pytest.mark.parametrize(
    "norm", [PlainSub, nn.SyncBatchNorm, OwnForward], ids=["subclass", "sync", "own-forward"]
)
def test_update_bn_of_batchnorm_subclasses_and_sync_matches_torch(norm):
    # update_bn runs with momentum=None: a subclass that keeps torch's forward and
    # SyncBatchNorm failed under vmap; one with its own forward runs with backend="loop".
    def factory() -> nn.Module:
        return MLP(norm, 0.2)

    backend = "loop" if norm is OwnForward else "vmap"
    ens = vmapens.Ensemble(factory, n=N, seeds=range(N), backend=backend)
    alone = seeded_members(factory, N)
    _train_both(ens, alone, "mlp", steps=1)
    swa, twins = AveragedModel(ens), [AveragedModel(m) for m in alone]
    loader = [(_x("mlp", 5), torch.zeros(5)), (_x("mlp", 4), torch.zeros(4))]
    vmapens.swa.update_bn(loader, swa)
    for twin in twins:
        torch_update_bn(loader, twin)
    averaged = swa.module
    for i, twin in enumerate(twins):
        torch.testing.assert_close(averaged.state_dicts()[i], twin.module.state_dict(), **TOL)
    assert averaged.template.bn.momentum == 0.2 and type(averaged.runner.bn) is norm


@pytest.mark.parametrize("norm", [nn.BatchNorm1d, PlainSub, nn.SyncBatchNorm])
def test_cumulative_average_with_tracking_switched_off_after_building(norm):
    # A layer with its buffers and track_running_stats=False normalises by the batch and
    # leaves the buffers alone; the momentum=None twin counted and updated them.
    def factory() -> nn.Module:
        return MLP(norm, None)

    def untracked(template: nn.Module) -> None:
        template.bn.track_running_stats = False

    ens = vmapens.Ensemble(factory, n=N, seeds=range(N))
    alone = seeded_members(factory, N)
    _train_both(ens, alone, "mlp", steps=2, edit=untracked)
    _assert_as_alone(ens, alone, "mlp")
    assert int(ens.get_buffer("bn.num_batches_tracked").abs().sum()) == 0


def test_update_bn_refuses_a_subclass_with_its_own_forward_under_vmap_and_changes_nothing():
    def factory() -> nn.Module:
        return MLP(OwnForward, 0.2)

    ens = vmapens.Ensemble(factory, n=N, seeds=range(N))
    ens.template.bn.eval()  # a frozen layer stays frozen
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"OwnForward.*backend='loop'"):
        vmapens.swa.update_bn([_x("mlp", 5)], ens)
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert ens.template.bn.momentum == 0.2 and ens.runner.bn.momentum == 0.2
    assert type(ens.runner.bn) is OwnForward and not ens.runner.bn.training and ens.training
