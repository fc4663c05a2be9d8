"""Bug hunt: random ops inside the members' forwards, and train/eval behaviour of random layers
(docs/semantics.md, "Randomness in the forward pass", "Buffers and train/eval", "What vmap
cannot batch"; docs/workflows.md on `predict` and MC dropout).

The truth is always N plain modules (built after `torch.manual_seed(k)`, as `seeds=range(N)`
builds them) run alone with `torch.optim.Adam`. With `randomness="same"` the docs promise that
each member draws what it draws alone from the same RNG state, in the eager step, with
`chunk_size` and with `backend="loop"`: the truth sets the global RNG to the state the
ensemble's call started from before each member, and the ensemble must leave the global RNG
where every member alone leaves it. In eval mode nothing is drawn: outputs as alone, the RNG
untouched. `randomness="error"` refuses a forward that draws and changes nothing (parameters,
buffers, optimizer state, global RNG). float64 throughout.

Forwards: stochastic depth (`torch.rand(B, 1, 1, 1) < keep` in training, identity in eval), a
VAE's `randn_like` reparameterisation, `torch.randperm` token shuffling, `F.gumbel_softmax`,
`torch.multinomial` of shared weights (bootstrap rows), `nn.AlphaDropout`, `nn.Dropout2d`,
`nn.RReLU`, `F.dropout` on a transposed tensor, `torch.bernoulli` of a tensor made like a
member's activation, and `torch.Generator` objects passed in or held by the module.

Found here and fixed in session 43:
- a `torch.Generator` the forward draws from (passed as an argument, `ens(x, g)`, or held by
  the module) with `randomness="same"`: unchunked vmap draws once and every member gets what
  it gets alone, but with `chunk_size=2` and `backend="loop"` the turns after the first go on
  drawing from the generator the first turn advanced (only the global RNG is put back between
  turns), so members 2.. get other numbers than alone, silently and without the uneven-draw
  warning (outputs ~3.6 off); the generator ends advanced once per turn, so with a
  generator the module holds every member trains on other noise from the second step on
  (0.07-0.16 off in the parameters after 3 Adam steps).
- `nn.RReLU` in eval mode draws nothing alone (it is `leaky_relu` with slope
  `(lower + upper) / 2`), but `backend="loop"` with `randomness="error"` refuses it saying the
  forward "draws random numbers" and advising to "put the random layers in eval mode" (they
  are: `aten::rrelu_with_noise` carries torch's `nondeterministic_seeded` tag either way).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from truth import seeded_members

import vmapens

pytestmark = pytest.mark.usefixtures("float64_default")

N, LR, STEPS = 3, 0.05, 3
TOL: dict[str, Any] = {"rtol": 1e-10, "atol": 1e-12}
BACKENDS = {"vmap": {}, "chunk": {"chunk_size": 2}, "loop": {"backend": "loop"}}


# -- the members -------------------------------------------------------------------------------


class StochasticDepth(nn.Module):
    """A residual conv block whose branch is dropped per sample in training
    (`torch.rand(B, 1, 1, 1) < keep`, rescaled), the identity branch kept; eval: the block."""

    def __init__(self, keep: float = 0.6) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.head = nn.Linear(2, 2)
        self.keep = keep

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv(x)
        if self.training:
            mask = (torch.rand(x.shape[0], 1, 1, 1) < self.keep).to(x.dtype) / self.keep
            h = h * mask
        return self.head((x + h).mean((2, 3)))


class VAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc, self.dec = nn.Linear(4, 4), nn.Linear(2, 2)

    def forward(self, x: Tensor) -> Tensor:
        mu, logvar = self.enc(x).chunk(2, -1)
        return self.dec(mu + torch.randn_like(mu) * (0.5 * logvar).exp())


class Shuffle(nn.Module):
    """Token shuffling: a `torch.randperm` of the features inside the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        return self.out(h[:, torch.randperm(h.shape[1])])


class Gumbel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(4, 3), nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(F.gumbel_softmax(self.fc(x), tau=0.5))


