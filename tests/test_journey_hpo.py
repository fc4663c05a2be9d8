"""User journey: sweeping hyperparameters that live in the module or the loss, not the optimizer.

A researcher sweeps a dropout rate, a LeakyReLU slope, a LayerNorm `eps`, an activation class,
a temperature kept as a plain float, BatchNorm's `momentum`; in the loss a label smoothing, a
focal-loss gamma and BCE's `pos_weight`, one value per member. docs/semantics.md: one forward
runs every member with member 0's submodules and settings, so building refuses members whose
settings differ, naming the member, the attribute and both values; a value that differs per
member belongs in a buffer; `Sweep`'s `space` names optimizer hyperparameters only. So this
file tries what a user tries first (a factory drawing `random.choice`, `from_factories` with
one `partial` per value, `from_modules`, a factory taking the member's index, `space`
returning `p`, editing `ens[i].drop.p`), then the documented way: the swept values as buffers,
per-member loss arguments through `per_member(..., in_dims=...)`.

The truth is the naive loop in plain PyTorch: each member a module built with its own values
(after `torch.manual_seed(member_seed(0, i))`, docs/semantics.md "Seeds") and trained alone
with `torch.optim.Adam` on the same batches, float64; with dropout, each member alone from
the same global RNG state, which `randomness="same"` promises bit for bit (docs/semantics.md,
"Randomness in the forward pass").

Found here: a module hook that holds a per-member value (`register_forward_hook(lambda m, a,
out: out * s)`) was not compared at build: every member ran member 0's hook, and `ens[i]`
held it too (patch /work/notes/patches/hpo-1.patch).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import vmapens
from vmapens.seeds import member_seed
from vmapens.sweep import Sweep

TOL: dict[str, Any] = dict(rtol=1e-9, atol=1e-10)
DT = torch.float64
SLOPES, TEMPS, PS = (0.01, 0.2, 0.5), (1.0, 0.5, 2.0), (0.0, 0.25, 0.5)


def _data(seed: int, *shape: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


def alone(factories: list[Any], seed: int = 0) -> list[nn.Module]:
    """Member i built alone: the torch seed docs/semantics.md gives it, then its factory."""
    out = []
    for i, f in enumerate(factories):
        torch.manual_seed(member_seed(seed, i))
        out.append(f())
    return out


# -- what a user tries first: members that differ in a plain setting -------------------------


class Net(nn.Module):
    """The researcher's model: every swept setting a constructor argument, kept as torch does."""

    def __init__(
        self,
        p: float = 0.1,
        slope: float = 0.01,
        eps: float = 1e-5,
        act: str = "leaky",
        temperature: float = 1.0,
        momentum: float | None = 0.1,
    ) -> None:
        super().__init__()
        self.fc1 = nn.Linear(3, 6, dtype=DT)
        self.bn = nn.BatchNorm1d(6, momentum=momentum, dtype=DT)
        self.act = nn.LeakyReLU(slope) if act == "leaky" else nn.GELU()
        self.drop = nn.Dropout(p)
        self.ln = nn.LayerNorm(6, eps=eps, dtype=DT)
        self.fc2 = nn.Linear(6, 2, dtype=DT)
        self.temperature = temperature

    def forward(self, x: Tensor) -> Tensor:
        h = self.ln(self.drop(self.act(self.bn(self.fc1(x)))))
        return self.fc2(h) / self.temperature


# setting -> (the two members' constructor arguments, what the message must name)
SETTINGS: dict[str, tuple[dict, dict, tuple[str, ...]]] = {
    "dropout-p": ({"p": 0.1}, {"p": 0.3}, ("`drop` (Dropout)", "`p`", "0.3", "0.1")),
    "leaky-slope": (
        {"slope": 0.01},
        {"slope": 0.2},
        ("`act` (LeakyReLU)", "`negative_slope`", "0.2", "0.01"),
    ),
    "layernorm-eps": (
        {"eps": 1e-5},
        {"eps": 1e-3},
        ("`ln` (LayerNorm)", "`eps`", "0.001", "1e-05"),
    ),
    "activation": ({"act": "leaky"}, {"act": "gelu"}, ("`act`", "GELU", "LeakyReLU")),
    "temperature": ({"temperature": 1.0}, {"temperature": 0.5}, ("`temperature`", "0.5", "1.0")),
    "bn-momentum": (
        {"momentum": 0.1},
        {"momentum": 0.01},
        ("`bn` (BatchNorm1d)", "`momentum`", "0.01", "0.1"),
    ),
    "bn-cumulative": (
        {"momentum": 0.1},
        {"momentum": None},
        ("`bn` (BatchNorm1d)", "`momentum`", "None", "0.1"),
    ),
}


