"""Model surgery between and during training phases, against each member trained alone.

What plain PyTorch users do to a model and its optimizer between phases: freeze and unfreeze
layers (through the template, through `ens.parameters()`, between micro-batches, between
`backward` and `step`), replace a head, re-initialise with `ens.apply`, prune, add param
groups, change hyperparameters per member mid-run, pick members and go on training, unstack
and restack. The truth is plain PyTorch: `ens.unstack()` right after building gives each
member's initialisation; each is trained with its own `torch.optim` optimizer and the same
surgery. Every comparison is float64.
"""

from __future__ import annotations

import copy
import tempfile
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import prune
from truth import TOL64

import vmapens

N = 3
LRS = [0.01, 0.02, 0.03]
BACKENDS = [
    pytest.param({}, id="vmap"),
    pytest.param({"chunk_size": 2}, id="chunks"),
    pytest.param({"backend": "loop"}, id="loop"),
]

pytestmark = pytest.mark.usefixtures("float64_default")


class Net(nn.Module):
    """A body, a BatchNorm after the nonlinearity (no bias right before it, whose gradient is
    round-off) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)
        self.fc = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bn(torch.tanh(self.body(x))))


def _batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(k)
    return torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y)


def _built(**kw: Any) -> tuple[vmapens.Ensemble, list[nn.Module]]:
    ens = vmapens.Ensemble(Net, n=N, seeds=range(N), **kw)
    return ens, ens.unstack()


def _readme_step(ens: vmapens.Ensemble, opt: torch.optim.Optimizer, k: int) -> None:
    x, y = _batch(k)
    opt.zero_grad()
    vmapens.per_member(_loss)(ens(x), y).sum().backward()
    opt.step()


def _alone_step(plain: list[nn.Module], opts: list[torch.optim.Optimizer], k: int) -> None:
    x, y = _batch(k)
    for m, o in zip(plain, opts, strict=True):
        o.zero_grad()
        _loss(m(x), y).backward()
        o.step()


def _assert_members(ens: vmapens.Ensemble, plain: list[nn.Module]) -> None:
    for i, (got, m) in enumerate(zip(ens.state_dicts(), plain, strict=True)):
        truth = m.state_dict()
        assert list(got) == list(truth)
        for k, v in truth.items():
            torch.testing.assert_close(got[k], v, **TOL64, msg=f"member {i}, {k}")


def _assert_opt_state(opt: Any, opts: list[torch.optim.Optimizer], plain: list[nn.Module]) -> None:
    for i, (o, m) in enumerate(zip(opts, plain, strict=True)):
        mine = opt.member_state_dict(i, module=m)["state"]
        theirs = o.state_dict()["state"]
        assert sorted(mine) == sorted(theirs)
        for k in theirs:
            for name, v in theirs[k].items():
                torch.testing.assert_close(mine[k][name], v, **TOL64, msg=f"{i} {k} {name}")


@pytest.mark.parametrize("kw", BACKENDS)
def test_freeze_then_unfreeze_one_parameter_with_zero_grad_set_to_none_false(kw: dict) -> None:
    """Frozen through `ens.named_parameters()`, then one weight unfrozen through the template;
    `zero_grad(set_to_none=False)` keeps the frozen layer's zero gradients, which torch's Adam
    goes on stepping (its moments decay), as each member alone does."""
    ens, plain = _built(**kw)
    opt = vmapens.StackedAdam(ens, lr=LRS)
    opts = [torch.optim.Adam(m.parameters(), lr=lr) for m, lr in zip(plain, LRS)]
    for k in range(6):
        if k == 2:
            for name, p in ens.named_parameters():
                if name.startswith("body"):
                    p.requires_grad_(False)
            for m in plain:
                m.body.requires_grad_(False)
        if k == 4:
            ens.template.body.weight.requires_grad_(True)
            for m in plain:
                m.body.weight.requires_grad_(True)
        x, y = _batch(k)
        opt.zero_grad(set_to_none=False)
        vmapens.per_member(_loss)(ens(x), y).sum().backward()
        opt.step()
        for m, o in zip(plain, opts):
            o.zero_grad(set_to_none=False)
            _loss(m(x), y).backward()
            o.step()
    _assert_members(ens, plain)
    _assert_opt_state(opt, opts, plain)


@pytest.mark.parametrize("kw", BACKENDS)
@pytest.mark.parametrize("how", ["template", "stacked", "whole"])
def test_freeze_between_micro_batches_and_between_backward_and_step(kw: dict, how: str) -> None:
    """Gradient accumulation over two micro-batches; the head frozen after the first one's
    backward (its gradient so far is kept and stepped, as alone), the body frozen between the
    last backward and `step` (torch's optimizer steps any parameter that has a gradient)."""
    ens, plain = _built(**kw)
    opt = vmapens.StackedAdam(ens, lr=0.02)
    opts = [torch.optim.Adam(m.parameters(), lr=0.02) for m in plain]
    for k in range(4):
        x, y = _batch(k)
        opt.zero_grad(set_to_none=False)
        for o in opts:
            o.zero_grad(set_to_none=False)
        for rows in (slice(0, 4), slice(4, 8)):
            vmapens.per_member(_loss)(ens(x[rows]), y[rows]).sum().backward()
            for m in plain:
                _loss(m(x[rows]), y[rows]).backward()
            if k == 1 and rows.start == 0:
                if how == "template":
                    ens.template.fc.requires_grad_(False)
                elif how == "stacked":
                    ens.get_parameter("fc.weight").requires_grad_(False)
                    ens.get_parameter("fc.bias").requires_grad_(False)
                else:
                    ens.requires_grad_(False)
                    ens.template.body.requires_grad_(True)
                    ens.template.bn.requires_grad_(True)
                for m in plain:
                    m.fc.requires_grad_(False)
        if k == 2:
            if how == "template":
                ens.template.body.requires_grad_(False)
            else:
                ens.get_parameter("body.weight").requires_grad_(False)
                ens.get_parameter("body.bias").requires_grad_(False)
            for m in plain:
                m.body.requires_grad_(False)
        opt.step()
        for o in opts:
            o.step()
    _assert_members(ens, plain)


def _new_head(m: nn.Module) -> None:
    if isinstance(m, Net):
        m.fc = nn.Linear(6, 2)


@pytest.mark.parametrize("kw", BACKENDS)
def test_apply_replaces_the_head_mid_run_readme_loop(kw: dict) -> None:
    """`ens.apply` swapping in a fresh head (same class and shape): every member draws its new
    head from the global RNG as alone, and the optimizer made before holds the old head, which
    no gradient reaches: the new head stays where it was drawn, alone and here."""
    ens, plain = _built(**kw)
    opt = vmapens.StackedSGD(ens, lr=0.1, momentum=0.9)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in plain]
    _readme_step(ens, opt, 0)
    _alone_step(plain, opts, 0)
    torch.manual_seed(7)
    ens.apply(_new_head)
    torch.manual_seed(7)
    for m in plain:
        m.apply(_new_head)
    _assert_members(ens, plain)
    for k in (1, 2):
        _readme_step(ens, opt, k)
        _alone_step(plain, opts, k)
    _assert_members(ens, plain)


