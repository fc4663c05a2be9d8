"""Sharded ensembles and checkpoints against the truth: plain modules trained alone with
torch.optim, and the files themselves read with plain ``torch.load``.

The distributed half runs tests/dist_hunt2_worker.py once on 2 CPU ranks (gloo on 127.0.0.1):
3 members over 2 ranks (blocks of 2 and 1).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import dist_hunt2_worker as worker
import pytest
import torch
from torch import nn
from torchrun import torchrun
from truth import TOL64, assert_bit_identical, derived_seed, train_alone

import vmapens
from vmapens.history import History


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> Path:
    """One 2-rank run of every scenario in dist_hunt2_worker.py; its output directory."""
    out = tmp_path_factory.mktemp("hunt2")
    torchrun(worker.__file__, [str(out)], out.name)
    return out


def alone(factory, n: int = worker.N) -> list[nn.Module]:
    """The members as plain modules, trained alone with torch.optim.Adam on the shared
    batches; and their optimizers."""
    models = []
    for i in range(n):
        torch.manual_seed(derived_seed(worker.SEED, "member", i))
        models.append(factory())
    return models


def train_each(models: list[nn.Module], inputs=lambda x: x) -> list[torch.optim.Adam]:
    data = [(inputs(x), y) for x, y in worker.batches()]
    return [
        train_alone(m, data, make_opt=lambda m, lr=lr: torch.optim.Adam(m.parameters(), lr=lr))
        for m, lr in zip(models, worker.LRS, strict=True)
    ]


def test_sharded_recurrent_members_train_as_alone(ranks: Path):
    """GRU members, 2 + 1 over the ranks, gathered: each as trained alone with torch Adam, to
    round-off (vmapens's batched GRU sums in another order for another number of members,
    docs/distributed.md)."""
    got = torch.load(ranks / "gru.pt")
    models = alone(worker.gru)
    train_each(models)
    for i, m in enumerate(models):
        for key, want in m.state_dict().items():
            torch.testing.assert_close(got[key][i], want, **TOL64, msg=f"member {i} {key}")


# -- restore into some of the stored members ------------------------------------------------


def saved(tmp_path: Path) -> tuple[Path, list[nn.Module], list[torch.optim.Adam]]:
    """A file of the N members trained with vmapens, and the same members trained alone."""
    ens = vmapens.Ensemble(worker.mlp, worker.N, seed=worker.SEED)
    path = tmp_path / "whole.pt"
    vmapens.save(ens, path, worker.train(ens, worker.flat))
    models = alone(worker.mlp)
    return path, models, train_each(models, worker.flat)


def assert_as_alone(ens, opt, models, opts, rows) -> None:
    """Row k of ``ens``/``opt`` is member ``rows[k]`` alone: state, Adam moments, step."""
    params = list(ens.stacked_params().values())
    for k, i in enumerate(rows):
        for key, want in models[i].state_dict().items():
            torch.testing.assert_close(ens.state_dict()[key][k], want, **TOL64, msg=f"{i} {key}")
        for p, q in zip(params, models[i].parameters(), strict=True):
            for name in ("exp_avg", "exp_avg_sq"):
                got = opt.state[p][name][k]
                torch.testing.assert_close(got, opts[i].state[q][name], **TOL64, msg=name)
            assert float(opt.state[p]["step"].reshape(-1)[k]) == float(opts[i].state[q]["step"])


@pytest.mark.parametrize("rows", [[1, 2], [2, 0], [1]], ids=["block", "reordered", "one"])
def test_restore_fills_some_members_from_a_whole_file(tmp_path: Path, rows: list[int]):
    """restore(path, ens.select(rows), opt) gives each row its member's state and per-member
    learning rate (it refused a file of more members): the next step goes on as alone."""
    path, models, opts = saved(tmp_path)
    ens = vmapens.Ensemble(worker.mlp, worker.N, seed=worker.SEED + 1).select(rows)
    opt = vmapens.StackedAdam(ens)
    vmapens.restore(path, ens, opt)
    assert_as_alone(ens, opt, models, opts, rows)
    x, y = worker.batches()[0]
    opt.zero_grad()
    vmapens.per_member(nn.functional.mse_loss)(ens(worker.flat(x)), y).sum().backward()
    opt.step()
    for i in rows:
        train_alone(models[i], [(worker.flat(x), y)], make_opt=opts[i])
    assert_as_alone(ens, opt, models, opts, rows)


def test_restore_into_a_block_on_each_rank(ranks: Path):
    """Each rank restored a whole-ensemble file into its shard=True block and a fresh
    StackedAdam: the rows of the file, read with plain torch.load, member by member."""
    held = torch.load(ranks / "whole.pt")
    opt_rows = {
        k: {name: v for name, v in entry.items() if v.dim() > 0}
        for k, entry in held["optimizer"]["state"].items()
    }
    for rank, block in enumerate(([0, 1], [2])):
        state, opt_state = torch.load(ranks / f"block.rank{rank}.pt")
        assert_bit_identical(dict(state), {k: v[block] for k, v in held["ensemble"].items()})
        for k, entry in opt_rows.items():
            for name, v in entry.items():
                assert_bit_identical(opt_state["state"][k][name], v[block], f"{k} {name}")
        assert list(opt_state["param_groups"][0]["lr"]) == [worker.LRS[i] for i in block]


@pytest.mark.parametrize("rows", [[1, 2], [2, 0]], ids=["other-split", "reordered"])
def test_restore_a_sharded_checkpoint_into_some_members(ranks: Path, rows: list[int]):
    """A 2-rank fit checkpoint (blocks [0, 1] and [2]) restored in one process into members
    of another split: as restoring every member and then selecting the rows."""
    path = ranks / "ckpt" / "ckpt.pt"
    whole = vmapens.Ensemble(worker.mlp, worker.N, seed=0)
    whole_opt = vmapens.StackedAdam(whole)
    whole_history = History.empty(range(worker.N), validated=True)
    vmapens.restore(path, whole, whole_opt, whole_history)
    ens = vmapens.Ensemble(worker.mlp, worker.N, seed=1).select(rows)
    opt, history = vmapens.StackedAdam(ens), History.empty(rows, validated=True)
    vmapens.restore(path, ens, opt, history)
    assert_bit_identical(ens.state_dict(), whole.select(rows).state_dict())
    want = whole_opt.select(rows, whole.select(rows)).state_dict()
    assert_bit_identical(opt.state_dict()["state"], want["state"])
    assert list(opt.param_groups[0]["lr"]) == [worker.LRS[i] for i in rows]
    for name in ("train_loss", "val_loss"):
        assert_bit_identical(getattr(history, name), getattr(whole_history, name)[:, rows])
    assert history.member_ids == rows and history.ensemble_metrics is None


def test_restore_into_members_the_file_lacks_changes_nothing(tmp_path: Path):
    path, _, _ = saved(tmp_path)
    part = tmp_path / "part.pt"
    ens = vmapens.load(path, worker.mlp).select([0, 1])
    vmapens.save(ens, part)
    target = vmapens.Ensemble(worker.mlp, worker.N, seed=1).select([1, 2])
    before = copy.deepcopy(target.state_dict())
    with pytest.raises(ValueError, match=r"^restore: .* holds 2 members .*ids 0\.\.1 of 3\), "
                       r"this ensemble has 2 members .*ids 1\.\.2 of 3\): restore fills an "
                       r"ensemble of the stored members, or of some of them"):  # fmt: skip
        vmapens.restore(part, target)
    assert_bit_identical(target.state_dict(), before)


def test_save_members_fails_on_every_rank_when_one_rank_cannot_write(ranks: Path):
    said = [json.loads((ranks / f"report.rank{r}.json").read_text()) for r in range(2)]
    assert said[1]["save_members"].startswith("IsADirectoryError: ")
    assert said[0]["save_members"].startswith(
        "RuntimeError: save_members: rank 1 could not write its member files, so no "
        "members.json was written"
    ), said[0]
    assert not (ranks / "members" / "members.json").exists()


def test_restore_fills_some_members_of_several_sizes(tmp_path: Path):
    """Members of different sizes (from_factories): each row gets its own member's corner,
    as the plain module of that width holds it (the file records every member's size)."""
    factories = [lambda h=h: nn.Sequential(nn.Linear(3, h), nn.Tanh(), nn.Linear(h, 1)).double()
                 for h in (2, 5, 3)]  # fmt: skip
    ens = vmapens.Ensemble.from_factories(factories, seed=0)
    opt = vmapens.StackedAdam(ens, lr=[0.1, 0.2, 0.3])
    opt.zero_grad()
    ens(torch.ones(4, 3, dtype=torch.float64)).square().sum().backward()
    opt.step()
    vmapens.save(ens, tmp_path / "sizes.pt", opt)
    plain = ens.unstack()
    sub = vmapens.Ensemble.from_factories(factories, seed=1).select([2, 0])
    vmapens.restore(tmp_path / "sizes.pt", sub, vmapens.StackedAdam(sub))
    for k, i in enumerate([2, 0]):
        assert_bit_identical(dict(sub[k].state_dict()), dict(plain[i].state_dict()), f"{i}")
