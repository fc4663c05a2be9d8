"""Seeds and best-k selection against their truths: `torch.manual_seed(...)` + `factory()` per
member, and the documented ranking rule applied to N plain modules trained alone."""

from __future__ import annotations

import copy
import functools
import math

import numpy as np
import pytest
import torch
from torch import nn
from truth import TOL64, derived_seed

import vmapens
from vmapens.selection import best_k, member_scores


def mlp(h: int = 4) -> nn.Module:
    return nn.Sequential(nn.Linear(3, h), nn.Tanh(), nn.Linear(h, 1)).double()


def bn_mlp() -> nn.Module:
    # No bias before the BatchNorm: its gradient is rounding noise, which Adam amplifies.
    layers = [nn.Linear(3, 5, bias=False), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 1)]
    return nn.Sequential(*layers).double()


def assert_same_module(a: nn.Module, b: nn.Module, **tol: float) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        if tol:
            torch.testing.assert_close(sa[name], sb[name], msg=name, **tol)
        else:
            assert torch.equal(sa[name], sb[name]), name


def truth_order(scores: list[float], mode: str) -> list[int]:
    """The documented rule: best first, ties by lower row, NaN last."""

    def key(i: int) -> tuple[bool, float, int]:
        s = scores[i]
        if math.isnan(s):
            return (True, 0.0, i)
        return (False, s if mode == "min" else -s, i)

    return sorted(range(len(scores)), key=key)


# -- seeds ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, -3, 2**70])
def test_seeded_members_are_the_plain_construction(seed: int) -> None:
    built = {}
    for n, rng in ((2, 1), (5, 2)):
        torch.manual_seed(rng)
        before = torch.get_rng_state()
        ens = vmapens.Ensemble(bn_mlp, n, seed=seed)
        assert torch.equal(torch.get_rng_state(), before)  # the caller's RNG untouched
        built[n] = ens
        for i in range(n):
            torch.manual_seed(derived_seed(seed, "member", i))
            assert_same_module(bn_mlp(), ens[i])
    for i in range(2):  # member i does not depend on n nor on the global RNG
        assert_same_module(built[2][i], built[5][i])
    sub = built[5].select(torch.tensor([4, 1]))
    assert list(sub.member_ids) == [4, 1]
    torch.manual_seed(derived_seed(seed, "member", 4))
    assert_same_module(bn_mlp(), sub[0])


@pytest.mark.parametrize(
    "seeds",
    [[5, 5, 2**64 - 1], np.array([7, -(2**63), 3]), torch.tensor([1, 2, 3])],
    ids=["list", "numpy", "tensor"],
)
def test_explicit_seeds_are_manual_seed_then_factory(seeds: object) -> None:
    factories = [functools.partial(mlp, h) for h in (2, 4, 3)]
    ens = vmapens.Ensemble.from_factories(factories, seeds=seeds)
    for i, s in enumerate(list(seeds)):  # type: ignore[call-overload]
        torch.manual_seed(int(s))
        assert_same_module(factories[i](), ens[i])


@pytest.mark.parametrize("bad", [2**64, -(2**63) - 1])
def test_out_of_range_seed_is_refused_before_any_member_is_built(bad: int) -> None:
    calls = []

    def factory() -> nn.Module:
        calls.append(1)
        return mlp()

    torch.manual_seed(0)
    before = torch.get_rng_state()
    with pytest.raises(ValueError, match=r"Ensemble: `seeds\[1\]` must be in"):
        vmapens.Ensemble(factory, 2, seeds=[0, bad])
    with pytest.raises(ValueError, match=r"from_factories: `seeds\[1\]` must be in"):
        vmapens.Ensemble.from_factories([factory, factory], seeds=[0, bad])
    assert calls == []  # refused up front, not by torch.manual_seed at member 1
    assert torch.equal(torch.get_rng_state(), before)


# -- selection: the rule -------------------------------------------------------------------

NAN, INF = math.nan, math.inf
RULE_CASES = [
    ([0.3, 0.1, 0.4, 0.2], "min"),
    ([0.3, 0.1, 0.4, 0.2], "max"),
    ([1.0, 1.0, 0.5, 1.0], "min"),
    ([1.0, 1.0, 0.5, 1.0], "max"),
    ([NAN, 1.0, INF, -INF], "min"),
    ([NAN, 1.0, INF, -INF], "max"),
    ([NAN, NAN, NAN, NAN], "min"),
    ([NAN, 2.0, NAN, 2.0], "max"),
]


