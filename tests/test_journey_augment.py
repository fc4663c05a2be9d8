"""A user journey: a seed ensemble of 4 tiny CNNs trained with per-member data augmentation.

The recipe of published deep-ensemble papers: every member sees its own random flips, crops
and noise of the batch, mixup with its own `lam ~ Beta(alpha, alpha)` and its own permutation,
or cutmix with its own box, and trains on a two-target loss (`lam * CE(y_a) + (1 - lam) *
CE(y_b)`) or on soft targets, with label smoothing; at predict time the members' outputs are
averaged over flips (test-time augmentation). The CNN (8x8 inputs, float64): a stem conv, a
residual block with a depthwise conv and a pointwise conv, GroupNorm or BatchNorm,
AdaptiveAvgPool2d and a linear head.

The augmentation is drawn in the test from seeded generators, outside the ensemble, stacked
`[n, B, ...]` and fed with `in_dims=0` (docs/index.md "Per-member data"), so the naive loop
(each member a plain module trained alone with `torch.optim`) sees exactly the same batches:
through `make_step`, through `fit` (tensor data, and one DataLoader per member whose
`collate_fn` augments from its own generator, docs/fit.md "Data, epochs and steps") and
through a hand-written loop. Augmentation inside the member's forward draws from torch's
global RNG: with `randomness="same"` each member draws what it draws alone from the same RNG
state (docs/semantics.md, "Randomness in the forward pass"), so the naive loop replays each
step's RNG state; with `"different"` the members' draws differ (equal in distribution only).

Convs before a norm (the depthwise conv too, before the pointwise one) have no bias: its true
gradient is 0 (BatchNorm) and Adam steps on its round-off (docs/semantics.md, "What differs
from training alone").

A `for` loop over a shuffling DataLoader runs it to its end, where torch's RandomSampler draws
one more permutation from the loader's generator: the naive loop below reads every loader to
its end each pass, as `fit` does, or its next pass would get another order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from truth import assert_members_equal, batch_plan, resample

import vmapens

pytestmark = pytest.mark.usefixtures("float64_default")

N, B, C, SIDE = 4, 6, 5, 8
ALPHA = 0.4
LRS = [1e-2, 3e-3, 2e-2, 5e-3]
TOL = {"rtol": 1e-9, "atol": 1e-10}
SMOOTH = nn.CrossEntropyLoss(label_smoothing=0.1)


class Net(nn.Module):
    def __init__(self, norm: str = "gn") -> None:
        super().__init__()

        def make_norm() -> nn.Module:
            return nn.GroupNorm(2, 8) if norm == "gn" else nn.BatchNorm2d(8)

        self.stem = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.n1 = make_norm()
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False)  # depthwise
        self.pw = nn.Conv2d(8, 8, 1, bias=False)
        self.n2 = make_norm()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(8, C)

    def forward(self, x: Tensor) -> Tensor:
        h = F.relu(self.n1(self.stem(x)))
        h = F.relu(h + self.n2(self.pw(self.dw(h))))
        return self.head(self.pool(h).flatten(1))


def bn_net() -> nn.Module:
    return Net("bn")


def images(count: int, seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(count, 3, SIDE, SIDE, generator=g), torch.randint(C, (count,), generator=g)


def augment(x: Tensor, g: torch.Generator) -> Tensor:
    """Random horizontal flips, random 8x8 crops of the reflect-padded image, noise."""
    b = x.shape[0]
    flip = (torch.rand(b, generator=g) < 0.5)[:, None, None, None]
    x = torch.where(flip, x.flip(-1), x)
    padded = F.pad(x, (1, 1, 1, 1), mode="reflect")
    dy, dx = torch.randint(3, (2, b), generator=g)
    x = torch.stack([padded[k, :, dy[k] : dy[k] + SIDE, dx[k] : dx[k] + SIDE] for k in range(b)])
    return x + 0.05 * torch.randn(x.shape, generator=g)


def beta(g: torch.Generator, alpha: float = ALPHA) -> float:
    """lam ~ Beta(alpha, alpha), seeded from `g` (Beta's `sample()` reads the global RNG)."""
    seed = int(torch.randint(2**62, (), generator=g))
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return float(torch.distributions.Beta(alpha, alpha).sample())


def mixup(x: Tensor, y: Tensor, g: torch.Generator) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
    lam = beta(g)
    perm = torch.randperm(x.shape[0], generator=g)
    return lam * x + (1 - lam) * x[perm], (y, y[perm], torch.tensor(lam))


def cutmix(x: Tensor, y: Tensor, g: torch.Generator) -> tuple[Tensor, Tensor]:
    """A per-call box; soft targets weighted by the box's true area."""
    lam = beta(g, 1.0)
    perm = torch.randperm(x.shape[0], generator=g)
    cut = int(SIDE * math.sqrt(1 - lam))
    cy, cx = (int(v) for v in torch.randint(SIDE, (2,), generator=g))
    y0, y1 = max(cy - cut // 2, 0), min(cy + cut // 2, SIDE)
    x0, x1 = max(cx - cut // 2, 0), min(cx + cut // 2, SIDE)
    out = x.clone()
    out[:, :, y0:y1, x0:x1] = x[perm][:, :, y0:y1, x0:x1]
    kept = 1 - (y1 - y0) * (x1 - x0) / SIDE**2
    soft = kept * F.one_hot(y, C) + (1 - kept) * F.one_hot(y[perm], C)
    return out, soft.double()


def two_targets(out: Tensor, target: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    y_a, y_b, lam = target
    return lam * SMOOTH(out, y_a) + (1 - lam) * SMOOTH(out, y_b)


def member_batches(steps: int, seed: int, how: str = "mixup") -> list[Any]:
    """`steps` batches `(x [n, B, ...], targets [n, ...])`: the same images, each member its
    own augmentation, mixup (two targets and lam) or cutmix (soft targets)."""
    out = []
    for k in range(steps):
        x, y = images(B, seed * 1000 + k)
        xs, ts = [], []
        for i in range(N):
            g = torch.Generator().manual_seed(seed * 1000 + 100 * k + i)
            a = augment(x, g)
            a, t = mixup(a, y, g) if how == "mixup" else cutmix(a, y, g)
            xs.append(a)
            ts.append(t)
        if how == "mixup":
            targets: Any = tuple(torch.stack(col) for col in zip(*ts))
        else:
            targets = torch.stack(ts)
        out.append((torch.stack(xs), targets))
    return out


def member_slice(tree: Any, i: int) -> Any:
    if isinstance(tree, Tensor):
        return tree[i]
    return type(tree)(member_slice(t, i) for t in tree)


def train_alone(
    models: list[nn.Module],
    data: list[Any],
    loss_fn: Callable[[Tensor, Any], Tensor],
    make_opt: Callable[[int, nn.Module], torch.optim.Optimizer],
) -> list[torch.optim.Optimizer]:
    """The naive loop: member i alone on its own slice of every batch."""
    opts = []
    for i, m in enumerate(models):
        opt = make_opt(i, m)
        m.train()
        for x, t in data:
            opt.zero_grad()
            loss_fn(m(x[i]), member_slice(t, i)).backward()
            opt.step()
        opts.append(opt)
    return opts


def adam(i: int, m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(m.parameters(), lr=LRS[i])


def assert_members(ens: vmapens.Ensemble, models: list[nn.Module]) -> None:
    assert_members_equal(ens, models, **TOL)


@pytest.mark.parametrize(
    ("factory", "chunk"),
    [(Net, None), (bn_net, None), (bn_net, 3)],
    ids=["groupnorm", "batchnorm", "batchnorm-chunked"],
)
def test_make_step_with_per_member_mixup_two_targets_and_label_smoothing(
    factory: Callable[[], nn.Module], chunk: int | None
) -> None:
    ens = vmapens.Ensemble(factory, n=N, seed=0, chunk_size=chunk)
    models = ens.unstack()
    step = vmapens.make_step(ens, two_targets, vmapens.StackedAdam(ens, lr=LRS), in_dims=0)
    data = member_batches(3, seed=1)
    for x, t in data:
        step(x, t)
    train_alone(models, data, two_targets, adam)
    assert_members(ens, models)
    # every member drew its own lam and its own permutation
    lam = data[0][1][2]
    assert len(set(lam.tolist())) == N


class Augmenting:
    """A `collate_fn` that augments and mixes each batch from its own generator, as a data
    pipeline does; it counts its calls."""

    def __init__(self, seed: int) -> None:
        self.g = torch.Generator().manual_seed(seed)
        self.calls = 0

    def __call__(self, rows: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Any]:
        self.calls += 1
        x, y = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
        return mixup(augment(x, self.g), y, self.g)


def member_loaders(seed: int) -> list[DataLoader]:
    """One DataLoader per member: its own shuffle order and its own augmentation."""
    x, y = images(3 * B, seed)
    return [
        DataLoader(
            TensorDataset(x, y),
            batch_size=B,
            shuffle=True,
            generator=torch.Generator().manual_seed(seed + 10 * i),
            collate_fn=Augmenting(seed + 10 * i + 1),
        )
        for i in range(N)
    ]


@pytest.mark.parametrize("factory", [Net, bn_net], ids=["groupnorm", "batchnorm"])
def test_fit_with_one_augmenting_dataloader_per_member(factory: Callable[[], nn.Module]) -> None:
    ens = vmapens.Ensemble(factory, n=N, seed=0)
    models = ens.unstack()
    loaders = member_loaders(seed=3)
    vmapens.fit(ens, loaders, two_targets, epochs=2, lr=LRS, in_dims=0, progress=False, seed=0)
    assert [loader.collate_fn.calls for loader in loaders] == [6] * N  # 2 epochs x 3 batches
    alone = member_loaders(seed=3)
    for i, m in enumerate(models):
        opt = torch.optim.Adam(m.parameters(), lr=LRS[i])
        m.train()
        for _ in range(2):
            for x, t in alone[i]:
                opt.zero_grad()
                two_targets(m(x), t).backward()
                opt.step()
    assert_members(ens, models)


class AugmentInside(Net):
    """Augmentation in the member's forward, train mode only: flips, noise, then mixup with
    lam ~ Beta(alpha, alpha) and a permutation, all from torch's global RNG. It returns the
    logits, the permutation and lam, which the loss reads."""

    def __init__(self, norm: str = "gn", beta: str = "gamma") -> None:
        super().__init__(norm)
        self.beta = beta

    def forward(self, x: Tensor) -> Any:  # type: ignore[override]
        if not self.training:
            return super().forward(x)
        flip = torch.rand(x.shape[0], 1, 1, 1) < 0.5
        x = torch.where(flip, x.flip(-1), x) + 0.05 * torch.randn_like(x)
        if self.beta == "gamma":  # Beta(a, a) as G1 / (G1 + G2), Gi ~ Gamma(a, 1)
            gam = torch.distributions.Gamma(torch.full((2,), ALPHA), torch.tensor(1.0)).sample()
            lam = gam[0] / gam.sum()
        else:
            lam = torch.distributions.Beta(torch.tensor(ALPHA), torch.tensor(ALPHA)).sample()
        perm = torch.randperm(x.shape[0])
        return super().forward(lam * x + (1 - lam) * x[perm]), perm, lam


def inside_loss(out: tuple[Tensor, Tensor, Tensor], y: Tensor) -> Tensor:
    logits, perm, lam = out
    return two_targets(logits, (y, y[perm], lam))


@pytest.mark.parametrize(
    ("backend", "beta", "chunk"),
    [
        ("vmap", "gamma", None),
        ("vmap", "gamma", 3),
        ("loop", "gamma", None),
        ("loop", "beta", None),
    ],
)
def test_augmentation_inside_the_forward_with_same_randomness_draws_as_alone(
    backend: str, beta: str, chunk: int | None
) -> None:
    def factory() -> nn.Module:
        return AugmentInside("bn", beta)

    ens = vmapens.Ensemble(
        factory, n=N, seed=0, randomness="same", backend=backend, chunk_size=chunk
    )
    models = ens.unstack()
    step = vmapens.make_step(ens, inside_loss, vmapens.StackedAdam(ens, lr=LRS))
    data, states = [images(B, 20 + k) for k in range(3)], []
    for x, y in data:
        states.append(torch.get_rng_state())
        step(x, y)
    after = torch.get_rng_state()
    for i, m in enumerate(models):  # each step from the RNG state the ensemble's started from
        opt = torch.optim.Adam(m.parameters(), lr=LRS[i])
        for state, (x, y) in zip(states, data, strict=True):
            torch.set_rng_state(state)
            opt.zero_grad()
            inside_loss(m(x), y).backward()
            opt.step()
    assert_members(ens, models)
    # the RNG went on as one member's draws per step take it, as a plain loop's would
    torch.set_rng_state(states[-1])
    models[0](data[-1][0])
    assert torch.equal(torch.get_rng_state(), after)


def test_beta_sample_inside_the_forward_under_vmap_is_refused_naming_the_way_out() -> None:
    ens = vmapens.Ensemble(lambda: AugmentInside("gn", "beta"), n=N, seed=0)
    x, _ = images(B, 0)
    before = [p.clone() for p in ens.parameters()]
    # The ways out it names: lam drawn outside, a Gamma ratio (the "gamma" runs above), the loop.
    with pytest.raises(RuntimeError, match=r"Beta or Dirichlet.*Gamma.*backend='loop'"):
        ens(x)
    assert all(torch.equal(p, q) for p, q in zip(ens.parameters(), before, strict=True))


def test_augmentation_inside_the_forward_with_different_randomness_differs_per_member() -> None:
    """`"different"`: each member its own flips, noise, lam and permutation (equal to alone's
    in distribution only, docs/semantics.md), and two calls never reuse them."""
    ens = vmapens.Ensemble(Net, n=N, seed=0)
    inside = vmapens.Ensemble.from_modules([AugmentInside("gn") for _ in range(N)])
    inside.load_state_dict(ens.state_dict())  # the same members: only the draws differ
    x, _ = images(B, 0)
    _, perm, lam = inside(x)
    assert len(set(lam.tolist())) == N and len({tuple(p.tolist()) for p in perm}) > 1
    _, perm2, lam2 = inside(x)
    assert not torch.equal(lam, lam2)


class GlobalAugmenting:
    """A `collate_fn` that augments and mixes from torch's global RNG, as torchvision's
    transforms do: docs/fit.md's advice for a run that resumes exactly."""

    def __call__(self, rows: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Any]:
        x, y = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
        g = torch.default_generator
        return mixup(augment(x, g), y, g)


def global_loaders(seed: int) -> list[DataLoader]:
    x, y = images(3 * B, seed)
    return [
        DataLoader(
            TensorDataset(x, y),
            batch_size=B,
            shuffle=True,
            generator=torch.Generator().manual_seed(seed + 10 * i),
            collate_fn=GlobalAugmenting(),
        )
        for i in range(N)
    ]


def stop_after_first_epoch(history: vmapens.History) -> None:
    if history.epochs == 1:
        raise KeyboardInterrupt


@pytest.mark.parametrize("steps", [None, 2], ids=["passes", "mid-pass"])
def test_fit_resumes_per_member_global_rng_augmentation_as_the_uninterrupted_naive_loop(
    tmp_path: Any, steps: int | None
) -> None:
    """Per-member loaders whose augmentation draws from the global RNG, read member by member
    (docs/fit.md), interrupted after epoch 1 and resumed from the checkpoint with new loaders
    (with `steps=2`, mid-pass: the resumed pass skips the batches used): every member ends
    where it ends alone on the batches a plain loop reading the loaders in that order gets."""
    ckpt = tmp_path / "run.pt"
    opts = dict(epochs=3, steps=steps, lr=LRS, in_dims=0, progress=False, seed=0, checkpoint=ckpt)
    torch.manual_seed(5)
    ens = vmapens.Ensemble(bn_net, n=N, seed=0)
    models = ens.unstack()
    with pytest.raises(KeyboardInterrupt):
        vmapens.fit(ens, global_loaders(3), two_targets, callbacks=[stop_after_first_epoch],
                    **opts)  # fmt: skip
    torch.manual_seed(99)  # a new process: the checkpoint gives the global RNG back
    resumed = vmapens.Ensemble(bn_net, n=N, seed=0)
    vmapens.fit(resumed, global_loaders(3), two_targets, **opts)

    torch.manual_seed(5)
    loaders, data = global_loaders(3), []
    for _ in range(3):  # each pass: member 0's iterator and batch, then member 1's, ...
        iterators: list[Iterator[Any]] = []
        while True:
            row = []
            for i in range(N):
                if len(iterators) == i:
                    iterators.append(iter(loaders[i]))
                row.append(next(iterators[i], None))  # to the end, as a `for` loop goes
            if row[0] is None:
                break
            data.append(row)
    for i, m in enumerate(models):
        opt = torch.optim.Adam(m.parameters(), lr=LRS[i])
        m.train()
        for row in data[: 3 * (steps or 3)]:
            x, t = row[i]
            opt.zero_grad()
            two_targets(m(x), t).backward()
            opt.step()
    assert_members(resumed, models)


def tta(model: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """Test-time augmentation: class probabilities averaged over the image and its flip."""
    return (model(x).softmax(-1) + model(x.flip(-1)).softmax(-1)) / 2


def test_hand_written_loop_with_cutmix_soft_targets_sgd_and_tta_validation_midway() -> None:
    """BatchNorm members, cutmix with a box per member and soft targets (label smoothing on
    top), `ens(xs, in_dims=0)`, `per_member(loss, in_dims=(0, 0))`, the sum backward, a
    StackedSGD step (Nesterov, per-member lr and weight decay); after step 2 a TTA validation
    in eval mode (running statistics), then back to training."""
    lrs, decays = [0.1, 0.05, 0.2, 0.02], [1e-3, 0.0, 1e-2, 1e-4]
    ens = vmapens.Ensemble(bn_net, n=N, seed=0)
    models = ens.unstack()
    opt = vmapens.StackedSGD(ens, lr=lrs, momentum=0.9, nesterov=True, weight_decay=decays)
    loss_fn = vmapens.per_member(SMOOTH, in_dims=(0, 0))
    data = member_batches(4, seed=2, how="cutmix")
    xv, _ = images(7, 50)
    midway = None
    for k, (xs, soft) in enumerate(data):
        opt.zero_grad()
        loss_fn(ens(xs, in_dims=0), soft).sum().backward()
        opt.step()
        if k == 1:
            ens.eval()
            with torch.no_grad():
                midway = (tta(ens, xv), vmapens.predict(ens, xv, softmax=True))
            ens.train()
    want_mid = []
    for i, m in enumerate(models):
        sgd = torch.optim.SGD(
            m.parameters(), lr=lrs[i], momentum=0.9, nesterov=True, weight_decay=decays[i]
        )
        for k, (xs, soft) in enumerate(data):
            sgd.zero_grad()
            SMOOTH(m(xs[i]), soft[i]).backward()
            sgd.step()
            if k == 1:
                m.eval()
                with torch.no_grad():
                    want_mid.append((tta(m, xv), m(xv).softmax(-1)))
                m.train()
    assert midway is not None and ens.training
    torch.testing.assert_close(midway[0], torch.stack([w[0] for w in want_mid]), **TOL)
    torch.testing.assert_close(midway[1], torch.stack([w[1] for w in want_mid]), **TOL)
    assert_members(ens, models)


class TTANet(Net):
    """Averages its logits over flips in eval mode when `tta` is set."""

    def __init__(self, norm: str = "bn") -> None:
        super().__init__(norm)
        self.tta = False

    def forward(self, x: Tensor) -> Tensor:
        if self.training or not self.tta:
            return super().forward(x)
        return (super().forward(x) + super().forward(x.flip(-1))) / 2


def test_predict_with_test_time_augmentation_outside_and_inside_the_forward() -> None:
    ens = vmapens.Ensemble(TTANet, n=N, seed=0)
    step = vmapens.make_step(ens, two_targets, vmapens.StackedAdam(ens, lr=LRS), in_dims=0)
    for x, t in member_batches(2, seed=4):
        step(x, t)
    models = ens.unstack()  # the trained members, as plain modules
    x, _ = images(9, 60)
    views = torch.stack([x, x.flip(-1), x.flip(-2)])
    # outside: one predict per view, averaged
    got = torch.stack([vmapens.predict(ens, v, softmax=True) for v in views]).mean(0)
    for i, m in enumerate(models):
        m.eval()
        with torch.no_grad():
            want = torch.stack([m(v).softmax(-1) for v in views]).mean(0)
        torch.testing.assert_close(got[i], want, **TOL)
    mean = vmapens.predict(ens, x, reduce="mean", softmax=True, batch_size=4)
    with torch.no_grad():
        alone = torch.stack([m(x).softmax(-1) for m in models]).mean(0)
    torch.testing.assert_close(mean, alone, **TOL)
    # per-member views (`in_dims=0`), in batches of 2 samples: member i sees view i % 3
    per = vmapens.predict(ens, views[torch.arange(N) % 3], in_dims=0, batch_size=2)
    with torch.no_grad():
        torch.testing.assert_close(
            per, torch.stack([m(views[i % 3]) for i, m in enumerate(models)]), **TOL
        )
    # inside: a flag set on the template reaches every member, and `ens[i]`
    ens.template.tta = True
    inside = vmapens.predict(ens, x, reduce="none")
    assert ens[0].tta and ens.training
    with torch.no_grad():
        for i, m in enumerate(models):
            m.tta = True
            torch.testing.assert_close(inside[i], m(x), **TOL)
            torch.testing.assert_close(inside[i], ens[i].eval()(x), **TOL)


def per_sample_mix(out: Tensor, target: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    """Mixup with one lam per sample (a two-target loss that `fit` cuts row by row)."""
    y_a, y_b, lam = target
    ce = nn.functional.cross_entropy
    a = ce(out, y_a, reduction="none", label_smoothing=0.1)
    b = ce(out, y_b, reduction="none", label_smoothing=0.1)
    return (lam * a + (1 - lam) * b).mean()


@pytest.mark.parametrize("bootstrap", [False, True])
def test_fit_on_stacked_pre_augmented_tensors_with_per_sample_mixup_targets(
    bootstrap: bool,
) -> None:
    """Each member's own augmented copy of the data set, stacked `[n, S, ...]`, targets a tuple
    `(y_a, y_b, lam)` of `[n, S]` tensors cut by the same rows (docs/fit.md), 2 epochs of
    shuffled batches of 4 (the last one 2 rows); with `bootstrap=True` member i's batch is the
    rows `r_i[order[...]]` of its own slice (its resample `r_i`, docs/fit.md "Bagging")."""
    x, y = images(10, 70)
    xs, targets = [], []
    for i in range(N):
        g = torch.Generator().manual_seed(700 + i)
        a = augment(x, g)
        lam = torch.tensor([beta(g) for _ in range(len(x))])
        perm = torch.randperm(len(x), generator=g)
        xs.append(lam[:, None, None, None] * a + (1 - lam[:, None, None, None]) * a[perm])
        targets.append((y, y[perm], lam))
    data = (torch.stack(xs), tuple(torch.stack(col) for col in zip(*targets)))
    ens = vmapens.Ensemble(bn_net, n=N, seed=0)
    models = ens.unstack()
    history = vmapens.fit(ens, data, per_sample_mix, epochs=2, batch_size=4, lr=LRS, in_dims=0,
                          bootstrap=bootstrap, progress=False, seed=3)  # fmt: skip
    plan = batch_plan(10, 4, 6, seed=3)
    assert [len(rows) for rows in plan] == [4, 4, 2, 4, 4, 2]
    own = [resample(10, 3, i) if bootstrap else torch.arange(10) for i in range(N)]
    rows = [torch.stack([own[i][r] for i in range(N)]) for r in plan]  # [n, b] per step
    batches = [
        (
            torch.stack([data[0][i, r[i]] for i in range(N)]),
            tuple(torch.stack([t[i, r[i]] for i in range(N)]) for t in data[1]),
        )
        for r in rows
    ]
    train_alone(models, batches, per_sample_mix, adam)
    assert_members(ens, models)
    assert history.train_loss.shape == (2, N)


def mix_or_plain(out: Tensor, target: Any) -> Tensor:
    """The mixup loss on training batches, plain smoothed CE on validation labels: `fit`
    scores `val_data` with `loss_fn` too."""
    return two_targets(out, target) if isinstance(target, (tuple, list)) else SMOOTH(out, target)


def test_fit_with_per_member_augmented_validation_views_and_best_epoch_restore() -> None:
    """Each member validated on its own augmented view of the validation images
    (`in_dims=(0, 0)`): its validation loss each epoch, and its best epoch given back, are
    those of the member alone. Metrics need shared `val_data`: refused before training."""
    x, y = images(9, 60)
    views = torch.stack([augment(x, torch.Generator().manual_seed(80 + i)) for i in range(N)])
    val = (views, y.expand(N, 9).clone())
    ens = vmapens.Ensemble(bn_net, n=N, seed=0)
    models = ens.unstack()
    before = [p.clone() for p in ens.parameters()]
    with pytest.raises(ValueError, match="`metrics` need shared `val_data`"):
        vmapens.fit(ens, member_loaders(3), mix_or_plain, lr=LRS, in_dims=(0, 0), val_data=val,
                    metrics={"acc": lambda o, t: (o.argmax(-1) == t).double().mean()},
                    progress=False, seed=0)  # fmt: skip
    assert all(torch.equal(p, q) for p, q in zip(ens.parameters(), before, strict=True))
    history = vmapens.fit(ens, member_loaders(3), mix_or_plain, epochs=3, lr=LRS,
                          in_dims=(0, 0), val_data=val, progress=False, seed=0)  # fmt: skip
    loaders, val_loss, best = member_loaders(3), torch.zeros(3, N), []
    for i, m in enumerate(models):
        opt = torch.optim.Adam(m.parameters(), lr=LRS[i])
        kept: dict[str, Tensor] = {}
        for epoch in range(3):
            m.train()
            for xb, t in loaders[i]:
                opt.zero_grad()
                two_targets(m(xb), t).backward()
                opt.step()
            m.eval()
            with torch.no_grad():
                val_loss[epoch, i] = SMOOTH(m(views[i]), val[1][i])
            if epoch == 0 or val_loss[epoch, i] < val_loss[:epoch, i].min():
                kept = {k: v.clone() for k, v in m.state_dict().items()}
        best.append(int(val_loss[:, i].argmin()))
        m.load_state_dict(kept)
    torch.testing.assert_close(history.val_loss, val_loss, **TOL)
    assert history.best_epoch.tolist() == best and len(set(best)) > 1
    assert_members(ens, models)


def test_a_box_drawn_per_member_inside_the_forward_is_refused_naming_the_loop_backend() -> None:
    """Cutmix in the forward with `randomness="different"`: a box per member as Python ints
    (`.item()` under vmap) cannot be batched; refused with the way out, nothing changed."""

    class CutInside(Net):
        def forward(self, x: Tensor) -> Tensor:
            if self.training:
                cy, cx = torch.randint(SIDE - 3, (2,))
                x = x.clone()
                x[:, :, cy : cy + 3, cx : cx + 3] = 0
            return super().forward(x)

    ens = vmapens.Ensemble(CutInside, n=N, seed=0)
    step = vmapens.make_step(ens, SMOOTH, vmapens.StackedAdam(ens, lr=LRS))
    before = [p.clone() for p in ens.parameters()]
    x, y = images(B, 0)
    with pytest.raises(RuntimeError, match="cannot be batched.*backend='loop'"):
        step(x, y)
    assert all(torch.equal(p, q) for p, q in zip(ens.parameters(), before, strict=True))


@pytest.mark.parametrize("backend", ["vmap", "loop"])
def test_a_float_lam_in_per_member_targets_gets_the_steps_own_error(backend: str) -> None:
    ens = vmapens.Ensemble(Net, n=N, seed=0, backend=backend)
    step = vmapens.make_step(ens, two_targets, vmapens.StackedAdam(ens, lr=LRS), in_dims=0)
    xs, (y_a, y_b, _) = member_batches(1, seed=1)[0]
    with pytest.raises(TypeError, match="`targets` must be a tensor or a tuple.*holding float"):
        step(xs, (y_a, y_b, 0.3))  # lam as a Python float, as `np.random.beta` gives it
