"""A user journey: controlling how members are initialised, and re-initialised mid-training.

The script a researcher writes from docs/index.md ("Building members"), docs/semantics.md
("Seeds", `ens.apply`, "Container operations") and docs/optim.md: the members built after
`torch.manual_seed(k)` (the global RNG), with `seed=` or `seeds=`; DCGAN's `weights_init`
run with `ens.apply` (Conv, ConvTranspose, BatchNorm); `nn.init.orthogonal_`,
`kaiming_uniform_`, `xavier_normal_`, `trunc_normal_` and `reset_parameters()` on members of
different sizes (each member's own fans); one pretrained state dict in every member plus
per-member noise written into `ens.stacked_params()`; the worst members re-initialised in
place mid-training with their optimizer state reset as docs/semantics.md says ("zero row `i`
of every tensor in `opt.state[p]`"), for every stacked optimizer with a torch twin; an
initialisation run on `ens.template`.

The truth: each member a plain module built alone with the documented seeding, initialised by
`module.apply(fn)` member after member from the same global RNG state (the draws `ens.apply`
promises: "as `member.apply(fn)` would"), trained alone with `torch.optim` on the same
batches, a re-initialised member given a fresh `torch.optim` optimizer; float64. Where only a
distribution is promised, each member's own weight is checked: orthogonality, fan-in bounds.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import truth
from torch import Tensor, nn

import vmapens
from vmapens import optim as vo

pytestmark = pytest.mark.usefixtures("float64_default")

N = 3
TOL = {"rtol": 1e-10, "atol": 1e-12}


def batches(count: int, shape_x: tuple[int, ...], shape_y: tuple[int, ...]) -> list[Any]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(shape_x, generator=g), torch.randn(shape_y, generator=g)) for _ in range(count)
    ]


def alone_step(models: list[nn.Module], opts: list[Any], x: Tensor, y: Tensor) -> None:
    for m, o in zip(models, opts, strict=True):
        o.zero_grad()
        nn.functional.mse_loss(m(x), y).backward()
        o.step()


def ens_step(ens: vmapens.Ensemble, opt: Any, x: Tensor, y: Tensor) -> Tensor:
    loss = vmapens.per_member(nn.MSELoss())(ens(x), y)
    opt.zero_grad()
    loss.sum().backward()
    opt.step()
    return loss.detach()


def assert_rng_same(a: Tensor, b: Tensor) -> None:
    assert torch.equal(a, b), "the global RNG ended elsewhere than after the loop alone"


# -- DCGAN: built from the global RNG, `ens.apply(weights_init)`, trained --------------------


class Gen(nn.Module):  # a small DCGAN-style generator with a discriminator-style head
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(3, 4, 2, stride=2, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.conv = nn.Conv2d(4, 2, 3, padding=1)
        self.fc = nn.Linear(2 * 4 * 4, 2)

    def forward(self, z: Tensor) -> Tensor:
        h = torch.relu(self.bn(self.up(z)))
        return self.fc(torch.tanh(self.conv(h)).flatten(1))


def weights_init(m: nn.Module) -> None:  # DCGAN's, as in the PyTorch tutorial
    name = type(m).__name__
    if name.find("Conv") != -1:
        nn.init.normal_(m.weight.data, 0.0, 0.02)
    elif name.find("BatchNorm") != -1:
        nn.init.normal_(m.weight.data, 1.0, 0.02)
        nn.init.constant_(m.bias.data, 0)


def test_dcgan_weights_init_draws_as_each_member_alone_then_trains_as_alone() -> None:
    torch.manual_seed(3)
    ens = vmapens.Ensemble(Gen, N)  # neither seed nor seeds: the global RNG, member by member
    after_build = torch.rand(2)
    torch.manual_seed(3)
    alone = [Gen() for _ in range(N)]
    assert_rng_same(after_build, torch.rand(2))
    truth.assert_members_equal(ens, alone, rtol=0, atol=0)

    torch.manual_seed(7)
    assert ens.apply(weights_init) is ens
    after_init = torch.rand(2)
    torch.manual_seed(7)
    for m in alone:
        m.apply(weights_init)
    assert_rng_same(after_init, torch.rand(2))
    truth.assert_members_equal(ens, alone, rtol=0, atol=0)
    # the init reached the members, not a copy: conv weights now have std ~0.02
    assert ens.stacked_params()["conv.weight"].std() < 0.05

    opt = vmapens.StackedAdam(ens, lr=[1e-2, 3e-2, 1e-1])
    opts = [torch.optim.Adam(m.parameters(), lr=lr) for m, lr in zip(alone, [1e-2, 3e-2, 1e-1])]
    for z, y in batches(2, (4, 3, 2, 2), (4, 2)):
        ens_step(ens, opt, z, y)
        alone_step(alone, opts, z, y)
    truth.assert_members_equal(ens, alone, **TOL)


# -- nn.init's fans: each member's own shape, members of different sizes ----------------------


def mlp(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(5, hidden), nn.Tanh(), nn.Linear(hidden, 3))


def fancy_init(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        if m.out_features == 3:
            nn.init.orthogonal_(m.weight, gain=0.7)
            nn.init.trunc_normal_(m.bias, std=0.2, a=-0.1, b=0.1)
        else:
            nn.init.kaiming_uniform_(m.weight, a=math.sqrt(5), nonlinearity="leaky_relu")
            nn.init.xavier_normal_(m.bias[None])  # a [1, h] view: xavier on the member's row


def test_init_functions_use_each_members_own_fans() -> None:
    hidden = (2, 7, 4)
    factories = [functools.partial(mlp, h) for h in hidden]
    ens = vmapens.Ensemble.from_factories(factories, seed=5)
    alone = truth.factory_members(factories, seed=5)
    truth.assert_members_equal(ens, alone, rtol=0, atol=0)

    torch.manual_seed(11)
    ens.apply(fancy_init)
    after = torch.rand(2)
    torch.manual_seed(11)
    for m in alone:
        m.apply(fancy_init)
    assert_rng_same(after, torch.rand(2))
    truth.assert_members_equal(ens, alone, rtol=0, atol=0)

    for i, h in enumerate(hidden):  # distribution-level: from the member's own weights
        member = ens[i]
        w2 = member[2].weight  # [3, h]: orthogonal rows (3 <= h) or columns, times the gain
        small = w2 @ w2.T if h >= 3 else w2.T @ w2
        torch.testing.assert_close(small, 0.49 * torch.eye(min(3, h)), rtol=0, atol=1e-12)
        bound = math.sqrt(6 / ((1 + 5) * 5))  # kaiming_uniform_, a=sqrt(5), fan_in 5
        assert member[0].weight.abs().max() <= bound
        assert member[2].bias.abs().max() <= 0.1
        assert member[0].weight.shape == (h, 5)  # the padded storage keeps its own size


# -- seeds=, seed= and reset_parameters() ----------------------------------------------------


def test_seeds_then_reset_parameters_as_alone_and_member_copies() -> None:
    torch.manual_seed(0)
    before = torch.rand(2)
    torch.manual_seed(0)
    ens = vmapens.Ensemble(Gen, N, seeds=[10, 20, 30])
    assert_rng_same(before, torch.rand(2))  # seeds= leaves the global RNG untouched
    alone = []
    for k in (10, 20, 30):
        torch.manual_seed(k)
        alone.append(Gen())
    truth.assert_members_equal(ens, alone, rtol=0, atol=0)
    by_seed = vmapens.Ensemble(Gen, N, seed=4)
    torch.manual_seed(truth.derived_seed(4, "member", 2))
    truth.assert_members_equal(by_seed.select([2]), [Gen()], rtol=0, atol=0)

    def reset(m: nn.Module) -> None:
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()

    ens.train()
    ens(torch.randn(4, 3, 2, 2))  # BatchNorm's running statistics move; reset puts them back
    torch.manual_seed(9)
    ens.apply(reset)
    torch.manual_seed(9)
    for m in alone:
        m.apply(reset)
    truth.assert_members_equal(ens, alone, rtol=0, atol=0)

    # `ens[i]` is a copy (docs/index.md): initialising it leaves the member as it was
    copy_ = ens[1]
    nn.init.zeros_(copy_.fc.weight)
    torch.testing.assert_close(ens[1].fc.weight, alone[1].fc.weight, rtol=0, atol=0)


# -- one pretrained state dict in every member, then per-member noise -------------------------


def test_pretrained_in_every_member_plus_noise_then_make_step() -> None:
    torch.manual_seed(2)
    pre = mlp(6)
    kept = copy.deepcopy(pre.state_dict())
    ens = vmapens.Ensemble.from_modules([pre] * N)  # one object N times: split into copies
    g = torch.Generator().manual_seed(5)
    noise = {k: 0.05 * torch.randn(N, *p.shape, generator=g) for k, p in pre.named_parameters()}
    with torch.no_grad():
        for name, p in ens.stacked_params().items():
            p.add_(noise[name])
    for k, v in kept.items():  # the pretrained module itself is not edited
        torch.testing.assert_close(pre.state_dict()[k], v, rtol=0, atol=0)
    alone = []
    for i in range(N):
        m = copy.deepcopy(pre)
        with torch.no_grad():
            for name, p in m.named_parameters():
                p.add_(noise[name][i])
        alone.append(m)
    truth.assert_members_equal(ens, alone, rtol=0, atol=0)

    opt = vmapens.StackedAdam(ens, lr=0.05)
    step = vmapens.make_step(ens, nn.MSELoss(), opt)
    opts = [torch.optim.Adam(m.parameters(), lr=0.05) for m in alone]
    for x, y in batches(3, (6, 5), (6, 3)):
        step(x, y)
        alone_step(alone, opts, x, y)
    truth.assert_members_equal(ens, alone, **TOL)


# -- the worst members re-initialised mid-training, their optimizer state reset ---------------


def reset_rows_(
    ens: vmapens.Ensemble, opt: Any, rows: list[int], fresh: list[nn.Module], starts: dict
) -> None:
    """docs/semantics.md, "Container operations": copy the module's values into row `i`
    (`sd[k][i].copy_(v)`), and "zero row `i` of every tensor in `opt.state[p]`" (a state in
    `starts` filled with its start instead: init-2.patch's wording)."""
    sd = ens.state_dict()
    with torch.no_grad():
        for i, module in zip(rows, fresh, strict=True):
            for k, v in module.state_dict().items():
                sd[k][i].copy_(v)
            for p in ens.parameters():
                for name, value in opt.state[p].items():
                    value[i].fill_(starts.get(name, 0.0))


def own(kw: dict, i: int) -> dict:
    """Member ``i``'s hyperparameters: a list holds one value per member."""
    return {k: v[i] if isinstance(v, list) else v for k, v in kw.items()}


def reinit_journey(
    stacked: Callable[..., Any], plain: Callable[..., Any], kw: dict, starts: dict | None = None
) -> None:
    """Train 3 steps, re-initialise the 2 worst members (by the last loss) from new seeds with
    the documented recipe, train 3 more; each member against its plain module, a re-initialised
    one with a fresh torch optimizer."""
    factory = functools.partial(mlp, 4)
    ens = vmapens.Ensemble(factory, N, seeds=range(N))
    alone = truth.seeded_members(factory, N)
    opt = stacked(ens, **kw)
    opts = [plain(m.parameters(), **own(kw, i)) for i, m in enumerate(alone)]
    data = batches(6, (5, 5), (5, 3))
    for x, y in data[:3]:
        losses = ens_step(ens, opt, x, y)
        alone_step(alone, opts, x, y)
    worst = sorted(torch.argsort(losses, descending=True)[:2].tolist())
    fresh = []
    for i in worst:
        torch.manual_seed(100 + i)
        fresh.append(factory())
        alone[i] = copy.deepcopy(fresh[-1])
        opts[i] = plain(alone[i].parameters(), **own(kw, i))
    reset_rows_(ens, opt, worst, fresh, starts or {})
    truth.assert_members_equal(ens, alone, **TOL)
    for x, y in data[3:]:
        ens_step(ens, opt, x, y)
        alone_step(alone, opts, x, y)
    truth.assert_members_equal(ens, alone, **TOL)


RESETTABLE = {
    "adamw-amsgrad": (
        vmapens.StackedAdam,
        torch.optim.Adam,
        dict(lr=0.05, weight_decay=0.1, decoupled_weight_decay=True, amsgrad=True),
    ),
    "sgd-dampened": (vo.StackedSGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.3)),
    "rmsprop-centered": (
        vo.StackedRMSprop,
        torch.optim.RMSprop,
        dict(lr=0.01, momentum=0.5, centered=True),
    ),
    "rprop": (vo.StackedRprop, torch.optim.Rprop, dict(lr=0.02)),  # step sizes from lr at step 0
    "asgd": (vo.StackedASGD, torch.optim.ASGD, dict(lr=0.05, t0=2)),  # eta from lr at step 0
    "adadelta": (vo.StackedAdadelta, torch.optim.Adadelta, dict(lr=0.5)),
    "adamax": (vo.StackedAdamax, torch.optim.Adamax, dict(lr=0.05)),
    "radam": (vo.StackedRAdam, torch.optim.RAdam, dict(lr=0.05)),
    "adafactor": (vo.StackedAdafactor, torch.optim.Adafactor, dict(lr=0.05)),
    "adagrad": (vo.StackedAdagrad, torch.optim.Adagrad, dict(lr=0.05)),
}


