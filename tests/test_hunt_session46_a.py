"""Data-dependent forwards and losses: trained in an ensemble against each member alone.

Forwards and losses that read tensor values (``.item()``, ``bool(t)``, boolean masks,
``nonzero``, ``unique``, ``bincount``, ``torch.cond``, top-k routing, ties in reductions,
colliding scatter indices). Each runs in the README's hand-written loop
(``per_member(loss)(ens(x), y)``) and in ``make_step``, under one vmap, with ``chunk_size``
and with ``backend="loop"``. The truth is plain PyTorch: copies of the members taken right
after construction, each trained alone with ``torch.optim.SGD`` on the same batches, in
float64. Where vmap cannot batch a forward the ensemble must refuse, naming
``backend='loop'``, and change nothing.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from truth import TOL64, assert_members_equal

import vmapens
import vmapens._autocompile

N = 3
LR = 0.1
SETTINGS = {"vmap": {}, "chunk-2": {"chunk_size": 2}, "loop": {"backend": "loop"}}

pytestmark = [
    pytest.mark.usefixtures("float64_default"),
    # vmap's per-member fallback (bincount, histc, nonzero_static, ...) warns about speed.
    pytest.mark.filterwarnings("ignore:There is a performance drop"),
    # torch's own, alone too: torch.cond traced eagerly with grad on; index_reduce is beta.
    pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf"),
    pytest.mark.filterwarnings("ignore:index_reduce"),
]


def _batches(count: int = 3, rows: int = 8, seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(rows, 4, generator=g), torch.randn(rows, 2, generator=g)) for _ in range(count)
    ]


def _alone(
    members: list[nn.Module], loss_fn: Callable, batches: list, *, per_member: bool = False
) -> None:
    for i, m in enumerate(members):
        opt = torch.optim.SGD(m.parameters(), lr=LR)
        for x, y in batches:
            opt.zero_grad()
            loss_fn(m(x[i] if per_member else x), y[i] if per_member else y).backward()
            opt.step()


def _train(
    factory: Callable[[], nn.Module],
    loss_fn: Callable,
    batches: list,
    how: str,
    *,
    per_member: bool = False,
    n: int = N,
    **settings: Any,
) -> tuple[vmapens.Ensemble, list[nn.Module]]:
    """The ensemble trained ``how`` ("readme" or "step") and its members trained alone."""
    ens = vmapens.Ensemble(factory, n=n, seed=0, **settings)
    alone = [copy.deepcopy(m) for m in ens.unstack()]
    opt = vmapens.StackedSGD(ens, lr=LR)
    if how == "readme":
        loss_of = vmapens.per_member(loss_fn, in_dims=(0, 0) if per_member else (0, None))
        for x, y in batches:
            out = ens(x, in_dims=0) if per_member else ens(x)
            loss = loss_of(out, y)
            opt.zero_grad()
            loss.sum().backward()
            opt.step()
    else:
        step = vmapens.make_step(ens, loss_fn, opt, in_dims=0 if per_member else None)
        for x, y in batches:
            step(x, y)
    _alone(alone, loss_fn, batches, per_member=per_member)
    return ens, alone


class Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


# ---------------------------------------------------------------------------------------------
# Losses that read values: per_member runs them member by member, the step refuses under vmap.


def positive_only_mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A squared error over the outputs that are positive (a per-member boolean mask)."""
    keep = out > 0
    return ((out[keep] - y[keep]) ** 2).sum() / max(int(keep.sum()), 1)


def nan_guarded_mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(out, y)
    if torch.isnan(loss):
        return loss * 0
    return loss * 2 if loss.item() > 1.0 else loss


@pytest.mark.parametrize("loss_fn", [positive_only_mse, nan_guarded_mse], ids=lambda f: f.__name__)
@pytest.mark.parametrize("setting", SETTINGS)
def test_a_loss_that_reads_values_trains_as_alone_in_the_readme_loop(
    loss_fn: Callable, setting: str
) -> None:
    ens, alone = _train(Linear, loss_fn, _batches(), "readme", **SETTINGS[setting])
    assert_members_equal(ens, alone, **TOL64)


@pytest.mark.parametrize("loss_fn", [positive_only_mse, nan_guarded_mse], ids=lambda f: f.__name__)
def test_a_loss_that_reads_values_trains_as_alone_in_the_loop_step(loss_fn: Callable) -> None:
    ens, alone = _train(Linear, loss_fn, _batches(), "step", backend="loop")
    assert_members_equal(ens, alone, **TOL64)


