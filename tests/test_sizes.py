"""Members of different sizes (``Ensemble.from_factories``), against members trained alone.

The truth is each member built by its own factory at its own size and trained alone with
torch.optim; the ensemble stores them padded to the largest member and trains them in one
vmapped step. Every member must end where it ends alone (float64, 1e-12), its padded entries
must stay zero in parameters and optimizer state, and what cannot be padded exactly must be
refused with the layer's name.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn
from truth import train_alone

import vmapens

# float64: padding adds exact zeros to every sum, so only the order of the sums can differ
# from the member alone (a few 1e-16 per step); 1e-12 is the bound and sits 1e4 above.
EXACT = dict(rtol=0.0, atol=1e-12)
STEPS = 12


class MLP(nn.Module):
    """Activations that are not 0 at 0 (sigmoid, softplus): padded units output a constant,
    which only the masks keep out of the next layer and out of the gradients."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.hidden = hidden  # an int setting of the user's own class: may differ by size
        self.net = nn.Sequential(
            nn.Linear(3, hidden), nn.Sigmoid(), nn.Linear(hidden, hidden), nn.Softplus(),
            nn.Linear(hidden, 2),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CNN(nn.Module):
    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 2),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Conv1dFlat(nn.Module):
    """Flatten of [channels, length] is channel-major: a padded channel's block of features
    comes after the member's own, where the next Linear's padded columns are."""

    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv1d(2, channels, 3), nn.Tanh(), nn.Flatten(), nn.Linear(channels * 6, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Embed(nn.Module):
    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(10, dim), nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x).mean(1))


class Recurrent(nn.Module):
    def __init__(self, hidden: int = 8, cell: type = nn.GRU, layers: int = 1) -> None:
        super().__init__()
        self.rnn = cell(3, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0][:, -1])


def _data(kind: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = {
        "mlp": lambda: torch.randn(10, 3, generator=g),
        "cnn": lambda: torch.randn(6, 1, 5, 5, generator=g),
        "conv1d": lambda: torch.randn(6, 2, 8, generator=g),
        "embed": lambda: torch.randint(0, 10, (6, 4), generator=g),
        "rnn": lambda: torch.randn(5, 7, 3, generator=g),
    }[kind]()
    outputs = 2 if kind in ("mlp", "cnn") else 1
    return x, torch.randn(x.shape[0], outputs, generator=g)


# (id, factory taking the size, sizes, data kind)
MODELS = [
    ("mlp", MLP, (4, 8, 16), "mlp"),
    ("cnn-batchnorm", CNN, (2, 4), "cnn"),
    ("conv1d-flatten", Conv1dFlat, (2, 5), "conv1d"),
    ("embedding", Embed, (3, 5), "embed"),
    ("gru", functools.partial(Recurrent, cell=nn.GRU), (4, 8), "rnn"),
    ("lstm-2-layers", functools.partial(Recurrent, cell=nn.LSTM, layers=2), (4, 8), "rnn"),
    ("gru-cell", None, (3, 6), "rnn"),
]


class CellModel(nn.Module):
    def __init__(self, hidden: int = 6) -> None:
        super().__init__()
        self.cell, self.head = nn.GRUCell(3, hidden), nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = None
        for t in range(x.shape[1]):
            h = self.cell(x[:, t], h)
        return self.head(h)


def _factories(make, sizes, per_size: int = 2):
    make = make or CellModel
    return [functools.partial(make, s) for s in sizes for _ in range(per_size)]


OPTIMIZERS = {
    "adam-wd": (
        lambda ens: vmapens.StackedAdam(ens, lr=0.02, weight_decay=0.1),
        lambda m: torch.optim.Adam(m.parameters(), lr=0.02, weight_decay=0.1),
    ),
    "sgd-momentum-wd": (
        lambda ens: vmapens.StackedSGD(ens, lr=0.05, momentum=0.9, weight_decay=0.01),
        lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01),
    ),
}


pytestmark = pytest.mark.usefixtures("float64_default")


