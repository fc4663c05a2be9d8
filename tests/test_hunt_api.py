"""The smaller user-facing modules against plain torch: per_member, predict, rl, History, fit's
data layer.

Each expected value is plain torch: a loss applied to each member's slice alone, the members
run one by one as plain modules, `Tensor.lerp_` per parameter, a module trained alone with
`torch.optim.Adam` on the batches a plain loop over the DataLoader gives.
"""

from __future__ import annotations

import copy
import dataclasses
import io

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset
from truth import TOL64, adam, assert_members_equal, batch_plan, resample, train_alone

import vmapens
from vmapens import predict
from vmapens.history import History
from vmapens.rl import make_target, polyak_

F64 = dict(dtype=torch.float64)
G = torch.Generator().manual_seed(0)
N = 3
X, Y = torch.randn(12, 3, generator=G, **F64), torch.randn(12, 1, generator=G, **F64)


# -- per_member: losses vmap cannot batch run member by member -------------------------------------


def gaussian_nll(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # nn.GaussianNLLLoss checks `if torch.any(var < 0)`: a Python branch on tensor values.
    return nn.GaussianNLLLoss()(out[:, :1], y, out[:, 1:].exp())


def masked_mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    keep = y[:, 0] > 0  # a boolean mask as an index: a shape that depends on the values
    return (out[keep] - y[keep]).pow(2).mean()


LOSSES = [
    ("gaussian-nll-shared", gaussian_nll, (0, None), (N, 12, 2), (12, 1)),
    ("gaussian-nll-per-member", gaussian_nll, (0, 0), (N, 12, 2), (N, 12, 1)),
    ("item", lambda o, y: (o - y).pow(2).mean() * float(y.abs().max().item()), 0, (N, 5, 1), (N, 5, 1)),
    ("boolean-mask-per-member", masked_mse, (0, 0), (N, 12, 1), (N, 12, 1)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("loss_fn", "in_dims", "out_shape", "y_shape"),
    [case[1:] for case in LOSSES],
    ids=[case[0] for case in LOSSES],
)
def test_per_member_of_a_loss_that_reads_values_equals_each_member_alone(
    loss_fn, in_dims, out_shape, y_shape
):
    out = torch.randn(out_shape, generator=G, **F64).requires_grad_()
    y = torch.randn(y_shape, generator=G, **F64)
    got = vmapens.per_member(loss_fn, in_dims=in_dims)(out, y)
    (grad,) = torch.autograd.grad(got.sum(), out)
    mapped_y = in_dims == 0 or in_dims[1] == 0
    for i in range(N):
        alone = out[i].detach().clone().requires_grad_()
        value = loss_fn(alone, y[i] if mapped_y else y)
        (want,) = torch.autograd.grad(value, alone)
        torch.testing.assert_close(got[i], value, **TOL64)
        torch.testing.assert_close(grad[i], want, **TOL64)


def test_per_member_leaves_other_errors_alone():
    calls = []

    def matmul_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return (out @ y).sum()  # [4, 2] @ [5, 3]: fails for one member alone too

    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        vmapens.per_member(matmul_loss)(torch.zeros(N, 4, 2), torch.zeros(5, 3))
    assert len(calls) == 1, "no member-by-member retry for an ordinary error"


# -- predict -------------------------------------------------------------------------------------


class Shifted(nn.Module):
    """Adds a second input that broadcasts over the samples ([1, 1]), as plain torch allows."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + shift


def alone(ens: vmapens.Ensemble, *inputs: torch.Tensor) -> list:
    outs = []
    for m in ens.unstack():
        with torch.no_grad():
            outs.append(m.eval()(*inputs))
    return outs


def test_predict_in_one_batch_passes_inputs_as_given():
    ens = vmapens.Ensemble(Shifted, n=N, seed=0).double()
    shift = torch.ones(1, 1, **F64)
    want = torch.stack(alone(ens, X, shift))
    torch.testing.assert_close(predict(ens, (X, shift)), want, **TOL64)


def test_predict_in_batches_refuses_inputs_of_other_sample_counts():
    ens = vmapens.Ensemble(Shifted, n=N, seed=0).double()
    with pytest.raises(ValueError, match=r"predict: `batch_size` cuts every input.*\(1, 1\)"):
        predict(ens, (X, torch.ones(1, 1, **F64)), batch_size=5)


def test_predict_of_no_samples_is_empty_as_alone():
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 2), n=N, seed=0).double()
    want = torch.stack(alone(ens, X[:0]))
    for batch_size in (None, 4):
        got = predict(ens, X[:0], batch_size=batch_size)
        assert got.shape == want.shape == (N, 0, 2)


def test_predict_of_a_scalar_output_in_one_batch():
    class Sum(nn.Module):  # one value per member, no samples dim
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).sum()

    ens = vmapens.Ensemble(Sum, n=N, seed=0).double()
    want = torch.stack(alone(ens, X))
    torch.testing.assert_close(predict(ens, X), want, **TOL64)
    torch.testing.assert_close(predict(ens, X, reduce="mean"), want.mean(0), **TOL64)


def test_predict_in_batches_refuses_outputs_whose_samples_are_not_first():
    # nn.GRU's final state is [layers, samples, hidden]: joining batches along dim 1 of the
    # stacked output would lay them along the layers: torch.cat made [2, 6, 2, 4] of two
    # batches' [2, 3, 2, 4], silently.
    ens = vmapens.Ensemble(lambda: nn.GRU(3, 4, num_layers=3, batch_first=True), n=2, seed=0)
    x = torch.randn(4, 5, 3, generator=G)
    with pytest.raises(ValueError, match=r"predict: the batches' outputs are joined"):
        predict(ens, x, batch_size=2)
    out, h = predict(ens, x)  # one batch: every output as the members give it
    for i, (o, hn) in enumerate(alone(ens, x)):
        torch.testing.assert_close(out[i], o)
        torch.testing.assert_close(h[i], hn)


def test_predict_per_member_inputs_with_a_negative_member_dim():
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 2), n=N, seed=0).double()
    xs = torch.randn(N, 7, 3, generator=G, **F64)  # member dim -3 == 0
    want = torch.stack([m.eval()(xs[i]) for i, m in enumerate(ens.unstack())]).detach()
    torch.testing.assert_close(predict(ens, xs, in_dims=-3, batch_size=2), want, **TOL64)


def test_predict_refuses_a_dict_before_iterating_its_keys():
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 2), n=N, seed=0).double()
    with pytest.raises(TypeError, match=r"predict: `data` is a dict.*\[data\]"):
        predict(ens, {"x": X})


# -- rl ------------------------------------------------------------------------------------------


class WithComplex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2).double()
        self.phase = nn.Parameter(torch.randn(2, dtype=torch.complex128))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) * self.phase).real


@pytest.mark.parametrize(
    "tau",
    [0.3, torch.tensor(0.3), np.float32(0.25)],
    ids=["float", "0-dim-tensor", "numpy-float32"],
)
def test_polyak_moves_every_parameter_as_lerp_does_complex_too(tau):
    online = vmapens.Ensemble(WithComplex, n=N, seed=0)
    target = make_target(online)
    with torch.no_grad():
        for t in online.stacked_params().values():
            t.add_(torch.randn(t.shape, generator=G, dtype=t.dtype))
    plain = [copy.deepcopy(m) for m in target.unstack()]
    for p, o in zip(plain, online.unstack(), strict=True):
        with torch.no_grad():
            for a, b in zip(p.parameters(), o.parameters(), strict=True):
                a.lerp_(b, float(tau))
    polyak_(target, online, tau)
    assert_members_equal(target, plain, rtol=0, atol=1e-15)


# -- History -------------------------------------------------------------------------------------


def recorded_history() -> History:
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 1), n=N, seed=0).double()
    return vmapens.fit(
        ens, (X, Y), nn.MSELoss(), epochs=2, val_data=(X, Y), progress=False, seed=0,
        metrics={"mae": lambda o, y: (o - y).abs().mean()},
    )  # fmt: skip


BAD_STATES = [
    ("member-ids-short", lambda s: s.update(member_ids=[0]), "member_ids"),
    ("member-ids-str", lambda s: s.update(member_ids="abc"), "member_ids"),
    ("val-rows", lambda s: s.update(val_loss=s["val_loss"][:1]), "val_loss"),
    ("metric-rows", lambda s: s.update(
        metrics={"mae": s["metrics"]["mae"][:1]},
        ensemble_metrics={"mae": s["ensemble_metrics"]["mae"][:1]}), "mae"),
    ("best-float", lambda s: s.update(best_epoch=s["best_epoch"].double()), "best_epoch"),
    ("diverged-int", lambda s: s.update(diverged=s["diverged"].long()), "diverged"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("mutate", "key"), [b[1:] for b in BAD_STATES], ids=[b[0] for b in BAD_STATES]
)
def test_history_refuses_an_inconsistent_state_and_keeps_its_own(mutate, key):
    h = recorded_history()
    before = h.state_dict()
    state = h.state_dict()
    mutate(state)
    with pytest.raises(ValueError, match=rf"History.load_state_dict: .*`?{key}"):
        h.load_state_dict(state)
    assert h.member_ids == before["member_ids"]
    torch.testing.assert_close(h.train_loss, before["train_loss"], rtol=0, atol=0, equal_nan=True)
    assert h.val_loss is not None and h.val_loss.shape == before["val_loss"].shape


def test_history_round_trip_through_torch_save_owns_its_lists():
    h = recorded_history()
    buf = io.BytesIO()
    torch.save(h.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    loaded = History.empty([0, 1, 2], validated=True, metrics=["mae"])
    loaded.load_state_dict(state)
    state["member_ids"].append(7)  # the loaded history is not a view of the state
    assert loaded.member_ids == [0, 1, 2]
    for name in ("train_loss", "val_loss", "best_epoch", "stopped_epoch", "diverged"):
        torch.testing.assert_close(getattr(loaded, name), getattr(h, name), rtol=0, atol=0)
    torch.testing.assert_close(loaded.metrics, h.metrics, rtol=0, atol=0)


def test_a_gathered_history_without_ensemble_metrics_plots_saves_and_restores(tmp_path):
    # vmapens.sharding.gather_history returns per-member metrics with ensemble_metrics=None
    # (each rank scored only its own block): plot raised KeyError, restore refused the file.
    pytest.importorskip("matplotlib")
    h = recorded_history()
    gathered = dataclasses.replace(h, ensemble_metrics=None)
    gathered.plot(tmp_path / "h.png")
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 1), n=N, seed=0).double()
    vmapens.save(ens, tmp_path / "ck.pt", history=gathered)
    loaded = History.empty([0, 1, 2], validated=True, metrics=["mae"])
    vmapens.checkpoint.restore(tmp_path / "ck.pt", ens, history=loaded)
    assert loaded.ensemble_metrics is None
    torch.testing.assert_close(loaded.metrics, h.metrics, rtol=0, atol=0)


# -- fit's data layer ----------------------------------------------------------------------------


class Stream(IterableDataset):
    """An iterable dataset without __len__: its DataLoader's len() raises TypeError."""

    def __iter__(self):
        return iter(zip(X, Y, strict=True))


@pytest.mark.parametrize("steps", [None, 3], ids=["epochs", "steps"])
def test_fit_on_a_dataloader_over_an_iterable_dataset_equals_training_alone(steps):
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 1), n=N, seed=0).double()
    plain = [copy.deepcopy(m) for m in ens.unstack()]
    loader = DataLoader(Stream(), batch_size=5)
    vmapens.fit(ens, loader, nn.MSELoss(), epochs=2, steps=steps, lr=1e-2, progress=False)
    batches = list(loader)  # 5, 5, 2 rows
    if steps is not None:  # 3 steps an epoch, cycling: the same 3 batches each epoch
        batches = batches[:steps]
    for m in plain:
        train_alone(m, batches * 2, nn.functional.mse_loss, adam(1e-2))
    assert_members_equal(ens, plain)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ([(X, ["a"] * 12)], r"fit: each batch of `data` must hold tensors.*str in its targets"),
        (
            [({"x": X, "k": 3}, Y)],
            r"fit: each batch of `data` must hold tensors.*int in its inputs",
        ),
        (
            (X.numpy(), Y.numpy()),
            r"fit: `data` as a tuple holds batches.*`data\[0\]` is ndarray .*torch.as_tensor",
        ),
    ],
    ids=["strings", "int-in-dict", "numpy-arrays"],
)
def test_fit_refuses_batches_of_non_tensors_by_name_before_a_step(data, match):
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 1), n=N, seed=0).double()
    before = copy.deepcopy(ens.state_dict())
    with pytest.raises(TypeError, match=match):
        vmapens.fit(ens, data, nn.MSELoss(), epochs=1, progress=False)
    for k, v in ens.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


