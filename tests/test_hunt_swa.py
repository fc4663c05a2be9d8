"""Weight averaging of an ensemble against torch's ``swa_utils`` on N plain modules.

The truth is torch itself: every member copied out as a plain module, trained with
``torch.optim.SGD``, averaged by its own ``AveragedModel`` and given torch's ``update_bn``.
float64, so only the order of sums differs.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn, get_ema_multi_avg_fn
from torch.optim.swa_utils import update_bn as torch_update_bn
from torch.utils.data import DataLoader, TensorDataset

import vmapens
from vmapens.swa import update_bn

TOL = dict(rtol=1e-12, atol=1e-12)  # float64: the same maths, sums in another order
N = 3


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(3, 5)
        self.bn = nn.BatchNorm1d(5, momentum=0.2)
        self.fc2 = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def _x(g: torch.Generator, rows: int = 6) -> torch.Tensor:
    return torch.randn(rows, 3, generator=g, dtype=torch.float64)


def _assert_members(ens: vmapens.Ensemble, alone: list[nn.Module]) -> None:
    for i, member in enumerate(alone):
        torch.testing.assert_close(ens[i].state_dict(), member.state_dict(), **TOL)


AVERAGING = {
    "swa": {},
    "ema-multi": {"multi_avg_fn": get_ema_multi_avg_fn(0.6)},
    "ema-avg-fn": {"avg_fn": get_ema_avg_fn(0.6)},
}


AVERAGED = [("swa", False), ("swa", True), ("ema-multi", True), ("ema-avg-fn", False)]


@pytest.mark.parametrize(
    "avg, use_buffers", AVERAGED, ids=[f"{a}-{'buffers' if b else 'params'}" for a, b in AVERAGED]
)
def test_averaging_started_mid_training_round_trips_and_unstacks(avg, use_buffers):
    # Averaging starts after two steps, as SWA does; the averaged ensemble then gets
    # update_bn over a DataLoader, a state_dict round trip and unstack, each member as alone.
    g = torch.Generator().manual_seed(0)
    ens = vmapens.Ensemble(MLP, n=N, seed=1).double()
    alone = [copy.deepcopy(ens[i]) for i in range(N)]
    opt = vmapens.StackedSGD(ens, lr=0.1, momentum=0.9)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in alone]
    options: dict[str, Any] = dict(AVERAGING[avg], use_buffers=use_buffers)
    swa: AveragedModel | None = None
    twins: list[AveragedModel] = []
    for step in range(5):
        x, y = _x(g), torch.randn(6, 2, generator=g, dtype=torch.float64)
        loss = ((ens(x) - y) ** 2).mean((1, 2)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        for m, o in zip(alone, opts):
            o.zero_grad()
            ((m(x) - y) ** 2).mean().backward()
            o.step()
        if step == 2:
            swa, twins = AveragedModel(ens, **options), [AveragedModel(m, **options) for m in alone]
        if swa is not None:
            swa.update_parameters(ens)
            for twin, m in zip(twins, alone):
                twin.update_parameters(m)
    assert swa is not None
    _assert_members(swa.module, [t.module for t in twins])
    data = TensorDataset(torch.randn(15, 3, generator=g, dtype=torch.float64), torch.zeros(15))
    loader = DataLoader(data, batch_size=4)
    update_bn(loader, swa, device="cpu")
    for twin in twins:
        torch_update_bn(loader, twin, device="cpu")
    _assert_members(swa.module, [t.module for t in twins])
    assert swa.n_averaged.item() == twins[0].n_averaged.item() == 3

    loaded = AveragedModel(vmapens.Ensemble(MLP, n=N, seed=9).double(), **options)
    loaded.load_state_dict(swa.state_dict())
    _assert_members(loaded.module, [t.module for t in twins])
    assert loaded.n_averaged.item() == 3
    models = loaded.module.unstack()
    for model, twin in zip(models, twins):
        torch.testing.assert_close(model.state_dict(), twin.module.state_dict(), **TOL)


def test_a_sub_ensemble_per_member_batches_from_a_dataloader():
    # A sub-ensemble picked with a tensor of rows, averaged, then update_bn with member i's
    # own column of every DataLoader batch (in_dims=1); the parent ensemble is left alone.
    g = torch.Generator().manual_seed(2)
    big = vmapens.Ensemble(MLP, n=5, seed=3).double()
    parent = {k: v.clone() for k, v in big.state_dict().items()}
    rows = torch.tensor([4, 1])
    swa = AveragedModel(big[rows])
    twins = [AveragedModel(big[int(r)]) for r in rows]
    data = TensorDataset(torch.randn(10, 2, 3, generator=g, dtype=torch.float64), torch.zeros(10))
    loader = DataLoader(data, batch_size=4)
    update_bn(loader, swa, in_dims=1)
    for i, twin in enumerate(twins):
        torch_update_bn([x[:, i] for x, _ in loader], twin)
    _assert_members(swa.module, [t.module for t in twins])
    for k, v in big.state_dict().items():
        assert torch.equal(v, parent[k]), k


def _spectral_member() -> nn.Module:
    linear = nn.utils.parametrizations.spectral_norm(nn.Linear(3, 4))
    return nn.Sequential(linear, nn.BatchNorm1d(4, track_running_stats=False), nn.Linear(4, 2))


def test_batchnorm_without_statistics_still_runs_the_pass_as_torch():
    # torch's update_bn returns early only where there is no BatchNorm at all; with a
    # BatchNorm that keeps no statistics it still runs the loader in train mode, which moves
    # spectral_norm's power-iteration vectors. vmapens returned at once: `_u`/`_v` stayed.
    g = torch.Generator().manual_seed(4)
    ens = vmapens.Ensemble(_spectral_member, n=N, seed=5).double()
    twins = [AveragedModel(ens[i]) for i in range(N)]
    u = "0.parametrizations.weight.0._u"
    before = ens.get_buffer(u).clone()
    loader = [_x(g, 5), _x(g, 4)]
    update_bn(loader, ens)
    for twin in twins:
        torch_update_bn(loader, twin)
    assert not torch.equal(twins[0].module.state_dict()[u], before[0])  # torch moved it
    _assert_members(ens, [t.module for t in twins])


BAD_DEVICES = [
    ("float", 3.5, TypeError, r"update_bn: `device` must be None, an int, a str"),
    ("bool", True, TypeError, r"update_bn: `device` must be None.*got bool"),
    ("object", object(), TypeError, r"update_bn: `device` must be None.*got object"),
    ("bad-string", "gpu0", ValueError, r"update_bn: `device` 'gpu0' is not a device"),
]


@pytest.mark.parametrize(
    "device, error, match", [b[1:] for b in BAD_DEVICES], ids=[b[0] for b in BAD_DEVICES]
)
def test_a_bad_device_is_refused_naming_it_before_anything_changes(device, error, match):
    # `batch.to(3.5)` turns the batch into float64 and `batch.to(True)` into bool: a float32
    # ensemble then failed in its forward (or, in float64, ran on the converted batch).
    g = torch.Generator().manual_seed(6)
    ens = vmapens.Ensemble(MLP, n=N, seed=7).double()
    ens(_x(g))
    state = {k: v.clone() for k, v in ens.state_dict().items()}
    with pytest.raises(error, match=match):
        update_bn([_x(g)], ens, device=device)
    for k, v in ens.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert ens.template.bn.momentum == 0.2


class Batches(torch.utils.data.Dataset):
    """A map-style dataset of whole batches: ``__getitem__`` only, no ``__iter__``; a ``for``
    loop walks it until IndexError, as torch's update_bn does."""

    def __init__(self, batches: list[torch.Tensor]) -> None:
        self.batches = batches

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batches[i], torch.zeros(len(self.batches[i]))


def test_a_map_style_dataset_of_batches_is_walked_as_torch_walks_it():
    # It was refused ("`loader` must be an iterable") where torch's update_bn runs.
    g = torch.Generator().manual_seed(8)
    ens = vmapens.Ensemble(MLP, n=N, seed=9).double()
    twins = [AveragedModel(ens[i]) for i in range(N)]
    loader = Batches([_x(g, 5), _x(g, 7)])
    update_bn(loader, ens)
    for twin in twins:
        torch_update_bn(loader, twin)
    assert ens.get_buffer("bn.num_batches_tracked").tolist() == [2] * N
    _assert_members(ens, [t.module for t in twins])
