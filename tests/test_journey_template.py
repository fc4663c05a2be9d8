"""User journey: ``ens.template`` treated as if it were "the model".

The template is a module on ``meta`` whose parameters are linked to the stacked ones
(docs/semantics.md, "Storage", "Buffers and train/eval"). What a user does to it must reach
every member as the same call on each member alone would, or be refused with a clear message
before anything changes: modes (``eval()``/``train()`` on the root and on a submodule),
``bn.momentum``, ``requires_grad_(False)`` on a layer mid-training with ``torch.optim.Adam``;
dtype conversions, ``load_state_dict`` of a member's state dict, ``reset_running_stats``,
``fill_`` under ``no_grad`` (refused at the next call); ``copy.deepcopy``/``torch.save`` of the
template; the template called directly; a parameter set to None, ``zero_grad`` and an optimizer
over the template's parameters, a bias set to None (patch template-1) and a buffer's ``.data``
written (``TemplateBuffer``): each was silent, and is refused now (session 34).
The truth: each member a plain module trained alone with ``torch.optim.Adam``, float64.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from truth import seeded_members, twins

import vmapens

N, B = 3, 6
F64 = torch.float64
TOL: dict[str, Any] = dict(rtol=1e-10, atol=1e-12)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4, dtype=F64)
        self.bn = nn.BatchNorm1d(4, dtype=F64)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(4, 2, dtype=F64)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.drop(torch.tanh(self.bn(self.fc(x)))))


def _batches(count: int, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(B, 3, generator=g, dtype=F64), torch.randn(B, 2, generator=g, dtype=F64))
        for _ in range(count)
    ]


def _built(backend: str = "vmap") -> tuple[vmapens.Ensemble, list[nn.Module]]:
    alone = seeded_members(Net, N)
    return vmapens.Ensemble.from_modules(twins(alone), backend=backend), alone


def _assert_members(ens: vmapens.Ensemble, alone: list[nn.Module], where: str) -> None:
    for i, m in enumerate(alone):
        got, want = ens[i].state_dict(), m.state_dict()
        assert list(got) == list(want), where
        for k in want:
            torch.testing.assert_close(got[k], want[k], **TOL, msg=f"{where}: member {i} {k}")


def _step(ens: vmapens.Ensemble, opt: torch.optim.Optimizer, x: Tensor, y: Tensor) -> None:
    opt.zero_grad()
    ((ens(x) - y) ** 2).mean(dim=(1, 2)).sum().backward()  # member i's grad is its own
    opt.step()


def _step_alone(alone: list[nn.Module], opts: list[torch.optim.Optimizer], x: Tensor, y: Tensor):
    for m, opt in zip(alone, opts, strict=True):
        opt.zero_grad()
        nn.functional.mse_loss(m(x), y).backward()
        opt.step()


# -- what reaches every member ----------------------------------------------------------------


@pytest.mark.parametrize("backend", ["vmap", "loop"])
def test_modes_momentum_and_a_frozen_layer_set_on_the_template_train_as_alone(
    backend: str,
) -> None:
    """A fine-tune in eval mode (dropout off, BatchNorm frozen: the dropout's p=0.5 would show),
    then train mode with ``momentum = 0.5``, then ``fc`` frozen mid-training, each set on the
    template as on each member; torch.optim.Adam over ``ens.parameters()``."""
    ens, alone = _built(backend)
    opt = torch.optim.Adam(ens.parameters(), lr=0.05)
    opts = [torch.optim.Adam(m.parameters(), lr=0.05) for m in alone]
    data = _batches(4)

    def edit(fn: Any) -> None:
        fn(ens.template)
        for m in alone:
            fn(m)

    edit(lambda m: m.eval())
    for x, y in data[:1]:
        _step(ens, opt, x, y)
        _step_alone(alone, opts, x, y)
    _assert_members(ens, alone, "eval")
    edit(lambda m: (m.train(), setattr(m.bn, "momentum", 0.5), setattr(m.drop, "p", 0.0)))
    for x, y in data[1:3]:
        _step(ens, opt, x, y)
        _step_alone(alone, opts, x, y)
    _assert_members(ens, alone, "train, momentum 0.5")
    edit(lambda m: m.fc.requires_grad_(False))
    for x, y in data[3:]:
        _step(ens, opt, x, y)
        _step_alone(alone, opts, x, y)
    _assert_members(ens, alone, "fc frozen")
    assert not ens.stacked_params()["fc.weight"].requires_grad
    edit(lambda m: m.eval())
    with torch.no_grad():
        want = torch.stack([m(data[0][0]) for m in alone])
        torch.testing.assert_close(ens(data[0][0]), want, **TOL)


@pytest.mark.parametrize(
    "edit",
    [
        lambda t: t.half(),
        lambda t: t.to(torch.float32),
        lambda t: t.bn.reset_running_stats(),
        lambda t: t.bn.running_var.fill_(1.0),
        lambda t: torch.no_grad()(t.fc.weight.fill_)(1.0),
        lambda t: nn.init.constant_(t.head.bias, 0.5),
    ],
    ids=["half", "to_float32", "reset_running_stats", "buffer_fill", "fill_no_grad", "constant_"],
)
def test_a_template_write_is_refused_at_the_next_call_and_changes_nothing(edit: Any) -> None:
    ens, alone = _built()
    x, y = _batches(1)[0]
    _step(ens, torch.optim.SGD(ens.parameters(), lr=0.1), x, y)  # trained: not the init values
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    edit(ens.template)
    with pytest.raises(ValueError, match=r"`ens\.template\.\w+\.\w+` was written in place"):
        ens(x)
    torch.testing.assert_close(ens.state_dict(), before, rtol=0, atol=0)
    ens.eval()
    with torch.no_grad():  # refused once: the ensemble runs on, from its members' own values
        want = torch.stack([twin.eval()(x) for twin in (ens[i] for i in range(N))])
        torch.testing.assert_close(ens(x), want, **TOL)
    assert ens(x).dtype == F64


def test_load_state_dict_of_a_member_into_the_template_is_refused() -> None:
    """torch warns that a copy into meta is a no-op; the next call refuses it, naming the
    ways to load values into the members, and no member changed."""
    ens, alone = _built()
    x = _batches(1)[0][0]
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    pretrained = Net().state_dict()
    with pytest.warns(UserWarning, match="meta parameter.*no-op"):
        ens.template.load_state_dict(pretrained)
    with pytest.raises(ValueError, match=r"`ens\.template\.fc\.weight` was written in place"):
        ens(x)
    torch.testing.assert_close(ens.state_dict(), before, rtol=0, atol=0)
    ens.load_state_dict({k: v.expand(N, *v.shape) for k, v in pretrained.items()})  # the way
    for i in range(N):
        torch.testing.assert_close(ens[i].state_dict(), pretrained, rtol=0, atol=0)


def test_copies_of_the_template_are_on_meta_and_leave_the_ensemble_linked() -> None:
    ens, alone = _built()
    keys = list(Net().state_dict())
    clone = copy.deepcopy(ens.template)
    buf = io.BytesIO()
    torch.save(ens.template, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for m in (clone, loaded):
        assert list(m.state_dict()) == keys
        assert all(t.is_meta for t in m.state_dict().values())
    clone.fc.requires_grad_(False)  # a copy's flag is its own
    assert ens.stacked_params()["fc.weight"].requires_grad
    ens.template.fc.requires_grad_(False)  # the template's still reaches the members
    assert not ens.stacked_params()["fc.weight"].requires_grad
    _assert_members(ens, alone, "after copies")


def test_the_template_called_directly_is_refused_by_torch_and_changes_nothing() -> None:
    ens, alone = _built()
    x = _batches(1)[0][0]
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    with pytest.raises(RuntimeError, match="meta"):
        ens.template(x)
    torch.testing.assert_close(ens.state_dict(), before, rtol=0, atol=0)
    ens.eval()
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m.eval()(x) for m in alone]), **TOL)


# -- bugs: silent ------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["vmap", "loop"])
def test_a_bias_set_to_none_on_the_template_is_refused(backend: str) -> None:
    """``ens.template.head.bias = None``: alone the forward drops the bias; the ensemble went
    on adding every member's (0.49 off), and ``ens[i]`` (no bias) disagreed with ``ens(x)``."""
    ens, alone = _built(backend)
    x = _batches(1)[0][0]
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    bias = ens.template.head.bias
    ens.template.head.bias = None
    for _ in range(2):  # every call, until it is set back
        with pytest.raises(ValueError, match=r"`ens\.template\.head\.bias` was set to None"):
            ens(x)
    with pytest.raises(ValueError, match=r"`ens\.template\.head\.bias` was set to None"):
        ens.state_dict()  # the bias it would save is not what the template shows (session 46)
    ens.template.head.bias = bias
    torch.testing.assert_close(ens.state_dict(), before, rtol=0, atol=0)
    ens.eval()
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m.eval()(x) for m in alone]), **TOL)


