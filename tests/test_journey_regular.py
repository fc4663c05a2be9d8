"""A user journey: a seed / hyperparameter sweep of small members with the regularisers and
constraints papers use, written as users write them in plain PyTorch.

* An L1 + L2 penalty on the weights computed in the forward from `self.named_parameters()`
  and returned with the output (`return out, penalty`), the loss adding it, trained with
  `make_step` (plain, pruned and orthogonal members); the same penalty computed in a hand-written
  loop from the stacked tensors (`ens.named_parameters()`, per member: a sum over the non-member
  dims), one strength per member, with AdamW's per-member weight decay
  (`vmapens.optim.stacked(torch.optim.AdamW)`).
* A penalty that skips frozen parameters (`if p.requires_grad`), which reads what vmap hides
  (docs/semantics.md, "How vmapens checks itself"): the first step refuses it, and
  `backend="loop"` trains it as alone.
* Elastic weight consolidation: after task A, a diagonal Fisher per member from per-sample
  squared gradients (`ens.map_members` with `torch.func.grad` over the samples) or per-batch
  ones (`loss.sum().backward()`); anchors and Fisher kept as buffers the member registered
  (written into the stacked buffers by name) and task B trained with `fit`, or kept outside
  in dicts of stacked tensors and task B trained by hand (a CNN with BatchNorm).
* A loss hyperparameter that differs per member (focal gamma, label smoothing, loss weight):
  `vmapens.per_member(loss, in_dims=(0, None, 0))` with a `[n]` tensor; a buffer per member
  that the forward returns with its output, for `make_step`; inputs expanded to one slice
  per member with the per-member values in the targets (`in_dims=0`); a plain float
  attribute that differs per member is refused at build.
* Constraints after each optimizer step: non-negativity (`clamp_` on the stacked tensor),
  max-norm per unit (`renorm` on the stacked tensor viewed as rows, and `ens.apply`).
* Keras-style constraints the layer applies to its own weight in its forward: in place under
  `torch.no_grad()` (eager step, hand-written loop, members in turns: `backend="loop"` and
  `chunk_size`, which crashed until session 30), and braindecode's `self.weight.data =
  torch.renorm(...)` (refused under vmap, naming the ways out; with `backend="loop"` as alone:
  until session 30 refused by the step's check and silently off in a hand-written loop).

The truth: every member copied out before training (`ens.unstack()`, or built by its factory
from its documented seed) and trained alone with `torch.optim` on the same batches, the same
penalty written on the plain module, float64.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from models import CNN
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from torch.nn.utils import parametrizations, prune
from truth import TOL64, assert_members_equal, factory_members

import vmapens

pytestmark = pytest.mark.usefixtures("float64_default")

N, IN, HID, C = 5, 4, 6, 3
LRS = [0.05, 0.1, 0.02, 0.08, 0.03]
L1, L2 = 1e-3, 1e-2


def batches(count: int, rows: int = 8, seed: int = 0, shape: tuple = (IN,)) -> list:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(rows, *shape, generator=g), torch.randint(C, (rows,), generator=g))
        for _ in range(count)
    ]


# -- (1) an L1 + L2 penalty computed in the forward ----------------------------------------


class Penalised(nn.Module):
    """Returns `(logits, penalty)`: L1 + L2 on every weight the module holds."""

    def __init__(self, kind: str = "plain") -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(IN, HID), nn.Linear(HID, C)
        if kind == "pruned":  # each member its own magnitude mask
            prune.l1_unstructured(self.fc1, "weight", amount=0.4)
        if kind == "orthogonal":
            parametrizations.orthogonal(self.fc1)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        out = self.fc2(torch.tanh(self.fc1(x)))
        penalty = sum(
            L1 * p.abs().sum() + L2 * p.pow(2).sum()
            for name, p in self.named_parameters()
            if "weight" in name  # weight, weight_orig, parametrizations.weight.original
        )
        return out, penalty


def penalised_ce(out: tuple[Tensor, Tensor], y: Tensor) -> Tensor:
    return F.cross_entropy(out[0], y) + out[1]


def train_alone(
    models: list[nn.Module],
    data: list,
    loss_fn: Callable,
    make_opt: Callable[[int, nn.Module], torch.optim.Optimizer],
    after: Callable[[nn.Module], None] | None = None,
) -> None:
    for i, m in enumerate(models):
        opt = make_opt(i, m)
        for x, y in data:
            opt.zero_grad()
            loss_fn(m(x), y).backward()
            opt.step()
            if after is not None:
                after(m)


@pytest.mark.parametrize("kind", ["plain", "pruned", "orthogonal"])
def test_penalty_returned_by_the_forward_trains_as_alone(kind: str) -> None:
    factory = functools.partial(Penalised, kind)
    ens = vmapens.Ensemble(factory, N, seed=0)
    alone = ens.unstack()
    data = batches(3)
    step = vmapens.make_step(
        ens, penalised_ce, vmapens.StackedSGD(ens, lr=LRS, momentum=0.9, nesterov=True)
    )
    losses = [step(x, y) for x, y in data]
    train_alone(
        alone,
        data,
        penalised_ce,
        lambda i, m: torch.optim.SGD(m.parameters(), lr=LRS[i], momentum=0.9, nesterov=True),
    )
    assert_members_equal(ens, alone)
    x, y = data[0]
    out, penalty = ens(x)  # the penalty comes back with one value per member
    assert penalty.shape == (N,)
    for i, m in enumerate(alone):
        torch.testing.assert_close(penalty[i], m(x)[1], **TOL64)
    assert losses[0].shape == (N,)


# -- (2) the penalty from the stacked tensors, in a hand-written loop ------------------------


def member_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(IN, HID), nn.Tanh(), nn.Linear(HID, C))


def test_penalty_from_the_stacked_parameters_with_adamw_per_member_weight_decay() -> None:
    ens = vmapens.Ensemble(member_mlp, N, seed=1)
    alone = ens.unstack()
    lam = torch.tensor([0.0, 1e-3, 1e-2, 3e-2, 1e-1])  # one L2 strength per member
    wd = [0.0, 1e-2, 1e-1, 0.0, 3e-1]
    opt = vmapens.optim.stacked(torch.optim.AdamW)(ens, lr=0.05, weight_decay=wd)
    data = batches(4, seed=1)
    for x, y in data:
        opt.zero_grad()
        # per member: a sum over every dim but the member dim
        l2 = sum(p.pow(2).flatten(1).sum(1) for n, p in ens.named_parameters() if "weight" in n)
        l1 = sum(p.abs().flatten(1).sum(1) for n, p in ens.named_parameters() if "weight" in n)
        loss = vmapens.per_member(F.cross_entropy)(ens(x), y) + lam * l2 + L1 * l1
        loss.sum().backward()
        opt.step()

    def plain_loss(i: int, m: nn.Module) -> Callable:
        def loss(out: Tensor, y: Tensor) -> Tensor:
            weights = [p for n, p in m.named_parameters() if "weight" in n]
            l2 = sum(p.pow(2).sum() for p in weights)
            l1 = sum(p.abs().sum() for p in weights)
            return F.cross_entropy(out, y) + lam[i] * l2 + L1 * l1

        return loss

    for i, m in enumerate(alone):
        opt_i = torch.optim.AdamW(m.parameters(), lr=0.05, weight_decay=wd[i])
        train_alone([m], data, plain_loss(i, m), lambda _, __, o=opt_i: o)
    assert_members_equal(ens, alone)


# -- (3) a penalty that skips frozen parameters ---------------------------------------------


class SkipsFrozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(IN, HID), nn.Linear(HID, C)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        out = self.fc2(torch.relu(self.fc1(x)))
        return out, sum(L2 * p.pow(2).sum() for p in self.parameters() if p.requires_grad)


def test_a_penalty_reading_requires_grad_is_refused_under_vmap_and_exact_in_a_loop() -> None:
    ens = vmapens.Ensemble(SkipsFrozen, N, seed=2)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    step = vmapens.make_step(ens, penalised_ce, vmapens.StackedAdam(ens, lr=0.05))
    x, y = batches(1, seed=2)[0]
    with pytest.raises(RuntimeError, match="backend='loop'") as err:
        step(x, y)
    assert "SkipsFrozen" in str(err.value)
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k  # nothing changed

    looped = vmapens.Ensemble(SkipsFrozen, N, seed=2, backend="loop")
    looped.template.fc1.requires_grad_(False)  # fine-tune the head: fc1 out of the penalty
    alone = looped.unstack()
    step = vmapens.make_step(looped, penalised_ce, vmapens.StackedAdam(looped, lr=LRS))
    data = batches(3, seed=2)
    for xb, yb in data:
        step(xb, yb)
    train_alone(
        alone,
        data,
        penalised_ce,
        lambda i, m: torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=LRS[i]),
    )
    assert_members_equal(looped, alone)


# -- (4) elastic weight consolidation, anchors and Fisher as buffers, task B with fit --------


class EWCNet(nn.Module):
    """An MLP that keeps its EWC state as buffers and returns the EWC penalty with its logits."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(IN, HID), nn.Linear(HID, C)
        for name, p in list(self.named_parameters()):
            key = name.replace(".", "_")
            self.register_buffer(f"fisher_{key}", torch.zeros_like(p))
            self.register_buffer(f"anchor_{key}", torch.zeros_like(p))
        self.register_buffer("ewc_lambda", torch.tensor(0.0))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        out = self.fc2(torch.relu(self.fc1(x)))
        penalty = 0.0
        for name, p in self.named_parameters():
            key = name.replace(".", "_")
            fisher, anchor = getattr(self, f"fisher_{key}"), getattr(self, f"anchor_{key}")
            penalty = penalty + (fisher * (p - anchor) ** 2).sum()
        return out, self.ewc_lambda / 2 * penalty


