"""fit's data side against truths written again from docs/fit.md ("Data, epochs and steps").

The batch order, the shuffle and the bootstrap draws are recomputed here from the documented
recipe (SHA-256 seeds, ``torch.randperm``, ``torch.randint``), never with a vmapens helper;
the expected members are plain modules trained alone with ``torch.optim.Adam`` on exactly
those batches, in float64.
"""

from __future__ import annotations

import copy
import hashlib
import warnings

import pytest
import torch
from models import TwoInputs
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import vmapens
from vmapens.callbacks import EarlyStopping

N, ROWS = 3, 11  # 11 rows in batches of 4: a last batch of 3
F64 = dict(dtype=torch.float64)
G = torch.Generator().manual_seed(0)
X1, X2, Y = (torch.randn(ROWS, d, generator=G, **F64) for d in (3, 2, 2))
XS1, XS2, YS = (torch.randn(N, ROWS, d, generator=G, **F64) for d in (3, 2, 2))
LRS = [1e-2, 2e-2, 3e-2]
TOL = dict(rtol=1e-9, atol=1e-10)


def documented_seed(seed: int, purpose: str, index: int) -> int:
    """docs/fit.md: the first 8 bytes of sha256("vmapens:{seed}:{purpose}:{index}"),
    little-endian, shifted right by one."""
    digest = hashlib.sha256(f"vmapens:{seed}:{purpose}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def documented_resample(rows: int, seed: int, member: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(documented_seed(seed, "bootstrap", member))
    return torch.randint(rows, (rows,), generator=g)


def documented_plan(batch: int | None, passes: int, seed: int, shuffle: bool) -> list:
    """Each pass's batches of positions: pass p permuted by its own generator unless one
    batch holds everything; the last batch holds what is left over."""
    b = ROWS if batch is None else min(batch, ROWS)
    plan = []
    for p in range(passes):
        order = torch.arange(ROWS)
        if shuffle and b < ROWS:
            g = torch.Generator().manual_seed(documented_seed(seed, "shuffle", p))
            order = torch.randperm(ROWS, generator=g)
        plan.append([order[k : k + b] for k in range(0, ROWS, b)])
    return plan


def plain_members(seed: int = 0) -> list[nn.Module]:
    """docs/semantics.md: member i is `torch.manual_seed(member_seed(seed, i)); factory()`."""
    out = []
    for i in range(N):
        torch.manual_seed(documented_seed(seed, "member", i))
        out.append(TwoInputs().double())
    return out


def assert_members_equal(ens: vmapens.Ensemble, plain: list[nn.Module]) -> None:
    for i, model in enumerate(plain):
        got, want = ens[i].state_dict(), model.state_dict()
        for key in want:
            torch.testing.assert_close(got[key], want[key], **TOL, msg=f"member {i} {key}")


CASES = [
    # id, fit options (steps cross a pass's end; batches of 4 leave a last one of 3)
    ("shuffled", dict(epochs=2, batch_size=4, seed=3)),
    ("steps-across-passes", dict(epochs=3, steps=2, batch_size=4, seed=9)),
    ("in-order", dict(epochs=2, batch_size=4, shuffle=False, seed=3)),
    ("one-batch", dict(epochs=2, seed=1)),
    ("batch-over-size", dict(epochs=2, batch_size=50, seed=1)),
]


@pytest.mark.parametrize("bootstrap", [False, True], ids=["all-rows", "bagged"])
@pytest.mark.parametrize("per_member", [False, True], ids=["shared", "per-member"])
@pytest.mark.parametrize("options", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_tuple_inputs_train_on_the_documented_rows(options, per_member, bootstrap):
    ens = vmapens.Ensemble(TwoInputs, N, seed=0).double()
    data = ((XS1, XS2), YS) if per_member else ((X1, X2), Y)
    extra = dict(in_dims=0) if per_member else {}
    if bootstrap:  # out-of-bag validation: each member's loss on the rows it never drew
        extra |= dict(val_data="oob", callbacks=[EarlyStopping(restore_best=False)])
    h = vmapens.fit(ens, data, nn.MSELoss(), lr=LRS, bootstrap=bootstrap, progress=False,
                    **options, **extra)  # fmt: skip
    epochs, steps, seed = options["epochs"], options.get("steps"), options["seed"]
    plan = documented_plan(
        options.get("batch_size"), epochs * 3, seed, options.get("shuffle", True)
    )
    flat = [b for one_pass in plan for b in one_pass]
    per_epoch = steps or len(plan[0])
    plain = plain_members()
    for i, model in enumerate(plain):
        own = documented_resample(ROWS, seed, i) if bootstrap else torch.arange(ROWS)
        x1, x2, y = (XS1[i], XS2[i], YS[i]) if per_member else (X1, X2, Y)
        opt = torch.optim.Adam(model.parameters(), lr=LRS[i])
        for epoch in range(epochs):
            losses = []
            for positions in flat[epoch * per_epoch : (epoch + 1) * per_epoch]:
                rows = own[positions]
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x1[rows], x2[rows]), y[rows])
                loss.backward()
                opt.step()
                losses.append(loss.detach())
            # History: the mean of the epoch's step losses, each step one weight.
            torch.testing.assert_close(h.train_loss[epoch, i], torch.stack(losses).mean(), **TOL)
            if bootstrap:
                left = torch.ones(ROWS, dtype=torch.bool)
                left[own] = False
                with torch.no_grad():
                    oob = nn.functional.mse_loss(model(x1[left], x2[left]), y[left])
                torch.testing.assert_close(h.val_loss[epoch, i], oob, **TOL)
    assert_members_equal(ens, plain)


