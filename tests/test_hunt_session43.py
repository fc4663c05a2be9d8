"""Regression hunt around session 43's changes, against N plain modules alone (or torch itself).

1. the ``nn.TransformerEncoder`` twin (``vmapens/_encoder_twin.py``): round trips (deepcopy,
   ``torch.save``, ``vmapens.save``/``load``, ``select``, ``ens[i]``, ``unstack``, member
   files), padded members, chunks, the loop, ``mask_check=False``, ``enable_nested_tensor=False``,
   ``nn.Transformer``, a frozen-encoder probe trained with an embedding in front;
2. ``ens.apply`` replacing a parameter: padded members, a tied parameter, a step built before,
   ``save``/``load``;
3. ``undo_point``: a torch optimizer refused mid-step (SGD momentum, Adam amsgrad, a tensor
   ``lr``, RMSprop, ASGD; a scheduler attached), LBFGS;
4. ``Draws``: generators in lists/dicts/kwargs of the call, on child modules, in a list the
   module holds;
5. ``stacked_like``: channels_last_3d, format round trips, padded members, mixed layouts;
6. ``failure_alone``: a bad target in member 1 only (``in_dims=0``), a loss reading kept state,
   exception classes of other signatures.

The eight bugs found here were fixed in the same session (each test below failed before).
float64 throughout.
"""

from __future__ import annotations

import copy
import io
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from truth import assert_members_equal, factory_members, seeded_members

import vmapens

pytestmark = pytest.mark.usefixtures("float64_default")

N = 3
TOL: dict[str, Any] = dict(rtol=1e-9, atol=1e-10)
E, H, FF, S, B = 8, 2, 16, 5, 2
PAD = torch.tensor([[False, False, False, True, True], [False] * 5])  # left aligned


