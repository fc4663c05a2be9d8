"""Journey: members that learn from each other, checked against the naive joint loop.

Here the truth is not "each member trained alone": the members' losses interact, so the truth
is N plain modules trained *jointly* in a Python loop (each module's forward in turn, the
losses built from the list of their outputs, one backward of the summed loss, one
torch.optim optimizer per module). The ensemble side is written as a researcher would from
README.md and docs/: one `ens(x)` gives the stacked output `[n, B, C]`, the cross-member loss
is written over it, and a stacked optimizer steps (docs/fit.md: `loss_fn` sees one member's
output, so a cross-member loss is a step written by hand).

(1) deep mutual learning (Zhang et al. 2018), each member's KL to the mean of its peers'
probabilities, with the peers detached and without (gradients cross members), over the
default vmap backend, `chunk_size` and `backend="loop"`, with per-member learning rates and
per-member clipping; DML with detached peers through `make_step` with per-member targets;
(2) negative-correlation learning, with and without detaching the ensemble mean; (3) a
diversity penalty on the members' flattened weights from `ens.stacked_params()`; (4) `fit` and
`make_step` refuse a `loss_fn` that reads the other members' outputs; (5) `ens[i]`,
`ens.select` and member files afterwards.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from truth import TOL64, assert_members_equal, assert_states, seeded_members

import vmapens

N = 4
LRS = [1e-2, 3e-2, 5e-3, 2e-2]


def net() -> nn.Module:
    return nn.Sequential(
        nn.Linear(4, 8, bias=False),  # no bias before BatchNorm (its gradient is round-off)
        nn.BatchNorm1d(8),
        nn.Tanh(),
        nn.Linear(8, 3),
    ).double()


def reg() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 1)).double()


def _cls_data(rows: int = 12, seed: int = 0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 4, generator=g, dtype=torch.float64)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0.3).long()


def _reg_data(rows: int = 10, seed: int = 1) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 3, generator=g, dtype=torch.float64)
    return x, torch.sin(x.sum(1, keepdim=True))


# ---------------------------------------------------------------- the naive joint loop


def _joint_loop(models, opts, x, total_of, steps: int, clip: float | None = None) -> None:
    """The naive code: each plain module's forward in turn, one summed loss, one backward, each
    module's own clip and optimizer step."""
    for _ in range(steps):
        for o in opts:
            o.zero_grad()
        outs = [m(x) for m in models]
        total_of(outs).backward()
        for m, o in zip(models, opts, strict=True):
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
            o.step()


def _dml_naive(y: Tensor, detach: bool):
    """Deep mutual learning over a list of plain outputs: member i's cross-entropy plus
    KL(p_i || mean of the other members' p_j)."""

    def total(outs: list[Tensor]) -> Tensor:
        probs = [o.softmax(-1) for o in outs]
        losses = []
        for i, o in enumerate(outs):
            peers = [p for j, p in enumerate(probs) if j != i]
            q = sum(peers[1:], peers[0]) / len(peers)
            if detach:
                q = q.detach()
            log_p = o.log_softmax(-1)
            kl = (log_p.exp() * (log_p - q.log())).sum(-1).mean()
            losses.append(F.cross_entropy(o, y) + kl)
        return sum(losses[1:], losses[0])

    return total


def _dml_stacked(out: Tensor, y: Tensor, detach: bool) -> Tensor:
    """The same loss over the ensemble's stacked output `[n, B, C]`: one value per member."""
    n = out.shape[0]
    log_p = out.log_softmax(-1)
    p = log_p.exp()
    q = (p.sum(0, keepdim=True) - p) / (n - 1)  # the mean of the others, for every member
    if detach:
        q = q.detach()
    kl = (p * (log_p - q.log())).sum(-1).mean(-1)
    return vmapens.per_member(F.cross_entropy)(out, y) + kl


# ---------------------------------------------------------------- (1) deep mutual learning


