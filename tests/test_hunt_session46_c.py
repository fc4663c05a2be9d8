"""Hunt (session 46, c): side outputs of the forward that the loss or the user reads.

A VAE's ``self.kl``, a mixture-of-experts layer's ``self.aux_loss``, activations a forward hook
collects for a feature loss, a penalty read from a layer in the loss. The truth: N plain
copies (``ens.unstack()`` right after building) trained alone with ``torch.optim.SGD`` on the
same batches, float64. Tests that pass hold the promise; each ``xfail(strict=True)`` asserts
what the members alone do where the ensemble differs without an error (or fails unclearly).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from truth import resample

import vmapens

pytestmark = pytest.mark.usefixtures("float64_default")

N = 3
LR = 0.05
RUNS = [{}, {"chunk_size": 2}, {"backend": "loop"}]
IDS = ["vmap", "chunks-2", "loop"]
TOL = dict(rtol=1e-9, atol=1e-10)


def batches(k: int = 3) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 4, generator=g), torch.randn(6, 1, generator=g)) for _ in range(k)]


def train_alone(alone: list[nn.Module], data, loss: Callable[[nn.Module, Tensor, Tensor], Tensor]):
    """Each plain module trained on its own with torch.optim.SGD: ``loss(model, x, y)``."""
    for m in alone:
        opt = torch.optim.SGD(m.parameters(), lr=LR)
        for x, y in data:
            opt.zero_grad()
            loss(m, x, y).backward()
            opt.step()


def assert_members(ens: vmapens.Ensemble, alone: list[nn.Module]) -> None:
    for i, m in enumerate(alone):
        for k, v in m.state_dict().items():
            torch.testing.assert_close(ens.state_dict()[k][i], v, **TOL, msg=f"{k}, member {i}")


def step_run(ens: vmapens.Ensemble, loss_fn, data) -> None:
    step = vmapens.make_step(ens, loss_fn, vmapens.StackedSGD(ens, lr=LR))
    for x, y in data:
        step(x, y)


# -- a VAE's KL kept on the module -------------------------------------------------------------


class VAEish(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc, self.dec = nn.Linear(4, 6), nn.Linear(3, 1)
        self.kl = torch.zeros(())

    def forward(self, x: Tensor) -> Tensor:
        h = self.enc(x)
        mu, logvar = h[:, :3], h[:, 3:]
        self.kl = -0.5 * (1 + logvar - mu**2 - logvar.exp()).sum(1).mean()
        self.mu = mu  # kept for logging
        return self.dec(mu)


def elbo_alone(m: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return F.mse_loss(m(x), y) + 0.1 * m.kl


@pytest.mark.parametrize("kw", RUNS, ids=IDS)
def test_fit_loss_reading_the_kept_kl_and_what_the_template_holds_after(kw: dict) -> None:
    data = batches()
    x = torch.cat([b[0] for b in data])
    y = torch.cat([b[1] for b in data])
    xv, yv = data[0][0] + 1, data[0][1]
    ens = vmapens.Ensemble(VAEish, n=N, seed=0, **kw)
    alone = ens.unstack()
    h = vmapens.fit(
        ens, (x, y), lambda out, t: F.mse_loss(out, t) + 0.1 * ens.template.kl, epochs=2,
        batch_size=6, shuffle=False, optimizer=vmapens.StackedSGD(ens, lr=LR), progress=False,
        seed=0, val_data=(xv, yv),
    )  # fmt: skip
    val = torch.zeros(2, N)
    for i, m in enumerate(alone):
        opt = torch.optim.SGD(m.parameters(), lr=LR)
        for epoch in range(2):
            m.train()
            for xb, yb in data:
                opt.zero_grad()
                elbo_alone(m, xb, yb).backward()
                opt.step()
            m.eval()
            with torch.no_grad():
                val[epoch, i] = F.mse_loss(m(xv), yv) + 0.1 * m.kl
    assert_members(ens, alone)
    torch.testing.assert_close(h.val_loss, val, **TOL)
    # what the user reads afterwards: each member's own, from its last (validation) forward
    assert ens.template.kl.shape == (N,) and ens.template.mu.shape == (N, 6, 3)
    torch.testing.assert_close(ens.template.kl, torch.stack([m.kl for m in alone]), **TOL)
    torch.testing.assert_close(ens.template.mu, torch.stack([m.mu for m in alone]), **TOL)
    for i, m in enumerate(alone):
        torch.testing.assert_close(ens[i].kl, m.kl, **TOL)


@pytest.mark.parametrize("kw", RUNS, ids=IDS)
def test_fixed_per_member_loss_reading_the_kept_kl(kw: dict) -> None:
    # Fixed in session 46 (per_member lends each member its rows of the stacks): it returned [n, n]
    data = batches()
    ens = vmapens.Ensemble(VAEish, n=N, seed=0, **kw)
    alone = ens.unstack()
    opt = vmapens.StackedSGD(ens, lr=LR)

    def loss_fn(out: Tensor, y: Tensor) -> Tensor:
        return F.mse_loss(out, y) + 0.1 * ens.template.kl

    for x, y in data:
        opt.zero_grad()
        loss = vmapens.per_member(loss_fn)(ens(x), y)
        assert loss.shape == (N,)
        loss.sum().backward()
        opt.step()
    train_alone(alone, data, elbo_alone)
    assert_members(ens, alone)


class PerSampleKL(VAEish):
    def forward(self, x: Tensor) -> Tensor:
        h = self.enc(x)
        mu, logvar = h[:, :3], h[:, 3:]
        self.kl = -0.5 * (1 + logvar - mu**2 - logvar.exp()).sum(1)  # one per sample, [B]
        return self.dec(mu)


def test_fixed_fit_metric_reading_the_kept_kl() -> None:
    # Fixed in session 46: a metric read all members' kl (off by up to 0.93), a scalar one failed fit
    data = batches()
    x = torch.cat([b[0] for b in data])
    y = torch.cat([b[1] for b in data])
    xv, yv = data[0][0] + 1, data[0][1]
    ens = vmapens.Ensemble(PerSampleKL, n=N, seed=0)
    alone = ens.unstack()
    h = vmapens.fit(
        ens, (x, y), lambda out, t: F.mse_loss(out, t) + 0.1 * ens.template.kl.mean(), epochs=1,
        batch_size=6, shuffle=False, optimizer=vmapens.StackedSGD(ens, lr=LR), progress=False,
        seed=0, val_data=(xv, yv),
        metrics={"elbo": lambda out, t: F.mse_loss(out, t) + ens.template.kl.mean()},
    )  # fmt: skip
    want = torch.zeros(1, N)
    train_alone(alone, data, lambda m, xb, yb: F.mse_loss(m(xb), yb) + 0.1 * m.kl.mean())
    for i, m in enumerate(alone):
        m.eval()
        with torch.no_grad():
            want[0, i] = F.mse_loss(m(xv), yv) + m.kl.mean()
    assert_members(ens, alone)  # training itself is right
    torch.testing.assert_close(h.metrics["elbo"], want, **TOL)


# -- mixture-of-experts aux losses, one per layer -------------------------------------------


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(4, 2)
        self.experts = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])

    def forward(self, x: Tensor) -> Tensor:
        p = self.gate(x).softmax(-1)
        self.aux_loss = 2 * (p.mean(0) ** 2).sum()  # load balancing
        return sum(p[:, k : k + 1] * e(x) for k, e in enumerate(self.experts))


class MoENet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([MoE(), MoE()])
        self.out = nn.Linear(4, 1)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.out(x)


def aux_of(model: nn.Module) -> Tensor:
    return sum(m.aux_loss for m in model.modules() if isinstance(m, MoE))


def moe_alone(m: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    out = m(x)
    return F.mse_loss(out, y) + 0.1 * aux_of(m)


@pytest.mark.parametrize("kw", RUNS, ids=IDS)
def test_step_and_hand_loop_summing_the_aux_losses_over_the_templates_modules(kw: dict) -> None:
    data = batches()
    ens = vmapens.Ensemble(MoENet, n=N, seed=0, **kw)
    alone = ens.unstack()
    step_run(ens, lambda out, y: F.mse_loss(out, y) + 0.1 * aux_of(ens.template), data)
    train_alone(alone, data, moe_alone)
    assert_members(ens, alone)

    ens = vmapens.Ensemble(MoENet, n=N, seed=0, **kw)
    alone = ens.unstack()
    opt = vmapens.StackedSGD(ens, lr=LR)
    for x, y in data:
        opt.zero_grad()
        out = ens(x)
        aux = aux_of(ens.template)
        assert aux.shape == (N,)
        (vmapens.per_member(F.mse_loss)(out, y) + 0.1 * aux).sum().backward()
        opt.step()
    train_alone(alone, data, moe_alone)
    assert_members(ens, alone)


class SinkLayer(nn.Module):
    def __init__(self, sink: list) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.sink = sink  # the root's list of aux losses, shared by every layer

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.lin(x))
        self.sink.append(h.pow(2).mean())
        return h


class SinkNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.aux_losses: list[Tensor] = []
        self.l1, self.l2 = SinkLayer(self.aux_losses), SinkLayer(self.aux_losses)
        self.out = nn.Linear(4, 1)

    def forward(self, x: Tensor) -> Tensor:
        self.aux_losses.clear()
        return self.out(self.l2(self.l1(x)))


def sink_alone(m: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    out = m(x)
    return F.mse_loss(out, y) + 0.1 * sum(m.aux_losses)


def test_a_shared_aux_list_read_by_the_step_in_the_loop_trains_as_alone() -> None:
    data = batches()
    ens = vmapens.Ensemble(SinkNet, n=N, seed=0, backend="loop")
    alone = ens.unstack()
    step_run(ens, lambda out, y: F.mse_loss(out, y) + 0.1 * sum(ens.template.aux_losses), data)
    train_alone(alone, data, sink_alone)
    assert_members(ens, alone)


@pytest.mark.parametrize("kw", RUNS[:2], ids=IDS[:2])
def test_fixed_a_shared_aux_list_read_by_the_step(kw: dict) -> None:
    # Fixed in session 46: the loss read __init__'s empty list (the aux term dropped, 0.0036 off)
    data = batches()
    ens = vmapens.Ensemble(SinkNet, n=N, seed=0, **kw)
    alone = ens.unstack()
    step_run(ens, lambda out, y: F.mse_loss(out, y) + 0.1 * sum(ens.template.aux_losses), data)
    train_alone(alone, data, sink_alone)
    assert_members(ens, alone)
    # the template's modules share one list still, each member's terms in it
    assert ens.template.l1.sink is ens.template.aux_losses is ens.template.l2.sink
    for got, want in zip(ens.template.aux_losses, zip(*[m.aux_losses for m in alone]), strict=True):
        torch.testing.assert_close(got, torch.stack(want), **TOL)


@pytest.mark.parametrize("kw", RUNS, ids=IDS)
def test_fixed_a_shared_aux_list_read_by_the_hand_loop(kw: dict) -> None:
    # Fixed in session 46: empty under vmap and chunks, the last member's terms with the loop
    data = batches()
    ens = vmapens.Ensemble(SinkNet, n=N, seed=0, **kw)
    alone = ens.unstack()
    opt = vmapens.StackedSGD(ens, lr=LR)
    for x, y in data:
        opt.zero_grad()
        out = ens(x)
        aux = sum(ens.template.aux_losses)
        (vmapens.per_member(F.mse_loss)(out, y) + 0.1 * aux).sum().backward()
        opt.step()
    train_alone(alone, data, sink_alone)
    assert_members(ens, alone)


@pytest.mark.parametrize("kw", RUNS, ids=IDS)
@pytest.mark.parametrize("copy_how", ["select", "deepcopy"])
def test_a_copy_of_an_ensemble_with_a_shared_aux_list_trains_as_alone(copy_how: str, kw: dict):
    # A copy starts with one empty list its modules share, as a module that has not run
    data = batches()
    ens = vmapens.Ensemble(SinkNet, n=N, seed=0, **kw)

    def loss_fn(out: Tensor, y: Tensor) -> Tensor:  # reads the ensemble `ens` names now
        return F.mse_loss(out, y) + 0.1 * sum(ens.template.aux_losses)

    step_run(ens, loss_fn, data[:1])
    ens = ens.select(list(range(N))) if copy_how == "select" else copy.deepcopy(ens)
    assert ens.template.l1.sink is ens.template.aux_losses is ens.template.l2.sink
    alone = ens.unstack()
    step_run(ens, loss_fn, data[1:])
    train_alone(alone, data[1:], sink_alone)
    assert_members(ens, alone)


# -- activations collected by forward hooks ---------------------------------------------------

ACTIVATION: dict[str, Tensor] = {}


def get_activation(name: str):
    def hook(module: nn.Module, args, output: Tensor) -> None:  # the forums' recipe
        ACTIVATION[name] = output

    return hook


class Hooked(nn.Module):
    def __init__(self, where: str) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 5), nn.Linear(5, 1)
        self.where, self.feats, self.acts = where, {}, []
        if where == "own dict":
            self.fc1.register_forward_hook(lambda m, a, o: self.feats.__setitem__("fc1", o))
        elif where == "own list":
            self.fc1.register_forward_hook(lambda m, a, o: self.acts.append(o))
        elif where == "on the layer":
            self.fc1.register_forward_hook(lambda m, a, o: setattr(m, "last", o))
        else:  # a dict outside the module
            self.fc1.register_forward_hook(get_activation("fc1"))

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def feature(model: nn.Module, where: str) -> Tensor:
    if where == "own dict":
        return model.feats["fc1"]
    if where == "own list":
        value = model.acts[-1]
        model.acts.clear()
        return value
    if where == "on the layer":
        return model.fc1.last
    return ACTIVATION["fc1"]


WHERE = ["own dict", "own list", "on the layer", "outside"]


@pytest.mark.parametrize("kw", RUNS, ids=IDS)
@pytest.mark.parametrize("where", WHERE)
def test_step_loss_reading_hooked_activations_trains_as_alone(where: str, kw: dict) -> None:
    data = batches()
    ens = vmapens.Ensemble(lambda: Hooked(where), n=N, seed=0, **kw)
    alone = ens.unstack()
    step_run(ens, lambda out, y: F.mse_loss(out, y) + 0.1 * feature(ens.template, where).pow(2).mean(), data)  # fmt: skip
    train_alone(alone, data, lambda m, x, y: F.mse_loss(m(x), y) + 0.1 * feature(m, where).pow(2).mean())  # fmt: skip
    assert_members(ens, alone)


@pytest.mark.parametrize("kw", RUNS, ids=IDS)
@pytest.mark.parametrize("where", WHERE[:3])
def test_hand_loop_reading_hooked_activations_on_the_module_trains_as_alone(where: str, kw: dict):
    data = batches()
    ens = vmapens.Ensemble(lambda: Hooked(where), n=N, seed=0, **kw)
    alone = ens.unstack()
    opt = vmapens.StackedSGD(ens, lr=LR)
    for x, y in data:
        opt.zero_grad()
        out = ens(x)
        penalty = feature(ens.template, where).pow(2).flatten(1).mean(1)  # [n]: one per member
        (vmapens.per_member(F.mse_loss)(out, y) + 0.1 * penalty).sum().backward()
        opt.step()
    train_alone(alone, data, lambda m, x, y: F.mse_loss(m(x), y) + 0.1 * feature(m, where).pow(2).mean())  # fmt: skip
    assert_members(ens, alone)


@pytest.mark.xfail(
    strict=True,
    reason="a forward hook registered in the factory that stores activations in a dict outside "
    "the module (`activation[name] = output`): with backend='loop' the dict holds the last "
    "member's activation after ens(x), and a feature loss read from it adds that member's "
    "penalty to every member's loss (0.009 off after 3 steps), silently (under vmap reading it "
    "fails with functorch's bare 'tensor may have escaped' error)",
)
def test_bug_hand_loop_reading_a_hooks_outside_dict_in_the_loop() -> None:
    data = batches()
    ens = vmapens.Ensemble(lambda: Hooked("outside"), n=N, seed=0, backend="loop")
    alone = ens.unstack()
    opt = vmapens.StackedSGD(ens, lr=LR)
    try:
        for x, y in data:
            opt.zero_grad()
            out = ens(x)
            penalty = ACTIVATION["fc1"].pow(2).mean()
            (vmapens.per_member(F.mse_loss)(out, y) + 0.1 * penalty).sum().backward()
            opt.step()
    except (RuntimeError, ValueError):  # an error is right too
        return
    train_alone(alone, data, lambda m, x, y: F.mse_loss(m(x), y) + 0.1 * ACTIVATION["fc1"].pow(2).mean())  # fmt: skip
    assert_members(ens, alone)


# -- a penalty read from a layer in the loss ----------------------------------------------------


class WeightNormed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.utils.parametrizations.weight_norm(nn.Linear(4, 5))
        self.fc2 = nn.Linear(5, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


@pytest.mark.parametrize("kw", RUNS, ids=IDS)
def test_a_loss_reading_a_parametrized_weight_of_the_template_is_refused(kw: dict) -> None:
    ens = vmapens.Ensemble(WeightNormed, n=N, seed=0, **kw)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    x, y = batches(1)[0]
    with pytest.raises(RuntimeError, match="ens.template"):
        step_run(ens, lambda out, t: F.mse_loss(out, t) + ens.template.fc1.weight.pow(2).sum(), [(x, y)])  # fmt: skip
    for k, v in ens.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


class Enc(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.fc(x))
        self.act = h.pow(2).mean()
        return h


class Tied(nn.Module):
    """One encoder at two names, run twice: its kept `act` is the second run's."""

    def __init__(self) -> None:
        super().__init__()
        self.a = Enc()
        self.b = self.a
        self.out = nn.Linear(4, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.b(self.a(x)))