class Bootstrap(nn.Module):
    """Rows resampled with `torch.multinomial` of shared (not per-member) weights."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(4, 3), nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        rows = torch.multinomial(torch.ones(x.shape[0]), x.shape[0], replacement=True)
        return self.out(torch.tanh(self.fc(x[rows])))


class SELUNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.drop, self.out = nn.Linear(4, 5), nn.AlphaDropout(0.3), nn.Linear(5, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.drop(torch.selu(self.fc(x))))


class ConvDrop(nn.Module):
    """Conv (no bias: its gradient before a BatchNorm is round-off, docs/semantics.md),
    BatchNorm, Dropout2d: a buffer written before the draw."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(2, 3, 3, padding=1, bias=False), nn.BatchNorm2d(3)
        self.drop, self.head = nn.Dropout2d(0.5), nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.drop(torch.relu(self.bn(self.conv(x)))).mean((2, 3)))


def _image_batch() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(6, 2, 3, 3, generator=g), torch.randn(6, 2, generator=g)


def _flat_batch() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple[Tensor, Tensor]]]] = {
    "stochastic-depth": (StochasticDepth, _image_batch),
    "vae-randn_like": (VAE, _flat_batch),
    "randperm": (Shuffle, _flat_batch),
    "gumbel-softmax": (Gumbel, _flat_batch),
    "multinomial": (Bootstrap, _flat_batch),
    "alpha-dropout": (SELUNet, _flat_batch),
    "dropout2d-bn": (ConvDrop, _image_batch),
}


# -- the truth: each member alone, from the ensemble call's RNG state --------------------------


def _alone_steps(models: list[nn.Module], batches: list[tuple[Tensor, Tensor]]) -> list[Tensor]:
    """Adam steps of each model alone, every member starting each step from the global RNG
    state of that moment (what "same" promises); the losses per step, `[N]` each. Leaves the
    global RNG where the members alone leave it (they all leave it in one state: checked)."""
    opts = [torch.optim.Adam(m.parameters(), lr=LR) for m in models]
    losses = []
    for x, y in batches:
        start, ends, row = torch.get_rng_state(), [], []
        for m, opt in zip(models, opts, strict=True):
            torch.set_rng_state(start)
            opt.zero_grad()
            loss = F.mse_loss(m(x), y)
            loss.backward()
            opt.step()
            row.append(loss.detach())
            ends.append(torch.get_rng_state())
        assert all(torch.equal(e, ends[0]) for e in ends)  # the truth's own premise
        torch.set_rng_state(ends[0])
        losses.append(torch.stack(row))
    return losses


def _assert_as_alone(ens: vmapens.Ensemble, alone: list[nn.Module], grads: bool = True) -> None:
    for i, m in enumerate(alone):
        got = ens[i].state_dict()
        for k, v in m.state_dict().items():
            torch.testing.assert_close(got[k], v, **TOL, msg=f"member {i} {k}")
        if grads:
            for name, p in ens.named_parameters():
                q = m.get_parameter(name).grad
                assert (p.grad is None) == (q is None), name
                if q is not None:
                    torch.testing.assert_close(p.grad[i], q, **TOL, msg=f"member {i} {name}.grad")


# -- randomness="same": make_step, ens(x) in train mode, eval mode ----------------------------


@pytest.mark.parametrize("kw", list(BACKENDS))
@pytest.mark.parametrize("model", list(MODELS))
def test_same_randomness_make_step_trains_each_member_as_alone_and_leaves_alones_rng(
    model: str, kw: str
) -> None:
    """Three `make_step` steps (the first one self-checked) against Adam alone, each member
    from the step's RNG state: losses, parameters, buffers, gradients, and the global RNG
    after the steps where the members alone leave it."""
    factory, batch = MODELS[model]
    x, y = batch()
    ens = vmapens.Ensemble(factory, N, seeds=range(N), randomness="same", **BACKENDS[kw])
    alone = seeded_members(factory, N)
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedAdam(ens, lr=LR))
    torch.manual_seed(123)
    got = [step(x, y).detach().clone() for _ in range(STEPS)]
    rng_ens = torch.get_rng_state()
    torch.manual_seed(123)
    want = _alone_steps(alone, [(x, y)] * STEPS)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    _assert_as_alone(ens, alone)
    assert torch.equal(rng_ens, torch.get_rng_state()), "the RNG is not where alone leaves it"


