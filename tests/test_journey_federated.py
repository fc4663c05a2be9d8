"""A user journey: federated learning simulated with the ensemble's members as the clients.

A researcher simulates FedAvg, FedBN and FedProx with 4 clients (a small float64 MLP with
BatchNorm or LayerNorm), each client one member, from README.md and docs/:

* local training: E steps per round on each client's own batches (`make_step(..., in_dims=0)`,
  or `vmapens.fit(..., in_dims=0)` once per round); clients of different data sizes, and
  clients that sit a round out, through `make_step`'s `mask` (docs: "freezes the members where
  it is False: their parameters, optimizer state and buffers stay exactly as they were");
* the server: a weighted mean over the members of every float tensor of `ens.state_dict()`
  (the storage itself, docs/semantics.md "Container operations"), written back into every row
  under `torch.no_grad()`; BatchNorm's statistics averaged (FedAvg) or kept local (FedBN);
* the client optimizer kept across rounds (SGD momentum per client), or reset every round: a
  new stacked optimizer, `opt.state.clear()`, or the documented row reset (zero every state
  row, Adagrad's `sum` filled with `initial_accumulator_value`);
* FedProx: `mu / 2 * ||w - w_global||^2` per client, written by hand over
  `ens.stacked_params()` (docs/fit.md), or returned by the forward from the server snapshot
  set on `ens.template`; a `make_step` loss reading `ens.stacked_params()` is refused;
* checkpoints between rounds (`vmapens.save`/`load`/`restore`), bit for bit the run that never
  stopped; a client dropped (`ens.select` + `opt.select`) and one added (`from_modules` of
  `unstack()` plus the global model, the optimizer state extended by a zero row).

The truth is plain PyTorch: 4 modules, each trained alone with its own `torch.optim` optimizer
on its own batches, and the server written as a loop over their state dicts.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import vmapens
from tests.truth import batch_plan

N, B, D_IN, D_OUT = 4, 6, 3, 2
mse = nn.functional.mse_loss
TOL = dict(rtol=1e-10, atol=1e-12)


class Net(nn.Module):
    def __init__(self, norm: str = "bn") -> None:
        super().__init__()
        # No bias before the norm: its true gradient is 0 (docs/semantics.md, round-off).
        self.fc1 = nn.Linear(D_IN, 5, bias=False, dtype=torch.float64)
        kind = nn.BatchNorm1d if norm == "bn" else nn.LayerNorm
        self.norm = kind(5, dtype=torch.float64)
        self.fc2 = nn.Linear(5, D_OUT, dtype=torch.float64)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


class ProxNet(Net):
    """FedProx in the forward: the server's snapshot is a plain attribute (the same for every
    client; set on `ens.template` each round), the penalty read from the member's own weights."""

    anchor: dict[str, Tensor] | None = None

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        out = super().forward(x)
        if self.anchor is None:
            return out, out.new_zeros(())
        prox = sum(((p - self.anchor[k]) ** 2).sum() for k, p in self.named_parameters())
        return out, prox


def clients(cls: type[Net] = Net, norm: str = "bn") -> tuple[list[nn.Module], vmapens.Ensemble]:
    """Four clients started from one global model (plain modules) and the ensemble of them."""
    torch.manual_seed(0)
    base = cls(norm)
    plain = [copy.deepcopy(base) for _ in range(N)]
    return plain, vmapens.Ensemble.from_modules(plain)


def batches(count: int, seed: int, n: int = N) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(n, B, D_IN, generator=g, dtype=torch.float64),
         torch.randn(n, B, D_OUT, generator=g, dtype=torch.float64))
        for _ in range(count)
    ]  # fmt: skip


def server_plain(models: list[nn.Module], w: Tensor, local: tuple[str, ...] = ()) -> None:
    """FedAvg by hand: the weighted mean of every float entry of the clients' state dicts
    (those under a `local` prefix kept: FedBN), loaded into every client."""
    sds = [m.state_dict() for m in models]
    avg = {
        k: sum(float(wi) * sd[k] for wi, sd in zip(w, sds, strict=True))
        for k in sds[0]
        if sds[0][k].is_floating_point() and not k.startswith(local)
    }
    for m in models:
        m.load_state_dict(avg, strict=False)


