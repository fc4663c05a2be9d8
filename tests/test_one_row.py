"""One integer-like selects one row wherever rows are taken, as ``[i]`` does; a path that is no
path is refused naming the argument."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

import vmapens
from vmapens.pbt import exploit_


def _trained(n: int = 4) -> tuple[vmapens.Ensemble, vmapens.StackedAdam]:
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 2, dtype=torch.float64), n=n, seed=0)
    opt = vmapens.StackedAdam(ens, lr=torch.linspace(0.01, 0.04, n, dtype=torch.float64))
    x = torch.randn(5, 3, dtype=torch.float64)
    for _ in range(2):
        opt.zero_grad()
        ens(x).pow(2).mean((1, 2)).sum().backward()
        opt.step()
    return ens, opt


@pytest.mark.parametrize("one", [2, np.int64(2), torch.tensor(2), -2])
def test_select_one_integer_is_the_one_row_list(one: object) -> None:
    ens, opt = _trained()
    sub, want = ens.select(one), ens.select([2])
    assert list(sub.member_ids) == list(want.member_ids) == [2]
    for (k, a), (_, b) in zip(sub.state_dict().items(), want.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    sub_opt = opt.select(one, sub)
    want_opt = opt.select([2], want)
    assert str(sub_opt.state_dict()) == str(want_opt.state_dict())


def test_exploit_with_integer_rows_equals_the_list_form() -> None:
    ens, opt = _trained()
    twin, twin_opt = copy.deepcopy((ens, opt))
    exploit_(ens, opt, 0, 3)
    exploit_(twin, twin_opt, [0], [3])
    for (k, a), (_, b) in zip(ens.state_dict().items(), twin.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    assert torch.equal(ens.state_dict()["weight"][3], ens.state_dict()["weight"][0])
    assert str(opt.state_dict()) == str(twin_opt.state_dict())


def test_a_checkpoint_path_that_is_no_path_is_refused_by_name() -> None:
    ens, opt = _trained()
    data = (torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64))
    before = copy.deepcopy(ens.state_dict())
    with pytest.raises(TypeError, match="`checkpoint` must be a str or os.PathLike, got int"):
        vmapens.fit(ens, data, nn.MSELoss(), optimizer=opt, checkpoint=3, progress=False)
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k
