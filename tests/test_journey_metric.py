"""A user journey: metric learning with an ensemble of small embedding networks.

A researcher trains 3 embedding networks (an MLP, or a tiny CNN, to an L2-normalised embedding
with `F.normalize`) written as plain PyTorch, with the losses of the field:

* batch-hard triplet (`torch.cdist`, masks from the labels, `masked_fill`, max / min over rows,
  `F.margin_ranking_loss`);
* `nn.TripletMarginLoss` with the positive and negative of each anchor mined per member by
  `argsort` / `topk` on the member's own distances;
* ArcFace (normalised class weights, `acos` / `cos` with an angular margin on the target logit
  through `one_hot`) and CosFace (an additive margin placed with `scatter`), scaled, into
  `F.cross_entropy(label_smoothing=...)`;
* a supervised contrastive loss with a learned temperature (an `nn.Parameter` of the member,
  clamped).

The paths, in the order a user tries them (README.md, docs/semantics.md, docs/workflows.md,
docs/fit.md): the README's manual loop with `vmapens.per_member`; `make_step` and `fit` on a
`DataLoader` with a P classes x K samples batch sampler; per-member batches (`in_dims=0`);
`vmapens.predict(reduce="none")` and recall@k computed by hand, per member and for the
averaged embedding; `chunk_size` and `backend="loop"`.

The truth: every member copied out before training (`ens.unstack()`) and trained alone with
`torch.optim.Adam` on the same batches, float64. Distances are distinct (checked), so the mined
indices and the top-k neighbours alone are well defined; only the order of sums may differ,
hence TOL.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

import vmapens

N, D, E, C, LR = 3, 6, 4, 4, 0.05
TOL: dict[str, Any] = {"rtol": 1e-9, "atol": 1e-10}  # float64, sums in another order

Out = tuple[Tensor, Tensor, Tensor]


class Embedder(nn.Module):
    """An MLP to a unit-norm embedding, a cosine classifier head and a learned temperature."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 8), nn.Linear(8, E)
        self.head = nn.Parameter(torch.randn(C, E))  # ArcFace / CosFace class centres
        self.temperature = nn.Parameter(torch.tensor(0.3))

    def embed(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))

    def forward(self, x: Tensor) -> Out:
        emb = F.normalize(self.embed(x), dim=-1)
        cos = emb @ F.normalize(self.head, dim=-1).T
        return emb, cos, self.temperature.clamp(0.05, 1.0)


