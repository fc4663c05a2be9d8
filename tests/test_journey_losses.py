"""A user journey: torch's own loss modules and functional losses passed straight to vmapens.

The script a researcher writes from README.md, docs/fit.md ("`loss_fn` sees one member's output
and target", "Data, epochs and steps": `Y` a tuple or dict of targets, class targets int64 or
int32) and docs/semantics.md (`per_member`, "What vmap cannot batch": `nn.GaussianNLLLoss`,
`nn.CrossEntropyLoss` with `weight` and `label_smoothing` on per-member targets, refused
naming `backend="loop"`): small float64 ensembles trained with `make_step` (vmap, vmap with
`chunk_size=2`, and `backend="loop"` where vmap refuses), `fit`, and a hand-written loop over
`vmapens.per_member`, with the options a user sets: PoissonNLL (`log_input` both ways,
`full`), GaussianNLL (the variance a model output, `full`, `eps`), KLDiv (`batchmean`,
`log_target` both ways), MultiMargin (`p`, `margin`, `weight`), MultiLabelSoftMargin,
Triplet / TripletWithDistance (a custom distance), CosineEmbedding, MarginRanking,
HingeEmbedding, SmoothL1 (`beta`), Huber (`delta`), SoftMargin, NLL (`ignore_index`,
`weight`), CrossEntropy (class-probability targets, `label_smoothing`, `ignore_index`,
K-dim), BCEWithLogits (`pos_weight`); `reduction` "mean"/"sum", and "none" refused; targets
as a tuple, list, dict or NamedTuple, per member too; int32 class targets; losses that return
a `[1]` tensor or a float32 0-d tensor; a loss closing over per-member class weights.

The truth is plain PyTorch: each member a plain module trained alone with `torch.optim.SGD`
(momentum: the update scales with the gradient, unlike Adam) on the same batches.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import vmapens

pytestmark = pytest.mark.usefixtures("float64_default")

N, B, IN, C, STEPS = 3, 6, 4, 5, 3
TOL = {"rtol": 1e-10, "atol": 1e-12}  # float64: the same maths, summed in another order
SGD = {"lr": 0.1, "momentum": 0.9}
CONFIGS = {"vmap": {}, "chunks": {"chunk_size": 2}, "loop": {"backend": "loop"}}


def mlp(out: int = C) -> Callable[[], nn.Module]:
    return lambda: nn.Sequential(nn.Linear(IN, 7), nn.Tanh(), nn.Linear(7, out))


class Siamese(nn.Module):
    """One encoder applied to each of its inputs: anchors, positives, negatives."""

    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.Linear(IN, 6), nn.Tanh(), nn.Linear(6, 3))

    def forward(self, *xs: Tensor) -> tuple[Tensor, ...]:
        return tuple(self.f(x) for x in xs)


class MeanVar(nn.Module):
    """A heteroscedastic regressor: a mean and a positive variance per output."""

    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.Linear(IN, 7), nn.Tanh(), nn.Linear(7, 4))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = self.f(x)
        return h[:, :2], F.softplus(h[:, 2:])


class Labelled(NamedTuple):
    y: Tensor
    w: Tensor


def call(model: nn.Module, x: Any) -> Any:
    return model(*x) if isinstance(x, tuple) else model(x)


def member_rows(tree: Any, i: int) -> Any:
    return optree.tree_map(lambda t: t[i], tree)


def train_alone(models: list[nn.Module], batches: list, loss_fn: Callable, per_member: bool):
    """Each module alone: torch.optim.SGD on its batches; returns its losses [steps, n]."""
    losses = []
    for i, m in enumerate(models):
        opt = torch.optim.SGD(m.parameters(), **SGD)
        mine = []
        for x, y in batches:
            if per_member:
                x, y = member_rows(x, i), member_rows(y, i)
            opt.zero_grad()
            loss = loss_fn(call(m, x), y)
            loss.backward()
            opt.step()
            mine.append(loss.detach().reshape(()))  # a [1] loss: one value, as the step
        losses.append(torch.stack(mine))
    return torch.stack(losses, 1)


def check_make_step(
    factory: Callable[[], nn.Module],
    loss_fn: Callable,
    draw: Callable[[torch.Generator], tuple],
    config: str,
    in_dims: int | None = None,
) -> None:
    g = torch.Generator().manual_seed(1)
    batches = [draw(g) for _ in range(STEPS)]
    ens = vmapens.Ensemble(factory, n=N, seed=0, **CONFIGS[config])
    alone = ens.unstack()
    step = vmapens.make_step(ens, loss_fn, vmapens.StackedSGD(ens, **SGD), in_dims=in_dims)
    got = torch.stack([step(x, y) for x, y in batches])
    want = train_alone(alone, batches, loss_fn, per_member=in_dims == 0)
    torch.testing.assert_close(got, want, **TOL)
    for i, m in enumerate(alone):
        torch.testing.assert_close(ens[i].state_dict(), m.state_dict(), **TOL, msg=f"member {i}")


def inputs(g: torch.Generator, k: int = 1, lead: tuple = ()) -> Any:
    xs = tuple(torch.randn(*lead, B, IN, generator=g) for _ in range(k))
    return xs if k > 1 else xs[0]


def classes(g: torch.Generator, lead: tuple = ()) -> Tensor:
    return torch.randint(C, (*lead, B), generator=g)


def signs(g: torch.Generator, *shape: int) -> Tensor:
    return torch.randint(2, shape, generator=g).double() * 2 - 1


def probs(g: torch.Generator) -> Tensor:
    return F.softmax(torch.randn(B, C, generator=g), -1)


def counts(g: torch.Generator) -> Tensor:
    return torch.poisson(torch.full((B, C), 2.0), generator=g)


WEIGHT = torch.linspace(0.5, 2.0, C, dtype=torch.float64)
KL = {lt: nn.KLDivLoss(reduction="batchmean", log_target=lt) for lt in (False, True)}
TRIPLET = nn.TripletMarginLoss(margin=0.5, p=1.5, swap=True)
TRIPLET_COS = nn.TripletMarginWithDistanceLoss(
    distance_function=lambda a, b: 1 - F.cosine_similarity(a, b), margin=0.3, swap=True
)
COSINE, RANKING = nn.CosineEmbeddingLoss(margin=0.2), nn.MarginRankingLoss(margin=0.1)

# name: (factory, loss_fn, draw one batch (x, y))
SHARED: dict[str, tuple[Callable, Callable, Callable]] = {
    "poisson_log_full": (mlp(), nn.PoissonNLLLoss(log_input=True, full=True),
                         lambda g: (inputs(g), counts(g))),
    "poisson_rate_full_sum": (
        mlp(),
        lambda o, y: F.poisson_nll_loss(F.softplus(o), y, log_input=False, full=True,
                                        reduction="sum"),
        lambda g: (inputs(g), counts(g))),
    "kl_batchmean": (mlp(), lambda o, y: KL[False](F.log_softmax(o, -1), y),
                     lambda g: (inputs(g), probs(g))),
    "kl_batchmean_log_target": (mlp(), lambda o, y: KL[True](F.log_softmax(o, -1), y.log()),
                                lambda g: (inputs(g), probs(g))),
    "multimargin_p1": (mlp(), nn.MultiMarginLoss(p=1, margin=0.7, weight=WEIGHT),
                       lambda g: (inputs(g), classes(g))),
    "multimargin_p2_sum": (mlp(), nn.MultiMarginLoss(p=2, margin=0.7, weight=WEIGHT,
                                                     reduction="sum"),
                           lambda g: (inputs(g), classes(g))),
    "multilabel_soft_margin": (mlp(), nn.MultiLabelSoftMarginLoss(weight=WEIGHT),
                               lambda g: (inputs(g), (signs(g, B, C) > 0).double())),
    "smooth_l1_beta": (mlp(), nn.SmoothL1Loss(beta=0.3), lambda g: (inputs(g), signs(g, B, C))),
    "huber_delta_sum": (mlp(), nn.HuberLoss(delta=0.4, reduction="sum"),
                        lambda g: (inputs(g), torch.randn(B, C, generator=g))),
    "soft_margin": (mlp(), nn.SoftMarginLoss(), lambda g: (inputs(g), signs(g, B, C))),
    "hinge_embedding": (mlp(), nn.HingeEmbeddingLoss(margin=0.5),
                        lambda g: (inputs(g), signs(g, B, C))),
    "nll_weight_ignore": (
        mlp(),
        lambda o, y: F.nll_loss(F.log_softmax(o, -1), y, weight=WEIGHT, ignore_index=2),
        lambda g: (inputs(g), classes(g))),
    "ce_probs_smoothing_weight": (mlp(), nn.CrossEntropyLoss(weight=WEIGHT, label_smoothing=0.1),
                                  lambda g: (inputs(g), probs(g))),
    "ce_smoothing_ignore_weight": (
        mlp(), nn.CrossEntropyLoss(weight=WEIGHT, label_smoothing=0.2, ignore_index=1),
        lambda g: (inputs(g), classes(g))),
    "ce_kdim_int32": (  # [B, C, 2] logits; int32 [B, 2] targets reach the loss as int32
        lambda: nn.Sequential(nn.Linear(IN, 2 * C), nn.Unflatten(-1, (C, 2))),
        lambda o, y: F.cross_entropy(o, y.long(), ignore_index=0, label_smoothing=0.1),
        lambda g: (inputs(g), torch.randint(C, (B, 2), generator=g, dtype=torch.int32))),
    "bce_pos_weight": (mlp(), nn.BCEWithLogitsLoss(pos_weight=WEIGHT),
                       lambda g: (inputs(g), (signs(g, B, C) > 0).double())),
    "triplet_swap": (Siamese, lambda o, _: TRIPLET(*o), lambda g: (inputs(g, 3), torch.zeros(1))),
    "triplet_cosine_distance": (Siamese, lambda o, _: TRIPLET_COS(*o),
                                lambda g: (inputs(g, 3), torch.zeros(1))),
    "cosine_embedding": (Siamese, lambda o, y: COSINE(*o, y), lambda g: (inputs(g, 2), signs(g, B))),
    "margin_ranking_tuple_targets": (  # targets (other scores, which ranks first)
        mlp(1), lambda o, t: RANKING(o[:, 0], t[0], t[1]),
        lambda g: (inputs(g), (torch.randn(B, generator=g), signs(g, B)))),
    "dict_targets": (mlp(), lambda o, t: (t["w"] * (o - t["y"]) ** 2).mean(),
                     lambda g: (inputs(g), {"y": torch.randn(B, C, generator=g),
                                            "w": torch.rand(B, 1, generator=g)})),
    "namedtuple_targets": (mlp(), lambda o, t: (t.w * (o - t.y) ** 2).mean(),
                           lambda g: (inputs(g), Labelled(torch.randn(B, C, generator=g),
                                                          torch.rand(B, 1, generator=g)))),
    "loss_of_shape_1": (mlp(), lambda o, y: F.mse_loss(o, y).reshape(1),
                        lambda g: (inputs(g), torch.randn(B, C, generator=g))),
    "loss_in_float32": (mlp(), lambda o, y: F.mse_loss(o, y).float(),  # rounded alike alone
                        lambda g: (inputs(g), torch.randn(B, C, generator=g))),
}  # fmt: skip


@pytest.mark.parametrize("config", ["vmap", "chunks"])
@pytest.mark.parametrize("name", sorted(SHARED))
def test_a_torch_loss_passed_as_it_is_trains_each_member_as_alone(name: str, config: str) -> None:
    """`make_step(ens, nn.SomeLoss(options), opt)`: every member, its loss values included,
    as a plain module trained alone with torch.optim.SGD on the same batches."""
    factory, loss_fn, draw = SHARED[name]
    with warnings.catch_warnings():  # triplet_margin_loss runs through torch's loop fallback
        warnings.filterwarnings("ignore", "There is a performance drop")
        check_make_step(factory, loss_fn, draw, config)


def test_a_loss_in_another_dtype_keeps_its_dtype() -> None:
    """A float32 loss of a float64 member: the step returns float32 losses, as alone."""
    ens = vmapens.Ensemble(mlp(), n=N, seed=0)
    step = vmapens.make_step(ens, SHARED["loss_in_float32"][1], vmapens.StackedSGD(ens, lr=0.1))
    assert step(torch.randn(B, IN), torch.randn(B, C)).dtype == torch.float32


PER_MEMBER: dict[str, tuple[Callable, Callable, Callable]] = {
    "nll_weight_ignore": (mlp(), SHARED["nll_weight_ignore"][1],
                          lambda g: (inputs(g, lead=(N,)), classes(g, (N,)))),
    "multimargin_p2": (mlp(), nn.MultiMarginLoss(p=2, margin=0.7, weight=WEIGHT),
                       lambda g: (inputs(g, lead=(N,)), classes(g, (N,)))),
    # The way to give each member its own class weights: a target column of its own.
    "per_member_class_weights": (
        mlp(), lambda o, t: F.cross_entropy(o, t[0], weight=t[1][0]),
        lambda g: (inputs(g, lead=(N,)),
                   (classes(g, (N,)), (torch.rand(N, 1, C, generator=g) + 0.5).expand(N, B, C)))),
    "tuple_targets": (mlp(), lambda o, t: (t[1] * (o - t[0]) ** 2).mean(),
                      lambda g: (inputs(g, lead=(N,)), (torch.randn(N, B, C, generator=g),
                                                        torch.rand(N, B, 1, generator=g)))),
}  # fmt: skip


@pytest.mark.parametrize("config", ["vmap", "chunks"])
@pytest.mark.parametrize("name", sorted(PER_MEMBER))
def test_per_member_targets_train_each_member_on_its_own(name: str, config: str) -> None:
    """`in_dims=0`: member i's rows of every target tensor (a tuple's too), as alone."""
    factory, loss_fn, draw = PER_MEMBER[name]
    check_make_step(factory, loss_fn, draw, config, in_dims=0)


UNBATCHABLE: dict[str, tuple[Callable, Callable, Callable, int | None]] = {
    # GaussianNLLLoss checks `var < 0` with an `if` (docs/semantics.md).
    "gaussian_nll_var_output": (
        MeanVar, lambda o, y: nn.GaussianNLLLoss(full=True, eps=1e-2)(o[0], y, o[1]),
        lambda g: (inputs(g), torch.randn(B, 2, generator=g)), None),
    # weight + label_smoothing on per-member targets selects rows with a per-member mask.
    "ce_smoothing_weight_per_member": (
        mlp(), nn.CrossEntropyLoss(weight=WEIGHT, label_smoothing=0.2, ignore_index=1),
        lambda g: (inputs(g, lead=(N,)), classes(g, (N,))), 0),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(UNBATCHABLE))
def test_a_loss_vmap_cannot_batch_is_refused_naming_loop_and_loop_trains_as_alone(name: str):
    factory, loss_fn, draw, in_dims = UNBATCHABLE[name]
    ens = vmapens.Ensemble(factory, n=N, seed=0)
    before = copy.deepcopy(ens.state_dict())
    step = vmapens.make_step(ens, loss_fn, vmapens.StackedSGD(ens, **SGD), in_dims=in_dims)
    with pytest.raises(RuntimeError, match=r"step: `loss_fn`.*backend='loop'"):
        step(*draw(torch.Generator().manual_seed(1)))
    torch.testing.assert_close(ens.state_dict(), before, rtol=0, atol=0)
    check_make_step(factory, loss_fn, draw, "loop", in_dims=in_dims)


def test_per_member_in_a_hand_written_loop_runs_gaussian_nll_member_by_member():
    """`per_member(nn.GaussianNLLLoss(...), in_dims=(0, None, 0))(mean, y, var)` with the
    variance a model output: vmap cannot batch its check, so it runs member by member."""
    gnll = nn.GaussianNLLLoss(full=True, eps=1e-2, reduction="sum")
    g = torch.Generator().manual_seed(1)
    batches = [(inputs(g), torch.randn(B, 2, generator=g)) for _ in range(STEPS)]
    ens = vmapens.Ensemble(MeanVar, n=N, seed=0)
    alone = ens.unstack()
    opt = torch.optim.SGD(ens.parameters(), **SGD)
    got = []
    for x, y in batches:
        mean, var = ens(x)
        loss = vmapens.per_member(gnll, in_dims=(0, None, 0))(mean, y, var)
        opt.zero_grad()
        loss.sum().backward()
        opt.step()
        got.append(loss.detach())
    want = train_alone(alone, batches, lambda o, y: gnll(o[0], y, o[1]), per_member=False)
    torch.testing.assert_close(torch.stack(got), want, **TOL)
    for i, m in enumerate(alone):
        torch.testing.assert_close(ens[i].state_dict(), m.state_dict(), **TOL)


def test_reduction_none_in_a_hand_written_loop_is_each_members_elementwise_loss():
    """`per_member(nn.SmoothL1Loss(reduction="none"))` gives `[n, B, C]`: member i's row is
    its own elementwise loss, and `.sum()` trains it as `loss.sum().backward()` alone."""
    x, y = torch.randn(B, IN), torch.randn(B, C)
    ens = vmapens.Ensemble(mlp(), n=N, seed=0)
    alone = ens.unstack()
    loss = vmapens.per_member(nn.SmoothL1Loss(beta=0.5, reduction="none"))(ens(x), y)
    assert loss.shape == (N, B, C)
    loss.sum().backward()
    for i, m in enumerate(alone):
        mine = nn.SmoothL1Loss(beta=0.5, reduction="none")(m(x), y)
        mine.sum().backward()
        torch.testing.assert_close(loss[i], mine, **TOL)
        for p, stacked in zip(m.parameters(), ens.parameters(), strict=True):
            torch.testing.assert_close(stacked.grad[i], p.grad, **TOL)


@pytest.mark.parametrize("api", ["make_step", "fit"])
def test_reduction_none_is_refused_before_anything_changes(api: str) -> None:
    """A non-scalar member loss: alone `loss.backward()` refuses it; so do the step and fit."""
    x, y = torch.randn(B, IN), classes(torch.Generator().manual_seed(0))
    ens = vmapens.Ensemble(mlp(), n=N, seed=0)
    before = copy.deepcopy(ens.state_dict())
    loss_fn = nn.CrossEntropyLoss(reduction="none")
    with pytest.raises(ValueError, match=r"one value per member.*got \[6\].*reduction='mean'"):
        if api == "fit":
            vmapens.fit(ens, (x, y), loss_fn, progress=False, seed=0)
        else:
            vmapens.make_step(ens, loss_fn, vmapens.StackedSGD(ens, lr=0.1))(x, y)
    torch.testing.assert_close(ens.state_dict(), before, rtol=0, atol=0)


def test_a_loss_returning_a_python_float_is_refused() -> None:
    """`float(loss)` has no gradient: alone `.backward()` fails; the loop step says so."""
    ens = vmapens.Ensemble(mlp(), n=N, seed=0, backend="loop")
    step = vmapens.make_step(ens, lambda o, y: float(F.mse_loss(o, y)), vmapens.StackedSGD(ens))
    with pytest.raises(ValueError, match=r"one value per member \(a scalar tensor\), got float"):
        step(torch.randn(B, IN), torch.randn(B, C))


def test_a_loss_closing_over_every_members_class_weights_is_refused_as_alone() -> None:
    """`lambda o, y: F.cross_entropy(o, y, weight=W)` with `W` `[n, C]`: each member would get
    all of `W`, which torch's own check refuses, in the ensemble as alone; per_member with
    `in_dims=(0, None, 0)` gives member i its row `W[i]` (docs/semantics.md)."""
    g = torch.Generator().manual_seed(0)
    x, y, w = torch.randn(B, IN, generator=g), classes(g), torch.rand(N, C, generator=g) + 0.5
    ens = vmapens.Ensemble(mlp(), n=N, seed=0)
    step = vmapens.make_step(ens, lambda o, t: F.cross_entropy(o, t, weight=w),
                             vmapens.StackedSGD(ens, lr=0.1))  # fmt: skip
    with pytest.raises((RuntimeError, AssertionError), match="weight tensor should be defined"):
        step(x, y)
    own = vmapens.per_member(lambda o, t, wi: F.cross_entropy(o, t, weight=wi, label_smoothing=0.1),
                             in_dims=(0, None, 0))(ens(x), y, w)  # fmt: skip
    want = [F.cross_entropy(m(x), y, weight=w[i], label_smoothing=0.1) for i, m in
            enumerate(ens.unstack())]  # fmt: skip
    torch.testing.assert_close(own, torch.stack(want), **TOL)


def test_fit_with_kl_batchmean_tuple_targets_and_validation_matches_alone() -> None:
    """`fit(ens, (X, (P, W)), loss)`: targets a tuple (soft labels, per-sample weights) cut by
    the same rows; KLDiv 'batchmean' divides by each batch's own rows (the last one shorter);
    the validation loss is the member's loss on all of `val_data` in eval mode."""
    g = torch.Generator().manual_seed(0)
    x, p, w = torch.randn(10, IN, generator=g), probs(g).repeat(2, 1)[:10], torch.rand(10, 1)
    xv, pv = torch.randn(4, IN, generator=g), probs(g)[:4]
    kl = nn.KLDivLoss(reduction="batchmean")

    def loss_fn(o: Tensor, t: tuple[Tensor, Tensor]) -> Tensor:
        return kl(F.log_softmax(o, -1) * t[1], t[0] * t[1])

    ens = vmapens.Ensemble(mlp(), n=N, seed=0)
    alone = ens.unstack()
    h = vmapens.fit(ens, (x, (p, w)), loss_fn, epochs=2, batch_size=4, shuffle=False,
                    val_data=(xv, (pv, torch.ones(4, 1))), optimizer=vmapens.StackedSGD,
                    progress=False, seed=0, **SGD)  # fmt: skip
    batches = [(x[k : k + 4], (p[k : k + 4], w[k : k + 4])) for k in (0, 4, 8)] * 2
    train_alone(alone, batches, loss_fn, per_member=False)
    for i, m in enumerate(alone):
        torch.testing.assert_close(ens[i].state_dict(), m.state_dict(), **TOL)
        with torch.no_grad():
            val = loss_fn(m.eval()(xv), (pv, torch.ones(4, 1)))
        torch.testing.assert_close(h.val_loss[-1, i], val, **TOL)


