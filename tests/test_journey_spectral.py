"""A user journey: an ensemble of small Fourier Neural Operators, with complex parameters.

The script a researcher writes from README.md, docs/optim.md ("Complex parameters step as
torch steps them") and docs/fit.md: a 1-D spectral convolution whose weights are
`nn.Parameter(torch.randn(in, out, modes, dtype=torch.cdouble))`, `torch.fft.rfft` /
`irfft` in the forward, `torch.einsum` with the complex weights, a fixed complex filter kept
as a buffer, a real `Conv1d` skip path and GELU. Trained with stacked optimizers through
`make_step` (eager and compiled) and `fit` (per-member lr and weight decay, clipping,
checkpoint and resume, best-epoch restore); clipped with `vmapens.optim.clip_grad_norm_`;
saved with `save`/`restore`, member files, state dicts; cast with `ens.to(dtype)`; a width
and modes sweep with `Ensemble.from_factories`; the FNO paper's own `out_ft = zeros(...);
out_ft[..., :modes] = ...`, which vmap cannot batch; and the single-tensor update functions
(`vmapens.optim.adam_update_`, ...) for a functional step.

The truth is plain PyTorch: each member built alone (`seeds=range(N)`: member k after
`torch.manual_seed(k)`) and trained alone with `torch.optim`, which steps a complex parameter
as its real pairs (so Adam's second moment is not the naive complex `g * g`): torch.optim
itself is the truth, never a formula written here. float64 / complex128 throughout.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from truth import assert_members_equal, batch_plan, factory_members, seeded_members

import vmapens
from vmapens import optim as vo

pytestmark = pytest.mark.usefixtures("float64_default")

C, MODES, L, B, N, STEPS = 4, 3, 16, 8, 3, 3
TOL = {"rtol": 1e-10, "atol": 1e-12}
LRS = [0.01, 0.05, 0.2]


class SpectralConv1d(nn.Module):
    """FNO's spectral convolution: the lowest `modes` Fourier modes times complex weights."""

    def __init__(self, cin: int = C, cout: int = C, modes: int = MODES, dtype=torch.cdouble):
        super().__init__()
        self.modes = modes
        self.weights = nn.Parameter(torch.randn(cin, cout, modes, dtype=dtype) / (cin * cout))
        phase = torch.linspace(0, 1, modes, dtype=torch.float64)
        self.register_buffer("filt", torch.polar(torch.ones_like(phase), phase).to(dtype))

    def forward(self, x: Tensor) -> Tensor:
        xf = torch.fft.rfft(x)
        y = torch.einsum("bix,iox->box", xf[..., : self.modes], self.weights) * self.filt
        return torch.fft.irfft(F.pad(y, (0, x.shape[-1] // 2 + 1 - self.modes)), n=x.shape[-1])


class FNO(nn.Module):
    def __init__(self, width: int = C, modes: int = MODES):
        super().__init__()
        self.spec = SpectralConv1d(width, width, modes)
        self.skip = nn.Conv1d(width, width, 1)

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(self.spec(x) + self.skip(x))


def batches(count: int = STEPS, rows: int = B, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, C, L, generator=g), torch.randn(rows, C, L, generator=g))
            for _ in range(count)]  # fmt: skip


def train_alone(m: nn.Module, opt: torch.optim.Optimizer, data, clip: float | None = None):
    for x, y in data:
        opt.zero_grad()
        F.mse_loss(m(x), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
        opt.step()


def assert_dtypes_and_values(got: dict[str, Tensor], want: dict[str, Tensor]) -> None:
    assert sorted(got) == sorted(want)  # a safetensors file keeps its keys sorted
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        assert torch.equal(got[k], want[k]), k


# -- every elementwise optimizer, eager, masked, handed off -----------------------------------

# (stacked class, torch class, stacked kwargs, member i's torch kwargs)
OPTIMIZERS: dict[str, tuple[Any, Any, dict[str, Any], Callable[[int], dict[str, Any]]]] = {
    "adam-amsgrad": (vmapens.StackedAdam, torch.optim.Adam,
        dict(lr=LRS, betas=(0.9, [0.99, 0.999, 0.9]), weight_decay=[0.0, 0.1, 0.2], amsgrad=True),
        lambda i: dict(lr=LRS[i], betas=(0.9, [0.99, 0.999, 0.9][i]),
                       weight_decay=[0.0, 0.1, 0.2][i], amsgrad=True)),
    "adamw": (vmapens.StackedAdam, torch.optim.AdamW,
        dict(lr=LRS, weight_decay=[0.0, 0.1, 0.3], decoupled_weight_decay=True),
        lambda i: dict(lr=LRS[i], weight_decay=[0.0, 0.1, 0.3][i])),
    "sgd-nesterov": (vmapens.StackedSGD, torch.optim.SGD,
        dict(lr=LRS, momentum=[0.3, 0.5, 0.9], nesterov=True, weight_decay=0.1),
        lambda i: dict(lr=LRS[i], momentum=[0.3, 0.5, 0.9][i], nesterov=True, weight_decay=0.1)),
    "rmsprop-centered": (vmapens.StackedRMSprop, torch.optim.RMSprop,
        dict(lr=0.01, centered=True, momentum=[0.0, 0.5, 0.9]),
        lambda i: dict(lr=0.01, centered=True, momentum=[0.0, 0.5, 0.9][i])),
    "adagrad": (vmapens.StackedAdagrad, torch.optim.Adagrad,
        dict(lr=LRS, lr_decay=0.01, initial_accumulator_value=0.1),
        lambda i: dict(lr=LRS[i], lr_decay=0.01, initial_accumulator_value=0.1)),
}  # fmt: skip
MASKS = ([True, False, True], [False, True, True], [True, True, False])


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_stacked_optimizers_step_complex_members_as_torch_optim_alone(kind: str) -> None:
    stacked_cls, torch_cls, kw, member_kw = OPTIMIZERS[kind]
    ens = vmapens.Ensemble(FNO, n=N, seeds=range(N))
    alone = seeded_members(FNO, N)
    assert ens.state_dict()["spec.weights"].dtype == torch.complex128
    opt = stacked_cls(ens, **kw)
    step = vmapens.make_step(ens, F.mse_loss, opt)
    data = batches()
    for (x, y), mask in zip(data, MASKS):
        step(x, y, mask=torch.tensor(mask))
    for i, m in enumerate(alone):
        own = torch_cls(m.parameters(), **member_kw(i))
        train_alone(m, own, [b for b, mask in zip(data, MASKS) if mask[i]])
        if i == 2:  # member 2 carries on alone with its state handed to torch
            hand = ens[2]
            twin = torch_cls(hand.parameters())
            twin.load_state_dict(opt.member_state_dict(2, module=hand))
            for p, q in zip(m.parameters(), hand.parameters()):
                for name, value in own.state[p].items():
                    torch.testing.assert_close(twin.state[q][name], value, **TOL, msg=name)
    assert_members_equal(ens, alone, **TOL)


def test_whole_shape_optimizers_refuse_complex_weights_and_change_nothing() -> None:
    ens = vmapens.Ensemble(FNO, n=N, seeds=range(N))
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    with pytest.raises(ValueError, match=r"^StackedAdafactor: complex parameters are not supp"):
        vmapens.StackedAdafactor(ens)
    with pytest.raises(ValueError, match=r"^StackedMuon: .*2D parameters"):
        vmapens.StackedMuon(ens)
    assert_dtypes_and_values(ens.state_dict(), before)


# -- clipping ---------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_grad_norm_on_complex_grads_is_torchs_on_each_member(norm_type: float) -> None:
    ens = vmapens.Ensemble(FNO, n=N, seeds=range(N))
    alone = seeded_members(FNO, N)
    x, y = batches(1)[0]
    vmapens.per_member(F.mse_loss)(ens(x), y).sum().backward()
    norms = vo.clip_grad_norm_(ens, 0.05, norm_type=norm_type)
    for i, m in enumerate(alone):
        F.mse_loss(m(x), y).backward()
        norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05, norm_type=norm_type)
        torch.testing.assert_close(norms[i], norm, **TOL)
        for (name, p), q in zip(m.named_parameters(), ens.parameters()):
            assert q.grad.dtype == p.grad.dtype
            torch.testing.assert_close(q.grad[i], p.grad, **TOL, msg=name)


def test_clip_grad_norm_refuses_a_non_finite_complex_grad_naming_the_member() -> None:
    ens = vmapens.Ensemble(FNO, n=N, seeds=range(N))
    x, y = batches(1)[0]
    vmapens.per_member(F.mse_loss)(ens(x), y).sum().backward()
    weights = ens.get_parameter("spec.weights")
    weights.grad[1, 0, 0, 0] = complex(0.0, float("nan"))  # only the imaginary part
    before = [p.grad.clone() for p in ens.parameters()]
    with pytest.raises(RuntimeError, match=r"member"):
        vo.clip_grad_norm_(ens, 0.05, error_if_nonfinite=True)
    for p, g in zip(ens.parameters(), before):
        assert torch.equal(p.grad.nan_to_num(), g.nan_to_num())
    norms = vo.clip_grad_norm_(ens, 0.05)
    assert norms[1].isnan() and norms[[0, 2]].isfinite().all()


def test_clip_grad_value_refuses_complex_grads_as_torch_does_and_changes_nothing() -> None:
    ens = vmapens.Ensemble(FNO, n=N, seeds=range(N))
    m = seeded_members(FNO, 1)[0]
    x, y = batches(1)[0]
    vmapens.per_member(F.mse_loss)(ens(x), y).sum().backward()
    F.mse_loss(m(x), y).backward()
    with pytest.raises(NotImplementedError) as alone:
        torch.nn.utils.clip_grad_value_(m.parameters(), 1e-3)
    before = [p.grad.clone() for p in ens.parameters()]
    with pytest.raises(NotImplementedError) as got:
        vo.clip_grad_value_(ens, 1e-3)
    assert str(got.value) == str(alone.value)
    assert all(torch.equal(p.grad, g) for p, g in zip(ens.parameters(), before))


def test_make_step_refuses_clip_grad_value_on_complex_weights_naming_the_cause() -> None:
    ens = vmapens.Ensemble(FNO, n=N, seeds=range(N))
    opt = vmapens.StackedAdam(ens, lr=0.01)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    try:
        with pytest.raises(ValueError, match=r"^make_step: `clip_grad_value` .*complex.*"
                           r"spec\.weights.*clip_grad_norm"):  # fmt: skip
            step = vmapens.make_step(ens, F.mse_loss, opt, clip_grad_value=1e-3)
            step(*batches(1)[0])
    finally:  # refused or not, nothing changed
        assert_dtypes_and_values(ens.state_dict(), before)
        assert not opt.state


# -- fit, checkpoints, files ------------------------------------------------------------------


def test_fit_resumed_from_a_checkpoint_ends_where_adamw_alone_ends(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    X, Y = torch.randn(16, C, L, generator=g), torch.randn(16, C, L, generator=g)
    wds = [0.0, 0.1, 0.3]
    options = dict(batch_size=8, seed=0, progress=False, clip_grad_norm=0.3)

    def run(epochs: int, ens, opt) -> None:
        vmapens.fit(ens, (X, Y), F.mse_loss, optimizer=opt, epochs=epochs,
                    checkpoint=tmp_path / "fno.pt", **options)  # fmt: skip

    ens = vmapens.Ensemble(FNO, n=N, seeds=range(N))
    opt = vmapens.StackedAdam(ens, lr=LRS, weight_decay=wds, decoupled_weight_decay=True)
    run(2, ens, opt)  # interrupted after two epochs
    ens = vmapens.Ensemble(FNO, n=N, seeds=range(N))  # a new process resumes from the file
    opt = vmapens.StackedAdam(ens, lr=LRS, weight_decay=wds, decoupled_weight_decay=True)
    run(3, ens, opt)

    alone = seeded_members(FNO, N)
    plan = batch_plan(16, 8, 6, seed=0)
    for i, m in enumerate(alone):
        own = torch.optim.AdamW(m.parameters(), lr=LRS[i], weight_decay=wds[i])
        train_alone(m, own, [(X[r], Y[r]) for r in plan], clip=0.3)
        for p, q in zip(m.parameters(), ens.parameters()):
            for name, value in own.state[p].items():
                torch.testing.assert_close(opt.state[q][name][i], value, **TOL, msg=name)
    assert_members_equal(ens, alone, **TOL)

    # the checkpoint holds complex tensors as they are: weights, filter and Adam's moments
    loaded = vmapens.load(tmp_path / "fno.pt", FNO)
    reopt = vmapens.StackedAdam(loaded, lr=LRS, weight_decay=wds, decoupled_weight_decay=True)
    vmapens.restore(tmp_path / "fno.pt", loaded, reopt)
    assert_dtypes_and_values(loaded.state_dict(), ens.state_dict())
    for p, q in zip(ens.parameters(), loaded.parameters()):
        assert_dtypes_and_values(reopt.state[q], opt.state[p])


def test_fit_restores_each_members_best_epoch_of_complex_weights() -> None:
    g = torch.Generator().manual_seed(4)
    X, Y = torch.randn(16, C, L, generator=g), torch.randn(16, C, L, generator=g)
    Xv, Yv = torch.randn(8, C, L, generator=g), torch.randn(8, C, L, generator=g)
    lrs, epochs, patience = [0.5, 0.1, 0.02], 5, 2
    ens = vmapens.Ensemble(FNO, n=N, seeds=range(N))
    history = vmapens.fit(ens, (X, Y), F.mse_loss, lr=lrs, epochs=epochs, batch_size=8, seed=0,
                          progress=False, val_data=(Xv, Yv), patience=patience)  # fmt: skip
    plan = batch_plan(16, 8, 2 * epochs, seed=0)
    alone = seeded_members(FNO, N)
    best_epochs, stopped = [], []
    for m, lr in zip(alone, lrs):
        own = torch.optim.Adam(m.parameters(), lr=lr)
        best, bad, kept, best_epoch, stop = float("inf"), 0, None, -1, -1
        for epoch in range(epochs):
            train_alone(m, own, [(X[r], Y[r]) for r in plan[2 * epoch : 2 * epoch + 2]])
            with torch.no_grad():
                val = F.mse_loss(m.eval()(Xv), Yv).item()
            m.train()
            if val < best:
                best, bad, kept, best_epoch = val, 0, copy.deepcopy(m.state_dict()), epoch
            else:
                bad += 1
                if bad >= patience:
                    stop = epoch
                    break
        m.load_state_dict(kept)
        best_epochs.append(best_epoch)
        stopped.append(stop)
    assert history.best_epoch.tolist() == best_epochs
    assert history.stopped_epoch.tolist() == stopped
    assert max(stopped) >= 0 and min(best_epochs) < epochs - 1  # stops and restores happen
    assert_members_equal(ens, alone, **TOL)


def test_state_dicts_member_files_and_round_trips_keep_complex_dtypes(tmp_path: Path) -> None:
    ens = vmapens.Ensemble(FNO, n=N, seeds=range(N))
    opt = vmapens.StackedAdam(ens, lr=0.05)
    vmapens.make_step(ens, F.mse_loss, opt)(*batches(1)[0])
    members = [ens[i].state_dict() for i in range(N)]
    assert members[0]["spec.filt"].dtype == torch.complex128

    vmapens.save(ens, tmp_path / "ens.pt", opt)
    loaded = vmapens.load(tmp_path / "ens.pt", FNO)
    reopt = vmapens.StackedAdam(loaded, lr=0.05)
    vmapens.restore(tmp_path / "ens.pt", loaded, reopt)
    assert_dtypes_and_values(loaded.state_dict(), ens.state_dict())
    for p, q in zip(ens.parameters(), loaded.parameters()):
        assert_dtypes_and_values(reopt.state[q], opt.state[p])

    paths = vmapens.save_members(ens, tmp_path / "members")
    for i, (state, path) in enumerate(zip(vmapens.load_members(tmp_path / "members"), paths)):
        assert_dtypes_and_values(state, members[i])
        assert_dtypes_and_values(vmapens.load_member(path), members[i])
        plain = FNO()
        plain.load_state_dict(torch.load(path, weights_only=True))  # plain PyTorch reads it
        assert_dtypes_and_values(plain.state_dict(), members[i])

    for i, (module, state) in enumerate(zip(ens.unstack(), ens.state_dicts())):
        assert isinstance(module, FNO)
        assert_dtypes_and_values(module.state_dict(), members[i])
        assert_dtypes_and_values(state, members[i])
    again = vmapens.Ensemble.from_modules(ens.unstack())
    assert_dtypes_and_values(again.state_dict(), ens.state_dict())
    other = vmapens.Ensemble(FNO, n=N, seeds=[7, 8, 9])
    other.load_state_dict(ens.state_dict())
    assert_dtypes_and_values(other.state_dict(), ens.state_dict())


def test_safetensors_member_files_keep_complex64(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    make = functools.partial(SpectralConv1d, dtype=torch.cfloat)
    ens = vmapens.Ensemble(make, n=N, seeds=range(N))
    paths = vmapens.save_members(ens, tmp_path, format="safetensors")
    states = vmapens.load_members(tmp_path)
    for i, path in enumerate(paths):
        assert states[i]["weights"].dtype == torch.complex64
        assert_dtypes_and_values(states[i], ens[i].state_dict())
        assert_dtypes_and_values(vmapens.load_member(path), ens[i].state_dict())


def test_safetensors_refuses_complex128_clearly_and_keeps_the_previous_set(tmp_path) -> None:
    pytest.importorskip("safetensors")
    ens = vmapens.Ensemble(FNO, n=N, seeds=range(N))
    vmapens.save_members(ens, tmp_path)  # the .pt set there before
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    try:
        with pytest.raises(ValueError, match=r"^save_members: .*complex128.*`spec\.\w+`.*'pt'"):
            vmapens.save_members(ens, tmp_path, format="safetensors")
    finally:
        assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == files


# -- dtypes, buffers, sizes -------------------------------------------------------------------


@pytest.mark.parametrize("how", ["to-float64", "to-float32", "to-complex64", "double", "float"])
def test_dtype_casts_treat_complex_tensors_as_torchs_module_casts_do(how: str) -> None:
    # torch's Module.to(dtype) casts complex tensors too (to a real dtype: the imaginary part
    # is dropped, with torch's warning); .double()/.float() cast floating-point tensors only.
    cast: Callable[[nn.Module], Any] = {
        "to-float64": lambda m: m.to(torch.float64),
        "to-float32": lambda m: m.to(torch.float32),
        "to-complex64": lambda m: m.to(torch.complex64),
        "double": lambda m: m.double(),
        "float": lambda m: m.float(),
    }[how]
    ens = vmapens.Ensemble(FNO, n=N, seeds=range(N))
    alone = seeded_members(FNO, N)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Casting complex values to real", UserWarning)
        warnings.filterwarnings("ignore", "Complex modules are a new feature", UserWarning)
        cast(ens)
        for m in alone:
            cast(m)
    for i, m in enumerate(alone):
        assert_dtypes_and_values(ens[i].state_dict(), m.state_dict())


def test_a_complex_buffer_written_in_the_forward_follows_each_member() -> None:
    class RunningSpectrum(FNO):
        """Keeps a running mean of the input's low modes (complex), read by the output."""

        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("seen", torch.zeros(C, MODES, dtype=torch.cdouble))

        def forward(self, x: Tensor) -> Tensor:
            if self.training:
                with torch.no_grad():
                    self.seen.mul_(0.9).add_(0.1 * torch.fft.rfft(x)[..., :MODES].mean(0))
            return super().forward(x) + 0.01 * self.seen.abs().sum()

    ens = vmapens.Ensemble(RunningSpectrum, n=N, seeds=range(N))
    alone = seeded_members(RunningSpectrum, N)
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedAdam(ens, lr=LRS))
    data = batches()
    for x, y in data:
        step(x, y)
    for m, lr in zip(alone, LRS):
        train_alone(m, torch.optim.Adam(m.parameters(), lr=lr), data)
    assert_members_equal(ens, alone, **TOL)
    ens.eval()
    out = ens(data[0][0])
    for i, m in enumerate(alone):
        torch.testing.assert_close(out[i], m.eval()(data[0][0]), **TOL)


def test_a_width_and_modes_sweep_pads_complex_weights_exactly() -> None:
    class Lifted(nn.Module):
        def __init__(self, width: int, modes: int) -> None:
            super().__init__()
            self.lift, self.fno, self.proj = nn.Conv1d(1, width, 1), FNO(width, modes), nn.Conv1d(width, 1, 1)  # fmt: skip

        def forward(self, x: Tensor) -> Tensor:
            return self.proj(self.fno(self.lift(x)))

    factories = [functools.partial(Lifted, w, k) for w, k in [(2, 2), (4, 3), (3, 3)]]
    ens = vmapens.Ensemble.from_factories(factories, seed=0)
    alone = factory_members(factories, seed=0)
    opt = vmapens.StackedAdam(ens, lr=LRS, weight_decay=0.1, decoupled_weight_decay=True)
    step = vmapens.make_step(ens, F.mse_loss, opt, clip_grad_norm=0.5)
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(B, 1, L, generator=g), torch.randn(B, 1, L, generator=g))
            for _ in range(STEPS)]  # fmt: skip
    for x, y in data:
        step(x, y)
    for m, lr in zip(alone, LRS):
        train_alone(m, torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.1), data, 0.5)
    assert_members_equal(ens, alone, **TOL)
    weights = ens.get_parameter("fno.spec.weights")  # member 0: 2 x 2 x 2 in a 4 x 4 x 3 corner
    assert not weights[0, 2:].any() and not weights[0, :, :, 2:].any()