def server_ens(ens: vmapens.Ensemble, w: Tensor, local: tuple[str, ...] = ()) -> None:
    """The same over the stacked storage: `ens.state_dict()`'s tensors, written in place."""
    with torch.no_grad():
        for k, t in ens.state_dict().items():
            if t.is_floating_point() and not k.startswith(local):
                col = w.to(t).view(-1, *[1] * (t.dim() - 1))
                t.copy_((col * t).sum(0, keepdim=True).expand_as(t))


def local_plain(models: list[nn.Module], opts: list[Any], x: Tensor, y: Tensor, mask=None) -> None:
    for k, (m, o) in enumerate(zip(models, opts, strict=True)):
        if mask is None or mask[k]:
            o.zero_grad()
            mse(m(x[k]), y[k]).backward()
            o.step()


def assert_clients(ens: vmapens.Ensemble, models: list[nn.Module]) -> None:
    assert len(ens) == len(models)
    for i, m in enumerate(models):
        got = ens[i].state_dict()
        for k, v in m.state_dict().items():
            torch.testing.assert_close(got[k], v, **TOL, msg=f"client {i} {k}")


W = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)


@pytest.mark.parametrize("norm, local", [("bn", ()), ("bn", ("norm.",)), ("ln", ())])
def test_fedavg_and_fedbn_rounds_with_momentum_kept_are_the_clients_alone(norm, local) -> None:
    plain, ens = clients(norm=norm)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in plain]
    step = vmapens.make_step(ens, mse, vmapens.StackedSGD(ens, lr=0.1, momentum=0.9), in_dims=0)
    data = batches(6, seed=1)
    for r in range(3):
        for x, y in data[2 * r : 2 * r + 2]:
            step(x, y)
            local_plain(plain, opts, x, y)
        server_plain(plain, W, local)
        server_ens(ens, W, local)
        assert_clients(ens, plain)
    if local:  # FedBN: the statistics stay each client's own
        stats = ens.get_buffer("norm.running_mean")
        assert not torch.equal(stats[0], stats[1])


def test_clients_of_different_sizes_and_skipped_rounds_through_make_steps_mask() -> None:
    """Client k holds `sizes[k]` batches and does one local epoch: at step t the clients with
    no batch left, and those that sit the round out, are masked (their BatchNorm statistics
    too); the server weighs the round's participants by their data size."""
    sizes, rounds = [1, 2, 3, 2], [[0, 1, 2, 3], [1, 2, 3], [0, 2]]
    own = [batches(s, seed=10 + k, n=1) for k, s in enumerate(sizes)]
    plain, ens = clients()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in plain]
    step = vmapens.make_step(ens, mse, vmapens.StackedSGD(ens, lr=0.1, momentum=0.9), in_dims=0)
    for part in rounds:
        for t in range(max(sizes)):
            mask = torch.tensor([k in part and t < sizes[k] for k in range(N)])
            # a masked client's slot holds any batch of the right shape (its last one)
            x = torch.cat([own[k][min(t, sizes[k] - 1)][0] for k in range(N)])
            y = torch.cat([own[k][min(t, sizes[k] - 1)][1] for k in range(N)])
            step(x, y, mask=mask)
            local_plain(plain, opts, x, y, mask)
        w = torch.tensor([float(sizes[k] * (k in part)) for k in range(N)], dtype=torch.float64)
        server_plain(plain, w / w.sum())
        server_ens(ens, w / w.sum())
        assert_clients(ens, plain)
    counts = ens.get_buffer("norm.num_batches_tracked").tolist()
    assert counts == [2, 4, 9, 4] == [m.norm.num_batches_tracked.item() for m in plain]


OPTIMIZERS = {
    "sgd": (
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1),
        lambda e: vmapens.StackedSGD(e, lr=0.1, momentum=0.9, dampening=0.1),
    ),
    "adam": (
        lambda ps: torch.optim.Adam(ps, lr=0.05, weight_decay=0.01),
        lambda e: vmapens.StackedAdam(e, lr=0.05, weight_decay=0.01),
    ),
    "adagrad": (
        lambda ps: torch.optim.Adagrad(ps, lr=0.05, initial_accumulator_value=0.1),
        lambda e: vmapens.optim.stacked(torch.optim.Adagrad)(
            e, lr=0.05, initial_accumulator_value=0.1
        ),
    ),
}


