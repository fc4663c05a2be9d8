"""Journey: optimizer wrappers from popular repositories over stacked optimizers.

A researcher brings the wrappers as they are published and tries them on an ensemble:
davda54/sam's `SAM(params, base_optimizer, rho=...)` (`first_step` / `second_step` over
`self.param_groups`, `self.state[p]["old_p"]`, `p.data = old_p`, two forward/backward passes
per step, `step(closure)`), with the stacked class as `base_optimizer`; timm's `Lookahead`
(slow weights in the base optimizer's `state`, its counters in the base's `param_groups`)
around a built stacked optimizer, also given to `vmapens.fit`; gradient centralization and a
per-member gradient-noise injection as a step pre-hook, and as a subclass that overrides `step`.
Per member: `lr`, SAM's `rho`, Lookahead's `alpha`, the noise scale. Checkpoints through
`vmapens.save` / `restore`, `member_state_dict(i)` handed to the same wrapper over `torch.optim`,
`select`.

The truth: each member a plain module trained alone with the same wrapper over the torch.optim
twin, on the same batches, float64. Documented (docs/semantics.md, top): code that reduces over
a parameter's dims sees dim 0 as the members, so SAM's published `_grad_norm` (one norm over all
of `param_groups`) mixes the members, and nothing can tell it from a correct one; a SAM for the
ensemble takes one norm per member (`MemberSAM` below).
"""

from __future__ import annotations

import copy
import io
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.optim import Optimizer
from truth import float64_batches, twins

import vmapens
from vmapens.optim import MemberValues

pytestmark = pytest.mark.usefixtures("float64_default")

N = 3
LR = [0.1, 0.05, 0.2]
RHO = [0.05, 0.1, 0.2]
TOL = dict(rtol=1e-10, atol=1e-12)  # float64: the same ops per element, sums in another order


# The wrappers as published ------------------------------------------------------------------


class SAM(Optimizer):
    """davda54/sam, sam.py, as published."""

    def __init__(self, params, base_optimizer, rho=0.05, adaptive=False, **kwargs):
        assert rho >= 0.0, f"Invalid rho, should be non-negative: {rho}"
        defaults = dict(rho=rho, adaptive=adaptive, **kwargs)
        super().__init__(params, defaults)
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups
        self.defaults.update(self.base_optimizer.defaults)

    @torch.no_grad()
    def first_step(self, zero_grad=False):
        grad_norm = self._grad_norm()
        for group in self.param_groups:
            scale = group["rho"] / (grad_norm + 1e-12)
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.state[p]["old_p"] = p.data.clone()
                e_w = (torch.pow(p, 2) if group["adaptive"] else 1.0) * p.grad * scale.to(p)
                p.add_(e_w)  # climb to the local maximum "w + e(w)"
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad=False):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                p.data = self.state[p]["old_p"]  # get back to "w" from "w + e(w)"
        self.base_optimizer.step()  # do the actual "sharpness-aware" update
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is not None, (
            "Sharpness Aware Minimization requires closure, but it was not provided"
        )
        closure = torch.enable_grad()(closure)  # the closure should do a full forward-backward pass
        self.first_step(zero_grad=True)
        closure()
        self.second_step()

    def _grad_norm(self):
        shared_device = self.param_groups[0]["params"][0].device
        norm = torch.norm(
            torch.stack(
                [
                    ((torch.abs(p) if group["adaptive"] else 1.0) * p.grad)
                    .norm(p=2)
                    .to(shared_device)
                    for group in self.param_groups
                    for p in group["params"]
                    if p.grad is not None
                ]
            ),
            p=2,
        )
        return norm

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self.base_optimizer.param_groups = self.param_groups


