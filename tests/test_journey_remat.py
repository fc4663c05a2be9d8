"""A user journey: saving memory and switching autograd modes as one would on a single model.

A researcher short of memory, or debugging, reaches for torch's own switches around and inside
a member: activation checkpointing (`torch.utils.checkpoint.checkpoint` of a block, with and
without Dropout, `use_reentrant=False` and torch's old default `True`, and
`checkpoint_sequential` over an `nn.Sequential` member), a frozen feature extractor written as
`with torch.no_grad(): f = self.backbone(x)`, `torch.inference_mode()` around `ens(x)` and
`predict` before training goes on, `torch.set_grad_enabled(False)` around a step call,
`torch.use_deterministic_algorithms(True)`, `saved_tensors_hooks` / `save_on_cpu()` around a
step, and `torch.autograd.set_detect_anomaly(True)`. Each with `make_step` (or `fit`) under
vmap, with `chunk_size` and with `backend="loop"`.

The truth: each member a plain module trained alone with `torch.optim` on the same batches,
float64 (batched kernels may sum in another order: ~1e-16 per step). docs/semantics.md says a
checkpointed block (its recomputation in backward calls the member's layers after the member's
tensors were swapped out) is refused with either backend; a recomputation that calls no layer
(a checkpointed activation) runs with `backend="loop"`, as alone.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential
from truth import batch_plan, factory_members

import vmapens

pytestmark = pytest.mark.usefixtures("float64_default")

N, B = 3, 5
TOL: dict[str, Any] = {"rtol": 1e-10, "atol": 1e-12}
KINDS = [{}, {"chunk_size": 2}, {"backend": "loop"}]
IDS = ["vmap", "chunks", "loop"]
CHECKPOINT = r"^step: the forward of \w+ uses torch\.utils\.checkpoint.*directly"


def batches(count: int, *shape: int, seed: int = 0, ints: int = 0) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        x = (
            torch.randint(ints, (B, *shape), generator=g)
            if ints
            else torch.randn(B, *shape, generator=g)
        )
        out.append((x, torch.randn(B, 1, generator=g)))
    return out


def train_alone(
    models: list[nn.Module],
    data: list[tuple[Tensor, Tensor]],
    make_opt: Callable[[nn.Module], torch.optim.Optimizer],
    around: Callable[[], Any] = contextlib.nullcontext,
    rng: list[Tensor] | None = None,
) -> None:
    for m in models:
        opt = make_opt(m)
        for k, (x, y) in enumerate(data):
            if rng is not None:
                torch.set_rng_state(rng[k])
            opt.zero_grad()
            with around():
                nn.functional.mse_loss(m(x), y).backward()
            opt.step()


def adam(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(m.parameters(), lr=1e-2)


def assert_members(ens: vmapens.Ensemble, models: list[nn.Module], **tol: Any) -> None:
    for i, m in enumerate(models):
        got, want = ens[i].state_dict(), m.state_dict()
        assert list(got) == list(want)
        for k in want:
            torch.testing.assert_close(got[k], want[k], **(tol or TOL), msg=f"member {i} {k}")


def pair(factory: Callable[[], nn.Module], **kw: Any) -> tuple[vmapens.Ensemble, list[nn.Module]]:
    ens = vmapens.Ensemble(factory, n=N, seed=0, **kw)
    return ens, [copy.deepcopy(m) for m in ens.unstack()]


def snapshot(ens: vmapens.Ensemble, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    return copy.deepcopy(ens.state_dict()), copy.deepcopy(opt.state_dict())


def assert_unchanged(ens: vmapens.Ensemble, opt: torch.optim.Optimizer, before: tuple) -> None:
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[0][k]), k
    assert opt.state_dict()["state"] == before[1]["state"] == {}
    assert all(p.grad is None for p in ens.parameters())


# -- activation checkpointing ------------------------------------------------------------------


class Blocked(nn.Module):
    """A residual-free block checkpointed as in a memory-starved transformer."""

    def __init__(self, drop: float = 0.0, reentrant: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.block = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Dropout(drop), nn.Linear(6, 6))
        self.head = nn.Linear(6, 1)
        self.reentrant = reentrant

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.inp(x))
        return self.head(checkpoint(self.block, h, use_reentrant=self.reentrant))


class Chain(nn.Sequential):
    """An `nn.Sequential` member run through `checkpoint_sequential` in two segments."""

    def __init__(self, reentrant: bool = False) -> None:
        super().__init__(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 1))
        self.reentrant = reentrant

    def forward(self, x: Tensor) -> Tensor:
        return checkpoint_sequential(self, 2, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_a_checkpointed_block_is_refused_by_the_step_and_fit_and_changes_nothing(kind) -> None:
    # Dropout in the block or not, torch's new and old (reentrant) checkpoint, checked step or
    # not: a clear refusal with the way out, before anything changed.
    x, y = batches(1, 4)[0]
    for drop, reentrant, check in [(0.0, False, True), (0.3, False, False), (0.3, True, True)]:
        ens = vmapens.Ensemble(lambda d=drop, r=reentrant: Blocked(d, r), n=N, seed=0, **kind)
        opt = vmapens.StackedAdam(ens, lr=1e-2)
        before = snapshot(ens, opt)
        step = vmapens.make_step(ens, nn.MSELoss(), opt, check=check)
        with pytest.raises(RuntimeError, match=CHECKPOINT):
            step(x, y)
        assert_unchanged(ens, opt, before)
    ens = vmapens.Ensemble(lambda: Blocked(0.3), n=N, seed=0, **kind)
    before = copy.deepcopy(ens.state_dict())
    with pytest.raises(RuntimeError, match="torch.utils.checkpoint"):
        vmapens.fit(ens, (torch.randn(8, 4), torch.randn(8, 1)), nn.MSELoss(), batch_size=4,
                    progress=False, seed=0)  # fmt: skip
    assert all(torch.equal(v, before[k]) for k, v in ens.state_dict().items())


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True:UserWarning")
@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_checkpoint_sequential_is_refused_or_trains_as_alone(kind) -> None:
    data = batches(3, 4)
    # The new checkpoint recomputes the first segment's layers: refused with either backend.
    ens = vmapens.Ensemble(Chain, n=N, seed=0, **kind)
    opt = vmapens.StackedAdam(ens, lr=1e-2)
    before = snapshot(ens, opt)
    with pytest.raises(RuntimeError, match=CHECKPOINT):
        vmapens.make_step(ens, nn.MSELoss(), opt)(*data[0])
    assert_unchanged(ens, opt, before)
    # The reentrant one on an input without requires_grad records nothing for the first
    # segment (torch warns, alone too): its layers get no gradient and Adam skips them. Under
    # vmap its autograd.Function cannot run (refused); the loop trains as alone.
    ens, models = pair(lambda: Chain(reentrant=True), **kind)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-2))
    if kind.get("backend") != "loop":
        with pytest.raises(RuntimeError, match=CHECKPOINT):
            step(*data[0])
        return
    for x, y in data:
        step(x, y)
    train_alone(models, data, adam)
    assert_members(ens, models)
    assert [p.grad is None for p in ens.parameters()] == [True, True, False, False, False, False]


class Activation(nn.Module):
    """A checkpointed activation (no layer inside): the recomputation needs only its input."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.drop, self.head = nn.Linear(4, 6), nn.Dropout(0.5), nn.Linear(6, 1)
        self.starts: list[Tensor] = []  # the RNG state each run of `act` starts from

    def act(self, t: Tensor) -> Tensor:
        self.starts.append(torch.get_rng_state())
        return self.drop(torch.tanh(t) * torch.sigmoid(t))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(checkpoint(self.act, self.fc(x), use_reentrant=False))


