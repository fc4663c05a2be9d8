"""User modules the other tests never saw, trained in an ensemble against each one alone.

Every truth here is plain PyTorch: the same modules built alone (seeded as ``seeds=`` builds
the members) and trained with ``torch.optim`` on their own copy of each batch. Where vmap
cannot give that result, the ensemble must refuse before anything changes, naming the module
and the way out.
"""

from __future__ import annotations

import copy
from collections import namedtuple
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations
from truth import TOL64, assert_members_equal, float64_batches, seeded_members, train_each

import vmapens

N = 3
ROWS = 5

pytestmark = [
    pytest.mark.usefixtures("float64_default"),
    # Layers without a batching rule (bilinear, weight norm, embedding renorm) run member by
    # member with torch's performance warning, as docs/semantics.md says.
    pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),
]


def _sgd(ens: vmapens.Ensemble) -> vmapens.StackedSGD:
    return vmapens.StackedSGD(ens, lr=0.1)


def _torch_sgd(i: int, m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.1)


def _trained_alone(factory: Callable[[], nn.Module], batches: list) -> list[nn.Module]:
    """Each member alone with torch.optim.SGD, on its own copy of every batch."""
    models = seeded_members(factory, N)
    for m in models:
        train_each([m], copy.deepcopy(batches), nn.functional.mse_loss, _torch_sgd)
    return models


def _ints(rows: int, width: int, high: int) -> torch.Tensor:
    return torch.randint(0, high, (rows, width), generator=torch.Generator().manual_seed(1))


# -- modules that train as each member alone -------------------------------------------------


