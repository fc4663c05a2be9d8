"""Sharded runs and the Lightning module against the truth: members trained alone with
torch.optim, one process, and Lightning's own rules.

The distributed half runs tests/dist_hunt_worker.py once on 2 CPU ranks (gloo on 127.0.0.1)
and reads its files: 3 members over 2 ranks (uneven: blocks of 2 and 1), 2 over 2 (one
each), BatchNorm, a bool buffer and a frozen parameter in every member.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
from pathlib import Path

import dist_hunt_worker as worker
import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torchrun import torchrun
from truth import TOL64, assert_bit_identical, derived_seed, train_alone

import vmapens
from vmapens.lightning import EnsembleModule

# A Linear's bias right before BatchNorm has a gradient of round-off only (BatchNorm removes
# the mean), which Adam scales up: docs/semantics.md tests it to 1.8e-8 in float64. The
# running mean follows that bias. Everything else: TOL64.
BEFORE_BN = ("fc1.bias", "bn.running_mean", "0.bias", "1.running_mean")
TOL_BN = dict(rtol=0, atol=1.8e-8)


def tol(key: str) -> dict:
    return TOL_BN if key in BEFORE_BN else TOL64


def assert_state_close(got: dict, expected: dict, where: str) -> None:
    assert list(got) == list(expected), where
    for key, want in expected.items():
        torch.testing.assert_close(got[key], want, **tol(key), msg=f"{where} {key}")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> Path:
    """One 2-rank run of every scenario in dist_hunt_worker.py; its output directory."""
    out = tmp_path_factory.mktemp("hunt")
    torchrun(worker.__file__, [str(out)], out.name)
    return out


def reports(out: Path) -> list[dict]:
    return [json.loads((out / f"report.rank{r}.json").read_text()) for r in range(2)]


def load(path: Path):
    return torch.load(path, weights_only=False)


def optimizer_rows(out: Path, name: str) -> dict[int, dict]:
    """Global member id -> its optimizer state, from both ranks' files."""
    return {**load(out / f"{name}.opt.rank0.pt"), **load(out / f"{name}.opt.rank1.pt")}


# -- refused on every rank, not a hang --------------------------------------------------------

REFUSALS = [
    ("gather_unsharded_rank0", r"^ValueError: gather: rank 0's `ens` holds members range\(0, 4\) "
     r"of 4, but rank 0's block is range\(0, 2\); build it with shard=True on every rank$"),
    ("gather_dst_differs", r"^ValueError: gather: every rank must pass the same `dst`, got "
     r"\[0, 1\] by rank$"),
    ("gather_history_dst_differs", r"^ValueError: gather_history: every rank must pass the same "
     r"`dst`, got \[0, 1\] by rank$"),
    ("gather_dst_out_of_range_on_rank1", r"^ValueError: gather: every rank must pass the same "
     r"`dst`, got \[0, 2\] by rank$"),
]  # fmt: skip