@pytest.mark.parametrize(("scores", "mode"), RULE_CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_best_k_follows_the_documented_rule(
    scores: list[float], mode: str, dtype: torch.dtype
) -> None:
    ens = vmapens.Ensemble(mlp, 4, seed=1)
    order = truth_order(scores, mode)
    t = torch.tensor(scores, dtype=dtype, requires_grad=True)
    for k in (1, 2, 4):
        sub = best_k(ens, t, k, mode=mode)
        assert list(sub.member_ids) == order[:k]
        for j, i in enumerate(order[:k]):
            assert_same_module(ens[i], sub[j])


def test_member_scores_best_value_per_member() -> None:
    # As EarlyStopping counts them: the best infinity is a value (-inf in "min", +inf in
    # "max"); NaN and the worst infinity are not.
    h = vmapens.History.empty([0, 1, 2], validated=True)
    table = [[3.0, NAN, INF], [2.0, NAN, 4.0], [NAN, NAN, -INF]]
    h.val_loss = torch.tensor(table, dtype=torch.float64)
    for mode, pick in (("min", min), ("max", max)):
        truth = []
        for col in zip(*table, strict=True):
            worst = INF if mode == "min" else -INF
            kept = [v for v in col if not math.isnan(v) and v != worst]
            truth.append(pick(kept) if kept else NAN)
        torch.testing.assert_close(
            member_scores(h, mode=mode), torch.tensor(truth, dtype=torch.float64), equal_nan=True
        )


def test_bad_input_is_refused_with_the_argument_named() -> None:
    ens = vmapens.Ensemble(mlp, 3, seed=0)
    opt = vmapens.StackedAdam(ens, lr=0.1)
    other = vmapens.StackedAdam(vmapens.Ensemble(mlp, 3, seed=1), lr=0.1)
    scores = torch.tensor([0.2, 0.1, 0.3])
    before = copy.deepcopy((ens.state_dict(), opt.state_dict()))
    cases = [
        (dict(k=0), ValueError, "`k` must be >= 1"),
        (dict(k=4), ValueError, r"`k` must be <= the number of members \(3\)"),
        (dict(k=1, mode="best"), ValueError, "`mode`"),
        (dict(k=1, optimizer=other), ValueError, "`optimizer` holds tensors"),
        (dict(k=1, optimizer=torch.optim.SGD(ens.parameters(), lr=0.1)), TypeError, "optim"),
    ]
    for kwargs, error, match in cases:
        with pytest.raises(error, match=f"best_k: .*{match}"):
            best_k(ens, scores, **kwargs)
    with pytest.raises(ValueError, match=r"best_k: scores must have shape \[3\]"):
        best_k(ens, scores[:2], 1)
    with pytest.raises(TypeError, match="best_k: `history_or_scores`"):
        best_k(ens, [0.2, 0.1, 0.3], 1)  # type: ignore[arg-type]
    after = (ens.state_dict(), opt.state_dict())
    torch.testing.assert_close(after[0], before[0], rtol=0, atol=0)
    assert after[1]["param_groups"] == before[1]["param_groups"]


# -- selection after training, against plain modules trained alone -------------------------

N, EPOCHS, PATIENCE = 5, 6, 2
LRS = [0.3, 0.01, 1e200, 0.05, 0.2]  # member 2 diverges in its first epoch


def data() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(
        torch.randn(*shape, generator=g, dtype=torch.float64)
        for shape in ((12, 3), (12, 1), (6, 3), (6, 1))
    )


def plain_early_stopping(i: int, X, Y, Xv, Yv):  # noqa: ANN001, ANN202
    """Member i trained alone: plain Adam, a stop on a non-finite loss, patience, best restore."""
    torch.manual_seed(derived_seed(3, "member", i))
    m = bn_mlp()
    opt = torch.optim.Adam(m.parameters(), lr=LRS[i])
    best, bad, best_state = math.inf, 0, None
    for _ in range(EPOCHS):
        m.train()
        for b in range(3):
            opt.zero_grad()
            loss = nn.functional.mse_loss(m(X[4 * b : 4 * b + 4]), Y[4 * b : 4 * b + 4])
            if not torch.isfinite(loss):
                return m, opt, math.nan
            loss.backward()
            opt.step()
        m.eval()
        with torch.no_grad():
            v = nn.functional.mse_loss(m(Xv), Yv).item()
        if v < best:
            best, bad, best_state = v, 0, copy.deepcopy(m.state_dict())
        else:
            bad += 1
        if bad >= PATIENCE:
            break
    m.load_state_dict(best_state)
    return m, opt, best


def test_best_k_after_early_stopping_is_the_plain_best_members() -> None:
    X, Y, Xv, Yv = data()
    ens = vmapens.Ensemble(bn_mlp, N, seed=3)
    opt = vmapens.StackedAdam(ens, lr=torch.tensor(LRS, dtype=torch.float64))
    h = vmapens.fit(
        ens,
        (X, Y),
        nn.MSELoss(),
        epochs=EPOCHS,
        batch_size=4,
        shuffle=False,
        val_data=(Xv, Yv),
        patience=PATIENCE,
        optimizer=opt,
        progress=False,
    )
    plain = [plain_early_stopping(i, X, Y, Xv, Yv) for i in range(N)]
    truth = [best for _, _, best in plain]
    torch.testing.assert_close(
        member_scores(h), torch.tensor(truth, dtype=torch.float64), equal_nan=True, **TOL64
    )
    order = truth_order(truth, "min")
    assert order[-1] == 2  # the diverged member ranks last
    assert list(best_k(ens, h, N).member_ids) == order
    sub, sub_opt = best_k(ens, h, 3, optimizer=opt)
    assert list(sub.member_ids) == order[:3]
    for k, i in enumerate(order[:3]):
        m, popt, _ = plain[i]
        assert_same_module(m, sub[k], **TOL64)
        mine, theirs = sub_opt.member_state_dict(k), popt.state_dict()
        assert mine["param_groups"][0]["lr"] == theirs["param_groups"][0]["lr"]
        for pid, st in theirs["state"].items():
            for key, value in st.items():
                torch.testing.assert_close(
                    torch.as_tensor(mine["state"][pid][key]).double(),
                    torch.as_tensor(value).double(),
                    msg=key,
                    **TOL64,
                )


def test_best_k_of_members_of_different_sizes_trains_on_as_alone() -> None:
    X, Y, Xv, Yv = data()
    factories = [functools.partial(mlp, h) for h in (2, 4, 3, 4)]
    ens = vmapens.Ensemble.from_factories(factories, seed=1)
    opt = vmapens.StackedAdam(ens, lr=0.05)
    h = vmapens.fit(
        ens,
        (X, Y),
        nn.MSELoss(),
        epochs=2,
        shuffle=False,
        val_data=(Xv, Yv),
        optimizer=opt,
        progress=False,
    )
    order = truth_order(member_scores(h).tolist(), "min")
    sub, sub_opt = best_k(ens, h, 3, optimizer=opt)
    assert list(sub.member_ids) == order[:3]
    alone = []
    for i in order[:3]:
        m = copy.deepcopy(ens[i])
        o = torch.optim.Adam(m.parameters(), lr=0.05)
        o.load_state_dict(opt.member_state_dict(i))
        alone.append((m, o))
    vmapens.fit(
        sub, (X, Y), nn.MSELoss(), epochs=2, shuffle=False, optimizer=sub_opt, progress=False
    )
    for k, (m, o) in enumerate(alone):
        for _ in range(2):
            o.zero_grad()
            nn.functional.mse_loss(m(X), Y).backward()
            o.step()
        assert_same_module(m, sub[k], **TOL64)


def psnr(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 10 * torch.log10(1.0 / ((out - y) ** 2).mean())  # +inf for a perfect fit


def test_best_k_ranks_a_perfect_member_first_as_early_stopping_keeps_it() -> None:
    g = torch.Generator().manual_seed(0)
    X = torch.randn(8, 2, generator=g, dtype=torch.float64)
    Y = X @ torch.tensor([[1.0], [2.0]], dtype=torch.float64)
    starts, lrs = ([[1.0, 2.0]], [[1.1, 2.1]], [[0.0, 0.0]]), [0.0, 0.0, 0.05]

    def member(i: int) -> nn.Module:
        m = nn.Linear(2, 1, bias=False).double()
        with torch.no_grad():
            m.weight.copy_(torch.tensor(starts[i]))
        return m

    best = []  # each member alone: plain SGD, the best epoch as a plain early-stopping loop
    for i in range(3):
        m, value = member(i), -math.inf
        opt = torch.optim.SGD(m.parameters(), lr=lrs[i])
        for _ in range(3):
            opt.zero_grad()
            nn.functional.mse_loss(m(X), Y).backward()
            opt.step()
            with torch.no_grad():
                v = psnr(m(X), Y).item()
            value = v if v > value else value
        best.append(value)
    order = truth_order(best, "max")
    ens = vmapens.Ensemble.from_modules([member(i) for i in range(3)])
    opt = vmapens.StackedSGD(ens, lr=torch.tensor(lrs, dtype=torch.float64))
    stop = vmapens.callbacks.EarlyStopping(monitor="val_psnr", mode="max")
    h = vmapens.fit(
        ens,
        (X, Y),
        nn.MSELoss(),
        epochs=3,
        shuffle=False,
        val_data=(X, Y),
        metrics={"psnr": psnr},
        optimizer=opt,
        callbacks=[stop],
        progress=False,
    )
    assert order[0] == 0  # the perfect member
    assert list(best_k(ens, h, 3, metric="val_psnr", mode="max").member_ids) == order
    assert list(best_k(ens, stop.best_val, 3).member_ids) == order