class ConvEmbedder(Embedder):
    """The same heads on a tiny CNN over 1 x 4 x 4 images (a flat input of 16)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Conv2d(1, 2, 3)
        self.fc2 = nn.Linear(8, E)

    def embed(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.fc1(x.view(-1, 1, 4, 4))).flatten(1))


def mine(emb: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """Each anchor's hardest positive (argsort) and hardest negative (topk), on its own
    distances."""
    with torch.no_grad():
        d = torch.cdist(emb, emb)
        same = y[:, None] == y[None, :]
        eye = torch.eye(len(y), dtype=torch.bool)
        pos = d.masked_fill(~same | eye, -1.0).argsort(1, descending=True)[:, 0]
        neg = d.masked_fill(same, float("inf")).topk(1, largest=False).indices[:, 0]
    return pos, neg


def batch_hard(out: Out, y: Tensor) -> Tensor:
    d = torch.cdist(out[0], out[0])
    same = y[:, None] == y[None, :]
    eye = torch.eye(len(y), dtype=torch.bool)
    hardest_pos = d.masked_fill(~same | eye, 0.0).max(1).values
    hardest_neg = d.masked_fill(same, float("inf")).min(1).values
    return F.margin_ranking_loss(hardest_neg, hardest_pos, torch.ones_like(hardest_neg), 0.3)


def mined_triplet(out: Out, y: Tensor) -> Tensor:
    pos, neg = mine(out[0], y)
    return nn.TripletMarginLoss(margin=0.3)(out[0], out[0][pos], out[0][neg])


def arcface(out: Out, y: Tensor, s: float = 8.0, m: float = 0.3) -> Tensor:
    cos = out[1].clamp(-1 + 1e-7, 1 - 1e-7)
    target = F.one_hot(y, C).bool()
    logits = torch.where(target, torch.cos(torch.acos(cos) + m), cos) * s
    return F.cross_entropy(logits, y, label_smoothing=0.1)


def cosface(out: Out, y: Tensor, s: float = 8.0, m: float = 0.2) -> Tensor:
    logits = out[1].scatter(1, y[:, None], out[1].gather(1, y[:, None]) - m) * s
    return F.cross_entropy(logits, y, label_smoothing=0.1)


def supcon(out: Out, y: Tensor) -> Tensor:
    emb, _, temperature = out
    eye = torch.eye(len(y), dtype=torch.bool)
    sim = (emb @ emb.T / temperature).masked_fill(eye, float("-inf"))
    logp = sim.log_softmax(1).masked_fill(eye, 0.0)
    pos = (y[:, None] == y[None, :]) & ~eye
    return -((logp * pos).sum(1) / pos.sum(1)).mean()


def total(out: Out, y: Tensor) -> Tensor:
    return batch_hard(out, y) + mined_triplet(out, y) + arcface(out, y) + supcon(out, y)


LOSSES: dict[str, Callable[[Out, Tensor], Tensor]] = {
    "batch_hard": batch_hard,
    "mined_triplet": mined_triplet,
    "arcface": arcface,
    "cosface": cosface,
    "supcon": supcon,
}


class PKSampler(Sampler[list[int]]):
    """P classes x K samples per batch, from a generator of its own."""

    def __init__(self, labels: Tensor, p: int, k: int, batches: int, seed: int) -> None:
        self.labels, self.p, self.k, self.batches = labels, p, k, batches
        self.g = torch.Generator().manual_seed(seed)

    def __iter__(self) -> Iterator[list[int]]:
        classes = self.labels.unique()
        for _ in range(self.batches):
            batch: list[int] = []
            for c in classes[torch.randperm(len(classes), generator=self.g)[: self.p]]:
                rows = (self.labels == c).nonzero().flatten()
                batch += rows[torch.randperm(len(rows), generator=self.g)[: self.k]].tolist()
            yield batch

    def __len__(self) -> int:
        return self.batches


def data(seed: int = 1, per_class: int = 6, dim: int = D) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(C).repeat_interleave(per_class)
    centres = 1.5 * torch.randn(C, dim, generator=g, dtype=torch.float64)
    return centres[y] + torch.randn(len(y), dim, generator=g, dtype=torch.float64), y


def loader(x: Tensor, y: Tensor, seed: int, batches: int = 3) -> DataLoader:
    return DataLoader(TensorDataset(x, y), batch_sampler=PKSampler(y, 2, 3, batches, seed))


def build(module: type[nn.Module] = Embedder, **kw: Any) -> tuple[vmapens.Ensemble, list]:
    ens = vmapens.Ensemble(lambda: module().double(), n=N, seed=0, **kw)
    return ens, ens.unstack()  # copies, taken before training


def distinct(emb: Tensor) -> None:
    """The distances (and similarities) of one member's batch are apart by far more than
    round-off, so argsort / topk alone have one answer."""
    d = torch.cdist(emb, emb).triu(1)
    gaps = d[d > 0].sort().values.diff()
    assert gaps.min() > 1e-9, float(gaps.min())


def train_alone(model: nn.Module, batches: list, loss_fn: Callable) -> tuple[Tensor, Tensor]:
    """The member alone: torch.optim.Adam on `batches`; its losses `[steps]` and the indices it
    mines at each step, `[steps, 2, batch]`."""
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses, mined = [], []
    for x, y in batches:
        opt.zero_grad()
        out = model(x)
        distinct(out[0])
        mined.append(torch.stack(mine(out[0], y)))
        loss = loss_fn(out, y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses), torch.stack(mined)


def train_all_alone(alone: list[nn.Module], batches: list, loss_fn: Callable) -> tuple:
    """Every member alone: losses `[steps, n]` and mined indices `[steps, n, 2, batch]`."""
    runs = [train_alone(m, batches, loss_fn) for m in alone]
    return torch.stack([r[0] for r in runs], 1), torch.stack([r[1] for r in runs], 1)


def assert_members(ens: vmapens.Ensemble, alone: list[nn.Module]) -> None:
    for i, m in enumerate(alone):
        got, want = ens[i].state_dict(), m.state_dict()
        assert list(got) == list(want)
        for k in want:  # the learned temperature included
            torch.testing.assert_close(got[k], want[k], **TOL, msg=f"member {i} {k}")
        # training moved every member (the test compares trained members, not initial ones)
    assert not torch.equal(ens[0].temperature, torch.tensor(0.3, dtype=torch.float64))


def recall_at_k(emb: Tensor, y: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """recall@k of every point against the others: its k most similar points (topk of the
    cosine similarity matrix, itself left out) hold one of its class."""
    sim = (emb @ emb.T).fill_diagonal_(float("-inf"))
    top = sim.topk(k, dim=1).indices
    return (y[top] == y[:, None]).any(1).double().mean(), top


# ------------------------------------------------------------------ (1) the README's manual loop


@pytest.mark.parametrize("name", list(LOSSES))
def test_manual_loop_trains_every_member_as_alone(name: str) -> None:
    loss_fn = LOSSES[name]
    x, y = data()
    batches = list(loader(x, y, seed=3))
    ens, alone = build()
    opt = vmapens.StackedAdam(ens, lr=LR)
    together, mined = [], []
    for xb, yb in batches:
        out = ens(xb)
        mined.append(torch.stack([torch.stack(mine(out[0][i], yb)) for i in range(N)]))
        loss = vmapens.per_member(loss_fn)(out, yb)
        opt.zero_grad()
        loss.sum().backward()
        opt.step()
        together.append(loss.detach())
    losses, mined_alone = train_all_alone(alone, batches, loss_fn)
    torch.testing.assert_close(torch.stack(together), losses, **TOL)
    assert torch.equal(torch.stack(mined), mined_alone)  # each member mined its own triplets
    assert_members(ens, alone)


# ----------------------------------------------- (2) make_step and fit on a P x K DataLoader


def test_make_step_on_a_pk_loader_trains_every_member_as_alone() -> None:
    x, y = data()
    batches = list(loader(x, y, seed=5))
    ens, alone = build()
    step = vmapens.make_step(ens, total, vmapens.StackedAdam(ens, lr=LR))
    together = torch.stack([step(xb, yb) for xb, yb in batches])
    losses, _ = train_all_alone(alone, batches, total)
    torch.testing.assert_close(together, losses, **TOL)
    assert_members(ens, alone)


def test_fit_on_a_pk_loader_trains_every_member_as_alone() -> None:
    x, y = data()
    ens, alone = build()
    history = vmapens.fit(ens, loader(x, y, seed=5), total, epochs=2, lr=LR, progress=False)
    same = loader(x, y, seed=5)  # the sampler's generator goes on from pass to pass, as in fit
    batches = list(same) + list(same)
    losses, _ = train_all_alone(alone, batches, total)
    assert_members(ens, alone)
    epoch_means = torch.stack([losses[:3].mean(0), losses[3:].mean(0)])
    torch.testing.assert_close(history.train_loss, epoch_means, **TOL)


# ------------------------------------------------------------ (3) per-member batches, in_dims=0


def test_per_member_pk_batches_train_each_member_on_its_own() -> None:
    x, y = data()
    own = [list(loader(x, y, seed=10 + i)) for i in range(N)]  # member i's own P x K batches
    ens, alone = build()
    step = vmapens.make_step(ens, total, vmapens.StackedAdam(ens, lr=LR), in_dims=0)
    together = torch.stack(
        [step(torch.stack([b[k][0] for b in own]), torch.stack([b[k][1] for b in own]))
         for k in range(3)]
    )  # fmt: skip
    runs = [train_alone(m, own[i], total) for i, m in enumerate(alone)]
    torch.testing.assert_close(together, torch.stack([r[0] for r in runs], 1), **TOL)
    assert_members(ens, alone)


def test_fit_reads_one_pk_loader_per_member() -> None:
    x, y = data()
    ens, alone = build()
    loaders = [loader(x, y, seed=10 + i) for i in range(N)]
    vmapens.fit(ens, loaders, total, epochs=1, in_dims=0, lr=LR, progress=False)
    for i, m in enumerate(alone):
        train_alone(m, list(loader(x, y, seed=10 + i)), total)
    assert_members(ens, alone)


# ----------------------------------------- (4) predict the embeddings, recall@k by hand


def test_predict_embeddings_give_each_members_recall_at_k_and_the_averaged_ones() -> None:
    x, y = data()
    held_x, held_y = data(seed=2, per_class=5)
    ens, alone = build()
    vmapens.fit(ens, loader(x, y, seed=5), total, epochs=1, lr=LR, progress=False)
    same = loader(x, y, seed=5)
    train_all_alone(alone, list(same), total)
    emb, cos, temperature = vmapens.predict(ens, held_x, reduce="none")
    assert emb.shape == (N, len(held_x), E) and cos.shape == (N, len(held_x), C)
    for m in alone:
        m.eval()
    with torch.no_grad():
        truth = [m(held_x) for m in alone]
    torch.testing.assert_close(temperature, torch.stack([t[2] for t in truth]), **TOL)
    for k in (1, 3):
        for i in range(N):
            distinct(truth[i][0])
            got, got_top = recall_at_k(emb[i], held_y, k)
            want, want_top = recall_at_k(truth[i][0], held_y, k)
            assert torch.equal(got_top, want_top) and torch.equal(got, want), (i, k)
        mean = F.normalize(emb.mean(0), dim=-1)  # the ensemble's averaged embedding
        want_mean = F.normalize(torch.stack([t[0] for t in truth]).mean(0), dim=-1)
        distinct(want_mean)
        torch.testing.assert_close(mean, want_mean, **TOL)
        assert torch.equal(recall_at_k(mean, held_y, k)[1], recall_at_k(want_mean, held_y, k)[1])
    # `predict`'s averaging takes one tensor per member: a tuple is refused, naming the way out
    with pytest.raises(TypeError, match=r"predict: `reduce='mean'` needs .* one tensor.*'none'"):
        vmapens.predict(ens, held_x, reduce="mean")


def test_predict_in_batches_refuses_the_per_member_temperature_naming_the_way_out() -> None:
    ens, _ = build()
    with pytest.raises(ValueError, match=r"predict:.*batch_size=None"):
        vmapens.predict(ens, data()[0], reduce="none", batch_size=10)


# --------------------------------------------------------- (5) chunk_size and backend="loop"


@pytest.mark.parametrize("module", [Embedder, ConvEmbedder])
@pytest.mark.parametrize("how", [{"chunk_size": 2}, {"backend": "loop"}], ids=["chunk", "loop"])
def test_chunks_and_the_loop_backend_train_every_member_as_alone(
    module: type[nn.Module], how: dict[str, Any]
) -> None:
    dim = D if module is Embedder else 16
    x, y = data(dim=dim)
    held_x, held_y = data(seed=2, per_class=5, dim=dim)
    batches = list(loader(x, y, seed=5))
    ens, alone = build(module, **how)
    step = vmapens.make_step(ens, total, vmapens.StackedAdam(ens, lr=LR))
    together = torch.stack([step(xb, yb) for xb, yb in batches])
    losses, _ = train_all_alone(alone, batches, total)
    torch.testing.assert_close(together, losses, **TOL)
    assert_members(ens, alone)
    emb = vmapens.predict(ens, held_x, reduce="none", chunk_size=2)[0]
    with torch.no_grad():
        for i, m in enumerate(alone):
            want = m.eval()(held_x)[0]
            torch.testing.assert_close(emb[i], want, **TOL)
            assert torch.equal(recall_at_k(emb[i], held_y, 3)[1], recall_at_k(want, held_y, 3)[1])


# ------------------------------------------- the temperature kept in the loss module instead


class SupConLoss(nn.Module):
    """The contrastive loss as a module that learns its own temperature: what a user writes
    for one model, with `torch.optim.Adam([*model.parameters(), *loss.parameters()])`."""

    def __init__(self) -> None:
        super().__init__()
        self.log_t = nn.Parameter(torch.tensor(-1.0, dtype=torch.float64))

    def forward(self, out: Out, y: Tensor) -> Tensor:
        t = self.log_t.exp().clamp(0.05, 1.0)
        return supcon((out[0], out[1], t), y)


def test_a_loss_module_with_its_own_temperature_trains_alone() -> None:
    """The truth for the two tests below: alone, the loss module's temperature learns."""
    x, y = data()
    model, loss = Embedder().double(), SupConLoss()
    opt = torch.optim.Adam([*model.parameters(), *loss.parameters()], lr=LR)
    for xb, yb in loader(x, y, seed=5):
        opt.zero_grad()
        loss(model(xb), yb).backward()
        opt.step()
    assert loss.log_t.detach().item() != -1.0


