"""Journey: a researcher ensembles hypernetworks and meta-learners (a hypernet that generates
its target net's weights and runs them with functional_call, MAML by hand over the stacked
parameters with a per-member inner lr, Meta-SGD adapting inside the forward, Reptile, a
FiLM-conditioned member with mixed per-member and shared inputs, member files), each member
checked against a plain module doing the same alone with torch.optim, in float64."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad

import vmapens
from tests.truth import TOL64, assert_members_equal, batch_plan

N, E = 3, 4  # members, task-embedding width
LR = [1e-2, 3e-2, 1e-1]  # one outer learning rate per member
mse = nn.functional.mse_loss


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def pair(factory, **kw) -> tuple[vmapens.Ensemble, list[nn.Module]]:
    ens = vmapens.Ensemble(factory, n=N, seed=0, **kw).double()
    return ens, [copy.deepcopy(m) for m in ens.unstack()]


class Hyper(nn.Module):
    """Generates all weights of a 3->4->2 target net from a task embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.target = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        self.shapes = {k: tuple(p.shape) for k, p in self.target.named_parameters()}
        self.gen = nn.Linear(E, sum(p.numel() for p in self.target.parameters()))

    def forward(self, emb: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        flat, params, at = self.gen(emb), {}, 0
        for name, shape in self.shapes.items():
            size = int(torch.tensor(shape).prod())
            params[name] = flat[at : at + size].view(shape)
            at += size
        return functional_call(self.target, params, (x,))


class HyperBN(nn.Module):
    """Generates the first layer's weight only: the target's BatchNorm and head are its own."""

    def __init__(self) -> None:
        super().__init__()
        self.target = nn.Sequential(
            nn.Linear(3, 4, bias=False), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2)
        )
        self.gen = nn.Linear(E, 12)

    def forward(self, emb: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # emb: one row per sample, all rows the task's embedding (so fit can cut it).
        w = self.gen(emb.mean(0) if emb.dim() == 2 else emb).view(4, 3)
        return functional_call(self.target, {"0.weight": w}, (x,))


def learner() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))


class MetaSGD(nn.Module):
    """Adapts its learner on the support set inside forward, with a learned inner lr."""

    def __init__(self) -> None:
        super().__init__()
        self.learner = learner()
        self.log_alpha = nn.Parameter(torch.tensor(-2.0))

    def forward(self, xs: torch.Tensor, ys: torch.Tensor, xq: torch.Tensor) -> torch.Tensor:
        fast = dict(self.learner.named_parameters())
        for _ in range(2):
            g = grad(lambda p: mse(functional_call(self.learner, p, (xs,)), ys))(fast)
            fast = {k: fast[k] - self.log_alpha.exp() * g[k] for k in fast}
        return functional_call(self.learner, fast, (xq,))


class MAMLAutograd(MetaSGD):
    """The same with torch.autograd.grad in the forward: refused under vmap."""

    def forward(self, xs: torch.Tensor, ys: torch.Tensor, xq: torch.Tensor) -> torch.Tensor:
        fast = dict(self.learner.named_parameters())
        inner = mse(functional_call(self.learner, fast, (xs,)), ys)
        g = torch.autograd.grad(inner, list(fast.values()), create_graph=True)
        fast = {k: v - self.log_alpha.exp() * gk for (k, v), gk in zip(fast.items(), g)}
        return functional_call(self.learner, fast, (xq,))


class FiLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.film, self.head = nn.Linear(3, 4), nn.Linear(2, 8), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        gamma, beta = self.film(cond).chunk(2, dim=-1)
        return self.head(torch.relu(gamma * self.body(x) + beta))


def tasks(count: int) -> list[tuple[torch.Tensor, ...]]:
    """Per-member (support x, support y, query x, query y), `count` of them."""
    return [
        (randn(N, 6, 3, seed=4 * t), randn(N, 6, 2, seed=4 * t + 1),
         randn(N, 6, 3, seed=4 * t + 2), randn(N, 6, 2, seed=4 * t + 3))
        for t in range(count)
    ]  # fmt: skip


# -- (1) hypernetworks ---------------------------------------------------------------------


