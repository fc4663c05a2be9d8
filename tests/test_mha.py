"""vmapens._mha: the attention twin against torch's own ``nn.MultiheadAttention``, the truth."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

from vmapens._batchable import batchable
from vmapens._mha import MATH_SCORES, BatchableMultiheadAttention

TOL = {"atol": 1e-10, "rtol": 1e-10}  # float64: the same maths in another order
EMBED, HEADS, BATCH = 16, 4, 3


def _pair(**kwargs) -> tuple[nn.MultiheadAttention, BatchableMultiheadAttention]:
    torch.manual_seed(0)
    truth = nn.MultiheadAttention(EMBED, HEADS, **kwargs).double()
    twin = copy.deepcopy(truth)
    twin.__class__ = BatchableMultiheadAttention
    return truth, twin


def _run(mha: nn.Module, x: torch.Tensor, call: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = x.detach().requires_grad_()
    out, _ = mha(x, x, x, **call)
    out.pow(2).sum().backward()
    grads = [x.grad] + [p.grad for p in mha.parameters()]
    return out, grads


# (id, constructor kwargs, sequence length, forward kwargs): each takes the twin's own path.
PLAIN = [
    ("batch-first", {"batch_first": True}, 7, {}),
    ("sequence-first", {}, 7, {}),
    ("no-bias", {"batch_first": True, "bias": False}, 5, {}),
    ("long-sequence-sdpa", {"batch_first": True}, 80, {}),
    ("at-the-math-limit", {"batch_first": True}, 64, {}),
    ("dropout-in-eval", {"batch_first": True, "dropout": 0.5}, 6, {"eval": True}),
]


@pytest.mark.parametrize(
    ("kwargs", "length", "call"), [c[1:] for c in PLAIN], ids=[c[0] for c in PLAIN]
)
def test_plain_self_attention_equals_torch(kwargs, length, call, monkeypatch):
    truth, twin = _pair(**kwargs)
    if call.get("eval"):
        truth.eval(), twin.eval()
    shape = (BATCH, length, EMBED) if kwargs.get("batch_first") else (length, BATCH, EMBED)
    x = torch.randn(shape, dtype=torch.float64)
    out, grads = _run(truth, x, {"need_weights": False})
    # The twin must not reach torch's forward on these calls: that is the point of it.
    monkeypatch.setattr(nn.MultiheadAttention, "forward", _never)
    twin_out, twin_grads = _run(twin, x, {"need_weights": False})
    torch.testing.assert_close(twin_out, out, **TOL)
    for got, want in zip(twin_grads, grads, strict=True):
        torch.testing.assert_close(got, want, **TOL)


def _never(*args, **kwargs):
    raise AssertionError("the plain case ran torch's own forward")


@pytest.fixture
def calls(monkeypatch) -> list[int]:
    """One entry per ``F.scaled_dot_product_attention`` call made while the test runs."""
    made: list[int] = []
    kernel = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        torch.nn.functional,
        "scaled_dot_product_attention",
        lambda *a, **k: made.append(1) or kernel(*a, **k),
    )
    return made


@pytest.mark.parametrize(("length", "kernel_calls"), [(64, 0), (65, 1)])
def test_cpu_runs_the_math_form_up_to_math_scores_and_the_kernel_above(length, kernel_calls, calls):
    assert (length * length <= MATH_SCORES) == (kernel_calls == 0)  # either side of the limit
    _, twin = _pair(batch_first=True)
    x = torch.randn(BATCH, length, EMBED, dtype=torch.float64)
    twin(x, x, x, need_weights=False)
    assert len(calls) == kernel_calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_runs_the_fused_kernel(dtype, calls):
    # Its softmax runs in float32 inside; two matmuls and a softmax would round in `dtype`.
    truth, twin = _pair(batch_first=True)
    truth, twin = truth.to(dtype), twin.to(dtype)
    x = torch.randn(BATCH, 6, EMBED, dtype=dtype)
    got, _ = twin(x, x, x, need_weights=False)
    assert calls == [1]
    want, _ = truth(x, x, x, need_weights=False)
    torch.testing.assert_close(got, want)


# Every call outside the plain case runs torch's own forward: bit for bit the same.
FALLBACK = [
    ("need-weights", {"batch_first": True}, {"need_weights": True}),
    ("attn-mask", {"batch_first": True}, {"attn_mask": torch.ones(6, 6).triu(1).bool()}),
    (
        "causal",
        {"batch_first": True},
        {"attn_mask": torch.ones(6, 6).triu(1).bool(), "is_causal": True},
    ),
    (
        "key-padding",
        {"batch_first": True},
        {"key_padding_mask": torch.arange(6).expand(BATCH, 6) > 4},
    ),
    ("dropout-training", {"batch_first": True, "dropout": 0.5}, {}),
    ("bias-kv", {"batch_first": True, "add_bias_kv": True}, {}),
    ("zero-attn", {"batch_first": True, "add_zero_attn": True}, {}),
    ("kdim", {"batch_first": True, "kdim": 8, "vdim": 8}, {}),
]


@pytest.mark.parametrize(
    ("kwargs", "call"), [c[1:] for c in FALLBACK], ids=[c[0] for c in FALLBACK]
)
def test_other_calls_run_torchs_forward_exactly(kwargs, call):
    truth, twin = _pair(**kwargs)
    x = torch.randn(BATCH, 6, EMBED, dtype=torch.float64)
    kv = torch.randn(BATCH, 6, 8, dtype=torch.float64) if "kdim" in kwargs else x
    call = {"need_weights": False, **call}
    outs = []
    for mha in (truth, twin):
        torch.manual_seed(1)  # the same dropout draws
        outs.append(mha(x, kv, kv, **call))
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=0, rtol=0)
    if outs[0][1] is not None:
        torch.testing.assert_close(outs[1][1], outs[0][1], atol=0, rtol=0)


def test_cross_attention_runs_torchs_forward_exactly():
    truth, twin = _pair(batch_first=True)
    q, kv = torch.randn(2, BATCH, 5, EMBED, dtype=torch.float64)
    for call in ({"need_weights": False}, {}):
        want, got = truth(q, kv, kv, **call), twin(q, kv, kv, **call)
        torch.testing.assert_close(got[0], want[0], atol=0, rtol=0)


@pytest.mark.parametrize("length", [7, 80], ids=["math", "sdpa"])
def test_vmapped_twin_equals_each_member_alone(length):
    torch.manual_seed(0)
    members = [nn.MultiheadAttention(EMBED, HEADS, batch_first=True).double() for _ in range(3)]
    params, _ = stack_module_state(members)
    template = batchable(members[0]).to("meta")
    assert type(template) is BatchableMultiheadAttention
    x = torch.randn(BATCH, length, EMBED, dtype=torch.float64)

    def call(p, x):
        return functional_call(template, p, (x, x, x), {"need_weights": False})[0]

    out = vmap(call, in_dims=(0, None))(params, x)
    out.pow(2).sum().backward()
    for i, member in enumerate(members):
        alone, _ = member(x, x, x, need_weights=False)
        alone.pow(2).sum().backward()
        torch.testing.assert_close(out[i], alone, **TOL)
        for name, p in member.named_parameters():
            torch.testing.assert_close(params[name].grad[i], p.grad, **TOL)


def test_batchable_leaves_subclasses_and_the_original_alone():
    class Mine(nn.MultiheadAttention):
        pass

    model = nn.Sequential(nn.MultiheadAttention(EMBED, HEADS), Mine(EMBED, HEADS))
    converted = batchable(model)
    assert [type(m) for m in converted] == [BatchableMultiheadAttention, Mine]
    assert [type(m) for m in model] == [nn.MultiheadAttention, Mine]
    assert list(converted.state_dict()) == list(model.state_dict())