#: The RNG state each run of ``LoggedActivation.act`` starts from, all members' in one list
#: (a list on the module is each member's own since session 45, and the recomputations in the
#: backward append after the members' turns).
STARTS: list[Tensor] = []


class LoggedActivation(Activation):
    def act(self, t: Tensor) -> Tensor:
        STARTS.append(torch.get_rng_state())
        return self.drop(torch.tanh(t) * torch.sigmoid(t))


def test_a_checkpointed_activation_with_dropout_trains_as_alone_with_the_loop() -> None:
    # randomness="same": each member draws what it draws alone from the step's RNG state, and
    # the recomputation (preserve_rng_state) redraws the forward's mask: exact, the global RNG
    # left where the loop alone leaves it.
    data = batches(3, 4, seed=1)
    ens, models = pair(Activation, backend="loop", randomness="same")
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-2))
    torch.manual_seed(5)
    rng = []
    for x, y in data:
        rng.append(torch.get_rng_state())
        step(x, y)
    after = torch.get_rng_state()
    train_alone(models, data, adam, rng=rng)
    assert_members(ens, models, rtol=0, atol=0)
    assert torch.equal(after, torch.get_rng_state())
    # randomness="different": other masks than alone (documented), but each member's
    # recomputation starts from the RNG state its forward started from.
    ens = vmapens.Ensemble(LoggedActivation, n=N, seed=0, backend="loop")
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-2), check=False)
    STARTS.clear()
    step(*data[0])
    assert len(STARTS) == 2 * N
    forward, again = STARTS[:N], STARTS[N:]
    assert all(any(torch.equal(s, t) for t in again) for s in forward)
    assert not any(torch.equal(forward[0], s) for s in forward[1:])  # the members' own masks
    # Under vmap the recomputation would run outside vmap on the member's batched input.
    ens = vmapens.Ensemble(Activation, n=N, seed=0, randomness="same")
    opt = vmapens.StackedAdam(ens, lr=1e-2)
    before = snapshot(ens, opt)
    with pytest.raises(RuntimeError, match=CHECKPOINT):
        vmapens.make_step(ens, nn.MSELoss(), opt)(*data[0])
    assert_unchanged(ens, opt, before)


