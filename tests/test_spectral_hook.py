"""Members with the old-style ``torch.nn.utils.spectral_norm`` under the default vmap backend.

torch's ``SpectralNorm`` forward pre-hook writes its power iteration into ``weight_u`` /
``weight_v`` with ``out=``, which vmap cannot batch ("Batching rule not implemented for
aten::div.out"); the module the ensemble runs holds a twin of the hook
(``vmapens/_spectral.py``). The truth is plain PyTorch: the same modules built alone (seeded
as ``seeds=`` builds the members), with torch's own hook, trained with ``torch.optim.Adam`` on
the same batches (``tests/truth.py``); compared member by member, the buffers included, in
training and eval mode.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn.utils.spectral_norm import SpectralNorm
from truth import TOL64, assert_members_equal, float64_batches, seeded_members, train_each

import vmapens

pytestmark = pytest.mark.usefixtures("float64_default")

N = 3
ROWS = 5
LR = 1e-2  # truth.adam's default, which train_each uses


def _linear(**kw: object) -> Callable[[], nn.Module]:
    return lambda: nn.Sequential(
        nn.utils.spectral_norm(nn.Linear(4, 5), **kw), nn.Tanh(), nn.Linear(5, 2)
    )


def _conv(layer: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """The 4 inputs as a 1 x 2 x 2 image through ``layer`` (3 channels of 3 x 3 out)."""
    return lambda: nn.Sequential(
        nn.Unflatten(1, (1, 2, 2)),
        nn.utils.spectral_norm(layer()),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(27, 2),
    )


CASES = {
    "linear": _linear(),
    # Three iterations per forward; an eps above the members' first ||W^T u|| (it decides v).
    "linear-iterations-eps": _linear(n_power_iterations=3, eps=0.75),
    "linear-dim1": _linear(dim=1),
    "conv2d": _conv(lambda: nn.Conv2d(1, 3, 2, padding=1)),
    "conv-transpose2d": _conv(lambda: nn.ConvTranspose2d(1, 3, 2)),  # spectral_norm's dim=1
}


def _hook(module: nn.Module) -> SpectralNorm:
    (hook,) = [h for m in module.modules() for h in m._forward_pre_hooks.values()]
    assert isinstance(hook, SpectralNorm)
    return hook


def _train_alone(models: list[nn.Module], batches: list, eval_from: int) -> None:
    """``train_each`` in training mode up to batch ``eval_from``, then in eval mode, with one
    Adam per module kept across the switch."""
    opts = [torch.optim.Adam(m.parameters(), lr=LR) for m in models]
    for part, mode in ((batches[:eval_from], True), (batches[eval_from:], False)):
        for m in models:
            m.train(mode)
        train_each(models, part, make_opt=lambda i, _: opts[i])


def _train_ensemble(
    factory: Callable[[], nn.Module], batches: list, eval_from: int, **kw: object
) -> vmapens.Ensemble:
    ens = vmapens.Ensemble(factory, n=N, seeds=range(N), **kw)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=LR))
    for k, (x, y) in enumerate(batches):
        ens.train(k < eval_from)
        step(x, y)  # the first step checks itself: member 0 alone against the ensemble
    return ens


@pytest.mark.parametrize("name", list(CASES))
def test_old_spectral_norm_members_train_as_alone_under_vmap_in_train_and_eval_mode(name):
    factory = CASES[name]
    batches = float64_batches(4, ROWS, 4, 2)
    ens = _train_ensemble(factory, batches, eval_from=2)
    alone = seeded_members(factory, N)
    _train_alone(alone, batches, eval_from=2)
    assert type(_hook(ens.runner)) is not SpectralNorm  # the twin ran, not the loop
    assert any(k.endswith("weight_u") for k in ens.state_dict())
    assert_members_equal(ens, alone)  # parameters and the weight_u / weight_v buffers
    x = batches[0][0]
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in alone]), **TOL64)


@pytest.mark.parametrize("kw", [{"chunk_size": 2}, {"backend": "loop"}], ids=["chunk_size", "loop"])
def test_old_spectral_norm_members_train_as_alone_in_chunks_and_with_the_loop_backend(kw):
    factory = CASES["linear-iterations-eps"]
    batches = float64_batches(3, ROWS, 4, 2)
    ens = _train_ensemble(factory, batches, eval_from=2, **kw)
    alone = seeded_members(factory, N)
    _train_alone(alone, batches, eval_from=2)
    assert_members_equal(ens, alone)


def test_members_keep_torchs_hook_and_a_saved_ensemble_resumes_as_alone(tmp_path):
    """``ens[i]``, ``unstack`` and the member state dicts are torch's; a checkpoint carries
    ``weight_u`` / ``weight_v``, and the loaded ensemble's power iteration goes on from them."""
    factory = CASES["conv-transpose2d"]
    batches = float64_batches(4, ROWS, 4, 2)
    ens = vmapens.Ensemble(factory, n=N, seeds=range(N))
    opt = vmapens.StackedAdam(ens, lr=LR)
    step = vmapens.make_step(ens, nn.MSELoss(), opt)
    for x, y in batches[:3]:
        step(x, y)
    vmapens.save(ens, tmp_path / "ens.pt", opt)
    loaded = vmapens.load(tmp_path / "ens.pt", factory)
    opt = vmapens.StackedAdam(loaded, lr=LR)
    vmapens.restore(tmp_path / "ens.pt", loaded, opt)
    vmapens.make_step(loaded, nn.MSELoss(), opt)(*batches[3])
    alone = seeded_members(factory, N)
    _train_alone(alone, batches, eval_from=4)
    assert_members_equal(loaded, alone)
    x = batches[0][0]
    for i, (member, plain, state) in enumerate(
        zip(loaded.unstack(), alone, loaded.state_dicts(), strict=True)
    ):
        assert type(_hook(member)) is SpectralNorm
        assert list(state) == list(plain.state_dict())
        from_file = factory()
        from_file.load_state_dict(state)
        want = plain.train()(x)  # a training-mode forward: one more power iteration
        for m in (member, from_file):
            torch.testing.assert_close(m.train()(x), want, **TOL64, msg=f"member {i}")
            torch.testing.assert_close(m.state_dict(), plain.state_dict(), **TOL64)
