"""Journey: an ensemble of small neural ODEs and continuous-time models, solvers by hand.

A researcher without torchdiffeq writes the solvers herself: (a) an ODE block whose forward
integrates dy/dt = f(t, y) with 10 fixed RK4 steps (f a tanh MLP, t concatenated to y; the end
time a learned 0-d parameter); (b) the time grid as an input tensor, shared or per member
(`in_dims=0`), also read as Python floats with `ts.tolist()`; (c) an adaptive Bogacki-Shampine
3(2) solver whose `while` loop accepts a step `if err.item() < tol` (or `if err < tol` on the
tensor): data-dependent control flow per member, refused under vmap naming backend='loop', and
exact there, each member with its own step sizes; a warm start kept in a float on the module is
refused by the first step, kept in a buffer it trains as alone; and the same solver written
without Python branches (`torch.where`, a fixed number of attempts), which vmap runs with every
member's own step sizes; (d) a Hamiltonian NN whose vector field is `torch.autograd.grad(H(q,
p).sum(), (q, p), create_graph=True)` in the forward (refused under vmap, exact with
backend='loop') or `torch.func.grad` (exact under vmap); (e) a latent ODE with an ODE-RNN
encoder (GRUCell, irregular observations with masks, run backwards in time); (f) the adjoint
method by hand, an `autograd.Function` whose backward integrates the adjoint ODE.

The truth: each member copied before training (`ens.unstack()`) and trained alone with
`torch.optim.Adam` on the same batches, float64. Checked through `make_step`, a hand-written
loop, `fit` and `predict`.

`make_step(compile=True)` on the 10-step RK4 block was checked by hand (3 steps, per-member
learning rates: within 1e-9 of alone, not bit for bit) but is not pinned here: its first call
compiled for 36 s on this shared machine. What this journey found: a hand-written adjoint whose
backward calls the module (as torchdiffeq's does) fails under backend='loop' with torch's
"Tensor on device meta" and the advice to pass check=False (fixed in session 31: the message
names the way out); `fit` refused a time grid in tensor `data` without saying how to pass a
shared input (fixed too).
Left as documented (docs/semantics.md, "Only the first step and vmapens.check look"): the float
warm start under backend='loop' in a hand-written loop (`ens(x)`, no probe) starts every member
from the last member's step size, 2e-6 off alone after 3 steps; a counter of accepted steps kept
in an int on the module reads the last member's in every `ens[i]`.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

import vmapens
from tests.truth import TOL64, assert_members_equal

pytestmark = pytest.mark.usefixtures("float64_default")

N = 3
mse = nn.MSELoss()


def data(*shape: int, seed: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


X, Y = data(6, 2, seed=0), data(6, 2, seed=1)
TS = torch.tensor([0.0, 0.1, 0.25, 0.5, 0.7, 1.0], dtype=torch.float64)  # irregular grid


def rk4_step(f, t, y, dt):
    k1 = f(t, y)
    k2 = f(t + dt / 2, y + dt / 2 * k1)
    k3 = f(t + dt / 2, y + dt / 2 * k2)
    k4 = f(t + dt, y + dt * k3)
    return y + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)


def bs32(f, t, y, h):
    """Bogacki-Shampine 3(2): the third-order solution and the error estimate."""
    k1 = f(t, y)
    k2 = f(t + h / 2, y + h / 2 * k1)
    k3 = f(t + 3 * h / 4, y + 3 * h / 4 * k2)
    y3 = y + h * (2 * k1 + 3 * k2 + 4 * k3) / 9
    k4 = f(t + h, y3)
    y2 = y + h * (7 * k1 / 24 + k2 / 4 + k3 / 3 + k4 / 8)
    return y3, (y3 - y2).abs().max()


class Field(nn.Module):
    """f(t, y): a tanh MLP, t concatenated to y."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))

    def forward(self, t: Tensor, y: Tensor) -> Tensor:
        return self.net(torch.cat([y, t.expand(*y.shape[:-1], 1)], -1))


