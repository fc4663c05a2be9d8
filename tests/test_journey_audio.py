"""User journey: an ensemble of tiny keyword-spotting models on raw waveforms.

The script a researcher writes from README.md, docs/semantics.md ("Randomness in the forward
pass", "What vmap cannot batch"), docs/fit.md and docs/workflows.md:

* a mel front end inside the member: `torch.stft` with a registered `hann_window` buffer
  (vmap has no rule for `aten::stft`: torch's per-member fallback, whose speed warning is
  silenced as docs/semantics.md says), the power of the complex spectrum, a mel filterbank
  buffer (matmul), `log(x + eps)`, per-utterance normalisation; SpecAugment in the training
  forward (time and frequency masks from `torch.randint`, `masked_fill`); a depthwise-separable
  `Conv1d` (`groups=`), `BatchNorm1d`, masked mean pooling over each utterance's frames from a
  lengths tensor; trained by `make_step` with one learning rate per member, under
  `randomness="same"` (each member draws what it draws alone from the same RNG state) with
  `backend="vmap"`, `chunk_size` and `backend="loop"`; under `"different"` members mask
  differently;
* a SincNet-like learnable front end (band-pass filters computed in the forward from learnable
  cutoffs) after a `torch.stft`/`torch.istft` round trip, a strided `Conv1d`, a
  depthwise-separable `Conv2d` + `BatchNorm2d` + `AdaptiveAvgPool2d`; `fit` with per-member lr,
  `predict(softmax=True)`, member files loaded into a plain module;
* a learnable complex filterbank (a complex parameter, a complex DFT buffer) under Adam with
  per-member clipping;
* SpecAugment drawn from Python's `random` module: refused by the first step's self-check.

The truth: plain modules (`torch.manual_seed(k); Model()`, as `seeds=range(n)` builds member k)
trained alone with `torch.optim.Adam` on the same batches. float64; the convolutions before a
BatchNorm have no bias (a bias whose exact gradient is 0 drifts by Adam-amplified round-off,
docs/semantics.md's table), so the only differences are sums in another order (TOL).
"""

from __future__ import annotations

import copy
import functools
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from truth import batch_plan, derived_seed

import vmapens

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop")

N, NFFT, HOP, MELS, B, L = 3, 32, 8, 8, 6, 96
LRS = [1e-2, 5e-3, 2e-3]
TOL: dict[str, Any] = {"rtol": 1e-9, "atol": 1e-10}  # float64, sums in another order
F64 = torch.float64