def test_the_fno_papers_in_place_modes_are_refused_with_the_way_out_which_is_exact() -> None:
    class PaperFNO(FNO):  # out_ft = zeros(...); out_ft[..., :modes] = einsum(...)
        def forward(self, x: Tensor) -> Tensor:
            xf = torch.fft.rfft(x)
            out = torch.zeros(x.shape[0], C, L // 2 + 1, dtype=torch.cdouble)
            out[..., :MODES] = torch.einsum("bix,iox->box", xf[..., :MODES], self.spec.weights)
            return F.gelu(torch.fft.irfft(out, n=L) + self.skip(x))

    refused = vmapens.Ensemble(PaperFNO, n=N, seeds=range(N))
    before = {k: v.clone() for k, v in refused.state_dict().items()}
    opt = vmapens.StackedSGD(refused, lr=LRS, momentum=0.9)
    for call in (lambda: refused(batches(1)[0][0]),
                 lambda: vmapens.make_step(refused, F.mse_loss, opt)(*batches(1)[0])):  # fmt: skip
        with pytest.raises(RuntimeError, match=r"forward of PaperFNO cannot be batched with "
                           r"torch.func.vmap .*backend='loop'"):  # fmt: skip
            call()
    assert_dtypes_and_values(refused.state_dict(), before)
    assert not opt.state
    ens = vmapens.Ensemble(PaperFNO, n=N, seeds=range(N), backend="loop")
    alone = seeded_members(PaperFNO, N)
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedSGD(ens, lr=LRS, momentum=0.9))
    data = batches()
    for x, y in data:
        step(x, y)
    for m, lr in zip(alone, LRS):
        train_alone(m, torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9), data)
    assert_members_equal(ens, alone, **TOL)