def _assert_padding_zero(ens: vmapens.Ensemble, opt: vmapens.optim.StackedOptimizer) -> None:
    """Every padded entry of every parameter and of its optimizer state is exactly zero: the
    padded tensor's total equals the total of the members' own tensors, cut by
    ``ens.unstack()`` / ``member_state_dict`` (each checked against the truth elsewhere)."""
    members = ens.unstack()
    order = [q for g in opt.param_groups for q in g["params"]]
    handed = [opt.member_state_dict(i)["state"] for i in range(len(ens))]
    for name, p in ens.stacked_params().items():
        own = sum(float(dict(m.named_parameters())[name].detach().abs().sum()) for m in members)
        assert float(p.detach().abs().sum()) == pytest.approx(own, rel=1e-12, abs=0.0), name
        k = next(j for j, q in enumerate(order) if q is p)
        for key, v in opt.state[p].items():
            if v.shape == p.shape:
                own = sum(float(h[k][key].abs().sum()) for h in handed)
                assert float(v.abs().sum()) == pytest.approx(own, rel=1e-12, abs=0.0), key


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("model_id,make,sizes,kind", MODELS, ids=[m[0] for m in MODELS])
def test_each_member_ends_where_it_ends_alone_at_its_own_size(
    model_id, make, sizes, kind, optimizer
):
    factories = _factories(make, sizes)
    ens = vmapens.Ensemble.from_factories(factories, seed=3)
    # The truth: each factory's own module, built as documented (member_seed), trained alone.
    alone = []
    for i, f in enumerate(factories):
        torch.manual_seed(vmapens.seeds.member_seed(3, i))
        alone.append(f())
    for i, m in enumerate(alone):
        for key, v in m.state_dict().items():
            assert torch.equal(ens[i].state_dict()[key], v), f"member {i} init {key}"
    stacked_opt, plain_opt = OPTIMIZERS[optimizer]
    opt = stacked_opt(ens)
    step = vmapens.make_step(ens, nn.MSELoss(), opt)
    x, y = _data(kind)
    for _ in range(STEPS):
        step(x, y)
    opts = [train_alone(m, [(x, y)] * STEPS, nn.functional.mse_loss, plain_opt(m)) for m in alone]
    for i, m in enumerate(alone):
        got = ens[i].state_dict()
        assert list(got) == list(m.state_dict())
        for key, v in m.state_dict().items():
            torch.testing.assert_close(got[key], v, **EXACT, msg=f"member {i} `{key}`")
        # The optimizer state handed off at the member's own size equals torch's own.
        mine = opt.member_state_dict(i, ens[i])["state"]
        theirs = opts[i].state_dict()["state"]
        assert set(mine) == set(theirs)
        for k, state in theirs.items():
            for key, v in state.items():
                torch.testing.assert_close(mine[k][key].to(v.dtype), v, **EXACT)
    _assert_padding_zero(ens, opt)


def test_masked_steps_and_chunks_and_the_loop_backend_match_members_alone():
    factories = _factories(MLP, (4, 8, 16))
    x, y = _data("mlp")
    masks = [torch.tensor([i % 3 != s % 3 for i in range(6)]) for s in range(STEPS)]
    for options in (dict(), dict(chunk_size=4), dict(backend="loop")):
        ens = vmapens.Ensemble.from_factories(factories, seed=0, **options)
        alone = ens.unstack()
        opt = vmapens.StackedAdam(ens, lr=0.02, weight_decay=0.1)
        step = vmapens.make_step(ens, nn.MSELoss(), opt)
        for mask in masks:
            step(x, y, mask)
        for i, m in enumerate(alone):
            own = [(x, y) for mask in masks if mask[i]]
            train_alone(m, own, nn.functional.mse_loss, torch.optim.Adam(m.parameters(), lr=0.02, weight_decay=0.1))  # fmt: skip
            for key, v in m.state_dict().items():
                torch.testing.assert_close(ens[i].state_dict()[key], v, **EXACT)
        _assert_padding_zero(ens, opt)


