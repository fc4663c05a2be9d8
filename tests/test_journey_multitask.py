"""User journey: multi-task members (a shared trunk, three heads), against plain PyTorch alone.

A researcher trains 4 float64 members of one multi-task module: a shared trunk over the tokens
of a sequence, a classification head (on the mean-pooled tokens), a regression head and a
per-token head; the forward returns a dict of outputs (once a nested dict holding a list). The
loss is a weighted sum of the per-task losses, with (a) fixed per-member task weights (a
buffer of the member, and a `[n, 3]` tensor outside the ensemble in a hand-written loop), (b)
Kendall et al.'s learned uncertainty weighting (log-variances as a parameter of the member,
trained with everything else by `make_step`), (c) PCGrad and GradNorm written by hand
(per-member per-task gradients with `torch.autograd.grad` on each task's stacked loss,
projected or normalised member by member, written into `.grad` before stacked optimizer
steps; GradNorm differentiates the gradient norms, `create_graph=True`), (d) missing labels
(masks, a member whose batch has no label for a task, `ignore_index` with a member whose every
token is ignored, and a loss with a boolean index, refused batched and run by
`backend="loop"`), (e) param groups with per-member learning rates for trunk and heads, or
two stacked optimizers, and one head frozen mid-run with `requires_grad_(False)` (on
`ens.template`, by a `fit` callback, or on the stacked parameters: docs/semantics.md, "Buffers
and train/eval": the flag set last counts, and a frozen layer gets no gradient and no step).

The truth is each member as a plain module trained alone with `torch.optim` on the same
batches, written here (tests/truth.py for the batches `fit` cuts).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from truth import batch_plan

import vmapens

pytestmark = pytest.mark.usefixtures("float64_default")

N, B, T, IN, H, C = 4, 6, 5, 3, 8, 3
TOL = dict(rtol=1e-9, atol=1e-10)  # float64: batched kernels sum in another order
W = [[1.0, 0.5, 0.2], [0.3, 1.0, 1.0], [1.0, 1.0, 0.0], [2.0, 0.1, 0.7]]  # member, task


class MultiTask(nn.Module):
    """A shared trunk over tokens; classification, regression and per-token heads."""

    def __init__(self, nested: bool = False) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(IN, H), nn.Tanh(), nn.Linear(H, H), nn.Tanh())
        self.cls = nn.Linear(H, C)
        self.reg = nn.Linear(H, 1)
        self.tok = nn.Linear(H, 2)
        self.log_vars = nn.Parameter(torch.zeros(3))  # Kendall et al.'s s_k = log sigma_k^2
        self.register_buffer("task_w", torch.ones(3))  # fixed per-member task weights
        self.nested = nested

    def forward(self, x: Tensor) -> dict[str, Any]:
        h = self.trunk(x)  # [B, T, H]
        pooled = h.mean(1)
        cls, reg, tok = self.cls(pooled), self.reg(pooled).squeeze(-1), self.tok(h)
        if self.nested:
            return {"cls": cls, "aux": {"reg": reg, "tok": [tok, h]}, "s": self.log_vars}
        return {"cls": cls, "reg": reg, "tok": tok, "s": self.log_vars, "w": self.task_w}


def batch(g: torch.Generator, lead: tuple[int, ...] = (), rows: int = B) -> tuple[Tensor, dict]:
    """Inputs and a dict of targets with masks (1: the row / token has that label)."""
    x = torch.randn(*lead, rows, T, IN, generator=g)
    y = {
        "cls": torch.randint(C, (*lead, rows), generator=g),
        "reg": torch.randn(*lead, rows, generator=g),
        "tok": torch.randint(2, (*lead, rows, T), generator=g),
        "mc": (torch.rand(*lead, rows, generator=g) < 0.7).double(),
        "mr": (torch.rand(*lead, rows, generator=g) < 0.6).double(),
        "mt": (torch.rand(*lead, rows, T, generator=g) < 0.8).double(),
    }
    return x, y


def masked_mean(v: Tensor, m: Tensor) -> Tensor:
    return (v * m).sum() / m.sum().clamp(min=1)  # no label at all: 0, not NaN


def task_losses(o: dict, y: dict) -> Tensor:
    """One member's three task losses, each on the rows (tokens) that have its label."""
    lc = masked_mean(F.cross_entropy(o["cls"], y["cls"], reduction="none"), y["mc"])
    lr = masked_mean((o["reg"] - y["reg"]) ** 2, y["mr"])
    lt = F.cross_entropy(o["tok"].transpose(1, 2), y["tok"], reduction="none")
    return torch.stack([lc, lr, masked_mean(lt, y["mt"])])