def _head_swap_run(kw: dict) -> None:
    """Phase 1: body frozen, optimizer over the rest. Phase 2: a new head (ens.apply), the
    body unfrozen, both added as param groups (the body with per-member lrs), the step made
    in phase 1 goes on. Phase 3: BatchNorm frozen (flags and eval mode)."""
    ens, plain = _built(**kw)
    ens.template.body.requires_grad_(False)
    for m in plain:
        m.body.requires_grad_(False)
    opt = vmapens.StackedAdam(
        [p for p in ens.parameters() if p.requires_grad], lr=LRS, weight_decay=0.1
    )
    opts = [
        torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=lr, weight_decay=0.1)
        for m, lr in zip(plain, LRS)
    ]
    step = vmapens.make_step(ens, _loss, opt)

    def both(k: int) -> None:
        step(*_batch(k))
        _alone_step(plain, opts, k)

    for k in range(2):
        both(k)
    torch.manual_seed(11)
    ens.apply(_new_head)
    torch.manual_seed(11)
    for m in plain:
        m.apply(_new_head)
    ens.template.body.requires_grad_(True)
    opt.add_param_group(
        {"params": [ens.get_parameter("fc.weight"), ens.get_parameter("fc.bias")], "lr": 0.05}
    )
    body = [ens.get_parameter("body.weight"), ens.get_parameter("body.bias")]
    opt.add_param_group({"params": body, "lr": [0.001, 0.002, 0.003]})
    for i, (m, o) in enumerate(zip(plain, opts)):
        m.body.requires_grad_(True)
        o.add_param_group({"params": [m.fc.weight, m.fc.bias], "lr": 0.05})
        o.add_param_group({"params": [m.body.weight, m.body.bias], "lr": 0.001 * (i + 1)})
    for k in range(2, 5):
        both(k)
    _assert_members(ens, plain)
    ens.template.bn.requires_grad_(False)
    ens.template.bn.eval()
    for m in plain:
        m.bn.requires_grad_(False)
        m.bn.eval()
    for k in range(5, 7):
        both(k)
    _assert_members(ens, plain)