@contextmanager
def _quiet() -> Iterator[None]:
    """torch's own warnings alone (the nested-tensor prototype warning, enable_nested_tensor)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _x(*shape: int, seed: int = 0) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# -- 1. the encoder twin --------------------------------------------------------------------


class Pooled(nn.Module):
    """An encoder over a left-aligned padded batch, mean-pooled over every position (so the
    padded positions show), then a head."""

    def __init__(self, width: int = FF, enc: type = nn.TransformerEncoder, **kw: Any) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(E, H, width, dropout=0.0, batch_first=True)
        with _quiet():
            self.enc = enc(layer, 1, norm=nn.LayerNorm(E), **kw)
        self.head = nn.Linear(E, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.enc(x, src_key_padding_mask=PAD).mean(1))


def _eval_members(factory: Callable[[], nn.Module]) -> list[nn.Module]:
    return [m.eval() for m in seeded_members(factory, N)]


def _alone(members: list[nn.Module], x: Tensor) -> Tensor:
    with torch.no_grad(), _quiet():
        return torch.stack([m(x) for m in members])


def _ens_out(ens: Any, x: Tensor) -> Tensor:
    with torch.no_grad():
        return ens(x)


def _torch_round_trip(ens: vmapens.Ensemble) -> vmapens.Ensemble:
    buf = io.BytesIO()
    torch.save(ens, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _vmapens_round_trip(ens: vmapens.Ensemble, tmp_path: Any) -> vmapens.Ensemble:
    vmapens.save(ens, tmp_path / "ens.pt")
    return vmapens.load(tmp_path / "ens.pt", lambda: Pooled()).eval()


TRIPS: dict[str, Callable[[vmapens.Ensemble, Any], vmapens.Ensemble]] = {
    "deepcopy": lambda e, _: copy.deepcopy(e),
    "torch.save": lambda e, _: _torch_round_trip(e),
    "vmapens.save": _vmapens_round_trip,
    "select": lambda e, _: e.select([2, 0, 1]),
}


@pytest.mark.parametrize("trip", list(TRIPS))
def test_encoder_twin_survives_round_trips_as_each_member_alone(trip: str, tmp_path: Any) -> None:
    members = _eval_members(Pooled)
    x = _x(B, S, E)
    ens = TRIPS[trip](vmapens.Ensemble.from_modules(copy.deepcopy(members)).eval(), tmp_path)
    order = [2, 0, 1] if trip == "select" else [0, 1, 2]
    torch.testing.assert_close(_ens_out(ens, x), _alone([members[i] for i in order], x), **TOL)


def test_encoder_members_handed_back_are_the_users_class_and_compute_as_alone(
    tmp_path: Any,
) -> None:
    members = _eval_members(Pooled)
    x = _x(B, S, E)
    ens = vmapens.Ensemble.from_modules(copy.deepcopy(members)).eval()
    want = _alone(members, x)
    handed = [ens[1], *ens.unstack()]
    assert all(type(m.enc) is nn.TransformerEncoder for m in handed)
    torch.testing.assert_close(_alone([handed[0]], x)[0], want[1], **TOL)
    torch.testing.assert_close(_alone(handed[1:], x), want, **TOL)
    vmapens.save_members(ens, tmp_path / "m")
    plain = Pooled().eval()
    plain.load_state_dict(vmapens.load_members(tmp_path / "m")[2])
    torch.testing.assert_close(_alone([plain], x)[0], want[2], **TOL)


ENCODERS: dict[str, tuple[Callable[[], nn.Module], dict]] = {
    "mask_check=False": (lambda: Pooled(mask_check=False), {}),
    "nested off": (lambda: Pooled(enable_nested_tensor=False), {}),
    "chunk_size": (Pooled, {"chunk_size": 2}),
    "loop": (Pooled, {"backend": "loop"}),
}


@pytest.mark.parametrize("kind", list(ENCODERS))
def test_encoder_variants_evaluate_as_each_member_alone(kind: str) -> None:
    factory, opts = ENCODERS[kind]
    members = _eval_members(factory)
    x = _x(B, S, E)
    ens = vmapens.Ensemble.from_modules(copy.deepcopy(members), **opts).eval()
    torch.testing.assert_close(_ens_out(ens, x), _alone(members, x), **TOL)


class Seq2Seq(nn.Module):
    """nn.Transformer, the decoder reading the memory without a memory padding mask."""

    def __init__(self) -> None:
        super().__init__()
        with _quiet():
            self.t = nn.Transformer(E, H, 1, 1, FF, dropout=0.0, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.t(x, x[:, :3], src_key_padding_mask=PAD).mean(1)


def test_a_transformer_whose_memory_is_read_everywhere_evaluates_as_alone() -> None:
    members = _eval_members(Seq2Seq)
    x = _x(B, S, E)
    ens = vmapens.Ensemble.from_modules(copy.deepcopy(members)).eval()
    torch.testing.assert_close(_ens_out(ens, x), _alone(members, x), **TOL)


def test_padded_encoders_of_different_widths_evaluate_as_each_member_alone() -> None:
    factories = [lambda w=w: Pooled(width=w) for w in (8, 16, 12)]
    members = [m.eval() for m in factory_members(factories, seed=0)]
    ens = vmapens.Ensemble.from_factories(factories, seed=0).eval()
    x = _x(B, S, E)
    torch.testing.assert_close(_ens_out(ens, x), _alone(members, x), **TOL)
    assert all(type(m.enc) is nn.TransformerEncoder for m in ens.unstack())
    torch.testing.assert_close(_alone([ens[0]], x)[0], _alone(members[:1], x)[0], **TOL)


class Probe(nn.Module):
    """A trained embedding, a frozen encoder in eval mode, a trained head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(E, E)
        self.body = Pooled()
        self.body.enc.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        return self.body(self.emb(x))


