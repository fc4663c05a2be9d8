"""Seeded random programs on ensembles of members of different sizes, against members alone.

Each case draws a family of members of different widths (``Ensemble.from_factories``): MLPs of
two hidden widths (PReLU or another activation, BatchNorm, a LayerNorm over the unpadded
input), a CNN of different channel counts (BatchNorm, or InstanceNorm with or without running
statistics), an Embedding whose weight is tied to the output layer, GRU/LSTM of different
hidden sizes and layers; two or three sizes, in random order, some repeated; ``chunk_size`` or
``backend="loop"``. Then a stacked optimizer (SGD with momentum, dampening or Nesterov,
Adam/AdamW with amsgrad, RMSprop centred or with momentum, Adagrad with a non-zero initial
accumulator, Adamax, NAdam) over one param group or two (weights; the rest with a learning
rate of its own), per-member learning rates and weight decay, gradient clipping by norm or by
value, and a random program of: steps on batches of several sizes (with a member mask),
train/eval, ``predict``, new per-member learning rates, ``select`` of rows (repeats included)
with ``opt.select``, ``state_dict``/``load_state_dict`` (``assign=True`` too) into a
re-initialised copy (``apply``), ``vmapens.save``/``load``/``restore``, ``save_members`` loaded
into each member's own class, channels-last, the hand-off of a member's optimizer state to a
plain torch optimizer (which then trains it on), and the optimizers padding refuses
(Adafactor, Muon: refused, nothing changed).

The truth is each member built by its own factory (``member_seed``) at its own size and
trained alone with ``torch.optim``, same batches, float64. After every operation each member's
parameters, buffers and optimizer state equal its twin's (1e-12), and the padded entries of
every parameter, gradient, buffer and optimizer state hold what docs/semantics.md promises,
computed from the twins' own shapes.

Run more seeds by hand: ``python tests/test_fuzz_padded.py 0 300`` runs seeds 0..299 and
prints the failures; ``python tests/test_fuzz_padded.py 17`` prints seed 17's case and runs it.
"""

from __future__ import annotations

import copy
import functools
import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from truth import assert_bit_identical, search

import vmapens

# float64: only the order of sums differs; 1e-12 relative also covers RMSprop's state (~10)
EXACT = dict(rtol=1e-12, atol=1e-12)

# -- the members ------------------------------------------------------------------------------


def _act(name: str, width: int) -> nn.Module:
    if name == "prelu":
        return nn.PReLU(width, init=0.1)  # one slope per unit: padded like a bias
    return {"sigmoid": nn.Sigmoid(), "tanh": nn.Tanh(), "softplus": nn.Softplus()}[name]


