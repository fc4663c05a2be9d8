"""User journey: an ensemble of 3 small tabular models (float64) for an imbalanced binary target.

The script a researcher writes from README.md and docs/: categorical columns embedded by an
`nn.ModuleList` of `nn.Embedding`s (one per column, different cardinalities), one of them also
`F.one_hot`-encoded; numeric columns quantile-normalised with `torch.searchsorted` against
per-member bin edges (buffers, from `torch.quantile` of each member's own reference draw) and
robust-centred by the batch median (`torch.quantile` in the forward, gradients through it);
sparsemax attention over features written by hand (`torch.sort(descending=True)`, `cumsum`,
threshold: gradients through sort); a depth-2 soft decision tree (sigmoid routing, path
probabilities by `cumprod`). Class imbalance: `BCEWithLogitsLoss(pos_weight=...)` and a
`WeightedRandomSampler` in the DataLoader given to `fit` (its own generator, resumed from a
checkpoint in a "new process"; or torch's global RNG). Then `predict` and member files.

The truth: each member a plain module built from its documented seed (tests/truth.py) and
trained alone with torch.optim (Adam; SGD with nesterov) on the same batches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, WeightedRandomSampler
from truth import TOL64, assert_members_equal, derived_seed, train_alone

import vmapens

pytestmark = [
    pytest.mark.usefixtures("float64_default"),
    # under vmap the values reach searchsorted's kernel non-contiguous (alone: contiguous)
    pytest.mark.filterwarnings("ignore:torch.searchsorted.*non-contiguous:UserWarning"),
]

N, ROWS, B, NUM, BINS = 3, 40, 8, 4, 4
CARDS, DIMS = (5, 3, 7), (3, 2, 4)
WIDTH = sum(DIMS) + 2 * NUM + CARDS[1]


def sparsemax(z: Tensor) -> Tensor:
    """Sparsemax over the last dim (Martins & Astudillo 2016), by hand."""
    zs, _ = torch.sort(z, dim=-1, descending=True)
    k = torch.arange(1, z.shape[-1] + 1, dtype=z.dtype)
    cum = zs.cumsum(-1)
    support = (1 + k * zs > cum).to(z.dtype)
    kz = support.sum(-1, keepdim=True)
    tau = ((zs * support).sum(-1, keepdim=True) - 1) / kz
    return torch.clamp(z - tau, min=0)


class Tabular(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embs = nn.ModuleList(nn.Embedding(c, d) for c, d in zip(CARDS, DIMS, strict=True))
        ref = torch.randn(32, NUM)  # this member's own reference sample for its bin edges
        q = torch.linspace(0, 1, BINS + 1)[1:-1]
        self.register_buffer("edges", torch.quantile(ref, q, dim=0).T.contiguous())
        self.num = nn.Linear(NUM, NUM)
        self.attn = nn.Linear(WIDTH, WIDTH)
        self.gates = nn.Linear(WIDTH, 3)  # depth-2 tree: root, left, right
        self.leaves = nn.Parameter(torch.randn(4, 1))

    def forward(self, cat: Tensor, num: Tensor) -> Tensor:
        emb = [e(cat[:, j]) for j, e in enumerate(self.embs)]
        bins = torch.searchsorted(self.edges, num.T.contiguous()).T.to(num.dtype) / BINS
        h = self.num(num)
        h = h / (1 + torch.quantile(h.abs(), 0.5, dim=0))  # robust scale, gradients through it
        onehot = F.one_hot(cat[:, 1], CARDS[1]).to(num.dtype)
        x = torch.cat([*emb, h, bins, onehot], -1)
        x = x * sparsemax(self.attn(x)) * WIDTH
        d = torch.sigmoid(self.gates(x))
        lvl1 = torch.stack([d[:, 0], 1 - d[:, 0]], -1).repeat_interleave(2, -1)
        lvl2 = torch.stack([d[:, 1], 1 - d[:, 1], d[:, 2], 1 - d[:, 2]], -1)
        path = torch.stack([lvl1, lvl2], -1).cumprod(-1)[..., -1]  # [B, 4] leaf probabilities
        return path @ self.leaves


def data(seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    cat = torch.stack([torch.randint(c, (ROWS,), generator=g) for c in CARDS], -1)
    num = torch.randn(ROWS, NUM, generator=g, dtype=torch.float64)
    y = (num[:, :1] + 0.5 * torch.randn(ROWS, 1, generator=g, dtype=torch.float64) > 1.0).to(
        num.dtype
    )
    return cat, num, y


CAT, NUMS, Y = data()
POS = Y.sum()
LOSS = nn.BCEWithLogitsLoss(pos_weight=(ROWS - POS) / POS)


def plain_members(seed: int = 0) -> list[Tabular]:
    out = []
    for i in range(N):
        torch.manual_seed(derived_seed(seed, "member", i))
        out.append(Tabular())
    return out


class Rows(Dataset):
    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> tuple[tuple[Tensor, Tensor], Tensor]:
        return (CAT[i], NUMS[i]), Y[i]


def loader(generator: torch.Generator | None) -> DataLoader:
    w = torch.where(Y[:, 0] > 0, (ROWS - POS) / POS, 1.0)  # balance the classes
    sampler = WeightedRandomSampler(w, ROWS, replacement=True, generator=generator)
    return DataLoader(Rows(), batch_size=B, sampler=sampler)


def batches_of(ld: DataLoader, epochs: int) -> list[Any]:
    return [((c, x), y) for _ in range(epochs) for (c, x), y in ld]


def alone(model: nn.Module, batches: list[Any], make_opt: Any) -> None:
    train_alone(model, batches, lambda out, y: LOSS(out, y), make_opt)


class Wrap(nn.Module):
    """train_alone calls model(x): x here is the (cat, num) pair."""

    def __init__(self, m: nn.Module) -> None:
        super().__init__()
        self.m = m

    def forward(self, inputs: tuple[Tensor, Tensor]) -> Tensor:
        return self.m(*inputs)


OPTS = {
    "adam": (vmapens.StackedAdam, torch.optim.Adam, dict(lr=0.03)),
    "sgd-nesterov": (
        vmapens.StackedSGD,
        torch.optim.SGD,
        dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
    ),
}


@pytest.mark.parametrize("name", list(OPTS))
def test_make_step_trains_each_member_as_alone(name: str) -> None:
    stacked, plain, kw = OPTS[name]
    ens = vmapens.Ensemble(Tabular, n=N, seed=0)
    step = vmapens.make_step(ens, LOSS, stacked(ens, **kw))
    batches = [((CAT[k : k + B], NUMS[k : k + B]), Y[k : k + B]) for k in range(0, 4 * B, B)]
    for inputs, y in batches:
        step(inputs, y)
    truth = plain_members()
    for m in truth:
        alone(Wrap(m), batches, lambda w: plain(w.parameters(), **kw))
    assert_members_equal(ens, truth, **TOL64)
    # the members differ: their own bin edges, their own weights
    assert not torch.equal(ens[0].edges, ens[1].edges)


def test_fit_with_a_weighted_sampler_resumes_its_generator_and_files_load_into_the_class(
    tmp_path: Path,
) -> None:
    kw = OPTS["sgd-nesterov"][2]
    truth = plain_members()
    batches = batches_of(loader(torch.Generator().manual_seed(7)), epochs=2)
    assert {len(y) for _, y in batches} == {B}
    for m in truth:
        alone(Wrap(m), batches, lambda w: torch.optim.SGD(w.parameters(), **kw))

    ckpt = tmp_path / "run.pt"
    first = vmapens.Ensemble(Tabular, n=N, seed=0)
    vmapens.fit(first, loader(torch.Generator().manual_seed(7)), LOSS,
                optimizer=vmapens.StackedSGD, epochs=1, checkpoint=ckpt, progress=False,
                seed=0, **kw)  # fmt: skip
    # a new process: a fresh ensemble and a fresh loader whose generator starts at seed 7;
    # the resume must put the sampler's generator where epoch 1 left it
    ens = vmapens.Ensemble(Tabular, n=N, seed=0)
    vmapens.fit(ens, loader(torch.Generator().manual_seed(7)), LOSS,
                optimizer=vmapens.StackedSGD, epochs=2, checkpoint=ckpt, progress=False,
                seed=0, **kw)  # fmt: skip
    assert_members_equal(ens, truth, **TOL64)

    out = vmapens.predict(ens, (CAT, NUMS))
    for i, m in enumerate(truth):
        m.eval()
        with torch.no_grad():
            torch.testing.assert_close(out[i], m(CAT, NUMS), **TOL64)
    # the batch median makes the output depend on the batch: batches of 16, as a loop cuts them
    mean = vmapens.predict(ens, (CAT, NUMS), reduce="mean", batch_size=16)
    with torch.no_grad():
        cut = [torch.cat([m(CAT[k : k + 16], NUMS[k : k + 16]) for k in range(0, ROWS, 16)])
               for m in truth]  # fmt: skip
    torch.testing.assert_close(mean, torch.stack(cut).mean(0), **TOL64)

    vmapens.save_members(ens, tmp_path / "members")
    for i, state in enumerate(vmapens.load_members(tmp_path / "members")):
        model = Tabular()
        model.load_state_dict(state)
        for key, value in truth[i].state_dict().items():
            torch.testing.assert_close(model.state_dict()[key], value, **TOL64, msg=key)


def test_fit_with_a_sampler_on_the_global_rng_draws_what_a_plain_loop_draws() -> None:
    kw = OPTS["adam"][2]
    ens = vmapens.Ensemble(Tabular, n=N, seed=0)
    torch.manual_seed(123)
    batches = batches_of(loader(None), epochs=2)
    truth = plain_members()
    for m in truth:
        alone(Wrap(m), batches, lambda w: torch.optim.Adam(w.parameters(), **kw))
    torch.manual_seed(123)
    # seed=None: with a DataLoader fit draws no seed of its own from the global RNG
    vmapens.fit(ens, loader(None), LOSS, epochs=2, progress=False, **kw)
    assert_members_equal(ens, truth, **TOL64)


def test_a_refused_first_step_gives_the_sampler_its_generator_back() -> None:
    def broken(out: Tensor, y: Tensor) -> Tensor:
        raise RuntimeError("boom")

    kw = OPTS["adam"][2]
    ens = vmapens.Ensemble(Tabular, n=N, seed=0)
    ld = loader(torch.Generator().manual_seed(7))
    with pytest.raises(RuntimeError, match="boom"):
        vmapens.fit(ens, ld, broken, epochs=1, progress=False, seed=0, **kw)
    # the retry on the same loader draws the first pass a fresh loader draws, as alone
    vmapens.fit(ens, ld, LOSS, epochs=1, progress=False, seed=0, **kw)
    truth = plain_members()
    batches = batches_of(loader(torch.Generator().manual_seed(7)), epochs=1)
    for m in truth:
        alone(Wrap(m), batches, lambda w: torch.optim.Adam(w.parameters(), **kw))
    assert_members_equal(ens, truth, **TOL64)
