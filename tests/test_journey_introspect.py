"""A user journey: looking inside trained members (float64, 3 members).

A researcher trains a small CNN and a one-layer transformer encoder with `make_step` / `fit`,
then inspects the ensemble the way one inspects a plain model (README.md, docs/semantics.md
"Storage" on tensors a forward keeps, the hooks paragraph of "What vmap cannot batch",
`torch.autograd.grad` with a shared input, docs/fit.md "Validation"): forward hooks for
feature extraction, attention weights kept by the forward (`self.last_attn`,
`average_attn_weights` both ways) read from `ens.template` after `ens(x)` and after a step,
saliency and integrated gradients, per-member gradient norms against `clip_grad_norm_`,
backward hooks logging gradient norms, `parameters_to_vector` and parameter counts, and a
`loss_fn` that reads an attention-entropy penalty the forward kept on `ens.template` (make_step
with masks and dropout, members of different sizes, `fit` with validation).

The truth: each member a plain module trained alone with `torch.optim` on the same batches,
float64 (a batched kernel sums in another order: 1e-10).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import clip_grad_norm_, parameters_to_vector

import vmapens

pytestmark = pytest.mark.usefixtures("float64_default")

N, D, T, B = 3, 8, 5, 4
TOL: dict[str, Any] = {"rtol": 1e-10, "atol": 1e-10}
OPTIONS = [{}, {"chunk_size": 2}, {"backend": "loop"}]
IDS = ["vmap", "chunks", "loop"]


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3)
        self.head = nn.Linear(3 * 4 * 4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.relu(self.conv(x)).flatten(1))


class Block(nn.Module):
    """One encoder layer that keeps its attention weights and their entropy for inspection."""

    def __init__(self, ff: int = 16, average: bool = True, dropout: float = 0.0) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True, dropout=dropout)
        self.norm = nn.LayerNorm(D)
        self.ff = nn.Sequential(nn.Linear(D, ff), nn.ReLU(), nn.Linear(ff, D))
        self.average = average
        self.last_attn: Tensor | None = None
        self.attn_entropy = torch.tensor(0.0)

    def keep(self, w: Tensor) -> None:
        self.last_attn = w
        self.attn_entropy = -(w * w.clamp_min(1e-12).log()).sum(-1).mean()

    def forward(self, x: Tensor) -> Tensor:
        a, w = self.attn(x, x, x, need_weights=True, average_attn_weights=self.average)
        self.keep(w)
        h = self.norm(x + a)
        return h + self.ff(h)


class Encoder(nn.Module):
    def __init__(self, block: type[Block] = Block, **kw: Any) -> None:
        super().__init__()
        self.inp = nn.Linear(3, D)
        self.block = block(**kw)
        self.out = nn.Linear(D, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.block(self.inp(x)).mean(1))


def seq_batches(count: int, rows: int = B, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(rows, T, 3, generator=g), torch.randn(rows, 2, generator=g))
        for _ in range(count)
    ]


def penalised(m: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """The loss alone: the member's own kept entropy, read after its forward."""
    return F.mse_loss(m(x), y) + 0.1 * m.block.attn_entropy


def train_alone(models, data, masks=None, seed: int | None = None) -> None:
    for i, m in enumerate(models):
        opt = torch.optim.Adam(m.parameters(), lr=0.05)
        if seed is not None:
            torch.manual_seed(seed)
        for k, (x, y) in enumerate(data):
            opt.zero_grad()
            penalised(m, x, y).backward()
            if masks is None or masks[k][i]:
                opt.step()


def assert_members(ens: vmapens.Ensemble, models: list[nn.Module]) -> None:
    for i, m in enumerate(models):
        got = ens[i].state_dict()
        for k, v in m.state_dict().items():
            torch.testing.assert_close(got[k], v, **TOL, msg=f"member {i} {k}")


def images(seed: int = 0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 1, 6, 6, generator=g), torch.randint(0, 3, (B,), generator=g)


# -- feature extraction with forward hooks ----------------------------------------------------


