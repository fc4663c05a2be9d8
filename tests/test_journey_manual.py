"""A user journey: the training loop written by hand around the ensemble, no `make_step`/`fit`.

The script a researcher writes from README.md's example and docs/index.md: `out = ens(x)`
(shape `[n, batch, ...]`), the loss summed over members (`vmapens.per_member(loss_fn)(out,
y).sum()`), `loss.backward()`; gradient accumulation over 3 micro-batches of different sizes
(each loss divided by 3, some micro-batches shared by all members, some per member with
`ens(xs, in_dims=0)`), validation in the middle of an accumulation (`ens.eval()`,
`torch.no_grad()`, back to `ens.train()`), `vmapens.optim.clip_grad_norm_` per member, one
stacked optimizer step with some members frozen by `opt.step(mask=...)`, `opt.zero_grad()`,
and torch's `OneCycleLR` with one peak learning rate and one base momentum per member
(`MemberValues`, docs/optim.md). BatchNorm members see micro-batches of 5, 7 and 4 rows. Also:
the loss-reduction pitfall (a mean over members scales each member's gradient by 1/n), the
forward under `torch.autocast("cpu", dtype=torch.bfloat16)` (docs/semantics.md, "Mixed
precision"), and the documented per-member call signature.

The truth is the naive loop in plain PyTorch: N modules, each with its own `torch.optim`
optimizer and `OneCycleLR`, the same micro-batches, `torch.nn.utils.clip_grad_norm_`, a
frozen member's `opt.step()` skipped (its scheduler still steps), float64.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import vmapens
from vmapens.optim import MemberValues

N, STEPS, IN, OUT = 4, 4, 3, 2
SIZES = (5, 7, 4)  # micro-batch rows: BatchNorm's statistics come from batches of each size
PER_MEMBER = (False, True, False)  # which micro-batches are per member (`in_dims=0`)
MAX_LR = [0.05, 0.1, 0.2, 0.02]
BASE_MOMENTUM = [0.8, 0.85, 0.8, 0.7]
MAX_NORM = 0.3
TOL = {"rtol": 1e-10, "atol": 1e-10}


def member() -> nn.Module:
    # bias=False before BatchNorm: that bias's true gradient is 0 and Adam would step on its
    # round-off (docs/semantics.md), in plain PyTorch as in the ensemble.
    return nn.Sequential(
        nn.Linear(IN, 6, bias=False), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, OUT)
    )


def mask_at(step: int) -> list[bool]:
    # Member 1 is frozen from step 2 on, member 3 at step 3 only.
    return [True, step < 2, True, step != 3]


def micro_batches(g: torch.Generator) -> list[tuple[Tensor, Tensor]]:
    out = []
    for rows, own in zip(SIZES, PER_MEMBER):
        lead = (N,) if own else ()
        out.append(
            (torch.randn(*lead, rows, IN, generator=g), torch.randn(*lead, rows, OUT, generator=g))
        )
    return out


OPTIMIZERS: dict[str, tuple[Callable[..., Any], Callable[..., Any], dict[str, Any]]] = {
    "sgd": (
        vmapens.StackedSGD,
        torch.optim.SGD,
        {"lr": 0.01, "momentum": 0.9, "weight_decay": 1e-3},
    ),
    "adam": (
        vmapens.StackedAdam,
        torch.optim.Adam,
        {"lr": 0.01, "weight_decay": 1e-2, "amsgrad": True},
    ),
}


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_manual_accumulation_loop_matches_the_naive_loop(float64_default: None, kind: str) -> None:
    stacked_cls, torch_cls, kw = OPTIMIZERS[kind]
    ens = vmapens.Ensemble(member, n=N, seed=0)
    alone = ens.unstack()  # the same initialisations, as plain modules

    opt = stacked_cls(ens, **kw)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt,
        max_lr=MemberValues(MAX_LR),
        base_momentum=MemberValues(BASE_MOMENTUM),
        total_steps=STEPS,
    )
    opts = [torch_cls(m.parameters(), **kw) for m in alone]
    scheds = [
        torch.optim.lr_scheduler.OneCycleLR(o, max_lr=lr, base_momentum=bm, total_steps=STEPS)
        for o, lr, bm in zip(opts, MAX_LR, BASE_MOMENTUM)
    ]
    g = torch.Generator().manual_seed(1)
    data = [micro_batches(g) for _ in range(STEPS)]
    x_val = torch.randn(6, IN, generator=g)
    loss_fn = nn.MSELoss()

    for step in range(STEPS):
        mask = mask_at(step)
        for k, (x, y) in enumerate(data[step]):
            if PER_MEMBER[k]:
                out = ens(x, in_dims=0)
                loss = vmapens.per_member(loss_fn, in_dims=(0, 0))(out, y).sum() / len(SIZES)
            else:
                out = ens(x)
                loss = vmapens.per_member(loss_fn)(out, y).sum() / len(SIZES)
            loss.backward()
            if k == 1:  # validation between two micro-batches of one accumulation
                ens.eval()
                with torch.no_grad():
                    val = ens(x_val)
                ens.train()
        norms = vmapens.optim.clip_grad_norm_(ens, max_norm=MAX_NORM)
        opt.step(mask=torch.tensor(mask))
        opt.zero_grad()
        sched.step()

        for i, (m, o, s) in enumerate(zip(alone, opts, scheds)):
            for k, (x, y) in enumerate(data[step]):
                (
                    loss_fn(m(x[i] if PER_MEMBER[k] else x), y[i] if PER_MEMBER[k] else y)
                    / len(SIZES)
                ).backward()
                if k == 1:
                    m.eval()
                    with torch.no_grad():
                        torch.testing.assert_close(val[i], m(x_val), **TOL)
                    m.train()
            norm = torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM)
            torch.testing.assert_close(norms[i], norm, **TOL)
            if mask[i]:
                o.step()
            o.zero_grad()
            with warnings.catch_warnings():
                # torch warns once when a scheduler steps before its optimizer ever stepped;
                # every member here stepped at step 0.
                warnings.simplefilter("error")
                s.step()

    group = opt.param_groups[0]
    for i, (m, o) in enumerate(zip(alone, opts)):
        torch.testing.assert_close(ens[i].state_dict(), m.state_dict(), **TOL)
        assert group["lr"][i] == o.param_groups[0]["lr"]
        if kind == "sgd":
            assert group["momentum"][i] == o.param_groups[0]["momentum"]
        else:
            assert group["betas"][0][i] == o.param_groups[0]["betas"][0]
        mine = opt.member_state_dict(i, module=m)["state"]
        for key, state in o.state_dict()["state"].items():
            torch.testing.assert_close(mine[key], state, **TOL)
    # Every submodule back in training mode after the validations, as the plain modules.
    assert all(mod.training for mod in ens[0].modules())


def test_summed_per_member_loss_gives_each_member_its_own_gradient(float64_default: None) -> None:
    ens = vmapens.Ensemble(member, n=N, seed=0)
    alone = ens.unstack()
    x, y = torch.randn(5, IN), torch.randn(5, OUT)
    for m in alone:
        nn.functional.mse_loss(m(x), y).backward()
    plain = [{k: p.grad for k, p in m.named_parameters()} for m in alone]

    def grads(loss: Tensor) -> list[dict[str, Tensor]]:
        ens.zero_grad()
        loss.backward()
        return [{k: p.grad[i] for k, p in ens.named_parameters()} for i in range(N)]

    # The documented form (README.md, docs/index.md): each member exactly its own gradient.
    for i, got in enumerate(grads(vmapens.per_member(nn.MSELoss())(ens(x), y).sum())):
        torch.testing.assert_close(got, plain[i], **TOL)
    # `loss_fn(out, y.expand(n, ...))` with a sum reduction is that sum again.
    summed = nn.MSELoss(reduction="sum")(ens(x), y.expand(N, *y.shape)) / y.numel()
    for i, got in enumerate(grads(summed)):
        torch.testing.assert_close(got, plain[i], **TOL)
    # The pitfall the docs name: a mean over members gives each member 1/n of its gradient.
    for loss in (
        nn.MSELoss()(ens(x), y.expand(N, *y.shape)),
        vmapens.per_member(nn.MSELoss())(ens(x), y).mean(),
    ):
        for i, got in enumerate(grads(loss)):
            torch.testing.assert_close(got, {k: v / N for k, v in plain[i].items()}, **TOL)


def test_autocast_forward_backward_and_validation_match_members_alone() -> None:
    # float32 parameters under CPU bf16 autocast (docs/semantics.md, "Mixed precision": the
    # ensemble applies each member's cast policy itself). Compared loosely: the docs promise
    # forwards equal up to 1-ulp flips and gradients to float32 round-off.
    ens = vmapens.Ensemble(member, n=N, seed=0)
    alone = ens.unstack()
    opt = vmapens.StackedSGD(ens, lr=0.1, momentum=0.9)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in alone]
    g = torch.Generator().manual_seed(2)
    bf16 = {"rtol": 2**-7, "atol": 2**-7}
    f32 = {"rtol": 1e-4, "atol": 1e-5}
    for rows in SIZES:
        x, y = torch.randn(rows, IN, generator=g), torch.randn(rows, OUT, generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ens(x)
            loss = vmapens.per_member(nn.MSELoss())(out, y)
        assert out.dtype == torch.bfloat16 and loss.dtype == torch.float32
        (loss.sum() / len(SIZES)).backward()
        for i, m in enumerate(alone):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                own = m(x)
                own_loss = nn.functional.mse_loss(own, y)
            torch.testing.assert_close(out[i], own, **bf16)
            torch.testing.assert_close(loss[i], own_loss, **f32)
            (own_loss / len(SIZES)).backward()
    for i, m in enumerate(alone):  # the accumulated gradients, before clipping
        for k, p in m.named_parameters():
            torch.testing.assert_close(ens.get_parameter(k).grad[i], p.grad, **f32)
    norms = vmapens.optim.clip_grad_norm_(ens, max_norm=MAX_NORM)
    for i, m in enumerate(alone):
        torch.testing.assert_close(
            norms[i], torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM), **f32
        )
        opts[i].step()
    opt.step()
    for i, m in enumerate(alone):
        torch.testing.assert_close(ens[i].state_dict(), m.state_dict(), **f32)
    ens.eval()
    x_val = torch.randn(6, IN, generator=g)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        val = ens(x_val)
        for i, m in enumerate(alone):
            torch.testing.assert_close(val[i], m.eval()(x_val), **bf16)


def test_per_member_inputs_take_the_documented_call_signature(float64_default: None) -> None:
    ens = vmapens.Ensemble(member, n=N, seed=0)
    alone = ens.unstack()
    xs = torch.randn(N, 5, IN)
    out = ens(xs, in_dims=0)
    for i, m in enumerate(alone):  # each member's BatchNorm sees its own slice only
        torch.testing.assert_close(out[i], m(xs[i]), **TOL)
        torch.testing.assert_close(ens[i].state_dict(), m.state_dict(), **TOL)
    # One entry per positional argument, as in torch.func.vmap (docs/index.md).
    torch.testing.assert_close(
        ens(xs, in_dims=(0,)), torch.stack([m(xs[i]) for i, m in enumerate(alone)]), **TOL
    )
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    for bad in ([0], (0, None)):
        with pytest.raises(ValueError, match="`in_dims`"):
            ens(xs, in_dims=bad)
    with pytest.raises(ValueError, match="has size 5 there"):
        ens(torch.randn(N + 1, 5, IN), in_dims=0)
    with pytest.raises(
        ValueError, match="in_dims"
    ):  # keyword inputs are shared (docs/semantics.md)
        ens(x=xs, in_dims=0)
    torch.testing.assert_close(ens.state_dict(), before, rtol=0, atol=0)


@pytest.mark.parametrize("autocast", ["bf16", torch.float32], ids=["string", "float32"])
def test_check_refuses_an_autocast_it_would_run_without(autocast: Any) -> None:
    # docs/semantics.md tells a user who calls `ens(x)` by hand to run `vmapens.check` once;
    # `make_step` spells the same option `precision="bf16"`. torch.autocast only warns for a
    # dtype it cannot autocast to and runs without autocast: the check passed silently.
    ens = vmapens.Ensemble(member, n=N, seed=0)
    x, y = torch.randn(5, IN), torch.randn(5, OUT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="`autocast` must be"):
            vmapens.check(ens, x, y, nn.MSELoss(), autocast=autocast)
