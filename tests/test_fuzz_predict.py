"""Seeded random predictions, exports and validations against N plain modules run alone.

Each program builds N (1..4) plain float64 modules (BatchNorm, Dropout, GRU, LSTM, a
Transformer layer, two inputs, tuple and dict outputs), moves their BatchNorm statistics with
training-mode forwards, stacks copies with ``Ensemble.from_modules`` and leaves the ensemble in
a random mode (train, eval, or train with one submodule the user put in eval). It then draws a
call that plain PyTorch users make: ``vmapens.predict`` with a reduction, ``softmax``,
``batch_size``, ``chunk_size``, shared or per-member inputs (``in_dims``), the data as a tensor,
a tuple, a list of batches or a ``DataLoader``; ``vmapens.export``; ``vmapens.fit`` with
shared, per-member or out-of-bag validation data and metrics. The truth is each plain module
run alone in eval mode under ``torch.no_grad()`` and the reductions written again from
docs/workflows.md (the entropy of the mean of the members' softmaxes, ...); afterwards every
submodule must be back in the mode it had.

Run one program by hand: ``python tests/test_fuzz_predict.py SEED`` prints what it drew.
"""

from __future__ import annotations

import copy
import random
import sys
import warnings
from typing import Any

import optree
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from truth import reduce_by_hand

import vmapens
from vmapens.predict import REDUCTIONS

TOL = dict(rtol=1e-9, atol=1e-10)  # float64: only the order of sums may differ
C = 3  # classes
F64 = torch.float64


# -- the members ------------------------------------------------------------------------------


class MLPBN(nn.Module):
    drop_p = 0.4

    def __init__(self) -> None:
        super().__init__()
        # No bias before BatchNorm: its true gradient is 0 (docs/semantics.md, round-off).
        self.a, self.bn, self.b = nn.Linear(3, 6, bias=False), nn.BatchNorm1d(6), nn.Linear(6, C)
        self.drop = nn.Dropout(self.drop_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(torch.relu(self.bn(self.a(x)))))


class TwoInputs(nn.Module):
    drop_p = 0.3

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.drop = nn.Linear(3, C), nn.Linear(2, C), nn.Dropout(self.drop_p)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.drop(self.a(x)) * self.b(z)


class MLPBNTrained(MLPBN):
    drop_p = 0.0  # fit draws its own dropout masks: no dropout where it trains


class TwoInputsTrained(TwoInputs):
    drop_p = 0.0