class MLP(nn.Module):
    """Two hidden widths; BatchNorm right after a Linear (its padded input is exactly 0)."""

    def __init__(self, widths: tuple[int, int], act: str, norm: bool, layernorm: bool) -> None:
        super().__init__()
        self.widths = widths
        a, b = widths
        # Over the unpadded input; not before BatchNorm, which cancels its bias (gradient 0).
        self.inp = nn.LayerNorm(3) if layernorm and not norm else nn.Identity()
        # No bias before BatchNorm: its true gradient is 0, Adam would amplify round-off.
        self.fc1 = nn.Linear(3, a, bias=not norm)
        self.fc2, self.out = nn.Linear(a, b), nn.Linear(b, 2)
        self.bn = nn.BatchNorm1d(a) if norm else nn.Identity()
        self.act1, self.act2 = _act(act, a), _act(act, b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act1(self.bn(self.fc1(self.inp(x))))
        return self.out(self.act2(self.fc2(h)))


class CNN(nn.Module):
    """BatchNorm or InstanceNorm (with or without running statistics) over channels; no
    bias before either (a norm cancels it: its true gradient is 0)."""

    def __init__(self, channels: tuple[int, int], act: str, norm: str) -> None:
        super().__init__()
        a, b = channels
        norms = {
            "batch": lambda: nn.BatchNorm2d(a),
            "instance": lambda: nn.InstanceNorm2d(a, affine=True),
            "instance-stats": lambda: nn.InstanceNorm2d(a, track_running_stats=True),
        }
        self.net = nn.Sequential(
            nn.Conv2d(1, a, 3, padding=1, bias=False), norms[norm](),
            nn.Sigmoid() if act == "sigmoid" else _act(act, a) if act == "prelu" else nn.ReLU(),
            nn.Conv2d(a, b, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(b, 2),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Tied(nn.Module):
    """An Embedding whose weight is the output layer's (weight tying, as in language models)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.embed, self.mix = nn.Embedding(7, dim), nn.Linear(dim, dim)
        self.head = nn.Linear(dim, 7, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(x))).mean(1))


class Recurrent(nn.Module):
    def __init__(self, hidden: int, cell: str, layers: int) -> None:
        super().__init__()
        self.rnn = getattr(nn, cell)(3, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0][:, -1])


def _family(rng: random.Random) -> tuple[str, Callable[[int], nn.Module], str]:
    """(description, size -> module, data kind)."""
    kind = rng.choice(["mlp", "cnn", "tied", "rnn"])
    if kind == "mlp":
        act, norm, ln, extra = (
            rng.choice(["sigmoid", "tanh", "softplus", "prelu"]), rng.random() < 0.5,
            rng.random() < 0.3, rng.randint(0, 2),
        )  # fmt: skip
        make: Any = lambda s: MLP((s, s + extra), act, norm, ln)  # noqa: E731
        return f"MLP(act={act}, bn={norm}, ln={ln}, +{extra})", make, "mlp"
    if kind == "cnn":
        act, extra = rng.choice(["sigmoid", "relu", "prelu"]), rng.randint(0, 1)
        norm = rng.choice(["batch", "instance", "instance-stats"])
        return f"CNN({act}, {norm}, +{extra})", lambda s: CNN((s, s + extra), act, norm), "cnn"
    if kind == "tied":
        return "Tied", Tied, "tied"
    cell, layers = rng.choice(["GRU", "LSTM"]), rng.randint(1, 2)
    return f"{cell}x{layers}", lambda s: Recurrent(s, cell, layers), "rnn"


def _batch(kind: str, rows: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = {
        "mlp": lambda: torch.randn(rows, 3, generator=g),
        "cnn": lambda: torch.randn(rows, 1, 4, 4, generator=g),
        "tied": lambda: torch.randint(0, 7, (rows, 3), generator=g),
        "rnn": lambda: torch.randn(rows, 4, 3, generator=g),
    }[kind]()
    outputs = {"mlp": 2, "cnn": 2, "tied": 7, "rnn": 1}[kind]
    return x, torch.randn(rows, outputs, generator=g)


# -- the optimizers: a spec, and the stacked optimizer and each twin's built from it ----------


def _optimizer(rng: random.Random, n: int) -> dict[str, Any]:
    name = rng.choice(["SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adamax", "NAdam"])
    lrs = [rng.choice([0.003, 0.01, 0.03]) for _ in range(n)]
    shared: dict[str, Any] = {}
    if name == "SGD":
        momentum = rng.choice([0.0, 0.9])
        shared = dict(momentum=momentum)
        if momentum and rng.random() < 0.5:
            shared["nesterov"] = True
        elif momentum:
            shared["dampening"] = rng.choice([0.0, 0.3])
        lrs = [10 * lr for lr in lrs]
    elif name in ("Adam", "AdamW"):
        shared = dict(amsgrad=rng.random() < 0.5)
    elif name == "RMSprop":
        shared = dict(centered=rng.random() < 0.5, momentum=rng.choice([0.0, 0.5]))
    elif name == "Adagrad":
        shared = dict(initial_accumulator_value=rng.choice([0.0, 0.2]), lr_decay=0.01)
    decay = [rng.choice([0.0, 0.1]) for _ in range(n)] if rng.random() < 0.6 else None
    groups = rng.random() < 0.4
    return dict(name=name, lr=lrs, shared=shared, weight_decay=decay, groups=groups)


def _groups(named: dict[str, Any], split: bool) -> Any:
    """All parameters, or two param groups by name: the weights with the optimizer's own
    settings, the rest with a shared lr of their own and no weight decay."""
    if not split:
        return list(named.values())
    weights = [p for name, p in named.items() if name.endswith("weight")]
    rest = [p for name, p in named.items() if not name.endswith("weight")]
    return [
        {"params": weights},
        *([{"params": rest, "lr": 0.02, "weight_decay": 0.0}] * bool(rest)),
    ]


def _build_stacked(spec: dict[str, Any], ens: vmapens.Ensemble) -> vmapens.StackedOptimizer:
    kwargs = dict(spec["shared"], lr=spec["lr"])
    if spec["weight_decay"] is not None:
        kwargs["weight_decay"] = spec["weight_decay"]
    params = _groups(ens.stacked_params(), spec["groups"])
    return vmapens.optim.stacked(getattr(torch.optim, spec["name"]))(params, **kwargs)


def _build_plain(spec: dict[str, Any], m: nn.Module, i: int) -> torch.optim.Optimizer:
    kwargs = dict(spec["shared"], lr=spec["lr"][i])
    if spec["weight_decay"] is not None:
        kwargs["weight_decay"] = spec["weight_decay"][i]
    params = _groups(dict(m.named_parameters()), spec["groups"])
    return getattr(torch.optim, spec["name"])(params, **kwargs)


# -- the case ---------------------------------------------------------------------------------

OPS = ["step", "step", "step", "mode", "predict", "select", "state_dict", "save", "members",
       "handoff", "refused", "lr", "assign", "layout"]  # fmt: skip


def draw(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    desc, make, kind = _family(rng)
    base = rng.sample([1, 2, 3, 4], rng.randint(2, 3))
    sizes = [rng.choice(base) for _ in range(rng.randint(2, 4))]
    sizes[: len(base)] = base  # every drawn size present at least once
    rng.shuffle(sizes)
    clip = rng.choice([None, None, ("norm", rng.choice([0.05, 0.5])), ("value", 0.02)])
    options = rng.choice([{}, {}, {"chunk_size": 2}, {"backend": "loop"}])
    program = [rng.choice(OPS) for _ in range(rng.randint(4, 8))]
    program.append("step")
    return dict(
        seed=seed, family=desc, make=make, kind=kind, sizes=sizes, clip=clip, options=options,
        optimizer=_optimizer(rng, len(sizes)), program=program,
    )  # fmt: skip


def _show(spec: dict[str, Any]) -> str:
    return str({k: v for k, v in spec.items() if k != "make"})


def _reset(m: nn.Module) -> None:
    if hasattr(m, "reset_parameters"):
        m.reset_parameters()


class Case:
    """The ensemble, its optimizer and step, and the twins: one plain module and torch
    optimizer per member."""

    def __init__(self, spec: dict[str, Any], tmp: Path) -> None:
        self.spec, self.tmp, self.rng = spec, tmp, random.Random(spec["seed"] + 1)
        self.g = torch.Generator().manual_seed(spec["seed"])
        self.factories = [functools.partial(spec["make"], s) for s in spec["sizes"]]
        self.ens = vmapens.Ensemble.from_factories(
            self.factories, seed=spec["seed"], **spec["options"]
        )
        self.alone = []
        for i, f in enumerate(self.factories):
            torch.manual_seed(vmapens.seeds.member_seed(spec["seed"], i))
            self.alone.append(f())
        self.opt_spec = copy.deepcopy(spec["optimizer"])
        self.opt = _build_stacked(self.opt_spec, self.ens)
        self.opts = [_build_plain(self.opt_spec, m, i) for i, m in enumerate(self.alone)]
        self._new_step()

    def _new_step(self) -> None:
        clip = self.spec["clip"]
        options = {} if clip is None else {f"clip_grad_{clip[0]}": clip[1]}
        self.step = vmapens.make_step(self.ens, nn.MSELoss(), self.opt, **options)

    def _clip(self, m: nn.Module) -> None:
        clip = self.spec["clip"]
        if clip is not None and clip[0] == "norm":
            torch.nn.utils.clip_grad_norm_(m.parameters(), clip[1])
        elif clip is not None:
            torch.nn.utils.clip_grad_value_(m.parameters(), clip[1])

    # -- the operations ---------------------------------------------------------------------

    def op_step(self) -> None:
        x, y = _batch(self.spec["kind"], self.rng.randint(3, 6), self.g)
        n = len(self.alone)
        mask = None
        if self.rng.random() < 0.3:
            mask = torch.tensor([self.rng.random() < 0.6 for _ in range(n)])
        self.step(x, y, mask)
        for i, (m, opt) in enumerate(zip(self.alone, self.opts, strict=True)):
            if mask is not None and not mask[i]:
                continue
            opt.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            self._clip(m)
            opt.step()

    def op_mode(self) -> None:
        train = not self.ens.training
        self.ens.train(train)
        for m in self.alone:
            m.train(train)

    def op_predict(self) -> None:
        x, _ = _batch(self.spec["kind"], 5, self.g)
        out = vmapens.predict(self.ens, x)
        for i, m in enumerate(self.alone):
            was = m.training
            with torch.no_grad():
                torch.testing.assert_close(out[i], m.eval()(x), **EXACT)
            m.train(was)

    def op_select(self) -> None:
        n = len(self.alone)
        rows = [self.rng.randrange(n) for _ in range(self.rng.randint(2, 4))]
        sub = self.ens.select(rows)
        groups = _groups(sub.stacked_params(), self.opt_spec["groups"])  # the optimizer's order
        flat = [p for g in groups for p in g["params"]] if self.opt_spec["groups"] else groups
        self.opt = self.opt.select(rows, flat)
        self.ens = sub
        alone, opts = [], []
        for r in rows:
            m = copy.deepcopy(self.alone[r])
            opt = _build_plain(self.opt_spec, m, r)
            opt.load_state_dict(copy.deepcopy(self.opts[r].state_dict()))  # not shared
            alone.append(m)
            opts.append(opt)
        self.alone, self.opts, self.factories = alone, opts, [self.factories[r] for r in rows]
        for key in ("lr", "weight_decay"):
            if self.opt_spec[key] is not None:
                self.opt_spec[key] = [self.opt_spec[key][r] for r in rows]
        self._new_step()

    def _copy(self) -> vmapens.Ensemble:
        other = self.ens.select(list(range(len(self.alone))))
        other.apply(_reset)  # every member re-initialised at its own size
        return other

    def op_state_dict(self) -> None:
        other = self._copy()
        other.load_state_dict(self.ens.state_dict())
        opt = _build_stacked(self.opt_spec, other)
        opt.load_state_dict(self.opt.state_dict())
        self.ens, self.opt = other, opt
        self._new_step()

    def op_save(self) -> None:
        path = self.tmp / "ckpt.pt"
        vmapens.save(self.ens, path, self.opt)
        ids = list(self.ens.member_ids)
        # load refuses repeated ids (a file save writes): restore into a copy then
        loaded = self._copy() if len(set(ids)) < len(ids) else vmapens.load(path, self.factories)
        opt = _build_stacked(self.opt_spec, loaded)
        vmapens.restore(path, loaded, opt)
        loaded.train(self.ens.training)
        self.ens, self.opt = loaded, opt
        self._new_step()

    def op_lr(self) -> None:
        """The user sets new per-member learning rates, as on each member's own optimizer."""
        lrs = [lr * self.rng.choice([0.5, 2.0]) for lr in self.opt_spec["lr"]]
        self.opt.param_groups[0]["lr"] = vmapens.optim.MemberValues(lrs)
        for lr, opt in zip(lrs, self.opts, strict=True):
            opt.param_groups[0]["lr"] = lr
        self.opt_spec["lr"] = lrs

    def op_assign(self) -> None:
        """``load_state_dict(assign=True)``: the state dict's tensors become the storage."""
        other = self._copy()
        other.load_state_dict({k: v.clone() for k, v in self.ens.state_dict().items()}, assign=True)
        opt = _build_stacked(self.opt_spec, other)
        opt.load_state_dict(self.opt.state_dict())
        self.ens, self.opt = other, opt
        self._new_step()

    def op_layout(self) -> None:
        """channels_last on the ensemble and on every member (4-D tensors only: convolutions)."""
        self.ens.to(memory_format=torch.channels_last)
        for m in self.alone:
            m.to(memory_format=torch.channels_last)

    def op_members(self) -> None:
        ids = list(self.ens.member_ids)
        if len(set(ids)) < len(ids):  # files are named by member id: refused, documented
            with pytest.raises(ValueError, match="more than once"):
                vmapens.save_members(self.ens, self.tmp / "refused")
            return
        paths = vmapens.save_members(self.ens, self.tmp / f"members{self.rng.random()}")
        for i, path in enumerate(paths):
            fresh = self.factories[i]()
            fresh.load_state_dict(torch.load(path))  # strict: its own keys at its own shapes
            for key, v in self.alone[i].state_dict().items():
                torch.testing.assert_close(fresh.state_dict()[key], v, **EXACT)

    def _handed(self, i: int) -> dict[str, Any]:
        """Member ``i``'s optimizer state; ``module`` checks the parameters in the order of
        ``module.parameters()``, which two param groups by name do not keep."""
        module = None if self.opt_spec["groups"] else self.ens[i]
        return self.opt.member_state_dict(i, module)

    def op_handoff(self) -> None:
        i = self.rng.randrange(len(self.alone))
        plain = _build_plain(self.opt_spec, self.alone[i], i)
        plain.load_state_dict(self._handed(i))
        self.opts[i] = plain  # the twin trains on with the handed-off state

    def op_refused(self) -> None:
        before = {k: v.clone() for k, v in self.ens.state_dict().items()}
        with pytest.raises(ValueError, match="StackedAdafactor: .*not elementwise"):
            vmapens.optim.StackedAdafactor(self.ens)
        matrices = [p for p in self.ens.parameters() if p.dim() == 3]
        with pytest.raises(ValueError, match="StackedMuon: .*not elementwise"):
            vmapens.optim.StackedMuon(matrices)
        for k, v in self.ens.state_dict().items():
            assert torch.equal(v, before[k]), k

    # -- the checks -------------------------------------------------------------------------

    def check(self, where: str) -> None:
        assert len(self.ens) == len(self.alone)
        assert self.ens.training == self.alone[0].training, where
        for i, m in enumerate(self.alone):
            got, want = self.ens[i].state_dict(), m.state_dict()
            assert list(got) == list(want), f"{where}: member {i} keys"
            for key, v in want.items():
                torch.testing.assert_close(got[key], v, **EXACT, msg=f"{where}: {i} {key}")
            mine = self._handed(i)
            theirs = self.opts[i].state_dict()
            # State on one side only is at its start: torch's Adagrad makes its own when
            # built, a stacked optimizer makes every member's at the first step of any.
            for k in set(theirs["state"]) ^ set(mine["state"]):
                state = theirs["state"].get(k, mine["state"].get(k))
                assert float(torch.as_tensor(state["step"]).max()) == 0, f"{where}: {i} {k}"
            for k, state in theirs["state"].items():
                if k not in mine["state"]:
                    continue
                for key, v in state.items():
                    got_v = torch.as_tensor(mine["state"][k][key]).to(torch.as_tensor(v).dtype)
                    torch.testing.assert_close(
                        got_v, torch.as_tensor(v), **EXACT, msg=f"{where}: {i} state {k} {key}"
                    )
        self._check_padding(where)

    def _check_padding(self, where: str) -> None:
        """Padded entries: zero, but where an elementwise rule starts or keeps a constant
        there (torch's own rule on a zero gradient): Adagrad's ``sum`` its initial
        accumulator, Adamax's ``exp_inf`` ``max(beta2 * 0, |0| + eps) = eps`` once stepped."""
        name, shared = self.opt_spec["name"], self.opt_spec["shared"]
        for key, t in {**self.ens.stacked_params(), **self.ens.stacked_buffers()}.items():
            if t.dim() < 2:
                continue  # num_batches_tracked: one count per member, nothing padded
            own = _own_masks(self.alone, key, t)
            tensors = {"value": t.detach()}
            if t.grad is not None:
                tensors["grad"] = t.grad
            state = self.opt.state.get(t, {})
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and v.shape == t.shape:
                    tensors[k] = v
            for k, v in tensors.items():
                expected = torch.zeros_like(v)
                if name == "Adagrad" and k == "sum":
                    expected.fill_(shared["initial_accumulator_value"])
                if name == "Adamax" and k == "exp_inf":
                    stepped = (state["step"] > 0).to(v.dtype).reshape(-1, *[1] * (v.dim() - 1))
                    expected = expected + 1e-8 * stepped
                assert torch.equal(v[~own], expected[~own]), f"{where}: padded {key} {k}"


def _gates(alone: nn.Module, name: str) -> int:
    module, _, leaf = name.rpartition(".")
    sub = alone.get_submodule(module)
    if isinstance(sub, nn.RNNBase) and leaf.startswith(
        ("weight_i", "weight_h", "bias_i", "bias_h")
    ):
        return {"GRU": 3, "LSTM": 4}.get(sub.mode, 1)
    return 1


def _own_masks(alone: list[nn.Module], name: str, stacked: torch.Tensor) -> torch.Tensor:
    """True where member ``i``'s own entries sit in its padded row (gate blocks each padded
    on their own), from the twin's own shape: written here, not taken from vmapens."""
    mask = torch.zeros(stacked.shape, dtype=torch.bool)
    for i, m in enumerate(alone):
        shape = dict(m.state_dict(keep_vars=True))[name].shape
        gates = _gates(m, name)
        rows = mask[i].unflatten(0, (gates, stacked.shape[1] // gates))
        index = (slice(None), slice(0, shape[0] // gates), *(slice(0, k) for k in shape[1:]))
        rows[index] = True
    return mask


def run(spec: dict[str, Any], tmp: Path) -> None:
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        case = Case(spec, tmp)
        case.check("built")
        for k, op in enumerate(spec["program"]):
            getattr(case, f"op_{op}")()
            case.check(f"op {k} ({op})")
    finally:
        torch.set_default_dtype(before)


SEEDS = [*range(10), 16, 25]  # 16: Adagrad, 25: GRU


@pytest.mark.parametrize("seed", SEEDS)
def test_a_random_program_on_members_of_different_sizes_matches_members_alone(seed, tmp_path):
    run(draw(seed), tmp_path)


if __name__ == "__main__":
    search(lambda seed, tmp: run(draw(seed), tmp), lambda seed: _show(draw(seed)))


# -- what the search found, one test each ------------------------------------------------------


def _built(factories: list[Callable[[], nn.Module]], seed: int) -> list[nn.Module]:
    """Each member as ``from_factories(factories, seed=seed)`` documents it (member_seed)."""
    out = []
    for i, f in enumerate(factories):
        torch.manual_seed(vmapens.seeds.member_seed(seed, i))
        out.append(f())
    return out


class Channels(nn.Module):
    """PReLU (one slope per channel) and InstanceNorm (each channel over its own positions)."""

    def __init__(self, channels: int, stats: bool) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, channels, 3, bias=False)  # no bias: the norm cancels it
        self.norm = nn.InstanceNorm1d(channels, affine=True, track_running_stats=stats)
        self.act, self.head = nn.PReLU(channels, init=0.2), nn.Conv1d(channels, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.norm(self.conv(x)))).flatten(1)


@pytest.mark.usefixtures("float64_default")
@pytest.mark.parametrize("stats", [False, True], ids=["instance-stats", "running-stats"])
def test_prelu_and_instance_norm_of_different_channels_train_as_alone(stats):
    """Both were refused as a differing setting (`num_parameters`, `num_features`), where
    every member trains alone: a padded channel is 0 in, 0 - 0 = 0 normalised, slope 0."""
    factories = [functools.partial(Channels, c, stats) for c in (2, 4, 3)]
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(5, 2, 6, generator=g), torch.randn(5, 4, generator=g)
    ens = vmapens.Ensemble.from_factories(factories, seed=0)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=0.05))
    alone = _built(factories, seed=0)
    opts = [torch.optim.Adam(m.parameters(), lr=0.05) for m in alone]
    for _ in range(3):
        step(x, y)
        for m, opt in zip(alone, opts, strict=True):
            opt.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()
    ens.eval()
    with torch.no_grad():
        out = ens(x)
    for i, m in enumerate(alone):
        assert m.norm.num_features == ens[i].norm.num_features
        for key, v in m.state_dict().items():
            torch.testing.assert_close(ens[i].state_dict()[key], v, **EXACT, msg=f"{i} {key}")
        with torch.no_grad():
            torch.testing.assert_close(out[i], m.eval()(x), **EXACT)


class Dropped(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc, self.drop, self.head = nn.Linear(3, hidden), nn.Dropout(0.5), nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(torch.tanh(self.fc(x))))


@pytest.mark.usefixtures("float64_default")
def test_dropout_of_members_of_different_sizes_is_named_with_the_way_out():
    """A padded member draws its dropout mask over the padded width, so not the mask it draws
    alone: the self-check refused it as "an operation that mixes a padded dimension" without
    naming a layer (its locator ran in eval mode only). It names the Dropout now, and the
    way out it gives (check=False) trains every member on its own entries."""
    factories = [functools.partial(Dropped, h) for h in (2, 4)]
    g = torch.Generator().manual_seed(8)
    x, y = torch.randn(6, 3, generator=g), torch.randn(6, 1, generator=g)
    ens = vmapens.Ensemble.from_factories(factories, seed=0)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    rng = torch.get_rng_state()
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1))
    with pytest.raises(RuntimeError, match=r"first differs at `drop` \(Dropout\), which draws "
                       r"random numbers over the padded shape.*check=False"):  # fmt: skip
        step(x, y)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(v, before[k]) for k, v in ens.state_dict().items())
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1), check=False)
    step(x, y)
    alone = _built(factories, seed=0)
    for i, m in enumerate(alone):
        assert not torch.equal(ens[i].fc.weight, m.fc.weight)  # it trained
    weight = ens.stacked_params()["fc.weight"]
    assert torch.equal(weight[0, 2:], torch.zeros(2, 3))  # member 0's padded rows: untouched
    assert torch.equal(weight.grad[0, 2:], torch.zeros(2, 3))


