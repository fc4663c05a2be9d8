"""Regression hunt over session 43's code, against N plain modules trained alone (float64).

1. ``nn.TransformerEncoder`` / ``nn.Transformer`` members: a subclass of the layer, a causal
   mask beside a padding mask, float masks, ``norm_first``, per-member masks in training, the
   fast path switched off, ``mask_check=False``;
2. channels-last members: built so, ``ens.to(memory_format=...)`` before and after the
   optimizer and after a step, Conv3d, ``vmapens.save``/``load`` and ``ens[i]``;
3. ``ens.apply``: in-place re-initialisation, replaced parameters, buffers, before and after
   the optimizer is made;
4. a step that fails partway (a bad target in one member, the forward raising, the optimizer's
   pre-hook raising), with ``chunk_size``, the loop and a scheduler: nothing changes, and the
   next steps train as members that never saw it. Gradient hooks on the stacked parameters.

Three bugs found (strict xfails at first), fixed in session 44: ``mask_check=False`` with a mask
not left aligned, and gradient hooks on the stacked parameters in the step.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from truth import assert_members_equal, seeded_members

import vmapens

pytestmark = pytest.mark.usefixtures("float64_default")

N = 3
TOL: dict[str, Any] = dict(rtol=1e-9, atol=1e-10)
E, H, FF, S, B = 8, 2, 16, 5, 2
PAD = torch.tensor([[False, False, False, True, True], [False] * 5])  # left aligned
NOT_ALIGNED = torch.tensor([[True, False, False, False, True], [False] * 5])


@contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _x(*shape: int, seed: int = 0) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _members(factory: Callable[[], nn.Module], train: bool = True) -> list[nn.Module]:
    with _quiet():
        return [m.train(train) for m in seeded_members(factory, N)]


def _ensemble(members: list[nn.Module], **kw: Any) -> vmapens.Ensemble:
    with _quiet():
        return vmapens.Ensemble.from_modules(copy.deepcopy(members), **kw)


def _alone(members: list[nn.Module], x: Tensor) -> Tensor:
    with torch.no_grad(), _quiet():
        return torch.stack([m(x) for m in members])


def _train_alone(
    members: list[nn.Module], x: Tensor, y: Tensor, k: int, loss: Callable = F.mse_loss,
    lr: float = 0.01,
) -> None:  # fmt: skip
    for m in members:
        opt = torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=lr)
        for _ in range(k):
            opt.zero_grad()
            with _quiet():
                value = loss(m(x), y)
            value.backward()
            opt.step()


# -- 1. transformers ---------------------------------------------------------------------------


class SubLayer(nn.TransformerEncoderLayer):
    """A user's layer class that keeps torch's forward."""


class Encoded(nn.Module):
    """An embedding, an encoder over a padded batch mean-pooled over every position, a head."""

    def __init__(
        self, pad: Tensor = PAD, layer: type = nn.TransformerEncoderLayer, causal: bool = False,
        norm_first: bool = False, mask_check: bool = True,
    ) -> None:  # fmt: skip
        super().__init__()
        block = layer(E, H, FF, dropout=0.0, batch_first=True, norm_first=norm_first)
        with _quiet():
            self.enc = nn.TransformerEncoder(block, 2, norm=nn.LayerNorm(E), mask_check=mask_check)
        self.emb, self.head = nn.Linear(E, E), nn.Linear(E, 1)
        self.pad, self.causal = pad, causal

    def forward(self, x: Tensor) -> Tensor:
        kw: dict[str, Any] = {}
        if self.causal:
            causal = torch.ones(S, S, dtype=torch.bool).triu(1)  # the padding mask's type
            kw = dict(mask=causal, is_causal=True)
        return self.head(self.enc(self.emb(x), src_key_padding_mask=self.pad, **kw).mean(1))


ENCODED: dict[str, Callable[[], nn.Module]] = {
    "sublayer": lambda: Encoded(layer=SubLayer),
    "causal-and-padding": lambda: Encoded(causal=True),
    "float-inf-padding": lambda: Encoded(pad=torch.where(PAD, float("-inf"), 0.0)),
    "norm-first": lambda: Encoded(norm_first=True),
    "not-aligned": lambda: Encoded(pad=NOT_ALIGNED),
}
OPTS: dict[str, dict] = {"vmap": {}, "chunks": {"chunk_size": 2}, "loop": {"backend": "loop"}}
ENCODED_RUNS = [(kind, "vmap") for kind in ENCODED] + [
    ("causal-and-padding", "chunks"),
    ("not-aligned", "loop"),
    ("sublayer", "chunks"),
]


@pytest.mark.parametrize(("kind", "opts"), ENCODED_RUNS)
def test_encoder_members_evaluate_and_train_in_eval_mode_as_alone(kind: str, opts: str) -> None:
    members = _members(ENCODED[kind], train=False)
    ens = _ensemble(members, **OPTS[opts]).eval()
    x, y = _x(B, S, E), _x(B, 1, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(ens(x), _alone(members, x), **TOL)
    with torch.inference_mode():
        torch.testing.assert_close(vmapens.predict(ens, x), _alone(members, x), **TOL)
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedAdam(ens, lr=0.01))
    for _ in range(2):
        step(x, y)
    _train_alone(members, x, y, 2)
    assert_members_equal(ens, members, **TOL)


def test_mask_check_off_with_a_mask_not_left_aligned_evaluates_as_alone() -> None:
    members = _members(lambda: Encoded(pad=NOT_ALIGNED, mask_check=False), train=False)
    ens = _ensemble(members).eval()
    x = _x(B, S, E)
    with torch.no_grad():
        torch.testing.assert_close(ens(x), _alone(members, x), **TOL)


def test_a_frozen_first_layer_over_a_trained_one_is_refused_as_alone_fails() -> None:
    # alone (eval, grad on) torch checks layer 0's flags only, takes the nested path and fails
    def make() -> nn.Module:
        m = Encoded()
        m.enc.layers[0].requires_grad_(False)
        m.emb.requires_grad_(False)
        return m

    members = _members(make, train=False)
    ens = _ensemble(members).eval()
    x, y = _x(B, S, E), _x(B, 1, seed=1)
    with pytest.raises(AssertionError), _quiet():
        F.mse_loss(members[0](x), y)
    before = {k: v.detach().clone() for k, v in ens.stacked_state().items()}
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedAdam(ens, lr=0.01))
    with pytest.raises(Exception, match="NestedTensor"):
        step(x, y)
    for k, v in ens.stacked_state().items():
        assert torch.equal(v, before[k]), k


class Seq2Seq(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with _quiet():
            self.t = nn.Transformer(E, H, 1, 1, FF, dropout=0.0, batch_first=True)
        self.head = nn.Linear(E, 1)

    def forward(self, x: Tensor, pad: Tensor) -> Tensor:
        tgt = x[:, :3]
        causal = nn.Transformer.generate_square_subsequent_mask(3)
        out = self.t(x, tgt, tgt_mask=causal, tgt_is_causal=True, src_key_padding_mask=pad)
        return self.head(out.mean(1))


@pytest.mark.parametrize(
    ("dtype", "opts"),
    [(torch.bool, "vmap"), (torch.float64, "vmap"), (torch.bool, "chunks")],
    ids=["bool", "float", "bool-chunks"],
)
def test_a_transformer_with_a_padding_mask_per_member_trains_as_alone(
    dtype: torch.dtype, opts: str
) -> None:
    members = _members(Seq2Seq)
    ens = _ensemble(members, **OPTS[opts])
    full = torch.zeros(B, S, dtype=torch.bool)
    masks = torch.stack([PAD, NOT_ALIGNED, full])
    if dtype != torch.bool:
        masks = torch.where(masks, float("-inf"), 0.0)
    x, y = _x(B, S, E), _x(B, 1, seed=1)
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedAdam(ens, lr=0.01), in_dims=0)
    for _ in range(2):
        step((x.expand(N, *x.shape), masks), y.expand(N, *y.shape))
    for i, m in enumerate(members):
        opt = torch.optim.Adam(m.parameters(), lr=0.01)
        for _ in range(2):
            opt.zero_grad()
            F.mse_loss(m(x, masks[i]), y).backward()
            opt.step()
    assert_members_equal(ens, members, **TOL)
    ens.eval()
    with torch.no_grad():
        got = ens(x, masks, in_dims=(None, 0))
    with torch.no_grad(), _quiet():
        want = torch.stack([m.eval()(x, masks[i]) for i, m in enumerate(members)])
    torch.testing.assert_close(got, want, **TOL)


def test_with_the_fast_path_off_a_frozen_encoder_evaluates_as_alone() -> None:
    def make() -> nn.Module:
        m = Encoded()
        m.enc.requires_grad_(False)
        return m

    members = _members(make, train=False)
    ens = _ensemble(members).eval()
    x = _x(B, S, E)
    was = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad():
            got = ens(x)
        want = _alone(members, x)
    finally:
        torch.backends.mha.set_fastpath_enabled(was)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(vmapens.predict(ens, x), _alone(members, x), **TOL)


# -- 2. channels-last --------------------------------------------------------------------------


class CNN(nn.Module):
    def __init__(self, fmt: torch.memory_format | None = None, d3: bool = False) -> None:
        super().__init__()
        conv, norm = (nn.Conv3d, nn.BatchNorm3d) if d3 else (nn.Conv2d, nn.BatchNorm2d)
        self.c = conv(3, 4, 3, padding=1, bias=False)  # no bias before BatchNorm: no grad
        self.bn, self.c2 = norm(4), conv(4, 2, 1)
        self.fc = nn.Linear(2 * 16 * (4 if d3 else 1), 2)
        if fmt is not None:
            self.to(memory_format=fmt)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.c2(torch.relu(self.bn(self.c(x)))).flatten(1))


WHEN = ["factory", "after-building", "after-optimizer", "after-a-step", "input-only"]
LAYOUTS = [(when, False) for when in WHEN] + [("factory", True), ("after-optimizer", True)]


@pytest.mark.parametrize(("when", "d3"), LAYOUTS)
def test_channels_last_members_train_save_and_load_as_alone(
    when: str, d3: bool, tmp_path: Any
) -> None:
    fmt = torch.channels_last_3d if d3 else torch.channels_last

    def make() -> nn.Module:
        return CNN(fmt if when == "factory" else None, d3)

    members = _members(make)
    ens = _ensemble(members)
    x = _x(5, 3, 4, 4, 4) if d3 else _x(5, 3, 4, 4)
    if when == "input-only":
        x = x.to(memory_format=fmt)
    y = _x(5, 2, seed=1)
    if when == "after-building":
        ens.to(memory_format=fmt)
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedAdam(ens, lr=0.05))
    if when == "after-optimizer":
        ens.to(memory_format=fmt)
    step(x, y)
    if when == "after-a-step":
        ens.to(memory_format=fmt)
    step(x, y)
    step(x, y)
    _train_alone(members, x, y, 3, lr=0.05)
    assert_members_equal(ens, members, **TOL)
    if when in ("factory", "after-building", "after-optimizer", "after-a-step"):
        assert ens[1].c.weight.is_contiguous(memory_format=fmt)
    vmapens.save(ens, tmp_path / "e.pt")
    loaded = vmapens.load(tmp_path / "e.pt", make)
    assert_members_equal(loaded, members, **TOL)
    for m in members:
        m.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(x), _alone(members, x), **TOL)
        torch.testing.assert_close(ens[2].eval()(x), _alone(members[2:], x)[0], **TOL)


# -- 3. apply ----------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(3, 5, bias=False)
        self.bn = nn.BatchNorm1d(5)
        self.fc2 = nn.Linear(5, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


def _linear(fn: Callable[[nn.Linear], Any]) -> Callable[[nn.Module], None]:
    return lambda m: fn(m) if isinstance(m, nn.Linear) else None


def _bn(fn: Callable[[nn.BatchNorm1d], Any]) -> Callable[[nn.Module], None]:
    return lambda m: fn(m) if isinstance(m, nn.BatchNorm1d) else None


APPLY: dict[str, Callable[[nn.Module], None]] = {
    "init-normal": _linear(lambda m: nn.init.normal_(m.weight)),
    "reset-parameters": lambda m: getattr(m, "reset_parameters", lambda: None)(),
    "replace-randn": _linear(
        lambda m: setattr(m, "weight", nn.Parameter(torch.randn_like(m.weight)))
    ),
    "replace-frozen": _linear(
        lambda m: setattr(m, "weight", nn.Parameter(2 * m.weight.detach(), requires_grad=False))
    ),
    "buffer-fill": _bn(lambda m: m.running_var.fill_(3.0)),
    "buffer-replaced": _bn(
        lambda m: setattr(m, "running_mean", torch.full_like(m.running_mean, 0.5))
    ),
    "count-fill": _bn(lambda m: m.num_batches_tracked.fill_(7)),
}


APPLY_RUNS = [
    ("init-normal", "after-optimizer"),
    ("reset-parameters", "after-steps"),
    ("replace-randn", "after-steps"),
    ("replace-randn", "new-optimizer"),
    ("replace-frozen", "before-optimizer"),
    ("buffer-fill", "after-steps"),
    ("buffer-replaced", "after-optimizer"),
    ("count-fill", "after-steps"),
]


@pytest.mark.parametrize(("kind", "when"), APPLY_RUNS)
def test_apply_then_training_on_as_alone(kind: str, when: str) -> None:
    fn = APPLY[kind]
    members = _members(MLP)
    ens = vmapens.Ensemble(MLP, N, seeds=range(N))
    x, y = _x(6, 3), _x(6, 2, seed=1)
    made: dict[str, Any] = {}

    def build() -> None:
        made["step"] = vmapens.make_step(
            ens, F.mse_loss, vmapens.StackedSGD(ens, lr=0.1, momentum=0.9)
        )
        made["opts"] = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in members]

    def both_apply() -> None:
        torch.manual_seed(123)
        ens.apply(fn)
        torch.manual_seed(123)
        for m in members:
            m.apply(fn)

    def train(k: int) -> None:
        for _ in range(k):
            made["step"](x, y)
            for m, o in zip(members, made["opts"], strict=True):
                o.zero_grad()
                F.mse_loss(m(x), y).backward()
                o.step()

    if when == "before-optimizer":
        both_apply()
        build()
        train(3)
    elif when == "after-optimizer":
        build()
        both_apply()
        train(3)
    else:
        build()
        train(2)
        both_apply()
        if when == "new-optimizer":
            build()
        train(2)
    assert_members_equal(ens, members, **TOL)
    ens.eval()
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m.eval()(x) for m in members]), **TOL)


# -- 4. a step that fails partway -------------------------------------------------------------


class Boom(Exception):
    pass


class Flagged(MLP):
    fail = False

    def __init__(self) -> None:
        super().__init__()
        self.fc2 = nn.Linear(5, 4)

    def forward(self, x: Tensor) -> Tensor:
        if Flagged.fail:
            raise Boom("the user's check in forward")
        return super().forward(x)


def _copied(v: Any) -> Any:
    return v.detach().clone() if isinstance(v, Tensor) else copy.deepcopy(v)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor):
        return isinstance(b, Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _snapshot(ens: vmapens.Ensemble, opt: Any, sched: Any) -> Any:
    state = {k: _copied(v) for k, v in ens.stacked_state().items()}
    return state, _copied(opt.state_dict()), _copied(sched.state_dict())


FAILS = ["bad-target-in-member-2", "forward-raises", "optimizer-pre-hook"]


FAIL_RUNS = [
    ("bad-target-in-member-2", "vmap", 1),
    ("bad-target-in-member-2", "chunks", 1),
    ("bad-target-in-member-2", "loop", 0),
    ("forward-raises", "vmap", 0),
    ("forward-raises", "chunks", 1),
    ("optimizer-pre-hook", "vmap", 1),
    ("optimizer-pre-hook", "chunks", 0),
]


@pytest.mark.parametrize(("fail", "opts", "at"), FAIL_RUNS)
def test_a_failed_step_changes_nothing_and_training_goes_on_as_alone(
    fail: str, opts: str, at: int
) -> None:
    members = _members(Flagged)
    ens = vmapens.Ensemble(Flagged, N, seeds=range(N), **OPTS[opts])
    opt = vmapens.StackedAdam(ens, lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7)
    step = vmapens.make_step(ens, F.cross_entropy, opt, in_dims=0)
    alone = [torch.optim.Adam(m.parameters(), lr=0.05) for m in members]
    scheds = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.7) for o in alone]
    x, y = _x(6, 3), torch.randint(0, 4, (6,), generator=torch.Generator().manual_seed(1))
    xs, ys = x.expand(N, 6, 3).clone(), y.expand(N, 6).clone()
    for k in range(3):
        if k == at:
            before = _snapshot(ens, opt, sched)
            grads = [p.grad for p in ens.parameters()]
            bad, hooks = ys, []
            if fail == "bad-target-in-member-2":
                bad = ys.clone()
                bad[2, 3] = 7  # out of range for 4 classes
            elif fail == "forward-raises":
                Flagged.fail = True
            else:

                def refuse(*_: Any) -> None:
                    raise Boom("the user's pre-hook")

                hooks.append(opt.register_step_pre_hook(refuse))
            try:
                with pytest.raises((IndexError, Boom)):
                    step(xs, bad)
            finally:
                Flagged.fail = False
                for h in hooks:
                    h.remove()
            assert _same(before, _snapshot(ens, opt, sched))
            assert all(g is p.grad for g, p in zip(grads, ens.parameters(), strict=True))
        step(xs, ys)
        sched.step()
        for m, o, s in zip(members, alone, scheds, strict=True):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
            s.step()
    assert_members_equal(ens, members, **TOL)


def _seq() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


@pytest.mark.parametrize(
    "opts",
    [
        pytest.param(OPTS["vmap"], id="vmap"),
        pytest.param(OPTS["chunks"], id="chunks"),
        pytest.param(OPTS["loop"], id="loop"),
    ],
)
def test_a_gradient_hook_on_a_stacked_parameter_acts_in_the_step_as_alone(opts: dict) -> None:
    def clamp(g: Tensor) -> Tensor:
        return g.clamp(-0.01, 0.01)  # elementwise: the same on the stack as on each member

    members = _members(_seq)
    for m in members:
        m[2].weight.register_hook(clamp)
    ens = vmapens.Ensemble(_seq, N, seeds=range(N), **opts)
    ens.stacked_params()["2.weight"].register_hook(clamp)
    x, y = _x(6, 3), 5 * _x(6, 2, seed=1)
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedSGD(ens, lr=0.1))
    step(x, y)
    for m in members:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        opt.zero_grad()
        F.mse_loss(m(x), y).backward()
        opt.step()
    assert_members_equal(ens, members, **TOL)


def _quarter(p: Tensor) -> None:
    assert p.grad is not None
    p.grad.mul_(0.25)


@pytest.mark.parametrize("manual", [True, False], ids=["manual-loop", "make_step"])
@pytest.mark.parametrize("opts", list(OPTS.values()), ids=list(OPTS))
def test_a_post_accumulate_grad_hook_on_a_stacked_parameter_acts_as_alone(
    manual: bool, opts: dict
) -> None:
    """Found by the hunt: the step sets `.grad` itself, and the hooks torch runs once a
    gradient is accumulated never ran (any backend; weights 0.12 apart after one SGD step)."""
    members = _members(_seq)
    for m in members:
        m[2].weight.register_post_accumulate_grad_hook(_quarter)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        opt.zero_grad()
        F.mse_loss(m(_x(6, 3)), 5 * _x(6, 2, seed=1)).backward()
        opt.step()
    ens = vmapens.Ensemble(_seq, N, seeds=range(N), **opts)
    ens.stacked_params()["2.weight"].register_post_accumulate_grad_hook(_quarter)
    opt = vmapens.StackedSGD(ens, lr=0.1)
    x, y = _x(6, 3), 5 * _x(6, 2, seed=1)
    if manual:
        opt.zero_grad()
        vmapens.per_member(F.mse_loss)(ens(x), y).sum().backward()
        opt.step()
    else:
        vmapens.make_step(ens, F.mse_loss, opt)(x, y)
    assert_members_equal(ens, members, **TOL)


@pytest.mark.parametrize("post", [False, True], ids=["register_hook", "post_accumulate"])
def test_a_gradient_hook_on_a_stacked_parameter_is_refused_by_the_compiled_step(
    post: bool,
) -> None:
    """The compiled step takes its gradients with torch.func and updates inside its graph: no
    hook runs there (a clamp was dropped, 0.08 apart), so it refuses them, nothing changed."""
    ens = vmapens.Ensemble(_seq, N, seeds=range(N))
    p = ens.stacked_params()["2.weight"]
    if post:
        p.register_post_accumulate_grad_hook(_quarter)
    else:
        p.register_hook(lambda g: g.clamp(-0.01, 0.01))
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedSGD(ens, lr=0.1), compile=True)
    with pytest.raises(vmapens.CompileFailed, match=r"`2\.weight`.*compile=False"):
        step(_x(6, 3), _x(6, 2, seed=1))
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k
