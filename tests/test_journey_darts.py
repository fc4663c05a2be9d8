"""A user journey: N differentiable architecture searches (DARTS) at once, one per seed.

The script a researcher writes from README.md, docs/optim.md (param groups from
`ens.named_parameters()`, per-member `lr`, schedulers, checkpoints), docs/semantics.md
("Randomness in the forward pass", `map_members`, building refuses members that differ) and
docs/fit.md (`vmapens.save`/`restore`, member files):

* each member a tiny supernet: two mixed edges, each an `nn.ModuleList` of candidate ops
  (identity, zero, linear, ReLU + linear, average and max pooling) weighted by
  `softmax(alpha[e])`, `alpha` an `nn.Parameter` (the architecture parameters);
* bilevel optimisation with two stacked optimizers over disjoint parameters split by name
  (weights: SGD with momentum and weight decay, per-member lr; alphas: Adam with weight decay),
  both with `CosineAnnealingLR`; the first-order variant (alternating val/train steps, by hand
  and with two `make_step`s) and the second-order one (the virtual step `w - xi * grad`
  differentiated through, written with `torch.autograd.grad(create_graph=True)` on the stacked
  weights and `ens.map_members` for the validation loss at the virtual weights);
* GDAS-style hard Gumbel-softmax sampling of ops, under the documented randomness modes;
* checkpoint/resume with both optimizers and schedulers, member files;
* discretization: each member's argmax op per edge; members then have different
  architectures, which `from_modules`/`from_factories` refuse (the message names the layer).

The truth is each member a plain module trained alone with `torch.optim.SGD`/`Adam` and the
same schedulers on the same batches, float64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call
from truth import seeded_members

import vmapens
from vmapens.optim import MemberValues

pytestmark = __import__("pytest").mark.usefixtures("float64_default")

N, C, L, B, STEPS, EDGES = 3, 2, 5, 4, 3, 2
W_LR, XI_SCALE = [0.05, 0.1, 0.025], 1.0
A_LR = [3e-3, 1e-2, 6e-3]
TOL = {"rtol": 1e-10, "atol": 1e-10}  # float64, the same maths summed in another order


class Zero(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.mul(0.0)


def candidate_ops() -> list[nn.Module]:
    return [
        nn.Identity(),
        Zero(),
        nn.Linear(L, L),
        nn.Sequential(nn.ReLU(), nn.Linear(L, L)),
        nn.AvgPool1d(3, 1, 1, count_include_pad=False),
        nn.MaxPool1d(3, 1, 1),
    ]


K = len(candidate_ops())


class MixedOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ops = nn.ModuleList(candidate_ops())

    def forward(self, x: Tensor, w: Tensor) -> Tensor:
        return sum(w[k] * op(x) for k, op in enumerate(self.ops))


class Supernet(nn.Module):
    def __init__(self, tau: float | None = None) -> None:
        super().__init__()
        self.stem = nn.Linear(L, C * L)
        self.edges = nn.ModuleList([MixedOp() for _ in range(EDGES)])
        self.alpha = nn.Parameter(0.5 * torch.randn(EDGES, K))
        self.head = nn.Linear(C * L, 1)
        self.tau = tau

    def op_weights(self) -> Tensor:
        if self.tau is None:
            return F.softmax(self.alpha, dim=-1)
        return F.gumbel_softmax(self.alpha, tau=self.tau, hard=True)

    def forward(self, x: Tensor) -> Tensor:
        h = self.stem(x).unflatten(-1, (C, L))
        w = self.op_weights()
        for e, edge in enumerate(self.edges):
            h = edge(h, w[e])
        return self.head(h.flatten(1))


def batches(step: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    xt, xv = torch.randn(N, B, L, generator=g), torch.randn(B, L, generator=g)
    return xt, xt.sum(-1, keepdim=True).tanh(), xv, xv[:, :2].sum(-1, keepdim=True).sin()


def split(named) -> tuple[list, list]:
    named = list(named)
    return (
        [(n, p) for n, p in named if n != "alpha"],
        [(n, p) for n, p in named if n == "alpha"],
    )


def plain_optimizers(m: nn.Module, i: int):
    w, a = split(m.named_parameters())
    w_opt = torch.optim.SGD([p for _, p in w], lr=W_LR[i], momentum=0.9, weight_decay=3e-4)
    a_opt = torch.optim.Adam([p for _, p in a], lr=A_LR[i], betas=(0.5, 0.999), weight_decay=1e-3)
    return (
        w_opt,
        a_opt,
        [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=STEPS) for o in (w_opt, a_opt)],
    )


def stacked_optimizers(ens: vmapens.Ensemble):
    w, a = split(ens.named_parameters())
    w_opt = vmapens.StackedSGD(w, lr=W_LR, momentum=0.9, weight_decay=3e-4)
    a_opt = vmapens.StackedAdam(a, lr=A_LR, betas=(0.5, 0.999), weight_decay=1e-3)
    return (
        w_opt,
        a_opt,
        [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=STEPS) for o in (w_opt, a_opt)],
    )


def mse(out: Tensor, y: Tensor) -> Tensor:
    return ((out - y) ** 2).mean()


def first_order_alone(m: nn.Module, i: int, steps: int = STEPS) -> None:
    w_opt, a_opt, scheds = plain_optimizers(m, i)
    for s in range(steps):
        xt, yt, xv, yv = batches(s)
        a_opt.zero_grad()
        mse(m(xv), yv).backward()
        a_opt.step()
        w_opt.zero_grad()
        mse(m(xt[i]), yt[i]).backward()
        w_opt.step()
        for sch in scheds:
            sch.step()


def per_member_mse(out: Tensor, y: Tensor) -> Tensor:
    return ((out - y) ** 2).mean(dim=(1, 2))


def test_first_order_darts_by_hand_matches_each_search_alone() -> None:
    ens = vmapens.Ensemble(Supernet, n=N, seeds=range(N))
    plain = seeded_members(Supernet, N)
    w_opt, a_opt, scheds = stacked_optimizers(ens)
    assert [g["param_names"] for g in a_opt.param_groups] == [["alpha"]]
    for s in range(STEPS):
        xt, yt, xv, yv = batches(s)
        a_opt.zero_grad()
        per_member_mse(ens(xv), yv.expand(N, -1, -1)).sum().backward()
        a_opt.step()
        w_opt.zero_grad()
        per_member_mse(ens(xt, in_dims=0), yt).sum().backward()
        w_opt.step()
        for sch in scheds:
            sch.step()
    for i, m in enumerate(plain):
        first_order_alone(m, i)
        for name, p in m.named_parameters():
            torch.testing.assert_close(ens.get_parameter(name)[i], p.detach(), **TOL, msg=name)


def test_first_order_darts_with_two_make_steps_matches_each_search_alone() -> None:
    ens = vmapens.Ensemble(Supernet, n=N, seeds=range(N))
    w_opt, a_opt, scheds = stacked_optimizers(ens)
    arch_step = vmapens.make_step(ens, nn.MSELoss(), a_opt)  # shared validation batch
    weight_step = vmapens.make_step(ens, nn.MSELoss(), w_opt, in_dims=0)  # per-member batches
    for s in range(STEPS):
        xt, yt, xv, yv = batches(s)
        arch_step(xv, yv)
        weight_step(xt, yt)
        for sch in scheds:
            sch.step()
    assert list(w_opt.param_groups[0]["lr"]) == [0.0] * N  # cosine to eta_min=0 at T_max
    for i, m in enumerate(seeded_members(Supernet, N)):
        first_order_alone(m, i)
        for name, p in m.named_parameters():
            torch.testing.assert_close(ens.get_parameter(name)[i], p.detach(), **TOL, msg=name)


def second_order_alone(m: nn.Module, i: int) -> None:
    w_opt, a_opt, scheds = plain_optimizers(m, i)
    names = [n for n, _ in m.named_parameters() if n != "alpha"]
    for s in range(STEPS):
        xt, yt, xv, yv = batches(s)
        xi = XI_SCALE * w_opt.param_groups[0]["lr"]
        ws = [m.get_parameter(n) for n in names]
        g = torch.autograd.grad(mse(m(xt[i]), yt[i]), ws, create_graph=True)
        virtual = {n: w - xi * gw for n, w, gw in zip(names, ws, g, strict=True)}
        val = mse(functional_call(m, virtual, (xv,)), yv)
        m.alpha.grad = torch.autograd.grad(val, m.alpha)[0]
        a_opt.step()
        w_opt.zero_grad()
        mse(m(xt[i]), yt[i]).backward()
        w_opt.step()
        for sch in scheds:
            sch.step()


def test_second_order_unrolled_darts_matches_each_search_alone() -> None:
    # The virtual step w' = w - xi * dL_train/dw per member (xi its own current weight lr),
    # then d L_val(w', alpha) / d alpha through it: `create_graph=True` on the stacked weights
    # and the validation loss at w' with `map_members` (w' a mapped argument).
    ens = vmapens.Ensemble(Supernet, n=N, seeds=range(N))
    w_opt, a_opt, scheds = stacked_optimizers(ens)
    names = [n for n, _ in ens.named_parameters() if n != "alpha"]
    alpha = ens.get_parameter("alpha")

    def val_loss(state: dict, virtual: dict, x: Tensor, y: Tensor) -> Tensor:
        return mse(functional_call(ens.runner, {**state, **virtual}, (x,)), y)

    for s in range(STEPS):
        xt, yt, xv, yv = batches(s)
        xi = XI_SCALE * torch.tensor(list(w_opt.param_groups[0]["lr"]))
        ws = [ens.get_parameter(n) for n in names]
        g = torch.autograd.grad(per_member_mse(ens(xt, in_dims=0), yt).sum(), ws, create_graph=True)
        virtual = {
            n: w - xi.view(-1, *[1] * (w.ndim - 1)) * gw
            for n, w, gw in zip(names, ws, g, strict=True)
        }
        val = ens.map_members(val_loss, virtual, xv, yv, in_dims=(0, None, None))
        alpha.grad = torch.autograd.grad(val.sum(), alpha)[0]
        a_opt.step()
        w_opt.zero_grad()
        per_member_mse(ens(xt, in_dims=0), yt).sum().backward()
        w_opt.step()
        for sch in scheds:
            sch.step()
    first = seeded_members(Supernet, N)
    for i, m in enumerate(seeded_members(Supernet, N)):
        second_order_alone(m, i)
        first_order_alone(first[i], i)
        # the second-order term moves the alphas: the test would see it dropped
        assert (first[i].alpha - m.alpha).abs().max() > 1e-6
        for name, p in m.named_parameters():
            torch.testing.assert_close(ens.get_parameter(name)[i], p.detach(), **TOL, msg=name)


GUMBEL = __import__("pytest").mark.filterwarnings("ignore:There is a performance drop")


@GUMBEL
def test_gdas_hard_gumbel_sampling_same_mode_draws_what_each_member_draws_alone() -> None:
    # randomness="same": each member draws from the same RNG state what it draws alone
    # (docs/semantics.md), so seeding before each forward reproduces the searches exactly.
    gdas = lambda: Supernet(tau=1.0)  # noqa: E731
    ens = vmapens.Ensemble(gdas, n=N, seeds=range(N), randomness="same")
    plain = seeded_members(gdas, N)
    w_opt, a_opt, scheds = stacked_optimizers(ens)
    alone = [plain_optimizers(m, i) for i, m in enumerate(plain)]
    for s in range(STEPS):
        xt, yt, xv, yv = batches(s)
        a_opt.zero_grad()
        torch.manual_seed(10 + s)
        per_member_mse(ens(xv), yv.expand(N, -1, -1)).sum().backward()
        a_opt.step()
        w_opt.zero_grad()
        torch.manual_seed(20 + s)
        per_member_mse(ens(xt, in_dims=0), yt).sum().backward()
        w_opt.step()
        for sch in scheds:
            sch.step()
        for i, (m, (mw, ma, msch)) in enumerate(zip(plain, alone, strict=True)):
            ma.zero_grad()
            torch.manual_seed(10 + s)
            mse(m(xv), yv).backward()
            ma.step()
            mw.zero_grad()
            torch.manual_seed(20 + s)
            mse(m(xt[i]), yt[i]).backward()
            mw.step()
            for sch in msch:
                sch.step()
    for i, m in enumerate(plain):
        for name, p in m.named_parameters():
            torch.testing.assert_close(ens.get_parameter(name)[i], p.detach(), **TOL, msg=name)


@GUMBEL
def test_gdas_different_mode_gives_members_their_own_gumbel_noise() -> None:
    # "different": member 0 draws what it draws alone, the others their own noise (in
    # distribution as alone), so the sampled ops differ between seeds of one call.
    ens = vmapens.Ensemble(lambda: Supernet(tau=1.0), n=N, seeds=range(N), randomness="different")
    torch.manual_seed(5)
    noise = ens.map_members(lambda st: -torch.empty_like(st["alpha"]).exponential_().log())
    torch.manual_seed(5)
    torch.testing.assert_close(
        noise[0], -torch.empty(EDGES, K).exponential_().log(), rtol=0, atol=0
    )
    assert not torch.equal(noise[1], noise[0]) and not torch.equal(noise[2], noise[1])


def test_checkpoint_with_two_optimizers_resumes_each_search_and_refuses_a_swap(tmp_path) -> None:
    ens = vmapens.Ensemble(Supernet, n=N, seeds=range(N))
    w_opt, a_opt, scheds = stacked_optimizers(ens)

    def step(e, wo, ao, sch, s):
        xt, yt, xv, yv = batches(s)
        ao.zero_grad()
        per_member_mse(e(xv), yv.expand(N, -1, -1)).sum().backward()
        ao.step()
        wo.zero_grad()
        per_member_mse(e(xt, in_dims=0), yt).sum().backward()
        wo.step()
        for sc in sch:
            sc.step()

    step(ens, w_opt, a_opt, scheds, 0)
    vmapens.save(ens, tmp_path / "w.pt", optimizer=w_opt)
    vmapens.save(ens, tmp_path / "a.pt", optimizer=a_opt)
    torch.save([sc.state_dict() for sc in scheds], tmp_path / "sched.pt")
    back = vmapens.load(tmp_path / "w.pt", Supernet)
    w2, a2, sch2 = stacked_optimizers(back)
    for path, wrong in (("w.pt", a2), ("a.pt", w2)):  # each file into the other optimizer
        with __import__("pytest").raises(ValueError, match="holds Stacked"):
            vmapens.restore(tmp_path / path, back, wrong)
    vmapens.restore(tmp_path / "w.pt", back, w2)
    vmapens.restore(tmp_path / "a.pt", back, a2)
    for sc, sd in zip(sch2, torch.load(tmp_path / "sched.pt"), strict=True):
        sc.load_state_dict(sd)
    assert a2.param_groups[0]["lr"] == MemberValues(a_opt.param_groups[0]["lr"])
    for s in range(1, STEPS):
        step(back, w2, a2, sch2, s)
    paths = vmapens.save_members(back, tmp_path / "members")
    for i, m in enumerate(seeded_members(Supernet, N)):
        first_order_alone(m, i)
        alone = Supernet()
        alone.load_state_dict(vmapens.load_member(paths[i]))
        for name, p in m.named_parameters():
            torch.testing.assert_close(alone.get_parameter(name), p.detach(), **TOL, msg=name)


class Derived(nn.Module):
    """The discretized network: edge e keeps op `genotype[e]` (the member's argmax)."""

    def __init__(self, genotype: list[int]) -> None:
        super().__init__()
        self.stem = nn.Linear(L, C * L)
        self.edges = nn.ModuleList([candidate_ops()[k] for k in genotype])
        self.head = nn.Linear(C * L, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.stem(x).unflatten(-1, (C, L))
        for op in self.edges:
            h = op(h)
        return self.head(h.flatten(1))


def test_discretized_members_of_different_architectures_are_refused_naming_the_edge() -> None:
    pytest = __import__("pytest")
    genotypes = [[2, 4], [2, 5], [2, 4]]  # member 1 kept max pooling where 0 kept average
    for build in (
        lambda: vmapens.Ensemble.from_modules([Derived(g) for g in genotypes]),
        lambda: vmapens.Ensemble.from_factories([lambda g=g: Derived(g) for g in genotypes]),
    ):
        with pytest.raises(ValueError, match=r"member 1 .*`edges\.1` \(MaxPool1d vs AvgPool1d\)"):
            build()
    # the way out: one ensemble per architecture (members 0 and 2 share theirs)
    same = vmapens.Ensemble.from_modules([Derived(genotypes[0]), Derived(genotypes[2])])
    assert len(same) == 2


def test_from_modules_names_the_differing_op_when_a_parametrised_op_meets_a_pooling_one() -> None:
    pytest = __import__("pytest")
    with pytest.raises(ValueError, match=r"`edges\.0` \(AvgPool1d vs Linear\)"):
        vmapens.Ensemble.from_modules([Derived([2, 4]), Derived([4, 2])])
