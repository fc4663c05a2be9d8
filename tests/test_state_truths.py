"""Per-member state against plain PyTorch: masks, per-member hyperparameters, exploit_ and PBT.

Every truth here is N plain modules, each with its own torch optimizer (Lion: the reference
written from the paper, from test_optim_family's table), stepped, copied and restored by hand
the way a user would without vmapens:

* masks: a member whose mask is False comes out bit-identical (parameters, BatchNorm
  statistics, every optimizer state tensor, its step count); its twin simply does not run.
* per-member hyperparameters: member i equals a torch optimizer built with member i's values,
  for the table's values and for a permutation of them (a broadcast of one member's value, or
  values applied to the wrong rows, cannot pass both).
* ``exploit_``: member ``dst`` continues exactly as a twin that loaded ``src``'s module and
  optimizer state dicts (which carry the step count and the hyperparameters).
* ``PBT`` and ``Context.inherit``: a plain loop that validates, keeps each member's best
  state dict, copies the worst member from the best one (its best snapshot, best score and
  patience count too) and restores the best state dicts at the end.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import models
import pytest
import torch
from test_optim_family import SPECS, Spec, member_kwargs
from test_workflows import BATCHES, LRS, XV, YV, X, Y, build, plain
from torch import nn
from truth import TOL64, assert_members_equal, train_alone, twins

import vmapens

N = 4
F64 = dict(dtype=torch.float64)
#: A permutation of the members with no fixed point: every member gets another's values.
PERM = [2, 0, 3, 1]


def permuted(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with every per-member list reordered by ``PERM`` (betas: both lists)."""

    def perm(v: Any) -> Any:
        return [v[p] for p in PERM] if isinstance(v, list) else v

    return {k: tuple(map(perm, v)) if k == "betas" else perm(v) for k, v in kwargs.items()}


