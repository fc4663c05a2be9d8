"""A user journey: deep ensembles of small sparse mixture-of-experts models (float64, 3 members).

The script a researcher writes from README.md, docs/semantics.md ("Randomness in the forward
pass", "What vmap cannot batch", "Storage" on tensors a forward keeps, "How vmapens checks
itself") and docs/fit.md: a router and E experts stored as batched weights
(`nn.Parameter(torch.randn(E, d, h))` used with `torch.einsum` / `torch.bmm`), top-k routing with
`torch.topk`, softmax gates renormalised over the k picked, combined with `scatter_add_`; the
Switch load-balancing loss and the router z-loss returned from `forward` (a tuple) and also kept
on `self.aux_loss`; a capacity factor that drops the tokens past an expert's queue (a cumsum
over one-hot positions); noisy top-k gating (noise drawn in the forward, `randomness="same"`
and `"different"`); DeepSeek-style aux-loss-free balancing (a per-expert routing bias nudged in
the forward, kept in a buffer); and the routing users write with data-dependent shapes
(HF Mixtral's per-expert loop over `torch.where(mask)` with `index_add_`, a boolean-mask index,
`nonzero`, a `scatter_add_` into `torch.zeros(...)`), which vmap refuses and `backend="loop"`
runs. Trained with `make_step`, `fit` and a hand loop; `predict`; member files.

The truth: each member a plain module trained alone with `torch.optim` on the same batches,
float64 (a batched kernel sums in another order: 1e-10). With `randomness="same"` every member
draws what it draws alone from the same RNG state; with `"different"` member `i` gets row `i` of
one batched draw (docs/semantics.md).
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

N, D, H, E, K, T = 3, 4, 5, 4, 2, 10
TOL: dict[str, Any] = {"rtol": 1e-10, "atol": 1e-10}
OPTIONS = [{}, {"chunk_size": 2}, {"backend": "loop"}]
IDS = ["vmap", "chunks", "loop"]


class SwitchMoE(nn.Module):
    """Top-k MoE with batched expert weights; returns (prediction, balance loss, z-loss)."""

    def __init__(self, noisy: bool = False, capacity: int | None = None) -> None:
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.noise = nn.Linear(D, E, bias=False)  # noisy top-k: a learned noise scale
        self.w1 = nn.Parameter(0.4 * torch.randn(E, D, H))
        self.b1 = nn.Parameter(torch.zeros(E, H))
        self.w2 = nn.Parameter(0.4 * torch.randn(E, H, D))
        self.head = nn.Linear(D, 1)
        self.noisy, self.capacity = noisy, capacity
        self.aux_loss = torch.tensor(0.0)  # as many MoE codebases: read after the forward

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        logits = self.router(x)
        if self.noisy and self.training:
            logits = logits + torch.randn_like(logits) * F.softplus(self.noise(x))
        probs = logits.softmax(-1)
        gate, idx = probs.topk(K, dim=-1)
        gate = gate / gate.sum(-1, keepdim=True)
        hidden = torch.relu(torch.einsum("td,edh->teh", x, self.w1) + self.b1)
        each = torch.einsum("teh,ehd->ted", hidden, self.w2)  # every expert on every token
        weight = torch.zeros_like(probs).scatter_add_(1, idx, gate)  # [T, E], k non-zeros a row
        if self.capacity is not None:  # a token past its first expert's queue is dropped
            first = F.one_hot(idx[:, 0], E).to(x.dtype)
            place = torch.cumsum(first, 0) * first
            weight = weight * ((place > 0) & (place <= self.capacity)).any(-1, keepdim=True)
        out = (weight.unsqueeze(-1) * each).sum(1)
        frac = F.one_hot(idx[:, 0], E).to(x.dtype).mean(0)
        balance = E * (frac * probs.mean(0)).sum()  # Switch Transformer's
        z = torch.logsumexp(logits, -1).pow(2).mean()  # ST-MoE's router z-loss
        self.aux_loss = 0.5 * balance + 0.1 * z
        return self.head(out), balance, z


def moe_loss(out: tuple[Tensor, Tensor, Tensor], y: Tensor) -> Tensor:
    pred, balance, z = out
    return F.mse_loss(pred, y) + 0.5 * balance + 0.1 * z


def batches(count: int = 3, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(T, D, generator=g), torch.randn(T, 1, generator=g)) for _ in range(count)]


def train_alone(
    models: list[nn.Module], data: list, loss=moe_loss, lr: float = 0.05, seed: int | None = None
) -> None:
    """Each member alone with torch.optim.Adam; from `torch.manual_seed(seed)` when given."""
    for m in models:
        opt = torch.optim.Adam(m.parameters(), lr=lr)
        if seed is not None:
            torch.manual_seed(seed)
        for x, y in data:
            opt.zero_grad()
            loss(m(x), y).backward()
            opt.step()


def assert_members(ens: vmapens.Ensemble, models: list[nn.Module]) -> None:
    for i, m in enumerate(models):
        got = ens[i].state_dict()
        for k, v in m.state_dict().items():
            torch.testing.assert_close(got[k], v, **TOL, msg=f"member {i} {k}")


# -- top-k routing, capacity, noisy gating --------------------------------------------------


@pytest.mark.parametrize(
    ("options", "capacity"),
    [({}, None), ({"chunk_size": 2}, 3), ({"backend": "loop"}, 3)],
    ids=["vmap", "chunks-capacity", "loop-capacity"],
)
def test_topk_moe_make_step_equals_each_member_alone(options, capacity):
    ens = vmapens.Ensemble(lambda: SwitchMoE(capacity=capacity), n=N, seed=0, **options)
    alone = ens.unstack()
    step = vmapens.make_step(ens, moe_loss, vmapens.StackedAdam(ens, lr=0.05))
    data = batches(2)
    for x, y in data:
        step(x, y)
    train_alone(alone, data)
    assert_members(ens, alone)


@pytest.mark.parametrize("options", OPTIONS[::2], ids=IDS[::2])
def test_noisy_topk_same_randomness_each_member_draws_as_alone(options):
    ens = vmapens.Ensemble(lambda: SwitchMoE(noisy=True), n=N, seed=0, randomness="same", **options)
    alone = ens.unstack()
    step = vmapens.make_step(ens, moe_loss, vmapens.StackedAdam(ens, lr=0.05))
    data = batches(2)
    torch.manual_seed(7)
    for x, y in data:
        step(x, y)
    train_alone(alone, data, seed=7)
    assert_members(ens, alone)


class GivenNoise(SwitchMoE):
    """The truth's member for `randomness="different"`: its noise given (row i of one draw)."""

    given: Tensor

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        draw, torch.randn_like = torch.randn_like, lambda t: self.given.clone()  # type: ignore
        try:
            return super().forward(x)
        finally:
            torch.randn_like = draw