def test_hypernets_generating_the_whole_target_train_with_make_step_as_alone() -> None:
    # The target's own parameters are replaced whole: no gradient, no step, as alone.
    ens, members = pair(Hyper)
    lr = torch.tensor(LR)  # float32: member i's lr is float(lr[i]), as torch.optim would take it
    step = vmapens.make_step(ens, mse, vmapens.StackedAdam(ens, lr=lr))
    emb = randn(E)
    batches = [(randn(6, 3, seed=k + 1), randn(6, 2, seed=k + 10)) for k in range(3)]
    losses = [step((emb, x), y) for x, y in batches]
    for i, m in enumerate(members):
        opt = torch.optim.Adam(m.parameters(), lr=float(lr[i]))
        for k, (x, y) in enumerate(batches):
            opt.zero_grad()
            loss = mse(m(emb, x), y)
            torch.testing.assert_close(losses[k][i], loss.detach(), **TOL64)
            loss.backward()
            opt.step()
        unused = {k for k, p in m.named_parameters() if p.grad is None}
        assert unused == {k for k in m.state_dict() if k.startswith("target.")}
    assert_members_equal(ens, members)
    assert all(p.grad is None for k, p in ens.named_parameters() if k.startswith("target."))


def test_hypernets_on_per_member_tasks_with_fit_and_per_member_weight_decay() -> None:
    # Partial functional_call (weights generated, BatchNorm and head the target's own, the
    # running stats updated in place through the nested call), AdamW-style decay per member.
    ens, members = pair(HyperBN)
    wd = [0.0, 0.1, 0.5]
    opt = vmapens.StackedAdam(ens, lr=LR, weight_decay=wd, decoupled_weight_decay=True)
    embs = randn(N, 1, E, seed=3).expand(N, 8, E).contiguous()
    x, y = randn(N, 8, 3, seed=1), randn(N, 8, 2, seed=2)
    vmapens.fit(ens, ((embs, x), y), mse, optimizer=opt, in_dims=0, epochs=2, batch_size=4,
                progress=False, seed=0)  # fmt: skip
    for i, m in enumerate(members):
        alone = torch.optim.AdamW(m.parameters(), lr=LR[i], weight_decay=wd[i])
        for rows in batch_plan(8, 4, 4, seed=0):
            alone.zero_grad()
            mse(m(embs[i, rows], x[i, rows]), y[i, rows]).backward()
            alone.step()
    assert_members_equal(ens, members)


def test_a_custom_init_of_the_generator_through_ens_apply_is_each_members() -> None:
    # docs/semantics.md: torch.nn.init on ens.parameters() sees dim 0 as the members; ens.apply
    # runs the init on each member in turn from the global RNG, as a loop over modules does.
    def hyperfan(mod: nn.Module) -> None:
        if isinstance(mod, nn.Linear) and mod.in_features == E:
            nn.init.kaiming_uniform_(mod.weight, a=0.5)
            nn.init.zeros_(mod.bias)

    ens, members = pair(Hyper)
    torch.manual_seed(7)
    ens.apply(hyperfan)
    torch.manual_seed(7)
    for m in members:
        m.apply(hyperfan)
    assert_members_equal(ens, members, rtol=0, atol=0)


# -- (2) MAML, Meta-SGD and Reptile ----------------------------------------------------------


