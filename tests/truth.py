"""The independent truth every parity test compares against: plain modules trained alone.

Nothing here imports vmapens. Each helper is the naive loop a user would write with
`torch.optim`, one module at a time, so a test that compares an Ensemble with these compares it
with PyTorch itself, never with the code under test.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import itertools
import math
import sys
import tempfile
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

Batch = tuple[Any, Any]
MakeOpt = Callable[[nn.Module], torch.optim.Optimizer]

# float64 end-to-end: the same kernels on the same numbers, only summation order may differ.
TOL64 = dict(rtol=1e-9, atol=1e-10)


def autograd_nodes(t: torch.Tensor) -> set[str]:
    """The class names of every autograd node behind ``t`` (which backward a graph runs)."""
    seen, todo = set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo.extend(next_fn for next_fn, _ in node.next_functions)
    return {type(node).__name__ for node in seen}


@functools.cache
def lstm_runs_under_bf16_autocast() -> bool:
    """Whether torch's own `nn.LSTM` runs here under CPU bf16 autocast. On a CPU without
    AVX-512 (AVX2 only) torch 2.13 sends it to oneDNN, which has no bf16 LSTM there: "could
    not create a primitive descriptor for the LSTM forward propagation primitive". A member
    alone then fails, so the ensemble must refuse rather than train what no member computes."""
    try:  # the global RNG as it was: the caller's draws do not depend on who asked first
        with torch.random.fork_rng(devices=[]), torch.autocast("cpu", dtype=torch.bfloat16):
            nn.LSTM(3, 4)(torch.randn(5, 2, 3))
    except RuntimeError as e:
        if "primitive descriptor" not in str(e):
            raise
        return False
    return True


#: What torch says where `lstm_runs_under_bf16_autocast()` is False.
NO_BF16_LSTM = "could not create a primitive descriptor for the LSTM"


def derived_seed(seed: int, purpose: str, index: int) -> int:
    """The seed vmapens documents for stream `purpose` number `index` of run `seed`.

    Written again from the recipe (docs/semantics.md: a SHA-256 hash of `(seed, index)`; the
    byte layout as `vmapens._seeds` states it): the first 8 bytes of
    `sha256("vmapens:{seed}:{purpose}:{index}")`, little-endian, shifted right by one (63 bits).
    Purposes: `"member"` (member i's init, `torch.manual_seed(...)` then the factory),
    `"bootstrap"` (member i's resample), `"shuffle"` (the order of pass p).
    """
    digest = hashlib.sha256(f"vmapens:{seed}:{purpose}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def resample(rows: int, seed: int, member: int) -> torch.Tensor:
    """Member `member`'s bootstrap rows, from docs/fit.md "Bagging": `rows` draws with
    replacement from a generator keyed by `(seed, global member index)`."""
    g = torch.Generator().manual_seed(derived_seed(seed, "bootstrap", member))
    return torch.randint(rows, (rows,), generator=g)


def batch_plan(
    rows: int, batch: int | None, count: int, seed: int = 0, shuffle: bool = True
) -> list[torch.Tensor]:
    """The row indices of `fit`'s first `count` steps on `(X, Y)` data, from docs/fit.md "Data,
    epochs and steps": passes cut into batches of `batch` in order, pass `p` permuted by a
    generator seeded from `(seed, p)` (one batch of everything is never permuted); a step
    after the last batch of a pass starts the next pass."""
    batch = rows if batch is None else min(batch, rows)
    starts = range(0, rows, batch)
    out: list[torch.Tensor] = []
    for p in range(count):  # at most `count` passes are needed
        order = torch.arange(rows)
        if shuffle and len(starts) > 1:
            g = torch.Generator().manual_seed(derived_seed(seed, "shuffle", p))
            order = torch.randperm(rows, generator=g)
        out += [order[k : k + batch] for k in starts]
        if len(out) >= count:
            return out[:count]
    return out


def float64_batches(count: int, rows: int, inputs: int, outputs: int, seed: int = 0) -> list[Batch]:
    """``count`` batches ``(x [rows, inputs], y [rows, outputs])`` of float64 standard normals,
    drawn in that order, batch after batch, from one generator seeded ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(rows, inputs, generator=g, dtype=torch.float64),
         torch.randn(rows, outputs, generator=g, dtype=torch.float64))
        for _ in range(count)
    ]  # fmt: skip


def adam(lr: float = 1e-2, **kw: Any) -> MakeOpt:
    """A `make_opt` for `train_alone`: torch.optim.Adam over the module's parameters."""
    return lambda m: torch.optim.Adam(m.parameters(), lr=lr, **kw)


