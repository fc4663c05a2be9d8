"""make_step: the compiled one-graph step equals the eager step, and compiles once."""

from __future__ import annotations

import copy

import models
import pytest
import torch
from torch import nn
from torch._functorch import config as functorch_config
from torch._inductor import config as inductor_config
from torch._inductor.utils import run_and_get_code
from truth import assert_members_equal, float64_batches, train_alone, twins

import vmapens
from vmapens import _compiled_step, _matmuls

# The compiled graph may fuse and reorder float64 arithmetic: equal up to round-off.
TOL = dict(rtol=1e-9, atol=1e-11)
N = 4


def graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def mlp_batches(k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`k` float64 batches of 6 for `models.MLP` (4 inputs, 3 outputs)."""
    return float64_batches(k, 6, 4, 3)


def twin_steps(factory, loss_fn, *, in_dims=None, **opt_kw):
    """The same ensemble twice: one trained by the eager step, one by the compiled step."""
    eager = vmapens.Ensemble(factory, N, seed=0).double()
    compiled = copy.deepcopy(eager)
    step_e = vmapens.make_step(
        eager, loss_fn, vmapens.StackedAdam(eager, **opt_kw), in_dims=in_dims
    )
    step_c = vmapens.make_step(
        compiled, loss_fn, vmapens.StackedAdam(compiled, **opt_kw), in_dims=in_dims, compile=True
    )
    return eager, step_e, compiled, step_c


@pytest.fixture(scope="module")
def cnn_per_member():
    """BatchNorm buffers, per-member inputs and targets, per-member lr: one compile, shared."""
    torch.manual_seed(0)
    lr = torch.logspace(-3, -1, N).tolist()
    return twin_steps(models.CNN, nn.MSELoss(), in_dims=0, lr=lr)


def test_compiled_equals_eager_with_buffers_and_per_member_inputs(cnn_per_member):
    eager, step_e, compiled, step_c = cnn_per_member
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(N, 6, 1, 6, 6, generator=g, dtype=torch.float64)
        y = torch.randn(N, 6, 3, generator=g, dtype=torch.float64)
        torch.testing.assert_close(step_c(x, y), step_e(x, y), **TOL)
    torch.testing.assert_close(compiled.state_dict(), eager.state_dict(), **TOL)
    assert not torch.equal(eager.state_dict()["bn.running_mean"], torch.zeros(N, 4))


def test_compiled_masks_freeze_members_and_do_not_recompile(cnn_per_member):
    eager, step_e, compiled, step_c = cnn_per_member
    mask = torch.tensor([True, False, True, False])
    x = torch.randn(N, 6, 1, 6, 6, dtype=torch.float64)
    y = torch.randn(N, 6, 3, dtype=torch.float64)
    # Parameters and buffers (BatchNorm statistics) of masked member 1, in both ensembles.
    frozen = [{k: v[1].clone() for k, v in e.state_dict().items()} for e in (eager, compiled)]
    torch.testing.assert_close(step_c(x, y, mask), step_e(x, y, mask), **TOL)  # compiles
    before = graphs()
    for _ in range(3):
        torch.testing.assert_close(step_c(x, y, mask), step_e(x, y, mask), **TOL)
    assert graphs() == before, "a later call with the same shapes recompiled"
    torch.testing.assert_close(compiled.state_dict(), eager.state_dict(), **TOL)
    for ens, before in zip((eager, compiled), frozen, strict=True):
        for k, v in ens.state_dict().items():
            assert torch.equal(v[1], before[k]), f"masked member changed at {k}"


def test_compiled_step_trains_like_separate_models(monkeypatch):
    """Workload A through the compiled step against N plain modules and torch.optim.Adam.

    Its first layer on the shared input is a member matmul with a shared operand, which the
    compiled step rewrites into one matmul (vmapens/_matmuls.py) in the forward and the gradient.
    """
    rewrites: list[int] = []
    rewrite = _matmuls.rewrite_shared_operands
    monkeypatch.setattr(
        _matmuls, "rewrite_shared_operands", lambda g: rewrites.append(rewrite(g)) or rewrites[-1]
    )
    torch.manual_seed(0)
    alone = [
        nn.Sequential(nn.Linear(2, 20), nn.Linear(20, 1), nn.Sigmoid()).double() for _ in range(N)
    ]
    ens = vmapens.Ensemble.from_modules(twins(alone))
    step = vmapens.make_step(ens, nn.BCELoss(), vmapens.StackedAdam(ens, lr=1e-2), compile=True)
    x, y = torch.randn(5, 2, dtype=torch.float64), torch.ones(5, 1, dtype=torch.float64)
    # A graph from inductor's on-disk caches would not run the pass: compile afresh.
    with (
        inductor_config.patch(fx_graph_cache=False),
        functorch_config.patch(enable_autograd_cache=False),
    ):
        _, code = run_and_get_code(step, x, y)
        for _ in range(19):
            step(x, y)
    assert sum(rewrites) == 2, f"expected the forward and the gradient rewritten, got {rewrites}"
    (source,) = code
    # Adam's per-member bias corrections (float64 pows of the step counts) computed once per
    # member, not inlined into every parameter's loop (8 pows); its first moment's lerp fused
    # into the kernels, not run as a foreach call after them (docs/performance.md).
    assert source.count("pow(") == 2, "the per-member columns were inlined into the loops"
    assert "_foreach_lerp" not in source
    # The weight gradient of the first layer, computed transposed ([2, 5 * N]), is turned back
    # into rows in a buffer of its own: inlined into Adam's loops, it was read by a gather of
    # the 2 input features into each vector (inductor's `tmpbuf`), 20% of the step at N = 1024.
    assert "tmpbuf" not in source, "the transposed weight gradient was gathered in the loops"
    for twin in alone:  # torch.optim.Adam, lr 1e-2
        train_alone(twin, [(x, y)] * 20, nn.functional.binary_cross_entropy)
    assert_members_equal(ens, alone, **TOL)


@pytest.mark.parametrize("name", ["lr", "betas"])
def test_compiled_step_bakes_shared_floats_until_one_changes(name):
    """Without a scheduler, shared floats are constants of the graph (cheaper per step); the
    first value set by hand recompiles once and makes them inputs, so later values recompile
    nothing (dynamo would recompile at each, failing at the 9th). Members follow the values
    as torch.optim.Adam alone does."""
    ens = vmapens.Ensemble(models.MLP, N, seed=0).double()
    alone = twins(ens.unstack())
    opt = vmapens.StackedAdam(ens, lr=0.05)
    step = vmapens.make_step(ens, nn.MSELoss(), opt, compile=True)
    batches = mlp_batches(14)

    def value(k: int):  # what the user sets before step k (k >= 3), the same for each twin
        return 0.05 * 0.8**k if name == "lr" else (0.9 - 0.01 * k, 0.999)

    counts = []
    for k, (x, y) in enumerate(batches):
        if k >= 3:
            opt.param_groups[0][name] = value(k)
        step(x, y)
        counts.append(graphs())
    assert counts[1] == counts[2], "a call with the same floats recompiled"
    assert counts[3] == counts[2] + 1, "the first changed value should recompile once"
    assert counts[-1] == counts[3], "a later value recompiled the step"
    assert opt.param_groups[0][name] == value(13)
    for twin in alone:
        member_opt = torch.optim.Adam(twin.parameters(), lr=0.05)

        def set_value(k: int, o=member_opt) -> None:  # after step k: the value of step k + 1
            if k + 1 >= 3:
                o.param_groups[0][name] = value(k + 1)

        train_alone(twin, batches, nn.functional.mse_loss, member_opt, after_step=set_value)
    assert_members_equal(ens, alone, **TOL)


def test_eager_step_with_plain_torch_optimizer():
    ens = vmapens.Ensemble(models.MLP, N, seed=0)
    before = copy.deepcopy(ens.state_dict())
    step = vmapens.make_step(ens, nn.MSELoss(), torch.optim.SGD(ens.parameters(), lr=0.1))
    losses = step(torch.randn(7, 4), torch.randn(7, 3))
    assert losses.shape == (N,) and not losses.requires_grad
    assert not torch.equal(ens.state_dict()["fc1.weight"], before["fc1.weight"])
    with pytest.raises(TypeError, match="`mask` needs a vmapens.StackedOptimizer"):
        step(torch.randn(7, 4), torch.randn(7, 3), torch.ones(N, dtype=torch.bool))


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"in_dims": 1}, ValueError, r"make_step: `in_dims` must be None or 0, got 1"),
        (
            {"compile": True, "optimizer": "sgd"},
            TypeError,
            r"`compile=True` needs a vmapens.StackedOptimizer",
        ),
        ({"optimizer": "none"}, TypeError, r"`optimizer` must be a torch.optim.Optimizer"),
    ],
    ids=["in-dims", "compile-needs-stacked-adam", "not-an-optimizer"],
)
def test_make_step_bad_input(kwargs, exc, match):
    ens = vmapens.Ensemble(models.MLP, N, seed=0)
    optimizers = {"sgd": torch.optim.SGD(ens.parameters(), lr=0.1), "none": None}
    kwargs["optimizer"] = optimizers.get(kwargs.get("optimizer"), vmapens.StackedAdam(ens))
    with pytest.raises(exc, match=match):
        vmapens.make_step(ens, nn.MSELoss(), **kwargs)


def test_compiled_step_checks_per_member_sizes_like_eager(cnn_per_member):
    eager, step_e, compiled, step_c = cnn_per_member
    before = copy.deepcopy(compiled.state_dict())
    x = torch.randn(N - 1, 6, 1, 6, 6, dtype=torch.float64)  # one slice short
    y = torch.randn(N - 1, 6, 3, dtype=torch.float64)
    for step in (step_e, step_c):
        with pytest.raises(ValueError, match=r"argument 0 is mapped with in_dims=0 but has size 3"):
            step(x, y)
    torch.testing.assert_close(compiled.state_dict(), before, rtol=0, atol=0)


# -- the compiled step honours the ensemble's options as the eager step does ------------------


def _dropout_member() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.5), nn.Linear(8, 1))


def _same_members(randomness: str, **options) -> vmapens.Ensemble:
    """N identical members: only the forward's randomness can tell them apart."""
    torch.manual_seed(0)
    member = _dropout_member()
    return vmapens.Ensemble.from_modules([member] * N, randomness=randomness, **options)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("randomness", ["same", "different"])
def test_steps_honour_randomness(randomness, compile):
    ens = _same_members(randomness)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1), compile=compile)
    losses = step(torch.randn(16, 3), torch.randn(16, 1))
    equal = torch.allclose(losses, losses[0].expand(N))
    # "same": every member draws the same dropout mask (identical members stay identical);
    # "different": each its own.
    assert equal == (randomness == "same"), losses


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_steps_honour_randomness_error(compile):
    ens = _same_members("error")
    before = copy.deepcopy(ens.state_dict())
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1), compile=compile)
    with pytest.raises(Exception, match="randomness"):
        step(torch.randn(16, 3), torch.randn(16, 1))
    torch.testing.assert_close(ens.state_dict(), before, rtol=0, atol=0)