LAMBDAS = [0.0, 10.0, 100.0, 1000.0, 30.0]


def test_ewc_with_per_sample_fisher_in_buffers_and_task_b_with_fit() -> None:
    ens = vmapens.Ensemble(EWCNet, N, seed=3)
    alone = ens.unstack()
    task_a, task_b = batches(3, seed=30), batches(2, seed=31)

    # Task A: the penalty is 0 (Fisher and lambda are 0).
    step = vmapens.make_step(ens, penalised_ce, vmapens.StackedAdam(ens, lr=LRS))
    for x, y in task_a:
        step(x, y)
    train_alone(
        alone, task_a, penalised_ce, lambda i, m: torch.optim.Adam(m.parameters(), lr=LRS[i])
    )

    # Per-sample Fisher of task A: each member's squared per-sample gradients, averaged.
    xs = torch.cat([x for x, _ in task_a])
    ys = torch.cat([y for _, y in task_a])
    names = [n for n, _ in ens.named_parameters()]

    def member_fisher(state: dict[str, Tensor], x: Tensor, y: Tensor) -> dict[str, Tensor]:
        params = {k: v for k, v in state.items() if k in names}
        buffers = {k: v for k, v in state.items() if k not in names}

        def sample_loss(params: dict, x: Tensor, y: Tensor) -> Tensor:
            out = functional_call(ens.runner, {**params, **buffers}, (x[None],))[0]
            return F.cross_entropy(out, y[None])

        per_sample = vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, x, y)
        return {k: g.pow(2).mean(0) for k, g in per_sample.items()}

    fisher = ens.map_members(member_fisher, xs, ys)
    with torch.no_grad():
        for name in names:
            key = name.replace(".", "_")
            ens.get_buffer(f"fisher_{key}").copy_(fisher[name])
            ens.get_buffer(f"anchor_{key}").copy_(ens.get_parameter(name))
        ens.get_buffer("ewc_lambda").copy_(torch.tensor(LAMBDAS))

    for i, m in enumerate(alone):
        sums = {n: torch.zeros_like(p) for n, p in m.named_parameters()}
        for s in range(len(xs)):
            m.zero_grad()
            F.cross_entropy(m(xs[s : s + 1])[0], ys[s : s + 1]).backward()
            for n, p in m.named_parameters():
                sums[n] += p.grad**2
        with torch.no_grad():
            for n, p in m.named_parameters():
                key = n.replace(".", "_")
                getattr(m, f"fisher_{key}").copy_(sums[n] / len(xs))
                getattr(m, f"anchor_{key}").copy_(p)
            m.ewc_lambda.fill_(LAMBDAS[i])
    for i, m in enumerate(alone):
        torch.testing.assert_close(
            ens[i].fisher_fc1_weight, m.fisher_fc1_weight, **TOL64, msg=f"member {i}"
        )

    # Task B with fit: a fresh Adam per member, two epochs over the same two batches.
    history = vmapens.fit(
        ens, task_b, penalised_ce, optimizer=vmapens.StackedAdam(ens, lr=LRS), epochs=2,
        progress=False, seed=0,
    )  # fmt: skip
    train_alone(
        alone, task_b * 2, penalised_ce, lambda i, m: torch.optim.Adam(m.parameters(), lr=LRS[i])
    )
    assert_members_equal(ens, alone)  # parameters and every EWC buffer
    assert history.train_loss.shape == (2, N)


