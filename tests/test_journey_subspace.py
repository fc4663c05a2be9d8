"""User journey: random-subspace ensembles (each member sees its own subset of the features).

A researcher's script, four ways one writes the random subspace method: per-member column
indices passed with `in_dims=(None, 0)` (`x[:, idx]`, `x.index_select(1, idx)`) in a
hand-written loop; an index buffer each member holds (set after building through
`ens.stacked_buffers()`, or by factories with their own indices) trained with `fit`
(per-member learning rates, early stopping with best restore), averaged with `predict` and
saved as member files that a plain module with its own subset loads; each member's columns cut
outside (`torch.stack([x[:, i] for i in idx])`) into `make_step`/`fit` with `in_dims=0`; and
members of different subset sizes (`Ensemble.from_factories`, `nn.Linear(k_i, h)`) with their
own standardisation buffers (docs/semantics.md, "Members of different sizes").

The truth: each member a plain module built after `torch.manual_seed(member seed)` (tests/truth.py),
trained alone with `torch.optim.Adam` on its own columns and the same batches. float64.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from truth import factory_members

import vmapens
from vmapens.callbacks import EarlyStopping

TOL = dict(rtol=1e-10, atol=1e-12)
N, FEAT, K, H, S, B = 4, 7, 3, 5, 16, 8
LRS = [1e-2, 2e-2, 5e-2, 1e-1]

_g = torch.Generator().manual_seed(0)
IDX = torch.stack([torch.randperm(FEAT, generator=_g)[:K] for _ in range(N)])  # [N, K]
X = torch.randn(S, FEAT, generator=_g, dtype=torch.float64) * 2 + 1
Y = X[:, :2].sum(1, keepdim=True) + 0.1 * torch.randn(S, 1, generator=_g, dtype=torch.float64)
XV = torch.randn(B, FEAT, generator=_g, dtype=torch.float64) * 2 + 1
YV = XV[:, :2].sum(1, keepdim=True)
KS = (2, 3, 4, 6)  # subset sizes for members of different sizes
SUBSETS = [torch.randperm(FEAT, generator=_g)[:k] for k in KS]


@pytest.fixture(autouse=True)
def _float64() -> object:
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


class ByArgument(nn.Module):
    """The columns come in as an argument."""

    def __init__(self, select: str = "index") -> None:
        super().__init__()
        self.select = select
        self.fc, self.out = nn.Linear(K, H), nn.Linear(H, 1)

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        cols = x[:, idx] if self.select == "index" else x.index_select(1, idx)
        return self.out(torch.tanh(self.fc(cols)))


class ByBuffer(nn.Module):
    """The member's columns and their standardisation (mean, 1/std) are buffers."""

    def __init__(self, idx: torch.Tensor | None = None) -> None:
        super().__init__()
        idx = torch.arange(K) if idx is None else idx
        self.register_buffer("idx", idx.clone())
        self.register_buffer("mean", X[:, idx].mean(0))
        self.register_buffer("inv_std", 1 / X[:, idx].std(0))
        self.fc, self.out = nn.Linear(len(idx), H), nn.Linear(H, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = (x.index_select(1, self.idx) - self.mean) * self.inv_std
        return self.out(torch.tanh(self.fc(z)))


class ByStd(ByBuffer):
    """Standardised by dividing by a `std` buffer, as one usually writes it."""

    def __init__(self, idx: torch.Tensor) -> None:
        super().__init__(idx)
        self.register_buffer("std", X[:, idx].std(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = (x.index_select(1, self.idx) - self.mean) / self.std
        return self.out(torch.tanh(self.fc(z)))


class Plain(nn.Module):
    def __init__(self, k: int = K) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(k, H), nn.Linear(H, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.fc(x)))


def assert_member(state: dict[str, torch.Tensor], model: nn.Module, where: str) -> None:
    truth = model.state_dict()
    assert sorted(state) == sorted(truth), where
    for key, value in truth.items():
        torch.testing.assert_close(state[key], value, **TOL, msg=f"{where}: {key}")


def train_alone(model: nn.Module, lr: float, batches: list, call=None) -> None:  # type: ignore[no-untyped-def]
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for x, y in batches:
        opt.zero_grad()
        F.mse_loss(call(model, x) if call else model(x), y).backward()
        opt.step()


@pytest.mark.parametrize("select", ["index", "index_select"])
def test_column_indices_through_in_dims_train_in_a_hand_written_loop_as_alone(select: str) -> None:
    ens = vmapens.Ensemble(functools.partial(ByArgument, select), n=N, seed=0)
    alone = factory_members([functools.partial(ByArgument, select)] * N)
    opt = vmapens.StackedAdam(ens, lr=torch.tensor(LRS))
    batches = [(X[k : k + B], Y[k : k + B]) for k in range(0, S, B)] * 2
    for x, y in batches:
        loss = vmapens.per_member(nn.MSELoss())(ens(x, IDX, in_dims=(None, 0)), y)
        opt.zero_grad()
        loss.sum().backward()
        opt.step()
    for i, model in enumerate(alone):
        train_alone(model, LRS[i], batches, lambda m, x, i=i: m(x, IDX[i]))
        assert_member(ens.state_dicts()[i], model, f"member {i}")
    # make_step and fit map all of a batch's inputs or none: a per-argument in_dims is refused
    with pytest.raises(ValueError, match=r"make_step: `in_dims` must be None or 0"):
        vmapens.make_step(ens, nn.MSELoss(), opt, in_dims=(None, 0))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"fit: `in_dims` must be None, 0 or a pair"):
        vmapens.fit(ens, ((X, IDX), Y), nn.MSELoss(), in_dims=((None, 0), None), progress=False)  # type: ignore[arg-type]


def test_index_buffers_set_after_building_fit_early_stop_predict_and_member_files(
    tmp_path: Path,
) -> None:
    ens = vmapens.Ensemble(ByBuffer, n=N, seed=0)
    buffers = ens.stacked_buffers()
    for name, value in (
        ("idx", IDX),
        ("mean", torch.stack([X[:, i].mean(0) for i in IDX])),
        ("inv_std", torch.stack([1 / X[:, i].std(0) for i in IDX])),
    ):
        buffers[name].copy_(value)
    alone = factory_members([ByBuffer] * N)
    for i, model in enumerate(alone):  # the same init, its own subset
        for name, value in ByBuffer(IDX[i]).named_buffers():
            getattr(model, name).copy_(value)
    epochs, patience = 6, 1
    history = vmapens.fit(
        ens, (X, Y), nn.MSELoss(), optimizer=vmapens.StackedAdam(ens, lr=torch.tensor(LRS)),
        epochs=epochs, batch_size=B, shuffle=False, val_data=(XV, YV),
        callbacks=[EarlyStopping(patience=patience)], progress=False, seed=0,
    )  # fmt: skip
    stopped_any = False
    for i, model in enumerate(alone):
        opt = torch.optim.Adam(model.parameters(), lr=LRS[i])
        best, bad, state = float("inf"), 0, None
        for _ in range(epochs):
            for k in range(0, S, B):
                opt.zero_grad()
                F.mse_loss(model(X[k : k + B]), Y[k : k + B]).backward()
                opt.step()
            with torch.no_grad():
                val = F.mse_loss(model(XV), YV).item()
            if val < best:
                best, bad, state = val, 0, {k: v.clone() for k, v in model.state_dict().items()}
            else:
                bad += 1
                if bad >= patience:
                    stopped_any = True
                    break
        model.load_state_dict(state)
        assert_member(ens.state_dicts()[i], model, f"member {i}")
    assert stopped_any and history.val_loss.shape[1] == N
    mean = vmapens.predict(ens, XV, reduce="mean")
    torch.testing.assert_close(mean, torch.stack([m(XV) for m in alone]).mean(0), **TOL)
    for i, path in enumerate(vmapens.save_members(ens, tmp_path)):
        plain = ByBuffer(IDX[i])  # the user's class with the member's own subset
        plain.load_state_dict(torch.load(path))
        torch.testing.assert_close(plain(XV), alone[i](XV), **TOL)


def test_factories_with_their_own_masks_and_columns_cut_outside_into_make_step_and_fit() -> None:
    mask = torch.zeros(N, FEAT).scatter_(1, IDX, 1.0)

    class Masked(nn.Module):
        def __init__(self, m: torch.Tensor) -> None:
            super().__init__()
            self.register_buffer("mask", m.clone())
            self.fc, self.out = nn.Linear(FEAT, H), nn.Linear(H, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(torch.tanh(self.fc(x * self.mask)))

    factories = [functools.partial(Masked, mask[i]) for i in range(N)]
    masked = vmapens.Ensemble.from_factories(factories, seed=0)
    cut = vmapens.Ensemble(Plain, n=N, seed=0)
    xs = torch.stack([X[:, i] for i in IDX])  # [N, S, K]: member i's columns
    ys = Y.expand(N, S, 1).clone()
    step = vmapens.make_step(
        masked, nn.MSELoss(), vmapens.StackedAdam(masked, lr=torch.tensor(LRS))
    )
    for k in range(0, S, B):
        step(X[k : k + B], Y[k : k + B])
    vmapens.fit(cut, (xs, ys), nn.MSELoss(), optimizer=vmapens.StackedAdam(cut, lr=torch.tensor(LRS)),
                in_dims=0, batch_size=B, shuffle=False, progress=False, seed=0)  # fmt: skip
    batches = [(X[k : k + B], Y[k : k + B]) for k in range(0, S, B)]
    for i, (m_alone, c_alone) in enumerate(
        zip(factory_members(factories), factory_members([Plain] * N))
    ):
        train_alone(m_alone, LRS[i], batches)
        train_alone(c_alone, LRS[i], [(x[:, IDX[i]], y) for x, y in batches])
        assert_member(masked.state_dicts()[i], m_alone, f"masked member {i}")
        assert_member(cut.state_dicts()[i], c_alone, f"cut member {i}")
        assert torch.equal(masked[i].mask, mask[i])


def test_subsets_of_different_sizes_with_index_buffers_train_as_alone(tmp_path: Path) -> None:
    factories = [functools.partial(ByBuffer, s) for s in SUBSETS]
    ens = vmapens.Ensemble.from_factories(factories, seed=0)
    vmapens.fit(ens, (X, Y), nn.MSELoss(), optimizer=vmapens.StackedAdam(ens, lr=torch.tensor(LRS)),
                epochs=2, batch_size=B, shuffle=False, progress=False, seed=0)  # fmt: skip
    alone = factory_members(factories)
    for i, model in enumerate(alone):
        train_alone(model, LRS[i], [(X[k : k + B], Y[k : k + B]) for k in range(0, S, B)] * 2)
        assert_member(ens.state_dicts()[i], model, f"member {i}")
    out = vmapens.predict(ens, XV)
    for i, path in enumerate(vmapens.save_members(ens, tmp_path)):
        plain = ByBuffer(SUBSETS[i])
        plain.load_state_dict(torch.load(path))
        torch.testing.assert_close(out[i], plain(XV), **TOL)
        assert plain.idx.shape == (KS[i],)


def test_a_std_buffer_padded_with_zeros_divides_by_them_and_training_is_refused() -> None:
    ens = vmapens.Ensemble.from_factories([functools.partial(ByStd, s) for s in SUBSETS], seed=0)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    with pytest.raises(
        RuntimeError, match=r"member 0 of ByStd computes something else inside the padded"
    ):
        vmapens.fit(ens, (X, Y), nn.MSELoss(), batch_size=B, progress=False, seed=0)
    for key, value in ens.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0, equal_nan=True)
    # unchecked, as documented: a plain call gives NaN for every member smaller than the largest
    assert ens(X)[:-1].isnan().all() and not ens(X)[-1].isnan().any()


def padded_inputs() -> tuple[vmapens.Ensemble, torch.Tensor, torch.Tensor]:
    ens = vmapens.Ensemble.from_factories([functools.partial(Plain, k) for k in KS], seed=0)
    xs = torch.zeros(N, S, max(KS))
    for i, s in enumerate(SUBSETS):
        xs[i, :, : len(s)] = X[:, s]
    return ens, xs, Y.expand(N, S, 1).clone()


def test_inputs_padded_to_the_widest_member_are_refused_and_run_exactly_unchecked() -> None:
    ens, xs, ys = padded_inputs()
    alone = factory_members([functools.partial(Plain, k) for k in KS])
    with pytest.raises(RuntimeError, match=r"member 0 of Plain fails alone on this batch"):
        vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-2), in_dims=0)(xs, ys)
    step = vmapens.make_step(
        ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-2), in_dims=0, check=False
    )
    for _ in range(2):
        step(xs, ys)
    for i, model in enumerate(alone):
        train_alone(model, 1e-2, [(X[:, SUBSETS[i]], Y)] * 2)
        assert_member(ens.state_dicts()[i], model, f"member {i}")


def test_the_refusal_of_a_padded_input_says_what_to_do() -> None:
    ens, xs, ys = padded_inputs()
    with pytest.raises(RuntimeError) as caught:
        vmapens.fit(ens, (xs, ys), nn.MSELoss(), in_dims=0, batch_size=B, progress=False, seed=0)
    assert "different sizes" in str(caught.value)