def as_tensors(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with every per-member list given as a 1-D float64 tensor instead."""

    def tensor(v: Any) -> Any:
        return torch.tensor(v, **F64) if isinstance(v, list) else v

    return {k: tuple(map(tensor, v)) if k == "betas" else tensor(v) for k, v in kwargs.items()}


#: Per optimizer: hyperparameters shared (torch's fused kernels), per member as lists, and per
#: member permuted and given as tensors. The twins always get member i's floats.
CONFIGS = {
    f"{name}-{how}": (spec, kwargs, tensors)
    for name, spec in SPECS.items()
    for how, kwargs, tensors in (
        ("shared", spec.shared, False),
        ("per_member", spec.per, False),
        ("per_member_permuted_tensors", permuted(spec.per), True),
    )
}
BY_CONFIG = pytest.mark.parametrize(
    ("spec", "kwargs", "tensors"), list(CONFIGS.values()), ids=list(CONFIGS)
)


def batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + t)
    return torch.randn(6, 1, 6, 6, generator=g, **F64), torch.randn(6, 3, generator=g, **F64)


class Pair:
    """A CNN ensemble (BatchNorm buffers) and its N plain twins, each with a torch optimizer."""

    def __init__(self, spec: Spec, kwargs: dict[str, Any], tensors: bool = False) -> None:
        torch.manual_seed(0)
        self.twins = [models.CNN().double() for _ in range(N)]
        self.ens = vmapens.Ensemble.from_modules(twins(self.twins))
        self.opt = spec.cls(self.ens, **(as_tensors(kwargs) if tensors else kwargs))
        self.step = vmapens.make_step(self.ens, nn.MSELoss(), self.opt)
        self.twin_opts = [
            spec.twin(m.parameters(), **member_kwargs(kwargs, i)) for i, m in enumerate(self.twins)
        ]

    def run(self, t: int, mask: list[int] | None = None) -> None:
        """Step t: the ensemble with `mask`; twin i trains on the batch only where it is set."""
        x, y = batch(t)
        self.step(x, y, None if mask is None else torch.tensor(mask, dtype=torch.bool))
        for i, (m, opt) in enumerate(zip(self.twins, self.twin_opts, strict=True)):
            if mask is None or mask[i]:
                train_alone(m, [(x, y)], nn.functional.mse_loss, opt)

    def member(self, i: int) -> dict[str, torch.Tensor]:
        """Member i's row of every stacked tensor: parameters, buffers, optimizer state (which
        torch's optimizers, and these, create at the first step)."""
        rows = {k: t[i].clone() for k, t in self.ens.stacked_state().items()}
        for name, p in self.ens.stacked_params().items():
            rows.update({f"{name}.{k}": v[i].clone() for k, v in self.opt.state[p].items()})
        return rows

    def assert_matches(self) -> None:
        """Every member equals its twin: parameters and buffers, then each optimizer state
        tensor the twin keeps (step counts included), read from the stacked state by name."""
        assert_members_equal(self.ens, self.twins, **TOL64)
        stacked = self.ens.stacked_params()
        for i, (m, opt) in enumerate(zip(self.twins, self.twin_opts, strict=True)):
            for name, p in m.named_parameters():
                ours = self.opt.state[stacked[name]]
                for key, value in opt.state[p].items():
                    if value is None:  # torch's SGD without momentum keeps a None buffer
                        continue
                    got = ours[key][i]
                    torch.testing.assert_close(
                        got, value.to(got.dtype), **TOL64, msg=f"member {i} {name} {key}"
                    )


def load_twin(dst: tuple[nn.Module, torch.optim.Optimizer], module: dict, opt: dict) -> None:
    """A plain copy: the source's module and optimizer state dicts loaded into the twin.

    torch's load_state_dict casts counters other than `step` (NAdam's mu_product) to the
    parameter's dtype; a copy continues as its source would, so they get their dtype back.
    """
    m, o = dst
    m.load_state_dict(module)
    o.load_state_dict(copy.deepcopy(opt))
    for k, p in enumerate(m.parameters()):
        for key, v in o.state[p].items():
            old = opt["state"].get(k, {}).get(key)
            if isinstance(v, torch.Tensor) and isinstance(old, torch.Tensor):
                o.state[p][key] = v.to(old.dtype)


# -- masks ------------------------------------------------------------------------------------

# The first step is masked: member 1 takes its first step (SGD starts its momentum buffer)
# after the others took theirs.
MASKS = [[1, 0, 1, 1], [0, 1, 0, 1], None, [1, 1, 1, 0]]


@BY_CONFIG
def test_masked_members_are_bit_identical_and_the_others_equal_their_twins(spec, kwargs, tensors):
    pair = Pair(spec, kwargs, tensors)
    for t, mask in enumerate(MASKS):
        before = [pair.member(i) for i in range(N)] if mask is not None else []
        pair.run(t, mask)
        for i in [i for i in range(N) if mask is not None and not mask[i]]:
            after = pair.member(i)
            for key, old in before[i].items():
                assert torch.equal(old, after[key]), f"masked member {i} changed {key} at {t}"
            for key in after.keys() - before[i].keys():  # created by this step: not counted
                assert not key.endswith(".step") or after[key] == 0, (i, key)
    pair.assert_matches()


# -- exploit_ -----------------------------------------------------------------------------------


@BY_CONFIG
def test_exploit_continues_as_a_twin_that_loaded_the_source(spec, kwargs, tensors):
    pair = Pair(spec, kwargs, tensors)
    for t, mask in enumerate(MASKS[:3]):  # step counts now differ: [2, 2, 2, 3]
        pair.run(t, mask)
    src, dst = [1, 3, 2], [0, 1, 3]  # 1 is read (by 0) before it is written (from 3)
    saved = [
        (copy.deepcopy(pair.twins[s].state_dict()), copy.deepcopy(pair.twin_opts[s].state_dict()))
        for s in src
    ]
    vmapens.pbt.exploit_(pair.ens, pair.opt, src, dst)
    for d, (module, opt) in zip(dst, saved, strict=True):
        load_twin((pair.twins[d], pair.twin_opts[d]), module, opt)
    pair.assert_matches()
    for t in range(3, 6):
        pair.run(t)
    pair.assert_matches()


# -- PBT and Context.inherit ---------------------------------------------------------------------


EPOCHS, INTERVAL, FACTOR = 4, 2, 2.0


def plain_loop(patience: int | None, inherit: tuple[int, int, int] | None = None) -> dict[str, Any]:
    """fit by hand: plain MLPs and torch.optim.Adam, validated and early-stopped per member.

    PBT rounds (``inherit_at`` None) at epochs 1 and 3: with 4 members and fraction 0.25,
    one member is copied per round: the worst by validation loss takes the best one's module,
    optimizer state (hyperparameters included) and fit's bookkeeping (best state dict, best
    loss, best epoch, epochs without improvement), then its learning rate is multiplied by
    FACTOR. With ``inherit=(epoch, src, dst)``, member dst takes member src's bookkeeping
    alone at that epoch and keeps its own weights. The best state dicts are restored at the end.
    """
    members, opts = plain()
    best_val, best_epoch, bad = [float("inf")] * N, [-1] * N, [0] * N
    best_state = [copy.deepcopy(m.state_dict()) for m in members]
    stopped, rounds = [-1] * N, []
    for epoch in range(EPOCHS):
        live = [i for i in range(N) if stopped[i] < 0]
        for i in live:
            train_alone(members[i], BATCHES, nn.functional.cross_entropy, opts[i])
        val = [float("nan")] * N
        for i in live:
            with torch.no_grad():
                val[i] = float(nn.functional.cross_entropy(members[i](XV), YV))
            if val[i] < best_val[i]:
                best_val[i], best_epoch[i], bad[i] = val[i], epoch, 0
                best_state[i] = copy.deepcopy(members[i].state_dict())
            else:
                bad[i] += 1
                if patience is not None and bad[i] >= patience:
                    stopped[i] = epoch
        if inherit is None:
            if (epoch + 1) % INTERVAL:
                continue
            ranked = sorted((i for i in range(N) if stopped[i] < 0), key=lambda i: val[i])
            if len(ranked) < 2:  # one member per end at least: nothing to copy
                continue
            src, dst = ranked[0], ranked[-1]
            rounds.append((epoch, [src], [dst]))
            module, opt = members[src].state_dict(), opts[src].state_dict()
            load_twin((members[dst], opts[dst]), copy.deepcopy(module), opt)
            for group in opts[dst].param_groups:
                group["lr"] *= FACTOR
        elif epoch == inherit[0]:
            src, dst = inherit[1:]
        else:
            continue
        best_state[dst] = copy.deepcopy(best_state[src])
        best_val[dst], best_epoch[dst], bad[dst] = best_val[src], best_epoch[src], bad[src]
    for i, m in enumerate(members):
        if best_epoch[i] >= 0:
            m.load_state_dict(best_state[i])
    lrs = [o.param_groups[0]["lr"] for o in opts]
    return dict(members=members, best=best_epoch, stopped=stopped, rounds=rounds, lrs=lrs)


@pytest.mark.parametrize("patience", [None, 2], ids=["no-patience", "patience-2"])
def test_pbt_and_inherit_match_a_plain_loop_with_copied_modules(patience):
    naive = plain_loop(patience)
    ens = build()
    opt = vmapens.StackedAdam(ens, lr=LRS)
    pbt = vmapens.pbt.PBT(INTERVAL, fraction=0.25, factors=(FACTOR,), seed=0)
    h = vmapens.fit(ens, (X, Y), nn.CrossEntropyLoss(), epochs=EPOCHS, batch_size=8,
                    shuffle=False, optimizer=opt, val_data=(XV, YV), patience=patience,
                    progress=False, callbacks=[pbt])  # fmt: skip
    assert pbt.log == naive["rounds"]
    # The case must exercise the inheritance: the last round is at the last epoch, so its
    # copy ends restored to the source's best snapshot (not to its own best one).
    (epoch, [src], [dst]) = pbt.log[-1]
    assert epoch == EPOCHS - 1
    restored = [naive["members"][i].state_dict() for i in (src, dst)]
    assert all(torch.equal(v, restored[1][k]) for k, v in restored[0].items())
    assert h.best_epoch.tolist() == naive["best"]
    assert h.stopped_epoch.tolist() == naive["stopped"]
    assert opt.param_groups[0]["lr"].tolist() == naive["lrs"]
    assert_members_equal(ens, naive["members"], **TOL64)


class Handover(vmapens.Callback):
    """Member dst takes over member src's best-so-far bookkeeping at one epoch, weights
    untouched."""

    def __init__(self, at: int, src: int, dst: int) -> None:
        self.at, self.src, self.dst = at, src, dst

    def on_epoch_end(self, ctx: vmapens.callbacks.Context) -> None:
        if ctx.epoch == self.at:
            ctx.inherit([self.src], [self.dst])


@pytest.mark.parametrize("patience", [None, 2], ids=["no-patience", "patience-2"])
@pytest.mark.parametrize("at", [0, EPOCHS - 1], ids=["first-epoch", "last-epoch"])
# 2 -> 0: the slow member 0 keeps improving on its own best but not on member 2's;
# 2 -> 3: member 3 (the largest lr) stops improving; with patience it stops early.
@pytest.mark.parametrize("src,dst", [(2, 0), (2, 3)], ids=["2-to-0", "2-to-3"])
def test_inherit_alone_hands_over_best_score_snapshot_and_patience(patience, at, src, dst):
    naive = plain_loop(patience, inherit=(at, src, dst))
    ens = build()
    h = vmapens.fit(ens, (X, Y), nn.CrossEntropyLoss(), epochs=EPOCHS, batch_size=8,
                    shuffle=False, optimizer=vmapens.StackedAdam(ens, lr=LRS), val_data=(XV, YV),
                    patience=patience, progress=False, callbacks=[Handover(at, src, dst)])  # fmt: skip
    assert h.best_epoch.tolist() == naive["best"]
    assert h.stopped_epoch.tolist() == naive["stopped"]
    assert_members_equal(ens, naive["members"], **TOL64)


class _Rows(vmapens.Callback):
    """Each epoch's stacked state, recorded before PBT's round (it is listed first)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, torch.Tensor]] = []

    def on_epoch_end(self, ctx: Any) -> None:
        self.rows.append({k: v.detach().clone() for k, v in ctx.ensemble.stacked_state().items()})


def test_pbt_copies_under_fp16_continue_as_their_source():
    # factors=(1.0,): nothing is perturbed, so a copied member must then train exactly as its
    # source, which needs the source's loss scale and growth count too (fp16).
    torch.manual_seed(0)
    x, y = torch.randn(32, 4) * 30, torch.randn(32, 1) * 30
    ens = vmapens.Ensemble(lambda: nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1)),
                           4, seed=0)  # fmt: skip
    pbt = vmapens.pbt.PBT(interval=1, fraction=0.5, factors=(1.0,), monitor="train_loss", seed=0)
    rows = _Rows()
    scale = vmapens.LossScale(4, init_scale=2.0**10, growth_interval=2)
    run = dict(epochs=4, batch_size=8, shuffle=False, progress=False, seed=0, patience=None)
    run.update(precision="fp16", loss_scale=scale, callbacks=[rows, pbt])
    lrs = [1e-5, 3e-4, 1e-3, 3e-3]
    vmapens.fit(ens, (x, y), nn.MSELoss(), optimizer=vmapens.StackedSGD, lr=lrs, **run)
    copies = [(e, s, d) for e, src, dst in pbt.log[:-1] for s, d in zip(src, dst, strict=True)]
    assert copies
    for epoch, s, d in copies:
        for name, v in rows.rows[epoch + 1].items():
            assert torch.equal(v[s], v[d]), (epoch, s, d, name)


@pytest.mark.parametrize("recomputes", [True, False], ids=["LambdaLR", "StepLR"])
def test_pbt_warns_when_a_scheduler_would_undo_its_learning_rates(recomputes):
    # LambdaLR sets lr = base_lr * f(epoch) at every step: a copied or perturbed lr is undone.
    torch.manual_seed(0)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    ens = vmapens.Ensemble(lambda: nn.Linear(4, 1), 4, seed=0)
    opt = vmapens.StackedAdam(ens, lr=[1e-3, 1e-2, 3e-2, 1e-1])
    scheduler = (torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1 / (1 + e)) if recomputes
                 else torch.optim.lr_scheduler.StepLR(opt, 1, 0.5))  # fmt: skip
    pbt = vmapens.pbt.PBT(interval=1, monitor="train_loss", seed=0)
    run = dict(epochs=2, optimizer=opt, scheduler=scheduler, callbacks=[pbt], progress=False)
    with (
        contextlib.nullcontext() if not recomputes else pytest.warns(UserWarning, match="LambdaLR")
    ):
        vmapens.fit(ens, (x, y), nn.MSELoss(), **run)
    assert pbt.log
