"""User journey: the edges of the layers vmapens runs as twins of its own (``_BATCHABLE`` in
vmapens/_batchable.py: Dropout, GroupNorm, LayerNorm, spectral_norm, weight_norm), against each
member alone in plain PyTorch (docs/semantics.md, "What vmap cannot batch", "Randomness in the
forward pass", "Mixed precision").

LayerNorm without weights, without a bias, over a tuple of dims, and GroupNorm without weights,
with one group, with one channel per group, side by side on a channels-last 4-D input (and a
5-D one); spectral_norm (both APIs) on ConvTranspose1d layers (dim 1) with 3 power iterations
and weight_norm (both APIs, dim None and 1) on Conv1d layers, after torch's ``remove_*`` on the
members from ``ens.unstack()``: two ``make_step`` steps (the second in eval mode) with
StackedAdam against ``torch.optim.Adam`` alone, under vmap, ``chunk_size=2`` and
``backend="loop"``, then ``ens.eval()``, ``predict``, the ``state_dicts()`` keys and their load
into plain modules, all in float64. Dropout, Dropout1d/2d/3d and FeatureAlphaDropout on
channels-last and transposed inputs, p 0, 0.5 and 1, in place or not, ``randomness="same"``:
each member's output and gradients equal alone's from the same RNG state. bf16 inputs into
LayerNorm/GroupNorm without weights, and autocast around a weightless LayerNorm: outputs bit
for bit. Fixed by patches twinedges-1/2/3 (strict xfails before): AlphaDropout on a
non-contiguous input drew another mask than alone (the step refused it); norms without
weights under autocast got other gradients than alone (a weightless LayerNorm trained 1e-4 off
with ``precision="bf16"``); the weight_norm twins ran ``norm_except_dim`` member after
member.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils import parametrizations, parametrize
from truth import seeded_members

import vmapens

N, LR = 3, 0.05
F64, BF16 = torch.float64, torch.bfloat16
CL, CL3 = torch.channels_last, torch.channels_last_3d
TOL: dict[str, Any] = dict(rtol=1e-10, atol=1e-12)
KWS = {"vmap": {}, "chunk": {"chunk_size": 2}, "loop": {"backend": "loop"}}


def _old_style(wrap: Callable[..., nn.Module], *args: Any, **kw: Any) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch deprecates the old weight_norm
        return wrap(*args, **kw)


def _seq(*layers: nn.Module) -> nn.Module:
    return nn.Sequential(*layers).double()


class Norms(nn.Module):
    """Norm layers at their edges side by side on one input, summed: LayerNorm without weights,
    without a bias, over a tuple of dims; GroupNorm without weights, with one group, with one
    channel per group. After a conv without a bias: a norm cancels a per-channel bias, whose
    gradient is then round-off that Adam's first step scales to an lr-sized step."""

    def __init__(self, dims: int) -> None:
        super().__init__()
        conv = nn.Conv2d if dims == 2 else nn.Conv3d
        self.conv = conv(2, 4, 1, bias=False)
        self.norms = nn.ModuleList([
            nn.GroupNorm(2, 4, affine=False), nn.GroupNorm(1, 4), nn.GroupNorm(4, 4),
            nn.LayerNorm(3, elementwise_affine=False), nn.LayerNorm(3, bias=False),
            nn.LayerNorm((2, 3) if dims == 2 else (2, 2, 3)),
        ])  # fmt: skip
        self.head = nn.Linear(24 if dims == 2 else 48, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv(x)
        return self.head(sum(norm(h) for norm in self.norms).flatten(1))


# The last dims are W = 3 (LayerNorm(3)) and (H, W) = (2, 3) (the tuple); a channels-last input
# gives the conv's output, and so every norm's input, that layout.
NORMS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], Any]] = {
    "channels-last": (lambda: Norms(2).double(), (2, 2, 2, 3), CL),
    "5d": (lambda: Norms(3).double(), (2, 2, 2, 2, 3), CL3),
}


def _remove(module: nn.Module) -> None:
    """torch's own ``remove_*`` on every spectral/weight-normed layer of a plain module."""
    for sub in module.modules():
        if parametrize.is_parametrized(sub):
            parametrize.remove_parametrizations(sub, "weight")
        for hook in list(sub._forward_pre_hooks.values()):
            kind = type(hook).__name__
            if kind == "SpectralNorm":
                nn.utils.remove_spectral_norm(sub)
            elif kind == "WeightNorm":
                _old_style(nn.utils.remove_weight_norm, sub)