def test_zero_grad_on_the_template_is_refused_not_left_to_accumulate() -> None:
    """A loop that calls ``ens.template.zero_grad()`` (a plain model's ``model.zero_grad()``)
    with Adam over ``ens.parameters()``: nothing was cleared, gradients added up from step 2 on
    and every member drifted from alone, silently. Refused once there are gradients to clear,
    before the second backward."""
    ens, alone = _built()
    opt = torch.optim.Adam(ens.parameters(), lr=0.05)
    (x, y), (x2, _) = _batches(2)
    ens.template.zero_grad()  # no gradient anywhere yet: nothing to clear, as alone
    ((ens(x) - y) ** 2).mean(dim=(1, 2)).sum().backward()
    opt.step()
    grads = [p.grad.clone() for p in ens.parameters()]
    with pytest.raises(RuntimeError, match=r"ens\.template.*ens\.zero_grad\(\)"):
        ens.template.zero_grad()
    for p, g in zip(ens.parameters(), grads, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)


def test_torch_optimizer_over_the_template_parameters_is_refused() -> None:
    """``torch.optim.Adam(ens.template.parameters())`` (docs: "steps nothing") trained no
    member and said nothing; its first step after a backward is refused, nothing changed."""
    ens, _ = _built()
    opt = torch.optim.Adam(ens.template.parameters(), lr=0.05)
    x, y = _batches(1)[0]
    ((ens(x) - y) ** 2).mean(dim=(1, 2)).sum().backward()
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"ens\.template.*torch\.optim\.Adam\(ens\.parameters"):
        opt.step()
    torch.testing.assert_close(ens.state_dict(), before, rtol=0, atol=0)
    assert not opt.state  # Adam made no state either


@pytest.mark.parametrize(
    "write",
    [
        lambda bn: bn.running_var.data.fill_(1.0),
        lambda bn: setattr(bn.running_mean, "data", torch.zeros(4, dtype=F64, device="meta")),
        lambda bn: bn.num_batches_tracked.data.add_(1),
    ],
    ids=["fill", "assign", "count"],
)
def test_a_write_through_a_template_buffers_data_is_refused(write: Any) -> None:
    """The parameters' ``.data`` shares their version counter (session 32); a buffer's is a
    plain meta tensor's: the write reaches no member and the next call says nothing."""
    ens, _ = _built()
    x = _batches(1)[0][0]
    write(ens.template.bn)
    with pytest.raises(ValueError, match=r"`ens\.template\.bn\.\w+` was written"):
        ens(x)