class KWS(nn.Module):
    def __init__(self, spec_aug: bool = True) -> None:
        super().__init__()
        self.register_buffer("window", torch.hann_window(NFFT, dtype=F64))
        self.register_buffer("mel", torch.rand(NFFT // 2 + 1, MELS, dtype=F64))
        self.dw = nn.Conv1d(MELS, MELS, 3, padding=1, groups=MELS, bias=False, dtype=F64)
        self.pw = nn.Conv1d(MELS, 12, 1, bias=False, dtype=F64)
        self.bn = nn.BatchNorm1d(12, dtype=F64)
        self.fc = nn.Linear(12, 4, dtype=F64)
        self.spec_aug = spec_aug

    def forward(self, wave: Tensor, lengths: Tensor) -> Tensor:
        spec = torch.stft(wave, NFFT, HOP, window=self.window, return_complex=True)
        mel = (spec.abs() ** 2).transpose(1, 2) @ self.mel  # [B, T, M]
        x = torch.log(mel.transpose(1, 2) + 1e-6)
        x = (x - x.mean((1, 2), keepdim=True)) / (x.std((1, 2), keepdim=True) + 1e-5)
        if self.training and self.spec_aug:
            rows, m, t = x.shape
            f0 = torch.randint(0, m - 2, (rows, 1, 1))
            t0 = torch.randint(0, t - 3, (rows, 1, 1))
            fm = (torch.arange(m).view(1, m, 1) - f0).abs() < 1
            tm = (torch.arange(t).view(1, 1, t) - t0).abs() < 2
            x = x.masked_fill(fm | tm, 0.0)
        h = F.relu(self.bn(self.pw(self.dw(x))))
        keep = (torch.arange(h.shape[-1]).view(1, -1) <= (lengths // HOP).view(-1, 1)).to(F64)
        return self.fc((h * keep.unsqueeze(1)).sum(-1) / keep.sum(-1, keepdim=True))


def _batches(count: int) -> list[tuple[tuple[Tensor, Tensor], Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        lengths = torch.randint(48, L + 1, (B,), generator=g)
        wave = torch.randn(B, L, generator=g, dtype=F64) * (torch.arange(L) < lengths[:, None])
        out.append(((wave, lengths), torch.randint(0, 4, (B,), generator=g)))
    return out


def _alone(factory: Any, n: int = N) -> list[nn.Module]:
    built = []
    for k in range(n):
        torch.manual_seed(k)
        built.append(factory())
    return built


def _assert_members(ens: vmapens.Ensemble, alone: list[nn.Module], **tol: Any) -> None:
    for i, m in enumerate(alone):
        got = ens[i].state_dict()
        for k, v in m.state_dict().items():
            torch.testing.assert_close(got[k], v, **(tol or TOL), msg=f"member {i} {k}")


@pytest.mark.parametrize("how", [{}, {"chunk_size": 2}, {"backend": "loop"}])
def test_mel_kws_specaugment_same_randomness_trains_each_member_as_alone(how: dict) -> None:
    ens = vmapens.Ensemble(KWS, n=N, seeds=range(N), randomness="same", **how)
    alone = _alone(KWS)
    step = vmapens.make_step(ens, nn.CrossEntropyLoss(), vmapens.StackedAdam(ens, lr=LRS))
    opts = [torch.optim.Adam(m.parameters(), lr=lr) for m, lr in zip(alone, LRS, strict=True)]
    torch.manual_seed(123)
    for x, y in _batches(3):
        start = torch.get_rng_state()
        step(x, y)
        after = torch.get_rng_state()
        for m, opt in zip(alone, opts, strict=True):
            torch.set_rng_state(start)  # "same": each member draws from the same state
            opt.zero_grad()
            F.cross_entropy(m(*x), y).backward()
            opt.step()
        assert torch.equal(after, torch.get_rng_state())  # the RNG goes on as alone
    _assert_members(ens, alone)


def test_different_randomness_gives_each_member_its_own_masks_and_eval_is_exact() -> None:
    x, _ = _batches(1)[0]
    ens = vmapens.Ensemble(functools.partial(KWS, True), n=N, seeds=range(N))
    out = ens.eval()(*x)  # no masks in eval mode: each member as alone
    for i, m in enumerate(_alone(KWS)):
        torch.testing.assert_close(out[i], m.eval()(*x), **TOL)
    twin = vmapens.Ensemble(functools.partial(KWS, False), n=N, seeds=range(N))
    gain = ens.train()(*x) - twin(*x)  # the same members, with and without the masks
    assert not torch.allclose(gain[0], gain[1]) and not torch.allclose(gain[1], gain[2])


class Sinc(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.low = nn.Parameter(torch.rand(4, dtype=F64) * 0.2)
        self.band = nn.Parameter(torch.rand(4, dtype=F64) * 0.2 + 0.05)
        self.register_buffer("taps", torch.arange(-8, 9, dtype=F64))
        self.register_buffer("hamming", torch.hamming_window(17, periodic=False, dtype=F64))
        self.register_buffer("window", torch.hann_window(NFFT, dtype=F64))
        self.stem = nn.Conv1d(1, 4, 5, stride=2, dtype=F64)
        self.dw = nn.Conv2d(4, 4, 3, padding=1, groups=4, bias=False, dtype=F64)
        self.pw = nn.Conv2d(4, 6, 1, bias=False, dtype=F64)
        self.bn = nn.BatchNorm2d(6, dtype=F64)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.drop = nn.Dropout(0.0)
        self.fc = nn.Linear(10, 3, dtype=F64)

    def forward(self, wave: Tensor) -> Tensor:
        spec = torch.stft(wave, NFFT, HOP, window=self.window, return_complex=True)
        wave = torch.istft(spec, NFFT, HOP, window=self.window, length=wave.shape[-1])
        lo = self.low.abs().view(-1, 1)
        hi = lo + self.band.abs().view(-1, 1)
        kern = 2 * hi * torch.sinc(2 * hi * self.taps) - 2 * lo * torch.sinc(2 * lo * self.taps)
        s = F.conv1d(wave.unsqueeze(1), (kern * self.hamming).unsqueeze(1), padding=8)
        sinc = torch.log(s.pow(2).mean(-1) + 1e-6)
        gate = self.stem(wave.unsqueeze(1)).mean(-1)[:, :, None, None]
        img = torch.log(spec.abs() + 1e-6).unsqueeze(1) * gate  # [B, 4, F, T]
        z = self.pool(F.relu(self.bn(self.pw(self.dw(img))))).flatten(1)
        return self.fc(self.drop(torch.cat([z, sinc], 1)))


def test_sinc_istft_fit_predict_softmax_and_member_files(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(20, 64, generator=g, dtype=F64), torch.randint(0, 3, (20,), generator=g)
    ens = vmapens.Ensemble(Sinc, n=N, seeds=range(N))
    vmapens.fit(ens, (x, y), nn.CrossEntropyLoss(), epochs=2, batch_size=8, lr=LRS, seed=0,
                progress=False)  # fmt: skip
    alone = _alone(Sinc)
    for m, lr in zip(alone, LRS, strict=True):
        opt = torch.optim.Adam(m.parameters(), lr=lr)
        for rows in batch_plan(20, 8, 6, seed=0):  # docs/fit.md's order: 2 passes of 3
            opt.zero_grad()
            F.cross_entropy(m(x[rows]), y[rows]).backward()
            opt.step()
    _assert_members(ens, alone)
    ens.eval()
    probs = vmapens.predict(ens, x, softmax=True, reduce="none")
    for i, path in enumerate(vmapens.save_members(ens, tmp_path)):
        plain = Sinc()
        plain.load_state_dict(torch.load(path, weights_only=True))
        want = alone[i].eval()(x).softmax(-1)
        torch.testing.assert_close(probs[i], want, **TOL)
        torch.testing.assert_close(plain.eval()(x).softmax(-1), want, **TOL)


class ComplexBank(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.filt = nn.Parameter(torch.randn(9, 4, dtype=torch.complex128) * 0.3)
        self.register_buffer("dft", torch.fft.fft(torch.eye(16, dtype=torch.complex128))[:9])
        self.fc = nn.Linear(4, 3, dtype=F64)

    def forward(self, frames: Tensor) -> Tensor:
        return self.fc(torch.log1p((frames.to(self.dft.dtype) @ self.dft.T @ self.filt).abs()))


def test_complex_filterbank_adam_with_per_member_clipping() -> None:
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(8, 16, generator=g, dtype=F64), torch.randint(0, 3, (8,), generator=g))
            for _ in range(4)]  # fmt: skip
    ens = vmapens.Ensemble(ComplexBank, n=N, seeds=range(N))
    opt = vmapens.StackedAdam(ens, lr=LRS, weight_decay=0.01)
    step = vmapens.make_step(ens, nn.CrossEntropyLoss(), opt, clip_grad_norm=0.5)
    alone = _alone(ComplexBank)
    opts = [torch.optim.Adam(m.parameters(), lr=lr, weight_decay=0.01) for m, lr in zip(alone, LRS)]
    for x, y in data:
        step(x, y)
        for m, o in zip(alone, opts, strict=True):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            o.step()
    _assert_members(ens, alone)


class PyRandomAug(KWS):
    """SpecAugment as much audio code writes it: the mask start from Python's `random`."""

    def forward(self, wave: Tensor, lengths: Tensor) -> Tensor:
        if self.training:
            t0 = random.randint(0, 40)
            wave = torch.cat([wave[:, :t0], torch.zeros_like(wave[:, t0 : t0 + 16]),
                              wave[:, t0 + 16 :]], 1)  # fmt: skip
        return super().forward(wave, lengths)


@pytest.mark.parametrize("backend", ["vmap", "loop"])
def test_python_random_specaugment_is_refused_and_changes_nothing(backend: str) -> None:
    ens = vmapens.Ensemble(functools.partial(PyRandomAug, False), n=N, seeds=range(N),
                           backend=backend)  # fmt: skip
    before = copy.deepcopy(ens.state_dict())
    step = vmapens.make_step(ens, nn.CrossEntropyLoss(), vmapens.StackedAdam(ens, lr=1e-2))
    x, y = _batches(1)[0]
    random.seed(5)
    with pytest.raises(RuntimeError, match="member 0 of PyRandomAug"):
        step(x, y)
    for k, v in before.items():
        torch.testing.assert_close(ens.state_dict()[k], v, rtol=0, atol=0)


def test_python_random_refusal_names_the_cause_and_a_way_out_that_works() -> None:
    ens = vmapens.Ensemble(functools.partial(PyRandomAug, False), n=N, seeds=range(N))
    step = vmapens.make_step(ens, nn.CrossEntropyLoss(), vmapens.StackedAdam(ens, lr=1e-2))
    random.seed(5)
    with pytest.raises(RuntimeError) as err:
        step(*_batches(1)[0])
    assert "Python's `random`" in str(err.value) and "torch.randint" in str(err.value)
    assert "backend='loop'" not in str(err.value)


def test_seeds_are_the_documented_ones() -> None:  # the truth's member k is seeds[k] = k
    assert derived_seed(0, "member", 0) != 0
    ens = vmapens.Ensemble(KWS, n=2, seeds=range(2))
    for i, m in enumerate(_alone(KWS, 2)):
        torch.testing.assert_close(ens[i].mel, m.mel, rtol=0, atol=0)