def kendall(o: dict, y: dict) -> Tensor:
    s = o["s"]
    return (torch.exp(-s) * task_losses(o, y) + s).sum()


def fixed(o: dict, y: dict) -> Tensor:
    return o["w"] @ task_losses(o, y)


def member(i: int, y: dict) -> dict:
    return {k: v[i] for k, v in y.items()}


def assert_members(ens: vmapens.Ensemble, alone: list[nn.Module], **tol: Any) -> None:
    for i, m in enumerate(alone):
        got = ens[i].state_dict()
        for k, v in m.state_dict().items():
            torch.testing.assert_close(got[k], v, **(tol or TOL), msg=f"member {i} {k}")


# (b) Kendall's uncertainty weighting with make_step ------------------------------------------


@pytest.mark.parametrize("how", ["vmap", "chunked", "per_member_data"])
def test_kendall_uncertainty_weights_train_with_make_step_as_alone(how: str) -> None:
    ens = vmapens.Ensemble(MultiTask, n=N, seed=0, chunk_size=2 if how == "chunked" else None)
    alone = ens.unstack()
    lrs = [0.05, 0.02, 0.1, 0.01]
    own = how == "per_member_data"
    step = vmapens.make_step(
        ens, kendall, vmapens.StackedAdam(ens, lr=lrs), in_dims=0 if own else None
    )
    opts = [torch.optim.Adam(m.parameters(), lr=lr) for m, lr in zip(alone, lrs, strict=True)]
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = batch(g, (N,) if own else ())
        losses = step(x, y)
        for i, (m, o) in enumerate(zip(alone, opts, strict=True)):
            xi, yi = (x[i], member(i, y)) if own else (x, y)
            o.zero_grad()
            loss = kendall(m(xi), yi)
            loss.backward()
            o.step()
            torch.testing.assert_close(losses[i], loss.detach(), **TOL)
    assert_members(ens, alone)
    # the log-variances moved, each member its own way (alone too)
    assert not torch.equal(ens.get_parameter("log_vars")[0], ens.get_parameter("log_vars")[1])


def test_a_nested_dict_and_list_output_trains_and_predicts_as_alone() -> None:
    def loss(o: dict, y: dict) -> Tensor:
        tok, h = o["aux"]["tok"]
        ls = task_losses({"cls": o["cls"], "reg": o["aux"]["reg"], "tok": tok}, y)
        return (torch.exp(-o["s"]) * ls + o["s"]).sum() + 1e-3 * h.pow(2).mean()

    ens = vmapens.Ensemble(lambda: MultiTask(nested=True), n=N, seed=0)
    alone = ens.unstack()
    step = vmapens.make_step(ens, loss, vmapens.StackedSGD(ens, lr=0.1, momentum=0.9))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in alone]
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        x, y = batch(g)
        step(x, y)
        for m, o in zip(alone, opts, strict=True):
            o.zero_grad()
            loss(m(x), y).backward()
            o.step()
    assert_members(ens, alone)

    x = torch.randn(7, T, IN, generator=g)
    with pytest.raises(ValueError, match="predict: the batches' outputs are joined along the sa"):
        vmapens.predict(ens, x, batch_size=3)  # `s` has no samples dim: refused, not joined
    got = vmapens.predict(ens, x)  # one batch: every output as the member gives it
    with torch.no_grad():
        want = [m.eval()(x) for m in alone]
    torch.testing.assert_close(got["s"], ens.get_parameter("log_vars").detach(), rtol=0, atol=0)
    for i, w in enumerate(want):
        torch.testing.assert_close(got["cls"][i], w["cls"], **TOL)
        torch.testing.assert_close(got["aux"]["reg"][i], w["aux"]["reg"], **TOL)
        for a, b in zip(got["aux"]["tok"], w["aux"]["tok"], strict=True):
            torch.testing.assert_close(a[i], b, **TOL)