# -- per-member data given without in_dims=0 ---------------------------------------------------


@pytest.mark.parametrize(
    "inputs", [(XS1, XS2), {"x": XS1}], ids=["tuple-of-inputs", "dict-of-inputs"]
)
def test_stacked_inputs_of_several_tensors_without_in_dims_warn(inputs):
    # docs/fit.md: `fit` warns when every input and the targets have n rows and agree on dim
    # 1. Before, only a lone input tensor was looked at: a tuple of stacked inputs trained
    # every member on all of it, member dim as samples, without a word.
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 2), N, seed=0).double()
    # The warning comes first; the forward then fails (a Linear takes one input).
    with (
        pytest.warns(UserWarning, match=r"^fit: `data` inputs .* pass in_dims=0"),
        pytest.raises(TypeError),
    ):
        vmapens.fit(ens, (inputs, YS), nn.MSELoss(), epochs=1, progress=False, seed=0,
                    check=False)  # fmt: skip


def test_shared_tuple_inputs_with_n_rows_but_other_widths_do_not_warn():
    ens = vmapens.Ensemble(TwoInputs, N, seed=0).double()
    shared = ((X1[:N], X2[:N]), torch.randn(N, 5, **F64)[:, :2])  # 2 target columns, 3 features
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        vmapens.fit(ens, shared, nn.MSELoss(), epochs=1, progress=False, seed=0)


# -- data that holds no batches is refused before anything changes -----------------------------


LOADERS = [DataLoader(TensorDataset(XS1[i], YS[i]), batch_size=4) for i in range(N)]
REFUSED = [
    # id, data, extra options, the message
    ("loaders-without-in-dims", LOADERS, {},
     r"^fit: `data` as a list holds batches.* `data\[0\]` is DataLoader; a list of one "
     r"DataLoader per member needs in_dims=0"),
    ("x-y-as-a-list", [(X1, X2), Y], {},
     r"^fit: `data` as a list .* `data\[1\]` is Tensor; \(X, Y\) tensors go in a tuple"),
    ("per-member-x-y-pairs", [(XS1[i], YS[i]) for i in range(N)], dict(in_dims=0),
     r"^fit: `data\[0\]` as a tuple .* per-member tensors go stacked"),
    ("arrays", (X1.numpy(), Y.numpy()), {}, r"^fit: `data` as a tuple .* ndarray \(arrays: pass"),
]  # fmt: skip


