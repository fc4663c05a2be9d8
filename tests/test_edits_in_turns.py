"""A forward that edits a batch tensor all members share, with members running in turns.

One vmapped run for all members edits the batch once, as one member alone does. In turns
(``backend="loop"``, or a ``chunk_size`` below ``n``) member ``i`` would see the edits of the
members before it: the runners refuse that before the next member runs, in every call that
runs members (``ens(x)``, ``predict``, ``make_step(check=False)``, ``fit``'s validation), and
leave the ensemble as it was. The truth is each member run alone (``ens[i]``, ``train_alone``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from truth import adam, assert_members_equal, train_alone

import vmapens

N, ROWS = 3, 5
REFUSED = (
    r"edits a tensor of the batch in place.*x = x\.clone\(\).*edited once, by "
    r"(member 0|the one run of members 0 to 1 \(a chunk\)), as one member alone edits it"
)

# Settings where members run in turns on one shared batch.
IN_TURNS = [
    pytest.param({"backend": "loop"}, "backend='loop'", id="loop"),
    pytest.param({"chunk_size": 1}, "chunk_size=1", id="chunk-1"),
    pytest.param({"chunk_size": 2}, "chunk_size=2", id="chunk-2"),
]


class Scales(nn.Module):
    """Doubles its input in place, then BatchNorm (buffers a failed call must give back)."""

    def __init__(self) -> None:
        super().__init__()
        self.bn, self.fc = nn.BatchNorm1d(3), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return self.fc(self.bn(x))


class Rectifies(nn.Module):
    """``nn.ReLU(inplace=True)`` on its input."""

    def __init__(self) -> None:
        super().__init__()
        self.relu, self.bn, self.fc = nn.ReLU(inplace=True), nn.BatchNorm1d(3), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bn(self.relu(x)))


class ScalesACopy(nn.Module):
    """Edits only a tensor it made itself: exact in turns."""

    def __init__(self) -> None:
        super().__init__()
        self.bn, self.fc = nn.BatchNorm1d(3), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        x.mul_(2)
        return self.fc(self.bn(x))


class ScalesWhenFlagged(nn.Module):
    """Doubles its input in place when its buffer says so (one member may, another not)."""

    def __init__(self, flag: int = 0) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.register_buffer("flag", torch.tensor(flag))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.flag:
            x.mul_(2)
        return self.fc(x)


class ScalesWhenEvaluated(nn.Module):
    """Doubles its input in place in eval mode only (the step's self-check sees train mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            x.mul_(2)
        return self.fc(x)


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(ROWS, 3, generator=g, dtype=torch.float64),
            torch.randn(ROWS, 2, generator=g, dtype=torch.float64))  # fmt: skip


def _ensemble(cls: type[nn.Module], **kw: Any) -> vmapens.Ensemble:
    return vmapens.Ensemble(cls, N, seed=0, **kw).double()


def _state(ens: vmapens.Ensemble) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in ens.state_dict().items()}


def _forward(ens: vmapens.Ensemble, x: torch.Tensor, y: torch.Tensor) -> Any:
    return ens(x)


def _predict(ens: vmapens.Ensemble, x: torch.Tensor, y: torch.Tensor) -> Any:
    return vmapens.predict(ens, x)


def _step(ens: vmapens.Ensemble, x: torch.Tensor, y: torch.Tensor) -> Any:
    opt = vmapens.StackedAdam(ens, lr=0.1)
    step = vmapens.make_step(ens, nn.MSELoss(), opt, check=False)
    try:
        return step(x, y)
    finally:
        assert all(p.grad is None for p in ens.parameters())
        assert not opt.state or all(not s for s in opt.state.values())


CALLS: list[Any] = [  # the call, the API its errors name (predict's forward is ens(x))
    pytest.param(_forward, "Ensemble", id="ens(x)"),
    pytest.param(_predict, "Ensemble", id="predict"),
    pytest.param(_step, "step", id="step-check-False"),
]


