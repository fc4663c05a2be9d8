"""The eager member call (vmapens._fastcall) against torch.func itself: same results, same errors.

``vmap_members`` and ``call_member`` skip the per-call Python of ``torch.func.vmap`` and
``torch.func.functional_call``; the truth here is those two functions, called on the same inputs.
"""

from __future__ import annotations

import models
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, stack_module_state, vmap
from torch.nn.utils import parametrize
from truth import assert_members_equal, train_each, twins

from vmapens import Ensemble, StackedAdam, make_step
from vmapens._fastcall import call_member, vmap_members

N = 4


def _stacked(factory, n=N):
    torch.manual_seed(0)
    members = [factory() for _ in range(n)]
    params, buffers = stack_module_state(members)
    return members, {**params, **buffers}, factory().to("meta")


def _both(fn, state, args, in_dims, randomness="error"):
    """(vmapens, torch.func) outputs of the same call, from the same RNG state."""
    torch.manual_seed(1)
    ours = vmap_members(fn, N, randomness, state, args, in_dims)
    torch.manual_seed(1)
    theirs = vmap(fn, in_dims=(0, *in_dims), randomness=randomness)(state, *args)
    return ours, theirs


class Pair(nn.Module):
    """Two outputs in a dict, one of them not depending on the input."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict:
        return {"out": self.lin(x) * y.sum(), "w": (self.lin.weight.sum(), torch.ones(2))}


@pytest.mark.parametrize("in_dims", [(None, None), (0, None), (1, 0), (-2, -1)])
def test_vmap_members_equals_vmap(in_dims):
    _, state, meta = _stacked(Pair)
    x = torch.randn(N, N, 3) if in_dims[0] is not None else torch.randn(5, 3)
    y = torch.randn(N) if in_dims[1] is not None else torch.randn(7)

    def fn(s, x, y):
        return functional_call(meta, s, (x, y))

    ours, theirs = _both(fn, state, (x, y), in_dims)
    assert ours.keys() == theirs.keys()
    torch.testing.assert_close(ours["out"], theirs["out"], rtol=0, atol=0)
    for a, b in zip(ours["w"], theirs["w"], strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("randomness", ["different", "same"])
def test_vmap_members_draws_as_vmap(randomness):
    _, state, meta = _stacked(lambda: nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.5)))
    x = torch.randn(6, 3)
    ours, theirs = _both(
        lambda s, x: functional_call(meta, s, (x,)), state, (x,), (None,), randomness
    )
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert (ours == 0).any()  # dropout did draw


def test_vmap_members_tuple_argument_mapped():
    _, state, meta = _stacked(lambda: nn.Linear(3, 2))
    args = ((torch.randn(N, 5, 3), torch.randn(N, 5, 2)),)

    def fn(s, pair):
        return F.mse_loss(functional_call(meta, s, (pair[0],)), pair[1])

    ours, theirs = _both(fn, state, args, (0,))
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@pytest.mark.parametrize(
    "args, in_dims",
    [
        (([1.0, 2.0],), (0,)),  # a mapped argument that is not a tensor
        ((torch.randn(N + 1, 3),), (0,)),  # a mapped size that is not n
        ((torch.randn(N, 3),), (2,)),  # no such dim
    ],
)
def test_vmap_members_errors_are_torch_func_errors(args, in_dims):
    _, state, meta = _stacked(lambda: nn.Linear(3, 2))

    def fn(s, x):
        return functional_call(meta, s, (x,))

    with pytest.raises(ValueError) as theirs:
        vmap(fn, in_dims=(0, *in_dims))(state, *args)
    with pytest.raises(ValueError) as ours:
        vmap_members(fn, N, "error", state, args, in_dims)
    assert str(ours.value) == str(theirs.value)


def test_vmap_members_non_tensor_output_is_refused_as_torch_func_does():
    _, state, meta = _stacked(lambda: nn.Linear(3, 2))

    def fn(s, x):
        return functional_call(meta, s, (x,)), "label"

    with pytest.raises(ValueError, match="must only return Tensors"):
        vmap_members(fn, N, "error", state, (torch.randn(3),), (None,))


def test_vmap_members_leaves_no_vmap_level_after_an_error():
    _, state, _ = _stacked(lambda: nn.Linear(3, 2))

    def fails(s, x):
        raise KeyError("inside")

    with pytest.raises(KeyError):
        vmap_members(fails, N, "error", state, (torch.randn(3),), (None,))
    # An unbalanced level would make this plain tensor look batched (or vmap fail).
    out = vmap(lambda t: t * 2)(torch.ones(3))
    torch.testing.assert_close(out, torch.full((3,), 2.0))


class Reassigns(nn.Module):
    """Reassigns a buffer in its forward: functional_call writes the new tensor to the dict."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("seen", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = self.seen + x.detach().sum(0)
        return self.lin(x)


def _weight_normed() -> nn.Module:
    lin = nn.Linear(3, 2)
    parametrize.register_parametrization(lin, "weight", _Scale())
    return lin