class ODEBlock(nn.Module):
    """y(T) by 10 RK4 steps from t = 0; T a learned 0-d parameter, t a scalar tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.f = Field()
        self.T = nn.Parameter(torch.tensor(1.0))

    def forward(self, y: Tensor) -> Tensor:
        t, dt = torch.zeros(()), self.T / 10
        for _ in range(10):
            y, t = rk4_step(self.f, t, y, dt), t + dt
        return y


class Grid(nn.Module):
    """The trajectory [batch, len(ts), 2] on the grid `ts`, one RK4 step per interval."""

    def __init__(self) -> None:
        super().__init__()
        self.f = Field()

    def forward(self, y: Tensor, ts: Tensor) -> Tensor:
        out = [y]
        for i in range(ts.shape[0] - 1):
            y = rk4_step(self.f, ts[i : i + 1], y, ts[i + 1] - ts[i])
            out.append(y)
        return torch.stack(out, 1)


class GridFloats(Grid):
    """The same, the grid read as Python floats."""

    def forward(self, y: Tensor, ts: Tensor) -> Tensor:
        out, grid = [y], ts.tolist()
        for t0, t1 in zip(grid[:-1], grid[1:]):
            y = rk4_step(self.f, torch.full((1,), t0), y, t1 - t0)
            out.append(y)
        return torch.stack(out, 1)


class Adaptive(nn.Module):
    """y(1) by an adaptive BS3(2): `while t < 1`, a step accepted `if err.item() < tol`."""

    tol = 1e-4

    def __init__(self) -> None:
        super().__init__()
        self.f = Field()

    def first_step(self) -> float:
        return 0.1

    def accepted(self, h: float) -> None:
        pass

    def forward(self, y: Tensor) -> Tensor:
        t, h = 0.0, self.first_step()
        while t < 1.0:
            h = min(h, 1.0 - t)
            y_new, err = bs32(self.f, torch.full((1,), t), y, h)
            e = err.item()
            if e < self.tol:
                t, y = t + h, y_new
                if t < 1.0:
                    self.accepted(h)
            h *= min(5.0, max(0.2, 0.9 * (self.tol / max(e, 1e-12)) ** (1 / 3)))
        return y


class AdaptiveTensorIf(Adaptive):
    """The same with `if err < tol` on the tensor."""

    def forward(self, y: Tensor) -> Tensor:
        t, h = 0.0, 0.1
        while t < 1.0:
            h = min(h, 1.0 - t)
            y_new, err = bs32(self.f, torch.full((1,), t), y, h)
            if err < self.tol:
                t, y = t + h, y_new
            h *= 0.5 if err >= self.tol else 1.5
        return y


class WarmFloat(Adaptive):
    """A solve starts from the last accepted step of the one before: a float on the module."""

    def __init__(self) -> None:
        super().__init__()
        self.h0 = 0.1

    def first_step(self) -> float:
        return self.h0

    def accepted(self, h: float) -> None:
        self.h0 = h


class WarmBuffer(Adaptive):
    """The same warm start in a buffer (docs/semantics.md's way out: one row per member)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("h0", torch.tensor(0.1))

    def first_step(self) -> float:
        return self.h0.item()

    def accepted(self, h: float) -> None:
        self.h0.fill_(h)


class Vectorised(nn.Module):
    """The adaptive BS3(2) without Python branches on values: 30 attempts, each accepted or not
    by `torch.where`; returns y(1) and the number of accepted steps."""

    tol = 1e-5

    def __init__(self) -> None:
        super().__init__()
        self.f = Field()

    def forward(self, y: Tensor) -> tuple[Tensor, Tensor]:
        t, h, accepted = torch.zeros(()), torch.full((), 0.1), torch.zeros(())
        for _ in range(30):
            h = torch.minimum(h, 1.0 - t)
            y_new, err = bs32(self.f, t.reshape(1), y, h)
            ok = (err < self.tol) & (t < 1.0)
            t, y = torch.where(ok, t + h, t), torch.where(ok, y_new, y)
            accepted = accepted + ok.to(y.dtype)
            h = h * (0.9 * (self.tol / err.clamp_min(1e-12)) ** (1 / 3)).clamp(0.2, 5.0)
        return y, accepted


class HNN(nn.Module):
    """(q, p) after 4 RK4 steps of Hamilton's equations, H(q, p) a tanh MLP; the vector field
    (dH/dp, -dH/dq) by `torch.autograd.grad` in the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.H = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))

    def field(self, q: Tensor, p: Tensor) -> tuple[Tensor, Tensor]:
        with torch.enable_grad():
            q, p = q.requires_grad_(), p.requires_grad_()
            energy = self.H(torch.cat([q, p], -1)).sum()
            dq, dp = torch.autograd.grad(energy, (q, p), create_graph=True)
        return dp, -dq

    def forward(self, z: Tensor) -> Tensor:
        def f(t, z):
            return torch.cat(self.field(z[..., :1].clone(), z[..., 1:].clone()), -1)

        for _ in range(4):
            z = rk4_step(f, 0.0, z, 0.1)
        return z


class HNNFunc(HNN):
    """The vector field by `torch.func.grad` (docs/semantics.md: runs under vmap)."""

    def field(self, q: Tensor, p: Tensor) -> tuple[Tensor, Tensor]:
        def energy(q, p):
            return self.H(torch.cat([q, p], -1)).sum()

        dq, dp = torch.func.grad(energy, argnums=(0, 1))(q, p)
        return dp, -dq


class LatentODE(nn.Module):
    """ODE-RNN encoder over irregular, masked observations (backwards in time: the hidden
    state evolved by RK4 between observations, a GRUCell update where anything was seen),
    then the latent state integrated forward (2 RK4 steps per interval) and decoded."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRUCell(4, 6)
        self.enc = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))
        self.to_z = nn.Linear(6, 3)
        self.f = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 3))
        self.dec = nn.Linear(3, 2)

    def forward(self, x: Tensor, mask: Tensor, ts: Tensor) -> Tensor:
        h = x.new_zeros(x.shape[0], 6)
        for k in range(x.shape[1] - 1, -1, -1):
            if k < x.shape[1] - 1:
                h = rk4_step(lambda t, h: self.enc(h), 0.0, h, ts[k] - ts[k + 1])
            seen = mask[:, k].amax(-1, keepdim=True) > 0
            update = self.gru(torch.cat([x[:, k] * mask[:, k], mask[:, k]], -1), h)
            h = torch.where(seen, update, h)
        z = self.to_z(h)
        out = [self.dec(z)]
        for k in range(x.shape[1] - 1):
            for _ in range(2):
                z = rk4_step(lambda t, z: self.f(z), 0.0, z, (ts[k + 1] - ts[k]) / 2)
            out.append(self.dec(z))
        return torch.stack(out, 1)


