"""A user journey: stochastic weight averaging and EMA of an ensemble, torch's SWA recipe.

The script a researcher writes from docs/workflows.md ("Stochastic weight averaging") and
docs/semantics.md: 4 BatchNorm MLP members in float64 trained with `fit` (a `Callback` that,
from epoch 2 on, calls `AveragedModel(ens).update_parameters(ens)` and steps torch's `SWALR`
with one `swa_lr` per member as `MemberValues`, docs/optim.md) or with `make_step` in a loop
(plus an EMA, `get_ema_multi_avg_fn`, `use_buffers=True`, updated every step); then
`vmapens.swa.update_bn` over a DataLoader, evaluation (`swa(x)`, `predict`), `save_members`
of the averaged members, and a `fit` checkpoint interrupted and resumed mid-SWA (the callback's
`state_dict` holds the averaged model and the scheduler, docs/fit.md "Callbacks").

The truth is the naive loop in plain PyTorch: one module per member with its own
`torch.optim` optimizer, `AveragedModel`, `SWALR` and torch's own `update_bn`, fed the batches
of docs/fit.md's documented shuffle formula, float64.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.optim.swa_utils import SWALR, AveragedModel, get_ema_multi_avg_fn
from torch.optim.swa_utils import update_bn as torch_update_bn
from torch.utils.data import DataLoader, TensorDataset
from truth import derived_seed

import vmapens
from vmapens.callbacks import Callback
from vmapens.optim import MemberValues
from vmapens.swa import update_bn

N, EPOCHS, SWA_START, BATCH = 4, 5, 2, 8
LR = [0.05, 0.1, 0.02, 0.08]
SWA_LR = [0.01, 0.02, 0.005, 0.03]
TOL: dict[str, Any] = {
    "rtol": 1e-12,
    "atol": 1e-12,
}  # float64: the same maths, sums in another order

_g = torch.Generator().manual_seed(1)
X = torch.randn(20, 3, generator=_g, dtype=torch.float64)
Y = torch.randn(20, 2, generator=_g, dtype=torch.float64)
X_TEST = torch.randn(7, 3, generator=_g, dtype=torch.float64)


def member() -> nn.Module:
    # bias=False before BatchNorm: that bias's true gradient is 0 and Adam would step on its
    # round-off (docs/semantics.md), in plain PyTorch as in the ensemble.
    return nn.Sequential(nn.Linear(3, 6, bias=False), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))


def batches(seed: int, p: int) -> list[tuple[Tensor, Tensor]]:
    """Pass `p`'s batches, from docs/fit.md's formula (sha256 of the seed and pass number)."""
    s_p = derived_seed(seed, "shuffle", p)
    order = torch.randperm(len(X), generator=torch.Generator().manual_seed(s_p))
    return [(X[order[k : k + BATCH]], Y[order[k : k + BATCH]]) for k in range(0, len(X), BATCH)]


def bn_loader() -> DataLoader:
    return DataLoader(TensorDataset(X, Y), batch_size=BATCH)  # (x, y) batches, as in torch


def naive_swa(
    modules: list[nn.Module], kind: str
) -> list[tuple[nn.Module, AveragedModel, AveragedModel, torch.optim.Optimizer]]:
    """torch's recipe per member: (model, swa_model, ema_model, optimizer) at the end."""
    out: list[tuple[nn.Module, AveragedModel, AveragedModel, torch.optim.Optimizer]] = []
    for i, m in enumerate(modules):
        opt: torch.optim.Optimizer
        if kind == "sgd":
            opt = torch.optim.SGD(m.parameters(), lr=LR[i], momentum=0.9)
        else:
            opt = torch.optim.Adam(m.parameters(), lr=LR[i])
        swa = AveragedModel(m)
        ema = AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
        sched = SWALR(opt, swa_lr=SWA_LR[i], anneal_epochs=2)
        m.train()
        for epoch in range(EPOCHS):
            for x, y in batches(0, epoch):
                opt.zero_grad()
                nn.MSELoss()(m(x), y).backward()
                opt.step()
                ema.update_parameters(m)
            if epoch >= SWA_START:
                swa.update_parameters(m)
                sched.step()
        torch_update_bn(bn_loader(), swa)
        out.append((m, swa, ema, opt))
    return out


def assert_member(ens: Any, i: int, alone: nn.Module) -> None:
    stacked = ens.state_dict()
    for k, v in alone.state_dict().items():
        torch.testing.assert_close(stacked[k][i], v, **TOL, msg=f"member {i}, {k}")


class SWA(Callback):
    """torch's SWA recipe as a fit callback: average and anneal after each epoch from `start`.

    SWALR is built at the first SWA epoch (building it before `fit` with `checkpoint=` is
    refused, docs/fit.md), and rebuilt from the checkpoint on resume.
    """

    def __init__(self, swa: AveragedModel, opt: torch.optim.Optimizer, start: int) -> None:
        self.swa, self.opt, self.start = swa, opt, start
        self.sched: SWALR | None = None

    def _build(self) -> SWALR:
        return SWALR(self.opt, swa_lr=MemberValues(SWA_LR), anneal_epochs=2)  # type: ignore[arg-type]

    def on_epoch_end(self, ctx: Any) -> None:
        if ctx.epoch >= self.start:
            if self.sched is None:
                self.sched = self._build()
            self.swa.update_parameters(ctx.ensemble)
            self.sched.step()

    def state_dict(self) -> dict[str, Any]:
        sched = None if self.sched is None else self.sched.state_dict()
        return {"swa": self.swa.state_dict(), "sched": sched}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.swa.load_state_dict(state["swa"])
        if state["sched"] is not None:
            self.sched = self._build()
            self.sched.load_state_dict(state["sched"])


