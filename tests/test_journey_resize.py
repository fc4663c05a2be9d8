"""User journey: changing the ensemble while it trains, as RL and evolutionary users do.

Six tiny float64 MLPs trained with ``StackedAdam`` (one lr per member); members 2 and 4 reset in
place (docs/semantics.md, "Container operations": ``ens[i] = module`` is refused, copy the
fresh module's values into ``ens.state_dict()``'s rows; their Adam state zeroed, as a fresh
``torch.optim.Adam`` starts); the best 3 kept with ``ens.select`` / ``opt.select``; two fresh
members added (no ``cat`` is documented: ``Ensemble.from_modules`` over ``unstack()`` plus the
new modules, the optimizer state carried over through ``load_state_dict``); unstacked to plain
modules trained alone with ``member_state_dict``, stacked back. Also indexing with a tensor, a
negative int, a bool mask and a numpy int, ``copy.deepcopy``, and ``torch.save``/``torch.load`` of
the whole objects mid-run. The truth at every stage: plain modules, each with its own
``torch.optim.Adam``, reset/kept/created as the user did to the ensemble.
"""

from __future__ import annotations

import copy
import io

import numpy as np
import pytest
import torch
from torch import Tensor, nn

import vmapens
from tests.truth import TOL64, assert_members_equal, derived_seed, float64_batches

N, D_IN, HIDDEN, D_OUT = 6, 3, 5, 2
LRS = [1e-3 * 2**i for i in range(N)]
mse = nn.functional.mse_loss


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, D_OUT)).double()