def _normed(flip: bool) -> nn.Module:
    """spectral_norm, both APIs, on ConvTranspose1d layers (their dim 1) with 3 power
    iterations, then weight_norm, both APIs, on Conv1d layers, one with dim None and one with
    dim 1 (``flip`` swaps which API gets which)."""
    new, old = parametrizations.weight_norm, nn.utils.weight_norm
    return _seq(
        parametrizations.spectral_norm(nn.ConvTranspose1d(2, 3, 2), n_power_iterations=3),
        nn.utils.spectral_norm(nn.ConvTranspose1d(3, 3, 2), n_power_iterations=3),
        nn.Tanh(),
        _old_style(old if flip else new, nn.Conv1d(3, 3, 2), dim=None),
        _old_style(new if flip else old, nn.Conv1d(3, 3, 2), dim=1),
        nn.Flatten(),
        nn.Linear(12, 2),
    )


NORMED: dict[str, Callable[[], nn.Module]] = {
    "new-None": lambda: _normed(False),
    "old-None": lambda: _normed(True),
}


def _journey(factory: Callable[[], nn.Module], shape: tuple[int, ...], layout: Any,
             kw: dict, remove: bool = False) -> None:  # fmt: skip
    """Two make_step steps (train, then eval: no power iteration) against torch.optim.Adam
    alone, then eval outputs, predict and the state_dicts keys; ``remove``: torch's
    ``remove_*`` on the members from ``ens.unstack()`` first (the ensemble keeps its own)."""
    g = torch.Generator().manual_seed(1)
    fmt = layout or torch.contiguous_format
    xs = [torch.randn(shape, generator=g, dtype=F64).contiguous(memory_format=fmt) for _ in "ab"]
    out = seeded_members(factory, 1)[0](xs[0])  # a module of its own: its forward iterates
    data = [(x, torch.randn(out.shape, generator=g, dtype=F64)) for x in xs]
    ens = vmapens.Ensemble(factory, N, seeds=range(N), **kw)
    alone = seeded_members(factory, N)
    assert [list(s) for s in ens.state_dicts()] == [list(m.state_dict()) for m in alone]
    if remove:
        for member in ens.unstack():
            _remove(member)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=LR))
    for k, (x, y) in enumerate(data):
        ens.train(k == 0)
        step(x, y)
    for m in alone:
        opt = torch.optim.Adam(m.parameters(), lr=LR)
        for k, (x, y) in enumerate(data):
            m.train(k == 0)
            opt.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()
    for i, (state, m) in enumerate(zip(ens.state_dicts(), alone, strict=True)):
        plain = factory()
        plain.load_state_dict(state)  # a member's file loads into the plain module
        want = m.state_dict()
        assert list(state) == list(want), i
        for key in want:
            torch.testing.assert_close(state[key], want[key], **TOL, msg=f"member {i} {key}")
    ens.eval()
    x = data[1][0]
    with torch.no_grad():
        together, predicted = ens(x), vmapens.predict(ens, x)
        for i, m in enumerate(alone):
            torch.testing.assert_close(together[i], m.eval()(x), **TOL)
            torch.testing.assert_close(predicted[i], m(x), **TOL)


NORM_RUNS = [("channels-last", kw) for kw in KWS] + [("5d", "vmap")]
NORMED_RUNS = [("new-None", "vmap"), ("new-None", "chunk"), ("old-None", "vmap")]


@pytest.mark.parametrize(("case", "kw"), NORM_RUNS)
def test_norm_twins_at_their_edges_train_as_alone(case: str, kw: str) -> None:
    _journey(*NORMS[case], KWS[kw])


@pytest.mark.parametrize(("case", "kw"), NORMED_RUNS)
def test_spectral_and_weight_norm_edges_train_as_alone_after_remove_on_members(
    case: str, kw: str
) -> None:
    _journey(NORMED[case], (2, 2, 4), None, KWS[kw], remove=True)


# -- dropouts with randomness="same": each member's own mask, as alone -------------------------


