"""The container against plain torch: per-member state dicts carry `_metadata`, a sparse-gradient
layer is refused by the forward before anything runs, and an unbatchable loss is named.

Truth comes from plain modules: `module.state_dict()` / `load_state_dict`, members run alone,
members trained alone with `torch.optim.Adam`.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import vmapens

TOL64 = dict(rtol=1e-9, atol=1e-10)


# -- state_dicts carry each submodule's `_version` ---------------------------------------------


class Versioned(nn.Module):
    """A module at version 2 whose version 1 stored the log of `scale`: an older state dict
    is migrated on load, as torch's own versioned modules (BatchNorm) do."""

    _version = 2

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.rand(3, dtype=torch.float64) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale

    def _load_from_state_dict(
        self, state_dict: dict, prefix: str, local_metadata: dict, *args: Any
    ) -> None:
        version = local_metadata.get("version")
        key = prefix + "scale"
        if (version is None or version < 2) and key in state_dict:
            state_dict[key] = state_dict[key].exp()  # version 1: the log of the scale
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)


def _versioned_net() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), Versioned()).double()


def test_state_dicts_load_into_a_versioned_module_as_the_member() -> None:
    ens = vmapens.Ensemble(_versioned_net, n=3, seed=0)
    for i, sd in enumerate(ens.state_dicts()):
        member = ens[i]
        own = member.state_dict()  # plain torch: what the member alone hands out
        assert sd._metadata == own._metadata  # type: ignore[attr-defined]
        assert list(sd) == list(own)
        fresh = _versioned_net()
        fresh.load_state_dict(sd)
        truth = _versioned_net()
        truth.load_state_dict(own)
        for (k, got), (_, want) in zip(
            fresh.state_dict().items(), truth.state_dict().items(), strict=True
        ):
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=k)
        torch.testing.assert_close(fresh[2].scale, member[2].scale, rtol=0, atol=0)
    # each member's metadata is its own: editing one leaves the others as they were
    a, b = ens.state_dicts()[:2]
    a._metadata["2"]["version"] = 1  # type: ignore[attr-defined]
    assert b._metadata["2"]["version"] == 2  # type: ignore[attr-defined]


# -- a sparse-gradient layer called on the ensemble ---------------------------------------------


def _embedded() -> nn.Module:
    return nn.Sequential(nn.Embedding(10, 3, sparse=True), nn.BatchNorm1d(3)).double()


def _bagged() -> nn.Module:
    return nn.Sequential(nn.EmbeddingBag(10, 3, sparse=True), nn.BatchNorm1d(3)).double()


def _state(ens: vmapens.Ensemble) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in ens.stacked_state().items()}


@pytest.mark.parametrize(
    ("factory", "idx", "layer"),
    [
        (_embedded, torch.tensor([1, 2, 7]), "Embedding"),
        (_bagged, torch.tensor([[1, 2], [7, 7], [0, 9]]), "EmbeddingBag"),
    ],
    ids=["embedding", "bag"],
)
@pytest.mark.parametrize("backend", ["vmap", "loop"])
def test_a_sparse_embedding_is_refused_by_the_forward_before_anything_runs(
    backend: str, factory: Any, idx: torch.Tensor, layer: str
) -> None:
    ens = vmapens.Ensemble(factory, n=3, seed=0, backend=backend)
    alone = [ens[i] for i in range(3)]
    before = _state(ens)
    with pytest.raises(ValueError, match=rf"^Ensemble: `0` \({layer}\) is built with sparse=True"):
        ens(idx)
    with pytest.raises(ValueError, match=r"sparse=False.*torch\.no_grad\(\)"):
        ens.select([0, 2])(idx)
    for k, v in _state(ens).items():  # the BatchNorm statistics did not move
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, msg=k)
    with torch.no_grad():  # no backward can follow: runs, as every member alone does
        out = ens(idx)
        want = torch.stack([m(idx) for m in alone])
    torch.testing.assert_close(out, want, **TOL64)
    for k, v in ens.stacked_buffers().items():
        torch.testing.assert_close(v, torch.stack([m.state_dict()[k] for m in alone]), **TOL64)