@pytest.mark.parametrize("name", list(RESETTABLE))
def test_reinit_worst_members_mid_training_as_fresh_alone(name: str) -> None:
    reinit_journey(*RESETTABLE[name])


@pytest.mark.parametrize("lr", [0.05, [0.05, 0.02, 0.1]], ids=["shared", "per-member"])
def test_reinit_with_nadam_as_fresh_alone(lr: Any) -> None:
    reinit_journey(vo.StackedNAdam, torch.optim.NAdam, dict(lr=lr))


def test_reinit_with_adagrad_initial_accumulator_as_fresh_alone() -> None:
    """torch's Adagrad makes its `sum` at `initial_accumulator_value` when it is built: a row
    zeroed (the recipe for the other optimizers, docs/semantics.md) gives the reset member a
    `sum` of 0, 0.09 off after 3 steps; filled with the start, as the docs say, exact."""
    kw = dict(lr=0.05, initial_accumulator_value=0.5)
    reinit_journey(vo.StackedAdagrad, torch.optim.Adagrad, kw, {"sum": 0.5})
    with pytest.raises(AssertionError, match=r"member \d"):
        reinit_journey(vo.StackedAdagrad, torch.optim.Adagrad, kw)  # zeroed: off


# -- an initialisation run on the template ----------------------------------------------------


