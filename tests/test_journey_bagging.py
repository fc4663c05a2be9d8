"""User journey: a bagged ensemble on a tabular problem, member by member against plain PyTorch.

A data scientist's script: 5 float64 MLPs (an `nn.Embedding` for one categorical column,
`BatchNorm1d`, `Dropout`), each trained on its own bootstrap resample, with its own class
weights in the loss, scored out-of-bag, early-stopped on its own out-of-bag loss with its best
weights given back, the top 3 kept by that score (`vmapens.selection.best_k`), saved as member
files and one loaded into a plain module with `torch.load` + `load_state_dict`, and the kept
members' averaged prediction. Four routes to the same job: `fit` on per-member resampled
tensors (`in_dims=0`, out-of-bag scores through per-member validation data whose weights are
the out-of-bag masks), `fit(bootstrap=True, val_data="oob")` interrupted and resumed from its
checkpoint, a hand-written loop (`ens(x, in_dims=0)`, `per_member` with each
member's class-weight vector, masks for the members that stopped, best weights copied from
`ens.state_dicts()`), and a quantile regression with one pinball level `tau` per member over
one DataLoader per member.

The truth: each member a plain module built after `torch.manual_seed(member_seed(seed, i))`
(docs/index.md), trained alone with `torch.optim.Adam` on its own resampled rows in the order
docs/fit.md documents, `F.cross_entropy(..., weight=its class weights)` on its out-of-bag rows,
and EarlyStopping's documented rule. Dropout runs with `randomness="same"`, under which each
member draws what it draws alone from the same RNG state (docs/semantics.md): the truth runs
the members in lock step, each from the RNG state the step starts with. float64 throughout.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset
from truth import derived_seed, resample

import vmapens
from vmapens.selection import best_k

TOL: dict[str, Any] = dict(rtol=1e-9, atol=1e-10)
N, S, F_NUM, CATS, C = 5, 24, 3, 4, 3
SEED, FIT_SEED, RNG, BATCH, EPOCHS, PATIENCE = 7, 11, 5, 8, 5, 1

_g = torch.Generator().manual_seed(0)
XN = torch.randn(S, F_NUM, generator=_g, dtype=torch.float64)
XC = torch.randint(CATS, (S,), generator=_g)
Y = (
    (XN[:, 0] + (XC == 1).double() + 0.3 * torch.randn(S, generator=_g, dtype=torch.float64)) > 0.2
).long() + (XN[:, 1] > 0.8).long()
XN_TEST = torch.randn(10, F_NUM, generator=_g, dtype=torch.float64)
XC_TEST = torch.randint(CATS, (10,), generator=_g)
CLASS_W = 0.5 + torch.rand(N, C, generator=_g, dtype=torch.float64)  # member i's class weights
ROWS = [resample(S, FIT_SEED, i) for i in range(N)]
OOB = torch.stack([~torch.isin(torch.arange(S), r) for r in ROWS])  # [N, S] out-of-bag masks


class Tabular(nn.Module):
    def __init__(self, out: int = C) -> None:
        super().__init__()
        self.emb = nn.Embedding(CATS, 2)
        self.fc1 = nn.Linear(F_NUM + 2, 8, bias=False)  # before BatchNorm (semantics.md)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.2)
        self.fc2 = nn.Linear(8, out)

    def forward(self, xn: torch.Tensor, xc: torch.Tensor) -> torch.Tensor:
        h = torch.cat([xn, self.emb(xc)], -1)
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(h)))))


def tabular() -> nn.Module:
    return Tabular().double()


# -- the truth, written again from the docs ---------------------------------------------------


def alone(i: int) -> nn.Module:
    torch.manual_seed(derived_seed(SEED, "member", i))
    return tabular()


def order(p: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(derived_seed(FIT_SEED, "shuffle", p))
    return torch.randperm(S, generator=g)


def oob_loss(model: nn.Module, i: int, weight: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        m = OOB[i]
        value = F.cross_entropy(model(XN[m], XC[m]), Y[m], weight=weight)
    model.train()
    return float(value)


def naive_bagging(lrs: list[float], weights: torch.Tensor = CLASS_W) -> list[dict[str, Any]]:
    """Every member alone, in lock step (dropout: each from the step's RNG state): its own
    Adam, its resample's rows in docs/fit.md's order (positions shared, rows its own), its
    class-weighted loss, its out-of-bag loss after each epoch, EarlyStopping's rule (strictly
    better than the best so far; stop after `PATIENCE` epochs without) and best-epoch restore."""
    runs = []
    for i in range(N):
        model = alone(i)
        runs.append(dict(model=model, opt=torch.optim.Adam(model.parameters(), lr=lrs[i]),
                         best=math.inf, bad=0, state=None, values=[], best_epoch=-1,
                         stopped=-1))  # fmt: skip
    torch.manual_seed(RNG)  # the dropout masks' stream, as the ensemble's run starts it
    for epoch in range(EPOCHS):
        perm = order(epoch)
        for k in range(0, S, BATCH):
            rng = torch.get_rng_state()
            for i, run in enumerate(runs):
                if run["stopped"] >= 0:
                    continue
                torch.set_rng_state(rng)
                r = ROWS[i][perm[k : k + BATCH]]
                run["opt"].zero_grad()
                out = run["model"](XN[r], XC[r])
                F.cross_entropy(out, Y[r], weight=weights[i]).backward()
                run["opt"].step()
        for i, run in enumerate(runs):
            if run["stopped"] >= 0:
                continue
            value = oob_loss(run["model"], i, weights[i])
            run["values"].append(value)
            if value < run["best"]:
                run.update(best=value, bad=0, best_epoch=epoch,
                           state=copy.deepcopy(run["model"].state_dict()))  # fmt: skip
            else:
                run["bad"] += 1
                if run["bad"] >= PATIENCE:
                    run["stopped"] = epoch
    for run in runs:
        run["model"].load_state_dict(run["state"])
    return runs


def assert_member(state: dict[str, torch.Tensor], model: nn.Module, where: str) -> None:
    truth = model.state_dict()
    assert sorted(state) == sorted(truth), where
    for key, value in truth.items():
        torch.testing.assert_close(state[key], value, **TOL, msg=f"{where}: {key}")


# -- the journey ------------------------------------------------------------------------------


def weighted_ce(out: torch.Tensor, target: dict[str, torch.Tensor]) -> torch.Tensor:
    """One member's class-weighted cross-entropy, its weights per row (`w[y]`, zero off the
    rows scored): `F.cross_entropy(weight=w)`'s mean, the weighted sum over the weights' sum."""
    w = target["w"]
    return (F.cross_entropy(out, target["y"], reduction="none") * w).sum() / w.sum()


def test_bagged_fit_with_class_weights_oob_early_stopping_best_k_and_member_files(
    tmp_path: Path,
) -> None:
    lrs = [0.01, 0.03, 0.05, 0.02, 0.04]
    rows = torch.stack(ROWS)  # [N, S]
    cw = torch.stack([CLASS_W[i][Y] for i in range(N)])  # [N, S]: member i's weight of each row
    data = ((XN[rows], XC[rows]), {"y": Y[rows], "w": cw.gather(1, rows)})
    # Out-of-bag scores: every member scored on all training rows, weighted by its own
    # out-of-bag mask times its class weights.
    val = ((XN.expand(N, S, F_NUM), XC.expand(N, S)), {"y": Y.expand(N, S), "w": cw * OOB})
    ens = vmapens.Ensemble(tabular, N, seed=SEED, randomness="same")
    torch.manual_seed(RNG)
    history = vmapens.fit(ens, data, weighted_ce, in_dims=(0, 0), epochs=EPOCHS, batch_size=BATCH,
                          lr=lrs, val_data=val, patience=PATIENCE, seed=FIT_SEED,
                          progress=False)  # fmt: skip
    truth = naive_bagging(lrs)
    assert history.best_epoch.tolist() == [run["best_epoch"] for run in truth]
    assert history.stopped_epoch.tolist() == [run["stopped"] for run in truth]
    assert history.val_loss is not None
    for i, run in enumerate(truth):
        got = history.val_loss[:, i]
        torch.testing.assert_close(
            got[~got.isnan()], torch.tensor(run["values"], dtype=torch.float64), **TOL
        )
        assert_member(ens[i].state_dict(), run["model"], f"member {i}")
    assert any(run["stopped"] >= 0 for run in truth)  # early stopping stopped someone
    # The top 3 by best out-of-bag loss, best first.
    top = best_k(ens, history, 3)
    best = [run["best"] for run in truth]
    want = sorted(range(N), key=lambda i: (best[i], i))[:3]
    assert list(top.member_ids) == want
    paths = vmapens.save_members(top, tmp_path / "members")
    assert [p.name for p in paths] == [f"member_{i:04d}.pt" for i in want]  # global ids
    plain = Tabular().double()
    plain.load_state_dict(torch.load(paths[0]))
    plain.eval()
    model0 = truth[want[0]]["model"].eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(XN_TEST, XC_TEST), model0(XN_TEST, XC_TEST), **TOL)
        mean = vmapens.predict(top, (XN_TEST, XC_TEST), reduce="mean", softmax=True)
        outs = [truth[i]["model"].eval()(XN_TEST, XC_TEST).softmax(-1) for i in want]
    torch.testing.assert_close(mean, sum(outs) / 3, **TOL)


def test_a_hand_written_bagging_loop_with_class_weight_vectors_masks_and_best_copies(
    tmp_path: Path,
) -> None:
    lrs = [0.02, 0.05, 0.01, 0.04, 0.03]
    rows = torch.stack(ROWS)  # [N, S]: member i's resample
    ens = vmapens.Ensemble(tabular, N, seed=SEED, randomness="same")
    opt = vmapens.StackedAdam(ens, lr=lrs)
    # member i's loss with its own class-weight vector: the weight mapped like the output
    train_loss = vmapens.per_member(
        lambda out, y, w: F.cross_entropy(out, y, weight=w), in_dims=(0, 0, 0)
    )
    # out-of-bag: a boolean mask as an index, which per_member runs member by member
    oob_loss_fn = vmapens.per_member(
        lambda out, y, w, m: F.cross_entropy(out[m], y[m], weight=w), in_dims=(0, None, 0, 0)
    )
    active = torch.ones(N, dtype=torch.bool)
    best, bad = torch.full((N,), math.inf, dtype=torch.float64), torch.zeros(N, dtype=torch.long)
    best_states: list[dict[str, torch.Tensor] | None] = [None] * N
    values: list[list[float]] = [[] for _ in range(N)]
    at_stop: dict[int, dict[str, torch.Tensor]] = {}
    torch.manual_seed(RNG)
    for epoch in range(EPOCHS):
        perm = order(epoch)
        for k in range(0, S, BATCH):
            r = rows[:, perm[k : k + BATCH]]  # [N, B]: each member's own rows
            out = ens(XN[r], XC[r], in_dims=0)
            losses = train_loss(out, Y[r], CLASS_W)
            opt.zero_grad()
            losses.sum().backward()
            opt.step(mask=active)
        ens.eval()
        with torch.no_grad():
            scores = oob_loss_fn(ens(XN, XC), Y, CLASS_W, OOB)
        ens.train()
        states = ens.state_dicts()
        for i in range(N):
            if not active[i]:
                continue
            values[i].append(float(scores[i]))
            if scores[i] < best[i]:
                best[i], bad[i], best_states[i] = scores[i], 0, copy.deepcopy(states[i])
            else:
                bad[i] += 1
                active[i] = bad[i] < PATIENCE
                if not active[i]:
                    at_stop[i] = copy.deepcopy(states[i])
        if not active.any():
            break
    # A stopped member's parameters stay as they were when it stopped (the optimizer's mask);
    # its BatchNorm statistics do not: its forward still ran in train mode, which alone it
    # would not. The best-epoch copies below put those back too.
    for i, state in at_stop.items():
        now = ens[i].state_dict()
        for key, _ in ens.template.named_parameters():
            assert torch.equal(now[key], state[key]), (i, key)
    # every member back to its best epoch's weights and BatchNorm statistics (semantics.md)
    stacked = ens.state_dict()
    with torch.no_grad():
        for i, state in enumerate(best_states):
            assert state is not None
            for key, value in state.items():
                stacked[key][i].copy_(value)
    truth = naive_bagging(lrs)
    for i, run in enumerate(truth):
        torch.testing.assert_close(torch.tensor(values[i], dtype=torch.float64),
                                   torch.tensor(run["values"], dtype=torch.float64), **TOL)  # fmt: skip
        assert_member(ens[i].state_dict(), run["model"], f"member {i}")
    assert not active.all()  # someone stopped early
    top = best_k(ens, best, 3)  # scores as a tensor: lower is better
    want = sorted(range(N), key=lambda i: (truth[i]["best"], i))[:3]
    assert list(top.member_ids) == want
    vmapens.save_members(top, tmp_path / "members")
    states = vmapens.load_members(tmp_path / "members")
    models = []
    for state in states:
        model = Tabular().double()
        model.load_state_dict(state)
        models.append(model.eval())
    with torch.no_grad():
        for model, i in zip(models, want):
            torch.testing.assert_close(model(XN_TEST, XC_TEST),
                                       truth[i]["model"].eval()(XN_TEST, XC_TEST), **TOL)  # fmt: skip
        mean = vmapens.predict(top, (XN_TEST, XC_TEST), reduce="mean")
        torch.testing.assert_close(mean, sum(m(XN_TEST, XC_TEST) for m in models) / 3, **TOL)


def test_fit_bootstrap_true_with_oob_validation_and_a_resumed_checkpoint(tmp_path: Path) -> None:
    # The shortest script: fit resamples (bootstrap=True) and scores out-of-bag itself, one
    # class-weight vector shared by the members (a loss module's `weight`); interrupted after
    # epoch 2 and resumed in what could be a new process (another global RNG state).
    lrs = [0.03, 0.01, 0.05, 0.04, 0.02]
    weight = CLASS_W[0]
    options: dict[str, Any] = dict(bootstrap=True, val_data="oob", epochs=EPOCHS, lr=lrs,
                                   batch_size=BATCH, patience=PATIENCE, seed=FIT_SEED,
                                   progress=False, checkpoint=tmp_path / "bag.pt")  # fmt: skip

    def interrupt(history: Any) -> None:
        if history.epochs == 2:
            raise KeyboardInterrupt

    ens = vmapens.Ensemble(tabular, N, seed=SEED, randomness="same")
    torch.manual_seed(RNG)
    with pytest.raises(KeyboardInterrupt):
        vmapens.fit(ens, ((XN, XC), Y), nn.CrossEntropyLoss(weight=weight),
                    callbacks=[interrupt], **options)  # fmt: skip
    torch.manual_seed(RNG + 1)
    ens = vmapens.Ensemble(tabular, N, seed=SEED, randomness="same")
    history = vmapens.fit(ens, ((XN, XC), Y), nn.CrossEntropyLoss(weight=weight), **options)
    truth = naive_bagging(lrs, weight.expand(N, C))
    assert history.val_loss is not None
    for i, run in enumerate(truth):
        got = history.val_loss[:, i]
        torch.testing.assert_close(
            got[~got.isnan()], torch.tensor(run["values"], dtype=torch.float64), **TOL
        )
        assert_member(ens[i].state_dict(), run["model"], f"member {i}")
    assert history.stopped_epoch.tolist() == [run["stopped"] for run in truth]
    assert history.best_epoch.tolist() == [run["best_epoch"] for run in truth]


# -- quantile regression: one pinball level per member, one DataLoader per member --------------

TAU = torch.tensor([0.1, 0.3, 0.5, 0.7, 0.9], dtype=torch.float64)
YQ = (XN[:, :1] + 0.5 * (XC == 2).double().unsqueeze(1)
      + torch.randn(S, 1, generator=_g, dtype=torch.float64))  # fmt: skip


def regressor() -> nn.Module:
    return Tabular(out=1).double()


class Rows(Dataset):
    """Member i's resample: ((numeric, category), {"y", "tau", "w"}) per row."""

    def __init__(self, i: int) -> None:
        self.rows, self.tau = ROWS[i], TAU[i]

    def __len__(self) -> int:
        return S

    def __getitem__(self, k: int) -> Any:
        r = self.rows[k]
        target = {"y": YQ[r], "tau": self.tau.expand(1), "w": torch.ones(1, dtype=torch.float64)}
        return (XN[r], XC[r]), target