def _prelu(slopes: int) -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.PReLU(slopes), nn.Linear(4, 1))


def test_a_prelu_with_one_slope_over_several_channels_is_caught_by_the_self_check():
    """``PReLU(1)`` applies its slope to every channel; padded to ``PReLU(4)`` it would apply
    it to channel 0 only. Building cannot tell it from ``PReLU(1)`` over one channel (exact):
    the self-check refuses it, naming the layer, before anything changes."""
    ens = vmapens.Ensemble.from_factories([functools.partial(_prelu, k) for k in (1, 4)])
    g = torch.Generator().manual_seed(9)
    x, y = torch.randn(5, 3, generator=g), torch.randn(5, 1, generator=g)
    with pytest.raises(RuntimeError, match=r"member 0 .* first differs at `1` \(PReLU\)"):
        vmapens.check(ens, x, y, nn.MSELoss())


class Centred(nn.Module):
    """Centres its hidden units over the (padded) width, in its own ``forward``: always, or
    in training mode only."""

    def __init__(self, hidden: int, always: bool) -> None:
        super().__init__()
        self.always = always
        self.fc, self.head = nn.Linear(3, hidden), nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        if self.always or self.training:
            h = h - h.mean(-1, keepdim=True)
        return self.head(h)


@pytest.mark.parametrize("always", [True, False], ids=["always", "training-only"])
def test_an_op_in_the_members_own_forward_is_named_by_that_module(always):
    """docs/semantics.md: a functional op in your own ``forward`` is named by the module
    whose ``forward`` holds it. The locator compared outputs only, so it named the next
    layer (`head`), and ran in eval mode only, so an op of training mode went unnamed. Now
    the owner is named, with no word of random draws (none here)."""
    ens = vmapens.Ensemble.from_factories([functools.partial(Centred, h, always) for h in (2, 4)])
    g = torch.Generator().manual_seed(10)
    x, y = torch.randn(5, 3, generator=g), torch.randn(5, 1, generator=g)
    with pytest.raises(RuntimeError, match="first differs at the Centred itself") as err:
        vmapens.check(ens, x, y, nn.MSELoss())
    assert "random" not in str(err.value)


