"""What a user does in the first hour either works exactly or fails loudly (issue 10).

Each case compares with the independent truth, N plain modules trained alone with
``torch.optim`` in the same order of calls, or asserts a clear error and that nothing changed.
"""

from __future__ import annotations

import copy
import warnings

import models
import numpy as np
import pytest
import torch
import truth
from torch import nn

import vmapens

TOL64 = dict(rtol=1e-12, atol=1e-14)
N = 4


# -- 1. the optimizer is built before .double() / .to(): state follows the parameters ------


@pytest.mark.parametrize("cast", ["double", "to_float64"])
def test_optimizer_before_cast_steps_in_the_new_dtype(cast):
    ens = vmapens.Ensemble(models.MLP, N, seed=0)
    opt = vmapens.StackedAdam(ens, lr=1e-2)
    ens.double() if cast == "double" else ens.to(torch.float64)
    twins = truth.twins(
        ens.unstack()
    )  # float64 members, each with a plain Adam built after the cast
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    step = vmapens.make_step(ens, nn.MSELoss(), opt)
    for _ in range(5):
        step(x, y)
    truth.train_each(twins, [(x, y)] * 5)  # Adam, lr 1e-2
    for member, twin in zip(ens.unstack(), twins, strict=True):
        torch.testing.assert_close(member.state_dict(), twin.state_dict(), **TOL64)
    assert all(s["exp_avg"].dtype == torch.float64 for s in opt.state.values())


def test_cast_after_steps_moves_the_state_too():
    ens = vmapens.Ensemble(models.MLP, N, seed=0)
    opt = vmapens.StackedAdam(ens, lr=1e-2)
    step = vmapens.make_step(ens, nn.MSELoss(), opt)
    step(torch.randn(6, 4), torch.randn(6, 3))
    ens.double()
    step(torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64))
    for state in opt.state.values():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float64


# -- 2. an optimizer of another ensemble is refused on every step path ---------------------


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_optimizer_of_another_ensemble_is_refused(compile):
    a, b = vmapens.Ensemble(models.MLP, N, seed=0), vmapens.Ensemble(models.MLP, N, seed=1)
    before = copy.deepcopy(a.state_dict())
    match = r"make_step: `optimizer` parameter 0 .* is not a parameter of this ensemble"
    with pytest.raises(ValueError, match=match):
        vmapens.make_step(a, nn.MSELoss(), vmapens.StackedAdam(b), compile=compile)
    with pytest.raises(ValueError, match=r"fit: `optimizer` parameter 0"):
        vmapens.fit(a, (torch.randn(8, 4), torch.randn(8, 3)), nn.MSELoss(),
                    optimizer=vmapens.StackedAdam(b), progress=False)  # fmt: skip
    torch.testing.assert_close(a.state_dict(), before, rtol=0, atol=0)


# -- 3. seeds: no overlap between ensembles, explicit per-member seeds ---------------------


def test_different_seeds_share_no_member():
    a = vmapens.Ensemble(models.MLP, 16, seed=0).state_dicts()
    b = vmapens.Ensemble(models.MLP, 16, seed=1).state_dicts()
    firsts = {tuple(sd["fc1.weight"].flatten()[:4].tolist()) for sd in a + b}
    assert len(firsts) == 32


def test_seeds_reproduce_a_naive_loop_over_manual_seed():
    ens = vmapens.Ensemble(models.MLP, 16, seeds=range(16))
    for k, member in enumerate(ens.unstack()):
        torch.manual_seed(k)
        torch.testing.assert_close(member.state_dict(), models.MLP().state_dict(), rtol=0, atol=0)


def test_member_seed_rebuilds_member_alone():
    ens = vmapens.Ensemble(models.CNN, 5, seed=42)
    torch.manual_seed(vmapens.seeds.member_seed(42, 3))
    torch.testing.assert_close(ens[3].state_dict(), models.CNN().state_dict(), rtol=0, atol=0)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(seed=0, seeds=[0, 1]), ValueError, r"give `seed` or `seeds`, not both"),
        (dict(seeds=[0, 1, 2]), ValueError, r"`seeds` has 3 values, expected n=2"),
        (dict(seeds=[0, 1.5]), TypeError, r"`seeds\[1\]` must be an int"),
        (dict(seeds="ab"), TypeError, r"`seeds` must be a sequence of 2 ints"),
    ],
    ids=["both", "length", "float", "string"],
)
def test_bad_seeds(kwargs, error, match):
    with pytest.raises(error, match="Ensemble: " + match):
        vmapens.Ensemble(models.MLP, 2, **kwargs)