class GRUNet(nn.Module):
    layer: type[nn.RNNBase] = nn.GRU

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = self.layer(3, 4, batch_first=True), nn.Linear(4, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


class LSTMNet(GRUNet):
    layer = nn.LSTM


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(1, 2, 3, bias=False), nn.BatchNorm2d(2)
        self.drop, self.head = nn.Dropout2d(0.5), nn.Linear(2 * 3 * 3, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(torch.relu(self.bn(self.conv(x)))).flatten(1))


class TupleOut(nn.Module):
    """A tuple holding a dict: ``reduce="none"`` returns the same pytree, stacked."""

    def __init__(self) -> None:
        super().__init__()
        self.bn, self.a = nn.BatchNorm1d(3), nn.Linear(3, C)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        h = self.bn(x)
        return self.a(h), {"h": 2 * h}


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.TransformerEncoderLayer(4, 2, 8, dropout=0.3, batch_first=True)
        self.head = nn.Linear(4, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(x).mean(1))


# name: (class, the shape of one sample of each input)
MEMBERS: dict[str, tuple[type[nn.Module], list[tuple[int, ...]]]] = {
    "mlp_bn": (MLPBN, [(3,)]),
    "two_inputs": (TwoInputs, [(3,), (2,)]),
    "gru": (GRUNet, [(5, 3)]),
    "lstm": (LSTMNet, [(4, 3)]),
    "conv_bn": (ConvBN, [(1, 5, 5)]),
    "tuple_out": (TupleOut, [(3,)]),
    "encoder": (Encoder, [(3, 4)]),
    "mlp_bn_trained": (MLPBNTrained, [(3,)]),
    "two_inputs_trained": (TwoInputsTrained, [(3,), (2,)]),
}
PREDICTED = [name for name in MEMBERS if not name.endswith("_trained")]


# -- the truth --------------------------------------------------------------------------------


def alone(modules: list[nn.Module], inputs: list[Any], softmax: bool) -> list[Any]:
    """Each module run alone in eval mode on its own inputs (``inputs[i]``)."""
    outs = []
    for m, args in zip(modules, inputs):
        m = copy.deepcopy(m).eval()
        with torch.no_grad():
            out = m(*args)
        outs.append(optree.tree_map(lambda t: t.softmax(-1), out) if softmax else out)
    return outs


def assert_same(got: Any, want: Any, exact: bool, drawn: dict) -> None:
    got_leaves, got_spec = optree.tree_flatten(got)
    want_leaves, want_spec = optree.tree_flatten(want)
    assert got_spec == want_spec, f"{drawn}: {got_spec} vs {want_spec}"
    for g, w in zip(got_leaves, want_leaves):
        if exact:
            assert g.dtype == w.dtype and torch.equal(g, w), f"{drawn}: {g} vs {w}"
        else:
            torch.testing.assert_close(g, w, **TOL, msg=lambda m: f"{drawn}: {m}")


def modes(ens: vmapens.Ensemble) -> list[tuple[str, bool]]:
    return [(k, m.training) for k, m in ens.template.named_modules()] + [("", ens.training)]


# -- the programs -----------------------------------------------------------------------------


def build(rng: random.Random, seed: int, names: list[str]) -> tuple:
    """N plain modules whose BatchNorm statistics moved, their ensemble in a random mode."""
    name = rng.choice(names)
    cls, shapes = MEMBERS[name]
    n = rng.randint(1, 4)
    modules = []
    for i in range(n):
        torch.manual_seed(1000 * seed + i)
        m = cls().to(F64)
        with torch.no_grad():  # training mode: each module its own running statistics
            m(*[torch.randn(6, *s, dtype=F64) * 2 + 1 for s in shapes])
        modules.append(m)
    ens = vmapens.Ensemble.from_modules([copy.deepcopy(m) for m in modules])
    mode = rng.choice(["train", "eval", "one submodule in eval"])
    if mode == "eval":
        ens.eval()
    elif mode == "one submodule in eval":  # e.g. a BatchNorm the user froze
        subs = [k for k, _ in ens.template.named_modules() if k]
        ens.template.get_submodule(rng.choice(subs)).eval()
    return name, shapes, n, modules, ens, mode


def predict_program(seed: int) -> tuple[dict, Any, Any, vmapens.Ensemble, list]:
    """One random ``predict`` call: (what was drawn, its result, the truth, the ensemble, the
    modes it had before)."""
    rng = random.Random(seed)
    name, shapes, n, modules, ens, mode = build(rng, seed, PREDICTED)
    samples = rng.randint(0, 9)
    g = torch.Generator().manual_seed(seed)
    per = [rng.random() < 0.35 for _ in shapes]  # per-member input: [n, samples, ...]
    xs = [torch.randn(*((n,) if p else ()), samples, *s, generator=g, dtype=F64)
          for s, p in zip(shapes, per)]  # fmt: skip
    in_dims: Any = None if rng.random() < 0.7 else (None,) * len(shapes)
    if any(per):
        in_dims = (
            0 if len(per) == 1 and rng.random() < 0.5 else tuple(0 if p else None for p in per)
        )
    form = rng.choice(["tensor", "tensor", "list", "loader"])
    form = "list" if any(per) and form == "loader" else form
    batch_size, data = None, None
    if form == "tensor":
        data = xs[0] if len(xs) == 1 and rng.random() < 0.7 else tuple(xs)
        batch_size = rng.choice([None, 1, 2, 4, 100])
    elif form == "list":
        cuts = sorted(rng.sample(range(1, samples), min(2, samples - 1))) if samples > 1 else []
        bounds = [0, *cuts, samples]
        data = []
        for lo, hi in zip(bounds, bounds[1:]):
            parts = [x[:, lo:hi] if p else x[lo:hi] for x, p in zip(xs, per)]
            data.append(tuple(parts) if len(parts) > 1 or rng.random() < 0.5 else parts[0])
    else:
        if samples == 0:  # a DataLoader over no samples yields no batches: refused
            samples, xs = 3, [torch.randn(3, *s, generator=g, dtype=F64) for s in shapes]
        data = DataLoader(TensorDataset(*xs), batch_size=rng.randint(1, 4))
    softmax = rng.random() < 0.5
    reductions = [r for r in REDUCTIONS if softmax or r not in ("entropy", "mutual_information")]
    reduce = "none" if name == "tuple_out" else rng.choice(reductions)
    chunk_size = rng.choice([None, None, 1, 2])
    drawn = dict(seed=seed, member=name, n=n, mode=mode, samples=samples, per_member=per,
                 in_dims=in_dims, form=form, batch_size=batch_size, softmax=softmax,
                 reduce=reduce, chunk_size=chunk_size)  # fmt: skip
    inputs = [[x[i] if p else x for x, p in zip(xs, per)] for i in range(n)]
    outs = alone(modules, inputs, softmax)
    if reduce == "none":
        want = optree.tree_map(lambda *ts: torch.stack(ts), *outs)
    else:
        want = reduce_by_hand(outs, reduce)
    before = modes(ens)
    got = vmapens.predict(ens, data, reduce=reduce, batch_size=batch_size, in_dims=in_dims,
                          softmax=softmax, chunk_size=chunk_size)  # fmt: skip
    return drawn, got, want, ens, before


@pytest.mark.parametrize("seed", range(24))
def test_random_predict_equals_members_run_alone(seed: int) -> None:
    drawn, got, want, ens, before = predict_program(seed)
    assert_same(got, want, drawn["reduce"] == "vote", drawn)
    assert modes(ens) == before, f"{drawn}: modes not restored"
    assert ens.chunk_size is None


# torch.export traces for seconds: two tiny programs in the suite (more seeds by hand).
EXPORT_SEEDS = [0, 5]  # two inputs and a vote in train mode; a tuple output, a submodule in eval


def export_program(seed: int) -> tuple[dict, Any, Any, vmapens.Ensemble, list, dict]:
    rng = random.Random(seed)
    name, shapes, n, modules, ens, mode = build(rng, seed, ["mlp_bn", "two_inputs", "tuple_out"])
    before, state = modes(ens), {k: v.clone() for k, v in ens.state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    rows = rng.randint(1, 4)
    xs = tuple(torch.randn(rows, *s, generator=g, dtype=F64) for s in shapes)
    softmax = rng.random() < 0.5
    reduce = None if name == "tuple_out" else rng.choice([None, "mean", "variance", "vote"])
    drawn = dict(seed=seed, member=name, n=n, mode=mode, softmax=softmax, reduce=reduce)
    with warnings.catch_warnings():  # torch's own deprecation noise while tracing
        warnings.simplefilter("ignore", FutureWarning)
        program = vmapens.export(ens, xs, reduce=reduce, softmax=softmax)
    outs = alone(modules, [list(xs)] * n, softmax)
    want = optree.tree_map(lambda *t: torch.stack(t), *outs) if reduce is None else None
    want = reduce_by_hand(outs, reduce) if reduce is not None else want
    return drawn, program.module()(*xs), want, ens, before, state


@pytest.mark.parametrize("seed", EXPORT_SEEDS)
def test_random_export_equals_members_run_alone(seed: int) -> None:
    drawn, got, want, ens, before, state = export_program(seed)
    assert_same(got, want, drawn["reduce"] == "vote", drawn)
    assert modes(ens) == before, f"{drawn}: modes not restored"
    for key, value in ens.state_dict().items():
        assert torch.equal(value, state[key]), f"{drawn}: export changed {key}"


# -- fit's validation loss and metrics ---------------------------------------------------------


def accuracy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.argmax(-1) == y).to(F64).mean()


def nll(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


LOSSES = {
    "ce": lambda: nn.CrossEntropyLoss(),
    "ce_weighted": lambda: nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 0.5], dtype=F64)),
    "ce_sum": lambda: nn.CrossEntropyLoss(reduction="sum"),
}
METRICS = {"acc": accuracy, "nll": nll}