# (a) fixed weights, (d) missing labels, (e) param groups and a head frozen, with fit ----------


def split(named: Any, trunk_lr: Any, head_lr: Any) -> list[dict]:
    """The usual trunk / heads param groups, by name (the template's names on the ensemble)."""
    named = list(named)
    return [
        {"params": [p for n, p in named if n.startswith("trunk")], "lr": trunk_lr},
        {"params": [p for n, p in named if not n.startswith("trunk")], "lr": head_lr},
    ]


TRUNK_LR, HEAD_LR, FREEZE_AT = [0.01, 0.02, 0.05, 0.1], [0.1, 0.05, 0.02, 0.01], 2


class FreezeTokenHead(vmapens.callbacks.Callback):
    def on_step_end(self, ctx: Any) -> None:
        if ctx.step == FREEZE_AT:  # as `model.tok.requires_grad_(False)` in a plain loop
            ctx.ensemble.template.tok.requires_grad_(False)


def test_fit_with_fixed_task_weights_missing_labels_param_groups_and_a_frozen_head() -> None:
    ens = vmapens.Ensemble(MultiTask, n=N, seed=0)
    with torch.no_grad():  # each member's own task weights, in its buffer
        ens.get_buffer("task_w").copy_(torch.tensor(W))
    alone = ens.unstack()
    g = torch.Generator().manual_seed(3)
    rows = 10
    x, y = batch(g, (N,), rows)  # per-member data
    y["mr"][2] = 0  # member 2 has no regression label in any batch
    y["mc"][1, :5] = 0  # member 1's first rows have no class label
    x_val, y_val = batch(g, (), 5)

    def accuracy(o: dict, t: dict) -> Tensor:
        return (o["cls"].argmax(-1) == t["cls"]).double().mean()

    opt = vmapens.StackedAdam(split(ens.named_parameters(), TRUNK_LR, HEAD_LR), weight_decay=1e-2)
    history = vmapens.fit(
        ens, (x, y), fixed, optimizer=opt, in_dims=0, epochs=2, batch_size=4, seed=0,
        val_data=(x_val, y_val), metrics={"acc": accuracy}, callbacks=[FreezeTokenHead()],
        progress=False,
    )  # fmt: skip

    plan = batch_plan(rows, 4, 6, seed=0)  # 3 steps an epoch: 4, 4 and 2 rows
    for i, m in enumerate(alone):
        o = torch.optim.Adam(
            split(m.named_parameters(), TRUNK_LR[i], HEAD_LR[i]), weight_decay=1e-2
        )
        val_losses, kept = [], []
        for k, r in enumerate(plan):
            o.zero_grad()
            fixed(m(x[i][r]), {key: v[i][r] for key, v in y.items()}).backward()
            o.step()
            if k + 1 == FREEZE_AT:
                m.tok.requires_grad_(False)
            if k % 3 == 2:  # the epoch's end: validation in eval mode, no grad
                with torch.no_grad():
                    out = m.eval()(x_val)
                    m.train()
                e = k // 3
                val_losses.append(fixed(out, y_val))
                kept.append({key: v.clone() for key, v in m.state_dict().items()})
                torch.testing.assert_close(history.val_loss[e, i], val_losses[-1], **TOL)
                torch.testing.assert_close(history.metrics["acc"][e, i], accuracy(out, y_val))
        state = opt.member_state_dict(i, module=m)["state"]
        flat = [q for group in o.param_groups for q in group["params"]]
        for p in (m.tok.weight, m.cls.weight):  # Adam's own step counts, frozen head too
            index = next(j for j, q in enumerate(flat) if q is p)
            assert state[index]["step"] == o.state[p]["step"]
        # val_data brings fit's default EarlyStopping: each member ends at its best epoch
        best = int(torch.stack(val_losses).argmin())
        assert history.best_epoch[i] == best
        m.load_state_dict(kept[best])
    assert history.best_epoch.tolist() != [1] * N  # some member restored to epoch 0
    assert_members(ens, alone)
    step_counts = [
        opt.state[ens.get_parameter(k)]["step"].tolist() for k in ("tok.weight", "cls.weight")
    ]
    assert step_counts == [[FREEZE_AT] * N, [6] * N]  # the frozen head kept its Adam state


