"""What ``fit`` accepts as data, targets and metrics, against plain torch: targets held in a
tuple or dict next to the inputs, class targets of narrow integer dtypes, metrics that call
``.item()``; batches that do not divide the data, cycling ``steps`` across passes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from truth import derived_seed

import vmapens

F64 = dict(dtype=torch.float64)
TOL = dict(rtol=1e-9, atol=1e-11)
G = torch.Generator().manual_seed(3)
S = 11  # samples: batches of 4 leave a last batch of 3
X = torch.randn(S, 3, generator=G, **F64)
Y = torch.randint(0, 2, (S,), generator=G)
W = torch.rand(S, generator=G, **F64)
XV, YV = torch.randn(3, 3, generator=G, **F64), torch.randint(0, 2, (3,), generator=G)


def linear() -> nn.Module:
    return nn.Linear(3, 2).double()


def weighted(out: torch.Tensor, yw: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    y, w = yw
    return (nn.functional.cross_entropy(out, y, reduction="none") * w).mean()


def weighted_dict(out: torch.Tensor, t: dict[str, torch.Tensor]) -> torch.Tensor:
    return weighted(out, (t["y"], t["w"]))


def order(seed: int, p: int, shuffle: bool) -> torch.Tensor:
    """docs/fit.md, "Data, epochs and steps": pass ``p``'s order, written again here."""
    if not shuffle:
        return torch.arange(S)
    g = torch.Generator().manual_seed(derived_seed(seed, "shuffle", p))
    return torch.randperm(S, generator=g)


def plan(seed: int, b: int, total: int, shuffle: bool = True) -> list[torch.Tensor]:
    """The rows of each of ``total`` steps, cycling over passes as ``steps=`` does."""
    rows: list[torch.Tensor] = []
    p = 0
    while len(rows) < total:
        o = order(seed, p, shuffle)
        rows += [o[k : k + b] for k in range(0, S, b)]
        p += 1
    return rows[:total]


def train_alone(members: list[nn.Module], loss, batches, lr: float) -> torch.Tensor:
    """Each member alone with torch.optim.Adam; the step losses, ``[steps, members]``."""
    losses = []
    for m in members:
        opt = torch.optim.Adam(m.parameters(), lr=lr)
        losses.append([])
        for inputs, targets in batches:
            opt.zero_grad()
            value = loss(m(inputs), targets)
            value.backward()
            opt.step()
            losses[-1].append(value.item())
    return torch.tensor(losses, **F64).T


def assert_members(ens: vmapens.Ensemble, plain: list[nn.Module]) -> None:
    for got, want in zip(ens.unstack(), plain, strict=True):
        for (k, a), b in zip(got.state_dict().items(), want.state_dict().values(), strict=True):
            torch.testing.assert_close(a, b, **TOL, msg=k)


