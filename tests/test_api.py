"""The public surface: a small core at the top level, namespaces for the rest, one meaning per
name, and 0.2's moved names saying where they went."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

import vmapens

CORE = {
    # the container and the verbs over it
    "Ensemble", "fit", "make_step", "predict", "check", "export", "save", "load", "restore",
    "save_members", "load_members", "load_member", "gather", "gather_history",
    # what the verbs take
    "History", "Callback", "LossScale", "per_member", "StackedOptimizer",
    # what a compiled step raises when its first update differs from the eager one, or when
    # torch.compile cannot build it
    "CompiledStepMismatch", "CompileFailed",
}  # fmt: skip
NAMESPACES = ["optim", "callbacks", "seeds", "rl", "pbt", "sweep", "selection"]


def test_the_top_level_is_the_core_and_the_stacked_optimizers():
    names = set(vmapens.__all__)
    optimizers = {n for n in names if n.startswith("Stacked") and n != "StackedOptimizer"}
    assert names == CORE | optimizers
    assert optimizers == {n for n in vmapens.optim.__all__ if n.startswith("Stacked")} - {
        "StackedOptimizer"
    }
    assert vmapens.__all__ == sorted(vmapens.__all__)


@pytest.mark.parametrize("space", NAMESPACES)
def test_each_name_has_one_meaning(space):
    module = getattr(vmapens, space)  # reachable after `import vmapens`
    assert module is importlib.import_module(f"vmapens.{space}")
    for name in getattr(module, "__all__", []):
        if hasattr(vmapens, name) and name in vmapens.__all__:
            assert getattr(module, name) is getattr(vmapens, name), f"{space}.{name}"


@pytest.mark.parametrize("name", sorted(vmapens._MOVED))
def test_a_moved_name_says_where_it_went(name):
    target = vmapens._MOVED[name]
    with pytest.raises(AttributeError, match=rf"^vmapens\.{name} moved to {target} in 0\.3\.0$"):
        getattr(vmapens, name)
    space, attr = target.removeprefix("vmapens.").split(".")
    assert hasattr(importlib.import_module(f"vmapens.{space}"), attr)


@pytest.mark.parametrize("space", [vmapens, vmapens.optim])
def test_stacked_adamw_names_the_ways_to_adamw_and_both_step_as_torch_adamw(space):
    with pytest.raises(AttributeError, match="decoupled_weight_decay=True.*stacked") as err:
        space.StackedAdamW  # noqa: B018
    assert "has no attribute 'StackedAdamW'" in str(err.value)
    # The two ways it names: each member steps as torch.optim.AdamW alone.
    ens = vmapens.Ensemble(lambda: torch.nn.Linear(3, 2).double(), n=2, seed=0)
    alone = ens.unstack()
    ways = [
        lambda e: vmapens.StackedAdam(e, lr=0.1, weight_decay=0.3, decoupled_weight_decay=True),
        lambda e: vmapens.optim.stacked(torch.optim.AdamW)(e, lr=0.1, weight_decay=0.3),
    ]
    x = torch.randn(4, 3, dtype=torch.float64)
    for way in ways:
        ens = vmapens.Ensemble.from_modules([copy.deepcopy(m) for m in alone])
        opt = way(ens)
        for _ in range(2):
            opt.zero_grad()
            ens(x).pow(2).sum().backward()
            opt.step()
        for i, m in enumerate(alone):
            m = copy.deepcopy(m)
            plain = torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.3)
            for _ in range(2):
                plain.zero_grad()
                m(x).pow(2).sum().backward()
                plain.step()
            torch.testing.assert_close(ens[i].state_dict(), m.state_dict(), rtol=1e-12, atol=1e-14)


def test_an_unknown_name_is_a_plain_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        vmapens.nope  # noqa: B018


def test_load_returns_the_ensemble_alone(tmp_path):
    ens = vmapens.Ensemble(lambda: torch.nn.Linear(2, 1), n=2, seed=0)
    vmapens.save(ens, tmp_path / "e.pt", optimizer=vmapens.StackedAdam(ens))
    loaded = vmapens.load(tmp_path / "e.pt", lambda: torch.nn.Linear(2, 1))
    assert isinstance(loaded, vmapens.Ensemble)
    torch.testing.assert_close(loaded.state_dict(), ens.state_dict(), rtol=0, atol=0)


def test_internal_maps_are_private():
    assert hasattr(vmapens.Ensemble, "map_members")  # the public per-member map
    assert not hasattr(vmapens.Ensemble, "member_map")


@pytest.mark.parametrize("naive_s, ours_s", [(10.0, 10.3), (10.0, 9.7), (1.0, 25.0), (25.0, 1.0)])
def test_the_demo_says_faster_or_slower_as_it_is(naive_s, ours_s):
    from vmapens import __main__ as cli

    text = cli._than(naive_s, ours_s)
    assert text.endswith(
        "faster than the naive loop" if ours_s <= naive_s else "slower than the naive loop"
    )
    printed = float(text.split("x ")[0])
    assert printed == pytest.approx(max(naive_s / ours_s, ours_s / naive_s), rel=0.01)
