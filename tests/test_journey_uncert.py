"""A user journey: uncertainty estimation with a deep ensemble (docs/workflows.md).

The script a researcher writes from docs/workflows.md ("Predictions and uncertainty"),
`vmapens.predict`'s docstring and docs/semantics.md ("Randomness in the forward pass"): 5 MLP
classifiers with Dropout in float64, trained briefly with `fit`, then the predictive
distribution (`reduce="mean", softmax=True`), its entropy, the mutual information (BALD),
variance, vote and disagreement, the expected calibration error from the mean prediction,
`predict` in batches, by chunks of members and over a DataLoader, out-of-distribution inputs,
and MC dropout (the ensemble in eval mode with its Dropout in train mode).

The truth: the naive loop in plain PyTorch (one module per member, its own `torch.optim.Adam` (fit's default optimizer),
the batches of docs/fit.md's documented shuffle formula), the members alone (`unstack()`, in
eval mode), and every documented formula written again here by hand. MC dropout masks are
documented "in distribution only", so they are checked by their documented semantics: who
shares masks under `randomness="same"`/`"different"`, determinism from the global RNG, and
the mean over passes.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from truth import derived_seed

import vmapens
from vmapens.predict import REDUCTIONS

N, EPOCHS, BATCH, LR, P = 5, 3, 8, 0.05, 0.3
TOL: dict[str, Any] = {
    "rtol": 1e-12,
    "atol": 1e-12,
}  # float64: the same maths, sums in another order

_g = torch.Generator().manual_seed(3)
X = torch.randn(30, 4, generator=_g, dtype=torch.float64)
Y = (X[:, :2].sum(1) > 0).long() + (X[:, 2] > 0.5).long()  # 3 classes
X_TEST = torch.randn(13, 4, generator=_g, dtype=torch.float64)
Y_TEST = (X_TEST[:, :2].sum(1) > 0).long() + (X_TEST[:, 2] > 0.5).long()
X_OOD = 40 * torch.randn(9, 4, generator=_g, dtype=torch.float64)  # far from the data
Trained = tuple[vmapens.Ensemble, list[nn.Module]]


def member() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(P), nn.Linear(8, 3)).double()


def batches(seed: int, p: int) -> list[tuple[Tensor, Tensor]]:
    """Pass `p`'s batches, from docs/fit.md's formula (sha256 of the seed and pass number)."""
    s_p = derived_seed(seed, "shuffle", p)
    order = torch.randperm(len(X), generator=torch.Generator().manual_seed(s_p))
    return [(X[order[k : k + BATCH]], Y[order[k : k + BATCH]]) for k in range(0, len(X), BATCH)]


def naive_members() -> list[nn.Module]:
    """The plain loop: member i built as `torch.manual_seed(i); member()`, trained alone in
    eval mode (Dropout off, so the run is exact), Adam per member."""
    models = []
    for i in range(N):
        torch.manual_seed(i)
        model = member().eval()
        opt = torch.optim.Adam(model.parameters(), lr=LR)  # fit's default, StackedAdam
        for epoch in range(EPOCHS):
            for xb, yb in batches(0, epoch):
                opt.zero_grad()
                nn.functional.cross_entropy(model(xb), yb).backward()
                opt.step()
        models.append(model)
    return models


@pytest.fixture(scope="module")
def trained() -> Trained:
    ens = vmapens.Ensemble(member, n=N, seeds=range(N)).eval()
    vmapens.fit(
        ens,
        (X, Y),
        nn.CrossEntropyLoss(),
        epochs=EPOCHS,
        batch_size=BATCH,
        lr=LR,
        seed=0,
        progress=False,
    )
    return ens, naive_members()


def alone_probs(models: list[nn.Module], x: Tensor) -> Tensor:
    """Each member alone in eval mode: its softmax, stacked `[n, samples, classes]`."""
    outs = []
    with torch.no_grad():
        for m in models:
            m.eval()
            outs.append(torch.softmax(m(x), -1))
    return torch.stack(outs)


def entropy(p: Tensor) -> Tensor:
    """H[p] = -sum_c p_c log p_c (natural log, 0 log 0 = 0), over the last dim."""
    logs = torch.where(p > 0, p.log(), torch.zeros_like(p))
    return -(p * logs).sum(-1)


def disagreement(p: Tensor) -> Tensor:
    """Fraction of ordered member pairs i != j whose argmax classes differ."""
    cls = p.argmax(-1)  # [n, samples]
    n = cls.shape[0]
    differ = torch.zeros(cls.shape[1:], dtype=torch.float64)
    for i in range(n):
        for j in range(n):
            if i != j:
                differ += (cls[i] != cls[j]).double()
    return differ / (n * (n - 1))


def ece(probs: Tensor, target: Tensor, bins: int = 5) -> float:
    """Expected calibration error: sum_b |B|/S * |acc(B) - conf(B)|, equal-width bins of the
    top-class confidence, written by hand."""
    conf, pred = probs.max(-1)
    total = 0.0
    for b in range(bins):
        lo, hi = b / bins, (b + 1) / bins
        inside = [k for k in range(len(conf)) if lo < float(conf[k]) <= hi]
        if inside:
            acc = sum(float(pred[k] == target[k]) for k in inside) / len(inside)
            mean_conf = sum(float(conf[k]) for k in inside) / len(inside)
            total += len(inside) / len(conf) * abs(acc - mean_conf)
    return total


def test_fit_matches_the_naive_loop(trained: Trained) -> None:
    ens, models = trained
    for i, (mine, alone) in enumerate(zip(ens.unstack(), models)):
        for (name, a), b in zip(mine.state_dict().items(), alone.state_dict().values()):
            torch.testing.assert_close(a, b, **TOL, msg=f"member {i} {name}")


@pytest.mark.parametrize("x", [X_TEST, X_OOD], ids=["test", "ood"])
def test_reductions_match_the_members_alone(trained: Trained, x: Tensor) -> None:
    ens, _ = trained
    p = alone_probs(ens.unstack(), x)
    mean = p.mean(0)
    got = {r: vmapens.predict(ens, x, reduce=r, softmax=True) for r in REDUCTIONS}
    torch.testing.assert_close(got["none"], p, **TOL)
    torch.testing.assert_close(got["mean"], mean, **TOL)
    torch.testing.assert_close(got["min"], p.min(0).values, **TOL)
    torch.testing.assert_close(got["max"], p.max(0).values, **TOL)
    torch.testing.assert_close(got["variance"], ((p - mean) ** 2).mean(0), **TOL)
    torch.testing.assert_close(got["entropy"], entropy(mean), **TOL)
    mi = entropy(mean) - entropy(p).mean(0)
    torch.testing.assert_close(got["mutual_information"], mi, **TOL)
    torch.testing.assert_close(got["disagreement"], disagreement(p), **TOL)
    votes = torch.stack([p.argmax(-1).eq(c).sum(0) for c in range(3)], -1)
    torch.testing.assert_close(got["vote"], votes.argmax(-1))
    assert (mi >= -1e-12).all()


def test_batches_chunks_and_a_dataloader_give_one_batch_results(trained: Trained) -> None:
    ens, _ = trained
    p = alone_probs(ens.unstack(), X_TEST)
    loader = DataLoader(TensorDataset(X_TEST), batch_size=4)
    for reduce, truth in (
        ("mean", p.mean(0)),
        ("entropy", entropy(p.mean(0))),
        ("disagreement", disagreement(p)),
        ("none", p),
    ):
        for kwargs in ({"batch_size": 4}, {"chunk_size": 2}, {"batch_size": 5, "chunk_size": 3}):
            got = vmapens.predict(ens, X_TEST, reduce=reduce, softmax=True, **kwargs)
            torch.testing.assert_close(got, truth, **TOL, msg=f"{reduce} {kwargs}")
        got = vmapens.predict(ens, loader, reduce=reduce, softmax=True, chunk_size=2)
        torch.testing.assert_close(got, truth, **TOL, msg=f"{reduce} DataLoader")
    assert ens.chunk_size is None  # the call's chunk_size is its own


def test_calibration_from_the_mean_prediction(trained: Trained) -> None:
    ens, _ = trained
    probs = vmapens.predict(ens, X_TEST, reduce="mean", softmax=True, batch_size=4)
    truth = alone_probs(ens.unstack(), X_TEST).mean(0)
    assert ece(probs, Y_TEST) == pytest.approx(ece(truth, Y_TEST), abs=1e-12)
    assert 0 <= ece(probs, Y_TEST) <= 1
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(X_TEST), dtype=torch.float64))


def test_out_of_distribution_inputs(trained: Trained) -> None:
    ens, _ = trained
    # Saturated softmaxes (exact 0s) and a NaN input row: docs say non-finite rows show as NaN.
    x = torch.cat([X_OOD, torch.full((1, 4), float("nan"), dtype=torch.float64)])
    p = alone_probs(ens.unstack(), x)
    for reduce, truth in (
        ("entropy", entropy(p.mean(0))),
        ("mutual_information", entropy(p.mean(0)) - entropy(p).mean(0)),
    ):
        got = vmapens.predict(ens, x, reduce=reduce, softmax=True, batch_size=4)
        torch.testing.assert_close(got, truth, **TOL, equal_nan=True, msg=reduce)
        assert got[-1].isnan() and got[:-1].isfinite().all()


def dropouts(ens: vmapens.Ensemble) -> list[nn.Module]:
    # ens.modules() yields the ensemble alone (docs/semantics.md): the members' modules are
    # the template's.
    return [m for m in ens.template.modules() if isinstance(m, nn.Dropout)]


def dropout_on(m: nn.Module) -> None:
    if isinstance(m, nn.Dropout):
        m.train()


def mc_dropout(ens: vmapens.Ensemble, x: Tensor, passes: int) -> Tensor:
    """MC dropout as a user writes it: eval mode, then every Dropout back in train mode."""
    ens.eval().apply(dropout_on)  # modes set by `apply` carry over (Ensemble.apply)
    with torch.no_grad():
        return torch.stack([ens(x) for _ in range(passes)])  # [passes, n, samples, classes]


def test_mc_dropout_modes_and_predict_restore(trained: Trained) -> None:
    ens, _ = trained
    ens = copy.deepcopy(ens)
    outs = mc_dropout(ens, X_TEST, 2)
    assert not torch.equal(outs[0], outs[1])  # a new mask every call
    # predict runs every module in eval mode (no dropout) and gives the modes back after.
    p = alone_probs(ens.unstack(), X_TEST)
    torch.testing.assert_close(vmapens.predict(ens, X_TEST, softmax=True), p, **TOL)
    assert all(m.training for m in dropouts(ens)) and not ens.training
    # the members alone follow the ensemble's per-module modes: MC dropout alone, too
    alone = ens.unstack()
    assert all(isinstance(m, nn.Sequential) and m[2].training and not m.training for m in alone)


@pytest.mark.parametrize(("backend", "chunk_size"), [("vmap", None), ("vmap", 2), ("loop", None)])
def test_mc_dropout_masks_follow_randomness(backend: str, chunk_size: int | None) -> None:
    torch.manual_seed(0)
    one = member()
    x = X_TEST
    kw: dict[str, Any] = {"backend": backend, "chunk_size": chunk_size}
    same = vmapens.Ensemble.from_modules(
        [copy.deepcopy(one) for _ in range(N)], randomness="same", **kw
    )
    diff = vmapens.Ensemble.from_modules([copy.deepcopy(one) for _ in range(N)], **kw)
    out_same = mc_dropout(same, x, 1)[0]
    for i in range(1, N):  # identical members, one mask per call: identical outputs
        torch.testing.assert_close(out_same[i], out_same[0], rtol=0, atol=0)
    out_diff = mc_dropout(diff, x, 1)[0]
    for i in range(1, N):  # each member its own mask
        assert not torch.equal(out_diff[i], out_diff[0])
    # the masks come from the global RNG: the same seed, the same passes
    torch.manual_seed(5)
    a = mc_dropout(diff, x, 2)
    torch.manual_seed(5)
    torch.testing.assert_close(mc_dropout(diff, x, 2), a, rtol=0, atol=0)
    # in distribution: inverted dropout then a linear layer is unbiased, so the mean over
    # passes tends to the eval-mode output, and the passes spread as one module's alone
    torch.manual_seed(1)
    many = mc_dropout(diff, x, 400)
    with torch.no_grad():
        eval_out = one.eval()(x)
    spread = many.std(0).max()
    assert (many.mean(0) - eval_out).abs().max() < 5 * spread / math.sqrt(400)
    # each member alone with its Dropout in train mode: the same spread of outputs
    torch.manual_seed(2)
    with torch.no_grad():
        solo = torch.stack([one.train()(x) for _ in range(400)])
    torch.testing.assert_close(many.std(0).mean(0), solo.std(0), rtol=0.25, atol=1e-3)


def test_trained_with_dropout_then_predicted() -> None:
    """The usual recipe: fit in train mode (dropout on, masks in distribution only), then
    predict, in batches, by chunks: every reduction as the members alone in eval mode."""
    ens = vmapens.Ensemble(member, n=N, seed=1)
    vmapens.fit(
        ens,
        (X, Y),
        nn.CrossEntropyLoss(),
        epochs=2,
        batch_size=BATCH,
        lr=LR,
        bootstrap=True,
        seed=1,
        progress=False,
    )
    assert ens.training and all(m.training for m in dropouts(ens))
    p = alone_probs(ens.unstack(), torch.cat([X_TEST, X_OOD]))
    got = vmapens.predict(
        ens,
        torch.cat([X_TEST, X_OOD]),
        reduce="mutual_information",
        softmax=True,
        batch_size=6,
        chunk_size=3,
    )
    torch.testing.assert_close(got, entropy(p.mean(0)) - entropy(p).mean(0), **TOL)
    assert ens.training and all(m.training for m in dropouts(ens))  # modes given back