class ActPenalty(nn.Module):
    """A loss module holding the layer whose kept activation it penalises."""

    def __init__(self, enc: nn.Module) -> None:
        super().__init__()
        self.enc = enc

    def forward(self, out: Tensor, y: Tensor) -> Tensor:
        return F.mse_loss(out, y) + 0.1 * self.enc.act


@pytest.mark.parametrize("kw", RUNS, ids=IDS)
@pytest.mark.parametrize("name", ["a", "b"])
def test_a_loss_reading_the_kept_tensor_of_a_module_at_two_names(name: str, kw: dict) -> None:
    data = batches()
    ens = vmapens.Ensemble(Tied, n=N, seed=0, **kw)
    alone = ens.unstack()
    step_run(ens, lambda out, y: F.mse_loss(out, y) + 0.1 * getattr(ens.template, name).act, data)
    train_alone(alone, data, lambda m, x, y: F.mse_loss(m(x), y) + 0.1 * m.a.act)
    assert_members(ens, alone)


def test_fixed_a_loss_module_holding_a_template_layer_trains_without_a_warning() -> None:
    # Fixed in session 46: it warned that the layer's parameters were not trained (they are)
    data = batches()
    x = torch.cat([b[0] for b in data])
    y = torch.cat([b[1] for b in data])
    ens = vmapens.Ensemble(Tied, n=N, seed=0)
    alone = ens.unstack()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        vmapens.fit(
            ens, (x, y), ActPenalty(ens.template.a), epochs=1, batch_size=6, shuffle=False,
            optimizer=vmapens.StackedSGD(ens, lr=LR), progress=False, seed=0,
        )  # fmt: skip
    train_alone(alone, data, lambda m, xb, yb: F.mse_loss(m(xb), yb) + 0.1 * m.a.act)
    assert_members(ens, alone)


