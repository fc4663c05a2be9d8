"""An attribute set on ``ens.template`` after building changes what the members run, as it
changes a plain module's next forward: BatchNorm's ``momentum`` (``None`` included) and ``eps``,
dropout's ``p``, a user attribute the forward reads. The ensemble runs copies of the template
(``ens.runner``, the padded sizes' templates); before this was followed they kept the values
they were built with, silently. Truth: the same edits on N plain modules trained alone."""

from __future__ import annotations

import copy
import functools
import pickle
from collections.abc import Callable

import pytest
import torch
import truth
from torch import nn

import vmapens

N, STEPS = 3, 6


class Net(nn.Module):
    def __init__(self, hidden: int = 4) -> None:
        super().__init__()
        self.fc = nn.Linear(3, hidden)
        self.bn = nn.BatchNorm1d(hidden)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(hidden, 2)
        self.temperature = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(torch.tanh(self.bn(self.fc(x))))) / self.temperature


def _set(path: str, value: object) -> Callable[[nn.Module], None]:
    def edit(m: nn.Module) -> None:
        owner, _, name = path.rpartition(".")
        setattr(m.get_submodule(owner) if owner else m, name, value)

    return edit


# Step k's edits, made before step k on the template and on every plain module. Dropout's
# p goes to 0 first, so that the members' results do not depend on random streams.
EDITS: dict[int, list[Callable[[nn.Module], None]]] = {
    0: [_set("drop.p", 0.0)],
    1: [_set("bn.momentum", 0.5)],
    2: [_set("temperature", 2.0), _set("bn.eps", 1e-3)],
    3: [_set("bn.momentum", None)],  # torch's cumulative average: another class in the runner
    5: [_set("bn.momentum", 0.1)],
}


def _batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return truth.float64_batches(steps, rows=8, inputs=3, outputs=2)


def _train_alone(models: list[nn.Module], batches: list) -> None:
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    for k, (x, y) in enumerate(batches):
        for m, opt in zip(models, opts, strict=True):
            for edit in EDITS.get(k, []):
                edit(m)
            opt.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()


def _train_ensemble(ens: vmapens.Ensemble, batches: list) -> None:
    opt = vmapens.StackedSGD(ens, lr=0.1, momentum=0.9)
    step = vmapens.make_step(ens, nn.MSELoss(), opt)
    for k, (x, y) in enumerate(batches):
        for edit in EDITS.get(k, []):
            edit(ens.template)
        step(x, y)


def _members(n: int = N) -> list[nn.Module]:
    return [m.double() for m in truth.seeded_members(Net, n)]


def _assert_eval_outputs_equal(ens: vmapens.Ensemble, models: list[nn.Module]) -> None:
    x = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    ens.eval()
    out = ens(x)
    for i, m in enumerate(models):
        m.eval()
        torch.testing.assert_close(out[i], m(x), **truth.TOL64)


@pytest.mark.parametrize("backend", ["vmap", "loop"])
def test_attributes_set_on_the_template_train_as_on_each_member(backend: str) -> None:
    models = _members()
    ens = vmapens.Ensemble.from_modules(truth.twins(models), backend=backend)
    batches = _batches()
    _train_ensemble(ens, batches)
    _train_alone(models, batches)
    truth.assert_members_equal(ens, models)
    _assert_eval_outputs_equal(ens, models)
    assert ens[0].bn.momentum == 0.1 and ens[0].temperature == 2.0  # the members show them


def test_members_of_different_sizes_follow_and_keep_their_sizes() -> None:
    factories = [functools.partial(Net, h) for h in (260, 300, 280)]  # ints Python does not cache
    ens = vmapens.Ensemble.from_factories(factories, seed=0)
    models = []
    for i, f in enumerate(factories):
        torch.manual_seed(vmapens.seeds.member_seed(0, i))
        models.append(f().double())
    ens.double()
    batches = _batches()
    _train_ensemble(ens, batches)
    _train_alone(models, batches)
    # An equal value in another object (300 again, not cached): the other sizes keep theirs.
    ens.template.fc.out_features = int(str(ens.template.fc.out_features))
    _assert_eval_outputs_equal(ens, models)  # a call in eval mode: followed
    for i, m in enumerate(models):
        member = ens[i]
        assert member.fc.out_features == m.fc.out_features  # sizes are not the template's
        assert (member.bn.eps, member.bn.momentum, member.drop.p) == (1e-3, 0.1, 0.0)
        for name, t in m.state_dict().items():
            torch.testing.assert_close(member.state_dict()[name], t, **truth.TOL64, msg=name)


@pytest.mark.parametrize("how", ["select", "deepcopy", "pickle"])
def test_a_copy_follows_its_own_template_only(how: str) -> None:
    models = _members()
    ens = vmapens.Ensemble.from_modules(truth.twins(models))
    ens.template.temperature = 4.0  # followed into the copy too
    copies = {
        "select": lambda e: e[[0, 1, 2]],
        "deepcopy": copy.deepcopy,
        "pickle": lambda e: pickle.loads(pickle.dumps(e)),
    }
    other = copies[how](ens)
    other.template.bn.eps = 0.5
    x = torch.randn(4, 3, dtype=torch.float64)
    ens.eval(), other.eval()
    for m in models:
        m.temperature = 4.0
        m.eval()
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in models]), **truth.TOL64)
    for m in models:
        m.bn.eps = 0.5
    torch.testing.assert_close(other(x), torch.stack([m(x) for m in models]), **truth.TOL64)
    other.template.bn.eps = 1e-5  # the value it was built with: followed back
    for m in models:
        m.bn.eps = 1e-5
    torch.testing.assert_close(other(x), torch.stack([m(x) for m in models]), **truth.TOL64)


