"""Hunt: the compiled step's rewrite of member matmuls on a shared operand (vmapens/_matmuls.py)
on odd operand layouts and sizes, and MKL's warm-up (vmapens/_mkl.py).

Truth: ``torch.bmm`` on the same operands, the eager step, and the devices torch itself reports.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch._functorch import config as functorch_config
from torch._inductor import config as inductor_config
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.overrides import TorchFunctionMode

import vmapens
from vmapens import _matmuls, _mkl

# mm and bmm may sum a dot product's terms in another order: float64 round-off only.
TOL = dict(rtol=1e-12, atol=1e-13)
F64 = torch.float64


def _matrix(m: int, k: int, how: str, g: torch.Generator) -> torch.Tensor:
    """An [m, k] float64 matrix laid out as `how` says."""
    if how == "transposed":
        return torch.randn(k, m, generator=g, dtype=F64).t()
    if how == "offset":  # a slice: storage offset and row stride of a larger matrix
        return torch.randn(m + 2, k + 3, generator=g, dtype=F64)[1 : m + 1, 2 : k + 2]
    if how == "every-other-row":
        return torch.randn(2 * m, k, generator=g, dtype=F64)[::2]
    if how == "one-row-broadcast":  # inner stride 0: every row the same
        return torch.randn(1, k, generator=g, dtype=F64).expand(m, k)
    if how == "one-column-broadcast":
        return torch.randn(m, 1, generator=g, dtype=F64).expand(m, k)
    return torch.randn(m, k, generator=g, dtype=F64)


def _stack(n: int, m: int, k: int, how: str, g: torch.Generator) -> torch.Tensor:
    """n per-member [m, k] matrices (column-major ones if `how` is "transposed")."""
    if how == "transposed":
        return torch.randn(n, k, m, generator=g, dtype=F64).transpose(1, 2)
    return torch.stack([_matrix(m, k, how, g) for _ in range(n)])


# (n, m, k, w, which operand is shared, its layout, how it is expanded, bmms rewritten)
ODD = {
    "first-transposed": (4, 5, 3, 7, "first", "transposed", "in-graph", 1),
    "first-offset": (4, 5, 3, 7, "first", "offset", "in-graph", 1),
    "first-every-other-row": (3, 6, 4, 5, "first", "every-other-row", "in-graph", 1),
    "first-one-row-broadcast": (3, 6, 4, 5, "first", "one-row-broadcast", "in-graph", 1),
    "second-transposed": (4, 5, 3, 7, "second", "transposed", "in-graph", 1),
    "second-offset": (4, 20, 40, 4, "second", "offset", "in-graph", 1),  # transposed bmm
    "second-one-column-broadcast": (3, 6, 4, 5, "second", "one-column-broadcast", "in-graph", 1),
    "both-shared": (3, 4, 5, 6, "both", "transposed", "in-graph", 1),
    "expanded-placeholder": (4, 5, 3, 7, "first", "offset", "placeholder", 1),
    "unsqueeze-expand": (4, 5, 3, 7, "second", "plain", "unsqueeze", 1),
    "k-one": (4, 5, 1, 7, "first", "plain", "in-graph", 1),
    "k-zero": (4, 5, 0, 7, "second", "plain", "in-graph", 1),
    "at-small": (2, 16, 16, 8, "first", "plain", "in-graph", 1),  # 2048 multiply-adds
    "past-small": (2, 16, 16, 9, "first", "plain", "in-graph", 0),
    "narrow-merged-at-eight": (3, 16, 16, 8, "second", "offset", "in-graph", 1),
    "narrow-rows-at-two-w": (3, 16, 33, 8, "second", "transposed", "in-graph", 1),
    "narrow-rows-under-two-w": (3, 15, 33, 8, "second", "plain", "in-graph", 0),
    "narrow-k-under-32": (3, 40, 31, 2, "second", "plain", "in-graph", 0),
    "narrow-k-32": (3, 40, 32, 2, "second", "every-other-row", "in-graph", 1),
    "one-member": (1, 5, 3, 7, "first", "plain", "in-graph", 0),
    "one-row": (4, 1, 3, 7, "first", "plain", "in-graph", 0),
    "one-column": (4, 5, 3, 1, "second", "plain", "in-graph", 0),
}


@pytest.mark.parametrize("case", list(ODD))
def test_odd_layouts_and_sizes_equal_bmm_on_the_same_operands(case):
    n, m, k, w, shared, how, expand, expected = ODD[case]
    g = torch.Generator().manual_seed(0)
    a = _matrix(m, k, how, g) if shared in ("first", "both") else _stack(n, m, k, how, g)
    b = _matrix(k, w, how, g) if shared in ("second", "both") else _stack(n, k, w, how, g)

    def batched(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        if x.dim() == 3:
            return x
        return (
            x.unsqueeze(0).expand(n, -1, -1) if expand == "unsqueeze" else x.expand(n, rows, cols)
        )

    if expand == "placeholder":  # stride 0 from outside the graph, as a user's expanded input
        a, b = batched(a, m, k), batched(b, k, w)

    def fn(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.bmm(batched(x, m, k), batched(v, k, w))

    want = torch.bmm(batched(a, m, k), batched(b, k, w))
    gm = make_fx(fn, tracing_mode="fake")(a, b)
    assert _matmuls.rewrite_shared_operands(gm.graph) == expected
    gm.graph.lint()
    gm.recompile()
    out = gm(a, b)
    # Later nodes were traced against bmm's contiguous output: the rewrite must keep it so.
    assert out.shape == want.shape and out.stride() == want.stride()
    torch.testing.assert_close(out, want, **TOL)


def test_symbolic_sizes_are_left_alone_and_the_graph_still_runs():
    """A graph traced with dynamic shapes: the rewrite put raw SymInts into its view nodes,
    and the graph failed to run (NameError)."""

    def fn(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.bmm(x.expand(4, 5, 3), v)

    x, v = torch.randn(5, 3, dtype=F64), torch.randn(4, 3, 7, dtype=F64)
    gm = make_fx(fn, tracing_mode="symbolic")(x, v)
    assert _matmuls.rewrite_shared_operands(gm.graph) == 0
    gm.recompile()
    torch.testing.assert_close(gm(x, v), torch.bmm(x.expand(4, 5, 3), v), **TOL)


@pytest.mark.parametrize("device", ["meta", "cuda"])
def test_other_devices_keep_their_bmm(device):
    def fn(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.bmm(x.expand(4, 5, 3), v)

    # Fake CUDA tensors need no GPU: only the graph's device matters to the rewrite.
    with FakeTensorMode(allow_non_fake_inputs=True):
        args = (
            torch.empty(5, 3, dtype=F64, device=device),
            torch.empty(4, 3, 7, dtype=F64, device=device),
        )
    gm = make_fx(fn, tracing_mode="fake")(*args)
    assert _matmuls.rewrite_shared_operands(gm.graph) == 0


class _Devices(TorchFunctionMode):
    """Records the device of every tensor a torch function is called on."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.update(str(a.device) for a in args if isinstance(a, torch.Tensor))
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch without MKL")
def test_warm_up_runs_on_the_cpu_whatever_the_default_device():
    """``torch.set_default_device("cuda")`` (or "meta") before ``import vmapens``: the warm-up
    made its tensors there and resolved none of MKL's CPU kernels."""
    spy = _Devices()
    with torch.device("meta"), spy:
        _mkl.warm_vml()
    assert spy.seen == {"cpu"}


