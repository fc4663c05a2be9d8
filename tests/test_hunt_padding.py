"""Members of different sizes: cases ``tests/test_sizes.py`` leaves out, against members alone.

The truth is each member built by its own factory and trained alone with ``torch.optim``
(float64: padding adds exact zeros, only the order of the sums differs).
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch import nn
from truth import assert_members_equal, factory_members, train_alone

import vmapens

EXACT = dict(rtol=0.0, atol=1e-12)


pytestmark = pytest.mark.usefixtures("float64_default")


#: Adam, lr 0.02: the stacked optimizer of an ensemble, and torch's of a member alone.
ADAM = (
    lambda e: vmapens.StackedAdam(e, lr=0.02),
    lambda m: torch.optim.Adam(m.parameters(), lr=0.02),
)


def _three_steps_as_alone(factories, x, y, stacked, plain, **options) -> vmapens.Ensemble:
    """Three steps of ``from_factories(factories, seed=0, **options)`` with ``stacked(ens)``
    on ``(x, y)``, against each member trained alone with ``plain(module)``: equal."""
    ens = vmapens.Ensemble.from_factories(factories, seed=0, **options)
    step = vmapens.make_step(ens, nn.MSELoss(), stacked(ens))
    for _ in range(3):
        step(x, y)
    alone = factory_members(factories)
    for m in alone:
        train_alone(m, [(x, y)] * 3, make_opt=plain(m))
    assert_members_equal(ens, alone, **EXACT)
    return ens


class MyGRUCell(nn.GRUCell):
    """A user's subclass: it stacks the gates (r, z, n) along dim 0 as nn.GRUCell does."""


class MyLSTMCell(nn.LSTMCell):
    pass


class CellModel(nn.Module):
    def __init__(self, hidden: int, cell: type = MyGRUCell) -> None:
        super().__init__()
        self.cell, self.head = cell(3, hidden), nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = None
        for t in range(x.shape[1]):
            state = self.cell(x[:, t], state)
        return self.head(state[0] if isinstance(state, tuple) else state)


# nn.LSTMCell's subclass has no vmap rule (only nn.LSTMCell itself is swapped): the loop.
@pytest.mark.parametrize(
    "cell,backend", [(MyGRUCell, "vmap"), (MyLSTMCell, "loop")], ids=["gru-cell", "lstm-cell"]
)
def test_a_subclass_of_a_recurrent_cell_is_padded_gate_by_gate(cell, backend):
    """The gates were found by exact type, so a subclass was padded as one corner: its gates
    mixed, and the self-check refused a model that trains alone."""
    factories = [functools.partial(CellModel, h, cell) for h in (3, 6)]
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(5, 4, 3, generator=g), torch.randn(5, 1, generator=g)
    _three_steps_as_alone(factories, x, y, *ADAM, backend=backend)


class EmbedMaxNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(7, dim, max_norm=0.5), nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x).sum(1))


def test_an_embedding_with_max_norm_is_refused_at_different_widths_and_trains_at_one():
    """max_norm renormalises the weight in place during the forward; a padded member does
    that to its masked copy, so the stored weight would not follow (``ens(x)`` is unchecked)."""
    rng = torch.get_rng_state()
    with pytest.raises(ValueError, match=r"`embed` \(Embedding\) with max_norm=0.5 renormalises"):
        vmapens.Ensemble.from_factories([functools.partial(EmbedMaxNorm, d) for d in (2, 3)])
    assert torch.equal(torch.get_rng_state(), rng)
    factories = [functools.partial(EmbedMaxNorm, 3)] * 2  # one width: no padding, as alone
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 7, (5, 4), generator=g), torch.randn(5, 1, generator=g)
    ens = vmapens.Ensemble.from_factories(factories, seed=0)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1))
    step(x, y)
    alone = factory_members(factories)
    for m in alone:
        train_alone(m, [(x, y)], make_opt=torch.optim.SGD(m.parameters(), lr=0.1))
    assert_members_equal(ens, alone, **EXACT)


