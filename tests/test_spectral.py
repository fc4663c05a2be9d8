"""Members with ``torch.nn.utils.parametrizations.spectral_norm`` under the default vmap backend.

torch's parametrization writes its power iteration into ``_u``/``_v`` with ``out=``, which vmap
cannot batch; the module the ensemble runs holds a twin (``vmapens/_spectral.py``). The truth
is plain PyTorch: the same modules built alone (seeded as ``seeds=`` builds the members), with
torch's own ``_SpectralNorm``, trained with ``torch.optim`` on the same batches; compared
member by member, the ``_u``/``_v`` buffers included, in training and eval mode.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations
from torch.nn.utils.parametrizations import _SpectralNorm
from truth import assert_members_equal, float64_batches, seeded_members

import vmapens

pytestmark = pytest.mark.usefixtures("float64_default")

N = 3
ROWS = 5
LR = 0.05


def _linear(**kw: object) -> Callable[[], nn.Module]:
    return lambda: nn.Sequential(
        parametrizations.spectral_norm(nn.Linear(4, 5), **kw), nn.Tanh(), nn.Linear(5, 2)
    )


def _conv(layer: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """The 4 inputs as a 1 x 2 x 2 image through ``layer`` (3 channels of 3 x 3 out)."""
    return lambda: nn.Sequential(
        nn.Unflatten(1, (1, 2, 2)),
        parametrizations.spectral_norm(layer()),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(27, 2),
    )


CASES = {
    "linear": _linear(),
    # Three iterations per forward; an eps above member 0's ||W v|| (its clamp decides u).
    "linear-iterations-eps": _linear(n_power_iterations=3, eps=0.75),
    "linear-dim1": _linear(dim=1),
    "conv2d": _conv(lambda: nn.Conv2d(1, 3, 2, padding=1)),
    "conv-transpose2d": _conv(lambda: nn.ConvTranspose2d(1, 3, 2)),  # spectral_norm's dim=1
}


def _train_alone(models: list[nn.Module], batches: list, eval_from: int) -> None:
    """torch.optim.Adam, one module at a time; eval mode from batch ``eval_from`` on."""
    for m in models:
        opt = torch.optim.Adam(m.parameters(), lr=LR)
        for k, (x, y) in enumerate(batches):
            m.train(k < eval_from)
            opt.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()


def _train_ensemble(
    factory: Callable[[], nn.Module], batches: list, eval_from: int, **kw: object
) -> vmapens.Ensemble:
    compile = bool(kw.pop("compile", False))
    ens = vmapens.Ensemble(factory, n=N, seeds=range(N), **kw)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=LR), compile=compile)
    for k, (x, y) in enumerate(batches):
        ens.train(k < eval_from)
        step(x, y)  # the first step checks itself: member 0 alone against the ensemble
    return ens


@pytest.mark.parametrize("name", list(CASES))
def test_spectral_norm_members_train_as_alone_under_vmap_in_train_and_eval_mode(name):
    factory = CASES[name]
    batches = float64_batches(4, ROWS, 4, 2)
    ens = _train_ensemble(factory, batches, eval_from=2)
    alone = seeded_members(factory, N)
    _train_alone(alone, batches, eval_from=2)
    assert any(k.endswith("._u") for k in ens.state_dict())
    assert_members_equal(ens, alone)  # parameters and the _u / _v buffers
    x = batches[0][0]
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in alone]), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("kw", [{"chunk_size": 2}, {"backend": "loop"}], ids=["chunk_size", "loop"])
def test_spectral_norm_members_train_as_alone_in_chunks_and_with_the_loop_backend(kw):
    factory = CASES["linear-iterations-eps"]
    batches = float64_batches(3, ROWS, 4, 2)
    ens = _train_ensemble(factory, batches, eval_from=len(batches), **kw)
    alone = seeded_members(factory, N)
    _train_alone(alone, batches, eval_from=len(batches))
    assert_members_equal(ens, alone)


def test_members_keep_torchs_spectral_norm_and_load_into_plain_modules():
    factory = CASES["conv-transpose2d"]
    batches = float64_batches(2, ROWS, 4, 2)
    ens = _train_ensemble(factory, batches, eval_from=len(batches))
    runner_norm = ens.runner[1].parametrizations.weight[0]
    assert isinstance(runner_norm, _SpectralNorm) and type(runner_norm) is not _SpectralNorm
    alone = seeded_members(factory, N)
    _train_alone(alone, batches, eval_from=len(batches))
    x = batches[0][0]
    for i, (member, plain, state) in enumerate(
        zip(ens.unstack(), alone, ens.state_dicts(), strict=True)
    ):
        assert type(member.get_submodule("1.parametrizations.weight.0")) is _SpectralNorm
        loaded = factory()
        loaded.load_state_dict(state)
        # A training-mode forward runs the power iteration from the loaded _u / _v.
        for m in (member, plain, loaded):
            m.train()
        want = plain(x)
        for m in (member, loaded):
            torch.testing.assert_close(m(x), want, rtol=1e-9, atol=1e-10, msg=f"member {i}")
            torch.testing.assert_close(m.state_dict(), plain.state_dict(), rtol=1e-9, atol=1e-10)


def _hook_linear() -> nn.Module:
    """The old-style ``nn.utils.spectral_norm`` (a forward pre-hook), as in
    tests/test_spectral_hook.py."""
    return nn.Sequential(nn.utils.spectral_norm(nn.Linear(4, 5)), nn.Tanh(), nn.Linear(5, 2))


@pytest.mark.parametrize(
    "factory", [CASES["linear"], _hook_linear], ids=["parametrization", "hook"]
)
def test_two_forwards_in_one_step_as_a_gan_discriminator(factory):
    """``D(real) - D(fake)``: two power iterations per step, the first forward's backward
    through the vectors it read, not the ones the second forward wrote."""
    batches = float64_batches(3, ROWS, 4, 4)
    alone = seeded_members(factory, N)
    for m in alone:
        opt = torch.optim.Adam(m.parameters(), lr=LR)
        for real, fake in batches:
            opt.zero_grad()
            (m(real).mean() - m(fake).mean()).backward()
            opt.step()
    ens = vmapens.Ensemble(factory, n=N, seeds=range(N))
    opt = vmapens.StackedAdam(ens, lr=LR)
    for real, fake in batches:
        opt.zero_grad()
        (ens(real).mean((1, 2)) - ens(fake).mean((1, 2))).sum().backward()
        opt.step()
    assert_members_equal(ens, alone)


def test_compiled_step_traces_spectral_norm_and_trains_as_alone():
    factory = CASES["linear-iterations-eps"]
    batches = float64_batches(3, ROWS, 4, 2)
    ens = _train_ensemble(factory, batches, eval_from=2, compile=True)
    alone = seeded_members(factory, N)
    _train_alone(alone, batches, eval_from=2)
    assert_members_equal(ens, alone)