class _Odd(nn.Module):
    """Member matmuls on a shared input in unusual layouts: a sliced column (in_features 1),
    the input transposed as the first operand (x^T @ P) and as the second (Q @ x^T), and
    layers whose weight gradients on 3 input features run merged and transposed."""

    def __init__(self, batch: int) -> None:
        super().__init__()
        self.one = nn.Linear(1, 6)
        self.narrow = nn.Linear(3, 24)  # weight gradient 24 x 3 on 40 rows: transposed bmm
        self.small = nn.Linear(3, 12)  # 12 x 3: merged into one mm, transposed
        self.p = nn.Parameter(torch.randn(batch, 5) / batch)
        self.q = nn.Parameter(torch.randn(7, 3) / 3)
        self.head = nn.Linear(6 + 24 + 12 + 7, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.cat(
            [
                self.one(x[:, 1:2]),
                torch.tanh(self.narrow(x)),
                self.small(x * 2),
                (self.q @ x.t()).t(),
            ],
            1,
        )
        return self.head(h) + (x.t() @ self.p).sum()


def test_compiled_step_on_odd_shared_layouts_equals_the_eager_step(monkeypatch):
    rewrites: list[int] = []
    rewrite = _matmuls.rewrite_shared_operands
    monkeypatch.setattr(
        _matmuls, "rewrite_shared_operands", lambda g: rewrites.append(rewrite(g)) or rewrites[-1]
    )
    batch = 40
    eager = vmapens.Ensemble(lambda: _Odd(batch), 3, seed=0).double()
    compiled = copy.deepcopy(eager)
    steps = [
        vmapens.make_step(
            e, nn.MSELoss(), vmapens.StackedSGD(e, lr=0.05, momentum=0.9), compile=c, check=False
        )
        for e, c in ((eager, False), (compiled, True))
    ]
    g = torch.Generator().manual_seed(1)
    # A graph from inductor's on-disk caches would not run the pass: compile afresh.
    with (
        inductor_config.patch(fx_graph_cache=False),
        functorch_config.patch(enable_autograd_cache=False),
    ):
        for _ in range(3):
            x = torch.randn(batch, 3, generator=g, dtype=F64)
            y = torch.randn(batch, 1, generator=g, dtype=F64)
            losses = [step(x, y) for step in steps]
            torch.testing.assert_close(losses[1], losses[0], rtol=1e-9, atol=1e-11)
    assert sum(rewrites) >= 5, f"the odd layouts were not rewritten: {rewrites}"
    torch.testing.assert_close(compiled.state_dict(), eager.state_dict(), rtol=1e-9, atol=1e-11)
