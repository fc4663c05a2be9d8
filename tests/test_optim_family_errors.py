"""Bad hyperparameters of every stacked optimizer: torch's own message, after the API name.

The table of optimizers is test_optim_family's; torch's twin, given the offending member's
value, says what the message must start with.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_optim_family import SPECS, N, ReferenceLion, Spec, member_kwargs

from vmapens.optim import MemberValues

#: What torch says for a bad value where it has no twin to ask (Lion), by hyperparameter.
LION_MESSAGES = {
    "lr": "Invalid learning rate: {v}",
    "betas": "Invalid beta parameter at index {j}: {v}",
    "weight_decay": "Invalid weight_decay value: {v}",
}


def _bad_cases() -> dict[str, tuple[Spec, dict[str, Any], int]]:
    """Per optimizer and hyperparameter: a bad shared value and one bad member (index 2)."""
    out = {}
    for name, spec in SPECS.items():
        for key in spec.per:
            if key == "dampening":
                continue  # torch accepts any dampening
            if key == "betas":
                out[f"{name}-beta1_shared"] = (spec, {"betas": (1.0, 0.999)}, 0)
                out[f"{name}-beta2_member"] = (spec, {"betas": (0.9, [0.9, 0.9, 1.5, 0.9])}, 2)
                continue
            out[f"{name}-{key}_shared"] = (spec, {key: -1.0}, 0)
            out[f"{name}-{key}_member"] = (spec, {key: [0.1, 0.1, -0.5, 0.1]}, 2)
    out["SGD-nesterov_member_without_momentum"] = (
        SPECS["SGD"],
        {"momentum": [0.9, 0.9, 0.0, 0.9], "nesterov": True},
        2,
    )
    return out


BAD = _bad_cases()


def _torch_message(spec: Spec, kwargs: dict[str, Any], i: int) -> str:
    if spec.twin is not ReferenceLion:
        with pytest.raises(ValueError) as theirs:
            spec.twin([torch.zeros(2, requires_grad=True)], **member_kwargs(kwargs, i))
        return str(theirs.value)
    (key,) = kwargs
    v = member_kwargs(kwargs, i)[key]
    j = 0 if key != "betas" or v[0] >= 1 else 1
    return LION_MESSAGES[key].format(v=v[j] if key == "betas" else v, j=j)


@pytest.mark.parametrize(("spec", "kwargs", "i"), list(BAD.values()), ids=list(BAD))
def test_bad_hyperparameter_gives_torch_message(spec: Spec, kwargs: dict, i: int) -> None:
    expected = f"{spec.cls.__name__}: {_torch_message(spec, kwargs, i)}"
    with pytest.raises(ValueError) as ours:
        spec.cls([torch.zeros(N, 2, requires_grad=True)], **kwargs)
    assert str(ours.value).startswith(expected), (str(ours.value), expected)


@pytest.mark.parametrize("spec", list(SPECS.values()), ids=list(SPECS))
def test_wrong_number_of_member_values(spec: Spec) -> None:
    api = spec.cls.__name__
    with pytest.raises(ValueError, match=rf"^{api}: `lr` has 3 values, expected n=4, one per"):
        spec.cls([torch.zeros(N, 2, requires_grad=True)], lr=[0.1] * 3)
    with pytest.raises(TypeError, match=rf"^{api}: `lr` must be a float"):
        spec.cls([torch.zeros(N, 2, requires_grad=True)], lr="fast")


@pytest.mark.parametrize("spec", list(SPECS.values()), ids=list(SPECS))
def test_a_param_group_edited_to_a_bad_value_is_refused_and_nothing_steps(spec: Spec) -> None:
    # A schedule that writes a list (not MemberValues) or a wrong count into a param group:
    # refused by name at the next step, before anything is written.
    api = spec.cls.__name__
    for value, error, says in [
        ([0.1] * N, TypeError, "must be a float, a tensor or vmapens.optim.MemberValues"),
        (MemberValues([0.1] * 3), ValueError, "has 3 values, expected n=4, one per member"),
    ]:
        w = torch.ones(N, 2, requires_grad=True)
        opt = spec.cls([w])
        w.grad = torch.ones(N, 2)
        opt.step()
        before = ({k: v.clone() for k, v in opt.state[w].items()}, w.detach().clone())
        opt.param_groups[0]["lr"] = value
        with pytest.raises(error, match=rf"^{api}.step: param group `lr` {says}"):
            opt.step()
        assert torch.equal(w, before[1])
        assert all(torch.equal(opt.state[w][k], v) for k, v in before[0].items())
