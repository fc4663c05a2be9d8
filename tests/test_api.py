"""The public surface: a small core at the top level, namespaces for the rest, one meaning per
name, and 0.2's moved names saying where they went."""

from __future__ import annotations

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