class MemberSAM(SAM):
    """The researcher's SAM for stacked tensors: one gradient norm per member (over the
    member's rows of every parameter) and `rho` one value per member (a 1-D tensor in the
    groups, which `member_state_dict` and `select` cut per member)."""

    def __init__(self, params, base_optimizer, rho=0.05, adaptive=False, **kwargs):
        assert (torch.as_tensor(rho) >= 0).all(), f"Invalid rho: {rho}"
        defaults = dict(rho=rho, adaptive=adaptive, **kwargs)
        Optimizer.__init__(self, params, defaults)
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups
        self.defaults.update(self.base_optimizer.defaults)

    @torch.no_grad()
    def first_step(self, zero_grad=False):
        grad_norm = self._grad_norm()  # [n]
        for group in self.param_groups:
            scale = torch.as_tensor(group["rho"]) / (grad_norm + 1e-12)
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.state[p]["old_p"] = p.data.clone()
                column = scale.to(p).view(-1, *[1] * (p.dim() - 1))
                p.add_((torch.pow(p, 2) if group["adaptive"] else 1.0) * p.grad * column)
        if zero_grad:
            self.zero_grad()

    def _grad_norm(self):
        rows = [
            ((torch.abs(p) if group["adaptive"] else 1.0) * p.grad).flatten(1).norm(dim=1)
            for group in self.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        return torch.stack(rows).norm(dim=0)


class Lookahead(Optimizer):
    """timm/optim/lookahead.py, as published."""

    def __init__(self, base_optimizer, alpha=0.5, k=6):
        # NOTE super().__init__() not called on purpose
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"Invalid slow update rate: {alpha}")
        if not 1 <= k:  # noqa: SIM300 (as published)
            raise ValueError(f"Invalid lookahead steps: {k}")
        defaults = dict(lookahead_alpha=alpha, lookahead_k=k, lookahead_step=0)
        self._base_optimizer = base_optimizer
        self.param_groups = base_optimizer.param_groups
        self.defaults = base_optimizer.defaults
        self.defaults.update(defaults)
        self.state = defaultdict(dict)
        for name, default in defaults.items():
            for group in self._base_optimizer.param_groups:
                group.setdefault(name, default)

    @torch.no_grad()
    def update_slow(self, group):
        for fast_p in group["params"]:
            if fast_p.grad is None:
                continue
            param_state = self._base_optimizer.state[fast_p]
            if "lookahead_slow_buff" not in param_state:
                param_state["lookahead_slow_buff"] = torch.empty_like(fast_p)
                param_state["lookahead_slow_buff"].copy_(fast_p)
            slow = param_state["lookahead_slow_buff"]
            slow.add_(fast_p - slow, alpha=group["lookahead_alpha"])
            fast_p.copy_(slow)

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._base_optimizer.step(closure)
        for group in self._base_optimizer.param_groups:
            group["lookahead_step"] += 1
            if group["lookahead_step"] % group["lookahead_k"] == 0:
                self.update_slow(group)
        return loss

    def state_dict(self):
        return self._base_optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self._base_optimizer.load_state_dict(state_dict)
        self.param_groups = self._base_optimizer.param_groups


class MemberLookahead(Lookahead):
    """timm's Lookahead with `lookahead_alpha` one value per member (a 1-D tensor in the
    groups: each member's slow weights move by its own alpha)."""

    @torch.no_grad()
    def update_slow(self, group):
        alpha = torch.as_tensor(group["lookahead_alpha"])
        for fast_p in group["params"]:
            if fast_p.grad is None:
                continue
            param_state = self._base_optimizer.state[fast_p]
            if "lookahead_slow_buff" not in param_state:
                param_state["lookahead_slow_buff"] = fast_p.detach().clone()
            slow = param_state["lookahead_slow_buff"]
            slow.add_((fast_p - slow) * alpha.to(slow).view(-1, *[1] * (slow.dim() - 1)))
            fast_p.copy_(slow)


# The setup ----------------------------------------------------------------------------------


def _factory() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def _bn_factory() -> nn.Module:
    # bias=False before BatchNorm: that bias's true gradient is 0 (docs/semantics.md).
    return nn.Sequential(nn.Linear(3, 4, bias=False), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2))


def _setup(factory=_factory, n: int = N) -> tuple[vmapens.Ensemble, list[nn.Module]]:
    ens = vmapens.Ensemble(factory, n=n, seed=0)
    return ens, twins(ens.unstack())


BATCHES = float64_batches(6, 8, 3, 2, seed=1)


def _ens_loss(ens: vmapens.Ensemble, x: Tensor, y: Tensor) -> Tensor:
    return vmapens.per_member(nn.MSELoss())(ens(x), y).sum()


