"""make_step/fit options: per-member gradient clipping; fit's optimizer classes and factories."""

from __future__ import annotations

import models
import pytest
import torch
import truth
from torch import nn

import vmapens

# float32 members against float32 plain modules: batched kernels sum in another order, and
# Adam's first steps turn those float32 round-offs (~1e-7 relative) into parameter differences
# of ~lr * 1e-7 / |g| in small gradients. Held on every CPU setting of docs/semantics.md's
# "What holds on which hardware" (native, oneDNN capped at AVX2, ATen default kernels, 1 and 2
# threads); a wrong clip or update is off by ~lr = 1e-2.
TOL = dict(rtol=1e-5, atol=1e-6)
N = 3
STEPS = 4


def batches(x_shape, y_shape, steps=STEPS):
    return [(torch.randn(*x_shape), torch.randn(*y_shape)) for _ in range(steps)]


def train_alone(models_, data, loss_fn, make_opt, clip=None):
    """Each module trained alone (truth.train_each): torch's clipping and optimizer."""
    truth.train_each(models_, data, loss_fn, make_opt, clip=clip)
    return models_


def assert_members(ens, alone):
    truth.assert_members_equal(ens, alone, **TOL)


def torch_clip(kind, bound):
    if kind == "clip_grad_norm":
        return lambda ps: torch.nn.utils.clip_grad_norm_(ps, bound)
    return lambda ps: torch.nn.utils.clip_grad_value_(ps, bound)


# (member, input shape, target shape, option, bound): bounds small enough to bind.
CLIP_CASES = [
    pytest.param(models.MLP, (16, 4), (16, 3), "clip_grad_norm", 0.05, id="mlp-norm"),
    pytest.param(models.MLP, (16, 4), (16, 3), "clip_grad_value", 0.01, id="mlp-value"),
    pytest.param(models.CNN, (8, 1, 6, 6), (8, 3), "clip_grad_norm", 0.1, id="cnn-bn-norm"),
    pytest.param(models.Awkward, (16, 4), (16, 3), "clip_grad_norm", 0.05, id="awkward-norm"),
]


@pytest.mark.parametrize(("factory", "x_shape", "y_shape", "option", "bound"), CLIP_CASES)
def test_clipping_matches_members_alone(factory, x_shape, y_shape, option, bound):
    ens = vmapens.Ensemble(factory, N, seed=0)
    alone = ens.unstack()
    data = batches(x_shape, y_shape)
    step = vmapens.make_step(
        ens, nn.MSELoss(), vmapens.StackedAdam(ens, lr=1e-2), **{option: bound}
    )
    for x, y in data:
        step(x, y)
    adam = lambda i, m: torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=1e-2)  # noqa: E731
    assert_members(ens, train_alone(alone, data, nn.MSELoss(), adam, torch_clip(option, bound)))


def test_compiled_clipping_matches_members_alone():
    ens = vmapens.Ensemble(models.MLP, N, seed=0)
    alone = ens.unstack()
    data = batches((16, 4), (16, 3))
    opt = vmapens.StackedAdam(ens, lr=1e-2)
    step = vmapens.make_step(ens, nn.MSELoss(), opt, compile=True, clip_grad_norm=0.05)
    for x, y in data:
        step(x, y)
    adam = lambda i, m: torch.optim.Adam(m.parameters(), lr=1e-2)  # noqa: E731
    clip = torch_clip("clip_grad_norm", 0.05)
    assert_members(ens, train_alone(alone, data, nn.MSELoss(), adam, clip))


def test_fit_with_an_optimizer_class_and_per_member_hyperparameters():
    ens = vmapens.Ensemble(models.MLP, N, seed=0)
    alone = ens.unstack()
    data = batches((16, 4), (16, 3))
    lr, momentum = [0.1, 0.03, 0.01], [0.0, 0.5, 0.9]
    vmapens.fit(ens, data, nn.MSELoss(), epochs=2, optimizer=vmapens.StackedSGD, lr=lr,
                momentum=momentum, progress=False, seed=0)  # fmt: skip

    def sgd(i, m):
        return torch.optim.SGD(m.parameters(), lr=lr[i], momentum=momentum[i])

    assert_members(ens, train_alone(alone, data + data, nn.MSELoss(), sgd))


def test_fit_with_a_factory_and_clipping():
    ens = vmapens.Ensemble(models.MLP, N, seed=0)
    alone = ens.unstack()
    data = batches((16, 4), (16, 3))
    factory = lambda e, lr: vmapens.StackedAdam(e, lr=lr, betas=(0.8, 0.9))  # noqa: E731
    vmapens.fit(ens, data, nn.MSELoss(), optimizer=factory, lr=0.01, clip_grad_norm=0.05,
                progress=False, seed=0)  # fmt: skip
    adam = lambda i, m: torch.optim.Adam(m.parameters(), lr=0.01, betas=(0.8, 0.9))  # noqa: E731
    clip = torch_clip("clip_grad_norm", 0.05)
    assert_members(ens, train_alone(alone, data, nn.MSELoss(), adam, clip))


