"""User journey: an ensemble of tiny hand-written state-space sequence models.

A researcher writes three SSM layers by hand (float64, 3 members, sequence 16, state 4):

- `Diag`: a diagonal linear recurrence with a learned log-timestep per channel
  (`dt = exp(log_dt)`, `A = -exp(log_A)`, `A_bar = exp(dt * A)`), run either as a Python loop
  over time or as a causal convolution with the kernel `K[t] = C A_bar^t B` (powers from
  `torch.cumprod`) applied by zero-padded `torch.fft.rfft` / `irfft`;
- `Selective`: a Mamba-lite selective scan, input-dependent `dt`, `B`, `C` from Linear layers,
  the states gathered with `torch.stack`;
- `LogScan`: a parallel scan `h_t = a_t h_{t-1} + u_t` with signed input-dependent `a_t`,
  written with `torch.cumsum` of `log|a_t|` and the sign handled separately (the parity of the
  negative factors).

Each is trained with AdamW whose weight decay excludes `log_dt` / `log_A` by param groups
(docs/optim.md: groups built over the ensemble's tensors, picked by name with
`ens.get_parameter`), through `make_step`, `fit` and `predict`, also with `chunk_size=2`. The
truth: 3 plain modules, each with its own `torch.optim.AdamW` and the same two groups, the same
batches (docs/fit.md's order via tests/truth.py), float64.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn
from truth import batch_plan, seeded_members, train_alone

import vmapens

N, T, S, D = 3, 16, 4, 2  # members, sequence length, state size, channels
LRS = [1e-2, 3e-2, 5e-3]
WD = 0.1
NO_DECAY = ("log_dt", "log_A")
TOL: dict[str, Any] = dict(rtol=1e-9, atol=1e-10)


class Diag(nn.Module):
    """Diagonal SSM per channel; `conv=True` applies it as an FFT convolution."""

    def __init__(self, conv: bool = False) -> None:
        super().__init__()
        self.conv = conv
        self.log_dt = nn.Parameter(torch.log(torch.linspace(0.05, 0.3, D)))
        self.log_A = nn.Parameter(torch.log(torch.rand(D, S) + 0.5))
        self.B = nn.Parameter(torch.randn(D, S) * 0.5)
        self.C = nn.Parameter(torch.randn(D, S) * 0.5)
        self.head = nn.Linear(D, 1)

    def forward(self, x: Tensor) -> Tensor:  # x [batch, T, D] -> [batch, T, 1]
        dt = torch.exp(self.log_dt).unsqueeze(-1)  # [D, 1]
        a_bar = torch.exp(dt * -torch.exp(self.log_A))  # [D, S]
        b_bar = dt * self.B
        if self.conv:
            powers = torch.cumprod(a_bar.expand(T - 1, D, S), dim=0)  # A_bar^1..A_bar^(T-1)
            powers = torch.cat([torch.ones_like(a_bar).unsqueeze(0), powers])
            k = (self.C * powers * b_bar).sum(-1)  # [T, D]
            xf = torch.fft.rfft(x.transpose(1, 2), n=2 * T)
            y = torch.fft.irfft(xf * torch.fft.rfft(k.T, n=2 * T), n=2 * T)[..., :T]
            y = y.transpose(1, 2)
        else:
            h = x.new_zeros(x.shape[0], D, S)
            ys = []
            for t in range(T):
                h = a_bar * h + b_bar * x[:, t].unsqueeze(-1)
                ys.append((self.C * h).sum(-1))
            y = torch.stack(ys, 1)
        return self.head(y)


class Selective(nn.Module):
    """Mamba-lite: dt, B, C from the input; a sequential scan stacked with torch.stack."""

    def __init__(self) -> None:
        super().__init__()
        self.log_A = nn.Parameter(torch.log(torch.rand(D, S) + 0.5))
        self.to_dt = nn.Linear(D, D)
        self.to_B = nn.Linear(D, S)
        self.to_C = nn.Linear(D, S)
        self.head = nn.Linear(D, 1)

    def forward(self, x: Tensor) -> Tensor:
        dt = nn.functional.softplus(self.to_dt(x)).unsqueeze(-1)  # [batch, T, D, 1]
        a_bar = torch.exp(dt * -torch.exp(self.log_A))  # [batch, T, D, S]
        bx = dt * self.to_B(x).unsqueeze(2) * x.unsqueeze(-1)  # [batch, T, D, S]
        c = self.to_C(x).unsqueeze(2)
        h = x.new_zeros(x.shape[0], D, S)
        states = []
        for t in range(T):
            h = a_bar[:, t] * h + bx[:, t]
            states.append(h)
        hs = torch.stack(states, 1)
        return self.head((hs * c).sum(-1))


class LogScan(nn.Module):
    """h_t = a_t h_{t-1} + u_t in parallel: cumsum of log|a|, the sign by parity."""

    def __init__(self, parallel: bool = True) -> None:
        super().__init__()
        self.parallel = parallel
        self.to_mag = nn.Linear(D, D)
        self.to_sign = nn.Linear(D, D)
        self.to_u = nn.Linear(D, D)
        self.head = nn.Linear(D, 1)

    def forward(self, x: Tensor) -> Tensor:
        mag = 0.6 + 0.35 * torch.sigmoid(self.to_mag(x))  # [batch, T, D]
        neg = self.to_sign(x) < 0
        u = self.to_u(x)
        if self.parallel:
            log_p = torch.cumsum(torch.log(mag), 1)  # log |prod_{s<=t} a_s|
            sign = 1 - 2 * torch.remainder(torch.cumsum(neg.long(), 1), 2).to(x.dtype)
            p = sign * torch.exp(log_p)
            h = p * torch.cumsum(u / p, 1)
        else:
            a = torch.where(neg, -mag, mag)
            hs, h_t = [], torch.zeros_like(u[:, 0])
            for t in range(T):
                h_t = a[:, t] * h_t + u[:, t]
                hs.append(h_t)
            h = torch.stack(hs, 1)
        return self.head(h)


MODELS = {
    "diag_loop": lambda: Diag(conv=False).double(),
    "diag_conv": lambda: Diag(conv=True).double(),
    "selective": lambda: Selective().double(),
    "logscan": lambda: LogScan().double(),
}


def data(count: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(count, T, D, generator=g, dtype=torch.float64)
    y = torch.randn(count, T, 1, generator=g, dtype=torch.float64)
    return x, y


def torch_groups(named: Any, keep_empty: bool = False) -> list[dict[str, Any]]:
    named = list(named)
    groups = [
        {"params": [p for k, p in named if k in NO_DECAY], "weight_decay": 0.0},
        {"params": [p for k, p in named if k not in NO_DECAY], "weight_decay": WD},
    ]
    return [g for g in groups if g["params"] or keep_empty]


def stacked_adamw(ens: vmapens.Ensemble, keep_empty: bool = False) -> vmapens.StackedAdam:
    # docs/optim.md: param groups over the ensemble's tensors, picked by the template's names.
    named = [(k, ens.get_parameter(k)) for k, _ in ens.template.named_parameters()]
    groups = torch_groups(named, keep_empty)
    return vmapens.StackedAdam(groups, lr=LRS, decoupled_weight_decay=True)


def alone(model: nn.Module, i: int, keep_empty: bool = False) -> torch.optim.Optimizer:
    return torch.optim.AdamW(torch_groups(model.named_parameters(), keep_empty), lr=LRS[i])


def test_the_hand_written_forms_agree() -> None:
    """The truth's own check: conv == loop, parallel log-space scan == sequential scan."""
    x, _ = data(3)
    torch.manual_seed(0)
    loop = Diag(conv=False).double()
    conv = Diag(conv=True).double()
    conv.load_state_dict(loop.state_dict())
    torch.testing.assert_close(conv(x), loop(x), **TOL)
    par = LogScan(parallel=True).double()
    seq = LogScan(parallel=False).double()
    seq.load_state_dict(par.state_dict())
    torch.testing.assert_close(par(x), seq(x), **TOL)