# (c) PCGrad and GradNorm by hand: per-member per-task gradients into .grad --------------------


def pcgrad(grads: list[Tensor]) -> Tensor:
    """PCGrad (Yu et al., 2020) on flat per-task gradients `[..., D]`, row by row (a member per
    row): each task's gradient loses its component along another's where they conflict."""
    out = []
    for i, gi in enumerate(grads):
        for j, gj in enumerate(grads):
            if i != j:
                dot = (gi * gj).sum(-1, keepdim=True)
                gi = gi - torch.where(dot < 0, dot / (gj * gj).sum(-1, keepdim=True), 0) * gj
        out.append(gi)
    return sum(out)


def flat_grads(loss: Tensor, params: list[Tensor], lead: int) -> Tensor:
    gs = torch.autograd.grad(loss, params, retain_graph=True)
    return torch.cat([g.flatten(lead) for g in gs], -1)


def write_flat(params: list[Tensor], flat: Tensor) -> None:
    """Each parameter's `.grad` a view of `flat` (not contiguous for the stacked ones)."""
    start = 0
    for p in params:
        size = p[0].numel() if flat.dim() == 2 else p.numel()
        p.grad = flat[..., start : start + size].reshape(p.shape)
        start += size


def test_pcgrad_on_the_trunk_two_optimizers_and_a_head_frozen_in_a_hand_written_loop() -> None:
    ens = vmapens.Ensemble(MultiTask, n=N, seed=0)
    alone = ens.unstack()
    weights = torch.tensor(W)  # fixed per-member task weights, outside the ensemble

    def trunk_of(model: Any) -> list[Tensor]:
        return [p for n, p in model.named_parameters() if n.startswith("trunk")]

    def heads_of(model: Any) -> list[Tensor]:
        return [p for n, p in model.named_parameters() if n.split(".")[0] in ("cls", "reg", "tok")]

    sgd = vmapens.StackedSGD(trunk_of(ens), lr=[0.05, 0.1, 0.02, 0.2], momentum=0.9)
    adam = vmapens.StackedAdam(heads_of(ens), lr=[0.01, 0.02, 0.05, 0.1], weight_decay=0.1)
    plain = [
        (torch.optim.SGD(trunk_of(m), lr=lr, momentum=0.9),
         torch.optim.Adam(heads_of(m), lr=hl, weight_decay=0.1))
        for m, lr, hl in zip(alone, [0.05, 0.1, 0.02, 0.2], [0.01, 0.02, 0.05, 0.1], strict=True)
    ]  # fmt: skip
    g = torch.Generator().manual_seed(4)
    conflicts = 0  # member-steps where PCGrad projected something
    for step in range(4):
        x, y = batch(g, (N,))
        if step == 2:  # the per-token head is done: freeze it on the stacked parameters
            for name in ("tok.weight", "tok.bias"):
                ens.stacked_params()[name].requires_grad_(False)
            for m in alone:
                m.tok.requires_grad_(False)
        ls = vmapens.per_member(task_losses, in_dims=(0, 0))(ens(x, in_dims=0), y)  # [n, 3]
        weighted = ls * weights
        trunk = trunk_of(ens)
        per_task = [flat_grads(weighted[:, k].sum(), trunk, 1) for k in range(3)]
        heads = [p for p in heads_of(ens) if p.requires_grad]
        head_grads = torch.autograd.grad(weighted.sum(), heads)
        sgd.zero_grad()
        adam.zero_grad()
        projected = pcgrad(per_task)
        conflicts += int((projected - sum(per_task)).abs().amax(-1).gt(0).sum())
        write_flat(trunk, projected)
        for p, hg in zip(heads, head_grads, strict=True):
            p.grad = hg
        sgd.step()
        adam.step()

        for i, (m, (o1, o2)) in enumerate(zip(alone, plain, strict=True)):
            lm = task_losses(m(x[i]), member(i, y)) * weights[i]
            per_task_m = [flat_grads(lm[k], trunk_of(m), 0) for k in range(3)]
            live = [p for p in heads_of(m) if p.requires_grad]
            grads_m = torch.autograd.grad(lm.sum(), live)
            o1.zero_grad()
            o2.zero_grad()
            write_flat(trunk_of(m), pcgrad(per_task_m))
            for p, hg in zip(live, grads_m, strict=True):
                p.grad = hg
            o1.step()
            o2.step()
    assert_members(ens, alone)
    assert adam.state[ens.get_parameter("tok.weight")]["step"].tolist() == [2] * N
    assert 0 < conflicts < 4 * N, conflicts


