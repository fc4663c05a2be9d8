"""User journey: an ensemble of small NER taggers with a linear-chain CRF on top.

A researcher ensembles N taggers (embedding, a BiLSTM or a conv encoder, a linear projection to
emission scores, and a CRF with learned `transitions` and start/end scores), written the way
common CRF code (pytorch-crf, PyTorch's BiLSTM-CRF tutorial) writes it: the forward algorithm
with `torch.logsumexp` in a Python loop over time steps, the padding mask applied with
`torch.where(mask[:, t, None], next, score)`, the gold path's score with `gather` and indexing
of `transitions` by tag pairs, the NLL as loss; Viterbi decoding with max/argmax per step,
backpointers stacked and a backtrack with `gather` in a reversed loop. Sequences have variable
lengths (padded). Trained with `fit` (one learning rate per member, the NLL from the forward,
or a custom loss computing the CRF from the forward's emissions and CRF parameters), decoded
inside the ensemble three ways (a `tags=None` branch of the forward, `map_members` through a
view module whose forward is `decode`, and `predict`), written as member files and decoded by
plain modules loaded from them. pytorch-crf's own `decode` ends with `.tolist()` per
sequence: refused under vmap naming `backend="loop"` (docs/semantics.md, "What vmap cannot
batch").

The truth: each member a plain module trained alone with `torch.optim.Adam` on the same
batches (`tests/truth.py`'s `batch_plan`), float64, and its own `decode`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call

import vmapens

sys.path.insert(0, str(Path(__file__).parent))
from truth import TOL64, batch_plan  # noqa: E402

N, VOCAB, TAGS, EMB, HID, T, ROWS, BATCH = 3, 9, 4, 5, 4, 5, 8, 4
LR = [0.05, 0.02, 0.1]


# -- the model, as a user writes it ------------------------------------------------------------


class CRF(nn.Module):
    """A linear-chain CRF, batch first, in pytorch-crf's arithmetic."""

    def __init__(self, tags: int) -> None:
        super().__init__()
        self.start_transitions = nn.Parameter(torch.empty(tags).uniform_(-0.1, 0.1))
        self.end_transitions = nn.Parameter(torch.empty(tags).uniform_(-0.1, 0.1))
        self.transitions = nn.Parameter(torch.empty(tags, tags).uniform_(-0.1, 0.1))

    def forward(self, emissions: Tensor, tags: Tensor, mask: Tensor) -> Tensor:
        """The negative log-likelihood of each sequence, `[batch]`."""
        return crf_nll(
            emissions, self.start_transitions, self.end_transitions, self.transitions, tags, mask
        )

    def decode(self, emissions: Tensor, mask: Tensor) -> Tensor:
        """The best path of each sequence, `[batch, time]`, -1 past its length."""
        score = self.start_transitions + emissions[:, 0]
        history = []
        for t in range(1, emissions.shape[1]):
            nxt = score.unsqueeze(2) + self.transitions + emissions[:, t].unsqueeze(1)
            nxt, idx = nxt.max(dim=1)
            score = torch.where(mask[:, t, None], nxt, score)
            history.append(idx)
        score = score + self.end_transitions
        lengths = mask.long().sum(1)
        cur = score.argmax(1)
        path = [cur] * emissions.shape[1]
        for t in range(emissions.shape[1] - 1, 0, -1):
            path[t] = cur
            prev = history[t - 1].gather(1, cur.unsqueeze(1)).squeeze(1)
            cur = torch.where(t < lengths, prev, cur)
        path[0] = cur
        return torch.where(mask, torch.stack(path, 1), -1)

    def decode_lists(self, emissions: Tensor, mask: Tensor) -> list[list[int]]:
        """pytorch-crf's `_viterbi_decode`: the backtrack per sequence, in Python ints."""
        score = self.start_transitions + emissions[:, 0]
        history = []
        for t in range(1, emissions.shape[1]):
            nxt = score.unsqueeze(2) + self.transitions + emissions[:, t].unsqueeze(1)
            nxt, idx = nxt.max(dim=1)
            score = torch.where(mask[:, t, None], nxt, score)
            history.append(idx)
        score = score + self.end_transitions
        seq_ends = mask.long().sum(1) - 1
        best = []
        for i in range(emissions.shape[0]):
            _, last = score[i].max(dim=0)
            tags = [last.item()]
            for hist in reversed(history[: seq_ends[i]]):
                last = hist[i][tags[-1]]
                tags.append(last.item())
            best.append(tags[::-1])
        return best