def _tuple(r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return Y[r], W[r]


def _dict(r: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"y": Y[r], "w": W[r]}


# (targets, loss, how the truth cuts them, epochs, steps, shuffle)
TREES = [
    pytest.param((Y, W), weighted, _tuple, 2, None, True, id="tuple-passes"),
    pytest.param({"y": Y, "w": W}, weighted_dict, _dict, 2, 4, True, id="dict-steps-cycle"),
    pytest.param((Y, W), weighted, _tuple, 1, 3, False, id="tuple-in-order"),
]


@pytest.mark.parametrize(("targets", "loss", "cut", "epochs", "steps", "shuffle"), TREES)
def test_tensor_data_with_targets_in_a_tree_trains_as_alone(
    targets, loss, cut, epochs, steps, shuffle
):
    """(X, (Y, W)) was refused as tensor data (read as a tuple of two batches) while a
    DataLoader yielding (x, (y, w)) trained: both train as alone now, the last partial batch
    and the passes ``steps`` cycles over included."""
    ens = vmapens.Ensemble(linear, n=3, seed=0)
    plain = [copy.deepcopy(m) for m in ens.unstack()]
    h = vmapens.fit(ens, (X, targets), loss, epochs=epochs, steps=steps, batch_size=4,
                    shuffle=shuffle, seed=5, progress=False, lr=0.05)  # fmt: skip
    per_epoch = steps if steps is not None else 3
    batches = [(X[r], cut(r)) for r in plan(5, 4, epochs * per_epoch, shuffle)]
    losses = train_alone(plain, loss, batches, lr=0.05)
    assert_members(ens, plain)
    # Each step weighs one in the epoch's mean, the last partial batch too (docs/fit.md).
    torch.testing.assert_close(h.train_loss, losses.view(epochs, per_epoch, -1).mean(1), **TOL)


class _Pairs(Dataset):
    def __len__(self) -> int:
        return S

    def __getitem__(self, i: int):
        return X[i], (Y[i], W[i])


def test_tuple_targets_as_tensors_and_as_a_dataloader_agree() -> None:
    a, b = (vmapens.Ensemble(linear, n=2, seed=1) for _ in range(2))
    vmapens.fit(a, (X, (Y, W)), weighted, batch_size=4, shuffle=False, progress=False, lr=0.1)
    vmapens.fit(b, DataLoader(_Pairs(), batch_size=4), weighted, progress=False, lr=0.1)
    assert_members(a, b.unstack())


def test_out_of_bag_with_tuple_targets_is_refused_first() -> None:
    ens = vmapens.Ensemble(linear, n=2, seed=0)
    before = copy.deepcopy(ens.state_dict())
    with pytest.raises(ValueError, match=r"fit: `val_data='oob'` needs the targets of `data`"):
        vmapens.fit(ens, (X, (Y, W)), weighted, bootstrap=True, val_data="oob", seed=0,
                    progress=False)  # fmt: skip
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize(
    ("dtype", "loss"),
    [
        (torch.uint8, nn.CrossEntropyLoss()),
        (torch.int8, nn.functional.nll_loss),
        (torch.int16, nn.NLLLoss()),
    ],
    ids=["uint8", "int8", "int16"],
)
def test_narrow_class_training_targets_are_refused_with_the_dtype_and_long(dtype, loss) -> None:
    """torch alone takes uint8 class indices (and refuses int8/int16 with its own error); vmap's
    batched gather in the step fails on all three: the refusal names the dtype and the fix,
    before anything changed."""
    ens = vmapens.Ensemble(linear, n=2, seed=0)
    before = copy.deepcopy(ens.state_dict())
    opt = vmapens.StackedAdam(ens, lr=0.1)
    with pytest.raises(ValueError, match=rf"fit: the targets of `data` are {dtype}.*Y\.long\(\)"):
        vmapens.fit(ens, (X, Y.to(dtype)), loss, optimizer=opt, progress=False)
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(not s for s in opt.state.values())
    vmapens.fit(ens, (X, Y.to(dtype).long()), loss, optimizer=opt, progress=False)  # the fix


def test_uint8_class_targets_from_a_dataloader_are_refused_naming_long() -> None:
    # A DataLoader's batches reach the step's self-check, which said to use backend='loop'.
    ens = vmapens.Ensemble(linear, n=2, seed=0)
    before = copy.deepcopy(ens.state_dict())
    loader = DataLoader(torch.utils.data.TensorDataset(X, Y.to(torch.uint8)), batch_size=4)
    with pytest.raises(RuntimeError, match=r"uint8 class targets .*pass \.long\(\)"):
        vmapens.fit(ens, loader, nn.CrossEntropyLoss(), progress=False)
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_uint8_validation_targets_score_as_alone_and_int16_fails_as_alone() -> None:
    """The validation loss runs a loss vmap cannot gather with member by member: uint8 class
    indices give each member's loss as alone; int16 gives torch's own refusal."""
    ens = vmapens.Ensemble(linear, n=2, seed=0)
    loss = nn.CrossEntropyLoss()
    h = vmapens.fit(ens, (X, Y), loss, val_data=(XV, YV.to(torch.uint8)), progress=False, lr=0.1)
    with torch.no_grad():
        want = [loss(m.eval()(XV), YV.to(torch.uint8)).item() for m in ens.unstack()]
    assert h.val_loss[-1].tolist() == want
    with torch.no_grad(), pytest.raises(RuntimeError) as alone:
        loss(linear()(XV), YV.to(torch.int16))
    with pytest.raises(ValueError, match=r"`val_data` does not fit") as got:
        vmapens.fit(ens, (X, Y), loss, val_data=(XV, YV.to(torch.int16)), progress=False)
    assert str(alone.value) in str(got.value)


def accuracy_item(out: torch.Tensor, y: torch.Tensor) -> float:
    return (out.argmax(-1) == y).double().mean().item()


def test_a_metric_calling_item_runs_member_by_member_exactly() -> None:
    """A metric with ``.item()`` was refused (vmap cannot batch it); it is computed on each
    member's output, and on the averaged output as a float64 (a Python float of 1/3 kept as
    is, not rounded to float32)."""
    ens = vmapens.Ensemble(linear, n=3, seed=2)
    h = vmapens.fit(ens, (X, Y), nn.CrossEntropyLoss(), epochs=2, val_data=(XV, YV),
                    metrics={"acc": accuracy_item}, progress=False, lr=0.1)  # fmt: skip
    members = [m.eval() for m in ens.unstack()]
    with torch.no_grad():
        outs = [m(XV) for m in members]
        want = torch.tensor([accuracy_item(o, YV) for o in outs], **F64)
        whole = accuracy_item(torch.stack(outs).mean(0), YV)
    assert torch.equal(h.metrics["acc"][-1], want)
    assert h.ensemble_metrics["acc"][-1].item() == whole


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 2).double(), nn.Linear(1, 2).double()

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.a(x) + torch.tanh(self.b(z))


