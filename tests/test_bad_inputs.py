"""Bad inputs to every public function: a clear error, and nothing changed.

Each case calls one API with one bad argument and checks the exception type, a message that
names the API and the argument, and that parameters, buffers, gradients, optimizer state and
the files of the working directory are bit-identical afterwards.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from truth import assert_bit_identical

import vmapens
from vmapens.callbacks import Checkpoint, EarlyStopping, LRScheduler
from vmapens.step import make_step

N, D_IN, D_OUT, ROWS = 4, 3, 2, 8


class BNNet(nn.Module):
    """Linear + BatchNorm1d: buffers (running stats, num_batches_tracked) that steps move."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D_IN, 5)
        self.bn = nn.BatchNorm1d(5)
        self.out = nn.Linear(5, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.fc(x))))


@dataclass
class World:
    """What a case may touch: an ensemble mid-training, its optimizer, step, data, files."""

    ens: vmapens.Ensemble
    opt: vmapens.StackedAdam
    step: Callable[..., torch.Tensor]
    x: torch.Tensor
    y: torch.Tensor
    dir: Path
    history: vmapens.History


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> World:
    monkeypatch.chdir(tmp_path)
    ens = vmapens.Ensemble(BNNet, N, seed=0)
    opt = vmapens.StackedAdam(ens, lr=[1e-3, 2e-3, 3e-3, 4e-3])
    step = make_step(ens, nn.MSELoss(), opt)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(ROWS, D_IN, generator=g), torch.randn(ROWS, D_OUT, generator=g)
    step(x, y)  # optimizer state exists, gradients are set, BatchNorm statistics have moved
    history = vmapens.fit(ens, (x, y), nn.MSELoss(), epochs=1, progress=False, seed=0)
    vmapens.save(ens, tmp_path / "ckpt.pt", opt, history)
    return World(ens, opt, step, x, y, tmp_path, history)


def snapshot(w: World) -> dict[str, Any]:
    """Everything a failed call must leave as it was, as bit-comparable values."""
    files = {
        str(p.relative_to(w.dir)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(w.dir.rglob("*"))
        if p.is_file()
    }
    return {
        "state": {k: t.detach().clone() for k, t in w.ens.stacked_state().items()},
        "grads": {
            n: None if p.grad is None else p.grad.clone() for n, p in w.ens.named_parameters()
        },
        "opt": copy.deepcopy(w.opt.state_dict()),
        "history": copy.deepcopy(w.history.state_dict()),
        "files": files,
    }


def _mask(n: int, dtype: torch.dtype = torch.bool) -> torch.Tensor:
    return torch.ones(n, dtype=dtype)


def _quiet(build: Callable[[], Any]) -> Any:
    """``build()`` without touching the global RNG (the cases check that the API leaves it)."""
    with torch.random.fork_rng():
        return build()


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1))


def _linear() -> nn.Module:
    return _quiet(lambda: nn.Linear(2, 2))


def _foreign() -> torch.optim.Optimizer:
    return torch.optim.SGD(_linear().parameters(), lr=0.1)


def _fit(w: World, **kwargs: Any) -> Any:
    data = kwargs.pop("data", (w.x, w.y))
    loss = kwargs.pop("loss_fn", nn.MSELoss())
    return vmapens.fit(w.ens, data, loss, progress=False, seed=0, **kwargs)


def _val_bad_features(w: World) -> Any:
    return _fit(w, epochs=2, val_data=(_randn(ROWS, D_IN + 1), w.y))


def _raise_at_member_two() -> Callable[[nn.Module], None]:
    seen: list[int] = []

    def fn(m: nn.Module) -> None:
        if isinstance(m, BNNet):
            seen.append(1)
            nn.init.zeros_(m.fc.weight)
            if len(seen) == 3:
                raise RuntimeError("boom in member 2")

    return fn