@pytest.mark.parametrize("kw", list(BACKENDS))
@pytest.mark.parametrize("model", ["stochastic-depth", "vae-randn_like", "dropout2d-bn"])
def test_same_randomness_train_mode_no_grad_forward_as_alone(model: str, kw: str) -> None:
    """`ens(x)` in train mode under `no_grad` (a warm-up, MC sampling): outputs and written
    buffers as each member alone from the call's RNG state, twice in a row (the second call
    goes on from where alone leaves the RNG), and the RNG left as alone leaves it."""
    factory, batch = MODELS[model]
    x, _ = batch()
    ens = vmapens.Ensemble(factory, N, seeds=range(N), randomness="same", **BACKENDS[kw])
    alone = seeded_members(factory, N)
    for _ in range(2):
        start = torch.get_rng_state()
        with torch.no_grad():
            out = ens(x)
        after = torch.get_rng_state()
        want = []
        for m in alone:
            torch.set_rng_state(start)
            with torch.no_grad():
                want.append(m(x))
            assert torch.equal(torch.get_rng_state(), after)
        torch.testing.assert_close(out, torch.stack(want), **TOL)
    _assert_as_alone(ens, alone, grads=False)


@pytest.mark.parametrize("kw", list(BACKENDS))
@pytest.mark.parametrize("randomness", ["different", "same", "error"])
def test_eval_mode_draws_nothing_and_computes_as_alone(randomness: str, kw: str) -> None:
    """Eval mode: stochastic depth is the plain block, Dropout2d the identity, BatchNorm reads
    its running statistics: `ens(x)` and `predict(reduce="none")` equal every member alone in
    eval mode, the global RNG untouched, whatever `randomness` ("error" too: nothing is
    drawn). `predict` on an ensemble in train mode gives the mode back."""
    for factory, batch in (MODELS["stochastic-depth"], MODELS["dropout2d-bn"]):
        x, _ = batch()
        ens = vmapens.Ensemble(factory, N, seeds=range(N), randomness=randomness, **BACKENDS[kw])
        alone = [m.eval() for m in seeded_members(factory, N)]
        with torch.no_grad():
            want = torch.stack([m(x) for m in alone])
        rng = torch.get_rng_state()
        pred = vmapens.predict(ens, x, reduce="none")  # ens in train mode: predict runs eval
        assert ens.training and all(m.training for m in ens.template.modules())
        torch.testing.assert_close(pred, want, **TOL)
        ens.eval()
        with torch.no_grad():
            torch.testing.assert_close(ens(x), want, **TOL)
        assert torch.equal(rng, torch.get_rng_state())
        _assert_as_alone(ens, alone, grads=False)


@pytest.mark.parametrize("kw", list(BACKENDS))
def test_mc_dropout_recipe_with_same_draws_each_members_mask(kw: str) -> None:
    """docs/workflows.md's MC dropout: `ens.eval().apply(...)` puts the dropouts back in train
    mode; the BatchNorm stays in eval (its statistics untouched), every member draws the mask
    it draws alone from the call's RNG state."""
    factory, batch = MODELS["dropout2d-bn"]
    x, _ = batch()
    ens = vmapens.Ensemble(factory, N, seeds=range(N), randomness="same", **BACKENDS[kw])
    ens.eval().apply(lambda m: m.train() if isinstance(m, nn.Dropout2d) else None)
    alone = seeded_members(factory, N)
    for m in alone:
        m.eval().apply(lambda m: m.train() if isinstance(m, nn.Dropout2d) else None)
    start = torch.get_rng_state()
    with torch.no_grad():
        out = [ens(x) for _ in range(2)]
    after = torch.get_rng_state()
    for i, m in enumerate(alone):
        torch.set_rng_state(start)
        with torch.no_grad():
            for o in out:
                torch.testing.assert_close(o[i], m(x), **TOL, msg=f"member {i}")
        assert torch.equal(torch.get_rng_state(), after)
    assert not torch.equal(out[0], out[1])  # two calls, two masks
    _assert_as_alone(ens, alone, grads=False)