# -- serving ------------------------------------------------------------------------------------


def test_predict_export_and_swa_of_complex_members() -> None:
    ens = vmapens.Ensemble(FNO, n=N, seeds=range(N))
    alone = seeded_members(FNO, N)
    averaged = torch.optim.swa_utils.AveragedModel(ens)
    averaged_alone = [torch.optim.swa_utils.AveragedModel(m) for m in alone]
    step = vmapens.make_step(ens, F.mse_loss, vmapens.StackedSGD(ens, lr=0.05, momentum=0.9))
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in alone]
    for x, y in batches():
        step(x, y)
        averaged.update_parameters(ens)
        for m, own, avg in zip(alone, opts, averaged_alone):
            train_alone(m, own, [(x, y)])
            avg.update_parameters(m)
    for i, avg in enumerate(averaged_alone):
        for k, v in avg.module.state_dict().items():
            torch.testing.assert_close(averaged.module[i].state_dict()[k], v, **TOL, msg=k)

    x = batches(1, seed=9)[0][0]
    ens.eval()
    want = torch.stack([m.eval()(x) for m in alone]).detach()
    torch.testing.assert_close(vmapens.predict(ens, x), want, **TOL)
    program = vmapens.export(ens, (x,))
    assert program.state_dict["spec.weights"].dtype == torch.complex128
    torch.testing.assert_close(program.module()(x), want, **TOL)