def masked_mse(out: Tensor, target: Tensor) -> Tensor:
    """The target holds the values and the mask side by side on the last dim."""
    y, m = target[..., :2], target[..., 2:]
    return ((out - y) ** 2 * m).sum() / m.sum()


def rk4_path(f, y: Tensor, steps: int = 10, dt: float = 0.1) -> Tensor:
    for _ in range(steps):
        y = rk4_step(f, 0.0, y, dt)
    return y


def adjoint_solve(aug, y1: Tensor, a1: Tensor, params) -> list[Tensor]:
    """RK4 backwards from t = 1 to 0 of [y, a, dL/dtheta]; `aug(s)` gives their derivatives."""
    s, h = [y1, a1, *[torch.zeros_like(p) for p in params]], -0.1
    for _ in range(10):
        k1 = aug(s)
        k2 = aug([x + h / 2 * k for x, k in zip(s, k1)])
        k3 = aug([x + h / 2 * k for x, k in zip(s, k2)])
        k4 = aug([x + h * k for x, k in zip(s, k3)])
        s = [x + h / 6 * (a + 2 * b + 2 * c + d) for x, a, b, c, d in zip(s, k1, k2, k3, k4)]
    return s


class AdjointModule(torch.autograd.Function):
    """odeint_adjoint as torchdiffeq writes it: the backward calls the module `f` itself."""

    @staticmethod
    def forward(ctx, y0, f, *params):
        with torch.no_grad():
            y1 = rk4_path(lambda t, y: f(y), y0)
        ctx.f = f
        ctx.save_for_backward(y1, *params)
        return y1

    @staticmethod
    def backward(ctx, a1):
        y1, *params = ctx.saved_tensors

        def aug(s):
            with torch.enable_grad():
                y = s[0].detach().requires_grad_()
                fy = ctx.f(y)
                gy, *gp = torch.autograd.grad(fy, (y, *params), s[1])
            return [fy, -gy, *[-g for g in gp]]

        s = adjoint_solve(aug, y1, a1, params)
        return (s[1], None, *s[2:])


def functional(f: nn.Module):
    names = [n for n, _ in f.named_parameters()]
    return lambda y, ps: torch.func.functional_call(f, dict(zip(names, ps)), (y,))