def test_fit_with_early_stopping_matches_members_alone():
    """Per-member early stopping (patience) and best restore, as a plain loop does it."""
    factories = _factories(MLP, (4, 16), per_size=2)
    lrs = [0.002, 0.5, 0.002, 0.5]  # the large rates overshoot and stop early
    g = torch.Generator().manual_seed(1)
    X, Y = torch.randn(32, 3, generator=g), torch.randn(32, 2, generator=g)
    XV, YV = torch.randn(16, 3, generator=g), torch.randn(16, 2, generator=g)
    epochs, patience, batch = 8, 2, 8
    ens = vmapens.Ensemble.from_factories(factories, seed=5)
    alone = ens.unstack()
    h = vmapens.fit(ens, (X, Y), nn.MSELoss(), epochs=epochs, batch_size=batch, shuffle=False,
                    optimizer=vmapens.StackedAdam(ens, lr=lrs), val_data=(XV, YV),
                    patience=patience, progress=False)  # fmt: skip
    batches = [(X[k : k + batch], Y[k : k + batch]) for k in range(0, 32, batch)]
    best_epochs, stops = [], []
    for i, m in enumerate(alone):
        opt = torch.optim.Adam(m.parameters(), lr=lrs[i])
        best, best_state, best_epoch, bad, stopped = float("inf"), None, -1, 0, -1
        for epoch in range(epochs):
            train_alone(m, batches, nn.functional.mse_loss, opt)
            with torch.no_grad():
                val = float(nn.functional.mse_loss(m(XV), YV))
            if val < best:
                best, best_state, best_epoch, bad = val, copy.deepcopy(m.state_dict()), epoch, 0
            else:
                bad += 1
                if bad >= patience:
                    stopped = epoch
                    break
        m.load_state_dict(best_state)
        best_epochs.append(best_epoch)
        stops.append(stopped)
    assert h.best_epoch.tolist() == best_epochs
    assert h.stopped_epoch.tolist() == stops
    assert any(s >= 0 for s in stops) and any(s < 0 for s in stops)  # the case bites
    for i, m in enumerate(alone):
        for key, v in m.state_dict().items():
            torch.testing.assert_close(ens[i].state_dict()[key], v, **EXACT)


def test_members_come_back_at_their_own_size(tmp_path):
    factories = _factories(CNN, (2, 4))
    ens = vmapens.Ensemble.from_factories(factories, seed=0)
    x = _data("cnn")[0]
    built = []
    for i, f in enumerate(factories):
        torch.manual_seed(vmapens.seeds.member_seed(0, i))
        built.append(f())
    paths = vmapens.save_members(ens, tmp_path / "members")
    for i, path in enumerate(paths):
        fresh = CNN(built[i].net[0].out_channels)
        fresh.load_state_dict(torch.load(path))  # strict: the member's own keys and shapes
        for key, v in built[i].state_dict().items():
            assert torch.equal(vmapens.load_member(path)[key], v)
    for i, (m, sd) in enumerate(zip(built, ens.state_dicts(), strict=True)):
        assert type(ens[i]) is CNN and ens[i].net[0].out_channels == m.net[0].out_channels
        assert CNN(m.net[0].out_channels).load_state_dict(sd) is not None  # strict, own size
    out = ens(x)  # training mode: BatchNorm statistics update, member by member as alone
    for i, m in enumerate(built):
        torch.testing.assert_close(out[i], m(x), **EXACT)
        torch.testing.assert_close(ens[i].net[1].running_var, m.net[1].running_var, **EXACT)
    for i, m in enumerate(ens.unstack()):
        assert m.net[1].num_features == built[i].net[1].num_features
    # A sub-ensemble keeps each member's size; its eval() leaves this one in training mode.
    sub = ens.select([3, 0])
    sub.eval()
    assert ens.training and ens.template.training and all(m.training for m in ens.unstack())
    assert sub[0].net[0].out_channels == 4 and sub[1].net[0].out_channels == 2


def test_a_checkpoint_resumes_exactly_and_refuses_other_sizes(tmp_path):
    factories = _factories(MLP, (4, 8))
    x, y = _data("mlp")
    straight = vmapens.Ensemble.from_factories(factories, seed=0)
    step = vmapens.make_step(straight, nn.MSELoss(), vmapens.StackedAdam(straight, lr=0.02))
    for _ in range(6):
        step(x, y)
    ens = vmapens.Ensemble.from_factories(factories, seed=0)
    opt = vmapens.StackedAdam(ens, lr=0.02)
    step = vmapens.make_step(ens, nn.MSELoss(), opt)
    for _ in range(3):
        step(x, y)
    vmapens.save(ens, tmp_path / "ckpt.pt", opt)
    loaded = vmapens.load(tmp_path / "ckpt.pt", factories)
    opt2 = vmapens.StackedAdam(loaded, lr=0.02)
    vmapens.restore(tmp_path / "ckpt.pt", loaded, opt2)
    step = vmapens.make_step(loaded, nn.MSELoss(), opt2)
    for _ in range(3):
        step(x, y)
    for key, v in straight.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], v), key
    with pytest.raises(ValueError, match="other sizes"):
        vmapens.load(tmp_path / "ckpt.pt", factories[::-1])
    with pytest.raises(ValueError, match="holds 4 members, `factory` gives 2"):
        vmapens.load(tmp_path / "ckpt.pt", factories[:2])