@pytest.mark.parametrize("options", OPTIONS, ids=IDS)
def test_forward_hook_on_the_template_is_refused_under_vmap_and_fires_per_member_in_the_loop(
    options,
):
    ens = vmapens.Ensemble(CNN, n=N, seed=0, **options)
    alone = ens.unstack()
    x, _ = images()
    feats: list[Tensor] = []
    handle = ens.template.conv.register_forward_hook(lambda m, i, o: feats.append(o))
    if options.get("backend") != "loop":  # docs: refused on the next call, naming the way out
        with pytest.raises(RuntimeError, match="backend='loop'"):
            ens(x)
        handle.remove()
        ens(x)  # removed: runs again
        return
    ens(x)
    assert len(feats) == N  # once per member, in member order
    for f, m in zip(feats, alone, strict=True):
        torch.testing.assert_close(f, m.conv(x), **TOL)


# -- attention weights kept by the forward ---------------------------------------------------


@pytest.mark.parametrize(
    ("options", "average"),
    [({}, False), ({"chunk_size": 2}, True), ({"backend": "loop"}, False)],
    ids=["vmap-per-head", "chunks-averaged", "loop-per-head"],
)
def test_kept_attention_weights_after_a_call_and_after_steps_are_each_members_own(options, average):
    ens = vmapens.Ensemble(lambda: Encoder(average=average), n=N, seed=0, **options)
    alone = ens.unstack()
    (x, _), *data = seq_batches(3)
    out = ens(x)
    kept = ens.template.block.last_attn
    heads = () if average else (2,)
    assert kept.shape == (N, B, *heads, T, T) and kept.requires_grad  # with its graph
    for i, m in enumerate(alone):
        torch.testing.assert_close(out[i], m(x), **TOL)
        torch.testing.assert_close(kept[i], m.block.last_attn, **TOL)
        assert torch.equal(ens[i].block.last_attn, kept[i].detach())
    step = vmapens.make_step(ens, lambda o, y: F.mse_loss(o, y), vmapens.StackedAdam(ens, lr=0.05))
    for xb, yb in data:
        step(xb, yb)
    for m in alone:  # the truth: each alone, then what its last training forward kept
        opt = torch.optim.Adam(m.parameters(), lr=0.05)
        for xb, yb in data:
            opt.zero_grad()
            F.mse_loss(m(xb), yb).backward()
            opt.step()
    assert_members(ens, alone)
    t = ens.template.block
    assert not t.last_attn.requires_grad and not t.attn_entropy.requires_grad  # detached
    for i, m in enumerate(alone):
        torch.testing.assert_close(t.last_attn[i], m.block.last_attn.detach(), **TOL)
        torch.testing.assert_close(t.attn_entropy[i], m.block.attn_entropy.detach(), **TOL)
        torch.testing.assert_close(ens[i].block.last_attn, m.block.last_attn.detach(), **TOL)


# -- saliency, integrated gradients ------------------------------------------------------------


@pytest.mark.parametrize("options", OPTIONS, ids=IDS)
def test_saliency_and_integrated_gradients_equal_each_members_own(options):
    ens = vmapens.Ensemble(CNN, n=N, seed=0, **options)
    alone = ens.unstack()
    x0, _ = images()
    c = 1
    own = []
    for m in alone:
        xi = x0.clone().requires_grad_(True)
        m(xi)[:, c].sum().backward()
        own.append(xi.grad)
    # one shared input: its gradient is the sum over members (it feeds every member)
    x = x0.clone().requires_grad_(True)
    ens(x)[:, :, c].sum().backward()
    torch.testing.assert_close(x.grad, sum(own), **TOL)
    # a copy per member: row i is member i's saliency map
    xs = x0.expand(N, *x0.shape).clone().requires_grad_(True)
    (g,) = torch.autograd.grad(ens(xs, in_dims=0)[:, :, c].sum(), xs)
    for i in range(N):
        torch.testing.assert_close(g[i], own[i], **TOL)
    # integrated gradients from a zero baseline, 4 steps of the path, each member its own
    alphas = torch.linspace(0, 1, 5)[1:].view(-1, 1, 1, 1, 1)
    path = (alphas * x0).reshape(-1, 1, 6, 6)
    ps = path.expand(N, *path.shape).clone().requires_grad_(True)
    (gp,) = torch.autograd.grad(ens(ps, in_dims=0)[:, :, c].sum(), ps)
    ig = x0 * gp.view(N, 4, *x0.shape).mean(1)
    for i, m in enumerate(alone):
        p = path.clone().requires_grad_(True)
        (gi,) = torch.autograd.grad(m(p)[:, c].sum(), p)
        torch.testing.assert_close(ig[i], x0 * gi.view(4, *x0.shape).mean(0), **TOL)