# -- (5) EWC kept outside the module, per-batch Fisher, a CNN, task B by hand ----------------


def test_ewc_with_per_batch_fisher_kept_outside_on_a_cnn() -> None:
    ens = vmapens.Ensemble(CNN, 4, seed=4)
    alone = ens.unstack()
    lam = torch.tensor([0.0, 5.0, 50.0, 500.0])
    task_a = batches(2, rows=6, seed=40, shape=(1, 6, 6))
    task_b = batches(2, rows=6, seed=41, shape=(1, 6, 6))
    sgd = {"lr": 0.05, "momentum": 0.9}

    opt = vmapens.StackedSGD(ens, **sgd)
    for x, y in task_a:
        opt.zero_grad()
        vmapens.per_member(F.cross_entropy)(ens(x), y).sum().backward()
        opt.step()
    fisher = {n: torch.zeros_like(p) for n, p in ens.named_parameters()}
    for x, y in task_a:  # the per-batch Fisher: squared batch gradients
        opt.zero_grad()
        vmapens.per_member(F.cross_entropy)(ens(x), y).sum().backward()
        for n, p in ens.named_parameters():
            fisher[n] += p.grad.detach() ** 2 / len(task_a)
    anchors = {n: p.detach().clone() for n, p in ens.named_parameters()}
    opt = vmapens.StackedSGD(ens, **sgd)
    for x, y in task_b:
        opt.zero_grad()
        ewc = sum(
            (fisher[n] * (p - anchors[n]) ** 2).flatten(1).sum(1) for n, p in ens.named_parameters()
        )
        (vmapens.per_member(F.cross_entropy)(ens(x), y) + lam / 2 * ewc).sum().backward()
        opt.step()

    for i, m in enumerate(alone):
        opt_i = torch.optim.SGD(m.parameters(), **sgd)
        for x, y in task_a:
            opt_i.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt_i.step()
        fisher_i = {n: torch.zeros_like(p) for n, p in m.named_parameters()}
        for x, y in task_a:
            opt_i.zero_grad()
            F.cross_entropy(m(x), y).backward()
            for n, p in m.named_parameters():
                fisher_i[n] += p.grad.detach() ** 2 / len(task_a)
        anchors_i = {n: p.detach().clone() for n, p in m.named_parameters()}
        opt_i = torch.optim.SGD(m.parameters(), **sgd)
        for x, y in task_b:
            opt_i.zero_grad()
            ewc = sum(
                (fisher_i[n] * (p - anchors_i[n]) ** 2).sum() for n, p in m.named_parameters()
            )
            (F.cross_entropy(m(x), y) + lam[i] / 2 * ewc).backward()
            opt_i.step()
        for n in fisher_i:
            torch.testing.assert_close(fisher[n][i], fisher_i[n], **TOL64, msg=f"{i} {n}")
    assert_members_equal(ens, alone)


