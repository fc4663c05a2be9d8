"""The Ensemble container against plain PyTorch: old-style weight/spectral norm members,
state_dict loading, indexing and building, each compared with the plain modules alone."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from truth import TOL64, assert_members_equal, float64_batches, train_each

import vmapens

N = 3


def _old_weight_norm() -> nn.Module:
    with warnings.catch_warnings():  # torch deprecates it in favour of parametrizations
        warnings.simplefilter("ignore", FutureWarning)
        layer = nn.utils.weight_norm(nn.Linear(3, 4, dtype=torch.float64))
    return nn.Sequential(layer, nn.Tanh(), nn.Linear(4, 1, dtype=torch.float64))


def _old_spectral_norm() -> nn.Module:
    layer = nn.utils.spectral_norm(nn.Linear(3, 4, dtype=torch.float64))
    return nn.Sequential(layer, nn.Tanh(), nn.Linear(4, 1, dtype=torch.float64))


def _alone(factory, seeds=range(N)) -> list[nn.Module]:
    models = []
    for s in seeds:
        torch.manual_seed(s)
        models.append(factory())
    return models


def _pruned() -> nn.Module:
    model = nn.Sequential(
        nn.Linear(3, 4, dtype=torch.float64), nn.Tanh(), nn.Linear(4, 1, dtype=torch.float64)
    )
    nn.utils.prune.l1_unstructured(model[0], "weight", amount=0.5)  # each member its own mask
    return model


OLD_STYLE = [
    (_old_weight_norm, "vmap"),
    (_old_weight_norm, "loop"),
    (_old_spectral_norm, "vmap"),  # the runner holds a twin of its hook (vmapens/_spectral.py)
    (_pruned, "vmap"),
    (_pruned, "loop"),
]


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize(
    ("factory", "backend"),
    OLD_STYLE,
    ids=["weight_norm", "weight_norm-loop", "spectral_norm", "prune", "prune-loop"],
)
def test_old_style_norm_hooks_train_as_alone_and_members_come_back_after_a_forward(
    factory, backend
):
    """``nn.utils.weight_norm`` / ``spectral_norm`` / ``prune`` keep ``weight`` as a non-leaf
    plain attribute that their forward pre-hook sets: building (weight_norm, prune) and
    ``ens[i]`` after a forward (spectral_norm, loop) raised deepcopy's "Only Tensors created
    explicitly by the user" before."""
    ens = vmapens.Ensemble(factory, N, seeds=list(range(N)), backend=backend)
    alone = _alone(factory)
    batches = float64_batches(3, 5, 3, 1)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-2))
    for x, y in batches:
        step(x, y)
    train_each(alone, batches)
    assert_members_equal(ens, alone)
    x = batches[0][0]
    for i, member in enumerate(ens.unstack()):  # after a forward of the ensemble
        assert type(member[0]) is nn.Linear
        alone[i].eval()(x)  # sets `weight` from its current parameters, as ens[i] holds it
        torch.testing.assert_close(member[0].weight, alone[i][0].weight, **TOL64)
        torch.testing.assert_close(member.eval()(x), alone[i](x), **TOL64)
    sub = ens.select([2, 0])  # a copy of the meta modules, after a forward too
    torch.testing.assert_close(sub.eval()(x)[0], alone[2](x), **TOL64)
    assert ens.template[0].weight.is_meta  # no member's tensor (nor its graph) kept there


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
def test_old_style_weight_norm_trains_as_alone_compiled():
    """Under vmap the hook's tensor leaked out of the compiled step's graph (inductor: "Cannot
    access storage of TensorWrapper"). (The compiled step's fused gradients read after the
    update: tests/test_compiled_fusion.py.)"""
    ens = vmapens.Ensemble(_old_weight_norm, 2, seeds=[0, 1])
    alone = _alone(_old_weight_norm, range(2))
    batches = float64_batches(2, 4, 3, 1)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-2), compile=True)
    for x, y in batches:
        step(x, y)
    train_each(alone, batches)
    assert_members_equal(ens, alone)


