"""batched_attention: vmapped attention equals each member run alone, in one kernel call.

The truth is each member, a real module, run alone in float64 (eval forwards under
``torch.no_grad()``, where torch takes its fused fast path). The ensemble side stacks the
members with ``torch.func.stack_module_state`` and runs ``functional_call`` on a meta-device
copy under ``vmap`` inside ``batched_attention()``.
"""

from __future__ import annotations

import contextlib
import copy
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value, stack_module_state, vmap

from vmapens._attention import batched_attention
from vmapens._compiling import compile_arguments

# pyproject ignores this warning suite-wide (the loop is correct, only slow); here it is
# exactly what must not happen, so it is an error again.
pytestmark = pytest.mark.filterwarnings("error:There is a performance drop:UserWarning")

N = 3
TOL = 1e-10  # float64 throughout; folding changes no arithmetic, only round-off order
DTYPE = torch.float64
B, L, D = 4, 6, 16


class SelfAttention(nn.Module):
    """nn.MultiheadAttention as self-attention, weights not returned (the sdpa path)."""

    def __init__(self, batch_first: bool = True) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(D, 4, batch_first=batch_first)

    def forward(
        self, x: Tensor, key_padding_mask: Tensor | None = None, attn_mask: Tensor | None = None
    ) -> Tensor:
        return self.mha(
            x, x, x, key_padding_mask=key_padding_mask, attn_mask=attn_mask, need_weights=False
        )[0]


class Attention(nn.Module):
    """Projections around a plain ``F.scaled_dot_product_attention`` call.

    ``member_mask`` gives every member its own attention mask (a buffer, so it is stacked
    and vmapped like the parameters): the per-member-mask case.
    """

    def __init__(
        self,
        heads: int = 4,
        kv_heads: int = 4,
        is_causal: bool = False,
        scale: float | None = None,
        member_mask: str | None = None,
    ) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.is_causal, self.scale = heads, kv_heads, is_causal, scale
        self.head_dim = D // heads
        self.q = nn.Linear(D, D)
        self.kv = nn.Linear(D, 2 * kv_heads * self.head_dim)
        self.out = nn.Linear(D, D)
        self.member_mask: Tensor | None
        if member_mask == "bool":
            # Keep the diagonal so that no query row is fully masked (NaN in every backend).
            self.register_buffer(
                "member_mask", (torch.rand(B, 1, L, L) > 0.5) | torch.eye(L, dtype=torch.bool)
            )
        elif member_mask == "float":
            self.register_buffer("member_mask", torch.randn(1, self.heads, L, L))
        else:
            self.member_mask = None

    def forward(self, x: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k, v = (
            self.kv(x).view(b, n, 2 * self.kv_heads, self.head_dim).transpose(1, 2).chunk(2, dim=1)
        )
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=self.member_mask if attn_mask is None else attn_mask,
            is_causal=self.is_causal,
            scale=self.scale,
            enable_gqa=self.kv_heads != self.heads,
        )
        return self.out(out.transpose(1, 2).reshape(b, n, D))


def encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2)


def padding(batch: int, length: int) -> Tensor:
    """A key padding mask (True = padding) with a different length per sequence."""
    return torch.arange(length) >= torch.tensor([length - k % 3 for k in range(batch)])[:, None]


@dataclass
class Case:
    id: str
    make: Callable[[], nn.Module]
    x_shape: tuple[int, ...] = (B, L, D)
    kwargs: Callable[[], dict[str, Tensor]] = dict
    train: bool = True
    # Positions compared and differentiated, [*x_shape[:-1]] (None: all). torch's fast path
    # writes zeros at padded positions, the regular path whatever attention gives there.
    keep: Callable[[dict[str, Tensor]], Tensor] | None = None


def _unpadded(kwargs: dict[str, Tensor]) -> Tensor:
    return ~kwargs["src_key_padding_mask"]