@pytest.mark.parametrize("opts", [{}, {"chunk_size": 2}], ids=["vmap", "chunks"])
def test_a_probe_behind_a_trained_embedding_trains_as_alone(opts: dict) -> None:
    # the encoder's input needs a gradient: alone torch takes the plain path, padded computed
    members = _eval_members(Probe)
    ens = vmapens.Ensemble.from_modules(copy.deepcopy(members), **opts).eval()
    x, y = _x(B, S, E), _x(B, 1, seed=1)
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedAdam(ens, lr=0.05))
    opts_ = [torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=0.05)
             for m in members]  # fmt: skip
    for _ in range(2):
        loss = step(x, y)
        want = []
        for m, o in zip(members, opts_, strict=True):
            o.zero_grad()
            with _quiet():
                value = F.mse_loss(m(x), y)
            value.backward()
            o.step()
            want.append(value.detach())
        torch.testing.assert_close(loss, torch.stack(want), **TOL)
    assert_members_equal(ens, members, **TOL)


class MyEncoder(nn.TransformerEncoder):
    """A subclass that keeps torch's forward (a user's own encoder class)."""


def test_a_subclass_of_transformer_encoder_evaluates_as_each_member_alone() -> None:
    members = _eval_members(lambda: Pooled(enc=MyEncoder))
    x = _x(B, S, E)
    ens = vmapens.Ensemble.from_modules(copy.deepcopy(members)).eval()
    torch.testing.assert_close(_ens_out(ens, x), _alone(members, x), **TOL)
    assert type(ens[0].enc) is MyEncoder  # the member is the user's class
    buffer = io.BytesIO()
    torch.save(ens, buffer)
    buffer.seek(0)
    for again in (copy.deepcopy(ens), torch.load(buffer, weights_only=False)):
        torch.testing.assert_close(_ens_out(again, x), _alone(members, x), **TOL)


class OwnForward(nn.TransformerEncoder):
    """A subclass with a forward of its own that calls torch's through super()."""

    def forward(self, src: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return super().forward(src * 2, *args, **kwargs)


def test_a_subclass_with_its_own_forward_evaluates_as_each_member_alone() -> None:
    members = _eval_members(lambda: Pooled(enc=OwnForward))
    x = _x(B, S, E)
    ens = vmapens.Ensemble.from_modules(copy.deepcopy(members)).eval()
    torch.testing.assert_close(_ens_out(ens, x), _alone(members, x), **TOL)


class Causal(Pooled):
    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.enc(x, src_key_padding_mask=PAD, is_causal=True).mean(1))


def test_an_is_causal_hint_without_mask_evaluates_as_each_member_alone() -> None:
    members = _eval_members(Causal)
    x = _x(B, S, E)
    want = _alone(members, x)  # runs alone
    ens = vmapens.Ensemble.from_modules(copy.deepcopy(members)).eval()
    torch.testing.assert_close(_ens_out(ens, x), want, **TOL)


# -- 2. apply replacing a parameter -----------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, hidden: int = 4) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(3, hidden), nn.Linear(hidden, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def _fresh_hidden_bias(m: nn.Module) -> None:
    if isinstance(m, nn.Linear) and m.out_features != 2:
        m.bias = nn.Parameter(torch.full_like(m.bias, 0.3))


def _train_both(step: Callable, ens_opt_alone: list, x: Tensor, y: Tensor, k: int,
                clip: float | None = None) -> None:  # fmt: skip
    for _ in range(k):
        step(x, y)
        for m, o in ens_opt_alone:
            m.zero_grad()  # set_to_none on every parameter: each step's gradients, as the step
            F.mse_loss(m(x), y).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
            o.step()


