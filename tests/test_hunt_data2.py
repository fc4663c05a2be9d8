"""fit's data handling, second hunt: truths written again from docs/fit.md ("Data, epochs and
steps", "Bagging") with plain torch generators; every expected member is a plain module
trained alone with ``torch.optim.SGD`` on the batches the docs say it sees, in float64.
"""

from __future__ import annotations

import copy

import pytest
import torch
from models import TwoInputs
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset
from truth import derived_seed, resample

import vmapens
from vmapens.callbacks import EarlyStopping

N, ROWS = 3, 10
F64 = dict(dtype=torch.float64)
G = torch.Generator().manual_seed(0)
X1, X2, Y = (torch.randn(ROWS, d, generator=G, **F64) for d in (3, 2, 2))
LRS = [0.05, 0.1, 0.2]
TOL = dict(rtol=1e-9, atol=1e-10)


def documented_order(rows: int, batch: int, seed: int, p: int) -> torch.Tensor:
    if batch >= rows:  # one batch of everything is never permuted
        return torch.arange(rows)
    g = torch.Generator().manual_seed(derived_seed(seed, "shuffle", p))
    return torch.randperm(rows, generator=g)


def plain_members(factory=TwoInputs, seed: int = 0) -> list[nn.Module]:
    """docs/semantics.md: member i is `torch.manual_seed(member_seed(seed, i)); factory()`."""
    out = []
    for i in range(N):
        torch.manual_seed(derived_seed(seed, "member", i))
        out.append(factory().double())
    return out