@pytest.mark.parametrize("data,extra,match", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_data_that_holds_no_batches_is_refused_naming_the_fix(data, extra, match):
    # Before, these ran into the first step and failed there with "each batch must be an
    # (inputs, targets) pair, got DataLoader (`data` as arrays is ...)", or not at all: the
    # list [(X1, X2), Y] trained on X1 as inputs and X2 as targets until the forward failed.
    ens = vmapens.Ensemble(TwoInputs, N, seed=0).double()
    optimizer = vmapens.StackedAdam(ens, lr=LRS)
    before = copy.deepcopy(ens.state_dict())
    groups = copy.deepcopy(
        [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    )
    rng = torch.get_rng_state()
    scheduler = lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)  # noqa: E731
    with pytest.raises(TypeError, match=match):
        vmapens.fit(ens, data, nn.MSELoss(), optimizer=optimizer, scheduler=scheduler,
                    epochs=1, progress=False, **extra)  # fmt: skip
    torch.testing.assert_close(ens.state_dict(), before, rtol=0, atol=0)
    assert [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups] == groups
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_loader_of_three_tensors_is_refused_naming_the_collate_fix():
    ens = vmapens.Ensemble(TwoInputs, N, seed=0).double()
    loader = DataLoader(TensorDataset(X1, X2, Y), batch_size=4)
    with pytest.raises(TypeError, match=r"got a list of 3 items; give the Dataset or the "
                       r"DataLoader's `collate_fn` \(\(x1, x2\), y\) pairs"):  # fmt: skip
        vmapens.fit(ens, loader, nn.MSELoss(), epochs=1, progress=False)


# -- per-member DataLoaders that shuffle from torch's RNG --------------------------------------


def test_per_member_shuffling_loaders_give_the_documented_orders():
    # docs/fit.md: each pass makes member 0's iterator and takes its first batch, then member
    # 1's, ...; the truth is that plain loop, one module alone per member on its batches.
    def loaders() -> list[DataLoader]:
        return [
            DataLoader(TensorDataset(XS1[i], XS2[i], YS[i]), batch_size=4, shuffle=True,
                       drop_last=True, collate_fn=lambda b: (
                           (torch.stack([r[0] for r in b]), torch.stack([r[1] for r in b])),
                           torch.stack([r[2] for r in b])))
            for i in range(N)
        ]  # fmt: skip

    ens = vmapens.Ensemble(TwoInputs, N, seed=0).double()
    torch.manual_seed(5)
    vmapens.fit(ens, loaders(), nn.MSELoss(), in_dims=0, epochs=2, lr=LRS, progress=False)
    torch.manual_seed(5)
    data, seen = loaders(), [[] for _ in range(N)]
    for _ in range(2):
        for i, loader in enumerate(data):
            it = iter(loader)
            seen[i] += [next(it), *it]  # no other draws: the rest of the pass is fixed
    plain = plain_members()
    for i, model in enumerate(plain):
        opt = torch.optim.Adam(model.parameters(), lr=LRS[i])
        for (x1, x2), y in seen[i]:
            opt.zero_grad()
            nn.functional.mse_loss(model(x1, x2), y).backward()
            opt.step()
    assert_members_equal(ens, plain)
    torch.manual_seed(5)  # zip(*loaders) draws in another order: the test tells them apart
    zipped = [batches[1] for batches in zip(*loaders(), strict=True)]
    assert not torch.equal(zipped[0][1], seen[1][0][1])


@pytest.mark.parametrize(
    ("name", "value"), [("bootstrap", "no"), ("shuffle", None), ("shuffle", 1)]
)
def test_shuffle_and_bootstrap_that_are_no_bools_are_refused_before_anything_changes(name, value):
    # `bootstrap="no"` bagged and `shuffle=None` stopped shuffling, without a word.
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 1), 2, seed=0)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    data = (torch.randn(8, 3), torch.randn(8, 1))
    rng = torch.get_rng_state()
    with pytest.raises(
        TypeError, match=rf"^fit: `{name}` must be a bool, got {type(value).__name__}"
    ):
        vmapens.fit(ens, data, nn.MSELoss(), progress=False, **{name: value})
    assert all(torch.equal(v, before[k]) for k, v in ens.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)