# -- load_state_dict ----------------------------------------------------------------------------


def _bn_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def _partial_state(source: dict) -> dict:
    state = {k: v for k, v in source.items() if k != "0.weight"}
    state["extra"] = torch.zeros(1)
    return state


def test_load_state_dict_not_strict_loads_the_keys_it_has_as_torch_does():
    """torch calls ``_load_from_state_dict`` with strict=True always and applies ``strict``
    after: the ensemble refused to load anything when a key was missing or unexpected, and
    ``strict=False`` reported success with nothing loaded."""
    ens, other = (vmapens.Ensemble(_bn_mlp, N, seed=s) for s in (0, 1))
    plain, plain_other = _bn_mlp(), _bn_mlp()
    kept = ens.stacked_params()["0.weight"].detach().clone()
    got = ens.load_state_dict(_partial_state(other.state_dict()), strict=False)
    want = plain.load_state_dict(_partial_state(plain_other.state_dict()), strict=False)
    assert (got.missing_keys, got.unexpected_keys) == (want.missing_keys, want.unexpected_keys)
    for key, value in other.state_dict().items():
        if key != "0.weight":
            torch.testing.assert_close(ens.state_dict()[key], value, rtol=0, atol=0)
    torch.testing.assert_close(ens.stacked_params()["0.weight"], kept, rtol=0, atol=0)


def test_load_state_dict_inside_a_parent_module_not_strict():
    class Outer(nn.Module):
        def __init__(self, seed: int) -> None:
            super().__init__()
            self.ens = vmapens.Ensemble(_bn_mlp, N, seed=seed)
            self.head = nn.Linear(2, 1)

    ours, theirs = Outer(0), Outer(1)
    state = {k: v for k, v in theirs.state_dict().items() if k != "ens.2.bias"}
    result = ours.load_state_dict(state, strict=False)
    assert result.missing_keys == ["ens.2.bias"] and not result.unexpected_keys
    torch.testing.assert_close(
        ours.ens.stacked_params()["0.weight"], theirs.ens.stacked_params()["0.weight"]
    )


def test_load_state_dict_strict_still_changes_nothing_when_a_key_is_missing():
    ens, other = (vmapens.Ensemble(_bn_mlp, N, seed=s) for s in (0, 1))
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"0.weight\""):
        ens.load_state_dict(_partial_state(other.state_dict()))
    torch.testing.assert_close(ens.state_dict(), before, rtol=0, atol=0)


def test_load_state_dict_assign_takes_the_state_dicts_tensors_as_torch_does():
    """``assign=True`` copied into the existing tensors: into an ensemble built on the meta
    device that copied nothing, and the load reported success."""
    source = vmapens.Ensemble(_bn_mlp, N, seed=0)
    with torch.device("meta"):
        ens = vmapens.Ensemble(_bn_mlp, N, seed=1)
        plain = _bn_mlp()
    plain.load_state_dict(source[0].state_dict(), assign=True)
    ens.load_state_dict(source.state_dict(), assign=True)
    assert {t.device for t in ens.state_dict().values()} == {plain[0].weight.device}
    assert all(isinstance(p, nn.Parameter) and p.requires_grad for p in ens.parameters())
    x = torch.randn(5, 3)
    torch.testing.assert_close(ens.eval()(x), source.eval()(x), rtol=0, atol=0)
    torch.testing.assert_close(ens[0](x), plain.eval()(x), rtol=0, atol=0)


def test_load_state_dict_assign_not_strict_keeps_the_tensors_it_does_not_load():
    ens, other = (vmapens.Ensemble(_bn_mlp, N, seed=s) for s in (0, 1))
    kept = ens.stacked_params()["0.weight"]
    state = other.state_dict()
    ens.load_state_dict(_partial_state(state), strict=False, assign=True)
    assert ens.stacked_params()["0.weight"] is kept
    assert ens.stacked_params()["0.bias"].data_ptr() == state["0.bias"].data_ptr()


