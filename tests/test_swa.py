"""SWA and EMA of an ensemble against N plain ``AveragedModel(member)``s and torch's ``update_bn``.

``torch.optim.swa_utils.AveragedModel(ens)`` averages the stacked tensors; ``vmapens.swa.update_bn``
recomputes every member's BatchNorm statistics. The truth is torch itself: one
``AveragedModel(member_i)`` per member, fed the member's own values after every step, and
``torch.optim.swa_utils.update_bn`` on each. float64, so only the order of sums differs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.optim.swa_utils import update_bn as torch_update_bn
from torch.utils.data import DataLoader, TensorDataset

import vmapens
from vmapens.swa import update_bn

TOL = dict(rtol=1e-12, atol=1e-12)  # float64: the same maths, sums in another order
N = 3


class MLP(nn.Module):
    def __init__(self, hidden: int = 6, momentum: float | None = 0.1) -> None:
        super().__init__()
        self.fc1 = nn.Linear(3, hidden)
        self.bn = nn.BatchNorm1d(hidden, momentum=momentum)
        self.fc2 = nn.Linear(hidden, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4, momentum=0.3)
        self.inorm = nn.InstanceNorm2d(4, track_running_stats=True)  # not a _BatchNorm
        self.bn_free = nn.BatchNorm1d(4, track_running_stats=False)  # no statistics
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inorm(torch.relu(self.bn(self.conv(x))))
        return self.head(self.bn_free(h.mean((2, 3))))


def _x(model: str, rows: int, g: torch.Generator) -> torch.Tensor:
    shape = (rows, 3) if model == "mlp" else (rows, 2, 5, 5)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _loader(model: str, kind: str, g: torch.Generator) -> Any:
    xs = [_x(model, rows, g) for rows in (6, 4, 5)]
    if kind == "list":
        return xs
    x = torch.cat(xs)
    ds = TensorDataset(x, torch.zeros(len(x), 2, dtype=torch.float64))
    return DataLoader(ds, batch_size=6, shuffle=False)  # (x, y) batches of 6, 6, 3


def _averaged(avg: str, module: nn.Module) -> AveragedModel:
    if avg == "swa":
        return AveragedModel(module)
    if avg == "swa_buffers":
        return AveragedModel(module, use_buffers=True)
    ema = get_ema_multi_avg_fn(0.7)
    return AveragedModel(module, multi_avg_fn=ema, use_buffers=avg == "ema_buffers")


def _trained(
    ens: vmapens.Ensemble, model: str, avg: str, g: torch.Generator
) -> tuple[AveragedModel, list[AveragedModel]]:
    """A few SGD steps; after each, the ensemble's AveragedModel and every member's twin
    (``AveragedModel(member_i)``, given member i's own values) are updated."""
    opt = vmapens.StackedSGD(ens, lr=0.1, momentum=0.5)
    step = vmapens.make_step(ens, nn.MSELoss(), opt)
    swa = _averaged(avg, ens)
    twins = [_averaged(avg, ens[i]) for i in range(len(ens))]
    for _ in range(3):
        step(_x(model, 8, g), torch.randn(8, 2, generator=g, dtype=torch.float64))
        swa.update_parameters(ens)
        for i, twin in enumerate(twins):
            twin.update_parameters(ens[i])
    return swa, twins


def _assert_members(swa: AveragedModel, twins: list[AveragedModel], x: torch.Tensor) -> None:
    """Every member's parameters and buffers, n_averaged and eval outputs equal its twin's."""
    ens = swa.module
    for i, twin in enumerate(twins):
        torch.testing.assert_close(ens[i].state_dict(), twin.module.state_dict(), **TOL)
    assert torch.equal(swa.n_averaged, twins[0].n_averaged)
    swa.eval()
    out = swa(x)
    for i, twin in enumerate(twins):
        torch.testing.assert_close(out[i], twin.eval()(x), **TOL)


def _state(swa: AveragedModel) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in swa.module.state_dict().items()}


# -- against torch, member by member ------------------------------------------------------------

