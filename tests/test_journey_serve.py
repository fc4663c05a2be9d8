"""Journey test: train a small ensemble with make_step, then serve it.

A researcher trains 4 members (an MLP with LayerNorm and Dropout, a CNN with BatchNorm) with
``make_step`` and a stacked optimizer, exports them with ``vmapens.export`` (every member, and
the mean of their softmax), saves the program with ``torch.export.save``, loads it back with
``torch.export.load`` and calls it under ``torch.inference_mode()``. Truth is the members run
alone as plain modules in eval mode (``ens.unstack()``), and for the training itself the naive
loop: 4 plain modules, each with its own ``torch.optim.Adam``, on the same batches.
"""

from __future__ import annotations

import copy
import io
from pathlib import Path

import pytest
import torch
from torch import nn

import vmapens

N = 4
BATCH = 6
TOL = {
    torch.float64: dict(rtol=1e-12, atol=1e-12),
    # Batched matmuls and grouped convolutions sum in another order than one member alone.
    torch.float32: dict(rtol=1e-5, atol=1e-6),
}


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.ln = nn.Linear(4, 8), nn.LayerNorm(8)
        self.drop, self.fc2 = nn.Dropout(0.3), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.ln(self.fc1(x)))))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3)
        self.fc = nn.Linear(3 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


class TwoInputs(nn.Module):
    """A member whose forward takes two tensors and an optional keyword."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.drop = nn.Linear(4, 3), nn.Linear(2, 3), nn.Dropout(0.5)

    def forward(
        self, x: torch.Tensor, z: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        out = self.drop(self.a(x)) + self.b(z)
        return out if mask is None else out.masked_fill(mask, 0.0)


SHAPES = {MLP: (4,), CNN: (1, 6, 6)}


def _plain(cls: type[nn.Module], dtype: torch.dtype) -> list[nn.Module]:
    modules = []
    for i in range(N):
        torch.manual_seed(10 + i)
        modules.append(cls().to(dtype))
    return modules


def _batches(cls: type[nn.Module], dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(BATCH, *SHAPES[cls], generator=g, dtype=dtype),
         torch.randint(0, 3, (BATCH,), generator=g))
        for _ in range(3)
    ]  # fmt: skip


def _trained(cls: type[nn.Module], dtype: torch.dtype) -> vmapens.Ensemble:
    ens = vmapens.Ensemble.from_modules(_plain(cls, dtype))
    opt = vmapens.StackedAdam(ens, lr=1e-2)
    step = vmapens.make_step(ens, nn.functional.cross_entropy, opt)
    for x, y in _batches(cls, dtype):
        step(x, y)
    return ens


def _alone(ens: vmapens.Ensemble, *inputs: torch.Tensor) -> torch.Tensor:
    """Each member as a plain module in eval mode, one after another: the truth."""
    with torch.no_grad():
        return torch.stack([m.eval()(*inputs) for m in ens.unstack()])


@pytest.fixture(scope="module")
def trained() -> dict:
    keys = [(MLP, torch.float64), (CNN, torch.float64), (CNN, torch.float32)]  # 3 x 3 steps
    return {key: _trained(*key) for key in keys}


def test_make_step_training_ends_where_the_naive_loop_ends(trained: dict) -> None:
    # The CNN has no dropout (dropout masks match alone only in distribution, semantics.md):
    # its members and BatchNorm statistics must end where 4 plain Adam loops end.
    ens = trained[CNN, torch.float64]
    naive = _plain(CNN, torch.float64)
    for model in naive:
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for x, y in _batches(CNN, torch.float64):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    # tests/truth.py's bar for training: the conv bias before BatchNorm has a gradient of pure
    # round-off, which Adam turns into lr-sized steps (semantics.md's table: ~1e-10 in float64).
    for member, model in zip(ens.unstack(), naive, strict=True):
        torch.testing.assert_close(member.state_dict(), model.state_dict(), rtol=1e-9, atol=1e-10)


# The float64 CNN is served in test_export_of_a_selection_and_of_a_float32_copy (time budget).
# Each export traces the forward (about half a second): the MLP serves every member, the
# float32 CNN the mean of the members' softmax (a second trace after the members' for the probe).
@pytest.mark.parametrize("key", ["mlp64_members", "cnn32_mean"])
def test_saved_program_serves_members_as_alone(trained: dict, key: str, tmp_path: Path) -> None:
    cls, dtype = (MLP, torch.float64) if key == "mlp64_members" else (CNN, torch.float32)
    reduce, softmax = (None, False) if key == "mlp64_members" else ("mean", True)
    ens, tol = trained[cls, dtype], TOL[dtype]
    x = _batches(cls, dtype)[0][0]
    truth = _alone(ens, x)
    want = truth if reduce is None else truth.softmax(-1).mean(0)  # by hand
    assert ens.training  # left in train mode by training: export and predict use eval mode

    program = vmapens.export(ens, x, reduce=reduce, softmax=softmax)
    assert ens.training  # the mode is given back
    torch.export.save(program, tmp_path / "ensemble.pt2")
    served = torch.export.load(tmp_path / "ensemble.pt2").module()
    with torch.inference_mode():
        torch.testing.assert_close(served(x), want, **tol)
        torch.testing.assert_close(served(x), want, **tol)  # twice: BatchNorm stays put
    got = vmapens.predict(ens, x, reduce=reduce or "none", softmax=softmax, batch_size=4)
    torch.testing.assert_close(got, want, **tol)
    ens.eval()
    try:
        with torch.inference_mode():
            torch.testing.assert_close(ens(x), truth, **tol)
    finally:
        ens.train()

    # Documented (workflows.md, "What is fixed when exporting"): one program per batch size.
    for size in (1, 3, 12):
        other = torch.randn(size, *SHAPES[cls], dtype=dtype)
        with pytest.raises(AssertionError, match=rf"args_0.size\(\)\[0\] == {BATCH}"):
            served(other)


def test_export_of_a_selection_and_of_a_float32_copy(trained: dict) -> None:
    ens = trained[CNN, torch.float64]
    x = _batches(CNN, torch.float64)[0][0]
    truth = _alone(ens, x)
    program = vmapens.export(ens.select(torch.tensor([3, 1])), x, reduce="max").module()
    with torch.inference_mode():
        torch.testing.assert_close(program(x), truth[[3, 1]].amax(0), **TOL[torch.float64])
    assert len(ens) == N

    # ens.to(torch.float32) after training (its optimizer made before): the members cast alone.
    single = copy.deepcopy(ens).to(torch.float32)
    x32 = x.float()
    by_hand = torch.stack([copy.deepcopy(m).float().eval()(x32) for m in ens.unstack()]).detach()
    program = vmapens.export(single, x32).module()
    with torch.inference_mode():
        out = program(x32)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, by_hand, **TOL[torch.float32])


def test_two_inputs_and_a_keyword_are_served_positionally() -> None:
    modules = []
    for i in range(N):
        torch.manual_seed(i)
        modules.append(TwoInputs().double())
    ens = vmapens.Ensemble.from_modules(modules)
    x, z = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    mask = torch.zeros(5, 3, dtype=torch.bool)
    mask[0] = True
    truth = _alone(ens, x, z, mask)
    program = vmapens.export(ens, (x, z, mask))
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    buffer.seek(0)
    with torch.inference_mode():
        served = torch.export.load(buffer).module()(x, z, mask)
    torch.testing.assert_close(served, truth, **TOL[torch.float64])
    ens.eval()  # its dropout: served in eval mode
    torch.testing.assert_close(ens(x, z, mask=mask), served, **TOL[torch.float64])
    # Only positional tensors are taken (the docstring): a list or a float says so, by name.
    with pytest.raises(TypeError, match=r"export: `example_inputs` must be .* got list"):
        vmapens.export(ens, [x, z])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"`example_inputs` .* got \['Tensor', 'float'\]"):
        vmapens.export(ens, (x, 2.0))  # type: ignore[arg-type]


def test_dropout_in_train_mode_is_served_in_eval_mode() -> None:
    ens = vmapens.Ensemble.from_modules(_plain(MLP, torch.float64))
    x = torch.randn(BATCH, 4, dtype=torch.float64)
    truth = _alone(ens, x)
    # Monte Carlo dropout: the ensemble in eval mode with its Dropout in train mode.
    ens.eval()
    ens.template.drop.train()
    assert not torch.equal(ens(x), ens(x))
    program = vmapens.export(ens, x).module()
    # Documented: exported in eval mode, the modes restored afterwards.
    assert (ens.training, ens.template.drop.training, ens.template.ln.training) == (
        False,
        True,
        False,
    )
    with torch.inference_mode():
        torch.testing.assert_close(program(x), truth, **TOL[torch.float64])
        torch.testing.assert_close(program(x), truth, **TOL[torch.float64])
    # The served program has no train mode to switch dropout back on: torch refuses.
    with pytest.raises(NotImplementedError, match="train"):
        program.train()


def test_torch_export_of_the_ensemble_itself_is_refused() -> None:
    # semantics.md: the ensemble holds no submodules, torch utilities that reach tensors by
    # dotted paths do not see the members' layers; vmapens.export is the way to serve it.
    ens = vmapens.Ensemble(MLP, n=2, seed=0).eval()
    x = torch.randn(3, 4)
    with pytest.raises(AttributeError, match="Ensemble has no attribute `fc1`") as info:
        torch.export.export(ens, (x,))
    assert "ens.template.fc1" in str(info.value.__cause__)