# -- 7. nn.Module habits: apply, integer-like indexing, slices, attribute access -------------


def test_apply_runs_on_every_member_as_on_each_module_alone():
    def init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)  # draws from the global RNG, member by member
            nn.init.zeros_(m.bias)

    ens = vmapens.Ensemble(models.MLP, N, seed=0)
    twins = truth.twins(ens.unstack())
    torch.manual_seed(5)
    assert ens.apply(init) is ens
    torch.manual_seed(5)
    for twin in twins:
        twin.apply(init)
    for member, twin in zip(ens.unstack(), twins, strict=True):
        torch.testing.assert_close(member.state_dict(), twin.state_dict(), rtol=0, atol=0)


@pytest.mark.parametrize(
    "index",
    [2, torch.tensor(2), np.int64(2), -2, torch.tensor(-2, dtype=torch.int32)],
    ids=["int", "tensor", "numpy", "negative", "int32-tensor"],
)
def test_integer_like_index_returns_the_member(index):
    ens = vmapens.Ensemble(models.MLP, N, seed=0)
    i = int(index) % N
    torch.testing.assert_close(ens[index].state_dict(), ens.state_dicts()[i], rtol=0, atol=0)
    assert type(ens[index]) is models.MLP


@pytest.mark.parametrize(
    "index,rows",
    [
        (slice(1, 3), [1, 2]),
        ([3, 0], [3, 0]),
        (torch.tensor([2, 1]), [2, 1]),
        (torch.tensor([True, False, False, True]), [0, 3]),
        (np.array([1, 3]), [1, 3]),
    ],
    ids=["slice", "list", "tensor", "bool-mask", "numpy"],
)
def test_selection_returns_a_sub_ensemble_with_its_optimizer_state(index, rows):
    ens = vmapens.Ensemble(models.MLP, N, seed=0)
    opt = vmapens.StackedAdam(ens, lr=[1e-3, 2e-3, 3e-3, 4e-3])
    vmapens.make_step(ens, nn.MSELoss(), opt)(torch.randn(6, 4), torch.randn(6, 3))
    sub = ens[list(index) if isinstance(index, np.ndarray) else index]
    assert isinstance(sub, vmapens.Ensemble) and list(sub.member_ids) == rows
    for k, r in enumerate(rows):
        torch.testing.assert_close(sub.state_dicts()[k], ens.state_dicts()[r], rtol=0, atol=0)
    sub_opt = opt.select(rows, sub)
    for k, r in enumerate(rows):
        mine, theirs = sub_opt.member_state_dict(k), opt.member_state_dict(r)
        assert mine["param_groups"] == theirs["param_groups"]
        torch.testing.assert_close(mine["state"], theirs["state"], rtol=0, atol=0)


@pytest.mark.parametrize(
    "index,error,match",
    [
        (4, IndexError, r"member index 4 out of range for 4 members"),
        (1.0, TypeError, r"index must be an integer-like"),
        ([], IndexError, r"selecting no members"),
        (torch.tensor([True, False]), IndexError, r"a bool mask must have shape \[4\]"),
    ],
    ids=["out-of-range", "float", "empty", "short-mask"],
)
def test_bad_index_is_clear(index, error, match):
    ens = vmapens.Ensemble(models.MLP, N, seed=0)
    with pytest.raises(error, match="Ensemble: " + match):
        ens[index]


def test_member_attribute_on_the_ensemble_points_to_template_and_members():
    ens = vmapens.Ensemble(models.MLP, N, seed=0)
    with pytest.raises(AttributeError, match=r"`fc1` is an attribute of the members.*ens\[i\]"):
        ens.fc1  # noqa: B018
    assert not hasattr(ens, "no_such_thing")
    assert isinstance(ens.template.fc1, nn.Linear)


