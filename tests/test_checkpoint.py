"""Checkpoints: resume equals an uninterrupted run bit for bit; bad files change nothing."""

from __future__ import annotations

import copy
import functools
import os
import pickle
import sys
from dataclasses import dataclass

import models
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import vmapens
from vmapens import History, _files, checkpoint

N = 4
F64 = dict(dtype=torch.float64)
G = torch.Generator().manual_seed(1)
X, Y = torch.randn(24, 4, generator=G, **F64), torch.randn(24, 3, generator=G, **F64)
XV, YV = torch.randn(10, 4, generator=G, **F64), torch.randn(10, 3, generator=G, **F64)
EXACT = dict(rtol=0, atol=0)


class DropoutMLP(models.MLP):
    """Dropout draws from torch's global RNG: resume must restore it."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


class BatchNormMLP(models.MLP):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.bn(x))


class Interrupt(Exception):
    pass


def interrupt_after(epoch: int):
    def callback(history: History) -> None:
        if history.epochs == epoch:
            raise Interrupt

    return callback


@dataclass
class Case:
    id: str
    factory: type
    options: dict
    data: object = None


CASES = [
    Case("shuffle-batches", models.MLP, dict(batch_size=5, seed=3)),
    Case("bootstrap-shuffle-patience", models.MLP,
         dict(batch_size=8, bootstrap=True, seed=3, val_data=(XV, YV), patience=2,
              lr=[1e-3, 1e-2, 3e-2, 1e-1])),
    Case("steps-across-passes", models.MLP, dict(steps=7, batch_size=5, seed=3)),
    Case("dropout-and-drawn-seed", DropoutMLP, dict(batch_size=8)),
    Case("batchnorm-dataloader", BatchNormMLP, dict(val_data=(XV, YV)),
         data=DataLoader(TensorDataset(X, Y), batch_size=8, shuffle=True)),
]  # fmt: skip


def run(case: Case, path, epochs: int, callbacks=()):
    torch.manual_seed(0)  # same global RNG for each run (dropout, drawn seeds, DataLoader)
    ens = vmapens.Ensemble(case.factory, n=N, seed=0).double()
    data = (X, Y) if case.data is None else case.data
    options = {"lr": 1e-2, **case.options}
    opt = vmapens.StackedAdam(ens, lr=options.pop("lr"))
    history = vmapens.fit(ens, data, nn.MSELoss(), epochs=epochs, optimizer=opt, progress=False,
                      checkpoint=path, callbacks=callbacks, **options)  # fmt: skip
    return ens, opt, history


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_resume_equals_the_uninterrupted_run_exactly(case: Case, tmp_path):
    ens, opt, history = run(case, tmp_path / "straight.pt", epochs=5)
    path = tmp_path / "resumed.pt"
    with pytest.raises(Interrupt):
        run(case, path, epochs=5, callbacks=[interrupt_after(2)])
    torch.manual_seed(123)  # the resumed run must not depend on the global RNG at its start
    again, again_opt, again_history = run(case, path, epochs=5)

    torch.testing.assert_close(again.state_dict(), ens.state_dict(), **EXACT)
    torch.testing.assert_close(again_opt.state_dict(), opt.state_dict(), **EXACT)
    torch.testing.assert_close(
        again_history.state_dict(), history.state_dict(), equal_nan=True, **EXACT
    )


def test_more_epochs_continue_a_finished_run(tmp_path):
    case = CASES[0]
    ens, _, _ = run(case, tmp_path / "straight.pt", epochs=4)
    run(case, tmp_path / "steps.pt", epochs=2)
    again, _, history = run(case, tmp_path / "steps.pt", epochs=4)
    assert history.epochs == 4
    torch.testing.assert_close(again.state_dict(), ens.state_dict(), **EXACT)


def test_resume_with_other_options_is_refused(tmp_path):
    path = tmp_path / "run.pt"
    run(CASES[0], path, epochs=1)
    other = Case("other", models.MLP, dict(batch_size=6, seed=3))
    with pytest.raises(ValueError, match=r"other options: batch_size=6 \(checkpoint: 5\)"):
        run(other, path, epochs=2)


def test_save_load_round_trip(tmp_path):
    ens = vmapens.Ensemble(models.Tied, n=3, seed=0)
    opt = vmapens.StackedAdam(ens, lr=[1e-3, 1e-2, 1e-1])
    vmapens.fit(ens, (torch.randint(0, 10, (6, 5)), torch.randn(6, 3)), nn.MSELoss(), optimizer=opt,
            epochs=2, progress=False, seed=0)  # fmt: skip
    vmapens.save(ens, tmp_path / "ens.pt", optimizer=opt)
    loaded = vmapens.load(tmp_path / "ens.pt", models.Tied)
    loaded_opt = vmapens.StackedAdam(loaded, lr=0.5)
    vmapens.restore(tmp_path / "ens.pt", loaded, loaded_opt)
    torch.testing.assert_close(loaded.state_dict(), ens.state_dict(), **EXACT)
    torch.testing.assert_close(loaded_opt.state_dict(), opt.state_dict(), **EXACT)
    assert loaded.member_ids == range(3) and loaded.n_total == 3
    with pytest.raises(TypeError, match=r"^load: `optimizer` is not taken since 0.3.0.*restore"):
        vmapens.load(tmp_path / "ens.pt", models.Tied, optimizer=vmapens.StackedAdam)


def test_write_is_atomic(tmp_path, monkeypatch):
    ens = vmapens.Ensemble(models.MLP, n=2, seed=0)
    path = tmp_path / "ens.pt"
    checkpoint.save(ens, path)
    good = path.read_bytes()

    def crash(obj, f):
        f.write(b"half a checkpoint")
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(ens, path)
    assert path.read_bytes() == good and os.listdir(tmp_path) == ["ens.pt"]


class Evil:
    def __reduce__(self):
        return (print, ("this ran while loading",))


def truncated(path, ens):
    checkpoint.save(ens, path)
    path.write_bytes(path.read_bytes()[:300])


def wrong_count(path, ens):
    checkpoint.save(vmapens.Ensemble(models.MLP, n=8, seed=0), path)


def wrong_class(path, ens):
    checkpoint.save(vmapens.Ensemble(models.CNN, n=5, seed=0), path)


def sealed(path, obj):
    """``obj`` written as vmapens writes files, digest included: the reader gets past it."""
    _files.atomic_write(path, _files.seal_torch(obj), "test")


def malicious(path, ens):
    with open(path, "wb") as f:
        pickle.dump({"format": "vmapens-checkpoint", "evil": Evil()}, f, protocol=2)


def malicious_zip(path, ens):
    torch.save({"format": "vmapens-checkpoint", "evil": Evil()}, path)


def malicious_sealed(path, ens):
    sealed(path, {"format": "vmapens-checkpoint", "evil": Evil()})


def not_a_checkpoint(path, ens):
    sealed(path, {"weight": torch.zeros(3)})


def unsealed(path, ens):  # what vmapens 0.2 wrote: no digest
    torch.save({"format": "vmapens-checkpoint", "version": 2}, path)


def wrong_dtype(path, ens):
    checkpoint.save(vmapens.Ensemble(models.MLP, n=5, seed=0).double(), path)


BAD = [
    (truncated, r"ck\.pt carries no vmapens digest \(300 bytes\): a truncated or corrupt"),
    (wrong_count, r"ck\.pt holds 8 members of models\.MLP .* this ensemble has 5 members of models\.MLP"),
    (wrong_class, r"ck\.pt holds 5 members of models\.CNN .* this ensemble has 5 members of models\.MLP"),
    (malicious, r"ck\.pt carries no vmapens digest"),
    (malicious_zip, r"ck\.pt carries no vmapens digest"),
    (malicious_sealed, r"refusing to load .*ck\.pt: it holds objects other than tensors"),
    (unsealed, r"ck\.pt carries no vmapens digest .* not written by vmapens >= 0\.3"),
    (not_a_checkpoint, r"ck\.pt is not a vmapens checkpoint"),
    (wrong_dtype, r"ck\.pt: `fc1\.weight` is .*float64.*this ensemble has .*float32"),
]  # fmt: skip


@pytest.mark.parametrize("make,match", BAD, ids=[b[0].__name__ for b in BAD])
def test_bad_checkpoint_raises_clearly_and_changes_nothing(make, match, tmp_path, capsys):
    ens = vmapens.Ensemble(models.MLP, n=5, seed=0)
    opt = vmapens.StackedAdam(ens, lr=1e-2)
    ens(torch.randn(2, 4)).sum().backward()
    opt.step()
    before = copy.deepcopy((ens.state_dict(), opt.state_dict()))
    path = tmp_path / "ck.pt"
    make(path, ens)
    for attempt in (
        lambda: checkpoint.restore(path, ens, opt),
        lambda: vmapens.fit(
            ens, (X, Y), nn.MSELoss(), optimizer=opt, checkpoint=path, progress=False
        ),
    ):
        with pytest.raises(ValueError, match=match):
            attempt()
        torch.testing.assert_close((ens.state_dict(), opt.state_dict()), before, **EXACT)
    if make is wrong_count:  # load builds as many members as the file holds
        assert len(vmapens.load(path, models.MLP)) == 8
    else:
        with pytest.raises(ValueError, match=match.replace("5 members", r"\d members")):
            vmapens.load(path, models.MLP)
    assert "this ran" not in capsys.readouterr().out


def test_plain_save_is_not_a_fit_checkpoint(tmp_path):
    ens = vmapens.Ensemble(models.MLP, n=2, seed=0)
    opt = vmapens.StackedAdam(ens)
    checkpoint.save(ens, tmp_path / "ck.pt", optimizer=opt, history=History.empty([0, 1], False))
    with pytest.raises(ValueError, match=r"was written by save\(\), not by fit"):
        vmapens.fit(
            ens, (X, Y), nn.MSELoss(), optimizer=opt, checkpoint=tmp_path / "ck.pt", progress=False
        )


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
@pytest.mark.parametrize("factory", [models.MLP, models.Tied, models.Awkward, models.CNN])
def test_save_members_loads_into_the_users_class(factory, fmt, tmp_path):
    ens = vmapens.Ensemble(factory, n=2, seed=0)
    ens.member_ids, ens.n_total = range(3, 5), 5  # a shard: files are named by global index
    paths = vmapens.save_members(ens, tmp_path / "members", format=fmt)
    assert [p.name for p in paths] == [f"member_0003.{fmt}", f"member_0004.{fmt}"]
    for path, member in zip(paths, ens.unstack(), strict=True):
        if fmt == "pt":
            state = torch.load(path)
        else:
            from safetensors.torch import load_file

            state = load_file(path)
        model = factory()
        model.load_state_dict(state)
        torch.testing.assert_close(model.state_dict(), member.state_dict(), **EXACT)


def test_save_members_without_safetensors_says_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    ens = vmapens.Ensemble(models.MLP, n=2, seed=0)
    with pytest.raises(ImportError, match=r"pip install 'vmapens\[safetensors\]'"):
        vmapens.save_members(ens, tmp_path, format="safetensors")
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match=r"`format` must be 'pt' or 'safetensors', got 'npz'"):
        vmapens.save_members(ens, tmp_path, format="npz")


# -- a part that does not fit ----------------------------------------------------------------


def _trained_elsewhere() -> tuple[vmapens.Ensemble, vmapens.StackedAdam]:
    """An ensemble and optimizer with state of their own, unlike the checkpoint's."""
    ens = vmapens.Ensemble(models.MLP, n=3, seed=1).double()
    opt = vmapens.StackedAdam(ens, lr=1e-2)
    ens(XV).sum().backward()
    opt.step()
    return ens, opt


