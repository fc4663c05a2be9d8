"""Forward paths and the training step against plain torch: cases a bug hunt found.

Every truth here is plain PyTorch: the same modules built alone (seeded as ``seeds=`` builds
the members), run and trained with ``torch.optim`` and ``torch.nn.utils``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from truth import seeded_members

import vmapens

N = 3
TOL = dict(rtol=1e-9, atol=1e-12)


pytestmark = pytest.mark.usefixtures("float64_default")


# -- nn.MultiheadAttention's `None` weights ------------------------------------------------


def _mha() -> nn.Module:
    return nn.MultiheadAttention(8, 2, batch_first=True)


@pytest.mark.parametrize(
    "options",
    [{}, {"chunk_size": 2}, {"backend": "loop"}],
    ids=["vmap", "chunked", "loop"],
)
@pytest.mark.parametrize(
    "call",
    [
        {"need_weights": False},
        {"need_weights": False, "attn_mask": torch.ones(5, 5, dtype=torch.bool).triu(1)},
    ],
    ids=["self-attention", "masked"],
)
def test_attention_without_weights_returns_none_as_each_member_alone(options, call):
    ens = vmapens.Ensemble(_mha, n=N, seeds=range(N), **options)
    x = torch.randn(2, 5, 8)
    out, weights = ens(x, x, x, **call)
    assert weights is None
    for i, member in enumerate(seeded_members(_mha, N)):
        alone, none = member(x, x, x, **call)
        assert none is None
        torch.testing.assert_close(out[i], alone, **TOL)


# -- one gradient tensor for two parameters ------------------------------------------------


class _TwoBiases(nn.Module):
    """``b1 + b2``: autograd hands both parameters one gradient tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.b1 = nn.Parameter(torch.randn(4))
        self.b2 = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + (self.b1 + self.b2)


class _LSTMHead(nn.Module):
    """The fused LSTM node's gradients of ``bias_ih`` and ``bias_hh`` are one tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(3, 4, batch_first=True)
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0][:, -1])


class _SummedOffset(nn.Module):
    """``offset.sum()``: autograd hands ``offset`` an expanded (stride 0) gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.offset = nn.Parameter(torch.randn(2, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + self.offset.sum()


@pytest.mark.parametrize(
    "factory, shape",
    [(_TwoBiases, (5, 3)), (_LSTMHead, (5, 6, 3)), (_SummedOffset, (5, 3))],
    ids=["b1+b2", "lstm-biases", "expanded"],
)
@pytest.mark.parametrize("clip", ["clip_grad_norm", "clip_grad_value"])
def test_eager_step_clips_each_gradient_once_whatever_tensor_autograd_returns(factory, shape, clip):
    ens = vmapens.Ensemble(factory, n=N, seeds=range(N))
    opt = vmapens.StackedSGD(ens, lr=0.1)
    step = vmapens.make_step(ens, nn.MSELoss(), opt, **{clip: 0.05})
    alone = seeded_members(factory, N)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in alone]
    clip_alone = {
        "clip_grad_norm": nn.utils.clip_grad_norm_,
        "clip_grad_value": nn.utils.clip_grad_value_,
    }[clip]
    for _ in range(3):
        x, y = torch.randn(shape), torch.randn(5, 4)
        step(x, y)
        for m, opt in zip(alone, opts, strict=True):
            opt.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            clip_alone(m.parameters(), 0.05)
            opt.step()
    grads = [p.grad for p in ens.parameters()]
    assert len({g.untyped_storage().data_ptr() for g in grads}) == len(grads)
    state = ens.state_dict()
    for i, m in enumerate(alone):
        for name, value in m.state_dict().items():
            torch.testing.assert_close(state[name][i], value, **TOL)


# -- an empty batch through an LSTM ----------------------------------------------------------


@pytest.mark.parametrize("batch_first", [False, True])
def test_lstm_on_an_empty_batch_returns_empty_outputs_as_alone(batch_first):
    def factory() -> nn.Module:
        return nn.LSTM(3, 4, num_layers=2, batch_first=batch_first)

    ens = vmapens.Ensemble(factory, n=N, seeds=range(N))
    x = torch.randn(0, 5, 3) if batch_first else torch.randn(5, 0, 3)
    out, (h, c) = ens(x)
    for i, member in enumerate(seeded_members(factory, N)):
        want, (h_want, c_want) = member(x)
        assert out[i].shape == want.shape and h[i].shape == h_want.shape
        assert c[i].shape == c_want.shape


# -- BatchNorm with momentum=None (cumulative average) -------------------------------------


def _cnn(dims: int) -> Callable[[], nn.Module]:
    conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
    norm = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[dims]

    def factory() -> nn.Module:
        return nn.Sequential(
            conv(2, 3, 3, bias=False), norm(3, momentum=None), nn.ReLU(), nn.Flatten(1)
        )

    return factory


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_batchnorm_cumulative_average_trains_as_each_member_alone(dims):
    factory = _cnn(dims)
    ens = vmapens.Ensemble(factory, n=N, seeds=range(N))
    alone = seeded_members(factory, N)
    width = 3 * 2**dims
    head = torch.randn(width, 1)
    loss_fn = lambda out, y: nn.functional.mse_loss(out @ head, y)  # noqa: E731
    step = vmapens.make_step(ens, loss_fn, vmapens.StackedAdam(ens, lr=1e-2))
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in alone]
    for _ in range(3):
        x, y = torch.randn(4, 2, *[4] * dims), torch.randn(4, 1)
        step(x, y)
        for m, opt in zip(alone, opts, strict=True):
            opt.zero_grad()
            loss_fn(m(x), y).backward()
            opt.step()
    ens.eval()
    x = torch.randn(4, 2, *[4] * dims)
    out = ens(x)
    state = ens.state_dict()
    for i, m in enumerate(alone):
        m.eval()
        torch.testing.assert_close(out[i], m(x), **TOL)
        for name, value in m.state_dict().items():
            torch.testing.assert_close(state[name][i], value, **TOL)


