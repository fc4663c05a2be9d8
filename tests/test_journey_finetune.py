"""A user journey: many heads fine-tuned on one pretrained backbone with `fit`.

The script a researcher writes: a "pretrained" backbone (Linear + BatchNorm1d, float64) loaded
into every member, each member its own head; the backbone frozen (`requires_grad_(False)`,
its BatchNorm in eval mode by `backbone.eval()`) for 2 epochs of `fit` with one head learning
rate per member and validation (best-epoch restore); then unfrozen (`requires_grad_(True)`,
`backbone.train()`) and trained 2 more epochs, its parameters added to the optimizer with a
smaller rate (`add_param_group`, or a new optimizer over both groups, as docs/optim.md
offers); then `save_members`. A second script computes the frozen backbone once, outside the
ensemble, and trains an ensemble of heads on its features: the heads must end as those of
the in-member frozen run. The truth is the naive loop in plain PyTorch, one member at a time:
its own frozen copy, `torch.optim.Adam`, batches from docs/fit.md's documented order
(`truth.batch_plan`), validation in eval mode with each submodule's mode restored after it,
and best-epoch restore written from `EarlyStopping`'s documented rule (a strictly lower
validation loss is an improvement; parameters and buffers of the best epoch come back at
the end).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from truth import batch_plan, derived_seed

import vmapens

pytestmark = pytest.mark.usefixtures("float64_default")

N, ROWS, VAL_ROWS, BATCH = 3, 20, 12, 8
STEPS = 3  # per epoch: 20 rows in batches of 8
HEAD_LRS = [0.05, 0.02, 0.1]
BACKBONE_LR = 1e-2
SEED1, SEED2 = 11, 12  # the two fit calls' data seeds
TOL: dict[str, Any] = {"atol": 1e-10, "rtol": 1e-10}


def backbone() -> nn.Sequential:
    # bias=False before BatchNorm: in train mode that bias's true gradient is 0 and Adam would
    # step on its round-off (docs/semantics.md), alone as in the ensemble.
    return nn.Sequential(nn.Linear(4, 6, bias=False), nn.BatchNorm1d(6), nn.ReLU())


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = backbone()
        self.head = nn.Linear(6, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.backbone(x))


def pretrained() -> dict[str, Tensor]:
    """The backbone as a pretraining run left it: running statistics far from (0, 1), so a
    BatchNorm that is not in eval mode shows at once."""
    torch.manual_seed(100)
    b = backbone()
    with torch.no_grad():
        b[1].running_mean.copy_(torch.linspace(-1, 1, 6))
        b[1].running_var.copy_(torch.linspace(0.5, 2, 6))
        b[1].num_batches_tracked.fill_(50)
        b[1].weight.copy_(torch.linspace(0.8, 1.2, 6))
    return copy.deepcopy(b.state_dict())


def data() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, 4, generator=g)
    xv = torch.randn(VAL_ROWS, 4, generator=g)
    w = torch.randn(4, 2, generator=g)
    return x, x @ w, xv, xv @ w


def member(i: int, frozen: bool) -> Net:
    """Member `i` as the factory builds it under `Ensemble(..., seed=0)`: its own head from
    the member seed of docs/semantics.md, the pretrained backbone loaded."""
    torch.manual_seed(derived_seed(0, "member", i))
    m = Net()
    m.backbone.load_state_dict(pretrained())
    if frozen:
        m.backbone.requires_grad_(False)
        m.backbone.eval()
    return m


def modes(m: nn.Module) -> dict[str, bool]:
    return {k: s.training for k, s in m.named_modules()}


def flags(m: nn.Module) -> dict[str, bool]:
    return {k: p.requires_grad for k, p in m.named_parameters()}


def naive_fit(m: nn.Module, opt: torch.optim.Optimizer, epochs: int, seed: int) -> None:
    """One plain `fit(epochs=..., batch_size=BATCH, val_data=..., seed=seed)` call."""
    x, y, xv, yv = data()
    plan = batch_plan(ROWS, BATCH, epochs * STEPS, seed=seed)
    best, best_state = float("inf"), None
    for e in range(epochs):
        for rows in plan[e * STEPS : (e + 1) * STEPS]:
            opt.zero_grad()
            nn.functional.mse_loss(m(x[rows]), y[rows]).backward()
            opt.step()
        before = modes(m)
        m.eval()
        with torch.no_grad():
            val = float(nn.functional.mse_loss(m(xv), yv))
        for k, s in m.named_modules():
            s.training = before[k]
        if val < best:
            best, best_state = val, copy.deepcopy(m.state_dict())
    assert best_state is not None
    m.load_state_dict(best_state)


def naive(i: int, new_optimizer: bool) -> tuple[dict[str, Tensor], Net]:
    """Member `i` by the naive loop: its state after the frozen phase, and the model at the end."""
    m = member(i, frozen=True)
    opt = torch.optim.Adam(m.head.parameters(), lr=HEAD_LRS[i])
    naive_fit(m, opt, 2, SEED1)
    after_frozen = copy.deepcopy(m.state_dict())
    m.backbone.requires_grad_(True)
    m.backbone.train()
    if new_optimizer:
        opt = torch.optim.Adam(
            [
                {"params": m.head.parameters(), "lr": HEAD_LRS[i]},
                {"params": m.backbone.parameters(), "lr": BACKBONE_LR},
            ]
        )
    else:
        opt.add_param_group({"params": list(m.backbone.parameters()), "lr": BACKBONE_LR})
    naive_fit(m, opt, 2, SEED2)
    return after_frozen, m


def fit(ens: vmapens.Ensemble, opt: torch.optim.Optimizer, seed: int, **kw: Any) -> Any:
    x, y, xv, yv = data()
    return vmapens.fit(
        ens,
        (x, y),
        nn.MSELoss(),
        optimizer=opt,
        epochs=2,
        batch_size=BATCH,
        val_data=(xv, yv),
        seed=seed,
        progress=False,
        **kw,
    )


def named(ens: vmapens.Ensemble, prefix: str) -> list[Tensor]:
    return [p for k, p in ens.named_parameters() if k.startswith(prefix)]


def assert_member(ens: vmapens.Ensemble, i: int, truth: nn.Module) -> None:
    got = ens[i]
    assert modes(got) == modes(truth)
    assert flags(got) == flags(truth)
    want = truth.state_dict()
    for k, v in got.state_dict().items():
        if v.is_floating_point():
            torch.testing.assert_close(v, want[k], **TOL, msg=f"member {i} {k}")
        else:
            assert torch.equal(v, want[k]), f"member {i} {k}"


@pytest.mark.parametrize(
    "build,unfreeze",
    [("from_modules", "add_param_group"), ("factory", "new_optimizer")],
)
def test_frozen_backbone_then_unfrozen_ends_as_the_naive_loop(
    build: str, unfreeze: str, tmp_path: Path
) -> None:
    if build == "from_modules":
        ens = vmapens.Ensemble.from_modules([member(i, frozen=True) for i in range(N)])
    else:  # the factory loads the backbone; the user freezes it on the ensemble's template
        ens = vmapens.Ensemble(lambda: member_from_global(), n=N, seed=0)
        ens.template.backbone.requires_grad_(False)
        ens.template.backbone.eval()
    pre = pretrained()
    truths = [naive(i, unfreeze == "new_optimizer") for i in range(N)]

    opt = vmapens.StackedAdam(named(ens, "head."), lr=HEAD_LRS)
    fit(ens, opt, SEED1)
    for i, (after_frozen, _) in enumerate(truths):
        got = ens[i]
        assert not got.backbone.training and got.head.training and got.training
        assert flags(got) == {k: k.startswith("head.") for k in flags(got)}
        for k, v in got.backbone.state_dict().items():  # bit for bit: nothing moved
            assert torch.equal(v, pre[k]), f"member {i} backbone.{k} moved while frozen"
        for k, v in got.head.state_dict().items():
            torch.testing.assert_close(v, after_frozen[f"head.{k}"], **TOL)

    ens.template.backbone.requires_grad_(True)
    ens.template.backbone.train()
    if unfreeze == "new_optimizer":
        opt = vmapens.StackedAdam(
            [
                {"params": named(ens, "head."), "lr": HEAD_LRS},
                {"params": named(ens, "backbone."), "lr": BACKBONE_LR},
            ]
        )
    else:
        opt.add_param_group({"params": named(ens, "backbone."), "lr": BACKBONE_LR})
    fit(ens, opt, SEED2)
    for i, (_, truth) in enumerate(truths):
        assert_member(ens, i, truth)
        backbone_now = ens[i].backbone.state_dict()
        assert not torch.equal(backbone_now["0.weight"], pre["0.weight"])
        assert not torch.equal(backbone_now["1.running_mean"], pre["1.running_mean"])
    # Each member's backbone moved its own way once unfrozen.
    assert not torch.equal(ens[0].backbone[0].weight, ens[1].backbone[0].weight)

    paths = vmapens.save_members(ens, tmp_path / "members")
    for i, (path, (_, truth)) in enumerate(zip(paths, truths, strict=True)):
        plain = Net()
        plain.load_state_dict(torch.load(path, weights_only=True))
        for k, v in plain.state_dict().items():
            want = truth.state_dict()[k]
            if v.is_floating_point():
                torch.testing.assert_close(v, want, **TOL, msg=f"file {i} {k}")
            else:
                assert torch.equal(v, want)


def member_from_global() -> Net:
    # Ensemble(factory, seed=0) seeds torch before each call; the factory loads the backbone.
    m = Net()
    m.backbone.load_state_dict(pretrained_cached())
    return m


_PRE: dict[str, Tensor] = {}


def pretrained_cached() -> dict[str, Tensor]:
    # Cached: `pretrained()` reseeds torch's global RNG, which a factory must not do.
    if not _PRE:
        state = torch.random.get_rng_state()
        _PRE.update(pretrained())
        torch.random.set_rng_state(state)
    return _PRE


def test_a_shared_frozen_backbone_gives_the_heads_of_the_in_member_frozen_run() -> None:
    ens = vmapens.Ensemble.from_modules([member(i, frozen=True) for i in range(N)])
    heads = vmapens.Ensemble.from_modules([member(i, frozen=True).head for i in range(N)])
    fit(ens, vmapens.StackedAdam(named(ens, "head."), lr=HEAD_LRS), SEED1)

    shared = backbone()
    shared.load_state_dict(pretrained())
    shared.eval()
    x, y, xv, yv = data()
    with torch.no_grad():
        features, val_features = shared(x), shared(xv)
    vmapens.fit(
        heads,
        (features, y),
        nn.MSELoss(),
        optimizer=vmapens.StackedAdam(heads.parameters(), lr=HEAD_LRS),
        epochs=2,
        batch_size=BATCH,
        val_data=(val_features, yv),
        seed=SEED1,
        progress=False,
    )
    for i in range(N):
        for k, v in heads[i].state_dict().items():
            torch.testing.assert_close(v, ens[i].head.state_dict()[k], **TOL)
        truth, _ = naive(i, new_optimizer=False)
        for k, v in heads[i].state_dict().items():
            torch.testing.assert_close(v, truth[f"head.{k}"], **TOL)


class _Interrupt(vmapens.callbacks.Callback):
    """Ctrl-C in the second epoch's second step: the checkpoint holds the first epoch."""

    def on_step_end(self, ctx: vmapens.callbacks.Context) -> None:
        if ctx.step == STEPS + 2:
            raise KeyboardInterrupt


