"""User journey: `torch.nn.utils` and friends on an ensemble, reached for as on one model.

The script a researcher writes from README.md, docs/semantics.md and docs/fit.md's manual
loop: an evolution-strategy perturbation through `parameters_to_vector` /
`vector_to_parameters` on `ens.parameters()` (and on `ens.template.parameters()`, which is on
meta); torch's `clip_grad_value_` and vmapens's per-member `clip_grad_norm_` (`foreach` both
ways) between backward and step, each member's norm against `torch.nn.utils.get_total_norm`
alone; `fuse_conv_bn_eval` on members of a trained Conv+BN ensemble (`ens[i]`, `unstack()`,
restacked with `from_modules`); `skip_init` in the factory and `nn.LazyLinear` materialised by
a first call; `nn.AdaptiveLogSoftmaxWithLoss` as the head (forward takes the target, returns
`(output, loss)`); `pad_sequence` of a list input before a GRU; `to_empty` after building on
meta, `share_memory()`, freezing a template layer mid-training with
`zero_grad(set_to_none=False)` (Adam's moments still move the frozen layer, as alone).

The truth: each member a plain module built after `torch.manual_seed(k)` (`seeds=range(n)`)
and trained alone with `torch.optim` on the same batches, float64 (a batched matmul sums in
another order: 1e-10).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils import (
    clip_grad_value_,
    fuse_conv_bn_eval,
    get_total_norm,
    parameters_to_vector,
    skip_init,
    vector_to_parameters,
)
from torch.nn.utils.rnn import pad_sequence
from truth import seeded_members

import vmapens

pytestmark = pytest.mark.usefixtures("float64_default")

N = 3
TOL: dict[str, Any] = {"rtol": 1e-10, "atol": 1e-10}
SEEDS = list(range(N))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def batches(count: int, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(5, 3, generator=g), torch.randn(5, 2, generator=g)) for _ in range(count)]


def assert_members(ens: vmapens.Ensemble, alone: list[nn.Module]) -> None:
    for i, m in enumerate(alone):
        got = ens[i].state_dict()
        for k, v in m.state_dict().items():
            torch.testing.assert_close(got[k], v, **TOL, msg=f"member {i} {k}")


def step_alone(alone: list[nn.Module], opts: list, x: Any, y: Tensor, loss_fn: Any) -> None:
    for m, o in zip(alone, opts):
        o.zero_grad()
        loss_fn(m(x), y).backward()
        o.step()


# -- parameters_to_vector / vector_to_parameters ------------------------------------------------


def test_evolution_strategy_step_through_vector_to_parameters_matches_alone() -> None:
    """Each member's own noise added to its flat parameter vector mid-training, as alone with
    `vector_to_parameters(parameters_to_vector(m.parameters()) + eps, m.parameters())`.

    `parameters_to_vector(ens.parameters())` is parameter-major (every member's `0.weight`,
    then every member's `0.bias`, ...): member i's own vector is row i of
    `torch.cat([p.flatten(1) for p in ens.parameters()], 1)`, not of `.view(n, -1)`.
    `vector_to_parameters` into `ens.parameters()` replaces their storage (`p.data = ...`);
    the stacked optimizer and the step go on from it as alone."""
    ens = vmapens.Ensemble(mlp, n=N, seeds=SEEDS)
    alone = seeded_members(mlp, N)
    params = list(ens.parameters())
    rows = torch.cat([p.detach().flatten(1) for p in params], 1)
    for i, m in enumerate(alone):
        torch.testing.assert_close(rows[i], parameters_to_vector(m.parameters()), rtol=0, atol=0)
    # The reshape of the flat vector mixes members: its first row is member 0's weights and
    # then members 1 and 2's (the pitfall the row recipe above avoids).
    flat = parameters_to_vector(params).detach().view(N, -1)
    assert not torch.equal(flat[0], rows[0])

    opt = vmapens.StackedAdam(ens, lr=1e-2)
    step = vmapens.make_step(ens, nn.MSELoss(), opt)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in alone]
    g = torch.Generator().manual_seed(7)
    sizes = [p[0].numel() for p in params]
    for t, (x, y) in enumerate(batches(5)):
        if t in (2, 4):
            eps = 0.1 * torch.randn(N, sum(sizes), generator=g)  # member i's noise: eps[i]
            for m, e in zip(alone, eps):
                vector_to_parameters(parameters_to_vector(m.parameters()) + e, m.parameters())
            own = torch.cat([p.detach().flatten(1) for p in params], 1) + eps
            # Back to parameter-major order: each parameter's columns, every member's rows.
            chunks = own.split(sizes, dim=1)
            vector_to_parameters(torch.cat([c.reshape(-1) for c in chunks]), params)
        step(x, y)
        step_alone(alone, opts, x, y, nn.functional.mse_loss)
    assert_members(ens, alone)


def test_vector_to_parameters_into_the_meta_template_is_refused_at_the_next_call() -> None:
    """`ens.template.parameters()` are on meta: their flat vector is one member's size on meta
    (no values); a meta vector written back through `.data` is refused at the next call, with
    the ways to change the members, and the members are as they were."""
    ens = vmapens.Ensemble(mlp, n=N, seeds=SEEDS)
    x = batches(1)[0][0]
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    vec = parameters_to_vector(ens.template.parameters())
    assert vec.is_meta and vec.numel() == sum(p.numel() for p in mlp().parameters())
    vector_to_parameters(vec * 2, ens.template.parameters())
    with pytest.raises(ValueError, match=r"`ens.template.0.weight` was written.*stacked_params"):
        ens(x)
    torch.testing.assert_close(ens.state_dict(), before, rtol=0, atol=0)  # no member changed


def test_real_vector_into_the_template_is_refused_naming_the_members_storage() -> None:
    """Until patch nnutils-1, torch's 'Attempted to call `variable.set_data(tensor)`, but
    `variable` and `tensor` have incompatible tensor type', naming neither."""
    ens = vmapens.Ensemble(mlp, n=N, seeds=SEEDS)
    vec = torch.randn(sum(p.numel() for p in ens.template.parameters()))
    with pytest.raises(ValueError, match=r"meta.*ens\.parameters\(\)"):
        vector_to_parameters(vec, ens.template.parameters())


# -- clipping between backward and step ---------------------------------------------------------


@pytest.mark.parametrize("foreach", [True, False])
def test_manual_loop_clips_values_with_torch_and_norms_per_member(foreach: bool) -> None:
    """docs/fit.md's manual loop: backward, torch's own `clip_grad_value_` over the stacked
    leaves (elementwise: each member's elements as alone), `vmapens.optim.clip_grad_norm_`
    (each member by its own norm, returned `[n]`, equal to `get_total_norm` of the member's
    gradients alone), then the step."""
    ens = vmapens.Ensemble(mlp, n=N, seeds=SEEDS)
    alone = seeded_members(mlp, N)
    opt = vmapens.StackedSGD(ens, lr=0.1, momentum=0.9)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in alone]
    loss_fn = nn.MSELoss()
    for x, y in batches(4):
        opt.zero_grad()
        vmapens.per_member(loss_fn)(ens(x), y).sum().backward()
        clip_grad_value_(ens.parameters(), 0.4, foreach=foreach)
        norms = vmapens.optim.clip_grad_norm_(ens, 0.3, foreach=foreach)
        opt.step()
        want = []
        for m, o in zip(alone, opts):
            o.zero_grad()
            loss_fn(m(x), y).backward()
            clip_grad_value_(m.parameters(), 0.4, foreach=foreach)
            grads = [p.grad for p in m.parameters()]
            want.append(get_total_norm(grads, foreach=foreach))
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.3, foreach=foreach)
            o.step()
        torch.testing.assert_close(norms, torch.stack(want), **TOL)
    assert_members(ens, alone)


