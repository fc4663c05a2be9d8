"""A user journey: an ensemble of small graph neural networks in plain torch (no torch_geometric).

The researcher's script: one shared graph, node features ``[V, F]`` and an edge index
``[2, E]`` passed as an input to every member; message passing with out-of-place
``index_add``, ``scatter_add`` and ``scatter_reduce(reduce="mean"/"amax", include_self=False)``,
degree normalisation with ``torch.bincount``, an attention softmax over each node's incoming
edges (per-destination max by ``scatter_reduce("amax")``, exp, sum), a sparse adjacency
(``torch.sparse_coo_tensor``) times features with ``torch.sparse.mm``; node classification
with a train mask (loss on the masked nodes only) and graph classification over a batch of
small graphs (global mean pooling with ``index_add``). Then one graph per member
(``in_dims=0``: features, edge index, labels and mask all stacked), and what vmap cannot batch
(``index_add_`` into a tensor made in the forward: refused, nothing changed, exact with
``backend="loop"``).

The truth is the naive loop: each member a plain module, built as the ensemble documents
(``torch.manual_seed(derived_seed(seed, "member", i))`` then the factory), trained alone with
``torch.optim.Adam`` on the same batches. float64 throughout: the ensemble runs the same
kernels on the same numbers, so members agree to round-off (``TOL64``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from truth import TOL64, assert_members_equal, factory_members

import vmapens

pytestmark = pytest.mark.usefixtures("float64_default")

N, V, FEAT, HID, CLASSES, EDGES, STEPS = 5, 9, 3, 4, 3, 24, 3
LRS = [0.05, 0.02, 0.1, 0.03, 0.01]
# torch's fallback for an op without a batching rule (bincount, _sparse_mm) runs it member by
# member, exactly, and says so once per call site (docs/semantics.md, "What vmap cannot batch").
FALLBACK = "ignore:There is a performance drop:UserWarning"


def graph(g: torch.Generator, nodes: int = V, edges: int = EDGES) -> tuple[Tensor, Tensor]:
    """Random features ``[nodes, FEAT]`` and a random directed edge index ``[2, edges]``."""
    x = torch.randn(nodes, FEAT, generator=g)
    ei = torch.stack([torch.randint(nodes, (edges,), generator=g) for _ in range(2)])
    return x, ei


def node_data(seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One graph for node classification: features, edges, labels, train mask."""
    g = torch.Generator().manual_seed(seed)
    x, ei = graph(g)
    y = torch.randint(CLASSES, (V,), generator=g)
    mask = torch.tensor([1, 1, 0, 1, 0, 1, 1, 0, 1], dtype=torch.bool)
    return x, ei, y, mask