@pytest.mark.parametrize(
    "kind, reset", [("adam", "new"), ("adam", "clear"), ("sgd", "rows"), ("adagrad", "rows")]
)
def test_client_optimizers_reset_every_round_start_as_fresh_torch_optimizers(kind, reset) -> None:
    make_plain, make_stacked = OPTIMIZERS[kind]
    plain, ens = clients()
    opt = make_stacked(ens)
    step = vmapens.make_step(ens, mse, opt, in_dims=0)
    data = batches(6, seed=2)
    for r in range(3):
        opts = [make_plain(m.parameters()) for m in plain]  # a fresh optimizer per round
        if r and reset == "new":
            opt = make_stacked(ens)
            step = vmapens.make_step(ens, mse, opt, in_dims=0)
        elif r and reset == "clear":
            opt.state.clear()
        elif r:  # docs/semantics.md: zero every row; Adagrad's sum at its initial value
            with torch.no_grad():
                for p in ens.parameters():
                    for name, t in opt.state[p].items():
                        t.fill_(0.1) if name == "sum" else t.zero_()
        for x, y in data[2 * r : 2 * r + 2]:
            step(x, y)
            local_plain(plain, opts, x, y)
        server_plain(plain, W)
        server_ens(ens, W)
    assert_clients(ens, plain)


MU = 0.5


def test_fedprox_written_by_hand_over_the_stacked_parameters() -> None:
    plain, ens = clients()
    opts = [torch.optim.Adam(m.parameters(), lr=0.05) for m in plain]
    opt = vmapens.StackedAdam(ens, lr=0.05)
    data = batches(6, seed=3)
    for r in range(3):
        glob = [{k: p.detach().clone() for k, p in m.named_parameters()} for m in plain]
        snap = {k: p.detach().clone() for k, p in ens.stacked_params().items()}
        for x, y in data[2 * r : 2 * r + 2]:
            for k, (m, o) in enumerate(zip(plain, opts, strict=True)):
                o.zero_grad()
                prox = sum(((p - glob[k][n]) ** 2).sum() for n, p in m.named_parameters())
                (mse(m(x[k]), y[k]) + MU / 2 * prox).backward()
                o.step()
            losses = vmapens.per_member(mse, in_dims=(0, 0))(ens(x, in_dims=0), y)
            prox = sum(
                ((p - snap[n]) ** 2).flatten(1).sum(1) for n, p in ens.stacked_params().items()
            )
            opt.zero_grad()
            (losses + MU / 2 * prox).sum().backward()
            opt.step()
        server_plain(plain, W)
        server_ens(ens, W)
    assert_clients(ens, plain)


def prox_loss(out: tuple[Tensor, Tensor], y: Tensor) -> Tensor:
    return mse(out[0], y) + MU / 2 * out[1]


@pytest.mark.parametrize("update", ["assign", "in_place"])
def test_fedprox_in_the_forward_from_the_snapshot_on_the_template(update) -> None:
    """The server's snapshot set on `ens.template` each round (a new dict, or the first one's
    tensors copied into in place): `make_step` trains each client against it as alone."""
    plain, ens = clients(ProxNet)
    opts = [torch.optim.Adam(m.parameters(), lr=0.05) for m in plain]
    step = vmapens.make_step(ens, prox_loss, vmapens.StackedAdam(ens, lr=0.05), in_dims=0)
    data = batches(6, seed=4)
    for r in range(3):
        for m in plain:
            m.anchor = {k: p.detach().clone() for k, p in m.named_parameters()}
        glob = {k: p[0].detach().clone() for k, p in ens.stacked_params().items()}
        if update == "assign" or r == 0:
            ens.template.anchor = glob
        else:
            for k, t in ens.template.anchor.items():
                t.copy_(glob[k])
        for x, y in data[2 * r : 2 * r + 2]:
            step(x, y)
            for k, (m, o) in enumerate(zip(plain, opts, strict=True)):
                o.zero_grad()
                prox_loss(m(x[k]), y[k]).backward()
                o.step()
        server_plain(plain, W)
        server_ens(ens, W)
    assert_clients(ens, plain)


