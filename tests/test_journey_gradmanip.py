"""A user journey: training loops that manipulate the gradients by hand.

The researcher writes the loop themselves, as docs/fit.md ("Neither `fit` nor `make_step`
accumulates gradients") and docs/optim.md describe it: `out = ens(x)`, a per-member loss
(`vmapens.per_member(loss_fn)` or reduced by hand over `[n, batch, ...]`), `.sum().backward()`,
then edits of the stacked `.grad`s before one stacked optimizer's `step()`:

- gradient accumulation over 3 micro-batches of different sizes, with BatchNorm, reduced as a
  mean of means (`loss / k`) or as a plain sum, `zero_grad()` with and without `set_to_none`;
  `make_step` after a hand-written backward replaces the gradient, as docs/fit.md says;
- per-member clipping with `vmapens.optim.clip_grad_norm_` (norm types 2, 1, inf, `foreach`)
  and `clip_grad_value_`, against `torch.nn.utils` on each member alone; a bound per member;
- Gaussian gradient noise with a per-member scale and weight decay by hand
  (`p.grad.add_(p, alpha=wd)`) on members of different sizes (`Ensemble.from_factories`): the
  noise lands on the padded entries too, which docs/semantics.md says the stacked optimizer's
  `step` masks;
- a layer frozen mid-training on `ens.template` (`requires_grad_(False)`, or the attribute) and
  unfrozen later: Adam's per-parameter step counts must follow torch's;
- an L1 and an orthogonality penalty from `ens.stacked_params()` added to the per-member loss
  (docs/fit.md's way), on one size and on padded members;
- an EMA of the weights by hand (`torch._foreach_lerp_`) and torch's `AveragedModel` on `ens`.

Each runs eager with `backend="vmap"`, `chunk_size=2` and `backend="loop"`. The truth is the
naive loop in plain PyTorch: one module per member, built by `ens.unstack()` before training
(the same initialisations), each with its own `torch.optim` optimizer, the same batches and
the same edits written for one module (the noise: member `i`'s slice of the same draw).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import vmapens

N = 4
SIZES = (5, 3, 7)  # micro-batch rows
TOL = {"rtol": 1e-10, "atol": 1e-10}  # float64: only the order of sums may differ
EXACT = {"rtol": 0.0, "atol": 0.0}
RUNS = {"vmap": {}, "chunk2": {"chunk_size": 2}, "loop": {"backend": "loop"}}

pytestmark = pytest.mark.usefixtures("float64_default")


def bn_member() -> nn.Module:
    # bias=False before BatchNorm: that bias's true gradient is 0 (docs/semantics.md).
    return nn.Sequential(nn.Linear(3, 6, bias=False), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 2))


class MLP(nn.Module):
    def __init__(self, hidden: int = 5) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(3, hidden), nn.Linear(hidden, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


WIDTHS = (5, 3, 4, 5)


def padded(**kw: Any) -> vmapens.Ensemble:
    return vmapens.Ensemble.from_factories(
        [functools.partial(MLP, h) for h in WIDTHS], seed=0, **kw
    )


def batches(count: int, rows: int = 8, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(rows, 3, generator=g), torch.randn(rows, 2, generator=g)) for _ in range(count)
    ]


def corner(t: Tensor, like: Tensor) -> Tensor:
    """Member `i`'s own entries of a padded row `t`: the leading corner of `like`'s shape."""
    return t[tuple(slice(0, d) for d in like.shape)]


def assert_as_alone(
    ens: vmapens.Ensemble, opt: Any, alone: list[nn.Module], opts: list[Any]
) -> None:
    for i, (m, o) in enumerate(zip(alone, opts)):
        torch.testing.assert_close(ens[i].state_dict(), m.state_dict(), **TOL)
        mine = opt.member_state_dict(i, module=m)["state"]
        for key, state in o.state_dict()["state"].items():
            torch.testing.assert_close(mine[key], state, **TOL)


# -- gradient accumulation ------------------------------------------------------------------


@pytest.mark.parametrize("run", sorted(RUNS))
def test_accumulation_mean_of_means_and_sum_with_batchnorm_as_alone(run: str) -> None:
    """3 micro-batches of 5, 3 and 7 rows, one step: each loss `/ k` (a mean of the three
    means, not the mean over 15 rows) through `per_member`, or a sum of squares reduced by hand
    over `[n, batch, out]`; `zero_grad()` and `zero_grad(set_to_none=False)`. BatchNorm updates
    its running statistics once per micro-batch, alone as in the ensemble (docs/fit.md)."""
    g = torch.Generator().manual_seed(1)
    data = [
        [(torch.randn(r, 3, generator=g), torch.randn(r, 2, generator=g)) for r in SIZES]
        for _ in range(3)
    ]
    for reduction, set_to_none in (("mean", True), ("sum", False)):
        ens = vmapens.Ensemble(bn_member, n=N, seed=0, **RUNS[run])
        alone = ens.unstack()
        kw = {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-2}
        opt = vmapens.StackedSGD(ens, **kw)
        opts = [torch.optim.SGD(m.parameters(), **kw) for m in alone]
        loss_fn = nn.MSELoss()
        for micro in data:
            opt.zero_grad(set_to_none=set_to_none)
            for x, y in micro:
                if reduction == "mean":
                    loss = vmapens.per_member(loss_fn)(ens(x), y) / len(micro)
                else:
                    loss = ((ens(x) - y) ** 2).sum(dim=(1, 2))
                assert loss.shape == (N,)
                loss.sum().backward()
            opt.step()
            for m, o in zip(alone, opts):
                o.zero_grad(set_to_none=set_to_none)
                for x, y in micro:
                    one = (
                        loss_fn(m(x), y) / len(micro)
                        if reduction == "mean"
                        else ((m(x) - y) ** 2).sum()
                    )
                    one.backward()
                o.step()
        assert_as_alone(ens, opt, alone, opts)


def test_make_step_after_a_hand_written_backward_replaces_the_gradient() -> None:
    """docs/fit.md: `make_step` replaces any `.grad` it finds (no accumulation), as a plain
    loop's `zero_grad` before its backward: a stray backward before it changes nothing."""
    (x, y), (x2, y2) = batches(2)
    ens = vmapens.Ensemble(MLP, n=N, seed=0)
    alone = ens.unstack()
    opt = vmapens.StackedAdam(ens, lr=1e-2)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in alone]
    step = vmapens.make_step(ens, nn.MSELoss(), opt)
    vmapens.per_member(nn.MSELoss())(ens(x2), y2).sum().backward()  # left in `.grad`
    step(x, y)
    for m, o in zip(alone, opts):
        o.zero_grad()
        nn.functional.mse_loss(m(x), y).backward()
        o.step()
    assert_as_alone(ens, opt, alone, opts)
    for i, m in enumerate(alone):
        for p, q in zip(ens.parameters(), m.parameters()):
            torch.testing.assert_close(p.grad[i], q.grad, **TOL)


