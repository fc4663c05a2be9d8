"""``remove_parametrizations`` on one module leaves every other copy parametrized, as it does
for modules built alone: the user's modules, the template, ``ens[i]`` and the runner each have
a ``Parametrized*`` class of their own (torch's deep copy shares the class, and the removal
deletes the property from it)."""

from __future__ import annotations

import torch
import torch.nn.utils.parametrizations as P
from torch import nn
from torch.nn.utils import parametrize

import vmapens


def _member() -> nn.Module:
    return nn.Sequential(P.weight_norm(nn.Linear(4, 5)), nn.Tanh(), nn.Linear(5, 2)).double()


def test_removal_on_a_users_module_leaves_the_ensemble_built_from_it() -> None:
    x = torch.randn(6, 4, dtype=torch.float64)
    models = [_member() for _ in range(3)]
    with torch.no_grad():
        want = [m(x) for m in models]
    ens = vmapens.Ensemble.from_modules(models)
    parametrize.remove_parametrizations(models[0][0], "weight")
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack(want), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(ens[1](x), want[1], rtol=1e-12, atol=1e-12)
    assert parametrize.is_parametrized(ens.template[0], "weight")


def test_removal_on_a_member_leaves_the_others_and_the_template() -> None:
    x = torch.randn(6, 4, dtype=torch.float64)
    ens = vmapens.Ensemble(_member, n=3, seed=0)
    with torch.no_grad():
        want = [m(x) for m in ens.unstack()]
        first = ens[0]
        parametrize.remove_parametrizations(first[0], "weight")
        torch.testing.assert_close(first(x), want[0], rtol=1e-12, atol=1e-12)  # baked in
        for i in (1, 2):
            torch.testing.assert_close(ens[i](x), want[i], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(ens(x), torch.stack(want), rtol=1e-12, atol=1e-12)
    assert parametrize.is_parametrized(ens.template[0], "weight")
    assert parametrize.is_parametrized(ens[2][0], "weight")