class NodeGNN(nn.Module):
    """Every aggregation of the journey in one forward, over a shared or per-member graph."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(FEAT, HID)
        self.root = nn.Linear(FEAT, HID)
        self.att = nn.Linear(2 * HID, 1)
        self.val = nn.Linear(HID, HID)
        self.mix = nn.Linear(4 * HID, HID)
        self.out = nn.Linear(HID, CLASSES)

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        src, dst = edge_index[0], edge_index[1]
        nodes = x.shape[0]
        # GCN-style symmetric normalisation by in-degree (bincount), sum by out-of-place
        # index_add on a fresh zeros tensor.
        deg = torch.bincount(dst, minlength=nodes).clamp(min=1).to(x.dtype)
        h = self.lin(x)
        msg = h[src] / deg[src].sqrt()[:, None]
        agg = torch.zeros(nodes, HID, dtype=x.dtype).index_add(0, dst, msg)
        h = torch.relu(agg / deg.sqrt()[:, None] + self.root(x))
        # sum, mean and max over incoming edges with scatter ops
        idx = dst[:, None].expand(-1, HID)
        m = h[src]
        total = torch.zeros_like(h).scatter_add(0, idx, m)
        mean = torch.zeros_like(h).scatter_reduce(0, idx, m, "mean", include_self=False)
        top = torch.zeros_like(h).scatter_reduce(0, idx, m, "amax", include_self=False)
        # attention: softmax of edge scores over each destination's incoming edges
        e = F.leaky_relu(self.att(torch.cat([h[src], h[dst]], -1)).squeeze(-1), 0.2)
        emax = torch.full((nodes,), -torch.inf, dtype=x.dtype)
        emax = emax.scatter_reduce(0, dst, e, "amax", include_self=False)
        a = torch.exp(e - emax[dst])
        z = torch.zeros(nodes, dtype=x.dtype).index_add(0, dst, a)
        att = torch.zeros_like(h).index_add(0, dst, (a / z[dst])[:, None] * self.val(h)[src])
        h = torch.relu(self.mix(torch.cat([total, mean, top, att], -1)))
        return self.out(h)


def masked_ce(out: Tensor, target: tuple[Tensor, Tensor]) -> Tensor:
    """Cross-entropy on the train nodes only (a boolean mask shared by all members)."""
    y, mask = target
    return F.cross_entropy(out[mask], y[mask])


def weighted_ce(out: Tensor, target: tuple[Tensor, Tensor]) -> Tensor:
    """The same loss with the mask as 0/1 weights: no data-dependent shape."""
    y, w = target
    return (F.cross_entropy(out, y, reduction="none") * w).sum() / w.sum()


def train_alone(
    models: Sequence[nn.Module],
    batches: Sequence[tuple[tuple[Tensor, ...], Any]],
    loss_fn: Callable[[Tensor, Any], Tensor],
    lrs: Sequence[float] = LRS,
    per_member: bool = False,
) -> list[list[float]]:
    """The naive loop: member i alone, torch.optim.Adam(lr=lrs[i]), every batch in order
    (with ``per_member``, its own slice of every stacked tensor). Returns the losses."""
    losses = []
    for i, model in enumerate(models):
        opt = torch.optim.Adam(model.parameters(), lr=lrs[i])
        own = []
        for inputs, target in batches:
            if per_member:
                inputs = tuple(t[i] for t in inputs)
                target = tuple(t[i] for t in target)
            opt.zero_grad()
            loss = loss_fn(model(*inputs), target)
            loss.backward()
            opt.step()
            own.append(loss.item())
        losses.append(own)
    return losses


def twins_of(factory: Callable[[], nn.Module]) -> list[nn.Module]:
    return factory_members([factory] * N, seed=0)


def test_node_classification_make_step_and_fit_match_members_alone() -> None:
    x, ei, y, mask = node_data()
    batches = [((x, ei), (y, mask))] * STEPS
    alone = twins_of(NodeGNN)
    alone_losses = train_alone(alone, batches, masked_ce)

    ens = vmapens.Ensemble(NodeGNN, n=N, seed=0)
    step = vmapens.make_step(ens, masked_ce, vmapens.StackedAdam(ens, lr=LRS))
    losses = torch.stack([step(inputs, target) for inputs, target in batches], 1)
    torch.testing.assert_close(losses, torch.tensor(alone_losses), **TOL64)
    assert_members_equal(ens, alone)

    # fit over a list of (inputs, targets) batches: the forward gets (x, edge_index). The
    # targets as a dict, since val_data takes a tensor or dict as Y (a tuple X with a tuple Y
    # reads as two batches); validation on the other nodes after every epoch.
    def dict_ce(out: Tensor, target: dict[str, Tensor]) -> Tensor:
        return masked_ce(out, (target["y"], target["mask"]))

    fitted = vmapens.Ensemble(NodeGNN, n=N, seed=0)
    history = vmapens.fit(fitted, [((x, ei), {"y": y, "mask": mask})], dict_ce, epochs=STEPS,
                          lr=LRS, val_data=((x, ei), {"y": y, "mask": ~mask}), progress=False,
                          seed=0, callbacks=[vmapens.callbacks.EarlyStopping(patience=STEPS,
                          restore_best=False)])  # fmt: skip
    assert_members_equal(fitted, alone)
    torch.testing.assert_close(history.train_loss, torch.tensor(alone_losses).T, **TOL64)
    val = []  # each member alone, scored in eval mode after every epoch (one step here)
    for model, lr in zip(twins_of(NodeGNN), LRS, strict=True):
        opt, own = torch.optim.Adam(model.parameters(), lr=lr), []
        for _ in range(STEPS):
            opt.zero_grad()
            masked_ce(model(x, ei), (y, mask)).backward()
            opt.step()
            with torch.no_grad():
                own.append(masked_ce(model.eval()(x, ei), (y, ~mask)).item())
            model.train()
        val.append(own)
    torch.testing.assert_close(history.val_loss, torch.tensor(val).T, **TOL64)


class GraphGNN(nn.Module):
    """Graph classification: two mean-aggregation layers, global mean pooling over `batch`."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(FEAT, HID), nn.Linear(HID, HID)
        self.self1 = nn.Linear(FEAT, HID, bias=False)
        self.out = nn.Linear(HID, 2)

    def forward(self, x: Tensor, edge_index: Tensor, batch: Tensor) -> Tensor:
        src, dst = edge_index[0], edge_index[1]
        deg = torch.bincount(dst, minlength=x.shape[0]).clamp(min=1).to(x.dtype)[:, None]
        h = self.lin1(x)
        h = torch.relu(torch.zeros_like(h).index_add(0, dst, h[src]) / deg + self.self1(x))
        h = self.lin2(h)
        h = torch.tanh(torch.zeros_like(h).index_add(0, dst, h[src]) / deg + h)
        sizes = torch.bincount(batch)  # nodes per graph; its length is the number of graphs
        pooled = torch.zeros(sizes.shape[0], HID, dtype=x.dtype).index_add(0, batch, h)
        return self.out(pooled / sizes[:, None].to(x.dtype))


