"""Export, checkpoints and member files, found by a second bug hunt: refusals that say what
helps and change nothing, and files that load as plain torch loads its own."""

from __future__ import annotations

import functools
import re

import pytest
import torch
from torch import nn

import vmapens

F64 = torch.float64
G = torch.Generator().manual_seed(11)
X = torch.randn(6, 3, generator=G, dtype=F64)


class Wide(nn.Module):
    """A member whose hidden and output widths are its own."""

    def __init__(self, hidden: int, out: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(3, hidden), nn.Linear(hidden, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def _snapshot(ens: vmapens.Ensemble) -> tuple[dict, bool]:
    return {k: v.clone() for k, v in ens.state_dict().items()}, ens.training


def _unchanged(ens: vmapens.Ensemble, before: tuple[dict, bool]) -> None:
    state, training = before
    assert ens.training == training
    now = ens.state_dict()
    assert now.keys() == state.keys()
    assert all(torch.equal(now[k], v) for k, v in state.items())


# -- export of members of different sizes ------------------------------------------------------

SIZES = [(4, 2), (6, 3), (4, 2), (6, 3)]  # two output widths, two members each


@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
@pytest.mark.parametrize("backend", ["vmap", "loop"])
def test_export_of_outputs_of_several_widths_says_what_helps(backend, check):
    factories = [functools.partial(Wide, h, o).__call__ for h, o in SIZES]
    ens = vmapens.Ensemble.from_factories(factories, seed=0, backend=backend).double()
    before = _snapshot(ens)
    with pytest.raises(ValueError) as info:
        vmapens.export(ens, X, check=check)  # unchecked it used to return padded outputs
    said = str(info.value)
    assert said.startswith("export: `ens`")
    assert "members [0, 2] give (6, 2)" in said and "members [1, 3] give (6, 3)" in said
    assert "backend='loop'" in said and "from_modules([ens[i] for i in rows])" in said
    _unchanged(ens, before)
    # The way out it names: one program per size, each member as its own module computes.
    for rows in ([0, 2], [1, 3]):
        alone = [Wide(*SIZES[r]).double() for r in rows]
        for r, m in zip(rows, alone, strict=True):
            m.load_state_dict(ens.state_dicts()[r])
        served = vmapens.export(vmapens.Ensemble.from_modules(alone), X).module()
        for k, m in enumerate(alone):
            torch.testing.assert_close(served(X)[k], m(X), rtol=0, atol=1e-12)


def test_export_of_a_padded_sub_ensemble_of_the_smaller_members_says_what_helps():
    # select keeps the storage padded to the largest member of the ensemble it came from.
    factories = [functools.partial(Wide, h, o).__call__ for h, o in SIZES]
    ens = vmapens.Ensemble.from_factories(factories, seed=0).double()
    sub = ens.select([0, 2])
    before = _snapshot(sub)
    with pytest.raises(ValueError, match=r"members \[0, 1\] give \(6, 2\).*from_modules"):
        vmapens.export(sub, X, check=False)
    _unchanged(sub, before)


def test_export_of_members_of_several_hidden_sizes_and_one_output_width_still_serves_them():
    sizes = [(4, 2), (6, 2), (5, 2)]
    factories = [functools.partial(Wide, h, o).__call__ for h, o in sizes]
    ens = vmapens.Ensemble.from_factories(factories, seed=0).double()
    served = vmapens.export(ens, X).module()
    for i, (h, o) in enumerate(sizes):
        alone = Wide(h, o).double()
        alone.load_state_dict(ens.state_dicts()[i])
        torch.testing.assert_close(served(X)[i], alone(X), rtol=0, atol=1e-12)


class Centred(nn.Module):
    """Centres its hidden units over the hidden width: a padded member would centre over zeros."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(3, hidden), nn.Linear(hidden, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        return self.fc2(h - h.mean(-1, keepdim=True))


@pytest.mark.parametrize("backend", ["vmap", "loop"])
def test_export_probe_of_a_padded_member_names_a_way_out_that_works(backend):
    factories = [functools.partial(Centred, 4), functools.partial(Centred, 6)]
    ens = vmapens.Ensemble.from_factories(factories, seed=0, backend=backend).double()
    before = _snapshot(ens)
    with pytest.raises(RuntimeError, match="computes something else") as info:
        vmapens.export(ens, X)
    said = str(info.value)
    # backend='loop' runs a padded member padded too: it is no way out here.
    assert "with backend='loop' to export" not in said and "from_modules" in said
    _unchanged(ens, before)
    alone = Centred(4).double()
    alone.load_state_dict(ens.state_dicts()[0])
    served = vmapens.export(vmapens.Ensemble.from_modules([alone]), X).module()
    torch.testing.assert_close(served(X)[0], alone(X), rtol=0, atol=1e-12)


# -- restore into an ensemble of other members -------------------------------------------------


def _saved(tmp_path, n: int = 4):
    """A checkpoint of ``n`` Linear members and their Adam state after one step, and the
    members' state before that step."""
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 2), n=n, seed=0).double()
    initial = {k: v.clone() for k, v in ens.state_dict().items()}
    opt = vmapens.StackedAdam(ens, lr=0.1)
    opt.zero_grad()
    ens(X).square().sum().backward()
    opt.step()
    path = tmp_path / "ckpt.pt"
    vmapens.save(ens, path, opt)
    return path, ens, initial