def test_a_fedprox_loss_reading_the_stacked_parameters_is_refused() -> None:
    _, ens = clients()
    snap = {k: p.detach().clone() for k, p in ens.stacked_params().items()}

    def loss(out: Tensor, y: Tensor) -> Tensor:
        prox = sum(((p - snap[k]) ** 2).sum() for k, p in ens.stacked_params().items())
        return mse(out, y) + MU / 2 * prox

    before = {k: v.clone() for k, v in ens.state_dict().items()}
    step = vmapens.make_step(ens, loss, vmapens.StackedAdam(ens, lr=0.05), in_dims=0)
    with pytest.raises(ValueError, match="stacked parameters.*forward.*by hand"):
        step(*batches(1, seed=5)[0])
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_checkpoints_between_rounds_resume_bit_for_bit(tmp_path: Path) -> None:
    data = batches(8, seed=6)

    def rounds(ens: vmapens.Ensemble, opt: Any, which: range) -> None:
        step = vmapens.make_step(ens, mse, opt, in_dims=0)
        for r in which:
            for x, y in data[2 * r : 2 * r + 2]:
                step(x, y)
            server_ens(ens, W)

    _, straight = clients()
    rounds(straight, vmapens.StackedSGD(straight, lr=0.1, momentum=0.9), range(4))
    _, first = clients()
    opt = vmapens.StackedSGD(first, lr=0.1, momentum=0.9)
    rounds(first, opt, range(2))
    vmapens.save(first, tmp_path / "round2.pt", optimizer=opt)
    resumed = vmapens.load(tmp_path / "round2.pt", Net)
    opt2 = vmapens.StackedSGD(resumed, lr=0.1, momentum=0.9)
    vmapens.restore(tmp_path / "round2.pt", resumed, opt2)
    rounds(resumed, opt2, range(2, 4))
    for k, v in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[k], v), k


def test_a_client_dropped_with_select_and_one_added_with_from_modules() -> None:
    plain, ens = clients()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in plain]
    opt = vmapens.StackedSGD(ens, lr=0.1, momentum=0.9)

    def one_round(ens: vmapens.Ensemble, opt: Any, seed: int) -> None:
        step = vmapens.make_step(ens, mse, opt, in_dims=0)
        w = torch.full((len(ens),), 1 / len(ens), dtype=torch.float64)
        for x, y in batches(2, seed=seed, n=len(ens)):
            step(x, y)
            local_plain(plain, opts, x, y)
        server_plain(plain, w)
        server_ens(ens, w)

    one_round(ens, opt, 7)
    rows = [0, 1, 3]  # client 2 leaves, with its optimizer state
    sub = ens.select(rows)
    sub_opt = opt.select(rows, sub)
    plain[:], opts[:] = [plain[r] for r in rows], [opts[r] for r in rows]
    one_round(sub, sub_opt, 8)
    assert_clients(sub, plain)
    new = copy.deepcopy(plain[0])  # a new client starts from the global model, fresh SGD
    plain.append(new)
    opts.append(torch.optim.SGD(new.parameters(), lr=0.1, momentum=0.9))
    grown = vmapens.Ensemble.from_modules([*sub.unstack(), sub[0]])
    grown_opt = vmapens.StackedSGD(grown, lr=0.1, momentum=0.9)
    sd = sub_opt.state_dict()  # docs/semantics.md: each state tensor extended by zero rows
    for state in sd["state"].values():
        for k, v in state.items():
            state[k] = torch.cat([v, torch.zeros_like(v[:1])])
    grown_opt.load_state_dict(sd)
    one_round(grown, grown_opt, 9)
    assert_clients(grown, plain)