@pytest.mark.parametrize("kw", list(BACKENDS))
def test_same_predict_and_per_member_data_of_a_forward_that_draws_in_eval(kw: str) -> None:
    """The VAE samples in eval mode too: `predict` over a list of two batches gives each
    member what it gives alone from the call's RNG state, batch after batch, and leaves the RNG
    there; `ens(xs, in_dims=0)` (per-member data) likewise."""
    ens = vmapens.Ensemble(VAE, N, seeds=range(N), randomness="same", **BACKENDS[kw])
    alone = [m.eval() for m in seeded_members(VAE, N)]
    x, _ = _flat_batch()
    xs = torch.randn(N, 6, 4, generator=torch.Generator().manual_seed(4))
    start = torch.get_rng_state()
    pred = vmapens.predict(ens, [x[:3], x[3:]], reduce="none")
    with torch.no_grad():
        out = ens(xs, in_dims=0)
    after = torch.get_rng_state()
    for i, m in enumerate(alone):
        torch.set_rng_state(start)
        with torch.no_grad():
            want = torch.cat([m(x[:3]), m(x[3:])])
            torch.testing.assert_close(pred[i], want, **TOL, msg=f"member {i}")
            torch.testing.assert_close(out[i], m(xs[i]), **TOL, msg=f"member {i}")
        assert torch.equal(torch.get_rng_state(), after)


# -- randomness="different": independent draws; the self-check changes nothing ---------------


@pytest.mark.parametrize("kw", list(BACKENDS))
def test_different_gives_each_member_its_own_draws_in_every_turn(kw: str) -> None:
    """With chunks or a loop the turns must not replay one another's draws (only "same" puts
    the RNG back): 4 members, chunks of 2, every member a mask of its own."""
    ens = vmapens.Ensemble(lambda: nn.Dropout(0.5), 4, seed=0, **BACKENDS[kw])
    masks = ens(torch.ones(64))
    for i in range(4):
        for j in range(i):
            assert not torch.equal(masks[i], masks[j]), (i, j)
    assert not torch.equal(masks, ens(torch.ones(64)))


@pytest.mark.parametrize("kw", list(BACKENDS))
def test_the_first_steps_self_check_draws_nothing_from_the_global_rng(kw: str) -> None:
    """Two twin ensembles with "different" dropout, one step with the self-check and one
    without, from the same RNG state: the same parameters and the same RNG after (the check's
    runs of member 0 are forked off the global RNG)."""
    factory, batch = MODELS["dropout2d-bn"]
    x, y = batch()
    results = []
    for check in (True, False):
        ens = vmapens.Ensemble(factory, N, seeds=range(N), **BACKENDS[kw])
        step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedAdam(ens, lr=LR), check=check)
        torch.manual_seed(5)
        step(x, y)
        step(x, y)
        results.append(({k: v.clone() for k, v in ens.state_dict().items()}, torch.get_rng_state()))
    (sd_a, rng_a), (sd_b, rng_b) = results
    assert torch.equal(rng_a, rng_b)
    for k in sd_a:
        assert torch.equal(sd_a[k], sd_b[k]), k


# -- randomness="error": refused, nothing changed; no draw, no refusal -------------------------


def _snapshot(ens: vmapens.Ensemble, opt: vmapens.StackedOptimizer | None = None) -> list[Tensor]:
    tensors = [t.clone() for t in ens.stacked_state().values()]
    if opt is not None:
        for s in opt.state.values():
            tensors += [t.clone() for t in s.values() if isinstance(t, Tensor)]
    return tensors


def _assert_same(a: list[Tensor], b: list[Tensor]) -> None:
    assert len(a) == len(b)
    for u, v in zip(a, b, strict=True):
        assert torch.equal(u, v)