@pytest.mark.parametrize("setting", ["vmap", "chunk-2"])
def test_the_vmap_step_refuses_a_loss_that_reads_values_and_changes_nothing(setting: str) -> None:
    ens = vmapens.Ensemble(Linear, n=N, seed=0, **SETTINGS[setting])
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    step = vmapens.make_step(ens, positive_only_mse, vmapens.StackedSGD(ens, lr=LR))
    x, y = _batches(1)[0]
    with pytest.raises(RuntimeError, match="backend='loop'"):
        step(x, y)
    for key, value in before.items():
        assert torch.equal(ens.state_dict()[key], value), key


def skip_empty_classes(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy averaged over the classes present in the batch (an ``if`` on a mask)."""
    total, present = out.sum() * 0, 0
    for c in range(3):
        rows = y == c
        if rows.any():
            total = total + F.cross_entropy(out[rows], y[rows])
            present += 1
    return total / present


class Three(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _class_batches(per_member: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(3):
        if per_member:
            x, y = torch.randn(N, 8, 4, generator=g), torch.randint(0, 3, (N, 8), generator=g)
            y[0] = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1])  # member 0 never sees class 2
        else:
            x, y = torch.randn(8, 4, generator=g), torch.tensor([0, 1, 0, 1, 0, 1, 0, 1])
        out.append((x, y))
    return out


@pytest.mark.parametrize("how", ["readme", "step"])
@pytest.mark.parametrize("setting", SETTINGS)
def test_skipping_empty_classes_of_shared_targets_trains_as_alone(how: str, setting: str) -> None:
    # The targets every member shares are no batched tensor: the `if` runs under vmap.
    ens, alone = _train(Three, skip_empty_classes, _class_batches(False), how, **SETTINGS[setting])
    assert_members_equal(ens, alone, **TOL64)


@pytest.mark.parametrize("setting", SETTINGS)
def test_skipping_empty_classes_of_per_member_targets_trains_as_alone(setting: str) -> None:
    batches = _class_batches(True)
    ens, alone = _train(
        Three, skip_empty_classes, batches, "readme", per_member=True, **SETTINGS[setting]
    )
    assert_members_equal(ens, alone, **TOL64)
    ens, alone = _train(Three, skip_empty_classes, batches, "step", per_member=True, backend="loop")
    assert_members_equal(ens, alone, **TOL64)


# ---------------------------------------------------------------------------------------------
# Forwards with data-dependent ops that vmap batches: every member as alone.


class Routed(nn.Module):
    """``fc`` gives the values, ``gate`` the data-dependent choice made by ``op``."""

    def __init__(self, op: Callable) -> None:
        super().__init__()
        self.fc, self.gate, self.op = nn.Linear(4, 2), nn.Linear(4, 2), op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(self.fc(x), self.gate(x), x)


BATCHED_OPS: dict[str, Callable] = {
    "topk-routing": lambda h, g, x: (
        h.gather(-1, g.topk(1, -1).indices) * g.topk(1, -1).values
    ).expand(-1, 2),
    "bincount-minlength": lambda h, g, x: (
        h * torch.bincount(g.argmax(-1), minlength=2).to(h.dtype)[0]
    ),
    "histc": lambda h, g, x: h * torch.histc(g.detach(), bins=4)[0],
    "count_nonzero": lambda h, g, x: h * torch.count_nonzero(g > 0),
    "nonzero_static": lambda h, g, x: h[
        torch.nonzero_static(g[:, 0] > 0, size=8, fill_value=0).squeeze(-1)
    ],
    "kthvalue": lambda h, g, x: h * g[:, 0].kthvalue(3).values,
    "mode": lambda h, g, x: h * (torch.mode(g.argmax(-1)).values + 1),
    "bucketize": lambda h, g, x: h * torch.bucketize(g.detach(), torch.tensor([-0.5, 0.0, 0.5])),
    "torch.cond": lambda h, g, x: torch.cond(
        g.sum() > 0, lambda a: a * 2, lambda a: a.tanh(), (h,)
    ),
    "shared-mask": lambda h, g, x: torch.where((x[:, :2] > 0), h, g)[x[:, 0] > -5],
    "shared-nonzero": lambda h, g, x: h[torch.nonzero(x[:, 0] > -5).squeeze(-1)],
}


@pytest.mark.parametrize("op", BATCHED_OPS)
@pytest.mark.parametrize("setting", ["vmap", "chunk-2"])
def test_a_forward_with_a_batchable_data_dependent_op_trains_as_alone(
    op: str, setting: str
) -> None:
    fn = BATCHED_OPS[op]
    for how in ("readme", "step"):
        ens, alone = _train(lambda: Routed(fn), F.mse_loss, _batches(), how, **SETTINGS[setting])
        assert_members_equal(ens, alone, **TOL64)


# ---------------------------------------------------------------------------------------------
# Forwards vmap cannot batch: refused naming backend='loop'; the loop trains as alone.

UNBATCHABLE: dict[str, Callable] = {
    "item": lambda h, g, x: h * 2 if g.sum().item() > 0 else h,
    "bool": lambda h, g, x: h / h.norm() if h.norm() > 1.0 else h,
    "tolist": lambda h, g, x: h * float(sum(g.argmax(-1).tolist())),
    "int": lambda h, g, x: h * int((g > 0).sum()),
    "boolean-mask": lambda h, g, x: h[g[:, 0] > -5],
    "masked-write": lambda h, g, x: (
        h.masked_fill(g < 0, 0.0) + h.clone().index_put((g < 0,), torch.tensor(0.0))
    ),
    "nonzero": lambda h, g, x: h[torch.nonzero(g[:, 0] > -5).squeeze(-1)],
    "where-one-arg": lambda h, g, x: h[torch.where(g[:, 0] > -5)[0]],
    "unique": lambda h, g, x: h * torch.unique(g.argmax(-1)).numel(),
    "masked_select": lambda h, g, x: h * torch.masked_select(g, g > 0).sum(),
    "contains": lambda h, g, x: h * 2 if 1 in g.argmax(-1) else h,
    "torch.equal": lambda h, g, x: h * 2 if torch.equal(g.argmax(-1), g.argmin(-1)) else h,
    "narrow-tensor-start": lambda h, g, x: torch.narrow(h, 0, (g[:, 0] > 9).sum(), 8),
}


@pytest.mark.parametrize("op", UNBATCHABLE)
def test_a_forward_vmap_cannot_batch_is_refused_and_trains_as_alone_in_the_loop(op: str) -> None:
    fn = UNBATCHABLE[op]
    x, y = _batches(1)[0]
    for setting in ("vmap", "chunk-2"):
        ens = vmapens.Ensemble(lambda: Routed(fn), n=N, seed=0, **SETTINGS[setting])
        with pytest.raises(RuntimeError, match="backend='loop'"):
            ens(x)
        with pytest.raises(RuntimeError, match="backend='loop'"):
            vmapens.make_step(ens, F.mse_loss, vmapens.StackedSGD(ens, lr=LR))(x, y)
    for how in ("readme", "step"):
        ens, alone = _train(lambda: Routed(fn), F.mse_loss, _batches(), how, backend="loop")
        assert_members_equal(ens, alone, **TOL64)
    out = ens(x)
    for i, m in enumerate(alone):
        torch.testing.assert_close(out[i], m(x), **TOL64)


def test_predict_with_the_loop_backend_averages_what_each_member_computes_alone() -> None:
    fn = UNBATCHABLE["bool"]
    ens = vmapens.Ensemble(lambda: Routed(fn), n=N, seed=0, backend="loop")
    alone = [copy.deepcopy(m) for m in ens.unstack()]
    x, _ = _batches(1)[0]
    mean = vmapens.predict(ens, x, reduce="mean")
    torch.testing.assert_close(mean, torch.stack([m(x) for m in alone]).mean(0), **TOL64)


# ---------------------------------------------------------------------------------------------
# Ties and colliding indices: which element gets the gradient is data-dependent.


class Tied(nn.Module):
    """A parameter with many ties (values 0, 1, 2), reduced by ``op``."""

    def __init__(self, op: Callable) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randint(0, 3, (5, 40)).double())
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(self.p + 0 * x.sum())


TIES: dict[str, Callable] = {
    "max-dim": lambda h: h.max(1).values,
    "topk": lambda h: h.topk(3, 1).values.flatten(),
    "sort": lambda h: h.sort(0).values[:2].flatten(),
    "kthvalue": lambda h: h.kthvalue(7, 1).values,
    "median-dim": lambda h: h.median(0).values,
    "mode": lambda h: h.mode(1).values,
    "cummax": lambda h: h.cummax(1).values.flatten(),
    "argmax-gather": lambda h: h.gather(1, h.argmax(1, keepdim=True)).flatten(),
    "max-pool": lambda h: F.max_pool1d(h[None], 4)[0].flatten(),
}


@pytest.mark.parametrize("op", TIES)
def test_a_reduction_over_ties_gives_each_member_its_gradient_alone(op: str) -> None:
    ens = vmapens.Ensemble(lambda: Tied(TIES[op]), n=N, seed=0)
    alone = [copy.deepcopy(m) for m in ens.unstack()]
    x = torch.randn(2)
    out = ens(x)
    w = torch.randn(out.shape[1:], generator=torch.Generator().manual_seed(1))
    (out * w).sum().backward()
    for i, m in enumerate(alone):
        (m(x) * w).sum().backward()
        torch.testing.assert_close(ens.p.grad[i], m.p.grad, rtol=0, atol=0, msg=f"member {i}")


COLLIDING: dict[str, Callable] = {
    "scatter": lambda h, i: torch.zeros(3, 2).scatter(0, i[:, None].expand(-1, 2), h),
    "index_copy": lambda h, i: torch.zeros(3, 2).index_copy(0, i, h),
    "index_reduce-amax": lambda h, i: torch.zeros(3, 2).index_reduce(
        0, i, h, "amax", include_self=False
    ),
    "index_put-accumulate": lambda h, i: torch.zeros(3, 2).index_put((i,), h, accumulate=True),
    "setitem-read-back": lambda h, i: h.clone().index_put((i,), h[i] * 2),
}


class Slotted(nn.Module):
    """Rows written to 3 slots chosen by ``gate`` (an expert dispatch, with collisions)."""

    def __init__(self, op: Callable) -> None:
        super().__init__()
        self.fc, self.gate, self.op = nn.Linear(4, 2), nn.Linear(4, 3), op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(self.fc(x), self.gate(x).argmax(-1))


@pytest.mark.parametrize("op", COLLIDING)
def test_writes_at_colliding_data_dependent_indices_train_as_alone(op: str) -> None:
    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (out * y[: out.shape[0]]).sum()

    for how in ("readme", "step"):
        ens, alone = _train(lambda: Slotted(COLLIDING[op]), loss_fn, _batches(rows=6), how)
        assert_members_equal(ens, alone, **TOL64)


# ---------------------------------------------------------------------------------------------
# A step that fails on a later batch, in its second chunk: nothing changes.


class CountsInputs(nn.Module):
    """``bincount`` of the member's own input: its length is data-dependent (vmap's fallback
    stacks the members' counts, and fails where their lengths differ)."""

    def __init__(self) -> None:
        super().__init__()
        self.bn, self.fc = nn.BatchNorm1d(4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bn(x)) * torch.bincount(x[:, 0].abs().long())[0]


def _counted(bad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 8, 4, generator=g)
    x[:, :, 0] = torch.tensor([0.0, 1.0] * 4)
    if bad:
        x[3, 0, 0] = 2.5  # member 3's counts get a third bin, member 2's do not
    return x, torch.randn(4, 8, 2, generator=g)


@pytest.mark.parametrize("setting", ["vmap", "chunk-2"])
def test_a_step_failing_on_data_dependent_sizes_changes_nothing(setting: str) -> None:
    ens = vmapens.Ensemble(CountsInputs, n=4, seed=0, **SETTINGS[setting])
    opt = vmapens.StackedAdam(ens, lr=0.1)
    step = vmapens.make_step(ens, F.mse_loss, opt, in_dims=0)
    step(*_counted(False))
    state = {k: v.clone() for k, v in ens.state_dict().items()}
    grads = {k: p.grad.clone() for k, p in ens.named_parameters()}
    moments = copy.deepcopy(opt.state_dict()["state"])
    with pytest.raises(RuntimeError, match="backend='loop'"):
        step(*_counted(True))
    for key, value in state.items():
        assert torch.equal(ens.state_dict()[key], value), key
    for key, p in ens.named_parameters():
        assert torch.equal(p.grad, grads[key]), key
    for index, entry in opt.state_dict()["state"].items():
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(moments[index][key])), key


