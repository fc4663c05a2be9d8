"""Seeded random programs of edits on ``ens.template`` between training steps, against N plain
modules that receive the same edits.

Each program draws a member (an MLP with dropout, a CNN with BatchNorm2d, a GRU or an LSTM
with inter-layer dropout, a TransformerEncoderLayer, a custom module whose forward reads a
float attribute and a flag that switches an extra head on), how the ensemble is built
(``from_modules``, ``backend="loop"``, ``chunk_size``, members of different sizes with
``Ensemble.from_factories``), an optimizer (SGD with momentum, Adam) and 4-8 operations
interleaved with training steps (``make_step``; one program in five compiled): attribute
edits on the template (dropout's ``p``, BatchNorm's ``momentum`` with ``None`` and back,
``eps``, the custom float and flag, ``norm_first``, an attribute added and deleted), a
submodule's ``eval()``/``train()``, ``requires_grad_`` on a template layer, ``select``,
``copy.deepcopy``, ``save`` + ``load`` (then the edits again: attributes are not in files),
``ens.to(torch.float64)``, ``fit`` for one epoch, ``predict`` and ``ens(x)`` in eval mode.
A dropout draws nothing whenever results are compared (``p = 0`` or in eval mode): the
random streams of train-mode dropout are not compared here. The truth is plain torch: the
same edits on N plain modules, each trained with its own ``torch.optim`` optimizer, compared
in float64 after every operation (state dicts and eval-mode outputs).

Run one program by hand: ``python tests/test_fuzz_template.py SEED`` prints what it drew;
``python tests/test_fuzz_template.py A B [-v]`` runs seeds A..B-1.
"""

from __future__ import annotations

import copy
import functools
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.modules.linear_cross_entropy_options import LinearCrossEntropyOptions
from truth import TOL64, search, seeded_members

import vmapens

F64 = torch.float64


# -- the members ------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, hidden: int = 5) -> None:
        super().__init__()
        self.fc = nn.Linear(3, hidden)
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(hidden, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(torch.tanh(self.fc(x))))


class CNN(nn.Module):
    def __init__(self, hidden: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, hidden, 3, bias=False)
        self.bn = nn.BatchNorm2d(hidden)
        self.drop = nn.Dropout(0.4)
        self.head = nn.Linear(4 * hidden, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(torch.relu(self.bn(self.conv(x))).flatten(1)))


class Recurrent(nn.Module):
    def __init__(self, hidden: int = 4, cell: type = nn.GRU) -> None:
        super().__init__()
        self.rnn = cell(3, hidden, num_layers=2, dropout=0.3, batch_first=True)
        self.head = nn.Linear(hidden, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.rnn(x)[0]
        return self.head(out[:, -1] if self.rnn.batch_first else out[-1])


class Encoder(nn.Module):
    def __init__(self, hidden: int = 6) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(
            4, 2, dim_feedforward=hidden, dropout=0.2, batch_first=True
        )
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x)[:, 0])


class Custom(nn.Module):
    """A forward that reads a float attribute, a flag switching a head on, and an attribute
    that may be added and deleted."""

    def __init__(self, hidden: int = 4) -> None:
        super().__init__()
        self.body = nn.Linear(3, hidden)
        self.bn = nn.BatchNorm1d(hidden)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(hidden, 2)
        self.extra = nn.Linear(hidden, 2)
        self.temperature = 1.0
        self.aux = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.tanh(self.bn(self.body(x))))
        out = self.head(h) + self.extra(h) if self.aux else self.head(h)
        return out / self.temperature + getattr(self, "shift", 0.0)


#: name -> (factory of a given size, input shape after the batch dim, sizes for from_factories)
MEMBERS: dict[str, tuple[Callable[[int], nn.Module], tuple[int, ...], tuple[int, ...]]] = {
    "mlp": (MLP, (3,), (4, 7, 5)),
    "cnn": (CNN, (1, 4, 4), (3, 3, 3)),
    "gru": (functools.partial(Recurrent, cell=nn.GRU), (3, 3), (4, 5, 3)),
    "lstm": (functools.partial(Recurrent, cell=nn.LSTM), (3, 3), (4, 4, 4)),
    "encoder": (Encoder, (3, 4), (6, 8, 5)),
    "custom": (Custom, (3,), (4, 6, 3)),
}