@pytest.mark.parametrize("backend", ["vmap", "loop"])
def test_the_sparse_flag_is_read_where_the_user_sets_it(backend: str) -> None:
    idx = torch.tensor([3, 3, 5])
    ens = vmapens.Ensemble(_embedded, n=2, seed=1, backend=backend)
    ens.template[0].sparse = False  # the way out the message gives
    alone = [ens[i] for i in range(2)]
    assert alone[0][0].sparse is False
    ens(idx).pow(2).sum().backward()
    for i, m in enumerate(alone):
        m(idx).pow(2).sum().backward()
        assert m[0].weight.grad is not None and not m[0].weight.grad.is_sparse
        torch.testing.assert_close(ens.stacked_params()["0.weight"].grad[i], m[0].weight.grad)
    ens.template[0].sparse = True  # and back: refused again
    with pytest.raises(ValueError, match=r"`0` \(Embedding\) is built with sparse=True"):
        ens(idx)
    ens.stacked_params()["0.weight"].requires_grad_(False)  # a frozen table: no gradient
    ens(idx).sum().backward()


# -- a loss that vmap cannot batch --------------------------------------------------------------


class Gaussian(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        o = self.l(x)
        return o[:, :1], o[:, 1:].exp()


def _nll(o: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    return nn.GaussianNLLLoss()(o[0], y, o[1])  # checks its variances by value: branches


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 3, generator=g, dtype=torch.float64), torch.randn(
        8, 1, generator=g, dtype=torch.float64
    )


@pytest.mark.parametrize("check", [True, False])
def test_an_unbatchable_loss_is_named_with_the_way_out(check: bool) -> None:
    ens = vmapens.Ensemble(lambda: Gaussian().double(), n=2, seed=0)
    before = _state(ens)
    with pytest.raises(
        RuntimeError, match=r"^step: `loss_fn` or the forward of Gaussian cannot"
    ) as e:
        vmapens.fit(ens, _data(), _nll, epochs=1, progress=False, check=check)
    assert "backend='loop'" in str(e.value) and "branches on values" in str(e.value)
    for k, v in _state(ens).items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, msg=k)


def test_a_forward_alone_that_cannot_be_batched_names_only_the_forward() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.l(x)
            return y if y.sum() > 0 else -y

    ens = vmapens.Ensemble(Branchy, n=2, seed=0)
    with pytest.raises(RuntimeError, match=r"^Ensemble: the forward of Branchy cannot") as e:
        ens(torch.randn(4, 3))
    assert "loss_fn" not in str(e.value)


def test_an_unbatchable_loss_trains_with_the_loop_backend_as_the_members_alone() -> None:
    ens = vmapens.Ensemble(lambda: Gaussian().double(), n=3, seed=0, backend="loop")
    alone = [copy.deepcopy(ens[i]) for i in range(3)]
    x, y = _data()
    steps = 3
    vmapens.fit(
        ens,
        (x, y),
        _nll,
        epochs=steps,
        shuffle=False,
        optimizer=lambda e: vmapens.StackedAdam(e, lr=0.05),
        progress=False,
    )
    for i, m in enumerate(alone):
        opt = torch.optim.Adam(m.parameters(), lr=0.05)
        for _ in range(steps):
            opt.zero_grad()
            _nll(m(x), y).backward()
            opt.step()
        for k, v in m.state_dict().items():
            torch.testing.assert_close(ens.state_dicts()[i][k], v, **TOL64, msg=k)


def test_another_modules_sparse_attribute_is_not_taken_for_a_sparse_gradient() -> None:
    class Gate(nn.Linear):
        def __init__(self) -> None:
            super().__init__(3, 2)
            self.sparse = True  # the user's own meaning: nothing to do with gradients

    ens = vmapens.Ensemble(Gate, n=2, seed=0)
    x = torch.randn(4, 3)
    ens(x).sum().backward()
    for i in range(2):
        m = ens[i]
        m(x).sum().backward()
        torch.testing.assert_close(ens.stacked_params()["weight"].grad[i], m.weight.grad)