@pytest.mark.parametrize("kw", list(BACKENDS))
@pytest.mark.parametrize("model", ["dropout2d-bn", "stochastic-depth"])
def test_error_refuses_a_draw_and_changes_nothing(model: str, kw: str) -> None:
    """Train mode: `ens(x)` and a `make_step` step both refuse, naming randomness='error', and
    leave parameters, buffers (BatchNorm ran before the draw), optimizer state and the global
    RNG as they were. Then in eval mode the same step trains as alone (nothing is drawn)."""
    factory, batch = MODELS[model]
    x, y = batch()
    ens = vmapens.Ensemble(factory, N, seeds=range(N), randomness="error", **BACKENDS[kw])
    opt = vmapens.StackedAdam(ens, lr=LR)
    step = vmapens.make_step(ens, F.mse_loss, opt)
    opt.prepare()
    before, rng = _snapshot(ens, opt), torch.get_rng_state()
    with pytest.raises(RuntimeError, match="randomness='error'"):
        ens(x)
    with pytest.raises(RuntimeError, match="randomness"):
        step(x, y)
    _assert_same(before, _snapshot(ens, opt))
    assert torch.equal(rng, torch.get_rng_state())
    assert all(p.grad is None for p in ens.parameters())
    # eval mode: no draw, so no refusal; as alone (BatchNorm on its running statistics)
    alone = [m.eval() for m in seeded_members(factory, N)]
    ens.eval()
    rng = torch.get_rng_state()
    for _ in range(2):
        step(x, y)
    assert torch.equal(rng, torch.get_rng_state())
    _alone_steps(alone, [(x, y)] * 2)
    _assert_as_alone(ens, alone)


@pytest.mark.parametrize("kw", list(BACKENDS))
def test_error_trains_a_model_whose_dropout_is_frozen_in_eval(kw: str) -> None:
    """`model.drop.eval()` inside a model in train mode (the BatchNorm trains): no draw, so
    "error" runs it, and the steps equal Adam alone; the submodule stays in eval."""
    factory, batch = MODELS["dropout2d-bn"]
    x, y = batch()
    ens = vmapens.Ensemble(factory, N, seeds=range(N), randomness="error", **BACKENDS[kw])
    ens.template.drop.eval()
    alone = seeded_members(factory, N)
    for m in alone:
        m.drop.eval()
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedAdam(ens, lr=LR))
    rng = torch.get_rng_state()
    for _ in range(2):
        step(x, y)
    assert torch.equal(rng, torch.get_rng_state())
    _alone_steps(alone, [(x, y)] * 2)
    _assert_as_alone(ens, alone)
    assert ens.template.bn.training and not ens.template.drop.training


# -- documented refusals: refused with the way out, nothing changed; the way out as alone -----


class TransposedDropout(nn.Module):
    """`F.dropout` called in the forward on a transposed (non-contiguous) tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn, self.out = nn.Linear(4, 3, bias=False), nn.BatchNorm1d(3), nn.Linear(6, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.bn(self.fc(x)).transpose(0, 1)  # [3, B], memory order batch-first
        h = F.dropout(h, 0.5, training=self.training)
        return self.out(h.t()[:, :2].repeat(1, 3))


class LikeBernoulli(nn.Module):
    """`torch.bernoulli(torch.full_like(h, 0.7))`: a probability tensor made like the member's
    activation (batched under vmap, the same values in every member)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn, self.out = nn.Linear(4, 3, bias=False), nn.BatchNorm1d(3), nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.bn(self.fc(x))
        return self.out(h * torch.bernoulli(torch.full_like(h, 0.7)))