@pytest.mark.parametrize("cls", [Scales, Rectifies], ids=["mul_", "relu-inplace"])
@pytest.mark.parametrize(("call", "api"), CALLS)
@pytest.mark.parametrize(("settings", "how"), IN_TURNS)
def test_an_edit_of_the_shared_batch_in_turns_is_refused_and_changes_nothing(
    settings: dict[str, Any], how: str, call: Callable[..., Any], api: str, cls: type[nn.Module]
) -> None:
    ens = _ensemble(cls, **settings)
    before = _state(ens)
    x, y = _batch()
    alone = x.clone()
    ens[0](alone)  # the batch after one member alone: what a refusal may leave
    with pytest.raises(
        RuntimeError, match=rf"^{api}: the forward or loss of {cls.__name__} "
    ) as info:
        call(ens, x, y)
    assert re.search(REFUSED, str(info.value)) and how in str(info.value)
    torch.testing.assert_close(x, alone, rtol=0, atol=0)  # edited as by one member, once
    after = _state(ens)
    for name, value in before.items():  # BatchNorm's statistics given back, no step taken
        torch.testing.assert_close(after[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(("settings", "how"), IN_TURNS)
def test_an_edit_in_eval_mode_is_refused_in_fits_validation(
    settings: dict[str, Any], how: str
) -> None:
    ens = _ensemble(ScalesWhenEvaluated, **settings)
    x, y = _batch()
    xv, yv = _batch(1)
    # fit checks `val_data` with one forward first: the forward is at fault, not the data
    with pytest.raises(RuntimeError, match=r"^fit: the forward or loss of ScalesWhenEvaluated "):
        vmapens.fit(ens, (x, y), nn.MSELoss(), val_data=(xv, yv), progress=False)


def test_the_member_that_edited_is_named_and_the_last_may_edit() -> None:
    """Any member may be the one that edits (data-dependent, with the loop backend): the
    turn after it is refused; the last member's edit is seen by no other member."""
    modules = [ScalesWhenFlagged(f).double() for f in (0, 1, 0)]
    ens = vmapens.Ensemble.from_modules(modules, backend="loop")
    with pytest.raises(RuntimeError, match=r"edited once, by member 1, "):
        ens(_batch()[0])
    modules = [ScalesWhenFlagged(f).double() for f in (0, 0, 1)]
    ens = vmapens.Ensemble.from_modules(modules, backend="loop")
    x = _batch()[0]
    out = ens(x.clone())
    for i, m in enumerate(modules):
        torch.testing.assert_close(out[i], m(x.clone()), rtol=0, atol=0)


@pytest.mark.parametrize(("settings", "how"), [*IN_TURNS, pytest.param({}, "", id="vmap")])
def test_an_edit_of_its_own_copy_runs_as_alone(settings: dict[str, Any], how: str) -> None:
    ens = _ensemble(ScalesACopy, **settings)
    alone = ens.unstack()
    batches = [_batch(k) for k in range(3)]
    x = batches[0][0]
    out = ens(x)
    for i, m in enumerate(alone):
        torch.testing.assert_close(out[i], m(x), rtol=1e-12, atol=1e-12)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=0.1), check=False)
    for xb, yb in batches:
        step(xb, yb)
    for m in alone:
        train_alone(m, batches, nn.functional.mse_loss, adam(lr=0.1))
    assert_members_equal(ens, alone)


@pytest.mark.parametrize(("settings", "how"), IN_TURNS)
def test_per_member_data_edited_in_place_runs_as_alone(settings: dict[str, Any], how: str) -> None:
    ens = _ensemble(Scales, **settings)
    alone = ens.unstack()
    g = torch.Generator().manual_seed(2)
    batches = [
        (torch.randn(N, ROWS, 3, generator=g, dtype=torch.float64),
         torch.randn(N, ROWS, 2, generator=g, dtype=torch.float64))
        for _ in range(2)
    ]  # fmt: skip
    step = vmapens.make_step(
        ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=0.1), in_dims=0, check=False
    )
    for x, y in batches:
        step(x.clone(), y)
    for i, m in enumerate(alone):
        train_alone(m, [(x[i].clone(), y[i]) for x, y in batches], make_opt=adam(lr=0.1))
    assert_members_equal(ens, alone)


@pytest.mark.parametrize(("settings", "how"), IN_TURNS)
def test_an_inference_tensor_batch_runs_in_turns(settings: dict[str, Any], how: str) -> None:
    ens = _ensemble(ScalesACopy, **settings).eval()
    with torch.inference_mode():
        x = _batch()[0]
        out = ens(x)
        for i in range(N):
            torch.testing.assert_close(out[i], ens[i](x), rtol=1e-12, atol=1e-12)


class _ScaledByKeyword(nn.Module):
    """Takes a keyword input; with ``edit`` its forward doubles it in place."""

    def __init__(self, edit: bool = True) -> None:
        super().__init__()
        self.fc, self.edit = nn.Linear(3, 2), edit

    def forward(self, x: torch.Tensor, scale: torch.Tensor, shift: float = 0.0) -> torch.Tensor:
        if self.edit:
            scale.mul_(2)
        return self.fc(x) * scale + shift


@pytest.mark.parametrize(
    "settings", [{"backend": "loop"}, {"chunk_size": 1}], ids=["loop", "chunk1"]
)
def test_a_keyword_input_edited_in_turns_is_refused(settings: dict[str, Any]) -> None:
    ens = vmapens.Ensemble(_ScaledByKeyword, n=3, seed=0, **settings)
    scale = torch.ones(1, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="edits a tensor of the batch in place"):
        ens(torch.randn(4, 3), scale=scale)
    assert torch.equal(scale, torch.full((1,), 2.0))  # once, as by one member alone


@pytest.mark.parametrize(
    "settings", [{}, {"backend": "loop"}, {"chunk_size": 1}], ids=["vmap", "loop", "chunk1"]
)
def test_keyword_inputs_reach_every_member_as_alone(settings: dict[str, Any]) -> None:
    ens = vmapens.Ensemble(lambda: _ScaledByKeyword(edit=False), n=3, seed=0, **settings)
    x, scale = torch.randn(4, 3), torch.rand(4, 1)
    out = ens(x, scale=scale, shift=0.5)
    for i in range(3):
        torch.testing.assert_close(out[i], ens[i](x, scale=scale, shift=0.5))