def test_apply_replacing_a_parameter_of_padded_members_then_save_load_as_alone(
    tmp_path: Any,
) -> None:
    factories = [lambda h=h: MLP(h) for h in (3, 5, 4)]
    alone = factory_members(factories, seed=0)
    ens = vmapens.Ensemble.from_factories(factories, seed=0)
    x, y = _x(6, 3), _x(6, 2, seed=1)
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedAdam(ens, lr=0.05))
    pairs = [(m, torch.optim.Adam(m.parameters(), lr=0.05)) for m in alone]
    _train_both(step, pairs, x, y, 2)
    ens.apply(_fresh_hidden_bias)
    for m in alone:
        m.apply(_fresh_hidden_bias)
    _train_both(step, pairs, x, y, 2)  # the optimizers made before: the new bias stays
    assert all(torch.equal(m.fc1.bias, torch.full_like(m.fc1.bias, 0.3)) for m in alone)
    assert_members_equal(ens, alone, **TOL)
    vmapens.save(ens, tmp_path / "e.pt")
    loaded = vmapens.load(tmp_path / "e.pt", factories)
    assert_members_equal(loaded, alone, **TOL)
    torch.testing.assert_close(_ens_out(loaded, x), _alone(alone, x), **TOL)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(x)))


def test_apply_replacing_a_tied_parameter_in_both_places_trains_as_alone() -> None:
    def both(m: nn.Module) -> None:
        if isinstance(m, Tied):
            w = nn.Parameter(m.a.weight.detach() * 2)
            m.a.weight = w
            m.b.weight = w

    alone = seeded_members(Tied, N)
    ens = vmapens.Ensemble(Tied, N, seeds=range(N))
    ens.apply(both)
    for m in alone:
        m.apply(both)
    x, y = _x(6, 4), _x(6, 4, seed=1)
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedAdam(ens, lr=0.05))
    _train_both(step, [(m, torch.optim.Adam(m.parameters(), lr=0.05)) for m in alone], x, y, 2)
    assert_members_equal(ens, alone, **TOL)
    member = ens[1]
    assert member.a.weight is member.b.weight


def test_apply_untying_a_parameter_is_refused_changing_nothing() -> None:
    def untie(m: nn.Module) -> None:
        if isinstance(m, Tied):
            m.a.weight = nn.Parameter(m.a.weight.detach() * 2)  # b keeps the old one alone

    ens = vmapens.Ensemble(Tied, N, seeds=range(N))
    before = {k: (t, t.detach().clone()) for k, t in ens.stacked_state().items()}
    with pytest.raises(ValueError, match="b.weight"):
        ens.apply(untie)
    for k, t in ens.stacked_state().items():
        assert t is before[k][0] and torch.equal(t, before[k][1]), k
    x = _x(6, 4)
    torch.testing.assert_close(_ens_out(ens, x), _alone(seeded_members(Tied, N), x), **TOL)


def test_a_step_with_clipping_built_before_apply_clips_as_alone() -> None:
    alone = [m for m in seeded_members(MLP, N)]
    ens = vmapens.Ensemble(MLP, N, seeds=range(N))
    x, y = _x(6, 3), 5 * _x(6, 2, seed=1)
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedSGD(ens, lr=0.1), clip_grad_norm=0.5)
    pairs = [(m, torch.optim.SGD(m.parameters(), lr=0.1)) for m in alone]
    _train_both(step, pairs, x, y, 1, clip=0.5)
    ens.apply(_fresh_hidden_bias)
    for m in alone:
        m.apply(_fresh_hidden_bias)
    _train_both(step, pairs, x, y, 2, clip=0.5)
    assert_members_equal(ens, alone, grads=True, **TOL)


# -- 3. a refused step with a plain torch optimizer --------------------------------------------


class CheckFailed(Exception):
    pass


def _flaky(base: type) -> type:
    class Flaky(base):  # type: ignore[misc, valid-type]
        """The user's optimizer: torch's update, then a check of its own that can fail."""

        fail = False

        def step(self, closure: Any = None) -> Any:
            out = super().step(closure)
            if self.fail:
                raise CheckFailed("the user's check after the update failed")
            return out

    return Flaky