def square() -> nn.Module:
    return nn.Linear(3, 3)  # every template parameter leads with 3 = n: read as n members


def test_vmapens_clip_over_template_parameters_is_refused() -> None:
    """Until patch nnutils-2 they clipped nothing and returned a meta [3] of zeros, silently,
    when the template's leading sizes agreed."""
    ens = vmapens.Ensemble(square, n=N, seeds=SEEDS)
    x = torch.randn(5, 3)
    vmapens.per_member(nn.MSELoss())(ens(x), torch.randn(5, 3)).sum().backward()
    before = [p.grad.clone() for p in ens.parameters()]
    with pytest.raises(ValueError, match=r"meta.*template"):
        vmapens.optim.clip_grad_norm_(ens.template.parameters(), 1e-3)
    with pytest.raises(ValueError, match=r"meta.*template"):
        vmapens.optim.clip_grad_value_(ens.template.parameters(), 1e-3)
    for p, g in zip(ens.parameters(), before):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)


# -- fuse_conv_bn_eval ----------------------------------------------------------------------


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3)
        self.bn = nn.BatchNorm2d(3)
        self.head = nn.Linear(3 * 4 * 4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.relu(self.bn(self.conv(x))).flatten(1))


def fused(m: nn.Module) -> nn.Module:
    out = copy.deepcopy(m)
    out.conv = fuse_conv_bn_eval(out.conv, out.bn)
    out.bn = nn.Identity()
    return out