def _normed(hidden: int, norm) -> nn.Module:
    with warnings.catch_warnings():  # the hook-based API is deprecated, still used
        warnings.simplefilter("ignore", FutureWarning)
        return nn.Sequential(norm(nn.Linear(3, hidden)), nn.Tanh(), nn.Linear(hidden, 1))


@pytest.mark.parametrize(
    "norm", [nn.utils.weight_norm, nn.utils.spectral_norm], ids=["weight-norm", "spectral-norm"]
)
def test_a_weight_computed_by_a_pre_hook_of_another_size_is_refused_for_what_it_is(norm):
    """It was refused as a differing setting, with the advice to register it as a buffer."""
    factories = [functools.partial(_normed, h, norm) for h in (2, 3)]
    with pytest.raises(ValueError, match=r"`0` \(Linear\) computes `weight` from padded") as e:
        vmapens.Ensemble.from_factories(factories)
    assert "register_buffer" not in str(e.value)


class CNN(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.Sigmoid(),
            nn.Flatten(), nn.Linear(channels * 16, 2),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_optimizer_before_double_batch_sizes_eval_and_a_trained_selection():
    """Plain torch's order: optimizer, then ``.double()``; batches of several sizes; then
    eval mode and a sub-ensemble (tensor index) trained on, each member as alone."""
    torch.set_default_dtype(torch.float32)
    factories = [functools.partial(CNN, c) for c in (2, 3, 2, 3)]
    ens = vmapens.Ensemble.from_factories(factories, seed=1)
    opt = vmapens.StackedSGD(ens, lr=0.1, momentum=0.9)
    ens.double()
    alone = [m.double() for m in factory_members(factories, seed=1)]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 1, 4, 4, generator=g, dtype=torch.float64)
    y = torch.randn(6, 2, generator=g, dtype=torch.float64)
    batches = [(x[:b], y[:b]) for b in (6, 3, 5)]
    step = vmapens.make_step(ens, nn.MSELoss(), opt)
    for xb, yb in batches:
        step(xb, yb)
    for m in alone:
        train_alone(m, batches, make_opt=torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
    assert_members_equal(ens, alone, **EXACT)
    ens.eval()
    with torch.no_grad():
        out = ens(x)
        for i, m in enumerate(alone):
            torch.testing.assert_close(out[i], m.eval()(x), **EXACT)
    sub = ens.select(torch.tensor([3, 0])).train()
    assert [m.net[0].out_channels for m in sub.unstack()] == [3, 2]
    step = vmapens.make_step(sub, nn.MSELoss(), vmapens.StackedSGD(sub, lr=0.1))
    step(x, y)
    picked = [alone[3].train(), alone[0].train()]
    for m in picked:
        train_alone(m, [(x, y)], make_opt=torch.optim.SGD(m.parameters(), lr=0.1))
    assert_members_equal(sub, picked, **EXACT)


class MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, hidden), nn.Sigmoid(), nn.Linear(hidden, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


# Elementwise rules whose state starts non-zero in the padded entries (Adagrad's initial
# accumulator, Rprop's step sizes) or that divide by a state (Adadelta, centred RMSprop).
RULES = [
    ("Adagrad", dict(lr=0.05, initial_accumulator_value=0.3, lr_decay=0.01)),
    ("RMSprop", dict(lr=0.01, centered=True, momentum=0.5, weight_decay=0.1)),
    ("Rprop", dict(lr=0.01)),
    ("Adadelta", dict(lr=0.5)),
    ("Adamax", dict(lr=0.01, weight_decay=0.1)),
]


@pytest.mark.parametrize("name,kwargs", RULES, ids=[r[0] for r in RULES])
def test_other_elementwise_rules_train_each_size_as_alone(name, kwargs):
    factories = [functools.partial(MLP, h) for h in (2, 5, 3)]
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 3, generator=g), torch.randn(8, 2, generator=g)
    ens = vmapens.Ensemble.from_factories(factories, seed=0)
    opt = getattr(vmapens.optim, f"Stacked{name}")(ens, **kwargs)
    step = vmapens.make_step(ens, nn.MSELoss(), opt)
    for _ in range(4):
        step(x, y)
    alone = factory_members(factories)
    for i, m in enumerate(alone):
        plain = getattr(torch.optim, name)(m.parameters(), **kwargs)
        train_alone(m, [(x, y)] * 4, make_opt=plain)
        mine = opt.member_state_dict(i, ens[i])["state"]
        for k, state in plain.state_dict()["state"].items():
            for key, v in state.items():
                torch.testing.assert_close(mine[k][key].to(v.dtype), v, **EXACT)
    assert_members_equal(ens, alone, **EXACT)