def _snapshot(opt: torch.optim.Optimizer) -> Any:
    def copied(v: Any) -> Any:
        return v.detach().clone() if isinstance(v, Tensor) else copy.deepcopy(v)

    state = {id(p): {k: copied(v) for k, v in s.items()} for p, s in opt.state.items()}
    groups = [{k: copied(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return state, groups


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor):
        return isinstance(b, Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


OPTIMIZERS: dict[str, tuple[type, Callable[[], dict]]] = {
    "sgd-nesterov": (torch.optim.SGD, lambda: dict(lr=0.1, momentum=0.9, nesterov=True)),
    "adam-amsgrad": (torch.optim.Adam, lambda: dict(lr=0.05, amsgrad=True)),
    "adam-tensor-lr": (torch.optim.Adam, lambda: dict(lr=torch.tensor(0.05), foreach=False)),
    "rmsprop-centered": (torch.optim.RMSprop, lambda: dict(lr=0.01, centered=True, momentum=0.5)),
    "asgd": (torch.optim.ASGD, lambda: dict(lr=0.05, t0=1)),
}


@pytest.mark.parametrize("at", [0, 1], ids=["first-step", "later-step"])
@pytest.mark.parametrize("scheduler", [False, True], ids=["", "steplr"])
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_a_step_refused_by_the_optimizer_changes_nothing_and_trains_on_as_alone(
    kind: str, scheduler: bool, at: int
) -> None:
    cls, kw = OPTIMIZERS[kind]
    alone = seeded_members(MLP, N)
    ens = vmapens.Ensemble(MLP, N, seeds=range(N))
    opt = _flaky(cls)(ens.parameters(), **kw())
    opts = [cls(m.parameters(), **kw()) for m in alone]
    scheds = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5) for o in [opt, *opts]] * scheduler
    step = vmapens.make_step(ens, F.mse_loss, opt)
    x, y = _x(6, 3), _x(6, 2, seed=1)
    for k in range(3):
        if k == at:  # refused: everything as it was, the optimizer's own objects kept
            before, held = _snapshot(opt), opt.param_groups[0]
            objects = {id(p): {n: id(v) for n, v in s.items()} for p, s in opt.state.items()}
            params = [p.detach().clone() for p in ens.parameters()]
            grads = [p.grad for p in ens.parameters()]
            opt.fail = True
            with pytest.raises(CheckFailed):
                step(x, y)
            opt.fail = False
            assert _same(before, _snapshot(opt))
            assert opt.param_groups[0] is held
            assert objects == {
                id(p): {n: id(v) for n, v in s.items()} for p, s in opt.state.items()
            }
            assert all(torch.equal(a, b) for a, b in zip(params, ens.parameters(), strict=True))
            assert all(g is p.grad for g, p in zip(grads, ens.parameters(), strict=True))
        step(x, y)
        for m, o in zip(alone, opts, strict=True):
            o.zero_grad()
            F.mse_loss(m(x), y).backward()
            o.step()
        for s in scheds:
            s.step()
    assert_members_equal(ens, alone, **TOL)
    assert _same(_snapshot(opt)[1], _snapshot(opts[0])[1])


def test_lbfgs_is_refused_at_make_step_creating_nothing() -> None:
    ens = vmapens.Ensemble(MLP, N, seeds=range(N))
    opt = torch.optim.LBFGS(ens.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in ens.stacked_state().items()}
    with pytest.raises(TypeError, match="LBFGS is not elementwise"):
        vmapens.make_step(ens, F.mse_loss, opt)
    assert not opt.state
    assert all(torch.equal(v, before[k]) for k, v in ens.stacked_state().items())


# -- 4. generators put back between turns ------------------------------------------------------


class NoiseArgs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: Tensor, gens: Any = (), g: torch.Generator | None = None) -> Tensor:
        h = self.fc(x)
        found = list(gens.values()) if isinstance(gens, dict) else list(gens)
        for gen in found + ([g] if g is not None else []):
            h = h + torch.randn(h.shape, generator=gen)
        return h


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