# -- a functional step with the single-tensor update functions ---------------------------------


def _adam(p, g, s, **kw):
    vo.adam_update_(p, g, *s, lr=0.05, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, **kw)


def _adam_pure(p, g, s):
    new = vo.adam_update(p, g, *s, lr=0.05, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    p.copy_(new[0])
    for old, fresh in zip(s, new[1:]):
        if old is not None:
            old.copy_(fresh)


# name: (state maker from a stacked param, update, torch optimizer alone)
UPDATES: dict[str, tuple[Callable, Callable, Callable]] = {
    "adam_update_": (lambda p: (torch.zeros_like(p), torch.zeros_like(p), None, torch.zeros(N)),
        _adam, lambda ps: torch.optim.Adam(ps, lr=0.05, weight_decay=0.1)),
    "adam_update_-amsgrad": (
        lambda p: (torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p), torch.zeros(N)),
        functools.partial(_adam, amsgrad=True),
        lambda ps: torch.optim.Adam(ps, lr=0.05, weight_decay=0.1, amsgrad=True)),
    "adam_update": (lambda p: (torch.zeros_like(p), torch.zeros_like(p), None, torch.zeros(N)),
        _adam_pure, lambda ps: torch.optim.Adam(ps, lr=0.05)),
    "rmsprop_update_": (
        lambda p: (torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p), torch.zeros(N)),
        lambda p, g, s: vo.rmsprop_update_(p, g, *s, lr=0.01, alpha=0.99, eps=1e-8,
                                           weight_decay=0.0, momentum=0.9),
        lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.9, centered=True)),
    "adagrad_update_": (lambda p: (torch.zeros_like(p), torch.zeros(N)),
        lambda p, g, s: vo.adagrad_update_(p, g, *s, lr=0.05, lr_decay=0.0, weight_decay=0.0,
                                           eps=1e-10),
        lambda ps: torch.optim.Adagrad(ps, lr=0.05)),
    "nadam_update_": (
        lambda p: (torch.zeros_like(p), torch.zeros_like(p), torch.ones(N), torch.zeros(N)),
        lambda p, g, s: vo.nadam_update_(p, g, *s, lr=0.05, beta1=0.9, beta2=0.999, eps=1e-8,
                                         weight_decay=0.0, momentum_decay=4e-3),
        lambda ps: torch.optim.NAdam(ps, lr=0.05)),
    "adamax_update_": (lambda p: (torch.zeros_like(p), torch.zeros_like(p), torch.zeros(N)),
        lambda p, g, s: vo.adamax_update_(p, g, *s, lr=0.05, beta1=0.9, beta2=0.999, eps=1e-8,
                                          weight_decay=0.0),
        lambda ps: torch.optim.Adamax(ps, lr=0.05)),
}  # fmt: skip


