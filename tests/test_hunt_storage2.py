"""``Ensemble.state_dict``/``load_state_dict`` against N plain modules: the member's ``_metadata``
in the ensemble's state dict, and the ensemble's own load_state_dict pre-hooks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vmapens

N = 3


def _member() -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).double()


def _snapshot(ens: vmapens.Ensemble) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in ens.state_dict().items()}


@pytest.mark.parametrize("prefix", ["", "net."])
def test_the_state_dicts_metadata_is_the_members_under_the_prefix(prefix: str) -> None:
    ens = vmapens.Ensemble(_member, n=N, seed=0)
    ours = ens.state_dict(prefix=prefix)._metadata  # type: ignore[attr-defined]
    truth = _member().state_dict(prefix=prefix)._metadata  # type: ignore[attr-defined]
    assert dict(ours) == dict(truth)


def test_a_state_dict_that_lacks_num_batches_tracked_is_refused_as_torch_refuses_it() -> None:
    # Truth: a plain module refuses its own state dict without BatchNorm's count (version 2).
    plain = _member()
    sd = plain.state_dict()
    del sd["1.num_batches_tracked"]
    with pytest.raises(RuntimeError, match="Missing key.*1.num_batches_tracked"):
        plain.load_state_dict(sd)
    ens = vmapens.Ensemble(_member, n=N, seed=0)
    with torch.no_grad():
        ens.get_buffer("1.num_batches_tracked").fill_(7)
    other = vmapens.Ensemble(_member, n=N, seed=1).state_dict()
    del other["1.num_batches_tracked"]
    before = _snapshot(ens)
    with pytest.raises(RuntimeError, match="Missing key.*1.num_batches_tracked"):
        ens.load_state_dict(other)
    for k, v in ens.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, msg=k)
    # strict=False reports it and loads the rest, as torch does.
    report = ens.load_state_dict(other, strict=False)
    assert report.missing_keys == ["1.num_batches_tracked"]
    assert plain.load_state_dict(sd, strict=False).missing_keys == ["1.num_batches_tracked"]
    torch.testing.assert_close(ens.state_dict()["0.weight"], other["0.weight"], rtol=0, atol=0)


def test_a_state_dict_without_metadata_still_keeps_the_count_as_torch_does() -> None:
    plain = _member()
    with torch.no_grad():
        plain.get_buffer("1.num_batches_tracked").fill_(7)
    ens = vmapens.Ensemble(_member, n=N, seed=0)
    with torch.no_grad():
        ens.get_buffer("1.num_batches_tracked").fill_(7)
    sd = dict(vmapens.Ensemble(_member, n=N, seed=1).state_dict())  # no `_metadata`
    del sd["1.num_batches_tracked"]
    plain.load_state_dict({k: v[0] for k, v in sd.items()})
    ens.load_state_dict(sd)
    count = int(plain.get_buffer("1.num_batches_tracked"))
    assert ens.get_buffer("1.num_batches_tracked").tolist() == [count] * N


def _rename(module: nn.Module, state_dict: dict, prefix: str, *_: object) -> None:
    for key in [k for k in state_dict if k.startswith(prefix + "old.")]:
        state_dict[prefix + key[len(prefix) + 4 :]] = state_dict.pop(key)


@pytest.mark.parametrize("parent", [False, True])
def test_the_ensembles_own_load_pre_hook_runs_as_on_a_plain_module(parent: bool) -> None:
    # Truth: a plain module runs its own pre-hook, which renames an old checkpoint's keys.
    plain = _member()
    plain.register_load_state_dict_pre_hook(_rename)
    src = _member()
    assert not plain.load_state_dict(
        {"old." + k: v for k, v in src.state_dict().items()}
    ).missing_keys
    torch.testing.assert_close(plain.state_dict(), src.state_dict(), rtol=0, atol=0)

    ens = vmapens.Ensemble(_member, n=N, seed=0)
    ens.register_load_state_dict_pre_hook(_rename)
    other = vmapens.Ensemble(_member, n=N, seed=1).state_dict()
    old = {"old." + k: v for k, v in other.items()}
    if parent:
        holder = nn.ModuleDict({"ens": ens})
        holder.load_state_dict({"ens." + k: v for k, v in old.items()})
    else:
        ens.load_state_dict(old)
    for k, v in ens.state_dict().items():
        torch.testing.assert_close(v, other[k], rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("kind", ["buffer", "parameter"])
def test_a_tensor_registered_on_the_template_after_building_is_named_by_indexing(kind: str) -> None:
    ens = vmapens.Ensemble(_member, n=N, seed=0)
    if kind == "buffer":
        ens.template.get_submodule("0").register_buffer("extra", torch.ones(2, dtype=torch.float64))
    else:
        ens.template.get_submodule("0").extra = nn.Parameter(torch.ones(2, dtype=torch.float64))
    with pytest.raises(
        ValueError,
        match=r"`ens.template.0.extra` was registered or deleted|\['0.extra'\] were registered",
    ):
        ens[0]