# -- gradient and weight statistics ------------------------------------------------------------


@pytest.mark.parametrize("options", OPTIONS, ids=IDS)
def test_grad_norms_clipping_parameter_vectors_and_counts_equal_each_members(options):
    ens = vmapens.Ensemble(CNN, n=N, seed=0, **options)
    alone = ens.unstack()
    x, y = images()
    loss = vmapens.per_member(F.cross_entropy)(ens(x), y)
    loss.sum().backward()
    stacked = ens.stacked_params()
    norms = torch.stack([p.grad.flatten(1).norm(dim=1) for p in stacked.values()], 1).norm(dim=1)
    want = []
    for m in alone:
        F.cross_entropy(m(x), y).backward()
        want.append(clip_grad_norm_(m.parameters(), 0.5))  # returns the norm before clipping
    torch.testing.assert_close(norms, torch.stack(want), **TOL)
    got = vmapens.optim.clip_grad_norm_(ens, 0.5)
    torch.testing.assert_close(got, torch.stack(want), **TOL)
    for i, m in enumerate(alone):
        for k, p in m.named_parameters():
            torch.testing.assert_close(stacked[k].grad[i], p.grad, **TOL, msg=k)
        torch.testing.assert_close(
            parameters_to_vector(ens[i].parameters()), parameters_to_vector(m.parameters())
        )
    each = sum(p.numel() for p in alone[0].parameters())
    assert sum(p.numel() for p in ens.parameters()) == N * each
    assert sum(p.numel() for p in ens[1].parameters()) == each
    assert sum(p.numel() for p in ens.template.parameters()) == each  # on meta, shapes only


def test_backward_hook_is_refused_under_vmap_and_logs_each_members_in_the_loop():
    x, y = images()
    ens = vmapens.Ensemble(CNN, n=N, seed=0)
    ens.template.conv.register_full_backward_hook(lambda m, gi, go: None)
    with pytest.raises(RuntimeError, match="backend='loop'"):
        vmapens.make_step(ens, nn.CrossEntropyLoss(), vmapens.StackedSGD(ens, lr=0.1))(x, y)

    ens = vmapens.Ensemble(CNN, n=N, seed=0, backend="loop")
    alone = ens.unstack()
    fwd: list[Tensor] = []
    bwd: list[Tensor] = []

    def hooks(m: nn.Module) -> None:
        m.conv.register_forward_hook(lambda _, i, o: fwd.append(o.detach().norm()))
        m.conv.register_full_backward_hook(lambda _, gi, go: bwd.append(go[0].norm()))

    hooks(ens.template)
    # check=False: the first step's self-check runs member 0 twice more, and hooks fire there
    step = vmapens.make_step(
        ens, nn.CrossEntropyLoss(), vmapens.StackedSGD(ens, lr=0.1), check=False
    )
    with pytest.warns(UserWarning, match="no inputs require gradients"):  # torch's, as alone
        for _ in range(2):
            step(x, y)
    got_f, got_b = torch.stack(fwd).view(2, N), torch.stack(bwd).view(2, N)
    fwd.clear(), bwd.clear()
    with pytest.warns(UserWarning, match="no inputs require gradients"):
        for m in alone:
            hooks(m)
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            for _ in range(2):
                opt.zero_grad()
                F.cross_entropy(m(x), y).backward()
                opt.step()
    want_f, want_b = torch.stack(fwd).view(N, 2).T, torch.stack(bwd).view(N, 2).T
    torch.testing.assert_close(got_f, want_f, **TOL)  # forward hooks: in member order
    # backward hooks fire once per member, last member first (autograd's order for the
    # summed loss): compared per step as a set
    torch.testing.assert_close(got_b.sort(1).values, want_b.sort(1).values, **TOL)
    assert_members(ens, alone)


