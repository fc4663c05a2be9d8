"""predict against the truth: the unstacked members run one by one, reductions by hand."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from truth import reduce_by_hand

import vmapens
from vmapens import predict
from vmapens.predict import REDUCTIONS

TOL = dict(rtol=1e-10, atol=1e-12)  # float64 throughout
N, CLASSES = 5, 4


def member() -> nn.Module:
    # BatchNorm and Dropout: predictions must run in eval mode (running statistics, no drop).
    return nn.Sequential(
        nn.Linear(3, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, CLASSES)
    )


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, CLASSES), nn.Linear(2, CLASSES)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.a(x) * self.b(z)


@pytest.fixture(scope="module")
def ens() -> vmapens.Ensemble:
    torch.manual_seed(0)
    ens = vmapens.Ensemble(member, n=N, seed=0).double()
    with torch.no_grad():  # a training-mode forward: each member its own running statistics
        ens(torch.randn(16, 3, dtype=torch.float64) * 3 + 1)
    return ens.train()


X = torch.randn(11, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def truth(ens: vmapens.Ensemble, x: torch.Tensor, reduce: str, softmax: bool) -> torch.Tensor:
    outs = []
    for m in ens.unstack():
        m.eval()
        with torch.no_grad():
            o = m(x)
        outs.append(o.softmax(-1) if softmax else o)
    return reduce_by_hand(outs, reduce)


# Entropies are of probabilities: only with softmax.
CASES = [
    (r, s)
    for r in REDUCTIONS
    for s in (False, True)
    if s or r not in ("entropy", "mutual_information")
]


@pytest.mark.parametrize("batch_size", [None, 4], ids=["one-batch", "batches-of-4"])
@pytest.mark.parametrize(
    ("reduce", "softmax"), CASES, ids=[f"{r}-{'softmax' if s else 'raw'}" for r, s in CASES]
)
def test_reductions_match_members_run_one_by_one(ens, reduce, batch_size, softmax):
    got = predict(ens, X, reduce=reduce, batch_size=batch_size, softmax=softmax)
    expected = truth(ens, X, reduce, softmax)
    if reduce == "vote":
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected, **TOL)
    assert ens.training, "predict must give the ensemble its training mode back"
    assert not got.requires_grad


DATA_FORMS = {
    "tensor": lambda x: x,
    "list-of-batches": lambda x: [x[:5], x[5:]],
    "dataloader": lambda x: DataLoader(TensorDataset(x), batch_size=3),
}


@pytest.mark.parametrize("form", DATA_FORMS, ids=list(DATA_FORMS))
def test_data_forms_and_member_chunks(ens, form):
    expected = truth(ens, X, "mean", True)
    got = predict(ens, DATA_FORMS[form](X), reduce="mean", softmax=True, chunk_size=2)
    torch.testing.assert_close(got, expected, **TOL)
    assert ens.chunk_size is None, "chunk_size is for this call only"


def test_tuple_of_inputs_and_per_member_inputs():
    e = vmapens.Ensemble(TwoInputs, n=3, seed=1).double()
    x, z = X, torch.randn(11, 2, dtype=torch.float64)
    models = e.unstack()
    expected = torch.stack([m(x, z) for m in models]).detach()
    torch.testing.assert_close(predict(e, (x, z), batch_size=4), expected, **TOL)
    # in_dims=(0, None): member i sees xs[i]; samples are dim 1 of xs, dim 0 of z.
    xs = torch.randn(3, 11, 3, dtype=torch.float64)
    got = predict(e, (xs, z), in_dims=(0, None), batch_size=5, reduce="max")
    expected = torch.stack([m(xs[i], z) for i, m in enumerate(models)]).detach().amax(0)
    torch.testing.assert_close(got, expected, **TOL)


BAD = [
    ("unknown-reduce", dict(reduce="median"), ValueError, r"predict: `reduce` must be one of"),
    ("zero-batch", dict(batch_size=0), ValueError, r"predict: `batch_size` must be >= 1"),
    ("zero-chunk", dict(chunk_size=0), ValueError, r"predict: `chunk_size` must be >= 1"),
    ("batched-iterable", dict(data=[X], batch_size=2), ValueError, r"predict: `batch_size` cuts"),
    ("no-batches", dict(data=[]), ValueError, r"predict: `data` yielded no batches"),
    ("not-ensemble", dict(ens=nn.Linear(3, 1)), TypeError, r"predict: `ens` must be"),
]


@pytest.mark.parametrize(("case", "options", "exc", "match"), BAD, ids=[b[0] for b in BAD])
def test_bad_arguments(ens, case, options, exc, match):
    options = {"ens": ens, "data": X, **options}
    with pytest.raises(exc, match=match):
        predict(options.pop("ens"), options.pop("data"), **options)
    assert ens.training


class Fixed(nn.Module):
    """Returns stored logits for the sample ids it is given: outputs chosen by the test."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = nn.Parameter(logits)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.logits[ids]


def all_label_patterns(n: int, classes: int) -> torch.Tensor:
    """Logits ``[n, classes**n, classes]``: sample s gets every member's argmax from the
    digits of s in base ``classes``, so every tie between classes occurs."""
    combos = torch.tensor(list(itertools.product(range(classes), repeat=n)))  # [samples, n]
    noise = torch.rand(n, len(combos), classes, generator=torch.Generator().manual_seed(3))
    onehot = nn.functional.one_hot(combos.T, classes).double()
    return onehot * 2 + noise.double()  # noise < 1: the argmax stays the chosen label


@pytest.mark.parametrize("reduce", REDUCTIONS)
def test_reductions_over_every_pattern_of_member_labels(reduce):
    n, classes = 4, 3  # 81 samples: every 2-2 tie between two classes among them
    logits = all_label_patterns(n, classes)
    e = vmapens.Ensemble.from_modules([Fixed(logits[i]) for i in range(n)])
    ids = torch.arange(logits.shape[1])
    got = predict(e, ids, reduce=reduce, softmax=True, batch_size=20)
    expected = reduce_by_hand([logits[i].softmax(-1) for i in range(n)], reduce)
    if reduce == "vote":
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected, **TOL)