def loaders() -> list[DataLoader]:
    return [DataLoader(Rows(i), batch_size=BATCH, shuffle=True,
                       generator=torch.Generator().manual_seed(100 + i))
            for i in range(N)]  # fmt: skip


def pinball(q: torch.Tensor, target: dict[str, torch.Tensor]) -> torch.Tensor:
    """One member's pinball loss at its level `tau`, weighted per row (`w`: the out-of-bag
    mask in validation, ones in training)."""
    diff, tau, w = target["y"] - q, target["tau"], target["w"]
    return (torch.maximum(tau * diff, (tau - 1) * diff) * w).sum() / w.sum()


def pinball_alone(q: torch.Tensor, y: torch.Tensor, tau: float) -> torch.Tensor:
    diff = y - q
    return torch.maximum(tau * diff, (tau - 1) * diff).mean()


def naive_quantiles(lr: float) -> list[dict[str, Any]]:
    """Each member alone over its own DataLoader (the same generator seed), its pinball level,
    out-of-bag early stopping as in `naive_bagging`, in lock step for dropout."""
    runs = []
    for i in range(N):
        torch.manual_seed(derived_seed(SEED, "member", i))
        model = regressor()
        runs.append(dict(model=model, opt=torch.optim.Adam(model.parameters(), lr=lr),
                         best=math.inf, bad=0, state=None, values=[], stopped=-1))  # fmt: skip
    own = loaders()
    torch.manual_seed(RNG)
    for epoch in range(EPOCHS):
        batches = [list(loader) for loader in own]  # each loader's pass, from its own generator
        for k in range(len(batches[0])):
            rng = torch.get_rng_state()
            for i, run in enumerate(runs):
                if run["stopped"] >= 0:
                    continue
                torch.set_rng_state(rng)
                (xn, xc), target = batches[i][k]
                run["opt"].zero_grad()
                pinball_alone(run["model"](xn, xc), target["y"], float(TAU[i])).backward()
                run["opt"].step()
        for i, run in enumerate(runs):
            if run["stopped"] >= 0:
                continue
            m = run["model"].eval()
            with torch.no_grad():
                value = float(pinball_alone(m(XN[OOB[i]], XC[OOB[i]]), YQ[OOB[i]], float(TAU[i])))
            m.train()
            run["values"].append(value)
            if value < run["best"]:
                run.update(best=value, bad=0, state=copy.deepcopy(m.state_dict()))
            else:
                run["bad"] += 1
                if run["bad"] >= PATIENCE:
                    run["stopped"] = epoch
    for run in runs:
        run["model"].load_state_dict(run["state"])
    return runs