@pytest.mark.parametrize("kw", [BACKENDS[0], BACKENDS[2]])
def test_make_step_goes_on_after_head_swap_unfreeze_and_add_param_group(kw: dict) -> None:
    _head_swap_run(kw)


# Fixed in session 46 (was a strict xfail).
def test_chunked_make_step_goes_on_after_head_swap() -> None:
    _head_swap_run({"chunk_size": 2})


# Fixed in session 46 (was a strict xfail).
def test_chunked_make_step_after_load_state_dict_assign() -> None:
    ens, plain = _built(chunk_size=2)
    opt = vmapens.StackedSGD(ens, lr=0.1)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in plain]
    step = vmapens.make_step(ens, _loss, opt)
    step(*_batch(0))
    _alone_step(plain, opts, 0)
    ens.load_state_dict({k: v.clone() for k, v in ens.state_dict().items()}, assign=True)
    for m in plain:
        m.load_state_dict({k: v.clone() for k, v in m.state_dict().items()}, assign=True)
    step(*_batch(1))
    _alone_step(plain, opts, 1)
    _assert_members(ens, plain)


# Fixed in session 46 (was a strict xfail).
def test_state_dicts_refuse_a_head_replaced_on_the_template() -> None:
    ens, _ = _built()
    ens.template.fc = nn.Linear(6, 2)
    with pytest.raises(ValueError, match="template.fc"):
        ens.state_dicts()
    with tempfile.TemporaryDirectory() as d, pytest.raises(ValueError, match="template.fc"):
        vmapens.save_members(ens, d)


def test_a_head_replaced_on_the_template_is_refused_at_the_next_call() -> None:
    ens, _ = _built()
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    built = ens.template.fc
    ens.template.fc = nn.Linear(6, 2)
    with pytest.raises(ValueError, match="template.fc"):
        ens(_batch(0)[0])
    with pytest.raises(ValueError, match="template.fc"):
        vmapens.make_step(ens, _loss, vmapens.StackedSGD(ens, lr=0.1))(*_batch(0))
    ens.template.fc = built  # as the error says: the built one back
    after = ens.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("kw", BACKENDS)
def test_apply_reinitialises_mid_run_and_adam_keeps_its_moments(kw: dict) -> None:
    def init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.kaiming_normal_(m.weight)
            nn.init.uniform_(m.bias, -0.1, 0.1)

    ens, plain = _built(**kw)
    opt = vmapens.StackedAdam(ens, lr=0.02)
    opts = [torch.optim.Adam(m.parameters(), lr=0.02) for m in plain]
    for k in range(2):
        _readme_step(ens, opt, k)
        _alone_step(plain, opts, k)
    torch.manual_seed(3)
    ens.apply(init)
    torch.manual_seed(3)
    for m in plain:
        m.apply(init)
    for k in range(2, 4):
        _readme_step(ens, opt, k)
        _alone_step(plain, opts, k)
    _assert_members(ens, plain)
    _assert_opt_state(opt, opts, plain)


def test_prune_through_apply_is_refused_and_changes_nothing() -> None:
    ens, _ = _built()
    opt = vmapens.StackedAdam(ens, lr=0.05)
    _readme_step(ens, opt, 0)
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    with pytest.raises(ValueError, match="body.weight"):
        ens.apply(
            lambda m: prune.l1_unstructured(m, "weight", 0.4) if isinstance(m, nn.Linear) else None
        )
    after = ens.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("kw", BACKENDS)
