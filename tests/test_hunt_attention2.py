"""Attention members with a learned attention mask, trained in an ensemble against each alone.

The truth is each member a plain module in float64, trained with ``torch.optim`` on the same
batches. Under ``vmap`` a tensor reports ``requires_grad=False``, so SDPA sent a learned mask
that a view made 4-D (``nn.MultiheadAttention``'s float ``attn_mask``) to the CPU flash
kernel, which cannot differentiate it: the ensemble raised where the member alone trains
(torch runs its math path there).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, stack_module_state, vmap
from truth import TOL64, assert_members_equal

import vmapens
from vmapens._attention import batched_attention

pytestmark = pytest.mark.usefixtures("float64_default")

N, B, L, E, H = 3, 2, 4, 8, 2


class LearnedMaskMHA(nn.Module):
    """``nn.MultiheadAttention`` with a learned additive mask (a relative-position bias)."""

    def __init__(self, per_head: bool = False) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(E, H, batch_first=True)
        self.per_head = per_head
        self.bias = nn.Parameter(0.1 * torch.randn(H, L, L) if per_head else torch.zeros(L, L))

    def forward(self, x: Tensor) -> Tensor:
        mask = self.bias.repeat(x.size(0), 1, 1) if self.per_head else self.bias
        return self.mha(x, x, x, attn_mask=mask, need_weights=False)[0]


class LearnedMaskSDPA(nn.Module):
    """Projections around SDPA with a learned mask made 4-D by a view, no biases."""

    def __init__(self, kv_heads: int = H) -> None:
        super().__init__()
        self.kv_heads = kv_heads
        self.q = nn.Linear(E, E, bias=False)
        self.kv = nn.Linear(E, 2 * kv_heads * (E // H), bias=False)
        self.bias = nn.Parameter(0.1 * torch.randn(H, L, L))

    def forward(self, x: Tensor) -> Tensor:
        b, length, _ = x.shape
        q = self.q(x).view(b, length, H, E // H).transpose(1, 2)
        kv = self.kv(x).view(b, length, 2, self.kv_heads, E // H)
        k, v = kv.permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=self.bias.unsqueeze(0), scale=0.7, enable_gqa=self.kv_heads != H
        )
        return out.transpose(1, 2).reshape(b, length, E)


CASES: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "mha-2d-mask-sgd": (LearnedMaskMHA, "sgd"),
    "mha-3d-mask-sgd": (lambda: LearnedMaskMHA(per_head=True), "sgd"),
    "sdpa-4d-mask-adam": (LearnedMaskSDPA, "adam"),
    "sdpa-gqa-4d-mask-adam": (lambda: LearnedMaskSDPA(kv_heads=1), "adam"),
}


def _members(factory: Callable[[], nn.Module]) -> list[nn.Module]:
    torch.manual_seed(0)
    return [factory() for _ in range(N)]


def _optimizers(
    ens: vmapens.Ensemble, alone: list[nn.Module], kind: str
) -> tuple[torch.optim.Optimizer, list[torch.optim.Optimizer]]:
    if kind == "sgd":
        return vmapens.StackedSGD(ens, lr=0.05), [
            torch.optim.SGD(m.parameters(), lr=0.05) for m in alone
        ]
    return vmapens.StackedAdam(ens, lr=0.01), [
        torch.optim.Adam(m.parameters(), lr=0.01) for m in alone
    ]


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
@pytest.mark.parametrize("per_member", [False, True], ids=["shared-x", "per-member-x"])
def test_learned_mask_trains_as_each_member_alone(case: str, per_member: bool) -> None:
    factory, kind = CASES[case]
    members = _members(factory)
    alone = copy.deepcopy(members)
    ens = vmapens.Ensemble.from_modules(members)
    opt, plain = _optimizers(ens, alone, kind)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        xs = torch.randn(N if per_member else 1, B, L, E, generator=g).expand(N, -1, -1, -1)
        out = ens(xs, in_dims=0) if per_member else ens(xs[0])
        truth = torch.stack([m(x) for m, x in zip(alone, xs, strict=True)])
        torch.testing.assert_close(out, truth, **TOL64)
        opt.zero_grad()
        out.square().sum().backward()
        opt.step()
        for o in plain:
            o.zero_grad()
        truth.square().sum().backward()
        for o in plain:
            o.step()
    assert_members_equal(ens, alone)


def test_make_step_with_a_learned_mask_equals_each_member_alone() -> None:
    members = _members(LearnedMaskMHA)
    alone = copy.deepcopy(members)
    ens = vmapens.Ensemble.from_modules(members)
    opt, plain = _optimizers(ens, alone, "sgd")
    step = vmapens.make_step(ens, lambda out, y: (out - y).square().mean(), opt)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        x, y = torch.randn(B, L, E, generator=g), torch.randn(B, L, E, generator=g)
        step(x, y)
        for m, o in zip(alone, plain, strict=True):
            o.zero_grad()
            (m(x) - y).square().mean().backward()
            o.step()
    assert_members_equal(ens, alone)


def test_grad_inside_vmap_with_a_mask_that_needs_grad_only_outside() -> None:
    """``vmap(grad(...))`` over the projections, the learned mask held fixed: the outer
    autograd still tracks the mask, so the rule runs the math path, and the flash backward at
    the ``grad`` level gets its logsumexp from there."""
    members = _members(LearnedMaskSDPA)
    params, _ = stack_module_state(members)  # leaves that require grad, the mask too
    template = copy.deepcopy(members[0]).to("meta")
    x = torch.randn(B, L, E, generator=torch.Generator().manual_seed(3))

    def loss(trained: dict[str, Tensor], bias: Tensor) -> Tensor:
        return functional_call(template, {**trained, "bias": bias}, (x,)).square().sum()

    trained = {k: v for k, v in params.items() if k != "bias"}
    with batched_attention():
        got = vmap(grad(loss))(trained, params["bias"])
    for i, m in enumerate(members):
        m.zero_grad()
        m(x).square().sum().backward()
        for name, p in m.named_parameters():
            if name != "bias":
                torch.testing.assert_close(got[name][i], p.grad, **TOL64, msg=name)