class InPlaceNoise(nn.Module):
    """`torch.empty(h.shape).normal_()`: an in-place draw into a tensor the forward made."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn = nn.Linear(4, 2, bias=False), nn.BatchNorm1d(2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.bn(self.fc(x))
        return h + torch.empty(h.shape).normal_()


@pytest.mark.parametrize(
    ("factory", "randomness", "kw", "says"),
    [
        (TransposedDropout, "same", "vmap", "backend='loop'"),
        (TransposedDropout, "different", "chunk", "backend='loop'"),
        (LikeBernoulli, "same", "vmap", "backend='loop'"),
        (LikeBernoulli, "same", "chunk", "backend='loop'"),
        (InPlaceNoise, "different", "vmap", "randomness='same'"),
    ],
    ids=["F.dropout-transposed-same", "F.dropout-transposed-different-chunk",
         "bernoulli-full_like-same", "bernoulli-full_like-same-chunk",
         "in-place-normal_-different"],
)  # fmt: skip
def test_documented_refusals_change_nothing_and_the_loop_trains_as_alone(
    factory: Callable[[], nn.Module], randomness: str, kw: str, says: str
) -> None:
    x, y = _flat_batch()
    ens = vmapens.Ensemble(factory, N, seeds=range(N), randomness=randomness, **BACKENDS[kw])
    opt = vmapens.StackedAdam(ens, lr=LR)
    step = vmapens.make_step(ens, F.mse_loss, opt)
    opt.prepare()
    before, rng = _snapshot(ens, opt), torch.get_rng_state()
    with pytest.raises(RuntimeError, match=says) as err:
        step(x, y)
    assert str(err.value).startswith("step:")
    _assert_same(before, _snapshot(ens, opt))
    assert torch.equal(rng, torch.get_rng_state())
    # the way out: backend="loop" with "same" draws as alone
    ens = vmapens.Ensemble(factory, N, seeds=range(N), randomness="same", backend="loop")
    alone = seeded_members(factory, N)
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedAdam(ens, lr=LR))
    torch.manual_seed(9)
    for _ in range(STEPS):
        step(x, y)
    rng_ens = torch.get_rng_state()
    torch.manual_seed(9)
    _alone_steps(alone, [(x, y)] * STEPS)
    _assert_as_alone(ens, alone)
    assert torch.equal(rng_ens, torch.get_rng_state())


# -- nn.RReLU ----------------------------------------------------------------------------------


class RReLUNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn, self.act, self.out = (
            nn.Linear(4, 5, bias=False), nn.BatchNorm1d(5), nn.RReLU(), nn.Linear(5, 2)
        )  # fmt: skip

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.act(self.bn(self.fc(x))))


@pytest.mark.parametrize("kw", ["vmap", "chunk"])
def test_rrelu_under_vmap_is_refused_naming_the_loop_and_changes_nothing(kw: str) -> None:
    """vmap has no rule for `aten::rrelu` (even in eval mode, where nothing is drawn): refused
    naming backend='loop', and the BatchNorm that ran before it is put back."""
    x, _ = _flat_batch()
    ens = vmapens.Ensemble(RReLUNet, N, seeds=range(N), **BACKENDS[kw])
    before, rng = _snapshot(ens), torch.get_rng_state()
    for mode in (True, False):
        ens.train(mode)
        with pytest.raises(RuntimeError, match="backend='loop'"):
            ens(x)
    _assert_same(before, _snapshot(ens))
    assert torch.equal(rng, torch.get_rng_state())


def test_rrelu_with_the_loop_draws_as_alone_and_warns_of_uneven_draws() -> None:
    """On CPU RReLU draws one slope per negative element only, so members alone leave the RNG
    in different states: with "same" the loop gives every member its own slopes from the
    call's state (as alone), and warns that the RNG goes on from the last member's. Eval
    mode: `leaky_relu` with the mean slope, as alone, the RNG untouched."""
    x, _ = _flat_batch()
    ens = vmapens.Ensemble(RReLUNet, N, seeds=range(N), randomness="same", backend="loop")
    alone = seeded_members(RReLUNet, N)
    start = torch.get_rng_state()
    with pytest.warns(UserWarning, match="drew other random numbers"), torch.no_grad():
        out = ens(x)
    ends = []
    for i, m in enumerate(alone):
        torch.set_rng_state(start)
        with torch.no_grad():
            torch.testing.assert_close(out[i], m(x), **TOL, msg=f"member {i}")
        ends.append(torch.get_rng_state())
    assert not all(torch.equal(e, ends[0]) for e in ends)  # the premise of the warning
    _assert_as_alone(ens, alone, grads=False)
    ens.eval()
    rng = torch.get_rng_state()
    with torch.no_grad():
        want = torch.stack([m.eval()(x) for m in alone])
        torch.testing.assert_close(ens(x), want, **TOL)
        torch.testing.assert_close(vmapens.predict(ens, x, reduce="none"), want, **TOL)
    assert torch.equal(rng, torch.get_rng_state())


def test_rrelu_in_eval_mode_runs_under_error_with_the_loop() -> None:
    x, _ = _flat_batch()
    ens = vmapens.Ensemble(RReLUNet, N, seeds=range(N), randomness="error", backend="loop")
    ens.eval()
    alone = [m.eval() for m in seeded_members(RReLUNet, N)]
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in alone]), **TOL)


# -- torch.Generator objects the forward draws from ---------------------------------------------


class NoiseFrom(nn.Module):
    """Noise drawn from a generator passed in (`forward(x, g)`)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: Tensor, g: torch.Generator) -> Tensor:
        h = self.fc(x)
        return h + torch.randn(h.shape, generator=g)


