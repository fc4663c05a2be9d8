"""Files, checkpoints and resume, found by a bug hunt: each test compares with plain torch or
with the run that was never interrupted."""

from __future__ import annotations

import copy
import functools
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import vmapens
from vmapens import checkpoint

F64 = torch.float64
G = torch.Generator().manual_seed(5)
X, Y = torch.randn(12, 3, generator=G, dtype=F64), torch.randn(12, 2, generator=G, dtype=F64)
EXACT = dict(rtol=0, atol=0)
# Members padded to another width sum the same products with other zeros in between: equal
# up to the order of float64 sums (docs/semantics.md, "Members of different sizes").
PADDED = dict(rtol=0, atol=1e-12)


class Net(nn.Module):
    def __init__(self, hidden: int = 4) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(3, hidden), nn.Linear(hidden, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


# Net as a script defines it: `python train.py` makes its classes `__main__.Net`; a notebook
# that does `from train import Net` gets `train.Net`. Same class, same state_dict.
ScriptNet = type("Net", (Net,), {"__module__": "__main__", "__qualname__": "Net"})
OtherNet = type("Net", (Net,), {"__module__": "elsewhere", "__qualname__": "Net"})
Renamed = type("Renamed", (Net,), {"__module__": "__main__", "__qualname__": "Renamed"})


class Interrupt(Exception):
    pass


def interrupt_after(epoch: int):
    def callback(history: vmapens.History) -> None:
        if history.epochs == epoch:
            raise Interrupt

    return callback


def fit(ens: vmapens.Ensemble, path, epochs: int = 3, callbacks=()) -> tuple:
    opt = vmapens.StackedAdam(ens, lr=0.05)
    history = vmapens.fit(ens, (X, Y), nn.MSELoss(), optimizer=opt, epochs=epochs,
                          batch_size=5, seed=1, progress=False, checkpoint=path,
                          callbacks=list(callbacks))  # fmt: skip
    return opt, history


def member_states(ens: vmapens.Ensemble, opt: torch.optim.Optimizer) -> list:
    """Every member's parameters and optimizer state at its own size."""
    return [(sd, opt.member_state_dict(i)) for i, sd in enumerate(ens.state_dicts())]


def test_a_sub_ensemble_of_several_sizes_resumes_from_its_own_factories(tmp_path):
    """A sub-ensemble's checkpoint holds its members padded to the parent's largest member; the
    run resumed from the kept members' factories pads to its own largest (was: refused)."""
    factories = [functools.partial(Net, h) for h in (3, 6, 4)]
    kept = [2, 0]

    def sub() -> vmapens.Ensemble:
        return vmapens.Ensemble.from_factories(factories, seed=0).double().select(kept)

    straight = sub()
    opt, history = fit(straight, tmp_path / "straight.pt")
    path = tmp_path / "resumed.pt"
    with pytest.raises(Interrupt):
        fit(sub(), path, callbacks=[interrupt_after(1)])
    resumed = vmapens.load(path, [lambda r=r: factories[r]().double() for r in kept])
    assert resumed.stacked_params()["fc1.weight"].shape[1] == 4  # padded to its own largest
    resumed_opt, resumed_history = fit(resumed, path)

    torch.testing.assert_close(
        member_states(resumed, resumed_opt), member_states(straight, opt), **PADDED
    )
    torch.testing.assert_close(resumed_history.train_loss, history.train_loss, **PADDED)


@pytest.mark.parametrize(("saved", "loaded"), [(ScriptNet, Net), (Net, ScriptNet)],
                         ids=["script-to-import", "import-to-script"])  # fmt: skip
def test_a_scripts_class_loads_where_the_script_is_imported(saved, loaded, tmp_path):
    ens = vmapens.Ensemble(saved, n=3, seed=0).double()
    opt = vmapens.StackedAdam(ens, lr=0.1)
    vmapens.per_member(nn.MSELoss())(ens(X), Y).sum().backward()
    opt.step()
    vmapens.save(ens, tmp_path / "ens.pt", optimizer=opt)

    back = vmapens.load(tmp_path / "ens.pt", lambda: loaded().double())
    back_opt = vmapens.StackedAdam(back)
    vmapens.restore(tmp_path / "ens.pt", back, back_opt)
    torch.testing.assert_close(back.state_dict(), ens.state_dict(), **EXACT)
    torch.testing.assert_close(back_opt.state_dict(), opt.state_dict(), **EXACT)


def test_a_fit_checkpoint_of_a_script_resumes_where_the_script_is_imported(tmp_path):
    straight = vmapens.Ensemble(Net, n=3, seed=0).double()
    opt, history = fit(straight, tmp_path / "straight.pt")
    path = tmp_path / "resumed.pt"
    with pytest.raises(Interrupt):
        fit(vmapens.Ensemble(ScriptNet, n=3, seed=0).double(), path, callbacks=[interrupt_after(1)])
    resumed = vmapens.Ensemble(Net, n=3, seed=0).double()
    resumed_opt, resumed_history = fit(resumed, path)
    torch.testing.assert_close(resumed.state_dict(), straight.state_dict(), **EXACT)
    torch.testing.assert_close(resumed_opt.state_dict(), opt.state_dict(), **EXACT)
    torch.testing.assert_close(resumed_history.state_dict(), history.state_dict(), **EXACT)


@pytest.mark.parametrize("other", [OtherNet, Renamed], ids=["other-module", "other-name"])
def test_a_class_of_another_module_or_name_is_still_refused(other, tmp_path):
    vmapens.save(vmapens.Ensemble(Net, n=2, seed=0), tmp_path / "ens.pt")
    with pytest.raises(ValueError, match=r"holds 2 members of .*\.Net .*this ensemble has"):
        vmapens.load(tmp_path / "ens.pt", other)


class CountsOnItem(nn.Module):
    """A forward that vmap cannot batch (``.item()``): it runs only with backend="loop"."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * (1.0 + float(self.fc.weight.sum().item() > 0))


class Dropped(Net):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.tanh(self.fc1(x))))


@pytest.mark.parametrize("how", ["save", "fit"])
def test_load_runs_the_members_as_the_saved_ensemble_ran(how, tmp_path):
    """``backend``, ``randomness`` and ``chunk_size`` come back (were: the defaults, so a
    forward that needs backend="loop" raised after load)."""
    ens = vmapens.Ensemble(CountsOnItem, n=3, seed=0, backend="loop", chunk_size=2).double()
    path = tmp_path / "ens.pt"
    if how == "save":
        vmapens.save(ens, path)
    else:
        fit(ens, path, epochs=1)
    back = vmapens.load(path, lambda: CountsOnItem().double())
    assert (back.backend, back.chunk_size) == ("loop", 2)
    with torch.no_grad():
        alone = torch.stack([member(X) for member in ens.unstack()])
        torch.testing.assert_close(back(X), alone, **EXACT)

    same = vmapens.Ensemble(Dropped, n=3, seed=0, randomness="same").double()
    vmapens.save(same, path)
    back = vmapens.load(path, lambda: Dropped().double())
    assert back.randomness == "same"
    torch.manual_seed(3)
    out = back(X)
    # randomness="same": one dropout mask for all members, the one a member alone draws.
    for i, member in enumerate(same.unstack()):
        torch.manual_seed(3)
        torch.testing.assert_close(out[i], member(X), rtol=1e-12, atol=1e-12)


def test_export_serves_a_sub_ensemble(monkeypatch):
    """``export(ens[idx])`` is how docs/workflows.md serves a subset (was: refused as a
    sharded ensemble); a rank's block of a sharded ensemble is still refused."""
    ens = vmapens.Ensemble(Net, n=4, seed=0).double()
    sub = ens[[3, 1]]
    program = vmapens.export(sub, X)
    with torch.no_grad():
        alone = torch.stack([ens[3](X), ens[1](X)])
    torch.testing.assert_close(program.module()(X), alone, rtol=1e-12, atol=1e-12)

    exporting = sys.modules["vmapens.export"]
    monkeypatch.setattr(exporting, "world_size", lambda: 2)
    monkeypatch.setattr(exporting, "rank", lambda: 1)
    with pytest.raises(ValueError, match=r"export: `ens` holds 2 of 4 members \(a sharded"):
        vmapens.export(ens[2:], X)
    vmapens.export(ens[[3, 2]], X, check=False)  # not rank 1's block: a selection


def test_fewer_epochs_than_the_checkpoint_holds_is_refused(tmp_path):
    """Resuming with `epochs` below the checkpoint's epoch handed back members trained for
    more epochs than asked, with a longer history; now an error that changes nothing."""
    path = tmp_path / "run.pt"
    fit(vmapens.Ensemble(Net, n=2, seed=0).double(), path, epochs=3)
    ens = vmapens.Ensemble(Net, n=2, seed=0).double()
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    with pytest.raises(ValueError, match=r"already trained for 3 epochs, more than `epochs`=2"):
        fit(ens, path, epochs=2)
    torch.testing.assert_close(ens.state_dict(), before, **EXACT)


@pytest.mark.parametrize("held", [[4, 5], None], ids=["other-ids", "no-ids"])
def test_restore_refuses_a_history_of_other_members(held, tmp_path):
    """``save`` refuses a History of other members; ``restore`` loaded one from a file (or
    one with no member ids, which broke ``history.state_dict()`` afterwards)."""
    ens = vmapens.Ensemble(Net, n=2, seed=0).double()
    history = vmapens.fit(ens, (X, Y), nn.MSELoss(), epochs=1, seed=1, progress=False)
    vmapens.save(ens, tmp_path / "ens.pt", history=history)
    payload = checkpoint.read(tmp_path / "ens.pt", "test")
    payload["history"]["member_ids"] = held
    parts = {k: v for k, v in payload.items() if k not in ("format", "version")}
    checkpoint.write(tmp_path / "ens.pt", parts)

    again = vmapens.Ensemble(Net, n=2, seed=3).double()
    mine = vmapens.fit(again, (X, Y), nn.MSELoss(), epochs=2, seed=1, progress=False)
    before = (copy.deepcopy(again.state_dict()), copy.deepcopy(mine.state_dict()))
    with pytest.raises(ValueError, match=r"restore: .* holds the history of other members"):
        vmapens.restore(tmp_path / "ens.pt", again, history=mine)
    torch.testing.assert_close((again.state_dict(), mine.state_dict()), before, **EXACT)


def test_loading_the_shared_part_of_a_sharded_checkpoint_says_what_it_is(tmp_path):
    """A sharded fit checkpoint keeps the members in block files next to it; ``load`` and
    ``restore`` said "`fc1.weight` is <class 'str'>" (a placeholder) instead. They read the
    blocks now (tests/test_load_sharded.py): without them, the missing block is named."""
    ens = vmapens.Ensemble(Net, n=2, seed=0)
    vmapens.save(ens, tmp_path / "ens.pt")
    payload = checkpoint.read(tmp_path / "ens.pt", "test")
    shared = {k: v for k, v in payload.items() if k not in ("format", "version")}
    shared["ensemble"] = {k: "vmapens:rows" for k in shared["ensemble"]}  # as sharding writes
    shared["blocks"] = [("members-000000-000002.epoch000001.pt", [0, 1])]
    checkpoint.write(tmp_path / "ens.pt", shared)
    missing = r"ens\.pt names the block .*members-000000-000002\.epoch000001\.pt, which is missing"
    with pytest.raises(ValueError, match=rf"^load: .*{missing}"):
        vmapens.load(tmp_path / "ens.pt", Net)
    before = copy.deepcopy(ens.state_dict())
    with pytest.raises(ValueError, match=rf"^restore: .*{missing}"):
        vmapens.restore(tmp_path / "ens.pt", ens)
    torch.testing.assert_close(ens.state_dict(), before, **EXACT)


class ScaledLoss(nn.Module):
    """A loss with a scalar buffer (0-d tensor), as custom losses often hold."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.register_buffer("scale", torch.tensor(scale, dtype=F64))

    def forward(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.scale * nn.functional.mse_loss(out, target)


def fit_with(path, loss_fn: nn.Module, lr, epochs: int = 3, callbacks=()) -> tuple:
    ens = vmapens.Ensemble(Net, n=2, seed=0).double()
    opt = vmapens.StackedAdam(ens, lr=lr)
    vmapens.fit(ens, (X, Y), loss_fn, optimizer=opt, epochs=epochs, batch_size=5, seed=1,
                progress=False, checkpoint=path, callbacks=list(callbacks))  # fmt: skip
    return ens, opt


def test_a_loss_with_a_scalar_buffer_checkpoints_and_resumes(tmp_path):
    """The resume check fingerprints a loss's tensors; a 0-d one raised torch's "self.dim()
    cannot be 0 to view Double as Byte" from fit(checkpoint=...)."""
    straight, opt = fit_with(tmp_path / "straight.pt", ScaledLoss(2.0), 0.05)
    path = tmp_path / "resumed.pt"
    with pytest.raises(Interrupt):
        fit_with(path, ScaledLoss(2.0), 0.05, callbacks=[interrupt_after(1)])
    with pytest.raises(ValueError, match=r"other options: loss_fn="):
        fit_with(path, ScaledLoss(2.0 + 1e-9), 0.05)
    resumed, resumed_opt = fit_with(path, ScaledLoss(2.0), 0.05)
    torch.testing.assert_close(resumed.state_dict(), straight.state_dict(), **EXACT)
    torch.testing.assert_close(resumed_opt.state_dict(), opt.state_dict(), **EXACT)


def test_resume_refuses_a_tensor_lr_that_differs_past_its_printed_digits(tmp_path):
    """A tensor lr was compared by its repr, ``tensor(0.0100)`` for both: the run resumed
    with the checkpoint's lr in place of the one it was given."""
    path = tmp_path / "run.pt"
    fit_with(path, nn.MSELoss(), torch.tensor(0.01, dtype=F64), epochs=1)
    with pytest.raises(ValueError, match=r"optimizer\.group0\.lr=tensor\(0\.0100001"):
        fit_with(path, nn.MSELoss(), torch.tensor(0.0100001, dtype=F64))


class Counter(vmapens.callbacks.Callback):
    """A stateful callback; ``reads_v2`` stands for a later version of it that reads its old
    state with an AttributeError."""

    def __init__(self, reads_v2: bool = False) -> None:
        self.epochs, self.reads_v2 = 0, reads_v2

    def on_epoch_end(self, ctx) -> None:
        self.epochs += 1

    def state_dict(self) -> dict:
        return {"epochs": self.epochs}

    def load_state_dict(self, state: dict) -> None:
        self.epochs = state.epochs if self.reads_v2 else state["epochs"]


def test_a_callback_failing_to_load_its_state_leaves_the_run_unchanged(tmp_path):
    """The parts loaded before a callback's AttributeError (ensemble, optimizer, history) kept
    the checkpoint's state while fit raised."""
    path = tmp_path / "run.pt"
    fit_with(path, nn.MSELoss(), 0.05, epochs=1, callbacks=[Counter()])
    ens = vmapens.Ensemble(Net, n=2, seed=0).double()
    opt = vmapens.StackedAdam(ens, lr=0.05)
    before = copy.deepcopy(ens.state_dict())
    with pytest.raises(AttributeError, match="epochs"):
        vmapens.fit(ens, (X, Y), nn.MSELoss(), optimizer=opt, epochs=3, batch_size=5, seed=1,
                    progress=False, checkpoint=path, callbacks=[Counter(reads_v2=True)])  # fmt: skip
    torch.testing.assert_close(ens.state_dict(), before, **EXACT)
    assert not opt.state  # as built: no step taken, nothing loaded


def test_a_dataloader_with_persistent_workers_warns_that_resume_is_not_exact(tmp_path):
    """Its workers keep their random state across epochs and a resumed run starts new ones,
    drawing their seed from the RNG the uninterrupted run does not draw from then: the resume
    silently differed (checked by hand: dropout and the shuffled order diverge)."""
    loader = DataLoader(TensorDataset(X, Y), batch_size=4, shuffle=True, num_workers=1,
                        persistent_workers=True)  # fmt: skip
    ens = vmapens.Ensemble(Net, n=2, seed=0).double()
    with pytest.warns(UserWarning, match=r"persistent_workers=True.*differ from an uninter"):
        vmapens.fit(ens, loader, nn.MSELoss(), progress=False, checkpoint=tmp_path / "run.pt")


def test_files_with_per_member_hyperparameters_load_with_plain_torch(tmp_path):
    """docs/fit.md: a checkpoint holds tensors and plain containers only. Per-member learning
    rates and betas (``MemberValues``) went in as vmapens objects, which
    ``torch.load(weights_only=True)`` refuses without vmapens imported."""
    ens = vmapens.Ensemble(Net, n=3, seed=0).double()
    opt = vmapens.StackedAdam(ens, lr=[0.1, 0.2, 0.3], betas=([0.9, 0.8, 0.7], 0.999))
    history = vmapens.fit(ens, (X, Y), nn.MSELoss(), optimizer=opt, seed=1, progress=False,
                          checkpoint=tmp_path / "run.pt")  # fmt: skip
    vmapens.save(ens, tmp_path / "ens.pt", optimizer=opt, history=history)
    allowed = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()  # as in a process without vmapens
    try:
        held = [torch.load(tmp_path / name, weights_only=True) for name in ("run.pt", "ens.pt")]
    finally:
        torch.serialization.add_safe_globals(allowed)
    for payload in held:
        group = payload["optimizer"]["param_groups"][0]
        assert group["lr"] == {"vmapens:member_values": [0.1, 0.2, 0.3]}
        torch.testing.assert_close(payload["ensemble"], ens.state_dict(), **EXACT)

    back = vmapens.load(tmp_path / "ens.pt", lambda: Net().double())
    back_opt = vmapens.StackedAdam(back)
    vmapens.restore(tmp_path / "ens.pt", back, back_opt)
    assert back_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert back_opt.param_groups[0]["betas"] == opt.param_groups[0]["betas"]
    torch.testing.assert_close(back_opt.state_dict(), opt.state_dict(), **EXACT)


class Versioned(nn.Module):
    """A module at version 2 of its state: version 1 stored the scale doubled, and its
    ``_load_from_state_dict`` converts such files, as torch's own modules do for theirs."""

    _version = 2

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.scale = nn.Parameter(torch.rand(2))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args) -> None:
        if local_metadata.get("version", 1) < 2:
            state_dict[prefix + "scale"] = state_dict[prefix + "scale"] / 2
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale


def test_member_files_carry_the_state_dict_version_plain_torch_reads(tmp_path):
    """``module.state_dict()`` carries each submodule's ``_version`` (``_metadata``); member
    files did not, so a versioned module loaded them as version 1 and halved ``scale``."""
    modules = [Versioned().double() for _ in range(3)]
    ens = vmapens.Ensemble.from_modules(modules)
    for module, path in zip(modules, vmapens.save_members(ens, tmp_path), strict=True):
        for state in (torch.load(path, weights_only=True), vmapens.load_member(path)):
            loaded = Versioned().double()
            loaded.load_state_dict(state)
            torch.testing.assert_close(loaded.state_dict(), module.state_dict(), **EXACT)