@pytest.mark.parametrize("chunk", [None, 2])
@pytest.mark.parametrize("name", list(MODELS))
def test_make_step_matches_adamw_alone(name: str, chunk: int | None) -> None:
    factory = MODELS[name]
    ens = vmapens.Ensemble(factory, N, seeds=range(N), chunk_size=chunk)
    plain = seeded_members(factory, N)
    step = vmapens.make_step(ens, nn.functional.mse_loss, stacked_adamw(ens))
    x, y = data(5 * 3, seed=1)
    batches = [(x[k : k + 5], y[k : k + 5]) for k in range(0, 15, 5)]
    for xb, yb in batches:
        step(xb, yb)
    for i, m in enumerate(plain):
        train_alone(m, batches, make_opt=alone(m, i))
    for i, m in enumerate(plain):
        for k, v in m.state_dict().items():
            torch.testing.assert_close(ens[i].state_dict()[k], v, **TOL, msg=f"{name} {i} {k}")


@pytest.mark.parametrize("name", ["diag_conv", "selective", "logscan"])
def test_fit_and_predict_match_adamw_alone(name: str) -> None:
    factory = MODELS[name]
    ens = vmapens.Ensemble(factory, N, seeds=range(N), chunk_size=2)
    plain = seeded_members(factory, N)
    x, y = data(10, seed=2)
    hist = vmapens.fit(
        ens, (x, y), nn.functional.mse_loss, optimizer=stacked_adamw(ens),
        epochs=2, batch_size=4, seed=7, progress=False,
    )  # fmt: skip
    plan = batch_plan(10, 4, 6, seed=7)
    for i, m in enumerate(plain):
        train_alone(m, [(x[r], y[r]) for r in plan], make_opt=alone(m, i))
    assert hist is not None
    xt, _ = data(4, seed=3)
    with torch.no_grad():
        outs = torch.stack([m.eval()(xt) for m in plain])
    torch.testing.assert_close(vmapens.predict(ens, xt), outs, **TOL)
    torch.testing.assert_close(vmapens.predict(ens, xt, reduce="mean", chunk_size=2),
                               outs.mean(0), **TOL)  # fmt: skip
    for i, m in enumerate(plain):
        for k, v in m.state_dict().items():
            torch.testing.assert_close(ens[i].state_dict()[k], v, **TOL, msg=f"{name} {i} {k}")