# -- clipping --------------------------------------------------------------------------------


def _grads_of(ens: vmapens.Ensemble, alone: list[nn.Module], x: Tensor, y: Tensor) -> None:
    """Each member's own gradient, computed alone and copied into the stacked `.grad`s, so that
    the clipping alone is compared (a batched backward may round a gradient's last bit)."""
    vmapens.per_member(nn.MSELoss())(ens(x), y).sum().backward()
    for i, m in enumerate(alone):
        nn.functional.mse_loss(m(x), y).backward()
        with torch.no_grad():
            for p, q in zip(ens.parameters(), m.parameters()):
                p.grad[i].copy_(q.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_clipping_by_norm_types_and_by_value_with_foreach_as_each_member_alone(
    dtype: torch.dtype,
) -> None:
    """docs/optim.md: `clip_grad_norm_` clips each member exactly as `torch.nn.utils` clips it
    alone and returns the `[n]` norms; `clip_grad_value_` takes `foreach` too. Bit for bit in
    float32 and float64, given the same gradients."""
    x, y = (t.to(dtype) for t in batches(1)[0])
    for norm_type, foreach in ((2.0, None), (1.0, True), (math.inf, True), ("inf", False)):
        ens = vmapens.Ensemble(MLP, n=N, seed=0).to(dtype)
        alone = ens.unstack()
        _grads_of(ens, alone, x, y)
        norms = vmapens.optim.clip_grad_norm_(ens, 0.3, norm_type=norm_type, foreach=foreach)
        for i, m in enumerate(alone):
            norm = torch.nn.utils.clip_grad_norm_(
                m.parameters(), 0.3, norm_type=norm_type, foreach=foreach
            )
            torch.testing.assert_close(norms[i], norm, **EXACT)
            for p, q in zip(ens.parameters(), m.parameters()):
                torch.testing.assert_close(p.grad[i], q.grad, **EXACT)
    ens = vmapens.Ensemble(MLP, n=N, seed=0).to(dtype)
    alone = ens.unstack()
    _grads_of(ens, alone, x, y)
    assert vmapens.optim.clip_grad_value_(ens, torch.tensor(0.05), foreach=True) is None
    for i, m in enumerate(alone):
        torch.nn.utils.clip_grad_value_(m.parameters(), torch.tensor(0.05), foreach=True)
        for p, q in zip(ens.parameters(), m.parameters()):
            torch.testing.assert_close(p.grad[i], q.grad, **EXACT)


def test_a_max_norm_per_member_clips_each_member_as_alone_with_its_own_bound() -> None:
    """An lr sweep that also sweeps the clipping bound: member `i` clipped as
    `torch.nn.utils.clip_grad_norm_(m_i.parameters(), bounds[i])` (float32, bit for bit)."""
    bounds = [0.1, 0.5, 2.0, 0.3]
    x, y = (t.float() for t in batches(1)[0])
    ens = vmapens.Ensemble(MLP, n=N, seed=0).float()
    alone = ens.unstack()
    _grads_of(ens, alone, x, y)
    before = [p.grad.clone() for p in ens.parameters()]
    with pytest.raises(ValueError, match=r"^clip_grad_norm_: .*expected shape \(4,\), got \(3,\)"):
        vmapens.optim.clip_grad_norm_(ens, torch.tensor(bounds[:3]))
    assert all(torch.equal(p.grad, b) for p, b in zip(ens.parameters(), before))
    norms = vmapens.optim.clip_grad_norm_(ens, torch.tensor(bounds))
    for i, m in enumerate(alone):
        norm = torch.nn.utils.clip_grad_norm_(m.parameters(), bounds[i])
        torch.testing.assert_close(norms[i], norm, **EXACT)
        for p, q in zip(ens.parameters(), m.parameters()):
            torch.testing.assert_close(p.grad[i], q.grad, **EXACT)


# -- noise, weight decay by hand, padded members ---------------------------------------------


@pytest.mark.parametrize("run", sorted(RUNS))
@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_gradient_noise_and_weight_decay_by_hand_on_padded_members(kind: str, run: str) -> None:
    """Members of widths 5, 3, 4, 5 (padded to 5). Each step: `randn_like(p.grad)` scaled by
    each member's own sigma (member 0 noiseless) added to every stacked gradient, padded
    entries included, then `p.grad.add_(p, alpha=wd)`. Alone: member `i`'s corner of the same
    draw. docs/semantics.md: the stacked optimizer's `step` masks the padded entries' gradients,
    so they and their optimizer state stay exactly zero."""
    sigma = torch.tensor([0.0, 0.1, 0.2, 0.05])
    wd = 1e-2
    ens = padded(**RUNS[run])
    alone = ens.unstack()
    if kind == "adam":
        opt: Any = vmapens.StackedAdam(ens, lr=1e-2)
        opts: list[Any] = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in alone]
    else:
        opt = vmapens.StackedSGD(ens, lr=0.05, momentum=0.9)
        opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in alone]
    for s, (x, y) in enumerate(batches(3)):
        opt.zero_grad()
        vmapens.per_member(nn.MSELoss())(ens(x), y).sum().backward()
        torch.manual_seed(100 + s)
        noise = {}
        for name, p in ens.named_parameters():
            noise[name] = torch.randn_like(p.grad)
            p.grad.add_(noise[name] * sigma.view(-1, *[1] * (p.dim() - 1)))
            p.grad.add_(p, alpha=wd)
        assert ens.stacked_params()["fc1.weight"].grad[1, 3:].abs().sum() > 0  # noise padded
        opt.step()
        for i, (m, o) in enumerate(zip(alone, opts)):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            for name, q in m.named_parameters():
                q.grad.add_(corner(noise[name][i], q) * sigma[i])
                q.grad.add_(q, alpha=wd)
            o.step()
    assert_as_alone(ens, opt, alone, opts)
    stacked = ens.stacked_params()
    for i, h in enumerate(WIDTHS):
        for name, pad in (("fc1.weight", (i, slice(h, None))), ("fc1.bias", (i, slice(h, None))),
                          ("fc2.weight", (i, slice(None), slice(h, None)))):  # fmt: skip
            p = stacked[name]
            assert not p[pad].any(), (name, i)
            for key, state in opt.state[p].items():
                if key != "step":
                    assert not state[pad].any(), (name, key, i)
    ens.load_state_dict(ens.state_dict())  # still loads: no padded entry holds a value


