"""Journey: a deep ensemble of physics-informed networks (PINNs) for uncertainty.

A researcher fits u'' + u = 0 (u(0) = 0, u'(0) = 1) and the 1-D heat equation u_t = k u_xx
(u(x, 0) = sin(pi x), u(0, t) = u(1, t) = 0) with 2x16 tanh MLPs. The loss needs derivatives
of the network in its input: written with `torch.autograd.grad(..., create_graph=True)` (the
plain-PyTorch way) or with `torch.func` (`jacrev`, `hessian`). Paths tried, in order: the
README's manual loop, `make_step`/`fit` with the residual in the forward (shared and
per-member collocation points), `backend="loop"`, LBFGS and an Adam fine-tune with a
schedule, `predict` at test points. Every member is checked against the same PINN trained
alone with `torch.optim` from the same init (`ens.unstack()` before training), in float64.
"""

from __future__ import annotations

import copy
import gc
import math

import pytest
import torch
from torch import nn
from torch.func import hessian, jacrev, vmap

import vmapens
from tests.truth import TOL64, assert_members_equal

# torch's own: the first forward-mode derivative of the process (`hessian` is jacfwd over
# jacrev) imports torch._decomp.decompositions_for_jvp, which calls torch.jit.script.
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning"
)

N, K = 3, 0.1  # members; the heat equation's diffusivity
mse = nn.MSELoss()


def mlp(inputs: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(inputs, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)
    )