class Decoder(nn.Module):
    """A conv decoder: ConvTranspose2d's weight is [in, out, k, k], padded as a corner."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.down, self.bn = nn.Conv2d(1, channels, 3), nn.BatchNorm2d(channels)
        self.up = nn.ConvTranspose2d(channels, 1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(torch.sigmoid(self.bn(self.down(x)))).flatten(1)


def test_a_transposed_convolution_of_different_channels_trains_as_alone():
    """It was refused as a differing setting (`in_channels`), where plain torch trains it."""
    factories = [functools.partial(Decoder, c) for c in (2, 4, 3)]
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(4, 1, 5, 5, generator=g), torch.randn(4, 25, generator=g)
    sgd = (
        lambda e: vmapens.StackedSGD(e, lr=0.1, momentum=0.9),
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
    )
    ens = _three_steps_as_alone(factories, x, y, *sgd)
    assert [m.up.in_channels for m in ens.unstack()] == [2, 4, 3]
    grouped = [lambda c=c: nn.ConvTranspose1d(c, c, 1, groups=2) for c in (2, 4)]
    with pytest.raises(ValueError, match="groups=2 mixes padded channels"):
        vmapens.Ensemble.from_factories(grouped)


class Widths(nn.Module):
    """A user's MLP configured by a tuple of widths, kept as a setting (a common pattern)."""

    def __init__(self, hidden: tuple[int, ...], act: str = "tanh") -> None:
        super().__init__()
        self.hidden, self.act = hidden, act
        sizes = (3, *hidden)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))
        self.head = nn.Linear(hidden[-1], 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def test_a_tuple_of_widths_may_differ_between_sizes_and_other_settings_may_not():
    """A tuple of ints differing was refused as a setting, where a plain int is allowed."""
    factories = [functools.partial(Widths, h) for h in ((2, 3), (4, 3), (4, 5))]
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(6, 3, generator=g), torch.randn(6, 1, generator=g)
    ens = _three_steps_as_alone(factories, x, y, *ADAM)
    assert [m.hidden for m in ens.unstack()] == [(2, 3), (4, 3), (4, 5)]
    with pytest.raises(ValueError, match=r"`hidden` is \[4, 3\] vs \(2, 3\)"):  # list, tuple
        vmapens.Ensemble.from_factories([functools.partial(Widths, h) for h in ((2, 3), [4, 3])])
    with pytest.raises(ValueError, match="`act` is 'relu' vs 'tanh'"):
        vmapens.Ensemble.from_factories(
            [functools.partial(Widths, (2, 3)), functools.partial(Widths, (4, 3), "relu")]
        )


class Bag(nn.Module):
    def __init__(self, dim: int, mode: str = "mean", max_norm: float | None = None) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(7, dim, mode=mode, max_norm=max_norm)
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.sigmoid(self.bag(x)))


# torch's own vmap fallback for embedding_bag warns about its speed, not its values.
@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize("mode", ["mean", "max"])
def test_an_embedding_bag_of_different_widths_trains_as_alone(mode):
    """It was refused as a differing setting (`embedding_dim`); a bag reduces over its
    indices, never over the padded width."""
    factories = [functools.partial(Bag, d, mode) for d in (2, 4)]
    g = torch.Generator().manual_seed(6)
    x, y = torch.randint(0, 7, (5, 3), generator=g), torch.randn(5, 1, generator=g)
    _three_steps_as_alone(factories, x, y, *ADAM)
    with pytest.raises(ValueError, match=r"`bag` \(EmbeddingBag\) with max_norm=1.0"):
        vmapens.Ensemble.from_factories([functools.partial(Bag, d, mode, 1.0) for d in (2, 4)])