@pytest.mark.parametrize("api", ["make_step", "fit"])
def test_a_loss_module_with_a_trainable_parameter_is_named_with_the_way_out(api: str) -> None:
    # make_step and fit differentiate and step the ensemble's parameters only: the loss's own
    # learned temperature stayed as built, silently, where alone (above) it trains. A warning,
    # not an error: alone a loss module's parameters outside the optimizer (a GAN's
    # discriminator, a teacher) do not train either.
    x, y = data()
    ens, _ = build()
    loss = SupConLoss()
    with pytest.warns(UserWarning, match=rf"{api}: `loss_fn` .*log_t.*member.*requires_grad_"):
        if api == "make_step":
            step = vmapens.make_step(ens, loss, vmapens.StackedAdam(ens, lr=LR))
            step(x[:6], y[:6])
        else:
            vmapens.fit(ens, loader(x, y, seed=5), loss, lr=LR, progress=False)
    assert loss.log_t.grad is None and loss.log_t.detach().item() == -1.0
    loss.requires_grad_(False)  # the way out for a loss that is not to train: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        vmapens.make_step(ens, loss, vmapens.StackedAdam(ens, lr=LR))(x[:6], y[:6])


# ----------------------- fit with recall@k as validation metrics, and a clamped temperature


def recall_at_1(out: Out, y: Tensor) -> Tensor:
    return recall_at_k(out[0], y, 1)[0]