# -- a loss that reads what the forward kept on ens.template -----------------------------------


def template_penalty(ens: vmapens.Ensemble):
    def loss(out: Tensor, y: Tensor) -> Tensor:  # as a plain loop reads model.block.attn_entropy
        return F.mse_loss(out, y) + 0.1 * ens.template.block.attn_entropy

    return loss


@pytest.mark.parametrize("options", OPTIONS, ids=IDS)
def test_loss_reading_the_kept_entropy_with_masks_after_a_call_equals_alone(options):
    ens = vmapens.Ensemble(Encoder, n=N, seed=0, **options)
    alone = ens.unstack()
    data = seq_batches(2)
    ens(data[0][0])  # the template now holds a stacked [n] entropy, with its graph
    step = vmapens.make_step(ens, template_penalty(ens), vmapens.StackedAdam(ens, lr=0.05))
    masks = [[True, False, True], [False, True, True]]
    for (x, y), mask in zip(data, masks, strict=True):
        step(x, y, mask=torch.tensor(mask))
    train_alone(alone, data, masks=masks)
    assert_members(ens, alone)


@pytest.mark.parametrize("options", OPTIONS[::2], ids=IDS[::2])
def test_loss_reading_the_kept_entropy_with_attention_dropout_same_randomness_equals_alone(
    options,
):
    ens = vmapens.Ensemble(lambda: Encoder(dropout=0.3), n=N, seed=0, randomness="same", **options)
    alone = ens.unstack()
    data = seq_batches(2)
    step = vmapens.make_step(ens, template_penalty(ens), vmapens.StackedAdam(ens, lr=0.05))
    torch.manual_seed(5)
    for x, y in data:
        step(x, y)
    train_alone(alone, data, seed=5)  # "same": each member draws what it draws alone
    assert_members(ens, alone)


@pytest.mark.parametrize("options", OPTIONS, ids=IDS)
def test_loss_reading_the_kept_entropy_members_of_different_sizes_equals_alone(options):
    factories = [functools.partial(Encoder, ff=f) for f in (16, 24, 24)]
    ens = vmapens.Ensemble.from_factories(factories, seed=0, **options)
    alone = ens.unstack()
    data = seq_batches(2)
    step = vmapens.make_step(ens, template_penalty(ens), vmapens.StackedAdam(ens, lr=0.05))
    for x, y in data:
        step(x, y)
    train_alone(alone, data)
    assert_members(ens, alone)
    assert [m.block.ff[0].out_features for m in ens.unstack()] == [16, 24, 24]
    for i, m in enumerate(alone):  # the stacked rows are right ...
        torch.testing.assert_close(ens.template.block.attn_entropy[i], m.block.attn_entropy)
    # ... and ens[i] of members of different sizes holds no kept row (docs/semantics.md)
    assert ens[1].block.last_attn is None


class Sparse(Block):
    """An activation-sparsity penalty kept over the feed-forward width (padded in a sweep)."""

    def forward(self, x: Tensor) -> Tensor:
        a, w = self.attn(x, x, x, need_weights=True)
        self.keep(w)
        h = self.norm(x + a)
        hidden = self.ff[1](self.ff[0](h))
        self.attn_entropy = self.attn_entropy + hidden.abs().mean()  # a mean over ff
        return h + self.ff[2](hidden)