def _alone_loss(m: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return nn.functional.mse_loss(m(x), y)


def _assert_members(ens: vmapens.Ensemble, alone: list[nn.Module], rows=None, **tol: Any) -> None:
    rows = range(len(alone)) if rows is None else rows
    for k, i in enumerate(rows):
        torch.testing.assert_close(
            ens[k].state_dict(), alone[i].state_dict(), **(tol or TOL), msg=f"member {k} ({i})"
        )


def _sam_steps(opt: SAM, model: Any, loss: Any, batches: list) -> None:
    """davda54's two-pass loop: first_step at w, second_step from the gradient at w + e(w)."""
    for x, y in batches:
        loss(model, x, y).backward()
        opt.first_step(zero_grad=True)
        loss(model, x, y).backward()
        opt.second_step(zero_grad=True)


def _plain_steps(opt: Optimizer, model: Any, loss: Any, batches: list) -> None:
    for x, y in batches:
        opt.zero_grad()
        loss(model, x, y).backward()
        opt.step()


# SAM ----------------------------------------------------------------------------------------

BASES = {
    "sgd": (vmapens.StackedSGD, torch.optim.SGD, {"momentum": 0.9, "weight_decay": 1e-3}),
    "adam": (vmapens.StackedAdam, torch.optim.Adam, {"betas": (0.8, 0.99)}),
}


@pytest.mark.parametrize("adaptive", [False, True], ids=["sam", "asam"])
@pytest.mark.parametrize("base", sorted(BASES))
def test_sam_with_a_norm_per_member_matches_each_member_alone(base: str, adaptive: bool) -> None:
    """The stacked class as `base_optimizer`, per-member `rho` and `lr`, driven by davda54's
    `step(closure)`; each member against the published SAM over torch.optim, driven by
    `first_step` / `second_step` (both usages of its README)."""
    stacked, torch_class, options = BASES[base]
    ens, alone = _setup()
    opt = MemberSAM(
        ens.parameters(), stacked, rho=torch.tensor(RHO), adaptive=adaptive, lr=LR, **options
    )
    assert opt.param_groups is opt.base_optimizer.param_groups
    for x, y in BATCHES[:3]:

        def closure(x: Tensor = x, y: Tensor = y) -> Tensor:
            loss = _ens_loss(ens, x, y)
            loss.backward()
            return loss

        closure()
        opt.step(closure)
        opt.zero_grad()
    for m, rho, lr in zip(alone, RHO, LR, strict=True):
        mine = SAM(m.parameters(), torch_class, rho=rho, adaptive=adaptive, lr=lr, **options)
        _sam_steps(mine, m, _alone_loss, BATCHES[:3])
    _assert_members(ens, alone)


def test_published_sam_shares_one_rho_among_all_members() -> None:
    """What docs/semantics.md warns of: `_grad_norm` as published is one norm over every
    member's gradient, so the perturbations of all members together have norm `rho` (each of
    them less), where alone each member climbs by `rho`. Nothing refuses it."""
    ens, alone = _setup()
    opt = SAM(ens.parameters(), vmapens.StackedSGD, rho=0.05, lr=0.1)
    before = [p.detach().clone() for p in ens.parameters()]
    x, y = BATCHES[0]
    _ens_loss(ens, x, y).backward()
    opt.first_step()
    moved = torch.stack(
        [(p.detach() - b).flatten(1).norm(dim=1) for p, b in zip(ens.parameters(), before)]
    ).norm(dim=0)  # [n]: each member's climb
    torch.testing.assert_close(moved.norm(), torch.tensor(0.05))  # rho shared out
    assert (moved < 0.05 * 0.95).all()  # alone, each climbs by rho (rho / (norm + 1e-12))
    m = alone[0]
    mine = SAM(m.parameters(), torch.optim.SGD, rho=0.05, lr=0.1)
    old = [p.detach().clone() for p in m.parameters()]
    _alone_loss(m, x, y).backward()
    mine.first_step()
    own = torch.stack([(p.detach() - b).norm() for p, b in zip(m.parameters(), old)]).norm()
    torch.testing.assert_close(own, torch.tensor(0.05))


def _disable_running_stats(model: nn.Module) -> None:
    """davda54/sam example/utility/bypass_bn.py."""

    def _disable(module):
        if isinstance(module, _BatchNorm):
            module.backup_momentum = module.momentum
            module.momentum = 0

    model.apply(_disable)


def _enable_running_stats(model: nn.Module) -> None:
    def _enable(module):
        if isinstance(module, _BatchNorm) and hasattr(module, "backup_momentum"):
            module.momentum = module.backup_momentum

    model.apply(_enable)


def test_sam_with_batchnorm_stats_frozen_in_the_second_pass_on_the_template() -> None:
    """davda54's example freezes BatchNorm's running statistics for the perturbed pass with
    `model.apply(...)` setting `momentum = 0`. On the ensemble `ens.apply` refuses an attribute
    change, naming the way out (`ens.template`); there it trains every member as alone,
    running statistics included."""
    ens, alone = _setup(_bn_factory)
    with pytest.raises(
        ValueError, match=r"Ensemble.apply: `fn` changed `1.momentum`.*ens.template"
    ):
        _disable_running_stats(ens)
    opt = MemberSAM(
        ens.parameters(), vmapens.StackedSGD, rho=torch.tensor(RHO), lr=LR, momentum=0.9
    )
    for x, y in BATCHES[:3]:
        _enable_running_stats(ens.template)
        _ens_loss(ens, x, y).backward()
        opt.first_step(zero_grad=True)
        _disable_running_stats(ens.template)
        _ens_loss(ens, x, y).backward()
        opt.second_step(zero_grad=True)
    for m, rho, lr in zip(alone, RHO, LR, strict=True):
        mine = SAM(m.parameters(), torch.optim.SGD, rho=rho, lr=lr, momentum=0.9)
        for x, y in BATCHES[:3]:
            _enable_running_stats(m)
            _alone_loss(m, x, y).backward()
            mine.first_step(zero_grad=True)
            _disable_running_stats(m)
            _alone_loss(m, x, y).backward()
            mine.second_step(zero_grad=True)
    _assert_members(ens, alone)


def test_sam_resumes_from_a_vmapens_checkpoint_and_hands_a_member_off(tmp_path: Path) -> None:
    """Two SAM steps, `vmapens.save` with the base optimizer, `restore` into a fresh ensemble
    and a fresh SAM (its groups linked again, as `SAM.load_state_dict` links them), two more
    steps: as the uninterrupted twins. The SAM's own state dict loads with
    `weights_only=True`. Member 1 handed off to the published SAM over torch's SGD continues
    alone with its own `rho` and `lr` on the same trajectory."""
    ens, alone = _setup()
    opt = MemberSAM(
        ens.parameters(), vmapens.StackedSGD, rho=torch.tensor(RHO), lr=LR, momentum=0.9
    )
    _sam_steps(opt, ens, _ens_loss, BATCHES[:2])
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=True)["param_groups"][0]["lr"] == MemberValues(LR)
    vmapens.save(ens, tmp_path / "ck.pt", optimizer=opt.base_optimizer)
    member = ens[1]
    handed = SAM(member.parameters(), torch.optim.SGD, rho=0.0, lr=0.0, momentum=0.9)
    handed.base_optimizer.load_state_dict(opt.base_optimizer.member_state_dict(1, module=member))
    handed.param_groups = handed.base_optimizer.param_groups
    assert (handed.param_groups[0]["rho"], handed.param_groups[0]["lr"]) == (RHO[1], LR[1])

    resumed = vmapens.Ensemble(_factory, n=N, seed=7)
    fresh = MemberSAM(resumed.parameters(), vmapens.StackedSGD, rho=0.0, lr=0.0, momentum=0.9)
    vmapens.restore(tmp_path / "ck.pt", resumed, optimizer=fresh.base_optimizer)
    fresh.param_groups = fresh.base_optimizer.param_groups
    _sam_steps(fresh, resumed, _ens_loss, BATCHES[2:4])
    _sam_steps(handed, member, _alone_loss, BATCHES[2:4])

    for m, rho, lr in zip(alone, RHO, LR, strict=True):
        mine = SAM(m.parameters(), torch.optim.SGD, rho=rho, lr=lr, momentum=0.9)
        _sam_steps(mine, m, _alone_loss, BATCHES[:4])
    _assert_members(resumed, alone)
    torch.testing.assert_close(member.state_dict(), alone[1].state_dict(), **TOL)


