"""Member files and the hand-off to plain PyTorch, against plain modules and plain torch.optim.

Each member file must load with ``MyModule().load_state_dict(torch.load(path,
weights_only=True), strict=True)`` into exactly the module trained alone (parameters and
buffers, non-persistent buffers left out as torch leaves them out, submodule versions passed to
the loader), and a plain optimizer loaded from ``member_state_dict(i)`` must continue as the
member does in the ensemble. Files are checked when read and written atomically.
"""

from __future__ import annotations

import copy
import functools
import io
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

import vmapens

pytestmark = pytest.mark.usefixtures("float64_default")


class _CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # No bias before BatchNorm: its gradient is rounding noise, which Adam scales to +-lr.
        self.conv = nn.Conv2d(2, 3, 3, bias=False)
        self.bn = nn.BatchNorm2d(3)
        self.fc = nn.Linear(3, 2)
        self.register_buffer("scratch", torch.randn(3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(self.bn(self.conv(x))).mean((2, 3)))


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(3, 4, batch_first=True)
        self.lstm = nn.LSTM(4, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(self.gru(x)[0])[0][:, -1]


class _Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x).mean(1)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 4)
        self.out = nn.Linear(4, 5, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.emb(x))).mean(1)


class _Orthogonal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = parametrizations.orthogonal(nn.Linear(3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class _Versioned(nn.Module):
    """A module whose loader reads its ``_version`` from the state dict's ``_metadata``."""

    _version = 3

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.bn = nn.BatchNorm1d(2)
        self.versions: list[Any] = []

    def _load_from_state_dict(
        self, state_dict: Any, prefix: str, metadata: Any, *rest: Any
    ) -> None:
        self.versions.append(metadata.get("version"))
        super()._load_from_state_dict(state_dict, prefix, metadata, *rest)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x))


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "cnn_batchnorm": (_CNN, lambda: torch.randn(4, 2, 5, 5)),
    "gru_lstm": (_Recurrent, lambda: torch.randn(3, 4, 3)),
    "transformer": (_Transformer, lambda: torch.randn(2, 3, 4)),
    "tied": (_Tied, lambda: torch.randint(0, 5, (4, 3))),
    "orthogonal": (_Orthogonal, lambda: torch.randn(4, 3)),
    "versioned": (_Versioned, lambda: torch.randn(5, 3)),
}


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def _train_both(
    make: Callable[[], nn.Module], data: Callable[[], torch.Tensor], steps: int
) -> tuple[list[nn.Module], vmapens.Ensemble]:
    """Three plain modules trained with torch.optim.SGD and an ensemble of copies of them
    trained with StackedSGD on the same batches."""
    models = [make() for _ in range(3)]
    ens = vmapens.Ensemble.from_modules([copy.deepcopy(m) for m in models])
    opt = vmapens.optim.StackedSGD(ens.parameters(), lr=0.1, momentum=0.9)
    plain = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    for _ in range(steps):
        x = data()
        opt.zero_grad()
        out = ens(x)
        out.pow(2).mean(tuple(range(1, out.dim()))).sum().backward()
        opt.step()
        for m, o in zip(models, plain, strict=True):
            o.zero_grad()
            _loss(m(x)).backward()
            o.step()
    return models, ens


@pytest.mark.parametrize("name", list(MODELS))
def test_member_files_load_strictly_into_the_module_trained_alone(
    name: str, tmp_path: Path
) -> None:
    make, data = MODELS[name]
    models, ens = _train_both(make, data, steps=2)
    paths = vmapens.save_members(ens, tmp_path / "members")
    for model, path in zip(models, paths, strict=True):
        state = torch.load(path, weights_only=True)
        truth = model.state_dict()
        assert list(state) == list(truth)  # non-persistent buffers left out, as torch does
        loaded = make()
        loaded.load_state_dict(state, strict=True)
        for key, value in truth.items():
            assert state[key].dtype == value.dtype, key
            torch.testing.assert_close(state[key], value, rtol=0, atol=1e-10, msg=key)
        for key, value in loaded.state_dict().items():
            torch.testing.assert_close(value, truth[key], rtol=0, atol=1e-10, msg=key)
        if isinstance(loaded, _Versioned):
            assert loaded.versions == [_Versioned._version]
        x = data()
        loaded.eval(), model.eval()
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=1e-10)