CASES = [
    Case("mha-batch-first", SelfAttention),
    Case("mha-seq-first", lambda: SelfAttention(batch_first=False), x_shape=(L, B, D)),
    Case("mha-key-padding-mask", SelfAttention, kwargs=lambda: {"key_padding_mask": padding(B, L)}),
    Case(
        "mha-float-attn-mask",
        SelfAttention,
        kwargs=lambda: {"attn_mask": torch.randn(L, L, dtype=DTYPE)},
    ),
    Case(
        "mha-seq-first-bool-attn-mask-and-padding-eval",
        lambda: SelfAttention(batch_first=False),
        x_shape=(L, B, D),
        kwargs=lambda: {
            "attn_mask": ~torch.ones(L, L, dtype=torch.bool).tril(),
            "key_padding_mask": padding(B, L),
        },
        train=False,
    ),
    Case("encoder-train", encoder, x_shape=(B, L, 32)),
    Case("encoder-eval", encoder, x_shape=(B, L, 32), train=False),
    Case(
        "encoder-padding-train",
        encoder,
        x_shape=(B, L, 32),
        kwargs=lambda: {"src_key_padding_mask": padding(B, L)},
        keep=_unpadded,
    ),
    Case(
        "encoder-padding-eval",
        encoder,
        x_shape=(B, L, 32),
        kwargs=lambda: {"src_key_padding_mask": padding(B, L)},
        train=False,
        keep=_unpadded,
    ),
    Case("sdpa-causal", lambda: Attention(is_causal=True)),
    Case("sdpa-scale-gqa", lambda: Attention(kv_heads=2, scale=0.3)),
    Case(
        "sdpa-shared-bool-mask-2d",
        Attention,
        kwargs=lambda: {"attn_mask": torch.ones(L, L, dtype=torch.bool).tril()},
    ),
    Case(
        "sdpa-shared-bool-mask-b11s",
        Attention,
        kwargs=lambda: {"attn_mask": ~padding(B, L)[:, None, None, :]},
    ),
    Case(
        "sdpa-shared-float-mask-bhls",
        Attention,
        kwargs=lambda: {"attn_mask": torch.randn(B, 4, L, L, dtype=DTYPE)},
    ),
    Case("sdpa-member-bool-mask", lambda: Attention(member_mask="bool")),
    Case("sdpa-member-float-mask", lambda: Attention(member_mask="float")),
]
COMPILED = ["encoder-padding-eval", "sdpa-member-bool-mask"]


def _setup(
    case: Case,
) -> tuple[list[nn.Module], nn.Module, Tensor, dict[str, Tensor], Tensor | None]:
    members = [case.make().to(DTYPE).train(case.train) for _ in range(N)]
    template = copy.deepcopy(members[0]).to("meta")
    x = torch.randn(case.x_shape, dtype=DTYPE)
    kwargs = case.kwargs()
    keep = None if case.keep is None else case.keep(kwargs)
    return members, template, x, kwargs, keep


def _kept(out: Tensor, keep: Tensor | None) -> Tensor:
    return out if keep is None else out * keep[..., None]


def _member_loss(template: nn.Module, keep: Tensor | None) -> Callable[..., tuple[Tensor, Tensor]]:
    def loss(params: dict, buffers: dict, x: Tensor, kwargs: dict) -> tuple[Tensor, Tensor]:
        out = _kept(functional_call(template, (params, buffers), (x,), kwargs), keep)
        return out.pow(2).sum(), out

    return loss


def _truth(
    members: list[nn.Module], x: Tensor, kwargs: dict, keep: Tensor | None
) -> tuple[list[Tensor], list[Tensor], list[list[Tensor]]]:
    outs, losses, grads = [], [], []
    for m in members:
        with torch.no_grad(), warnings.catch_warnings():
            # The encoder's eval fast path packs padded batches into (prototype) nested tensors.
            warnings.filterwarnings("ignore", "The PyTorch API of nested tensors", UserWarning)
            outs.append(_kept(m(x, **kwargs), keep))
        loss = _kept(m(x, **kwargs), keep).pow(2).sum()
        losses.append(loss.detach())
        grads.append(list(torch.autograd.grad(loss, list(m.parameters()))))
    return outs, losses, grads