class _Scale(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w / w.norm()


@pytest.mark.parametrize(
    "factory, inputs",
    [
        (models.Tied, lambda: torch.tensor([[0, 3, 4], [9, 1, 1]])),
        (Reassigns, lambda: torch.randn(4, 3)),
        (_weight_normed, lambda: torch.randn(4, 3)),
        (
            lambda: nn.Sequential(nn.Conv1d(2, 3, 3), nn.BatchNorm1d(3)),
            lambda: torch.randn(2, 2, 6),
        ),
    ],
    ids=["tied", "reassigns", "parametrized", "batchnorm"],
)
def test_call_member_equals_functional_call(factory, inputs):
    torch.manual_seed(0)
    module, x = factory(), inputs()
    own = dict(module.state_dict(keep_vars=True))
    # Tied: only one of the two names is given, so the other must follow it.
    state = {k: v.detach() + 0.5 for k, v in own.items() if k != "dec.weight"}
    state_theirs = {k: v.clone() for k, v in state.items()}
    ours = call_member(module, state, (x,))
    theirs = functional_call(module, state_theirs, (x,))
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert state.keys() == state_theirs.keys()
    for k in state:  # reassigned/updated buffers reach the dict alike
        torch.testing.assert_close(state[k], state_theirs[k], rtol=0, atol=0)
    for k, v in module.state_dict(keep_vars=True).items():  # the module's own tensors are back
        assert v is own[k], k


def test_call_member_two_values_for_one_tied_tensor_is_functional_calls_error():
    module = models.Tied()
    state = {"emb.weight": torch.randn(10, 6), "dec.weight": torch.randn(10, 6)}
    with pytest.raises(ValueError, match="tied"):
        call_member(module, state, (torch.tensor([[1]]),))


def test_call_member_puts_tensors_back_after_an_error():
    module = nn.Linear(3, 2)
    weight = module.weight
    with pytest.raises(RuntimeError):
        call_member(module, {"weight": torch.randn(2, 4)}, (torch.randn(1, 3),))
    assert module.weight is weight


def test_step_on_tied_weights_equals_members_trained_alone():
    """End to end: the eager step (both fast paths) on a tied model, against plain modules."""
    ens = Ensemble(models.Tied, 3, seed=0).double()
    alone = twins(ens.unstack())
    step = make_step(ens, nn.CrossEntropyLoss(), StackedAdam(ens, lr=0.1))
    batches = [(torch.tensor([[0, 1, 4], [7, 2, 9]]), torch.tensor([2, 0]))] * 3
    for x, y in batches:
        step(x, y)
    train_each(
        alone, batches, F.cross_entropy, lambda i, m: torch.optim.Adam(m.parameters(), lr=0.1)
    )
    assert_members_equal(ens, alone)


# -- the fast path inside the user's own transforms ------------------------------------------


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))


def test_jacobian_through_the_ensemble_equals_each_member_alone():
    ens = Ensemble(_mlp, 3, seed=0).double()
    alone = ens.unstack()
    x = torch.randn(4, 3, dtype=torch.float64)
    ours = torch.func.jacrev(lambda x: ens(x).sum())(x)
    truth = sum(torch.func.jacrev(lambda x, m=m: m(x).sum())(x) for m in alone)
    torch.testing.assert_close(ours, truth, rtol=0, atol=1e-12)


def test_ensemble_under_an_outer_vmap_equals_each_member_alone():
    ens = Ensemble(_mlp, 3, seed=0).double()
    alone = ens.unstack()
    xs = torch.randn(5, 4, 3, dtype=torch.float64)  # 5 outer batches
    ours = vmap(lambda x: ens(x))(xs)  # [5, n, 4, 2]
    truth = torch.stack([torch.stack([m(x) for m in alone]) for x in xs])
    torch.testing.assert_close(ours, truth, rtol=0, atol=1e-12)


# dynamo's resume function after the graph break reads `.grad` of a non-leaf output (torch's
# own warning, raised while tracing, with or without the fast path).
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_ensemble_in_a_users_compiled_function_equals_eager():
    ens = Ensemble(_mlp, 3, seed=0).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    # Not fullgraph: the call's guard (a lock, buffers given back on error) breaks the graph.
    # backend="eager": dynamo's tracing is what takes the torch.func path; inductor adds time.
    compiled = torch.compile(lambda x: ens(x).tanh(), backend="eager")
    torch.testing.assert_close(compiled(x), ens(x).tanh(), rtol=0, atol=1e-12)


class _KeepsNorm(nn.Module):
    """Keeps a tensor its forward computed (``self.norm``), as a KL or aux loss is kept."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.norm = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        self.norm = y.square().sum()
        return y


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_a_users_compiled_function_runs_the_ensemble_as_eager(monkeypatch):
    # Traced by dynamo, the call lost what the forward kept (`ens.template.norm` was None),
    # and CI failed once: dynamo guarded a cache of runners by key position, and runners
    # collected between tracing and building the guards made building them fail (IndexError).
    import gc

    from torch._dynamo.guards import CheckFunctionManager

    others = [Ensemble(_mlp, 2, seed=i) for i in range(20)]
    for other in others:
        other(torch.randn(4, 3))
    build = CheckFunctionManager.__init__

    def collect_then_build(self, *args, **kwargs):
        others.clear()
        gc.collect()
        build(self, *args, **kwargs)

    monkeypatch.setattr(CheckFunctionManager, "__init__", collect_then_build)
    ens = Ensemble(_KeepsNorm, 3, seed=0).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    compiled = torch.compile(lambda x: ens(x).tanh(), backend="eager")
    out = compiled(x)
    norm = ens.template.norm  # the forward's kept tensor, one row per member, as eager keeps it
    torch.testing.assert_close(out, ens(x).tanh(), rtol=0, atol=1e-12)
    assert not others
    members = [ens[i] for i in range(3)]
    alone = torch.stack([m.lin(x).square().sum() for m in members])
    torch.testing.assert_close(norm, alone, rtol=0, atol=1e-12)


def test_a_users_fullgraph_compile_around_the_ensemble_is_refused_naming_the_compiled_step():
    # The ensemble's call runs as eager under a user's torch.compile, which fullgraph=True
    # cannot hold: dynamo's error shows vmapens's line, which names the compiled path.
    ens = Ensemble(_mlp, 3, seed=0)
    x = torch.randn(4, 3)
    compiled = torch.compile(lambda x: ens(x), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=r"ens\(x\) runs eager: make_step\(compile=True\)"):
        compiled(x)