CALLS: dict[str, Callable[[], tuple[tuple, dict]]] = {
    "list": lambda: (([_gen(7)],), {}),
    "two": lambda: (([_gen(7), _gen(8)],), {}),
    "dict": lambda: (({"a": _gen(7)},), {}),
    "kwarg": lambda: ((), {"g": _gen(7)}),
}
TURNS = {"chunk": {"chunk_size": 2}, "loop": {"backend": "loop"}}


@pytest.mark.parametrize("turns", list(TURNS))
@pytest.mark.parametrize("call", list(CALLS))
def test_generators_nested_in_the_call_draw_as_alone_in_turns(call: str, turns: str) -> None:
    ens = vmapens.Ensemble(NoiseArgs, N, seeds=range(N), randomness="same", **TURNS[turns])
    alone = seeded_members(NoiseArgs, N)
    x = _x(5, 4)
    args, kwargs = CALLS[call]()
    rng = torch.get_rng_state()
    out = _ens_out(lambda t: ens(t, *args, **kwargs), x)
    want = []
    for m in alone:
        a, k = CALLS[call]()  # each member alone, given generators in the same state
        with torch.no_grad():
            want.append(m(x, *a, **k))
    torch.testing.assert_close(out, torch.stack(want), **TOL)
    assert torch.equal(rng, torch.get_rng_state())


class Inner(nn.Module):
    def __init__(self, g: torch.Generator) -> None:
        super().__init__()
        self.g = g

    def forward(self, h: Tensor) -> Tensor:
        return h + torch.rand(h.shape, generator=self.g)


class HeldByChild(nn.Module):
    def __init__(self, g: torch.Generator) -> None:
        super().__init__()
        self.fc, self.inner = nn.Linear(4, 3), nn.Sequential(Inner(g))

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(self.fc(x))


class HeldInList(nn.Module):
    def __init__(self, gens: list[torch.Generator]) -> None:
        super().__init__()
        self.fc, self.gens = nn.Linear(4, 3), gens

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        for g in self.gens:
            h = h + torch.randn(h.shape, generator=g)
        return h


def _held_as_alone(cls: type, holder: Callable[[], Any], turns: str) -> None:
    shared = holder()  # one object for every member (members' own ones are refused at build)
    ens = vmapens.Ensemble(lambda: cls(shared), N, seeds=range(N), randomness="same",
                           **TURNS[turns])  # fmt: skip
    alone = seeded_members(lambda: cls(holder()), N)  # each its own, in the same state
    x = _x(5, 4)
    torch.testing.assert_close(_ens_out(ens, x), _alone(alone, x), **TOL)


@pytest.mark.parametrize("turns", list(TURNS))
def test_a_generator_held_by_a_child_module_draws_as_alone_in_turns(turns: str) -> None:
    _held_as_alone(HeldByChild, lambda: _gen(7), turns)


@pytest.mark.parametrize("turns", list(TURNS))
def test_generators_held_in_a_list_draw_as_alone_in_turns(turns: str) -> None:
    _held_as_alone(HeldInList, lambda: [_gen(7), _gen(9)], turns)


# -- 5. layouts ---------------------------------------------------------------------------------


class ConvDrop(nn.Module):
    def __init__(self, c: int = 6, d3: bool = False) -> None:
        super().__init__()
        self.conv = (nn.Conv3d if d3 else nn.Conv2d)(3, c, 3, padding=1)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.conv(x)).flatten(2).mean(2)


CL, CL3 = torch.channels_last, torch.channels_last_3d


def _same_draws_as_alone(ens: Any, alone: list[nn.Module], x: Tensor) -> None:
    """randomness='same' in train mode: each member alone from the state the call started."""
    rng = torch.get_rng_state()
    out = _ens_out(ens, x)
    want = []
    for m in alone:
        torch.set_rng_state(rng)
        with torch.no_grad():
            want.append(m(x))
    torch.testing.assert_close(out, torch.stack(want), **TOL)