@pytest.mark.parametrize(("key", "match"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_gather_mismatch_is_refused_on_every_rank(ranks: Path, key: str, match: str):
    # Before: the rank that saw the mismatch raised alone and the other waited in the
    # collective until the group's timeout (30 minutes by default).
    for report in reports(ranks):
        assert report[key] is not None
        assert re.match(match, report[key]), report[key]


# -- sharded runs end where members alone end ----------------------------------------------


def alone(n: int) -> list[nn.Module]:
    """Member i as docs/distributed.md builds it: torch.manual_seed(member seed); factory()."""
    models = []
    for i in range(n):
        torch.manual_seed(derived_seed(worker.SEED, "member", i))
        models.append(worker.factory())
    return models


def test_uneven_shards_train_like_members_alone(ranks: Path):
    """3 members on 2 ranks, make_step with per-member lr, gathered onto rank 1: parameters,
    buffers, optimizer state and the frozen flag are each member's own, as with torch.optim."""
    x, y = worker.data(0)
    batches = [(x[k * worker.BATCH : (k + 1) * worker.BATCH],
                y[k * worker.BATCH : (k + 1) * worker.BATCH]) for k in range(3)]  # fmt: skip
    models = alone(3)
    opts = [
        train_alone(m, batches, nn.functional.mse_loss, torch.optim.Adam(m.parameters(), lr=lr))
        for m, lr in zip(models, worker.LRS)
    ]
    gathered = load(ranks / "steps.pt")
    rows = optimizer_rows(ranks, "steps")
    assert reports(ranks)[1]["steps_ids"] == [0, 1, 2]
    assert reports(ranks)[1]["steps_frozen"] == {k: p.requires_grad for k, p in
                                                 models[0].named_parameters()}  # fmt: skip
    for i, (m, opt) in enumerate(zip(models, opts)):
        assert_state_close({k: v[i] for k, v in gathered.items()}, m.state_dict(), f"member {i}")
        want = opt.state_dict()
        got = rows[i]
        for k in set(got["state"]) - set(want["state"]):  # the frozen bias: a fresh state
            assert float(got["state"][k]["step"]) == 0, (i, k)
            assert not any(v.any() for v in got["state"][k].values()), (i, k)
        assert set(want["state"]) <= set(got["state"]), i
        for k, state in want["state"].items():
            name = [n for n, _ in m.named_parameters()][k]
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(got["state"][k][key], state[key], **tol(name))
            assert float(got["state"][k]["step"]) == float(state["step"])
        assert got["param_groups"][0]["lr"] == worker.LRS[i]
    # The gathered ensemble runs: member i's eval output is model i's.
    xv = worker.data(1)[0]
    with torch.no_grad():
        want_out = torch.stack([m.eval()(xv) for m in models])
    # In eval mode the output moves with the bias before BatchNorm and the running mean
    # (TOL_BN each), scaled by the BatchNorm and output weights.
    torch.testing.assert_close(load(ranks / "steps.forward.pt"), want_out, rtol=0, atol=1e-7)


def test_gather_complex_buffers(ranks: Path):
    """torch.distributed.gather takes no complex tensors: they travel as (real, imag) pairs."""
    gathered = load(ranks / "spectral.pt")
    for i in range(3):
        torch.manual_seed(derived_seed(worker.SEED, "member", i))
        want = worker.Spectral().state_dict()
        for key, value in want.items():
            assert gathered[key].dtype == value.dtype, key
            assert torch.equal(gathered[key][i], value), (i, key)


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    """The fit scenario in this process, unsharded, for 3 and for 2 members."""
    out: dict = {"members": tmp_path_factory.mktemp("single") / "members"}
    for n in (3, 2):
        ens, opt, history = worker.fit(n, shard=False)
        out[n] = (ens.state_dict(), history.state_dict(), worker.member_states(ens, opt))
        if n == 3:
            vmapens.save_members(ens, out["members"])
    return out


def assert_fit_close(got: dict, opt_rows: dict, expected: tuple, where: str) -> None:
    state, history, opt = expected
    assert_state_close(got["state"], state, where)
    h = got["history"]
    assert h["member_ids"] == history["member_ids"], where
    # Which epochs were best and when members stopped: decisions, the same exactly.
    for key in ("best_epoch", "stopped_epoch", "diverged"):
        assert torch.equal(h[key], history[key]), (where, key, h[key], history[key])
    for key in ("train_loss", "val_loss"):
        torch.testing.assert_close(h[key], history[key], rtol=1e-9, atol=0, equal_nan=True)
    torch.testing.assert_close(h["metrics"], history["metrics"], rtol=1e-9, atol=0, equal_nan=True)
    assert sorted(opt_rows) == sorted(opt), where
    for gid, want in opt.items():
        assert opt_rows[gid]["param_groups"] == want["param_groups"], (where, gid)
        for k, st in want["state"].items():
            for key, v in st.items():
                torch.testing.assert_close(opt_rows[gid]["state"][k][key], v, rtol=1e-6,
                                           atol=1e-9, msg=f"{where} {gid} {k} {key}")  # fmt: skip


def test_uneven_sharded_fit_with_best_restore_matches_one_process(ranks: Path, single: dict):
    """Bagging, per-member lr and weight decay, early stopping with best restore, members that
    stop at different epochs (rank 1's only member first): as the one-process run."""
    stopped = single[3][1]["stopped_epoch"].tolist()
    assert len(set(stopped)) == 3 and stopped[2] != -1, stopped  # the premise
    assert_fit_close(load(ranks / "fit.pt"), optimizer_rows(ranks, "fit"), single[3], "fit")


def test_sharded_resume_with_best_restore_is_exact(ranks: Path):
    """Stopped after 2 epochs and resumed on the same 2 ranks: bit for bit the uninterrupted
    sharded run (early-stopping state, best states, optimizer rows, History)."""
    assert_bit_identical(load(ranks / "resumed.pt"), load(ranks / "fit.pt"), "resumed")
    assert_bit_identical(optimizer_rows(ranks, "resumed"), optimizer_rows(ranks, "fit"), "opt")


def test_one_process_resumes_an_uneven_sharded_checkpoint(ranks: Path, single: dict, tmp_path):
    ckpt = shutil.copytree(ranks / "partial", tmp_path / "partial") / "ckpt.pt"
    ens, opt, history = worker.fit(3, shard=False, checkpoint=ckpt)
    got = {"state": ens.state_dict(), "history": history.state_dict()}
    assert_fit_close(got, worker.member_states(ens, opt), single[3], "resumed alone")
    assert not (tmp_path / "partial" / "ckpt.pt.members").exists()  # a single file again


def test_as_many_members_as_ranks(ranks: Path, single: dict):
    assert_fit_close(load(ranks / "two.pt"), optimizer_rows(ranks, "two"), single[2], "two")


def test_save_members_from_uneven_shards(ranks: Path, single: dict):
    names = sorted(p.name for p in single["members"].iterdir())
    assert sorted(p.name for p in (ranks / "members").iterdir()) == names
    for name in (n for n in names if n.startswith("member_")):
        assert_state_close(load(ranks / "members" / name), load(single["members"] / name), name)
    got, want = vmapens.load_members(ranks / "members"), vmapens.load_members(single["members"])
    assert len(got) == len(want) == len(names) - 1  # every rank's members in one manifest
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert_state_close(a, b, f"member {i}")


# -- a sharded run without a seed; a plateau scheduler's record across world sizes ----------


def test_sharded_fit_without_seed_is_refused(ranks: Path):
    for report in reports(ranks):
        assert report["seed_none"].startswith("fit: a sharded ensemble needs an int `seed`")


def test_sharded_fit_without_seed_changes_nothing(ranks: Path):
    for report in reports(ranks):
        assert report["seed_none_changed"] == {
            "on_fit_start_ran": False,
            "optimizer_changed": False,
        }


def test_plateau_scheduler_resumes_at_another_world_size(ranks: Path, single: dict, tmp_path):
    """A per-member plateau scheduler's record is state, not a setting: a checkpoint of two
    uneven blocks resumes in one process and ends as the uninterrupted one-process run."""
    ckpt = shutil.copytree(ranks / "plateau", tmp_path / "plateau") / "ckpt.pt"
    ens, opt, history = worker.fit(3, shard=False, checkpoint=ckpt, plateau=True)
    want_ens, want_opt, want_history = worker.fit(3, shard=False, plateau=True)
    want = (
        want_ens.state_dict(),
        want_history.state_dict(),
        worker.member_states(want_ens, want_opt),
    )
    got = {"state": ens.state_dict(), "history": history.state_dict()}
    assert_fit_close(got, worker.member_states(ens, opt), want, "plateau resumed alone")
    assert opt.param_groups[0]["lr"].tolist() == want_opt.param_groups[0]["lr"].tolist()


# -- Lightning -------------------------------------------------------------------------------

QUIET = dict(
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    enable_checkpointing=False,
    accelerator="cpu",
)


def bn_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 1)).double()