CASES = [
    # (model, loader, averaging, ensemble options)
    ("mlp", "list", "swa", {}),
    ("mlp", "loader", "swa", {}),
    ("cnn", "list", "swa", {}),
    ("cnn", "loader", "ema", {}),
    ("mlp", "list", "ema", {}),
    ("mlp", "list", "ema_buffers", {}),
    ("mlp", "loader", "swa_buffers", {}),
    ("mlp", "list", "swa", {"backend": "loop"}),
    ("cnn", "loader", "swa", {"backend": "loop"}),
    ("mlp", "list", "swa", {"chunk_size": 2}),
    ("mlp", "list", "swa", {"momentum": None}),  # already cumulative in training
]


@pytest.mark.parametrize(
    "model, loader_kind, avg, options",
    CASES,
    ids=[f"{m}-{lk}-{a}" + "".join(f"-{k}={v}" for k, v in o.items()) for m, lk, a, o in CASES],
)
def test_members_match_torch_update_bn(model, loader_kind, avg, options):
    g = torch.Generator().manual_seed(0)
    options = dict(options)
    factory: Callable[[], nn.Module] = CNN
    if model == "mlp":
        factory = functools.partial(MLP, momentum=options.pop("momentum", 0.1))
    ens = vmapens.Ensemble(factory, n=N, seed=1, **options).double()
    swa, twins = _trained(ens, model, avg, g)
    loader = _loader(model, loader_kind, g)
    before = _state(swa)
    update_bn(loader, swa, device="cpu")
    for twin in twins:
        torch_update_bn(loader, twin, device="cpu")
    after = swa.module.state_dict()
    assert not torch.equal(after["bn.running_mean"], before["bn.running_mean"])
    assert after["bn.num_batches_tracked"].tolist() == [3] * N  # one per batch, per member
    _assert_members(swa, twins, _x(model, 5, g))


def test_an_ensemble_itself_and_per_member_batches():
    # `model` may be the Ensemble; in_dims=0 gives member i slice i of every batch.
    g = torch.Generator().manual_seed(2)
    ens = vmapens.Ensemble(MLP, n=N, seed=3).double()
    twins = [AveragedModel(ens[i]) for i in range(N)]
    loader = [torch.randn(N, rows, 3, generator=g, dtype=torch.float64) for rows in (5, 7)]
    update_bn(loader, ens, in_dims=0)
    for i, twin in enumerate(twins):
        torch_update_bn([x[i] for x in loader], twin)
        torch.testing.assert_close(ens[i].state_dict(), twin.module.state_dict(), **TOL)


def test_members_of_different_sizes():
    g = torch.Generator().manual_seed(4)
    factories = [functools.partial(MLP, hidden=h) for h in (6, 4, 5)]
    ens = vmapens.Ensemble.from_factories(factories, seed=5).double()
    swa, twins = _trained(ens, "mlp", "swa", g)
    loader = _loader("mlp", "list", g)
    update_bn(loader, swa)
    for twin in twins:
        torch_update_bn(loader, twin)
    _assert_members(swa, twins, _x("mlp", 5, g))
    var = swa.module.get_buffer("bn.running_var")
    assert var[1, 4:].eq(0).all() and var[2, 5:].eq(0).all()  # padded channels stay zero


def test_an_empty_loader_leaves_the_statistics_reset():
    ens = vmapens.Ensemble(MLP, n=N, seed=6).double()
    twins = [AveragedModel(ens[i]) for i in range(N)]
    update_bn([], ens)
    for i, twin in enumerate(twins):
        torch_update_bn([], twin)
        torch.testing.assert_close(ens[i].state_dict(), twin.module.state_dict(), rtol=0, atol=0)


def test_without_batchnorm_the_loader_is_not_read():
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 2), n=N, seed=0)

    def loader() -> Iterator[torch.Tensor]:
        raise AssertionError("read")
        yield torch.zeros(1)

    update_bn(loader(), ens)


# -- what it leaves as it was ---------------------------------------------------------------------


def _settings(swa: AveragedModel) -> list[Any]:
    """Every mode and BatchNorm momentum and class, of the wrapper, the ensemble, the template
    and the module the ensemble runs."""
    ens = swa.module
    modules = [swa, ens, *ens.template.modules(), *ens.runner.modules()]
    return [(m.training, type(m), getattr(m, "momentum", "-")) for m in modules]