def test_members_pruned_twice_then_stacked_train_as_alone(kw: dict) -> None:
    """Iterative magnitude pruning (a PruningContainer) on the members, then
    `from_modules` and make_step with Adam and weight decay: masks, `weight_orig` and the
    computed weight as alone (the plain module's `weight` attribute is the one its last
    forward computed, so compare after a forward)."""
    _, plain = _built()
    for amount in (0.4, 0.3):
        for m in plain:
            for layer in (m.body, m.fc):
                prune.l1_unstructured(layer, "weight", amount=amount)
    ens = vmapens.Ensemble.from_modules(plain, **kw)
    opt = vmapens.StackedAdam(ens, lr=0.05, weight_decay=0.1)
    opts = [torch.optim.Adam(m.parameters(), lr=0.05, weight_decay=0.1) for m in plain]
    step = vmapens.make_step(ens, _loss, opt)
    for k in range(4):
        step(*_batch(k))
        _alone_step(plain, opts, k)
    _assert_members(ens, plain)
    x = _batch(9)[0]
    for i, m in enumerate(plain):
        m(x)
        torch.testing.assert_close(ens[i].fc.weight, m.fc.weight, **TOL64)
        assert int((ens[i].fc.weight == 0).sum()) == int((m.fc.weight == 0).sum())