def test_export_of_a_padded_ensemble_equals_its_members_alone():
    ens = vmapens.Ensemble.from_factories(_factories(CNN, (2, 4)), seed=0).eval()
    x = _data("cnn")[0]
    program = vmapens.export(ens, x)
    with torch.no_grad():
        out = program.module()(x)
        for i, m in enumerate(ens.unstack()):
            torch.testing.assert_close(out[i], m(x), **EXACT)
    assert not isinstance(ens(x), torch._subclasses.fake_tensor.FakeTensor)


def test_the_masks_follow_dtype_changes():
    ens = vmapens.Ensemble.from_factories(_factories(MLP, (4, 8)), seed=0).float()
    x = _data("mlp")[0].float()
    for i, m in enumerate(ens.unstack()):
        torch.testing.assert_close(ens(x)[i], m(x))


class MeanOverWidth(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.net[1](self.net[0](x))
        return hidden.mean(-1, keepdim=True).expand(-1, 2)  # averages the padded zeros in


# Largest first: member 0 runs exactly as alone, only the smaller size differs.
@pytest.mark.parametrize("widths", [(4, 8), (8, 4)], ids=["smallest-first", "largest-first"])
def test_the_probe_refuses_a_forward_that_mixes_padded_entries(widths):
    ens = vmapens.Ensemble.from_factories(_factories(MeanOverWidth, widths), seed=0)
    x, y = _data("mlp")
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens))
    with pytest.raises(RuntimeError, match="member [02] of MeanOverWidth .* padded ensemble"):
        step(x, y)
    assert all(torch.equal(v, before[k]) for k, v in ens.state_dict().items())
    with pytest.raises(RuntimeError, match="Members of different sizes"):
        vmapens.check(ens, x, y, nn.MSELoss())


class SoftmaxOverWidth(MLP):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__(hidden)
        self.net[3] = nn.Softmax(-1)  # over the padded width: the padded units enter the sum


def test_the_probe_names_the_first_layer_that_differs():
    ens = vmapens.Ensemble.from_factories(_factories(SoftmaxOverWidth, (8, 4)), seed=0)
    x, y = _data("mlp")
    with pytest.raises(RuntimeError, match=r"member 2 .* first differs at `net.3` \(Softmax\)"):
        vmapens.check(ens, x, y, nn.MSELoss())


def _transformer(d: int) -> nn.Module:
    return nn.TransformerEncoderLayer(d, 2, dim_feedforward=8, batch_first=True)


def _dropout(p: float) -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.Dropout(p))


class TwoWidths(nn.Module):
    def __init__(self, a: int, b: int) -> None:
        super().__init__()
        self.one, self.two = nn.Linear(3, a), nn.Linear(a, b)


REFUSED = [
    ("layernorm", [lambda: nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4)),
                   lambda: nn.Sequential(nn.Linear(3, 8), nn.LayerNorm(8))],
     r"`1` \(LayerNorm\) normalises over the padded dimension"),
    ("groupnorm", [lambda: nn.GroupNorm(2, 4), lambda: nn.GroupNorm(2, 8)],
     "GroupNorm normalises over groups"),
    ("attention", [lambda: _transformer(4), lambda: _transformer(8)],
     r"`self_attn` \(MultiheadAttention\) splits the padded width into heads"),
    ("grouped-conv", [lambda: nn.Conv1d(4, 4, 1, groups=2), lambda: nn.Conv1d(8, 8, 1, groups=2)],
     "groups=2 mixes padded channels"),
    ("bidirectional", [lambda: nn.GRU(3, 4, bidirectional=True),
                       lambda: nn.GRU(3, 8, bidirectional=True)], "bidirectional=True"),
    ("vocabulary", [lambda: nn.Embedding(5, 4), lambda: nn.Embedding(9, 4)],
     "index beyond a smaller member's rows"),
    ("dropout-rate", [lambda: _dropout(0.1), lambda: _dropout(0.5)], r"`p` is 0.5 vs 0.1"),
    ("no-largest", [lambda: TwoWidths(4, 8), lambda: TwoWidths(8, 4)],
     "no member is the largest in every dimension"),
    ("other-class", [lambda: nn.Linear(3, 4), lambda: nn.Bilinear(3, 3, 4)], "another structure"),
]  # fmt: skip