#: Attribute edits per member: (submodule path, attribute, values drawn from).
ATTRIBUTES: dict[str, list[tuple[str, str, list[Any]]]] = {
    "mlp": [],
    "cnn": [("bn", "momentum", [None, 0.5, 0.1]), ("bn", "eps", [1e-3, 0.1])],
    "gru": [("rnn", "batch_first", [False, True])],
    "lstm": [("rnn", "batch_first", [False, True])],
    "encoder": [
        ("layer", "norm_first", [True, False]),
        ("layer", "activation", [nn.functional.gelu, nn.functional.relu]),
        ("layer.norm1", "eps", [0.5, 1e-5]),
    ],
    "custom": [
        ("", "temperature", [2.0, 0.5]),
        ("", "aux", [True, False]),
        ("bn", "momentum", [None, 0.3]),
        ("bn", "eps", [0.01]),
    ],
}


def dropouts(m: nn.Module) -> list[tuple[nn.Module, str]]:
    """Every dropout rate in ``m``: nn.Dropout's ``p``, the recurrent and attention ``dropout``."""
    out: list[tuple[nn.Module, str]] = []
    for sub in m.modules():
        if isinstance(sub, nn.Dropout):
            out.append((sub, "p"))
        elif isinstance(sub, (nn.RNNBase, nn.MultiheadAttention)):
            out.append((sub, "dropout"))
    return out


def no_draws(m: nn.Module) -> None:
    """Every dropout in train mode at rate 0 (a new float object: the template's change)."""
    for sub, name in dropouts(m):
        if sub.training and getattr(sub, name) != 0:
            setattr(sub, name, float("0"))


def made64(factory: Callable[[], nn.Module]) -> nn.Module:
    return factory().to(F64)


def x_time_first(m: nn.Module) -> bool:
    return isinstance(m, Recurrent) and not m.rnn.batch_first


# -- the draw ---------------------------------------------------------------------------------

OPS = [
    "step", "step", "step", "attr", "attr", "dropout", "mode", "freeze", "select", "deepcopy",
    "save_load", "to64", "fit", "predict", "call_eval", "index", "add_attr",
]  # fmt: skip