def test_an_empty_no_decay_group_trains_as_adamw_alone() -> None:
    """The researcher's one group split for all three models: LogScan has no `log_dt` /
    `log_A`, so its no-decay group is empty; torch.optim.AdamW keeps an empty group."""
    factory = MODELS["logscan"]
    ens = vmapens.Ensemble(factory, N, seeds=range(N))
    plain = seeded_members(factory, N)
    opt = stacked_adamw(ens, keep_empty=True)
    assert [len(g["params"]) for g in opt.param_groups] == [0, 8]
    step = vmapens.make_step(ens, nn.functional.mse_loss, opt)
    x, y = data(10, seed=4)
    batches = [(x[:5], y[:5]), (x[5:], y[5:])]
    for xb, yb in batches:
        step(xb, yb)
    for i, m in enumerate(plain):
        train_alone(m, batches, make_opt=alone(m, i, keep_empty=True))
        for k, v in m.state_dict().items():
            torch.testing.assert_close(ens[i].state_dict()[k], v, **TOL, msg=f"{i} {k}")
    member_opt = torch.optim.AdamW(torch_groups(plain[1].named_parameters(), True), lr=LRS[1])
    member_opt.load_state_dict(opt.member_state_dict(1))
    assert member_opt.param_groups[0]["params"] == []


def test_an_empty_group_marked_capturable_by_dynamo_still_steps() -> None:
    """torch.compile's dynamo marks a group `capturable=True` when all its parameters are on
    CUDA, and all() of none is True: an empty group then reached the stacked optimizer with a
    flag it refuses (the compiled step failed naming `capturable`). A group with no parameters
    updates nothing, so its flags are moot, as in torch."""
    ens = vmapens.Ensemble(MODELS["logscan"], N, seeds=range(N))
    opt = stacked_adamw(ens, keep_empty=True)
    opt.param_groups[0]["capturable"] = True  # what dynamo leaves on the empty group
    step = vmapens.make_step(ens, nn.MSELoss(), opt)
    x, y = torch.randn(4, 16, 2, dtype=torch.float64), torch.randn(4, 16, 1, dtype=torch.float64)
    step(x, y)
    with pytest.raises(ValueError, match="capturable"):  # a group with parameters: refused
        opt.param_groups[1]["capturable"] = True
        step(x, y)