def test_noisy_topk_different_randomness_member_i_gets_row_i_of_one_draw():
    ens = vmapens.Ensemble(lambda: SwitchMoE(noisy=True), n=N, seed=0)
    x, _ = batches(1)[0]
    torch.manual_seed(3)
    got = ens(x)
    torch.manual_seed(3)
    noise = torch.randn(N, T, E)
    assert not torch.equal(got[0][0], got[0][1])
    for i in range(N):
        m = GivenNoise(noisy=True)
        m.load_state_dict(ens[i].state_dict())
        m.given = noise[i]
        want = m(x)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a[i], b, **TOL)


class AuxFree(SwitchMoE):
    """DeepSeek-V3's aux-loss-free balancing: a per-expert bias picks the experts (not the
    gates), nudged after each training forward towards the mean load, kept in a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("bias", torch.zeros(E))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        probs = self.router(x).softmax(-1)
        _, idx = (probs + self.bias).topk(K, -1)
        gate = probs.gather(-1, idx)
        gate = gate / gate.sum(-1, keepdim=True)
        hidden = torch.relu(torch.einsum("td,edh->teh", x, self.w1) + self.b1)
        each = torch.einsum("teh,ehd->ted", hidden, self.w2)
        out = (torch.zeros_like(probs).scatter_add(1, idx, gate).unsqueeze(-1) * each).sum(1)
        if self.training:
            load = F.one_hot(idx, E).sum((0, 1)).to(x.dtype)
            with torch.no_grad():
                self.bias += 0.05 * torch.sign(load.mean() - load)
        zero = torch.zeros((), dtype=x.dtype)
        return self.head(out), zero, zero


@pytest.mark.parametrize("options", OPTIONS[:1], ids=IDS[:1])
def test_aux_free_balancing_bias_buffer_equals_each_member_alone(options):
    ens = vmapens.Ensemble(AuxFree, n=N, seed=0, **options)
    alone = ens.unstack()
    step = vmapens.make_step(ens, moe_loss, vmapens.StackedAdam(ens, lr=0.05))
    data = batches(3)
    for x, y in data:
        step(x, y)
    train_alone(alone, data)
    assert_members(ens, alone)  # the bias buffer included
    assert ens.get_buffer("bias").abs().sum() > 0  # the loads moved it


# -- fit, the hand loop, predict, member files ----------------------------------------------


def test_fit_then_hand_loop_then_predict_and_member_files_equal_alone(tmp_path):
    ens = vmapens.Ensemble(lambda: SwitchMoE(capacity=3), n=N, seed=0)
    alone = ens.unstack()
    g = torch.Generator().manual_seed(1)
    X, Y = torch.randn(24, D, generator=g), torch.randn(24, 1, generator=g)
    vmapens.fit(ens, (X, Y), moe_loss, epochs=2, batch_size=8, lr=0.05, seed=0, progress=False)
    # Then fine-tune by hand with the same optimizer kind, the aux losses from the output.
    opt = vmapens.StackedSGD(ens, lr=0.1, momentum=0.9)
    tune = batches(2, seed=2)
    for x, y in tune:
        opt.zero_grad()
        pred, balance, z = ens(x)
        (vmapens.per_member(F.mse_loss)(pred, y) + 0.5 * balance + 0.1 * z).sum().backward()
        opt.step()
    plan = batch_plan(24, 8, 6, seed=0)
    for m in alone:
        adam = torch.optim.Adam(m.parameters(), lr=0.05)
        for rows in plan:
            adam.zero_grad()
            moe_loss(m(X[rows]), Y[rows]).backward()
            adam.step()
        sgd = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        for x, y in tune:
            sgd.zero_grad()
            moe_loss(m(x), y).backward()
            sgd.step()
    assert_members(ens, alone)
    xt = torch.randn(7, D, generator=g)
    pred, balance, z = vmapens.predict(ens, xt)
    for i, m in enumerate(alone):
        m.eval()
        with torch.no_grad():
            want = m(xt)
        torch.testing.assert_close(pred[i], want[0], **TOL)
        torch.testing.assert_close(balance[i], want[1], **TOL)
    with pytest.raises(TypeError, match="reduce='none'"):
        vmapens.predict(ens, xt, reduce="mean")  # a tuple output: refused, naming the way out
    vmapens.save_members(ens, tmp_path)
    for i, m in enumerate(alone):
        plain = SwitchMoE(capacity=3)
        plain.load_state_dict(torch.load(tmp_path / f"member_{i:04d}.pt", weights_only=True))
        for k, v in m.state_dict().items():
            torch.testing.assert_close(plain.state_dict()[k], v, **TOL, msg=f"{i} {k}")


# -- routing with data-dependent shapes: refused under vmap, exact with backend="loop" -------


class Mixtral(nn.Module):
    """Sparse routing as users write it: only the tokens routed to an expert run through it."""

    def __init__(self, routing: str) -> None:
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D)) for _ in range(E)
        )
        self.head = nn.Linear(D, 1)
        self.routing = routing

    def forward(self, x: Tensor) -> Tensor:
        probs = self.router(x).softmax(-1)
        gate, idx = probs.topk(K, -1)
        gate = gate / gate.sum(-1, keepdim=True)
        out = torch.zeros(x.shape[0], D, dtype=x.dtype)
        if self.routing == "where":  # Hugging Face's MixtralSparseMoeBlock
            mask = F.one_hot(idx, E).permute(2, 1, 0)  # [E, K, T]
            for e, expert in enumerate(self.experts):
                slot, tok = torch.where(mask[e])
                out.index_add_(0, tok, expert(x[tok]) * gate[tok, slot, None])
        elif self.routing == "bool-mask":
            for e, expert in enumerate(self.experts):
                rows = (idx == e).any(-1)
                w = (gate * (idx == e)).sum(-1)
                out[rows] += expert(x[rows]) * w[rows, None]
        elif self.routing == "nonzero":
            for e, expert in enumerate(self.experts):
                tok = (idx == e).any(-1).nonzero().squeeze(-1)
                w = (gate * (idx == e)).sum(-1)
                out = out.index_add(0, tok, expert(x[tok]) * w[tok, None])
        else:  # "zeros-scatter": dense, but scattered into a fresh torch.zeros in place
            w = torch.zeros(x.shape[0], E, dtype=x.dtype).scatter_add_(1, idx, gate)
            out = (w.unsqueeze(-1) * torch.stack([ex(x) for ex in self.experts], 1)).sum(1)
        return self.head(out)


ROUTINGS = ["where", "bool-mask", "nonzero", "zeros-scatter"]


@pytest.mark.parametrize("routing", ROUTINGS)
def test_data_dependent_routing_is_refused_naming_the_loop_and_changes_nothing(routing):
    ens = vmapens.Ensemble(lambda: Mixtral(routing), n=N, seed=0)
    opt = vmapens.StackedAdam(ens, lr=0.05)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    (x, y), *_ = batches(1)
    with pytest.raises(RuntimeError, match="backend='loop'"):
        ens(x)
    step = vmapens.make_step(ens, nn.MSELoss(), opt)
    with pytest.raises(RuntimeError, match=r"forward of Mixtral cannot be batched.*backend='loop'"):
        step(x, y)
    with pytest.raises(RuntimeError, match="backend='loop'"):
        vmapens.fit(ens, [(x, y)], nn.MSELoss(), optimizer=opt, progress=False, seed=0)
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not opt.state  # no step was taken


@pytest.mark.parametrize("routing", ["where"])
def test_data_dependent_routing_with_the_loop_equals_each_member_alone(routing):
    data = batches(2)
    stepped = vmapens.Ensemble(lambda: Mixtral(routing), n=N, seed=0, backend="loop")
    alone = stepped.unstack()
    step = vmapens.make_step(stepped, nn.MSELoss(), vmapens.StackedAdam(stepped, lr=0.05))
    for x, y in data:
        step(x, y)
    fitted = vmapens.Ensemble(lambda: Mixtral(routing), n=N, seed=0, backend="loop")
    vmapens.fit(fitted, data, nn.MSELoss(), lr=0.05, progress=False, seed=0)  # one epoch
    train_alone(alone, data, loss=F.mse_loss)
    assert_members(stepped, alone)
    assert_members(fitted, alone)
    xt = torch.randn(7, D)
    got = vmapens.predict(fitted, xt)
    for i, m in enumerate(alone):
        with torch.no_grad():
            torch.testing.assert_close(got[i], m.eval()(xt), **TOL)


# -- found: silent results ------------------------------------------------------------------

C = 2  # expert capacity


class Dispatch(SwitchMoE):
    """Switch top-1 with capacity, GShard's dispatch/combine tensors, the experts run with
    `torch.bmm`. The slot of a token past its expert's queue is >= C (and -1 for none): alone,
    `F.one_hot(slot, C)` raises "Class values must be smaller than num_classes"."""

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        probs = self.router(x).softmax(-1)
        gate, idx = probs.max(-1)
        mask = F.one_hot(idx, E)
        slot = (torch.cumsum(mask, 0) * mask - 1).max(-1).values  # place in its queue
        dispatch = (F.one_hot(slot, C).unsqueeze(1) * mask.unsqueeze(-1)).to(x.dtype)
        xin = torch.einsum("tec,td->ecd", dispatch, x)
        h = torch.relu(torch.bmm(xin, self.w1) + self.b1.unsqueeze(1))
        out = torch.einsum("tec,ecd->td", dispatch * gate[:, None, None], torch.bmm(h, self.w2))
        zero = torch.zeros((), dtype=x.dtype)
        return self.head(out), zero, zero


def test_a_forward_that_raises_alone_is_refused_by_the_step():
    ens = vmapens.Ensemble(Dispatch, n=N, seed=0)
    (x, y), *_ = batches(1)
    with pytest.raises(RuntimeError, match="num_classes"):
        ens[0](x)  # alone: every batch of 10 tokens overflows a queue of 2
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    step = vmapens.make_step(ens, moe_loss, vmapens.StackedAdam(ens, lr=0.05))
    try:
        for x, y in batches(4):
            step(x, y)  # all four ran, every member moved
    except RuntimeError as err:
        assert "fails alone on this batch" in str(err) and "backend='loop'" in str(err)
        for k, v in ens.state_dict().items():
            assert torch.equal(v, before[k]), k  # refused before anything changed
        return
    pytest.fail("four steps trained a forward that raises alone")


def runner_aux_loss(ens: vmapens.Ensemble, where: str = "runner"):
    def loss(out: tuple, y: Tensor) -> Tensor:  # the awkward journey's way: the module run
        return F.mse_loss(out[0], y) + getattr(ens, where).aux_loss  # or the docs' template

    return loss


@pytest.mark.parametrize(
    "options",
    [{}, {"chunk_size": 2}, {"backend": "loop"}],
    ids=IDS,
)
@pytest.mark.parametrize("where", ["runner", "template"])
def test_fit_validation_of_a_loss_reading_the_kept_aux_loss_equals_alone(options, where):
    # Training runs forward and loss in one member map, so the loss reads each member's own
    # `ens.runner.aux_loss` (exact). Validation ran `ens(x)` first, then the loss per member:
    # in chunks / turns the runner held the last chunk's / member's, and every member's
    # validation loss (hence early stopping, best_k) used it, silently; the template's held
    # all members' (a crash). It now runs the loss in the member map too.
    ens = vmapens.Ensemble(SwitchMoE, n=N, seed=0, **options)
    alone = ens.unstack()
    g = torch.Generator().manual_seed(1)
    X, Y = torch.randn(16, D, generator=g), torch.randn(16, 1, generator=g)
    Xv, Yv = torch.randn(8, D, generator=g), torch.randn(8, 1, generator=g)
    h = vmapens.fit(
        ens, (X, Y), runner_aux_loss(ens, where), epochs=1, batch_size=8, shuffle=False, lr=0.05,
        val_data=(Xv, Yv), patience=5, seed=0, progress=False,
    )  # fmt: skip
    want = torch.zeros(1, N, dtype=torch.float64)
    for i, m in enumerate(alone):
        opt = torch.optim.Adam(m.parameters(), lr=0.05)
        for epoch in range(1):
            m.train()
            for rows in (slice(0, 8), slice(8, 16)):
                opt.zero_grad()
                pred = m(X[rows])[0]
                (F.mse_loss(pred, Y[rows]) + m.aux_loss).backward()
                opt.step()
            m.eval()
            with torch.no_grad():
                want[epoch, i] = F.mse_loss(m(Xv)[0], Yv) + m.aux_loss
    torch.testing.assert_close(h.val_loss, want, **TOL)


@pytest.mark.parametrize("options", [{}, {"chunk_size": 2}], ids=["vmap", "chunks"])
def test_step_loss_reading_the_templates_kept_aux_loss_gets_each_members(options) -> None:
    ens = vmapens.Ensemble(SwitchMoE, n=N, seed=0, **options)
    alone = ens.unstack()

    def loss(out: tuple, y: Tensor) -> Tensor:  # the member's structure: docs' `ens.template`
        return F.mse_loss(out[0], y) + ens.template.aux_loss

    step = vmapens.make_step(ens, loss, vmapens.StackedSGD(ens, lr=0.1))
    data = batches(2)
    for x, y in data:
        step(x, y)
    for m in alone:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for x, y in data:
            opt.zero_grad()
            (F.mse_loss(m(x)[0], y) + m.aux_loss).backward()
            opt.step()
    assert_members(ens, alone)


def test_step_loss_reading_the_templates_kept_aux_loss_with_the_loop_equals_alone():
    ens = vmapens.Ensemble(SwitchMoE, n=N, seed=0, backend="loop")
    alone = ens.unstack()

    def loss(out: tuple, y: Tensor) -> Tensor:
        return F.mse_loss(out[0], y) + ens.template.aux_loss

    step = vmapens.make_step(ens, loss, vmapens.StackedSGD(ens, lr=0.1))
    data = batches(2)
    for x, y in data:
        step(x, y)
    for m in alone:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for x, y in data:
            opt.zero_grad()
            (F.mse_loss(m(x)[0], y) + m.aux_loss).backward()
            opt.step()
    assert_members(ens, alone)


def test_hand_loop_with_the_loop_reading_the_kept_aux_loss_gets_each_members_or_an_error():
    ens = vmapens.Ensemble(SwitchMoE, n=N, seed=0, backend="loop")
    alone = ens.unstack()
    opt = vmapens.StackedSGD(ens, lr=0.1)
    data = batches(2)
    try:
        for x, y in data:
            opt.zero_grad()
            pred = ens(x)[0]
            aux = ens.template.aux_loss  # the MoE codebase's loop: read after the forward
            (vmapens.per_member(F.mse_loss)(pred, y) + aux).sum().backward()
            opt.step()
    except (RuntimeError, ValueError, TypeError):
        return  # an error is right too
    for m in alone:
        sgd = torch.optim.SGD(m.parameters(), lr=0.1)
        for x, y in data:
            sgd.zero_grad()
            (F.mse_loss(m(x)[0], y) + m.aux_loss).backward()
            sgd.step()
    assert_members(ens, alone)