def test_sgd_update_steps_complex_weights_as_torch_sgd() -> None:
    # SGD is linear in the gradient: a complex tensor steps as its real pairs either way.
    _functional_run(
        lambda p: (torch.zeros_like(p), torch.zeros(N)),
        lambda p, g, s: vo.sgd_update_(
            p, g, *s, lr=0.05, momentum=0.9, dampening=0.0, weight_decay=0.1
        ),  # fmt: skip
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.1),
    )


@pytest.mark.parametrize("name", list(UPDATES))
def test_update_functions_step_complex_weights_as_torch_optim(name: str) -> None:
    _functional_run(*UPDATES[name])


def _functional_run(make_state: Callable, update: Callable, make_torch: Callable) -> None:
    """docs/optim.md: a functional step takes each stacked parameter's gradient and runs the
    rule's `*_update_` on it; the truth is each member's torch optimizer alone."""
    ens = vmapens.Ensemble(FNO, n=N, seeds=range(N))
    alone = seeded_members(FNO, N)
    states = {name: make_state(p) for name, p in ens.named_parameters()}
    data = batches()
    for x, y in data:
        grads = torch.autograd.grad(
            vmapens.per_member(F.mse_loss)(ens(x), y).sum(), list(ens.parameters())
        )
        with torch.no_grad():
            for (name, p), g in zip(ens.named_parameters(), grads):
                update(p, g, states[name])
    for m in alone:
        train_alone(m, make_torch(m.parameters()), data)
    assert_members_equal(ens, alone, **TOL)


# -- compiled ---------------------------------------------------------------------------------


# Inductor warns that it runs complex ops as they are (no generated code for them).
@pytest.mark.filterwarnings("ignore:Torchinductor does not support code generation for complex")
def test_the_compiled_step_trains_complex_members_as_adamw_alone() -> None:
    # docs/fit.md: compile=True works on CPU; the first call compiles (one small test only).
    # AdamW: its second moment is where a complex tensor must step as its real pairs.
    ens = vmapens.Ensemble(FNO, n=N, seeds=range(N))
    alone = seeded_members(FNO, N)
    wds = [0.0, 0.1, 0.3]
    opt = vmapens.StackedAdam(ens, lr=LRS, weight_decay=wds, decoupled_weight_decay=True)
    step = vmapens.make_step(ens, F.mse_loss, opt, compile=True, clip_grad_norm=0.3)
    data = batches()
    for x, y in data:
        step(x, y)
    for m, lr, wd in zip(alone, LRS, wds):
        own = torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=wd)
        train_alone(m, own, data, clip=0.3)
    assert_members_equal(ens, alone, **TOL)