def fresh(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return mlp()


class Plain:
    """The naive loop: one plain module and one ``torch.optim.Adam`` per member."""

    def __init__(self, models: list[nn.Module], lrs: list[float]) -> None:
        self.models = models
        self.lrs = list(lrs)
        self.opts = [torch.optim.Adam(m.parameters(), lr=lr) for m, lr in zip(models, lrs)]

    def step(self, x: Tensor, y: Tensor) -> Tensor:
        losses = []
        for m, o in zip(self.models, self.opts, strict=True):
            o.zero_grad()
            loss = mse(m(x), y)
            loss.backward()
            o.step()
            losses.append(loss.detach())
        return torch.stack(losses)

    def reset(self, i: int, module: nn.Module) -> None:
        self.models[i].load_state_dict(module.state_dict())
        self.opts[i] = torch.optim.Adam(self.models[i].parameters(), lr=self.lrs[i])

    def keep(self, rows: list[int]) -> None:
        self.models = [self.models[r] for r in rows]
        self.opts = [self.opts[r] for r in rows]
        self.lrs = [self.lrs[r] for r in rows]

    def add(self, module: nn.Module, lr: float) -> None:
        self.models.append(module)
        self.lrs.append(lr)
        self.opts.append(torch.optim.Adam(module.parameters(), lr=lr))


def ens_step(ens: vmapens.Ensemble, opt: torch.optim.Optimizer, x: Tensor, y: Tensor) -> Tensor:
    """The README's loop: per-member losses, their sum back-propagated, one stacked step."""
    loss = vmapens.per_member(mse)(ens(x), y)
    opt.zero_grad()
    loss.sum().backward()
    opt.step()
    return loss.detach()


def start() -> tuple[vmapens.Ensemble, vmapens.StackedAdam, Plain]:
    ens = vmapens.Ensemble(mlp, n=N, seed=0)
    opt = vmapens.StackedAdam(ens, lr=LRS)
    plain = Plain([fresh(derived_seed(0, "member", i)) for i in range(N)], LRS)
    assert_members_equal(ens, plain.models, rtol=0, atol=0)
    return ens, opt, plain


def _plain_twin(plain: Plain) -> Plain:
    twin = Plain([], [])
    twin.models, twin.opts = copy.deepcopy((plain.models, plain.opts))
    twin.lrs = list(plain.lrs)
    return twin


def train_both(ens, opt, plain, batches) -> Tensor:
    for x, y in batches:
        got = ens_step(ens, opt, x, y)
        want = plain.step(x, y)
        torch.testing.assert_close(got, want, **TOL64)
    assert_members_equal(ens, plain.models)
    return got


def reset_member_(ens: vmapens.Ensemble, opt: vmapens.StackedAdam, i: int, module: nn.Module):
    """docs/semantics.md's recipe for ``ens[i] = module``, and a fresh Adam state for row i."""
    sd = ens.state_dict()
    with torch.no_grad():
        for k, v in module.state_dict().items():
            sd[k][i].copy_(v)
        for p in ens.parameters():
            for value in opt.state[p].values():
                value[i].zero_()  # exp_avg, exp_avg_sq and the member's `step` count


# ---------------------------------------------------------------------------------------------


def test_reset_members_in_place_then_continue() -> None:
    ens, opt, plain = start()
    batches = float64_batches(8, 7, D_IN, D_OUT, seed=1)
    train_both(ens, opt, plain, batches[:3])
    with pytest.raises(TypeError, match="copy"):
        ens[2] = fresh(100)
    for i in (2, 4):
        new = fresh(100 + i)
        reset_member_(ens, opt, i, new)
        plain.reset(i, new)
    assert opt.state[ens.get_parameter("0.weight")]["step"].tolist() == [3, 3, 0, 3, 0, 3]
    train_both(ens, opt, plain, batches[3:])


def test_keep_best_three_with_their_optimizer_state() -> None:
    ens, opt, plain = start()
    batches = float64_batches(7, 7, D_IN, D_OUT, seed=2)
    losses = train_both(ens, opt, plain, batches[:4])
    rows = torch.argsort(losses)[:3].tolist()
    sub = ens.select(rows)
    sub_opt = opt.select(rows, sub)
    plain.keep(rows)
    assert list(sub_opt.param_groups[0]["lr"]) == plain.lrs
    train_both(sub, sub_opt, plain, batches[4:])


def test_best_k_with_scores_and_optimizer() -> None:
    ens, opt, plain = start()
    batches = float64_batches(6, 7, D_IN, D_OUT, seed=3)
    losses = train_both(ens, opt, plain, batches[:3])
    top, top_opt = vmapens.selection.best_k(ens, losses, 3, optimizer=opt)
    rows = torch.argsort(losses)[:3].tolist()
    assert list(top.member_ids) == rows
    plain.keep(rows)
    train_both(top, top_opt, plain, batches[3:])


def grow(ens, opt, new: list[nn.Module], new_lrs: list[float]):
    """No ``cat`` is documented: stack the members and the new modules with ``from_modules``,
    and give the new optimizer the old rows' state plus a fresh (zero) state for the new rows
    through ``load_state_dict`` (a list of n values for a per-member hyperparameter)."""
    big = vmapens.Ensemble.from_modules(ens.unstack() + new)
    old = opt.state_dict()
    k = len(new)
    state = {}
    for pid, st in old["state"].items():
        state[pid] = {
            name: torch.cat([v, torch.zeros((k, *v.shape[1:]), dtype=v.dtype)])
            for name, v in st.items()
        }
    groups = [{**g, "lr": [*g["lr"], *new_lrs]} for g in old["param_groups"]]
    big_opt = vmapens.StackedAdam(big, lr=list(opt.param_groups[0]["lr"]) + new_lrs)
    big_opt.load_state_dict({"state": state, "param_groups": groups})
    return big, big_opt


def test_grow_by_concatenating_fresh_members() -> None:
    ens, opt, plain = start()
    batches = float64_batches(7, 7, D_IN, D_OUT, seed=4)
    train_both(ens, opt, plain, batches[:3])
    new = [fresh(200), fresh(201)]
    new_lrs = [3e-3, 5e-2]
    big, big_opt = grow(ens, opt, [copy.deepcopy(m) for m in new], new_lrs)
    for m, lr in zip(new, new_lrs, strict=True):
        plain.add(m, lr)
    assert len(big) == N + 2
    train_both(big, big_opt, plain, batches[3:])


def unstack_train_restack(ens, opt, plain: Plain, batches):
    """Members handed to plain torch (``unstack`` + ``member_state_dict``), trained alone
    beside the truth, then stacked back with ``from_modules`` and their torch states stacked row
    by row into the new stacked optimizer's state dict."""
    models, lrs = ens.unstack(), list(opt.param_groups[0]["lr"])
    alone = []
    for i, m in enumerate(models):
        o = torch.optim.Adam(m.parameters(), lr=lrs[i])
        o.load_state_dict(opt.member_state_dict(i, module=m))
        alone.append(o)
    for x, y in batches:
        plain.step(x, y)
        for m, o in zip(models, alone, strict=True):
            o.zero_grad()
            mse(m(x), y).backward()
            o.step()
    for m, p in zip(models, plain.models, strict=True):
        torch.testing.assert_close(m.state_dict(), p.state_dict(), **TOL64)
    back = vmapens.Ensemble.from_modules(models)
    back_opt = vmapens.StackedAdam(back, lr=lrs)
    sds = [o.state_dict() for o in alone]
    state = {
        pid: {name: torch.stack([sd["state"][pid][name] for sd in sds]) for name in st}
        for pid, st in sds[0]["state"].items()
    }
    groups = [{**back_opt.state_dict()["param_groups"][0], "lr": lrs}]
    back_opt.load_state_dict({"state": state, "param_groups": groups})
    return back, back_opt


def test_unstack_train_alone_stack_back() -> None:
    ens, opt, plain = start()
    batches = float64_batches(9, 7, D_IN, D_OUT, seed=5)
    train_both(ens, opt, plain, batches[:3])
    back, back_opt = unstack_train_restack(ens, opt, plain, batches[3:6])
    train_both(back, back_opt, plain, batches[6:])


def test_whole_journey_reset_keep_grow_restack_save() -> None:
    """The stages one after another on one run: step counts that differ per member (the reset
    ones) go through ``opt.select``, the grown optimizer, the hand-off and ``torch.save``."""
    ens, opt, plain = start()
    batches = float64_batches(14, 7, D_IN, D_OUT, seed=12)
    train_both(ens, opt, plain, batches[:2])
    for i in (2, 4):
        new = fresh(400 + i)
        reset_member_(ens, opt, i, new)
        plain.reset(i, new)
    losses = train_both(ens, opt, plain, batches[2:4])
    best = [r for r in torch.argsort(losses).tolist() if r != 2]
    rows = [2, *best[:2]]  # a reset member kept, and the best two others
    sub = ens.select(rows)
    sub_opt = opt.select(rows, sub)
    plain.keep(rows)
    train_both(sub, sub_opt, plain, batches[4:6])
    new = [fresh(500), fresh(501)]
    big, big_opt = grow(sub, sub_opt, [copy.deepcopy(m) for m in new], [2e-2, 4e-3])
    for m, lr in zip(new, [2e-2, 4e-3], strict=True):
        plain.add(m, lr)
    train_both(big, big_opt, plain, batches[6:8])
    back, back_opt = unstack_train_restack(big, big_opt, plain, batches[8:10])
    train_both(back, back_opt, plain, batches[10:11])
    buf = io.BytesIO()
    torch.save({"ens": back, "opt": back_opt}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    train_both(loaded["ens"], loaded["opt"], plain, batches[11:])


def test_reset_by_loading_a_state_dict_under_make_step() -> None:
    """The other reset a user writes: a full state dict with rows 2 and 4 replaced, through
    ``ens.load_state_dict``, between steps of a ``make_step`` built before it."""
    ens, opt, plain = start()
    batches = float64_batches(7, 7, D_IN, D_OUT, seed=6)
    step = vmapens.make_step(ens, mse, opt)
    for x, y in batches[:3]:
        torch.testing.assert_close(step(x, y), plain.step(x, y), **TOL64)
    sd = {k: v.clone() for k, v in ens.state_dict().items()}
    for i in (2, 4):
        new = fresh(300 + i)
        for k, v in new.state_dict().items():
            sd[k][i] = v
        plain.reset(i, new)
    ens.load_state_dict(sd)
    with torch.no_grad():
        for p in ens.parameters():
            for value in opt.state[p].values():
                value[[2, 4]] = 0
    for x, y in batches[3:]:
        torch.testing.assert_close(step(x, y), plain.step(x, y), **TOL64)
    assert_members_equal(ens, plain.models)


SUB_INDICES = {
    "tensor": torch.tensor([4, 1, 3]),
    "mask": torch.tensor([False, True, False, True, True, False]),
    "numpy": np.array([5, 0]),
    "negative-list": [-1, -3],
}
ONE_INDICES = {"negative": -2, "numpy-int": np.int64(3), "0d-tensor": torch.tensor(1),
               "0d-array": np.array(0)}  # fmt: skip


def test_index_sub_ensembles_and_members_then_train() -> None:
    """``ens[index]`` with a tensor, a bool mask, a numpy array and negative ints: a copy of
    those rows that ``opt.select(index, sub)`` hands its members' Adam state, trained apart
    from the original; one member (negative, numpy int, 0-d tensor/array) as a plain copy."""
    ens, opt, plain = start()
    batches = float64_batches(5, 7, D_IN, D_OUT, seed=7)
    train_both(ens, opt, plain, batches[:2])
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    for name, index in ONE_INDICES.items():
        i = int(index) % N
        member = ens[index]
        assert type(member) is nn.Sequential, name
        torch.testing.assert_close(member.state_dict(), plain.models[i].state_dict(), **TOL64)
        with torch.no_grad():
            member[0].weight.add_(1.0)  # a copy: the ensemble does not move
    for name, index in SUB_INDICES.items():
        rows = torch.arange(N)[torch.as_tensor(index)].tolist()
        sub = ens[index]
        sub_opt = opt.select(index, sub)
        assert list(sub.member_ids) == rows, name
        kept = Plain([], [])
        kept.models, kept.opts, kept.lrs = plain.models, plain.opts, plain.lrs
        kept.keep(rows)
        twin = _plain_twin(kept)  # the sub-ensemble is a copy: members and Adam states
        train_both(sub, sub_opt, twin, batches[2:])
    for k, v in ens.state_dict().items():  # the original did not move
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, msg=k)
    train_both(ens, opt, plain, batches[2:])


@pytest.mark.parametrize("how", ["deepcopy-pair", "load-copied-state"])
def test_deepcopy_trains_apart(how) -> None:
    ens, opt, plain = start()
    batches = float64_batches(7, 7, D_IN, D_OUT, seed=9)
    train_both(ens, opt, plain, batches[:2])
    if how == "deepcopy-pair":
        c, c_opt = copy.deepcopy((ens, opt))
    else:
        c = copy.deepcopy(ens)
        c_opt = vmapens.StackedAdam(c, lr=LRS)
        c_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    ptrs = {t.data_ptr() for t in [*ens.parameters(), *ens.buffers()]}
    ptrs |= {v.data_ptr() for st in opt.state.values() for v in st.values()}
    assert not ptrs & {p.data_ptr() for p in c.parameters()}
    assert not ptrs & {v.data_ptr() for st in c_opt.state.values() for v in st.values()}
    assert all(p in c_opt.state for p in c.parameters())
    twin = _plain_twin(plain)
    train_both(c, c_opt, twin, batches[2:5])  # the copy on some batches,
    train_both(ens, opt, plain, batches[5:])  # the original on others
    assert_members_equal(c, twin.models)


def test_load_a_live_state_dict_shares_moments_as_torch_does() -> None:
    """``c_opt.load_state_dict(opt.state_dict())`` without a copy: torch's own load keeps the
    state dict's tensors (same dtype and device: no cast), so the two optimizers share their
    moments and ``step``, and each one's step moves the other's state. The ensemble does what
    the same code does with plain ``torch.optim.Adam`` (copy the state dict to train apart)."""
    ens, opt, plain = start()
    batches = float64_batches(7, 7, D_IN, D_OUT, seed=11)
    train_both(ens, opt, plain, batches[:2])
    c = copy.deepcopy(ens)
    c_opt = vmapens.StackedAdam(c, lr=LRS)
    c_opt.load_state_dict(opt.state_dict())
    twin = Plain([copy.deepcopy(m) for m in plain.models], LRS)
    for o, src in zip(twin.opts, plain.opts, strict=True):
        o.load_state_dict(src.state_dict())
    train_both(c, c_opt, twin, batches[2:5])
    train_both(ens, opt, plain, batches[5:])
    assert opt.state[ens.get_parameter("0.weight")]["step"].tolist() == [7] * N


def test_torch_save_whole_objects_mid_training() -> None:
    ens, opt, plain = start()
    batches = float64_batches(6, 7, D_IN, D_OUT, seed=10)
    train_both(ens, opt, plain, batches[:3])
    buf = io.BytesIO()
    torch.save({"ens": ens, "opt": opt}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    ens2, opt2 = loaded["ens"], loaded["opt"]
    assert all(p in opt2.state for p in ens2.parameters())
    twin = _plain_twin(plain)
    train_both(ens2, opt2, twin, batches[3:])
    train_both(ens, opt, plain, batches[3:5])  # the original is not the loaded one