def test_fit_refuses_tensor_data_without_a_samples_dim():
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 1), n=N, seed=0).double()
    with pytest.raises(ValueError, match=r"fit: every tensor in `data` needs its samples"):
        vmapens.fit(ens, (torch.tensor(1.0, **F64), Y), nn.MSELoss(), epochs=1, progress=False)


class MeanAndVariance(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.lin(x)
        return out[:, :1], out[:, 1:].exp()


def gaussian_pair_nll(out: tuple, y: torch.Tensor) -> torch.Tensor:
    return nn.GaussianNLLLoss()(out[0], y, out[1])


def test_fit_with_a_gaussian_nll_loss_validates_each_member_as_alone():
    # The step's error for this loss says to use backend='loop'; validation ran the loss under
    # vmap whatever the backend, and refused val_data.
    ens = vmapens.Ensemble(MeanAndVariance, n=N, seed=0, backend="loop").double()
    plain = [copy.deepcopy(m) for m in ens.unstack()]
    xv, yv = X[:5] + 1, Y[:5]
    history = vmapens.fit(
        ens, (X, Y), gaussian_pair_nll, epochs=2, lr=1e-2, val_data=(xv, yv), progress=False
    )
    for i, m in enumerate(plain):
        losses = []
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        for _ in range(2):
            train_alone(m, [(X, Y)], gaussian_pair_nll, opt)
            with torch.no_grad():
                losses.append(gaussian_pair_nll(m(xv), yv))
        torch.testing.assert_close(history.val_loss[:, i], torch.stack(losses), **TOL64)
    assert_members_equal(ens, plain)


def test_bagged_per_member_data_is_each_members_own_resample_as_documented():
    # docs/fit.md "Bagging": member i's rows are drawn from (seed, i); with in_dims=0 they index
    # member i's own slice, and each pass is shuffled from (seed, pass) like shared data.
    xs = torch.randn(N, 12, 3, generator=G, **F64)
    ys = torch.randn(N, 12, 1, generator=G, **F64)
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 1), n=N, seed=0).double()
    plain = [copy.deepcopy(m) for m in ens.unstack()]
    vmapens.fit(ens, (xs, ys), nn.MSELoss(), in_dims=0, bootstrap=True, epochs=2,
                batch_size=5, lr=1e-2, seed=3, progress=False)  # fmt: skip
    plan = batch_plan(12, 5, 6, seed=3)  # 3 batches a pass, 2 passes
    for i, m in enumerate(plain):
        own = resample(12, 3, i)
        train_alone(m, [(xs[i, own[idx]], ys[i, own[idx]]) for idx in plan],
                    nn.functional.mse_loss, adam(1e-2))  # fmt: skip
    assert_members_equal(ens, plain)
