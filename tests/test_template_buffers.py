"""A write through a template *buffer*'s ``.data`` (``bn.running_var.data.fill_(1)``, old
code's ``m.running_mean.data.zero_()``) or new ``.data`` assigned to it changed nothing and
raised nothing: the template is on meta, and torch's ``.data`` has a version counter of its
own. It is refused at the next call now, as the same write on a template parameter is
(``_template_parameter.TemplateBuffer``); nothing changes.

Truth: the members' own state before the write (a refused write changes nothing), and plain
``BatchNorm1d`` modules for what still runs after copies and saves."""

from __future__ import annotations

import copy
import io
from collections.abc import Callable

import pytest
import torch
from torch import nn

import vmapens


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))


_WRITES: dict[str, Callable[[torch.Tensor], None]] = {
    "data.fill_": lambda b: b.data.fill_(1.0),
    "data.zero_": lambda b: b.data.zero_(),
    "data = meta": lambda b: setattr(b, "data", torch.ones(4, device="meta")),
}


def _built(how: str) -> vmapens.Ensemble:
    ens = vmapens.Ensemble(_net, 3, seed=0)
    if how == "deepcopy":
        return copy.deepcopy(ens)
    if how == "saved":
        buf = io.BytesIO()
        torch.save(ens, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)
    if how == "double":
        return ens.double()
    return ens


@pytest.mark.parametrize("how", ["built", "deepcopy", "saved", "double"])
@pytest.mark.parametrize("write", sorted(_WRITES))
def test_a_data_write_on_a_template_buffer_is_refused_at_the_next_call(
    write: str, how: str
) -> None:
    ens = _built(how)
    x = torch.randn(5, 3, dtype=ens.stacked_params()["0.weight"].dtype)
    ens(x)  # train mode: the statistics move
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    _WRITES[write](ens.template[1].running_var)
    with pytest.raises(ValueError, match=r"`ens\.template\.1\.running_var` was written in place"):
        ens(x)
    for k, v in ens.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


def test_real_data_assigned_to_a_template_buffer_is_refused_naming_the_members_storage() -> None:
    ens = vmapens.Ensemble(_net, 3, seed=0)
    with pytest.raises(ValueError, match=r"meta.*ens\.stacked_params\(\)"):
        ens.template[1].running_mean.data = torch.zeros(4)


def test_the_members_still_run_as_alone_after_copies_and_saves() -> None:
    """The buffers' new type changes nothing a member computes: ens(x) in train mode (the
    statistics move) and then in eval mode, against each member alone."""
    torch.manual_seed(0)
    x = torch.randn(6, 3)
    for how in ("built", "deepcopy", "saved"):
        ens = _built(how)
        alone = ens.unstack()
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in alone]))
        ens.eval()
        for m in alone:
            m.eval()
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in alone]))
        for i, m in enumerate(alone):
            torch.testing.assert_close(ens[i].state_dict(), m.state_dict())
            assert type(ens[i][1].running_mean) is torch.Tensor  # a member is a plain module