# -- compiled ---------------------------------------------------------------------------------


class KeptNoInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x: Tensor) -> Tensor:
        y = self.fc(x)
        self.aux = y.pow(2).mean()  # set first by the forward, not in __init__
        return y


def test_eager_step_reading_a_kept_tensor_first_set_by_the_forward() -> None:
    data = batches()
    ens = vmapens.Ensemble(KeptNoInit, n=N, seed=0)
    alone = ens.unstack()
    step_run(ens, lambda out, y: F.mse_loss(out, y) + 0.1 * ens.template.aux, data)
    train_alone(alone, data, lambda m, x, y: F.mse_loss(m(x), y) + 0.1 * m.aux)
    assert_members(ens, alone)


@pytest.mark.parametrize(
    "name,error,match",
    [
        ("aux", vmapens.CompileFailed, r"keeps `aux`.*compile=False"),
        ("auxx", AttributeError, "auxx"),
    ],
    ids=["kept", "typo"],
)
def test_fixed_compiled_step_reading_a_kept_tensor_not_set_in_init(name, error, match) -> None:
    # Fixed in session 46: a bare AttributeError ('KeptNoInit' object has no attribute 'aux');
    # the review's: a typo in the loss (`auxx`) stays the user's AttributeError
    ens = vmapens.Ensemble(KeptNoInit, n=N, seed=0)
    x, y = batches(1)[0]
    step = vmapens.make_step(
        ens, lambda out, t: F.mse_loss(out, t) + 0.1 * getattr(ens.template, name),
        vmapens.StackedSGD(ens, lr=LR), compile=True,
    )  # fmt: skip
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    with pytest.raises(error, match=match):
        step(x, y)
    for key, value in ens.state_dict().items():
        assert torch.equal(value, before[key]), key


