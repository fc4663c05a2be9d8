"""predict refuses entropies of outputs that are not probabilities (issue 18).

Logits passed to `reduce="entropy"` without `softmax=True` gave all-NaN results (xlogy of
negative numbers) and no error. The truth for the accepted cases is the entropy written again
from its definition, -sum p log p of the members' mean distribution.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vmapens

N, ROWS, CLASSES = 4, 10, 3


def _ens(head: nn.Module | None = None) -> vmapens.Ensemble:
    def make() -> nn.Module:
        layers = [nn.Linear(5, CLASSES)] + ([head] if head is not None else [])
        return nn.Sequential(*layers)

    return vmapens.Ensemble(make, N, seed=0)


REFUSED = [
    ("logits", None),
    ("log-probabilities", nn.LogSoftmax(-1)),
    ("sigmoid-per-class", nn.Sigmoid()),  # in [0, 1] but not one distribution per sample
]


@pytest.mark.parametrize("reduce", ["entropy", "mutual_information"])
@pytest.mark.parametrize("head", [c[1] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_entropies_of_non_probabilities_are_refused(reduce, head):
    ens = _ens(head)
    with pytest.raises(ValueError, match=rf"^predict: `reduce='{reduce}'` needs .*softmax=True"):
        vmapens.predict(ens, torch.randn(ROWS, 5), reduce=reduce)


@pytest.mark.parametrize("reduce", ["entropy", "mutual_information"])
def test_probabilities_and_softmax_true_are_accepted(reduce):
    x = torch.randn(ROWS, 5)
    logits = _ens()
    with_softmax = vmapens.predict(logits, x, reduce=reduce, softmax=True)
    probs = vmapens.predict(_ens(nn.Softmax(-1)), x, reduce=reduce)
    members = torch.stack([m(x).softmax(-1) for m in logits.unstack()]).detach()
    mean = members.mean(0)
    total = -(mean * mean.log()).sum(-1)
    want = total if reduce == "entropy" else total + (members * members.log()).sum(-1).mean(0)
    # float32 softmax and logs: round-off of a few eps on values of order 1.
    torch.testing.assert_close(with_softmax, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(probs, want, rtol=1e-5, atol=1e-6)


def test_other_reductions_still_take_logits():
    # variance, mean, vote and disagreement are meaningful on any output.
    ens, x = _ens(), torch.randn(ROWS, 5)
    for reduce in ("variance", "mean", "vote", "disagreement"):
        assert torch.isfinite(vmapens.predict(ens, x, reduce=reduce).float()).all()


def test_a_diverged_member_shows_as_nan_not_as_an_error():
    ens = _ens(nn.Softmax(-1))
    with torch.no_grad():
        ens.stacked_params()["0.weight"][1].fill_(float("nan"))
    out = vmapens.predict(ens, torch.randn(ROWS, 5), reduce="entropy")
    assert out.isnan().all()