# -- grad modes: a frozen feature extractor, no_grad and inference_mode around calls ----------


class Frozen(nn.Module):
    """A feature extractor under `torch.no_grad()` (its BatchNorm still updates its running
    statistics in train mode) and a trained head; a buffer the forward reassigns."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh())
        self.head = nn.Linear(6, 1)
        self.register_buffer("ema", torch.zeros(6))

    def forward(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            f = self.backbone(x)
        if self.training:
            self.ema = 0.9 * self.ema + 0.1 * f.mean(0)
        return self.head(f - self.ema)


def adamw(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)


def stacked_adamw(ens: vmapens.Ensemble) -> vmapens.StackedAdam:
    return vmapens.StackedAdam(ens, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_a_frozen_backbone_under_no_grad_trains_as_alone_whatever_the_callers_grad_mode(
    kind,
) -> None:
    # AdamW alone skips the backbone (no .grad): neither decayed nor given a state; the same
    # with the step called under torch.set_grad_enabled(False) for half the steps.
    data = batches(4, 4)
    ens, models = pair(Frozen, **kind)
    opt = stacked_adamw(ens)
    step = vmapens.make_step(ens, nn.MSELoss(), opt)
    for k, (x, y) in enumerate(data):
        with torch.set_grad_enabled(k % 2 == 0):
            step(x, y)
            assert torch.is_grad_enabled() == (k % 2 == 0)
    train_alone(models, data, adamw)
    assert_members(ens, models)
    assert [p.grad is None for p in ens.parameters()] == [True] * 4 + [False] * 2


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_inference_mode_around_calls_then_training_leaks_nothing(kind) -> None:
    # `ens(x)` in train mode under inference_mode updates BatchNorm's statistics and the
    # reassigned buffer, as alone; `predict` runs eval; then training goes on as alone, with
    # no inference tensor left in the parameters, buffers or optimizer state.
    data, xe = batches(3, 4), torch.randn(7, 4)
    ens, models = pair(Frozen, **kind)
    with torch.inference_mode():
        out, pred = ens(xe), vmapens.predict(ens, xe, reduce="none")
        want = torch.stack([m(xe) for m in models])
        for m in models:
            m.eval()
        want_pred = torch.stack([m(xe) for m in models])
        for m in models:
            m.train()
    torch.testing.assert_close(out, want, **TOL)
    torch.testing.assert_close(pred, want_pred, **TOL)
    opt = stacked_adamw(ens)
    step = vmapens.make_step(ens, nn.MSELoss(), opt)
    for x, y in data:
        step(x, y)
    train_alone(models, data, adamw)
    assert_members(ens, models)
    held = [*ens.state_dict().values(), *ens.parameters()]
    held += [v for s in opt.state.values() for v in s.values() if isinstance(v, Tensor)]
    assert not any(t.is_inference() for t in held)


def test_fit_under_no_grad_trains_as_alone_and_under_inference_mode_is_refused() -> None:
    g = torch.Generator().manual_seed(3)
    X, Y = torch.randn(12, 4, generator=g), torch.randn(12, 1, generator=g)
    ens, models = pair(Frozen)
    with torch.no_grad():
        vmapens.fit(ens, (X, Y), nn.MSELoss(), epochs=1, batch_size=4, lr=1e-2, progress=False,
                    seed=0)  # fmt: skip
    train_alone(models, [(X[r], Y[r]) for r in batch_plan(12, 4, 3, seed=0)], adam)
    assert_members(ens, models)
    before = copy.deepcopy(ens.state_dict())
    with torch.inference_mode(), pytest.raises(RuntimeError, match="inference_mode.*outside"):
        vmapens.fit(ens, (X, Y), nn.MSELoss(), batch_size=4, progress=False, seed=0)
    assert all(torch.equal(v, before[k]) for k, v in ens.state_dict().items())


# -- deterministic algorithms ------------------------------------------------------------------


class Indexed(nn.Module):
    """Ops with deterministic variants on CPU: an embedding's backward, gather, index_add,
    a strided conv before BatchNorm (no bias: BatchNorm cancels its gradient), max pooling."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, width)
        self.conv = nn.Conv1d(width, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 1)

    def forward(self, t: Tensor) -> Tensor:
        h = nn.functional.max_pool1d(torch.relu(self.bn(self.conv(self.emb(t).transpose(1, 2)))), 2)
        idx = torch.tensor([1, 0, 1, 0])
        h = h.gather(2, idx[:2].expand(*h.shape[:2], 2)).index_add(1, idx, h.flip(1)[..., :2])
        return self.head(h.mean(2))