def test_maml_by_hand_with_a_per_member_inner_lr_and_per_member_clipping() -> None:
    # autograd.grad(create_graph=True) on the stacked ens.parameters(), the inner lr a [n]
    # tensor; outer StackedSGD with momentum, each member clipped by its own norm. torch's
    # clip_grad_norm_ on ens.parameters() takes one norm over all members (docs: mixes them).
    ens, members = pair(learner)
    alpha = torch.tensor([0.05, 0.1, 0.3], dtype=torch.float64)
    names = [k for k, _ in ens.named_parameters()]
    opt = vmapens.StackedSGD(ens, lr=LR, momentum=0.9)
    loss = vmapens.per_member(mse, in_dims=(0, 0))

    def run(fast: dict, x: torch.Tensor) -> torch.Tensor:
        call = lambda s, p, x: functional_call(ens.runner, {**s, **p}, (x,))  # noqa: E731
        return ens.map_members(call, fast, x, in_dims=(0, 0))

    norms, mixed = [], []
    for xs, ys, xq, yq in tasks(3):
        opt.zero_grad()
        fast = dict(ens.named_parameters())
        for _ in range(2):
            g = torch.autograd.grad(loss(run(fast, xs), ys).sum(), list(fast.values()),
                                    create_graph=True)  # fmt: skip
            fast = {k: fast[k] - alpha.view(-1, *[1] * (fast[k].dim() - 1)) * gk
                    for k, gk in zip(names, g, strict=True)}  # fmt: skip
        loss(run(fast, xq), yq).sum().backward()
        mixed.append(
            torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ens.parameters()]))
        )
        norms.append(vmapens.optim.clip_grad_norm_(ens, 0.5))
        opt.step()

    for i, m in enumerate(members):
        alone = torch.optim.SGD(m.parameters(), lr=LR[i], momentum=0.9)
        for t, (xs, ys, xq, yq) in enumerate(tasks(3)):
            alone.zero_grad()
            fast = dict(m.named_parameters())
            for _ in range(2):
                inner = mse(functional_call(m, fast, (xs[i],)), ys[i])
                g = torch.autograd.grad(inner, list(fast.values()), create_graph=True)
                fast = {k: v - alpha[i] * gk for (k, v), gk in zip(fast.items(), g, strict=True)}
            mse(functional_call(m, fast, (xq[i],)), yq[i]).backward()
            norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            torch.testing.assert_close(norms[t][i], norm, **TOL64)
            alone.step()
    # the global norm torch would clip by is the members' norms together, not any one's
    for t in range(3):
        torch.testing.assert_close(mixed[t], norms[t].norm(), **TOL64)
        assert (mixed[t] > norms[t]).all()
    assert_members_equal(ens, members)


def test_meta_sgd_adapting_in_the_forward_with_func_grad_trains_with_make_step() -> None:
    # torch.func.grad inside the member's forward, a learned inner lr per member.
    ens, members = pair(MetaSGD)
    step = vmapens.make_step(ens, mse, vmapens.StackedAdam(ens, lr=LR), in_dims=0)
    for xs, ys, xq, yq in tasks(3):
        step((xs, ys, xq), yq)
    for i, m in enumerate(members):
        alone = torch.optim.Adam(m.parameters(), lr=LR[i])
        for xs, ys, xq, yq in tasks(3):
            alone.zero_grad()
            mse(m(xs[i], ys[i], xq[i]), yq[i]).backward()
            alone.step()
    assert_members_equal(ens, members)
    assert len(set(ens.state_dict()["log_alpha"].tolist())) == N  # each learned its own


def test_autograd_grad_in_the_forward_is_refused_under_vmap_and_exact_with_loop() -> None:
    xs, ys, xq, yq = tasks(1)[0]
    ens = vmapens.Ensemble(MAMLAutograd, n=N, seed=0).double()
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    step = vmapens.make_step(ens, mse, vmapens.StackedSGD(ens, lr=0.1), in_dims=0)
    with pytest.raises(RuntimeError, match=r"torch.autograd.grad.*backend='loop'"):
        step((xs, ys, xq), yq)
    assert all(torch.equal(v, before[k]) for k, v in ens.state_dict().items())

    ens, members = pair(MAMLAutograd, backend="loop")
    step = vmapens.make_step(ens, mse, vmapens.StackedSGD(ens, lr=LR), in_dims=0)
    step((xs, ys, xq), yq)
    for i, m in enumerate(members):
        alone = torch.optim.SGD(m.parameters(), lr=LR[i])
        mse(m(xs[i], ys[i], xq[i]), yq[i]).backward()
        alone.step()
    assert_members_equal(ens, members)