# -- freezing --------------------------------------------------------------------------------


@pytest.mark.parametrize("run", sorted(RUNS))
@pytest.mark.parametrize("how", ["method", "attribute"])
def test_a_layer_frozen_mid_training_on_the_template_and_unfrozen_later(how: str, run: str) -> None:
    """Steps 0-1 train everything, steps 2-3 freeze the first Linear (`requires_grad_(False)`
    on `ens.template[0]`, or `p.requires_grad = False` on its parameters), steps 4-5 unfreeze
    it; Adam with weight decay. With `set_to_none=True` the frozen weight has no `.grad` and
    Adam skips it (its step count stays behind, so its bias correction after unfreezing is its
    own); with `set_to_none=False` it keeps a zero `.grad` and Adam still moves it (momentum
    and decay), alone as in the ensemble."""
    data = batches(6)
    for set_to_none in (True, False):
        ens = vmapens.Ensemble(bn_member, n=N, seed=0, **RUNS[run])
        alone = ens.unstack()
        opt = vmapens.StackedAdam(ens, lr=1e-2, weight_decay=0.1)
        opts = [torch.optim.Adam(m.parameters(), lr=1e-2, weight_decay=0.1) for m in alone]
        for s, (x, y) in enumerate(data):
            if s in (2, 4):
                flag = s == 4
                if how == "method":
                    ens.template[0].requires_grad_(flag)
                else:
                    for p in ens.template[0].parameters():
                        p.requires_grad = flag
                assert ens.stacked_params()["0.weight"].requires_grad is flag
                for m in alone:
                    m[0].requires_grad_(flag)
            opt.zero_grad(set_to_none=set_to_none)
            vmapens.per_member(nn.MSELoss())(ens(x), y).sum().backward()
            opt.step()
            for m, o in zip(alone, opts):
                o.zero_grad(set_to_none=set_to_none)
                nn.functional.mse_loss(m(x), y).backward()
                o.step()
        assert_as_alone(ens, opt, alone, opts)