def test_gradnorm_task_weights_by_double_backward_per_member() -> None:
    """GradNorm (Chen et al., 2018): the task weights (`task_w`, here a parameter) learn from
    the gap between each task's weighted gradient norm on the last trunk layer and the
    mean norm times its relative inverse training rate; renormalised to sum to 3."""
    alpha = 1.5

    class GradNormTask(MultiTask):
        def __init__(self) -> None:
            super().__init__()
            del self.task_w
            self.task_w = nn.Parameter(torch.ones(3))

    ens = vmapens.Ensemble(GradNormTask, n=N, seed=0)
    alone = ens.unstack()
    opt = vmapens.StackedAdam(ens, lr=[0.01, 0.02, 0.05, 0.1])
    opts = [
        torch.optim.Adam(m.parameters(), lr=lr) for m, lr in zip(alone, [0.01, 0.02, 0.05, 0.1])
    ]
    g = torch.Generator().manual_seed(5)
    first: list[Tensor | None] = [None] * (N + 1)  # each member's initial losses; [N]: stacked

    def gradnorm_loss(ls: Tensor, w: Tensor, last: Tensor, l0: Tensor) -> Tensor:
        """ls, w, l0: [..., 3]; last: the last shared weight (stacked `[n, ...]` or alone)."""
        lead = ls.dim() - 1
        norms = torch.stack(
            [
                (
                    w[..., k, None, None]
                    * torch.autograd.grad(ls[..., k].sum(), last, create_graph=True)[0]
                )
                .flatten(lead)
                .norm(dim=-1)
                for k in range(3)
            ],
            -1,
        )
        ratio = ls.detach() / l0
        target = norms.mean(-1, keepdim=True) * (ratio / ratio.mean(-1, keepdim=True)) ** alpha
        return (norms - target.detach()).abs().sum()

    for _ in range(3):
        x, y = batch(g)
        ls = vmapens.per_member(task_losses)(ens(x), y)  # [n, 3]
        w = ens.get_parameter("task_w")
        if first[N] is None:
            first[N] = ls.detach()
        opt.zero_grad()
        gn = gradnorm_loss(ls, w, ens.get_parameter("trunk.2.weight"), first[N])
        (w * ls).sum().backward(retain_graph=True)
        w.grad = torch.autograd.grad(gn, w)[0]
        opt.step()
        with torch.no_grad():
            w.mul_(3 / w.sum(-1, keepdim=True))

        for i, (m, o) in enumerate(zip(alone, opts, strict=True)):
            lm = task_losses(m(x), y)
            if first[i] is None:
                first[i] = lm.detach()
            o.zero_grad()
            gm = gradnorm_loss(lm, m.task_w, m.trunk[2].weight, first[i])
            (m.task_w * lm).sum().backward(retain_graph=True)
            m.task_w.grad = torch.autograd.grad(gm, m.task_w)[0]
            o.step()
            with torch.no_grad():
                m.task_w.mul_(3 / m.task_w.sum())
    assert_members(ens, alone)
    assert not torch.equal(ens.get_parameter("task_w")[0], ens.get_parameter("task_w")[1])


# (d) missing labels the way torch's losses spell them ----------------------------------------


