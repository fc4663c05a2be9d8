"""Hunt (session 44, b): what users change in the middle of training, in plain PyTorch's orders.

Fine-tuning phases (a backbone frozen with `requires_grad_(False)` on the template and
unfrozen, one optimizer throughout or groups added with `add_param_group`, one lr per group),
BatchNorm frozen or switched to a cumulative average mid-run, gradient accumulation over
micro-batches with per-member clipping and `zero_grad(set_to_none=False)`, torch's LR
schedulers resumed from `vmapens.save`/`restore` mid-schedule, and dtype moves after the
optimizer exists. The truth is N plain copies of the members (`ens.unstack()` before
training), each trained alone with `torch.optim` and `torch.optim.lr_scheduler`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim import lr_scheduler as sched

import vmapens

N = 3
TOL: dict[str, Any] = {"atol": 1e-12, "rtol": 1e-12}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 6), nn.Tanh())
        self.head = nn.Linear(6, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.backbone(x))


class BNNet(nn.Module):
    def __init__(self, momentum: float | None = 0.1, track: bool = True) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6, bias=False)  # no bias before BatchNorm (docs/semantics.md)
        self.bn = nn.BatchNorm1d(6, momentum=momentum, track_running_stats=track)
        self.head = nn.Linear(6, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.relu(self.bn(self.fc(x))))


def data(k: int, rows: int = 8, dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(k)
    x = torch.randn(rows, 4, generator=g, dtype=torch.float64)
    y = torch.randn(rows, 2, generator=g, dtype=torch.float64)
    return x.to(dtype), y.to(dtype)


def ens_loss(ens: vmapens.Ensemble, x: Tensor, y: Tensor) -> Tensor:
    return ((ens(x) - y) ** 2).mean(dim=(1, 2))


def assert_members(ens: vmapens.Ensemble, alone: list[nn.Module], **tol: Any) -> None:
    tol = tol or TOL
    for i, m in enumerate(alone):
        got, want = ens[i].state_dict(), m.state_dict()
        assert list(got) == list(want)
        for k in want:
            torch.testing.assert_close(
                got[k], want[k], **tol, msg=lambda s, k=k, i=i: f"{i} {k}: {s}"
            )


def both(ens: vmapens.Ensemble, alone: list[nn.Module], fn: Callable[[nn.Module], Any]) -> None:
    fn(ens.template)
    for m in alone:
        fn(m)


def plain_step(ens, opt, alone, opts, x, y, set_to_none: bool = True) -> None:
    opt.zero_grad(set_to_none=set_to_none)
    ens_loss(ens, x, y).sum().backward()
    opt.step()
    for m, o in zip(alone, opts, strict=True):
        o.zero_grad(set_to_none=set_to_none)
        F.mse_loss(m(x), y).backward()
        o.step()


# --- 1. Fine-tuning phases -------------------------------------------------------------------

OPTIMS = {
    "adam-wd": ("Adam", {"lr": 0.05, "weight_decay": 0.1}),
    "sgd-momentum-wd": ("SGD", {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}),
    "rmsprop-momentum": ("RMSprop", {"lr": 0.01, "momentum": 0.5}),
    "adagrad": ("Adagrad", {"lr": 0.05}),
    "rprop": ("Rprop", {"lr": 0.01}),
    "nadam": ("NAdam", {"lr": 0.01}),
}


@pytest.mark.usefixtures("float64_default")
@pytest.mark.parametrize("which, set_to_none", [(w, False) for w in OPTIMS] + [("adam-wd", True)])
def test_freeze_then_unfreeze_the_backbone_with_one_optimizer(
    which: str, set_to_none: bool
) -> None:
    # zero_grad(set_to_none=False): the frozen backbone keeps a zero .grad, and torch steps it
    # (Adam's moments decay, weight decay applies); with None it is skipped. Both as alone.
    name, kw = OPTIMS[which]
    ens = vmapens.Ensemble(Net, N, seed=0)
    alone = [copy.deepcopy(m) for m in ens.unstack()]
    opt = getattr(vmapens, "Stacked" + name)(ens, **kw)
    opts = [getattr(torch.optim, name)(m.parameters(), **kw) for m in alone]
    for k in range(2):
        plain_step(ens, opt, alone, opts, *data(k), set_to_none)
    both(ens, alone, lambda m: m.backbone.requires_grad_(False))
    for k in range(10, 13):
        plain_step(ens, opt, alone, opts, *data(k), set_to_none)
    assert_members(ens, alone)
    both(ens, alone, lambda m: m.backbone.requires_grad_(True))
    for k in range(20, 23):
        plain_step(ens, opt, alone, opts, *data(k), set_to_none)
    assert_members(ens, alone)


def _groups(head: list, backbone: list) -> list[dict]:
    return [{"params": head, "lr": 0.05}, {"params": backbone, "lr": 0.01}]


@pytest.mark.usefixtures("float64_default")
@pytest.mark.parametrize(
    "variant, how, clip",
    [("two-groups", "loop", None), ("two-groups", "make_step", 0.3),
     ("add_param_group", "loop", 0.3), ("add_param_group", "make_step", None)],
)  # fmt: skip
def test_head_first_then_backbone_with_its_own_lr(
    variant: str, how: str, clip: float | None
) -> None:
    ens = vmapens.Ensemble(Net, N, seed=0)
    alone = [copy.deepcopy(m) for m in ens.unstack()]
    sp = ens.stacked_params()
    head = [sp["head.weight"], sp["head.bias"]]
    backbone = [p for k, p in sp.items() if k.startswith("backbone")]
    both(ens, alone, lambda m: m.backbone.requires_grad_(False))
    if variant == "two-groups":
        opt = vmapens.StackedAdam(_groups(head, backbone), lr=0.02)
        opts = [
            torch.optim.Adam(_groups(list(m.head.parameters()), list(m.backbone.parameters())))
            for m in alone
        ]
    else:
        opt = vmapens.StackedAdam(head, lr=0.05)
        opts = [torch.optim.Adam(m.head.parameters(), lr=0.05) for m in alone]
    step = (
        vmapens.make_step(ens, nn.MSELoss(), opt, clip_grad_norm=clip)
        if how == "make_step"
        else None
    )

    def phase(k0: int) -> None:
        for k in range(k0, k0 + 3):
            x, y = data(k)
            if step is not None:
                step(x, y)
            else:
                opt.zero_grad()
                ens_loss(ens, x, y).sum().backward()
                if clip is not None:
                    vmapens.optim.clip_grad_norm_(ens, clip)
                opt.step()
            for m, o in zip(alone, opts, strict=True):
                o.zero_grad()
                F.mse_loss(m(x), y).backward()
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
                o.step()

    phase(0)
    assert_members(ens, alone)
    both(ens, alone, lambda m: m.backbone.requires_grad_(True))
    if variant == "add_param_group":
        opt.add_param_group({"params": backbone, "lr": 0.01})
        for m, o in zip(alone, opts, strict=True):
            o.add_param_group({"params": list(m.backbone.parameters()), "lr": 0.01})
    phase(20)
    assert_members(ens, alone)


# --- 2. BatchNorm frozen or switched mid-run --------------------------------------------------

BN_PLANS = {
    "bn-eval-mid": ["step", "step", "bn.eval", "step", "step", "bn.train", "step"],
    "momentum-none-mid": ["step", "mom.None", "step", "step", "mom.0.3", "step"],
    "bn-params-frozen-and-eval": ["step", "bn.freeze", "bn.eval", "step", "step"],
    "track-off-mid": ["step", "track.off", "step", "step", "track.on", "step"],
    "all-eval-step": ["step", "eval", "step", "train", "step"],
}
BN_ACTIONS: dict[str, Callable[[nn.Module], Any]] = {
    "bn.eval": lambda m: m.bn.eval(),
    "bn.train": lambda m: m.bn.train(),
    "mom.None": lambda m: setattr(m.bn, "momentum", None),
    "mom.0.3": lambda m: setattr(m.bn, "momentum", 0.3),
    "bn.freeze": lambda m: m.bn.requires_grad_(False),
    "track.off": lambda m: setattr(m.bn, "track_running_stats", False),
    "track.on": lambda m: setattr(m.bn, "track_running_stats", True),
}


@pytest.mark.usefixtures("float64_default")
@pytest.mark.parametrize("how", ["make_step"])  # the loop held too (session 44's hunt)
@pytest.mark.parametrize("plan", list(BN_PLANS))
@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
def test_batchnorm_changed_between_steps_then_eval_predictions(
    momentum: float | None, plan: str, how: str
) -> None:
    ens = vmapens.Ensemble(lambda: BNNet(momentum), N, seed=0)
    alone = [copy.deepcopy(m) for m in ens.unstack()]
    opt = vmapens.StackedAdam(ens, lr=0.02)
    opts = [torch.optim.Adam(m.parameters(), lr=0.02) for m in alone]
    step = vmapens.make_step(ens, nn.MSELoss(), opt) if how == "make_step" else None
    k = 0
    for action in BN_PLANS[plan]:
        if action == "step":
            x, y = data(k)
            k += 1
            if step is not None:
                step(x, y)
                for m, o in zip(alone, opts, strict=True):
                    o.zero_grad()
                    F.mse_loss(m(x), y).backward()
                    o.step()
            else:
                plain_step(ens, opt, alone, opts, x, y)
        elif action in ("eval", "train"):
            getattr(ens, action)()
            for m in alone:
                getattr(m, action)()
        else:
            both(ens, alone, BN_ACTIONS[action])
    assert_members(ens, alone)
    ens.eval()
    x, _ = data(99)
    with torch.no_grad():
        out = ens(x)
        for i, m in enumerate(alone):
            torch.testing.assert_close(out[i], m.eval()(x), **TOL)


# --- 3. Accumulation over micro-batches, clipping ---------------------------------------------


@pytest.mark.usefixtures("float64_default")
@pytest.mark.parametrize(
    "clip, set_to_none",
    [(None, False), ("norm-per-member", False), ("norm-per-member", True), ("norm-inf", False),
     ("norm-1", True), ("value", False)],
)  # fmt: skip
def test_accumulated_micro_batches_clipped_per_member(clip: str | None, set_to_none: bool) -> None:
    # k micro-batches of other sizes, each loss / k, one step; the head's bias frozen after
    # two steps (a zero .grad with set_to_none=False counts in torch's norm, as zero).
    ens = vmapens.Ensemble(Net, N, seed=0)
    alone = [copy.deepcopy(m) for m in ens.unstack()]
    opt = vmapens.StackedAdam(ens, lr=0.05)
    opts = [torch.optim.Adam(m.parameters(), lr=0.05) for m in alone]
    max_norm = [0.3, 1.0, 0.05]
    micro = 3
    for s in range(4):
        if s == 2:
            both(ens, alone, lambda m: m.head.bias.requires_grad_(False))
        opt.zero_grad(set_to_none=set_to_none)
        for o in opts:
            o.zero_grad(set_to_none=set_to_none)
        for j in range(micro):
            x, y = data(10 * s + j, rows=3 + j)
            (ens_loss(ens, x, y) / micro).sum().backward()
            for m in alone:
                (F.mse_loss(m(x), y) / micro).backward()
        norms = want = None
        if clip == "norm-per-member":
            norms = vmapens.optim.clip_grad_norm_(ens, max_norm=torch.tensor(max_norm))
            want = [
                torch.nn.utils.clip_grad_norm_(m.parameters(), c) for m, c in zip(alone, max_norm)
            ]
        elif clip == "norm-inf":
            norms = vmapens.optim.clip_grad_norm_(ens.parameters(), 0.1, norm_type="inf")
            want = [
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1, norm_type="inf") for m in alone
            ]
        elif clip == "norm-1":
            norms = vmapens.optim.clip_grad_norm_(ens, 0.5, norm_type=1.0)
            want = [
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5, norm_type=1.0) for m in alone
            ]
        elif clip == "value":
            torch.nn.utils.clip_grad_value_(ens.parameters(), 0.02)
            for m in alone:
                torch.nn.utils.clip_grad_value_(m.parameters(), 0.02)
        if norms is not None:
            torch.testing.assert_close(norms, torch.stack(want), **TOL)
        opt.step()
        for o in opts:
            o.step()
    assert_members(ens, alone)


# --- 4. Schedulers resumed mid-schedule -------------------------------------------------------

SCHEDULES: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "onecycle": lambda o: sched.OneCycleLR(o, max_lr=0.05, total_steps=12),
    "lambda-per-group": lambda o: sched.LambdaLR(o, [lambda e: 0.9**e, lambda e: 1.0 / (1 + e)]),
    "sequential": lambda o: sched.SequentialLR(
        o,
        [sched.LinearLR(o, start_factor=0.1, total_iters=3), sched.ExponentialLR(o, 0.8)],
        milestones=[3],
    ),
    "cosine-warm-restarts": lambda o: sched.CosineAnnealingWarmRestarts(o, T_0=3, T_mult=2),
    "cyclic": lambda o: sched.CyclicLR(
        o, base_lr=0.001, max_lr=0.05, step_size_up=3, cycle_momentum=False
    ),
}


@pytest.mark.usefixtures("float64_default")
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_a_schedule_over_two_groups_resumed_from_a_checkpoint_across_a_frozen_phase(
    schedule: str, tmp_path: Path
) -> None:
    make = SCHEDULES[schedule]

    def stacked(ens: vmapens.Ensemble) -> vmapens.StackedAdam:
        sp = ens.stacked_params()
        bb = [p for k, p in sp.items() if k.startswith("backbone")]
        return vmapens.StackedAdam(_groups([sp["head.weight"], sp["head.bias"]], bb), lr=0.02)

    def plain(m: Net) -> torch.optim.Adam:
        return torch.optim.Adam(_groups(list(m.head.parameters()), list(m.backbone.parameters())))

    ens = vmapens.Ensemble(Net, N, seed=0)
    alone = [copy.deepcopy(m) for m in ens.unstack()]
    opt = stacked(ens)
    opts = [plain(m) for m in alone]
    sch, schs = make(opt), [make(o) for o in opts]
    for s in range(10):
        if s == 2:
            both(ens, alone, lambda m: m.backbone.requires_grad_(False))
        if s == 5:  # save, then resume in a "new process": fresh objects, frozen again
            path = tmp_path / "c.pt"
            vmapens.save(ens, path, opt)
            sch_sd = copy.deepcopy(sch.state_dict())
            plain_sds = [
                copy.deepcopy((o.state_dict(), sc.state_dict())) for o, sc in zip(opts, schs)
            ]
            ens = vmapens.load(path, Net)
            ens.template.backbone.requires_grad_(False)
            opt = stacked(ens)
            sch = make(opt)
            vmapens.restore(path, ens, opt)
            sch.load_state_dict(sch_sd)
            alone = [copy.deepcopy(m) for m in alone]
            opts = [plain(m) for m in alone]
            schs = [make(o) for o in opts]
            for o, sc, (osd, ssd) in zip(opts, schs, plain_sds, strict=True):
                o.load_state_dict(osd)
                sc.load_state_dict(ssd)
        if s == 7:
            both(ens, alone, lambda m: m.backbone.requires_grad_(True))
        x, y = data(s)
        plain_step(ens, opt, alone, opts, x, y)
        sch.step()
        for sc in schs:
            sc.step()
    for g, tg in zip(opt.param_groups, opts[0].param_groups, strict=True):
        lrs = list(g["lr"]) if isinstance(g["lr"], vmapens.optim.MemberValues) else [g["lr"]] * N
        assert lrs == pytest.approx([tg["lr"]] * N, rel=1e-12)
    assert_members(ens, alone)


@pytest.mark.usefixtures("float64_default")
def test_per_member_plateaus_across_a_freeze_and_a_state_dict_round_trip() -> None:
    kw: dict[str, Any] = {"patience": 1, "factor": 0.5, "cooldown": 1, "threshold": 1e-3}
    ens = vmapens.Ensemble(Net, N, seed=0)
    alone = [copy.deepcopy(m) for m in ens.unstack()]
    opt = vmapens.StackedSGD(ens, lr=0.05, momentum=0.5)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.5) for m in alone]
    sch = vmapens.optim.ReduceLROnPlateau(opt, **kw)
    schs = [sched.ReduceLROnPlateau(o, **kw) for o in opts]
    metrics = [[1.0, 1.0, 1.0], [1.0, 0.5, 1.2], [1.1, 0.5, 1.3], [0.9, 0.6, 1.3], [1.0, 0.7, 0.1],
               [1.0, 0.7, 0.2], [1.0, 0.7, 0.2]]  # fmt: skip
    for s, mt in enumerate(metrics):
        if s == 2:
            both(ens, alone, lambda m: m.backbone.requires_grad_(False))
        if s == 3:
            sd, osd = copy.deepcopy(sch.state_dict()), copy.deepcopy(opt.state_dict())
            opt = vmapens.StackedSGD(ens, lr=0.05, momentum=0.5)
            opt.load_state_dict(osd)
            sch = vmapens.optim.ReduceLROnPlateau(opt, **kw)
            sch.load_state_dict(sd)
        plain_step(ens, opt, alone, opts, *data(s))
        sch.step(torch.tensor(mt))
        for i, sc in enumerate(schs):
            sc.step(mt[i])
    assert list(opt.param_groups[0]["lr"]) == pytest.approx([o.param_groups[0]["lr"] for o in opts])
    assert_members(ens, alone)


# --- 5. dtype moves after the optimizer exists ------------------------------------------------


def _low_trip_pair(name: str, kw: dict, start: torch.dtype):
    ens = vmapens.Ensemble(
        lambda: nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)), N, seed=0
    )
    ens.to(start)
    alone = [copy.deepcopy(m) for m in ens.unstack()]
    opt = getattr(vmapens, "Stacked" + name)(ens, **kw)
    opts = [getattr(torch.optim, name)(m.parameters(), **kw) for m in alone]
    return ens, alone, opt, opts


def _frozen_state_through(name: str, kw: dict, low: torch.dtype) -> None:
    # Train all in float32, freeze layer 0, move to `low`, train the head a step, .float().
    # torch's SGD and Adagrad run on `low` gradients with their float32 state (they do not
    # refuse, as Adam does) and never touch the frozen layer's state: it stays as it was.
    ens, alone, opt, opts = _low_trip_pair(name, kw, torch.float32)
    for k in range(2):
        plain_step(ens, opt, alone, opts, *data(k, dtype=torch.float32))
    both(ens, alone, lambda m: m[0].requires_grad_(False))
    key = "momentum_buffer" if name == "SGD" else "sum"
    before = opt.state[ens.get_parameter("0.weight")][key].clone()
    alone_before = [o.state[m[0].weight][key].clone() for m, o in zip(alone, opts, strict=True)]
    ens.to(low)
    for m in alone:
        m.to(low)
    plain_step(ens, opt, alone, opts, *data(2, dtype=low))
    ens.float()
    for m in alone:
        m.float()
    for m, o, was in zip(alone, opts, alone_before, strict=True):  # torch: untouched
        assert o.state[m[0].weight][key].dtype == torch.float32
        assert torch.equal(o.state[m[0].weight][key], was)
    got = opt.state[ens.get_parameter("0.weight")][key]
    assert got.dtype == torch.float32  # as torch's (it was left float16 / bfloat16)
    torch.testing.assert_close(got, before, atol=0, rtol=0)


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16], ids=["half", "bf16"])
@pytest.mark.parametrize(
    "name, kw", [("SGD", {"lr": 0.1, "momentum": 0.9}), ("Adagrad", {"lr": 0.05})]
)
def test_a_frozen_layers_state_survives_a_low_precision_phase(
    name: str, kw: dict, low: torch.dtype
) -> None:
    """Found by the hunt: every stacked step cast all state to its parameter's dtype, so a
    frozen layer's float32 momentum was rounded through float16 (4e-4 relative) where torch
    never touches it. A parameter without a gradient now keeps its state as it is."""
    _frozen_state_through(name, kw, low)


def test_a_frozen_layers_state_survives_a_double_phase() -> None:
    # The same trip through float64 (exact both ways) keeps the frozen state bit for bit.
    _frozen_state_through("SGD", {"lr": 0.1, "momentum": 0.9}, torch.float64)
    _frozen_state_through("Adagrad", {"lr": 0.05}, torch.float64)


def test_a_step_without_gradients_in_a_lower_dtype_keeps_the_state_as_torch() -> None:
    # float64 training, .float(), a step that finds no gradient (zero_grad, a skipped batch,
    # opt.step()): torch changes nothing; .double() and on. torch's momentum stays float64.
    ens, alone, opt, opts = _low_trip_pair("SGD", {"lr": 0.1, "momentum": 0.9}, torch.float64)
    for k in range(2):
        plain_step(ens, opt, alone, opts, *data(k))
    ens.float()
    for m in alone:
        m.float()
    opt.zero_grad()
    opt.step()
    for o in opts:
        o.zero_grad()
        o.step()
    ens.double()
    for m in alone:
        m.double()
    for k in range(2, 5):
        plain_step(ens, opt, alone, opts, *data(k))
    assert_members(ens, alone)