# Lookahead ----------------------------------------------------------------------------------

ALPHA = [0.5, 0.8, 0.3]


def test_lookahead_per_member_alpha_resume_select_and_hand_off(tmp_path: Path) -> None:
    """timm's Lookahead over a StackedAdam with per-member `lr` and `alpha`, k=2: its slow
    weights live in the stacked optimizer's state and its counter in its param groups. Three
    steps, `vmapens.save(optimizer=lookahead)`, `restore` into a fresh ensemble and wrapper,
    three more; `select([2, 0])` and member 2 handed off to timm's Lookahead over torch's Adam
    (its `alpha` a float) continue from step 3 too. Each as the member alone for 6 steps."""
    ens, alone = _setup()
    la = MemberLookahead(vmapens.StackedAdam(ens, lr=LR), k=2)
    for group in la.param_groups:
        group["lookahead_alpha"] = torch.tensor(ALPHA)
    _plain_steps(la, ens, _ens_loss, BATCHES[:3])
    vmapens.save(ens, tmp_path / "la.pt", optimizer=la)

    sub = ens.select([2, 0])
    sub_la = MemberLookahead(la._base_optimizer.select([2, 0], sub), k=2)
    assert sub_la.param_groups[0]["lookahead_alpha"].tolist() == [ALPHA[2], ALPHA[0]]
    member = ens[2]
    handed = Lookahead(torch.optim.Adam(member.parameters()), k=2)
    handed.load_state_dict(la._base_optimizer.member_state_dict(2, module=member))
    assert handed.param_groups[0]["lookahead_alpha"] == ALPHA[2]
    assert handed.param_groups[0]["lookahead_step"] == 3

    resumed = vmapens.Ensemble(_factory, n=N, seed=7)
    fresh = MemberLookahead(vmapens.StackedAdam(resumed, lr=0.0), k=2)
    vmapens.restore(tmp_path / "la.pt", resumed, optimizer=fresh)
    for wrapper, model, loss in [
        (fresh, resumed, _ens_loss),
        (sub_la, sub, _ens_loss),
        (handed, member, _alone_loss),
    ]:
        _plain_steps(wrapper, model, loss, BATCHES[3:6])

    for m, lr, alpha in zip(alone, LR, ALPHA, strict=True):
        mine = Lookahead(torch.optim.Adam(m.parameters(), lr=lr), alpha=alpha, k=2)
        _plain_steps(mine, m, _alone_loss, BATCHES)
    _assert_members(resumed, alone)
    _assert_members(sub, alone, rows=[2, 0])
    torch.testing.assert_close(member.state_dict(), alone[2].state_dict(), **TOL)