def test_reptile_with_a_per_member_outer_step_size_is_each_members() -> None:
    # Inner: a few StackedSGD steps on each member's task; outer: p += eps_i (fast - p).
    ens, members = pair(learner)
    eps = torch.tensor([0.1, 0.5, 1.0], dtype=torch.float64)
    for xs, ys, _, _ in tasks(2):
        start = {k: p.detach().clone() for k, p in ens.named_parameters()}
        step = vmapens.make_step(ens, mse, vmapens.StackedSGD(ens, lr=LR), in_dims=0)
        for _ in range(2):
            step(xs, ys)
        with torch.no_grad():
            for k, p in ens.named_parameters():
                w = eps.view(-1, *[1] * (p.dim() - 1))
                p.copy_(start[k] + w * (p - start[k]))
    for i, m in enumerate(members):
        for xs, ys, _, _ in tasks(2):
            start = {k: p.detach().clone() for k, p in m.named_parameters()}
            inner = torch.optim.SGD(m.parameters(), lr=LR[i])
            for _ in range(2):
                inner.zero_grad()
                mse(m(xs[i]), ys[i]).backward()
                inner.step()
            with torch.no_grad():
                for k, p in m.named_parameters():
                    p.copy_(start[k] + eps[i] * (p - start[k]))
    assert_members_equal(ens, members)


# -- (3) FiLM: a per-member conditioning vector, a shared input -------------------------------


def test_film_members_with_mixed_in_dims_train_as_alone() -> None:
    ens, members = pair(FiLM)
    x, cond, y = randn(5, 3), randn(N, 5, 2, seed=1), randn(N, 5, 1, seed=2)
    opt = vmapens.StackedAdam(ens, lr=LR)
    for _ in range(3):
        opt.zero_grad()
        out = ens(x, cond, in_dims=(None, 0))
        vmapens.per_member(mse, in_dims=(0, 0))(out, y).sum().backward()
        opt.step()
    for i, m in enumerate(members):
        alone = torch.optim.Adam(m.parameters(), lr=LR[i])
        for _ in range(3):
            alone.zero_grad()
            mse(m(x, cond[i]), y[i]).backward()
            alone.step()
    assert_members_equal(ens, members)
    # make_step and fit take one in_dims for all inputs: a mixed one is refused, clearly
    with pytest.raises(ValueError, match=r"make_step: `in_dims` must be None or 0"):
        vmapens.make_step(ens, mse, opt, in_dims=(None, 0))
    with pytest.raises(ValueError, match=r"fit: `in_dims` must be None, 0 or a pair"):
        vmapens.fit(ens, ((x, cond), y), mse, in_dims=((None, 0), 0), progress=False)


# -- (4) member files and ens[i] alone ------------------------------------------------------


def test_member_files_and_ens_i_go_on_alone_as_the_member_trained_alone(tmp_path) -> None:
    ens, members = pair(HyperBN)
    step = vmapens.make_step(ens, mse, vmapens.StackedAdam(ens, lr=LR), in_dims=0)
    emb = randn(N, E)
    data = [(randn(N, 6, 3, seed=k + 1), randn(N, 6, 2, seed=k + 10)) for k in range(2)]
    for x, y in data:
        step((emb, x), y)
    opts = []
    for i, m in enumerate(members):
        opts.append(torch.optim.Adam(m.parameters(), lr=LR[i]))
        for x, y in data:
            opts[i].zero_grad()
            mse(m(emb[i], x[i]), y[i]).backward()
            opts[i].step()
    assert_members_equal(ens, members)

    paths = vmapens.save_members(ens, tmp_path)
    states = vmapens.load_members(tmp_path)
    probe = randn(4, 3, seed=99)
    for i, m in enumerate(members):
        plain = HyperBN().double()
        plain.load_state_dict(torch.load(paths[i]))
        assert all(torch.equal(states[i][k], v) for k, v in plain.state_dict().items())
        mine = ens[i]
        assert type(mine) is HyperBN and mine.training
        for mod in (plain, mine, m):
            mod.eval()
        torch.testing.assert_close(plain(emb[i], probe), m(emb[i], probe), **TOL64)
        torch.testing.assert_close(mine(emb[i], probe), m(emb[i], probe), **TOL64)
        # ens[i] trained on alone with the member's optimizer state goes where the member goes
        mine.train(), m.train()
        opt = torch.optim.Adam(mine.parameters(), lr=LR[i])
        opt.load_state_dict(copy.deepcopy(opts[i].state_dict()))  # torch shares state tensors
        for x, y in data:
            for mod, o in ((mine, opt), (m, opts[i])):
                o.zero_grad()
                mse(mod(emb[i], x[i]), y[i]).backward()
                o.step()
        for k, v in m.state_dict().items():
            torch.testing.assert_close(mine.state_dict()[k], v, **TOL64, msg=k)