# -- a loss with more than one value per member --------------------------------------------


@pytest.mark.parametrize("options", [{}, {"chunk_size": 2}, {"backend": "loop"}], ids=str)
def test_step_refuses_a_loss_of_several_values_and_changes_nothing(options):
    ens = vmapens.Ensemble(lambda: nn.Linear(3, 1), n=N, seeds=range(N), **options)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    x, y = torch.randn(5, 3), torch.randn(5, 1)
    alone = nn.Linear(3, 1)
    with pytest.raises(RuntimeError, match="scalar"):  # plain torch refuses it too
        nn.functional.mse_loss(alone(x), y, reduction="none").backward()
    step = vmapens.make_step(ens, nn.MSELoss(reduction="none"), vmapens.StackedSGD(ens, lr=0.1))
    with pytest.raises(ValueError, match=r"step: `loss_fn` must return one value per member"):
        step(x, y)
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k])
    assert all(p.grad is None for p in ens.parameters())


def test_step_takes_a_one_element_loss_as_backward_does():
    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out, y).reshape(1)

    factory = lambda: nn.Linear(3, 1)  # noqa: E731
    ens = vmapens.Ensemble(factory, n=N, seeds=range(N))
    step = vmapens.make_step(ens, loss_fn, vmapens.StackedSGD(ens, lr=0.1))
    x, y = torch.randn(5, 3), torch.randn(5, 1)
    losses = step(x, y)
    assert losses.shape == (N,)
    for i, m in enumerate(seeded_members(factory, N)):
        loss = loss_fn(m(x), y)
        loss.backward()  # plain torch takes a one-element loss
        torch.optim.SGD(m.parameters(), lr=0.1).step()
        torch.testing.assert_close(losses[i], loss[0].detach(), **TOL)
        torch.testing.assert_close(ens.state_dict()["weight"][i], m.weight.detach(), **TOL)


# -- an LSTM state given as a list -----------------------------------------------------------


@pytest.mark.parametrize(
    "factory, x, state",
    [
        (lambda: nn.LSTM(3, 4, num_layers=2), (5, 2, 3), [(2, 2, 4), (2, 2, 4)]),
        (lambda: nn.LSTMCell(3, 4), (2, 3), [(2, 4), (2, 4)]),
    ],
    ids=["LSTM", "LSTMCell"],
)
def test_lstm_state_as_a_list_runs_as_alone(factory, x, state):
    ens = vmapens.Ensemble(factory, n=N, seeds=range(N))
    x = torch.randn(x)
    hx = [torch.randn(s) for s in state]
    out = tree_leaves(ens(x, hx))
    for i, member in enumerate(seeded_members(factory, N)):
        want = tree_leaves(member(x, hx))  # torch takes a list [h_0, c_0] as well as a tuple
        assert len(out) == len(want) == (3 if isinstance(member, nn.LSTM) else 2)
        for got, alone in zip(out, want, strict=True):
            torch.testing.assert_close(got[i], alone, **TOL)