def fit_program(seed: int) -> None:
    """``fit`` with shared, per-member (``in_dims``) or out-of-bag validation, every epoch's
    row against the plain modules trained alone with ``torch.optim.Adam`` on the same batch."""
    rng = random.Random(seed)
    name, shapes, n, modules, ens, _ = build(
        rng, seed, ["mlp_bn_trained", "two_inputs_trained", "gru"]
    )
    ens.train()
    for m in modules:
        m.train()
    rows, val_rows, epochs = rng.randint(5, 8), rng.randint(1, 6), rng.randint(1, 3)
    how = rng.choice(["shared", "per-member data", "per-member val_data", "oob"])
    loss_fn = LOSSES[rng.choice(list(LOSSES))]()
    g = torch.Generator().manual_seed(seed)

    def draw(count: int, lead: tuple[int, ...] = ()) -> tuple[tuple[torch.Tensor, ...], Any]:
        xs = tuple(torch.randn(*lead, count, *s, generator=g, dtype=F64) for s in shapes)
        return xs, torch.randint(C, (*lead, count), generator=g)

    per_data = how == "per-member data"
    x, y = draw(rows, (n,) if per_data else ())
    options: dict[str, Any] = dict(epochs=epochs, lr=0.05, shuffle=False, progress=False,
                                   seed=seed, patience=100)  # fmt: skip
    if how == "oob":
        options.update(val_data="oob", bootstrap=True)
    else:
        val = draw(val_rows, (n,) if how == "per-member val_data" else ())
        options["val_data"] = (val[0] if len(shapes) > 1 else val[0][0], val[1])
        options["in_dims"] = {"shared": None, "per-member data": 0}.get(how, (None, 0))
        if how != "per-member val_data":
            options["metrics"] = METRICS
    data = (x if len(shapes) > 1 else x[0], y)
    history = vmapens.fit(ens, data, loss_fn, **options)

    val_loss = torch.full((epochs, n), torch.nan, dtype=F64)
    scores = {k: torch.zeros(epochs, n, dtype=F64) for k in METRICS}
    outputs: list[list[torch.Tensor]] = [[] for _ in range(epochs)]
    for i, m in enumerate(modules):
        opt = torch.optim.Adam(m.parameters(), lr=0.05)
        xi, yi = (tuple(t[i] for t in x), y[i]) if per_data else (x, y)
        if how == "oob":  # docs/fit.md, "Bagging": the resample, and the rows it left out
            drawn = vmapens.seeds.bootstrap_indices(rows, seed, i)
            left = torch.ones(rows, dtype=torch.bool)
            left[drawn] = False
            xi, yi = tuple(t[drawn] for t in x), y[drawn]
        for e in range(epochs):
            m.train()
            opt.zero_grad()
            loss_fn(m(*xi), yi).backward()
            opt.step()
            m.eval()
            with torch.no_grad():
                if how == "oob":
                    if left.any():
                        val_loss[e, i] = loss_fn(m(*(t[left] for t in x)), y[left])
                elif how == "per-member val_data":
                    val_loss[e, i] = loss_fn(m(*(t[i] for t in val[0])), val[1][i])
                else:
                    out = m(*val[0])
                    val_loss[e, i] = loss_fn(out, val[1])
                    outputs[e].append(out)
                    for k, fn in METRICS.items():
                        scores[k][e, i] = fn(out, val[1])
    torch.testing.assert_close(history.val_loss, val_loss, **TOL, equal_nan=True)
    if "metrics" in options:
        for k, fn in METRICS.items():
            torch.testing.assert_close(history.metrics[k], scores[k], **TOL)
            whole = torch.stack([fn(sum(outs) / n, val[1]) for outs in outputs])
            torch.testing.assert_close(history.ensemble_metrics[k], whole, **TOL)