# (id, call, exception, message regex): the message must start with the API's name and name
# the argument.
CASES: list[tuple[str, Callable[[World], Any], type[BaseException], str]] = [
    # Ensemble construction
    ("ensemble-n-zero", lambda w: vmapens.Ensemble(BNNet, 0), ValueError, r"^Ensemble: `n` must be >= 1, got 0"),
    ("ensemble-n-float", lambda w: vmapens.Ensemble(BNNet, 2.0), TypeError, r"^Ensemble: `n` must be an int"),
    ("ensemble-factory-instance", lambda w: vmapens.Ensemble(_quiet(BNNet), 2), TypeError, r"^Ensemble: `factory` must build a new member"),
    ("ensemble-factory-not-callable", lambda w: vmapens.Ensemble(3, 2), TypeError, r"^Ensemble: `factory` must be"),
    ("ensemble-seed-str", lambda w: vmapens.Ensemble(BNNet, 2, seed="0"), TypeError, r"^Ensemble: `seed` must be an int"),
    ("ensemble-randomness", lambda w: vmapens.Ensemble(BNNet, 2, randomness="bad"), ValueError, r"^Ensemble: `randomness`"),
    ("ensemble-backend", lambda w: vmapens.Ensemble(BNNet, 2, backend="gpu"), ValueError, r"^Ensemble: `backend`"),
    ("ensemble-chunk-size", lambda w: vmapens.Ensemble(BNNet, 2, chunk_size=0), ValueError, r"^Ensemble: `chunk_size`"),
    ("ensemble-seeds-length", lambda w: vmapens.Ensemble(BNNet, 2, seeds=[1]), ValueError, r"^Ensemble: `seeds`"),
    ("from-modules-empty", lambda w: vmapens.Ensemble.from_modules([]), ValueError, r"^Ensemble.from_modules: `modules`"),
    ("from-modules-mixed", lambda w: vmapens.Ensemble.from_modules(_quiet(lambda: [nn.Linear(2, 1), nn.Linear(3, 1)])), ValueError, r"^Ensemble.from_modules: member 1 differs from member 0 at `weight`"),
    ("from-modules-not-modules", lambda w: vmapens.Ensemble.from_modules([1, 2]), TypeError, r"^Ensemble.from_modules: `modules`"),
    # forward, indexing, selection, apply, map_members
    ("call-wrong-features", lambda w: w.ens(_randn(ROWS, D_IN + 1)), RuntimeError, r"^Ensemble: a member's forward or loss failed"),
    ("call-in-dims-size", lambda w: w.ens(_randn(N + 1, ROWS, D_IN), in_dims=0), ValueError, r"^Ensemble: argument 0 is mapped with in_dims=0"),
    ("index-out-of-range", lambda w: w.ens[N], IndexError, r"^Ensemble: member index 4 out of range"),
    ("index-float", lambda w: w.ens[1.5], TypeError, r"^Ensemble(\.select)?: index must be"),
    ("select-empty", lambda w: w.ens.select([]), IndexError, r"^Ensemble: selecting no members"),
    ("select-empty-slice", lambda w: w.ens[2:2], IndexError, r"^Ensemble: selecting no members"),
    ("select-all-false", lambda w: w.ens[torch.zeros(N, dtype=torch.bool)], IndexError, r"^Ensemble: selecting no members"),
    ("select-mask-shape", lambda w: w.ens.select(_mask(N + 1)), IndexError, r"^Ensemble: a bool mask must have shape \[4\]"),
    ("apply-not-callable", lambda w: w.ens.apply(3), TypeError, r"^Ensemble.apply: `fn` must be callable"),
    ("apply-raises-midway", lambda w: w.ens.apply(_raise_at_member_two()), RuntimeError, r"boom in member 2"),
    ("map-members-not-callable", lambda w: w.ens.map_members(3, w.x), TypeError, r"^Ensemble.map_members: `fn` must be callable"),
    ("map-members-in-dims", lambda w: w.ens.map_members(lambda s, x: x, _randn(N + 1, 2), in_dims=0), ValueError, r"^Ensemble: argument 0 is mapped with in_dims=0"),
    ("per-member-not-callable", lambda w: vmapens.per_member(3), TypeError, r"^per_member: `loss_fn` must be callable"),
    # optimizers
    ("adam-lr-negative", lambda w: vmapens.StackedAdam(w.ens, lr=-1.0), ValueError, r"^StackedAdam: Invalid learning rate: -1.0 \(`lr`"),
    ("adam-lr-length", lambda w: vmapens.StackedAdam(w.ens, lr=[1e-3] * (N + 1)), ValueError, r"^StackedAdam: `lr` has 5 values, expected n=4"),
    ("adam-betas-not-pair", lambda w: vmapens.StackedAdam(w.ens, betas=0.9), ValueError, r"^StackedAdam: `betas` must be a pair"),
    ("adam-eps-str", lambda w: vmapens.StackedAdam(w.ens, eps="small"), TypeError, r"^StackedAdam: `eps` must be a float"),
    ("adam-params-empty", lambda w: vmapens.StackedAdam([]), ValueError, r"^StackedAdam: `params` is empty"),
    ("sgd-momentum-negative", lambda w: vmapens.StackedSGD(w.ens, lr=0.1, momentum=-0.5), ValueError, r"^StackedSGD: Invalid momentum.*`momentum`"),
    ("sgd-lr-2d", lambda w: vmapens.StackedSGD(w.ens, lr=torch.ones(N, 2)), ValueError, r"^StackedSGD: `lr` must be a float or 1-D"),
    ("opt-step-mask-shape", lambda w: w.opt.step(mask=_mask(2)), ValueError, r"^StackedAdam: `mask` must have shape \[4\]"),
    ("opt-step-mask-dtype", lambda w: w.opt.step(mask=_mask(N, torch.int64)), TypeError, r"^StackedAdam: `mask` must be a bool tensor"),
    ("apply-gradients-count", lambda w: w.opt.apply_gradients([None]), ValueError, r"^StackedAdam.apply_gradients: `grads` has 1 entries"),
    ("apply-gradients-shape", lambda w: w.opt.apply_gradients([torch.zeros(1)] * len(list(w.ens.parameters()))), ValueError, r"^StackedAdam.apply_gradients: `grads\[0\]` is \[1\] "),
    ("apply-gradients-mask", lambda w: w.opt.apply_gradients([p.grad for p in w.ens.parameters()], mask=_mask(3)), ValueError, r"^StackedAdam.apply_gradients: `mask` must have shape"),
    ("member-state-dict-range", lambda w: w.opt.member_state_dict(N), IndexError, r"^StackedAdam.member_state_dict: `i`=4 out of range"),
    ("member-state-dict-module", lambda w: w.opt.member_state_dict(0, _linear()), ValueError, r"^StackedAdam.member_state_dict: `module` parameters do not match"),
    ("clip-grad-norm-negative", lambda w: vmapens.optim.clip_grad_norm_(w.ens, -1.0), ValueError, r"^clip_grad_norm_: `max_norm`"),
    ("clip-grad-norm-str", lambda w: vmapens.optim.clip_grad_norm_(w.ens, "1"), TypeError, r"^clip_grad_norm_: `max_norm`"),
    # make_step: build and call
    ("make-step-ens", lambda w: make_step(_linear(), nn.MSELoss(), w.opt), TypeError, r"^make_step: `ens` must be a vmapens.Ensemble"),
    ("make-step-loss", lambda w: make_step(w.ens, "mse", w.opt), TypeError, r"^make_step: `loss_fn` must be callable"),
    ("make-step-in-dims", lambda w: make_step(w.ens, nn.MSELoss(), w.opt, in_dims=1), ValueError, r"^make_step: `in_dims` must be None or 0"),
    ("make-step-foreign-optimizer", lambda w: make_step(w.ens, nn.MSELoss(), _foreign()), ValueError, r"^make_step: `optimizer` parameter 0"),
    ("make-step-not-optimizer", lambda w: make_step(w.ens, nn.MSELoss(), "adam"), TypeError, r"^make_step: `optimizer` must be a torch.optim.Optimizer"),
    ("make-step-clip-both", lambda w: make_step(w.ens, nn.MSELoss(), w.opt, clip_grad_norm=1.0, clip_grad_value=1.0), ValueError, r"^make_step: give one of `clip_grad_norm`"),
    ("make-step-precision", lambda w: make_step(w.ens, nn.MSELoss(), w.opt, precision="fp8"), ValueError, r"^make_step: `precision`"),
    ("step-mask-shape-issue-14", lambda w: w.step(w.x, w.y, mask=_mask(2)), ValueError, r"^step: `mask` must have shape \[4\]"),
    ("step-mask-dtype", lambda w: w.step(w.x, w.y, mask=_mask(N, torch.float32)), TypeError, r"^step: `mask` must be a bool tensor"),
    ("step-target-type", lambda w: w.step(w.x, w.y.tolist()), TypeError, r"^step: `targets` must be a tensor"),
    ("step-wrong-features", lambda w: w.step(_randn(ROWS, D_IN + 1), w.y), RuntimeError, r"^step: member 0 run alone raises this too, in its forward: .* mat1 and mat2 shapes"),
    ("step-per-member-size", lambda w: make_step(w.ens, nn.MSELoss(), w.opt, in_dims=0)(_randn(N + 1, ROWS, D_IN), _randn(N + 1, ROWS, D_OUT)), ValueError, r"^step: argument 0 is mapped with in_dims=0 but has size 5"),
    ("step-mask-plain-optimizer", lambda w: make_step(w.ens, nn.MSELoss(), torch.optim.SGD(w.ens.parameters(), lr=0.1))(w.x, w.y, mask=_mask(N)), TypeError, r"^step: `mask` needs a vmapens.StackedOptimizer"),
    # fit: every option
    ("fit-ens", lambda w: vmapens.fit(_linear(), (w.x, w.y), nn.MSELoss()), TypeError, r"^fit: `ens` must be a vmapens.Ensemble"),
    ("fit-epochs", lambda w: _fit(w, epochs=0), ValueError, r"^fit: `epochs` must be >= 1, got 0"),
    ("fit-steps", lambda w: _fit(w, steps=0), ValueError, r"^fit: `steps` must be >= 1"),
    ("fit-batch-size", lambda w: _fit(w, batch_size=1.5), TypeError, r"^fit: `batch_size` must be an int"),
    ("fit-patience-without-val", lambda w: _fit(w, patience=2), ValueError, r"^fit: `patience` needs `val_data`"),
    ("fit-loss", lambda w: _fit(w, loss_fn=3), TypeError, r"^fit: `loss_fn` must be callable"),
    ("fit-val-data-type", lambda w: _fit(w, val_data=[w.x, w.y]), ValueError, r"^fit: `val_data` must be an \(X, Y\) tuple"),
    ("fit-val-wrong-features-issue-14", _val_bad_features, ValueError, r"^fit: `val_data` does not fit the ensemble"),
    ("fit-oob-without-bootstrap", lambda w: _fit(w, val_data="oob"), ValueError, r"^fit: `val_data` must be .*'oob' with bootstrap=True"),
    ("fit-batch-size-loader", lambda w: _fit(w, data=[(w.x, w.y)], batch_size=2), ValueError, r"^fit: `batch_size` cuts `data` given as \(X, Y\) tensors; this `data` \(list\) yields its own batches"),
    ("fit-bootstrap-loader", lambda w: _fit(w, data=[(w.x, w.y)], bootstrap=True), ValueError, r"^fit: `bootstrap=True` needs `data`"),
    ("fit-in-dims", lambda w: _fit(w, in_dims=1), ValueError, r"^fit: `in_dims` must be None, 0 or a pair"),
    ("fit-moved-scheduler-interval", lambda w: _fit(w, scheduler_interval="step"), TypeError, r"^fit: `scheduler_interval` moved in vmapens 0.3.0: pass callbacks=\[vmapens.callbacks.LRScheduler\(scheduler, interval='step'\)\]"),
    ("lr-scheduler-interval", lambda w: LRScheduler(None, interval="batch"), ValueError, r"^LRScheduler: `interval` must be one of \('epoch', 'step'\), got 'batch'"),
    ("fit-compile", lambda w: _fit(w, compile="yes"), ValueError, r"^fit: `compile`"),
    ("fit-moved-override", lambda w: _fit(w, override=("optimizer",)), TypeError, r"^fit: `override` moved in vmapens 0.3.0: pass callbacks=\[vmapens.callbacks.Checkpoint\(path, override=...\)\]"),
    ("checkpoint-override", lambda w: Checkpoint(w.dir / "c.pt", override="optimizer"), TypeError, r"^Checkpoint: `override` must be a sequence"),
    ("fit-moved-restore-best", lambda w: _fit(w, val_data=(w.x, w.y), restore_best=False), TypeError, r"^fit: `restore_best` moved in vmapens 0.3.0: pass callbacks=\[vmapens.callbacks.EarlyStopping\(patience=..., restore_best=...\)\]"),
    ("fit-moved-val-in-dims", lambda w: _fit(w, val_in_dims=0), TypeError, r"^fit: `val_in_dims` moved in vmapens 0.3.0: pass in_dims=\(<data's in_dims>, 0\)"),
    ("fit-patience-and-early-stopping", lambda w: _fit(w, val_data=(w.x, w.y), patience=2, callbacks=[EarlyStopping()]), ValueError, r"^fit: `patience` builds a callbacks.EarlyStopping, but `callbacks` holds one already"),
    ("fit-early-stopping-without-val", lambda w: _fit(w, callbacks=[EarlyStopping(patience=2)]), ValueError, r"^fit: `EarlyStopping` .*needs `val_data`"),
    ("fit-seed", lambda w: _fit(w, seed=None, shuffle=True) if False else vmapens.fit(w.ens, (w.x, w.y), nn.MSELoss(), seed=1.5, progress=False), TypeError, r"^fit: `seed` must be an int"),
    ("fit-optimizer-class", lambda w: _fit(w, optimizer=torch.optim.Adam), TypeError, r"^fit: an `optimizer` class must be a vmapens.StackedOptimizer"),
    ("fit-optimizer-foreign", lambda w: _fit(w, optimizer=_foreign()), ValueError, r"^fit: `optimizer` parameter 0"),
    ("fit-hyper-with-instance", lambda w: _fit(w, optimizer=w.opt, lr=0.1), ValueError, r"^fit: `lr` configures the optimizer"),
    ("fit-unknown-hyper", lambda w: _fit(w, learning_rate=0.1), TypeError, r"^fit: StackedAdam does not take these keyword arguments"),
    ("fit-callback", lambda w: _fit(w, callbacks=[3]), TypeError, r"^fit: `callbacks\[0\]`"),
    ("fit-moved-monitor", lambda w: _fit(w, monitor="val_acc"), TypeError, r"^fit: `monitor` moved in vmapens 0.3.0: pass callbacks=\[vmapens.callbacks.EarlyStopping\(monitor=..., mode=..., patience=...\)\]"),
    ("fit-moved-mode", lambda w: _fit(w, mode="max"), TypeError, r"^fit: `mode` moved in vmapens 0.3.0"),
    ("early-stopping-monitor", lambda w: _fit(w, val_data=(w.x, w.y), callbacks=[EarlyStopping(monitor="val_acc")]), ValueError, r"^fit: `EarlyStopping.monitor` must be one of \['val_loss'\], got 'val_acc'"),
    ("early-stopping-mode", lambda w: EarlyStopping(mode="up"), ValueError, r"^EarlyStopping: `mode` must be one of \('min', 'max'\), got 'up'"),
    ("fit-checkpoint-no-dir", lambda w: _fit(w, epochs=2, checkpoint=w.dir / "missing" / "c.pt"), FileNotFoundError, r"^fit: `checkpoint` directory .*missing.* does not exist"),
    ("fit-checkpoint-parent-is-file", lambda w: _fit(w, epochs=2, checkpoint=w.dir / "ckpt.pt" / "c.pt"), NotADirectoryError, r"^fit: `checkpoint` directory .*ckpt.pt.* is not a directory"),
    ("fit-checkpoint-from-save", lambda w: _fit(w, checkpoint=w.dir / "ckpt.pt"), ValueError, r"^fit: .*ckpt.pt was written by save\(\)"),
    ("fit-per-member-data", lambda w: _fit(w, data=(_randn(N + 1, ROWS, D_IN), _randn(N + 1, ROWS, D_OUT)), in_dims=0), ValueError, r"^fit: with `in_dims=0` every tensor of `data`"),
    ("fit-one-shot-iterator", lambda w: _fit(w, data=iter([(w.x, w.y)])), TypeError, r"^fit: `data` must be re-iterable"),
    # checkpoints
    ("save-ens", lambda w: vmapens.save(_linear(), w.dir / "x.pt"), TypeError, r"^save: `ens` must be a vmapens.Ensemble"),
    ("save-parent-is-file", lambda w: vmapens.save(w.ens, w.dir / "ckpt.pt" / "x.pt"), OSError, r"save: could not write .*; any previous file at that path is intact"),
    ("load-missing", lambda w: vmapens.load(w.dir / "nope.pt", BNNet), FileNotFoundError, r"^load: no checkpoint at"),
    ("load-wrong-class", lambda w: vmapens.load(w.dir / "ckpt.pt", lambda: nn.Linear(D_IN, D_OUT)), ValueError, r"^load: .*ckpt.pt holds 4 members of .*BNNet"),
    ("restore-other-ensemble", lambda w: vmapens.restore(w.dir / "ckpt.pt", vmapens.Ensemble(BNNet, 2, seed=0)), ValueError, r"^restore: .*holds 4 members"),
    ("restore-wrong-optimizer", lambda w: vmapens.restore(w.dir / "ckpt.pt", w.ens, vmapens.StackedSGD(w.ens, lr=0.1)), ValueError, r"^restore: .*holds StackedAdam state, the optimizer is a StackedSGD"),
    ("save-members-format", lambda w: vmapens.save_members(w.ens, w.dir / "m", format="npz"), ValueError, r"^save_members: `format` must be 'pt' or 'safetensors'"),
    ("save-members-parent-is-file", lambda w: vmapens.save_members(w.ens, w.dir / "ckpt.pt" / "m"), OSError, r"save_members: could not write .*ckpt.pt/m"),
    # sharding, seeds, data
    ("gather-dst", lambda w: vmapens.gather(w.ens, dst=1), ValueError, r"^gather: `dst` must be a rank in \[0, 1\)"),
    ("gather-dst-type", lambda w: vmapens.gather(w.ens, dst="0"), TypeError, r"^gather: `dst` must be an int"),
    ("gather-history-dst", lambda w: vmapens.gather_history(w.history, dst=2), ValueError, r"^gather_history: `dst` must be a rank"),
    ("member-seed-negative", lambda w: vmapens.seeds.member_seed(0, -1), ValueError, r"^member_seed: `i` must be >= 0"),
    ("member-seed-type", lambda w: vmapens.seeds.member_seed("0", 1), TypeError, r"^member_seed: `seed` must be an int"),
    ("bootstrap-indices-size", lambda w: vmapens.seeds.bootstrap_indices(0, 0, 0), ValueError, r"^bootstrap_indices: `n_samples` must be >= 1"),
    ("bootstrap-indices-member", lambda w: vmapens.seeds.bootstrap_indices(10, 0, -1), ValueError, r"^bootstrap_indices: `member_id` must be >= 0"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("call", "error", "match"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_input_is_a_clear_error_and_changes_nothing(world: World, call, error, match):
    before = snapshot(world)
    rng = torch.get_rng_state()
    with pytest.raises(error, match=match):
        call(world)
    assert_bit_identical(snapshot(world), before)
    assert torch.equal(torch.get_rng_state(), rng)


def test_enough_cases():
    assert len(CASES) >= 50


def test_issue_14_masked_step_keeps_batchnorm_buffers_and_gradients(world: World):
    """The issue's first case spelled out: a [2] mask on 4 members with BatchNorm."""
    bn = {k: t.clone() for k, t in world.ens.stacked_buffers().items()}
    grads = [p.grad.clone() for p in world.ens.parameters()]
    with pytest.raises(ValueError, match=r"^step: `mask` must have shape \[4\]"):
        world.step(world.x, world.y, mask=torch.ones(2, dtype=torch.bool))
    for key in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        assert torch.equal(world.ens.stacked_buffers()[key], bn[key]), key
    for p, g in zip(world.ens.parameters(), grads, strict=True):
        assert torch.equal(p.grad, g)


def test_sparse_gradients_are_refused_before_any_step():
    # nn.Embedding(sparse=True) trains alone (a sparse gradient); stacked, neither backend can
    # compute it, and the step failed inside autograd with torch's bare error.
    def member() -> nn.Module:
        return nn.Sequential(nn.Embedding(6, 4, sparse=True), nn.Flatten(), nn.Linear(12, 1))

    ens = vmapens.Ensemble(member, n=3, seed=0)
    before = copy.deepcopy(ens.state_dict())
    with pytest.raises(
        ValueError, match=r"^make_step: `0` \(Embedding\) is built with sparse=True"
    ):
        vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1))
    torch.testing.assert_close(ens.state_dict(), before, rtol=0, atol=0)
    ens.stacked_params()["0.weight"].requires_grad_(False)  # frozen: no gradient, no refusal
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1))
    step(torch.tensor([[0, 1, 2]]), torch.zeros(1, 1))
