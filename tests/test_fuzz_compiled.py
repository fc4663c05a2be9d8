"""What the seeded random search over the compiled step found, each shrunk to a test.

The search (kept outside the suite: each compile costs seconds) drew models (MLP, CNN with
BatchNorm, GRU, a Transformer layer, tied weights, a frozen layer, dropout), dtypes, every
stacked optimizer with a torch twin (shared or per-member hyperparameters), clipping, masks,
per-member or shared batches of changing sizes, and changes between steps (learning rates by
hand, schedulers, freezing, train/eval, ``add_param_group``, state dict round trips, chunk
sizes), and compared ``make_step(..., compile=True)`` after every step with the eager step
and with each member trained alone with ``torch.optim``. The truth here is plain torch.

The tests share their compiled steps (module-scoped fixtures, tiny float64 models).
"""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
import torch
from torch import nn
from truth import TOL64, assert_members_equal, float64_batches

import vmapens
from vmapens import _autocompile, _compiled_step

N, CLIP = 3, 0.1


def _cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(2, 2, 2), nn.Tanh(), nn.Flatten(), nn.Linear(8, 2))


@pytest.fixture(scope="module")
def head_only() -> tuple[vmapens.Ensemble, list[nn.Module], dict[str, list[torch.Tensor]], Any]:
    """A channels_last CNN ensemble whose optimizer holds the head only while the body still
    requires grad (fine-tuning a head), trained compiled with ``clip_grad_norm``; its members
    trained alone with ``torch.optim.SGD`` over the head and ``clip_grad_norm_`` over all
    their parameters; the plain members' ``.grad`` after the last step; the compiled step and
    its last batch."""
    torch.manual_seed(0)
    members = [_cnn().double().to(memory_format=torch.channels_last) for _ in range(N)]
    alone = copy.deepcopy(members)
    ens = vmapens.Ensemble.from_modules(members).to(memory_format=torch.channels_last)
    head = [p for name, p in ens.named_parameters() if name.startswith("3.")]
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedSGD(head, lr=0.1),
                             compile=True, clip_grad_norm=CLIP)  # fmt: skip
    opts = [torch.optim.SGD(m[3].parameters(), lr=0.1) for m in alone]
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(5, 2, 3, 3, generator=g, dtype=torch.float64)
        y = torch.randn(5, 2, generator=g, dtype=torch.float64)
        step(x, y)
        for m, opt in zip(alone, opts, strict=True):
            m.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            nn.utils.clip_grad_norm_(m.parameters(), CLIP)
            opt.step()
    grads = {
        name: [m.get_parameter(name).grad for m in alone] for name, _ in ens.named_parameters()
    }
    return ens, alone, grads, (step, x, y)


def test_clipping_counts_the_gradients_of_parameters_outside_the_optimizer(head_only):
    # The compiled step clipped the optimizer's gradients only: the head stepped with a norm
    # that left out the body's gradients (1.9e-3 off after two steps), where the eager step
    # and clip_grad_norm_(member.parameters()) alone count every parameter with a gradient.
    ens, alone, _, _ = head_only
    assert_members_equal(ens, alone)


def test_parameters_outside_the_optimizer_get_their_gradients_in_grad(head_only):
    # As loss.backward() leaves them (and the eager step): the compiled step left them None.
    ens, _, grads, _ = head_only
    for name, p in ens.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, torch.stack(grads[name]), **TOL64, msg=name)


def test_grad_is_laid_out_as_its_parameter(head_only):
    # torch's .grad of a channels_last conv weight is channels_last, and so is the eager
    # step's; the compiled step left inductor's contiguous output there.
    ens, _, _, _ = head_only
    for name, p in ens.named_parameters():
        assert p.grad.stride() == p.stride(), name
    assert not dict(ens.named_parameters())["0.weight"].is_contiguous()  # not a trivial case


def test_a_graph_past_dynamos_recompile_limit_says_so_and_changes_nothing(head_only):
    # A mask, another mode or dtype compiles a graph again; past dynamo's recompile limit
    # (8), fullgraph=True raised its "Hard failure due to fullgraph=True" as it was. The
    # step's own limit counts input shapes only. Limit 1 here: the first mask is one too many.
    ens, _, _, (step, x, y) = head_only
    before = {k: v.clone() for k, v in ens.stacked_state().items()}
    with (
        torch._dynamo.config.patch(recompile_limit=1),
        pytest.raises(RuntimeError, match=r"^step: .*more than 1 times.*compile=False"),
    ):
        step(x, y, torch.tensor([True, False, True]))
    for name, value in ens.stacked_state().items():
        assert torch.equal(value, before[name]), name


