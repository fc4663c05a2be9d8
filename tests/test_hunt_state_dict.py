"""``Ensemble.load_state_dict`` against plain modules: refusals that change nothing, in torch's
words, and hints that say what a refused state dict is."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vmapens

N = 3


def _member() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).double()


def _snapshot(ens: vmapens.Ensemble) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in ens.state_dict().items()}


def _assert_unchanged(ens: vmapens.Ensemble, before: dict[str, torch.Tensor]) -> None:
    after = ens.state_dict(keep_vars=True)
    assert list(after) == list(before)
    for k, v in after.items():
        assert v.dtype == before[k].dtype, k
        torch.testing.assert_close(v.detach(), before[k], rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("as_parameter", [False, True])
def test_assign_of_an_integer_parameter_is_refused_as_torch_refuses_it_and_changes_nothing(
    as_parameter: bool,
) -> None:
    """Before, the parameters ahead of the bad one were replaced, then torch's bare
    "Only Tensors of floating point..." escaped from building the Parameter."""
    ens = vmapens.Ensemble(_member, N, seed=0)
    params = list(ens.parameters())
    before = _snapshot(ens)
    sd = {k: torch.zeros_like(v) for k, v in ens.state_dict().items()}
    bad = torch.zeros(N, 2, dtype=torch.int64)
    sd["2.bias"] = nn.Parameter(bad, requires_grad=False) if as_parameter else bad
    plain = _member()
    plain_sd = {k: torch.zeros_like(v) for k, v in plain.state_dict().items()}
    plain_sd["2.bias"] = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(RuntimeError) as truth:
        plain.load_state_dict(plain_sd, assign=True)
    with pytest.raises(type(truth.value)) as refused:
        ens.load_state_dict(sd, assign=True)
    message = str(refused.value)
    assert 'While copying the parameter named "2.bias"' in message
    assert "can require gradients" in message
    assert "can require gradients" in str(truth.value)
    _assert_unchanged(ens, before)
    assert all(p is q for p, q in zip(ens.parameters(), params, strict=True))


def test_assign_of_an_integer_parameter_that_needs_no_grad_is_taken_as_torch_takes_it() -> None:
    ens = vmapens.Ensemble(_member, N, seed=0)
    ens.template[2].bias.requires_grad_(False)
    plain = _member()
    plain[2].bias.requires_grad_(False)
    plain.load_state_dict(
        {**plain.state_dict(), "2.bias": torch.ones(2, dtype=torch.int64)}, assign=True
    )
    sd = {**ens.state_dict(), "2.bias": torch.ones(N, 2, dtype=torch.int64)}
    ens.load_state_dict(sd, assign=True)
    got = ens.state_dict(keep_vars=True)["2.bias"]
    want = plain.state_dict(keep_vars=True)["2.bias"]
    assert isinstance(got, nn.Parameter) and isinstance(want, nn.Parameter)
    assert (got.dtype, got.requires_grad) == (want.dtype, want.requires_grad)


@pytest.mark.parametrize("assign", [False, True])
def test_one_members_state_dict_is_refused_with_a_hint_and_changes_nothing(assign: bool) -> None:
    ens = vmapens.Ensemble(_member, N, seed=0)
    before = _snapshot(ens)
    one = ens.state_dicts()[0]
    with pytest.raises(RuntimeError, match="size mismatch") as refused:
        ens.load_state_dict(one, assign=assign)
    message = str(refused.value)
    assert "one member's state dict (no member dim)" in message
    assert "Ensemble.from_modules" in message
    assert "members per tensor" not in message
    _assert_unchanged(ens, before)
    # What the hint says works: the member's class takes it.
    _member().load_state_dict(one)


def test_one_members_state_dict_of_members_of_other_sizes_gets_the_hint() -> None:
    factories = [
        lambda w=w: nn.Sequential(nn.Linear(3, w), nn.ReLU(), nn.Linear(w, 2)).double()
        for w in (4, 8)
    ]
    ens = vmapens.Ensemble.from_factories(factories, seed=0)
    before = _snapshot(ens)
    for one in ens.state_dicts():
        with pytest.raises(RuntimeError, match="one member's state dict"):
            ens.load_state_dict(one)
    _assert_unchanged(ens, before)


def test_a_mismatch_in_a_members_own_shape_gets_no_member_hint() -> None:
    ens = vmapens.Ensemble(_member, N, seed=0)
    sd = {**ens.state_dicts()[0], "0.weight": torch.zeros(5, 3, dtype=torch.float64)}
    with pytest.raises(RuntimeError, match="size mismatch") as refused:
        ens.load_state_dict(sd)
    assert "one member's state dict" not in str(refused.value)


def test_a_value_that_is_no_tensor_is_refused_in_torchs_words_and_changes_nothing() -> None:
    ens = vmapens.Ensemble(_member, N, seed=0)
    before = _snapshot(ens)
    sd = {k: torch.zeros_like(v) for k, v in ens.state_dict().items()}
    sd["2.bias"] = [0.0, 0.0]
    plain = _member()
    with pytest.raises(RuntimeError) as truth:
        plain.load_state_dict({**plain.state_dict(), "2.bias": [0.0, 0.0]})
    with pytest.raises(RuntimeError) as refused:
        ens.load_state_dict(sd)
    words = "expected torch.Tensor or Tensor-like object from checkpoint but received"
    assert words in str(truth.value) and words in str(refused.value)
    _assert_unchanged(ens, before)


def test_strict_false_and_a_parent_module_report_keys_as_torch_does() -> None:
    ens = vmapens.Ensemble(_member, N, seed=0)
    plain = _member()
    sd = {k: v.clone() + 1 for k, v in ens.state_dict().items() if k != "0.bias"}
    got = ens.load_state_dict({**sd, "extra": torch.zeros(1)}, strict=False)
    psd = {k: v for k, v in plain.state_dict().items() if k != "0.bias"}
    want = plain.load_state_dict({**psd, "extra": torch.zeros(1)}, strict=False)
    assert (got.missing_keys, got.unexpected_keys) == (want.missing_keys, want.unexpected_keys)
    for k, v in ens.state_dict().items():
        if k in sd:
            torch.testing.assert_close(v, sd[k], rtol=0, atol=0)

    parent = nn.ModuleDict({"ens": vmapens.Ensemble(_member, N, seed=1), "head": nn.Linear(2, 2)})
    twin = nn.ModuleDict({"ens": _member(), "head": nn.Linear(2, 2)})
    full = {f"ens.{k}": v for k, v in ens.state_dict().items()}
    full |= {f"head.{k}": v for k, v in parent["head"].state_dict().items()}
    assert parent.load_state_dict(full) == twin.load_state_dict(twin.state_dict())
    for k, v in parent.state_dict().items():
        torch.testing.assert_close(v, full[k], rtol=0, atol=0)


class Halved(nn.Module):
    """A member whose load_state_dict pre-hook halves the weight it loads: alone, torch runs it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.fc.register_load_state_dict_pre_hook(self._halve)

    @staticmethod
    def _halve(module: nn.Module, state_dict: dict, prefix: str, *args: object) -> None:
        state_dict[prefix + "weight"] = state_dict[prefix + "weight"] / 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_members_load_hooks_that_the_ensemble_does_not_run_are_warned_of() -> None:
    torch.manual_seed(0)
    plain = [Halved().double() for _ in range(2)]
    ens = vmapens.Ensemble.from_modules(plain)
    sd = {k: v + 1 for k, v in ens.state_dict().items()}
    alone = Halved().double()
    alone.load_state_dict({k: v[0] for k, v in sd.items()})  # the truth: torch runs the hook
    assert torch.equal(alone.fc.weight, sd["fc.weight"][0] / 2)
    with pytest.warns(UserWarning, match=r"modules \['fc'\] have load_state_dict hooks, which the "
                      r"ensemble does not run.*Ensemble\.from_modules"):  # fmt: skip
        ens.load_state_dict(sd)
    assert not torch.equal(ens.stacked_params()["fc.weight"][0], alone.fc.weight)  # as warned
    # torch's own hooks (old spectral_norm's, for old state dict versions) are not warned of.
    normed = vmapens.Ensemble(lambda: nn.utils.spectral_norm(nn.Linear(3, 2)), 2, seed=0)
    normed.load_state_dict(normed.state_dict())