def test_a_step_with_data_dependent_sizes_trains_as_alone_in_the_loop() -> None:
    batches = [_counted(False), _counted(True)]
    ens, alone = _train(
        CountsInputs, F.mse_loss, batches, "step", per_member=True, n=4, backend="loop"
    )
    assert_members_equal(ens, alone, **TOL64)


# ---------------------------------------------------------------------------------------------
# Bugs the hunt found, fixed in session 46 (each was a strict xfail).


class WarmedUp(nn.Module):
    """A loss that counts its calls for a warm-up weight, with a NaN guard (``if`` on a value):
    the guard makes ``per_member`` run it member by member."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        loss = F.mse_loss(out, y)
        if torch.isnan(loss):
            return loss * 0
        return min(1.0, self.calls / 10) * loss


@pytest.mark.parametrize("setting", ["vmap", "loop"])
def test_a_stateful_loss_run_member_by_member_advances_once_a_step(setting: str) -> None:
    ens = vmapens.Ensemble(Linear, n=N, seed=0, **SETTINGS[setting])
    alone = [copy.deepcopy(m) for m in ens.unstack()]
    opt, loss_fn = vmapens.StackedSGD(ens, lr=LR), WarmedUp()
    batches = _batches()
    for x, y in batches:
        loss = vmapens.per_member(loss_fn)(ens(x), y)
        opt.zero_grad()
        loss.sum().backward()
        opt.step()
    for m in alone:  # each alone with its own copy of the loss
        _alone([m], WarmedUp(), batches)
    assert_members_equal(ens, alone, **TOL64)
    assert loss_fn.calls == len(batches)


LOSSES_VMAP_CANNOT_BATCH: dict[str, Callable] = {
    "torch.equal": lambda out, y: F.mse_loss(out, y) * (2 if torch.equal(out > 0, y > 0) else 1),
    "torch.allclose": lambda out, y: (
        F.mse_loss(out, y) * (2 if torch.allclose(out, y, atol=0.5) else 1)
    ),
    "narrow-tensor-start": lambda out, y: F.mse_loss(
        torch.narrow(out, 0, (out[:, 0] > 9).sum(), 4), y[:4]
    ),
}


@pytest.mark.parametrize("loss", LOSSES_VMAP_CANNOT_BATCH)
def test_per_member_runs_every_loss_vmap_cannot_batch_member_by_member(loss: str) -> None:
    loss_fn = LOSSES_VMAP_CANNOT_BATCH[loss]
    ens = vmapens.Ensemble(Linear, n=N, seed=0)
    x, y = _batches(1)[0]
    out = ens(x)
    got = vmapens.per_member(loss_fn)(out, y)
    torch.testing.assert_close(got, torch.stack([loss_fn(out[i], y) for i in range(N)]))


class MaskedByInput(nn.Module):
    """Keeps the rows its (shared) input marks: eager vmap batches it (the mask is no member's
    tensor); its size is data-dependent for dynamo."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)[x[:, 0] > 0]


