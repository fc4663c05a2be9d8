"""Hunt: the eager make_step as torch users call it (clip bounds as tensors, several targets)
against N plain modules trained alone with torch.optim and torch.nn.utils, in float64."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import vmapens

N = 3


def factory() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def pair(**kwargs: Any) -> tuple[vmapens.Ensemble, list[nn.Module]]:
    ens = vmapens.Ensemble(factory, n=N, seed=0, **kwargs).double()
    return ens, [copy.deepcopy(m) for m in ens.unstack()]


def step_alone(
    members: list[nn.Module],
    opts: list[torch.optim.Optimizer],
    x: torch.Tensor,
    targets: Callable[[int], Any],
    loss_fn: Callable,
    clip: Callable[[nn.Module], Any] | None = None,
) -> torch.Tensor:
    losses = []
    for i, (m, opt) in enumerate(zip(members, opts, strict=True)):
        opt.zero_grad()
        loss = loss_fn(m(x), targets(i))
        loss.backward()
        if clip is not None:
            clip(m)
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def assert_members_equal(ens: vmapens.Ensemble, members: list[nn.Module]) -> None:
    for name, p in ens.stacked_params().items():
        for i, m in enumerate(members):
            torch.testing.assert_close(p[i], m.get_parameter(name), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("option", ["clip_grad_norm", "clip_grad_value"])
def test_a_clip_bound_given_as_a_0d_tensor_clips_as_torch_nn_utils(option):
    ens, members = pair()
    opt = torch.optim.SGD(ens.parameters(), lr=0.1, momentum=0.9)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in members]
    bound = torch.tensor(0.05, dtype=torch.float64)
    step = vmapens.make_step(ens, nn.MSELoss(), opt, **{option: bound})
    if option == "clip_grad_norm":
        clip = lambda m: nn.utils.clip_grad_norm_(m.parameters(), bound)  # noqa: E731
    else:
        clip = lambda m: nn.utils.clip_grad_value_(m.parameters(), bound)  # noqa: E731
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3, generator=gen, dtype=torch.float64)
    y = torch.randn(6, 2, generator=gen, dtype=torch.float64)
    for _ in range(3):
        losses = step(x, y)
        want = step_alone(members, opts, x, lambda i: y, nn.MSELoss(), clip)
        torch.testing.assert_close(losses, want, rtol=1e-12, atol=0)
    assert_members_equal(ens, members)


@pytest.mark.parametrize(
    ("bound", "error", "match"),
    [
        (torch.tensor([0.5, 0.5]), TypeError, r"`clip_grad_norm` must be a float.*shape \[2\]"),
        (torch.tensor(True), TypeError, "`clip_grad_norm` must be a real number"),
        (torch.tensor(-1.0), ValueError, "`clip_grad_norm` must be > 0"),
        ("0.5", TypeError, "`clip_grad_norm` must be a float"),
    ],
)
def test_a_clip_bound_that_is_not_one_positive_number_is_refused(bound, error, match):
    ens, _ = pair()
    with pytest.raises(error, match=f"make_step: {match}"):
        vmapens.make_step(
            ens, nn.MSELoss(), torch.optim.SGD(ens.parameters()), clip_grad_norm=bound
        )


def two_targets(out: torch.Tensor, target: Any) -> torch.Tensor:
    """A weighted MSE whose targets come as (values, weights) or {"y": ..., "w": ...}."""
    y, w = (target["y"], target["w"]) if isinstance(target, dict) else target
    return (w * (out - y) ** 2).mean()


@pytest.mark.parametrize("structure", [tuple, list, dict])
@pytest.mark.parametrize(
    ("in_dims", "kwargs"),
    [(None, {}), (None, {"chunk_size": 2}), (None, {"backend": "loop"}), (0, {})],
)
def test_several_targets_train_each_member_as_alone(structure, in_dims, kwargs):
    ens, members = pair(**kwargs)
    opt = vmapens.StackedAdam(ens, lr=0.05)
    opts = [torch.optim.Adam(m.parameters(), lr=0.05) for m in members]
    gen = torch.Generator().manual_seed(2)
    lead = () if in_dims is None else (N,)
    x = torch.randn(*lead, 5, 3, generator=gen, dtype=torch.float64)
    y = torch.randn(*lead, 5, 2, generator=gen, dtype=torch.float64)
    w = torch.rand(*lead, 5, 1, generator=gen, dtype=torch.float64)
    targets = {"y": y, "w": w} if structure is dict else structure([y, w])

    def mine(i: int) -> Any:
        if in_dims is None:
            return targets
        if structure is dict:
            return {"y": y[i], "w": w[i]}
        return structure([y[i], w[i]])

    step = vmapens.make_step(ens, two_targets, opt, in_dims=in_dims, clip_grad_norm=0.5)
    for _ in range(2):
        losses = step(x, targets)
        want = (
            step_alone(
                members,
                opts,
                x,
                mine,
                two_targets,
                lambda m: nn.utils.clip_grad_norm_(m.parameters(), 0.5),
            )
            if in_dims is None
            else None
        )
        if in_dims is not None:  # each member its own rows of the inputs too
            want = torch.stack(
                [
                    step_alone([m], [o], x[i], lambda _, i=i: mine(i), two_targets,
                               lambda m: nn.utils.clip_grad_norm_(m.parameters(), 0.5))[0]
                    for i, (m, o) in enumerate(zip(members, opts, strict=True))
                ]
            )  # fmt: skip
        torch.testing.assert_close(losses, want, rtol=1e-12, atol=0)
    assert_members_equal(ens, members)


@pytest.mark.parametrize(
    ("targets", "match"),
    [
        ((torch.zeros(5, 2), 0.5), "got a tuple holding float"),
        ({"y": torch.zeros(5, 2), "w": None}, "got a dict holding NoneType"),
        ((), "got an empty tuple"),
        ("y", "got str"),
    ],
)
def test_targets_that_are_not_tensors_are_refused_before_anything_changes(targets, match):
    ens, _ = pair()
    opt = torch.optim.SGD(ens.parameters(), lr=0.1, momentum=0.9)
    step = vmapens.make_step(ens, two_targets, opt, check=False)
    before = {k: p.clone() for k, p in ens.stacked_params().items()}
    with pytest.raises(TypeError, match=f"step: `targets` must be a tensor or .*{match}"):
        step(torch.zeros(5, 3, dtype=torch.float64), targets)
    for k, p in ens.stacked_params().items():
        assert torch.equal(p, before[k]) and p.grad is None
    assert not opt.state


def maybe_weighted(out: torch.Tensor, target: dict) -> torch.Tensor:
    """An MSE, weighted where the batch has weights (an empty tensor where it has none)."""
    w = target["w"] if target["w"].numel() else 1.0
    return (w * (out - target["y"]) ** 2).mean()


@pytest.mark.parametrize("in_dims", [None, 0])
def test_a_missing_target_as_none_names_the_way_out_and_that_way_trains_as_alone(in_dims):
    ens, members = pair()
    step = vmapens.make_step(ens, maybe_weighted, vmapens.StackedSGD(ens, lr=0.1), in_dims=in_dims)
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"holding NoneType; for a target missing .*torch\.empty"):
        step(x, {"y": y, "w": None})
    # The way the message names: an empty tensor the loss skips.
    if in_dims is None:
        got = step(x, {"y": y, "w": torch.empty(0)})
    else:
        got = step(x.expand(N, 5, 3), {"y": y.expand(N, 5, 2), "w": torch.empty(N, 0)})
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in members]
    want = step_alone(members, opts, x, lambda _: {"y": y, "w": torch.empty(0)}, maybe_weighted)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    assert_members_equal(ens, members)


def test_several_targets_pass_the_first_calls_self_check():
    # check=True (the default): vmapens.check runs member 0 alone on the same targets.
    ens, members = pair()
    step = vmapens.make_step(ens, two_targets, torch.optim.SGD(ens.parameters(), lr=0.1))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in members]
    x = torch.randn(4, 3, dtype=torch.float64)
    targets = (torch.randn(4, 2, dtype=torch.float64), torch.rand(4, 1, dtype=torch.float64))
    step(x, targets)
    step_alone(members, opts, x, lambda i: targets, two_targets)
    assert_members_equal(ens, members)


def test_the_first_calls_self_check_leaves_inputs_and_targets_grads_as_the_step_does() -> None:
    # The step differentiates the parameters only: a teacher's output that requires grad
    # keeps `.grad` None, with the self-check (the first call's default) as without it.
    for check in (True, False):
        ens = vmapens.Ensemble(lambda: nn.Linear(3, 5, dtype=torch.float64), n=3, seed=0)
        opt = torch.optim.SGD(ens.parameters(), lr=0.1)
        x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
        t = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
        vmapens.make_step(ens, nn.MSELoss(), opt, check=check)(x, t)
        assert x.grad is None and t.grad is None, check


class _Unsupported(torch.optim.SGD):
    """A user's optimizer with a rule it has not written for every case yet."""

    def step(self, closure: Any = None) -> Any:
        raise NotImplementedError("my_rule is not implemented for sparse tensors yet")


def test_an_error_after_the_backward_is_not_explained_as_the_members_and_changes_nothing() -> None:
    """The guard explains errors of the members' forward and loss ("makes a sparse tensor",
    "a member's forward or loss failed"); an error from the optimizer comes after them and is
    raised as the optimizer raised it, with BatchNorm's statistics and the parameters as
    before."""
    ens = vmapens.Ensemble(lambda: nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)), 3, seed=0)
    before = copy.deepcopy(ens.state_dict())
    step = vmapens.make_step(ens, nn.MSELoss(), _Unsupported(ens.parameters(), lr=0.1), check=False)
    with pytest.raises(NotImplementedError, match="^my_rule is not implemented") as err:
        step(torch.randn(5, 3), torch.randn(5, 4))
    assert "forward" not in str(err.value)
    for key, value in ens.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0, msg=key)