class AccumulatingNet(SinkNet):
    """Never clears the shared list: each forward reads the terms of every call before."""

    def forward(self, x: Tensor) -> Tensor:
        h = self.out(self.l2(self.l1(x)))
        return h + 0.1 * sum(t.detach() for t in self.aux_losses)


IN_TURNS = pytest.mark.xfail(
    strict=True,
    reason="a container several modules share is not handed back at the next call (each "
    "module's rows would part it): with members in turns each turn reads the last turn's terms "
    "(0.01-0.05 off from the second call, or a size error; docs/semantics.md)",
)


@pytest.mark.parametrize(
    "kw", [RUNS[0], *[pytest.param(kw, marks=IN_TURNS) for kw in RUNS[1:]]], ids=IDS
)
def test_a_shared_list_read_across_calls(kw: dict) -> None:
    ens = vmapens.Ensemble(AccumulatingNet, n=N, seed=0, **kw)
    alone = ens.unstack()
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(5, 4, generator=g)
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in alone]), **TOL)


class Collects(nn.Module):
    """Appends its hidden activation; the loss reads the list, then clears it, as a plain loop
    clears its module's after reading it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(4, 3), nn.Linear(3, 1)
        self.acts: list[Tensor] = []

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        self.acts.append(h)
        return self.out(h)


def read_and_clear(m: nn.Module) -> Tensor:
    penalty = sum(a.pow(2).mean() for a in m.acts)
    m.acts.clear()
    return penalty


def read_and_reset(m: nn.Module) -> Tensor:
    penalty = sum(a.pow(2).mean() for a in m.acts)
    m.acts = []
    return penalty


@pytest.mark.parametrize("read_and_clear", [read_and_clear, read_and_reset], ids=["clear", "new"])
@pytest.mark.parametrize("kw", RUNS, ids=IDS)
def test_per_member_loss_that_clears_what_it_read(kw: dict, read_and_clear: Callable) -> None:
    # Session 46's review: the lent rows were cleared, the stack put back whole, and the next
    # call appended to it (a graph more every step; a sum over it failed at the second step)
    data = batches()
    ens = vmapens.Ensemble(Collects, n=N, seed=0, **kw)
    alone = ens.unstack()
    opt = vmapens.StackedSGD(ens, lr=LR)
    for x, y in data:
        opt.zero_grad()
        loss = vmapens.per_member(lambda o, t: F.mse_loss(o, t) + read_and_clear(ens.template))
        loss(ens(x), y).sum().backward()
        opt.step()
        assert ens.template.acts == []
    train_alone(alone, data, lambda m, x, y: F.mse_loss(m(x), y) + read_and_clear(m))
    assert_members(ens, alone)


def test_out_of_bag_loss_reading_the_kept_kl_is_refused() -> None:
    # Session 46's review: each member's out-of-bag loss read all members' kl (fit failed, or
    # scored every member with the mean over all members'); lent its own row, it is still the
    # kl of the forward over every row, where alone the member keeps its left-out rows' only
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(12, 4, generator=g), torch.randn(12, 1, generator=g)
    ens = vmapens.Ensemble(VAEish, n=N, seed=0)
    with pytest.raises(ValueError, match=r"val_data='oob' cannot give per member"):
        vmapens.fit(
            ens, (x, y), lambda out, t: F.mse_loss(out, t) + 0.1 * ens.template.kl, epochs=1,
            optimizer=vmapens.StackedSGD(ens, lr=LR), bootstrap=True, val_data="oob",
            progress=False, seed=5,
        )  # fmt: skip


def test_out_of_bag_loss_of_a_forward_that_keeps_what_the_loss_does_not_read() -> None:
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(12, 4, generator=g), torch.randn(12, 1, generator=g)
    ens = vmapens.Ensemble(VAEish, n=N, seed=0)
    alone = ens.unstack()
    h = vmapens.fit(
        ens, (x, y), F.mse_loss, epochs=1, optimizer=vmapens.StackedSGD(ens, lr=LR),
        bootstrap=True, val_data="oob", progress=False, seed=5,
    )  # fmt: skip
    for i, m in enumerate(alone):
        rows = resample(12, 5, i)
        train_alone([m], [(x[rows], y[rows])], lambda m, xb, yb: F.mse_loss(m(xb), yb))
        left_out = torch.ones(12, dtype=torch.bool)
        left_out[rows] = False
        with torch.no_grad():
            want = F.mse_loss(m.eval()(x[left_out]), y[left_out])
        torch.testing.assert_close(h.val_loss[-1, i], want, **TOL)
    assert_members(ens, alone)


class VAEPair(VAEish):
    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return super().forward(x), self.mu


@pytest.mark.parametrize("kw", RUNS, ids=IDS)
def test_per_member_with_nested_in_dims_reading_the_kept_kl(kw: dict) -> None:
    # Session 46's review: with in_dims=((0, 0), None) the lending was skipped ([n, n] losses)
    data = batches()
    ens = vmapens.Ensemble(VAEPair, n=N, seed=0, **kw)
    alone = ens.unstack()
    opt = vmapens.StackedSGD(ens, lr=LR)

    def loss_fn(out: tuple[Tensor, Tensor], y: Tensor) -> Tensor:
        return F.mse_loss(out[0], y) + 0.1 * ens.template.kl + 0.01 * out[1].pow(2).mean()

    for x, y in data:
        opt.zero_grad()
        loss = vmapens.per_member(loss_fn, in_dims=((0, 0), None))(ens(x), y)
        assert loss.shape == (N,)
        loss.sum().backward()
        opt.step()

    def alone_loss(m: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        rec, mu = m(x)
        return F.mse_loss(rec, y) + 0.1 * m.kl + 0.01 * mu.pow(2).mean()

    train_alone(alone, data, alone_loss)
    assert_members(ens, alone)


def test_out_of_bag_with_a_random_loss_and_a_forward_that_keeps_a_tensor() -> None:
    # Session 46's review: the refusal compared two draws of a noisy loss and refused it
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(12, 4, generator=g), torch.randn(12, 1, generator=g)
    ens = vmapens.Ensemble(VAEish, n=N, seed=0)
    h = vmapens.fit(
        ens, (x, y), lambda o, t: F.mse_loss(o + 0.01 * torch.randn_like(o), t), epochs=2,
        optimizer=vmapens.StackedSGD(ens, lr=LR), bootstrap=True, val_data="oob",
        progress=False, seed=5,
    )  # fmt: skip
    assert h.val_loss.shape == (2, N) and bool(torch.isfinite(h.val_loss).all())
    # the refusal's check leaves the RNG as it found it: the loss's own call draws as before
    before = torch.get_rng_state()
    stacks = vmapens._kept.kept_stacks(N)
    vmapens._evaluate._refuse_kept_reads(lambda: torch.randn(3).sum(), stacks, 0)
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("kw", RUNS, ids=IDS)
def test_per_member_reading_a_shared_aux_list_trains_as_alone(kw: dict) -> None:
    # Session 46's review: a shared container was not lent ([n, n] losses, 0.064 off) and
    # ens[i] held an empty list
    data = batches()
    ens = vmapens.Ensemble(SinkNet, n=N, seed=0, **kw)
    alone = ens.unstack()
    opt = vmapens.StackedSGD(ens, lr=LR)
    for x, y in data:
        opt.zero_grad()
        per = vmapens.per_member(lambda o, t: F.mse_loss(o, t) + 0.1 * sum(ens.template.aux_losses))
        loss = per(ens(x), y)
        assert loss.shape == (N,)
        loss.sum().backward()
        opt.step()
    train_alone(alone, data, sink_alone)
    assert_members(ens, alone)
    for i, m in enumerate(alone):
        mine = ens[i]
        assert mine.l1.sink is mine.aux_losses is mine.l2.sink
        torch.testing.assert_close(mine.aux_losses, [t.detach() for t in m.aux_losses], **TOL)


def test_a_stopped_member_keeps_its_terms_in_a_shared_aux_list() -> None:
    # a member masked out of a step does not run alone: its list keeps the last terms
    data = batches(2)
    ens = vmapens.Ensemble(SinkNet, n=N, seed=0)
    alone = ens.unstack()
    loss_fn = lambda out, y: F.mse_loss(out, y) + 0.1 * sum(ens.template.aux_losses)  # noqa: E731
    step = vmapens.make_step(ens, loss_fn, vmapens.StackedSGD(ens, lr=LR))
    mask = torch.tensor([True, False, True])
    step(*data[0])
    step(*data[1], mask)
    for i, m in enumerate(alone):
        opt = torch.optim.SGD(m.parameters(), lr=LR)
        for k, (x, y) in enumerate(data):
            if k == 1 and not mask[i]:
                continue
            opt.zero_grad()
            sink_alone(m, x, y).backward()
            opt.step()
    assert_members(ens, alone)
    for got, want in zip(ens.template.aux_losses, zip(*[m.aux_losses for m in alone]), strict=True):
        torch.testing.assert_close(got, torch.stack(want).detach(), **TOL)