def test_quantile_members_with_their_own_tau_over_one_dataloader_each() -> None:
    val = ((XN.expand(N, S, F_NUM), XC.expand(N, S)),
           {"y": YQ.expand(N, S, 1), "tau": TAU.view(N, 1, 1).expand(N, S, 1),
            "w": OOB.double().unsqueeze(-1)})  # fmt: skip
    ens = vmapens.Ensemble(regressor, N, seed=SEED, randomness="same")
    torch.manual_seed(RNG)
    history = vmapens.fit(ens, loaders(), pinball, in_dims=(0, 0), epochs=EPOCHS, lr=0.05,
                          val_data=val, patience=PATIENCE, progress=False)  # fmt: skip
    truth = naive_quantiles(0.05)
    assert history.val_loss is not None
    for i, run in enumerate(truth):
        got = history.val_loss[:, i]
        torch.testing.assert_close(
            got[~got.isnan()], torch.tensor(run["values"], dtype=torch.float64), **TOL
        )
        assert_member(ens[i].state_dict(), run["model"], f"member {i}")
    assert history.stopped_epoch.tolist() == [run["stopped"] for run in truth]
    # the levels order the members' predictions on average, as quantiles should
    with torch.no_grad():
        q = vmapens.predict(ens, (XN, XC)).mean((1, 2))
    assert q.argsort().tolist() == list(range(N))


def test_per_member_loaders_with_other_last_batches_are_refused_before_training() -> None:
    sizes = [24, 24, 20, 24, 24]  # member 2 resampled 20 rows: a last batch of 4, not 8
    own = [DataLoader(TensorDataset(XN[ROWS[i][:s]], Y[ROWS[i][:s]]), batch_size=BATCH,
                      shuffle=True, generator=torch.Generator().manual_seed(i))
           for i, s in enumerate(sizes)]  # fmt: skip
    ens = vmapens.Ensemble(lambda: nn.Linear(F_NUM, C).double(), N, seed=SEED)
    before = [t.clone() for t in ens.state_dict().values()]
    with pytest.raises(ValueError, match=r"^fit: the per-member DataLoaders give batches"):
        vmapens.fit(ens, own, nn.CrossEntropyLoss(), in_dims=0, epochs=1, progress=False)
    for was, now in zip(before, ens.state_dict().values(), strict=True):
        assert torch.equal(was, now)  # refused before any step: nothing changed