def _mlp(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(3, width), nn.Tanh(), nn.Linear(width, 2)).double()


def test_a_deep_copy_keeps_what_optimizers_read_of_each_members_size():
    # Parameter.__deepcopy__ drops the stacked parameters' padding marks: a copy then took
    # StackedAdafactor (whose factored rule mixes padded entries), and member_state_dict(i)
    # handed torch optimizer state at the padded size, which crashed its next step.
    ens = vmapens.Ensemble.from_factories([functools.partial(_mlp, w) for w in (2, 4)], seed=0)
    twin = copy.deepcopy(ens)
    with pytest.raises(ValueError, match="StackedAdafactor: the ensemble holds members of"):
        vmapens.optim.StackedAdafactor(twin, lr=0.01)
    opt = vmapens.StackedAdam(twin, lr=0.01)
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    vmapens.make_step(twin, nn.MSELoss(), opt)(x, y)
    alone = twin[0]  # width 2
    plain = torch.optim.Adam(alone.parameters(), lr=0.01)
    plain.load_state_dict(opt.member_state_dict(0))
    for p, state in zip(alone.parameters(), plain.state.values(), strict=True):
        assert state["exp_avg"].shape == p.shape
    nn.functional.mse_loss(alone(x), y).backward()
    plain.step()  # the member alone goes on from its own state