def graph_batches() -> list[tuple[tuple[Tensor, Tensor, Tensor], Tensor]]:
    """Two mini-batches of 3 and 4 small graphs each, batched as torch_geometric does: node
    features concatenated, edge indices offset, a `batch` vector naming each node's graph."""
    g = torch.Generator().manual_seed(1)
    out = []
    for sizes in ([4, 2, 5], [3, 6, 2, 4]):
        xs, eis, owner, offset = [], [], [], 0
        for k, nodes in enumerate(sizes):
            x, ei = graph(g, nodes, 2 * nodes)
            xs.append(x)
            eis.append(ei + offset)
            owner.append(torch.full((nodes,), k))
            offset += nodes
        y = torch.randint(2, (len(sizes),), generator=g)
        out.append(((torch.cat(xs), torch.cat(eis, 1), torch.cat(owner)), y))
    return out


def test_graph_classification_fit_matches_members_alone() -> None:
    batches = graph_batches()
    alone = twins_of(GraphGNN)
    alone_losses = train_alone(alone, batches * 2, F.cross_entropy)

    ens = vmapens.Ensemble(GraphGNN, n=N, seed=0)
    history = vmapens.fit(ens, batches, nn.CrossEntropyLoss(), epochs=2, lr=LRS,
                          progress=False, seed=0)  # fmt: skip
    assert_members_equal(ens, alone)
    # an epoch's train loss: the mean of its steps' losses
    mean_per_epoch = torch.tensor(alone_losses).view(N, 2, 2).mean(2).T
    torch.testing.assert_close(history.train_loss, mean_per_epoch, **TOL64)
    # the members' predictions on a batch, against each member alone
    inputs = batches[1][0]
    expected = torch.stack([m(*inputs) for m in alone])
    torch.testing.assert_close(ens(*inputs), expected, **TOL64)