# -- (6) a loss hyperparameter per member ---------------------------------------------------

GAMMAS = [0.0, 0.5, 1.0, 2.0, 5.0]
SMOOTHING = [0.0, 0.05, 0.1, 0.2, 0.3]
WEIGHTS = [1.0, 0.5, 2.0, 1.0, 0.1]


def focal(logits: Tensor, y: Tensor, gamma: Tensor | float) -> Tensor:
    logp = F.log_softmax(logits, -1).gather(-1, y[:, None])[:, 0]
    return (-((1 - logp.exp()) ** gamma) * logp).mean()


def test_per_member_focal_gamma_smoothing_and_weight_through_per_member_in_dims() -> None:
    ens = vmapens.Ensemble(member_mlp, N, seed=5)
    alone = ens.unstack()
    gamma, eps, w = (torch.tensor(v) for v in (GAMMAS, SMOOTHING, WEIGHTS))
    opt = vmapens.StackedAdam(ens, lr=0.05)
    data = batches(3, seed=5)

    def smoothed(out: Tensor, y: Tensor, eps: Tensor) -> Tensor:
        return F.cross_entropy(out, y, label_smoothing=eps)

    for x, y in data:
        out = ens(x)
        loss = vmapens.per_member(focal, in_dims=(0, None, 0))(out, y, gamma)
        loss = loss + vmapens.per_member(smoothed, in_dims=(0, None, 0))(out, y, eps)
        opt.zero_grad()
        (w * loss).sum().backward()
        opt.step()

    def plain(i: int) -> Callable:
        return lambda out, y: (
            WEIGHTS[i]
            * (focal(out, y, GAMMAS[i]) + F.cross_entropy(out, y, label_smoothing=SMOOTHING[i]))
        )

    for i, m in enumerate(alone):
        train_alone([m], data, plain(i), lambda _, m: torch.optim.Adam(m.parameters(), lr=0.05))
    assert_members_equal(ens, alone)


