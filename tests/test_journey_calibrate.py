"""A user journey: post-hoc calibration and test-time tricks on a trained ensemble.

The script a researcher writes after training: each member's logits on a validation split
from `vmapens.predict` (docs/workflows.md), a temperature per member fitted with LBFGS (one
`torch.optim.LBFGS` per member, the way out that `vmapens.optim.stacked(torch.optim.LBFGS)`
names) or with `StackedAdam` on the `[n]` temperatures; a calibration wrapper (the member
plus a `temperature` parameter) built with `Ensemble.from_modules` from the trained members,
its members frozen (`requires_grad_(False)`, docs/semantics.md) and the temperature trained
with a per-member learning rate; test-time augmentation (the same flip for every member, or
a crop of its own per member through `in_dims=0`); BatchNorm statistics recomputed on shifted
data (`vmapens.swa.update_bn`, and the manual pass with `momentum=None`), each member's ECE
and the disagreement; the calibrated members' files loaded into the plain wrapper.

The truth: the plain modules, each trained alone with `torch.optim` and processed alone with
torch in float64 (its own LBFGS, its own Adam, torch's `swa_utils.update_bn`).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.optim.swa_utils import update_bn as torch_update_bn

import vmapens

N, C = 3, 3
TOL: dict[str, Any] = {"rtol": 1e-12, "atol": 1e-12}  # float64, sums in another order

_g = torch.Generator().manual_seed(11)
X = torch.randn(24, 1, 6, 6, generator=_g, dtype=torch.float64)
Y = (X.mean((1, 2, 3)) * 6 > 0).long() + (X[:, 0, 0, 0] > 0.5).long()
XV = torch.randn(20, 1, 6, 6, generator=_g, dtype=torch.float64)
YV = (XV.mean((1, 2, 3)) * 6 > 0).long() + (XV[:, 0, 0, 0] > 0.5).long()
X_SHIFT = 1.5 * torch.randn(16, 1, 6, 6, generator=_g, dtype=torch.float64) + 0.7
LRS = [0.05, 0.1, 0.2]


def member() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, C),
    ).double()


class Calibrated(nn.Module):
    """The member plus a learned temperature: logits / T."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base = base
        self.temperature = nn.Parameter(torch.ones((), dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) / self.temperature


def trained_alone() -> list[nn.Module]:
    """The plain loop: member i from `torch.manual_seed(i)`, 4 SGD steps alone in train mode."""
    models = []
    for i in range(N):
        torch.manual_seed(i)
        m = member()
        opt = torch.optim.SGD(m.parameters(), lr=0.3, momentum=0.5)
        for k in range(4):
            xb, yb = X[6 * k : 6 * k + 6], Y[6 * k : 6 * k + 6]
            opt.zero_grad()
            F.cross_entropy(m(xb), yb).backward()
            opt.step()
        models.append(m.eval())
    return models


@pytest.fixture(scope="module")
def models() -> list[nn.Module]:
    return trained_alone()


def ensemble_of(models: list[nn.Module]) -> vmapens.Ensemble:
    return vmapens.Ensemble.from_modules([copy.deepcopy(m) for m in models]).eval()


def alone(models: list[nn.Module], x: Tensor) -> Tensor:
    with torch.no_grad():
        return torch.stack([m.eval()(x) for m in models])


def nll(logits: Tensor, t: Tensor) -> Tensor:
    return F.cross_entropy(logits / t, YV)


def lbfgs_temperature(logits: Tensor) -> Tensor:
    """One member's temperature alone: torch's LBFGS on its validation logits."""
    t = torch.ones((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([t], lr=0.5, max_iter=30, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        opt.zero_grad()
        loss = nll(logits, t)
        loss.backward()
        return loss

    opt.step(closure)
    return t.detach()


def test_validation_logits_and_per_member_lbfgs(models: list[nn.Module]) -> None:
    ens = ensemble_of(models)
    logits = vmapens.predict(ens, XV, batch_size=7)  # reduce="none": [n, samples, C]
    truth = alone(models, XV)
    torch.testing.assert_close(logits, truth, **TOL)
    # The documented way: one LBFGS per member, on that member's logits.
    temps = torch.stack([lbfgs_temperature(logits[i]) for i in range(N)])
    temps_alone = torch.stack([lbfgs_temperature(truth[i]) for i in range(N)])
    torch.testing.assert_close(temps, temps_alone, rtol=1e-9, atol=1e-9)
    assert not torch.allclose(temps, torch.ones(N, dtype=torch.float64))
    for i in range(N):  # fitted: the NLL went down, member by member
        assert nll(truth[i], temps_alone[i]) < nll(truth[i], torch.tensor(1.0))
    # written back into the calibration wrapper's stacked storage (docs/semantics.md,
    # "Container operations": state_dict()'s tensors are the storage)
    cal = calibrated_ensemble(models)
    with torch.no_grad():
        cal.state_dict()["temperature"].copy_(temps)
    want = truth / temps_alone[:, None, None]
    torch.testing.assert_close(vmapens.predict(cal, XV, batch_size=8), want, rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="written in place"):  # the meta template: refused
        with torch.no_grad():
            cal.template.temperature.fill_(2.0)
        cal(XV)


def test_stacked_adam_on_the_temperatures(models: list[nn.Module]) -> None:
    ens = ensemble_of(models)
    logits = vmapens.predict(ens, XV)
    t = torch.ones(N, dtype=torch.float64, requires_grad=True)  # one per member, [n]
    opt = vmapens.StackedAdam([t], lr=torch.tensor(LRS, dtype=torch.float64))
    for _ in range(6):
        opt.zero_grad()
        per_member = torch.stack([nll(logits[i], t[i]) for i in range(N)])
        per_member.sum().backward()
        opt.step()
    truth = alone(models, XV)
    for i in range(N):
        ti = torch.ones((), dtype=torch.float64, requires_grad=True)
        adam = torch.optim.Adam([ti], lr=LRS[i])
        for _ in range(6):
            adam.zero_grad()
            nll(truth[i], ti).backward()
            adam.step()
        torch.testing.assert_close(t[i].detach(), ti.detach(), **TOL, msg=f"member {i}")


def test_lbfgs_is_refused_with_the_way_out(models: list[nn.Module]) -> None:
    ens = ensemble_of(models)
    with pytest.raises(ValueError, match="one LBFGS per member"):
        vmapens.optim.stacked(torch.optim.LBFGS)
    lbfgs = torch.optim.LBFGS(ens.parameters())
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    for call in (
        lambda: vmapens.make_step(ens, nn.CrossEntropyLoss(), lbfgs),
        lambda: vmapens.fit(ens, (XV, YV), nn.CrossEntropyLoss(), optimizer=lbfgs, progress=False),
    ):
        with pytest.raises(TypeError, match="LBFGS is not elementwise"):
            call()
    for k, v in ens.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


def calibrated_ensemble(models: list[nn.Module]) -> vmapens.Ensemble:
    trained = ensemble_of(models).unstack()
    cal = vmapens.Ensemble.from_modules([Calibrated(m) for m in trained]).eval()
    cal.requires_grad_(False)
    cal.template.temperature.requires_grad_(True)
    return cal


def calibrated_alone(
    models: list[nn.Module], steps: int, each_step: Any = None
) -> list[Calibrated]:
    out = []
    for i, m in enumerate(models):
        c = Calibrated(copy.deepcopy(m)).eval()
        c.base.requires_grad_(False)
        opt = torch.optim.Adam([c.temperature], lr=LRS[i])
        for k in range(steps):
            opt.zero_grad()
            F.cross_entropy(c(XV), YV).backward()
            opt.step()
            if each_step is not None:
                each_step(i, k, c)
        out.append(c)
    return out


def test_calibration_wrapper_trains_only_the_temperature(models: list[nn.Module]) -> None:
    cal = calibrated_ensemble(models)
    assert [n for n, p in cal.named_parameters() if p.requires_grad] == ["temperature"]
    frozen = {k: v.clone() for k, v in cal.state_dict().items() if k != "temperature"}
    opt = vmapens.StackedAdam(cal.parameters(), lr=LRS)
    loss_fn = vmapens.per_member(nn.CrossEntropyLoss())
    for _ in range(5):
        opt.zero_grad()
        loss_fn(cal(XV), YV).sum().backward()
        opt.step()
    truth = calibrated_alone(models, 5)
    torch.testing.assert_close(
        cal.get_parameter("temperature").detach(),
        torch.stack([c.temperature.detach() for c in truth]),
        **TOL,
    )
    for k, v in cal.state_dict().items():  # the members, buffers included, untouched
        if k != "temperature":
            torch.testing.assert_close(v, frozen[k], rtol=0, atol=0, msg=k)
    torch.testing.assert_close(
        vmapens.predict(cal, XV, softmax=True), alone(truth, XV).softmax(-1), **TOL
    )


def test_calibration_wrapper_with_fit(models: list[nn.Module]) -> None:
    """`fit` on the whole validation split (one batch: never permuted), per-member lr."""
    cal = calibrated_ensemble(models)
    vmapens.fit(cal, (XV, YV), nn.CrossEntropyLoss(), steps=5, lr=LRS, progress=False, seed=0)
    truth = calibrated_alone(models, 5)
    for i, (mine, c) in enumerate(zip(cal.unstack(), truth)):
        for (name, a), b in zip(mine.state_dict().items(), c.state_dict().values()):
            torch.testing.assert_close(a, b, **TOL, msg=f"member {i} {name}")
    assert not cal.training  # fit left the eval mode the user set


def ece_metric(out: Tensor, y: Tensor) -> Tensor:
    return torch.tensor(ece(out.softmax(-1), y), dtype=torch.float64)  # reads values


def test_calibration_metrics_per_member_in_fit(models: list[nn.Module]) -> None:
    """Each member's ECE and NLL on shifted validation data after every epoch (one step)."""
    cal = calibrated_ensemble(models)
    xv, yv = X_SHIFT[:10], YV[:10]
    metrics = {"ece": ece_metric, "nll": F.cross_entropy}
    hist = vmapens.fit(
        cal, (XV, YV), nn.CrossEntropyLoss(), epochs=3, lr=LRS, val_data=(xv, yv),
        metrics=metrics, progress=False, seed=0,
    )  # fmt: skip
    outs = torch.zeros(3, N, 10, C, dtype=torch.float64)

    def record(i: int, k: int, c: nn.Module) -> None:
        with torch.no_grad():
            outs[k, i] = c(xv)

    calibrated_alone(models, 3, record)
    for name, fn in metrics.items():
        want = torch.tensor(
            [[float(fn(o, yv)) for o in outs[k]] for k in range(3)], dtype=torch.float64
        )
        torch.testing.assert_close(hist.metrics[name], want.double(), **TOL, msg=name)
    ens_ece = torch.tensor(
        [ece(outs[k].mean(0).softmax(-1), yv) for k in range(3)], dtype=torch.float64
    )
    torch.testing.assert_close(hist.ensemble_metrics["ece"], ens_ece.double(), **TOL)


def test_tta_shared_flip_and_per_member_crops(models: list[nn.Module]) -> None:
    ens = ensemble_of(models)
    flips = [XV, XV.flip(-1), XV.flip(-2)]
    shared = torch.stack([vmapens.predict(ens, v, softmax=True, batch_size=8) for v in flips])
    truth = torch.stack([alone(models, v).softmax(-1) for v in flips])
    torch.testing.assert_close(shared.mean(0), truth.mean(0), **TOL)
    # per member: its own 4x4 crop (member i at offset i), one slice per member, in_dims=0
    crops = torch.stack([XV[..., i : i + 4, i : i + 4] for i in range(N)])
    got = vmapens.predict(ens, crops, in_dims=0, softmax=True, batch_size=6)
    want = torch.stack([alone([m], crops[i])[0].softmax(-1) for i, m in enumerate(models)])
    torch.testing.assert_close(got, want, **TOL)
    got_mean = vmapens.predict(ens, (crops,), in_dims=(0,), reduce="mean", softmax=True)
    torch.testing.assert_close(got_mean, want.mean(0), **TOL)
    got_dis = vmapens.predict(ens, crops, in_dims=0, reduce="disagreement", batch_size=5)
    torch.testing.assert_close(got_dis, disagreement(want), **TOL)


def disagreement(p: Tensor) -> Tensor:
    cls = p.argmax(-1)
    pairs = [(cls[i] != cls[j]).double() for i in range(N) for j in range(N) if i != j]
    return torch.stack(pairs).mean(0)


def ece(probs: Tensor, target: Tensor, bins: int = 4) -> float:
    conf, pred = probs.max(-1)
    total = 0.0
    for b in range(bins):
        inside = (conf > b / bins) & (conf <= (b + 1) / bins)
        if inside.any():
            acc = (pred[inside] == target[inside]).double().mean()
            total += float(inside.double().mean() * (acc - conf[inside].mean()).abs())
    return total


def loader() -> list[Tensor]:
    return [X_SHIFT[:6], X_SHIFT[6:11], X_SHIFT[11:]]


def test_bn_recalibration_with_update_bn(models: list[nn.Module]) -> None:
    ens = ensemble_of(models)
    vmapens.swa.update_bn(loader(), ens)
    plain = [copy.deepcopy(m) for m in models]
    for m in plain:
        torch_update_bn(loader(), m)
    for i, (mine, m) in enumerate(zip(ens.unstack(), plain)):
        for (name, a), b in zip(mine.state_dict().items(), m.state_dict().values()):
            torch.testing.assert_close(a, b, **TOL, msg=f"member {i} {name}")
    assert not ens.training and ens.template[1].momentum == 0.1
    p = vmapens.predict(ens, X_SHIFT, softmax=True)
    truth = alone(plain, X_SHIFT).softmax(-1)
    torch.testing.assert_close(p, truth, **TOL)
    y_shift = (X_SHIFT.mean((1, 2, 3)) * 6 > 4).long()
    for i in range(N):
        assert ece(p[i], y_shift) == pytest.approx(ece(truth[i], y_shift), abs=1e-12)
    got = vmapens.predict(ens, X_SHIFT, reduce="disagreement")
    torch.testing.assert_close(got, disagreement(truth), **TOL)


def test_bn_recalibration_per_member_data(models: list[nn.Module]) -> None:
    """Each member's own shifted data (in_dims=0): torch's update_bn on its slice alone."""
    ens = ensemble_of(models)
    per = [
        torch.stack([X_SHIFT[:6] * (1 + i) for i in range(N)]),
        X_SHIFT[6:].expand(N, -1, -1, -1, -1) - 1,
    ]
    vmapens.swa.update_bn([(b, None) for b in per], ens, in_dims=0)
    for i, m in enumerate(models):
        m = copy.deepcopy(m)
        torch_update_bn([b[i] for b in per], m)
        for (name, a), b in zip(ens.unstack()[i].state_dict().items(), m.state_dict().values()):
            torch.testing.assert_close(a, b, **TOL, msg=f"member {i} {name}")


def manual_bn_pass(model: nn.Module, bns: list[nn.Module]) -> None:
    """Reset the statistics, cumulative average (`momentum=None`), train mode, no_grad."""
    for bn in bns:
        bn.momentum = None
    model.train()
    with torch.no_grad():
        for xb in loader():
            model(xb)
    model.eval()


def test_bn_recalibration_by_hand(models: list[nn.Module]) -> None:
    ens = ensemble_of(models)
    ens.apply(lambda m: m.reset_running_stats() if isinstance(m, nn.BatchNorm2d) else None)
    manual_bn_pass(ens, [ens.template[1]])
    plain = [copy.deepcopy(m) for m in models]
    for m in plain:
        m[1].reset_running_stats()
        manual_bn_pass(m, [m[1]])
    for i, (mine, m) in enumerate(zip(ens.unstack(), plain)):
        for (name, a), b in zip(mine.state_dict().items(), m.state_dict().values()):
            torch.testing.assert_close(a, b, **TOL, msg=f"member {i} {name}")
    assert ens.get_buffer("1.num_batches_tracked").tolist() == [3] * N


def test_calibrated_member_files_load_into_the_plain_wrapper(
    models: list[nn.Module], tmp_path: Path
) -> None:
    cal = calibrated_ensemble(models)
    vmapens.fit(cal, (XV, YV), nn.CrossEntropyLoss(), steps=3, lr=LRS, progress=False, seed=0)
    paths = vmapens.save_members(cal, tmp_path)
    states = vmapens.load_members(tmp_path)
    truth = calibrated_alone(models, 3)
    for i, (path, c) in enumerate(zip(paths, truth)):
        for state in (torch.load(path), states[i]):
            plain = Calibrated(member()).eval()
            plain.load_state_dict(state)
            torch.testing.assert_close(plain.temperature, c.temperature, **TOL)
            with torch.no_grad():
                torch.testing.assert_close(plain(XV), c(XV), **TOL, msg=f"member {i}")
        plain_base = member().eval()  # the frozen member alone: the base's keys
        plain_base.load_state_dict({k[5:]: v for k, v in state.items() if k.startswith("base.")})
        torch.testing.assert_close(alone([plain_base], XV)[0], alone([models[i]], XV)[0], **TOL)