def _built(formats: list[Any], d3: bool = False) -> list[nn.Module]:
    out = []
    for k, fmt in enumerate(formats):
        torch.manual_seed(k)
        m = ConvDrop(d3=d3)
        out.append(m if fmt is None else m.to(memory_format=fmt))
    return out


def test_channels_last_3d_members_draw_as_alone() -> None:
    alone = _built([CL3] * N, d3=True)
    ens = vmapens.Ensemble.from_modules(copy.deepcopy(alone), randomness="same")
    assert not ens.stacked_params()["conv.weight"][1].is_contiguous()
    _same_draws_as_alone(ens, alone, _x(2, 3, 4, 5, 5))


@pytest.mark.parametrize(
    "trip", [(CL, torch.contiguous_format), (None, CL)], ids=["cl-to-contig", "contig-to-cl"]
)
def test_a_format_change_after_building_draws_as_alone(trip: tuple) -> None:
    built, to = trip
    alone = _built([built] * N)
    ens = vmapens.Ensemble.from_modules(copy.deepcopy(alone), randomness="same")
    ens.to(memory_format=to)
    alone = [m.to(memory_format=to) for m in alone]
    _same_draws_as_alone(ens, alone, _x(2, 3, 5, 5))


def test_padded_members_made_channels_last_after_building_init_as_alone() -> None:
    # docs/semantics.md: padded members are stacked contiguous; ens.to(channels_last) after.
    def init(m: nn.Module) -> None:
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight)

    factories = [lambda c=c: ConvDrop(c) for c in (4, 6, 5)]
    ens = vmapens.Ensemble.from_factories(factories, seed=0).to(memory_format=CL)
    alone = [m.to(memory_format=CL) for m in factory_members(factories, seed=0)]
    torch.manual_seed(5)
    ens.apply(init)
    torch.manual_seed(5)
    for m in alone:
        m.apply(init)
    for i, m in enumerate(alone):
        got = ens.stacked_params()["conv.weight"][i][: m.conv.out_channels]
        torch.testing.assert_close(got, m.conv.weight.detach(), **TOL)


@pytest.mark.parametrize(
    "formats", [[CL, None, None], [None, CL, CL]], ids=["cl-first", "cl-later"]
)
def test_members_of_mixed_layouts_are_refused(formats: list[Any]) -> None:
    # Stacked in member 0's layout, the others drew other dropout masks than alone (0.37 off).
    first, other = (
        ("channels-last", "contiguous") if formats[0] else ("contiguous", "channels-last")
    )
    with pytest.raises(ValueError, match=f"member 1's `conv.weight` is {other} and member 0's "
                       f"is {first}"):  # fmt: skip
        vmapens.Ensemble.from_modules(_built(formats), randomness="same")


# -- 6. the step's error when the members' forward or loss fails --------------------------------