def test_ignore_index_with_a_member_whose_every_token_is_unlabelled_is_nan_for_it_alone() -> None:
    """`cross_entropy(..., ignore_index=-100)` over a batch without any label is 0/0 = NaN
    alone; inside the ensemble too, for that member only: the others train on undisturbed."""

    def loss(o: dict, y: dict) -> Tensor:
        return F.cross_entropy(o["cls"], y["cls"]) + F.cross_entropy(
            o["tok"].transpose(1, 2), y["tok"], ignore_index=-100
        )

    ens = vmapens.Ensemble(MultiTask, n=N, seed=0)
    alone = ens.unstack()
    step = vmapens.make_step(ens, loss, vmapens.StackedSGD(ens, lr=0.1), in_dims=0)
    g = torch.Generator().manual_seed(6)
    x, y = batch(g, (N,))
    y["tok"][2] = -100  # member 2: no token label in its batch
    y["tok"][1, :3] = -100  # member 1: half its rows unlabelled
    losses = step(x, y)
    for i, m in enumerate(alone):
        o = torch.optim.SGD(m.parameters(), lr=0.1)
        o.zero_grad()
        want = loss(m(x[i]), member(i, y))
        want.backward()
        o.step()
        torch.testing.assert_close(losses[i], want.detach(), **TOL, equal_nan=True)
    assert losses.isnan().tolist() == [False, False, True, False]
    assert_members(ens, alone, **TOL, equal_nan=True)


def test_a_boolean_index_loss_is_refused_batched_and_the_loop_backend_trains_it() -> None:
    def loss(o: dict, y: dict) -> Tensor:  # the rows with a regression label, if any
        sq = (o["reg"] - y["reg"]) ** 2
        has = y["mr"].bool()
        reg = sq[has].mean() if has.any() else sq.sum() * 0
        return F.cross_entropy(o["cls"], y["cls"]) + reg

    g = torch.Generator().manual_seed(7)
    x, y = batch(g, (N,))
    y["mr"][2] = 0
    ens = vmapens.Ensemble(MultiTask, n=N, seed=0)
    step = vmapens.make_step(ens, loss, vmapens.StackedAdam(ens, lr=0.05), in_dims=0)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    with pytest.raises(RuntimeError, match="cannot be batched.*backend='loop'"):
        step(x, y)
    for k, v in ens.state_dict().items():  # refused: nothing changed
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)

    looped = vmapens.Ensemble(MultiTask, n=N, seed=0, backend="loop")
    alone = looped.unstack()
    step = vmapens.make_step(looped, loss, vmapens.StackedAdam(looped, lr=0.05), in_dims=0)
    opts = [torch.optim.Adam(m.parameters(), lr=0.05) for m in alone]
    for _ in range(2):
        step(x, y)
        for i, (m, o) in enumerate(zip(alone, opts, strict=True)):
            o.zero_grad()
            loss(m(x[i]), member(i, y)).backward()
            o.step()
    assert_members(looped, alone)


def test_per_member_task_weights_as_a_plain_attribute_are_refused_at_build() -> None:
    """docs/semantics.md: a setting that differs per member is refused (one forward runs
    every member with member 0's attributes): a buffer (`task_w` above) is the way."""

    class Weighted(MultiTask):
        def __init__(self, weights: tuple[float, ...]) -> None:
            super().__init__()
            self.weights = weights

    with pytest.raises(ValueError, match="weights"):
        vmapens.Ensemble.from_modules([Weighted(tuple(w)) for w in W])


def test_a_head_frozen_after_zero_grad_without_set_to_none_steps_on_zeros_as_alone() -> None:
    """`zero_grad(set_to_none=False)` leaves the frozen head a zero `.grad`: torch's Adam then
    still steps it (decaying moments, weight decay), and so does the stacked one."""
    ens = vmapens.Ensemble(MultiTask, n=N, seed=0)
    alone = ens.unstack()
    opt = vmapens.StackedAdam(ens, lr=[0.05, 0.02, 0.1, 0.01], weight_decay=0.1)
    opts = [torch.optim.Adam(m.parameters(), lr=lr, weight_decay=0.1)
            for m, lr in zip(alone, [0.05, 0.02, 0.1, 0.01], strict=True)]  # fmt: skip
    g = torch.Generator().manual_seed(8)
    for step in range(4):
        x, y = batch(g)
        if step == 2:
            ens.template.tok.requires_grad_(False)
            for m in alone:
                m.tok.requires_grad_(False)
        opt.zero_grad(set_to_none=False)
        vmapens.per_member(kendall)(ens(x), y).sum().backward()
        opt.step()
        for m, o in zip(alone, opts, strict=True):
            o.zero_grad(set_to_none=False)
            kendall(m(x), y).backward()
            o.step()
    assert_members(ens, alone)
    assert opt.state[ens.get_parameter("tok.weight")]["step"].tolist() == [4] * N