def _assert_members(stacked: list[Tensor], truth: list[list[Tensor]]) -> None:
    for i, member in enumerate(truth):
        for s, t in zip(stacked, member, strict=True):
            torch.testing.assert_close(s[i], t, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_eager_forward_and_backward_match_members(case: Case):
    members, template, x, kwargs, keep = _setup(case)
    outs, losses, grads = _truth(members, x, kwargs, keep)
    params, buffers = stack_module_state(members)
    with batched_attention():
        loss, out = vmap(_member_loss(template, keep), in_dims=(0, 0, None, None))(
            params, buffers, x, kwargs
        )
        got = torch.autograd.grad(loss.sum(), list(params.values()))
    _assert_members([out, loss], [[o, v] for o, v in zip(outs, losses, strict=True)])
    _assert_members(list(got), grads)


def _grad_and_value(case: Case, compile: bool) -> None:
    members, template, x, kwargs, keep = _setup(case)
    _, losses, grads = _truth(members, x, kwargs, keep)
    params, buffers = stack_module_state(members)
    fn = vmap(
        grad_and_value(_member_loss(template, keep), has_aux=True), in_dims=(0, 0, None, None)
    )
    if compile:
        # With the compiled step's backend and options: its vector ISA in the cache key (a run
        # under ATEN_CPU_CAPABILITY=avx2 after one on AVX-512 read 16-wide kernels from torch's
        # compile cache otherwise), and its C++ wrapper (one C++ compile per graph, not one per
        # kernel).
        fn = torch.compile(fn, fullgraph=True, dynamic=False, **compile_arguments(x.device))
    # Entered outside the compiled function: the rule is read while tracing.
    with torch.no_grad(), batched_attention():
        got, (loss, _) = fn(params, buffers, x, kwargs)
    _assert_members([loss, *got.values()], [[v, *g] for v, g in zip(losses, grads, strict=True)])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_vmap_grad_and_value_matches_members(case: Case):
    _grad_and_value(case, compile=False)


@pytest.mark.parametrize("case", [c for c in CASES if c.id in COMPILED], ids=lambda c: c.id)
def test_compiled_vmap_grad_and_value_matches_members(case: Case):
    _grad_and_value(case, compile=True)


def _sdpa(q: Tensor) -> Tensor:
    return F.scaled_dot_product_attention(q, q, q)


def test_before_the_first_context_vmap_falls_back_to_its_loop():
    # A fresh process: torch's own per-member fallback, with its warning.
    code = (
        "import warnings, torch, torch.nn.functional as F\n"
        "warnings.simplefilter('error')\n"
        "q = torch.randn(3, 2, 4, 5, 8)\n"
        "torch.func.vmap(lambda q: F.scaled_dot_product_attention(q, q, q))(q)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "performance drop" in proc.stderr


# Attention outside the context, forward and gradients: exec'd here and in a fresh process.
_OUTSIDE = """
import torch, torch.nn.functional as F
from torch.func import vmap

def outside(q, mask):
    out = vmap(lambda q, m: F.scaled_dot_product_attention(q, q, q, attn_mask=m))(q, mask)
    return [out, *torch.autograd.grad(out.square().sum(), q)]
"""


def test_outside_the_context_attention_is_torchs_own_loop(tmp_path: Path):
    # The rule stays registered after the first context (registering costs ~0.1 ms); outside
    # every context vmap must still do what it does in a process without vmapens: a loop over
    # the members with torch's warning, bit for bit (the fresh process is the truth).
    g = torch.Generator().manual_seed(0)
    q = torch.randn(N, B, 4, L, 8, dtype=torch.float64, generator=g)
    mask = torch.randn(N, L, L, dtype=torch.float64, generator=g)
    torch.save([q, mask], tmp_path / "in.pt")
    code = (
        f"{_OUTSIDE}\ntorch.set_num_threads({torch.get_num_threads()})\n"
        f"q, mask = torch.load({str(tmp_path / 'in.pt')!r})\n"
        f"torch.save(outside(q.requires_grad_(), mask), {str(tmp_path / 'out.pt')!r})\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "performance drop" in proc.stderr
    space: dict = {}
    exec(_OUTSIDE, space)
    with batched_attention():  # registered now, if no earlier test did
        inside = space["outside"](q.clone().requires_grad_(), mask)
    with pytest.warns(UserWarning, match="performance drop"):
        ours = space["outside"](q.clone().requires_grad_(), mask)
    for got, want, near in zip(ours, torch.load(tmp_path / "out.pt"), inside, strict=True):
        assert torch.equal(got, want)
        torch.testing.assert_close(near, want, rtol=0, atol=1e-12)  # folding: summation order


def test_calls_without_vmap_are_untouched():
    q = torch.randn(B, 4, L, 8, requires_grad=True)
    with batched_attention():
        inside = _sdpa(q)
        (g_inside,) = torch.autograd.grad(inside.sum(), q)
    outside = _sdpa(q)
    (g_outside,) = torch.autograd.grad(outside.sum(), q)
    assert torch.equal(inside, outside) and torch.equal(g_inside, g_outside)


def test_dropout_keeps_vmap_randomness():
    # dropout_p > 0 takes torch's composite math path, which vmap batches by itself.
    q = torch.randn(N, B, 4, L, 8)
    with batched_attention():
        out = vmap(
            lambda q: F.scaled_dot_product_attention(q, q, q, dropout_p=0.5), randomness="different"
        )(q)
        with pytest.raises(RuntimeError, match="randomness"):
            vmap(lambda q: F.scaled_dot_product_attention(q, q, q, dropout_p=0.5))(q)
    assert out.shape == q.shape


def test_nested_and_threaded_contexts_share_one_rule():
    q = torch.randn(N, B, 4, L, 8)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(20):
                with batched_attention():
                    vmap(_sdpa)(q)
        except BaseException as err:  # surfaced in the main thread below
            errors.append(err)

    with batched_attention():
        threads = [threading.Thread(target=worker) for _ in range(2)]
        for t in threads:
            t.start()
        with batched_attention():
            vmap(_sdpa)(q)
        vmap(_sdpa)(q)  # still inside the outer context after the inner one left
        for t in threads:
            t.join()
    assert not errors, errors


# The settings the context switches off: the MHA fast path (vmap cannot batch it) and CUDA's
# memory-efficient attention (its backward fails under vmap; H200, torch 2.11: see
# docs/performance.md, "CUDA"). Each flag is an ordinary global, so this runs on CPU too.
SETTINGS = {
    "fastpath": (torch.backends.mha.get_fastpath_enabled, torch.backends.mha.set_fastpath_enabled),
    "mem-efficient-sdp": (
        torch.backends.cuda.mem_efficient_sdp_enabled,
        torch.backends.cuda.enable_mem_efficient_sdp,
    ),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("before", [True, False], ids=["on", "off"])
@pytest.mark.parametrize("raises", [False, True], ids=["body-returns", "body-raises"])
def test_switched_settings_are_restored(setting: str, before: bool, raises: bool):
    get, set_ = SETTINGS[setting]
    old = get()
    set_(before)
    try:
        with pytest.raises(KeyError) if raises else contextlib.nullcontext(), batched_attention():
            assert not get()
            with batched_attention():  # nested: the outer one restores
                assert not get()
            assert not get()
            if raises:
                raise KeyError("body")
        assert get() is before
    finally:
        set_(old)
