"""Seeded random exports (``vmapens.export``) against the members run alone as plain modules.

Each program draws a member (an MLP with dropout, a CNN with BatchNorm, an Embedding, tied
weights, a GRU, an LSTM, a Transformer encoder layer, an nn.TransformerEncoder with a padding
mask as a second input, a module with buffers and a frozen parameter, a buffer the forward
updates in eval mode, MLPs of different widths), a dtype, a member count, how the ensemble
came to be (N plain modules trained alone with ``torch.optim.Adam`` and stacked, an ensemble
trained with ``StackedAdam`` whose members are then taken out with ``unstack``, or untrained),
a selection of members (``ens[list]`` with repeats, a tensor, a slice, a mask),
``chunk_size`` or ``backend="loop"``, the mode it is in, a reduction and ``softmax``, and the
example's batch size. It exports, saves and loads the program, and holds its output on the
example, on fresh inputs of the example's shapes and on the same values in other strides to
every member run alone in eval mode (``reduce_by_hand`` for the reductions). Inputs of another
batch size, feature size, rank or dtype, or one input less, must raise or equal the members
alone; the weights of as many members (moved on) replace the program's, and a state of
another member count is refused.

A symbolic batch size is not offered (docs/workflows.md, "Serving an ensemble"): every size
is fixed when exporting, so "another batch size" is one of the inputs that must raise.

Run one program by hand: ``python tests/test_fuzz_export.py SEED`` prints what it drew;
``python tests/test_fuzz_export.py A B [-v]`` runs seeds A..B-1.
"""

from __future__ import annotations

import copy
import functools
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from models import CNN, MLP, Awkward, Encoder, Recurrent, Tied, TokenModel
from torch import nn
from truth import reduce_by_hand, search, seeded_members, twins

import vmapens

F64 = torch.float64
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-10, atol=1e-10)}


class DropMLP(MLP):
    """Dropout in training: eval mode (what export promises) must turn it off."""

    def __init__(self, hidden: int = 8) -> None:
        super().__init__(hidden=hidden)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


class LSTMNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.LSTM(4, 5, batch_first=True), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0][:, -1])


class Counted(nn.Module):
    """A buffer the forward updates in eval mode too (a call counter): the program must start
    where the member alone starts."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)  # first: an input the member refuses changes nothing
        self.calls += 1
        return y * self.calls


class PaddedEncoder(nn.Module):
    """nn.TransformerEncoder with a padding mask: its eval-mode fast path writes zeros at
    padded positions, which the ensemble computes (docs/semantics.md)."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1, batch_first=True)
        self.enc, self.head = nn.TransformerEncoder(layer, layers), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(x, src_key_padding_mask=pad)[:, 0])


class EditsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)  # in place, on the caller's tensor
        return self.fc(x)


def _padding_mask(batch: int, g: torch.Generator) -> torch.Tensor:
    lengths = torch.randint(1, 5, (batch,), generator=g)
    return torch.arange(4) >= lengths[:, None]  # True: padded


# name: (factory of member i, input shape after the batch, whether the input is tokens;
# a second input: a padding mask)
MEMBERS: dict[str, tuple[Any, tuple[int, ...], bool]] = {
    "mlp_dropout": (lambda i: DropMLP(), (4,), False),
    "cnn_bn": (lambda i: CNN(), (1, 6, 6), False),
    "embedding": (lambda i: TokenModel(), (5,), True),
    "tied": (lambda i: Tied(), (5,), True),
    "gru": (lambda i: Recurrent(), (3, 4), False),
    "lstm": (lambda i: LSTMNet(), (3, 4), False),
    "encoder": (lambda i: Encoder(), (3, 8), False),
    "padded_encoder": (lambda i: PaddedEncoder(), (4, 8), False),
    "buffers": (lambda i: Awkward(), (4,), False),
    "counted": (lambda i: Counted(), (4,), False),
    "widths": (lambda i: DropMLP(hidden=(8, 5, 3, 6)[i % 4]), (4,), False),
    "edits_input": (lambda i: EditsInput(), (4,), False),
}
SELECTIONS = ["all", "list", "tensor", "slice", "mask"]
REDUCES = [None, None, "mean", "min", "max", "variance", "vote", "disagreement"]