@pytest.mark.parametrize(
    "moms",
    [
        [0.9, 0.0, 0.9],
        [0.9, [0.0, 0.9, 0.5], 0.9],
        [[0.0, 0.9, 0.5], [0.9, 0.0, 0.5]],
    ],
    ids=["off-on", "one-member-off", "per-member-swap"],
)
def test_sgd_momentum_switched_per_member_mid_run(moms: list) -> None:
    """torch's SGD makes a member's momentum buffer at its first step with momentum (the
    gradient itself, no dampening) and leaves a stale one untouched while momentum is 0."""

    def value(m: Any, i: int) -> float:
        return m[i] if isinstance(m, list) else m

    ens, plain = _built()
    opt = vmapens.StackedSGD(ens, lr=0.1, momentum=moms[0], dampening=0.1)
    opts = [
        torch.optim.SGD(m.parameters(), lr=0.1, momentum=value(moms[0], i), dampening=0.1)
        for i, m in enumerate(plain)
    ]
    for k in range(2 * len(moms)):
        if k % 2 == 0 and k > 0:
            mom = moms[k // 2]
            opt.param_groups[0]["momentum"] = (
                vmapens.optim.MemberValues(mom) if isinstance(mom, list) else mom
            )
            for i, o in enumerate(opts):
                o.param_groups[0]["momentum"] = value(mom, i)
        _readme_step(ens, opt, k)
        _alone_step(plain, opts, k)
    _assert_members(ens, plain)


@pytest.mark.parametrize(
    "key,stacked,alone",
    [
        # float32 tensors (made at import): each member alone gets its element's float value
        ("lr", torch.tensor([0.05, 0.002, 0.01]), torch.tensor([0.05, 0.002, 0.01]).tolist()),
        ("weight_decay", torch.tensor([0.5, 0.0, 0.1]), torch.tensor([0.5, 0.0, 0.1]).tolist()),
        (
            "betas",
            (0.8, vmapens.optim.MemberValues([0.9, 0.99, 0.95])),
            [(0.8, 0.9), (0.8, 0.99), (0.8, 0.95)],
        ),
        ("eps", vmapens.optim.MemberValues([1e-3, 1e-8, 1e-1]), [1e-3, 1e-8, 1e-1]),
        ("decoupled_weight_decay", True, [True] * N),
        ("maximize", True, [True] * N),
    ],
)
def test_adam_hyperparameters_set_per_member_mid_run(key: str, stacked: Any, alone: list) -> None:
    ens, plain = _built()
    opt = vmapens.StackedAdam(ens, lr=LRS, weight_decay=0.05)
    opts = [torch.optim.Adam(m.parameters(), lr=lr, weight_decay=0.05) for m, lr in zip(plain, LRS)]
    for k in range(5):
        if k == 2:
            opt.param_groups[0][key] = stacked
            for o, v in zip(opts, alone):
                o.param_groups[0][key] = v
        _readme_step(ens, opt, k)
        _alone_step(plain, opts, k)
    _assert_members(ens, plain)


def test_a_list_hyperparameter_set_mid_run_is_refused_and_changes_nothing() -> None:
    ens, _ = _built()
    opt = vmapens.StackedAdam(ens, lr=LRS)
    _readme_step(ens, opt, 0)
    opt.param_groups[0]["lr"] = [0.1, 0.2, 0.3]
    x, y = _batch(1)
    opt.zero_grad()
    vmapens.per_member(_loss)(ens(x), y).sum().backward()
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    state = copy.deepcopy(opt.state_dict()["state"])
    with pytest.raises(TypeError, match="MemberValues"):
        opt.step()
    assert all(torch.equal(before[k], v) for k, v in ens.state_dict().items())
    after = opt.state_dict()["state"]
    assert all(torch.equal(state[i][s], after[i][s]) for i in state for s in state[i])


@pytest.mark.parametrize(
    "rows,plain_rows",
    [
        (torch.tensor([2, 0]), [2, 0]),
        (torch.tensor([True, False, True]), [0, 2]),
        ([-1, 0], [2, 0]),
        ([1, 1], [1, 1]),
    ],
    ids=["tensor", "mask", "negative", "repeated"],
)
def test_indexing_then_optimizer_select_goes_on_as_alone(rows: Any, plain_rows: list) -> None:
    """Param groups (no decay on biases and norms), per-member lr, decay and beta2, three
    steps, then `ens[rows]` and `opt.select(rows, sub)` go on for three more."""
    wd, b2 = [0.1, 0.2, 0.3], [0.99, 0.995, 0.999]

    def groups(named: list) -> list[dict]:
        return [
            {"params": [p for n, p in named if n.endswith("weight") and not n.startswith("bn")]},
            {"params": [p for n, p in named if n.endswith("bias") or n.startswith("bn")],
             "weight_decay": 0.0},
        ]  # fmt: skip

    ens, plain = _built()
    opt = vmapens.StackedAdam(groups(list(ens.named_parameters())), lr=LRS, weight_decay=wd,
                              betas=(0.9, b2))  # fmt: skip
    opts = [
        torch.optim.Adam(
            groups(list(m.named_parameters())), lr=LRS[i], weight_decay=wd[i], betas=(0.9, b2[i])
        )  # fmt: skip
        for i, m in enumerate(plain)
    ]
    for k in range(3):
        _readme_step(ens, opt, k)
        _alone_step(plain, opts, k)
    sub = ens[rows]
    sub_opt = opt.select(rows, sub)
    kept = [copy.deepcopy(plain[r]) for r in plain_rows]
    kept_opts = []
    for r, m in zip(plain_rows, kept):
        o = torch.optim.Adam(groups(list(m.named_parameters())), lr=LRS[r], weight_decay=wd[r],
                             betas=(0.9, b2[r]))  # fmt: skip
        o.load_state_dict(copy.deepcopy(opts[r].state_dict()))  # torch's load shares tensors
        kept_opts.append(o)
    for k in range(3, 6):
        _readme_step(sub, sub_opt, k)
        _alone_step(kept, kept_opts, k)
    _assert_members(sub, kept)


@pytest.mark.parametrize("kw", BACKENDS)
def test_best_k_of_a_frozen_backbone_then_unfreeze_it(kw: dict) -> None:
    ens, plain = _built(**kw)
    ens.template.body.requires_grad_(False)
    ens.template.bn.eval()
    for m in plain:
        m.body.requires_grad_(False)
        m.bn.eval()

    def held(named: list) -> list[dict]:
        return [
            {"params": [p for n, p in named if n.startswith("fc")], "weight_decay": 0.0},
            {"params": [p for n, p in named if n.startswith("bn")]},
        ]

    wd = [0.1, 0.2, 0.3]
    opt = vmapens.StackedAdam(held(list(ens.named_parameters())), lr=LRS, weight_decay=wd)
    opts = [
        torch.optim.Adam(held(list(m.named_parameters())), lr=LRS[i], weight_decay=wd[i])
        for i, m in enumerate(plain)
    ]
    step = vmapens.make_step(ens, _loss, opt)
    for k in range(3):
        step(*_batch(k))
        _alone_step(plain, opts, k)
    sub, sub_opt = vmapens.selection.best_k(ens, torch.tensor([0.3, 0.1, 0.2]), 2, optimizer=opt)
    assert [p.requires_grad for p in sub.parameters()] == [False, False, True, True, True, True]
    assert not sub.template.bn.training
    kept = [copy.deepcopy(plain[r]) for r in (1, 2)]
    kept_opts = []
    for r, m in zip((1, 2), kept):
        o = torch.optim.Adam(held(list(m.named_parameters())), lr=LRS[r], weight_decay=wd[r])
        o.load_state_dict(copy.deepcopy(opts[r].state_dict()))
        kept_opts.append(o)
    sub.template.body.requires_grad_(True)
    sub_opt.add_param_group(
        {"params": [sub.get_parameter("body.weight"), sub.get_parameter("body.bias")], "lr": 1e-3}
    )
    for m, o in zip(kept, kept_opts):
        m.body.requires_grad_(True)
        o.add_param_group({"params": [m.body.weight, m.body.bias], "lr": 1e-3})
    step2 = vmapens.make_step(sub, _loss, sub_opt)
    for k in range(3, 6):
        step2(*_batch(k))
        _alone_step(kept, kept_opts, k)
    _assert_members(sub, kept)


@pytest.mark.parametrize("kw", BACKENDS)
def test_unstack_restack_and_load_the_optimizer_of_a_frozen_run(kw: dict) -> None:
    ens, plain = _built(**kw)
    ens.template.body.requires_grad_(False)
    for m in plain:
        m.body.requires_grad_(False)
    opt = vmapens.StackedAdam([p for p in ens.parameters() if p.requires_grad], lr=LRS)
    opts = [
        torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=lr)
        for m, lr in zip(plain, LRS)
    ]
    for k in range(3):
        _readme_step(ens, opt, k)
        _alone_step(plain, opts, k)
    again = vmapens.Ensemble.from_modules(ens.unstack(), **kw)
    assert [p.requires_grad for p in again.parameters()] == [False, False, True, True, True, True]
    opt2 = vmapens.StackedAdam([p for p in again.parameters() if p.requires_grad], lr=0.5)
    opt2.load_state_dict(opt.state_dict())
    for k in range(3, 6):
        _readme_step(again, opt2, k)
        _alone_step(plain, opts, k)
    _assert_members(again, plain)
    _assert_opt_state(opt2, opts, plain)