# -- indexing -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("index", "rows"),
    [
        (np.array([3, 0]), [3, 0]),
        (np.argsort(np.array([0.3, 0.1, 0.2, 0.5]))[:2], [1, 2]),
        (np.array([True, False, True, False]), [0, 2]),
        (np.array([-1], dtype=np.int32), [3]),
    ],
    ids=["int64", "argsort", "bool-mask", "int32-negative"],
)
def test_numpy_arrays_select_members_as_torch_tensors_do(index, rows):
    """``ens[np.argsort(scores)[:k]]`` raised TypeError (a numpy array is no Sequence)."""
    ens = vmapens.Ensemble(_bn_mlp, 4, seed=0)
    models = ens.unstack()
    sub = ens[index]
    assert list(sub.member_ids) == rows
    for k, row in enumerate(rows):
        for key, value in models[row].state_dict().items():
            torch.testing.assert_close(sub[k].state_dict()[key], value, rtol=0, atol=0)


# -- parametrize.cached() -----------------------------------------------------------------------


def _orthogonal() -> nn.Module:
    layer = nn.utils.parametrizations.orthogonal(nn.Linear(3, 3, dtype=torch.float64))
    return nn.Sequential(layer, nn.Tanh(), nn.Linear(3, 1, dtype=torch.float64))


@pytest.mark.parametrize("backend", ["vmap", "loop"])
def test_parametrize_cached_gives_each_member_its_own_tensor(backend):
    """``parametrize.cached()`` caches by module, and members share theirs: with the loop
    backend every member ran with member 0's orthogonal weight, silently."""
    ens = vmapens.Ensemble(_orthogonal, N, seeds=list(range(N)), backend=backend)
    alone = _alone(_orthogonal)
    x = torch.randn(4, 3, dtype=torch.float64)
    with nn.utils.parametrize.cached():
        together = ens(x)
        want = torch.stack([m(x) for m in alone])
    torch.testing.assert_close(together, want, **TOL64)


def test_a_step_inside_parametrize_cached_trains_as_alone():
    """The self-check's plain member left its cached tensor under an id that the ensemble's
    module then had: "`...original` gets no gradient inside the ensemble"."""
    ens = vmapens.Ensemble(_orthogonal, N, seeds=list(range(N)))
    alone = _alone(_orthogonal)
    batches = float64_batches(1, 4, 3, 1)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-2))
    with nn.utils.parametrize.cached():
        step(*batches[0])
    for model in alone:
        with nn.utils.parametrize.cached():
            train_each([model], batches)
    assert_members_equal(ens, alone)


# -- building -----------------------------------------------------------------------------------


class _StateDictHook(nn.Module):
    """A module whose state_dict hook adds a key that is not one of its tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self._register_state_dict_hook(_add_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _add_scale(module: nn.Module, state: dict, prefix: str, metadata: dict) -> None:
    state[prefix + "scale"] = torch.tensor(2.0)


@pytest.mark.parametrize("api", ["Ensemble", "from_modules"])
def test_a_state_dict_key_that_is_no_tensor_of_the_member_is_refused_by_name(api):
    """It raised a bare KeyError (an id) while building."""
    assert "scale" in _StateDictHook().state_dict()  # plain torch keeps it
    rng = torch.get_rng_state()
    with pytest.raises(ValueError, match=r"state_dict holds `scale`.*register_buffer"):
        if api == "Ensemble":
            vmapens.Ensemble(_StateDictHook, N, seed=0)
        else:
            vmapens.Ensemble.from_modules([_StateDictHook() for _ in range(N)])
    if api == "Ensemble":
        assert torch.equal(torch.get_rng_state(), rng)


class _KeepsActivation(nn.Module):
    """Keeps its last hidden activation, as feature-extraction code does."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(3, 4, dtype=torch.float64)
        self.fc2 = nn.Linear(4, 1, dtype=torch.float64)
        self.hidden: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.hidden = torch.tanh(self.fc1(x))
        return self.fc2(self.hidden)