class Cls(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        self.aux = (h**2).mean()  # kept for the loss
        return h


def _classes(seed: int = 0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, 5, 4, generator=g), torch.randint(0, 3, (N, 5), generator=g)


def test_a_bad_target_in_member_1_only_is_refused_as_member_1_alone_refuses_it() -> None:
    xs, ys = _classes()
    ys[1, 2] = 7
    with pytest.raises(IndexError, match="Target 7 is out of bounds"):
        F.cross_entropy(seeded_members(Cls, N)[1](xs[1]), ys[1])  # member 1 alone
    ens = vmapens.Ensemble(Cls, N, seeds=range(N))
    step = vmapens.make_step(ens, F.cross_entropy, vmapens.StackedAdam(ens, lr=0.05), in_dims=0)
    with pytest.raises(IndexError, match="Target 7 is out of bounds"):
        step(xs, ys)


def test_a_loss_reading_kept_state_refused_alone_changes_nothing() -> None:
    xs, ys = _classes()
    ens = vmapens.Ensemble(Cls, N, seeds=range(N))
    alone = seeded_members(Cls, N)

    def loss_fn(out: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(out, y) + 0.1 * ens.template.aux

    opt = vmapens.StackedAdam(ens, lr=0.05)
    step = vmapens.make_step(ens, loss_fn, opt, in_dims=0)
    opts = [torch.optim.Adam(m.parameters(), lr=0.05) for m in alone]

    def both() -> None:
        step(xs, ys)
        for i, (m, o) in enumerate(zip(alone, opts, strict=True)):
            o.zero_grad()
            out = m(xs[i])
            (F.cross_entropy(out, ys[i]) + 0.1 * m.aux).backward()
            o.step()

    both()
    aux, kept = ens.template.aux, ens.template.aux.detach().clone()
    state = [t.clone() for t in ens.stacked_state().values()]
    moments = [t.clone() for s in opt.state.values() for t in s.values() if isinstance(t, Tensor)]
    rng = torch.get_rng_state()
    bad = ys.clone()
    bad[0, 1] = 9
    with pytest.raises(IndexError, match="Target 9 is out of bounds") as err:
        step(xs, bad)
    assert str(err.value).startswith("step: member 0 run alone raises this too, in `loss_fn`")
    assert ens.template.aux is aux and torch.equal(aux.detach(), kept)
    assert all(torch.equal(a, b) for a, b in zip(state, ens.stacked_state().values(), strict=True))
    after = [t for s in opt.state.values() for t in s.values() if isinstance(t, Tensor)]
    assert all(torch.equal(a, b) for a, b in zip(moments, after, strict=True))
    assert torch.equal(rng, torch.get_rng_state())
    both()
    assert_members_equal(ens, alone, **TOL)


class NoArgument(Exception):
    def __init__(self) -> None:
        super().__init__("a bad label (no argument)")


class LabelError(ValueError):
    def __init__(self, code: int) -> None:
        self.code = code
        super().__init__(f"bad label, code {code}")


def _relabelling(make: Callable[[], Exception]) -> Callable[[Tensor, Tensor], Tensor]:
    """A loss that turns F.cross_entropy's IndexError into the user's own exception (under
    vmap the IndexError is a RuntimeError, so only member 0 alone raises the user's)."""

    def loss_fn(out: Tensor, y: Tensor) -> Tensor:
        try:
            return F.cross_entropy(out, y)
        except IndexError as e:
            raise make() from e

    return loss_fn


def _users_error(make: Callable[[], Exception]) -> tuple[Exception, Exception]:
    """(member 0 alone's error, the step's) on a batch with a class out of range."""
    loss_fn = _relabelling(make)
    x, y = _x(5, 4), torch.tensor([0, 1, 7, 2, 0])
    ens = vmapens.Ensemble(lambda: nn.Linear(4, 3), N, seeds=range(N))
    step = vmapens.make_step(ens, loss_fn, vmapens.StackedAdam(ens, lr=0.05))
    step(x, torch.tensor([0, 1, 2, 2, 0]))
    before = [t.clone() for t in ens.stacked_state().values()]
    with pytest.raises(Exception) as alone:
        loss_fn(seeded_members(lambda: nn.Linear(4, 3), 1)[0](x), y)
    with pytest.raises(Exception) as got:
        step(x, y)
    assert all(torch.equal(a, b) for a, b in zip(before, ens.stacked_state().values(), strict=True))
    return alone.value, got.value


def test_an_exception_class_without_a_message_argument_is_raised_as_alone() -> None:
    alone, got = _users_error(NoArgument)
    assert type(got) is NoArgument and str(got) == str(alone)


def test_an_exception_with_its_own_argument_keeps_its_attributes_as_alone() -> None:
    alone, got = _users_error(lambda: LabelError(42))
    assert type(got) is LabelError
    assert got.code == alone.code == 42  # type: ignore[attr-defined]