def lightning_data() -> tuple[DataLoader, DataLoader, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    x, y = (torch.randn(20, k, generator=g, dtype=torch.float64) for k in (3, 1))
    xv, yv = (torch.randn(10, k, generator=g, dtype=torch.float64) for k in (3, 1))
    # Batches of 8, 8, 4 and 4, 4, 2: the logged means weight batches by their size.
    return (DataLoader(TensorDataset(x, y), batch_size=8),
            DataLoader(TensorDataset(xv, yv), batch_size=4), (xv, yv))  # fmt: skip


def test_lightning_trains_batchnorm_in_train_mode_after_validation():
    """The sanity check and each epoch's validation put the module in eval mode; training
    after them must run BatchNorm in train mode again, as for a plain module."""
    train, val, (xv, yv) = lightning_data()
    ens = vmapens.Ensemble(bn_mlp, n=3, seed=0)
    models = [m.double() for m in ens.unstack()]
    lr = 0.05
    mod = EnsembleModule(ens, nn.MSELoss(), optimizer=functools.partial(vmapens.StackedAdam, lr=lr))
    L.Trainer(max_epochs=2, **QUIET).fit(mod, train, val)  # sanity check on (2 batches)
    for i, m in enumerate(models):
        opt = torch.optim.Adam(m.parameters(), lr=lr)
        for _ in range(2):
            train_alone(m, list(train), nn.functional.mse_loss, opt)
        assert_state_close(ens[i].state_dict(), m.state_dict(), f"member {i}")
        m.eval()
        with torch.no_grad():
            want = nn.functional.mse_loss(m(xv), yv)
        # The last epoch's validation, in eval mode (running statistics).
        got = mod.trainer.callback_metrics[f"val_loss/member_{i}"]
        torch.testing.assert_close(got.double(), want, rtol=1e-7, atol=0)
    assert all(m.training for m in ens.template.modules())


def test_lightning_validate_and_predict_restore_each_members_mode():
    train, val, _ = lightning_data()
    ens = vmapens.Ensemble(bn_mlp, n=2, seed=0)
    ens.template[1].eval()  # frozen BatchNorm, as `model.bn.eval()` on a plain module
    modes = [m.training for m in ens.template.modules()]
    mod = EnsembleModule(ens, nn.MSELoss())
    trainer = L.Trainer(max_epochs=1, **QUIET)
    trainer.validate(mod, val, verbose=False)
    assert [m.training for m in ens.template.modules()] == modes
    trainer.predict(mod, DataLoader(next(iter(train))[0], batch_size=4))
    assert [m.training for m in ens.template.modules()] == modes
    assert ens.training


def test_lightning_validate_outside_fit_does_not_count_for_patience():
    """trainer.validate() is no epoch of training: as Lightning's EarlyStopping, the module's
    patience ignores it. Before, three calls stopped every member before any training."""
    train, val, _ = lightning_data()
    ens = vmapens.Ensemble(bn_mlp, n=3, seed=0)
    mod = EnsembleModule(ens, nn.MSELoss(), patience=1)
    trainer = L.Trainer(max_epochs=1, **QUIET)
    state = {k: v.clone() for k, v in mod.state_dict().items()}
    for _ in range(3):
        trainer.validate(mod, val, verbose=False)
    assert "val_loss/member_0" in trainer.callback_metrics  # logged all the same
    for key, want in state.items():
        assert torch.equal(mod.state_dict()[key], want), key


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 1), nn.Linear(2, 1)

    def forward(self, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.a(u) + torch.tanh(self.b(v))


class PairDataset(Dataset):
    """Samples ``((u, v), y)``: DataLoader's collation turns the pair into a list."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(12, 3, generator=g, dtype=torch.float64)
        self.y = torch.randn(12, 1, generator=g, dtype=torch.float64)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return (self.x[i], self.x[i, :2]), self.y[i]


def test_lightning_two_inputs_from_a_dataloader():
    train = DataLoader(PairDataset(0), batch_size=4)
    val = DataLoader(PairDataset(1), batch_size=12)
    assert isinstance(next(iter(train))[0], list)  # the premise
    ens = vmapens.Ensemble(lambda: TwoInputs().double(), n=2, seed=0)
    models = ens.unstack()
    mod = EnsembleModule(
        ens, nn.MSELoss(), optimizer=functools.partial(vmapens.StackedAdam, lr=0.1)
    )
    L.Trainer(max_epochs=1, num_sanity_val_steps=0, **QUIET).fit(mod, train, val)
    (u, v), y = next(iter(val))
    for i, m in enumerate(models):
        opt = torch.optim.Adam(m.parameters(), lr=0.1)
        for (bu, bv), target in train:  # the plain loop: model(u, v)
            opt.zero_grad()
            nn.functional.mse_loss(m(bu, bv), target).backward()
            opt.step()
        assert_state_close(ens[i].state_dict(), m.state_dict(), f"member {i}")
        with torch.no_grad():
            want = nn.functional.mse_loss(m(u, v), y)
        torch.testing.assert_close(
            mod.trainer.callback_metrics[f"val_loss/member_{i}"].double(), want, **TOL64
        )
