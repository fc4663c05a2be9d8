"""Ensemble against the truth: N plain modules, each trained alone with torch.optim.Adam."""

from __future__ import annotations

import copy
import functools
import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import models
import pytest
import torch
from torch import nn
from truth import train_alone, twins

import vmapens

# One tolerance for every member-vs-twin comparison (float64 throughout).
TOL = dict(rtol=1e-9, atol=1e-10)
N = 5
STEPS = 6


@dataclass
class Case:
    id: str
    factory: Callable[[], nn.Module]
    inputs: Callable[[torch.Generator], torch.Tensor]
    per_member: bool = False  # each member gets its own slice of the batch (in_dims=0)
    backend: str = "vmap"


def floats(*shape):
    return lambda g: torch.randn(*shape, generator=g, dtype=torch.float64)


def tokens(*shape):
    return lambda g: torch.randint(0, 10, shape, generator=g)


CASES = [
    Case("mlp", models.MLP, floats(7, 4)),
    Case("mlp-per-member-inputs", models.MLP, floats(N, 7, 4), per_member=True),
    Case("cnn-batchnorm2d", models.CNN, floats(6, 1, 6, 6)),
    Case("cnn-batchnorm2d-per-member", models.CNN, floats(N, 6, 1, 6, 6), per_member=True),
    Case("embedding-layernorm", models.TokenModel, tokens(7, 5)),
    Case("tied-weights", models.Tied, tokens(7, 5)),
    Case("frozen-unused-zero-size", models.Awkward, floats(7, 4)),
    Case("transformer-encoder-layer", models.Encoder, floats(3, 5, 8)),
    Case("gru-loop-backend", models.Recurrent, floats(4, 6, 4), backend="loop"),
    Case("mlp-loop-backend", models.MLP, floats(N, 7, 4), per_member=True, backend="loop"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_trains_exactly_like_separate_models(case: Case):
    alone = [case.factory().double() for _ in range(N)]
    ens = vmapens.Ensemble.from_modules(twins(alone), backend=case.backend)
    g = torch.Generator().manual_seed(1)
    batches = [case.inputs(g) for _ in range(STEPS)]
    lead = (N,) if case.per_member else ()
    targets = [
        torch.randn(*lead, b.shape[int(case.per_member)], 3, generator=g, dtype=torch.float64)
        for b in batches
    ]

    opt = torch.optim.Adam(ens.parameters(), lr=1e-2)
    loss_fn = vmapens.per_member(
        nn.functional.mse_loss, in_dims=(0, 0 if case.per_member else None)
    )
    for x, y in zip(batches, targets):
        opt.zero_grad()
        loss_fn(ens(x, in_dims=0 if case.per_member else None), y).sum().backward()
        opt.step()

    for i, twin in enumerate(alone):
        own = [b[i] for b in batches] if case.per_member else batches
        own_y = [t[i] for t in targets] if case.per_member else targets
        train_alone(twin, list(zip(own, own_y, strict=True)))  # Adam, lr 1e-2, MSE
        torch.testing.assert_close(ens[i].state_dict(), twin.state_dict(), **TOL)
        torch.testing.assert_close(dict(ens[i].named_buffers()), dict(twin.named_buffers()), **TOL)


def test_tied_weights_stay_tied_and_frozen_stay_frozen():
    ens = vmapens.Ensemble(models.Tied, 3, seed=0)
    assert len(list(ens.parameters())) == 1  # emb/dec weight stored once
    member = ens[1]
    assert member.dec.weight is member.emb.weight
    awkward = vmapens.Ensemble(models.Awkward, 3, seed=0)
    assert not dict(awkward.named_parameters())["scale"].requires_grad
    assert not awkward[2].scale.requires_grad


@pytest.mark.parametrize("factory", [models.MLP, models.CNN, models.Tied], ids=lambda f: f.__name__)
def test_seed_rebuilds_any_member_alone(factory):
    before = torch.get_rng_state()
    ens = vmapens.Ensemble(factory, 4, seed=123)
    assert torch.equal(torch.get_rng_state(), before), "global RNG must be untouched"
    for i in range(4):
        torch.manual_seed(vmapens.seeds.member_seed(123, i))
        torch.testing.assert_close(ens[i].state_dict(), factory().state_dict(), rtol=0, atol=0)


def test_no_seed_draws_like_the_naive_loop():
    torch.manual_seed(7)
    ens = vmapens.Ensemble(models.MLP, 4)
    after_ens = torch.rand(3)
    torch.manual_seed(7)
    naive = [models.MLP() for _ in range(4)]
    assert torch.equal(torch.rand(3), after_ens), "RNG must advance as the naive loop's does"
    for i, m in enumerate(naive):
        torch.testing.assert_close(ens[i].state_dict(), m.state_dict(), rtol=0, atol=0)


def test_builds_one_member_at_a_time():
    alive: list[weakref.ref] = []

    def factory():
        assert sum(r() is not None for r in alive) == 0, "previous member still alive"
        m = models.MLP()
        alive.append(weakref.ref(m))
        return m

    ens = vmapens.Ensemble(factory, 5)
    assert all(r() is None for r in alive), "the Ensemble keeps no member module"
    assert all(t.device.type == "meta" for t in ens._template.state_dict().values())


def test_dropout_masks_differ_per_member_and_per_call():
    ens = vmapens.Ensemble(lambda: nn.Dropout(0.5), 4)
    x = torch.ones(64)
    first, second = ens(x), ens(x)
    assert first.shape == (4, 64)
    for i in range(4):
        for j in range(i):
            assert not torch.equal(first[i], first[j]), "members share a dropout mask"
        assert not torch.equal(first[i], second[i]), "a second call reused the mask"
    same = vmapens.Ensemble(lambda: nn.Dropout(0.5), 4, randomness="same")(x)
    assert all(torch.equal(same[0], same[i]) for i in range(4))


def test_train_eval_switch_all_members():
    ens = vmapens.Ensemble(models.CNN, 3, seed=0).double()
    x = torch.randn(5, 1, 6, 6, dtype=torch.float64)
    ens(x)  # update running statistics
    ens.eval()
    assert not ens.training and not ens._template.bn.training
    out = ens(x)
    for i in range(3):
        member = ens[i]
        assert not member.training
        torch.testing.assert_close(out[i], member(x), **TOL)


def test_round_trips():
    ens = vmapens.Ensemble(models.CNN, 4, seed=0)
    ens(torch.randn(5, 1, 6, 6))
    again = vmapens.Ensemble.from_modules(ens.unstack())
    torch.testing.assert_close(again.state_dict(), ens.state_dict(), rtol=0, atol=0)
    fresh = vmapens.Ensemble(models.CNN, 4, seed=99)
    fresh.load_state_dict(ens.state_dict())
    torch.testing.assert_close(fresh.state_dict(), ens.state_dict(), rtol=0, atol=0)
    assert list(ens.state_dict()) == list(models.CNN().state_dict()), "keys are the member's own"
    for sd in ens.state_dicts():
        models.CNN().load_state_dict(sd, strict=True)


def test_tied_state_dict_keys_match_member():
    ens = vmapens.Ensemble(models.Tied, 3, seed=0)
    assert list(ens.state_dict()) == list(models.Tied().state_dict())
    for sd in ens.state_dicts():
        models.Tied().load_state_dict(sd, strict=True)
    copy_ = vmapens.Ensemble(models.Tied, 3, seed=5)
    copy_.load_state_dict(ens.state_dict())
    torch.testing.assert_close(copy_.state_dict(), ens.state_dict(), rtol=0, atol=0)


def test_member_is_independent_of_storage():
    ens = vmapens.Ensemble(models.MLP, 3, seed=0)
    before = copy.deepcopy(ens.state_dict())
    member = ens[0]
    with torch.no_grad():
        member.fc1.weight.add_(1.0)
    torch.testing.assert_close(ens.state_dict(), before, rtol=0, atol=0)
    assert ens[-1].fc1.weight.shape == (8, 4)


def test_to_and_double_behave_as_for_any_module():
    ens = vmapens.Ensemble(models.MLP, 3, seed=0)
    ens.double()
    assert all(p.dtype == torch.float64 and p.is_leaf for p in ens.parameters())
    assert ens[0].fc1.weight.dtype == torch.float64
    ens.to(torch.float32)
    assert ens(torch.randn(2, 4)).dtype == torch.float32


def test_chunk_size_gives_the_same_outputs():
    x = torch.randn(3, 4)
    full = vmapens.Ensemble(models.MLP, 7, seed=0)(x)
    chunked = vmapens.Ensemble(models.MLP, 7, seed=0, chunk_size=3)(x)
    torch.testing.assert_close(chunked, full)


def test_output_pytree_gains_member_dim():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x, *, scale=1.0):
            y = self.fc(x)
            return {"y": y * scale, "pair": (y.sum(-1), y.mean())}

    out = vmapens.Ensemble(TwoHeads, 5, seed=0)(torch.randn(3, 4), scale=2.0)
    assert out["y"].shape == (5, 3, 2)
    assert out["pair"][0].shape == (5, 3) and out["pair"][1].shape == (5,)


def test_len_iter_and_unstack_types():
    ens = vmapens.Ensemble(functools.partial(models.MLP, 4, 16), 6, seed=0)
    assert len(ens) == 6
    assert [type(m) for m in ens.unstack()] == [models.MLP] * 6
    assert ens.unstack()[2].fc1.weight.shape == (16, 4)


# -- bad input: a clear error, and nothing changed ---------------------------------------------

BUILD_ERRORS = [
    (
        "n-zero",
        lambda: vmapens.Ensemble(models.MLP, 0),
        ValueError,
        r"^Ensemble: `n` must be >= 1, got 0",
    ),
    ("n-float", lambda: vmapens.Ensemble(models.MLP, 2.0), TypeError, r"`n` must be an int"),
    (
        "factory-is-instance",
        lambda: vmapens.Ensemble(models.MLP(), 2),
        TypeError,
        r"`factory` must build a new member on each call, got an instance of MLP",
    ),
    (
        "factory-not-callable",
        lambda: vmapens.Ensemble(3, 2),
        TypeError,
        r"`factory` must be a zero-arg",
    ),
    (
        "factory-not-module",
        lambda: vmapens.Ensemble(lambda: torch.zeros(2), 2),
        TypeError,
        r"`factory` must return an nn.Module, but member 0 is Tensor",
    ),
    (
        "lazy-module",
        lambda: vmapens.Ensemble(lambda: nn.LazyLinear(3), 2),
        ValueError,
        r"uninitialised lazy tensor `weight`",
    ),
    (
        "bad-backend",
        lambda: vmapens.Ensemble(models.MLP, 2, backend="jit"),
        ValueError,
        r"`backend`",
    ),
    (
        "bad-randomness",
        lambda: vmapens.Ensemble(models.MLP, 2, randomness="x"),
        ValueError,
        r"`randomness`",
    ),
    (
        "differ-shape",
        lambda: vmapens.Ensemble.from_modules([models.MLP(), models.MLP(hidden=9)]),
        ValueError,
        r"member 1 differs from member 0 at `fc1.weight`: shape .*Ensemble\.from_factories\(",
    ),
    (
        "differ-class",
        lambda: vmapens.Ensemble.from_modules([models.MLP(), models.CNN()]),
        ValueError,
        r"member 1 is a CNN, member 0 is a MLP",
    ),
    (
        "differ-dtype",
        lambda: vmapens.Ensemble.from_modules([models.MLP(), models.MLP().double()]),
        ValueError,
        r"member 1 differs from member 0 at `fc1.weight`: dtype",
    ),
    (
        "differ-requires-grad",
        lambda: vmapens.Ensemble.from_modules([models.MLP(), models.MLP().requires_grad_(False)]),
        ValueError,
        r"at `fc1.weight`: requires_grad",
    ),
    (
        "differ-keys",
        lambda: vmapens.Ensemble.from_modules([nn.Linear(2, 2), nn.Linear(2, 2, bias=False)]),
        ValueError,
        r"member 1 lacks tensor `bias`",
    ),
    (
        "empty",
        lambda: vmapens.Ensemble.from_modules([]),
        ValueError,
        r"`modules` must not be empty",
    ),
    (
        "not-a-list",
        lambda: vmapens.Ensemble.from_modules(models.MLP()),
        TypeError,
        r"`modules` must be",
    ),
]


@pytest.mark.parametrize(
    "build,exc,match", [c[1:] for c in BUILD_ERRORS], ids=[c[0] for c in BUILD_ERRORS]
)
def test_bad_construction_raises_clearly(build, exc, match):
    with pytest.raises(exc, match=match):
        build()


def test_failed_build_leaves_rng_untouched():
    calls = []

    def factory():
        calls.append(1)
        return models.MLP() if len(calls) < 3 else "oops"

    before = torch.get_rng_state()
    with pytest.raises(TypeError, match="member 2 is str"):
        vmapens.Ensemble(factory, 4)
    assert torch.equal(torch.get_rng_state(), before)


CALL_ERRORS = [
    ("item", models.UsesItem, {}, RuntimeError, r"cannot be batched.*\.item\(\).*backend='loop'"),
    (
        "data-dependent-branch",
        models.DataDependent,
        {},
        RuntimeError,
        r"cannot be batched.*data-dependent control flow.*backend='loop'",
    ),
    (
        "per-member-size",
        models.MLP,
        {"in_dims": 0},
        ValueError,
        r"argument 0 is mapped with in_dims=0 but has size 6.*expected 4, one slice per member",
    ),
    ("in-dims-length", models.MLP, {"in_dims": (0, None)}, ValueError, r"`in_dims` must be"),
]


@pytest.mark.parametrize(
    "factory,kw,exc,match", [c[1:] for c in CALL_ERRORS], ids=[c[0] for c in CALL_ERRORS]
)
def test_bad_call_raises_clearly_and_changes_nothing(factory, kw, exc, match):
    ens = vmapens.Ensemble(factory, 4, seed=0)
    before = copy.deepcopy(ens.state_dict())
    with pytest.raises(exc, match=match):
        ens(torch.randn(6, 4), **kw)
    # BatchNorm ran (and updated its statistics) before the failing op: all restored.
    torch.testing.assert_close(ens.state_dict(), before, rtol=0, atol=0)


def test_loop_backend_runs_what_vmap_cannot():
    ens = vmapens.Ensemble(models.DataDependent, 3, seed=0, backend="loop")
    x = torch.randn(6, 4)
    out = ens(x)
    ref = [
        m(x) for m in vmapens.Ensemble(models.DataDependent, 3, seed=0, backend="loop").unstack()
    ]
    torch.testing.assert_close(out, torch.stack(ref))


def test_bad_state_dict_changes_nothing():
    ens = vmapens.Ensemble(models.MLP, 3, seed=0)
    before = copy.deepcopy(ens.state_dict())
    wrong = vmapens.Ensemble(models.MLP, 4, seed=1).state_dict()
    with pytest.raises(RuntimeError, match=re.escape("size mismatch for fc1.weight")):
        ens.load_state_dict(wrong)
    partial = {k: v + 1 for k, v in before.items() if k != "fc2.bias"}
    with pytest.raises(RuntimeError, match="Missing key"):
        ens.load_state_dict(partial)
    torch.testing.assert_close(ens.state_dict(), before, rtol=0, atol=0)


@pytest.mark.parametrize(
    "index",
    [slice(None, None, -1), slice(None, None, -2), slice(3, 0, -1), slice(1, None, 2)],
    ids=["reversed", "step-minus-2", "3-down-to-1", "odd"],
)
def test_slices_pick_the_members_a_list_slice_picks(index):
    # Truth: Python's own slicing of the member list, as nn.Sequential's slicing follows it.
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 2), n=5, seed=0)
    alone = ens.unstack()[index]
    picked = ens[index]
    assert len(picked) == len(alone)
    for k, module in enumerate(alone):
        for name, value in module.state_dict().items():
            assert torch.equal(picked[k].state_dict()[name], value), (k, name)