@pytest.mark.parametrize("factories,match", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_what_cannot_be_padded_is_refused_by_layer(factories, match):
    rng = torch.get_rng_state()
    with pytest.raises(ValueError, match=match):
        vmapens.Ensemble.from_factories(factories)
    assert torch.equal(torch.get_rng_state(), rng)  # a refused build leaves the RNG alone


def test_from_modules_refuses_members_whose_settings_differ():
    """One forward runs every member with the template's settings: a dropout rate of 0.5 in
    member 1 would have run as member 0's 0.1."""
    with pytest.raises(ValueError, match=r"`1` \(Dropout\): `p` is 0.5 vs 0.1"):
        vmapens.Ensemble.from_modules([_dropout(0.1), _dropout(0.5)])


def test_rules_that_are_not_elementwise_and_cross_size_copies_are_refused():
    ens = vmapens.Ensemble.from_factories(_factories(MLP, (4, 8)), seed=0)
    with pytest.raises(ValueError, match="StackedAdafactor: .* not elementwise"):
        vmapens.optim.StackedAdafactor(ens)
    matrices = [p for p in ens.parameters() if p.dim() == 3]
    with pytest.raises(ValueError, match="StackedMuon: .* not elementwise"):
        vmapens.optim.StackedMuon(matrices)
    with pytest.raises(ValueError, match="member 2 cannot become a copy of member 0"):
        vmapens.pbt.exploit_(ens, None, [0], [2])
    vmapens.pbt.exploit_(ens, None, [0], [1])  # one size: allowed
    assert torch.equal(
        ens.stacked_params()["net.0.weight"][1], ens.stacked_params()["net.0.weight"][0]
    )


BAD_ARGUMENTS = [
    (nn.Linear(3, 4), TypeError, "`factories` must be a sequence"),
    ([], ValueError, "`factories` must not be empty"),
    ([nn.Linear(3, 4)], TypeError, r"`factories\[0\]` must be a zero-argument callable"),
]


@pytest.mark.parametrize(
    "factories,error,match", BAD_ARGUMENTS, ids=["module", "empty", "instance"]
)
def test_bad_factories_are_named(factories, error, match):
    with pytest.raises(error, match=match):
        vmapens.Ensemble.from_factories(factories)


# The compiled step reorders float64 arithmetic (docs/semantics.md: ~1e-16 per step, tested
# against eager to 1e-9); the padding must not add to that.
COMPILED = dict(rtol=0.0, atol=1e-9)


def test_the_compiled_step_trains_each_size_as_alone():
    # Clipped by each member's norm: the compiled step once gave padded entries gradients
    # (grad of the masked parameters), which the norm counted (2.5e-3 off alone) and Adam
    # stepped, so padded entries drifted from 0.
    factories = _factories(MLP, (4, 8))
    x, y = _data("mlp")
    ens = vmapens.Ensemble.from_factories(factories, seed=0)
    alone = ens.unstack()
    opt = vmapens.StackedAdam(ens, lr=0.02)
    step = vmapens.make_step(ens, nn.MSELoss(), opt, compile=True, clip_grad_norm=0.05)
    for _ in range(5):
        step(x, y)
    clip = functools.partial(torch.nn.utils.clip_grad_norm_, max_norm=0.05)
    for i, m in enumerate(alone):
        train_alone(m, [(x, y)] * 5, nn.functional.mse_loss, torch.optim.Adam(m.parameters(), lr=0.02), clip=clip)  # fmt: skip
        for key, v in m.state_dict().items():
            torch.testing.assert_close(ens[i].state_dict()[key], v, **COMPILED)
    masks = ens._padding.masks(ens.stacked_params())
    assert masks  # the widths differ: some tensors are padded
    for name, mask in masks.items():
        padded = ~mask.bool()
        assert not ens.stacked_params()[name][padded].any(), name
        assert not ens.stacked_params()[name].grad[padded].any(), name
        for value in opt.state[ens.stacked_params()[name]].values():
            if value.shape == mask.shape:
                assert not value[padded].any(), name


def test_fit_resumes_a_padded_ensemble_bit_identically(tmp_path):
    factories = _factories(MLP, (4, 8))
    g = torch.Generator().manual_seed(2)
    data = (torch.randn(48, 3, generator=g), torch.randn(48, 2, generator=g))

    def run(epochs: int, checkpoint=None) -> vmapens.Ensemble:
        ens = vmapens.Ensemble.from_factories(factories, seed=0)
        vmapens.fit(ens, data, nn.MSELoss(), epochs=epochs, batch_size=16, seed=0,
                    optimizer=vmapens.StackedAdam(ens, lr=0.01), checkpoint=checkpoint,
                    progress=False)  # fmt: skip
        return ens

    straight = run(4)
    run(2, tmp_path / "run.pt")
    resumed = run(4, tmp_path / "run.pt")
    for key, v in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], v), key