class FocalNet(nn.Module):
    """The member keeps its focal gamma as a buffer and returns it with its logits."""

    def __init__(self, gamma: float) -> None:
        super().__init__()
        self.net = member_mlp()
        self.register_buffer("gamma", torch.tensor(gamma))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.net(x), self.gamma


class FloatGamma(FocalNet):
    def __init__(self, gamma: float) -> None:
        super().__init__(gamma)
        self.focal_gamma = gamma  # a plain attribute: one forward serves every member


def focal_out(out: tuple[Tensor, Tensor], y: Tensor) -> Tensor:
    return focal(out[0], y, out[1])


def test_per_member_gamma_as_a_buffer_for_make_step_and_through_per_member_targets() -> None:
    factories = [functools.partial(FocalNet, g) for g in GAMMAS]
    ens = vmapens.Ensemble.from_factories(factories, seed=6)
    alone = factory_members(factories, seed=6)
    data = batches(3, seed=6)
    step = vmapens.make_step(ens, focal_out, vmapens.StackedAdam(ens, lr=LRS))
    for x, y in data:
        step(x, y)
    train_alone(alone, data, focal_out, lambda i, m: torch.optim.Adam(m.parameters(), lr=LRS[i]))
    assert_members_equal(ens, alone)

    # The same gammas as per-member targets: inputs and labels expanded to one slice each.
    plain = vmapens.Ensemble(member_mlp, N, seed=6)
    twins = plain.unstack()
    gammas = torch.tensor(GAMMAS)
    step = vmapens.make_step(
        plain, lambda out, t: focal(out, *t), vmapens.StackedAdam(plain, lr=LRS), in_dims=0
    )
    for x, y in data:
        step(x.expand(N, *x.shape), (y.expand(N, *y.shape), gammas))
    for i, m in enumerate(twins):
        train_alone(
            [m], data, lambda o, y, i=i: focal(o, y, GAMMAS[i]),
            lambda _, m, i=i: torch.optim.Adam(m.parameters(), lr=LRS[i]),
        )  # fmt: skip
    assert_members_equal(plain, twins)

    with pytest.raises(ValueError, match="focal_gamma") as err:
        vmapens.Ensemble.from_factories([functools.partial(FloatGamma, g) for g in GAMMAS])
    assert "0.5" in str(err.value) and "buffer" in str(err.value)


# -- (7) constraints after each step: non-negativity and max-norm ---------------------------

MAX_NORM = 0.6