def test_fit_takes_int32_class_targets_as_their_int64_values() -> None:
    """docs/fit.md: class targets int64 or int32. Member i as alone on `Y.long()`."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, IN, generator=g), torch.randint(C, (8,), generator=g)
    loss_fn = nn.CrossEntropyLoss(weight=WEIGHT, label_smoothing=0.1)
    ens = vmapens.Ensemble(mlp(), n=N, seed=0)
    alone = ens.unstack()
    vmapens.fit(ens, (x, y.int()), loss_fn, epochs=2, optimizer=vmapens.StackedSGD,
                progress=False, seed=0, **SGD)  # fmt: skip
    train_alone(alone, [(x, y)] * 2, loss_fn, per_member=False)
    for i, m in enumerate(alone):
        torch.testing.assert_close(ens[i].state_dict(), m.state_dict(), **TOL)


# -- bugs -------------------------------------------------------------------------------------


@pytest.mark.xfail(strict=True, reason="per_member: BCEWithLogits of a float64 member with "
                   "float32 targets runs in float64 under vmap, in float32 alone")  # fmt: skip
def test_per_member_bce_with_float32_targets_gives_what_alone_gives() -> None:
    """torch alone computes `binary_cross_entropy_with_logits(float64 logits, float32 targets)`
    in float32 (in-place ops on `1 - target`); vmap's batched version in float64. The step
    refuses it (its self-check sees the loss dtype differ); `per_member` in a hand-written
    loop gives a float64 loss and gradients ~1e-7 off each member's alone, silently."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(B, IN, generator=g), (signs(g, B, C) > 0).float()
    loss_fn = nn.BCEWithLogitsLoss(pos_weight=WEIGHT)
    ens = vmapens.Ensemble(mlp(), n=N, seed=0)
    loss = vmapens.per_member(loss_fn)(ens(x), y)
    loss.sum().backward()
    for i, m in enumerate(ens.unstack()):
        mine = loss_fn(m(x), y)
        mine.backward()
        torch.testing.assert_close(loss[i], mine, **TOL)  # dtype and value
        for p, stacked in zip(m.parameters(), ens.parameters(), strict=True):
            torch.testing.assert_close(stacked.grad[i], p.grad, **TOL)


def test_a_class_weight_torch_refuses_alone_is_refused_by_the_step() -> None:
    """Class weights from numpy (float64) for float32 members: torch alone raises "expected
    scalar type Float but found Double", so does the loop backend; the vmap step trains on
    the float64 loss (members ~1e-7 from alone with `weight.float()`), a run no member alone
    could make."""
    x, y = torch.randn(B, IN, dtype=torch.float32), classes(torch.Generator().manual_seed(0))
    loss_fn = nn.CrossEntropyLoss(weight=WEIGHT)  # float64
    ens = vmapens.Ensemble(lambda: mlp()().float(), n=N, seed=0)
    with pytest.raises(RuntimeError, match="expected scalar type Float but found Double"):
        loss_fn(ens[0](x), y)  # alone
    step = vmapens.make_step(ens, loss_fn, vmapens.StackedSGD(ens, lr=0.1))
    with pytest.raises(RuntimeError, match="step: .*alone"):
        step(x, y)