@pytest.mark.parametrize("how", ["vmap", "chunks", "loop"])
@pytest.mark.parametrize("detach", [True, False], ids=["detached", "through"])
def test_deep_mutual_learning_in_a_hand_loop_is_the_naive_joint_loop(how: str, detach: bool):
    x, y = _cls_data()
    kw = {"vmap": {}, "chunks": {"chunk_size": 3}, "loop": {"backend": "loop"}}[how]
    ens = vmapens.Ensemble(net, N, seeds=range(N), **kw)
    models = seeded_members(net, N)
    opt = vmapens.StackedAdam(ens, lr=torch.tensor(LRS, dtype=torch.float64))
    clip = 0.5 if not detach else None  # per-member clipping of the crossed gradients
    for _ in range(3):
        opt.zero_grad()
        losses = _dml_stacked(ens(x), y, detach)
        assert losses.shape == (N,)
        losses.sum().backward()
        if clip is not None:
            vmapens.optim.clip_grad_norm_(ens, clip)
        opt.step()
    opts = [torch.optim.Adam(m.parameters(), lr=lr) for m, lr in zip(models, LRS, strict=True)]
    _joint_loop(models, opts, x, _dml_naive(y, detach), 3, clip)
    assert_members_equal(ens, models)  # parameters and BatchNorm statistics


def test_the_crossed_gradients_are_the_naive_loops_and_not_each_members_own() -> None:
    """Without `.detach()` member 0's gradient holds the other members' KL terms: the summed
    loss's gradient is the naive joint loop's, and differs from member 0's own loss alone."""
    x, y = _cls_data()
    ens = vmapens.Ensemble(net, N, seeds=range(N))
    models = seeded_members(net, N)
    _dml_stacked(ens(x), y, detach=False).sum().backward()
    _dml_naive(y, detach=False)([m(x) for m in models]).backward()
    for i, m in enumerate(models):
        for name, p in m.named_parameters():
            torch.testing.assert_close(ens.get_parameter(name).grad[i], p.grad, **TOL64)
    own = [copy.deepcopy(m) for m in seeded_members(net, N)]
    outs = [m(x) for m in own]
    _dml_naive(y, detach=True)(outs).backward()  # each member's own term only
    w = ens.get_parameter("3.weight").grad[0]
    assert (w - own[0][3].weight.grad).abs().max() > 1e-4  # the crossed terms do count


def test_mutual_learning_with_detached_peers_through_make_step_targets() -> None:
    """Detached peers are fixed targets: the step is then `make_step(in_dims=0)` with member
    i's own target, its peers' mean computed from `ens(x)` under no_grad before the step."""
    x, y = _cls_data()
    ens = vmapens.Ensemble(reg_cls, N, seeds=range(N))
    models = seeded_members(reg_cls, N)

    def dml(out: Tensor, t: Tensor) -> Tensor:
        log_p = out.log_softmax(-1)
        q = t[:, :3]
        return (
            F.cross_entropy(out, t[:, 3].long()) + (log_p.exp() * (log_p - q.log())).sum(-1).mean()
        )

    step = vmapens.make_step(ens, dml, vmapens.StackedSGD(ens, lr=LRS, momentum=0.9), in_dims=0)
    xs = x.expand(N, *x.shape)
    for _ in range(3):
        with torch.no_grad():
            p = ens(x).softmax(-1)
        q = (p.sum(0, keepdim=True) - p) / (N - 1)
        step(xs, torch.cat([q, y.double().expand(N, -1)[..., None]], -1))
    opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9) for m, lr in zip(models, LRS)]
    _joint_loop(models, opts, x, _dml_naive(y, detach=True), 3)
    assert_members_equal(ens, models)


def reg_cls() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()


# ---------------------------------------------------------------- (2) negative correlation

LAM = 0.5