class Timed(nn.Module):
    """A forward that calls a Python builtin dynamo cannot trace (a timer, as a profiling
    user would add): eager runs it, ``torch.compile(fullgraph=True)`` cannot."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.seconds = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = self.fc(x)
        self.seconds += time.perf_counter() - start
        return out


# dynamo warns that it cannot trace the builtin before it raises
UNTRACEABLE = pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace")


@UNTRACEABLE
def test_a_step_dynamo_cannot_trace_says_so_and_changes_nothing():
    # torch._dynamo.exc.Unsupported ("Attempted to call function marked as skipped") reached
    # the user as it was, naming neither the step nor compile=False.
    ens = vmapens.Ensemble(Timed, n=N, seed=0).double()
    before = {k: v.clone() for k, v in ens.stacked_state().items()}
    step = vmapens.make_step(ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=0.1), compile=True)
    x, y = float64_batches(1, 5, 3, 2)[0]
    with pytest.raises(RuntimeError, match=r"^step: torch.compile cannot compile.*compile=False"):
        step(x, y)
    for name, value in ens.stacked_state().items():
        assert torch.equal(value, before[name]), name


@UNTRACEABLE
@pytest.mark.parametrize("cause", ["untraceable", "shapes"])
def test_fit_auto_goes_on_eagerly_when_the_compiled_step_cannot_go_on(cause, monkeypatch):
    # fit(compile="auto") switched to the compiled step after its timed eager steps and then
    # failed (dynamo's error; the step's refusal of one more input shape, which a DataLoader
    # of varying batch sizes meets), where compile=False trains the same model to the end.
    monkeypatch.setattr(_autocompile, "COMPILE_PAYS_AFTER_S", 0.0)
    if cause == "shapes":  # refused at its first call, before compiling: no compile cost
        monkeypatch.setattr(_compiled_step, "MAX_SHAPES", 0)
    module = Timed if cause == "untraceable" else (lambda: nn.Linear(3, 2))
    batches = float64_batches(_autocompile.TIMED_STEPS + 3, 5, 3, 2)
    data = (torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))
    runs = []
    for compile in (False, "auto"):
        ens = vmapens.Ensemble(module, n=N, seed=0).double()
        alone = ens.unstack()
        options = dict(batch_size=5, shuffle=False, lr=0.05, progress=False, compile=compile)
        if compile:
            with pytest.warns(UserWarning, match=r"step: .*compile.*goes on eagerly"):
                vmapens.fit(ens, data, nn.MSELoss(), **options)
        else:
            vmapens.fit(ens, data, nn.MSELoss(), **options)
        runs.append(ens)
    opts = [torch.optim.Adam(m.parameters(), lr=0.05) for m in alone]
    for x, y in batches:
        for m, opt in zip(alone, opts, strict=True):
            opt.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()
    for ens in runs:
        assert_members_equal(ens, alone)


def test_a_layer_unfrozen_again_resumes_its_own_adam_step_count():
    # Freezing the head gives it step counts of its own; unfrozen, the step reused the graph
    # traced while all counts were one tensor (dynamo does not guard that aliasing): the head's
    # count stayed at 1 and its bias correction read the body's count (1e-2 off after 3 steps).
    torch.manual_seed(0)
    alone = [nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2)).double() for _ in range(2)]
    ens = vmapens.Ensemble.from_modules(copy.deepcopy(alone))
    opt = vmapens.StackedAdam(ens.parameters(), lr=0.05)
    step = vmapens.make_step(ens, nn.MSELoss(), opt, compile=True)
    opts = [torch.optim.Adam(m.parameters(), lr=0.05) for m in alone]
    for i, (x, y) in enumerate(float64_batches(4, 5, 3, 2)):
        for head in [ens.template[2], *(m[2] for m in alone)]:
            head.requires_grad_(i != 1)  # frozen for one step
        step(x, y)
        for m, o in zip(alone, opts, strict=True):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
    assert_members_equal(ens, alone)
    for name, p in ens.named_parameters():
        want = torch.stack([o.state[m.get_parameter(name)]["step"] for m, o in zip(alone, opts)])
        torch.testing.assert_close(opt.state[p]["step"], want.to(opt.state[p]["step"]), msg=name)