def sgd_alone(model: nn.Module, lr: float, batches, loss_fn) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for inputs, y in batches:
        opt.zero_grad()
        loss = loss_fn(model(*inputs), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def assert_members_equal(ens: vmapens.Ensemble, plain: list[nn.Module]) -> None:
    for i, model in enumerate(plain):
        got, want = ens[i].state_dict(), model.state_dict()
        for key in want:
            torch.testing.assert_close(got[key], want[key], **TOL, msg=f"member {i} {key}")


def sgd(ens: vmapens.Ensemble) -> vmapens.StackedSGD:
    return vmapens.StackedSGD(ens, lr=LRS)


# -- a list of inputs is spread into the forward, in training and in validation alike ----------


@pytest.mark.parametrize("validation", ["oob", "val_data"])
def test_a_list_of_inputs_is_validated_as_it_is_trained(validation):
    """`data=([x1, x2], y)` trains as forward(x1, x2) (a DataLoader collates tuples into lists);
    validation on a list of inputs used to call forward([x1, x2]): out-of-bag validation
    crashed after the first epoch had trained, `val_data` was refused."""
    seed, batch, epochs = 4, 4, 2
    extra = dict(bootstrap=True, val_data="oob") if validation == "oob" else {}
    if validation == "val_data":
        extra = dict(val_data=([X1[:5], X2[:5]], Y[:5]))
    ens = vmapens.Ensemble(TwoInputs, N, seed=0).double()
    h = vmapens.fit(ens, ([X1, X2], Y), nn.MSELoss(), epochs=epochs, batch_size=batch, seed=seed,
                    optimizer=sgd, callbacks=[EarlyStopping(restore_best=False)], progress=False,
                    **extra)  # fmt: skip
    plain = plain_members()
    for i, model in enumerate(plain):
        own = resample(ROWS, seed, i) if validation == "oob" else torch.arange(ROWS)
        left = torch.ones(ROWS, dtype=torch.bool)
        left[own] = False
        for epoch in range(epochs):
            order = documented_order(ROWS, batch, seed, epoch)
            rows = [own[order[k : k + batch]] for k in range(0, ROWS, batch)]
            batches = [((X1[r], X2[r]), Y[r]) for r in rows]
            losses = sgd_alone(model, LRS[i], batches, nn.functional.mse_loss)
            torch.testing.assert_close(h.train_loss[epoch, i], torch.stack(losses).mean(), **TOL)
            with torch.no_grad():
                if validation == "oob":
                    want = nn.functional.mse_loss(model(X1[left], X2[left]), Y[left])
                else:
                    want = nn.functional.mse_loss(model(X1[:5], X2[:5]), Y[:5])
            torch.testing.assert_close(h.val_loss[epoch, i], want, **TOL)
    assert_members_equal(ens, plain)  # plain SGD has no state: one optimizer per epoch is alike


# -- a refused run gives back the DataLoader's own generator ----------------------------------


def _fails(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("this loss fails on every batch")


@pytest.mark.parametrize("per_member", [False, True], ids=["one-loader", "loader-per-member"])
def test_a_run_refused_by_its_first_step_gives_the_loaders_generator_back(per_member):
    """docs/fit.md: a run refused before its first step is done gives back what it drew, so a
    second call starts as the first did. The first pass of a DataLoader with its own
    `generator=` draws its order from it: that draw was kept, and the next run saw another
    order than a plain loop over the loader from the generator's state."""
    g = torch.Generator().manual_seed(1)
    xs, ys = (
        torch.randn(N, ROWS, 3, generator=g, **F64),
        torch.randn(N, ROWS, 2, generator=g, **F64),
    )

    def loaders() -> list:
        gens = [torch.Generator().manual_seed(10 + i) for i in range(N if per_member else 1)]
        sets = [TensorDataset(xs[i], ys[i]) for i in range(len(gens))]
        return [DataLoader(d, batch_size=4, shuffle=True, generator=g) for d, g in zip(sets, gens, strict=True)]  # fmt: skip

    class One(nn.Module):  # one input: a DataLoader's batches are (x, y)
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.a(x))

    ens = vmapens.Ensemble(One, N, seed=0).double()
    given = loaders()
    data = given if per_member else given[0]
    extra = dict(in_dims=0) if per_member else {}
    with pytest.raises(RuntimeError, match="fails on every batch"):
        vmapens.fit(ens, data, _fails, optimizer=sgd, progress=False, **extra)
    vmapens.fit(ens, data, nn.MSELoss(), epochs=2, optimizer=sgd, progress=False, **extra)
    fresh = loaders()  # the same loaders, generators as they were before the refused run
    # Two passes of each loader, each pass one iterator, as a plain loop reads it.
    read = [[((x,), y) for _ in range(2) for x, y in loader] for loader in fresh]
    plain = plain_members(One)
    for i, model in enumerate(plain):
        sgd_alone(model, LRS[i], read[i if per_member else 0], nn.functional.mse_loss)
    assert_members_equal(ens, plain)


# -- loaders without a length, unbatched loaders, dicts of inputs: the batches a loop sees ------


class Chunks(IterableDataset):
    """An IterableDataset without `__len__`: 3 batches a pass, the last one short."""

    def __iter__(self):
        for k in range(0, ROWS, 4):
            yield (X1[k : k + 4], X2[k : k + 4]), Y[k : k + 4]


class Keyed(nn.Module):  # inputs as a dict of tensors
    def __init__(self) -> None:
        super().__init__()
        self.inner = TwoInputs()

    def forward(self, d: dict) -> torch.Tensor:
        return self.inner(d["x"], d["z"])


def _dict_batches(epochs: int, batch: int, seed: int) -> list:
    out = []
    for p in range(epochs):
        order = documented_order(ROWS, batch, seed, p)
        out += [order[k : k + batch] for k in range(0, ROWS, batch)]
    return [(({"x": X1[r], "z": X2[r]},), Y[r]) for r in out]


SOURCES = {
    # id: (factory, data, fit options, the batches a plain loop sees, in order)
    "iterable-dataset-steps-across-passes": (
        TwoInputs, DataLoader(Chunks(), batch_size=None), dict(epochs=2, steps=4),
        lambda: ([b for _ in range(3) for b in Chunks()])[:8],
    ),
    "unbatched-loader": (
        TwoInputs, DataLoader(TensorDataset(X1, X2, Y), batch_size=None,
                              collate_fn=lambda s: ((s[0], s[1]), s[2])),
        dict(epochs=1, steps=12), lambda: [((X1[k], X2[k]), Y[k]) for k in [*range(ROWS), 0, 1]],
    ),
    "dict-of-inputs-shuffled": (
        Keyed, ({"x": X1, "z": X2}, Y), dict(epochs=2, batch_size=4, seed=5),
        lambda: _dict_batches(2, 4, 5),
    ),
}  # fmt: skip


@pytest.mark.parametrize("source", list(SOURCES))
def test_fit_trains_on_the_batches_a_plain_loop_sees(source):
    factory, data, options, expected = SOURCES[source]
    ens = vmapens.Ensemble(factory, N, seed=0).double()
    vmapens.fit(ens, data, nn.MSELoss(), optimizer=sgd, progress=False, **options)
    plain = plain_members(factory)
    for i, model in enumerate(plain):
        sgd_alone(model, LRS[i], expected(), nn.functional.mse_loss)
    assert_members_equal(ens, plain)


# -- targets in a dict: refused as (X, Y) tensors with the fix named; the fix trains right ------


def _two_targets(out: torch.Tensor, y: dict) -> torch.Tensor:
    return nn.functional.mse_loss(out[:, :1], y["a"]) + nn.functional.mse_loss(out[:, 1:], y["b"])


def test_targets_in_a_dict_train_as_tensor_data_and_as_batches():
    """(X, {"a": Ya, "b": Yb}) was refused as tensor data (session 27: targets in a tree are
    cut by the same rows); a list of (inputs, targets) batches trains as a plain loop over it,
    and the tensor form equals it (batch_size 4, no shuffling: the same batches, 4, 4 and 2 rows)."""
    ya, yb = Y[:, :1], Y[:, 1:]
    ens = vmapens.Ensemble(TwoInputs, N, seed=0).double()
    as_tensors = copy.deepcopy(ens)
    vmapens.fit(as_tensors, ((X1, X2), {"a": ya, "b": yb}), _two_targets, batch_size=4,
                epochs=2, shuffle=False, optimizer=sgd, progress=False)  # fmt: skip
    batches = [((X1[k : k + 4], X2[k : k + 4]), {"a": ya[k : k + 4], "b": yb[k : k + 4]})
               for k in range(0, ROWS, 4)]  # fmt: skip
    vmapens.fit(ens, batches, _two_targets, epochs=2, optimizer=sgd, progress=False)
    plain = plain_members()
    for i, model in enumerate(plain):
        sgd_alone(model, LRS[i], batches * 2, _two_targets)
    assert_members_equal(ens, plain)
    assert_members_equal(as_tensors, plain)