@pytest.mark.parametrize("how", ["factory-draws", "from_factories", "from_modules"])
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_members_that_differ_in_a_layer_setting_are_refused_naming_both_values(
    setting: str, how: str
) -> None:
    # The user's sweep: one value per member, built the three ways the docs name. Building
    # refuses it (one forward would run member 1 with member 0's value), naming member 1, the
    # layer, the attribute and both values; a build that went through would be the silent bug.
    first, second, named = SETTINGS[setting]
    kwargs = [first, second]
    with pytest.raises(ValueError, match="member 1") as err:
        if how == "factory-draws":  # `Net(p=random.choice(ps))`: member 1 draws the other
            draws = iter(kwargs)
            vmapens.Ensemble(lambda: Net(**next(draws)), n=2, seed=0)
        elif how == "from_factories":
            vmapens.Ensemble.from_factories([functools.partial(Net, **k) for k in kwargs], seed=0)
        else:
            vmapens.Ensemble.from_modules([Net(**k) for k in kwargs])
    for part in named:
        assert part in str(err.value), (part, str(err.value))


class Closes(nn.Module):
    """The slope held by a function: a lambda's closure, a `partial`'s keyword, a config object."""

    def __init__(self, slope: float, kind: str) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2, dtype=DT)
        if kind == "lambda":
            self.act = lambda h: F.leaky_relu(h, slope)
        elif kind == "partial":
            self.act = functools.partial(F.leaky_relu, negative_slope=slope)
        else:  # a plain config object, as a researcher's `cfg` holds the run's settings
            self.cfg = type("Config", (), {})()
            self.cfg.slope = slope
            self.act = lambda h: F.leaky_relu(h, self.cfg.slope)

    def forward(self, x: Tensor) -> Tensor:
        return self.act(self.fc(x))


@pytest.mark.parametrize("kind", ["lambda", "partial", "config"])
def test_a_slope_held_by_a_function_or_a_config_object_is_refused_per_member(kind: str) -> None:
    attribute = "`cfg`" if kind == "config" else "`act`"
    with pytest.raises(ValueError, match=f"member 1 differs from member 0 at Closes: {attribute}"):
        vmapens.Ensemble.from_factories(
            [functools.partial(Closes, s, kind) for s in (0.01, 0.3)], seed=0
        )


@pytest.mark.parametrize("kind", ["lambda", "config"])
def test_a_refused_lambda_or_config_object_shows_the_values_that_differ(kind: str) -> None:
    with pytest.raises(ValueError, match="member 1 differs from member 0") as err:
        vmapens.Ensemble.from_factories(
            [functools.partial(Closes, s, kind) for s in (0.01, 0.3)], seed=0
        )
    assert "0.3" in str(err.value) and "0.01" in str(err.value), str(err.value)


def test_a_factory_that_takes_the_member_index_fails_before_any_member_is_built() -> None:
    # `Ensemble(lambda i: Net(p=ps[i]), n)` is not the API (a zero-argument factory; one
    # factory per member is `from_factories`): it raises the call's own TypeError, and the
    # global RNG is as it was.
    state = torch.get_rng_state()
    with pytest.raises(TypeError, match="missing 1 required positional argument"):
        vmapens.Ensemble(lambda i: Net(p=PS[i]), n=3, seed=0)
    assert torch.equal(state, torch.get_rng_state())


def test_a_sweep_space_that_names_a_module_setting_is_refused_before_any_trial() -> None:
    # `space` names optimizer hyperparameters only (docs/workflows.md): a dropout rate there
    # is refused by `run` before it asks for a trial, naming it and what the optimizer takes.
    x, y = _data(0, 8, 3), _data(1, 8, 2)

    def space(trial: Any) -> dict[str, Any]:
        return {"lr": trial.suggest_float("lr", 1e-3, 1e-1), "p": trial.suggest_float("p", 0, 0.5)}

    sweep = Sweep(Net, space, backend="random", seed=0)
    with pytest.raises(ValueError, match=r"`space` returned \['p'\], which StackedAdam does not"):
        sweep.run((x, y), nn.MSELoss(), n_trials=2, epochs=1, val_data=(x, y), progress=False)


def test_template_settings_reach_every_member_and_a_members_copy_changes_nothing() -> None:
    # `ens.template.act.negative_slope = ...` is the documented edit (every member follows it,
    # as every plain module edited alike); `ens[1].drop.p = ...` edits a fresh copy of member 1
    # (docs/semantics.md: `ens[i]` builds a module when asked), which the ensemble never runs.
    ens = vmapens.Ensemble(Net, n=3, seed=0).eval()
    plain = [m.eval() for m in alone([Net] * 3)]
    x = _data(2, 5, 3)
    copy = ens[1]
    copy.drop.p, copy.act.negative_slope = 0.9, 0.7
    assert ens[1].drop.p == 0.1 and ens.template.act.negative_slope == 0.01
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in plain]), **TOL)
    ens.template.act.negative_slope, ens.template.ln.eps = 0.3, 1e-2
    for m in plain:
        m.act.negative_slope, m.ln.eps = 0.3, 1e-2
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in plain]), **TOL)
    assert ens[2].act.negative_slope == 0.3 and ens[2].ln.eps == 1e-2