def _part_optimizer(path, ens, opt):  # same class, over two of the four parameters
    vmapens.restore(path, ens, vmapens.StackedAdam(list(ens.parameters())[:2], lr=1e-2))


def _part_history(path, ens, opt):  # a History of 5 members for 3
    vmapens.restore(path, ens, opt, History.empty(range(5), False))


def _part_fit(path, ens, opt):  # the loop state of a run without validation
    resume = vmapens.callbacks.Checkpoint(path, override=("val_data",))
    vmapens.fit(ens, (X, Y), nn.MSELoss(), epochs=2, seed=0, progress=False, val_data=(XV, YV),
                callbacks=[resume])  # fmt: skip


PARTS = [(_part_optimizer, "optimizer"), (_part_history, "history"), (_part_fit, "fit")]


@pytest.mark.parametrize(("attempt", "part"), PARTS, ids=[p for _, p in PARTS])
def test_the_part_that_does_not_fit_is_named_and_the_parts_before_it_roll_back(
    attempt, part, tmp_path
):
    path = tmp_path / "ck.pt"
    vmapens.fit(vmapens.Ensemble(models.MLP, n=3, seed=0).double(), (X, Y), nn.MSELoss(),
                epochs=1, seed=0, progress=False, checkpoint=path)  # fmt: skip
    ens, opt = _trained_elsewhere()
    before = copy.deepcopy((ens.state_dict(), opt.state_dict()))
    with pytest.raises(ValueError, match=rf"ck\.pt: the {part} state does not fit: "):
        attempt(path, ens, opt)
    torch.testing.assert_close((ens.state_dict(), opt.state_dict()), before, **EXACT)