def draw(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    member = rng.choice(list(MEMBERS))
    build = rng.choice(["plain", "loop", "chunk", "sizes"])
    ops = [rng.choice(OPS) for _ in range(rng.randint(4, 8))]
    return dict(
        seed=seed,
        member=member,
        build=build,
        n=rng.randint(2, 3) if build != "sizes" else 3,
        opt=rng.choice(["sgd", "adam"]),
        compile=build != "loop" and rng.random() < 0.2,
        ops=[op for o in ops for op in (o, "step")],
    )


# -- both sides -------------------------------------------------------------------------------


class World:
    def __init__(self, d: dict[str, Any], tmp: Path) -> None:
        self.d, self.tmp = d, tmp
        self.rng = random.Random(d["seed"] + 1)
        self.g = torch.Generator().manual_seed(d["seed"])
        make, self.shape, sizes = MEMBERS[d["member"]]
        n = d["n"]
        self.factories = [functools.partial(make, sizes[i % len(sizes)]) for i in range(n)]
        options: dict[str, Any] = {}
        if d["build"] == "loop":
            options["backend"] = "loop"
        if d["build"] == "chunk":
            options["chunk_size"] = self.rng.choice([1, 2])
        if d["build"] == "sizes":
            self.ens = vmapens.Ensemble.from_factories(self.factories, seed=d["seed"])
            self.models = []
            for i, f in enumerate(self.factories):
                torch.manual_seed(vmapens.seeds.member_seed(d["seed"], i))
                self.models.append(f())
            self.ens.to(F64)
        else:
            self.factories = [self.factories[0]] * n
            self.models = []
            for i in range(n):
                torch.manual_seed(d["seed"] * 10 + i)
                self.models.append(self.factories[0]())
            self.ens = vmapens.Ensemble.from_modules(copy.deepcopy(self.models), **options)
            self.ens.to(F64)
        self.models = [m.to(F64) for m in self.models]
        # Every edit, in order, as a function of a module: `load` builds the members anew.
        self.log: list[Callable[[nn.Module], None]] = []
        self.edit(no_draws)
        self.fresh_optimizers()

    # the edits, on the template and on every plain module
    def edit(self, fn: Callable[[nn.Module], None]) -> None:
        self.log.append(fn)
        for m in (self.ens.template, *self.models):
            fn(m)

    def fresh_optimizers(self) -> None:
        if self.d["opt"] == "sgd":
            self.opt: Any = vmapens.StackedSGD(self.ens, lr=0.05, momentum=0.9)
            self.opts = [
                torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in self.models
            ]
        else:
            # eps well above 0: attention's key bias gets a gradient of round-off alone, which
            # Adam's normalisation would blow up to a step of the learning rate's size
            self.opt = vmapens.StackedAdam(self.ens, lr=1e-2, eps=1e-4)
            self.opts = [torch.optim.Adam(m.parameters(), lr=1e-2, eps=1e-4) for m in self.models]
        self.step = vmapens.make_step(self.ens, nn.MSELoss(), self.opt, compile=self.d["compile"])

    def batch(self, rows: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(rows, *self.shape, generator=self.g, dtype=F64)
        if x_time_first(self.ens.template):
            x = x.transpose(0, 1).contiguous()  # the recurrent layer edited to time first
        return x, torch.randn(rows, 2, generator=self.g, dtype=F64)

    def train_alone(self, x: torch.Tensor, y: torch.Tensor) -> None:
        for m, o in zip(self.models, self.opts, strict=True):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            o.step()

    def eval_outputs(self, x: torch.Tensor) -> list[torch.Tensor]:
        outs = []
        for m in self.models:
            modes = [s.training for s in m.modules()]
            outs.append(
                m.eval()(x).detach()
            )  # grad on: TransformerEncoderLayer's no-grad fast path keeps the activation it was built with
            for s, mode in zip(m.modules(), modes, strict=True):
                s.training = mode
        return outs

    def compare(self, where: str) -> None:
        ens = self.ens
        assert len(ens) == len(self.models), where
        x, _ = self.batch(4)
        want = self.eval_outputs(x)
        got = vmapens.predict(ens, x)
        for i, m in enumerate(self.models):
            member = ens[i]
            sd, truth = member.state_dict(), m.state_dict()
            assert list(sd) == list(truth), f"{where}: member {i} keys"
            for k, t in truth.items():
                torch.testing.assert_close(
                    sd[k], t, **TOL64, msg=lambda e, i=i, k=k: f"{where}: {i} {k}: {e}"
                )
            for name, p in m.named_parameters():
                assert member.get_parameter(name).requires_grad == p.requires_grad, (
                    f"{where} {name}"
                )
            modes = {k: s.training for k, s in m.named_modules()}
            assert modes == {k: s.training for k, s in ens.template.named_modules()}, where
            assert modes == {k: s.training for k, s in member.named_modules()}, where
            torch.testing.assert_close(
                got[i], want[i], **TOL64, msg=lambda e, i=i: f"{where}: predict member {i}: {e}"
            )
        # ens[i] alone, in eval mode, runs as the plain module: the edits are in it
        for i in range(len(self.models)):
            out = ens[i].eval()(x).detach()
            torch.testing.assert_close(
                out, want[i], **TOL64, msg=lambda e, i=i: f"{where}: ens[{i}]: {e}"
            )

    # the operations
    def run(self, op: str) -> None:
        rng = self.rng
        if op == "step":
            x, y = self.batch(rng.choice([4, 5]))
            self.step(x, y)
            self.train_alone(x, y)
        elif op == "attr":
            choices = ATTRIBUTES[self.d["member"]]
            if not choices:
                return self.run("dropout")
            path, name, values = rng.choice(choices)
            value = rng.choice(values)
            self.edit(lambda m: setattr(m.get_submodule(path), name, value))
        elif op == "add_attr":
            if self.d["member"] != "custom":
                return self.run("attr")
            if hasattr(self.ens.template, "shift"):
                self.edit(lambda m: delattr(m, "shift"))
            else:
                value = rng.choice([0.5, -1.0])
                self.edit(lambda m: setattr(m, "shift", value))
        elif op == "dropout":
            # A rate above 0 only where the dropout is in eval mode (it draws nothing there).
            k = rng.randrange(len(dropouts(self.ens.template)))
            rate = rng.choice([0.0, 0.25, 0.5])

            def set_rate(m: nn.Module) -> None:
                sub, name = dropouts(m)[k]
                setattr(sub, name, rate if not sub.training else float("0"))

            self.edit(set_rate)
        elif op == "mode":
            names = [k for k, _ in self.ens.template.named_modules() if k]
            path, train = rng.choice(names), rng.random() < 0.5

            def switch(m: nn.Module) -> None:
                m.get_submodule(path).train(train)
                no_draws(m)

            self.edit(switch)
        elif op == "freeze":
            names = [
                k
                for k, s in self.ens.template.named_modules()
                if k and any(True for _ in s.parameters())
            ]
            path, flag = rng.choice(names), rng.random() < 0.5
            frozen = {k for k, p in self.ens.template.named_parameters() if not p.requires_grad}
            mine = {
                f"{path}.{k}" for k, _ in self.ens.template.get_submodule(path).named_parameters()
            }
            if not flag and mine | frozen >= {k for k, _ in self.ens.template.named_parameters()}:
                flag = True  # everything frozen: nothing to train (the step refuses)
            self.edit(lambda m: m.get_submodule(path).requires_grad_(flag))
        elif op == "select":
            rows = rng.sample(range(len(self.models)), rng.randint(1, len(self.models)))
            self.ens = self.ens.select(rows)
            self.models = [copy.deepcopy(self.models[r]) for r in rows]
            self.factories = [self.factories[r] for r in rows]
            self.fresh_optimizers()
        elif op == "deepcopy":
            self.ens = copy.deepcopy(self.ens)
            self.fresh_optimizers()
        elif op == "save_load":
            path = self.tmp / "ens.pt"
            vmapens.save(self.ens, path, self.opt)
            made = [functools.partial(made64, f) for f in self.factories]
            factories = made if self.d["build"] == "sizes" else made[0]
            ens = vmapens.load(path, factories)
            self.ens = ens.to(F64)
            for fn in self.log:  # attributes, modes and flags are not in files: set them again
                fn(self.ens.template)
            self.fresh_optimizers()
        elif op == "to64":
            self.ens.to(torch.float64)
        elif op == "fit":
            if x_time_first(self.ens.template):  # fit's data is sample-first
                return self.run("step")
            x, y = self.batch(6)
            vmapens.fit(self.ens, (x, y), nn.MSELoss(), optimizer=self.opt, progress=False,
                        shuffle=False)  # fmt: skip
            self.train_alone(x, y)
        elif op == "predict":
            x, _ = self.batch(3)
            got, want = vmapens.predict(self.ens, x, reduce="mean"), self.eval_outputs(x)
            torch.testing.assert_close(got, sum(want) / len(want), **TOL64)
        elif op == "call_eval":
            x, _ = self.batch(3)
            self.ens.eval()
            for m in self.models:
                m.eval()
            with torch.no_grad():
                got = self.ens(x)
            want = self.eval_outputs(x)
            for i, w in enumerate(want):
                torch.testing.assert_close(got[i], w, **TOL64)
            self.edit(lambda m: (m.train(), no_draws(m)))
            self.ens.train()
        elif op == "index":
            i = rng.randrange(len(self.models))
            member = self.ens[i]
            for k, v in vars(self.models[i]).items():
                if not k.startswith("_") and k != "training":
                    assert getattr(member, k) == v, k
        else:
            raise AssertionError(op)
        return None


def run(d: dict[str, Any], tmp: Path) -> None:
    w = World(d, tmp)
    w.compare("built")
    for k, op in enumerate(d["ops"]):
        w.run(op)
        w.compare(f"op {k} {op}")


SEEDS = [0, 6, 8, 9, 13, 19, 27]  # lstm sizes, encoder load, cnn chunk, lstm load, gru, custom x2


@pytest.mark.parametrize("seed", SEEDS)
def test_seeded_template_edits(seed: int, tmp_path: Path) -> None:
    run(draw(seed), tmp_path)


# -- what the programs and the probes around them found, one test each ----------------------


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.act = nn.Linear(3, 2), nn.Tanh()
        self.scale: Any = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.scale[0] if isinstance(self.scale, tuple) else self.scale
        return self.act(self.fc(x)) / scale  # 1 / -0.0 is -inf, 1 / 0.0 is inf


def _scaled_pair() -> tuple[vmapens.Ensemble, list[nn.Module]]:
    models = seeded_members(lambda: Scaled().to(F64), 2)
    return vmapens.Ensemble.from_modules(copy.deepcopy(models)), models


@pytest.mark.parametrize("value", [-0.0, (-0.0,)], ids=["float", "tuple"])
def test_the_sign_of_a_zero_set_on_the_template_is_followed(value: Any) -> None:
    # An equal value by `==` counted as unchanged (kept for sizes, which a padded template
    # must keep), and -0.0 == 0.0: the copies kept 0.0, the members divided by +0.
    ens, models = _scaled_pair()
    ens.template.scale = (0.0,) if isinstance(value, tuple) else 0.0
    x = torch.randn(4, 3, dtype=F64)
    ens(x)
    ens.template.scale = value
    for m in models:
        m.scale = value
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in models]), **TOL64)