def train_alone(
    model: nn.Module,
    batches: Iterable[Batch],
    loss_fn: Callable[..., torch.Tensor] = nn.functional.mse_loss,
    make_opt: MakeOpt | torch.optim.Optimizer | None = None,
    *,
    clip: Callable[[Iterable[nn.Parameter]], Any] | None = None,
    autocast: torch.dtype | None = None,
    scaler: torch.amp.GradScaler | None = None,
    after_step: Callable[[int], Any] | None = None,
) -> torch.optim.Optimizer:
    """Train one plain module on `batches` the way a user would; return its optimizer.

    Args:
        model: the module, trained in place.
        batches: `(x, y)` pairs, already this member's own (index per-member data before).
        loss_fn: `loss_fn(model(x), y)` -> scalar.
        make_opt: builds the optimizer from the module (default Adam, lr 1e-2), or an
            optimizer already built over `model`'s parameters.
        clip: called on `model.parameters()` after backward (after unscaling with a scaler).
        autocast: run forward and loss under `torch.autocast("cpu", dtype=autocast)`.
        scaler: a `torch.amp.GradScaler` for fp16: scale, unscale, clip, step, update.
        after_step: called with the step number (0-based) after every optimizer step, e.g. to
            step an LR scheduler built on the optimizer passed as `make_opt`.
    """
    opt = make_opt if isinstance(make_opt, torch.optim.Optimizer) else (make_opt or adam())(model)
    for k, (x, y) in enumerate(batches):
        opt.zero_grad()
        ctx = (
            torch.autocast("cpu", dtype=autocast)
            if autocast is not None
            else contextlib.nullcontext()
        )
        with ctx:
            loss = loss_fn(model(x), y)
        if scaler is None:
            loss.backward()
            if clip is not None:
                clip(model.parameters())
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            if clip is not None:
                clip(model.parameters())
            scaler.step(opt)
            scaler.update()
        if after_step is not None:
            after_step(k)
    return opt


def train_each(
    models: Sequence[nn.Module],
    batches: Sequence[Batch],
    loss_fn: Callable[..., torch.Tensor] = nn.functional.mse_loss,
    make_opt: Callable[[int, nn.Module], torch.optim.Optimizer] | None = None,
    *,
    per_member: bool = False,
    **kw: Any,
) -> list[torch.optim.Optimizer]:
    """`train_alone` for every module; member i gets `make_opt(i, model)`.

    With `per_member=True` each batch is stacked `[n, ...]` and member i trains on `x[i], y[i]`.
    """
    opts = []
    for i, m in enumerate(models):
        own = [(x[i], y[i]) for x, y in batches] if per_member else batches
        opt = make_opt(i, m) if make_opt is not None else None
        opts.append(train_alone(m, own, loss_fn, opt, **kw))
    return opts


def factory_members(factories: Sequence[Callable[[], nn.Module]], seed: int = 0) -> list[nn.Module]:
    """The members of ``Ensemble.from_factories(factories, seed=seed)`` as plain modules:
    member ``i`` built by ``factories[i]`` after ``torch.manual_seed`` of its documented seed
    (``derived_seed(seed, "member", i)``)."""
    built = []
    for i, factory in enumerate(factories):
        torch.manual_seed(derived_seed(seed, "member", i))
        built.append(factory())
    return built


def seeded_members(factory: Callable[[], nn.Module], n: int) -> list[nn.Module]:
    """The members of ``Ensemble(factory, n, seeds=range(n))`` as plain modules: member ``k``
    built after ``torch.manual_seed(k)``."""
    out = []
    for k in range(n):
        torch.manual_seed(k)
        out.append(factory())
    return out


def assert_states(got: Sequence[dict], plain: Sequence[nn.Module]) -> None:
    """State dicts (loaded member files, say) equal, key for key and bit for bit, to those of
    the plain modules, in order."""
    assert len(got) == len(plain)
    for state, module in zip(got, plain, strict=True):
        truth = module.state_dict()
        assert sorted(state) == sorted(truth)
        for key in truth:
            torch.testing.assert_close(state[key], truth[key], rtol=0, atol=0, msg=key)


def twins(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """Independent deep copies (for `ens.unstack()` or a list of plain modules)."""
    return [copy.deepcopy(m) for m in modules]


def assert_members_equal(
    ens: Any, modules: Sequence[nn.Module], *, grads: bool = False, **tol: Any
) -> None:
    """Member i's state_dict (parameters and buffers) equals `modules[i]`'s, key by key; with
    `grads`, its gradients too (`assert_grads_equal`)."""
    tol = tol or TOL64
    assert len(ens) == len(modules), f"{len(ens)} members vs {len(modules)} modules"
    for i, m in enumerate(modules):
        got = ens[i].state_dict()
        want = m.state_dict()
        assert list(got) == list(want), f"member {i}: keys {list(got)} vs {list(want)}"
        for name in want:
            torch.testing.assert_close(got[name], want[name], **tol, msg=f"member {i} {name}")
    if grads:
        assert_grads_equal(ens, modules, **tol)


def assert_grads_equal(ens: Any, modules: Sequence[nn.Module], **tol: Any) -> None:
    """Row i of every stacked parameter's `.grad` equals `modules[i]`'s `.grad`; a parameter
    that gets no gradient alone (unused by the forward) has none inside either."""
    tol = tol or TOL64
    for name, p in ens.named_parameters():
        for i, m in enumerate(modules):
            g = m.get_parameter(name).grad
            if g is None:
                assert p.grad is None, f"{name}: a gradient inside, none alone (member {i})"
                continue
            assert p.grad is not None, f"{name}: no gradient inside, one alone (member {i})"
            torch.testing.assert_close(p.grad[i], g, **tol, msg=f"member {i} {name}.grad")


def assert_bit_identical(got: Any, expected: Any, where: str = "") -> None:
    """Nested dicts, sequences and tensors equal bit for bit (dtype, shape and bytes: NaN
    equals NaN, -0.0 differs from 0.0), leaves of the same type; other leaves ``==``."""
    assert type(got) is type(expected), f"{where}: {type(got)} vs {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert (got.dtype, got.shape) == (expected.dtype, expected.shape), where
        assert torch.equal(_bits(got), _bits(expected)), where
    elif isinstance(expected, dict):
        assert list(got) == list(expected), where
        for k in expected:
            assert_bit_identical(got[k], expected[k], f"{where}.{k}")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), where
        for k, (a, b) in enumerate(zip(got, expected, strict=True)):
            assert_bit_identical(a, b, f"{where}[{k}]")
    elif isinstance(expected, float) and math.isnan(expected):
        assert math.isnan(got), where
    else:
        assert got == expected, where


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(-1).view(torch.uint8)