@pytest.mark.parametrize("backend", ["vmap", "loop"])
def test_a_forward_that_keeps_a_tensor_on_the_module_leaves_the_ensemble_usable(backend):
    """After one ``ens(x)`` the meta modules held a batched (vmap) or non-leaf (loop) tensor:
    ``ens[i]`` (loop), ``select``, ``copy.deepcopy`` and ``make_step``'s self-check raised."""
    ens = vmapens.Ensemble(_KeepsActivation, N, seeds=list(range(N)), backend=backend)
    alone = _alone(_KeepsActivation)
    x = torch.randn(5, 3, dtype=torch.float64)
    before = torch.stack([m(x) for m in alone])
    torch.testing.assert_close(ens(x), before, **TOL64)
    # member 0's own activation, detached, as member 0 alone holds after the same forward
    torch.testing.assert_close(ens[0].hidden, alone[0].hidden.detach(), **TOL64)
    torch.testing.assert_close(ens.select([2, 0])(x), before[[2, 0]], **TOL64)
    copied = copy.deepcopy(ens)
    batches = float64_batches(2, 5, 3, 1)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-2))
    for xb, yb in batches:
        step(xb, yb)
    train_each(alone, batches)
    assert_members_equal(ens, alone)
    torch.testing.assert_close(copied(x), before, **TOL64)  # the copy did not train


@pytest.mark.parametrize("grad", [True, False])
def test_a_kept_tensor_on_the_template_is_seen_not_followed(grad):
    """``ens(x)`` sets the stacked activation on ``ens.template`` (docs/semantics.md). That
    is not a value set there for every member: the runner keeps its own (nothing is copied to
    it), and the template's watch takes no new version (a compiled step would compile anew)."""
    ens = vmapens.Ensemble(_KeepsActivation, N, seeds=list(range(N)))
    alone = _alone(_KeepsActivation)
    x = torch.randn(5, 3, dtype=torch.float64)
    with torch.set_grad_enabled(grad):
        ens(x)
        version = ens._followers[4].version
        for _ in range(2):
            ens(x)
        assert ens._followers[4].version == version
        assert ens.runner.hidden is not ens.template.hidden
        want = torch.stack([m.fc1(x).tanh() for m in alone])
        torch.testing.assert_close(ens.template.hidden, want, **TOL64)
        # a copy takes a copy there (None for one with a graph, which alone deepcopy refuses:
        # session 46), and the original keeps its own
        copied = copy.deepcopy(ens).template.hidden
        if grad:
            assert copied is None
        else:
            assert copied is not ens.template.hidden
            torch.testing.assert_close(copied, want, **TOL64)
        torch.testing.assert_close(ens.template.hidden, want, **TOL64)


class _KeepsSome(nn.Module):
    """Keeps a constant every call, and its first activation once."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2, dtype=torch.float64)
        self.first: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc(x)
        if self.first is None:
            self.first = out
        self.const = torch.ones(2, dtype=torch.float64)  # made without the member's tensors
        return out


@pytest.mark.parametrize("how", [{}, {"chunk_size": 2}, {"backend": "loop"}])
def test_kept_tensors_are_stacked_every_call_and_turn(how):
    """docs/semantics.md: the tensors the members set are stacked on the template; a constant
    is one per member. `first` is set when `self.first is None`: with chunks or the loop every
    turn starts from the plain values the modules held before the call (None), so each member
    keeps its own, as alone."""
    ens = vmapens.Ensemble(_KeepsSome, N, seeds=list(range(N)), **how)
    alone = _alone(_KeepsSome)
    x = torch.randn(5, 3, dtype=torch.float64)
    for _ in range(2):  # the second call sets no `first`: the first call's stays, as alone
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in alone]), **TOL64)
        assert ens.template.const.shape == (N, 2)
        assert torch.equal(ens.template.const, torch.ones(N, 2, dtype=torch.float64))
        want = torch.stack([m.first for m in alone])
        torch.testing.assert_close(ens.template.first, want, **TOL64)
