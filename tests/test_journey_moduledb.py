"""A hunt over torch's ModuleInfo database (``module_db``) through the user's path.

Every non-lazy ModuleInfo (108 of 114; torch 2.13, CPU, float64), up to 8 of its samples, in
training and eval mode where they differ, for n in 1, 2, 3 and every size of the input's shape
from 4 to 16 (a member count equal to a batch, channel or feature size): ``ens(*inputs)`` under
``no_grad`` (outputs leaf by leaf, tuples and PackedSequences included, and buffers after the
call), per-member inputs (``in_dims=0``: outputs, buffers, input and parameter gradients),
README's loop (``(out * w).sum().backward()``, every parameter's ``.grad``), and two
``make_step`` steps with ``StackedAdam(lr=0.01)`` against ``torch.optim.Adam`` alone (losses,
parameters, buffers; also ``chunk_size=2``, ``backend="loop"`` and ``in_dims=0``), each
member against a plain module built after ``torch.manual_seed(k)``.

No silent mismatch was found. One warning alone does not give: ``nn.PReLU`` on the input every
member shares made torch's batching rule resize an output (a deprecation ``UserWarning``, an
error under ``-W error``); since session 35 vmapens gives the input a row per member first
(``vmapens/_fixed_rules.py``, patch moduledb-1). The only differences are round-off that Adam amplifies where a
gradient entry sits near ``eps`` (about 1e-9 after two steps: a key bias of
``nn.MultiheadAttention``, whose gradient is zero up to round-off, and LSTMCell entries of
1e-8; the gradients themselves agree to 4e-15) and one refusal: ``nn.GaussianNLLLoss`` with a
member's own ``var`` checks ``torch.any(var < 0)``, which vmap cannot batch; the error names
``backend='loop'``, which is exact. The tests below pin a handful of representative modules
(samples shaped as the database's, written out here: ``torch.testing._internal`` needs
``expecttest``) and that refusal.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten
from truth import seeded_members

import vmapens

F64 = torch.float64
TOL: dict[str, Any] = {"rtol": 1e-10, "atol": 1e-12}  # float64, sums in another order


def _leaves(out: Any) -> list[Tensor]:
    if isinstance(out, nn.utils.rnn.PackedSequence):
        out = tuple(out)
    return [t for t in tree_flatten(out)[0] if isinstance(t, Tensor)]


def _loss(out: Any, ws: list[Tensor | None]) -> Tensor:
    return sum(
        ((t * w).sum() for t, w in zip(_leaves(out), ws) if w is not None),
        torch.zeros((), dtype=F64),
    )


def _check(
    factory: Callable[[], nn.Module],
    args: tuple,
    n: int,
    training: bool,
    step_atol: float = 1e-12,
    **ens_kw: Any,
) -> None:
    """(1) no_grad forward and buffers, (2) README's backward, (3) two make_step steps: each
    member against a plain module trained alone with torch.optim.Adam. ``step_atol``: Adam
    turns a gradient that is zero up to round-off (an attention key bias) into a step of
    ``lr * g / (|g| + eps)``, so 1e-16 of round-off becomes ~1e-9 after two steps."""

    def built() -> nn.Module:
        return factory().double().train(training)

    ens = vmapens.Ensemble(built, n=n, seeds=range(n), **ens_kw).train(training)
    alone = seeded_members(built, n)
    with torch.no_grad():
        got = _leaves(ens(*args))
        for k, m in enumerate(alone):
            for g, a in zip(got, _leaves(m(*args)), strict=True):
                torch.testing.assert_close(g[k], a, **TOL)
    for name, b in ens.named_buffers():
        for k, m in enumerate(alone):
            torch.testing.assert_close(b[k], dict(m.named_buffers())[name], **TOL)

    ens = vmapens.Ensemble(built, n=n, seeds=range(n), **ens_kw).train(training)
    alone = seeded_members(built, n)
    out = ens(*args)
    gen = torch.Generator().manual_seed(1)
    ws = [
        torch.randn(t.shape[1:], generator=gen, dtype=F64) if t.is_floating_point() else None
        for t in _leaves(out)
    ]
    _loss(out, ws).backward()
    for m in alone:
        _loss(m(*args), ws).backward()
    for name, p in ens.named_parameters():
        for k, m in enumerate(alone):
            torch.testing.assert_close(p.grad[k], dict(m.named_parameters())[name].grad, **TOL)

    ens = vmapens.Ensemble(built, n=n, seeds=range(n), **ens_kw).train(training)
    alone = seeded_members(built, n)
    step = vmapens.make_step(ens, lambda o, _t: _loss(o, ws), vmapens.StackedAdam(ens, lr=0.01))
    inputs = args[0] if len(args) == 1 else args
    losses = [step(inputs, torch.zeros(())) for _ in range(2)]
    for k, m in enumerate(alone):
        opt = torch.optim.Adam(m.parameters(), lr=0.01)
        for s in range(2):
            opt.zero_grad()
            loss = _loss(m(*args), ws)
            loss.backward()
            opt.step()
            torch.testing.assert_close(losses[s][k], loss.detach(), **TOL)
        truth = dict(list(m.named_parameters()) + list(m.named_buffers()))
        for name, t in list(ens.named_parameters()) + list(ens.named_buffers()):
            torch.testing.assert_close(
                t[k].detach(), truth[name].detach(), rtol=1e-10, atol=step_atol
            )


def _x(*shape: int, seed: int = 0) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple], int, bool, float]] = {
    # name: (factory, inputs, n (often = a size of the input), training, step_atol)
    "batchnorm2d-train": (
        lambda: nn.BatchNorm2d(3, momentum=None),
        lambda: (_x(4, 3, 2, 2),),
        4,
        True,
        1e-12,
    ),
    "instancenorm1d-stats": (
        lambda: nn.InstanceNorm1d(3, affine=True, track_running_stats=True),
        lambda: (_x(4, 3, 6),),
        3,
        True,
        1e-12,
    ),
    "conv1d": (
        lambda: nn.Conv1d(3, 4, 3, padding=1, groups=1),
        lambda: (_x(2, 3, 5),),
        5,
        True,
        1e-12,
    ),
    "convtranspose2d-groups": (
        lambda: nn.ConvTranspose2d(4, 4, 2, stride=2, groups=2),
        lambda: (_x(1, 4, 3, 3),),
        4,
        True,
        1e-12,
    ),
    "bilinear": (
        lambda: nn.Bilinear(2, 3, 4),
        lambda: (_x(4, 2), _x(4, 3, seed=1)),
        4,
        True,
        1e-12,
    ),
    "lstm-bidir-eval": (
        lambda: nn.LSTM(4, 3, num_layers=2, bidirectional=True, batch_first=True),
        lambda: (_x(2, 5, 4),),
        4,
        False,
        1e-12,
    ),
    "decoder-layer": (
        lambda: nn.TransformerDecoderLayer(4, 2, dim_feedforward=8, dropout=0.0, batch_first=True),
        lambda: (_x(2, 3, 4), _x(2, 5, 4, seed=1)),
        3,
        True,
        1e-8,  # the attention's key bias: zero gradient up to round-off (see _check)
    ),
    "mha-eval": (
        lambda: nn.MultiheadAttention(4, 2, bias=False, batch_first=True),
        lambda: (_x(2, 3, 4), _x(2, 5, 4, seed=1), _x(2, 5, 4, seed=2)),
        2,
        False,
        1e-12,
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_module_through_the_users_path(name: str) -> None:
    factory, inputs, n, training, step_atol = CASES[name]
    _check(factory, inputs(), n, training, step_atol)


def test_loop_and_chunks_are_exact_for_batchnorm() -> None:
    for kw in ({"chunk_size": 2}, {"backend": "loop"}):
        _check(lambda: nn.BatchNorm1d(3), (_x(4, 3),), 3, True, **kw)


def test_packed_sequence_refused_by_vmap_and_exact_in_the_loop() -> None:
    """A shared PackedSequence into nn.GRU: refused (naming backend='loop'), then the packed
    output and h_n per member, leaf by leaf, with the loop."""
    seq = nn.utils.rnn.pack_padded_sequence(_x(3, 4, 2), torch.tensor([4, 3, 1]), batch_first=True)
    with pytest.raises(TypeError, match="backend='loop'"):
        vmapens.Ensemble(lambda: nn.GRU(2, 3, batch_first=True).double(), n=2)(seq)
    _check(lambda: nn.GRU(2, 3, batch_first=True), (seq,), 3, True, backend="loop")


def test_prelu_on_a_shared_input_warns_nothing() -> None:
    """nn.PReLU(3) on the input every member sees: torch's batching rule of _prelu_kernel
    resizes an output of the input's shape [2, 3, 4] to the members' [n, 2, 3, 4], a
    deprecated behaviour that warns (UserWarning, an error under -W error, as here) and that
    "a future PyTorch release" will refuse; alone the module warns nothing. Values are right.
    Patch moduledb-1 gives the input a broadcast row per member first."""
    _check(lambda: nn.PReLU(3), (_x(2, 3, 4),), 3, True)


def test_gaussian_nll_with_members_own_var_refused_then_loop_exact() -> None:
    x, t, var = _x(3, 4, 5), _x(3, 4, 5, seed=1), _x(3, 4, 5, seed=2).abs() + 0.1
    with pytest.raises(RuntimeError, match="backend='loop'"):
        vmapens.Ensemble(nn.GaussianNLLLoss, n=3)(x, t, var, in_dims=0)
    got = vmapens.Ensemble(nn.GaussianNLLLoss, n=3, backend="loop")(x, t, var, in_dims=0)
    torch.testing.assert_close(
        got, torch.stack([nn.GaussianNLLLoss()(x[k], t[k], var[k]) for k in range(3)]), **TOL
    )