@pytest.mark.parametrize("seed", range(8))
def test_random_validation_rows_equal_members_trained_alone(seed: int) -> None:
    fit_program(seed)


# -- what the programs found, one test each -------------------------------------------------


class WithAux(nn.Module):
    """Logits and a dict of auxiliary outputs, as detection or multi-task heads return."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, C)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logits = self.fc(x)
        return logits, {"energy": logits.logsumexp(-1)}


class AuxAccuracy:
    """A metric object (``reset``/``update``/``compute``, as torchmetrics) reading the tuple."""

    def reset(self) -> None:
        self.right, self.seen = 0, 0

    def update(self, out: tuple, y: torch.Tensor) -> None:
        self.right += int((out[0].argmax(-1) == y).sum())
        self.seen += len(y)

    def compute(self) -> torch.Tensor:
        return torch.tensor(self.right / self.seen, dtype=F64)


def test_metrics_of_members_that_return_a_tuple_equal_the_members_alone() -> None:
    """A metric of a member whose output is a pytree (here a tuple holding a dict) failed in
    fit's first check (``'tuple' object has no attribute 'mean'``), where plain torch runs it.
    The ensemble's output is averaged over the members tensor by tensor."""

    def loss(out: tuple, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out[0], y) + 0.1 * out[1]["energy"].mean()

    def energy(out: tuple, y: torch.Tensor) -> torch.Tensor:
        return out[1]["energy"].mean() + 0 * out[0].sum()

    n, g = 3, torch.Generator().manual_seed(0)
    modules = []
    for i in range(n):
        torch.manual_seed(i)
        modules.append(WithAux().to(F64))
    ens = vmapens.Ensemble.from_modules([copy.deepcopy(m) for m in modules])
    x, y = torch.randn(8, 3, generator=g, dtype=F64), torch.randint(C, (8,), generator=g)
    xv, yv = torch.randn(6, 3, generator=g, dtype=F64), torch.randint(C, (6,), generator=g)
    metrics = {"acc": lambda o, t: accuracy(o[0], t), "energy": energy, "object": AuxAccuracy()}
    history = vmapens.fit(ens, (x, y), loss, epochs=2, lr=0.1, val_data=(xv, yv),
                          metrics=metrics, progress=False, seed=0)  # fmt: skip
    object_metric = AuxAccuracy()

    def plain_object(out: tuple, t: torch.Tensor) -> torch.Tensor:
        object_metric.reset()
        object_metric.update(out, t)
        return object_metric.compute()

    truth = {"acc": lambda o, t: accuracy(o[0], t), "energy": energy, "object": plain_object}
    per = {k: torch.zeros(2, n, dtype=F64) for k in truth}
    outs: list[list[Any]] = [[], []]
    for i, m in enumerate(modules):
        opt = torch.optim.Adam(m.parameters(), lr=0.1)
        for e in range(2):
            opt.zero_grad()
            loss(m(x), y).backward()
            opt.step()
            with torch.no_grad():
                out = m(xv)
            outs[e].append(out)
            for k, fn in truth.items():
                per[k][e, i] = fn(out, yv)
    for k, fn in truth.items():
        torch.testing.assert_close(history.metrics[k], per[k], **TOL)
        means = [optree.tree_map(lambda *ts: sum(ts) / n, *o) for o in outs]
        whole = torch.stack([fn(mean, yv) for mean in means])
        torch.testing.assert_close(history.ensemble_metrics[k], whole, **TOL)