class SparseGCN(nn.Module):
    """A normalised sparse adjacency, given as an input, times the node features."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.out = nn.Linear(FEAT, HID), nn.Linear(HID, CLASSES)

    def forward(self, x: Tensor, adj: Tensor) -> Tensor:
        h = torch.relu(torch.sparse.mm(adj, self.lin(x)))
        return self.out(torch.sparse.mm(adj, h))


def normalised_adjacency(ei: Tensor, nodes: int) -> Tensor:
    deg = torch.bincount(ei[1], minlength=nodes).clamp(min=1).double()
    values = 1 / (deg[ei[0]] * deg[ei[1]]).sqrt()
    return torch.sparse_coo_tensor(ei.flip(0), values, (nodes, nodes), check_invariants=True)


@pytest.mark.filterwarnings(FALLBACK)
def test_sparse_adjacency_input_trains_as_alone() -> None:
    x, ei, y, mask = node_data()
    adj = normalised_adjacency(ei, V)
    batches = [((x, adj), (y, mask.double()))] * STEPS
    alone = twins_of(SparseGCN)
    alone_losses = train_alone(alone, batches, weighted_ce)

    ens = vmapens.Ensemble(SparseGCN, n=N, seed=0)
    step = vmapens.make_step(ens, weighted_ce, vmapens.StackedAdam(ens, lr=LRS))
    losses = torch.stack([step(inputs, target) for inputs, target in batches], 1)
    torch.testing.assert_close(losses, torch.tensor(alone_losses), **TOL64)
    assert_members_equal(ens, alone)


def member_graphs() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One graph per member, stacked: features [N, V, F], edges [N, 2, E], labels, masks."""
    g = torch.Generator().manual_seed(3)
    pairs = [graph(g) for _ in range(N)]
    xs, eis = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    ys = torch.randint(CLASSES, (N, V), generator=g)
    masks = torch.rand(N, V, generator=g) < 0.6
    return xs, eis, ys, masks


def snapshot(ens: vmapens.Ensemble, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "state": copy.deepcopy(ens.state_dict()),
        "grads": [None if p.grad is None else p.grad.clone() for p in ens.parameters()],
        "opt": copy.deepcopy(opt.state_dict()),
    }


def assert_unchanged(ens: vmapens.Ensemble, opt: torch.optim.Optimizer, before: dict) -> None:
    after = snapshot(ens, opt)
    torch.testing.assert_close(after["state"], before["state"], rtol=0, atol=0)
    assert [g is None for g in after["grads"]] == [g is None for g in before["grads"]]
    torch.testing.assert_close(after["opt"], before["opt"], rtol=0, atol=0)


def test_per_member_graphs_train_as_alone() -> None:
    """Each member its own graph (features, integer edge index, labels, mask), stacked and
    mapped with in_dims=0. Indexing, index_add and scatter ops take a per-member index under
    vmap; bincount has no batching rule and torch's fallback runs it member by member, with
    its performance warning (docs/semantics.md: such ops "run correctly, member by member")."""
    xs, eis, ys, masks = member_graphs()
    weights = masks.double()
    alone = twins_of(NodeGNN)
    batches = [((xs, eis), (ys, weights))] * STEPS
    alone_losses = train_alone(alone, batches, weighted_ce, per_member=True)

    ens = vmapens.Ensemble(NodeGNN, n=N, seed=0)
    opt = vmapens.StackedAdam(ens, lr=LRS)
    # A boolean mask per member is a data-dependent shape under vmap: refused, naming the
    # way out, and nothing changed.
    before = snapshot(ens, opt)
    refused = vmapens.make_step(ens, masked_ce, opt, in_dims=0)
    with pytest.raises(RuntimeError, match=r"(?s)boolean mask.*backend='loop'"):
        refused((xs, eis), (ys, masks))
    assert_unchanged(ens, opt, before)

    step = vmapens.make_step(ens, weighted_ce, opt, in_dims=0)
    with pytest.warns(UserWarning, match="aten::bincount"):
        losses = torch.stack([step(inputs, target) for inputs, target in batches], 1)
    torch.testing.assert_close(losses, torch.tensor(alone_losses), **TOL64)
    assert_members_equal(ens, alone)

    # fit with in_dims=0 reads a list as one loader (here a list of batches) per member
    fitted = vmapens.Ensemble(NodeGNN, n=N, seed=0)
    data = [[((xs[i], eis[i]), (ys[i], weights[i]))] for i in range(N)]
    with pytest.warns(UserWarning, match="aten::bincount"):
        vmapens.fit(fitted, data, weighted_ce, in_dims=0, epochs=STEPS, lr=LRS,
                    progress=False, seed=0)  # fmt: skip
    assert_members_equal(fitted, alone)
    # shared features, per-member edges through the forward: each member its own graph
    got = ens(xs[0], eis, in_dims=(None, 0))
    torch.testing.assert_close(got, torch.stack([m(xs[0], eis[i]) for i, m in enumerate(alone)]))