class NoiseHeld(nn.Module):
    """Noise drawn from a generator the module holds (one generator object for every member:
    members holding their own generators are refused at build)."""

    def __init__(self, g: torch.Generator) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.g = g

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        return h + torch.randn(h.shape, generator=self.g)


def _generator_passed_in(kw: str) -> None:
    x, _ = _flat_batch()
    ens = vmapens.Ensemble(NoiseFrom, N, seeds=range(N), randomness="same", **BACKENDS[kw])
    alone = seeded_members(NoiseFrom, N)
    g = torch.Generator().manual_seed(7)
    rng = torch.get_rng_state()
    with torch.no_grad():
        out = ens(x, g)
    want, ends = [], []
    for m in alone:
        own = torch.Generator().manual_seed(7)  # each member alone, given the same generator
        with torch.no_grad():
            want.append(m(x, own))
        ends.append(own.get_state())
    torch.testing.assert_close(out, torch.stack(want), **TOL)
    assert torch.equal(g.get_state(), ends[0])  # advanced as by one member alone
    assert torch.equal(rng, torch.get_rng_state())


def _generator_held(kw: str) -> None:
    x, y = _flat_batch()
    shared = torch.Generator().manual_seed(7)
    ens = vmapens.Ensemble(
        lambda: NoiseHeld(shared), N, seeds=range(N), randomness="same", **BACKENDS[kw]
    )
    alone = []
    for k in range(N):  # each member alone holds its own generator, seeded as the shared one
        torch.manual_seed(k)
        alone.append(NoiseHeld(torch.Generator().manual_seed(7)))
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedAdam(ens, lr=LR))
    for _ in range(STEPS):
        step(x, y)
    _alone_steps(alone, [(x, y)] * STEPS)
    _assert_as_alone(ens, alone)


def test_a_generator_passed_in_with_same_draws_as_alone_under_vmap() -> None:
    _generator_passed_in("vmap")


def test_a_generator_held_by_the_module_with_same_trains_as_alone_under_vmap() -> None:
    _generator_held("vmap")


@pytest.mark.parametrize("kw", ["chunk", "loop"])
def test_a_generator_passed_in_with_same_draws_as_alone_in_turns(kw: str) -> None:
    _generator_passed_in(kw)


@pytest.mark.parametrize("kw", ["chunk", "loop"])
def test_a_generator_held_by_the_module_with_same_trains_as_alone_in_turns(kw: str) -> None:
    _generator_held(kw)


def test_members_holding_equally_seeded_generators_are_refused_at_build() -> None:
    """Each member its own generator, all seeded alike: refused at build (the objects differ),
    naming the attribute; nothing to compare against, but the refusal must name `g`."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="`g`"):
            vmapens.Ensemble(lambda: NoiseHeld(torch.Generator().manual_seed(7)), N, seed=0)