def test_fit_trains_a_lookahead_wrapper_and_refuses_what_needs_the_stacked_one() -> None:
    """`fit(optimizer=Lookahead(StackedAdam(...)))`: a built optimizer over the ensemble's
    parameters, trained as each member alone. What needs the stacked optimizer itself is
    refused naming it: `patience`, a step's `mask`, `compile=True`. SAM, whose `step` needs a
    closure, has no route through `fit` (its own assertion says so)."""
    ens, alone = _setup()
    x, y = BATCHES[0]
    la = Lookahead(vmapens.StackedAdam(ens, lr=LR), alpha=0.5, k=2)
    vmapens.fit(ens, (x, y), nn.MSELoss(), optimizer=la, epochs=5, progress=False, seed=0)
    for m, lr in zip(alone, LR, strict=True):
        mine = Lookahead(torch.optim.Adam(m.parameters(), lr=lr), alpha=0.5, k=2)
        _plain_steps(mine, m, _alone_loss, [(x, y)] * 5)
    _assert_members(ens, alone)

    with pytest.raises(
        TypeError, match=r"fit: `patience` .*StackedOptimizer's mask, got Lookahead"
    ):
        vmapens.fit(
            ens, (x, y), nn.MSELoss(), optimizer=la, val_data=(x, y), patience=2, progress=False
        )
    with pytest.raises(
        TypeError, match=r"make_step: `compile=True` needs a vmapens.StackedOptimizer"
    ):
        vmapens.make_step(ens, nn.MSELoss(), la, compile=True)
    step = vmapens.make_step(ens, nn.MSELoss(), la)
    with pytest.raises(
        TypeError, match=r"step: `mask` needs a vmapens.StackedOptimizer, got Lookahead"
    ):
        step(x, y, mask=torch.tensor([True, False, True]))
    sam = MemberSAM(ens.parameters(), vmapens.StackedSGD, rho=0.05, lr=0.1)
    before = copy.deepcopy(ens.state_dict())
    with pytest.raises(AssertionError, match="requires closure"):
        vmapens.fit(ens, (x, y), nn.MSELoss(), optimizer=sam, progress=False, seed=0)
    torch.testing.assert_close(ens.state_dict(), before, rtol=0, atol=0)


