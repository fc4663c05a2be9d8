"""The training step when the user changes things between steps, and hooks around it.

Found by the hunt on ``make_step`` (eager and ``compile=True``) against members trained alone
with ``torch.optim``:

* a forward or backward hook registered on ``ens.template`` after ``make_step`` ran on no
  member under vmap, and the step did not refuse it (``ens(x)`` and a new step did);
* the compiled step never ran the optimizer's step hooks (its update runs inside the graph,
  not through ``optimizer.step()``);
* ``ens.template.<layer>.eval()`` between compiled steps: the step keyed its parts on the
  runner's modes, which follow the template only later in the call, so one step reused the
  train-mode parameters that get a gradient, and weight decay stepped a head the forward no
  longer read.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from truth import assert_members_equal, float64_batches, train_alone

import vmapens
from vmapens import _autocompile, _compiled_step

pytestmark = pytest.mark.usefixtures("float64_default")

N = 3


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


class Aux(nn.Module):
    """An auxiliary head the forward reads only while that head is in training mode."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.aux = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc(x)
        return out + self.aux(x) if self.aux.training else out


def _state(ens: vmapens.Ensemble) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in ens.stacked_state().items()}


def _unchanged(ens: vmapens.Ensemble, before: dict[str, torch.Tensor]) -> None:
    for name, value in ens.stacked_state().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0, msg=name)


HOOKS = {
    "forward": lambda m: m.register_forward_hook(lambda *a: None),
    "forward pre": lambda m: m.register_forward_pre_hook(lambda *a: None),
    "backward": lambda m: m.register_full_backward_hook(lambda *a: None),
    "backward pre": lambda m: m.register_full_backward_pre_hook(lambda *a: None),
}


@pytest.mark.parametrize("kind", list(HOOKS))
def test_a_hook_on_the_template_after_make_step_is_refused_by_the_step(kind: str) -> None:
    # docs/semantics.md: hooks added to ens.template later are refused on the next call. The
    # step lifted its member map once, at make_step, and ran without the hook, silently.
    ens = vmapens.Ensemble(_mlp, n=N, seed=0)
    opt = vmapens.StackedSGD(ens, lr=0.1)
    step = vmapens.make_step(ens, nn.functional.mse_loss, opt)
    (x, y), batch = float64_batches(2, 5, 3, 2)
    step(x, y)
    handle = HOOKS[kind](ens.template[2])
    before = _state(ens)
    with pytest.raises(RuntimeError, match=rf"`ens\.template\.2` has a {kind} hook"):
        step(*batch)
    _unchanged(ens, before)
    handle.remove()
    step(*batch)  # removed: the step runs again


def test_a_backward_hook_on_the_runner_after_make_step_is_refused_by_the_step() -> None:
    ens = vmapens.Ensemble(_mlp, n=N, seed=0)
    step = vmapens.make_step(ens, nn.functional.mse_loss, vmapens.StackedSGD(ens, lr=0.1))
    (x, y), batch = float64_batches(2, 5, 3, 2)
    step(x, y)
    ens.runner[0].register_full_backward_hook(lambda *a: None)
    before = _state(ens)
    with pytest.raises(RuntimeError, match=r"`0` \(Linear\) has a backward hook"):
        step(*batch)
    _unchanged(ens, before)


def test_the_compiled_step_follows_a_head_switched_to_eval_and_runs_the_step_hooks() -> None:
    # The head is switched on the template alone (docs/semantics.md: ens.template.bn.eval()
    # switches it for all members). Alone, the head gets no .grad in eval mode and Adam's
    # weight decay leaves it; the compiled step reused the train-mode parts and stepped it.
    ens = vmapens.Ensemble(Aux, n=N, seed=0)
    alone = ens.unstack()
    opt = vmapens.StackedAdam(ens, lr=0.05, weight_decay=0.5)
    posts: list[dict] = []
    opt.register_step_post_hook(lambda o, args, kwargs: posts.append(kwargs))
    step = vmapens.make_step(ens, nn.functional.mse_loss, opt, compile=True)
    batches = float64_batches(4, 5, 3, 2)
    for k, (x, y) in enumerate(batches):
        if k == 2:
            ens.template.aux.eval()
        step(x, y)
    assert posts == [{}] * len(batches)  # as optimizer.step() runs them, once a step

    # A pre-hook runs between the gradients and the update, which are one graph here: refused
    # before anything changes (the eager step runs it).
    pre = opt.register_step_pre_hook(lambda *a: None)
    before = _state(ens)
    with pytest.raises(ValueError, match=r"^step: `optimizer` has a step pre-hook"):
        step(*batches[0])
    _unchanged(ens, before)
    pre.remove()
    hook = ens.template.fc.register_forward_hook(lambda *a: None)
    with pytest.raises(RuntimeError, match=r"`ens\.template\.fc` has a forward hook"):
        step(*batches[0])
    _unchanged(ens, before)
    hook.remove()

    for m in alone:
        opt_alone = torch.optim.Adam(m.parameters(), lr=0.05, weight_decay=0.5)
        train_alone(m, batches[:2], make_opt=opt_alone)
        m.aux.eval()
        train_alone(m, batches[2:], make_opt=opt_alone)
    assert_members_equal(ens, alone)


