"""A user journey: MoCo v2 / BYOL members, written the way the reference code writes them.

(1) MoCo: a query encoder trained by InfoNCE (`torch.einsum`, a temperature, `F.cross_entropy`
against zero labels) and a key encoder (`requires_grad=False`) updated in `forward` under
`torch.no_grad()` by momentum, the reference's `param_k.data = param_k.data * m + param_q.data
* (1 - m)` or its in-place `param_k.data.mul_(m).add_(param_q.data, alpha=1 - m)`; a queue of
negatives in a `[dim, K]` buffer and a long `queue_ptr` buffer, enqueued with
`ptr = int(self.queue_ptr)` and a slice assignment. Under vmap `.data` and `int(...)` (an
`.item()`) are refused naming `backend="loop"` (docs/semantics.md "What vmap cannot batch",
"How vmapens checks itself"), and the reference code then trains as alone with that backend.
Written without them (the momentum an in-place edit under `torch.no_grad()`, the pointer a
one-hot mask, a roll, or an index `queue[:, idx] = keys.T`), it runs under vmap, each member with its own momentum `m` in a buffer
(a float attribute that differs per member is refused, naming the buffer as the way out);
`fit` with a checkpoint, resumed after an interrupt, restores the queue and the pointer, and
member files load into a plain module.

(2) BYOL: an online network with a predictor, a target network updated by momentum, the
symmetric loss against the stop-gradient target projections.

The truth: each member a plain module (built after `torch.manual_seed(k)`) written as the
reference writes it (`.data`, `int(self.queue_ptr)`, a float `m`), trained alone with
`torch.optim.Adam` on the same batches, float64; only the order of sums may differ, hence TOL.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from truth import batch_plan, float64_batches

import vmapens

N, B, D, DIM, K, TAU, LR = 3, 4, 5, 4, 8, 0.2, 1e-2
MS = (0.5, 0.9, 0.99)  # a momentum sweep: one m per member
TOL: dict[str, Any] = {"rtol": 1e-9, "atol": 1e-10}  # float64, sums in another order


class MoCo(nn.Module):
    """`momentum`: "data" (`.data =`), "data_inplace" (`.data.mul_().add_()`), "buffer" (an
    in-place edit under no_grad, `m` a buffer). `queue`: "item" (`int(self.queue_ptr)`),
    "onehot" (a mask from the pointer), "roll" (newest keys first), "index" (`queue[:, idx]`)."""

    def __init__(self, m: float = 0.9, momentum: str = "data", queue: str = "item") -> None:
        super().__init__()
        self.momentum, self.queue_kind = momentum, queue
        self.encoder_q = nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, DIM))
        self.encoder_k = copy.deepcopy(self.encoder_q)
        for p in self.encoder_k.parameters():
            p.requires_grad = False
        if momentum == "buffer":
            self.register_buffer("m", torch.tensor(m, dtype=torch.float64))
        else:
            self.m = m
        self.register_buffer("queue", F.normalize(torch.randn(DIM, K), dim=0))
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    @torch.no_grad()
    def _momentum_update_key_encoder(self) -> None:
        m = self.m
        for pq, pk in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            if self.momentum == "data":
                pk.data = pk.data * m + pq.data * (1.0 - m)
            elif self.momentum == "data_inplace":
                pk.data.mul_(m).add_(pq.data, alpha=1.0 - m)
            else:
                pk.mul_(m).add_(pq * (1 - m))

    @torch.no_grad()
    def _dequeue_and_enqueue(self, keys: Tensor) -> None:
        bs = keys.shape[0]
        if self.queue_kind == "item":  # the reference
            ptr = int(self.queue_ptr)
            self.queue[:, ptr : ptr + bs] = keys.T
            self.queue_ptr[0] = (ptr + bs) % K
            return
        idx = (self.queue_ptr + torch.arange(bs)) % K
        if self.queue_kind == "onehot":
            onehot = F.one_hot(idx, K).to(keys.dtype)  # [bs, K]
            self.queue.copy_(torch.where(onehot.sum(0) > 0, keys.T @ onehot, self.queue))
        elif self.queue_kind == "roll":
            self.queue.copy_(torch.roll(self.queue, bs, dims=1))
            self.queue[:, :bs] = keys.T
        else:
            self.queue[:, idx] = keys.T
        self.queue_ptr.copy_((self.queue_ptr + bs) % K)

    def forward(self, im_q: Tensor, im_k: Tensor) -> Tensor:
        q = F.normalize(self.encoder_q(im_q), dim=1)
        with torch.no_grad():
            self._momentum_update_key_encoder()
            k = F.normalize(self.encoder_k(im_k), dim=1)
        l_pos = torch.einsum("nc,nc->n", [q, k]).unsqueeze(-1)
        l_neg = torch.einsum("nc,ck->nk", [q, self.queue.clone().detach()])
        logits = torch.cat([l_pos, l_neg], dim=1) / TAU
        self._dequeue_and_enqueue(k)
        return logits


def info_nce(logits: Tensor, _target: Tensor | None = None) -> Tensor:
    return F.cross_entropy(logits, torch.zeros(logits.shape[0], dtype=torch.long))


def moco(momentum: str = "data", queue: str = "item", m: float = 0.9) -> Any:
    return lambda: MoCo(m, momentum, queue).double()


def reference_alone(ms: tuple[float, ...] = (0.9,) * N, queue: str = "item") -> list[nn.Module]:
    out = []
    for k, m in enumerate(ms):
        torch.manual_seed(k)
        out.append(moco("data", queue, m)())
    return out


def pairs(count: int, rows: int = B, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    """Two augmented views per batch: float64 standard normals, batch after batch."""
    return float64_batches(count, rows, D, D, seed)


def train_alone(models: list[nn.Module], batches: list[tuple[Tensor, Tensor]], loss=info_nce):
    losses = []
    for m in models:
        opt = torch.optim.Adam(m.parameters(), lr=LR)  # the frozen key encoder gets no grad
        row = []
        for x1, x2 in batches:
            opt.zero_grad()
            loss_value = loss(m(x1, x2))
            loss_value.backward()
            opt.step()
            row.append(loss_value.detach())
        losses.append(torch.stack(row))
    return torch.stack(losses, 1)  # [steps, N]


def assert_members(ens: vmapens.Ensemble, models: list[nn.Module], skip: tuple = ()) -> None:
    for i, m in enumerate(models):
        got, want = ens[i].state_dict(), m.state_dict()
        assert set(got) - set(skip) == set(want) - set(skip)
        for k in want:
            if k not in skip:
                torch.testing.assert_close(got[k], want[k], **TOL, msg=f"member {i} {k}")


def dummy(rows: int = B) -> Tensor:
    return torch.zeros(rows, dtype=torch.float64)


# ----------------------------------------------------------------------------- (1) MoCo


@pytest.mark.parametrize(
    ("momentum", "queue", "names"),
    [("data", "item", ".data"), ("data_inplace", "item", ".data"), ("buffer", "item", ".item()")],
)
def test_the_reference_code_under_vmap_is_refused_naming_backend_loop(
    momentum: str, queue: str, names: str
) -> None:
    ens = vmapens.Ensemble(moco(momentum, queue), n=N, seeds=range(N))
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    step = vmapens.make_step(ens, info_nce, vmapens.StackedAdam(ens, lr=LR))
    with pytest.raises(RuntimeError, match="backend='loop'") as err:
        step(pairs(1)[0], dummy())
    assert names in str(err.value) and str(err.value).startswith("step:")
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k  # nothing changed


@pytest.mark.parametrize("momentum", ["data", "data_inplace"])
def test_the_reference_code_with_backend_loop_matches_each_member_alone(momentum: str) -> None:
    batches = pairs(3)  # K = 2 batches: the pointer wraps
    ens = vmapens.Ensemble(moco(momentum), n=N, seeds=range(N), backend="loop")
    step = vmapens.make_step(ens, info_nce, vmapens.StackedAdam(ens, lr=LR))
    losses = torch.stack([step(b, dummy()) for b in batches])
    alone = reference_alone()
    want = train_alone(alone, batches)
    torch.testing.assert_close(losses, want, **TOL)
    assert_members(ens, alone)  # key encoder, queue and pointer included
    assert ens.stacked_buffers()["queue_ptr"].flatten().tolist() == [4] * N
    assert all(p.grad is None for p in ens.template.encoder_k.parameters())


@pytest.mark.parametrize(
    ("queue", "chunk"),
    [("onehot", None), ("onehot", 2), ("roll", None), ("index", None), ("index", 2)],
)
def test_rewritten_without_data_and_item_runs_under_vmap_each_member_its_own_m(
    queue: str, chunk: int | None
) -> None:
    # a float m per member through the factory is refused, naming the buffer way out
    ms = iter(MS)
    with pytest.raises(ValueError, match=r"`m` is 0.9 vs 0.5.*buffer"):
        vmapens.Ensemble(lambda: MoCo(next(ms)).double(), n=N)
    ens = vmapens.Ensemble(moco("buffer", queue), n=N, seeds=range(N), chunk_size=chunk)
    ens.stacked_buffers()["m"].copy_(
        torch.tensor(MS, dtype=torch.float64)
    )  # docs/semantics.md: set in place
    batches = pairs(3)
    step = vmapens.make_step(ens, info_nce, vmapens.StackedAdam(ens, lr=LR))
    losses = torch.stack([step(b, dummy()) for b in batches])
    # the one-hot and index rewrites keep the reference's queue order: their truth is the
    # reference itself (`queue[:, idx] = keys.T` once wrote each queue transposed under torch's
    # vmap rule, or raised a shape mismatch; vmapens's index_put_ rule writes it as alone);
    # the roll keeps the newest keys first (the same negatives in another order)
    alone = reference_alone(MS, "roll" if queue == "roll" else "item")
    want = train_alone(alone, batches)
    torch.testing.assert_close(losses, want, **TOL)
    assert_members(ens, alone, skip=("m",))
    assert [ens[i].m.item() for i in range(N)] == list(MS)


def test_an_indexed_enqueue_in_a_plain_forward_fills_each_queue_as_alone() -> None:
    ens = vmapens.Ensemble(moco("buffer", "index"), n=N, seeds=range(N))
    alone = [ens[i] for i in range(N)]
    x1, x2 = pairs(1)[0]
    with torch.no_grad():  # a queue warm-up, or an evaluation pass
        out = ens(x1, x2)
        want = torch.stack([m(x1, x2) for m in alone])
    torch.testing.assert_close(out, want, **TOL)
    for i, m in enumerate(alone):
        torch.testing.assert_close(ens[i].queue, m.queue, **TOL, msg=f"member {i}")


def test_fit_with_a_checkpoint_resumed_mid_run_restores_queue_and_pointer(tmp_path: Path) -> None:
    rows, batch, epochs = 12, 4, 3  # 3 steps an epoch: the pointer stops mid-queue (4 of 8)
    x1, x2 = (torch.cat(t) for t in zip(*pairs(3)))
    data, ckpt = ((x1, x2), dummy(rows)), tmp_path / "moco.pt"
    options = dict(epochs=epochs, batch_size=batch, seed=3, progress=False, checkpoint=ckpt, lr=LR)

    def stop_after_one(history: vmapens.History) -> None:
        if history.epochs == 1:
            raise KeyboardInterrupt

    def build() -> vmapens.Ensemble:
        ens = vmapens.Ensemble(moco("buffer", "onehot"), n=N, seeds=range(N))
        ens.stacked_buffers()["m"].copy_(torch.tensor(MS, dtype=torch.float64))
        return ens

    first = build()
    with pytest.raises(KeyboardInterrupt):
        vmapens.fit(first, data, info_nce, callbacks=[stop_after_one], **options)
    assert first.stacked_buffers()["queue_ptr"].flatten().tolist() == [4] * N
    resumed = build()
    history = vmapens.fit(resumed, data, info_nce, **options)
    plan = batch_plan(rows, batch, epochs * rows // batch, seed=3)
    alone = reference_alone(MS)
    train_alone(alone, [(x1[r], x2[r]) for r in plan])
    assert history.train_loss.shape == (epochs, N)
    assert_members(resumed, alone, skip=("m",))
    # member files load into the plain class; the plain module goes on as its twin alone
    paths = vmapens.save_members(resumed, tmp_path / "members")
    plain = MoCo(0.0, "buffer", "onehot").double()
    plain.load_state_dict(torch.load(paths[2]))
    assert plain.m.item() == MS[2] and int(plain.queue_ptr) == 4
    nxt = pairs(1, seed=9)
    train_alone([plain], nxt)
    train_alone([alone[2]], nxt)
    for k, v in alone[2].state_dict().items():
        torch.testing.assert_close(plain.state_dict()[k], v, **TOL, msg=k)


# ----------------------------------------------------------------------------- (2) BYOL


class BYOL(nn.Module):
    def __init__(self, m: float = 0.9, ema: str = "data") -> None:
        super().__init__()
        self.ema = ema
        self.online = nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, DIM))
        self.predictor = nn.Sequential(nn.Linear(DIM, 6), nn.Tanh(), nn.Linear(6, DIM))
        self.target = copy.deepcopy(self.online).requires_grad_(False)
        if ema == "buffer":
            self.register_buffer("m", torch.tensor(m, dtype=torch.float64))
        else:
            self.m = m

    def forward(self, v1: Tensor, v2: Tensor) -> Tensor:
        p1, p2 = self.predictor(self.online(v1)), self.predictor(self.online(v2))
        with torch.no_grad():
            for po, pt in zip(self.online.parameters(), self.target.parameters()):
                if self.ema == "data":
                    pt.data = pt.data * self.m + po.data * (1.0 - self.m)
                else:
                    pt.mul_(self.m).add_(po * (1 - self.m))
            z1, z2 = self.target(v1), self.target(v2)
        return torch.stack([p1, p2, z2.detach(), z1.detach()])  # [4, B, DIM]


def byol_loss(out: Tensor, _target: Tensor | None = None) -> Tensor:
    p, z = F.normalize(out[:2], dim=-1), F.normalize(out[2:], dim=-1)
    return (2 - 2 * (p * z).sum(-1)).mean(-1).sum()


def test_byol_with_a_momentum_sweep_matches_each_member_alone() -> None:
    ens = vmapens.Ensemble(lambda: BYOL(ema="buffer").double(), n=N, seeds=range(N))
    ens.stacked_buffers()["m"].copy_(torch.tensor(MS, dtype=torch.float64))
    batches = pairs(4, seed=5)
    step = vmapens.make_step(ens, byol_loss, vmapens.StackedAdam(ens, lr=LR))
    losses = torch.stack([step(b, dummy()) for b in batches])
    alone = []
    for k, m in enumerate(MS):
        torch.manual_seed(k)
        alone.append(BYOL(m).double())
    want = train_alone(alone, batches, byol_loss)
    torch.testing.assert_close(losses, want, **TOL)
    assert_members(ens, alone, skip=("m",))
    assert all(p.grad is None for p in ens.template.target.parameters())
    # the target moved by each member's own m: none stayed at its init, none equals online
    for i in range(N):
        assert not torch.equal(ens[i].target[0].weight, ens[i].online[0].weight)