@pytest.mark.parametrize("detach", [True, False], ids=["detached", "through"])
def test_negative_correlation_learning_is_the_naive_joint_loop(detach: bool) -> None:
    x, y = _reg_data()
    ens = vmapens.Ensemble(reg, N, seeds=range(N))
    models = seeded_members(reg, N)
    opt = vmapens.StackedSGD(ens, lr=[0.1, 0.05, 0.2, 0.02], momentum=0.9)
    for _ in range(4):
        out = ens(x)  # [n, B, 1]
        f_bar = out.mean(0)
        if detach:
            f_bar = f_bar.detach()
        mse = vmapens.per_member(F.mse_loss)(out, y)
        loss = mse - LAM * ((out - f_bar) ** 2).mean((1, 2))
        opt.zero_grad()
        loss.sum().backward()
        opt.step()

    def total(outs: list[Tensor]) -> Tensor:
        f_bar = sum(outs[1:], outs[0]) / len(outs)
        if detach:
            f_bar = f_bar.detach()
        losses = [F.mse_loss(f, y) - LAM * ((f - f_bar) ** 2).mean() for f in outs]
        return sum(losses[1:], losses[0])

    opts = [
        torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9)
        for m, lr in zip(models, [0.1, 0.05, 0.2, 0.02], strict=True)
    ]
    _joint_loop(models, opts, x, total, 4)
    assert_members_equal(ens, models)


# ---------------------------------------------------------------- (3) a diversity penalty

BETA = 0.3


def _cosine_penalty(flat: Tensor) -> Tensor:
    unit = F.normalize(flat, dim=1)
    sim = unit @ unit.T
    return (sim.sum() - sim.diagonal().sum()) / (flat.shape[0] * (flat.shape[0] - 1))


def test_a_pairwise_cosine_penalty_on_stacked_params_is_the_naive_joint_loop() -> None:
    x, y = _reg_data()
    ens = vmapens.Ensemble(reg, N, seeds=range(N))
    models = seeded_members(reg, N)
    opt = vmapens.StackedAdam(ens, lr=LRS, weight_decay=1e-3)
    for _ in range(4):
        flat = torch.cat([p.reshape(N, -1) for p in ens.stacked_params().values()], 1)
        loss = vmapens.per_member(F.mse_loss)(ens(x), y).sum() + BETA * _cosine_penalty(flat)
        opt.zero_grad()
        loss.backward()
        opt.step()

    def total(outs: list[Tensor]) -> Tensor:
        flat = torch.stack([torch.cat([p.reshape(-1) for p in m.parameters()]) for m in models])
        return sum(F.mse_loss(f, y) for f in outs) + BETA * _cosine_penalty(flat)

    opts = [
        torch.optim.Adam(m.parameters(), lr=lr, weight_decay=1e-3)
        for m, lr in zip(models, LRS, strict=True)
    ]
    _joint_loop(models, opts, x, total, 4)
    assert_members_equal(ens, models)
    assert ens.get_parameter("0.weight").grad[1].abs().sum() > 0


class Sized(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, hidden), nn.Linear(hidden, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(x)))


def _corner_flat(m: Sized, width: int) -> Tensor:
    """A member's weights flattened as the padded storage holds them: its own entries in the
    leading corner, constant zeros up to `width` hidden units."""
    k = width - m.a.out_features
    parts = [F.pad(m.a.weight, (0, 0, 0, k)), F.pad(m.a.bias, (0, k)), F.pad(m.b.weight, (0, k))]
    return torch.cat([t.reshape(-1) for t in [*parts, m.b.bias]])


def test_a_diversity_penalty_over_members_of_different_sizes_leaves_the_padding_at_zero():
    x, y = _reg_data()
    factories = [functools.partial(Sized, h) for h in (4, 6, 4, 6)]
    ens = vmapens.Ensemble.from_factories(factories, seed=0).double()
    models = [m.double() for m in ens.unstack()]
    opt = vmapens.StackedAdam(ens, lr=LRS)
    for _ in range(3):
        flat = torch.cat([p.reshape(N, -1) for p in ens.stacked_params().values()], 1)
        loss = vmapens.per_member(F.mse_loss)(ens(x), y).sum() + BETA * _cosine_penalty(flat)
        opt.zero_grad()
        loss.backward()
        opt.step()

    def total(outs: list[Tensor]) -> Tensor:
        flat = torch.stack([_corner_flat(m, 6) for m in models])
        return sum(F.mse_loss(f, y) for f in outs) + BETA * _cosine_penalty(flat)

    opts = [torch.optim.Adam(m.parameters(), lr=lr) for m, lr in zip(models, LRS, strict=True)]
    _joint_loop(models, opts, x, total, 3)
    ens.load_state_dict(ens.state_dict())  # refused once a padded entry holds a value
    assert ens.get_parameter("a.weight")[0, 4:].abs().max() == 0
    assert_members_equal(ens, models)