def test_fuse_conv_bn_eval_on_trained_members_equals_the_fused_member_alone() -> None:
    ens = vmapens.Ensemble(ConvBN, n=N, seeds=SEEDS)
    alone = seeded_members(ConvBN, N)
    step = vmapens.make_step(
        ens, nn.CrossEntropyLoss(), vmapens.StackedSGD(ens, lr=0.1, momentum=0.9)
    )
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in alone]
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x, y = torch.randn(6, 1, 6, 6, generator=g), torch.randint(0, 2, (6,), generator=g)
        step(x, y)
        step_alone(alone, opts, x, y, nn.functional.cross_entropy)
    ens.eval()
    for m in alone:
        m.eval()
    x = torch.randn(4, 1, 6, 6, generator=g)
    members = ens.unstack()
    for i, m in enumerate(alone):
        want = fused(m)(x)
        torch.testing.assert_close(fused(ens[i])(x), want, **TOL)
        torch.testing.assert_close(fused(members[i])(x), want, **TOL)
        torch.testing.assert_close(ens(x)[i], want, **TOL)  # fusing changes nothing in eval
    restacked = vmapens.Ensemble.from_modules([fused(u) for u in members])
    assert not restacked.training
    torch.testing.assert_close(restacked(x), torch.stack([fused(m)(x) for m in alone]), **TOL)
    # Fusing the template's layers in place is a structural edit: refused, not run stale.
    ens.template.conv = fuse_conv_bn_eval(ens.template.conv, ens.template.bn)
    with pytest.raises(ValueError, match=r"`ens.template.conv` was replaced.*from_modules"):
        ens(x)


# -- skip_init, LazyLinear ---------------------------------------------------------------------


def skipped() -> nn.Module:
    m = nn.Sequential(skip_init(nn.Linear, 3, 4), nn.Tanh(), skip_init(nn.Linear, 4, 2))
    for layer in (m[0], m[2]):
        nn.init.normal_(layer.weight, std=0.5)
        nn.init.zeros_(layer.bias)
    return m


def lazy() -> nn.Module:
    m = nn.Sequential(nn.LazyLinear(4), nn.Tanh(), nn.LazyLinear(2))
    m(torch.zeros(1, 3))  # materialised: LazyLinear becomes Linear
    return m


@pytest.mark.parametrize("factory", [skipped, lazy], ids=["skip_init", "lazy"])
def test_skip_init_and_materialised_lazy_members_train_as_alone(factory: Any) -> None:
    ens = vmapens.Ensemble(factory, n=N, seeds=SEEDS)
    alone = seeded_members(factory, N)
    assert_members(ens, alone)  # the same initialisation, drawn after the same seed
    assert type(ens.template[0]) is nn.Linear
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-2))
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in alone]
    for x, y in batches(3):
        step(x, y)
        step_alone(alone, opts, x, y, nn.functional.mse_loss)
    assert_members(ens, alone)


# -- AdaptiveLogSoftmaxWithLoss head ---------------------------------------------------------------

V = 10


class AdaptiveLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 6)
        self.head = nn.AdaptiveLogSoftmaxWithLoss(6, V, cutoffs=[3, 6], div_value=2.0)

    def forward(self, x: Tensor, target: Tensor) -> Any:
        return self.head(torch.tanh(self.body(x)), target)  # _ASMoutput(output, loss)


def read_loss(out: Any, target: Tensor) -> Tensor:
    return out.loss


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # index_copy_ under vmap
def test_adaptive_log_softmax_head_trains_as_alone() -> None:
    """The head's `.loss` as the loss: a shared target runs under vmap (torch's fallback for
    `index_copy_`, member by member); per-member targets (`in_dims=0`) need `nonzero` of a
    batched target, refused naming `backend='loop'`, which trains them as alone."""
    ens = vmapens.Ensemble(AdaptiveLM, n=N, seeds=SEEDS)
    alone = seeded_members(AdaptiveLM, N)
    step = vmapens.make_step(ens, read_loss, vmapens.StackedAdam(ens, lr=1e-2))
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in alone]
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x, t = torch.randn(8, 4, generator=g), torch.randint(0, V, (8,), generator=g)
        losses = step((x, t), t)
        want = []
        for m, o in zip(alone, opts):
            o.zero_grad()
            loss = m(x, t).loss
            loss.backward()
            o.step()
            want.append(loss.detach())
        torch.testing.assert_close(losses, torch.stack(want), **TOL)
    assert_members(ens, alone)
    out = ens(x, t)
    assert out.output.shape == (N, 8) and out.loss.shape == (N,)

    X, T = torch.randn(N, 8, 4, generator=g), torch.randint(0, V, (N, 8), generator=g)
    own = vmapens.make_step(ens, read_loss, vmapens.StackedAdam(ens, lr=1e-2), in_dims=0)
    with pytest.raises(RuntimeError, match=r"nonzero.*backend='loop'"):
        own((X, T), T)
    assert_members(ens, alone)  # nothing changed

    loop = vmapens.Ensemble(AdaptiveLM, n=N, seeds=SEEDS, backend="loop")
    alone = seeded_members(AdaptiveLM, N)
    step = vmapens.make_step(loop, read_loss, vmapens.StackedAdam(loop, lr=1e-2), in_dims=0)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in alone]
    for _ in range(2):
        X, T = torch.randn(N, 8, 4, generator=g), torch.randint(0, V, (N, 8), generator=g)
        step((X, T), T)
        for i, (m, o) in enumerate(zip(alone, opts)):
            o.zero_grad()
            m(X[i], T[i]).loss.backward()
            o.step()
    assert_members(loop, alone)