class _Bilinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Bilinear(4, 4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(x, x.flip(-1))


class _VmapSquare(torch.autograd.Function):
    """x ** 2 with a backward of 3 x g (not the true derivative: plain torch uses it)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x * x

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return 3 * x * g


class _WithFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(_VmapSquare.apply(self.a(x)))


class _Decoder(nn.Module):
    """nn.TransformerDecoderLayer with a causal mask and a memory padding mask."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        padding = torch.zeros(x.shape[0], 3, dtype=torch.bool)
        padding[:, -1] = True
        out = self.layer(
            x[:, :4],
            x[:, 4:],
            tgt_mask=nn.Transformer.generate_square_subsequent_mask(4),
            memory_key_padding_mask=padding,
            tgt_is_causal=True,
        )
        return out.mean(1)[:, :2]


class _CrossAttention(nn.Module):
    """kdim / vdim, bias_kv, zero attention and a key padding mask, weights returned."""

    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(
            8, 2, batch_first=True, kdim=6, vdim=5, add_bias_kv=True, add_zero_attn=True
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        padding = torch.zeros(x.shape[0], x.shape[1], dtype=torch.bool)
        padding[:, 0] = True
        out, weights = self.mha(x, x[..., :6], x[..., 3:], key_padding_mask=padding)
        return out.mean(1)[:, :2] + weights.mean((1, 2)).unsqueeze(-1)


_Pair = namedtuple("_Pair", "y extra")


class _NamedTupleOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        # A running mean kept out of the state_dict, moved in place by the forward.
        self.register_buffer("mean", torch.zeros(2), persistent=False)
        self.fc.register_forward_pre_hook(lambda m, args: (args[0] * 2,))

    def forward(self, x: torch.Tensor) -> _Pair:
        y = self.fc(x)
        self.mean.mul_(0.5).add_(0.5 * y.detach().mean(0))
        return _Pair(y - self.mean, None)


def _conv(*layers: nn.Module, flat: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(2, 4, 3, bias=False), *layers, nn.Flatten(), nn.Linear(flat, 2))


MODULES = [
    # (id, factory, input shape or ("int", width, vocabulary), loss on the output)
    ("group-norm", lambda: _conv(nn.GroupNorm(2, 4), flat=16), (2, 4, 4)),
    (
        "instance-norm-running-stats",
        lambda: _conv(nn.InstanceNorm2d(4, affine=True, track_running_stats=True), flat=16),
        (2, 4, 4),
    ),
    ("local-response-norm", lambda: _conv(nn.LocalResponseNorm(2), flat=16), (2, 4, 4)),
    ("rms-norm", lambda: nn.Sequential(nn.Linear(4, 6), nn.RMSNorm(6), nn.Linear(6, 2)), (4,)),
    (
        "conv-transpose-groups-output-padding",
        lambda: nn.Sequential(
            nn.ConvTranspose2d(4, 4, 3, stride=2, output_padding=1, groups=2),
            nn.Flatten(),
            nn.Linear(256, 2),
        ),
        (4, 3, 3),
    ),
    (
        "pixel-shuffle-unfold-fold-upsample",
        lambda: nn.Sequential(
            nn.Conv2d(2, 4, 1),
            nn.PixelShuffle(2),
            nn.Unfold(2),
            nn.Fold((8, 8), 2),
            nn.Upsample(scale_factor=0.5, mode="bilinear"),
            nn.Flatten(),
            nn.Linear(16, 2),
        ),
        (2, 4, 4),
    ),
    ("prelu", lambda: nn.Sequential(nn.Linear(4, 6), nn.PReLU(6), nn.Linear(6, 2)), (4,)),
    ("bilinear", _Bilinear, (4,)),
    (
        "embedding-padding-idx-max-norm",  # max_norm renormalises the weight in place
        lambda: nn.Sequential(
            nn.Embedding(6, 4, padding_idx=0, max_norm=0.5), nn.Flatten(), nn.Linear(12, 2)
        ),
        ("int", 3, 6),
    ),
    (
        "embedding-bag-max",
        lambda: nn.Sequential(nn.EmbeddingBag(6, 4, mode="max"), nn.Linear(4, 2)),
        ("int", 3, 6),
    ),
    (
        "orthogonal-and-weight-norm",
        lambda: nn.Sequential(
            parametrizations.orthogonal(nn.Linear(4, 4)),
            nn.Tanh(),
            parametrizations.weight_norm(nn.Linear(4, 2)),
        ),
        (4,),
    ),
    ("autograd-function-vmap-rule", _WithFunction, (4,)),
    ("decoder-layer-masks", _Decoder, (7, 8)),
    ("attention-kdim-vdim-bias-kv-padding", _CrossAttention, (4, 8)),
    ("namedtuple-out-non-persistent-buffer-pre-hook", _NamedTupleOut, (4,)),
]


@pytest.mark.parametrize(
    ("factory", "shape"), [c[1:] for c in MODULES], ids=[c[0] for c in MODULES]
)
def test_modules_train_as_each_member_alone(factory, shape):
    g = torch.Generator().manual_seed(0)
    batches = [
        (
            torch.randint(0, shape[2], (ROWS, shape[1]), generator=g)
            if shape[0] == "int"
            else torch.randn(ROWS, *shape, generator=g),
            torch.randn(ROWS, 2, generator=g),
        )
        for _ in range(2)
    ]

    def loss(out, y):
        return nn.functional.mse_loss(out.y if isinstance(out, _Pair) else out, y)

    ens = vmapens.Ensemble(factory, n=N, seeds=range(N))
    step = vmapens.make_step(ens, loss, _sgd(ens))
    for x, y in batches:
        step(x, y)
    models = seeded_members(factory, N)
    train_each(models, batches, loss, _torch_sgd)
    assert_members_equal(ens, models)


# -- a forward that edits its input in place ---------------------------------------------------


class _DoublesInput(nn.Module):
    """``x.mul_(2)`` on its input: alone, the member sees 2 x and leaves 2 x to the caller."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return torch.tanh(self.fc(x))


def test_a_forward_that_edits_its_shared_input_trains_as_alone():
    """The probe's run of member 0 alone doubled the batch before the ensemble's run, which
    then saw 4 x and refused a step that is exact: one vmap edits the input once."""
    batches = float64_batches(3, ROWS, 4, 2)
    models = _trained_alone(_DoublesInput, batches)
    ens = vmapens.Ensemble(_DoublesInput, n=N, seeds=range(N))
    step = vmapens.make_step(ens, nn.MSELoss(), _sgd(ens))
    for x, y in batches:
        given = x.clone()
        step(x, y)
        torch.testing.assert_close(x, 2 * given, rtol=0, atol=0)  # edited once, as alone
    assert_members_equal(ens, models)


def test_check_leaves_an_input_its_forward_edits_as_it_was():
    ens = vmapens.Ensemble(_DoublesInput, n=N, seeds=range(N))
    x, y = float64_batches(1, ROWS, 4, 2)[0]
    given = x.clone()
    vmapens.check(ens, x, y, nn.MSELoss())
    torch.testing.assert_close(x, given, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("options", "how"),
    [({"backend": "loop"}, "backend='loop'"), ({"chunk_size": 1}, "chunk_size=1")],
    ids=["loop", "chunked"],
)
def test_editing_a_shared_input_in_turns_is_refused_and_nothing_changes(options, how):
    """Members in turns on one batch: member 1 saw 4 x (chunked: silently, 3 lr-sized
    differences; loop: autograd's in-place error, pointing at the inputs)."""
    ens = vmapens.Ensemble(_DoublesInput, n=N, seeds=range(N), **options)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    x, y = float64_batches(1, ROWS, 4, 2)[0]
    given = x.clone()
    step = vmapens.make_step(ens, nn.MSELoss(), _sgd(ens))
    with pytest.raises(RuntimeError, match=rf"^step: .*_DoublesInput edits .*{how}.*x\.clone"):
        step(x, y)
    torch.testing.assert_close(x, given, rtol=0, atol=0)
    for k, v in ens.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


def test_editing_per_member_data_in_turns_trains_as_alone():
    """With ``in_dims=0`` each member edits its own rows once: exact in turns too."""
    x, y = float64_batches(1, N * ROWS, 4, 2)[0]
    x, y = x.view(N, ROWS, 4), y.view(N, ROWS, 2)
    models = seeded_members(_DoublesInput, N)
    for i, m in enumerate(models):
        train_each([m], [(x[i].clone(), y[i])], nn.functional.mse_loss, _torch_sgd)
    ens = vmapens.Ensemble(_DoublesInput, n=N, seeds=range(N), chunk_size=1)
    vmapens.make_step(ens, nn.MSELoss(), _sgd(ens), in_dims=0)(x, y)
    assert_members_equal(ens, models)


# -- backward hooks the module registers itself -------------------------------------------------


class _BackwardHooked(nn.Module):
    """Scales the gradients through ``fc`` with module backward hooks (never fired under
    vmap: members trained without them)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.fc = nn.Linear(4, 4), nn.Linear(4, 2)
        self.fc.register_full_backward_pre_hook(lambda m, g_out: (g_out[0] * 3,))
        self.fc.register_full_backward_hook(lambda m, g_in, g_out: (g_in[0] * 0.5,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(self.a(x)))


def test_backward_hooks_are_refused_under_vmap_and_fire_with_the_loop_backend():
    x, y = float64_batches(1, ROWS, 4, 2)[0]
    ens = vmapens.Ensemble(_BackwardHooked, n=N, seeds=range(N))
    with pytest.raises(RuntimeError, match=r"`fc` \(Linear\) has a backward hook.*backend='loop'"):
        ens(x).sum().backward()
    assert all(p.grad is None for p in ens.parameters())
    with pytest.raises(RuntimeError, match=r"`fc` \(Linear\) has a backward hook"):
        vmapens.make_step(ens, nn.MSELoss(), _sgd(ens))(x, y)
    with torch.no_grad():  # no backward: the hooks have nothing to miss
        out = ens(x)
    models = seeded_members(_BackwardHooked, N)
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(x), **TOL64)

    looped = vmapens.Ensemble(_BackwardHooked, n=N, seeds=range(N), backend="loop")
    step = vmapens.make_step(looped, nn.MSELoss(), _sgd(looped))
    batches = float64_batches(2, ROWS, 4, 2)
    for xb, yb in batches:
        step(xb, yb)
    train_each(models, batches, nn.functional.mse_loss, _torch_sgd)
    assert_members_equal(looped, models)


# -- what vmap cannot run: the error says what it is and the way out ------------------------------


class _OldSquare(torch.autograd.Function):
    """An autograd.Function written the old way: forward(ctx, ...), no setup_context."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return 2 * x * g


class _WithOldFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _OldSquare.apply(self.fc(x))


class _GradientReversal(nn.Module):
    """Flips the gradient of its hidden layer with a tensor hook (domain-adversarial nets)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.fc = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h.register_hook(lambda g: -g)
        return self.fc(h)


class _CountsToo(nn.Module):
    """Returns a Python number next to its tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> dict:
        return {"y": self.fc(x), "count": 3}


UNBATCHABLE = [
    # (id, factory, pattern)
    ("old-autograd-function", _WithOldFunction, r"setup_context.*backend='loop'"),
    ("tensor-hook", _GradientReversal, r"register_hook.*backend='loop'"),
]


@pytest.mark.parametrize(
    ("factory", "pattern"), [c[1:] for c in UNBATCHABLE], ids=[c[0] for c in UNBATCHABLE]
)
def test_what_vmap_cannot_run_is_named_with_the_way_out(factory, pattern):
    """These said "check the inputs against one member run alone", which runs fine."""
    x, y = float64_batches(1, ROWS, 4, 2)[0]
    ens = vmapens.Ensemble(factory, n=N, seeds=range(N))
    with pytest.raises(
        RuntimeError, match=rf"^Ensemble: the forward of {factory.__name__} .*{pattern}"
    ):
        ens(x)
    for check in (False, True):
        step = vmapens.make_step(ens, nn.MSELoss(), _sgd(ens), check=check)
        with pytest.raises(RuntimeError, match=rf"^step: the forward of .*{pattern}"):
            step(x, y)


@pytest.mark.parametrize("backend", ["vmap", "loop"])
def test_a_number_in_the_output_trains_as_alone_and_the_forward_names_it(backend):
    """The step trains on it (only the loss leaves the member map); the probe's run returned
    the whole output from the member map and refused it. The forward itself cannot stack a
    number: it said "check the inputs" (vmap) or torch.stack's TypeError (loop)."""
    batches = float64_batches(2, ROWS, 4, 2)

    def loss(out: dict, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out["y"], target) * out["count"]

    ens = vmapens.Ensemble(_CountsToo, n=N, seeds=range(N), backend=backend)
    with pytest.raises(
        RuntimeError,
        match=r"^Ensemble: the forward of _CountsToo returns something other than tensors",
    ):
        ens(batches[0][0])
    step = vmapens.make_step(ens, loss, _sgd(ens))
    for x, y in batches:
        step(x, y)
    models = seeded_members(_CountsToo, N)
    train_each(models, batches, loss, _torch_sgd)
    assert_members_equal(ens, models)


@pytest.mark.parametrize("factory", [_WithOldFunction, _GradientReversal], ids=["function", "hook"])
def test_the_way_out_trains_as_alone(factory):
    batches = float64_batches(2, ROWS, 4, 2)
    ens = vmapens.Ensemble(factory, n=N, seeds=range(N), backend="loop")
    step = vmapens.make_step(ens, nn.MSELoss(), _sgd(ens))
    for x, y in batches:
        step(x, y)
    assert_members_equal(ens, _trained_alone(factory, batches))


def test_an_in_place_write_into_a_shared_tensor_gets_the_hint_under_vmap():
    class WritesIntoInput(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 2)
            self.shift = nn.Parameter(torch.randn(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x.clone().add_(self.shift))

    x = float64_batches(1, ROWS, 4, 2)[0][0]
    with pytest.raises(RuntimeError, match=r"ens\[0\]\(inputs\)\. If it runs alone.*x = x \+ "):
        vmapens.Ensemble(WritesIntoInput, n=N, seeds=range(N))(x)


class _LeafBranch(nn.Module):
    """Branches on ``is_leaf``: a member's tensor in the loop backend is a row of the stack."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * (2.0 if self.fc.weight.is_leaf else 1.0)


def test_the_loop_backends_probe_does_not_point_to_the_loop_backend():
    x, y = float64_batches(1, ROWS, 4, 2)[0]
    ens = vmapens.Ensemble(_LeafBranch, n=N, seeds=range(N), backend="loop")
    with pytest.raises(RuntimeError, match=r"computes something else") as caught:
        vmapens.check(ens, x, y, nn.MSELoss())
    assert "Build the ensemble with backend='loop'" not in str(caught.value)
    assert "check=False" in str(caught.value)


@pytest.mark.parametrize("backend", ["vmap", "loop"])
def test_spectral_norm_trains_as_alone_with_either_backend(backend):
    """Its power iteration writes with ``out=``, which vmap cannot batch: the runner holds a
    twin that writes the same vectors with ``copy_`` (vmapens/_spectral.py; more cases in
    tests/test_spectral.py). The old-style ``nn.utils.spectral_norm`` still needs
    ``backend='loop'``: tests/test_hunt_ensemble.py."""

    def factory() -> nn.Module:
        return nn.Sequential(
            parametrizations.spectral_norm(nn.Linear(4, 5)), nn.Tanh(), nn.Linear(5, 2)
        )

    batches = float64_batches(2, ROWS, 4, 2)
    ens = vmapens.Ensemble(factory, n=N, seeds=range(N), backend=backend)
    step = vmapens.make_step(ens, nn.MSELoss(), _sgd(ens))
    for x, y in batches:
        step(x, y)
    assert_members_equal(ens, _trained_alone(factory, batches))


def _zero_grad(p: torch.Tensor) -> None:
    p.grad.zero_()


class _ParameterHook(nn.Module):
    """A module that puts a hook on its own weight: alone, the weight never moves."""

    def __init__(self, post_accumulate: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        if post_accumulate:
            self.fc.weight.register_post_accumulate_grad_hook(_zero_grad)
        else:
            self.fc.weight.register_hook(lambda g: g * 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


@pytest.mark.parametrize("post_accumulate", [False, True])
def test_a_hook_on_a_parameter_is_refused_when_stacking(post_accumulate):
    # Alone the hook keeps the weight fixed; the stacked tensors would train without it.
    alone = _ParameterHook(post_accumulate)
    before = alone.fc.weight.detach().clone()
    opt = torch.optim.SGD(alone.parameters(), lr=0.1)
    nn.functional.mse_loss(alone(torch.randn(5, 4)), torch.randn(5, 2)).backward()
    opt.step()
    assert torch.equal(alone.fc.weight, before)
    with pytest.raises(ValueError, match=r"member 0's tensor `fc.weight` has a hook"):
        vmapens.Ensemble(lambda: _ParameterHook(post_accumulate), 3, seed=0)
    with pytest.raises(ValueError, match=r"Ensemble.from_modules: member 0's tensor `fc.weight`"):
        vmapens.Ensemble.from_modules([_ParameterHook(post_accumulate) for _ in range(2)])