def test_linear_cross_entropy_options_set_on_the_template_keep_the_gradients() -> None:
    # The runner keeps LinearCrossEntropyLoss on its reference path (its chunked path gives
    # batched weights no gradient); `options` set on the template was set on the runner too,
    # and the loss's weights stopped training, silently.
    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.loss = nn.Linear(3, 4), nn.LinearCrossEntropyLoss(4, 5)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self.loss(torch.tanh(self.fc(x)), y)

    models = seeded_members(lambda: Classifier().to(F64), 2)
    ens = vmapens.Ensemble.from_modules(copy.deepcopy(models))
    opt = vmapens.StackedSGD(ens, lr=0.1)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    g = torch.Generator().manual_seed(0)
    for k in range(3):
        x, y = torch.randn(6, 3, generator=g, dtype=F64), torch.randint(5, (6,), generator=g)
        if k == 1:
            options = LinearCrossEntropyOptions()
            for m in (ens.template, *models):
                m.loss.options = options
        opt.zero_grad()
        ens(x, y).sum().backward()
        opt.step()
        for m, o in zip(models, opts, strict=True):
            o.zero_grad()
            m(x, y).backward()
            o.step()
    for i, m in enumerate(models):
        for k, t in m.state_dict().items():
            torch.testing.assert_close(ens[i].state_dict()[k], t, **TOL64, msg=k)