def recall_at_3(out: Out, y: Tensor) -> Tensor:
    return recall_at_k(out[0], y, 3)[0]


def clamp_temperature(m: nn.Module) -> None:
    """CLIP's recipe: clamp the learned temperature in place after every optimizer step."""
    if isinstance(m, Embedder):
        with torch.no_grad():
            m.temperature.clamp_(0.25, 0.32)


class ClampTemperature(vmapens.Callback):
    def on_step_end(self, ctx: Any) -> None:
        ctx.ensemble.apply(clamp_temperature)  # as `member.apply(...)` alone


def test_fit_with_recall_metrics_best_epoch_and_a_clamped_temperature_as_alone() -> None:
    x, y = data()
    held = data(seed=2, per_class=5)
    ens, alone = build()
    history = vmapens.fit(ens, loader(x, y, seed=5), total, epochs=2, lr=LR, progress=False,
                          val_data=held, metrics={"r1": recall_at_1, "r3": recall_at_3},
                          callbacks=[ClampTemperature()])  # fmt: skip
    same = loader(x, y, seed=5)
    opts = [torch.optim.Adam(m.parameters(), lr=LR) for m in alone]
    val, r1, r3, averaged, best = [], [], [], [], [(float("inf"), None)] * N
    for _ in range(2):
        for xb, yb in same:
            for m, opt in zip(alone, opts, strict=True):
                opt.zero_grad()
                total(m(xb), yb).backward()
                opt.step()
                m.apply(clamp_temperature)
        with torch.no_grad():
            outs = [m.eval()(held[0]) for m in alone]
        for m in alone:
            m.train()
        val.append(torch.stack([total(o, held[1]) for o in outs]))
        r1.append(torch.stack([recall_at_1(o, held[1]) for o in outs]))
        r3.append(torch.stack([recall_at_3(o, held[1]) for o in outs]))
        mean = tuple(torch.stack(parts).mean(0) for parts in zip(*outs, strict=True))
        averaged.append(recall_at_1(mean, held[1]))  # the metric of the averaged output
        best = [(v, {k: t.clone() for k, t in m.state_dict().items()}) if v < b[0] else b
                for v, b, m in zip(val[-1].tolist(), best, alone, strict=True)]  # fmt: skip
    torch.testing.assert_close(history.val_loss, torch.stack(val), **TOL)
    assert torch.equal(history.metrics["r1"], torch.stack(r1))
    assert torch.equal(history.metrics["r3"], torch.stack(r3))
    assert torch.equal(history.ensemble_metrics["r1"], torch.stack(averaged))
    for m, (_, state) in zip(alone, best, strict=True):
        m.load_state_dict(state)  # fit's early stopping restores each member's best epoch
    assert_members(ens, alone)
    assert ens.get_parameter("temperature").detach().tolist() == [0.32] * N  # the clamp bit