def test_fit_once_per_round_on_each_clients_own_data() -> None:
    rows, epochs = 12, 2
    ((X, Y),) = batches(1, seed=11)
    X, Y = X.repeat(1, 2, 1), Y.repeat(1, 2, 1)  # 12 samples per client
    plain, ens = clients()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in plain]
    opt = vmapens.StackedSGD(ens, lr=0.1, momentum=0.9)
    for r in range(2):
        vmapens.fit(ens, (X, Y), nn.MSELoss(), epochs=epochs, in_dims=0, optimizer=opt,
                    batch_size=B, progress=False, seed=r)  # fmt: skip
        plan = batch_plan(rows, B, epochs * rows // B, seed=r)  # fit's documented order
        for k, (m, o) in enumerate(zip(plain, opts, strict=True)):
            for idx in plan:
                o.zero_grad()
                mse(m(X[k][idx]), Y[k][idx]).backward()
                o.step()
        server_plain(plain, W)
        server_ens(ens, W)
    assert_clients(ens, plain)


def test_fit_refuses_per_client_loaders_of_different_lengths() -> None:
    g = torch.Generator().manual_seed(12)
    sizes = [12, 18, 24, 12]
    loaders = [
        DataLoader(TensorDataset(torch.randn(s, D_IN, generator=g, dtype=torch.float64),
                                 torch.randn(s, D_OUT, generator=g, dtype=torch.float64)),
                   batch_size=B)
        for s in sizes
    ]  # fmt: skip
    _, ens = clients()
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    with pytest.raises(ValueError, match="same number of batches"):
        vmapens.fit(ens, loaders, nn.MSELoss(), epochs=1, in_dims=0, progress=False, seed=0)
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k


# -- bugs: each test passes once vmapens refuses, or trains as alone -------------------------


def test_the_global_model_expanded_over_the_members_and_assigned() -> None:
    plain, ens = clients()
    with torch.no_grad():  # a global model whose statistics have moved
        for m in plain:
            m.norm.running_mean.fill_(0.5)
    glob = {k: v for k, v in plain[0].state_dict().items() if v.is_floating_point()}
    x, y = batches(1, seed=13)[0]
    try:  # "no copy": the server's tensors become every client's row
        ens.load_state_dict(
            {k: v.expand(N, *v.shape) for k, v in glob.items()}, strict=False, assign=True
        )
    except (RuntimeError, ValueError) as err:
        assert "expand" in str(err) and "clone" in str(err)
        return
    ens(x, in_dims=0)  # one local forward in train mode
    for k, m in enumerate(plain):
        m(x[k])
    assert_clients(ens, plain)


def test_fit_with_one_checkpoint_path_for_every_round(tmp_path: Path) -> None:
    rows, epochs = 12, 1
    ((X, Y),) = batches(1, seed=14)
    X, Y = X.repeat(1, 2, 1), Y.repeat(1, 2, 1)
    plain, ens = clients()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in plain]
    opt = vmapens.StackedSGD(ens, lr=0.1)
    for r in range(2):
        try:
            vmapens.fit(ens, (X, Y), nn.MSELoss(), epochs=epochs, in_dims=0, optimizer=opt,
                        batch_size=B, progress=False, seed=0, checkpoint=tmp_path / "fl.pt")  # fmt: skip
        except ValueError as err:  # a refusal naming the way out is right too
            assert r == 1 and "checkpoint" in str(err) and "changed" in str(err)
            return
        for k, (m, o) in enumerate(zip(plain, opts, strict=True)):
            for idx in batch_plan(rows, B, epochs * rows // B, seed=0):
                o.zero_grad()
                mse(m(X[k][idx]), Y[k][idx]).backward()
                o.step()
        server_plain(plain, W)
        server_ens(ens, W)
    assert_clients(ens, plain)


def test_the_refusal_of_clients_of_different_lengths_names_each_and_the_way_out() -> None:
    loaders = [
        DataLoader(TensorDataset(torch.zeros(s, D_IN, dtype=torch.float64),
                                 torch.zeros(s, D_OUT, dtype=torch.float64)), batch_size=B)
        for s in [12, 18, 24, 12]
    ]  # fmt: skip
    _, ens = clients()
    with pytest.raises(ValueError) as err:
        vmapens.fit(ens, loaders, nn.MSELoss(), epochs=1, in_dims=0, progress=False, seed=0)
    assert "[2, 3, 4, 2]" in str(err.value) and "mask" in str(err.value)