def test_fit_auto_goes_on_eagerly_when_the_optimizer_has_a_step_pre_hook(monkeypatch) -> None:
    # fit(compile="auto") switches to the compiled step mid-run; with a pre-hook the compiled
    # step refuses (changing nothing), and the run goes on eagerly with the hook, as alone.
    monkeypatch.setattr(_autocompile, "COMPILE_PAYS_AFTER_S", 0.0)
    ens = vmapens.Ensemble(_mlp, n=N, seed=0)
    alone = ens.unstack()
    opt = vmapens.StackedSGD(ens, lr=0.1)
    calls: list[int] = []
    opt.register_step_pre_hook(lambda *a: calls.append(1))
    build = vmapens.make_step  # the same options as fit's eager and compiled steps
    eager = build(ens, nn.functional.mse_loss, opt)
    batches = float64_batches(_autocompile.TIMED_STEPS + 3, 5, 3, 2)
    auto = _autocompile.AutoStep(
        eager,
        lambda: build(ens, nn.functional.mse_loss, opt, compile=True),
        total_steps=len(batches),
    )
    with pytest.warns(UserWarning, match=r"step pre-hook.*goes on eagerly"):
        for x, y in batches:
            auto(x, y)
    assert auto.step is eager and len(calls) == len(batches)
    for m in alone:
        train_alone(m, batches, make_opt=lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    assert_members_equal(ens, alone)


def test_the_update_check_runs_again_after_the_parameters_change_dtype(monkeypatch) -> None:
    # ens.double() between compiled steps on integer inputs and targets: the inputs' shapes and
    # dtypes are as before, but dynamo compiles a new graph, whose first call must be checked
    # as the first graph's was (the parts were keyed on the inputs alone).
    calls = []
    checked_call = _compiled_step.checked_call
    monkeypatch.setattr(
        _compiled_step, "checked_call", lambda *a, **k: calls.append(1) or checked_call(*a, **k)
    )

    def tagger() -> nn.Module:
        return nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 4))

    ens = vmapens.Ensemble(tagger, n=N, seed=0).float()
    alone = ens.unstack()
    opt = vmapens.optim.StackedSGD(ens, lr=0.1)
    step = vmapens.make_step(ens, nn.functional.cross_entropy, opt, compile=True)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(5, (6,), generator=g), torch.randint(4, (6,), generator=g))
               for _ in range(4)]  # fmt: skip
    for x, y in batches[:2]:
        step(x, y)
    assert len(calls) == 1
    ens.double()
    for x, y in batches[2:]:
        step(x, y)
    assert len(calls) == 2
    for m in alone:
        sgd = torch.optim.SGD(m.parameters(), lr=0.1)
        train_alone(m.float(), batches[:2], nn.functional.cross_entropy, sgd)
        train_alone(m.double(), batches[2:], nn.functional.cross_entropy, sgd)
    assert_members_equal(ens, alone, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("how", ["make_step", "manual"])
def test_freezing_a_layer_on_the_template_freezes_it_as_on_a_plain_module(how: str) -> None:
    # `ens.template[0].requires_grad_(False)`, as on a plain module: the template's flags were
    # set back from the stacked parameters' at the next call, and the layer kept training.
    ens = vmapens.Ensemble(_mlp, n=N, seed=0)
    alone = ens.unstack()
    opt = vmapens.StackedAdam(ens, lr=0.1)
    step = vmapens.make_step(ens, nn.functional.mse_loss, opt)
    mine = [torch.optim.Adam(m.parameters(), lr=0.1) for m in alone]
    stacked = ens.stacked_params()
    for k, (x, y) in enumerate(float64_batches(6, 5, 3, 2)):
        if k == 1:  # freeze on the template, then on the stacked tensor too: both agree
            ens.template[0].requires_grad_(False)
            stacked["0.bias"].requires_grad_(False)
        if k == 4:  # unfreeze on the template
            ens.template[0].requires_grad_(True)
        for m in alone:
            m[0].requires_grad_(not 1 <= k < 4)
        if how == "make_step":
            step(x, y)
        else:
            opt.zero_grad()
            losses = nn.functional.mse_loss(ens(x), y.expand(N, *y.shape), reduction="none")
            losses.mean(dim=(1, 2)).sum().backward()
            opt.step()
        for m, o in zip(alone, mine, strict=True):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
        assert stacked["0.weight"].requires_grad == (not 1 <= k < 4)
    assert_members_equal(ens, alone)