# -- 9. TransformerEncoder's eval fast path (nested tensors) under vmap ----------------------


def test_transformer_encoder_with_padding_mask_in_eval_equals_members_alone():
    def member() -> nn.Module:
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        return nn.TransformerEncoder(layer, 2)  # enable_nested_tensor=True: torch's default

    ens = vmapens.Ensemble(member, 3, seed=0).double().eval()
    x = torch.randn(5, 7, 8, dtype=torch.float64)
    pad = torch.zeros(5, 7, dtype=torch.bool)
    pad[:, 5:] = True
    with torch.no_grad():
        out = ens(x, src_key_padding_mask=pad)
        for i, m in enumerate(ens.unstack()):
            with warnings.catch_warnings():  # the member alone takes torch's nested-tensor path
                warnings.filterwarnings("ignore", "The PyTorch API of nested tensors")
                alone = m.eval()(x, src_key_padding_mask=pad)
            # torch's fast path writes zeros at padded positions; compare the real tokens.
            torch.testing.assert_close(out[i][~pad], alone[~pad], **TOL64)


# -- 10. round-off of a parameter whose true gradient is zero --------------------------------


class ConvBiasBeforeBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)  # BatchNorm cancels this bias: its true gradient is 0
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(64, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(x))).flatten(1))


# The bias's gradient is pure round-off: per step at most ~EPS64 times the summed size of
# the terms its gradient adds up (O(1) here). Adam's eps (1e-8) dwarfs sqrt(v) (~1e-17), so a
# step moves it by ~lr * g / eps, and 20 steps by at most STEPS * LR / ADAM_EPS * EPS64 * that
# size: 4.4e-9 per unit. Measured 3.7e-10 to 1.5e-9 for members and reordered plain PyTorch
# alike (4 seeds; native, oneDNN capped at AVX2, ATen's default kernels, 1 and 2 threads). 4
# units leave 4x room over that worst; a real gradient (~1e-2) would move it ~lr per step.
STEPS, LR, ADAM_EPS = 20, 1e-2, 1e-8
EPS64 = torch.finfo(torch.float64).eps
BIAS_ROUND_OFF = 4 * STEPS * LR / ADAM_EPS * EPS64
# The other parameters, float64 after 20 steps: measured <= 2.2e-16 on every setting above.
OTHERS_ROUND_OFF = 1e-13


def test_zero_gradient_parameters_differ_by_plain_pytorchs_own_round_off():
    # Adam divides a gradient of pure round-off (~1e-17) by its eps, so the bias moves by a
    # noise whose size any change of summation order changes, in plain PyTorch too. vmapens
    # stays within the same round-off bound as reordering the batch rows.
    twins = [ConvBiasBeforeBatchNorm().double() for _ in range(N)]
    ens = vmapens.Ensemble.from_modules(truth.twins(twins))
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=LR))
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(8, 1, 6, 6, generator=g, dtype=torch.float64),
         torch.randn(8, 3, generator=g, dtype=torch.float64))
        for _ in range(STEPS)
    ]  # fmt: skip
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(2))
    alone, permuted = truth.twins(twins), truth.twins(twins)
    for x, y in batches:
        step(x, y)
    truth.train_each(alone, batches, make_opt=lambda i, m: truth.adam(LR)(m))
    truth.train_each(
        permuted, [(x[perm], y[perm]) for x, y in batches], make_opt=lambda i, m: truth.adam(LR)(m)
    )

    def gap(ms, key):
        return max((a.state_dict()[key] - b.state_dict()[key]).abs().max().item()
                   for a, b in zip(ms, alone, strict=True))  # fmt: skip

    members = ens.unstack()
    assert gap(permuted, "conv.bias") > 1e-12  # plain PyTorch moves it too
    assert gap(permuted, "conv.bias") <= BIAS_ROUND_OFF  # the bound describes PyTorch itself
    assert gap(members, "conv.bias") <= BIAS_ROUND_OFF
    for key in ("conv.weight", "head.weight", "bn.weight"):  # running_mean includes the bias
        assert gap(members, key) < OTHERS_ROUND_OFF