# -- sub-ensembles of members of several sizes ------------------------------------------------

WIDTHS = (4, 8, 16)
SCORES = torch.tensor([0.3, 0.1, 0.2])  # best_k(k=2): rows [1, 2]


@pytest.mark.parametrize("rows", [[2, 0], [0, 1], [1, 0], [1], "best_k"], ids=str)
def test_a_sub_ensemble_of_several_sizes_loads_its_own_members(rows, tmp_path):
    factories = [functools.partial(models.MLP, hidden=h) for h in WIDTHS]
    ens = vmapens.Ensemble.from_factories(factories, seed=0)  # float32: load does not cast
    opt = vmapens.StackedAdam(ens, lr=[1e-2, 2e-2, 3e-2])
    step = vmapens.make_step(ens, nn.MSELoss(), opt)
    for _ in range(2):
        step(X.float(), Y.float())
    if rows == "best_k":
        sub, sub_opt = vmapens.selection.best_k(ens, SCORES, 2, optimizer=opt)
        rows = [1, 2]
    else:
        sub = ens.select(rows)
        sub_opt = opt.select(rows, sub)
    path = tmp_path / "sub.pt"
    vmapens.save(sub, path, sub_opt)
    kept = [factories[r] for r in rows]

    loaded = vmapens.load(path, kept)
    assert list(loaded.member_ids) == rows and loaded.n_total == len(WIDTHS)
    for mine, saved in zip(loaded.unstack(), sub.unstack(), strict=True):
        torch.testing.assert_close(mine.state_dict(), saved.state_dict(), **EXACT)
    if loaded._padding is not None:  # what no member holds is zero, as in a fresh build
        params = loaded.stacked_params()
        for name, mask in loaded._padding.masks(params).items():
            assert not params[name].detach()[mask == 0].any(), name
    loaded_opt = vmapens.StackedAdam(loaded, lr=0.5)
    vmapens.restore(path, loaded, loaded_opt)
    for i in range(len(rows)):
        torch.testing.assert_close(
            loaded_opt.member_state_dict(i), sub_opt.member_state_dict(i), **EXACT
        )
    if len(rows) == 1:  # one member: one factory is enough
        torch.testing.assert_close(
            vmapens.load(path, kept[0]).state_dicts(), sub.state_dicts(), **EXACT
        )

    with pytest.raises(ValueError, match=r"holds members of other sizes .* \(member by member\)"):
        vmapens.load(path, [factories[(r + 1) % len(WIDTHS)] for r in rows])
    with pytest.raises(
        ValueError, match=rf"holds {len(rows)} members, `factory` gives 3 factories"
    ):
        vmapens.load(path, factories)