def _conv_member() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(144, 2))


def test_memory_format_lays_out_each_member_as_torch_lays_out_it_alone():
    # Truth: each member alone after torch's own .to(memory_format=...). The stacked conv
    # weight is 5-D: torch's Module.to would give it the 2-D format and raise.
    ens = vmapens.Ensemble(_conv_member, 3, seed=0).double()
    alone = [m.to(memory_format=torch.channels_last) for m in ens.unstack()]
    assert ens.to(memory_format=torch.channels_last) is ens
    x = torch.randn(5, 3, 8, 8, dtype=torch.float64).to(memory_format=torch.channels_last)
    out = ens(x)
    for i, m in enumerate(alone):
        weight = ens[i].state_dict()["0.weight"]
        assert weight.is_contiguous(memory_format=torch.channels_last), i
        assert weight.stride() == m[0].weight.stride(), i
        torch.testing.assert_close(out[i], m(x), rtol=1e-12, atol=1e-12)
    ens.to(memory_format=torch.contiguous_format)
    assert ens.stacked_params()["0.weight"].is_contiguous()


def test_memory_format_torch_refuses_for_a_member_is_refused_and_changes_nothing():
    with pytest.raises(RuntimeError, match="required rank 5"):
        _conv_member().to(memory_format=torch.channels_last_3d)  # torch alone refuses
    ens = vmapens.Ensemble(_conv_member, 3, seed=0)
    strides = {k: v.stride() for k, v in ens.stacked_state().items()}
    with pytest.raises(RuntimeError, match="required rank 5"):
        ens.to(torch.float64, memory_format=torch.channels_last_3d)
    assert {k: v.stride() for k, v in ens.stacked_state().items()} == strides
    assert all(v.dtype != torch.float64 for v in ens.stacked_state().values())


def test_the_hint_for_members_of_different_sizes_builds_them_padded():
    # The error for from_modules with members of two widths names a call; it must work and
    # hold the very members given, each computing as alone.
    modules = [models.MLP(), models.MLP(hidden=9)]
    with pytest.raises(ValueError, match=r"from_factories\(\[lambda m=m: m for m in modules\]\)"):
        vmapens.Ensemble.from_modules(modules)
    ens = vmapens.Ensemble.from_factories([lambda m=m: m for m in modules])
    x = torch.randn(5, 4)
    out = ens(x)
    for i, m in enumerate(modules):
        for key, value in m.state_dict().items():
            torch.testing.assert_close(ens[i].state_dict()[key], value, rtol=0, atol=0)
        torch.testing.assert_close(out[i], m(x))
