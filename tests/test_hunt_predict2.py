"""Hunt in predict and fit's validation metrics: each against the members run alone."""

from __future__ import annotations

import copy
import itertools

import torch
from torch import nn
from truth import reduce_by_hand

import vmapens
from vmapens import predict
from vmapens.predict import reduce_members

F64 = torch.float64
TOL = dict(rtol=1e-10, atol=1e-12)
C = 3


class Counts(nn.Module):
    """Integer class scores (a count of votes, a histogram): ``argmax`` reads them as classes."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).round().long()


def test_the_disagreement_of_integer_outputs_is_the_fraction_of_pairs() -> None:
    """``disagreement`` of int64 outputs was cast to int64 at the end: every fraction in
    (0, 1) read 0, silently (three members 2 to 1: 0 instead of 2/3)."""
    torch.manual_seed(0)
    modules = [Counts().to(F64) for _ in range(3)]
    ens = vmapens.Ensemble.from_modules([copy.deepcopy(m) for m in modules])
    x = torch.randn(40, 2, generator=torch.Generator().manual_seed(1), dtype=F64) * 4
    with torch.no_grad():
        outs = [m(x) for m in modules]
    got = predict(ens, x, reduce="disagreement", batch_size=16)
    labels = torch.stack(outs).argmax(-1).T.tolist()  # [samples][member]
    pairs = list(itertools.permutations(range(3), 2))
    truth = [sum(s[i] != s[j] for i, j in pairs) / len(pairs) for s in labels]
    assert 0 < sum(truth) < len(truth)  # members that neither always agree nor never do
    assert got.dtype == torch.get_default_dtype()  # a fraction, in the default float dtype
    torch.testing.assert_close(got, torch.tensor(truth, dtype=got.dtype))
    one = reduce_members(torch.stack(outs[:1]), "disagreement")
    assert one.is_floating_point() and not one.any()


class Float32Softmax(nn.Module):
    """Probabilities taken in float32 inside a float64 model, as attention code does
    (``softmax(x, -1, dtype=torch.float32).type_as(x)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).softmax(-1, dtype=torch.float32).type_as(x)


def test_probabilities_of_a_float32_softmax_in_a_float64_model_are_accepted() -> None:
    """They sum to 1 to float32's precision (about 1e-7), which was over float64's bound
    (1.5e-8): ``entropy`` refused them as logits; logits are still refused."""
    torch.manual_seed(0)
    modules = [Float32Softmax().to(F64) for _ in range(4)]
    ens = vmapens.Ensemble.from_modules([copy.deepcopy(m) for m in modules])
    x = torch.randn(300, 4, generator=torch.Generator().manual_seed(2), dtype=F64) * 3
    with torch.no_grad():
        outs = [m(x) for m in modules]
    assert float((torch.stack(outs).sum(-1) - 1).abs().max()) > 1.5e-8  # the case at hand
    for reduce in ("entropy", "mutual_information"):
        got = predict(ens, x, reduce=reduce, batch_size=128)
        torch.testing.assert_close(got, reduce_by_hand(outs, reduce), **TOL)
    logits = torch.stack(outs).log()
    try:
        reduce_members(logits, "entropy")
    except ValueError as err:
        assert "softmax=True" in str(err)
    else:
        raise AssertionError("log-probabilities were read as probabilities")


class Accuracy:
    """A metric object (``reset``/``update``/``compute``, as torchmetrics) whose ``compute``
    returns a Python float, as a hand-written accumulator does."""

    def reset(self) -> None:
        self.right, self.seen = 0, 0

    def update(self, out: torch.Tensor, y: torch.Tensor) -> None:
        self.right += int((out.argmax(-1) == y).sum())
        self.seen += len(y)

    def compute(self) -> float:
        return self.right / self.seen


def test_a_metric_object_that_computes_a_python_float_is_recorded_exactly() -> None:
    """Its value went through ``torch.as_tensor``, which makes a Python float float32: an
    accuracy of 1/3 was recorded as 0.3333333433, per member and for the ensemble."""
    n, epochs, g = 3, 2, torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    modules = [nn.Linear(4, C).to(F64) for _ in range(n)]
    ens = vmapens.Ensemble.from_modules([copy.deepcopy(m) for m in modules])
    x, y = torch.randn(12, 4, generator=g, dtype=F64), torch.randint(C, (12,), generator=g)
    xv, yv = torch.randn(9, 4, generator=g, dtype=F64), torch.randint(C, (9,), generator=g)
    history = vmapens.fit(ens, (x, y), nn.CrossEntropyLoss(), epochs=epochs, lr=0.1,
                          val_data=(xv, yv), metrics={"acc": Accuracy()}, progress=False,
                          seed=0)  # fmt: skip

    def accuracy(out: torch.Tensor) -> float:  # plain: what the user's object computes
        return int((out.argmax(-1) == yv).sum()) / len(yv)

    per = torch.zeros(epochs, n, dtype=F64)
    outs: list[list[torch.Tensor]] = [[] for _ in range(epochs)]
    for i, m in enumerate(modules):
        opt = torch.optim.Adam(m.parameters(), lr=0.1)
        for e in range(epochs):
            opt.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
            with torch.no_grad():
                outs[e].append(m(xv))
            per[e, i] = accuracy(outs[e][-1])
    assert history.metrics is not None and history.ensemble_metrics is not None
    assert (per != per.float().double()).any()  # some accuracy float32 cannot hold (k/9)
    torch.testing.assert_close(history.metrics["acc"], per, rtol=0, atol=0)
    whole = torch.tensor([accuracy(sum(o) / n) for o in outs], dtype=F64)
    torch.testing.assert_close(history.ensemble_metrics["acc"], whole, rtol=0, atol=0)