OPTIMIZERS: dict[str, tuple[type, type, dict[str, Any]]] = {
    "sgd_nesterov": (
        vmapens.optim.StackedSGD,
        torch.optim.SGD,
        {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
    ),
    "adam_amsgrad": (vmapens.optim.StackedAdam, torch.optim.Adam, {"amsgrad": True}),
    "rmsprop_centered": (
        vmapens.optim.StackedRMSprop,
        torch.optim.RMSprop,
        {"centered": True, "momentum": 0.5},
    ),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_plain_optimizer_from_member_state_dict_continues_like_the_ensemble(
    name: str, tmp_path: Path
) -> None:
    stacked, plain, kwargs = OPTIMIZERS[name]
    ens = vmapens.Ensemble(_CNN, n=3, seed=0)
    opt = stacked(ens.parameters(), lr=[0.01, 0.02, 0.05], **kwargs)
    batches = [(torch.randn(4, 2, 5, 5), torch.randn(4, 2)) for _ in range(4)]

    def ensemble_step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        (ens(x) - y).pow(2).mean((1, 2)).sum().backward()
        opt.step()

    for x, y in batches[:2]:
        ensemble_step(x, y)
    paths = vmapens.save_members(ens, tmp_path / "members")
    alone = []
    for i, path in enumerate(paths):
        member = _CNN()
        member.load_state_dict(torch.load(path, weights_only=True), strict=True)
        buffer = io.BytesIO()  # through a file, as a hand-off to another program goes
        torch.save(opt.member_state_dict(i, module=member), buffer)
        buffer.seek(0)
        member_opt = plain(member.parameters(), lr=1.0, **kwargs)
        member_opt.load_state_dict(torch.load(buffer, weights_only=True))
        alone.append((member, member_opt))
    for x, y in batches[2:]:
        ensemble_step(x, y)
        for member, member_opt in alone:
            member_opt.zero_grad()
            (member(x) - y).pow(2).mean().backward()
            member_opt.step()
    for i, (member, _) in enumerate(alone):
        truth = member.state_dict()
        for key, value in ens[i].state_dict().items():
            torch.testing.assert_close(value, truth[key], rtol=0, atol=1e-12, msg=key)


_ODD = "we ird/ü %$#'\"[x]"


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_truncated_or_edited_member_file_is_refused_naming_it(fmt: str, tmp_path: Path) -> None:
    if fmt == "safetensors":
        pytest.importorskip("safetensors")
    directory = tmp_path / _ODD
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 2), n=2, seed=0)
    paths = vmapens.save_members(ens, directory, format=fmt)
    states = vmapens.load_members(directory)
    for i, state in enumerate(states):
        for key, value in ens[i].state_dict().items():
            assert torch.equal(state[key], value)
    whole = paths[1].read_bytes()
    for data in (whole[:-9], whole[: len(whole) // 2], _flip(whole, len(whole) // 2)):
        paths[1].write_bytes(data)
        for read in (
            lambda: vmapens.load_member(paths[1]),
            lambda: vmapens.load_members(directory),
        ):
            with pytest.raises(ValueError, match=re.escape(str(paths[1]))):
                read()


def _flip(data: bytes, at: int) -> bytes:
    edited = bytearray(data)
    edited[at] ^= 1
    return bytes(edited)


def test_failed_save_leaves_the_previous_files_whole_and_no_partial_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 2), n=3, seed=0)
    directory = tmp_path / "members"
    vmapens.save_members(ens, directory)
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    with torch.no_grad():
        for p in ens.parameters():
            p.add_(1.0)
    save, calls = torch.save, []

    def disk_full_at_the_second(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        calls.append(1)
        if len(calls) == 2:
            f.write(b"half a file")
            raise OSError(28, "No space left on device")
        save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_full_at_the_second)
    with pytest.raises(OSError, match="member_0001.pt"):
        vmapens.save_members(ens, directory)
    monkeypatch.undo()
    after = {p.name: p.read_bytes() for p in directory.iterdir()}
    assert sorted(after) == sorted(before)  # no temporary file left
    assert after["member_0001.pt"] == before["member_0001.pt"]
    assert after["member_0002.pt"] == before["member_0002.pt"]
    # member_0000.pt is this save's, which the previous members.json does not list.
    with pytest.raises(ValueError, match="member_0000.pt"):
        vmapens.load_members(directory)


