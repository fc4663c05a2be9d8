"""Files vmapens writes behave as plain ``torch.save`` files do on disk: the mode a new
file gets, the mode an overwritten file keeps, and writing through a symlink."""

from __future__ import annotations

import functools
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import vmapens


def _ens() -> vmapens.Ensemble:
    return vmapens.Ensemble(lambda: nn.Linear(3, 1, dtype=torch.float64), n=2, seed=0)


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _save(path: Path) -> None:
    vmapens.save(_ens(), path)


def _save_member(path: Path) -> None:
    vmapens.save_members(_ens(), path.parent)


WRITERS: dict[str, tuple[Callable[[Path], None], str]] = {
    "save": (_save, "ens.pt"),
    "save_members": (_save_member, "member_0000.pt"),
}


@pytest.fixture
def umask_027() -> object:
    old = os.umask(0o027)
    yield
    os.umask(old)


@pytest.mark.parametrize("api", sorted(WRITERS))
def test_a_new_file_gets_the_mode_torch_save_gives_it(
    api: str, tmp_path: Path, umask_027: object
) -> None:
    write, name = WRITERS[api]
    (tmp_path / "plain").mkdir()
    (tmp_path / "ours").mkdir()
    torch.save({}, tmp_path / "plain" / name)
    write(tmp_path / "ours" / name)
    assert _mode(tmp_path / "ours" / name) == _mode(tmp_path / "plain" / name)
    if api == "save_members":
        assert _mode(tmp_path / "ours" / "members.json") == _mode(tmp_path / "plain" / name)


@pytest.mark.parametrize("api", sorted(WRITERS))
def test_an_overwritten_file_keeps_its_mode_as_with_torch_save(api: str, tmp_path: Path) -> None:
    write, name = WRITERS[api]
    for side in ("plain", "ours"):
        (tmp_path / side).mkdir()
        (tmp_path / side / name).write_bytes(b"old")
        os.chmod(tmp_path / side / name, 0o640)
    torch.save({}, tmp_path / "plain" / name)
    write(tmp_path / "ours" / name)
    assert _mode(tmp_path / "ours" / name) == _mode(tmp_path / "plain" / name)


def test_a_checkpoint_path_that_is_a_symlink_is_written_through(tmp_path: Path) -> None:
    """torch.save(obj, link) writes the file the link points to; so must vmapens."""
    (tmp_path / "store").mkdir()
    target = tmp_path / "store" / "run.pt"
    link = tmp_path / "latest.pt"
    ens = _ens()
    vmapens.save(ens, target)
    os.symlink(target, link)
    with torch.no_grad():
        for p in ens.parameters():
            p.add_(1.0)
    vmapens.save(ens, link)
    assert link.is_symlink()
    held = torch.load(target, weights_only=True)["ensemble"]
    assert all(torch.equal(held[k], v) for k, v in ens.state_dict().items())
    back = vmapens.load(link, lambda: nn.Linear(3, 1, dtype=torch.float64))
    assert all(torch.equal(a, b) for a, b in zip(back.parameters(), ens.parameters(), strict=True))


class _Wrapped(nn.Module):
    """A loss that holds its settings in an inner loss, whose repr leaves them out."""

    def __init__(self, smoothing: float) -> None:
        super().__init__()
        self.inner = nn.CrossEntropyLoss(label_smoothing=smoothing)

    def forward(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.inner(out, y)


class _Stop(Exception):
    pass


LOSSES: dict[str, Callable[[float], Callable[..., torch.Tensor]]] = {
    "partial": lambda s: functools.partial(F.cross_entropy, label_smoothing=s),
    "nested_module": _Wrapped,
}


@pytest.mark.parametrize("kind", sorted(LOSSES))
def test_resume_compares_the_settings_of_a_partial_or_nested_loss(
    kind: str, tmp_path: Path
) -> None:
    """`loss_fn` must match the checkpoint's by its settings (docs/fit.md): a resume with
    another label smoothing would end elsewhere than the uninterrupted run."""
    make = LOSSES[kind]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 3, generator=g, dtype=torch.float64)
    y = torch.randint(0, 2, (16,), generator=g)
    opts = dict(epochs=2, batch_size=8, seed=0, progress=False, checkpoint=tmp_path / "c.pt")

    def member() -> nn.Module:
        return nn.Linear(3, 2, dtype=torch.float64)

    def stop(history: vmapens.History) -> None:
        if history.epochs == 1:
            raise _Stop

    with pytest.raises(_Stop):
        vmapens.fit(
            vmapens.Ensemble(member, n=2, seed=0), (x, y), make(0.1), callbacks=[stop], **opts
        )
    ens = vmapens.Ensemble(member, n=2, seed=0)
    before = [p.clone() for p in ens.parameters()]
    with pytest.raises(ValueError, match="loss_fn"):
        vmapens.fit(ens, (x, y), make(0.4), **opts)
    assert all(torch.equal(a, b) for a, b in zip(before, ens.parameters(), strict=True))
    # The same settings (a new object) still resume.
    assert vmapens.fit(ens, (x, y), make(0.1), **opts).epochs == 2


def _loader(x: torch.Tensor, y: torch.Tensor, shuffle: bool = True) -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=shuffle, generator=gen)


@pytest.mark.parametrize("change", ["tensors", "shuffle"])
def test_resume_compares_what_a_dataloader_yields(change: str, tmp_path: Path) -> None:
    """`data` must match the checkpoint's (docs/fit.md): a DataLoader over other tensors, or
    no longer shuffling, is another run, not the one the checkpoint holds."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 3, generator=g, dtype=torch.float64)
    y = torch.randn(16, 1, generator=g, dtype=torch.float64)
    opts = dict(epochs=2, progress=False, checkpoint=tmp_path / "c.pt")

    def member() -> nn.Module:
        return nn.Linear(3, 1, dtype=torch.float64)

    def stop(history: vmapens.History) -> None:
        if history.epochs == 1:
            raise _Stop

    with pytest.raises(_Stop):
        vmapens.fit(
            vmapens.Ensemble(member, n=2, seed=0),
            _loader(x, y),
            nn.MSELoss(),
            callbacks=[stop],
            **opts,
        )
    other = _loader(x + 1, y) if change == "tensors" else _loader(x, y, shuffle=False)
    ens = vmapens.Ensemble(member, n=2, seed=0)
    with pytest.raises(ValueError, match="data="):
        vmapens.fit(ens, other, nn.MSELoss(), **opts)
    assert vmapens.fit(ens, _loader(x, y), nn.MSELoss(), **opts).epochs == 2


def test_a_set_of_member_files_given_to_the_other_readers_names_load_members(
    tmp_path: Path,
) -> None:
    vmapens.save_members(_ens(), tmp_path / "members")

    def member() -> nn.Module:
        return nn.Linear(3, 1, dtype=torch.float64)

    with pytest.raises(ValueError, match=r"load: .*vmapens\.load_members"):
        vmapens.load(tmp_path / "members", member)
    with pytest.raises(ValueError, match=r"restore: .*vmapens\.load_members"):
        vmapens.restore(tmp_path / "members" / "members.json", _ens())
    with pytest.raises(ValueError, match=r"load_member: .*members\.json.*vmapens\.load_members"):
        vmapens.load_member(tmp_path / "members" / "members.json")