def test_momentum_and_modes_are_restored_and_training_goes_on_as_alone():
    g = torch.Generator().manual_seed(7)
    ens = vmapens.Ensemble(functools.partial(MLP, momentum=0.25), n=N, seed=8).double()
    swa = AveragedModel(ens)
    swa.module.template.bn.eval()  # a frozen BatchNorm (torch's update_bn would unfreeze it)
    swa.module(_x("mlp", 4, g))
    settings = _settings(swa)
    update_bn(_loader("mlp", "list", g), swa)
    assert swa.module.template.bn.training is False
    assert _settings(swa) == settings
    # Afterwards the ensemble's forward is the member's again: momentum 0.25, eval BatchNorm.
    twins = [swa.module[i] for i in range(N)]
    swa.module.template.bn.train()
    x = _x("mlp", 6, g)
    out = swa(x)
    for i, twin in enumerate(twins):
        torch.testing.assert_close(out[i], twin.train()(x), **TOL)
        torch.testing.assert_close(swa.module[i].state_dict(), twin.state_dict(), **TOL)


BAD = [
    ("model", lambda ens: ([torch.zeros(2, 3)], nn.Linear(3, 2)), TypeError, r"`model`.*Linear"),
    (
        "averaged-plain",
        lambda ens: ([torch.zeros(2, 3)], AveragedModel(nn.Linear(3, 2))),
        TypeError,
        r"update_bn: `model` must be a vmapens\.Ensemble.*AveragedModel of Linear",
    ),
    ("loader", lambda ens: (3, ens), TypeError, r"update_bn: `loader` must be an iterable"),
    (
        "in_dims",
        lambda ens: ([torch.zeros(N + 1, 2, 3)], ens, 0),
        ValueError,
        r"in_dims=0 but has size 4",
    ),
    (
        "bad-batch",
        lambda ens: ([torch.zeros(4, 3), torch.zeros(4, 7)], ens),
        RuntimeError,
        r"forward or loss failed",
    ),
]


def _failing(ens: vmapens.Ensemble) -> Iterator[torch.Tensor]:
    yield torch.randn(4, 3, dtype=torch.float64)
    raise KeyError("loader broke")


BAD.append(("loader-raises", lambda ens: (_failing(ens), ens), KeyError, r"loader broke"))


@pytest.mark.parametrize("args, error, match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_refused_or_failed_changes_nothing(args, error, match):
    ens = vmapens.Ensemble(MLP, n=N, seed=9).double()
    ens.train(False)
    ens(torch.randn(4, 3, dtype=torch.float64))
    with torch.no_grad():
        for t in ens.stacked_buffers().values():  # statistics that a reset would change
            t.add_(torch.arange(N).view(-1, *[1] * (t.dim() - 1)).to(t.dtype) + 1)
    swa = AveragedModel(ens)
    state, settings = _state(swa), _settings(swa)
    loader, model, *in_dims = args(swa.module)
    if model is swa.module:
        model = swa
    with pytest.raises(error, match=match):
        update_bn(loader, model, in_dims=in_dims[0] if in_dims else None)
    for k, v in swa.module.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert _settings(swa) == settings


class SubclassedBN(nn.BatchNorm1d):
    def forward(self, input: torch.Tensor) -> torch.Tensor:  # its own, reaching torch's factor
        return super().forward(input)


def test_a_batchnorm_subclass_with_its_own_forward_needs_the_loop_backend():
    # docs/semantics.md: vmap batches momentum=None for the BatchNorm classes and subclasses
    # that keep torch's forward (tests/test_hunt_norms.py), not for one with its own.
    def member() -> nn.Module:
        return nn.Sequential(nn.Linear(3, 4), SubclassedBN(4))

    g = torch.Generator().manual_seed(10)
    loader = [_x("mlp", 5, g), _x("mlp", 6, g)]
    ens = vmapens.Ensemble(member, n=2, seed=0).double()
    state = _state(AveragedModel(ens))
    with pytest.raises(RuntimeError, match="backend='loop'"):
        update_bn(loader, ens)
    for k, v in ens.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert ens.template[1].momentum == 0.1 and ens.runner[1].momentum == 0.1
    looped = vmapens.Ensemble(member, n=2, seed=0, backend="loop").double()
    twins = [AveragedModel(looped[i]) for i in range(2)]
    update_bn(loader, looped)
    for i, twin in enumerate(twins):
        torch_update_bn(loader, twin)
        torch.testing.assert_close(looped[i].state_dict(), twin.module.state_dict(), **TOL)