def test_compiled_step_honours_chunk_size():
    # vmap's chunk_size splits the members into chunks: the result equals unchunked.
    torch.manual_seed(0)
    members = [models.MLP().double() for _ in range(N)]
    whole = vmapens.Ensemble.from_modules(members)
    chunked = vmapens.Ensemble.from_modules(members, chunk_size=3)
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    step_whole = vmapens.make_step(whole, nn.MSELoss(), vmapens.StackedAdam(whole))
    step_chunked = vmapens.make_step(
        chunked, nn.MSELoss(), vmapens.StackedAdam(chunked), compile=True
    )
    for _ in range(2):
        torch.testing.assert_close(step_chunked(x, y), step_whole(x, y), **TOL)
    torch.testing.assert_close(chunked.state_dict(), whole.state_dict(), **TOL)


def test_compiled_step_with_loop_backend_is_refused_up_front():
    ens = vmapens.Ensemble(models.MLP, N, seed=0, backend="loop")
    with pytest.raises(ValueError, match=r"make_step: `compile=True` needs .*backend='vmap'"):
        vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens), compile=True)
    # The eager step runs the same loop backend.
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens))
    assert step(torch.randn(5, 4), torch.randn(5, 3)).shape == (N,)


def test_compiled_step_refuses_endless_batch_sizes_clearly(monkeypatch):
    monkeypatch.setattr(_compiled_step, "MAX_SHAPES", 2)  # dynamo's limit is 8: fewer compiles
    ens = vmapens.Ensemble(models.MLP, N, seed=0)
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(ens, lr=0.1), compile=True)
    for size in range(1, _compiled_step.MAX_SHAPES + 1):
        step(torch.randn(size, 4), torch.randn(size, 3))  # one compile per size, allowed
    before = copy.deepcopy(ens.state_dict())
    with pytest.raises(ValueError, match=r"compiled for 2 input shapes .*drop_last=True"):
        step(torch.randn(20, 4), torch.randn(20, 3))
    torch.testing.assert_close(ens.state_dict(), before, rtol=0, atol=0)