class Transposed(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.transpose(1, 2)


def _dropped(layer: Callable[[], nn.Module], view: str) -> tuple[Callable[[], nn.Module], Tensor]:
    """A member with ``layer`` after a channels-last conv or a transpose, and its input."""
    g = torch.Generator().manual_seed(2)
    if view == "channels-last-3d":
        x = torch.randn(2, 2, 2, 3, 3, generator=g, dtype=F64).contiguous(memory_format=CL3)
        return lambda: _seq(nn.Conv3d(2, 4, 1, bias=False), layer()), x
    if view == "channels-last":
        x = torch.randn(2, 2, 3, 3, generator=g, dtype=F64).contiguous(memory_format=CL)
        return lambda: _seq(nn.Conv2d(2, 4, 1, bias=False), layer()), x
    x = torch.randn(2, 5, 4, generator=g, dtype=F64)  # (batch, length, features) -> (N, C, L)
    return lambda: _seq(nn.Linear(4, 6), Transposed(), layer()), x


def _assert_masks_as_alone(factory: Callable[[], nn.Module], x: Tensor, **kw: Any) -> None:
    ens = vmapens.Ensemble(factory, N, seed=0, randomness="same", **kw)
    alone, rng = ens.unstack(), torch.get_rng_state()
    out = ens(x)
    out.square().sum().backward()
    for i, m in enumerate(alone):
        torch.set_rng_state(rng)  # each member alone draws from the ensemble call's state
        want = m(x)
        want.square().sum().backward()
        torch.testing.assert_close(out[i], want, **TOL, msg=f"member {i}")
        for (name, p), q in zip(ens.named_parameters(), m.parameters(), strict=True):
            torch.testing.assert_close(p.grad[i], q.grad, **TOL, msg=f"member {i} {name}")


DROPOUTS = {
    "Dropout": (nn.Dropout, "channels-last"),
    "Dropout1d": (nn.Dropout1d, "transposed"),
    "Dropout2d": (nn.Dropout2d, "channels-last"),
    "Dropout3d": (nn.Dropout3d, "channels-last-3d"),
    "FeatureAlphaDropout": (nn.FeatureAlphaDropout, "channels-last"),
    "FeatureAlphaDropout-transposed": (nn.FeatureAlphaDropout, "transposed"),
}


@pytest.mark.parametrize("name", list(DROPOUTS))
def test_dropouts_on_non_contiguous_inputs_draw_alones_masks(name: str) -> None:
    """p=0.5 in place and not under vmap; in chunks and p 0 and 1 for the first two."""
    layer, view = DROPOUTS[name]
    runs = [(0.5, False, "vmap"), (0.5, True, "vmap")]
    if name in ("Dropout", "Dropout1d"):
        runs += [(0.5, True, "chunk"), (0.0, True, "vmap"), (1.0, False, "chunk")]
    for p, inplace, kw in runs:
        factory, x = _dropped(lambda: layer(p, inplace=inplace), view)  # noqa: B023
        _assert_masks_as_alone(factory, x, **KWS[kw])


@pytest.mark.parametrize("view", ["channels-last", "transposed"])
def test_alpha_dropout_on_a_non_contiguous_input_draws_alones_mask_and_trains(view: str) -> None:
    """``ens(x)`` with randomness="same" gave each member another mask than alone (outputs 2-3
    off, silently), and make_step refused to train it ("draw into `.contiguous()` (or use ...
    nn.Dropout)"): a SELU network cannot swap in nn.Dropout. alpha_dropout alone draws into
    ``empty_like(input)`` as dropout does, which ``BatchableDropout`` already follows."""
    factory, x = _dropped(lambda: nn.AlphaDropout(0.5), view)
    _assert_masks_as_alone(factory, x)
    ens = vmapens.Ensemble(factory, N, seed=0)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=LR))
    step(x, torch.zeros(ens(x).shape[1:], dtype=F64))


# -- bf16 into norms without weights, autocast around them -------------------------------------

WEIGHTLESS = {
    "layer": lambda: nn.LayerNorm(4, elementwise_affine=False),
    "group": lambda: nn.GroupNorm(2, 4, affine=False),
}