def draw(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    member = rng.choice(list(MEMBERS))
    d = dict(
        seed=seed,
        member=member,
        dtype=rng.choice(["float32", "float64"]),
        n=rng.randint(1, 4),
        how=rng.choice(["alone", "stacked_adam", "untrained"]),
        selection=rng.choice(SELECTIONS),
        runner=rng.choice(["vmap", "vmap", "chunk_size", "loop"]),
        reduce=rng.choice(REDUCES),
        softmax=rng.random() < 0.4,
        batch=rng.choice([1, 2, 3, 5]),
        mode=rng.choice(["train", "eval"]),
    )
    if member in ("counted", "edits_input") and d["how"] == "stacked_adam":
        # Training them with chunk_size or backend="loop" fails: in backward (the in-place
        # counter's write-back; reported, not export's), or refused (an input edited in
        # turns, docs/semantics.md): trained through vmap here.
        d["runner"] = "vmap"
    return d


def inputs(d: dict[str, Any], batch: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    _, shape, tokens = MEMBERS[d["member"]]
    if tokens:
        x = torch.randint(10, (batch, *shape), generator=g)
    else:
        x = torch.randn(batch, *shape, generator=g, dtype=getattr(torch, d["dtype"]))
    return (x, _padding_mask(batch, g)) if d["member"] == "padded_encoder" else (x,)


def train_alone(modules: list[nn.Module], batches: list) -> None:
    """torch.optim.Adam on each plain module, one after another (training mode)."""
    for m in modules:
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        for xs, y in batches:
            opt.zero_grad()
            xs = tuple(t.clone() for t in xs)  # a member that edits its input: its own batch
            nn.functional.mse_loss(m(*xs), y).backward()
            opt.step()


def build(d: dict[str, Any]) -> tuple[vmapens.Ensemble, list[nn.Module]]:
    """The ensemble and its members as plain modules (the truth), before any selection."""
    factory, _, _ = MEMBERS[d["member"]]
    dtype, n, seed = getattr(torch, d["dtype"]), d["n"], d["seed"]
    g = torch.Generator().manual_seed(seed)
    batches = [(inputs(d, 6, g), torch.randn(6, 3, generator=g, dtype=dtype)) for _ in range(3)]
    options: dict[str, Any] = {}
    if d["runner"] == "chunk_size":
        options["chunk_size"] = max(1, n // 2)
    elif d["runner"] == "loop":
        options["backend"] = "loop"
    modules = []
    for i in range(n):
        torch.manual_seed(1000 * seed + i)
        modules.append(factory(i).to(dtype))
    if d["how"] == "alone":
        train_alone(modules, batches)  # training mode: BatchNorm statistics move, dropout on
    if d["member"] == "widths":
        built = [functools.partial(copy.deepcopy, m) for m in modules]
        ens = vmapens.Ensemble.from_factories(built, **options)
    else:
        ens = vmapens.Ensemble.from_modules(twins(modules), **options)
    if d["how"] == "stacked_adam":
        ens.train()
        opt = vmapens.StackedAdam(ens, lr=1e-2)
        for xs, y in batches:
            loss = vmapens.per_member(nn.MSELoss())(ens(*xs), y)
            opt.zero_grad()
            loss.sum().backward()
            opt.step()
        modules = ens.unstack()
    ens.train(d["mode"] == "train")
    return ens, modules


def select(d: dict[str, Any], ens: vmapens.Ensemble, modules: list[nn.Module]) -> tuple:
    n, rng = len(modules), random.Random(d["seed"] + 1)
    rows = list(range(n))
    if d["selection"] == "all":
        return ens, modules
    if d["selection"] == "slice":
        start = rng.randint(0, n - 1)
        index: Any = slice(start, n)
        rows = rows[start:]
    elif d["selection"] == "mask":
        keep = [rng.random() < 0.6 for _ in rows]
        keep[rng.randrange(n)] = True
        index, rows = torch.tensor(keep), [r for r, k in zip(rows, keep) if k]
    else:
        rows = [rng.randrange(n) for _ in range(rng.randint(1, n + 1))]  # repeats too
        index = rows if d["selection"] == "list" else torch.tensor(rows)
    return ens[index], [modules[r] for r in rows]


class Alone:
    """The truth: eval-mode copies of the plain modules, each called whenever the program is
    (a buffer the forward updates moves in both)."""

    def __init__(self, modules: list[nn.Module], d: dict[str, Any]) -> None:
        self.modules, self.d = [copy.deepcopy(m).eval() for m in modules], d

    def __call__(self, xs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        with torch.no_grad():
            outs = [m(*(t.clone() for t in xs)) for m in self.modules]  # each its own batch
        outs = [out.softmax(-1) for out in outs] if self.d["softmax"] else outs
        reduce = self.d["reduce"]
        return torch.stack(outs) if reduce is None else reduce_by_hand(outs, reduce)


def assert_matches(got: Any, want: Any, d: dict[str, Any], where: str) -> None:
    if d["reduce"] == "vote":
        assert got.dtype == want.dtype and torch.equal(got, want), f"{d} {where}: {got} {want}"
    else:
        dtype = getattr(torch, d["dtype"])
        want = want.to(dtype) if d["reduce"] == "disagreement" else want  # truth: float64
        torch.testing.assert_close(got, want, **TOL[dtype], msg=lambda m: f"{d} {where}: {m}")


def bad_inputs(d: dict[str, Any], xs: tuple[torch.Tensor, ...]) -> dict[str, tuple]:
    """Inputs the program was not exported for (the first one changed): each must raise or
    give the members' truth."""
    g = torch.Generator().manual_seed(d["seed"] + 2)
    x, rest = xs[0], xs[1:]
    out = {
        "batch + 1": inputs(d, x.shape[0] + 1, g),
        "rank + 1": (x.unsqueeze(0), *rest),
        "last dim + 1": (torch.cat([x, x[..., :1]], -1), *rest),
        "one input less": xs[:1] if rest else (),
    }
    if x.is_floating_point():
        other = torch.float64 if x.dtype == torch.float32 else torch.float32
        out["other dtype"] = (x.to(other), *rest)
        out["integers"] = (x.long(), *rest)
    else:
        out["int32 tokens"] = (x.int(), *rest)
        out["float tokens"] = (x.float(), *rest)
    return out


def run(d: dict[str, Any], tmp: Path) -> None:
    ens, modules = build(d)
    ens, modules = select(d, ens, modules)
    g = torch.Generator().manual_seed(d["seed"] + 3)
    xs = inputs(d, d["batch"], g)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    training = [m.training for m in ens.modules()]
    in_turns = ens.backend == "loop" or (ens.chunk_size or len(ens)) < len(ens)
    if d["member"] == "edits_input" and in_turns and len(ens) > 1:
        with pytest.raises(RuntimeError, match=r"edits a tensor of the batch in place"):
            vmapens.export(ens, xs, reduce=d["reduce"], softmax=d["softmax"])
        return  # as ens(x) refuses it (docs/semantics.md)
    program = vmapens.export(ens, xs, reduce=d["reduce"], softmax=d["softmax"])
    assert [m.training for m in ens.modules()] == training, f"{d}: modes not restored"
    for key, value in ens.state_dict().items():
        assert torch.equal(value, before[key]), f"{d}: export changed {key}"
    for node in program.graph.nodes:
        if node.op == "call_function":
            target = node.target
            ok = isinstance(target, torch._ops.OpOverload) or target.__name__ == "getitem"
            assert ok and "vmapens" not in str(target.__module__), f"{d}: graph calls {target}"
    torch.export.save(program, tmp / "program.pt2")
    served = torch.export.load(tmp / "program.pt2").module()
    fresh = inputs(d, d["batch"], g)
    truth = Alone(modules, d)
    # The same values in other strides (a sequence-first batch transposed): as alone.
    strided = tuple(t.transpose(0, -1).contiguous().transpose(0, -1) for t in fresh)
    calls = (("example", xs), ("fresh", fresh), ("example again", xs), ("strided", strided))
    for where, data in calls:
        with torch.no_grad():
            assert_matches(served(*data), truth(data), d, where)
    for where, data in bad_inputs(d, xs).items():
        if d["reduce"] == "disagreement" and len(modules) == 1 and "batch" not in where:
            continue  # constant zeros: the program reads only the input's shape, as it may
        try:
            with torch.no_grad():
                got = served(*data)
        except (AssertionError, RuntimeError, IndexError, ValueError, TypeError):
            continue
        assert_matches(got, truth(data), d, f"{where} ran")
    # The weights of as many members (trained further) replace the program's; another count
    # is refused.
    shifted = [copy.deepcopy(m) for m in modules]
    with torch.no_grad():
        for m in shifted:
            for p in m.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    if d["member"] != "widths":
        served.load_state_dict(vmapens.Ensemble.from_modules(twins(shifted)).state_dict())
        with torch.no_grad():
            assert_matches(served(*fresh), Alone(shifted, d)(fresh), d, "refreshed")
        more = vmapens.Ensemble.from_modules(twins([*shifted, shifted[0]]))
        with pytest.raises(RuntimeError, match="size mismatch"):
            served.load_state_dict(more.state_dict())
    else:  # padded members: the ensemble itself moved on, as further training would move it
        with torch.no_grad():
            for p in ens.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        served.load_state_dict(ens.state_dict())
        with torch.no_grad():
            assert_matches(served(*fresh), Alone(ens.unstack(), d)(fresh), d, "refreshed")


# torch's nested-tensor fast path, taken by a plain nn.TransformerEncoder with a padding mask
# in eval mode (the truth), warns that nested tensors are a prototype.
NESTED = "ignore:The PyTorch API of nested tensors is in prototype stage:UserWarning"
# torch.export traces for 1-3 s a program: a few seeds in the suite, more by hand.
SEEDS = [6, 8, 12, 27, 49]  # counter buffer, tied, padding mask, widths, CNN + BatchNorm


@pytest.mark.filterwarnings(NESTED)
@pytest.mark.parametrize("seed", SEEDS)
def test_random_export_equals_members_run_alone(seed: int, tmp_path: Path) -> None:
    run(draw(seed), tmp_path)


# -- what the programs found, one test each -------------------------------------------------


@pytest.mark.parametrize("persistent", [True, False], ids=["buffer", "non-persistent"])
def test_program_starts_with_the_buffers_the_members_have(persistent: bool) -> None:
    # export's parity probe called the program once and left its buffers as that call moved
    # them: a forward that updates a buffer in eval mode (a call counter) returned its second
    # call's output on the user's first call.
    class Count(Counted):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("calls", torch.zeros((), dtype=F64), persistent=persistent)

    modules = seeded_members(lambda: Count().to(F64), 2)
    ens = vmapens.Ensemble.from_modules(twins(modules))
    x = torch.randn(3, 4, dtype=F64)
    served = vmapens.export(ens, x).module()
    truth = Alone(modules, dict(softmax=False, reduce=None))
    for call in range(2):
        with torch.no_grad():
            torch.testing.assert_close(served(x), truth((x,)), **TOL[F64], msg=f"call {call}")
    assert float(ens.stacked_buffers()["calls"].abs().sum()) == 0.0  # the ensemble's own too


class FullEncoder(PaddedEncoder):
    def __init__(self) -> None:
        super().__init__(layers=1)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return self.enc(x, src_key_padding_mask=pad)  # every position, padded ones too


@pytest.mark.filterwarnings(NESTED)
def test_transformer_with_a_padding_mask_exports() -> None:
    # Alone in eval mode, nn.TransformerEncoder takes its nested-tensor fast path and writes
    # zeros at padded positions; the ensemble computes them (docs/semantics.md), so export's
    # parity probe refused every such member ("computes something else in the exported
    # program"), though the program equals the member everywhere else.
    modules = seeded_members(lambda: FullEncoder().eval(), 2)
    ens = vmapens.Ensemble.from_modules(twins(modules))
    g = torch.Generator().manual_seed(0)
    x, pad = torch.randn(3, 4, 8, generator=g), _padding_mask(3, g)
    pad[0, 1:] = True  # padded positions for sure
    served = vmapens.export(ens, (x, pad)).module()
    with torch.no_grad():
        got = served(x, pad)
        fast = torch.stack([m(x, pad) for m in modules])
        assert torch.all(fast[:, pad] == 0)  # torch's fast path ran alone
        enabled = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            slow = torch.stack([m(x, pad) for m in modules])
        finally:
            torch.backends.mha.set_fastpath_enabled(enabled)
    torch.testing.assert_close(got[:, ~pad], fast[:, ~pad], **TOL[torch.float32])
    torch.testing.assert_close(got, slow, **TOL[torch.float32])


def test_program_takes_inputs_of_other_strides() -> None:
    # vmap runs a Linear on a shared [batch, tokens, features] input as one matmul over
    # [batch * tokens, features]; traced on a contiguous example that reshape became a view
    # of the input, and the program failed ("view size is not compatible with input tensor's
    # size and stride") on a sequence-first batch transposed, which the members alone take.
    modules = seeded_members(lambda: MLP().to(F64), 2)
    ens = vmapens.Ensemble.from_modules(twins(modules))
    served = vmapens.export(ens, torch.randn(5, 3, 4, dtype=F64)).module()
    seq_first = torch.randn(3, 5, 4, dtype=F64)
    x = seq_first.transpose(0, 1)  # [batch, tokens, features], not contiguous
    truth = Alone(modules, dict(softmax=False, reduce=None))
    with torch.no_grad():
        torch.testing.assert_close(served(x), truth((x,)), **TOL[F64])


def test_program_exported_under_inference_mode_serves_outside_it() -> None:
    # Exported under torch.inference_mode(), the program's copies of the buffers were
    # inference tensors: a forward that updates one (a call counter) failed outside it
    # ("Inplace update to inference tensor outside InferenceMode").
    modules = seeded_members(lambda: Counted().to(F64), 2)
    ens = vmapens.Ensemble.from_modules(twins(modules))
    x = torch.randn(3, 4, dtype=F64)
    with torch.inference_mode():
        served = vmapens.export(ens, x).module()
    truth = Alone(modules, dict(softmax=False, reduce=None))
    for call in range(2):
        with torch.no_grad():
            torch.testing.assert_close(served(x), truth((x,)), **TOL[F64], msg=f"call {call}")


@pytest.mark.parametrize("reduce", [None, "mean"])
def test_member_that_edits_its_input_exports(reduce: str | None) -> None:
    # The parity probe ran the member alone on `example_inputs` themselves: its edit doubled
    # the caller's example, the program then ran on the doubled values and the probe refused
    # a correct program ("computes something else in the exported program than alone").
    modules = seeded_members(lambda: EditsInput().to(F64), 2)
    ens = vmapens.Ensemble.from_modules(twins(modules))
    x = torch.randn(3, 4, dtype=F64)
    example = x.clone()
    served = vmapens.export(ens, example, reduce=reduce).module()
    assert torch.equal(example, x)  # export left the caller's example as it was
    truth = Alone(modules, dict(softmax=False, reduce=reduce))
    with torch.no_grad():
        torch.testing.assert_close(served(x.clone()), truth((x.clone(),)), **TOL[F64])


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize(
    "options", [dict(backend="loop"), dict(chunk_size=1)], ids=["loop", "chunk"]
)
def test_member_that_edits_its_input_in_turns_is_refused(options: dict, check: bool) -> None:
    # Members run in turns on the program's one copy of the input: member 1 saw member 0's
    # edit (its input doubled twice) and the program returned it, silently; the probe runs
    # member 0 only. ens(x) refuses this (docs/semantics.md), export now too.
    ens = vmapens.Ensemble(EditsInput, n=2, seed=0, **options).to(F64)
    x = torch.randn(3, 4, dtype=F64)
    with pytest.raises(RuntimeError, match=r"export: .* edits a tensor of the batch in place"):
        vmapens.export(ens, x, check=check)


if __name__ == "__main__":
    search(lambda seed, tmp: run(draw(seed), tmp), draw)