@pytest.mark.parametrize("how", ["replace", "add", "delete"])
def test_a_submodule_replaced_on_the_template_is_refused(how: str, tmp_path: Path) -> None:
    # The copies the members run keep the submodules they were built with: `ens.template.act
    # = nn.Sigmoid()` ran Tanh in every member while ens[i] showed Sigmoid, silently.
    ens, models = _scaled_pair()
    ens.template.scale = 2.0
    for m in models:
        m.scale = 2.0
    x = torch.randn(4, 3, dtype=F64)
    built = ens.template.act
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    if how == "replace":
        ens.template.act = nn.Sigmoid()
    elif how == "add":
        ens.template.extra = nn.ReLU()
    else:
        del ens.template.act
    with pytest.raises(ValueError, match=r"`ens.template.(act|extra)` was replaced, added or del"):
        ens(x)
    with pytest.raises(ValueError, match=r"`ens.template.(act|extra)` was replaced, added or del"):
        vmapens.save(ens, tmp_path / "ens.pt")  # no file of what the template no longer shows
    assert not (tmp_path / "ens.pt").exists()
    if how == "add":
        del ens.template.extra
    else:
        ens.template.act = built  # the built one back: the ensemble runs again
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in models]), **TOL64)


class Keeps(nn.Module):
    """A forward that keeps a tensor in a plain attribute (``self.last = h``)."""

    def __init__(self, hidden: int = 4) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(3, hidden), nn.Linear(hidden, 2)
        self.last: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last = torch.tanh(self.fc(x))
        return self.head(self.last)


@pytest.mark.parametrize("then", ["index", "select", "deepcopy"])
def test_a_tensor_a_forward_keeps_on_the_template_is_not_followed(then: str) -> None:
    # With backend="loop" the template itself runs: its `last` (the last member's, with its
    # graph) was followed into the padded templates, and ens[i], select and deepcopy, which
    # copy those, failed (torch deep-copies no tensor with a graph).
    factories = [functools.partial(Keeps, h) for h in (4, 6)]
    ens = vmapens.Ensemble.from_factories(factories, seed=0, backend="loop").to(F64)
    models = []
    for i, f in enumerate(factories):
        torch.manual_seed(vmapens.seeds.member_seed(0, i))
        models.append(f().to(F64))
    opt = vmapens.StackedSGD(ens, lr=0.1)
    step = vmapens.make_step(ens, nn.MSELoss(), opt)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    x, y = torch.randn(5, 3, dtype=F64), torch.randn(5, 2, dtype=F64)
    for _ in range(2):
        step(x, y)
        for m, o in zip(models, opts, strict=True):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
    copies = {"index": lambda e: e, "select": lambda e: e.select([0, 1]), "deepcopy": copy.deepcopy}
    other = copies[then](ens)
    for i, m in enumerate(models):
        member = other[i]
        assert member.last is None  # a copy starts as a module that has not run
        for k, t in m.state_dict().items():
            torch.testing.assert_close(member.state_dict()[k], t, **TOL64, msg=k)


if __name__ == "__main__":
    search(lambda seed, tmp: run(draw(seed), tmp), draw)