RESTORE_INTO = {
    # name: (build the target from the saved 4 members, what the message must say)
    "fewer": (
        lambda ens: vmapens.Ensemble(lambda: nn.Linear(3, 2), n=3, seed=1).double(),
        r"holds 4 members .* this ensemble has 3 members .*vmapens\.load\(path, factory\)",
    ),
    "more": (
        lambda ens: vmapens.Ensemble(lambda: nn.Linear(3, 2), n=8, seed=1).double(),
        r"this ensemble has 8 members .*vmapens\.load\(path, factory\)",
    ),
    # members of the same run, one of them twice: some of the stored members, but not each once
    "twice": (
        lambda ens: ens.select([1, 1, 2]),
        r"ids \[1, 1, 2\] of 4\).*some of them, each once.*ens\.select\(rows\).*"
        r"vmapens\.load\(path, factory\)",
    ),
}


@pytest.mark.parametrize("case", list(RESTORE_INTO))
def test_restore_into_other_members_says_what_it_expected_and_what_to_do(case, tmp_path):
    path, ens, _ = _saved(tmp_path)
    build, said = RESTORE_INTO[case]
    target = build(ens)
    opt = vmapens.StackedAdam(target, lr=0.1)
    before = _snapshot(target)
    with pytest.raises(ValueError, match=said) as info:
        vmapens.restore(path, target, opt)
    assert str(info.value).startswith(f"restore: {path} holds 4 members")
    _unchanged(target, before)
    assert not opt.state


def test_the_way_restore_names_gives_a_block_its_members_and_their_optimizer_state(tmp_path):
    path, _, initial = _saved(tmp_path)
    whole = vmapens.load(path, lambda: nn.Linear(3, 2).double())
    opt = vmapens.StackedAdam(whole, lr=0.1)
    vmapens.restore(path, whole, opt)
    block = whole.select([2, 3])
    block_opt = opt.select([2, 3], block)
    opt.zero_grad()
    block(X).square().sum().backward()
    block_opt.step()
    # Truth: member 3 alone, two steps of plain torch.optim.Adam from its initial state.
    alone = nn.Linear(3, 2).double()
    alone.load_state_dict({k: v[3] for k, v in initial.items()})
    torch_opt = torch.optim.Adam(alone.parameters(), lr=0.1)
    for _ in range(2):
        torch_opt.zero_grad()
        alone(X).square().sum().backward()
        torch_opt.step()
    assert list(block.member_ids) == [2, 3] and block.n_total == 4
    for name, p in alone.named_parameters():
        torch.testing.assert_close(block.stacked_params()[name][1], p, rtol=0, atol=1e-12)


# -- a file whose member list is not what vmapens writes -----------------------------------------

BAD_MEMBER_LISTS = {
    "ids-not-a-list": (5, "`member_ids` must be a list of ints"),
    "no-ids": (None, "`member_ids` must be a list of ints"),
    "id-out-of-range": ([0, 5], r"member ids must be in \[0, 2\)"),
    "repeated": ([0, 0], "repeat ids"),
}


@pytest.mark.parametrize("api", ["restore", "fit"])
@pytest.mark.parametrize("case", list(BAD_MEMBER_LISTS))
def test_a_bad_member_list_in_a_file_is_a_value_error_naming_it(api, case, tmp_path):
    ids, said = BAD_MEMBER_LISTS[case]
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 2), n=2, seed=0).double()
    members = {"class": "torch.nn.modules.linear.Linear", "n_total": 2}
    if ids is not None:
        members["member_ids"] = ids
    path = tmp_path / "bad.pt"
    # A file of the checkpoint envelope (format, version, digest) holding a foreign member list.
    vmapens.checkpoint.write(path, {"members": members, "ensemble": ens.state_dict(), "fit": {}})
    before = _snapshot(ens)
    with pytest.raises(ValueError, match=f"{api}: {re.escape(str(path))}: .*{said}"):
        if api == "restore":
            vmapens.restore(path, ens)
        else:
            y = torch.zeros(4, 2, dtype=F64)
            vmapens.fit(ens, (X[:4], y), nn.MSELoss(), epochs=1, checkpoint=path, progress=False)
    _unchanged(ens, before)


def test_loading_members_of_another_dtype_says_which_dtype_to_build(tmp_path):
    path, ens, _ = _saved(tmp_path)  # float64 members
    with pytest.raises(ValueError, match=r"float64.*float32.*module\.to\(torch\.float64\)"):
        vmapens.load(path, lambda: nn.Linear(3, 2))  # float32, which torch would cast silently
    loaded = vmapens.load(path, lambda: nn.Linear(3, 2).to(torch.float64))  # the way it names
    for key, value in ens.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value, rtol=0, atol=0)