class Rounds(nn.Module):
    """A width sweep whose own int setting is no size: how many times the mixing layer runs."""

    def __init__(self, hidden: int, rounds: int) -> None:
        super().__init__()
        self.inp, self.mix = nn.Linear(3, hidden, dtype=DT), nn.Linear(hidden, hidden, dtype=DT)
        self.out = nn.Linear(hidden, 1, dtype=DT)
        self.rounds = rounds

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        for _ in range(self.rounds):
            h = torch.tanh(self.mix(h))
        return self.out(h)


def test_a_width_sweep_whose_int_setting_is_no_size_is_refused_at_the_first_step() -> None:
    # docs/semantics.md: ints of your class may differ between sizes (taken as sizes); the
    # padded forward runs the largest member's module, so member 0 runs 3 rounds, not its 1.
    # The first-step self-check runs each size's first member alone: refused, nothing changed.
    ens = vmapens.Ensemble.from_factories(
        [functools.partial(Rounds, 4, 1), functools.partial(Rounds, 8, 3)], seed=0
    )
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-2))
    with pytest.raises(RuntimeError, match="member 0 of Rounds computes something else"):
        step(_data(3, 5, 3), _data(4, 5, 1))
    torch.testing.assert_close(ens.state_dict(), before, rtol=0, atol=0)
    assert ens[0].rounds == 1 and ens[1].rounds == 3


# -- a per-member value in a module hook: not compared at build ------------------------------


def _scale_hook(module: nn.Module, args: Any, out: Tensor, scale: float) -> Tensor:
    return out * scale


class Hooked(nn.Module):
    """A temperature applied by a hook the module registers in its own `__init__` (run batched,
    docs/semantics.md); `scale=None` registers none."""

    def __init__(self, scale: float | None, kind: str) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2, dtype=DT)
        if scale is None:
            return
        if kind == "lambda":
            self.fc.register_forward_hook(lambda m, a, out: out * scale)
        elif kind == "partial":
            self.fc.register_forward_hook(functools.partial(_scale_hook, scale=scale))
        else:
            self.register_forward_pre_hook(lambda m, a: (a[0] * scale,))

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x)


@pytest.mark.parametrize(
    ("kind", "scales"),
    [
        ("lambda", (1.0, 5.0)),
        ("partial", (1.0, 5.0)),
        ("pre-hook", (1.0, 5.0)),
        ("lambda", (None, 5.0)),
    ],  # fmt: skip
    ids=["forward-hook-lambda", "forward-hook-partial", "pre-hook", "member-0-has-none"],
)
def test_a_per_member_value_in_a_module_hook_is_refused_or_runs_as_alone(
    kind: str, scales: tuple
) -> None:
    factories = [functools.partial(Hooked, s, kind) for s in scales]
    try:
        ens = vmapens.Ensemble.from_factories(factories, seed=0)
    except ValueError as err:  # refused: the member, the hook and both values named
        assert "member 1 differs from member 0" in str(err) and "hooks" in str(err)
        assert "5.0" in str(err), str(err)
        return
    plain, x = alone(factories), _data(5, 4, 3)
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in plain]), **TOL)
    torch.testing.assert_close(ens[1](x), plain[1](x), **TOL)


def test_the_same_hook_closing_over_the_member_itself_still_builds_and_runs_as_alone() -> None:
    # What the fix must keep: a hook reading the member's own attribute (one per member, each
    # member's own copy, docs/semantics.md), the same in every member.
    class Gain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.gain = nn.Linear(3, 2, dtype=DT), 2.0
            self.fc.register_forward_hook(lambda m, a, out: out * self.gain)

        def forward(self, x: Tensor) -> Tensor:
            return self.fc(x)

    ens, plain, x = vmapens.Ensemble(Gain, n=2, seed=0), alone([Gain] * 2), _data(6, 4, 3)
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in plain]), **TOL)


# -- the documented way: swept values in buffers, loss arguments per member --------------------


class Swept(nn.Module):
    """The researcher's model rewritten as docs/semantics.md says: the swept values in buffers
    (stacked per member), read by ops that take a tensor (F.leaky_relu and F.dropout take a
    Python float); the dropout written out, drawing `torch.rand_like` as a user would."""

    def __init__(self, slope: float = 0.01, temperature: float = 1.0, p: float = 0.0) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(3, 6, dtype=DT), nn.Linear(6, 2, dtype=DT)
        self.register_buffer("slope", torch.tensor(slope, dtype=DT))
        self.register_buffer("temperature", torch.tensor(temperature, dtype=DT))
        self.register_buffer("p", torch.tensor(p, dtype=DT))

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)
        h = torch.where(h >= 0, h, h * self.slope)
        if self.training:
            h = h * (torch.rand_like(h) >= self.p) / (1 - self.p)
        return self.fc2(h) / self.temperature