def resample(seed: int, member: int) -> torch.Tensor:
    """docs/fit.md, "Bagging": member ``member``'s rows, written again here."""
    g = torch.Generator().manual_seed(derived_seed(seed, "bootstrap", member))
    return torch.randint(S, (S,), generator=g)


@pytest.mark.parametrize("how", ["bootstrap", "in_dims=0"])
def test_tuple_inputs_with_dict_targets_are_cut_alike(how: str) -> None:
    """((x, z), {"y": Y, "w": W}) tensors: each input and each target by the same rows, per
    member for a resample (``bootstrap``) or a member's own slice (``in_dims=0``)."""
    n, z = 2, X[:, :1] * 2
    ens = vmapens.Ensemble(TwoInputs, n=n, seed=0)
    plain = [copy.deepcopy(m) for m in ens.unstack()]
    stacked = [(X, z, Y, W) if how == "bootstrap" else (X + i, z - i, Y.flip(0), W * i) for i in range(n)]  # fmt: skip
    if how == "bootstrap":
        data, extra = ((X, z), {"y": Y, "w": W}), dict(bootstrap=True)
    else:
        xs, zs, ys, ws = (torch.stack(t) for t in zip(*stacked))
        data, extra = ((xs, zs), {"y": ys, "w": ws}), dict(in_dims=0)
    vmapens.fit(ens, data, weighted_dict, epochs=2, batch_size=4, seed=9, progress=False,
                lr=0.05, **extra)  # fmt: skip
    for i, m in enumerate(plain):
        x, zi, y, w = stacked[i]
        boot = resample(9, i) if how == "bootstrap" else torch.arange(S)
        batches = [((x[boot[r]], zi[boot[r]]), {"y": y[boot[r]], "w": w[boot[r]]})
                   for r in plan(9, 4, 6)]  # fmt: skip
        opt = torch.optim.Adam(m.parameters(), lr=0.05)
        for inputs, targets in batches:
            opt.zero_grad()
            weighted_dict(m(*inputs), targets).backward()
            opt.step()
    assert_members(ens, plain)


def test_uint8_class_targets_train_as_alone_with_the_loop_backend() -> None:
    """Members one after another take uint8 class indices as torch alone does: not refused."""
    ens = vmapens.Ensemble(linear, n=2, seed=4, backend="loop")
    plain = [copy.deepcopy(m) for m in ens.unstack()]
    y8 = Y.to(torch.uint8)
    vmapens.fit(ens, (X, y8), nn.CrossEntropyLoss(), batch_size=4, shuffle=False,
                progress=False, lr=0.05)  # fmt: skip
    batches = [(X[r], y8[r]) for r in plan(0, 4, 3, shuffle=False)]
    train_alone(plain, nn.CrossEntropyLoss(), batches, lr=0.05)
    assert_members(ens, plain)


class _Member(Dataset):
    def __init__(self, k: int) -> None:
        self.k = k

    def __len__(self) -> int:
        return S

    def __getitem__(self, i: int):
        return X[i] + self.k, (Y[i], W[i] * self.k)


def test_per_member_dataloaders_with_tuple_targets_train_as_alone() -> None:
    """A list of one DataLoader per member (``in_dims=0``) yielding ``(x, (y, w))``: the step
    stacks the targets' tuple as it stacks the inputs (was a TypeError from torch.stack)."""
    ens = vmapens.Ensemble(linear, n=2, seed=0)
    plain = [copy.deepcopy(m) for m in ens.unstack()]
    loaders = [DataLoader(_Member(k + 1), batch_size=4) for k in range(2)]
    vmapens.fit(ens, loaders, weighted, in_dims=0, progress=False, lr=0.05)
    for m, loader in zip(plain, loaders, strict=True):
        train_alone([m], weighted, list(loader), lr=0.05)
    assert_members(ens, plain)