# -- penalties from the stacked parameters ---------------------------------------------------

L1, ORTH = 1e-3, 1e-2


def eye_of_own_rows(w: Tensor, widths: tuple[int, ...]) -> Tensor:
    """`[n, H, H]`: member `i`'s identity on its own `widths[i]` rows, 0 on its padded rows."""
    eye = torch.zeros(w.shape[0], w.shape[1], w.shape[1], dtype=w.dtype)
    for i, h in enumerate(widths):
        eye[i, :h, :h] = torch.eye(h, dtype=w.dtype)
    return eye


def penalty_stacked(sp: dict[str, Tensor], widths: tuple[int, ...]) -> Tensor:
    """One value per member: L1 of every parameter, `||W1 W1^T - I||_F` (rows: the hidden
    units, padded) and `||W2 W2^T - I||_F^2` (rows: the 2 outputs)."""
    l1 = sum(p.abs().flatten(1).sum(1) for p in sp.values())
    w1, w2 = sp["fc1.weight"], sp["fc2.weight"]
    orth1 = torch.linalg.matrix_norm(w1 @ w1.mT - eye_of_own_rows(w1, widths))
    orth2 = ((w2 @ w2.mT - torch.eye(2)) ** 2).sum((-2, -1))
    return L1 * l1 + ORTH * (orth1 + orth2)


def penalty_alone(m: MLP) -> Tensor:
    w1, w2 = m.fc1.weight, m.fc2.weight
    l1 = sum(p.abs().sum() for p in m.parameters())
    orth1 = torch.linalg.matrix_norm(w1 @ w1.mT - torch.eye(w1.shape[0]))
    return L1 * l1 + ORTH * (orth1 + ((w2 @ w2.mT - torch.eye(2)) ** 2).sum())