def test_swept_values_as_buffers_train_each_member_as_alone_with_its_own_values(
    tmp_path: Path,
) -> None:
    # Dropout on: `randomness="same"` gives each member the draw it makes alone from the same
    # global RNG state; 3 Adam steps through make_step, then ens[i], unstack() and member
    # files each carry member i's own values and weights, loading into a plain Swept().
    factories = [functools.partial(Swept, *v) for v in zip(SLOPES, TEMPS, PS, strict=True)]
    ens = vmapens.Ensemble.from_factories(factories, seed=0, randomness="same")
    plain = alone(factories)
    batches = [(_data(10 + k, 5, 3), _data(20 + k, 5, 2)) for k in range(3)]
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=0.05))
    torch.manual_seed(7)
    for x, y in batches:
        step(x, y)
    for m in plain:  # each alone, from the same RNG state
        opt = torch.optim.Adam(m.parameters(), lr=0.05)
        torch.manual_seed(7)
        for x, y in batches:
            opt.zero_grad()
            F.mse_loss(m(x), y).backward()
            opt.step()
    paths = vmapens.save_members(ens, tmp_path / "members")
    members = ens.unstack()
    for i, m in enumerate(plain):
        torch.testing.assert_close(ens[i].state_dict(), m.state_dict(), **TOL)
        torch.testing.assert_close(members[i].state_dict(), m.state_dict(), **TOL)
        loaded = Swept()
        loaded.load_state_dict(vmapens.load_member(paths[i]))
        torch.testing.assert_close(loaded.state_dict(), m.state_dict(), **TOL)
        assert (float(loaded.slope), float(loaded.p)) == (SLOPES[i], PS[i])


def test_per_member_loss_arguments_train_each_member_with_its_own_value() -> None:
    # The loss side, a loop written by hand (README): label smoothing and a focal gamma per
    # member through `per_member(..., in_dims=(0, None, 0, 0))`, pos_weight per member
    # positionally (a keyword tensor would reach every member whole, docs/semantics.md).
    smoothing, gamma = torch.tensor([0.0, 0.1, 0.3], dtype=DT), torch.tensor([0.0, 1.0, 2.0])
    pos_weight = torch.tensor([[1.0, 1.0], [2.0, 3.0], [5.0, 0.5]], dtype=DT)

    def head() -> nn.Module:
        return nn.Linear(3, 5, dtype=DT)

    def loss(out: Tensor, y: Tensor, ls: Tensor, g: Tensor) -> Tensor:
        logp = F.log_softmax(out[:, :3], -1).gather(-1, y[:, :1]).squeeze(-1)
        focal = (-((1 - logp.exp()) ** g) * logp).mean()
        smooth = F.cross_entropy(out[:, :3], y[:, 0], label_smoothing=ls)
        return focal + smooth

    def bce(out: Tensor, t: Tensor, w: Tensor) -> Tensor:
        return F.binary_cross_entropy_with_logits(out[:, 3:], t, pos_weight=w)

    ens = vmapens.Ensemble(head, n=3, seed=0)
    plain = alone([head] * 3)
    opt = vmapens.StackedAdam(ens, lr=0.05)
    g = torch.Generator().manual_seed(0)
    batches = [
        (_data(30 + k, 6, 3), torch.randint(3, (6, 1), generator=g),
         torch.randint(2, (6, 2), generator=g).to(DT))
        for k in range(3)
    ]  # fmt: skip
    for x, y, t in batches:
        out = ens(x)
        total = vmapens.per_member(loss, in_dims=(0, None, 0, 0))(out, y, smoothing, gamma)
        total = total + vmapens.per_member(bce, in_dims=(0, None, 0))(out, t, pos_weight)
        opt.zero_grad()
        total.sum().backward()
        opt.step()
    for i, m in enumerate(plain):
        torch_opt = torch.optim.Adam(m.parameters(), lr=0.05)
        for x, y, t in batches:
            out = m(x)
            logp = F.log_softmax(out[:, :3], -1).gather(-1, y).squeeze(-1)
            focal = (-((1 - logp.exp()) ** float(gamma[i])) * logp).mean()
            ce = nn.CrossEntropyLoss(label_smoothing=float(smoothing[i]))(out[:, :3], y[:, 0])
            b = nn.BCEWithLogitsLoss(pos_weight=pos_weight[i])(out[:, 3:], t)
            torch_opt.zero_grad()
            (focal + ce + b).backward()
            torch_opt.step()
        torch.testing.assert_close(ens[i].state_dict(), m.state_dict(), **TOL)