@pytest.mark.parametrize("kw", ["vmap", "chunk"])
@pytest.mark.parametrize("norm", list(WEIGHTLESS))
def test_a_bf16_input_into_weightless_norms_gives_alones_bits(norm: str, kw: str) -> None:
    """No weight to take a dtype from: the twins run torch's own bf16 kernel, as alone; under
    autocast (a float32 Linear before it) too. Compared bit for bit, dtype included."""
    ens = vmapens.Ensemble(WEIGHTLESS[norm], N, seed=0, **KWS[kw])
    x = torch.randn(3, 4, 2, generator=torch.Generator().manual_seed(3)).to(BF16)
    if norm == "layer":
        x = x.transpose(1, 2)
    with torch.no_grad():
        together, predicted = ens(x), vmapens.predict(ens, x)
        for i in range(N):
            torch.testing.assert_close(together[i], ens[i](x), rtol=0, atol=0)
            torch.testing.assert_close(predicted[i], ens[i](x), rtol=0, atol=0)
    lin = vmapens.Ensemble(lambda: nn.Sequential(nn.Linear(4, 4), WEIGHTLESS["layer"]()), N, seed=0)
    h = torch.randn(5, 4)
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        out = lin(h)
        for i in range(N):
            torch.testing.assert_close(out[i], lin[i](h), rtol=0, atol=0)


class Lowered(nn.Module):
    """A float32 Linear, a norm without weights, a Linear: under autocast the norm gets the
    first Linear's bf16 output."""

    def __init__(self, norm: str) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(4, 16), nn.Linear(16, 2)
        self.norm = nn.LayerNorm(16, elementwise_affine=False) if norm == "layer" else (
            nn.GroupNorm(2, 4, affine=False))  # fmt: skip
        self.group = norm == "group"

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        h = self.norm(h.unflatten(1, (4, 4))).flatten(1) if self.group else self.norm(h)
        return self.out(h)


@pytest.mark.parametrize("norm", list(WEIGHTLESS))
def test_weightless_norms_under_autocast_give_alones_gradients(norm: str) -> None:
    """Outputs were bit for bit alone's; the gradients of the Linear before the norm 0.8-0.9%
    (relative) off, silently, where ``backend="loop"`` is exact."""
    ens = vmapens.Ensemble(lambda: Lowered(norm), N, seed=0)
    alone = ens.unstack()
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)
    with torch.autocast("cpu", dtype=BF16):
        out = ens(x)
    (out.float() - y).square().mean(dim=(1, 2)).sum().backward()
    for i, m in enumerate(alone):
        with torch.autocast("cpu", dtype=BF16):
            want = m(x)
        (want.float() - y).square().mean().backward()
        torch.testing.assert_close(out[i], want, rtol=0, atol=0)
        for (name, p), q in zip(ens.named_parameters(), m.parameters(), strict=True):
            torch.testing.assert_close(p.grad[i], q.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_precision_bf16_trains_a_weightless_layer_norm_as_alone() -> None:
    """Two Adam steps: 1.05e-4 off alone's autocast run (``backend="loop"``: 1.5e-8)."""
    ens = vmapens.Ensemble(lambda: Lowered("layer"), N, seeds=range(N))
    alone = seeded_members(lambda: Lowered("layer"), N)
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)) for _ in "ab"]
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-2),
                             precision="bf16")  # fmt: skip
    for x, y in data:
        step(x, y)
    for m in alone:
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        for x, y in data:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=BF16):
                loss = nn.functional.mse_loss(m(x), y)
            loss.backward()
            opt.step()
    for i, m in enumerate(alone):
        for key, want in m.state_dict().items():
            torch.testing.assert_close(ens[i].state_dict()[key], want, rtol=1e-5, atol=1e-6)


# -- the weight_norm twins: no member loop -----------------------------------------------------


@pytest.mark.parametrize("case", list(NORMED))
def test_weight_norm_twins_run_without_a_member_loop(case: str) -> None:
    """docs/semantics.md: the twins exist because the fused kernel made vmap loop over the
    members; each call still warned "There is a performance drop ... aten::norm_except_dim"
    (tests/test_weight_norm.py looks for "_weight_norm" only), and a user's
    ``warnings.simplefilter("error")`` makes the first step refuse the ensemble."""
    ens = vmapens.Ensemble(NORMED[case], N, seed=0).eval()  # eval: no power iteration
    x = torch.randn(2, 2, 4, dtype=F64)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = ens(x)
    assert not [str(w.message) for w in seen if "performance drop" in str(w.message)]
    for i in range(N):
        torch.testing.assert_close(out[i], ens[i].eval()(x), **TOL)