@pytest.mark.parametrize("run", sorted(RUNS))
@pytest.mark.parametrize("sizes", ["one", "padded"])
def test_l1_and_orthogonality_penalties_from_stacked_params_as_alone(sizes: str, run: str) -> None:
    """docs/fit.md: `(per_member(loss_fn)(ens(x), y) + penalty).sum().backward()`, `penalty`
    one value per member from `ens.stacked_params()`. Each member gets exactly its own
    penalty's gradient. On padded members an identity over a padded dim must be the member's
    own (`eye_of_own_rows`): the padded rows of `W W^T` are 0, so `torch.eye(H)` there adds
    `H - h` to the member's squared norm (pinned below)."""
    widths = WIDTHS if sizes == "padded" else (5,) * N
    ens = (
        padded(**RUNS[run])
        if sizes == "padded"
        else vmapens.Ensemble(MLP, n=N, seed=0, **RUNS[run])
    )
    alone = ens.unstack()
    opt = vmapens.StackedAdam(ens, lr=1e-2)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in alone]
    for x, y in batches(3):
        opt.zero_grad()
        penalty = penalty_stacked(ens.stacked_params(), widths)
        assert penalty.shape == (N,)
        (vmapens.per_member(nn.MSELoss())(ens(x), y) + penalty).sum().backward()
        opt.step()
        for m, o in zip(alone, opts):
            o.zero_grad()
            (nn.functional.mse_loss(m(x), y) + penalty_alone(m)).backward()
            o.step()
    assert_as_alone(ens, opt, alone, opts)
    if sizes == "padded":  # the pitfall: a full-size identity counts member 1's 2 padded rows
        w1 = ens.stacked_params()["fc1.weight"].detach()
        naive = torch.linalg.matrix_norm(w1 @ w1.mT - torch.eye(5))
        own = torch.linalg.matrix_norm(alone[1].fc1.weight @ alone[1].fc1.weight.mT - torch.eye(3))
        torch.testing.assert_close(naive[1] ** 2, own.detach() ** 2 + 2, **TOL)


# -- EMA of the weights ----------------------------------------------------------------------


@pytest.mark.parametrize("run", sorted(RUNS))
@pytest.mark.parametrize("sizes", ["one", "padded"])
def test_ema_by_foreach_lerp_and_averaged_model_on_the_ensemble(sizes: str, run: str) -> None:
    """After each step: `torch._foreach_lerp_(ema, list(ens.parameters()), 0.1)` on stacked
    copies, and torch's `AveragedModel(ens, multi_avg_fn=get_ema_multi_avg_fn(0.9))`, against
    the same on each member alone; the averaged ensemble's member `i` and outputs too."""
    if sizes == "padded":
        ens = padded(**RUNS[run])
    else:
        ens = vmapens.Ensemble(MLP, n=N, seed=0, **RUNS[run])
    alone = ens.unstack()
    opt = vmapens.StackedSGD(ens, lr=0.1, momentum=0.5)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.5) for m in alone]
    ema = [p.detach().clone() for p in ens.parameters()]
    ema_alone = [[p.detach().clone() for p in m.parameters()] for m in alone]
    avg = AveragedModel(ens, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    avg_alone = [AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9)) for m in alone]
    data = batches(3)
    for x, y in data:
        opt.zero_grad()
        vmapens.per_member(nn.MSELoss())(ens(x), y).sum().backward()
        opt.step()
        with torch.no_grad():
            torch._foreach_lerp_(ema, list(ens.parameters()), 0.1)
        avg.update_parameters(ens)
        for m, o, e, a in zip(alone, opts, ema_alone, avg_alone):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
            with torch.no_grad():
                torch._foreach_lerp_(e, list(m.parameters()), 0.1)
            a.update_parameters(m)
    assert_as_alone(ens, opt, alone, opts)
    with torch.no_grad():
        out = avg(data[0][0])
    for i, (e, a) in enumerate(zip(ema_alone, avg_alone)):
        for stacked, q in zip(ema, e):
            torch.testing.assert_close(corner(stacked[i], q), q, **TOL)
        torch.testing.assert_close(avg.module[i].state_dict(), a.module.state_dict(), **TOL)
        with torch.no_grad():
            torch.testing.assert_close(out[i], a(data[0][0]), **TOL)
