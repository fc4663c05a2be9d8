"""User journey: an ensemble of tiny CTC speech/OCR models (Conv1d + bidirectional GRU + Linear).

The script a researcher writes: each member maps features ``[B, T, F]`` to
``log_softmax(-1)`` scores transposed to ``[T, B, C]``; the loss is ``nn.CTCLoss(blank=0,
reduction="mean", zero_infinity=True)`` with variable ``input_lengths`` / ``target_lengths``,
targets padded ``[B, S]`` or concatenated 1-D; the batch shared by all members, or each member
its own (``in_dims=0``). Trained by ``make_step`` (vmap and ``backend="loop"``) and by a
hand-written loop with ``vmapens.per_member(ctc, in_dims=...)``; greedy decoding (``argmax``,
collapse repeats, drop blanks) under ``torch.no_grad``. torch has no batching rule for
``aten::ctc_loss``; vmap runs its fallback (a loop over members) with a performance warning,
which is not a refusal: the results must still be the member's own.

The truth: 3 plain modules, each trained alone with ``torch.optim.Adam`` on the same batches.
float64 end to end (CTC's CPU kernel takes float64), so only summation order may differ.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import vmapens

N, STEPS, B, T, F, V, S = 3, 2, 3, 7, 4, 5, 3
LR = 0.05
TOL: dict[str, Any] = dict(rtol=1e-9, atol=1e-10)
CTC = nn.CTCLoss(blank=0, reduction="mean", zero_infinity=True)
# torch's vmap fallback for ctc_loss warns of the speed (a loop over members); that is all.
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop")


class Speech(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(F, 6, 3, padding=1)
        self.rnn = nn.GRU(6, 4, batch_first=True, bidirectional=True)
        self.head = nn.Linear(8, V)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv(x.transpose(1, 2)).relu().transpose(1, 2)
        h, _ = self.rnn(h)
        return self.head(h).log_softmax(-1).transpose(0, 1)  # [T, B, V]


def members() -> list[nn.Module]:
    out = []
    for k in range(N):
        torch.manual_seed(k)
        out.append(Speech().double())
    return out


def ctc(log_probs: Tensor, y: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    targets, input_lengths, target_lengths = y
    return CTC(log_probs, targets, input_lengths, target_lengths)


def batch(g: torch.Generator, concat: bool) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
    x = torch.randn(B, T, F, generator=g, dtype=torch.float64)
    input_lengths = torch.tensor([T, T - 2, T - 3])
    # Row 2 cannot fit 3 labels with a repeat in 4 frames -> infinite loss, zeroed.
    target_lengths = torch.tensor([S, 2, S])
    targets = torch.randint(1, V, (B, S), generator=g)
    targets[2] = torch.tensor([1, 1, 1])
    targets[1, 2] = 0  # padding past the length
    if concat:
        targets = torch.cat([targets[b, : target_lengths[b]] for b in range(B)])
    return x, (targets, input_lengths, target_lengths)


def batches(own: bool, concat: bool) -> list[Any]:
    """STEPS batches; per member (`own`): a list of N batches per step."""
    g = torch.Generator().manual_seed(7)
    return [[batch(g, concat) for _ in range(N)] if own else batch(g, concat) for _ in range(STEPS)]


def stack(per: list[Any]) -> Any:
    xs = torch.stack([x for x, _ in per])
    return xs, tuple(torch.stack([y[j] for _, y in per]) for j in range(3))


def train_alone(own: bool, concat: bool) -> list[nn.Module]:
    plain = members()
    for i, m in enumerate(plain):
        opt = torch.optim.Adam(m.parameters(), lr=LR)
        for b in batches(own, concat):
            x, y = b[i] if own else b
            opt.zero_grad()
            ctc(m(x), y).backward()
            opt.step()
    return plain


def assert_members(ens: vmapens.Ensemble, plain: list[nn.Module]) -> None:
    for i, m in enumerate(plain):
        got, want = ens[i].state_dict(), m.state_dict()
        for k in want:
            torch.testing.assert_close(got[k], want[k], **TOL, msg=f"member {i} {k}")


CASES = [("vmap", False, False), ("vmap", False, True), ("vmap", True, True)]


@pytest.mark.parametrize(
    ("backend", "own", "concat"), [*CASES, ("loop", False, True), ("loop", True, False)]
)
def test_make_step_ctc_equals_alone(backend: str, own: bool, concat: bool) -> None:
    ens = vmapens.Ensemble.from_modules(members(), backend=backend)
    opt = vmapens.StackedAdam(ens.parameters(), lr=LR)
    step = vmapens.make_step(ens, ctc, opt, in_dims=0 if own else None)
    losses = []
    for b in batches(own, concat):
        x, y = stack(b) if own else b
        losses.append(step(x, y))
    plain = train_alone(own, concat)
    assert_members(ens, plain)
    # The step's losses are the members' own (recomputed with the trained-alone modules' init).
    first = members()
    x, y = stack(batches(own, concat)[0]) if own else batches(own, concat)[0]
    with torch.no_grad():
        want = torch.stack(
            [
                ctc(m(x[i] if own else x), tuple(t[i] for t in y) if own else y)
                for i, m in enumerate(first)
            ]
        )
    torch.testing.assert_close(losses[0].detach(), want, **TOL)


@pytest.mark.parametrize("own", [False, True])
def test_hand_loop_per_member_ctc(own: bool) -> None:
    """`out = ens(x)`, `per_member(ctc, in_dims=...)(out, y).sum().backward()`, `opt.step()`."""
    ens = vmapens.Ensemble.from_modules(members())
    opt = vmapens.StackedAdam(ens.parameters(), lr=LR)
    # CTCLoss's own four positional arguments, the member dim first on the scores.
    fn = vmapens.per_member(CTC, in_dims=(0, 0, 0, 0) if own else (0, None, None, None))
    for b in batches(own, concat=False):
        x, (tg, il, tl) = stack(b) if own else b
        out = ens(x, in_dims=0) if own else ens(x)
        opt.zero_grad()
        fn(out, tg, il, tl).sum().backward()
        opt.step()
    assert_members(ens, train_alone(own, concat=False))


def greedy(log_probs: Tensor, lengths: Tensor) -> list[list[int]]:
    best = log_probs.argmax(-1).T  # [B, T]
    out = []
    for row, n in zip(best.tolist(), lengths.tolist()):
        seq, prev = [], None
        for c in row[:n]:
            if c != prev and c != 0:
                seq.append(c)
            prev = c
        out.append(seq)
    return out


def test_greedy_decode_after_training() -> None:
    ens = vmapens.Ensemble.from_modules(members())
    step = vmapens.make_step(ens, ctc, vmapens.StackedAdam(ens.parameters(), lr=LR))
    for x, y in batches(False, False):
        step(x, y)
    plain = train_alone(False, False)
    x, (_, lengths, _) = batches(False, False)[0]
    ens.eval()
    with torch.no_grad():
        out = ens(x)
        for i, m in enumerate(plain):
            m.eval()
            want = m(x)
            torch.testing.assert_close(out[i], want, **TOL)
            assert greedy(out[i], lengths) == greedy(want, lengths)
        # The ensemble's decode: mean of member probabilities, then greedy.
        mean = torch.stack([m(x).exp() for m in plain]).mean(0).log()
        torch.testing.assert_close(out.exp().mean(0).log(), mean, **TOL)


def test_refused_step_changes_nothing() -> None:
    """Under `warnings.simplefilter("error")` torch's fallback warning is an error inside the
    ensemble only: the step refuses, naming backend='loop', and leaves members and Adam's state
    as they were; the next steps, warnings back to normal, train as alone."""
    ens = vmapens.Ensemble.from_modules(members())
    opt = vmapens.StackedAdam(ens.parameters(), lr=LR)
    step = vmapens.make_step(ens, ctc, opt)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    data = batches(False, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match=r"^step: .*backend='loop'"):
            step(*data[0])
    assert not opt.state
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k
    for x, y in data:
        step(x, y)
    assert_members(ens, train_alone(False, False))


def test_int_list_lengths_refusal_says_way_out() -> None:
    """nn.CTCLoss alone takes `input_lengths` / `target_lengths` as lists of ints; the step
    refuses them before anything runs, but its message should say to pass tensors."""
    ens = vmapens.Ensemble.from_modules(members())
    step = vmapens.make_step(ens, ctc, vmapens.StackedAdam(ens.parameters(), lr=LR))
    x, (tg, il, tl) = batches(False, False)[0]
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    with pytest.raises(TypeError, match=r"^step: `targets`.*torch\.tensor\(input_lengths\)"):
        step(x, (tg, il.tolist(), tl.tolist()))
    for k, v in ens.state_dict().items():
        assert torch.equal(v, before[k]), k