def crf_nll(e: Tensor, start: Tensor, end: Tensor, trans: Tensor, tags: Tensor, mask: Tensor):
    """`log Z - score(gold)` per sequence: the forward algorithm and the gold path's score."""
    m = mask.to(e.dtype)
    emit = e.gather(2, tags.unsqueeze(2)).squeeze(2)  # [B, T]
    gold = start[tags[:, 0]] + emit[:, 0]
    for t in range(1, e.shape[1]):
        gold = gold + (trans[tags[:, t - 1], tags[:, t]] + emit[:, t]) * m[:, t]
    last = tags.gather(1, (mask.long().sum(1) - 1).unsqueeze(1)).squeeze(1)
    gold = gold + end[last]
    alpha = start + e[:, 0]
    for t in range(1, e.shape[1]):
        nxt = torch.logsumexp(alpha.unsqueeze(2) + trans + e[:, t].unsqueeze(1), dim=1)
        alpha = torch.where(mask[:, t, None], nxt, alpha)
    return torch.logsumexp(alpha + end, dim=1) - gold


class Tagger(nn.Module):
    def __init__(self, encoder: str = "lstm") -> None:
        super().__init__()
        self.encoder = encoder
        self.emb = nn.Embedding(VOCAB, EMB, padding_idx=0)
        if encoder == "lstm":
            self.enc: nn.Module = nn.LSTM(EMB, HID, batch_first=True, bidirectional=True)
        else:
            self.enc = nn.Conv1d(EMB, 2 * HID, 3, padding=1)
        self.proj = nn.Linear(2 * HID, TAGS)
        self.crf = CRF(TAGS)

    def emissions(self, tokens: Tensor) -> Tensor:
        h = self.emb(tokens)
        if self.encoder == "lstm":
            h = self.enc(h)[0]
        else:
            h = torch.relu(self.enc(h.transpose(1, 2))).transpose(1, 2)
        return self.proj(h)

    def forward(self, tokens: Tensor, tags: Tensor | None, mask: Tensor) -> Tensor:
        """The NLL per sequence with gold `tags`; the Viterbi paths with `tags=None`."""
        if tags is None:
            return self.crf.decode(self.emissions(tokens), mask)
        return self.crf(self.emissions(tokens), tags, mask)

    def decode(self, tokens: Tensor, mask: Tensor) -> Tensor:
        return self.crf.decode(self.emissions(tokens), mask)


class Emitter(Tagger):
    """The forward returns the emissions and the CRF's parameters; the loss does the CRF."""

    def forward(self, tokens: Tensor, mask: Tensor):  # type: ignore[override]
        c = self.crf
        return self.emissions(tokens), c.start_transitions, c.end_transitions, c.transitions


def data(seed: int = 0, rows: int = ROWS) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (rows,), generator=g)
    lengths[0] = T  # one full row: the padded batch keeps length T
    mask = torch.arange(T) < lengths[:, None]
    tokens = torch.randint(1, VOCAB, (rows, T), generator=g) * mask
    tags = torch.randint(0, TAGS, (rows, T), generator=g) * mask
    return tokens, tags, mask


def mean_nll(nll: Tensor, _y) -> Tensor:
    return nll.mean()