class Unpooled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h, i = nn.functional.max_pool1d(self.fc(x)[:, None], 2, return_indices=True)
        return nn.functional.max_unpool1d(h, i, 2)[:, 0, :1]


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    torch.use_deterministic_algorithms(True)  # torch.empty then fills memory with NaN
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_deterministic_algorithms_train_as_alone_or_raise_as_alone(kind) -> None:
    data = batches(3, 4, ints=10)
    ens, models = pair(Indexed, **kind)
    with deterministic():
        step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-2))
        for x, y in data:
            step(x, y)
        train_alone(models, data, adam)
    assert_members(ens, models)
    # Members of two widths (padded storage, masked by zeros) built and trained inside it.
    factories = [lambda: Indexed(3), lambda: Indexed(5)]
    alone = factory_members(factories, seed=0)
    with deterministic():
        ens = vmapens.Ensemble.from_factories(factories, seed=0, **kind)
        step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-2))
        for k, (x, y) in enumerate(data):
            step(x, y, mask=torch.tensor([True, k != 1]))
        train_alone(alone[:1], data, adam)
        train_alone(alone[1:], data[:1] + data[2:], adam)
    assert_members(ens, alone)
    # max_unpool has no deterministic kernel: torch's own error, alone and in the ensemble.
    ens = vmapens.Ensemble(Unpooled, n=N, seed=0, **kind)
    x, y = torch.randn(B, 4), torch.randn(B, 1)
    with deterministic(), pytest.raises(RuntimeError, match="does not have a deterministic"):
        Unpooled()(x)
    with deterministic(), pytest.raises(RuntimeError, match="does not have a deterministic"):
        vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens))(x, y)
    assert not torch.are_deterministic_algorithms_enabled()


# -- saved-tensor hooks and anomaly detection around a step ------------------------------------


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(4, 6), nn.Linear(6, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.fc(x)))


def kept_in_a_list() -> Any:
    stash: list[Tensor] = []

    def pack(t: Tensor) -> int:
        stash.append(t)
        return len(stash) - 1

    return torch.autograd.graph.saved_tensors_hooks(pack, stash.__getitem__)


def float32_saved() -> Any:
    # A lossy trick: saved activations in float32, alone too, so the same rounding.
    return torch.autograd.graph.saved_tensors_hooks(
        lambda t: (t.dtype, t.float() if t.is_floating_point() else t), lambda p: p[1].to(p[0])
    )


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_saved_tensor_hooks_around_a_step_train_as_alone(kind) -> None:
    data = batches(3, 4, seed=2)
    for around in (torch.autograd.graph.save_on_cpu, kept_in_a_list, float32_saved):
        ens, models = pair(Small, **kind)
        step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-2))
        for x, y in data:
            with around():
                step(x, y)
        train_alone(models, data, adam, around=around)
        assert_members(ens, models)


@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled:UserWarning")
@pytest.mark.filterwarnings("ignore:Error detected in:UserWarning")
@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_anomaly_detection_around_a_step_trains_as_alone_and_names_the_nan(kind) -> None:
    # Frozen: its forward updates BatchNorm's statistics and a buffer before the backward.
    data = batches(3, 4, seed=3)
    ens, models = pair(Frozen, **kind)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-2))
    with torch.autograd.set_detect_anomaly(True):
        for x, y in data:
            step(x, y)
        train_alone(models, data, adam)
    assert_members(ens, models)
    assert not torch.is_anomaly_enabled()
    # A NaN target: alone, anomaly mode names the backward that returned NaN; the step raises
    # torch's message and changes nothing.
    x, y = data[0]
    y = y.clone()
    y[0] = float("nan")
    with torch.autograd.detect_anomaly(), pytest.raises(RuntimeError, match="returned nan"):
        nn.functional.mse_loss(models[0](x), y).backward()
    opt = vmapens.StackedAdam(ens, lr=1e-2)
    before = snapshot(ens, opt)
    grads = [None if p.grad is None else p.grad.clone() for p in ens.parameters()]
    step = vmapens.make_step(ens, nn.MSELoss(), opt, check=False)
    with torch.autograd.detect_anomaly(), pytest.raises(RuntimeError, match="returned nan"):
        step(x, y)
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[0][k]), k
    assert opt.state_dict()["state"] == before[1]["state"] == {}
    for p, g in zip(ens.parameters(), grads, strict=True):
        assert (p.grad is None and g is None) or torch.equal(p.grad, g)
