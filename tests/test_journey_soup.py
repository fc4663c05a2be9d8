"""A user journey: model soups (Wortsman et al., 2022) from one fine-tuning sweep.

The script a researcher writes from README.md, docs/semantics.md ("Container operations",
"Randomness in the forward pass", the SWA paragraph), docs/optim.md and docs/fit.md ("member
files"): one pretrained plain module (float64, an MLP with LayerNorm and dropout, or with
BatchNorm) is loaded into 5 members (`Ensemble.from_modules([base] * 5)`, or `Ensemble(...)`
then `load_state_dict` of the base's tensors expanded over the members), fine-tuned with a
per-member sweep (AdamW's lr and weight decay as `StackedAdam(decoupled_weight_decay=True)`
lists, label smoothing as a per-member target, each member's own data order via `in_dims=0`,
dropout under `randomness="same"` with the global seed set before each step); then

* the uniform soup (the mean of every member's weights, from `ens.state_dict()`,
  `ens.state_dicts()`, `ens.unstack()` or member files) and the greedy soup (members added in
  order of validation accuracy from `vmapens.predict`, or from `fit`'s history through
  `selection.member_scores`/`best_k`, while the soup's accuracy does not drop), each evaluated
  as a plain module; the ingredients selected with their optimizer (`select`, a member twice)
  and trained on;
* linear mode connectivity: the weights interpolated between two members at 5 alphas, loaded
  into an ensemble of 5 (`load_state_dict`, or `select` of one member repeated) and evaluated
  at once; with BatchNorm, the statistics averaged or recomputed (`vmapens.swa.update_bn`);
* the soup put back as a member (row `i` overwritten as docs/semantics.md says, with its Adam
  state zeroed; or `Ensemble.from_modules(unstack() + [soup])` with the old optimizer state
  extended by zero rows), then the ensemble trained on.

The truth is plain PyTorch: 5 modules, each fine-tuned alone with `torch.optim.AdamW` and
`F.cross_entropy(label_smoothing=...)` on its batches, soups and interpolations written as
Python loops over their state dicts, torch's own `update_bn`.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim.swa_utils import update_bn as torch_update_bn
from truth import batch_plan

import vmapens
from vmapens.callbacks import EarlyStopping

N, STEPS, BATCH, ALPHAS = 5, 6, 16, [0.0, 0.25, 0.5, 0.75, 1.0]
LRS = [1e-3, 3e-3, 1e-2, 3e-2, 6e-2]
WDS = [0.0, 1e-3, 1e-2, 1e-1, 0.3]
SMOOTH = [0.0, 0.05, 0.1, 0.2, 0.3]
TOL: dict[str, Any] = {"rtol": 1e-10, "atol": 1e-12}  # float64, sums in another order

_g = torch.Generator().manual_seed(0)
_W = torch.randn(6, 3, generator=_g, dtype=torch.float64)
X = torch.randn(160, 6, generator=_g, dtype=torch.float64)
Y = (X @ _W + 0.5 * torch.randn(160, 3, generator=_g, dtype=torch.float64)).argmax(-1)
TRAIN, VAL = (X[:96], Y[:96]), (X[96:], Y[96:])


def ln_net() -> nn.Module:
    return nn.Sequential(
        nn.Linear(6, 16), nn.LayerNorm(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3)
    ).double()


def bn_net() -> nn.Module:
    # bias=False before BatchNorm: that bias's true gradient is 0 and Adam would step on its
    # round-off, alone as in the ensemble (docs/semantics.md)
    return nn.Sequential(
        nn.Linear(6, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3)
    ).double()


def pretrained(factory: Any) -> nn.Module:
    """The researcher's starting point: a plain module trained a little with plain torch."""
    torch.manual_seed(123)
    base = factory()
    opt = torch.optim.SGD(base.parameters(), lr=0.1)
    for k in range(3):
        opt.zero_grad()
        F.cross_entropy(base(X[k * 32 : (k + 1) * 32]), Y[k * 32 : (k + 1) * 32]).backward()
        opt.step()
    return base