def train_plain(models, batches, loss) -> None:
    """Each member alone: torch.optim.Adam at its own lr, the same batches."""
    for i, m in enumerate(models):
        opt = torch.optim.Adam(m.parameters(), lr=LR[i])
        for batch in batches:
            opt.zero_grad()
            loss(m, *batch).backward()
            opt.step()


def assert_members(ens, models) -> None:
    for i, m in enumerate(models):
        got, want = ens[i].state_dict(), m.state_dict()
        assert list(got) == list(want)
        for k in want:
            torch.testing.assert_close(got[k], want[k], **TOL64, msg=f"member {i} {k}")


# -- training ----------------------------------------------------------------------------------


def test_fit_on_the_nll_from_the_forward_with_per_member_lr_matches_alone(encoder="lstm") -> None:
    tokens, tags, mask = data()
    ens = vmapens.Ensemble(lambda: Tagger(encoder).double(), n=N, seed=0)
    alone = ens.unstack()
    vmapens.fit(ens, ((tokens, tags, mask), tags), mean_nll, epochs=2, batch_size=BATCH,
                lr=LR, seed=1, progress=False)  # fmt: skip
    plan = batch_plan(ROWS, BATCH, 2 * -(-ROWS // BATCH), seed=1)
    batches = [(tokens[r], tags[r], mask[r]) for r in plan]
    train_plain(alone, batches, lambda m, x, y, k: m(x, y, k).mean())
    assert_members(ens, alone)
    # The members' decoded paths, inside the ensemble (`tags=None`), equal each one's alone.
    paths = ens(tokens, None, mask)
    for i, m in enumerate(alone):
        assert torch.equal(paths[i], m.decode(tokens, mask))
    assert (paths[:, ~mask] == -1).all() and (paths[:, mask] >= 0).all()


def crf_loss(out, y: dict[str, Tensor]) -> Tensor:
    emissions, start, end, trans = out
    return crf_nll(emissions, start, end, trans, y["tags"], y["mask"]).mean()


def test_fit_with_a_custom_crf_loss_on_per_member_batches_matches_alone(encoder="conv") -> None:
    # Each member its own sentences (`in_dims=0`); the loss computes the CRF from the
    # forward's emissions and the member's own CRF parameters, the mask in a dict of targets.
    per = [data(seed=10 + i) for i in range(N)]
    tokens, tags, mask = (torch.stack([p[j] for p in per]) for j in range(3))
    ens = vmapens.Ensemble(lambda: Emitter(encoder).double(), n=N, seed=2)
    alone = ens.unstack()
    vmapens.fit(ens, ((tokens, mask), {"tags": tags, "mask": mask}), crf_loss, in_dims=0,
                epochs=2, batch_size=BATCH, lr=LR, seed=4, progress=False)  # fmt: skip
    plan = batch_plan(ROWS, BATCH, 2 * -(-ROWS // BATCH), seed=4)
    for i, m in enumerate(alone):
        opt = torch.optim.Adam(m.parameters(), lr=LR[i])
        for r in plan:
            opt.zero_grad()
            y = {"tags": tags[i, r], "mask": mask[i, r]}
            crf_loss(m(tokens[i, r], mask[i, r]), y).backward()
            opt.step()
    assert_members(ens, alone)


# -- decoding ----------------------------------------------------------------------------------


def trained(encoder: str = "lstm"):
    tokens, tags, mask = data()
    ens = vmapens.Ensemble(lambda: Tagger(encoder).double(), n=N, seed=5)
    opt = vmapens.StackedAdam(ens, lr=torch.tensor(LR, dtype=torch.float64))
    for _ in range(2):
        opt.zero_grad()
        vmapens.per_member(mean_nll)(ens(tokens, tags, mask), tags).sum().backward()
        opt.step()
    return ens, data(seed=3)


class DecodeView(nn.Module):
    """Runs another method of a module as its forward: `functional_call` calls forward only."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: Tensor, mask: Tensor) -> Tensor:
        return self.model.decode(tokens, mask)


def test_decode_through_map_members_predict_and_member_files_matches_each_member(
    tmp_path: Path,
) -> None:
    ens, (tokens, _, mask) = trained("lstm")
    alone = ens.unstack()
    want = torch.stack([m.decode(tokens, mask) for m in alone])
    view = DecodeView(ens.runner)

    def decode(state: dict[str, Tensor], tokens: Tensor, mask: Tensor) -> Tensor:
        own = {f"model.{k}": v for k, v in state.items()}
        return functional_call(view, own, (tokens, mask))

    with torch.no_grad():
        mapped = ens.map_members(decode, tokens, mask)
    predicted = vmapens.predict(ens, [(tokens, None, mask)])  # one batch, `tags=None`
    assert torch.equal(mapped, want)
    assert torch.equal(predicted, want)
    # The Viterbi path is the best path: its score is the max over all TAGS**T paths alone.
    m, row = alone[0], 0
    e = m.emissions(tokens[row : row + 1]).detach()
    k = int(mask[row].sum())
    paths = torch.cartesian_prod(*[torch.arange(TAGS)] * k)
    ones = torch.ones(len(paths), k, dtype=torch.bool)
    scores = -crf_nll(e[:, :k].expand(len(paths), -1, -1), m.crf.start_transitions,
                      m.crf.end_transitions, m.crf.transitions, paths, ones).detach()  # fmt: skip
    assert torch.equal(paths[scores.argmax()], want[0, row, :k])
    # Member files load into plain taggers (torch's own nn.LSTM) that decode the same paths.
    vmapens.save_members(ens, tmp_path)
    for i, state in enumerate(vmapens.load_members(tmp_path)):
        plain = Tagger().double()
        plain.load_state_dict(state)
        assert isinstance(plain.enc, nn.LSTM)
        assert torch.equal(plain.decode(tokens, mask), want[i])


def test_pytorch_crf_tolist_decode_is_refused_with_either_backend_and_runs_per_member() -> None:
    ens, (tokens, _, mask) = trained("conv")
    alone = ens.unstack()

    def decode_lists(state, tokens, mask):
        with torch.nn.utils.stateless._reparametrize_module(ens.runner, state):
            return ens.runner.crf.decode_lists(ens.runner.emissions(tokens), mask)

    with torch.no_grad(), pytest.raises(RuntimeError, match="backend='loop'"):
        ens.map_members(decode_lists, tokens, mask)
    # With backend="loop" it runs, member by member, but the ensemble stacks every output:
    # lists of ints are refused, saying to return tensors. The way out: each member as a plain
    # module (`ens[i]`), or the batched backtrack above, which returns a tensor.
    looped = vmapens.Ensemble.from_modules(alone, backend="loop")
    with torch.no_grad(), pytest.raises(RuntimeError, match="other than tensors"):
        looped.map_members(decode_lists, tokens, mask)
    for i, m in enumerate(alone):
        with torch.no_grad():
            lists = ens[i].crf.decode_lists(ens[i].emissions(tokens), mask)
        assert lists == [p[: len(p)] for p in m.crf.decode_lists(m.emissions(tokens), mask)]
        assert lists == [row[row >= 0].tolist() for row in m.decode(tokens, mask)]


# -- bug: `predict`'s "tuple of positional inputs" with a None among them -----------------------


def test_predict_on_a_tuple_of_inputs_with_a_none_runs_them_as_one_call() -> None:
    # predict's docstring: `data` is "a tuple of its positional inputs"; ens(tokens, None,
    # mask) runs. With a None among them predict iterates the tuple as batches and calls
    # forward(tokens), which fails with the forward's own TypeError (not silent).
    ens, (tokens, _, mask) = trained("conv")
    want = ens(tokens, None, mask).detach()
    assert torch.equal(vmapens.predict(ens, (tokens, None, mask)), want)
