"""Per-member hyperparameters on float16 and bfloat16 parameters: every stacked optimizer that
has a torch twin against that twin alone, member by member, in the same dtype.

torch computes a float16/bfloat16 update with each hyperparameter as a Python float (in float32
inside the kernels) and rounds every op's result to the parameters' dtype; a per-member value
reaches the stacked rule as a column. The truth is torch's optimizer over each member alone
with that member's floats. The two may round a sum in another order, so parameters are
compared in ulps of their value or of the distance travelled, as the bf16 Adam test
(``tests/test_optim.py``) does; an update that is wrong by a few percent is off by hundreds.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import vmapens.optim as vo

N = 4
STEPS = 5
#: Measured at most 4.1 ulps (Adadelta; on AVX2 and on ATen's default kernels too); 10 leaves room.
ULPS = 10.0

LRS = [1e-3, 3e-3, 1e-2, 3e-2]
BETAS = ([0.0, 0.5, 0.9, 0.95], [0.5, 0.9, 0.99, 0.999])
DECAYS = [0.0, 1e-3, 1e-2, 0.1]

#: name -> (stacked class, torch class, fixed options, per-member values)
CASES: dict[str, tuple[type[vo.StackedOptimizer], type, dict[str, Any], dict[str, Any]]] = {
    "Adam": (
        vo.StackedAdam,
        torch.optim.Adam,
        {"amsgrad": True},
        {
            "lr": LRS,
            "betas": BETAS,
            "eps": [1e-8, 1e-6, 1e-3, 1e-1],
            "weight_decay": DECAYS,
        },
    ),
    "AdamW": (
        vo.StackedAdam,
        torch.optim.Adam,
        {"decoupled_weight_decay": True},
        {"lr": LRS, "weight_decay": DECAYS},
    ),
    "SGD": (
        vo.StackedSGD,
        torch.optim.SGD,
        {},
        {
            "lr": [0.01, 0.03, 0.1, 0.3],
            "momentum": [0.0, 0.5, 0.9, 0.99],
            "dampening": [0.0, 0.1, 0.5, 0.0],
            "weight_decay": DECAYS,
        },
    ),
    "SGD-nesterov": (
        vo.StackedSGD,
        torch.optim.SGD,
        {"nesterov": True},
        {"lr": [0.01, 0.03, 0.1, 0.3], "momentum": [0.1, 0.5, 0.9, 0.99]},
    ),
    "Adagrad": (
        vo.StackedAdagrad,
        torch.optim.Adagrad,
        {},
        {
            "lr": [0.01, 0.03, 0.1, 0.3],
            "lr_decay": [0.0, 1e-3, 1e-2, 0.1],
            "weight_decay": DECAYS,
            "eps": [1e-10, 1e-8, 1e-6, 1e-3],
        },
    ),
    "RMSprop": (
        vo.StackedRMSprop,
        torch.optim.RMSprop,
        {"centered": True},
        {
            "lr": LRS,
            "alpha": [0.5, 0.9, 0.99, 0.999],
            "momentum": [0.0, 0.5, 0.9, 0.1],
            "weight_decay": DECAYS,
        },
    ),
    "Adamax": (
        vo.StackedAdamax,
        torch.optim.Adamax,
        {},
        {
            "lr": LRS,
            "betas": BETAS,
            "weight_decay": DECAYS,
        },
    ),
    "NAdam": (
        vo.StackedNAdam,
        torch.optim.NAdam,
        {},
        {
            "lr": LRS,
            "betas": BETAS,
            "weight_decay": DECAYS,
            "momentum_decay": [4e-3, 1e-3, 1e-2, 0.1],
        },
    ),
    "RAdam": (
        vo.StackedRAdam,
        torch.optim.RAdam,
        {},
        {
            "lr": LRS,
            "betas": BETAS,
            "weight_decay": DECAYS,
        },
    ),
    "Adadelta": (
        vo.StackedAdadelta,
        torch.optim.Adadelta,
        {},
        {
            "lr": [0.01, 0.1, 0.5, 1.0],
            "rho": [1.0, 0.9, 0.5, 0.0],
            "weight_decay": [0, 1e-3, 0.1, 0.9],
        },
    ),
    "Rprop": (
        vo.StackedRprop,
        torch.optim.Rprop,
        {},
        {"lr": LRS, "etas": ([0.1, 0.5, 0.6, 0.9], [1.1, 1.2, 1.5, 2.0])},
    ),
    "ASGD": (
        vo.StackedASGD,
        torch.optim.ASGD,
        {},
        {
            "lr": [0.005, 0.01, 0.02, 0.05],
            "lambd": [0.0, 1e-4, 0.1, 1.0],
            "t0": [0.0, 2.0, 3.0, 1e6],
        },
    ),
    "Adafactor": (
        vo.StackedAdafactor,
        torch.optim.Adafactor,
        {},
        {"lr": LRS, "beta2_decay": [-0.5, -0.8, -1.0, 0.0]},
    ),
}


def _member(values: dict[str, Any], i: int) -> dict[str, Any]:
    """Member ``i``'s floats from the per-member values (pairs: a pair of lists)."""
    return {
        k: tuple(float(x[i]) for x in v) if isinstance(v, tuple) else float(v[i])
        for k, v in values.items()
    }