class _Steps(vmapens.callbacks.Callback):
    def __init__(self) -> None:
        self.count = 0

    def on_step_end(self, ctx: vmapens.callbacks.Context) -> None:
        self.count += 1


def test_the_unfrozen_phase_resumes_from_its_checkpoint_with_per_member_backbone_rates(
    tmp_path: Path,
) -> None:
    rates = [1e-2, 3e-3, 2e-2]  # one backbone rate per member in the added group

    def script(callbacks: list[Any]) -> vmapens.Ensemble:  # the researcher's script, rerun
        ens = vmapens.Ensemble.from_modules([member(i, frozen=True) for i in range(N)])
        opt = vmapens.StackedAdam(named(ens, "head."), lr=HEAD_LRS)
        fit(ens, opt, SEED1)
        ens.template.backbone.requires_grad_(True)
        ens.template.backbone.train()
        opt.add_param_group({"params": named(ens, "backbone."), "lr": rates})
        fit(ens, opt, SEED2, checkpoint=tmp_path / "phase2.pt", callbacks=callbacks)
        return ens

    with pytest.raises(KeyboardInterrupt):
        script([_Interrupt()])
    steps = _Steps()
    resumed = script([steps])
    assert steps.count == STEPS  # the second epoch only: it resumed
    for i in range(N):
        truth = member(i, frozen=True)
        opt = torch.optim.Adam(truth.head.parameters(), lr=HEAD_LRS[i])
        naive_fit(truth, opt, 2, SEED1)
        truth.backbone.requires_grad_(True)
        truth.backbone.train()
        opt.add_param_group({"params": list(truth.backbone.parameters()), "lr": rates[i]})
        naive_fit(truth, opt, 2, SEED2)
        assert_member(resumed, i, truth)