@pytest.mark.parametrize(
    ("pick", "ids"),
    [
        (torch.tensor([3, 1]), [3, 1]),
        (np.array([2, 0]), [2, 0]),
        (torch.tensor([True, False, False, True]), [0, 3]),
    ],
    ids=["tensor", "numpy", "mask"],
)
def test_members_picked_by_tensors_are_saved_under_their_global_ids(
    pick: Any, ids: list[int], tmp_path: Path
) -> None:
    models = [nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)) for _ in range(4)]
    ens = vmapens.Ensemble.from_modules([copy.deepcopy(m) for m in models])
    x = torch.randn(5, 3)
    ens(x)
    for m in models:
        m(x)
    paths = vmapens.save_members(ens[pick], tmp_path / "sub")
    assert [p.name for p in paths] == [f"member_{i:04d}.pt" for i in ids]
    for gid, path, state in zip(ids, paths, vmapens.load_members(tmp_path / "sub"), strict=True):
        from_disk = torch.load(path, weights_only=True)
        for key, value in models[gid].state_dict().items():
            torch.testing.assert_close(from_disk[key], value, rtol=0, atol=1e-12)
            assert torch.equal(state[key], from_disk[key])


def test_member_files_round_trip_into_a_new_ensemble(tmp_path: Path) -> None:
    ens = vmapens.Ensemble(_CNN, n=3, seed=0)
    x = torch.randn(4, 2, 5, 5)
    ens(x)
    paths = vmapens.save_members(ens, tmp_path / "members")
    modules = []
    for path in paths:
        module = _CNN()
        module.load_state_dict(torch.load(path, weights_only=True), strict=True)
        modules.append(module)
    again = vmapens.Ensemble.from_modules(modules)
    original = ens.state_dict()
    assert list(again.state_dict()) == list(original)
    for key, value in again.state_dict().items():
        assert value.dtype == original[key].dtype and torch.equal(value, original[key]), key
    ens.eval(), again.eval()
    assert torch.equal(again(x), ens(x))


def test_safetensors_files_of_members_of_different_widths_load_into_each(tmp_path: Path) -> None:
    safetensors = pytest.importorskip("safetensors.torch")
    widths = (2, 5, 3)

    def make(w: int) -> nn.Module:
        return nn.Sequential(nn.Linear(3, w), nn.Tanh(), nn.BatchNorm1d(w), nn.Linear(w, 1))

    models = [make(w) for w in widths]
    ens = vmapens.Ensemble.from_factories([functools.partial(copy.deepcopy, m) for m in models])
    x = torch.randn(6, 3)
    ens(x)
    for m in models:
        m(x)
    paths = vmapens.save_members(ens, tmp_path / "st", format="safetensors")
    for w, model, path in zip(widths, models, paths, strict=True):
        state = safetensors.load_file(os.fspath(path))
        loaded = make(w)
        loaded.load_state_dict(state, strict=True)
        for key, value in model.state_dict().items():
            assert loaded.state_dict()[key].dtype == value.dtype
            torch.testing.assert_close(loaded.state_dict()[key], value, rtol=0, atol=1e-12)