def _run(name: str, dtype: torch.dtype, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """Each parameter's difference to the members alone, per element, in ulps of the value
    plus the distance the member travelled alone (its per-step changes summed)."""
    cls, twin_cls, fixed, per = CASES[name]
    g = torch.Generator().manual_seed(0)
    start = [(0.1 * torch.randn(s, generator=g) + 0.05).to(dtype) for s in shapes]
    stacked = [t.clone().requires_grad_() for t in start]
    alone = [[p[i].detach().clone().requires_grad_() for p in stacked] for i in range(N)]
    opt = cls(stacked, **fixed, **per)
    twins = [twin_cls(alone[i], **fixed, **_member(per, i)) for i in range(N)]
    travelled = [torch.zeros(s) for s in shapes]
    for _ in range(STEPS):
        for p in stacked:
            p.grad = torch.randn(p.shape, generator=g).to(dtype)
        opt.step()
        before = [torch.stack([leaves[k].detach() for leaves in alone]) for k in range(len(shapes))]
        for i, twin in enumerate(twins):
            for leaf, p in zip(alone[i], stacked, strict=True):
                leaf.grad = p.grad[i].clone()
            twin.step()
        for k, old in enumerate(before):
            new = torch.stack([leaves[k].detach() for leaves in alone])
            travelled[k] += (new.float() - old.float()).abs()
    out = []
    for k, p in enumerate(stacked):
        assert p.dtype == dtype
        want = torch.stack([leaves[k].detach() for leaves in alone]).float()
        got = p.detach().float()
        err = torch.where(got == want, 0.0, (got - want).abs())  # inf where both overflowed
        out.append(err / (torch.finfo(dtype).eps * (want.abs() + travelled[k])))
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_per_member_values_on_low_precision_follow_torch_alone(name: str, dtype: torch.dtype):
    # Members of a few elements (torch's scalar loops) and of a few thousand (its vector ones).
    for shapes in ([(N, 4, 5), (N, 7)], [(N, 48, 40), (N, 1000)]):
        for k, ulps in enumerate(_run(name, dtype, shapes)):
            assert ulps.nan_to_num().max() <= ULPS, f"{shapes[k]}: {ulps.max():.1f} ulps"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("cls", "twin_cls", "name", "values"),
    [
        (vo.StackedSGD, torch.optim.SGD, "lr", [0.01, 0.03, 0.1, 0.3]),  # p.add_(g, alpha=-lr)
        (vo.StackedAdagrad, torch.optim.Adagrad, "eps", [1e-3, 1e-2, 3e-2, 0.1]),  # + eps
    ],
    ids=["SGD-lr", "Adagrad-eps"],
)
def test_a_per_member_alpha_or_added_value_rounds_as_torchs(
    cls: type, twin_cls: type, name: str, values: list[float], dtype: torch.dtype
):
    # torch's float16/bfloat16 kernels round an `alpha` (`p.add_(g, alpha=-lr)`) and an added
    # float (`std.add_(eps)`) to the tensor's dtype in their vector loops (their scalar loops,
    # and ATen's default kernels, keep an alpha in float32): members of 1024 elements, a
    # multiple of every vector width, run there alone and stacked, so each member takes
    # torch's bits alone. On the default kernels, within a rounding of the value.
    g = torch.Generator().manual_seed(0)
    start = (0.1 * torch.randn(N, 1024, generator=g)).to(dtype)
    stacked = start.clone().requires_grad_()
    alone = [start[i].clone().requires_grad_() for i in range(N)]
    opt = cls([stacked], **{name: values})
    twins = [twin_cls([alone[i]], **{name: values[i]}) for i in range(N)]
    travelled = torch.zeros(N, 1024)
    for _ in range(STEPS):
        stacked.grad = (0.1 * torch.randn(stacked.shape, generator=g)).to(dtype)
        opt.step()
        before = torch.stack([leaf.detach() for leaf in alone]).float()
        for i, twin in enumerate(twins):
            alone[i].grad = stacked.grad[i].clone()
            twin.step()
        travelled += (torch.stack([leaf.detach() for leaf in alone]).float() - before).abs()
    want = torch.stack([leaf.detach() for leaf in alone])
    if torch.backends.cpu.get_cpu_capability() != "DEFAULT":
        assert torch.equal(stacked.detach(), want)
    else:  # an ulp of the value per step at most, or of the rounded value's share of a step
        err = (stacked.detach().float() - want.float()).abs()
        scale = STEPS * want.float().abs() + travelled
        assert (err <= torch.finfo(dtype).eps * scale).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_shared_sgd_on_low_precision_moves_every_element_as_torch(
    dtype: torch.dtype, momentum: float
):
    # Shared floats: the path that took torch 2.13's CPU fused SGD kernel, which leaves about
    # 96% of a 16-bit tensor unchanged (torch.optim.SGD(fused=True) too).
    g = torch.Generator().manual_seed(0)
    stacked = (0.1 * torch.randn(N, 48, 40, generator=g) + 0.05).to(dtype).requires_grad_()
    alone = [stacked[i].detach().clone().requires_grad_() for i in range(N)]
    opt = vo.StackedSGD([stacked], lr=0.1, momentum=momentum, weight_decay=0.01)
    twins = [torch.optim.SGD([a], lr=0.1, momentum=momentum, weight_decay=0.01) for a in alone]
    start, travelled = stacked.detach().float(), torch.zeros(stacked.shape)
    for _ in range(STEPS):
        stacked.grad = torch.randn(stacked.shape, generator=g).to(dtype)
        opt.step()
        before = torch.stack([a.detach() for a in alone]).float()
        for a, twin, grad in zip(alone, twins, stacked.grad, strict=True):
            a.grad = grad.clone()
            twin.step()
        travelled += (torch.stack([a.detach() for a in alone]).float() - before).abs()
    want = torch.stack([a.detach() for a in alone]).float()
    got = stacked.detach().float()
    assert (want != start).float().mean() > 0.9  # torch alone moves them
    ulps = (got - want).abs() / (torch.finfo(dtype).eps * (want.abs() + travelled))
    assert ulps.nan_to_num().max() <= ULPS