# Gradient centralization and gradient noise ---------------------------------------------------

NOISE = [0.0, 0.01, 0.05]


def _centralize_(grad: Tensor, member_dims: int) -> None:
    """Gradient centralization (Yong et al., 2020): a weight's gradient minus its mean over
    every dim but the output dim. `member_dims` is 1 on stacked tensors (dim 0 the members)."""
    if grad.dim() - member_dims > 1:
        grad.sub_(grad.mean(dim=tuple(range(member_dims + 1, grad.dim())), keepdim=True))


def _alone_pre_hook(std: float, gen: torch.Generator):
    def hook(opt, args, kwargs):
        for group in opt.param_groups:
            for p in group["params"]:
                _centralize_(p.grad, 0)
                p.grad.add_(torch.randn(p.shape, generator=gen) * std)

    return hook


def _stacked_pre_hook(std: list[float], gens: list[torch.Generator]):
    def hook(opt, args, kwargs):
        for group in opt.param_groups:
            for p in group["params"]:
                _centralize_(p.grad, 1)
                noise = torch.stack([torch.randn(p.shape[1:], generator=g) for g in gens])
                p.grad.add_(noise * torch.tensor(std).view(-1, *[1] * (p.dim() - 1)))

    return hook


def _gens(seed: int = 5) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(N)]


def test_centralized_noisy_gradients_as_a_pre_hook_match_alone() -> None:
    """A step pre-hook that centralizes each member's weight gradients and adds noise of a
    per-member scale, each member drawing from its own generator, on a StackedRMSprop
    driven by `make_step`: each member as a torch RMSprop with the same hook alone."""
    ens, alone = _setup()
    opt = vmapens.StackedRMSprop(ens, lr=LR, momentum=0.5)
    opt.register_step_pre_hook(_stacked_pre_hook(NOISE, _gens()))
    step = vmapens.make_step(ens, nn.MSELoss(), opt)
    for x, y in BATCHES[:4]:
        step(x, y)
    for m, lr, std, gen in zip(alone, LR, NOISE, _gens(), strict=True):
        mine = torch.optim.RMSprop(m.parameters(), lr=lr, momentum=0.5)
        mine.register_step_pre_hook(_alone_pre_hook(std, gen))
        _plain_steps(mine, m, _alone_loss, BATCHES[:4])
    _assert_members(ens, alone)


class CentralizedAdam(vmapens.StackedAdam):
    """Gradient centralization as a subclass of the stacked optimizer: its own `step`
    centralizes every member's weight gradients, then steps."""

    @torch.no_grad()
    def step(self, mask=None, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    _centralize_(p.grad, 1)
        return super().step(mask=mask, closure=closure)


class CentralizedTorchAdam(torch.optim.Adam):
    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    _centralize_(p.grad, 0)
        return super().step(closure)


def test_a_subclass_that_overrides_step_trains_as_alone_in_the_eager_step() -> None:
    ens, alone = _setup()
    step = vmapens.make_step(ens, nn.MSELoss(), CentralizedAdam(ens, lr=LR))
    for x, y in BATCHES[:3]:
        step(x, y)
    for m, lr in zip(alone, LR, strict=True):
        mine = CentralizedTorchAdam(m.parameters(), lr=lr)
        _plain_steps(mine, m, _alone_loss, BATCHES[:3])
    _assert_members(ens, alone)


def test_the_compiled_step_refuses_a_subclass_that_overrides_step(monkeypatch) -> None:
    ens, _ = _setup()

    def compiles(*args: Any, **kwargs: Any) -> Any:
        # Reached only when make_step accepts the optimizer: it would compile a step that
        # skips CentralizedAdam.step (not run here: a compile takes seconds).
        raise AssertionError("make_step(compile=True) went on to compile without the override")

    monkeypatch.setattr(vmapens.step, "compiled_step", compiles)
    with pytest.raises(TypeError, match=r"make_step: .*CentralizedAdam overrides `step`"):
        vmapens.make_step(ens, nn.MSELoss(), CentralizedAdam(ens, lr=LR), compile=True)