def test_the_variance_of_no_samples_is_empty_without_a_warning() -> None:
    """Found by the predict programs: ``reduce="variance"`` of data with no samples warned
    (torch's ``var`` of an empty reduction; pytest makes it an error) where every other
    reduction and the members alone give empty outputs."""
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 2).to(F64), n=3, seed=0)
    x = torch.zeros(0, 3, dtype=F64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = vmapens.predict(ens, x, reduce="variance", batch_size=2)
    want = reduce_by_hand(alone(ens.unstack(), [[x]] * 3, softmax=False), "variance")
    assert got.shape == want.shape == (0, 2)


def test_in_dims_as_a_list_is_refused_by_predict_before_cutting_the_inputs() -> None:
    """A list ``in_dims`` was read as one entry for every input, so ``batch_size`` cut the
    per-member input along the member dim and the error blamed the sample counts."""
    ens = vmapens.Ensemble(lambda: TwoInputs().to(F64), n=3, seed=0)
    xs, z = torch.randn(3, 7, 3, dtype=F64), torch.randn(7, 2, dtype=F64)
    with pytest.raises(ValueError, match=r"^predict: `in_dims` must be None, an int, or a tuple"):
        vmapens.predict(ens, (xs, z), in_dims=[0, None], batch_size=3)


def test_export_of_a_reduction_of_a_tuple_output_is_refused_first_in_exports_name() -> None:
    """The refusal came from inside the second trace, seconds later, as ``predict: ...``."""
    ens = vmapens.Ensemble(lambda: TupleOut().to(F64), n=2, seed=0).train()
    with pytest.raises(
        TypeError, match=r"^export: `reduce='mean'` needs the members to return one"
    ):
        vmapens.export(ens, torch.randn(4, 3, dtype=F64), reduce="mean")
    assert ens.training


def test_a_loader_that_yields_targets_too_is_named_in_predicts_error() -> None:
    """A DataLoader over (x, y), the usual test loader, passed y as a second input: the
    member's bare ``forward() takes 2 positional arguments but 3 were given``."""
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 2).to(F64), n=2, seed=0)
    loader = DataLoader(TensorDataset(torch.randn(8, 3, dtype=F64), torch.zeros(8)), batch_size=4)
    with pytest.raises(
        TypeError, match=r"^predict: each batch of `data` .* holds 2 \(.*TensorDataset"
    ):
        vmapens.predict(ens, loader)
    assert ens.training


if __name__ == "__main__":
    for s in map(int, sys.argv[1:]):
        print(predict_program(s)[0])