def test_fit_lr_still_configures_the_default_adam():
    ens = vmapens.Ensemble(models.MLP, N, seed=0)
    alone = ens.unstack()
    data = batches((16, 4), (16, 3))
    vmapens.fit(ens, data, nn.MSELoss(), lr=[1e-3, 1e-2, 1e-1], progress=False, seed=0)
    adam = lambda i, m: torch.optim.Adam(m.parameters(), lr=[1e-3, 1e-2, 1e-1][i])  # noqa: E731
    assert_members(ens, train_alone(alone, data, nn.MSELoss(), adam))


FIT_ERRORS = [
    pytest.param(
        dict(optimizer="instance", lr=0.1, momentum=0.9),
        ValueError,
        r"fit: `lr`, `momentum` configure the optimizer that fit builds",
        id="hyperparameters-with-an-instance",
    ),
    pytest.param(dict(epoch=3), TypeError, r"fit: StackedAdam does not take .*epoch", id="typo"),
    pytest.param(
        dict(optimizer=vmapens.StackedSGD, betas=(0.9, 0.99)),
        TypeError,
        r"fit: StackedSGD does not take .*betas",
        id="wrong-hyperparameter",
    ),
    pytest.param(
        dict(optimizer=torch.optim.Adam),
        TypeError,
        r"fit: an `optimizer` class must be a vmapens.StackedOptimizer, got Adam",
        id="torch-class",
    ),
    pytest.param(dict(optimizer=3), TypeError, r"fit: `optimizer` must be .* got int", id="int"),
    pytest.param(
        dict(optimizer=lambda e: torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)),
        ValueError,
        r"fit: `optimizer` parameter 0 .* is not a parameter of this ensemble",
        id="factory-over-other-params",
    ),
]


@pytest.mark.parametrize(("kwargs", "error", "match"), FIT_ERRORS)
def test_fit_optimizer_errors(kwargs, error, match):
    ens = vmapens.Ensemble(models.MLP, N, seed=0)
    if kwargs.get("optimizer") == "instance":
        kwargs = {**kwargs, "optimizer": vmapens.StackedSGD(ens)}
    before = [p.detach().clone() for p in ens.parameters()]
    with pytest.raises(error, match=match):
        vmapens.fit(ens, batches((4, 4), (4, 3), 1), nn.MSELoss(), progress=False, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(before, ens.parameters()))


STEP_ERRORS = [
    pytest.param(
        dict(clip_grad_norm=1.0, clip_grad_value=1.0), ValueError, r"give one of", id="both"
    ),
    pytest.param(dict(clip_grad_norm=0.0), ValueError, r"`clip_grad_norm` must be > 0", id="norm0"),
    pytest.param(
        dict(clip_grad_value=-1.0), ValueError, r"`clip_grad_value` must be > 0", id="value<0"
    ),
    pytest.param(
        dict(clip_grad_norm="1"), TypeError, r"`clip_grad_norm` must be a float", id="str"
    ),
    pytest.param(dict(precision="fp8"), ValueError, r"`precision` must be one of", id="fp8"),
    pytest.param(
        dict(loss_scale=vmapens.step.LossScale(N)),
        ValueError,
        r"`loss_scale` needs `precision='fp16'`",
        id="scale-without-fp16",
    ),
    pytest.param(
        dict(precision="fp16", loss_scale=vmapens.step.LossScale(N + 1)),
        ValueError,
        r"`loss_scale` is for 4 members, the ensemble has 3",
        id="scale-size",
    ),
    pytest.param(
        dict(precision="fp16", optimizer="torch"),
        TypeError,
        r"make_step: `precision='fp16'` skips overflowing members .* got Adam",
        id="fp16-torch-optimizer",
    ),
]


@pytest.mark.parametrize(("kwargs", "error", "match"), STEP_ERRORS)
def test_make_step_option_errors(kwargs, error, match):
    ens = vmapens.Ensemble(models.MLP, N, seed=0)
    kwargs = dict(kwargs)
    torch_opt = kwargs.pop("optimizer", None) == "torch"
    opt = torch.optim.Adam(ens.parameters()) if torch_opt else vmapens.StackedAdam(ens)
    with pytest.raises(error, match=match):
        vmapens.make_step(ens, nn.MSELoss(), opt, **kwargs)