def test_init_on_the_template_is_refused_not_silently_ignored() -> None:
    ens = vmapens.Ensemble(Gen, N, seed=0)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    torch.manual_seed(1)
    # a plain module's habit; DCGAN's `nn.init.normal_(m.weight.data, ...)`, `orthogonal_` and
    # `trunc_normal_` leave no trace on a meta tensor (`.data` has its own version counter,
    # torch's two return early on meta): the docs' sentence in init-1.patch covers those
    ens.template.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
    with pytest.raises(ValueError, match=r"ens\.template\.up\.weight.*ens\.apply"):
        ens(torch.randn(2, 3, 2, 2))
    for k, v in ens.state_dict().items():  # nothing changed
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    ens.apply(weights_init)  # the way out, then the ensemble runs again
    ens(torch.randn(2, 3, 2, 2))


@pytest.mark.parametrize(
    "write",
    [
        lambda t: nn.init.normal_(t.up.weight.data, 0.0, 0.02),  # DCGAN's weights_init
        lambda t: t.up.weight.data.clamp_(-0.01, 0.01),  # WGAN's clipping, CLIP's clamp
        lambda t: [p.data.mul_(0.5) for p in t.parameters()],
    ],
    ids=["init", "clamp", "all"],
)
def test_a_write_through_data_on_the_template_is_refused(write) -> None:
    # Until session 32 `.data` of a template parameter had its own version counter: the
    # write changed nothing and nothing said so. Now the next call refuses it, naming the ways.
    ens = vmapens.Ensemble(Gen, N, seed=0)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    write(ens.template)
    with pytest.raises(ValueError, match=r"ens\.template\..*written in place.*ens\.apply"):
        ens(torch.randn(2, 3, 2, 2))
    for k, v in ens.state_dict().items():  # nothing changed
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    ens(torch.randn(2, 3, 2, 2))  # refused once: the ensemble runs on