def _masked_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x, y[x[:, 0] > 0]) for x, y in _batches(2)]


def test_the_eager_step_trains_a_shared_input_mask_as_alone() -> None:
    for setting in ("vmap", "chunk-2"):
        ens, alone = _train(
            MaskedByInput, F.mse_loss, _masked_batches(), "step", **SETTINGS[setting]
        )
        assert_members_equal(ens, alone, **TOL64)


def test_a_data_dependent_size_in_the_compiled_step_is_compile_failed() -> None:
    ens = vmapens.Ensemble(MaskedByInput, n=N, seed=0)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedSGD(ens, lr=LR), compile=True)
    x, y = _masked_batches()[0]
    try:
        with pytest.raises(vmapens.CompileFailed, match="compile=False"):
            step(x, y)
    finally:
        for key, value in before.items():
            assert torch.equal(ens.state_dict()[key], value), key


def test_fit_compile_auto_goes_on_eagerly_past_a_data_dependent_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(vmapens._autocompile, "COMPILE_PAYS_AFTER_S", 0.0)
    fn = BATCHED_OPS["bincount-minlength"]
    ens = vmapens.Ensemble(lambda: Routed(fn), n=N, seed=0)
    alone = [copy.deepcopy(m) for m in ens.unstack()]
    x, y = _batches(1, rows=16)[0]
    with pytest.warns(UserWarning, match="goes on eagerly"):
        vmapens.fit(
            ens,
            (x, y),
            F.mse_loss,
            steps=8,
            batch_size=16,
            shuffle=False,
            optimizer=lambda e: vmapens.StackedSGD(e, lr=LR),
            compile="auto",
            progress=False,
        )
    _alone(alone, F.mse_loss, [(x, y)] * 8)
    assert_members_equal(ens, alone, **TOL64)