# ---------------------------------------------------------------- (4) fit and make_step


def _state(ens) -> dict[str, Tensor]:
    return {k: v.clone() for k, v in ens.state_dict().items()}


def test_fit_refuses_a_loss_fn_that_reads_the_other_members_outputs() -> None:
    x, y = _cls_data()
    ens = vmapens.Ensemble(reg_cls, N, seeds=range(N))
    before = _state(ens)

    def dml(out: Tensor, target: Tensor) -> Tensor:  # the peers from a forward of its own
        q = ens(x).softmax(-1).mean(0)
        log_p = out.log_softmax(-1)
        return F.cross_entropy(out, target) + (log_p.exp() * (log_p - q.log())).sum(-1).mean()

    # the self-check's refusal names the step fit builds, the parameters reached and the way
    # out: the step written by hand over `ens(x)`, as in the tests above
    with pytest.raises(ValueError, match=r"step: `loss_fn` reads the ensemble's own stacked"
                       r" parameters \(`0.bias`.*write the step by hand"):  # fmt: skip
        vmapens.fit(ens, (x, y), dml, epochs=1, progress=False, seed=0)
    for k, v in ens.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


def test_make_step_refuses_a_loss_that_reads_a_stacked_output_computed_before_it() -> None:
    x, y = _cls_data()
    ens = vmapens.Ensemble(reg_cls, N, seeds=range(N))
    before = _state(ens)
    peers = ens(x).softmax(-1)  # with its graph: what a user would pass in a closure

    def dml(out: Tensor, target: Tensor) -> Tensor:
        log_p = out.log_softmax(-1)
        q = peers.mean(0)
        return F.cross_entropy(out, target) + (log_p.exp() * (log_p - q.log())).sum(-1).mean()

    step = vmapens.make_step(ens, dml, vmapens.StackedAdam(ens, lr=1e-2))
    with pytest.raises(ValueError, match=r"step: `loss_fn` reads the ensemble's own stacked"):
        step(x, y)
    for k, v in ens.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    assert all(p.grad is None for p in ens.parameters())


# ---------------------------------------------------------------- (5) afterwards


def test_after_mutual_learning_members_select_and_member_files(tmp_path) -> None:
    x, y = _cls_data()
    ens = vmapens.Ensemble(net, N, seeds=range(N))
    models = seeded_members(net, N)
    opt = vmapens.StackedAdam(ens, lr=LRS)
    for _ in range(2):
        opt.zero_grad()
        _dml_stacked(ens(x), y, detach=False).sum().backward()
        opt.step()
    opts = [torch.optim.Adam(m.parameters(), lr=lr) for m, lr in zip(models, LRS, strict=True)]
    _joint_loop(models, opts, x, _dml_naive(y, detach=False), 2)

    for i in range(N):  # ens[i] is a plain module of the class, in the ensemble's mode
        m = ens[i]
        assert isinstance(m, nn.Sequential) and m.training
        m.eval()
        models[i].eval()
        torch.testing.assert_close(m(x), models[i](x), **TOL64)
        models[i].train()
    sub = ens.select([2, 0])
    assert_members_equal(sub, [models[2], models[0]])
    # the optimizer's hand-off per member: Adam's state alone
    for i in (1, 3):
        state = opt.member_state_dict(i)
        alone = opts[i].state_dict()["state"]
        for k, want in state["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(want[key], alone[k][key], **TOL64)
    paths = vmapens.save_members(ens, tmp_path / "members")
    states = vmapens.load_members(tmp_path / "members")
    assert [p.name for p in paths] == [f"member_{i:04d}.pt" for i in range(N)]
    plain = net()
    plain.load_state_dict(torch.load(paths[3], weights_only=True))
    torch.testing.assert_close(plain.state_dict()["3.weight"], models[3][3].weight, **TOL64)
    assert_states(states, ens.unstack())  # the files hold the members bit for bit
    for s, m in zip(states, models, strict=True):
        for k, want in m.state_dict().items():
            torch.testing.assert_close(s[k], want, **TOL64, msg=k)