@pytest.mark.parametrize(
    "make_opt, torch_opt",
    [
        (lambda ens: vmapens.StackedAdam(ens, lr=0.05, betas=(0.8, 0.95)),
         lambda m: torch.optim.Adam(m.parameters(), lr=0.05, betas=(0.8, 0.95))),
        (lambda ens: vmapens.StackedSGD(ens, lr=0.1, momentum=0.9),
         lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)),
    ],
    ids=["adam", "sgd"],
)  # fmt: skip
def test_compiled_step_follows_a_scheduler_on_a_shared_lr(make_opt, torch_opt):
    """A float lr changed every step (ExponentialLR) reaches the graph as an input: no
    recompile (dynamo baked the float in and recompiled every step, failing at the 9th), the
    members follow torch's schedule alone, and param_groups keep their floats."""
    ens = vmapens.Ensemble(models.MLP, N, seed=0).double()
    alone = twins(ens.unstack())
    opt = make_opt(ens)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.8)
    step = vmapens.make_step(ens, nn.MSELoss(), opt, compile=True)
    batches = mlp_batches(12)
    step(*batches[0])  # compiles
    sched.step()
    before = graphs()
    for x, y in batches[1:]:
        step(x, y)
        sched.step()
    assert graphs() == before, "a changed lr recompiled the step"
    assert type(opt.param_groups[0]["lr"]) is float
    assert all(type(v) is float for v in opt.param_groups[0].get("betas", ()))
    for twin in alone:
        member_opt = torch_opt(twin)
        member_sched = torch.optim.lr_scheduler.ExponentialLR(member_opt, gamma=0.8)
        train_alone(twin, batches, nn.functional.mse_loss, member_opt,
                    after_step=lambda _, s=member_sched: s.step())  # fmt: skip
    assert_members_equal(ens, alone, **TOL)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_compile_options_are_what_torch_compile_accepts(device):
    # torch.compile refuses a mode together with options; CUDA's "reduce-overhead" must come
    # as its options (CUDA graphs), next to the precision and matmul options. No GPU needed:
    # torch.compile checks its arguments when it wraps, before anything runs.
    options = vmapens._compiling.compile_options(torch.device(device))
    torch.compile(lambda x: x, fullgraph=True, dynamic=False, options=options)
    assert options.get("triton.cudagraphs", False) is (device == "cuda")
    # eager's rounding of bf16/fp16 intermediates: autocast, StackedMuon, 16-bit parameters
    assert options.get("emulate_precision_casts", False) is True
    assert ("post_grad_custom_pre_pass" in options) is (device == "cpu")


def test_the_compiled_step_gives_torch_compile_its_options_and_no_mode(monkeypatch):
    seen: list[dict] = []
    real = torch.compile

    def recording(fn, **kwargs):
        seen.append(kwargs)
        return real(fn, **kwargs)

    monkeypatch.setattr(torch, "compile", recording)
    ens = vmapens.Ensemble(models.MLP, N, seed=0)
    vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens), compile=True)
    (kwargs,) = seen
    assert kwargs.get("mode") is None
    assert kwargs["options"] == vmapens._compiling.compile_options(torch.device("cpu"))