@pytest.mark.parametrize("kw", BACKENDS)
def test_fit_in_two_phases_frozen_body_then_frozen_batchnorm(kw: dict) -> None:
    batches = [_batch(k) for k in range(4)]
    ens, plain = _built(**kw)
    ens.template.body.requires_grad_(False)
    for m in plain:
        m.body.requires_grad_(False)
    vmapens.fit(ens, batches, _loss, epochs=1, progress=False, lr=LRS, shuffle=False)
    opts = [torch.optim.Adam(m.parameters(), lr=lr) for m, lr in zip(plain, LRS)]
    for k in range(4):
        _alone_step(plain, opts, k)
    _assert_members(ens, plain)
    ens.template.body.requires_grad_(True)
    ens.template.bn.eval()
    for m in plain:
        m.body.requires_grad_(True)
        m.bn.eval()
    opt = vmapens.StackedSGD(ens, lr=0.05, momentum=0.9)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in plain]
    vmapens.fit(ens, batches, _loss, epochs=2, progress=False, optimizer=opt, shuffle=False)
    for _ in range(2):
        for k in range(4):
            _alone_step(plain, opts, k)
    _assert_members(ens, plain)
    assert not ens.template.bn.training


@pytest.mark.parametrize("kw", BACKENDS)
def test_batchnorm_frozen_in_eval_then_whole_model_train_again(kw: dict) -> None:
    ens, plain = _built(**kw)
    opt = vmapens.StackedAdam(ens, lr=0.02)
    opts = [torch.optim.Adam(m.parameters(), lr=0.02) for m in plain]
    for k in range(6):
        if k == 2:
            ens.template.bn.eval()
            for m in plain:
                m.bn.eval()
        if k == 4:
            ens.train()
            for m in plain:
                m.train()
            assert ens.template.bn.training and ens[0].bn.training
        _readme_step(ens, opt, k)
        _alone_step(plain, opts, k)
    _assert_members(ens, plain)


def test_load_state_dict_assign_keeps_the_frozen_flags() -> None:
    ens, plain = _built()
    ens.template.fc.requires_grad_(False)
    ens.load_state_dict({k: v.clone() for k, v in ens.state_dict().items()}, assign=True)
    for m, sd in zip(plain, ens.state_dicts()):
        m.fc.requires_grad_(False)
        m.load_state_dict({k: v.clone() for k, v in sd.items()}, assign=True)
    assert [p.requires_grad for p in ens.parameters()] == [
        p.requires_grad for p in plain[0].parameters()
    ]