class Oscillator(nn.Module):
    """u(t); `forward` returns u, the residual is written by the user around it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(1)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.net(t)


class OscillatorResidual(Oscillator):
    """The residual of u'' + u = 0 and the two initial conditions, with autograd.grad in the
    forward (the plain-PyTorch way): columns [u'' + u, u(0), u'(0) - 1] at each t."""

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            t = t.clone().requires_grad_()
            u = self.net(t)
            (du,) = torch.autograd.grad(u.sum(), t, create_graph=True)
            (d2u,) = torch.autograd.grad(du.sum(), t, create_graph=True)
            t0 = torch.zeros(1, 1, dtype=t.dtype, requires_grad=True)
            u0 = self.net(t0)
            (du0,) = torch.autograd.grad(u0.sum(), t0, create_graph=True)
        return torch.cat([d2u + u, u0.expand_as(u), (du0 - 1).expand_as(u)], 1)


class OscillatorFunc(Oscillator):
    """The same residual columns with torch.func: `hessian` (jacfwd over jacrev), `jacrev`."""

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        def u_of(ti: torch.Tensor) -> torch.Tensor:  # one time [1] -> a scalar
            return self.net(ti.view(1, 1)).squeeze()

        d2u = vmap(hessian(u_of))(t).reshape(-1, 1)
        t0 = torch.zeros(1, dtype=t.dtype)
        u, u0, du0 = self.net(t), u_of(t0).view(1, 1), jacrev(u_of)(t0).view(1, 1)
        return torch.cat([d2u + u, u0.expand_as(u), (du0 - 1).expand_as(u)], 1)


class Heat(nn.Module):
    """u(x, t). With `physics` (the default) `forward` returns per collocation point the
    residual u_t - k u_xx, the initial-condition error and the two boundary values, through
    torch.func; with `physics = False` it returns u itself (for `predict`)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(2)
        self.physics = True

    def forward(self, xt: torch.Tensor) -> torch.Tensor:
        if not self.physics:
            return self.net(xt)

        def u_of(p: torch.Tensor) -> torch.Tensor:  # one point [2] -> a scalar
            return self.net(p).squeeze(-1)

        grad_u, hess_u = vmap(jacrev(u_of))(xt), vmap(hessian(u_of))(xt)
        residual = grad_u[:, 1:] - K * hess_u[:, 0, :1]
        x, t = xt[:, :1], xt[:, 1:]
        zero, one = torch.zeros_like(x), torch.ones_like(x)
        initial = self.net(torch.cat([x, zero], 1)) - torch.sin(math.pi * x)
        walls = torch.cat([self.net(torch.cat([zero, t], 1)), self.net(torch.cat([one, t], 1))], 1)
        return torch.cat([residual, initial, walls], 1)  # [points, 4]


def pair(factory: type[nn.Module], **kw: object) -> tuple[vmapens.Ensemble, list[nn.Module]]:
    """The ensemble and its members as plain modules, copied before any training."""
    ens = vmapens.Ensemble(factory, n=N, seed=0, **kw).double()
    return ens, [copy.deepcopy(m) for m in ens.unstack()]


def rand(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(*shape, generator=g, dtype=torch.float64)


T = torch.linspace(0, 2 * math.pi, 12, dtype=torch.float64).reshape(-1, 1)
ROWS = torch.zeros(12, 3, dtype=torch.float64)  # the residual columns: all zero at best
XT = rand(10, 2, seed=0) * torch.tensor([1.0, 0.5], dtype=torch.float64)  # shared points
XTS = rand(N, 10, 2, seed=1) * torch.tensor([1.0, 0.5], dtype=torch.float64)  # per member
ZERO = torch.zeros(10, 4, dtype=torch.float64)


def oscillator_loss_alone(m: nn.Module, t: torch.Tensor) -> torch.Tensor:
    """The plain-PyTorch PINN loss of one member, written in the usual way."""
    t = t.clone().requires_grad_()
    u = m(t)
    (du,) = torch.autograd.grad(u.sum(), t, create_graph=True)
    (d2u,) = torch.autograd.grad(du.sum(), t, create_graph=True)
    t0 = torch.zeros(1, 1, dtype=t.dtype, requires_grad=True)
    u0 = m(t0)
    (du0,) = torch.autograd.grad(u0.sum(), t0, create_graph=True)
    return (d2u + u).pow(2).mean() + u0.pow(2).sum() + (du0 - 1).pow(2).sum()


def adam_alone(
    members: list[nn.Module], inputs: torch.Tensor, target: torch.Tensor, steps: int, lr=1e-2
) -> None:
    """Each member alone: torch.optim.Adam on mse(m(inputs), target), `inputs[i]` when the
    points are per member ([n, points, 2])."""
    for i, m in enumerate(members):
        opt = torch.optim.Adam(m.parameters(), lr=lr[i] if isinstance(lr, list) else lr)
        x = inputs[i] if inputs.dim() == 3 else inputs
        for _ in range(steps):
            opt.zero_grad()
            mse(m(x), target).backward()
            opt.step()


# -- (1) the README's manual loop, derivatives in the loop ------------------------------------


def test_readme_loop_with_autograd_grad_on_per_member_points_is_each_pinn_alone() -> None:
    # The user's loop: each member gets its own copy of the points (in_dims=0) so that
    # autograd.grad(u.sum(), ts) gives every member its own du/dt (with one shared `t`, the
    # gradient of u.sum() would be the sum over members, as for any stacked output).
    ens, alone = pair(Oscillator)
    opt = vmapens.StackedAdam(ens, lr=1e-2)
    for _ in range(3):
        ts = T.expand(N, -1, -1).clone().requires_grad_()
        u = ens(ts, in_dims=0)  # [n, 12, 1]
        (du,) = torch.autograd.grad(u.sum(), ts, create_graph=True)
        (d2u,) = torch.autograd.grad(du.sum(), ts, create_graph=True)
        t0 = torch.zeros(N, 1, 1, dtype=torch.float64, requires_grad=True)
        u0 = ens(t0, in_dims=0)
        (du0,) = torch.autograd.grad(u0.sum(), t0, create_graph=True)
        loss = (d2u + u).pow(2).mean((1, 2)) + u0.pow(2).sum((1, 2)) + (du0 - 1).pow(2).sum((1, 2))
        opt.zero_grad()
        loss.sum().backward()
        opt.step()
    for m in alone:
        plain = torch.optim.Adam(m.parameters(), lr=1e-2)
        for _ in range(3):
            plain.zero_grad()
            oscillator_loss_alone(m, T).backward()
            plain.step()
    assert_members_equal(ens, alone)


def test_readme_loop_with_torch_func_hessian_of_the_ensemble_is_each_pinn_alone() -> None:
    # torch.func over the ensemble's call: u_of(p) is [n], one value per member, so jacrev and
    # hessian give each member's own derivatives side by side ([points, n, 2(, 2)]).
    ens, alone = pair(Heat)
    ens.template.physics = False  # docs/semantics.md: an attribute set on the template
    opt = vmapens.StackedAdam(ens, lr=[1e-2, 2e-2, 5e-3])
    for _ in range(3):

        def u_of(p: torch.Tensor) -> torch.Tensor:
            return ens(p.view(1, 2)).reshape(N)

        grad_u, hess_u = vmap(jacrev(u_of))(XT), vmap(hessian(u_of))(XT)
        loss = (grad_u[..., 1] - K * hess_u[..., 0, 0]).pow(2).mean(0)  # [n]
        opt.zero_grad()
        loss.sum().backward()
        opt.step()
    for m, lr in zip(alone, [1e-2, 2e-2, 5e-3], strict=True):
        m.physics = False
        plain = torch.optim.Adam(m.parameters(), lr=lr)
        for _ in range(3):

            def one(p: torch.Tensor, m: nn.Module = m) -> torch.Tensor:
                return m(p.view(1, 2)).reshape(())

            grad_u, hess_u = vmap(jacrev(one))(XT), vmap(hessian(one))(XT)
            plain.zero_grad()
            (grad_u[:, 1] - K * hess_u[:, 0, 0]).pow(2).mean().backward()
            plain.step()
    assert_members_equal(ens, alone)


# -- (2) make_step / fit with the residual in the forward ----------------------------------


@pytest.mark.parametrize("points", ["shared", "per_member"])
def test_make_step_and_fit_with_a_torch_func_residual_train_each_pinn_alone(points: str) -> None:
    ens, alone = pair(Heat)
    in_dims = 0 if points == "per_member" else None
    x = XTS if in_dims == 0 else XT
    y = ZERO.expand(N, -1, -1) if in_dims == 0 else ZERO  # in_dims=0 maps targets too
    step = vmapens.make_step(ens, mse, vmapens.StackedAdam(ens, lr=1e-2), in_dims=in_dims)
    for _ in range(2):
        step(x, y)
    # ... then two more steps with fit on the same points (one batch: never permuted)
    vmapens.fit(ens, (x, y), mse, steps=2, lr=1e-2, in_dims=in_dims, progress=False, seed=0)
    for i, m in enumerate(alone):  # fit built a fresh StackedAdam: so does the plain loop
        xi = x[i] if in_dims == 0 else x
        for _ in range(2):
            adam_alone([m], xi, ZERO, steps=2)
    assert_members_equal(ens, alone)


def test_autograd_grad_in_the_forward_is_refused_under_vmap_and_exact_with_loop() -> None:
    # docs/semantics.md: "torch.autograd.grad inside the forward (gradient penalties,
    # physics-informed networks): refused under vmap, exact with backend='loop'".
    ens, _ = pair(OscillatorResidual)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    step = vmapens.make_step(ens, mse, vmapens.StackedAdam(ens, lr=1e-2))
    with pytest.raises(RuntimeError, match=r"autograd.grad.*torch.func.*hessian.*backend='loop'"):
        step(T, ROWS)
    assert all(torch.equal(v, before[k]) for k, v in ens.state_dict().items())
    assert all(p.grad is None for p in ens.parameters())
    with pytest.raises(RuntimeError, match=r"backend='loop'"):
        vmapens.predict(ens, T, reduce="mean")

    # The way out: per-member collocation points, every member one after another.
    ens, alone = pair(OscillatorResidual, backend="loop")
    ts = T + 0.1 * torch.arange(N, dtype=torch.float64).view(N, 1, 1)
    rows = ROWS.expand(N, -1, -1)
    vmapens.fit(ens, (ts, rows), mse, steps=3, lr=1e-2, in_dims=0, progress=False, seed=0)
    for i, m in enumerate(alone):
        plain = torch.optim.Adam(m.parameters(), lr=1e-2)
        for _ in range(3):
            plain.zero_grad()
            mse(m(ts[i]), ROWS).backward()  # the module alone runs its autograd.grad
            plain.step()
    assert_members_equal(ens, alone)
    # predict under no_grad: the forward's enable_grad makes the derivatives, as alone
    got = vmapens.predict(ens, T, reduce="variance")
    want = torch.stack([m(T) for m in alone]).detach().var(0, unbiased=False)
    torch.testing.assert_close(got, want, **TOL64)


# -- (4) LBFGS, then an Adam fine-tune with a schedule --------------------------------------


def test_lbfgs_is_refused_with_the_way_out_and_per_member_lbfgs_after_adam_is_alone() -> None:
    # docs/optim.md: LBFGS has no stacked twin and is refused with the reason.
    ens, alone = pair(Heat)
    with pytest.raises(ValueError, match="LBFGS.*one LBFGS per member"):
        vmapens.optim.stacked(torch.optim.LBFGS)
    with pytest.raises(TypeError, match="LBFGS is not elementwise"):
        vmapens.make_step(ens, mse, torch.optim.LBFGS(ens.parameters()))

    # The way out: Adam in the ensemble, then one LBFGS per member, then back together.
    vmapens.fit(ens, (XT, ZERO), mse, steps=3, lr=1e-2, progress=False, seed=0)
    adam_alone(alone, XT, ZERO, steps=3)

    def lbfgs(m: nn.Module) -> None:
        opt = torch.optim.LBFGS(m.parameters(), max_iter=3)

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = mse(m(XT), ZERO)
            loss.backward()
            return loss

        opt.step(closure)

    tuned = ens.unstack()
    for m in tuned + alone:
        lbfgs(m)
    back = vmapens.Ensemble.from_modules(tuned)
    assert_members_equal(back, alone)

    # (5) predictions with uncertainty at test points, on u itself
    back.template.physics = False
    test = rand(7, 2, seed=3)
    with torch.no_grad():
        outs = torch.stack([m.eval().net(test) for m in alone])
    torch.testing.assert_close(vmapens.predict(back, test, reduce="mean"), outs.mean(0), **TOL64)
    torch.testing.assert_close(
        vmapens.predict(back, test, reduce="variance"), outs.var(0, unbiased=False), **TOL64
    )


def test_adam_then_a_fine_tune_with_a_per_step_cosine_schedule_is_each_pinn_alone() -> None:
    ens, alone = pair(Heat)
    lrs = [1e-2, 2e-2, 5e-3]
    opt = vmapens.StackedAdam(ens, lr=lrs)
    vmapens.fit(ens, (XT, ZERO), mse, steps=2, optimizer=opt, progress=False, seed=0)
    for group in opt.param_groups:  # fine-tune: a lower rate, as on a torch optimizer
        group["lr"] = 1e-3
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=2)
    every_step = vmapens.callbacks.LRScheduler(sched, interval="step")
    vmapens.fit(ens, (XT, ZERO), mse, steps=2, optimizer=opt, callbacks=[every_step],
                progress=False, seed=0)  # fmt: skip
    for m, lr in zip(alone, lrs, strict=True):
        plain = torch.optim.Adam(m.parameters(), lr=lr)
        for k in range(4):
            if k == 2:
                for group in plain.param_groups:
                    group["lr"] = 1e-3
                plain_sched = torch.optim.lr_scheduler.CosineAnnealingLR(plain, T_max=2)
            plain.zero_grad()
            mse(m(XT), ZERO).backward()
            plain.step()
            if k >= 2:
                plain_sched.step()
    assert_members_equal(ens, alone)
    assert opt.param_groups[0]["lr"] == plain.param_groups[0]["lr"]


# -- bugs ---------------------------------------------------------------------------------


def test_compiling_a_hessian_residual_fails_as_documented(monkeypatch) -> None:
    # docs/semantics.md: "A step torch.compile cannot build ... raises vmapens.CompileFailed
    # (a RuntimeError) naming the cause, with nothing changed, where torch's internal errors
    # reached the user; compile=False runs the same step." docs/fit.md: "with
    # compile='auto' fit warns and goes on eagerly". (torch.compile of the plain member's own
    # step fails on the same hessian: compiling cannot work here; jacrev(jacrev) compiles.)
    ens, alone = pair(OscillatorFunc)
    opt = vmapens.StackedAdam(ens, lr=1e-2)
    before = copy.deepcopy(ens.state_dict())
    step = vmapens.make_step(ens, mse, opt, compile=True)
    dispatch = [str(torch._C._dispatch_tls_local_include_set()),
                str(torch._C._dispatch_tls_local_exclude_set())]  # fmt: skip
    with pytest.raises(vmapens.CompileFailed, match="compile=False") as failed:
        step(T, ROWS)
    # dynamo's failed trace left guards in its traceback's frames that, freed later, excluded
    # functorch's and autograd's dispatch keys: every later step in the process failed
    # ("Cannot access storage of BatchedTensorImpl"), in other tests too.
    del failed
    gc.collect()
    assert [str(torch._C._dispatch_tls_local_include_set()),
            str(torch._C._dispatch_tls_local_exclude_set())] == dispatch  # fmt: skip
    torch.testing.assert_close(ens.state_dict(), before, rtol=0, atol=0)
    # (the call prepared the optimizer's state, docs/optim.md: zeros, no member stepped)
    assert all(not s["step"].any() for s in opt.state_dict()["state"].values())

    # fit's automatic switch, made to pay at once: it tries to compile after 6 eager steps;
    # the same optimizer goes on: 8 Adam steps in all, as alone.
    monkeypatch.setattr(vmapens._autocompile, "COMPILE_PAYS_AFTER_S", 0.0)
    with pytest.warns(UserWarning, match="goes on eagerly"):
        vmapens.fit(ens, (T, ROWS), mse, steps=8, optimizer=opt, compile="auto", progress=False,
                    seed=0)  # fmt: skip
    adam_alone(alone, T, ROWS, steps=8)
    assert_members_equal(ens, alone)


def test_fit_with_the_lbfgs_class_names_the_way_out() -> None:
    ens, _ = pair(Heat)
    with pytest.raises(TypeError) as err:
        vmapens.fit(ens, (XT, ZERO), mse, steps=1, optimizer=torch.optim.LBFGS, progress=False)
    assert "per member" in str(err.value) and "instance" not in str(err.value), str(err.value)
