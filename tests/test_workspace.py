"""vmapens._workspace: CPU buffers kept across calls, handed out only when nothing holds them.

The unit tests hold views the ways a caller can (a variable, a view of the view, an autograd
graph that saved it, a graph kept for a second backward, another thread) and check that
``take`` hands out another buffer meanwhile and the same one after. The LSTM cases are the
user's side: an ensemble called twice before one backward, a graph dropped without a
backward, a second backward through a kept graph, and a no-grad and an inference-mode call
in between; each against the members as torch's own ``nn.LSTM``, run alone.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from truth import autograd_nodes, seeded_members

from vmapens import Ensemble, _workspace

TOL = dict(atol=1e-10, rtol=1e-10)  # float64: the same maths, summed in another order


@pytest.fixture(autouse=True)
def _empty_pool():
    """Each test starts and ends with an empty pool on this thread."""
    _workspace._LOCAL.__dict__.pop("pool", None)
    yield
    _workspace._LOCAL.__dict__.pop("pool", None)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_a_buffer_in_use_is_not_handed_out_again():
    like = torch.empty(0)
    first = _workspace.take(like, 4, 5)
    second = _workspace.take(like, 4, 5)
    assert _storage(first) != _storage(second)
    kept = _storage(first)
    row = first[0]  # a view of the view holds it too
    del first
    third = _workspace.take(like, 4, 5)
    assert _storage(third) not in (kept, _storage(second))
    del row
    assert _storage(_workspace.take(like, 4, 5)) == kept


def test_another_shape_or_dtype_gets_another_buffer():
    kept = _storage(_workspace.take(torch.empty(0), 4, 5))
    assert _storage(_workspace.take(torch.empty(0), 5, 4)) != kept
    assert _storage(_workspace.take(torch.empty(0, dtype=torch.float64), 4, 5)) != kept
    assert _storage(_workspace.take(torch.empty(0), 4, 5)) == kept


def test_a_buffer_saved_by_autograd_is_held_until_the_graph_goes():
    w = torch.randn(3, requires_grad=True)
    buf = _workspace.take(w, 3).copy_(torch.arange(3.0))
    kept = _storage(buf)
    loss = (w * buf).sum()  # mul saves buf for w's gradient
    del buf
    others = [_workspace.take(w, 3)]  # held, so that only the saved buffer can come back
    assert _storage(others[0]) != kept
    loss.backward(retain_graph=True)
    others.append(_workspace.take(w, 3))
    assert _storage(others[1]) != kept  # the kept graph still holds it
    loss.backward()
    torch.testing.assert_close(w.grad, 2 * torch.arange(3.0))
    del loss
    assert _storage(_workspace.take(w, 3)) == kept


def test_a_buffer_held_on_another_thread_is_not_handed_out():
    held, ready, done = [], threading.Event(), threading.Event()

    def hold():
        held.append(_workspace.take(torch.empty(0), 6))
        ready.set()
        done.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert ready.wait(10)
        assert _storage(_workspace.take(torch.empty(0), 6)) != _storage(held[0])
    finally:
        done.set()
        thread.join(10)


def test_the_most_recently_used_free_buffer_comes_first():
    like = torch.empty(0)
    first, second = _workspace.take(like, 8), _workspace.take(like, 8)
    older, newer = _storage(first), _storage(second)
    del first, second  # both free; the second was made last
    assert _storage(_workspace.take(like, 8)) == newer
    held = _workspace.take(like, 8)  # the same one again, held now
    assert _storage(held) == newer
    assert _storage(_workspace.take(like, 8)) == older


def test_the_pool_keeps_at_most_its_capacity(monkeypatch):
    monkeypatch.setattr(_workspace, "CAPACITY", 4 * 100)  # one float32 buffer of 100
    like = torch.empty(0)
    kept = _storage(_workspace.take(like, 100))
    assert _storage(_workspace.take(like, 100)) == kept
    _workspace.take(like, 101)  # over the capacity: made, not kept
    assert [k.key[0] for k in _workspace._LOCAL.pool] == [(100,)]
    _workspace.take(like, 50)  # the free buffer of 100 makes room
    assert [k.key[0] for k in _workspace._LOCAL.pool] == [(50,)]
    held = _workspace.take(like, 50)
    _workspace.take(like, 60)  # the one of 50 is held: nothing makes room
    assert [k.key[0] for k in _workspace._LOCAL.pool] == [(50,)]
    del held


def test_the_least_recently_used_free_buffer_goes_first(monkeypatch):
    monkeypatch.setattr(_workspace, "CAPACITY", 4 * 100)
    like = torch.empty(0)
    _workspace.take(like, 40)
    _workspace.take(like, 50)
    _workspace.take(like, 40)  # used again: the one of 50 is now the least recent
    _workspace.take(like, 30)  # room for 30 more: one buffer goes
    assert [k.key[0] for k in _workspace._LOCAL.pool] == [(40,), (30,)]


def test_other_devices_and_dispatch_modes_get_a_tensor_not_kept():
    out = _workspace.take(torch.empty(0, device="meta"), 2, 3)
    assert out.device.type == "meta" and out.shape == (2, 3)
    like = torch.empty(0)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = _workspace.take(like, 2, 3)
    assert isinstance(fake, FakeTensor) and fake.shape == (2, 3)
    assert "pool" not in _workspace._LOCAL.__dict__


class _Member(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(3, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


def _truth_and_ensemble(n=3):
    members = seeded_members(lambda: _Member().double(), n)
    ens = Ensemble(lambda: _Member().double(), n, seeds=range(n))
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 5, 3, generator=g, dtype=torch.float64) for _ in range(3)]
    return members, ens, xs


def _loss(out: torch.Tensor) -> torch.Tensor:
    return (out * out).sum() + out.sum()


def test_two_calls_before_one_backward_train_as_each_lstm_alone():
    members, ens, (x1, x2, x3) = _truth_and_ensemble()
    with torch.inference_mode():
        ens(x1)  # its buffers are inference tensors, which no graph may save
    dropped = ens(x3)  # a graph made and dropped without a backward
    del dropped
    out1, out2 = ens(x1), ens(x2)  # both graphs alive: the same buffer shapes twice
    with torch.no_grad():
        ens(x3)  # a no-grad call in between
    total = _loss(out1) + _loss(out2)
    assert "_RecurrenceBackward" in autograd_nodes(total)  # the node that takes its buffers here
    total.backward(retain_graph=True)
    first = [p.grad.clone() for p in ens.parameters()]
    total.backward()  # through the kept graph: the saved buffers must be unchanged
    for k, member in enumerate(members):
        m_out1, m_out2 = member(x1), member(x2)
        torch.testing.assert_close((out1[k], out2[k]), (m_out1, m_out2), **TOL)
        (_loss(m_out1) + _loss(m_out2)).backward()
        for g, p in zip(first, member.parameters(), strict=True):
            torch.testing.assert_close(g[k], p.grad, **TOL)
        for g, p in zip(ens.parameters(), member.parameters(), strict=True):
            torch.testing.assert_close(g.grad[k], 2 * p.grad, **TOL)
