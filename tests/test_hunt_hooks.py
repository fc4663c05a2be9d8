"""Module hooks and state-dict hooks on the members, as users register them, against the
members trained alone with ``torch.optim`` (float64).

Found by the hunt (each silent before):

* a forward hook registered in the member's ``__init__`` as a lambda that closes over the
  member itself or one of its submodules (``lambda m, args, out: out * self.gain``) read
  member 0's original, never-trained tensors for every member: the ensemble runs a copy of
  member 0, and ``copy.deepcopy`` does not copy functions. The copies now rebind it to their
  own modules (``vmapens._copies``): it trains as alone, as a bound method does;
* a global module backward hook (``register_module_full_backward_hook``) never fired under
  vmap: ``ens(x)`` then ``backward()`` trained without it. Refused as a member's own is;
* a state_dict pre-hook that refreshes a buffer ran on no member in ``ens.state_dict()``
  (member 0's ran once, at build, on the caller's module). Refused at build.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from truth import float64_batches, seeded_members

import vmapens

pytestmark = pytest.mark.usefixtures("float64_default")

N = 3


def _train_both(factory, **ens_kw):
    torch.manual_seed(0)
    mods = [factory() for _ in range(N)]
    return _train(mods, [copy.deepcopy(m) for m in mods], **ens_kw)


def _train(mods, alone, **ens_kw):
    """An ensemble of ``mods`` and the modules ``alone`` trained alike, 3 SGD steps each."""
    ens = vmapens.Ensemble.from_modules(mods, **ens_kw)
    batches = float64_batches(3, 5, 3, 2)
    step = vmapens.make_step(ens, nn.functional.mse_loss, vmapens.StackedSGD(ens, lr=0.1))
    for x, y in batches:
        step(x, y)
    for m in alone:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for x, y in batches:
            opt.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()
    return ens, alone


def _assert_as_alone(ens, alone):
    whole = ens.state_dict()
    for i, m in enumerate(alone):
        want = m.state_dict()
        for got in (ens[i].state_dict(), ens.unstack()[i].state_dict(), ens.state_dicts()[i]):
            assert list(got) == list(want)
            for k in want:
                torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-12)
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(i))
        with torch.no_grad():  # the hooks of `ens[i]`, `unstack()` and the batched run
            outs = [ens[i](x), ens.unstack()[i](x), ens(x)[i]]
            for out in outs:
                torch.testing.assert_close(out, m(x), rtol=0, atol=1e-12)
        assert set(whole) == set(want)
        for k in want:
            torch.testing.assert_close(whole[k][i], want[k], rtol=0, atol=1e-12)


class GainClosure(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.gain = nn.Parameter(torch.rand(2) + 0.5)
        self.fc.register_forward_hook(lambda m, args, out: out * self.gain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class SubmoduleClosure(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.fc2 = nn.Linear(3, 4), nn.Linear(4, 2)
        fc2 = self.fc2
        self.fc.register_forward_hook(lambda m, args, out: out * fc2.bias.sum())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc(x))


class BoundMethod(nn.Module):
    """The same hook as ``GainClosure``'s, as a bound method: the copy rebinds it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.gain = nn.Parameter(torch.rand(2) + 0.5)
        self.fc.register_forward_hook(self._hook)

    def _hook(self, m: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        return out * self.gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


@pytest.mark.parametrize("cls", [GainClosure, SubmoduleClosure])
def test_a_hook_closing_over_the_members_module_trains_as_alone(cls):
    # The truth is built anew, not deep-copied: a copy's lambda would read the original's.
    ens, alone = _train(seeded_members(cls, N), seeded_members(cls, N))
    _assert_as_alone(ens, alone)


def test_a_bound_method_hook_trains_as_alone():
    _assert_as_alone(*_train_both(BoundMethod))


class KwargHooks(nn.Module):
    """Forward pre-hook with kwargs, forward hook with kwargs and always_call, prepend."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.fc.register_forward_pre_hook(lambda m, a, kw: ((a[0] * 2,), kw), with_kwargs=True)
        self.fc.register_forward_hook(
            lambda m, a, kw, out: out * 3, with_kwargs=True, always_call=True
        )
        self.fc.register_forward_hook(lambda m, a, out: out + 1, prepend=True)
        self.register_forward_hook(lambda m, a, out: out.tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_forward_hooks_with_kwargs_train_as_alone():
    _assert_as_alone(*_train_both(KwargHooks))


def test_a_global_forward_hook_trains_as_alone():
    handle = nn.modules.module.register_module_forward_hook(
        lambda m, a, out: out * 2 if isinstance(m, nn.Linear) else None
    )
    try:
        _assert_as_alone(
            *_train_both(lambda: nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
        )
    finally:
        handle.remove()


class BackwardHooks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.fc2 = nn.Linear(3, 4), nn.Linear(4, 2)
        self.fc2.register_full_backward_hook(lambda m, gi, go: (gi[0] * 0.5,))
        self.fc2.register_full_backward_pre_hook(lambda m, go: (go[0] * 3,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if h.requires_grad:  # as alone: no hook without a graph
            h.register_hook(lambda g: g * 0.25)
        return self.fc2(torch.tanh(h))


def test_backward_and_tensor_hooks_train_as_alone_in_turns_and_are_refused_under_vmap():
    _assert_as_alone(*_train_both(BackwardHooks, backend="loop"))
    with pytest.raises(RuntimeError, match="`fc2` .*backward hook"):
        _train_both(BackwardHooks)


class RenamedKeys(nn.Module):
    """A state_dict hook that renames keys (an old checkpoint layout), with its load twin."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self._register_state_dict_hook(
            lambda m, sd, p, lm: {k.replace("fc.", "lin."): v for k, v in sd.items()}
        )
        self.register_forward_hook(lambda m, a, out: out * 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_a_state_dict_hook_that_renames_keys_gives_the_members_keys(tmp_path):
    ens, alone = _train_both(RenamedKeys)
    _assert_as_alone(ens, alone)
    vmapens.save(ens, tmp_path / "e.pt")
    _assert_as_alone(vmapens.load(tmp_path / "e.pt", RenamedKeys), alone)


def _global_scale(m: nn.Module, grad_input: tuple, grad_output: tuple) -> tuple | None:
    return (grad_input[0] * 0.5,) if isinstance(m, nn.Tanh) else None


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


# torch's own, alone: the first layer's input needs no gradient.
@pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")
def test_a_global_backward_hook_is_refused_under_vmap_and_exact_in_turns():
    """It never fired on the members under vmap: ``ens(x)`` then ``backward()`` trained
    without it, silently (``make_step``'s self-check caught it as a gradient difference)."""
    handle = nn.modules.module.register_module_full_backward_hook(_global_scale)
    try:
        _assert_as_alone(*_train_both(_mlp, backend="loop"))
        ens = vmapens.Ensemble(_mlp, n=N, seed=0)
        x = torch.randn(5, 3)
        with pytest.raises(RuntimeError, match="global backward hook.*backend='loop'"):
            ens(x)
        with pytest.raises(RuntimeError, match="global backward hook"):
            _train_both(_mlp)
        with torch.no_grad():
            out = ens(x)
        torch.testing.assert_close(out[1], ens[1](x), rtol=0, atol=1e-12)
    finally:
        handle.remove()
    ens(x).sum().backward()  # removed: runs again


class NormBeforeSaving(nn.Module):
    """A state_dict pre-hook that refreshes a buffer from the weights before saving."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.register_buffer("norm", torch.zeros(()))
        self.register_state_dict_pre_hook(
            lambda m, p, kv: m.norm.copy_(m.fc.weight.detach().norm())
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_a_state_dict_pre_hook_is_refused_before_it_runs():
    """``ens.state_dict()`` gave member 0's refreshed buffer and the others' stale zeros,
    where each member's own ``state_dict()`` gives its own norm."""
    torch.manual_seed(0)
    mods = [NormBeforeSaving() for _ in range(N)]
    with pytest.raises(ValueError, match=r"NormBeforeSaving of member 0 has a state_dict pre-hook"):
        vmapens.Ensemble.from_modules(mods)
    assert all(m.norm.item() == 0 for m in mods)  # refused before any hook ran
    with pytest.raises(ValueError, match="state_dict pre-hook"):
        vmapens.Ensemble(NormBeforeSaving, n=N, seed=0)