def fit_swa(checkpoint: Path | None = None, stop_at: int | None = None) -> tuple[Any, ...]:
    ens = vmapens.Ensemble(member, n=N, seed=0).double()
    start = [copy.deepcopy(m) for m in ens.unstack()]
    opt = vmapens.StackedSGD(ens.parameters(), lr=LR, momentum=0.9)
    swa = AveragedModel(ens)
    callbacks: list[Any] = [SWA(swa, opt, SWA_START)]
    if stop_at is not None:

        def interrupt(history: vmapens.History) -> None:
            if history.epochs == stop_at:
                raise KeyboardInterrupt

        callbacks.append(interrupt)
    try:
        vmapens.fit(ens, (X, Y), nn.MSELoss(), epochs=EPOCHS, batch_size=BATCH, optimizer=opt,
                    callbacks=callbacks, seed=0, progress=False, checkpoint=checkpoint)  # fmt: skip
    except KeyboardInterrupt:
        assert stop_at is not None
    return ens, opt, swa, start


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_fit_with_swa_callback_update_bn_evaluation_and_member_files(tmp_path: Path) -> None:
    ens, opt, swa, start = fit_swa()
    update_bn(bn_loader(), swa)
    truth = naive_swa(start, "sgd")
    assert int(swa.n_averaged) == EPOCHS - SWA_START
    swa.eval()
    out = swa(X_TEST)
    probs = vmapens.predict(swa.module, X_TEST)
    files = vmapens.save_members(swa.module, tmp_path / "swa")
    assert [f.name for f in files] == [f"member_{i:04d}.pt" for i in range(N)]
    for i, (m, alone_swa, _, alone_opt) in enumerate(truth):
        assert_member(ens, i, m)
        assert_member(swa.module, i, alone_swa.module)
        assert opt.param_groups[0]["lr"][i] == alone_opt.param_groups[0]["lr"]
        alone_swa.eval()
        torch.testing.assert_close(out[i], alone_swa(X_TEST), **TOL)
        torch.testing.assert_close(probs[i], alone_swa(X_TEST).detach(), **TOL)
        loaded = member().double()
        loaded.load_state_dict(torch.load(files[i], weights_only=True))
        for k, v in alone_swa.module.state_dict().items():
            torch.testing.assert_close(loaded.state_dict()[k], v, **TOL)


def test_make_step_with_ema_every_step_and_swa_per_epoch() -> None:
    ens = vmapens.Ensemble(member, n=N, seed=0).double()
    start = [copy.deepcopy(m) for m in ens.unstack()]
    opt = vmapens.StackedAdam(ens.parameters(), lr=LR)
    swa = AveragedModel(ens)
    ema = AveragedModel(ens, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    sched = SWALR(opt, swa_lr=MemberValues(SWA_LR), anneal_epochs=2)  # type: ignore[arg-type]
    step = vmapens.make_step(ens, nn.MSELoss(), opt)
    for epoch in range(EPOCHS):
        for x, y in batches(0, epoch):
            step(x, y)
            ema.update_parameters(ens)
        if epoch >= SWA_START:
            swa.update_parameters(ens)
            sched.step()
    update_bn(bn_loader(), swa)
    for i, (m, alone_swa, alone_ema, alone_opt) in enumerate(naive_swa(start, "adam")):
        assert_member(ens, i, m)
        assert_member(swa.module, i, alone_swa.module)
        assert_member(ema.module, i, alone_ema.module)  # buffers averaged too (use_buffers)
        assert opt.param_groups[0]["lr"][i] == alone_opt.param_groups[0]["lr"]


def test_an_swalr_built_before_fit_with_a_checkpoint_is_refused_naming_it(tmp_path: Path) -> None:
    ens = vmapens.Ensemble(member, n=N, seed=0).double()
    opt = vmapens.StackedSGD(ens.parameters(), lr=LR, momentum=0.9)
    SWALR(opt, swa_lr=MemberValues(SWA_LR), anneal_epochs=2)  # type: ignore[arg-type]
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    # It names the way an SWALR started at swa_start is kept: fit(scheduler=) would step it
    # from epoch 0.
    with pytest.raises(ValueError, match=r"scheduler.*build it in a Callback that saves"):
        vmapens.fit(ens, (X, Y), nn.MSELoss(), epochs=EPOCHS, batch_size=BATCH, optimizer=opt,
                    seed=0, progress=False, checkpoint=tmp_path / "c.pt")  # fmt: skip
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_a_checkpoint_interrupted_mid_swa_resumes_exactly(tmp_path: Path) -> None:
    whole = fit_swa(tmp_path / "whole.pt")
    path = tmp_path / "cut.pt"
    fit_swa(path, stop_at=SWA_START + 2)  # after two SWA epochs
    resumed = fit_swa(path)
    for (_, opt_a, swa_a, _), (_, opt_b, swa_b, _) in [(whole, resumed)]:
        assert opt_a.param_groups[0]["lr"] == opt_b.param_groups[0]["lr"]
        for k, v in swa_a.state_dict().items():
            assert torch.equal(v, swa_b.state_dict()[k]), k
    update_bn(bn_loader(), resumed[2])
    for i, (m, alone_swa, _, _) in enumerate(naive_swa(resumed[3], "sgd")):
        assert_member(resumed[0], i, m)
        assert_member(resumed[2].module, i, alone_swa.module)