class AdjointFunctional(torch.autograd.Function):
    """The same, `f` called on the parameters the Function was given; the vjps by
    `torch.func.vjp`, so torch.func can vmap it (setup_context, generate_vmap_rule)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(y0, f, *params):
        call = functional(f)
        with torch.no_grad():
            return rk4_path(lambda t, y: call(y, params), y0)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, f, *params = inputs
        ctx.call = functional(f)
        ctx.save_for_backward(output, *params)

    @staticmethod
    def backward(ctx, a1):
        y1, *params = ctx.saved_tensors

        def aug(s):
            fy, pull = torch.func.vjp(ctx.call, s[0], tuple(params))
            gy, gp = pull(s[1])
            return [fy, -gy, *[-g for g in gp]]

        s = adjoint_solve(aug, y1, a1, params)
        return (s[1], None, *s[2:])


class Adjoint(nn.Module):
    function: type[torch.autograd.Function] = AdjointFunctional

    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 2))

    def forward(self, y: Tensor) -> Tensor:
        return self.function.apply(y, self.f, *self.f.parameters())


class AdjointCallsModule(Adjoint):
    function = AdjointModule


# -- helpers -------------------------------------------------------------------------------


def pair(factory, **kw) -> tuple[vmapens.Ensemble, list[nn.Module]]:
    """The ensemble (float64) and its members as plain modules, copied before training."""
    ens = vmapens.Ensemble(factory, n=N, seed=0, **kw).double()
    return ens, [copy.deepcopy(m) for m in ens.unstack()]


def train_alone(models, inputs, target, steps, lr=1e-2, loss_fn=mse, per_member=False, opts=None):
    """Each model with its own torch.optim.Adam (or `opts[i]`); `inputs` a tuple of positional
    inputs; with `per_member`, model i sees row i of each input and of the target."""
    opts = opts or [torch.optim.Adam(m.parameters(), lr=lr) for m in models]
    for i, (m, opt) in enumerate(zip(models, opts)):
        args = tuple(a[i] for a in inputs) if per_member else inputs
        want = target[i] if per_member else target
        for _ in range(steps):
            opt.zero_grad()
            loss_fn(m(*args), want).backward()
            opt.step()
    return opts


def unchanged(ens: vmapens.Ensemble, before: dict[str, Tensor]) -> bool:
    return all(torch.equal(v, before[k]) for k, v in ens.state_dict().items())


# -- (a) the fixed-step RK4 block -----------------------------------------------------------


def test_rk4_block_through_make_step_a_hand_loop_fit_and_predict_is_each_member_alone() -> None:
    ens, alone = pair(ODEBlock)
    lrs = [1e-2, 3e-2, 5e-3]
    opt = vmapens.StackedAdam(ens, lr=lrs)
    step = vmapens.make_step(ens, mse, opt)
    for _ in range(2):
        step(X, Y)
    for _ in range(2):  # the README's loop, on the same optimizer
        loss = vmapens.per_member(mse)(ens(X), Y)
        opt.zero_grad()
        loss.sum().backward()
        opt.step()
    opts = [torch.optim.Adam(m.parameters(), lr=lr) for m, lr in zip(alone, lrs)]
    train_alone(alone, (X,), Y, steps=4, opts=opts)
    assert_members_equal(ens, alone)
    # fit: a fresh StackedAdam, one batch of everything
    vmapens.fit(ens, (X, Y), mse, steps=2, lr=2e-2, progress=False, seed=0)
    train_alone(alone, (X,), Y, steps=2, lr=2e-2)
    assert_members_equal(ens, alone)
    assert len(set(ens.state_dict()["T"].tolist())) == N  # each member its own end time
    want = torch.stack([m(X) for m in alone]).detach()
    torch.testing.assert_close(vmapens.predict(ens, X, reduce="mean"), want.mean(0), **TOL64)
    got = vmapens.predict(ens, X, reduce="variance")
    torch.testing.assert_close(got, want.var(0, unbiased=False), **TOL64)


# -- (b) the time grid as an input ----------------------------------------------------------


@pytest.mark.parametrize("cls", [Grid, GridFloats])
def test_a_shared_time_grid_input_trains_each_member_alone(cls) -> None:
    target = data(6, 6, 2, seed=2)
    ens, alone = pair(cls)
    step = vmapens.make_step(ens, mse, vmapens.StackedAdam(ens, lr=1e-2))
    for _ in range(2):
        step((X, TS), target)
    train_alone(alone, (X, TS), target, steps=2)
    assert_members_equal(ens, alone)
    # fit over a list of batches, the grid in each (tensor data would cut it by rows)
    ens, alone = pair(cls)
    batches = [((X[:3], TS), target[:3]), ((X[3:], TS), target[3:])]
    vmapens.fit(ens, batches, mse, epochs=2, lr=1e-2, progress=False, seed=0)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in alone]
    for _ in range(2):
        for (x, ts), y in batches:
            train_alone(alone, (x, ts), y, steps=1, opts=opts)
    assert_members_equal(ens, alone)


def test_per_member_time_grids_train_alone_and_a_grid_read_as_floats_is_refused() -> None:
    g = torch.Generator().manual_seed(3)
    grids = torch.rand(N, 6, generator=g, dtype=torch.float64).sort(-1).values
    xs, targets = data(N, 6, 2, seed=4), data(N, 6, 6, 2, seed=5)
    ens, alone = pair(Grid)
    step = vmapens.make_step(ens, mse, vmapens.StackedAdam(ens, lr=1e-2), in_dims=0)
    for _ in range(2):
        step((xs, grids), targets)
    train_alone(alone, (xs, grids), targets, steps=2, per_member=True)
    assert_members_equal(ens, alone)
    # a hand loop: per-member initial states, one shared grid (in_dims per input)
    opt = vmapens.StackedAdam(ens, lr=1e-2)
    for _ in range(2):
        loss = vmapens.per_member(mse, in_dims=(0, 0))(ens(xs, TS, in_dims=(0, None)), targets)
        opt.zero_grad()
        loss.sum().backward()
        opt.step()
    train_alone(alone, (xs, TS.expand(N, -1)), targets, steps=2, per_member=True)
    assert_members_equal(ens, alone)
    got = vmapens.predict(ens, (xs, TS), in_dims=(0, None), reduce="none")
    torch.testing.assert_close(got, torch.stack([m(xs[i], TS) for i, m in enumerate(alone)]))
    # ts.tolist() of a member's own grid: refused, naming the way out; nothing changed
    ens, _ = pair(GridFloats)
    before = copy.deepcopy(ens.state_dict())
    step = vmapens.make_step(ens, mse, vmapens.StackedAdam(ens, lr=1e-2), in_dims=0)
    with pytest.raises(RuntimeError, match=r"\.tolist\(\).*backend='loop'"):
        step((xs, grids), targets)
    assert unchanged(ens, before)


# -- (c) an adaptive step size --------------------------------------------------------------


@pytest.mark.parametrize("cls", [Adaptive, AdaptiveTensorIf])
def test_an_adaptive_solver_is_refused_under_vmap_naming_backend_loop(cls) -> None:
    ens, _ = pair(cls)
    before = copy.deepcopy(ens.state_dict())
    step = vmapens.make_step(ens, mse, vmapens.StackedAdam(ens, lr=1e-2))
    what = r"\.item\(\)" if cls is Adaptive else "data-dependent control flow"
    with pytest.raises(RuntimeError, match=rf"{what}.*backend='loop'"):
        step(X, Y)
    with pytest.raises(RuntimeError, match=rf"^Ensemble: .*{what}.*backend='loop'"):
        ens(X)
    with pytest.raises(RuntimeError, match=r"backend='loop'"):
        vmapens.predict(ens, X, reduce="mean")
    assert unchanged(ens, before)
    looped, _ = pair(cls, backend="loop")
    with pytest.raises(ValueError, match=r"compile=True.*backend='vmap'"):
        vmapens.make_step(looped, mse, vmapens.StackedAdam(looped, lr=1e-2), compile=True)


def steps_taken(m: nn.Module, x: Tensor) -> list[float]:
    """The step sizes the adaptive solver accepts on `x`, read by running `m` alone."""
    sizes: list[float] = []
    m.accepted = sizes.append  # type: ignore[method-assign]
    with torch.no_grad():
        m(x)
    del m.accepted
    return sizes


def test_the_adaptive_solver_with_backend_loop_gives_each_member_its_own_steps() -> None:
    ens, alone = pair(Adaptive, backend="loop")
    step = vmapens.make_step(ens, mse, vmapens.StackedAdam(ens, lr=1e-2))
    for _ in range(2):
        step(X, Y)
    vmapens.fit(ens, (X, Y), mse, steps=2, lr=1e-2, progress=False, seed=0)
    train_alone(alone, (X,), Y, steps=2)
    train_alone(alone, (X,), Y, steps=2)
    assert_members_equal(ens, alone)
    sizes = [steps_taken(m, X) for m in alone]
    assert len({tuple(s) for s in sizes}) > 1  # the members' step sizes differ
    assert [steps_taken(ens[i], X) for i in range(N)] == sizes
    want = torch.stack([m(X) for m in alone]).detach()
    torch.testing.assert_close(vmapens.predict(ens, X, reduce="none"), want, **TOL64)


def test_a_warm_start_in_a_float_is_refused_and_in_a_buffer_trains_as_alone() -> None:
    # docs/semantics.md: with backend='loop' a plain value a forward reads back would be the
    # last member's at the next call: the first step refuses it, naming it.
    ens, _ = pair(WarmFloat, backend="loop")
    before = copy.deepcopy(ens.state_dict())
    step = vmapens.make_step(ens, mse, vmapens.StackedAdam(ens, lr=1e-2))
    with pytest.raises(RuntimeError, match=r"`h0`.*register_buffer"):
        step(X, Y)
    assert unchanged(ens, before)
    ens, alone = pair(WarmBuffer, backend="loop")
    step = vmapens.make_step(ens, mse, vmapens.StackedAdam(ens, lr=1e-2))
    for _ in range(3):
        step(X, Y)
    train_alone(alone, (X,), Y, steps=3)
    assert_members_equal(ens, alone)  # the buffer h0 included: each member its own
    assert len(set(ens.state_dict()["h0"].tolist())) == N
    opt = vmapens.StackedAdam(ens, lr=1e-2)
    for _ in range(2):  # a hand loop: ens(x) reads each member's own row too
        loss = vmapens.per_member(mse)(ens(X), Y)
        opt.zero_grad()
        loss.sum().backward()
        opt.step()
    train_alone(alone, (X,), Y, steps=2)
    assert_members_equal(ens, alone)


def test_the_vectorised_adaptive_solver_under_vmap_keeps_each_members_step_sizes() -> None:
    ens, alone = pair(Vectorised)

    def loss_fn(out, y):
        return mse(out[0], y)

    step = vmapens.make_step(ens, loss_fn, vmapens.StackedAdam(ens, lr=1e-2))
    for _ in range(3):
        step(X, Y)
    train_alone(alone, (X,), Y, steps=3, loss_fn=loss_fn)
    assert_members_equal(ens, alone)
    y1, accepted = ens(X)
    want = [m(X) for m in alone]
    torch.testing.assert_close(y1, torch.stack([w[0] for w in want]), **TOL64)
    assert accepted.tolist() == [w[1].item() for w in want]
    assert len(set(accepted.tolist())) > 1  # not one step count for all members


# -- (d) a Hamiltonian NN -------------------------------------------------------------------


def test_hnn_with_autograd_grad_is_refused_under_vmap_and_exact_with_backend_loop() -> None:
    ens, _ = pair(HNN)
    before = copy.deepcopy(ens.state_dict())
    step = vmapens.make_step(ens, mse, vmapens.StackedAdam(ens, lr=1e-2))
    with pytest.raises(RuntimeError, match=r"autograd\.grad.*torch\.func\.grad.*backend='loop'"):
        step(X, Y)
    assert unchanged(ens, before)
    ens, alone = pair(HNN, backend="loop")
    vmapens.fit(ens, (X, Y), mse, steps=3, lr=1e-2, progress=False, seed=0)
    train_alone(alone, (X,), Y, steps=3)
    assert_members_equal(ens, alone)
    got = vmapens.predict(ens, X, reduce="variance")  # no_grad outside, enable_grad inside
    want = torch.stack([m(X) for m in alone]).detach().var(0, unbiased=False)
    torch.testing.assert_close(got, want, **TOL64)


@pytest.mark.parametrize("kw", [{}, {"chunk_size": 2}], ids=["vmap", "chunks"])
def test_hnn_with_torch_func_grad_trains_each_member_alone_under_vmap(kw) -> None:
    ens, alone = pair(HNNFunc, **kw)
    opt = vmapens.StackedAdam(ens, lr=1e-2)
    step = vmapens.make_step(ens, mse, opt)
    for _ in range(2):
        step(X, Y)
    loss = vmapens.per_member(mse)(ens(X), Y)  # and one step by hand
    opt.zero_grad()
    loss.sum().backward()
    opt.step()
    train_alone(alone, (X,), Y, steps=3)
    assert_members_equal(ens, alone)


# -- (e) a latent ODE over irregular, masked observations -----------------------------------


def test_latent_ode_with_masks_shared_and_per_member_trains_each_member_alone() -> None:
    g = torch.Generator().manual_seed(6)
    ts = torch.rand(6, generator=g, dtype=torch.float64).sort().values
    x = data(5, 6, 2, seed=7)
    mask = (torch.rand(5, 6, 2, generator=g) < 0.6).double()
    ens, alone = pair(LatentODE)
    step = vmapens.make_step(ens, masked_mse, vmapens.StackedAdam(ens, lr=1e-2))
    for _ in range(2):
        step((x, mask, ts), torch.cat([x, mask], -1))
    train_alone(alone, (x, mask, ts), torch.cat([x, mask], -1), 2, loss_fn=masked_mse)
    assert_members_equal(ens, alone)
    # each member its own observation mask and grid
    masks = (torch.rand(N, 5, 6, 2, generator=g) < 0.6).double()
    grids = torch.rand(N, 6, generator=g, dtype=torch.float64).sort(-1).values
    xs = x.expand(N, -1, -1, -1)
    ens, alone = pair(LatentODE)
    step = vmapens.make_step(ens, masked_mse, vmapens.StackedAdam(ens, lr=1e-2), in_dims=0)
    for _ in range(2):
        step((xs, masks, grids), torch.cat([xs, masks], -1))
    inputs, target = (xs, masks, grids), torch.cat([xs, masks], -1)
    train_alone(alone, inputs, target, 2, loss_fn=masked_mse, per_member=True)
    assert_members_equal(ens, alone)


# -- (f) the adjoint method by hand ---------------------------------------------------------


@pytest.mark.parametrize("kw", [{}, {"chunk_size": 2}, {"backend": "loop"}])
def test_an_adjoint_function_with_torch_func_vjp_trains_each_member_alone(kw) -> None:
    ens, alone = pair(Adjoint, **kw)
    opt = vmapens.StackedAdam(ens, lr=1e-2)
    step = vmapens.make_step(ens, mse, opt)
    step(X, Y)
    loss = vmapens.per_member(mse)(ens(X), Y)
    opt.zero_grad()
    loss.sum().backward()
    opt.step()
    train_alone(alone, (X,), Y, steps=2)
    assert_members_equal(ens, alone)


def test_an_old_style_adjoint_function_is_refused_under_vmap_naming_the_ways_out() -> None:
    ens, _ = pair(AdjointCallsModule)
    before = copy.deepcopy(ens.state_dict())
    step = vmapens.make_step(ens, mse, vmapens.StackedAdam(ens, lr=1e-2))
    with pytest.raises(RuntimeError, match=r"setup_context.*backend='loop'"):
        step(X, Y)
    assert unchanged(ens, before)


def test_an_adjoint_whose_backward_calls_the_module_is_explained_under_backend_loop() -> None:
    alone = AdjointCallsModule().double()  # runs alone
    mse(alone(X), Y).backward()
    ens, _ = pair(AdjointCallsModule, backend="loop")
    before = copy.deepcopy(ens.state_dict())
    step = vmapens.make_step(ens, mse, vmapens.StackedAdam(ens, lr=1e-2))
    with pytest.raises(RuntimeError, match=r"^step: .*backward.*functional_call") as err:
        step(X, Y)
    assert "check=False" not in str(err.value)
    assert unchanged(ens, before)


def test_fit_refusing_a_time_grid_in_tensor_data_names_the_way_out() -> None:
    x, target = data(8, 2, seed=8), data(8, 6, 2, seed=9)
    ens, _ = pair(Grid)
    before = copy.deepcopy(ens.state_dict())
    with pytest.raises(ValueError, match=r"got 6 and 8.*list of batches"):
        vmapens.fit(ens, ((x, TS), target), mse, steps=1, progress=False, seed=0)
    assert unchanged(ens, before)