class InPlaceGNN(nn.Module):
    """Sum aggregation written with the in-place index_add_ into a fresh zeros tensor: a
    member's messages written into a tensor all members share under vmap."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.out = nn.Linear(FEAT, HID), nn.Linear(HID, CLASSES)

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        h = self.lin(x)
        agg = torch.zeros(x.shape[0], HID, dtype=x.dtype)
        agg.index_add_(0, edge_index[1], h[edge_index[0]])
        return self.out(torch.relu(agg + h))


def test_unbatchable_in_place_scatter_is_refused_and_loop_is_exact() -> None:
    x, ei, y, mask = node_data()
    batches = [((x, ei), (y, mask))] * STEPS
    alone = twins_of(InPlaceGNN)
    alone_losses = train_alone(alone, batches, masked_ce)

    ens = vmapens.Ensemble(InPlaceGNN, n=N, seed=0)
    with pytest.raises(RuntimeError, match=r"(?s)^Ensemble: .*index_add_.*backend='loop'"):
        ens(x, ei)
    opt = vmapens.StackedAdam(ens, lr=LRS)
    before = snapshot(ens, opt)
    step = vmapens.make_step(ens, masked_ce, opt)
    with pytest.raises(RuntimeError, match=r"(?s)index_add_.*backend='loop'"):
        step((x, ei), (y, mask))
    assert_unchanged(ens, opt, before)
    with pytest.raises(RuntimeError, match=r"(?s)^(fit|step): .*index_add_.*backend='loop'"):
        vmapens.fit(ens, batches[:1], masked_ce, optimizer=opt, epochs=2, progress=False, seed=0)
    assert_unchanged(ens, opt, before)

    # backend="loop": each member's forward runs as alone, bit for bit; training agrees to
    # round-off (StackedAdam's update may round an ulp from torch.optim.Adam's, semantics.md)
    looped = vmapens.Ensemble(InPlaceGNN, n=N, seed=0, backend="loop")
    plain = twins_of(InPlaceGNN)
    torch.testing.assert_close(
        looped(x, ei), torch.stack([m(x, ei) for m in plain]), rtol=0, atol=0
    )
    step = vmapens.make_step(looped, masked_ce, vmapens.StackedAdam(looped, lr=LRS))
    losses = torch.stack([step(inputs, target) for inputs, target in batches], 1)
    torch.testing.assert_close(losses, torch.tensor(alone_losses), **TOL64)
    assert_members_equal(looped, alone)
    fitted = vmapens.Ensemble(InPlaceGNN, n=N, seed=0, backend="loop")
    vmapens.fit(fitted, batches[:1], masked_ce, epochs=STEPS, lr=LRS, progress=False, seed=0)
    assert_members_equal(fitted, alone)


def sparse_member_setup() -> tuple[Tensor, Tensor, tuple[Tensor, Tensor], list, list]:
    xs, eis, ys, masks = member_graphs()
    adjs = torch.stack([normalised_adjacency(eis[i], V) for i in range(N)])
    target = (ys, masks.double())
    alone = twins_of(SparseGCN)
    alone_losses = train_alone(alone, [((xs, adjs), target)] * 2, weighted_ce, per_member=True)
    return xs, adjs, target, alone, alone_losses


@pytest.mark.filterwarnings(FALLBACK)
@pytest.mark.parametrize("backend", ["vmap", "loop"])
def test_per_member_sparse_adjacency_trains_as_alone_unchecked(backend: str) -> None:
    """One sparse adjacency per member, stacked [N, V, V] (in_dims=0): the forward and the
    training step run (torch's fallback for sparse.mm) and every member trains as alone."""
    xs, adjs, target, alone, alone_losses = sparse_member_setup()
    ens = vmapens.Ensemble(SparseGCN, n=N, seed=0, backend=backend)
    first = twins_of(SparseGCN)
    expected = torch.stack([m(xs[i], adjs[i]) for i, m in enumerate(first)])
    torch.testing.assert_close(ens(xs, adjs, in_dims=0), expected, **TOL64)
    opt = vmapens.StackedAdam(ens, lr=LRS)
    step = vmapens.make_step(ens, weighted_ce, opt, in_dims=0, check=False)
    losses = torch.stack([step((xs, adjs), target) for _ in range(2)], 1)
    torch.testing.assert_close(losses, torch.tensor(alone_losses), **TOL64)
    assert_members_equal(ens, alone)


@pytest.mark.filterwarnings(FALLBACK)
@pytest.mark.parametrize("backend", ["vmap", "loop"])
def test_per_member_sparse_adjacency_passes_the_self_check(backend: str) -> None:
    xs, adjs, target, alone, alone_losses = sparse_member_setup()
    ens = vmapens.Ensemble(SparseGCN, n=N, seed=0, backend=backend)
    step = vmapens.make_step(ens, weighted_ce, vmapens.StackedAdam(ens, lr=LRS), in_dims=0)
    losses = torch.stack([step((xs, adjs), target) for _ in range(2)], 1)
    torch.testing.assert_close(losses, torch.tensor(alone_losses), **TOL64)
    assert_members_equal(ens, alone)


class BuildsSparse(nn.Module):
    """Builds its sparse adjacency from the edge index it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(FEAT, HID)

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        adj = torch.sparse_coo_tensor(edge_index, torch.ones(edge_index.shape[1]), (V, V))
        return torch.sparse.mm(adj, self.lin(x))


@pytest.mark.filterwarnings(FALLBACK)
@pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")
def test_forward_unbatchable_sparse_build_names_the_way_out() -> None:
    xs, eis, _, _ = member_graphs()
    ens = vmapens.Ensemble(BuildsSparse, n=N, seed=0)
    with pytest.raises(RuntimeError, match=r"(?s)^Ensemble: .*backend='loop'"):
        ens(xs, eis, in_dims=0)
    looped = vmapens.Ensemble(BuildsSparse, n=N, seed=0, backend="loop")
    alone = twins_of(BuildsSparse)
    expected = torch.stack([m(xs[i], eis[i]) for i, m in enumerate(alone)])
    torch.testing.assert_close(looped(xs, eis, in_dims=0), expected, rtol=0, atol=0)


def test_val_data_with_tuple_targets_says_why_and_the_way_out() -> None:
    x, ei, y, mask = node_data()
    ens = vmapens.Ensemble(NodeGNN, n=N, seed=0)
    with pytest.raises(ValueError, match=r"(?s)^fit: `val_data`.*two batches.*dict"):
        vmapens.fit(ens, [((x, ei), (y, mask))], masked_ce, val_data=((x, ei), (y, ~mask)),
                    progress=False, seed=0)  # fmt: skip