def step_with_twins(
    opt: torch.optim.Optimizer,
    twins: Sequence[torch.optim.Optimizer],
    g: torch.Generator,
    stacked: Sequence[torch.Tensor],
    alone: Sequence[Sequence[torch.Tensor]],
    mask: Sequence[int] | None,
) -> None:
    """One step of a stacked optimizer on random gradients from `g`, and of each member's own
    torch optimizer (`twins[i]` over `alone[i]`) on its rows of them; with `mask`, only the
    members it keeps step alone, as the stacked step steps only them."""
    for p in stacked:
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
    m = None if mask is None else torch.tensor(mask, dtype=torch.bool)
    opt.step(mask=m)
    for i, twin in enumerate(twins):
        if m is None or m[i]:
            for leaf, p in zip(alone[i], stacked, strict=True):
                leaf.grad = p.grad[i].clone()
            twin.step()


def entropy(p: torch.Tensor) -> torch.Tensor:
    """Shannon entropy over the last dim, with 0 * log 0 = 0."""
    return -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1)


def reduce_by_hand(outs: list[torch.Tensor], reduce: str) -> torch.Tensor:
    """docs/workflows.md's reductions of the members' outputs (``outs[i]``: member ``i``'s
    ``[..., classes]``), written with loops and ``Counter``."""
    n, stack = len(outs), torch.stack(outs)
    if reduce == "none":
        return stack
    if reduce == "mean":
        return sum(outs) / n
    if reduce in ("min", "max"):
        pick = torch.minimum if reduce == "min" else torch.maximum
        out = outs[0]
        for o in outs[1:]:
            out = pick(out, o)
        return out
    if reduce == "variance":
        mean = sum(outs) / n
        return sum((o - mean) ** 2 for o in outs) / n
    if reduce == "entropy":
        return entropy(sum(outs) / n)
    if reduce == "mutual_information":
        return entropy(sum(outs) / n) - sum(entropy(o) for o in outs) / n
    labels = stack.argmax(-1)
    per_sample = labels.reshape(n, -1).T.tolist()
    if reduce == "vote":
        votes = []
        for s in per_sample:
            counts = Counter(s)
            votes.append(min(counts, key=lambda c: (-counts[c], c)))
        return torch.tensor(votes, dtype=torch.int64).reshape(labels.shape[1:])
    assert reduce == "disagreement", reduce
    pairs = list(itertools.permutations(range(n), 2))
    if not pairs:
        return torch.zeros(labels.shape[1:], dtype=torch.float64)
    rows = [sum(s[i] != s[j] for i, j in pairs) / len(pairs) for s in per_sample]
    return torch.tensor(rows, dtype=torch.float64).reshape(labels.shape[1:])


def search(check: Callable[[int, Any], None], describe: Callable[[int], Any] = str) -> None:
    """The command line of a seeded search file: ``python tests/test_fuzz_<x>.py K`` prints
    seed K's draw and runs it with the full traceback; ``... A B [-v]`` runs seeds A..B-1, each
    in a fresh temporary directory, reports each failure (``-v``: with its traceback) and goes
    on, then lists the seeds that failed. ``check(seed, tmp_dir)`` runs one seed;
    ``describe(seed)`` is what gets printed for it."""
    if len(sys.argv) == 2:
        seed = int(sys.argv[1])
        print(describe(seed))
        with tempfile.TemporaryDirectory() as tmp_dir:
            check(seed, Path(tmp_dir))
        return
    failed = []
    for seed in range(int(sys.argv[1]), int(sys.argv[2])):
        with tempfile.TemporaryDirectory() as tmp_dir:
            try:
                check(seed, Path(tmp_dir))
            except Exception as err:  # noqa: BLE001 - a search: report and go on
                failed.append(seed)
                print(seed, describe(seed))
                print("   ", type(err).__name__, (str(err).splitlines() or [""])[0][:300])
                if "-v" in sys.argv:
                    traceback.print_exc()
    print("failed:", failed)