def max_norm_(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        with torch.no_grad():
            m.weight.copy_(torch.renorm(m.weight, 2, 0, MAX_NORM))


def non_negative_(m: nn.Module) -> None:
    with torch.no_grad():
        m[2].weight.clamp_(min=0)


@pytest.mark.parametrize("how", ["stacked", "apply"])
def test_max_norm_and_non_negativity_after_each_step_as_alone(how: str) -> None:
    ens = vmapens.Ensemble(member_mlp, N, seed=7)
    alone = ens.unstack()
    data = batches(4, seed=7)
    step = vmapens.make_step(ens, nn.CrossEntropyLoss(), vmapens.StackedSGD(ens, lr=LRS))
    for x, y in data:
        step(x, y)
        with torch.no_grad():
            ens.get_parameter("2.weight").clamp_(min=0)
            if how == "stacked":  # one row per (member, unit): renorm rows of the flat view
                for name in ("0.weight", "2.weight"):
                    w = ens.get_parameter(name)
                    w.copy_(torch.renorm(w.flatten(0, 1), 2, 0, MAX_NORM).view_as(w))
        if how == "apply":
            ens.apply(max_norm_)

    def after(m: nn.Module) -> None:
        non_negative_(m)
        m.apply(max_norm_)

    train_alone(
        alone,
        data,
        F.cross_entropy,
        lambda i, m: torch.optim.SGD(m.parameters(), lr=LRS[i]),
        after=after,
    )
    assert_members_equal(ens, alone)
    assert bool((ens.get_parameter("2.weight") >= 0).all())
    norms = ens.get_parameter("0.weight").detach().norm(dim=-1)
    assert bool((norms <= MAX_NORM).all())


# -- (8) a constraint the forward applies to its own weight (Keras-style) -------------------


class ConstrainedLinear(nn.Linear):
    """A max-norm per unit and a non-negative bias applied by the layer itself before it
    computes, in place under no_grad (braindecode's `LinearWithConstraint` does it with
    `self.weight.data = torch.renorm(...)`, which vmap refuses; the refusal tells this way)."""

    def forward(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            norms = self.weight.norm(dim=1, keepdim=True)
            self.weight.mul_(torch.where(norms > MAX_NORM, MAX_NORM / (norms + 1e-7), 1.0))
            self.bias.clamp_(min=0)
        return super().forward(x)


def constrained() -> nn.Module:
    return nn.Sequential(nn.Linear(IN, HID), nn.Tanh(), ConstrainedLinear(HID, C))


@pytest.mark.parametrize("how", ["step", "manual", "loop-step", "loop-manual", "chunked-manual"])
def test_a_forward_that_constrains_its_own_weight_in_place_trains_as_alone(how: str) -> None:
    kw: dict = {"backend": "loop"} if how.startswith("loop") else {}
    kw.update({"chunk_size": 2} if how.startswith("chunked") else {})
    ens = vmapens.Ensemble(constrained, N, seed=8, **kw)
    alone = ens.unstack()
    data = batches(3, seed=8)
    opt = vmapens.StackedSGD(ens, lr=LRS, momentum=0.9)
    step = vmapens.make_step(ens, nn.CrossEntropyLoss(), opt)
    for x, y in data:
        if how.endswith("step"):
            step(x, y)
        else:
            opt.zero_grad()
            vmapens.per_member(F.cross_entropy)(ens(x), y).sum().backward()
            opt.step()
    train_alone(
        alone,
        data,
        F.cross_entropy,
        lambda i, m: torch.optim.SGD(m.parameters(), lr=LRS[i], momentum=0.9),
    )
    assert_members_equal(ens, alone)


class DataConstrainedLinear(nn.Linear):
    """braindecode's `LinearWithConstraint` (EEGNet, ShallowFBCSPNet), as written there."""

    def forward(self, x: Tensor) -> Tensor:
        self.weight.data = torch.renorm(self.weight.data, p=2, dim=0, maxnorm=MAX_NORM)
        return super().forward(x)


def data_constrained() -> nn.Module:
    return nn.Sequential(nn.Linear(IN, HID), nn.Tanh(), DataConstrainedLinear(HID, C))


def test_a_forward_that_assigns_weight_data_is_refused_under_vmap_naming_the_ways_out() -> None:
    ens = vmapens.Ensemble(data_constrained, N, seed=9)
    step = vmapens.make_step(ens, nn.CrossEntropyLoss(), vmapens.StackedSGD(ens, lr=LRS))
    x, y = batches(1, seed=9)[0]
    with pytest.raises(RuntimeError, match="reads `.data`") as err:
        step(x, y)
    assert "torch.no_grad()" in str(err.value) and "backend='loop'" in str(err.value)


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")  # no renorm rule
@pytest.mark.parametrize("how", ["step", "manual"])
def test_a_forward_that_assigns_weight_data_trains_as_alone_with_the_loop_backend(how: str) -> None:
    ens = vmapens.Ensemble(data_constrained, N, seed=9, backend="loop")
    alone = ens.unstack()
    data = batches(3, seed=9)
    opt = vmapens.StackedSGD(ens, lr=LRS, momentum=0.9)
    step = vmapens.make_step(ens, nn.CrossEntropyLoss(), opt)
    for x, y in data:
        if how == "step":
            step(x, y)
        else:
            opt.zero_grad()
            vmapens.per_member(F.cross_entropy)(ens(x), y).sum().backward()
            opt.step()
    train_alone(
        alone,
        data,
        F.cross_entropy,
        lambda i, m: torch.optim.SGD(m.parameters(), lr=LRS[i], momentum=0.9),
    )
    assert_members_equal(ens, alone)