def test_a_kept_penalty_that_averages_over_a_padded_width_is_refused_by_the_self_check():
    factories = [functools.partial(Encoder, block=Sparse, ff=f) for f in (16, 24, 24)]
    ens = vmapens.Ensemble.from_factories(factories, seed=0)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    step = vmapens.make_step(ens, template_penalty(ens), vmapens.StackedAdam(ens, lr=0.05))
    with pytest.raises(RuntimeError, match="padded ensemble than alone"):
        step(*seq_batches(1)[0])
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("options", OPTIONS, ids=IDS)
def test_fit_with_validation_of_a_loss_reading_the_kept_entropy_equals_alone(options):
    ens = vmapens.Ensemble(Encoder, n=N, seed=0, **options)
    alone = ens.unstack()
    (X, Y), (Xv, Yv) = seq_batches(1, rows=8)[0], seq_batches(1, rows=4, seed=1)[0]
    h = vmapens.fit(
        ens, (X, Y), template_penalty(ens), epochs=2, batch_size=4, shuffle=False, lr=0.05,
        val_data=(Xv, Yv), progress=False, seed=0,
    )  # fmt: skip
    want = torch.zeros(2, N)
    best: list[dict[str, Tensor]] = []
    for i, m in enumerate(alone):
        opt = torch.optim.Adam(m.parameters(), lr=0.05)
        states = []
        for epoch in range(2):
            m.train()
            train_alone_rows = [(X[:4], Y[:4]), (X[4:], Y[4:])]
            for x, y in train_alone_rows:
                opt.zero_grad()
                penalised(m, x, y).backward()
                opt.step()
            m.eval()
            with torch.no_grad():
                want[epoch, i] = penalised(m, Xv, Yv)
            states.append({k: v.clone() for k, v in m.state_dict().items()})
        best.append(states[int(want[:, i].argmin())])  # fit's default: best-epoch restore
    torch.testing.assert_close(h.val_loss, want, **TOL)
    for i, m in enumerate(alone):  # the template holds what the last validation forward kept
        torch.testing.assert_close(ens.template.block.last_attn[i], m.block.last_attn, **TOL)
        for k, v in ens[i].state_dict().items():
            torch.testing.assert_close(v, best[i][k], **TOL, msg=k)


# -- bugs --------------------------------------------------------------------------------------


class TrainOnly(Block):
    """Keeps its entropy in training only, as many aux losses are (`if self.training:`)."""

    def forward(self, x: Tensor) -> Tensor:
        a, w = self.attn(x, x, x, need_weights=True)
        if self.training:
            self.keep(w)
        h = self.norm(x + a)
        return h + self.ff(h)


@pytest.mark.parametrize("options", OPTIONS[::2], ids=IDS[::2])
def test_validation_loss_reading_a_kept_tensor_only_training_sets_equals_alone(options):
    ens = vmapens.Ensemble(lambda: Encoder(block=TrainOnly), n=N, seed=0, **options)
    alone = ens.unstack()
    (X, Y), (Xv, Yv) = seq_batches(1, rows=8)[0], seq_batches(1, rows=4, seed=1)[0]
    h = vmapens.fit(
        ens, (X, Y), template_penalty(ens), epochs=1, batch_size=4, shuffle=False, lr=0.05,
        val_data=(Xv, Yv), progress=False, seed=0,
    )  # fmt: skip
    want = torch.zeros(1, N)
    for i, m in enumerate(alone):
        opt = torch.optim.Adam(m.parameters(), lr=0.05)
        for x, y in [(X[:4], Y[:4]), (X[4:], Y[4:])]:
            opt.zero_grad()
            penalised(m, x, y).backward()
            opt.step()
        m.eval()
        with torch.no_grad():  # alone: the entropy its last training forward kept
            want[0, i] = penalised(m, Xv, Yv)
    torch.testing.assert_close(h.val_loss, want, **TOL)


@pytest.mark.parametrize("options", OPTIONS[:2], ids=IDS[:2])
def test_forward_hook_on_the_runner_is_refused_or_gives_each_members_features(options):
    ens = vmapens.Ensemble(CNN, n=N, seed=0, **options)
    alone = ens.unstack()
    x, _ = images()
    feats: list[Tensor] = []
    ens.runner.conv.register_forward_hook(lambda m, i, o: feats.append(o))
    try:
        ens(x)
    except RuntimeError as err:  # refused, with the way out, is right
        assert "backend='loop'" in str(err)
        return
    got = torch.cat([f.reshape(-1, *f.shape[-4:]) for f in feats])  # raises: escaped
    torch.testing.assert_close(got, torch.stack([m.conv(x) for m in alone]).flatten(0, 1))