@pytest.mark.parametrize("assign", [False, True])
def test_a_state_dict_of_the_sizes_in_another_order_is_refused_and_changes_nothing(assign):
    # Widths (4, 8) saved, loaded into (8, 4): the same padded shapes, so no size mismatch,
    # and each member got the other's entries (plain torch refuses a member of another size).
    saved = vmapens.Ensemble.from_factories([functools.partial(_mlp, w) for w in (4, 8)], seed=0)
    ens = vmapens.Ensemble.from_factories([functools.partial(_mlp, w) for w in (8, 4)], seed=1)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"0\.weight: non-zero values where this ensemble pads"):
        ens.load_state_dict(saved.state_dict(), assign=assign)
    assert_bit_identical(dict(ens.state_dict()), before, "after the refusal")
    same = vmapens.Ensemble.from_factories([functools.partial(_mlp, w) for w in (4, 8)], seed=1)
    same.load_state_dict(saved.state_dict(), assign=assign)  # the same sizes, in order: loads
    assert_bit_identical(dict(same.state_dict()), dict(saved.state_dict()), "loaded")


def test_pbt_on_members_of_different_sizes_is_refused_before_any_step():
    # PBT ranks members whatever their sizes, and exploit_ refuses a copy across sizes: the
    # first round failed after `interval` epochs of training had changed the members.
    ens = vmapens.Ensemble.from_factories([functools.partial(_mlp, w) for w in (2, 4)], seed=0)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    pbt = vmapens.pbt.PBT(interval=1, monitor="train_loss")
    with pytest.raises(ValueError, match=r"^PBT: the ensemble holds members of different sizes"):
        vmapens.fit(ens, (x, y), nn.MSELoss(), epochs=2, callbacks=[pbt], progress=False)
    assert_bit_identical(dict(ens.state_dict()), before, "after the refusal")


def test_a_negative_norm_type_on_members_of_different_sizes_is_refused():
    # vector_norm with p < 0 (or -inf) is 0 once one entry is 0: the padded entries' zero
    # gradients made a padded member's norm 0, so it was not clipped where alone it was.
    ens = vmapens.Ensemble.from_factories([functools.partial(_mlp, w) for w in (2, 4)], seed=0)
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    nn.functional.mse_loss(ens(x), y.expand(2, 5, 2)).backward()
    grads = {k: p.grad.clone() for k, p in ens.stacked_params().items()}
    for norm_type in (-1.0, -math.inf):
        with pytest.raises(ValueError, match=r"^clip_grad_norm_: `norm_type` must be >= 0"):
            vmapens.optim.clip_grad_norm_(ens, 0.1, norm_type=norm_type)
    for k, p in ens.stacked_params().items():
        assert torch.equal(p.grad, grads[k]), k  # nothing clipped
    vmapens.optim.clip_grad_norm_(ens, 0.1, norm_type=math.inf)  # max |g|: zeros do not count