# -- pad_sequence in the forward ------------------------------------------------------------------


class PaddedGRU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(2, 4, batch_first=True)
        self.head = nn.Linear(4, 1)

    def forward(self, seqs: list[Tensor]) -> Tensor:
        _, h = self.rnn(pad_sequence(seqs, batch_first=True))
        return self.head(h[-1])


def test_pad_sequence_of_a_list_input_before_a_gru_trains_as_alone() -> None:
    ens = vmapens.Ensemble(PaddedGRU, n=N, seeds=SEEDS)
    alone = seeded_members(PaddedGRU, N)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-2))
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in alone]
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        seqs = [torch.randn(k, 2, generator=g) for k in (5, 3, 4)]
        y = torch.randn(3, 1, generator=g)
        step((seqs,), y)
        step_alone(alone, opts, seqs, y, nn.functional.mse_loss)
    assert_members(ens, alone)


# -- to_empty, share_memory, freezing mid-training ------------------------------------------------


def test_to_empty_after_building_on_meta_then_loading_and_share_memory_train_as_alone() -> None:
    trained = vmapens.Ensemble(mlp, n=N, seeds=SEEDS)
    with torch.device("meta"):
        ens = vmapens.Ensemble(mlp, n=N, seeds=SEEDS)
    ens.to_empty(device="cpu")
    ens.load_state_dict(trained.state_dict())
    ens.share_memory()
    assert all(p.is_shared() for p in ens.parameters())
    alone = seeded_members(mlp, N)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-2))
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in alone]
    for x, y in batches(3):
        step(x, y)
        step_alone(alone, opts, x, y, nn.functional.mse_loss)
    assert_members(ens, alone)
    assert all(p.is_shared() for p in ens.parameters())  # updated in place, still shared
    # The template's own to_empty gives it real tensors that no member reads: refused.
    ens.template.to_empty(device="cpu")
    with pytest.raises(
        ValueError, match=r"`ens.template.0.weight` was replaced by a tensor on cpu"
    ):
        ens(x)


@pytest.mark.parametrize("manual", [True, False], ids=["zero_grad_keep", "make_step"])
def test_freezing_a_template_layer_mid_training_matches_alone(manual: bool) -> None:
    """`ens.template[0].requires_grad_(False)` after two steps, back on after four. With
    `zero_grad(set_to_none=False)` the frozen layer keeps a zero gradient, so Adam's moments
    and weight decay still move it, alone and in the ensemble; `make_step` sets gradients
    afresh, as a loop with torch's default `zero_grad()`, and the frozen layer stays."""
    kw = {"lr": 1e-2, "weight_decay": 0.1}
    ens = vmapens.Ensemble(mlp, n=N, seeds=SEEDS)
    alone = seeded_members(mlp, N)
    opt = vmapens.StackedAdam(ens, **kw)
    opts = [torch.optim.Adam(m.parameters(), **kw) for m in alone]
    step = vmapens.make_step(ens, nn.MSELoss(), opt)
    moved = []
    for t, (x, y) in enumerate(batches(5)):
        if t in (2, 4):
            for m in (ens.template, *alone):
                m[0].requires_grad_(t == 4)
        frozen = alone[0][0].weight.detach().clone()
        if manual:
            opt.zero_grad(set_to_none=False)
            vmapens.per_member(nn.MSELoss())(ens(x), y).sum().backward()
            opt.step()
        else:
            step(x, y)
        for m, o in zip(alone, opts):
            o.zero_grad(set_to_none=not manual)
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
        if t in (2, 3):
            moved.append(not torch.equal(alone[0][0].weight, frozen))
    assert moved == [manual, manual]  # the truth itself: frozen layers move only by momentum
    assert_members(ens, alone)
