"""Container and inference calls found wrong by a hunt, each against plain torch.

The truth is the list of plain modules the ensemble stands for (``truth.seeded_members``), or
plain torch's own behaviour on the same call (``nn.Sequential`` indexing,
``torch.func.stack_module_state`` inputs, losses called on each member's slice).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from truth import TOL64, assert_members_equal, seeded_members

import vmapens
from vmapens.predict import reduce_members


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2)).double()


def test_from_modules_takes_a_module_list_as_torch_func_does() -> None:
    members = seeded_members(mlp, 3)
    held = nn.ModuleList(members)
    torch.func.stack_module_state(held)  # the torch recipe vmapens builds on takes one
    ens = vmapens.Ensemble.from_modules(held)
    assert_members_equal(ens, members)
    x = torch.randn(5, 3, dtype=torch.float64)
    out = ens(x)
    for i, m in enumerate(members):
        torch.testing.assert_close(out[i], m(x), **TOL64)


def test_a_sequential_of_members_is_still_refused_by_name() -> None:
    with pytest.raises(TypeError, match=r"`modules` must be a sequence .*ModuleList.*Sequential"):
        vmapens.Ensemble.from_modules(nn.Sequential(*seeded_members(mlp, 2)))


@pytest.mark.parametrize("index", [np.array(1), np.array(-1), np.array(2, dtype=np.int32)])
def test_a_0d_numpy_array_indexes_one_member_as_in_nn_sequential(index: np.ndarray) -> None:
    members = seeded_members(mlp, 3)
    ens = vmapens.Ensemble.from_modules(members)
    want = nn.Sequential(*members)[index]  # plain torch takes it as an int
    got = ens[index]
    assert type(got) is type(want)
    for key, value in want.state_dict().items():
        torch.testing.assert_close(got.state_dict()[key], value, rtol=0, atol=0)


def test_assigning_a_member_is_refused_with_a_recipe_that_works() -> None:
    members = seeded_members(mlp, 3)
    ens = vmapens.Ensemble.from_modules(members)
    torch.manual_seed(99)
    other = mlp()
    before = ens.state_dict()
    before = {k: v.clone() for k, v in before.items()}
    with pytest.raises(TypeError, match=r"cannot be assigned .*sd\[k\]\[i\]\.copy_\(v\)"):
        ens[1] = other
    for key, value in ens.state_dict().items():  # refused: nothing changed
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)
    sd = ens.state_dict()  # the recipe the message gives
    with torch.no_grad():
        for k, v in other.state_dict().items():
            sd[k][1].copy_(v)
    assert_members_equal(ens, [members[0], other, members[2]], rtol=0, atol=0)


def test_per_member_in_dims_of_another_length_than_the_arguments_is_named() -> None:
    n, rows = 3, 5
    mean = torch.randn(n, rows, 2, dtype=torch.float64)
    target = torch.randn(rows, 2, dtype=torch.float64)
    var = torch.rand(rows, 2, dtype=torch.float64) + 0.1
    loss_fn = nn.GaussianNLLLoss()
    with pytest.raises(ValueError, match=r"per_member: `in_dims` has 2 entries.* called with 3"):
        vmapens.per_member(loss_fn)(mean, target, var)
    # the call the message suggests gives each member's own loss
    got = vmapens.per_member(loss_fn, in_dims=(0, None, None))(mean, target, var)
    want = torch.stack([loss_fn(mean[i], target, var) for i in range(n)])
    torch.testing.assert_close(got, want, **TOL64)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_disagreement_of_hundreds_of_low_precision_members_is_the_fraction_of_pairs(
    dtype: torch.dtype,
) -> None:
    n = 300  # past 256 members, a float16 pair count (256 * 255) overflows
    ens = vmapens.Ensemble(lambda: nn.Linear(2, 3), n=n, seed=0).to(dtype)
    g = torch.Generator().manual_seed(0)
    weight = torch.randint(-3, 4, (n, 3, 2), generator=g)
    weight[10:, 0] = 3  # most members vote class 0 on positive inputs: the pair count is large
    with torch.no_grad():  # small integers: every sum exact, so no kernel can flip a label
        ens.stacked_params()["weight"].copy_(weight)
        ens.stacked_params()["bias"].zero_()
    x = torch.randint(1, 4, (6, 2), generator=g).to(dtype)
    got = vmapens.predict(ens, x, reduce="disagreement")
    # each member's labels, exact in float64 (plain float16 Linears take seconds on CPU)
    labels = torch.einsum("ncf,sf->nsc", weight.double(), x.double()).argmax(-1)  # [n, samples]
    differ = (labels[:, None, :] != labels[None, :, :]).sum((0, 1)).double()
    want = differ / (n * (n - 1))
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, rtol=torch.finfo(dtype).eps, atol=0)


@pytest.mark.parametrize("reduce", ["vote", "disagreement", "entropy", "mutual_information"])
@pytest.mark.parametrize("softmax", [False, True])
def test_a_class_reduction_of_one_output_column_is_refused_with_a_recipe_that_works(
    reduce: str, softmax: bool
) -> None:
    # The README's member: one sigmoid probability per sample. Its vote and disagreement were
    # 0 for every sample, and softmax=True (what the entropy's refusal advised) gave entropy 0.
    def member() -> nn.Module:
        return nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1), nn.Sigmoid()).double()

    n = 5
    members = seeded_members(member, n)
    ens = vmapens.Ensemble.from_modules(members)
    x = torch.randn(7, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match=rf"`reduce='{reduce}'` .* one class.*torch\.cat"):
        vmapens.predict(ens, x, reduce=reduce, softmax=softmax)
    # the recipe the message gives, against the members alone
    p = vmapens.predict(ens, x)
    got = reduce_members(torch.cat([1 - p, p], -1), reduce)
    with torch.no_grad():
        alone = torch.stack([m.eval()(x)[:, 0] for m in members])  # [n, samples]: P(class 1)
    ones = (alone > 0.5).sum(0)
    mean = alone.mean(0)

    def entropy(q: torch.Tensor) -> torch.Tensor:
        return -(q * q.log() + (1 - q) * (1 - q).log())

    want = {
        "vote": (ones > n - ones).long(),  # ties go to class 0
        "disagreement": (2 * ones * (n - ones)).double() / (n * (n - 1)),
        "entropy": entropy(mean),
        "mutual_information": entropy(mean) - entropy(alone).mean(0),
    }[reduce]
    torch.testing.assert_close(got, want.to(got.dtype), **TOL64)


def test_members_wrapped_by_torch_compile_are_refused_naming_the_module_they_wrap() -> None:
    # They were refused as members that "differ" at `_torchdynamo_wrapper_id`.
    members = seeded_members(mlp, 2)
    wrapped = [torch.compile(m) for m in members]  # nothing compiles until a call
    with pytest.raises(ValueError, match=r"member 0 is wrapped by torch\.compile.*`_orig_mod`"):
        vmapens.Ensemble.from_modules(wrapped)
    with pytest.raises(ValueError, match=r"member 0 is wrapped by torch\.compile"):
        vmapens.Ensemble(lambda: torch.compile(mlp()), 2, seed=0)
    ens = vmapens.Ensemble.from_modules([w._orig_mod for w in wrapped])  # the way out
    assert_members_equal(ens, members, rtol=0, atol=0)


def test_predict_refuses_a_dataset_of_single_samples_and_takes_its_data_loader() -> None:
    # Each item ran as a batch without a sample dim: a member [4 -> 4] gave a mean of shape
    # [40] for 10 samples, silently.
    members = seeded_members(lambda: nn.Linear(4, 4).double(), 3)
    ens = vmapens.Ensemble.from_modules(members)
    x = torch.randn(10, 4, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"`data` is a TensorDataset.*DataLoader\(data"):
        vmapens.predict(ens, TensorDataset(x), reduce="mean")
    got = vmapens.predict(ens, DataLoader(TensorDataset(x), batch_size=3), reduce="mean")
    with torch.no_grad():
        want = torch.stack([m(x) for m in members]).mean(0)
    torch.testing.assert_close(got, want, **TOL64)


def test_in_dims_with_keyword_inputs_only_is_refused_before_running() -> None:
    # Keyword inputs are shared: each member ran on every member's slice ([n, n, ...]).
    class Member(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 2, dtype=torch.float64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)

    members = seeded_members(Member, 3)
    ens = vmapens.Ensemble.from_modules(members)
    xs = torch.randn(3, 5, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"`in_dims` \(0\) maps positional inputs only.*\(x\)"):
        ens(x=xs, in_dims=0)
    out = ens(xs, in_dims=0)  # the way out
    for i, m in enumerate(members):
        torch.testing.assert_close(out[i], m(x=xs[i]), **TOL64)