def test_an_attribute_added_then_deleted_on_the_template_is_followed() -> None:
    class Shift(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) + getattr(self, "shift", 0.0)

    ens = vmapens.Ensemble(Shift, 2, seed=0)
    x = torch.randn(4, 3)
    base = ens(x)
    ens.template.shift = 3.0
    torch.testing.assert_close(ens(x), base + 3.0)
    del ens.template.shift
    torch.testing.assert_close(ens(x), base)


class Aux(nn.Module):
    """A head used only when a flag says so: which parameters get a gradient changes with it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(3, 4)
        self.head = nn.Linear(4, 2)
        self.extra = nn.Linear(4, 2)
        self.aux = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        return self.head(h) + self.extra(h) if self.aux else self.head(h)


def test_the_compiled_step_trains_a_head_a_template_flag_switches_on() -> None:
    # The runner follows the flag, dynamo guards on it and compiles anew, and the step finds
    # anew which parameters get a gradient (it had kept the parts of the head-off graph).
    models = [m.double() for m in truth.seeded_members(Aux, 2)]
    ens = vmapens.Ensemble.from_modules(truth.twins(models))
    opt = vmapens.StackedSGD(ens, lr=0.1)
    step = vmapens.make_step(ens, nn.MSELoss(), opt, compile=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    for k, (x, y) in enumerate(_batches(3)):
        aux = k > 0
        ens.template.aux = aux
        step(x, y)
        for m, o in zip(models, opts, strict=True):
            m.aux = aux
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
    truth.assert_members_equal(ens, models)


def _conv() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Dropout(0.4),
        nn.Linear(12, 2),
    )  # fmt: skip


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(3, 4, num_layers=2, dropout=0.3, batch_first=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(x)[0][:, -1])


def _encoder() -> nn.Module:
    return nn.TransformerEncoderLayer(4, 2, dim_feedforward=6, dropout=0.2, batch_first=True)


# Per kind: the input, and edits a user makes between steps. Before the first step every
# dropout is switched off on the template and the members, an edit too (train mode's random
# streams are not compared here).
KINDS = {
    "cnn": (lambda g: torch.randn(5, 1, 4, 4, generator=g, dtype=torch.float64), _conv, [
        _set("1.momentum", None), _set("1.eps", 0.1), _set("1.momentum", 0.7),
    ]),
    "gru": (lambda g: torch.randn(5, 3, 3, generator=g, dtype=torch.float64), _Recurrent, [
        _set("gru.batch_first", False), _set("gru.batch_first", True),
    ]),
    "encoder": (lambda g: torch.randn(5, 3, 4, generator=g, dtype=torch.float64), _encoder, [
        _set("norm_first", True),
        _set("activation", nn.functional.gelu), _set("norm1.eps", 0.5),
    ]),
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_real_members_follow_edits_between_steps(kind: str) -> None:
    make_input, factory, edits = KINDS[kind]
    models = [m.double() for m in truth.seeded_members(factory, 2)]
    ens = vmapens.Ensemble.from_modules(truth.twins(models))
    opt = vmapens.StackedSGD(ens, lr=0.05, momentum=0.5)
    step = vmapens.make_step(ens, nn.MSELoss(), opt)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.5) for m in models]
    g = torch.Generator().manual_seed(1)
    for k in range(len(edits) + 1):
        x = make_input(g)
        y = torch.randn(*((x.shape[0], 2) if kind != "encoder" else x.shape), generator=g,
                        dtype=torch.float64)  # fmt: skip
        if k:
            for m in (ens.template, *models):
                edits[k - 1](m)
        else:
            for m in (ens.template, *models):
                for sub in m.modules():  # no dropout at all on the first step
                    if isinstance(sub, nn.Dropout):
                        sub.p = 0.0
                    if isinstance(sub, (nn.GRU, nn.MultiheadAttention)):
                        sub.dropout = 0.0
        step(x, y)
        for m, o in zip(models, opts, strict=True):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
    truth.assert_members_equal(ens, models)
    _assert_eval_outputs_equal_on(ens, models, make_input(g))


def _assert_eval_outputs_equal_on(ens: vmapens.Ensemble, models: list, x: torch.Tensor) -> None:
    ens.eval()
    out = ens(x)
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m.eval()(x), **truth.TOL64)


@pytest.mark.parametrize("how", ["assign", "overwrite_on_conversion"])
def test_an_edit_before_the_storage_is_replaced_is_kept(how: str) -> None:
    # Replacing the storage pairs the template with its copies anew: an edit made since the
    # last call must reach the copies first, or the new pairing would take it as seen.
    models = _members(2)
    ens = vmapens.Ensemble.from_modules(truth.twins(models))
    ens.template.temperature = 3.0
    if how == "assign":
        ens.load_state_dict(ens.state_dict(), assign=True)
    else:
        torch.__future__.set_overwrite_module_params_on_conversion(True)
        try:
            ens.double()
        finally:
            torch.__future__.set_overwrite_module_params_on_conversion(False)
    x = torch.randn(4, 3, dtype=torch.float64)
    ens.eval()
    for m in models:
        m.temperature = 3.0
    torch.testing.assert_close(ens(x), torch.stack([m.eval()(x) for m in models]), **truth.TOL64)