def orders(step: int, n: int = N) -> list[Tensor]:
    """Member i's rows at `step`: its own data order, drawn from its own seed."""
    out = []
    for i in range(n):
        perm = torch.randperm(96, generator=torch.Generator().manual_seed(1000 * i + step // 6))
        out.append(perm[(step % 6) * BATCH : (step % 6 + 1) * BATCH])
    return out


def smoothed_ce(out: Tensor, target: tuple[Tensor, Tensor]) -> Tensor:
    """`F.cross_entropy(out, y, label_smoothing=eps)` written for a per-member (0-d) `eps`."""
    y, eps = target
    logp = out.log_softmax(-1)
    nll = -logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    return ((1 - eps) * nll - eps * logp.mean(-1)).mean()


def plain_opt(model: nn.Module, i: int) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LRS[i], weight_decay=WDS[i])


def plain_step(models: list[nn.Module], opts: list, step: int) -> None:
    """The naive loop: each member alone, dropout drawn after `manual_seed(step)`."""
    for i, (m, o) in enumerate(zip(models, opts, strict=True)):
        rows = orders(step)[i]
        torch.manual_seed(step)
        o.zero_grad()
        F.cross_entropy(m(X[rows]), Y[rows], label_smoothing=SMOOTH[i]).backward()
        o.step()


def ens_step(step_fn: Any, step: int, n: int = N, smooth: list[float] = SMOOTH) -> Tensor:
    rows = orders(step, n)
    xs, ys = torch.stack([X[r] for r in rows]), torch.stack([Y[r] for r in rows])
    torch.manual_seed(step)
    return step_fn(xs, (ys, torch.tensor(smooth[:n], dtype=torch.float64)))


def finetune(factory: Any, build: str) -> tuple[Any, Any, list[nn.Module], list, nn.Module]:
    """The sweep, in the ensemble and alone. Returns (ens, opt, plain, plain opts, base)."""
    base = pretrained(factory)
    kept = copy.deepcopy(base.state_dict())
    if build == "from_modules":
        ens = vmapens.Ensemble.from_modules([base] * N, randomness="same")
    else:  # build, then load the base into every member
        ens = vmapens.Ensemble(factory, N, seed=7, randomness="same")
        ens.load_state_dict({k: v.expand(N, *v.shape) for k, v in base.state_dict().items()})
    opt = vmapens.StackedAdam(ens, lr=LRS, weight_decay=WDS, decoupled_weight_decay=True)
    step_fn = vmapens.make_step(ens, smoothed_ce, opt, in_dims=0)
    plain = [copy.deepcopy(base) for _ in range(N)]
    opts = [plain_opt(m, i) for i, m in enumerate(plain)]
    for s in range(STEPS):
        ens_step(step_fn, s)
        plain_step(plain, opts, s)
    for k, v in kept.items():  # the pretrained module is the user's: untouched
        torch.testing.assert_close(base.state_dict()[k], v, rtol=0, atol=0)
    return ens, opt, plain, opts, base


def assert_member_states(ens: Any, plain: list[nn.Module], **tol: Any) -> None:
    for i, m in enumerate(plain):
        got, want = ens.state_dicts()[i], m.state_dict()
        assert list(got) == list(want)
        for k in want:
            torch.testing.assert_close(got[k], want[k], **(tol or TOL), msg=f"member {i} {k}")


def accuracy(model: nn.Module, data: tuple[Tensor, Tensor] = VAL) -> int:
    """Correct answers of a plain module in eval mode (a count: compared exactly)."""
    mode = model.training
    model.eval()
    with torch.no_grad():
        hits = int((model(data[0]).argmax(-1) == data[1]).sum())
    model.train(mode)
    return hits


def average(states: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """The uniform soup of plain state dicts, a Python sum over the members; an integer
    buffer (BatchNorm's `num_batches_tracked`) is taken from the first."""
    out = {}
    for k, v in states[0].items():
        out[k] = v.clone() if not v.is_floating_point() else sum(s[k] for s in states) / len(states)
    return out


def soup_of(state: dict[str, Tensor], factory: Any) -> nn.Module:
    model = factory()
    model.load_state_dict(state)
    return model


def ranking(val_hits: list[int]) -> list[int]:
    """Members by validation accuracy, best first (ties: lower index first)."""
    return sorted(range(len(val_hits)), key=lambda i: (-val_hits[i], i))


def greedy_soup(candidates: list[dict[str, Tensor]], ranked: list[int], factory: Any) -> tuple:
    """Wortsman et al.'s greedy soup: members in the order `ranked` (best first); a member
    stays in the soup when the soup's validation accuracy does not drop."""
    kept = [ranked[0]]
    best = accuracy(soup_of(average([candidates[ranked[0]]]), factory))
    for i in ranked[1:]:
        hits = accuracy(soup_of(average([candidates[j] for j in kept + [i]]), factory))
        if hits >= best:
            kept, best = kept + [i], hits
    return kept, best


@pytest.fixture(scope="module")
def sweep() -> tuple:
    return finetune(ln_net, "from_modules")


def test_the_sweep_from_one_pretrained_module_is_each_member_fine_tuned_alone(sweep) -> None:
    ens, _, plain, _, _ = sweep
    assert_member_states(ens, plain)
    # the members really differ (the sweep is a sweep) and differ from the base
    w = ens.state_dict()["0.weight"]
    assert min((w[i] - w[j]).abs().max() for i in range(N) for j in range(i)) > 1e-4


def test_building_then_loading_the_base_expanded_over_the_members_is_the_same_sweep() -> None:
    ens, _, plain, _, _ = finetune(ln_net, "build-then-load")
    assert_member_states(ens, plain)


def test_uniform_soup_four_ways_is_the_plain_average(sweep, tmp_path: Path) -> None:
    ens, _, plain, _, _ = sweep
    truth = average([m.state_dict() for m in plain])
    stacked = {k: v.mean(0) for k, v in ens.state_dict().items()}
    listed = average(ens.state_dicts())
    unstacked = average([m.state_dict() for m in ens.unstack()])
    vmapens.save_members(ens, tmp_path / "members")
    from_files = average(vmapens.load_members(tmp_path / "members"))
    for got in (stacked, listed, unstacked, from_files):
        assert list(got) == list(truth)
        for k in truth:
            torch.testing.assert_close(got[k], truth[k], **TOL, msg=k)
    soup = soup_of(stacked, ln_net)
    assert accuracy(soup) == accuracy(soup_of(truth, ln_net))
    torch.testing.assert_close(soup.eval()(VAL[0]), soup_of(truth, ln_net).eval()(VAL[0]), **TOL)


def test_greedy_soup_ranked_by_predict_takes_the_plain_ingredients(sweep) -> None:
    ens, _, plain, _, _ = sweep
    mode = ens.training
    logits = vmapens.predict(ens, VAL[0])  # [n, samples, classes], eval mode
    assert ens.training == mode
    hits = (logits.argmax(-1) == VAL[1]).sum(-1).tolist()
    assert hits == [accuracy(m) for m in plain]
    got = greedy_soup(ens.state_dicts(), ranking(hits), ln_net)
    want = greedy_soup(
        [m.state_dict() for m in plain], ranking([accuracy(m) for m in plain]), ln_net
    )
    assert got == want
    # the same soup as rows of the stacked storage
    rows = got[0]
    soup = soup_of({k: v[rows].mean(0) for k, v in ens.state_dict().items()}, ln_net)
    assert accuracy(soup) == want[1]


def test_interpolation_between_two_members_evaluated_at_once(sweep, tmp_path: Path) -> None:
    ens, _, plain, _, _ = sweep
    a, b = 0, 4
    sd = ens.state_dict()
    w = torch.tensor(ALPHAS, dtype=torch.float64)
    path = {k: torch.lerp(v[a], v[b], w.view(-1, *[1] * (v.dim() - 1))) for k, v in sd.items()}
    # a 5-member ensemble to hold the path: member a repeated, then the path loaded
    line = ens.select([a] * len(ALPHAS))
    line.load_state_dict(path)
    curve = (vmapens.predict(line, VAL[0]).argmax(-1) == VAL[1]).sum(-1).tolist()
    truth = []
    for alpha in ALPHAS:
        sa, sb = plain[a].state_dict(), plain[b].state_dict()
        truth.append(
            accuracy(soup_of({k: (1 - alpha) * sa[k] + alpha * sb[k] for k in sa}, ln_net))
        )
    assert curve == truth
    assert curve[0] == accuracy(plain[a]) and curve[-1] == accuracy(plain[b])
    # loading into the copy left the sweep's members as they were
    assert_member_states(ens, plain)
    # the path's members share member a's id: member files would overwrite each other, so
    # save_members refuses; restacked, they are 5 members of their own
    with pytest.raises(
        ValueError, match=r"save_members: `ens` holds member\(s\) \[0\] more than once"
    ):
        vmapens.save_members(line, tmp_path / "path")
    vmapens.save_members(vmapens.Ensemble.from_modules(line.unstack()), tmp_path / "path")
    for got, want in zip(vmapens.load_members(tmp_path / "path"), line.state_dicts(), strict=True):
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)


def test_batchnorm_soups_averaged_or_recomputed_statistics() -> None:
    ens, _, plain, _, _ = finetune(bn_net, "from_modules")
    assert_member_states(ens, plain)
    # uniform soup with averaged running statistics
    truth = average([m.state_dict() for m in plain])
    sd = ens.state_dict()
    stacked = {k: v.mean(0) if v.is_floating_point() else v[0].clone() for k, v in sd.items()}
    for k in truth:
        torch.testing.assert_close(stacked[k], truth[k], **TOL, msg=k)
    # interpolation curve with statistics recomputed on the training data (as REPAIR-less
    # soups do): torch's update_bn on every plain interpolant vs vmapens's on the ensemble
    a, b = 1, 3
    w = torch.tensor(ALPHAS, dtype=torch.float64)
    path = {
        k: torch.lerp(v[a], v[b], w.view(-1, *[1] * (v.dim() - 1)))
        if v.is_floating_point()
        else v[a].expand(len(ALPHAS)).clone()
        for k, v in sd.items()
    }
    line = vmapens.Ensemble.from_modules([bn_net() for _ in ALPHAS])
    line.load_state_dict(path)
    loader = [TRAIN[0][k : k + 32] for k in range(0, 96, 32)]
    vmapens.swa.update_bn(loader, line)
    alone = []
    for alpha in ALPHAS:
        sa, sb = plain[a].state_dict(), plain[b].state_dict()
        mixed = {k: (1 - alpha) * sa[k] + alpha * sb[k] if sa[k].is_floating_point() else sa[k]
                 for k in sa}  # fmt: skip
        model = soup_of(mixed, bn_net)
        torch_update_bn(loader, model)
        alone.append(model)
    assert_member_states(line, alone)
    curve = (vmapens.predict(line, VAL[0]).argmax(-1) == VAL[1]).sum(-1).tolist()
    assert curve == [accuracy(m) for m in alone]


def _continue(ens: Any, opt: Any, plain: list[nn.Module], opts: list, lrs: list, wds: list,
              smooth: list[float]) -> None:  # fmt: skip
    step_fn = vmapens.make_step(ens, smoothed_ce, opt, in_dims=0)
    for s in range(STEPS, STEPS + 3):
        ens_step(step_fn, s, len(plain), smooth)
        for i, (m, o) in enumerate(zip(plain, opts, strict=True)):
            rows = orders(s, len(plain))[i]
            torch.manual_seed(s)
            o.zero_grad()
            F.cross_entropy(m(X[rows]), Y[rows], label_smoothing=smooth[i]).backward()
            o.step()


def branch(sweep: tuple, rows: list[int]) -> tuple:
    """Members `rows` of the sweep with their optimizer state (`select`), and their plain
    twins, each with its own optimizer loaded from a deep copy of the member's state dict
    (torch's load_state_dict keeps the tensors it is given: optimizers loaded from one state
    dict would share their moments)."""
    ens, opt, plain, opts, _ = sweep
    sub = ens.select(rows)
    twins = [copy.deepcopy(plain[j]) for j in rows]
    twin_opts = []
    for m, j in zip(twins, rows, strict=True):
        o = plain_opt(m, j)
        o.load_state_dict(copy.deepcopy(opts[j].state_dict()))
        twin_opts.append(o)
    return sub, opt.select(rows, sub), twins, twin_opts


def test_the_soup_written_into_row_i_trains_on_as_a_fresh_member(sweep) -> None:
    ens, opt, plain, opts = branch(sweep, list(range(N)))
    soup_state = {k: v.mean(0) for k, v in ens.state_dict().items()}
    i = 2
    # docs/semantics.md "Container operations": copy into the storage's row, zero the row's
    # optimizer state (moments and step) so the next step is its first
    with torch.no_grad():
        sd = ens.state_dict()
        for k, v in soup_state.items():
            sd[k][i].copy_(v)
        for p in ens.parameters():
            for t in opt.state[p].values():
                t[i] = 0
    plain[i] = soup_of(average([m.state_dict() for m in plain]), ln_net)
    opts[i] = plain_opt(plain[i], i)
    assert_member_states(ens, plain)
    _continue(ens, opt, plain, opts, LRS, WDS, SMOOTH)
    assert_member_states(ens, plain)


def test_the_soup_added_as_a_sixth_member_with_the_optimizer_state_extended(sweep) -> None:
    ens, opt, plain, opts = branch(sweep, list(range(N)))
    soup = soup_of({k: v.mean(0) for k, v in ens.state_dict().items()}, ln_net)
    grown = vmapens.Ensemble.from_modules(ens.unstack() + [soup], randomness="same")
    lrs, wds, smooth = LRS + [5e-3], WDS + [1e-2], SMOOTH + [0.1]
    new_opt = vmapens.StackedAdam(grown, lr=lrs, weight_decay=wds, decoupled_weight_decay=True)
    # docs/semantics.md: load the old optimizer's state dict with each state tensor extended
    # by a zero row and each per-member hyperparameter list extended
    old = opt.state_dict()
    old["state"] = {
        k: {name: torch.cat([t, torch.zeros_like(t[:1])]) for name, t in s.items()}
        for k, s in old["state"].items()
    }
    for group in old["param_groups"]:
        group["lr"], group["weight_decay"] = list(lrs), list(wds)
    new_opt.load_state_dict(old)
    plain = plain + [copy.deepcopy(soup)]
    opts = opts + [torch.optim.AdamW(plain[-1].parameters(), lr=lrs[-1], weight_decay=wds[-1])]
    _continue(grown, new_opt, plain, opts, lrs, wds, smooth)
    assert_member_states(grown, plain)


def test_greedy_soup_ranked_by_fit_histories_best_accuracy_with_batchnorm() -> None:
    """`fit` with the sweep's lr and weight decay, validation accuracy, best-epoch restore:
    `member_scores` ranks the members for the greedy soup as the plain loop's best epochs."""
    base = pretrained(bn_net)
    ens = vmapens.Ensemble.from_modules([base] * N)

    def acc(out: Tensor, target: Tensor) -> Tensor:
        return (out.argmax(-1) == target).double().mean()

    history = vmapens.fit(ens, TRAIN, nn.CrossEntropyLoss(label_smoothing=0.1), epochs=4,
                          batch_size=32, lr=LRS, weight_decay=WDS, decoupled_weight_decay=True,
                          val_data=VAL, metrics={"acc": acc}, seed=3, progress=False,
                          callbacks=[EarlyStopping("val_acc", "max")])  # fmt: skip
    scores = vmapens.selection.member_scores(history, "val_acc", "max")
    # the naive loop: docs/fit.md's shuffle formula, each epoch's accuracy, the best restored
    plan = batch_plan(96, 32, 12, seed=3)
    plain, best_hits = [], []
    for i in range(N):
        m = copy.deepcopy(base)
        o = plain_opt(m, i)
        best, best_state = -1, None
        for epoch in range(4):
            for rows in plan[epoch * 3 : (epoch + 1) * 3]:
                o.zero_grad()
                F.cross_entropy(m(X[rows]), Y[rows], label_smoothing=0.1).backward()
                o.step()
            hits = accuracy(m)
            if hits > best:
                best, best_state = hits, copy.deepcopy(m.state_dict())
        m.load_state_dict(best_state)
        plain.append(m)
        best_hits.append(best)
    assert_member_states(ens, plain)
    assert (scores * len(VAL[1])).round().long().tolist() == best_hits
    # best_k with all members ranks them best first, ties to the lower row (its docstring)
    ranked = vmapens.selection.best_k(ens, history, N, metric="acc", mode="max")
    assert list(ranked.member_ids) == ranking(best_hits)
    got = greedy_soup(ens.state_dicts(), list(ranked.member_ids), bn_net)
    assert got == greedy_soup([m.state_dict() for m in plain], ranking(best_hits), bn_net)


def test_the_greedy_ingredients_selected_with_their_optimizer_train_on_alone(sweep) -> None:
    ens = sweep[0]
    rows = [3, 3, 0]  # member 3 twice (two continuations of one ingredient) and member 0
    sub, sub_opt, twins, twin_opts = branch(sweep, rows)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    _continue(sub, sub_opt, twins, twin_opts, LRS, WDS, [SMOOTH[j] for j in rows])
    assert_member_states(sub, twins)
    for k, v in ens.state_dict().items():  # the sweep's ensemble is untouched
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


def test_assigning_or_loading_one_soup_into_the_ensemble_is_refused_with_the_way_out(sweep) -> None:
    ens = sweep[0]
    soup = soup_of({k: v.mean(0) for k, v in ens.state_dict().items()}, ln_net)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    with pytest.raises(TypeError, match=r"ens\[1\] = module.*sd\[k\]\[i\]\.copy_\(v\)"):
        ens[1] = soup
    with pytest.raises(RuntimeError, match="one member's state dict.*Ensemble.from_modules"):
        ens.load_state_dict(soup.state_dict())
    for k, v in ens.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
